"""The mid-layer capture buffer (what compression heads read), KV pool sizing and the check
that the pool and page table fit the device."""

import pytest
import torch

from latentserve.config import EngineConfig
from latentserve.engine.kv_sizing import check_fits, kv_slots_for
from tests.support.parity import run_batch, shared_prefix_prompts


@pytest.mark.parametrize("kind,layer", [("llama", 1), ("gpt2", 1)])
def test_capture_returns_the_layer_hidden_of_each_sampling_row(kind, layer, tiny_dirs,
                                                               hf_models):
    from latentserve.engine.llm_engine import LLMEngine

    engine = LLMEngine(EngineConfig(model=str(tiny_dirs[kind])))
    engine.runner.capture_layer = layer
    seen = {}
    original = engine.runner.run

    def run(batch):
        out = original(batch)
        rows = [r for r, s in zip(batch.reqs, batch.sample) if s]
        for req, cap in zip(rows, engine.runner.last_captured):
            if not req.output_ids:
                seen[req.rid] = (list(req.prompt_ids), cap.clone())
        return out

    engine.runner.run = run
    run_batch(engine, shared_prefix_prompts()[:4], 2)
    hf = hf_models(tiny_dirs[kind])
    for prompt, cap in seen.values():
        with torch.no_grad():
            ref = hf(torch.tensor([prompt]), output_hidden_states=True).hidden_states[layer]
        torch.testing.assert_close(cap, ref[0, -1], atol=1e-4, rtol=0)
    assert len(seen) == 4


def test_kv_sizing_on_cuda_fails_with_the_flags_to_change(monkeypatch):
    gib = 1 << 30
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (2 * gib, 80 * gib))
    cfg = EngineConfig(device="cuda", max_model_len=4096)
    with pytest.raises(ValueError, match="--max-model-len or --max-num-seqs") as err:
        kv_slots_for(cfg, bytes_per_slot=1 << 20, max_model_len=4096, vocab_size=1000)
    assert "78.0 of 80.0 GiB of cuda are in use" in str(err.value)
    assert "--kv-slots" in str(err.value)


def test_kv_sizing_on_cuda_uses_the_memory_fraction(monkeypatch):
    gib = 1 << 30
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (70 * gib, 80 * gib))
    small = kv_slots_for(EngineConfig(device="cuda", gpu_memory_utilization=0.5), 1 << 16,
                         1024, 1000)
    large = kv_slots_for(EngineConfig(device="cuda", gpu_memory_utilization=0.9), 1 << 16,
                         1024, 1000)
    # 0.4 of 80 GiB more memory buys 0.4 * 80 GiB / 64 KiB more slots.
    assert large - small == pytest.approx(0.4 * 80 * gib / (1 << 16), abs=1)
    # the per-sequence vocabulary rows (logits, penalty counts) come off the pool: 256 more
    # sequences of a 100k vocabulary take 256 x 100k x 13 bytes
    few, many = (kv_slots_for(EngineConfig(device="cuda", max_num_seqs=n), 1 << 16, 1024,
                              100_000) for n in (256, 512))
    assert few - many == pytest.approx(256 * 100_000 * 13 / (1 << 16), abs=1)


def test_pool_and_page_table_that_do_not_fit_the_gpu_name_the_flags(monkeypatch):
    gib = 1 << 30
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (10 * gib, 80 * gib))
    check_fits(EngineConfig(device="cuda", max_num_seqs=256), 100_000, 1 << 16, 8192)
    with pytest.raises(ValueError, match="--kv-slots, --max-num-seqs or --max-model-len") as err:
        check_fits(EngineConfig(device="cuda", max_num_seqs=1 << 20), 100_000, 1 << 16, 8192)
    assert "page table (max_num_seqs=1048576 x max_model_len=8192 x 8 bytes = 64.0 GiB)" \
        in str(err.value) and "10.0 GiB free on cuda" in str(err.value)
    with pytest.raises(ValueError, match=r"KV pool \(200000 slots x 65536 bytes = 12.2 GiB\)"):
        check_fits(EngineConfig(device="cuda"), 200_000, 1 << 16, 8192)


@pytest.mark.parametrize("option", [{"max_num_seqs": 10**20}, {"kv_slots": 10**20}])
def test_engine_refuses_a_pool_or_page_table_larger_than_memory(tiny_dirs, option):
    """A huge --max-num-seqs or --kv-slots is a ValueError naming the flags, not a torch
    overflow or an allocation failure."""
    from latentserve.engine.llm_engine import LLMEngine

    with pytest.raises(ValueError, match="lower --kv-slots, --max-num-seqs or --max-model-len"):
        LLMEngine(EngineConfig(model=str(tiny_dirs["llama"]), **option))
