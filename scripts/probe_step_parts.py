"""Host time per part of an overlapped engine's decode step, on one GPU (or the CPU).

The model and engine of ``scripts/bench_structured_gpu.py`` (a random Llama of ``--shape``,
64 requests, greedy, 96 tokens each) run each variant in three rounds; every named part is
wrapped in ``perf_counter`` (host time only: no device sync, so a part that waits for the
device counts its wait): scheduling, ``ModelRunner.run``, sampling and its pieces (the
penalties' ``count``/``apply`` and kernels, ``greedy_tokens``, ``score_rows``, the token
masks), the host copies, ``finish`` and the event waits. The third round also runs with
``torch.cuda.set_sync_debug_mode("warn")`` and counts the warnings. Writes
``OUT/probe_parts_SHAPE.json``: per variant and round, the median step (ms) and each part's
host time in us per full-batch step (summed over all the round's steps)::

    OUT=dir python scripts/probe_step_parts.py --tokenizer DIR [--shape smollm2|llama-1b]
        [--variants plain,penalties,logprobs,json] [--device cuda|cpu]
"""

import argparse
import importlib.util
import json
import os
import statistics
import tempfile
import time
import warnings
from collections import defaultdict
from pathlib import Path

import torch

pc = time.perf_counter


def _bench_module():
    spec = importlib.util.spec_from_file_location(
        "bench_structured_gpu", Path(__file__).with_name("bench_structured_gpu.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokenizer", required=True)
    ap.add_argument("--shape", default="smollm2")
    ap.add_argument("--variants", default="plain,penalties")
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args()
    from latentserve import penalties, sampling, staging, token_masks
    from latentserve.engine import overlap
    from latentserve.ops.kernels import penalties as kernels

    bsg = _bench_module()
    acc: dict[str, float] = defaultdict(float)
    calls: dict[str, int] = defaultdict(int)

    def wrap(obj, name: str, label: str) -> None:
        f = getattr(obj, name)

        def timed(*a, **k):
            s = pc()
            try:
                return f(*a, **k)
            finally:
                acc[label] += pc() - s
                calls[label] += 1

        setattr(obj, name, timed)

    out = Path(os.environ.get("OUT", "out"))
    out.mkdir(exist_ok=True)
    model_dir = bsg.build_model(args.tokenizer, Path(tempfile.mkdtemp()) / args.shape,
                                args.shape)
    eng = bsg.build_engine(model_dir, 64, True, args.device)
    for obj, name, label in [
            (overlap, "_count_penalties", "count_penalties"), (overlap, "_sample", "sample"),
            (overlap, "finish", "finish"), (overlap, "_host_copy", "host_copy"),
            (overlap, "_known", "known"), (penalties.PenaltyCounts, "count", "pc_count"),
            (penalties.PenaltyCounts, "apply", "pc_apply"), (kernels, "penalize", "k_penalize"),
            (kernels, "count_tokens", "k_count"), (sampling, "greedy_tokens", "greedy_tokens"),
            (sampling, "score_rows", "score_rows"), (staging.HostToDevice, "copy", "h2d_copy"),
            (sampling, "sample_with_logprobs", "sample_with_logprobs"),
            (token_masks, "batch_bitmask", "batch_bitmask"),
            (token_masks, "begin_bitmask", "begin_bitmask"),
            (token_masks.PendingBitmask, "result", "bitmask_result"),
            (token_masks.PendingBitmask, "build", "bitmask_build_any_thread"),
            (eng, "begin_token_mask", "begin_token_mask"),
            (sampling, "apply_token_mask", "apply_token_mask"),
            (staging._Ring, "take", "ring_take"), (torch.cuda.Event, "synchronize", "event_sync"),
            (eng.runner, "run", "runner_run"), (eng.scheduler, "schedule", "schedule"),
            (eng.scheduler, "advance_launched", "advance_launched"),
            (eng.scheduler, "finalize_launched", "finalize_launched"),
            (eng, "_retire", "retire"), (eng, "token_mask", "token_mask")]:
        wrap(obj, name, label)
    cuda = torch.cuda.is_available() and args.device == "cuda"
    res = {}
    for rnd in range(3):
        for v in args.variants.split(","):
            acc.clear()
            calls.clear()
            with warnings.catch_warnings(record=True) as ws:
                warnings.simplefilter("always")
                if rnd == 2 and cuda:
                    torch.cuda.set_sync_debug_mode("warn")
                t, _ = bsg.run_variant(eng, v, f"p{rnd}", 64, 96, "greedy", 32)
                if cuda:
                    torch.cuda.set_sync_debug_mode(0)
                syncs = [str(w.message)[:200] for w in ws
                         if "synchron" in str(w.message).lower()]
            n = max(len(t), 1)
            row = {"steps": len(t), "step_ms_median": round(statistics.median(t) * 1e3, 3),
                   "parts_us_per_step_all_steps": {k: round(acc[k] / n * 1e6, 1)
                                                   for k in sorted(acc)},
                   "calls": dict(calls), "sync_warnings": len(syncs),
                   "sync_examples": syncs[:3]}
            res[f"{v}_r{rnd}"] = row
            print(v, rnd, json.dumps(row), flush=True)
    (out / f"probe_parts_{args.shape}.json").write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
