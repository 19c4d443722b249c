"""SiLU(gate) * up kernel on a fused gate/up projection (reference:
``latentserve.ops.activation``). A 2-D grid of (row, column block); SiLU is rounded to the
activation dtype before the product, as the eager ``F.silu(gate) * up`` does."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from latentserve.ops.kernels.pdl import pdl_launch, pdl_wait


@triton.jit
def silu_mul(g, u):
    """``silu(g) * u`` for g and u in the activation dtype (rounded there), computed in fp32
    with SiLU rounded to that dtype before the product, as the eager ``F.silu(gate) * up``;
    returns the activation dtype. Shared by this kernel and ``decode_linear``'s epilogue."""
    gf = g.to(tl.float32)
    act = (gf / (1.0 + tl.exp(-gf))).to(g.dtype).to(tl.float32)
    return (act * u.to(tl.float32)).to(g.dtype)


@triton.jit
def _silu_and_mul_kernel(GU, Out, stride_gu, stride_o, n_cols, BLOCK: tl.constexpr,
                         PDL: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n_cols
    pdl_wait(PDL)
    g = tl.load(GU + row * stride_gu + offs, mask=mask, other=0.0)
    u = tl.load(GU + row * stride_gu + n_cols + offs, mask=mask, other=0.0)
    tl.store(Out + row * stride_o + offs, silu_mul(g, u), mask=mask)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up: ``[T, 2 * I]`` fp32/bf16/fp16 (gate columns first, last dim contiguous).
    Returns a new ``[T, I]`` tensor ``silu(gate) * up`` in the input dtype.
    Raises ValueError on a non-2-D input, an odd width or a strided last dim."""
    if gate_up.dim() != 2 or gate_up.shape[1] % 2 or gate_up.stride(-1) != 1:
        raise ValueError(f"gate_up must be [T, 2 * I] with a contiguous last dim, got shape "
                         f"{tuple(gate_up.shape)} strides {gate_up.stride()}")
    t, n = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty((t, n), dtype=gate_up.dtype, device=gate_up.device)
    if t > 0:
        block = min(triton.next_power_of_2(n), 1024)
        _silu_and_mul_kernel[(t, triton.cdiv(n, block))](
            gate_up, out, gate_up.stride(0), out.stride(0), n, BLOCK=block,
            num_warps=4 if block >= 512 else 1, **pdl_launch(gate_up.device),
        )
    return out
