"""The offline benchmark runs end to end on a tiny random Llama (no timing assertions)."""

import json

from latentserve.bench.offline import load_questions, run_offline_bench


def test_questions_are_packaged():
    qs = load_questions()
    assert len(qs) >= 40
    assert all(q["question"] and q["answer"] for q in qs)


def test_run_offline_bench_tiny_llama(tmp_path):
    from latentserve.bench.baseline.tiny_models import save_tiny

    model = save_tiny(tmp_path / "m", "llama")
    res = run_offline_bench(model=str(model), num_prompts=3, output_len=4)
    for key in ("engine", "hf", "speedup", "greedy_agreement", "greedy_agree", "machine",
                "command", "num_prompts", "output_len", "prompt_tokens"):
        assert key in res
    for side in ("engine", "hf"):
        r = res[side]
        for key in ("wall_s", "output_tokens", "total_tokens", "output_tok_per_s",
                    "total_tok_per_s"):
            assert key in r
        assert r["output_tokens"] == 3 * 4
        assert r["total_tokens"] == res["prompt_tokens"] + 3 * 4
    assert res["speedup"] > 0
    assert len(res["greedy_agreement"]) == 3
    assert {"platform", "cpu_count", "torch"} <= set(res["machine"])
    json.dumps(res)  # serialisable as is
