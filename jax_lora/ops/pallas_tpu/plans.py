"""Static tiling plans: the row, k and column tiles of one shrink or expand call under a VMEM
budget, and the byte counts the row-order choice weighs.

A plan depends on shapes and dtypes only, never on the mapping, so it is a static argument of the
jitted call and one compiled program serves every mapping. Every BlockSpec is checked against the
TPU block-shape rules (`jax_lora.tpu_rules`) while tracing: each plan lists its blocks
(`block_uses`) and the entry points check them.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

from jax.experimental.pallas import tpu as pltpu

from ... import tpu_rules
from .common import _round_up
from .schedule import OrderCost, num_steps

VMEM_BUDGET = 12 * 2**20  # bytes of blocks per step, double-buffered; below Mosaic's default scoped limit


def _lane_divisors(n: int, cap: int) -> list:
    """Multiples of 128 dividing n, largest first, at most cap; [n] when there is none."""
    out = [d for d in range(min(cap, n) // 128 * 128, 0, -128) if n % d == 0]
    return out or [n]


def _pick_tm(num_tokens: int, num_slots: int, tm_max: int) -> int:
    """Rows per m-tile: a multiple of 16 (a bf16 sublane tile) near T / min(L, T).

    Every step multiplies a whole (tm, H) tile although its group may own a few rows of it, so a
    tile much taller than the average group wastes MXU work: with up to min(L, T) groups, tiles of
    about T / min(L, T) rows keep that waste near 2x. Never above tm_max nor the padded T."""
    groups = max(1, min(num_slots, num_tokens))
    tm = min(tm_max, _round_up(num_tokens, 16), _round_up(-(-num_tokens // groups), 16))
    return max(16, tm // 16 * 16)


def _halve_tm(tm: int) -> int:
    return max(16, tm // 2 // 16 * 16)


class _RankChunked:
    """Properties shared by the shrink and expand plans (fields: rank, rank_chunk, num_tokens, tm)."""

    @property
    def rc(self) -> int:
        """Rank rows per block: `rank_chunk`, or the whole rank."""
        return self.rank_chunk or self.rank

    @property
    def chunks(self) -> int:
        return self.rank // self.rc

    @property
    def tiles_m(self) -> int:
        return -(-self.num_tokens // self.tm)


@dataclasses.dataclass(frozen=True)
class ShrinkPlan(_RankChunked):
    """Static tiling of one shrink call: grid (steps, tiles_k)."""

    num_tokens: int
    hidden: int
    num_slices: int
    rank: int
    num_slots: int
    tm: int
    tk: int
    lanes: int  # P: the packed output width
    rank_chunk: int = 0  # rows of A per block; < rank: heterogeneous ranks read real chunks only
    row_dma: bool = True  # sorted order with tk = H: the kernel DMAs x rows (else an XLA gather)

    @property
    def tiles_k(self) -> int:
        return self.hidden // self.tk

    @property
    def steps(self) -> int:
        return num_steps(self.num_tokens, self.num_slots, self.tm)

    def block_uses(self) -> list:
        tp = self.tiles_m * self.tm
        uses = [tpu_rules.BlockUse("row_slot", (tp, 1), (self.tm, 1)),
                tpu_rules.BlockUse("x (rows)", (tp, self.hidden), (self.tm, self.tk))]
        uses += [tpu_rules.BlockUse(f"lora_a[{s}] chunk {c}", (self.num_slots, self.rank, self.hidden),
                                    (None, self.rc, self.tk))
                 for s in range(self.num_slices) for c in range(self.chunks)]
        uses.append(tpu_rules.BlockUse("shrink out (packed)", (tp, self.lanes), (self.tm, self.lanes)))
        return uses

    def vmem_bytes(self, x_bytes: int, a_bytes: int) -> int:
        """VMEM per step: double-buffered x, A and out blocks, plus the accumulator."""
        r_pad = _round_up(self.rank, 16)
        return (2 * self.tm * self.tk * x_bytes + 2 * self.num_slices * r_pad * self.tk * a_bytes
                + 3 * self.tm * self.lanes * 4)


def rank_chunk_for(rank: int, chunked: bool) -> int:
    """Rows per rank chunk: 16 (a bf16 sublane tile) when heterogeneous ranks are in play and the
    rank splits evenly, else the whole rank (one block)."""
    return 16 if chunked and rank > 16 and rank % 16 == 0 else rank


def plan_shrink(num_tokens: int, hidden: int, num_slices: int, rank: int, num_slots: int,
                x_bytes: int = 2, a_bytes: int = 2, tm_max: int = 256, tk_max: int = 8192,
                vmem_budget: int = VMEM_BUDGET, chunked: bool = False, row_dma: bool = True) -> ShrinkPlan:
    """Largest tiles under the VMEM budget, preferring tk = H (then consecutive steps of one group
    reuse the weight block and each adapter's A is read once per call), then a large tm.
    `chunked`: split A's rank into 16-row blocks, fetched only up to each slot's rank."""
    lanes = _round_up(num_slices * rank, 128)
    rc = rank_chunk_for(rank, chunked)
    tm0 = _pick_tm(num_tokens, num_slots, tm_max)
    for tk in _lane_divisors(hidden, tk_max):
        tm = tm0
        while True:
            plan = ShrinkPlan(num_tokens, hidden, num_slices, rank, num_slots, tm, tk, lanes, rc, row_dma)
            if plan.vmem_bytes(x_bytes, a_bytes) <= vmem_budget or tm <= 16:
                break
            tm = _halve_tm(tm)
        if plan.vmem_bytes(x_bytes, a_bytes) <= vmem_budget:
            return plan
    return plan


@dataclasses.dataclass(frozen=True)
class ExpandPlan(_RankChunked):
    """Static tiling of one expand call over all S slices: grid (J, steps).

    Slice s is cut into tiles_n[s] column tiles of width tn[s]; the column tiles of all slices are
    laid end to end, J = sum(tiles_n), and grid row j belongs to slice `slice_of(j)`.
    """

    num_tokens: int
    widths: tuple  # n_s per slice
    rank: int
    num_slots: int
    lanes: int  # P of the packed buffer
    tm: int
    tn: tuple  # per slice
    b_layout: str  # "nr" (L, n, r) as vLLM stores B, or "rn" (L, r, n) rank-major
    has_bias: tuple  # per slice
    y_cols: int = 0  # N; with inplace, y is updated in the kernel (token order only)
    y_bytes: int = 0
    inplace: bool = False
    rank_chunk: int = 0  # rank-major B only: rows per block, fetched only up to each slot's rank
    by_rows: bool = False  # with inplace: y rows moved by DMA (sorted order), no y BlockSpec
    scaled: tuple = ()  # per slice: its epilogue vector (has_bias) is a DoRA column scale g, not a bias
    w_scaled: tuple = ()  # per slice: an fp8 B's output-row scale (L, n_s) multiplies the product

    def is_scaled(self, s: int) -> bool:
        """Slice s's (1, tn) epilogue block multiplies the new value (DoRA) instead of adding."""
        return bool(self.scaled) and bool(self.scaled[s])

    def has_w_scale(self, s: int) -> bool:
        """Slice s reads a (1, tn) block of its fp8 B's scales, which multiplies buf @ B.T."""
        return bool(self.w_scaled) and bool(self.w_scaled[s])

    @property
    def tiles_n(self) -> tuple:
        return tuple(w // t for w, t in zip(self.widths, self.tn))

    @property
    def tile_base(self) -> tuple:
        """First grid row j of each slice."""
        out, acc = [], 0
        for n in self.tiles_n:
            out.append(acc)
            acc += n
        return tuple(out)

    @property
    def grid_n(self) -> int:
        return sum(self.tiles_n)

    @property
    def steps(self) -> int:
        return num_steps(self.num_tokens, self.num_slots, self.tm)

    def block_uses(self) -> list:
        tp = self.tiles_m * self.tm
        uses = [tpu_rules.BlockUse("row_slot", (tp, 1), (self.tm, 1)),
                tpu_rules.BlockUse("buf (rows, packed)", (tp, self.lanes), (self.tm, self.lanes))]
        for s, (width, tn) in enumerate(zip(self.widths, self.tn)):
            if self.b_layout == "nr":
                uses.append(tpu_rules.BlockUse(f"lora_b[{s}]", (self.num_slots, width, self.rank),
                                               (None, tn, self.rank)))
            else:
                uses += [tpu_rules.BlockUse(f"lora_b[{s}] (rank-major) chunk {c}",
                                            (self.num_slots, self.rank, width), (None, self.rc, tn))
                         for c in range(self.chunks)]
            if self.has_bias[s]:
                what = "col_scale" if self.is_scaled(s) else "bias"
                uses.append(tpu_rules.BlockUse(f"{what}[{s}]", (self.num_slots, 1, width), (None, 1, tn)))
            if self.has_w_scale(s):
                uses.append(tpu_rules.BlockUse(f"b_scale[{s}]", (self.num_slots, 1, width), (None, 1, tn)))
            if not self.inplace:
                uses.append(tpu_rules.BlockUse(f"delta[{s}]", (tp, width), (self.tm, tn)))
        if self.inplace and not self.by_rows:
            uses.append(tpu_rules.BlockUse("y (in place)", (self.num_tokens, self.y_cols), (self.tm, self.tn[0])))
        return uses

    def vmem_bytes(self, b_bytes: int) -> int:
        """Every slice's blocks are resident at once (double-buffered), plus the buffer tile."""
        total = self.tm * self.lanes * 4
        for s, tn in enumerate(self.tn):
            if self.b_layout == "nr":  # the rank sits in lanes: a (tn, r) block occupies (tn, 128k)
                total += tn * _round_up(self.rank, 128) * b_bytes
            else:
                total += _round_up(self.rank, 16) * tn * b_bytes
            total += (8 * tn * 4 if self.has_bias[s] else 0) + (8 * tn * 4 if self.has_w_scale(s) else 0)
            total += 0 if self.inplace else self.tm * tn * 4
        if self.inplace:  # y in and y out blocks
            total += 2 * self.tm * self.tn[0] * self.y_bytes
        return 2 * total


def plan_expand(num_tokens: int, widths: Sequence[int], rank: int, num_slots: int, lanes: int,
                b_layout: str = "nr", has_bias: Sequence[bool] | None = None, b_bytes: int = 2,
                tm_max: int = 256, tn_max: int = 4096, vmem_budget: int = VMEM_BUDGET,
                chunked: bool = False, scaled: Sequence[bool] | None = None,
                w_scaled: Sequence[bool] | None = None) -> ExpandPlan:
    """Large column tiles (few re-reads of the buffer) and tm under the VMEM budget: halves the
    widest tile, then tm, until the blocks fit. `chunked` (rank-major B only): 16-row rank blocks.
    has_bias: per slice, an epilogue vector (L, n_s) is read; scaled: per slice, that vector is a
    DoRA column scale (the new value is multiplied by it) rather than a bias (added); w_scaled: per
    slice, an fp8 B's scales (L, n_s) are read too."""
    widths = tuple(int(w) for w in widths)
    has_bias = tuple(bool(b) for b in (has_bias or (False,) * len(widths)))
    scaled = tuple(bool(g) for g in scaled) if scaled and any(scaled) else ()
    w_scaled = tuple(bool(g) for g in w_scaled) if w_scaled and any(w_scaled) else ()
    options = [_lane_divisors(w, tn_max) for w in widths]  # per slice, largest first
    choice = [0] * len(widths)
    tm = _pick_tm(num_tokens, num_slots, tm_max)

    def make():
        return ExpandPlan(num_tokens, widths, rank, num_slots, lanes, tm,
                          tuple(o[c] for o, c in zip(options, choice)), b_layout, has_bias,
                          rank_chunk=rank_chunk_for(rank, chunked and b_layout == "rn"), scaled=scaled,
                          w_scaled=w_scaled)

    plan = make()
    while plan.vmem_bytes(b_bytes) > vmem_budget:
        shrinkable = [s for s in range(len(widths)) if choice[s] + 1 < len(options[s])]
        if shrinkable and max(plan.tn[s] for s in shrinkable) >= 512:
            s = max(shrinkable, key=lambda s: plan.tn[s])
            choice[s] += 1
        elif tm > 16:
            tm = _halve_tm(tm)
        elif shrinkable:
            choice[max(shrinkable, key=lambda s: plan.tn[s])] += 1
        else:
            break
        plan = make()
    return plan


def plan_inplace(plan: ExpandPlan, offsets: Sequence[int], y_cols: int, y_bytes: int,
                 tn_max: int = 4096, vmem_budget: int = VMEM_BUDGET, by_rows: bool = False
                 ) -> ExpandPlan | None:
    """The in-place variant of `plan` (y read and written by the kernel, no float32 delta round
    trip), or None when it does not apply. One column tile width, a multiple of 128, must divide
    every slice width and offset. Token order (y as BlockSpec blocks) also needs T % tm == 0 and
    that width to divide y's; sorted order (`by_rows`: y rows moved by DMA) does not."""
    if not by_rows and plan.tiles_m * plan.tm != plan.num_tokens:
        return None
    g = 0  # y's width too (token order): partial edge blocks of an aliased output break interpret mode
    for v in list(plan.widths) + [int(o) for o in offsets] + ([] if by_rows else [int(y_cols)]):
        g = math.gcd(g, int(v))
    for tn in range(min(tn_max, g) // 128 * 128, 0, -128):
        if g % tn:
            continue
        cand = dataclasses.replace(plan, tn=(tn,) * len(plan.widths), y_cols=int(y_cols),
                                   y_bytes=int(y_bytes), inplace=True, by_rows=by_rows)
        if cand.vmem_bytes(2) <= vmem_budget:
            return cand
    return None


def _compiler_params(vmem_bytes: int) -> pltpu.CompilerParams:
    """Sequential grid ("arbitrary": output tiles are revisited by consecutive steps). A plan that
    cannot fit VMEM_BUDGET (a slice width with no 128-multiple divisor, e.g. an odd vocabulary)
    raises the scoped-VMEM limit instead, up to 96 MiB of the 128 MiB of v5e / v6e."""
    limit = None
    if vmem_bytes > VMEM_BUDGET:
        limit = min(96 * 2**20, int(vmem_bytes * 1.25) + 4 * 2**20)
    return pltpu.CompilerParams(dimension_semantics=("arbitrary", "arbitrary"), vmem_limit_bytes=limit)


# ------------------------------------------------------------------------ order costs of a plan

def shrink_order_cost(plan: ShrinkPlan, x_bytes: int, a_bytes: int) -> OrderCost:
    """The OrderCost of a shrink with this plan: A bytes per weight fetch (all slices, every k
    tile) and the x bytes each order moves (token: x, plus its padded copy when T is not a multiple
    of tm; sorted: the kernel's row DMAs, or an XLA gather)."""
    t, h, tp = plan.num_tokens, plan.hidden, plan.tiles_m * plan.tm
    x_rows = t * h * x_bytes
    padded = 0 if tp == t else x_rows + tp * h * x_bytes
    # sorted: rows DMA'd by the kernel when tk = H, else an XLA gather (read, write, read again)
    sorted_rows = x_rows if plan.tiles_k == 1 and plan.row_dma else 2 * x_rows + 2 * tp * h * x_bytes
    return OrderCost(plan.num_slices * plan.rank * h * a_bytes * plan.tiles_k, x_rows + padded, sorted_rows)


def expand_order_cost(plan: ExpandPlan, inplace: ExpandPlan | None, b_bytes: int,
                      y_bytes: int, scatter: ExpandPlan | None = None) -> OrderCost:
    """The OrderCost of an expand with this plan: B bytes per weight fetch (the rank padded to 128
    lanes in the (L, n, r) layout) and the y bytes each order moves: y read and written once when
    that order updates y in place (`inplace`: token order, `scatter`: sorted order), else also the
    float32 delta written and read back."""
    t, n = plan.num_tokens, sum(plan.widths)
    r_hbm = plan.rank if plan.b_layout == "rn" else _round_up(plan.rank, 128)
    delta_path = t * n * (8 + 2 * y_bytes)
    in_place = 2 * t * n * y_bytes
    return OrderCost(n * r_hbm * b_bytes, in_place if inplace is not None else delta_path,
                     in_place if scatter is not None else delta_path)
