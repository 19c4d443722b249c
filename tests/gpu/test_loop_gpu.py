"""Looped latent blocks on CUDA (run on the H200 with ``scripts/gpu_tests.sh``): the engine's
default CUDA path (Triton attention for the block passes' extend rows, decode replayed from
CUDA graphs) gives, in fp32, the greedy answers of the eager full-recomputation reference on
the same GPU and first-answer logits within 1e-4, for PCCoT (GPT-2, Llama with ``prj``) and
LOTUS in one mixed-budget batch; every pass reuses the block's slots; no slot leaks."""

import pytest
import torch

from latentserve.bench.baseline.loop_reference import load_pccot_reference
from latentserve.config import EngineConfig
from latentserve.engine.llm_engine import LLMEngine
from tests.support.loop_models import load_lotus_reference, save_loop_tiny
from tests.support.loop_reference import reference_generate_loop
from tests.support.parity import run_budget_batch, shared_prefix_prompts

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

KINDS = {"pccot-gpt2": 5, "pccot-llama": 3, "lotus-llama": 8}
BUDGETS = (0, 1, 3, 6)
MAX_TOKENS = 8


@pytest.mark.parametrize("kind", list(KINDS))
def test_looped_block_cuda_matches_reference(kind, tmp_path, smollm2_dir):
    pytest.importorskip("peft")
    model_dir = save_loop_tiny(tmp_path / kind, kind, block_size=KINDS[kind], iterations=2)
    ref = (load_lotus_reference(str(model_dir), "cuda") if kind.startswith("lotus") else
           load_pccot_reference(str(tmp_path / kind / "base"), str(tmp_path / kind / "adapter"),
                                "cuda"))
    engine = LLMEngine(EngineConfig(model=str(model_dir), device="cuda", dtype="float32",
                                    kv_slots=8192))
    reqs = [(p, BUDGETS[i % len(BUDGETS)]) for i, p in enumerate(shared_prefix_prompts())]
    want = [reference_generate_loop(ref, p, b, MAX_TOKENS) for p, b in reqs]
    added, add = [], engine.scheduler.add
    engine.scheduler.add = lambda req: (added.append(req), add(req))  # their LoopStates
    for _ in ("cold", "warm"):  # run_budget_batch: synchronous or overlapped (the default)
        added.clear()
        served = run_budget_batch(engine, reqs, MAX_TOKENS)
        for i, (req, (_, b), (ans, lg, _), (want_ans, want_lg)) in enumerate(
                zip(added, reqs, served, want)):
            assert ans == want_ans, f"request {i}"
            torch.testing.assert_close(lg, want_lg, atol=1e-4, rtol=0)
            assert req.state.slot_checks == b
        engine.cache.check_idle()
    assert engine.runner.num_graph_steps > 0
