"""``latentserve serve`` with a model that cannot be loaded: one error line, no traceback
(neither the API process's nor the engine process's), and a non-zero exit."""

import json
import subprocess
import sys

import pytest


def _serve(model: str) -> subprocess.CompletedProcess:
    code = "import sys; from latentserve.cli import main; sys.exit(main(sys.argv[1:]))"
    return subprocess.run([sys.executable, "-c", code, "serve", "--model", model,
                           "--port", "0"], capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("kind", ["missing", "bad-config"])
def test_bad_model_path_prints_one_error_line_and_exits_non_zero(tmp_path, kind):
    model = tmp_path / "model"
    if kind == "bad-config":
        model.mkdir()
        (model / "config.json").write_text(json.dumps({"model_type": "no-such-arch"}))
    done = _serve(str(model))
    assert done.returncode != 0
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("latentserve: error")]
    # Library warnings may precede it; the error itself is one line, and the last.
    assert errors == [lines[-1]], done.stderr
    assert lines[-1].startswith("latentserve: error: EngineStartupError: engine failed to "
                                "start:"), lines[-1]
    if kind == "missing":
        assert f"'{model}' does not exist" in lines[-1]
    assert "Traceback" not in done.stderr + done.stdout


def test_busy_port_is_one_error_line_before_any_model_loads(tmp_path):
    """The port is bound before the engine starts: a busy one is refused at once, naming the
    address (the model path here does not exist, and is never reached)."""
    import socket
    import time

    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    port = busy.getsockname()[1]
    code = "import sys; from latentserve.cli import main; sys.exit(main(sys.argv[1:]))"
    start = time.monotonic()
    try:
        done = subprocess.run([sys.executable, "-c", code, "serve", "--model",
                               str(tmp_path / "never-loaded"), "--port", str(port)],
                              capture_output=True, text=True, timeout=120)
    finally:
        busy.close()
    assert done.returncode != 0 and time.monotonic() - start < 60
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith(f"latentserve: error: cannot listen on 127.0.0.1:{port}"), last
    assert "never-loaded" not in done.stderr and "Traceback" not in done.stderr


def test_start_server_picks_another_port_when_its_pick_is_taken(tiny_model_dir, monkeypatch):
    """The race of a picked free port taken before the server binds it (a flaky replica
    test): the server refuses at once and ``start_server`` picks again."""
    import socket

    from latentserve.config import EngineConfig
    from latentserve.server import launch

    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    taken = busy.getsockname()[1]
    picks = iter([taken])
    real = launch.free_port
    monkeypatch.setattr(launch, "free_port", lambda host: next(picks, None) or real(host))
    try:
        srv = launch.start_server(EngineConfig(model=str(tiny_model_dir)), timeout=300)
    finally:
        busy.close()
    try:
        import httpx

        assert srv.port != taken
        assert httpx.get(f"{srv.base_url}/health", timeout=10).status_code == 200
    finally:
        srv.stop()
