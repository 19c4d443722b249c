"""Radix-tree prefix cache over token ids (page size 1), with the contract of SGLang's
``RadixCache`` (``python/sglang/srt/mem_cache/radix_cache.py``)."""

from __future__ import annotations

import heapq
import itertools

import torch

from latentserve.kvcache.allocator import SlotAllocator


class Node:
    """One edge of the radix tree and the node it leads to: ``key`` token ids, ``value`` their
    slots (``[len(key)] int64``), ``children`` by first token, ``lock_ref`` users,
    ``last_access`` a logical LRU clock."""

    __slots__ = ("key", "value", "parent", "children", "lock_ref", "last_access")

    def __init__(self, key: list[int], value: torch.Tensor, parent: Node | None) -> None:
        self.key = key
        self.value = value
        self.parent = parent
        self.children: dict[int, Node] = {}
        self.lock_ref = 0
        self.last_access = 0.0

    def __lt__(self, other: Node) -> bool:  # heap order: least recently used first
        return self.last_access < other.last_access


def _common_len(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


class RadixCache:
    """Prefix cache mapping token-id prefixes to the KV slots that hold them.
    * ``match_prefix(ids)``: the longest cached prefix's slots (tree-owned) and its deepest
      node; ``inc_lock(node)`` before relying on them, ``dec_lock`` after.
    * ``insert(ids, slots)`` with ``slots[:m]`` from ``match_prefix`` returns ``p >= m``
      already cached: the caller frees ``slots[m:p]``, the tree owns ``slots[p:]``.
    * ``evict(n)`` frees unlocked leaves in LRU order.
    ``enabled=False``: always empty; ``insert`` returns ``len(token_ids)`` (caller frees all)."""

    root: Node
    evictable_size: int
    protected_size: int

    def __init__(self, allocator: SlotAllocator, enabled: bool = True) -> None:
        self.allocator = allocator
        self.disabled = not enabled
        self._clock = itertools.count(1)
        self.reset()

    def reset(self) -> None:
        """Drop the whole tree, slots back to the allocator. RuntimeError if a node is locked."""
        root = getattr(self, "root", None)
        if root is not None:
            if self.protected_size:
                raise RuntimeError(f"reset with {self.protected_size} locked slots")
            values = [n.value for n in self._nodes() if n is not root]
            if values:
                self.allocator.free(torch.cat(values))
        self.root = Node([], self._empty(), None)
        self.root.lock_ref = 1  # the root is never evicted
        self.evictable_size = 0  # slots in nodes with lock_ref == 0
        self.protected_size = 0  # slots in nodes with lock_ref > 0

    def total_size(self) -> int:
        """Number of slots held by the tree (walks it; ``evictable + protected`` is O(1))."""
        return sum(len(n.value) for n in self._nodes())

    def _nodes(self):
        stack = [self.root]
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def _empty(self) -> torch.Tensor:
        return torch.empty(0, dtype=torch.int64, device=self.allocator.device)

    def _split(self, child: Node, n: int) -> Node:
        """Split ``child``'s edge after ``n`` tokens; return the new upper node."""
        mid = Node(child.key[:n], child.value[:n], child.parent)
        mid.lock_ref, mid.last_access = child.lock_ref, child.last_access
        mid.children[child.key[n]] = child
        assert child.parent is not None  # never the root
        child.parent.children[child.key[0]] = mid
        child.key, child.value, child.parent = child.key[n:], child.value[n:], mid
        return mid

    def match_prefix(self, token_ids: list[int]) -> tuple[torch.Tensor, Node]:
        """``(slots [m] int64, node ending at m)`` of the longest cached prefix (an edge may
        be split); refreshes access times."""
        if self.disabled:
            return self._empty(), self.root
        now = float(next(self._clock))
        node, i, values = self.root, 0, []
        while i < len(token_ids):
            child = node.children.get(token_ids[i])
            if child is None:
                break
            n = _common_len(child.key, token_ids[i:])
            partial = n < len(child.key)
            if partial:
                child = self._split(child, n)
            child.last_access = now
            values.append(child.value)
            node, i = child, i + n
            if partial:
                break
        return (torch.cat(values) if values else self._empty()), node

    def insert(self, token_ids: list[int], slots: torch.Tensor, copy: bool = True) -> int:
        """Insert ``token_ids`` with their ``slots`` (``[len] int64``; ``copy=False`` keeps a
        view). Returns the length ``p`` already cached (see the class docstring)."""
        if len(slots) != len(token_ids):
            raise ValueError(f"{len(token_ids)} token ids but {len(slots)} slots")
        if self.disabled:
            return len(token_ids)
        now = float(next(self._clock))
        node, i = self.root, 0
        while i < len(token_ids):
            child = node.children.get(token_ids[i])
            if child is None:
                value = slots[i:].to(torch.int64, copy=True) if copy else slots[i:]
                new = Node(list(token_ids[i:]), value, node)
                new.last_access = now
                node.children[token_ids[i]] = new
                self.evictable_size += len(new.key)
                return i
            n = _common_len(child.key, token_ids[i:])
            if n < len(child.key):
                child = self._split(child, n)
            child.last_access = now
            node, i = child, i + n
        return i

    def inc_lock(self, node: Node) -> None:
        """Pin ``node`` and its ancestors (root excluded) so they are never evicted."""
        while node is not self.root:
            if node.lock_ref == 0:
                self.evictable_size -= len(node.key)
                self.protected_size += len(node.key)
            node.lock_ref += 1
            node = node.parent  # type: ignore[assignment]  # every node but the root has one

    def dec_lock(self, node: Node) -> None:
        """Undo one ``inc_lock(node)``."""
        while node is not self.root:
            if node.lock_ref <= 0:
                raise RuntimeError("dec_lock on an unlocked node")
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self.protected_size -= len(node.key)
                self.evictable_size += len(node.key)
            node = node.parent  # type: ignore[assignment]  # every node but the root has one

    def evict(self, num_slots: int) -> int:
        """Free at least ``num_slots`` slots from unlocked leaves, LRU first (emptied parents
        become candidates); returns the count freed (more: whole nodes; fewer: none left)."""
        if self.disabled or num_slots <= 0:
            return 0
        heap = [n for n in self._nodes() if not n.children and n.lock_ref == 0]
        heapq.heapify(heap)
        freed, values = 0, []
        while freed < num_slots and heap:
            node = heapq.heappop(heap)
            parent = node.parent
            del parent.children[node.key[0]]
            values.append(node.value)
            freed += len(node.key)
            if not parent.children and parent.lock_ref == 0:
                heapq.heappush(heap, parent)
        if values:
            self.allocator.free(torch.cat(values))
        self.evictable_size -= freed
        return freed
