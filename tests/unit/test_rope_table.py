"""The fast path's RoPE cos/sin table (``layers.Rotary.build_table``): its rows equal the
direct computation, the engine builds it for ``max_model_len`` on the fast path only, and a
position past the table is clamped instead of faulting."""

import pytest
import torch
from transformers import LlamaConfig

from latentserve.models.layers import Rotary


def _rotary(**rope):
    cfg = LlamaConfig(hidden_size=64, num_attention_heads=2, max_position_embeddings=4096,
                      rope_parameters={"rope_type": "default", "rope_theta": 10000.0, **rope})
    return Rotary(cfg, 32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_table_rows_equal_direct_cos_sin(dtype):
    rot = _rotary()
    positions = torch.tensor([0, 1, 7, 300, 4095, 2])
    want = rot.cos_sin(positions, dtype)
    rot.build_table(4096, dtype)
    got = rot.cos_sin(positions, dtype)
    for g, w in zip(got, want):
        assert g.shape == w.shape == (6, 32) and g.dtype == dtype and g.stride(-1) == 1
        torch.testing.assert_close(g, w, rtol=0, atol=2e-7 if dtype == torch.float32 else 0)
    # another dtype than the table's computes directly
    assert rot.cos_sin(positions, torch.float16)[0].dtype == torch.float16
    # past the end: the last row, not a fault
    past = rot.cos_sin(torch.tensor([5000]), dtype)[0]
    assert torch.equal(past, rot.cos_sin(torch.tensor([4095]), dtype)[0])
    with pytest.raises(ValueError, match="max_positions"):
        rot.build_table(0, dtype)


def test_engine_builds_the_table_on_the_fast_path_only(tiny_dirs):
    from latentserve.config import EngineConfig
    from latentserve.engine.llm_engine import LLMEngine

    for fused in (False, True):
        engine = LLMEngine(EngineConfig(model=str(tiny_dirs["llama"]), fused_ops=fused,
                                        attention_backend="torch", max_model_len=96))
        table = engine.runner.model.model.rotary_emb._table
        if fused:
            assert table is not None and table.shape[:2] == (96, 2)
        else:
            assert table is None
