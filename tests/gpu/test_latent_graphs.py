"""Latent families inside the captured decode graphs on the H200 (fp32): a real COCONUT
checkpoint (feedback rows), a closed-loop compression head (head, decoder and stop head in
the graph) and recurrent depth (the masked recurrence loop in the graph) give the eager
per-request references' greedy tokens, and replayed steps carry the latent phase."""

import pytest
import torch

from latentserve.config import EngineConfig
from latentserve.sampling_params import SamplingParams
from tests.support.parity import shared_prefix_prompts
from tests.support.tp_parity import run_requests

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _engine(path, **kw):
    from latentserve.engine.llm_engine import LLMEngine

    kw.setdefault("kv_slots", 8192)
    return LLMEngine(EngineConfig(model=str(path), device="cuda", **kw))


def _drive(engine, requests):
    """``[(tokens, final StepOutput)]`` of ``[(prompt, SamplingParams)]`` run as one batch
    (slot invariant checked after)."""
    return [(toks, final) for toks, _, final in run_requests(engine, requests)]


def test_coconut_feedback_rows_replay_inside_graphs(tmp_path):
    from latentserve.bench.baseline.latent_models import save_latent_tiny
    from tests.support.latent_reference import reference_generate

    d = save_latent_tiny(tmp_path, "coconut-gpt2")
    engine = _engine(d)
    prompts = shared_prefix_prompts()[:8]
    budgets = [0, 1, 3, 6, 8, 0, 3, 6]
    refs = [reference_generate(d, p, b, 8)[0] for p, b in zip(prompts, budgets)]
    before = engine.runner.num_graph_steps
    out = _drive(engine, [(p, SamplingParams(max_tokens=8, temperature=0.0, latent_budget=b))
                          for p, b in zip(prompts, budgets)])
    assert [t for t, _ in out] == refs
    assert engine.runner.num_graph_steps - before >= max(budgets)


@pytest.mark.parametrize("kind", ["codi-llama", "codi-gpt2"])
def test_codi_projection_runs_in_the_decode_graphs(tmp_path, kind):
    """CODI's ``prj`` (Linear, GELU, Linear, LayerNorm) runs in the decode graphs beside the LM
    head, its outputs read only for steps with latent rows; answers equal the eager
    reference."""
    from latentserve.bench.baseline.latent_models import save_latent_tiny
    from tests.support.latent_reference import reference_generate

    d = save_latent_tiny(tmp_path, kind)
    engine = _engine(d)
    graphs = engine.runner.graphs
    assert graphs.feedback is not None
    assert len(graphs.outputs[graphs.graph_depths[0], graphs.buckets[0]]) == 4  # + prj's
    prompts = shared_prefix_prompts()[:8]
    budgets = [0, 1, 3, 6, 8, 0, 3, 6]
    refs = [reference_generate(d, p, b, 8, ignore_eos=True)[0]
            for p, b in zip(prompts, budgets)]
    before = engine.runner.num_graph_steps
    out = _drive(engine, [(p, SamplingParams(max_tokens=8, temperature=0.0, latent_budget=b,
                                             ignore_eos=True))
                          for p, b in zip(prompts, budgets)])
    assert [t for t, _ in out] == refs
    steps = engine.runner.num_graph_steps - before
    assert steps >= max(budgets)
    # Read for the steps with latent rows only: a budget of k takes k - 1 of them (the
    # prefill's eager forward gives the first latent input); 8 answer tokens follow.
    assert max(budgets) - 1 <= graphs.num_latent_replays < steps


def test_closed_loop_head_runs_inside_graphs(tmp_path):
    from tests.support.head_models import save_head_model
    from tests.support.head_reference import head_reference_generate

    d = save_head_model(tmp_path / "cl", injection="closed_loop", source_layer=1,
                        stop_bias=0.3)
    engine = _engine(d)
    assert engine.runner.graphs.head is not None
    spec = engine.latent_spec
    prompts = shared_prefix_prompts()[:8]
    controls = [{"max_latent": c, "min_latent": m, "use_stop": u, "stop_threshold": t}
                for c, m, u, t in ((0, 0, True, 0.5), (3, 2, False, 0.5), (8, 0, True, 0.62),
                                   (12, 4, True, 0.66), (5, 0, False, 0.7), (10, 1, True, 0.64),
                                   (2, 0, False, 0.5), (6, 1, True, 0.99))]
    refs = [head_reference_generate(d, d / "latent_reasoning_head.safetensors", p,
                                    spec.start_ids, spec.end_ids, max_tokens=24,
                                    eos_ids=engine.eos_ids, **c)
            for p, c in zip(prompts, controls)]
    before = engine.runner.num_graph_steps
    out = _drive(engine, [(p, SamplingParams(max_tokens=24, temperature=0.0,
                                             min_output_tokens=0, **c))
                          for p, c in zip(prompts, controls)])
    for (toks, final), ref in zip(out, refs):
        assert toks == ref["tokens"]
        for k in ("steps", "stop_step", "end"):
            assert final.latent_stats[k] == ref[k], k
    steps = engine.runner.num_graph_steps - before
    assert steps >= max(r["steps"] for r in refs)
    # The head runs inside the decode graph, from its anchor layer on a side stream; its
    # outputs are read only for decode steps with rows still thinking (a step that forces a
    # request's closing ids is an eager extend step).
    assert 0 < engine.runner.graphs.num_latent_replays < steps


def test_colar_policy_runs_inside_graphs(tmp_path):
    """CoLaR (latent/colar_head.py): the policy runs in the decode graph on its final-normed
    hidden, beside the LM head; answers, latent steps and stop/cap equal the eager
    reference's for a batch of mixed thinking speeds and caps, cold and warm."""
    from transformers import AutoModelForCausalLM

    from latentserve.latent import colar
    from latentserve.models.checkpoint import load_tokenizer
    from tests.support.colar_models import save_colar_tiny
    from tests.support.colar_reference import colar_generate_reference

    torch.backends.cuda.matmul.allow_tf32 = False
    d = save_colar_tiny(tmp_path / "colar", stop_push=16.0)
    model = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    tok = load_tokenizer(d)
    cfg, policy = colar.load_colar(d)
    engine = _engine(d)
    assert engine.runner.graphs.head is engine.runner.model.latent_head
    base = [f"w{(37 * i + 11) % 900 + 30}" for i in range(24)]
    questions = [" ".join(base + ["w500"]), " ".join(base[:10]), "w45 w46",
                 " ".join(base + [f"w{700 + i}" for i in range(9)])]
    cases = [(q, c, m) for i, q in enumerate(questions)
             for c, m in (((i % 5) + 1, 12), ((i + 2) % 5 + 1, 4))]
    refs = [colar_generate_reference(model, tok, policy, cfg, q, c, m, 8) for q, c, m in cases]
    requests = [(tok.encode(colar.QUESTION.format(q), add_special_tokens=False),
                 SamplingParams(max_tokens=8, temperature=0.0, compression_factor=c,
                                max_latent=m)) for q, c, m in cases]
    before = engine.runner.num_graph_steps
    for _ in range(2):  # cold, then warm
        for (toks, final), ref in zip(_drive(engine, requests), refs):
            assert toks == ref.answer_ids
            assert final.latent_stats["steps"] == ref.n_latent
    fired = [r.n_latent > 0 and int(r.latent_logits[-1].argmax()) == 3 for r in refs]  # ###
    assert any(fired) and not all(fired)  # stops and caps both ran
    assert 0 < engine.runner.graphs.num_latent_replays < engine.runner.num_graph_steps - before


@pytest.mark.parametrize("kind", ["huginn", "ouro"])
def test_recurrence_loop_runs_inside_graphs(kind, tmp_path):
    from latentserve.bench.baseline.recurrent_models import write_huginn, write_ouro
    from tests.support.recurrent_reference import HuginnReference, OuroReference

    d = (write_huginn if kind == "huginn" else write_ouro)(tmp_path / kind)
    engine = _engine(d, max_model_len=256)
    ref = (HuginnReference if kind == "huginn" else OuroReference)(d)
    base = [(7 * i + 11) % 900 + 20 for i in range(24)]
    prompts = [base + [100, 101], base + [200] * 5, base[:13], [5, 6, 7]]
    depths = [1, 2, 4, 3] if kind == "huginn" else [4, 2, 3, 4]
    before = engine.runner.num_graph_steps
    out = _drive(engine, [(p, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True,
                                             latent_budget=t))
                          for p, t in zip(prompts, depths)])
    for (toks, _), p, t in zip(out, prompts, depths):
        want = (ref.generate(p, 8, t) if kind == "huginn"
                else ref.generate(p, 8, t, "threshold", 1.0))
        assert toks == want["tokens"]
    assert engine.runner.num_graph_steps - before >= 7

@pytest.mark.parametrize("rows", [1, 16, 64])
def test_fused_head_serve_path_matches_ieee_float32(rows):
    """The head's fused serve path (``decode_linear`` with 3xTF32 on tensor cores, the CUDA
    default) against the IEEE float32 modules at the Llama-1B head's size (hidden 2048,
    latent 512, mlp 1024): within float32 rounding, far inside plain TF32's ~1e-3; replayed
    from a CUDA graph (its stop head on a side stream), bit for bit the eager fused path."""
    from latentserve.latent.bundle import random_bundle

    torch.backends.cuda.matmul.allow_tf32 = False
    head = random_bundle(2048, 512, 1024, seed=5, stop_bias=0.1).build().cuda()
    x = torch.randn(rows, 2048, device="cuda", dtype=torch.bfloat16) * 3
    with torch.inference_mode():
        vecs, probs = head.serve_outputs(x)
        ref_v, ref_p = head.serve_outputs(x, fused=False)
    assert torch.equal(ref_v, head.latent_input(x)) and torch.equal(ref_p, head.stop_prob(x))
    torch.testing.assert_close(vecs, ref_v, rtol=2e-5, atol=2e-5)
    torch.testing.assert_close(probs, ref_p, rtol=2e-5, atol=2e-6)
    # captured (the stop head on a side stream), replayed: the eager fused path's values
    static = x.clone()
    with torch.inference_mode():
        head.serve_outputs(static)  # warm-up outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out_v, out_p = head.serve_outputs(static)
        static.copy_(torch.randn_like(x) * 3)
        graph.replay()
        want_v, want_p = head.serve_outputs(static)
    torch.cuda.synchronize()
    assert torch.equal(out_v, want_v) and torch.equal(out_p, want_p)


def test_ouro_exit_distribution_from_replayed_graphs(tmp_path):
    """Ouro's per-token trace (depth, readout step, exit distribution) from replayed decode
    graphs (the static ``exit_probs`` buffer) equals the eager reference's, with the readouts
    that run every step (threshold, weighted, last) in one batch (fp32, the overlap schedule
    on: the CUDA default). A ``threshold-approx`` row may stop iterating early, which the
    masked graph loop cannot do (``RecurrentGraphs.fits``): its batch runs eagerly, so it is
    served in a batch of its own, checked against the reference too."""
    from latentserve.bench.baseline.recurrent_models import write_ouro
    from tests.support.recurrent_reference import OuroReference

    d = write_ouro(tmp_path / "ouro")
    engine = _engine(d, max_model_len=256)
    ref = OuroReference(d)
    base = [(7 * i + 11) % 900 + 20 for i in range(24)]
    prompts = [base + [100, 101], base + [200] * 5, base[:13], [5, 6, 7], base[:9] + [44]]
    cases = [(4, "threshold", 1.0), (2, "threshold", 0.6), (6, "weighted", None),
             (3, "last", None), (6, "threshold-approx", 0.6)]

    def drive(idx):
        return _drive(engine, [(prompts[i], SamplingParams(
            max_tokens=8, temperature=0.0, ignore_eos=True, latent_budget=cases[i][0],
            exit_criterion=cases[i][1], exit_threshold=cases[i][2], return_latent_trace=True))
            for i in idx])

    before = engine.runner.num_graph_steps
    out = drive(range(4))
    assert engine.runner.num_graph_steps - before >= 7  # every decode step replayed
    before = engine.runner.num_graph_steps
    out += drive([4])
    assert engine.runner.num_graph_steps == before  # may exit early: eager
    for i, ((toks, final), p, (t, c, thr)) in enumerate(zip(out, prompts, cases, strict=True)):
        want = ref.generate(p, 8, t, c, 1.0 if thr is None else thr)
        assert toks == want["tokens"], f"request {i}"
        trace = final.latent_trace
        assert [e["depth"] for e in trace] == want["iterations"], f"request {i}"
        assert [e["readout_step"] for e in trace] == want["readouts"], f"request {i}"
        for j, (e, pdf) in enumerate(zip(trace, want["exit_probs"], strict=True)):
            assert len(e["exit_probs"]) == len(pdf) == e["depth"], f"request {i} token {j}"
            assert abs(sum(e["exit_probs"]) - 1) < 1e-6
            assert max(abs(a - b) for a, b in zip(e["exit_probs"], pdf)) < 1e-4, (i, j)
