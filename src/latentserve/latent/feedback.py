"""Feedback latent models (COCONUT, CODI, SIM-CoT) from their upstream checkpoint forms.

Design notes: docs/internals.md, "latentserve.latent.feedback".
"""

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

def _bad(field: str, msg: str) -> ValueError:
    return ValueError(f"{LATENT_CONFIG}: field {field!r} {msg}")


def _int(cfg: dict, field: str, lo: int = 0, default=None) -> int:
    keys = field.split(".")
    v = cfg
    for k in keys:
        v = v.get(k, None) if isinstance(v, dict) else None
    if v is None:
        if default is None:
            raise _bad(field, "is required")
        return default
    if isinstance(v, bool) or not isinstance(v, int) or v < lo:
        raise _bad(field, f"must be an integer >= {lo}, got {v!r}")
    return v


def validate_latent_config(cfg: dict, model_dir: Path | None = None) -> dict:
    """Check ``cfg`` (parsed latent_config.json) and return a copy with defaults filled in.

    Raises ValueError naming the offending field (e.g. ``'tokens.bot'``, ``'lora.alpha'``).
    """
    if not isinstance(cfg, dict):
        raise ValueError(f"{LATENT_CONFIG} must hold a JSON object")
    cfg = json.loads(json.dumps(cfg))  # deep copy
    fam = cfg.get("family")
    if fam not in FAMILIES:
        raise _bad("family", f"must be one of {list(FAMILIES)}, got {fam!r}")
    ver = cfg.setdefault("format_version", 1)
    if ver != 1:
        raise _bad("format_version", f"must be 1, got {ver!r}")
    cfg["default_budget"] = _int(cfg, "default_budget", default=6)
    cfg["max_budget"] = _int(cfg, "max_budget", default=max(64, cfg["default_budget"]))
    if cfg["default_budget"] > cfg["max_budget"]:
        raise _bad("default_budget", f"must be <= max_budget ({cfg['max_budget']})")
    if not isinstance(cfg.get("tokens"), dict):
        raise _bad("tokens", f"is required: an object with {list(_TOKENS[fam])}")
    ids = [_int(cfg, f"tokens.{k}") for k in _TOKENS[fam]]
    if len(set(ids)) != len(ids):
        raise _bad("tokens", f"ids must be distinct, got {cfg['tokens']}")
    if "vocab_size" in cfg:
        v = _int(cfg, "vocab_size", lo=1)
        if max(ids) >= v:
            raise _bad("tokens", f"ids must be < vocab_size ({v}), got {ids}")
    ckpt = cfg.setdefault("checkpoint", None)
    if ckpt is not None:
        if not isinstance(ckpt, str) or not ckpt or "/" in ckpt or ckpt.startswith("."):
            raise _bad("checkpoint", f"must name a file inside the model directory, got {ckpt!r}")
        if model_dir is not None and not (Path(model_dir) / ckpt).is_file():
            raise _bad("checkpoint", f"names {ckpt!r}, which is not a file in {model_dir}")
    if fam == "codi":
        rm = cfg.setdefault("remove_eos", True)
        if not isinstance(rm, bool):
            raise _bad("remove_eos", f"must be true or false, got {rm!r}")
        if not rm:
            _int(cfg, "tokens.eos")
        lora = cfg.setdefault("lora", None)
        if lora is not None:
            if not isinstance(lora, dict):
                raise _bad("lora", "must be an object {r, alpha} or null")
            _int(cfg, "lora.r", lo=1)
            a = lora.get("alpha")
            if not finite_positive(a):
                raise _bad("lora.alpha", f"must be a finite number > 0, got {a!r}")
            if not isinstance(lora.setdefault("use_rslora", False), bool):
                raise _bad("lora.use_rslora", "must be true or false")
        prj = cfg.setdefault("prj", None)
        if prj is not None:
            if not isinstance(prj, dict):
                raise _bad("prj", "must be an object {dim, layer_norm, eps} or null")
            _int(cfg, "prj.dim", lo=1)
            if not isinstance(prj.setdefault("layer_norm", True), bool):
                raise _bad("prj.layer_norm", "must be true or false")
            eps = prj.setdefault("eps", 1e-5)
            if not finite_positive(eps):
                raise _bad("prj.eps", f"must be a finite number > 0, got {eps!r}")
    elif cfg.get("lora") or cfg.get("prj"):
        raise _bad("lora" if cfg.get("lora") else "prj", "is for family 'codi' only")
    return cfg


def read_latent_config(model_dir: str | Path) -> dict | None:
    """The validated ``model_dir/latent_config.json`` (defaults filled in), or None when the
    directory has none. Raises ValueError naming the field for a bad config."""
    path = Path(model_dir) / LATENT_CONFIG
    if not path.is_file():
        return None
    try:
        cfg = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from None
    return validate_latent_config(cfg, Path(model_dir))


def latent_spec_from_config(cfg: dict) -> LatentSpec:
    """The engine contract for a validated config. CODI with ``remove_eos: false`` wraps the
    latents as upstream ``test.py`` does: prompt + [eos, bot] ... [eot, eos]. COCONUT's
    upstream stop rule (``LatentSpec.upstream_eos_from``) is 2; CODI's is the engine's."""
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
                      max_budget=cfg["max_budget"], positions_per_thought=1,
                      start_ids=start, end_ids=end, latent_id=latent, suppress_ids=suppress,
                      upstream_eos_from=eos_from)


# ----------------------------------------------------------------------------- weights

def read_state_dict(path: str | Path, keep=None) -> dict[str, torch.Tensor]:
    """Tensors of a ``.safetensors`` file or a ``torch.save``'d state dict (read with
    ``weights_only=True``, memory-mapped when the file is a zip archive); only names for which
    ``keep(name)`` is true when ``keep`` is given."""
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
    """Upstream keys -> our (HF) names; tensors that are not part of the base LM are dropped.

    ``module.`` (DDP) is stripped first. Then the family's wrapper prefix, ``base_causallm.``
    (COCONUT) or ``codi.`` (CODI): when any key has it, only those keys are kept (dropping
    ``prj.*`` and SIM-CoT's training-only ``expainable_llm.*`` / decoder modules) and it is
    stripped; otherwise every key but ``prj.*`` is kept (a plain HF-named state dict). Last,
    PEFT's ``base_model.model.``; LoRA tensors keep their ``.base_layer`` / ``.lora_A.<adapter>``
    infixes for :func:`merge_lora`.
    """
    state = {k.removeprefix("module."): v for k, v in state.items()}
    prefix = "base_causallm." if family == "coconut" else "codi."
    if any(k.startswith(prefix) for k in state):
        state = {k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)}
    else:
        state = {k: v for k, v in state.items() if not k.startswith("prj.")}
    return {k.removeprefix("base_model.model."): v for k, v in state.items()}


def merge_lora(state: dict, lora: dict | None, conv1d: bool) -> dict[str, torch.Tensor]:
    """Fold PEFT LoRA pairs into their base weights: ``W + (B @ A) * alpha / r`` (``alpha /
    sqrt(r)`` with rsLoRA), computed and kept in float32 (``models.lora.merged_weight``; the
    loader casts to the serving dtype later, so a bf16 base is not rounded back to bf16).

    state: stripped names; ``<m>.base_layer.{weight,bias}`` become ``<m>.{weight,bias}``;
    other tensors are returned unchanged. conv1d: GPT-2, whose ``c_attn/c_proj/c_fc`` store W
    as ``[in, out]`` (Conv1D), so the update is transposed. Raises ValueError when LoRA
    tensors and ``lora`` disagree, for a PEFT tensor other than LoRA A/B, and for shapes that
    do not fit.
    """
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
        raise _bad("lora", f"is null but the checkpoint has LoRA tensors ({next(iter(pairs))})")
    if not pairs:
        return out
    r = lora["r"]
    scale = lora_scale(lora["alpha"], r, lora.get("use_rslora", False))
    for mod, ab in pairs.items():
        if set(ab) != {"A", "B"} or mod + ".weight" not in out:
            raise ValueError(f"incomplete LoRA module {mod!r}: has {sorted(ab)}, base weight "
                             f"{'present' if mod + '.weight' in out else 'missing'}")
        if ab["A"].shape[0] != r:
            raise _bad("lora.r", f"is {r} but {mod}.lora_A has rank {ab['A'].shape[0]}")
        name = mod + ".weight"
        out[name] = merged_weight(out[name], ab["A"], ab["B"], scale, name=name,
                                  transpose=conv1d and mod.endswith(_GPT2_CONV1D))
    return out


def _fallback_weights(model_dir: Path, skip: str, tied: bool):
    """Base weights from the directory's ``*.safetensors`` other than the checkpoint (a tied
    ``lm_head`` and causal-mask buffers left out)."""
    for f in sorted(model_dir.glob("*.safetensors")):
        if f.name != skip:
            for k, v in read_state_dict(f).items():
                if not (k.endswith(BUFFER_SUFFIXES) or (tied and k == "lm_head.weight")):
                    yield k, v


def prepare_latent_weights(model_dir, hf_config, latent_cfg):
    """Return ``(weights, hf_config)``: ``weights`` is a list of ``(HF name, tensor)`` for our
    model classes (GPT-2 Conv1D weights still ``[in, out]``, as in HF files); base weights the
    checkpoint lacks come from the directory's other ``*.safetensors`` (upstream loads the
    checkpoint over the pretrained base). ``hf_config.vocab_size`` is set to the embedding rows.

    Raises ValueError when the checkpoint has no embedding or its vocab cannot hold the ids.
    """
    model_dir = Path(model_dir)
    ckpt, fam = latent_cfg.get("checkpoint"), latent_cfg["family"]
    state = {}
    for f in [model_dir / ckpt] if ckpt else sorted(model_dir.glob("*.safetensors")):
        state.update(read_state_dict(f))
    conv1d = getattr(hf_config, "model_type", None) == "gpt2"
    state = merge_lora(strip_keys(state, fam), latent_cfg.get("lora"), conv1d)
    if ckpt:
        names = set(state) | {"transformer." + k for k in state}
        tied = getattr(hf_config, "tie_word_embeddings", True)
        for k, v in _fallback_weights(model_dir, ckpt, tied):
            if k not in names and "transformer." + k not in names:
                state[k] = v
    emb = next((state[k] for k in _EMBED_KEYS if k in state), None)
    if emb is None:
        raise ValueError(f"{model_dir}: the checkpoint has no embedding ({_EMBED_KEYS[0]} or "
                         f"{_EMBED_KEYS[2]})")
    rows = int(emb.shape[0])
    ids = list(latent_cfg["tokens"].values())
    if max(ids) >= rows:
        raise _bad("tokens", f"ids {ids} do not fit the checkpoint's {rows} embedding rows")
    if latent_cfg.get("vocab_size", rows) != rows:
        raise _bad("vocab_size", f"is {latent_cfg['vocab_size']} but the checkpoint's "
                   f"embedding has {rows} rows")
    hf_config.vocab_size = rows
    return list(state.items()), hf_config


# ----------------------------------------------------------------------------- feedback

class CodiProjection(nn.Module):
    """CODI's ``prj``: Linear(H, dim) -> GELU (erf) -> Linear(dim, H) -> LayerNorm(H)
    (LayerNorm absent with upstream ``--prj_no_ln``). Children are named ``1``, ``3``, ``ln``
    so upstream keys ``prj.1.weight`` ... load after stripping ``prj.``; the Dropout (index 0)
    and GELU (index 2) hold no weights. ``forward(hidden [N, H]) -> [N, H]``, same dtype."""

    def __init__(self, hidden: int, dim: int, layer_norm: bool = True, eps: float = 1e-5):
        super().__init__()
        self.add_module("1", nn.Linear(hidden, dim))
        self.add_module("3", nn.Linear(dim, hidden))
        self.ln = nn.LayerNorm(hidden, eps=eps) if layer_norm else None

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        x = self._modules["3"](nn.functional.gelu(self._modules["1"](hidden)))
        return x if self.ln is None else self.ln(x)


def attach_latent(model, model_dir, hf_config, latent_cfg, dtype, device) -> None:
    """Set ``model.latent_spec`` and register ``model.latent_feedback`` (``[N, H]`` post-final-
    norm hidden in the model dtype -> ``[N, H]`` next input embedding): ``nn.Identity`` for
    COCONUT and for CODI without ``prj``, else :class:`CodiProjection` loaded from the
    checkpoint's ``prj.*`` (strict). Raises ValueError on missing/mismatched prj weights, and
    when ``prj`` is null but the checkpoint has ``prj.*`` tensors (it would be skipped)."""
    model.latent_spec = latent_spec_from_config(latent_cfg)
    if latent_cfg["family"] != "codi":
        model.latent_feedback = nn.Identity()
        return
    prj_cfg = latent_cfg.get("prj")
    ckpt = latent_cfg.get("checkpoint")
    files = [Path(model_dir) / ckpt] if ckpt else sorted(Path(model_dir).glob("*.safetensors"))
    sd = {}
    for f in files:
        sd.update(read_state_dict(f, keep=lambda k: k.removeprefix("module.").startswith("prj.")))
    sd = {k.removeprefix("module.").removeprefix("prj."): v for k, v in sd.items()}
    if prj_cfg is None:
        if sd:  # a hand-written config without "prj" would silently skip the projection
            dim = int(sd["1.weight"].shape[0]) if "1.weight" in sd else "?"
            want = json.dumps({"dim": dim, "layer_norm": "ln.weight" in sd, "eps": 1e-5})
            raise _bad("prj", f"is null but the checkpoint has prj.* tensors "
                       f"({', '.join(sorted(sd)[:2])}, ...): set it, e.g. {want}")
        model.latent_feedback = nn.Identity()
        return
    hidden = getattr(hf_config, "hidden_size", None) or hf_config.n_embd
    prj = CodiProjection(hidden, prj_cfg["dim"], prj_cfg["layer_norm"], prj_cfg["eps"])
    try:
        prj.load_state_dict(sd, strict=True)
    except RuntimeError as e:
        raise _bad("prj", f"does not match the checkpoint's prj.* tensors: {e}") from None
    model.latent_feedback = prj.to(device=device, dtype=dtype).eval()
