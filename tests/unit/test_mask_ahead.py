"""Grammar rows filled ahead by a worker thread (``mask_ahead.MasksAhead``) are the rows the
step would fill itself (``token_masks.batch_bitmask``), with SmolLM2's tokenizer."""

import random

import numpy as np
import pytest
import torch

from latentserve.core import Req
from latentserve.mask_ahead import MasksAhead
from latentserve.sampling import unpack_bitmask
from latentserve.sampling_params import SamplingParams
from latentserve.scheduler.scheduler import PENDING_ID
from latentserve.token_masks import RequestMask, batch_bitmask
from tests.support.mask_hits import hits

pytest.importorskip("xgrammar")

VOCAB = 49152
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
                                           "n": {"type": "integer"}},
          "required": ["name", "n"]}
KINDS = [{"structured_outputs": {"json": SCHEMA}},
         {"structured_outputs": {"regex": "[a-z]{2,5}( [a-z]{2,5}){0,4}"}},
         {"structured_outputs": {"json": SCHEMA}, "min_tokens": 30},
         {"structured_outputs": {"regex": "[a-z ]+"}, "bad_words": ["the"]},
         {"allowed_token_ids": [11, 257, 1000]},
         {}]


@pytest.fixture(scope="module")
def grammars(smollm2_tokenizer):
    from latentserve.structured import Grammars

    return Grammars(smollm2_tokenizer, VOCAB, {smollm2_tokenizer.eos_token_id})


def _reqs(grammars, tok, kinds):
    """One request per entry of ``kinds`` (``SamplingParams`` fields), at its answer's start."""
    from latentserve.token_masks import bad_words_ids

    reqs = []
    for i, kw in enumerate(kinds):
        params = SamplingParams(max_tokens=64, **kw)
        r = Req(f"r{i}", [1, 2, 3], params)
        r.answer_start = 0
        if params.has_token_mask:
            so = params.structured_outputs
            r.constraint = RequestMask(
                params, VOCAB, {tok.eos_token_id},
                bad_words_ids(tok, params.bad_words) if params.bad_words else None,
                None if so is None else grammars.matcher(so))
        reqs.append(r)
    return reqs


def _pick(rng, rows, bits, b) -> int:
    """A token row ``b`` may take under the mask ``(rows, bits)`` (any token when unmasked)."""
    if b not in rows:
        return rng.randrange(VOCAB)
    allowed = unpack_bitmask(bits[rows.index(b) : rows.index(b) + 1], VOCAB)[0]
    return rng.choice(allowed.nonzero().flatten().tolist())


def _end_check(r, n):
    """``Scheduler._finish_reason``'s feeding of the grammar: the answer's first ``n`` ids."""
    if r.constraint is not None and r.constraint.matcher is not None:
        r.constraint.sync(r.output_ids, 0, n)


@pytest.mark.parametrize("overlapped", [True, False], ids=["overlapped", "synchronous"])
def test_rows_filled_ahead_are_the_rows_the_step_fills(grammars, smollm2_tokenizer,
                                                       overlapped):
    """Two copies of a mixed batch (grammars, grammars with ``min_tokens`` and ``bad_words``,
    a static mask, no mask) walk the same tokens; each step's bitmask built from the rows
    filled ahead equals the one filled in the step. Overlapped: the tokens arrive as pending
    ids (``overlap.py``); synchronous: already in ``output_ids`` (``LLMEngine.step``)."""
    tok = smollm2_tokenizer
    want, got = _reqs(grammars, tok, KINDS), _reqs(grammars, tok, KINDS)
    ahead = MasksAhead(VOCAB)
    rng = random.Random(0)
    used, prev = 0, None
    for step in range(40):
        known = None if prev is None else {id(r): (step - 1, t) for r, t in zip(got, prev)}
        ref = batch_bitmask(want, VOCAB)
        filled = ahead.take()
        mine = batch_bitmask(got, VOCAB, known, None, filled)
        used += hits(filled)
        assert ref[0] == mine[0] and torch.equal(ref[1], mine[1]), step
        toks = [_pick(rng, *ref, b) for b in range(len(want))]
        for r, t in zip(want, toks):
            r.output_ids.append(t)
            _end_check(r, step + 1)
        if not overlapped:
            for r, t in zip(got, toks):
                r.output_ids.append(t)
                _end_check(r, step + 1)
            ahead.start([(r, None) for r in got])
            continue
        for r, t in zip(got, prev or ()):  # finalize the batch before, then advance this one
            r.output_ids[step - 1] = t
            _end_check(r, step)
        for r in got:
            r.output_ids.append(PENDING_ID)
        ahead.start([(r, step) for r in got], torch.tensor(toks))
        prev = toks
    assert used > 0


def test_a_row_is_filled_again_when_its_matcher_took_a_token_since(grammars,
                                                                   smollm2_tokenizer):
    """A row filled ahead is not used once its request's grammar took another token: the
    step fills it from the matcher's state then."""
    tok = smollm2_tokenizer
    kinds = [{"structured_outputs": {"regex": "[0-9]{2}-[a-z]{2}"}}]
    want, got = _reqs(grammars, tok, kinds), _reqs(grammars, tok, kinds)
    ahead = MasksAhead(VOCAB)
    ones = [tok.encode(d, add_special_tokens=False)[0] for d in "12"]
    for r in want + got:
        r.output_ids.append(ones[0])
    ahead.start([(got[0], None)])
    for r in want + got:  # fed on the host after the fill started
        r.output_ids.append(ones[1])
    filled = ahead.take()
    assert filled is not None
    stale = filled.bits[filled.rows[id(got[0])][1]].copy()
    ref, mine = batch_bitmask(want, VOCAB)[1], batch_bitmask(got, VOCAB, None, None, filled)[1]
    assert torch.equal(ref, mine)
    assert not np.array_equal(stale, mine[0].numpy())  # the stale row would have differed


def test_the_workers_error_is_raised_on_the_engines_thread(grammars, smollm2_tokenizer,
                                                           monkeypatch):
    from latentserve import mask_ahead

    def refuse(masks, tokens):
        raise RuntimeError(f"boom {tokens}")

    monkeypatch.setattr(mask_ahead, "accept_each", refuse)
    (r,) = _reqs(grammars, smollm2_tokenizer, KINDS[:1])
    r.output_ids = [PENDING_ID]
    ahead = MasksAhead(VOCAB)
    ahead.start([(r, 0)], torch.tensor([7]))
    with pytest.raises(RuntimeError, match=r"boom \[7\]"):
        ahead.take()
    assert ahead.take() is None  # and the next step goes on


def test_disabled_fills_nothing(grammars, smollm2_tokenizer):
    reqs = _reqs(grammars, smollm2_tokenizer, KINDS[:1])
    ahead = MasksAhead(VOCAB, enabled=False)
    ahead.start([(reqs[0], None)])
    assert ahead.take() is None and reqs[0].constraint.consumed == 0


def test_the_switch_interval_is_short_only_while_fills_are_in_flight(grammars,
                                                                     smollm2_tokenizer):
    """While a worker fills, the engine's thread hands it the GIL within ``SWITCH_S``; the
    interval is back once the last fill in flight was waited for."""
    import sys

    from latentserve.mask_ahead import SWITCH_S

    before = sys.getswitchinterval()
    a, b = MasksAhead(VOCAB), MasksAhead(VOCAB)
    ra, rb = (_reqs(grammars, smollm2_tokenizer, KINDS[:1])[0] for _ in range(2))
    a.start([(ra, None)])
    b.start([(rb, None)])
    assert sys.getswitchinterval() == pytest.approx(min(SWITCH_S, before))
    a.take()
    assert sys.getswitchinterval() == pytest.approx(min(SWITCH_S, before))
    b.take()
    assert sys.getswitchinterval() == pytest.approx(before)
