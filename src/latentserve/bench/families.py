"""``latentserve bench --suite families``: every latent family's benchmark in one run, and one
table of them (issue 27).

Design notes: docs/internals.md, "latentserve.bench.families".
"""

from __future__ import annotations

import time

ROW_FIELDS = ("family", "model", "concurrency", "step_ms", "replay_ms", "floor_ms",
              "step_over_floor", "replay_over_floor", "latent_over_plain_pct",
              "speedup_vs_reference")


def _ms(seconds) -> float | None:
    return None if seconds is None else 1e3 * seconds


def _row(family: str, model: str, c, **figures) -> dict:
    row = dict.fromkeys(ROW_FIELDS)
    row.update(family=family, model=model, concurrency=int(c), **figures)
    return row


def _plain(res: dict) -> list[dict]:
    rows = []
    for name, shape in res.get("shapes", {}).items():
        for c, r in shape["concurrency"].items():
            rows.append(_row("plain", name, c, step_ms=_ms(r["decode_step_s"]),
                             replay_ms=_ms(r.get("graph_replay_s")),
                             floor_ms=_ms(r["bandwidth_floor_s"]),
                             step_over_floor=r["step_over_floor"],
                             replay_over_floor=r.get("replay_over_floor"),
                             speedup_vs_reference=r.get("speedup_vs_hf_batch")))
    return rows


def _cost_pct(cost: dict | None, c) -> float | None:
    """A suite's latent-over-plain step cost, on the row of the batch it was measured at."""
    if not cost or int(cost.get("batch", -1)) != int(c):
        return None
    return cost.get("overhead_pct", cost.get("latent_over_plain_pct"))


def _feedback(res: dict) -> list[dict]:
    rows = []
    for name, m in res.get("models", {}).items():
        for c, r in m["concurrency"].items():
            rows.append(_row("feedback", name, c, speedup_vs_reference=r.get("speedup"),
                             latent_over_plain_pct=_cost_pct(m.get("step_cost"), c)))
    return rows


def _head(res: dict) -> list[dict]:
    """Per concurrency its decode step; at the step-cost batch the latent step against its
    floor (the suite measures the floor there only)."""
    rows = []
    for name, s in res.get("shapes", {}).items():
        cost = s.get("step_cost") or {}
        for c, r in s["concurrency"].items():
            at_cost = int(cost.get("batch", -1)) == int(c)
            floor = cost.get("floor_s") if at_cost else None
            rows.append(_row("head", name, c, step_ms=_ms(r.get("step_s", {}).get("decode")),
                             floor_ms=_ms(floor),
                             step_over_floor=cost.get("latent_step_over_floor") if at_cost
                             else None,
                             speedup_vs_reference=r.get("speedup"),
                             latent_over_plain_pct=_cost_pct(cost, c)))
    return rows


def _recurrent(res: dict) -> list[dict]:
    rows = []
    for name, m in res.get("models", {}).items():
        for depth, by_c in m["engine"].items():
            for c, r in by_c.items():
                floor = (r.get("bandwidth_floor") or {}).get("floor_s")
                rows.append(_row("recurrent", f"{name} depth {depth}", c,
                                 step_ms=_ms(r.get("decode_step_s")), floor_ms=_ms(floor),
                                 step_over_floor=r.get("step_over_floor"),
                                 speedup_vs_reference=r.get("speedup")))
    return rows


def _loop(res: dict) -> list[dict]:
    block = res.get("pccot")
    if not block:
        return []
    return [_row("loop", block["model"], c, speedup_vs_reference=r.get("speedup_vs_reference"))
            for c, r in block["concurrency"].items()]


READERS = {"plain": _plain, "feedback": _feedback, "head": _head, "recurrent": _recurrent,
           "loop": _loop}


def summarize(suites: dict) -> list[dict]:
    """Table rows of ``suites`` (``{family: that suite's result}``), in ``READERS`` order,
    then model, then concurrency; missing suites give no rows."""
    return [r for family, read in READERS.items() if family in suites
            for r in read(suites[family])]


def table_markdown(rows: list[dict]) -> str:
    """``rows`` as a Markdown table (figures to 2 decimals, "-" where not measured)."""
    def fmt(v) -> str:
        return "-" if v is None else (f"{v:.2f}" if isinstance(v, float) else str(v))

    cols = ROW_FIELDS
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(fmt(r[k]) for k in cols) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def run_families_bench(concurrency=(1, 16, 64), families=tuple(READERS),
                       command: str | None = None) -> dict:
    """Run the suites of ``families`` (keys of ``READERS``) on CUDA (see the module
    docstring); returns ``{"command", "date", "suites": {family: result}, "table": rows,
    "total_s"}``. Raises ValueError for an unknown family, RuntimeError without CUDA."""
    unknown = set(families) - set(READERS)
    if unknown:
        raise ValueError(f"families must be among {sorted(READERS)}, got {sorted(unknown)}")
    import torch

    if not torch.cuda.is_available():
        raise RuntimeError("bench --suite families needs a CUDA device (the H200)")
    from latentserve.bench.gpu import run_gpu_bench
    from latentserve.bench.head_gpu import run_head_bench
    from latentserve.bench.latent import run_latent_bench
    from latentserve.bench.loop import run_loop_bench
    from latentserve.bench.recurrent_gpu import run_recurrent_gpu_bench

    runs = {
        "plain": lambda: run_gpu_bench(concurrency, shapes=("llama-3.2-1b", "smollm2-135m"),
                                       hf_baseline=False, compare_unfused=False,
                                       compare_overlap=False),
        "feedback": lambda: run_latent_bench("cuda", concurrency, codi=True),
        "head": lambda: run_head_bench(("llama-3.2-1b",), "cuda", concurrency=concurrency),
        "recurrent": lambda: run_recurrent_gpu_bench(concurrency=concurrency),
        "loop": lambda: run_loop_bench("cuda", concurrency),
    }
    t0 = time.perf_counter()
    suites = {f: runs[f]() for f in READERS if f in families}
    return {"command": command, "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
            "suites": suites, "table": summarize(suites),
            "total_s": time.perf_counter() - t0}
