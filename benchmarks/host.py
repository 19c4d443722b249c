"""Host work of a decode step: what the engine spends per step outside the model.

A tiny random Llama serves ``batch`` requests that all decode; the model's work is taken
out so only the host side is timed: on CUDA the decode graphs are replaced by no-ops (the
input copies into the graphs' static buffers still run; outputs are the capture-time
buffers), on CPU the forward returns zeros and the logits are 8 zero columns (so sampling
times the host path, not an argmax over the vocabulary), with torch on one thread. Reports the
median engine step, its 90th and 99th percentiles and maximum, and the median of its parts
(scheduling, ``ModelRunner.run``, sampling, the next latent inputs, postprocess), in
microseconds.

``--latent feedback`` (a tiny COCONUT Llama), ``--latent head`` (a tiny Llama with a random
closed-loop compression-head bundle, ``bench.head_gpu.build_head_model``) or ``--latent colar``
(the checkout's ``models/smollm2-mult-colar``, SmolLM2-135M's shape) times the same
batch twice in one engine: ``steps`` latent steps (every row in its latent phase, so each
step injects the previous step's latent vectors) and ``steps`` plain decode steps (latent
budget 0 / thinking off, same prompt length), and reports both (``latent`` and ``plain``
dicts) and ``latent_over_plain_pct`` of the median step. The head's MLPs are stubbed too on
CPU (``latent_input``, ``stop_prob`` and ``serve_outputs`` return zeros; on CUDA they run
inside the no-op graphs); the engine's own latent host code (phase machines, vector
bookkeeping, injection) runs for real.

Run: ``python -m benchmarks.host [--device cuda] [--batch 64] [--steps 200]
[--latent feedback|head|colar] [--overlap | --no-overlap]`` (the CUDA engine overlaps by default,
the CPU one does not; ``--overlap`` on the CPU times the host path a GPU step takes).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from benchmarks.common import parser, write_json

_SLACK = 16  # latent budget beyond the timed steps (prefill chunks end on different steps)


class _NoReplay:
    """Stands in for a captured ``torch.cuda.CUDAGraph``: replay does nothing."""

    def replay(self) -> None:
        pass


def time_calls(obj, name: str, sink: dict):
    """Wrap ``obj.name`` so each call's wall time (seconds) is appended to ``sink[name]``;
    returns the original, for the caller to put back."""
    fn = getattr(obj, name)

    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            sink.setdefault(name, []).append(time.perf_counter() - start)

    setattr(obj, name, wrapper)
    return fn


def step_until_all_decode(engine) -> None:
    """Step ``engine`` until nothing waits and every running request decodes one id."""
    sched = engine.scheduler
    while sched.waiting or any(r.num_pending != 1 for r in sched.running):
        engine.step()


def steady_step_ms(engine, steps: int, warm: int = 4) -> float:
    """Mean wall time (ms) of ``steps`` engine steps once every request decodes
    (:func:`step_until_all_decode`, then ``warm`` steps); no device sync between steps, one
    before and after on CUDA."""
    import torch

    step_until_all_decode(engine)
    for _ in range(warm):
        engine.step()
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        engine.step()
    if cuda:
        torch.cuda.synchronize()
    return (time.perf_counter() - t0) * 1e3 / steps


def abort_all(engine) -> None:
    """Abort every running request and step until the engine is empty."""
    for r in list(engine.scheduler.running):
        engine.abort_request(r.rid)
    while engine.has_unfinished_requests():
        engine.step()


def _build(root: Path, latent: str | None) -> Path:
    """The tiny model directory: a plain Llama, a COCONUT Llama (``feedback``; latent budget
    up to 512) or a Llama with a random closed-loop head bundle (``head``)."""
    if latent is None:
        from latentserve.bench.baseline.tiny_models import save_tiny

        return save_tiny(root / "llama", "llama")
    if latent == "feedback":
        from latentserve.bench.baseline.latent_models import save_latent_tiny

        return save_latent_tiny(root / "coconut", "coconut-llama", max_budget=512)
    if latent == "head":
        from latentserve.bench.head_gpu import build_head_model

        return build_head_model(root / "head", "tiny")
    if latent == "colar":
        from latentserve.models.checkpoint import find_models_dir

        models = find_models_dir()
        if models is None or not (models / "smollm2-mult-colar").is_dir():
            raise RuntimeError("--latent colar serves the checkout's models/smollm2-mult-colar, "
                               "which is not here (a wheel install has no models/)")
        return models / "smollm2-mult-colar"
    raise ValueError(f"latent must be None, 'feedback', 'head' or 'colar', got {latent!r}")


def _params(latent: str | None, engine, thinking: bool, n: int):
    """Sampling params of ``n`` decode steps: latent steps when ``thinking`` (every step of
    the timed window in the latent phase), else plain tokens (budget 0 / thinking off)."""
    from latentserve.sampling_params import SamplingParams

    if latent == "head":
        from latentserve.bench.head_gpu import _params as head_params

        return head_params(n if thinking else 0, n + 1, len(engine.latent_spec.end_ids),
                           thinking)
    if latent == "colar":  # the stub logits never name ###: the cap ends the phase
        return SamplingParams(max_tokens=n + 1, temperature=0.0, ignore_eos=True,
                              max_latent=n if thinking else 0)
    budget = (n if thinking else 0) if latent == "feedback" else None
    return SamplingParams(max_tokens=n + 1, temperature=0.0, ignore_eos=True,
                          latent_budget=budget)


def _time_steps(engine, params, batch: int, steps: int, prompt_len: int, tag: str,
                latent_phase: bool) -> dict:
    """Admit ``batch`` requests, prefill them, then time ``steps`` engine steps (all decode
    rows; all in the latent phase when ``latent_phase``); the requests are aborted after."""
    for i in range(batch):
        engine.add_request(f"{tag}{i}", [5 + (i * 7 + j) % 500 for j in range(prompt_len)],
                           params)
    sched = engine.scheduler
    step_until_all_decode(engine)
    runner = engine.runner
    parts: dict = {}
    originals = [(obj, name, time_calls(obj, name, parts)) for obj, name in (
        (sched, "schedule"), (runner, "run"), (engine, "_sample"),
        (engine.family, "latent_inputs"), (sched, "postprocess"))]
    total = []
    try:
        for _ in range(steps):
            start = time.perf_counter()
            engine.step()
            total.append(time.perf_counter() - start)
    finally:
        for obj, name, fn in originals:
            setattr(obj, name, fn)
    in_phase = [r.answer_start is None for r in sched.running]
    if latent_phase and not (len(in_phase) == batch and all(in_phase)):
        raise RuntimeError("a row left its latent phase inside the timed window")
    abort_all(engine)

    def med(xs):
        return statistics.median(xs) * 1e6

    ranked = sorted(total)
    return {"steps": len(total), "step_us": med(total),
            "step_p90_us": ranked[int(0.9 * (len(ranked) - 1))] * 1e6,
            "step_p99_us": ranked[int(0.99 * (len(ranked) - 1))] * 1e6,
            "step_max_us": ranked[-1] * 1e6,
            **{f"{k}_us": med(v) for k, v in parts.items()}}


def run_host_bench(device: str = "cpu", batch: int = 64, steps: int = 200,
                   prompt_len: int = 100, latent: str | None = None,
                   overlap: bool | None = None) -> dict:
    """Median host time per decode step (us) and of its parts; see the module docstring.
    ``batch`` requests of ``prompt_len`` ids decode for ``steps`` timed steps. ``latent``
    (``"feedback"``, ``"head"`` or ``"colar"``): time latent steps and plain steps of the same
    batch.
    ``overlap``: the overlap scheduler on or off (None: the device's default, on for CUDA
    only)."""
    import torch

    from latentserve.config import EngineConfig
    from latentserve.engine.llm_engine import LLMEngine

    with tempfile.TemporaryDirectory() as d:
        path = _build(Path(d), latent)
        engine = LLMEngine(EngineConfig(model=str(path), device=device, max_num_seqs=batch,
                                        kv_slots=batch * 512, overlap_schedule=overlap))
    runner, model = engine.runner, engine.runner.model
    if runner.graphs is not None:
        runner.graphs.graphs = {k: _NoReplay() for k in runner.graphs.graphs}
    else:
        torch.set_num_threads(1)  # host work is one Python thread; no OpenMP spin on shared CPUs
        hidden = model.config.hidden_size
        model.forward = lambda ids, pos, *a: torch.zeros(ids.shape[0], hidden)
        model.compute_logits = lambda h: torch.zeros(h.shape[0], 8)
        head = getattr(model, "latent_head", None)
        if latent in ("head", "colar") and head is not None:
            # a stop head gives probabilities; CoLaR's stop is a sampled token (None)
            probs = head.has_stop and head.stop_token is None
            head.latent_input = lambda a: torch.zeros(a.shape[0], hidden)
            head.stop_prob = lambda a: torch.zeros(a.shape[0])
            head.serve_outputs = lambda a: (torch.zeros(a.shape[0], hidden),
                                            torch.zeros(a.shape[0]) if probs else None)
    # Room for the opening ids, the steps (+ slack), the closing ids and one answer token.
    steps = max(2, min(steps, engine.max_model_len - prompt_len - 8 - _SLACK))
    base = {"device": device, "batch": batch, "graphs": runner.graphs is not None,
            "overlap": engine.config.use_overlap_schedule}
    if latent is None:
        res = _time_steps(engine, _params(None, engine, False, steps + _SLACK), batch, steps - 1,
                          prompt_len, "h", False)
        return {**base, **res}
    # Latent steps first, then plain steps over the same prompts in the same engine. The
    # budgets leave slack: rows whose prefill chunk came first start decoding earlier.
    lat = _time_steps(engine, _params(latent, engine, True, steps + _SLACK), batch,
                      steps - 1, prompt_len, "lat", True)
    plain = _time_steps(engine, _params(latent, engine, False, steps + _SLACK), batch,
                        steps - 1, prompt_len, "pln", False)
    return {**base, "latent_kind": latent, "latent": lat, "plain": plain,
            "latent_over_plain_pct": 100 * (lat["step_us"] / plain["step_us"] - 1)}


def main(argv=None) -> int:
    ap = parser("host", __doc__)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--latent", choices=["feedback", "head", "colar"], default=None,
                    help="also time latent steps of this kind against plain steps")
    ap.add_argument("--overlap", action=argparse.BooleanOptionalAction, default=None,
                    help="the overlap scheduler on or off (default: on for CUDA only)")
    a = ap.parse_args(argv)
    write_json(None, run_host_bench(a.device, a.batch, a.steps, latent=a.latent,
                                    overlap=a.overlap))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
