"""Stage 2 of a compression head: GRPO with the head as a Gaussian policy over the injected
latent (``latentserve train-head grpo``).

Design notes: docs/internals.md, "latentserve.train.grpo".
"""

from __future__ import annotations

import copy
import math
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm

from latentserve.config import EngineConfig
from latentserve.engine.llm_engine import LLMEngine
from latentserve.eval.answers import last_number, numbers_equal
from latentserve.eval.colar_eval import answers_match
from latentserve.eval.datasets import chat_prompt_ids
from latentserve.latent import colar
from latentserve.latent.bundle import bundle_from_module, read_bundle, write_bundle
from latentserve.latent.head_loop import set_policy_sampling
from latentserve.sampling_params import SamplingParams
from latentserve.train.cot import DivergenceWatch, read_items
from latentserve.train.options import GRPOConfig, check_out
from latentserve.train.sft import adamw_warmup_linear, say_stderr, write_log
from latentserve.train.traces import train_file


def reward(text: str, gold: str, stats: dict, prompt_format: str = "chat",
           close_bonus: float = 0.1) -> float:
    """1 when the answer is right, + ``close_bonus`` when the stop head ended the latent phase
    (``stats["end"] == "stop"``). Right: ``chat``, the last number of ``text`` equals ``gold``;
    ``colar``, the answer after ``Answer:`` matches it (upstream ``verify_answer``)."""
    if prompt_format == "colar":
        answer = text.partition(colar.ANSWER.format(""))[2].strip()
        right = bool(answer) and answers_match(gold, answer)
    else:
        right = numbers_equal(last_number(text), gold)
    return float(right) + close_bonus * (stats.get("end") == "stop")


def group_advantages(rewards: torch.Tensor, unbiased: bool = False,
                     eps: float = 1e-6) -> torch.Tensor:
    """``[Q, G]`` rewards -> float32 ``[Q, G]`` advantages ``(r - mean) / (std + eps)`` per row
    (population std; ``unbiased``: Bessel corrected, as upstream CoLaR's ``torch.std``); a row
    of equal rewards gives zeros."""
    r = rewards.float()
    return (r - r.mean(1, keepdim=True)) / (r.std(1, keepdim=True, unbiased=unbiased) + eps)


def policy_loss(policy, ref, actions: list[list], adv: torch.Tensor, sigma: float,
                kl_coef: float) -> tuple[torch.Tensor, dict]:
    """The GRPO loss of rollouts ``actions[i]`` = ``[(anchor [H], z [L])]`` with advantages
    ``adv [n]``. Returns ``(loss, {"pg", "kl", "latent_steps"})``."""
    rows = [(i, a, z) for i, acts in enumerate(actions) for a, z in acts]
    dev = next(policy.parameters()).device
    if not rows:
        zero = torch.zeros((), device=dev, requires_grad=True)
        return zero, {"pg": 0.0, "kl": 0.0, "latent_steps": 0}
    i, a, z = zip(*rows)
    idx, anchors, z = torch.tensor(i, device=dev), torch.stack(a).to(dev), torch.stack(z).to(dev)
    mu = policy.encode(anchors)
    with torch.no_grad():
        mu_ref = ref.encode(anchors)
    logp = (-0.5 * ((z - mu) / sigma) ** 2 - math.log(sigma)
            - 0.5 * math.log(2 * math.pi)).mean(-1)  # [steps], per-dim mean
    n = len(actions)
    counts = torch.zeros(n, device=dev).index_add_(0, idx, torch.ones_like(logp))
    per_rollout = torch.zeros(n, device=dev).index_add(0, idx, logp) / counts.clamp(min=1)
    has = counts > 0
    pg = -(adv.to(dev)[has] * per_rollout[has]).mean()
    kl = (((mu - mu_ref) ** 2).mean(-1) / (2 * sigma ** 2)).mean()
    loss = pg + kl_coef * kl
    return loss, {"pg": float(pg.detach()), "kl": float(kl.detach()), "latent_steps": len(rows)}


def run_requests(engine, requests: list[tuple], tag: str) -> list[tuple[list[int], dict]]:
    """``(prompt ids, SamplingParams)`` pairs through ``engine`` in one batch; per request its
    output ids and ``latent_stats``. RuntimeError naming a failed request."""
    base = f"{tag}-{time.monotonic_ns()}-"
    toks: dict[str, list[int]] = {f"{base}{i}": [] for i in range(len(requests))}
    for rid, (ids, params) in zip(toks, requests):
        engine.add_request(rid, ids, params)
    stats = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.rid in toks:
                toks[o.rid] += o.new_token_ids
                if o.finished:
                    if o.finish_reason == "error":
                        raise RuntimeError(f"rollout {o.rid} failed: {o.error}")
                    stats[o.rid] = o.latent_stats or {}
    return [(toks[r], stats[r]) for r in toks]


def head_engine(engine, cfg, **options):
    """``(engine, its head)``; ``engine`` None: one serving ``cfg.bundle`` over ``cfg.model``
    (``options``: ``EngineConfig`` fields). ValueError when it serves no compression head."""
    if engine is None:
        engine = LLMEngine(EngineConfig(model=cfg.model, latent_head=cfg.bundle,
                                        device=cfg.device, dtype=cfg.dtype,
                                        max_num_seqs=cfg.max_num_seqs, kv_slots=cfg.kv_slots,
                                        enforce_eager=cfg.enforce_eager, **options))
    if engine.latent_spec is None or engine.latent_spec.kind != "head":
        raise ValueError("the engine serves no compression head")
    return engine, engine.runner.model.latent_head


def train_grpo(cfg: GRPOConfig, reward_fn=None, engine=None) -> dict:
    """``cfg.steps`` GRPO steps from the SFT bundle, written to ``cfg.out`` and
    ``<out>.log.json``; returns the log. ``reward_fn(text, gold, stats)`` replaces
    :func:`reward`. ValueError for an ``out`` that is a directory (checked first) or when the
    engine serves no compression head; FloatingPointError naming the step whose loss is NaN
    or inf (nothing saved then)."""
    check_out(cfg.out, "a bundle file", False, say_stderr)
    t0 = time.perf_counter()
    torch.manual_seed(cfg.seed)
    bundle = read_bundle(cfg.bundle)
    engine, served = head_engine(engine, cfg)
    set_policy_sampling(served, cfg.sigma)
    policy = bundle.build().to(cfg.device)
    ref = copy.deepcopy(policy).requires_grad_(False)
    policy.reasoning_head.net.requires_grad_(True)
    params = list(policy.reasoning_head.net.parameters())
    opt, sched = adamw_warmup_linear(params, cfg.lr, cfg.steps, warmup=0.0)
    items = read_items(train_file(cfg.data))[:cfg.max_examples]
    tok = engine.tokenizer
    n_close = len(engine.latent_spec.end_ids)
    sp = SamplingParams(max_tokens=cfg.max_latent + n_close + cfg.answer_tokens,
                        temperature=0.0, max_latent=cfg.max_latent,
                        min_latent=cfg.min_latent, use_stop=True,
                        stop_threshold=cfg.stop_threshold, min_output_tokens=0)
    reward_of = reward_fn or (lambda t, g, s: reward(t, g, s, cfg.prompt_format,
                                                     cfg.close_bonus))
    gen = torch.Generator().manual_seed(cfg.seed)
    order = torch.randperm(len(items), generator=gen).tolist()
    history = []
    bar = tqdm(range(cfg.steps), desc="grpo", unit="step", disable=not cfg.progress)
    watch = DivergenceWatch(cfg.lr)
    for step in bar:
        pick = [items[order[(step * cfg.questions_per_step + j) % len(items)]]
                for j in range(cfg.questions_per_step)]
        # the prefill before the head's opening ids: CoLaR's prompt at speed 1, or the chat's
        qs = [it.question for it in pick]
        prompts = (colar.prompt_ids(tok, qs) if cfg.prompt_format == "colar"
                   else [chat_prompt_ids(tok, q) for q in qs])
        outs = run_requests(engine, [(ids, sp) for ids in prompts
                                     for _ in range(cfg.group_size)], "grpo")
        golds = [it.gold for it in pick for _ in range(cfg.group_size)]
        texts = [tok.decode(t, skip_special_tokens=True) for t, _ in outs]
        r = torch.tensor([reward_of(t, g, st) for t, g, (_, st) in zip(texts, golds, outs)])
        adv = group_advantages(r.view(cfg.questions_per_step, cfg.group_size)).flatten()
        actions = [st.get("actions") or [] for _, st in outs]
        loss, parts = policy_loss(policy, ref, actions, adv, cfg.sigma, cfg.kl_coef)
        watch.see(step, loss)
        watch.check()  # no extra sync: policy_loss's parts are read already
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
        with torch.no_grad():
            served.reasoning_head.load_state_dict(policy.reasoning_head.state_dict())
        acc = sum(reward(t, g, {}, cfg.prompt_format, 0.0)
                  for t, g in zip(texts, golds)) / len(texts)
        closed = sum(st.get("end") == "stop" for _, st in outs) / len(outs)
        row = {"step": step, "reward": float(r.mean()), "accuracy": acc, "closed": closed,
               **parts, "reward_std": float(r.std(unbiased=False))}
        history.append(row)
        bar.set_postfix(reward=f"{row['reward']:.3f}", acc=f"{acc:.2f}", kl=f"{parts['kl']:.4f}")
        if cfg.save_every and (step + 1) % cfg.save_every == 0 and step + 1 < cfg.steps:
            _save(policy, bundle.format_version, cfg, history, t0)
    set_policy_sampling(served, None)
    return _save(policy, bundle.format_version, cfg, history, t0)


def _save(policy, format_version: int, cfg: GRPOConfig, history: list, t0: float) -> dict:
    Path(cfg.out).parent.mkdir(parents=True, exist_ok=True)
    write_bundle(bundle_from_module(policy, format_version), cfg.out)
    return write_log(cfg, t0, history=history)
