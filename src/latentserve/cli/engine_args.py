"""The engine flags, one per ``EngineConfig`` field (``options.option``), as vLLM's
``EngineArgs.add_cli_args`` (``vllm/engine/arg_utils.py``).

Design notes: docs/internals.md, "latentserve.cli.engine_args".
"""

from __future__ import annotations

import argparse
import dataclasses
import logging

log = logging.getLogger(__name__)


def add_engine_args(p: argparse.ArgumentParser, several_models: bool = False,
                    exclude: tuple[str, ...] = ()) -> None:
    """Add the ``EngineConfig`` flags to ``p``: positional ``MODEL``, ``--model`` (repeatable
    with ``several_models``), one per field not in ``exclude``, ``--trust-remote-code``
    (ignored) and ``--config FILE.yaml`` (``cli.config_file``)."""
    from latentserve.config import EngineConfig
    from latentserve.options import add_options

    p.add_argument("model_tag", nargs="?", metavar="MODEL",
                   help="the model, as in `vllm serve MODEL` (same as --model)")
    p.add_argument("--model", action="append" if several_models else "store",
                   help="HF-style model directory or .gguf file (default: embedded SmolLM2)"
                        + ("; repeat to serve several models, one engine each, each under its "
                           "own name" if several_models else ""))
    add_options(p, EngineConfig, exclude)
    p.add_argument("--trust-remote-code", action="store_true",
                   help="accepted for vLLM launch lines and ignored: latentserve runs no "
                        "code from checkpoints")
    p.add_argument("--config", metavar="FILE.yaml",
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
            args.model = tag
    if getattr(args, "trust_remote_code", False):
        log.warning("--trust-remote-code is ignored: latentserve runs no code from "
                    "checkpoints")


def engine_configs(args: argparse.Namespace) -> list:
    """One ``EngineConfig`` per model of the flags, each with ``latent_cap_where_applicable``
    when there are several. ValueError for ``--served-model-name`` with several or a failed
    field check."""
    from latentserve.config import EngineConfig

    models = args.model if isinstance(args.model, list) else [args.model]
    several = len(models) > 1
    if several and getattr(args, "served_model_name", None) is not None:
        raise ValueError("--served-model-name names one model; with several --model each "
                         "is served under its path")
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(EngineConfig)
              if f.name != "model" and hasattr(args, f.name)
              and not (getattr(args, f.name) is None and f.default is not None)}
    return [EngineConfig(model=m, latent_cap_where_applicable=several, **values) for m in models]


def engine_config(args: argparse.Namespace):
    """The one ``EngineConfig`` of the flags; ValueError as :func:`engine_configs`, or for
    several models."""
    if len(configs := engine_configs(args)) != 1:
        raise ValueError("this command takes one --model")
    return configs[0]
