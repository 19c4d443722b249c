"""Per-request sampling parameters, shaped like vLLM's ``SamplingParams``."""

from __future__ import annotations

import copy
import json as _json
import math
import numbers
from dataclasses import InitVar, dataclass, field, fields

from latentserve.schema_support import tag_schemas, unenforced

# Temperatures below this are greedy (vLLM's _SAMPLING_EPS): dividing by them overflows.
SAMPLING_EPS = 1e-5
# float32's largest finite value and smallest normal one: the sampler computes in float32, where
# larger values overflow to inf and smaller ones lose precision or flush to 0.
FLOAT32_MAX = 3.4028234663852886e38
FLOAT32_TINY = 2.0**-126
# OpenAI's bound on a logit_bias value (either sign).
LOGIT_BIAS_MAX = 100.0
# The largest latent_temperature: a draw's noise 100x the policy's spread already swamps its
# mean; far larger ones overflow the forward (NaN latents and logits).
LATENT_TEMPERATURE_MAX = 100.0
# Huginn adaptive-exit semantics (SamplingParams.exit_semantics, EngineConfig.exit_semantics).
EXIT_SEMANTICS = ("engine", "upstream")
# The deepest a JSON schema or structural tag may nest (objects and arrays inside one another):
# deeper ones overflow Python's recursion (pickled to the engine, dumped for xgrammar).
MAX_SCHEMA_DEPTH = 128


# Each numeric field's allowed range: (lo, hi) for integers, (lo, hi, lo_open) for numbers;
# None (where the field's type allows it) always passes.
SEED_MAX = 2**63 - 1  # torch.Generator.manual_seed takes int64
INT_RANGES = {"max_tokens": (1,), "n": (1,), "top_k": (-1,), "seed": (0, SEED_MAX),
              "logprobs": (0,), "prompt_logprobs": (0,), "latent_budget": (0,),
              "max_latent": (0,), "min_latent": (0,), "min_output_tokens": (0,),
              "exit_min_steps": (0,), "exit_check_every": (1,), "compression_factor": (1,),
              "min_tokens": (0,), "thinking_token_budget": (0,)}
NUM_RANGES = {"temperature": (0.0, FLOAT32_MAX), "top_p": (0.0, 1.0, True),
              "min_p": (0.0, 1.0), "presence_penalty": (-2.0, 2.0),
              "frequency_penalty": (-2.0, 2.0),
              "repetition_penalty": (FLOAT32_TINY, FLOAT32_MAX), "exit_threshold": (0.0,),
              "stop_threshold": (0.0, 1.0),
              "latent_temperature": (0.0, LATENT_TEMPERATURE_MAX)}


# vLLM ``SamplingParams`` fields and the values at which they change nothing here (best_of
# also at n).
VLLM_NO_EFFECT: dict[str, tuple] = {
    "best_of": (None, 1), "detokenize": (True,), "spaces_between_special_tokens": (True,),
    "logits_processors": (None, [])}


@dataclass(slots=True, kw_only=True)
class SamplingParams:
    """How one request is decoded (vLLM's names and meanings; docs/internals.md,
    "latentserve.sampling_params", gives each field's semantics). Keyword arguments only:
    vLLM's takes positional ones in its own field order, so a positional call is refused
    rather than misread. As vLLM's, ``seed=-1`` is no seed and ``logprobs=True`` /
    ``prompt_logprobs=True`` are 1.

    Raises:
        ValueError: naming the field and the allowed range, from ``__post_init__``.
    """

    max_tokens: int | None = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    latent_budget: int | None = None
    return_latent_trace: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: int | None = None
    # Recurrent-depth models (latent/recurrent.py); None: the model's or server's default.
    exit_criterion: str | None = None
    exit_threshold: float | None = None
    exit_min_steps: int = 0
    exit_check_every: int = 1
    exit_semantics: str | None = None
    # Compression heads (latent/head.py) and CoLaR (latent/colar_head.py).
    thinking: bool | None = None
    max_latent: int | None = None
    min_latent: int | None = None
    use_stop: bool | None = None
    stop_threshold: float | None = None
    min_output_tokens: int | None = None
    compression_factor: int | None = None
    latent_temperature: float | None = None
    prompt_logprobs: int | None = None
    stream_latent_steps: bool = False
    upstream_stop_rules: bool | None = None
    n: int = 1
    # Token masks.
    min_tokens: int = 0
    include_stop_str_in_output: bool = False
    bad_words: list[str] = field(default_factory=list)
    allowed_token_ids: list[int] | None = None
    structured_outputs: StructuredOutputsParams | None = None
    thinking_token_budget: int | None = None
    truncate_prompt_tokens: int | None = None
    # Token id -> bias added to its logit (OpenAI's and vLLM's; ``LOGIT_BIAS_MAX``).
    logit_bias: dict[int, float] | None = None
    # vLLM fields taken only at values that change nothing here (``VLLM_NO_EFFECT``), not kept.
    best_of: InitVar[int | None] = None
    detokenize: InitVar[bool] = True
    spaces_between_special_tokens: InitVar[bool] = True
    logits_processors: InitVar[list | None] = None

    def __post_init__(self, best_of, detokenize, spaces_between_special_tokens,
                      logits_processors) -> None:
        if not isinstance(self.stop, (str, list, tuple, type(None))):
            raise ValueError(f"stop must be a string or a list of strings, got "
                             f"{_short(self.stop)}")
        self.stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if not isinstance(self.stop_token_ids, (list, tuple, type(None))):
            raise ValueError(f"stop_token_ids must be a list of token ids, got "
                             f"{_short(self.stop_token_ids)}")
        self.stop_token_ids = [_plain_number(t) for t in self.stop_token_ids or []]
        if _plain_number(self.seed) == -1:  # vLLM's "no seed"
            self.seed = None
        for name in ("logprobs", "prompt_logprobs"):  # vLLM's True: the chosen token's + 1
            if getattr(self, name) is True:
                setattr(self, name, 1)
        for f in fields(self):  # numpy scalars (np.int64(3), np.float32(0.7)) as Python's
            value = _plain_number(getattr(self, f.name))
            setattr(self, f.name, value)
            if value is None and "None" in f.type:
                continue
            if f.name in INT_RANGES:
                _check(f.name, value, INT_RANGES[f.name])
            elif f.name in NUM_RANGES:
                _check(f.name, value, NUM_RANGES[f.name], integer=False)
            elif f.type.startswith("bool") and not isinstance(value, bool):
                raise ValueError(f"{f.name} must be a boolean, got {value!r}")
        _check_truncation(self.truncate_prompt_tokens)
        for name, value in (("best_of", best_of), ("detokenize", detokenize),
                            ("spaces_between_special_tokens", spaces_between_special_tokens),
                            ("logits_processors", logits_processors)):
            value, allowed = _plain_number(value), VLLM_NO_EFFECT[name]
            if name == "best_of" and self.n not in allowed:  # best_of also at n
                allowed += (self.n,)
            if not any(value is v or (type(value) is type(v) and value == v) for v in allowed):
                raise ValueError(f"{name}={_short(value)} is not supported (only "
                                 f"{' or '.join(map(repr, allowed))}, where it changes nothing)")
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise ValueError(f"stop must be a list of non-empty strings, got {s!r}")
        for t in self.stop_token_ids:
            _check("stop_token_ids[]", t, (0,))
        if self.exit_criterion is not None and (not isinstance(self.exit_criterion, str)
                                                or not self.exit_criterion):
            raise ValueError(f"exit_criterion must be a non-empty string, got "
                             f"{self.exit_criterion!r}")
        if self.exit_semantics is not None and self.exit_semantics not in EXIT_SEMANTICS:
            raise ValueError(f"exit_semantics must be one of {list(EXIT_SEMANTICS)}, got "
                             f"{self.exit_semantics!r}")
        if (self.min_latent is not None and self.max_latent  # max_latent 0: no latent phase
                and self.min_latent > self.max_latent):
            raise ValueError(f"min_latent must be at most max_latent ({self.max_latent}), "
                             f"got {self.min_latent}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens must be at most max_tokens ({self.max_tokens}), got "
                             f"{self.min_tokens}")
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
                _check("allowed_token_ids[]", t, (0,))
        if self.logit_bias is not None:
            self.logit_bias = _logit_bias(self.logit_bias)
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

    def clone(self) -> SamplingParams:
        """A deep copy (vLLM's ``SamplingParams.clone``)."""
        return copy.deepcopy(self)

    @property
    def has_token_mask(self) -> bool:
        """Whether the sampler masks this request's logits (``token_masks.py``)."""
        return (self.allowed_token_ids is not None or bool(self.bad_words)
                or self.min_tokens > 0 or self.structured_outputs is not None)

    @property
    def has_logit_bias(self) -> bool:
        """Whether the sampler adds a bias to this request's logits (``logit_bias.py``)."""
        return bool(self.logit_bias)

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
    of ``json`` (a schema, dict or JSON string), ``regex``, ``choice``, ``grammar`` (GBNF with
    a ``root`` rule, or Lark with ``start``), ``json_object`` or ``structural_tag`` (xgrammar's
    structural tag, dict or JSON string: free text with tagged, schema-bound blocks). ``param``
    names the request field in error messages.

    Raises:
        ValueError: naming ``param`` for none or several kinds, or a value of the wrong type
            (whether it compiles is the engine's check, ``structured.py``).
    """

    KINDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")

    json: dict | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: dict | str | None = None
    param: str = "structured_outputs"

    def __post_init__(self) -> None:
        p = self.param
        given = self._given()
        if len(given) != 1:
            raise ValueError(f"{p} must set exactly one of {', '.join(self.KINDS)}, got "
                             f"{', '.join(given) if given else 'none'}")
        if self.json is not None:
            if isinstance(self.json, str):
                try:
                    self.json = _json.loads(self.json)
                except (ValueError, RecursionError) as exc:  # RecursionError: nested too deep
                    raise ValueError(f"{p} is not valid JSON: {exc}") from None
            if not isinstance(self.json, (dict, bool)):
                raise ValueError(f"{p} must be a JSON schema (an object), got "
                                 f"{_short(self.json)}")
        if self.structural_tag is not None:
            if isinstance(self.structural_tag, str):
                try:
                    self.structural_tag = _json.loads(self.structural_tag)
                except (ValueError, RecursionError) as exc:
                    raise ValueError(f"{p} structural_tag is not valid JSON: {exc}") from None
            if not isinstance(self.structural_tag, dict):
                raise ValueError(f"{p} structural_tag must be an object, got "
                                 f"{_short(self.structural_tag)}")
        for name in ("json", "structural_tag"):
            if _depth(getattr(self, name)) > MAX_SCHEMA_DEPTH:
                raise ValueError(f"{p} nests deeper than {MAX_SCHEMA_DEPTH} levels ({name})")
        if self.json is False:
            raise ValueError(f"{p} is the schema false, which no value satisfies")
        for schema in ([self.json] if self.json is not None else
                       tag_schemas(self.structural_tag)):
            if (found := unenforced(schema)) is not None:
                raise ValueError(f"{p} uses a JSON-schema keyword this server cannot enforce "
                                 f"({found})")
        for name in ("regex", "grammar"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, str) or not v):
                raise ValueError(f"{p} must be a non-empty string ({name}), got {_short(v)}")
        if self.choice is not None:
            if not isinstance(self.choice, (list, tuple)) or not self.choice or not all(
                    isinstance(c, str) for c in self.choice):
                raise ValueError(f"{p} must be a non-empty list of strings (choice), got "
                                 f"{_short(self.choice)}")
            self.choice = list(self.choice)
        if self.json_object not in (None, True, False):
            raise ValueError(f"{p} json_object must be a boolean, got {self.json_object!r}")

    def _given(self) -> list[str]:
        """The ``KINDS`` set (``json_object`` False is not set; ``json`` False is: the schema
        false)."""
        return [k for k in self.KINDS if getattr(self, k) is not None and not (
            k == "json_object" and self.json_object is False)]

    @property
    def kind(self) -> str:
        """Which of ``KINDS`` is set."""
        return self._given()[0]


def _check_truncation(k) -> None:
    """ValueError unless ``truncate_prompt_tokens`` ``k`` is None, -1 or an integer >= 1
    (vLLM's ``SamplingParams._verify_args``)."""
    if k is not None and (isinstance(k, bool) or not isinstance(k, int) or k == 0 or k < -1):
        raise ValueError(f"truncate_prompt_tokens must be an integer >= 1 or -1, got {k!r}")


def prompt_tokens_kept(k: int | None, max_model_len: int) -> int | None:
    """How many last prompt tokens ``truncate_prompt_tokens`` ``k`` keeps: None (all), k,
    or ``max_model_len`` for -1 (vLLM's ``_validate_truncation_size``; left truncation).
    ValueError naming the field for another value or one over ``max_model_len``."""
    _check_truncation(k)
    if k is None:
        return None
    k = max_model_len if k == -1 else k
    if k > max_model_len:
        raise ValueError(f"truncate_prompt_tokens value ({k}) is greater than max_model_len "
                         f"({max_model_len}). Please, select a smaller truncation size.")
    return k


def _logit_bias(bias) -> dict[int, float]:
    """``bias`` as ``{token id: float}``: keys integers >= 0 (numpy's as Python's), values
    finite numbers in ``[-LOGIT_BIAS_MAX, LOGIT_BIAS_MAX]``; ValueError naming ``logit_bias``
    otherwise (whether an id is in the vocabulary is the engine's check)."""
    if not isinstance(bias, dict):
        raise ValueError(f"logit_bias must be a dict of token id -> bias, got {_short(bias)}")
    out = {}
    for key, value in bias.items():
        key = _plain_number(key)
        if isinstance(key, bool) or not isinstance(key, int) or key < 0:
            raise ValueError(f"logit_bias keys must be token ids (integers >= 0), got "
                             f"{_short(key)}")
        value = _plain_number(value)
        _check("logit_bias", value, (-LOGIT_BIAS_MAX, LOGIT_BIAS_MAX), integer=False)
        out[key] = float(value)
    return out


def _depth(value) -> int:
    """How deep JSON ``value`` nests (0: a scalar), walked without recursion."""
    deepest, stack = 0, [(value, 0)]
    while stack:
        v, d = stack.pop()
        if isinstance(v, (dict, list, tuple)):
            deepest = max(deepest, d + 1)
            stack.extend((c, d + 1) for c in (v.values() if isinstance(v, dict) else v))
    return deepest


def _short(value) -> str:
    r = repr(value)
    return r if len(r) <= 80 else r[:77] + "..."


def _plain_number(value):
    """A numpy integer or real scalar as a Python ``int`` / ``float``; else unchanged."""
    if isinstance(value, (bool, int, float)) or not isinstance(value, numbers.Real):
        return value  # numpy's bool_ is not a numbers.Real: it stays (and is refused)
    return int(value) if isinstance(value, numbers.Integral) else float(value)


def _check(name: str, value, bounds: tuple, integer: bool = True) -> None:
    """ValueError naming ``name`` for a value that is not an integer (``integer``) or a finite
    number, or outside ``bounds`` (``(lo[, hi[, lo_open]])``, stated as ``(0.0, 1.0]``
    whichever side failed)."""
    lo, hi, lo_open = (*bounds, None, False)[:3]
    if isinstance(value, bool) or not isinstance(value, int if integer else (int, float)):
        raise ValueError(f"{name} must be {'an integer' if integer else 'a number'}, got "
                         f"{value!r}")
    if not integer and not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value}")
    if (value <= lo if lo_open else value < lo) or (hi is not None and value > hi):
        if hi is None:  # one-sided: "[0, inf]" reads like a real upper bound
            raise ValueError(f"{name} must be {'>' if lo_open else '>='} {lo}, got {value}")
        raise ValueError(f"{name} must be in {'(' if lo_open else '['}{lo}, {hi}], got {value}")
