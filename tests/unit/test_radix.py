"""Specification of ``RadixCache`` (SGLang radix-cache contract, page size 1)."""

import random

import torch

from latentserve.kvcache.allocator import SlotAllocator
from latentserve.kvcache.radix import RadixCache


def make(num_slots=64, enabled=True):
    alloc = SlotAllocator(num_slots, "cpu")
    return alloc, RadixCache(alloc, enabled=enabled)


def put(alloc, cache, ids):
    """Allocate slots for ``ids`` and insert them; free the duplicates like the engine does."""
    slots = alloc.alloc(len(ids))
    prefix = cache.insert(ids, slots)
    alloc.free(slots[:prefix])
    return slots


def test_match_on_empty_tree_returns_empty_and_root():
    _, cache = make()
    slots, node = cache.match_prefix([1, 2, 3])
    assert slots.dtype == torch.int64 and slots.shape == (0,)
    assert node is cache.root


def test_full_match_returns_inserted_slots():
    alloc, cache = make()
    slots = put(alloc, cache, [1, 2, 3, 4])
    got, node = cache.match_prefix([1, 2, 3, 4, 5])
    assert torch.equal(got, slots)
    assert node.key == [1, 2, 3, 4]


def test_partial_match_splits_the_edge():
    alloc, cache = make()
    slots = put(alloc, cache, [1, 2, 3, 4])
    got, node = cache.match_prefix([1, 2, 9])
    assert torch.equal(got, slots[:2])
    assert node.key == [1, 2] and torch.equal(node.value, slots[:2])
    (child,) = node.children.values()
    assert child.key == [3, 4] and torch.equal(child.value, slots[2:])
    assert cache.total_size() == 4


def test_insert_returns_length_of_existing_prefix():
    alloc, cache = make()
    put(alloc, cache, [1, 2, 3, 4])
    assert cache.insert([1, 2, 7, 8], alloc.alloc(4)) == 2
    assert cache.insert([1, 2, 7, 8], alloc.alloc(4)) == 4
    assert cache.insert([5], alloc.alloc(1)) == 0


def test_insert_keeps_tree_slots_for_the_existing_prefix():
    alloc, cache = make()
    first = put(alloc, cache, [1, 2, 3])
    second = put(alloc, cache, [1, 2, 3, 4, 5])
    got, _ = cache.match_prefix([1, 2, 3, 4, 5])
    assert torch.equal(got, torch.cat([first, second[3:]]))


def test_lock_moves_slots_from_evictable_to_protected():
    alloc, cache = make()
    put(alloc, cache, [1, 2, 3, 4])
    _, node = cache.match_prefix([1, 2])
    cache.inc_lock(node)
    assert (cache.protected_size, cache.evictable_size) == (2, 2)
    cache.dec_lock(node)
    assert (cache.protected_size, cache.evictable_size) == (0, 4)


def test_locked_nodes_are_never_evicted():
    alloc, cache = make()
    put(alloc, cache, [1, 2, 3])
    put(alloc, cache, [7, 8])
    _, node = cache.match_prefix([1, 2, 3])
    cache.inc_lock(node)
    assert cache.evict(100) == 2
    got, _ = cache.match_prefix([1, 2, 3])
    assert got.numel() == 3
    assert cache.match_prefix([7, 8])[0].numel() == 0


def test_eviction_is_least_recently_used_first():
    alloc, cache = make()
    put(alloc, cache, [1, 1])
    put(alloc, cache, [2, 2])
    put(alloc, cache, [3, 3])
    cache.match_prefix([1, 1])  # [2, 2] is now the oldest
    assert cache.evict(1) == 2
    assert cache.match_prefix([2, 2])[0].numel() == 0
    assert cache.match_prefix([1, 1])[0].numel() == 2
    assert cache.match_prefix([3, 3])[0].numel() == 2


def test_parent_is_evicted_after_its_children():
    alloc, cache = make()
    put(alloc, cache, [1, 2, 3])
    put(alloc, cache, [1, 2, 4])  # tree: [1,2] -> {[3], [4]}
    put(alloc, cache, [9])
    cache.match_prefix([9])  # make [9] the most recent leaf
    assert cache.evict(4) == 4  # [3], [4], then their parent [1, 2]
    assert cache.match_prefix([1, 2])[0].numel() == 0
    assert cache.match_prefix([9])[0].numel() == 1


def test_evict_returns_fewer_when_not_enough_is_evictable():
    alloc, cache = make()
    put(alloc, cache, [1, 2])
    assert cache.evict(10) == 2
    assert cache.total_size() == 0 and alloc.num_free == alloc.num_total


def test_reset_gives_all_slots_back():
    alloc, cache = make()
    put(alloc, cache, [1, 2, 3])
    put(alloc, cache, [1, 5])
    cache.reset()
    assert cache.total_size() == 0 and alloc.num_free == alloc.num_total


def test_disabled_cache_matches_nothing_and_takes_no_slots():
    alloc, cache = make(enabled=False)
    slots = alloc.alloc(3)
    assert cache.insert([1, 2, 3], slots) == 3  # caller frees slots[:3], i.e. all of them
    alloc.free(slots)
    got, node = cache.match_prefix([1, 2, 3])
    assert got.numel() == 0 and node is cache.root
    cache.inc_lock(node)
    cache.dec_lock(node)
    assert cache.evict(3) == 0
    assert cache.total_size() == 0 and alloc.num_free == alloc.num_total


def test_random_ops_conserve_slots():
    """Every slot is free, in the tree, or owned by a live request; never two of these."""
    rng = random.Random(0)
    alloc, cache = make(num_slots=48)
    live = []  # (token ids, matched slots, locked node, slots the request allocated itself)

    def check():
        owned = sum(len(r[3]) for r in live)
        assert alloc.num_free + cache.total_size() + owned == alloc.num_total
        assert cache.evictable_size + cache.protected_size == cache.total_size()
        # white-box: the three sets are disjoint and cover 1..N exactly
        tree = [s for n in cache._nodes() for s in n.value.tolist()]
        free = alloc._free.tolist() + [s for q in alloc._queued for s in q.tolist()]
        every = free + tree + [s for r in live for s in r[3].tolist()]
        assert sorted(every) == list(range(1, alloc.num_total + 1))

    for _ in range(200):
        op = rng.random()
        if op < 0.45:  # a request arrives: match, lock, allocate the rest (evicting if needed)
            ids = [rng.randrange(4) for _ in range(rng.randint(1, 8))]
            matched, node = cache.match_prefix(ids)
            cache.inc_lock(node)
            need = len(ids) - len(matched)
            if alloc.num_free < need:
                cache.evict(need - alloc.num_free)
            own = alloc.alloc(need)
            if own is None:
                cache.dec_lock(node)
            else:
                live.append((ids, matched, node, own))
        elif op < 0.75 and live:  # a request finishes: insert, free its duplicates, unlock
            ids, matched, node, own = live.pop(rng.randrange(len(live)))
            slots = torch.cat([matched, own])
            prefix = cache.insert(ids, slots)
            assert prefix >= len(matched)
            alloc.free(slots[len(matched):prefix])
            cache.dec_lock(node)
        elif op < 0.85 and live:  # a request is aborted: give its own slots back
            _, _, node, own = live.pop(rng.randrange(len(live)))
            alloc.free(own)
            cache.dec_lock(node)
        else:
            cache.evict(rng.randint(1, 10))
        check()

    while live:
        _, _, node, own = live.pop()
        alloc.free(own)
        cache.dec_lock(node)
    check()
    assert cache.protected_size == 0
