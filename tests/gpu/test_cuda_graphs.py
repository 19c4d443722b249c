"""CUDA-graph decode on the H200: replayed steps give the eager torch backend's tokens and
logits (fp32), plain and with feedback-latent rows inside the captured graphs."""

import pytest
import torch

from latentserve.config import EngineConfig
from tests.support.latent_mock import mock_latent_loading, mock_reference, run_mixed_budgets
from tests.support.parity import run_batch, shared_prefix_prompts

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _engine(path, **kw):
    from latentserve.engine.llm_engine import LLMEngine

    kw.setdefault("kv_slots", 8192)
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


@pytest.mark.parametrize("model", ["smollm2", "llama-3.2-1b-shape"])
def test_triton_graphs_match_torch_eager_on_real_shapes(model, smollm2_dir, tmp_path):
    """Triton + CUDA graphs vs the torch backend run eagerly: fp32 greedy tokens and logits
    equal (1e-4); bf16 logits within 0.5 of each other (both paths in bf16; 4 bf16 ulps at
    |logit| in [16, 32); the H200 run of 2026-11-29 saw at most 0.375)."""
    from latentserve.bench.gpu import SHAPES, save_random_llama

    path = smollm2_dir if model == "smollm2" else save_random_llama(tmp_path / "m",
                                                                      SHAPES["llama-3.2-1b"])
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(3, 1000, (16, 64), generator=g).tolist()
    for dtype in ("float32", "bfloat16"):
        kw = dict(dtype=dtype, max_model_len=256, kv_slots=8192)
        fast, ref = _engine(path, **kw), _engine(path, attention_backend="torch",
                                                  enforce_eager=True, **kw)
        f_tok, f_lg, _ = run_batch(fast, prompts, 16)
        r_tok, r_lg, _ = run_batch(ref, prompts, 16)
        assert fast.runner.num_graph_steps > 0
        atol = 1e-4 if dtype == "float32" else 0.5
        for a, b in zip(f_lg, r_lg):
            torch.testing.assert_close(a, b, atol=atol, rtol=0)
        if dtype == "float32":
            assert f_tok == r_tok
        del fast, ref
        torch.cuda.empty_cache()


def test_overlap_schedule_equals_the_synchronous_engine(smollm2_dir):
    """The overlap scheduler (the CUDA default) against the synchronous engine, both on
    Triton + CUDA graphs with SmolLM2's real weights in fp32: equal greedy and seeded-sampled
    tokens and finish reasons for a batch of mixed lengths and stops, one request with
    logprobs (its steps run synchronously, so the engine switches modes mid-run); the logits
    of every step the synchronous engine sampled within 1e-4; no KV slot leaked."""
    from latentserve.sampling_params import SamplingParams
    from tests.support.tp_parity import run_requests

    prompts = shared_prefix_prompts()
    kinds = [{"max_tokens": 6 + 3 * i} for i in range(len(prompts))]
    kinds[1] = {"max_tokens": 20, "temperature": 0.8, "seed": 7}
    kinds[2] = {"max_tokens": 16, "temperature": 1.0, "top_p": 0.9, "seed": 3}
    kinds[3] = {"max_tokens": 12, "logprobs": 2}
    kinds[4] = {"max_tokens": 30, "stop_token_ids": [13, 28]}
    requests = [(p, SamplingParams(**{"temperature": 0.0, **k})) for p, k in zip(prompts, kinds)]
    runs = {}
    for overlap in (False, True):
        engine = _engine(smollm2_dir, overlap_schedule=overlap)
        assert engine.config.use_overlap_schedule is overlap
        runs[overlap] = run_requests(engine, requests)
        assert engine.runner.num_graph_steps > 0
        del engine
        torch.cuda.empty_cache()
    for (s_tok, s_lg, s_fin), (o_tok, o_lg, o_fin) in zip(runs[False], runs[True]):
        assert o_tok == s_tok
        assert o_fin.finish_reason == s_fin.finish_reason
        for a, b in zip(s_lg, o_lg):
            torch.testing.assert_close(b, a, atol=1e-4, rtol=0)
