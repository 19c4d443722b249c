"""RMSNorm folded into the decode GEMMs (``ops.kernels.norm_fold``) on CPU through the Triton
interpreter: the producer (``decode_linear_add``: serial split-K with tile counters, the
residual add, the per-tile sums of squares) against the GEMM's partial sums + the RMSNorm
kernel, and the consumers (``decode_linear(norm=)``, ``qkv_rope_store_kv(norm=)``)
against the same GEMMs on a normed input. With small-integer inputs every sum of squares is
exact in any order, so the folded path must match bit for bit; the engine end to end with
the fold on and off must agree within the one-ulp difference a reordered sum can make."""

import os

os.environ["TRITON_INTERPRET"] = "1"  # before anything imports triton or the kernels

import pytest

pytest.importorskip("triton")

import torch

from latentserve.ops import rotary
from latentserve.ops.kernels.decode_linear import decode_linear, decode_linear_add
from latentserve.ops.kernels.norm_fold import NormIn, tile_counters
from latentserve.ops.kernels.qkv_rope import qkv_rope_store_kv
from latentserve.ops.kernels.rms_norm import rms_norm
from latentserve.testing.triton_interpreter import patch_triton_interpreter

patch_triton_interpreter()

EPS = 1e-5


def _ints(g, *shape, lo=-1, hi=2):
    return torch.randint(lo, hi, shape, generator=g).float()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m,k,split_k", [(5, 256, 1), (5, 256, 4), (70, 512, 2)])
def test_producer_equals_partials_then_norm_kernel(dtype, m, k, split_k):
    """h bit for bit as the RMSNorm kernel's residual output from the partial sums; the
    stats are the per-tile sums of squares of h; two row tiles (m = 70) count apart;
    the counters are left at zero, so a second call gives the same result."""
    g = torch.Generator().manual_seed(m + k)
    n = 96
    x = torch.randn(m, k, generator=g).to(dtype)
    w = (torch.randn(n, k, generator=g) / k**0.5).to(dtype)
    r = torch.randn(m, n, generator=g).to(dtype)
    h, stats = decode_linear_add(x, w, r, split_k=split_k, block_n=32)
    parts = decode_linear(x, w, partials=True, split_k=split_k, block_n=32)
    _, h_ref = rms_norm(parts, torch.ones(n, dtype=dtype), EPS, r)
    assert torch.equal(h, h_ref)
    assert stats.shape == (3, m) and stats.dtype == torch.float32
    tiles = h.float().view(m, 3, 32).pow(2).sum(-1).T
    torch.testing.assert_close(stats, tiles, rtol=1e-6, atol=1e-6)
    assert not tile_counters("cpu").any()
    h2, stats2 = decode_linear_add(x, w, r, split_k=split_k, block_n=32)
    assert torch.equal(h2, h) and torch.equal(stats2, stats)


def _integer_stream(dtype, m, hidden, seed):
    """A residual stream of small integers out of ``decode_linear_add`` (exact sums of
    squares), its stats, and a random norm weight."""
    g = torch.Generator().manual_seed(seed)
    x, w = _ints(g, m, 64).to(dtype), _ints(g, hidden, 64).to(dtype)
    h, stats = decode_linear_add(x, w, _ints(g, m, hidden, lo=-3, hi=4).to(dtype),
                                 split_k=2, block_n=32)
    return h, stats, torch.randn(hidden, generator=g).to(dtype)


@pytest.mark.parametrize("dtype,swiglu,tma", [
    (torch.float32, False, False), (torch.float32, True, False),
    (torch.bfloat16, False, False), (torch.bfloat16, True, False),
    (torch.bfloat16, False, True), (torch.bfloat16, True, True)])  # TMA: 16-bit tiles
def test_consumer_gemm_equals_gemm_of_normed_rows(dtype, swiglu, tma):
    h, stats, gw = _integer_stream(dtype, 19, 128, seed=1)
    w = (torch.randn(64, 128, generator=torch.Generator().manual_seed(2)) / 11).to(dtype)
    normed = rms_norm(h, gw, EPS)
    y = decode_linear(h, w, swiglu=swiglu, norm=NormIn(stats, gw, EPS), tma=tma)
    assert torch.equal(y, decode_linear(normed, w, swiglu=swiglu, tma=tma))


@pytest.mark.parametrize("tma", [False, True])
def test_qkv_rope_consumer_equals_normed_input(tma):
    dtype, t, heads, kv, d = torch.bfloat16, 19, 4, 2, 32
    h, stats, gw = _integer_stream(dtype, t, 128, seed=3)
    g = torch.Generator().manual_seed(4)
    w = (torch.randn((heads + 2 * kv) * d, 128, generator=g) / 11).to(dtype)
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, d, 2).float() / d))
    cos, sin = rotary.rope_cos_sin(torch.arange(t) * 7, inv_freq, 1.0, dtype)
    slots = torch.randperm(24, generator=g)[:t]
    out = []
    for x, norm in ((rms_norm(h, gw, EPS), None), (h, NormIn(stats, gw, EPS))):
        kc, vc = torch.zeros(2, 25, kv, d, dtype=dtype)
        q = qkv_rope_store_kv(x, w, None, cos, sin, kc, vc, slots, heads, kv, norm=norm,
                              block_m=16, block_k=32, tma=tma)
        out.append((q, kc, vc))
    for a, b in zip(*out):
        assert torch.equal(a, b)


def test_random_stream_within_one_ulp_of_the_norm_kernel():
    """Random values: the stats' summation order can move rstd by an fp32 ulp, so a normed
    element by at most one bf16 ulp; the GEMM outputs stay within bf16 noise."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(33, 512, generator=g).bfloat16()
    w = (torch.randn(256, 512, generator=g) / 22).bfloat16()
    r = torch.randn(33, 256, generator=g).bfloat16()
    h, stats = decode_linear_add(x, w, r)
    gw = torch.randn(256, generator=g).bfloat16()
    w2 = (torch.randn(128, 256, generator=g) / 16).bfloat16()
    y = decode_linear(h, w2, norm=NormIn(stats, gw, EPS)).float()
    y_ref = decode_linear(rms_norm(h, gw, EPS), w2).float()
    torch.testing.assert_close(y, y_ref, rtol=2e-2, atol=2e-2)


def test_bad_arguments_name_the_field():
    x = torch.randn(4, 64)
    w = torch.randn(32, 64)
    with pytest.raises(ValueError, match="residual must be"):
        decode_linear_add(x, w, torch.randn(4, 31))
    with pytest.raises(ValueError, match="residual must be"):
        decode_linear_add(x, w, torch.randn(4, 32).bfloat16())
    good = NormIn(torch.zeros(2, 4), torch.ones(64), EPS)
    for bad, field in ((good._replace(stats=torch.zeros(2, 5)), "norm.stats"),
                       (good._replace(stats=torch.zeros(2, 4).double()), "norm.stats"),
                       (good._replace(weight=torch.ones(63)), "norm.weight"),
                       (good._replace(weight=torch.ones(64).bfloat16()), "norm.weight"),
                       (good._replace(eps=-1.0), "norm.eps")):
        with pytest.raises(ValueError, match=field):
            decode_linear(x, w, norm=bad)


def _engine_outputs(path, monkeypatch, fold, reqs, **cfg):
    from latentserve.config import EngineConfig
    from latentserve.engine.llm_engine import LLMEngine
    from latentserve.models import layers
    from latentserve.ops import kernels
    from latentserve.testing.tp_parity import run_requests

    monkeypatch.setattr(layers, "FOLD_NORMS", fold)
    calls, real = [], kernels.decode_linear_add
    monkeypatch.setattr(kernels, "decode_linear_add",
                        lambda *a, **k: calls.append(1) or real(*a, **k))
    engine = LLMEngine(EngineConfig(model=str(path), fused_ops=True, dtype="bfloat16",
                                    attention_backend="triton", **cfg))
    out = run_requests(engine, reqs)
    assert bool(calls) == fold
    engine.cache.check_idle()
    return out


@pytest.fixture
def fold_settings(monkeypatch):
    from latentserve.models import layers

    monkeypatch.setattr(layers, "QKV_ROPE_ROWS", (1, 64))  # tiny batches here
    monkeypatch.setenv("LATENTSERVE_DECODE_TMA", "1")  # as on Hopper (interpreted here)


def test_engine_with_folded_norms_matches_the_norm_kernels(tiny_dirs, monkeypatch,
                                                          fold_settings):
    """Prefill, extend over a cached prefix and decode (bf16, q/k/v with bias): equal greedy
    tokens and every step's logits within bf16 noise of the RMSNorm-kernel path."""
    from latentserve.sampling_params import SamplingParams
    from latentserve.testing.parity import shared_prefix_prompts
    from latentserve.testing.tp_parity import assert_same

    sp = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    reqs = [(p, sp) for p in shared_prefix_prompts()[0:5:2]]
    out = {fold: _engine_outputs(tiny_dirs["qwen2"], monkeypatch, fold, reqs)
           for fold in (False, True)}
    assert_same(out[False], out[True], atol=0.05)


def test_compression_head_reads_the_same_mid_layer_state(tmp_path, monkeypatch,
                                                         fold_settings):
    """A compression head reads the residual stream after layer 1 (``capture_layer``):
    with the fold it comes from ``decode_linear_add``'s h. Latent steps, stop step and
    tokens equal the RMSNorm-kernel path's."""
    from latentserve.sampling_params import SamplingParams
    from latentserve.testing.head_models import save_head_model

    d = save_head_model(tmp_path / "cl", injection="closed_loop", source_layer=1,
                        stop_bias=0.3)
    sp = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, min_output_tokens=0)
    reqs = [([5, 9, 14, 3, 7], sp), ([11, 2, 8], sp)]
    out = {fold: _engine_outputs(d, monkeypatch, fold, reqs) for fold in (False, True)}
    for a, b in zip(out[False], out[True]):
        assert a[0] == b[0]  # tokens
        sa, sb = a[2].latent_stats, b[2].latent_stats
        assert sa["steps"] > 0 and (sa["steps"], sa["stop_step"]) == (sb["steps"],
                                                                        sb["stop_step"])
        for x, y in zip(a[1], b[1]):
            torch.testing.assert_close(y, x, atol=0.05, rtol=0)
