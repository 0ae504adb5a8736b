"""The shrink kernel: the rank-sized buffer of every token, from its adapter's A.

Math (contract section 4), idx[t] = slot of token t (or -1), products accumulated in float32:

  out[p, s, t, :] = scale * x[t, chunk p] @ A_s[idx[t], :, chunk p].T     (0 where idx[t] = -1)

summed over the split-K planes p (by the expand when it reads them, or by atomic adds into a
zeroed output for the stand-alone shrink). Grid and meta-parameters: `plan_shrink`; arguments:
`arguments.shrink_call`.
"""

from __future__ import annotations

import dataclasses

import triton
import triton.language as tl

from .common import (
    channel_scaled,
    gdc_launch_dependents,
    gdc_wait,
    hint16,
    lora_a_rows,
    pick_slice,
    prefetch_rows,
    shrink_slices,
    slot_rank,
    token_tile,
)
from .planning import (
    TOKEN_COUNT_PARAMS,
    PlanKey,
    cast_and_precision,
    check_dot_dims,
    dot_dtype,
    hidden_split,
    max_tiles,
    next_pow2,
    prefetch_constexprs,
    small_t_block,
)


@triton.jit
def _store_rank_rows(out, acc, write, ATOMIC: tl.constexpr):
    if ATOMIC:
        tl.atomic_add(out, acc, mask=write, sem="relaxed")
    else:
        tl.store(out, acc, mask=write)


@triton.jit
def _slot_a_rows(s, slot, a0_ptr, a1_ptr, a2_ptr, a3_ptr, stride_a0_slot, stride_a0_rank, stride_a0_hidden,
                 stride_a1_slot, stride_a1_rank, stride_a1_hidden, stride_a2_slot, stride_a2_rank, stride_a2_hidden,
                 stride_a3_slot, stride_a3_rank, stride_a3_hidden, ALIGNED: tl.constexpr, BLOCK_R: tl.constexpr,
                 SLICES: tl.constexpr):
    """(a0_rows, a1_rows, a2_rows, a3_rows, stride_a0_hidden): (BLOCK_R,) pointers to the rank rows of
    slot `slot`'s A in each slice, and slice 0's column stride. SLICES == 1: "slice 0" is slice s of
    the launch (the program's own slice), its pointer and strides picked from the four."""
    if SLICES == 1:
        a0_rows = lora_a_rows(pick_slice(s, a0_ptr, a1_ptr, a2_ptr, a3_ptr), slot,
                              hint16(pick_slice(s, stride_a0_slot, stride_a1_slot, stride_a2_slot, stride_a3_slot),
                                     ALIGNED),
                              hint16(pick_slice(s, stride_a0_rank, stride_a1_rank, stride_a2_rank, stride_a3_rank),
                                     ALIGNED), BLOCK_R)
        stride_a0_hidden = pick_slice(s, stride_a0_hidden, stride_a1_hidden, stride_a2_hidden, stride_a3_hidden)
    else:
        a0_rows = lora_a_rows(a0_ptr, slot, hint16(stride_a0_slot, ALIGNED), hint16(stride_a0_rank, ALIGNED), BLOCK_R)
    a1_rows = lora_a_rows(a1_ptr, slot, hint16(stride_a1_slot, ALIGNED), hint16(stride_a1_rank, ALIGNED), BLOCK_R)
    a2_rows = lora_a_rows(a2_ptr, slot, hint16(stride_a2_slot, ALIGNED), hint16(stride_a2_rank, ALIGNED), BLOCK_R)
    a3_rows = lora_a_rows(a3_ptr, slot, hint16(stride_a3_slot, ALIGNED), hint16(stride_a3_rank, ALIGNED), BLOCK_R)
    return a0_rows, a1_rows, a2_rows, a3_rows, stride_a0_hidden


@triton.jit
def _store_slices(out, acc0, acc1, acc2, acc3, factor, s, slot, a0_ptr, a1_ptr, a2_ptr, a3_ptr, as0_ptr, as1_ptr,
                  as2_ptr, as3_ptr, stride_as0_slot, stride_as1_slot, stride_as2_slot, stride_as3_slot,
                  stride_out_slice, write, RANK: tl.constexpr, BLOCK_R: tl.constexpr, ATOMIC: tl.constexpr,
                  SLICES: tl.constexpr):
    """Stores (or atomically adds) acc_s * a_scale_s[slot, :] * factor at out + s * stride_out_slice
    for the first SLICES slices (the fp8 channel scales only for fp8 A; factor: scale, or a (rows, 1)
    column of per-token weights). SLICES == 1: acc0 is slice s of the launch, its scales picked."""
    offs_r = tl.arange(0, BLOCK_R)
    rank_ok = offs_r < RANK
    if SLICES == 1:
        acc0 = channel_scaled(acc0, a0_ptr, pick_slice(s, as0_ptr, as1_ptr, as2_ptr, as3_ptr), slot,
                              pick_slice(s, stride_as0_slot, stride_as1_slot, stride_as2_slot, stride_as3_slot),
                              offs_r, rank_ok)
    else:
        acc0 = channel_scaled(acc0, a0_ptr, as0_ptr, slot, stride_as0_slot, offs_r, rank_ok)
    _store_rank_rows(out, acc0 * factor, write, ATOMIC)
    if SLICES > 1:
        acc1 = channel_scaled(acc1, a1_ptr, as1_ptr, slot, stride_as1_slot, offs_r, rank_ok)
        _store_rank_rows(out + stride_out_slice, acc1 * factor, write, ATOMIC)
    if SLICES > 2:
        acc2 = channel_scaled(acc2, a2_ptr, as2_ptr, slot, stride_as2_slot, offs_r, rank_ok)
        _store_rank_rows(out + 2 * stride_out_slice, acc2 * factor, write, ATOMIC)
    if SLICES > 3:
        acc3 = channel_scaled(acc3, a3_ptr, as3_ptr, slot, stride_as3_slot, offs_r, rank_ok)
        _store_rank_rows(out + 3 * stride_out_slice, acc3 * factor, write, ATOMIC)


@triton.jit
def _shrink_pairs(x_ptr, a0_ptr, a1_ptr, a2_ptr, a3_ptr, as0_ptr, as1_ptr, as2_ptr, as3_ptr, ranks_ptr,
                  pair_slots_ptr, pair_weights_ptr, group,
                  has_group, tok, tok_ok, s, split, scale, hidden, stride_x_token, stride_x_hidden,
                  stride_a0_slot, stride_a0_rank, stride_a0_hidden, stride_a1_slot, stride_a1_rank, stride_a1_hidden,
                  stride_a2_slot, stride_a2_rank, stride_a2_hidden, stride_a3_slot, stride_a3_rank, stride_a3_hidden,
                  stride_as0_slot, stride_as1_slot, stride_as2_slot, stride_as3_slot, stride_out_plane,
                  stride_out_slice, stride_out_token, stride_out_rank, out_ptr,
                  RANK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr,
                  K_PER_SPLIT: tl.constexpr, ATOMIC: tl.constexpr, HAS_RANKS: tl.constexpr,
                  CAST_FP32: tl.constexpr, DOT_PRECISION: tl.constexpr, ALIGNED: tl.constexpr,
                  SLICES: tl.constexpr, PAIRS: tl.constexpr):
    """The shrink of a token tile whose tokens share one tuple of PAIRS slots (group `group`):

      out[p, s, t, j * RANK + c] = w[t, j] * scale * x[t, chunk p] @ A_s[slot_j, c, chunk p].T

    slot_j = pair_slots[group, j] (-1: no adapter in pair j, zero columns), w = pair_weights
    (tokens, PAIRS) float32. The pairs' rank columns lie side by side in the buffer's rank axis.
    fp8 A: each pair's columns are also multiplied by its slot's channel scales a_scale_s[slot_j, c].
    """
    offs_r = tl.arange(0, BLOCK_R)
    k_begin = split * K_PER_SPLIT
    plane = tl.where(ATOMIC, 0, split)
    stride_out_slice = hint16(stride_out_slice, ALIGNED)
    out0 = (out_ptr + plane.to(tl.int64) * hint16(stride_out_plane, ALIGNED) + s * stride_out_slice
            + tok[:, None] * hint16(stride_out_token, ALIGNED) + offs_r[None, :] * stride_out_rank)
    write = tok_ok[:, None] & (offs_r < RANK)[None, :]
    for j in tl.static_range(PAIRS):
        slot = tl.load(pair_slots_ptr + tl.where(has_group, group, 0) * PAIRS + j)
        has_pair = has_group & (slot >= 0)
        slot = tl.where(has_pair, slot, 0)
        rank = slot_rank(ranks_ptr, slot, has_pair, RANK, HAS_RANKS)
        a0_rows, a1_rows, a2_rows, a3_rows, sa0_h = _slot_a_rows(
            s, slot, a0_ptr, a1_ptr, a2_ptr, a3_ptr, stride_a0_slot, stride_a0_rank, stride_a0_hidden, stride_a1_slot,
            stride_a1_rank, stride_a1_hidden, stride_a2_slot, stride_a2_rank, stride_a2_hidden, stride_a3_slot,
            stride_a3_rank, stride_a3_hidden, ALIGNED, BLOCK_R, SLICES)
        k_end = tl.where(has_pair, tl.minimum(k_begin + K_PER_SPLIT, hidden), k_begin)
        acc0, acc1, acc2, acc3 = shrink_slices(x_ptr, a0_rows, a1_rows, a2_rows, a3_rows, sa0_h, stride_a1_hidden,
                                               stride_a2_hidden, stride_a3_hidden, tok, tok_ok, rank, k_begin, k_end,
                                               hidden, stride_x_token, stride_x_hidden, SLICES, BLOCK_M, BLOCK_K,
                                               BLOCK_R, CAST_FP32, DOT_PRECISION)
        w = scale * tl.load(pair_weights_ptr + tok * PAIRS + j, mask=tok_ok, other=0.0).to(tl.float32)[:, None]
        _store_slices(out0 + (j * RANK) * stride_out_rank, acc0, acc1, acc2, acc3, w, s, slot, a0_ptr, a1_ptr, a2_ptr,
                      a3_ptr, as0_ptr, as1_ptr, as2_ptr, as3_ptr, stride_as0_slot, stride_as1_slot, stride_as2_slot,
                      stride_as3_slot, stride_out_slice, write, RANK, BLOCK_R, ATOMIC, SLICES)


@triton.jit(do_not_specialize_on_alignment=TOKEN_COUNT_PARAMS)
def lora_shrink_kernel(
        # pointers: x, A per slice (slices 0..3), A's fp8 channel scales per slice, the per-slot ranks,
        # the adapter pairs (slots, weights)
        x_ptr, a0_ptr, a1_ptr, a2_ptr, a3_ptr, as0_ptr, as1_ptr, as2_ptr, as3_ptr, ranks_ptr, pair_slots_ptr,
        pair_weights_ptr,
        # pointers: the metadata, KernelMeta's index arrays in its order
        mapping_ptr, sorted_ptr, counts_ptr, starts_ptr, active_ptr,
        # scale and sizes
        scale, num_tokens, hidden, num_sorted, num_slots,
        # strides: x, then A per slice (slot, rank, hidden)
        stride_x_token, stride_x_hidden,
        stride_a0_slot, stride_a0_rank, stride_a0_hidden,
        stride_a1_slot, stride_a1_rank, stride_a1_hidden,
        stride_a2_slot, stride_a2_rank, stride_a2_hidden,
        stride_a3_slot, stride_a3_rank, stride_a3_hidden,
        # strides: A's channel scales per slice (slot; channels contiguous)
        stride_as0_slot, stride_as1_slot, stride_as2_slot, stride_as3_slot,
        # strides: out (plane, slice, token, rank)
        stride_out_plane, stride_out_slice, stride_out_token, stride_out_rank,
        # the output pointer
        out_ptr,
        # meta-parameters
        RANK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr,
        K_PER_SPLIT: tl.constexpr, NUM_GROUPS: tl.constexpr, GROUPS_P2: tl.constexpr,
        LORA_ONLY: tl.constexpr, ATOMIC: tl.constexpr, HAS_RANKS: tl.constexpr,
        CAST_FP32: tl.constexpr, DOT_PRECISION: tl.constexpr, ALIGNED: tl.constexpr,
        SMALL_T: tl.constexpr, USE_PDL: tl.constexpr, PREFETCH_LINES: tl.constexpr,
        PREFETCH_LINE: tl.constexpr, SLICES: tl.constexpr, PAIRS: tl.constexpr):
    """out[p, s, t, :RANK] = scale * x[t, chunk p] @ A_s[idx[t], :, chunk p].T.

    Grid (slice programs, SPLIT_K, tiles). SLICES == 1: program (s, p, tile) computes slice s.
    SLICES > 1 (grid axis 0 of size 1): each program computes all SLICES slices, loading every x
    tile once for all of them (a multi-slice shrink reads x once instead of once per slice).
    Plain stores write one plane per split (the workspace the expand kernel sums); ATOMIC adds
    every split into plane 0 of a zeroed output. Without LORA_ONLY (stand-alone shrink, no
    atomics), tokens of non-slot groups get zero rows. PREFETCH_LINES > 0 (with USE_PDL): the
    program's A chunks are prefetched into L2 while the kernel before it still runs.
    PAIRS > 0 (several adapters per token, `_shrink_pairs`): the metadata groups tokens by their
    tuple of slots; PAIRS == 0 compiles none of that code.
    fp8 (e4m3) A (every slice of a launch one dtype): tiles enter the dot in x's dtype, and the
    float32 result is multiplied once by the slot's channel scales a_scale_s[idx[t], c] (as{s}_ptr,
    (L, r) float32, contiguous per slot) before the store; 16-bit A compiles none of it.
    """
    s = tl.program_id(0)
    split = tl.program_id(1)
    pid = tl.program_id(2)
    # USE_PDL: launched as a programmatic dependent of the kernel before it. The metadata, ranks
    # and A are read before waiting for it (not outputs of a kernel that lets dependents start
    # early: see the module docstring); x only after.
    lora_id, tok, tok_ok, n_tok = token_tile(pid, mapping_ptr, sorted_ptr, counts_ptr, starts_ptr, active_ptr,
                                        num_slots, num_tokens, num_sorted, BLOCK_M, NUM_GROUPS, GROUPS_P2,
                                        LORA_ONLY, SMALL_T)
    has_lora = (lora_id >= 0) & (lora_id < num_slots) & (n_tok > 0)  # False without LORA_ONLY: no-LoRA rows
    rank = slot_rank(ranks_ptr, lora_id, has_lora, RANK, HAS_RANKS)
    slot = tl.where(has_lora, lora_id, 0)
    a0_rows, a1_rows, a2_rows, a3_rows, stride_a0_hidden = _slot_a_rows(
        s, slot, a0_ptr, a1_ptr, a2_ptr, a3_ptr, stride_a0_slot, stride_a0_rank, stride_a0_hidden, stride_a1_slot,
        stride_a1_rank, stride_a1_hidden, stride_a2_slot, stride_a2_rank, stride_a2_hidden, stride_a3_slot,
        stride_a3_rank, stride_a3_hidden, ALIGNED, BLOCK_R, SLICES)
    hidden = hint16(hidden, ALIGNED)
    stride_x_token = hint16(stride_x_token, ALIGNED)
    k_begin = split * K_PER_SPLIT
    k_end = tl.where(has_lora, tl.minimum(k_begin + K_PER_SPLIT, hidden), k_begin)  # no LoRA: no loop
    if PREFETCH_LINES > 0:
        rank_ok = tl.arange(0, BLOCK_R) < rank
        prefetch_rows(a0_rows, rank_ok, k_begin, k_end, stride_a0_hidden, PREFETCH_LINES, PREFETCH_LINE)
        if SLICES > 1:
            prefetch_rows(a1_rows, rank_ok, k_begin, k_end, stride_a1_hidden, PREFETCH_LINES, PREFETCH_LINE)
        if SLICES > 2:
            prefetch_rows(a2_rows, rank_ok, k_begin, k_end, stride_a2_hidden, PREFETCH_LINES, PREFETCH_LINE)
        if SLICES > 3:
            prefetch_rows(a3_rows, rank_ok, k_begin, k_end, stride_a3_hidden, PREFETCH_LINES, PREFETCH_LINE)
    if USE_PDL:
        # Every program waits, idle ones too: the grid must not complete (and let the expand and
        # the kernels after it run) before the kernel before it has.
        gdc_wait()
        gdc_launch_dependents()
    if n_tok <= 0:
        return
    if PAIRS > 0:
        _shrink_pairs(x_ptr, a0_ptr, a1_ptr, a2_ptr, a3_ptr, as0_ptr, as1_ptr, as2_ptr, as3_ptr, ranks_ptr,
                      pair_slots_ptr, pair_weights_ptr, lora_id,
                      has_lora, tok, tok_ok, s, split, scale, hidden, stride_x_token, stride_x_hidden,
                      stride_a0_slot, stride_a0_rank, stride_a0_hidden, stride_a1_slot, stride_a1_rank,
                      stride_a1_hidden, stride_a2_slot, stride_a2_rank, stride_a2_hidden, stride_a3_slot,
                      stride_a3_rank, stride_a3_hidden, stride_as0_slot, stride_as1_slot, stride_as2_slot,
                      stride_as3_slot, stride_out_plane, stride_out_slice, stride_out_token,
                      stride_out_rank, out_ptr, RANK, BLOCK_M, BLOCK_K, BLOCK_R, K_PER_SPLIT, ATOMIC, HAS_RANKS,
                      CAST_FP32, DOT_PRECISION, ALIGNED, SLICES, PAIRS)
        return
    acc0, acc1, acc2, acc3 = shrink_slices(x_ptr, a0_rows, a1_rows, a2_rows, a3_rows, stride_a0_hidden,
                                           stride_a1_hidden, stride_a2_hidden, stride_a3_hidden,
                                            tok, tok_ok, rank, k_begin, k_end, hidden, stride_x_token,
                                            stride_x_hidden,
                                            SLICES, BLOCK_M, BLOCK_K, BLOCK_R, CAST_FP32, DOT_PRECISION)
    offs_r = tl.arange(0, BLOCK_R)
    plane = tl.where(ATOMIC, 0, split)
    stride_out_slice = hint16(stride_out_slice, ALIGNED)
    out = (out_ptr + plane.to(tl.int64) * hint16(stride_out_plane, ALIGNED) + s * stride_out_slice
           + tok[:, None] * hint16(stride_out_token, ALIGNED) + offs_r[None, :] * stride_out_rank)
    write = tok_ok[:, None] & (offs_r < RANK)[None, :]       # real tokens, the buffer's rank columns
    _store_slices(out, acc0, acc1, acc2, acc3, scale, s, slot, a0_ptr, a1_ptr, a2_ptr, a3_ptr, as0_ptr, as1_ptr,
                  as2_ptr, as3_ptr, stride_as0_slot, stride_as1_slot, stride_as2_slot, stride_as3_slot,
                  stride_out_slice, write, RANK, BLOCK_R, ATOMIC, SLICES)


# ------------------------------------------------------------------------------- launch plan

@dataclasses.dataclass(frozen=True, eq=False)
class ShrinkPlan(PlanKey):
    """How `lora_shrink_kernel` is launched. USE_PDL: launched as a programmatic dependent of the
    kernel before it; its gdc_wait comes before any read of x, so the kernel before -- which may
    write x, y or the metadata -- is complete first, and only then may the expand start."""

    KERNEL = "shrink"
    grid: tuple
    constexprs: dict
    num_warps: int
    num_stages: int
    num_partials: int          # planes of the output (1 for the stand-alone shrink)
    atomic: bool               # the output must be zeroed first
    num_tokens: int = 0        # T (the launch's PDL policy depends on it: planning.pdl_launch)


def plan_shrink(num_tokens: int, hidden: int, rank: int, num_slices: int, num_groups: int,
                x_dtype: str, w_dtype: str, config: dict, *, lora_only: bool, workspace: bool,
                has_ranks: bool, aligned: bool = False, pdl: bool = False,
                deterministic: bool = False, pairs: int = 0) -> ShrinkPlan:
    """Grid and meta-parameters of `lora_shrink_kernel`.

    workspace=True: the output has one plane per split (the linear path); else SPLIT_K > 1 means
    atomic adds into a zeroed output. config: BLOCK_M, BLOCK_K, SPLIT_K, num_warps, num_stages,
    PREFETCH (default True: L2 prefetch of the A chunk before the PDL wait, if pdl), ALL_SLICES
    (default False: one program per slice; True: every program computes all the launch's slices,
    x read once for them -- SLICES = num_slices, grid axis 0 of size 1).
    deterministic=True: never atomic adds (without a workspace the shrink runs unsplit) and never
    SMALL_T, whatever the config says (see configs.deterministic_config).
    pairs > 0: several adapters per token (`_shrink_pairs`), the metadata's ids are group ids; no
    L2 prefetch (the group's slots are known only after a load).
    """
    if deterministic:
        config = {**config, "SMALL_T": False, **({} if workspace else {"SPLIT_K": 1})}
    block_m, block_k = int(config["BLOCK_M"]), int(config["BLOCK_K"])
    small_t, block_m = small_t_block(num_tokens, block_m, config)
    block_r = max(16, next_pow2(rank))
    check_dot_dims(block_m, block_k, block_r)
    split, k_per_split = hidden_split(hidden, int(config.get("SPLIT_K", 1)), block_k)
    atomic = split > 1 and not workspace
    cast, precision = cast_and_precision((x_dtype, dot_dtype(w_dtype, x_dtype)))
    constexprs = dict(RANK=rank, BLOCK_M=block_m, BLOCK_K=block_k, BLOCK_R=block_r,
                      K_PER_SPLIT=k_per_split, NUM_GROUPS=num_groups, GROUPS_P2=next_pow2(num_groups),
                      LORA_ONLY=bool(lora_only or atomic), ATOMIC=atomic, HAS_RANKS=bool(has_ranks),
                      CAST_FP32=cast, DOT_PRECISION=precision, ALIGNED=bool(aligned), SMALL_T=small_t,
                      USE_PDL=bool(pdl), **prefetch_constexprs(pdl and config.get("PREFETCH", True) and not pairs,
                                                               k_per_split, w_dtype),
                      SLICES=num_slices if config.get("ALL_SLICES") else 1, PAIRS=int(pairs))
    grid = (num_slices // constexprs["SLICES"], split,
            max_tiles(num_tokens, num_groups, block_m, small_t, constexprs["LORA_ONLY"]))
    return ShrinkPlan(grid, constexprs, int(config.get("num_warps", 4)), int(config.get("num_stages", 2)),
                      split if workspace else 1, atomic, int(num_tokens))
