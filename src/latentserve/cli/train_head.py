"""``latentserve train-head sft|dagger|grpo``: train a compression head on a frozen backbone
(``train/sft.py``, ``train/dagger.py``, then ``train/grpo.py``); each writes a bundle that
``latentserve serve --latent-head`` loads. Their options are ``train/options.py``'s."""

from __future__ import annotations

import json

# stage -> (options class in train/options.py, help); the trainer is train/<stage>.py's
# train_<stage>
STAGES = {
    "sft": ("SFTConfig", "regress the head on teacher-forced traces"),
    "dagger": ("DaggerConfig", "DAgger rounds: retrain an SFT head on the anchors of its own "
               "closed-loop rollouts, labelled by the gold trace"),
    "grpo": ("GRPOConfig", "GRPO of an SFT head through the engine's closed loop"),
}


def register(sub) -> None:
    from latentserve.train import options

    p = sub.add_parser("train-head", help="train a compression head (sft, dagger, grpo)")
    stages = p.add_subparsers(dest="stage", required=True)
    for stage, (cls, what) in STAGES.items():
        options.add_options(stages.add_parser(stage, help=what), getattr(options, cls))
    p.set_defaults(func=run)


def run(args) -> int:
    """Find the training data (a missing ``--data`` fails before torch loads: FileNotFoundError
    naming the file and where to get it), train, print a summary of the log."""
    import importlib

    from latentserve.train import options
    from latentserve.train.traces import train_file

    data = train_file(args.data)
    if not data.is_file():
        raise FileNotFoundError(f"--data {data} does not exist")
    cfg = options.config_of(getattr(options, STAGES[args.stage][0]), args)
    module = importlib.import_module(f"latentserve.train.{args.stage}")
    log = getattr(module, f"train_{args.stage}")(cfg)
    summary = {"bundle": args.out}
    if args.stage == "sft":
        summary |= {k: log[k] for k in ("traces", "loss_before", "loss_after")}
    elif args.stage == "dagger":
        summary |= {"traces": log["traces"], "rounds": [
            {k: h[k] for k in ("round", "rows", "closed_loop")} for h in log["history"]]}
    else:
        summary |= {"first": log["history"][0], "last": log["history"][-1]}
    print(json.dumps({**summary, "seconds": log["seconds"]}, indent=1))
    return 0
