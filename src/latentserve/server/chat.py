"""``POST /v1/chat/completions``, with tool calls and reasoning parsed out of the answer."""

from __future__ import annotations

import functools
import time
from collections.abc import AsyncIterator, Callable
from itertools import zip_longest

from latentserve.server.admission import admit
from latentserve.server.errors import APIError
from latentserve.server.generation import TextDelta
from latentserve.server.latent_params import latent_controls, thinking_kwargs
from latentserve.server.latent_trace import latent_info, tick_infos
from latentserve.server.logprobs import chat_logprobs, token_texts
from latentserve.server.output_parser import (
    CallDelta,
    OutputParser,
    answer_params,
    parse_output,
)
from latentserve.server.params import check_common, check_logprobs, engine_requests, sampling_params
from latentserve.server.prompts import (
    chat_tools,
    message_text,
    prompt_truncation,
    templated_prompt_ids,
)
from latentserve.server.protocol import ChatCompletionRequest, response, usage_of
from latentserve.server.reasoning import (
    LatentReasoning,
    latent_reasoning_mode,
    latent_reasoning_text,
)
from latentserve.server.request_ids import new_request_id
from latentserve.server.serving import collect, stream
from latentserve.server.state import ServerState
from latentserve.server.tools import (
    ToolChoice,
    check_tools,
    refuse_unenforced_strict,
    resolve_tool_choice,
)
from latentserve.token_masks import reasoning_open


async def create_chat_completion(body: ChatCompletionRequest, request, state: ServerState):
    """Validate, admit, template, fan out, run; answer with one response or an SSE stream."""
    arrival = time.monotonic()
    body = body.with_template_kwargs_fields()  # what a router leaves of the latent fields
    n = check_common(body, state.model_name, state.limits)
    with admit(state, n) as ticket:
        tools = check_tools(chat_tools(body.tools))
        choice = resolve_tool_choice(body.tool_choice, tools, body.parallel_tool_calls)
        refuse_unenforced_strict(tools, choice, state.tool_parser)
        latent_mode = latent_reasoning_mode(body, state.latent_spec)
        if body.top_logprobs and not body.logprobs:
            raise APIError("top_logprobs requires logprobs to be true", param="top_logprobs")
        logprobs = (body.top_logprobs or 0) if body.logprobs else None  # top k, None: off
        check_logprobs(logprobs, "top_logprobs", state.limits)
        budget, head, ticks = latent_controls(request, body, state.latent_spec,
                                              body.chat_template_kwargs)
        template_kwargs = thinking_kwargs(body.chat_template_kwargs, head["thinking"])
        keep = prompt_truncation(body, state.max_model_len)  # a prompt to cut may be longer
        prompt_ids = await templated_prompt_ids(body, state, template_kwargs,
                                                state.max_model_len if keep is None else None)
        prompt_ids = prompt_ids if keep is None else prompt_ids[-keep:]
        last = len(body.messages) - 1  # vLLM's echo: the final message's text, the assistant's
        echo = (message_text(body.messages[last], last)
                if body.echo and body.messages[last].role == "assistant" else "")
        field = "max_tokens" if body.max_completion_tokens is None else "max_completion_tokens"
        params = sampling_params(body, field, len(prompt_ids), state, logprobs, budget, head,
                                 stream_latent_steps=ticks, prompt_ids=prompt_ids,
                                 http_request=request)
        parser = functools.partial(OutputParser, state.reasoning_parser, state.tool_parser,
                                   choice, body.include_reasoning is not False, opened=(
                                       reasoning_open(state.tokenizer, state.reasoning_parser,
                                                      prompt_ids)))
        params = answer_params(params, choice, tools, latent_mode, state.tokenizer, parser())
        rid, engine_rid = new_request_id(request, "chatcmpl")
        reqs = engine_requests(engine_rid, [(prompt_ids, None, params)], n, field, state,
                               request)
        if body.stream:
            return await stream(request, state, reqs, arrival, ticket, lambda deltas: _chunks(
                body, state, rid, prompt_ids, deltas, len(reqs), parser, latent_mode,
                choice, ticks, echo))
        results = await collect(request, state, reqs, arrival, ticket)
        texts, as_ids = token_texts(state.tokenizer), bool(body.return_tokens_as_token_ids)
        choices = []
        for i, r in enumerate(results):
            reasoning, content, calls = parse_output(parser(), r.text)
            if latent_mode:
                reasoning = latent_reasoning_text(latent_mode, r.latent_steps, r.step_trace,
                                                  texts) + reasoning
            content = echo + content
            # null when none, as vLLM; under both names (vLLM's newer ``reasoning``)
            message = {"role": "assistant", "content": content if content or not calls else None,
                       "reasoning": reasoning or None, "reasoning_content": reasoning or None}
            if calls:
                message["tool_calls"] = [{"id": c.id, "type": "function", "function": {
                    "name": c.name, "arguments": c.arguments}} for c in calls]
            choices.append({
                "index": i, "message": message,
                "finish_reason": _finish_reason(r.finish_reason, bool(calls), choice),
                "logprobs": (chat_logprobs(texts, r.logprobs, as_ids)
                             if logprobs is not None else None),
                "latent": latent_info(r, bool(body.return_latent_trace), texts)})
            if body.return_token_ids:
                choices[-1]["token_ids"] = r.token_ids
        out = response("chat.completion", rid, state.model_name, choices,
                       usage_of(len(prompt_ids), sum(r.num_output_tokens for r in results)))
        if body.return_token_ids:  # vLLM's: the prompt's ids on the response
            out["prompt_token_ids"] = prompt_ids
        return out


def _finish_reason(reason: str | None, called: bool, choice: ToolChoice) -> str | None:
    """``tool_calls`` after a call, except for a named function (``stop``, as OpenAI)."""
    return "tool_calls" if called and reason == "stop" and choice.mode != "named" else reason


async def _chunks(body: ChatCompletionRequest, state: ServerState, rid: str,
                  prompt_ids: list[int], deltas: AsyncIterator[tuple[int, TextDelta]],
                  n: int, parser: Callable[[], OutputParser], latent_mode: str | None,
                  choice: ToolChoice, ticks: bool, echo: str
                  ) -> AsyncIterator[dict]:
    """Per choice a role chunk and the echo; per delta its latent reasoning (``ticks``: a
    chunk per step) and what its parser releases; finish chunks; the usage chunk if asked.
    With ``return_token_ids`` (vLLM's ``chat_completion_stream_generator``) the role chunks
    carry ``prompt_token_ids`` and each delta's first chunk (an empty one if its parser held
    its text back; the finish chunk on the last delta) the delta's ``token_ids``."""

    model = state.model_name
    texts = token_texts(state.tokenizer)
    trace, as_ids = bool(body.return_latent_trace), bool(body.return_tokens_as_token_ids)
    parsers = [parser() for _ in range(n)]
    latent = [LatentReasoning(latent_mode, texts, ticks) if latent_mode else None
              for _ in range(n)]

    def chunk(index: int, delta: dict, finish_reason: str | None = None,
              lps=None, latent=None, token_ids: list[int] | None = None) -> dict:
        """A chunk of one choice; the delta's, ``latent``'s and ``token_ids``' None left out;
        ``reasoning_content`` also as ``reasoning`` (vLLM's newer name)."""
        logprobs = chat_logprobs(texts, lps, as_ids) if body.logprobs and lps else None
        if delta.get("reasoning_content") is not None:
            delta = {**delta, "reasoning": delta["reasoning_content"]}
        out = {"index": index, "delta": {k: v for k, v in delta.items() if v is not None},
               "finish_reason": finish_reason, "logprobs": logprobs}
        if latent is not None:
            out["latent"] = latent
        if token_ids is not None:
            out["token_ids"] = token_ids
        return response("chat.completion.chunk", rid, model, [out])

    with_ids = bool(body.return_token_ids)
    for i in range(n):
        first = chunk(i, {"role": "assistant", "content": ""})
        if with_ids:
            first["prompt_token_ids"] = prompt_ids
        yield first
    for i in range(n if echo else 0):
        yield chunk(i, {"content": echo})
    tokens = [0] * n
    called = [False] * n
    async for i, delta in deltas:
        tokens[i] = delta.num_output_tokens
        lines = latent[i].step_texts(delta) if latent[i] is not None else []
        infos = (tick_infos(delta, delta.latent_steps - delta.latent_tick, trace, texts)
                 if ticks and delta.latent_tick else [])  # a line per tick step, if any
        for line, info in zip_longest([None] * (len(infos) - len(lines)) + lines, infos):
            yield chunk(i, {"reasoning_content": line}, latent=info)
        piece = parsers[i].step(delta.text, delta.finish_reason is not None)
        called[i] = called[i] or bool(piece.calls)
        ids = delta.token_ids if with_ids else None
        if piece or delta.logprobs or (ids and delta.finish_reason is None):
            yield chunk(i, {"content": piece.content or None,
                            "reasoning_content": piece.reasoning or None,
                            "tool_calls": [_call_delta(c) for c in piece.calls] or None},
                        None, delta.logprobs, token_ids=ids)
            ids = [] if with_ids else None
        if delta.finish_reason is not None:
            yield chunk(i, {}, _finish_reason(delta.finish_reason, called[i], choice),
                        latent=latent_info(delta, trace, texts), token_ids=ids)
    if body.include_usage:
        yield response("chat.completion.chunk", rid, model, [],
                       usage_of(len(prompt_ids), sum(tokens)))


def _call_delta(c: CallDelta) -> dict:
    """OpenAI's streamed tool call piece: the first of a call names it."""
    if c.id is None:
        return {"index": c.index, "function": {"arguments": c.arguments}}
    return {"index": c.index, "id": c.id, "type": "function",
            "function": {"name": c.name, "arguments": c.arguments}}
