"""Decode-step cost of token masks and structured outputs, offline on one GPU.

A random-weight Llama of SmolLM2-135M's shape (SmolLM2's tokenizer from ``--tokenizer``)
serves ``--batch`` concurrent requests per variant; the engine's ``step()`` is timed (no
device sync between steps) and the median over the steps where every request decodes (all
``--batch`` running, no prefill) is the variant's round median. Variants: ``plain`` (overlap
scheduling on, the CUDA default), ``plain_sync`` (overlap off), ``allowed`` and
``min_tokens`` (static masks), ``json`` and ``regex`` (a grammar per request; masks built on
the host while the forward runs). Two engines (overlap on and off) are built once and warmed
with one pass of every variant; then ``--rounds`` rounds each run every variant once, in
order, so that a slow stretch of the host hits every variant. Prints one JSON object and
writes it to ``--out``; docs/server.md quotes it::

    {"device": str, "batch": int, "rounds": int, "model": str,
     "rows": [{"variant": str,
               "steps": int,                 # full-batch steps, all rounds
               "round_ms": [float, ...],     # each round's median step (ms)
               "step_ms_median": float,      # median of round_ms
               "step_ms_mean": float,        # mean step over all rounds' steps
               "vs_plain": float}]}          # step_ms_median / plain's step_ms_median

    python scripts/bench_structured_gpu.py --tokenizer DIR [--batch 64] [--rounds 3] [--out FILE]
"""

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

SCHEMA = {"type": "object", "properties": {"title": {"type": "string"},
                                           "tags": {"type": "array",
                                                    "items": {"type": "string"}}},
          "required": ["title", "tags"]}


def build_model(tokenizer_dir: str, out: Path) -> Path:
    import torch
    import transformers as tf

    cfg = tf.LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536,
                         num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                         max_position_embeddings=2048, rms_norm_eps=1e-5,
                         tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    model = tf.LlamaForCausalLM(cfg)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.05)
    model.save_pretrained(out)
    tf.AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(out)
    return out


EXTRA = {"plain": {}, "plain_sync": {},
         "allowed": {"allowed_token_ids": list(range(0, 49152, 3))},
         "min_tokens": {"min_tokens": None},  # max_tokens, filled in
         "json": {"structured_outputs": {"json": SCHEMA}},
         "regex": {"structured_outputs": {"regex": "[a-z ,.]+"}}}


def build_engine(model_dir: Path, batch: int, overlap: bool, device: str):
    from latentserve.config import EngineConfig
    from latentserve.engine.llm_engine import LLMEngine

    eng = LLMEngine(EngineConfig(model=str(model_dir), device=device,
                                 dtype="bfloat16" if device == "cuda" else "float32",
                                 max_num_seqs=batch, max_model_len=1024, kv_slots=batch * 1024,
                                 overlap_schedule=overlap))
    eng.warmup()
    return eng


def run_variant(eng, name: str, tag: str, batch: int, max_tokens: int) -> list[float]:
    """One round of ``name`` on ``eng``: the wall times (s) of its full-batch steps."""
    from latentserve.sampling_params import SamplingParams

    extra = dict(EXTRA[name])
    if "min_tokens" in extra:
        extra["min_tokens"] = max_tokens
    for i in range(batch):
        params = SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=i,
                                ignore_eos=name not in ("json", "regex"), **extra)
        eng.add_request(f"{name}-{tag}-{i}", [1 + (i * 7 + k) % 1000 for k in range(32)],
                        params)
    times: list[float] = []
    _sync()
    t0 = time.perf_counter()
    while eng.has_unfinished_requests():
        # NOTE: no device sync between steps (it would undo overlap scheduling): a step's
        # time is the wall time between step boundaries, in the steady state
        full = (len(eng.scheduler.running) == batch and not eng.scheduler.waiting
                and all(r.num_computed >= len(r.prompt_ids) for r in eng.scheduler.running))
        eng.step()
        t1 = time.perf_counter()
        if full:
            times.append(t1 - t0)
        t0 = t1
    _sync()
    return times


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
    ap.add_argument("--device", default="cuda", help="cpu: a smoke run of the script")
    args = ap.parse_args()
    import torch

    variants = args.variants.split(",")
    bad = [v for v in variants if v not in EXTRA]
    if bad or args.rounds < 1:
        ap.error(f"unknown variant {bad[0]!r}" if bad else "--rounds must be >= 1")
    model_dir = build_model(args.tokenizer, Path(tempfile.mkdtemp()) / "smollm2-shape")
    engines = {o: build_engine(model_dir, args.batch, o, args.device)
               for o in {v != "plain_sync" for v in variants}}
    times = {v: [] for v in variants}  # per round, the step times
    for rnd in range(args.rounds + 1):  # round 0 warms the graphs' batch sizes and grammars
        for v in variants:
            t = run_variant(engines[v != "plain_sync"], v, str(rnd), args.batch,
                            args.max_tokens)
            if rnd:
                times[v].append(t)
                print(json.dumps({"round": rnd, "variant": v, "steps": len(t),
                                  "step_ms_median": _ms(statistics.median(t)) if t else None}),
                      flush=True)
    rows = []
    for v in variants:
        per = [_ms(statistics.median(t)) for t in times[v] if t]
        flat = [x for t in times[v] for x in t]
        rows.append({"variant": v, "steps": len(flat), "round_ms": per,
                     "step_ms_median": round(statistics.median(per), 3) if per else None,
                     "step_ms_mean": _ms(statistics.mean(flat)) if flat else None})
    base = next((r["step_ms_median"] for r in rows if r["variant"] == "plain"), None)
    for r in rows:
        r["vs_plain"] = (round(r["step_ms_median"] / base, 3)
                         if base and r["step_ms_median"] else None)
    for eng in engines.values():
        eng.shutdown()
    name = torch.cuda.get_device_name(0) if args.device == "cuda" else args.device
    result = {"device": name, "batch": args.batch,
              "rounds": args.rounds, "model": "random Llama, SmolLM2-135M shape, "
              + ("bf16" if args.device == "cuda" else "fp32"),
              "rows": rows}
    print(json.dumps(result, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


def _ms(seconds: float) -> float:
    return round(seconds * 1e3, 3)


if __name__ == "__main__":
    main()
