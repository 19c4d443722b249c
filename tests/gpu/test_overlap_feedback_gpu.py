"""The feedback overlap parity of tests/parity/test_overlap_feedback.py on CUDA (float32,
CUDA graphs on, forced end ids one per step): COCONUT and CODI (its ``prj`` in the decode
graphs) overlapped equal the synchronous engine, output for output, with
latent steps replayed from the graphs (issue 27)."""

import dataclasses

import pytest
import torch

from latentserve.bench.baseline.latent_models import save_latent_tiny
from latentserve.config import EngineConfig
from latentserve.engine.llm_engine import LLMEngine
from tests.support.tp_parity import (
    assert_same_streams,
    mixed_feedback_requests,
    run_streams,
    spy_overlapped,
)

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _engine(path, overlapped: bool, **kw):
    kw = {"kv_slots": 4096, "max_model_len": 256, **kw}
    return LLMEngine(EngineConfig(model=str(path), device="cuda", dtype="float32",
                                  overlap_schedule=overlapped, **kw))


@pytest.mark.parametrize("kind", ["coconut-gpt2", "codi-llama"])
def test_overlapped_feedback_engine_equals_the_synchronous_one_on_cuda(tmp_path, kind):
    path = save_latent_tiny(tmp_path / kind, kind)
    requests = mixed_feedback_requests()
    want = run_streams(_engine(path, False), requests)
    engine = _engine(path, True)
    overlapped = spy_overlapped(engine)
    assert_same_streams(want, run_streams(engine, requests))
    assert sum(overlapped) > 5 and engine.runner.num_graph_steps > 0
    if kind.startswith("codi"):  # the prj ran in the decode graph
        assert engine.runner.graphs.num_latent_replays > 0
    stopped = [(p, dataclasses.replace(sp, stop_token_ids=[t[2]], ignore_eos=False))
               for (p, sp), (t, _, _) in zip(requests, want[0])]
    assert_same_streams(run_streams(_engine(path, False), stopped),
                        run_streams(_engine(path, True), stopped))
    # preemption: latent vectors of several tensors re-injected into a recomputed prefill
    engine = _engine(path, True, kv_slots=200)
    assert_same_streams(run_streams(_engine(path, False, kv_slots=200), requests),
                        run_streams(engine, requests))
    assert engine.scheduler.num_preemptions > 0
