"""The recurrent overlap parity of tests/parity/test_overlap_recurrent.py on CUDA (float32,
CUDA graphs on): Huginn and Ouro overlapped equal the synchronous engine (issue 27)."""

import dataclasses

import pytest
import torch

from latentserve.bench.baseline.recurrent_models import write_huginn, write_ouro
from latentserve.config import EngineConfig
from latentserve.engine.llm_engine import LLMEngine
from tests.support.recurrent_requests import mixed_recurrent_requests
from tests.support.tp_parity import assert_same_outputs, run_requests, spy_overlapped

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _engine(path, overlapped: bool):
    return LLMEngine(EngineConfig(model=str(path), device="cuda", dtype="float32",
                                  kv_slots=4096, max_model_len=256, overlap_schedule=overlapped))


@pytest.mark.parametrize("family", ["huginn", "ouro"])
def test_overlapped_recurrent_engine_equals_the_synchronous_one_on_cuda(tmp_path, family):
    path = (write_huginn if family == "huginn" else write_ouro)(tmp_path / family)
    requests = mixed_recurrent_requests(family)
    want = run_requests(_engine(path, False), requests)
    engine = _engine(path, True)
    overlapped = spy_overlapped(engine)
    assert_same_outputs(want, run_requests(engine, requests))
    assert sum(overlapped) > 5 and engine.runner.num_graph_steps > 0
    stopped = [(p, dataclasses.replace(sp, stop_token_ids=[t[2]], ignore_eos=False))
               for (p, sp), (t, _, _) in zip(requests, want)]
    assert_same_outputs(run_requests(_engine(path, False), stopped),
                        run_requests(_engine(path, True), stopped))
