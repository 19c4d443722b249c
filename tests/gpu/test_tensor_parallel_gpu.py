"""Tensor parallelism on two GPUs (NCCL): TP=2 against TP=1 on the same random-weight
checkpoints at real sizes, the Llama-3.2-1B shape (32 query / 8 KV heads) and the Huginn-0125
shape (55 heads, split 28 + 27; 8 recurrences, KV banks on every rank), with the default
CUDA path (Triton attention, decode replayed from CUDA graphs on every rank).

fp32: greedy tokens equal and every sampled step's logits within 1e-4 (Huginn: 5e-4, see the
test). bf16: the tolerance of ``tests.support.tp_parity.assert_close_bf16`` against the fp32 TP=1
run. Needs no HTTP stack.
Run: ``bash scripts/gpu_tests.sh -k tensor_parallel`` on a 2-GPU machine.
"""

import gc

import pytest
import torch

from latentserve.config import EngineConfig
from latentserve.sampling_params import SamplingParams
from tests.support.tp_parity import assert_close_bf16, assert_same, run_requests

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")]

HUGINN_SHAPE = {"n_embd": 5280, "num_attention_heads": 55, "num_key_value_heads": 55,
                "intermediate_size": 17920, "vocab_size": 65536, "block_size": 4096,
                "n_layers_in_prelude": 2, "n_layers_in_recurrent_block": 4,
                "n_layers_in_coda": 2, "mean_recurrence": 32, "max_recurrence": 32}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """``family -> checkpoint dir``, each written on first use. Huginn's weights are saved in
    bf16 (7 GB) and read back in fp32 by the fp32 runs, which is exact."""
    from latentserve.bench.baseline.recurrent_models import write_huginn
    from latentserve.bench.gpu import SHAPES, save_random_llama

    root, made = tmp_path_factory.mktemp("tp-gpu"), {}

    def get(family):
        if family not in made:
            if family == "huginn":
                made[family] = write_huginn(root / family, save_dtype=torch.bfloat16,
                                            init_device="cuda", **HUGINN_SHAPE)
            else:
                made[family] = save_random_llama(root / family, SHAPES[family])
            gc.collect()
            torch.cuda.empty_cache()
        return made[family]

    return get


def _requests(family):
    g = torch.Generator().manual_seed(1)
    lens = (7, 33, 64, 120, 5, 48)
    prompts = [torch.randint(3, 1000, (n,), generator=g).tolist() for n in lens]
    prompts.append(prompts[2] + [7, 8, 9])  # shares a prefix with prompt 2 (radix cache)
    kw = {"latent_budget": 8} if family == "huginn" else {}
    return [(p, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, **kw))
            for p in prompts]


def _run(path, family, dtype, tp, eager=False):
    from latentserve.engine.llm_engine import LLMEngine

    engine = LLMEngine(EngineConfig(model=str(path), device="cuda", dtype=dtype,
                                    max_model_len=256, max_num_seqs=8, kv_slots=2048,
                                    tensor_parallel_size=tp, enforce_eager=eager))
    try:
        out = run_requests(engine, _requests(family))
        assert (engine.runner.num_graph_steps > 0) != eager, "graphs replayed unless eager"
    finally:
        engine.shutdown()
        del engine
        gc.collect()
        torch.cuda.empty_cache()
    return out


@pytest.mark.parametrize("family", ["llama-3.2-1b", "huginn"])
def test_tp2_matches_tp1_at_real_shape(family, checkpoints):
    path = checkpoints(family)
    ref32 = _run(path, family, "float32", 1)
    # NOTE: the all-reduce sums the two ranks' partial products in another order than one
    # GEMM does. Llama (16 layers) stays within 1e-4; Huginn at 8 recurrences runs 36 layer
    # passes of width 5280 and differed by up to 2.6e-4 on the H200 (2026-11-29, greedy
    # tokens equal), so its bound is 5e-4.
    assert_same(ref32, _run(path, family, "float32", 2),
                atol=5e-4 if family == "huginn" else 1e-4)
    ref16 = _run(path, family, "bfloat16", 1)
    assert_close_bf16(ref32, ref16, _run(path, family, "bfloat16", 2))


def test_tp2_eager_matches_tp1_llama_shape(checkpoints):
    """Without CUDA graphs (tells a TP numerics failure from a graph-capture one)."""
    path = checkpoints("llama-3.2-1b")
    assert_same(_run(path, "llama-3.2-1b", "float32", 1, eager=True),
                _run(path, "llama-3.2-1b", "float32", 2, eager=True))
