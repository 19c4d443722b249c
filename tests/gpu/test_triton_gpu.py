"""TritonBackend against TorchBackend on CUDA at serving sizes (H200).

Run in its own pytest process, without ``TRITON_INTERPRET``::

    pytest -m gpu tests/gpu/test_triton_gpu.py

The kernels are compiled or interpreted depending on ``TRITON_INTERPRET`` when they are first
imported, and ``tests/unit/test_triton_attention.py`` sets it at collection, so these tests
import the backend lazily and skip if the interpreter is on.
"""

import os

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1",
                       reason="kernels are interpreted in this process; run tests/gpu alone"),
]

ATOL = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 2e-2}


def _backends(**kw):
    pytest.importorskip("triton")
    from latentserve.attention.torch_backend import TorchBackend
    from latentserve.attention.triton_backend import TritonBackend

    return TorchBackend(), TritonBackend(**kw)


def _scenario(seed, q_lens, kv_lens, n_kv, group, d, dtype, dev="cuda"):
    """Random page table (shuffled slots, stale entries past kv_len), random pool, new q/k/v."""
    from latentserve.attention.base import BatchLayout
    from latentserve.kvcache.pool import KVPool, PageTable

    g = torch.Generator().manual_seed(seed)
    b, max_len = len(q_lens), max(kv_lens) + 8
    table = PageTable(b + 8, max_len, dev)
    num_slots = sum(kv_lens) + 64
    table.table.copy_(torch.randint(1, num_slots + 1, table.table.shape, generator=g))
    rows = torch.randperm(b + 8, generator=g)[:b]
    perm = torch.randperm(num_slots, generator=g) + 1
    used = 0
    for r, n in zip(rows.tolist(), kv_lens):
        table.table[r, :n] = perm[used : used + n].to(dev)
        used += n
    pool = KVPool(1, num_slots, n_kv, d, dtype, dev)
    for buf in pool.k + pool.v:
        buf.copy_(torch.randn(buf.shape, generator=g).to(dtype))
    positions = torch.cat([torch.arange(kv - q, kv) for q, kv in zip(q_lens, kv_lens)]).to(dev)
    rows = rows.to(dev)
    row_of_token = torch.repeat_interleave(rows, torch.tensor(q_lens, device=dev))
    layout = BatchLayout(q_lens=list(q_lens), kv_lens=list(kv_lens), rows=rows,
                         out_slots=table.table[row_of_token, positions])
    t = sum(q_lens)
    q = torch.randn(t, n_kv * group, d, generator=g).to(dev, dtype)
    k = torch.randn(t, n_kv, d, generator=g).to(dev, dtype)
    v = torch.randn(t, n_kv, d, generator=g).to(dev, dtype)
    return layout, table, pool, q, k, v


def _clone_pool(pool):
    from latentserve.kvcache.pool import KVPool

    twin = KVPool.__new__(KVPool)
    twin.num_slots = pool.num_slots
    twin.k = [x.clone() for x in pool.k]
    twin.v = [x.clone() for x in pool.v]
    return twin


def _compare(q_lens, kv_lens, n_kv, group, d, dtype, seed=0, **kw):
    layout, table, pool, q, k, v = _scenario(seed, q_lens, kv_lens, n_kv, group, d, dtype)
    ref_be, tri_be = _backends(**kw)
    ref_pool, tri_pool = _clone_pool(pool), _clone_pool(pool)
    scale = d ** -0.5
    ref = ref_be.forward(0, q, k, v, ref_be.prepare(layout, table.table), ref_pool, scale)
    out = tri_be.forward(0, q, k, v, tri_be.prepare(layout, table.table), tri_pool, scale)
    torch.cuda.synchronize()
    assert torch.equal(ref_pool.k[0], tri_pool.k[0]) and torch.equal(ref_pool.v[0], tri_pool.v[0])
    torch.testing.assert_close(out.float(), ref.float(), atol=ATOL[dtype], rtol=0)


def _kv_lens(seed, n, max_kv=1024):
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(1, max_kv + 1, (n,), generator=g).tolist()
    lens[:4] = [max_kv, max_kv, 1, 2]
    return lens


@pytest.mark.parametrize("d,n_kv,group", [(64, 4, 1), (64, 2, 4), (128, 8, 1), (128, 8, 4)])
def test_decode_bf16_64_requests_kv1024(d, n_kv, group):
    _compare([1] * 64, _kv_lens(d + group, 64), n_kv, group, d, torch.bfloat16)


@pytest.mark.parametrize("splits", [1, 2])
def test_decode_other_split_counts(splits):
    """``num_kv_splits`` 1 (stage 1 writes the output, no merge kernel, 128-key tiles) and
    2 (64-key tiles): 64 requests x 4 KV heads would take 4 splits uncapped."""
    _compare([1] * 64, _kv_lens(7, 64), 4, 2, 64, torch.bfloat16, num_kv_splits=splits)


def test_decode_one_split_default_tiles_at_batch_64():
    """The batch-64 Llama-1B decode configuration: 8 KV heads fill the SMs, one split with
    the default 128-key tiles."""
    from latentserve.attention.triton_backend import TritonBackend

    be = TritonBackend()
    assert be.decode_splits(64, 8, "cuda") == 1 and be.decode_tile(1, 64) == 128
    _compare([1] * 64, _kv_lens(8, 64), 8, 4, 64, torch.bfloat16)


@pytest.mark.parametrize("batch", [64, 4])
def test_decode_prefetch_hints_change_nothing(batch, monkeypatch):
    """With PDL, stage 1 reads the batch's metadata and prefetches its first K/V tile before
    the wait, and prefetches ``prefetch_next`` as it ends: outputs equal bit for bit with any
    hint (an 8 MiB weight, one of a few bytes, one of a line and a half, a tiny budget,
    none), short requests and
    empty splits included (batch 4 takes 8 splits; its keys: 700, 700, 1, 2)."""
    layout, table, pool, q, k, v = _scenario(3, [1] * batch, _kv_lens(3, batch, 700), 8, 4,
                                             64, torch.bfloat16)
    _, be = _backends()
    assert be.decode_splits(batch, 8, "cuda") == (1 if batch == 64 else 8)
    meta = be.prepare(layout, table.table)
    base = be.forward(0, q, k, v, meta, pool, 0.125)  # stores the new K/V
    w = torch.randn(2048, 2048, device="cuda").bfloat16()
    for hint, mb in ((w, "8"), (w[:1, :3].contiguous(), "8"), (w.reshape(-1)[:100], "8"),
                     (w, "0.001"), (None, "8")):
        monkeypatch.setenv("LATENTSERVE_ATTN_PREFETCH_MB", mb)
        out = be.forward(0, q, None, None, meta, pool, 0.125, prefetch_next=hint)
        torch.cuda.synchronize()
        assert torch.equal(out, base)


@pytest.mark.parametrize("d,n_kv,group", [(64, 4, 1), (128, 8, 4)])
def test_extend_mixed_bf16_64_requests_kv1024(d, n_kv, group):
    g = torch.Generator().manual_seed(d)
    kv_lens = _kv_lens(d + 1, 64)
    q_lens = [1 if i % 2 else int(torch.randint(1, kv + 1, (1,), generator=g).clamp(max=300))
              for i, kv in enumerate(kv_lens)]
    q_lens[0] = kv_lens[0]  # one full prefill of 1024 tokens
    _compare(q_lens, kv_lens, n_kv, group, d, torch.bfloat16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("d", [80, 96])
def test_dtypes_and_odd_head_dims(dtype, d):
    kv_lens = _kv_lens(d, 16, 300)
    _compare([1] * 16, kv_lens, 2, 3, d, dtype)
    _compare([1, 7, 1, 33] * 4, [max(kv, 33) for kv in kv_lens], 2, 3, d, dtype)


def test_decode_cuda_graph_replay():
    """Capture one decode forward with static metadata, refill the metadata in place (new
    lengths and slots), replay, and compare: forward has no host syncs or shape changes."""
    ref_be, tri_be = _backends()
    n_kv, group, d, dtype, b = 8, 4, 128, torch.bfloat16, 32
    kv_a, kv_b = _kv_lens(1, b), _kv_lens(2, b)
    lay_a, table, pool, q, k, v = _scenario(3, [1] * b, [max(x, y) for x, y in zip(kv_a, kv_b)],
                                            n_kv, group, d, dtype)
    rows = lay_a.rows
    static = tri_be.prepare(lay_a, table.table)
    static_q, static_k, static_v = q.clone(), k.clone(), v.clone()
    tri_pool = _clone_pool(pool)

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):  # warm-up compiles the kernels outside the capture
        tri_be.forward(0, static_q, static_k, static_v, static, tri_pool, d ** -0.5)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = tri_be.forward(0, static_q, static_k, static_v, static, tri_pool, d ** -0.5)

    from latentserve.attention.base import BatchLayout

    # New step: other lengths (so other slots), new q/k/v, written into the static tensors.
    lay_b = BatchLayout(q_lens=[1] * b, kv_lens=kv_b, rows=rows,
                        out_slots=table.table[rows, torch.tensor(kv_b, device="cuda") - 1])
    fresh = tri_be.prepare(lay_b, table.table)
    static.kv_lens.copy_(fresh.kv_lens)
    static.out_slots.copy_(fresh.out_slots)
    for dst in (static_q, static_k, static_v):
        dst.copy_(torch.randn_like(dst))
    ref_pool = _clone_pool(tri_pool)
    graph.replay()
    ref = ref_be.forward(0, static_q, static_k, static_v, ref_be.prepare(lay_b, table.table),
                         ref_pool, d ** -0.5)
    torch.cuda.synchronize()
    assert torch.equal(ref_pool.k[0], tri_pool.k[0])
    torch.testing.assert_close(static_out.float(), ref.float(), atol=2e-2, rtol=0)


def test_gumbel_kernel_draws_the_tempered_softmax():
    """The fused temperature sampler (``ops.kernels.gumbel``), compiled: 20,000 rows of one
    8-token distribution padded to 10,000 columns of -inf (three chunks, the last cut short),
    at temperature 0.7: the counts match
    ``softmax(logits / T)`` (chi-square, 7 degrees of freedom, under 24.3 = p 0.001); the
    same seed gives the same tokens."""
    pytest.importorskip("triton")
    from latentserve.ops.kernels.gumbel import gumbel_sample_rows

    base = torch.tensor([1.0, 0.5, 0.0, -0.5, 0.25, 0.75, -1.0, 1.5], device="cuda")
    x = torch.full((20000, 10000), float("-inf"), device="cuda")
    x[:, 9000:9008] = base
    tokens = gumbel_sample_rows(x, 0.7, seed=1234)
    assert torch.equal(tokens, gumbel_sample_rows(x, 0.7, seed=1234))
    counts = torch.bincount(tokens - 9000, minlength=8).double().cpu()
    assert counts.sum() == 20000  # nothing outside the eight
    expected = torch.softmax(base / 0.7, -1).double().cpu() * 20000
    assert float(((counts - expected) ** 2 / expected).sum()) < 24.3


@pytest.mark.parametrize("rows,vocab", [(64, 128256), (1, 49152), (16, 32000)])
def test_argmax_kernel_equals_torch_argmax(rows, vocab):
    """Greedy sampling's two-pass argmax (``ops.kernels.argmax``) against ``torch.argmax`` on
    fp32 logits of real vocabularies: random rows, a tie across chunks, a NaN row, an
    all -inf row."""
    pytest.importorskip("triton")
    from latentserve.ops.kernels.argmax import argmax_rows

    g = torch.Generator(device="cuda").manual_seed(rows)
    x = torch.randn(rows, vocab, generator=g, device="cuda")
    x[0, [vocab - 1, 17]] = 99.0
    if rows > 2:
        x[1, [5000, 9]] = float("nan")
        x[2] = float("-inf")
        x[-1] = -1.0
        x[-1, [vocab - 1, 4100, 9000]] = torch.tensor([0.0, -0.0, 0.0], device="cuda")
    assert torch.equal(argmax_rows(x), x.argmax(dim=-1))
    assert torch.equal(argmax_rows(x.bfloat16()), x.bfloat16().argmax(dim=-1))
    # a token mask (greedy rows under a grammar): the argmax of the masked copy
    from latentserve.sampling import TokenMask, apply_token_mask

    bits = torch.randint(-2**31, 2**31 - 1, (rows, (vocab + 31) // 32), generator=g,
                         device="cuda", dtype=torch.int64).to(torch.int32)
    bits[0] = 0
    want = apply_token_mask(x, TokenMask(list(range(rows)), bits)).argmax(dim=-1)
    assert torch.equal(argmax_rows(x, bits=bits), want)


@pytest.mark.parametrize("rows,vocab", [(64, 128256), (16, 49152)])
def test_lm_head_argmax_equals_torch_argmax(rows, vocab):
    """The LM head with the argmax's first pass in its epilogue (``decode_linear_argmax``,
    PDL and TMA on): logits equal to ``decode_linear``'s bit for bit, ids to their
    ``torch.argmax``; a NaN and a tie across tiles in the weight, bf16."""
    pytest.importorskip("triton")
    from latentserve.ops.kernels.decode_linear import decode_linear, decode_linear_argmax

    g = torch.Generator(device="cuda").manual_seed(rows)
    x = torch.randn(rows, 2048, generator=g, device="cuda").bfloat16()
    w = (torch.randn(vocab, 2048, generator=g, device="cuda") / 45).bfloat16()
    w[vocab - 3] = w[70]  # equal logits in two tiles: the first wins
    w[vocab - 3, 0] = w[70, 0] = 4.0
    x[0, 0] = 50.0
    y, ids = decode_linear_argmax(x, w, out_dtype=torch.float32)
    assert torch.equal(y, decode_linear(x, w, out_dtype=torch.float32))
    assert torch.equal(ids, y.argmax(dim=-1)) and int(ids[0]) == 70
    w[9000, 1] = float("nan")
    y, ids = decode_linear_argmax(x, w, out_dtype=torch.float32)
    assert torch.equal(ids, y.argmax(dim=-1)) and ids.eq(9000).all()


def test_rope_rows_kernel_equals_indexing():
    """``Rotary.cos_sin``'s CUDA gather (``ops.kernels.rope_rows``): the table's rows bit for
    bit, positions past either end clamped."""
    pytest.importorskip("triton")
    from latentserve.ops.kernels.rope_rows import rope_rows

    table = torch.randn(600, 2, 64, device="cuda").bfloat16()
    pos = torch.randint(0, 600, (64,), device="cuda")
    pos[:2] = torch.tensor([700, -1])
    assert torch.equal(rope_rows(table, pos), table[pos.clamp(0, 599)])
