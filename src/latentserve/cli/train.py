"""``latentserve train cot|colar|colar-grpo``: CoLaR's stages 0 (text CoT, ``train/cot.py``),
1 (compressed latents, ``train/colar.py``) and 3 (GRPO, ``train/colar_grpo.py``); their
options are ``train/options.py``'s."""

from __future__ import annotations

import json

# stage -> (options class in train/options.py, module in train/ with its ``train``, help)
STAGES = {
    "cot": ("CotConfig", "cot", "fine-tune a backbone on text chains of thought"),
    "colar": ("ColarTrainConfig", "colar", "CoLaR stage 1: LoRA + latent policy on compressed "
              "reasoning (arXiv 2505.16552)"),
    "colar-grpo": ("ColarGRPOConfig", "colar_grpo", "CoLaR stage 3: GRPO on a stage-1 model, "
                   "rollouts through the engine (arXiv 2505.16552)"),
}


def register(sub) -> None:
    from latentserve.train import options

    p = sub.add_parser("train", help="train reasoning models (CoLaR stage 0: cot, stage 1: "
                                     "colar, stage 3: colar-grpo)")
    stages = p.add_subparsers(dest="stage", required=True)
    for stage, (cls, _, what) in STAGES.items():
        options.add_options(stages.add_parser(stage, help=what), getattr(options, cls))
    p.set_defaults(func=run)


def run(args) -> int:
    """Check the stage's options and that PEFT is there when it is needed (a LoRA: all but a
    full fine-tune), then train; prints the last log record."""
    import importlib

    from latentserve.extras import require
    from latentserve.train import options

    cls, module, _ = STAGES[args.stage]
    cfg = options.config_of(getattr(options, cls), args)
    if not hasattr(cfg, "lora_r"):
        require("peft", f"latentserve train {args.stage}")
    elif cfg.lora_r > 0 or cfg.init_adapter:  # LoRA through PEFT
        require("peft", f"latentserve train {args.stage} (LoRA; --lora-r 0 is a full fine-tune)")
    train = importlib.import_module(f"latentserve.train.{module}").train
    print(json.dumps(train(cfg), indent=1))
    return 0
