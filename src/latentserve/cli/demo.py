"""``latentserve demo``: start the server, ask it a few grade-school math questions through
the ``openai`` client (streaming), print each answer with TTFT and tokens/s, stop it."""

from __future__ import annotations

import json
import time
from importlib import resources


def register(sub) -> None:
    from latentserve.cli import add_engine_args

    p = sub.add_parser("demo", help="serve the model and ask it real questions")
    add_engine_args(p)
    p.add_argument("--num-questions", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=160)
    p.set_defaults(func=run)


def demo_questions(n: int) -> list[dict]:
    """The first ``n`` GSM8K test questions shipped with the package (``question``, ``answer``)."""
    text = resources.files("latentserve").joinpath("data", "questions.json").read_text()
    return json.loads(text)["questions"][:n]


def run(args) -> int:
    from openai import OpenAI

    from latentserve.cli import engine_config
    from latentserve.server.launch import start_server

    print("starting the server (the first start converts the embedded model, ~30 s) ...",
          flush=True)
    with start_server(engine_config(args)) as server:
        client = OpenAI(base_url=server.base_url + "/v1", api_key="none")
        model = client.models.list().data[0].id
        print(f"serving {model} at {server.base_url}\n", flush=True)
        for q in demo_questions(args.num_questions):
            ask(client, model, q, args.max_tokens)
    return 0


def ask(client, model: str, q: dict, max_tokens: int) -> None:
    """Stream one answer to stdout, then print TTFT and decode speed."""
    print(f"Q: {q['question']}\nA: ", end="", flush=True)
    start, first, n_tokens = time.perf_counter(), None, 0
    stream = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": q["question"]}],
        max_tokens=max_tokens, temperature=0.0, stream=True,
        stream_options={"include_usage": True})
    for chunk in stream:
        if chunk.usage is not None:
            n_tokens = chunk.usage.completion_tokens
        for choice in chunk.choices:
            text = choice.delta.content or ""
            if text and first is None:
                first = time.perf_counter()
            print(text, end="", flush=True)
    end = time.perf_counter()
    ttft = (first or end) - start
    tps = (n_tokens - 1) / (end - first) if first and end > first and n_tokens > 1 else 0.0
    print(f"\n   [reference answer {q['answer']} | TTFT {ttft * 1000:.0f} ms | "
          f"{n_tokens} tokens, {tps:.1f} tokens/s]\n", flush=True)
