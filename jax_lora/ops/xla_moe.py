"""Reference fused MoE LoRA (backend "xla"): per routed pair, a gather of its own (slot, expert)
weights, in plain jnp (the oracle's twin; math in jax_lora.ops.fused_moe).

Steps: 1. each pair's (slot, expert) from the block-sorted layout (`pairs_of_layout`), -1 where the
layout holds no pair; 2. per slice s, A_s[slot, expert] (P, r, K) and B_s[slot, expert] (P, n_s, r)
gathered and contracted with the pair's row in float32 (`products`: an einsum here, the
batch-invariant elementwise sums in jax_lora.ops.invariant), rank padding masked with `where`; fp8
(e4m3) weights: the rank columns times the pair's a_scale_s[slot, expert], the slice's columns
times its b_scale_s[slot, expert] (float32, once per product); 3. times the router weight when
given; 4. y's slice updated with `where` on the pairs with an adapter (0 * NaN = NaN: weights of
a slot or expert no pair uses are never multiplied by anything).
Memory: P * r * (K + n_s) gathered weights per slice, so this is the fallback, not the fast path.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from .moe_layout import pair_rows, pairs_of_layout

HIGHEST = jax.lax.Precision.HIGHEST


def pair_products(rows: jax.Array, weights: jax.Array) -> jax.Array:
    """(P, n) float32: rows[p] (P, m) float32 against the pair's own weights (P, n, m), an einsum."""
    return jnp.einsum("pm,pnm->pn", rows, weights.astype(jnp.float32), precision=HIGHEST)


def fused_moe_lora(y3, x, lora_a, lora_b, pair_weight, layout, offsets, lora_ranks, *, products=pair_products,
                   lora_a_scale=None, lora_b_scale=None):
    """y3 (M, k, N); x (M, K) one row per token or (P, K) one per pair; lora_a / lora_b: S arrays
    (L, E, r, K) / (L, E, n_s, r); pair_weight (P,) float32 or None; offsets: S static column
    offsets; products(rows (P, m) float32, weights (P, n, m)) -> (P, n) float32; lora_a_scale /
    lora_b_scale: None or S float32 arrays (L, E, r) / (L, E, n_s), the fp8 channel scales ->
    the new y3."""
    m, k, n_total = y3.shape
    p = m * k
    rows = pair_rows(x, p)
    pair_slot, pair_expert = pairs_of_layout(layout, p)                              # step 1
    has = (pair_slot >= 0) & (pair_expert >= 0)
    slot, expert = jnp.maximum(pair_slot, 0), jnp.maximum(pair_expert, 0)
    xf = rows.astype(jnp.float32)
    y = y3.reshape(p, n_total)
    a_scales = lora_a_scale if lora_a_scale is not None else (None,) * len(lora_a)
    b_scales = lora_b_scale if lora_b_scale is not None else (None,) * len(lora_b)
    for a, b, off, a_scale, b_scale in zip(lora_a, lora_b, offsets, a_scales, b_scales):
        rank, width = a.shape[2], b.shape[2]
        keep = has[:, None]
        if lora_ranks is not None:
            keep = keep & (jnp.arange(rank)[None, :] < lora_ranks[slot][:, None])
        h = products(xf, a[slot, expert])                                            # step 2: (P, r)
        if a_scale is not None:
            h = h * a_scale[slot, expert]
        h = jnp.where(keep, h, 0.0)
        b_p = b[slot, expert]                                                        # (P, n, r)
        if lora_ranks is not None:
            b_p = jnp.where(keep[:, None, :], b_p, jnp.zeros((), b_p.dtype))
        delta = products(h, b_p)
        if b_scale is not None:
            delta = delta * b_scale[slot, expert]
        if pair_weight is not None:                                                  # step 3
            delta = delta * pair_weight[:, None]
        old = y[:, off:off + width]
        new = (old.astype(jnp.float32) + delta).astype(y.dtype)
        # step 4, an update slice (no index array: the rule of xla.set_columns, which imports this module)
        y = jax.lax.dynamic_update_slice_in_dim(y, jnp.where(has[:, None], new, old), off, axis=1)
    return y.reshape(y3.shape)
