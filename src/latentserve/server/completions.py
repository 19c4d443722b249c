"""``POST /v1/completions``."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

from latentserve.server.admission import admit
from latentserve.server.generation import EngineRequest, TextDelta
from latentserve.server.latent_params import latent_controls
from latentserve.server.latent_trace import latent_info, tick_infos
from latentserve.server.logprobs import completion_logprobs, echo_logprobs, token_texts
from latentserve.server.params import check_common, check_logprobs, engine_requests, sampling_params
from latentserve.server.prompts import completion_prompts, prompt_list, prompt_truncation
from latentserve.server.protocol import CompletionRequest, response, usage_of
from latentserve.server.request_ids import new_request_id
from latentserve.server.serving import collect, stream
from latentserve.server.state import ServerState
from latentserve.server.tokenize_pool import in_pool


async def create_completion(body: CompletionRequest, request, state: ServerState):
    """Validate, admit, encode, fan out (choice ``p * n + j`` is choice j of prompt p), run;
    answer with one response or an SSE stream."""
    arrival = time.monotonic()
    n = check_common(body, state.model_name, state.limits)
    listed = prompt_list(body.prompt, state.limits.max_prompts)
    with admit(state, len(listed) * n, "n" if n > 1 else "prompt") as ticket:
        check_logprobs(body.logprobs, "logprobs", state.limits)
        keep = prompt_truncation(body, state.max_model_len)
        prompts = await in_pool(completion_prompts, state.tokenizer, listed, state.vocab_size,
                                state.max_model_len, keep)
        budget, head, ticks = latent_controls(request, body, state.latent_spec)
        with_params = [(ids, text, sampling_params(body, "max_tokens", len(ids), state,
                                                   body.logprobs, budget, head,
                                                   body.logprobs if body.echo else None, ticks,
                                                   prompt_ids=ids, http_request=request))
                       for ids, text in prompts]
        rid, engine_rid = new_request_id(request, "cmpl")
        reqs = engine_requests(engine_rid, with_params, n, "max_tokens", state, request)
        echoes = [("" if not body.echo else r.prompt_text if r.prompt_text is not None
                   else state.tokenizer.decode(r.prompt_ids)) for r in reqs]  # the prompt text
        num_prompt_tokens = sum(len(ids) for ids, _ in prompts)
        if body.stream:
            return await stream(request, state, reqs, arrival, ticket, lambda deltas: _chunks(
                body, state, rid, num_prompt_tokens, echoes, deltas, reqs))
        results = await collect(request, state, reqs, arrival, ticket)
        texts, as_ids = token_texts(state.tokenizer), bool(body.return_tokens_as_token_ids)
        choices = []
        for i, r in enumerate(results):
            lps = None
            if body.logprobs is not None:
                lps, _ = completion_logprobs(texts, r.logprobs, len(echoes[i]), as_ids)
                if body.echo:  # the prompt's entries first, offsets kept as they are
                    echoed = echo_logprobs(texts, reqs[i].prompt_ids, r.prompt_logprobs, as_ids)
                    lps = {k: echoed[k] + lps[k] for k in lps}
            choices.append({"index": i, "text": echoes[i] + r.text,
                            "finish_reason": r.finish_reason, "logprobs": lps,
                            "latent": latent_info(r, bool(body.return_latent_trace), texts)})
            if body.return_token_ids:  # vLLM's: on the choice, the answer's ids alone
                choices[-1].update(prompt_token_ids=reqs[i].prompt_ids, token_ids=r.token_ids)
        return response("text_completion", rid, state.model_name, choices,
                        usage_of(num_prompt_tokens, sum(r.num_output_tokens for r in results)))


async def _chunks(body: CompletionRequest, state: ServerState, rid: str,
                  num_prompt_tokens: int, echoes: list[str],
                  deltas: AsyncIterator[tuple[int, TextDelta]], reqs: list[EngineRequest]
                  ) -> AsyncIterator[dict]:
    """Per choice the echo, a chunk per latent tick and per delta; the usage chunk if asked.
    With ``return_token_ids`` each choice chunk carries its new ``token_ids`` and a choice's
    first chunk the ``prompt_token_ids`` (vLLM's ``completion_stream_generator``)."""

    texts = token_texts(state.tokenizer)
    want_logprobs = body.logprobs is not None
    trace, as_ids = bool(body.return_latent_trace), bool(body.return_tokens_as_token_ids)
    with_ids = bool(body.return_token_ids)
    prompt_ids_due = [with_ids] * len(echoes)

    def chunk(index: int, text: str, token_ids: list[int] | None = None, **fields) -> dict:
        out = {"index": index, "text": text, "finish_reason": None, "logprobs": None,
               "latent": None, **fields}
        if with_ids:
            if prompt_ids_due[index]:
                out["prompt_token_ids"], prompt_ids_due[index] = reqs[index].prompt_ids, False
            out["token_ids"] = token_ids or []
        return response("text_completion", rid, state.model_name, [out])

    offsets = [len(e) for e in echoes]
    tokens = [0] * len(echoes)
    # With logprobs, an echo chunk waits for its prompt logprobs (on the first delta).
    echoed = [not (want_logprobs and any(echoes))] * len(echoes)
    for i, echo in enumerate(echoes):
        if echo and echoed[i]:
            yield chunk(i, echo)
    async for i, delta in deltas:
        tokens[i] = delta.num_output_tokens
        if not echoed[i]:  # the prompt logprobs ride the choice's first delta
            echoed[i] = True
            yield chunk(i, echoes[i], logprobs=echo_logprobs(
                texts, reqs[i].prompt_ids, delta.prompt_logprobs, as_ids))
        if delta.latent_tick:
            for info in tick_infos(delta, delta.latent_steps - delta.latent_tick, trace, texts):
                yield chunk(i, "", latent=info)
        if not delta.text and delta.finish_reason is None and not delta.logprobs and not (
                with_ids and delta.token_ids):
            continue
        lps = None
        if want_logprobs:
            lps, offsets[i] = completion_logprobs(texts, delta.logprobs, offsets[i], as_ids)
        latent = latent_info(delta, trace, texts) if delta.finish_reason is not None else None
        yield chunk(i, delta.text, delta.token_ids, finish_reason=delta.finish_reason,
                    logprobs=lps, latent=latent)
    if body.include_usage:
        yield response("text_completion", rid, state.model_name, [],
                       usage_of(num_prompt_tokens, sum(tokens)))
