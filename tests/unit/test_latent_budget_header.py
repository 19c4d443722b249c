"""``x-latent-budget`` header parsing (server/latent_params.latent_budget): every malformed or
out-of-range value is a 400 naming the header, never a 500."""

import pytest

from latentserve.latent.spec import LatentSpec
from latentserve.server.errors import APIError
from latentserve.server.latent_params import latent_budget
from latentserve.server.protocol import CompletionRequest

COCONUT = LatentSpec(kind="feedback", family="coconut", default_budget=6, max_budget=16)


class _Req:
    def __init__(self, headers):
        self.headers = headers


def _budget(raw):
    return latent_budget(_Req({"x-latent-budget": raw}), CompletionRequest(prompt="hi"), COCONUT)


def test_header_in_range_is_the_budget():
    assert _budget(" 3 ") == 3 and _budget("16") == 16


@pytest.mark.parametrize("raw", ["17", "9" * 50, "9" * 5000, "-1", "1.5", "abc", "", "\u0663"])
def test_bad_header_is_a_400_naming_it(raw):
    with pytest.raises(APIError) as exc:
        _budget(raw)
    assert exc.value.param == "x-latent-budget" and "x-latent-budget" in str(exc.value)


def test_stream_steps_on_a_model_without_latent_steps_is_refused_streamed_or_not():
    """docs/server.md: stream_latent_steps is a 400 naming it on plain and recurrent-depth
    models, and a malformed x-latent-stream-steps is a 400; both held only for streamed chat
    (a non-streamed chat or a completion silently ignored them)."""
    from latentserve.server.latent_params import refuse_stream_steps
    from latentserve.server.protocol import ChatCompletionRequest

    huginn = LatentSpec(kind="recurrent", family="huginn", default_budget=4, max_budget=8)
    msgs = [{"role": "user", "content": "hi"}]
    for stream in (False, True):
        body = ChatCompletionRequest(messages=msgs, stream=stream, stream_latent_steps=True)
        for spec in (None, huginn):
            with pytest.raises(APIError) as exc:
                refuse_stream_steps(_Req({}), body, spec)
            assert exc.value.param == "stream_latent_steps"
            with pytest.raises(APIError) as exc:
                refuse_stream_steps(_Req({"x-latent-stream-steps": "1"}),
                                    CompletionRequest(prompt="hi", stream=stream), spec)
            assert exc.value.param == "x-latent-stream-steps"
        if stream:
            assert refuse_stream_steps(_Req({}), body, COCONUT)  # feedback models tick
        else:  # ticks are stream chunks
            with pytest.raises(APIError, match="^stream_latent_steps needs stream: true"):
                refuse_stream_steps(_Req({}), body, COCONUT)
        off = ChatCompletionRequest(messages=msgs, stream=stream)
        assert not refuse_stream_steps(_Req({"x-latent-stream-steps": "0"}), off, None)
        with pytest.raises(APIError) as exc:
            refuse_stream_steps(_Req({"x-latent-stream-steps": "maybe"}),
                                ChatCompletionRequest(messages=msgs, stream=stream), COCONUT)
        assert exc.value.param == "x-latent-stream-steps"
