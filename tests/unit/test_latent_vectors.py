"""Latent input vectors kept as ``(tensor, row)`` entries (``latent/vectors.py``) and how
``ModelRunner.run`` injects them: a slice of one tensor, one ``index_select``, or a stack."""

import pytest
import torch

from latentserve.config import EngineConfig
from latentserve.core import Req
from latentserve.latent import vectors
from latentserve.sampling_params import SamplingParams
from latentserve.scheduler.scheduler import ScheduledBatch


def test_stack_slices_consecutive_rows_and_gathers_the_rest():
    a, b = torch.randn(5, 3), torch.randn(2, 3)
    view = vectors.stack(vectors.as_rows(a)[1:4])
    assert view.data_ptr() == a[1].data_ptr()  # a slice, no copy
    torch.testing.assert_close(view, a[1:4])
    torch.testing.assert_close(vectors.stack([(a, 3), (a, 0)]), a[[3, 0]])
    torch.testing.assert_close(vectors.stack([(a, 2), (b, 1)]), torch.stack([a[2], b[1]]))
    assert vectors.common_source([(a, 0), (a, 4)]) is a
    assert vectors.common_source([(a, 0), (b, 0)]) is None
    torch.testing.assert_close(vectors.stack_at([1], [(b, 1)], 2), torch.stack([b[0] * 0, b[1]]))


@pytest.fixture(scope="module")
def spy_runner(tiny_dirs):
    """The tiny Llama's runner with a forward that records ``(input_embeds, latent_mask)``."""
    from latentserve.engine.llm_engine import LLMEngine

    engine = LLMEngine(EngineConfig(model=str(tiny_dirs["llama"]), max_num_seqs=8))
    runner, seen = engine.runner, []
    hidden = runner.model.config.hidden_size

    def forward(ids, pos, embeds=None, mask=None):
        seen.append((embeds, mask))
        return torch.zeros(ids.shape[0], hidden)

    runner.model.forward = forward
    return runner, seen


def _req(row: int, prompt_len: int, entries: list) -> Req:
    req = Req(f"r{row}", list(range(3, 3 + prompt_len)), SamplingParams(max_tokens=8))
    req.row, req.latent_start, req.latent_embeds = row, prompt_len, list(entries)
    req.output_ids = [7] * len(entries)
    return req


def _injected(runner, seen, reqs, starts, q_lens):
    seen.clear()
    runner.run(ScheduledBatch(reqs, starts, q_lens, [True] * len(reqs)))
    embeds, mask = seen[0]
    return embeds, mask


def _decode(reqs):
    return [r.latent_start + len(r.latent_embeds) - 1 for r in reqs], [1] * len(reqs)


def test_a_latent_decode_batch_injects_the_step_tensor_itself(spy_runner):
    runner, seen = spy_runner
    vecs = torch.randn(3, runner.model.config.hidden_size)
    reqs = [_req(i, 4, [(torch.randn(1, vecs.shape[1]), 0), (vecs, i)]) for i in range(3)]
    embeds, mask = _injected(runner, seen, reqs, *_decode(reqs))
    assert embeds.data_ptr() == vecs.data_ptr() and mask.tolist() == [True] * 3
    # Rows of one tensor in another order: gathered (one index_select).
    embeds, mask = _injected(runner, seen, reqs[::-1], *_decode(reqs[::-1]))
    torch.testing.assert_close(embeds, vecs[[2, 1, 0]])
    assert mask.tolist() == [True] * 3


def test_mixed_rows_and_several_tensors_get_the_right_vectors(spy_runner):
    runner, seen = spy_runner
    h = runner.model.config.hidden_size
    vecs, other = torch.randn(2, h), torch.randn(4, h)
    lat = [_req(0, 4, [(vecs, 1)]), _req(1, 5, [(vecs, 0)])]
    plain = _req(2, 4, [])
    starts, q_lens = _decode(lat)
    reqs = [lat[0], plain, lat[1]]
    embeds, mask = _injected(runner, seen, reqs, [starts[0], 3, starts[1]], [1, 1, 1])
    assert mask.tolist() == [True, False, True]
    torch.testing.assert_close(embeds[[0, 2]], vecs[[1, 0]])
    # A prefill chunk over prompt and latent positions, vectors of two steps' tensors, next
    # to a decode row: positions 2..6 of a 4-id prompt with 3 latents take rows 2, 3, 4.
    chunk = _req(3, 4, [(other, 0), (vecs, 0), (other, 3)])
    embeds, mask = _injected(runner, seen, [chunk, lat[0]], [2, starts[0]], [5, 1])
    assert mask.tolist() == [False, False, True, True, True, True]
    torch.testing.assert_close(embeds[2:], torch.stack([other[0], vecs[0], other[3], vecs[1]]))


class _CountingGraph:
    """A no-op stand-in for ``torch.cuda.CUDAGraph`` that counts its replays."""

    def __init__(self):
        self.n = 0

    def replay(self):
        self.n += 1


def _cpu_graph_runner(buckets: list[int], hidden: int):
    """A ``CudaGraphRunner`` over CPU buffers whose graphs are ``_CountingGraph``s (its
    bookkeeping without CUDA): static buffers for ``buckets[-1]`` rows, logits of width 8."""
    from latentserve.engine.cuda_graph import CudaGraphRunner
    from latentserve.latent.family import GraphHooks

    g = object.__new__(CudaGraphRunner)
    cap = buckets[-1]
    g.buckets, g.graph_depths, g.hooks, g.latent_capable = buckets, [0], GraphHooks(), True
    g.dummy_row = 0
    for name in ("ids", "pos", "rows", "out_slots"):
        setattr(g, name, torch.zeros(cap, dtype=torch.int64))
    g.kv_lens = torch.ones(cap, dtype=torch.int32)
    g.embeds, g.mask = torch.zeros(cap, hidden), torch.zeros(cap, dtype=torch.bool)
    g._mask_hi = g._mask_ones = 0
    g.graphs = {(0, b): _CountingGraph() for b in buckets}
    g.outputs = {(0, b): (torch.zeros(b, 8), torch.zeros(b, hidden), None) for b in buckets}
    return g


def test_graph_replay_keeps_the_static_mask_exact():
    """``CudaGraphRunner.replay``'s mask bookkeeping (plain steps skip the clear, all-latent
    steps skip the copy while it already holds), checked on CPU buffers with no-op graphs."""
    cap, h = 16, 4
    g = _cpu_graph_runner([4, 8, 16], h)
    fills = []
    mask_fill = torch.Tensor.fill_

    def step(n, kind):
        z = torch.zeros(n, dtype=torch.int64)
        if kind == "plain":
            g.replay(z, z, z, z, z)
            want = [False] * n
        elif kind == "all":
            g.replay(z, z, z, z, z, torch.full((n, h), 2.0), None, mask_all=True)
            want = [True] * n
        else:  # every other row
            m = torch.arange(n) % 2 == 0
            g.replay(z, z, z, z, z, torch.full((n, h), 3.0), m)
            want = m.tolist()
        assert g.mask.tolist() == want + [False] * (cap - n), (n, kind)
        if kind != "plain":
            assert g.embeds[:n].eq(2.0 if kind == "all" else 3.0).all()

    torch.Tensor.fill_ = lambda t, v: (fills.append(t.shape), mask_fill(t, v))[1]
    try:
        for n, kind in [(12, "all"), (12, "all"), (5, "all"), (5, "part"), (9, "all"),
                        (3, "plain"), (3, "plain"), (16, "part"), (6, "all"), (6, "all"),
                        (16, "plain"), (7, "all")]:
            step(n, kind)
    finally:
        torch.Tensor.fill_ = mask_fill
    # The repeated all-latent steps (12 then 12, 6 then 6) filled the mask once each.
    assert sum(1 for s in fills if s == (12,)) == 1 and sum(1 for s in fills if s == (6,)) == 1


def test_latent_outputs_are_the_replayed_graphs_rows():
    """``CudaGraphRunner.latent_outputs``: the latent module's outputs of the bucket just
    replayed (after the decode graph's logits, hidden and greedy tokens), sliced to the
    batch's rows; ``num_latent_replays`` counts the replays whose outputs were read, once
    each. Checked on CPU with counting no-op graphs."""
    h = 4
    g = _cpu_graph_runner([4, 8], h)
    g.head, g.feedback = object(), None  # a closed-loop head: (vectors, stop probabilities)
    g.outputs = {(0, b): (torch.zeros(b, 8), torch.zeros(b, h), None,
                          torch.arange(b * h, dtype=torch.float32).view(b, h) + b,
                          torch.arange(b, dtype=torch.float32)) for b in g.buckets}
    g._last, g._read, g.num_latent_replays = None, False, 0
    with pytest.raises(RuntimeError, match="replay first"):
        g.latent_outputs()
    z = torch.zeros(3, dtype=torch.int64)
    g.replay(z, z, z, z, z)  # 3 rows: bucket 4
    vecs, probs = g.latent_outputs()
    g.latent_outputs()  # the same step again: counted once
    assert vecs.shape == (3, h) and vecs[0, 0] == 4 and probs.tolist() == [0.0, 1.0, 2.0]
    assert (g.graphs[0, 4].n, g.num_latent_replays) == (1, 1)
    z = torch.zeros(6, dtype=torch.int64)
    g.replay(z, z, z, z, z)  # a plain step (nobody asks) ...
    g.replay(z, z, z, z, z)  # ... then one with latent rows
    vecs, _ = g.latent_outputs()
    assert vecs.shape == (6, h) and vecs[0, 0] == 8  # bucket 8's buffers
    assert (g.graphs[0, 8].n, g.num_latent_replays) == (2, 2)
    g.head, g.feedback = None, object()  # CODI's prj: one tensor
    g.outputs = {(0, b): (torch.zeros(b, 8), torch.zeros(b, h), None, torch.ones(b, h))
                 for b in g.buckets}
    g.replay(z[:2], z[:2], z[:2], z[:2], z[:2])
    assert g.latent_outputs().shape == (2, h) and g.num_latent_replays == 3
    g.head = g.feedback = None  # no latent module
    assert g.latent_outputs() is None
