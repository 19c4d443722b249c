"""The fast path's Triton kernels (``latentserve.ops.kernels``) against their torch
references (``latentserve.ops``), on CPU through the Triton interpreter, at tiny sizes.

fp32: within 1e-5 (the kernels' fp32 sums run in another order). bf16/fp16: the kernels
round where the eager ops round, so they may differ from the reference by at most one unit
in the last place of the output dtype (an fp32 intermediate off by an ulp can flip a
rounding). The real-size comparison on CUDA is in ``tests/gpu/test_fused_gpu.py``.
"""

import os

os.environ["TRITON_INTERPRET"] = "1"  # before anything imports triton or the kernels

import pytest

pytest.importorskip("triton")

import torch

from latentserve.ops import activation, kernels, norm, rotary
from tests.support.triton_interpreter import patch_triton_interpreter

patch_triton_interpreter()

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _ulp_close(out: torch.Tensor, ref: torch.Tensor) -> None:
    """Equal dtype and shape; values within 1e-5 (fp32) or one output-dtype ulp."""
    assert out.dtype == ref.dtype and out.shape == ref.shape
    if out.dtype == torch.float32:
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
        return
    ulp = torch.finfo(out.dtype).eps * ref.float().abs().clamp_min(1e-3)
    assert bool(((out.float() - ref.float()).abs() <= ulp).all()), \
        float((out.float() - ref.float()).abs().max())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [64, 96])
def test_rms_norm_matches_torch(dtype, hidden):
    g = torch.Generator().manual_seed(hidden)
    x = (torch.randn(5, hidden, generator=g) * 3).to(dtype)
    w = (1 + torch.randn(hidden, generator=g) * 0.1).to(dtype)
    out = kernels.rms_norm(x, w, 1e-6)
    _ulp_close(out, norm.rms_norm(x, w, 1e-6))


@pytest.mark.parametrize("dtype", DTYPES)
def test_add_rms_norm_matches_torch_and_keeps_inputs(dtype):
    g = torch.Generator().manual_seed(1)
    wide = torch.randn(6, 2 * 80, generator=g).to(dtype)
    x = wide[:, :80]  # strided rows, as a view into a wider buffer
    res = torch.randn(6, 80, generator=g).to(dtype)
    w = (1 + torch.randn(80, generator=g) * 0.1).to(dtype)
    x0, res0 = x.clone(), res.clone()
    out, new_res = kernels.rms_norm(x, w, 1e-5, residual=res)
    ref_out, ref_res = norm.add_rms_norm(x, res, w, 1e-5)
    assert torch.equal(new_res, ref_res)  # the residual sum is one rounded add either way
    _ulp_close(out, ref_out)
    assert torch.equal(x, x0) and torch.equal(res, res0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [64, 96, 200, 2048])
def test_sandwich_norm_is_the_separate_kernels_bitwise(dtype, hidden):
    """``pre_weight`` (Ouro's ``*_2`` norm, residual add, next norm in one kernel): bit for bit
    the three separate kernels of before; against the eager formula bit for bit in bf16/fp16
    (fp32: the sums run in another order, as ``test_rms_norm_matches_torch``)."""
    g = torch.Generator().manual_seed(hidden)
    a, r = ((torch.randn(7, hidden, generator=g) * sd).to(dtype) for sd in (3, 5))
    wp, w = ((1 + torch.randn(hidden, generator=g) * 0.1).to(dtype) for _ in range(2))
    a0, r0 = a.clone(), r.clone()
    y, s = kernels.rms_norm(a, w, 1e-6, residual=r, pre_weight=wp, pre_eps=1e-5)
    sep_s = r + kernels.rms_norm(a, wp, 1e-5)
    assert torch.equal(s, sep_s) and torch.equal(y, kernels.rms_norm(sep_s, w, 1e-6))
    ref_s = r + norm.rms_norm(a, wp, 1e-5)  # the eager sandwich boundary
    ref_y = norm.rms_norm(ref_s, w, 1e-6)
    if dtype == torch.float32:
        _ulp_close(s, ref_s)
        _ulp_close(y, ref_y)
    else:
        assert torch.equal(s, ref_s) and torch.equal(y, ref_y)
    assert torch.equal(a, a0) and torch.equal(r, r0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sandwich_norm_sums_split_k_partials(dtype):
    """With fp32 partials ``[S, T, hidden]`` (the down projection's) the pre-norm reads their
    sum rounded as the GEMM's output (``layers.materialize``)."""
    from latentserve.models.layers import materialize

    g = torch.Generator().manual_seed(5)
    parts = torch.randn(3, 4, 80, generator=g) * 4
    r = torch.randn(4, 80, generator=g).to(dtype)
    wp, w = ((1 + torch.randn(80, generator=g) * 0.1).to(dtype) for _ in range(2))
    y, s = kernels.rms_norm(parts, w, 1e-6, residual=r, pre_weight=wp)
    ref_y, ref_s = kernels.rms_norm(materialize(parts, r), w, 1e-6, residual=r, pre_weight=wp)
    assert torch.equal(s, ref_s) and torch.equal(y, ref_y)


def test_sandwich_norm_rejects_missing_residual_and_mixed_dtypes():
    x, w = torch.randn(2, 8), torch.ones(8)
    with pytest.raises(ValueError, match="pre_weight needs a residual"):
        kernels.rms_norm(x, w, 1e-6, pre_weight=w)
    with pytest.raises(ValueError, match="pre_weight needs a residual"):
        kernels.rms_norm(x, w, 1e-6, residual=x.bfloat16(), pre_weight=w.bfloat16())
    with pytest.raises(ValueError, match="pre_weight needs a residual"):
        kernels.rms_norm(x, w, 1e-6, residual=x, pre_weight=w.bfloat16())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(4, 2, 64), (3, 3, 96), (6, 2, 16)])
def test_rotary_in_place_matches_torch(dtype, heads, kv_heads, head_dim):
    g = torch.Generator().manual_seed(head_dim)
    t = 7
    # q, k as views of one fused qkv projection output (what the fast path hands over).
    qkv = torch.randn(t, (heads + 2 * kv_heads) * head_dim, generator=g).to(dtype)
    q = qkv[:, : heads * head_dim].view(t, heads, head_dim)
    k = qkv[:, heads * head_dim : (heads + kv_heads) * head_dim].view(t, kv_heads, head_dim)
    v_before = qkv[:, (heads + kv_heads) * head_dim :].clone()
    positions = torch.tensor([0, 1, 5, 17, 300, 4095, 2])
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    cos, sin = rotary.rope_cos_sin(positions, inv_freq, 1.0, dtype)
    ref_q, ref_k = rotary.apply_rotary(q, k, cos, sin)
    kernels.apply_rotary_(q, k, cos, sin)
    _ulp_close(q, ref_q)
    _ulp_close(k, ref_k)
    assert torch.equal(qkv[:, (heads + kv_heads) * head_dim :], v_before)  # v untouched


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("inter", [48, 1500])
def test_silu_and_mul_matches_torch(dtype, inter):
    g = torch.Generator().manual_seed(inter)
    gate_up = (torch.randn(3, 2 * inter, generator=g) * 4).to(dtype)
    _ulp_close(kernels.silu_and_mul(gate_up), activation.silu_and_mul(gate_up))


def test_kernels_reject_bad_layouts():
    x = torch.randn(4, 8)
    with pytest.raises(ValueError, match="contiguous last dim"):
        kernels.rms_norm(x.t(), torch.ones(4), 1e-6)
    with pytest.raises(ValueError, match=r"\[T, 2 \* I\]"):
        kernels.silu_and_mul(torch.randn(2, 7))
    q, k = torch.randn(2, 2, 8), torch.randn(2, 1, 8)
    with pytest.raises(ValueError, match="cos/sin"):
        kernels.apply_rotary_(q, k, torch.ones(2, 4), torch.ones(2, 4))
