"""Data-parallel replicas behind SGLang's router (``latentserve serve --data-parallel-size N``).
Design notes: docs/internals.md, "latentserve.server.replicas"."""

from __future__ import annotations

import ctypes
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict

from latentserve.extras import require

ROUTER_POLICIES = ("cache_aware", "round_robin", "random", "power_of_two")


def _die_with_parent() -> None:
    """``preexec_fn`` of the router: SIGTERM it when this process dies (Linux only)."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # 1: PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def serve_replicas(config, data_parallel_size: int, options, policy: str = "cache_aware") -> None:
    """Start ``data_parallel_size`` servers with ``options`` (``ServerOptions``; each on a
    free port) and the router on ``options.host:options.port``; block until interrupted or
    the router exits, then stop them all (``data_parallel_size`` and ``policy`` as ``serve``'s
    flags checked them). ValueError (``port`` in use), ModuleNotFoundError (no
    ``sglang_router``), RuntimeError (a replica or the router failed)."""
    # NOTE: lazy: the CLI builds its parser from this module, and launch imports the whole API
    from latentserve.server.launch import free_port, listen_socket, start_server

    host, port = options.host, options.port
    replica_options = {k: v for k, v in asdict(options).items() if k not in ("host", "port")}
    require("sglang_router", "--data-parallel-size")
    try:
        listen_socket(host, port).close()
    except ValueError:
        raise ValueError(f"--port {port} is in use on {host} (the router's port); pick "
                         f"another --port") from None

    def on_term(*_):
        raise KeyboardInterrupt  # run the finally below on SIGTERM too

    signal.signal(signal.SIGTERM, on_term)
    tp = config.tensor_parallel_size

    def start(i: int):  # start_server: a replica stops when this process dies
        gpus = ",".join(str(d) for d in range(i * tp, (i + 1) * tp))
        env = {"CUDA_VISIBLE_DEVICES": gpus} if config.device.startswith("cuda") else {}
        return start_server(config, host, None, env=env, **replica_options)

    servers, router = [], None
    try:
        with ThreadPoolExecutor(data_parallel_size) as pool:  # replicas load in parallel
            futures = [pool.submit(start, i) for i in range(data_parallel_size)]
        servers = [f.result() for f in futures if f.exception() is None]
        for f in futures:
            f.result()  # the first failure, once all have started or failed (finally stops)
        for i, s in enumerate(servers):
            print(f"replica {i}: {s.base_url}", flush=True)
        # its Prometheus exporter on a free port (the default is shared by every router)
        router = subprocess.Popen(
            [sys.executable, "-m", "sglang_router.launch_router", "--host", host, "--port",
             str(port), "--worker-urls", *(s.base_url for s in servers), "--policy", policy,
             "--prometheus-host", host, "--prometheus-port", str(free_port(host)),
             "--log-level", "warn"], preexec_fn=_die_with_parent)  # noqa: PLW1509 - pool ended
        print(f"router ({policy}): http://{host}:{port}", flush=True)
        while router.poll() is None and all(s.proc.poll() is None for s in servers):
            time.sleep(0.5)
        if router.returncode is not None and router.returncode not in (0, 130):  # 130: Ctrl-C
            raise RuntimeError(f"the router exited with code {router.returncode} (its "
                               f"output is above; --port {port} taken meanwhile?)")
    except KeyboardInterrupt:
        pass
    finally:
        if router is not None and router.poll() is None:
            router.terminate()
            try:
                router.wait(10)
            except subprocess.TimeoutExpired:
                router.kill()
        for s in servers:
            s.stop()
