"""Recurrent-depth benchmark (issue 7), CPU: a batch of concurrent Huginn / Ouro requests
through the engine against the eager per-request reference
(``latentserve.bench.baseline.recurrent_reference``, upstream's algorithm with a per-position dict
KV cache, one request at a time), and the mean iterations per token with early exit on vs
off.

Models are random, written in the upstream formats by ``bench.baseline.recurrent_models`` at a
small CPU shape (Huginn: n_embd 256, 2 prelude + 4 core + 2 coda layers, 8 recurrences;
Ouro: hidden 256, 4 layers, 4 steps). Throughput is generated tokens per second (wall
clock, greedy, ``ignore_eos``). Iterations per token: core-block (Huginn) / stack (Ouro)
iterations at each position a token was sampled from, averaged over all generated tokens
(the first one comes from the prompt, which never exits).

Run: ``python -m benchmarks.recurrent --json-out docs/bench/recurrent_cpu.json``.
"""

from __future__ import annotations

import gc
import json
import tempfile
import time
from pathlib import Path

from benchmarks.common import command, parser, write_json

HUGINN_CPU = {"n_embd": 256, "num_attention_heads": 4, "num_key_value_heads": 4,
                  "intermediate_size": 768, "vocab_size": 1024, "block_size": 512,
                  "n_layers_in_prelude": 2,
                  "n_layers_in_recurrent_block": 4, "n_layers_in_coda": 2, "mean_recurrence": 8,
                  "max_recurrence": 8}
OURO_CPU = {"hidden_size": 256, "intermediate_size": 768, "num_hidden_layers": 4,
                "num_attention_heads": 4, "num_key_value_heads": 4, "head_dim": 64,
                "vocab_size": 1024,
                "max_position_embeddings": 512, "total_ut_steps": 4, "max_recurrence": 4}
# Exit rules of the "exit on" runs (thresholds picked so that exits fire on these random
# weights; trained models use upstream's "auto" values).
EXITS = {"huginn": {"exit_criterion": "latent-diff", "exit_threshold": 0.03},
         "ouro": {"exit_criterion": "threshold-approx", "exit_threshold": 0.5}}


def _engine_run(engine, prompts, params, depth: int) -> dict:
    """All prompts queued at once; tokens/s, per-request tokens and iteration stats."""
    model = engine.runner.model
    it0 = model.num_iterations
    rids = []
    for i, p in enumerate(prompts):
        rid = f"b{engine._arrivals}-{i}"
        rids.append(rid)
        engine.add_request(rid, p, params)
    toks, iters = {r: [] for r in rids}, {}
    t0 = time.perf_counter()
    while engine.has_unfinished_requests():
        for o in engine.step():
            toks[o.rid] += o.new_token_ids
            if o.finished:
                iters[o.rid] = o.recurrence
    wall = time.perf_counter() - t0
    n = sum(len(t) for t in toks.values())
    total = sum(s["mean_iterations"] * s["tokens"] for s in iters.values())
    engine.cache.check_idle()
    # The first token of each request comes from the prompt's last position (full depth).
    return {"wall_s": wall, "tok_per_s": n / wall, "tokens": n,
            "mean_iterations_per_token": total / n,
            "mean_iterations_per_decode_token": (total - depth * len(rids)) / (n - len(rids)),
            "forward_token_iterations": model.num_iterations - it0,
            "outputs": [toks[r] for r in rids]}


def _reference_run(ref, family, prompts, output_len, depth, exit_kw) -> dict:
    t0 = time.perf_counter()
    outs = []
    for p in prompts:
        if family == "huginn":
            crit = exit_kw.get("exit_criterion")
            outs.append(ref.generate(p, output_len, depth, crit,
                                     exit_kw.get("exit_threshold", "auto")))
        else:
            outs.append(ref.generate(p, output_len, depth,
                                     exit_kw.get("exit_criterion", "last"),
                                     exit_kw.get("exit_threshold")))
    wall = time.perf_counter() - t0
    n = sum(len(o["tokens"]) for o in outs)
    return {"wall_s": wall, "tok_per_s": n / wall, "tokens": n, "requests": len(prompts),
            "mean_iterations_per_token": sum(sum(o["iterations"]) for o in outs) / n,
            "mean_iterations_per_decode_token": sum(sum(o["iterations"][1:]) for o in outs)
            / (n - len(outs)),
            "outputs": [o["tokens"] for o in outs]}


def bench_family(family: str, root: Path, batch: int, prompt_len: int, output_len: int,
                 ref_requests: int) -> dict:
    import torch

    from latentserve.bench.baseline import recurrent_models as rm
    from latentserve.config import EngineConfig
    from latentserve.engine.llm_engine import LLMEngine
    from latentserve.sampling_params import SamplingParams
    from tests.support.recurrent_reference import HuginnReference, OuroReference

    if family == "huginn":
        path, shape = rm.write_huginn(root / family, **HUGINN_CPU), HUGINN_CPU
        depth, ref = shape["mean_recurrence"], HuginnReference
    else:
        path, shape = rm.write_ouro(root / family, **OURO_CPU), OURO_CPU
        depth, ref = shape["total_ut_steps"], OuroReference
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(3, 1000, (batch, prompt_len), generator=g).tolist()
    engine = LLMEngine(EngineConfig(model=str(path), max_num_seqs=batch,
                                    max_model_len=prompt_len + output_len + 8,
                                    kv_slots=batch * (prompt_len + output_len + 8)))
    base = {"max_tokens": output_len, "temperature": 0.0, "ignore_eos": True,
            "latent_budget": depth}
    if family == "ouro":
        base["exit_criterion"] = "last"
    off_params = SamplingParams(**base)
    on_params = SamplingParams(**{**base, **EXITS[family]})
    _engine_run(engine, prompts[:2], SamplingParams(**{**base, "max_tokens": 4}), depth)
    engine.cache.radix.reset()  # warm-up done; the timed runs start with an empty cache
    off = _engine_run(engine, prompts, off_params, depth)
    engine.cache.radix.reset()  # the exit run must not reuse the prompts' KV
    on = _engine_run(engine, prompts, on_params, depth)
    del engine
    gc.collect()
    reference = ref(path)
    reference.generate(prompts[0][:8], 2, depth)  # warm-up
    ref_off = _reference_run(reference, family, prompts[:ref_requests], output_len, depth,
                             {"exit_criterion": "last"} if family == "ouro" else {})
    ref_on = _reference_run(reference, family, prompts[:ref_requests], output_len, depth,
                            EXITS[family])
    agree_off = off["outputs"][:ref_requests] == ref_off["outputs"]
    agree_on = on["outputs"][:ref_requests] == ref_on["outputs"]
    for r in (off, on, ref_off, ref_on):
        del r["outputs"]
    return {"shape": shape, "depth": depth, "exit_rule": EXITS[family],
            "engine_exit_off": off, "engine_exit_on": on,
            "reference_exit_off": ref_off, "reference_exit_on": ref_on,
            "speedup_exit_off": off["tok_per_s"] / ref_off["tok_per_s"],
            "speedup_exit_on": on["tok_per_s"] / ref_on["tok_per_s"],
            "greedy_agree_exit_off": agree_off, "greedy_agree_exit_on": agree_on}


def run_recurrent_bench(batch: int = 16, prompt_len: int = 32, output_len: int = 32,
                        ref_requests: int = 4, families=("huginn", "ouro"),
                        command: str | None = None) -> dict:
    from latentserve.bench.offline import machine_info

    out = {"command": command, "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
           "machine": machine_info(), "device": "cpu", "dtype": "float32", "batch": batch,
           "prompt_len": prompt_len, "output_len": output_len, "ref_requests": ref_requests,
           "families": {}}
    with tempfile.TemporaryDirectory() as d:
        for fam in families:
            out["families"][fam] = bench_family(fam, Path(d), batch, prompt_len, output_len,
                                                ref_requests)
            print(json.dumps({fam: out["families"][fam]}, indent=1), flush=True)
    out["machine"]["loadavg_1m_end"] = machine_info()["loadavg_1m"]
    return out


def main(argv=None) -> int:
    import os

    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as the CLI: no spinning on shared CPUs
    p = parser("recurrent", __doc__)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--ref-requests", type=int, default=4,
                   help="requests the reference runs, one at a time (default 4)")
    p.add_argument("--families", default="huginn,ouro")
    p.add_argument("--json-out", default=None)
    args = p.parse_args(argv)
    cmd = command("recurrent", argv)
    res = run_recurrent_bench(args.batch, args.prompt_len, args.output_len, args.ref_requests,
                              tuple(args.families.split(",")), cmd)
    if args.json_out:
        write_json(args.json_out, res)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
