"""The eager looped-block reference (``latentserve.bench.baseline.loop_reference``) with the
EOS stop: greedy decoding is the same with or without it, so the answer is the reference's
``max_tokens`` tokens cut after the first EOS."""

from __future__ import annotations

from latentserve.bench.baseline import loop_reference as base
from latentserve.bench.baseline.loop_reference import LoopReference


def reference_generate_loop(ref: LoopReference, prompt_ids: list[int], iterations: int,
                            max_tokens: int, ignore_eos: bool = False,
                            upstream_stop_rules: bool = False, passes: list | None = None):
    """``(answer_ids, first_answer_logits [vocab] float32 CPU)``; the answer ends with its
    first ``ref.eos`` token (kept) unless ``ignore_eos``. ``upstream_stop_rules``: PCCoT's
    upstream loop, whose first token never stops it (``PCCoTGenerationMixin.generate``);
    ValueError for another family. ``passes``: as the reference's."""
    if upstream_stop_rules and ref.family != "pccot":
        raise ValueError(f"upstream_stop_rules: {ref.family or 'this model'} has no upstream "
                         "stop rule")
    answer, first = base.reference_generate_loop(ref, prompt_ids, iterations, max_tokens,
                                                 passes)
    if not ignore_eos:
        ends = [i for i, t in enumerate(answer) if t in ref.eos and (i or not upstream_stop_rules)]
        answer = answer[:ends[0] + 1] if ends else answer
    return answer, first
