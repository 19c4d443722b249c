"""The eager per-request reference for feedback latent models over HF transformers
(``inputs_embeds`` + ``past_key_values``), loading the checkpoint independently.

Design notes: docs/internals.md, "latentserve.bench.baseline.latent_reference".
"""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path

import torch


def _state_dict(path: Path) -> dict:
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        return load_file(str(path))
    return torch.load(path, map_location="cpu", weights_only=True)


def _lora_hooks(model, state: dict, r: int, alpha: float) -> dict:
    """Without peft: forward hooks adding ``x @ A.T @ B.T * alpha / r`` to each LoRA module.
    Returns ``state`` without the LoRA tensors and ``.base_layer``."""
    mods = dict(model.named_modules())
    pairs: dict = {}
    for k in [k for k in state if ".lora_" in k]:
        mod, rest = k.split(".lora_", 1)
        pairs.setdefault(mod, {})[rest[0]] = state.pop(k)
    for mod, ab in pairs.items():
        a, b = ab["A"], ab["B"]
        mods[mod].register_forward_hook(
            lambda m, inp, out, a=a, b=b: out + (inp[0] @ a.t() @ b.t()) * (alpha / r))
    return {k.replace(".base_layer.", "."): v for k, v in state.items()}


@lru_cache(maxsize=8)
def load_reference(model_dir: str, device: str = "cpu", dtype: str = "float32"):
    """``(hf_model, latent_config.json, feedback)`` of a model directory: the HF CausalLM
    with the upstream weights (LoRA unmerged), CODI's ``prj`` or identity."""
    from torch import nn
    from transformers import AutoConfig, AutoModelForCausalLM

    d = Path(model_dir)
    cfg = json.loads((d / "latent_config.json").read_text())
    # a DDP-saved checkpoint's ``module.`` prefix is stripped first (docs/models.md)
    state = {k.removeprefix("module."): v for k, v in _state_dict(d / cfg["checkpoint"]).items()}
    prefix = "base_causallm." if cfg["family"] == "coconut" else "codi."
    if any(k.startswith(prefix) for k in state):
        main = {k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)}
    else:
        main = {k: v for k, v in state.items() if not k.startswith("prj.")}
    emb = next(v for k, v in main.items() if k.endswith(("wte.weight", "embed_tokens.weight")))
    hf_cfg = AutoConfig.from_pretrained(d, local_files_only=True)
    hf_cfg.vocab_size = emb.shape[0]
    model = AutoModelForCausalLM.from_config(hf_cfg, dtype=torch.float32)
    for f in d.glob("*.safetensors"):  # base weights the checkpoint may lack (upstream loads
        if f.name != cfg["checkpoint"]:  # the checkpoint over the pretrained base)
            model.load_state_dict(_state_dict(f), strict=False)
    lora = cfg.get("lora")
    target = model
    if lora and any(".lora_" in k for k in main):
        try:
            from peft import LoraConfig, get_peft_model
        except ImportError:
            main = {k.removeprefix("base_model.model."): v for k, v in main.items()}
            main = _lora_hooks(model, main, lora["r"], lora["alpha"])
        else:
            mods = sorted({k.split(".lora_")[0].rsplit(".", 1)[-1] for k in main if ".lora_" in k})
            target = get_peft_model(model, LoraConfig(
                r=lora["r"], lora_alpha=lora["alpha"], target_modules=mods, lora_dropout=0.0,
                use_rslora=lora.get("use_rslora", False),
                fan_in_fan_out=hf_cfg.model_type == "gpt2"))
    missing, unexpected = target.load_state_dict(main, strict=False)
    tied = getattr(hf_cfg, "tie_word_embeddings", True)
    missing = [k for k in missing if not (tied and k.endswith("lm_head.weight"))]
    if missing or unexpected:
        raise ValueError(f"reference load: missing {missing[:4]}, unexpected {unexpected[:4]}")
    model.tie_weights()
    feedback = nn.Identity()
    prj = cfg.get("prj")
    if cfg["family"] == "codi" and prj:
        h = hf_cfg.hidden_size
        feedback = nn.Sequential(nn.Dropout(0.0), nn.Linear(h, prj["dim"]), nn.GELU(),
                                 nn.Linear(prj["dim"], h))
        if prj.get("layer_norm", True):
            feedback.add_module("ln", nn.LayerNorm(h, eps=prj.get("eps", 1e-5)))
        feedback.load_state_dict({k[4:]: v for k, v in state.items() if k.startswith("prj.")})
    dt = getattr(torch, dtype)
    return target.to(device, dt).eval(), cfg, feedback.to(device, dt).eval()


def _wrap_ids(cfg: dict) -> tuple[list[int], list[int]]:
    t = cfg["tokens"]
    if cfg["family"] == "coconut":
        return [t["start_latent"]], [t["end_latent"]]
    if cfg.get("remove_eos", True):
        return [t["bot"]], [t["eot"]]
    return [t["eos"], t["bot"]], [t["eot"], t["eos"]]


@torch.no_grad()
def reference_generate(model_dir, prompt_ids: list[int], budget: int, max_tokens: int,
                       device: str = "cpu", dtype: str = "float32"):
    """Greedy answer for one request, exactly ``max_tokens`` (no EOS stop):
    ``(answer_token_ids, first_answer_logits [vocab] float32 CPU)``: the logits the first
    answer token is picked from (CODI: its last id, eot, at -inf, as upstream ``test.py``'s
    argmax over ``logits[:vocab_size - 1]``)."""
    model, cfg, feedback = load_reference(str(model_dir), device, dtype)
    emb = model.get_input_embeddings()
    start, end = _wrap_ids(cfg)
    vocab = model.config.vocab_size
    past = None

    def run(embeds):  # embeds [T, H] -> (last logits [V], last post-norm hidden [H])
        nonlocal past
        out = model(inputs_embeds=embeds[None], past_key_values=past, use_cache=True,
                    output_hidden_states=True)
        past = out.past_key_values
        return out.logits[0, -1].float(), out.hidden_states[-1][0, -1]

    dev = model.device
    logits, hidden = run(emb(torch.tensor(prompt_ids + start, device=dev)))
    for _ in range(budget):
        logits, hidden = run(feedback(hidden)[None])
    logits, hidden = run(emb(torch.tensor(end, device=dev)))
    first, answer = logits.cpu(), []
    if cfg["family"] == "codi":
        first[vocab - 1] = float("-inf")
    for _ in range(max_tokens):
        pick = logits[: vocab - 1] if cfg["family"] == "codi" else logits
        tok = int(pick.argmax())
        answer.append(tok)
        logits, hidden = run(emb(torch.tensor([tok], device=dev)))
    return answer, first
