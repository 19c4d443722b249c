"""Repetition, frequency and presence penalties (vLLM's rules) from token counts kept on the
device for each live request, updated with the tokens its answer gained since the last step.
Design notes: docs/internals.md, "latentserve.penalties"."""

from __future__ import annotations

import operator
from array import array
from collections.abc import Callable, Hashable
from typing import Any

import torch

from latentserve.staging import HostToDevice


class PenaltyCounts:
    """Per request with penalties (by ``key(req)``, default its ``rid``), a row of ``counts``
    (``[R, vocab] int32``: how often each token occurs in its answer so far) and of
    ``prompt`` (``[R, vocab] bool``: the tokens of its prompt, for the repetition penalty),
    on ``device``. A row is taken at a request's first :meth:`count` (the tensors grow by
    doubling) and given back by :meth:`release`. A step costs O(batch) host work and two
    small copies: the answer is not sent again. ``live``: whether a request announced by
    :meth:`add` has not been released (the engine counts only then)."""

    def __init__(self, vocab_size: int, device: torch.device | str,
                 key: Callable[[Any], Hashable] = operator.attrgetter("rid")):
        self.vocab = vocab_size
        self._key = key
        self.device = torch.device(device)
        self.counts = torch.zeros(0, vocab_size, dtype=torch.int32, device=self.device)
        self.prompt = torch.zeros(0, vocab_size, dtype=torch.bool, device=self.device)
        self._rows: dict[Hashable, int] = {}  # key -> row
        self._counted: dict[Hashable, int] = {}  # key -> answer tokens in its counts row
        self._free: list[int] = []
        self._live: set[Hashable] = set()  # add()ed, not released
        self._epoch = 0  # changes whenever a row is taken or given back
        self._applied: tuple | None = None  # ((epoch, ids of the requests), their rows)
        self._last: dict[str, tuple[array, torch.Tensor]] = {}  # _copy's last per tag
        self._copies = HostToDevice(self.device, slots=4)  # two copies a step

    def __len__(self) -> int:
        return len(self._rows)

    def add(self, key: Hashable) -> None:
        """Announce a live request with penalties (``live`` until :meth:`release`)."""
        self._live.add(key)

    @property
    def live(self) -> bool:
        return bool(self._live)

    def count(self, reqs, src: dict[int, int] | None = None, slots: list | None = None,
              tokens: torch.Tensor | None = None) -> None:
        """Queue the counting of what the answers of ``reqs`` (requests with ``rid``,
        ``params``, ``prompt_ids``, ``output_ids``, ``answer_start``) gained since their last
        count; requests without penalties are skipped, an answer that shrank is counted
        again from its start. A trailing ``PENDING_ID`` (< 0) in an answer is not read
        (overlap mode): ``src`` (``id(req) -> j``) says that ``tokens[j]`` (``[T] int64`` on
        the device) is the token at index ``slots[j][1]`` of its ``output_ids``, counted from
        there. Not waited for. When it raises, nothing is counted (the call may be made
        again)."""
        taken: list = []
        try:
            updates = self._count(reqs, src, slots, tokens, taken)
        except BaseException:
            for k in taken:  # rows taken by this call go back, unused
                self.release(k)
            raise
        self._counted.update(updates)

    def _count(self, reqs, src, slots, tokens, taken: list) -> list:
        """:meth:`count`'s work; returns its ``(key, answer tokens counted)`` updates, for the
        caller to record once everything is queued; ``taken`` gets the keys of new rows."""
        base, vals, zero, fresh, prompt = (array("q") for _ in range(5))
        rows, counted, key, v = self._rows, self._counted, self._key, self.vocab
        updates = []
        for r in reqs:
            p = r.params
            if not p.has_penalties:
                continue
            k = key(r)
            row = rows.get(k)
            if row is None:
                row = self._take(k)
                taken.append(k)
                zero.append(row)
                fresh.append(row)
                if p.repetition_penalty != 1.0:
                    prompt.extend(row * v + t for t in set(r.prompt_ids))
            start = r.answer_start
            if start is None:
                continue
            out = r.output_ids
            n, done = len(out) - start, counted[k]
            if n < done:  # ids were taken back: count the answer again
                zero.append(row)
                done = 0
            known = n - 1 if n and out[-1] < 0 else n
            if known > done:
                base.extend([row * v] * (known - done))
                vals.extend(out[start + done : start + known])
                done = known
            if src is not None and (j := src.get(id(r))) is not None:
                at = slots[j][1] - start
                if at >= done:
                    base.append(row * v)
                    vals.append(-1 - j)
                    done = at + 1
            updates.append((k, done))
        if not (base or zero):
            return updates
        n, z, f = len(base), len(zero), len(fresh)
        dev = self._copy("count", base + vals + zero + fresh + prompt)
        if z:  # a new owner, or an answer counted again
            self.counts.index_fill_(0, dev[2 * n : 2 * n + z], 0)
        if f:  # a row's earlier owner left its prompt
            self.prompt.index_fill_(0, dev[2 * n + z : 2 * n + z + f], False)
            if prompt:
                self.prompt.view(-1).index_fill_(0, dev[2 * n + z + f :], True)
        if n:
            toks = tokens if tokens is not None else dev[:0]
            if self.device.type == "cuda":
                from latentserve.ops.kernels.penalties import count_tokens

                count_tokens(self.counts, dev[: 2 * n], toks)
            else:
                e = dev[n : 2 * n]
                ids = e if not len(toks) else torch.where(e >= 0, e, toks[(-1 - e).clamp(min=0)])
                self.counts.view(-1).index_put_(
                    (dev[:n] + ids,), torch.ones(n, dtype=torch.int32, device=self.device),
                    accumulate=True)
        return updates

    def _copy(self, tag: str, values: array) -> torch.Tensor:
        """``values`` on the device: the last copy under ``tag`` when its values were equal
        (a steady batch sends nothing)."""
        last = self._last.get(tag)
        if last is not None and last[0] == values:
            return last[1]
        dev = self._copies.copy(values)
        self._last[tag] = (values, dev)
        return dev

    def apply(self, logits: torch.Tensor, reqs) -> torch.Tensor:
        """A new ``[S, V]`` tensor: ``logits`` (``[S, V]``, row i for ``reqs[i]``, not
        modified) with each request's penalties applied from its counts (rows of requests
        without penalties, or whose token is no answer token (``core.Req.samples_answer``),
        copied). Not waited for. ValueError when ``V`` is not the counts'
        vocabulary; RuntimeError for a request with penalties that was never counted."""
        if logits.shape[1] != self.vocab:
            raise ValueError(f"logits have {logits.shape[1]} columns, the counts {self.vocab}")
        n = len(reqs)
        answer = tuple(r.samples_answer for r in reqs)
        same = (self._epoch, tuple(map(id, reqs)), answer)  # the same rows
        if self._applied is None or self._applied[0] != same:
            rows = array("q")
            for r, a in zip(reqs, answer):
                row = self._rows.get(self._key(r), -1)
                if row < 0 and r.params.has_penalties:
                    raise RuntimeError(f"request {r.rid!r} has penalties but was never "
                                       "counted")
                rows.append(row if a else -1)  # no penalty on a latent step's token
            params = array("d", [r.params.repetition_penalty for r in reqs]
                           + [r.params.frequency_penalty for r in reqs]
                           + [r.params.presence_penalty for r in reqs])
            self._applied = (same, self._copy("apply", rows + array("q", params.tobytes())))
        dev = self._applied[1]
        rows_d, params_d = dev[:n], dev[n:].view(torch.float64)
        if logits.is_cuda:
            from latentserve.ops.kernels.penalties import penalize

            return penalize(logits if logits.stride(-1) == 1 else logits.contiguous(),
                            self.counts, self.prompt, rows_d, params_d)
        return penalize_reference(logits, self.counts, self.prompt, rows_d, params_d)

    def release(self, key: Hashable) -> None:
        """The request with ``key`` left: its row goes back (no-op without one)."""
        self._live.discard(key)
        row = self._rows.pop(key, None)
        if row is not None:
            del self._counted[key]
            self._free.append(row)
            self._epoch += 1

    def _take(self, key: Hashable) -> int:
        if not self._free:
            old = self.counts.shape[0]
            self._grow(max(8, 2 * old))
            self._free.extend(range(self.counts.shape[0] - 1, old - 1, -1))
        row = self._rows[key] = self._free.pop()
        self._counted[key] = 0
        self._epoch += 1
        return row

    def _grow(self, rows: int) -> None:
        counts = torch.zeros(rows, self.vocab, dtype=torch.int32, device=self.device)
        prompt = torch.zeros(rows, self.vocab, dtype=torch.bool, device=self.device)
        counts[: len(self.counts)] = self.counts
        prompt[: len(self.prompt)] = self.prompt
        self.counts, self.prompt = counts, prompt


def penalize_reference(logits: torch.Tensor, counts: torch.Tensor, prompt: torch.Tensor,
                       rows: torch.Tensor, params: torch.Tensor) -> torch.Tensor:
    """What ``ops.kernels.penalties.penalize`` computes (same arguments), in torch: the CPU
    path."""
    n = logits.shape[0]
    has = rows >= 0
    r = rows.clamp(min=0)
    c = counts[r].to(torch.float32)
    rep, freq, pres = params.to(torch.float32).view(3, n, 1)
    y = logits.to(torch.float32)
    seen = (c > 0) | prompt[r]
    big = torch.finfo(logits.dtype).max
    scaled = torch.where(y > 0, y / rep, y * rep).clamp(-big, big)
    y = torch.where(seen & (rep != 1.0), scaled, y)
    y = (y - freq * c) - pres * c.clamp(max=1.0)
    return torch.where(has[:, None], y.to(logits.dtype), logits)


def apply_penalties(logits: torch.Tensor, reqs) -> torch.Tensor:
    """``logits`` (``[N, vocab]``, row i for ``reqs[i]``, not modified) with each request's
    penalties applied, counting its whole answer (no pending token): one step of a
    :class:`PenaltyCounts` of its own."""
    state = PenaltyCounts(logits.shape[1], logits.device, key=id)
    state.count(reqs)
    return state.apply(logits, reqs)
