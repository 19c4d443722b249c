"""The API process's side of the ZMQ link: send requests, route outputs to their callers."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable

from latentserve.outputs import StepOutput
from latentserve.sampling_params import SamplingParams
from latentserve.server.messages import (
    Abort,
    AddRequest,
    Answer,
    EngineFailed,
    Query,
    RequestFailed,
    StepOutputs,
)

log = logging.getLogger(__name__)

_LIVENESS_POLL_MS = 1000


class EngineRequestError(ValueError):
    """The engine rejected the request (its ``add_request`` raised ``ValueError``)."""


class EngineDeadError(RuntimeError):
    """The engine process stopped; no request can be served any more."""


_SEATED = object()  # queued for a request the engine scheduled (before any output)


class EngineQueueTimeout(RuntimeError):
    """The request waited longer than its queue timeout for a seat; it was aborted."""


class EngineInternalError(RuntimeError):
    """The engine failed this one request (a server-side error); it keeps serving others."""


_EARLY_ABORT_TTL_S = 10.0  # how long an abort for a request not yet sent is remembered


class EngineClient:
    """Asyncio client of the engine process: a receive task routes each ``StepOutput`` to
    its request's queue. Sends never wait, so :meth:`abort` works in ``finally`` blocks;
    ``is_alive`` is polled while no output arrives (a dead engine fails every request)."""

    def __init__(self, input_address: str, output_address: str,
                 is_alive: Callable[[], bool] | None = None):
        self.input_address = input_address
        self.output_address = output_address
        self.is_alive = is_alive
        self.dead_reason: str | None = None
        self.num_aborts_sent = 0
        self.last_stats: dict[str, int] | None = None
        self.last_stats_at: float | None = None  # time.monotonic() of last_stats
        self._queues: dict[str, asyncio.Queue] = {}
        # rid -> (queued_at, scheduled_at) in the engine process, while the request runs
        self.scheduled_at: dict[str, tuple[float, float]] = {}
        self._aborted: set[str] = set()  # running rids already aborted
        # rid -> time of an abort before the request was sent: generate() refuses it.
        self._early_aborts: dict[str, float] = {}
        # a check's "check-{rid}" or a stats token -> the future of the engine's Answer
        self._replies: dict[str | int, asyncio.Future] = {}
        self._stats_token = 0
        # called once, with the reason, when the engine is found gone (server: log, exit)
        self.on_dead: Callable[[str], None] | None = None
        self._ctx = self._actx = self._push = self._pull = None
        self._task: asyncio.Task | None = None

    @property
    def num_running(self) -> int:
        """Requests that have been sent and not finished, failed or aborted."""
        return len(self._queues)

    async def start(self) -> None:
        """Connect the sockets and start the receive task (call inside the event loop)."""
        import zmq
        import zmq.asyncio

        self._ctx = zmq.Context()
        self._push = self._ctx.socket(zmq.PUSH)
        self._push.setsockopt(zmq.SNDHWM, 0)
        self._push.setsockopt(zmq.LINGER, 0)
        self._push.connect(self.input_address)
        self._actx = zmq.asyncio.Context()
        self._pull = self._actx.socket(zmq.PULL)
        self._pull.setsockopt(zmq.LINGER, 0)
        self._pull.connect(self.output_address)
        self._task = asyncio.create_task(self._receive_loop(), name="engine-client-receive")

    async def close(self) -> None:
        """Stop the receive task and close the sockets."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        for ctx in (self._ctx, self._actx):
            if ctx is not None:
                ctx.destroy(linger=0)  # its socket too
        self._ctx = self._actx = self._push = self._pull = None

    async def generate(self, rid: str, prompt_token_ids: list[int],
                       params: SamplingParams, queue_timeout: float | None = None
                       ) -> AsyncIterator[StepOutput]:
        """Send the request and yield its ``StepOutput``s until the finished one; leaving
        early aborts it. ``EngineRequestError``, ``EngineInternalError``, ``EngineDeadError``
        or ``EngineQueueTimeout`` (not scheduled within ``queue_timeout`` seconds)."""
        if self.dead_reason is not None:
            raise EngineDeadError(self.dead_reason)
        if rid in self._queues:
            raise EngineRequestError(f"request id {rid!r} is already running")
        aborted_at = self._early_aborts.pop(rid, None)
        if aborted_at is not None and time.monotonic() - aborted_at < _EARLY_ABORT_TTL_S:
            raise EngineRequestError(f"request {rid!r} was aborted before it started "
                                     "(the client disconnected)")
        queue: asyncio.Queue = asyncio.Queue()
        self._queues[rid] = queue
        done = False
        deadline = None if queue_timeout is None else time.monotonic() + queue_timeout
        try:
            self._push.send_pyobj(AddRequest(rid, list(prompt_token_ids), params))
            while True:
                left = None if deadline is None else max(deadline - time.monotonic(), 0.0)
                try:
                    item = await asyncio.wait_for(queue.get(), left)
                except TimeoutError:
                    raise EngineQueueTimeout(
                        f"the request waited more than {queue_timeout:g} s for a seat "
                        f"(--queue-timeout); retry later") from None
                deadline = None  # seated, an output or an error: it is no longer waiting
                if item is _SEATED:
                    continue
                if isinstance(item, BaseException):
                    done = True
                    raise item
                done = item.finished
                if item.finish_reason == "error":
                    raise EngineInternalError(item.error or "the engine failed this request")
                yield item
                if done:
                    return
        finally:
            if not done and rid not in self._aborted and self.dead_reason is None:
                self.abort(rid)  # while rid is still in _queues: not an early abort
            self._queues.pop(rid, None)
            self.scheduled_at.pop(rid, None)
            self._aborted.discard(rid)

    async def check(self, rid: str, prompt_token_ids: list[int], params: SamplingParams,
                    timeout: float = 30.0) -> None:
        """Check the request in the engine without queueing it: ``EngineRequestError``, or
        ``EngineDeadError`` (gone, or no answer within ``timeout`` s)."""
        if self.dead_reason is not None:
            raise EngineDeadError(self.dead_reason)
        rid = f"check-{rid}"
        try:
            await self._ask(rid, Query(rid, AddRequest(rid, list(prompt_token_ids), params)),
                            timeout)
        except TimeoutError:
            raise EngineDeadError(f"the engine did not answer a check within {timeout} s"
                                  ) from None

    def abort_all(self) -> None:
        """Abort every running request."""
        for rid in list(self._queues):
            self.abort(rid)

    def abort(self, rid: str) -> None:
        """Ask the engine to stop ``rid`` (once; harmless if it already finished)."""
        if rid in self._aborted:
            return
        if rid not in self._queues:  # not started yet (or already over): remember it a while
            now = time.monotonic()
            if len(self._early_aborts) > 64:
                self._early_aborts = {r: t for r, t in self._early_aborts.items()
                                      if now - t < _EARLY_ABORT_TTL_S}
            self._early_aborts[rid] = now
        if self._push is not None and self.dead_reason is None:
            if rid in self._queues:
                self._aborted.add(rid)
            self._push.send_pyobj(Abort(rid))
            self.num_aborts_sent += 1

    async def get_stats(self, timeout: float = 5.0) -> dict[str, int] | None:
        """``LLMEngine.stats()`` now; ``last_stats`` if no answer within ``timeout`` s."""
        if self._push is None or self.dead_reason is not None:
            return self.last_stats
        self._stats_token += 1
        try:
            return await self._ask(self._stats_token, Query(self._stats_token), timeout)
        except (TimeoutError, EngineDeadError):
            return self.last_stats

    async def _ask(self, key: str | int, message: object, timeout: float):
        """Send ``message`` and wait for the answer the receive task files under ``key``;
        TimeoutError after ``timeout`` s, EngineDeadError when the engine goes."""
        future = asyncio.get_running_loop().create_future()
        self._replies[key] = future
        try:
            self._push.send_pyobj(message)
            return await asyncio.wait_for(future, timeout)
        finally:
            self._replies.pop(key, None)

    async def _receive_loop(self) -> None:
        import zmq

        try:
            while True:
                if await self._pull.poll(_LIVENESS_POLL_MS, zmq.POLLIN):
                    self._dispatch(await self._pull.recv_pyobj())
                elif self.is_alive is not None and not self.is_alive():
                    self._fail_all("the engine process has stopped")
                    return
        except Exception as exc:  # noqa: BLE001 - a broken link fails requests, not the app
            log.exception("engine client receive loop failed")
            self._fail_all(f"lost the link to the engine: {type(exc).__name__}")

    def _dispatch(self, message: object) -> None:
        if isinstance(message, StepOutputs):
            for rid, times in message.scheduled.items():
                if rid in self._queues:
                    self.scheduled_at[rid] = times
                    self._queues[rid].put_nowait(_SEATED)  # ends its wait for a seat
            for out in message.outputs:
                queue = self._queues.get(out.rid)
                if queue is not None:  # None: the caller left (aborted) already
                    queue.put_nowait(out)
        elif isinstance(message, RequestFailed):
            queue = self._queues.get(message.rid)
            if queue is not None:
                cls = EngineInternalError if message.internal else EngineRequestError
                queue.put_nowait(cls(message.error))
        elif isinstance(message, Answer):
            if message.stats is not None:
                self.last_stats, self.last_stats_at = message.stats, time.monotonic()
            future = self._replies.get(message.key)
            if future is not None and not future.done():
                if message.error is None:
                    future.set_result(message.stats)
                else:
                    future.set_exception(EngineRequestError(message.error))
        elif isinstance(message, EngineFailed):
            log.error("engine failed: %s", message.error)
            self._fail_all(f"the engine failed: {message.error}")
        else:
            log.warning("ignoring unknown message %r", type(message).__name__)

    def _fail_all(self, reason: str) -> None:
        if self.dead_reason is None:  # keep the first reason (EngineFailed's, with the cause)
            self.dead_reason = reason
            if self.on_dead is not None:
                self.on_dead(reason)
        for queue in self._queues.values():
            queue.put_nowait(EngineDeadError(reason))
        for future in self._replies.values():
            if not future.done():
                future.set_exception(EngineDeadError(reason))
