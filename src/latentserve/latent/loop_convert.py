"""``latentserve convert pccot``: PCCoT's upstream form -> a model directory."""

from __future__ import annotations

import json
from pathlib import Path

from latentserve.latent.convert import write_checked, write_configs
from latentserve.latent.feedback import BUFFER_SUFFIXES, hf_name, read_state_dict
from latentserve.latent.loop_checkpoint import validate_loop_config
from latentserve.models.checkpoint import load_tokenizer
from latentserve.models.loader import iter_weights
from latentserve.models.lora import check_adapter_config, fold_embedding_adapters

ADAPTER_FILE = "adapter_model.safetensors"


def _read_json(path: Path, what: str, flag: str = "--adapter") -> dict:
    if not path.is_file():
        raise ValueError(f"{flag} {path.parent} has no {path.name} ({what})")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from None


def _lora_of(ac: dict) -> dict:
    """``latent_config.json``'s ``lora`` from ``adapter_config.json``; ValueError naming the
    field (also ``rank_pattern`` / ``alpha_pattern``: one rank for every module)."""
    folded = ("trainable_token_indices", "modules_to_save", "fan_in_fan_out")
    checked = check_adapter_config({k: v for k, v in ac.items() if k not in folded})
    for field in ("rank_pattern", "alpha_pattern"):
        if checked[field]:
            raise ValueError(f"adapter_config.json: field {field!r} is set "
                             f"({checked[field]!r}); convert pccot merges one r and lora_alpha "
                             f"for every module (upstream run_ccot.py trains so)")
    return {"r": int(checked["r"]), "alpha": float(checked["lora_alpha"]),
            "use_rslora": checked["use_rslora"]}


def convert_pccot(base_dir, adapter_dir, out_dir, *, max_budget: int | None = None,
                  overwrite: bool = False) -> Path:
    """Write a PCCoT model directory from ``adapter_dir`` over ``base_dir``; ``max_budget``
    None: ``max(64, num_iterations)``. ValueError naming a missing file or bad field."""
    from safetensors.torch import save_file

    base_dir, adapter_dir, out_dir = Path(base_dir), Path(adapter_dir), Path(out_dir)
    pc = _read_json(adapter_dir / "config.json", "the pccot-* model config")
    args = _read_json(adapter_dir / "pccot_args.json", "the PCCoT token ids")
    if not (adapter_dir / ADAPTER_FILE).is_file():
        raise ValueError(f"--adapter {adapter_dir} has no {ADAPTER_FILE}")
    mt = str(pc.get("model_type", ""))
    if mt not in ("pccot-gpt2", "pccot-llama"):
        raise ValueError(f"--adapter config.json model_type must be pccot-gpt2 or pccot-llama, "
                         f"got {mt!r}")
    iters = pc.get("num_iterations", 6)
    if isinstance(iters, bool) or not isinstance(iters, int) or iters < 0:
        raise ValueError(f"--adapter config.json: field 'num_iterations' must be an integer "
                         f">= 0, got {iters!r}")
    if max_budget is None:
        max_budget = max(64, iters)
    if isinstance(max_budget, bool) or not isinstance(max_budget, int) or max_budget < iters:
        raise ValueError(f"--max-budget must be an integer >= the adapter's num_iterations "
                         f"({iters}, the default budget), got {max_budget!r}")
    if out_dir.exists() and any(out_dir.iterdir()) and not overwrite:  # before the reading
        raise ValueError(f"--out {out_dir} exists and is not empty (use --force)")
    base_cfg = _read_json(base_dir / "config.json", "the base model config", "--base")
    gpt2 = base_cfg.get("model_type") == "gpt2"
    if base_cfg.get("model_type") != mt.removeprefix("pccot-"):
        raise ValueError(f"--base {base_dir} is a {base_cfg.get('model_type')!r} model but the "
                         f"adapter is {mt!r}: give the base it was trained from")
    weights = {k: v.contiguous() for k, v in iter_weights(base_dir)
               if not k.endswith(BUFFER_SUFFIXES)}
    state, untie = _fold_embedding(read_state_dict(adapter_dir / ADAPTER_FILE), adapter_dir,
                                   base_dir, gpt2, weights)
    embed = "transformer.wte.weight" if gpt2 else "model.embed_tokens.weight"
    rows = int(state[embed].shape[0]) if embed in state else int(base_cfg["vocab_size"])
    lora = None
    if any(".lora_A." in k or k.endswith(".lora_A.weight") for k in state):
        lora = _lora_of(_read_json(adapter_dir / "adapter_config.json",
                                   "the LoRA rank and alpha"))
    has_tok = any((adapter_dir / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json"))
    tok = load_tokenizer(adapter_dir if has_tok else base_dir)
    prompt = tok.encode(args.get("answer_prompt", "The answer is:"), add_special_tokens=False)
    cfg = {"format_version": 1, "family": "pccot", "checkpoint": ADAPTER_FILE,
           "tokens": {"bot": args["bot_token_id"], "eot": args["eot_token_id"],
                      "latent": args["latent_token_id"]},
           "answer_prompt_ids": prompt, "block_size": int(args.get("num_latent_tokens", 6)),
           "default_budget": iters, "max_budget": max_budget, "lora": lora,
           "prj": {"eps": 1e-5} if pc.get("use_projection") else None}  # nn.LayerNorm default
    cfg = validate_loop_config(cfg)
    hf_cfg = {**base_cfg, "vocab_size": rows, **({"tie_word_embeddings": False} if untie else {})}

    def write(out: Path) -> None:
        save_file(weights, str(out / "base.safetensors"), metadata={"format": "pt"})
        save_file({k: v.contiguous() for k, v in state.items()}, str(out / ADAPTER_FILE),
                  metadata={"format": "pt"})
        write_configs(out, base_dir, hf_cfg, tok, cfg)

    return write_checked(out_dir, write)


def _fold_embedding(adapter: dict, adapter_dir: Path, base_dir: Path, gpt2: bool,
                    base_weights: dict):
    """``(state, untie)``: the adapter's tensors with embedding and ``lm_head`` folded
    (``models.lora.fold_embedding_adapters``); ``untie``: the output must set
    ``tie_word_embeddings: false``. ValueError when folding fails or GPT-2 would untie."""
    import torch
    from transformers import AutoConfig

    ac = {}
    if (adapter_dir / "adapter_config.json").is_file():
        ac = _read_json(adapter_dir / "adapter_config.json", "")
    indices = ac.get("trainable_token_indices") or ac.get("token_indices")
    tied = bool(getattr(AutoConfig.from_pretrained(base_dir, local_files_only=True),
                        "tie_word_embeddings", True))
    embed = "transformer.wte" if gpt2 else "model.embed_tokens"

    rows = {k: v for k, v in ((hf_name(k, gpt2), v) for k, v in base_weights.items())
            if k in (f"{embed}.weight", "lm_head.weight")}
    state = fold_embedding_adapters({hf_name(k, gpt2): v for k, v in adapter.items()}, indices,
                                    embed, tied, rows)
    head, emb = state.get("lm_head.weight"), state.get(embed + ".weight")
    untie = False
    if tied and head is not None:
        if emb is not None and torch.equal(head, emb):
            del state["lm_head.weight"]  # the tied copy
        elif gpt2:
            raise ValueError(f"--adapter {adapter_dir}: its lm_head rows differ from its "
                             f"embedding (e.g. modules_to_save on {embed}, which PEFT trains "
                             "apart from the tied lm_head); the engine's GPT-2 ties lm_head "
                             "to wte and cannot serve it")
        else:
            untie = True
    return state, untie
