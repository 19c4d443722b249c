"""The head overlap parity of tests/parity/test_overlap_head.py on CUDA (float32, CUDA graphs
on, the head in the decode graphs, forced closing ids one per step): the
compression head and CoLaR overlapped equal the synchronous engine, output for output, with
stops settled a step late, preemption, and every KV slot back in the pool (issue 27)."""

import dataclasses

import pytest
import torch

from latentserve.config import EngineConfig
from latentserve.engine.llm_engine import LLMEngine
from tests.support.colar_models import save_colar_tiny
from tests.support.head_models import save_head_model
from tests.support.tp_parity import (
    assert_same_streams,
    mixed_colar_requests,
    mixed_head_requests,
    run_streams,
    spy_overlapped,
)

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _engine(path, overlapped: bool, **kw):
    kw = {"kv_slots": 4096, "max_model_len": 256, **kw}
    return LLMEngine(EngineConfig(model=str(path), device="cuda", dtype="float32",
                                  overlap_schedule=overlapped, **kw))


def _all_slots_free(engine) -> None:
    cache = engine.cache
    cache.radix.evict(cache.radix.total_size())
    assert cache.num_free == cache.allocator.num_total


@pytest.mark.parametrize("kind", ["closed_loop", "colar"])
def test_overlapped_head_engine_equals_the_synchronous_one_on_cuda(tmp_path, kind):
    if kind == "colar":
        path, requests = save_colar_tiny(tmp_path / kind, stop_push=16.0), mixed_colar_requests()
    else:
        path = save_head_model(tmp_path / kind, source_layer=1, stop_bias=0.3)
        requests = mixed_head_requests()
    want = run_streams(_engine(path, False), requests)
    engine = _engine(path, True)
    overlapped = spy_overlapped(engine)
    assert_same_streams(want, run_streams(engine, requests))
    assert sum(overlapped) > 5 and engine.runner.num_graph_steps > 0
    assert engine.runner.graphs.num_latent_replays > 0  # replays whose head outputs were read
    assert "stop" in {f.latent_stats["end"] for _, _, f in want[0]}
    _all_slots_free(engine)
    stopped = [(p, dataclasses.replace(sp, stop_token_ids=[t[1]], ignore_eos=False))
               for (p, sp), (t, _, _) in zip(requests, want[0]) if len(t) > 1]
    assert_same_streams(run_streams(_engine(path, False), stopped),
                        run_streams(_engine(path, True), stopped))
    # preemption: latent vectors re-injected into a recomputed prefill
    engine = _engine(path, True, kv_slots=200)
    assert_same_streams(run_streams(_engine(path, False, kv_slots=200), requests),
                        run_streams(engine, requests))
    assert engine.scheduler.num_preemptions > 0
    _all_slots_free(engine)
