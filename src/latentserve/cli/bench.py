"""``latentserve bench``: ``--suite offline|gpu|latent|loop|families`` (``bench/``), and
``bench serve``: TTFT/TPOT/ITL/throughput against a running server. Seconds, tokens/s."""

from __future__ import annotations

import json
import shlex
import sys
from pathlib import Path


def register(sub) -> None:
    from latentserve.options import comma_list, ranged

    p = sub.add_parser("bench", help="benchmarks (offline, gpu, latent, loop, families)")
    p.add_argument("--model",
                   help="HF-style model directory or .gguf file (default: embedded SmolLM2)")
    p.add_argument("--num-prompts", type=ranged(int, "num_prompts", ge=1), default=32,
                   help="prompts in the timed run (GSM8K questions; default 32)")
    p.add_argument("--output-len", type=ranged(int, "output_len", ge=1), default=64,
                   help="generated tokens per prompt, exact (default 64)")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--no-hf-baseline", action="store_true",
                   help="skip the Hugging Face generate baseline")
    p.add_argument("--json-out", metavar="PATH", help="write the full result as JSON to PATH")
    p.add_argument("--seed", type=int, default=0, help="engine seed (default 0)")
    p.add_argument("--suite", default="offline",
                   choices=["offline", "gpu", "latent", "loop", "families"],
                   help="offline: the engine against HF on GSM8K prompts (CPU or GPU); gpu: "
                        "decode steps against the bandwidth floor (CUDA); latent: latent "
                        "against plain steps; loop: looped-block passes; families: every "
                        "family's suite and one table (CUDA; docs/benchmarks.md)")
    p.add_argument("--concurrency", type=comma_list(ranged(int, "concurrency", ge=1)),
                   help="comma-separated concurrent requests (gpu, latent, loop suites)")
    p.add_argument("--families",
                   help="comma-separated families of --suite families (default: plain, "
                        "feedback, head, recurrent, loop, trained: the models/ of the "
                        "checkout)")
    p.set_defaults(func=run)
    from latentserve.bench.serve import add_serve_bench_args, serve_bench_main

    sub_bench = p.add_subparsers(dest="bench_command")
    s = sub_bench.add_parser("serve", help="load a running server like `vllm bench serve`")
    add_serve_bench_args(s)
    s.set_defaults(func=serve_bench_main)


def format_table(result: dict) -> str:
    """A ``run_offline_bench`` result: its setting, a Markdown table, the speedup and
    whether greedy tokens agree."""
    from latentserve.bench.families import table_markdown

    cols = ("run", "wall s", "out tok/s", "total tok/s")
    rows = [dict(zip(cols, (name, r["wall_s"], r["output_tok_per_s"], r["total_tok_per_s"])))
            for name, key in (("latentserve", "engine"), ("HF generate (bs=1)", "hf"))
            if (r := result.get(key))]
    lines = [f"{result['num_prompts']} prompts x {result['output_len']} output tokens, "
             f"{result['device']} {result['dtype']}, prompt len mean "
             f"{result['prompt_len_mean']} tokens", table_markdown(rows, cols).rstrip()]
    if result.get("speedup") is not None:
        lines.append(f"speedup (output tok/s): {result['speedup']:.2f}x")
    if result.get("greedy_agree") is not None:
        lines.append("greedy tokens of the first 4 prompts agree with HF: "
                     f"{'yes' if result['greedy_agree'] else 'NO'}")
    return "\n".join(lines)


def run(args) -> int:
    """Run ``--suite``; print its table (offline, families) or its JSON, and write
    ``--json-out`` if given. Returns the exit status (0)."""
    from latentserve.bench.suite import run_suite
    from latentserve.extras import require

    conc = args.concurrency
    cuda, table, command = args.device == "cuda", None, shlex.join(["latentserve", *sys.argv[1:]])
    if conc is not None and args.suite == "offline":
        raise ValueError("--concurrency sets the gpu, latent, loop and families suites; "
                         "--suite offline runs --num-prompts at once")
    if args.families is not None and args.suite != "families":
        raise ValueError(f"--families needs --suite families, got --suite {args.suite}")
    if args.families is not None:
        from latentserve.bench.families import SUITES

        if unknown := [f for f in args.families.split(",") if f not in SUITES]:
            raise ValueError(f"--families: unknown family {unknown[0]!r}; the families are "
                             f"{', '.join(SUITES)}")
    if args.suite in ("gpu", "families"):
        import torch

        if not torch.cuda.is_available():
            raise ValueError(f"--suite {args.suite} runs on CUDA, and torch sees no CUDA "
                             "device here")
    elif cuda:
        from latentserve.config import check_device

        check_device("cuda")
    if args.suite == "offline":
        from latentserve.bench.offline import run_offline_bench

        result = run_offline_bench(model=args.model, num_prompts=args.num_prompts,
                                   output_len=args.output_len, device=args.device,
                                   dtype=args.dtype, hf_baseline=not args.no_hf_baseline,
                                   seed=args.seed, command=command)
        table = format_table(result)
    elif args.suite == "families":
        from latentserve.bench.families import SUITES, run_families_bench, table_markdown

        families = args.families.split(",") if args.families else tuple(SUITES)
        result = run_families_bench(conc or (1, 16, 64), families, command=command)
        table = table_markdown(result["table"])
    elif args.suite == "gpu":
        from latentserve.bench import gpu

        result = run_suite(gpu, tuple(gpu.SHAPES), "cuda", conc or (1, 16, 64), command,
                           hf_baseline=not args.no_hf_baseline)
    elif args.suite == "loop":
        require("peft", "bench --suite loop (it builds a PCCoT checkpoint)")
        from latentserve.bench import loop

        result = run_suite(loop, ("pccot-gpt2-124m",), args.device,
                           conc or ((1, 16, 64) if cuda else (1, 8)), command)
    else:
        if cuda:
            require("peft", "bench --suite latent on cuda (it builds a CODI checkpoint)")
        from latentserve.bench import latent

        result = run_suite(
            latent, ("coconut-gpt2-124m", "codi-llama-3.2-1b") if cuda else ("coconut-gpt2-124m",),
            args.device, conc or ((1, 16, 64) if cuda else (32,)), command)
    text = json.dumps(result, indent=1)
    if table is not None:
        print(table)
    elif not args.json_out:
        print(text)
    if args.json_out:
        Path(args.json_out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json_out).write_text(text + "\n")
        print(f"wrote {args.json_out}")
    return 0
