"""Replay-level A/B of decode-graph variants on one GPU (the harness behind the session-11
tables in docs/benchmarks-history.md, "Decode on one H200").

One engine serves ``batch`` requests (Llama-3.2-1B shape, random bf16 weights, prompts of 256
ids) for 140 steps, so each holds about 391 keys. Then, for every configuration in turn and
for several rounds, a fresh ``CudaGraphRunner`` captures the batch's bucket from the engine's
last step inputs and its graph is replayed ``--replays`` times between CUDA events. Repeats
in one process agree within about 1.5 us; compare configurations only within one run.

A configuration is ``NAME`` or ``NAME:KEY=VALUE,KEY=VALUE``. A key is an environment
variable read when the graph is captured (``LATENTSERVE_LMHEAD``,
``LATENTSERVE_ATTN_PREFETCH_MB``, ``LATENTSERVE_DECODE_PREFETCH_MB``, ``LATENTSERVE_PDL``,
``LATENTSERVE_DECODE_TMA``, ...), or ``lm_head_argmax=0``: the graphs take the argmax of the
logits instead of the LM head's epilogue (``CudaGraphRunner.LM_HEAD_ARGMAX``). Every
configuration starts from the environment the script was started with.

Usage (on the H200):
    python scripts/replay_ab.py --out ab.json base:lm_head_argmax=0 \\
        tiled:LATENTSERVE_LMHEAD=tiled persistent:LATENTSERVE_LMHEAD=persistent

Writes JSON: per batch the mean key count, every round's microseconds per replay, the best
round, and each configuration's first 8 greedy tokens (``mismatch`` lists configurations
whose in-graph greedy tokens differed from their logits' argmax).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
from pathlib import Path


def parse_config(text: str) -> tuple[str, dict[str, str]]:
    """``"name:K=V,K2=V2"`` -> ``("name", {"K": "V", "K2": "V2"})``. Raises ValueError for
    an item without ``=``."""
    name, _, rest = text.partition(":")
    knobs = {}
    for item in filter(None, rest.split(",")):
        key, eq, value = item.partition("=")
        if not eq or not key:
            raise ValueError(f"config {text!r}: {item!r} is not KEY=VALUE")
        knobs[key] = value
    return name, knobs


def _apply(knobs: dict[str, str], base_env: dict[str, str]) -> None:
    from latentserve.engine.cuda_graph import CudaGraphRunner

    os.environ.clear()
    os.environ.update(base_env)
    CudaGraphRunner.LM_HEAD_ARGMAX = knobs.get("lm_head_argmax", "1") != "0"
    os.environ.update({k: v for k, v in knobs.items() if k != "lm_head_argmax"})


def run(path: Path, bs: int, configs: list[tuple[str, dict]], rounds: int, replays: int) -> dict:
    import torch

    from latentserve.bench.device_common import time_replays
    from latentserve.config import EngineConfig
    from latentserve.engine import cuda_graph
    from latentserve.engine.cuda_graph import CudaGraphRunner
    from latentserve.engine.llm_engine import LLMEngine
    from latentserve.sampling_params import SamplingParams

    base_env = dict(os.environ)
    engine = LLMEngine(EngineConfig(model=str(path), device="cuda", dtype="bfloat16",
                                    max_model_len=520, max_num_seqs=64))
    g = torch.Generator().manual_seed(0)
    sp = SamplingParams(max_tokens=300, temperature=0.0, ignore_eos=True)
    for i, p in enumerate(torch.randint(3, 1000, (bs, 256), generator=g).tolist()):
        engine.add_request(f"r{i}", p, sp)
    for _ in range(140):
        engine.step()
    torch.cuda.synchronize()
    old, r = engine.runner.graphs, engine.runner
    real_buckets = cuda_graph.graph_buckets
    cuda_graph.graph_buckets = lambda m: [bs]  # capture only this batch's bucket
    us = {name: [] for name, _ in configs}
    tokens, mismatch = {}, []
    try:
        for _ in range(rounds):
            for name, knobs in configs:
                _apply(knobs, base_env)
                gr = CudaGraphRunner(r.model, r.backend, r.kv_pool, r.table, bs,
                                     old.embeds.shape[1], old.embeds.dtype)
                for buf in ("ids", "pos", "rows", "kv_lens", "out_slots"):
                    getattr(gr, buf)[:bs].copy_(getattr(old, buf)[:bs])
                graph = gr.graphs[gr.graph_depths[0], bs]
                us[name].append(round(time_replays(graph, replays, warmup=20), 1))
                logits, _, greedy = gr.outputs[gr.graph_depths[0], bs][:3]
                tokens[name] = None if greedy is None else greedy[:8].tolist()
                if greedy is not None and not torch.equal(greedy, logits.argmax(-1)):
                    mismatch.append(name)
                del gr, graph
                gc.collect()
    finally:
        cuda_graph.graph_buckets = real_buckets
        _apply({}, base_env)
    kv = float(old.kv_lens[:bs].float().mean())
    del engine, old, r
    gc.collect()
    torch.cuda.empty_cache()
    return {"bs": bs, "mean_kv": kv, "us": us, "min": {k: min(v) for k, v in us.items()},
            "tokens": tokens, "mismatch": sorted(set(mismatch))}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("configs", nargs="+", help="NAME[:KEY=VALUE,...]")
    ap.add_argument("--batch", default="64", help="comma-separated batch sizes (<= 64)")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--replays", type=int, default=300)
    ap.add_argument("--model-dir", default="/tmp/l1b", help="built once (random weights)")
    ap.add_argument("--out", default="replay_ab.json")
    args = ap.parse_args(argv)
    configs = [parse_config(c) for c in args.configs]
    from latentserve.bench.gpu import SHAPES, save_random_llama

    path = Path(args.model_dir)
    if not (path / "config.json").exists():
        save_random_llama(path, SHAPES["llama-3.2-1b"])
    out = [run(path, int(b), configs, args.rounds, args.replays) for b in args.batch.split(",")]
    Path(args.out).write_text(json.dumps(out, indent=1))
    for res in out:
        print(res["bs"], res["min"], "mismatch:", res["mismatch"], file=sys.stderr)


if __name__ == "__main__":
    main()
