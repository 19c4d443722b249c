"""Host cost of launching a decode step's CUDA graph, with programmatic dependent launch (PDL)
on and off: per model and setting, an engine (random bf16 weights) serves ``--batch``
greedy requests; then ``step_ms`` is its mean decode step while all of them decode (no
device sync between steps), ``launch_us`` the host time of one ``replay()`` of its
``--batch``-row decode graph issued on an idle device (the mean of 50), and ``replay_us``
the graph's device time (CUDA events over 100 back-to-back replays). A profile of the
SmolLM2 shape (session 26) saw about 250 us of host time per launch with PDL on. Usage:
``python -m benchmarks.graph_launch [OUT.json] [--models smollm2-135m,llama-3.2-1b]``.
Needs CUDA.
"""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path

from benchmarks import common
from benchmarks.host import steady_step_ms


def measure(name: str, root: Path, batch: int, pdl: bool, steps: int = 32) -> dict:
    import torch

    from latentserve.bench.device_common import make_engine, time_replays
    from latentserve.bench.gpu import build_llama
    from latentserve.sampling_params import SamplingParams

    os.environ["LATENTSERVE_PDL"] = "1" if pdl else "0"  # read when the graphs are captured
    path = root / name
    if not path.exists():
        build_llama(path, name, "cuda")
    engine = make_engine(path, "cuda", "bfloat16", batch, 256, kv_slots=(batch + 1) * 256)
    engine.warmup()
    for i in range(batch):
        engine.add_request(f"r{i}", [3 + (i * 7 + k) % 900 for k in range(32)],
                           SamplingParams(max_tokens=steps + 24, temperature=0.0,
                                          ignore_eos=True))
    step_ms = steady_step_ms(engine, steps)
    while engine.has_unfinished_requests():
        engine.step()
    graph = next(g for (d, b), g in engine.runner.graphs.graphs.items() if b == batch)
    host = []
    for _ in range(50):
        torch.cuda.synchronize()
        t = time.perf_counter()
        graph.replay()
        host.append(time.perf_counter() - t)
    torch.cuda.synchronize()
    out = {"model": name, "pdl": pdl, "batch": batch, "step_ms": round(step_ms, 3),
           "launch_us": round(sum(host) / len(host) * 1e6, 1),
           "replay_us": round(time_replays(graph, 100), 1)}
    print(out, flush=True)
    del engine, graph
    torch.cuda.empty_cache()
    return out


def main(argv: list[str] | None = None) -> None:
    p = common.parser("graph_launch", __doc__)
    p.add_argument("out", nargs="?", default=None)
    p.add_argument("--models", default="smollm2-135m,llama-3.2-1b")
    p.add_argument("--batch", type=int, default=64)
    args = p.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory() as d:
        for name in args.models.split(","):
            for pdl in (True, False, True):  # on twice: the first run of a machine is often slow
                rows.append(measure(name, Path(d), args.batch, pdl))
    common.write_json(args.out, {"command": common.command("graph_launch", argv), "rows": rows})


if __name__ == "__main__":
    main()
