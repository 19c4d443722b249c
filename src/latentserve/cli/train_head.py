"""``latentserve train-head sft|dagger|grpo``: train a compression head on a frozen backbone
(``train/sft.py``, ``train/dagger.py``, then ``train/grpo.py``); each writes a bundle that
``latentserve serve --latent-head`` loads."""

from __future__ import annotations

import json


def register(sub) -> None:
    from latentserve.train.traces import THINK_CLOSE, THINK_OPEN

    p = sub.add_parser("train-head", help="train a compression head (sft, dagger, grpo)")
    stages = p.add_subparsers(dest="stage", required=True)

    s = stages.add_parser("sft", help="regress the head on teacher-forced traces")
    _common(s)
    _traces(s)
    s.add_argument("--think-open", default=None,
                   help=f"chat format: thinking opening text (default {THINK_OPEN!r}); the "
                        "colar format's is empty")
    s.add_argument("--think-close", default=None,
                   help=f"chat format: thinking closing text (default {THINK_CLOSE!r}); the "
                        "colar format's is ###")
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

    d = stages.add_parser("dagger", help="DAgger rounds: retrain an SFT head on the anchors of "
                          "its own closed-loop rollouts, labelled by the gold trace")
    _common(d)
    _traces(d)
    d.add_argument("--bundle", required=True, help="the SFT bundle to start from")
    d.add_argument("--rounds", type=int, default=2)
    d.add_argument("--rollout-examples", type=int, default=None,
                   help="traces rolled out per round, a fresh random subset (default: all)")
    d.add_argument("--overshoot", type=int, default=2,
                   help="latent steps each rollout runs past its gold length (labelled stop)")
    d.add_argument("--sigma", type=float, default=0.0,
                   help="rollout latents z ~ N(mu, sigma^2) (0: greedy, mu)")
    d.add_argument("--steps", type=int, default=300, help="training steps per round")
    d.add_argument("--batch-size", type=int, default=256, help="rows per step")
    d.add_argument("--lr", type=float, default=1e-3)
    d.add_argument("--warmup", type=float, default=0.05, help="fraction of steps")
    d.add_argument("--weight-decay", type=float, default=0.01)
    d.add_argument("--beta", type=float, default=0.01, help="entropy weight")
    d.add_argument("--stop-threshold", type=float, default=0.5,
                   help="for the logged closed-loop stop metrics")
    d.add_argument("--capture-batch-size", type=int, default=8)
    d.add_argument("--max-num-seqs", type=int, default=256)
    d.add_argument("--enforce-eager", action="store_true")
    d.add_argument("--kv-slots", type=int, default=None,
                   help="the rollout engine's KV pool in tokens (default: from memory)")
    d.add_argument("--gpu-memory-utilization", type=float, default=0.5,
                   help="the rollout engine's share of GPU memory (the rows stay on the GPU)")
    d.set_defaults(func=run_dagger)

    g = stages.add_parser("grpo", help="GRPO of an SFT head through the engine's closed loop")
    _common(g)
    g.add_argument("--prompt-format", default="chat", choices=["chat", "colar"],
                   help="as the head was trained (colar: reward = the answer after Answer:)")
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
    g.add_argument("--kv-slots", type=int, default=None,
                   help="the rollout engine's KV pool in tokens (default: from memory)")
    g.add_argument("--save-every", type=int, default=0,
                   help="also write the bundle every N steps (0: at the end only)")
    g.set_defaults(func=run_grpo)


def _common(p) -> None:
    p.add_argument("--model", default=None, help="backbone: a model directory, .gguf or PEFT "
                   "LoRA adapter directory (default: embedded SmolLM2)")
    p.add_argument("--data", default=None,
                   help="GSM8K jsonl; the colar format also takes iCoT lines "
                        "(default: $LATENTSERVE_DATA/gsm8k/train.jsonl, which does not ship "
                        "with the package: docs/training.md, 'Data')")
    p.add_argument("--max-examples", type=int, default=None)
    p.add_argument("--out", required=True, help="bundle to write (.safetensors or .pt)")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-progress", action="store_true")


def _traces(p) -> None:
    p.add_argument("--prompt-format", default="chat", choices=["chat", "colar"],
                   help="chat: chat template + thinking text; colar: CoLaR's prompt ending "
                        "in ###, steps, ###, Answer:{gold} (a `train cot` backbone)")
    p.add_argument("--max-reasoning-tokens", type=int, default=256)
    p.add_argument("--style", default="solution", choices=["solution", "equations"],
                   help="chat format: reasoning = worked solution text, or only its <<...>> "
                        "equations")


def _options(args, skip=("command", "stage", "func", "no_progress")) -> dict:
    """The stage's config fields from ``args``, once its training data is found (before the
    backbone loads). Raises FileNotFoundError naming the file and where to get it."""
    from latentserve.train.traces import train_file

    data = train_file(args.data)
    if not data.is_file():
        raise FileNotFoundError(f"--data {data} does not exist")
    d = {k: v for k, v in vars(args).items() if k not in skip}
    d["progress"] = not args.no_progress
    return d


def run_sft(args) -> int:
    options = _options(args)  # a missing --data fails before torch loads
    from latentserve.train.sft import SFTConfig, train_sft

    log = train_sft(SFTConfig(**options))
    print(json.dumps({"bundle": args.out, "traces": log["traces"],
                      "loss_before": log["loss_before"], "loss_after": log["loss_after"],
                      "seconds": log["seconds"]}, indent=1))
    return 0


def run_dagger(args) -> int:
    options = _options(args)  # a missing --data fails before torch loads
    from latentserve.train.dagger import DaggerConfig, train_dagger

    log = train_dagger(DaggerConfig(**options))
    print(json.dumps({"bundle": args.out, "traces": log["traces"],
                      "rounds": [{k: h[k] for k in ("round", "rows", "closed_loop")}
                                 for h in log["history"]],
                      "seconds": log["seconds"]}, indent=1))
    return 0


def run_grpo(args) -> int:
    options = _options(args)  # a missing --data fails before torch loads
    from latentserve.train.grpo import GRPOConfig, train_grpo

    log = train_grpo(GRPOConfig(**options))
    h = log["history"]
    print(json.dumps({"bundle": args.out, "first": h[0], "last": h[-1],
                      "seconds": log["seconds"]}, indent=1))
    return 0
