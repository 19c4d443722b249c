"""Request fields -> ``SamplingParams``, with 400s that name the offending field."""

from __future__ import annotations

from latentserve.sampling_params import SamplingParams
from latentserve.server.errors import APIError, param_from_value_error
from latentserve.server.protocol import SamplingRequest


# OpenAI features not implemented, with the values that mean "not used".
_UNSUPPORTED = {
    "logprobs": (None, False, 0), "top_logprobs": (None, 0), "echo": (None, False),
    "best_of": (None, 1), "suffix": (None, ""), "presence_penalty": (None, 0, 0.0),
    "frequency_penalty": (None, 0, 0.0), "repetition_penalty": (None, 1, 1.0),
    "logit_bias": (None, {}), "tools": (None, []), "functions": (None, []),
    "response_format": (None, {"type": "text"}),
}


def check_common(request: SamplingRequest, served_model: str) -> None:
    """Checks that need no tokenizer: the model name, ``n``, and unimplemented features."""
    for name, value in (request.model_extra or {}).items():
        if name in _UNSUPPORTED and not any(_same(value, ok) for ok in _UNSUPPORTED[name]):
            raise APIError(f"{name} is not supported by this server (got {value!r})",
                           param=name)
    if request.model is not None and request.model != served_model:
        raise APIError(f"The model '{request.model}' does not exist; this server serves "
                       f"'{served_model}'", param="model", code="model_not_found")
    if request.n is not None and request.n != 1:
        raise APIError(f"n must be 1, got {request.n}; n > 1 is not supported yet", param="n")


def sampling_params(request: SamplingRequest, max_tokens: int | None, max_tokens_field: str,
                    num_prompt_tokens: int, max_model_len: int) -> SamplingParams:
    """Build the engine's ``SamplingParams``.

    ``max_tokens`` is what the client asked for (None: up to the end of the context,
    ``max_model_len - num_prompt_tokens``); ``max_tokens_field`` names it in errors.

    Raises:
        APIError: 400 naming the field and the allowed values.
    """
    if max_tokens is not None and max_tokens < 1:
        raise APIError(f"{max_tokens_field} must be at least 1, got {max_tokens}",
                       param=max_tokens_field)
    if max_tokens is None:
        max_tokens = max(max_model_len - num_prompt_tokens, 1)
    top_k = request.top_k
    try:
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=1.0 if request.temperature is None else request.temperature,
            top_p=1.0 if request.top_p is None else request.top_p,
            top_k=-1 if top_k is None or top_k == 0 else top_k,
            min_p=0.0 if request.min_p is None else request.min_p,
            seed=request.seed,
            stop=[request.stop] if isinstance(request.stop, str) else list(request.stop or []),
            stop_token_ids=list(request.stop_token_ids or []),
            ignore_eos=bool(request.ignore_eos),
            skip_special_tokens=request.skip_special_tokens is not False,
        )
    except ValueError as exc:
        param = param_from_value_error(str(exc))
        if param == "max_tokens":
            param = max_tokens_field
        raise APIError(str(exc), param=param) from None


def _same(value: object, ok: object) -> bool:
    if ok is None:
        return value is None
    return type(value) is type(ok) and value == ok
