"""What every family's benchmark shares (``bench --suite families``): models built in a
scratch directory, the engine's decode step at each concurrency against its bandwidth floor,
the eager reference, a latent step against a plain one. Seconds, bytes, tokens/s.

Design notes: docs/internals.md, "latentserve.bench.families".
"""

from __future__ import annotations

import inspect
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch

from latentserve.bench.device_common import (
    agreement,
    copy_bandwidth,
    free_memory,
    kv_floor,
    make_engine,
    timed,
)
from latentserve.bench.drive import drive
from latentserve.bench.offline import machine_info
from latentserve.sampling_params import SamplingParams


def run_suite(family, models, device: str = "cuda", concurrency=(1, 16, 64),
              command: str | None = None, **options) -> dict:
    """``family.bench_model(name, root, bw, device, concurrency, **options)`` (``family``: a
    suite module; options not given take ``bench_model``'s defaults) for each of ``models``
    in a scratch directory. Returns ``{command, date, machine, config, copy_bandwidth_Bps,
    models: {name: result}, total_s}``; ``config``: device, dtype, concurrency, cuda_graphs,
    the options and ``family.NOTES``."""
    t_start = time.perf_counter()
    params = inspect.signature(family.bench_model).parameters.values()
    options = {**{p.name: p.default for p in params if p.default is not p.empty}, **options}
    bw = copy_bandwidth(device)
    config = {"device": device, "dtype": dtype_for(device), "concurrency": list(concurrency),
              "cuda_graphs": device.startswith("cuda"), **options, **family.NOTES}
    out = {"command": command, "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
           "machine": {**machine_info(), "device": device}, "config": config,
           "copy_bandwidth_Bps": bw, "models": {}}
    with tempfile.TemporaryDirectory() as d:
        for name in models:
            out["models"][name] = family.bench_model(name, Path(d), bw, device, concurrency,
                                                     **options)
            shutil.rmtree(Path(d) / name, ignore_errors=True)  # 7.6 GB for Huginn
            free_memory(device)
            print(json.dumps({name: out["models"][name]}, indent=1), flush=True)
    out["total_s"] = time.perf_counter() - t_start
    return out


def dtype_for(device: str) -> str:
    """The suites' dtype: bfloat16 on CUDA, float32 on the CPU."""
    return "bfloat16" if device.startswith("cuda") else "float32"


def greedy(n: int, **kw) -> SamplingParams:
    """``n`` greedy tokens, EOS ignored (``kw``: other ``SamplingParams`` fields)."""
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, **kw)


def random_batches(concurrency, prompt_len: int, seed: int = 0) -> dict[int, list[list[int]]]:
    """Per concurrency c, c prompts of ``prompt_len`` ids drawn from ``[3, 1000)``, all
    distinct draws of one generator seeded ``seed``."""
    g = torch.Generator().manual_seed(seed)
    return {c: torch.randint(3, 1000, (c, prompt_len), generator=g).tolist()
            for c in concurrency}


def suite_engine(path, device: str, concurrency, max_len: int, **kw):
    """``make_engine`` for the largest of ``concurrency`` with KV room for one more row."""
    max_c = max(concurrency)
    return make_engine(path, device, dtype_for(device), max_c, max_len,
                       kv_slots=(max_c + 1) * max_len, **kw)


def engine_rows(engine, params, batches: dict, device: str, bw: float, warm_params,
                on_add=None, floor=kv_floor) -> tuple[dict, dict]:
    """Warm up on every batch of ``batches`` (``{c: prompts}``) with ``warm_params``, then
    drive each with ``params``. ``rows[c]``: ``drive``'s result with ``tok_s`` (output
    tokens/s), ``decode_step_s`` (the decode steps' steady mean; None without any),
    ``bandwidth_floor`` (``floor(model, c, ctx, bw, kv_dtype)`` at the decode steps' mean
    context; a dict with ``floor_s``) and ``step_over_floor``; with CUDA graphs also
    ``graph_replay_s`` and ``replay_over_floor``; ``outputs[c]``: ``(prompts, engine
    outputs)``. Prints a line per batch; returns ``(rows, outputs)``."""
    for prompts in batches.values():
        drive(engine, prompts, warm_params, device, "warm", on_add)
    engine.cache.radix.reset()
    rows, outputs = {}, {}
    for c, prompts in batches.items():
        r = rows[c] = drive(engine, prompts, params, device, f"c{c}", on_add)
        outputs[c] = (prompts, r.pop("outputs"))
        step, replay = r["step_s"].get("decode"), r.get("replay_s", {}).get("decode")
        fl = None if step is None else floor(engine.runner.model, c, r["ctx"]["decode"], bw,
                                             engine.config.torch_dtype)
        r.update(tok_s=r["tokens"] / r["wall_s"], decode_step_s=step, bandwidth_floor=fl,
                 step_over_floor=step / fl["floor_s"] if fl else None)
        if replay is not None:
            r.update(graph_replay_s=replay, replay_over_floor=replay / fl["floor_s"])
        print(f"[{engine.model_name}] c={c}: {r['wall_s']:.3f} s, {r['tok_s']:.1f} tok/s, "
              f"step {step} s, x floor {r['step_over_floor']}", flush=True)
    engine.cache.check_idle()
    return rows, outputs


def reference(rows: dict, outputs: dict, generate, device: str, requests: int,
              output_len: int, timed_len: int | None = None) -> dict:
    """The eager reference ``generate(prompt, n) -> n greedy ids`` one request at a time on
    the first ``requests`` prompts of the largest concurrency, timed at ``timed_len`` tokens
    (fewer than ``output_len``: extrapolated from the time at 1). Returns ``{requests,
    timed_tokens, s_per_request, tok_s, agree_with_engine}``; sets each row's ``speedup``."""
    timed_len = timed_len or output_len
    prompts, engine_out = outputs[max(outputs)]
    prompts = prompts[:requests]
    generate(prompts[0][:8], 2)
    per_req, ref_out = [], []
    for p in prompts:
        out, t = timed(device, generate, p, timed_len)
        if timed_len < output_len:
            _, t1 = timed(device, generate, p, 1)
            t = t1 + (output_len - 1) * (t - t1) / (timed_len - 1)
        ref_out.append(out)
        per_req.append(t)
    s = sum(per_req) / len(per_req)
    ref = {"requests": len(prompts), "timed_tokens": timed_len, "s_per_request": s,
           "tok_s": output_len / s,
           "agree_with_engine": agreement([o[:timed_len] for o in engine_out], ref_out)}
    for r in rows.values():
        r["speedup"] = r["tok_s"] / ref["tok_s"]
    print(f"reference: {s:.3f} s per request", flush=True)
    return ref


def step_cost(engine, latent, plain, device: str, bw: float, bare=None, rounds: int = 1) -> dict:
    """Steady step time (s) of a batch in its latent phase against plain decoding at the same
    positions: ``latent``, ``plain`` are ``(prompts, params)`` for ``drive`` (``plain`` also on
    ``bare`` when given), medians over ``rounds`` alternations; with the latent step's
    ``bandwidth_floor`` and ``latent_step_over_floor``."""
    samples: dict[str, list] = {"latent": [], "plain": [], "bare": []}
    lat = None
    for _ in range(rounds):
        # NOTE: every phase starts from an empty prefix cache, so none pays for evicting
        # the earlier phases' cached prompts (nor reuses them): like is compared with like.
        engine.cache.radix.reset()
        lat = drive(engine, *latent, device, "lat")
        samples["latent"].append(lat["step_s"].get("latent"))
        for key, eng in (("plain", engine), ("bare", bare)):
            if eng is not None:
                eng.cache.radix.reset()
                samples[key].append(drive(eng, *plain, device, key)["step_s"].get("decode"))
    med = {k: statistics.median(v) for k, v in samples.items() if v}
    batch = len(latent[0])
    fl = kv_floor(engine.runner.model, batch, lat["ctx"]["latent"], bw,
                  engine.config.torch_dtype)
    out = {"batch": batch, "latent_steps": lat["steps"].get("latent", 0),
           "latent_step_s": med["latent"], "plain_step_s": med["plain"],
           "latent_graph_steps": lat["graph_steps"], "bandwidth_floor": fl,
           "latent_step_over_floor": med["latent"] / fl["floor_s"],
           "latent_over_plain_pct": 100 * (med["latent"] / med["plain"] - 1)}
    if bare is not None:
        out["bare_backbone_step_s"] = med["bare"]
        out["latent_over_bare_pct"] = 100 * (med["latent"] / med["bare"] - 1)
    if rounds > 1:
        out["rounds"] = {k: v for k, v in samples.items() if v}
    print(f"[{engine.model_name}] step cost: {json.dumps(out)}", flush=True)
    return out
