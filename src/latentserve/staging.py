"""Pinned host buffers for the engine's small per-step copies between host and device.
Design notes: docs/internals.md, "latentserve.staging"."""

from __future__ import annotations

import ctypes
from array import array

import torch


def to_device(values, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """``values`` (a sequence of numbers, or a CPU tensor) as a 1-D ``dtype`` tensor on
    ``device``, queued without waiting for the device. On CUDA the bytes go through a pinned
    block of torch's caching host allocator, which holds the block until its copy is done;
    ``torch.tensor(values, device="cuda")`` would be a pageable copy, which waits for all the
    work queued on the stream (the forward that overlap scheduling runs meanwhile)."""
    device = torch.device(device)
    if device.type != "cuda":
        return torch.as_tensor(values, dtype=dtype).to(device)
    if isinstance(values, torch.Tensor):
        host = values.to(dtype).pin_memory()
    else:
        host = torch.tensor(values, dtype=dtype, pin_memory=True)
    return host.to(device, non_blocking=True)


class _Ring:
    """``slots`` pinned int64 buffers (grown on demand) and the event of each one's last
    copy."""

    def __init__(self, slots: int):
        if slots < 2:
            raise ValueError(f"slots must be >= 2, got {slots}")
        self._bufs: list[torch.Tensor | None] = [None] * slots
        self._events: list = [None] * slots
        self._next = 0

    def take(self, n: int) -> tuple[torch.Tensor, object]:
        """The next buffer, at least ``n`` long and free (its last copy waited for), and the
        event to record after the copy that uses it."""
        i = self._next
        self._next = (i + 1) % len(self._bufs)
        event = self._events[i]
        if event is None:
            event = self._events[i] = torch.cuda.Event()
        else:
            event.synchronize()  # NOTE: its copy was queued `slots` copies ago
        buf = self._bufs[i]
        if buf is None or buf.numel() < n:  # a power of two, so a ramp of sizes grows rarely
            buf = self._bufs[i] = torch.empty(max(1 << (n - 1).bit_length(), 256),
                                              dtype=torch.int64, pin_memory=True)
        return buf, event


class HostToDevice:
    """Copies int64 vectors (``array('q')``) to ``device`` through a ring of ``slots`` (>= 2,
    else ValueError) pinned buffers; a plain tensor on a CPU device."""

    def __init__(self, device: torch.device | str, slots: int = 4, side_stream: bool = False):
        self.device = torch.device(device)
        ring = _Ring(slots)
        self._ring = ring if self.device.type == "cuda" else None
        self._side = torch.cuda.Stream(self.device) if side_stream and self._ring else None

    def copy(self, values: array) -> torch.Tensor:
        """``values`` (``array('q')``) as a ``[len(values)] int64`` device tensor, queued
        without waiting (on the side stream if set); ``values`` may change once this
        returns. Raises ValueError for another typecode."""
        if values.typecode != "q":
            raise ValueError(f"values must be an array('q'), got typecode {values.typecode!r}")
        n = len(values)
        if n == 0:
            return torch.empty(0, dtype=torch.int64, device=self.device)
        if self._ring is None:  # a copy: the tensor must not share the array's memory
            return torch.frombuffer(values, dtype=torch.int64).clone()
        buf, event = self._ring.take(n)
        ctypes.memmove(buf.data_ptr(), values.buffer_info()[0], n * 8)
        cur = torch.cuda.current_stream(self.device)
        if self._side is None:
            out = buf[:n].to(self.device, non_blocking=True)
            event.record(cur)
            return out
        with torch.cuda.stream(self._side):  # NOTE: `out` is allocated for the side stream
            out = buf[:n].to(self.device, non_blocking=True)
            event.record(self._side)
        cur.wait_event(event)
        out.record_stream(cur)  # and used on the current one
        return out


class DeviceToHost:
    """Copies int64 device vectors to a ring of ``slots`` (>= 2, else ValueError) pinned host
    buffers without waiting; a host tensor stays valid for ``slots - 1`` later copies.
    ``side_stream``: copy on its own stream; later writers of the source wait for the
    returned event (``CudaGraphRunner.wait_before_replay``)."""

    def __init__(self, slots: int = 4, side_stream: bool = False):
        self._ring = _Ring(slots)
        self._want_side = side_stream
        self._side: dict = {}  # device -> (side stream, ring of "values ready" events)

    def copy(self, values: torch.Tensor) -> tuple[torch.Tensor, object]:
        """``(host, event)``: ``values`` (``[n] int64``) in a pinned buffer and the CUDA event
        to synchronize before reading it (CPU: a clone, None). ValueError if not 1-D int64."""
        if values.dtype != torch.int64 or values.dim() != 1:
            raise ValueError(f"values must be a 1-D int64 tensor, got {values.dtype} "
                             f"of shape {tuple(values.shape)}")
        if not values.is_cuda:
            return values.clone(), None
        i = self._ring._next
        buf, event = self._ring.take(values.numel())
        host = buf[: values.numel()]
        cur = torch.cuda.current_stream(values.device)
        if not self._want_side:
            host.copy_(values, non_blocking=True)
            event.record(cur)
            return host, event
        side = self._side.get(values.device)
        if side is None:
            side = self._side[values.device] = (
                torch.cuda.Stream(values.device),
                [torch.cuda.Event() for _ in range(len(self._ring._bufs))])
        stream, ready = side
        ready[i].record(cur)  # NOTE: reused once `event` of the same slot completed
        stream.wait_event(ready[i])
        with torch.cuda.stream(stream):
            host.copy_(values, non_blocking=True)
            event.record(stream)
        values.record_stream(stream)  # freed on the current stream: not reused before this
        return host, event


class BitmaskToDevice:
    """Token bitmasks (``[M, W] int32``) written on the host into a ring of ``slots`` (>= 2,
    else ValueError) pinned buffers and copied to ``device`` without waiting (CPU: a new
    tensor)."""

    def __init__(self, device: torch.device | str, slots: int = 3):
        self.device = torch.device(device)
        ring = _Ring(slots)
        self._ring = ring if self.device.type == "cuda" else None
        self._event = None

    def host(self, rows: int, width: int) -> torch.Tensor:
        """A ``[rows, width] int32`` host tensor to fill (any content), then pass to
        :meth:`copy`; on CUDA the next pinned buffer, free of its last copy."""
        if self._ring is None:
            return torch.empty(rows, width, dtype=torch.int32)
        buf, self._event = self._ring.take((rows * width + 1) // 2)
        return buf.view(torch.int32)[: rows * width].view(rows, width)

    def copy(self, bits: torch.Tensor) -> torch.Tensor:
        """``bits`` (rows of the last :meth:`host` tensor) on the device: a copy queued on
        the current stream, not waited for."""
        if self._ring is None:
            return bits
        out = bits.to(self.device, non_blocking=True)
        self._event.record(torch.cuda.current_stream(self.device))
        return out
