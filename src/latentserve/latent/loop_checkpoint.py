"""Looped-block models (PCCoT, LOTUS) from a model directory: config, weights (LoRA merged)
and ``LatentSpec`` (docs/internals.md)."""

from __future__ import annotations

from pathlib import Path

from torch import nn

from latentserve.latent import feedback as fb
from latentserve.latent.spec import LatentSpec

LOOP_FAMILIES = ("pccot", "lotus")
_TOKENS = {"pccot": ("bot", "eot", "latent"), "lotus": ("start", "end", "latent")}


def validate_loop_config(cfg: dict, model_dir: Path | None = None) -> dict:
    """Check a loop family's parsed latent_config.json; return a copy with defaults filled.
    Raises ValueError naming the offending field."""
    cfg = fb.check_common(cfg, LOOP_FAMILIES, None, model_dir)
    fam = cfg["family"]
    cfg["block_size"] = fb.config_int(cfg, "block_size", lo=1)
    toks = cfg.get("tokens")
    if not isinstance(toks, dict) or set(toks) != set(_TOKENS[fam]):
        raise fb.bad_field("tokens", f"must be an object with exactly {list(_TOKENS[fam])}, "
                           f"got {toks!r}")
    for k in toks:
        fb.config_int(cfg, f"tokens.{k}")
    prompt = cfg.setdefault("answer_prompt_ids", [])
    if not isinstance(prompt, list) or not all(isinstance(t, int) and not isinstance(t, bool)
                                               and t >= 0 for t in prompt):
        raise fb.bad_field("answer_prompt_ids", f"must be a list of token ids, got {prompt!r}")
    rule = cfg.setdefault("loop_rule", "jacobi" if fam == "pccot" else "same")
    if rule not in (("jacobi",) if fam == "pccot" else ("same", "jacobi")):
        raise fb.bad_field("loop_rule", "must be 'jacobi' for pccot, 'same' or 'jacobi' for "
                           f"lotus, got {rule!r}")
    fb.check_lora_prj(cfg)
    return cfg


def prepare_loop_weights(model_dir, hf_config, cfg: dict):
    """``([(HF name, tensor)], hf_config)``: the checkpoint over the base, LoRA merged,
    ``vocab_size`` = embedding rows. ValueError when the token ids do not fit."""
    model_dir = Path(model_dir)
    gpt2 = getattr(hf_config, "model_type", None) == "gpt2"
    ckpt = cfg.get("checkpoint")
    files = [f for f in sorted(model_dir.glob("*.safetensors")) if f.name != ckpt]
    if ckpt:
        files.append(model_dir / ckpt)  # last: its tensors (e.g. a resized wte) win
    state = {}
    for f in files:
        for k, v in fb.read_state_dict(f).items():
            k = fb.hf_name(k, gpt2)
            if not k.startswith("prj.") and not k.endswith(fb.BUFFER_SUFFIXES):
                state[k] = v
    state = fb.merge_lora(state, cfg.get("lora"), gpt2)
    rows = fb.embedding_rows(state, model_dir, cfg, ("tokens", "answer_prompt_ids"))
    hf_config.vocab_size = rows
    return list(state.items()), hf_config


def attach_loop(model, model_dir, hf_config, cfg: dict, dtype, device) -> None:
    """Set ``model.latent_spec`` (end ids: end token + answer prompt; PCCoT
    ``upstream_eos_from`` 2, whyNLP/PCCoT ``models/generate.py``) and
    ``model.latent_feedback``: identity, or PCCoT's ``prj`` Linear -> GELU -> Linear ->
    LayerNorm (``[N, H] -> [N, H]``, upstream keys); ValueError when ``prj``'s tensors do
    not match."""
    t, pccot = cfg["tokens"], cfg["family"] == "pccot"
    start, end = (t["bot"], t["eot"]) if pccot else (t["start"], t["end"])
    model.latent_spec = LatentSpec(
        kind="loop", family=cfg["family"], default_budget=cfg["default_budget"],
        max_budget=cfg["max_budget"], start_ids=(start,), latent_id=t["latent"],
        end_ids=(end, *cfg["answer_prompt_ids"]), block_size=cfg["block_size"],
        loop_rule=cfg["loop_rule"], upstream_eos_from=2 if pccot else 0)
    if cfg.get("prj") is None:
        model.latent_feedback = nn.Identity()
        return
    hidden = getattr(hf_config, "hidden_size", None) or hf_config.n_embd
    prj = nn.Sequential(nn.Linear(hidden, hidden), nn.GELU(), nn.Linear(hidden, hidden),
                        nn.LayerNorm(hidden, eps=cfg["prj"]["eps"]))
    model.latent_feedback = fb.load_projection(prj, fb.prj_tensors(model_dir, cfg), dtype, device)
