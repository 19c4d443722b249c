"""The scaffolding every ``python -m benchmarks.NAME`` script shares: its argument parser, the
command line it records in its result, and writing that result as JSON."""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
from pathlib import Path


def parser(name: str, doc: str | None) -> argparse.ArgumentParser:
    """The parser of ``python -m benchmarks.NAME``, described by the first paragraph of
    ``doc``; sets ``HF_HUB_OFFLINE=1`` (a benchmark never downloads)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    return argparse.ArgumentParser(prog=f"python -m benchmarks.{name}",
                                   description=(doc or "").split("\n\n")[0])


def command(name: str, argv: list[str] | None = None) -> str:
    """The command line that ran benchmark ``name`` with ``argv`` (default: ``sys.argv``)."""
    return shlex.join(["python", "-m", f"benchmarks.{name}",
                       *(sys.argv[1:] if argv is None else argv)])


def write_json(path: str | Path | None, result: dict) -> None:
    """Write ``result`` as indented JSON to ``path`` (parents created), to stdout if None."""
    text = json.dumps(result, indent=1) + "\n"
    if path is None:
        sys.stdout.write(text)
        return
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(text)
    print(f"wrote {path}", flush=True)
