"""Training data for the reasoning tasks: k x k multiplication in the iCoT format and GSM8K
train with its calculator steps as the chain of thought.

Design notes: docs/internals.md, "latentserve.train.tasks".
"""

from __future__ import annotations

import random
from collections.abc import Iterable
from pathlib import Path

from latentserve.eval.datasets import Item, parse_file
from latentserve.train.traces import reasoning_text


def digits(n: int, width: int) -> str:
    """``n`` as ``width`` space-separated digits, least significant first. Raises
    ValueError when ``n`` needs more digits."""
    s = str(n)
    if n < 0 or len(s) > width:
        raise ValueError(f"{n} does not fit in {width} digits")
    return " ".join(reversed(s.zfill(width)))


def multiplication_item(a: int, b: int, k: int) -> Item:
    """The iCoT item for ``a * b`` (both k-digit numbers): question, partial-product steps,
    product (``Item.kind`` ``"digits"``)."""
    lo, hi = 10 ** (k - 1), 10 ** k
    if not (lo <= a < hi and lo <= b < hi):
        raise ValueError(f"operands must have {k} digits, got {a} and {b}")
    parts, total = [], 0
    for i, d in enumerate(reversed(str(b))):
        p = a * int(d) * 10 ** i
        total += p
        part = digits(p, k + 1 + i)
        if 0 < i < k - 1:
            part += f" ( {digits(total, k + 1 + i)} )"
        parts.append(part)
    question = f"{digits(a, k)} * {digits(b, k)}"
    return Item(question, digits(a * b, 2 * k), "digits", " + ".join(parts))


def icot_line(item: Item) -> str:
    """``item`` as one line of the iCoT text format (``question||steps #### answer``)."""
    return f"{item.question}||{item.steps} #### {item.gold}"


def generate_multiplication(k: int, n: int, seed: int = 0,
                            exclude: Iterable[str] = ()) -> list[Item]:
    """``n`` distinct random k x k items whose question is not in ``exclude`` (questions as
    iCoT writes them; ``k >= 1``, ``n >= 0``: ``data multiplication`` checks them). Raises
    ValueError when ``n`` is more than half of the questions not in ``exclude`` (drawing
    more would slow to a crawl)."""
    lo, hi = 10 ** (k - 1), 10 ** k
    seen = set(exclude)
    left = (hi - lo) ** 2 - len(seen)  # at least this many questions are not excluded
    if n > left // 2:
        raise ValueError(f"n={n} is more than half of the {(hi - lo) ** 2} {k}x{k} questions "
                         f"less the {len(seen)} excluded ({max(left, 0)})")
    rng = random.Random(seed)
    out = []
    while len(out) < n:
        it = multiplication_item(rng.randrange(lo, hi), rng.randrange(lo, hi), k)
        if it.question not in seen:
            seen.add(it.question)
            out.append(it)
    return out


def questions_of(paths: Iterable[str | Path], k: int | None = None) -> set[str]:
    """The questions of iCoT text files (to exclude from generated training data). Raises
    ValueError naming the file and line when a non-empty line is not ``question||steps ####
    answer``, or, given ``k``, when a file with questions holds no k x k one (it would exclude
    nothing)."""
    out: set[str] = set()
    for p in paths:
        mine = set()
        for i, line in enumerate(Path(p).read_text().splitlines(), 1):
            if not line.strip():
                continue
            question, bar, rest = line.partition("||")
            if not bar or "####" not in rest:
                raise ValueError(f"{p} line {i} is not an iCoT line (question||steps #### "
                                 f"answer): {line[:60]!r}")
            mine.add(question.strip())
        shape = f"{' '.join('d' * k)} * {' '.join('d' * k)}" if k else None
        if mine and shape and shape not in map(_digits_shape, mine):
            raise ValueError(f"{p} holds no {k}x{k} question, so it would exclude nothing")
        out |= mine
    return out


def _digits_shape(question: str) -> str:
    """``"7 6 9 2 * 1 6 3 6"`` -> ``"d d d d * d d d d"``."""
    return " ".join("d" if w.isdigit() and len(w) == 1 else w for w in question.split())


def write_icot(items: Iterable[Item], path: str | Path) -> int:
    """Write ``items`` as iCoT text lines; returns the count."""
    lines = [icot_line(it) for it in items]
    Path(path).write_text("".join(line + "\n" for line in lines))
    return len(lines)


def gsm8k_train_items(path: str | Path) -> list[Item]:
    """GSM8K jsonl rows as items: steps the ``<<...>>`` annotations, gold after ``####``
    (commas removed). Errors as ``datasets.parse_file``."""
    return [Item(it.question.strip(), it.gold.replace(",", ""), "number",
                 reasoning_text(it.steps, "equations"))
            for it in parse_file(Path(path), "jsonl", "number", None)]
