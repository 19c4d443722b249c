"""One engine request's token stream -> text deltas with stop strings, logprobs and timing;
``EngineRequest``, one of a client request's fan-out (``n``, prompt lists); ``merge``."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any

from latentserve.detokenizer import IncrementalDetokenizer
from latentserve.outputs import TokenLogprob
from latentserve.sampling_params import SamplingParams
from latentserve.server.client import EngineRequestError
from latentserve.server.metrics import RequestTimer


@dataclass(slots=True)
class TextDelta:
    """New text of one engine request. ``finish_reason``: on the last delta only;
    ``num_output_tokens``: all so far; ``logprobs``: the tokens whose text this releases;
    ``token_ids``: the ids generated since the previous delta (the EOS / stop token too;
    latent steps are no ids); ``latent_trace``: on the last delta, or a tick's new entries."""

    text: str
    finish_reason: str | None
    num_output_tokens: int
    logprobs: list[TokenLogprob] = field(default_factory=list)
    stop_string: str | None = None
    latent_steps: int = 0
    latent_trace: list | None = None
    latent_stats: dict | None = None
    recurrence: dict | None = None
    latent_tick: int = 0  # latent steps run since the previous delta (stream_latent_steps)
    prompt_logprobs: list | None = None  # on the first delta
    token_ids: list[int] = field(default_factory=list)


@dataclass(slots=True)
class EngineRequest:
    """One choice of prompt ``prompt_index`` of a client request."""

    rid: str
    prompt_ids: list[int]
    params: SamplingParams
    prompt_index: int = 0
    prompt_text: str | None = None


async def generate_text(state, rid: str, prompt_ids: list[int], params: SamplingParams,
                        arrival: float | None = None, group=None, ticket=None
                        ) -> AsyncIterator[TextDelta]:
    """Yield non-empty text deltas, then exactly one with a ``finish_reason`` (with
    ``stream_latent_steps``, text-less ticks too). Stop strings are matched here, which
    aborts the engine request. ``arrival``: ``time.monotonic()`` seconds, for the metrics;
    ``ticket``: the ``admission.Ticket`` counting it. Raises the client's errors."""
    detok = IncrementalDetokenizer(state.tokenizer, prompt_ids, params.stop,
                                   skip_special_tokens=params.skip_special_tokens,
                                   include_stop_str_in_output=params.include_stop_str_in_output,
                                   min_tokens=params.min_tokens)
    timer = (RequestTimer(state.metrics, arrival, group, params.max_tokens)
             if state.metrics is not None else None)
    num_tokens = 0
    # Logprobs not yet reported, each with its token's start in the decoded text.
    pending: list[tuple[TokenLogprob, int]] = []
    pending_ids: list[int] = []  # ids not yet handed out
    prompt_lps: list | None = None
    latent_steps = 0
    stats = None  # a compression head's latent stats, once its latent phase has settled
    reason = "abort"

    def delta(text: str, finish: str | None, out=None, cut: int | None = None,
              **kw) -> TextDelta:
        """A delta taking the pending logprobs (with ``cut``: of tokens starting before it)."""
        nonlocal prompt_lps
        lps = [lp for lp, start in pending if cut is None or start < cut]
        pending.clear()
        d = TextDelta(text, finish, num_tokens, lps, prompt_logprobs=prompt_lps,
                      token_ids=pending_ids[:], **kw)
        prompt_lps = None
        pending_ids.clear()
        if out is not None:
            d.latent_steps, d.latent_trace = out.latent_steps, out.latent_trace
            d.latent_stats, d.recurrence = out.latent_stats or stats, out.recurrence
        return d

    try:
        timeout = state.limits.queue_timeout
        kw = {} if timeout is None else {"queue_timeout": timeout}
        if ticket is not None:  # the client counts it from here (no await in between)
            ticket.take()
        async with aclosing(state.client.generate(rid, prompt_ids, params, **kw)) as outputs:
            async for out in outputs:
                ids = out.new_token_ids
                num_tokens += len(ids)
                pending_ids.extend(ids)
                if timer is not None:
                    if timer.scheduled_at is None:  # (a stand-in client may not say)
                        timer.scheduled(getattr(state.client, "scheduled_at", {}).get(rid))
                    timer.tokens(len(ids))
                if out.prompt_logprobs is not None:
                    prompt_lps = out.prompt_logprobs
                if out.latent_stats is not None:
                    stats = out.latent_stats
                # The EOS / stop token ends the text, it is not part of it (unless
                # include_stop_str_in_output: then its text, if any, is, as in vLLM).
                text_ids = ids[:-1] if (out.finished and out.finish_reason == "stop"
                                        and not params.include_stop_str_in_output) else ids
                starts, parts = [], []
                for t in text_ids:
                    starts.append(detok.decoded_len)
                    parts.append(detok.add([t]))
                starts += [detok.decoded_len] * (len(ids) - len(text_ids))
                if out.logprobs:
                    pending.extend(zip(out.logprobs, starts))
                text = "".join(parts)
                if detok.stopped is not None or out.finished:
                    stopped = detok.stopped is not None  # returning aborts the engine request
                    reason = "stop" if stopped else out.finish_reason
                    if timer is not None:
                        timer.latent(out.latent_steps, stats)
                    yield delta(text if stopped else text + detok.flush(), reason, out,
                                detok.decoded_len if stopped else None, stop_string=detok.stopped)
                    return
                tick = out.latent_steps - latent_steps if params.stream_latent_steps else 0
                latent_steps = out.latent_steps
                if text or tick > 0:
                    yield delta(text, None, latent_tick=max(tick, 0),
                                latent_steps=out.latent_steps,
                                latent_trace=out.latent_trace if tick > 0 else None)
    except EngineRequestError:
        reason = None  # refused before it ran (a 400): not a finished request
        raise
    except Exception:
        reason = "error"
        raise
    finally:
        if timer is not None and reason is not None:
            timer.finish(reason, len(prompt_ids))


async def merge(iterators: list[AsyncIterator[Any]]) -> AsyncIterator[tuple[int, Any]]:
    """Interleave async iterators as ``(position, item)``; the first exception is re-raised,
    closing this closes every source."""

    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(i: int, it: AsyncIterator[Any]) -> None:
        try:
            async with aclosing(it):
                async for item in it:
                    queue.put_nowait((i, item))
            queue.put_nowait((i, done))
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # noqa: BLE001 - handed to the consumer
            queue.put_nowait((i, exc))

    tasks = [asyncio.create_task(pump(i, it)) for i, it in enumerate(iterators)]
    try:
        remaining = len(tasks)
        while remaining:
            i, item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
