"""Compression-head benchmark: closed-loop latent decoding against the eager reference, a
latent step against a plain one (method: benchmarks/head_gpu.py)."""

from __future__ import annotations

from pathlib import Path

import torch

from latentserve.bench.baseline import head_reference as hr
from latentserve.bench.device_common import free_memory, profile_replay, time_graph
from latentserve.bench.gpu import SHAPES, TINY_SHAPE, build_llama
from latentserve.bench.suite import (
    dtype_for,
    engine_rows,
    greedy,
    random_batches,
    reference,
    step_cost,
    suite_engine,
)
from latentserve.latent.bundle import random_bundle, write_bundle
from latentserve.latent.head import HEAD_BUNDLE_NAME

# latent_dim and source_layer (0-based, the anchor's layer: ~0.8 depth as DeepSeek-V4's head)
HEADS = {"smollm2-135m": {"latent_dim": 128, "source_layer": 23},
         "llama-3.2-1b": {"latent_dim": 512, "source_layer": 12}}
TINY_HEAD = {"latent_dim": 16, "source_layer": 1}
THINK_OPEN, THINK_CLOSE = "w5 w6 w7", "w8"  # word-tokenizer ids (5, 6, 7) and (8,)
NOTES = {"head_dtype": "float32", "think_open_ids": 3, "think_close_ids": 1, "min_latent": 0,
         "use_stop": False, "ignore_eos": True,
         "goal": ">= 30x at 64 concurrent; latent step within 10% of plain"}


def build_head_model(root: Path, name: str, device: str = "cuda") -> Path:
    """A random backbone ``name`` (``build_llama``) with a random closed-loop head bundle."""
    path = build_llama(root, name, device)
    head = HEADS.get(name, TINY_HEAD)
    bundle = random_bundle(SHAPES.get(name, TINY_SHAPE)["hidden_size"], head["latent_dim"],
                           source_layer=head["source_layer"], seed=0, injection="closed_loop",
                           think_open=THINK_OPEN, think_close=THINK_CLOSE)
    write_bundle(bundle, path / HEAD_BUNDLE_NAME)
    return path


def _params(max_latent: int, answer_len: int, n_close: int, thinking: bool = True):
    if not thinking:
        return greedy(answer_len, thinking=False)
    return greedy(max_latent + n_close + answer_len, thinking=True, max_latent=max_latent,
                  min_latent=0, use_stop=False, min_output_tokens=0)


def head_replay_us(head, hidden: int, rows: int, iters: int = 200) -> dict:
    """Microseconds per CUDA graph replay of ``LatentHead.serve_outputs`` on ``rows`` bf16
    anchors: float32 torch (``torch_fp32``) against fused 3xTF32 (``decode_linear_tf32x3``),
    each with ``<name>_kernels`` (``profile_replay``)."""
    x = torch.randn(rows, hidden, device="cuda", dtype=torch.bfloat16)
    out = {}
    for name, fused in (("torch_fp32", False), ("decode_linear_tf32x3", True)):
        out[name], graph = time_graph(lambda f=fused: head.serve_outputs(x, fused=f),
                                      replays=iters)
        out[f"{name}_kernels"] = profile_replay(graph)
        del graph
    return out


def bench_model(name: str, root: Path, bw: float, device: str, concurrency,
                prompt_len: int = 128, max_latent: int = 32, answer_len: int = 32,
                ref_requests: int = 3, bare_baseline: bool = True, step_rounds: int = 1) -> dict:
    """One backbone (``HEADS`` key, or ``tiny``) + head: ``engine_rows``, ``step_cost`` at the
    largest concurrency (the bare backbone as a third phase when ``bare_baseline``), then
    ``reference``."""
    dtype = dtype_for(device)
    path = build_head_model(root / name, name, device)
    n_close = len(THINK_CLOSE.split())
    max_len = prompt_len + len(THINK_OPEN.split()) + max_latent + n_close + answer_len + 8
    max_c = max(concurrency)
    engine = suite_engine(path, device, concurrency, max_len)
    spec = engine.latent_spec
    rows, outputs = engine_rows(engine, _params(max_latent, answer_len, n_close),
                                random_batches(concurrency, prompt_len), device, bw,
                                _params(2, 2, n_close))
    # NOTE: scheduled like the head engine (both overlap on CUDA by default), so the bare
    # baseline compares like with like
    bare = suite_engine(path, device, concurrency, max_len, no_latent_head=True,
                        overlap_schedule=engine.config.overlap_schedule) if bare_baseline else None
    prompts = random_batches((max_c,), prompt_len, seed=1)[max_c]
    cost = step_cost(engine, (prompts, _params(max_latent, 1, n_close)),
                     ([p + list(spec.start_ids) for p in prompts],
                      _params(0, max_latent + 1, 0, False)),
                     device, bw, bare, step_rounds)
    if device.startswith("cuda"):
        head = engine.runner.model.latent_head
        cost["head_replay_us"] = head_replay_us(head, head.config.hidden_size, max_c)
    del engine, bare
    free_memory(device)

    def generate(prompt, n):
        return hr.HeadReference(path, path / HEAD_BUNDLE_NAME, dtype, device, True).generate(
            prompt, spec.start_ids, spec.end_ids, max_latent, max_latent + n_close + n)["tokens"]

    ref = reference(rows, outputs, generate, device, ref_requests, answer_len)
    hr._hf_model.cache_clear()
    hr._bundle_cached.cache_clear()
    backbone = SHAPES.get(name, TINY_SHAPE)
    return {"backbone": backbone,
            "head": {**HEADS.get(name, TINY_HEAD), "mlp_dim": backbone["hidden_size"] // 2},
            "max_model_len": max_len, "concurrency": rows, "step_cost": cost,
            "reference": ref}
