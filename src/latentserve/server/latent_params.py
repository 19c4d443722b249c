"""A request's latent controls over HTTP, with 400s that name the header or field:
``x-latent-budget``, the compression-head controls (``x-latent-*`` headers and their
``x-ds4-*`` aliases over body fields), per-step stream ticks, and the KV positions the latent
phase adds to a prompt. ``latent.head`` imports torch: the functions that need it import it."""

from __future__ import annotations

import re
from collections.abc import Sequence

from latentserve.sampling_params import LATENT_TEMPERATURE_MAX
from latentserve.server.errors import APIError
from latentserve.server.fields import route_of
from latentserve.server.protocol import SamplingRequest


def latent_budget(http_request, body, spec=None) -> int | None:
    """Header ``x-latent-budget`` > body ``latent_budget`` > None (the model's default).
    APIError (400 naming the header or field) for a value that is not a non-negative integer,
    outside ``spec``'s ``[min_budget, max_budget]``, or > 0 on a model without latent steps."""
    raw = _headers(http_request).get("x-latent-budget")
    param = "x-latent-budget" if raw is not None else "latent_budget"
    value = body.latent_budget if raw is None else header_value(param, raw, "int")
    if value is None or (spec is not None and spec.kind == "head"):
        return value  # heads use the x-latent-* controls
    budgeted = spec is not None and spec.kind in ("feedback", "recurrent", "loop")
    if value != 0 and not budgeted:
        why = f", got {value}" if value < 0 else ": this model does no latent reasoning"
        raise APIError(f"{param} must be 0 or null{why}", param=param)
    if budgeted and not spec.min_budget <= value <= spec.max_budget:
        raise APIError(f"{param} must be in [{spec.min_budget}, {spec.max_budget}], got "
                       f"{value}", param=param)
    return value


def _colar_steps(spec, budget: int | None, head: dict,
                 thinking_budget: int | None) -> tuple[int, str | None]:
    """``(latent steps counted, the field that set them or None)`` of a request to CoLaR
    ``spec``: none while not thinking; else a sent cap (``head["max_latent"]`` or ``budget``)
    or the sent floor ``head["min_latent"]`` (at most the cap, the model's default if none
    sent) where larger, at most ``thinking_budget``."""
    if not (head.get("thinking") if head.get("thinking") is not None else budget != 0):
        return 0, None
    cap = head.get("max_latent") if head.get("max_latent") is not None else budget
    # the engine runs at least min_latent steps, up to the cap (the model's if none sent)
    floor = min(head.get("min_latent") or 0, spec.default_max_latent if cap is None else cap)
    steps = max(cap or 0, floor)
    param = ("min_latent" if floor > (cap or 0) else "max_latent"
             if head.get("max_latent") is not None else "latent_budget")
    if thinking_budget is not None and thinking_budget < steps:
        steps, param = thinking_budget, "thinking_token_budget"
    return steps, param if steps > 0 else None


def _is_colar(spec) -> bool:
    return spec is not None and spec.kind == "head" and bool(spec.default_max_latent)


def positions_param(spec, budget: int | None, head: dict,
                    thinking_budget: int | None) -> str | None:
    """The field whose value :func:`latent_positions` counted beyond the model's fixed
    transitions (``latent_budget``, ``max_latent``, ``min_latent``, ``thinking_token_budget``),
    or None when only those transitions or the model's own cap count."""
    if not _is_colar(spec):
        feedback = spec is not None and spec.kind in ("feedback", "loop")
        return "latent_budget" if feedback and budget else None
    return _colar_steps(spec, budget, head, thinking_budget)[1]


def latent_positions(spec, budget: int | None, head: dict | None = None,
                     prompt_ids: Sequence[int] = (), thinking_budget: int | None = None) -> int:
    """KV positions a model adds between the prompt and the answer that ``max_tokens`` does
    not count (``budget`` in range: :func:`latent_budget` checked it). Feedback and looped
    models: start, latent or block and end positions. CoLaR: its speed and ``###`` (none when
    ``prompt_ids`` ends with ``###``, upstream's whole prompt), the closing ``###`` and the
    latent steps :func:`_colar_steps` counts (the default cap itself is not counted: a latent
    phase that reaches the end of the context ends with ``length``). 0 for other models."""
    if _is_colar(spec):
        whole = bool(prompt_ids) and prompt_ids[-1] == spec.start_ids[-1]
        steps, _ = _colar_steps(spec, budget, head or {}, thinking_budget)
        return (0 if whole else len(spec.start_ids)) + steps + len(spec.end_ids)
    if spec is None or spec.kind not in ("feedback", "loop"):
        return 0
    return spec.prompt_extra(spec.resolve_budget(budget))


# Head controls: field -> (header, seed alias header or None, parser kind).
HEAD_HEADERS = {
    "thinking": ("x-latent-thinking", "x-ds4-thinking", "bool"),
    "max_latent": ("x-latent-max", "x-ds4-max-latent", "int"),
    "min_latent": ("x-latent-min", "x-ds4-min-latent", "int"),
    "use_stop": ("x-latent-use-stop", "x-ds4-use-stop", "bool"),
    "stop_threshold": ("x-latent-stop-threshold", "x-ds4-stop-threshold", "float"),
    "min_output_tokens": ("x-latent-min-output-tokens", "x-ds4-min-output-tokens", "int"),
    "compression_factor": ("x-latent-compression-factor", None, "int"),
    "latent_temperature": ("x-latent-temperature", None, "temperature"),
}


def head_controls(http_request, body: SamplingRequest,
                  template_kwargs: dict | None = None) -> dict:
    """``HEAD_HEADERS`` controls: header (``x-latent-*`` > ``x-ds4-*``) > body > template
    thinking > None; ``x-latent-budget: 0`` turns thinking off unless a thinking header is
    sent. APIError (400 naming the header or template key) for a malformed value."""
    out = {k: getattr(body, k, None) for k in HEAD_HEADERS}
    from_template = checked_template_thinking(template_kwargs)  # checked even when unused
    if out["thinking"] is None:
        out["thinking"] = from_template
    headers = _headers(http_request)
    for name, (hdr, alias, kind) in HEAD_HEADERS.items():
        used = hdr if headers.get(hdr) is not None or alias is None else alias
        if headers.get(used) is not None:
            out[name] = header_value(used, headers[used], kind)
    if out["thinking"] and (headers.get("x-latent-budget") or "").strip() == "0" \
            and not any(headers.get(h) is not None for h in HEAD_HEADERS["thinking"][:2]):
        out["thinking"] = False  # header x-latent-budget: 0 (thinking off) beats the body
    return out


def thinking_kwargs(template_kwargs: dict | None, thinking: bool | None) -> dict | None:
    """``template_kwargs`` with ``thinking`` and ``enable_thinking`` set to ``thinking``
    (the template renders the opening, or not), unchanged when it is None."""
    if thinking is None:
        return template_kwargs
    return {**(template_kwargs or {}), "thinking": thinking, "enable_thinking": thinking}


def checked_template_thinking(template_kwargs: dict | None) -> bool | None:
    """``latent.head.template_thinking`` with its ValueError as an APIError (400) naming
    the ``chat_template_kwargs`` key."""
    from latentserve.latent.head import template_thinking

    try:
        return template_thinking(template_kwargs)
    except ValueError as e:
        raise APIError(str(e), param=str(e).split()[0]) from None


def _headers(http_request) -> dict:
    return getattr(http_request, "headers", None) or {}


def sent_as(http_request, name: str) -> str:
    """The header of ``http_request`` that set control ``name`` (``x-latent-*`` before its
    ``x-ds4-*`` alias; ``x-latent-budget`` for ``latent_budget``), else ``name`` itself."""
    headers = _headers(http_request)
    names = ("x-latent-budget",) if name == "latent_budget" else HEAD_HEADERS.get(name, ())[:2]
    return next((h for h in names if h is not None and headers.get(h) is not None), name)


def header_error(http_request, message: str, param: str | None,
                 code: str | None = None) -> APIError:
    """A 400 with ``message`` naming ``param``, or, where ``param`` is a control a header of
    ``http_request`` set (:func:`sent_as`), naming that header instead (every mention of a
    snake_case field, the first of a one-word one)."""
    header = param and sent_as(http_request, param)
    if header != param:
        message = re.sub(rf"\b{param}\b", f"header {header}", message,
                         count=0 if "_" in param else 1)
    return APIError(message, param=header, code=code)


_WANT = {"bool": "a boolean (1/0, true/false, yes/no, on/off)", "int": "a non-negative integer",
         "float": "a number in [0, 1]",
         "temperature": f"a number in [0, {LATENT_TEMPERATURE_MAX:g}]"}


def header_value(name: str, raw: str, kind: str):
    """Header ``name``'s ``raw`` value as a ``kind`` of ``_WANT``. Raises APIError (400
    naming the header) when it is not one."""
    from latentserve.latent.head import parse_bool

    try:
        if kind == "bool":
            return parse_bool(name, raw)
        if kind == "int" and raw.strip().isascii() and raw.strip().isdigit():
            if len(raw.strip()) > 4300:  # Python's int() digit limit: far above any cap
                raise APIError(f"header {name} is too large ({len(raw.strip())} digits)",
                               param=name)
            return int(raw)
        if kind in ("float", "temperature"):
            value = float(raw)
            if 0.0 <= value <= (1.0 if kind == "float" else LATENT_TEMPERATURE_MAX):
                return value
    except ValueError:
        pass
    try:  # the ASGI server decodes header bytes as latin-1; show UTF-8 text as sent
        shown = raw.encode("latin-1").decode("utf-8")
    except UnicodeError:
        shown = raw
    raise APIError(f"header {name} must be {_WANT[kind]}, got {shown!r}", param=name)


def refuse_head_controls(http_request, body, controls: dict, spec=None) -> None:
    """APIError (400 naming the header or field) for head controls the model would ignore:
    any without a head (unless thinking is off; ``thinking`` itself is taken by feedback and
    looped models, whose latent steps it turns on or off), those not in ``spec.controls``
    with one, or
    ``compression_factor`` outside ``[1, spec.max_compression_factor]``."""
    head = spec is not None and spec.kind == "head"
    if not head and controls.get("thinking") is False:
        return
    taken = spec.controls if head else ()
    stepped = spec is not None and spec.kind in ("feedback", "loop")  # thinking: on is theirs
    headers = _headers(http_request)
    for name, (hdr, alias, _) in HEAD_HEADERS.items():
        field = name in type(body).model_fields and getattr(body, name) is not None
        sent = next((h for h in (hdr, alias) if h is not None and headers.get(h) is not None),
                    name if field else None)
        if name in taken or sent is None or (name == "thinking" and stepped):
            continue
        if taken:
            why = (f"is not a control of this model's latent head ({spec.family}; it takes "
                   f"{', '.join(taken)})")
        elif name in ("compression_factor", "latent_temperature"):
            why = "needs a CoLaR model (a directory with colar_config.json); leave it out"
        else:  # how to turn thinking off, in the route's own form for a body field
            messages = route_of(type(body)) == "/v1/messages"
            off = (f"{HEAD_HEADERS['thinking'][0]}: false" if sent != name else "thinking: "
                   + ('{"type": "disabled"}' if messages else "false"))
            also = (" (or latent steps, or <think> text under --reasoning-parser)"
                    if messages and sent == "thinking" else "")
            why = (f"needs a model with a compression head{also}; this model has none (send "
                   f"{off} or leave it out)")
        raise APIError(f"{'header ' if sent != name else ''}{sent} {why}", param=sent)
    c = controls.get("compression_factor")
    if c is not None and "compression_factor" in taken and \
            not 1 <= c <= spec.max_compression_factor:
        sent = HEAD_HEADERS["compression_factor"][0]
        param = sent if headers.get(sent) is not None else "compression_factor"
        raise APIError(f"{param} must be in [1, {spec.max_compression_factor}] for this model, "
                       f"got {c}", param=param)


STREAM_STEPS_HEADER = "x-latent-stream-steps"


def refuse_stream_steps(http_request, body, spec=None) -> bool:
    """Whether latent steps are asked to stream: header ``x-latent-stream-steps`` > body
    ``stream_latent_steps`` > False. APIError (400 naming the header or field) when asked of a
    model without latent steps or without ``stream`` (the ticks are stream chunks), for the
    header asking on /v1/messages (which has no such field), or for a malformed header."""
    raw = _headers(http_request).get(STREAM_STEPS_HEADER)
    sent = STREAM_STEPS_HEADER if raw is not None else "stream_latent_steps"
    asked = (bool(getattr(body, "stream_latent_steps", None)) if raw is None
             else header_value(STREAM_STEPS_HEADER, raw, "bool"))
    if not asked:
        return False
    if raw is not None and route_of(type(body)) == "/v1/messages":
        raise APIError(f"header {sent} is not taken on /v1/messages (its thinking block "
                       "shows latent steps per latent_reasoning); leave it out", param=sent)
    if spec is None or spec.kind not in ("feedback", "head", "loop"):
        what = ("a recurrent-depth model" if spec is not None
                else "a model without latent reasoning")
        raise APIError(f"{sent} needs a model with latent steps, not {what} (it would "
                       "silently do nothing)", param=sent)
    if not body.stream:
        raise APIError(f"{sent} needs stream: true (each latent step is a stream chunk)",
                       param=sent)
    return True


# Every latent header the server reads; another ``x-latent-*`` or ``x-ds4-*`` one is a 400.
KNOWN_HEADERS = ("x-latent-budget", STREAM_STEPS_HEADER,
                 *(h for hdr, alias, _ in HEAD_HEADERS.values() for h in (hdr, alias) if h))


def refuse_unknown_headers(http_request) -> None:
    """APIError (400 naming the header) for an ``x-latent-*`` or ``x-ds4-*`` header that is
    not one of ``KNOWN_HEADERS`` (a typo such as ``x-latent-maxx`` would do nothing)."""
    for name in _headers(http_request):
        header = name.lower()
        if header.startswith(("x-latent-", "x-ds4-")) and header not in KNOWN_HEADERS:
            raise APIError(f"header {header} is not a header this server takes; the latent "
                           f"headers are {', '.join(KNOWN_HEADERS)}", param=header)


def latent_controls(http_request, body, spec, template_kwargs: dict | None = None
                    ) -> tuple[int | None, dict, bool]:
    """``(budget, head controls, ticks)``: :func:`latent_budget`, checked :func:`head_controls`
    and whether a stream ticks per latent step. APIError (400 naming the header or field; an
    unknown latent header too: :func:`refuse_unknown_headers`)."""
    refuse_unknown_headers(http_request)
    budget = latent_budget(http_request, body, spec)
    head = head_controls(http_request, body, template_kwargs)
    if head["thinking"] is False and budget is None and spec is not None \
            and spec.kind == "feedback":
        budget = 0  # thinking off: no latent steps (the engine's rule: latent/family.py)
    refuse_head_controls(http_request, body, head, spec)
    return budget, head, refuse_stream_steps(http_request, body, spec)
