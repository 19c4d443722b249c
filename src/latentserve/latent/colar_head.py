"""CoLaR served closed-loop by ``latent/head_loop.py`` (arXiv 2505.16552; upstream
``src/models/model_base.py`` ``latent_generate``; docs/internals.md)."""

from __future__ import annotations

import re

import torch
from torch import nn

from latentserve.latent.colar import SEPARATOR, SPEED, ColarConfig, LatentPolicy, load_colar
from latentserve.latent.head import refuse_controls, resolve_settings
from latentserve.latent.spec import LatentSpec
from latentserve.models.checkpoint import load_tokenizer
from latentserve.staging import to_device

# The per-request controls CoLaR takes (``SamplingParams`` fields; ``latent.spec.HEAD_FIELDS``).
CONTROLS = ("thinking", "max_latent", "min_latent", "use_stop", "compression_factor",
            "latent_temperature")
_SPEED_AT_END = re.compile(r"\(\s*Thinking\s*speed\s*:\s*(\d+)\s*\)\s*$")


class ColarHead(nn.Module):
    """CoLaR's latent step behind ``LatentHead``'s serve interface (reads the final-normed
    hidden; ``stop_token``: ``###``), plus :meth:`sample` and :meth:`prepare_request`.
    ``speed_ids``: ``c -> ids of "(Thinking speed: {c})"``."""

    capture_layer = -1
    has_stop = True
    policy_sigma: float | None = None  # head_loop.set_policy_sampling
    record_latents = False

    def __init__(self, config: ColarConfig, policy: LatentPolicy, separator_id: int,
                 speed_ids: dict[int, tuple[int, ...]], tokenizer):
        super().__init__()
        self.config = config
        self.policy = policy
        self.stop_token = int(separator_id)
        self.speed_ids = speed_ids
        self.tokenizer = tokenizer

    def serve_outputs(self, hidden: torch.Tensor) -> tuple[torch.Tensor, None]:
        """``(embeds_std * mean(hidden), None)``: ``[N, H]`` -> ``[N, H]`` float32."""
        p = self.policy
        return p.mean(p.fc(hidden.float())) * self.config.embeds_std, None

    def sample(self, hidden: torch.Tensor, temperatures: list[float], generators: list
               ) -> torch.Tensor:
        """``[n, H]`` float32 draws of ``Normal(mean, std * t_i) * embeds_std`` (upstream
        ``rsample() * embeds_std``), noise from ``generators[i]`` (None: global)."""
        t = to_device(temperatures, torch.float32, hidden.device)
        mean, std = self.policy.mean_std(hidden.float(), t[:, None])
        eps = torch.stack([torch.randn(mean.shape[-1], generator=g, device=mean.device)
                           for g in generators])
        return (mean + std * eps) * self.config.embeds_std

    def prepare_request(self, prompt_ids: list[int], params):
        """``(params, HeadSettings, ids to append)``: ``(Thinking speed: c)`` + ``###``
        (+ ``###`` with thinking off), none when the prompt ends with ``###`` (the speed it
        names, if any, is reported). Raises ValueError naming a control CoLaR does not take, a
        ``compression_factor`` out of range or beside such a prompt, or a named speed out of
        range."""
        refuse_controls(params, CONTROLS, "a CoLaR model")
        cfg = self.config
        c = params.compression_factor
        if c is not None and not 1 <= c <= cfg.max_compression_factor:
            raise ValueError(f"compression_factor must be in [1, {cfg.max_compression_factor}] "
                             f"for this model, got {c}")
        defaults = {"max_latent": cfg.max_latent, "min_latent": 0, "use_stop": True,
                    "stop_threshold": 0.5, "min_output_tokens": 0}  # the last two: inert
        hs = resolve_settings(params, defaults, "closed_loop", True)
        hs.end_ids, hs.answer_budget = (self.stop_token,), True
        hs.latent_temperature = float(params.latent_temperature or 0.0)
        if prompt_ids and prompt_ids[-1] == self.stop_token:  # the whole upstream prompt
            # the c of "(Thinking speed: c)" before the final ###, or None (reported as such)
            m = _SPEED_AT_END.search(self.tokenizer.decode(prompt_ids[-16:-1]))
            named = int(m.group(1)) if m else None
            if named is not None and not 1 <= named <= cfg.max_compression_factor:
                raise ValueError(f"prompt names {SPEED.format(named)}; the speed must be in "
                                 f"[1, {cfg.max_compression_factor}] for this model")
            if c is not None and named != c:
                why = ("contradicts the prompt's " + SPEED.format(named) if named is not None
                       else "would be ignored: the prompt ends with ### and names no speed")
                raise ValueError(f"compression_factor {c} {why}; send the question alone or "
                                 "leave compression_factor out")
            hs.compression_factor = named
            return params, hs, () if hs.thinking else hs.end_ids
        hs.compression_factor = cfg.compression_factor if c is None else c
        suffix = (*self.speed_ids[hs.compression_factor], self.stop_token)
        return params, hs, suffix if hs.thinking else (*suffix, *hs.end_ids)


def attach_colar(model, model_dir, hf_config, device) -> bool:
    """Attach ``model.latent_head`` (float32 :class:`ColarHead`), ``latent_head_mode`` and
    ``latent_spec`` from ``colar_config.json``; False without one. Raises ValueError for a bad
    config, a ``hidden_size`` not the backbone's, or a tokenizer without ``###``."""
    loaded = load_colar(model_dir)
    if loaded is None:
        return False
    cfg, policy = loaded
    if cfg.hidden_size != hf_config.hidden_size:
        raise ValueError(f"colar_config.json: hidden_size {cfg.hidden_size} is not the "
                         f"backbone's {hf_config.hidden_size}")
    tok = load_tokenizer(model_dir)
    sep = tok.convert_tokens_to_ids(SEPARATOR)
    if sep is None or sep == tok.unk_token_id:
        raise ValueError(f"the tokenizer of {model_dir} has no {SEPARATOR!r} token (CoLaR's "
                         "thinking separator)")
    speeds = {c: tuple(tok.encode(SPEED.format(c), add_special_tokens=False))
              for c in range(1, cfg.max_compression_factor + 1)}
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    model.latent_head = ColarHead(cfg, policy.float(), sep, speeds, tok).to(device)
    model.latent_head.requires_grad_(False)
    model.latent_head_mode = "closed_loop"
    model.latent_spec = LatentSpec(
        kind="head", family="colar", default_budget=0, max_budget=0,
        start_ids=(*speeds[cfg.compression_factor], sep), end_ids=(sep,),
        latent_id=int(pad or 0), controls=CONTROLS,
        max_compression_factor=cfg.max_compression_factor, default_max_latent=cfg.max_latent)
    return True
