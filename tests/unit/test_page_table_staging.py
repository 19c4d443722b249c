"""``PageTable.stage``: staged page-table writes are applied by the first read of
``table``, taken whole by ``take_staged`` (for the decode input kernel), and never lost
when a new stage arrives first."""

from array import array

import pytest
import torch

from latentserve.kvcache.pool import PageTable


def _stage(pt, cells, slots):
    rows = array("q", [r for r, _ in cells] + [c for _, c in cells])
    pt.stage(rows, len(cells), torch.tensor(slots, dtype=torch.int64))


def test_a_read_applies_the_staged_writes():
    pt = PageTable(4, 8, "cpu")
    _stage(pt, [(0, 0), (2, 5), (1, 7)], [11, 12, 13])
    assert pt.staged is not None
    assert int(pt.raw[2, 5]) == 0  # not written yet
    t = pt.table
    assert (int(t[0, 0]), int(t[2, 5]), int(t[1, 7])) == (11, 12, 13)
    assert pt.staged is None and int(t.sum()) == 36


def test_take_staged_hands_them_over():
    pt = PageTable(4, 8, "cpu")
    _stage(pt, [(3, 1)], [9])
    cells, n, slots = pt.take_staged()
    assert n == 1 and list(cells) == [3, 1] and slots.tolist() == [9]
    assert int(pt.table.sum()) == 0  # the taker writes them, a read does not
    assert pt.take_staged() is None


def test_a_second_stage_applies_the_first():
    pt = PageTable(4, 8, "cpu")
    _stage(pt, [(0, 1)], [5])
    _stage(pt, [(0, 2)], [6])
    assert int(pt.raw[0, 1]) == 5 and int(pt.raw[0, 2]) == 0
    assert int(pt.table[0, 2]) == 6


def test_stage_checks_lengths():
    pt = PageTable(4, 8, "cpu")
    with pytest.raises(ValueError, match="2 \\* n = 4 cells"):
        pt.stage(array("q", [0, 1, 2]), 2, torch.zeros(2, dtype=torch.int64))
    pt.stage(array("q"), 0, torch.zeros(0, dtype=torch.int64))  # nothing to stage
    assert pt.staged is None


def test_writes_stay_staged_when_applying_them_raises():
    pt = PageTable(4, 8, "cpu")
    _stage(pt, [(1, 2)], [7])

    class Broken:
        def copy(self, values):
            raise RuntimeError("copy failed")

    pt._to_device = Broken()
    with pytest.raises(RuntimeError):
        pt.table  # noqa: B018 - the read applies the writes
    assert pt.staged is not None  # not lost: the next read applies them
    pt._to_device = None
    assert int(pt.table[1, 2]) == 7


def test_requests_released_together_keep_every_slot_accounted_for():
    """``CacheManager.release_many`` of requests that share a prompt prefix: the tree keeps
    one copy of the prefix, the duplicates and the uncomputed tails go back to the free
    list, and free + cached + held covers every slot exactly once."""
    from latentserve.core import Req
    from latentserve.kvcache.allocator import SlotAllocator
    from latentserve.kvcache.radix import RadixCache
    from latentserve.sampling_params import SamplingParams
    from latentserve.scheduler.cache import CacheManager

    alloc = SlotAllocator(64)
    cm = CacheManager(alloc, RadixCache(alloc), PageTable(4, 32, "cpu"))
    shared = [5, 6, 7, 8]
    reqs = [Req(f"r{i}", shared + [20 + i, 30 + i], SamplingParams(max_tokens=4))
            for i in range(3)]
    for r in reqs:
        assert cm.admit(r)
        r.num_computed = len(r.prompt_ids)
        assert cm.reserve(r, len(r.prompt_ids) + 2)  # one more slot than computed
    cm.flush()
    cm.release_many(reqs[:2])
    cm.release_many([reqs[2]])
    assert all(r.row == -1 for r in reqs)
    tree = [s for n in cm.radix._nodes() for s in n.value.tolist()]
    free = alloc._free.tolist() + [s for q in alloc._queued for s in q.tolist()]
    assert sorted(tree + free) == list(range(1, 65))
    assert len(tree) == 4 + 3 * 2  # the shared prefix once, each request's own two ids
    cm.check_idle()
