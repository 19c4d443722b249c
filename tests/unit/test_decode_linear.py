"""``ops.kernels.decode_linear`` (the decode-sized weight GEMMs: split-K, partial sums for
the next RMSNorm, the SiLU-mul epilogue, fp32 logits) and the RMSNorm kernel reducing those
partial sums, on CPU through the Triton interpreter; then the Llama fast path with and
without them. H200 runs: ``tests/gpu`` (the fast-path parity tests take this path for every
decode step of up to ``layers.DECODE_ROWS`` rows)."""

import os

os.environ["TRITON_INTERPRET"] = "1"  # before anything imports triton or the kernels

import pytest

pytest.importorskip("triton")

import torch
import torch.nn.functional as F

from latentserve.ops.kernels import decode_linear, rms_norm, silu_and_mul
from latentserve.ops.kernels.decode_linear import pick_tiling
from latentserve.ops.kernels.pdl import pdl_launch, prefetch_budget, prefetch_lines, share_args
from latentserve.ops.norm import add_rms_norm
from tests.support.triton_interpreter import patch_triton_interpreter

patch_triton_interpreter()


def _data(m, n, k, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).to(dtype)
    w = (torch.randn(n, k, generator=g) / k**0.5).to(dtype)
    b = torch.randn(n, generator=g).to(dtype)
    return x, w, b


@pytest.mark.parametrize("m,n,k", [(1, 48, 64), (5, 40, 200), (64, 96, 256), (70, 32, 96)])
@pytest.mark.parametrize("split_k", [1, 2, 4])
def test_matches_torch_fp32(m, n, k, split_k):
    """Odd M, N and K (masked tiles), M past one 64-row tile, K splits that do not divide K,
    with a bias; the partial sums add up to the product."""
    x, w, b = _data(m, n, k, seed=m + n + k)
    y = decode_linear(x, w, b, block_n=16, block_k=32, split_k=split_k)
    torch.testing.assert_close(y, F.linear(x, w, b), rtol=1e-5, atol=1e-5)
    parts = decode_linear(x, w, block_n=16, block_k=32, split_k=split_k, partials=True)
    assert parts.dtype == torch.float32 and parts.shape[1:] == (m, n)
    assert parts.shape[0] == min(split_k, -(-k // 32))  # never an empty split
    torch.testing.assert_close(parts.sum(0), F.linear(x, w), rtol=1e-5, atol=1e-5)


def test_bf16_rounds_once_and_fp32_logits_hold_bf16_values():
    """bf16: within one bf16 rounding of the fp32 product. ``out_dtype=float32`` (the LM
    head) gives fp32 values that are bf16 numbers, as ``linear(x).float()`` does."""
    x, w, _ = _data(17, 64, 512, torch.bfloat16)
    exact = F.linear(x.float(), w.float())
    for sk in (1, 4):
        y = decode_linear(x, w, block_n=32, block_k=64, split_k=sk)
        assert y.dtype == torch.bfloat16
        torch.testing.assert_close(y.float(), exact, rtol=1e-2, atol=1e-2)
        logits = decode_linear(x, w, out_dtype=torch.float32, block_n=32, block_k=64,
                               split_k=sk)
        assert logits.dtype == torch.float32
        assert torch.equal(logits, logits.to(torch.bfloat16).float())
        torch.testing.assert_close(logits, y.float(), rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
def test_swiglu_epilogue_equals_silu_and_mul(dtype, bias):
    """``swiglu`` on a merged gate/up weight equals the gate/up GEMM followed by the
    SiLU-mul kernel (bitwise in bf16: the same roundings in the same places)."""
    x, w, b = _data(9, 2 * 40, 96, dtype, seed=5)
    y = decode_linear(x, w, b if bias else None, swiglu=True, block_n=16, block_k=32)
    ref = silu_and_mul(F.linear(x, w, b if bias else None))
    assert y.shape == (9, 40) and y.dtype == dtype
    if dtype == torch.bfloat16:
        assert torch.equal(y, ref)
    else:
        torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("split_k", [1, 3])
@pytest.mark.parametrize("bias", [False, True])
def test_silu_epilogue_fp32(split_k, bias):
    """``silu``: ``silu(x @ w.T + b)`` in fp32, in the GEMM's epilogue (one split) or the
    split-K reduction (three splits); refused with ``partials`` or ``swiglu``."""
    x, w, b = _data(70, 33, 200, seed=11)
    b = b if bias else None
    y = decode_linear(x, w, b, silu=True, block_n=16, block_k=32, split_k=split_k)
    torch.testing.assert_close(y, F.silu(F.linear(x, w, b)), rtol=1e-5, atol=1e-6)
    for bad in ({"partials": True}, {"swiglu": True}):
        with pytest.raises(ValueError, match="cannot be combined"):
            decode_linear(x, torch.cat([w, w]), silu=True, **bad)


def test_empty_rows_and_strided_rows():
    x, w, b = _data(6, 24, 64)
    assert decode_linear(x[:0], w, b).shape == (0, 24)
    wide = torch.randn(6, 100)
    wide[:, 10:74] = x  # rows of stride 100, last dim contiguous
    torch.testing.assert_close(decode_linear(wide[:, 10:74], w, b), F.linear(x, w, b),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("call,match", [
    (lambda x, w, b: decode_linear(x[:, :60], w, b), "share K"),
    (lambda x, w, b: decode_linear(x, w[:23], None, swiglu=True), "gate/up"),
    (lambda x, w, b: decode_linear(x, w, None, swiglu=True, partials=True), "combined"),
    (lambda x, w, b: decode_linear(x, w, b[:5]), "bias"),
    (lambda x, w, b: decode_linear(x, w, b, block_n=24), "tiling"),
    (lambda x, w, b: decode_linear(x, w, b, swiglu=True, split_k=2), "split"),
    (lambda x, w, b: decode_linear(x.t(), w[:, :6], b), "contiguous"),
    (lambda x, w, b: decode_linear(x.double(), w, b), "dtype"),
])
def test_bad_arguments_name_the_problem(call, match):
    x, w, b = _data(6, 24, 64)
    with pytest.raises(ValueError, match=match):
        call(x, w, b)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_reduces_partials(dtype):
    """The RMSNorm kernel given ``[S, T, H]`` partials equals the eager add + RMSNorm of
    their sum rounded to the activation dtype (the GEMM output it replaces)."""
    g = torch.Generator().manual_seed(1)
    parts = torch.randn(3, 5, 64, generator=g)
    res = torch.randn(5, 64, generator=g).to(dtype)
    w = torch.randn(64, generator=g).to(dtype)
    normed, new_res = rms_norm(parts, w, 1e-5, res)
    ref_normed, ref_res = add_rms_norm(parts.sum(0).to(dtype), res, w, 1e-5)
    assert normed.dtype == new_res.dtype == dtype
    torch.testing.assert_close(new_res, ref_res, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(normed, ref_normed, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="partials"):
        rms_norm(parts, w, 1e-5)  # partials need the residual


def test_tiling_heuristic_and_pdl_off_on_cpu(monkeypatch):
    """The tilings the H200 sweep chose for the Llama-1B decode shapes at 64 rows
    (docs/benchmarks-history.md); PDL is never requested off CUDA or with LATENTSERVE_PDL=0."""
    assert pick_tiling(64, 3072, 2048) == (64, 128, 2)     # q/k/v
    assert pick_tiling(64, 2048, 2048) == (64, 128, 4)     # o_proj
    assert pick_tiling(64, 16384, 2048) == (128, 128, 1)   # gate/up
    assert pick_tiling(64, 2048, 8192) == (64, 128, 4)     # down
    assert pick_tiling(64, 128256, 2048) == (128, 128, 1)  # LM head
    # a weight already in L2 (o_proj after decode attention prefetched it): half the target
    assert pick_tiling(64, 2048, 2048, in_l2=True) == (64, 128, 2)
    assert pick_tiling(64, 16384, 2048, in_l2=True) == (128, 128, 1)
    assert pdl_launch(torch.device("cpu")) == {"PDL": False}
    monkeypatch.setenv("LATENTSERVE_PDL", "0")
    assert pdl_launch(torch.device("cuda", 0)) == {"PDL": False}


def test_prefetch_share_per_weight_row(monkeypatch):
    """The q/k/v kernel's L2 prefetch per program: its share of the budget over its weight
    rows, in whole 128-byte lines rounded down to a power of 2, at most its K span (rounded
    up), and none when that is less than a line."""
    mib = 1 << 20
    # Llama-1B q/k/v at 64 rows, bf16 (64 elements a line): 48 programs x 64 weight rows
    assert prefetch_lines(3 * mib, 64, 48, 64, 2048) == 512     # the default: a quarter
    assert prefetch_lines(16 * mib, 64, 48, 64, 2048) == 2048   # the whole rows
    assert prefetch_lines(16 * mib, 64, 48, 64, 600) == 1024    # K span rounded up
    assert prefetch_lines(16 * mib, 64, 1 << 20, 64, 2048) == 0  # less than a line
    assert prefetch_lines(16 * mib, 64, 48, 64, 32) == 0        # rows shorter than a line
    assert prefetch_lines(0, 64, 48, 64, 2048) == 0
    assert prefetch_lines(3 * mib, 64, 48, 32, 2048) == 256     # fp32: 32 a line
    monkeypatch.delenv("LATENTSERVE_DECODE_PREFETCH_MB", raising=False)
    assert prefetch_budget() == 3 * mib
    monkeypatch.setenv("LATENTSERVE_DECODE_PREFETCH_MB", "0")
    assert prefetch_budget() == 0


def test_share_args_split_a_buffer_over_programs(monkeypatch):
    """``share_args``: power-of-2 shares of whole 128-byte lines that cover the budget (or the
    whole buffer when smaller) across the programs; off for no buffer, no budget, a buffer
    under one line or a non-contiguous one (the stand-in then fills the pointer)."""
    from latentserve.attention.kernels.decode_attention import prefetch_budget as attn_budget

    mib, stand_in = 1 << 20, torch.empty(1)
    w = torch.empty(2048, 2048, dtype=torch.bfloat16)  # Llama-1B o_proj: 65536 lines
    nxt, last, lines, line = share_args(w, 8 * mib, 512, stand_in)
    assert nxt is w and (last, lines, line) == (65535, 128, 64) and lines * 512 > last
    assert share_args(w, 1 * mib, 512, stand_in)[1:3] == (8191, 16)     # the budget caps
    assert share_args(w, 64 * mib, 100, stand_in)[1:3] == (65535, 1024)  # the buffer caps
    assert share_args(w.float(), 8 * mib, 512, stand_in)[1:] == (65535, 128, 32)  # fp32
    for off in (share_args(None, mib, 8, stand_in), share_args(w, 0, 8, stand_in),
                share_args(torch.empty(3, dtype=torch.bfloat16), mib, 8, stand_in),
                share_args(w[:1].expand(2048, 2048), mib, 8, stand_in),
                share_args(w.t(), mib, 8, stand_in)):
        assert off[0] is stand_in and off[2] == 0
    monkeypatch.delenv("LATENTSERVE_ATTN_PREFETCH_MB", raising=False)
    assert attn_budget() == 8 * mib
    monkeypatch.setenv("LATENTSERVE_ATTN_PREFETCH_MB", "0")
    assert attn_budget() == 0


@pytest.mark.parametrize("kind,dtype", [("llama", "float32"), ("qwen2", "bfloat16")])
def test_fast_path_with_decode_gemms_equals_cublas_gemms(kind, dtype, small_vocab_dirs,
                                                         monkeypatch):
    """The Llama fast path with the decode-sized GEMMs (q/k/v with RoPE and the KV store
    in its epilogue, o_proj and down handing partial sums to the RMSNorm kernel, the
    SiLU-mul epilogue, fp32 logits) against the same path
    with ``DECODE_ROWS = 0`` (torch GEMMs): equal greedy tokens, every step's logits within
    1e-4 (fp32) or bf16 noise, and the kernels did run. Decode attention gets the layer's
    o_proj weight as its L2 prefetch hint on the decode-GEMM path only; where the backend
    says it prefetches (forced here: no PDL on CPU), the o_proj tiles for an L2-resident
    weight (split 2)."""
    from latentserve.attention import triton_backend
    from latentserve.config import EngineConfig
    from latentserve.engine.llm_engine import LLMEngine
    from latentserve.models import layers
    from latentserve.ops import kernels
    from latentserve.sampling_params import SamplingParams
    from tests.support.parity import shared_prefix_prompts
    from tests.support.tp_parity import assert_same, run_requests

    calls, real, real_qkv = [], kernels.decode_linear, kernels.qkv_rope_store_kv
    monkeypatch.setattr(kernels, "decode_linear", lambda *a, **k: calls.append(
        k.get("partials")) or calls.append(("l2", k.get("weight_in_l2"))) or real(*a, **k))
    monkeypatch.setattr(triton_backend.TritonBackend, "prefetches",
                        lambda self, meta, w, kv_heads: meta.is_decode and w is not None)
    monkeypatch.setattr(kernels, "qkv_rope_store_kv",
                        lambda *a, **k: calls.append("qkv") or real_qkv(*a, **k))
    hints, real_attn = [], triton_backend.decode_attention
    monkeypatch.setattr(triton_backend, "decode_attention", lambda *a, **k: hints.append(
        k["prefetch_next"]) or real_attn(*a, **k))
    sp = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    reqs = [(p, sp) for p in shared_prefix_prompts()[0:5:2]]  # 51, 30 (its prefix), 3 tokens
    out = {}
    monkeypatch.setattr(layers, "QKV_ROPE_ROWS", (1, 64))  # tiny batches here
    monkeypatch.setenv("LATENTSERVE_DECODE_TMA", "1")  # as on Hopper (interpreted here)
    for rows in (0, 64):
        monkeypatch.setattr(layers, "DECODE_ROWS", rows)
        engine = LLMEngine(EngineConfig(model=str(small_vocab_dirs[kind]), fused_ops=True,
                                        attention_backend="triton", dtype=dtype,
                                        attention_num_kv_splits=2))
        calls.clear()
        hints.clear()
        out[rows] = run_requests(engine, reqs)
        assert bool(calls) == bool(rows)
        o_projs = [lay.self_attn.o_proj.weight for lay in engine.runner.model.model.layers]
        assert hints and all(h is o_projs[i % len(o_projs)] if rows else h is None
                             for i, h in enumerate(hints))
        engine.cache.check_idle()
    assert True in calls  # o_proj / down handed partial sums on
    assert ("l2", True) in calls  # the decode steps' o_proj
    assert ("qkv" in calls) == (dtype != "float32")  # q/k/v + RoPE fused: 16-bit TMA only
    assert_same(out[0], out[64], atol=1e-4 if dtype == "float32" else 0.1)


def test_ouro_banks_with_the_qkv_rope_kernel(tmp_path, monkeypatch):
    """Ouro (recurrent depth, one KV bank per loop iteration, exited rows leaving a
    sub-batch) in bf16 with the q/k/v + RoPE + store kernel writing each iteration's bank,
    against the same fast path with torch GEMMs (``DECODE_ROWS = 0``): equal greedy tokens
    and every step's logits within bf16 noise."""
    from latentserve.bench.baseline.recurrent_models import write_ouro
    from latentserve.config import EngineConfig
    from latentserve.engine.llm_engine import LLMEngine
    from latentserve.models import layers
    from latentserve.ops import kernels
    from latentserve.sampling_params import SamplingParams
    from tests.support.tp_parity import assert_same, run_requests

    calls, real = [], kernels.qkv_rope_store_kv
    monkeypatch.setattr(kernels, "qkv_rope_store_kv",
                        lambda *a, **k: calls.append(1) or real(*a, **k))
    monkeypatch.setattr(layers, "QKV_ROPE_ROWS", (1, 64))
    monkeypatch.setenv("LATENTSERVE_DECODE_TMA", "1")  # as on Hopper (interpreted here)
    path = write_ouro(tmp_path / "ouro")
    g = torch.Generator().manual_seed(5)
    reqs = [(torch.randint(3, 200, (n,), generator=g).tolist(),
             SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True, latent_budget=d,
                            exit_criterion=c, exit_threshold=t))
            for n, d, c, t in ((9, 4, None, None), (5, 2, "threshold", 0.6),
                               (12, 3, "last", None))]
    out = {}
    for rows in (0, 64):
        monkeypatch.setattr(layers, "DECODE_ROWS", rows)
        engine = LLMEngine(EngineConfig(model=str(path), fused_ops=True,
                                        attention_backend="triton", dtype="bfloat16",
                                        attention_num_kv_splits=2))
        calls.clear()
        out[rows] = run_requests(engine, reqs)
        assert bool(calls) == bool(rows)
        engine.cache.check_idle()
    assert_same(out[0], out[64], atol=0.1)


def test_rms_norm_without_residual_rounds_to_x_dtype_and_materialize_matches_kernel():
    """Review findings: with no residual the kernel rounds the normed value to x's dtype
    even under an fp32 weight (as ``ops.norm.rms_norm``); ``layers.materialize`` sums
    partials in the kernel's order, so a captured hidden state equals the residual stream."""
    from latentserve.models.layers import materialize
    from latentserve.ops.norm import rms_norm as eager_rms_norm

    g = torch.Generator().manual_seed(2)
    x = torch.randn(4, 64, generator=g).to(torch.bfloat16)
    w = torch.rand(64, generator=g) + 0.5
    assert torch.equal(rms_norm(x, w, 1e-5), eager_rms_norm(x, w, 1e-5))
    parts = torch.randn(4, 3, 64, generator=g) * 1e3
    res = torch.randn(3, 64, generator=g).to(torch.bfloat16)
    _, new_res = rms_norm(parts, torch.ones(64, dtype=torch.bfloat16), 1e-5, res)
    assert torch.equal(new_res, materialize(parts, res) + res)


def mock_cuda(t: torch.Tensor):
    """A stand-in for a CUDA tensor as ``use_tma`` inspects it (is_cuda, device index,
    dtype, data_ptr, strides, element size)."""
    from types import SimpleNamespace

    return SimpleNamespace(is_cuda=True, device=torch.device("cuda", 0), dtype=t.dtype,
                           data_ptr=t.data_ptr, stride=t.stride, element_size=t.element_size)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tma_descriptor_path_equals_pointer_path(dtype):
    """The TMA path (the Hopper default, forced here with ``tma=True``; tiles read through tensor
    descriptors, zeros past every edge) gives the pointer path's results: odd M, N and K,
    K splits, partial sums, the SwiGLU epilogue and fp32 logits."""
    x, w, b = _data(5, 40, 200, dtype, seed=11)
    w2, b2 = torch.cat([w, w.flip(0)]), torch.cat([b, b])
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)
    cases = [dict(split_k=1), dict(split_k=4), dict(split_k=2, partials=True)]
    for kw in cases:
        bias = None if kw.get("partials") else b
        want = decode_linear(x, w, bias, block_n=16, block_k=32, tma=False, **kw)
        got = decode_linear(x, w, bias, block_n=16, block_k=32, tma=True, **kw)
        torch.testing.assert_close(got, want, **tol)
    want = decode_linear(x, w2, b2, swiglu=True, block_n=16, block_k=32, tma=False)
    got = decode_linear(x, w2, b2, swiglu=True, block_n=16, block_k=32, tma=True)
    torch.testing.assert_close(got, want, **tol)
    got = decode_linear(x, w, out_dtype=torch.float32, block_n=16, block_k=32, tma=True)
    torch.testing.assert_close(got, F.linear(x, w).float(), rtol=1e-2, atol=1e-2)


def test_tma_default_is_hopper_only(monkeypatch):
    """Descriptors by default on CUDA devices of compute capability 9.0+ only (never CPU
    tensors); ``LATENTSERVE_DECODE_TMA=0`` turns them off there, ``=1`` forces them on."""
    import importlib

    mod = importlib.import_module("latentserve.ops.kernels.decode_linear")
    use_tma = mod.use_tma
    x, w, _ = _data(4, 32, 64, torch.bfloat16)
    monkeypatch.delenv("LATENTSERVE_DECODE_TMA", raising=False)
    assert not use_tma(x, w)  # CPU tensors
    monkeypatch.setattr(mod, "_device_has_tma", lambda index: True)
    monkeypatch.delenv("TRITON_INTERPRET")
    assert use_tma(mock_cuda(x), w)
    monkeypatch.setenv("LATENTSERVE_DECODE_TMA", "0")
    assert not use_tma(mock_cuda(x), w)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv("LATENTSERVE_DECODE_TMA", "1")
    assert use_tma(x, w)
    assert not use_tma(x.float(), w.float())  # 16-bit weights only
    assert not use_tma(torch.zeros(4, 65, dtype=torch.bfloat16)[:, 1:], w)  # misaligned


def test_warmup_compiles_both_gemm_paths_and_leaves_the_engine_untouched(small_vocab_dirs,
                                                                          monkeypatch):
    """On the fast path the warm-up prompt is ``DECODE_ROWS + 1`` tokens: its prefill runs
    the torch/cuBLAS GEMMs (the SiLU-mul kernel) and its decode step ``decode_linear``; a
    second prompt of ``QKV_ROPE_ROWS[0]`` tokens runs the q/k/v + RoPE kernel;
    afterwards no request, no cached prefix and no prefix-cache counts remain. A context
    too short for that prompt gets one that fits."""
    from latentserve.config import EngineConfig
    from latentserve.engine.llm_engine import LLMEngine
    from latentserve.models import layers
    from latentserve.ops import kernels

    monkeypatch.setattr(layers, "DECODE_ROWS", 8)  # a short long-prompt: fast on CPU
    monkeypatch.setattr(layers, "QKV_ROPE_ROWS", (5, 8))
    monkeypatch.setenv("LATENTSERVE_DECODE_TMA", "1")  # as on Hopper (interpreted here)
    seen = []
    for name in ("decode_linear", "silu_and_mul", "qkv_rope_store_kv"):
        real = getattr(kernels, name)
        monkeypatch.setattr(kernels, name,
                            lambda *a, _n=name, _f=real, **k: seen.append(_n) or _f(*a, **k))
    engine = LLMEngine(EngineConfig(model=str(small_vocab_dirs["llama"]), fused_ops=True,
                                    attention_backend="triton", dtype="bfloat16"))
    seen.clear()
    engine.warmup()
    assert {"decode_linear", "silu_and_mul", "qkv_rope_store_kv"} <= set(seen)
    assert not engine.has_unfinished_requests()
    assert engine.scheduler.prefix_queries == engine.scheduler.prefix_hits == 0
    engine.cache.check_idle()
    short = LLMEngine(EngineConfig(model=str(small_vocab_dirs["llama"]), fused_ops=True,
                                   attention_backend="triton", max_model_len=8))
    short.warmup()  # 5 tokens fit, not 9
    short.cache.check_idle()
