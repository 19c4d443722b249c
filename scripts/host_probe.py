"""Where the host's time goes in a real decode step on the GPU (the probe behind
docs/benchmarks-history.md, "Results (session 12)").

One engine serves the Llama-3.2-1B shape (random bf16 weights, overlap scheduling on).
For 1, 16 and 64 requests of 256 prompt ids, 200 decode steps are timed twice: plain, then
with each host part wrapped in ``perf_counter`` (scheduling, the page-table flush,
``ModelRunner.run``, the packed replay and the graph launch inside it, sampling, the token
copy, ``advance_launched``, ``finalize_launched`` and ``overlap.finish``, which includes the
wait for the device). Then, on the batch-64 graph: the host time of a graph launch with the
device idle and busy, and of a 320-value host-to-device copy from pageable and from pinned
memory with a replay in flight.

Usage (on the H200): ``OUT=dir python scripts/host_probe.py [--model llama-3.2-1b|smollm2-135m]
[--prompt-len 256] [--temperature 0] [--batches 1,16,64]``. Prints one JSON line per
batch size and writes ``$OUT/probe_MODEL_tT_pP.json``: per batch ``plainN`` (median and mean
step, us) and ``instN`` (the same, and per part ``[median, mean, calls]`` in us), and the
batch-64 graph's device time per replay (``replay_device_us``).
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
import time
from array import array
from pathlib import Path

pc = time.perf_counter


class _TimedGraph:
    """A captured graph whose ``replay`` (the launch's host time) is timed."""

    def __init__(self, graph, sink: dict):
        self.graph, self.sink = graph, sink

    def replay(self):
        s = pc()
        self.graph.replay()
        self.sink.setdefault("cudaGraphLaunch", []).append(pc() - s)


def _run(engine, batch: int, steps: int, instrument: bool, gen, prompt_len: int = 256,
         temperature: float = 0.0) -> dict:
    import torch

    from benchmarks.host import abort_all, step_until_all_decode, time_calls
    from latentserve.engine import overlap
    from latentserve.sampling_params import SamplingParams

    sched, runner = engine.scheduler, engine.runner
    sp = SamplingParams(max_tokens=steps + 50, temperature=temperature, ignore_eos=True)
    for i, p in enumerate(torch.randint(3, 1000, (batch, prompt_len), generator=gen).tolist()):
        engine.add_request(f"p{batch}-{i}-{time.monotonic_ns()}", p, sp)
    step_until_all_decode(engine)
    for _ in range(5):
        engine.step()
    sink: dict = {}
    saved, graphs = [], runner.graphs
    originals = dict(graphs.graphs)
    if instrument:
        graphs.graphs = {k: _TimedGraph(v, sink) for k, v in originals.items()}
        for obj, name in ((sched, "schedule"), (sched, "advance_launched"),
                          (sched, "finalize_launched"), (sched.cache, "flush"),
                          (runner, "run"), (graphs, "replay_packed"), (overlap, "_sample"),
                          (overlap, "_host_copy"), (overlap, "finish")):
            saved.append((obj, name, time_calls(obj, name, sink)))
    times = []
    try:
        for _ in range(steps):
            s = pc()
            engine.step()
            times.append(pc() - s)
    finally:
        for obj, name, fn in saved:
            setattr(obj, name, fn)
        graphs.graphs = originals
    abort_all(engine)
    out = {"step_med": statistics.median(times) * 1e6, "step_mean": statistics.mean(times) * 1e6}
    for k, v in sink.items():
        out[k] = [round(statistics.median(v) * 1e6, 1), round(statistics.mean(v) * 1e6, 1),
                  len(v)]
    return out


def _copies(engine) -> dict:
    """Host time of the batch-64 graph's launch (device idle, then busy) and of a 320-value
    host-to-device copy from pageable and from pinned memory with a replay in flight. The
    replays run on stale inputs and may overwrite cached KV: call it last."""
    import torch

    graph = engine.runner.graphs.graphs[0, 64]
    idle, busy, pageable, pinned_t = [], [], [], []
    values = array("q", range(64 * 5))
    pinned = torch.empty(64 * 5, dtype=torch.int64, pin_memory=True)
    for _ in range(30):
        torch.cuda.synchronize()
        s = pc()
        graph.replay()
        idle.append(pc() - s)
        s = pc()
        graph.replay()
        busy.append(pc() - s)
        s = pc()
        torch.frombuffer(values, dtype=torch.int64).to("cuda", non_blocking=True)
        pageable.append(pc() - s)
        graph.replay()  # the pinned copy too with a replay in flight
        s = pc()
        pinned.copy_(torch.frombuffer(values, dtype=torch.int64))
        pinned.to("cuda", non_blocking=True)
        pinned_t.append(pc() - s)
    torch.cuda.synchronize()

    def med(xs):
        return statistics.median(xs) * 1e6

    from latentserve.bench.device_common import time_replays

    return {"replay_device_us": time_replays(graph, 100), "launch_idle_us": med(idle),
            "launch_busy_us": med(busy), "pageable_copy_busy_us": med(pageable),
            "pinned_copy_busy_us": med(pinned_t)}


def main(argv: list[str] | None = None) -> None:
    import argparse

    import torch

    from latentserve.bench.gpu import SHAPES, save_random_llama
    from latentserve.config import EngineConfig
    from latentserve.engine.llm_engine import LLMEngine

    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="llama-3.2-1b", choices=sorted(SHAPES))
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--batches", default="1,16,64")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as d:
        path = save_random_llama(Path(d), SHAPES[args.model])
        engine = LLMEngine(EngineConfig(model=str(path), device="cuda", dtype="bfloat16",
                                        max_model_len=args.prompt_len + 264, max_num_seqs=64,
                                        overlap_schedule=True))
    gen = torch.Generator().manual_seed(0)
    _run(engine, 64, 20, False, gen, args.prompt_len, args.temperature)  # warm-up
    out: dict = {"args": vars(args)}
    for batch in map(int, args.batches.split(",")):
        for tag, inst in (("plain", False), ("inst", True)):
            out[f"{tag}{batch}"] = _run(engine, batch, 200, inst, gen, args.prompt_len,
                                        args.temperature)
        print(batch, json.dumps(out[f"plain{batch}"]), json.dumps(out[f"inst{batch}"]),
              flush=True)
    out.update(_copies(engine))
    print(json.dumps({k: v for k, v in out.items() if k.endswith("_us")}))
    name = f"probe_{args.model}_t{args.temperature:g}_p{args.prompt_len}.json"
    Path(os.environ.get("OUT", "."), name).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
