"""Recurrent-depth benchmark: Huginn and Ouro shapes through the engine against the eager
reference, and the decode step against its bandwidth floor (method: benchmarks/recurrent_gpu.py)."""

from __future__ import annotations

import time
from pathlib import Path

from latentserve.bench.baseline import recurrent_models as rm

HUGINN_3_5B = {"n_embd": 5280, "num_attention_heads": 55, "num_key_value_heads": 55,
               "intermediate_size": 17920, "vocab_size": 65536, "block_size": 4096,
               "n_layers_in_prelude": 2, "n_layers_in_recurrent_block": 4,
               "n_layers_in_coda": 2, "mean_recurrence": 8, "max_recurrence": 32}
OURO_1_4B = {"hidden_size": 2048, "intermediate_size": 5632, "num_hidden_layers": 24,
             "num_attention_heads": 16, "num_key_value_heads": 16, "head_dim": 128,
             "vocab_size": 49152, "max_position_embeddings": 65536, "total_ut_steps": 4,
             "max_recurrence": 4}
HUGINN_TINY = {**rm.HUGINN_TINY, "mean_recurrence": 2, "max_recurrence": 4}
OURO_TINY = {**rm.OURO_TINY, "max_recurrence": 4}
# (family, shape, depths) per benchmark name
MODELS = {"huginn-0125": ("huginn", HUGINN_3_5B, (8, 32)),
          "ouro-1.4b": ("ouro", OURO_1_4B, (4,))}
TINY_MODELS = {"huginn-tiny": ("huginn", HUGINN_TINY, (2, 4)),
               "ouro-tiny": ("ouro", OURO_TINY, (4,))}


def _dtype(name: str):
    import torch

    return getattr(torch, name)


def decode_floor(model, family: str, depth: int, batch: int, mean_ctx: float, bw: float,
                 kv_dtype) -> dict:
    """Bytes one decode step of ``batch`` rows at ``depth`` must read (the byte model in the
    module docstring; KV in ``kv_dtype``) and the floor time (s) at ``bw`` bytes/s."""
    from latentserve.bench.device_common import param_bytes
    from latentserve.kvcache.pool import KVPool

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
    kv = batch * mean_ctx * banks * per_bank
    return {"weights_bytes": weights, "kv_bytes": kv, "kv_banks_read": banks,
            "floor_s": (weights + kv) / bw}


def _write(family: str, shape: dict, path: Path, device: str, dtype: str) -> Path:
    write = rm.write_huginn if family == "huginn" else rm.write_ouro
    return write(path, save_dtype=_dtype(dtype), init_device=device, **shape)


def _params(depth: int, output_len: int, family: str):
    from latentserve.sampling_params import SamplingParams

    extra = {"exit_criterion": "last"} if family == "ouro" else {}
    return SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True,
                          latent_budget=depth, **extra)


def _reference(ref, family: str, prompt, n: int, depth: int) -> dict:
    if family == "huginn":
        return ref.generate(prompt, n, depth)
    return ref.generate(prompt, n, depth, "last")


def bench_model(name: str, family: str, shape: dict, depths, root: Path, device: str,
                dtype: str, concurrency, prompt_len: int, output_len: int, ref_requests: int,
                ref_output_len: int, bw: float, fused_ops: bool | None = None) -> dict:
    """One model: engine at every depth and concurrency, then the reference (after the
    engine is freed). ``fused_ops``: ``EngineConfig.fused_ops`` (None: the engine's default,
    the Triton fast path on CUDA; True forces it). Returns a JSON-able dict."""
    import torch

    from latentserve.bench.baseline.recurrent_reference import HuginnReference, OuroReference
    from latentserve.bench.device_common import agreement, drive, free_memory, make_engine, timed

    t0 = time.perf_counter()
    path = _write(family, shape, root / name, device, dtype)
    t_build = time.perf_counter() - t0
    max_c, max_len = max(concurrency), prompt_len + output_len + 8
    t0 = time.perf_counter()
    engine = make_engine(path, device, dtype, max_c, max_len, kv_slots=(max_c + 1) * max_len,
                         fused_ops=fused_ops)
    t_engine = time.perf_counter() - t0
    print(f"[{name}] checkpoint written in {t_build:.1f} s, engine ready in {t_engine:.1f} s",
          flush=True)
    model = engine.runner.model
    g = torch.Generator().manual_seed(0)

    def rand_prompts(c):
        return torch.randint(3, 1000, (c, prompt_len), generator=g).tolist()

    # Warm-up at full concurrency at every depth (prefill kernels), short output.
    for depth in depths:
        drive(engine, rand_prompts(max_c), _params(depth, 2, family), device, "warm")
    engine.cache.radix.reset()
    rows, outputs = {}, {}
    for depth in depths:
        rows[depth] = {}
        for c in concurrency:
            prompts = rand_prompts(c)
            r = drive(engine, prompts, _params(depth, output_len, family), device,
                      f"d{depth}c{c}")
            outputs[depth, c] = (prompts, r.pop("outputs"))
            r["tok_s"] = r["tokens"] / r["wall_s"]
            step = r["step_s"].get("decode")
            fl = decode_floor(model, family, depth, c, prompt_len + output_len / 2, bw,
                              _dtype(dtype))
            r.update(decode_step_s=step, bandwidth_floor=fl,
                     step_over_floor=None if step is None else step / fl["floor_s"])
            rows[depth][c] = r
            print(f"[{name}] engine depth={depth} c={c}: {r['wall_s']:.3f} s, "
                  f"{r['tok_s']:.1f} tok/s, step {step} s, "
                  f"x floor {r['step_over_floor']}", flush=True)
    engine.cache.check_idle()
    del engine, model
    free_memory(device)
    t0 = time.perf_counter()
    cls = HuginnReference if family == "huginn" else OuroReference
    ref = cls(path, dtype=_dtype(dtype), device=device)
    t_ref_load = time.perf_counter() - t0
    print(f"[{name}] reference loaded in {t_ref_load:.1f} s", flush=True)
    ref_rows = {}
    for depth in depths:
        _reference(ref, family, rand_prompts(1)[0][:8], 2, depth)  # warm-up
        prompts, eng_out = outputs[depth, max_c]
        pre, dec, ref_out = [], [], []
        for p in prompts[:ref_requests]:
            _, t1 = timed(device, _reference, ref, family, p, 1, depth)
            out_k, tk = timed(device, _reference, ref, family, p, ref_output_len, depth)
            ref_out.append(out_k["tokens"])
            pre.append(t1)
            dec.append((tk - t1) / max(ref_output_len - 1, 1))
        t_pre, t_dec = sum(pre) / len(pre), sum(dec) / len(dec)
        per_req = t_pre + (output_len - 1) * t_dec
        ref_rows[depth] = {"prefill_s": t_pre, "decode_token_s": t_dec,
                           "extrapolated_s_per_request": per_req,
                           "tok_s": output_len / per_req,
                           "agree_with_engine": agreement(
                               [o[:ref_output_len] for o in eng_out[:ref_requests]], ref_out)}
        for c in concurrency:
            rows[depth][c]["speedup"] = rows[depth][c]["tok_s"] / ref_rows[depth]["tok_s"]
        print(f"[{name}] reference depth={depth}: prefill {t_pre:.3f} s, "
              f"{t_dec * 1e3:.1f} ms/token", flush=True)
    del ref
    free_memory(device)
    return {"family": family, "shape": shape, "depths": list(depths), "build_s": t_build,
            "engine_init_s": t_engine, "reference_load_s": t_ref_load,
            "max_model_len": max_len,
            "engine": {str(d): {str(c): v for c, v in r.items()} for d, r in rows.items()},
            "reference": {str(d): v for d, v in ref_rows.items()}}


def run_recurrent_gpu_bench(models=tuple(MODELS), device: str = "cuda",
                            dtype: str = "bfloat16", concurrency=(1, 16, 64),
                            prompt_len: int = 64, output_len: int = 32, ref_requests: int = 2,
                            ref_output_len: int = 8, tiny: bool = False,
                            command: str | None = None, fused_ops: bool | None = None) -> dict:
    """Every model in ``models`` (``MODELS`` keys, or ``TINY_MODELS`` keys with ``tiny``);
    see the module docstring. Returns the JSON-able result with the config it ran."""
    from latentserve.bench.device_common import run_suite

    table = TINY_MODELS if tiny else MODELS
    config = {"device": device, "dtype": dtype, "concurrency": list(concurrency),
              "prompt_len": prompt_len, "output_len": output_len, "ignore_eos": True,
              "early_exit": False, "ref_requests": ref_requests,
              "ref_output_len": ref_output_len, "cuda_graphs": device.startswith("cuda"),
              "fused_ops": fused_ops, "goal": ">= 30x at 64 concurrent"}
    return run_suite("models", models, lambda name, root, bw: bench_model(
        name, *table[name], root, device, dtype, concurrency, prompt_len, output_len,
        ref_requests, ref_output_len, bw, fused_ops), device, command, config)
