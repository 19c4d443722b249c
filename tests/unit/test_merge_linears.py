"""``merge_linears`` (the fast path's q/k/v and gate/up merge): the merged layer's output is
the given layers' outputs concatenated, for plain ``nn.Linear`` (with and without bias) and
for one tensor-parallel rank's column shards."""

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from latentserve.models.layers import merge_linears
from latentserve.models.parallel import ColumnParallelLinear


@pytest.mark.parametrize("bias", [False, True])
def test_merged_output_is_the_concatenation(bias):
    torch.manual_seed(0)
    parts = [nn.Linear(16, n, bias=bias) for n in (8, 4, 4)]
    x = torch.randn(5, 16)
    merged = merge_linears(*parts)
    assert isinstance(merged, nn.Linear) and merged.weight.shape == (16, 16)
    # equal up to the GEMM's summation order (one wider GEMM blocks differently)
    torch.testing.assert_close(merged(x), torch.cat([p(x) for p in parts], dim=-1),
                               atol=1e-6, rtol=0)


def test_merging_column_shards_gives_this_ranks_shard():
    torch.manual_seed(0)
    q, k, v = nn.Linear(16, 8), nn.Linear(16, 4), nn.Linear(16, 4)
    x = torch.randn(3, 16)
    for rank in (0, 1):
        tp = SimpleNamespace(rank=rank, size=2)
        merged = merge_linears(*(ColumnParallelLinear.from_linear(p, tp) for p in (q, k, v)))
        want = torch.cat([p(x).chunk(2, dim=-1)[rank] for p in (q, k, v)], dim=-1)
        torch.testing.assert_close(merged(x), want, atol=1e-6, rtol=0)


def test_merge_rejects_mixed_biases():
    with pytest.raises(ValueError, match="all or no biases"):
        merge_linears(nn.Linear(4, 2), nn.Linear(4, 2, bias=False))
