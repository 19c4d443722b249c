"""Host work of a decode step: what the engine spends per step outside the model.

A tiny random Llama serves ``batch`` requests that all decode; the model's work is taken
out so only the host side is timed: on CUDA the decode graphs are replaced by no-ops (the
input copies into the graphs' static buffers still run; outputs are the capture-time
buffers), on CPU the forward returns zeros and the logits are 8 zero columns (so sampling
times the host path, not an argmax over the vocabulary), with torch on one thread. Reports the
median engine step and its parts (scheduling, ``ModelRunner.run``, sampling, postprocess),
in microseconds.

Run: ``python -m latentserve.bench.host [--device cuda] [--batch 64] [--steps 200]``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path


class _NoReplay:
    """Stands in for a captured ``torch.cuda.CUDAGraph``: replay does nothing."""

    def replay(self) -> None:
        pass


def _timed(obj, name: str, sink: dict) -> None:
    """Wrap ``obj.name`` so each call's wall time is appended to ``sink[name]``."""
    fn = getattr(obj, name)

    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            sink.setdefault(name, []).append(time.perf_counter() - start)

    setattr(obj, name, wrapper)


def run_host_bench(device: str = "cpu", batch: int = 64, steps: int = 200,
                   prompt_len: int = 100) -> dict:
    """Median host time per decode step (us) and of its parts; see the module docstring.
    ``batch`` requests of ``prompt_len`` ids decode for ``steps`` timed steps."""
    import torch

    from latentserve.config import EngineConfig
    from latentserve.engine.llm_engine import LLMEngine
    from latentserve.sampling_params import SamplingParams
    from latentserve.testing.tiny_models import save_tiny

    with tempfile.TemporaryDirectory() as d:
        path = save_tiny(Path(d) / "llama", "llama")
        engine = LLMEngine(EngineConfig(model=str(path), device=device, max_num_seqs=batch,
                                        kv_slots=batch * 512))
    runner, model = engine.runner, engine.runner.model
    if runner.graphs is not None:
        runner.graphs.graphs = {k: _NoReplay() for k in runner.graphs.graphs}
    else:
        torch.set_num_threads(1)  # host work is one Python thread; no OpenMP spin on shared CPUs
        hidden = model.config.hidden_size
        model.forward = lambda ids, pos, *a: torch.zeros(ids.shape[0], hidden)
        model.compute_logits = lambda h: torch.zeros(h.shape[0], 8)
    steps = min(steps, engine.max_model_len - prompt_len - 2)
    sp = SamplingParams(max_tokens=steps + 1, temperature=0.0, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"h{i}", [5 + (i * 7 + j) % 500 for j in range(prompt_len)], sp)
    while engine.scheduler.waiting or any(r.num_pending != 1 for r in engine.scheduler.running):
        engine.step()
    parts: dict = {}
    _timed(engine.scheduler, "schedule", parts)
    _timed(runner, "run", parts)
    _timed(engine, "_sample", parts)
    _timed(engine.scheduler, "postprocess", parts)
    total = []
    for _ in range(steps - 1):
        start = time.perf_counter()
        engine.step()
        total.append(time.perf_counter() - start)

    def med(xs):
        return statistics.median(xs) * 1e6

    return {"device": device, "batch": batch, "steps": len(total),
            "graphs": runner.graphs is not None, "step_us": med(total),
            **{f"{k}_us": med(v) for k, v in parts.items()}}


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--steps", type=int, default=200)
    a = ap.parse_args()
    print(json.dumps(run_host_bench(a.device, a.batch, a.steps), indent=1))
