"""``latentserve train cot|colar|colar-grpo`` (CoLaR's stages 0, 1 and 3: ``train/cot.py``,
``train/colar.py``, ``train/colar_grpo.py``) and ``latentserve train-head sft|dagger|grpo``
(a compression head on a frozen backbone: ``train/sft.py``, ``dagger.py``, ``grpo.py``; each
writes a bundle ``serve --latent-head`` loads). Options: ``train/options.py``."""

from __future__ import annotations

import importlib
import json

# stage -> (options class in train/options.py, module in train/ with its ``train``, help)
STAGES = {
    "cot": ("CotConfig", "cot", "fine-tune a backbone on text chains of thought"),
    "colar": ("ColarTrainConfig", "colar", "CoLaR stage 1: LoRA + latent policy on compressed "
              "reasoning (arXiv 2505.16552)"),
    "colar-grpo": ("ColarGRPOConfig", "colar_grpo", "CoLaR stage 3: GRPO on a stage-1 model, "
                   "rollouts through the engine (arXiv 2505.16552)"),
}
# stage -> (options class, help); the trainer is train/<stage>.py's train_<stage>
HEAD_STAGES = {
    "sft": ("SFTConfig", "regress the head on teacher-forced traces"),
    "dagger": ("DaggerConfig", "DAgger rounds: retrain an SFT head on the anchors of its own "
               "closed-loop rollouts, labelled by the gold trace"),
    "grpo": ("GRPOConfig", "GRPO of an SFT head through the engine's closed loop"),
}


def register(sub) -> None:
    from latentserve.options import add_options
    from latentserve.train import options

    for name, what, stages, run in (
            ("train", "train reasoning models (CoLaR stage 0: cot, stage 1: colar, stage 3: "
             "colar-grpo)", STAGES, run_train),
            ("train-head", "train a compression head (sft, dagger, grpo)", HEAD_STAGES,
             run_train_head)):
        p = sub.add_parser(name, help=what)
        parsers = p.add_subparsers(dest="stage", required=True)
        for stage, (cls, *_, text) in stages.items():
            add_options(parsers.add_parser(stage, help=text), getattr(options, cls))
        p.set_defaults(func=run)


def run_train(args) -> int:
    """Check the stage's options and that PEFT is there when it is needed (a LoRA: all but a
    full fine-tune), then train; prints the last log record."""
    from latentserve.config import check_device
    from latentserve.extras import require
    from latentserve.options import options_of
    from latentserve.train import options

    cls, module, _ = STAGES[args.stage]
    cfg = options_of(getattr(options, cls), args)
    check_device(cfg.device)  # before any load
    if not hasattr(cfg, "lora_r"):
        require("peft", f"latentserve train {args.stage}")
    elif cfg.init_adapter or options.fresh_lora(cfg):  # LoRA through PEFT
        require("peft", f"latentserve train {args.stage} (LoRA; --lora-r 0 is a full fine-tune)")
    train = importlib.import_module(f"latentserve.train.{module}").train
    print(json.dumps(train(cfg), indent=1))
    return 0


def run_train_head(args) -> int:
    """Find the training data (a missing ``--data`` fails before torch loads: FileNotFoundError
    naming the file and where to get it), train, print a summary of the log."""
    from latentserve.config import check_device
    from latentserve.options import options_of
    from latentserve.train import options
    from latentserve.train.traces import train_file

    data = train_file(args.data)
    if not data.is_file():
        raise FileNotFoundError(f"--data {data} does not exist")
    cfg = options_of(getattr(options, HEAD_STAGES[args.stage][0]), args)
    check_device(cfg.device)
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
