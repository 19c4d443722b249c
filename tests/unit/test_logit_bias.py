"""``SamplingParams.logit_bias`` (OpenAI's and vLLM's): the sampler's :class:`LogitBias`
(``logit_bias.py``), and offline on a tiny Llama with SmolLM2's tokenizer: forced and banned
tokens, unbiased rows of a mixed batch left exact, overlap scheduling, the latent phase."""

import pytest
import torch

from latentserve.core import Req
from latentserve.logit_bias import batch_logit_bias
from latentserve.sampling import sample_with_logprobs
from latentserve.sampling_params import SamplingParams
from latentserve.staging import HostToDevice

VOCAB = 100


def _req(**kw):
    return Req("r", [1, 2], SamplingParams(**kw))


def test_only_the_biased_logits_move_and_logprobs_stay_raw():
    torch.manual_seed(0)
    logits = torch.randn(3, VOCAB)
    free = logits.argmax(-1)
    reqs = [_req(temperature=0, logprobs=1),
            _req(temperature=0, logprobs=1, logit_bias={7: 100.0, int(free[1]): -100.0}),
            _req(temperature=0, logprobs=1)]
    bias = batch_logit_bias(reqs, HostToDevice("cpu"))
    assert bias.rows.tolist() == [1, 1] and bias.ids.tolist() == [7, int(free[1])]
    out = sample_with_logprobs(logits, reqs, greedy=free, bias=bias)  # a graph's argmax
    plain = sample_with_logprobs(logits, reqs, greedy=free)
    assert out.tokens.tolist() == [free[0], 7, free[2]]
    raw = torch.log_softmax(logits[1], -1)[7].item()
    assert out.logprobs[1].logprob == pytest.approx(raw, abs=1e-6)
    for b in (0, 2):
        assert out.logprobs[b] == plain.logprobs[b]


def test_the_bias_comes_after_the_mask_and_before_the_penalties():
    from latentserve.sampling import TokenMask
    from latentserve.token_masks import ids_bitmask

    logits = torch.zeros(1, VOCAB)
    logits[0, 5] = 1.0
    masked = _req(temperature=0, logit_bias={9: 100.0})
    mask = TokenMask([0], torch.from_numpy(ids_bitmask([5, 6], VOCAB))[None])
    bias = batch_logit_bias([masked], HostToDevice("cpu"))
    assert sample_with_logprobs(logits, [masked], mask=mask, bias=bias).tokens.item() == 5
    # repetition 2 on the seen token 9 halves its biased logit (10 -> 5 < 6): after the bias
    pen = _req(temperature=0, repetition_penalty=2.0, logit_bias={9: 10.0, 4: 6.0})
    pen.prompt_ids = [9]
    bias = batch_logit_bias([pen], HostToDevice("cpu"))
    assert sample_with_logprobs(torch.zeros(1, VOCAB), [pen], bias=bias).tokens.item() == 4


def test_latent_phase_rows_get_a_bias_only_where_their_token_may_be_the_answers():
    closed, open_ = _req(logit_bias={3: 1.0}), _req(logit_bias={4: 2.0})
    closed.answer_start = open_.answer_start = None
    closed.forced_close = True  # closing ids follow the phase: its tokens are never kept
    assert batch_logit_bias([closed], HostToDevice("cpu")) is None
    # no closing ids: the step ending the phase samples the answer's first token
    bias = batch_logit_bias([closed, open_], HostToDevice("cpu"))
    assert (bias.rows.tolist(), bias.ids.tolist(), bias.values.tolist()) == ([1], [4], [2.0])


@pytest.mark.parametrize("bias,msg", [
    ({5: 100.5}, r"^logit_bias must be in \[-100.0, 100.0\], got 100.5$"),
    ({5: -101}, r"^logit_bias must be in \[-100.0, 100.0\]"),
    ({5: float("inf")}, r"^logit_bias must be a finite number"),
    ({5: "1"}, r"^logit_bias must be a number"),
    ({-1: 1.0}, r"^logit_bias keys must be token ids"),
    ({"5": 1.0}, r"^logit_bias keys must be token ids"),
    ([5], r"^logit_bias must be a dict"),
])
def test_sampling_params_validate_logit_bias(bias, msg):
    with pytest.raises(ValueError, match=msg):
        SamplingParams(logit_bias=bias)


def test_numpy_keys_and_values_are_plain_numbers():
    import numpy as np

    p = SamplingParams(logit_bias={np.int64(3): np.float32(-2.5), 4: 1})
    assert p.logit_bias == {3: -2.5, 4: 1.0} and all(type(k) is int for k in p.logit_bias)
    assert not SamplingParams(logit_bias={}).has_logit_bias


# --- offline, on a tiny Llama with SmolLM2's tokenizer --------------------------------------


@pytest.fixture(scope="module")
def llm(tiny_dirs):
    from latentserve import LLM

    # no prefix cache: a cached prompt prefill would change the next run's CPU numerics
    return LLM(str(tiny_dirs["llama"]), max_num_seqs=8, enable_prefix_caching=False)


PROMPTS = ["The capital of France is", "Once upon a time", "1, 2, 3,"]


def _gen(llm, prompts, params):
    return [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]


def _greedy(**kw):
    return SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, **kw)


def test_plus_100_makes_greedy_and_sampling_pick_the_id(llm):
    for params in (_greedy(logit_bias={257: 100.0}),
                   SamplingParams(max_tokens=10, temperature=1.0, seed=3, ignore_eos=True,
                                  logit_bias={257: 100.0}),
                   SamplingParams(max_tokens=10, temperature=1.0, ignore_eos=True,
                                  logit_bias={257: 100.0})):
        for o in _gen(llm, PROMPTS, params):
            assert o.token_ids == [257] * 10


def test_minus_100_on_the_greedy_token_changes_it(llm):
    free = _gen(llm, PROMPTS[:1], _greedy())[0].token_ids
    out = _gen(llm, PROMPTS[:1], _greedy(logit_bias={free[0]: -100.0}))[0].token_ids
    assert out[0] != free[0] and free[0] not in out


def test_unbiased_rows_of_a_mixed_batch_are_exact(llm):
    """The plain rows equal those of the same batch with no bias at all (a CPU forward's
    logprobs depend on the batch's size, so the control batch keeps its shape)."""
    plain = _greedy(logprobs=3)
    prompts = [PROMPTS[0], "Hi", PROMPTS[1], "Yo", PROMPTS[2]]
    seeded = dict(max_tokens=10, temperature=1.0, seed=1, ignore_eos=True)
    control = _gen(llm, prompts, [plain, plain, plain, SamplingParams(**seeded), plain])
    mixed = _gen(llm, prompts, [plain, _greedy(logprobs=3, logit_bias={11: 100.0}), plain,
                                SamplingParams(**seeded, logit_bias={11: -100.0, 257: 5.0}),
                                plain])
    assert [o.token_ids for o in mixed[::2]] == [o.token_ids for o in control[::2]]
    assert [o.logprobs for o in mixed[::2]] == [o.logprobs for o in control[::2]]
    assert [o.token_ids for o in _gen(llm, PROMPTS, _greedy())] == [
        o.token_ids for o in mixed[::2]]
    assert mixed[1].token_ids == [11] * 10
    assert 11 not in mixed[3].token_ids


def test_an_id_outside_the_vocabulary_is_refused(llm):
    with pytest.raises(ValueError, match=r"^logit_bias must be in \[0, 49152\), got 49152$"):
        _gen(llm, PROMPTS[:1], _greedy(logit_bias={5: 1.0, 49152: 1.0}))
    assert not llm.engine.has_unfinished_requests()


def test_finished_requests_leave_the_engine_unbiased(llm):
    _gen(llm, PROMPTS, _greedy(logit_bias={11: 1.0}))
    assert not llm.engine._biased


def test_overlap_scheduling_gives_the_synchronous_outputs(tiny_dirs):
    from tests.support.overlap_runs import sync_and_overlapped

    params = [SamplingParams(max_tokens=8, temperature=0, ignore_eos=True),
              SamplingParams(max_tokens=8, temperature=0, ignore_eos=True,
                             logit_bias={257: 100.0}),
              SamplingParams(max_tokens=8, temperature=1.0, seed=2, ignore_eos=True,
                             logit_bias={11: 3.0, 1000: -100.0}),
              SamplingParams(max_tokens=8, temperature=0, ignore_eos=True,
                             logit_bias={11: 4.0}, allowed_token_ids=[11, 12, 13])]
    prompts = [[1 + i, 50 + i, 700 + i] for i in range(len(params))]
    results = sync_and_overlapped(tiny_dirs["llama"], prompts, params)
    assert results[0] == results[1]
    assert results[0]["r1"] == [257] * 8 and set(results[0]["r3"]) == {11}


def test_the_bias_covers_the_answer_not_the_latent_phase(tmp_path):
    """A COCONUT model takes its latent steps as without a bias, then answers the biased id."""
    from latentserve import LLM
    from latentserve.bench.baseline.latent_models import save_latent_tiny

    llm = LLM(str(save_latent_tiny(tmp_path, "coconut-llama")), max_num_seqs=4)
    base = {"max_tokens": 6, "temperature": 0, "latent_budget": 3, "ignore_eos": True}
    free = _gen(llm, PROMPTS[:2], SamplingParams(**base))
    biased = _gen(llm, PROMPTS[:2], SamplingParams(**base, logit_bias={257: 100.0}))
    for f, b in zip(free, biased):
        assert b.latent_steps == f.latent_steps == 3
        assert set(b.token_ids) == {257}
