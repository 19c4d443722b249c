"""Data-parallel replicas: ``latentserve serve --data-parallel-size 2`` starts two servers
and SGLang's router in front of them. Every request sent to the router is answered (by the
OpenAI SDK), and with the ``cache_aware`` policy the requests that share a long prefix all go
to the replica that served it first, whose radix cache then serves that prefix.

Skipped unless ``sglang-router`` (a 30 MB wheel, not in the ``test`` extra) is installed.
"""

import subprocess
import sys
import time

import pytest

pytest.importorskip("sglang_router")


def _stats(url: str) -> dict:
    import httpx

    return httpx.get(f"{url}/health", timeout=10).json()["engine"]


@pytest.fixture(scope="module")
def replicas(tmp_path_factory):
    from latentserve.bench.baseline.tiny_models import save_tiny

    d = save_tiny(tmp_path_factory.mktemp("dp") / "llama", "llama", word_tokenizer=True,
                  vocab_size=1024)
    proc, urls = _start(d)
    try:
        yield str(d), urls[0], urls[1:]
    finally:
        proc.terminate()
        proc.wait(60)


def _start(model_dir, port: int | None = None):
    """``latentserve serve --data-parallel-size 2`` with the router on ``port`` (default: a
    free one); returns the process and the router's and replicas' URLs (the replicas' from
    its ``replica i: URL`` lines) once all answer /health."""
    import threading

    import httpx

    from latentserve.server.launch import free_port

    port = port or free_port()
    proc = subprocess.Popen([sys.executable, "-c", "from latentserve.cli import main; main()",
                             "serve", "--model", str(model_dir), "--kv-slots", "4096",
                             "--max-model-len", "512", "--port", str(port),
                             "--data-parallel-size", "2"], stdout=subprocess.PIPE, text=True)
    lines: list[str] = []
    threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True).start()
    deadline = time.monotonic() + 300
    while True:
        if proc.poll() is not None:
            pytest.fail(f"latentserve serve --data-parallel-size 2 exited: {lines}")
        if time.monotonic() > deadline:
            proc.terminate()
            pytest.fail("router and replicas not healthy in 300 s")
        workers = [line.split(": ", 1)[1].strip() for line in list(lines)
                   if line.startswith("replica ")]
        urls = [f"http://127.0.0.1:{port}", *workers]
        try:
            if len(workers) == 2 and all(httpx.get(f"{u}/health", timeout=2).status_code
                                         == 200 for u in urls):
                return proc, urls
        except httpx.HTTPError:
            pass
        time.sleep(0.5)


@pytest.fixture(scope="module")
def second_set(replicas, tmp_path_factory):
    """``(model, port, urls)``: a second replica set on this machine, beside ``replicas``,
    serving a tiny COCONUT; started with the three ports after its router's held by another
    socket (released once it is up)."""
    import socket

    from latentserve.bench.baseline.latent_models import save_latent_tiny
    from latentserve.server.launch import free_port

    d = save_latent_tiny(tmp_path_factory.mktemp("dp-coconut"), "coconut-gpt2")
    held = []
    for _ in range(50):
        port = free_port()
        try:
            for i in (1, 2, 3):
                s = socket.socket()
                held.append(s)
                s.bind(("127.0.0.1", port + i))
                s.listen()
            break
        except OSError:
            for s in held:
                s.close()
            held = []
    assert held, "no port with three free ports after it"
    try:
        proc, urls = _start(d, port)
    finally:
        for s in held:
            s.close()
    try:
        yield str(d), port, urls
    finally:
        proc.terminate()
        proc.wait(60)


def test_replicas_start_when_the_ports_after_the_routers_are_taken(second_set):
    """The replicas' ports are the OS's picks, not ``--port + 1 + i``: with those held by
    another process (the race that made this test file flaky) the set starts all the same."""
    _, port, urls = second_set
    assert all(not u.endswith(f":{port + i}") for u in urls[1:] for i in (1, 2, 3))


def test_every_request_through_the_router_is_answered(replicas):
    from concurrent.futures import ThreadPoolExecutor

    from openai import OpenAI

    model, router, _ = replicas
    client = OpenAI(base_url=f"{router}/v1", api_key="unused")

    def ask(i):
        return client.completions.create(model=model, prompt=f"w{10 + i} w{50 + 3 * i} w7",
                                         max_tokens=4, temperature=0)

    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(ask, range(8)))
    assert [r.usage.completion_tokens for r in results] == [4] * 8
    assert all(r.choices[0].finish_reason == "length" for r in results)


def test_shared_prefix_goes_to_the_replica_that_has_it(replicas):
    from openai import OpenAI

    model, router, workers = replicas
    client = OpenAI(base_url=f"{router}/v1", api_key="unused")
    prefix = " ".join(f"w{100 + i}" for i in range(200))
    before = [_stats(u) for u in workers]
    for i in range(4):
        client.completions.create(model=model, prompt=f"{prefix} w{900 + i}", max_tokens=2,
                                  temperature=0)
    after = [_stats(u) for u in workers]
    grew = [a["prefix_cache_queries"] > b["prefix_cache_queries"]
            for a, b in zip(after, before)]
    assert grew.count(True) == 1, f"the prefix went to {grew.count(True)} replicas"
    k = grew.index(True)
    # Requests 2..4 find the 200-token prefix in that replica's radix cache.
    assert after[k]["prefix_cache_hits"] - before[k]["prefix_cache_hits"] >= 3 * 200


def test_a_second_replica_set_on_the_same_machine_starts(second_set):
    """Each router's Prometheus exporter gets its own free port (on --host):
    with sglang-router's default (0.0.0.0:29000) the second router panicked at start."""
    from openai import OpenAI

    model, _, urls = second_set
    r = OpenAI(base_url=f"{urls[0]}/v1", api_key="unused").completions.create(
        model=model, prompt="w10 w11", max_tokens=2, temperature=0)
    assert r.usage.completion_tokens == 2


def test_killed_supervisor_leaves_no_replica_or_router(replicas):
    """SIGKILL of ``latentserve serve --data-parallel-size 2`` (no chance to clean up): the
    replicas notice their parent is gone and stop, the router gets SIGTERM from the kernel
    (PR_SET_PDEATHSIG); before, all three kept running and holding their ports."""
    import signal

    import httpx

    model, _, _ = replicas
    proc, urls = _start(model)
    proc.send_signal(signal.SIGKILL)
    proc.wait(10)
    deadline = time.monotonic() + 60
    alive = urls
    while alive and time.monotonic() < deadline:
        time.sleep(1)
        alive = []
        for u in urls:
            try:
                httpx.get(f"{u}/health", timeout=2)
                alive.append(u)
            except httpx.HTTPError:
                pass
    assert alive == [], f"still answering 60 s after the supervisor was killed: {alive}"


def test_latent_fields_reach_the_replicas_inside_chat_template_kwargs(second_set):
    """The router rebuilds chat bodies and drops our top-level latent fields; inside
    ``chat_template_kwargs`` they arrive (docs/scaling.md), on a COCONUT model."""
    import httpx

    model, _, urls = second_set
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 3, "temperature": 0}
    for budget in (0, 2, 5):
        r = httpx.post(f"{urls[0]}/v1/chat/completions", timeout=60,
                       json={**body, "chat_template_kwargs": {"latent_budget": budget}})
        assert r.status_code == 200, r.text
        assert (r.json()["choices"][0].get("latent") or {"steps": 0})["steps"] == budget
