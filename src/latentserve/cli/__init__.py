"""The ``latentserve`` command: serve, chat, complete, generate, demo, bench, convert, train,
data, eval."""

from __future__ import annotations

import argparse
import os
import signal
import sys

from latentserve import settings
from latentserve.cli.engine_args import add_engine_args, engine_config, engine_configs

__all__ = ["add_engine_args", "build_parser", "engine_config", "engine_configs", "main"]


def build_parser() -> argparse.ArgumentParser:
    from latentserve import __version__
    from latentserve.cli import (
        bench,
        client,
        convert,
        data,
        demo,
        eval,
        generate,
        serve,
        train,
    )

    parser = argparse.ArgumentParser(prog="latentserve",
                                     description="Serve latent-reasoning language models.")
    parser.add_argument("--version", action="version", version=f"latentserve {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    for mod in (serve, client, generate, demo, bench, convert, train, data, eval):
        mod.register(sub)
    return parser


def resend_lost_interrupt(unraisable) -> None:
    """``sys.unraisablehook`` for the CLI: a Ctrl-C whose KeyboardInterrupt was raised inside a
    callback Python cannot raise from (a weakref callback, as an import's lock release runs)
    is sent again 50 ms later (from a thread, so that it lands in the command's own code, not
    in this hook); other cases as Python's default."""
    if isinstance(unraisable.exc_value, KeyboardInterrupt):
        import threading

        threading.Timer(0.05, os.kill, (os.getpid(), signal.SIGINT)).start()
        return
    sys.__unraisablehook__(unraisable)


def main(argv: list[str] | None = None) -> int:
    from latentserve.cli.config_file import expand_config_args
    from latentserve.cli.engine_args import finish_engine_args

    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never reach for the hub at run time
    # NOTE: spinning OpenMP threads stall every op when another job holds a core; set
    # before torch loads.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    prev_hook, sys.unraisablehook = sys.unraisablehook, resend_lost_interrupt
    try:
        parser = build_parser()
        try:
            argv = expand_config_args(parser, list(sys.argv[1:] if argv is None else argv))
        except ValueError as e:
            print(f"latentserve: error: {e}", file=sys.stderr)
            return 2
        args = parser.parse_args(argv)
        finish_engine_args(args)
        return args.func(args) or 0
    except KeyboardInterrupt:  # Ctrl-C: one line, no traceback, the shell's 128 + SIGINT
        print("\nlatentserve: interrupted", file=sys.stderr, flush=True)
        return 130
    except Exception as e:  # noqa: BLE001 - one line for users; LATENTSERVE_DEBUG=1 for the trace
        if settings.get("LATENTSERVE_DEBUG"):
            raise
        kind = "" if isinstance(e, (ValueError, FileNotFoundError,
                                                ModuleNotFoundError)) else f"{type(e).__name__}: "
        message = " ".join(str(e).split())  # one line, even for a multi-line message
        print(f"latentserve: error: {kind}{message}", file=sys.stderr)
        return 2
    finally:  # main() called in-process (tests, scripts) leaves the caller's hook
        sys.unraisablehook = prev_hook
