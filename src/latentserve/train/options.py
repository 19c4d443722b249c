"""The options of the training commands, one dataclass each (``train cot|colar|colar-grpo``,
``train-head sft|dagger|grpo``), each field declared once with ``options.option``: its
default, ``--help`` text, range or choices, which ``options.check`` enforces and
``options.add_options`` turns into the command's flags. Light: no torch (``latentserve
--help`` imports it)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from latentserve.latent.spec import COMPRESSIONS
from latentserve.options import check, option
from latentserve.train.traces import (
    COLAR_CLOSE,
    COLAR_OPEN,
    PROMPT_FORMATS,
    THINK_CLOSE,
    THINK_OPEN,
)

# The LoRA target modules of a fresh adapter (Llama names), ``--lora-targets``' default.
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# CoLaR GRPO's per-sequence loss: summed / 32 (upstream) or the mean over tokens.
LOSS_AVERAGES = ("sum", "mean")
DEVICES = ("cpu", "cuda")
DTYPES = ("float32", "bfloat16", "float16")
DATA = "training file: iCoT text lines or GSM8K jsonl (repeatable)"
MAX_SECONDS = "stop and save after this long (0: no limit)"
INF = float("inf")  # the upper bound of a float option with no other: inf (and NaN) refused
KV_SLOTS = "the rollout engine's KV pool in tokens (default: from memory)"


def check_out(path, what: str, directory: bool, say=print) -> None:
    """Before any training: ValueError naming ``--out`` when ``path`` cannot take ``what``
    (e.g. "a model directory"): a ``directory`` output that is an existing file, a file
    output that is an existing directory, a nearest existing folder above it that is a file
    or not writable. ``say`` gets one line when an existing non-empty directory or a file is
    overwritten (missing folders are created when the output is written)."""
    p = Path(path)
    if p.exists() and p.is_dir() != directory:
        raise ValueError(f"--out {p} is an existing {'file' if directory else 'directory'}, "
                         f"but it names {what}: give a new path or "
                         f"{'a directory' if directory else 'a file'}")
    above = p if p.is_dir() else next(a for a in p.absolute().parents if a.exists())
    if not above.is_dir():
        raise ValueError(f"--out {p}: {above} is a file, not a folder, so {what} cannot be "
                         "written below it")
    if not os.access(above, os.W_OK | os.X_OK):
        raise ValueError(f"--out {p}: {above} is not writable")
    if p.is_file() or (p.is_dir() and any(p.iterdir())):
        say(f"--out {p} exists: {'the files written there are' if directory else 'it is'} "
            "overwritten")


# ----------------------------------------------------------------------------- train

def fresh_lora(cfg) -> tuple[int, float, tuple[str, ...]] | None:
    """``(r, alpha, target modules)`` of the fresh LoRA ``cfg`` (a :class:`FinetuneOptions`)
    asks for, unsent ones as 16, 32 and :data:`LORA_TARGETS`; None for a full fine-tune
    (``lora_r`` 0) or a continued ``init_adapter`` (its own config rules)."""
    if cfg.init_adapter or cfg.lora_r == 0:
        return None
    return (16 if cfg.lora_r is None else cfg.lora_r,
            32.0 if cfg.lora_alpha is None else cfg.lora_alpha,
            LORA_TARGETS if cfg.lora_targets is None else cfg.lora_targets)


def check_lora(cfg) -> None:
    """ValueError naming the field for a LoRA option of ``cfg`` that would do nothing:
    ``lora_alpha``/``lora_targets`` without a fresh LoRA, ``lora_r`` > 0 with
    ``init_adapter``."""
    if cfg.init_adapter and cfg.lora_r:
        raise ValueError(f"lora_r must be 0 (merge the adapter) or unset with init_adapter, "
                         f"got {cfg.lora_r}: the adapter keeps its own rank")
    if fresh_lora(cfg) is not None:
        return
    for name in ("lora_alpha", "lora_targets"):
        if getattr(cfg, name) is not None:
            why = "init_adapter's own config" if cfg.init_adapter else "a full fine-tune"
            raise ValueError(f"{name} applies to a fresh LoRA only, not to {why}")


@dataclass(slots=True, kw_only=True)
class FinetuneOptions:
    """What ``train cot`` and ``train colar`` share: data, backbone, LoRA, optimiser."""

    data: list[str] = option(help=DATA)
    out: str = option(help="model directory to write (the adapter, or the whole model)")
    base: str | None = option(None, "backbone (default: the embedded SmolLM2-135M-Instruct; "
                              "train colar: --init-adapter's base first)", flags=("--model",))
    lora_r: int | None = option(None, "rank of a fresh LoRA (default 16); 0 = full fine-tune; "
                                "with --init-adapter only 0 (merge it), its own rank otherwise",
                                ge=0)
    lora_alpha: float | None = option(None, "alpha of a fresh LoRA (default 32)", gt=0,
                                      lt=INF)
    lora_targets: tuple[str, ...] | None = option(None, "comma-separated module names of a "
                                                  "fresh LoRA (default: every Llama linear)")
    init_adapter: str | None = option(None, "adapter directory to continue training (train cot "
                                      "output; for train colar also a train colar output, its "
                                      "latent policy too); with --lora-r 0 it is merged and "
                                      "every weight trained")
    steps: int = option(2000, ge=1)
    batch_size: int = option(128, ge=1)
    lr: float = option(1e-3, gt=0, lt=INF)
    warmup: int = option(100, "warmup steps", ge=0)
    weight_decay: float = option(0.01, ge=0, lt=INF)
    max_len: int = option(512, "examples longer than this (uncompressed) are dropped", ge=1)
    seed: int = 0
    device: str = option("cpu", choices=DEVICES)
    max_seconds: float = option(0.0, MAX_SECONDS, ge=0, lt=INF)
    save_every: int = option(0, "also save every N steps", ge=0)
    log_every: int = option(50, ge=1)

    def __post_init__(self):
        check(self)
        check_lora(self)


@dataclass(slots=True, kw_only=True)
class CotConfig(FinetuneOptions):
    """Options of ``latentserve train cot`` (stage 0 of CoLaR: a text-CoT backbone)."""

    mode: str = option("cot", "nocot: the control that answers without steps",
                       choices=("cot", "nocot"))
    eval_data: list[str] = option([], "file to check greedy accuracy on at the end (repeatable)")
    eval_items: int = option(200, "items per --eval-data file", ge=1)


@dataclass(slots=True, kw_only=True)
class ColarTrainConfig(FinetuneOptions):
    """Options of ``latentserve train colar`` (stage 1 of CoLaR); ``compression_factor``
    None becomes ``max_compression_factor``."""

    batch_size: int = option(256, ge=1)
    lr: float = option(1e-4, gt=0, lt=INF)
    max_compression_factor: int = option(5, "each batch's compression factor is drawn from "
                                         "1..this", ge=1)
    train_factors: tuple[int, ...] | None = option(
        None, "comma-separated factors each batch's compression factor is drawn from instead, "
        "repeats weighting one (e.g. 2,3,4,4); each in 1..--max-compression-factor")
    compression_factor: int | None = option(None, "default thinking speed written to "
                                            "colar_config.json (default: "
                                            "--max-compression-factor)", ge=1)
    embed_loss: str = option("mse", "latent loss: mse of a policy sample (upstream default) or nll",
                             choices=("mse", "nll"))
    embed_weight: float = option(1.0, "weight of the latent loss", ge=0, lt=INF)
    ce_weight: float = option(1.0, "weight of the CE loss", ge=0, lt=INF)
    intermediate_size: int | None = option(None, "latent policy width (default: the hidden size)",
                                           ge=1)
    embeds_std: float | None = option(None, "latent scale (default: std of the input-embedding "
                                      "matrix)", gt=0, lt=INF)
    max_latent: int = option(64, "latent-step cap written to colar_config.json", ge=1)
    compression: str = option("sqrt_mean", "how a group of r step-token embeddings becomes one "
                              "latent: sqrt_mean (upstream: their sum over sqrt(r)) or ramp (our "
                              "extension: token j weighted j + 1, over the weights' norm, so "
                              "the order within a group is kept)", choices=COMPRESSIONS)
    own_latent_prob: float = option(0.0, "scheduled sampling (our extension): each latent input "
                                    "but the first is, with this probability, the policy's own "
                                    "prediction from a no-grad pass of the gold batch", ge=0, le=1)

    def __post_init__(self):
        check(self)
        check_lora(self)
        if self.ce_weight == 0 and self.embed_weight == 0:
            raise ValueError("ce_weight and embed_weight are both 0: nothing would be trained")
        top = self.max_compression_factor
        if self.compression_factor is None:
            self.compression_factor = top
        if self.compression_factor > top:
            raise ValueError(f"compression_factor must be in 1..{top} (max_compression_factor),"
                             f" got {self.compression_factor}")
        if self.train_factors is not None and not (self.train_factors and all(
                1 <= r <= top for r in self.train_factors)):
            raise ValueError(f"train_factors must be a non-empty list of values in 1..{top} "
                             f"(max_compression_factor), got {self.train_factors}")


@dataclass(slots=True, kw_only=True)
class ColarGRPOConfig:
    """Options of ``latentserve train colar-grpo`` (stage 3 of CoLaR)."""

    model: str = option(help="stage-1 directory (train colar output: LoRA adapter + latent "
                        "policy)")
    data: list[str] = option(help=DATA)
    out: str = option(help="model directory to write")
    steps: int = option(100, "rollout + update rounds", ge=1)
    questions_per_step: int = option(8, ge=1)
    group_size: int = option(8, "rollouts per question (upstream 8; >= 2: advantages are "
                             "group-relative)", ge=2)
    exp_batch_size: int = option(8, "rollouts per optimiser step (upstream 8)", ge=1)
    lr: float = option(1e-6, "AdamW learning rate (upstream RL 1e-6)", gt=0, lt=INF)
    weight_decay: float = option(0.01, ge=0, lt=INF)
    clip_eps: float = option(0.2, "PPO ratio clip (upstream 0.2)", gt=0, lt=1)
    loss_average: str = option("sum", "per sequence: sum / 32 (upstream colar.yaml) or the mean "
                               "over tokens", choices=LOSS_AVERAGES)
    max_log_ratio: float | None = option(
        None, "clamp logp - logp_old to [-M, M] before exp (default: no clamp, upstream); "
        "keeps the ratios of a near-deterministic latent policy finite after an update "
        "(train/colar_grpo.py)", gt=0, lt=INF)
    tempered_logprobs: bool = option(False, "latent log-probs at --latent-temperature, the "
                                     "density the latents were drawn from (default: at 1, "
                                     "upstream get_logprobs)")
    use_latent_loss: bool = option(True, "leave the latent log-probs out of the loss",
                                   flags=("--no-latent-loss",))
    use_answer_loss: bool = option(True, "leave the answer log-probs out of the loss",
                                   flags=("--no-answer-loss",))
    punish_latent_length: bool = option(False, "divide each reward by its latent count "
                                        "(upstream option)")
    length_penalty: float = option(0.0, "subtract this x latent steps / max latent from each "
                                   "reward", ge=0, lt=INF)
    latent_temperature: float = option(1.0, "latent policy temperature of the rollouts (> 0: "
                                       "GRPO explores by drawing the latents; upstream 1)", gt=0,
                                       lt=INF)
    answer_temperature: float = option(1.0, "sampling temperature of the stop token and the "
                                       "answer (upstream 1)", ge=0, lt=INF)
    answer_top_p: float = option(0.9, "answer top-p (upstream 0.9)", gt=0, le=1)
    answer_tokens: int = option(16, "answer tokens per rollout (upstream max_new_tokens 16)",
                                ge=1)
    compression_factor: int | None = option(None, "thinking speed of the rollouts (default: the "
                                            "model's)", ge=1)
    max_latent: int | None = option(None, "latent-step cap of the rollouts (default: the "
                                    "model's)", ge=1)
    max_examples: int | None = option(None, "use the first N items", ge=1)
    seed: int = 0
    device: str = option("cpu", choices=DEVICES)
    dtype: str | None = option(None, "the engine's dtype (default: bfloat16 on cuda, float32 on "
                               "cpu)", choices=DTYPES)
    max_num_seqs: int = option(256, "engine batch size", ge=1)
    enforce_eager: bool = option(False, "engine without CUDA graphs")
    kv_slots: int | None = option(None, KV_SLOTS)
    autocast: bool = option(True, "the trainer's forward in float32 on CUDA (default: bfloat16 "
                            "autocast)")
    max_seconds: float = option(0.0, MAX_SECONDS, ge=0, lt=INF)
    save_every: int = option(0, "also save every N steps", ge=0)

    def __post_init__(self):
        check(self)
        if not (self.use_latent_loss or self.use_answer_loss):
            raise ValueError("use_latent_loss and use_answer_loss are both off: no loss")


# ----------------------------------------------------------------------------- train-head

@dataclass(slots=True, kw_only=True)
class HeadOptions:
    """What ``train-head sft|dagger|grpo`` share: backbone, data, the bundle to write."""

    out: str = option(help="bundle to write (.safetensors or .pt)")
    model: str | None = option(None, "backbone: a model directory, .gguf or PEFT LoRA adapter "
                               "directory (default: embedded SmolLM2)")
    data: str | None = option(None, "GSM8K jsonl; the colar format also takes iCoT lines "
                              "(default: $LATENTSERVE_DATA/gsm8k/train.jsonl, which does not ship "
                              "with the package: docs/training.md, 'Data')")
    prompt_format: str = option("chat", "chat: chat template + thinking text; colar: CoLaR's "
                                "prompt ending in ###, steps, ###, Answer:{gold} (a `train cot` "
                                "backbone; grpo rewards the answer after Answer:)",
                                choices=PROMPT_FORMATS)
    max_examples: int | None = option(None, ge=1)
    seed: int = 0
    device: str = option("cpu", choices=DEVICES)
    dtype: str = option("float32", choices=DTYPES)
    progress: bool = option(True, "no progress bars")

    def __post_init__(self):
        check(self)
        if not str(self.out).endswith((".safetensors", ".pt")):
            raise ValueError(f"out must end in .safetensors or .pt, got {self.out!r}")


@dataclass(slots=True, kw_only=True)
class FitOptions(HeadOptions):
    """What ``train-head sft`` and ``dagger`` share: the traces and the supervised fit
    (``train.sft.fit``)."""

    style: str = option("solution", "chat format: reasoning = worked solution text, or only its "
                        "<<...>> equations", choices=("solution", "equations"))
    max_reasoning_tokens: int = option(256, ge=1)
    capture_batch_size: int = option(8, ge=1)
    steps: int = option(300, "training steps (dagger: per round)", ge=1)
    batch_size: int = option(256, "rows per step", ge=1)
    lr: float = option(1e-3, gt=0, lt=INF)
    warmup: float = option(0.05, "fraction of steps", ge=0, lt=1)
    weight_decay: float = option(0.01, ge=0, lt=INF)
    beta: float = option(0.01, "entropy weight", ge=0, lt=INF)
    log_every: int = option(10, ge=1)


@dataclass(slots=True, kw_only=True)
class SFTConfig(FitOptions):
    """Options of ``train-head sft``; ``think_open`` / ``think_close`` None become the
    prompt format's (``colar`` allows no other)."""

    think_open: str | None = option(None, f"chat format: thinking opening text (default "
                                    f"{THINK_OPEN!r}); the colar format's is empty")
    think_close: str | None = option(None, f"chat format: thinking closing text (default "
                                     f"{THINK_CLOSE!r}); the colar format's is ###")
    source_layer: int | None = option(None, "anchor layer (default: round(0.8 L) - 1, ~80%% depth)")
    target_layer: int | None = option(None, "default: the last layer")
    compression_factor: int = option(4, "reasoning tokens per latent step", ge=1)
    latent_dim: int = option(128, ge=1)
    mlp_dim: int | None = option(None, "default: hidden_size // 2", ge=1)
    save_every: int = option(0, "checkpoint every N steps", ge=0)

    def __post_init__(self):
        HeadOptions.__post_init__(self)
        fixed = self.prompt_format == "colar"
        for k, v in (("think_open", COLAR_OPEN if fixed else THINK_OPEN),
                     ("think_close", COLAR_CLOSE if fixed else THINK_CLOSE)):
            given = getattr(self, k)
            if given is None:
                setattr(self, k, v)
            elif fixed and given != v:
                raise ValueError(f"{k} is {v!r} in the colar prompt format (the prompt ends "
                                 f"with the opening ###, the closing is ###), got {given!r}")
            elif not fixed and not (isinstance(given, str) and given):
                # empty: serving would look for <think>
                raise ValueError(f"{k} must be a non-empty string (the thinking span's text "
                                 f"the head is trained and served with), got {given!r}")


@dataclass(slots=True, kw_only=True)
class DaggerConfig(FitOptions):
    """Options of ``train-head dagger``. Layers, compression factor and thinking text come
    from the SFT ``bundle``; data options must be SFT's."""

    bundle: str = option(help="the SFT bundle to start from")
    rounds: int = option(2, ge=1)
    rollout_examples: int | None = option(None, "traces rolled out per round, a fresh random "
                                          "subset (default: all)", ge=1)
    overshoot: int = option(2, "latent steps each rollout runs past its gold length (labelled "
                            "stop)", ge=1)
    sigma: float = option(0.0, "rollout latents z ~ N(mu, sigma^2) (0: greedy, mu)", ge=0, lt=INF)
    stop_threshold: float = option(0.5, "for the logged closed-loop stop metrics", ge=0, le=1)
    max_num_seqs: int = option(256, ge=1)
    enforce_eager: bool = False
    kv_slots: int | None = option(None, KV_SLOTS)
    gpu_memory_utilization: float = option(0.5, "the rollout engine's share of GPU memory (the "
                                           "rows stay on the GPU)", gt=0, le=1)


@dataclass(slots=True, kw_only=True)
class GRPOConfig(HeadOptions):
    """Options of ``train-head grpo``."""

    bundle: str = option(help="the SFT bundle to start from")
    steps: int = option(10, ge=1)
    questions_per_step: int = option(8, ge=1)
    group_size: int = option(8, "rollouts per question (>= 2: advantages are group-relative)",
                             ge=2)
    lr: float = option(1e-4, gt=0, lt=INF)
    kl_coef: float = option(0.05, ge=0, lt=INF)
    sigma: float = option(0.3, "exploration std of z", gt=0, lt=INF)
    max_latent: int = option(32, ge=0)
    min_latent: int = option(1, ge=0)
    stop_threshold: float = option(0.5, ge=0, le=1)
    answer_tokens: int = option(16, ge=1)
    close_bonus: float = option(0.1, "reward added when the stop head closed the phase",
                                gt=-INF, lt=INF)
    max_num_seqs: int = option(256, ge=1)
    enforce_eager: bool = False
    kv_slots: int | None = option(None, KV_SLOTS)
    save_every: int = option(0, "also write the bundle every N steps (0: at the end only)", ge=0)
