"""KV slot allocator: hands out token-granular slot ids of the KV pool.

Modelled on SGLang's ``TokenToKVPoolAllocator``
(``python/sglang/srt/mem_cache/allocator.py``) and mini-sglang's cache manager: the free list is
a single int64 tensor on the pool's device, so alloc is a slice and free is one concat.
"""

from __future__ import annotations

import torch


class SlotAllocator:
    """Free list of KV slot ids ``1..num_slots`` (page size 1).

    Slot 0 is a reserved dummy slot: it is never handed out, so padded rows of a batch can
    write their (garbage) K/V there. A KV pool backing this allocator therefore needs
    ``num_slots + 1`` rows.

    The free list is a 1-D ``torch.int64`` tensor on ``device``. ``alloc`` takes slots from its
    front, ``free`` appends to its back; neither loops over slots in Python. The allocator does
    not check for double frees or foreign ids (that would need a device sync); the callers
    (request table and ``RadixCache``) own that invariant.
    """

    def __init__(self, num_slots: int, device: torch.device | str = "cpu") -> None:
        if num_slots < 1:
            raise ValueError(f"num_slots must be >= 1, got {num_slots}")
        self._num_slots = num_slots
        self.device = torch.device(device)
        self.reset()

    def reset(self) -> None:
        """Mark every slot ``1..num_slots`` free again (forgets all outstanding allocations)."""
        self._free = torch.arange(1, self._num_slots + 1, dtype=torch.int64, device=self.device)

    @property
    def num_free(self) -> int:
        """Number of slots that ``alloc`` can still hand out."""
        return self._free.numel()

    @property
    def num_total(self) -> int:
        """Number of allocatable slots (``num_slots``; the dummy slot 0 is not counted)."""
        return self._num_slots

    def alloc(self, n: int) -> torch.Tensor | None:
        """Take ``n`` free slots.

        Returns:
            ``torch.int64`` tensor of shape ``[n]`` on ``device``, or None when fewer than ``n``
            slots are free (the allocation is all-or-nothing; nothing is taken then).
        """
        if n < 0:
            raise ValueError(f"cannot allocate {n} slots")
        if n > self._free.numel():
            return None
        out, self._free = self._free[:n], self._free[n:]
        return out

    def free(self, slots: torch.Tensor) -> None:
        """Give slots back. ``slots``: integer tensor of any shape (flattened), any device."""
        if slots.numel() == 0:
            return
        self.free_many([slots])

    def free_many(self, pieces: list[torch.Tensor]) -> None:
        """``free`` of each tensor in ``pieces``, in one concatenation (empty ones skipped)."""
        pieces = [p.reshape(-1).to(device=self.device, dtype=torch.int64)
                  for p in pieces if p.numel()]
        if pieces:
            self._free = torch.cat((self._free, *pieces))
