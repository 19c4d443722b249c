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
# (a background job), which the child would inherit. It says CLI_IMPORTED once the
# ``latentserve.cli`` package is imported: a Ctrl-C before that interrupts Python's own imports
# (a traceback from the interpreter, as for any Python command), which these tests do not time.
CLI_IMPORTED = "test: latentserve.cli imported"
RUN_CLI = ("import runpy, signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler); "
           f"import latentserve.cli; print({CLI_IMPORTED!r}, file=sys.stderr, flush=True); "
           "sys.argv[0] = 'latentserve'; runpy.run_module('latentserve.cli', run_name='__main__')")


def interrupt(argv: list[str], when, timeout: float = 300.0, env: dict | None = None,
              group: bool = True, exit_within: float | None = None):
    """Run ``python -m latentserve.cli argv`` in its own process group (with Python's
    SIGINT handler, as in a terminal), send the group SIGINT (what Ctrl-C does; ``group``
    False: the command's process alone, as ``kill -INT``) ``when`` seconds after the
    ``latentserve.cli`` package is imported,
    once ``when`` (a str) appears on stderr, or once ``when(proc)`` (a callable) returns;
    ``(returncode, stderr)``. The command must exit within ``exit_within`` seconds of the
    signal (default ``timeout``)."""
    env = env or {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = subprocess.Popen([sys.executable, "-c", RUN_CLI, *argv], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stderr), daemon=True)
    reader.start()
    start = time.monotonic()
    try:
        while not any(CLI_IMPORTED in x for x in lines):
            assert proc.poll() is None, f"exited before the signal: {''.join(lines)}"
            assert time.monotonic() - start < timeout, "latentserve.cli not imported"
            time.sleep(0.01)
        start = time.monotonic()
        if callable(when):
            when(proc)
        while time.monotonic() - start < timeout and proc.poll() is None:
            if callable(when) or (isinstance(when, str) and any(when in x for x in lines)) or (
                    isinstance(when, (int, float)) and time.monotonic() - start >= when):
                break
            time.sleep(0.05)
        assert proc.poll() is None, f"exited before the signal: {''.join(lines)}"
        (os.killpg if group else os.kill)(proc.pid, signal.SIGINT)
        try:
            rc = proc.wait(exit_within or timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"still running {exit_within} s after SIGINT: "
                                 f"{''.join(lines)}") from None
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
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


@pytest.mark.parametrize("delay", [1.0, 2.0])
def test_ctrl_c_while_generate_starts(tiny_dirs, delay):
    assert_clean(*interrupt(["generate", "--model", str(tiny_dirs["llama"]), "--prompt", "hi",
                             "--max-tokens", "8"], delay))


# --- start-up with engines that are still loading (tests/support/slow_engine.py) ----------


def _descendants(pid: int) -> list[int]:
    import psutil

    return [p.pid for p in psutil.Process(pid).children(recursive=True)]


def test_ctrl_c_while_two_engines_load_exits_at_once(tiny_dirs, tmp_path):
    """``serve`` with two models, Ctrl-C while both engines load: exits within seconds and
    leaves no engine (before: it waited until both had loaded, ~50 s for the demo)."""
    from tests.support.slow_engine import alive_after, loading_pids, slow_engine_env

    env, marker = slow_engine_env(tmp_path)
    engines = []
    rc, err = interrupt(["serve", "--model", str(tiny_dirs["llama"]), "--model",
                         str(tiny_dirs["qwen2"]), "--port", "0"],
                        lambda proc: engines.extend(loading_pids(marker, 2, proc)),
                        env=env, exit_within=15)
    assert_clean(rc, err)
    assert alive_after(engines, 5) == []


def _cmdline(process) -> list[str]:
    import psutil

    try:
        return process.cmdline()
    except psutil.Error:  # gone, or a zombie
        return []


def test_sigint_while_the_engine_interpreter_starts_is_ignored_by_the_engine(tiny_dirs,
                                                                             tmp_path):
    """A SIGINT that reaches the engine process while its interpreter is still starting
    (before ``engine_main`` runs) neither kills it nor prints a traceback: it goes on to load,
    and Ctrl-C then exits ``serve`` cleanly (before: KeyboardInterrupt in the engine's
    start-up, a traceback on the server's stderr, and the server failed)."""
    import psutil

    from tests.support.slow_engine import loading_pids, slow_engine_env

    env, marker = slow_engine_env(tmp_path)

    def when(proc):
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and proc.poll() is None:
            engine = [c for c in psutil.Process(proc.pid).children()
                      if "--multiprocessing-fork" in _cmdline(c)]
            if engine:
                os.kill(engine[0].pid, signal.SIGINT)
                break
            time.sleep(0.002)
        else:
            raise AssertionError("no engine process started")
        loading_pids(marker, 1, proc)

    assert_clean(*interrupt(["serve", "--model", str(tiny_dirs["llama"]), "--port", "0"],
                            when, env=env, exit_within=15))


@pytest.mark.parametrize("group", [True, False], ids=["ctrl-c", "kill-int-demo-alone"])
def test_interrupted_demo_start_up_exits_at_once_and_leaves_no_process(
        tiny_dirs, tmp_path, group):
    """``latentserve demo`` interrupted while its server's engine loads, by Ctrl-C (its
    process group) or ``kill -INT`` of the demo alone: it exits within seconds and its
    server and engine are gone (before: SIGINT to the demo alone waited for the server to
    be ready, then left it running)."""
    from tests.support.slow_engine import alive_after, loading_pids, slow_engine_env

    models = tmp_path / "models"
    models.mkdir()
    (models / "smollm2-mult-cot").symlink_to(tiny_dirs["llama"])
    env, marker = slow_engine_env(tmp_path)
    family = []

    def when(proc):
        loading_pids(marker, 1, proc)
        family.extend(_descendants(proc.pid))  # the server, its engine and helpers

    rc, err = interrupt(["demo", "--models-dir", str(models), "--num-questions", "1"], when,
                        env=env, group=group, exit_within=15)
    assert_clean(rc, err)
    assert len(family) >= 2
    assert alive_after(family, 10) == []


def test_sigterm_while_the_engine_loads_leaves_no_engine(tiny_dirs, tmp_path):
    """A server SIGTERMed (or killed) while its model loads: its engine process exits
    within seconds too (before: it went on loading, orphaned)."""
    from tests.support.slow_engine import alive_after, loading_pids, slow_engine_env

    env, marker = slow_engine_env(tmp_path)
    proc = subprocess.Popen([sys.executable, "-m", "latentserve.server.launch", "--model",
                             str(tiny_dirs["llama"]), "--port", "0"], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        engines = loading_pids(marker, 1, proc)
        proc.terminate()
        proc.wait(15)
        assert alive_after(engines, 5) == []
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_a_ctrl_c_lost_in_a_weakref_callback_is_sent_again():
    """A KeyboardInterrupt raised inside a weakref callback (where the SIGINT of a Ctrl-C lands
    when an import releases its module lock) is one Python ignores; with the CLI's
    ``sys.unraisablehook`` the signal is sent again and interrupts the code after it."""
    script = ("import signal, sys, weakref\n"
              "from latentserve.cli import resend_lost_interrupt\n"
              "signal.signal(signal.SIGINT, signal.default_int_handler)\n"
              "sys.unraisablehook = resend_lost_interrupt\n"
              "class A: pass\n"
              "def cb(_): raise KeyboardInterrupt\n"
              "a = A(); r = weakref.ref(a, cb)\n"
              "try:\n"
              "    del a\n"
              "    import time; time.sleep(30)\n"
              "except KeyboardInterrupt:\n"
              "    sys.exit(130)\n")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
                          timeout=60)
    assert proc.returncode == 130, proc.stderr
    assert "Exception ignored" not in proc.stderr, proc.stderr
