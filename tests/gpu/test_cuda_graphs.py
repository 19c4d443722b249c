"""CUDA-graph decode on the H200: replayed steps give the eager torch backend's tokens and
logits (fp32), plain and with feedback-latent rows inside the captured graphs."""

import pytest
import torch

from latentserve.config import EngineConfig
from latentserve.testing.latent_mock import mock_latent_loading, mock_reference, run_mixed_budgets
from latentserve.testing.parity import run_batch, shared_prefix_prompts

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _engine(path, **kw):
    from latentserve.engine.llm_engine import LLMEngine

    return LLMEngine(EngineConfig(model=str(path), device="cuda", **kw))


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_graph_decode_matches_eager(kind, tiny_dirs):
    graph = _engine(tiny_dirs[kind])
    eager = _engine(tiny_dirs[kind], attention_backend="torch", enforce_eager=True)
    prompts = shared_prefix_prompts()
    g_tok, g_lg, _ = run_batch(graph, prompts, 12)
    e_tok, e_lg, _ = run_batch(eager, prompts, 12)
    assert graph.runner.num_graph_steps > 0 and eager.runner.num_graph_steps == 0
    assert g_tok == e_tok
    for a, b in zip(g_lg, e_lg):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=0)
    graph.cache.check_idle()


def test_latent_rows_run_inside_graphs(tiny_dirs, hf_models):
    with mock_latent_loading():
        engine = _engine(tiny_dirs["llama"])
    prompts = [[5 + i + j for j in range(10 + 3 * i)] for i in range(8)]
    budgets = [0, 1, 3, 6, 8, 0, 3, 6]
    hf = hf_models(tiny_dirs["llama"], "cuda")
    refs = [mock_reference(hf, p, b, 8) for p, b in zip(prompts, budgets)]
    before = engine.runner.num_graph_steps
    answers, steps = run_mixed_budgets(engine, prompts, budgets, 8)
    assert answers == refs and steps == budgets
    # Every step after the prefill was a decode step, latent rows included: all replayed.
    assert engine.runner.num_graph_steps - before >= max(budgets) + 8
    engine.cache.check_idle()
