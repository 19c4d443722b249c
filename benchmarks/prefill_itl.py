"""Inter-token latency of a running decode while a long prompt is admitted, under a given
prefill token budget (``--max-num-batched-tokens``): the scheduler (``scheduler/
scheduler.py``) puts decode rows first and fills the rest of each step's budget with a chunk
of the long prompt, as vLLM v1's chunked prefill does, so the decode waits for one chunk per
step instead of the whole prefill.

    python -m benchmarks.prefill_itl --prompt-len 4096 --budgets 256 8192

prints one JSON object: per budget, the decode request's worst and median inter-token gap
(ms) while the long prompt was in prefill, the steps that prefill took and whether the decode
got a token in every one of them. Numbers and the command go to docs/bench/.
"""

from __future__ import annotations

import itertools
import statistics
import tempfile
import time

from benchmarks import common

SHAPES = {  # transformers LlamaConfig fields
    "tiny": dict(hidden_size=256, intermediate_size=512, num_hidden_layers=4),
    "llama-1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                     num_attention_heads=32, num_key_value_heads=8, rope_theta=500000.0),
}


def tiny_checkpoint(out_dir: str, max_len: int, shape: str = "tiny") -> str:
    """A random Llama of ``max_len`` positions in ``shape`` (``SHAPES``: ``tiny``, hidden
    256 and 4 layers, where a long prefill costs seconds on a CPU; ``llama-1b``, Llama-3.2-1B's
    layer shapes with a small vocabulary, for a GPU)."""
    from latentserve.bench.baseline.tiny_models import save_tiny

    return str(save_tiny(out_dir, "llama", word_tokenizer=True, max_position_embeddings=max_len,
                         **SHAPES[shape]))


def measure(model_dir: str, prompt_len: int, budget: int, decode_tokens: int = 64,
            device: str = "cpu", dtype: str | None = None) -> dict:
    """Run one decode request, admit a ``prompt_len``-token prompt after its 4th token, and
    time the decode's tokens until the long prompt's first token (its prefill). Returns
    ``{"budget", "prefill_steps", "decode_token_every_step", "worst_itl_ms",
    "median_itl_ms", "prefill_s"}``."""
    from latentserve.config import EngineConfig
    from latentserve.engine.llm_engine import LLMEngine
    from latentserve.sampling_params import SamplingParams

    max_len = prompt_len + 2 * decode_tokens
    engine = LLMEngine(EngineConfig(model=model_dir, device=device, dtype=dtype or "auto",
                                    max_model_len=max_len, kv_slots=2 * max_len,
                                    max_num_batched_tokens=budget, max_num_seqs=4,
                                    enable_prefix_caching=False))
    try:
        decode = SamplingParams(max_tokens=decode_tokens * 2, ignore_eos=True, temperature=0)
        engine.add_request("decode", [5, 6, 7, 8], decode)
        seen = 0
        while seen < 4:
            seen += sum(len(o.new_token_ids) for o in engine.step() if o.rid == "decode")
        engine.add_request("long", [(i * 7919) % 40000 + 100 for i in range(prompt_len)],
                           SamplingParams(max_tokens=1, ignore_eos=True, temperature=0))
        times, steps, every = [time.perf_counter()], 0, True
        start = times[0]
        while True:
            outs = engine.step()
            steps += 1
            now = time.perf_counter()
            got = any(o.rid == "decode" and o.new_token_ids for o in outs)
            every = every and got
            if got:
                times.append(now)
            if any(o.rid == "long" and o.new_token_ids for o in outs):
                break
        gaps = [(b - a) * 1e3 for a, b in itertools.pairwise(times)] or [(now - start) * 1e3]
        return {"budget": budget, "prefill_steps": steps, "decode_token_every_step": every,
                "worst_itl_ms": round(max(gaps), 2),
                "median_itl_ms": round(statistics.median(gaps), 2),
                "prefill_s": round(now - start, 3)}
    finally:
        engine.shutdown()


def main(argv: list[str] | None = None) -> None:
    parser = common.parser("prefill_itl", __doc__)
    parser.add_argument("--prompt-len", type=int, default=4096)
    parser.add_argument("--budgets", type=int, nargs="+", default=[256, 8192])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default=None, help="engine dtype (default: auto)")
    parser.add_argument("--shape", default="tiny", choices=sorted(SHAPES))
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        model = tiny_checkpoint(tmp, args.prompt_len + 256, args.shape)
        runs = [measure(model, args.prompt_len, b, device=args.device, dtype=args.dtype)
                for b in args.budgets]
    common.write_json(None, {
        "command": common.command("prefill_itl", argv), "prompt_len": args.prompt_len,
        "model": f"random llama, {args.shape} shape: {SHAPES[args.shape]}",
        "device": args.device, "dtype": args.dtype, "runs": runs})


if __name__ == "__main__":
    main()
