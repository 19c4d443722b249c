"""``bench --suite families`` (issue 27): one table of every family's suite, read from the
suites' own results (here the stored H200 runs in docs/bench/)."""

import json
from pathlib import Path

import pytest

from latentserve.bench.families import ROW_FIELDS, run_families_bench, summarize, table_markdown

BENCH = Path(__file__).resolve().parents[2] / "docs" / "bench"
RUNS = {"plain": "gpu_llama1b_s13k.json", "feedback": "latent_codi_h200.json",
        "head": "head_gpu_llama1b_h200.json", "recurrent": "recurrent_gpu_fused_h200.json",
        "loop": "loop_gpu_h200.json"}


@pytest.fixture(scope="module")
def suites():
    return {family: json.loads((BENCH / name).read_text()) for family, name in RUNS.items()}


def _one(rows, family, model, c):
    (row,) = [r for r in rows if (r["family"], r["model"], r["concurrency"]) == (family, model, c)]
    return row


def test_each_suite_gives_a_row_per_model_and_concurrency(suites):
    rows = summarize(suites)
    assert [r["family"] for r in rows] == sorted(
        (r["family"] for r in rows), key=list(RUNS).index)  # in family order
    assert {(r["family"], r["model"]) for r in rows} == {
        ("plain", "llama-3.2-1b"), ("feedback", "codi-llama-3.2-1b"),
        ("head", "llama-3.2-1b"), ("recurrent", "huginn-0125 depth 8"),
        ("recurrent", "huginn-0125 depth 32"), ("loop", "pccot-gpt2-124m")}
    assert all(set(r) == set(ROW_FIELDS) for r in rows)
    assert {r["concurrency"] for r in rows} == {1, 16, 64}


def test_figures_are_the_suites_own(suites):
    rows = summarize(suites)
    plain = suites["plain"]["shapes"]["llama-3.2-1b"]["concurrency"]["64"]
    r = _one(rows, "plain", "llama-3.2-1b", 64)
    assert r["step_ms"] == pytest.approx(1e3 * plain["decode_step_s"])
    assert r["floor_ms"] == pytest.approx(1e3 * plain["bandwidth_floor_s"])
    assert r["step_over_floor"] == plain["step_over_floor"]
    assert r["replay_over_floor"] == plain["replay_over_floor"]
    head = suites["head"]["shapes"]["llama-3.2-1b"]
    assert _one(rows, "head", "llama-3.2-1b", 64)["latent_over_plain_pct"] == \
        head["step_cost"]["latent_over_plain_pct"]
    assert _one(rows, "head", "llama-3.2-1b", 64)["step_over_floor"] == \
        head["step_cost"]["latent_step_over_floor"]
    assert _one(rows, "head", "llama-3.2-1b", 16)["latent_over_plain_pct"] is None
    codi = suites["feedback"]["models"]["codi-llama-3.2-1b"]
    assert _one(rows, "feedback", "codi-llama-3.2-1b", 64)["latent_over_plain_pct"] == \
        codi["step_cost"]["overhead_pct"]
    huginn = suites["recurrent"]["models"]["huginn-0125"]["engine"]["32"]["64"]
    r = _one(rows, "recurrent", "huginn-0125 depth 32", 64)
    assert r["step_over_floor"] == huginn["step_over_floor"]
    assert r["floor_ms"] == pytest.approx(1e3 * huginn["bandwidth_floor"]["floor_s"])
    assert _one(rows, "loop", "pccot-gpt2-124m", 64)["speedup_vs_reference"] == \
        suites["loop"]["pccot"]["concurrency"]["64"]["speedup_vs_reference"]


def test_the_table_has_a_line_per_row_and_dashes_for_what_was_not_measured(suites):
    rows = summarize({"loop": suites["loop"]})
    text = table_markdown(rows).splitlines()
    assert len(text) == 2 + len(rows) == 5
    assert text[0].startswith("| family | model | concurrency | step_ms")
    assert text[-1].startswith("| loop | pccot-gpt2-124m | 64 | - |")


def test_the_suite_needs_cuda():
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present")
    with pytest.raises(RuntimeError, match="needs a CUDA device"):
        run_families_bench()
    with pytest.raises(ValueError, match="families must be among"):
        run_families_bench(families=("plain", "moe"))
