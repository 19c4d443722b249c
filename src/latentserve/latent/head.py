"""Compression heads with a learned stop (CoLaR-style latent reasoning on a frozen backbone;
docs/internals.md)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from latentserve import settings
from latentserve.core import LatentState
from latentserve.latent.spec import HEAD_FIELDS
from latentserve.settings import parse_bool

INJECTION_MODES = ("closed_loop", "prompt")
CONTROLS = HEAD_FIELDS[:6]  # this module's compression head
LOG_SIGMA_MIN, LOG_SIGMA_MAX = -10.0, 2.0
HEAD_BUNDLE_NAME = "latent_reasoning_head.safetensors"


@dataclass(frozen=True, slots=True)
class HeadConfig:
    """A bundle's ``config``: ``hidden_size`` H, ``latent_dim`` L, ``mlp_dim`` (None: H // 2),
    ``source_layer`` (0-based decoder layer whose output is the anchor), ``target_layer`` /
    ``compression_factor`` (training only), ``arch`` (``"v1"``), ``bank_m`` (v2 only),
    ``injection`` (``INJECTION_MODES``), ``think_open`` / ``think_close`` (span text; None:
    ``<think>`` / ``</think>``; ``""``: no ids)."""

    hidden_size: int
    latent_dim: int
    mlp_dim: int | None = None
    source_layer: int | None = None
    target_layer: int | None = None
    compression_factor: int | None = None
    arch: str = "v1"
    bank_m: int = 1
    injection: str = "closed_loop"
    think_open: str | None = None
    think_close: str | None = None

    @property
    def mlp(self) -> int:
        return self.mlp_dim or self.hidden_size // 2

    def to_dict(self) -> dict:
        return {k: getattr(self, k) for k in self.__slots__}

    @classmethod
    def from_dict(cls, d: dict) -> HeadConfig:
        """Raises ValueError naming a missing or bad field."""
        if not isinstance(d, dict):
            raise ValueError(  # noqa: TRY004 - a config error, like the others
                f"head config must be a JSON object, got {type(d).__name__}")
        for k in ("hidden_size", "latent_dim"):
            if k not in d:
                raise ValueError(f"head config: field {k!r} is required")
        known = {k: d[k] for k in cls.__slots__ if k in d and d[k] is not None}
        cfg = cls(**known)
        for k in ("hidden_size", "latent_dim", "mlp_dim", "source_layer", "bank_m"):
            v = getattr(cfg, k)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 0
                                  or (v == 0 and k != "source_layer")):
                raise ValueError(f"head config: field {k!r} must be a positive integer, "
                                 f"got {v!r}")
        for k in ("arch", "injection", "think_open", "think_close"):
            v = getattr(cfg, k)
            if v is not None and not isinstance(v, str):
                raise ValueError(f"head config: field {k!r} must be a string, got {v!r}")
        if cfg.injection not in INJECTION_MODES:
            raise ValueError(f"head config: field 'injection' must be one of "
                             f"{INJECTION_MODES}, got {cfg.injection!r}")
        return cfg


def silu_mlp(d_in: int, m: int, d_out: int) -> nn.Sequential:
    """Linear(d_in, m), SiLU, Linear(m, m), SiLU, Linear(m, d_out): upstream's arch v1 MLP."""
    return nn.Sequential(nn.Linear(d_in, m), nn.SiLU(), nn.Linear(m, m), nn.SiLU(),
                         nn.Linear(m, d_out))


class CompressionHead(nn.Module):
    """Upstream ``ReasoningCompressionHead`` (arch v1): ``forward(h [..., H] float32,
    layer-normed) -> (mu, log_sigma)`` ``[..., L]`` each; ``stop_logit(h) -> [..., 1]``."""

    def __init__(self, hidden_size: int, latent_dim: int, mlp_dim: int | None = None,
                 stop_head: bool = True):
        super().__init__()
        m = mlp_dim or hidden_size // 2
        self.hidden_size, self.latent_dim = hidden_size, latent_dim
        self.net = silu_mlp(hidden_size, m, 2 * latent_dim)
        self.stop_head = (nn.Sequential(nn.Linear(hidden_size, m // 2), nn.SiLU(),
                                        nn.Linear(m // 2, 1)) if stop_head else None)

    def forward(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if h.shape[-1] != self.hidden_size:
            raise ValueError(f"head input has last dim {h.shape[-1]}, expected "
                             f"{self.hidden_size}")
        mu, log_sigma = self.net(h).chunk(2, dim=-1)
        return mu, log_sigma.clamp(LOG_SIGMA_MIN, LOG_SIGMA_MAX)

    def stop_logit(self, h: torch.Tensor) -> torch.Tensor:
        if self.stop_head is None:
            raise ValueError("this head has no stop head (format_version < 3)")
        return self.stop_head(h)


class LatentHead(nn.Module):
    """Head + decoder (+ ``target_proj``) with the serve path's LayerNorms, in float32.

    ``anchor``: ``[N, H]`` source-layer residual stream, any float dtype.
    ``latent_input(anchor) -> [N, H] float32``; ``stop_prob(anchor) -> [N] float32`` or None.
    Serve interface (shared with ``ColarHead``): ``capture_layer``, ``stop_token``,
    ``has_stop``, ``serve_outputs``.
    """

    stop_token = None  # the stop is the stop head's probability, not a sampled token
    # GRPO rollout options (head_loop.set_policy_sampling); class defaults, so the step's
    # lookups do not fall through to nn.Module.__getattr__
    policy_sigma: float | None = None
    record_latents = False

    def __init__(self, config: HeadConfig, has_stop_head: bool = True,
                 has_target_proj: bool = False):
        super().__init__()
        self.config = config
        h, lat, m = config.hidden_size, config.latent_dim, config.mlp
        self.reasoning_head = CompressionHead(h, lat, m, stop_head=has_stop_head)
        # upstream LatentDecoder: z [..., L] -> an absolute input embedding [..., H]
        self.decoder = nn.ModuleDict({"net": silu_mlp(lat, m, h)})
        self.target_proj = nn.Linear(h, lat, bias=False) if has_target_proj else None

    @property
    def has_stop(self) -> bool:
        return self.reasoning_head.stop_head is not None

    @property
    def capture_layer(self) -> int:
        """The anchor is the residual stream after this many decoder layers."""
        return self.config.source_layer + 1

    def _ln_anchor(self, anchor: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(anchor.float(), (self.config.hidden_size,))

    def encode(self, anchor: torch.Tensor) -> torch.Tensor:
        """``mu`` of the head (``[N, L]`` float32): the MAP latent, as served upstream."""
        return self.policy(anchor)[0]

    def latent_input(self, anchor: torch.Tensor) -> torch.Tensor:
        return self.decode(self.encode(anchor))

    def policy(self, anchor: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(mu, log_sigma)`` ``[N, L]`` float32 each: the Gaussian policy GRPO trains."""
        return self.reasoning_head(self._ln_anchor(anchor))

    def decode(self, z: torch.Tensor) -> torch.Tensor:
        """``decoder(LN(z))``: ``[N, L]`` -> ``[N, H]`` float32."""
        return self.decoder.net(F.layer_norm(z, (self.config.latent_dim,)))

    def stop_prob(self, anchor: torch.Tensor) -> torch.Tensor | None:
        if not self.has_stop:
            return None
        return torch.sigmoid(self.reasoning_head.stop_logit(self._ln_anchor(anchor))[..., 0])

    def serve_outputs(self, anchor: torch.Tensor, fused: bool | None = None
                      ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(latent_input(anchor), stop_prob(anchor))``, ``[N, H]`` and ``[N]`` float32,
        computing only the ``mu`` half. ``fused`` (None: on CUDA): each Linear + SiLU as one
        ``decode_linear`` launch (3xTF32); ``False`` is exact. Captured into a CUDA graph, the
        stop head runs on a side stream, beside the head and decoder."""
        if fused is None:
            fused = anchor.is_cuda
        h = self._ln_anchor(anchor)
        lat = self.config.latent_dim
        side = None
        if self.has_stop and h.is_cuda and torch.cuda.is_current_stream_capturing():
            side = _side_stream(h.device)
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                probs = torch.sigmoid(_mlp(h, self.reasoning_head.stop_head, fused)[..., 0])
        mu = _mlp(h, self.reasoning_head.net, fused, last_out=lat)[..., :lat]
        vecs = _mlp(F.layer_norm(mu, (lat,)), self.decoder.net, fused)
        if not self.has_stop:
            return vecs, None
        if side is None:
            probs = torch.sigmoid(_mlp(h, self.reasoning_head.stop_head, fused)[..., 0])
        else:
            torch.cuda.current_stream().wait_stream(side)  # joins the capture
        return vecs, probs


_SIDE_STREAMS: dict = {}


def _side_stream(device: torch.device):
    """One side stream per CUDA device for branches captured into graphs."""
    if device not in _SIDE_STREAMS:
        _SIDE_STREAMS[device] = torch.cuda.Stream(device)
    return _SIDE_STREAMS[device]


def _mlp(x: torch.Tensor, layers: nn.Sequential, fused: bool,
         last_out: int | None = None) -> torch.Tensor:
    """``layers(x)`` (Linear, SiLU, ..., Linear), ``x [M, K]`` float32; ``fused``:
    ``decode_linear`` launches (3xTF32 on CUDA, SiLU in the epilogue), the last computing
    only its first ``last_out`` features (None: all)."""
    if not fused:
        return layers(x)
    from latentserve.ops.kernels.decode_linear import decode_linear

    linears = [m for m in layers if isinstance(m, nn.Linear)]  # SiLU between each two
    for i, layer in enumerate(linears):
        last = i == len(linears) - 1
        w, b = layer.weight, layer.bias
        if last and last_out is not None:
            w, b = w[:last_out], None if b is None else b[:last_out]
        block_n, split = fp32_tiling(*x.shape, w.shape[0])
        x = decode_linear(x, w, b, silu=not last, block_n=block_n, split_k=split)
    return x


def fp32_tiling(m: int, k: int, n: int, num_sms: int = 132) -> tuple[int, int]:
    """``(block_n, split_k)`` of ``decode_linear`` for a float32 ``[m, k] @ [k, n]`` (3xTF32):
    32 columns a program; K split into pieces of about 256, more (down to 128) while there
    are fewer than 0.9 programs per SM. Source: ``benchmarks.head_tiling`` on an H100
    (docs/benchmarks.md): the best of 15 tilings for each of the Llama-1B head's Linears."""
    tiles = -(-n // 32) * -(-m // 64)
    split = 1
    while split * 256 < k:
        split *= 2
    while tiles * split < 0.9 * num_sms and split * 128 < k:
        split *= 2
    return 32, split


# ----------------------------------------------------------------------------- controls

def template_thinking(template_kwargs: dict | None) -> bool | None:
    """Thinking on or off per ``template_kwargs`` ``thinking`` and ``enable_thinking`` (a
    bool, or a string ``settings.parse_bool`` reads); None when neither is set (a null is
    not set). Raises ValueError naming ``chat_template_kwargs.<key>`` for any other value
    (0, "maybe", []) or when the two disagree."""
    found: dict[str, bool] = {}
    for key in ("thinking", "enable_thinking"):
        value = (template_kwargs or {}).get(key)
        if isinstance(value, str):  # "false" from a client that stringifies kwargs
            value = parse_bool(f"chat_template_kwargs.{key}", value)
        if value is not None and not isinstance(value, bool):
            raise ValueError(f"chat_template_kwargs.{key} must be true or false, got "
                             f"{value!r}")
        if value is not None:
            found[key] = value
    if len(set(found.values())) > 1:
        raise ValueError("chat_template_kwargs.enable_thinking disagrees with "
                         "chat_template_kwargs.thinking; send one")
    return next(iter(found.values()), None)


def head_defaults(environ=None) -> dict:
    """Server defaults of the head controls from ``LATENTSERVE_<CONTROL>`` (``settings``).
    Raises ValueError naming a malformed variable."""
    out = {k: settings.get(f"LATENTSERVE_{k.upper()}", environ) for k in (
        "max_latent", "min_latent", "use_stop", "stop_threshold", "min_output_tokens")}
    for k in ("max_latent", "min_latent", "min_output_tokens"):  # settings parsed the types
        if out[k] < 0:
            raise ValueError(f"LATENTSERVE defaults: {k} must be an integer >= 0, got {out[k]}")
    if not 0.0 <= out["stop_threshold"] <= 1.0:
        raise ValueError(f"LATENTSERVE defaults: stop_threshold must be a number in [0, 1], "
                         f"got {out['stop_threshold']}")
    return out


def refuse_controls(params, controls: tuple[str, ...], what: str) -> None:
    """ValueError naming the first ``HEAD_FIELDS`` control ``params`` sets outside
    ``controls`` (it would do nothing); ``what`` names the head."""
    for name in HEAD_FIELDS:
        if name not in controls and getattr(params, name, None) is not None:
            raise ValueError(f"{name} is not a control of {what}; it takes "
                             f"{', '.join(controls)}")


def apply_output_floor(max_tokens: int, floor: int, cap: int) -> int:
    """``max_tokens`` raised to ``floor + cap`` when lower (latent steps spend output
    tokens); ``floor <= 0`` disables it."""
    if floor <= 0:
        return max_tokens
    return max(max_tokens, floor + max(0, cap))


@dataclass(slots=True)
class HeadSettings(LatentState):
    """One request's resolved head controls and its latent stats.

    ``steps``: latent positions run; ``stop_step``: steps when the stop fired;
    ``max_stop_prob`` / ``last_stop_prob``: largest / latest stop probability (CoLaR: of
    ``###``, traced requests only); ``end``: ``"stop"``, ``"cap"``, ``"length"`` or None;
    ``reported``: stats sent before the final output; ``answer_budget``: ``max_tokens``
    counts answer tokens only (CoLaR); ``compression_factor`` / ``latent_temperature``: CoLaR
    (``compression_factor`` None: a whole prompt naming no speed).
    """

    thinking: bool
    mode: str
    max_latent: int
    min_latent: int
    use_stop: bool
    stop_threshold: float
    min_output_tokens: int
    end_ids: tuple[int, ...] = ()
    steps: int = 0
    stop_step: int | None = None
    max_stop_prob: float | None = None
    last_stop_prob: float | None = None
    end: str | None = None
    # set_policy_sampling: per step (anchor [H], z [L]) or the injected input [H], float32 CPU
    actions: list | None = None
    reported: bool = False
    late: Any = None  # overlap mode: its head_late.Candidate, until settled
    answer_budget: bool = False
    compression_factor: int | None = None
    latent_temperature: float = 0.0

    @property
    def settled(self) -> bool:
        """No latent step is left to run: thinking off, or the phase has ended."""
        return not self.thinking or self.end is not None

    def stats(self) -> dict:
        out = {k: getattr(self, k) for k in (
            "thinking", "mode", "steps", "stop_step", "max_stop_prob", "end", "max_latent",
            "min_latent", "use_stop", "stop_threshold", "min_output_tokens")}
        if self.end is not None and self.last_stop_prob is not None:
            out["end_stop_prob"] = self.last_stop_prob
        if self.answer_budget:  # CoLaR: its controls instead of the floor's
            del out["stop_threshold"], out["min_output_tokens"]
            out["compression_factor"] = self.compression_factor
            out["latent_temperature"] = self.latent_temperature
        if self.actions is not None:
            out["actions"] = self.actions
        return out


def resolve_settings(params, defaults: dict, mode: str, has_stop: bool) -> HeadSettings:
    """Per-request controls, else the server default; ``latent_budget`` aliases ``max_latent``
    (0: thinking off; two different values are refused); ``use_stop`` needs a stop head.
    Raises ValueError naming the field."""
    budget, cap_sent = params.latent_budget, params.max_latent
    if budget is not None and cap_sent is not None and budget != cap_sent:
        raise ValueError(f"latent_budget must equal max_latent when both are sent (one "
                         f"control on this model: the latent step cap), got {budget} and "
                         f"{cap_sent}; give one")

    def pick(name):
        v = getattr(params, name, None)
        return defaults[name] if v is None else v

    source, cap = next(((k, v) for k, v in (("max_latent", params.max_latent),
                                            ("latent_budget", params.latent_budget))
                        if v is not None), ("this model's max_latent", defaults["max_latent"]))
    if params.thinking_token_budget is not None and params.thinking_token_budget < cap:
        source, cap = "thinking_token_budget", params.thinking_token_budget  # a step a token
    thinking = params.thinking if params.thinking is not None else params.latent_budget != 0
    floor = pick("min_latent")
    if params.min_latent is None:
        floor = min(floor, cap)  # a server default floor yields to the request's cap
    elif thinking and 0 < cap < floor:  # the cap would end the phase below the floor
        raise ValueError(f"min_latent must be at most {source} ({cap}), got {floor}")
    return HeadSettings(thinking=bool(thinking), mode=mode, max_latent=int(cap),
                        min_latent=int(floor),
                        use_stop=bool(pick("use_stop")) and has_stop,
                        stop_threshold=float(pick("stop_threshold")),
                        min_output_tokens=int(pick("min_output_tokens")))
