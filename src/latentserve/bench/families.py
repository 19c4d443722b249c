"""``latentserve bench --suite families``: every family's benchmark in one run, one table.

Design notes: docs/internals.md, "latentserve.bench.families".
"""

from __future__ import annotations

import importlib
import time

import torch

from latentserve.bench.suite import run_suite
from latentserve.bench.trained import model_paths

ROW_FIELDS = ("family", "model", "concurrency", "step_ms", "step_p50_ms", "replay_ms", "floor_ms",
              "step_over_floor", "replay_over_floor", "latent_over_plain_pct",
              "speedup_vs_reference", "tok_s", "accuracy")  # accuracy: trained models only


def _ms(seconds) -> float | None:
    return None if seconds is None else 1e3 * seconds


def _rows(family: str, res: dict) -> list[dict]:
    """A row per model (recurrent: and depth) and concurrency of a ``run_suite`` result."""
    rows = []
    for name, m in res["models"].items():
        groups = ({f"{name} depth {d}": g for d, g in m["depths"].items()} if "depths" in m
                  else {name: m})
        cost = m.get("step_cost") or {}
        for model, g in groups.items():
            for c, r in g["concurrency"].items():
                row = dict.fromkeys(ROW_FIELDS)
                row.update(family=family, model=model, concurrency=int(c),
                           step_ms=_ms(r["decode_step_s"]), step_p50_ms=_ms(r.get("step_p50_s")),
                           replay_ms=_ms(r.get("graph_replay_s")),
                           floor_ms=_ms((r["bandwidth_floor"] or {}).get("floor_s")),
                           step_over_floor=r["step_over_floor"],
                           replay_over_floor=r.get("replay_over_floor"),
                           speedup_vs_reference=r.get("speedup"), tok_s=r["tok_s"],
                           accuracy=r.get("accuracy"))
                if int(cost.get("batch", -1)) == int(c):  # the batch the cost was measured at
                    row["latent_over_plain_pct"] = cost["latent_over_plain_pct"]
                rows.append(row)
    return rows


# family -> (suite module, models on the H200, options; tiny models for the CPU, their
# options: short lengths)
SUITES = {
    "plain": ("gpu", ("llama-3.2-1b", "smollm2-135m"), {"hf_baseline": False, "variants": False},
              ("tiny",), {"output_len": 8, "prompt_len": 8}),
    "feedback": ("latent", ("coconut-gpt2-124m", "codi-llama-3.2-1b"), {},
                 ("coconut-tiny", "codi-tiny"), {"answer_len": 4, "ref_requests": 1,
                                                 "prompt_len": 8}),
    "head": ("head_gpu", ("llama-3.2-1b",), {}, ("tiny",),
             {"max_latent": 4, "answer_len": 4, "ref_requests": 1, "prompt_len": 8}),
    "recurrent": ("recurrent_gpu", ("huginn-0125", "ouro-1.4b"), {}, ("huginn-tiny", "ouro-tiny"),
                  {"output_len": 4, "ref_requests": 1, "ref_output_len": 3, "prompt_len": 8}),
    "loop": ("loop", ("pccot-gpt2-124m",), {}, ("pccot-tiny",),
             {"answer_len": 4, "ref_requests": 1, "block_size": 4, "prompt_len": 8}),
    "trained": ("trained", ("smollm2-mult-cot", "smollm2-mult-colar"), {},
                ("smollm2-mult-cot", "smollm2-mult-colar"),
                {"output_len": 4, "answer_len": 4, "max_latent": 4, "cost_steps": 4}),
}


def summarize(suites: dict) -> list[dict]:
    """Table rows of ``suites`` (``{family: result}``) in ``SUITES`` order."""
    return [r for family in SUITES if family in suites for r in _rows(family, suites[family])]


def table_markdown(rows: list[dict], cols=ROW_FIELDS) -> str:
    """``rows`` as a Markdown table of ``cols`` (figures to 2 decimals, "-" where not
    measured)."""
    def fmt(v) -> str:
        return "-" if v is None else (f"{v:.2f}" if isinstance(v, float) else str(v))

    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(fmt(r[k]) for k in cols) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def run_families_bench(concurrency=(1, 16, 64), families=tuple(SUITES),
                       command: str | None = None, tiny: bool = False) -> dict:
    """The suites of ``families`` (``SUITES`` keys) on CUDA, or with ``tiny`` on the CPU.
    Returns ``{command, date, suites: {family: result}, table, total_s}``. ValueError for an
    unknown family, RuntimeError without CUDA (unless ``tiny``)."""
    if unknown := set(families) - set(SUITES):
        raise ValueError(f"families must be among {sorted(SUITES)}, got {sorted(unknown)}")
    if not tiny and not torch.cuda.is_available():
        raise RuntimeError("bench --suite families needs a CUDA device (the H200)")
    if "trained" in families:  # at once, not after hours of the other suites
        model_paths(SUITES["trained"][1])
    t0, suites = time.perf_counter(), {}
    for family, (module, models, options, tiny_models, tiny_options) in SUITES.items():
        if family in families:
            if tiny:
                models, options = tiny_models, {**options, **tiny_options}
            suites[family] = run_suite(importlib.import_module(f"latentserve.bench.{module}"),
                                       models, "cpu" if tiny else "cuda", concurrency, **options)
    return {"command": command, "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
            "suites": suites, "table": summarize(suites),
            "total_s": time.perf_counter() - t0}
