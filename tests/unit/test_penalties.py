"""``penalties.PenaltyCounts`` against a row-by-row reading of vLLM's rules over many steps:
answers that grow by host-known tokens and by the token still on the device (overlap mode),
requests without penalties in the batch, rows given back and taken by new requests (their
prompts replace the old ones), more requests than the first 8 rows, an answer that shrinks
(counted again), a latent phase before the answer (its rows penalized only where their
token may be the answer's first: ``Req.samples_answer``); and the Triton kernels (through the
interpreter) against the torch path."""

import os

os.environ["TRITON_INTERPRET"] = "1"  # before anything imports triton or the kernels

import random

import pytest
import torch

from latentserve.core import Req
from latentserve.penalties import PenaltyCounts, apply_penalties, penalize_reference
from latentserve.sampling_params import SamplingParams
from latentserve.scheduler.scheduler import PENDING_ID

VOCAB = 300


def _reference(logits: torch.Tensor, reqs, answers) -> torch.Tensor:
    """Row by row: repetition on the prompt and answer, then frequency and presence on the
    answer (vLLM's ``apply_penalties``)."""
    out = logits.clone()
    for i, (r, answer) in enumerate(zip(reqs, answers)):
        if r.answer_start is None and r.forced_close:
            continue  # a latent step's token, dropped or deciding the phase: no penalty
        p, counts = r.params, torch.zeros(VOCAB)
        for t in answer:
            counts[t] += 1
        if p.repetition_penalty != 1.0:
            seen = counts > 0
            seen[r.prompt_ids] = True
            x = out[i]
            out[i] = torch.where(seen, torch.where(x > 0, x / p.repetition_penalty,
                                                   x * p.repetition_penalty), x)
        out[i] -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).float()
    return out


def _params(rng: random.Random) -> SamplingParams:
    return SamplingParams(presence_penalty=rng.choice([0.0, 0.5, -1.5]),
                          frequency_penalty=rng.choice([0.0, 1.0]),
                          repetition_penalty=rng.choice([1.0, 1.3, 0.7]))


def _new_req(rng: random.Random, rid: str) -> Req:
    req = Req(rid, [rng.randrange(VOCAB) for _ in range(rng.randint(1, 10))], _params(rng))
    if rng.random() < 0.3:  # a latent phase first: two latent ids, then the answer
        req.output_ids, req.answer_start = [7, 7], None
        # closing ids forced after the phase (no latent row penalized), or none (each
        # latent row is, as the one ending the phase samples the answer's first token)
        req.forced_close = rng.random() < 0.5
    else:
        req.answer_start = 0
    return req


@pytest.mark.parametrize("seed", range(6))
def test_counts_over_steps_equal_a_recount(seed):
    """30 steps of a changing batch: each step some requests gain a known token, some a
    pending one (``PENDING_ID`` in ``output_ids``, its token on the device), some finish
    (``release``) and new ones arrive; :meth:`apply` equals the reference on the answers as
    they will read; a request without penalties in each batch is left as it is."""
    rng = random.Random(seed)
    state = PenaltyCounts(VOCAB, "cpu")
    live: list[Req] = []
    truth: dict[str, int | None] = {}  # rid -> the token its PENDING_ID stands for
    n_made = 0
    for step in range(30):
        for r in [r for r in live if rng.random() < 0.1]:  # finished
            live.remove(r)
            state.release(r.rid)
        while len(live) < rng.randint(1, 14):
            live.append(_new_req(rng, f"r{n_made}"))
            n_made += 1
        for r in live:  # the last step's pending token, now known on the host
            if truth.get(r.rid) is not None:
                r.output_ids[-1] = truth[r.rid]
            truth[r.rid] = None
        for r in live:
            if r.answer_start is None and rng.random() < 0.3:
                r.answer_start = len(r.output_ids)  # the latent phase ended
        batch = [r for r in live if rng.random() < 0.9]
        shrunk = set()
        for r in batch:
            if r.answer_start is not None and r.output_ids[r.answer_start:] and \
                    rng.random() < 0.05:
                del r.output_ids[-1]  # taken back (it gains nothing this step)
                shrunk.add(r.rid)
        tokens, src, slots = [], {}, []
        for r in (r for r in batch if r.rid not in shrunk):
            if rng.random() < 0.5:  # a known token
                r.output_ids.append(rng.randrange(VOCAB))
            if r.answer_start is not None and rng.random() < 0.6:  # one still on the device
                src[id(r)] = len(tokens)
                slots.append((r, len(r.output_ids)))
                truth[r.rid] = rng.randrange(VOCAB)
                tokens.append(truth[r.rid])
                r.output_ids.append(PENDING_ID)
        plain = _new_req(rng, "plain")  # no penalties: not counted, its row copied
        plain.params = SamplingParams()
        batch.insert(rng.randint(0, len(batch)), plain)
        state.count(batch, src, slots, torch.tensor(tokens, dtype=torch.int64))
        answers = [[truth[r.rid] if t == PENDING_ID else t
                    for t in r.output_ids[r.answer_start:]] if r.answer_start is not None
                   else [] for r in batch]
        logits = torch.randn(len(batch), VOCAB) * 3
        got = state.apply(logits, batch)
        torch.testing.assert_close(got, _reference(logits, batch, answers), msg=f"step {step}")
    assert n_made > 8  # the rows grew past their first 8


def test_a_request_never_counted_is_refused():
    state = PenaltyCounts(VOCAB, "cpu")
    req = _new_req(random.Random(0), "x")
    req.params = SamplingParams(presence_penalty=1.0)
    with pytest.raises(RuntimeError, match="never counted"):
        state.apply(torch.zeros(1, VOCAB), [req])


def test_stateless_apply_counts_whole_answers():
    rng = random.Random(1)
    reqs = [_new_req(rng, "same") for _ in range(5)]  # one rid for all: counted by identity
    for r in reqs:
        r.answer_start = 0
        r.output_ids = [rng.randrange(VOCAB) for _ in range(rng.randint(0, 12))]
    logits = torch.randn(5, VOCAB)
    want = _reference(logits, reqs, [r.output_ids for r in reqs])
    torch.testing.assert_close(apply_penalties(logits, reqs), want)


@pytest.mark.parametrize("seed", range(3))
def test_kernels_equal_the_torch_path(seed):
    """``ops.kernels.penalties`` (interpreted): ``count_tokens`` adds host ids and device
    tokens like ``index_put_``; ``penalize`` equals ``penalize_reference`` (rows of -1
    copied), over chunks cut short."""
    from latentserve.ops.kernels import penalties as k

    g = torch.Generator().manual_seed(seed)
    rows, vocab = 5, 4100  # three chunks of 2048, the last cut short
    counts = torch.randint(0, 3, (rows, vocab), generator=g, dtype=torch.int32)
    want = counts.clone()
    tokens = torch.randint(0, vocab, (7,), generator=g)
    base = torch.randint(0, rows, (20,), generator=g) * vocab
    vals = torch.where(torch.rand(20, generator=g) < 0.5,
                       torch.randint(0, vocab, (20,), generator=g),
                       -1 - torch.randint(0, 7, (20,), generator=g))
    k.count_tokens(counts, torch.cat([base, vals]), tokens)
    ids = torch.where(vals >= 0, vals, tokens[(-1 - vals).clamp(min=0)])
    want.view(-1).index_put_((base + ids,), torch.ones(20, dtype=torch.int32), accumulate=True)
    assert torch.equal(counts, want)
    prompt = torch.rand(rows, vocab, generator=g) < 0.1
    logits = torch.randn(6, vocab, generator=g) * 5
    logits[0, :3] = torch.tensor([3e38, -3e38, float("-inf")])
    r = torch.tensor([0, 4, -1, 2, 2, 1])
    params = torch.tensor([1.0, 0.5, 1.3, 1.0, 1e-30, 2.0,  # repetition
                           0.0, 1.0, 0.5, -2.0, 0.0, 1.5,  # frequency
                           0.5, 0.0, -1.0, 2.0, 0.0, 1.0], dtype=torch.float64)
    got = k.penalize(logits, counts, prompt, r, params)
    torch.testing.assert_close(got, penalize_reference(logits, counts, prompt, r, params),
                               rtol=0, atol=0)
    assert torch.equal(got[2], logits[2])


def test_a_steady_batch_sends_nothing_after_its_first_step():
    """The same requests each gaining one token still on the device, step after step: the
    counts' entries and the rows' penalties go to the device once, and the penalties stay
    right."""
    rng = random.Random(3)
    reqs = [_new_req(rng, f"s{i}") for i in range(6)]
    for r in reqs:
        r.answer_start, r.output_ids = 0, []
        r.params = SamplingParams(frequency_penalty=1.0, repetition_penalty=1.3)
    state = PenaltyCounts(VOCAB, "cpu")
    sent = []
    copy = state._copies.copy
    state._copies.copy = lambda values: sent.append(len(values)) or copy(values)
    answers = [[] for _ in reqs]
    for _ in range(5):
        toks = [rng.randrange(VOCAB) for _ in reqs]
        for r in reqs:  # last step's token known, this one's pending
            if r.output_ids:
                r.output_ids[-1] = answers[reqs.index(r)][-1]
        src = {id(r): j for j, r in enumerate(reqs)}
        slots = [(r, len(r.output_ids)) for r in reqs]
        for r, a, t in zip(reqs, answers, toks):
            r.output_ids.append(PENDING_ID)
            a.append(t)
        state.count(reqs, src, slots, torch.tensor(toks))
        logits = torch.randn(len(reqs), VOCAB)
        torch.testing.assert_close(state.apply(logits, reqs), _reference(logits, reqs, answers))
    assert len(sent) == 3  # the first count (new rows, prompts), the rows' penalties, then
    # one count whose entries (row, j) every later step repeats


def test_a_count_that_raises_counts_nothing_and_can_be_made_again():
    """Eight rows in use, each answer gaining a token; a ninth request needs the tensors to
    grow, which raises once: nothing of that call is counted (no row advanced, no row kept
    uncleared), and the call made again counts everything once."""
    rng = random.Random(4)
    state = PenaltyCounts(VOCAB, "cpu")
    reqs = [_new_req(rng, f"a{i}") for i in range(8)]
    for r in reqs:
        r.answer_start, r.output_ids = 0, [5]
        r.params = SamplingParams(frequency_penalty=1.0)
    state.count(reqs)
    for r in reqs:
        r.output_ids.append(5)
    late = _new_req(rng, "late")
    late.answer_start, late.output_ids = 0, [9]
    late.params = SamplingParams(presence_penalty=0.5, repetition_penalty=1.3)
    grow = state._grow

    def fail(rows):
        state._grow = grow
        raise RuntimeError("out of memory")

    state._grow = fail
    with pytest.raises(RuntimeError, match="out of memory"):
        state.count(reqs + [late])
    assert len(state) == 8
    state.count(reqs + [late])
    logits = torch.randn(9, VOCAB)
    torch.testing.assert_close(state.apply(logits, reqs + [late]),
                               _reference(logits, reqs + [late],
                                          [r.output_ids for r in reqs + [late]]))


@pytest.mark.parametrize("dtype,rep", [(torch.float16, 1e-5), (torch.bfloat16, 1e-35)])
def test_half_precision_logits_stay_finite(dtype, rep):
    """A tiny repetition penalty scales a seen positive logit past the dtype's range: it is
    held at its largest value (never inf, whose softmax is NaN), in torch and in the kernel;
    a seen negative one goes towards 0."""
    from latentserve.ops.kernels.penalties import penalize

    req = Req("h", [0, 1], SamplingParams(repetition_penalty=rep))
    req.answer_start, req.output_ids = 0, []
    logits = torch.tensor([[1e4, -9.0, 0.0] + [0.0] * (VOCAB - 3)], dtype=dtype)
    out = apply_penalties(logits, [req])
    assert out.dtype == dtype and out[0, 0] == torch.finfo(dtype).max
    assert torch.isfinite(out).all() and -9.0 < out[0, 1] <= 0
    state = PenaltyCounts(VOCAB, "cpu")
    state.count([req])
    rows = torch.tensor([0])
    params = torch.tensor([rep, 0.0, 0.0], dtype=torch.float64)
    assert torch.equal(penalize(logits, state.counts, state.prompt, rows, params), out)
