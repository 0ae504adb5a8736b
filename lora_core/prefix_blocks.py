"""The host index of a base-model prefix cache: a trie of token blocks with an LRU over its blocks.

A prompt p = (p_0, ..., p_{n-1}) is cut into blocks of B tokens, block b = p[bB:(b+1)B]. The
keys and values of block b depend on p[:(b+1)B] only (causal attention), so a cached block is
named by its whole chain: block b's key is (the id of the node of block b-1, the B token ids of
block b), a trie whose root is the empty prefix. Keys are the token ids themselves, not hashes of
them: two different prefixes never share a node.

Each node holds one slot of a device pool of `num_blocks` blocks (the framework's side stores the
keys and values; this index only says which slot holds which block). When the pool is full the
least recently used block is evicted. Every use of a chain touches it from its deepest node up to
the root's child, so a node is always more recent than its children: the least recently used node
is a leaf, and evicting it never orphans a cached block.

  1. `match(tokens, limit)`: the slots of the longest cached chain of whole blocks inside
     tokens[:limit] (touched: most recent);
  2. `insert(tokens, limit, held)`: the whole blocks of tokens[:limit] not cached yet get slots
     (evicting the LRU leaves outside this chain and outside `held`, the chains of the same write
     batch, when the pool is full; when none is left, the rest is not stored); returns (block
     index, slot) of the blocks to write.

The index is not thread-safe on its own: its owner (the serving engine) calls it under its lock.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Sequence

__all__ = ["PrefixBlockIndex"]


@dataclasses.dataclass(eq=False)
class _Node:
    key: tuple            # (parent node id, the block's B token ids)
    id: int
    slot: int
    parent: _Node | None
    children: int = 0


class PrefixBlockIndex:
    """Token-block trie over `num_blocks` pool slots of `block_size` tokens each, LRU eviction.

    Counters (cumulative): `stored_blocks`, `evicted_blocks`; `cached_blocks` is the current count.
    """

    def __init__(self, num_blocks: int, block_size: int):
        for name, value in (("num_blocks", num_blocks), ("block_size", block_size)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        self.num_blocks, self.block_size = num_blocks, block_size
        self.stored_blocks = self.evicted_blocks = 0
        self.clear()

    def clear(self) -> None:
        """Forgets every block (the slots become free; their contents are never read again)."""
        self._nodes: collections.OrderedDict = collections.OrderedDict()     # key -> node, oldest first
        self._free = list(range(self.num_blocks - 1, -1, -1))
        self._next_id = 1                                                     # 0: the root (empty prefix)

    @property
    def cached_blocks(self) -> int:
        return len(self._nodes)

    def _block(self, tokens: Sequence[int], b: int) -> tuple:
        return tuple(int(t) for t in tokens[b * self.block_size:(b + 1) * self.block_size])

    def _walk(self, tokens: Sequence[int], limit: int) -> list:
        """The cached nodes of tokens[:limit]'s whole blocks, from block 0 until the first miss."""
        path, parent = [], 0
        for b in range(max(0, min(limit, len(tokens))) // self.block_size):
            node = self._nodes.get((parent, self._block(tokens, b)))
            if node is None:
                break
            path.append(node)
            parent = node.id
        return path

    def _touch(self, path: list) -> None:
        """Makes the chain the most recent, deepest node first: each parent ends newer than its children."""
        for node in reversed(path):
            self._nodes.move_to_end(node.key)

    def match(self, tokens: Sequence[int], limit: int) -> list:
        """Slots of the longest cached chain of whole blocks within tokens[:limit], block 0 first."""
        path = self._walk(tokens, limit)
        self._touch(path)
        return [node.slot for node in path]

    def _take_slot(self, protected: set) -> int | None:
        if self._free:
            return self._free.pop()
        if not self._nodes:
            return None
        oldest = next(iter(self._nodes.values()))
        if oldest in protected:           # only protected chains are left: none is evicted for another
            return None
        if oldest.children:
            raise AssertionError("prefix index: the least recently used block has children")
        del self._nodes[oldest.key]
        if oldest.parent is not None:
            oldest.parent.children -= 1
        self.evicted_blocks += 1
        return oldest.slot

    def insert(self, tokens: Sequence[int], limit: int, held: set | None = None) -> list:
        """Caches the whole blocks of tokens[:limit] that are not cached yet; returns the
        (block index, slot) pairs whose keys and values the caller writes into the pool.

        held: a set shared by the inserts of one write batch: each insert adds its chain to it and
        evicts none of it, so no slot is handed out twice before the batch is written."""
        path = self._walk(tokens, limit)
        protected = held if held is not None else set()
        protected.update(path)
        new = []
        for b in range(len(path), max(0, min(limit, len(tokens))) // self.block_size):
            slot = self._take_slot(protected)
            if slot is None:
                break
            parent = path[-1] if path else None
            node = _Node((parent.id if parent else 0, self._block(tokens, b)), self._next_id, slot, parent)
            self._next_id += 1
            if parent is not None:
                parent.children += 1
            self._nodes[node.key] = node
            path.append(node)
            protected.add(node)
            new.append((b, slot))
            self.stored_blocks += 1
        self._touch(path)
        return new
