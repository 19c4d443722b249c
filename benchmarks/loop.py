"""Looped-block benchmark (issue 8): PCCoT requests whose block passes run as one extend row
over all block positions, against (a) the same engine running the same thoughts position by
position (``LoopState.pass_chunk = 1``: every pass split into one-position forwards, what an
append-only engine would do) and (b) the eager full-recomputation reference
(``latentserve.bench.baseline.loop_reference``) one request at a time, in the same process.

Shape: PCCoT over a random GPT-2 124M (n_embd 768, 12 layers), upstream's released recipe of
24 latents and 3 Jacobi iterations, LoRA r 128 / alpha 32 on ``c_attn, c_fc, c_proj``, written
in the upstream PEFT form and converted. Throughput is answer tokens per second; the thought
phase is the wall time until every request of the batch has left its block (prefill
included).

Run: ``latentserve bench --suite loop [--device cuda] --json-out PATH`` or
``python -m benchmarks.loop PATH [cuda]`` (CUDA: 1, 16 and 64 concurrent requests).
"""

from __future__ import annotations

from benchmarks.common import command, parser, write_json
from latentserve.bench import loop
from latentserve.bench.suite import run_suite


def main(argv=None) -> int:
    p = parser("loop", __doc__)
    p.add_argument("out", nargs="?", default="loop_bench.json", help="JSON output path")
    p.add_argument("device", nargs="?", default="cpu", choices=["cpu", "cuda"])
    args = p.parse_args(argv)
    res = run_suite(loop, ("pccot-gpt2-124m",), args.device,
                    (1, 16, 64) if args.device == "cuda" else (1, 8), command("loop", argv))
    write_json(args.out, res)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
