"""Plots for docs/benchmarks.md from the benchmark JSON files (matplotlib: the ``eval``
extra)."""

from __future__ import annotations

import json
import sys
from pathlib import Path


def plot_gpu(json_path: str | Path, out_png: str | Path) -> None:
    """Output tokens/s against concurrency for each shape: engine, HF padded batch, HF batch 1
    (log scale), and the decode step (whole engine step, and its graph replay where the JSON
    has it) against its bandwidth floor. Reads ``bench --suite gpu`` JSON of today and of the
    runs stored in docs/bench before the suites shared ``bench/suite.py`` (other key names).
    Raises KeyError when a field both lack is missing."""
    from latentserve.extras import require

    require("matplotlib", "benchmarks.plot")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = json.loads(Path(json_path).read_text())
    shapes = data.get("models") or data["shapes"]  # "shapes": runs stored before it
    fig, axes = plt.subplots(2, len(shapes), figsize=(5 * len(shapes), 7), squeeze=False)
    for col, (name, res) in enumerate(shapes.items()):
        conc = sorted(res["concurrency"], key=int)
        rows = [res["concurrency"][c] for c in conc]
        x = [int(c) for c in conc]
        ax = axes[0][col]
        # "engine_tok_s": the key of runs stored before the suites shared bench/suite.py
        ax.plot(x, [r.get("tok_s", r.get("engine_tok_s")) for r in rows], "o-",
                label="latentserve")
        ax.plot(x, [r["hf_padded_batch_tok_s"] for r in rows], "s--", label="HF generate, batch")
        ax.plot(x, [r["hf_batch1_tok_s"] for r in rows], "^:", label="HF generate, batch 1")
        ax.set(title=f"{name} (bf16, random weights)", xlabel="concurrent requests",
               ylabel="output tokens/s", xscale="log", yscale="log")
        ax.legend()
        ax = axes[1][col]
        ax.bar([str(c) for c in x], [r["decode_step_s"] * 1e3 for r in rows],
               label="engine decode step")
        if all("graph_replay_s" in r for r in rows):
            ax.bar([str(c) for c in x], [r["graph_replay_s"] * 1e3 for r in rows], width=0.5,
                   label="graph replay (device)")
        floors = [r["bandwidth_floor"]["floor_s"] if "bandwidth_floor" in r
                  else r["bandwidth_floor_s"] for r in rows]  # the latter: older runs
        ax.plot([str(c) for c in x], [f * 1e3 for f in floors], "k_",
                markersize=30, label="bandwidth floor")
        ax.set(xlabel="concurrent requests", ylabel="ms per decode step")
        ax.legend()
    fig.tight_layout()
    fig.savefig(out_png, dpi=110)


if __name__ == "__main__":
    plot_gpu(sys.argv[1], sys.argv[2])
