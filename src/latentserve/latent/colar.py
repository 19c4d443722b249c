"""CoLaR (arXiv 2505.16552, xiaomi-research/colar): its prompt format and latent policy.

An example is question + ``(Thinking speed: c)`` + ``###`` + reasoning + ``###`` +
``Answer:`` + answer + EOS (upstream ``model_base.py``); at speed ``c`` > 1 the reasoning is
``ceil(n / c)`` latent steps, ended when the LM head emits ``###`` at a latent position.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import nn

from latentserve.latent.spec import COMPRESSIONS, finite_positive

QUESTION = "Question: {} Let's think step by step:"
SPEED = "(Thinking speed: {})"
SEPARATOR = "###"
ANSWER = "Answer:{}"


def prompt_text(question: str, speed: int | str = 1) -> str:
    """The prompt a CoLaR model continues: question, thinking speed and the opening
    separator (upstream ``latent_generate``'s question part)."""
    return QUESTION.format(question) + SPEED.format(speed) + SEPARATOR


def prompt_ids(tok, questions: list[str], speed: int | str = 1, separator: bool = True
               ) -> list[list[int]]:
    """The prompt's ids per question: question, speed and (``separator``) ``###``, each
    tokenised on its own as the engine appends them (no BPE merge across the boundary)."""
    if not questions:
        return []
    qs = tok([QUESTION.format(q) for q in questions], add_special_tokens=False)["input_ids"]
    tail = tok.encode(SPEED.format(speed), add_special_tokens=False)
    if separator:
        tail = [*tail, tok.convert_tokens_to_ids(SEPARATOR)]
    return [q + tail for q in qs]


def split_output(text: str) -> tuple[str, str]:
    """``(reasoning, answer)``: the text before the closing ``###``, and what follows
    ``Answer:`` after it (else after ``###``), stripped."""
    reasoning, sep, rest = text.partition(SEPARATOR)
    if not sep:
        return text, ""
    prefix = ANSWER.format("")
    return reasoning, (rest.partition(prefix)[2] if prefix in rest else rest).strip()


# ------------------------------------------- model files (beside the backbone; docs/models.md)

COLAR_CONFIG = "colar_config.json"
POLICY_WEIGHTS = "latent_policy.safetensors"


@dataclass(frozen=True, slots=True)
class ColarConfig:
    """``colar_config.json``: ``hidden_size`` H, ``intermediate_size`` (upstream
    ``lp_intermediate_size``), ``deterministic`` (std 1e-9), ``embeds_std`` (upstream
    ``MODEL_EMB_STD``), ``compression_factor`` (default speed), ``max_compression_factor``,
    ``max_latent`` (upstream ``max_n_latent_forward``), ``compression`` (how training formed
    the latents the policy predicts, one of :data:`COMPRESSIONS`; serving does not read it)."""

    hidden_size: int
    intermediate_size: int
    embeds_std: float
    deterministic: bool = False
    compression_factor: int = 4
    max_compression_factor: int = 5
    max_latent: int = 64
    compression: str = "sqrt_mean"
    format_version: int = 1

    @classmethod
    def from_dict(cls, d: dict) -> ColarConfig:
        """Raises ValueError naming a missing or bad field."""
        if not isinstance(d, dict):
            raise ValueError(f"{COLAR_CONFIG} must hold a JSON object")
        unknown = set(d) - set(cls.__slots__)
        if unknown:
            raise ValueError(f"{COLAR_CONFIG}: unknown field(s) {sorted(unknown)}")
        for k in ("hidden_size", "intermediate_size", "embeds_std"):
            if k not in d:
                raise ValueError(f"{COLAR_CONFIG}: field {k!r} is required")
        cfg = cls(**d)
        for k in ("hidden_size", "intermediate_size", "compression_factor",
                  "max_compression_factor", "max_latent"):
            v = getattr(cfg, k)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{COLAR_CONFIG}: field {k!r} must be an integer >= 1, "
                                 f"got {v!r}")
        for k, ok, want in (
                ("embeds_std", finite_positive(cfg.embeds_std), "a finite number > 0"),
                ("deterministic", isinstance(cfg.deterministic, bool), "true or false"),
                ("format_version", cfg.format_version == 1, "1"),
                ("compression", cfg.compression in COMPRESSIONS,
                 f"one of {', '.join(map(repr, COMPRESSIONS))}"),
                ("compression_factor", cfg.compression_factor <= cfg.max_compression_factor,
                 f"<= max_compression_factor ({cfg.max_compression_factor})")):
            if not ok:
                raise ValueError(f"{COLAR_CONFIG}: field {k!r} must be {want}, got "
                                 f"{getattr(cfg, k)!r}")
        return cfg


class LatentPolicy(nn.Module):
    """Upstream ``src/modules/projector.py`` ``LatentPolicy``: ``fc`` = Linear(H, I), GELU,
    Linear(I, I), LayerNorm(I); ``mean`` / ``log_std`` = Linear(I, H): a Normal over the next
    embedding / ``embeds_std`` from the final-normed hidden ``[N, H]``."""

    def __init__(self, hidden_size: int, intermediate_size: int, deterministic: bool = False):
        super().__init__()
        self.deterministic = deterministic
        self.fc = nn.Sequential(nn.Linear(hidden_size, intermediate_size), nn.GELU(),
                                nn.Linear(intermediate_size, intermediate_size),
                                nn.LayerNorm(intermediate_size))
        self.mean = nn.Linear(intermediate_size, hidden_size)
        if not deterministic:
            self.log_std = nn.Linear(intermediate_size, hidden_size)

    def mean_std(self, hidden: torch.Tensor, temperature=1.0
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        """``hidden`` [..., H] -> mean and std [..., H] (in units of ``embeds_std``); a
        ``temperature`` tensor broadcasts against the std."""
        x = self.fc(hidden)
        mean = self.mean(x)
        if self.deterministic:
            return mean, torch.full_like(mean, 1e-9)
        return mean, self.log_std(x).exp() * temperature

    def forward(self, hidden: torch.Tensor, temperature: float = 1.0
                ) -> torch.distributions.Normal:
        """:meth:`mean_std` as a ``Normal``."""
        return torch.distributions.Normal(*self.mean_std(hidden, temperature))


def load_colar(model_dir: str | Path) -> tuple[ColarConfig, LatentPolicy] | None:
    """``(ColarConfig, float32 policy)`` of ``model_dir`` or None; ValueError for a bad
    config or policy keys, FileNotFoundError for a missing weights file."""
    from safetensors.torch import load_file

    d = Path(model_dir)
    if not (d / COLAR_CONFIG).is_file():
        return None
    cfg = ColarConfig.from_dict(json.loads((d / COLAR_CONFIG).read_text()))
    if not (d / POLICY_WEIGHTS).is_file():
        raise FileNotFoundError(f"{d / POLICY_WEIGHTS} is missing ({COLAR_CONFIG} is there)")
    policy = LatentPolicy(cfg.hidden_size, cfg.intermediate_size, cfg.deterministic)
    try:
        policy.load_state_dict({k: v.float() for k, v in load_file(d / POLICY_WEIGHTS).items()})
    except RuntimeError as e:
        raise ValueError(f"{d / POLICY_WEIGHTS} does not match {COLAR_CONFIG}: {e}") from None
    return cfg, policy.eval()


def save_colar(model_dir: str | Path, cfg: ColarConfig, policy: LatentPolicy) -> None:
    """Write ``colar_config.json`` and ``latent_policy.safetensors`` (float32)."""
    from safetensors.torch import save_file

    d = Path(model_dir)
    d.mkdir(parents=True, exist_ok=True)
    (d / COLAR_CONFIG).write_text(json.dumps(asdict(cfg), indent=1))
    save_file({k: v.detach().float().cpu().contiguous() for k, v in policy.state_dict().items()},
              str(d / POLICY_WEIGHTS))
