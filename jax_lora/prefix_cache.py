"""The serving engine's base-model prefix cache: keys and values of prompt blocks the base computed.

For a decoder, the key and value of layer l at position t are a function of the tokens p[:t+1]
and of the layers' weights applied to them. A position computed with no adapter (LoRA id 0: a
base request, or an aLoRA request before its invocation) therefore holds the base model's K/V of
that prefix, the same for every request that starts with p[:t+1]. This cache keeps such K/V in a
device pool and copies them into a new request's KV row, so that its prefill computes only the
positions after them.

What is stored: whole blocks of `block_size` prompt tokens, each inside the prompt's base-computed
prefix (every token of a base request's prompt; an aLoRA request's tokens before its invocation;
nothing of a request whose first token has an adapter). Generated tokens are not stored. What is
reused: the longest chain of cached whole blocks a new prompt starts with, within its own
base-computed prefix, leaving at least its last prompt token to the prefill (the token whose logits
are sampled). A request whose prefix differs from a cached one at token t reuses the whole blocks
before t only. K/V computed with an adapter are never stored, so never reused.

Layout: per layer a key pool and a value pool, each (num_blocks, block_size, kv_heads, head_dim) in
the KV cache's dtype and sharding; the host index is lora_core.prefix_blocks (a token-block trie,
LRU over blocks). Two jitted copies move blocks between the pool and the KV cache rows, each over a
fixed number of blocks per call (`copy_blocks`, entries past the real ones are dropped), so they
are two programs whatever the prompt lengths; more blocks take several calls.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from lora_core.prefix_blocks import PrefixBlockIndex

from .models.llama import KVCache, init_cache

__all__ = ["PrefixCache"]

_LOG = logging.getLogger("jax_lora")


def _load(cache: KVCache, pool: KVCache, rows, starts, slots, sharding):
    """cache[l][rows[i], starts[i] + j] = pool[l][slots[i], j] for j < block_size, every layer.

    rows, starts, slots: (N,) int32; a row >= the cache's rows is padding (its write is dropped)."""
    bs = pool.k[0].shape[1]
    pos = starts[:, None] + jnp.arange(bs, dtype=jnp.int32)[None, :]                  # (N, bs)
    safe = jnp.minimum(slots, pool.k[0].shape[0] - 1)

    def put(dst, src):
        return dst.at[rows[:, None], pos].set(src[safe], mode="drop")
    out = KVCache(tuple(map(put, cache.k, pool.k)), tuple(map(put, cache.v, pool.v)))
    return out if sharding is None else jax.lax.with_sharding_constraint(out, sharding)


def _save(pool: KVCache, cache: KVCache, rows, starts, slots, sharding):
    """pool[l][slots[i], j] = cache[l][rows[i], starts[i] + j] for j < block_size, every layer.

    rows, starts, slots: (N,) int32; a slot >= num_blocks is padding (its write is dropped)."""
    bs = pool.k[0].shape[1]
    pos = starts[:, None] + jnp.arange(bs, dtype=jnp.int32)[None, :]                  # (N, bs)
    safe = jnp.minimum(rows, cache.k[0].shape[0] - 1)[:, None]

    def put(dst, src):
        return dst.at[slots].set(src[safe, pos], mode="drop")
    out = KVCache(tuple(map(put, pool.k, cache.k)), tuple(map(put, pool.v, cache.v)))
    return out if sharding is None else jax.lax.with_sharding_constraint(out, sharding)


class PrefixCache:
    """A pool of `capacity_tokens // block_size` blocks of base-model K/V with its LRU token-block index.

    Args:
      config: the model's config (layers, KV heads, head_dim).
      capacity_tokens: tokens the pool holds (rounded down to whole blocks; at least one block).
      block_size: tokens per block (the granularity of reuse).
      dtype, sharding: the KV cache's dtype and NamedSharding (None: one device).
      copy_blocks: blocks one copy call moves (the copies' fixed shape).

    Counters (cumulative, `stats()`): lookups, reused tokens, stored and evicted tokens.
    """

    def __init__(self, config, capacity_tokens: int, block_size: int, dtype, sharding, copy_blocks: int):
        num_blocks = capacity_tokens // block_size
        if num_blocks < 1:
            raise ValueError(f"prefix_cache_tokens={capacity_tokens} holds no whole block of "
                             f"prefix_block_size={block_size} tokens")
        self.block_size, self.copy_blocks = block_size, max(1, int(copy_blocks))
        self.index = PrefixBlockIndex(num_blocks, block_size)
        self.pool = init_cache(config, num_blocks, block_size, dtype, sharding=sharding)
        self._load = jax.jit(functools.partial(_load, sharding=sharding), donate_argnums=(0,))
        self._save = jax.jit(functools.partial(_save, sharding=sharding), donate_argnums=(0,))
        self._replicated = (None if sharding is None else
                            jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec()))
        self.lookups = self.reused_tokens = 0
        _LOG.info("ServingEngine: base-model prefix cache of %d blocks of %d tokens (%d tokens)", num_blocks,
                  block_size, num_blocks * block_size)

    @property
    def num_blocks(self) -> int:
        return self.index.num_blocks

    def stats(self) -> dict:
        bs = self.block_size
        return {"block_size": bs, "capacity_tokens": self.num_blocks * bs,
                "cached_tokens": self.index.cached_blocks * bs, "lookups": self.lookups,
                "reused_tokens": self.reused_tokens, "stored_tokens": self.index.stored_blocks * bs,
                "evicted_tokens": self.index.evicted_blocks * bs}

    def clear(self) -> None:
        """Forgets every cached block (the counters stay)."""
        self.index.clear()

    def lookup(self, prompt: Sequence[int], base_len: int) -> tuple:
        """(reused tokens, slots of the blocks to load) for a prompt whose first `base_len` tokens
        are computed with no adapter: the cached whole blocks it starts with inside that prefix,
        capped at len(prompt) - 1 reused tokens (the last prompt token is always prefilled)."""
        self.lookups += 1
        slots = self.index.match(prompt, base_len)
        reused = min(len(slots) * self.block_size, len(prompt) - 1)
        return reused, slots[:-(-reused // self.block_size)]

    def _copy(self, fn, dst, other, entries: list, pad_row: int, pad_slot: int):
        """Runs `fn` over (row, start, slot) entries in calls of copy_blocks (padded entries dropped)."""
        n = self.copy_blocks
        for i in range(0, len(entries), n):
            chunk = entries[i:i + n]
            rows = np.full(n, pad_row, np.int32)
            starts = np.zeros(n, np.int32)
            slots = np.full(n, pad_slot, np.int32)
            rows[:len(chunk)], starts[:len(chunk)], slots[:len(chunk)] = zip(*chunk)
            args = jax.device_put((rows, starts, slots), self._replicated)
            dst = fn(dst, other, *args)
        return dst

    def load(self, cache: KVCache, loads: list) -> KVCache:
        """Copies pool blocks into cache rows: loads = [(row, reused tokens, slots in block order)] from
        `lookup`; counts the reused tokens; returns the cache."""
        self.reused_tokens += sum(reused for _, reused, _ in loads)
        entries = [(row, b * self.block_size, slot) for row, _, slots in loads for b, slot in enumerate(slots)]
        if not entries:
            return cache
        return self._copy(self._load, cache, self.pool, entries, cache.k[0].shape[0], 0)

    def store(self, cache: KVCache, rows: list) -> None:
        """Caches the base-computed whole blocks of rows = [(row, prompt, base_len)] from the KV cache
        (after their prefill); blocks already cached are only touched."""
        entries, held = [], set()          # one write batch: no slot given out twice in it
        for row, prompt, base_len in rows:
            entries += [(row, b * self.block_size, slot) for b, slot in self.index.insert(prompt, base_len, held)]
        if entries:
            self.pool = self._copy(self._save, self.pool, cache, entries, 0, self.num_blocks)
