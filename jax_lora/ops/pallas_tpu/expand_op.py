"""Expand: y[t, off_s : off_s + n_s] = (y[t, ...] if add_inputs else 0) + buf[s, t] @ B_s[idx[t]].T
+ bias_s[idx[t]] for all S slices in one pallas_call, grid (J, steps), J the column tiles of all
slices end to end. The rank rows arrive packed in the lanes, (rows, P) float32, as shrink writes
them.

Kernels:
  - `_expand_kernel`: a float32 delta per slice, which an XLA epilogue adds to y (any slice layout);
  - `_expand_inplace_kernel`: token order, y aliased in and out and updated by (tm, tn) blocks;
  - `_expand_scatter_kernel`: sorted order, y rows DMA'd in from their token positions and back.
The two in-place kernels need one 128-multiple column tile that divides every slice offset and
width (`plan_inplace`). B comes in vLLM's layout (L, n, r) or rank-major (L, r, n)
(`transpose_lora_b`).

fp8 weights: an e4m3 B block is loaded as stored and upcast in the kernel (`_dot`), the product
accumulates in float32 over the rank chunks, and the slot's output-row scales (a (1, tn) block of
b_scale_s (L, n_s), fetched like the bias) multiply it once, before the bias (`_slice_delta`), in
every kernel.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from lora_core.dora import epilogue_vectors

from ... import tpu_rules
from ...meta import LoRAKernelMeta
from .common import (
    _below,
    _dot,
    _pad_rows,
    _placement,
    _ranks_or_full,
    _round_up,
    _row_mask,
    _rows_dma,
    _two_jits,
    _window,
    current_interpret,
    scales_by_slice,
)
from .plans import ExpandPlan, _compiler_params, expand_order_cost, plan_expand, plan_inplace
from .schedule import (
    Schedule,
    _check_row_order,
    _live_steps,
    _pick_order,
    _Rows,
    _rows,
    _sorted_slots,
    choose_token_order,
    chunk_slots,
)

# -------------------------------------------------------------------------------------- kernels

def _slice_refs(plan: ExpandPlan, refs) -> tuple:
    """(per slice (B chunk refs, epilogue vector ref or None, fp8 B scale ref or None), the index of
    the first ref after them): the kernels' weight operands, in `_weight_specs` order."""
    ins, k = [], 0
    for s in range(len(plan.widths)):
        vec = refs[k + plan.chunks] if plan.has_bias[s] else None
        k_scale = k + plan.chunks + plan.has_bias[s]
        ins.append((refs[k:k + plan.chunks], vec, refs[k_scale] if plan.has_w_scale(s) else None))
        k = k_scale + plan.has_w_scale(s)
    return ins, k


def _slice_delta(plan: ExpandPlan, s: int, buf_ref, b_refs, bias_ref, slot_rank, w_scale_ref=None):
    """(tm, tn) float32: extract_s(buf_tile) @ B_s[slot].T (times the fp8 B's output-row scales
    `w_scale_ref`, once after the sum; + bias; a DoRA scale is applied by the caller, after y is
    added: `_scaled`), summed over B's rank chunks;
    a chunk past the slot's rank (another slot's rows, its fetch skipped) is masked out. Buffer lanes
    outside the chunk's real rank columns and B's rank padding are selected away before any product
    (values there may be anything, NaN included)."""
    delta = None
    for c in range(plan.chunks):
        rank_here = slot_rank - c * plan.rc
        lo = s * plan.rank + c * plan.rc
        extract = _placement(plan.rc, plan.lanes, lo, rank_here)
        part = _dot(_window(buf_ref[...], lo, jnp.minimum(rank_here, plan.rc), 1), extract, (1, 1))  # (tm, rc)
        b_tile = _below(b_refs[c][...], rank_here, 1 if plan.b_layout == "nr" else 0)
        d = _dot(part, b_tile, (1, 1) if plan.b_layout == "nr" else (1, 0))          # (tm, tn)
        delta = d if delta is None else delta + d
    if w_scale_ref is not None:
        delta = delta * w_scale_ref[...]
    if bias_ref is not None and not plan.is_scaled(s):
        delta = delta + bias_ref[...].astype(jnp.float32)
    return delta


def _scaled(plan: ExpandPlan, s: int, new, vec_ref):
    """DoRA's epilogue: the slice's new value (y + delta, float32 (tm, tn)) times the slot's column
    scale g (its (1, tn) block); other slices unchanged."""
    return new * vec_ref[...].astype(jnp.float32) if plan.is_scaled(s) else new


def _expand_kernel(tile_ref, slot_ref, live_ref, rank_ref, chunk_slot_ref, row_slot_ref, buf_ref, *refs,
                   plan: ExpandPlan):
    """Grid (j, i): for the slice s owning column tile j,
    delta_s[tile rows, tile cols] = extract_s(buf_tile) @ B_s[slot].T (+ bias_s[slot]), group rows only."""
    s_count = len(plan.widths)
    ins, k = _slice_refs(plan, refs)
    outs = refs[k:k + s_count]
    j, i = pl.program_id(0), pl.program_id(1)
    live = live_ref[i] == 1
    base, tiles_n = plan.tile_base, plan.tiles_n

    for s in range(s_count):
        mine = (j >= base[s]) & (j < base[s] + tiles_n[s])

        @pl.when(live & mine)
        def _compute(s=s):
            delta = _slice_delta(plan, s, buf_ref, ins[s][0], ins[s][1], rank_ref[slot_ref[i]], ins[s][2])
            out_ref = outs[s]
            rows = _row_mask(row_slot_ref, slot_ref[i])
            out_ref[...] = jnp.where(rows, delta, out_ref[...])


def _expand_inplace_kernel(tile_ref, slot_ref, live_ref, rank_ref, chunk_slot_ref, col0_ref, row_slot_ref,
                           buf_ref, *refs, plan: ExpandPlan, add_inputs: bool):
    """Token order, y aliased in and out: on the first step of an m-tile copy the y block, then
    each group writes its rows: y = cast((y if add_inputs else 0) + buf @ B.T + bias), once (a
    DoRA slice: cast(g * ((y if add_inputs else 0) + buf @ B.T)))."""
    s_count = len(plan.widths)
    ins, k = _slice_refs(plan, refs)
    y_in, y_out = refs[k], refs[k + 1]
    j, i = pl.program_id(0), pl.program_id(1)
    live = live_ref[i] == 1
    first = (i == 0) | (tile_ref[i] != tile_ref[jnp.maximum(i - 1, 0)])

    @pl.when(first)
    def _init():
        y_out[...] = y_in[...]

    for s in range(s_count):
        mine = (j >= plan.tile_base[s]) & (j < plan.tile_base[s] + plan.tiles_n[s])

        @pl.when(live & mine)
        def _compute(s=s):
            delta = _slice_delta(plan, s, buf_ref, ins[s][0], ins[s][1], rank_ref[slot_ref[i]], ins[s][2])
            if add_inputs:
                delta = delta + y_in[...].astype(jnp.float32)
            delta = _scaled(plan, s, delta, ins[s][1])
            rows = _row_mask(row_slot_ref, slot_ref[i])
            y_out[...] = jnp.where(rows, delta.astype(y_out.dtype), y_out[...])


def _column_of(plan: ExpandPlan, j, col0_ref):
    """First y column of grid column tile j (slices laid end to end; col0 = offsets // tn)."""
    s_of_j, first_j = 0, 0
    for s in range(1, len(plan.widths)):
        s_of_j = jnp.where(j >= plan.tile_base[s], s, s_of_j)
        first_j = jnp.where(j >= plan.tile_base[s], plan.tile_base[s], first_j)
    return (col0_ref[s_of_j] + j - first_j) * plan.tn[0]


def _expand_scatter_kernel(tile_ref, slot_ref, live_ref, rank_ref, chunk_slot_ref, col0_ref, row_tok_ref,
                           row_slot_ref, buf_ref, *refs, plan: ExpandPlan, add_inputs: bool):
    """Sorted order, y updated in place by rows: on the first step of an m-tile the y pieces of its
    rows (tokens row_tok, -1 for none) are DMA'd into a VMEM tile; each group updates its rows,
    y = cast((y if add_inputs else 0) + buf @ B.T + bias) (DoRA: g * (...) without bias); on the
    tile's last step the rows are
    DMA'd back. Only tokens with a LoRA are read or written."""
    s_count, tm, tn = len(plan.widths), plan.tm, plan.tn[0]
    ins, k = _slice_refs(plan, refs)
    _, y_hbm, ybuf, sem = refs[k], refs[k + 1], refs[k + 2], refs[k + 3]  # y in (aliased), y out
    j, i = pl.program_id(0), pl.program_id(1)
    cap = tile_ref.shape[0]
    tile = tile_ref[i]
    first = (i == 0) | (tile != tile_ref[jnp.maximum(i - 1, 0)])
    last = (i == pl.num_programs(1) - 1) | (tile != tile_ref[jnp.minimum(i + 1, cap - 1)])
    col = pl.multiple_of(_column_of(plan, j, col0_ref), 128)

    def rows_dma(to_hbm: bool, wait: bool):
        def copy(tok, row):
            hbm = y_hbm.at[pl.ds(tok, 1), pl.ds(col, tn)]
            vmem = ybuf.at[pl.ds(row, 1), :]
            return pltpu.make_async_copy(vmem, hbm, sem) if to_hbm else pltpu.make_async_copy(hbm, vmem, sem)
        _rows_dma(row_tok_ref, tile, tm, wait, copy)

    @pl.when(first)
    def _gather():
        rows_dma(False, False)
        rows_dma(False, True)

    for s in range(s_count):
        mine = (j >= plan.tile_base[s]) & (j < plan.tile_base[s] + plan.tiles_n[s])

        @pl.when((live_ref[i] == 1) & mine)
        def _compute(s=s):
            delta = _slice_delta(plan, s, buf_ref, ins[s][0], ins[s][1], rank_ref[slot_ref[i]], ins[s][2])
            if add_inputs:
                delta = delta + ybuf[...].astype(jnp.float32)
            delta = _scaled(plan, s, delta, ins[s][1])
            rows = _row_mask(row_slot_ref, slot_ref[i])
            ybuf[...] = jnp.where(rows, delta.astype(ybuf.dtype), ybuf[...])

    @pl.when(last)
    def _scatter():
        rows_dma(True, False)
        rows_dma(True, True)


# --------------------------------------------------------------------------------------- launch

def _slice_maps(plan: ExpandPlan, s: int):
    """Index maps for slice s's B, bias and output blocks on grid (j, i).

    Outside the slice's own column tiles the maps stay frozen: before them on the block that the
    slice's first step will use, after them on the block of its last step. The block index then
    does not change while the slice is idle, so the pipeline neither fetches B nor writes an output
    block back, and no output block is ever revisited non-consecutively."""
    base, n = plan.tile_base[s], plan.tiles_n[s]

    def where(j, i, tile, slot):
        last = tile.shape[0] - 1  # the schedule's tail repeats its last live step
        before, after = j < base, j >= base + n
        jj = jnp.clip(j - base, 0, n - 1)
        ii = jnp.where(before, 0, jnp.where(after, last, i))
        return jj, tile[ii], slot[ii]

    def w_map(c):  # B chunk c: the slot chunk_slots() picked for it (its own slot when needed)
        def index(j, i, tile, slot, live, rk, chunk_slot, *_):
            jj, _, _ = where(j, i, tile, slot)
            ii = jnp.where(j < base, 0, jnp.where(j >= base + n, tile.shape[0] - 1, i))
            sl = chunk_slot[c * tile.shape[0] + ii]
            return (sl, jj, 0) if plan.b_layout == "nr" else (sl, c, jj)
        return index

    def bias_map(j, i, tile, slot, *_):
        jj, _, sl = where(j, i, tile, slot)
        return sl, 0, jj

    def out_map(j, i, tile, slot, *_):
        jj, tl, _ = where(j, i, tile, slot)
        return tl, jj

    return w_map, bias_map, out_map


class _ExpandOperands(NamedTuple):
    """What every expand kernel of one call reads besides the rank rows and the schedule."""

    lora_b: tuple  # S arrays (L, n_s, r) or (L, r, n_s)
    y: jax.Array  # (T, N)
    ranks: jax.Array  # (L,) int32
    bias: tuple | None  # None or S entries of None / (L, n_s)
    offsets: jax.Array  # (S,) int32 column offsets of the slices in y
    add_inputs: bool
    interpret: object  # False or pltpu.InterpretParams
    b_scales: tuple | None = None  # None or S (L, n_s) float32 (ones for 16-bit slices): fp8 B scales


def _delta_blocks(plan: ExpandPlan, lora_b, bias, b_scales=None):
    """BlockSpecs and operands of the delta kernel (`_expand_kernel`) on grid (j, i):
    (in_specs, weight operands, out_specs, out_shapes), one float32 (tp, n_s) delta per slice."""
    r, tm = plan.rank, plan.tm
    tp = plan.tiles_m * tm

    def buf_map(j, i, tile, *_):
        return tile[i], 0

    in_specs = [pl.BlockSpec((tm, 1), buf_map), pl.BlockSpec((tm, plan.lanes), buf_map)]
    operands, out_specs, out_shapes = [], [], []
    for s in range(len(plan.widths)):
        w_map, bias_map, out_map = _slice_maps(plan, s)
        tn, width = plan.tn[s], plan.widths[s]
        w_block = (None, tn, r) if plan.b_layout == "nr" else (None, plan.rc, tn)
        for c in range(plan.chunks):
            in_specs.append(pl.BlockSpec(w_block, w_map(c)))
            operands.append(lora_b[s])
        if plan.has_bias[s]:
            in_specs.append(pl.BlockSpec((None, 1, tn), bias_map))
            operands.append(bias[s].reshape(plan.num_slots, 1, width))
        if plan.has_w_scale(s):
            in_specs.append(pl.BlockSpec((None, 1, tn), bias_map))
            operands.append(b_scales[s].reshape(plan.num_slots, 1, width))
        out_specs.append(pl.BlockSpec((tm, tn), out_map))
        out_shapes.append(jax.ShapeDtypeStruct((tp, width), jnp.float32))
    return in_specs, operands, out_specs, out_shapes


def _run_delta(args: _ExpandOperands, plan: ExpandPlan, blocks, sched: Schedule, row_slot, rows_buf) -> tuple:
    """The delta kernel over rows in the order of `sched`: S float32 (tp, n_s) deltas, only the rows
    of scheduled groups written. blocks: `_delta_blocks(plan, ...)`."""
    in_specs, operands, out_specs, out_shapes = blocks
    r, tp, n_total = plan.rank, plan.tiles_m * plan.tm, sum(plan.widths)
    b_item = max(b.dtype.itemsize for b in args.lora_b)
    return pl.pallas_call(
        functools.partial(_expand_kernel, plan=plan),
        out_shape=tuple(out_shapes),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=5,
            grid=(plan.grid_n, _live_steps(sched)),
            in_specs=in_specs,
            out_specs=tuple(out_specs),
        ),
        compiler_params=_compiler_params(plan.vmem_bytes(b_item)),
        cost_estimate=pl.CostEstimate(
            flops=2 * tp * n_total * r, transcendentals=0,
            bytes_accessed=plan.grid_n * tp * plan.lanes * 4
            + plan.steps * n_total * r * b_item + tp * n_total * 4),
        interpret=args.interpret,
    )(*sched, args.ranks, chunk_slots(sched, args.ranks, plan.rc, plan.chunks), row_slot[:, None], rows_buf,
      *operands)


def _add_deltas(args: _ExpandOperands, plan: ExpandPlan, rows: _Rows, deltas) -> jax.Array:
    """The delta path's XLA epilogue: y[:, slice s] = cast((y if add_inputs else 0) + deltas[s])
    in float32 with one cast, times g[idx[t]] for a DoRA slice; rows without LoRA keep y.
    deltas: S (T, n_s) in token order."""
    out = args.y
    has_lora = rows.has_lora
    for s in range(len(plan.widths)):
        width = plan.widths[s]
        old = lax.dynamic_slice_in_dim(out, args.offsets[s], width, axis=1)
        new = deltas[s]
        if args.add_inputs:
            new = new + old.astype(jnp.float32)
        if plan.is_scaled(s):
            new = new * jnp.take(args.bias[s], jnp.maximum(rows.idx, 0), axis=0).astype(jnp.float32)
        out = lax.dynamic_update_slice_in_dim(
            out, jnp.where(has_lora[:, None], new.astype(args.y.dtype), old), args.offsets[s], axis=1)
    return out


def _weight_blocks(args: _ExpandOperands, plan: ExpandPlan, inplace: ExpandPlan, tn: int):
    """BlockSpecs and operands of every slice's B chunks (and bias) for the in-place plan `inplace`
    (a variant of `plan` with one column tile width tn)."""
    r, specs, ops = plan.rank, [], []
    for s in range(len(plan.widths)):
        w_map, bias_map, _ = _slice_maps(inplace, s)
        for c in range(inplace.chunks):
            specs.append(pl.BlockSpec((None, tn, r) if plan.b_layout == "nr" else (None, inplace.rc, tn),
                                      w_map(c)))
            ops.append(args.lora_b[s])
        if plan.has_bias[s]:
            specs.append(pl.BlockSpec((None, 1, tn), bias_map))
            ops.append(args.bias[s].reshape(plan.num_slots, 1, plan.widths[s]))
        if plan.has_w_scale(s):
            specs.append(pl.BlockSpec((None, 1, tn), bias_map))
            ops.append(args.b_scales[s].reshape(plan.num_slots, 1, plan.widths[s]))
    return specs, ops


def _run_inplace(args: _ExpandOperands, plan: ExpandPlan, inplace: ExpandPlan, sched: Schedule, row_slot,
                 rows_buf) -> jax.Array:
    """Token order, y aliased in and out and updated by (tm, tn) blocks (`_expand_inplace_kernel`):
    the new y."""
    tm, tn, s_count = plan.tm, inplace.tn[0], len(plan.widths)
    base = inplace.tile_base

    def row_map(j, i, tile, *_):
        return tile[i], 0

    def y_map(j, i, tile, slot, live, rk, chunk_slot, col0):
        s_of_j, first_j = 0, 0  # the slice owning column tile j, and its first j
        for s in range(1, s_count):
            s_of_j = jnp.where(j >= base[s], s, s_of_j)
            first_j = jnp.where(j >= base[s], base[s], first_j)
        return tile[i], col0[s_of_j] + j - first_j

    w_specs, ops = _weight_blocks(args, plan, inplace, tn)
    specs = [pl.BlockSpec((tm, 1), row_map), pl.BlockSpec((tm, plan.lanes), row_map), *w_specs]
    specs.append(pl.BlockSpec((tm, tn), y_map))
    col0 = (args.offsets // tn).astype(jnp.int32)
    return pl.pallas_call(
        functools.partial(_expand_inplace_kernel, plan=inplace, add_inputs=args.add_inputs),
        out_shape=jax.ShapeDtypeStruct(args.y.shape, args.y.dtype),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=6,
            grid=(inplace.grid_n, _live_steps(sched)),
            in_specs=specs,
            out_specs=pl.BlockSpec((tm, tn), y_map),
        ),
        input_output_aliases={6 + 2 + len(ops): 0},
        compiler_params=_compiler_params(inplace.vmem_bytes(args.lora_b[0].dtype.itemsize)),
        interpret=args.interpret,
    )(*sched, args.ranks, chunk_slots(sched, args.ranks, inplace.rc, inplace.chunks), col0, row_slot[:, None],
      rows_buf, *ops, args.y)


def _run_scatter(args: _ExpandOperands, plan: ExpandPlan, scatter: ExpandPlan, sched: Schedule, order,
                 row_slot, rows_buf) -> jax.Array:
    """Sorted order, y aliased in and out and updated by row DMAs (`_expand_scatter_kernel`): the
    new y. order: the token at each sorted row."""
    tm, tn = plan.tm, scatter.tn[0]

    def row_map(j, i, tile, *_):
        return tile[i], 0

    w_specs, ops = _weight_blocks(args, plan, scatter, tn)
    specs = [pl.BlockSpec((tm, 1), row_map), pl.BlockSpec((tm, plan.lanes), row_map), *w_specs]
    specs.append(pl.BlockSpec(memory_space=pl.ANY))
    row_tok = jnp.where(row_slot >= 0, order, -1).astype(jnp.int32)
    return pl.pallas_call(
        functools.partial(_expand_scatter_kernel, plan=scatter, add_inputs=args.add_inputs),
        out_shape=jax.ShapeDtypeStruct(args.y.shape, args.y.dtype),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=7,
            grid=(scatter.grid_n, _live_steps(sched)),
            in_specs=specs,
            out_specs=pl.BlockSpec(memory_space=pl.ANY),
            scratch_shapes=[pltpu.VMEM((tm, tn), args.y.dtype), pltpu.SemaphoreType.DMA],
        ),
        input_output_aliases={7 + 2 + len(ops): 0},
        compiler_params=_compiler_params(scatter.vmem_bytes(args.lora_b[0].dtype.itemsize)),
        interpret=args.interpret,
    )(*sched, args.ranks, chunk_slots(sched, args.ranks, scatter.rc, scatter.chunks),
      (args.offsets // tn).astype(jnp.int32), row_tok, row_slot[:, None], rows_buf, *ops, args.y)


def _expand_orders(lora_b, y, ranks, bias, offsets, rows: _Rows, plan: ExpandPlan,
                   inplace: ExpandPlan | None, scatter: ExpandPlan | None, add_inputs: bool, interpret,
                   b_scales=None):
    """(token-order fn, sorted-order fn): each takes the packed (tp, P) rank rows in its own order
    and returns the new y.

    Token order updates y in place by blocks when `inplace` is given, sorted order by row DMAs when
    `scatter` is given; otherwise either runs the delta kernel and the XLA epilogue adds the deltas."""
    args = _ExpandOperands(lora_b, y, ranks, bias, offsets, add_inputs, interpret, b_scales)
    t, tp = plan.num_tokens, plan.tiles_m * plan.tm
    # The delta kernel adds biases only: a DoRA scale multiplies y + delta, which only the XLA
    # epilogue sees on that path (`_add_deltas`), so its plan reads no DoRA blocks (fp8 B scales
    # multiply the product itself: the kernel reads them on every path).
    dplan = dataclasses.replace(plan, has_bias=tuple(b and not plan.is_scaled(s) for s, b in enumerate(plan.has_bias)),
                                scaled=()) if plan.scaled else plan
    blocks = _delta_blocks(dplan, lora_b, bias, b_scales)  # traced here, outside the branches that share it

    def token_order(packed_rows):
        row_slot = _pad_rows(rows.idx, tp, -1)
        if inplace is not None:
            return _run_inplace(args, plan, inplace, rows.token_sched, row_slot, packed_rows)
        deltas = _run_delta(args, dplan, blocks, rows.token_sched, row_slot, packed_rows)
        return _add_deltas(args, plan, rows, tuple(d[:t] for d in deltas))

    def sorted_order(packed_rows):
        row_slot = _sorted_slots(rows.idx, rows.order, t)
        if scatter is not None:
            return _run_scatter(args, plan, scatter, rows.sorted_sched, rows.order, row_slot, packed_rows)
        deltas = _run_delta(args, dplan, blocks, rows.sorted_sched, row_slot, packed_rows)
        return _add_deltas(args, plan, rows, tuple(jnp.take(d, rows.position, axis=0) for d in deltas))

    return token_order, sorted_order


def _expand_call(buf, lora_b, y, meta, ranks, bias, offsets, b_scales, *, plan: ExpandPlan,
                 inplace: ExpandPlan | None, scatter: ExpandPlan | None, add_inputs, row_order, interpret):
    t, r, s_count = plan.num_tokens, plan.rank, len(plan.widths)
    tp = plan.tiles_m * plan.tm
    rows = _rows(meta, t, plan.num_slots, plan.tm, tp)
    # Pack the S rank blocks side by side in the lanes (small: T x P float32).
    packed = jnp.transpose(buf.astype(jnp.float32), (1, 0, 2)).reshape(t, s_count * r)
    packed = jnp.pad(packed, ((0, 0), (0, plan.lanes - s_count * r)))
    token_order, sorted_order = _expand_orders(lora_b, y, ranks, bias, offsets, rows, plan, inplace,
                                               scatter, add_inputs, interpret, b_scales)
    # As in shrink: the row order estimated cheaper (either can update y in place).
    cost = expand_order_cost(plan, inplace, lora_b[0].dtype.itemsize, y.dtype.itemsize, scatter)
    return _pick_order(row_order, choose_token_order(rows.token_sched, rows.sorted_sched, cost),
                       lambda: token_order(_pad_rows(packed, tp, 0)),
                       lambda: sorted_order(jnp.take(packed, rows.order, axis=0)))


_expand_call = _two_jits(_expand_call, ("plan", "inplace", "scatter", "add_inputs", "row_order", "interpret"))


def _inplace_plans(plan: ExpandPlan, offsets, y, tn_max: int) -> tuple:
    """(token-order in-place plan, sorted-order by-rows plan), each None when it does not apply;
    both checked against the block-shape rules."""
    out = []
    for by_rows in (False, True):
        p = plan_inplace(plan, offsets, y.shape[1], y.dtype.itemsize, tn_max=tn_max, by_rows=by_rows)
        if p is not None:
            tpu_rules.check_blocks(p.block_uses())
        out.append(p)
    return tuple(out)


def expand(buf: jax.Array, lora_b: Sequence[jax.Array], y: jax.Array, meta: LoRAKernelMeta,
           offsets: Sequence[int], add_inputs: bool, lora_ranks=None, bias=None, *,
           b_layout: str = "nr", tm_max: int = 256, tn_max: int = 4096,
           allow_inplace: bool = True, row_order: str | None = None, row_dma: bool = True,
           col_scale=None, b_scales=None) -> jax.Array:
    """buf (S, T, r); lora_b: S arrays (L, n_s, r) (or (L, r, n_s) with b_layout="rn");
    y (T, N); offsets: S column offsets (slices inside y); bias, col_scale: None or S entries of
    None / (L, n_s), never both for one slice.

    Returns the new y: y[t, off_s:off_s+n_s] = (y[...] if add_inputs else 0) + buf[s, t] @ B_s[idx[t]].T
    + bias_s[idx[t]], accumulated in float32 and cast once; a slice with a DoRA column scale gets
    g_s[idx[t]] * ((y[...] if add_inputs else 0) + buf[s, t] @ B_s[idx[t]].T) instead, in the same
    epilogue; rows with idx -1 and columns outside the slices unchanged. One pallas_call covers all
    slices. When the slices sit on 128-column boundaries and T is a multiple of the row tile, the
    token-order path updates y in place in the kernel (`plan_inplace`); otherwise the kernel writes
    a float32 delta that XLA adds to y. b_scales: None or S entries of None / (L, n_s) float32, the
    output-row scales of e4m3 slices (module docstring).
    """
    if b_layout not in ("nr", "rn"):
        raise ValueError(f"b_layout must be 'nr' (L, n, r) or 'rn' (L, r, n), got {b_layout!r}")
    _check_row_order(row_order)
    s_count, t, r = buf.shape
    if t == 0:  # nothing to launch
        return y
    if len(lora_b) != s_count or len(offsets) != s_count:
        raise ValueError(f"buf has {s_count} slices but lora_b has {len(lora_b)} and offsets "
                         f"{len(offsets)}")
    num_slots = lora_b[0].shape[0]
    widths = []
    for s, b in enumerate(lora_b):
        width, b_rank = (b.shape[1], b.shape[2]) if b_layout == "nr" else (b.shape[2], b.shape[1])
        if b.shape[0] != num_slots or b_rank != r or (b.dtype != lora_b[0].dtype and b_scales is None):
            raise ValueError(f"lora_b[{s}] has shape {b.shape} dtype {b.dtype}; expected {num_slots} "
                             f"slots, rank {r} in layout {b_layout!r}, dtype {lora_b[0].dtype}")
        if not 0 <= int(offsets[s]) <= y.shape[1] - width:
            raise ValueError(f"slice {s} (offset {offsets[s]}, width {width}) falls outside y's "
                             f"{y.shape[1]} columns")
        widths.append(width)
    bias, has_bias, scaled = epilogue_vectors(bias, col_scale, s_count)
    b_scales = scales_by_slice(b_scales, s_count, num_slots, widths)
    plan = plan_expand(t, widths, r, num_slots, _round_up(s_count * r, 128), b_layout, has_bias,
                       max(b.dtype.itemsize for b in lora_b), tm_max=tm_max, tn_max=tn_max,
                       chunked=lora_ranks is not None, scaled=scaled,
                       w_scaled=None if b_scales is None else (True,) * s_count)
    tpu_rules.check_blocks(plan.block_uses())
    inplace, scatter = _inplace_plans(plan, offsets, y, tn_max) if allow_inplace else (None, None)
    scatter = scatter if row_dma else None
    ranks = _ranks_or_full(lora_ranks, num_slots, r)
    return _expand_call(buf, tuple(lora_b), y, meta, ranks, bias,
                        jnp.asarray([int(o) for o in offsets], jnp.int32), b_scales, plan=plan, inplace=inplace,
                        scatter=scatter,
                        add_inputs=bool(add_inputs), row_order=row_order, interpret=current_interpret())


def transpose_lora_b(lora_b: Sequence[jax.Array]) -> tuple:
    """(L, n, r) -> (L, r, n) per slice: the lane-dense layout for `expand(..., b_layout="rn")`.

    Do it once when adapters are loaded, not per step (it reads every slot)."""
    return tuple(jnp.swapaxes(b, 1, 2) for b in lora_b)
