"""The engine in its own process: a loop around ``LLMEngine.step()`` fed over ZMQ.
Design notes: docs/internals.md, "latentserve.server.engine_process"."""

from __future__ import annotations

import functools
import logging
import os
import pickle
import shutil
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass

from latentserve.config import EngineConfig
from latentserve.outputs import StepOutput
from latentserve.server.grammar_worker import GrammarWorker
from latentserve.server.messages import (
    Abort,
    AddRequest,
    Answer,
    EngineFailed,
    Query,
    Ready,
    RequestFailed,
    Shutdown,
    StartupFailed,
    StepOutputs,
)

log = logging.getLogger(__name__)

# How often a process checks that its parent still exists (watch_parent; an idle engine, or
# one waiting to send): an orphaned engine exits within this long, busy or idle.
PARENT_CHECK_S = 0.5
_POLL_MS = int(PARENT_CHECK_S * 1000)  # an idle poll or a blocked send wakes up this often
# How often an idle loop checks the grammar worker while a compile is parked (ms).
_GRAMMAR_POLL_MS = 2
# Forward failures in a row (with no good step between) after which the engine gives up.
MAX_CONSECUTIVE_STEP_FAILURES = 3


class EngineStartupError(RuntimeError):
    """The engine process could not load the model or died before it was ready."""


@dataclass(frozen=True, slots=True)
class EngineAddresses:
    """Where the engine's two ZMQ sockets are bound."""

    input: str
    output: str


# --- child side ----------------------------------------------------------------------------


def engine_main(config: EngineConfig, addresses: EngineAddresses, ready_conn,
                parent_pid: int, log_level: str = "info") -> None:
    """The engine process: load, report readiness, then serve until told to stop or the
    parent process is gone. ``log_level``: uvicorn's names ("trace" logs as debug)."""
    import signal

    import zmq

    # the parent decides when the engine stops (start_ignoring_sigint, docs/internals.md)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    loaded = threading.Event()  # from then on EngineLoop watches the parent
    watch_parent(parent_pid, functools.partial(os._exit, 1), until=loaded)
    name = "DEBUG" if str(log_level).upper() == "TRACE" else str(log_level).upper()
    logging.basicConfig(level=getattr(logging, name, logging.INFO),
                        format="%(asctime)s engine %(levelname)s %(message)s")
    ctx = zmq.Context()
    try:
        # NOTE: torch, in the engine process only (the API process imports this module)
        from latentserve.engine.llm_engine import LLMEngine

        engine = LLMEngine(config)
        engine.warmup()
        log.info("gc: %d objects of the loaded engine frozen", freeze_heap())
        inbox = ctx.socket(zmq.PULL)
        inbox.bind(addresses.input)
        outbox = ctx.socket(zmq.PUSH)
        outbox.setsockopt(zmq.SNDHWM, 0)  # outputs are never dropped
        # A PUSH socket with no peer blocks its sender: wake up to check that the API
        # process still exists (EngineLoop._send).
        outbox.setsockopt(zmq.SNDTIMEO, _POLL_MS)
        outbox.bind(addresses.output)
        ready = Ready(engine.model_name, engine.max_model_len,
                      getattr(engine, "vocab_size", None), engine.tokenizer,
                      engine.latent_spec, engine.sampling_defaults)
    except BaseException as exc:  # noqa: BLE001 - reported to the parent, then exit
        ready_conn.send_bytes(pickle.dumps(StartupFailed(f"{type(exc).__name__}: {exc}",
                                                  traceback.format_exc())))
        ready_conn.close()
        ctx.destroy(linger=0)
        raise SystemExit(1) from None
    loaded.set()
    ready_conn.send_bytes(pickle.dumps(ready))
    ready_conn.close()
    loop = EngineLoop(engine, inbox, outbox, parent_pid)
    try:
        loop.run()
    finally:
        if loop.orphaned:  # leave at once: remove the sockets' private directory (nobody else
            # will) and skip the interpreter's teardown (seconds with torch loaded)
            shutil.rmtree(os.path.dirname(addresses.input.removeprefix("ipc://")),
                          ignore_errors=True)
            logging.shutdown()
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(0)
        ctx.destroy(linger=1000)


def freeze_heap() -> int:
    """Collect, then move every tracked object into the garbage collector's permanent
    generation (``gc.freeze``): full collections while serving skip the loaded engine, torch
    and the model (docs/server.md, "Garbage collection"). Returns how many objects are frozen
    in all. Only for a process that keeps one engine until it exits: frozen cycles are never
    freed."""
    import gc

    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


def watch_parent(parent_pid: int, on_gone: Callable[[], object],
                 until: threading.Event | None = None) -> None:
    """Call ``on_gone()`` from a daemon thread once ``parent_pid`` is no longer this process's
    parent (checked every ``PARENT_CHECK_S`` s), unless ``until`` is set first."""
    stop = until or threading.Event()

    def watch() -> None:
        while not stop.wait(PARENT_CHECK_S):
            if os.getppid() != parent_pid:
                log.info("parent process %d is gone", parent_pid)
                on_gone()
                return

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


class EngineLoop:
    """Receive messages, step the engine while it has work, send what each step produced.

    Blocks on the input socket while idle. A rejected request gets ``RequestFailed``; when
    ``step()`` raises, its running requests are aborted with ``RequestFailed(internal=True)``
    and the loop goes on, until ``MAX_CONSECUTIVE_STEP_FAILURES`` in a row or a dead
    tensor-parallel worker: then ``EngineFailed`` is sent and the exception re-raised.
    """

    def __init__(self, engine, inbox, outbox, parent_pid: int | None = None):
        self.engine = engine
        self.inbox = inbox
        self.outbox = outbox
        self.parent_pid = parent_pid
        self.running = True
        self.orphaned = False  # the loop ended because the parent process is gone
        self.failed_steps = 0
        self.queued_at: dict[str, float] = {}  # added, not yet scheduled: when it came
        self.scheduled: dict[str, tuple[float, float]] = {}  # to send: (queued, scheduled)
        # requests and checks with structured outputs wait here while their grammar compiles
        self.grammars = GrammarWorker(engine.compile_grammar,
                                      engine.config.grammar_compile_timeout)

    def run(self) -> None:
        import zmq

        poller = zmq.Poller()
        poller.register(self.inbox, zmq.POLLIN)
        while self.running:
            if self._parent_gone():  # every step: nobody reads the outputs of a busy engine
                self._orphan()
                return
            busy = self.engine.has_unfinished_requests()
            idle_ms = _GRAMMAR_POLL_MS if self.grammars.parked else _POLL_MS
            if poller.poll(0 if busy else idle_ms):
                self._drain()
            elif not busy and (gone := self._workers_gone()):
                self._fail_engine(gone)
                raise RuntimeError(gone)
            if self.grammars.parked:
                self._unpark()
            if self.running and self.engine.has_unfinished_requests():
                self._step()

    def _drain(self) -> None:
        import zmq

        while self.running:
            try:
                message = self.inbox.recv_pyobj(zmq.NOBLOCK)
            except zmq.Again:
                return
            self.handle(message)

    def handle(self, message: object, compiled: bool = False) -> None:
        """Apply one incoming message to the engine. A request or check with structured
        outputs first waits for its grammar (``GrammarWorker``) unless ``compiled``."""
        if not compiled and self._park(message):
            return
        if isinstance(message, AddRequest):
            try:
                self.engine.add_request(message.rid, message.prompt_token_ids, message.params)
                self.queued_at[message.rid] = time.monotonic()
            except Exception as exc:  # noqa: BLE001 - any rejection goes back to the caller
                self._send(RequestFailed(message.rid, str(exc)))
        elif isinstance(message, Abort):
            if self.grammars.drop(message.rid):  # never reached the engine: its final output
                self._send(StepOutputs([StepOutput(message.rid, [], True, "abort")]))
                return
            try:
                self.engine.abort_request(message.rid)
            except Exception:  # noqa: BLE001 - aborting a finished request is harmless
                log.debug("abort of %s ignored", message.rid, exc_info=True)
        elif isinstance(message, Query):
            check = message.check
            answer = Answer(message.key, None if check else self.engine.stats())
            try:
                if check is not None:
                    self.engine.check_request(check.prompt_token_ids, check.params)
            except Exception as exc:  # noqa: BLE001 - a rejection goes back to the caller
                answer.error = str(exc)
            self._send(answer)
        elif isinstance(message, Shutdown):
            self.running = False
        else:
            log.warning("ignoring unknown message %r", type(message).__name__)

    def _park(self, message: object) -> bool:
        """Hand ``message`` to the grammar worker when it carries structured outputs."""
        add = message.check if isinstance(message, Query) else message
        if not isinstance(add, AddRequest) or add.params.structured_outputs is None:
            return False
        self.grammars.park(add.rid, add.params.structured_outputs, message)
        return True

    def _unpark(self) -> None:
        """Apply the parked messages whose grammar compiled; answer the others' errors."""
        for message, error in self.grammars.ready():
            if error is None:
                self.handle(message, compiled=True)
            elif isinstance(message, Query):
                self._send(Answer(message.key, None, error))
            else:
                self._send(RequestFailed(message.rid, error))

    def _note_scheduled(self, started: float, outputs) -> None:
        """Record when each waiting request was first scheduled (the start of the step after
        which it runs or has an output); forget one aborted before it ran."""
        if not self.queued_at:
            return
        seen = {r.rid for r in self.engine.scheduler.running}
        for out in outputs:
            if out.finish_reason in ("abort", "error") and out.rid not in seen:
                self.queued_at.pop(out.rid, None)
            else:
                seen.add(out.rid)
        for rid in seen.intersection(self.queued_at):
            self.scheduled[rid] = (self.queued_at.pop(rid), started)

    def _step(self) -> None:
        started = time.monotonic()
        try:
            outputs = self.engine.step()
        except Exception as exc:
            self.failed_steps += 1
            gone = self._workers_gone()  # a dead rank fails every later step: stop now
            if gone or self.failed_steps >= MAX_CONSECUTIVE_STEP_FAILURES:
                self._fail_engine(gone or f"{type(exc).__name__}: {exc}")
                raise
            log.exception("engine step failed; failing the running requests")
            self._fail_running(f"the engine failed while running this request "
                               f"({type(exc).__name__})")
            return
        self.failed_steps = 0
        self._note_scheduled(started, outputs)
        if outputs or self.scheduled:  # a first prefill chunk has no output yet
            self._send(StepOutputs(outputs, self.scheduled))
            self.scheduled = {}

    def _fail_running(self, error: str) -> None:
        """Abort every admitted request (its KV is released) and tell its caller."""
        for req in list(self.engine.scheduler.running):
            try:
                self.engine.abort_request(req.rid)
            except Exception:  # noqa: BLE001 - keep failing the others
                log.exception("could not abort %s", req.rid)
            self.queued_at.pop(req.rid, None)
            self._send(RequestFailed(req.rid, error, internal=True))

    def _fail_engine(self, error: str) -> None:
        """Tell the server this engine is gone for good (it then answers 503)."""
        log.error("engine failed: %s", error)
        self._send(EngineFailed(error))

    def _send(self, message: object) -> None:
        """Send ``message`` to the API process, waiting while it has no reader; once the
        parent process is gone, drop it and stop the loop."""
        import zmq

        while True:
            try:
                self.outbox.send_pyobj(message)
                return
            except zmq.Again:
                if self._parent_gone():
                    self._orphan()
                    return

    def _orphan(self) -> None:
        log.info("parent process is gone; engine exits")
        self.running, self.orphaned = False, True

    def _workers_gone(self) -> str | None:
        """Why the engine cannot step any more because a tensor-parallel worker exited."""
        dead = getattr(self.engine, "dead_workers", list)()
        return f"tensor-parallel worker {', '.join(dead)} exited" if dead else None

    def _parent_gone(self) -> bool:
        return self.parent_pid is not None and os.getppid() != self.parent_pid


# --- parent side ---------------------------------------------------------------------------


class EngineProcess:
    """Start the engine process and wait until it is ready (a context manager); then
    ``ready`` holds its ``Ready`` message and ``addresses`` its sockets. :meth:`start` raises
    ``EngineStartupError`` (the child's traceback in its notes) when loading failed, the
    child died, or it was not ready within ``startup_timeout`` seconds.
    """

    def __init__(self, config: EngineConfig, startup_timeout: float = 600.0,
                 log_level: str = "info"):
        self.config = config
        self.startup_timeout = startup_timeout
        self.log_level = log_level
        self.ready: Ready | None = None
        self.addresses: EngineAddresses | None = None
        self._proc = None
        self._dir: str | None = None
        self._cancel = threading.Event()

    def cancel(self) -> None:
        """Make a :meth:`start` waiting in another thread stop and raise within 0.2 s."""
        self._cancel.set()

    def start(self) -> Ready:
        import multiprocessing as mp

        ctx = mp.get_context("spawn")
        self._dir = tempfile.mkdtemp(prefix="latentserve-")
        self.addresses = EngineAddresses(f"ipc://{self._dir}/input.sock",
                                         f"ipc://{self._dir}/output.sock")
        parent_conn, child_conn = ctx.Pipe(duplex=False)
        self._proc = ctx.Process(
            target=engine_main, name="latentserve-engine", daemon=True,
            args=(self.config, self.addresses, child_conn, os.getpid(), self.log_level),
        )
        try:
            start_ignoring_sigint(self._proc)
            child_conn.close()
            self.ready = self._wait_ready(parent_conn)
        except BaseException:
            self.stop()
            raise
        finally:
            child_conn.close()
            parent_conn.close()
        return self.ready

    def _wait_ready(self, conn) -> Ready:
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            if self._cancel.is_set():
                raise EngineStartupError("engine start-up cancelled")
            if conn.poll(0.2):
                try:
                    message = pickle.loads(conn.recv_bytes())
                except EOFError:
                    break  # the child closed its end without a word: it died
                if isinstance(message, Ready):
                    return message
                if isinstance(message, StartupFailed):
                    err = EngineStartupError(f"engine failed to start: {message.error}")
                    err.add_note(message.traceback)
                    raise err
                raise EngineStartupError(f"unexpected start-up message {message!r}")
            if not self._proc.is_alive():
                break
        else:
            raise EngineStartupError(
                f"engine was not ready within {self.startup_timeout:.0f} s")
        # NOTE: a dying child closes its pipe end a moment before it can be reaped.
        self._proc.join(5)
        raise EngineStartupError(
            f"engine process exited with code {self._proc.exitcode} before it was ready")

    @property
    def pid(self) -> int | None:
        """The engine process's id (None before :meth:`start`)."""
        return None if self._proc is None else self._proc.pid

    def is_alive(self) -> bool:
        """Whether the engine process is still running."""
        return self._proc is not None and self._proc.is_alive()

    def stop(self, timeout: float = 10.0) -> None:
        """Ask the engine to exit, then terminate or kill it if it does not; remove the
        sockets."""
        proc = self._proc
        if proc is not None:
            if proc.is_alive() and self.ready is not None:
                import zmq

                with zmq.Context() as ctx, ctx.socket(zmq.PUSH) as sock:
                    sock.setsockopt(zmq.LINGER, 2000)
                    sock.connect(self.addresses.input)
                    sock.send_pyobj(Shutdown())
                proc.join(timeout)
            for end in (proc.terminate, proc.kill):
                if proc.is_alive():
                    end()
                    proc.join(timeout)
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None

    def __enter__(self) -> EngineProcess:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def start_ignoring_sigint(proc) -> None:
    """``proc.start()`` (a ``spawn`` ``multiprocessing.Process`` running :func:`engine_main`)
    with SIGINT blocked, which the child inherits; a SIGINT of this process during the start
    is raised again once the child is started (docs/internals.md)."""
    import signal
    from multiprocessing import resource_tracker

    # NOTE: ``start`` launches multiprocessing's resource tracker the first time, and that
    # unblocks SIGINT in this thread on its way out: have it running before SIGINT is blocked.
    resource_tracker.ensure_running()
    held: list = []
    in_main = threading.current_thread() is threading.main_thread()
    previous = signal.getsignal(signal.SIGINT) if in_main else None  # None: not Python's
    if previous is not None:
        signal.signal(signal.SIGINT, lambda *a: held.append(a))
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        proc.start()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        if previous is not None:
            signal.signal(signal.SIGINT, previous)
            if held:
                signal.raise_signal(signal.SIGINT)
