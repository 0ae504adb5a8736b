"""Grid schedules and the two row orders: which (m-tile, slot) each grid step works on, and which
order a call runs.

`make_schedule` gives the sorted order's schedule (rows grouped by adapter), `make_token_schedule`
the token order's (rows as they come); `_rows` builds both for one call, with the index arrays the
kernels need. The invariants of a schedule are on `Schedule` and in the package docstring (steps
1-3). `choose_token_order` picks the order estimated cheaper, on the device (no host sync), from an
`OrderCost` (`plans.shrink_order_cost` / `plans.expand_order_cost`).

Heterogeneous ranks (`lora_ranks`): A, and B when stored rank-major, are passed as 16-row rank
chunks, one BlockSpec per chunk. `chunk_slots` gives each chunk's index map the step's own slot
when that slot's rank reaches the chunk and otherwise the slot it asked for before, so a chunk
past a slot's rank is never fetched and no grid step is added; the placement matrices mask what a
skipped chunk holds.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from ...meta import LoRAKernelMeta


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


# ----------------------------------------------------------------------------------- row orders

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


# ----------------------------------------------------------------------- choosing the row order

# Grid-step overhead expressed in HBM bytes (the fixed cost of a grid step, tpu_cost.STEP_OVERHEAD_S,
# times the HBM bandwidth of the TPUs targeted, rounded), so that the choice between the two row
# orders weighs steps against bytes.
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


def choose_token_order(token_sched: Schedule, sorted_sched: Schedule, cost: OrderCost | None) -> jax.Array:
    """Device bool: the token order is estimated to cost no more than the sorted order. Without a
    cost, the one with fewer steps (ties: token order)."""
    if cost is None:
        return _live_steps(token_sched) <= _live_steps(sorted_sched)

    def estimate(sched, rows_bytes):
        return (_weight_fetches(sched).astype(jnp.float32) * cost.step_weight_bytes
                + _live_steps(sched).astype(jnp.float32) * STEP_BYTES + rows_bytes)

    return estimate(token_sched, cost.token_rows_bytes) <= estimate(sorted_sched, cost.sorted_rows_bytes)


def prefers_token_order(meta: LoRAKernelMeta, num_tokens: int, num_slots: int, tm: int,
                        cost: OrderCost | None = None) -> jax.Array:
    """Device bool: whether a kernel with this tiling and cost runs in token order."""
    raw = meta.token_lora_mapping[:num_tokens].astype(jnp.int32)
    idx = jnp.where((raw >= 0) & (raw < num_slots), raw, -1)
    return choose_token_order(make_token_schedule(idx, num_tokens, num_slots, tm),
                              make_schedule(meta, num_tokens, num_slots, tm), cost)


def _pick_order(row_order: str | None, choose: jax.Array, token_fn, sorted_fn):
    """`lax.cond` on the device-side choice, or the forced branch (row_order "token" / "sorted")."""
    if row_order == "token":
        return token_fn()
    if row_order == "sorted":
        return sorted_fn()
    return lax.cond(choose, token_fn, sorted_fn)


def _check_row_order(row_order: str | None) -> None:
    if row_order not in (None, "token", "sorted"):
        raise ValueError(f"row_order must be None (choose per call), 'token' or 'sorted', got {row_order!r}")
