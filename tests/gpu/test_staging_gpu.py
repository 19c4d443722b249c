"""``staging`` on CUDA: the pinned-buffer rings give every copy its own values while earlier
copies are still queued behind device work, across buffer reuse and growth."""

from array import array

import pytest
import torch

from latentserve.staging import DeviceToHost, HostToDevice

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _busy():
    """Queue ~tens of ms of device work, so the copies below wait behind it."""
    a = torch.randn(4096, 4096, device="cuda")
    for _ in range(8):
        a = a @ a
        a /= a.norm()


def test_host_to_device_copies_keep_their_values_across_reuse_and_growth():
    ring = HostToDevice("cuda", slots=2)
    _busy()
    outs, want = [], []
    for i in range(9):
        n = 100 + 300 * i  # grows past the first buffers
        values = array("q", range(i, i + n))
        outs.append(ring.copy(values))
        want.append(list(values))
        values[0] = -7  # the caller may change the array once copy returned
    torch.cuda.synchronize()
    assert [o.tolist() for o in outs] == want
    assert all(o.is_cuda and o.dtype == torch.int64 for o in outs)


def test_device_to_host_copies_arrive_after_their_event():
    ring = DeviceToHost(slots=3)
    got = []
    for i in range(7):
        _busy()
        tokens = torch.arange(i, i + 64 + i, device="cuda")
        host, event = ring.copy(tokens)
        tokens.fill_(-1)  # queued after the copy: must not reach the host copy
        event.synchronize()
        got.append(host.tolist() == list(range(i, i + 64 + i)))
    assert all(got)
