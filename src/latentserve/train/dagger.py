"""DAgger for a compression head: train it on the states its own latents lead to
(``latentserve train-head dagger``, between ``train-head sft`` and ``train-head grpo``).

Design notes: docs/internals.md, "latentserve.train.dagger".
"""

from __future__ import annotations

import dataclasses
import time
from itertools import accumulate
from pathlib import Path

import torch
import torch.nn.functional as F

from latentserve.latent.bundle import bundle_from_module, read_bundle, write_bundle
from latentserve.latent.head_loop import set_policy_sampling
from latentserve.sampling_params import SamplingParams
from latentserve.train.features import Features, num_groups
from latentserve.train.grpo import head_engine, run_requests
from latentserve.train.options import DaggerConfig, check_out
from latentserve.train.sft import capture_traces, fit, load_backbone, say_stderr, write_log
from latentserve.train.traces import COLAR_CLOSE, COLAR_OPEN


def rollout_anchors(engine, prompts: list[list[int]], caps: list[int],
                    chunk: int = 1024) -> list[torch.Tensor]:
    """Each prompt closed-loop through ``engine`` for exactly ``caps[i]`` latent steps (no
    stop), ``chunk`` at a time: its anchors ``[caps[i], H]`` float32 CPU (fewer when the
    context ran out). RuntimeError when a request fails."""
    n_close = len(engine.latent_spec.end_ids)
    hidden = engine.runner.model.latent_head.config.hidden_size
    out = []
    for lo in range(0, len(prompts), chunk):
        batch = [(prompts[i], SamplingParams(
            max_tokens=caps[i] + n_close + 1, temperature=0.0, thinking=True,
            max_latent=caps[i], min_latent=0, use_stop=False, min_output_tokens=0))
            for i in range(lo, min(lo + chunk, len(prompts)))]
        for _, stats in run_requests(engine, batch, "dagger"):
            acts = stats.get("actions") or []
            out.append(torch.stack([a for a, _ in acts]).float() if acts
                       else torch.zeros(0, hidden))
    return out


def label_rollouts(anchors: list[torch.Tensor], teacher: Features, first: list[int],
                   groups: list[int]) -> Features:
    """DAgger rows of rollouts: row ``j`` of rollout ``i`` (anchors ``[n_i, H]``) copies
    teacher row ``first[i] + min(j, groups[i])`` with its anchor replaced. Returns
    :class:`Features` on ``teacher``'s device, rollout-major."""
    dev = teacher.anchor.device
    idx = torch.cat([f + torch.arange(len(a)).clamp(max=g)
                     for a, f, g in zip(anchors, first, groups)])
    rows = teacher.rows(idx.to(dev))
    rows.anchor = torch.cat(anchors).to(device=dev, dtype=torch.float32)
    return rows


@torch.no_grad()
def closed_loop_metrics(head, anchors: list[torch.Tensor], rows: Features,
                        groups: list[int], threshold: float = 0.5) -> dict:
    """The head on its own rollouts: ``stop_at_gold`` / ``stop_early`` / ``stop_late``
    (fractions whose stop probability first passes ``threshold`` at ``j == G``, ``1 <= j <
    G``, later or never), ``mse`` of mu against the targets, ``stop_prob_at_gold``."""
    probs = [p.tolist() for p in head.stop_prob(rows.anchor).split([len(a) for a in anchors])]
    has = rows.has_target
    t = F.layer_norm(head.target_proj(rows.target[has]), (head.config.latent_dim,))
    mse = float(F.mse_loss(head.encode(rows.anchor[has]), t)) if bool(has.any()) else 0.0
    at, early, at_gold = 0, 0, []
    for p, g in zip(probs, groups):
        fire = next((j for j in range(1, len(p)) if p[j] > threshold), None)
        at += fire == g
        early += fire is not None and fire < g
        if g < len(p):
            at_gold.append(p[g])
    n = max(len(anchors), 1)
    return {"stop_at_gold": at / n, "stop_early": early / n,
            "stop_late": (len(anchors) - at - early) / n, "mse": round(mse, 6),
            "stop_prob_at_gold": sum(at_gold) / max(len(at_gold), 1)}


def _serve_weights(served, head) -> None:
    """Copy ``head``'s trained parts into the engine's head (in place: graphs see them)."""
    with torch.no_grad():
        served.reasoning_head.load_state_dict(head.reasoning_head.state_dict())
        served.decoder.load_state_dict(head.decoder.state_dict())


def train_dagger(cfg: DaggerConfig, engine=None) -> dict:
    """``cfg.rounds`` DAgger rounds from the SFT bundle, round ``r``'s head written to
    ``<out stem>-round{r}<suffix>`` (the last to ``cfg.out``), the log to ``<out>.log.json``
    and returned. ValueError for an ``out`` that is a directory (checked first), a non-SFT
    bundle or another prompt format; FloatingPointError as ``sft.fit``."""
    check_out(cfg.out, "a bundle file", False, say_stderr)
    t0 = time.perf_counter()
    torch.manual_seed(cfg.seed)
    bundle = read_bundle(cfg.bundle)
    hc = bundle.config
    if bundle.target_proj is None or not bundle.has_stop_head or hc.target_layer is None:
        raise ValueError(f"{cfg.bundle} is not an SFT bundle (target_proj, target_layer and a "
                         "stop head are needed to label rollouts)")
    colar_texts = (hc.think_open, hc.think_close) == (COLAR_OPEN, COLAR_CLOSE)
    if (cfg.prompt_format == "colar") != colar_texts or not (hc.think_open is not None
                                                             and hc.think_close):
        raise ValueError(f"{cfg.bundle} was trained with think_open {hc.think_open!r} and "
                         f"think_close {hc.think_close!r}, which is not the "
                         f"{cfg.prompt_format!r} prompt format")
    c = hc.compression_factor or 1
    model, tok, _ = load_backbone(cfg.model, cfg.device, cfg.dtype)
    traces, teacher = capture_traces(model, tok, cfg, hc)
    del model
    if torch.cuda.is_available():
        torch.cuda.empty_cache()  # the engine sizes its KV pool from the free memory
    head = bundle.build().to(cfg.device)
    head.reasoning_head.requires_grad_(True)
    head.decoder.requires_grad_(True)
    engine, served = head_engine(engine, cfg,
                                 gpu_memory_utilization=cfg.gpu_memory_utilization)
    _serve_weights(served, head)
    set_policy_sampling(served, cfg.sigma)
    groups = [num_groups(len(t.reasoning), c) for t in traces]
    first = list(accumulate([g + 1 for g in groups], initial=0))  # trace i's row k = 0
    data, history = teacher, []
    gen = torch.Generator().manual_seed(cfg.seed)
    out = Path(cfg.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    try:
        for r in range(1, cfg.rounds + 1):
            t_round = time.perf_counter()
            pick = torch.randperm(len(traces), generator=gen).tolist()[:cfg.rollout_examples]
            anchors = rollout_anchors(engine, [traces[i].prompt for i in pick],
                                      [groups[i] + cfg.overshoot for i in pick])
            g = [groups[i] for i in pick]
            new = label_rollouts(anchors, teacher, [first[i] for i in pick], g)
            metrics = closed_loop_metrics(head, anchors, new, g, cfg.stop_threshold)
            t_roll = time.perf_counter() - t_round
            data = data.cat(new)
            res = fit(head, data, dataclasses.replace(cfg, seed=cfg.seed + r),
                      f"dagger round {r}")
            _serve_weights(served, head)
            path = out if r == cfg.rounds else out.with_name(f"{out.stem}-round{r}{out.suffix}")
            write_bundle(bundle_from_module(head, bundle.format_version), path)
            history.append({"round": r, "rollouts": len(pick), "new_rows": len(new.stop),
                            "rows": res["rows"], "closed_loop": metrics,
                            "loss_before": res["loss_before"], "loss_after": res["loss_after"],
                            "rollout_seconds": round(t_roll, 2),
                            "seconds": round(time.perf_counter() - t_round, 2)})
            log = write_log(cfg, t0, traces=len(traces), teacher_rows=len(teacher.stop),
                            history=history)
    finally:
        set_policy_sampling(served, None)
    return log
