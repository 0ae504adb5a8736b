"""Fused MoE LoRA as a Pallas TPU kernel (backend "pallas_tpu"; math in jax_lora.ops.fused_moe).

The block-sorted layout (vLLM's `moe_lora_align_block_size`) makes every block of `block_size`
rows one (slot, expert) group, so each grid step multiplies one tile of rows by one pair of
weights, the megablox pattern with the expert ids as the schedule:

  1. XLA gathers the rows of the layout, (L * EM, K): row j of slot l is x row sorted_ids[l, j]
     (zeros for the sentinel P and for padding), in the input dtype.
  2. One pallas_call per slice, grid (L * EM / block_size,): the block's expert and live flag
     (j < num_tokens_post_padded[l] and expert >= 0) and the slots' ranks are scalar-prefetched
     into SMEM; the index maps fetch A_s[l, e] (r, K) and B_s[l, e] (n_s, r) of the step's group
     (consecutive blocks of one group ask for the same weights, which the pipeline does not fetch
     again). The kernel computes (rows @ A.T) @ B.T in float32, rank columns >= lora_ranks[l]
     masked with `where`, and stores the (block_size, n_s) delta; with fp8 (e4m3) weights the
     group's channel scales (a_scale_s[l, e] (r,), b_scale_s[l, e] (n_s,)) are fetched the same
     way and multiply the rank columns and the delta's columns once, in float32; a dead step stores zeros and
     reads nothing it uses (its weight blocks are clamped to expert 0).
  3. XLA multiplies each row's delta by its pair's router weight (when given) and adds it into y
     at the pair (a scatter-add with the sentinel dropped; each pair occurs at most once), in
     float32 with one cast.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from ..moe_layout import pair_rows
from ..xla import set_columns
from .common import HIGHEST, _ranks_or_full, _two_jits, current_interpret

__all__ = ["fused_moe_lora"]


def _kernel(expert_ref, live_ref, ranks_ref, x_ref, a_ref, b_ref, *refs, blocks_per_slot: int, scaled_a: bool,
            scaled_b: bool):
    *scale_refs, o_ref = refs
    a_scale_ref = scale_refs.pop(0) if scaled_a else None
    b_scale_ref = scale_refs.pop(0) if scaled_b else None
    g = pl.program_id(0)

    @pl.when(live_ref[g] != 0)
    def _():
        slot = g // blocks_per_slot
        a = a_ref[...].astype(jnp.float32)                                      # (r, K)
        h = jax.lax.dot_general(x_ref[...].astype(jnp.float32), a, (((1,), (1,)), ((), ())),
                                precision=HIGHEST, preferred_element_type=jnp.float32)    # (bs, r)
        if a_scale_ref is not None:
            h = h * a_scale_ref[...][None, :]
        col = jax.lax.broadcasted_iota(jnp.int32, h.shape, 1)
        h = jnp.where(col < ranks_ref[slot], h, 0.0)
        b = b_ref[...].astype(jnp.float32)                                      # (n, r)
        col_b = jax.lax.broadcasted_iota(jnp.int32, b.shape, 1)
        b = jnp.where(col_b < ranks_ref[slot], b, 0.0)
        out = jax.lax.dot_general(h, b, (((1,), (1,)), ((), ())), precision=HIGHEST,
                                  preferred_element_type=jnp.float32)
        if b_scale_ref is not None:
            out = out * b_scale_ref[...][None, :]
        o_ref[...] = out

    @pl.when(live_ref[g] == 0)
    def _():
        o_ref[...] = jnp.zeros(o_ref.shape, o_ref.dtype)


def _slice_delta(rows_sorted, a, b, expert, live, ranks, a_scale=None, b_scale=None, *, block_size: int,
                 interpret):
    """(L * EM, n) float32 delta of one slice over the gathered rows (step 2); a_scale (L, E, r) /
    b_scale (L, E, n) float32 or None: fp8 channel scales."""
    num_slots, _, rank, hidden = a.shape
    width = b.shape[2]
    total = rows_sorted.shape[0]
    grid = total // block_size
    blocks_per_slot = grid // num_slots

    def w_map(g, expert_ref, live_ref, ranks_ref):
        return g // blocks_per_slot, jnp.maximum(expert_ref[g], 0), 0, 0

    def row_map(g, *_):
        return g, 0

    def scale_map(g, expert_ref, live_ref, ranks_ref):
        return g // blocks_per_slot, jnp.maximum(expert_ref[g], 0), 0

    scale_specs = ([pl.BlockSpec((None, None, rank), scale_map)] if a_scale is not None else []) + (
        [pl.BlockSpec((None, None, width), scale_map)] if b_scale is not None else [])
    scales = [sc for sc in (a_scale, b_scale) if sc is not None]
    return pl.pallas_call(
        functools.partial(_kernel, blocks_per_slot=blocks_per_slot, scaled_a=a_scale is not None,
                          scaled_b=b_scale is not None),
        out_shape=jax.ShapeDtypeStruct((total, width), jnp.float32),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=3,
            grid=(grid,),
            in_specs=[pl.BlockSpec((block_size, hidden), row_map),
                      pl.BlockSpec((None, None, rank, hidden), w_map),
                      pl.BlockSpec((None, None, width, rank), w_map)] + scale_specs,
            out_specs=pl.BlockSpec((block_size, width), row_map),
        ),
        interpret=interpret,
    )(expert, live, ranks, rows_sorted, a, b, *scales)


def fused_moe_lora(y3, x, lora_a, lora_b, pair_weight, layout, offsets, lora_ranks, *, lora_a_scale=None,
                   lora_b_scale=None):
    """y3 (M, k, N); x (M, K) one row per token or (P, K) one per pair; lora_a / lora_b: S arrays
    (L, E, r, K) / (L, E, n_s, r); pair_weight (P,) float32 or None; offsets: S static column
    offsets; lora_a_scale / lora_b_scale: None or S float32 arrays (L, E, r) / (L, E, n_s) of fp8
    weights -> the new y3."""
    ranks = _ranks_or_full(lora_ranks, layout.sorted_token_ids.shape[0], lora_a[0].shape[2])
    rows = pair_rows(x, y3.shape[0] * y3.shape[1])
    a_scales = (None,) * len(lora_a) if lora_a_scale is None else tuple(lora_a_scale)
    b_scales = (None,) * len(lora_b) if lora_b_scale is None else tuple(lora_b_scale)
    return _moe_call(y3, rows, tuple(lora_a), tuple(lora_b), pair_weight, tuple(layout), ranks, a_scales, b_scales,
                     offsets=tuple(offsets), interpret=current_interpret())


def _moe_call(y3, rows, lora_a, lora_b, pair_weight, layout, ranks, a_scales, b_scales, *, offsets, interpret):
    """Steps 1-3 of the module docstring in one program."""
    m, k, n_total = y3.shape
    p = m * k
    sorted_ids, expert_ids, ntp = layout
    num_slots, em = sorted_ids.shape
    nb = expert_ids.shape[1]
    bs = em // nb
    j = jnp.arange(em, dtype=jnp.int32)
    held = (sorted_ids < p) & (sorted_ids >= 0) & (j[None, :] < ntp[:, None])              # (L, EM)
    block_live = (expert_ids >= 0) & (jnp.arange(nb, dtype=jnp.int32)[None, :] * bs < ntp[:, None])
    held = held & jnp.repeat(block_live, bs, axis=1, total_repeat_length=em)
    target = jnp.where(held, sorted_ids, p).reshape(-1)                                     # (L * EM,)
    rows_sorted = jnp.where(held.reshape(-1, 1), rows[jnp.minimum(target, p - 1)], 0).astype(rows.dtype)  # 1
    weight = None if pair_weight is None else pair_weight[jnp.minimum(target, p - 1)]
    y = y3.reshape(p, n_total)
    for a, b, off, a_scale, b_scale in zip(lora_a, lora_b, offsets, a_scales, b_scales):
        delta = _slice_delta(rows_sorted, a, b, expert_ids.reshape(-1), block_live.reshape(-1).astype(jnp.int32),
                             ranks, a_scale, b_scale, block_size=bs, interpret=interpret)  # 2
        if weight is not None:
            delta = delta * weight[:, None]                                                  # 3
        width = b.shape[2]
        added = jnp.zeros((p, width), jnp.float32).at[target].add(delta, mode="drop")
        has = jnp.zeros((p,), bool).at[target].set(True, mode="drop")
        old = y[:, off:off + width]
        y = set_columns(y, jnp.where(has[:, None], (old.astype(jnp.float32) + added).astype(y.dtype), old), off)
    return y.reshape(y3.shape)


_moe_call = _two_jits(_moe_call, ("offsets", "interpret"))
