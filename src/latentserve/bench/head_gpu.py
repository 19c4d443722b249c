"""Compression-head benchmark: the engine's closed-loop latent decoding against the eager
single-request reference, and a latent step against a plain one (method: benchmarks/head_gpu.py)."""

from __future__ import annotations

import json
import time
from pathlib import Path

from latentserve.bench.device_common import free_memory, make_engine, run_suite, timed

# Head config per backbone: latent_dim, source_layer (0-based decoder layer whose output is
# the anchor). Upstream's DeepSeek-V4 head is hidden 4096 -> latent 1024 with the anchor at
# layer 35 of 43 (~0.8 depth); SmolLM2 takes latent 128 (issue 6), Llama-3.2-1B hidden / 4.
# mlp_dim is the bundle default hidden / 2.
HEADS = {"smollm2-135m": {"latent_dim": 128, "source_layer": 23},
         "llama-3.2-1b": {"latent_dim": 512, "source_layer": 12}}
TINY_SHAPE = {"hidden_size": 64, "num_hidden_layers": 3, "num_attention_heads": 4,
              "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": 1024}
TINY_HEAD = {"latent_dim": 16, "source_layer": 1}
THINK_OPEN, THINK_CLOSE = "w5 w6 w7", "w8"  # word-tokenizer ids (5, 6, 7) and (8,)


def build_head_model(root: Path, name: str) -> Path:
    """A random backbone ``name`` (a ``bench.gpu.SHAPES`` key, or ``tiny``: a 3-layer
    hidden-64 Llama on the CPU) with a random closed-loop head bundle in its directory."""
    from latentserve.latent.bundle import random_bundle, write_bundle
    from latentserve.latent.head import HEAD_BUNDLE_NAME

    if name == "tiny":
        from latentserve.bench.baseline.tiny_models import save_tiny

        path, head, hidden = save_tiny(root, "llama", word_tokenizer=True, **TINY_SHAPE), \
            TINY_HEAD, TINY_SHAPE["hidden_size"]
    else:
        from latentserve.bench.gpu import SHAPES, save_random_llama

        path, head, hidden = save_random_llama(root, SHAPES[name]), HEADS[name], \
            SHAPES[name]["hidden_size"]
    bundle = random_bundle(hidden, head["latent_dim"], source_layer=head["source_layer"],
                           seed=0, injection="closed_loop", think_open=THINK_OPEN,
                           think_close=THINK_CLOSE)
    write_bundle(bundle, path / HEAD_BUNDLE_NAME)
    return path


def _params(max_latent: int, answer_len: int, n_close: int, thinking: bool = True):
    from latentserve.sampling_params import SamplingParams

    if not thinking:
        return SamplingParams(max_tokens=answer_len, temperature=0.0, ignore_eos=True,
                              thinking=False)
    return SamplingParams(max_tokens=max_latent + n_close + answer_len, temperature=0.0,
                          ignore_eos=True, thinking=True, max_latent=max_latent,
                          min_latent=0, use_stop=False, min_output_tokens=0)


def _engine(path: Path, device: str, dtype: str, max_seqs: int, max_len: int, **kw):
    return make_engine(path, device, dtype, max_seqs, max_len,
                       kv_slots=(max_seqs + 1) * max_len, **kw)


def _kv_floor(engine, batch: int, mean_ctx: float, bw: float) -> dict:
    """Bandwidth floor (s) of one decode step of ``batch`` rows at context ``mean_ctx``:
    every parameter of the model (backbone + head) and each row's KV read once."""
    from latentserve.bench.device_common import param_bytes
    from latentserve.kvcache.pool import KVPool

    model = engine.runner.model
    layers, kvh, hd = model.kv_shape
    per_tok = KVPool.bytes_per_slot(layers, kvh, hd, engine.config.torch_dtype)
    weights = param_bytes(model)
    kv = batch * mean_ctx * per_tok
    return {"weights_bytes": weights, "kv_bytes": kv, "floor_s": (weights + kv) / bw}


def step_cost(engine, bare, prompts, open_ids, max_latent: int, device: str,
              rounds: int = 1) -> dict:
    """Steady step time (s) of ``len(prompts)`` rows in the latent phase against the same
    rows decoding plain tokens at the same positions, in the head engine and (when ``bare``
    is an engine) on the bare backbone. ``rounds`` > 1 alternates the phases and reports each
    one's median (per-round figures in ``rounds``), so drift cannot pass for the head's cost."""
    import statistics

    from latentserve.bench.device_common import drive

    n_close = len(engine.latent_spec.end_ids)
    plain_prompts = [p + list(open_ids) for p in prompts]
    samples = {"latent": [], "plain": [], "bare": []}
    lat = None
    for _ in range(rounds):
        # NOTE: every phase starts from an empty prefix cache, so none pays for evicting
        # the earlier phases' cached prompts (nor reuses them): like is compared with like.
        engine.cache.radix.reset()
        lat = drive(engine, prompts, _params(max_latent, 1, n_close), device, "lat")
        samples["latent"].append(lat["step_s"].get("latent"))
        engine.cache.radix.reset()
        plain = drive(engine, plain_prompts, _params(0, max_latent + 1, 0, False), device,
                      "pln")
        samples["plain"].append(plain["step_s"].get("decode"))
        if bare is not None:
            bare.cache.radix.reset()
            b = drive(bare, plain_prompts, _params(0, max_latent + 1, 0, False), device,
                      "bare")
            samples["bare"].append(b["step_s"].get("decode"))
    med = {k: statistics.median(v) for k, v in samples.items() if v}
    out = {"batch": len(prompts), "latent_steps": lat["steps"].get("latent", 0),
           "latent_step_s": med["latent"], "plain_step_s": med["plain"],
           "latent_graph_steps": lat["graph_steps"]}
    out["latent_over_plain_pct"] = 100 * (out["latent_step_s"] / out["plain_step_s"] - 1)
    if bare is not None:
        out["bare_backbone_step_s"] = med["bare"]
        out["latent_over_bare_pct"] = 100 * (out["latent_step_s"]
                                             / out["bare_backbone_step_s"] - 1)
    if rounds > 1:
        out["rounds"] = {k: v for k, v in samples.items() if v}
    return out


def head_replay_us(head, hidden: int, rows: int, iters: int = 200) -> dict:
    """Device time (microseconds) of one replay of a CUDA graph holding only the head's
    serve path (``LatentHead.serve_outputs``) for ``rows`` bf16 anchors: the IEEE float32
    torch modules (``torch_fp32``) against the fused 3xTF32 ``small_linear`` launches
    (``small_linear_tf32x3``, the default); ``<name>_kernels``: one replay's device ops
    (``device_common.profile_replay``)."""
    import torch

    from latentserve.bench.device_common import profile_replay, time_graph

    x = torch.randn(rows, hidden, device="cuda", dtype=torch.bfloat16)
    out = {}
    for name, fused in (("torch_fp32", False), ("small_linear_tf32x3", True)):
        out[name], graph = time_graph(lambda f=fused: head.serve_outputs(x, fused=f),
                                      replays=iters)
        try:
            out[f"{name}_kernels"] = profile_replay(graph)
        except Exception as exc:  # noqa: BLE001 - a profiler gap must not lose the benchmark
            out[f"{name}_kernels"] = {"error": f"{type(exc).__name__}: {exc}"}
        del graph
    return out


def bench_shape(name: str, root: Path, device: str, dtype: str, concurrency, prompt_len: int,
                max_latent: int, answer_len: int, ref_requests: int, bw: float,
                bare_baseline: bool = True, step_rounds: int = 1) -> dict:
    """One backbone + head: engine at each concurrency, latent-step cost, then the eager
    reference (after the engines are freed). Returns a JSON-able dict."""
    import torch

    from latentserve.bench.baseline import head_reference as hr
    from latentserve.bench.device_common import agreement, drive

    t_build = time.perf_counter()
    path = build_head_model(root / name, name)
    t_build = time.perf_counter() - t_build
    n_open, n_close = len(THINK_OPEN.split()), len(THINK_CLOSE.split())
    max_len = prompt_len + n_open + max_latent + n_close + answer_len + 8
    max_c = max(concurrency)
    t0 = time.perf_counter()
    engine = _engine(path, device, dtype, max_c, max_len)
    t_engine = time.perf_counter() - t0
    print(f"[head {name}] model written in {t_build:.1f} s, engine ready in {t_engine:.1f} s",
          flush=True)
    spec = engine.latent_spec
    g = torch.Generator().manual_seed(0)

    def rand_prompts(c):
        return torch.randint(3, 1000, (c, prompt_len), generator=g).tolist()

    sp = _params(max_latent, answer_len, n_close)
    # Warm-up at full concurrency (prefill and extend kernels), short lengths.
    drive(engine, rand_prompts(max_c), _params(2, 2, n_close), device, "warm")
    engine.cache.radix.reset()
    rows, outputs = {}, {}
    for c in concurrency:
        prompts = rand_prompts(c)
        r = drive(engine, prompts, sp, device, f"c{c}")
        outputs[c] = (prompts, r.pop("outputs"))
        r["answer_tok_s"] = r["tokens"] / r["wall_s"]
        r["req_s"] = c / r["wall_s"]
        rows[c] = r
        print(f"[head {name}] engine c={c}: {r['wall_s']:.3f} s, "
              f"{r['answer_tok_s']:.1f} answer tok/s", flush=True)
    floor = _kv_floor(engine, max_c, prompt_len + n_open + max_latent / 2, bw)
    bare = None
    if bare_baseline:
        # NOTE: scheduled like the head engine (both overlap on CUDA by default), so the
        # bare baseline compares like with like
        bare = _engine(path, device, dtype, max_c, max_len, no_latent_head=True,
                       overlap_schedule=engine.config.overlap_schedule)
    cost = step_cost(engine, bare, rand_prompts(max_c), spec.start_ids, max_latent, device,
                     step_rounds)
    cost.update(floor)
    if device.startswith("cuda"):
        head = engine.runner.model.latent_head
        cost["head_replay_us"] = head_replay_us(head, head.config.hidden_size, max_c)
    cost["latent_step_over_floor"] = cost["latent_step_s"] / floor["floor_s"]
    print(f"[head {name}] step cost: {json.dumps(cost)}", flush=True)
    del engine, bare
    free_memory(device)
    # Eager reference, one request at a time.
    ref_kw = {"mode": "closed_loop", "max_latent": max_latent, "min_latent": 0,
              "use_stop": False, "max_tokens": max_latent + n_close + answer_len,
              "eos_ids": (), "dtype": dtype, "device": device, "reuse_bundle": True}
    bundle = path / "latent_reasoning_head.safetensors"
    ref_prompts, ref_engine_out = outputs[max_c][0][:ref_requests], \
        outputs[max_c][1][:ref_requests]
    hr.head_reference_generate(path, bundle, rand_prompts(1)[0], spec.start_ids, spec.end_ids,
                               **{**ref_kw, "max_latent": 2, "max_tokens": 2 + n_close + 2})
    ref_out, ref_s = timed(device, lambda: [
        hr.head_reference_generate(path, bundle, p, spec.start_ids, spec.end_ids,
                                   **ref_kw)["tokens"] for p in ref_prompts])
    ref_req_s = ref_s / len(ref_prompts)
    hr._hf_model.cache_clear()
    hr._bundle_cached.cache_clear()
    free_memory(device)
    print(f"[head {name}] reference: {ref_req_s:.3f} s per request", flush=True)
    for c in concurrency:
        rows[c]["reference_s_per_request"] = ref_req_s
        rows[c]["reference_answer_tok_s"] = answer_len / ref_req_s
        rows[c]["speedup"] = rows[c]["answer_tok_s"] / rows[c]["reference_answer_tok_s"]
    if name == "tiny":
        backbone = TINY_SHAPE
    else:
        from latentserve.bench.gpu import SHAPES

        backbone = SHAPES[name]
    head = {**HEADS.get(name, TINY_HEAD), "mlp_dim": backbone["hidden_size"] // 2}
    return {"backbone": backbone, "head": head, "build_s": t_build, "engine_init_s": t_engine,
            "max_model_len": max_len, "concurrency": rows, "step_cost": cost,
            "reference_requests": len(ref_prompts),
            "agree_with_reference": agreement(ref_engine_out, ref_out)}


def run_head_bench(shapes=tuple(HEADS), device: str = "cuda", dtype: str = "bfloat16",
                   concurrency=(1, 16, 64), prompt_len: int = 128, max_latent: int = 32,
                   answer_len: int = 32, ref_requests: int = 3, bare_baseline: bool = True,
                   command: str | None = None, step_rounds: int = 1) -> dict:
    """Every shape in ``shapes`` (``HEADS`` keys, or ``("tiny",)``); see the module
    docstring. Returns the JSON-able result with the config it ran."""
    config = {"device": device, "dtype": dtype, "head_dtype": "float32",
              "concurrency": list(concurrency), "prompt_len": prompt_len,
              "step_rounds": step_rounds, "think_open_ids": len(THINK_OPEN.split()),
              "think_close_ids": len(THINK_CLOSE.split()), "max_latent": max_latent,
              "min_latent": 0, "use_stop": False, "answer_len": answer_len, "ignore_eos": True,
              "ref_requests": ref_requests, "cuda_graphs": device.startswith("cuda"),
              "goal": ">= 30x at 64 concurrent; latent step within 10% of plain"}
    return run_suite("shapes", shapes, lambda name, root, bw: bench_shape(
        name, root, device, dtype, concurrency, prompt_len, max_latent, answer_len,
        ref_requests, bw, bare_baseline, step_rounds), device, command, config)
