"""``latentserve bench``: ``--suite offline|gpu|latent|loop|families`` (``bench/``), and
``bench serve``: TTFT/TPOT/ITL/throughput against a running server."""

from __future__ import annotations

import json
from pathlib import Path


def register(sub) -> None:
    from latentserve.bench.cli import add_bench_args

    p = sub.add_parser("bench", help="benchmarks (offline, gpu, latent, loop, families)")
    add_bench_args(p)
    p.add_argument("--suite", default="offline",
                   choices=["offline", "gpu", "latent", "loop", "families"],
                   help="offline: the engine against HF on GSM8K prompts (CPU or GPU); gpu: "
                        "decode steps against the bandwidth floor (CUDA); latent: latent "
                        "against plain steps; loop: looped-block passes; families: every "
                        "family's suite and one table (CUDA; docs/benchmarks.md)")
    p.add_argument("--concurrency", default=None,
                   help="comma-separated concurrent requests (gpu, latent, loop suites)")
    p.add_argument("--families", default=None,
                   help="comma-separated families of --suite families (default: plain, "
                        "feedback, head, recurrent, loop)")
    p.set_defaults(func=run)
    from latentserve.bench.serve import add_serve_bench_args, serve_bench_main

    sub_bench = p.add_subparsers(dest="bench_command")
    s = sub_bench.add_parser("serve", help="load a running server like `vllm bench serve`")
    add_serve_bench_args(s)
    s.set_defaults(func=serve_bench_main)


def run(args) -> int:
    if args.suite == "offline":
        from latentserve.bench.cli import bench_main

        return bench_main(args) or 0
    conc = tuple(int(c) for c in args.concurrency.split(",")) if args.concurrency else None
    if args.suite == "gpu":
        from latentserve.bench.gpu import run_gpu_bench

        result = run_gpu_bench(concurrency=conc or (1, 16, 64),
                               hf_baseline=not args.no_hf_baseline)
    elif args.suite == "families":
        import sys

        from latentserve.bench.families import run_families_bench, table_markdown

        families = args.families.split(",") if args.families else \
            ("plain", "feedback", "head", "recurrent", "loop")
        result = run_families_bench(conc or (1, 16, 64), families,
                                    command="latentserve " + " ".join(sys.argv[1:]))
        print(table_markdown(result["table"]))
    elif args.suite == "loop":
        from latentserve.bench.loop import run_loop_bench
        from latentserve.extras import require

        require("peft", "bench --suite loop (it builds a PCCoT checkpoint)")

        cuda = args.device == "cuda"
        result = run_loop_bench(args.device, conc or ((1, 16, 64) if cuda else (1, 8)))
    else:
        from latentserve.bench.latent import run_latent_bench

        cuda = args.device == "cuda"
        if cuda:
            from latentserve.extras import require

            require("peft", "bench --suite latent on cuda (it builds a CODI checkpoint)")
        result = run_latent_bench(args.device, conc or ((1, 16, 64) if cuda else (32,)),
                                  codi=cuda)
    text = json.dumps(result, indent=1)
    if args.json_out:
        Path(args.json_out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json_out).write_text(text)
    else:
        print(text)
    return 0
