"""Recurrent-depth benchmark: Huginn and Ouro through the engine against the eager reference
(method: benchmarks/recurrent_gpu.py)."""

from __future__ import annotations

from functools import partial
from pathlib import Path

import torch

from latentserve.bench.baseline import recurrent_models as rm
from latentserve.bench.baseline.recurrent_reference import HuginnReference, OuroReference
from latentserve.bench.device_common import free_memory, param_bytes
from latentserve.bench.suite import dtype_for, engine_rows, random_batches, reference, suite_engine
from latentserve.kvcache.pool import KVPool
from latentserve.sampling_params import SamplingParams

HUGINN_3_5B = {"n_embd": 5280, "num_attention_heads": 55, "num_key_value_heads": 55,
               "intermediate_size": 17920, "vocab_size": 65536, "block_size": 4096,
               "n_layers_in_prelude": 2, "n_layers_in_recurrent_block": 4,
               "n_layers_in_coda": 2, "mean_recurrence": 8, "max_recurrence": 32}
OURO_1_4B = {"hidden_size": 2048, "intermediate_size": 5632, "num_hidden_layers": 24,
             "num_attention_heads": 16, "num_key_value_heads": 16, "head_dim": 128,
             "vocab_size": 49152, "max_position_embeddings": 65536, "total_ut_steps": 4,
             "max_recurrence": 4}
# (family, shape, depths) per benchmark name; the tiny ones run on the CPU in seconds
MODELS = {"huginn-0125": ("huginn", HUGINN_3_5B, (8, 32)),
          "ouro-1.4b": ("ouro", OURO_1_4B, (4,)),
          "huginn-tiny": ("huginn", {**rm.HUGINN_TINY, "mean_recurrence": 2,
                                     "max_recurrence": 4}, (2, 4)),
          "ouro-tiny": ("ouro", {**rm.OURO_TINY, "max_recurrence": 4}, (4,))}
NOTES = {"ignore_eos": True, "early_exit": False, "goal": ">= 30x at 64 concurrent"}


def decode_floor(model, batch: int, ctx: float, bw: float, kv_dtype, family: str,
                 depth: int) -> dict:
    """``device_common.kv_floor`` for ``depth`` recurrences (the byte model of
    benchmarks/recurrent_gpu.py), with ``kv_banks_read``."""
    _, kvh, hd = model.kv_shape
    per_bank = KVPool.bytes_per_slot(1, kvh, hd, kv_dtype)
    if family == "huginn":
        t = model.transformer
        emb = t.wte.weight
        weights = (param_bytes(t.prelude) + depth * param_bytes(t.adapter, t.core_block)
                   + param_bytes(t.coda, t.ln_f) + param_bytes(model.lm_head))
        banks = model.n_prelude + depth * model.n_core + model.n_coda
    else:
        m = model.model
        emb = m.embed_tokens.weight
        weights = (depth * param_bytes(m.layers, m.norm, m.early_exit_gate)
                   + param_bytes(model.lm_head))
        banks = depth * len(m.layers)
    weights += batch * emb.shape[1] * emb.element_size()
    kv = batch * ctx * banks * per_bank
    return {"weights_bytes": weights, "kv_bytes": kv, "kv_banks_read": banks,
            "floor_s": (weights + kv) / bw}


def bench_model(name: str, root: Path, bw: float, device: str, concurrency,
                prompt_len: int = 64, output_len: int = 32, ref_requests: int = 2,
                ref_output_len: int = 8) -> dict:
    """One model (``MODELS`` key): ``engine_rows`` at every depth, then per depth
    ``reference`` (timed at ``ref_output_len`` tokens)."""
    family, shape, depths = MODELS[name]
    dtype = getattr(torch, dtype_for(device))
    write = rm.write_huginn if family == "huginn" else rm.write_ouro
    path = write(root / name, save_dtype=dtype, init_device=device, **shape)
    max_len = prompt_len + output_len + 8
    engine = suite_engine(path, device, concurrency, max_len)
    extra = {"exit_criterion": "last"} if family == "ouro" else {}

    def params(depth, n):
        return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True,
                              latent_budget=depth, **extra)

    batches = random_batches(concurrency, prompt_len)
    runs = {depth: engine_rows(engine, params(depth, output_len), batches, device, bw,
                               params(depth, 2), floor=partial(
                                   decode_floor, family=family, depth=depth))
            for depth in depths}
    del engine
    free_memory(device)
    ref = (HuginnReference if family == "huginn" else OuroReference)(path, dtype, device)
    out = {str(depth): {"concurrency": rows, "reference": reference(
        rows, outputs, lambda p, n, d=depth: ref.generate(p, n, d)["tokens"], device,
        ref_requests, output_len, ref_output_len)} for depth, (rows, outputs) in runs.items()}
    return {"family": family, "shape": shape, "max_model_len": max_len, "depths": out}
