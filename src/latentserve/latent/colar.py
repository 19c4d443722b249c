"""CoLaR (arXiv 2505.16552, xiaomi-research/colar): the prompt format its models are trained
and served with.

A CoLaR example is ``question`` + ``speed`` + ``###`` + reasoning + ``###`` + ``Answer:`` +
answer + EOS (upstream ``model_base.py`` templates: ``"Question: {} Let's think step by
step:"``, ``"(Thinking speed: {})"``, separator ``"###"``, ``"Answer:{}"``). At speed 1 the
reasoning is text (the chain-of-thought model of stage 0, upstream ``cot.py``); at speed
``c`` it is ``ceil(n / c)`` latent steps, each standing for ``c`` reasoning tokens, and the
phase ends when the LM head emits the separator at a latent position.
"""

from __future__ import annotations

QUESTION = "Question: {} Let's think step by step:"
SPEED = "(Thinking speed: {})"
SEPARATOR = "###"
ANSWER = "Answer:{}"


def prompt_text(question: str, speed: int | str = 1) -> str:
    """The prompt a CoLaR model continues: question, thinking speed and the opening
    separator (upstream ``latent_generate``'s question part)."""
    return QUESTION.format(question) + SPEED.format(speed) + SEPARATOR


def split_output(text: str) -> tuple[str, str]:
    """``(reasoning, answer)`` of a generated continuation: the text before the closing
    separator, and what follows ``Answer:`` after it (stripped). Without a separator the
    reasoning is the whole text; without ``Answer:`` the answer is what follows the
    separator (upstream ``extract_answer_from_output`` keeps the whole string then)."""
    reasoning, sep, rest = text.partition(SEPARATOR)
    if not sep:
        return text, ""
    prefix = ANSWER.format("")
    return reasoning, (rest.partition(prefix)[2] if prefix in rest else rest).strip()
