"""Logprobs, prompt logprobs and penalties under overlap scheduling, for every family (issue
27): a model of each family runs its mixed requests (latent phases, budgets, caps, stops,
traces) with logprobs, prompt logprobs and the three penalties spread over them, in the
synchronous and the overlapped engine; tokens, finish reasons, latent step counts, logprobs
and prompt logprobs are the same, cold and with the prefix cache warm, and the overlapped
engine overlaps."""

import dataclasses

import pytest

from latentserve.bench.baseline.latent_models import save_latent_tiny
from latentserve.bench.baseline.recurrent_models import write_huginn, write_ouro
from latentserve.config import EngineConfig
from latentserve.engine.llm_engine import LLMEngine
from tests.support.colar_models import save_colar_tiny
from tests.support.head_models import save_head_model
from tests.support.loop_models import save_loop_tiny
from tests.support.overlap_runs import assert_same_scored, scored_outputs
from tests.support.recurrent_requests import mixed_recurrent_requests
from tests.support.tp_parity import (
    mixed_colar_requests,
    mixed_feedback_requests,
    mixed_head_requests,
    spy_overlapped,
)

# family model -> (builder of its directory under a root, its mixed requests)
MODELS = {
    "coconut-gpt2": (lambda root: save_latent_tiny(root, "coconut-gpt2"), mixed_feedback_requests),
    "codi-llama": (lambda root: save_latent_tiny(root, "codi-llama"), mixed_feedback_requests),
    "head": (lambda root: save_head_model(root, source_layer=1, stop_bias=0.3),
             mixed_head_requests),
    "colar": (lambda root: save_colar_tiny(root, stop_push=16.0), mixed_colar_requests),
    "pccot-gpt2": (lambda root: save_loop_tiny(root, "pccot-gpt2", iterations=2),
                   mixed_feedback_requests),
    "lotus-llama": (lambda root: save_loop_tiny(root, "lotus-llama", block_size=6,
                                                iterations=2), mixed_feedback_requests),
    "huginn": (write_huginn, lambda: mixed_recurrent_requests("huginn")),
    "ouro": (write_ouro, lambda: mixed_recurrent_requests("ouro")),
}

# spread over the requests in turn (the fourth kind adds nothing)
SCORED = [{"logprobs": 2, "presence_penalty": 1.5},
          {"logprobs": 0, "frequency_penalty": 1.0, "prompt_logprobs": 1},
          {"repetition_penalty": 1.8, "logprobs": 1},
          {}]


def _scored(requests):
    return [(p, dataclasses.replace(sp, **SCORED[i % len(SCORED)]))
            for i, (p, sp) in enumerate(requests)]


@pytest.mark.parametrize("model", list(MODELS))
def test_overlapped_engine_scores_and_penalizes_like_the_synchronous_one(
        tmp_path, smollm2_dir, model):
    if model == "pccot-gpt2":
        pytest.importorskip("peft")  # PCCoT's adapter
    build, requests = MODELS[model]
    path, requests = build(tmp_path / model), _scored(requests())

    def engine(overlapped: bool):
        return LLMEngine(EngineConfig(model=str(path), kv_slots=4096, max_model_len=256,
                                      overlap_schedule=overlapped))

    want = scored_outputs(engine(False), requests, rounds=2)
    over = engine(True)
    overlapped = spy_overlapped(over)
    got = scored_outputs(over, requests, rounds=2)
    assert_same_scored(got, want)
    assert sum(overlapped) > 10
    assert any(g[1] for g in want[0]) and any(g[2] for g in want[0])
