"""One evaluation run (a data set, a backend, one latent budget) and its summary.

Design notes: docs/internals.md, "latentserve.eval.run".
"""

from __future__ import annotations

import json
import statistics
from collections import Counter
from pathlib import Path

from latentserve.eval.answers import score
from latentserve.eval.backends import Request
from latentserve.eval.datasets import INSTRUCTIONS, Item
from latentserve.options import check_value


def requests(items: list[Item], max_tokens: int, max_latent: int | None) -> list[Request]:
    """One :class:`Request` per item: text CoT asks with the data set's instruction, a latent
    run with the bare question."""
    return [Request(it.question if max_latent is not None
                    else f"{it.question}\n{INSTRUCTIONS[it.kind]}", max_tokens, max_latent)
            for it in items]


def check(items: list[Item], backend, max_tokens: int = 256, max_latent: int | None = None,
          **head_controls) -> None:
    """The checks ``backend`` makes of :func:`evaluate`'s requests, nothing run (a sweep
    checks every value before its first run); a no-op for a backend without ``check`` (a
    server checks its requests as they come). ValueError as the backend raises it."""
    if (backend_check := getattr(backend, "check", None)) is not None:
        backend_check(requests(items, max_tokens, max_latent), **head_controls)


def evaluate(items: list[Item], backend, max_tokens: int = 256,
             max_latent: int | None = None, **head_controls) -> tuple[list[dict], dict]:
    """Run ``items`` through ``backend``; returns ``(records, summary)``: accuracies
    (fractions), thinking, token and latency (s) statistics (a latent run's also counts each
    ``latent_end``: ``stop``, ``cap`` or ``length``), and the settings: ``max_tokens``,
    ``max_latent`` and the head controls (:data:`CONTROLS`; a latent run's as the backend
    reports it resolved, else as given, None for the model's default). Text CoT asks with
    the data set's instruction, a latent run with the bare question. ValueError for no
    items."""
    if not items:
        raise ValueError("no items to evaluate")
    outs = backend.run(requests(items, max_tokens, max_latent), **head_controls)
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
    stats = [o.stats for o in outs] if max_latent is not None else []
    summary = {"n": n, "accuracy_strict": sum(r["strict"] for r in records) / n,
               "accuracy_flexible": sum(r["flexible"] for r in records) / n,
               "thinking_median": statistics.median(think), "thinking_max": max(think),
               "completion_tokens_mean": sum(r["completion_tokens"] for r in records) / n,
               "latency_median_s": statistics.median(lat), "latency_max_s": max(lat),
               "max_tokens": max_tokens, "max_latent": max_latent,
               **resolved_controls(stats, head_controls)}
    if max_latent is not None:  # how the latent phases ended (stop head, cap, length)
        summary["latent_end"] = dict(sorted(Counter(str(r["latent_end"]) for r in records).items()))
    return records, summary


# The head controls a summary records (``--min-latent``, ``--stop-threshold``, ``--no-stop``).
CONTROLS = ("min_latent", "stop_threshold", "use_stop")


def resolved_controls(stats: list[dict | None], given: dict,
                      keys: tuple[str, ...] = CONTROLS) -> dict:
    """Each of ``keys`` as the first of ``stats`` (per-request latent stats) that reports it
    resolved, else as ``given`` (None: not given, the model's default)."""
    out = {}
    for k in keys:
        reported = [st[k] for st in stats if st and st.get(k) is not None]
        out[k] = reported[0] if reported else given.get(k)
    return out


# The fields --sweep takes and the range each shares with its own flag (cli/eval.py).
SWEEP_BOUNDS = {"max_latent": {"ge": 0}, "compression_factor": {"ge": 1}}


def parse_sweep(spec: str, keys: tuple[str, ...] = ("max_latent",)) -> tuple[str, list[int]]:
    """``"max_latent=0,4,8"`` -> ``("max_latent", [0, 4, 8])`` (a key of ``keys``), every
    value in the range of the key's flag (:data:`SWEEP_BOUNDS`) and given once; else
    ValueError naming ``--sweep``."""
    key, sep, vals = spec.partition("=")
    key = key.strip()
    if key not in keys or not sep:
        shapes = " or ".join(f"{k}=..." for k in keys)
        raise ValueError(f"--sweep must look like {shapes} (e.g. {keys[0]}=1,2,4); got {spec!r}")
    out = [v.strip() for v in vals.split(",")]
    if not all(v.isdecimal() for v in out):
        raise ValueError(f"--sweep needs a comma-separated list of integers >= 0, got {vals!r}")
    values = [int(v) for v in out]
    for v in values:
        try:
            check_value(key, v, SWEEP_BOUNDS.get(key, {}))
        except ValueError as exc:
            raise ValueError(f"--sweep {key}=...: {exc}") from None
    if len(set(values)) < len(values):
        twice = sorted({v for v in values if values.count(v) > 1})
        raise ValueError(f"--sweep {key}={vals.strip()} repeats {', '.join(map(str, twice))}; "
                         "give each value once (each run is recorded under its value)")
    return key, values


ACCURACY_KEYS = (("accuracy_flexible", "flexible"), ("accuracy_strict", "strict"))


def read_baseline(path, colar: bool) -> dict:
    """The reference line of ``--baseline`` ``path``: a text-CoT run's summary, or a sweep's
    first run. Chat prompt format (``colar`` False): an ``eval --out`` JSON, returns
    ``accuracy_flexible``, ``accuracy_strict`` and ``thinking_median``; CoLaR format: an
    ``eval --json-out`` (or ``--out``) JSON, returns ``accuracy`` and ``thinking_median``.
    ValueError naming ``--baseline`` for any other file (the other format's included)."""
    try:
        data = json.loads(Path(path).read_text())
    except ValueError as exc:
        raise ValueError(f"--baseline {path} is not JSON ({exc})") from None
    s = data.get("summary", data) if isinstance(data, dict) else {}  # a CoLaR --out
    if isinstance(s, dict) and isinstance(s.get("runs"), list) and s["runs"]:
        s = s["runs"][0]  # a sweep: its first run
    s = s if isinstance(s, dict) else {}
    thinking = s.get("thinking")
    is_colar = "accuracy" in s and isinstance(thinking, dict) and "median" in thinking
    is_chat = all(k in s for k in ("accuracy_flexible", "accuracy_strict", "thinking_median"))
    if colar and is_colar:
        return {"accuracy": s["accuracy"], "thinking_median": thinking["median"]}
    if not colar and is_chat:
        return {k: s[k] for k in ("accuracy_flexible", "accuracy_strict", "thinking_median")}
    want = ("a CoLaR-prompt-format run's --json-out summary" if colar
            else "a chat-prompt-format run's --out JSON")
    found = ("; it is a chat-prompt-format --out, which goes with --prompt-format chat"
             if colar and is_chat else
             "; it is a CoLaR-prompt-format summary, which goes with --prompt-format colar"
             if not colar and is_colar else "")
    raise ValueError(f"--baseline {path} is not {want} (this run's prompt format is "
                     f"{'CoLaR' if colar else 'chat'}){found}")


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
