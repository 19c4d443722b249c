"""The sampler's fused path (``sampling._gumbel_tokens``: unseeded rows without top-k, top-p
or min-p race in ``ops.kernels.gumbel`` on CUDA), run on CPU through the Triton interpreter:
which rows take it, greedy rows beside it, token masks before it, per-row temperatures, and
the engine seed making it reproducible."""

import os

os.environ["TRITON_INTERPRET"] = "1"  # before anything imports triton or the kernels

import pytest

pytest.importorskip("triton")

import torch

from latentserve import sampling
from latentserve.core import Req
from latentserve.sampling import TokenMask, sample_with_logprobs
from latentserve.sampling_params import SamplingParams
from latentserve.token_masks import bitmask_width
from tests.support.triton_interpreter import patch_triton_interpreter

patch_triton_interpreter()


@pytest.fixture
def races(monkeypatch):
    """The fused path on for CPU logits; the row counts of its calls."""
    calls: list[int] = []
    real = sampling._gumbel_tokens

    def spy(logits, params, bits=None):
        calls.append(len(params))
        return real(logits, params, bits)

    monkeypatch.setattr(sampling, "_races_on", lambda logits: True)
    monkeypatch.setattr(sampling, "_gumbel_tokens", spy)
    return calls


def _reqs(*params):
    reqs = []
    for i, p in enumerate(params):
        req = Req(f"r{i}", [1], SamplingParams(**p))
        if p.get("seed") is not None:
            req.generator = torch.Generator().manual_seed(p["seed"])
        reqs.append(req)
    return reqs


def test_unseeded_rows_race_and_greedy_rows_keep_their_argmax(races):
    logits = torch.randn(5, 40, generator=torch.Generator().manual_seed(0))
    reqs = _reqs({"temperature": 0}, {"temperature": 0.7}, {"temperature": 0},
                 {"temperature": 0.7}, {"temperature": 1.3})
    torch.manual_seed(1)
    a = sample_with_logprobs(logits, reqs).tokens
    assert races == [3]  # the three sampled rows, per-row temperatures in one launch
    assert a[0] == logits[0].argmax() and a[2] == logits[2].argmax()
    torch.manual_seed(1)  # the engine's seed: the same draws
    assert torch.equal(sample_with_logprobs(logits, reqs).tokens, a)


def test_a_token_mask_applies_before_the_race(races):
    logits = torch.randn(3, 70, generator=torch.Generator().manual_seed(2))
    bits = torch.zeros(1, bitmask_width(70), dtype=torch.int32)
    bits[0, 1] = (1 << 3) | (1 << 9)  # ids 35 and 41 only
    mask = TokenMask([1], bits)
    reqs = _reqs(*[{"temperature": 1.0}] * 3)
    drawn = {int(sample_with_logprobs(logits, reqs, mask=mask).tokens[1]) for _ in range(12)}
    assert drawn <= {35, 41} and races == [3] * 12


def test_a_mask_of_every_row_is_applied_in_the_race(races, monkeypatch):
    """Every row masked and sampled: the race reads the bits itself (no masked copy of the
    logits) and draws the tokens the masked copy would give under the same engine seed;
    columns past the mask's words are never drawn."""
    from latentserve.sampling import apply_token_mask

    logits = torch.randn(4, 70, generator=torch.Generator().manual_seed(5))
    bits = torch.zeros(4, bitmask_width(70), dtype=torch.int32)
    bits[:, 1] = (1 << 3) | (1 << 9)  # ids 35 and 41
    bits[2, 0] = -1  # row 2: ids 0-31 too (bit 31 is the sign bit)
    mask = TokenMask([0, 1, 2, 3], bits)
    reqs = _reqs(*[{"temperature": t} for t in (1.0, 0.5, 1.0, 2.0)])
    copies = []
    real_apply = sampling.apply_token_mask
    monkeypatch.setattr(sampling, "apply_token_mask",
                        lambda *a: copies.append(1) or real_apply(*a))
    for seed in range(6):
        torch.manual_seed(seed)
        got = sample_with_logprobs(logits, reqs, mask=mask).tokens
        torch.manual_seed(seed)
        want = sample_with_logprobs(apply_token_mask(logits, mask), reqs).tokens
        assert torch.equal(got, want)
        assert set(got[[0, 1, 3]].tolist()) <= {35, 41} and int(got[2]) in {*range(32), 35, 41}
    assert copies == []  # the masked path never copied (the reference calls its own import)
    wide = torch.zeros(2, 70)  # 70 columns, a mask of one word: ids 32-69 disallowed
    one_word = TokenMask([0, 1], torch.full((2, 1), 1 << 5, dtype=torch.int32))
    assert sample_with_logprobs(wide, _reqs({"temperature": 1.0}, {"temperature": 1.0}),
                                mask=one_word).tokens.tolist() == [5, 5]


def test_a_mask_of_every_greedy_row_is_applied_in_the_argmax(races, monkeypatch):
    """Every row masked and greedy: the argmax kernel reads the bits (no masked copy) and
    gives the masked copy's argmax, the graph's unmasked argmax ignored; a mask of some rows
    keeps the masked copy."""
    logits = torch.randn(4, 70, generator=torch.Generator().manual_seed(6))
    bits = torch.zeros(4, bitmask_width(70), dtype=torch.int32)
    bits[:, 1] = (1 << 3) | (1 << 9)  # ids 35 and 41
    bits[2, 0] = -1
    bits[3] = 0  # nothing allowed: index 0, as torch's argmax of an all -inf row
    copies = []
    real_apply = sampling.apply_token_mask
    monkeypatch.setattr(sampling, "apply_token_mask",
                        lambda *a: copies.append(1) or real_apply(*a))
    reqs = _reqs(*[{"temperature": 0}] * 4)
    want = real_apply(logits, TokenMask([0, 1, 2, 3], bits)).argmax(dim=-1)
    got = sample_with_logprobs(logits, reqs, greedy=logits.argmax(dim=-1),
                               mask=TokenMask([0, 1, 2, 3], bits)).tokens
    assert torch.equal(got, want) and copies == [] and races == []
    some = sample_with_logprobs(logits, reqs, mask=TokenMask([1, 3], bits[[1, 3]])).tokens
    assert copies == [1] and some[[1, 3]].tolist() == want[[1, 3]].tolist()
    assert some[[0, 2]].tolist() == logits[[0, 2]].argmax(dim=-1).tolist()


@pytest.mark.parametrize("params", [{"top_p": 0.9}, {"top_k": 5}, {"min_p": 0.1},
                                    {"seed": 3}])
def test_filters_and_seeds_keep_the_torch_path(races, params):
    logits = torch.randn(2, 30, generator=torch.Generator().manual_seed(3))
    reqs = _reqs({"temperature": 1.0}, {"temperature": 1.0, **params})
    sample_with_logprobs(logits, reqs)
    assert races == []


def test_a_top_k_as_large_as_the_vocabulary_filters_nothing_and_races(races):
    logits = torch.randn(2, 30, generator=torch.Generator().manual_seed(4))
    sample_with_logprobs(logits, _reqs({"temperature": 1.0, "top_k": 30},
                                       {"temperature": 1.0}))
    assert races == [2]


def test_without_the_device_the_torch_path_runs(monkeypatch):
    called = []
    monkeypatch.setattr(sampling, "_gumbel_tokens", lambda *a: called.append(1))
    sample_with_logprobs(torch.zeros(2, 8), _reqs({"temperature": 1.0}, {"temperature": 1.0}))
    assert called == []


def test_warm_race_runs_every_kernel_variant(races):
    sampling.warm_race(40, "cpu")
    assert races == [2, 2, 2, 2]  # one temperature, one per row; without, then with a mask
