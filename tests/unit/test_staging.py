"""``staging``: the engine's per-step copies between host and device, on a CPU device (no
copy: wrapped or cloned). The pinned-buffer ring itself runs on CUDA only
(``tests/gpu/test_staging_gpu.py``)."""

from array import array

import pytest
import torch

from latentserve.staging import DeviceToHost, HostToDevice


def test_host_to_device_on_the_cpu_wraps_the_values():
    values = array("q", [3, -1, 2 ** 40, 0])
    out = HostToDevice("cpu").copy(values)
    assert out.dtype == torch.int64 and out.tolist() == [3, -1, 2 ** 40, 0]
    empty = HostToDevice("cpu").copy(array("q"))
    assert empty.shape == (0,) and empty.dtype == torch.int64


def test_device_to_host_on_the_cpu_clones_without_an_event():
    tokens = torch.tensor([5, 6, 7])
    host, event = DeviceToHost().copy(tokens)
    tokens.fill_(0)
    assert event is None and host.tolist() == [5, 6, 7]


@pytest.mark.parametrize("bad", [torch.zeros(3, dtype=torch.int32),
                                 torch.zeros(2, 2, dtype=torch.int64)])
def test_device_to_host_rejects_what_is_not_1d_int64(bad):
    with pytest.raises(ValueError, match="1-D int64"):
        DeviceToHost().copy(bad)


@pytest.mark.parametrize("cls", [HostToDevice, DeviceToHost])
def test_a_ring_needs_two_slots(cls):
    with pytest.raises(ValueError, match="slots must be >= 2"):
        cls("cuda", slots=1) if cls is HostToDevice else cls(slots=1)
