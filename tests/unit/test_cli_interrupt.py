"""Ctrl-C on ``latentserve serve`` (while its engine loads), ``eval`` (while it evaluates)
and ``generate`` (while it starts) prints one ``latentserve: interrupted`` line, no
traceback, and exits 130 (128 + SIGINT), as a shell reports an interrupted command."""

import os
import signal
import subprocess
import sys
import threading
import time

import pytest

# The command with Python's Ctrl-C handler, even when this test runs where SIGINT is ignored
# (a background job), which the child would inherit.
RUN_CLI = ("import runpy, signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler); "
           "sys.argv[0] = 'latentserve'; runpy.run_module('latentserve.cli', run_name='__main__')")


def interrupt(argv: list[str], when: str | float, timeout: float = 300.0):
    """Run ``python -m latentserve.cli argv`` in its own process group (with Python's
    SIGINT handler, as in a terminal), send the group SIGINT (what Ctrl-C does) ``when`` seconds
    after the start, or once ``when`` (a str) appears on stderr; ``(returncode, stderr)``."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = subprocess.Popen([sys.executable, "-c", RUN_CLI, *argv], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stderr), daemon=True)
    reader.start()
    start = time.monotonic()
    while time.monotonic() - start < timeout and proc.poll() is None:
        if (isinstance(when, str) and any(when in line for line in lines)) or (
                not isinstance(when, str) and time.monotonic() - start >= when):
            break
        time.sleep(0.05)
    assert proc.poll() is None, f"exited before the signal: {''.join(lines)}"
    os.killpg(proc.pid, signal.SIGINT)
    rc = proc.wait(timeout)
    reader.join(10)
    return rc, "".join(lines)


def assert_clean(rc: int, err: str) -> None:
    assert rc == 130, err
    assert err.rstrip().endswith("latentserve: interrupted"), err
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err


def test_ctrl_c_while_serve_loads_its_engine(tiny_dirs):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    assert_clean(*interrupt(["serve", "--model", str(tiny_dirs["llama"]), "--port", str(port)],
                            "engine config of"))


def test_ctrl_c_during_eval(tiny_dirs):
    # 1,319 GSM8K items on a random tiny model: far from done after 3 s.
    assert_clean(*interrupt(["eval", "--model", str(tiny_dirs["llama"]), "--dataset", "gsm8k",
                             "--max-tokens", "64"], 3.0))


# NOTE: not earlier than ~1 s: before the child's first line runs, a SIGINT that the test's
# own process ignores (a background job) is ignored by the child too, and lost.
@pytest.mark.parametrize("delay", [1.0, 2.0])
def test_ctrl_c_while_generate_starts(tiny_dirs, delay):
    assert_clean(*interrupt(["generate", "--model", str(tiny_dirs["llama"]), "--prompt", "hi",
                             "--max-tokens", "8"], delay))
