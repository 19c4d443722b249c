"""GPU benchmark: the engine against HF ``generate`` on real-size random-weight shapes (bf16),
and the decode step against the memory-bandwidth floor. Seconds, output tokens/s, bytes/s."""

from __future__ import annotations

import gc
import json
import platform
import tempfile
import time
from pathlib import Path

from latentserve.bench.device_common import free_memory, make_engine, profile_replay

SHAPES = {
    "smollm2-135m": dict(hidden_size=576, num_hidden_layers=30, num_attention_heads=9,
                         num_key_value_heads=3, intermediate_size=1536, vocab_size=49152,
                         tie_word_embeddings=True, rope_theta=100000.0,
                         max_position_embeddings=8192),
    "llama-3.2-1b": dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=32,
                         num_key_value_heads=8, head_dim=64, intermediate_size=8192,
                         vocab_size=128256, tie_word_embeddings=True,
                         rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0,
                                          "factor": 32.0, "low_freq_factor": 1.0,
                                          "high_freq_factor": 4.0,
                                          "original_max_position_embeddings": 8192},
                         max_position_embeddings=131072),
}


def save_random_llama(out_dir: Path, shape: dict) -> Path:
    """A random-weight Llama checkpoint of ``shape`` in bf16 with a word-level tokenizer."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from latentserve.bench.baseline.tiny_models import save_word_tokenizer

    cfg = LlamaConfig(bos_token_id=1, eos_token_id=2, **shape)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(out_dir)
    save_word_tokenizer(out_dir)
    return out_dir


_best_bandwidth: dict = {}  # (device, nbytes) -> the best copy bandwidth measured (bytes/s)


def copy_bandwidth(nbytes: int = 2 << 30, iters: int = 20, rounds: int = 5) -> float:
    """Device-to-device copy bandwidth in bytes moved (read + written) per second: the best
    of ``rounds`` timings of ``iters`` copies and of every earlier call in this process on the
    same device and size (a later benchmark in one H200 process read ~10% slower)."""
    import torch

    torch.cuda.empty_cache()
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = 0.0
    for _ in range(rounds):
        start, end = torch.cuda.Event(True), torch.cuda.Event(True)
        start.record()
        for _ in range(iters):
            dst.copy_(src)
        end.record()
        torch.cuda.synchronize()
        best = max(best, 2 * nbytes * iters / (start.elapsed_time(end) / 1e3))
    key = (torch.cuda.current_device(), nbytes)
    _best_bandwidth[key] = max(_best_bandwidth.get(key, 0.0), best)
    return _best_bandwidth[key]


# _engine_run's keys on how the decode steps spread and whether the host set their pace
_STEP_SPREAD = ("step_p50_s", "step_p90_s", "step_max_s", "overlap_wait_s", "host_bound_frac",
                "slowest_steps", "gc_collections")


def _engine_run(engine, prompts, output_len):
    """One batch through the engine: tokens/s, wall time, decode-step host time (mean, p50,
    p90, max), graph replay device time, the 8 slowest steps, gc collections, and with
    overlap ``overlap_wait_s`` / ``host_bound_frac`` (waits under 20 us)."""
    import torch

    from latentserve.engine import overlap
    from latentserve.sampling_params import SamplingParams

    sp = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(f"b{time.monotonic_ns()}-{i}", p, sp)
    graphs, events = engine.runner.graphs, []

    def timed(replay):
        def timed_replay(*args, **kwargs):
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            out = replay(*args, **kwargs)
            end.record()
            events.append((start, end))
            return out
        return timed_replay

    real_finish, waits = overlap.finish, []

    def finish(engine_, launched):
        if launched.event is not None:
            s = time.perf_counter()
            launched.event.synchronize()
            waits.append(time.perf_counter() - s)
        return real_finish(engine_, launched)

    decode_times, decode_waits, n_out, compiles = [], [], 0, []
    knobs = _triton_knobs()
    try:  # NOTE: the patches below are undone in `finally`, whatever raises after them
        graphs.replay, graphs.replay_packed = timed(graphs.replay), timed(graphs.replay_packed)
        overlap.finish = finish
        if knobs is not None:  # Triton compiles in the timed run would count as serving time
            knobs.runtime.jit_post_compile_hook = lambda **kw: compiles.append(kw["repr"][:160])
        torch.cuda.synchronize()
        gc_before = [g["collections"] for g in gc.get_stats()]
        t0 = time.perf_counter()
        while engine.has_unfinished_requests():
            decode = not engine.scheduler.waiting and all(
                r.num_pending == 1 for r in engine.scheduler.running)
            s, n_waits = time.perf_counter(), len(waits)
            outs = engine.step()
            if decode:
                decode_times.append(time.perf_counter() - s)
                decode_waits.extend(waits[n_waits:])
            n_out += sum(len(o.new_token_ids) for o in outs)
    finally:
        for name in ("replay", "replay_packed"):  # back to the class methods
            graphs.__dict__.pop(name, None)
        overlap.finish = real_finish
        if knobs is not None:
            knobs.runtime.jit_post_compile_hook = None
    wall = time.perf_counter() - t0
    torch.cuda.synchronize()
    replays = [a.elapsed_time(b) / 1e3 for a, b in events]
    ranked = sorted(decode_times) or [0.0]
    out = {"tok_s": n_out / wall, "wall_s": wall, "jit_compiles": compiles,
           "step_s": sum(decode_times) / max(len(decode_times), 1),
           "step_p50_s": ranked[(len(ranked) - 1) // 2],
           "step_p90_s": ranked[int(0.9 * (len(ranked) - 1))], "step_max_s": ranked[-1],
           "replay_s": sum(replays) / max(len(replays), 1)}
    if decode_waits:
        out["overlap_wait_s"] = sum(decode_waits) / len(decode_waits)
        out["host_bound_frac"] = sum(w < 20e-6 for w in decode_waits) / len(decode_waits)
    # where the slow decode steps sit in the run, and Python's collections during it
    out["slowest_steps"] = sorted(enumerate(decode_times), key=lambda x: -x[1])[:8]
    out["gc_collections"] = [g["collections"] - b for g, b in zip(gc.get_stats(), gc_before)]
    return out


def _triton_knobs():
    try:
        from triton import knobs
    except ImportError:
        return None
    return knobs


def _kernels_per_replay(engine, bs: int) -> dict:
    """Device operations in one replay of the decode graph of batch ``bs``'s bucket
    (``device_common.profile_replay``), with the bucket."""
    try:
        graphs = engine.runner.graphs
        b = next(x for x in graphs.buckets if x >= bs)
        graph = graphs.graphs[graphs.graph_depths[0], b]
        graph.replay()  # re-runs the last step's inputs: same K/V into the same slots
        return {"bucket": b, **profile_replay(graph)}
    except Exception as exc:  # noqa: BLE001 - a profiler gap must not lose the benchmark
        return {"error": f"{type(exc).__name__}: {exc}"}


def _hf_run(model, prompts, output_len):
    import torch

    ids = torch.tensor(prompts, device="cuda")
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                   max_new_tokens=output_len, min_new_tokens=output_len, pad_token_id=0)
    torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    return len(prompts) * output_len / wall, wall


def _inject_cost(engine, bs: int, iters: int = 50) -> dict:
    """Replay time of a decode graph with the latent inject buffers bound vs without."""
    import torch

    from latentserve.engine.cuda_graph import CudaGraphRunner

    r = engine.runner
    hidden = r.graphs.embeds.shape[1]
    out = {}
    for capable in (True, False):
        g = CudaGraphRunner(r.model, r.backend, r.kv_pool, r.table, bs, hidden,
                            r.graphs.embeds.dtype, latent_capable=capable)
        z = torch.zeros(bs, dtype=torch.int64, device="cuda")
        kv = torch.full((bs,), 384, dtype=torch.int32, device="cuda")
        rows = torch.full((bs,), r.table.dummy_row, dtype=torch.int64, device="cuda")
        for _ in range(3):
            g.replay(z, z, rows, kv, z)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(iters):
            g.replay(z, z, rows, kv, z)
        torch.cuda.synchronize()
        out["with_inject_s" if capable else "without_inject_s"] = (time.perf_counter() - t0) / iters
    out["overhead_pct"] = 100 * (out["with_inject_s"] / out["without_inject_s"] - 1)
    return out


def run_gpu_bench(concurrency=(1, 16, 64), prompt_len=256, output_len=256,
                  shapes=tuple(SHAPES), hf_baseline=True, compare_unfused=True,
                  compare_overlap=True, kv_splits=()) -> dict:
    """Benchmark every shape; returns a JSON-able dict. Per shape and concurrency: engine
    throughput, decode step and graph replay time over the bandwidth floor, device ops per
    replay; at the largest concurrency also the ``unfused``, ``sync`` and ``kv_splits_N``
    variants."""
    import torch
    from transformers import AutoModelForCausalLM

    from latentserve.kvcache.pool import KVPool

    bw = copy_bandwidth()
    result = {"machine": {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__,
                          "python": platform.python_version()},
              "copy_bandwidth_Bps": bw, "prompt_len": prompt_len, "output_len": output_len,
              "shapes": {}}
    g = torch.Generator().manual_seed(0)
    for name in shapes:
        with tempfile.TemporaryDirectory() as d:
            path = save_random_llama(Path(d), SHAPES[name])
            max_len = prompt_len + output_len + 8
            engine = make_engine(path, "cuda", "bfloat16", max(concurrency), max_len)
            weights = sum(p.numel() * p.element_size()
                          for p in engine.runner.model.parameters())
            layers, kvh, hd = engine.runner.model.kv_shape
            per_slot = KVPool.bytes_per_slot(layers, kvh, hd, torch.bfloat16)
            rows = {}
            # warm-up: prefill at the real prompt length (cuBLAS GEMMs) and a short one
            # (decode-sized GEMMs), so no Triton compile lands in a timed run
            _engine_run(engine, torch.randint(3, 1000, (2, prompt_len), generator=g).tolist(), 8)
            _engine_run(engine, torch.randint(3, 1000, (3, 16), generator=g).tolist(), 8)
            mean_ctx = prompt_len + output_len / 2
            # Bytes a decode step must read (weights + the batch's KV) at the copy bandwidth.
            floor = {c: (weights + c * mean_ctx * per_slot) / bw for c in concurrency}
            for c in concurrency:
                prompts = torch.randint(3, 1000, (c, prompt_len), generator=g).tolist()
                r = _engine_run(engine, prompts, output_len)
                rows[c] = {"engine_tok_s": r["tok_s"], "engine_wall_s": r["wall_s"],
                           "jit_compiles_in_run": r["jit_compiles"],
                           "decode_step_s": r["step_s"], "graph_replay_s": r["replay_s"],
                           "bandwidth_floor_s": floor[c],
                           "step_over_floor": r["step_s"] / floor[c],
                           "replay_over_floor": r["replay_s"] / floor[c],
                           "kernels": _kernels_per_replay(engine, c),
                           **{k: r[k] for k in _STEP_SPREAD if k in r}}
            inject = _inject_cost(engine, max(concurrency))
            del engine
            free_memory("cuda")
            variants = ([("unfused", {"fused_ops": False})] if compare_unfused else []) + \
                ([("sync", {"overlap_schedule": False})] if compare_overlap else []) + \
                [(f"kv_splits_{s}", {"attention_num_kv_splits": s}) for s in kv_splits]
            for key, opts in variants:  # the largest concurrency again, one option changed
                c = max(concurrency)
                engine = make_engine(path, "cuda", "bfloat16", c, max_len, **opts)
                prompts = torch.randint(3, 1000, (c, prompt_len), generator=g).tolist()
                r = _engine_run(engine, prompts, output_len)
                rows[c][key] = {"engine_tok_s": r["tok_s"], "decode_step_s": r["step_s"],
                                "step_over_floor": r["step_s"] / floor[c],
                                "graph_replay_s": r["replay_s"],
                                "replay_over_floor": r["replay_s"] / floor[c],
                                "kernels": _kernels_per_replay(engine, c),
                                **{k: r[k] for k in _STEP_SPREAD if k in r}}
                del engine
                free_memory("cuda")
            if hf_baseline:
                hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).cuda()
                hf.eval()
                _hf_run(hf, torch.randint(3, 1000, (1, 16), generator=g).tolist(), 8)
                for c in concurrency:
                    prompts = torch.randint(3, 1000, (c, prompt_len), generator=g).tolist()
                    tps, _ = _hf_run(hf, prompts, output_len)
                    rows[c]["hf_padded_batch_tok_s"] = tps
                    rows[c]["speedup_vs_hf_batch"] = rows[c]["engine_tok_s"] / tps
                tps1, _ = _hf_run(hf, prompts[:1], output_len)
                for c in concurrency:
                    rows[c]["hf_batch1_tok_s"] = tps1
                    rows[c]["speedup_vs_hf_batch1"] = rows[c]["engine_tok_s"] / tps1
                del hf
                free_memory("cuda")
            result["shapes"][name] = {"weights_bytes": weights, "kv_bytes_per_token": per_slot,
                                      "concurrency": rows, "inject_cost": inject}
            print(json.dumps({name: result["shapes"][name]}, indent=1), flush=True)
    return result
