"""The engine flags, one per ``EngineConfig`` field (``config.option``), as vLLM's
``EngineArgs.add_cli_args`` (``vllm/engine/arg_utils.py``).

Design notes: docs/internals.md, "latentserve.cli.engine_args".
"""

from __future__ import annotations

import argparse
import dataclasses
import logging

log = logging.getLogger(__name__)

_TYPES = {"int": int, "float": float, "str": str, "bool": bool}


def _base_type(annotation: str) -> tuple[type, bool]:
    """``"int | None"`` -> (int, False); ``"tuple[str, ...]"`` -> (str, True)."""
    parts = [p.strip() for p in str(annotation).split("|") if p.strip() != "None"]
    base = parts[0] if parts else "str"
    if base.startswith("tuple["):
        return _TYPES.get(base[6:].split(",")[0].strip(), str), True
    return _TYPES.get(base, str), False


_DECIMAL = {"k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}
_BINARY = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def human_readable_int(text: str) -> int:
    """vLLM's ``human_readable_int``: ``1k`` = 1000, ``25.6k`` = 25600, ``1K`` = 1024.
    Raises ValueError (ArgumentTypeError for decimals with a binary suffix)."""
    import re

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


def _checked(conv: type, name: str, meta) -> callable:
    """``conv`` that also enforces ``meta``'s range (argparse reports it on the flag)."""
    from latentserve.config import check_value

    def parse(text: str):
        value = conv(text)
        try:
            check_value(name, value, meta)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc).removeprefix(f"{name} ")) from None
        return value

    parse.__name__ = conv.__name__  # argparse's "invalid int value: 'x'"
    return parse


def _flag_text(default) -> str:
    return "" if default is None else f" (default: {default})"


def add_engine_args(p: argparse.ArgumentParser, several_models: bool = False,
                    exclude: tuple[str, ...] = ()) -> None:
    """Add the ``EngineConfig`` flags to ``p``: positional ``MODEL``, ``--model`` (repeatable
    with ``several_models``), one per field not in ``exclude``, ``--trust-remote-code``
    (ignored) and ``--config FILE.yaml`` (``cli.config_file``)."""
    from latentserve.config import EngineConfig

    p.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                   help="the model, as in `vllm serve MODEL` (same as --model)")
    p.set_defaults(several_models=several_models)
    if several_models:
        p.add_argument("--model", action="append", default=None,
                       help="HF-style model directory or .gguf file (default: embedded "
                            "SmolLM2); repeat to serve several models, one engine each, "
                            "each under its own name")
    else:
        p.add_argument("--model", default=None,
                       help="HF-style model directory or .gguf file (default: embedded "
                            "SmolLM2)")
    for f in dataclasses.fields(EngineConfig):
        meta = f.metadata or {}
        if not meta.get("cli", True) or f.name in exclude:
            continue
        flags = tuple(meta.get("flags") or ()) or ("--" + f.name.replace("_", "-"),)
        off = tuple(meta.get("off_flags") or ())
        conv, several = _base_type(f.type)
        text = meta.get("help") or f"EngineConfig.{f.name}"
        if conv is bool:
            if off:
                group = p.add_mutually_exclusive_group()
                group.add_argument(*flags, dest=f.name, action="store_const", const=True,
                                   default=f.default, help=text + _flag_text(f.default))
                group.add_argument(*off, dest=f.name, action="store_const", const=False,
                                   help=f"the opposite of {flags[0]}")
            elif f.default is False:
                p.add_argument(*flags, dest=f.name, action="store_true", help=text)
            else:
                p.add_argument(*flags, dest=f.name, action=argparse.BooleanOptionalAction,
                               default=f.default, help=text)
            continue
        kwargs = {"dest": f.name, "default": f.default, "help": text + _flag_text(f.default)}
        if meta.get("metavar"):
            kwargs["metavar"] = meta["metavar"]
        if meta.get("choices") is not None:
            kwargs["choices"] = meta["choices"]
            kwargs["type"] = conv
        else:
            human = meta.get("human") and conv is int
            kwargs["type"] = _checked(human_readable_int if human else conv, f.name, meta)
        if several:
            kwargs["nargs"] = "+"
        p.add_argument(*flags, **kwargs)
    p.add_argument("--trust-remote-code", action="store_true",
                   help="accepted for vLLM launch lines and ignored: latentserve runs no "
                        "code from checkpoints")
    p.add_argument("--config", default=None, metavar="FILE.yaml",
                   help="flags from a YAML file, as vLLM's --config: keys are flag names "
                        "(`max-num-seqs: 8` or `max_num_seqs: 8`), `true` for a flag "
                        "without value; flags on the command line override the file")


def finish_engine_args(args: argparse.Namespace) -> None:
    """Fold the positional ``MODEL`` into ``args.model`` (ValueError when it contradicts
    ``--model`` on a one-model command); warn about ``--trust-remote-code``."""
    tag = getattr(args, "model_tag", None)
    if tag is not None:
        if isinstance(args.model, list):
            args.model = [tag, *args.model]
        elif args.model not in (None, tag):
            raise ValueError(f"the model is given twice: positional {tag!r} and --model "
                             f"{args.model!r}; give one")
        else:
            args.model = [tag] if getattr(args, "several_models", False) else tag
    if getattr(args, "trust_remote_code", False):
        log.warning("--trust-remote-code is ignored: latentserve runs no code from "
                    "checkpoints")


def engine_config(args: argparse.Namespace, model: str | None | list = ...):
    """The ``EngineConfig`` of the flags (``model``: instead of ``args.model``). Raises
    ValueError for several models or a failed field check."""
    from latentserve.config import EngineConfig

    if model is ...:
        model = args.model
    if isinstance(model, list):
        if len(model) != 1:
            raise ValueError("this command takes one --model")
        model = model[0]
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(EngineConfig)
              if f.name != "model" and hasattr(args, f.name)
              and not (getattr(args, f.name) is None and f.default is not None)}
    return EngineConfig(model=model, **values)


def engine_configs(args: argparse.Namespace) -> list:
    """One ``EngineConfig`` per model, each with ``latent_cap_where_applicable`` when there
    are several (ValueError with ``--served-model-name``)."""
    models = args.model if isinstance(args.model, list) else [args.model]
    several = len(models) > 1
    if several and getattr(args, "served_model_name", None) is not None:
        raise ValueError("--served-model-name names one model; with several --model each "
                         "is served under its path")
    return [dataclasses.replace(engine_config(args, model=m),
                                latent_cap_where_applicable=several) for m in models]
