"""Feedback-latent benchmark: concurrent COCONUT / CODI requests through the engine against
the eager per-request reference (``bench.baseline.latent_reference``); answer tokens/s."""

from __future__ import annotations

import json
import platform
import tempfile
import time
from pathlib import Path

from latentserve.bench.device_common import free_memory, make_engine, timed

GPT2_124M = dict(n_embd=768, n_layer=12, n_head=12, n_positions=1024, vocab_size=50257)


def build_coconut_gpt2(root: Path) -> Path:
    """COCONUT over a random GPT-2 124M-shaped base, written in the upstream form and
    converted; returns the model directory."""
    from latentserve.bench.baseline.latent_models import write_upstream_coconut
    from latentserve.latent.convert import convert_coconut

    base, ckpt = write_upstream_coconut(root, "gpt2", word_tokenizer=True, **GPT2_124M)
    return convert_coconut(base, ckpt, root / "model")


def build_codi_llama_1b(root: Path) -> Path:
    """CODI (LoRA r=128, alpha=32 as upstream's scripts; prj 2048) over a random Llama-3.2-1B
    shape; returns the converted model directory."""
    from latentserve.bench.baseline import latent_models
    from latentserve.bench.gpu import SHAPES, save_random_llama
    from latentserve.latent.convert import convert_codi

    base = save_random_llama(root / "base", SHAPES["llama-3.2-1b"])
    base, ckpt = latent_models.write_upstream_codi(root, "llama", "safetensors", lora_r=128,
                                                   lora_alpha=32.0, prj_dim=2048, base_dir=base)
    return convert_codi(base, ckpt, root / "model", lora_alpha=32.0)


def bench_one(model_dir: Path, device: str, dtype: str, concurrency, budget: int,
              answer_len: int, prompt_len: int = 64, ref_requests: int = 4) -> dict:
    """Engine answer tokens/s at each concurrency vs the reference one request at a time
    (measured on ``ref_requests`` requests; its throughput does not depend on concurrency)."""
    import torch

    from latentserve.bench.baseline.latent_reference import reference_generate
    from latentserve.sampling_params import SamplingParams

    g = torch.Generator().manual_seed(0)
    engine = make_engine(model_dir, device, dtype, max(concurrency),
                         prompt_len + budget + answer_len + 8,
                         kv_slots=None if device == "cuda" else 65536)
    sp = SamplingParams(max_tokens=answer_len, temperature=0.0, ignore_eos=True,
                        latent_budget=budget)
    rows = {}
    for c in (1, *concurrency):  # the first pass warms up
        prompts = torch.randint(3, 1000, (c, prompt_len), generator=g).tolist()
        for i, p in enumerate(prompts):
            engine.add_request(f"c{c}-{time.monotonic_ns()}-{i}", p, sp)
        t0, n = time.perf_counter(), 0
        while engine.has_unfinished_requests():
            n += sum(len(o.new_token_ids) for o in engine.step())
        rows[c] = {"engine_tok_s": n / (time.perf_counter() - t0), "answer_tokens": n}
    graph_steps = engine.runner.num_graph_steps
    del engine
    free_memory(device)  # the KV pool took most of the GPU
    prompts = torch.randint(3, 1000, (ref_requests + 1, prompt_len), generator=g).tolist()
    reference_generate(model_dir, prompts[0], budget, 2, device, dtype)  # load + warm up
    _, ref_s = timed(device, lambda: [
        reference_generate(model_dir, p, budget, answer_len, device, dtype, ignore_eos=True)
        for p in prompts[1:]])
    ref = ref_requests * answer_len / ref_s
    for c in concurrency:
        rows[c]["reference_tok_s"] = ref
        rows[c]["speedup"] = rows[c]["engine_tok_s"] / ref
    return {"budget": budget, "answer_len": answer_len, "prompt_len": prompt_len,
            "graph_steps": graph_steps, "concurrency": {c: rows[c] for c in concurrency}}


def latent_step_cost(model_dir: Path, device: str, dtype: str, batch: int = 64,
                     steps: int = 32) -> dict:
    """Mean engine-step time (s) of a decode batch whose rows are all latent steps against
    the same batch of plain answer-token rows, after the prefill; same prompts, same
    positions. The latent batch runs ``steps`` latent steps and 1 answer token; the plain one
    budget 0 and ``steps`` answer tokens."""
    import torch

    from latentserve.sampling_params import SamplingParams

    engine = make_engine(model_dir, device, dtype, batch, 64 + steps + 16,
                         kv_slots=None if device == "cuda" else 65536)
    prompts = torch.randint(3, 1000, (batch, 64), generator=torch.Generator().manual_seed(1))
    result = {}
    for name, budget, answer in (("warmup", steps, steps), ("latent", steps, 1),
                                 ("plain", 0, steps + 1)):
        sp = SamplingParams(max_tokens=answer, temperature=0.0, ignore_eos=True,
                            latent_budget=budget)
        for i, p in enumerate(prompts.tolist()):
            engine.add_request(f"{name}-{i}", p, sp)
        engine.step()  # prefill
        times = []
        while engine.has_unfinished_requests():
            t0 = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - t0)
        result[name] = sum(times[1:-1]) / max(len(times) - 2, 1)  # steady steps only
    del engine
    free_memory(device)
    return {"latent_step_s": result["latent"], "plain_step_s": result["plain"],
            "overhead_pct": 100 * (result["latent"] / result["plain"] - 1), "batch": batch}


def run_latent_bench(device: str = "cpu", concurrency=(32,), budget: int = 6,
                     answer_len: int = 32, codi: bool = False, only=None) -> dict:
    """COCONUT GPT-2 124M (and, with ``codi``, CODI Llama-3.2-1B) on ``device``; ``only``:
    a collection of model names to run (None: all)."""
    import torch

    dtype = "bfloat16" if device == "cuda" else "float32"
    out = {"machine": {"platform": platform.platform(), "python": platform.python_version(),
                       "torch": torch.__version__,
                       "gpu": torch.cuda.get_device_name(0) if device == "cuda" else None},
           "device": device, "dtype": dtype, "models": {}}
    with tempfile.TemporaryDirectory() as d:
        builds = [("coconut-gpt2-124m", build_coconut_gpt2)]
        if codi:
            builds.append(("codi-llama-3.2-1b", build_codi_llama_1b))
        for name, build in builds:
            if only and name not in only:
                continue
            path = build(Path(d) / name)
            out["models"][name] = bench_one(path, device, dtype, concurrency, budget,
                                            answer_len)
            free_memory(device)
            out["models"][name]["step_cost"] = latent_step_cost(path, device, dtype,
                                                                max(concurrency))
            free_memory(device)
            print(json.dumps({name: out["models"][name]}, indent=1), flush=True)
    return out
