"""The expand kernel: every token's rank-sized buffer through its adapter's B, into y's slices.

Math (contract section 4), idx[t] = slot of token t (or -1), products accumulated in float32:

  y[t, off_s:off_s+n_s] = (y[t, off_s:off_s+n_s] if add_inputs else 0)
                          + (sum_p buf[p, s, t]) @ B_s[idx[t]].T + bias_s[idx[t]]

Rows with idx[t] = -1 and columns outside the slices are never written. The split-K planes p of a
workspace written by `lora_shrink_kernel` are summed on load (no atomics, no zeroing). Grid and
meta-parameters: `plan_expand`; arguments: `arguments.expand_call`.
"""

from __future__ import annotations

import dataclasses
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
    runs_copy,
    slice_of_tile,
    slot_rank,
    store_slice,
    token_tile,
    weight_operand,
    workspace_lhs,
    y_tile,
)
from .planning import (
    MAX_SLICES,
    TOKEN_COUNT_PARAMS,
    PlanKey,
    cast_and_precision,
    check_dot_dims,
    dot_dtype,
    epilogue_constexprs,
    interpreting,
    max_tiles,
    next_pow2,
    prefetch_constexprs,
    small_t_block,
)


@triton.jit
def _expand_y(j, live, tok, tok_ok, y_ptr, width0, width1, width2, width3, offset0, offset1, offset2, offset3,
              stride_y_token,
              stride_y_col, NUM_TILES: tl.constexpr, NT1: tl.constexpr, NT2: tl.constexpr, NT3: tl.constexpr,
              ADD_INPUTS: tl.constexpr, BLOCK_N: tl.constexpr, ALIGNED: tl.constexpr):
    """The current y of output tile j (zeros unless live > 0, past NUM_TILES, or outside its slice):
    what `_expand_tile` adds to, loaded one tile ahead by lora_expand_kernel's Y_AHEAD loop."""
    s, n0 = slice_of_tile(tl.minimum(j, NUM_TILES - 1), NT1, NT2, NT3, BLOCK_N)
    cols = n0 + tl.arange(0, BLOCK_N)
    col_ok = ((cols < hint16(pick_slice(s, width0, width1, width2, width3), ALIGNED)) & ((cols * 0 + j) < NUM_TILES)
              & ((cols * 0 + live) > 0))
    _, _, y_old = y_tile(y_ptr, tok, tok_ok, cols, col_ok, hint16(pick_slice(s, offset0, offset1, offset2, offset3),
                                                                  ALIGNED),
                          hint16(stride_y_token, ALIGNED), stride_y_col, ADD_INPUTS)
    return y_old


@triton.jit
def _expand_tile(j, lora_id, tok, tok_ok, rank, buf_ptr, b0_ptr, b1_ptr, b2_ptr, b3_ptr,
                 bs0_ptr, bs1_ptr, bs2_ptr, bs3_ptr, bias0_ptr, bias1_ptr, bias2_ptr, bias3_ptr, y_ptr, out_ptr,
                 stride_buf_plane, stride_buf_slice, stride_buf_token, stride_buf_rank,
                 stride_b0_slot, stride_b0_col, stride_b0_rank, stride_b1_slot, stride_b1_col, stride_b1_rank,
                 stride_b2_slot, stride_b2_col, stride_b2_rank, stride_b3_slot, stride_b3_col, stride_b3_rank,
                 stride_bs0_slot, stride_bs1_slot, stride_bs2_slot, stride_bs3_slot,
                 stride_bias0_slot, stride_bias0_col, stride_bias1_slot, stride_bias1_col, stride_bias2_slot,
                 stride_bias2_col, stride_bias3_slot, stride_bias3_col,
                 width0, width1, width2, width3, offset0, offset1, offset2, offset3, stride_y_token, stride_y_col,
                 RANK: tl.constexpr, NUM_PARTIALS: tl.constexpr, NUM_TILES: tl.constexpr, NT1: tl.constexpr,
                 NT2: tl.constexpr, NT3: tl.constexpr, BIAS0: tl.constexpr, BIAS1: tl.constexpr,
                 BIAS2: tl.constexpr, BIAS3: tl.constexpr, ADD_INPUTS: tl.constexpr, HAS_RANKS: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
                 CAST_FP32: tl.constexpr, DOT_PRECISION: tl.constexpr, ALIGNED: tl.constexpr,
                 WAIT: tl.constexpr, y_given, Y_GIVEN: tl.constexpr, lhs_given, LHS_GIVEN: tl.constexpr,
                 B_TAIL: tl.constexpr):
    """Output tile j (over all slices; none past NUM_TILES) of one token tile: see lora_expand_kernel.
    B_TAIL: zero B's columns past the slot's rank in registers (`load_rank_cols` ZERO_TAIL; needed
    with per-slot ranks unless the rank is a multiple of 8).
    WAIT: gdc_wait (PDL) after the loads the shrink does not write (B tile, y tile), before the
    workspace's. Y_GIVEN: y_given is the tile's current y (`_expand_y`, loaded ahead), else loaded here.
    LHS_GIVEN (one rank block): lhs_given is the token tile's summed workspace rows of this tile's
    slice (`workspace_lhs`, loaded once per program), else loaded here.
    fp8 B: tiles enter the dot in y's dtype (`weight_operand`), and the float32 product is
    multiplied once by the slot's channel scales b_scale_s[lora_id, cols] before the epilogue."""
    s, n0 = slice_of_tile(tl.minimum(j, NUM_TILES - 1), NT1, NT2, NT3, BLOCK_N)
    b_ptr = pick_slice(s, b0_ptr, b1_ptr, b2_ptr, b3_ptr)
    stride_bl = hint16(pick_slice(s, stride_b0_slot, stride_b1_slot, stride_b2_slot, stride_b3_slot), ALIGNED)
    stride_bn = hint16(pick_slice(s, stride_b0_col, stride_b1_col, stride_b2_col, stride_b3_col), ALIGNED)
    stride_bk = pick_slice(s, stride_b0_rank, stride_b1_rank, stride_b2_rank, stride_b3_rank)
    cols = n0 + tl.arange(0, BLOCK_N)
    # the slice's own columns, of a real tile (a program's last tiles may lie past NUM_TILES)
    col_ok = (cols < hint16(pick_slice(s, width0, width1, width2, width3), ALIGNED)) & ((cols * 0 + j) < NUM_TILES)
    offs_r = tl.arange(0, BLOCK_R)
    b_rows = b_ptr + lora_id.to(tl.int64) * stride_bl + cols[:, None] * stride_bn
    buf_rows = (buf_ptr + s * hint16(stride_buf_slice, ALIGNED) + tok[:, None] * hint16(stride_buf_token, ALIGNED))
    stride_buf_plane = hint16(stride_buf_plane, ALIGNED)
    y_offs, write, y_old = y_tile(y_ptr, tok, tok_ok, cols, col_ok, hint16(pick_slice(s, offset0, offset1, offset2,
                                                                                      offset3), ALIGNED),
                                   hint16(stride_y_token, ALIGNED), stride_y_col, ADD_INPUTS and not Y_GIVEN)
    if Y_GIVEN:
        y_old = y_given
    if RANK <= BLOCK_R:
        # One rank block (decode ranks): its B tile -- cold weights the shrink does not write --
        # is loaded before waiting for the shrink, off the critical path.
        bt = weight_operand(load_rank_cols(b_rows + offs_r[None, :] * stride_bk, col_ok, offs_r, rank, RANK,
                                           HAS_RANKS, B_TAIL), y_ptr, CAST_FP32)
    if WAIT:
        # The shrink's workspace is complete past this point. Outside the rank loop on purpose:
        # the software pipeliner hoists the first iteration's loads above anything inside it.
        gdc_wait()
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if RANK <= BLOCK_R:
        if LHS_GIVEN:
            lhs = lhs_given
        else:
            lhs = workspace_lhs(buf_rows, stride_buf_plane, stride_buf_rank, offs_r, tok_ok, rank, RANK, HAS_RANKS,
                                 NUM_PARTIALS, BLOCK_M, BLOCK_R, HAS_RANKS or B_TAIL)
        acc = rank_dot(acc, lhs, bt, CAST_FP32, DOT_PRECISION)
    else:
        for k0 in range(0, rank, BLOCK_R):                   # real rank only
            kk = k0 + offs_r
            bt = weight_operand(load_rank_cols(b_rows + kk[None, :] * stride_bk, col_ok, kk, rank, RANK, HAS_RANKS,
                                               B_TAIL), y_ptr, CAST_FP32)
            lhs = workspace_lhs(buf_rows, stride_buf_plane, stride_buf_rank, kk, tok_ok, rank, RANK, HAS_RANKS,
                                 NUM_PARTIALS, BLOCK_M, BLOCK_R, HAS_RANKS)
            acc = rank_dot(acc, lhs, bt, CAST_FP32, DOT_PRECISION)
    acc = channel_scaled(acc, b_ptr, pick_slice(s, bs0_ptr, bs1_ptr, bs2_ptr, bs3_ptr), lora_id,
                         pick_slice(s, stride_bs0_slot, stride_bs1_slot, stride_bs2_slot, stride_bs3_slot), cols,
                         col_ok)
    has_bias = pick_slice(s, BIAS0, BIAS1, BIAS2, BIAS3)
    store_slice(acc, y_old, out_ptr, y_offs, write, pick_slice(s, bias0_ptr, bias1_ptr, bias2_ptr, bias3_ptr),
                lora_id,
                 cols, col_ok, hint16(pick_slice(s, stride_bias0_slot, stride_bias1_slot, stride_bias2_slot,
                                                 stride_bias3_slot), ALIGNED),
                 pick_slice(s, stride_bias0_col, stride_bias1_col, stride_bias2_col, stride_bias3_col), has_bias,
                 BIAS0 + BIAS1 + BIAS2 + BIAS3 > 0)


@triton.jit
def _expand_pairs_tile(j, group, tok, tok_ok, buf_ptr, b0_ptr, b1_ptr, b2_ptr, b3_ptr, bs0_ptr, bs1_ptr, bs2_ptr,
                       bs3_ptr, ranks_ptr, pair_slots_ptr,
                       y_ptr, out_ptr, stride_buf_plane, stride_buf_slice, stride_buf_token, stride_buf_rank,
                       stride_b0_slot, stride_b0_col, stride_b0_rank, stride_b1_slot, stride_b1_col, stride_b1_rank,
                       stride_b2_slot, stride_b2_col, stride_b2_rank, stride_b3_slot, stride_b3_col, stride_b3_rank,
                       stride_bs0_slot, stride_bs1_slot, stride_bs2_slot, stride_bs3_slot,
                       width0, width1, width2, width3, offset0, offset1, offset2, offset3, stride_y_token,
                       stride_y_col, RANK: tl.constexpr, NUM_PARTIALS: tl.constexpr, NUM_TILES: tl.constexpr,
                       NT1: tl.constexpr, NT2: tl.constexpr, NT3: tl.constexpr, ADD_INPUTS: tl.constexpr,
                       HAS_RANKS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                       BLOCK_R: tl.constexpr, CAST_FP32: tl.constexpr, DOT_PRECISION: tl.constexpr,
                       ALIGNED: tl.constexpr, PAIRS: tl.constexpr):
    """Output tile j of a token tile whose tokens share one tuple of PAIRS slots (group `group`):

      y[t, off_s + n] = (y if ADD_INPUTS else 0)
                        + sum_j sum_p buf[p, s, t, j * RANK : j * RANK + rank_j] @ B_s[slot_j, n, :rank_j]

    slot_j = pair_slots[group, j] (-1: pair j is empty and adds nothing); the buffer rows are
    already weighted by the shrink. One float32 accumulator for every pair: y is read and written
    once. No epilogue vector (several adapters take no LoRA bias or DoRA scale). fp8 B: each
    pair's product is multiplied by its slot's channel scales b_scale_s[slot_j, n] before it is added.

    y enters the float32 sum where it enters the pair-free tile's (`_expand_tile`), so that a token
    with one adapter gets the bits of a plain step in a paired one, compiled too:
      1. 16-bit B, one rank block (RANK <= BLOCK_R): Triton's compiler folds the pair-free tile's
         `dot(lhs, B, 0) + y` into `dot(lhs, B, y)`, the dot's chain of products starting from y;
         here the accumulator starts at y (Y_FIRST) and the first pair's dot continues from it;
      2. fp8 B: the pair-free tile adds y to the scaled product, y + scale * (lhs @ B); Y_FIRST too;
      3. 16-bit B, rank blocks in a loop: the chain starts from 0 and y is added last, in both.
    """
    s, n0 = slice_of_tile(tl.minimum(j, NUM_TILES - 1), NT1, NT2, NT3, BLOCK_N)
    b_ptr = pick_slice(s, b0_ptr, b1_ptr, b2_ptr, b3_ptr)
    stride_bl = hint16(pick_slice(s, stride_b0_slot, stride_b1_slot, stride_b2_slot, stride_b3_slot), ALIGNED)
    stride_bn = hint16(pick_slice(s, stride_b0_col, stride_b1_col, stride_b2_col, stride_b3_col), ALIGNED)
    stride_bk = pick_slice(s, stride_b0_rank, stride_b1_rank, stride_b2_rank, stride_b3_rank)
    cols = n0 + tl.arange(0, BLOCK_N)
    col_ok = (cols < hint16(pick_slice(s, width0, width1, width2, width3), ALIGNED)) & ((cols * 0 + j) < NUM_TILES)
    offs_r = tl.arange(0, BLOCK_R)
    buf_rows = (buf_ptr + s * hint16(stride_buf_slice, ALIGNED) + tok[:, None] * hint16(stride_buf_token, ALIGNED))
    y_offs, write, y_old = y_tile(y_ptr, tok, tok_ok, cols, col_ok, hint16(pick_slice(s, offset0, offset1, offset2,
                                                                                      offset3), ALIGNED),
                                   hint16(stride_y_token, ALIGNED), stride_y_col, ADD_INPUTS)
    Y_FIRST: tl.constexpr = (RANK <= BLOCK_R) or b_ptr.dtype.element_ty.is_fp8()
    if Y_FIRST:
        acc = y_old.to(tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for q in tl.static_range(PAIRS):
        slot = tl.load(pair_slots_ptr + tl.maximum(group, 0) * PAIRS + q)
        has_pair = (group >= 0) & (slot >= 0)
        slot = tl.where(has_pair, slot, 0)
        rank = slot_rank(ranks_ptr, slot, has_pair, RANK, HAS_RANKS)
        b_rows = b_ptr + slot.to(tl.int64) * stride_bl + cols[:, None] * stride_bn
        if b_ptr.dtype.element_ty.is_fp8():
            part = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for k0 in range(0, rank, BLOCK_R):
                kk = k0 + offs_r
                bt = weight_operand(load_rank_cols(b_rows + kk[None, :] * stride_bk, col_ok, kk, rank, RANK,
                                                   HAS_RANKS, True), y_ptr, CAST_FP32)
                lhs = workspace_lhs(buf_rows + (q * RANK) * stride_buf_rank, hint16(stride_buf_plane, ALIGNED),
                                    stride_buf_rank, kk, tok_ok, rank, RANK, HAS_RANKS, NUM_PARTIALS, BLOCK_M,
                                    BLOCK_R, True)
                part = rank_dot(part, lhs, bt, CAST_FP32, DOT_PRECISION)
            acc += channel_scaled(part, b_ptr, pick_slice(s, bs0_ptr, bs1_ptr, bs2_ptr, bs3_ptr), slot,
                                  pick_slice(s, stride_bs0_slot, stride_bs1_slot, stride_bs2_slot, stride_bs3_slot),
                                  cols, col_ok)
        else:
            for k0 in range(0, rank, BLOCK_R):
                kk = k0 + offs_r
                bt = load_rank_cols(b_rows + kk[None, :] * stride_bk, col_ok, kk, rank, RANK, HAS_RANKS, True)
                lhs = workspace_lhs(buf_rows + (q * RANK) * stride_buf_rank, hint16(stride_buf_plane, ALIGNED),
                                    stride_buf_rank, kk, tok_ok, rank, RANK, HAS_RANKS, NUM_PARTIALS, BLOCK_M,
                                    BLOCK_R, True)
                acc = rank_dot(acc, lhs, bt, CAST_FP32, DOT_PRECISION)
    if Y_FIRST:
        tl.store(out_ptr + y_offs, acc.to(out_ptr.dtype.element_ty), mask=write)
    else:
        store_slice(acc, y_old, out_ptr, y_offs, write, b_ptr, group, cols, col_ok, 0, 0, 0, False)


@triton.jit(do_not_specialize_on_alignment=TOKEN_COUNT_PARAMS)
def lora_expand_kernel(
        # pointers: the buffer, B per slice, B's fp8 channel scales per slice, the epilogue vector per
        # slice, the per-slot ranks, the adapter pairs' slots
        buf_ptr, b0_ptr, b1_ptr, b2_ptr, b3_ptr, bs0_ptr, bs1_ptr, bs2_ptr, bs3_ptr, bias0_ptr, bias1_ptr,
        bias2_ptr, bias3_ptr, ranks_ptr, pair_slots_ptr,
        # pointers: the metadata, KernelMeta's index arrays in its order; then y
        mapping_ptr, sorted_ptr, counts_ptr, starts_ptr, active_ptr, y_ptr,
        # sizes
        num_tokens, num_sorted, num_slots,
        # strides: the buffer (plane, slice, token, rank), then B per slice (slot, col, rank)
        stride_buf_plane, stride_buf_slice, stride_buf_token, stride_buf_rank,
        stride_b0_slot, stride_b0_col, stride_b0_rank,
        stride_b1_slot, stride_b1_col, stride_b1_rank,
        stride_b2_slot, stride_b2_col, stride_b2_rank,
        stride_b3_slot, stride_b3_col, stride_b3_rank,
        # strides: B's channel scales per slice (slot; channels contiguous)
        stride_bs0_slot, stride_bs1_slot, stride_bs2_slot, stride_bs3_slot,
        # strides: the epilogue vector per slice (slot, col)
        stride_bias0_slot, stride_bias0_col, stride_bias1_slot, stride_bias1_col,
        stride_bias2_slot, stride_bias2_col, stride_bias3_slot, stride_bias3_col,
        # sizes per slice: its width, its first column in y
        width0, width1, width2, width3, offset0, offset1, offset2, offset3,
        # strides: y (token, col)
        stride_y_token, stride_y_col,
        # the output pointer (y itself)
        out_ptr,
        # meta-parameters
        RANK: tl.constexpr, NUM_PARTIALS: tl.constexpr, NUM_TILES: tl.constexpr, NT1: tl.constexpr,
        NT2: tl.constexpr, NT3: tl.constexpr, BIAS0: tl.constexpr, BIAS1: tl.constexpr, BIAS2: tl.constexpr,
        BIAS3: tl.constexpr, ADD_INPUTS: tl.constexpr, HAS_RANKS: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, TILES_N: tl.constexpr,
        Y_AHEAD: tl.constexpr, NUM_GROUPS: tl.constexpr, GROUPS_P2: tl.constexpr,
        CAST_FP32: tl.constexpr, DOT_PRECISION: tl.constexpr, ALIGNED: tl.constexpr,
        SMALL_T: tl.constexpr, USE_PDL: tl.constexpr, PREFETCH_LINES: tl.constexpr,
        PREFETCH_LINE: tl.constexpr, PREFETCH_Y_LINES: tl.constexpr, PREFETCH_Y_LINE: tl.constexpr,
        B_SELECT: tl.constexpr, PAIRS: tl.constexpr):
    """y[t, off_s + n] = (y if ADD_INPUTS else 0) + sum_p buf[p, s, t, :] @ B_s[idx[t], n, :] + bias.

    Grid (cdiv(NUM_TILES, TILES_N), token tiles): program (i, tile) writes output tiles
    i * TILES_N ... + TILES_N - 1 (numbered over all slices; BLOCK_N columns each) of its token
    tile. TILES_N > 1 (prefill sizes) reads the tile's metadata once for several output tiles and
    gives the software pipeliner a loop whose next tile's loads overlap this one's math (the B tile
    and workspace rows, which feed the dot; Y_AHEAD: also the next tile's y, loaded by hand before
    this tile's math -- the pipeliner leaves loads that do not feed a dot in place). `y_ptr`
    (read) and `out_ptr` (written) are the same buffer (in place on torch, aliased under jax). Only
    groups of real slots are visited, so rows without LoRA and columns outside the slices are never
    written. USE_PDL (launched as a programmatic dependent of the shrink): the metadata -- and with
    one tile per program the B and y tiles, which the shrink does not write -- are loaded before
    waiting for the shrink grid; with several tiles, the first tile's y (Y_AHEAD) is loaded
    before the wait, and the B tiles (PREFETCH_LINES > 0) and y rows (PREFETCH_Y_LINES > 0) of
    all of them can be prefetched into L2 before it (loaded after it, by the pipelined loop).
    B_SELECT (one tile, one rank block): the B tile goes through the rank select even without
    per-slot ranks, which makes Triton stage it through shared memory (see `load_rank_cols`).
    PAIRS > 0 (several adapters per token): `_expand_pairs_tile` per output tile; PAIRS == 0
    compiles none of it.
    """
    if USE_PDL:
        # A programmatic dependent after this kernel (the next layer's shrink) may be scheduled
        # now; it waits (gdc_wait) for this grid to complete before it touches memory.
        gdc_launch_dependents()
    i = tl.program_id(0)
    pid = tl.program_id(1)
    lora_id, tok, tok_ok, n_tok = token_tile(pid, mapping_ptr, sorted_ptr, counts_ptr, starts_ptr, active_ptr,
                                        num_slots, num_tokens, num_sorted, BLOCK_M, NUM_GROUPS, GROUPS_P2,
                                        True, SMALL_T)
    if n_tok <= 0:
        return
    if PAIRS > 0:
        if USE_PDL:
            gdc_wait()
        for t in range(TILES_N):
            _expand_pairs_tile(i * TILES_N + t, lora_id, tok, tok_ok, buf_ptr, b0_ptr, b1_ptr, b2_ptr, b3_ptr,
                               bs0_ptr, bs1_ptr, bs2_ptr, bs3_ptr,
                               ranks_ptr, pair_slots_ptr, y_ptr, out_ptr, stride_buf_plane, stride_buf_slice,
                               stride_buf_token, stride_buf_rank, stride_b0_slot, stride_b0_col, stride_b0_rank,
                               stride_b1_slot, stride_b1_col, stride_b1_rank, stride_b2_slot, stride_b2_col,
                               stride_b2_rank, stride_b3_slot, stride_b3_col, stride_b3_rank,
                               stride_bs0_slot, stride_bs1_slot, stride_bs2_slot, stride_bs3_slot,
                               width0, width1, width2, width3, offset0, offset1, offset2, offset3, stride_y_token,
                               stride_y_col, RANK, NUM_PARTIALS, NUM_TILES, NT1, NT2, NT3, ADD_INPUTS, HAS_RANKS,
                               BLOCK_M, BLOCK_N, BLOCK_R, CAST_FP32, DOT_PRECISION, ALIGNED, PAIRS)
        return
    rank = slot_rank(ranks_ptr, lora_id, lora_id >= 0, RANK, HAS_RANKS)
    # Two call sites on purpose: one tile waits (PDL) between its B/y loads and its workspace loads,
    # which a loop would let the software pipeliner reorder; several tiles wait once, before a real
    # loop (scf.for) that the pipeliner overlaps -- unrolling it (static_range) would lose that.
    # Per-slot ranks: B's columns past a rank that is not a multiple of 8 are zeroed in registers,
    # which costs a pipelined loop a shared-memory round trip per B tile (a slower prefill expand).
    # The rank is uniform over a program (one slot), so a pipelined loop over B tiles
    # (several output tiles, or rank blocks) is compiled twice, with and without that step
    # (B_TAIL), and each program runs the copy its rank needs. One tile of one rank block loads
    # its B tile once, outside any loop: one copy, with the step (two would cost registers:
    # 80 -> 142 at T128, rank 64).
    odd_rank = (rank % 8) != 0
    if TILES_N == 1:
        TWO_COPIES: tl.constexpr = HAS_RANKS and RANK > BLOCK_R
        for b_tail in tl.static_range(1 + TWO_COPIES):
            if runs_copy(odd_rank, b_tail, TWO_COPIES):
                _expand_tile(i, lora_id, tok, tok_ok, rank, buf_ptr, b0_ptr, b1_ptr, b2_ptr, b3_ptr,
                             bs0_ptr, bs1_ptr, bs2_ptr, bs3_ptr, bias0_ptr, bias1_ptr, bias2_ptr, bias3_ptr, y_ptr,
                             out_ptr, stride_buf_plane,
                             stride_buf_slice, stride_buf_token,
                             stride_buf_rank, stride_b0_slot, stride_b0_col, stride_b0_rank, stride_b1_slot,
                             stride_b1_col, stride_b1_rank, stride_b2_slot, stride_b2_col, stride_b2_rank,
                             stride_b3_slot, stride_b3_col, stride_b3_rank, stride_bs0_slot, stride_bs1_slot,
                             stride_bs2_slot, stride_bs3_slot, stride_bias0_slot, stride_bias0_col,
                             stride_bias1_slot, stride_bias1_col, stride_bias2_slot, stride_bias2_col,
                             stride_bias3_slot, stride_bias3_col,
                             width0, width1, width2, width3, offset0, offset1, offset2, offset3, stride_y_token,
                             stride_y_col,
                             RANK, NUM_PARTIALS, NUM_TILES, NT1, NT2, NT3, BIAS0, BIAS1, BIAS2, BIAS3, ADD_INPUTS,
                             HAS_RANKS, BLOCK_M, BLOCK_N, BLOCK_R, CAST_FP32, DOT_PRECISION, ALIGNED, USE_PDL,
                             0.0, False, 0.0, False, (b_tail == 1) or ((HAS_RANKS or B_SELECT) and not TWO_COPIES))
    else:
        # The program's tiles lie in one slice (plan_expand pads each slice's tiles to a multiple
        # of TILES_N): its slice s0 and first column n0.
        s0, n0 = slice_of_tile(tl.minimum(i * TILES_N, NUM_TILES - 1), NT1, NT2, NT3, BLOCK_N)
        width_s0 = pick_slice(s0, width0, width1, width2, width3)
        if PREFETCH_LINES > 0:
            # The program's B tiles (weights: not written by the shrink) into L2 while it runs.
            b_rows0 = (pick_slice(s0, b0_ptr, b1_ptr, b2_ptr, b3_ptr)
                       + lora_id.to(tl.int64) * hint16(pick_slice(s0, stride_b0_slot, stride_b1_slot, stride_b2_slot,
                                                                  stride_b3_slot), ALIGNED))
            stride_bn0 = hint16(pick_slice(s0, stride_b0_col, stride_b1_col, stride_b2_col, stride_b3_col), ALIGNED)
            for tp in tl.static_range(TILES_N):
                cols = n0 + tp * BLOCK_N + tl.arange(0, BLOCK_N)
                prefetch_rows(b_rows0 + cols * stride_bn0, cols < width_s0, 0, rank,
                               pick_slice(s0, stride_b0_rank, stride_b1_rank, stride_b2_rank, stride_b3_rank),
                               PREFETCH_LINES, PREFETCH_LINE)
        if ADD_INPUTS and PREFETCH_Y_LINES > 0:
            # The program's y rows (final: the kernel before the shrink completed before the shrink
            # let this grid start) into L2 while the shrink runs.
            y_rows0 = (y_ptr + tok * hint16(stride_y_token, ALIGNED)
                       + (hint16(pick_slice(s0, offset0, offset1, offset2, offset3), ALIGNED) + n0) * stride_y_col)
            prefetch_rows(y_rows0, tok_ok, 0, tl.minimum(TILES_N * BLOCK_N, width_s0 - n0), stride_y_col,
                           PREFETCH_Y_LINES, PREFETCH_Y_LINE)
        if Y_AHEAD:
            # the first tile's y, before the wait (final already, as above)
            y_next = _expand_y(i * TILES_N, 1, tok, tok_ok, y_ptr, width0, width1, width2, width3,
                               offset0, offset1, offset2, offset3, stride_y_token, stride_y_col, NUM_TILES, NT1, NT2,
                               NT3,
                               ADD_INPUTS, BLOCK_N, ALIGNED)
        else:
            y_next = 0.0
        if USE_PDL:
            gdc_wait()                                   # before the loop: every tile reads the workspace
        if RANK <= BLOCK_R:
            # one rank block: the token tile's workspace rows of slice s0, summed once
            buf_rows = (buf_ptr + s0 * hint16(stride_buf_slice, ALIGNED)
                        + tok[:, None] * hint16(stride_buf_token, ALIGNED))
            lhs = workspace_lhs(buf_rows, hint16(stride_buf_plane, ALIGNED), stride_buf_rank, tl.arange(0, BLOCK_R),
                                tok_ok, rank, RANK, HAS_RANKS, NUM_PARTIALS, BLOCK_M, BLOCK_R, HAS_RANKS)
        else:
            lhs = 0.0
        for b_tail in tl.static_range(1 + HAS_RANKS):
            if runs_copy(odd_rank, b_tail, HAS_RANKS):
                for t in range(TILES_N):
                    y_cur = y_next
                    if Y_AHEAD:
                        y_next = _expand_y(i * TILES_N + t + 1, TILES_N - 1 - t, tok, tok_ok, y_ptr, width0,
                                           width1, width2, width3, offset0, offset1, offset2, offset3,
                                           stride_y_token, stride_y_col,
                                           NUM_TILES, NT1, NT2, NT3, ADD_INPUTS, BLOCK_N, ALIGNED)
                    _expand_tile(i * TILES_N + t, lora_id, tok, tok_ok, rank, buf_ptr, b0_ptr, b1_ptr, b2_ptr,
                                 b3_ptr, bs0_ptr, bs1_ptr, bs2_ptr, bs3_ptr, bias0_ptr, bias1_ptr, bias2_ptr, bias3_ptr,
                                 y_ptr, out_ptr,
                                 stride_buf_plane, stride_buf_slice,
                                 stride_buf_token, stride_buf_rank, stride_b0_slot, stride_b0_col, stride_b0_rank,
                                 stride_b1_slot, stride_b1_col, stride_b1_rank, stride_b2_slot, stride_b2_col,
                                 stride_b2_rank, stride_b3_slot, stride_b3_col, stride_b3_rank, stride_bs0_slot,
                                 stride_bs1_slot, stride_bs2_slot, stride_bs3_slot, stride_bias0_slot,
                                 stride_bias0_col, stride_bias1_slot, stride_bias1_col, stride_bias2_slot,
                                 stride_bias2_col, stride_bias3_slot, stride_bias3_col,
                                 width0, width1, width2, width3, offset0, offset1, offset2, offset3, stride_y_token,
                                 stride_y_col,
                                 RANK, NUM_PARTIALS, NUM_TILES, NT1, NT2, NT3, BIAS0, BIAS1, BIAS2, BIAS3,
                                 ADD_INPUTS, HAS_RANKS, BLOCK_M, BLOCK_N, BLOCK_R, CAST_FP32, DOT_PRECISION,
                                 ALIGNED, False, y_cur, Y_AHEAD, lhs, RANK <= BLOCK_R, b_tail == 1)


# ------------------------------------------------------------------------------- launch plan

@dataclasses.dataclass(frozen=True, eq=False)
class ExpandPlan(PlanKey):
    """How `lora_expand_kernel` is launched. USE_PDL: launched as a programmatic dependent of the
    shrink before it; its gdc_wait precedes every workspace read (the y tile it loads earlier was
    complete before the shrink, a normal launch, started)."""

    KERNEL = "expand"
    grid: tuple
    constexprs: dict
    num_warps: int
    num_stages: int


def plan_expand(num_tokens: int, rank: int, widths: Sequence[int], num_groups: int, num_partials: int,
                w_dtype: str, y_dtype: str, config: dict, *, add_inputs: bool, bias_flags: Sequence[bool],
                has_ranks: bool, aligned: bool = False, pdl: bool = False,
                deterministic: bool = False, pairs: int = 0) -> ExpandPlan:
    """Grid and meta-parameters of `lora_expand_kernel`. config: BLOCK_M, BLOCK_N, BLOCK_R, warps, stages,
    TILES_N (output tiles per program, default 1), Y_AHEAD (with TILES_N > 1: load the next tile's y
    before this tile's math; default False), PREFETCH / PREFETCH_Y (with TILES_N > 1 and pdl:
    prefetch the program's B tiles / y rows into L2 before waiting for the shrink; default False),
    B_SELECT (with one tile and one rank block: B through shared memory, see the kernel; default
    True: faster at decode and mid sizes; docs/benchmarks_evidence.md has the measurement).
    deterministic=True: never SMALL_T, whatever the config says (see configs.deterministic_config).
    pairs > 0: several adapters per token (`_expand_pairs_tile`), the metadata's ids are group ids;
    no epilogue vectors, no look-ahead or prefetch (their addresses depend on the group's slots)."""
    assert 1 <= len(widths) <= MAX_SLICES
    if pairs and any(bias_flags):
        raise ValueError("several adapters per token take no LoRA bias or DoRA column scale (lora_bias_stacked / "
                         "dora_scale_stacked must be None)")
    if pairs:
        config = {**config, "Y_AHEAD": False, "PREFETCH": False, "PREFETCH_Y": False, "B_SELECT": False}
    if deterministic:
        config = {**config, "SMALL_T": False}
    block_m, block_n = int(config["BLOCK_M"]), int(config["BLOCK_N"])
    small_t, block_m = small_t_block(num_tokens, block_m, config)
    block_r = max(16, min(next_pow2(rank), int(config.get("BLOCK_R", 64))))
    check_dot_dims(block_m, block_n, block_r)
    cast, precision = cast_and_precision((dot_dtype(w_dtype, y_dtype),) if not interpreting() else (w_dtype, y_dtype))
    tiles_n = max(1, min(int(config.get("TILES_N", 1)), max(triton.cdiv(int(w), block_n) for w in widths)))
    c, total = epilogue_constexprs(widths, bias_flags, add_inputs, has_ranks, block_n, tiles_n)
    c.update(RANK=rank, NUM_PARTIALS=int(num_partials), NUM_TILES=total, BLOCK_M=block_m, BLOCK_N=block_n,
             BLOCK_R=block_r, TILES_N=tiles_n, Y_AHEAD=bool(config.get("Y_AHEAD", False)) and tiles_n > 1,
             NUM_GROUPS=num_groups, GROUPS_P2=next_pow2(num_groups),
             CAST_FP32=cast, DOT_PRECISION=precision, ALIGNED=bool(aligned), SMALL_T=small_t,
             USE_PDL=bool(pdl), **prefetch_constexprs(pdl and tiles_n > 1 and bool(config.get("PREFETCH", False)),
                                                      rank, w_dtype))
    y_prefetch = prefetch_constexprs(pdl and tiles_n > 1 and bool(config.get("PREFETCH_Y", False)),
                                     tiles_n * block_n, y_dtype)
    c.update(PREFETCH_Y_LINES=y_prefetch["PREFETCH_LINES"], PREFETCH_Y_LINE=y_prefetch["PREFETCH_LINE"],
             B_SELECT=bool(config.get("B_SELECT", True)) and tiles_n == 1 and rank <= block_r, PAIRS=int(pairs))
    grid = (total // tiles_n, max_tiles(num_tokens, num_groups, block_m, small_t))
    return ExpandPlan(grid, c, int(config.get("num_warps", 4)), int(config.get("num_stages", 2)))
