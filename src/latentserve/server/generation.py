"""One request's token stream -> text deltas, with stop strings (shared by both endpoints)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass

from latentserve.sampling_params import SamplingParams
from latentserve.server.client import EngineClient


@dataclass(slots=True)
class TextDelta:
    """New text of one request. ``finish_reason`` is set on the last delta only;
    ``num_output_tokens`` counts all tokens generated so far."""

    text: str
    finish_reason: str | None
    num_output_tokens: int


async def generate_text(client: EngineClient, tokenizer, rid: str, prompt_ids: list[int],
                        params: SamplingParams) -> AsyncIterator[TextDelta]:
    """Yield non-empty text deltas, then exactly one delta with a ``finish_reason``.

    Token-level stops (EOS, ``stop_token_ids``) end in the engine with ``"stop"``; that last
    token counts as generated but is not text. Stop strings are matched here, on the
    detokenized text: the match and what follows are cut, the engine request is aborted
    (by leaving ``client.generate``) and the reason is ``"stop"``.

    Raises ``EngineRequestError`` / ``EngineDeadError`` from the client.
    """
    from latentserve.detokenizer import IncrementalDetokenizer

    detok = IncrementalDetokenizer(tokenizer, prompt_ids, params.stop,
                                   skip_special_tokens=params.skip_special_tokens)
    num_tokens = 0
    async with aclosing(client.generate(rid, prompt_ids, params)) as outputs:
        async for out in outputs:
            ids = out.new_token_ids
            num_tokens += len(ids)
            if out.finished and out.finish_reason == "stop" and ids:
                ids = ids[:-1]  # the EOS / stop token ends the text, it is not part of it
            text = detok.add(ids) if ids else ""
            if detok.stopped is not None:
                yield TextDelta(text, "stop", num_tokens)
                return  # leaving the generator aborts the engine request
            if out.finished:
                yield TextDelta(text + detok.flush(), out.finish_reason, num_tokens)
                return
            if text:
                yield TextDelta(text, None, num_tokens)
