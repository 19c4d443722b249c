"""``latentserve bench serve``: an online benchmark against a running server, like
``vllm bench serve``.

Design notes: docs/internals.md, "latentserve.bench.serve".
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import shlex
import sys
import time
from dataclasses import dataclass, field
from datetime import datetime
from functools import partial
from pathlib import Path

from latentserve import settings
from latentserve.bench.serve_datasets import DATASETS, sample_requests
from latentserve.options import ranged


def _header(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key.strip():
        raise argparse.ArgumentTypeError(f"must be KEY=VALUE, got {text!r}")
    return key.strip(), value


def _json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not valid JSON ({exc})") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"must be a JSON object, got {text!r}")
    return value


# vLLM's --backend names we serve, and the endpoint each sends to (vllm/benchmarks/lib/
# endpoint_request_func.py: vllm and openai post completions, openai-chat chat completions).
BACKEND_ENDPOINTS = {"vllm": "/v1/completions", "openai": "/v1/completions",
                     "openai-chat": "/v1/chat/completions"}


def add_serve_bench_args(parser: argparse.ArgumentParser) -> None:
    """Add the ``bench serve`` flags to ``parser`` (vLLM's names; our older ones aliases)."""
    parser.add_argument("--base-url", help="the server (default http://--host:--port)")
    parser.add_argument("--host", default="127.0.0.1",
                        help="the server's host, without --base-url (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000,
                        help="the server's port, without --base-url (default 8000)")
    parser.add_argument("--backend", choices=sorted(BACKEND_ENDPOINTS),
                        help="vLLM's backend names: vllm and openai send to /v1/completions, "
                             "openai-chat to /v1/chat/completions (an --endpoint given wins)")
    parser.add_argument("--endpoint", choices=["/v1/chat/completions", "/v1/completions"],
                        help="default: --backend's, else /v1/chat/completions")
    parser.add_argument("--model",
                        help="model name to send (default: the server's, from /v1/models)")
    parser.add_argument("--dataset", "--dataset-name", dest="dataset", default="gsm8k",
                        choices=DATASETS,
                        help="gsm8k (packaged), random, sharegpt or custom (--dataset-path)")
    parser.add_argument("--dataset-path",
                        help="sharegpt: a ShareGPT JSON file; custom: JSON lines of "
                             "{\"prompt\": ..., \"output_tokens\": ...}")
    parser.add_argument("--num-prompts", type=ranged(int, "num_prompts", ge=1), default=64)
    parser.add_argument("--input-len", "--random-input-len", dest="input_len", type=int,
                        default=128,
                        help="prompt tokens per request for --dataset random (default 128)")
    parser.add_argument("--output-len", "--random-output-len", dest="output_len",
                        type=ranged(int, "output_len", ge=1), default=64,
                        help="generated tokens per request, gsm8k and random (default 64)")
    parser.add_argument("--sharegpt-output-len", type=int,
                        help="sharegpt: this many tokens per request instead of the answer's")
    parser.add_argument("--custom-output-len", type=int,
                        help="custom: tokens per line without output_tokens (default "
                             "--output-len)")
    parser.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True,
                        help="every request makes its whole output length (default); "
                             "--no-ignore-eos: requests may end at EOS (vLLM's default)")
    parser.add_argument("--request-rate", type=float, default=float("inf"),
                        help="requests per second, Poisson arrivals (default inf: all at once)")
    parser.add_argument("--max-concurrency", type=int,
                        help="requests in flight at most (default: no limit)")
    parser.add_argument("--disconnect-fraction", default=0.0,
                        type=ranged(float, "disconnect_fraction", ge=0.0, le=1.0),
                        help="share of requests whose client hangs up after 1-4 text chunks")
    parser.add_argument("--percentiles", "--metric-percentiles", dest="percentiles",
                        default="50,90,99",
                        help="comma-separated percentiles to report (default 50,90,99)")
    parser.add_argument("--seed", type=int, default=0, help="arrivals, prompts, disconnects")
    parser.add_argument("--api-key",
                        help="sent as a Bearer token (default: $LATENTSERVE_API_KEY if set)")
    parser.add_argument("--extra-body", type=_json_object, metavar="JSON",
                        help="a JSON object merged into every request body, e.g. "
                             "'{\"latent_budget\": 4}'")
    parser.add_argument("--header", type=_header, action="append",
                        metavar="KEY=VALUE", help="a header on every request (repeatable)")
    parser.add_argument("--save-result", action="store_true",
                        help="write the result JSON to --result-dir/--result-filename")
    parser.add_argument("--result-dir", help="with --save-result (default .)")
    parser.add_argument("--result-filename",
                        help="with --save-result (default: vLLM's "
                             "{label}-{rate}qps[-concurrency{N}]-{model}-{time}.json)")
    parser.add_argument("--label",
                        help="the result's label and file name prefix (default: the "
                             "endpoint type, openai-chat or openai)")
    parser.add_argument("--json-out", metavar="PATH", help="write the result JSON to PATH")


@dataclass(slots=True)
class RequestResult:
    """One request as the client saw it (times in seconds)."""

    ok: bool = False
    cancelled: bool = False
    error: str | None = None
    ttft: float | None = None
    latency: float | None = None
    itl: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    output_tokens: int = 0
    text: str = ""


def build_requests(args: argparse.Namespace, model: str, samples) -> list[dict]:
    """The request bodies of ``samples`` in send order, ``--extra-body`` merged in last."""
    chat = args.endpoint == "/v1/chat/completions"
    return [{"model": model, "max_tokens": s.output_len, "temperature": 0,
             "ignore_eos": args.ignore_eos, "stream": True,
             "stream_options": {"include_usage": True},
             **({"messages": [{"role": "user", "content": s.prompt}]} if chat
                else {"prompt": s.prompt}), **(args.extra_body or {})} for s in samples]


async def _one(client, endpoint: str, body: dict, cancel_after: int | None) -> RequestResult:
    res, start, last, chunks = RequestResult(), time.perf_counter(), None, 0
    try:
        async with client.stream("POST", endpoint, json=body) as r:
            if r.status_code != 200:
                res.error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                return res
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    res.error = str(chunk["error"].get("message"))
                    return res
                if chunk.get("usage"):
                    res.prompt_tokens = chunk["usage"]["prompt_tokens"]
                    res.output_tokens = chunk["usage"]["completion_tokens"]
                for choice in chunk.get("choices", []):
                    text = choice.get("text") or (choice.get("delta") or {}).get("content")
                    if text:
                        res.text += text
                        now = time.perf_counter()
                        if res.ttft is None:
                            res.ttft = now - start
                        else:
                            res.itl.append(now - last)
                        last = now
                        chunks += 1
                if cancel_after is not None and chunks >= cancel_after:
                    res.cancelled = True
                    return res
        res.latency = time.perf_counter() - start
        res.ok = res.output_tokens > 0
        if not res.ok:
            res.error = "the stream ended without usage"
    except Exception as exc:  # noqa: BLE001 - a failed request is counted, not fatal
        res.error = f"{type(exc).__name__}: {exc}"
    return res


async def run_benchmark(args: argparse.Namespace, bodies: list[dict], headers: dict
                        ) -> tuple[list[RequestResult], float]:
    """Send ``bodies`` with ``headers`` as ``args`` says: the results (send order), seconds."""
    import httpx

    rng = random.Random(args.seed + 1)
    cancels = [rng.randrange(1, 5) if rng.random() < args.disconnect_fraction else None
               for _ in bodies]
    limit = args.max_concurrency or len(bodies)
    sem = asyncio.Semaphore(limit)
    async with httpx.AsyncClient(
            base_url=args.base_url, headers=headers, timeout=httpx.Timeout(600.0),
            limits=httpx.Limits(max_connections=limit, max_keepalive_connections=limit)
    ) as client:

        async def guarded(body, cancel):
            async with sem:
                return await _one(client, args.endpoint, body, cancel)

        tasks = []
        start = time.perf_counter()
        for body, cancel in zip(bodies, cancels):
            tasks.append(asyncio.create_task(guarded(body, cancel)))
            if args.request_rate != float("inf"):
                await asyncio.sleep(rng.expovariate(args.request_rate))
        results = await asyncio.gather(*tasks)
        return list(results), time.perf_counter() - start


def _stats(name: str, values: list[float], percentiles: list[float]) -> dict:
    """vLLM's ``mean_/median_/std_/pNN_{name}_ms`` of ``values`` (seconds; None if empty)."""
    import numpy as np

    arr = np.asarray(values) * 1000.0
    stats = {"mean": np.mean, "median": np.median, "std": np.std,
             **{f"p{p:g}": partial(np.percentile, q=p) for p in percentiles}}
    return {f"{k}_{name}_ms": float(f(arr)) if values else None for k, f in stats.items()}


def summarize(results: list[RequestResult], duration: float, percentiles: list[float]
              ) -> dict:
    """vLLM's flat result: counts, throughputs (/s), latency statistics (ms), per request."""
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_tokens for r in ok)
    tpots = [(r.latency - r.ttft) / (r.output_tokens - 1) for r in ok
             if r.output_tokens > 1 and r.ttft is not None]
    return {
        "duration": duration,
        "completed": len(ok),
        "failed": sum(1 for r in results if not r.ok and not r.cancelled),
        "cancelled": sum(r.cancelled for r in results),
        "total_input_tokens": in_tokens,
        "total_output_tokens": out_tokens,
        "request_throughput": len(ok) / duration,
        "output_throughput": out_tokens / duration,
        "total_token_throughput": (in_tokens + out_tokens) / duration,
        **_stats("ttft", [r.ttft for r in ok if r.ttft is not None], percentiles),
        **_stats("tpot", tpots, percentiles),
        **_stats("itl", [x for r in ok for x in r.itl], percentiles),
        **_stats("e2el", [r.latency for r in ok], percentiles),
        "input_lens": [r.prompt_tokens for r in results],
        "output_lens": [r.output_tokens for r in results],
        "ttfts": [r.ttft for r in results],
        "itls": [r.itl for r in results],
        "generated_texts": [r.text for r in results],
        "errors": [r.error or "" for r in results],
    }


def check_server(client, timeout: float = 30.0) -> dict:
    """``/health`` (``client``: an ``httpx.Client`` of the server) once the engine is idle,
    with ``slots_ok`` (free + cached == total)."""
    deadline = time.monotonic() + timeout
    health = {}
    while time.monotonic() < deadline:
        health = client.get("/health", timeout=10).json()
        engine = health.get("engine") or {}
        if (health.get("running") == 0 and engine.get("num_running") == 0
                and engine.get("num_waiting") == 0):
            break
        time.sleep(0.1)
    keys = ("kv_slots_free", "kv_slots_cached", "kv_slots_total")
    if all(k in health for k in keys):
        health["slots_ok"] = (health["kv_slots_free"] + health["kv_slots_cached"]
                              == health["kv_slots_total"])
    return health


def format_report(result: dict, percentiles: list[float]) -> str:
    """The plain-text report (vLLM's layout)."""
    lines = ["{s:{c}^60}".format(s=" Serving Benchmark Result ", c="=")]

    def row(name, value):  # counts as integers, other figures to 2 decimals
        text = "n/a" if value is None else f"{value:.2f}" if isinstance(value, float) else value
        lines.append(f"{name:<44}{text:>16}")

    for name, key in (("Successful requests:", "completed"),
                      ("Cancelled requests (client hung up):", "cancelled"),
                      ("Failed requests:", "failed"), ("Benchmark duration (s):", "duration"),
                      ("Total input tokens:", "total_input_tokens"),
                      ("Total generated tokens:", "total_output_tokens"),
                      ("Request throughput (req/s):", "request_throughput"),
                      ("Output token throughput (tok/s):", "output_throughput"),
                      ("Total token throughput (tok/s):", "total_token_throughput")):
        row(name, result[key])
    for key, title, short in (("ttft", "Time to First Token", "TTFT"),
                              ("tpot", "Time per Output Token (excl. 1st token)", "TPOT"),
                              ("itl", "Inter-token Latency", "ITL"),
                              ("e2el", "End-to-end Latency", "E2EL")):
        lines.append("{s:{c}^60}".format(s=f" {title} ", c="-"))
        for stat in ("mean", "median", *(f"p{p:g}" for p in percentiles)):
            label = stat.capitalize() if stat in ("mean", "median") else stat.upper()
            row(f"{label} {short} (ms):", result[f"{stat}_{key}_ms"])
    health = result.get("server_after") or {}
    lines.append("=" * 60)
    lines.append(f"server after the run: status {health.get('status')}, "
                 f"slot invariant {'holds' if health.get('slots_ok') else 'BROKEN'}")
    return "\n".join(lines)


def command_line(args: argparse.Namespace) -> str:
    """The ``latentserve bench serve`` command of ``args``, without the API key."""
    parts = ["latentserve", "bench", "serve", "--base-url", args.base_url,
             "--endpoint", args.endpoint, "--dataset", args.dataset,
             "--num-prompts", str(args.num_prompts), "--output-len", str(args.output_len)]
    if not args.ignore_eos:
        parts.append("--no-ignore-eos")
    for key, value in args.header or ():
        parts += ["--header", f"{key}={value}"]
    for flag, value in (
            ("--input-len", args.input_len if args.dataset == "random" else None),
            ("--dataset-path", args.dataset_path),
            ("--sharegpt-output-len", args.sharegpt_output_len),
            ("--custom-output-len", args.custom_output_len),
            ("--extra-body", json.dumps(args.extra_body) if args.extra_body else None),
            ("--model", args.model),
            ("--request-rate", None if args.request_rate == float("inf")
             else f"{args.request_rate:g}"),
            ("--max-concurrency", args.max_concurrency),
            ("--disconnect-fraction", f"{args.disconnect_fraction:g}"
             if args.disconnect_fraction else None),
            ("--seed", args.seed or None), ("--json-out", args.json_out)):
        if value:
            parts += [flag, str(value)]
    return shlex.join(parts)


def _served_model(client, base_url: str) -> str:
    """The first model ``/v1/models`` lists. Raises ValueError with the reason."""
    import httpx

    try:
        r = client.get("/v1/models", timeout=30)
    except httpx.HTTPError as exc:
        raise ValueError(f"cannot reach {base_url}: {exc}") from None
    if r.status_code != 200:
        hint = " (pass --api-key or set LATENTSERVE_API_KEY)" if r.status_code == 401 else ""
        raise ValueError(f"{base_url}/v1/models answered {r.status_code}{hint}: {r.text[:200]}")
    return r.json()["data"][0]["id"]


def serve_bench_main(args: argparse.Namespace) -> int:
    """Run the benchmark of ``args``, print the report, write the result. Returns 1 when a
    request failed or the server was unhealthy after, else 0. ValueError for a bad
    ``--dataset-path``, an unreachable server or a refused ``/v1/models``."""
    import httpx

    args.base_url = args.base_url or f"http://{args.host}:{args.port}"
    args.endpoint = args.endpoint or BACKEND_ENDPOINTS.get(args.backend, "/v1/chat/completions")
    args.api_key = args.api_key or settings.get("LATENTSERVE_API_KEY")
    headers = dict(args.header or ())  # then the API key's
    if args.api_key:
        headers["Authorization"] = f"Bearer {args.api_key}"
    client = httpx.Client(base_url=args.base_url, headers=headers, timeout=60)
    model = args.model or _served_model(client, args.base_url)
    percentiles = [float(p) for p in args.percentiles.split(",") if p.strip()]

    def ask(path: str, body: dict, key: str):  # the server's /tokenize and /detokenize
        r = client.post(path, json={"model": model, **body})
        r.raise_for_status()
        return r.json()[key]

    samples = sample_requests(args, lambda text: ask("/tokenize", {"prompt": text}, "count"),
                              lambda ids: ask("/detokenize", {"tokens": ids}, "prompt"))
    bodies = build_requests(args, model, samples)
    results, duration = asyncio.run(run_benchmark(args, bodies, headers))
    endpoint_type = "openai-chat" if args.endpoint == "/v1/chat/completions" else "openai"
    result = {
        "date": datetime.now().strftime("%Y%m%d-%H%M%S"),
        "endpoint_type": endpoint_type,
        "backend": "latentserve",
        "label": args.label or endpoint_type,
        "model_id": model,
        "tokenizer_id": model,
        "num_prompts": args.num_prompts,
        "request_rate": args.request_rate if args.request_rate != float("inf") else "inf",
        "burstiness": 1.0,
        "max_concurrency": args.max_concurrency,
        **summarize(results, duration, percentiles),
        "command": command_line(args),
        "client_machine": {"platform": platform.platform(), "cpus": os.cpu_count(),
                           "python": sys.version.split()[0]},
        "endpoint": args.endpoint,
        "dataset_name": args.dataset,
        "extra_body": args.extra_body,
        "disconnect_fraction": args.disconnect_fraction,
        "server_after": check_server(client),
    }
    print(format_report(result, percentiles))
    errors = list(dict.fromkeys(e for e in result.get("errors") or [] if e))
    for error in errors[:3]:  # why requests failed, as vLLM prints its failed test request
        print(f"failed request: {error}", file=sys.stderr)
    if len(errors) > 3:
        print(f"... and {len(errors) - 3} other errors (the result's 'errors')",
              file=sys.stderr)
    paths = [args.json_out] if args.json_out else []
    if args.save_result:  # --result-dir/--result-filename, by default vLLM's file name
        concurrency = f"-concurrency{args.max_concurrency}" if args.max_concurrency else ""
        paths.append(os.path.join(args.result_dir or ".", args.result_filename or (
            f"{result['label']}-{args.request_rate}qps{concurrency}-"
            f"{model.rstrip('/').split('/')[-1]}-{result['date']}.json")))
    for path in map(Path, paths):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result, indent=1))
        print(f"wrote {path}")
    healthy = result["server_after"].get("status") == "ok" and result["server_after"].get(
        "slots_ok")
    return 0 if result["failed"] == 0 and healthy else 1


if __name__ == "__main__":  # python -m latentserve.bench.serve: latentserve bench serve
    parser = argparse.ArgumentParser(prog="python -m latentserve.bench.serve")
    add_serve_bench_args(parser)
    sys.exit(serve_bench_main(parser.parse_args()))
