"""``max_logprobs`` (vLLM's engine argument, default 20; -1: the vocabulary size) caps the
``logprobs`` and ``prompt_logprobs`` a request may ask for, offline (a ValueError naming the
field and the range) and served (a 400 from the API process, the cap taken from the engine
configs)."""

import pytest

from latentserve.config import EngineConfig
from latentserve.engine.llm_engine import LLMEngine
from latentserve.sampling_params import SamplingParams


@pytest.mark.parametrize("field", ["logprobs", "prompt_logprobs"])
def test_the_engine_refuses_more_logprobs_than_max_logprobs(tiny_dirs, field):
    engine = LLMEngine(EngineConfig(model=str(tiny_dirs["llama"]), max_logprobs=3))
    engine.add_request("ok", [5, 6, 7], SamplingParams(max_tokens=2, **{field: 3}))
    with pytest.raises(ValueError, match=rf"^{field} must be in \[0, 3\] \(max_logprobs\), "
                                         "got 4$"):
        engine.add_request("no", [5, 6, 7], SamplingParams(max_tokens=2, **{field: 4}))
    while engine.has_unfinished_requests():
        engine.step()
    engine.cache.check_idle()
    default = LLMEngine(EngineConfig(model=str(tiny_dirs["llama"])))
    with pytest.raises(ValueError, match=r"\[0, 20\]"):  # vLLM's default
        default.check_request([5, 6], SamplingParams(**{field: 21}))
    vocab = LLMEngine(EngineConfig(model=str(tiny_dirs["llama"]), max_logprobs=-1))
    vocab.check_request([5, 6], SamplingParams(**{field: vocab.vocab_size}))
    with pytest.raises(ValueError, match=rf"\[0, {vocab.vocab_size}\]"):
        vocab.check_request([5, 6], SamplingParams(**{field: vocab.vocab_size + 1}))


def test_the_server_cap_comes_from_the_engine_configs():
    from latentserve.cli import build_parser, engine_config
    from latentserve.server.errors import APIError
    from latentserve.server.params import check_logprobs
    from latentserve.server.state import ServerLimits

    assert engine_config(build_parser().parse_args(["serve", "--max-logprobs", "5"])) \
        .max_logprobs == 5
    check_logprobs(5, "top_logprobs", ServerLimits(max_logprobs=5))
    with pytest.raises(APIError, match=r"^top_logprobs must be in \[0, 5\], got 6$"):
        check_logprobs(6, "top_logprobs", ServerLimits(max_logprobs=5))
    check_logprobs(10**6, "logprobs", ServerLimits(max_logprobs=None))  # the engine checks
    with pytest.raises(APIError):
        check_logprobs(-1, "logprobs", ServerLimits(max_logprobs=None))
    with pytest.raises(ValueError):
        EngineConfig(max_logprobs=-2)
