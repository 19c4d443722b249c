"""The sampler's penalties and logprobs (vLLM semantics), on hand-made logits."""

import collections
import math

import pytest
import torch

from latentserve.core import Req
from latentserve.sampling import apply_penalties, sample_with_logprobs
from latentserve.sampling_params import SamplingParams


def _req(prompt, output, **params):
    req = Req("r", list(prompt), SamplingParams(**params))
    req.output_ids = list(output)
    return req


def test_penalties_follow_vllms_formula():
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, 1.0]])
    req = _req([0], [2, 2, 3], repetition_penalty=2.0, frequency_penalty=0.5,
               presence_penalty=0.25)
    # 0: prompt, 2 / 2;  1: unseen;  2: 0.5 / 2 - 0.5 * 2 - 0.25;  3: 3 / 2 - 0.5 - 0.25
    assert apply_penalties(logits, [req]).tolist() == [[1.0, -1.0, -1.0, 0.75, 1.0]]


def test_repetition_penalty_multiplies_negative_logits():
    out = apply_penalties(torch.tensor([[-1.0, 0.0, 1.0]]),
                          [_req([0, 1], [], repetition_penalty=3.0)])
    assert out.tolist() == [[-3.0, 0.0, 1.0]]


def test_penalties_change_a_greedy_pick_and_leave_the_input_alone():
    logits = torch.tensor([[1.0, 0.75, 0.0], [1.0, 0.75, 0.0]])
    penalized = _req([5], [0], temperature=0, presence_penalty=0.5)
    plain = _req([5], [0], temperature=0)
    res = sample_with_logprobs(logits, [penalized, plain])
    assert res.tokens.tolist() == [1, 0]
    assert logits.tolist() == [[1.0, 0.75, 0.0], [1.0, 0.75, 0.0]]


def test_precomputed_greedy_tokens_are_used_and_never_written():
    """``greedy`` (a decode graph's argmax of the same logits) is what greedy rows take; a
    sampled row goes into a copy, so the caller's tensor (a static graph buffer) keeps its
    values; a penalized batch recomputes from the penalized logits."""
    logits = torch.tensor([[0.0, 5.0, 1.5], [0.0, 0.0, 9.0]])
    greedy = torch.tensor([1, 2])
    plain = _req([5], [0], temperature=0)
    res = sample_with_logprobs(logits, [plain, plain], greedy=greedy)
    assert res.tokens is greedy  # no copy, no argmax launched
    seeded = _req([5], [0], temperature=1.0, seed=3)
    res = sample_with_logprobs(logits, [plain, seeded], greedy=greedy)
    assert res.tokens[0] == 1 and greedy.tolist() == [1, 2]
    assert res.tokens.data_ptr() != greedy.data_ptr()
    penalized = _req([5], [1], temperature=0, presence_penalty=2.0, frequency_penalty=2.0)
    wrong = torch.tensor([0, 0])  # recomputed from the penalized logits, so never read
    res = sample_with_logprobs(logits, [penalized, plain], greedy=wrong)
    assert res.tokens.tolist() == [2, 2]  # 5 - 2 - 2 < 1.5: the penalties moved row 0


def test_logprobs_are_raw_log_softmax_with_top_k_and_rank():
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0]])
    req = _req([0], [1], temperature=0, logprobs=2, repetition_penalty=100.0)
    res = sample_with_logprobs(logits, [req])
    lsm = torch.log_softmax(logits, -1)[0].tolist()
    lp = res.logprobs[0]
    assert lp.token_id == res.tokens.item() == 2  # token 1 is penalized away
    assert lp.logprob == pytest.approx(lsm[2]) and lp.rank == 2
    assert [t for t, _ in lp.top] == [1, 2]
    assert [v for _, v in lp.top] == pytest.approx([lsm[1], lsm[2]])


def test_logprobs_zero_reports_only_the_sampled_token_and_none_without_asking():
    logits = torch.tensor([[0.0, 1.0], [1.0, 0.0]])
    res = sample_with_logprobs(logits, [_req([0], [], temperature=0, logprobs=0),
                                        _req([0], [], temperature=0)])
    assert res.logprobs[0].top == [] and res.logprobs[0].logprob == pytest.approx(
        -math.log(1 + math.exp(-1)))
    assert res.logprobs[1] is None


def test_tiny_temperature_is_greedy_not_nan():
    logits = torch.tensor([[0.0, 50.0, 49.0]])
    res = sample_with_logprobs(logits, [_req([0], [], temperature=1e-9)])
    assert res.tokens.tolist() == [1]


def test_seeded_sampling_with_penalties_is_reproducible():
    logits = torch.randn(1, 100, generator=torch.Generator().manual_seed(0))

    def draws():
        req = _req([1, 2], [3], temperature=1.0, seed=5, frequency_penalty=1.0)
        req.generator = torch.Generator().manual_seed(5)
        return [sample_with_logprobs(logits, [req]).tokens.item() for _ in range(8)]

    first = draws()
    assert first == draws() and len(set(first)) > 1


@pytest.mark.parametrize("field,value", [
    ("presence_penalty", 2.5), ("frequency_penalty", -3.0), ("repetition_penalty", 0.0),
    ("logprobs", -1), ("temperature", float("nan")),
])
def test_out_of_range_sampling_fields_are_refused_by_name(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_top_p_that_float32_flushes_to_zero_keeps_the_most_likely_token():
    """top_p 1e-50 is in vLLM's (0, 1] but is 0 in float32: it dropped every token (NaN
    probabilities, "sampling failed"); the most likely token is always kept."""
    logits = torch.tensor([[0.0, 5.0, 1.0, 3.0]])
    for seed in range(5):
        req = _req([0], [], temperature=1.0, top_p=1e-50, seed=seed)
        req.generator = torch.Generator().manual_seed(seed)
        assert sample_with_logprobs(logits, [req]).tokens.tolist() == [1]


@pytest.mark.parametrize("field,value,words", [
    ("repetition_penalty", 1e-40, ["1.1754943508222875e-38", "1e-40"]),
    ("repetition_penalty", 1e39, ["3.4028234663852886e+38", "1e+39"]),
    ("temperature", 1e39, ["3.4028234663852886e+38", "1e+39"]),
])
def test_values_float32_cannot_represent_are_refused_by_name(field, value, words):
    with pytest.raises(ValueError, match=field) as info:
        SamplingParams(**{field: value})
    for word in words:
        assert word in str(info.value)


def test_tiny_repetition_penalty_keeps_logits_finite():
    """A penalty in float32's range can still overflow a seen logit (50 / 1e-37): held at
    float32's largest, the seen tokens win and sampling never meets inf - inf = NaN."""
    logits = torch.tensor([[50.0, 60.0, 1.0, 70.0]])
    req = _req([0, 1], [], temperature=1.0, repetition_penalty=1e-37, seed=0)
    req.generator = torch.Generator().manual_seed(0)
    penalized = apply_penalties(logits, [req])
    assert torch.isfinite(penalized).all()
    assert sample_with_logprobs(logits, [req]).tokens.item() in (0, 1)


def _ops(logits, reqs):
    """``aten`` op name -> calls made by one :func:`sample_with_logprobs` of ``reqs``."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        sample_with_logprobs(logits, reqs, torch.Generator().manual_seed(0))
    return collections.Counter(e.name for e in prof.events() if e.name.startswith("aten::"))


def test_unseeded_rows_are_sampled_by_one_draw_whatever_the_batch_size():
    """vLLM's sampler: one exponential race for the whole batch, no per-row multinomial
    (each a launch, an index write and a host sync on CUDA)."""
    counts = [_ops(torch.randn(b, 50), [_req([0], [], temperature=0.8, top_k=20)] * b)
              for b in (2, 64)]
    assert counts[0] == counts[1]
    assert counts[0]["aten::exponential_"] == 1 and "aten::multinomial" not in counts[0]
    assert "aten::item" not in counts[0] and "aten::_local_scalar_dense" not in counts[0]


def test_a_seeded_row_draws_the_same_tokens_alone_and_in_any_batch():
    logits = torch.randn(6, 300, generator=torch.Generator().manual_seed(1))

    def stream(rows, seeds):
        reqs = []
        for s in seeds:
            reqs.append(_req([0], [], temperature=0.9 if s is None or s > 0 else 0.0,
                             top_p=0.95, seed=s))
            reqs[-1].generator = None if s is None else torch.Generator().manual_seed(s)
        return [sample_with_logprobs(logits[rows], reqs).tokens.tolist() for _ in range(6)]

    alone = stream([3], [7])
    mixed = stream([0, 3, 1, 2, 4], [None, 7, 0, 11, None])  # unseeded, greedy, other seeds
    assert [t[1] for t in mixed] == [t[0] for t in alone] and len({t[0] for t in alone}) > 1
    assert [t[3] for t in mixed] == [t[0] for t in stream([2], [11])]


def test_a_batched_row_follows_its_probabilities():
    """10000 unseeded rows of one distribution in one call: a chi-square test on the counts
    (4 degrees of freedom, 99.99% quantile 23.5); the zero-probability token is never drawn."""
    probs = torch.tensor([0.1, 0.2, 0.3, 0.25, 0.15, 0.0])
    n = 10000
    reqs = [_req([0], [], temperature=1.0)] * n
    tokens = sample_with_logprobs(probs.log().expand(n, -1), reqs,
                                  torch.Generator().manual_seed(0)).tokens
    counts = torch.bincount(tokens, minlength=6).double()
    expected = probs.double() * n
    assert counts[5] == 0
    assert ((counts[:5] - expected[:5]) ** 2 / expected[:5]).sum() < 23.5
