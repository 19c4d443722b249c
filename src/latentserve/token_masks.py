"""Per-request token masks: which ids a request may sample next, as a packed bitmask.
Design notes: docs/internals.md, "latentserve.token_masks"."""

from __future__ import annotations

import functools
import logging

import numpy as np

log = logging.getLogger(__name__)

THINK_START, THINK_END = "<think>", "</think>"
# --reasoning-parser name -> whether an output that does not open with <think> is reasoning.
REASONING_PARSERS = {"deepseek_r1": True, "qwen3": False}


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


def _find(ids: list[int], seq: list[int], lo: int) -> int | None:
    """Index just past the first ``seq`` in ``ids`` starting at or after ``lo``, or None."""
    n = len(seq)
    return next((i + n for i in range(max(lo, 0), len(ids) - n + 1) if ids[i:i + n] == seq),
                None)


def _last(ids: list[int], seq: list[int]) -> int:
    """Index of the last ``seq`` in ``ids``, or -1."""
    n = len(seq)
    return next((i for i in range(len(ids) - n, -1, -1) if ids[i:i + n] == seq), -1)


def think_open(prompt: list[int], start: list[int] | None, end: list[int],
               implicit: bool = False) -> bool:
    """Whether an answer to ``prompt`` starts inside its reasoning (vLLM's
    ``is_reasoning_end``, negated): the prompt's last tag is ``start`` (a template or an
    assistant prefill left ``<think>`` open), or it has neither tag and ``implicit`` (an
    output that does not open with ``<think>`` is reasoning). ``start`` None: not searched."""
    s = -1 if start is None else _last(list(prompt), start)
    e = _last(list(prompt), end)
    return s > e or (implicit and s < 0 and e < 0)


def reasoning_open(tokenizer, parser: str | None, prompt: list[int]) -> bool:
    """Whether the answer to ``prompt`` starts inside its reasoning under ``--reasoning-parser``
    ``parser`` (None: False): :func:`think_open` with the tags as ``tokenizer`` encodes them,
    implicit for ``deepseek_r1``."""
    if not parser:
        return False
    start, end = (tokenizer.encode(t, add_special_tokens=False) for t in (THINK_START, THINK_END))
    return think_open(prompt, start, end, REASONING_PARSERS[parser])


class ThinkBudget:
    """Where the ``<think>`` reasoning of an answer ends, and ``thinking_token_budget``
    (vLLM's): at most ``budget`` tokens of reasoning (None: no cap), counted from the end of
    ``start`` ids in the answer, or from the answer's first token when it starts inside the
    reasoning (:func:`think_open` of ``prompt``; ``implicit``, or ``start`` None: a prompt
    with no tag counts), then the ``end`` ids are forced one by one; nothing once ``end`` has
    appeared."""

    def __init__(self, budget: int | None, start: list[int] | None, end: list[int],
                 prompt: list[int] = (), implicit: bool = False):
        self.budget, self.start, self.end = budget, start, end
        opened = think_open(prompt, start, end, implicit or start is None)
        self.begin: int | None = 0 if opened else None  # where the reasoning's tokens start
        self.after: int | None = None  # the answer index after its end ids, once they appear
        self.seen = 0  # answer tokens searched so far

    @property
    def ended(self) -> bool:
        return self.after is not None

    def update(self, answer: list[int]) -> None:
        """Search the answer tokens not seen yet (``answer`` only grows between calls)."""
        if self.begin is None and self.start is not None:
            self.begin = _find(answer, self.start, self.seen - len(self.start) + 1)
        if self.begin is not None and self.after is None:
            self.after = _find(answer, self.end, max(self.begin, self.seen - len(self.end) + 1))
        self.seen = len(answer)

    def forced(self, answer: list[int]) -> int | None:
        """The id the next answer token must be, or None (``answer`` as for :meth:`update`)."""
        self.update(answer)
        if self.budget is None or self.begin is None or self.ended:
            return None
        over = self.seen - self.begin - self.budget  # end ids forced so far
        return self.end[over] if 0 <= over < len(self.end) else None


class RequestMask:
    """What one request allows at its next sampled token. ``stop_ids``: what ``min_tokens``
    masks (EOS and ``stop_token_ids``); ``matcher``: an xgrammar ``GrammarMatcher`` or None;
    ``think``: a :class:`ThinkBudget` or None; when it has the reasoning open at the answer's
    start, the grammar starts after the reasoning (vLLM's rule). ``consumed``: answer tokens
    fed to the matcher;
    ``failed``: it refused one (the grammar is dropped, logged); ``terminated``: it accepted
    its end, one of ``end_ids`` (the grammar's stop ids). A row whose token is no answer
    token (``Req.samples_answer`` false) is all ones."""

    def __init__(self, params, vocab_size: int, stop_ids: set[int],
                 bad_words: list[list[int]] | None = None, matcher=None,
                 think: ThinkBudget | None = None):
        self.allowed = (None if params.allowed_token_ids is None
                        else ids_bitmask(params.allowed_token_ids, vocab_size))
        self.min_tokens = params.min_tokens
        self.stop_ids = sorted(t for t in stop_ids if 0 <= t < vocab_size)
        if params.allowed_token_ids is not None and matcher is None:
            _check_allowed(set(params.allowed_token_ids), set(self.stop_ids),
                           {w[0] for w in bad_words or () if len(w) == 1}, params.min_tokens)
        # the grammar ends only on accepting one of these (xgrammar's default)
        self.end_ids = frozenset(matcher.stop_token_ids) if matcher is not None else frozenset()
        self.bad_words = bad_words or []
        self.matcher = matcher
        self.think = think
        self._after_think = matcher is not None and think is not None and think.begin == 0
        self.consumed = 0
        self.failed = False
        self.terminated = False

    @property
    def static(self) -> bool:
        """Whether the mask depends only on the answer's length, not its tokens: the overlap
        scheduler builds it without waiting for the previous batch's tokens."""
        return self.matcher is None and not self.bad_words and not self.thinking

    @property
    def thinking(self) -> bool:
        """Whether the thinking budget may still force ``</think>`` (not once it appeared)."""
        return self.think is not None and self.think.budget is not None and not self.think.ended

    @property
    def grammar_from(self) -> int | None:
        """The answer index of the grammar's first token (None: the reasoning goes on)."""
        return self.think.after if self._after_think else 0

    @property
    def grammar_on(self) -> bool:
        """Whether the grammar masks the next token."""
        return (self.matcher is not None and not self.failed and not self.terminated
                and self.grammar_from is not None)

    def watch(self, ids: list[int], start: int, patch: tuple[int, int] | None) -> None:
        """Find the reasoning's end in the answer ``ids[start:]`` while the grammar waits for
        it (``patch``: see :meth:`sync`)."""
        if self._after_think and not self.think.ended:
            self.think.update(_patched(ids, start, len(ids), patch))

    def unfed(self, ids: list[int], start: int = 0, stop: int | None = None,
              patch: tuple[int, int] | None = None) -> list[int]:
        """The answer tokens the matcher has not seen (empty while the grammar is off); the
        answer and ``patch`` as for :meth:`sync`."""
        if not self.grammar_on:
            return []
        stop = len(ids) if stop is None else stop
        i = start + self.grammar_from + self.consumed
        new = ids[i:stop]
        if patch is not None and i <= patch[0] < stop:
            new[patch[0] - i] = patch[1]
        return new

    def took(self, token: int, accepted: bool) -> None:
        """Record the matcher's answer (``accepted``) to ``token``, the next unfed one."""
        self.consumed += 1
        if not accepted:
            log.warning("the grammar refused answer token %d; it is no longer applied to this "
                        "request", token)
            self.failed = True
        elif token in self.end_ids:
            self.terminated = self.matcher.is_terminated()

    def sync(self, ids: list[int], start: int = 0, stop: int | None = None,
             patch: tuple[int, int] | None = None) -> None:
        """Feed the matcher the answer tokens it has not seen: the answer is ``ids[start:stop]``
        (``stop`` None: to the end); ``patch``: ``(index, token)``, ``ids[index]`` being a
        pending id whose token is known (overlap mode). O(new tokens)."""
        for t in self.unfed(ids, start, stop, patch):
            self.took(t, self.matcher.accept_token(t))
            if not self.grammar_on:
                break

    def restricts(self, n: int) -> bool:
        """Whether :meth:`restrict` changes a row at answer length ``n``."""
        return (self.allowed is not None or bool(self.bad_words) or n < self.min_tokens
                or self.thinking)

    def restrict(self, row: np.ndarray, ids: list[int], stop: int, grammar: bool,
                 start: int = 0, patch: tuple[int, int] | None = None) -> None:
        """AND the other masks into ``row``, which holds the grammar's mask (``grammar``;
        padding bits cleared) or all ones. The answer is ``ids[start:stop]`` (``patch``: see
        :meth:`sync`)."""
        own = row.copy() if grammar else None
        n = stop - start
        if self.allowed is not None:
            row &= self.allowed
        if self.bad_words:
            k = min(n, max(len(w) for w in self.bad_words) - 1)
            tail = ids[stop - k : stop] if k else []
            if patch is not None and stop - k <= patch[0] < stop:
                tail[patch[0] - stop + k] = patch[1]
            _clear(row, [w[-1] for w in self.bad_words
                         if len(w) <= n + 1 and (len(w) == 1 or tail[-(len(w) - 1):] == w[:-1])])
        if n < self.min_tokens:
            _clear(row, self.stop_ids)
        if self.thinking and (t := self.think.forced(_patched(ids, start, stop, patch))
                              ) is not None:
            row[:] = ids_bitmask([t], len(row) * 32)
        if not row.any():  # nothing left: the grammar wins over min_tokens and the rest,
            if own is not None:  # else allowed_token_ids does (a bad word's context)
                row[:] = own
            elif self.allowed is not None:
                row[:] = self.allowed


def _check_allowed(allowed: set[int], stop_ids: set[int], bad: set[int], min_tokens: int
                   ) -> None:
    """ValueError when ``allowed_token_ids`` leaves nothing to sample at the first answer
    token: all of them are ``bad`` (single-token bad words) or, while ``min_tokens`` holds,
    stop ids (EOS and ``stop_token_ids``)."""
    if not allowed - bad:
        raise ValueError("allowed_token_ids holds only ids that bad_words forbids: nothing "
                         "could be sampled")
    if min_tokens > 0 and not allowed - bad - stop_ids:
        raise ValueError(f"allowed_token_ids holds only stop ids (EOS or stop_token_ids), "
                         f"which min_tokens={min_tokens} forbids for the first tokens: nothing "
                         "could be sampled")


def _patched(ids: list[int], start: int, stop: int, patch: tuple[int, int] | None) -> list[int]:
    """A copy of ``ids[start:stop]`` with ``patch`` (see :meth:`RequestMask.sync`) applied."""
    answer = ids[start:stop]
    if patch is not None and start <= patch[0] < stop:
        answer[patch[0] - start] = patch[1]
    return answer


def _clear_padding(bits: np.ndarray, vocab_size: int) -> None:
    """Clear the bits past ``vocab_size`` in every row of ``bits`` (``[M, W] int32``;
    xgrammar leaves them set)."""
    if vocab_size % 32:
        bits.view(np.uint32)[:, -1] &= np.uint32((1 << (vocab_size % 32)) - 1)


@functools.cache
def _batcher():
    """xgrammar's ``BatchGrammarMatcher`` on half this process's CPUs, at most 8 threads (its
    fill runs without the GIL)."""
    import os

    import xgrammar

    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 2
    return xgrammar.BatchGrammarMatcher(max(1, min(8, cpus // 2)))


@functools.cache
def _filler():
    """The one worker thread that runs grammar fills beside the engine's thread."""
    from concurrent.futures import ThreadPoolExecutor

    return ThreadPoolExecutor(1, thread_name_prefix="latentserve-grammar")


def _answer_start(r) -> int:
    """Where ``r``'s answer starts in ``output_ids`` (its end in the latent phase: no answer)."""
    return len(r.output_ids) if r.answer_start is None else r.answer_start


def static_key(reqs) -> tuple | None:
    """What the masks of ``reqs`` depend on when every constrained request's mask is static
    (``RequestMask.static``): per constrained row its index, its ``RequestMask`` (compared by
    identity) and whether ``min_tokens`` still masks (None: the row is unmasked); None when
    a mask reads tokens. Equal keys give equal :func:`batch_bitmask` results."""
    key: list = [len(reqs)]
    for b, r in enumerate(reqs):
        c = r.constraint
        if c is None:
            continue
        if not c.static:
            return None
        key.append((b, c, None if not r.samples_answer
                    else len(r.output_ids) - _answer_start(r) < c.min_tokens))
    return tuple(key)


def batch_bitmask(reqs, vocab_size: int, known: dict | None = None, out=None):
    """``(rows, bits)`` for the requests of ``reqs`` with a ``constraint``: ``bits[i]`` (an
    ``[M, W] int32`` CPU tensor, written into ``out[:M]`` when given) is ``reqs[rows[i]]``'s
    mask; None when none has one. ``known``: ``id(req) -> (index, token)`` for a pending id
    whose token is on the host (overlap mode). :func:`begin_bitmask`, waited for."""
    begun = begin_bitmask(reqs, vocab_size, known, out)
    return None if begun is None else begun.result()


def begin_bitmask(reqs, vocab_size: int, known: dict | None = None, out=None,
                  background: bool = False) -> PendingBitmask | None:
    """Start :func:`batch_bitmask` of ``reqs`` (None: no row has a constraint): each grammar
    is fed its unseen answer tokens (one batched xgrammar call for the usual one token a
    row), the grammars fill their rows in one threaded xgrammar call, which runs without
    the GIL, and the other masks are ANDed in. ``background``: all of it on the worker
    thread, so the caller's thread goes on (a forward launch); nothing may touch the
    grammars of ``reqs`` until :meth:`PendingBitmask.result` (or ``wait``). O(batch + new
    tokens)."""
    import torch

    rows = [b for b, r in enumerate(reqs) if r.constraint is not None]
    if not rows:
        return None
    bits = (torch.empty(len(rows), bitmask_width(vocab_size), dtype=torch.int32)
            if out is None else out[: len(rows)])
    job = PendingBitmask(reqs, rows, bits, vocab_size, known)
    if background:
        job._pending = _filler().submit(job.build)
    else:
        job.build()
    return job


def settle(begun: PendingBitmask | None) -> None:
    """Wait for ``begun``'s worker on an error path, logging (not raising) what it raised."""
    if begun is None:
        return
    try:
        begun.wait()
    except Exception:  # noqa: BLE001 - the caller re-raises its own error
        log.exception("a grammar fill failed while the step failed")


class PendingBitmask:
    """:func:`begin_bitmask`'s masks: ``reqs`` (the list it was given), ``rows`` and ``bits``
    as :func:`batch_bitmask` returns them, complete once :meth:`result` returns."""

    def __init__(self, reqs, rows: list[int], bits, vocab_size: int, known: dict | None):
        self.reqs, self.rows, self.bits = reqs, rows, bits
        self._vocab_size, self._known = vocab_size, known
        self._pending = None  # the worker's future

    def build(self) -> None:
        """Feed the grammars their unseen answer tokens, fill their rows of ``bits``, then AND
        in the other masks (all-ones rows where no grammar is on, and unmasked latent-phase
        rows: ``Req.samples_answer``)."""
        reqs, rows, known = self.reqs, self.rows, self._known
        fed_c, fed_t = [], []  # rows with exactly one token to feed: one batched call
        for b in rows:
            r = reqs[b]
            c = r.constraint
            if c.matcher is None or r.answer_start is None:
                continue
            patch = None if known is None else known.get(id(r))
            if c._after_think:
                c.watch(r.output_ids, r.answer_start, patch)
            new = c.unfed(r.output_ids, r.answer_start, None, patch)
            if len(new) == 1:
                fed_c.append(c)
                fed_t.append(new[0])
            elif new:
                c.sync(r.output_ids, r.answer_start, None, patch)
        if fed_c:
            import xgrammar

            ok = xgrammar.BatchGrammarMatcher.batch_accept_token([c.matcher for c in fed_c],
                                                                 fed_t)
            for c, t, a in zip(fed_c, fed_t, ok):
                c.took(t, a)
        free = [not reqs[b].samples_answer for b in rows]
        on = [not f and reqs[b].constraint.grammar_on for f, b in zip(free, rows)]
        gi = [i for i, g in enumerate(on) if g]
        if len(gi) > 1:
            _batcher().batch_fill_next_token_bitmask([reqs[rows[i]].constraint.matcher
                                                      for i in gi], self.bits, gi)
        elif gi:
            reqs[rows[gi[0]]].constraint.matcher.fill_next_token_bitmask(self.bits, gi[0])
        arr = self.bits.numpy()
        if len(gi) < len(rows):
            arr[[i for i, g in enumerate(on) if not g]] = -1
        if gi:
            _clear_padding(arr, self._vocab_size)  # harmless on the all-ones rows
        for i, b in enumerate(rows):
            r = reqs[b]
            c = r.constraint
            stop, start = len(r.output_ids), _answer_start(r)
            if not free[i] and c.restricts(stop - start):
                c.restrict(arr[i], r.output_ids, stop, on[i], start,
                           None if known is None else known.get(id(r)))

    def wait(self) -> None:
        """Wait for the worker (re-raising what it raised); idempotent."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()

    def result(self):
        """``(rows, bits)``, the worker waited for."""
        self.wait()
        return self.rows, self.bits
