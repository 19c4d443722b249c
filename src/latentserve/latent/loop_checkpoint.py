"""Looped-block models (PCCoT, LOTUS) from a latentserve model directory: the latent config,
the weights (PEFT LoRA merged at load) and the ``LatentSpec``. The loop itself is in
``latent/loop.py``; ``latentserve convert pccot`` (``latent/loop_convert.py``) writes the
directory from PCCoT's upstream form.

Design notes: docs/internals.md, "latentserve.latent.loop_checkpoint".
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from latentserve.latent.feedback import BUFFER_SUFFIXES, read_state_dict
from latentserve.latent.spec import LatentSpec, finite_positive

LOOP_FAMILIES = ("pccot", "lotus")
_TOKENS = {"pccot": ("bot", "eot", "latent"), "lotus": ("start", "end", "latent")}


def _bad(field: str, msg: str) -> ValueError:
    return ValueError(f"latent_config.json: field {field!r} {msg}")


def _pos_int(cfg: dict, field: str, lo: int, default=None) -> int:
    v = cfg.get(field, default)
    if v is None:
        raise _bad(field, "is required")
    if isinstance(v, bool) or not isinstance(v, int) or v < lo:
        raise _bad(field, f"must be an integer >= {lo}, got {v!r}")
    return v


def validate_loop_config(cfg: dict, model_dir: Path | None = None) -> dict:
    """Check a loop family's parsed latent_config.json; return a copy with defaults filled.
    Raises ValueError naming the offending field."""
    cfg = json.loads(json.dumps(cfg))
    fam = cfg.get("family")
    if fam not in LOOP_FAMILIES:
        raise _bad("family", f"must be one of {list(LOOP_FAMILIES)}, got {fam!r}")
    fv = cfg.setdefault("format_version", 1)
    if isinstance(fv, bool) or fv != 1:
        raise _bad("format_version", f"must be 1, got {fv!r}")
    cfg["block_size"] = _pos_int(cfg, "block_size", 1)
    cfg["default_budget"] = _pos_int(cfg, "default_budget", 0)
    cfg["max_budget"] = _pos_int(cfg, "max_budget", 0, max(64, cfg["default_budget"]))
    if cfg["default_budget"] > cfg["max_budget"]:
        raise _bad("default_budget", f"must be <= max_budget ({cfg['max_budget']})")
    toks = cfg.get("tokens")
    if not isinstance(toks, dict) or set(toks) != set(_TOKENS[fam]):
        raise _bad("tokens", f"must be an object with exactly {list(_TOKENS[fam])}, got {toks!r}")
    for k, v in toks.items():
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise _bad(f"tokens.{k}", f"must be a token id >= 0, got {v!r}")
    prompt = cfg.setdefault("answer_prompt_ids", [])
    if not isinstance(prompt, list) or not all(isinstance(t, int) and not isinstance(t, bool)
                                               and t >= 0 for t in prompt):
        raise _bad("answer_prompt_ids", f"must be a list of token ids, got {prompt!r}")
    rule = cfg.setdefault("loop_rule", "jacobi" if fam == "pccot" else "same")
    if rule not in (("jacobi",) if fam == "pccot" else ("same", "jacobi")):
        raise _bad("loop_rule", f"must be 'jacobi' for pccot, 'same' or 'jacobi' for lotus, "
                   f"got {rule!r}")
    lora = cfg.setdefault("lora", None)
    if lora is not None:
        if not isinstance(lora, dict):
            raise _bad("lora", "must be an object {r, alpha} or null")
        _pos_int(lora, "r", 1)
        a = lora.get("alpha")
        if not finite_positive(a):
            raise _bad("lora.alpha", f"must be a finite number > 0, got {a!r}")
        if not isinstance(lora.setdefault("use_rslora", False), bool):
            raise _bad("lora.use_rslora", f"must be true or false, got {lora['use_rslora']!r}")
    prj = cfg.setdefault("prj", None)
    if prj is not None:
        if not isinstance(prj, dict):
            raise _bad("prj", "must be an object {eps} or null")
        eps = prj.setdefault("eps", 1e-5)
        if not finite_positive(eps):
            raise _bad("prj.eps", f"must be a finite number > 0, got {eps!r}")
    ckpt = cfg.setdefault("checkpoint", None)
    if ckpt is not None:
        if not isinstance(ckpt, str) or "/" in ckpt or ckpt.startswith("."):
            raise _bad("checkpoint", f"must name a file inside the model directory, got {ckpt!r}")
        if model_dir is not None and not (Path(model_dir) / ckpt).is_file():
            raise _bad("checkpoint", f"names {ckpt!r}, which is not a file in {model_dir}")
    return cfg


def read_loop_config(model_dir) -> dict | None:
    """The validated ``latent_config.json`` when its family is a loop family, else None (no
    file, or another family). Raises ValueError for a bad loop config or invalid JSON."""
    path = Path(model_dir) / "latent_config.json"
    if not path.is_file():
        return None
    try:
        cfg = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(cfg, dict) or cfg.get("family") not in LOOP_FAMILIES:
        return None
    return validate_loop_config(cfg, Path(model_dir))


def loop_spec_from_config(cfg: dict) -> LatentSpec:
    """The engine contract: start ids, block, end ids = end token + answer prompt. PCCoT's
    upstream stop rule (``LatentSpec.upstream_eos_from``) is 2: its ``generate`` (whyNLP/PCCoT
    ``models/generate.py``) checks the stopping criteria only from the second answer token
    on. LOTUS has no upstream generate: the engine's rule."""
    t = cfg["tokens"]
    pccot = cfg["family"] == "pccot"
    start, end = (t["bot"], t["eot"]) if pccot else (t["start"], t["end"])
    return LatentSpec(kind="loop", family=cfg["family"], default_budget=cfg["default_budget"],
                      max_budget=cfg["max_budget"], positions_per_thought=cfg["block_size"],
                      start_ids=(start,), end_ids=(end, *cfg["answer_prompt_ids"]),
                      latent_id=t["latent"], block_size=cfg["block_size"],
                      loop_rule=cfg["loop_rule"], upstream_eos_from=2 if pccot else 0)


def _hf_name(k: str, gpt2: bool) -> str:
    k = k.removeprefix("module.").removeprefix("base_model.model.")
    if gpt2 and k.startswith(("wte.", "wpe.", "h.", "ln_f.")):
        k = "transformer." + k  # the original gpt2 repo stores h.0... without the prefix
    return k


def prepare_loop_weights(model_dir, hf_config, cfg: dict):
    """``(weights, hf_config)``: HF-named ``(name, tensor)`` pairs with the checkpoint read
    over the directory's other ``*.safetensors`` (the base) and its LoRA pairs merged
    (``feedback.merge_lora``); ``prj.*`` and buffers dropped; ``hf_config.vocab_size`` = the
    embedding rows. Raises ValueError when the token ids do not fit the embedding."""
    from latentserve.latent.feedback import _EMBED_KEYS, merge_lora

    model_dir = Path(model_dir)
    gpt2 = getattr(hf_config, "model_type", None) == "gpt2"
    ckpt = cfg.get("checkpoint")
    files = [f for f in sorted(model_dir.glob("*.safetensors")) if f.name != ckpt]
    if ckpt:
        files.append(model_dir / ckpt)  # last: its tensors (e.g. a resized wte) win
    state = {}
    for f in files:
        for k, v in read_state_dict(f).items():
            k = _hf_name(k, gpt2)
            if not k.startswith("prj.") and not k.endswith(BUFFER_SUFFIXES):
                state[k] = v
    state = merge_lora(state, cfg.get("lora"), gpt2)
    emb = next((state[k] for k in _EMBED_KEYS if k in state), None)
    if emb is None:
        raise ValueError(f"{model_dir}: no embedding weight ({_EMBED_KEYS[0]} or "
                         f"{_EMBED_KEYS[2]})")
    rows = int(emb.shape[0])
    for field, ids in (("tokens", list(cfg["tokens"].values())),
                       ("answer_prompt_ids", list(cfg["answer_prompt_ids"]))):
        if ids and max(ids) >= rows:
            raise _bad(field, f"ids {ids} do not fit the embedding's {rows} rows")
    hf_config.vocab_size = rows
    return list(state.items()), hf_config


class PCCoTProjection(nn.Module):
    """PCCoT's ``prj`` (``use_projection``): Linear(H, H) -> GELU (erf) -> Linear(H, H) ->
    LayerNorm(H); children ``0``, ``2``, ``3`` as upstream's ``nn.Sequential``.
    ``forward(hidden [N, H]) -> [N, H]``, same dtype."""

    def __init__(self, hidden: int, eps: float = 1e-5):
        super().__init__()
        self.add_module("0", nn.Linear(hidden, hidden))
        self.add_module("2", nn.Linear(hidden, hidden))
        self.add_module("3", nn.LayerNorm(hidden, eps=eps))

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        m = self._modules
        return m["3"](m["2"](nn.functional.gelu(m["0"](hidden))))


def _prj_state(model_dir: Path, cfg: dict) -> dict:
    """``prj.*`` tensors of the checkpoint, PEFT's ``modules_to_save`` wrapper removed."""
    ckpt = cfg.get("checkpoint")
    files = [model_dir / ckpt] if ckpt else sorted(model_dir.glob("*.safetensors"))
    out = {}
    for f in files:
        for k, v in read_state_dict(f).items():
            k = k.removeprefix("module.").removeprefix("base_model.model.")
            if k.startswith("prj.") and ".original_module." not in k:
                k = k.removeprefix("prj.").replace("modules_to_save.default.", "")
                out[k] = v
    return out


def attach_loop(model, model_dir, hf_config, cfg: dict, dtype, device) -> None:
    """Set ``model.latent_spec`` (kind ``"loop"``) and ``model.latent_feedback`` (identity,
    or :class:`PCCoTProjection` loaded strictly from the checkpoint's ``prj.*``).
    Raises ValueError when ``prj`` is configured but its tensors do not match."""
    model.latent_spec = loop_spec_from_config(cfg)
    if cfg.get("prj") is None:
        model.latent_feedback = nn.Identity()
        return
    hidden = getattr(hf_config, "hidden_size", None) or hf_config.n_embd
    prj = PCCoTProjection(hidden, cfg["prj"]["eps"])
    try:
        prj.load_state_dict(_prj_state(Path(model_dir), cfg), strict=True)
    except RuntimeError as e:
        raise _bad("prj", f"does not match the checkpoint's prj.* tensors: {e}") from None
    model.latent_feedback = prj.to(device=device, dtype=dtype).eval()
