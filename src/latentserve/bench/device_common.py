"""Pieces shared by the device benchmarks: sync, copy bandwidth, CUDA graph timing and
profiles, engines, the bandwidth floor, output agreement. Seconds, bytes, bytes/s."""

from __future__ import annotations

import gc
import time

from latentserve.config import EngineConfig


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


_best_bandwidth: dict = {}  # CUDA device -> the best copy bandwidth measured (bytes/s)


def copy_bandwidth(device: str = "cuda", iters: int = 20) -> float:
    """Bytes moved (read + written) per second by ``iters`` copies on ``device``: on CUDA of
    2 GiB, the best of 5 timings and of earlier calls on the device; on the CPU one timing of
    64 MiB copies."""
    import torch

    cuda = device.startswith("cuda")
    nbytes = 2 << 30 if cuda else 64 << 20
    free_memory(device)
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)

    def copies():
        for _ in range(iters):
            dst.copy_(src)

    best = max(2 * nbytes * iters / timed(device, copies)[1] for _ in range(5 if cuda else 1))
    if not cuda:
        return best
    key = torch.cuda.current_device()
    _best_bandwidth[key] = max(_best_bandwidth.get(key, 0.0), best)
    return _best_bandwidth[key]


def time_graph(fn, calls: int = 1, replays: int = 200):
    """Capture ``calls`` calls of ``fn`` (after one warm-up call) in a CUDA graph and time
    ``replays`` replays. Returns ``(microseconds per call, graph)``."""
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
    """Microseconds per replay of a CUDA ``graph`` over ``replays`` (after ``warmup``)."""
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
    """Device ops of one replay of a CUDA ``graph`` (``torch.profiler``): ``device_ops``,
    ``top`` names, ``busy_us``, ``top_by_time_us``, ``first_ops_us`` (24, start order);
    ``{"error"}`` when the profiler fails (a profiler gap must not lose a benchmark)."""
    import collections

    import torch
    from torch.profiler import ProfilerActivity, profile

    graph.replay()
    torch.cuda.synchronize()
    try:
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            graph.replay()
            torch.cuda.synchronize()
    except Exception as exc:  # noqa: BLE001 - reported in the result
        return {"error": f"{type(exc).__name__}: {exc}"}
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
    from latentserve.engine.llm_engine import LLMEngine  # torch: bench serve's parser imports us

    return LLMEngine(EngineConfig(model=str(path), device=device, dtype=dtype,
                                  max_num_seqs=max_num_seqs, max_model_len=max_model_len, **kw))


def timed(device: str, fn, *args):
    """``(fn(*args), seconds)``, the device synced before and after."""
    sync(device)
    t0 = time.perf_counter()
    result = fn(*args)
    sync(device)
    return result, time.perf_counter() - t0


def param_bytes(*modules) -> int:
    """Bytes of the distinct parameters of ``modules`` (a tied weight counts once)."""
    return sum({p.data_ptr(): p.numel() * p.element_size()
                for m in modules for p in m.parameters()}.values())


def kv_floor(model, batch: int, ctx: float, bw: float, kv_dtype) -> dict:
    """Bytes a decode step of ``batch`` rows at ``ctx`` tokens of context must read (each
    parameter and each row's KV once) and its time ``floor_s`` at ``bw`` bytes/s."""
    from latentserve.kvcache.pool import KVPool

    layers, kvh, hd = model.kv_shape
    weights = param_bytes(model)
    kv = batch * ctx * KVPool.bytes_per_slot(layers, kvh, hd, kv_dtype)
    return {"weights_bytes": weights, "kv_bytes": kv, "floor_s": (weights + kv) / bw}


def agreement(engine_outputs, reference_outputs) -> float:
    """Mean fraction of each reference output matched by the engine's output for the same
    prompt before their first difference (1.0: identical)."""
    fr = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
          / max(len(b), 1) for a, b in zip(engine_outputs, reference_outputs)]
    return sum(fr) / max(len(fr), 1)
