"""Feedback-latent benchmark (issue 5): many concurrent COCONUT / CODI requests through the
engine against the eager per-request reference loop
(``latentserve.bench.baseline.latent_reference``, HF transformers with a KV cache: already
faster than upstream COCONUT, which recomputes the whole prefix for every answer token) run
one request at a time, in the same process.

Shapes use random weights: COCONUT on GPT-2 124M (n_embd 768, 12 layers, vocab 50257 + 3) and
CODI on Llama-3.2-1B (GPU only; needs peft to write the upstream checkpoint). Throughput is
answer tokens per second; latent steps are work but not output. Each concurrency also reports
its decode step against that step's bandwidth floor, and the largest one a latent step against
a plain one (``step_cost``; method: docs/internals.md, "latentserve.bench.families").
``only``: a comma list of ``latentserve.bench.latent.MODELS`` names (``coconut-tiny`` and
``codi-tiny`` run on the CPU in seconds).
"""

from __future__ import annotations

from benchmarks.common import command, parser, write_json
from latentserve.bench import latent
from latentserve.bench.suite import run_suite


def main(argv=None) -> int:
    p = parser("latent", __doc__)
    p.add_argument("out", nargs="?", default="latent_bench.json", help="JSON output path")
    p.add_argument("device", nargs="?", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("only", nargs="?", default=None, help="comma list of models to run")
    args = p.parse_args(argv)
    cuda = args.device == "cuda"
    models = ("coconut-gpt2-124m", "codi-llama-3.2-1b") if cuda else ("coconut-gpt2-124m",)
    write_json(args.out, run_suite(latent, tuple(args.only.split(",")) if args.only else models,
                                   args.device, (1, 16, 64) if cuda else (32,),
                                   command("latent", argv)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
