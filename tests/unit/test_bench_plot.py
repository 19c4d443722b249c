"""``benchmarks/plot.py`` draws today's ``bench --suite gpu`` JSON and the runs stored in
docs/bench under the older key names."""

import json
from pathlib import Path

import pytest

from benchmarks.plot import plot_gpu

ROOT = Path(__file__).resolve().parents[2]


def _row(step_s: float) -> dict:
    return {"tok_s": 1000.0, "hf_padded_batch_tok_s": 100.0, "hf_batch1_tok_s": 10.0,
            "decode_step_s": step_s, "graph_replay_s": step_s * 0.9,
            "bandwidth_floor": {"floor_s": step_s / 2}}


@pytest.mark.parametrize("source", ["today", "stored"])
def test_plot_reads_both_formats(tmp_path, source):
    if source == "today":
        path = tmp_path / "gpu.json"
        path.write_text(json.dumps({"models": {"tiny": {"concurrency": {
            "1": _row(1e-3), "16": _row(2e-3)}}}}))
    else:
        path = ROOT / "docs" / "bench" / "gpu_h200.json"
    out = tmp_path / "plot.png"
    plot_gpu(path, out)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_row_without_a_floor_is_refused(tmp_path):
    row = _row(1e-3)
    del row["bandwidth_floor"]
    path = tmp_path / "gpu.json"
    path.write_text(json.dumps({"models": {"tiny": {"concurrency": {"1": row}}}}))
    with pytest.raises(KeyError, match="bandwidth_floor_s"):
        plot_gpu(path, tmp_path / "plot.png")
