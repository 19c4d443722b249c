"""Training traces for compression heads, built from GSM8K ``train.jsonl``: each row's
worked solution (its ``<<expr=value>>`` calculator annotations removed, or only those
equations with ``style="equations"``, the iCoT form) is the reasoning the head learns to
compress; the number after ``####`` is the answer.

A trace is the token sequence the served closed loop replaces: ``prompt`` (the chat
template's rendering of the question, then the thinking opening, exactly the ids the engine
prefills) + ``reasoning`` (compressed into latent steps) + ``close`` (the thinking closing,
forced by the engine) + ``answer``.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

# Thinking-span text for a backbone without <think> tokens (SmolLM2): the closing leads the
# frozen model into stating the answer.
THINK_OPEN = "Let me think step by step."
THINK_CLOSE = "\nThe answer is"
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


def chat_prompt_ids(tokenizer, question: str, instruction: str | None = None) -> list[int]:
    """The chat template's rendering of one user turn (``question``, then ``instruction``
    on a new line when given) with the assistant turn opened; plain ids when the tokenizer
    has no chat template."""
    text = question if not instruction else f"{question}\n{instruction}"
    if getattr(tokenizer, "chat_template", None):
        out = tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                            add_generation_prompt=True, tokenize=True)
        return list(out["input_ids"] if hasattr(out, "keys") else out)
    return list(tokenizer.encode(text))


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
    """``path``, else GSM8K ``train.jsonl`` under ``eval.datasets.data_root()``."""
    if path:
        return Path(path)
    from latentserve.eval.datasets import data_root

    return data_root() / "gsm8k" / "train.jsonl"


def load_gsm8k_rows(path: str | Path, limit: int | None = None) -> list[dict]:
    """``{"question", "answer"}`` rows of a GSM8K jsonl file (the first ``limit``).
    Raises FileNotFoundError naming the file; ValueError naming the file and line when a
    line is not a JSON object with string ``question`` and ``answer``."""
    if not Path(path).is_file():
        raise FileNotFoundError(f"training data {path} does not exist")
    rows = []
    with open(path, encoding="utf-8", errors="strict") as f:
        for n, line in enumerate(f, 1):
            if line.strip():
                try:
                    row = json.loads(line)
                    ok = all(isinstance(row.get(k), str) for k in ("question", "answer"))
                except (ValueError, AttributeError):
                    ok = False
                if not ok:
                    raise ValueError(f"{path}:{n}: not a GSM8K jsonl line (a JSON object "
                                     "with string 'question' and 'answer')")
                rows.append(row)
            if limit is not None and len(rows) >= limit:
                break
    return rows


def build_traces(tokenizer, rows: list[dict], think_open: str = THINK_OPEN,
                 think_close: str = THINK_CLOSE, style: str = "solution",
                 max_reasoning_tokens: int = 256) -> list[Trace]:
    """Tokenised traces of GSM8K ``rows``. Rows whose reasoning is empty or longer than
    ``max_reasoning_tokens`` tokens are skipped (the stop label needs the end in window)."""
    open_ids = tokenizer.encode(think_open, add_special_tokens=False)
    close_ids = tokenizer.encode(think_close, add_special_tokens=False)
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    out = []
    for row in rows:
        reasoning = reasoning_text(row["answer"], style)
        gold = row["answer"].rpartition("####")[2].strip()
        r_ids = tokenizer.encode("\n" + reasoning, add_special_tokens=False)
        if not reasoning or not r_ids or len(r_ids) > max_reasoning_tokens:
            continue
        prompt = chat_prompt_ids(tokenizer, row["question"]) + open_ids
        out.append(Trace(prompt, r_ids, close_ids,
                         tokenizer.encode(f" {gold}.", add_special_tokens=False) + eos))
    return out
