"""Stage 1 of a compression head: supervised regression on a frozen backbone
(``latentserve train-head sft``).

Design notes: docs/internals.md, "latentserve.train.sft".
"""

from __future__ import annotations

import json
import math
import sys
import time
from dataclasses import asdict
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from latentserve.eval.datasets import parse_file
from latentserve.latent.bundle import bundle_from_module, write_bundle
from latentserve.latent.head import HeadConfig, LatentHead
from latentserve.models.checkpoint import is_adapter_dir, load_tokenizer, resolve_model_dir
from latentserve.models.lora import merge_adapter, read_adapter
from latentserve.train.cot import DivergenceWatch, read_items
from latentserve.train.features import capture
from latentserve.train.options import SFTConfig, check_out
from latentserve.train.traces import build_colar_traces, build_traces, train_file


def load_backbone(model: str | None, device: str, dtype: str):
    """``(hf_model, tokenizer, model_dir)``: the frozen HF causal LM of ``model`` (directory,
    ``.gguf``, None = embedded, or a LoRA adapter merged in float32) in ``dtype`` on
    ``device``. Raises ValueError as ``resolve_model_dir`` and ``read_adapter``."""
    from transformers import AutoModelForCausalLM

    d = resolve_model_dir(model)
    if is_adapter_dir(d):  # its base with the adapter merged (models.lora), in float32
        adapter = read_adapter(d)
        m = AutoModelForCausalLM.from_pretrained(str(adapter.base_dir), dtype=torch.float32)
        m.load_state_dict(dict(merge_adapter(m.state_dict().items(), adapter, m.config)))
    else:
        m = AutoModelForCausalLM.from_pretrained(str(d), dtype=getattr(torch, dtype))
    m = m.to(device=device, dtype=getattr(torch, dtype)).eval().requires_grad_(False)
    return m, load_tokenizer(d), d


def say_stderr(line: str) -> None:
    """Print ``line`` to stderr (the head trainers' stdout is their JSON summary)."""
    print(line, file=sys.stderr)


def write_log(cfg, t0: float, **fields) -> dict:
    """``{"config": asdict(cfg), **fields, "seconds"}`` (since ``t0``, ``time.perf_counter``)
    written to ``<cfg.out>.log.json``; returns it."""
    log = {"config": asdict(cfg), **fields, "seconds": round(time.perf_counter() - t0, 2)}
    Path(str(cfg.out) + ".log.json").write_text(json.dumps(log, indent=1))
    return log


def adamw_warmup_linear(params, lr: float, steps: int, warmup: float = 0.05,
                        weight_decay: float = 0.01):
    """``(optimizer, scheduler)``: ``torch.optim.AdamW`` over ``params`` and a ``LambdaLR``
    whose factor rises linearly over ``round(warmup * steps)`` steps (at least 1) from
    1/(warmup steps) to 1, then falls linearly to 0 at ``steps`` (the ranges: the options'
    ``lr``, ``steps`` and ``warmup``); SFT's and GRPO's."""
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)
    n_warm = max(1, round(warmup * steps))

    def factor(step: int) -> float:
        if step < n_warm:
            return (step + 1) / n_warm
        return max(0.0, (steps - step) / max(1, steps - n_warm))

    return opt, torch.optim.lr_scheduler.LambdaLR(opt, factor)


def sft_losses(head, feats, lat_idx: torch.Tensor, stop_idx: torch.Tensor, beta: float,
               embed_var: float, pos_weight: torch.Tensor) -> dict:
    """Loss terms (scalars; ``loss`` is their sum) on latent rows ``lat_idx`` and stop rows
    ``stop_idx`` of ``feats``. ``head``: ``latent.head.LatentHead`` with ``target_proj``."""
    with torch.no_grad():
        t = F.layer_norm(head.target_proj(feats.target[lat_idx]), (head.config.latent_dim,))
    mu, log_sigma = head.policy(feats.anchor[lat_idx])
    nll = 0.5 * (t - mu) ** 2 * torch.exp(-2 * log_sigma) + log_sigma
    entropy = (log_sigma + 0.5 * math.log(2 * math.pi * math.e)).mean()
    soft_mse = nll.mean() - beta * entropy
    recon = F.mse_loss(head.decode(t), feats.embed[lat_idx]) / embed_var
    logit = head.reasoning_head.stop_logit(head._ln_anchor(feats.anchor[stop_idx]))[:, 0]
    stop = F.binary_cross_entropy_with_logits(logit, feats.stop[stop_idx],
                                              pos_weight=pos_weight)
    return {"loss": soft_mse + recon + stop, "soft_mse": soft_mse, "recon": recon,
            "stop": stop, "mse": F.mse_loss(mu, t), "log_sigma": log_sigma.mean()}


def capture_traces(model, tok, cfg, hc: HeadConfig):
    """``(traces, features)`` of ``cfg``'s training data (an :class:`SFTConfig` or
    ``DaggerConfig``; ``train.traces`` in ``cfg.prompt_format``, ``hc.think_open`` /
    ``think_close`` / ``cfg.style`` for ``chat`` only) on the frozen ``model`` at ``hc``'s
    layers and compression factor. ValueError when no trace fits or for a malformed file,
    FileNotFoundError."""
    path, limit = train_file(cfg.data), cfg.max_examples
    if cfg.prompt_format == "colar":
        traces = build_colar_traces(tok, read_items(path)[:limit], cfg.max_reasoning_tokens)
    else:
        traces = build_traces(tok, parse_file(path, "jsonl", "number", limit), hc.think_open,
                              hc.think_close, cfg.style, cfg.max_reasoning_tokens)
    if not traces:
        raise ValueError(f"no usable trace in {path} (max_reasoning_tokens="
                         f"{cfg.max_reasoning_tokens})")
    feats = capture(model, traces, hc.source_layer, hc.target_layer,
                    hc.compression_factor or 1, cfg.capture_batch_size, cfg.progress)
    return traces, feats


def fit(head, feats, cfg, desc: str = "sft", checkpoint=None) -> dict:
    """Train ``head`` (``target_proj`` frozen) for ``cfg.steps`` steps of ``cfg.batch_size``
    uniform rows; ``checkpoint(step)`` every ``cfg.save_every``. Returns ``{"rows",
    "latent_rows", "loss_before", "loss_after", "history"}`` (a history row's ``lr``: the rate
    its step used). FloatingPointError naming the step once the loss is NaN or inf (checked
    at each logged step and checkpoint: ``cot.DivergenceWatch``)."""
    lat_rows = feats.has_target.nonzero()[:, 0]
    embed_var = float(feats.embed[lat_rows].var(0).sum() / feats.embed.shape[1]) or 1.0
    n_pos = float(feats.stop.sum())
    pos_weight = torch.tensor((len(feats.stop) - n_pos) / max(n_pos, 1.0), device=cfg.device)
    all_rows = torch.arange(len(feats.stop), device=feats.stop.device)

    @torch.no_grad()
    def full_losses() -> dict:  # every row at once, eval mode
        head.eval()
        terms = sft_losses(head, feats, lat_rows, all_rows, cfg.beta, embed_var, pos_weight)
        return {k: float(v) for k, v in terms.items()}

    before = full_losses()
    params = [p for p in head.parameters() if p.requires_grad]
    opt, sched = adamw_warmup_linear(params, cfg.lr, cfg.steps, cfg.warmup, cfg.weight_decay)
    gen = torch.Generator(device=cfg.device).manual_seed(cfg.seed)
    history = []
    bar = tqdm(range(cfg.steps), desc=desc, unit="step", disable=not cfg.progress)
    watch = DivergenceWatch(cfg.lr)
    head.train()
    for step in bar:
        li = lat_rows[torch.randint(len(lat_rows), (cfg.batch_size,), generator=gen,
                                    device=cfg.device)]
        si = torch.randint(len(feats.stop), (cfg.batch_size,), generator=gen,
                           device=cfg.device)
        terms = sft_losses(head, feats, li, si, cfg.beta, embed_var, pos_weight)
        watch.see(step, terms["loss"])
        lr = sched.get_last_lr()[0]  # this step's; sched.step() sets the next one's
        opt.zero_grad(set_to_none=True)
        terms["loss"].backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
        logged = step % cfg.log_every == 0 or step == cfg.steps - 1
        saving = (checkpoint is not None and cfg.save_every and (step + 1) % cfg.save_every == 0
                  and step + 1 < cfg.steps)
        if logged or saving:  # the last step is always logged
            watch.check()
        if logged:
            row = {"step": step, "lr": lr,
                   **{k: round(float(v.detach()), 6) for k, v in terms.items()}}
            history.append(row)
            bar.set_postfix(loss=f"{row['loss']:.3f}", recon=f"{row['recon']:.3f}",
                            stop=f"{row['stop']:.3f}")
        if saving:
            checkpoint(step + 1)
            head.train()
    return {"rows": len(feats.stop), "latent_rows": len(lat_rows), "loss_before": before,
            "loss_after": full_losses(), "history": history}


def train_sft(cfg: SFTConfig) -> dict:
    """Capture features, train a head, write the bundle to ``cfg.out`` and ``<out>.log.json``;
    returns the log. Raises ValueError for bad options, an ``out`` that is a directory
    (checked first) or when no trace fits, FloatingPointError as :func:`fit`."""
    check_out(cfg.out, "a bundle file", False, say_stderr)
    t0 = time.perf_counter()
    torch.manual_seed(cfg.seed)
    model, tok, _ = load_backbone(cfg.model, cfg.device, cfg.dtype)
    n = model.config.num_hidden_layers  # default layers: near 80% and at 100% depth
    src = cfg.source_layer if cfg.source_layer is not None else max(0, min(n - 2,
                                                                           round(0.8 * n) - 1))
    tgt = cfg.target_layer if cfg.target_layer is not None else n - 1
    hcfg = HeadConfig(hidden_size=model.config.hidden_size, latent_dim=cfg.latent_dim,
                      mlp_dim=cfg.mlp_dim, source_layer=src, target_layer=tgt,
                      compression_factor=cfg.compression_factor,
                      think_open=cfg.think_open, think_close=cfg.think_close)
    traces, feats = capture_traces(model, tok, cfg, hcfg)
    t_capture = time.perf_counter() - t0
    del model
    head = LatentHead(hcfg, has_stop_head=True, has_target_proj=True).to(cfg.device)
    head.target_proj.requires_grad_(False)
    out = Path(cfg.out)
    out.parent.mkdir(parents=True, exist_ok=True)

    def checkpoint(step):
        write_bundle(bundle_from_module(head.eval()),
                     out.with_name(f"{out.stem}-step{step}{out.suffix}"))

    res = fit(head, feats, cfg, "sft", checkpoint)
    write_bundle(bundle_from_module(head), cfg.out)
    return write_log(cfg, t0, head_config=hcfg.to_dict(), traces=len(traces), **res,
                     capture_seconds=round(t_capture, 2))
