"""An overlapped engine's steady decode steps on CUDA wait for the device only through the
previous step's event: no blocking copy, ``.item()`` or stream sync
(``torch.cuda.set_sync_debug_mode("error")`` raises on one). Plain Llama with greedy,
temperature-1, mixed top-k/top-p/min-p and seeded rows, and rows with logprobs and
penalties; CODI, whose suppressed id is masked out of every step's logits (issue 27: one
pageable copy there cost CODI 7.6% a step)."""

import pytest
import torch

from latentserve.bench.baseline.latent_models import save_latent_tiny
from latentserve.bench.baseline.tiny_models import save_tiny
from latentserve.config import EngineConfig
from latentserve.engine.llm_engine import LLMEngine
from latentserve.sampling_params import SamplingParams

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

ROWS = {
    "greedy": lambda i: {"temperature": 0.0},
    "t1": lambda i: {"temperature": 1.0},
    "mixed": lambda i: {"temperature": (0.7, 1.0)[i % 2], "top_k": 20, "top_p": 0.9,
                        "min_p": 0.05},
    "seeded": lambda i: {"temperature": 1.0, "seed": i},
    # logprobs travel to the host beside the tokens; penalties count the pending token on
    # the device (PenaltyCounts.count)
    "scored": lambda i: {"temperature": (0.0, 1.0)[i % 2], "logprobs": i % 3,
                         "presence_penalty": 0.5, "frequency_penalty": 0.3,
                         "repetition_penalty": (1.0, 1.2)[i % 2]},
}


def _steady_steps_sync_free(engine: LLMEngine, fields: dict, kind: str, batch: int = 8,
                            steps: int = 6) -> int:
    """Run ``batch`` requests of ``kind`` until every row decodes, then ``steps`` steps with
    syncs as errors; returns how many of those steps overlapped a launched batch."""
    for i in range(batch):
        engine.add_request(f"{kind}-{i}", [5 + (i * 3 + k) % 50 for k in range(12)],
                           SamplingParams(max_tokens=4 * steps, ignore_eos=True, **fields,
                                          **ROWS[kind](i)))
    sched = engine.scheduler
    while not (len(sched.running) == batch and not sched.waiting and all(
            r.num_computed >= len(r.prompt_ids) for r in sched.running)):
        engine.step()
    engine.step()
    overlapped = 0
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(steps):
            engine.step()
            overlapped += engine.inflight is not None
    finally:
        torch.cuda.set_sync_debug_mode("default")
    while engine.has_unfinished_requests():
        engine.step()
    return overlapped


@pytest.mark.parametrize("kind", list(ROWS))
def test_plain_decode_steps_do_not_sync(tmp_path, kind):
    path = save_tiny(tmp_path / "llama", "llama", word_tokenizer=True)
    engine = LLMEngine(EngineConfig(model=str(path), device="cuda", dtype="float32",
                                    kv_slots=2048, max_model_len=256))
    assert _steady_steps_sync_free(engine, {}, kind) == 6


@pytest.mark.parametrize("kind", ["greedy", "t1"])
def test_codi_decode_steps_do_not_sync(tmp_path, kind):
    path = save_latent_tiny(tmp_path / "codi", "codi-llama")
    engine = LLMEngine(EngineConfig(model=str(path), device="cuda", dtype="float32",
                                    kv_slots=2048, max_model_len=256))
    assert engine.latent_spec.suppress_ids
    assert _steady_steps_sync_free(engine, {"latent_budget": 0}, kind) == 6
