"""Specification of ``SlotAllocator``: slot ids 1..N, slot 0 reserved, all-or-nothing alloc."""

import torch

from latentserve.kvcache.allocator import SlotAllocator


def test_fresh_allocator_has_all_slots_free():
    a = SlotAllocator(8, "cpu")
    assert a.num_free == 8
    assert a.num_total == 8


def test_alloc_returns_int64_ids_in_1_to_n_and_never_slot_0():
    a = SlotAllocator(8, "cpu")
    slots = a.alloc(8)
    assert slots.dtype == torch.int64 and slots.shape == (8,)
    assert sorted(slots.tolist()) == list(range(1, 9))
    assert a.num_free == 0


def test_alloc_more_than_free_returns_none_and_takes_nothing():
    a = SlotAllocator(4, "cpu")
    a.alloc(3)
    assert a.alloc(2) is None
    assert a.num_free == 1


def test_alloc_zero_returns_empty_tensor():
    a = SlotAllocator(4, "cpu")
    assert a.alloc(0).shape == (0,)
    assert a.num_free == 4


def test_free_returns_slots_for_reuse():
    a = SlotAllocator(4, "cpu")
    first = a.alloc(4)
    a.free(first[:2])
    assert a.num_free == 2
    assert sorted(a.alloc(2).tolist()) == sorted(first[:2].tolist())


def test_free_of_empty_tensor_is_a_no_op():
    a = SlotAllocator(4, "cpu")
    a.free(torch.empty(0, dtype=torch.int64))
    assert a.num_free == 4


def test_allocated_slots_are_distinct_across_calls():
    a = SlotAllocator(16, "cpu")
    got = torch.cat([a.alloc(5), a.alloc(5), a.alloc(6)])
    assert len(set(got.tolist())) == 16


def test_reset_frees_everything():
    a = SlotAllocator(4, "cpu")
    a.alloc(3)
    a.reset()
    assert a.num_free == 4


def test_freed_slots_join_the_free_list_in_order_when_needed():
    """Freed slots queue behind the free list (no copy of it per free) and come back in the
    order they were freed, once the slots before them are taken."""
    a = SlotAllocator(6, "cpu")
    first = a.alloc(4)  # 1..4 taken, 5 and 6 free
    a.free_many([first[2:], first[:1]])  # 3, 4, then 1
    assert a.num_free == 5
    assert a.alloc(5).tolist() == [5, 6, 3, 4, 1]
    assert a.alloc(1) is None and a.num_free == 0


def test_free_copies_but_free_many_keeps_the_tensors():
    a = SlotAllocator(4, "cpu")
    got = a.alloc(4)
    mine = got[:2].clone()
    a.free(mine)
    mine.fill_(0)  # free() copied: the caller may reuse its tensor
    assert sorted(a.alloc(2).tolist()) == sorted(got[:2].tolist())


def test_many_queued_frees_are_joined():
    a = SlotAllocator(3000, "cpu")
    got = a.alloc(3000)
    a.free_many(list(got.split(1)))  # 3000 one-slot tensors: joined past MAX_QUEUED
    assert len(a._queued) <= SlotAllocator.MAX_QUEUED and a.num_free == 3000
    assert sorted(a.alloc(3000).tolist()) == list(range(1, 3001))
