"""Stage 3 of CoLaR (``latentserve train colar-grpo``; upstream's second stage): GRPO over
the latent policy and the answer tokens, with the rollouts run by our engine.

Design notes: docs/internals.md, "latentserve.train.colar_grpo".
"""

from __future__ import annotations

import json
import random
import time
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch.nn.utils.rnn import pad_sequence

from latentserve.config import EngineConfig
from latentserve.engine.llm_engine import LLMEngine
from latentserve.eval.colar_eval import answers_match
from latentserve.latent import colar
from latentserve.latent.head_loop import set_policy_sampling
from latentserve.models.checkpoint import is_adapter_dir
from latentserve.models.lora import merged_weight
from latentserve.sampling_params import SamplingParams
from latentserve.train.colar import adapter_base
from latentserve.train.cot import (
    _lm,
    batches,
    load_backbone,
    read_items,
    right_pad,
    save,
    trainer_forward,
)
from latentserve.train.grpo import group_advantages, run_requests
from latentserve.train.options import ColarGRPOConfig, check_out

# GRPOLoss with ``average_per_token_loss: False`` divides each sequence's summed loss by this
# constant (upstream ``masked_sum``).
SUM_DIVISOR = 32


@dataclass(slots=True)
class Rollout:
    """One rollout: ``prompt_ids`` (question, speed, ``###``), ``latents`` ``[n, H]`` float32,
    ``answer_ids`` (``###``, sampled tokens), ``text``, ``end`` ("stop" or "cap")."""

    prompt_ids: list[int]
    latents: torch.Tensor
    answer_ids: list[int]
    text: str
    end: str

    @property
    def n_latent(self) -> int:
        return self.latents.shape[0]


def reward_stats(rewards: torch.Tensor) -> dict:
    """Of ``[Q, G]`` rewards: ``reward`` (mean), ``reward_var``, ``group_reward_var`` (mean
    within-group variance), ``zero_var_groups`` (share of groups without a gradient)."""
    r = rewards.float()
    return {"reward": float(r.mean()), "reward_var": float(r.var(unbiased=False)),
            "group_reward_var": float(r.var(1, unbiased=False).mean()),
            "zero_var_groups": float((r == r[:, :1]).all(1).float().mean())}


def rollout_logprobs(model, policy: colar.LatentPolicy, batch: list[Rollout],
                     embeds_std: float, latent_temperature: float = 1.0,
                     answer_temperature: float = 1.0) -> tuple[list, list]:
    """Per rollout float32 ``(latent log-probs [n], answer log-probs [len(answer_ids)])``
    from one teacher-forced forward over ``prompt | latents | answer_ids`` (upstream
    ``get_logprobs``). FloatingPointError naming a non-finite hidden state."""
    lm = _lm(model)
    emb = lm.get_input_embeddings()
    dev = emb.weight.device
    ids, lat_pos, ans_pos, targets = [], [], [], []
    for b, r in enumerate(batch):
        q, n = len(r.prompt_ids), r.n_latent
        ids.append(r.prompt_ids + [0] * n + r.answer_ids)
        lat_pos += [(b, q + k) for k in range(n)]
        ans_pos += [(b, q + n - 1 + j) for j in range(len(r.answer_ids))]
        targets += r.answer_ids
    x = emb(right_pad(ids, 0, dev))
    if lat_pos:
        lb, lt = torch.tensor(lat_pos, device=dev).T
        z = torch.cat([r.latents for r in batch]).to(dev)
        x = x.index_put((lb, lt), z.to(x.dtype))
    hidden = lm.model(inputs_embeds=x).last_hidden_state  # [B, T, H], after the final norm
    bad = ~torch.isfinite(hidden).all(-1) & right_pad([[1] * len(s) for s in ids], 0, dev).bool()
    if bad.any():
        b, t = (int(v) for v in bad.nonzero()[0])
        r = batch[b]
        raise FloatingPointError(
            f"non-finite hidden state in rollout {b} at position {t} (prompt "
            f"{len(r.prompt_ids)}, latents {r.n_latent}, answer {len(r.answer_ids)}); its "
            f"latents' largest |value| {float(r.latents.abs().max()) if r.n_latent else 0:.3g}, "
            f"input at that position finite: {bool(torch.isfinite(x[b, t]).all())}, "
            f"answer ids {r.answer_ids[:8]}; non-finite rows "
            f"{bad.any(-1).nonzero()[:, 0].tolist()}")
    ab, at = torch.tensor(ans_pos, device=dev).T
    logits = lm.lm_head(hidden[ab, at]).float()
    if answer_temperature > 0:
        logits = logits / answer_temperature
    ans = F.log_softmax(logits, -1).gather(-1, torch.tensor(targets, device=dev)[:, None])[:, 0]
    lat = torch.zeros(0, device=dev)
    if lat_pos:
        with torch.autocast(dev.type, enabled=False):
            dist = policy(hidden[lb, lt - 1].float(), temperature=latent_temperature)
            lat = dist.log_prob(z.float() / embeds_std).mean(-1)
    return (list(lat.split([r.n_latent for r in batch])),
            list(ans.split([len(r.answer_ids) for r in batch])))


def grpo_loss(new: tuple[list, list], old: tuple[list, list], adv: torch.Tensor,
              clip_eps: float = 0.2, average: str = "sum", use_latent: bool = True,
              use_answer: bool = True, max_log_ratio: float | None = None
              ) -> dict[str, torch.Tensor]:
    """Upstream ``GRPOLoss.forward`` on a minibatch (``new`` / ``old`` from
    :func:`rollout_logprobs`, ``adv`` ``[B]``): scalars ``total``, ``latent``, ``answer``
    (0 when off), each upstream ``calculate_loss``: the clipped surrogate per sequence summed
    / :data:`SUM_DIVISOR` ("sum") or averaged over tokens ("mean"); ``max_log_ratio`` clamps
    ``logp - logp_old`` (None: as upstream)."""
    parts = {}
    for name, i, on in (("latent", 0, use_latent), ("answer", 1, use_answer)):
        if not on:
            parts[name] = torch.zeros((), device=adv.device)
            continue
        logp = pad_sequence(new[i], batch_first=True)  # [B, L], right-padded with 0
        log_ratio = logp - pad_sequence([t.detach() for t in old[i]], batch_first=True)
        lengths = torch.tensor([len(t) for t in new[i]], device=logp.device)
        mask = torch.arange(logp.shape[1], device=logp.device) < lengths[:, None]
        if max_log_ratio is not None:
            log_ratio = log_ratio.clamp(-max_log_ratio, max_log_ratio)
        ratio, a = log_ratio.exp(), adv.to(logp.device)[:, None]
        per_tok = -torch.min(ratio * a, ratio.clamp(1 - clip_eps, 1 + clip_eps) * a) * mask
        per_seq = per_tok.sum(-1) / (SUM_DIVISOR if average == "sum"
                                     else mask.sum(-1).clamp(min=1))
        parts[name] = per_seq.mean()
    return {"total": parts["latent"] + parts["answer"], **parts}


# ----------------------------------------------------------------------------- the engine

# HF projection -> (the engine's fused projection holding it, the fused ones in row order)
_FUSED = {leaf: (fused, order) for fused, order in (
    ("qkv_proj", ("q_proj", "k_proj", "v_proj")), ("gate_up_proj", ("gate_proj", "up_proj")))
    for leaf in order}
_PEFT_PREFIX = "base_model.model."


class EngineSync:
    """Pushes the trainable PEFT model's weights into the ``LLMEngine`` serving the same
    stage-1 directory (LoRA layers onto same-named modules or rows of ``qkv_proj`` /
    ``gate_up_proj``). ValueError for a tensor-parallel engine, no LoRA layers, or a missing
    or differently shaped engine weight."""

    def __init__(self, engine, model):
        from peft.tuners.lora import LoraLayer

        if engine.tp is not None:
            raise ValueError("colar-grpo needs a single-process engine "
                             "(tensor_parallel_size 1)")
        mods = dict(engine.runner.model.named_modules())
        self.engine, self.targets = engine, []
        for name, layer in model.named_modules():
            if isinstance(layer, LoraLayer):
                hf = name.removeprefix(_PEFT_PREFIX)
                dest = self._dest(mods, hf, model)
                if dest.shape != layer.get_base_layer().weight.shape:
                    raise ValueError(f"engine weight {hf} is {tuple(dest.shape)}, the trained "
                                     f"one {tuple(layer.get_base_layer().weight.shape)}")
                self.targets.append((layer, dest))
        if not self.targets:
            raise ValueError("the trainable model has no LoRA layer")

    @staticmethod
    def _dest(mods: dict, name: str, model) -> torch.Tensor:
        """The engine tensor (a view for a fused projection) that holds HF weight ``name``."""
        if name in mods:
            return mods[name].weight
        parent, _, leaf = name.rpartition(".")
        fused, order = _FUSED.get(leaf, (None, ()))
        host = mods.get(parent)
        if fused is None or host is None or not hasattr(host, fused):
            raise ValueError(f"the engine's model has no weight for {name!r}")
        sizes = [model.get_submodule(_PEFT_PREFIX + f"{parent}.{o}").weight.shape[0]
                 for o in order]
        return getattr(host, fused).weight.split(sizes)[order.index(leaf)]

    @torch.no_grad()
    def push(self, policy: colar.LatentPolicy) -> None:
        """Engine weights := ``base + B @ A * scale`` (``models.lora.merged_weight``), its
        ``ColarHead`` := ``policy``; empties the prefix cache (RuntimeError while requests
        run)."""
        for layer, dest in self.targets:
            ad = layer.active_adapters[0]
            w = merged_weight(layer.get_base_layer().weight, layer.lora_A[ad].weight,
                              layer.lora_B[ad].weight, layer.scaling[ad])
            dest.copy_(w)
        self.engine.runner.model.latent_head.policy.load_state_dict(policy.state_dict())
        self.engine.cache.radix.reset()


def run_rollouts(engine, prompts: list[list[int]], params, group_size: int,
                 latent_dtype: torch.dtype) -> list[Rollout]:
    """Each prompt ``group_size`` times through ``engine`` (latents rounded to
    ``latent_dtype``); the rollouts prompt-major."""
    head = engine.runner.model.latent_head
    c = params.compression_factor or head.config.compression_factor
    tail = [*head.speed_ids[c], head.stop_token]
    outs = run_requests(engine, [(ids, params) for ids in prompts for _ in range(group_size)],
                        "grpo")
    res = []
    for k, (tokens, st) in enumerate(outs):
        acts = st.get("actions") or []
        if len(acts) != st.get("steps", 0):
            raise RuntimeError(f"rollout {k}: {len(acts)} latents recorded for "
                               f"{st.get('steps')} steps (is recording on?)")
        lat = torch.stack(acts).to(latent_dtype).float() if acts else \
            torch.zeros(0, head.config.hidden_size)
        res.append(Rollout(prompt_ids=list(prompts[k // group_size]) + tail, latents=lat,
                           answer_ids=[head.stop_token, *tokens],
                           text=engine.tokenizer.decode(tokens, skip_special_tokens=True),
                           end=st.get("end") or "cap"))
    return res


def rewards_of(rollouts: list[Rollout], golds: list[str], cfg: ColarGRPOConfig,
               max_latent: int, reward_fn=None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rewards [N], accuracies [N])`` float32; ``reward_fn(rollout, gold) -> float``
    replaces the 0/1 accuracy before the length terms."""
    prefix = colar.ANSWER.format("")  # the answer as upstream extract_answer_from_output takes
    # it: what follows the first Answer: up to a second one, else the whole text
    acc = torch.tensor([float(answers_match(g, (r.text.split(prefix)[1] if prefix in r.text
                                                 else r.text).strip()))
                        for r, g in zip(rollouts, golds)])
    base = acc.clone() if reward_fn is None else torch.tensor(
        [float(reward_fn(r, g)) for r, g in zip(rollouts, golds)])
    n = torch.tensor([float(r.n_latent) for r in rollouts])
    if cfg.punish_latent_length:
        base = base / n.clamp(min=1)
    return base - cfg.length_penalty * n / max_latent, acc


# ----------------------------------------------------------------------------- training

def train(cfg: ColarGRPOConfig, progress=print, engine=None, reward_fn=None) -> dict:
    """Run ``cfg.steps`` GRPO steps and write ``cfg.out``; returns the last log record.
    ``engine``: an ``LLMEngine`` serving ``cfg.model`` (else built; ends with the trained
    weights); ``reward_fn(rollout, gold) -> float`` replaces the accuracy reward.

    Raises ValueError (``cfg.out`` cannot be a model directory, checked first; bad option, no
    LoRA adapter or ``colar_config.json``, a deterministic policy, an untrained compression
    factor, an engine not serving CoLaR), FileNotFoundError (missing data) and
    FloatingPointError (non-finite weights or rollouts; nothing saved)."""
    check_out(cfg.out, "a model directory", True, progress)
    t0 = time.time()
    src = Path(cfg.model)
    loaded = colar.load_colar(src)
    if loaded is None or not is_adapter_dir(src):
        raise ValueError(f"{src} is not a stage-1 CoLaR directory with a LoRA adapter "
                         f"(adapter_config.json and {colar.COLAR_CONFIG}; train colar with "
                         "--lora-r > 0 writes one)")
    ccfg, policy = loaded
    if ccfg.deterministic:
        raise ValueError(f"{src}: the latent policy is deterministic; GRPO needs its std")
    c = ccfg.compression_factor if cfg.compression_factor is None else cfg.compression_factor
    if not 1 <= c <= ccfg.max_compression_factor:
        raise ValueError(f"compression_factor must be in [1, {ccfg.max_compression_factor}] "
                         f"for {src}, got {c}")
    max_latent = ccfg.max_latent if cfg.max_latent is None else cfg.max_latent
    items = [it for p in cfg.data for it in read_items(p)][:cfg.max_examples]
    if not items:
        raise ValueError(f"no training items in {cfg.data}")
    dtype = cfg.dtype or ("bfloat16" if cfg.device.startswith("cuda") else "float32")
    if engine is None:
        engine = LLMEngine(EngineConfig(model=str(src), device=cfg.device, dtype=dtype,
                                        max_num_seqs=cfg.max_num_seqs, kv_slots=cfg.kv_slots,
                                        enforce_eager=cfg.enforce_eager))
    if getattr(engine.latent_spec, "family", None) != "colar":
        raise ValueError("the engine does not serve a CoLaR model")
    model, _, base_name = load_backbone(adapter_base(str(src)), cfg.device,
                                        SimpleNamespace(init_adapter=str(src), lora_r=1))
    model.eval()  # no dropout: old and new log-probs come from the same function
    policy = policy.to(cfg.device)
    params = [p for p in model.parameters() if p.requires_grad] + list(policy.parameters())
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    sync = EngineSync(engine, model)
    sync.push(policy)  # the engine runs exactly the trainer's weights from the first step
    head = engine.runner.model.latent_head
    set_policy_sampling(head, record=True)
    sp = SamplingParams(max_tokens=cfg.answer_tokens, temperature=cfg.answer_temperature,
                        top_p=cfg.answer_top_p, compression_factor=c, max_latent=max_latent,
                        latent_temperature=cfg.latent_temperature)
    latent_dtype = getattr(torch, engine.config.dtype)
    order = batches(len(items), cfg.questions_per_step, random.Random(cfg.seed))
    shuffle = torch.Generator().manual_seed(cfg.seed)
    log: list[dict] = []

    def checkpoint() -> None:  # as train colar writes it, but the adapter in float32 (an RL
        # step at lr 1e-6 moves the LoRA weights far less than a bfloat16 ulp)
        save(model, base_name, cfg, log, torch.float32, colar_files=(ccfg, policy))

    progress(f"train colar-grpo: {len(items)} items, {sum(p.numel() for p in params)} "
             f"trainable parameters, {cfg.steps} steps of {cfg.questions_per_step} x "
             f"{cfg.group_size} rollouts, speed {c}, max_latent {max_latent}")

    def logprobs(batch):
        with trainer_forward(cfg.device, cfg.autocast):
            return rollout_logprobs(model, policy, batch, ccfg.embeds_std,
                                    cfg.latent_temperature if cfg.tempered_logprobs else 1.0,
                                    cfg.answer_temperature)

    torch.manual_seed(cfg.seed)  # the rollouts' draws do not depend on what loading drew
    try:
        for step in range(1, cfg.steps + 1):
            ts = time.time()
            pick = [items[i] for i in next(order)]
            prompts = engine.tokenizer([colar.QUESTION.format(it.question) for it in pick],
                                       add_special_tokens=False)["input_ids"]
            rolls = run_rollouts(engine, prompts, sp, cfg.group_size, latent_dtype)
            golds = [it.gold for it in pick for _ in range(cfg.group_size)]
            rewards, acc = rewards_of(rolls, golds, cfg, max_latent, reward_fn)
            grid = rewards.view(cfg.questions_per_step, cfg.group_size)
            adv = group_advantages(grid, unbiased=True, eps=1e-8).flatten()
            t_roll = time.time() - ts
            perm = torch.randperm(len(rolls), generator=shuffle).tolist()
            mbs = [perm[i:i + cfg.exp_batch_size]
                   for i in range(0, len(perm), cfg.exp_batch_size)]
            with torch.no_grad():
                old = [logprobs([rolls[i] for i in mb]) for mb in mbs]
            sums = {"loss": 0.0, "latent_loss": 0.0, "answer_loss": 0.0, "grad_norm": 0.0}
            skipped, max_logratio = 0, 0.0
            for mb, mb_old in zip(mbs, old):
                new = logprobs([rolls[i] for i in mb])
                max_logratio = max([max_logratio] + [float((n - o).abs().max().detach())
                                                     for n, o in zip(new[0], mb_old[0])
                                                     if len(n)])
                loss = grpo_loss(new, mb_old, adv[mb].to(cfg.device), cfg.clip_eps,
                                 cfg.loss_average, cfg.use_latent_loss, cfg.use_answer_loss,
                                 cfg.max_log_ratio)
                opt.zero_grad(set_to_none=True)
                loss["total"].backward()
                norm = torch.nn.utils.clip_grad_norm_(params, 1.0)
                if not torch.isfinite(norm):  # a non-finite gradient: this update is skipped
                    skipped += 1
                    continue
                opt.step()
                for k, v in (("loss", loss["total"]), ("latent_loss", loss["latent"]),
                             ("answer_loss", loss["answer"]), ("grad_norm", norm)):
                    sums[k] += float(v.detach()) / len(mbs)
            sync.push(policy)
            rec = {"step": step, **reward_stats(grid), "accuracy": float(acc.mean()),
                   "latent_steps": sum(r.n_latent for r in rolls) / len(rolls),
                   "stopped": sum(r.end == "stop" for r in rolls) / len(rolls),
                   **{k: round(v, 6) for k, v in sums.items()},
                   "skipped_updates": skipped,
                   "max_latent_logratio": round(max_logratio, 4),
                   "rollout_seconds": round(t_roll, 2),
                   "seconds": round(time.time() - ts, 2),
                   "total_seconds": round(time.time() - t0, 1)}
            log.append(rec)
            progress(json.dumps(rec))
            timed_out = cfg.max_seconds and time.time() - t0 > cfg.max_seconds
            if cfg.save_every and step % cfg.save_every == 0 and step < cfg.steps:
                checkpoint()
            if timed_out:
                progress(f"stopping at step {step}: max_seconds {cfg.max_seconds} reached")
                break
    finally:
        set_policy_sampling(head, record=False)
    checkpoint()
    return log[-1] if log else {}

