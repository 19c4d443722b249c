"""Run one batch through a synchronous and an overlapped engine (tests of overlap parity)."""

import pytest

from latentserve.config import EngineConfig
from latentserve.engine.llm_engine import LLMEngine


def sync_and_overlapped(model_dir, prompts: list[list[int]], params: list) -> list[dict]:
    """``[sync, overlapped]``, each ``rid -> output ids`` (rid ``r{i}`` for ``prompts[i]``
    with ``params[i]``); asserts that only the overlapped engine ran steps on pending ids."""
    results = []
    for overlap in (False, True):
        engine = LLMEngine(EngineConfig(model=str(model_dir), overlap_schedule=overlap))
        seen, run = [], engine.runner.run
        engine.runner.run = lambda batch, pending=None: (
            seen.append(pending is not None), run(batch, pending))[1]  # noqa: B023 - its own
        for i, (p, sp) in enumerate(zip(prompts, params)):
            engine.add_request(f"r{i}", p, sp)
        out = {f"r{i}": [] for i in range(len(params))}
        while engine.has_unfinished_requests():
            for o in engine.step():
                out[o.rid].extend(o.new_token_ids)
        results.append(out)
        assert any(seen) is overlap
    return results


def scored_outputs(engine, requests, rounds: int = 1) -> list[list]:
    """Run ``requests`` (``[(prompt ids, SamplingParams)]``) together ``rounds`` times on
    ``engine``; per round and request ``[ids, logprobs, prompt logprobs, finish reason,
    latent steps]``; asserts after each round that no KV slot leaked."""
    results = []
    for _ in range(rounds):
        rids = [f"r{engine._arrivals + i}" for i in range(len(requests))]
        for rid, (p, sp) in zip(rids, requests):
            engine.add_request(rid, p, sp)
        got = {rid: [[], [], None, None, 0] for rid in rids}
        while engine.has_unfinished_requests():
            for o in engine.step():
                g = got[o.rid]
                g[0] += o.new_token_ids
                g[1] += o.logprobs or []
                g[2] = o.prompt_logprobs if o.prompt_logprobs is not None else g[2]
                g[3] = o.finish_reason if o.finished else g[3]
                g[4] = o.latent_steps
        engine.cache.check_idle()
        results.append(list(got.values()))
    return results


def assert_same_logprobs(got, want, what: str) -> None:
    """Two lists of ``TokenLogprob`` (or None) equal: ids and top ids exactly, values within
    1e-5, ranks within 2 (a rank thousands deep moves with logits that differ by 1e-6, as
    those of rows batched differently do); ``what`` names them in a failure."""
    assert len(got) == len(want), what
    for i, (g, w) in enumerate(zip(got, want)):
        if w is None:
            assert g is None, (what, i)
            continue
        assert (g.token_id, [t for t, _ in g.top]) == (w.token_id, [t for t, _ in w.top]), \
            (what, i)
        assert abs(g.rank - w.rank) <= (0 if w.rank <= 20 else 2), (what, i, g.rank, w.rank)
        assert g.logprob == pytest.approx(w.logprob, abs=1e-5), (what, i)
        assert [v for _, v in g.top] == pytest.approx([v for _, v in w.top], abs=1e-5), (what, i)


def assert_same_scored(got: list[list], want: list[list]) -> None:
    """:func:`scored_outputs` results equal: ids, finish reasons and latent steps exactly,
    logprobs and prompt logprobs by :func:`assert_same_logprobs`."""
    assert len(got) == len(want)
    for r, (g_round, w_round) in enumerate(zip(got, want)):
        for i, (g, w) in enumerate(zip(g_round, w_round)):
            what = f"round {r} request {i}"
            assert (g[0], g[3], g[4]) == (w[0], w[3], w[4]), what
            assert_same_logprobs(g[1], w[1], f"{what} logprobs")
            assert (g[2] is None) == (w[2] is None), what
            if w[2] is not None:
                assert_same_logprobs(g[2], w[2], f"{what} prompt logprobs")
