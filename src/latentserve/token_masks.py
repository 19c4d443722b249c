"""Per-request token masks: which ids a request may sample next, as a packed bitmask.

Design notes: docs/internals.md, "latentserve.token_masks".
"""

from __future__ import annotations

import logging

import numpy as np

log = logging.getLogger(__name__)


def bitmask_width(vocab_size: int) -> int:
    """int32 words per bitmask row."""
    return (vocab_size + 31) // 32


def _clear(row: np.ndarray, ids) -> None:
    """Clear the bits of ``ids`` in ``row`` (``[W] int32``, as uint32 arithmetic)."""
    u = row.view(np.uint32)
    for t in ids:
        u[t >> 5] &= np.uint32(~(1 << (t & 31)) & 0xFFFFFFFF)


def ids_bitmask(ids, vocab_size: int) -> np.ndarray:
    """A ``[W] int32`` row with exactly the bits of ``ids`` set."""
    u = np.zeros(bitmask_width(vocab_size), dtype=np.uint32)
    for t in set(ids):
        u[t >> 5] |= np.uint32(1 << (t & 31))
    return u.view(np.int32)


def bad_words_ids(tokenizer, words: list[str]) -> list[list[int]]:
    """The token sequences of ``words`` whose last token is banned (vLLM's
    ``SamplingParams.update_from_tokenizer``). Raises ValueError naming ``bad_words`` for a
    word that tokenizes to nothing."""
    out: list[list[int]] = []
    for word in words:
        for prefix in ("", " "):
            ids = tokenizer.encode(prefix + word.lstrip(), add_special_tokens=False)
            if not ids:
                raise ValueError(f"bad_words entry {word!r} tokenizes to no token")
            if not prefix or (ids[0] != out[-1][0] and len(ids) == len(out[-1])):
                out.append(list(ids))
    return out


class RequestMask:
    """What one request allows at its next sampled token.

    Args:
        params: the request's ``SamplingParams``.
        vocab_size: the logits' width.
        stop_ids: the ids ``min_tokens`` masks (EOS and ``params.stop_token_ids``).
        bad_words: :func:`bad_words_ids` of ``params.bad_words``.
        matcher: an xgrammar ``GrammarMatcher`` (``structured.Grammars.matcher``) or None.

    ``consumed``: answer tokens fed to the matcher so far; ``failed``: the matcher refused a
    token (then the grammar is no longer applied; logged).
    """

    def __init__(self, params, vocab_size: int, stop_ids: set[int],
                 bad_words: list[list[int]] | None = None, matcher=None):
        self.vocab_size = vocab_size
        self.width = bitmask_width(vocab_size)
        self.allowed = (None if params.allowed_token_ids is None
                        else ids_bitmask(params.allowed_token_ids, vocab_size))
        self.min_tokens = params.min_tokens
        self.stop_ids = sorted(t for t in stop_ids if 0 <= t < vocab_size)
        self.bad_words = bad_words or []
        self.matcher = matcher
        self.consumed = 0
        self.failed = False

    @property
    def static(self) -> bool:
        """Whether the mask depends only on the answer's length, not its tokens: the overlap
        scheduler builds it without waiting for the previous batch's tokens."""
        return self.matcher is None and not self.bad_words

    def sync(self, answer: list[int]) -> None:
        """Feed the matcher the answer tokens it has not seen (``answer``: every answer
        token so far)."""
        if self.matcher is None or self.failed:
            return
        for t in answer[self.consumed :]:
            self.consumed += 1
            if not self.matcher.accept_token(t):
                log.warning("the grammar refused answer token %d; it is no longer applied "
                            "to this request", t)
                self.failed = True
                return

    @property
    def terminated(self) -> bool:
        """Whether the grammar accepted its end (EOS after a complete answer)."""
        return (self.matcher is not None and not self.failed
                and self.matcher.is_terminated())

    def grammar_active(self, answer: list[int]) -> bool:
        """Feed the matcher ``answer``'s new tokens; whether the grammar masks the next
        token (it has one, has not failed and has not taken its end)."""
        if self.matcher is None or self.failed or self.terminated:
            return False
        self.sync(answer)
        return not self.failed and not self.terminated

    def fill(self, row: np.ndarray, answer: list[int]) -> None:
        """Write the allowed tokens into ``row`` (``[W] int32``, any content) given the answer
        so far (``answer``; a :attr:`static` mask reads only its length)."""
        grammar = self.grammar_active(answer)
        if grammar:
            import torch

            self.matcher.fill_next_token_bitmask(torch.from_numpy(row).view(1, -1))
        else:
            row[:] = -1
        self.restrict(row, answer, grammar)

    def restrict(self, row: np.ndarray, answer: list[int], grammar: bool) -> None:
        """AND the other masks into ``row``, which holds the grammar's mask (``grammar``) or
        all ones."""
        if grammar and self.vocab_size % 32:  # xgrammar leaves the padding bits set
            row.view(np.uint32)[-1] &= np.uint32((1 << (self.vocab_size % 32)) - 1)
        own = row.copy() if grammar else None
        n = len(answer)
        if self.allowed is not None:
            row &= self.allowed
        if self.bad_words:
            _clear(row, [w[-1] for w in self.bad_words
                         if len(w) <= n + 1 and answer[n - len(w) + 1 :] == w[:-1]])
        if n < self.min_tokens:
            _clear(row, self.stop_ids)
        if own is not None and not row.any():
            row[:] = own  # the grammar wins over min_tokens and the rest


_batch_matcher = None


def _fill_grammars(bits: np.ndarray, rows: list[int], matchers: list) -> None:
    """The grammars' masks into ``bits[rows]``: one call to xgrammar's threaded
    ``BatchGrammarMatcher`` for several, the matcher itself for one."""
    import torch

    t = torch.from_numpy(bits)
    if len(matchers) == 1:
        matchers[0].fill_next_token_bitmask(t, rows[0])
        return
    global _batch_matcher
    if _batch_matcher is None:
        import xgrammar

        _batch_matcher = xgrammar.BatchGrammarMatcher()
    _batch_matcher.batch_fill_next_token_bitmask(matchers, t, rows)


def batch_bitmask(reqs, vocab_size: int, answer_of=None
                  ) -> tuple[list[int], np.ndarray] | None:
    """The bitmask rows of the requests in ``reqs`` that have a ``constraint``: ``(rows,
    bits)``, ``rows[i]`` being the index in ``reqs`` of ``bits[i]`` (``[M, W] int32``); None
    when no request has one. ``answer_of(req)``: the answer's tokens so far (default
    ``req.answer_ids``; overlap mode passes them with the previous batch's tokens, not yet
    written into ``output_ids``)."""
    rows = [b for b, r in enumerate(reqs) if r.constraint is not None]
    if not rows:
        return None
    bits = np.full((len(rows), bitmask_width(vocab_size)), -1, dtype=np.int32)
    answers = [reqs[b].answer_ids if answer_of is None else answer_of(reqs[b]) for b in rows]
    active = [reqs[b].constraint.grammar_active(a) for b, a in zip(rows, answers)]
    gi = [i for i, on in enumerate(active) if on]
    if gi:
        _fill_grammars(bits, gi, [reqs[rows[i]].constraint.matcher for i in gi])
    for i, b in enumerate(rows):
        reqs[b].constraint.restrict(bits[i], answers[i], active[i])
    return rows, bits
