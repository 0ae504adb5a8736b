"""Backend "pallas_tpu": grouped (SGMV-style) shrink and expand as Pallas TPU kernels.

Math (SPEC section 4), with idx[t] the slot of token t (-1 = no LoRA), every product in float32:

  shrink:  buf[s, t, :] = scale * x[t] @ A_s[idx[t]].T                 (0 where idx[t] = -1)
  expand:  y[t, off_s : off_s + n_s] = (y[t, ...] if add_inputs else 0)
                                        + buf[s, t] @ B_s[idx[t]].T + bias_s[idx[t]]
           (rows with idx[t] = -1 untouched), cast to y.dtype once.
  ranks:   with lora_ranks, rank columns c >= lora_ranks[idx[t]] count as zero (in A and in B).

How (the megablox `gmm` pattern, applied to the LoRA metadata of SPEC section 3):

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
  5. y is updated as (y if add_inputs else 0) + delta + bias in float32 and cast once, in the
     kernel (in place) or in an XLA epilogue (delta path); shrink's epilogue puts rows back in
     token order (sorted order), applies `scale` and zeroes rows without a LoRA.

Heterogeneous ranks (`lora_ranks`): A, and B when stored rank-major, are passed as 16-row rank
chunks, one BlockSpec per chunk. `chunk_slots` gives each chunk's index map the step's own slot
when that slot's rank reaches the chunk and otherwise the slot it asked for before, so a chunk
past a slot's rank is never fetched and no grid step is added; the placement matrices mask what a
skipped chunk holds.

Layouts, dense in the 128 lanes: the shrink output packs the S slices side by side in the lane
dim, (rows, P) with P = round_up(S * r, 128) (three rank-16 slices share one lane tile); the expand
kernel reads that packed buffer. A (L, r, H) is lane-dense as stored (H in lanes). vLLM's B layout
(L, n, r) puts the rank in lanes (r = 16 fills 1/8 of them); `expand` also accepts B stored
rank-major, (L, r, n), via `transpose_lora_b` once at load time (see docs/tpu.md for the cost).

Interpret vs compiled: on a TPU backend the kernels are compiled (Mosaic); anywhere else they run
in TPU interpret mode (`pltpu.InterpretParams`: out-of-bounds reads raise, uninitialised memory
reads as NaN). `interpret_mode(params)` overrides the choice (the tests turn on race detection).
Every BlockSpec is checked against the TPU block-shape rules (`jax_lora.tpu_rules`) while tracing.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
from typing import NamedTuple, Optional, Sequence

import jax
import jax.numpy as jnp
from jax import lax
from jax._src import (
    config as _jax_config,  # the flag behind pltpu.force_tpu_interpret_mode
)
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from .. import tpu_rules
from ..meta import LoRAKernelMeta

NAME = "pallas_tpu"

__all__ = [
    "NAME", "shrink", "expand", "linear", "transpose_lora_b",                # the backend
    "Schedule", "make_schedule", "make_token_schedule", "token_groups", "chunk_slots",  # schedules
    "OrderCost", "choose_token_order", "prefers_token_order", "shrink_order_cost", "expand_order_cost",
    "ShrinkPlan", "ExpandPlan", "plan_shrink", "plan_expand", "plan_inplace", "rank_chunk_for",
    "interpret_mode", "current_interpret",
]

HIGHEST = lax.Precision.HIGHEST
VMEM_BUDGET = 12 * 2**20  # bytes of blocks per step, double-buffered; below Mosaic's default scoped limit
DEFAULT_INTERPRET = pltpu.InterpretParams()  # out_of_bounds_reads="raise", uninitialized "nan"


# ----------------------------------------------------------------------------- interpret mode

_interpret_override: list = []


def current_interpret():
    """False (compile with Mosaic) on a TPU backend, else TPU interpret-mode params.

    `interpret_mode(p)` overrides it for the calls traced inside the context, and so do JAX's own
    `pltpu.force_tpu_interpret_mode(p)` / `pltpu.set_tpu_interpret_mode(p)`.
    """
    if _interpret_override:
        return _interpret_override[-1]
    forced = _jax_config.pallas_tpu_interpret_mode_context_manager.value  # pltpu.force_tpu_interpret_mode
    if forced is not None:
        return forced
    return False if jax.default_backend() == "tpu" else DEFAULT_INTERPRET


@contextlib.contextmanager
def interpret_mode(params):
    """Runs the kernels traced in this context with `interpret=params` (InterpretParams or False)."""
    _interpret_override.append(params)
    try:
        yield
    finally:
        _interpret_override.pop()


# Interpret mode compiles a large host program per kernel configuration; XLA's backend
# optimisations roughly double that compile time and buy nothing for a simulation, so the eager
# entry points jit twice: plainly for a TPU, with optimisations off for the interpreter. (Inside a
# caller's jit the caller's compile options apply.)
_INTERPRET_COMPILE_OPTIONS = {"xla_backend_optimization_level": 0,
                              "xla_llvm_disable_expensive_passes": True}


def _two_jits(fn, static_argnames):
    compiled = jax.jit(fn, static_argnames=static_argnames)
    try:
        interpreted = jax.jit(fn, static_argnames=static_argnames,
                              compiler_options=_INTERPRET_COMPILE_OPTIONS)
    except TypeError:  # an older jax without compiler_options
        interpreted = compiled

    @functools.wraps(fn)
    def call(*args, interpret, **kwargs):
        nested = any(isinstance(v, jax.core.Tracer) for v in jax.tree.leaves((args, kwargs)))
        jitted = compiled if interpret is False or nested else interpreted
        return jitted(*args, interpret=interpret, **kwargs)

    return call


# ----------------------------------------------------------------------------- schedule

class Schedule(NamedTuple):
    """Grid-step metadata, scalar-prefetched into SMEM. All (num_steps,) int32.

    tile[i]: the m-tile (rows tile[i]*tm .. +tm of the row order used) step i works on.
    slot[i]: the weight slot of step i's group (always in 0..L-1); the step stores the rows of
             its tile whose slot (the `row_slot` operand) equals slot[i].
    live[i]: 1 for a real step, 0 for the padding tail (nothing computed, nothing stored).
    Steps are ordered by tile, so an output tile is only ever revisited by consecutive steps.
    """

    tile: jax.Array
    slot: jax.Array
    live: jax.Array


def num_steps(num_tokens: int, num_slots: int, tm: int) -> int:
    """Static grid length: every m-tile once, plus one extra visit per group border inside a tile.

    Live groups are disjoint contiguous row ranges, at most min(L, T) of them, so the tiles they
    touch number at most tiles_m + (live groups - 1).
    """
    tiles_m = -(-num_tokens // tm)
    return tiles_m + min(num_slots, num_tokens) - 1


def make_schedule(meta: LoRAKernelMeta, num_tokens: int, num_slots: int, tm: int) -> Schedule:
    """Builds the Schedule for the first `num_tokens` tokens of `meta` (jit-friendly, static shapes).

    Invariants used (meta.py): groups are contiguous in sorted order and ascend by id, group g
    covers sorted rows [start[g], start[g] + count[g]); entries past the active ids have count 0.
    """
    t, tiles_m = num_tokens, -(-num_tokens // tm)
    ids = meta.active_lora_ids.astype(jnp.int32)
    g_count = ids.shape[0]
    # Step 1: each group's sorted row range among the T tokens this call sees.
    _, lo, hi = token_groups(meta, t)
    # Step 2: live groups: a real slot (never -1, never >= L) with at least one row.
    live_g = (ids >= 0) & (ids < num_slots) & (hi > lo)
    # Step 3: tiles each live group touches: from the tile of its first row to that of its last.
    first_tile = lo // tm
    tiles_g = jnp.where(live_g, (hi - 1) // tm - first_tile + 1, 0)
    ends = jnp.cumsum(tiles_g)
    begins = ends - tiles_g
    total = ends[-1]
    # Step 4: step i -> its group (the g with begins[g] <= i < ends[g]) and its tile. Steps past
    # the total repeat the last real step (same blocks: the pipeline fetches nothing) with live 0.
    steps = jnp.arange(num_steps(t, num_slots, tm), dtype=jnp.int32)
    eff = jnp.minimum(steps, jnp.maximum(total - 1, 0))
    g = jnp.clip(jnp.searchsorted(ends, eff, side="right"), 0, g_count - 1)
    tile = jnp.clip(first_tile[g] + eff - begins[g], 0, tiles_m - 1)
    slot = jnp.clip(ids[g], 0, num_slots - 1)
    live = (steps < total) & live_g[g]
    return Schedule(tile.astype(jnp.int32), slot.astype(jnp.int32), live.astype(jnp.int32))


def num_token_steps(num_tokens: int, num_slots: int, tm: int) -> int:
    """Static length of the token-order schedule: one step per (tile, slot) pair present, at most
    one per token and at most min(L, tm) per tile."""
    tiles_m = -(-num_tokens // tm)
    return max(1, min(num_tokens, tiles_m * min(num_slots, tm)))


def make_token_schedule(idx: jax.Array, num_tokens: int, num_slots: int, tm: int) -> Schedule:
    """The schedule over rows in token order (no sorting): one step per (m-tile, slot) pair that
    occurs, ordered by tile then slot. When each adapter's tokens are contiguous (prefill) this has
    as few steps as the sorted schedule and needs no gather of x or scatter of results.

    idx: (T,) slots with -1 (and anything outside 0..L-1) meaning no LoRA.
    """
    t, tiles_m = num_tokens, -(-num_tokens // tm)
    valid = (idx >= 0) & (idx < num_slots)
    pair = jnp.where(valid, (jnp.arange(t, dtype=jnp.int32) // tm) * num_slots + idx, tiles_m * num_slots)
    present = jnp.zeros(tiles_m * num_slots + 1, jnp.int32).at[pair].set(1)[:-1]
    total = jnp.sum(present)
    cap = num_token_steps(t, num_slots, tm)
    dest = jnp.where(present == 1, jnp.cumsum(present) - 1, cap)
    pairs = jnp.zeros(cap, jnp.int32).at[dest].set(jnp.arange(tiles_m * num_slots, dtype=jnp.int32),
                                                   mode="drop")
    steps = jnp.arange(cap, dtype=jnp.int32)
    chosen = pairs[jnp.minimum(steps, jnp.maximum(total - 1, 0))]
    live = (steps < total).astype(jnp.int32)
    return Schedule(chosen // num_slots, chosen % num_slots, live)


# Grid-step overhead expressed in HBM bytes (about 0.35 us per step at about 1 TB/s), so that the
# choice between the two row orders weighs steps against bytes.
STEP_BYTES = 350_000


@dataclasses.dataclass(frozen=True)
class OrderCost:
    """Static byte counts for choosing the row order (see `choose_token_order`).

    step_weight_bytes: weight bytes a step fetches when its slot differs from the previous step's.
    token_rows_bytes / sorted_rows_bytes: activation bytes each order moves (x or y rows, the
    gather and scatter of the sorted order, the float32 delta round trip of the delta path).
    """

    step_weight_bytes: float
    token_rows_bytes: float
    sorted_rows_bytes: float


def _weight_fetches(sched: Schedule) -> jax.Array:
    """Live steps whose slot differs from the previous step's: the weight blocks actually fetched."""
    prev = jnp.concatenate([jnp.full((1,), -1, jnp.int32), sched.slot[:-1]])
    return jnp.sum((sched.live == 1) & (sched.slot != prev), dtype=jnp.int32)


def choose_token_order(token_sched: Schedule, sorted_sched: Schedule, cost: Optional[OrderCost]) -> jax.Array:
    """Device bool: the token order is estimated to cost no more than the sorted order. Without a
    cost, the one with fewer steps (ties: token order)."""
    if cost is None:
        return _live_steps(token_sched) <= _live_steps(sorted_sched)

    def estimate(sched, rows_bytes):
        return (_weight_fetches(sched).astype(jnp.float32) * cost.step_weight_bytes
                + _live_steps(sched).astype(jnp.float32) * STEP_BYTES + rows_bytes)

    return estimate(token_sched, cost.token_rows_bytes) <= estimate(sorted_sched, cost.sorted_rows_bytes)


def prefers_token_order(meta: LoRAKernelMeta, num_tokens: int, num_slots: int, tm: int,
                        cost: Optional[OrderCost] = None) -> jax.Array:
    """Device bool: whether a kernel with this tiling and cost runs in token order."""
    raw = meta.token_lora_mapping[:num_tokens].astype(jnp.int32)
    idx = jnp.where((raw >= 0) & (raw < num_slots), raw, -1)
    return choose_token_order(make_token_schedule(idx, num_tokens, num_slots, tm),
                              make_schedule(meta, num_tokens, num_slots, tm), cost)


def shrink_order_cost(plan: "ShrinkPlan", x_bytes: int, a_bytes: int) -> OrderCost:
    t, h, tp = plan.num_tokens, plan.hidden, plan.tiles_m * plan.tm
    x_rows = t * h * x_bytes
    padded = 0 if tp == t else x_rows + tp * h * x_bytes
    # sorted: rows DMA'd by the kernel when tk = H, else an XLA gather (read, write, read again)
    sorted_rows = x_rows if plan.tiles_k == 1 and plan.row_dma else 2 * x_rows + 2 * tp * h * x_bytes
    return OrderCost(plan.num_slices * plan.rank * h * a_bytes * plan.tiles_k, x_rows + padded, sorted_rows)


def expand_order_cost(plan: "ExpandPlan", inplace: Optional["ExpandPlan"], b_bytes: int,
                      y_bytes: int, scatter: Optional["ExpandPlan"] = None) -> OrderCost:
    t, n = plan.num_tokens, sum(plan.widths)
    r_hbm = plan.rank if plan.b_layout == "rn" else _round_up(plan.rank, 128)
    delta_path = t * n * (8 + 2 * y_bytes)
    in_place = 2 * t * n * y_bytes
    return OrderCost(n * r_hbm * b_bytes, in_place if inplace is not None else delta_path,
                     in_place if scatter is not None else delta_path)


def _pick_order(row_order: Optional[str], choose: jax.Array, token_fn, sorted_fn):
    """`lax.cond` on the device-side choice, or the forced branch (row_order "token" / "sorted")."""
    if row_order == "token":
        return token_fn()
    if row_order == "sorted":
        return sorted_fn()
    return lax.cond(choose, token_fn, sorted_fn)


def _check_row_order(row_order: Optional[str]) -> None:
    if row_order not in (None, "token", "sorted"):
        raise ValueError(f"row_order must be None (choose per call), 'token' or 'sorted', got {row_order!r}")


def _live_steps(sched: Schedule) -> jax.Array:
    """The grid's step count, a traced int32: only the live steps run (like megablox's
    num_active_tiles); the static schedule length bounds it."""
    return jnp.sum(sched.live, dtype=jnp.int32)


def chunk_slots(sched: Schedule, ranks: jax.Array, rank_chunk: int, chunks: int) -> jax.Array:
    """(chunks * steps,) int32: the slot whose rank chunk c step i's BlockSpec asks for.

    A step whose slot needs chunk c (rank > c * rank_chunk) asks for its own slot's chunk; a step
    whose slot does not asks for the chunk the previous step asked for (so nothing is fetched), and
    steps before the first that needs chunk c ask for that first one's (fetched once, early). Chunks
    past every slot's rank are thus never read, with no extra grid steps."""
    n = sched.slot.shape[0]
    pos = jnp.arange(n, dtype=jnp.int32)
    rank_of_step = ranks[sched.slot]
    out = []
    for c in range(chunks):
        need = (sched.live == 1) & (rank_of_step > c * rank_chunk)
        last = lax.cummax(jnp.where(need, pos, -1))
        first = jnp.argmax(need).astype(jnp.int32)  # 0 when no step needs the chunk
        out.append(sched.slot[jnp.where(last >= 0, last, first)])
    return jnp.concatenate(out).astype(jnp.int32)


def token_groups(meta: LoRAKernelMeta, num_tokens: int):
    """The grouping restricted to tokens 0..T-1: (order (T,), lo (G,), hi (G,)) int32.

    order[p] is the token at sorted row p; group g (active_lora_ids[g]) holds sorted rows
    [lo[g], hi[g]). When the metadata covers exactly T tokens this is its own sorted order and start
    offsets. When it covers more (capacity C > T, e.g. a sampler mapping padded to a bucket), its
    sorted list may hold tokens >= T inside the groups: they are dropped by a stable compaction
    (a prefix sum over the C sorted entries, no sort), so the kernels always work on T rows.
    Values are clamped: a malformed meta cannot make anything read out of bounds.
    """
    t = num_tokens
    sorted_all = meta.token_indices_sorted_by_lora_ids.astype(jnp.int32)
    cap = sorted_all.shape[0]
    g_count = meta.active_lora_ids.shape[0]
    start = meta.lora_token_start_loc[:g_count].astype(jnp.int32)
    end = start + meta.num_tokens_per_lora.astype(jnp.int32)
    if cap == t:
        order = jnp.clip(sorted_all, 0, t - 1)
        return order, jnp.clip(start, 0, t), jnp.clip(end, 0, t)
    keep = (sorted_all >= 0) & (sorted_all < t)
    kept_before = jnp.concatenate([jnp.zeros(1, jnp.int32), jnp.cumsum(keep, dtype=jnp.int32)])
    dest = jnp.where(keep, kept_before[1:] - 1, t)                   # t: dropped by mode="drop"
    order = jnp.zeros(t, jnp.int32).at[dest].set(sorted_all, mode="drop")
    lo = kept_before[jnp.clip(start, 0, cap)]
    hi = jnp.maximum(kept_before[jnp.clip(end, 0, cap)], lo)
    return order, lo, hi


def _sorted_rows(meta: LoRAKernelMeta, num_tokens: int, num_slots: int, padded: int):
    """(order (padded,), position (T,), has_lora (T,), idx (T,)): sorted row p holds token
    order[p] (rows past T hold token 0 and are never stored); token t sits at sorted row
    position[t]; idx is the slot of each token, -1 for none (and for out-of-range values).
    Indices are clamped, so a malformed meta cannot read out of bounds."""
    t = num_tokens
    order = jnp.clip(token_groups(meta, t)[0], 0, t - 1)
    position = jnp.zeros(t, jnp.int32).at[order].set(jnp.arange(t, dtype=jnp.int32))
    raw = meta.token_lora_mapping[:t].astype(jnp.int32)
    has_lora = (raw >= 0) & (raw < num_slots)
    idx = jnp.where(has_lora, raw, -1)
    order = jnp.concatenate([order, jnp.zeros(padded - t, jnp.int32)])
    return order, position, has_lora, idx


def _sorted_slots(idx: jax.Array, order: jax.Array, num_tokens: int) -> jax.Array:
    """The slot of each sorted row; -1 for the padding rows past T."""
    return jnp.where(jnp.arange(order.shape[0]) < num_tokens, jnp.take(idx, order), -1)


def _pad_rows(a: jax.Array, rows: int, value) -> jax.Array:
    """`a` with rows appended up to `rows` (a no-op when it has them)."""
    if a.shape[0] == rows:
        return a
    pad = [(0, rows - a.shape[0])] + [(0, 0)] * (a.ndim - 1)
    return jnp.pad(a, pad, constant_values=value)


def _row_mask(row_slot_ref, slot) -> jax.Array:
    """(tm, 1) bool: the rows of this tile that belong to the step's group."""
    return row_slot_ref[...] == slot


def _placement(r: int, width: int, offset: int, rank) -> jax.Array:
    """(r, width) float32 0/1: column c (c < rank) of a rank block goes to lane offset + c.

    A matmul with it places a slice's (tm, r) result at a static lane offset of a packed tile, and
    its transpose extracts one; both are exact in float32 and lower on every TPU generation (no
    unaligned lane stores)."""
    c = lax.broadcasted_iota(jnp.int32, (r, width), 0)
    lane = lax.broadcasted_iota(jnp.int32, (r, width), 1)
    return ((lane == c + offset) & (c < rank)).astype(jnp.float32)


def _dot(a, b, contract):
    """a @ b in float32; contract = (a_dim, b_dim). bf16 x bf16 goes to the MXU natively; any other
    pair is upcast to float32 at HIGHEST precision."""
    if a.dtype == b.dtype == jnp.bfloat16:
        return lax.dot_general(a, b, ((contract[:1], contract[1:]), ((), ())),
                               preferred_element_type=jnp.float32)
    return lax.dot_general(a.astype(jnp.float32), b.astype(jnp.float32),
                           ((contract[:1], contract[1:]), ((), ())), precision=HIGHEST,
                           preferred_element_type=jnp.float32)


# ----------------------------------------------------------------------------- tiling plans

def _round_up(v: int, m: int) -> int:
    return -(-v // m) * m


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
                uses.append(tpu_rules.BlockUse(f"bias[{s}]", (self.num_slots, 1, width), (None, 1, tn)))
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
            total += (8 * tn * 4 if self.has_bias[s] else 0)
            total += 0 if self.inplace else self.tm * tn * 4
        if self.inplace:  # y in and y out blocks
            total += 2 * self.tm * self.tn[0] * self.y_bytes
        return 2 * total


def plan_expand(num_tokens: int, widths: Sequence[int], rank: int, num_slots: int, lanes: int,
                b_layout: str = "nr", has_bias: Optional[Sequence[bool]] = None, b_bytes: int = 2,
                tm_max: int = 256, tn_max: int = 4096, vmem_budget: int = VMEM_BUDGET,
                chunked: bool = False) -> ExpandPlan:
    """Large column tiles (few re-reads of the buffer) and tm under the VMEM budget: halves the
    widest tile, then tm, until the blocks fit. `chunked` (rank-major B only): 16-row rank blocks."""
    widths = tuple(int(w) for w in widths)
    has_bias = tuple(bool(b) for b in (has_bias or (False,) * len(widths)))
    options = [_lane_divisors(w, tn_max) for w in widths]  # per slice, largest first
    choice = [0] * len(widths)
    tm = _pick_tm(num_tokens, num_slots, tm_max)

    def make():
        return ExpandPlan(num_tokens, widths, rank, num_slots, lanes, tm,
                          tuple(o[c] for o, c in zip(options, choice)), b_layout, has_bias,
                          rank_chunk=rank_chunk_for(rank, chunked and b_layout == "rn"))

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
                 ) -> Optional[ExpandPlan]:
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


def _compiler_params(vmem_bytes: int) -> "pltpu.CompilerParams":
    """Sequential grid ("arbitrary": output tiles are revisited by consecutive steps). A plan that
    cannot fit VMEM_BUDGET (a slice width with no 128-multiple divisor, e.g. an odd vocabulary)
    raises the scoped-VMEM limit instead, up to 96 MiB of the 128 MiB of v5e / v6e."""
    limit = None
    if vmem_bytes > VMEM_BUDGET:
        limit = min(96 * 2**20, int(vmem_bytes * 1.25) + 4 * 2**20)
    return pltpu.CompilerParams(dimension_semantics=("arbitrary", "arbitrary"), vmem_limit_bytes=limit)


# ----------------------------------------------------------------------------- shrink kernel

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
                part = _dot(x, a_refs[s * chunks + c][...], (1, 1))              # (tm, rc)
                total += _dot(part, _placement(rc, lanes, s * rank + c * rc, slot_rank - c * rc), (1, 0))
        acc_ref[...] = total

    @pl.when(live & (k == tiles_k - 1))
    def _store():
        rows = _row_mask(row_slot_ref, slot_ref[i])
        out_ref[...] = jnp.where(rows, acc_ref[...], out_ref[...])


def _rows_dma(row_tok_ref, tile, tm: int, wait: bool, make_copy) -> None:
    """For each of the tile's tm rows whose token (row_tok_ref[tile * tm + row]) is real (>= 0),
    start -- or, with wait, wait for -- the row's DMA `make_copy(tok, row)`."""
    def body(row, carry):
        tok = row_tok_ref[tile * tm + row]

        @pl.when(tok >= 0)
        def _():
            copy = make_copy(tok, row)
            if wait:
                copy.wait()
            else:
                copy.start()
        return carry
    lax.fori_loop(0, tm, body, 0)


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
                part = _dot(x, a_refs[s * chunks + c][...], (1, 1))
                total += _dot(part, _placement(rc, lanes, s * rank + c * rc, slot_rank - c * rc), (1, 0))
        rows = _row_mask(row_slot_ref, slot_ref[i])
        out_ref[...] = jnp.where(rows, total, out_ref[...])


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


class _Rows(NamedTuple):
    """Both row orders of one call: what the branches of the `lax.cond` need."""

    order: jax.Array  # (tp,) token at each sorted row
    position: jax.Array  # (T,) sorted row of each token
    has_lora: jax.Array  # (T,) bool
    idx: jax.Array  # (T,) slot or -1
    token_sched: Schedule
    sorted_sched: Schedule


def _rows(meta: LoRAKernelMeta, num_tokens: int, num_slots: int, tm: int, padded: int) -> _Rows:
    order, position, has_lora, idx = _sorted_rows(meta, num_tokens, num_slots, padded)
    return _Rows(order, position, has_lora, idx, make_token_schedule(idx, num_tokens, num_slots, tm),
                 make_schedule(meta, num_tokens, num_slots, tm))


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


def _shrink_call(x, lora_a, meta, scale, ranks, *, plan: ShrinkPlan, row_order, interpret):
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
    packed = jnp.where(rows.has_lora[:, None, None], packed * scale, 0.0)
    return jnp.transpose(packed, (1, 0, 2))


_shrink_call = _two_jits(_shrink_call, ("plan", "row_order", "interpret"))


def shrink(x: jax.Array, lora_a: Sequence[jax.Array], meta: LoRAKernelMeta, scale: float,
           lora_ranks=None, *, tm_max: int = 256, tk_max: int = 8192,
           row_order: Optional[str] = None, row_dma: bool = True) -> jax.Array:
    """x (T, H); lora_a: S arrays (L, r, H), one (L, r) shape -> (S, T, r) float32.

    buf[s, t] = scale * x[t] @ lora_a[s][idx[t]].T, zero rows where idx[t] is -1 or out of range.
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
    return _shrink_call(x, tuple(lora_a), meta, jnp.float32(scale), ranks, plan=plan, row_order=row_order,
                        interpret=current_interpret())


def _ranks_or_full(lora_ranks, num_slots: int, rank: int) -> jax.Array:
    if lora_ranks is None:
        return jnp.full((num_slots,), rank, jnp.int32)
    return jnp.clip(jnp.asarray(lora_ranks, jnp.int32)[:num_slots], 0, rank)


# ----------------------------------------------------------------------------- expand kernel

def _slice_delta(plan: ExpandPlan, s: int, buf_ref, b_refs, bias_ref, slot_rank):
    """(tm, tn) float32: extract_s(buf_tile) @ B_s[slot].T (+ bias), summed over B's rank chunks;
    a chunk past the slot's rank (another slot's rows, its fetch skipped) is masked out."""
    delta = None
    for c in range(plan.chunks):
        extract = _placement(plan.rc, plan.lanes, s * plan.rank + c * plan.rc, slot_rank - c * plan.rc)
        part = _dot(buf_ref[...], extract, (1, 1))                                   # (tm, rc)
        d = _dot(part, b_refs[c][...], (1, 1) if plan.b_layout == "nr" else (1, 0))  # (tm, tn)
        delta = d if delta is None else delta + d
    if bias_ref is not None:
        delta = delta + bias_ref[...].astype(jnp.float32)
    return delta


def _expand_kernel(tile_ref, slot_ref, live_ref, rank_ref, chunk_slot_ref, row_slot_ref, buf_ref, *refs,
                   plan: ExpandPlan):
    """Grid (j, i): for the slice s owning column tile j,
    delta_s[tile rows, tile cols] = extract_s(buf_tile) @ B_s[slot].T (+ bias_s[slot]), group rows only."""
    s_count = len(plan.widths)
    ins, k = [], 0  # per slice: (B chunk refs, bias ref or None)
    for s in range(s_count):
        ins.append((refs[k:k + plan.chunks], refs[k + plan.chunks] if plan.has_bias[s] else None))
        k += plan.chunks + plan.has_bias[s]
    outs = refs[k:k + s_count]
    j, i = pl.program_id(0), pl.program_id(1)
    live = live_ref[i] == 1
    base, tiles_n = plan.tile_base, plan.tiles_n

    for s in range(s_count):
        mine = (j >= base[s]) & (j < base[s] + tiles_n[s])

        @pl.when(live & mine)
        def _compute(s=s):
            delta = _slice_delta(plan, s, buf_ref, ins[s][0], ins[s][1], rank_ref[slot_ref[i]])
            out_ref = outs[s]
            rows = _row_mask(row_slot_ref, slot_ref[i])
            out_ref[...] = jnp.where(rows, delta, out_ref[...])


def _expand_inplace_kernel(tile_ref, slot_ref, live_ref, rank_ref, chunk_slot_ref, col0_ref, row_slot_ref,
                           buf_ref, *refs, plan: ExpandPlan, add_inputs: bool):
    """Token order, y aliased in and out: on the first step of an m-tile copy the y block, then
    each group writes its rows: y = cast((y if add_inputs else 0) + buf @ B.T + bias), once."""
    s_count = len(plan.widths)
    ins, k = [], 0  # per slice: (B chunk refs, bias ref or None)
    for s in range(s_count):
        ins.append((refs[k:k + plan.chunks], refs[k + plan.chunks] if plan.has_bias[s] else None))
        k += plan.chunks + plan.has_bias[s]
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
            delta = _slice_delta(plan, s, buf_ref, ins[s][0], ins[s][1], rank_ref[slot_ref[i]])
            if add_inputs:
                delta = delta + y_in[...].astype(jnp.float32)
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
    y = cast((y if add_inputs else 0) + buf @ B.T + bias); on the tile's last step the rows are
    DMA'd back. Only tokens with a LoRA are read or written."""
    s_count, tm, tn = len(plan.widths), plan.tm, plan.tn[0]
    ins, k = [], 0
    for s in range(s_count):
        ins.append((refs[k:k + plan.chunks], refs[k + plan.chunks] if plan.has_bias[s] else None))
        k += plan.chunks + plan.has_bias[s]
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
            delta = _slice_delta(plan, s, buf_ref, ins[s][0], ins[s][1], rank_ref[slot_ref[i]])
            if add_inputs:
                delta = delta + ybuf[...].astype(jnp.float32)
            rows = _row_mask(row_slot_ref, slot_ref[i])
            ybuf[...] = jnp.where(rows, delta.astype(ybuf.dtype), ybuf[...])

    @pl.when(last)
    def _scatter():
        rows_dma(True, False)
        rows_dma(True, True)


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
    bias: Optional[tuple]  # None or S entries of None / (L, n_s)
    offsets: jax.Array  # (S,) int32 column offsets of the slices in y
    add_inputs: bool
    interpret: object  # False or pltpu.InterpretParams


def _delta_blocks(plan: ExpandPlan, lora_b, bias):
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
        out_specs.append(pl.BlockSpec((tm, tn), out_map))
        out_shapes.append(jax.ShapeDtypeStruct((tp, width), jnp.float32))
    return in_specs, operands, out_specs, out_shapes


def _run_delta(args: _ExpandOperands, plan: ExpandPlan, blocks, sched: Schedule, row_slot, rows_buf) -> tuple:
    """The delta kernel over rows in the order of `sched`: S float32 (tp, n_s) deltas, only the rows
    of scheduled groups written. blocks: `_delta_blocks(plan, ...)`."""
    in_specs, operands, out_specs, out_shapes = blocks
    r, tp, n_total = plan.rank, plan.tiles_m * plan.tm, sum(plan.widths)
    b_item = args.lora_b[0].dtype.itemsize
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


def _add_deltas(args: _ExpandOperands, plan: ExpandPlan, has_lora, deltas) -> jax.Array:
    """The delta path's XLA epilogue: y[:, slice s] = cast((y if add_inputs else 0) + deltas[s])
    in float32 with one cast; rows without LoRA keep y. deltas: S (T, n_s) in token order."""
    out = args.y
    for s in range(len(plan.widths)):
        width = plan.widths[s]
        old = lax.dynamic_slice_in_dim(out, args.offsets[s], width, axis=1)
        new = deltas[s]
        if args.add_inputs:
            new = new + old.astype(jnp.float32)
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
                   inplace: Optional[ExpandPlan], scatter: Optional[ExpandPlan], add_inputs: bool, interpret):
    """(token-order fn, sorted-order fn): each takes the packed (tp, P) rank rows in its own order
    and returns the new y.

    Token order updates y in place by blocks when `inplace` is given, sorted order by row DMAs when
    `scatter` is given; otherwise either runs the delta kernel and the XLA epilogue adds the deltas."""
    args = _ExpandOperands(lora_b, y, ranks, bias, offsets, add_inputs, interpret)
    t, tp = plan.num_tokens, plan.tiles_m * plan.tm
    blocks = _delta_blocks(plan, lora_b, bias)  # traced here, outside the branches that share it

    def token_order(packed_rows):
        row_slot = _pad_rows(rows.idx, tp, -1)
        if inplace is not None:
            return _run_inplace(args, plan, inplace, rows.token_sched, row_slot, packed_rows)
        deltas = _run_delta(args, plan, blocks, rows.token_sched, row_slot, packed_rows)
        return _add_deltas(args, plan, rows.has_lora, tuple(d[:t] for d in deltas))

    def sorted_order(packed_rows):
        row_slot = _sorted_slots(rows.idx, rows.order, t)
        if scatter is not None:
            return _run_scatter(args, plan, scatter, rows.sorted_sched, rows.order, row_slot, packed_rows)
        deltas = _run_delta(args, plan, blocks, rows.sorted_sched, row_slot, packed_rows)
        return _add_deltas(args, plan, rows.has_lora, tuple(jnp.take(d, rows.position, axis=0) for d in deltas))

    return token_order, sorted_order


def _expand_call(buf, lora_b, y, meta, ranks, bias, offsets, *, plan: ExpandPlan,
                 inplace: Optional[ExpandPlan], scatter: Optional[ExpandPlan], add_inputs, row_order, interpret):
    t, r, s_count = plan.num_tokens, plan.rank, len(plan.widths)
    tp = plan.tiles_m * plan.tm
    rows = _rows(meta, t, plan.num_slots, plan.tm, tp)
    # Pack the S rank blocks side by side in the lanes (small: T x P float32).
    packed = jnp.transpose(buf.astype(jnp.float32), (1, 0, 2)).reshape(t, s_count * r)
    packed = jnp.pad(packed, ((0, 0), (0, plan.lanes - s_count * r)))
    token_order, sorted_order = _expand_orders(lora_b, y, ranks, bias, offsets, rows, plan, inplace,
                                               scatter, add_inputs, interpret)
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
           allow_inplace: bool = True, row_order: Optional[str] = None, row_dma: bool = True) -> jax.Array:
    """buf (S, T, r); lora_b: S arrays (L, n_s, r) (or (L, r, n_s) with b_layout="rn");
    y (T, N); offsets: S column offsets (slices inside y); bias: None or S entries of None / (L, n_s).

    Returns the new y: y[t, off_s:off_s+n_s] = (y[...] if add_inputs else 0) + buf[s, t] @ B_s[idx[t]].T
    + bias_s[idx[t]], accumulated in float32 and cast once; rows with idx -1 and columns outside
    the slices unchanged. One pallas_call covers all slices. When the slices sit on 128-column
    boundaries and T is a multiple of the row tile, the token-order path updates y in place in the
    kernel (`plan_inplace`); otherwise the kernel writes a float32 delta that XLA adds to y.
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
        if b.shape[0] != num_slots or b_rank != r or b.dtype != lora_b[0].dtype:
            raise ValueError(f"lora_b[{s}] has shape {b.shape} dtype {b.dtype}; expected {num_slots} "
                             f"slots, rank {r} in layout {b_layout!r}, dtype {lora_b[0].dtype}")
        if not 0 <= int(offsets[s]) <= y.shape[1] - width:
            raise ValueError(f"slice {s} (offset {offsets[s]}, width {width}) falls outside y's "
                             f"{y.shape[1]} columns")
        widths.append(width)
    has_bias = tuple(bias is not None and bias[s] is not None for s in range(s_count))
    plan = plan_expand(t, widths, r, num_slots, _round_up(s_count * r, 128), b_layout, has_bias,
                       lora_b[0].dtype.itemsize, tm_max=tm_max, tn_max=tn_max,
                       chunked=lora_ranks is not None)
    tpu_rules.check_blocks(plan.block_uses())
    inplace, scatter = _inplace_plans(plan, offsets, y, tn_max) if allow_inplace else (None, None)
    scatter = scatter if row_dma else None
    ranks = _ranks_or_full(lora_ranks, num_slots, r)
    bias_t = None if bias is None else tuple(bias)
    return _expand_call(buf, tuple(lora_b), y, meta, ranks, bias_t,
                        jnp.asarray([int(o) for o in offsets], jnp.int32), plan=plan, inplace=inplace,
                        scatter=scatter,
                        add_inputs=bool(add_inputs), row_order=row_order, interpret=current_interpret())


def _linear_call(y, x, lora_a, lora_b, meta, scale, ranks, bias, offsets, *, splan: ShrinkPlan,
                 eplan: ExpandPlan, inplace: Optional[ExpandPlan], scatter: Optional[ExpandPlan], row_order,
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
           row_order: Optional[str] = None, row_dma: bool = True) -> jax.Array:
    """add_lora_linear's math in one program: y[t, slice s] += (scale * x[t] @ A_s[idx].T) @ B_s[idx].T
    + bias_s[idx] (float32, one cast), rows with idx -1 and other columns untouched.

    Shrink and expand share one row order (one `lax.cond`) and the packed rank rows pass between
    them in that order. The wrapper calls it when no shrink buffer is requested. row_order: None
    (chosen per call on the device), or force "token" / "sorted" (for measurements). row_dma:
    False replaces the sorted order's row DMAs by XLA gathers and a float32 delta.
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
    has_bias = tuple(bias is not None and bias[s] is not None for s in range(len(lora_b)))
    splan = plan_shrink(t, h, s_count, r, num_slots, x_item, a_item, tm_max=tm_max, tk_max=tk_max,
                        chunked=chunked, row_dma=row_dma)
    eplan = plan_expand(t, widths, r, num_slots, splan.lanes, b_layout, has_bias, lora_b[0].dtype.itemsize,
                        tm_max=splan.tm, tn_max=tn_max, chunked=chunked)
    if eplan.tm != splan.tm:
        splan = plan_shrink(t, h, s_count, r, num_slots, x_item, a_item, tm_max=eplan.tm, tk_max=tk_max,
                            chunked=chunked, row_dma=row_dma)
    if eplan.tm != splan.tm or len(lora_b) != s_count:  # no common row tile: two calls
        buf = shrink(x, lora_a, meta, scale, lora_ranks, tm_max=tm_max, tk_max=tk_max, row_order=row_order,
                     row_dma=row_dma)
        return expand(buf, lora_b, y, meta, offsets, True, lora_ranks, bias, b_layout=b_layout,
                      tm_max=tm_max, tn_max=tn_max, row_order=row_order, row_dma=row_dma)
    for s, b in enumerate(lora_b):
        if not 0 <= int(offsets[s]) <= y.shape[1] - widths[s]:
            raise ValueError(f"slice {s} (offset {offsets[s]}, width {widths[s]}) falls outside y's "
                             f"{y.shape[1]} columns")
    tpu_rules.check_blocks(splan.block_uses())
    tpu_rules.check_blocks(eplan.block_uses())
    inplace, scatter = _inplace_plans(eplan, offsets, y, tn_max)
    scatter = scatter if row_dma else None
    ranks = _ranks_or_full(lora_ranks, num_slots, r)
    return _linear_call(y, x, tuple(lora_a), tuple(lora_b), meta, jnp.float32(scale), ranks,
                        None if bias is None else tuple(bias),
                        jnp.asarray([int(o) for o in offsets], jnp.int32), splan=splan, eplan=eplan,
                        inplace=inplace, scatter=scatter, row_order=row_order, interpret=current_interpret())


def transpose_lora_b(lora_b: Sequence[jax.Array]) -> tuple:
    """(L, n, r) -> (L, r, n) per slice: the lane-dense layout for `expand(..., b_layout="rn")`.

    Do it once when adapters are loaded, not per step (it reads every slot)."""
    return tuple(jnp.swapaxes(b, 1, 2) for b in lora_b)

