"""Recurrent-depth benchmark for the H200 (issue 7): Huginn-0125 and Ouro-1.4B shapes with
random bf16 weights through ``LLMEngine`` (CUDA graphs on; the masked recurrence loop inside
the captured decode graph) at 1, 16 and 64 concurrent requests against the eager reference
(``bench.baseline.recurrent_reference``: upstream's algorithm with its per-position dict KV cache)
run one request at a time in the same process, and the decode step against its
memory-bandwidth floor.

Shapes (``HUGINN_3_5B``, ``OURO_1_4B``; facts from shared/reference/latent-families.md):
Huginn n_embd 5280, 55 heads (head_dim 96, MHA), intermediate 17920, vocab 65536, 2 prelude
+ 4 core + 2 coda layers, block_size 4096, run at 8 and 32 recurrences (one engine:
``mean_recurrence`` 8 and ``max_recurrence`` 32, so graphs are captured at both depths: with
upstream's default of 32 only depth-32 graphs would exist and a depth-8 batch would replay
them masked, at depth-32 cost);
Ouro hidden 2048, 24 layers, 16 heads (head_dim 128, MHA), intermediate 5632, vocab 49152,
untied head, 4 steps (readout ``last``). Weights are drawn on the GPU by
``bench.baseline.recurrent_models`` and saved in bf16; tokenizers are ``save_word_tokenizer``'s.

Work per request: ``prompt_len`` random ids, ``output_len`` greedy tokens with ``ignore_eos``
at a fixed depth, no early exit. Engine throughput: output tokens per second, wall clock
(device synced, prefill included). Reference: each of ``ref_requests`` prompts is run with 1
and with ``ref_output_len`` output tokens; prefill time = the 1-token run, per-token decode
time = the difference / (``ref_output_len`` - 1); one request of ``output_len`` tokens is
extrapolated as prefill + (``output_len`` - 1) x decode (its KV re-stacking grows with the
context, so this slightly favours the reference). Speedup = engine tok/s / reference tok/s.

Bandwidth floor of a decode step of B rows at depth T, mean context n = prompt_len +
output_len / 2 (bytes / the copy bandwidth measured in the same run):
* Huginn weights: prelude + T x (adapter + core block) + coda + ln_f + lm_head (the tied
  65536 x 5280 table, read in full for the logits) + B embedding rows;
  KV: B x n x (P + T x L + C) banks x 2 x kv_heads x head_dim x 2 bytes.
* Ouro weights: T x (24 layers + norm + exit gate) + lm_head + B embedding rows;
  KV: B x n x (T x 24) banks x (2 x kv_heads x head_dim x 2 bytes).
The floor ignores activations, the KV writes and the logits; a ratio near 1 is at the
bandwidth limit.

Run on the H200: ``python -m benchmarks.recurrent_gpu OUT.json`` (``--help`` for the
options; ``--tiny`` runs the whole pipeline on tiny models on the CPU in seconds).
"""

from __future__ import annotations

from benchmarks.common import command, parser, write_json
from latentserve.bench import recurrent_gpu
from latentserve.bench.suite import run_suite

FULL = ("huginn-0125", "ouro-1.4b")


def main(argv=None) -> int:
    p = parser("recurrent_gpu", __doc__)
    p.add_argument("out", nargs="?", default="recurrent_gpu_bench.json",
                   help="JSON output path")
    p.add_argument("--models", default=",".join(FULL), help=f"comma list of {list(FULL)}")
    p.add_argument("--concurrency", default="1,16,64")
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--ref-requests", type=int, default=2)
    p.add_argument("--ref-output-len", type=int, default=8,
                   help="output tokens per timed reference request (>= 2)")
    p.add_argument("--fused-ops", action="store_true",
                   help="the models' Triton fast path: the CUDA default, so a no-op (kept so "
                        "recorded commands still run)")
    p.add_argument("--tiny", action="store_true",
                   help="tiny models on the CPU, float32, small lengths (CI smoke run)")
    args = p.parse_args(argv)
    if args.tiny and args.fused_ops:
        p.error("--fused-ops is for the CUDA run, not --tiny (the kernels need a GPU, or "
                "TRITON_INTERPRET=1 on CPU)")
    cmd = command("recurrent_gpu", argv)
    if args.tiny:
        res = run_suite(recurrent_gpu, ("huginn-tiny", "ouro-tiny"), "cpu", (1, 4), cmd,
                        prompt_len=8, output_len=4, ref_requests=1, ref_output_len=3)
    else:
        res = run_suite(recurrent_gpu, tuple(args.models.split(",")), "cuda",
                        tuple(int(x) for x in args.concurrency.split(",")), cmd,
                        prompt_len=args.prompt_len, output_len=args.output_len,
                        ref_requests=args.ref_requests, ref_output_len=args.ref_output_len)
    write_json(args.out, res)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
