"""``latentserve train cot|colar|colar-grpo``: CoLaR's stages 0 (text CoT, ``train/cot.py``),
1 (compressed latents, ``train/colar.py``) and 3 (GRPO, ``train/colar_grpo.py``); their
options are ``train/options.py``'s."""

from __future__ import annotations

import json


def register(sub) -> None:
    from latentserve.train.options import (
        ColarGRPOConfig,
        ColarTrainConfig,
        CotConfig,
        add_options,
    )

    p = sub.add_parser("train", help="train reasoning models (CoLaR stage 0: cot, stage 1: "
                                     "colar, stage 3: colar-grpo)")
    stages = p.add_subparsers(dest="stage", required=True)
    for name, cls, run, what in (
            ("cot", CotConfig, run_cot, "fine-tune a backbone on text chains of thought"),
            ("colar", ColarTrainConfig, run_colar, "CoLaR stage 1: LoRA + latent policy on "
             "compressed reasoning (arXiv 2505.16552)"),
            ("colar-grpo", ColarGRPOConfig, run_colar_grpo, "CoLaR stage 3: GRPO on a "
             "stage-1 model, rollouts through the engine (arXiv 2505.16552)")):
        add_options(stages.add_parser(name, help=what), cls).set_defaults(func=run)


def run_cot(args) -> int:
    from latentserve.extras import require
    from latentserve.train.options import CotConfig, config_of

    cfg = config_of(CotConfig, args)
    if cfg.lora_r > 0 or cfg.init_adapter:  # LoRA through PEFT
        require("peft", "latentserve train cot (LoRA; --lora-r 0 is a full fine-tune)")
    from latentserve.train.cot import train

    print(json.dumps(train(cfg), indent=1))
    return 0


def run_colar(args) -> int:
    from latentserve.extras import require
    from latentserve.train.options import ColarTrainConfig, config_of

    cfg = config_of(ColarTrainConfig, args)
    if cfg.lora_r > 0 or cfg.init_adapter:  # LoRA through PEFT
        require("peft", "latentserve train colar (LoRA; --lora-r 0 is a full fine-tune)")
    from latentserve.train.colar import train

    print(json.dumps(train(cfg), indent=1))
    return 0


def run_colar_grpo(args) -> int:
    from latentserve.extras import require
    from latentserve.train.options import ColarGRPOConfig, config_of

    cfg = config_of(ColarGRPOConfig, args)
    require("peft", "latentserve train colar-grpo")
    from latentserve.train.colar_grpo import train

    print(json.dumps(train(cfg), indent=1))
    return 0
