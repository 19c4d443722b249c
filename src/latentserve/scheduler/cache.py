"""KV bookkeeping per request: page-table rows, slots, prefix matching, hand-back to the radix
cache (``check_idle``: none admitted, ``num_free + radix.total_size() == num_total``)."""

from __future__ import annotations

from array import array

import torch

from latentserve.core import Req
from latentserve.kvcache.allocator import SlotAllocator
from latentserve.kvcache.pool import PageTable
from latentserve.kvcache.radix import RadixCache


class CacheManager:
    """Owns the slot allocator, the radix cache and the page table; keeps ``req.row``,
    ``num_allocated``, ``cache_len`` and ``cache_node`` consistent."""

    def __init__(self, allocator: SlotAllocator, radix: RadixCache, table: PageTable):
        self.allocator = allocator
        self.radix = radix
        self.table = table
        self._grows: list[tuple[int, int, int]] = []  # (row, from, to) reserved, not written
        self._pending = 0

    def admit(self, req: Req) -> bool:
        """Give ``req`` a page-table row, its cached prefix and slots for the rest; False
        (holding nothing) when out, even after eviction."""
        row = self.table.alloc_row()
        if row is None:
            return False
        ids = req.cache_key
        # Leave at least one token to compute: its logits give the next token. Never match
        # past a latent position: its KV depends on a hidden state, not on the id.
        # A request that wants its prompt's logprobs needs every prompt position computed.
        limit = 0 if req.params.prompt_logprobs is not None else req.cacheable_len
        prefix, node = self.radix.match_prefix(ids[: min(len(ids) - 1, limit)])
        self.radix.inc_lock(node)
        m = len(prefix)
        if (short := len(ids) - m - self.allocator.num_free) > 0:
            self.radix.evict(short)
        slots = self.allocator.alloc(len(ids) - m)
        if slots is None:
            self.radix.dec_lock(node)
            self.table.free_row(row)
            return False
        self.table.table[row, :m] = prefix
        self.table.table[row, m : len(ids)] = slots
        req.row, req.cache_node, req.cache_len = row, node, m
        req.num_computed, req.num_allocated = m, len(ids)
        return True

    def reserve(self, req: Req, upto: int) -> bool:
        """Reserve slots for ``req``'s ids ``[0, upto)``, evicting the radix cache when short;
        False (nothing reserved) when out. Call :meth:`flush` before :meth:`admit` or any
        page-table read."""
        need = upto - req.num_allocated
        if need <= 0:
            return True
        short = self._pending + need - self.allocator.num_free
        if short > 0:
            self.radix.evict(short)
            if self._pending + need > self.allocator.num_free:
                return False
        self._grows.append((req.row, req.num_allocated, upto))
        self._pending += need
        req.num_allocated = upto
        return True

    def flush(self) -> None:
        """Take the slots reserved since the last flush and stage their page-table writes
        (``PageTable.stage``); the next ``table.table`` read or packed replay applies them."""
        if not self._grows:
            return
        slots = self.allocator.alloc(self._pending)
        assert slots is not None  # reserved when the rows grew
        rows, cols = array("q"), array("q")
        for row, lo, hi in self._grows:
            if hi - lo == 1:  # a decode row
                rows.append(row)
                cols.append(lo)
            else:
                rows.extend([row] * (hi - lo))
                cols.extend(range(lo, hi))
        n = len(rows)
        rows.extend(cols)
        self.table.stage(rows, n, slots)
        self._grows.clear()
        self._pending = 0

    def release_many(self, reqs: list[Req]) -> None:
        """Hand each of ``reqs``' KV before its first latent to the radix cache and free the
        rest (rowless ones skipped), in a constant number of device operations."""
        reqs = [r for r in reqs if r.row >= 0]
        if not reqs:
            return
        table = self.table.table
        # per request: positions to insert [0, n), then the rest [n, allocated)
        sizes: list[int] = []
        for r in reqs:
            n = min(r.num_computed, r.cacheable_len)
            sizes += (n, r.num_allocated - n)
        # NOTE: a fresh tensor (clone / cat), so the radix tree may keep views of it; and
        # few torch calls per request: each costs a few microseconds of host time
        rows = [table[r.row, : r.num_allocated] for r in reqs]
        held = rows[0].clone() if len(rows) == 1 else torch.cat(rows)
        parts = held.split(sizes)
        freed = list(parts[1::2])  # uncomputed or latent-dependent: never cached
        # NOTE: with several requests each node copies its slots; a view would keep the
        # whole gathered tensor alive as long as the node lives
        copy = len(reqs) > 1
        try:
            for req, slots, n in zip(reqs, parts[::2], sizes[::2]):
                present = self.radix.insert(req.cache_key[:n], slots, copy=copy)
                if present > req.cache_len:  # cached meanwhile by another request
                    freed.append(slots[req.cache_len : present])
                self.radix.dec_lock(req.cache_node)
                self.table.free_row(req.row)
                req.row, req.cache_node, req.cache_len = -1, None, 0
                req.num_computed = req.num_allocated = 0
        finally:
            self.allocator.free_many(freed)

    @property
    def num_free(self) -> int:
        return self.allocator.num_free

    def check_idle(self) -> None:
        """Raise AssertionError unless free + cached slots == total (call with nothing admitted)."""
        free, cached = self.allocator.num_free, self.radix.total_size()
        total = self.allocator.num_total
        assert free + cached == total, f"KV leak: free {free} + cached {cached} != total {total}"
