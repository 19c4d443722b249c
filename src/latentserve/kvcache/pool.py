"""The KV pool (per-layer K and V buffers indexed by slot) and the page table: page size 1,
one slot id per token as SGLang's ``req_to_token``; slot 0 is a dummy for padded rows."""

from __future__ import annotations

from array import array

import torch

from latentserve.staging import HostToDevice


class KVPool:
    """K and V buffers: ``k[layer]``/``v[layer]`` ``[num_slots + 1, num_kv_heads, head_dim]``
    in ``dtype`` (row 0 the dummy); recurrent models have one layer per (iteration, layer)."""

    def __init__(self, num_layers: int, num_slots: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str):
        shape = (num_slots + 1, num_kv_heads, head_dim)
        self.num_slots = num_slots
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]

    def store(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write ``k, v: [T, num_kv_heads, head_dim]`` into ``slots: [T] int64``."""
        self.k[layer][slots] = k.to(self.k[layer].dtype)
        self.v[layer][slots] = v.to(self.v[layer].dtype)

    @staticmethod
    def bytes_per_slot(num_layers: int, num_kv_heads: int, head_dim: int, dtype) -> int:
        size = torch.empty((), dtype=dtype).element_size()
        return 2 * num_layers * num_kv_heads * head_dim * size


class PageTable:
    """Slot-id rows, one per running request: ``table [max_reqs + 1, max_model_len] int64``;
    ``alloc_row()`` (None when full) / ``free_row(i)``. Row ``dummy_row`` (the last) stays
    zeros for padded rows. ``stage(cells, n, slots)`` records ``table[cells[j], cells[n + j]]
    = slots[j]``, applied on the next ``table`` read or handed to ``decode_inputs`` by
    ``take_staged``; ``raw``: the table without them."""

    def __init__(self, max_reqs: int, max_model_len: int, device: torch.device | str):
        self.raw = torch.zeros((max_reqs + 1, max_model_len), dtype=torch.int64,
                               device=device)
        self.dummy_row = max_reqs
        self._free = list(range(max_reqs - 1, -1, -1))
        self._staged: tuple | None = None
        self._to_device: HostToDevice | None = None  # for the cells, made on first use

    @property
    def table(self) -> torch.Tensor:
        """The page table, with every staged write applied (see the class docstring)."""
        if self._staged is not None:
            self.apply_staged()
        return self.raw

    def stage(self, cells: array, n: int, slots: torch.Tensor) -> None:
        """Record ``n`` writes: ``cells`` ``array('q')`` ``[rows (n) | cols (n)]``, ``slots``
        ``[n] int64``; ValueError when the lengths disagree."""
        if len(cells) != 2 * n or slots.shape != (n,):
            raise ValueError(f"stage needs 2 * n = {2 * n} cells and [n] slots, got "
                             f"{len(cells)} and {tuple(slots.shape)}")
        if self._staged is not None:
            self.apply_staged()
        if n:
            self._staged = (cells, n, slots)

    @property
    def staged(self) -> tuple | None:
        """The staged writes ``(cells, n, slots)``, or None; still staged."""
        return self._staged

    def take_staged(self) -> tuple | None:
        """The staged writes ``(cells, n, slots)`` (None when none), now the caller's to
        write: they are no longer applied on a read."""
        staged, self._staged = self._staged, None
        return staged

    def apply_staged(self) -> None:
        """Issue the staged writes now (a host-to-device copy of the cells and a scatter)."""
        staged = self._staged
        if staged is None:
            return
        cells, n, slots = staged
        if self._to_device is None:
            self._to_device = HostToDevice(self.raw.device)
        idx = self._to_device.copy(cells)  # [rows | cols], through a pinned buffer
        self.raw[idx[:n], idx[n:]] = slots
        self._staged = None  # NOTE: only once queued: a raise above keeps them staged

    def alloc_row(self) -> int | None:
        return self._free.pop() if self._free else None

    def free_row(self, row: int) -> None:
        self._free.append(row)
