"""Several adapters per token on the Pallas TPU backend: the one-adapter kernels once per pair.

Math (contract section 10): y[t, slice s] += sum_j w[t, j] * scale * (x[t] @ A_s[slot_j].T) @ B_s[slot_j].T,
pair j of token t being slot pairs.slots[group[t], j] with weight pairs.weights[t, j]
(lora_core.adapter_pairs; the metadata's ids are group ids).

1. Pair j's slot per token, from the group ids and the pair tables (`xla.pair_columns`), and its
   own slot metadata (`jax_lora.meta.build_kernel_meta`, on the device, static shapes).
2. shrink: pair j's product with its weight, at the rank columns j*r .. (j+1)*r of the buffer.
3. expand: every pair added into one float32 copy of y, cast once; rows without any pair keep y.

k shrink and k expand launches (the Triton kernels do each in one launch); the pair count is a
static bucket, so a jitted step compiles once per bucket.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp

from ...meta import build_kernel_meta
from ..xla import pair_columns, set_columns
from .expand_op import expand as expand_one
from .shrink_op import shrink as shrink_one


def _pair_metas(meta, pairs, num_tokens: int, num_slots: int) -> list:
    """[(slot metadata, slot (T,), weight (T,) float32)] per pair."""
    out = []
    capacity = meta.token_lora_mapping.shape[0]
    for slot, weight in pair_columns(meta.token_lora_mapping[:num_tokens], pairs):
        padded = jnp.full((capacity,), -1, jnp.int32).at[:num_tokens].set(slot.astype(jnp.int32))
        out.append((build_kernel_meta(padded, jnp.int32(num_tokens), max_loras=num_slots), slot, weight))
    return out


def shrink_pairs(x: jax.Array, lora_a: Sequence[jax.Array], meta, scale: float, lora_ranks, pairs,
                 **options) -> jax.Array:
    """(S, T, k * r) float32: pair j's w[t, j] * scale * x[t] @ A_s[slot_j].T at columns j*r..(j+1)*r."""
    parts = []
    for meta_j, _, weight in _pair_metas(meta, pairs, x.shape[0], lora_a[0].shape[0]):
        parts.append(shrink_one(x, lora_a, meta_j, scale, lora_ranks, **options) * weight[None, :, None])
    return jnp.concatenate(parts, axis=2)


def expand_pairs(buf: jax.Array, lora_b: Sequence[jax.Array], y: jax.Array, meta, offsets: Sequence[int],
                 add_inputs: bool, lora_ranks, pairs, **options) -> jax.Array:
    """New y: y[t, slice s] = (y if add_inputs else 0) + sum_j buf[s, t, j*r:(j+1)*r] @ B_s[slot_j].T for
    tokens with at least one pair (one float32 sum, one cast); other rows unchanged."""
    rank = lora_b[0].shape[-1]
    metas = _pair_metas(meta, pairs, y.shape[0], lora_b[0].shape[0])
    any_pair = jnp.zeros(y.shape[0], bool)
    for _, slot, _ in metas:
        any_pair = any_pair | (slot >= 0)
    acc = y.astype(jnp.float32)
    if not add_inputs:
        for b, off in zip(lora_b, offsets):
            acc = set_columns(acc, jnp.where(any_pair[:, None], 0.0, acc[:, off:off + b.shape[1]]), off)
    for j, (meta_j, _, _) in enumerate(metas):
        acc = expand_one(buf[:, :, j * rank:(j + 1) * rank], lora_b, acc, meta_j, offsets, True, lora_ranks,
                         **options)
    return jnp.where(any_pair[:, None], acc.astype(y.dtype), y)
