"""One engine request's token stream -> text deltas with stop strings, logprobs and timing;
and the fan-out of a client request into several engine requests (``n``, prompt lists)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any

from latentserve.outputs import TokenLogprob
from latentserve.sampling_params import SamplingParams


@dataclass(slots=True)
class TextDelta:
    """New text of one engine request.

    ``finish_reason`` is set on the last delta only (``stop``, ``length``, or ``abort``
    when the request was cancelled); ``num_output_tokens`` counts all tokens generated so
    far. ``logprobs`` covers the tokens consumed since the previous delta (tokens whose text
    was held back are reported with the delta that releases it; tokens that start after a
    matched stop string are dropped, as their text is). ``stop_string`` is the
    stop string that ended the request, if one did. ``latent_steps`` / ``latent_trace``:
    the request's latent positions so far and, on the last delta when asked, their trace
    (on a tick, ``latent_tick`` > 0, of a traced request: the new steps' trace entries).
    """

    text: str
    finish_reason: str | None
    num_output_tokens: int
    logprobs: list[TokenLogprob] = field(default_factory=list)
    stop_string: str | None = None
    latent_steps: int = 0
    latent_trace: list | None = None
    latent_stats: dict | None = None  # compression heads: the final delta's stats
    recurrence: dict | None = None  # recurrent depth: the final delta's iteration stats
    latent_tick: int = 0  # latent steps run since the previous delta (stream_latent_steps)
    prompt_logprobs: list | None = None  # asked for: on the first delta, None for token 0


@dataclass(slots=True)
class EngineRequest:
    """One engine request of a client request: choice ``index`` of prompt
    ``prompt_index``."""

    index: int
    rid: str
    prompt_ids: list[int]
    params: SamplingParams
    prompt_index: int = 0
    prompt_text: str | None = None


async def generate_text(state, rid: str, prompt_ids: list[int], params: SamplingParams,
                        arrival: float | None = None, group=None, ticket=None
                        ) -> AsyncIterator[TextDelta]:
    """Yield non-empty text deltas, then exactly one delta with a ``finish_reason``; with
    ``params.stream_latent_steps``, also a delta (text "", ``latent_tick`` > 0) whenever
    latent steps ran since the last one.

    Token-level stops (EOS, ``stop_token_ids``) end in the engine with ``"stop"``; that last
    token counts as generated but is not text (with ``include_stop_str_in_output`` it is,
    where it decodes to any). Stop strings are matched here, on the detokenized text, once
    ``min_tokens`` tokens exist: the match (unless ``include_stop_str_in_output``) and
    what follows are cut, text that could still become a
    stop string is held back until it is decided, the engine request is aborted (by leaving
    ``client.generate``) and the reason is ``"stop"``. ``state`` is the ``ServerState``; its
    ``metrics`` (if any) time the request from ``arrival`` (``time.monotonic()`` seconds),
    one of ``group``'s (``metrics.RequestGroup``: a prompt's ``n`` choices; None: alone).
    ``ticket`` (``admission.Ticket``; None: none) hands this request from its client
    request's reservation to the client's ``num_running`` as it is sent.

    Raises ``EngineRequestError`` / ``EngineInternalError`` / ``EngineDeadError`` from the
    client. A request the engine refuses (``EngineRequestError``: a 400 such as the context
    length) is not recorded in the metrics; one that fails while running counts as
    ``finish_reason="error"``.
    """
    from latentserve.detokenizer import IncrementalDetokenizer
    from latentserve.server.client import EngineRequestError

    detok = IncrementalDetokenizer(state.tokenizer, prompt_ids, params.stop,
                                   skip_special_tokens=params.skip_special_tokens,
                                   include_stop_str_in_output=params.include_stop_str_in_output,
                                   min_tokens=params.min_tokens)
    timer = (state.metrics.timer(arrival, group, params.max_tokens)
             if state.metrics is not None else None)
    num_tokens = 0
    # Logprobs not yet reported, each with its token's start in the decoded text.
    pending: list[tuple[TokenLogprob, int]] = []
    prompt_lps: list | None = None
    latent_steps = 0
    stats = None  # a compression head's latent stats, once its latent phase has settled
    reason = "abort"

    def take(cut: int | None = None) -> list[TokenLogprob]:
        """The pending logprobs; with ``cut``, only tokens that start before it (those
        past a stop string are dropped with their text)."""
        out = [lp for lp, start in pending if cut is None or start < cut]
        pending.clear()
        return out

    def delta(text: str, finish: str | None, out=None, cut: int | None = None,
              **kw) -> TextDelta:
        nonlocal prompt_lps
        d = TextDelta(text, finish, num_tokens, take(cut), prompt_logprobs=prompt_lps, **kw)
        prompt_lps = None
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
                if detok.stopped is not None:
                    reason = "stop"
                    if timer is not None and stats is not None:
                        timer.latent(stats)
                    yield delta(text, "stop", out, cut=detok.decoded_len,
                                stop_string=detok.stopped)
                    return  # leaving the generator aborts the engine request
                if out.finished:
                    reason = out.finish_reason
                    if timer is not None and stats is not None:
                        timer.latent(stats)
                    yield delta(text + detok.flush(), out.finish_reason, out)
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
    """Interleave several async iterators as ``(position, item)`` in arrival order.

    The first exception raised by any of them is re-raised here. Closing this generator
    (or an exception) cancels the pumps, which closes every source (an engine request left
    early is aborted by its ``client.generate``).
    """
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
