"""Tiny random recurrent-depth checkpoints in the upstream formats, for tests and benchmarks.

Design notes: docs/internals.md, "latentserve.bench.baseline.recurrent_models".
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from latentserve.bench.baseline.tiny_models import save_word_tokenizer

HUGINN_TINY = {"n_embd": 64, "num_attention_heads": 4, "num_key_value_heads": 4,
               "intermediate_size": 128, "vocab_size": 1024, "block_size": 256,
               "n_layers_in_prelude": 1, "n_layers_in_recurrent_block": 2,
               "n_layers_in_coda": 1, "mean_recurrence": 4, "max_recurrence": 8}
OURO_TINY = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
             "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
             "vocab_size": 1024, "max_position_embeddings": 256, "total_ut_steps": 4,
             "max_recurrence": 6}


def _rand(g, shape, std):
    import torch

    return torch.randn(*shape, generator=g, device=g.device) * std


def write_huginn(out_dir, seed: int = 0, contraction: float = 0.25, save_dtype=None,
                 init_device: str = "cpu", **overrides) -> Path:
    """Write a tiny Huginn checkpoint (``HUGINN_TINY`` + ``overrides``) into ``out_dir``;
    weights in ``save_dtype`` (None: float32; ``freqs_cis`` stays float32), drawn on
    ``init_device`` (a CUDA generator draws other numbers than the CPU one)."""
    import torch

    c = {**HUGINN_TINY, **overrides}
    e, heads, kv = c["n_embd"], c["num_attention_heads"], c["num_key_value_heads"]
    hd, inter = e // heads, c["intermediate_size"]
    p, l, cd = c["n_layers_in_prelude"], c["n_layers_in_recurrent_block"], c["n_layers_in_coda"]
    cfg = {
        "model_type": "huginn_raven", "architectures": ["RavenForCausalLM"],
        "auto_map": {"AutoConfig": "raven_config_minimal.RavenConfig",
                     "AutoModelForCausalLM": "raven_modeling_minimal.RavenForCausalLM"},
        "n_embd": e, "num_attention_heads": heads, "num_key_value_heads": kv,
        "intermediate_size": inter, "vocab_size": c["vocab_size"], "padding_multiple": 64,
        "block_size": c["block_size"], "tie_embeddings": True, "bias": False,
        "architecture_class_name": "RecurrentGPT", "block_class_name": "SandwichBlock",
        "norm_class_name": "RMSNorm_llama", "norm_eps": 1e-6, "mlp_class_name": "GatedMLP",
        "nonlin_name": "SiLU", "init_strategy": "takase", "state_init": "like-init",
        "injection_type": "linear", "n_layers_in_recurrent_block": l,
        "mean_recurrence": c["mean_recurrence"], "sampling_scheme": "poisson-lognormal-filling",
        "mean_backprop_depth": max(1, c["mean_recurrence"] // 2), "n_layers_in_prelude": p,
        "n_layers_in_coda": cd, "n_layers": p + l + cd, "qk_bias": True,
        "activation_checkpoint_impl": "per-iteration", "rope_base": 50000.0,
        "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "float32",
        "max_recurrence": c["max_recurrence"],
    }
    cfg.update({k: c[k] for k in ("init_scale", "state_init_seed") if k in c})
    g = torch.Generator(device=init_device).manual_seed(seed)
    # Gains ~1 per matmul at any width (0.12 / 0.09 at the tiny width 64 / 128).
    w_e, w_i = 0.96 / math.sqrt(e), 1.02 / math.sqrt(inter)
    sd = {"transformer.wte.weight": _rand(g, (c["vocab_size"], e), 0.1)}

    def block(prefix):
        for i in (1, 2, 3, 4):
            sd[f"{prefix}.norm_{i}.weight"] = 1 + _rand(g, (e,), 0.1)
        sd[f"{prefix}.attn.Wqkv.weight"] = _rand(g, ((heads + 2 * kv) * hd, e), w_e)
        sd[f"{prefix}.attn.qk_bias"] = _rand(g, (2, 1, heads, hd), 0.05)
        sd[f"{prefix}.attn.proj.weight"] = _rand(g, (e, e), w_e)
        sd[f"{prefix}.mlp.fc.weight"] = _rand(g, (2 * inter, e), w_e)
        sd[f"{prefix}.mlp.proj.weight"] = _rand(g, (e, inter), w_i)

    for part, n in (("prelude", p), ("core_block", l), ("coda", cd)):
        for i in range(n):
            block(f"transformer.{part}.{i}")
    adapter = _rand(g, (e, 2 * e), 1 / math.sqrt(2 * e))
    adapter[:, :e] *= contraction  # state half: the recurrence contracts
    sd["transformer.adapter.weight"] = adapter
    sd["transformer.ln_f.weight"] = 1 + _rand(g, (e,), 0.1)
    sd["lm_head.weight"] = sd["transformer.wte.weight"].clone()  # tied, stored twice
    inv = 1.0 / (50000.0 ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd))
    freqs = torch.outer(torch.arange(c["block_size"], dtype=torch.float32), inv)
    sd = _cast(sd, save_dtype, cfg)
    sd["freqs_cis"] = torch.stack([freqs.cos()[None, :, None, :],
                                   freqs.sin()[None, :, None, :]], dim=4)
    return _save(out_dir, cfg, sd, c["vocab_size"])


def write_ouro(out_dir, seed: int = 0, save_dtype=None, init_device: str = "cpu",
               **overrides) -> Path:
    """Write a tiny Ouro checkpoint (``OURO_TINY`` + ``overrides``) into ``out_dir``;
    ``save_dtype`` and ``init_device`` as in :func:`write_huginn`."""
    import torch

    c = {**OURO_TINY, **overrides}
    h, inter, n = c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"]
    heads, kv, hd = c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
    cfg = {
        "model_type": "ouro", "architectures": ["OuroForCausalLM"],
        "auto_map": {"AutoConfig": "configuration_ouro.OuroConfig",
                     "AutoModelForCausalLM": "modeling_ouro.OuroForCausalLM"},
        "hidden_size": h, "intermediate_size": inter, "num_hidden_layers": n,
        "num_attention_heads": heads, "num_key_value_heads": kv, "head_dim": hd,
        "vocab_size": c["vocab_size"], "max_position_embeddings": c["max_position_embeddings"],
        "rope_theta": 1000000.0, "rope_scaling": None, "rms_norm_eps": 1e-6,
        "hidden_act": "silu", "tie_word_embeddings": False, "attention_dropout": 0.0,
        "total_ut_steps": c["total_ut_steps"], "early_exit_threshold": 1.0,
        "layer_types": ["full_attention"] * n, "use_sliding_window": False,
        "sliding_window": None, "bos_token_id": 1, "eos_token_id": 2,
        "torch_dtype": "float32", "max_recurrence": c["max_recurrence"],
    }
    cfg.update({k: c[k] for k in ("early_exit_step", "early_exit_threshold") if k in c})
    g = torch.Generator(device=init_device).manual_seed(seed)
    w_h, w_i = 0.96 / math.sqrt(h), 1.02 / math.sqrt(inter)  # 0.12 / 0.09 at width 64 / 128
    sd = {"model.embed_tokens.weight": _rand(g, (c["vocab_size"], h), 0.5)}
    for i in range(n):
        pre = f"model.layers.{i}"
        for name in ("input_layernorm", "input_layernorm_2", "post_attention_layernorm",
                     "post_attention_layernorm_2"):
            sd[f"{pre}.{name}.weight"] = 1 + _rand(g, (h,), 0.1)
        sd[f"{pre}.self_attn.q_proj.weight"] = _rand(g, (heads * hd, h), w_h)
        sd[f"{pre}.self_attn.k_proj.weight"] = _rand(g, (kv * hd, h), w_h)
        sd[f"{pre}.self_attn.v_proj.weight"] = _rand(g, (kv * hd, h), w_h)
        sd[f"{pre}.self_attn.o_proj.weight"] = _rand(g, (h, heads * hd), w_h)
        sd[f"{pre}.mlp.gate_proj.weight"] = _rand(g, (inter, h), w_h)
        sd[f"{pre}.mlp.up_proj.weight"] = _rand(g, (inter, h), w_h)
        sd[f"{pre}.mlp.down_proj.weight"] = _rand(g, (h, inter), w_i)
    sd["model.norm.weight"] = 1 + _rand(g, (h,), 0.1)
    sd["model.early_exit_gate.weight"] = _rand(g, (1, h), 0.3)
    sd["model.early_exit_gate.bias"] = _rand(g, (1,), 0.3)
    sd["lm_head.weight"] = _rand(g, (c["vocab_size"], h), w_h)
    sd = _cast(sd, save_dtype, cfg)
    return _save(out_dir, cfg, sd, c["vocab_size"])


def _cast(sd: dict, dtype, cfg: dict) -> dict:
    """``sd`` on the CPU in ``dtype`` (None: unchanged dtype); ``cfg["torch_dtype"]`` names
    it."""
    out = {k: (v if dtype is None else v.to(dtype)).cpu() for k, v in sd.items()}
    if dtype is not None:
        cfg["torch_dtype"] = str(dtype).removeprefix("torch.")
    return out


def _save(out_dir, cfg, sd, vocab) -> Path:
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    save_file({k: v.contiguous() for k, v in sd.items()}, str(out / "model.safetensors"))
    save_word_tokenizer(out, vocab_size=vocab)
    return out
