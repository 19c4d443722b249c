"""``latentserve convert coconut|codi``: an upstream checkpoint over its base HF model
directory -> a latentserve model directory (docs/models.md, docs/internals.md)."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch

from latentserve.latent import feedback as fb
from latentserve.latent.load import load_model
from latentserve.models.checkpoint import load_tokenizer
from latentserve.models.loader import iter_weights

COCONUT_TOKENS = ("<|start-latent|>", "<|end-latent|>", "<|latent|>")


def _start(base_dir, checkpoint, out_dir, overwrite: bool):
    base_dir, checkpoint, out_dir = Path(base_dir), Path(checkpoint), Path(out_dir)
    if not (base_dir / "config.json").is_file():
        raise ValueError(f"--base {base_dir} has no config.json (an HF model directory is needed)")
    if not checkpoint.is_file():
        raise FileNotFoundError(f"--checkpoint {checkpoint} is not a file")
    if out_dir.exists() and any(out_dir.iterdir()) and not overwrite:
        raise ValueError(f"--out {out_dir} exists and is not empty (use --force)")
    return base_dir, checkpoint, out_dir, json.loads((base_dir / "config.json").read_text())


def _same_file(a: Path, b: Path) -> bool:
    return b.exists() and a.resolve() == b.resolve()


def write_checked(out_dir, write: Callable[[Path], None]) -> Path:
    """Run ``write(tmp)`` in a hidden directory next to ``out_dir``, check it (loaded as the
    engine does, float32 on CPU, with its tokenizer), then move it to ``out_dir`` (file by
    file when it exists; the caller refuses a non-empty one without ``overwrite``). Raises
    ValueError when the result would not serve or ``out_dir`` keeps weight files not
    replaced; on error ``out_dir`` is as it was."""
    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    umask = os.umask(0)
    os.umask(umask)
    tmp.chmod(0o777 & ~umask)  # as a plain mkdir of out_dir would be (mkdtemp gives 0700)
    try:
        write(tmp)
        try:
            hf_config = load_model(tmp, torch.float32, "cpu")[1]
            tokens = len(load_tokenizer(tmp))
        except Exception as e:  # any load failure means it would not serve
            raise ValueError(f"the converted model directory would not serve: "
                             f"{type(e).__name__}: {e}") from e
        if tokens > hf_config.vocab_size:
            raise ValueError(f"the converted model directory would not serve: its tokenizer "
                             f"has {tokens} tokens but the embedding only "
                             f"{hf_config.vocab_size} rows")
        if out_dir.exists():
            stale = sorted(f.name for pattern in ("*.safetensors", "pytorch_model*.bin")
                           for f in out_dir.glob(pattern) if not (tmp / f.name).is_symlink()
                           and not (tmp / f.name).exists())
            if stale:
                raise ValueError(f"--out {out_dir} holds {stale}, which this conversion does "
                                 "not write but the loader would read; remove them or choose "
                                 "another --out")
        if out_dir.exists() and not any(out_dir.iterdir()):
            out_dir.rmdir()
        if not out_dir.exists():
            tmp.rename(out_dir)
            return out_dir
        for entry in sorted(tmp.iterdir()):
            dest = out_dir / entry.name
            if entry.is_symlink() and _same_file(entry, dest):
                entry.unlink()  # the checkpoint, converted in place
            else:
                os.replace(entry, dest)
        tmp.rmdir()
        return out_dir
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)


def _finish(base_dir, checkpoint, out_dir, hf_cfg, state, latent_cfg, tokenizer, symlink):
    """Check, then write config, tokenizer, checkpoint copy, missing base weights and
    latent_config through :func:`write_checked`."""
    from safetensors.torch import save_file

    rows = latent_cfg["vocab_size"]
    # every config error (e.g. a negative --default-budget) before anything is written
    fb.validate_latent_config(latent_cfg)
    from transformers import AutoConfig

    tied = getattr(AutoConfig.from_pretrained(base_dir, local_files_only=True),
                   "tie_word_embeddings", True)
    have = set(state) | {"transformer." + k for k in state}
    base = dict(iter_weights(base_dir))
    _check_fits_base(state, base, base_dir, checkpoint)
    missing = {k: v.contiguous() for k, v in base.items()
               if k not in have and "transformer." + k not in have
               and not k.endswith(fb.BUFFER_SUFFIXES) and not (tied and k == "lm_head.weight")}
    in_place = _same_file(checkpoint, Path(out_dir) / checkpoint.name)

    def write(out: Path) -> None:
        if missing:
            save_file(missing, str(out / "base.safetensors"), metadata={"format": "pt"})
        target = out / checkpoint.name
        if symlink or in_place:  # in place: a link for the check, dropped by the move
            target.symlink_to(checkpoint.resolve())
        else:
            shutil.copy2(checkpoint, target)
        cfg = fb.validate_latent_config({**latent_cfg, "checkpoint": checkpoint.name}, out)
        write_configs(out, base_dir, {**hf_cfg, "vocab_size": rows}, tokenizer, cfg)

    return write_checked(out_dir, write)


def write_configs(out: Path, base_dir: Path, hf_cfg: dict, tokenizer, latent_cfg: dict) -> None:
    """Write ``config.json`` (``hf_cfg``), the base's ``generation_config.json`` when it has
    one, the tokenizer and ``latent_config.json`` (``latent_cfg``) into ``out``."""
    (out / "config.json").write_text(json.dumps(hf_cfg, indent=2) + "\n")
    if (base_dir / "generation_config.json").is_file():
        shutil.copy2(base_dir / "generation_config.json", out / "generation_config.json")
    tokenizer.save_pretrained(str(out))
    (out / fb.LATENT_CONFIG).write_text(json.dumps(latent_cfg, indent=2) + "\n")


def _check_fits_base(state: dict, base: dict, base_dir, checkpoint) -> None:
    """ValueError for a weight name the base lacks or a shape not the base's (embedding and
    ``lm_head`` rows excepted)."""
    norm = {k.removeprefix("transformer."): v for k, v in base.items()}
    odd = []
    for k, v in state.items():
        n = k.removeprefix("transformer.")
        if n.endswith(fb.BUFFER_SUFFIXES) or n == "lm_head.weight":
            continue
        b = norm.get(n)
        if b is None:
            odd.append(f"{k} (not in --base)")
        elif n not in ("wte.weight", "model.embed_tokens.weight") and b.shape != v.shape:
            odd.append(f"{k} {tuple(v.shape)} (--base: {tuple(b.shape)})")
    if odd:
        raise ValueError(f"{checkpoint} does not fit --base {base_dir}: {len(odd)} weights "
                         f"differ, e.g. {', '.join(odd[:3])}: wrong --base?")


def convert_coconut(base_dir, checkpoint, out_dir, *, default_budget: int = 6,
                    max_budget: int = 64, variant: str | None = None, symlink: bool = False,
                    overwrite: bool = False) -> Path:
    """Write a COCONUT model directory from a ``torch.save``'d ``checkpoint`` over
    ``base_dir``; ValueError when the token ids do not fit its vocab."""
    base_dir, checkpoint, out_dir, hf_cfg = _start(base_dir, checkpoint, out_dir, overwrite)
    state = fb.strip_keys(fb.read_state_dict(checkpoint), "coconut")
    rows = fb.embedding_rows(state, checkpoint, {}, ())
    tok = load_tokenizer(base_dir)
    tok.add_tokens(list(COCONUT_TOKENS))
    ids = tok.convert_tokens_to_ids(list(COCONUT_TOKENS))
    if max(ids) >= rows:
        raise ValueError(f"the COCONUT tokens get ids {ids} from --base's tokenizer but "
                         f"{checkpoint} has {rows} embedding rows: wrong --base?")
    cfg = {"format_version": 1, "family": "coconut", "variant": variant, "vocab_size": rows,
           "default_budget": default_budget, "max_budget": max_budget,
           "tokens": dict(zip(("start_latent", "end_latent", "latent"), ids))}
    return _finish(base_dir, checkpoint, out_dir, hf_cfg, state, cfg, tok, symlink)


def convert_codi(base_dir, checkpoint, out_dir, *, lora_alpha: float = 32.0,
                 remove_eos: bool = True, default_budget: int = 6, max_budget: int = 64,
                 variant: str | None = None, symlink: bool = False,
                 overwrite: bool = False) -> Path:
    """Write a CODI model directory from the whole module's ``checkpoint`` over ``base_dir``;
    ValueError when the embedding rows are not the base vocab + 3."""
    base_dir, checkpoint, out_dir, hf_cfg = _start(base_dir, checkpoint, out_dir, overwrite)
    raw = fb.read_state_dict(checkpoint)
    ori = int(hf_cfg["vocab_size"])
    lora_a = [v for k, v in raw.items() if ".lora_A." in k]
    lora = {"r": int(lora_a[0].shape[0]), "alpha": lora_alpha, "use_rslora": False} \
        if lora_a else None
    state = fb.merge_lora(fb.strip_keys(raw, "codi"), lora, hf_cfg.get("model_type") == "gpt2")
    rows = fb.embedding_rows(state, checkpoint, {}, ())
    if rows != ori + 3:
        raise ValueError(f"{checkpoint} has {rows} embedding rows; CODI over --base (vocab_size "
                         f"{ori}) has {ori + 3}: wrong --base?")
    raw = {k.removeprefix("module."): v for k, v in raw.items()}
    prj = {"dim": int(raw["prj.1.weight"].shape[0]), "layer_norm": "prj.ln.weight" in raw,
           "eps": 1e-5} if "prj.1.weight" in raw else None
    tok = load_tokenizer(base_dir)
    eos = tok.eos_token_id if tok.eos_token_id is not None else hf_cfg.get("eos_token_id")
    tokens = {"pad": ori, "bot": ori + 1, "eot": ori + 2}
    if isinstance(eos, int):
        tokens["eos"] = eos
    cfg = {"format_version": 1, "family": "codi", "variant": variant, "vocab_size": rows,
           "default_budget": default_budget, "max_budget": max_budget, "tokens": tokens,
           "remove_eos": remove_eos, "lora": lora, "prj": prj}
    return _finish(base_dir, checkpoint, out_dir, hf_cfg, state, cfg, tok, symlink)
