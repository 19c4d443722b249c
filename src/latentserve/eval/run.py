"""One evaluation run (a data set, a backend, one latent budget) and its summary.

Design notes: docs/internals.md, "latentserve.eval.run".
"""

from __future__ import annotations

import statistics
from collections import Counter

from latentserve.eval.answers import score
from latentserve.eval.backends import Request
from latentserve.eval.datasets import INSTRUCTIONS, Item


def evaluate(items: list[Item], backend, max_tokens: int = 256,
             max_latent: int | None = None, **head_controls) -> tuple[list[dict], dict]:
    """Run ``items`` through ``backend``; returns ``(records, summary)``: accuracies
    (fractions), thinking, token and latency (s) statistics (a latent run's also counts each
    ``latent_end``: ``stop``, ``cap`` or ``length``). Text CoT asks with the data set's
    instruction, a latent run with the bare question. ValueError for no items."""
    if not items:
        raise ValueError("no items to evaluate")
    outs = backend.run([Request(it.question if max_latent is not None
                                else f"{it.question}\n{INSTRUCTIONS[it.kind]}",
                                max_tokens, max_latent) for it in items], **head_controls)
    records = []
    for it, o in zip(items, outs):
        strict, flexible = score(it.kind, o.text, it.gold, it.question)
        records.append({"question": it.question, "gold": it.gold, "output": o.text,
                        "strict": strict, "flexible": flexible,
                        "thinking": o.completion_tokens if max_latent is None
                        else o.latent_steps,
                        "completion_tokens": o.completion_tokens,
                        "latent_steps": o.latent_steps, "latency_s": round(o.latency_s, 4),
                        "finish_reason": o.finish_reason, "latent_end": o.latent_end})
    n, think = len(records), [r["thinking"] for r in records]
    lat = [r["latency_s"] for r in records]
    summary = {"n": n, "accuracy_strict": sum(r["strict"] for r in records) / n,
               "accuracy_flexible": sum(r["flexible"] for r in records) / n,
               "thinking_median": statistics.median(think), "thinking_max": max(think),
               "completion_tokens_mean": sum(r["completion_tokens"] for r in records) / n,
               "latency_median_s": statistics.median(lat), "latency_max_s": max(lat),
               "max_latent": max_latent}
    if max_latent is not None:  # how the latent phases ended (stop head, cap, length)
        summary["latent_end"] = dict(sorted(Counter(str(r["latent_end"]) for r in records).items()))
    return records, summary


def parse_sweep(spec: str, keys: tuple[str, ...] = ("max_latent",)) -> tuple[str, list[int]]:
    """``"max_latent=0,4,8"`` -> ``("max_latent", [0, 4, 8])`` (a key of ``keys``); else
    ValueError."""
    key, sep, vals = spec.partition("=")
    key = key.strip()
    if key not in keys or not sep:
        shapes = " or ".join(f"{k}=..." for k in keys)
        raise ValueError(f"--sweep must look like {shapes} (e.g. {keys[0]}=1,2,4); got {spec!r}")
    out = [v.strip() for v in vals.split(",")]
    if not all(v.isdecimal() for v in out):
        raise ValueError(f"--sweep needs a comma-separated list of integers >= 0, got {vals!r}")
    return key, [int(v) for v in out]


ACCURACY_KEYS = (("accuracy_flexible", "flexible"), ("accuracy_strict", "strict"))


def plot_sweep(series: dict[str, list[dict]], path, title: str = "",
               baseline: dict | None = None, x: str = "max_latent",
               accuracy_keys: tuple[tuple[str, str], ...] = ACCURACY_KEYS) -> None:
    """Test-time-scaling plot (PNG): accuracy and median / max thinking of each series
    against the swept field ``x``; ``baseline`` (a text-CoT summary) as horizontal lines."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a1, a2) = plt.subplots(1, 2, figsize=(9.5, 3.8))
    for label, runs in series.items():
        xs = [s[x] for s in runs]
        color = None
        for k, (key, what) in enumerate(accuracy_keys):
            (line,) = a1.plot(xs, [s[key] for s in runs], "o-" if k == 0 else "s--",
                              color=color, label=f"{label} ({what})")
            color = line.get_color()
        a2.plot(xs, [s["thinking_median"] for s in runs], "o-", color=color,
                label=f"{label} median")
        a2.plot(xs, [s["thinking_max"] for s in runs], "v:", color=color,
                label=f"{label} max")
    if baseline is not None:
        key, what = accuracy_keys[0]
        a1.axhline(baseline[key], color="gray", ls="-.", label=f"text CoT ({what})")
        a2.axhline(baseline["thinking_median"], color="gray", ls="-.",
                   label="text CoT median tokens")
    a1.set(xlabel=x, ylabel="accuracy", title=f"accuracy vs {x}")
    a2.set(xlabel=x, ylabel="latent steps / thinking tokens", title=f"thinking vs {x}")
    a1.legend(fontsize=7)
    a2.legend(fontsize=7)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
