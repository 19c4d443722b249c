"""The decode-graph path with CUDA graphs emulated on CPU (``test_graph_emulation``'s
harness) for the latent families' graph hooks: Ouro's readout buffers, CODI's ``prj`` and a
closed-loop head in the decode graph, under overlap scheduling. Tokens and logprobs must
equal an engine without graphs. A file of its own so that xdist spreads the two halves.
"""

import os

os.environ["TRITON_INTERPRET"] = "1"  # before anything imports triton or the kernels

import pytest

pytest.importorskip("triton")

import torch

from latentserve.config import EngineConfig
from latentserve.engine.llm_engine import LLMEngine
from latentserve.sampling_params import SamplingParams
from tests.unit import test_graph_emulation as harness

# The batches here hold at most 4 requests: one bucket of 4 (as the harness's) replays few
# padded rows through the interpreted kernels.
MAX_BS = 4
# One decode split (the kernel's direct path, as for large batches on the GPU): half the
# interpreted attention programs of two splits and no combine stage. Split decode under
# emulated graphs is ``test_graph_emulation``'s.
KV_SPLITS = 1


@pytest.fixture
def emulated_graphs(monkeypatch):
    harness.emulate_graphs(monkeypatch)


@pytest.fixture(scope="module")
def small_vocab_llama(tmp_path_factory):
    """The harness's small-vocabulary Llama with one decoder layer (CODI's backbone here: its
    ``prj`` and LoRA do not depend on the depth), half the interpreted layer kernels."""
    return harness.save_small_vocab_llama(tmp_path_factory, num_hidden_layers=1)


def test_ouro_decode_graphs_return_each_tokens_readout_step(emulated_graphs, tmp_path):
    """Ouro's decode graphs write each row's readout step and per-step exit probabilities
    into static buffers (``CudaGraphRunner.readout_steps``, ``exit_probs``): the
    ``return_latent_trace`` of replayed steps (under the overlap scheduler, as on CUDA)
    equals the eager synchronous engine's, for traced rows with threshold, last and weighted
    readouts."""
    from latentserve.bench.baseline.recurrent_models import write_ouro

    # One decoder layer (half the interpreted kernels of each loop iteration; the readout
    # buffers do not depend on it): the threshold row still reads out before its last step
    # for some tokens. Budgets up to 6 as ``OURO_TINY``: the replayed depth-4 graph writes a
    # slice of the depth-6 exit-probability buffer.
    d = write_ouro(tmp_path / "ouro", num_hidden_layers=1)
    cases = [(4, "threshold", 0.6), (3, "last", None), (3, "weighted", None)]

    def traces(graphs: bool):
        engine = LLMEngine(EngineConfig(model=str(d), attention_backend="triton",
                                        max_num_seqs=MAX_BS, max_model_len=128,
                                        attention_num_kv_splits=KV_SPLITS,
                                        overlap_schedule=graphs))
        if graphs:
            engine.runner.capture_graphs(MAX_BS, engine.runner.model.config.hidden_size,
                                         torch.float32)
        for i, (depth, crit, thr) in enumerate(cases):
            engine.add_request(f"r{i}", [5 + i, 17, 29, 41 + i], SamplingParams(
                max_tokens=3, temperature=0.0, ignore_eos=True, latent_budget=depth,
                exit_criterion=crit, exit_threshold=thr, return_latent_trace=True))
        out = {}
        while engine.has_unfinished_requests():
            for o in engine.step():
                if o.finished:
                    out[o.rid] = (o.latent_trace, o.recurrence)
        return out, engine.runner.num_graph_steps

    eager, _ = traces(False)
    replayed, steps = traces(True)
    assert steps >= 2  # every decode step
    # Depths, readout steps and stats exactly; the exit probabilities (``[T, steps]`` static
    # buffer) within fp32 rounding of the eager loop's.
    def exact(out):
        return {rid: ([(e["depth"], e["readout_step"]) for e in trace], stats)
                for rid, (trace, stats) in out.items()}

    assert exact(replayed) == exact(eager)
    for rid, (trace, _) in eager.items():
        for e, r in zip(trace, replayed[rid][0], strict=True):
            assert len(e["exit_probs"]) == e["depth"]
            assert r["exit_probs"] == pytest.approx(e["exit_probs"], abs=1e-6)
    assert all(e["readout_step"] is None for e in eager["r2"][0])
    assert {e["readout_step"] for e in eager["r1"][0]} == {2}


def _eager_then_graphs(model_dir, requests):
    """``requests`` through an eager engine, then through one with emulated decode graphs and
    overlap scheduling: (eager outputs, graph outputs, the graph engine, its overlap spy)."""

    from tests.support.tp_parity import run_requests, spy_overlapped

    def run(graphs: bool):
        engine = LLMEngine(EngineConfig(model=str(model_dir), fused_ops=True,
                                        attention_backend="triton", max_num_seqs=MAX_BS,
                                        max_model_len=128, attention_num_kv_splits=KV_SPLITS,
                                        overlap_schedule=graphs))
        if graphs:
            engine.runner.capture_graphs(MAX_BS, engine.runner.model.config.hidden_size,
                                         torch.float32)
            engine.scheduler.forced_one_by_one = True
        overlapped = spy_overlapped(engine)
        return run_requests(engine, requests), engine, overlapped

    want, _, _ = run(False)
    return (want, *run(True))


@pytest.fixture(scope="module")
def small_vocab_codi(tmp_path_factory, small_vocab_llama):
    """A tiny CODI (Llama, LoRA, ``prj``) over the small-vocabulary Llama."""
    from latentserve.bench.baseline.latent_models import write_upstream_codi
    from latentserve.latent.convert import convert_codi

    root = tmp_path_factory.mktemp("small-vocab-codi")
    base, ckpt = write_upstream_codi(root, "llama", fmt="bin", base_dir=small_vocab_llama)
    return convert_codi(base, ckpt, root / "model", lora_alpha=16.0)


def test_codi_prj_in_the_graph_under_overlap_equals_the_eager_engine(small_vocab_codi,
                                                                     emulated_graphs):
    """CODI's ``prj`` runs in the decode graphs beside the LM head
    (``FeedbackFamily.graph_hooks``) and the overlap scheduler launches each latent step on
    the replayed outputs of the one before (their vectors injected into the next replay):
    greedy tokens, latent step counts and traces equal the eager synchronous engine's, and
    every sampled step's logits within 1e-4, for budgets 0 to 5 in one batch."""
    from tests.support.tp_parity import assert_same, assert_same_outputs

    requests = [([5 + i, 17, 29 + i, 41], SamplingParams(
        max_tokens=4, temperature=0.0, ignore_eos=True, latent_budget=b,
        return_latent_trace=i % 2 == 0)) for i, b in enumerate((0, 2, 3, 5))]

    want, got, engine, overlapped = _eager_then_graphs(small_vocab_codi, requests)
    assert_same_outputs(want, got, atol=1e-4)
    assert_same(want, got, atol=1e-4)
    assert sum(overlapped) > 5
    assert [f.latent_steps for _, _, f in got] == [0, 2, 3, 5]
    graphs = engine.runner.graphs
    assert graphs.feedback is engine.runner.model.latent_feedback
    assert graphs.num_latent_replays > 3 and engine.runner.num_graph_steps > 5
    # eot is masked in the graph, before the graph's greedy argmax the sampler takes
    eot = engine.latent_spec.suppress_ids
    assert graphs.with_greedy and graphs.suppress.tolist() == list(eot)
    logits, _, greedy = graphs.outputs[graphs.graph_depths[0], graphs.buckets[0]][:3]
    assert greedy is not None and torch.isneginf(logits[:, eot]).all()
    out = graphs.outputs[graphs.graph_depths[0], graphs.buckets[0]]
    assert len(out) == 4 and out[3].shape == out[1].shape  # prj's vectors, in the graph


@pytest.mark.parametrize("kind", ["colar", "head"])
def test_head_in_the_graph_under_overlap_equals_the_eager_engine(kind, emulated_graphs,
                                                                 tmp_path):
    """A closed-loop head (CoLaR's policy from the final hidden; the compression head with its
    stop head from a layer inside the stack) runs inside the decode graphs and the overlap
    scheduler settles each stop a step later
    from the graph's static outputs (``latent/head_late.py``), the closing ids one per step:
    greedy and seeded tokens, latent stats, step counts and traces equal the eager
    synchronous engine's."""
    from tests.support.colar_models import save_colar_tiny
    from tests.support.head_models import save_head_model
    from tests.support.tp_parity import assert_same_outputs

    if kind == "colar":  # one decoder layer: CoLaR's policy reads the final hidden
        path = save_colar_tiny(tmp_path / "colar", stop_push=16.0, num_hidden_layers=1)
        extra = [{}, {"latent_temperature": 1.0}]
    else:
        path = save_head_model(tmp_path / "head", source_layer=1, stop_bias=0.3,
                               word_tokenizer=True, vocab_size=1024)
        extra = [{"stop_threshold": 0.55, "min_latent": 1, "min_output_tokens": 0}] * 2
    requests = [([40 + i, 57, 69 + i, 81] * (1 + i % 2), SamplingParams(
        max_tokens=4 if kind == "colar" else 6, temperature=0.0 if i % 2 else 0.8, seed=i,
        ignore_eos=True, max_latent=m, return_latent_trace=i % 2 == 0, **extra[i % 2]))
        for i, m in enumerate((0, 3, 6, 8))]

    want, got, engine, overlapped = _eager_then_graphs(path, requests)
    assert_same_outputs(want, got, atol=1e-4)
    for (_, _, w), (_, _, g) in zip(want, got):
        assert (g.latent_steps, g.latent_stats["end"], g.latent_stats["stop_step"]) == (
            w.latent_steps, w.latent_stats["end"], w.latent_stats["stop_step"])
    assert sum(overlapped) > 5
    assert "stop" in {f.latent_stats["end"] for _, _, f in want}
    graphs = engine.runner.graphs
    assert graphs.head is engine.runner.model.latent_head
    assert graphs.num_latent_replays > 1 and engine.runner.num_graph_steps > 5
    assert graphs.with_greedy  # no suppressed ids: the greedy rows take the graph's argmax
    # both run in the decode graph from their anchor on: the compression head from a layer
    # inside the stack (its vectors and stop probabilities), CoLaR from the final hidden
    out = graphs.outputs[graphs.graph_depths[0], graphs.buckets[0]]
    assert len(out) == 5 and (out[4] is None) == (kind == "colar")
