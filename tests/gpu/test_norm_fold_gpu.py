"""RMSNorm folded into the decode GEMMs (``ops.kernels.norm_fold``) on the H200, at the
Llama-3.2-1B shapes of a decode step (17 and 64 rows):

* ``decode_linear_add`` (o_proj, down): the new residual stream bit for bit as the GEMM's
  partial sums + the RMSNorm kernel give it, stats within fp32 summation noise; replayed 50
  times in one CUDA graph, every replay gives the eager result bit for bit (the tile
  counters reset themselves; the split order is fixed).
* The consumers (gate/up with SiLU-mul, q/k/v with RoPE and the KV store, the LM head)
  against the same kernels on the RMSNorm kernel's output: within two bf16 ulps of the
  larger of the value and the tensor's rms (a stats sum in another order can move a normed
  element by one ulp).

The engines with the fold on: ``test_fused_gpu.py`` (fused against unfused, bf16 bound).
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

HIDDEN, INTER, HEADS, KV, HEAD_DIM, EPS = 2048, 8192, 32, 8, 64, 1e-5


def _close(out, ref, ulps=2):
    """Within ``ulps`` bf16 ulps of ``max(|ref|, rms(ref))``: a normed input element one ulp
    off moves a dot product by a term's ulp, not by one of a result that cancelled small."""
    mag = ref.float().abs()
    bound = ulps * torch.finfo(out.dtype).eps * mag.clamp_min(float(mag.pow(2).mean().sqrt()))
    err = (out.float() - ref.float()).abs()
    assert bool((err <= bound).all()), f"max error {float(err.max())}"


@pytest.mark.parametrize("rows", [17, 64])
@pytest.mark.parametrize("k", [HIDDEN, INTER])  # o_proj, down
def test_producer_bitwise_and_graph_replays_stable(rows, k):
    from latentserve.ops.kernels import decode_linear, decode_linear_add, rms_norm
    from latentserve.ops.kernels.norm_fold import tile_counters

    g = torch.Generator(device="cuda").manual_seed(rows + k)
    x = torch.randn(rows, k, device="cuda", generator=g).bfloat16()
    w = (torch.randn(HIDDEN, k, device="cuda", generator=g) / k**0.5).bfloat16()
    r = torch.randn(rows, HIDDEN, device="cuda", generator=g).bfloat16()
    h, stats = decode_linear_add(x, w, r)
    _, h_ref = rms_norm(decode_linear(x, w, partials=True), torch.ones_like(r[0]), EPS, r)
    assert torch.equal(h, h_ref)
    tiles = stats.shape[0]
    torch.testing.assert_close(stats, h.float().view(rows, tiles, -1).pow(2).sum(-1).T,
                               rtol=1e-5, atol=1e-5)
    torch.cuda.synchronize()
    assert not tile_counters(x.device).any()
    graph, outs = torch.cuda.CUDAGraph(), []
    with torch.cuda.graph(graph):
        h_g, stats_g = decode_linear_add(x, w, r)
    for _ in range(50):
        graph.replay()
        outs.append((h_g.clone(), stats_g.clone()))
    torch.cuda.synchronize()
    assert all(torch.equal(a, h) and torch.equal(b, stats) for a, b in outs)
    assert not tile_counters(x.device).any()


def _stream(rows):
    from latentserve.ops.kernels import decode_linear_add

    g = torch.Generator(device="cuda").manual_seed(rows)
    x = torch.randn(rows, INTER, device="cuda", generator=g).bfloat16()
    w = (torch.randn(HIDDEN, INTER, device="cuda", generator=g) / INTER**0.5).bfloat16()
    r = torch.randn(rows, HIDDEN, device="cuda", generator=g).bfloat16()
    gw = (1 + 0.1 * torch.randn(HIDDEN, device="cuda", generator=g)).bfloat16()
    return (*decode_linear_add(x, w, r), gw, g)


@pytest.mark.parametrize("rows", [17, 64])
def test_consumers_within_two_ulps_of_the_norm_kernel(rows):
    from latentserve.ops.kernels import decode_linear, qkv_rope_store_kv, rms_norm
    from latentserve.ops.kernels.norm_fold import NormIn
    from latentserve.ops.rotary import rope_cos_sin

    h, stats, gw, g = _stream(rows)
    norm, normed = NormIn(stats, gw, EPS), rms_norm(h, gw, EPS)
    w_gu = (torch.randn(2 * INTER, HIDDEN, device="cuda", generator=g) / 45).bfloat16()
    _close(decode_linear(h, w_gu, swiglu=True, norm=norm),
           decode_linear(normed, w_gu, swiglu=True))
    w_lm = (torch.randn(4096, HIDDEN, device="cuda", generator=g) / 45).bfloat16()
    _close(decode_linear(h, w_lm, norm=norm, out_dtype=torch.float32).bfloat16(),
           decode_linear(normed, w_lm, out_dtype=torch.float32).bfloat16())
    w_qkv = (torch.randn((HEADS + 2 * KV) * HEAD_DIM, HIDDEN, device="cuda", generator=g)
             / 45).bfloat16()
    inv = 1.0 / (500000.0 ** (torch.arange(0, HEAD_DIM, 2, device="cuda").float() / HEAD_DIM))
    cos, sin = rope_cos_sin(torch.arange(rows, device="cuda") * 5, inv, 1.0, torch.bfloat16)
    slots = torch.randperm(128, device="cuda", generator=g)[:rows]
    out = []
    for x, nrm in ((normed, None), (h, norm)):
        kc, vc = torch.zeros(2, 129, KV, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
        q = qkv_rope_store_kv(x, w_qkv, None, cos, sin, kc, vc, slots, HEADS, KV, norm=nrm)
        out.append((q, kc[slots], vc[slots]))
    for a, b in zip(out[1], out[0]):
        _close(a, b)
