"""Tensor-parallel layers and ``shard_model``: a loaded model -> this rank's shard."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from latentserve.distributed import TPGroup, all_gather_last_dim

# Modules kept whole on every rank (small, or cheaper whole than split).
REPLICATED = ("wpe", "adapter", "early_exit_gate")


def _block(n: int, tp: TPGroup, what: str) -> slice:
    if n % tp.size:
        raise ValueError(f"{what} ({n}) must be divisible by tensor_parallel_size ({tp.size})")
    per = n // tp.size
    return slice(tp.rank * per, (tp.rank + 1) * per)


def head_split(n_heads: int, n_kv: int, tp: TPGroup) -> tuple[slice, slice]:
    """This rank's ``(query heads, KV heads)`` as index ranges (docs/internals.md).
    Raises ValueError when there are fewer KV heads than ranks or the query heads do not
    group evenly over the KV heads."""
    if n_kv < tp.size:
        raise ValueError(f"num_key_value_heads ({n_kv}) must be >= tensor_parallel_size "
                         f"({tp.size}): KV heads are split across ranks, not replicated")
    if n_heads % n_kv:
        raise ValueError(f"num_attention_heads ({n_heads}) must be a multiple of "
                         f"num_key_value_heads ({n_kv})")
    base, extra = divmod(n_kv, tp.size)
    lo = tp.rank * base + min(tp.rank, extra)
    hi = lo + base + (tp.rank < extra)
    group = n_heads // n_kv
    return slice(lo * group, hi * group), slice(lo, hi)


def _scale(s: slice, k: int, offset: int = 0) -> slice:
    return slice(offset + s.start * k, offset + s.stop * k)


class _LocalLinear(nn.Module):
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)


class ColumnParallelLinear(_LocalLinear):
    """``y[..., out_r] = x W_r^T + b_r``: this rank's output features, no communication.
    ``from_rows(linear, parts)``: the ``parts`` slices of the output, in order;
    ``from_linear(linear, tp, splits)``: each chunk of ``splits`` split evenly."""

    @classmethod
    def from_rows(cls, linear: nn.Linear, parts: list[slice]) -> ColumnParallelLinear:
        weight = torch.cat([linear.weight.data[p] for p in parts]).clone()
        bias = None if linear.bias is None else \
            torch.cat([linear.bias.data[p] for p in parts]).clone()
        return cls(weight, bias)

    @classmethod
    def from_linear(cls, linear: nn.Linear, tp: TPGroup, splits: list[int] | None = None,
                    what: str = "output features") -> ColumnParallelLinear:
        parts, off = [], 0
        for n in splits or [linear.out_features]:
            parts.append(_scale(_block(n, tp, what), 1, off))
            off += n
        return cls.from_rows(linear, parts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class RowParallelLinear(_LocalLinear):
    """``y = all_reduce(x_r W_r^T) + b``: this rank's block of input features (``cols``,
    default an even split); the bias (whole) is added once, after the sum. Input
    ``[T, in / size]``; output ``[T, out]``."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, tp: TPGroup):
        super().__init__(weight, bias)
        self.tp = tp

    @classmethod
    def from_linear(cls, linear: nn.Linear, tp: TPGroup, cols: slice | None = None,
                    what: str = "input features") -> RowParallelLinear:
        cols = _block(linear.in_features, tp, what) if cols is None else cols
        bias = None if linear.bias is None else linear.bias.data.clone()
        return cls(linear.weight.data[:, cols].clone(), bias, tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight)
        dist.all_reduce(y, group=self.tp.device_group)  # the ranks' partial sums
        return y if self.bias is None else y + self.bias


def vocab_shard(weight: torch.Tensor, tp: TPGroup) -> tuple[nn.Parameter, int]:
    """This rank's rows ``[rank * per, (rank + 1) * per)`` of a ``[vocab, hidden]`` table,
    ``per = ceil(vocab / size)``, zero-padded to ``per`` rows; returns ``(param, start)``."""
    vocab = weight.shape[0]
    per = -(-vocab // tp.size)
    start = tp.rank * per
    part = weight.data[start : min(start + per, vocab)]
    out = weight.data.new_zeros(per, weight.shape[1])
    out[: part.shape[0]] = part
    return nn.Parameter(out, requires_grad=False), start


class VocabParallelEmbedding(nn.Module):
    """Token embedding over this rank's vocabulary block ``[start, start + per)``:
    ``forward(ids [T]) -> [T, hidden]``, out-of-block ids zeroed, then one all-reduce.
    ``weight`` ``[per, hidden]`` may be shared with a tied ``ParallelLMHead``."""

    def __init__(self, weight: nn.Parameter, start: int, tp: TPGroup):
        super().__init__()
        self.weight = weight
        self.start, self.tp = start, tp

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start
        outside = (local < 0) | (local >= self.weight.shape[0])
        x = F.embedding(local.masked_fill(outside, 0), self.weight).masked_fill(outside[:, None], 0)
        dist.all_reduce(x, group=self.tp.device_group)
        return x


class ParallelLMHead(nn.Module):
    """LM head over this rank's vocabulary block: ``forward(hidden [B, hidden]) -> [B, vocab]``
    in the weight's dtype, all-gathered, padding columns dropped."""

    def __init__(self, weight: nn.Parameter, vocab_size: int, tp: TPGroup):
        super().__init__()
        self.weight = weight
        self.vocab_size, self.tp = vocab_size, tp

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = all_gather_last_dim(F.linear(hidden, self.weight), self.tp)
        return logits[..., : self.vocab_size]


def _shard_attention(att: nn.Module, tp: TPGroup) -> None:
    """Split one attention module's heads across ranks (head counts become per-rank)."""
    col, row = ColumnParallelLinear.from_rows, RowParallelLinear.from_linear
    if hasattr(att, "q_proj"):  # Llama, Qwen2, Mistral, Ouro
        q, kv = head_split(att.n_heads, att.n_kv, tp)
        d = att.head_dim
        att.q_proj = col(att.q_proj, [_scale(q, d)])
        att.k_proj = col(att.k_proj, [_scale(kv, d)])
        att.v_proj = col(att.v_proj, [_scale(kv, d)])
        att.o_proj = row(att.o_proj, tp, _scale(q, d))
        att.n_heads, att.n_kv = q.stop - q.start, kv.stop - kv.start
    elif hasattr(att, "c_attn"):  # GPT-2: fused q|k|v, multi-head
        q, _ = head_split(att.n_heads, att.n_heads, tp)
        d, e = att.head_dim, att.n_heads * att.head_dim
        att.c_attn = col(att.c_attn, [_scale(q, d, i * e) for i in range(3)])
        att.c_proj = row(att.c_proj, tp, _scale(q, d))
        att.n_heads = q.stop - q.start
    elif hasattr(att, "Wqkv"):  # Huginn: fused q|k|v, per-head qk_bias
        q, kv = head_split(att.n_head, att.n_kv, tp)
        d, (nq, nk, _) = att.head_dim, att.chunks
        att.Wqkv = col(att.Wqkv, [_scale(q, d), _scale(kv, d, nq), _scale(kv, d, nq + nk)])
        att.proj = row(att.proj, tp, _scale(q, d))
        if att.has_qk_bias:  # [2, 1, heads, head_dim]; Huginn requires kv == heads here
            att.qk_bias = nn.Parameter(att.qk_bias.data[:, :, q].clone(), requires_grad=False)
        att.n_head, att.n_kv = q.stop - q.start, kv.stop - kv.start
        att.chunks = [att.n_head * d, att.n_kv * d, att.n_kv * d]
    else:
        raise ValueError(f"no tensor-parallel plan for attention {type(att).__name__}")


# MLP layouts: (column-split layers, the row-split layer); Huginn's ``fc`` is gate|up fused.
_MLP_PLANS = {"gate_proj": (("gate_proj", "up_proj"), "down_proj"),  # Llama family, Ouro
              "c_fc": (("c_fc",), "c_proj"), "fc": (("fc",), "proj")}  # GPT-2, Huginn


def _shard_mlp(mlp: nn.Module, tp: TPGroup) -> None:
    key = next((k for k in _MLP_PLANS if hasattr(mlp, k)), None)
    if key is None:
        raise ValueError(f"no tensor-parallel plan for MLP {type(mlp).__name__}")
    cols, row = _MLP_PLANS[key]
    inter = getattr(mlp, row).in_features
    for name in cols:
        setattr(mlp, name, ColumnParallelLinear.from_linear(
            getattr(mlp, name), tp, [inter, inter] if key == "fc" else None, "intermediate_size"))
    setattr(mlp, row, RowParallelLinear.from_linear(getattr(mlp, row), tp,
                                                    what="intermediate_size"))


def shard_model(model: nn.Module, tp: TPGroup) -> nn.Module:
    """``model`` (CPU, loaded) with this rank's shards. Raises ValueError naming a size
    ``tp.size`` does not divide, or a module no plan covers."""
    for name, mod in list(model.named_modules()):
        leaf = name.rpartition(".")[2]
        if leaf in ("attn", "self_attn") and not isinstance(mod, nn.Linear):
            _shard_attention(mod, tp)
        elif leaf == "mlp":
            _shard_mlp(mod, tp)
    modules = dict(model.named_modules())
    emb_name = next(n for n in ("model.embed_tokens", "transformer.wte") if n in modules)
    emb = modules[emb_name]
    vocab = emb.weight.shape[0]
    head = getattr(model, "lm_head", None)
    tied = head is None or head.weight is emb.weight
    weight, start = vocab_shard(emb.weight, tp)
    model.set_submodule(emb_name, VocabParallelEmbedding(weight, start, tp))
    head_weight = weight if tied else vocab_shard(head.weight, tp)[0]
    model.lm_head = ParallelLMHead(head_weight, vocab, tp)
    if head is None:  # GPT-2 computes logits from wte: route them through the parallel head
        model.compute_logits = lambda hidden: model.lm_head(hidden).float()
    for name, mod in model.named_modules():
        if isinstance(mod, (nn.Linear, nn.Embedding)) and name.rpartition(".")[2] \
                not in REPLICATED:
            raise ValueError(f"no tensor-parallel plan for {name} ({type(mod).__name__}) "
                             f"in {type(model).__name__}")
    model.tp = tp
    return model
