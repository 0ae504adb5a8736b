"""Backend "pallas_tpu": grouped (SGMV-style) shrink and expand as Pallas TPU kernels.

Math (contract section 4), with idx[t] the slot of token t (-1 = no LoRA), every product in float32:

  shrink:  buf[s, t, :] = scale * x[t] @ A_s[idx[t]].T                 (0 where idx[t] = -1)
  expand:  y[t, off_s : off_s + n_s] = (y[t, ...] if add_inputs else 0)
                                        + buf[s, t] @ B_s[idx[t]].T + bias_s[idx[t]]
           (rows with idx[t] = -1 untouched), cast to y.dtype once. A slice with a DoRA column
           scale g_s (L, n_s) instead of a bias: y[t, slice] = g_s[idx[t]] * ((y[t, slice] if
           add_inputs else 0) + buf[s, t] @ B_s[idx[t]].T).
  ranks:   with lora_ranks, rank columns c >= lora_ranks[idx[t]] count as zero (in A and in B).

How (the megablox `gmm` pattern, applied to the LoRA metadata of contract section 3):

  1. Rows are processed in one of two orders:
     - sorted: the order of `meta.token_indices_sorted_by_lora_ids` (each adapter's tokens
       contiguous, ascending by slot, -1 first). `make_schedule` gives one grid step per (group,
       m-tile) the group touches: each adapter's weights are read once however its tokens are
       spread. The kernels move the rows themselves (`_shrink_gather_kernel`,
       `_expand_scatter_kernel`): on a tile's first step the rows of its tokens with a LoRA are
       DMA'd from their token positions (x; y pieces), on its last step y rows go back. Where that
       does not apply (H split in k tiles; slices off 128-column boundaries) XLA gathers x and the
       kernel writes a float32 delta that XLA scatters and adds.
     - token: the rows as they come; `make_token_schedule` gives one step per (m-tile, slot) pair
       that occurs. Whole tiles by BlockSpec, y updated in place by blocks when aligned; as few
       steps as sorted when each adapter's tokens are contiguous (prefill), many more when they
       are shuffled (decode).
     The launcher builds both schedules (cheap XLA) and `lax.cond` runs the one estimated cheaper
     (`choose_token_order`: weight blocks fetched + steps + activation bytes); `row_order=`
     forces one. A device-side decision: no host sync. `linear` runs shrink and expand under one
     decision, the packed rank rows staying in that order between them.
  2. A schedule is a static-length list of steps: step i works on m-tile `tile[i]` (tm rows) for
     slot `slot[i]`, ordered by tile, so an output tile is only revisited by consecutive steps.
     The -1 rows, empty groups and out-of-range ids get no steps. Capacity: `tiles_m + min(L, T)
     - 1` (sorted) or `min(T, tiles_m * min(L, tm))` (token), the most any mapping can need; the
     grid runs only the live steps (a traced grid bound, as megablox's num_active_tiles), and the
     unused tail repeats the last live step with live = 0 (so an index map reading it asks for
     blocks already resident). Shapes depend on (T, L, tiling) only: one compiled program for
     every mapping.
  3. The schedule is scalar-prefetched into SMEM and drives the BlockSpec index maps: the weight
     block of step i is slot[i]'s. Consecutive steps of one slot ask for the same weight block,
     which the Pallas pipeline does not fetch again, so each active adapter's weights move from
     HBM once per call in sorted order (per n-tile for expand), and inactive slots never.
  4. Each step stores only the rows of its group (a row mask: the `row_slot` block of the tile
     equals the step's slot); rows of no group (-1 tokens, padding) are never written and the
     epilogue selects around them, so uninitialised memory never reaches a result.
  5. y is updated as (y if add_inputs else 0) + delta + bias (DoRA: g * ((y if add_inputs else 0)
     + delta)) in float32 and cast once, in the kernel (in place) or in an XLA epilogue (delta
     path); shrink's epilogue puts rows back in token order (sorted order), applies `scale` and
     zeroes rows without a LoRA.

fp8 weights (e4m3, `a_scales` / `b_scales`): the weight blocks are fetched as stored, 1 byte per
weight, and upcast in the kernels (`common._dot`); the per-channel scales multiply the float32
products once, in the shrink's epilogue (with `scale`) and in the expand kernels ((1, tn) blocks of
the B scales, before the bias); an fp8 `linear` runs as a shrink then an expand.

Layouts, dense in the 128 lanes: the shrink output packs the S slices side by side in the lane
dim, (rows, P) with P = round_up(S * r, 128) (three rank-16 slices share one lane tile); the expand
kernel reads that packed buffer. A (L, r, H) is lane-dense as stored (H in lanes). vLLM's B layout
(L, n, r) puts the rank in lanes (r = 16 fills 1/8 of them); `expand` also accepts B stored
rank-major, (L, r, n), via `transpose_lora_b` once at load time (see docs/tpu.md for the cost).

Modules (the op modules are named *_op so that the package attributes `shrink`, `expand` and
`linear` are the backend's functions, not modules):
  common.py     interpret vs compiled (`current_interpret`, `interpret_mode`, `partitionable`: whether
                jax_lora.ops.partition can split the kernels now), small array helpers,
                helpers used inside kernels (row mask, lane placement, float32 dot, row DMAs)
  schedule.py   `Schedule`, `make_schedule`, `make_token_schedule`, the row orders of a call,
                `chunk_slots` (heterogeneous ranks), `choose_token_order`
  plans.py      `ShrinkPlan` / `ExpandPlan`, `plan_shrink` / `plan_expand` / `plan_inplace` under
                `VMEM_BUDGET`, the order costs of a plan
  shrink_op.py  the shrink kernels and `shrink`
  expand_op.py  the expand kernels and `expand`, `transpose_lora_b`
  linear_op.py  `linear`: shrink and expand in one program
  pairs_op.py   several adapters per token (`pairs=`): the one-adapter kernels once per pair
  moe_op.py     `fused_moe_lora`: LoRA on the routed (token, expert) pairs of a MoE layer
"""

from __future__ import annotations

from . import expand_op, linear_op, shrink_op
from .common import DEFAULT_INTERPRET, HIGHEST, current_interpret, interpret_mode, partitionable
from .expand_op import transpose_lora_b
from .moe_op import fused_moe_lora
from .pairs_op import expand_pairs, shrink_pairs
from .plans import (
    VMEM_BUDGET,
    ExpandPlan,
    ShrinkPlan,
    expand_order_cost,
    plan_expand,
    plan_inplace,
    plan_shrink,
    rank_chunk_for,
    shrink_order_cost,
)
from .schedule import (
    STEP_BYTES,
    OrderCost,
    Schedule,
    choose_token_order,
    chunk_slots,
    make_schedule,
    make_token_schedule,
    num_steps,
    num_token_steps,
    prefers_token_order,
    token_groups,
)

NAME = "pallas_tpu"
COLUMN_SCALE = True        # expand and linear take col_scale (DoRA)
WEIGHT_SCALES = True       # shrink / expand / linear take a_scales / b_scales (fp8 weights, e4m3)
CUSTOM_CALLS = True        # pallas_call: partitioned by jax_lora.ops.partition under GSPMD


def shrink(x, lora_a, meta, scale, lora_ranks=None, *, pairs=None, **options):
    """`shrink_op.shrink`; with adapter pairs (lora_core.adapter_pairs) `pairs_op.shrink_pairs`."""
    if pairs is not None:
        return shrink_pairs(x, lora_a, meta, scale, lora_ranks, pairs, **options)
    return shrink_op.shrink(x, lora_a, meta, scale, lora_ranks, **options)


def expand(buf, lora_b, y, meta, offsets, add_inputs, lora_ranks=None, bias=None, *, pairs=None, **options):
    """`expand_op.expand`; with adapter pairs `pairs_op.expand_pairs` (no bias or col_scale then)."""
    if pairs is not None:
        if bias is not None or options.get("col_scale") is not None:
            raise ValueError("several adapters per token take no LoRA bias or DoRA column scale (lora_bias_stacked "
                             "/ dora_scale_stacked must be None)")
        return expand_pairs(buf, lora_b, y, meta, offsets, add_inputs, lora_ranks, pairs,
                            **{k: v for k, v in options.items() if k != "col_scale"})
    return expand_op.expand(buf, lora_b, y, meta, offsets, add_inputs, lora_ranks, bias, **options)


def linear(y, x, lora_a, lora_b, meta, scale, offsets, lora_ranks=None, bias=None, *, pairs=None, **options):
    """`linear_op.linear`; with adapter pairs the pairs' shrink then their expand (`pairs_op`)."""
    if pairs is not None:
        buf = shrink(x, lora_a, meta, scale, lora_ranks, pairs=pairs, a_scales=options.get("a_scales"))
        return expand(buf, lora_b, y, meta, offsets, True, lora_ranks, bias, pairs=pairs,
                      col_scale=options.get("col_scale"), b_scales=options.get("b_scales"))
    return linear_op.linear(y, x, lora_a, lora_b, meta, scale, offsets, lora_ranks, bias, **options)

__all__ = [
    "NAME", "shrink", "expand", "linear", "transpose_lora_b", "fused_moe_lora",  # the backend
    "Schedule", "make_schedule", "make_token_schedule", "token_groups", "chunk_slots",  # schedules
    "num_steps", "num_token_steps",
    "OrderCost", "STEP_BYTES", "choose_token_order", "prefers_token_order", "shrink_order_cost",
    "expand_order_cost",
    "ShrinkPlan", "ExpandPlan", "plan_shrink", "plan_expand", "plan_inplace", "rank_chunk_for", "VMEM_BUDGET",
    "interpret_mode", "current_interpret", "partitionable", "DEFAULT_INTERPRET", "HIGHEST",
]
