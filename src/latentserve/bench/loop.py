"""Looped-block benchmark: PCCoT block passes against one-position passes and the eager
reference (``baseline.loop_reference``); answer tokens/s."""

from __future__ import annotations

from pathlib import Path

from latentserve.bench.baseline.loop_models import write_upstream_pccot
from latentserve.bench.baseline.loop_reference import load_pccot_reference, reference_generate_loop
from latentserve.bench.baseline.tiny_models import save_tiny
from latentserve.bench.device_common import free_memory
from latentserve.bench.drive import drive
from latentserve.bench.latent import GPT2_124M
from latentserve.bench.suite import dtype_for, engine_rows, random_batches, reference, suite_engine
from latentserve.latent.loop_convert import convert_pccot
from latentserve.sampling_params import SamplingParams

# (GPT-2 base shape, LoRA rank) per benchmark name; the tiny one runs on the CPU in seconds
MODELS = {"pccot-gpt2-124m": (GPT2_124M, 128), "pccot-tiny": ({}, 8)}
NOTES = {"ignore_eos": True, "prefix_caching": False, "goal": ">= 20x at 64 concurrent"}


def _one_position(req) -> None:
    req.state.pass_chunk = 1  # every pass split into one-position forwards


def bench_model(name: str, root: Path, bw: float, device: str, concurrency,
                answer_len: int = 16, prompt_len: int = 64, ref_requests: int = 2,
                block_size: int = 24, iterations: int = 3) -> dict:
    """One model (``MODELS`` key; 24 latents and 3 Jacobi iterations as upstream's released
    recipe; upstream form in ``root/name``, LoRA alpha 32, converted): ``engine_rows`` (block
    passes), the same prompts with one-position passes (``position_by_position`` and the
    speedups over it), then ``reference``."""
    root, (shape, lora_r) = root / name, MODELS[name]
    base = save_tiny(root / "base", "gpt2", word_tokenizer=True, **shape)
    base, adapter = write_upstream_pccot(root, "gpt2", block_size, iterations, lora_r=lora_r,
                                         lora_alpha=32.0, base_dir=base)
    path = convert_pccot(base, adapter, root / "model")
    max_len = prompt_len + block_size + answer_len + 16
    engine = suite_engine(path, device, concurrency, max_len, enable_prefix_caching=False)

    def params(n):
        return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True,
                              latent_budget=iterations)

    rows, outputs = engine_rows(engine, params(answer_len),
                                random_batches(concurrency, prompt_len), device, bw, params(2))
    drive(engine, outputs[max(concurrency)][0][:2], params(2), device, "warm", _one_position)
    for c in concurrency:
        pos = drive(engine, outputs[c][0], params(answer_len), device, "pos", _one_position)
        rows[c].update(position_by_position={k: pos[k] for k in ("wall_s", "thought_s",
                                                                  "steps")},
                       thought_speedup_vs_positions=pos["thought_s"] / rows[c]["thought_s"],
                       wall_speedup_vs_positions=pos["wall_s"] / rows[c]["wall_s"])
    del engine
    free_memory(device)
    ref = load_pccot_reference(str(root / "base"), str(root / "adapter"), device,
                               dtype_for(device))
    ref_out = reference(rows, outputs, lambda p, n: reference_generate_loop(
        ref, p, iterations, n)[0], device, ref_requests, answer_len)
    load_pccot_reference.cache_clear()
    return {"block_size": block_size, "iterations": iterations, "answer_len": answer_len,
            "prompt_len": prompt_len, "max_model_len": max_len, "concurrency": rows,
            "reference": ref_out}
