"""Greedy evaluation in CoLaR's format (``latent/colar.py``) of text-CoT backbones, CoLaR
models and compression heads trained on them, through the engine.

Design notes: docs/internals.md, "latentserve.eval.colar_eval".
"""

from __future__ import annotations

import statistics
import time

from latentserve.eval.datasets import Item
from latentserve.eval.run import CONTROLS, resolved_controls
from latentserve.latent import colar
from latentserve.sampling_params import SamplingParams


def answers_match(gold: str, pred: str) -> bool:
    """Upstream ``verify_answer``: strip spaces and newlines, drop a trailing dot and the
    commas, compare as floats when both parse, else as strings."""
    g = gold.strip("\n ").rstrip(".").replace(",", "")
    p = pred.strip("\n ").rstrip(".").rstrip(".\n").replace(",", "")
    try:
        return float(g) == float(p)
    except ValueError:
        return g == p


def encode_questions(tok, questions: list[str], latent: bool) -> list[list[int]]:
    """Prompt ids per question in the format the model was trained with: a CoLaR model's
    question part (``colar.QUESTION``; the engine appends its speed and ``###``), else the
    text model's whole speed-1 prompt (``colar.prompt_ids``; a compression head on a text
    model takes that too)."""
    if latent:
        return tok([colar.QUESTION.format(q) for q in questions],
                   add_special_tokens=False)["input_ids"]
    return colar.prompt_ids(tok, questions)


def read_answer(tok, ids: list[int], latent: bool) -> str:
    """The answer in generated ``ids``: after a latent phase (CoLaR or a head) what follows
    ``Answer:`` (the whole text without it), else what follows ``Answer:`` after the text
    chain of thought's closing ``###`` (``colar.split_output``; "" without a ``###``)."""
    text = tok.decode(ids, skip_special_tokens=True)
    if latent:
        return text.partition(colar.ANSWER.format(""))[2].strip() or text.strip()
    return colar.split_output(text)[1]


def _params(llm, max_tokens: int, compression_factor: int | None, max_latent: int | None,
            head_controls: dict) -> tuple[SamplingParams, bool, bool]:
    """``(params, latent, head)``: the greedy sampling params of :func:`evaluate`'s requests
    and whether the model is CoLaR / a compression head. ValueError for a control the model
    does not take."""
    family = getattr(llm.engine.latent_spec, "family", None)
    latent, head = family == "colar", family == "compression-head"
    if max_latent is not None and not (latent or head):
        raise ValueError("max_latent needs a CoLaR model (a directory with colar_config.json) "
                         "or a compression head")
    takes = getattr(llm.engine.latent_spec, "controls", ())  # () but on a head model
    for k in head_controls:
        if k not in takes:
            flag = "--no-stop" if k == "use_stop" else "--" + k.replace("_", "-")
            raise ValueError(f"{flag} ({k}) is not a control of this model ("
                             f"{family or 'no latent head'}); it takes "
                             f"{', '.join(takes) or 'none'}")
    # compression_factor: the engine refuses it on any model but CoLaR (ValueError)
    extra = {k: v for k, v in (("compression_factor", compression_factor),
                               ("max_latent", max_latent)) if v is not None} | head_controls
    if head:  # thinking is on: without max_latent the engine's default cap
        cap = max_latent if max_latent is not None else llm.engine.family.defaults["max_latent"]
        extra |= {"max_latent": cap, "min_output_tokens": 0}
        max_tokens += cap + len(llm.engine.latent_spec.end_ids)  # latent steps count too
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, **extra), latent, head


def check(llm, items: list[Item], max_tokens: int = 320,
          compression_factor: int | None = None, max_latent: int | None = None,
          **head_controls) -> None:
    """The checks of :func:`evaluate`'s requests (its own and the engine's), nothing run: a
    sweep checks every value before its first run. ValueError naming the field (a
    ``compression_factor`` out of the model's range, ...)."""
    params, latent, _ = _params(llm, max_tokens, compression_factor, max_latent, head_controls)
    for p in encode_questions(llm.tokenizer, [it.question for it in items], latent):
        llm.engine.check_request(p, params)


def evaluate(llm, items: list[Item], max_tokens: int = 320,
             compression_factor: int | None = None, max_latent: int | None = None,
             **head_controls) -> tuple[list[dict], dict]:
    """Run ``items`` through ``llm`` greedily; returns ``(records, summary)`` (``{"n",
    "accuracy", "thinking": {"median", "max", "mean"}, "stop_fired", "seconds"}`` and the
    settings as the engine resolved them: ``compression_factor``, ``max_latent`` (a text
    model's None) and the head controls, ``min_latent``, ``stop_threshold``, ``use_stop``;
    None where the model has none). ``max_tokens`` bounds text tokens (latent models: the
    answer's). ``max_latent`` is for CoLaR or a head (None: the model's cap; a head thinks
    with the engine's default, ``LATENTSERVE_MAX_LATENT``), ``compression_factor`` CoLaR's,
    ``head_controls`` a head's (``SamplingParams`` fields: ``min_latent``, ``use_stop``,
    ``stop_threshold``); ValueError for a model that does not take one, or no items."""
    if not items:
        raise ValueError("no items to evaluate")
    params, latent, head = _params(llm, max_tokens, compression_factor, max_latent,
                                   head_controls)
    tok = llm.tokenizer
    sep = tok.convert_tokens_to_ids(colar.SEPARATOR)
    ids = encode_questions(tok, [it.question for it in items], latent)
    prompts = [{"prompt_token_ids": p} for p in ids]
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    records, stats = [], []
    for it, o in zip(items, outs):
        c = o.outputs[0]
        ids = list(c.token_ids)
        if latent or head:
            st = c.latent_stats or {}
            stats.append(st)
            thinking, fired = int(st.get("steps", 0)), st.get("end") == "stop"
        else:
            thinking, fired = (ids.index(sep), True) if sep in ids else (len(ids), False)
        answer = read_answer(tok, ids, latent or head)
        records.append({"question": it.question, "gold": it.gold, "answer": answer,
                        "correct": answers_match(it.gold, answer), "thinking": thinking,
                        "stop_fired": fired, "output_tokens": len(ids)})
    n, think = len(records), [r["thinking"] for r in records]
    given = {"compression_factor": compression_factor, "max_latent": max_latent,
             **head_controls}
    return records, {**resolved_controls(stats, given, ("compression_factor", "max_latent",
                                                         *CONTROLS)),
                     "n": n, "accuracy": sum(r["correct"] for r in records) / n,
                     "thinking": {"median": statistics.median(think), "max": max(think),
                                  "mean": sum(think) / n},
                     "stop_fired": sum(r["stop_fired"] for r in records) / n,
                     "seconds": round(seconds, 3)}
