"""Start the server: :func:`run_server` in this process, or :func:`start_server` as a
subprocess ready once ``/health`` answers. ``python -m latentserve.server.launch --model DIR
--port 8000`` runs :func:`run_server`; ``--model A --model B`` serves several models."""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, replace
from dataclasses import fields as fields_of
from pathlib import Path

from latentserve import settings
from latentserve.config import EngineConfig
from latentserve.options import add_options, options_of
from latentserve.server.app import create_app
from latentserve.server.client import EngineClient
from latentserve.server.engine_process import EngineProcess, EngineStartupError, watch_parent
from latentserve.server.options import API_KEY_ENV, ServerOptions
from latentserve.server.prompts import apply_chat_template, load_chat_template
from latentserve.server.state import ServerLimits, ServerState
from latentserve.server.timeouts import protocol_class

log = logging.getLogger(__name__)

# Set by a supervising process (``start_server``): the server stops (as on SIGTERM)
# when the process with this pid is no longer its parent, e.g. after a SIGKILL.
PARENT_PID_ENV = "LATENTSERVE_PARENT_PID"
# The name a model is served as when EngineConfig.model is None (LLMEngine's rule).
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
# Seconds the requests still running when the drain timeout ends (then aborted) have to get
# their final answer before uvicorn cancels them (a plain 500 under a heavily loaded host).
_ANSWER_ABORTED_S = 5.0


def served_model_name(config: EngineConfig) -> str:
    """The first ``served_model_name``, else the ``model`` path (or the default's name)."""
    return (config.served_model_name or [config.model or DEFAULT_MODEL_NAME])[0]


def check_model_names(configs: EngineConfig | list[EngineConfig]) -> list[EngineConfig]:
    """``configs`` as a list. Raises ValueError for no config or a name served twice (naming
    both ``--model`` paths)."""
    configs = [configs] if isinstance(configs, EngineConfig) else list(configs)
    if not configs:
        raise ValueError("no model to serve: give at least one --model")
    seen: dict[str, int] = {}
    for i, config in enumerate(configs):
        for name in config.served_model_name or (served_model_name(config),):
            if name in seen and seen[name] != i:
                j = seen[name]
                raise ValueError(
                    f"models {j + 1} and {i + 1} would both be served as {name!r} "
                    f"(--model {configs[j].model or '(default)'} and --model "
                    f"{config.model or '(default)'}); give each model once")
            if name in seen:
                raise ValueError(f"--served-model-name gives {name!r} twice")
            seen[name] = i
    return configs


def start_engines(configs: list[EngineConfig], log_level: str = "info") -> list:
    """One ready ``EngineProcess`` per config, started in parallel. ``EngineStartupError``
    (prefixed with the model's name) after stopping the others when one fails."""
    engines = [EngineProcess(c, log_level=log_level) for c in configs]
    if len(engines) == 1:
        engines[0].start()
        return engines
    with ThreadPoolExecutor(len(engines)) as pool:
        futures = [pool.submit(e.start) for e in engines]
        try:
            failed = [(c, exc) for c, f in zip(configs, futures) if (exc := f.exception())]
        except BaseException:  # Ctrl-C while they load: stop them now, not once loaded
            for e in engines:
                e.cancel()
            pool.shutdown()
            for e in engines:
                e.stop()
            raise
    if failed:
        for e in engines:
            e.stop()
        config, exc = failed[0]
        exc.args = (f"{served_model_name(config)}: {exc}",) + exc.args[1:]
        raise exc
    return engines


def run_server(config: EngineConfig | list[EngineConfig],
               options: ServerOptions | None = None) -> None:
    """Start one engine process per config, then serve HTTP with uvicorn until
    SIGINT/SIGTERM; the engines are stopped on the way out (call under ``__main__``: they
    start with ``spawn``). ``options`` None: the defaults; its ``api_key`` None: the
    ``LATENTSERVE_API_KEY`` environment variable's. When all engines die the server exits.

    Raises:
        ValueError: a name served twice, a bad ``chat_template``, or ``host:port`` cannot
            be bound (checked before any model loads).
        RuntimeError: every engine process stopped while serving.
        EngineStartupError: an engine could not start (the others are stopped).
    """
    import uvicorn

    o = options or ServerOptions()
    configs = check_model_names(config)
    template = load_chat_template(o.chat_template)
    if not logging.getLogger().handlers:  # latentserve's records to stderr at o.log_level
        name = "DEBUG" if o.log_level.upper() == "TRACE" else o.log_level.upper()
        logging.basicConfig(level=logging.WARNING,
                            format="%(asctime)s api %(levelname)s %(message)s")
        logging.getLogger("latentserve").setLevel(getattr(logging, name, logging.INFO))
    limits = ServerLimits(**{k: getattr(o, k) for k in (
        "max_request_body_bytes", "max_request_output_tokens", "max_waiting_requests",
        "queue_timeout") if getattr(o, k) is not None},
        max_logprobs=min(c.max_logprobs for c in configs) if all(
            c.max_logprobs >= 0 for c in configs) else None)
    sock = listen_socket(o.host, o.port)  # a busy port fails now, not after the model loads
    for cfg in configs:  # as vLLM logs its engine config: what each flag resolved to
        log.info("engine config of %s: %s", served_model_name(cfg), cfg)
    try:
        engines = start_engines(configs, o.log_level)
    except BaseException:
        sock.close()
        raise

    def stop_engines() -> None:  # all at once: each may wait for its engine to exit
        with ThreadPoolExecutor(len(engines)) as pool:
            list(pool.map(lambda e: e.stop(), engines))

    try:
        states = []
        for engine, cfg in zip(engines, configs):
            ready = engine.ready
            client = EngineClient(engine.addresses.input, engine.addresses.output,
                                  is_alive=engine.is_alive)
            apply_chat_template(ready.tokenizer, template)
            names = cfg.served_model_name or (ready.model_name,)
            states.append(ServerState(
                client, ready.tokenizer, names[0], ready.max_model_len, ready.vocab_size,
                limits=limits, latent_spec=ready.latent_spec, max_num_seqs=cfg.max_num_seqs,
                aliases=names[1:], root=cfg.model or ready.model_name,
                sampling_defaults=ready.sampling_defaults or {}, tool_parser=o.tool_call_parser,
                reasoning_parser=cfg.reasoning_parser, log_requests=o.log_requests,
                max_log_len=o.max_log_len,
                trust_request_chat_template=o.trust_request_chat_template))
        app = create_app(states, on_shutdown=stop_engines, cors=o.cors,
                         api_key=o.api_key or settings.get(API_KEY_ENV))
        server = uvicorn.Server(uvicorn.Config(
            app, host=o.host, port=o.port, log_level=o.uvicorn_log_level or o.log_level,
            timeout_graceful_shutdown=o.drain_timeout + _ANSWER_ABORTED_S,
            timeout_keep_alive=o.timeout_keep_alive,
            http=protocol_class(o.timeout_request_headers, o.timeout_request_body)))
        exit_server, armed = server.handle_exit, []

        def abort_all() -> None:  # streams end with "abort" and [DONE]
            for st in states:
                st.client.abort_all()

        def handle_exit(sig, frame) -> None:  # the first signal also arms abort_all
            exit_server(sig, frame)
            try:
                loop = asyncio.get_running_loop()  # the handler runs in the loop's thread
            except RuntimeError:
                return
            if not armed:  # when drain_timeout ends
                armed.append(loop.call_soon_threadsafe(loop.call_later, o.drain_timeout,
                                                       abort_all))

        server.handle_exit = handle_exit  # uvicorn installs it when it runs

        def engine_gone(name: str, reason: str) -> None:
            log.error("the engine of %s stopped: %s", name, reason)
            if all(s.client.dead_reason for s in states):
                log.error("no engine is left: the server exits")
                server.should_exit = True

        for st in states:
            st.client.on_dead = functools.partial(engine_gone, st.model_name)
        server.run(sockets=[sock])
        if all(s.client.dead_reason for s in states):
            raise RuntimeError(f"{states[0].client.dead_reason}; the server exited")
    finally:
        sock.close()
        stop_engines()


def listen_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``host:port`` (IPv6 if ``host`` has a colon); ValueError."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET,
                         socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise ValueError(f"cannot listen on {host}:{port}: {e.strerror or e} (another server "
                         f"on that port? choose one with --port)") from None
    return sock


@dataclass
class ServerProcess:
    """A server running as a subprocess (see :func:`start_server`); a context manager."""

    proc: subprocess.Popen
    host: str
    port: int
    log_path: Path

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
        """SIGTERM, then SIGKILL after ``timeout`` seconds; the exit code."""
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


def start_server(config: EngineConfig | list[EngineConfig], host: str = "127.0.0.1",
                 port: int | None = None, timeout: float = 600.0,
                 log_path: str | os.PathLike | None = None, env: dict[str, str] | None = None,
                 on_wait: Callable[[], None] | None = None, **options) -> ServerProcess:
    """Run ``python -m latentserve.server.launch`` as a subprocess and wait for ``/health``.
    ``options``: :class:`ServerOptions` fields; ``port`` None: a free one (three tries);
    ``log_path`` None: a temp file; ``on_wait``: called every 0.25 s while it starts. The
    server stops when this process is gone, or this call is interrupted.

    Raises:
        TypeError: a field :class:`ServerOptions` does not have.
        ValueError: a name served twice, an option (``port``, ``timeout`` too) out of its
            range.
        RuntimeError: the server exited or was not healthy within ``timeout`` seconds (with
            the end of its log).
    """
    import httpx

    configs = check_model_names(config)
    if not timeout > 0:
        raise ValueError(f"timeout must be > 0 seconds, got {timeout!r}")
    chosen_port = {} if port is None else {"port": port}  # checked with the options
    # a misspelt or out-of-range option fails here, before any process starts
    unknown = sorted(set(options) - {f.name for f in fields_of(ServerOptions)})
    if unknown:
        engine = [n for n in unknown if n in {f.name for f in fields_of(EngineConfig)}]
        raise TypeError(f"start_server got unknown option(s) {', '.join(unknown)}; it takes "
                        "ServerOptions fields" + (f" ({', '.join(engine)}: an EngineConfig "
                                                  "field, give it in config)" if engine else ""))
    fields = asdict(ServerOptions(host=host, **chosen_port, **options))
    api_key = fields.pop("api_key")  # by the environment, not on the command line
    if log_path is None:
        fd, log_path = tempfile.mkstemp(prefix="latentserve-server-", suffix=".log")
        os.close(fd)
    log_path = Path(log_path)
    cmd = [sys.executable, "-m", "latentserve.server.launch"]
    for c in configs:
        cmd += ["--config-json", json.dumps(asdict(c))]
    cmd += ["--options-json", json.dumps({k: v for k, v in fields.items() if k != "port"})]
    child_env = {**os.environ, "HF_HUB_OFFLINE": "1", PARENT_PID_ENV: str(os.getpid()),
                 **(env or {})}
    child_env.pop(API_KEY_ENV, None)
    if api_key is not None:
        child_env[API_KEY_ENV] = api_key
    deadline = time.monotonic() + timeout
    # A port picked here can be taken by another process before the server binds it (the
    # server says so at once, before loading): pick another, up to three times.
    for attempt in range(1 if port else 3):
        chosen = port or free_port(host)
        with open(log_path, "wb") as log:
            proc = subprocess.Popen([*cmd, "--port", str(chosen)], stdout=log,
                                    stderr=subprocess.STDOUT, env=child_env)
        server = ServerProcess(proc, host, chosen, log_path)
        try:
            while proc.poll() is None and time.monotonic() < deadline:
                if on_wait is not None:
                    on_wait()
                try:
                    if httpx.get(f"{server.base_url}/health", timeout=2.0).status_code == 200:
                        return server
                except httpx.HTTPError:
                    pass
                time.sleep(0.25)
        except BaseException:  # interrupted: leave no server behind
            server.stop()
            raise
        if proc.poll() is None or "cannot listen on" not in server.log_tail() or attempt == 2:
            break
    if proc.poll() is not None:
        raise RuntimeError(f"server exited with code {proc.returncode} before it was "
                           f"ready; log:\n{server.log_tail()}")
    server.stop()
    raise RuntimeError(f"server not healthy within {timeout:.0f} s; log:\n{server.log_tail()}")


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def main(argv: list[str] | None = None) -> None:
    """``python -m latentserve.server.launch``: serve one model or several."""
    parser = argparse.ArgumentParser(description="latentserve OpenAI-compatible server")
    parser.add_argument("--model", action="append", default=None,
                        help="model directory or .gguf file (repeat to serve several)")
    parser.add_argument("--config-json", action="append", default=None,
                        help="EngineConfig fields as a JSON object, one per model (overrides "
                             "--model)")
    parser.add_argument("--options-json", default="{}",
                        help="ServerOptions fields as a JSON object (overrides the flags; "
                             "start_server's way)")
    add_options(parser, ServerOptions)
    args = parser.parse_args(argv)
    configs = ([EngineConfig(**json.loads(c)) for c in args.config_json] if args.config_json
               else [EngineConfig(model=m) for m in args.model or [None]])

    parent = os.environ.pop(PARENT_PID_ENV, None)
    if parent:  # its SIGTERM: the draining shutdown
        watch_parent(int(parent), functools.partial(os.kill, os.getpid(), signal.SIGTERM))
    try:
        options = options_of(ServerOptions, args)
        run_server(configs, replace(options, **json.loads(args.options_json)))
    except EngineStartupError as exc:
        notes = "".join(getattr(exc, "__notes__", ()))
        sys.exit(f"{notes}\nlatentserve: {exc}")
    except ValueError as exc:
        sys.exit(f"latentserve: error: {exc}")


if __name__ == "__main__":
    main()
