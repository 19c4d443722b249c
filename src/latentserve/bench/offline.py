"""Offline throughput: the engine (all prompts batched) against HF ``generate`` (one at a
time) on chat-templated GSM8K questions.

Design notes: docs/internals.md, "latentserve.bench.offline".
"""

from __future__ import annotations

import contextlib
import gc
import importlib
import importlib.util
import json
import os
import platform
import shlex
import sys
import time
from datetime import UTC, datetime
from importlib import resources

from latentserve.bench.device_common import sync, timed
from latentserve.eval.datasets import chat_prompt_ids
from latentserve.models.checkpoint import load_tokenizer, resolve_model_dir
from latentserve.sampling_params import SamplingParams

WARMUP_PROMPTS = 2
WARMUP_OUTPUT_LEN = 8
AGREEMENT_PROMPTS = 4


def load_questions() -> list[dict]:
    """The packaged GSM8K test questions: ``[{"question", "answer"}]`` (the final number)."""
    text = resources.files("latentserve").joinpath("data/questions.json").read_text("utf-8")
    return json.loads(text)["questions"]


def machine_info() -> dict:
    """Platform, CPU, library versions, threads, load average, OpenMP/MKL variables, GPU."""
    import torch
    import transformers

    cpu_model = platform.processor() or None
    with contextlib.suppress(OSError), open("/proc/cpuinfo", encoding="utf-8") as f:
        cpu_model = next((line.split(":", 1)[1].strip() for line in f
                          if line.startswith("model name")), cpu_model)
    triton = importlib.util.find_spec("triton") and importlib.import_module("triton")
    info = {
        "platform": platform.platform(),
        "machine": platform.machine(),
        "cpu_model": cpu_model,
        "cpu_count": os.cpu_count(),
        "cpus_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
        else os.cpu_count(),
        "torch_num_threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "triton": triton.__version__ if triton else None,
        "loadavg_1m": _loadavg(),
        # Threading knobs that change CPU results a lot on a shared machine.
        "env": {k: os.environ.get(k) for k in ("OMP_NUM_THREADS", "OMP_WAIT_POLICY",
                                                 "MKL_NUM_THREADS", "GOMP_SPINCOUNT")},
    }
    if torch.cuda.is_available():
        info["cuda_device"] = torch.cuda.get_device_name(0)
    return info


def _loadavg() -> float | None:
    """The 1-minute load average, None where unknown."""
    try:
        return round(os.getloadavg()[0], 2)
    except (AttributeError, OSError):
        return None


def _timed_run(generate, prompts, device: str) -> tuple[dict, list[list[int]]]:
    """``generate()`` (the output ids per prompt) timed after a GC: wall and CPU seconds,
    load averages, token counts and throughputs (tokens/s). Returns ``(rates, outputs)``."""
    gc.collect()
    load0, cpu0, t0 = _loadavg(), time.process_time(), time.perf_counter()
    tokens = generate()
    sync(device)
    wall, out = time.perf_counter() - t0, sum(map(len, tokens))
    total = out + sum(map(len, prompts))
    return {"wall_s": round(wall, 4), "cpu_s": round(time.process_time() - cpu0, 3),
            "loadavg_1m_before": load0, "loadavg_1m_after": _loadavg(),
            "output_tokens": out, "total_tokens": total,
            "output_tok_per_s": round(out / wall, 3),
            "total_tok_per_s": round(total / wall, 3)}, tokens


def _run_engine(model, prompts, warmup, output_len, device, dtype, seed
                ) -> tuple[dict, list[list[int]], list[int]]:
    from latentserve.entrypoints.llm import LLM  # torch: bench serve's parser imports us

    t0 = time.perf_counter()
    llm = LLM(model=model, device=device, dtype=dtype, seed=seed,
              max_num_seqs=max(64, len(prompts)))
    load_s = time.perf_counter() - t0

    def generate(ps, n):  # the ids per prompt; the request outputs left in outs
        outs[:] = llm.generate([{"prompt_token_ids": p} for p in ps], SamplingParams(
            max_tokens=n, temperature=0.0, ignore_eos=True), use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]

    outs: list = []
    warmup_s = timed(device, generate, warmup, WARMUP_OUTPUT_LEN)[1]
    res, tokens = _timed_run(lambda: generate(prompts, output_len), prompts, device)
    cfg = llm.engine.config
    res.update(load_s=round(load_s, 3), warmup_s=round(warmup_s, 3),
               prefix_cached_tokens=sum(o.num_cached_tokens for o in outs),
               max_num_seqs=cfg.max_num_seqs, max_num_batched_tokens=cfg.max_num_batched_tokens,
               enable_prefix_caching=cfg.enable_prefix_caching)
    eos = sorted(llm.engine.eos_ids)
    llm = None  # freed before the HF baseline loads
    gc.collect()
    return res, tokens, eos


def _run_hf(model_dir, prompts, output_len, device, dtype) -> tuple[dict, list[list[int]]]:
    import torch
    from transformers import AutoModelForCausalLM

    t0 = time.perf_counter()
    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=getattr(torch, dtype),
                                              local_files_only=True).to(device).eval()
    load_s = time.perf_counter() - t0
    pad = hf.generation_config.pad_token_id
    if pad is None:
        eos = hf.generation_config.eos_token_id
        pad = (eos[0] if isinstance(eos, (list, tuple)) else eos) or 0

    def gen(ids, n):
        x = torch.tensor([ids], device=device)
        with torch.inference_mode():
            out = hf.generate(x, attention_mask=torch.ones_like(x), do_sample=False,
                              max_new_tokens=n, min_new_tokens=n, pad_token_id=pad)
        return out[0, len(ids):].tolist()

    timed(device, gen, prompts[0], 4)  # warm-up, untimed
    res, tokens = _timed_run(lambda: [gen(p, output_len) for p in prompts], prompts, device)
    res.update(load_s=round(load_s, 3), batch_size=1)
    return res, tokens  # the model is freed with this frame


def _agreement(engine_tokens, hf_tokens, eos_ids) -> list[dict]:
    """Per prompt: tokens compared (up to the engine's first EOS), the common prefix, agree."""
    rows = []
    for i, (ours, theirs) in enumerate(zip(engine_tokens, hf_tokens)):
        n = min(next((j for j, t in enumerate(ours) if t in eos_ids), len(ours)), len(theirs))
        match = next((j for j in range(n) if ours[j] != theirs[j]), n)
        rows.append({"prompt": i, "compared_tokens": n, "matching_prefix_tokens": match,
                     "agree": match == n, "engine_hit_eos": n < len(ours)})
    return rows


def run_offline_bench(model: str | None = None, num_prompts: int = 32, output_len: int = 64,
                      device: str = "cpu", dtype: str = "float32", hf_baseline: bool = True,
                      seed: int = 0, command: str | None = None) -> dict:
    """Throughput of the engine and (``hf_baseline``) HF ``generate`` on ``num_prompts``
    GSM8K questions, ``output_len`` greedy tokens each (EOS ignored); ``model``: directory,
    ``.gguf`` or None (embedded). Returns ``engine``/``hf`` rates, ``speedup``,
    ``greedy_agreement``, prompt statistics, ``machine``. ValueError for a count < 1."""
    if num_prompts < 1 or output_len < 1:
        raise ValueError(f"num_prompts and output_len must be >= 1, got {num_prompts}, "
                         f"{output_len}")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    model_dir = resolve_model_dir(model)
    tokenizer = load_tokenizer(model_dir)
    qs = [q["question"] for q in load_questions()]
    prompts = [chat_prompt_ids(tokenizer, qs[i % len(qs)]) for i in range(num_prompts)]
    # Plain text: no chat-template prefix shared with the timed prompts (cold prefix cache).
    warmup = [list(tokenizer.encode(qs[(num_prompts + i) % len(qs)]))
              for i in range(WARMUP_PROMPTS)]
    lens = [len(p) for p in prompts]

    engine, engine_tokens, eos_ids = _run_engine(model, prompts, warmup, output_len, device,
                                                 dtype, seed)
    hf = agreement = None
    if hf_baseline:
        hf, hf_tokens = _run_hf(model_dir, prompts, output_len, device, dtype)
        agreement = _agreement(engine_tokens[:AGREEMENT_PROMPTS],
                               hf_tokens[:AGREEMENT_PROMPTS], set(eos_ids))
    speedup = round(engine["output_tok_per_s"] / hf["output_tok_per_s"], 3) if hf else None
    return {
        "benchmark": "offline_throughput",
        "command": command or " ".join(shlex.quote(a) for a in sys.argv),
        "timestamp": datetime.now(UTC).isoformat(timespec="seconds"),
        "model": model or "SmolLM2-135M-Instruct (embedded)",
        "model_dir": str(model_dir),
        "device": device,
        "dtype": dtype,
        "seed": seed,
        "num_prompts": num_prompts,
        "output_len": output_len,
        "prompt_source": "GSM8K test questions (latentserve/data/questions.json), chat template",
        "prompt_tokens": sum(lens),
        "prompt_len_mean": round(sum(lens) / len(lens), 2),
        "prompt_len_min": min(lens),
        "prompt_len_max": max(lens),
        "engine": engine,
        "hf": hf,
        "speedup": speedup,
        "greedy_agreement": agreement,
        "greedy_agree": None if agreement is None else all(r["agree"] for r in agreement),
        "eos_token_ids": eos_ids,
        "machine": machine_info(),
    }
