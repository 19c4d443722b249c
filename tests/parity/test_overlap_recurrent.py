"""Overlap scheduling for recurrent-depth models (issue 27: every family on the fast path):
Huginn and Ouro under the overlap scheduler give what the synchronous engine gives: tokens,
finish reasons, iterations per token (``recurrence``) and traces, greedy and seeded, with
stop tokens and exit rules, in mixed batches, and no KV slot leaks."""

import dataclasses

import pytest

from latentserve.bench.baseline.recurrent_models import write_huginn, write_ouro
from latentserve.config import EngineConfig
from latentserve.engine import overlap
from latentserve.engine.llm_engine import LLMEngine
from latentserve.sampling_params import SamplingParams
from tests.support.recurrent_requests import mixed_recurrent_requests
from tests.support.tp_parity import assert_same_outputs, run_requests, spy_overlapped


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("overlap-recurrent")
    return {"huginn": write_huginn(root / "huginn"), "ouro": write_ouro(root / "ouro")}


def _engine(path, overlapped: bool):
    return LLMEngine(EngineConfig(model=str(path), kv_slots=4096, max_model_len=256,
                                  overlap_schedule=overlapped))


@pytest.mark.parametrize("family", ["huginn", "ouro"])
def test_overlapped_recurrent_engine_equals_the_synchronous_one(dirs, family):
    requests = mixed_recurrent_requests(family)
    want = run_requests(_engine(dirs[family], False), requests)
    engine = _engine(dirs[family], True)
    overlapped = spy_overlapped(engine)
    got = run_requests(engine, requests)  # also checks that no KV slot leaked
    assert_same_outputs(want, got)
    assert sum(overlapped) > 5  # most forwards read the previous forward's tokens
    assert all(f.recurrence for _, _, f in want)
    # A stop id each request meets (its own third token): it finishes on a token of a batch
    # it was already launched past, whose row is discarded.
    stopped = [(p, dataclasses.replace(sp, stop_token_ids=[t[2]], ignore_eos=False))
               for (p, sp), (t, _, _) in zip(requests, want)]
    want = run_requests(_engine(dirs[family], False), stopped)
    assert_same_outputs(want, run_requests(_engine(dirs[family], True), stopped))
    assert any(f.finish_reason == "stop" for _, _, f in want)


def test_recurrent_models_are_eligible(dirs):
    engine = _engine(dirs["huginn"], True)
    engine.add_request("r", [5, 6, 7], SamplingParams(max_tokens=3, latent_budget=2))
    assert overlap.eligible(engine)
    engine.add_request("lp", [5, 6], SamplingParams(max_tokens=3, logprobs=1))
    assert overlap.eligible(engine)  # logprobs overlap (test_overlap_scored)
