"""Token embedding lookup with latent rows swapped in, in one launch: bitwise
``torch.where(latent_mask[:, None], input_embeds, embed_tokens(ids))`` (``layers.inject``)
without the two kernels and the ``[T, hidden]`` intermediate."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from latentserve.ops.kernels.pdl import pdl_launch, pdl_wait


@triton.jit
def _embed_inject_kernel(W, Ids, E, Mask, Out, H, vocab, stride_w, stride_e, stride_o,
                         HAS_LATENT: tl.constexpr, BLOCK_H: tl.constexpr,
                         PDL: tl.constexpr):
    r = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    ok = offs < H
    pdl_wait(PDL)
    tok = tl.minimum(tl.maximum(tl.load(Ids + r), 0), vocab - 1).to(tl.int64)
    row = W + tok * stride_w + offs  # the embedding table has Out's dtype
    if HAS_LATENT:
        if tl.load(Mask + r) != 0:
            x = tl.load(E + r.to(tl.int64) * stride_e + offs, mask=ok, other=0.0)
            x = x.to(Out.dtype.element_ty)
        else:
            x = tl.load(row, mask=ok, other=0.0)
    else:
        x = tl.load(row, mask=ok, other=0.0)
    tl.store(Out + r.to(tl.int64) * stride_o + offs, x, mask=ok)


def embed_inject(weight: torch.Tensor, ids: torch.Tensor, input_embeds: torch.Tensor | None,
                 latent_mask: torch.Tensor | None) -> torch.Tensor:
    """``layers.inject(weight[ids], input_embeds, latent_mask)`` in one kernel: ``weight``
    ``[vocab, hidden]``, ``ids`` ``[T]`` int32/int64 (clamped into range), ``input_embeds``
    ``[T, hidden]`` any float dtype or None, ``latent_mask`` ``[T] bool``. Returns a new
    ``[T, hidden]`` in ``weight``'s dtype. Raises ValueError naming the argument on a shape,
    stride or device mismatch."""
    if weight.dim() != 2 or weight.stride(-1) != 1:
        raise ValueError(f"weight must be [vocab, hidden] with a contiguous last dim, got "
                         f"{tuple(weight.shape)}")
    if ids.dim() != 1:
        raise ValueError(f"ids must be [T], got {tuple(ids.shape)}")
    t, hidden = ids.shape[0], weight.shape[1]
    if input_embeds is not None:
        if input_embeds.shape != (t, hidden) or input_embeds.stride(-1) != 1:
            raise ValueError(f"input_embeds must be [{t}, {hidden}] with a contiguous last "
                             f"dim, got {tuple(input_embeds.shape)}")
        if latent_mask is None or latent_mask.shape != (t,):
            raise ValueError(f"latent_mask must be [{t}] bool with input_embeds, got "
                             f"{None if latent_mask is None else tuple(latent_mask.shape)}")
    for name, x in (("ids", ids), ("input_embeds", input_embeds), ("latent_mask", latent_mask)):
        if x is not None and x.device != weight.device:
            raise ValueError(f"{name} is on {x.device}, weight on {weight.device}")
    out = torch.empty(t, hidden, dtype=weight.dtype, device=weight.device)
    ids = ids.contiguous()
    if t == 0:
        return out
    block = min(1024, triton.next_power_of_2(hidden))
    has_latent = input_embeds is not None
    e = input_embeds if has_latent else out
    mask = latent_mask.contiguous() if has_latent else ids
    _embed_inject_kernel[(t, triton.cdiv(hidden, block))](
        weight, ids, e, mask, out, hidden, weight.shape[0], weight.stride(0), e.stride(0),
        out.stride(0), HAS_LATENT=has_latent, BLOCK_H=block, num_warps=4,
        **pdl_launch(weight.device))
    return out
