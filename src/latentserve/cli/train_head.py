"""``latentserve train-head sft|grpo``: train a compression head on a frozen backbone
(``train/sft.py``, then ``train/grpo.py``); both write a bundle that ``latentserve serve
--latent-head`` loads."""

from __future__ import annotations

import json


def register(sub) -> None:
    from latentserve.train.traces import THINK_CLOSE, THINK_OPEN

    p = sub.add_parser("train-head", help="train a compression head (sft, then grpo)")
    stages = p.add_subparsers(dest="stage", required=True)

    s = stages.add_parser("sft", help="regress the head on teacher-forced GSM8K traces")
    _common(s)
    s.add_argument("--max-reasoning-tokens", type=int, default=256)
    s.add_argument("--style", default="solution", choices=["solution", "equations"],
                   help="reasoning = worked solution text, or only its <<...>> equations")
    s.add_argument("--think-open", default=THINK_OPEN)
    s.add_argument("--think-close", default=THINK_CLOSE)
    s.add_argument("--source-layer", type=int, default=None,
                   help="anchor layer (default: ~80%% depth)")
    s.add_argument("--target-layer", type=int, default=None, help="default: the last layer")
    s.add_argument("--compression-factor", type=int, default=4,
                   help="reasoning tokens per latent step")
    s.add_argument("--latent-dim", type=int, default=128)
    s.add_argument("--mlp-dim", type=int, default=None, help="default: hidden_size // 2")
    s.add_argument("--steps", type=int, default=300)
    s.add_argument("--batch-size", type=int, default=256, help="rows per step")
    s.add_argument("--lr", type=float, default=1e-3)
    s.add_argument("--warmup", type=float, default=0.05, help="fraction of steps")
    s.add_argument("--weight-decay", type=float, default=0.01)
    s.add_argument("--beta", type=float, default=0.01, help="entropy weight")
    s.add_argument("--capture-batch-size", type=int, default=8)
    s.add_argument("--save-every", type=int, default=0, help="checkpoint every N steps")
    s.set_defaults(func=run_sft)

    g = stages.add_parser("grpo", help="GRPO of an SFT head through the engine's closed loop")
    _common(g)
    g.add_argument("--bundle", required=True, help="the SFT bundle to start from")
    g.add_argument("--steps", type=int, default=10)
    g.add_argument("--questions-per-step", type=int, default=8)
    g.add_argument("--group-size", type=int, default=8, help="rollouts per question")
    g.add_argument("--lr", type=float, default=1e-4)
    g.add_argument("--kl-coef", type=float, default=0.05)
    g.add_argument("--sigma", type=float, default=0.3, help="exploration std of z")
    g.add_argument("--max-latent", type=int, default=32)
    g.add_argument("--min-latent", type=int, default=1)
    g.add_argument("--stop-threshold", type=float, default=0.5)
    g.add_argument("--answer-tokens", type=int, default=16)
    g.add_argument("--close-bonus", type=float, default=0.1)
    g.add_argument("--max-num-seqs", type=int, default=256)
    g.add_argument("--enforce-eager", action="store_true")
    g.add_argument("--save-every", type=int, default=0,
                   help="also write the bundle every N steps (0: at the end only)")
    g.set_defaults(func=run_grpo)


def _common(p) -> None:
    p.add_argument("--model", default=None, help="backbone (default: embedded SmolLM2)")
    p.add_argument("--data", default=None,
                   help="GSM8K-format jsonl (default: $LATENTSERVE_DATA/gsm8k/train.jsonl)")
    p.add_argument("--max-examples", type=int, default=None)
    p.add_argument("--out", required=True, help="bundle to write (.safetensors or .pt)")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-progress", action="store_true")


def _options(args, skip=("command", "stage", "func", "no_progress")) -> dict:
    d = {k: v for k, v in vars(args).items() if k not in skip}
    d["progress"] = not args.no_progress
    return d


def run_sft(args) -> int:
    from latentserve.train.sft import SFTConfig, train_sft

    log = train_sft(SFTConfig(**_options(args)))
    print(json.dumps({"bundle": args.out, "traces": log["traces"],
                      "loss_before": log["loss_before"], "loss_after": log["loss_after"],
                      "seconds": log["seconds"]}, indent=1))
    return 0


def run_grpo(args) -> int:
    from latentserve.train.grpo import GRPOConfig, train_grpo

    log = train_grpo(GRPOConfig(**_options(args)))
    h = log["history"]
    print(json.dumps({"bundle": args.out, "first": h[0], "last": h[-1],
                      "seconds": log["seconds"]}, indent=1))
    return 0
