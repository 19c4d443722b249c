"""Start the server: :func:`run_server` in this process, or :func:`start_server` as a
subprocess (tests, demos) that is ready once ``/health`` answers.

``python -m latentserve.server.launch --model DIR --port 8000`` runs :func:`run_server`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

from latentserve.config import EngineConfig

API_KEY_ENV = "LATENTSERVE_API_KEY"
DEFAULT_DRAIN_TIMEOUT_S = 30.0


def run_server(config: EngineConfig, host: str = "127.0.0.1", port: int = 8000,
               log_level: str = "info", api_key: str | None = None,
               max_request_body_bytes: int | None = None,
               drain_timeout: float = DEFAULT_DRAIN_TIMEOUT_S,
               max_request_output_tokens: int | None = None) -> None:
    """Start the engine process, wait until its model is loaded and warmed up, then serve
    HTTP with uvicorn until SIGINT/SIGTERM; the engine process is stopped on the way out (by
    the app's shutdown, or the ``finally`` here when uvicorn fails to start).

    ``api_key``: required from clients on the API routes (None: open).
    ``max_request_body_bytes``: larger bodies get a 413 (None: 16 MiB).
    ``max_request_output_tokens``: a request whose prompts x n x max_tokens is larger gets a
    400 (None: ``ServerLimits``' default, 2**21).
    ``drain_timeout``: on SIGTERM/SIGINT the server stops accepting connections and lets
    running requests finish for up to this many seconds, then cancels what is left (those
    engine requests are aborted) and stops the engine.

    The engine process is started with multiprocessing's ``spawn``: a script calling this
    must do so under ``if __name__ == "__main__":``.

    Raises:
        EngineStartupError: the engine could not start (bad model path, load error, ...).
    """
    import uvicorn

    from latentserve.server.app import create_app
    from latentserve.server.client import EngineClient
    from latentserve.server.engine_process import EngineProcess
    from latentserve.server.state import ServerLimits, ServerState

    limits = ServerLimits(**{k: v for k, v in (
        ("max_request_body_bytes", max_request_body_bytes),
        ("max_request_output_tokens", max_request_output_tokens)) if v is not None})
    engine = EngineProcess(config)
    ready = engine.start()
    try:
        client = EngineClient(engine.addresses.input, engine.addresses.output,
                              is_alive=engine.is_alive)
        state = ServerState(client, ready.tokenizer, ready.model_name, ready.max_model_len,
                            ready.vocab_size, limits=limits, latent_spec=ready.latent_spec)
        app = create_app(state, on_shutdown=engine.stop, api_key=api_key)
        server = _draining_server(uvicorn, client, drain_timeout)(uvicorn.Config(
            app, host=host, port=port, log_level=log_level,
            timeout_graceful_shutdown=drain_timeout))
        server.run()
    finally:
        engine.stop()


# How long before the drain timeout the requests still running are aborted, seconds.
_ABORT_BEFORE_DRAIN_END_S = 0.5


def _draining_server(uvicorn, client, drain_timeout: float):
    """``uvicorn.Server`` that, on the first shutdown signal, schedules an abort of every
    request still running shortly before ``drain_timeout`` ends, so each finishes in the
    engine (``finish_reason`` ``"abort"``; streams get their finish chunk and ``[DONE]``)
    before uvicorn closes the connections, instead of being cut off mid-stream."""

    class DrainingServer(uvicorn.Server):
        _armed = False

        def handle_exit(self, sig, frame) -> None:
            super().handle_exit(sig, frame)
            if self._armed:
                return
            try:
                loop = asyncio.get_running_loop()  # the handler runs in the loop's thread
            except RuntimeError:
                return
            self._armed = True
            delay = max(drain_timeout - _ABORT_BEFORE_DRAIN_END_S, 0.0)
            loop.call_soon_threadsafe(loop.call_later, delay, client.abort_all)

    return DrainingServer


class ServerProcess:
    """A server running as a subprocess (see :func:`start_server`); a context manager."""

    def __init__(self, proc: subprocess.Popen, host: str, port: int, log_path: Path):
        self.proc = proc
        self.host = host
        self.port = port
        self.log_path = log_path

    @property
    def base_url(self) -> str:
        """``http://host:port`` (the OpenAI client's base_url is this + ``/v1``)."""
        return f"http://{self.host}:{self.port}"

    def log_tail(self, chars: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def stop(self, timeout: float = 30.0) -> int | None:
        """SIGTERM (uvicorn drains and shuts down, stopping the engine), then SIGKILL after
        ``timeout`` seconds. Returns the exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def start_server(config: EngineConfig, host: str = "127.0.0.1", port: int | None = None,
                 timeout: float = 600.0, log_path: str | os.PathLike | None = None,
                 env: dict[str, str] | None = None, api_key: str | None = None,
                 max_request_body_bytes: int | None = None,
                 drain_timeout: float | None = None,
                 max_request_output_tokens: int | None = None) -> ServerProcess:
    """Run ``python -m latentserve.server.launch`` for ``config`` and wait for ``/health``.

    ``port`` None picks a free one. Output goes to ``log_path`` (a temp file if None).
    ``api_key``, ``max_request_body_bytes``, ``drain_timeout`` and
    ``max_request_output_tokens`` are :func:`run_server`'s
    (the key travels in the child's environment, not on its command line).

    Raises:
        RuntimeError: the server exited or was not healthy within ``timeout`` seconds; the
            message carries the end of its log.
    """
    import httpx

    port = port or free_port(host)
    if log_path is None:
        fd, log_path = tempfile.mkstemp(prefix="latentserve-server-", suffix=".log")
        os.close(fd)
    log_path = Path(log_path)
    cmd = [sys.executable, "-m", "latentserve.server.launch", "--host", host,
           "--port", str(port), "--config-json", json.dumps(asdict(config))]
    if max_request_body_bytes is not None:
        cmd += ["--max-request-body-bytes", str(max_request_body_bytes)]
    if drain_timeout is not None:
        cmd += ["--drain-timeout", str(drain_timeout)]
    if max_request_output_tokens is not None:
        cmd += ["--max-request-output-tokens", str(max_request_output_tokens)]
    child_env = {**os.environ, "HF_HUB_OFFLINE": "1", **(env or {})}
    child_env.pop(API_KEY_ENV, None)
    if api_key is not None:
        child_env[API_KEY_ENV] = api_key
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=child_env)
    server = ServerProcess(proc, host, port, log_path)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with code {proc.returncode} before it was "
                               f"ready; log:\n{server.log_tail()}")
        try:
            if httpx.get(f"{server.base_url}/health", timeout=2.0).status_code == 200:
                return server
        except httpx.HTTPError:
            pass
        time.sleep(0.25)
    server.stop()
    raise RuntimeError(f"server not healthy within {timeout:.0f} s; log:\n{server.log_tail()}")


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def add_server_args(parser: argparse.ArgumentParser) -> None:
    """Add ``--api-key``, ``--max-request-body-bytes``, ``--drain-timeout`` and
    ``--max-request-output-tokens`` (the HTTP
    server's own flags; ``latentserve serve`` adds them too)."""
    from latentserve.server.state import DEFAULT_MAX_REQUEST_OUTPUT_TOKENS

    parser.add_argument("--api-key", default=None,
                        help=f"require this key (Bearer or x-api-key) on the API routes "
                             f"(default: ${API_KEY_ENV}, else no key)")
    parser.add_argument("--max-request-body-bytes", type=int, default=None,
                        help="refuse larger request bodies with 413 (default 16 MiB)")
    parser.add_argument("--drain-timeout", type=float, default=DEFAULT_DRAIN_TIMEOUT_S,
                        help="seconds running requests may take to finish after SIGTERM "
                             f"(default {DEFAULT_DRAIN_TIMEOUT_S:g})")
    parser.add_argument("--max-request-output-tokens", type=int, default=None,
                        help="refuse a request whose prompts x n x max_tokens exceeds this "
                             f"(default {DEFAULT_MAX_REQUEST_OUTPUT_TOKENS})")


def server_kwargs(args: argparse.Namespace) -> dict:
    """``run_server`` keyword arguments from :func:`add_server_args`' flags (the API key
    falls back to ``$LATENTSERVE_API_KEY``)."""
    return {"api_key": args.api_key or os.environ.get(API_KEY_ENV) or None,
            "max_request_body_bytes": args.max_request_body_bytes,
            "drain_timeout": args.drain_timeout,
            "max_request_output_tokens": args.max_request_output_tokens}


def main(argv: list[str] | None = None) -> None:
    """``python -m latentserve.server.launch``: serve one model."""
    parser = argparse.ArgumentParser(description="latentserve OpenAI-compatible server")
    parser.add_argument("--model", default=None, help="model directory or .gguf file")
    parser.add_argument("--config-json", default=None,
                        help="EngineConfig fields as a JSON object (overrides --model)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--log-level", default="info")
    add_server_args(parser)
    args = parser.parse_args(argv)
    fields = json.loads(args.config_json) if args.config_json else {"model": args.model}
    from latentserve.server.engine_process import EngineStartupError

    try:
        run_server(EngineConfig(**fields), host=args.host, port=args.port,
                   log_level=args.log_level, **server_kwargs(args))
    except EngineStartupError as exc:
        notes = "".join(getattr(exc, "__notes__", ()))
        sys.exit(f"{notes}\nlatentserve: {exc}")


if __name__ == "__main__":
    main()
