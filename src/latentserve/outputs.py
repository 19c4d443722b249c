"""What the engine hands back: per-step deltas (``StepOutput``) and finished results
(``RequestOutput``, ``CompletionOutput`` and ``Logprob``, shaped like vLLM's
``vllm/outputs.py`` and ``vllm/logprobs.py``)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class TokenLogprob:
    """Log-probabilities at one generated position (see ``SamplingParams.logprobs``).

    ``logprob`` is the sampled token's (natural log, raw model distribution); ``top`` holds
    up to k ``(token_id, logprob)`` pairs, most likely first; ``rank`` is the sampled
    token's 1-based rank in that distribution (1 = the most likely).
    """

    token_id: int
    logprob: float
    rank: int
    top: list[tuple[int, float]] = field(default_factory=list)


@dataclass(slots=True)
class Logprob:
    """One token's entry in a position's logprobs dict (vLLM's ``vllm/logprobs.py``
    ``Logprob``): ``logprob`` (natural log, raw model distribution), ``rank`` (1-based rank
    in that distribution, 1 = the most likely) and ``decoded_token`` (the token decoded on
    its own, ``tokenizer.decode([token_id])`` as vLLM's ``convert_ids_list_to_tokens``; a
    token holding part of a UTF-8 character decodes to U+FFFD; None without a tokenizer)."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# vLLM's types: per generated position, ``{token_id: Logprob}`` with the sampled token first
# then the top-k (k + 1 entries, or k when the sampled token is among them); prompt logprobs
# are the same per prompt token, None for the first one.
SampleLogprobs = list[dict[int, Logprob]]
PromptLogprobs = list[dict[int, Logprob] | None]


@dataclass(slots=True)
class StepOutput:
    """One request's progress after one engine step.

    ``new_token_ids`` are the tokens sampled this step (zero or one today). ``finished`` is
    set once, on the last output of the request, with ``finish_reason`` ``"stop"``
    (EOS or a stop token), ``"length"`` (max_tokens or max_model_len) or ``"abort"``.
    ``num_cached_tokens`` is how many prompt tokens were served by the prefix cache.
    ``latent_steps`` counts the latent positions the request has run so far (a looped
    block: block size x passes completed);
    ``latent_trace`` (on the final output, when asked for) lists per latent step
    ``{"norm": float, "top_tokens": [[id, logit], ...5], "top_probs": [p, ...5]}`` (feedback
    models; compression heads add ``"stop_prob"``; ``latent/lens.py``), or per
    generated token (recurrent-depth models; ``SamplingParams.return_latent_trace``)
    ``{"depth": int}`` (Huginn) / ``{"depth": int, "readout_step": int | None,
    "exit_probs": [float, ...depth]}`` (Ouro; ``latent/recurrent.py``), or per block
    position of each pass the lens entry plus ``"pass"``, ``"position"`` (looped blocks;
    ``latent/loop.py``);
    a latent step's progress output (``stream_latent_steps``) of a traced request carries
    that step's entry alone.
    ``logprobs`` (only when the request asked for them) is aligned with ``new_token_ids``.
    ``prompt_logprobs`` (``params.prompt_logprobs`` set): one entry per prompt token as the
    client sent it (None for the first), on the first output after the prompt is computed.
    ``finish_reason == "error"`` means the engine failed this request (``error`` says why,
    without a traceback); the engine keeps serving the others.
    ``recurrence`` (final output, recurrent-depth models): iterations per sampled token,
    ``{"tokens": n, "mean_iterations": float, "histogram": {iterations: count}}``.
    ``latent_stats`` (compression-head models): ``latent.head.HeadSettings.stats()``
    (``thinking``, ``mode``, ``steps``, ``stop_step``, ``max_stop_prob``, ``end`` stop|cap|length
    and the resolved controls); with thinking off it says so (``thinking: False``). On the
    final output, and once before it on the output of the step where the latent phase ended
    (the first output with thinking off), so that a request a stop string aborts has them.
    """

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
    """One completion of ``LLM.generate`` (vLLM's ``vllm/outputs.py`` ``CompletionOutput``):
    ``index`` (0 .. n-1 among the prompt's ``SamplingParams.n`` completions), ``text``,
    ``token_ids`` (the answer; latent positions are not tokens), ``finish_reason`` (``"stop"``
    or ``"length"``), ``stop_reason`` (None for EOS or ``"length"``, the stop token id or
    the stop string that ended it); ``logprobs`` (``SampleLogprobs``, one dict per token,
    when ``SamplingParams.logprobs`` is set, else None) and ``cumulative_logprob`` (the sum
    of the sampled tokens' logprobs, None without ``logprobs``). For latent models ``latent_steps``
    and, as
    on ``StepOutput``, ``latent_trace`` (when asked for), ``latent_stats`` (compression
    heads; a request a stop string ended has the stats its latent phase ended with) and
    ``recurrence`` (recurrent depth) from the final output (None otherwise; ``latent_trace``
    and ``recurrence`` are None when a stop string ended the request); a latent step's
    trace entry also has ``top_texts``, its ``top_tokens`` decoded one by one."""

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


@dataclass(slots=True)
class RequestOutput:
    """The result of one prompt from ``LLM.generate`` (vLLM's ``RequestOutput``): its
    ``outputs`` (``SamplingParams.n`` completions, by ``index``), ``prompt`` (None for a
    token-id prompt), ``prompt_token_ids``, ``prompt_logprobs`` (``PromptLogprobs``, one
    entry per prompt token, the first None, when ``SamplingParams.prompt_logprobs`` is set;
    else None) and ``num_cached_tokens`` (prompt tokens the prefix cache served)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    num_cached_tokens: int = 0
    finished: bool = True
    prompt_logprobs: PromptLogprobs | None = None
