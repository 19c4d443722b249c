"""Compression-head controls over HTTP (server/latent_params.head_controls): header > body >
server default, x-ds4-* aliases, chat_template_kwargs thinking, 400 naming a malformed
header; and the controls reach SamplingParams."""

import dataclasses
from types import SimpleNamespace

import pytest

from latentserve.server.errors import APIError
from latentserve.server.latent_params import head_controls
from latentserve.server.params import sampling_params
from latentserve.server.protocol import ChatCompletionRequest


class _Req:
    def __init__(self, headers):
        self.headers = headers


def _body(**kw):
    return ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}],
                                 **{"max_tokens": 16, **kw})


# The server state sampling_params reads: a plain model with a 512-token context.
STATE = SimpleNamespace(max_model_len=512, latent_spec=None, sampling_defaults=None)


def test_defaults_are_none_so_the_engine_uses_env():
    c = head_controls(_Req({}), _body())
    assert c == dict.fromkeys(("thinking", "max_latent", "min_latent", "use_stop",
                               "stop_threshold", "min_output_tokens", "compression_factor",
                               "latent_temperature"))


def test_header_beats_body_and_aliases_work():
    body = _body(max_latent=10, min_latent=2, stop_threshold=0.3, use_stop=True)
    c = head_controls(_Req({"x-latent-max": "64", "x-ds4-min-latent": "5",
                            "x-ds4-use-stop": "off", "x-ds4-stop-threshold": "0.9",
                            "x-latent-stop-threshold": "0.7",
                            "x-ds4-min-output-tokens": "0", "x-ds4-thinking": "yes"}), body)
    assert c == {"thinking": True, "max_latent": 64, "min_latent": 5, "use_stop": False,
                 "stop_threshold": 0.7, "min_output_tokens": 0, "compression_factor": None,
                 "latent_temperature": None}
    assert head_controls(_Req({}), body)["max_latent"] == 10


def test_thinking_from_template_kwargs_below_body_and_header():
    assert head_controls(_Req({}), _body(), {"enable_thinking": True})["thinking"] is True
    assert head_controls(_Req({}), _body(), {"thinking": False})["thinking"] is False
    assert head_controls(_Req({}), _body(thinking=False), {"thinking": True})["thinking"] is False
    assert head_controls(_Req({"x-latent-thinking": "1"}), _body(thinking=False))["thinking"]
    # a stringified boolean counts, a null is unset; any other value is a 400 naming the key
    assert head_controls(_Req({}), _body(), {"enable_thinking": "false"})["thinking"] is False
    assert head_controls(_Req({}), _body(), {"enable_thinking": None})["thinking"] is None


def test_template_thinking_is_checked_even_under_a_body_value_and_both_keys_must_agree():
    with pytest.raises(APIError) as e:
        head_controls(_Req({}), _body(thinking=False), {"enable_thinking": 0})
    assert e.value.param == "chat_template_kwargs.enable_thinking"
    with pytest.raises(APIError, match="enable_thinking disagrees with"):
        head_controls(_Req({}), _body(), {"thinking": True, "enable_thinking": "off"})
    assert head_controls(_Req({}), _body(), {"thinking": "on", "enable_thinking": True}
                         )["thinking"] is True


@pytest.mark.parametrize("key", ["thinking", "enable_thinking"])
@pytest.mark.parametrize("value", [0, 1, "maybe", [], {"a": 1}, 0.5])
def test_template_thinking_other_than_a_boolean_is_a_400(key, value):
    with pytest.raises(APIError) as e:
        head_controls(_Req({}), _body(), {key: value})
    assert e.value.param == f"chat_template_kwargs.{key}"
    assert str(e.value).startswith(f"chat_template_kwargs.{key} must be")


@pytest.mark.parametrize("header,value", [("x-latent-max", "-3"), ("x-ds4-max-latent", "ten"),
                                          ("x-latent-use-stop", "maybe"),
                                          ("x-ds4-stop-threshold", "1.5"),
                                          ("x-latent-min-output-tokens", "4.5")])
def test_malformed_header_is_a_400_naming_it(header, value):
    with pytest.raises(APIError) as e:
        head_controls(_Req({header: value}), _body())
    assert e.value.param == header and header in str(e.value)


def test_a_non_ascii_header_value_is_quoted_as_sent():
    """Starlette hands header bytes over as latin-1 text; the 400 shows the UTF-8 sent."""
    sent = "\u0663".encode().decode("latin-1")  # ARABIC-INDIC DIGIT THREE, as it arrives
    with pytest.raises(APIError) as e:
        head_controls(_Req({"x-latent-max": sent}), _body())
    assert str(e.value).endswith("got '\u0663'")


def test_controls_reach_sampling_params_and_bad_body_names_field():
    body = _body(max_latent=7)
    c = head_controls(_Req({"x-latent-stop-threshold": "0.25"}), body)
    p = sampling_params(body, "max_tokens", 3, STATE, head=c)
    assert p.max_latent == 7 and p.stop_threshold == 0.25 and p.use_stop is None
    with pytest.raises(APIError) as e:
        sampling_params(_body(min_latent=-1), "max_tokens", 3, STATE)
    assert e.value.param == "min_latent"
    # a floor above the cap, in the body or from headers: a 400 naming min_latent
    with pytest.raises(APIError, match="at most max_latent") as e:
        sampling_params(_body(max_latent=3, min_latent=5), "max_tokens", 3, STATE)
    assert e.value.param == "min_latent"
    req = _Req({"x-latent-max": "2", "x-ds4-min-latent": "4"})
    c = head_controls(req, _body())
    with pytest.raises(APIError) as e:  # named as the header that sent it
        sampling_params(_body(), "max_tokens", 3, STATE, head=c, http_request=req)
    assert e.value.param == "x-ds4-min-latent"
    assert str(e.value).startswith("header x-ds4-min-latent must be")
    assert sampling_params(_body(max_latent=5, min_latent=5), "max_tokens", 3,
                           STATE).min_latent == 5
    # max_latent 0 runs no latent phase: any floor is moot, not an error
    assert sampling_params(_body(max_latent=0, min_latent=2), "max_tokens", 3,
                           STATE).max_latent == 0


@pytest.mark.parametrize("kw,field", [({"latent_head": "h.safetensors"}, "latent_head"),
                                      ({"latent_injection": "prompt"}, "latent_injection")])
def test_no_latent_head_with_a_head_option_is_a_config_error(kw, field, tmp_path,
                                                            monkeypatch):
    """``--no-latent-head`` beside ``--latent-head B`` (or ``--latent-injection``) served the
    bare backbone without a word: the two contradict, so the config refuses them."""
    from latentserve.config import EngineConfig

    monkeypatch.chdir(tmp_path)
    (tmp_path / "h.safetensors").write_bytes(b"")  # --latent-head must exist
    with pytest.raises(ValueError, match=f"no_latent_head.*{field}|{field}.*no_latent_head"):
        EngineConfig(no_latent_head=True, **kw)
    EngineConfig(**kw)
    EngineConfig(no_latent_head=True)


def test_budget_header_zero_beats_body_thinking():
    """Header ``x-latent-budget: 0`` turns thinking off over a body ``thinking: true``
    (header > body); a thinking header still decides; a body budget leaves it alone."""
    assert head_controls(_Req({"x-latent-budget": "0"}), _body(thinking=True))["thinking"] \
        is False
    assert head_controls(_Req({"x-latent-budget": "0", "x-latent-thinking": "on"}),
                         _body())["thinking"] is True
    assert head_controls(_Req({"x-latent-budget": "5"}), _body(thinking=True))["thinking"] \
        is True
    assert head_controls(_Req({}), _body(thinking=True, latent_budget=0))["thinking"] is True
    assert head_controls(_Req({"x-latent-budget": "0"}), _body())["thinking"] is None


def _spec(family):
    """A served head's ``LatentSpec`` as the API process sees it."""
    from latentserve.latent import colar_head, head
    from latentserve.latent.spec import LatentSpec

    if family == "colar":
        return LatentSpec(kind="head", family="colar", default_budget=0,
                          controls=colar_head.CONTROLS, max_compression_factor=5,
                          start_ids=(7, 8, 3), end_ids=(3,), default_max_latent=64)
    return LatentSpec(kind="head", family="compression-head", default_budget=0,
                      controls=head.CONTROLS)


@pytest.mark.parametrize("spec,headers,body,param", [
    (None, {"x-latent-compression-factor": "2"}, {}, "x-latent-compression-factor"),
    (None, {}, {"latent_temperature": 0.5}, "latent_temperature"),
    ("head", {"x-latent-temperature": "0.5"}, {}, "x-latent-temperature"),
    ("head", {}, {"compression_factor": 2}, "compression_factor"),
    ("colar", {"x-latent-stop-threshold": "0.5"}, {}, "x-latent-stop-threshold"),
    ("colar", {}, {"min_output_tokens": 0}, "min_output_tokens"),
    ("colar", {"x-latent-compression-factor": "6"}, {}, "x-latent-compression-factor"),
    ("colar", {}, {"compression_factor": 6}, "compression_factor")])
def test_a_control_the_served_model_does_not_take_is_a_400_naming_it(spec, headers, body,
                                                                     param):
    """A plain model takes no head control; a compression head no ``compression_factor``
    or ``latent_temperature``; CoLaR no ``stop_threshold`` or ``min_output_tokens``, and
    its thinking speed must be in ``[1, max_compression_factor]``."""
    from latentserve.server.latent_params import refuse_head_controls

    served = None if spec is None else _spec(spec)
    req, b = _Req(headers), _body(**body)
    with pytest.raises(APIError) as e:
        refuse_head_controls(req, b, head_controls(req, b), served)
    assert e.value.param == param and param in str(e.value)


def test_colar_controls_reach_sampling_params_and_the_floor_stays_off():
    from latentserve.server.latent_params import refuse_head_controls
    from latentserve.server.params import request_steps

    req = _Req({"x-latent-compression-factor": "4", "x-latent-temperature": "0.3"})
    body = _body(compression_factor=2, max_latent=9)
    c = head_controls(req, body)
    refuse_head_controls(req, body, c, _spec("colar"))
    p = sampling_params(body, "max_tokens", 3, STATE, head=c)
    assert (p.compression_factor, p.latent_temperature, p.max_latent) == (4, 0.3, 9)
    # max_tokens counts answer tokens only; the latent-step cap runs beside it
    assert request_steps(p, _spec("colar"), 3, 512) == 16 + 9
    assert request_steps(dataclasses.replace(p, max_latent=None), _spec("colar"), 3, 512) \
        == 16 + 64  # the model's default cap
    assert request_steps(dataclasses.replace(p, max_latent=None), _spec("colar"), 500, 512) \
        == 16 + 12  # within the context left
    assert request_steps(dataclasses.replace(p, thinking=False), _spec("colar"), 3, 512) == 16


def test_feedback_and_loop_latent_positions_count_toward_the_request_limit():
    from latentserve.latent.spec import LatentSpec
    from latentserve.sampling_params import SamplingParams
    from latentserve.server.params import check_request_steps, request_steps
    from latentserve.server.state import ServerLimits

    coconut = LatentSpec(kind="feedback", family="coconut", default_budget=6, max_budget=8,
                         start_ids=(1,), end_ids=(2,))
    lotus = LatentSpec(kind="loop", family="lotus", default_budget=3, max_budget=8,
                       start_ids=(1,), end_ids=(2,), block_size=16, loop_rule="same")
    p = SamplingParams(max_tokens=10)
    assert request_steps(p, coconut, 3, 512) == 10 + 1 + 6 + 1
    assert request_steps(dataclasses.replace(p, latent_budget=0), coconut, 3, 512) == 12
    assert request_steps(p, lotus, 3, 512) == 10 + 1 + 16 + 1
    state = SimpleNamespace(max_model_len=512, latent_spec=lotus, sampling_defaults=None,
                            limits=ServerLimits(max_request_output_tokens=100))
    check_request_steps([([1, 2, 3], p)] * 3, 1, "max_tokens", state)  # 3 x 28 = 84
    with pytest.raises(APIError, match="got 112 .* plus up to 18 latent positions") as e:
        check_request_steps([([1, 2, 3], p)] * 4, 1, "max_tokens", state)
    assert e.value.param == "max_tokens"


def test_contradicting_controls_name_the_header_that_sent_them():
    """Controls that contradict only once resolved against the model (a floor above a
    budget cap) are a 400 naming the header that sent the floor, or the field."""
    from latentserve.server.params import check_request_steps
    from latentserve.server.state import ServerLimits

    state = SimpleNamespace(max_model_len=512, latent_spec=_spec("colar"),
                            sampling_defaults=None, limits=ServerLimits())
    for headers, fields, param in (({"x-latent-budget": "5", "x-latent-min": "9"}, {},
                                    "x-latent-min"),
                                   ({}, {"latent_budget": 5, "min_latent": 9}, "min_latent")):
        req, body = _Req(headers), _body(**fields)
        p = sampling_params(body, "max_tokens", 3, state, head=head_controls(req, body),
                            budget=5, http_request=req)
        with pytest.raises(APIError) as e:
            check_request_steps([([1, 2, 3], p)], 1, "max_tokens", state, req)
        assert e.value.param == param and param in str(e.value)


def test_a_sent_colar_cap_counts_against_the_context():
    """CoLaR's sent ``max_latent`` (or ``latent_budget``, at most ``thinking_token_budget``)
    takes KV positions beside ``max_tokens``: with the speed and closing ids (no speed after
    a prompt ending with ``###``) it lowers a null ``max_tokens`` and a sent one over the
    context is a 400; the model's default cap and thinking off count the transitions only."""
    from latentserve.server.latent_params import latent_positions

    spec = _spec("colar")
    assert latent_positions(spec, None, {"max_latent": 9}) == 3 + 9 + 1
    assert latent_positions(spec, 9, {"max_latent": None}) == 3 + 9 + 1
    assert latent_positions(spec, None, {"max_latent": None}) == 3 + 1  # speed, ###s
    assert latent_positions(spec, None, {"max_latent": 9, "thinking": False}) == 3 + 1
    assert latent_positions(spec, None, {"max_latent": 9}, [5, 3]) == 9 + 1  # ends with ###
    assert latent_positions(spec, None, {"max_latent": 9}, [5, 6], 4) == 3 + 4 + 1
    state = SimpleNamespace(max_model_len=512, latent_spec=spec, sampling_defaults=None)
    body = _body(max_tokens=None, max_latent=100)
    p = sampling_params(body, "max_tokens", 20, state, head=head_controls(_Req({}), body))
    assert p.max_tokens == 512 - 20 - 104
    body = _body(max_tokens=None)  # no cap sent: the speed and ### positions fill it
    with pytest.raises(APIError) as e:
        sampling_params(body, "max_tokens", 509, state, head=head_controls(_Req({}), body))
    assert e.value.param == "messages" and str(e.value).endswith(
        "(509 in the prompt, 4 latent and transition positions, at least 1 in the completion)."
        " Please reduce the length of the prompt.")
    body = _body(max_tokens=400, max_latent=100)
    with pytest.raises(APIError) as e:
        sampling_params(body, "max_tokens", 20, state, head=head_controls(_Req({}), body))
    assert e.value.param == "max_tokens" and e.value.code == "context_length_exceeded"
    assert "(20 in the prompt, 104 latent and transition positions, 400 in the completion)" \
        in str(e.value) and "the latent steps or max_tokens" in str(e.value)


def test_a_sent_colar_floor_counts_against_the_context():
    """CoLaR runs at least ``min_latent`` latent steps, so a floor above the sent cap (or with
    none sent) counts as that many positions; past the context it is named (the header when
    a header sent it)."""
    from latentserve.server.latent_params import latent_positions

    spec = _spec("colar")
    assert latent_positions(spec, None, {"min_latent": 40}) == 3 + 40 + 1
    assert latent_positions(spec, None, {"min_latent": 4, "max_latent": 9}) == 3 + 9 + 1
    assert latent_positions(spec, None, {"min_latent": 40, "thinking": False}) == 3 + 1
    assert latent_positions(spec, None, {"min_latent": 90}) == 3 + 64 + 1  # the default cap
    assert latent_positions(spec, None, {"min_latent": 2, "max_latent": 0}) == 3 + 1
    state = SimpleNamespace(max_model_len=512, latent_spec=spec, sampling_defaults=None)
    body = _body(max_tokens=None, min_latent=60)
    p = sampling_params(body, "max_tokens", 20, state, head=head_controls(_Req({}), body))
    assert p.max_tokens == 512 - 20 - 64
    state = SimpleNamespace(max_model_len=80, latent_spec=spec, sampling_defaults=None)
    for req, b, param in ((_Req({}), _body(max_tokens=None, min_latent=60), "min_latent"),
                          (_Req({"x-latent-min": "60"}), _body(max_tokens=None),
                           "x-latent-min")):
        with pytest.raises(APIError) as e:
            sampling_params(b, "max_tokens", 20, state, head=head_controls(req, b),
                            http_request=req)
        assert e.value.param == param and e.value.code == "context_length_exceeded"
        assert str(e.value).endswith(f"Please reduce the length of the prompt or {param}.")
    body = _body(max_tokens=10, min_latent=60)
    with pytest.raises(APIError) as e:
        sampling_params(body, "max_tokens", 20, state, head=head_controls(_Req({}), body))
    assert e.value.param == "max_tokens" and "64 latent and transition positions" in str(e.value)


@pytest.mark.parametrize("headers,fields,param", [
    ({"x-ds4-min-latent": "60"}, {}, "x-ds4-min-latent"),  # the alias a client sent
    ({"x-ds4-max-latent": "70"}, {}, "x-ds4-max-latent"),
    ({"x-latent-min": "60", "x-ds4-min-latent": "2"}, {}, "x-latent-min"),  # it wins
    ({}, {"max_latent": 70}, "max_latent"),
    ({}, {"max_latent": 70, "thinking_token_budget": 65}, "thinking_token_budget"),
    ({}, {"max_latent": 70, "thinking_token_budget": 0}, "messages"),  # it adds none
    ({"x-latent-budget": "70"}, {}, "x-latent-budget"),
    # thinking off: only the transitions count, so the prompt is what to shorten
    ({"x-latent-min": "60", "x-latent-thinking": "off"}, {}, "messages"),
    ({}, {"min_latent": 60, "thinking": False}, "messages")])
def test_a_full_context_names_what_counted(headers, fields, param):
    """With null max_tokens, a 400 for latent positions that fill the context names the
    control that counted, as the header that set it, or the prompt when none did."""
    spec = _spec("colar")
    state = SimpleNamespace(max_model_len=80, latent_spec=spec, sampling_defaults=None)
    body, req = _body(max_tokens=None, **fields), _Req(headers)
    prompt = 78 if param == "messages" else 20  # 78 + 3 + 1 transitions fill 80
    with pytest.raises(APIError) as e:
        sampling_params(body, "max_tokens", prompt, state, head=head_controls(req, body),
                        budget=70 if "x-latent-budget" in headers else None, http_request=req)
    assert e.value.param == param and e.value.code == "context_length_exceeded"
    assert str(e.value).endswith("prompt." if param == "messages" else f"prompt or {param}.")


def test_only_what_adds_positions_is_named():
    """A control that adds no KV positions on this model is never named for a full
    context: a compression head's cap (its steps are generation steps), a recurrent
    model's budget (loops over one position), thinking off."""
    from latentserve.latent.spec import LatentSpec
    from latentserve.server.latent_params import positions_param

    assert positions_param(_spec("head"), None, {"max_latent": 70}, None) is None
    recurrent = LatentSpec(kind="recurrent", family="huginn", default_budget=4)
    assert positions_param(recurrent, 8, {}, None) is None
    assert positions_param(LatentSpec(kind="feedback", family="codi", default_budget=6), 6,
                           {}, None) == "latent_budget"
    assert positions_param(_spec("colar"), None, {"max_latent": 9, "thinking": False},
                           None) is None


def test_an_engine_refusal_of_a_header_control_names_the_header():
    """CoLaR's engine-side refusals name ``compression_factor``; over HTTP the header that
    sent it is named instead (the body field where no header did)."""
    from latentserve.server.client import EngineRequestError
    from latentserve.server.serving import api_error

    exc = EngineRequestError("compression_factor 3 contradicts the prompt's (Thinking speed: "
                             "2); send the question alone or leave compression_factor out")
    req = SimpleNamespace(headers={"x-latent-compression-factor": "3"},
                          url=SimpleNamespace(path="/v1/completions"))
    err = api_error(exc, req)
    assert err.param == "x-latent-compression-factor"
    assert str(err).startswith("header x-latent-compression-factor 3 contradicts")
    assert str(err).endswith("leave header x-latent-compression-factor out")
    req.headers = {}
    assert api_error(exc, req).param == "compression_factor"
    assert str(api_error(exc, req)) == str(exc)
