"""TritonBackend against TorchBackend on CPU, through the Triton interpreter.

Tiny sizes only: the interpreter runs each kernel program in numpy. The real-size comparison
on CUDA lives in ``tests/gpu/test_triton_gpu.py`` (run it in its own pytest process: the
interpreter is chosen when the kernels are first imported).
"""

import os

os.environ["TRITON_INTERPRET"] = "1"  # before anything imports triton or the kernels

import pytest

pytest.importorskip("triton")

import torch

from latentserve.attention.base import BatchLayout, make_backend
from latentserve.attention.torch_backend import TorchBackend
from latentserve.attention.triton_backend import TritonBackend, TritonMeta
from latentserve.kvcache.pool import KVPool, PageTable
from tests.support.triton_interpreter import patch_triton_interpreter

patch_triton_interpreter()

LAYER = 1  # of 2: checks that forward picks the right pool layer
ATOL = {torch.float32: 1e-4, torch.bfloat16: 2e-2}


def _scenario(seed, q_lens, kv_lens, n_kv, group, d, dtype, max_len=48):
    """A random batch over a random page table and pool: returns (layout, table, pool, q, k, v)."""
    g = torch.Generator().manual_seed(seed)
    b = len(q_lens)
    max_reqs = b + 3
    table = PageTable(max_reqs, max_len, "cpu")
    num_slots = sum(kv_lens) + 16
    # Stale entries everywhere, then each request's slots: distinct, shuffled, never slot 0.
    table.table.copy_(torch.randint(1, num_slots + 1, table.table.shape, generator=g))
    rows = torch.randperm(max_reqs, generator=g)[:b]
    perm = torch.randperm(num_slots, generator=g) + 1
    used = 0
    for r, n in zip(rows.tolist(), kv_lens):
        table.table[r, :n] = perm[used : used + n]
        used += n
    pool = KVPool(2, num_slots, n_kv, d, dtype, "cpu")
    for buf in pool.k + pool.v:  # cached prefixes (and garbage elsewhere)
        buf.copy_(torch.randn(buf.shape, generator=g).to(dtype))
    positions = torch.cat([torch.arange(kv - q, kv) for q, kv in zip(q_lens, kv_lens)])
    row_of_token = torch.repeat_interleave(rows, torch.tensor(q_lens))
    layout = BatchLayout(q_lens=list(q_lens), kv_lens=list(kv_lens), rows=rows,
                         out_slots=table.table[row_of_token, positions])
    t = sum(q_lens)
    q = torch.randn(t, n_kv * group, d, generator=g).to(dtype)
    k = torch.randn(t, n_kv, d, generator=g).to(dtype)
    v = torch.randn(t, n_kv, d, generator=g).to(dtype)
    return layout, table, pool, q, k, v


def _clone_pool(pool: KVPool) -> KVPool:
    twin = KVPool.__new__(KVPool)
    twin.num_slots = pool.num_slots
    twin.k = [x.clone() for x in pool.k]
    twin.v = [x.clone() for x in pool.v]
    return twin


def _compare(seed, q_lens, kv_lens, n_kv, group, d, dtype, backend=None, max_len=48):
    layout, table, pool, q, k, v = _scenario(seed, q_lens, kv_lens, n_kv, group, d, dtype,
                                             max_len)
    scale = d ** -0.5
    ref_pool, tri_pool = _clone_pool(pool), _clone_pool(pool)
    ref_be, tri_be = TorchBackend(), backend or TritonBackend()
    ref = ref_be.forward(LAYER, q, k, v, ref_be.prepare(layout, table.table), ref_pool, scale)
    meta = tri_be.prepare(layout, table.table)
    out = tri_be.forward(LAYER, q, k, v, meta, tri_pool, scale)
    assert out.shape == q.shape and out.dtype == q.dtype
    for a, b_ in zip(ref_pool.k + ref_pool.v, tri_pool.k + tri_pool.v):
        assert torch.equal(a, b_)  # the store is a plain copy
    torch.testing.assert_close(out.float(), ref.float(), atol=ATOL[dtype], rtol=0)
    return meta


CASES = {
    # name: (q_lens, kv_lens, n_kv, group, head_dim, dtype)
    "decode-gqa2-d64-fp32": ([1, 1, 1, 1], [7, 40, 1, 23], 2, 2, 64, torch.float32),
    "decode-mha-d96-bf16": ([1, 1, 1], [33, 2, 17], 4, 1, 96, torch.bfloat16),
    "mixed-mha-d96-fp32": ([1, 5, 1, 9], [12, 30, 1, 9], 2, 1, 96, torch.float32),
    "mixed-gqa2-d64-bf16": ([3, 1, 7], [20, 38, 7], 3, 2, 64, torch.bfloat16),
    "extend-gqa2-d64-fp32": ([4, 9, 6], [4, 25, 40], 4, 2, 64, torch.float32),
}


@pytest.mark.parametrize("name", list(CASES))
def test_matches_torch_backend(name):
    q_lens, kv_lens, n_kv, group, d, dtype = CASES[name]
    meta = _compare(list(CASES).index(name), q_lens, kv_lens, n_kv, group, d, dtype)
    assert meta.is_decode == all(n == 1 for n in q_lens)


@pytest.mark.parametrize("name", ["decode-gqa2-d64-fp32", "decode-mha-d96-bf16",
                                  "mixed-gqa2-d64-bf16"])
def test_one_split_writes_the_output_from_stage_one(name):
    """``num_kv_splits=1``: no merge kernel; the same outputs as the torch backend."""
    q_lens, kv_lens, n_kv, group, d, dtype = CASES[name]
    be = TritonBackend(num_kv_splits=1, decode_block_n=16)
    _compare(11, q_lens, kv_lens, n_kv, group, d, dtype, backend=be)


@pytest.mark.parametrize("d,tile", [(64, 128), (96, 64)])
def test_one_split_default_tile_matches_torch_backend(d, tile):
    """A batch that covers the SMs three times (here: 1 SM) takes one split and, at
    head_dim 64, the 128-key tile it picks by default; requests longer and shorter than a
    tile, the same outputs as the torch backend."""
    from unittest import mock

    from latentserve.attention import triton_backend

    be, seen, real = TritonBackend(num_sms=1), [], triton_backend.decode_attention

    def spy(*args, **kwargs):
        seen.append((kwargs["num_kv_splits"], kwargs["block_n"]))
        return real(*args, **kwargs)

    with mock.patch.object(triton_backend, "decode_attention", spy):
        _compare(13, [1, 1, 1], [300, 5, 129], 2, 2, d, torch.bfloat16, backend=be,
                 max_len=320)
    assert seen == [(1, tile)]


def test_split_count_reaches_the_backend():
    from latentserve.config import EngineConfig

    assert make_backend("triton", 2).num_kv_splits == 2
    with pytest.raises(ValueError, match="attention_num_kv_splits"):
        EngineConfig(attention_num_kv_splits=0)


def test_decode_splits_and_tile():
    """A decode batch whose (request, KV head) programs cover the SMs three times takes one
    split; a smaller one the fewest power-of-2 splits (at most ``num_kv_splits``) giving four
    programs per SM; the kernel launch gets it. One split at head_dim <= 64 walks 128-key
    tiles, anything else 64, unless ``decode_block_n`` is set."""
    from unittest import mock

    from latentserve.attention import triton_backend

    be = TritonBackend(num_kv_splits=8, num_sms=132)
    assert [be.decode_splits(b, 8) for b in (1, 16, 17, 32, 33, 49, 50, 64, 500)] == \
        [8, 8, 4, 4, 2, 2, 1, 1, 1]
    assert [be.decode_splits(b, 2) for b in (1, 33, 66, 67, 132, 197, 198)] == \
        [8, 8, 4, 4, 2, 2, 1]
    assert TritonBackend(num_kv_splits=2, num_sms=132).decode_splits(1, 1) == 2
    assert TritonBackend(num_kv_splits=1).decode_splits(1, 1) == 1
    assert TritonBackend(num_kv_splits=16, num_sms=16).decode_splits(3, 2) == 16
    assert TritonBackend().decode_splits(64, 8) == 1  # CPU tensors: an H200's 132 SMs
    assert [be.decode_tile(s, d) for s, d in ((1, 64), (1, 96), (2, 64), (8, 32))] == \
        [128, 64, 64, 64]
    assert TritonBackend(decode_block_n=32).decode_tile(1, 64) == 32
    be = TritonBackend(num_kv_splits=8, decode_block_n=16, num_sms=8)
    seen = []
    real = triton_backend.decode_attention

    def spy(*args, **kwargs):
        seen.append(kwargs["num_kv_splits"])
        return real(*args, **kwargs)

    with mock.patch.object(triton_backend, "decode_attention", spy):
        # 3 requests x 2 KV heads = 6 programs: 8 splits give four per SM of 8 SMs.
        _compare(4, [1, 1, 1], [40, 3, 17], 2, 2, 64, torch.float32, backend=be)
    assert seen == [8]


def test_small_tiles_many_splits_and_query_blocks():
    """16-wide tiles: decode spans several splits (and empty ones), extend several key tiles
    and, for the 20-token request, two query blocks."""
    be = TritonBackend(num_kv_splits=4, decode_block_n=16, extend_block_m=16, extend_block_n=16)
    _compare(5, [1, 1, 1], [40, 3, 17], 2, 2, 64, torch.float32, backend=be)
    _compare(6, [20, 1, 3], [36, 40, 3], 2, 1, 64, torch.float32, backend=be)


def test_prepare_metadata():
    layout, table, *_ = _scenario(0, [1, 4, 2], [5, 9, 2], 2, 1, 64, torch.float32)
    meta = TritonBackend().prepare(layout, table.table)
    assert isinstance(meta, TritonMeta)
    assert meta.q_start.tolist() == [0, 1, 5, 7] and meta.q_start.dtype == torch.int32
    assert meta.kv_lens.tolist() == [5, 9, 2] and meta.kv_lens.dtype == torch.int32
    assert meta.rows.dtype == torch.int64 and torch.equal(meta.rows, layout.rows)
    assert (meta.num_reqs, meta.max_q_len, meta.is_decode) == (3, 4, False)
    assert meta.page_table is table.table


def test_make_backend_triton():
    assert isinstance(make_backend("triton"), TritonBackend)
    with pytest.raises(ValueError):
        TritonBackend(decode_block_n=24)


def test_looped_block_passes_match_torch_backend(tmp_path, smollm2_dir):
    """Loop passes rewrite the block's slots in place (extend rows whose out slots already
    hold K/V): the Triton kernels give the torch backend's answers and logits."""
    from latentserve.config import EngineConfig
    from latentserve.engine.llm_engine import LLMEngine
    from tests.support.loop_models import save_loop_tiny
    from tests.support.parity import run_batch

    model_dir = save_loop_tiny(tmp_path, "lotus-llama", block_size=3, iterations=2)
    out = {}
    for name in ("torch", "triton"):
        engine = LLMEngine(EngineConfig(model=str(model_dir), device="cpu", dtype="float32",
                                        attention_backend=name))
        hiddens, run = [], engine.runner.run

        def recording_run(batch, run=run, hiddens=hiddens, engine=engine):
            result = run(batch)
            hiddens.append(engine.runner.last_hidden_all.clone())  # every position, every pass
            return result

        engine.runner.run = recording_run
        toks, _, _ = run_batch(engine, [[5, 6, 7, 8], [9, 10, 11]], 3)
        out[name] = (toks, hiddens)
        engine.cache.check_idle()
    assert out["triton"][0] == out["torch"][0]
    assert len(out["triton"][1]) == len(out["torch"][1])
    for a, b in zip(out["triton"][1], out["torch"][1]):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=0)


@pytest.mark.parametrize("splits", [1, 3])
def test_engine_with_split_count_matches_torch_backend(tiny_dirs, splits):
    """``EngineConfig.attention_num_kv_splits`` reaches the decode kernel: greedy tokens and
    first logits of a batch equal the torch backend's (1 split: no merge kernel)."""
    from latentserve.config import EngineConfig
    from latentserve.engine.llm_engine import LLMEngine
    from tests.support.parity import run_batch, shared_prefix_prompts

    prompts = shared_prefix_prompts()[:4]
    out = {}
    for name in ("torch", "triton"):
        engine = LLMEngine(EngineConfig(model=str(tiny_dirs["llama"]), attention_backend=name,
                                        attention_num_kv_splits=splits))
        if name == "triton":
            assert engine.runner.backend.num_kv_splits == splits
        out[name] = run_batch(engine, prompts, 6)[:2]
        engine.cache.check_idle()
    assert out["triton"][0] == out["torch"][0]
    for a, b in zip(out["triton"][1], out["torch"][1]):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=0)


def test_prefetches_reports_a_whole_weight_prefetch(monkeypatch):
    """``TritonBackend.prefetches``: true only for a one-split decode batch (an H200's 132
    SMs: 64 requests x 8 KV heads, not 16 x 8), with PDL, for a contiguous weight within
    decode attention's prefetch budget (8 MiB by default); the torch backend never
    prefetches."""
    from types import SimpleNamespace

    from latentserve.ops.kernels import pdl

    be = TritonBackend(num_sms=132)
    dec = SimpleNamespace(is_decode=True, num_reqs=64)
    ext = SimpleNamespace(is_decode=False, num_reqs=64)
    w = torch.empty(2048, 2048, dtype=torch.bfloat16)  # Llama-1B o_proj: 8 MiB
    assert not be.prefetches(dec, w, 8)  # CPU: no PDL
    monkeypatch.setattr(pdl, "pdl_enabled", lambda device: True)
    assert be.prefetches(dec, w, 8)
    assert not be.prefetches(SimpleNamespace(is_decode=True, num_reqs=16), w, 8)  # 8 splits
    assert not be.prefetches(ext, w, 8) and not be.prefetches(dec, None, 8)
    assert not be.prefetches(dec, torch.empty(4096, 2048, dtype=torch.bfloat16), 8)  # 16 MiB
    assert not be.prefetches(dec, w.t(), 8)
    monkeypatch.setenv("LATENTSERVE_ATTN_PREFETCH_MB", "0")
    assert not be.prefetches(dec, w, 8)
    assert not TorchBackend().prefetches(dec, w, 8)
