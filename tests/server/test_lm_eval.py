"""lm-evaluation-harness against a live server (docs/lm-eval/README.md).

lm-eval is not a dependency: when it is importable, ``simple_evaluate`` runs its
``local-completions`` (loglikelihood) and ``local-chat-completions`` (generate_until)
models on a tiny local task; otherwise the same HTTP requests those models send
(``lm_eval/models/openai_completions.py``: ``_create_payload`` and ``parse_logprobs``) are
sent here and parsed as lm-eval parses them. Either way the loglikelihoods must equal
Hugging Face's, and ``--gen_kwargs latent_budget=N`` (lm-eval merges gen_kwargs into the
body) must reach a latent model.
"""

import importlib.util
import json
from operator import itemgetter

import httpx
import pytest
from server_testlib import API_KEY

HAVE_LM_EVAL = importlib.util.find_spec("lm_eval") is not None
# (context, continuation) pairs of the loglikelihood requests.
PAIRS = [("The capital of France is", " Paris"), ("2 + 2 =", " 4"),
         ("Once upon a time", " there was a cat")]


def lm_eval_loglikelihood_payload(model: str, tokens: list[int]) -> dict:
    """local-completions' loglikelihood body (``generate=False``), one request per pair
    (batch size 1)."""
    return {"model": model, "prompt": [tokens], "temperature": 0, "max_tokens": 1,
            "logprobs": 1, "seed": 1234, "echo": True}


def lm_eval_parse_logprobs(out: dict, ctxlens: list[int]) -> list[tuple[float, bool]]:
    """lm-eval's ``LocalCompletionsAPI.parse_logprobs``."""
    res = []
    for choice, ctxlen in zip(sorted(out["choices"], key=itemgetter("index")), ctxlens):
        token_logprobs = choice["logprobs"]["token_logprobs"][ctxlen:-1]
        top = choice["logprobs"]["top_logprobs"][ctxlen:-1]
        greedy = all(t == max(d.values()) for t, d in zip(token_logprobs, top))
        res.append((sum(token_logprobs), greedy))
    return res


def hf_loglikelihood(model_dir, tokens: list[int], ctxlen: int) -> float:
    import torch
    import transformers as tf

    model = tf.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        logits = model(torch.tensor([tokens])).logits[0].float()
    logprobs = torch.log_softmax(logits, dim=-1)
    return sum(logprobs[i - 1, tokens[i]].item() for i in range(ctxlen, len(tokens)))


@pytest.mark.skipif(HAVE_LM_EVAL, reason="lm-eval is installed: the harness itself runs")
def test_local_completions_loglikelihood_requests_match_hf(server, model, tiny_model_dir):
    from latentserve.models.checkpoint import load_tokenizer

    tok = load_tokenizer(tiny_model_dir)  # lm-eval's tokenizer=<the model directory>
    headers = {"Authorization": f"Bearer {API_KEY}"}  # lm-eval sends $OPENAI_API_KEY
    for context, continuation in PAIRS:
        ctx = tok.encode(context, add_special_tokens=False)
        tokens = ctx + tok.encode(continuation, add_special_tokens=False)
        r = httpx.post(f"{server.base_url}/v1/completions", headers=headers, timeout=60,
                       json=lm_eval_loglikelihood_payload(model, tokens))
        assert r.status_code == 200, r.text
        (logprob, _), = lm_eval_parse_logprobs(r.json(), [len(ctx)])
        assert logprob == pytest.approx(hf_loglikelihood(tiny_model_dir, tokens, len(ctx)),
                                        abs=1e-4)


@pytest.fixture(scope="module")
def latent_server(tmp_path_factory, smollm2_dir):
    from latentserve.bench.baseline.latent_models import save_latent_tiny
    from latentserve.config import EngineConfig
    from latentserve.server.launch import start_server

    path = save_latent_tiny(tmp_path_factory.mktemp("lm-eval"), "coconut-llama", max_budget=8)
    srv = start_server(EngineConfig(model=str(path), max_num_seqs=4), timeout=300)
    yield srv, str(path)
    srv.stop()


@pytest.mark.skipif(HAVE_LM_EVAL, reason="lm-eval is installed: the harness itself runs")
@pytest.mark.parametrize("route", ["/v1/chat/completions", "/v1/completions"])
def test_gen_kwargs_latent_budget_reaches_the_server(latent_server, route):
    """lm-eval's generate_until body with ``--gen_kwargs latent_budget=3`` (merged into the
    body after max_tokens, temperature, stop and seed) runs 3 latent steps."""
    srv, model = latent_server
    gen_kwargs = {"until": ["\n\n"], "max_gen_toks": 4, "do_sample": False,
                  "temperature": 0.0, "latent_budget": 3}
    body = {"model": model, "max_tokens": gen_kwargs.pop("max_gen_toks"),
            "temperature": gen_kwargs.pop("temperature"), "stop": gen_kwargs.pop("until"),
            "seed": 1234}
    gen_kwargs.pop("do_sample")
    if route == "/v1/chat/completions":
        body["messages"] = [{"role": "user", "content": "w5 w6 w7"}]
    else:
        body["prompt"] = "w5 w6 w7"
    r = httpx.post(f"{srv.base_url}{route}", json={**body, **gen_kwargs}, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["latent"]["steps"] == 3


@pytest.mark.skipif(not HAVE_LM_EVAL, reason="lm-eval is not installed (see the other tests)")
def test_lm_eval_local_completions_and_chat(server, model, tiny_model_dir, tmp_path,
                                            monkeypatch):
    """The harness itself on a two-item multiple-choice task (local-completions,
    loglikelihood) and a generate_until task (local-chat-completions)."""
    import lm_eval

    monkeypatch.setenv("OPENAI_API_KEY", API_KEY)
    data = tmp_path / "items.jsonl"
    data.write_text("".join(json.dumps({"q": c, "choices": [a, " Berlin"], "gold": 0}) + "\n"
                            for c, a in PAIRS[:2]))
    common = (f"dataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\n"
              "test_split: test\ndoc_to_text: '{{q}}'\n")
    (tmp_path / "mc.yaml").write_text(
        "task: tiny_mc\n" + common + "output_type: multiple_choice\n"
        "doc_to_choice: '{{choices}}'\ndoc_to_target: '{{gold}}'\n"
        "metric_list:\n  - metric: acc\n")
    (tmp_path / "gen.yaml").write_text(
        "task: tiny_gen\n" + common + "output_type: generate_until\n"
        "doc_to_target: '{{choices[0]}}'\ngeneration_kwargs:\n  until: ['\\n']\n"
        "  max_gen_toks: 4\nmetric_list:\n  - metric: exact_match\n")
    from lm_eval.tasks import TaskManager

    tasks = TaskManager(include_path=str(tmp_path))
    base = server.base_url
    mc = lm_eval.simple_evaluate(
        model="local-completions", tasks=["tiny_mc"], task_manager=tasks,
        model_args=f"model={model},base_url={base}/v1/completions,"
                   f"tokenizer={tiny_model_dir},tokenizer_backend=huggingface")
    assert "tiny_mc" in mc["results"]
    gen = lm_eval.simple_evaluate(
        model="local-chat-completions", tasks=["tiny_gen"], task_manager=tasks,
        apply_chat_template=True,
        model_args=f"model={model},base_url={base}/v1/chat/completions")
    assert "tiny_gen" in gen["results"]
