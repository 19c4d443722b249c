"""KV slot allocator: token-granular slot ids of the KV pool (docs/internals.md)."""

from __future__ import annotations

import torch


class SlotAllocator:
    """Free list of KV slot ids ``1..num_slots`` as an int64 tensor on ``device`` (slot 0 is
    the dummy). ``free`` queues slots, joined when ``alloc`` reaches them or at
    ``MAX_QUEUED``; double frees are not checked (the callers own that)."""

    MAX_QUEUED = 1024  # freed tensors waiting before they are joined to the free list

    def __init__(self, num_slots: int, device: torch.device | str = "cpu") -> None:
        if num_slots < 1:
            raise ValueError(f"num_slots must be >= 1, got {num_slots}")
        self._num_slots = num_slots
        self.device = torch.device(device)
        self.reset()

    def reset(self) -> None:
        """Mark every slot ``1..num_slots`` free again (forgets all outstanding allocations)."""
        self._free = torch.arange(1, self._num_slots + 1, dtype=torch.int64, device=self.device)
        self._queued: list[torch.Tensor] = []  # freed, not yet joined to ``_free``
        self._num_queued = 0

    def _join(self) -> None:
        self._free = torch.cat((self._free, *self._queued))
        self._queued, self._num_queued = [], 0

    @property
    def num_free(self) -> int:
        """Number of slots that ``alloc`` can still hand out."""
        return self._free.numel() + self._num_queued

    @property
    def num_total(self) -> int:
        """Number of allocatable slots (``num_slots``; the dummy slot 0 is not counted)."""
        return self._num_slots

    def alloc(self, n: int) -> torch.Tensor | None:
        """Take ``n`` free slots: ``[n] int64`` on ``device``, or None (nothing taken) when fewer
        are free."""
        if n < 0:
            raise ValueError(f"cannot allocate {n} slots")
        if n > self._free.numel():
            if n > self.num_free:
                return None
            self._join()
        out, self._free = self._free[:n], self._free[n:]
        return out

    def free(self, slots: torch.Tensor) -> None:
        """Give slots back. ``slots``: integer tensor of any shape (flattened), any device;
        copied, so the caller may reuse it."""
        self.free_many([slots.reshape(-1).to(device=self.device, dtype=torch.int64,
                                              copy=True)])

    def free_many(self, pieces: list[torch.Tensor]) -> None:
        """Give back each 1-D int64 tensor of ``pieces``, queued uncopied (do not write to
        them after)."""
        for p in pieces:
            k = p.numel()
            if k:
                self._queued.append(p)
                self._num_queued += k
        if len(self._queued) > self.MAX_QUEUED:
            self._join()
