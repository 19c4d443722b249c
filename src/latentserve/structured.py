"""Structured outputs: a request's ``StructuredOutputsParams`` compiled into a grammar
matcher that says, before each answer token, which tokens keep the text inside the grammar.
Design notes: docs/internals.md, "latentserve.structured"."""

from __future__ import annotations

import json
import re
import threading
import time

from latentserve.sampling_params import StructuredOutputsParams
from latentserve.schema_support import map_tag_schemas, safe_strings

JSON_SEPARATORS = (", ", ": ")
# The longest a grammar's first token mask may take to fill (seconds): every answer token of
# the request pays about that on the engine's step (docs/server.md).
FIRST_MASK_LIMIT_S = 0.1
# xgrammar's compiled-grammar cache (LRU): bounded, so many distinct schemas cannot grow the
# engine process without limit.
CACHE_LIMIT_BYTES = 256 << 20


class Grammars:
    """Compiles constraints for one tokenizer; ``vocab_size``: the logits' width (ids past
    the tokenizer's are never allowed); ``eos_ids`` are allowed once the grammar completes."""

    def __init__(self, tokenizer, vocab_size: int, eos_ids: set[int]):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_ids = sorted(eos_ids)
        self._compiler = None
        self._lock = threading.Lock()

    def compile(self, so: StructuredOutputsParams):
        """``so`` as an xgrammar ``CompiledGrammar``; ValueError naming ``so.param`` when it
        does not compile or xgrammar is missing."""
        if self._compiler is None:
            with self._lock:
                if self._compiler is None:
                    xgr = import_xgrammar(so.param)
                    info = xgr.TokenizerInfo.from_huggingface(
                        self.tokenizer, vocab_size=self.vocab_size,
                        stop_token_ids=self.eos_ids or None)
                    self._compiler = xgr.GrammarCompiler(info,
                                                         cache_limit_bytes=CACHE_LIMIT_BYTES)
        c = self._compiler
        kind = so.kind
        try:
            if kind == "json":
                return c.compile_json_schema(json.dumps(safe_strings(so.json)),
                                             any_whitespace=False,
                                             separators=JSON_SEPARATORS, strict_mode=True)
            if kind == "json_object":
                return c.compile_json_schema('{"type": "object"}', any_whitespace=False,
                                             separators=JSON_SEPARATORS, strict_mode=False)
            if kind == "regex":
                return c.compile_regex(so.regex)
            if kind == "choice":
                return c.compile_grammar(choice_grammar(so.choice))
            if kind == "structural_tag":
                tag = map_tag_schemas(_structural_tag(so.structural_tag), safe_strings)
                return c.compile_structural_tag(json.dumps(tag))
            if "::=" in so.grammar:
                return c.compile_grammar(so.grammar)
            return c.compile_lark(so.grammar)
        except Exception as exc:  # noqa: BLE001 - xgrammar raises RuntimeError with C++ text
            what = {"json": "is not a JSON schema this server can follow",
                    "regex": "is not a valid regular expression",
                    "grammar": "is not a valid grammar (EBNF with a root rule, or Lark)",
                    "structural_tag": "is not a structural tag this server can follow"}.get(
                kind, "could not be compiled")
            raise ValueError(f"{so.param} {what}: {_library_message(exc)}") from None

    def check_first_mask(self, so: StructuredOutputsParams) -> None:
        """ValueError naming ``so.param`` when filling the grammar's first token mask takes
        longer than ``FIRST_MASK_LIMIT_S`` (some regexes compile at once, then take seconds a
        token), or when that mask allows no token of the vocabulary (the tokenizer cannot
        spell the grammar's text); compiles ``so`` first (:meth:`compile`'s errors)."""
        from latentserve.sampling import unpack_bitmask

        xgr = import_xgrammar(so.param)
        matcher = xgr.GrammarMatcher(self.compile(so))
        bits = xgr.allocate_token_bitmask(1, self.vocab_size)
        start = time.perf_counter()
        matcher.fill_next_token_bitmask(bits)
        took = time.perf_counter() - start
        if took > FIRST_MASK_LIMIT_S:
            raise ValueError(f"{so.param} is too costly to follow: its first token mask took "
                             f"{took:.2f} s (limit {FIRST_MASK_LIMIT_S:g} s); use a simpler "
                             "schema or regex")
        if not unpack_bitmask(bits, self.vocab_size).any():
            raise ValueError(f"{so.param} allows no token of this model's vocabulary as its "
                             "first token: this tokenizer cannot write its text")

    def matcher(self, so: StructuredOutputsParams):
        """A fresh xgrammar ``GrammarMatcher`` for ``so`` (see :meth:`compile`)."""
        return import_xgrammar(so.param).GrammarMatcher(self.compile(so))


def import_xgrammar(param: str = "structured_outputs"):
    """The ``xgrammar`` module. Raises ValueError naming ``param`` when it is not installed."""
    try:
        import xgrammar
    except ImportError:
        from latentserve.extras import missing_extra_message

        raise ValueError(missing_extra_message("xgrammar", f"{param} (the grammar library)")
                         ) from None
    return xgrammar


def choice_grammar(choices: list[str]) -> str:
    """An EBNF grammar whose root is exactly one of ``choices`` (string literals escaped)."""
    def literal(s: str) -> str:
        s = s.replace("\\", "\\\\").replace('"', '\\"')
        return '"' + s.replace("\n", "\\n").replace("\r", "\\r").replace("\t", "\\t") + '"'

    return "root ::= " + " | ".join(literal(c) for c in choices)


def _structural_tag(tag: dict) -> dict:
    """``tag`` in xgrammar's format; vLLM's legacy form (``{"structures": [{"begin", "schema",
    "end"}, ...], "triggers": [...]}``, which vLLM still takes) as the triggered tags it means."""
    if "structures" not in tag:
        return tag
    return {"type": "structural_tag", "format": {
        "type": "triggered_tags", "triggers": tag.get("triggers"),
        "tags": [{"type": "tag", "begin": s["begin"], "end": s["end"],
                  "content": {"type": "json_schema", "json_schema": s["schema"]}}
                 for s in tag["structures"]]}}


def _library_message(exc: Exception) -> str:
    """xgrammar's error text without its C++ source location (``[12:00:00] file.cc:42: ``)."""
    text = str(exc).strip()
    text = re.sub(r"^\[[^\]]*\]\s*\S+:\d+:\s*", "", text)
    text = re.sub(r"^Check failed: \(.*?\) is false:\s*", "", text)
    return text.splitlines()[0] if text else type(exc).__name__
