"""Decode-step cost of token masks and structured outputs, offline on one GPU (or the CPU).

A random-weight Llama of SmolLM2-135M's shape (``--shape tiny``: 2 layers of width 64, so
that on the CPU the step is mostly the host's work; ``--shape llama-1b``: Llama-3.2-1B's
layers, a device-bound step; SmolLM2's tokenizer and vocabulary from ``--tokenizer``)
serves ``--batch`` concurrent requests per variant; the engine's ``step()`` is timed (no
device sync between steps) and the median over the steps where every request decodes (all
``--batch`` running, no prefill) is the variant's round median. Variants: ``plain`` (overlap
scheduling on, the CUDA default), ``allowed`` and ``min_tokens`` (static masks), ``json``
and ``regex`` (a grammar per request; its row filled in the step that samples it, after
that step's forward is launched), ``logprobs`` (1 each) and ``penalties`` (presence,
frequency and repetition);
``NAME_sync`` runs NAME with overlap scheduling off. ``--sampling``:
every request at temperature 1 with ``seed=i`` (``seeded``, the default), at temperature 1
without a seed (``unseeded``) or at temperature 0 (``greedy``). Two engines (overlap on and
off) are built once and warmed with one pass of every variant; then ``--rounds`` rounds each
run every variant once, in order, so that a slow stretch of the host hits every variant.
Prints one JSON object and writes it to ``--out``; docs/server.md quotes it::

    {"device": str, "batch": int, "rounds": int, "model": str, "sampling": str,
     "rows": [{"variant": str,
               "steps": int,                 # full-batch steps, all rounds
               "round_ms": [float, ...],     # each round's median step (ms)
               "step_ms_median": float,      # median of round_ms
               "step_ms_mean": float,        # mean step over all rounds' steps
               "thread_cpu_round_ms": [...], # each round's median CPU time of the
               "thread_cpu_ms_median": float,  # engine's thread per step (its own work,
                                             # not xgrammar's threads'; CUDA's spin-waits
                                             # count)
               "vs_plain": float,            # step_ms_median / plain's step_ms_median
               "cpu_vs_plain": float}]}      # the same for thread_cpu_ms_median

    python scripts/bench_structured_gpu.py --tokenizer DIR [--batch 64] [--rounds 3] [--out FILE]
        [--variants plain,json,...] [--device cuda|cpu] [--shape smollm2|llama-1b|tiny]
        [--sampling seeded|unseeded|greedy] [--prompt-len 32] [--profile DIR]
"""

import argparse
import cProfile
import io
import json
import pstats
import statistics
import tempfile
import time
from pathlib import Path

SCHEMA = {"type": "object", "properties": {"title": {"type": "string"},
                                           "tags": {"type": "array",
                                                    "items": {"type": "string"}}},
          "required": ["title", "tags"]}


SHAPES = {"smollm2": {"hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30,
                       "num_attention_heads": 9, "num_key_value_heads": 3},
          # Llama-3.2-1B's layers (a device-bound step) with SmolLM2's vocabulary
          "llama-1b": {"hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
                       "num_attention_heads": 32, "num_key_value_heads": 8},
          "tiny": {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                   "num_attention_heads": 4, "num_key_value_heads": 2}}


def build_model(tokenizer_dir: str, out: Path, shape: str = "smollm2") -> Path:
    import torch
    import transformers as tf

    cfg = tf.LlamaConfig(vocab_size=49152, **SHAPES[shape], max_position_embeddings=2048,
                         rms_norm_eps=1e-5, tie_word_embeddings=True, bos_token_id=1,
                         eos_token_id=2)
    torch.manual_seed(0)
    model = tf.LlamaForCausalLM(cfg)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.05)
    if shape == "llama-1b":
        model.to(torch.bfloat16)  # half the bytes to write and load
    model.save_pretrained(out)
    tf.AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(out)
    return out


EXTRA = {"plain": {},
         "allowed": {"allowed_token_ids": list(range(0, 49152, 3))},
         "min_tokens": {"min_tokens": None},  # max_tokens, filled in
         "json": {"structured_outputs": {"json": SCHEMA}},
         "regex": {"structured_outputs": {"regex": "[a-z ,.]+"}},
         "logprobs": {"logprobs": 1},
         "penalties": {"presence_penalty": 0.5, "frequency_penalty": 0.5,
                       "repetition_penalty": 1.1}}
# NAME_sync: NAME on an engine without overlap scheduling
EXTRA.update({f"{k}_sync": v for k, v in list(EXTRA.items())})


def build_engine(model_dir: Path, batch: int, overlap: bool, device: str):
    from latentserve.config import EngineConfig
    from latentserve.engine.llm_engine import LLMEngine

    eng = LLMEngine(EngineConfig(model=str(model_dir), device=device,
                                 dtype="bfloat16" if device == "cuda" else "float32",
                                 max_num_seqs=batch, max_model_len=1024, kv_slots=batch * 1024,
                                 overlap_schedule=overlap))
    eng.warmup()
    return eng


SAMPLING = {"seeded": lambda i: {"temperature": 1.0, "seed": i},
            "unseeded": lambda i: {"temperature": 1.0}, "greedy": lambda i: {"temperature": 0.0}}


def run_variant(eng, name: str, tag: str, batch: int, max_tokens: int, sampling: str = "seeded",
                prompt_len: int = 32, profile: Path | None = None
                ) -> tuple[list[float], list[float]]:
    """One round of ``name`` on ``eng``: ``(wall, cpu)`` times (s) of its full-batch steps
    (``cpu``: the calling thread's CPU time, without other threads' work or waits for the
    CPU). ``profile``: a cProfile of the full-batch steps is written there (the 40 costliest
    functions by own time, then by cumulative time; the profiler slows every Python call,
    so these steps' times are not comparable with an unprofiled round's)."""
    from latentserve.sampling_params import SamplingParams

    extra = dict(EXTRA[name])
    if "min_tokens" in extra:
        extra["min_tokens"] = max_tokens
    for i in range(batch):
        params = SamplingParams(max_tokens=max_tokens, **SAMPLING[sampling](i),
                                ignore_eos="structured_outputs" not in extra, **extra)
        eng.add_request(f"{name}-{tag}-{i}",
                        [1 + (i * 7 + k) % 1000 for k in range(prompt_len)], params)
    times: list[float] = []
    cpu: list[float] = []
    prof = cProfile.Profile() if profile is not None else None
    _sync()
    t0, c0 = time.perf_counter(), time.thread_time()
    while eng.has_unfinished_requests():
        # NOTE: no device sync between steps (it would undo overlap scheduling): a step's
        # time is the wall time between step boundaries, in the steady state
        full = (len(eng.scheduler.running) == batch and not eng.scheduler.waiting
                and all(r.num_computed >= len(r.prompt_ids) for r in eng.scheduler.running))
        if full and prof is not None:
            prof.enable()
        eng.step()
        if prof is not None:
            prof.disable()
        t1, c1 = time.perf_counter(), time.thread_time()
        if full:
            times.append(t1 - t0)
            cpu.append(c1 - c0)
        t0, c0 = t1, c1
    _sync()
    if prof is not None and profile is not None:
        text = io.StringIO()
        stats = pstats.Stats(prof, stream=text)
        text.write(f"{name}: {len(times)} full-batch steps\n")
        stats.sort_stats("tottime").print_stats(40)
        stats.sort_stats("cumulative").print_stats(40)
        profile.write_text(text.getvalue())
    return times, cpu


def _sync():
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokenizer", required=True)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--variants", default="plain,allowed,min_tokens,json,regex,plain_sync")
    ap.add_argument("--out", default=None)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--shape", default="smollm2", choices=sorted(SHAPES),
                    help="tiny: 2 layers of width 64, the step all host work (with --device cpu)")
    ap.add_argument("--sampling", default="seeded", choices=sorted(SAMPLING))
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--profile", default=None, metavar="DIR",
                    help="after the timed rounds, one more round of each variant under "
                         "cProfile, written to DIR/profile_VARIANT.txt")
    args = ap.parse_args()
    import torch

    variants = args.variants.split(",")
    bad = [v for v in variants if v not in EXTRA]
    if bad or args.rounds < 1:
        ap.error(f"unknown variant {bad[0]!r}" if bad else "--rounds must be >= 1")
    model_dir = build_model(args.tokenizer, Path(tempfile.mkdtemp()) / f"{args.shape}-shape",
                            args.shape)
    engines = {o: build_engine(model_dir, args.batch, o, args.device)
               for o in {not v.endswith("_sync") for v in variants}}
    times = {v: [] for v in variants}  # per round, the step times
    cpu = {v: [] for v in variants}  # per round, the engine thread's CPU time per step
    for rnd in range(args.rounds + 1):  # round 0 warms the graphs' batch sizes and grammars
        for v in variants:
            t, c = run_variant(engines[not v.endswith("_sync")], v, str(rnd), args.batch,
                               args.max_tokens, args.sampling, args.prompt_len)
            if rnd:
                times[v].append(t)
                cpu[v].append(c)
                print(json.dumps({"round": rnd, "variant": v, "steps": len(t),
                                  "step_ms_median": _ms(statistics.median(t)) if t else None,
                                  "thread_cpu_ms_median":
                                      _ms(statistics.median(c)) if c else None}),
                      flush=True)
    if args.profile:
        Path(args.profile).mkdir(parents=True, exist_ok=True)
        for v in variants:
            run_variant(engines[not v.endswith("_sync")], v, "prof", args.batch, args.max_tokens,
                        args.sampling, args.prompt_len,
                        Path(args.profile) / f"profile_{v}.txt")
    rows = []
    for v in variants:
        per = [_ms(statistics.median(t)) for t in times[v] if t]
        per_cpu = [_ms(statistics.median(c)) for c in cpu[v] if c]
        flat = [x for t in times[v] for x in t]
        rows.append({"variant": v, "steps": len(flat), "round_ms": per,
                     "step_ms_median": round(statistics.median(per), 3) if per else None,
                     "step_ms_mean": _ms(statistics.mean(flat)) if flat else None,
                     "thread_cpu_round_ms": per_cpu,
                     "thread_cpu_ms_median":
                         round(statistics.median(per_cpu), 3) if per_cpu else None})
    plain = next((r for r in rows if r["variant"] == "plain"), None)
    for r in rows:
        for key, vs in (("step_ms_median", "vs_plain"), ("thread_cpu_ms_median", "cpu_vs_plain")):
            base = None if plain is None else plain[key]
            r[vs] = round(r[key] / base, 3) if base and r[key] else None
    for eng in engines.values():
        eng.shutdown()
    name = torch.cuda.get_device_name(0) if args.device == "cuda" else args.device
    result = {"device": name, "batch": args.batch,
              "rounds": args.rounds, "sampling": args.sampling, "model": "random Llama, "
              + {"smollm2": "SmolLM2-135M shape, ", "llama-1b": "Llama-3.2-1B layers, SmolLM2 "
                 "vocabulary, ", "tiny": "tiny shape, "}[args.shape]
              + ("bf16" if args.device == "cuda" else "fp32"),
              "rows": rows}
    print(json.dumps(result, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


def _ms(seconds: float) -> float:
    return round(seconds * 1e3, 3)


if __name__ == "__main__":
    main()
