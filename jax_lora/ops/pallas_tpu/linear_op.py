"""add_lora_linear in one program: shrink and expand under one row-order decision (one
`lax.cond`), the packed rank rows passed between the two kernels in that order.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp

from lora_core.dora import epilogue_vectors

from ... import tpu_rules
from ...meta import LoRAKernelMeta
from .common import _ranks_or_full, _two_jits, current_interpret
from .expand_op import _expand_orders, _inplace_plans, expand
from .plans import ExpandPlan, ShrinkPlan, expand_order_cost, plan_expand, plan_shrink, shrink_order_cost
from .schedule import OrderCost, _check_row_order, _pick_order, _rows, choose_token_order
from .shrink_op import _shrink_orders, shrink


def _linear_call(y, x, lora_a, lora_b, meta, scale, ranks, bias, offsets, *, splan: ShrinkPlan,
                 eplan: ExpandPlan, inplace: ExpandPlan | None, scatter: ExpandPlan | None, row_order,
                 interpret):
    t = splan.num_tokens
    rows = _rows(meta, t, splan.num_slots, splan.tm, splan.tiles_m * splan.tm)
    s_token, s_sorted = _shrink_orders(x, lora_a, ranks, rows, splan, interpret)
    e_token, e_sorted = _expand_orders(lora_b, y, ranks, bias, offsets, rows, eplan, inplace, scatter, True,
                                       interpret)
    a_item, b_item = max(a.dtype.itemsize for a in lora_a), lora_b[0].dtype.itemsize
    sc = shrink_order_cost(splan, x.dtype.itemsize, a_item)
    ec = expand_order_cost(eplan, inplace, b_item, y.dtype.itemsize, scatter)
    cost = OrderCost(sc.step_weight_bytes + ec.step_weight_bytes, sc.token_rows_bytes + ec.token_rows_bytes,
                     sc.sorted_rows_bytes + ec.sorted_rows_bytes)
    # The rank rows stay in the chosen order between the two kernels: no scatter, no re-gather.
    # Rows the shrink did not write hold garbage; the expand never stores them.
    return _pick_order(row_order, choose_token_order(rows.token_sched, rows.sorted_sched, cost),
                       lambda: e_token(s_token() * scale), lambda: e_sorted(s_sorted() * scale))


_linear_call = _two_jits(_linear_call, ("splan", "eplan", "inplace", "scatter", "row_order", "interpret"))


def linear(y: jax.Array, x: jax.Array, lora_a: Sequence[jax.Array], lora_b: Sequence[jax.Array],
           meta: LoRAKernelMeta, scale: float, offsets: Sequence[int], lora_ranks=None, bias=None, *,
           b_layout: str = "nr", tm_max: int = 256, tk_max: int = 8192, tn_max: int = 4096,
           row_order: str | None = None, row_dma: bool = True, col_scale=None, a_scales=None,
           b_scales=None) -> jax.Array:
    """add_lora_linear's math in one program: y[t, slice s] += (scale * x[t] @ A_s[idx].T) @ B_s[idx].T
    + bias_s[idx] (float32, one cast), rows with idx -1 and other columns untouched; a slice with a
    DoRA column scale (col_scale: None or S entries of None / (L, n_s)) gets
    y[t, slice s] = g_s[idx] * (y[t, slice s] + delta) instead (`expand`).

    Shrink and expand share one row order (one `lax.cond`) and the packed rank rows pass between
    them in that order. The wrapper calls it when no shrink buffer is requested. row_order: None
    (chosen per call on the device), or force "token" / "sorted" (for measurements). row_dma:
    False replaces the sorted order's row DMAs by XLA gathers and a float32 delta. a_scales /
    b_scales: the per-channel scales of e4m3 slices (`shrink`, `expand`); with them the shrink and
    the expand run as two calls, each applying its scales in its epilogue.
    """
    _check_row_order(row_order)
    t, h = x.shape
    if t == 0:
        return y
    num_slots, r, _ = lora_a[0].shape
    s_count = len(lora_a)
    chunked = lora_ranks is not None
    x_item, a_item = x.dtype.itemsize, max(a.dtype.itemsize for a in lora_a)
    widths = [b.shape[1] if b_layout == "nr" else b.shape[2] for b in lora_b]
    vectors, has_bias, scaled = epilogue_vectors(bias, col_scale, len(lora_b))
    splan = plan_shrink(t, h, s_count, r, num_slots, x_item, a_item, tm_max=tm_max, tk_max=tk_max,
                        chunked=chunked, row_dma=row_dma)
    eplan = plan_expand(t, widths, r, num_slots, splan.lanes, b_layout, has_bias, lora_b[0].dtype.itemsize,
                        tm_max=splan.tm, tn_max=tn_max, chunked=chunked, scaled=scaled)
    if eplan.tm != splan.tm:
        splan = plan_shrink(t, h, s_count, r, num_slots, x_item, a_item, tm_max=eplan.tm, tk_max=tk_max,
                            chunked=chunked, row_dma=row_dma)
    fp8 = a_scales is not None or b_scales is not None
    if eplan.tm != splan.tm or len(lora_b) != s_count or fp8:  # no common row tile, or fp8 scales: two calls
        buf = shrink(x, lora_a, meta, scale, lora_ranks, tm_max=tm_max, tk_max=tk_max, row_order=row_order,
                     row_dma=row_dma, a_scales=a_scales)
        return expand(buf, lora_b, y, meta, offsets, True, lora_ranks, bias, b_layout=b_layout,
                      tm_max=tm_max, tn_max=tn_max, row_order=row_order, row_dma=row_dma, col_scale=col_scale,
                      b_scales=b_scales)
    for s in range(len(lora_b)):
        if not 0 <= int(offsets[s]) <= y.shape[1] - widths[s]:
            raise ValueError(f"slice {s} (offset {offsets[s]}, width {widths[s]}) falls outside y's "
                             f"{y.shape[1]} columns")
    tpu_rules.check_blocks(splan.block_uses())
    tpu_rules.check_blocks(eplan.block_uses())
    inplace, scatter = _inplace_plans(eplan, offsets, y, tn_max)
    scatter = scatter if row_dma else None
    ranks = _ranks_or_full(lora_ranks, num_slots, r)
    return _linear_call(y, x, tuple(lora_a), tuple(lora_b), meta, jnp.float32(scale), ranks,
                        vectors,
                        jnp.asarray([int(o) for o in offsets], jnp.int32), splan=splan, eplan=eplan,
                        inplace=inplace, scatter=scatter, row_order=row_order, interpret=current_interpret())
