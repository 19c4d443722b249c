"""Answer extraction and matching, as the data sets define their answers.

Design notes: docs/internals.md, "latentserve.eval.answers".
"""

from __future__ import annotations

import re

_NUM = re.compile(r"-?\$?\d[\d,]*(?:\.\d+)?")
_STRICT = re.compile(r"####\s*(-?\$?\d[\d,]*(?:\.\d+)?)")


def parse_number(text: str) -> float | None:
    """``"$1,234.50"`` -> 1234.5; None when ``text`` is not a number."""
    t = text.strip().rstrip(".").replace(",", "").replace("$", "")
    try:
        return float(t)
    except ValueError:
        return None


def numbers_equal(pred: str | None, gold: str) -> bool:
    if pred is None:
        return False
    a, b = parse_number(pred), parse_number(gold)
    return a is not None and b is not None and abs(a - b) < 1e-6


def strict_number(text: str) -> str | None:
    """The number after the first ``####`` in ``text``, or None."""
    m = _STRICT.search(text)
    return m.group(1) if m else None


def last_number(text: str) -> str | None:
    """The last number in ``text`` (``-``, ``$`` and thousands commas allowed), or None."""
    found = _NUM.findall(text)
    return found[-1] if found else None


def digits_strict(text: str) -> str | None:
    i = text.find("####")
    if i < 0:
        return None
    m = re.match(r"\s*(\d(?: ?\d)*)", text[i + 4:])
    return m.group(1).replace(" ", "") if m else None


def digits_last(text: str) -> str | None:
    found = re.findall(r"\d(?: ?\d)*", text)  # spaced (the data's form) or not
    return found[-1].replace(" ", "") if found else None


def prosqa_options(question: str) -> tuple[str, str] | None:
    """The two concepts offered by a ProsQA question, or None."""
    m = re.search(r"Is \w+ an? (\w+) or (\w+)\?\s*$", question.strip())
    return (m.group(1), m.group(2)) if m else None


def _norm_sentence(s: str) -> str:
    return " ".join(s.lower().strip().rstrip(".").split())


def score(kind: str, text: str, gold: str, question: str = "") -> tuple[bool, bool]:
    """``(strict, flexible)`` correctness of output ``text`` against ``gold`` for a data
    set ``kind`` (``number``, ``digits`` or ``prosqa``). Raises ValueError for another
    kind."""
    if kind == "number":
        return numbers_equal(strict_number(text), gold), numbers_equal(last_number(text), gold)
    if kind == "digits":
        g = gold.replace(" ", "")
        return digits_strict(text) == g, digits_last(text) == g
    if kind == "prosqa":
        i = text.find("####")
        tail = text[i + 4:] if i >= 0 else text
        strict = _norm_sentence(gold) in _norm_sentence(tail)
        opts = prosqa_options(question)
        flexible = False
        if opts:
            low = text.lower()
            pos = {o: low.rfind(o.lower()) for o in opts}
            named = [o for o in opts if pos[o] >= 0]
            if named:
                last = max(named, key=lambda o: pos[o])
                flexible = _norm_sentence(gold).endswith(" " + last.lower())
        return strict, flexible
    raise ValueError(f"answer kind must be one of number, digits, prosqa; got {kind!r}")
