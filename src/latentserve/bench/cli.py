"""``latentserve bench``: the offline throughput benchmark from the command line (seconds,
tokens per second)."""

from __future__ import annotations

import argparse
import json
import shlex
from pathlib import Path


def add_bench_args(parser: argparse.ArgumentParser) -> None:
    """Add --model, --num-prompts, --output-len, --device, --dtype, --no-hf-baseline,
    --json-out and --seed to ``parser``."""
    parser.add_argument("--model", default=None,
                        help="HF-style model directory or .gguf file (default: embedded SmolLM2)")
    parser.add_argument("--num-prompts", type=int, default=32,
                        help="prompts in the timed run (GSM8K questions; default 32)")
    parser.add_argument("--output-len", type=int, default=64,
                        help="generated tokens per prompt, exact (default 64)")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--no-hf-baseline", action="store_true",
                        help="skip the Hugging Face generate baseline")
    parser.add_argument("--json-out", default=None, metavar="PATH",
                        help="write the full result as JSON to PATH")
    parser.add_argument("--seed", type=int, default=0, help="engine seed (default 0)")


def command_line(args: argparse.Namespace) -> str:
    """The ``latentserve bench ...`` command equivalent to ``args`` (defaults left out, except
    --num-prompts and --output-len, which are always written)."""
    parts = ["latentserve", "bench"]
    if args.model is not None:
        parts += ["--model", str(args.model)]
    parts += ["--num-prompts", str(args.num_prompts), "--output-len", str(args.output_len)]
    if args.device != "cpu":
        parts += ["--device", args.device]
    if args.dtype != "float32":
        parts += ["--dtype", args.dtype]
    if args.no_hf_baseline:
        parts.append("--no-hf-baseline")
    if getattr(args, "seed", 0):
        parts += ["--seed", str(args.seed)]
    if args.json_out:
        parts += ["--json-out", str(args.json_out)]
    return shlex.join(parts)


def format_table(result: dict) -> str:
    """A small plain-text table of a ``run_offline_bench`` result."""
    rows = [("", "wall s", "out tok/s", "total tok/s")]
    for name, key in (("latentserve", "engine"), ("HF generate (bs=1)", "hf")):
        r = result.get(key)
        if r:
            rows.append((name, f"{r['wall_s']:.2f}", f"{r['output_tok_per_s']:.1f}",
                         f"{r['total_tok_per_s']:.1f}"))
    widths = [max(len(row[i]) for row in rows) for i in range(4)]
    lines = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w)
                       for i, (c, w) in enumerate(zip(row, widths))) for row in rows]
    lines.insert(1, "-" * len(lines[0]))
    head = (f"{result['num_prompts']} prompts x {result['output_len']} output tokens, "
            f"{result['device']} {result['dtype']}, prompt len mean "
            f"{result['prompt_len_mean']} tokens")
    tail = []
    if result.get("speedup") is not None:
        tail.append(f"speedup (output tok/s): {result['speedup']:.2f}x")
    if result.get("greedy_agree") is not None:
        tail.append("greedy tokens of the first 4 prompts agree with HF: "
                    f"{'yes' if result['greedy_agree'] else 'NO'}")
    return "\n".join([head, *lines, *tail])


def bench_main(args: argparse.Namespace) -> int:
    """Run the benchmark described by ``args`` (from ``add_bench_args``); print the table,
    write ``--json-out`` if given. Returns the exit status (0)."""
    from latentserve.bench.offline import run_offline_bench

    result = run_offline_bench(model=args.model, num_prompts=args.num_prompts,
                               output_len=args.output_len, device=args.device,
                               dtype=args.dtype, hf_baseline=not args.no_hf_baseline,
                               seed=getattr(args, "seed", 0), command=command_line(args))
    print(format_table(result))
    if args.json_out:
        path = Path(args.json_out)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
        print(f"wrote {path}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Stand-alone entry (``python -m latentserve.bench.cli``), same flags as ``latentserve
    bench``."""
    import os

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    parser = argparse.ArgumentParser(prog="latentserve bench",
                                     description="offline throughput against HF transformers")
    add_bench_args(parser)
    return bench_main(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
