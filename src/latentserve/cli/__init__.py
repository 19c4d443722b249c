"""The ``latentserve`` command: serve, generate, demo, bench, convert, train-head, eval."""

from __future__ import annotations

import argparse
import os
import sys


def add_engine_args(p: argparse.ArgumentParser, several_models: bool = False) -> None:
    """Flags that build an ``EngineConfig`` (shared by serve, generate and demo);
    ``several_models``: ``--model`` may be repeated (``args.model`` is then a list or None,
    see :func:`engine_configs`)."""
    if several_models:
        p.add_argument("--model", action="append", default=None,
                       help="HF-style model directory or .gguf file (default: embedded "
                            "SmolLM2); repeat to serve several models, one engine each, "
                            "each under its own name")
    else:
        p.add_argument("--model", default=None,
                       help="HF-style model directory or .gguf file (default: embedded "
                            "SmolLM2)")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--max-model-len", type=int, default=None,
                   help="prompt + output tokens per request (default: the model's limit)")
    p.add_argument("--max-num-seqs", type=int, default=64, help="requests running at once")
    p.add_argument("--kv-slots", type=int, default=None, help="KV pool size in tokens")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048,
                   help="tokens per forward (prefill chunk budget)")
    p.add_argument("--no-prefix-caching", action="store_true", help="disable the radix cache")
    p.add_argument("--attention-backend", default="auto", choices=["auto", "torch", "triton"],
                   help="auto: triton on cuda, torch on cpu")
    p.add_argument("--attention-num-kv-splits", type=int, default=8,
                   help="Triton decode attention: the most splits of each request's keys; a "
                        "batch that fills the GPU's SMs takes fewer (1: no merge kernel)")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                   help="fraction of GPU memory for weights, KV pool and graphs")
    p.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    overlap = p.add_mutually_exclusive_group()
    overlap.add_argument("--overlap-schedule", dest="overlap_schedule", action="store_const",
                         const=True, default=None,
                         help="schedule and prepare the next step while the device runs this "
                              "one (default on CUDA; plain models; steps with logprobs or "
                              "penalties run synchronously)")
    overlap.add_argument("--disable-overlap-schedule", dest="overlap_schedule",
                         action="store_const", const=False,
                         help="step synchronously even on CUDA")
    p.add_argument("--tensor-parallel-size", "--tp", type=int, default=1,
                   help="split the model across this many processes (one GPU each on CUDA)")
    p.add_argument("--latent-head", default=None,
                   help="compression-head bundle (default: env LATENTSERVE_LATENT_HEAD, else "
                        "latent_reasoning_head.safetensors in the model directory)")
    p.add_argument("--no-latent-head", action="store_true",
                   help="serve the bare backbone even when a head bundle is found")
    p.add_argument("--latent-injection", default=None, choices=["closed_loop", "prompt"],
                   help="override the head bundle's injection mode")
    p.add_argument("--max-latent-budget", "--max-recurrence", type=int, default=None,
                   dest="max_latent_budget",
                   help="cap on a request's latent_budget: latent steps (COCONUT, CODI), "
                        "recurrences per token (Huginn, Ouro) or block passes (PCCoT, LOTUS); "
                        "default: the model's own cap; with several --model, each latent "
                        "model is capped within its own range and the others ignore it")
    p.add_argument("--upstream-stop-rules", action="store_true",
                   help="requests that do not say (upstream_stop_rules) end on EOS as the "
                        "family's upstream code does (COCONUT, PCCoT: an EOS as the first "
                        "answer token is kept and decoding goes on), to reproduce upstream "
                        "numbers exactly; default off: the first EOS ends a request, as in "
                        "vLLM; refused for other families (with several --model, they ignore it)")
    p.add_argument("--exit-semantics", default="engine", choices=["engine", "upstream"],
                   help="requests that do not say (exit_semantics) use this Huginn adaptive "
                        "exit: 'engine' (default: the prompt runs full depth, an exited "
                        "token's K/V fills its skipped steps) or 'upstream' (upstream's "
                        "defaults: the prompt may exit as one block, skipped steps are "
                        "dropped from attention; needs the torch attention backend); "
                        "models without Huginn's exit ignore it")
    p.add_argument("--generation-config", default="auto", metavar="auto|vllm|DIR",
                   help="sampling defaults for the fields a request leaves unset (vLLM's "
                        "flag): 'auto' (default: the model's generation_config.json), 'vllm' "
                        "(none) or a folder holding a generation_config.json")


def engine_configs(args: argparse.Namespace) -> list:
    """One ``EngineConfig`` per ``--model`` (repeatable, see ``add_engine_args``), all with
    the same engine flags; none given: the embedded default model."""
    import dataclasses

    models = args.model if isinstance(args.model, list) else [args.model]
    base = engine_config(args, model=None)
    # Several models: --max-latent-budget caps each latent model within its own range and is
    # ignored by the others (a plain model beside COCONUT ones); so is --upstream-stop-rules.
    several = len(models) > 1
    return [dataclasses.replace(base, model=m, latent_cap_where_applicable=several)
            for m in models]


def engine_config(args: argparse.Namespace, model: str | None | list = ...):
    """The ``EngineConfig`` of the flags (``model``: instead of ``args.model``)."""
    from latentserve.config import EngineConfig

    if model is ...:
        model = args.model
    if isinstance(model, list):
        if len(model) != 1:
            raise ValueError("this command takes one --model")
        model = model[0]
    return EngineConfig(model=model, device=args.device, dtype=args.dtype,
                        max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
                        kv_slots=args.kv_slots,
                        max_num_batched_tokens=args.max_num_batched_tokens,
                        enable_prefix_caching=not args.no_prefix_caching,
                        attention_backend=args.attention_backend,
                        attention_num_kv_splits=getattr(args, "attention_num_kv_splits", 8),
                        gpu_memory_utilization=args.gpu_memory_utilization,
                        enforce_eager=args.enforce_eager,
                        overlap_schedule=getattr(args, "overlap_schedule", None),
                        tensor_parallel_size=getattr(args, "tensor_parallel_size", 1),
                        latent_head=getattr(args, "latent_head", None),
                        no_latent_head=getattr(args, "no_latent_head", False),
                        latent_injection=getattr(args, "latent_injection", None),
                        max_latent_budget=getattr(args, "max_latent_budget", None),
                        upstream_stop_rules=getattr(args, "upstream_stop_rules", False),
                        exit_semantics=getattr(args, "exit_semantics", "engine"),
                        generation_config=getattr(args, "generation_config", "auto"))


def build_parser() -> argparse.ArgumentParser:
    from latentserve.cli import (
        bench,
        convert,
        data,
        demo,
        eval,
        generate,
        serve,
        train,
        train_head,
    )
    from latentserve import __version__

    parser = argparse.ArgumentParser(prog="latentserve",
                                     description="Serve latent-reasoning language models.")
    parser.add_argument("--version", action="version", version=f"latentserve {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    for mod in (serve, generate, demo, bench):
        mod.register(sub)
    convert.register(sub)
    train_head.register(sub)
    train.register(sub)
    data.register(sub)
    eval.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never reach for the hub at run time
    # OpenMP threads that spin while waiting stall every op when another job holds a core
    # (measured: 2.7 s vs 0.29 s per CPU decode step under load). Set before torch loads.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    args = build_parser().parse_args(argv)
    try:
        return args.func(args) or 0
    except KeyboardInterrupt:
        return 130
    except Exception as e:  # noqa: BLE001 - one line for users; LATENTSERVE_DEBUG=1 for the trace
        if os.environ.get("LATENTSERVE_DEBUG"):
            raise
        kind = "" if isinstance(e, (ValueError, FileNotFoundError)) else f"{type(e).__name__}: "
        message = " ".join(str(e).split())  # one line, even for a multi-line message
        print(f"latentserve: error: {kind}{message}", file=sys.stderr)
        return 2
