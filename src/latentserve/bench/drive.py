"""One batch through an engine, each step timed under its phase (``step_kind``); on CUDA
also each graph replay and overlap wait (``Probe``). Seconds."""

from __future__ import annotations

import contextlib
import gc
import importlib
import importlib.util
import time
from collections import defaultdict

import torch

from latentserve.bench.device_common import sync
from latentserve.core import ReqStatus
from latentserve.engine import overlap


def step_kind(engine) -> str:
    """The phase of the next ``engine.step()``: ``latent``, ``decode`` (every row one
    position of it), ``mixed`` (both) or ``other`` (prefill, extend, a block pass)."""
    s = engine.scheduler
    if s.waiting or not s.running or any(r.num_pending != 1 for r in s.running):
        return "other"
    latent = [r.answer_start is None for r in s.running]
    if all(latent):
        return "latent"
    return "mixed" if any(latent) else "decode"


class Probe:
    """While open, times each CUDA graph replay of ``engine`` and each overlap-scheduler wait
    under the caller's ``kind``, and records Triton compiles and GC collections; the patches
    are undone on exit."""

    def __init__(self, engine):
        self.engine, self.kind = engine, "other"
        self.events: list = []  # (kind, start event, end event)
        self.waits: list = []  # (kind, seconds)
        self.compiles: list = []

    def __enter__(self):
        graphs, events = self.engine.runner.graphs, self.events

        def timed(replay):
            def timed_replay(*args, **kwargs):
                start, end = torch.cuda.Event(True), torch.cuda.Event(True)
                start.record()
                out = replay(*args, **kwargs)
                end.record()
                events.append((self.kind, start, end))
                return out
            return timed_replay

        def finish(engine, launched):
            if launched.event is not None:
                s = time.perf_counter()
                launched.event.synchronize()
                self.waits.append((self.kind, time.perf_counter() - s))
            return self.real_finish(engine, launched)

        self.real_finish, overlap.finish = overlap.finish, finish
        graphs.replay, graphs.replay_packed = timed(graphs.replay), timed(graphs.replay_packed)
        self.knobs = importlib.util.find_spec("triton") and importlib.import_module("triton.knobs")
        if self.knobs:  # a compile in a timed run would count as serving time
            self.knobs.runtime.jit_post_compile_hook = \
                lambda **kw: self.compiles.append(kw["repr"][:160])
        self.gc0 = [g["collections"] for g in gc.get_stats()]
        return self

    def __exit__(self, *exc) -> None:
        for name in ("replay", "replay_packed"):  # back to the class methods
            self.engine.runner.graphs.__dict__.pop(name, None)
        overlap.finish = self.real_finish
        if self.knobs:
            self.knobs.runtime.jit_post_compile_hook = None

    def summary(self) -> dict:
        """``replay_s`` (mean per kind), ``jit_compiles``, ``gc_collections``; after decode
        replays ``replay_p50_s`` and ``slowest_replays`` (``(index, seconds)``, the 8 longest
        decode replays in order of launch: a slow step with a slow replay waited on the
        device); after decode waits, ``overlap_wait_s`` (mean) and ``host_bound_frac``
        (share under 20 us)."""
        torch.cuda.synchronize()
        replays: dict[str, list[float]] = defaultdict(list)
        for kind, a, b in self.events:
            replays[kind].append(a.elapsed_time(b) / 1e3)
        out = {"replay_s": {k: sum(v) / len(v) for k, v in replays.items()},
               "jit_compiles": self.compiles,
               "gc_collections": [g["collections"] - b
                                  for g, b in zip(gc.get_stats(), self.gc0)]}
        decode = replays.get("decode")
        if decode:
            out["replay_p50_s"] = sorted(decode)[(len(decode) - 1) // 2]
            out["slowest_replays"] = sorted(enumerate(decode), key=lambda x: -x[1])[:8]
        waits = [w for kind, w in self.waits if kind == "decode"]
        if waits:
            out["overlap_wait_s"] = sum(waits) / len(waits)
            out["host_bound_frac"] = sum(w < 20e-6 for w in waits) / len(waits)
        return out


def drive(engine, prompts, params, device: str, tag: str, on_add=None) -> dict:
    """Queue every prompt with ``params`` (``on_add(req)`` on each) and step to completion.
    Returns ``wall_s``, ``tokens``, ``outputs`` (prompt order), ``thought_s`` (until every
    request left its latent phase, or None), ``graph_steps``; per ``step_kind`` ``steps``,
    ``step_s`` (steady mean) and ``ctx`` (mean context per row); the decode steps'
    ``step_p50_s``, ``step_p90_s``, ``step_max_s``, ``slowest_steps``; ``Probe.summary``."""
    rids = [f"{tag}-{engine._arrivals}-{i}" for i in range(len(prompts))]
    graphs0, reqs = engine.runner.num_graph_steps, []
    probe = Probe(engine) if engine.runner.graphs is not None else None
    toks: dict[str, list[int]] = {r: [] for r in rids}
    times: dict[str, list[float]] = defaultdict(list)
    ctx: dict[str, list[float]] = defaultdict(list)
    thought = None
    with probe or contextlib.nullcontext():
        sync(device)
        t0 = time.perf_counter()
        for rid, p in zip(rids, prompts):
            engine.add_request(rid, p, params)
            reqs.append(engine.scheduler.waiting[-1])
            if on_add is not None:
                on_add(reqs[-1])
        thinking = [r for r in reqs if r.answer_start is None]
        while engine.has_unfinished_requests():
            kind = step_kind(engine)
            running = engine.scheduler.running
            ctx[kind].append(sum(r.seq_len for r in running) / max(len(running), 1))
            if probe is not None:
                probe.kind = kind
            s = time.perf_counter()
            outs = engine.step()
            times[kind].append(time.perf_counter() - s)
            for o in outs:
                toks[o.rid] += o.new_token_ids
            if thought is None and thinking and all(
                    r.answer_start is not None or r.status is ReqStatus.FINISHED
                    for r in thinking):
                sync(device)
                thought = time.perf_counter() - t0
        sync(device)
        wall = time.perf_counter() - t0
    steady = {k: (v[1:-1] if len(v) > 2 else v) for k, v in times.items()}
    out = {"wall_s": wall, "tokens": sum(len(t) for t in toks.values()),
           "outputs": [toks[r] for r in rids], "thought_s": thought,
           "step_s": {k: sum(v) / len(v) for k, v in steady.items()},
           "steps": {k: len(v) for k, v in times.items()},
           "ctx": {k: sum(v) / len(v) for k, v in ctx.items()},
           "graph_steps": engine.runner.num_graph_steps - graphs0}
    decode = times.get("decode")
    if decode:
        ranked = sorted(decode)
        out.update(step_p50_s=ranked[(len(ranked) - 1) // 2],
                   step_p90_s=ranked[int(0.9 * (len(ranked) - 1))], step_max_s=ranked[-1],
                   slowest_steps=sorted(enumerate(decode), key=lambda x: -x[1])[:8])
    if probe is not None:
        out.update(probe.summary())
    return out
