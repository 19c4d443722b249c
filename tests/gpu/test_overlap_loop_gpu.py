"""The loop overlap parity of tests/parity/test_overlap_loop.py on CUDA (float32, CUDA graphs
on for the decode rows): PCCoT and LOTUS overlapped equal the synchronous engine, output for
output, with stops and preemption, and every KV slot back in the pool (issue 27)."""

import dataclasses

import pytest
import torch

from latentserve.config import EngineConfig
from latentserve.engine.llm_engine import LLMEngine
from tests.support.loop_models import save_loop_tiny
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


def _all_slots_free(engine) -> None:
    cache = engine.cache
    cache.radix.evict(cache.radix.total_size())
    assert cache.num_free == cache.allocator.num_total


@pytest.mark.parametrize("kind,block", [("pccot-gpt2", 4), ("lotus-llama", 6)])
def test_overlapped_loop_engine_equals_the_synchronous_one_on_cuda(tmp_path, kind, block):
    pytest.importorskip("peft")
    path = save_loop_tiny(tmp_path / kind, kind, block_size=block, iterations=2)
    requests = mixed_feedback_requests()
    want = run_streams(_engine(path, False), requests)
    engine = _engine(path, True)
    overlapped = spy_overlapped(engine)
    assert_same_streams(want, run_streams(engine, requests))
    assert sum(overlapped) > 5 and engine.runner.num_graph_steps > 0
    _all_slots_free(engine)
    stopped = [(p, dataclasses.replace(sp, stop_token_ids=[t[2]], ignore_eos=False))
               for (p, sp), (t, _, _) in zip(requests, want[0])]
    assert_same_streams(run_streams(_engine(path, False), stopped),
                        run_streams(_engine(path, True), stopped))
    engine = _engine(path, True, kv_slots=200)
    assert_same_streams(run_streams(_engine(path, False, kv_slots=200), requests),
                        run_streams(engine, requests))
    assert engine.scheduler.num_preemptions > 0
    _all_slots_free(engine)
