"""Decode-step cost of token masks and structured outputs, offline on one GPU.

A random-weight Llama of SmolLM2-135M's shape (SmolLM2's tokenizer from ``--tokenizer``)
serves ``--batch`` concurrent requests in each variant; the engine's ``step()`` is timed and
the median over the steps where every request is decoding (all ``--batch`` running, no
prefill) is reported, with its ratio to the plain step (``plain`` runs first and last: the
faster of the two is the base). Variants: ``plain`` (overlap
scheduling on, the CUDA default), ``plain_sync`` (overlap off), ``allowed`` and
``min_tokens`` (static masks: overlap stays on), ``json`` and ``regex`` (a grammar per
request: synchronous steps). Prints one JSON object; docs/server.md quotes it.

    python scripts/bench_structured_gpu.py --tokenizer DIR [--batch 64] [--out FILE]
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


def run_variant(model_dir: Path, name: str, batch: int, max_tokens: int) -> dict:
    import torch

    from latentserve.config import EngineConfig
    from latentserve.engine.llm_engine import LLMEngine
    from latentserve.sampling_params import SamplingParams

    overlap = name != "plain_sync"
    eng = LLMEngine(EngineConfig(model=str(model_dir), device="cuda", dtype="bfloat16",
                                 max_num_seqs=batch, max_model_len=1024, kv_slots=batch * 1024,
                                 overlap_schedule=overlap))
    eng.warmup()
    extra = {"plain": {}, "plain_sync": {},
             "allowed": {"allowed_token_ids": list(range(0, 49152, 3))},
             "min_tokens": {"min_tokens": max_tokens},
             "json": {"structured_outputs": {"json": SCHEMA}},
             "regex": {"structured_outputs": {"regex": "[a-z ,.]+"}}}[name]
    times: list[float] = []
    for rnd in range(2):  # round 0 warms the graphs' batch sizes and the grammar cache
        for i in range(batch):
            params = SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=i,
                                    ignore_eos=name not in ("json", "regex"), **extra)
            eng.add_request(f"{name}-{rnd}-{i}", [1 + (i * 7 + k) % 1000 for k in range(32)],
                            params)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        while eng.has_unfinished_requests():
            # NOTE: no device sync between steps (it would undo overlap scheduling): a
            # step's time is the wall time between step boundaries, in the steady state
            full = (len(eng.scheduler.running) == batch and not eng.scheduler.waiting
                    and all(r.num_computed >= len(r.prompt_ids) for r in eng.scheduler.running))
            eng.step()
            t1 = time.perf_counter()
            if rnd == 1 and full:
                times.append(t1 - t0)
            t0 = t1
    eng.shutdown()
    del eng
    torch.cuda.empty_cache()
    return {"variant": name, "steps": len(times),
            "step_ms_median": round(statistics.median(times) * 1e3, 3) if times else None,
            "step_ms_mean": round(statistics.mean(times) * 1e3, 3) if times else None}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokenizer", required=True)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--variants",
                    default="plain,allowed,min_tokens,json,regex,plain_sync,plain")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    import torch

    model_dir = build_model(args.tokenizer, Path(tempfile.mkdtemp()) / "smollm2-shape")
    rows = []
    for v in args.variants.split(","):
        rows.append(run_variant(model_dir, v, args.batch, args.max_tokens))
        print(json.dumps(rows[-1]), flush=True)
    plain = [r["step_ms_median"] for r in rows if r["variant"] == "plain"]
    base = min(plain) if plain else None
    for r in rows:
        if base and r["step_ms_median"]:
            r["vs_plain"] = round(r["step_ms_median"] / base, 3)
    result = {"device": torch.cuda.get_device_name(0), "batch": args.batch,
              "model": "random Llama, SmolLM2-135M shape, bf16", "rows": rows}
    print(json.dumps(result, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
