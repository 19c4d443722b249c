"""Optional dependencies, checked by name before a command does any work: each names the
extra of ``pyproject.toml`` that installs it (``pip install 'latentserve[EXTRA]'``)."""

from __future__ import annotations

# module -> (extra, what needs it)
EXTRAS = {
    "peft": ("train", ("PEFT LoRA: `latentserve train`, `bench --suite loop` and the CODI "
                       "and PCCoT checkpoint builders (latentserve.bench.baseline)")),
    "matplotlib": ("eval", "plots: `latentserve eval --plot`, benchmarks.plot"),
    "sglang_router": ("router", "`latentserve serve --data-parallel-size N`"),
    "xgrammar": ("structured", "structured outputs (response_format, guided_*)"),
}


def missing_extra_message(module: str, what: str | None = None) -> str:
    """``'WHAT needs MODULE, which is not installed: pip install 'latentserve[EXTRA]' (from a
    source checkout: pip install -e '.[EXTRA]')'``."""
    extra, default_what = EXTRAS[module]
    return (f"{what or default_what} needs {module.replace('_', '-')}, which is not "
            f"installed: pip install 'latentserve[{extra}]' (from a source checkout: "
            f"pip install -e '.[{extra}]')")


def require(module: str, what: str | None = None) -> None:
    """Raise ModuleNotFoundError (the message names the extra to install, see
    :func:`missing_extra_message`) when ``module`` (a key of ``EXTRAS``) cannot be imported;
    ``what`` says what needed it. Imports nothing."""
    import importlib.util

    try:
        found = importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        found = False
    if not found:
        raise ModuleNotFoundError(missing_extra_message(module, what), name=module)
