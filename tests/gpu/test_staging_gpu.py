"""``staging`` on CUDA: the pinned-buffer rings give every copy its own values while earlier
copies are still queued behind device work, when buffers are reused (the ring's event wait)
and when they grow; token bitmasks too."""

from array import array

import pytest
import torch

from latentserve.staging import BitmaskToDevice, DeviceToHost, HostToDevice

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _busy():
    """Queue ~tens of ms of device work, so the copies after it wait behind it."""
    a = torch.randn(4096, 4096, device="cuda")
    for _ in range(8):
        a = a @ a
        a /= a.norm()


@pytest.mark.parametrize("side", [False, True])
def test_host_to_device_copies_keep_their_values_across_reuse_and_growth(side):
    ring = HostToDevice("cuda", slots=2, side_stream=side)
    outs, want = [], []
    # growing sizes (new buffers), then sizes that fit (each buffer reused, behind its copy)
    for i, n in enumerate([100, 400, 1000, 3000, 700, 900, 50, 2000, 1500, 10]):
        if i % 3 == 0:
            _busy()
        values = array("q", range(i, i + n))
        outs.append(ring.copy(values))
        want.append(list(values))
        values[0] = -7  # the caller may change the array once copy returned
    torch.cuda.synchronize()
    assert [o.tolist() for o in outs] == want
    assert all(o.is_cuda and o.dtype == torch.int64 for o in outs)


def test_a_side_stream_copy_is_ready_for_the_current_streams_next_kernel():
    """The copy runs beside the queued work; a kernel queued after it on the current stream
    reads the copied values (it waits for the copy's event), and a freed copy's memory is
    not handed to a side-stream copy while the current stream may still read it."""
    ring = HostToDevice("cuda", slots=2, side_stream=True)
    sums = []
    for i in range(6):
        _busy()
        out = ring.copy(array("q", range(i, i + 5000)))
        sums.append(out.sum())  # queued behind _busy() on the current stream
        del out  # freed while the sum has not run: the allocator must not reuse it early
    assert [int(x) for x in sums] == [sum(range(i, i + 5000)) for i in range(6)]


def test_device_to_host_copies_stay_valid_for_slots_minus_one_later_copies():
    """As overlap scheduling uses them: a host copy is read after later copies were taken
    (here slots - 1 of them, queued behind device work, nothing synchronized in between)."""
    slots = 3
    ring = DeviceToHost(slots=slots)
    _check_device_to_host(ring, slots)


def test_side_stream_device_to_host_copies_wait_for_the_values():
    """On the side stream the copy still waits for the work that produced the values; and a
    write queued after it on the current stream waits for the copy's event first, as
    ``CudaGraphRunner.wait_before_replay`` makes a replay do."""
    ring = DeviceToHost(slots=3, side_stream=True)
    _check_device_to_host(ring, 3, wait=True)


def _check_device_to_host(ring, slots, wait=False):
    for rnd in range(3):
        _busy()
        got, want = [], []
        for i in range(slots):
            n = 300 + 200 * i + rnd  # larger than the ring's first buffers: they grow
            tokens = torch.arange(n, device="cuda") * (rnd + 1) + i
            got.append(ring.copy(tokens))
            want.append((torch.arange(n) * (rnd + 1) + i).tolist())
            if wait:
                torch.cuda.current_stream().wait_event(got[-1][1])
            tokens.fill_(-1)  # queued after the copy: must not reach the host copy
        for (host, event), w in zip(got, want):
            event.synchronize()
            assert host.tolist() == w


def test_bitmask_copies_keep_their_rows_across_reuse_and_growth():
    ring = BitmaskToDevice("cuda", slots=2)
    outs, want = [], []
    for i, rows in enumerate([3, 64, 7, 64, 1, 33]):
        if i % 2 == 0:
            _busy()
        host = ring.host(rows, 1536)
        assert host.is_pinned() and host.shape == (rows, 1536) and host.dtype == torch.int32
        values = torch.arange(rows * 1536, dtype=torch.int32).view(rows, 1536) + i
        host.copy_(values)
        used = max(1, rows - 1)  # the engine copies the first M rows
        outs.append(ring.copy(host[:used]))
        want.append(values[:used])
    torch.cuda.synchronize()
    for o, w in zip(outs, want):
        assert o.is_cuda and torch.equal(o.cpu(), w)
