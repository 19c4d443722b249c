"""Grammar compiles off the engine loop: a request with structured outputs waits beside the
engine while a background thread compiles its grammar (xgrammar releases the GIL while it
compiles), so a costly grammar never stalls the steps of the other requests.
Design notes: docs/server.md, "Structured outputs and token masks"."""

from __future__ import annotations

import queue
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any


@dataclass(slots=True)
class Parked:
    """A message waiting for its grammar: ``key`` names it for :meth:`GrammarWorker.drop`;
    ``param``: the request field of the grammar (error messages); ``deadline``:
    ``time.monotonic()`` after which it is answered with a timeout."""

    key: Any
    param: str
    message: Any
    future: Future
    deadline: float


class GrammarWorker:
    """Runs ``compile_fn(so)`` for parked messages on ``threads`` (>= 1) daemon threads,
    started in arrival order; ``compile_fn`` raises ValueError for a grammar that does not
    compile and leaves the compiled grammar where the engine finds it (xgrammar's cache), so
    the engine's own compile of the request is a lookup. ``timeout_s`` (> 0): how long a
    message may wait for its compile, queueing included. A compile past its time cannot be
    stopped and holds its thread: another thread replaces it, up to ``max_stuck`` held
    threads (then the queue waits for them)."""

    def __init__(self, compile_fn, timeout_s: float, threads: int = 2, max_stuck: int = 4):
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        if threads < 1:
            raise ValueError(f"threads must be >= 1, got {threads}")
        self._compile = compile_fn
        self.timeout_s = timeout_s
        self.threads = threads
        self.max_stuck = max_stuck
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()  # the thread counts, read by the workers too
        self._started = 0
        self._stuck: set[Future] = set()  # running compiles whose message timed out
        self.parked: list[Parked] = []

    def park(self, key, so, message) -> None:
        """Queue the compile of ``so`` (``StructuredOutputsParams``) and hold ``message``
        until :meth:`ready` hands it back."""
        future: Future = Future()
        self.parked.append(Parked(key, getattr(so, "param", "structured_outputs"), message,
                                  future, time.monotonic() + self.timeout_s))
        self._jobs.put((so, future))
        with self._lock:
            if self._started - len(self._stuck) < min(self.threads, len(self.parked)):
                self._start_thread()

    def _start_thread(self) -> None:
        """One more worker (a daemon: a compile never holds up the process's exit); call
        with ``_lock`` held."""
        threading.Thread(target=self._work, name=f"grammar-compile-{self._started}",
                         daemon=True).start()
        self._started += 1

    def drop(self, key) -> bool:
        """Forget the parked messages under ``key`` (an abort); True if there were any."""
        keep = [p for p in self.parked if p.key != key]
        dropped = len(keep) < len(self.parked)
        for p in self.parked:
            if p.key == key:
                self._give_up(p.future)
        self.parked = keep
        return dropped

    def _give_up(self, future: Future) -> None:
        """Stop waiting for ``future``: a compile not started yet is skipped; a running one
        holds its thread, which another replaces (up to ``max_stuck`` held threads)."""
        if future.cancel():
            return
        with self._lock:
            if not future.done() and len(self._stuck) < self.max_stuck:
                self._stuck.add(future)
                self._start_thread()  # in its place

    def ready(self) -> list[tuple[Any, str | None]]:
        """The parked messages whose compile ended or whose time ran out, in arrival order,
        each with None (compiled) or the error to answer it with; they are no longer
        parked."""
        now, out, keep = time.monotonic(), [], []
        for p in self.parked:
            if p.future.done() and not p.future.cancelled():
                exc = p.future.exception()
                out.append((p.message, None if exc is None else str(exc)))
            elif now >= p.deadline:
                self._give_up(p.future)
                out.append((p.message, f"{p.param} did not compile within "
                                       f"{self.timeout_s:g} s (--grammar-compile-timeout): "
                                       "use a smaller schema, regex or list of choices"))
            else:
                keep.append(p)
        self.parked = keep
        return out

    def _work(self) -> None:
        while True:
            so, future = self._jobs.get()
            if not future.set_running_or_notify_cancel():
                continue  # dropped or timed out before its turn
            try:
                self._compile(so)
            except Exception as exc:  # noqa: BLE001 - handed to the message's answer
                future.set_exception(exc)
            else:
                future.set_result(None)
            with self._lock:
                if future in self._stuck:  # another thread took this one's place: leave
                    self._stuck.discard(future)
                    self._started -= 1
                    return
