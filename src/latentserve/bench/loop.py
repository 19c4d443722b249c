"""Looped-block benchmark: PCCoT block passes against the same thoughts position by position
and against the eager reference (``bench.baseline.loop_reference``); answer tokens/s."""

from __future__ import annotations

import platform
import time
from pathlib import Path

from latentserve.bench.device_common import free_memory, make_engine, sync, timed
from latentserve.bench.latent import GPT2_124M


def build_pccot_gpt2(root: Path, block_size: int = 24, iterations: int = 3) -> Path:
    """PCCoT over a random GPT-2 124M-shaped base, upstream form, converted; returns the
    model directory (``root/model``; upstream dirs ``root/base``, ``root/adapter``)."""
    from latentserve.bench.baseline.loop_models import write_upstream_pccot
    from latentserve.bench.baseline.tiny_models import save_tiny
    from latentserve.latent.loop_convert import convert_pccot

    base = save_tiny(root / "base", "gpt2", word_tokenizer=True, **GPT2_124M)
    base, adapter = write_upstream_pccot(root, "gpt2", block_size, iterations, lora_r=128,
                                         lora_alpha=32.0, base_dir=base)
    return convert_pccot(base, adapter, root / "model")


def _engine_run(engine, prompts, params, pass_chunk: int) -> dict:
    from latentserve.core import ReqStatus

    reqs = []
    for i, p in enumerate(prompts):
        engine.add_request(f"b{time.monotonic_ns()}-{i}", p, params)
        reqs.append(engine.scheduler.waiting[-1])
        reqs[-1].state.pass_chunk = pass_chunk
    dev = engine.device.type
    sync(dev)
    t0, n, thought, steps = time.perf_counter(), 0, None, 0
    while engine.has_unfinished_requests():
        n += sum(len(o.new_token_ids) for o in engine.step())
        steps += 1
        if thought is None and all(r.answer_start is not None or r.status == ReqStatus.FINISHED
                                   for r in reqs):
            sync(dev)
            thought = time.perf_counter() - t0
    sync(dev)
    wall = time.perf_counter() - t0
    return {"wall_s": wall, "thought_s": thought, "answer_tokens": n, "steps": steps,
            "answer_tok_s": n / wall}


def bench_loop(root: Path, device: str, dtype: str, concurrency, answer_len: int = 16,
               prompt_len: int = 64, ref_requests: int = 2, block_size: int = 24,
               iterations: int = 3) -> dict:
    """Per concurrency c: the engine with block passes and position by position, and the
    reference's per-request time (measured on ``ref_requests`` requests) times c."""
    import torch

    from latentserve.bench.baseline.loop_reference import (
        load_pccot_reference,
        reference_generate_loop,
    )
    from latentserve.sampling_params import SamplingParams

    model_dir = build_pccot_gpt2(root, block_size, iterations)
    g = torch.Generator().manual_seed(0)
    engine = make_engine(model_dir, device, dtype, max(concurrency),
                         prompt_len + block_size + answer_len + 16, enable_prefix_caching=False,
                         kv_slots=None if device == "cuda" else 65536)
    sp = SamplingParams(max_tokens=answer_len, temperature=0.0, ignore_eos=True,
                        latent_budget=iterations)
    rows = {}
    warm = torch.randint(3, 1000, (2, prompt_len), generator=g).tolist()
    _engine_run(engine, warm, sp, 0)
    _engine_run(engine, warm, sp, 1)
    for c in concurrency:
        prompts = torch.randint(3, 1000, (c, prompt_len), generator=g).tolist()
        block = _engine_run(engine, prompts, sp, 0)
        by_pos = _engine_run(engine, prompts, sp, 1)
        rows[c] = {"block_passes": block, "position_by_position": by_pos,
                   "thought_speedup_vs_positions": by_pos["thought_s"] / block["thought_s"],
                   "wall_speedup_vs_positions": by_pos["wall_s"] / block["wall_s"]}
    del engine
    free_memory(device)
    ref = load_pccot_reference(str(root / "base"), str(root / "adapter"), device, dtype)
    prompts = torch.randint(3, 1000, (ref_requests + 1, prompt_len), generator=g).tolist()
    reference_generate_loop(ref, prompts[0], iterations, 2)  # warm up
    _, ref_s = timed(device, lambda: [
        reference_generate_loop(ref, p, iterations, answer_len, ignore_eos=True)
        for p in prompts[1:]])
    per_req = ref_s / ref_requests
    for c in concurrency:
        rows[c]["reference_wall_s"] = per_req * c  # one request at a time
        rows[c]["speedup_vs_reference"] = per_req * c / rows[c]["block_passes"]["wall_s"]
    return {"model": "pccot-gpt2-124m", "block_size": block_size, "iterations": iterations,
            "answer_len": answer_len, "prompt_len": prompt_len, "concurrency": rows}


def run_loop_bench(device: str = "cpu", concurrency=(1, 8)) -> dict:
    """The looped-block benchmark on ``device`` (bfloat16 on CUDA, float32 on the CPU)."""
    import tempfile

    import torch

    dtype = "bfloat16" if device == "cuda" else "float32"
    out = {"machine": {"platform": platform.platform(), "python": platform.python_version(),
                       "torch": torch.__version__, "threads": torch.get_num_threads(),
                       "gpu": torch.cuda.get_device_name(0) if device == "cuda" else None},
           "device": device, "dtype": dtype}
    with tempfile.TemporaryDirectory() as d:
        out["pccot"] = bench_loop(Path(d), device, dtype, concurrency)
    return out
