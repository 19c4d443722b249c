"""SIGTERM: the server stops accepting connections, lets running requests finish, stops the
engine and exits."""

import json
import os
import signal
import time

import httpx
import pytest
from server_testlib import A, engine_processes


def _children(pid: int) -> list[int]:
    path = f"/proc/{pid}/task/{pid}/children"
    if not os.path.exists(path):
        pytest.skip("needs Linux /proc")
    with open(path) as f:
        return [int(p) for p in f.read().split()]


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[1][0] != "Z"
    except FileNotFoundError:
        return False


def test_sigterm_drains_a_running_stream_then_exits(scripted_model_dir):
    from latentserve.config import EngineConfig
    from latentserve.server.launch import start_server

    srv = start_server(EngineConfig(model=str(scripted_model_dir), max_num_seqs=2),
                       timeout=300, drain_timeout=60)
    try:
        children = _children(srv.proc.pid)
        assert children  # the engine process (and multiprocessing's helpers)
        body = {"prompt": [A], "max_tokens": 250, "ignore_eos": True,
                "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
        chunks_after_sigterm, usage, reasons, attempt = 0, None, [], None
        with httpx.Client(base_url=srv.base_url, timeout=60) as c, \
                c.stream("POST", "/v1/completions", json=body) as r:
            lines = r.iter_lines()
            next(lines)  # generating
            srv.proc.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + 5
            while attempt != "ConnectError" and time.monotonic() < deadline:
                time.sleep(0.1)  # uvicorn checks for the signal every 0.1 s
                try:  # a new connection while the stream is draining
                    attempt = httpx.get(f"{srv.base_url}/health", timeout=2).status_code
                except httpx.HTTPError as exc:
                    attempt = type(exc).__name__
            still_running = srv.proc.poll() is None
            for line in lines:
                if not line.startswith("data: {"):
                    continue
                chunk = json.loads(line[6:])
                usage = chunk.get("usage") or usage
                chunks_after_sigterm += 1
                reasons += [ch["finish_reason"] for ch in chunk["choices"]
                            if ch["finish_reason"]]
        assert attempt == "ConnectError" and still_running  # draining, not accepting
        assert reasons == ["length"] and usage["completion_tokens"] == 250
        assert chunks_after_sigterm > 100  # the loop writes text on every token
        srv.proc.wait(30)
        deadline = time.monotonic() + 10  # children notice their parent is gone
        while any(_alive(p) for p in children) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(_alive(p) for p in children)
    finally:
        srv.stop()


def test_requests_left_at_the_drain_timeout_end_cleanly_then_the_server_exits(
        scripted_model_dir):
    """A stream still running when the drain timeout ends is aborted in the engine just
    before it: it gets a finish chunk and [DONE] (not a cut-off connection), and the
    server exits soon after."""
    from latentserve.config import EngineConfig
    from latentserve.server.launch import start_server

    drain = 0.0  # the abort comes at the signal (250 tokens take < 0.5 s)
    srv = start_server(EngineConfig(model=str(scripted_model_dir), max_num_seqs=2),
                       timeout=300, drain_timeout=drain)
    try:
        body = {"prompt": [A], "max_tokens": 250, "ignore_eos": True,
                "temperature": 0, "stream": True}
        reasons, done = [], False
        with httpx.Client(base_url=srv.base_url, timeout=60) as c, \
                c.stream("POST", "/v1/completions", json=body) as r:
            lines = r.iter_lines()
            next(lines)  # generating
            srv.proc.send_signal(signal.SIGTERM)
            t0 = time.monotonic()
            for line in lines:
                done = done or line == "data: [DONE]"
                if line.startswith("data: {"):
                    reasons += [ch["finish_reason"] for ch in json.loads(line[6:])["choices"]
                                if ch["finish_reason"]]
            ended = time.monotonic() - t0
        assert reasons == ["abort"] and done
        assert ended < drain + 3
        srv.proc.wait(30)
    finally:
        srv.stop()


def test_a_killed_engine_is_logged_and_the_server_exits_non_zero(scripted_model_dir):
    """With its only engine process killed, the server logs it, fails the stream in flight
    (an error event, no hang) and exits non-zero within seconds, so a supervisor restarts
    it (before: it answered 503 forever, with no log line)."""
    from latentserve.config import EngineConfig
    from latentserve.server.launch import start_server

    srv = start_server(EngineConfig(model=str(scripted_model_dir), max_num_seqs=2),
                       timeout=300)
    try:
        (engine,) = engine_processes(srv)
        body = {"prompt": [A], "max_tokens": 200, "ignore_eos": True, "stream": True}
        with httpx.Client(base_url=srv.base_url, timeout=60) as c, \
                c.stream("POST", "/v1/completions", json=body) as r:
            lines = r.iter_lines()
            first = next(lines)
            engine.kill()
            rest = list(lines)  # ends: the engine's death fails the stream
        assert first.startswith("data: {") and '"error"' not in first, first
        assert any('"error"' in line for line in rest), rest[-3:]
        code = srv.proc.wait(timeout=30)
        assert code != 0
        log = srv.log_tail(20000)
        assert "the engine of" in log and "stopped" in log and "server exits" in log, log
        assert "RuntimeError: the engine process has stopped; the server exited" in log, log
    finally:
        srv.stop()


def _seconds_to_exit(pid: int, limit: float = 15.0) -> float:
    """Seconds until ``pid`` has exited (a zombie counts: its reaping is up to whoever
    adopted it, here the container's init)."""
    t0 = time.monotonic()
    while _alive(pid) and time.monotonic() - t0 < limit:
        time.sleep(0.01)
    return time.monotonic() - t0


# An orphaned engine exits within its parent check period and a margin for the exit itself
# (before: 1 s to notice, then seconds of interpreter teardown with torch loaded).
ORPHAN_EXIT_S = 0.5 + 0.5


@pytest.mark.parametrize("busy", [False, True], ids=["idle", "busy"])
def test_a_killed_api_server_ends_its_engine_within_a_second(scripted_model_dir, busy):
    """SIGKILL of the API server, its engine idle or busy with long streams: the engine
    notices its parent is gone (its idle poll, or its next step) and exits at once, its
    IPC sockets removed (before a busy one ran every request to the end, queueing outputs
    nobody reads)."""
    import threading

    from latentserve.config import EngineConfig
    from latentserve.server.engine_process import PARENT_CHECK_S
    from latentserve.server.launch import start_server

    srv = start_server(EngineConfig(model=str(scripted_model_dir), max_num_seqs=8),
                       timeout=300)
    try:
        (engine,) = engine_processes(srv)
        card = httpx.get(f"{srv.base_url}/v1/models", timeout=30).json()["data"][0]
        body = {"prompt": [A], "max_tokens": card["max_model_len"] - 2, "ignore_eos": True,
                "stream": True}
        started = threading.Barrier(9)

        def stream():
            try:
                with httpx.Client(base_url=srv.base_url, timeout=60) as c, \
                        c.stream("POST", "/v1/completions", json=body) as r:
                    lines = r.iter_lines()
                    next(lines)
                    started.wait(30)
                    for _ in lines:
                        pass
            except (httpx.HTTPError, threading.BrokenBarrierError):
                pass

        threads = [threading.Thread(target=stream) for _ in range(8 if busy else 0)]
        for t in threads:
            t.start()
        if busy:
            started.wait(30)
        sockets = {c.laddr for c in engine.net_connections("unix") if c.laddr}
        assert any(p.endswith("input.sock") for p in sockets), sockets
        srv.proc.send_signal(signal.SIGKILL)
        assert PARENT_CHECK_S + 0.5 == ORPHAN_EXIT_S
        assert _seconds_to_exit(engine.pid) < ORPHAN_EXIT_S
        assert not any(os.path.exists(p) for p in sockets)
        for t in threads:
            t.join(30)
    finally:
        srv.stop()
