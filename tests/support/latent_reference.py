"""The eager feedback-latent reference (``latentserve.bench.baseline.latent_reference``) with
the EOS stop: greedy decoding is the same with or without it, so the answer is the reference's
``max_tokens`` tokens cut after the first EOS."""

from __future__ import annotations

from latentserve.bench.baseline import latent_reference as base
from latentserve.bench.baseline.latent_reference import load_reference


def _eos_ids(hf_model) -> set[int]:
    ids = set()
    for src in (hf_model.config.eos_token_id, getattr(hf_model.generation_config, "eos_token_id",
                                                      None)):
        ids |= set(src if isinstance(src, list) else [src] if src is not None else [])
    return ids


def reference_generate(model_dir, prompt_ids: list[int], budget: int, max_tokens: int,
                       device: str = "cpu", dtype: str = "float32", ignore_eos: bool = False,
                       upstream_stop_rules: bool = False):
    """``(answer_token_ids, first_answer_logits [vocab] float32 CPU)``; the answer ends with
    its first EOS (kept, as the engine's token_ids keep it) unless ``ignore_eos``.
    ``upstream_stop_rules``: COCONUT's upstream loop, whose first token never stops it
    (``coconut.py`` ``Coconut.generate``); ValueError for CODI."""
    model, cfg, _ = load_reference(str(model_dir), device, dtype)
    if upstream_stop_rules and cfg["family"] != "coconut":
        raise ValueError(f"upstream_stop_rules: {cfg['family']} stops on the first eos")
    answer, first = base.reference_generate(model_dir, prompt_ids, budget, max_tokens, device,
                                            dtype)
    if not ignore_eos:
        eos = _eos_ids(model)
        ends = [i for i, t in enumerate(answer) if t in eos and (i or not upstream_stop_rules)]
        answer = answer[:ends[0] + 1] if ends else answer
    return answer, first
