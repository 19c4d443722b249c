"""``latentserve bench serve``: an online benchmark against a running server, like
``vllm bench serve``.

``add_serve_bench_args(parser)`` adds the flags; ``serve_bench_main(args)`` runs it, prints
the report and writes the JSON (``--json-out``). It can also play the load test of the
server's robustness checks: ``--disconnect-fraction`` makes that share of the clients hang
up after a few chunks, and at the end the server's ``/health`` must show an idle engine
whose KV slots are all free or cached (``free + cached == total``).

Method: ``--num-prompts`` streaming requests (each ``stream: true`` with
``stream_options.include_usage``; greedy, ``ignore_eos``, ``max_tokens = --output-len``, so
each makes exactly that many tokens unless cancelled), sent at ``--request-rate`` requests
per second (Poisson arrivals; ``inf`` sends all at once) with at most ``--max-concurrency``
in flight. Prompts: the packaged GSM8K questions (``--dataset gsm8k``, cycled; chat requests
send each as one user message, completion requests as the prompt) or ``--input-len``
random token ids (``--dataset random``, completions only). Per request, measured in this
process from just before the request is sent (seconds, ``time.perf_counter``):

* TTFT: until the first chunk carrying text;
* ITL: between consecutive chunks carrying text (each gap is one sample);
* TPOT: ``(latency - TTFT) / (output tokens - 1)``, for requests with 2+ tokens;
* E2EL: until the stream ends.

Output tokens are the server's ``usage.completion_tokens``; input tokens its
``usage.prompt_tokens``. Throughputs divide by the wall time of the whole run (first send
to last byte). Percentiles use linear interpolation (``numpy.percentile``'s default).
Cancelled requests count in no latency and no throughput.
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
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone


def add_serve_bench_args(parser: argparse.ArgumentParser) -> None:
    """Add the ``bench serve`` flags to ``parser``."""
    parser.add_argument("--base-url", default="http://127.0.0.1:8000",
                        help="the server (default http://127.0.0.1:8000)")
    parser.add_argument("--endpoint", default="/v1/chat/completions",
                        choices=["/v1/chat/completions", "/v1/completions"])
    parser.add_argument("--model", default=None,
                        help="model name to send (default: the server's, from /v1/models)")
    parser.add_argument("--dataset", default="gsm8k", choices=["gsm8k", "random"])
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=128,
                        help="prompt tokens per request for --dataset random (default 128)")
    parser.add_argument("--output-len", type=int, default=64,
                        help="generated tokens per request, exact (default 64)")
    parser.add_argument("--request-rate", type=float, default=float("inf"),
                        help="requests per second, Poisson arrivals (default inf: all at once)")
    parser.add_argument("--max-concurrency", type=int, default=None,
                        help="requests in flight at most (default: no limit)")
    parser.add_argument("--disconnect-fraction", type=float, default=0.0,
                        help="share of requests whose client hangs up after 1-4 text chunks")
    parser.add_argument("--percentiles", default="50,90,99",
                        help="comma-separated percentiles to report (default 50,90,99)")
    parser.add_argument("--seed", type=int, default=0, help="arrivals, prompts, disconnects")
    parser.add_argument("--api-key", default=None,
                        help="sent as a Bearer token (default: $LATENTSERVE_API_KEY if set)")
    parser.add_argument("--json-out", default=None, metavar="PATH",
                        help="write the full result as JSON to PATH")


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


def _questions() -> list[str]:
    from importlib import resources

    text = resources.files("latentserve").joinpath("data/questions.json").read_text("utf-8")
    return [q["question"] for q in json.loads(text)["questions"]]


def build_requests(args: argparse.Namespace, model: str) -> list[dict]:
    """The request bodies, in send order (deterministic for a given ``--seed``)."""
    rng = random.Random(args.seed)
    common = {"model": model, "max_tokens": args.output_len, "temperature": 0,
              "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    bodies = []
    if args.dataset == "random":
        if args.endpoint != "/v1/completions":
            raise ValueError("--dataset random needs --endpoint /v1/completions")
        for _ in range(args.num_prompts):
            ids = [rng.randrange(1000, 30000) for _ in range(args.input_len)]
            bodies.append({**common, "prompt": ids})
        return bodies
    questions = _questions()
    for i in range(args.num_prompts):
        q = questions[i % len(questions)]
        if args.endpoint == "/v1/chat/completions":
            bodies.append({**common, "messages": [{"role": "user", "content": q}]})
        else:
            bodies.append({**common, "prompt": q})
    return bodies


async def _one(client, endpoint: str, body: dict, cancel_after: int | None) -> RequestResult:
    res = RequestResult()
    start = time.perf_counter()
    last = None
    chunks = 0
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


async def run_benchmark(args: argparse.Namespace, bodies: list[dict]
                        ) -> tuple[list[RequestResult], float]:
    """Send ``bodies`` as described by ``args``; return the results (in send order) and the
    wall time in seconds."""
    import httpx

    rng = random.Random(args.seed + 1)
    cancels = [rng.randrange(1, 5) if rng.random() < args.disconnect_fraction else None
               for _ in bodies]
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
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


def _stats(values: list[float], percentiles: list[float]) -> dict[str, float | None]:
    import numpy as np

    if not values:
        return {"mean": None, "median": None, **{f"p{p:g}": None for p in percentiles}}
    arr = np.asarray(values) * 1000.0
    out = {"mean": float(arr.mean()), "median": float(np.median(arr))}
    for p in percentiles:
        out[f"p{p:g}"] = float(np.percentile(arr, p))
    return out


def summarize(results: list[RequestResult], duration: float, percentiles: list[float]
              ) -> dict:
    """Counts, throughputs (per second of ``duration``) and latency statistics (ms)."""
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_tokens for r in ok)
    tpots = [(r.latency - r.ttft) / (r.output_tokens - 1) for r in ok
             if r.output_tokens > 1 and r.ttft is not None]
    return {
        "completed": len(ok),
        "cancelled": sum(r.cancelled for r in results),
        "failed": sum(1 for r in results if not r.ok and not r.cancelled),
        "errors": sorted({r.error for r in results if r.error})[:5],
        "duration_s": duration,
        "total_input_tokens": in_tokens,
        "total_output_tokens": out_tokens,
        "request_throughput": len(ok) / duration,
        "output_throughput": out_tokens / duration,
        "total_token_throughput": (in_tokens + out_tokens) / duration,
        "ttft_ms": _stats([r.ttft for r in ok if r.ttft is not None], percentiles),
        "tpot_ms": _stats(tpots, percentiles),
        "itl_ms": _stats([x for r in ok for x in r.itl], percentiles),
        "e2el_ms": _stats([r.latency for r in ok], percentiles),
    }


def check_server(base_url: str, api_key: str | None, timeout: float = 30.0) -> dict:
    """Wait until the server's engine is idle; return ``/health`` with ``slots_ok`` (free +
    cached == total) added."""
    import httpx

    deadline = time.monotonic() + timeout
    health = {}
    while time.monotonic() < deadline:
        health = httpx.get(f"{base_url}/health", timeout=10).json()
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


def format_report(result: dict) -> str:
    """The plain-text report (vLLM's layout)."""
    s = result["summary"]
    lines = ["{s:{c}^60}".format(s=" Serving Benchmark Result ", c="=")]

    def row(name, value, fmt="{:.2f}"):
        text = "n/a" if value is None else fmt.format(value)
        lines.append(f"{name:<44}{text:>16}")

    row("Successful requests:", s["completed"], "{}")
    row("Cancelled requests (client hung up):", s["cancelled"], "{}")
    row("Failed requests:", s["failed"], "{}")
    row("Benchmark duration (s):", s["duration_s"])
    row("Total input tokens:", s["total_input_tokens"], "{}")
    row("Total generated tokens:", s["total_output_tokens"], "{}")
    row("Request throughput (req/s):", s["request_throughput"])
    row("Output token throughput (tok/s):", s["output_throughput"])
    row("Total token throughput (tok/s):", s["total_token_throughput"])
    for key, title, short in (("ttft_ms", "Time to First Token", "TTFT"),
                              ("tpot_ms", "Time per Output Token (excl. 1st token)", "TPOT"),
                              ("itl_ms", "Inter-token Latency", "ITL"),
                              ("e2el_ms", "End-to-end Latency", "E2EL")):
        lines.append("{s:{c}^60}".format(s=f" {title} ", c="-"))
        for stat, value in s[key].items():
            label = stat.capitalize() if stat in ("mean", "median") else stat.upper()
            row(f"{label} {short} (ms):", value)
    health = result.get("server_after") or {}
    lines.append("=" * 60)
    lines.append(f"server after the run: status {health.get('status')}, "
                 f"slot invariant {'holds' if health.get('slots_ok') else 'BROKEN'}")
    return "\n".join(lines)


def command_line(args: argparse.Namespace) -> str:
    """The ``latentserve bench serve`` command equivalent to ``args`` (the API key left
    out)."""
    parts = ["latentserve", "bench", "serve", "--base-url", args.base_url,
             "--endpoint", args.endpoint, "--dataset", args.dataset,
             "--num-prompts", str(args.num_prompts), "--output-len", str(args.output_len)]
    if args.dataset == "random":
        parts += ["--input-len", str(args.input_len)]
    if args.model:
        parts += ["--model", args.model]
    if args.request_rate != float("inf"):
        parts += ["--request-rate", f"{args.request_rate:g}"]
    if args.max_concurrency:
        parts += ["--max-concurrency", str(args.max_concurrency)]
    if args.disconnect_fraction:
        parts += ["--disconnect-fraction", f"{args.disconnect_fraction:g}"]
    if args.seed:
        parts += ["--seed", str(args.seed)]
    if args.json_out:
        parts += ["--json-out", str(args.json_out)]
    return shlex.join(parts)


def _served_model(base_url: str, headers: dict) -> str:
    """The first model ``/v1/models`` lists. Raises ValueError with the reason."""
    import httpx

    try:
        r = httpx.get(f"{base_url}/v1/models", headers=headers, timeout=30)
    except httpx.HTTPError as exc:
        raise ValueError(f"cannot reach {base_url}: {exc}") from None
    if r.status_code != 200:
        hint = " (pass --api-key or set LATENTSERVE_API_KEY)" if r.status_code == 401 else ""
        raise ValueError(f"{base_url}/v1/models answered {r.status_code}{hint}: {r.text[:200]}")
    return r.json()["data"][0]["id"]


def serve_bench_main(args: argparse.Namespace) -> int:
    """Run the benchmark described by ``args`` (from ``add_serve_bench_args``); print the
    report, write ``--json-out`` if given. Returns 0, or 1 when a request failed or the
    server was not healthy with its slot invariant after the run.

    Raises:
        ValueError: bad flag values, a server that cannot be reached, or a refused
            ``/v1/models`` (e.g. a missing ``--api-key``); the message says which.
    """

    if args.num_prompts < 1 or args.output_len < 1:
        raise ValueError("--num-prompts and --output-len must be at least 1")
    if not 0.0 <= args.disconnect_fraction <= 1.0:
        raise ValueError("--disconnect-fraction must be in [0, 1]")
    args.api_key = args.api_key or os.environ.get("LATENTSERVE_API_KEY")
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    model = args.model or _served_model(args.base_url, headers)
    percentiles = [float(p) for p in args.percentiles.split(",") if p.strip()]
    bodies = build_requests(args, model)
    results, duration = asyncio.run(run_benchmark(args, bodies))
    result = {
        "command": command_line(args),
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "client_machine": {"platform": platform.platform(), "cpus": os.cpu_count(),
                           "python": sys.version.split()[0]},
        "model": model,
        "endpoint": args.endpoint,
        "num_prompts": args.num_prompts,
        "output_len": args.output_len,
        "request_rate": args.request_rate if args.request_rate != float("inf") else "inf",
        "max_concurrency": args.max_concurrency,
        "disconnect_fraction": args.disconnect_fraction,
        "summary": summarize(results, duration, percentiles),
        "server_after": check_server(args.base_url, args.api_key),
        "requests": [asdict(r) for r in results],
    }
    print(format_report(result))
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(result, f, indent=1)
    healthy = result["server_after"].get("status") == "ok" and result["server_after"].get(
        "slots_ok")
    return 0 if result["summary"]["failed"] == 0 and healthy else 1


def main(argv: list[str] | None = None) -> int:
    """``python -m latentserve.bench.serve``: the same as ``latentserve bench serve``."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_serve_bench_args(parser)
    return serve_bench_main(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
