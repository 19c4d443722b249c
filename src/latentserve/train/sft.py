"""Stage 1 of a compression head: supervised regression on a frozen backbone
(``latentserve train-head sft``).

Losses on the rows of ``train.features`` (``t = LN(target_proj(target))`` with a frozen,
randomly initialised ``target_proj``; ``mu, log_sigma = head(LN(anchor))``):

* ``soft_mse``: the Gaussian negative log-likelihood of ``t`` under ``N(mu, sigma^2)``,
  ``0.5 (t - mu)^2 / sigma^2 + log sigma`` (mean over rows and dims), minus ``beta`` (0.01)
  times the Gaussian entropy ``log sigma + 0.5 log(2 pi e)``;
* ``recon``: ``|decoder(LN(t)) - embed|^2`` divided by the variance of the embeddings (so
  1.0 = predicting their mean);
* ``stop``: BCE of ``stop_head(LN(anchor))`` against the end-of-reasoning label, positives
  weighted by the negative/positive ratio.

Loss = soft_mse + recon + stop; AdamW with linear warmup and decay. Facts from the
DeepSeek-V4 latent-reasoning addon's training notes (soft-MSE with an entropy term, a
reconstruction loss for the decoder, stop BCE on the group where reasoning ends, a frozen
backbone, source layer near 80% depth and target layer at the top) and CoLaR (arXiv
2505.16552); the code is ours.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from latentserve.train.traces import THINK_CLOSE, THINK_OPEN


@dataclass(slots=True)
class SFTConfig:
    """Options of ``train-head sft`` (see ``latentserve train-head sft --help``).
    ``source_layer`` / ``target_layer`` None = ``round(0.8 L) - 1`` / ``L - 1``."""

    out: str
    model: str | None = None
    data: str | None = None  # None = $LATENTSERVE_DATA/gsm8k/train.jsonl
    max_examples: int | None = None
    style: str = "solution"
    max_reasoning_tokens: int = 256
    think_open: str = THINK_OPEN
    think_close: str = THINK_CLOSE
    source_layer: int | None = None
    target_layer: int | None = None
    compression_factor: int = 4
    latent_dim: int = 128
    mlp_dim: int | None = None
    steps: int = 300
    batch_size: int = 256
    lr: float = 1e-3
    warmup: float = 0.05
    weight_decay: float = 0.01
    beta: float = 0.01
    seed: int = 0
    device: str = "cpu"
    dtype: str = "float32"
    capture_batch_size: int = 8
    log_every: int = 10
    save_every: int = 0
    progress: bool = True

    def __post_init__(self):
        for k in ("steps", "batch_size", "compression_factor", "latent_dim",
                  "max_reasoning_tokens", "capture_batch_size", "log_every"):
            v = getattr(self, k)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{k} must be an integer >= 1, got {v!r}")
        if self.max_examples is not None and self.max_examples < 1:
            raise ValueError(f"max_examples must be >= 1, got {self.max_examples}")
        if self.beta < 0:
            raise ValueError(f"beta must be >= 0, got {self.beta}")
        for k in ("think_open", "think_close"):  # empty: serving would look for <think>
            if not isinstance(getattr(self, k), str) or not getattr(self, k):
                raise ValueError(f"{k} must be a non-empty string (the thinking span's text "
                                 f"the head is trained and served with), got "
                                 f"{getattr(self, k)!r}")
        if not str(self.out).endswith((".safetensors", ".pt")):
            raise ValueError(f"out must end in .safetensors or .pt, got {self.out!r}")


def load_backbone(model: str | None, device: str, dtype: str):
    """``(hf_model, tokenizer, model_dir)``: the frozen HF causal LM (eval, no grads) for
    ``model`` (a directory, a ``.gguf``, or None for the embedded SmolLM2)."""
    from transformers import AutoModelForCausalLM

    from latentserve.models.checkpoint import load_tokenizer, resolve_model_dir

    d = resolve_model_dir(model)
    m = AutoModelForCausalLM.from_pretrained(str(d), dtype=getattr(torch, dtype))
    m = m.to(device).eval().requires_grad_(False)
    return m, load_tokenizer(d), d


def default_layers(n_layers: int) -> tuple[int, int]:
    """``(source, target)`` layer indices near 80% and at 100% depth."""
    return max(0, min(n_layers - 2, round(0.8 * n_layers) - 1)), n_layers - 1


def sft_losses(head, feats, lat_idx: torch.Tensor, stop_idx: torch.Tensor, beta: float,
               embed_var: float, pos_weight: torch.Tensor) -> dict:
    """Loss terms (scalars; ``loss`` is their sum) on latent rows ``lat_idx`` and stop rows
    ``stop_idx`` of ``feats``. ``head``: ``latent.head.LatentHead`` with ``target_proj``."""
    lat = head.config.latent_dim
    anchor = feats.anchor[lat_idx]
    with torch.no_grad():
        t = F.layer_norm(head.target_proj(feats.target[lat_idx]), (lat,))
    mu, log_sigma = head.policy(anchor)
    nll = 0.5 * (t - mu) ** 2 * torch.exp(-2 * log_sigma) + log_sigma
    entropy = (log_sigma + 0.5 * math.log(2 * math.pi * math.e)).mean()
    soft_mse = nll.mean() - beta * entropy
    recon = F.mse_loss(head.decode(t), feats.embed[lat_idx]) / embed_var
    logit = head.reasoning_head.stop_logit(head._ln_anchor(feats.anchor[stop_idx]))[:, 0]
    stop = F.binary_cross_entropy_with_logits(logit, feats.stop[stop_idx],
                                              pos_weight=pos_weight)
    return {"loss": soft_mse + recon + stop, "soft_mse": soft_mse, "recon": recon,
            "stop": stop, "mse": F.mse_loss(mu, t), "log_sigma": log_sigma.mean()}


@torch.no_grad()
def full_losses(head, feats, beta, embed_var, pos_weight) -> dict:
    """:func:`sft_losses` over every row at once (floats)."""
    lat_rows = feats.has_target.nonzero()[:, 0]
    all_rows = torch.arange(len(feats.stop), device=feats.stop.device)
    terms = sft_losses(head, feats, lat_rows, all_rows, beta, embed_var, pos_weight)
    return {k: float(v) for k, v in terms.items()}


def train_sft(cfg: SFTConfig) -> dict:
    """Capture features, train a head, write the bundle to ``cfg.out`` (and a JSON log
    beside it, ``<out>.log.json``). Returns the log: ``config``, ``loss_before`` /
    ``loss_after`` (all terms over every training row), ``history`` (terms every
    ``log_every`` steps), counts and seconds. Raises ValueError for bad options or when no
    trace fits ``max_reasoning_tokens``."""
    from latentserve.latent.bundle import bundle_from_module, write_bundle
    from latentserve.latent.head import HeadConfig, LatentHead
    from latentserve.train.features import capture
    from latentserve.train.schedule import adamw_warmup_linear
    from latentserve.train.traces import build_traces, load_gsm8k_rows, train_file

    t0 = time.perf_counter()
    torch.manual_seed(cfg.seed)
    data = train_file(cfg.data)
    rows = load_gsm8k_rows(data, cfg.max_examples)
    model, tok, _ = load_backbone(cfg.model, cfg.device, cfg.dtype)
    src, tgt = default_layers(model.config.num_hidden_layers)
    src = cfg.source_layer if cfg.source_layer is not None else src
    tgt = cfg.target_layer if cfg.target_layer is not None else tgt
    traces = build_traces(tok, rows, cfg.think_open, cfg.think_close, cfg.style,
                          cfg.max_reasoning_tokens)
    if not traces:
        raise ValueError(f"no usable trace in {data} (max_reasoning_tokens="
                         f"{cfg.max_reasoning_tokens})")
    feats = capture(model, traces, src, tgt, cfg.compression_factor,
                    cfg.capture_batch_size, cfg.progress)
    t_capture = time.perf_counter() - t0
    del model

    hcfg = HeadConfig(hidden_size=feats.anchor.shape[1], latent_dim=cfg.latent_dim,
                      mlp_dim=cfg.mlp_dim, source_layer=src, target_layer=tgt,
                      compression_factor=cfg.compression_factor,
                      think_open=cfg.think_open, think_close=cfg.think_close)
    head = LatentHead(hcfg, has_stop_head=True, has_target_proj=True).to(cfg.device)
    head.target_proj.requires_grad_(False)
    lat_rows = feats.has_target.nonzero()[:, 0]
    embed_var = float(feats.embed[lat_rows].var(0).sum() / feats.embed.shape[1]) or 1.0
    n_pos = float(feats.stop.sum())
    pos_weight = torch.tensor((len(feats.stop) - n_pos) / max(n_pos, 1.0), device=cfg.device)
    before = full_losses(head, feats, cfg.beta, embed_var, pos_weight)
    params = [p for p in head.parameters() if p.requires_grad]
    opt, sched = adamw_warmup_linear(params, cfg.lr, cfg.steps, cfg.warmup, cfg.weight_decay)
    gen = torch.Generator(device=cfg.device).manual_seed(cfg.seed)
    history = []
    steps = range(cfg.steps)
    bar = None
    if cfg.progress:
        from tqdm.auto import tqdm

        steps = bar = tqdm(steps, desc="sft", unit="step")
    head.train()
    for step in steps:
        li = lat_rows[torch.randint(len(lat_rows), (cfg.batch_size,), generator=gen,
                                    device=cfg.device)]
        si = torch.randint(len(feats.stop), (cfg.batch_size,), generator=gen,
                           device=cfg.device)
        terms = sft_losses(head, feats, li, si, cfg.beta, embed_var, pos_weight)
        opt.zero_grad(set_to_none=True)
        terms["loss"].backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
        if step % cfg.log_every == 0 or step == cfg.steps - 1:
            row = {"step": step, "lr": sched.get_last_lr()[0],
                   **{k: round(float(v.detach()), 6) for k, v in terms.items()}}
            history.append(row)
            if bar is not None:
                bar.set_postfix(loss=f"{row['loss']:.3f}", recon=f"{row['recon']:.3f}",
                                stop=f"{row['stop']:.3f}")
        if cfg.save_every and (step + 1) % cfg.save_every == 0 and step + 1 < cfg.steps:
            out = Path(cfg.out)
            write_bundle(bundle_from_module(head.eval()),
                         out.with_name(f"{out.stem}-step{step + 1}{out.suffix}"))
            head.train()
    head.eval()
    after = full_losses(head, feats, cfg.beta, embed_var, pos_weight)
    Path(cfg.out).parent.mkdir(parents=True, exist_ok=True)
    write_bundle(bundle_from_module(head), cfg.out)
    log = {"config": asdict(cfg), "head_config": hcfg.to_dict(), "traces": len(traces),
           "rows": len(feats.stop), "latent_rows": len(lat_rows),
           "loss_before": before, "loss_after": after, "history": history,
           "capture_seconds": round(t_capture, 2),
           "seconds": round(time.perf_counter() - t0, 2)}
    Path(str(cfg.out) + ".log.json").write_text(json.dumps(log, indent=1))
    return log
