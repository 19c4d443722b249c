"""Request fields -> ``SamplingParams``, with 400s that name the offending field.
``latent.head`` imports torch: the functions that need it import it, off the API's start-up."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence

from latentserve.sampling_params import (
    SamplingParams,
    StructuredOutputsParams,
)
from latentserve.server.errors import APIError, param_from_value_error, short_repr
from latentserve.server.fields import refused, route_of
from latentserve.server.generation import EngineRequest
from latentserve.server.latent_params import (
    HEAD_HEADERS,
    header_error,
    latent_positions,
    positions_param,
    sent_as,
)
from latentserve.server.protocol import CompletionRequest, RequestModel, SamplingRequest
from latentserve.server.state import ServerLimits


def check_common(request: SamplingRequest, served_model: str, limits: ServerLimits) -> int:
    """``n`` (null: 1) after the checks that need no tokenizer: model name, ``n``, stop count,
    refused fields. APIError: 400 naming the field (404 ``model_not_found`` for another model)."""
    refuse_unsupported(request)
    check_model(request.model, served_model)
    n = 1 if request.n is None else request.n
    if not 1 <= n <= limits.max_n:
        raise APIError(f"n must be in [1, {limits.max_n}], got {n}", param="n")
    check_stop_count(request.stop, "stop", limits)
    return n


def refuse_unsupported(request) -> None:
    """APIError (400 naming the field) for a ``fields.refused`` field set to a value that is
    used, or an undeclared top-level field (code ``unknown_field``, as OpenAI)."""
    unsupported = refused(route_of(type(request)))
    extra = request.model_extra or {}
    unknown = [name for name in extra if name not in unsupported]
    if unknown:
        s = "s" if len(unknown) > 1 else ""
        raise APIError(f"Unrecognized request argument{s} supplied: {', '.join(unknown)}",
                       param=unknown[0], code="unknown_field")
    for name, value in extra.items():
        if not _unused(value, unsupported[name]):
            raise APIError(f"{name} is not supported by this server (got "
                           f"{short_repr(value, 80)})", param=name)
    if getattr(request, "stream_options", None) is not None and not request.stream:
        raise APIError("stream_options is only allowed with stream: true",  # as vLLM
                       param="stream_options")
    dotted = route_of(type(request)) == "/v1/messages"  # Anthropic's paths: messages.0.content
    for name in type(request).model_fields:
        refuse_nested(getattr(request, name), name, dotted)


def _unused(value, served: tuple) -> bool:
    """Whether ``value`` is one of ``served`` (same type: ``0`` is not ``false``)."""
    return any(value is None if ok is None else type(value) is type(ok) and value == ok
               for ok in served)


def refuse_nested(value, path: str, dotted: bool = False) -> None:
    """APIError (400 naming ``path`` and the key) for a key of an object inside the body
    (``value``, at ``path``; lists walked, ``[i]`` or, ``dotted``, ``.i``) that the object
    does not take: ``unknown_field`` as at the top level, or "not supported" for one of its
    ``UNUSED`` keys at a value it does not serve. An object whose type is not served is
    left to the route, which refuses it naming its type."""
    if isinstance(value, list):
        for i, item in enumerate(value):
            refuse_nested(item, f"{path}.{i}" if dotted else f"{path}[{i}]", dotted)
        return
    if not isinstance(value, RequestModel) or (taken := value.taken_keys()) is None:
        return
    extra = value.model_extra or {}
    for key in value.model_fields_set - set(taken):
        here, served = f"{path}.{key}", value.UNUSED.get(key)
        if served is None:
            raise APIError(f"Unrecognized request argument supplied: {here}", param=here,
                           code="unknown_field")
        if not _unused(extra.get(key), served):
            raise APIError(f"{here} is not supported by this server (got "
                           f"{short_repr(extra.get(key), 80)})", param=here)
    for name in taken:
        refuse_nested(getattr(value, name, None), f"{path}.{name}", dotted)


def check_stop_count(stop, param: str, limits: ServerLimits) -> None:
    """At most ``limits.max_stop`` stop strings; else APIError naming ``param``."""
    count = 0 if stop is None else 1 if isinstance(stop, str) else len(stop)
    if count > limits.max_stop:
        raise APIError(f"{param} takes at most {limits.max_stop} strings, got {count}",
                       param=param)


def check_model(model: str | None, served_model: str) -> None:
    """Raise OpenAI's 404 ``model_not_found`` unless ``model`` is None or the served one."""
    if model is not None and model != served_model:
        raise APIError(f"The model '{model}' does not exist; this server serves "
                       f"'{served_model}'", status_code=404, param="model",
                       code="model_not_found")


def check_logprobs(k: int | None, param: str, limits: ServerLimits) -> None:
    """``k`` top logprobs must be in [0, limits.max_logprobs] (None: >= 0; the engine checks
    the vocabulary size)."""
    cap = limits.max_logprobs
    if k is not None and not (k >= 0 if cap is None else 0 <= k <= cap):
        raise APIError(f"{param} must be in [0, {'vocab size' if cap is None else cap}], got "
                       f"{k}", param=param)


# Sampling fields whose null takes the generation config's value, else vLLM's neutral one.
NEUTRAL = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "min_p": 0.0,
           "repetition_penalty": 1.0}
# Body fields SamplingParams takes as sent (null: its default), on every route / OpenAI's.
_SHARED_FIELDS = ("return_latent_trace", "upstream_stop_rules", "exit_criterion",
                  "exit_threshold", "exit_min_steps", "exit_check_every", "exit_semantics")
_OPENAI_FIELDS = ("seed", "presence_penalty", "frequency_penalty", "stop_token_ids",
                  "ignore_eos", "skip_special_tokens", "min_tokens",
                  "include_stop_str_in_output", "bad_words", "allowed_token_ids",
                  "thinking_token_budget")


def _sent(body, names: tuple[str, ...]) -> dict:
    """``body``'s fields ``names`` that are not null."""
    return {k: v for k in names if (v := getattr(body, k)) is not None}


def _or_default(body, names: tuple[str, ...], defaults: dict | None) -> dict:
    """``body``'s fields ``names``, a null one as ``defaults[name]``, else ``NEUTRAL[name]``."""
    return {k: v if (v := getattr(body, k)) is not None else (defaults or {}).get(k, NEUTRAL[k])
            for k in names}


def shared_fields(body, stop: list[str] | None, budget: int | None, defaults: dict | None
                  ) -> dict:
    """The ``SamplingParams`` keyword arguments every generation route (OpenAI, Anthropic)
    takes alike: sampling (``defaults`` fill unset ones), ``stop``, the latent fields."""
    out = {**_or_default(body, ("temperature", "top_p", "top_k"), defaults), "stop": stop,
           "latent_budget": budget, **_sent(body, _SHARED_FIELDS)}
    out["top_k"] = -1 if out["top_k"] == 0 else out["top_k"]
    return out


_GUIDED = (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice"),
           ("guided_grammar", "grammar"))


def structured_outputs(request: SamplingRequest) -> StructuredOutputsParams | None:
    """The answer constraint from ``response_format``, vLLM's ``guided_*`` or
    ``structured_outputs`` (None: none). APIError (400 naming the field) for a malformed
    value, ``response_format.json_schema`` beside a type other than json_schema, an unknown
    ``structured_outputs`` key, or more than one constraint."""
    found: list[StructuredOutputsParams] = []
    rf = request.response_format
    if rf is not None and rf.type != "json_schema" and rf.json_schema is not None:
        raise APIError(f"response_format.json_schema is only taken with type json_schema, got "
                       f"type {rf.type!r} (its schema would be ignored)",
                       param="response_format.json_schema")
    try:
        if rf is not None and rf.type != "text":
            schema = rf.json_schema and rf.json_schema.schema_
            if rf.type == "json_schema" and schema is None:
                raise APIError("response_format of type json_schema needs json_schema.schema "
                               "(the JSON schema the answer follows)", param="response_format")
            kind = {"json_object": True} if rf.type == "json_object" else {"json": schema}
            found.append(StructuredOutputsParams(**kind, param="response_format"))
        found += [StructuredOutputsParams(**{kind: v}, param=name) for name, kind in _GUIDED
                  if (v := getattr(request, name)) is not None]
        if (so := request.structured_outputs) is not None:
            kinds = StructuredOutputsParams.KINDS
            unused = (k for k, v in so.items() if k not in kinds and v not in (None, False))
            if (key := next(unused, None)) is not None:
                raise APIError(f"structured_outputs.{key} is not supported by this server "
                               f"(it takes {', '.join(kinds)})", param=f"structured_outputs.{key}")
            found.append(StructuredOutputsParams(**{k: v for k, v in so.items() if k in kinds},
                                                 param="structured_outputs"))
    except ValueError as exc:
        raise APIError(str(exc), param=param_from_value_error(str(exc))) from None
    if len(found) > 1:
        raise APIError(f"{found[1].param}: a request takes one structured-output constraint, "
                       f"got {found[0].param} and {found[1].param}", param=found[1].param)
    return found[0] if found else None


def logit_bias(request: SamplingRequest) -> dict[int, float] | None:
    """The body's ``logit_bias`` with its keys (token ids, decimal strings on the wire, as
    OpenAI's ``{"50256": -100}``) as integers; ranges are ``SamplingParams``' check.
    APIError (400 naming ``logit_bias``) for a key that is not an integer."""
    if request.logit_bias is None:
        return None
    out = {}
    for key, value in request.logit_bias.items():
        if not re.fullmatch(r"-?[0-9]{1,20}", key):
            raise APIError(f"logit_bias keys must be token ids (integers, as strings such as "
                           f"\"50256\"), got {short_repr(key, 40)}", param="logit_bias")
        out[int(key)] = value
    return out


def sampling_params(request: SamplingRequest, max_tokens_field: str, num_prompt_tokens: int,
                    state, logprobs: int | None = None, budget: int | None = None,
                    head: dict | None = None, prompt_logprobs: int | None = None,
                    stream_latent_steps: bool = False, prompt_ids: Sequence[int] = (),
                    http_request=None) -> SamplingParams:
    """The engine's ``SamplingParams`` for one prompt (``prompt_ids``: its ids, where
    :func:`latent_positions` needs them; ``http_request``: its headers, to name a control a
    header sent). ``max_tokens_field`` null: up to the end of
    ``state.max_model_len`` (and the generation config's ``max_tokens``);
    :func:`latent_positions` count as prompt tokens; ``state.sampling_defaults`` fill null
    sampling fields; ``head`` None: the body's. APIError (400 naming the field or header;
    ``context_length_exceeded`` over the context)."""
    max_tokens, max_model_len = getattr(request, max_tokens_field), state.max_model_len
    if num_prompt_tokens >= max_model_len:  # no room for one generated token
        raise APIError(
            f"This model's maximum context length is {max_model_len} tokens. However, your "
            f"prompt has {num_prompt_tokens} tokens, so no token can be generated "
            f"(max_model_len is {max_model_len}). Please reduce the length of the prompt.",
            param="prompt" if isinstance(request, CompletionRequest) else "messages",
            code="context_length_exceeded")
    if head is None:
        head = {k: getattr(request, k, None) for k in HEAD_HEADERS}
    latent = latent_positions(state.latent_spec, budget, head, prompt_ids,
                              getattr(request, "thinking_token_budget", None))
    used = num_prompt_tokens + latent
    defaults = state.sampling_defaults or {}
    if max_tokens is None and used >= max_model_len:  # the latent positions fill it
        prompt = "prompt" if isinstance(request, CompletionRequest) else "messages"
        sent = positions_param(state.latent_spec, budget, head,
                                getattr(request, "thinking_token_budget", None))
        sent = None if sent is None else sent_as(http_request, sent)
        raise APIError(
            f"This model's maximum context length is {max_model_len} tokens. However, you "
            f"requested {used + 1} tokens ({num_prompt_tokens} in the prompt, {latent} latent "
            f"and transition positions, at least 1 in the completion). Please reduce the "
            f"length of the prompt{'' if sent is None else ' or ' + sent}.",
            param=sent or prompt, code="context_length_exceeded")
    if max_tokens is None:
        max_tokens = min(max_model_len - used, defaults.get("max_tokens", max_model_len))
    elif used + max_tokens > max_model_len:
        positions = f", {latent} latent and transition positions" if latent else ""
        raise APIError(
            f"This model's maximum context length is {max_model_len} tokens. However, you "
            f"requested {used + max_tokens} tokens ({num_prompt_tokens} in the "
            f"prompt{positions}, {max_tokens} in the completion). Please reduce the length "
            f"of the prompt{', the latent steps' if latent else ''} or {max_tokens_field}.",
            param=max_tokens_field,
            code="context_length_exceeded")
    try:
        return SamplingParams(
            max_tokens=max_tokens, logprobs=logprobs, prompt_logprobs=prompt_logprobs,
            stream_latent_steps=stream_latent_steps, structured_outputs=structured_outputs(request),
            logit_bias=logit_bias(request),
            **_or_default(request, ("min_p", "repetition_penalty"), defaults),
            **_sent(request, _OPENAI_FIELDS),
            **shared_fields(request, request.stop, budget, defaults), **head)
    except ValueError as exc:  # a max_tokens error names the field sent
        msg, param = str(exc), param_from_value_error(str(exc))
        if param == "max_tokens":
            msg, param = max_tokens_field + msg.removeprefix(param), max_tokens_field
        raise header_error(http_request, msg, param) from None


def request_steps(params: SamplingParams, spec, num_prompt_tokens: int,
                  max_model_len: int) -> int:
    """The steps one request may run after its prompt: ``params.max_tokens``, on a thinking
    compression head raised to the answer-budget floor ``min_output_tokens + max_latent``,
    on thinking CoLaR plus its latent-step cap (both within the context left), on a
    feedback or looped-block model plus its latent positions (``LatentSpec.prompt_extra``)."""
    if spec is not None and spec.kind in ("feedback", "loop"):
        return params.max_tokens + spec.prompt_extra(spec.resolve_budget(params.latent_budget))
    if spec is None or spec.kind != "head":
        return params.max_tokens
    from latentserve.latent.head import apply_output_floor, head_defaults, resolve_settings

    colar = bool(spec.default_max_latent)  # latent steps beside max_tokens, no floor
    defaults = head_defaults()
    if colar:
        defaults["max_latent"] = spec.default_max_latent
    hs = resolve_settings(params, defaults, "closed_loop", True)
    left = max_model_len - num_prompt_tokens
    if not hs.thinking:
        return params.max_tokens
    if colar:
        return params.max_tokens + max(0, min(hs.max_latent, left))
    raised = apply_output_floor(params.max_tokens, hs.min_output_tokens, hs.max_latent)
    return max(params.max_tokens, min(raised, left))


def check_request_steps(prompts: list[tuple[list[int], SamplingParams]], n: int,
                        max_tokens_field: str, state, http_request=None) -> None:
    """APIError (400 naming the field) when ``n`` x the sum of :func:`request_steps` over
    ``prompts`` (``(token ids, params)``) exceeds ``state.limits.max_request_output_tokens``,
    or when head controls contradict each other (naming the header of ``http_request`` that
    sent one)."""
    asked = [params.max_tokens for _, params in prompts]
    try:
        steps = [request_steps(params, state.latent_spec, len(ids), state.max_model_len)
                 for ids, params in prompts]
    except ValueError as exc:  # head.resolve_settings: controls that contradict each other
        raise header_error(http_request, str(exc), param_from_value_error(str(exc))) from None
    total, limit = n * sum(steps), state.limits.max_request_output_tokens
    if total > limit:
        f = max_tokens_field
        kind = getattr(state.latent_spec, "kind", None)
        if asked == steps:
            each = f"{f} up to {max(asked)}"
        elif kind in ("feedback", "loop"):
            each = (f"{f} up to {max(asked)} plus up to "
                    f"{max(s - a for s, a in zip(steps, asked))} latent positions (start, "
                    "latent or block, end: latent_budget)")
        elif state.latent_spec.default_max_latent:  # CoLaR
            each = (f"{f} up to {max(asked)} plus up to "
                    f"{max(s - a for s, a in zip(steps, asked))} latent steps (max_latent)")
        else:
            each = (f"{f} up to {max(steps)}, raised from {max(asked)} by the answer-budget "
                    "floor min_output_tokens + max_latent (send min_output_tokens: 0 for it to "
                    "hold)")
        raise APIError(
            f"{f} x n summed over prompts must be at most {limit} tokens per request, got "
            f"{total} ({len(steps)} prompt(s), n={n}, {each}); lower {f}, n or the number of "
            "prompts", param=max_tokens_field)


def engine_requests(rid: str, prompts: list[tuple[list[int], str | None, SamplingParams]],
                    n: int, max_tokens_field: str, state, http_request=None
                    ) -> list[EngineRequest]:
    """Each prompt's ``(token ids, text, params)`` fanned out to ``n`` engine requests (choice
    ``p * n + j``: id ``{rid}-{p * n + j}``; with a ``seed``, seed ``seed + j``). APIError (400
    naming the field): :func:`check_request_steps`, or ``seed + n - 1`` out of range."""
    check_request_steps([(ids, params) for ids, _, params in prompts], n, max_tokens_field,
                        state, http_request)
    try:
        return [EngineRequest(f"{rid}-{p * n + j}", ids, dataclasses.replace(
                    params, seed=None if params.seed is None else params.seed + j), p, text)
                for p, (ids, text, params) in enumerate(prompts) for j in range(n)]
    except ValueError as exc:
        raise APIError(f"{exc} (seed + n - 1 must be in range)", param="seed") from None
