"""``latentserve convert pccot``: PCCoT's upstream form -> a latentserve model directory.

Upstream (arXiv 2506.18582; whyNLP/PCCoT, e.g. the ``whynlp/pccot-gpt2`` repo) ships a PEFT
adapter directory over a base model: ``adapter_config.json`` (``r``, ``lora_alpha``,
``use_rslora``), ``adapter_model.safetensors`` (LoRA pairs; the resized embedding when the
special tokens were added; ``prj`` when ``use_projection`` and saved), ``config.json``
(``model_type`` ``pccot-gpt2`` / ``pccot-llama``, ``num_iterations``, ``use_projection``),
``pccot_args.json`` (``bot_token_id``, ``eot_token_id``, ``latent_token_id``,
``answer_prompt``, ``num_latent_tokens``) and the tokenizer with ``<pcot.*>`` tokens.

The output directory (docs/models.md): the base's config with ``model_type`` the base's and
``vocab_size`` the embedding rows, the adapter's tokenizer, ``base.safetensors`` (the base
weights), ``adapter_model.safetensors`` (copied unchanged; LoRA is merged at load) and
``latent_config.json`` (family ``pccot``; answer prompt tokenized as upstream's
``COTDataProcessor``: ``encode(answer_prompt, add_special_tokens=False)``).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from latentserve.latent.feedback import BUFFER_SUFFIXES, read_state_dict
from latentserve.latent.loop_checkpoint import validate_loop_config

ADAPTER_FILE = "adapter_model.safetensors"


def _read_json(path: Path, what: str) -> dict:
    if not path.is_file():
        raise ValueError(f"--adapter {path.parent} has no {path.name} ({what})")
    return json.loads(path.read_text())


def convert_pccot(base_dir, adapter_dir, out_dir, *, max_budget: int | None = None,
                  overwrite: bool = False) -> Path:
    """Write a PCCoT model directory from ``adapter_dir`` (upstream form) over ``base_dir``
    (the HF base model it was trained from). Returns ``out_dir``. ``max_budget``: the
    largest ``latent_budget`` served (None: ``max(64, num_iterations)``); below the adapter's
    ``num_iterations`` (the default budget) it is an error, not silently raised. Raises
    ValueError naming the missing file or mismatching field."""
    from safetensors.torch import save_file

    from latentserve.models.checkpoint import load_tokenizer
    from latentserve.models.loader import iter_weights

    base_dir, adapter_dir, out_dir = Path(base_dir), Path(adapter_dir), Path(out_dir)
    if not (base_dir / "config.json").is_file():
        raise ValueError(f"--base {base_dir} has no config.json (an HF model directory)")
    pc = _read_json(adapter_dir / "config.json", "the pccot-* model config")
    args = _read_json(adapter_dir / "pccot_args.json", "the PCCoT token ids")
    if not (adapter_dir / ADAPTER_FILE).is_file():
        raise ValueError(f"--adapter {adapter_dir} has no {ADAPTER_FILE}")
    mt = str(pc.get("model_type", ""))
    if mt not in ("pccot-gpt2", "pccot-llama"):
        raise ValueError(f"--adapter config.json model_type must be pccot-gpt2 or pccot-llama, "
                         f"got {mt!r}")
    iters = int(pc.get("num_iterations", 6))
    if max_budget is None:
        max_budget = max(64, iters)
    if isinstance(max_budget, bool) or not isinstance(max_budget, int) or max_budget < iters:
        raise ValueError(f"--max-budget must be an integer >= the adapter's num_iterations "
                         f"({iters}, the default budget), got {max_budget!r}")
    if out_dir.exists() and any(out_dir.iterdir()) and not overwrite:
        raise ValueError(f"--out {out_dir} exists and is not empty (use --force)")
    out_dir.mkdir(parents=True, exist_ok=True)
    base_cfg = json.loads((base_dir / "config.json").read_text())
    adapter = read_state_dict(adapter_dir / ADAPTER_FILE)
    emb = [v for k, v in adapter.items() if k.endswith(("wte.weight", "embed_tokens.weight"))]
    rows = int(emb[0].shape[0]) if emb else int(base_cfg["vocab_size"])
    lora = None
    if any(".lora_A." in k or k.endswith(".lora_A.weight") for k in adapter):
        ac = _read_json(adapter_dir / "adapter_config.json", "the LoRA rank and alpha")
        lora = {"r": int(ac["r"]), "alpha": float(ac["lora_alpha"]),
                "use_rslora": bool(ac.get("use_rslora", False))}
    has_tok = any((adapter_dir / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json"))
    tok = load_tokenizer(adapter_dir if has_tok else base_dir)
    prompt = tok.encode(args.get("answer_prompt", "The answer is:"), add_special_tokens=False)
    weights = {k: v.contiguous() for k, v in iter_weights(base_dir)
               if not k.endswith(BUFFER_SUFFIXES)}
    save_file(weights, str(out_dir / "base.safetensors"), metadata={"format": "pt"})
    shutil.copy2(adapter_dir / ADAPTER_FILE, out_dir / ADAPTER_FILE)
    (out_dir / "config.json").write_text(json.dumps({**base_cfg, "vocab_size": rows},
                                                    indent=2) + "\n")
    if (base_dir / "generation_config.json").is_file():
        shutil.copy2(base_dir / "generation_config.json", out_dir / "generation_config.json")
    tok.save_pretrained(str(out_dir))
    cfg = {"format_version": 1, "family": "pccot", "checkpoint": ADAPTER_FILE,
           "tokens": {"bot": args["bot_token_id"], "eot": args["eot_token_id"],
                      "latent": args["latent_token_id"]},
           "answer_prompt_ids": prompt, "block_size": int(args.get("num_latent_tokens", 6)),
           "default_budget": iters, "max_budget": max_budget, "lora": lora,
           "prj": {"eps": 1e-5} if pc.get("use_projection") else None}  # nn.LayerNorm default
    cfg = validate_loop_config(cfg, out_dir)
    (out_dir / "latent_config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    return out_dir
