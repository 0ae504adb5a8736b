"""The fused kernel: shrink and expand in one launch, for decode sizes.

Math: expand(shrink(x)) with add_inputs (contract section 4, `add_lora_linear`):

  y[t, off_s:off_s+n_s] += (scale * x[t] @ A_s[idx[t]].T) @ B_s[idx[t]].T + bias_s[idx[t]]

The programs of one token tile compute the rank-sized intermediate into a float32 workspace,
meet at a per-tile barrier (one int32 counter per tile, zeroed once, reused by every launch),
then write their output tiles. Grid and meta-parameters: `plan_fused`; arguments:
`arguments.fused_call`.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

import triton
import triton.language as tl

from .common import (
    channel_scaled,
    gdc_launch_dependents,
    gdc_wait,
    hint16,
    load_rank_cols,
    pick_slice,
    prefetch_rows,
    rank_dot,
    shrink_tile,
    slice_of_tile,
    slot_rank,
    store_slice,
    token_tile,
    weight_operand,
    y_tile,
)
from .expand import ExpandPlan
from .planning import (
    MAX_SLICES,
    TOKEN_COUNT_PARAMS,
    cast_and_precision,
    check_dot_dims,
    dot_dtype,
    epilogue_constexprs,
    hidden_split,
    interpreting,
    max_tiles,
    next_pow2,
    prefetch_constexprs,
    small_t_block,
)

BARRIER_SPAN = tl.constexpr(1 << 20)  # what one launch adds to a token tile's barrier counter (> programs per tile)


# Polls after which a waiting program gives up with a `trap` (a CUDA error instead of a hang): each
# poll is an L2 round trip, so 2^24 polls take seconds, far beyond any legitimate wait (a tile's
# programs arrive within microseconds unless the GPU could not make them co-resident).
BARRIER_POLL_LIMIT = 1 << 24


@triton.jit
def _trap():
    """Aborts the kernel with an error (PTX `trap`): the launch fails, the host sees a CUDA error."""
    tl.inline_asm_elementwise("trap; mov.u32 $0, 0;", "=r", [], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _row_barrier(sync_ptr, first, num_programs, WAIT: tl.constexpr, POLL_LIMIT: tl.constexpr):
    """Barrier of the `num_programs` programs sharing the int32 counter at sync_ptr (one atomic each).

    Every launch adds exactly BARRIER_SPAN to the counter -- program `first` adds
    BARRIER_SPAN - (num_programs - 1), the others 1 -- so between launches it is a multiple of
    BARRIER_SPAN (0 when allocated; 32-bit wrap-around keeps that, BARRIER_SPAN being a power of
    two), and every program of a launch sees, as the value before its own add, one in
    [base, base + BARRIER_SPAN): the launch is complete when the counter reaches base +
    BARRIER_SPAN. acq_rel add / acquire polls at GPU scope: every store before the barrier is
    visible after it. WAIT=False (interpreter's first phase): arrive only. A program still waiting
    after POLL_LIMIT polls traps (`_trap`): a barrier that cannot complete (programs of a tile not
    co-resident, a counter written by someone else) fails the launch instead of hanging the GPU."""
    inc = tl.where(first, BARRIER_SPAN - num_programs + 1, 1)
    ticket = tl.atomic_add(sync_ptr, inc, sem="acq_rel", scope="gpu")
    target = (ticket & (-BARRIER_SPAN)) + BARRIER_SPAN
    if WAIT:
        polls = 0
        seen = tl.atomic_add(sync_ptr, 0, sem="acquire", scope="gpu")
        while (seen != target) & (polls < POLL_LIMIT):
            polls += 1
            seen = tl.atomic_add(sync_ptr, 0, sem="acquire", scope="gpu")
        if seen != target:
            _trap()


@triton.jit
def _fused_pairs_shrink(x_ptr, a_ptr, as_ptr, ranks_ptr, pair_slots_ptr, pair_weights_ptr, ws_ptr, group, tok, tok_ok,
                        split, s_in, scale, k_begin, k_end, hidden, stride_x_token, stride_x_hidden, stride_a_slot,
                        stride_a_rank, stride_a_hidden, stride_as_slot, stride_ws_plane, stride_ws_slice,
                        stride_ws_token,
                        RANK: tl.constexpr, HAS_RANKS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
                        BLOCK_R: tl.constexpr, CAST_FP32: tl.constexpr, DOT_PRECISION: tl.constexpr,
                        PAIRS: tl.constexpr):
    """Step 1 with adapter pairs: ws[split, s_in, t, j*RANK + c] = w[t, j] * scale * x[t, chunk] @
    A[slot_j, c, chunk].T for every pair j of the tile's group (zeros for an empty pair), times
    a_scale[slot_j, c] for fp8 A."""
    offs_r = tl.arange(0, BLOCK_R)
    ws0 = (ws_ptr + split.to(tl.int64) * stride_ws_plane + s_in * stride_ws_slice + tok[:, None] * stride_ws_token
           + offs_r[None, :])
    for j in tl.static_range(PAIRS):
        slot = tl.load(pair_slots_ptr + group * PAIRS + j)
        has_pair = slot >= 0
        slot = tl.where(has_pair, slot, 0)
        rank = slot_rank(ranks_ptr, slot, has_pair, RANK, HAS_RANKS)
        acc = shrink_tile(x_ptr, a_ptr, tok, tok_ok, slot, rank, k_begin, tl.where(has_pair, k_end, k_begin), hidden,
                          stride_x_token, stride_x_hidden, stride_a_slot, stride_a_rank, stride_a_hidden,
                          BLOCK_M, BLOCK_K, BLOCK_R, CAST_FP32, DOT_PRECISION)
        acc = channel_scaled(acc, a_ptr, as_ptr, slot, stride_as_slot, offs_r, offs_r < RANK)
        w = scale * tl.load(pair_weights_ptr + tok * PAIRS + j, mask=tok_ok, other=0.0).to(tl.float32)[:, None]
        tl.store(ws0 + j * RANK, acc * w, mask=tok_ok[:, None] & (offs_r < RANK)[None, :])


@triton.jit
def _fused_pairs_out(b_ptr, bs_ptr, ranks_ptr, pair_slots_ptr, ws_ptr, group, tok, tok_ok, cols, col_ok, s_out, y_old,
                     out_ptr, y_offs, write, stride_b_slot, stride_b_col, stride_b_rank, stride_bs_slot,
                     stride_ws_plane, stride_ws_slice,
                     stride_ws_token, RANK: tl.constexpr, HAS_RANKS: tl.constexpr, SPLIT_K: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, CAST_FP32: tl.constexpr,
                     DOT_PRECISION: tl.constexpr, PAIRS: tl.constexpr):
    """Step 3 with adapter pairs: the output tile's y + sum_j (sum_p ws[p, s_out, t, j*RANK:]) @
    B[slot_j, cols].T over the tile's pairs (fp8 B: each pair's product times b_scale[slot_j, cols]),
    one float32 accumulator, one store (no epilogue)."""
    offs_r = tl.arange(0, BLOCK_R)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for j in tl.static_range(PAIRS):
        slot = tl.load(pair_slots_ptr + group * PAIRS + j)
        has_pair = slot >= 0
        slot = tl.where(has_pair, slot, 0)
        rank = slot_rank(ranks_ptr, slot, has_pair, RANK, HAS_RANKS)
        bt = weight_operand(load_rank_cols(b_ptr + slot.to(tl.int64) * stride_b_slot + cols[:, None] * stride_b_col
                                           + offs_r[None, :] * stride_b_rank, col_ok, offs_r, rank, RANK, HAS_RANKS,
                                           True), out_ptr, CAST_FP32)
        lhs = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
        for p in tl.static_range(SPLIT_K):
            lhs += tl.load(ws_ptr + p * stride_ws_plane + s_out * stride_ws_slice + tok[:, None] * stride_ws_token
                           + (j * RANK + offs_r)[None, :], mask=tok_ok[:, None] & (offs_r < rank)[None, :],
                           other=0.0, cache_modifier=".cg")
        if b_ptr.dtype.element_ty.is_fp8():
            acc += channel_scaled(rank_dot(tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32), lhs, bt, CAST_FP32,
                                           DOT_PRECISION), b_ptr, bs_ptr, slot, stride_bs_slot, cols, col_ok)
        else:
            acc = rank_dot(acc, lhs, bt, CAST_FP32, DOT_PRECISION)
    store_slice(acc, y_old, out_ptr, y_offs, write, b_ptr, group, cols, col_ok, 0, 0, 0, False)


@triton.jit(do_not_specialize_on_alignment=TOKEN_COUNT_PARAMS)
def lora_fused_kernel(
        # pointers: x, A per slice, B per slice, their fp8 channel scales per slice, the epilogue
        # vector per slice, the per-slot ranks, the adapter pairs (slots, weights)
        x_ptr, a0_ptr, a1_ptr, a2_ptr, a3_ptr, b0_ptr, b1_ptr, b2_ptr, b3_ptr,
        as0_ptr, as1_ptr, as2_ptr, as3_ptr, bs0_ptr, bs1_ptr, bs2_ptr, bs3_ptr,
        bias0_ptr, bias1_ptr, bias2_ptr, bias3_ptr, ranks_ptr, pair_slots_ptr, pair_weights_ptr,
        # pointers: the metadata, KernelMeta's index arrays in its order; then y, the barrier
        # counters and the float32 workspace
        mapping_ptr, sorted_ptr, counts_ptr, starts_ptr, active_ptr, y_ptr, sync_ptr, ws_ptr,
        # scale and sizes
        scale, num_tokens, hidden, num_sorted, num_slots,
        # strides: x, then A per slice (slot, rank, hidden)
        stride_x_token, stride_x_hidden,
        stride_a0_slot, stride_a0_rank, stride_a0_hidden,
        stride_a1_slot, stride_a1_rank, stride_a1_hidden,
        stride_a2_slot, stride_a2_rank, stride_a2_hidden,
        stride_a3_slot, stride_a3_rank, stride_a3_hidden,
        # strides: B per slice (slot, col, rank)
        stride_b0_slot, stride_b0_col, stride_b0_rank,
        stride_b1_slot, stride_b1_col, stride_b1_rank,
        stride_b2_slot, stride_b2_col, stride_b2_rank,
        stride_b3_slot, stride_b3_col, stride_b3_rank,
        # strides: the channel scales of A, then of B, per slice (slot; channels contiguous)
        stride_as0_slot, stride_as1_slot, stride_as2_slot, stride_as3_slot,
        stride_bs0_slot, stride_bs1_slot, stride_bs2_slot, stride_bs3_slot,
        # strides: the epilogue vector per slice (slot, col)
        stride_bias0_slot, stride_bias0_col, stride_bias1_slot, stride_bias1_col,
        stride_bias2_slot, stride_bias2_col, stride_bias3_slot, stride_bias3_col,
        # sizes per slice: its width, its first column in y
        width0, width1, width2, width3, offset0, offset1, offset2, offset3,
        # strides: y (token, col), the workspace (plane, slice, token)
        stride_y_token, stride_y_col, stride_ws_plane, stride_ws_slice, stride_ws_token,
        # the output pointer (y itself)
        out_ptr,
        # meta-parameters
        RANK: tl.constexpr, NUM_SLICES: tl.constexpr, SPLIT_K: tl.constexpr, SPLIT_P2: tl.constexpr,
        K_PER_SPLIT: tl.constexpr, WS_GROUP: tl.constexpr,
        NUM_TILES: tl.constexpr, NT1: tl.constexpr, NT2: tl.constexpr, NT3: tl.constexpr,
        BIAS0: tl.constexpr, BIAS1: tl.constexpr, BIAS2: tl.constexpr, BIAS3: tl.constexpr,
        ADD_INPUTS: tl.constexpr, HAS_RANKS: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr,
        NUM_GROUPS: tl.constexpr, GROUPS_P2: tl.constexpr, PHASE: tl.constexpr,
        CAST_FP32: tl.constexpr, DOT_PRECISION: tl.constexpr, ALIGNED: tl.constexpr,
        SMALL_T: tl.constexpr, USE_PDL: tl.constexpr, PREFETCH_LINES: tl.constexpr,
        PREFETCH_LINE: tl.constexpr, BARRIER_POLLS: tl.constexpr, B_SELECT: tl.constexpr, PAIRS: tl.constexpr):
    """y[t, off_s + n] = (y if ADD_INPUTS else 0) + (scale * x[t] @ A_s[idx].T) @ B_s[idx, n].T + bias.

    One launch, grid (P, token tiles): the P programs of a token tile share its work and meet once.
      1. Program p < NUM_SLICES * SPLIT_K computes the shrink of slice p % NUM_SLICES over hidden
         chunk p // NUM_SLICES (K_PER_SPLIT columns) into plane p // NUM_SLICES of the float32
         workspace ws (SPLIT_K, NUM_SLICES, T, RANK); program p < NUM_TILES first loads what its
         output tile p needs besides the shrink (its B tile, before the PDL wait; its y tile,
         after it), so those loads overlap the shrink.
      2. All P programs of the tile meet at a barrier (`_row_barrier`: one int32 counter per
         token tile at sync_ptr, zeroed once when allocated, one atomic add per program).
      3. Program p < NUM_TILES sums its slice's SPLIT_K planes and writes output tile p.
    The barrier needs the P programs of a tile resident together. They are consecutive blocks of
    the grid (P <= a few hundred, far below what the GPU holds at once), and the GPU dispatches
    blocks in order, so the programs of earlier tiles are all resident and finish first. A
    cooperative launch would guarantee it, but the driver refuses one whose whole grid cannot be
    co-resident (large decode grids are refused): the launchers
    ask for it only when told to (FusedPlan.cooperative). The interpreter runs programs one after
    another, so it launches twice: PHASE 1 (steps 1-2 without waiting), PHASE 2 (step 3); PHASE 0
    (compiled) does everything in one launch. Needs BLOCK_R >= RANK (one rank block).
    USE_PDL: launched as a programmatic dependent of the kernel before it, waiting for it before
    reading x and y (metadata and weights are read, or prefetched, before: as in the shrink).
    PAIRS > 0 (several adapters per token, contract section 10; the metadata's ids are group ids):
    step 1 computes each pair j's weighted shrink (slot pairs.slots[group, j], weight
    pairs.weights[t, j]) into the workspace's rank columns j*RANK.., step 3 sums every pair's
    product through its own B (`_fused_pairs_shrink`, `_fused_pairs_out`); PAIRS == 0 compiles
    none of it.
    fp8 (e4m3) A / B (each of one dtype over the launch's slices): tiles enter the dots in x's
    dtype (`weight_operand`); step 1 multiplies its float32 partial by a_scale[slot, c] (per split:
    the scale distributes over the planes' sum), step 3 its product by b_scale[slot, cols], each
    once per tile; 16-bit weights compile none of it.
    """
    p = tl.program_id(0)
    row = tl.program_id(1)
    # Before waiting for the kernel before (USE_PDL): the metadata, the B tile (registers) and the
    # A chunk (L2 prefetch); x and y only after.
    lora_id, tok, tok_ok, n_tok = token_tile(row, mapping_ptr, sorted_ptr, counts_ptr, starts_ptr, active_ptr,
                                        num_slots, num_tokens, num_sorted, BLOCK_M, NUM_GROUPS, GROUPS_P2,
                                        True, SMALL_T)
    busy = n_tok > 0
    lora_id = tl.where(busy, lora_id, 0)
    if PAIRS == 0:
        rank = slot_rank(ranks_ptr, lora_id, busy, RANK, HAS_RANKS)
    else:
        rank = 0                                 # per pair (`_fused_pairs_shrink`, `_fused_pairs_out`)
    offs_r = tl.arange(0, BLOCK_R)
    stride_ws_token = hint16(stride_ws_token, ALIGNED)
    is_out = p < NUM_TILES
    s_out, n0 = slice_of_tile(tl.minimum(p, NUM_TILES - 1), NT1, NT2, NT3, BLOCK_N)
    cols = n0 + tl.arange(0, BLOCK_N)
    col_ok = (cols < hint16(pick_slice(s_out, width0, width1, width2, width3),
                            ALIGNED)) & ((cols * 0 + p) < NUM_TILES)
    b_ptr = pick_slice(s_out, b0_ptr, b1_ptr, b2_ptr, b3_ptr)
    if PHASE != 1 and PAIRS == 0:
        bt = load_rank_cols(b_ptr + lora_id.to(tl.int64) * hint16(pick_slice(s_out, stride_b0_slot, stride_b1_slot,
                                                                             stride_b2_slot, stride_b3_slot), ALIGNED)
                             + cols[:, None] * hint16(pick_slice(s_out, stride_b0_col, stride_b1_col, stride_b2_col,
                                                                 stride_b3_col), ALIGNED)
                             + offs_r[None, :] * pick_slice(s_out, stride_b0_rank, stride_b1_rank, stride_b2_rank,
                                                            stride_b3_rank),
                             col_ok, offs_r, rank, RANK, HAS_RANKS, HAS_RANKS or B_SELECT)
        bt = weight_operand(bt, x_ptr, CAST_FP32)
    s_in = p % NUM_SLICES
    split = p // NUM_SLICES
    a_ptr = pick_slice(s_in, a0_ptr, a1_ptr, a2_ptr, a3_ptr)
    stride_a_slot = hint16(pick_slice(s_in, stride_a0_slot, stride_a1_slot, stride_a2_slot, stride_a3_slot), ALIGNED)
    stride_a_rank = hint16(pick_slice(s_in, stride_a0_rank, stride_a1_rank, stride_a2_rank, stride_a3_rank), ALIGNED)
    stride_a_hidden = pick_slice(s_in, stride_a0_hidden, stride_a1_hidden, stride_a2_hidden, stride_a3_hidden)
    hidden = hint16(hidden, ALIGNED)
    k_begin = split * K_PER_SPLIT
    k_end = tl.where(p < NUM_SLICES * SPLIT_K, tl.minimum(k_begin + K_PER_SPLIT, hidden), k_begin)
    if PREFETCH_LINES > 0:
        prefetch_rows(a_ptr + lora_id.to(tl.int64) * stride_a_slot + offs_r * stride_a_rank, offs_r < rank,
                       k_begin, k_end, stride_a_hidden, PREFETCH_LINES, PREFETCH_LINE)
    if USE_PDL:
        gdc_wait()                               # every program, idle ones too (see the shrink)
        gdc_launch_dependents()
    if n_tok <= 0:
        return                                   # the whole row (every program of it) is idle
    if PHASE != 1:
        y_offs, write, y_old = y_tile(y_ptr, tok, tok_ok, cols, col_ok,
                                       hint16(pick_slice(s_out, offset0, offset1, offset2, offset3), ALIGNED),
                                       hint16(stride_y_token, ALIGNED), stride_y_col, ADD_INPUTS)
    if PHASE != 2 and PAIRS > 0:
        if p < NUM_SLICES * SPLIT_K:
            _fused_pairs_shrink(x_ptr, a_ptr, pick_slice(s_in, as0_ptr, as1_ptr, as2_ptr, as3_ptr), ranks_ptr,
                                pair_slots_ptr, pair_weights_ptr, ws_ptr, lora_id, tok, tok_ok,
                                split, s_in, scale, k_begin, tl.minimum(k_begin + K_PER_SPLIT, hidden), hidden,
                                hint16(stride_x_token, ALIGNED), stride_x_hidden, stride_a_slot, stride_a_rank,
                                stride_a_hidden, pick_slice(s_in, stride_as0_slot, stride_as1_slot, stride_as2_slot,
                                                            stride_as3_slot), hint16(stride_ws_plane, ALIGNED),
                                hint16(stride_ws_slice, ALIGNED),
                                stride_ws_token, RANK, HAS_RANKS, BLOCK_M, BLOCK_K, BLOCK_R, CAST_FP32, DOT_PRECISION,
                                PAIRS)
        _row_barrier(sync_ptr + row, p == 0, tl.num_programs(0), PHASE == 0, BARRIER_POLLS)
    if PHASE != 2 and PAIRS == 0:
        if p < NUM_SLICES * SPLIT_K:
            acc = shrink_tile(x_ptr, a_ptr, tok, tok_ok, lora_id, rank, k_begin, k_end, hidden,
                               hint16(stride_x_token, ALIGNED), stride_x_hidden, stride_a_slot, stride_a_rank,
                               stride_a_hidden,
                               BLOCK_M, BLOCK_K, BLOCK_R, CAST_FP32, DOT_PRECISION)
            ws = (ws_ptr + split.to(tl.int64) * hint16(stride_ws_plane, ALIGNED) + s_in * hint16(stride_ws_slice,
                                                                                                 ALIGNED)
                  + tok[:, None] * stride_ws_token + offs_r[None, :])
            acc = channel_scaled(acc, a_ptr, pick_slice(s_in, as0_ptr, as1_ptr, as2_ptr, as3_ptr), lora_id,
                                 pick_slice(s_in, stride_as0_slot, stride_as1_slot, stride_as2_slot, stride_as3_slot),
                                 offs_r, offs_r < RANK)
            tl.store(ws, acc * scale, mask=tok_ok[:, None] & (offs_r < RANK)[None, :])
        _row_barrier(sync_ptr + row, p == 0, tl.num_programs(0), PHASE == 0, BARRIER_POLLS)
    if PHASE != 1 and PAIRS > 0:  # noqa: SIM102 - a constexpr test, resolved when the kernel compiles
        if is_out:
            _fused_pairs_out(b_ptr, pick_slice(s_out, bs0_ptr, bs1_ptr, bs2_ptr, bs3_ptr), ranks_ptr, pair_slots_ptr,
                             ws_ptr, lora_id, tok, tok_ok, cols, col_ok, s_out, y_old, out_ptr, y_offs, write,
                             hint16(pick_slice(s_out, stride_b0_slot, stride_b1_slot, stride_b2_slot, stride_b3_slot),
                                    ALIGNED),
                             hint16(pick_slice(s_out, stride_b0_col, stride_b1_col, stride_b2_col, stride_b3_col),
                                    ALIGNED),
                             pick_slice(s_out, stride_b0_rank, stride_b1_rank, stride_b2_rank, stride_b3_rank),
                             pick_slice(s_out, stride_bs0_slot, stride_bs1_slot, stride_bs2_slot, stride_bs3_slot),
                             hint16(stride_ws_plane, ALIGNED), hint16(stride_ws_slice, ALIGNED), stride_ws_token,
                             RANK, HAS_RANKS, SPLIT_K, BLOCK_M, BLOCK_N, BLOCK_R, CAST_FP32, DOT_PRECISION, PAIRS)
    if PHASE != 1 and PAIRS == 0:  # noqa: SIM102 - a constexpr test, resolved when the kernel compiles
        if is_out:
            # The SPLIT_K planes, WS_GROUP at a time in one load (all of a group in flight at once;
            # decode: every plane in one load), from L2 (".cg": not L1), summed.
            lhs = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
            for g in tl.static_range(0, SPLIT_P2, WS_GROUP):
                planes = g + tl.arange(0, WS_GROUP)
                ws_rows = (ws_ptr + planes[:, None, None].to(tl.int64) * hint16(stride_ws_plane, ALIGNED)
                           + s_out * hint16(stride_ws_slice, ALIGNED) + tok[None, :, None] * stride_ws_token
                           + offs_r[None, None, :])
                ws_ok = ((planes < SPLIT_K)[:, None, None] & tok_ok[None, :, None]
                         & (offs_r < rank)[None, None, :])
                lhs += tl.sum(tl.load(ws_rows, mask=ws_ok, other=0.0, cache_modifier=".cg"), axis=0)
            if CAST_FP32:
                bt = bt.to(tl.float32)
            else:
                lhs = lhs.to(bt.dtype)
            acc = tl.dot(lhs, tl.trans(bt), input_precision=DOT_PRECISION)
            acc = channel_scaled(acc, b_ptr, pick_slice(s_out, bs0_ptr, bs1_ptr, bs2_ptr, bs3_ptr), lora_id,
                                 pick_slice(s_out, stride_bs0_slot, stride_bs1_slot, stride_bs2_slot, stride_bs3_slot),
                                 cols, col_ok)
            store_slice(acc, y_old, out_ptr, y_offs, write, pick_slice(s_out, bias0_ptr, bias1_ptr, bias2_ptr,
                                                                       bias3_ptr), lora_id,
                         cols, col_ok, hint16(pick_slice(s_out, stride_bias0_slot, stride_bias1_slot,
                                                         stride_bias2_slot, stride_bias3_slot), ALIGNED),
                         pick_slice(s_out, stride_bias0_col, stride_bias1_col, stride_bias2_col, stride_bias3_col),
                         pick_slice(s_out, BIAS0, BIAS1, BIAS2, BIAS3), BIAS0 + BIAS1 + BIAS2 + BIAS3 > 0)


# ------------------------------------------------------------------------------- launch plan

@dataclasses.dataclass(frozen=True, eq=False)
class FusedPlan(ExpandPlan):
    """How `lora_fused_kernel` is launched (and the workspace and barrier counters it needs)."""

    KERNEL = "fused"
    workspace_shape: tuple = ()   # (SPLIT_K, slices, T, rank) float32

    # Ask for a cooperative launch (co-residency checked by the driver, which refuses large decode
    # grids: see lora_fused_kernel). Off; benchmark experiments may set it on the class.
    cooperative = False

    @property
    def num_tokens(self) -> int:
        """T (the launch's PDL policy depends on it: planning.pdl_launch)."""
        return self.workspace_shape[2]

    @property
    def sync_ints(self) -> int:
        """int32 barrier counters the launch needs, one per token tile (zeroed once, reused)."""
        return self.grid[1]

    @functools.cached_property
    def phases(self) -> tuple:
        """PHASE values to launch in order: one launch compiled, two under the interpreter."""
        phase = self.constexprs["PHASE"]
        return (1, 2) if interpreting() and phase == 0 else (phase,)


WS_LOAD_MAX = 4096  # floats of workspace planes the fused kernel loads at once (32 registers at 4 warps)


def plan_fused(num_tokens: int, hidden: int, rank: int, widths: Sequence[int], num_groups: int,
               x_dtype: str, w_dtype: str, config: dict, *, add_inputs: bool,
               bias_flags: Sequence[bool], has_ranks: bool, aligned: bool = False,
               pdl: bool = False, pairs: int = 0) -> FusedPlan:
    """Grid and meta-parameters of `lora_fused_kernel`.

    config: BLOCK_M, BLOCK_N, BLOCK_K, SPLIT_K (hidden chunks per slice; 0: one shrink program per
    output tile), num_warps, num_stages. P = max(output tiles, slices * SPLIT_K) programs per token
    tile; the workspace has SPLIT_K planes (`FusedPlan.workspace_shape`). pairs > 0: several
    adapters per token (no epilogue vectors, no L2 prefetch; a workspace of pairs * rank columns).
    """
    assert 1 <= len(widths) <= MAX_SLICES
    if pairs and any(bias_flags):
        raise ValueError("several adapters per token take no LoRA bias or DoRA column scale (lora_bias_stacked / "
                         "dora_scale_stacked must be None)")
    block_m, block_n, block_k = int(config["BLOCK_M"]), int(config["BLOCK_N"]), int(config["BLOCK_K"])
    small_t, block_m = small_t_block(num_tokens, block_m, config)
    block_r = max(16, next_pow2(rank))
    check_dot_dims(block_m, block_n, block_k, block_r)
    cast, precision = cast_and_precision((x_dtype, dot_dtype(w_dtype, x_dtype)))
    c, total = epilogue_constexprs(widths, bias_flags, add_inputs, has_ranks, block_n)
    num_slices = len(widths)
    split, k_per_split = hidden_split(hidden, int(config.get("SPLIT_K", 0)) or max(1, total // num_slices),
                                       block_k)
    split_p2 = next_pow2(split)
    # planes summed per load: all of them while the (planes, BLOCK_M, BLOCK_R) block stays within
    # WS_LOAD_MAX floats (decode tiles), else groups of that size (prefill tiles: registers)
    ws_group = max(1, min(split_p2, WS_LOAD_MAX // (block_m * block_r)))
    c.update(RANK=rank, NUM_SLICES=num_slices, SPLIT_K=split, SPLIT_P2=split_p2, K_PER_SPLIT=k_per_split,
             WS_GROUP=ws_group, NUM_TILES=total,
             BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, BLOCK_R=block_r,
             NUM_GROUPS=num_groups, GROUPS_P2=next_pow2(num_groups), PHASE=0, CAST_FP32=cast,
             DOT_PRECISION=precision, ALIGNED=bool(aligned), SMALL_T=small_t, USE_PDL=bool(pdl),
             BARRIER_POLLS=BARRIER_POLL_LIMIT, B_SELECT=bool(config.get("B_SELECT", False)), PAIRS=int(pairs),
             **prefetch_constexprs(pdl and config.get("PREFETCH", True) and not pairs, k_per_split, w_dtype))
    grid = (max(total, num_slices * split), max_tiles(num_tokens, num_groups, block_m, small_t))
    return FusedPlan(grid, c, int(config.get("num_warps", 4)), int(config.get("num_stages", 2)),
                     (split, num_slices, num_tokens, rank * max(1, int(pairs))))
