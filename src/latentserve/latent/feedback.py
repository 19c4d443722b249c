"""Feedback latent models (COCONUT, CODI, SIM-CoT) from their upstream checkpoint forms
(docs/internals.md)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from latentserve.latent.spec import LatentSpec, finite_positive
from latentserve.models.lora import lora_scale, merged_weight, split_lora_key

LATENT_CONFIG = "latent_config.json"
FAMILIES = ("coconut", "codi")
_TOKENS = {"coconut": ("start_latent", "end_latent", "latent"), "codi": ("pad", "bot", "eot")}
_GPT2_CONV1D = ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")
BUFFER_SUFFIXES = (".attn.bias", ".attn.masked_bias", "rotary_emb.inv_freq")
_EMBED_KEYS = ("transformer.wte.weight", "wte.weight", "model.embed_tokens.weight")


# ----------------------------------------------------------------------------- config

def bad_field(field: str, msg: str) -> ValueError:
    return ValueError(f"{LATENT_CONFIG}: field {field!r} {msg}")


def config_int(cfg: dict, field: str, lo: int = 0, default=None) -> int:
    v = cfg
    for k in field.split("."):
        v = v.get(k, None) if isinstance(v, dict) else None
    if v is None:
        if default is None:
            raise bad_field(field, "is required")
        return default
    if isinstance(v, bool) or not isinstance(v, int) or v < lo:
        raise bad_field(field, f"must be an integer >= {lo}, got {v!r}")
    return v


def check_common(cfg, families: tuple[str, ...], default_budget: int | None,
                 model_dir: Path | None = None) -> dict:
    """The checks every ``latent_config.json`` shares; a deep copy with defaults filled in
    (``default_budget`` None: required). Raises ValueError naming the field."""
    if not isinstance(cfg, dict):
        raise ValueError(f"{LATENT_CONFIG} must hold a JSON object")
    cfg = json.loads(json.dumps(cfg))  # deep copy
    if cfg.get("family") not in families:
        raise bad_field("family", f"must be one of {list(families)}, got {cfg.get('family')!r}")
    ver = cfg.setdefault("format_version", 1)
    if isinstance(ver, bool) or ver != 1:
        raise bad_field("format_version", f"must be 1, got {ver!r}")
    cfg["default_budget"] = config_int(cfg, "default_budget", default=default_budget)
    cfg["max_budget"] = config_int(cfg, "max_budget", default=max(64, cfg["default_budget"]))
    if cfg["default_budget"] > cfg["max_budget"]:
        raise bad_field("default_budget", f"must be <= max_budget ({cfg['max_budget']})")
    ckpt = cfg.setdefault("checkpoint", None)
    if ckpt is not None:
        if not isinstance(ckpt, str) or not ckpt or "/" in ckpt or ckpt.startswith("."):
            raise bad_field("checkpoint", f"must name a file inside the model directory, got "
                            f"{ckpt!r}")
        if model_dir is not None and not (Path(model_dir) / ckpt).is_file():
            raise bad_field("checkpoint", f"names {ckpt!r}, which is not a file in {model_dir}")
    return cfg


def check_lora_prj(cfg: dict, prj_fields: str = "{eps}") -> None:
    """Check ``lora`` (``{r, alpha, use_rslora}`` or null) and ``prj`` (an object
    ``prj_fields``, its ``eps``, or null) in place, filling their defaults."""
    lora = cfg.setdefault("lora", None)
    if lora is not None:
        if not isinstance(lora, dict):
            raise bad_field("lora", "must be an object {r, alpha} or null")
        config_int(cfg, "lora.r", lo=1)
        if not finite_positive(lora.get("alpha")):
            raise bad_field("lora.alpha", f"must be a finite number > 0, got {lora.get('alpha')!r}")
        if not isinstance(lora.setdefault("use_rslora", False), bool):
            raise bad_field("lora.use_rslora", f"must be true or false, got {lora['use_rslora']!r}")
    prj = cfg.setdefault("prj", None)
    if prj is not None:
        if not isinstance(prj, dict):
            raise bad_field("prj", f"must be an object {prj_fields} or null")
        eps = prj.setdefault("eps", 1e-5)
        if not finite_positive(eps):
            raise bad_field("prj.eps", f"must be a finite number > 0, got {eps!r}")


def validate_latent_config(cfg: dict, model_dir: Path | None = None) -> dict:
    """A feedback family's ``cfg`` checked, with defaults filled in. Raises ValueError naming
    the field (e.g. ``'tokens.bot'``)."""
    cfg = check_common(cfg, FAMILIES, 6, model_dir)
    fam = cfg["family"]
    if not isinstance(cfg.get("tokens"), dict):
        raise bad_field("tokens", f"is required: an object with {list(_TOKENS[fam])}")
    ids = [config_int(cfg, f"tokens.{k}") for k in _TOKENS[fam]]
    if len(set(ids)) != len(ids):
        raise bad_field("tokens", f"ids must be distinct, got {cfg['tokens']}")
    if "vocab_size" in cfg:
        v = config_int(cfg, "vocab_size", lo=1)
        if max(ids) >= v:
            raise bad_field("tokens", f"ids must be < vocab_size ({v}), got {ids}")
    if fam != "codi":
        if cfg.get("lora") or cfg.get("prj"):
            raise bad_field("lora" if cfg.get("lora") else "prj", "is for family 'codi' only")
        return cfg
    rm = cfg.setdefault("remove_eos", True)
    if not isinstance(rm, bool):
        raise bad_field("remove_eos", f"must be true or false, got {rm!r}")
    if not rm:
        config_int(cfg, "tokens.eos")
    check_lora_prj(cfg, "{dim, layer_norm, eps}")
    if cfg["prj"] is not None:
        config_int(cfg, "prj.dim", lo=1)
        if not isinstance(cfg["prj"].setdefault("layer_norm", True), bool):
            raise bad_field("prj.layer_norm", "must be true or false")
    return cfg


def read_config_json(model_dir: str | Path):
    """The parsed ``model_dir/latent_config.json`` or None; ValueError for invalid JSON."""
    path = Path(model_dir) / LATENT_CONFIG
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from None


def latent_spec_from_config(cfg: dict) -> LatentSpec:
    """The engine contract for a validated config (CODI ``remove_eos: false``: [eos, bot] ...
    [eot, eos], as upstream ``test.py``)."""
    t = cfg["tokens"]
    suppress: tuple[int, ...] = ()
    eos_from = 0  # CODI's test.py stops on the first eos, as the engine does
    if cfg["family"] == "coconut":
        start, end, latent = (t["start_latent"],), (t["end_latent"],), t["latent"]
        # Upstream coconut.py generate appends the first answer token unchecked, then stops
        # on eos: an eos ends the answer from its second token on (upstream_stop_rules).
        eos_from = 2
    else:
        # Upstream test.py takes the argmax over logits[:vocab_size - 1]: eot is never picked.
        start, end, latent, suppress = (t["bot"],), (t["eot"],), t["pad"], (t["eot"],)
        if not cfg["remove_eos"]:
            start, end = (t["eos"], t["bot"]), (t["eot"], t["eos"])
    return LatentSpec(kind="feedback", family=cfg["family"], default_budget=cfg["default_budget"],
                      max_budget=cfg["max_budget"], start_ids=start, end_ids=end,
                      latent_id=latent, suppress_ids=suppress, upstream_eos_from=eos_from)


# ----------------------------------------------------------------------------- weights

def read_state_dict(path: str | Path, keep=None) -> dict[str, torch.Tensor]:
    """Tensors of a ``.safetensors`` file or a ``torch.save``'d state dict (``weights_only``),
    only names ``keep(name)`` accepts when given."""
    path = Path(path)
    if path.suffix == ".safetensors":
        from safetensors import safe_open

        with safe_open(str(path), framework="pt") as f:
            return {k: f.get_tensor(k) for k in f.keys() if keep is None or keep(k)}  # noqa: SIM118 - safe_open is not iterable
    try:
        sd = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except RuntimeError:  # legacy (non-zip) torch.save format cannot be memory-mapped
        sd = torch.load(path, map_location="cpu", weights_only=True)
    if isinstance(sd, dict) and isinstance(sd.get("state_dict"), dict):
        sd = sd["state_dict"]
    if not isinstance(sd, dict):
        raise ValueError(f"{path} does not hold a state dict (got {type(sd).__name__})")
    return {k: v for k, v in sd.items() if keep is None or keep(k)}


def strip_keys(state: dict, family: str) -> dict[str, torch.Tensor]:
    """Upstream keys -> HF names, base LM only: strips ``module.``, then keeps only keys with
    the wrapper prefix (``base_causallm.`` / ``codi.``) when any has it (else all but
    ``prj.*``), then strips PEFT's ``base_model.model.``; LoRA infixes stay."""
    state = {k.removeprefix("module."): v for k, v in state.items()}
    prefix = "base_causallm." if family == "coconut" else "codi."
    if any(k.startswith(prefix) for k in state):
        state = {k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)}
    else:
        state = {k: v for k, v in state.items() if not k.startswith("prj.")}
    return {k.removeprefix("base_model.model."): v for k, v in state.items()}


def merge_lora(state: dict, lora: dict | None, conv1d: bool) -> dict[str, torch.Tensor]:
    """Fold PEFT LoRA pairs into their base weights, float32 (``models.lora.merged_weight``);
    ``conv1d``: GPT-2's ``[in, out]`` Conv1D weights. Raises ValueError when LoRA tensors and
    ``lora`` disagree or shapes do not fit."""
    out, pairs = {}, {}
    for k, v in state.items():
        hit = split_lora_key(k)
        if hit is None:
            out[k.replace(".base_layer.", ".")] = v
            continue
        mod, part = hit
        if part in pairs.setdefault(mod, {}):
            raise ValueError(f"{mod!r} has more than one LoRA adapter; merge one first")
        pairs[mod][part] = v
    if pairs and lora is None:
        raise bad_field("lora", f"is null but the checkpoint has LoRA tensors "
                        f"({next(iter(pairs))})")
    if not pairs:
        return out
    r = lora["r"]
    scale = lora_scale(lora["alpha"], r, lora.get("use_rslora", False))
    for mod, ab in pairs.items():
        if set(ab) != {"A", "B"} or mod + ".weight" not in out:
            raise ValueError(f"incomplete LoRA module {mod!r}: has {sorted(ab)}, base weight "
                             f"{'present' if mod + '.weight' in out else 'missing'}")
        if ab["A"].shape[0] != r:
            raise bad_field("lora.r", f"is {r} but {mod}.lora_A has rank {ab['A'].shape[0]}")
        name = mod + ".weight"
        out[name] = merged_weight(out[name], ab["A"], ab["B"], scale, name=name,
                                  transpose=conv1d and mod.endswith(_GPT2_CONV1D))
    return out


def embedding_rows(state: dict, model_dir, cfg: dict, fields=("tokens",)) -> int:
    """Rows of ``state``'s input embedding; ValueError naming a field of ``cfg`` whose ids do
    not fit, or when there is no embedding."""
    emb = next((state[k] for k in _EMBED_KEYS if k in state), None)
    if emb is None:
        raise ValueError(f"{model_dir}: the checkpoint has no embedding ({_EMBED_KEYS[0]} or "
                         f"{_EMBED_KEYS[2]})")
    rows = int(emb.shape[0])
    for field in fields:
        ids = list(cfg[field].values() if isinstance(cfg[field], dict) else cfg[field])
        if ids and max(ids) >= rows:
            raise bad_field(field, f"ids {ids} do not fit the embedding's {rows} rows")
    return rows


def prepare_latent_weights(model_dir, hf_config, latent_cfg):
    """``([(HF name, tensor)], hf_config)`` with ``vocab_size`` = the embedding rows; weights
    the checkpoint lacks come from the other ``*.safetensors``. Raises ValueError when the
    checkpoint has no embedding or cannot hold the ids."""
    model_dir = Path(model_dir)
    ckpt, fam = latent_cfg.get("checkpoint"), latent_cfg["family"]
    state = {}
    for f in [model_dir / ckpt] if ckpt else sorted(model_dir.glob("*.safetensors")):
        state.update(read_state_dict(f))
    conv1d = getattr(hf_config, "model_type", None) == "gpt2"
    state = merge_lora(strip_keys(state, fam), latent_cfg.get("lora"), conv1d)
    if ckpt:  # the base weights it lacks, from the other files (no tied lm_head, no buffers)
        skip = set(state) | {"transformer." + k for k in state}
        if getattr(hf_config, "tie_word_embeddings", True):
            skip.add("lm_head.weight")
        for f in sorted(model_dir.glob("*.safetensors")):
            for k, v in read_state_dict(f).items() if f.name != ckpt else ():
                if not (k in skip or "transformer." + k in skip or k.endswith(BUFFER_SUFFIXES)):
                    state[k] = v
    rows = embedding_rows(state, model_dir, latent_cfg)
    if latent_cfg.get("vocab_size", rows) != rows:
        raise bad_field("vocab_size", f"is {latent_cfg['vocab_size']} but the checkpoint's "
                        f"embedding has {rows} rows")
    hf_config.vocab_size = rows
    return list(state.items()), hf_config


# ----------------------------------------------------------------------------- feedback

def attach_latent(model, model_dir, hf_config, latent_cfg, dtype, device) -> None:
    """Set ``model.latent_spec`` and ``model.latent_feedback`` (``[N, H]`` final hidden ->
    ``[N, H]`` next input): ``nn.Identity`` or CODI's ``prj``, children named as upstream:
    ``1`` Linear(H, dim), GELU, ``3`` Linear(dim, H), ``ln`` LayerNorm(H) (optional; ``0``:
    its dropout). Raises ValueError on mismatched ``prj`` weights, or ``prj`` null with
    ``prj.*`` tensors present."""
    model.latent_spec = latent_spec_from_config(latent_cfg)
    model.latent_feedback = nn.Identity()
    if latent_cfg["family"] != "codi":
        return
    prj_cfg, sd = latent_cfg.get("prj"), prj_tensors(model_dir, latent_cfg)
    if prj_cfg is None:
        if sd:  # a hand-written config without "prj" would silently skip the projection
            dim = int(sd["1.weight"].shape[0]) if "1.weight" in sd else "?"
            want = json.dumps({"dim": dim, "layer_norm": "ln.weight" in sd, "eps": 1e-5})
            raise bad_field("prj", f"is null but the checkpoint has prj.* tensors "
                            f"({', '.join(sorted(sd)[:2])}, ...): set it, e.g. {want}")
        return
    hidden = getattr(hf_config, "hidden_size", None) or hf_config.n_embd
    prj = nn.Sequential(nn.Identity(), nn.Linear(hidden, prj_cfg["dim"]), nn.GELU(),
                        nn.Linear(prj_cfg["dim"], hidden))
    if prj_cfg["layer_norm"]:
        prj.add_module("ln", nn.LayerNorm(hidden, eps=prj_cfg["eps"]))
    model.latent_feedback = load_projection(prj, sd, dtype, device)


def hf_name(k: str, gpt2: bool = False) -> str:
    """A checkpoint key without DDP's ``module.`` and PEFT's ``base_model.model.``; ``gpt2``:
    ``transformer.``-prefixed as the original gpt2 repo's ``h.0...`` are not."""
    k = k.removeprefix("module.").removeprefix("base_model.model.")
    return "transformer." + k if gpt2 and k.startswith(("wte.", "wpe.", "h.", "ln_f.")) else k


def prj_tensors(model_dir, cfg: dict) -> dict:
    """The checkpoint's ``prj.*`` tensors, without ``prj.`` and DDP / PEFT wrappers."""
    ckpt = cfg.get("checkpoint")
    files = [Path(model_dir) / ckpt] if ckpt else sorted(Path(model_dir).glob("*.safetensors"))
    out = {}
    for f in files:
        for k, v in read_state_dict(f, keep=lambda k: hf_name(k).startswith("prj.")).items():
            if ".original_module." not in k:
                out[hf_name(k).removeprefix("prj.").replace("modules_to_save.default.", "")] = v
    return out


def load_projection(prj: nn.Module, sd: dict, dtype, device) -> nn.Module:
    """``prj`` loaded strictly from ``sd``, eval mode; ValueError naming ``prj`` on mismatch."""
    try:
        prj.load_state_dict(sd, strict=True)
    except RuntimeError as e:
        raise bad_field("prj", f"does not match the checkpoint's prj.* tensors: {e}") from None
    return prj.to(device=device, dtype=dtype).eval()
