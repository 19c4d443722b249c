"""What the engine hands back: per-step ``StepOutput``s and vLLM-shaped finished results."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class TokenLogprob:
    """Raw natural-log probabilities at one position: the sampled token's, its 1-based
    ``rank``, and ``top`` k ``(token_id, logprob)`` pairs, most likely first."""

    token_id: int
    logprob: float
    rank: int
    top: list[tuple[int, float]] = field(default_factory=list)


@dataclass(slots=True)
class Logprob:
    """vLLM's ``Logprob`` (``vllm/logprobs.py``); ``decoded_token`` is the token decoded on its
    own (U+FFFD for part of a UTF-8 character; None without a tokenizer)."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# vLLM's types: per position, the sampled token then the top k; None for the first prompt token.
SampleLogprobs = list[dict[int, Logprob]]
PromptLogprobs = list[dict[int, Logprob] | None]


@dataclass(slots=True)
class StepOutput:
    """One request's progress after one engine step: ``finished`` once, on the last output,
    with ``finish_reason`` ``"stop"``, ``"length"``, ``"abort"`` or ``"error"`` (``error``
    says why). ``latent_steps``: latent positions run so far. On the final output (when
    asked): ``latent_trace`` (``server/latent_trace.py``; a ``stream_latent_steps`` tick
    carries its step's entry alone) and ``recurrence`` ``{"tokens", "mean_iterations",
    "histogram"}``; ``latent_stats`` also on the step that ended the latent phase.
    ``logprobs`` align with ``new_token_ids``; ``prompt_logprobs`` come once."""

    rid: str
    new_token_ids: list[int]
    finished: bool = False
    finish_reason: str | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    latent_steps: int = 0
    latent_trace: list | None = None
    logprobs: list[TokenLogprob] | None = None
    error: str | None = None
    recurrence: dict | None = None
    latent_stats: dict | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None


@dataclass(slots=True)
class CompletionOutput:
    """One completion of ``LLM.generate`` (vLLM's ``CompletionOutput``); ``stop_reason`` is
    the stop token id or string that ended it (None for EOS or length). The latent fields
    are the final ``StepOutput``'s (``latent_trace`` and ``recurrence`` None when a stop
    string ended it); trace entries gain ``top_texts``. ``lora_request`` is always None
    (adapters are merged at load)."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    latent_steps: int = 0
    latent_trace: list | None = None
    latent_stats: dict | None = None
    recurrence: dict | None = None
    logprobs: SampleLogprobs | None = None
    cumulative_logprob: float | None = None
    stop_reason: int | str | None = None
    lora_request: None = None

    def finished(self) -> bool:
        """Whether this completion has ended (it has a ``finish_reason``)."""
        return self.finish_reason is not None


@dataclass(slots=True)
class RequestOutput:
    """One prompt's result from ``LLM.generate`` (vLLM's ``RequestOutput``); ``prompt`` is
    None for a token-id prompt. vLLM's ``metrics``, ``lora_request`` and encoder prompt are
    always None here (no per-request stats offline, adapters merged at load, decoder-only
    models)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    num_cached_tokens: int = 0
    finished: bool = True
    prompt_logprobs: PromptLogprobs | None = None
    metrics: None = None
    lora_request: None = None
    encoder_prompt: None = None
    encoder_prompt_token_ids: None = None


def attach_logprobs(outs: list[StepOutput], rids: list[str],
                    logprobs: list[TokenLogprob | None]) -> None:
    """Give each output in ``outs`` the logprobs of the token it adds: ``logprobs[i]`` was
    sampled for request ``rids[i]`` (None: not asked); an output whose new ids are not
    exactly that token (a latent step, forced ids) gets none."""
    by_rid = {rid: lp for rid, lp in zip(rids, logprobs) if lp is not None}
    for o in outs:
        if (lp := by_rid.get(o.rid)) is not None and o.new_token_ids == [lp.token_id]:
            o.logprobs = [lp]
