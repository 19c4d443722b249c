"""The body fields of each route, declared once: implemented, accepted with no effect, or
refused; any other top-level field is refused as unknown (``params.refuse_unsupported``).
Design notes: docs/internals.md, "latentserve.server.fields"."""

from __future__ import annotations

import functools
import importlib

# Route -> (module, request model class).
ROUTES = {
    "/v1/completions": ("latentserve.server.protocol", "CompletionRequest"),
    "/v1/chat/completions": ("latentserve.server.protocol", "ChatCompletionRequest"),
    "/v1/messages": ("latentserve.server.anthropic_api", "MessagesRequest"),
    "/tokenize": ("latentserve.server.protocol", "TokenizeRequest"),
    "/detokenize": ("latentserve.server.protocol", "DetokenizeRequest"),
}

# Fields of a route's model that are validated and change nothing in the answer (billing,
# storage, caching hints, routing, end-user ids).
ACCEPTED = {
    "/v1/completions": ("user",),
    "/v1/chat/completions": (
        "user", "metadata", "store", "service_tier", "safety_identifier", "prompt_cache_key",
        "prompt_cache_retention", "prompt_cache_options", "prediction"),
    "/v1/messages": (
        "metadata", "service_tier", "inference_geo", "cache_control", "speed",
        "billing_policy", "fallback_credit_token"),
    "/tokenize": (),
    "/detokenize": (),
}

# OpenAI's and vLLM's output-changing fields that are not implemented, with the values that
# mean "not used" (served); per route, those that are not fields of its model.
_OPENAI_REFUSED = {
    "best_of": (None, 1), "suffix": (None, ""),
    "tools": (None, []), "functions": (None, []), "tool_choice": (None, "none", "auto"),
    "function_call": (None, "none", "auto"),
    "prompt_logprobs": (None, 0),
    "guided_decoding_backend": (None, "auto", "xgrammar"),
    "guided_whitespace_pattern": (None,), "structural_tag": (None,),
    "prompt_embeds": (None,), "chat_template": (None,),
    "echo": (None, False), "use_beam_search": (None, False),
    "length_penalty": (None, 1, 1.0), "logits_processors": (None, []),
    "spaces_between_special_tokens": (None, True),
    "modalities": (None, ["text"]), "audio": (None,), "web_search_options": (None,),
    "documents": (None, []),
    "reasoning_effort": (None,), "verbosity": (None, "medium"), "moderation": (None,),
    "priority": (None, 0), "mm_processor_kwargs": (None, {}), "request_id": (None,),
    "cache_salt": (None,), "kv_transfer_params": (None,), "vllm_xargs": (None, {}),
    # SGLang's extensions, which sglang-router forwards at these defaults
    "no_stop_trim": (None, False), "return_hidden_states": (None, False),
    "separate_reasoning": (None, True), "stream_reasoning": (None, True),
}
REFUSED = {
    "/v1/completions": {**_OPENAI_REFUSED, "add_special_tokens": (None, True)},
    "/v1/chat/completions": {**_OPENAI_REFUSED, "add_special_tokens": (None, False)},
    # Anthropic's server-side tools run code on the provider's side; the others edit or
    # hold the conversation on the provider's side, or add to the answer.
    "/v1/messages": {
        "mcp_servers": (None, []), "container": (None,), "context_management": (None,),
        "compaction": (None,), "thread": (None,), "fallbacks": (None, []),
        "diagnostics": (None,), "output_format": (None,)},
    "/tokenize": {"mm_processor_kwargs": (None, {})},
    "/detokenize": {},
}

# /v1/messages' fields that /v1/messages/count_tokens does not take (Anthropic's count answers
# "Extra inputs are not permitted"): sampling, stopping, streaming, billing and routing.
NOT_COUNTED = ("max_tokens", "stream", "stop_sequences", "temperature", "top_p", "top_k",
               "metadata", "service_tier", "inference_geo", "fallback_credit_token",
               "container", "diagnostics", "fallbacks", "thread")


def request_model(route: str):
    """The pydantic request model of ``route`` (a key of ``ROUTES``)."""
    module, name = ROUTES[route]
    return getattr(importlib.import_module(module), name)


def implemented(route: str) -> list[str]:
    """The fields ``route`` implements (its model's less ``ACCEPTED``), by alias."""
    fields = request_model(route).model_fields
    return [f.alias or name for name, f in fields.items() if name not in ACCEPTED[route]]


@functools.cache
def refused(route: str) -> dict[str, tuple]:
    """``REFUSED[route]`` less the fields of the route's model: name -> values served."""
    fields = request_model(route).model_fields
    return {k: v for k, v in REFUSED[route].items() if k not in fields}


def route_of(model: type) -> str:
    """The route of request model ``model`` or a base (else ``/v1/completions``)."""
    return next((route for route, (_, name) in ROUTES.items()
                 if any(cls.__name__ == name for cls in model.__mro__)), "/v1/completions")
