"""Options declared once, as dataclass fields: :func:`option` gives a field its default,
``--help`` text, range or choices and flags; :func:`check` enforces the ranges (ValueError
naming the field) and :func:`add_options` builds the argparse flags from them. Used by
``EngineConfig``, the training options and ``ServerOptions``. Light: no torch."""

from __future__ import annotations

import argparse
import dataclasses
import json
import operator
import re
from dataclasses import MISSING, field

_BOUNDS = {"ge": operator.ge, "gt": operator.gt, "le": operator.le, "lt": operator.lt}


def option(default=MISSING, help: str | None = None, *, ge=None, gt=None, le=None, lt=None,
           choices=None, flags: tuple[str, ...] = (), off_flags: tuple[str, ...] = (),
           cli: bool = True, human: bool = False, **argparse_kwargs):
    """A dataclass field: ``default`` (a list: a fresh copy each time; MISSING: required), its
    ``--help``, bounds ``ge``/``gt``/``le``/``lt`` (>=, >, <=, <), ``choices``, ``flags``
    (default ``--name``; ``--no-name`` for a bool on by default), ``off_flags`` (set a bool
    False), ``cli`` False: no flag, ``human``: an int flag takes ``1k`` = 1000, ``1K`` = 1024;
    other keywords go to ``add_argument`` (``metavar``, ``nargs``, ``type``)."""
    meta = {"help": help, "ge": ge, "gt": gt, "le": le, "lt": lt, "choices": choices,
            "flags": flags, "off_flags": off_flags, "cli": cli, "human": human,
            "argparse": argparse_kwargs}
    if isinstance(default, list):
        return field(default_factory=default.copy, metadata=meta)
    return field(default=default, metadata=meta)


def _range_text(meta) -> str | None:
    """``in (0, 1]`` or ``>= 1``: the declared range, or None when there is none."""
    lo = next((("[" if op == "ge" else "(", meta[op]) for op in ("ge", "gt")
               if meta.get(op) is not None), None)
    hi = next((f"{_number(meta[op])}{']' if op == 'le' else ')'}" for op in ("le", "lt")
               if meta.get(op) is not None), None)
    if hi is not None:
        return f"in {lo[0] + _number(lo[1]) if lo else '(-inf'}, {hi}"
    if lo is not None:
        return f"{'>=' if lo[0] == '[' else '>'} {_number(lo[1])}"
    return None


def _number(bound) -> str:
    """An int bound in full (``65535``), a float one short (``0.9``, ``1``)."""
    return str(bound) if isinstance(bound, int) else format(bound, "g")


def check_value(name: str, value, meta, integer: bool = False) -> None:
    """Raise ValueError naming ``name`` when ``value`` is outside its choices or range (or,
    with a range, not a number; not an int with ``integer``)."""
    choices = meta.get("choices")
    if choices is not None and value not in choices:
        raise ValueError(f"{name} must be one of {tuple(choices)}, got {value!r}")
    text = _range_text(meta)
    if text is None:
        return
    if isinstance(value, bool) or not isinstance(value, int if integer else (int, float)):
        raise ValueError(f"{name} must be {'an integer' if integer else 'a number'} {text}, "
                         f"got {value!r}")
    if not all(test(value, meta[op]) for op, test in _BOUNDS.items()
               if meta.get(op) is not None):  # NOTE: NaN fails every bound
        raise ValueError(f"{name} must be {text}, got {value}")


def _kind(f) -> str:
    """``int``, ``float``, ``str``, ``bool``, ``list[str]``, ... of a field, without None."""
    return str(f.type).replace(" | None", "")


def check(obj, **values) -> None:
    """Raise ValueError naming the first field of ``obj`` outside its :func:`option` range or
    choices (None passes where the type allows it); ``values``: what to check instead of a
    field's value."""
    for f in dataclasses.fields(obj):
        value = values.get(f.name, getattr(obj, f.name))
        if f.metadata and not (value is None and "None" in str(f.type)):
            check_value(f.name, value, f.metadata, _kind(f) == "int")


_DECIMAL = {"k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}
_BINARY = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def human_readable_int(text: str) -> int:
    """vLLM's ``human_readable_int``: ``1k`` = 1000, ``25.6k`` = 25600, ``1K`` = 1024.
    Raises ValueError (ArgumentTypeError for decimals with a binary suffix)."""
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([kKmMgGtT])", text.strip())
    if match is None:
        return int(text)
    number, suffix = match.groups()
    if suffix in _DECIMAL:
        return int(float(number) * _DECIMAL[suffix])
    if "." in number:
        raise argparse.ArgumentTypeError(
            f"decimals are not allowed with the binary suffix {suffix} in {text!r} "
            f"(did you mean {number}{suffix.lower()}?)")
    return int(number) * _BINARY[suffix]


human_readable_int.__name__ = "int"  # argparse's "invalid int value: 'x'"


def ranged(conv, name: str, meta=None, **bounds):
    """An argparse ``type``: ``conv`` (``int``, ``float``) checked against ``meta`` (an
    :func:`option`'s metadata) or ``bounds`` (``ge``/``gt``/``le``/``lt``), reported on the
    flag, e.g. ``ranged(int, "data_parallel_size", ge=1)``."""
    meta = bounds if meta is None else meta

    def parse(text: str):
        value = conv(text)
        try:
            check_value(name, value, meta)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc).removeprefix(f"{name} ")) from None
        return value

    parse.__name__ = conv.__name__  # argparse's "invalid int value: 'x'"
    return parse


def json_str_list(text: str) -> list[str]:
    """An argparse ``type``: ``text`` as a JSON list of strings (``["*"]``); ArgumentTypeError
    otherwise."""
    try:
        value = json.loads(text)
    except ValueError:
        value = None
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise argparse.ArgumentTypeError(f'must be a JSON list of strings (e.g. \'["*"]\'), '
                                         f"got {text!r}")
    return value


def comma_list(kind):
    """An argparse ``type``: one or more comma-separated values of ``kind`` (a type, or a
    :func:`ranged` parser whose range is then reported), as a tuple."""
    def parse(text: str) -> tuple:
        try:
            out = tuple(kind(t) for t in text.split(",") if t)
        except (ValueError, argparse.ArgumentTypeError) as exc:
            why = f" ({exc})" if isinstance(exc, argparse.ArgumentTypeError) else ""
            raise argparse.ArgumentTypeError(f"must be comma-separated {kind.__name__} values, "
                                             f"got {text!r}{why}") from None
        if not out:
            raise argparse.ArgumentTypeError(f"must name at least one value, got {text!r}")
        return out
    return parse


def _help(text: str | None, default) -> str | None:
    """``text`` with its default (a list as JSON, a tuple comma-separated), or None."""
    if default is None or default is MISSING:
        return text
    shown = (json.dumps(default) if isinstance(default, list) else
             ",".join(map(str, default)) if isinstance(default, tuple) else default)
    return f"{text or ''} (default: {shown})".lstrip()


def add_options(parser: argparse.ArgumentParser, cls, exclude: tuple[str, ...] = ()):
    """One flag of ``parser`` per :func:`option` field of ``cls`` not in ``exclude`` (its
    ``dest`` the field's name): a switch for a bool, repeatable for a list without a
    ``type``, comma-separated for a tuple without ``nargs``, required without a default.
    Returns ``parser``."""
    scalar = {"int": int, "float": float, "str": str}
    for f in dataclasses.fields(cls):
        m, kind = f.metadata, _kind(f)
        if not m.get("cli", True) or f.name in exclude:
            continue
        default = f.default if f.default_factory is MISSING else f.default_factory()
        off = m.get("off_flags")
        switch_off = kind == "bool" and default is True and not off
        flags = m.get("flags") or ("--" + "no-" * switch_off + f.name.replace("_", "-"),)
        if kind == "bool":
            if off:
                group = parser.add_mutually_exclusive_group()
                group.add_argument(*flags, dest=f.name, action="store_const", const=True,
                                   default=default, help=_help(m.get("help"), default))
                group.add_argument(*off, dest=f.name, action="store_const", const=False,
                                   help=f"the opposite of {flags[0]}")
            else:
                parser.add_argument(*flags, dest=f.name, help=m.get("help"),
                                    action="store_false" if default else "store_true")
            continue
        kw = {"dest": f.name, "help": _help(m.get("help"), default),
              "choices": m.get("choices"), **m.get("argparse", {})}
        if default is MISSING:
            kw["required"] = True
        else:
            kw["default"] = default
        if kind.startswith("list") and "type" not in kw:
            kw["action"] = "append"
        elif "type" not in kw:
            base = kind.removeprefix("tuple[").split(",")[0]
            conv = human_readable_int if m.get("human") else scalar.get(base, str)
            if kind.startswith("tuple") and "nargs" not in kw:
                conv = comma_list(conv)
            kw["type"] = conv if kw["choices"] is not None else ranged(conv, f.name, m)
        parser.add_argument(*flags, **kw)
    return parser


def options_of(cls, args: argparse.Namespace):
    """The ``cls`` an :func:`add_options` parser parsed into ``args`` (checked)."""
    return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls)
                  if hasattr(args, f.name)})
