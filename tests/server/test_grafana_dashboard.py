"""vLLM's Grafana dashboard (``fixtures/vllm_grafana.json``, the example vLLM ships, with
its licence in ``fixtures/LICENSE-vllm_grafana``) works on our ``/metrics`` with one rename:
``vllm:`` becomes ``latentserve_``. After a short run, every metric every panel queries has
samples for the served model, the histograms and counters have counted something, and the
label names the queries use are on those samples."""

import json
import re
from pathlib import Path

import pytest

DASHBOARD = Path(__file__).parent / "fixtures" / "vllm_grafana.json"
PREFIX_RULE = ("vllm:", "latentserve_")  # the documented rename (server/metrics.py)
# Gauges may read 0 after a run; every other queried series must have counted something.
GAUGES = {"latentserve_num_requests_running", "latentserve_num_requests_waiting",
          "latentserve_kv_cache_usage_perc"}


def panel_queries() -> dict[str, list[str]]:
    """Panel title -> its PromQL expressions, with the rename applied."""
    dashboard = json.loads(DASHBOARD.read_text())
    return {p["title"]: [t["expr"].replace(*PREFIX_RULE) for t in p["targets"]]
            for p in dashboard["panels"]}


def metric_names(expr: str) -> set[str]:
    return set(re.findall(r"latentserve_[a-zA-Z0-9_]+", expr))


def label_names(expr: str) -> set[str]:
    """Labels the expression filters on (``{name="..."}``) or groups by (``by(name)``),
    ``le`` (every histogram bucket has it) left out."""
    names = set(re.findall(r"[{,]\s*([a-zA-Z_]+)\s*=", expr))
    for group in re.findall(r"by\s*\(([^)]*)\)", expr):
        names |= {n.strip() for n in group.split(",") if n.strip()}
    return names - {"le"}


def test_the_fixture_is_the_twelve_panel_dashboard():
    queries = panel_queries()
    assert len(queries) == 12
    assert all(metric_names(e) for exprs in queries.values() for e in exprs)


@pytest.fixture(scope="module")
def scraped(server, model):
    """``/metrics`` samples after a short run: completions (one with n=2, one streamed), a
    chat request, and one cut by max_tokens. Returns {sample name: [(labels, value)]}."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families
    from server_testlib import API_KEY, wait_idle

    with httpx.Client(base_url=server.base_url, timeout=120,
                      headers={"Authorization": f"Bearer {API_KEY}"}) as http:
        bodies = [("/v1/completions", {"prompt": [5, 6, 7], "max_tokens": 4, "n": 2,
                                       "ignore_eos": True}),
                  ("/v1/completions", {"prompt": "Hello", "max_tokens": 3, "stream": True}),
                  ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}],
                                            "max_tokens": 2})]
        for path, body in bodies:
            assert http.post(path, json=body).status_code == 200
        wait_idle(http)
        text = http.get("/metrics").text
    samples: dict[str, list] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            samples.setdefault(s.name, []).append((s.labels, s.value))
    return samples


@pytest.mark.parametrize("title", sorted(panel_queries()))
def test_every_panel_query_has_data(scraped, model, title):
    for expr in panel_queries()[title]:
        for name in metric_names(expr):
            ours = [(labels, v) for labels, v in scraped.get(name, [])
                    if labels.get("model_name") == model]
            assert ours, f"{title}: {name} has no sample for {model}"
            for label in label_names(expr):
                assert all(label in labels for labels, _ in ours), (title, name, label)
            if name not in GAUGES:
                assert sum(v for _, v in ours) > 0, f"{title}: {name} counted nothing"


def test_finished_reason_and_the_parent_request_metrics(scraped, model):
    """``finished_reason`` as vLLM labels it; a prompt's n=2 choices are one parent
    request in ``request_params_n`` (its largest bucket count grows by 1 at le=2)."""
    reasons = {labels["finished_reason"] for labels, v in
               scraped["latentserve_request_success_total"] if v > 0}
    assert "length" in reasons
    n_two = [v for labels, v in scraped["latentserve_request_params_n_bucket"]
             if labels["model_name"] == model and labels["le"] == "2.0"]
    n_one = [v for labels, v in scraped["latentserve_request_params_n_bucket"]
             if labels["model_name"] == model and labels["le"] == "1.0"]
    assert n_two[0] - n_one[0] >= 1
