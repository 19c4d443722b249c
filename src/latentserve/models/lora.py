"""PEFT LoRA merged into base weights at load: the merge, and adapter directories."""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from latentserve.models.checkpoint import ADAPTER_CONFIG, adapter_base_dir, read_adapter_config
from latentserve.models.registry import LLAMA_FAMILY

ADAPTER_WEIGHTS = ("adapter_model.safetensors", "adapter_model.bin")
PEFT_PREFIX = "base_model.model."

# adapter_config.json fields that must be unset (null, false, empty): what each would need.
_UNSUPPORTED = {
    "use_dora": "DoRA (a magnitude vector per weight)",
    "modules_to_save": "whole modules trained beside the adapter",
    "fan_in_fan_out": "weights stored [in, out] (GPT-2 Conv1D)",
    "layer_replication": "replicated decoder layers",
    "lora_bias": "a bias on lora_B",
    "trainable_token_indices": "trained embedding rows",
    "alora_invocation_tokens": "activated LoRA (on only after the invocation tokens)",
    "use_qalora": "QA-LoRA",
    "target_parameters": "LoRA on nn.Parameters (MoE experts)",
    "use_bdlora": "block-diagonal LoRA",
    "arrow_config": "Arrow routing over several adapters",
    "kasa_config": "KaSA",
    "monteclora_config": "MonteCLoRA",
    "lora_ga_config": "LoRA-GA, whose initialization changes the base weights",
}
# Fields that do not change the merged weights (training, bookkeeping, which modules were
# targeted: the adapter's tensor names say that).
_IGNORED = frozenset((
    "task_type", "auto_mapping", "peft_version", "base_model_name_or_path", "revision",
    "inference_mode", "target_modules", "exclude_modules", "lora_dropout",
    "layers_to_transform", "layers_pattern", "megatron_config", "megatron_core",
    "loftq_config", "eva_config", "corda_config", "velora_config", "qalora_group_size",
    "ensure_weight_tying", "runtime_config"))
# init_lora_weights values that leave the base weights untouched (PiSSA, OLoRA, CorDA and
# LoftQ rewrite them when the adapter is created, so the adapter fits only that rewritten
# base; PEFT's saved form after path_initial_model_for_weight_conversion says True).
_PLAIN_INITS = (True, False, "gaussian", "eva", "orthogonal", "mica")


def lora_scale(alpha: float, r: int, use_rslora: bool = False) -> float:
    """PEFT's ``scaling``: ``alpha / r``, or ``alpha / sqrt(r)`` with rsLoRA."""
    return alpha / (math.sqrt(r) if use_rslora else r)


def merged_weight(w: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: float, *,
                  transpose: bool = False, name: str = "weight") -> torch.Tensor:
    """``w + (b @ a) * scale`` as a new float32 tensor: ``w`` ``[out, in]`` (``[in, out]``
    with ``transpose``, GPT-2's Conv1D), ``a`` ``[r, in]``, ``b`` ``[out, r]``. Raises
    ValueError naming ``name`` and the shapes when they do not fit."""
    if a.dim() != 2 or b.dim() != 2 or b.shape[1] != a.shape[0]:
        raise ValueError(f"LoRA pair of {name!r} does not fit together: lora_A "
                         f"{tuple(a.shape)} [r, in], lora_B {tuple(b.shape)} [out, r]")
    delta = b.float() @ a.float()
    if transpose:
        delta = delta.t()
    if delta.shape != w.shape:
        raise ValueError(f"LoRA pair of {name!r} gives an update of shape "
                         f"{tuple(delta.shape)} but the base weight is {tuple(w.shape)}")
    return w.float() + delta * scale


def split_lora_key(name: str) -> tuple[str, str] | None:
    """``<module>.lora_A[.<adapter>].weight`` -> ``(module, "A" | "B")``; None without
    ``.lora_``; ValueError for any other LoRA tensor (DoRA, bias, embedding LoRA)."""
    for part in ("A", "B"):
        module, sep, rest = name.partition(f".lora_{part}.")
        if sep and (rest == "weight" or (rest.endswith(".weight") and rest.count(".") == 1)):
            return module, part
    if ".lora_" in name:
        raise ValueError(f"unsupported PEFT tensor {name!r}: only plain LoRA "
                         "lora_A/lora_B weights can be merged")
    return None


@dataclass(frozen=True, slots=True)
class LoraPair:
    """One adapted weight: ``a`` ``[r, in]`` and ``b`` ``[out, r]`` as stored (any float
    dtype) and PEFT's ``scale`` for this module."""

    a: torch.Tensor
    b: torch.Tensor
    scale: float


@dataclass(frozen=True, slots=True)
class LoraAdapter:
    """A checked adapter directory: ``path``, ``base_dir``, ``pairs`` (base weight name ->
    :class:`LoraPair`)."""

    path: Path
    base_dir: Path
    pairs: dict[str, LoraPair]


def _bad(field: str, msg: str) -> ValueError:
    return ValueError(f"{ADAPTER_CONFIG}: field {field!r} {msg}")


def _number(v, field: str, integer: bool) -> None:
    ok = isinstance(v, int) if integer else isinstance(v, (int, float))
    if isinstance(v, bool) or not ok or not math.isfinite(v) or v <= 0:
        raise _bad(field, f"must be {'an integer' if integer else 'a finite number'} > 0, "
                   f"got {v!r}")


def check_adapter_config(cfg: dict) -> dict:
    """``{r, lora_alpha, use_rslora, rank_pattern, alpha_pattern}`` of a parsed
    ``adapter_config.json``; ValueError naming a bad, unsupported or unknown field."""
    if not isinstance(cfg, dict):
        raise ValueError(f"{ADAPTER_CONFIG} must hold a JSON object")
    if cfg.get("peft_type", "LORA") != "LORA":
        raise _bad("peft_type", f"must be 'LORA', got {cfg['peft_type']!r}")
    _number(cfg.get("r"), "r", integer=True)
    _number(cfg.get("lora_alpha"), "lora_alpha", integer=False)
    rslora = cfg.get("use_rslora", False)
    if not isinstance(rslora, bool):
        raise _bad("use_rslora", f"must be true or false, got {rslora!r}")
    patterns = {}
    for field, integer in (("rank_pattern", True), ("alpha_pattern", False)):
        pattern = cfg.get(field) or {}
        if not isinstance(pattern, dict):
            raise _bad(field, f"must be an object of module pattern -> value, got {pattern!r}")
        for key, v in pattern.items():
            _number(v, f"{field}.{key}", integer)
        patterns[field] = pattern
    if cfg.get("bias", "none") != "none":
        raise _bad("bias", f"must be 'none' (trained biases are not merged), got "
                   f"{cfg['bias']!r}")
    init = cfg.get("init_lora_weights", True)
    if init not in _PLAIN_INITS:
        raise _bad("init_lora_weights", f"is {init!r}, an initialization that rewrites the "
                   "base weights; save the adapter converted to plain LoRA (PEFT "
                   "save_pretrained(path_initial_model_for_weight_conversion=...)) first")
    known = {"peft_type", "r", "lora_alpha", "use_rslora", "rank_pattern", "alpha_pattern",
             "bias", "init_lora_weights"} | _IGNORED
    for field, v in cfg.items():
        if v in (None, False, "", [], {}) or field in known:
            continue
        what = _UNSUPPORTED.get(field, "a setting this loader does not know")
        raise _bad(field, f"is {v!r}: {what} is not supported; only plain LoRA adapters are "
                   "merged (the field must be unset, false or empty)")
    return {"r": cfg["r"], "lora_alpha": cfg["lora_alpha"], "use_rslora": rslora, **patterns}


def _pattern_value(pattern: dict, module: str, default):
    """PEFT's ``get_pattern_key``: the first key ``k`` with ``re.match(rf"(.*\\.)?({k})$",
    module)`` gives the value, else ``default``."""
    for key, value in pattern.items():
        if re.match(rf"(.*\.)?({key})$", module):
            return value
    return default


def read_adapter(adapter_dir: str | Path) -> LoraAdapter:
    """Read and check ``adapter_dir``. Raises ValueError for a bad config, base or tensor (one
    holding NaN or inf named with its file: it would serve NaN logits), FileNotFoundError
    without an adapter weights file."""
    adapter_dir = Path(adapter_dir)
    cfg = check_adapter_config(read_adapter_config(adapter_dir))
    base_dir = adapter_base_dir(adapter_dir)
    path = next((adapter_dir / n for n in ADAPTER_WEIGHTS if (adapter_dir / n).is_file()), None)
    if path is None:
        raise FileNotFoundError(f"{adapter_dir} has {ADAPTER_CONFIG} but no "
                                f"{' or '.join(ADAPTER_WEIGHTS)}")
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        tensors = load_file(str(path))
    else:
        tensors = torch.load(path, map_location="cpu", weights_only=True)
    found: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        try:
            hit = split_lora_key(key)
        except ValueError as e:
            raise ValueError(f"{adapter_dir}: {e}") from None
        if hit is None:
            raise ValueError(f"{adapter_dir}: tensor {key!r} is not a LoRA A/B weight (a "
                             "saved module, as modules_to_save writes, is not supported)")
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            raise ValueError(f"{path}: tensor {key!r} holds non-finite values (NaN or inf); "
                             "was the adapter trained with a diverging loss?")
        module, part = hit[0].removeprefix(PEFT_PREFIX), hit[1]
        if part in found.setdefault(module, {}):
            raise ValueError(f"{adapter_dir}: {module!r} has more than one lora_{part}")
        found[module][part] = tensor
    pairs = {}
    for module, ab in found.items():
        if set(ab) != {"A", "B"}:
            raise ValueError(f"{adapter_dir}: {module!r} has only lora_{next(iter(ab))}")
        r = _pattern_value(cfg["rank_pattern"], module, cfg["r"])
        if ab["A"].dim() != 2 or ab["A"].shape[0] != r:
            field = "rank_pattern" if r != cfg["r"] else "r"
            raise _bad(field, f"gives rank {r} for {module!r} but its lora_A is "
                       f"{tuple(ab['A'].shape)} [r, in]")
        alpha = _pattern_value(cfg["alpha_pattern"], module, cfg["lora_alpha"])
        pairs[module + ".weight"] = LoraPair(ab["A"], ab["B"],
                                             lora_scale(alpha, r, cfg["use_rslora"]))
    return LoraAdapter(adapter_dir, base_dir, pairs)


def check_base_type(adapter: LoraAdapter, model_type: str | None) -> None:
    """Raise ValueError unless the base's ``model_type`` is one ``merge_adapter`` merges into."""
    if model_type not in LLAMA_FAMILY:
        raise ValueError(f"{adapter.path}: LoRA adapters are merged into {list(LLAMA_FAMILY)} "
                         f"models; the base {adapter.base_dir} has model_type {model_type!r}")


def merge_adapter(weights: Iterable[tuple[str, torch.Tensor]], adapter: LoraAdapter,
                  hf_config) -> Iterator[tuple[str, torch.Tensor]]:
    """The base's ``(name, tensor)`` stream with ``adapter`` merged (float32). Raises
    ValueError for a non-Llama model, a tied adapted ``lm_head``, a shape mismatch, or a
    pair without a base weight."""
    check_base_type(adapter, getattr(hf_config, "model_type", None))
    if getattr(hf_config, "tie_word_embeddings", False) and "lm_head.weight" in adapter.pairs:
        raise ValueError(f"{adapter.path}: the adapter targets lm_head, which the base ties to "
                         "model.embed_tokens (tie_word_embeddings); merging would change the "
                         "input embedding too")
    return _merged_stream(weights, adapter)


def _merged_stream(weights, adapter: LoraAdapter):
    left = dict(adapter.pairs)
    for name, tensor in weights:
        pair = left.pop(name, None)
        if pair is not None:
            tensor = merged_weight(tensor, pair.a, pair.b, pair.scale, name=name)
        yield name, tensor
    if left:
        raise ValueError(f"{adapter.path}: {len(left)} LoRA module(s) match no base weight in "
                         f"{adapter.base_dir}, e.g. {sorted(left)[:3]}: wrong base?")


def _indices_for(module: str, spec, embed: str) -> list[int] | None:
    """The ids PEFT's ``trainable_token_indices`` gives ``module`` (list: ``embed``'s)."""
    if isinstance(spec, dict):
        return next((ids for key, ids in spec.items()
                     if module == key or module.endswith("." + key)), None)
    return spec if module == embed and spec is not None else None


def fold_embedding_adapters(state: dict[str, torch.Tensor], token_indices, embed: str,
                            tied: bool, base: dict[str, torch.Tensor] | None = None
                            ) -> dict[str, torch.Tensor]:
    """PEFT's trained embedding / LM head forms -> a plain ``<module>.weight``: trainable
    tokens (PEFT ``tuners/trainable_tokens/layer.py`` ``get_merged_weights``) and
    ``modules_to_save``. ``base``: the base's weights, for rows the adapter lacks.
    Raises ValueError naming the module when rows, deltas and ids do not fit."""
    out, tokens, trained = {}, {}, {}
    for k, v in state.items():
        module, sep, rest = k.partition(".token_adapter.")
        if sep:
            if rest == "base_layer.weight":
                tokens.setdefault(module, {})["base"] = v
            elif rest.split(".")[0] == "trainable_tokens_delta":
                tokens.setdefault(module, {})["delta"] = v
            elif rest.split(".")[0] != "trainable_tokens_original":
                raise ValueError(f"unsupported PEFT trainable-tokens tensor {k!r}")
            continue
        module, sep, rest = k.partition(".modules_to_save.")
        if sep:
            trained[f"{module}.{rest.removeprefix('default.')}"] = v
        elif ".original_module." not in k:
            out[k] = v
    out.update(trained)  # the trained copy wins over a plain name saved beside it
    base = base or {}
    for module, parts in tokens.items():
        ids = _indices_for(module, token_indices, embed)
        rows = parts.get("base", base.get(f"{module}.weight"))
        delta = parts.get("delta")
        if tied and module == "lm_head" and ids is None:  # PEFT's tied adapter: the embedding's
            shared = tokens.get(embed, {})
            ids = _indices_for(embed, token_indices, embed)
            rows = parts.get("base", shared.get("base", base.get(f"{embed}.weight")))
            delta = delta if delta is not None else shared.get("delta")
        if delta is None:
            raise ValueError(f"{module!r} has token_adapter.base_layer.weight but no "
                             "trainable_tokens_delta")
        if rows is None:
            raise ValueError(f"{module!r} has a trainable_tokens_delta but no base rows: "
                             f"neither token_adapter.base_layer.weight nor the base's "
                             f"{module}.weight")
        if ids is None:
            raise ValueError(f"{module!r} has trainable-token rows but adapter_config.json's "
                             f"trainable_token_indices ({token_indices!r}) names no ids for it")
        out[f"{module}.weight"] = _replace_rows(rows, list(ids), delta, module)
    return out


def _replace_rows(base: torch.Tensor, ids: list[int], delta: torch.Tensor,
                  module: str) -> torch.Tensor:
    """``base`` ``[V, H]`` with row ``ids[i]`` = ``delta[i]`` (``delta`` ``[len(ids), H]``,
    cast to ``base.dtype``), as PEFT's ``index_copy``."""
    if delta.dim() != 2 or delta.shape[0] != len(ids) or delta.shape[1] != base.shape[1]:
        raise ValueError(f"{module!r}: trainable_tokens_delta is {tuple(delta.shape)} but "
                         f"{len(ids)} token ids over base rows {tuple(base.shape)} need "
                         f"({len(ids)}, {base.shape[1]})")
    bad = [i for i in ids if isinstance(i, bool) or not isinstance(i, int)
           or not 0 <= i < base.shape[0]]
    if bad:
        raise ValueError(f"{module!r}: trainable token id {bad[0]!r} is not a row of the "
                         f"{base.shape[0]}-row base")
    for j, i in enumerate(ids):
        first = ids.index(i)
        if first != j and not torch.equal(delta[first], delta[j]):
            raise ValueError(f"{module!r}: trainable_token_indices lists token {i} twice with "
                             "different rows (PEFT's result is undefined)")
    index = torch.tensor(ids, dtype=torch.long)
    return base.index_copy(0, index, delta.to(base.dtype))
