"""The Llama fast path (``use_fused_ops``: merged q/k/v and gate/up GEMMs, fused residual-add
+ RMSNorm, in-place RoPE, SiLU-and-multiply kernels) end to end on CPU, with the kernels in
the Triton interpreter: the engine's greedy tokens and prefill logits equal HF transformers'
in fp32 (1e-4), as on the unfused path. Real sizes on CUDA: ``tests/gpu/test_fused_gpu.py``.
"""

import os
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "1"  # before anything imports triton or the kernels

import pytest

pytest.importorskip("triton")

import torch

from latentserve.config import EngineConfig
from latentserve.engine.llm_engine import LLMEngine
from tests.support.parity import hf_reference, run_batch, shared_prefix_prompts
from tests.support.triton_interpreter import patch_triton_interpreter

patch_triton_interpreter()


def _prefix_prompts(n: int = 16, m: int = 10):
    """``shared_prefix_prompts``' first, third and fifth cut to ``n + 3``, ``m`` (a prefix of
    the first) and 3 tokens (each prompt token is an interpreted program of every per-token
    kernel). By default a prefill of 32 rows, not 84."""
    base = shared_prefix_prompts()[0]
    return [base[:n] + base[-3:], base[:m], shared_prefix_prompts()[4]]


def _prompts_past_decode_rows():
    """``_prefix_prompts`` of 43, 24 and 3 tokens: a prefill of 70 rows, past
    ``layers.DECODE_ROWS`` (64), so it keeps the torch GEMMs and decode the decode GEMMs."""
    return _prefix_prompts(40, 24)


@pytest.mark.parametrize("kind,backend", [("llama", "torch"), ("qwen2", "torch"),
                                          ("llama", "triton"), ("qwen2", "triton")])
def test_fused_engine_matches_hf_fp32(kind, backend, small_vocab_dirs, hf_models):
    """With ``triton`` attention the kernels read q/k/v as strided views of the merged
    projection output, and the RoPE kernel stores K/V into the pool itself."""
    engine = LLMEngine(EngineConfig(model=str(small_vocab_dirs[kind]), fused_ops=True,
                                    attention_backend=backend))
    layer = engine.runner.model.model.layers[0]
    assert layer.self_attn.fused and layer.mlp.fused and layer.input_layernorm.fused
    assert not hasattr(layer.self_attn, "q_proj")  # merged, not kept twice
    prompts = _prompts_past_decode_rows()  # 43, 24 (its prefix) and 3 tokens
    tokens, logits, _ = run_batch(engine, prompts, 5)
    hf = hf_models(small_vocab_dirs[kind])
    for i, p in enumerate(prompts):
        ref_tokens, ref_logits = hf_reference(hf, p, 5)
        assert tokens[i] == ref_tokens, f"prompt {i}"
        torch.testing.assert_close(logits[i], ref_logits, atol=1e-4, rtol=0)
    engine.cache.check_idle()


def _run_with_and_without_fused_kv_store(path, reqs, monkeypatch, **cfg):
    """``run_requests`` output of two fresh fast-path engines on the Triton backend: the
    two-kernel path (RoPE, then the backend's ``store_kv``) and the fused store. Checks
    that only the first launches ``store_kv``. Both keep the q/k/v projection on torch
    (``DECODE_ROWS = 0``), so decode steps run this kernel, not ``qkv_rope_store_kv``
    (tested in ``test_decode_linear.py`` and ``test_qkv_rope.py``)."""
    from latentserve.attention import triton_backend
    from latentserve.models import layers
    from tests.support.tp_parity import run_requests

    monkeypatch.setattr(layers, "DECODE_ROWS", 0)

    calls, real = [], triton_backend.store_kv
    monkeypatch.setattr(triton_backend, "store_kv", lambda *a: calls.append(1) or real(*a))
    out = {}
    # one split (the kernel's direct path, as for large batches on the GPU): an eighth of 8
    # splits' interpreted programs and no combine stage; the stores are what is compared
    cfg.setdefault("attention_num_kv_splits", 1)
    for fused_store in (False, True):
        engine = LLMEngine(EngineConfig(model=str(path), fused_ops=True,
                                        attention_backend="triton", **cfg))
        engine.runner.backend.fused_kv_store = fused_store  # False: as before the fusion
        calls.clear()
        out[fused_store] = run_requests(engine, reqs)
        assert bool(calls) != fused_store, f"store_kv launched {len(calls)} times"
    return out[False], out[True]


@pytest.mark.parametrize("kind,dtype", [("llama", "float32"), ("qwen2", "bfloat16")])
def test_fused_kv_store_gives_the_two_kernel_path_bitwise(kind, dtype, small_vocab_dirs,
                                                          monkeypatch):
    """Prefill, extend over a cached prefix and decode with RoPE and the KV store in one
    kernel: greedy tokens and every step's logits equal the two-kernel path exactly."""
    from latentserve.sampling_params import SamplingParams
    from tests.support.tp_parity import assert_same

    sp = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    reqs = [(p, sp) for p in _prefix_prompts()]  # 19, 10 (its prefix), 3 tokens
    two, one = _run_with_and_without_fused_kv_store(small_vocab_dirs[kind], reqs, monkeypatch,
                                                    dtype=dtype)
    assert_same(two, one, atol=0)


def _ouro_requests():
    """Four Ouro requests with mixed depths and exit rules (one batch). Short prompts (14
    tokens in all): each prompt token runs every loop iteration of its request through the
    interpreted kernels. The threshold row exits at its first step for some tokens, at its
    last for others."""
    from latentserve.sampling_params import SamplingParams

    g = torch.Generator().manual_seed(3)
    cases = [(4, None, None), (2, "threshold", 0.6), (6, "weighted", None), (3, "last", None)]
    return [(torch.randint(3, 200, (n,), generator=g).tolist(),
             SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True, latent_budget=d,
                            exit_criterion=c, exit_threshold=t))
            for n, (d, c, t) in zip((3, 5, 2, 4), cases)]


def _huginn_requests(cases):
    """Huginn requests for ``cases`` (``(latent_budget, exit options)``): prompts drawn as 9,
    17, 4 and 12 tokens, all but the third cut to their first 3 to 5 (fewer interpreted
    programs a prefill). The third, in full, is the one whose KL exit fires (at budget 5 or
    6: before the budget for some of its tokens)."""
    from latentserve.sampling_params import SamplingParams

    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(3, 200, (n,), generator=g).tolist()[:k]
               for n, k in ((9, 3), (17, 5), (4, 4), (12, 4))]
    return [(p, SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True,
                               latent_budget=d, **kw))
            for p, (d, kw) in zip(prompts, cases)]


def test_fused_kv_store_ouro_banks_bitwise(tmp_path, monkeypatch):
    """Ouro on the Triton backend: each loop iteration's bank gets the fused store, also
    when exited rows leave a sub-batch; tokens and logits equal the two-kernel path."""
    from latentserve.bench.baseline.recurrent_models import write_ouro
    from tests.support.tp_parity import assert_same

    path = write_ouro(tmp_path / "ouro")
    reqs = _ouro_requests()
    two, one = _run_with_and_without_fused_kv_store(path, reqs, monkeypatch)
    assert_same(two, one, atol=0)


def test_fused_kv_store_huginn_banks_bitwise(tmp_path, monkeypatch):
    """Huginn on the Triton backend: the qk_bias + pair-RoPE kernel stores each iteration's
    K/V into its bank, with early exit (banks then filled from the exit iteration); tokens
    and logits equal the two-kernel path."""
    from latentserve.bench.baseline.recurrent_models import write_huginn
    from tests.support.tp_parity import assert_same

    path = write_huginn(tmp_path / "huginn")
    reqs = _huginn_requests([(3, {}), (2, {}),
                             (5, {"exit_criterion": "kl", "exit_threshold": 5e-4})])
    two, one = _run_with_and_without_fused_kv_store(path, reqs, monkeypatch)
    assert_same(two, one, atol=0)
    assert min(one[2][2].recurrence["histogram"]) < 5  # the KL exit fired


def test_fused_kv_store_llama_tp2_matches_tp1(small_vocab_dirs, tmp_path, monkeypatch):
    """The fast path on the Triton backend after sharding (one KV head per rank): each rank's
    RoPE kernel stores its local heads; TP=2 gives the TP=1 tokens and logits (1e-4)."""
    from latentserve.sampling_params import SamplingParams
    from tests.support.tp_parity import assert_same, run_requests

    # The rank-1 worker is a fresh interpreter (inheriting TRITON_INTERPRET): it needs this
    # process's interpreter patches too, applied at its startup through sitecustomize.
    (tmp_path / "sitecustomize.py").write_text(
        "from tests.support.triton_interpreter import patch_triton_interpreter\n"
        "patch_triton_interpreter()\n")
    root = str(Path(__file__).resolve().parents[2])  # tests.support, before sys.path[0] is set
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(
        p for p in (str(tmp_path), root, os.environ.get("PYTHONPATH")) if p))

    sp = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    reqs = [(p, sp) for p in _prompts_past_decode_rows()]
    cfg = {"model": str(small_vocab_dirs["llama"]), "fused_ops": True,
           "attention_backend": "triton",
           "kv_slots": 1024, "max_model_len": 128, "attention_num_kv_splits": 1}
    one = run_requests(LLMEngine(EngineConfig(**cfg)), reqs)
    two = LLMEngine(EngineConfig(**cfg, tensor_parallel_size=2))
    try:
        assert two.runner.backend.fused_kv_store and two.runner.model.model.layers[0] \
            .self_attn.n_kv == 1
        assert_same(one, run_requests(two, reqs))
    finally:
        two.shutdown()


def test_fused_ops_default_only_on_cuda_triton():
    assert not EngineConfig(device="cpu").use_fused_ops
    assert not EngineConfig(device="cuda", attention_backend="torch").use_fused_ops
    assert EngineConfig(device="cuda").use_fused_ops
    assert not EngineConfig(device="cuda", fused_ops=False).use_fused_ops


def test_fused_ouro_matches_unfused_fp32(tmp_path):
    """Ouro's fast path (merged q/k/v and gate/up, in-place RoPE from its ``[T, 1, D]``
    cos/sin, each sandwich norm, residual add and next norm as one RMSNorm kernel) gives
    the unfused path's tokens and logits (1e-4) for mixed depths and readouts; the unfused
    path is checked against the upstream-algorithm reference in
    ``tests/parity/test_recurrent_parity.py``."""
    from latentserve.bench.baseline.recurrent_models import write_ouro
    from tests.support.tp_parity import assert_same, run_requests

    path = write_ouro(tmp_path / "ouro")
    reqs = _ouro_requests()
    out = {}
    for fused in (False, True):
        engine = LLMEngine(EngineConfig(model=str(path), fused_ops=fused))
        layer = engine.runner.model.model.layers[0]
        assert layer.self_attn.fused == fused and layer.input_layernorm_2.fused == fused
        out[fused] = run_requests(engine, reqs)
    assert_same(out[False], out[True])


@pytest.mark.parametrize("rows", [0, 64])
def test_ouro_sandwich_norm_kernel_gives_the_separate_kernels_bitwise(rows, tmp_path,
                                                                      monkeypatch):
    """Ouro's fast path in bf16 with ``OuroDecoderLayer.fused_forward`` (each ``*_2`` norm,
    its residual add and the next norm as one kernel, the down projection's split-K
    partials summed in it with ``rows``) against the same fast path running the upstream
    layer formula (four norm kernels and two adds a layer, then the final norm): tokens and
    every step's logits equal bit for bit, with 2L + 1 norm kernels a loop step, not 4L + 1."""
    import importlib
    from types import MethodType

    from latentserve.bench.baseline.recurrent_models import write_ouro
    from latentserve.models import layers
    from latentserve.ops import kernels
    from tests.support.tp_parity import assert_same, run_requests

    def separate_step(self, h, cos, sin, t):  # the fast path before the sandwich kernel
        for l, layer in enumerate(self.model.layers):
            h = layer(h, cos, sin, self.bank(t, l))
        return self.model.norm(h)

    calls, real = [], kernels.rms_norm
    monkeypatch.setattr(kernels, "rms_norm", lambda *a, **k: calls.append(1) or real(*a, **k))
    monkeypatch.setattr(layers, "DECODE_ROWS", rows)
    gemm = importlib.import_module("latentserve.ops.kernels.decode_linear")
    monkeypatch.setattr(gemm, "pick_tiling",  # the down projection (K = 128) splits K in 2
                        lambda m, n, k, in_l2=False: (64, 64, 2 if k >= 128 else 1))
    path = write_ouro(tmp_path / "ouro")
    reqs = _ouro_requests()
    out, launches = {}, {}
    for fused_norms in (False, True):
        engine = LLMEngine(EngineConfig(model=str(path), fused_ops=True, dtype="bfloat16"))
        model = engine.runner.model
        assert model.model.layers[0].post_attention_layernorm_2.fused
        if not fused_norms:
            model.step = MethodType(separate_step, model)
        calls.clear()
        out[fused_norms] = run_requests(engine, reqs)
        launches[fused_norms] = len(calls)
    assert_same(out[False], out[True], atol=0)
    n_layers = 2  # OURO_TINY
    steps = launches[False] // (4 * n_layers + 1)
    assert launches[False] == steps * (4 * n_layers + 1) and steps > 0
    assert launches[True] == steps * (2 * n_layers + 1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_pairs_kernel_matches_huginn_eager(dtype):
    """The in-place kernel on strided views of a fused q|k|v output equals the eager
    ``qk_bias`` add (in the activation dtype) then ``rope_pairs`` (fp32 rotation)."""
    from latentserve.latent.huginn import rope_pairs
    from latentserve.ops.kernels import apply_rotary_pairs_

    g = torch.Generator().manual_seed(0)
    t, h, d = 5, 3, 8
    qkv = torch.randn(t, 3 * h * d, generator=g).to(dtype)
    bias = (0.5 * torch.randn(2, h, d, generator=g)).to(dtype)
    freqs = torch.arange(t)[:, None].float() * torch.rand(d // 2, generator=g)[None, :]
    cos, sin = freqs.cos(), freqs.sin()
    q, k = qkv[:, : h * d].view(t, h, d), qkv[:, h * d : 2 * h * d].view(t, h, d)
    want_q = rope_pairs((q + bias[0]).to(dtype), cos[:, None], sin[:, None])
    want_k = rope_pairs((k + bias[1]).to(dtype), cos[:, None], sin[:, None])
    v_before = qkv[:, 2 * h * d :].clone()
    apply_rotary_pairs_(q, k, cos, sin, bias[0], bias[1])
    tol = 0 if dtype == torch.float32 else 2 ** -7  # one bf16 ulp at |x| < 2 (fp32 FMA)
    torch.testing.assert_close(q, want_q, atol=1e-6 if tol == 0 else tol, rtol=0)
    torch.testing.assert_close(k, want_k, atol=1e-6 if tol == 0 else tol, rtol=0)
    assert torch.equal(qkv[:, 2 * h * d :], v_before)  # v untouched
    with pytest.raises(ValueError, match="both q_bias and k_bias"):
        apply_rotary_pairs_(q, k, cos, sin, bias[0], None)


def test_fused_huginn_matches_unfused_fp32(tmp_path):
    """Huginn's fast path (RMSNorm kernel with the sandwich residual add, the qk_bias +
    pair-RoPE kernel, SiLU-and-multiply) gives the unfused path's tokens and logits (1e-4)
    at mixed depths, with and without early exit; the unfused path is checked against the
    upstream-algorithm reference in ``tests/parity/test_recurrent_parity.py``."""
    from latentserve.bench.baseline.recurrent_models import write_huginn
    from tests.support.tp_parity import assert_same, run_requests

    path = write_huginn(tmp_path / "huginn")
    reqs = _huginn_requests([(4, {}), (2, {}),
                             (6, {"exit_criterion": "kl", "exit_threshold": 5e-4}), (3, {})])
    out = {}
    for fused in (False, True):
        engine = LLMEngine(EngineConfig(model=str(path), fused_ops=fused))
        block = engine.runner.model.transformer.core_block[0]
        assert block.attn.fused == fused and block.mlp.fused == fused and \
            block.norm_2.fused == fused
        out[fused] = run_requests(engine, reqs)
    assert_same(out[False], out[True])
    assert min(out[False][2][2].recurrence["histogram"]) < 6  # the KL exit fired


def test_recurrent_models_take_the_fast_path_when_asked(tmp_path):
    """``fused_ops`` (the CUDA + Triton default) switches Huginn and Ouro to the fast path,
    which passed its fp32 parity test on the H200; without it they stay unfused."""
    from latentserve.bench.baseline.recurrent_models import write_huginn, write_ouro
    from latentserve.latent.load import load_model

    for path in (write_huginn(tmp_path / "h"), write_ouro(tmp_path / "o")):
        plain, _ = load_model(path, torch.float32, "cpu")
        fused, _ = load_model(path, torch.float32, "cpu", fused_ops=True)
        norms = [m for m in plain.modules() if type(m).__name__ == "RMSNorm"]
        assert norms and not any(m.fused for m in norms)
        assert all(m.fused for m in fused.modules() if type(m).__name__ == "RMSNorm")


def test_fused_huginn_tp2_matches_tp1(tmp_path):
    """The fast path (the CUDA default for Huginn) after sharding: TP=2 over gloo gives the
    TP=1 fast path's tokens and logits (1e-4), with heads split unevenly (2 + 1)."""
    from latentserve.bench.baseline.recurrent_models import write_huginn
    from latentserve.sampling_params import SamplingParams
    from tests.support.tp_parity import assert_same, run_requests

    path = write_huginn(tmp_path / "huginn", n_embd=48, num_attention_heads=3,
                        num_key_value_heads=3)
    reqs = [([(7 * i + 11 * j) % 900 + 20 for i in range(3 + 2 * j)],
             SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, latent_budget=d))
            for j, d in enumerate((2, 1, 3))]  # mixed depths; fewer interpreted loop steps
    cfg = {"model": str(path), "fused_ops": True, "kv_slots": 2048, "max_model_len": 128}
    one = run_requests(LLMEngine(EngineConfig(**cfg)), reqs)
    two = LLMEngine(EngineConfig(**cfg, tensor_parallel_size=2))
    try:
        assert two.runner.model.transformer.core_block[0].attn.fused
        assert_same(one, run_requests(two, reqs))
    finally:
        two.shutdown()
