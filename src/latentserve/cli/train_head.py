"""``latentserve train-head sft|dagger|grpo``: train a compression head on a frozen backbone
(``train/sft.py``, ``train/dagger.py``, then ``train/grpo.py``); each writes a bundle that
``latentserve serve --latent-head`` loads. Their options are ``train/options.py``'s."""

from __future__ import annotations

import json


def register(sub) -> None:
    from latentserve.train.options import DaggerConfig, GRPOConfig, SFTConfig, add_options

    p = sub.add_parser("train-head", help="train a compression head (sft, dagger, grpo)")
    stages = p.add_subparsers(dest="stage", required=True)
    for name, cls, run, what in (
            ("sft", SFTConfig, run_sft, "regress the head on teacher-forced traces"),
            ("dagger", DaggerConfig, run_dagger, "DAgger rounds: retrain an SFT head on the "
             "anchors of its own closed-loop rollouts, labelled by the gold trace"),
            ("grpo", GRPOConfig, run_grpo, "GRPO of an SFT head through the engine's closed "
             "loop")):
        add_options(stages.add_parser(name, help=what), cls).set_defaults(func=run)


def _config(cls, args):
    """The stage's config from ``args``, once its training data is found (before the
    backbone loads). Raises FileNotFoundError naming the file and where to get it."""
    from latentserve.train.options import config_of
    from latentserve.train.traces import train_file

    data = train_file(args.data)
    if not data.is_file():
        raise FileNotFoundError(f"--data {data} does not exist")
    return config_of(cls, args)


def run_sft(args) -> int:
    from latentserve.train.options import SFTConfig

    cfg = _config(SFTConfig, args)  # a missing --data fails before torch loads
    from latentserve.train.sft import train_sft

    log = train_sft(cfg)
    print(json.dumps({"bundle": args.out, "traces": log["traces"],
                      "loss_before": log["loss_before"], "loss_after": log["loss_after"],
                      "seconds": log["seconds"]}, indent=1))
    return 0


def run_dagger(args) -> int:
    from latentserve.train.options import DaggerConfig

    cfg = _config(DaggerConfig, args)  # a missing --data fails before torch loads
    from latentserve.train.dagger import train_dagger

    log = train_dagger(cfg)
    print(json.dumps({"bundle": args.out, "traces": log["traces"],
                      "rounds": [{k: h[k] for k in ("round", "rows", "closed_loop")}
                                 for h in log["history"]],
                      "seconds": log["seconds"]}, indent=1))
    return 0


def run_grpo(args) -> int:
    from latentserve.train.options import GRPOConfig

    cfg = _config(GRPOConfig, args)  # a missing --data fails before torch loads
    from latentserve.train.grpo import train_grpo

    log = train_grpo(cfg)
    h = log["history"]
    print(json.dumps({"bundle": args.out, "first": h[0], "last": h[-1],
                      "seconds": log["seconds"]}, indent=1))
    return 0
