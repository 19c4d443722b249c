"""An engine that never finishes loading, for tests of what an interrupt or SIGTERM during
start-up leaves behind: :func:`slow_engine_env` gives a subprocess environment whose
interpreters (the engine processes too) import a ``sitecustomize`` that replaces
``LLMEngine`` by one whose constructor records its pid in a file, then sleeps 10 minutes."""

import os
import sys
import time
from pathlib import Path

SITECUSTOMIZE = '''\
import os, sys, time, types

_stub = types.ModuleType("latentserve.engine.llm_engine")


class LLMEngine:
    def __init__(self, config):
        with open(os.environ["LATENTSERVE_TEST_LOADING"], "a") as f:
            f.write(f"{os.getpid()}\\n")
        time.sleep(600)


_stub.LLMEngine = LLMEngine
sys.modules[_stub.__name__] = _stub
'''


def slow_engine_env(tmp_path: Path) -> tuple[dict[str, str], Path]:
    """``(env, marker)``: the environment for a subprocess (this interpreter's ``sys.path``
    after the stub's folder) and the file each stuck engine writes its pid to."""
    site = tmp_path / "slow-engine-site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(SITECUSTOMIZE)
    marker = tmp_path / "loading-pids"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), *sys.path]),
           "LATENTSERVE_TEST_LOADING": str(marker)}
    return env, marker


def loading_pids(marker: Path, n: int, proc, timeout: float = 240.0) -> list[int]:
    """The pids of the first ``n`` engines stuck loading, once they are (``proc``, the
    command under test, must not exit meanwhile)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"exited with {proc.returncode} before its engines loaded"
        pids = marker.read_text().split() if marker.exists() else []
        if len(pids) >= n:
            return [int(p) for p in pids[:n]]
        time.sleep(0.1)
    raise AssertionError(f"{n} engine(s) not loading within {timeout:.0f} s")


def alive_after(pids: list[int], timeout: float) -> list[int]:
    """Those of ``pids`` still running (zombies count as gone) after up to ``timeout`` s."""
    import psutil

    def alive(pid: int) -> bool:
        try:
            return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return False

    deadline = time.monotonic() + timeout
    while (left := [p for p in pids if alive(p)]) and time.monotonic() < deadline:
        time.sleep(0.1)
    return left
