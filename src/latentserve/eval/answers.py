"""Answer extraction and matching, as the data sets define their answers.

Design notes: docs/internals.md, "latentserve.eval.answers".
"""

from __future__ import annotations

import re

_NUM = re.compile(r"-?\$?\d[\d,]*(?:\.\d+)?")
_STRICT = re.compile(r"####\s*(-?\$?\d[\d,]*(?:\.\d+)?)")


def numbers_equal(pred: str | None, gold: str) -> bool:
    """Whether ``pred`` and ``gold`` are the same number (``"$1,234.50"`` is 1234.5)."""
    try:
        a, b = (float(t.strip().rstrip(".").replace(",", "").replace("$", ""))
                for t in (pred, gold))
    except (ValueError, AttributeError):  # not a number, or no prediction (None)
        return False
    return abs(a - b) < 1e-6


def strict_number(text: str) -> str | None:
    """The number after the first ``####`` in ``text``, or None."""
    m = _STRICT.search(text)
    return m.group(1) if m else None


def last_number(text: str) -> str | None:
    """The last number in ``text`` (``-``, ``$`` and thousands commas allowed), or None."""
    found = _NUM.findall(text)
    return found[-1] if found else None


def _norm_sentence(s: str) -> str:
    return " ".join(s.lower().strip().rstrip(".").split())


def score(kind: str, text: str, gold: str, question: str = "") -> tuple[bool, bool]:
    """``(strict, flexible)`` correctness of output ``text`` against ``gold`` for a data
    set ``kind`` (``number``, ``digits`` or ``prosqa``). Raises ValueError for another
    kind."""
    if kind == "number":
        return numbers_equal(strict_number(text), gold), numbers_equal(last_number(text), gold)
    i = text.find("####")
    tail = text[i + 4:] if i >= 0 else None  # after the first ####
    if kind == "digits":  # digits spaced (the data's form) or not
        g = gold.replace(" ", "")
        first = re.match(r"\s*(\d(?: ?\d)*)", tail) if tail is not None else None
        found = re.findall(r"\d(?: ?\d)*", text)
        return ((first is not None and first.group(1).replace(" ", "") == g),
                bool(found) and found[-1].replace(" ", "") == g)
    if kind == "prosqa":
        strict = _norm_sentence(gold) in _norm_sentence(text if tail is None else tail)
        m = re.search(r"Is \w+ an? (\w+) or (\w+)\?\s*$", question.strip())  # the options
        flexible = False
        if m:  # the option the text names last
            low = text.lower()
            last = max(m.groups(), key=lambda o: low.rfind(o.lower())).lower()
            flexible = last in low and _norm_sentence(gold).endswith(" " + last)
        return strict, flexible
    raise ValueError(f"answer kind must be one of number, digits, prosqa; got {kind!r}")
