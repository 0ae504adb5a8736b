"""The block-sorted layout of a MoE layer's routed pairs (vLLM 0.33's `moe_lora_align_block_size`)
and its inverse, per pair (slot, expert): what jax_lora.ops.fused_moe and its backends share.

Per slot l, the pairs of slot l's tokens grouped by expert (ascending expert, pairs ascending inside
a group), each group padded to a multiple of block_size with the sentinel P = num_tokens * top_k;
expert_ids holds each block's expert (-1 past the slot's last block). Every shape depends on
(P, E, L, block_size) only.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

__all__ = ["MoELayout", "NaiveOrder", "align_layout", "max_num_tokens_padded", "pair_rows", "pairs_of_layout"]


def max_num_tokens_padded(num_pairs: int, num_experts: int, block_size: int) -> int:
    """EM, the row length per slot: every pair plus block_size - 1 padding per expert, rounded up
    to a multiple of block_size."""
    return _round_up(num_pairs + num_experts * (block_size - 1), block_size)


class MoELayout(NamedTuple):
    """The block-sorted pairs of one MoE call (module docstring)."""

    sorted_token_ids: jax.Array      # (L, EM) int32
    expert_ids: jax.Array            # (L, EM // block_size) int32
    num_tokens_post_padded: jax.Array  # (L,) int32

    @property
    def block_size(self) -> int:
        return self.sorted_token_ids.shape[1] // self.expert_ids.shape[1]


class NaiveOrder(NamedTuple):
    """The pairs unsorted (vLLM's naive block assignment, one pair per kernel program): what a
    backend with NAIVE_ORDER receives instead of a layout when the caller gives no sorted ids."""

    experts: jax.Array         # (P,) int32: pair p's expert, -1 when it has none here
    token_slots: jax.Array     # (M,) int32: token t's slot, -1 for none (or a disabled slot)


def naive_order(topk_ids, token_lora_mapping, num_experts: int, max_loras: int, adapter_enabled=None) -> NaiveOrder:
    """The NaiveOrder of routed experts topk_ids (M, k) (out-of-range experts: none) and slots
    token_lora_mapping (>= M,) (out-of-range or disabled slots: none)."""
    ids = jnp.asarray(topk_ids).astype(jnp.int32)
    m = ids.shape[0]
    experts = jnp.where((ids >= 0) & (ids < num_experts), ids, -1).reshape(-1)
    slot = jnp.asarray(token_lora_mapping).astype(jnp.int32)[:m]
    ok = (slot >= 0) & (slot < max_loras)
    if adapter_enabled is not None:
        enabled = jnp.asarray(adapter_enabled).astype(jnp.int32)[:max_loras]
        ok = ok & (enabled[jnp.clip(slot, 0, max_loras - 1)] != 0)
    return NaiveOrder(experts, jnp.where(ok, slot, -1))


def _round_up(v: int, m: int) -> int:
    return -(-v // m) * m


def align_layout(topk_ids, token_lora_mapping, num_experts: int, block_size: int, max_loras: int,
                 adapter_enabled=None, expert_map=None) -> MoELayout:
    """The layout as a MoELayout (one row per slot); jax_lora.ops.fused_moe.moe_lora_align_block_size
    has its arguments and steps."""
    block_size = int(block_size)
    if block_size < 1:
        raise ValueError(f"block_size must be an int >= 1, got {block_size!r}")
    ids = jnp.asarray(topk_ids).astype(jnp.int32)
    if ids.ndim != 2:
        raise ValueError(f"topk_ids must be (num_tokens, top_k), got shape {ids.shape}")
    m, k = ids.shape
    e, num_slots = int(num_experts), int(max_loras)
    p = m * k
    em = max_num_tokens_padded(p, e, block_size)
    nb = em // block_size
    if expert_map is not None:
        emap = jnp.asarray(expert_map).astype(jnp.int32)
        ids = jnp.where((ids >= 0) & (ids < emap.shape[0]), emap[jnp.clip(ids, 0, emap.shape[0] - 1)], -1)
    slot = jnp.asarray(token_lora_mapping).astype(jnp.int32)[:m]
    enabled = (jnp.ones((num_slots,), jnp.int32) if adapter_enabled is None
               else jnp.asarray(adapter_enabled).astype(jnp.int32)[:num_slots])
    slot_ok = (slot >= 0) & (slot < num_slots)
    slot_ok = slot_ok & (enabled[jnp.clip(slot, 0, num_slots - 1)] != 0)
    pair_slot = jnp.repeat(jnp.where(slot_ok, slot, -1), k)                     # (P,)
    pair_expert = ids.reshape(-1)
    valid = (pair_slot >= 0) & (pair_expert >= 0) & (pair_expert < e)
    groups = num_slots * e
    key = jnp.where(valid, pair_slot * e + pair_expert, groups)                 # step 1
    counts = jnp.zeros((groups + 1,), jnp.int32).at[key].add(1)[:groups].reshape(num_slots, e)
    padded = _round_up_arr(counts, block_size)                                  # step 2
    ends = jnp.cumsum(padded, axis=1)                                           # (L, E)
    starts = ends - padded
    order = jnp.argsort(key, stable=True)                                       # step 3
    first_of_key = jnp.searchsorted(key[order], key[order], side="left")
    rank = jnp.zeros((p,), jnp.int32).at[order].set(jnp.arange(p, dtype=jnp.int32) - first_of_key)
    safe_slot, safe_expert = jnp.maximum(pair_slot, 0), jnp.clip(pair_expert, 0, e - 1)
    pos = starts[safe_slot, safe_expert] + rank
    row = jnp.where(valid, safe_slot, num_slots)                                # invalid: dropped
    sorted_ids = jnp.full((num_slots, em), p, jnp.int32).at[row, pos].set(
        jnp.arange(p, dtype=jnp.int32), mode="drop")                            # step 4
    block_start = jnp.arange(nb, dtype=jnp.int32) * block_size
    total = ends[:, -1]
    block_expert = jax.vmap(lambda end: jnp.searchsorted(end, block_start, side="right"))(ends)
    expert_ids = jnp.where(block_start[None, :] < total[:, None], block_expert, -1).astype(jnp.int32)
    return MoELayout(sorted_ids, expert_ids, total.astype(jnp.int32))


def _round_up_arr(v: jax.Array, m: int) -> jax.Array:
    return (v + m - 1) // m * m


def pairs_of_layout(layout: MoELayout, num_pairs: int) -> tuple[jax.Array, jax.Array]:
    """(pair_slot (P,), pair_expert (P,)) int32 of a layout, -1 for pairs it does not hold: entry j
    of row l holds pair sorted_token_ids[l, j] (when < P and j < num_tokens_post_padded[l]) for
    slot l and expert expert_ids[l, j // block_size] (when >= 0)."""
    sorted_ids, expert_ids, ntp = layout
    num_slots, em = sorted_ids.shape
    j = jnp.arange(em, dtype=jnp.int32)
    block_expert = jnp.repeat(expert_ids, layout.block_size, axis=1, total_repeat_length=em)
    held = (sorted_ids >= 0) & (sorted_ids < num_pairs) & (j[None, :] < ntp[:, None]) & (block_expert >= 0)
    target = jnp.where(held, sorted_ids, num_pairs)
    slots = jnp.broadcast_to(jnp.arange(num_slots, dtype=jnp.int32)[:, None], sorted_ids.shape)
    pair_slot = jnp.full((num_pairs,), -1, jnp.int32).at[target.reshape(-1)].set(slots.reshape(-1), mode="drop")
    pair_expert = jnp.full((num_pairs,), -1, jnp.int32).at[target.reshape(-1)].set(
        block_expert.reshape(-1), mode="drop")
    return pair_slot, pair_expert


def pair_rows(x: jax.Array, num_pairs: int) -> jax.Array:
    """(P, K): the input row of every pair. x holds one row per pair (P, K) (the down projection)
    or one per token (M, K), each repeated for the token's P / M pairs (gate_up)."""
    if x.shape[0] == num_pairs:
        return x
    return jnp.repeat(x, num_pairs // x.shape[0], axis=0)
