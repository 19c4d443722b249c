"""``bench --suite families`` (issue 27): one table of every family's suite, read from the
suites' own results (here every suite run on its tiny models on the CPU, float32)."""

import pytest

from latentserve.bench.families import ROW_FIELDS, SUITES, run_families_bench, table_markdown

RANDOM_WEIGHTS = tuple(f for f in SUITES if f != "trained")  # trained: test_bench_trained.py


@pytest.fixture(scope="module")
def result():
    return run_families_bench((1, 2), RANDOM_WEIGHTS, tiny=True)


def _one(rows, family, model, c):
    (row,) = [r for r in rows if (r["family"], r["model"], r["concurrency"]) == (family, model, c)]
    return row


def test_each_suite_gives_a_row_per_model_and_concurrency(result):
    rows = result["table"]
    assert [r["family"] for r in rows] == sorted(
        (r["family"] for r in rows), key=list(result["suites"]).index)  # in family order
    assert {(r["family"], r["model"]) for r in rows} == {
        ("plain", "tiny"), ("feedback", "coconut-tiny"), ("feedback", "codi-tiny"),
        ("head", "tiny"), ("recurrent", "huginn-tiny depth 2"),
        ("recurrent", "huginn-tiny depth 4"), ("recurrent", "ouro-tiny depth 4"),
        ("loop", "pccot-tiny")}
    assert all(set(r) == set(ROW_FIELDS) for r in rows)
    assert {r["concurrency"] for r in rows} == {1, 2}


def test_every_row_has_a_decode_step_against_its_bandwidth_floor(result):
    for r in result["table"]:
        assert r["step_ms"] > 0 and r["floor_ms"] > 0, r
        assert r["step_over_floor"] == pytest.approx(r["step_ms"] / r["floor_ms"])
        assert r["replay_ms"] is None and r["replay_over_floor"] is None  # no CUDA graphs


def test_figures_are_the_suites_own(result):
    rows, suites = result["table"], result["suites"]
    for family, name in (("plain", "tiny"), ("feedback", "codi-tiny"), ("head", "tiny"),
                         ("loop", "pccot-tiny")):
        run = suites[family]["models"][name]["concurrency"][2]
        r = _one(rows, family, name, 2)
        assert r["step_ms"] == pytest.approx(1e3 * run["decode_step_s"])
        assert r["step_p50_ms"] == pytest.approx(1e3 * run["step_p50_s"])  # the median step
        assert r["floor_ms"] == pytest.approx(1e3 * run["bandwidth_floor"]["floor_s"])
        assert r["speedup_vs_reference"] == run.get("speedup")
    huginn = suites["recurrent"]["models"]["huginn-tiny"]["depths"]["4"]["concurrency"][2]
    r = _one(rows, "recurrent", "huginn-tiny depth 4", 2)
    assert r["step_over_floor"] == huginn["step_over_floor"]
    assert r["speedup_vs_reference"] == huginn["speedup"]
    assert _one(rows, "plain", "tiny", 2)["speedup_vs_reference"] is None  # no HF baseline


def test_latent_over_plain_is_on_the_row_of_the_step_cost_batch(result):
    rows, suites = result["table"], result["suites"]
    for family, name in (("feedback", "coconut-tiny"), ("feedback", "codi-tiny"),
                         ("head", "tiny")):
        cost = suites[family]["models"][name]["step_cost"]
        assert cost["batch"] == 2
        assert _one(rows, family, name, 2)["latent_over_plain_pct"] == \
            cost["latent_over_plain_pct"]
        assert _one(rows, family, name, 1)["latent_over_plain_pct"] is None
    assert _one(rows, "loop", "pccot-tiny", 2)["latent_over_plain_pct"] is None


def test_the_floor_reads_the_weights_once_and_each_rows_kv_at_its_mean_context(result):
    """Between 1 and 2 concurrent requests the weight bytes stay and the KV bytes scale with
    the rows times the decode steps' mean context."""
    for family, name in (("plain", "tiny"), ("feedback", "codi-tiny"), ("loop", "pccot-tiny")):
        runs = result["suites"][family]["models"][name]["concurrency"]
        one, two = runs[1]["bandwidth_floor"], runs[2]["bandwidth_floor"]
        assert one["weights_bytes"] == two["weights_bytes"] > 0
        per_token = [fl["kv_bytes"] / (c * runs[c]["ctx"]["decode"])
                     for c, fl in ((1, one), (2, two))]
        assert per_token[0] == pytest.approx(per_token[1])


def test_every_reference_agrees_with_the_engine_in_float32(result):
    models = [m for s in result["suites"].values() for m in s["models"].values()]
    refs = [run["reference"] for m in models for run in m.get("depths", {"": m}).values()
            if "reference" in run]
    assert len(refs) == 7  # every model but plain's (no HF baseline here); Huginn twice
    assert all(r["agree_with_engine"] == 1.0 for r in refs)


def test_loop_rows_compare_block_passes_with_one_position_forwards(result):
    row = result["suites"]["loop"]["models"]["pccot-tiny"]["concurrency"][2]
    by_pos = row["position_by_position"]
    assert by_pos["thought_s"] > 0 and row["thought_s"] > 0
    assert row["thought_speedup_vs_positions"] == by_pos["thought_s"] / row["thought_s"]
    assert sum(by_pos["steps"].values()) > sum(row["steps"].values())


def test_the_table_has_a_line_per_row_and_dashes_for_what_was_not_measured(result):
    rows = [r for r in result["table"] if r["family"] == "loop"]
    text = table_markdown(rows).splitlines()
    assert len(text) == 2 + len(rows) == 4
    assert text[0].startswith("| family | model | concurrency | step_ms | step_p50_ms | replay_ms")
    assert text[-1].startswith("| loop | pccot-tiny | 2 | ")
    assert text[-1].split(" | ")[5] == "-"  # replay_ms: no CUDA graphs on the CPU


def test_the_suite_needs_cuda():
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present")
    with pytest.raises(RuntimeError, match="needs a CUDA device"):
        run_families_bench()
    with pytest.raises(ValueError, match="families must be among"):
        run_families_bench(families=("plain", "moe"))
