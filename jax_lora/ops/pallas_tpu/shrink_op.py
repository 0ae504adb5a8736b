"""Shrink: buf[s, t, :] = scale * x[t] @ A_s[idx[t]].T for all S slices in one pallas_call.

Kernels: `_shrink_kernel` (x rows by BlockSpec, grid (steps, tiles_k), either row order) and
`_shrink_gather_kernel` (sorted order with tk = H: the kernel DMAs the x rows from their token
positions, no XLA gather). Both write the S rank blocks packed side by side in the lanes, (rows, P)
float32, only the rows of scheduled groups; the epilogue puts rows back in token order, unpacks,
applies `scale` and zeroes rows without a LoRA.

fp8 weights: an e4m3 A block is loaded as it is stored (1 byte per weight from HBM) and upcast in
the kernel (`_dot`: to bf16 beside bf16 activations, exact, else float32); the product accumulates
in float32 and the rank-row scale a_scale_s[idx[t], c] multiplies it once, in the epilogue, with
`scale`: buf[s, t, c] = scale * a_scale_s[idx[t], c] * sum_k x[t, k] * A_q,s[idx[t], c, k].
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from ... import tpu_rules
from ...meta import LoRAKernelMeta
from .common import (
    _below,
    _dot,
    _pad_rows,
    _placement,
    _ranks_or_full,
    _row_mask,
    _rows_dma,
    _two_jits,
    current_interpret,
    scales_by_slice,
)
from .plans import ShrinkPlan, _compiler_params, plan_shrink, shrink_order_cost
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

def _shrink_kernel(tile_ref, slot_ref, live_ref, rank_ref, chunk_slot_ref, row_slot_ref, x_ref, *refs,
                   num_slices: int, rank: int, rc: int, tm: int, lanes: int, tiles_k: int):
    """One step: acc[tm, P] += sum_s place_s(x_tile @ A_s[slot].T); at the last k, store the group's rows.

    A_s arrives as rank // rc chunk blocks; a chunk past the slot's rank holds another slot's rows
    (its fetch was skipped) and is masked out by the placement matrix."""
    chunks = rank // rc
    n_a = num_slices * chunks
    a_refs, out_ref, acc_ref = refs[:n_a], refs[n_a], refs[n_a + 1]
    i, k = pl.program_id(0), pl.program_id(1)
    live = live_ref[i] == 1
    slot_rank = rank_ref[slot_ref[i]]

    @pl.when(k == 0)
    def _zero():
        acc_ref[...] = jnp.zeros_like(acc_ref)

    @pl.when(live)
    def _accumulate():
        x = x_ref[...]
        total = acc_ref[...]
        for s in range(num_slices):
            for c in range(chunks):
                part = _below(_dot(x, a_refs[s * chunks + c][...], (1, 1)), slot_rank - c * rc, 1)  # (tm, rc)
                total += _dot(part, _placement(rc, lanes, s * rank + c * rc, slot_rank - c * rc), (1, 0))
        acc_ref[...] = total

    @pl.when(live & (k == tiles_k - 1))
    def _store():
        rows = _row_mask(row_slot_ref, slot_ref[i])
        out_ref[...] = jnp.where(rows, acc_ref[...], out_ref[...])


def _shrink_gather_kernel(tile_ref, slot_ref, live_ref, rank_ref, chunk_slot_ref, row_tok_ref, row_slot_ref,
                          x_hbm, *refs, num_slices: int, rank: int, rc: int, tm: int, lanes: int):
    """Sorted order without an XLA gather (tk = H): on the first step of an m-tile the x rows of its
    tokens with a LoRA (row_tok, -1 for none) are DMA'd from HBM into a VMEM tile; then as
    `_shrink_kernel`. Rows not fetched hold stale values and are never stored."""
    chunks = rank // rc
    n_a = num_slices * chunks
    a_refs, out_ref, xbuf, sem = refs[:n_a], refs[n_a], refs[n_a + 1], refs[n_a + 2]
    i = pl.program_id(0)
    tile = tile_ref[i]
    first = (i == 0) | (tile != tile_ref[jnp.maximum(i - 1, 0)])

    def rows_dma(wait: bool):
        _rows_dma(row_tok_ref, tile, tm, wait,
                  lambda tok, row: pltpu.make_async_copy(x_hbm.at[pl.ds(tok, 1), :], xbuf.at[pl.ds(row, 1), :], sem))

    @pl.when(first)
    def _gather():
        rows_dma(False)
        rows_dma(True)

    @pl.when(live_ref[i] == 1)
    def _compute():
        x = xbuf[...]
        slot_rank = rank_ref[slot_ref[i]]
        total = jnp.zeros((tm, lanes), jnp.float32)
        for s in range(num_slices):
            for c in range(chunks):
                part = _below(_dot(x, a_refs[s * chunks + c][...], (1, 1)), slot_rank - c * rc, 1)
                total += _dot(part, _placement(rc, lanes, s * rank + c * rc, slot_rank - c * rc), (1, 0))
        rows = _row_mask(row_slot_ref, slot_ref[i])
        out_ref[...] = jnp.where(rows, total, out_ref[...])


# --------------------------------------------------------------------------------------- launch

def _shrink_gather_run(plan: ShrinkPlan, sched: Schedule, ranks, row_slot, row_tok, x, lora_a, interpret):
    """The gather kernel: (tp, P) float32 packed rows in sorted order, unscaled."""
    tm, s_count, n = plan.tm, plan.num_slices, sched.slot.shape[0]
    tp = plan.tiles_m * tm

    def row_map(i, tile, *_):
        return tile[i], 0

    def a_map(c):
        def index(i, tile, slot, live, rk, chunk_slot, row_tok):
            return chunk_slot[c * n + i], c, 0
        return index

    kernel = functools.partial(_shrink_gather_kernel, num_slices=s_count, rank=plan.rank, rc=plan.rc, tm=tm,
                               lanes=plan.lanes)
    a_item = max(a.dtype.itemsize for a in lora_a)
    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((tp, plan.lanes), jnp.float32),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=6,
            grid=(_live_steps(sched),),
            in_specs=[pl.BlockSpec((tm, 1), row_map), pl.BlockSpec(memory_space=pl.ANY)]
            + [pl.BlockSpec((None, plan.rc, plan.hidden), a_map(c)) for _ in range(s_count)
               for c in range(plan.chunks)],
            out_specs=pl.BlockSpec((tm, plan.lanes), row_map),
            scratch_shapes=[pltpu.VMEM((tm, plan.hidden), x.dtype), pltpu.SemaphoreType.DMA],
        ),
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("arbitrary",),
            vmem_limit_bytes=_compiler_params(plan.vmem_bytes(x.dtype.itemsize, a_item)).vmem_limit_bytes),
        interpret=interpret,
    )(*sched, ranks, chunk_slots(sched, ranks, plan.rc, plan.chunks), row_tok, row_slot[:, None], x,
      *[a for a in lora_a for _ in range(plan.chunks)])


def _shrink_run(plan: ShrinkPlan, sched: Schedule, ranks, row_slot, rows_x, lora_a, interpret) -> jax.Array:
    """The shrink kernel over rows in a given order: (tp, P) float32, unscaled; only the rows of
    scheduled groups are written."""
    tm, s_count, r = plan.tm, plan.num_slices, plan.rank
    tp, n = plan.tiles_m * tm, sched.slot.shape[0]
    a_item = max(a.dtype.itemsize for a in lora_a)

    def x_map(i, k, tile, *_):
        return tile[i], k

    def row_map(i, k, tile, *_):
        return tile[i], 0

    def a_map(c):
        def index(i, k, tile, slot, live, rk, chunk_slot):
            return chunk_slot[c * n + i], c, k
        return index

    kernel = functools.partial(_shrink_kernel, num_slices=s_count, rank=r, rc=plan.rc, tm=tm,
                               lanes=plan.lanes, tiles_k=plan.tiles_k)
    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((tp, plan.lanes), jnp.float32),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=5,
            grid=(_live_steps(sched), plan.tiles_k),
            in_specs=[pl.BlockSpec((tm, 1), row_map), pl.BlockSpec((tm, plan.tk), x_map)]
            + [pl.BlockSpec((None, plan.rc, plan.tk), a_map(c)) for _ in range(s_count)
               for c in range(plan.chunks)],
            out_specs=pl.BlockSpec((tm, plan.lanes), row_map),
            scratch_shapes=[pltpu.VMEM((tm, plan.lanes), jnp.float32)],
        ),
        compiler_params=_compiler_params(plan.vmem_bytes(rows_x.dtype.itemsize, a_item)),
        cost_estimate=pl.CostEstimate(
            flops=2 * tp * plan.hidden * r * s_count, transcendentals=0,
            bytes_accessed=tp * plan.hidden * rows_x.dtype.itemsize
            + plan.steps * s_count * r * plan.hidden * a_item + tp * plan.lanes * 4),
        interpret=interpret,
    )(*sched, ranks, chunk_slots(sched, ranks, plan.rc, plan.chunks), row_slot[:, None], rows_x,
      *[a for a in lora_a for _ in range(plan.chunks)])


def _shrink_orders(x, lora_a, ranks, rows: _Rows, plan: ShrinkPlan, interpret):
    """(token-order fn, sorted-order fn): each returns the packed (tp, P) rows in its own order."""
    tp, t = plan.tiles_m * plan.tm, plan.num_tokens

    def token_order():
        return _shrink_run(plan, rows.token_sched, ranks, _pad_rows(rows.idx, tp, -1), _pad_rows(x, tp, 0),
                           lora_a, interpret)

    def sorted_order():
        row_slot = _sorted_slots(rows.idx, rows.order, t)
        if plan.tiles_k == 1 and plan.row_dma:  # x rows DMA'd by the kernel: no XLA gather
            row_tok = jnp.where(row_slot >= 0, rows.order, -1).astype(jnp.int32)
            return _shrink_gather_run(plan, rows.sorted_sched, ranks, row_slot, row_tok, x, lora_a, interpret)
        return _shrink_run(plan, rows.sorted_sched, ranks, row_slot, jnp.take(x, rows.order, axis=0), lora_a,
                           interpret)

    return token_order, sorted_order


def _shrink_call(x, lora_a, meta, scale, ranks, a_scales, *, plan: ShrinkPlan, row_order, interpret):
    t, s_count, r = plan.num_tokens, plan.num_slices, plan.rank
    rows = _rows(meta, t, plan.num_slots, plan.tm, plan.tiles_m * plan.tm)
    # Two row orders, one kernel. Token order needs no gather; the sorted order reads each
    # adapter's weights once however the tokens are spread. The one estimated cheaper runs.
    token_order, sorted_order = _shrink_orders(x, lora_a, ranks, rows, plan, interpret)
    cost = shrink_order_cost(plan, x.dtype.itemsize, max(a.dtype.itemsize for a in lora_a))
    out = _pick_order(row_order, choose_token_order(rows.token_sched, rows.sorted_sched, cost),
                      lambda: token_order()[:t], lambda: jnp.take(sorted_order(), rows.position, axis=0))
    # Epilogue: unpack the slices, scale; rows without LoRA are 0 (their rows were never written).
    packed = out[:, : s_count * r].reshape(t, s_count, r)
    if a_scales is not None:  # fp8: each token's own slot's rank-row scales, once per channel
        own = jnp.clip(rows.idx, 0, plan.num_slots - 1)
        packed = packed * jnp.stack([jnp.take(v, own, axis=0) for v in a_scales], axis=1)
    packed = jnp.where(rows.has_lora[:, None, None], packed * scale, 0.0)
    return jnp.transpose(packed, (1, 0, 2))


_shrink_call = _two_jits(_shrink_call, ("plan", "row_order", "interpret"))


def shrink(x: jax.Array, lora_a: Sequence[jax.Array], meta: LoRAKernelMeta, scale: float,
           lora_ranks=None, *, tm_max: int = 256, tk_max: int = 8192,
           row_order: str | None = None, row_dma: bool = True, a_scales=None) -> jax.Array:
    """x (T, H); lora_a: S arrays (L, r, H), one (L, r) shape -> (S, T, r) float32.

    buf[s, t] = scale * x[t] @ lora_a[s][idx[t]].T, zero rows where idx[t] is -1 or out of range.
    a_scales: None or S entries of None / (L, r) float32, the rank-row scales of e4m3 slices
    (module docstring).
    row_order: None (chosen per call on the device), or force "token" / "sorted" (measurements).
    row_dma: in sorted order let the kernel DMA x rows from their token positions (False: an XLA
    gather; a switch for TPU bring-up and measurement).
    """
    _check_row_order(row_order)
    t, h = x.shape
    num_slots, r, _ = lora_a[0].shape
    if any(a.shape != lora_a[0].shape for a in lora_a):
        raise ValueError(f"every slice of lora_a must have one shape, got {[a.shape for a in lora_a]}")
    if t == 0:  # nothing to launch
        return jnp.zeros((len(lora_a), 0, r), jnp.float32)
    plan = plan_shrink(t, h, len(lora_a), r, num_slots, x.dtype.itemsize,
                       max(a.dtype.itemsize for a in lora_a), tm_max=tm_max, tk_max=tk_max,
                       chunked=lora_ranks is not None, row_dma=row_dma)
    tpu_rules.check_blocks(plan.block_uses())
    ranks = _ranks_or_full(lora_ranks, num_slots, r)
    return _shrink_call(x, tuple(lora_a), meta, jnp.float32(scale), ranks,
                        scales_by_slice(a_scales, len(lora_a), num_slots, [r] * len(lora_a)), plan=plan,
                        row_order=row_order, interpret=current_interpret())
