"""The Llama fast path (``use_fused_ops``: merged q/k/v and gate/up GEMMs, fused residual-add
+ RMSNorm, in-place RoPE, SiLU-and-multiply kernels) end to end on CPU, with the kernels in
the Triton interpreter: the engine's greedy tokens and prefill logits equal HF transformers'
in fp32 (1e-4), as on the unfused path. Real sizes on CUDA: ``tests/gpu/test_fused_gpu.py``.
"""

import os

os.environ["TRITON_INTERPRET"] = "1"  # before anything imports triton or the kernels

import pytest

pytest.importorskip("triton")

import torch

from latentserve.config import EngineConfig
from latentserve.engine.llm_engine import LLMEngine
from latentserve.testing.parity import hf_reference, run_batch, shared_prefix_prompts
from latentserve.testing.triton_interpreter import patch_triton_interpreter

patch_triton_interpreter()


@pytest.mark.parametrize("kind,backend", [("llama", "torch"), ("qwen2", "torch"),
                                          ("llama", "triton")])
def test_fused_engine_matches_hf_fp32(kind, backend, tiny_dirs, hf_models):
    """With ``triton`` attention the kernels read q/k/v as strided views of the merged
    projection output."""
    engine = LLMEngine(EngineConfig(model=str(tiny_dirs[kind]), fused_ops=True,
                                    attention_backend=backend))
    layer = engine.runner.model.model.layers[0]
    assert layer.self_attn.fused and layer.mlp.fused and layer.input_layernorm.fused
    assert not hasattr(layer.self_attn, "q_proj")  # merged, not kept twice
    prompts = shared_prefix_prompts()[0:5:2]  # 51, 30 (its prefix) and 3 tokens
    tokens, logits, _ = run_batch(engine, prompts, 5)
    hf = hf_models(tiny_dirs[kind])
    for i, p in enumerate(prompts):
        ref_tokens, ref_logits = hf_reference(hf, p, 5)
        assert tokens[i] == ref_tokens, f"prompt {i}"
        torch.testing.assert_close(logits[i], ref_logits, atol=1e-4, rtol=0)
    engine.cache.check_idle()


def test_fused_ops_default_only_on_cuda_triton():
    assert not EngineConfig(device="cpu").use_fused_ops
    assert not EngineConfig(device="cuda", attention_backend="torch").use_fused_ops
    assert EngineConfig(device="cuda").use_fused_ops
    assert not EngineConfig(device="cuda", fused_ops=False).use_fused_ops
