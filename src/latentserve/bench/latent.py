"""Feedback-latent benchmark: COCONUT / CODI through the engine against the eager reference
(``baseline.latent_reference``), a latent step against a plain one; answer tokens/s."""

from __future__ import annotations

from functools import partial
from pathlib import Path

from latentserve.bench.baseline import latent_models
from latentserve.bench.baseline.latent_reference import load_reference, reference_generate
from latentserve.bench.device_common import free_memory
from latentserve.bench.gpu import SHAPES, save_random_llama
from latentserve.bench.suite import (
    dtype_for,
    engine_rows,
    greedy,
    random_batches,
    reference,
    step_cost,
    suite_engine,
)
from latentserve.latent.convert import convert_coconut, convert_codi

GPT2_124M = dict(n_embd=768, n_layer=12, n_head=12, n_positions=1024, vocab_size=50257)
COST_STEPS = 32  # latent steps of the step-cost batch


def build_coconut_gpt2(root: Path) -> Path:
    """COCONUT over a random GPT-2 124M shape, upstream form, converted."""
    base, ckpt = latent_models.write_upstream_coconut(root, "gpt2", word_tokenizer=True,
                                                      **GPT2_124M)
    return convert_coconut(base, ckpt, root / "model")


def build_codi_llama_1b(root: Path) -> Path:
    """CODI (LoRA r=128, alpha=32, prj 2048 as upstream's scripts) over a random
    Llama-3.2-1B shape, converted."""
    base = save_random_llama(root / "base", SHAPES["llama-3.2-1b"])
    base, ckpt = latent_models.write_upstream_codi(root, "llama", "safetensors", lora_r=128,
                                                   lora_alpha=32.0, prj_dim=2048, base_dir=base)
    return convert_codi(base, ckpt, root / "model", lora_alpha=32.0)


# builder per benchmark name; the tiny ones (``latent_models.save_latent_tiny``) run on the CPU
MODELS = {"coconut-gpt2-124m": build_coconut_gpt2, "codi-llama-3.2-1b": build_codi_llama_1b,
          "coconut-tiny": partial(latent_models.save_latent_tiny, kind="coconut-gpt2"),
          "codi-tiny": partial(latent_models.save_latent_tiny, kind="codi-llama")}
NOTES = {"ignore_eos": True, "cost_steps": COST_STEPS, "goal": ">= 30x at 64 concurrent"}


def bench_model(name: str, root: Path, bw: float, device: str, concurrency, budget: int = 6,
                answer_len: int = 32, prompt_len: int = 64, ref_requests: int = 4) -> dict:
    """One model (``MODELS`` key): ``engine_rows``, ``step_cost`` at the largest concurrency
    (``COST_STEPS`` latent steps against as many plain ones), then ``reference``."""
    max_c = max(concurrency)
    path = MODELS[name](root / name)
    max_len = prompt_len + max(budget, COST_STEPS) + answer_len + 8
    engine = suite_engine(path, device, concurrency, max_len)
    rows, outputs = engine_rows(engine, greedy(answer_len, latent_budget=budget),
                                random_batches(concurrency, prompt_len), device, bw,
                                greedy(2, latent_budget=budget))
    prompts = random_batches((max_c,), prompt_len, seed=1)[max_c]
    cost = step_cost(engine, (prompts, greedy(1, latent_budget=COST_STEPS)),
                     (prompts, greedy(COST_STEPS + 1, latent_budget=0)), device, bw)
    del engine
    free_memory(device)
    ref = reference(rows, outputs, lambda p, n: reference_generate(
        path, p, budget, n, device, dtype_for(device))[0], device,
        ref_requests, answer_len)
    load_reference.cache_clear()
    return {"budget": budget, "answer_len": answer_len, "prompt_len": prompt_len,
            "max_model_len": max_len, "concurrency": rows, "step_cost": cost,
            "reference": ref}
