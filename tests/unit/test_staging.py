"""``staging``: the engine's per-step copies between host and device, on a CPU device (no
copy: wrapped or cloned). The pinned-buffer ring itself runs on CUDA only
(``tests/gpu/test_staging_gpu.py``)."""

from array import array

import pytest
import torch

from latentserve.staging import DeviceToHost, HostToDevice, to_device


def test_host_to_device_on_the_cpu_copies_the_values():
    values = array("q", [3, -1, 2 ** 40, 0])
    out = HostToDevice("cpu").copy(values)
    values[0] = 9  # the caller may change the array, or grow it, once copy returned
    values.extend(range(1000))
    assert out.dtype == torch.int64 and out.tolist() == [3, -1, 2 ** 40, 0]
    empty = HostToDevice("cpu").copy(array("q"))
    assert empty.shape == (0,) and empty.dtype == torch.int64


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_host_to_device_takes_only_int64_arrays(device):
    with pytest.raises(ValueError, match="array\\('q'\\)"):
        HostToDevice(device).copy(array("i", [1, 2, 3, 4]))


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


@pytest.mark.parametrize("make", [lambda: HostToDevice("cuda", slots=1),
                                  lambda: HostToDevice("cpu", slots=1),
                                  lambda: DeviceToHost(slots=1)])
def test_a_ring_needs_two_slots(make):
    with pytest.raises(ValueError, match="slots must be >= 2"):
        make()


def test_side_stream_is_a_plain_copy_on_the_cpu():
    values = array("q", [3, 1, 2])
    out = HostToDevice("cpu", side_stream=True).copy(values)
    values[0] = 9
    assert out.tolist() == [3, 1, 2]
    src = torch.tensor([4, 5], dtype=torch.int64)
    host, event = DeviceToHost(side_stream=True).copy(src)
    src.fill_(0)
    assert host.tolist() == [4, 5] and event is None


@pytest.mark.parametrize("values", [[3, 1, 2], torch.tensor([3, 1, 2])])
@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.float32, torch.bool])
def test_to_device_on_the_cpu_gives_the_values_in_the_dtype(values, dtype):
    out = to_device(values, dtype, "cpu")
    assert out.dtype == dtype and out.device.type == "cpu"
    assert out.tolist() == torch.tensor([3, 1, 2]).to(dtype).tolist()
