"""The decode-graph path of ``ModelRunner.run`` on CPU, with CUDA graphs emulated: a
"captured" graph re-runs its forward on replay and writes into the outputs of the capture,
as a real graph writes its static buffers. This covers what only the H200 ran before:
``CudaGraphRunner.replay_packed`` with the input kernel (``ops.kernels.decode_inputs``,
overlap scheduling's pending ids included), the greedy tokens returned by the graph
(``ModelRunner.last_greedy``) and the sampler taking them, the family's graph hooks (Ouro's
readout buffers, CODI's ``prj`` and a closed-loop head in the decode graph, under overlap
scheduling). Tokens and logprobs must equal an engine without graphs; every replay's
``last_greedy`` must be the argmax of the logits it returned. Kernels run in the Triton
interpreter.
"""

import os

os.environ["TRITON_INTERPRET"] = "1"  # before anything imports triton or the kernels

import random

import pytest

pytest.importorskip("triton")

import torch

from latentserve.config import EngineConfig
from latentserve.engine import overlap
from latentserve.engine.llm_engine import LLMEngine
from latentserve.sampling_params import SamplingParams
from tests.support.graph_emulation import emulate_graphs
from tests.support.triton_interpreter import patch_triton_interpreter

patch_triton_interpreter()

# One bucket of 4 (not 8): each replay runs its padded rows through the interpreted kernels.
MAX_BS = 4


@pytest.fixture
def emulated_graphs(monkeypatch):
    emulate_graphs(monkeypatch)


@pytest.fixture(scope="module")
def small_vocab_llama(tmp_path_factory):
    return save_small_vocab_llama(tmp_path_factory)


def save_small_vocab_llama(tmp_path_factory, **overrides):
    """The tiny Llama with a 1024-token vocabulary: its LM head and argmax interpret ~48x
    faster than with SmolLM2's vocabulary (the argmax's chunked pass has its own tests);
    ``overrides`` go into its config."""
    from latentserve.bench.baseline.tiny_models import save_tiny

    return save_tiny(tmp_path_factory.mktemp("small-vocab") / "llama", "llama",
                     word_tokenizer=True, vocab_size=1024, **overrides)


def _run(path, graphs: bool, overlap_on: bool, fail_at: int = -1, seeded: bool = True,
         n: int = MAX_BS, kv_splits: int = 2):
    """Greedy and seeded requests to completion; ``fail_at``: the run (counted from 0)
    whose forward raises after its replay, as a fault after the graph would; the step is
    then retried, as ``engine_process`` does not (it fails the running requests), so that
    the in-flight batch's pending ids are used again."""
    # two decode splits (by default), not eight: a quarter of the interpreted attention programs
    engine = LLMEngine(EngineConfig(model=str(path), fused_ops=True, attention_backend="triton",
                                    max_num_seqs=MAX_BS, max_num_batched_tokens=64,
                                    max_model_len=128, overlap_schedule=overlap_on,
                                    attention_num_kv_splits=kv_splits))
    if graphs:
        engine.runner.capture_graphs(MAX_BS, engine.runner.model.config.hidden_size,
                                     torch.float32)

    rng = random.Random(0)
    for i in range(n):
        prompt = [rng.randrange(3, 200) for _ in range(rng.randrange(3, 12))]
        params = {"max_tokens": rng.randrange(4, 9), "ignore_eos": True, "temperature": 0.0}
        if seeded and i % 3 == 0:  # seeded sampling: sampled rows go into a copy of the tokens
            params.update(temperature=0.9, seed=i, top_k=50)
        engine.add_request(f"r{i}", prompt, SamplingParams(**params))
    seen = {"replays": 0, "pending": 0, "kernel_writes": 0, "applied": 0}
    real_run, table = engine.runner.run, engine.cache.table
    real_apply = table.apply_staged

    def apply_staged():
        seen["applied"] += table.staged is not None
        real_apply()

    table.apply_staged = apply_staged

    def run(batch, *args):
        seen["pending"] += bool(args and args[0] is not None)
        staged, applied = table.staged, seen["applied"]
        logits, hidden = real_run(batch, *args)
        runner = engine.runner
        if runner.replayed:
            seen["replays"] += 1
            # the page-table writes of this step were made by the input kernel
            seen["kernel_writes"] += staged is not None and seen["applied"] == applied
            assert torch.equal(runner.last_greedy, logits.argmax(-1))
            if seen["replays"] == fail_at + 1:
                with torch.inference_mode():  # what a later replay would leave there
                    runner.last_greedy.fill_(7)
                raise RuntimeError("injected fault after the replay")
        return logits, hidden

    engine.runner.run = run
    tokens = {f"r{i}": [] for i in range(n)}
    while engine.has_unfinished_requests():
        try:
            outs = engine.step()
        except RuntimeError as exc:
            assert "injected" in str(exc)
            seen["failed"] = seen.get("failed", 0) + 1
            continue
        for out in outs:
            tokens[out.rid] += out.new_token_ids
    engine.cache.check_idle()
    return tokens, seen


def test_packed_replays_and_graph_greedy_tokens_equal_the_eager_engine(small_vocab_llama,
                                                                       emulated_graphs):
    """Overlap scheduling on: the synchronous step takes the same greedy tokens through
    ``LLMEngine._sample`` (a line of ``LLMEngine.step``; on the H200: test_cuda_graphs)."""
    want, _ = _run(small_vocab_llama, graphs=False, overlap_on=False)
    got, seen = _run(small_vocab_llama, graphs=True, overlap_on=True)
    assert got == want
    assert seen["replays"] > 5 and seen["pending"] > 5  # pending ids went through the kernel
    # and so did every replay's page-table writes (PageTable.stage), not a copy and scatter
    assert seen["kernel_writes"] == seen["replays"]


def test_a_step_that_raises_after_the_replay_leaves_the_pending_ids_intact(
        small_vocab_llama, emulated_graphs, monkeypatch):
    """All greedy, so the in-flight batch's tokens view the graph's greedy buffer, which a
    step's replay overwrites: here two steps raise afterwards, one from the forward and a
    later one from the host copy of its tokens. Retried, each must feed the in-flight
    batch's real tokens (its host copy) as pending ids: the same tokens as a run without
    the faults (the eager engine's: the test above holds the graphs to them)."""
    # one decode split (split decode under the graphs is the test above's)
    want, _ = _run(small_vocab_llama, graphs=False, overlap_on=False, seeded=False, kv_splits=1)
    real_copy, calls = overlap._host_copy, []

    def host_copy(tokens, ring):
        calls.append(1)
        if len(calls) == 7:
            with torch.inference_mode():  # what a later replay would leave there
                tokens.fill_(7)
            raise RuntimeError("injected fault in the host copy")
        return real_copy(tokens, ring)

    monkeypatch.setattr(overlap, "_host_copy", host_copy)
    got, seen = _run(small_vocab_llama, graphs=True, overlap_on=True, fail_at=3, seeded=False,
                     kv_splits=1)
    assert seen["failed"] == 2 and got == want


def test_a_rank_that_never_samples_captures_no_argmax(small_vocab_llama, emulated_graphs):
    """``capture_graphs(with_greedy=False)`` (tensor-parallel worker ranks): the graphs return no
    greedy tokens, so they launch no argmax; the default graphs of a plain model do."""
    engine = LLMEngine(EngineConfig(model=str(small_vocab_llama), fused_ops=True,
                                    attention_backend="triton", max_num_seqs=MAX_BS,
                                    max_model_len=64, attention_num_kv_splits=1))
    hidden = engine.runner.model.config.hidden_size
    for greedy in (False, True):
        engine.runner.capture_graphs(MAX_BS, hidden, torch.float32, with_greedy=greedy)
        graphs = engine.runner.graphs
        assert graphs.with_greedy is greedy
        assert all((out[2] is not None) is greedy for out in graphs.outputs.values())


def test_graph_logits_equal_eager_logits_and_fall_back_where_eager_splits_k(
        small_vocab_llama, monkeypatch):
    """``compute_logits_greedy`` (the decode graphs' LM head) returns ``compute_logits``'s
    logits bit for bit and their argmax: fused when ``decode_linear`` would not split the
    LM head along K, else (forced here) the plain LM head and the separate argmax. It also
    honours an instance's own ``compute_logits``, and an LM head that is not a plain
    ``nn.Linear`` (tensor parallelism's gathering head) is never on the fast path."""
    import sys

    dl = sys.modules["latentserve.ops.kernels.decode_linear"]
    engine = LLMEngine(EngineConfig(model=str(small_vocab_llama), fused_ops=True,
                                    attention_backend="triton", max_num_seqs=8,
                                    max_model_len=64, attention_num_kv_splits=2))
    model = engine.runner.model
    hidden = torch.randn(5, model.config.hidden_size, generator=torch.Generator().manual_seed(0))
    fused = []
    real = dl.decode_linear_argmax
    monkeypatch.setattr(dl, "decode_linear_argmax",
                        lambda *a, **kw: fused.append(1) or real(*a, **kw))
    with torch.inference_mode():
        assert model.lm_head_fast(hidden)
        logits, ids = model.compute_logits_greedy(hidden)
        assert fused == [1] and torch.equal(logits, model.compute_logits(hidden))
        assert torch.equal(ids, logits.argmax(-1))
        real_pick = dl.pick_tiling
        monkeypatch.setattr(dl, "pick_tiling", lambda *a, **kw: (*real_pick(*a, **kw)[:2], 2))
        logits, ids = model.compute_logits_greedy(hidden)
        assert fused == [1] and torch.equal(logits, model.compute_logits(hidden))
        assert torch.equal(ids, logits.argmax(-1))
        monkeypatch.setattr(dl, "pick_tiling", real_pick)
        monkeypatch.setattr(model, "compute_logits", lambda h: torch.zeros(h.shape[0], 3))
        logits, ids = model.compute_logits_greedy(hidden)
        assert fused == [1] and logits.shape == (5, 3) and ids.eq(0).all()
        monkeypatch.setattr(model, "lm_head", type("Gathering", (torch.nn.Linear,), {})(4, 4))
        assert not model.lm_head_fast(hidden)
