"""``bench --suite families``' trained suite (issue 27): the repository's multiplication
models (real SmolLM2-135M weights) on iCoT test questions, here on the CPU in float32 with
4-token outputs and at most 4 latent steps (the figures show only that every field is
measured; the short outputs leave most answers unfinished, so accuracy is not asserted)."""

import pytest

from latentserve.bench import trained
from latentserve.bench.families import ROW_FIELDS, run_families_bench
from latentserve.bench.trained import MODELS, model_paths


@pytest.fixture(scope="module")
def result():
    return run_families_bench((1, 2), ("trained",), tiny=True)


def _row(result, model, c):
    (row,) = [r for r in result["table"] if (r["model"], r["concurrency"]) == (model, c)]
    return row


@pytest.mark.slow
def test_each_trained_model_gives_a_row_per_concurrency_with_every_field(result):
    rows = result["table"]
    assert {(r["family"], r["model"], r["concurrency"]) for r in rows} == {
        ("trained", m, c) for m in MODELS for c in (1, 2)}
    assert all(set(r) == set(ROW_FIELDS) for r in rows)
    for r in rows:
        assert r["step_ms"] > 0 and r["floor_ms"] > 0 and r["tok_s"] > 0, r
        assert r["step_over_floor"] == pytest.approx(r["step_ms"] / r["floor_ms"])
        assert r["replay_ms"] is None and r["speedup_vs_reference"] is None


@pytest.mark.slow
def test_accuracy_is_the_share_of_the_runs_answers_that_match_the_gold(result):
    from latentserve.eval.colar_eval import answers_match

    for name, m in result["suites"]["trained"]["models"].items():
        answered = []
        for c, run in m["concurrency"].items():
            answers = run["answers"]
            assert len(answers) == c and len({a["question"] for a in answers}) == c
            assert all(a["correct"] == answers_match(a["gold"], a["answer"]) for a in answers)
            assert run["accuracy"] == sum(a["correct"] for a in answers) / c
            assert 0.0 <= _row(result, name, c)["accuracy"] == run["accuracy"] <= 1.0
            answered += answers
        assert m["accuracy"] == sum(a["correct"] for a in answered) / len(answered)
    questions = [a["question"] for m in result["suites"]["trained"]["models"].values()
                 for run in m["concurrency"].values() for a in run["answers"]]
    assert len(set(questions)) == 3  # each concurrency asks its own questions, both models


@pytest.mark.slow
def test_the_colar_model_has_a_latent_step_against_its_plain_step(result):
    models = result["suites"]["trained"]["models"]
    cost = models["smollm2-mult-colar"]["step_cost"]
    assert cost["batch"] == 2 and cost["latent_steps"] > 0
    assert cost["latent_step_s"] > 0 and cost["plain_step_s"] > 0
    assert _row(result, "smollm2-mult-colar", 2)["latent_over_plain_pct"] == \
        cost["latent_over_plain_pct"]
    assert models["smollm2-mult-cot"]["step_cost"] is None  # no latent phase
    assert _row(result, "smollm2-mult-cot", 2)["latent_over_plain_pct"] is None


def test_the_models_are_found_in_the_checkout():
    paths = model_paths(MODELS)
    assert [p.name for p in paths.values()] == list(MODELS)
    assert all(p.parent.name == "models" and p.is_dir() for p in paths.values())


def test_without_the_models_the_suite_says_what_is_missing(tmp_path):
    with pytest.raises(RuntimeError, match="is not the trained model smollm2-mult-cot"):
        model_paths(MODELS, tmp_path)
    with pytest.raises(FileNotFoundError, match="is not a directory"):
        model_paths(MODELS, tmp_path / "absent")
    with pytest.raises(ValueError, match="trained models must be among"):
        model_paths(("gpt-4",))


def test_a_wheel_install_without_models_is_told_so(monkeypatch):
    monkeypatch.setattr(trained, "find_models_dir", lambda given=None: None)
    with pytest.raises(RuntimeError, match="needs the repository's models/ directory"):
        model_paths(MODELS)
