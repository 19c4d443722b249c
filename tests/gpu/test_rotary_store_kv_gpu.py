"""The fused RoPE + KV store kernels on the H200 at the Llama-3.2-1B attention shape (32 q
heads, 8 KV heads, head_dim 64; Huginn's pair convention at its own shape): q and every
written pool slot bitwise equal to the two kernels each replaces (``apply_rotary_`` or
``apply_rotary_pairs_``, then ``store_kv``), eagerly and replayed from a CUDA graph with new
inputs and slots. CPU/interpreter version: ``tests/unit/test_rotary_store_kv.py``.
Also ``qkv_rope_store_kv`` (the projection with RoPE and the store in its epilogue)
against the exact projection and eager RoPE (``tests/unit/test_qkv_rope.py`` on CPU).

Run with the other GPU tests (``bash scripts/gpu_tests.sh``), never in a process that
imported the kernels under ``TRITON_INTERPRET=1``.
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

HEADS, KV_HEADS, D = 32, 8, 64
NUM_SLOTS = 4096


def _inputs(t, dtype, seed):
    """Fused qkv output, cos/sin at random positions, and slots: distinct, except every
    fourth token on the dummy slot 0 (CUDA-graph padding rows)."""
    from latentserve.ops import rotary

    g = torch.Generator(device="cuda").manual_seed(seed)
    qkv = torch.randn(t, (HEADS + 2 * KV_HEADS) * D, generator=g, device="cuda").to(dtype)
    pos = torch.randint(0, 8192, (t,), generator=g, device="cuda")
    inv_freq = 1.0 / (500000.0 ** (torch.arange(0, D, 2, device="cuda").float() / D))
    cos, sin = rotary.rope_cos_sin(pos, inv_freq, 1.0, dtype)
    slots = torch.randperm(NUM_SLOTS, generator=g, device="cuda")[:t] + 1
    slots[1::4] = 0
    return qkv, cos, sin, slots


def _split(qkv):
    t, nq, nk = qkv.shape[0], HEADS * D, KV_HEADS * D
    return (qkv[:, :nq].view(t, HEADS, D), qkv[:, nq : nq + nk].view(t, KV_HEADS, D),
            qkv[:, nq + nk :].view(t, KV_HEADS, D))


def _pool(dtype):
    return [torch.randn(NUM_SLOTS + 1, KV_HEADS, D, device="cuda").to(dtype) for _ in range(2)]


def _two_kernels(qkv, cos, sin, slots, caches):
    from latentserve.attention.kernels import store_kv
    from latentserve.ops.kernels import apply_rotary_

    q, k, v = _split(qkv)
    apply_rotary_(q, k, cos, sin)
    store_kv(k, v, caches[0], caches[1], slots)


def _fused(qkv, cos, sin, slots, caches):
    from latentserve.ops.kernels import apply_rotary_store_kv_

    q, k, v = _split(qkv)
    apply_rotary_store_kv_(q, k, v, cos, sin, caches[0], caches[1], slots)


def _assert_same(ref_qkv, ref_caches, qkv, caches):
    assert torch.equal(_split(qkv)[0], _split(ref_qkv)[0])
    for a, b in zip(caches, ref_caches):
        assert a.dtype == b.dtype
        assert torch.equal(a[1:], b[1:])  # slot 0: several writers, which lands is unspecified


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("tokens", [1, 64, 300])
def test_fused_kernel_equals_rotary_then_store_kv_at_llama_1b_shape(dtype, tokens):
    pytest.importorskip("triton")
    qkv, cos, sin, slots = _inputs(tokens, dtype, seed=tokens)
    ref_qkv, ref_caches = qkv.clone(), _pool(dtype)
    caches = [c.clone() for c in ref_caches]
    _two_kernels(ref_qkv, cos, sin, slots, ref_caches)
    _fused(qkv, cos, sin, slots, caches)
    torch.cuda.synchronize()
    _assert_same(ref_qkv, ref_caches, qkv, caches)


def test_fused_kernel_with_a_float32_pool_from_bf16_activations():
    pytest.importorskip("triton")
    qkv, cos, sin, slots = _inputs(64, torch.bfloat16, seed=7)
    ref_qkv, ref_caches = qkv.clone(), _pool(torch.float32)
    caches = [c.clone() for c in ref_caches]
    _two_kernels(ref_qkv, cos, sin, slots, ref_caches)
    _fused(qkv, cos, sin, slots, caches)
    _assert_same(ref_qkv, ref_caches, qkv, caches)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_pairs_kernel_equals_rotary_pairs_then_store_kv_at_huginn_shape(dtype):
    """Huginn-3.5B's attention (55 heads, MHA, head_dim 96) with its qk_bias, 64 tokens."""
    pytest.importorskip("triton")
    from latentserve.attention.kernels import store_kv
    from latentserve.ops.kernels import apply_rotary_pairs_, apply_rotary_pairs_store_kv_

    h, d, t = 55, 96, 64
    g = torch.Generator(device="cuda").manual_seed(11)
    qkv = torch.randn(t, 3 * h * d, generator=g, device="cuda").to(dtype)
    bias = (0.5 * torch.randn(2, h, d, generator=g, device="cuda")).to(dtype)
    freqs = torch.randint(0, 8192, (t, 1), generator=g, device="cuda").float() * \
        torch.rand(d // 2, generator=g, device="cuda")
    cos, sin = freqs.cos(), freqs.sin()
    slots = torch.randperm(NUM_SLOTS, generator=g, device="cuda")[:t] + 1
    slots[1::4] = 0
    caches = [torch.randn(NUM_SLOTS + 1, h, d, generator=g, device="cuda").to(dtype)
              for _ in range(2)]
    ref_qkv, ref_caches = qkv.clone(), [c.clone() for c in caches]

    def views(x):
        return x[:, : h * d].view(t, h, d), x[:, h * d : 2 * h * d].view(t, h, d), \
            x[:, 2 * h * d :].view(t, h, d)

    q, k, v = views(ref_qkv)
    apply_rotary_pairs_(q, k, cos, sin, bias[0], bias[1])
    store_kv(k, v, ref_caches[0], ref_caches[1], slots)
    q, k, v = views(qkv)
    apply_rotary_pairs_store_kv_(q, k, v, cos, sin, caches[0], caches[1], slots, bias[0],
                                 bias[1])
    torch.cuda.synchronize()
    assert torch.equal(views(qkv)[0], views(ref_qkv)[0])
    for a, b in zip(caches, ref_caches):
        assert torch.equal(a[1:], b[1:])


def test_fused_kernel_replays_from_a_cuda_graph():
    """Captured on static buffers, replayed after new activations, positions and slots are
    copied in: the same bits as the eager two-kernel path on the new inputs."""
    pytest.importorskip("triton")
    dtype, t = torch.bfloat16, 64
    static = list(_inputs(t, dtype, seed=1))
    caches = _pool(dtype)
    _fused(*static, caches)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        _fused(*static, caches)
    qkv, cos, sin, slots = _inputs(t, dtype, seed=2)
    ref_qkv, ref_caches = qkv.clone(), [c.clone() for c in caches]
    _two_kernels(ref_qkv, cos, sin, slots, ref_caches)
    for dst, src in zip(static, (qkv, cos, sin, slots)):
        dst.copy_(src)
    graph.replay()
    torch.cuda.synchronize()
    _assert_same(ref_qkv, ref_caches, static[0], caches)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("tokens", [17, 64])
def test_qkv_rope_kernel_equals_projection_then_rotary(dtype, tokens):
    """``qkv_rope_store_kv`` (the projection with RoPE and the store in its epilogue; bf16
    reads its tiles through TMA on the H200) at the Llama-1B shape, hidden 2048, with
    entries in {-1, 0, 1}: every dot product is an exact integer whatever the summation
    order, so v lands in the pool bit for bit, and q and k equal the eager RoPE
    (``ops.rotary.apply_rotary``) on the exact projection within two ulps of its terms
    (|x cos| + |rot(x) sin|). Compiled RoPE kernels, the two-kernel path's included, flip
    a last-bit rounding of a product against eager torch on this GPU (fp32: 1e-5)."""
    pytest.importorskip("triton")
    import torch.nn.functional as F

    from latentserve.ops import rotary
    from latentserve.ops.kernels import qkv_rope_store_kv

    hidden = 2048
    g = torch.Generator(device="cuda").manual_seed(tokens)
    x = torch.randint(-1, 2, (tokens, hidden), generator=g, device="cuda").to(dtype)
    w = torch.randint(-1, 2, ((HEADS + 2 * KV_HEADS) * D, hidden), generator=g,
                      device="cuda").to(dtype)
    _, cos, sin, slots = _inputs(tokens, dtype, seed=tokens)
    q_raw, k_raw, v_raw = _split(F.linear(x.float(), w.float()).to(dtype))
    q_ref, k_ref = rotary.apply_rotary(q_raw, k_raw, cos, sin)
    caches = _pool(dtype)
    q = qkv_rope_store_kv(x, w, None, cos, sin, caches[0], caches[1], slots, HEADS, KV_HEADS)
    torch.cuda.synchronize()
    real = slots > 0
    assert torch.equal(caches[1][slots[real]], v_raw[real])
    c, sn = cos.float().abs()[:, None, :], sin.float().abs()[:, None, :]
    _rotary_close(q, q_ref, q_raw, c, sn)
    _rotary_close(caches[0][slots[real]], k_ref[real], k_raw[real], c[real], sn[real])


def _rotary_close(out, ref, raw, abs_cos, abs_sin):
    """fp32: within 1e-5; 16-bit: within two ulps of max(|ref|, |raw cos| + |rot(raw) sin|)."""
    if out.dtype == torch.float32:
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
        return
    from latentserve.ops import rotary

    scale = raw.float().abs() * abs_cos + rotary.rotate_half(raw.float()).abs() * abs_sin
    bound = 2 * torch.finfo(out.dtype).eps * torch.maximum(ref.float().abs(), scale)
    err = (out.float() - ref.float()).abs()
    assert bool((err <= bound.clamp_min(1e-3)).all()), f"max error {float(err.max())}"
