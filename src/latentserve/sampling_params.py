"""Per-request sampling parameters, shaped like vLLM's ``SamplingParams``."""

from __future__ import annotations

import json as _json
import math
import numbers
from dataclasses import dataclass, field, fields

# Temperatures below this are greedy (vLLM's _SAMPLING_EPS): dividing by them overflows.
SAMPLING_EPS = 1e-5
# float32's largest finite value and smallest normal one: the sampler computes in float32, where
# larger values overflow to inf and smaller ones lose precision or flush to 0.
FLOAT32_MAX = 3.4028234663852886e38
FLOAT32_TINY = 2.0**-126
# Huginn adaptive-exit semantics (SamplingParams.exit_semantics, EngineConfig.exit_semantics).
EXIT_SEMANTICS = ("engine", "upstream")


@dataclass(slots=True)
class SamplingParams:
    """How one request is decoded.

    Fields follow vLLM's names and meanings. ``temperature`` below ``1e-5`` (vLLM's
    ``_SAMPLING_EPS``; 0 in practice) means greedy.
    ``top_k <= 0`` (or -1) disables top-k; ``top_p == 1`` and ``min_p == 0`` disable those.
    ``seed`` makes sampling reproducible per request, independent of the batch it rides in.
    ``stop`` strings are matched on detokenized text and are not part of the output text;
    ``stop_token_ids`` end the request when sampled (the token is kept in ``token_ids``,
    not in the text). ``max_tokens`` counts generated tokens.

    Penalties (vLLM semantics, applied to the raw logits before temperature and the
    filters, for greedy rows too): ``repetition_penalty`` (> 0, 1 = off) divides the
    positive logits and multiplies the negative ones of every token seen in the prompt or
    the output; ``frequency_penalty`` (in [-2, 2]) subtracts ``penalty * count`` for each
    token's count in the output; ``presence_penalty`` (in [-2, 2]) subtracts ``penalty``
    once for every token present in the output.

    float32 (the sampler's precision), as vLLM's rules and beyond them: ``temperature``
    above ``FLOAT32_MAX`` is refused (it overflows to inf); below ``1e-5`` it is greedy, so
    a tiny one never divides. ``top_p`` in (0, 1] as vLLM; one that float32 flushes to 0
    keeps only the most likely token, as vLLM's sampler always keeps one.
    ``repetition_penalty`` outside ``[FLOAT32_TINY, FLOAT32_MAX]`` is refused (vLLM only
    asks > 0: a tiny one flushes to 0 or turns every seen logit into inf); within it, logits
    the division overflows are held at +-``FLOAT32_MAX``. ``min_p`` and the [-2, 2]
    penalties need no rule: a value float32 flushes to 0 means what 0 means, off.

    ``n``: completions per prompt (>= 1); ``LLM.generate`` turns them into n engine
    requests (the engine itself takes n = 1; the server's ``n`` is a body field).

    ``logprobs``: None = none; k >= 0 = the sampled token's log-probability plus the k most
    likely tokens' (0: the sampled token only). They are log-softmax values of the raw model
    logits, before penalties, temperature and filtering (vLLM's default ``raw_logprobs``).
    ``prompt_logprobs``: the same for every prompt token given the tokens before it (the
    first has none); such a request computes its whole prompt (no prefix-cache hit) and
    gets the list on one ``StepOutput``. Costs nothing for requests that leave it None.

    ``return_latent_trace`` (feedback-latent, compression-head and recurrent-depth models
    only; any other model refuses it with a ValueError naming it): the final output's
    ``latent_trace`` lists, for a feedback model or a compression head, each latent step's
    ``{"norm", "top_tokens", "top_probs"}`` (``latent/lens.py``; a head's with
    ``"stop_prob"``); for a
    recurrent-depth model, one entry per generated token, ``{"depth": n}`` (Huginn) or
    ``{"depth": n, "readout_step": e}`` (Ouro), for the position the token was sampled
    from: ``n`` loop iterations run there (< ``latent_budget`` after an early exit) and ``e``
    the 0-based step whose hidden was read out (None for the ``weighted`` mixture). Prompt
    positions get no entries: they never exit early, so each runs the full ``latent_budget``.

    ``stream_latent_steps``: the engine also emits a token-less ``StepOutput`` after each
    latent step (its ``latent_steps`` counts them), for streamed progress ticks.

    Recurrent-depth models (``latent_budget`` = recurrences per token): ``exit_criterion``
    picks the per-token early exit (Huginn: ``entropy-diff``, ``latent-diff``, ``kl``,
    ``minp-kl``, ``argmax-stability``, ``cosine``, ``none``; Ouro: ``last``, ``threshold``,
    ``weighted``, ``threshold-approx``), ``exit_threshold`` its threshold (>= 0; None = the
    criterion's "auto" value), ``exit_min_steps`` / ``exit_check_every`` when Huginn checks
    (after 0-based iteration t with ``t >= min_steps`` and ``(t - min_steps) % every == 0``).
    ``exit_semantics`` (Huginn; None = the server default, ``EngineConfig.exit_semantics``):
    ``"engine"`` (prompt tokens run the full depth, an exited token's last K/V fills the
    steps it skipped) or ``"upstream"`` (upstream's defaults: the prompt may exit as one
    block, later tokens attend only to positions that have K/V at their step).
    The engine checks the names against the model (``latent.recurrent.resolve_exit_rule``).

    Compression-head models (``latent/head.py``): ``thinking`` (None = on), ``max_latent``
    (cap on latent steps; ``latent_budget`` is an alias), ``min_latent``, ``use_stop``,
    ``stop_threshold`` (in [0, 1]; stop when the stop probability is strictly above it) and
    ``min_output_tokens`` (the answer-budget floor: ``max_tokens`` is raised to floor + cap
    when lower). None takes the server default from the environment.

    CoLaR models (``latent/colar_head.py``) take ``thinking``, ``max_latent``,
    ``min_latent``, ``use_stop`` (defaults from ``colar_config.json``, not the environment)
    and ``compression_factor`` (the thinking speed c, >= 1; None = the model's default; the
    model's ``max_compression_factor`` bounds it) and ``latent_temperature`` (>= 0; None or
    0 = the latent policy's mean; > 0 draws each latent with the request's ``seed``).

    ``upstream_stop_rules`` (None = the server default, ``EngineConfig.upstream_stop_rules``,
    off unless set): end on EOS as the model family's upstream code does, to reproduce its
    numbers exactly, instead of at the first EOS as vLLM does. COCONUT and PCCoT keep an EOS
    that is the first answer token and decode on (an EOS ends the answer from its second
    token on; ``latent.spec.LatentSpec.upstream_eos_from``). ``stop_token_ids`` and ``stop``
    strings still end the request anywhere. True on a family whose upstream stops on EOS
    as the engine does is a ValueError from the engine (``LLMEngine.add_request``).

    Token masks (vLLM semantics; ``token_masks.py`` builds them, the sampler applies them):
    ``allowed_token_ids`` (None = all; a non-empty list otherwise): only these ids are
    sampled. ``bad_words``: each word is tokenized as it is and after a space; the last token
    of a tokenization is never sampled right after the tokens before it (a one-token word is
    never sampled). ``min_tokens``: EOS and ``stop_token_ids`` are masked until that many
    answer tokens exist, and stop strings cannot end the request before then (the text of
    the first ``min_tokens`` tokens is not searched; at most ``max_tokens``).
    ``include_stop_str_in_output``: the matched stop string (and a non-special stop token's
    text) stays at the end of the text. ``structured_outputs``
    (:class:`StructuredOutputsParams`, or a dict of its fields): the answer follows a JSON
    schema, regex, choice or grammar (``structured.py``); the request ends when the grammar
    is complete. Masks change what is sampled, never the reported ``logprobs`` (raw). They
    cover answer tokens only: a latent step's input is a vector, not the sampled token.

    Raises:
        ValueError: naming the field and the allowed range, from ``__post_init__``.
    """

    max_tokens: int | None = 16  # None: until max_model_len (vLLM), resolved by the engine
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    # Latent reasoning: None = the model's default budget; 0 = no thinking.
    latent_budget: int | None = None
    # Final output's latent_trace: feedback models, each latent step's norm and logit-lens
    # top-5; recurrent depth, each generated token's depth (+ Ouro's readout step).
    return_latent_trace: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: int | None = None
    # Recurrent-depth models (Huginn, Ouro; latent/recurrent.py): per-token early exit.
    # None = the model's default (Huginn: none; Ouro: its config's early_exit_threshold).
    exit_criterion: str | None = None
    exit_threshold: float | None = None  # None = the criterion's "auto" value
    exit_min_steps: int = 0
    exit_check_every: int = 1
    # Huginn exit semantics: "engine" (prompt runs full depth; an exited token's last K/V
    # fills the steps it skipped) or "upstream" (the prompt may exit as one block; later
    # tokens attend only to positions with K/V at their step). None = the server default.
    exit_semantics: str | None = None
    # Compression-head models (latent/head.py); None = the server default (env
    # LATENTSERVE_MAX_LATENT, _MIN_LATENT, _USE_STOP, _STOP_THRESHOLD, _MIN_OUTPUT_TOKENS).
    thinking: bool | None = None  # None = on (off when latent_budget == 0)
    max_latent: int | None = None  # latent-step cap (latent_budget is an alias)
    min_latent: int | None = None  # steps before the stop head may end the phase
    use_stop: bool | None = None
    stop_threshold: float | None = None  # stop when sigmoid(stop logit) > this
    min_output_tokens: int | None = None  # answer-budget floor (0 = off)
    # CoLaR models (latent/colar_head.py): None = the model's default (colar_config.json).
    compression_factor: int | None = None  # thinking speed c
    latent_temperature: float | None = None  # latent policy temperature (0: its mean)
    prompt_logprobs: int | None = None  # logprobs of the prompt tokens too (echo)
    # Emit a StepOutput (no tokens, latent_steps counted) after every latent step too.
    stream_latent_steps: bool = False
    # End on EOS as the family's upstream code does (COCONUT, PCCoT); None = server default.
    upstream_stop_rules: bool | None = None
    # Completions per prompt (vLLM's n): LLM.generate runs n engine requests of n=1 each.
    n: int = 1
    # Token masks (vLLM semantics; see the class docstring).
    min_tokens: int = 0
    include_stop_str_in_output: bool = False
    bad_words: list[str] = field(default_factory=list)
    allowed_token_ids: list[int] | None = None
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        for f in fields(self):  # numpy scalars (np.int64(3), np.float32(0.7)) as Python's
            setattr(self, f.name, _plain_number(getattr(self, f.name)))
        if isinstance(self.stop_token_ids, (list, tuple)):
            self.stop_token_ids = [_plain_number(t) for t in self.stop_token_ids]
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.max_tokens is not None:
            _check_int("max_tokens", self.max_tokens, lo=1)
        _check_int("n", self.n, lo=1)
        _check_num("temperature", self.temperature, lo=0.0, hi=FLOAT32_MAX)
        _check_num("top_p", self.top_p, lo=0.0, hi=1.0, lo_open=True)
        _check_int("top_k", self.top_k, lo=-1)
        _check_num("min_p", self.min_p, lo=0.0, hi=1.0)
        if self.seed is not None:
            _check_int("seed", self.seed, lo=0, hi=2**63 - 1)
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise ValueError(f"stop must be a list of non-empty strings, got {s!r}")
        for t in self.stop_token_ids:
            _check_int("stop_token_ids[]", t, lo=0)
        _check_num("presence_penalty", self.presence_penalty, lo=-2.0, hi=2.0)
        _check_num("frequency_penalty", self.frequency_penalty, lo=-2.0, hi=2.0)
        _check_num("repetition_penalty", self.repetition_penalty, lo=FLOAT32_TINY,
                   hi=FLOAT32_MAX)
        if self.logprobs is not None:
            _check_int("logprobs", self.logprobs, lo=0)
        if self.prompt_logprobs is not None:
            _check_int("prompt_logprobs", self.prompt_logprobs, lo=0)
        if self.latent_budget is not None:
            _check_int("latent_budget", self.latent_budget, lo=0)
        if self.exit_criterion is not None and (not isinstance(self.exit_criterion, str)
                                                or not self.exit_criterion):
            raise ValueError(f"exit_criterion must be a non-empty string, got "
                             f"{self.exit_criterion!r}")
        if self.exit_threshold is not None:
            _check_num("exit_threshold", self.exit_threshold, lo=0.0)
        _check_int("exit_min_steps", self.exit_min_steps, lo=0)
        _check_int("exit_check_every", self.exit_check_every, lo=1)
        if self.exit_semantics is not None and self.exit_semantics not in EXIT_SEMANTICS:
            raise ValueError(f"exit_semantics must be one of {list(EXIT_SEMANTICS)}, got "
                             f"{self.exit_semantics!r}")
        for name in ("thinking", "use_stop", "upstream_stop_rules", "return_latent_trace"):
            v = getattr(self, name)
            if v is not None and not isinstance(v, bool):
                raise ValueError(f"{name} must be a boolean, got {v!r}")
        for name in ("max_latent", "min_latent", "min_output_tokens"):
            if getattr(self, name) is not None:
                _check_int(name, getattr(self, name), lo=0)
        if (self.min_latent is not None and self.max_latent  # max_latent 0: no latent phase
                and self.min_latent > self.max_latent):
            raise ValueError(f"min_latent must be at most max_latent ({self.max_latent}), "
                             f"got {self.min_latent}")
        if self.stop_threshold is not None:
            _check_num("stop_threshold", self.stop_threshold, lo=0.0, hi=1.0)
        if self.compression_factor is not None:
            _check_int("compression_factor", self.compression_factor, lo=1)
        if self.latent_temperature is not None:
            _check_num("latent_temperature", self.latent_temperature, lo=0.0)
        self._check_masks()

    def _check_masks(self) -> None:
        """Validate (and normalize) the token-mask fields."""
        _check_int("min_tokens", self.min_tokens, lo=0)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens must be at most max_tokens ({self.max_tokens}), got "
                             f"{self.min_tokens}")
        if not isinstance(self.include_stop_str_in_output, bool):
            raise ValueError(f"include_stop_str_in_output must be a boolean, got "
                             f"{self.include_stop_str_in_output!r}")
        if self.bad_words is None:  # vLLM's default
            self.bad_words = []
        if not isinstance(self.bad_words, (list, tuple)) or not all(
                isinstance(w, str) and w.strip() for w in self.bad_words):
            raise ValueError(f"bad_words must be a list of non-blank strings, got "
                             f"{_short(self.bad_words)}")
        self.bad_words = list(self.bad_words)
        if self.allowed_token_ids is not None:
            ids = self.allowed_token_ids
            if not isinstance(ids, (list, tuple)) or not ids:
                raise ValueError(f"allowed_token_ids must be a non-empty list of token ids, "
                                 f"got {_short(ids)}")
            self.allowed_token_ids = [_plain_number(t) for t in ids]
            for t in self.allowed_token_ids:
                _check_int("allowed_token_ids[]", t, lo=0)
        if isinstance(self.structured_outputs, dict):
            kinds = StructuredOutputsParams.KINDS
            unknown = set(self.structured_outputs) - set(kinds) - {"param"}
            if unknown:
                raise ValueError(f"structured_outputs takes {', '.join(kinds)}, got "
                                 f"{min(unknown)!r}")
            self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
        if self.structured_outputs is not None and not isinstance(
                self.structured_outputs, StructuredOutputsParams):
            raise ValueError(f"structured_outputs must be a StructuredOutputsParams or a dict, "
                             f"got {_short(self.structured_outputs)}")

    @property
    def has_token_mask(self) -> bool:
        """Whether the sampler masks this request's logits (``token_masks.py``)."""
        return (self.allowed_token_ids is not None or bool(self.bad_words)
                or self.min_tokens > 0 or self.structured_outputs is not None)

    @property
    def greedy(self) -> bool:
        """Whether decoding is argmax (temperature below ``SAMPLING_EPS``)."""
        return self.temperature < SAMPLING_EPS

    @property
    def has_penalties(self) -> bool:
        """Whether any of the three penalties changes the logits."""
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.repetition_penalty != 1.0)


@dataclass(slots=True)
class StructuredOutputsParams:
    """One constraint on the answer's text (vLLM's ``StructuredOutputsParams``): exactly one
    of ``json`` (a JSON schema, as a dict or a JSON string), ``regex``, ``choice`` (the answer
    is one of these strings), ``grammar`` (an EBNF grammar with a ``root`` rule, GBNF style
    as xgrammar and llama.cpp read it, or a Lark grammar with a ``start`` rule) or
    ``json_object`` (True: any JSON object). ``param`` names the request field the
    constraint came from (``response_format``, ``guided_json``, ...) in error messages.

    Raises:
        ValueError: naming ``param`` when none or several kinds are set, or a value has the
            wrong type (a schema that is not JSON, an empty choice list). Whether a schema,
            regex or grammar compiles is checked by the engine (``structured.py``).
    """

    KINDS = ("json", "regex", "choice", "grammar", "json_object")

    json: dict | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    param: str = "structured_outputs"

    def __post_init__(self) -> None:
        p = self.param
        given = [k for k in self.KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise ValueError(f"{p} must set exactly one of {', '.join(self.KINDS)}, got "
                             f"{', '.join(given) if given else 'none'}")
        if self.json is not None:
            if isinstance(self.json, str):
                try:
                    self.json = _json.loads(self.json)
                except ValueError as exc:
                    raise ValueError(f"{p} is not valid JSON: {exc}") from None
            if not isinstance(self.json, (dict, bool)):
                raise ValueError(f"{p} must be a JSON schema (an object), got "
                                 f"{_short(self.json)}")
        for name in ("regex", "grammar"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, str) or not v):
                raise ValueError(f"{p} must be a non-empty string ({name}), got {_short(v)}")
        if self.choice is not None and (not isinstance(self.choice, (list, tuple))
                                        or not self.choice
                                        or not all(isinstance(c, str) for c in self.choice)):
            raise ValueError(f"{p} must be a non-empty list of strings (choice), got "
                             f"{_short(self.choice)}")
        if self.choice is not None:
            self.choice = list(self.choice)
        if self.json_object not in (None, True, False):
            raise ValueError(f"{p} json_object must be a boolean, got {self.json_object!r}")

    @property
    def kind(self) -> str:
        """Which of ``KINDS`` is set."""
        return next(k for k in self.KINDS if getattr(self, k) not in (None, False))


def _short(value) -> str:
    """``repr(value)``, cut to 80 characters for an error message."""
    r = repr(value)
    return r if len(r) <= 80 else r[:77] + "..."


def _plain_number(value):
    """A numpy (or other ``numbers``) integer or real scalar as a Python ``int`` / ``float``;
    anything else (bools included) unchanged."""
    if isinstance(value, (bool, int, float)) or not isinstance(value, numbers.Real):
        return value  # numpy's bool_ is not a numbers.Real: it stays (and is refused)
    return int(value) if isinstance(value, numbers.Integral) else float(value)


def _check_int(name: str, value: object, lo: int | None = None, hi: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    _check_range(name, value, lo, hi)


def _check_num(
    name: str, value: object, lo: float | None = None, hi: float | None = None, lo_open=False
) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a number, got {value!r}")
    if not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value}")
    if lo_open and lo is not None and value <= lo:
        hi_s = "inf)" if hi is None else f"{hi}]"
        raise ValueError(f"{name} must be in ({lo}, {hi_s}, got {value}")
    _check_range(name, value, lo, hi)


def _check_range(name: str, value, lo, hi) -> None:
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        if hi is None:  # one-sided: "[0, inf]" reads like a real upper bound
            raise ValueError(f"{name} must be >= {lo}, got {value}")
        if lo is None:
            raise ValueError(f"{name} must be <= {hi}, got {value}")
        raise ValueError(f"{name} must be in [{lo}, {hi}], got {value}")
