"""Compression-head benchmark for the H200 (issue 6): closed-loop latent decoding through
``LLMEngine`` (CUDA graphs on; head, stop head and decoder inside the captured decode
graphs) at 1, 16 and 64 concurrent requests against the eager single-request closed loop
over HF transformers (``bench.baseline.head_reference.HeadReference``), run one request
at a time in the same process; and the cost of a latent step against a plain decode step.

Models: random bf16 backbones of the SmolLM2-135M and Llama-3.2-1B shapes
(``bench.gpu.SHAPES``) with a random float32 head bundle inside the model directory
(``latent.bundle.random_bundle``; head config in ``HEADS``) and ``save_word_tokenizer``'s
tokenizer (ids 3..1023 are words ``w3..``; the thinking span is ``w5 w6 w7`` ... ``w8``).

Work per request (deterministic: ``use_stop`` off, ``min_latent`` 0): prompt of
``prompt_len`` random ids + the 3 opening ids, exactly ``max_latent`` latent steps, the
closing id, then ``answer_len`` greedy answer tokens with ``ignore_eos``. Throughput is
answer tokens per second (wall clock, device synced, prefill included); each request does
the same work, so the speedup is also the ratio of requests per second. The reference is
timed on ``ref_requests`` requests after one warm-up request and its per-request time is
taken as the same for every request (it runs them one after another).

Latent vs plain step: one batch of ``step_batch`` rows runs ``max_latent`` latent steps
(steady-step mean of the "latent" steps) and the same prompts with the opening ids and
thinking off run ``max_latent`` plain decode steps in the same engine; the same plain batch
also runs on the bare backbone (``no_latent_head``, stepping synchronously like the head
engine), whose graphs do not run the head.
Goal (issue 6): latent within 10 % of plain. The bandwidth floor of the latent step is
(backbone + head weight bytes + the batch's KV bytes at the mean context) / the copy
bandwidth measured in the same run.

Run on the H200: ``python -m benchmarks.head_gpu OUT.json`` (``--help`` for the
options; ``--tiny`` runs the whole pipeline on a tiny model on the CPU in seconds).
"""

from __future__ import annotations

from benchmarks.common import command, parser, write_json
from latentserve.bench import head_gpu
from latentserve.bench.head_gpu import HEADS
from latentserve.bench.suite import run_suite


def main(argv=None) -> int:
    p = parser("head_gpu", __doc__)
    p.add_argument("out", nargs="?", default="head_gpu_bench.json", help="JSON output path")
    p.add_argument("--shapes", default=",".join(HEADS), help=f"comma list of {list(HEADS)}")
    p.add_argument("--concurrency", default="1,16,64")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--max-latent", type=int, default=32)
    p.add_argument("--answer-len", type=int, default=32)
    p.add_argument("--ref-requests", type=int, default=3)
    p.add_argument("--step-rounds", type=int, default=1,
                   help="repeat the latent/plain/bare step-cost phases this many times in "
                        "turn and report medians")
    p.add_argument("--no-bare", action="store_true",
                   help="skip the bare-backbone plain-step baseline")
    p.add_argument("--tiny", action="store_true",
                   help="tiny model on the CPU, float32, small lengths (CI smoke run)")
    args = p.parse_args(argv)
    cmd = command("head_gpu", argv)
    conc = tuple(int(x) for x in args.concurrency.split(","))
    if args.tiny:
        res = run_suite(head_gpu, ("tiny",), "cpu", (1, 4), cmd, prompt_len=8, max_latent=4,
                        answer_len=4, ref_requests=1, bare_baseline=not args.no_bare,
                        step_rounds=args.step_rounds)
    else:
        res = run_suite(head_gpu, tuple(args.shapes.split(",")), "cuda", conc, cmd,
                        prompt_len=args.prompt_len, max_latent=args.max_latent,
                        answer_len=args.answer_len, ref_requests=args.ref_requests,
                        bare_baseline=not args.no_bare, step_rounds=args.step_rounds)
    write_json(args.out, res)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
