"""Pieces shared by the device benchmarks: sync, copy bandwidth, weight bytes, machine
description, engines, timing, the suite loop, and a step driver labelled by phase.
Units: seconds, bytes, bytes per second."""

from __future__ import annotations

import gc
import time


def sync(device: str) -> None:
    """Wait for queued device work (a no-op on the CPU)."""
    if device.startswith("cuda"):
        import torch

        torch.cuda.synchronize()


def free_memory(device: str) -> None:
    """Collect garbage and, on CUDA, hand the caching allocator's free blocks back."""
    gc.collect()
    if device.startswith("cuda"):
        import torch

        torch.cuda.empty_cache()


def copy_bandwidth_on(device: str, nbytes: int | None = None, iters: int = 20) -> float:
    """Copy bandwidth of ``device`` in bytes moved (read + written) per second. CUDA:
    ``bench.gpu.copy_bandwidth``; CPU: a ``nbytes`` (default 64 MiB) copy, only so the
    ``--tiny`` path runs (not a meaningful floor)."""
    if device.startswith("cuda"):
        from latentserve.bench.gpu import copy_bandwidth

        return copy_bandwidth(nbytes or 2 << 30, iters)
    import torch

    n = nbytes or 64 << 20
    src = torch.empty(n, dtype=torch.uint8)
    dst = torch.empty_like(src)
    dst.copy_(src)
    t0 = time.perf_counter()
    for _ in range(iters):
        dst.copy_(src)
    return 2 * n * iters / (time.perf_counter() - t0)


def time_graph(fn, calls: int = 1, replays: int = 200):
    """Capture ``calls`` back-to-back calls of ``fn`` (after one warm-up call outside the
    capture, which compiles or autotunes) in a CUDA graph and time ``replays`` replays
    with CUDA events. Returns ``(microseconds per call, graph)``."""
    import torch

    with torch.inference_mode():
        fn()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(calls):
                fn()
        us = time_replays(graph, replays)
    return us / calls, graph


def time_replays(graph, replays: int = 200, warmup: int = 1) -> float:
    """Microseconds per replay of a captured CUDA ``graph``: ``warmup`` replays, then
    ``replays`` back to back between two CUDA events."""
    import torch

    for _ in range(warmup):
        graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(True), torch.cuda.Event(True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / replays


def profile_replay(graph) -> dict:
    """Device operations in one replay of a captured CUDA ``graph`` (``torch.profiler``):
    ``device_ops``, ``top`` names, ``busy_us`` (summed device time), ``top_by_time_us`` and
    the first 24 in start order (``first_ops_us``), in microseconds."""
    import collections

    import torch
    from torch.profiler import ProfilerActivity, profile

    graph.replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        graph.replay()
        torch.cuda.synchronize()
    dev_events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    names = collections.Counter(e.name for e in dev_events)
    busy = collections.Counter()  # microseconds of device time per op name
    for e in dev_events:
        busy[e.name] += e.time_range.elapsed_us()
    out = {"device_ops": sum(names.values()), "top": names.most_common(12),
           "busy_us": sum(busy.values()),
           "top_by_time_us": [(k, round(v, 1)) for k, v in busy.most_common(12)],
           "first_ops_us": [(e.name[:60], round(e.time_range.elapsed_us(), 1)) for e in
                            sorted(dev_events, key=lambda e: e.time_range.start)[:24]]}
    if not names:
        out["note"] = "the profiler saw no device ops inside the graph replay"
    return out


def make_engine(path, device: str, dtype: str, max_num_seqs: int, max_model_len: int, **kw):
    """An ``LLMEngine`` over the model directory ``path`` (other ``EngineConfig`` options: kw)."""
    from latentserve.config import EngineConfig
    from latentserve.engine.llm_engine import LLMEngine

    return LLMEngine(EngineConfig(model=str(path), device=device, dtype=dtype,
                                  max_num_seqs=max_num_seqs, max_model_len=max_model_len, **kw))


def timed(device: str, fn, *args):
    """``(fn(*args), seconds)``, the device synced before and after."""
    sync(device)
    t0 = time.perf_counter()
    result = fn(*args)
    sync(device)
    return result, time.perf_counter() - t0


def run_suite(key: str, names, bench, device: str, command: str | None, config: dict) -> dict:
    """``bench(name, root, bandwidth)`` for each of ``names`` in a scratch directory, printed
    as it ends; returns ``{command, date, machine, config, copy_bandwidth_Bps, key: {name:
    result}, total_s}``."""
    import json
    import shutil
    import tempfile
    from pathlib import Path

    t_start = time.perf_counter()
    bw = copy_bandwidth_on(device)
    out = {"command": command, "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
           "machine": machine(device), "config": config, "copy_bandwidth_Bps": bw, key: {}}
    with tempfile.TemporaryDirectory() as d:
        for name in names:
            out[key][name] = bench(name, Path(d), bw)
            shutil.rmtree(Path(d) / name, ignore_errors=True)  # 7.6 GB for Huginn
            print(json.dumps({name: out[key][name]}, indent=1), flush=True)
    out["total_s"] = time.perf_counter() - t_start
    return out


def param_bytes(*modules) -> int:
    """Bytes of the distinct parameters of ``modules`` (a tied weight counts once)."""
    seen, total = set(), 0
    for m in modules:
        for p in m.parameters():
            if p.data_ptr() not in seen:
                seen.add(p.data_ptr())
                total += p.numel() * p.element_size()
    return total


def machine(device: str) -> dict:
    """``offline.machine_info()`` plus the device, the GPU name and triton's version."""
    from latentserve.bench.offline import machine_info

    info = machine_info()
    info["device"] = device
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        info["triton"] = None
    return info


def step_kind(engine) -> str:
    """The phase of the next ``engine.step()``: ``latent`` (all rows in a head's latent
    phase), ``decode`` (all one ordinary token), ``mixed`` (both) or ``other`` (queue,
    prefill or extend)."""
    s = engine.scheduler
    if s.waiting or not s.running or any(r.num_pending != 1 for r in s.running):
        return "other"
    latent = [r.state is not None and r.answer_start is None for r in s.running]
    if all(latent):
        return "latent"
    return "mixed" if any(latent) else "decode"


def drive(engine, prompts, params, device: str, tag: str) -> dict:
    """Queue every prompt with ``params`` at once and step to completion. Returns ``wall_s``,
    ``tokens``, ``outputs`` (per request, prompt order), ``step_s`` (mean steady step time per
    ``step_kind``: first and last dropped when more than 2), ``steps`` and ``graph_steps``."""
    rids = [f"{tag}-{engine._arrivals}-{i}" for i in range(len(prompts))]
    graphs0 = engine.runner.num_graph_steps
    sync(device)
    t0 = time.perf_counter()
    for rid, p in zip(rids, prompts):
        engine.add_request(rid, p, params)
    toks = {r: [] for r in rids}
    times: dict[str, list[float]] = {}
    while engine.has_unfinished_requests():
        kind = step_kind(engine)
        s = time.perf_counter()
        outs = engine.step()
        times.setdefault(kind, []).append(time.perf_counter() - s)
        for o in outs:
            toks[o.rid] += o.new_token_ids
    sync(device)
    wall = time.perf_counter() - t0
    steady = {k: (v[1:-1] if len(v) > 2 else v) for k, v in times.items()}
    return {"wall_s": wall, "tokens": sum(len(t) for t in toks.values()),
            "outputs": [toks[r] for r in rids],
            "step_s": {k: sum(v) / len(v) for k, v in steady.items()},
            "steps": {k: len(v) for k, v in times.items()},
            "graph_steps": engine.runner.num_graph_steps - graphs0}


def agreement(engine_outputs, reference_outputs) -> float:
    """Mean fraction of each reference output's tokens that the engine's output for the
    same prompt matches before their first difference (1.0 = identical). Informational in
    bf16: random weights give near-tied logits, and batched kernels round differently."""
    fr = []
    for a, b in zip(engine_outputs, reference_outputs):
        n = 0
        while n < min(len(a), len(b)) and a[n] == b[n]:
            n += 1
        fr.append(n / max(len(b), 1))
    return sum(fr) / max(len(fr), 1)
