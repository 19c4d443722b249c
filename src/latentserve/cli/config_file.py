"""``--config FILE.yaml``: flags from a YAML file, as vLLM's ``load_config_file``: keys are
flag names, ``true`` a bare flag, ``false`` its ``--no-`` form, a list several values, a
mapping JSON. The file's flags go right after the command (and a positional ``MODEL``), so
command-line flags override them.
"""

from __future__ import annotations

import argparse
import json


def _config_path(argv: list[str]) -> str | None:
    for i, token in enumerate(argv):
        if token == "--config" and i + 1 < len(argv):
            return argv[i + 1]
        if token.startswith("--config="):
            return token.split("=", 1)[1]
    return None


def _subparser(parser: argparse.ArgumentParser, argv: list[str]):
    """The command's subparser and the index of the command name in ``argv``."""
    commands = next((a.choices for a in parser._actions
                     if isinstance(a, argparse._SubParsersAction)), {})
    for i, token in enumerate(argv):
        if token in commands:
            return commands[token], i
    return None, -1


def config_tokens(path: str, options: set[str]) -> list[str]:
    """The command-line tokens of the YAML file ``path`` (``options``: the command's flags).
    Raises ValueError naming the file (and key) for an unreadable or non-mapping file or
    an unknown flag."""
    import yaml

    try:
        with open(path, encoding="utf-8") as f:
            data = yaml.safe_load(f)
    except OSError as exc:
        raise ValueError(f"--config {path}: {exc.strerror or exc}") from None
    except yaml.YAMLError as exc:
        raise ValueError(f"--config {path}: not valid YAML ({exc})") from None
    if data is None:
        return []
    if not isinstance(data, dict):
        msg = (f"--config {path}: the file must hold a mapping of flag names to values, got "
               f"{type(data).__name__}")
        raise ValueError(msg)  # noqa: TRY004 - a bad file: the CLI's one-line error
    tokens: list[str] = []
    for key, value in data.items():
        flag = "--" + str(key).replace("_", "-")
        if flag not in options or flag == "--config":
            raise ValueError(f"--config {path}: {key!r} is not a flag of this command "
                             f"(keys are flag names, e.g. max-num-seqs)")
        if isinstance(value, bool):
            off = "--no-" + flag[2:]
            tokens += [flag] if value else ([off] if off in options else [])
        elif isinstance(value, list):
            tokens += [flag, *(json.dumps(v) if isinstance(v, dict) else str(v)
                               for v in value)]
        elif isinstance(value, dict):
            tokens += [flag, json.dumps(value)]
        elif value is not None:
            tokens += [flag, str(value)]
    return tokens


def expand_config_args(parser: argparse.ArgumentParser, argv: list[str]) -> list[str]:
    """``argv`` with its ``--config`` file's flags inserted after the command name."""
    path = _config_path(argv)
    if path is None:
        return argv
    sub, at = _subparser(parser, argv)
    if sub is None:
        return argv
    if at + 1 < len(argv) and not argv[at + 1].startswith("-"):
        at += 1  # `serve MODEL --config f.yaml`: the file's flags after MODEL
    return [*argv[:at + 1], *config_tokens(path, set(sub._option_string_actions)),
            *argv[at + 1:]]
