"""``latentserve train cot|colar|colar-grpo``: CoLaR's stages 0 (text CoT, ``train/cot.py``),
1 (compressed latents, ``train/colar.py``) and 3 (GRPO, ``train/colar_grpo.py``)."""

from __future__ import annotations

import json


def register(sub) -> None:
    from latentserve.train import LORA_TARGETS

    p = sub.add_parser("train", help="train reasoning models (CoLaR stage 0: cot, stage 1: "
                                     "colar, stage 3: colar-grpo)")
    stages = p.add_subparsers(dest="stage", required=True)
    c = stages.add_parser("cot", help="fine-tune a backbone on text chains of thought")
    c.add_argument("--data", action="append", required=True,
                   help="training file: iCoT text lines or GSM8K jsonl (repeatable)")
    c.add_argument("--eval-data", action="append", default=[],
                   help="file to check greedy accuracy on at the end (repeatable)")
    c.add_argument("--eval-items", type=int, default=200, help="items per --eval-data file")
    c.add_argument("--out", required=True, help="directory to write the adapter into")
    c.add_argument("--model", dest="base", default=None,
                   help="backbone (default: the embedded SmolLM2-135M-Instruct)")
    c.add_argument("--mode", default="cot", choices=["cot", "nocot"],
                   help="nocot: the control that answers without steps")
    c.add_argument("--lora-r", type=int, default=16, help="LoRA rank; 0 = full fine-tune")
    c.add_argument("--lora-alpha", type=float, default=32.0)
    c.add_argument("--lora-targets", default=",".join(LORA_TARGETS),
                   help="comma-separated module names")
    c.add_argument("--init-adapter", default=None, help="continue training this adapter")
    c.add_argument("--steps", type=int, default=2000)
    c.add_argument("--batch-size", type=int, default=128)
    c.add_argument("--lr", type=float, default=1e-3)
    c.add_argument("--warmup", type=int, default=100, help="warmup steps")
    c.add_argument("--weight-decay", type=float, default=0.01)
    c.add_argument("--max-len", type=int, default=512, help="longer examples are dropped")
    c.add_argument("--seed", type=int, default=0)
    c.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    c.add_argument("--max-seconds", type=float, default=0.0,
                   help="stop and save after this long (0: no limit)")
    c.add_argument("--save-every", type=int, default=0, help="also save every N steps")
    c.add_argument("--log-every", type=int, default=50)
    c.set_defaults(func=run_cot)

    k = stages.add_parser("colar", help="CoLaR stage 1: LoRA + latent policy on compressed "
                                        "reasoning (arXiv 2505.16552)")
    k.add_argument("--data", action="append", required=True,
                   help="training file: iCoT text lines or GSM8K jsonl (repeatable)")
    k.add_argument("--out", required=True, help="model directory to write")
    k.add_argument("--model", dest="base", default=None,
                   help="backbone (default: --init-adapter's base, else the embedded "
                        "SmolLM2-135M-Instruct)")
    k.add_argument("--init-adapter", default=None,
                   help="adapter directory to continue training: stage 0 (train cot output), or a "
                        "CoLaR directory (train colar output; its latent policy too)")
    k.add_argument("--lora-r", type=int, default=16,
                   help="rank of a fresh LoRA (without --init-adapter); 0 = full fine-tune")
    k.add_argument("--lora-alpha", type=float, default=32.0)
    k.add_argument("--lora-targets", default=",".join(LORA_TARGETS),
                   help="comma-separated module names of a fresh LoRA")
    k.add_argument("--steps", type=int, default=2000)
    k.add_argument("--batch-size", type=int, default=256)
    k.add_argument("--lr", type=float, default=1e-4)
    k.add_argument("--warmup", type=int, default=100, help="warmup steps")
    k.add_argument("--weight-decay", type=float, default=0.01)
    k.add_argument("--max-len", type=int, default=512,
                   help="examples longer than this uncompressed are dropped")
    k.add_argument("--seed", type=int, default=0)
    k.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    k.add_argument("--max-seconds", type=float, default=0.0,
                   help="stop and save after this long (0: no limit)")
    k.add_argument("--save-every", type=int, default=0, help="also save every N steps")
    k.add_argument("--log-every", type=int, default=50)
    k.add_argument("--max-compression-factor", type=int, default=5,
                   help="each batch's compression factor is drawn from 1..this")
    k.add_argument("--train-factors", default=None,
                   help="comma-separated factors each batch's compression factor is drawn "
                        "from instead, repeats weighting one (e.g. 2,3,4,4); each in "
                        "1..--max-compression-factor")
    k.add_argument("--compression-factor", type=int, default=None,
                   help="default thinking speed written to colar_config.json "
                        "(default: --max-compression-factor)")
    k.add_argument("--embed-loss", default="mse", choices=["mse", "nll"],
                   help="latent loss: mse of a policy sample (upstream default) or nll")
    k.add_argument("--embed-weight", type=float, default=1.0, help="weight of the latent loss")
    k.add_argument("--ce-weight", type=float, default=1.0, help="weight of the CE loss")
    k.add_argument("--intermediate-size", type=int, default=None,
                   help="latent policy width (default: the hidden size)")
    k.add_argument("--embeds-std", type=float, default=None,
                   help="latent scale (default: std of the input-embedding matrix)")
    k.add_argument("--max-latent", type=int, default=64,
                   help="latent-step cap written to colar_config.json")
    k.set_defaults(func=run_colar)

    g = stages.add_parser("colar-grpo", help="CoLaR stage 3: GRPO on a stage-1 model, rollouts "
                                             "through the engine (arXiv 2505.16552)")
    g.add_argument("--model", required=True,
                   help="stage-1 directory (train colar output: LoRA adapter + latent policy)")
    g.add_argument("--data", action="append", required=True,
                   help="training file: iCoT text lines or GSM8K jsonl (repeatable)")
    g.add_argument("--out", required=True, help="model directory to write")
    g.add_argument("--steps", type=int, default=100, help="rollout + update rounds")
    g.add_argument("--questions-per-step", type=int, default=8)
    g.add_argument("--group-size", type=int, default=8, help="rollouts per question (upstream 8)")
    g.add_argument("--exp-batch-size", type=int, default=8,
                   help="rollouts per optimiser step (upstream 8)")
    g.add_argument("--lr", type=float, default=1e-6, help="AdamW learning rate (upstream RL 1e-6)")
    g.add_argument("--weight-decay", type=float, default=0.01)
    g.add_argument("--clip-eps", type=float, default=0.2, help="PPO ratio clip (upstream 0.2)")
    g.add_argument("--loss-average", default="sum", choices=["sum", "mean"],
                   help="per sequence: sum / 32 (upstream colar.yaml) or the mean over tokens")
    g.add_argument("--max-log-ratio", type=float, default=None,
                   help="clamp logp - logp_old to [-M, M] before exp (default: no clamp, "
                        "upstream); keeps the ratios of a near-deterministic latent policy "
                        "finite after an update (train/colar_grpo.py)")
    g.add_argument("--tempered-logprobs", action="store_true",
                   help="latent log-probs at --latent-temperature, the density the latents "
                        "were drawn from (default: at 1, upstream get_logprobs)")
    g.add_argument("--no-latent-loss", dest="use_latent_loss", action="store_false",
                   help="leave the latent log-probs out of the loss")
    g.add_argument("--no-answer-loss", dest="use_answer_loss", action="store_false",
                   help="leave the answer log-probs out of the loss")
    g.add_argument("--punish-latent-length", action="store_true",
                   help="divide each reward by its latent count (upstream option)")
    g.add_argument("--length-penalty", type=float, default=0.0,
                   help="subtract this x latent steps / max latent from each reward")
    g.add_argument("--latent-temperature", type=float, default=1.0,
                   help="latent policy temperature of the rollouts (> 0; upstream 1)")
    g.add_argument("--answer-temperature", type=float, default=1.0,
                   help="sampling temperature of the stop token and the answer (upstream 1)")
    g.add_argument("--answer-top-p", type=float, default=0.9, help="answer top-p (upstream 0.9)")
    g.add_argument("--answer-tokens", type=int, default=16,
                   help="answer tokens per rollout (upstream max_new_tokens 16)")
    g.add_argument("--compression-factor", type=int, default=None,
                   help="thinking speed of the rollouts (default: the model's)")
    g.add_argument("--max-latent", type=int, default=None,
                   help="latent-step cap of the rollouts (default: the model's)")
    g.add_argument("--max-examples", type=int, default=None, help="use the first N items")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    g.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                   help="the engine's dtype (default: bfloat16 on cuda, float32 on cpu)")
    g.add_argument("--max-num-seqs", type=int, default=256, help="engine batch size")
    g.add_argument("--enforce-eager", action="store_true", help="engine without CUDA graphs")
    g.add_argument("--kv-slots", type=int, default=None,
                   help="the rollout engine's KV pool in tokens (default: from memory)")
    g.add_argument("--no-autocast", dest="autocast", action="store_false",
                   help="the trainer's forward in float32 on CUDA (default: bfloat16 autocast)")
    g.add_argument("--max-seconds", type=float, default=0.0,
                   help="stop and save after this long (0: no limit)")
    g.add_argument("--save-every", type=int, default=0, help="also save every N steps")
    g.set_defaults(func=run_colar_grpo)


def run_cot(args) -> int:
    from latentserve.extras import require

    if args.lora_r > 0 or getattr(args, "init_adapter", None):  # LoRA through PEFT
        require("peft", "latentserve train cot (LoRA; --lora-r 0 is a full fine-tune)")
    from latentserve.train.cot import CotConfig, train

    opts = {k: v for k, v in vars(args).items() if k not in ("command", "stage", "func")}
    opts["lora_targets"] = tuple(t for t in opts["lora_targets"].split(",") if t)
    print(json.dumps(train(CotConfig(**opts)), indent=1))
    return 0


def run_colar(args) -> int:
    from latentserve.extras import require

    if args.lora_r > 0 or args.init_adapter:  # LoRA through PEFT
        require("peft", "latentserve train colar (LoRA; --lora-r 0 is a full fine-tune)")
    from latentserve.train.colar import ColarTrainConfig, train

    opts = {k: v for k, v in vars(args).items() if k not in ("command", "stage", "func")}
    opts["lora_targets"] = tuple(t for t in opts["lora_targets"].split(",") if t)
    if opts["train_factors"] is not None:
        try:
            opts["train_factors"] = tuple(int(r) for r in opts["train_factors"].split(","))
        except ValueError:
            raise ValueError(f"--train-factors must be comma-separated integers, got "
                             f"{opts['train_factors']!r}") from None
    print(json.dumps(train(ColarTrainConfig(**opts)), indent=1))
    return 0


def run_colar_grpo(args) -> int:
    from latentserve.extras import require

    require("peft", "latentserve train colar-grpo")
    from latentserve.train.colar_grpo import ColarGRPOConfig, train

    opts = {k: v for k, v in vars(args).items() if k not in ("command", "stage", "func")}
    print(json.dumps(train(ColarGRPOConfig(**opts)), indent=1))
    return 0
