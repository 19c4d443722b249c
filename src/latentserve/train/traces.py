"""Training traces for compression heads, in one of two prompt formats.

Design notes: docs/internals.md, "latentserve.train.traces".
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from latentserve.eval.datasets import Item, chat_prompt_ids, find_data_file

# Thinking-span text for a backbone without <think> tokens (SmolLM2): the closing leads the
# frozen model into stating the answer.
THINK_OPEN = "Let me think step by step."
THINK_CLOSE = "\nThe answer is"
# CoLaR's format: the prompt already ends with the opening separator; the closing is "###".
COLAR_OPEN, COLAR_CLOSE = "", "###"
PROMPT_FORMATS = ("chat", "colar")
_CALC = re.compile(r"<<([^>]*)>>")


@dataclass(frozen=True, slots=True)
class Trace:
    """Token ids of one training example (see the module docstring)."""

    prompt: list[int]
    reasoning: list[int]
    close: list[int]
    answer: list[int]

    @property
    def ids(self) -> list[int]:
        return self.prompt + self.reasoning + self.close + self.answer


def reasoning_text(solution: str, style: str = "solution") -> str:
    """The reasoning of a GSM8K answer field (the part before ``####``): ``solution`` =
    the worked text without ``<<...>>`` annotations; ``equations`` = the annotations only,
    space separated (``<<48/2=24>> <<48+24=72>>``). Raises ValueError for another style."""
    body = solution.rpartition("####")[0] if "####" in solution else solution
    if style == "solution":
        return _CALC.sub("", body).strip()
    if style == "equations":
        return " ".join(f"<<{e}>>" for e in _CALC.findall(body))
    raise ValueError(f"style must be 'solution' or 'equations', got {style!r}")


def train_file(path: str | Path | None) -> Path:
    """``path``, else GSM8K ``train.jsonl`` under ``$LATENTSERVE_DATA``. FileNotFoundError
    saying where to get it."""
    if path:
        return Path(path)
    return find_data_file("gsm8k/train.jsonl", flag="--data FILE")


def build_traces(tokenizer, items: list[Item], think_open: str = THINK_OPEN,
                 think_close: str = THINK_CLOSE, style: str = "solution",
                 max_reasoning_tokens: int = 256) -> list[Trace]:
    """Tokenised traces of GSM8K ``items`` (``datasets.parse_file``'s ``jsonl``). Items whose
    reasoning is empty or longer than ``max_reasoning_tokens`` tokens are skipped (the stop
    label needs the end in window)."""
    open_ids = tokenizer.encode(think_open, add_special_tokens=False)
    close_ids = tokenizer.encode(think_close, add_special_tokens=False)
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    out = []
    for it in items:
        reasoning = reasoning_text(it.steps, style)
        r_ids = tokenizer.encode("\n" + reasoning, add_special_tokens=False)
        if not reasoning or not r_ids or len(r_ids) > max_reasoning_tokens:
            continue
        prompt = chat_prompt_ids(tokenizer, it.question) + open_ids
        out.append(Trace(prompt, r_ids, close_ids,
                         tokenizer.encode(f" {it.gold}.", add_special_tokens=False) + eos))
    return out


def build_colar_traces(tokenizer, items, max_reasoning_tokens: int = 256) -> list[Trace]:
    """``colar``-format traces of ``items``, skipping empty steps or more than
    ``max_reasoning_tokens``."""
    from latentserve.train.cot import encode_parts

    out = []
    for prompt, steps, tail in encode_parts(tokenizer, items):  # tail = [###, answer, EOS]
        if steps and len(steps) <= max_reasoning_tokens:
            out.append(Trace(prompt + tail[:1], steps, tail[:1], tail[1:]))
    return out

