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


def config_tokens(path: str, options: dict[str, argparse.Action]) -> list[str]:
    """The command-line tokens of the YAML file ``path`` (``options``: the command's flags
    and their actions). Raises ValueError naming the file (and key) for an unreadable or
    non-mapping file, an unknown flag, or a value of the wrong shape for its flag (not
    true/false for a switch, a list for a one-value flag)."""
    import yaml

    try:
        with open(path, encoding="utf-8") as f:
            data = yaml.safe_load(f)
    except OSError as exc:
        raise ValueError(f"--config {path}: {exc.strerror or exc}") from None
    except yaml.YAMLError as exc:
        raise ValueError(f"--config {path}: not valid YAML ({exc})") from None
    if not isinstance(data, dict | None):
        msg = (f"--config {path}: the file must hold a mapping of flag names to values, got "
               f"{type(data).__name__}")
        raise ValueError(msg)  # noqa: TRY004 - a bad file: the CLI's one-line error
    tokens: list[str] = []
    for key, value in (data or {}).items():
        try:
            tokens += _flag_tokens("--" + str(key).replace("_", "-"), value, options)
        except ValueError as exc:
            raise ValueError(f"--config {path}: {key!r} {exc}") from None
    return tokens


def _flag_tokens(flag: str, value, options: dict[str, argparse.Action]) -> list[str]:
    """The tokens of one ``flag: value`` of the file; ValueError saying what is wrong. A
    switch set false gives its opposite flag, if it has one."""
    action = options.get(flag)
    if action is None or flag == "--config" or action.nargs == 0 and action.const is None \
            and not isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
        raise ValueError("is not a flag of this command (keys are flag names, e.g. "
                         "max-num-seqs)")
    if action.nargs == 0:  # a switch: true sets it, false its --no- form (or nothing)
        if not isinstance(value, bool):
            raise ValueError(f"is a switch: give true or false, got {value!r}")
        if value:
            return [flag]
        # its opposite: --no-enable-prefix-caching, --disable-overlap-schedule, or nothing
        return next(([other] for other, a in options.items() if a.dest == action.dest
                     and a.nargs == 0 and a.const is not action.const
                     and other.startswith("--")), [])
    if isinstance(value, bool):
        raise ValueError(f"takes a value, got {value!r}")
    if value is None:
        return []
    if isinstance(value, list):
        items = [json.dumps(v) if isinstance(v, dict) else str(v) for v in value]
        if isinstance(action, argparse._AppendAction):
            return [t for item in items for t in (flag, item)]
        if action.nargs in ("+", "*"):
            return [flag, *items]
        if getattr(action.type, "__name__", "") == "json_str_list":
            return [flag, json.dumps(value)]
        raise ValueError(f"takes one value, got a list {value!r}")
    if isinstance(value, dict):
        return [flag, json.dumps(value)]
    return [flag, str(value)]


def expand_config_args(parser: argparse.ArgumentParser, argv: list[str]) -> list[str]:
    """``argv`` with its ``--config`` file's flags inserted after the command name."""
    path = _config_path(argv)
    if path is None:
        return argv
    commands = next((a.choices for a in parser._actions
                     if isinstance(a, argparse._SubParsersAction)), {})
    at = next((i for i, token in enumerate(argv) if token in commands), None)
    if at is None:
        return argv
    sub = commands[argv[at]]
    if at + 1 < len(argv) and not argv[at + 1].startswith("-"):
        at += 1  # `serve MODEL --config f.yaml`: the file's flags after MODEL
    return [*argv[:at + 1], *config_tokens(path, sub._option_string_actions),
            *argv[at + 1:]]
