"""Incremental detokenization with stop strings, for streaming outputs.
Design notes: docs/internals.md, "latentserve.detokenizer"."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

# Prompt tokens kept as left context for decoding the first output tokens (vLLM uses 5).
PROMPT_CONTEXT_TOKENS = 5

_REPLACEMENT = "\ufffd"


def decode_stream_backend(tokenizer):
    """The ``tokenizers.Tokenizer`` with which ``DecodeStream`` decodes as ``tokenizer.decode``
    does, or None: not a fast tokenizer, or one whose ``decode`` cleans up spaces
    (transformers 5's ``TokenizersBackend._decode`` rule)."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    backend = getattr(tokenizer, "backend_tokenizer", None)
    if not isinstance(tokenizer, PreTrainedTokenizerFast) or not isinstance(backend, Tokenizer):
        return None
    if getattr(tokenizer, "clean_up_tokenization_spaces", False):
        bpe = type(backend.model).__name__ == "BPE"
        forced = getattr(tokenizer, "clean_up_tokenization_spaces_for_bpe_even_though_it_will_"
                                    "corrupt_output", False)
        if not bpe or forced:
            return None
    return backend


class IncrementalDetokenizer:
    """Turn a stream of output token ids into text deltas, honouring stop strings. The prompt's
    last tokens are decoding context only; stop strings cannot match in the text of the first
    ``min_tokens`` tokens. ``stopped``: the stop string that ended it. Raises
    ``NoTokenizerError`` for stop strings with a ``NoTokenizer``; RuntimeError from :meth:`add`
    after :meth:`flush`."""

    def __init__(self, tokenizer, prompt_token_ids: Sequence[int], stop: Iterable[str] = (),
                 skip_special_tokens: bool = True, include_stop_str_in_output: bool = False,
                 min_tokens: int = 0) -> None:
        from latentserve.models.checkpoint import NoTokenizer, NoTokenizerError

        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.stop = [s for s in stop if s]
        if self.stop and isinstance(tokenizer, NoTokenizer):
            raise NoTokenizerError("stop strings need text: this model directory has no "
                                   "tokenizer files; use stop_token_ids")
        self._max_stop_len = max((len(s) for s in self.stop), default=0)
        self._stop_firsts = {s[0] for s in self.stop}
        self._ids: list[int] = [int(t) for t in list(prompt_token_ids)[-PROMPT_CONTEXT_TOKENS:]]
        self._n_context = len(self._ids)
        self._prefix_offset = 0
        self._read_offset = self._n_context
        self._all_text = ""  # decoded output text, including held-back text
        self._emitted = 0  # length of _all_text already returned
        self.stopped: str | None = None
        self._finished = False
        self._include_stop = include_stop_str_in_output
        self._min_tokens = min_tokens
        self._stop_from = 0  # a stop string must end after this many characters
        self._backend = decode_stream_backend(tokenizer)
        self._stream = None
        if self._backend is not None:
            from tokenizers.decoders import DecodeStream

            self._stream = DecodeStream(ids=list(self._ids),
                                        skip_special_tokens=skip_special_tokens)

    @property
    def text(self) -> str:
        return self._all_text[: self._emitted]

    @property
    def decoded_len(self) -> int:
        """Characters decoded so far, held-back text included; after a stop string matched,
        the length of the text before it."""
        return len(self._all_text)

    def add(self, token_ids: Iterable[int]) -> str:
        """Add output tokens; return the text that became final (tokens after a stop: "")."""
        if self._finished:
            raise RuntimeError("IncrementalDetokenizer.add() called after flush()")
        for token_id in token_ids:
            if self.stopped is not None:
                break
            self._ids.append(int(token_id))
            self._append(self._decode_step(force=False))
        return self._release(hold=True)

    def flush(self) -> str:
        """End the output: return the held-back text and any incomplete trailing character
        (decoded as U+FFFD), still cut at a stop string if one now matches."""
        if self._finished:
            return ""
        if self.stopped is None:
            self._append(self._decode_step(force=True))
        self._finished = True
        return self._release(hold=False)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def _decode_step(self, force: bool) -> str:
        """Decode the newest token (``force``: the whole unfinished tail, for :meth:`flush`);
        return the new text and move the offsets, or "" and keep them."""
        if self._stream is not None and not force:
            try:
                chunk = self._stream.step(self._backend, self._ids[-1])
            except Exception:  # noqa: BLE001 - "invalid prefix": the window takes over
                self._stream = None
                return self._window_step(force)
            if chunk is None:
                return ""
            self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
            return chunk
        return self._window_step(force)

    def _window_step(self, force: bool) -> str:
        """Decode the window; return the new text and move the offsets, or "" and keep them."""
        if self._read_offset >= len(self._ids):
            return ""
        prefix = self._decode(self._ids[self._prefix_offset : self._read_offset])
        full = self._decode(self._ids[self._prefix_offset :])
        if len(full) <= len(prefix) or (full.endswith(_REPLACEMENT) and not force):
            return ""
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        return full[len(prefix) :]

    def _append(self, new_text: str) -> None:
        """Append decoded text and cut it at the stop string it completes first (the match
        that ends earliest; at equal ends the first in ``stop``), as text added one character
        at a time would, and as vLLM's ``check_stop_strings``."""
        if not new_text:
            return
        old_len = len(self._all_text)
        self._all_text += new_text
        if len(self._ids) - self._n_context <= self._min_tokens:
            self._stop_from = len(self._all_text)  # min_tokens not reached: no stop yet
            return
        if not self.stop:
            return
        # A match must end inside the new text; it starts at most max_stop_len - 1 before it.
        start = max(self._emitted, old_len - self._max_stop_len + 1, 0)
        best: tuple[int, str] | None = None
        for s in self.stop:
            idx = self._all_text.find(s, max(start, self._stop_from - len(s) + 1))
            if idx >= 0 and (best is None or idx + len(s) < best[0] + len(best[1])):
                best = (idx, s)
        if best is not None:
            end = best[0] + len(best[1]) if self._include_stop else best[0]
            self._all_text = self._all_text[:end]
            self.stopped = best[1]

    def _held_back(self) -> int:
        """Length of the longest text suffix that is a proper prefix of a stop string."""
        text = self._all_text
        limit = min(self._max_stop_len - 1, len(text) - self._emitted)
        j = len(text) - limit
        while limit > 0:
            starts = [i for c in self._stop_firsts if (i := text.find(c, j)) >= 0]
            if not starts:
                return 0
            j = min(starts)
            tail = text[j:]
            if any(s.startswith(tail) for s in self.stop):
                return len(tail)
            j += 1
        return 0

    def _release(self, hold: bool) -> str:
        end = len(self._all_text)
        if hold and self.stopped is None and self.stop:
            end -= self._held_back()
        if end <= self._emitted:
            return ""
        delta = self._all_text[self._emitted : end]
        self._emitted = end
        return delta
