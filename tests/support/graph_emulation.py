"""CUDA graphs emulated on CPU, for tests: a "captured" graph re-runs its forward on replay
and writes into the outputs of the capture, as a real graph writes its static buffers."""

import contextlib

import torch

from latentserve import context
from latentserve.context import set_context
from latentserve.engine import cuda_graph
from latentserve.engine.cuda_graph import CudaGraphRunner


class _ReplayedForward:
    """Stands in for ``torch.cuda.CUDAGraph``: ``replay()`` re-runs the captured forward."""

    capturing = None

    def __init__(self):
        self.rerun = None

    def pool(self):
        return None

    def replay(self):
        self.rerun()


@contextlib.contextmanager
def _capture(graph, pool=None, capture_error_mode=None):
    _ReplayedForward.capturing = graph
    try:
        yield
    finally:
        _ReplayedForward.capturing = None


def _replayable(fn):
    """``fn(self, *args)`` (a decode graph's forward) that, under capture, makes
    the capturing graph's replay re-run it into the outputs it returned (a tensor or a
    tuple of them), under the forward context of the capture."""

    def wrapped(self, *args):
        out = fn(self, *args)
        graph = _ReplayedForward.capturing
        if graph is not None:
            ctx = context._CTX

            @torch.inference_mode()
            def rerun():  # into the capture's outputs, as the graph's static buffers
                set_context(ctx)
                try:
                    new = fn(self, *args)
                finally:
                    set_context(None)
                pairs = [(out, new)] if isinstance(out, torch.Tensor) else zip(out, new)
                for old, fresh in pairs:
                    if old is not None:
                        old.copy_(fresh)

            graph.rerun = rerun
        return out

    return wrapped


def emulate_graphs(monkeypatch) -> None:
    """CUDA graphs emulated for this test (``_ReplayedForward``), one bucket: the largest."""
    monkeypatch.setattr(torch.cuda, "CUDAGraph", _ReplayedForward)
    monkeypatch.setattr(torch.cuda, "graph", _capture)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    monkeypatch.setattr(CudaGraphRunner, "_forward", _replayable(CudaGraphRunner._forward))
    # one bucket (fewer captures in the interpreter); smaller batches replay it padded
    monkeypatch.setattr(cuda_graph, "graph_buckets", lambda max_bs: [max_bs])
