"""Stage 1 of CoLaR (``latentserve train colar``): supervised compressed latent reasoning.

Design notes: docs/internals.md, "latentserve.train.colar".
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import torch
import torch.nn.functional as F

from latentserve.latent import colar
from latentserve.latent.spec import COMPRESSIONS
from latentserve.models.checkpoint import EMBEDDED_BASE_NAMES
from latentserve.train.cot import (
    _lm,
    batches,
    encode_parts,
    load_backbone,
    optimise,
    read_items,
    right_pad,
    save,
)
from latentserve.train.options import ColarTrainConfig, check_out

# (prompt ids at speed r, steps ids, answer ids = [###, *Answer:{a}, EOS])
Example = tuple[list[int], list[int], list[int]]


def draw_picks(steps_lens: list[int], r: int, rng: random.Random) -> list[list[int]]:
    """Per example, a uniform offset in each of its ``ceil(n / r)`` step groups: the label
    token (upstream ``sample_indices_from_attention_mask_3d``)."""
    return [[rng.randrange(min(r, n - g * r)) for g in range(-(-n // r))] for n in steps_lens]


def compress_groups(emb, group_ids: torch.Tensor, how: str = "sqrt_mean") -> torch.Tensor:
    """One compressed embedding per row of ``group_ids`` [G, r] (int64 token ids, -1 = pad
    after the real ones), from the embedding module ``emb``: [G, H] in its dtype.
    ``sqrt_mean`` (upstream CoLaR, arXiv 2505.16552): the sum over the real tokens divided
    by sqrt(count) + 1e-5 (not divided when r = 1). ``ramp`` (our extension,
    docs/training.md): token j of a group weighted j + 1 and the sum divided by the weights'
    L2 norm, so that a group's order is kept (a sum carries none). ValueError for another
    ``how``."""
    if how not in COMPRESSIONS:
        raise ValueError(f"compression must be one of {', '.join(COMPRESSIONS)}, got {how!r}")
    real = (group_ids >= 0).unsqueeze(-1)  # [G, r, 1]
    vectors = emb(group_ids.clamp(min=0))  # [G, r, H]
    if how == "ramp":
        w = torch.arange(1, group_ids.shape[1] + 1, device=vectors.device,
                         dtype=vectors.dtype).view(1, -1, 1) * real
        return (vectors * w).sum(1) / w.square().sum(1).sqrt()
    summed = (vectors * real).sum(1)
    return summed / (real.sum(1).sqrt() + 1e-5) if group_ids.shape[1] > 1 else summed


def colar_loss(model, policy: colar.LatentPolicy, batch: list[Example], r: int,
               picks: list[list[int]], embeds_std: float, embed_loss: str = "mse",
               noise: torch.Tensor | None = None, ce_weight: float = 1.0,
               embed_weight: float = 1.0, own_latent_prob: float = 0.0,
               compression: str = "sqrt_mean") -> dict[str, torch.Tensor]:
    """The SFT losses of ``batch`` at compression factor ``r``: ``picks`` from
    :func:`draw_picks`; ``compression`` as in :func:`compress_groups`; ``noise``
    ``[sum(K_i + 1), H]`` float32 normal draws for ``mse`` (None: ``torch.randn``);
    ``own_latent_prob`` > 0: the inputs go through :func:`feed_own_latents` first (targets
    stay gold). Returns float32 scalars ``total``, ``ce``, ``embed`` and counts ``n_ce``,
    ``n_embed``."""
    lm = _lm(model)
    emb = lm.get_input_embeddings()
    device = emb.weight.device
    sep = batch[0][2][0]
    # Example b: prompt [0, q) | c_0 .. c_k at [q, q + k] | answer. Groups of all examples in
    # order, [###] first, then the steps in runs of r (-1 = pad); c_rows: (b, position) of
    # each c (the latent rows), ce_rows: the positions whose logits predict the labels.
    groups, c_rows, ce_rows, ids, labels, fed = [], [], [], [], [], []
    for b, ((prompt, steps, answer), pick) in enumerate(zip(batch, picks)):
        q, k = len(prompt), -(-len(steps) // r)
        chunks = [[sep]] + [steps[g * r:(g + 1) * r] for g in range(k)]
        groups += [c + [-1] * (r - len(c)) for c in chunks]
        c_rows += [(b, q + g) for g in range(k + 1)]
        fed += [(b, q + g) for g in range(1, k + 1)]  # the latents the engine feeds
        ids.append(prompt + [0] * (k + 1) + answer)
        labels.append([sep] + [steps[g * r + p] for g, p in enumerate(pick)] + answer)
        ce_rows += [(b, q - 1 + j) for j in range(len(labels[-1]))]
    ids_t = right_pad(ids, 0, device)
    compressed = compress_groups(emb, torch.tensor(groups, device=device), compression)
    lb, lt = torch.tensor(c_rows, device=device).T
    x = emb(ids_t).index_put((lb, lt), compressed.to(emb.weight.dtype))  # [B, T, H]
    inputs = (feed_own_latents(lm, policy, x, fed, embeds_std, own_latent_prob)
              if own_latent_prob > 0 and fed else x)

    hidden = lm.model(inputs_embeds=inputs).last_hidden_state  # [B, T, H], post final norm
    cb, ct = torch.tensor(ce_rows, device=device).T
    target = torch.tensor([y for row in labels for y in row], device=device)
    ce = F.cross_entropy(lm.lm_head(hidden[cb, ct]).float(), target)

    dist = policy(hidden[lb, lt])
    mean, std = dist.mean.float(), dist.stddev.float()
    gold = x[lb, lt + 1].detach().float() / embeds_std
    if embed_loss == "mse":
        eps = torch.randn_like(mean) if noise is None else noise.to(mean)
        per_row = ((mean + std * eps - gold) ** 2).mean(-1)
    else:
        per_row = -torch.distributions.Normal(mean, std).log_prob(gold).mean(-1)
    embed = per_row.mean()
    return {"total": ce_weight * ce + embed_weight * embed, "ce": ce, "embed": embed,
            "n_ce": torch.tensor(len(target)), "n_embed": torch.tensor(len(c_rows))}


def feed_own_latents(lm, policy: colar.LatentPolicy, x: torch.Tensor,
                     rows: list[tuple[int, int]], embeds_std: float, prob: float
                     ) -> torch.Tensor:
    """Scheduled sampling (our extension, docs/training.md): ``x`` [B, T, H] with each latent
    position ``(b, t)`` of ``rows``, with probability ``prob``, replaced by what the engine
    would feed at temperature 0 (the policy's mean at ``t - 1`` of a no-grad pass, times
    ``embeds_std``)."""
    b, t = torch.tensor(rows, device=x.device).T
    with torch.no_grad():
        hidden = lm.model(inputs_embeds=x).last_hidden_state
        own = policy(hidden[b, t - 1].float()).mean * embeds_std
    take = torch.rand(len(rows), device=x.device) < prob
    return x.index_put((b[take], t[take]), own[take].to(x.dtype))


def adapter_base(adapter_dir: str) -> str | None:
    """A stage-0 adapter's base (None: the embedded SmolLM2; relative: beside the adapter).
    FileNotFoundError without ``adapter_config.json``."""
    path = Path(adapter_dir) / "adapter_config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist (--init-adapter takes a PEFT "
                                f"adapter directory, e.g. the output of train cot)")
    base = json.loads(path.read_text()).get("base_model_name_or_path")
    if base in (None, "", *EMBEDDED_BASE_NAMES):
        return None
    beside = Path(adapter_dir) / base
    return str(beside) if not Path(base).is_absolute() and beside.exists() else base


def train(cfg: ColarTrainConfig, progress=print) -> dict:
    """Run stage 1; returns the last log record. ValueError (``cfg.out`` cannot be a model
    directory, checked first; no ``###`` token, no example fits), FileNotFoundError (data,
    adapter), FloatingPointError (the loss turned NaN or inf; nothing saved)."""
    check_out(cfg.out, "a model directory", True, progress)
    if cfg.init_adapter and cfg.base is None:
        cfg.base = adapter_base(cfg.init_adapter)
    rng = random.Random(cfg.seed)
    random.seed(cfg.seed)
    torch.manual_seed(cfg.seed)
    items = [it for p in cfg.data for it in read_items(p)]
    model, tok, base_name = load_backbone(cfg.base, cfg.device, cfg)
    if tok.convert_tokens_to_ids(colar.SEPARATOR) in (None, tok.unk_token_id):
        raise ValueError(f"the tokenizer has no single {colar.SEPARATOR!r} token")
    keep = [(it.question, e) for it, e in zip(items, encode_parts(tok, items))
            if sum(map(len, e)) + 1 <= cfg.max_len]
    if not keep:
        raise ValueError(f"no training example fits max_len={cfg.max_len}")
    hidden = _lm(model).config.hidden_size
    prior = colar.load_colar(cfg.init_adapter) if cfg.init_adapter else None
    ccfg = colar.ColarConfig(
        hidden_size=hidden,
        intermediate_size=prior[0].intermediate_size if prior else
        cfg.intermediate_size or hidden,
        # default: the input embeddings' std (upstream: a constant per model, MODEL_EMB_STD)
        embeds_std=prior[0].embeds_std if prior else cfg.embeds_std or _lm(
            model).get_input_embeddings().weight.detach().float().std().item(),
        compression_factor=cfg.compression_factor,
        max_compression_factor=cfg.max_compression_factor, max_latent=cfg.max_latent,
        compression=cfg.compression)
    policy = (prior[1] if prior else colar.LatentPolicy(hidden, ccfg.intermediate_size)).to(
        cfg.device)
    params = [p for p in model.parameters() if p.requires_grad] + list(policy.parameters())
    progress(f"train colar: {len(keep)} examples, {sum(p.numel() for p in params)} trainable "
             f"parameters, {cfg.steps} steps of {cfg.batch_size}, r from "
             f"{list(cfg.train_factors or range(1, cfg.max_compression_factor + 1))}, "
             f"embeds_std {ccfg.embeds_std:.5g}")
    model.train()
    policy.train()
    order = batches(len(keep), cfg.batch_size)

    def step_loss() -> tuple[torch.Tensor, dict]:
        r = (rng.choice(cfg.train_factors) if cfg.train_factors
             else rng.randint(1, cfg.max_compression_factor))
        chosen = [keep[i] for i in next(order)]
        prompts = (colar.prompt_ids(tok, [q for q, _ in chosen], r, separator=False) if r > 1
                   else [p for _, (p, _, _) in chosen])
        batch = [(p, s, a) for p, (_, (_, s, a)) in zip(prompts, chosen)]
        picks = draw_picks([len(s) for _, s, _ in batch], r, rng)
        loss = colar_loss(model, policy, batch, r, picks, ccfg.embeds_std, cfg.embed_loss,
                          ce_weight=cfg.ce_weight, embed_weight=cfg.embed_weight,
                          own_latent_prob=cfg.own_latent_prob, compression=ccfg.compression)
        return loss["total"], {"ce": loss["ce"], "embed": loss["embed"], "r": r}

    def checkpoint(log: list[dict]) -> None:  # a servable directory, as train cot's + CoLaR's
        save(model, base_name, cfg, log, colar_files=(ccfg, policy), tok=tok)

    log = optimise(cfg, params, step_loss, checkpoint, progress)
    checkpoint(log)
    return log[-1]

