"""Chunked prefill under ``max_num_batched_tokens`` (issue 28): while a long prompt is
admitted, a running decode keeps getting a token every step; the prompt takes
ceil(prompt / (budget - decodes)) steps instead of one (``bench/prefill_itl.py``)."""

import math

import pytest

from benchmarks.prefill_itl import measure

PROMPT = 512


@pytest.fixture(scope="module")
def long_model(tmp_path_factory, smollm2_dir):
    from latentserve.bench.baseline.tiny_models import save_tiny

    return str(save_tiny(tmp_path_factory.mktemp("itl") / "tiny", "llama",
                         max_position_embeddings=1024))


def test_decode_gets_a_token_every_step_of_a_chunked_prefill(long_model):
    run = measure(long_model, PROMPT, budget=64, decode_tokens=32)
    assert run["decode_token_every_step"]
    assert run["prefill_steps"] >= math.ceil(PROMPT / 63)  # one budget slot is the decode's


def test_a_budget_over_the_prompt_prefills_it_in_one_step(long_model):
    run = measure(long_model, PROMPT, budget=1024, decode_tokens=32)
    assert run["prefill_steps"] == 1 and run["decode_token_every_step"]
