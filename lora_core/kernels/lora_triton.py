"""Multi-LoRA (Punica) kernels in Triton: shrink, expand and a fused shrink+expand.

One kernel source for both sides: this module imports only `triton` (no torch, no jax).
`torch_lora.ops.triton` launches the kernels on torch tensors, `jax_lora.ops.triton` inside
`jax.jit` through `jax_triton`; both take their grids and meta-parameters from the `plan_*`
functions at the bottom, which are plain Python over shapes and dtype names.

Math (SPEC section 4), idx[t] = slot of token t (or -1), every product accumulated in float32:

  shrink:  buf[s, t, :] = scale * x[t] @ A_s[idx[t]].T                     (0 where idx[t] = -1)
  expand:  y[t, off_s:off_s+n_s] = (y[t, ...] if add_inputs else 0) + buf[s, t] @ B_s[idx[t]].T
                                   + bias_s[idx[t]]        (rows with idx[t] = -1 untouched)
  fused:   expand(shrink(x)) in one launch, the rank-sized intermediate kept in registers.

Work decomposition. Tokens are grouped by adapter through the kernel metadata (SPEC section 3):
group g holds the tokens sorted[start[g] : start[g] + count[g]] of slot active[g]. A group is cut
into tiles of BLOCK_M tokens, and the grid's "tile" axis enumerates the tiles of all groups one
after another: program p finds its group by a prefix sum over the (max_loras + 1) per-group tile
counts, done in registers at the start of every program (`_group_tile`). The number of tiles is at
most cdiv(T, BLOCK_M) + number of groups, so a grid of that size covers every mapping, and the grid
depends only on (T, max_loras), never on the mapping (CUDA-graph capturable, one jit program).
Programs past the last tile return at once. Each active adapter's weights are read by the programs
of its own tiles only: inactive slots are never read, and with one tile per group (decode) each
weight byte is read once per step.

Weights: A_s is (L, r, H), B_s (L, n_s, r), any strides. Several slices go in one launch: the
slice is a grid coordinate and its pointers/strides are picked with a select (up to MAX_SLICES
per launch). Heterogeneous ranks: with `ranks` given, slot l uses only its first ranks[l] rank
rows/columns (masked loads, so the padding is neither read nor used), equal to the zero-padded
computation.

Small batches (T <= SMALL_T_MAX, decode): the whole batch is one tile per group; program g takes
group g and finds its tokens by comparing the mapping with the group's id, in the same round trip
as the group ids (no prefix sum, no sorted-order load): decode time is made of dependent loads.

Programmatic dependent launch (USE_PDL, Hopper): in the two-kernel path the expand is launched as
a dependent of the shrink and loads its metadata, y tile and (one rank block) B tile before
`gdc_wait()`. The shrink is launched as a dependent too, of whatever kernel precedes it: it reads
the metadata and ranks and prefetches its A chunk into L2 before waiting (`gdc_wait()`), reads x
only after, and only then signals `gdc_launch_dependents()`, so everything before the shrink is
complete when the expand's early loads run. The expand signals at its start, so a dependent after
it (the next layer's shrink) can be scheduled early: its metadata loads and weight prefetch then
overlap the expand. What is read before the wait -- metadata, ranks, weights -- must therefore
not be written by a kernel that lets its dependents start early (ours only write y and the
workspace; XLA's and torch's own kernels never do: they release dependents when they complete).

Split-K (shrink): the hidden dimension is cut into SPLIT_K chunks, one per program, to spread the
weight reads of few adapters over many SMs at decode sizes. The partial sums either go to separate
planes of a float32 workspace (NUM_PARTIALS planes, summed by the expand kernel on load: no atomics,
no zeroing) or, for the stand-alone shrink, are atomically added into a zeroed output.

Interpreter: under TRITON_INTERPRET=1 tiles are upcast to float32 right after loading
(CAST_FP32): the interpreter computes bf16 arithmetic wrongly (ENV.md). Compiled kernels never do.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from typing import Sequence

import triton
import triton.language as tl

try:  # programmatic dependent launch (Hopper); absent from older Triton: then never used
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
    HAVE_PDL = True
except ImportError:  # pragma: no cover - depends on the Triton version
    HAVE_PDL = False

    @triton.jit
    def gdc_wait():
        pass

    @triton.jit
    def gdc_launch_dependents():
        pass

__all__ = [
    "MAX_SLICES", "lora_shrink_kernel", "lora_expand_kernel", "lora_fused_kernel",
    "ShrinkPlan", "ExpandPlan", "FusedPlan", "plan_shrink", "plan_expand", "plan_fused",
    "interpreting", "next_pow2",
]

MAX_SLICES = 4  # slices handled by one launch; more are launched in groups of MAX_SLICES
MAX_PARTIALS = 32  # split-K planes the expand kernel sums (unrolled loads)


def interpreting() -> bool:
    """True when Triton runs kernels in its interpreter (TRITON_INTERPRET=1 at import time)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


# ----------------------------------------------------------------------------------- device helpers

@triton.jit
def _group_tile(pid, counts_ptr, starts_ptr, active_ptr, num_slots,
                BLOCK_M: tl.constexpr, NUM_GROUPS: tl.constexpr, GROUPS_P2: tl.constexpr,
                LORA_ONLY: tl.constexpr):
    """Which tile program `pid` computes: (slot id, first sorted position, tokens in the tile).

    Group g owns cdiv(count[g], BLOCK_M) consecutive tile numbers (0 for an empty group, and with
    LORA_ONLY for groups whose id is not a slot 0..num_slots-1). A tile count <= 0 means idle.
    """
    g = tl.arange(0, GROUPS_P2)
    real_group = g < NUM_GROUPS
    ids = tl.load(active_ptr + g, mask=real_group, other=-1)
    counts = tl.load(counts_ptr + g, mask=real_group, other=0)
    if LORA_ONLY:
        counts = tl.where((ids >= 0) & (ids < num_slots), counts, 0)
    tiles = (counts + BLOCK_M - 1) // BLOCK_M
    tiles_end = tl.cumsum(tiles, axis=0)                    # inclusive prefix sum
    grp = tl.sum((tiles_end <= pid).to(tl.int32), axis=0)    # first group whose tiles reach past pid
    mine = g == grp
    lora_id = tl.sum(tl.where(mine, ids, 0), axis=0)
    count = tl.sum(tl.where(mine, counts, 0), axis=0)
    first_tile = tl.sum(tl.where(mine, tiles_end - tiles, 0), axis=0)
    m0 = (pid - first_tile) * BLOCK_M
    starts = tl.load(starts_ptr + g, mask=real_group, other=0)  # loaded with the counts: one round trip
    start = tl.sum(tl.where(mine, starts, 0), axis=0)
    n_tok = tl.minimum(count - m0, BLOCK_M)                  # <= 0 past the last tile
    return lora_id, start + m0, n_tok


@triton.jit
def _tile_tokens(sorted_ptr, pos0, n_tok, num_sorted, num_tokens, BLOCK_M: tl.constexpr):
    """Token ids of a tile and the mask of real ones (inside the group, the sorted array and x)."""
    offs = tl.arange(0, BLOCK_M)
    pos = pos0 + offs
    in_tile = (offs < n_tok) & (pos < num_sorted)
    tok = tl.load(sorted_ptr + pos, mask=in_tile, other=0)
    tok_ok = in_tile & (tok >= 0) & (tok < num_tokens)
    return tl.where(tok_ok, tok, 0).to(tl.int64), tok_ok


@triton.jit
def _tile(pid, mapping_ptr, sorted_ptr, counts_ptr, starts_ptr, active_ptr, num_slots, num_tokens, num_sorted,
          BLOCK_M: tl.constexpr, NUM_GROUPS: tl.constexpr, GROUPS_P2: tl.constexpr, LORA_ONLY: tl.constexpr,
          SMALL_T: tl.constexpr):
    """(slot id, token ids (BLOCK_M,) int64, mask of real tokens, number of real tokens) of program pid.

    SMALL_T (the whole batch fits one tile, T <= BLOCK_M): program g serves group g, and its tokens
    are the rows whose mapping equals the group's id -- read together with the group ids in one
    round trip, without the sorted order (two fewer dependent loads: what decode latency is made
    of). Without LORA_ONLY one extra program (pid == NUM_GROUPS) owns the rows without LoRA (they
    get zero rows); programs of non-slot groups are idle.
    Otherwise tiles of BLOCK_M tokens of the sorted order (`_group_tile`).
    """
    if SMALL_T:
        offs = tl.arange(0, BLOCK_M)
        lora_id = tl.load(active_ptr + tl.minimum(pid, NUM_GROUPS - 1))
        lora_id = tl.where(pid < NUM_GROUPS, lora_id, -1)
        m = tl.load(mapping_ptr + offs, mask=offs < num_tokens, other=-2)   # -2: past the batch
        # (vector-only masks: the interpreter mishandles vector & scalar booleans)
        slot_row = (m >= 0) & (m < num_slots)
        tok_ok = (m == lora_id) & slot_row                  # false for every row if lora_id is no slot
        if not LORA_ONLY:
            extra = (offs * 0 + pid) == NUM_GROUPS
            tok_ok = tok_ok | ((m != -2) & (slot_row == 0) & extra)
            lora_id = tl.where((lora_id >= 0) & (lora_id < num_slots), lora_id, -1)
        tok = offs.to(tl.int64)
    else:
        lora_id, pos0, n = _group_tile(pid, counts_ptr, starts_ptr, active_ptr, num_slots,
                                       BLOCK_M, NUM_GROUPS, GROUPS_P2, LORA_ONLY)
        tok, tok_ok = _tile_tokens(sorted_ptr, pos0, n, num_sorted, num_tokens, BLOCK_M)
    n_tok = tl.sum(tok_ok.to(tl.int32), axis=0)
    return lora_id, tok, tok_ok, n_tok


@triton.jit
def _hint16(v, ALIGNED: tl.constexpr):
    """v, with its divisibility by 16 made visible to the compiler when the launcher checked it
    (ALIGNED). Triton specialises integer arguments itself when launched from torch; through
    jax_triton it does not, and without the hint loads along a row are not vectorised."""
    if ALIGNED:
        v = v // 16 * 16
    return v


@triton.jit
def _prefetch_l2(ptrs, mask):
    """Asks for the cache lines at ptrs (where mask) to be brought into L2, without waiting or
    using registers (PTX prefetch.global.L2). Compiled kernels only: not under the interpreter."""
    tl.inline_asm_elementwise("{ .reg .pred p; setp.ne.b32 p, $2, 0; @p prefetch.global.L2 [$1]; mov.u32 $0, 0; }",
                              "=r,l,r", [ptrs, mask.to(tl.int32)], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _prefetch_rows(row_ptrs, row_ok, k_begin, k_end, stride_k, LINES: tl.constexpr, LINE: tl.constexpr):
    """L2 prefetch of columns [k_begin, k_end) of the rows at row_ptrs (BLOCK,), LINE elements per
    128-byte line, at most LINES lines per row (columns contiguous: stride_k == 1 is the case that
    matters; other strides prefetch one element per line-sized step)."""
    k = k_begin + tl.arange(0, LINES) * LINE
    _prefetch_l2(row_ptrs[:, None] + k[None, :] * stride_k, row_ok[:, None] & (k < k_end)[None, :])


@triton.jit
def _pick(s, v0, v1, v2, v3):
    """v_s for a slice number s in 0..3 (pointers or integers)."""
    return tl.where(s == 0, v0, tl.where(s == 1, v1, tl.where(s == 2, v2, v3)))


@triton.jit
def _slot_rank(ranks_ptr, lora_id, has_lora, RANK: tl.constexpr, HAS_RANKS: tl.constexpr):
    """The rank columns slot `lora_id` really uses (RANK without a ranks array; 0 without LoRA)."""
    rank = RANK
    if HAS_RANKS:
        rank = tl.minimum(tl.load(ranks_ptr + tl.where(has_lora, lora_id, 0)), RANK)
        rank = tl.maximum(rank, 0)
    return tl.where(has_lora, rank, 0)


@triton.jit
def _runs_copy(odd_rank, b_tail: tl.constexpr, HAS_RANKS: tl.constexpr):
    """Whether the program runs copy b_tail (1: with B_TAIL) of code compiled per B_TAIL: without
    per-slot ranks the only copy (0); with them, copy 1 for ranks that are not multiples of 8."""
    if HAS_RANKS:
        return odd_rank == (b_tail == 1)
    else:
        return True


@triton.jit
def _load_rank_cols(ptrs, row_ok, kk, rank, RANK: tl.constexpr, HAS_RANKS: tl.constexpr,
                    ZERO_TAIL: tl.constexpr):
    """A tile whose columns kk are rank columns: those >= rank come out 0.

    With per-slot ranks the load mask is rounded up to 8 columns (16 bytes, inside the same DRAM
    sectors) so loads stay vectorised; the exact rank is then applied in registers (ZERO_TAIL).
    ZERO_TAIL=False: the caller knows rank is a multiple of 8 (the rounded mask is exact), and the
    tile goes from the load to its dot untouched -- what the software pipeliner needs to keep it in
    shared memory (a select in between costs a shared-memory round trip per tile). Without per-slot
    ranks, ZERO_TAIL=True applies the (runtime) rank select all the same: a tile loaded once, outside
    any loop, is then staged through shared memory instead of being held in registers in the dot's
    layout (the expand's B_SELECT: 183 -> 76 registers for a 256 x 64 B tile)."""
    if HAS_RANKS:
        rank_ld = tl.minimum((rank + 7) // 8 * 8, RANK)
        t = tl.load(ptrs, mask=row_ok[:, None] & (kk < rank_ld)[None, :], other=0.0)
    else:
        t = tl.load(ptrs, mask=row_ok[:, None] & (kk < RANK)[None, :], other=0.0)
    if ZERO_TAIL:
        t = tl.where((kk < rank)[None, :], t, tl.zeros_like(t))
    return t


@triton.jit
def _shrink_slices(x_ptr, a0_rows, a1_rows, a2_rows, a3_rows, sa0_h, sa1_h, sa2_h, sa3_h, tok, tok_ok, rank,
                   k_begin, k_end, hidden, stride_xt, stride_xh, NUM_SLICES: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr,
                   CAST_FP32: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """(acc0, acc1, acc2, acc3), acc_s[m, r] = sum_{k in [k_begin, k_end)} x[tok[m], k] * A_s[r, k]
    for r < rank and the first NUM_SLICES slices (the others stay zero): a{s}_rows (BLOCK_R,) point
    at the rank rows of slice s's A for one slot, sa{s}_h is its column stride. Each x tile is
    loaded once for all the slices."""
    offs_k = tl.arange(0, BLOCK_K)
    rank_ok = tl.arange(0, BLOCK_R) < rank                   # real rank rows of A: padding is not read
    x_rows = x_ptr + tok[:, None] * stride_xt
    acc0 = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    acc1 = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    acc2 = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    acc3 = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    for k0 in range(k_begin, k_end, BLOCK_K):
        k = k0 + offs_k
        k_ok = k < hidden                                    # the last chunk of a hidden size that
        xt = tl.load(x_rows + k[None, :] * stride_xh,        # is not a multiple of BLOCK_K
                     mask=tok_ok[:, None] & k_ok[None, :], other=0.0)
        a_ok = rank_ok[:, None] & k_ok[None, :]
        at0 = tl.load(a0_rows[:, None] + k[None, :] * sa0_h, mask=a_ok, other=0.0)
        if CAST_FP32:
            xt = xt.to(tl.float32)
            at0 = at0.to(tl.float32)
        acc0 = tl.dot(xt, tl.trans(at0), acc0, input_precision=DOT_PRECISION)
        if NUM_SLICES > 1:
            at1 = tl.load(a1_rows[:, None] + k[None, :] * sa1_h, mask=a_ok, other=0.0)
            acc1 = tl.dot(xt, tl.trans(at1.to(xt.dtype)), acc1, input_precision=DOT_PRECISION)
        if NUM_SLICES > 2:
            at2 = tl.load(a2_rows[:, None] + k[None, :] * sa2_h, mask=a_ok, other=0.0)
            acc2 = tl.dot(xt, tl.trans(at2.to(xt.dtype)), acc2, input_precision=DOT_PRECISION)
        if NUM_SLICES > 3:
            at3 = tl.load(a3_rows[:, None] + k[None, :] * sa3_h, mask=a_ok, other=0.0)
            acc3 = tl.dot(xt, tl.trans(at3.to(xt.dtype)), acc3, input_precision=DOT_PRECISION)
    return acc0, acc1, acc2, acc3


@triton.jit
def _a_rows(a_ptr, lora_id, stride_al, stride_ar, BLOCK_R: tl.constexpr):
    """(BLOCK_R,) pointers to the rank rows of slot lora_id's A."""
    return a_ptr + lora_id.to(tl.int64) * stride_al + tl.arange(0, BLOCK_R) * stride_ar


@triton.jit
def _shrink_tile(x_ptr, a_ptr, tok, tok_ok, lora_id, rank, k_begin, k_end, hidden,
                 stride_xt, stride_xh, stride_al, stride_ar, stride_ah,
                 BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr,
                 CAST_FP32: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """acc[m, r] = sum_{k in [k_begin, k_end)} x[tok[m], k] * A[lora_id, r, k], for r < rank."""
    a_rows = _a_rows(a_ptr, lora_id, stride_al, stride_ar, BLOCK_R)
    acc, _1, _2, _3 = _shrink_slices(x_ptr, a_rows, a_rows, a_rows, a_rows, stride_ah, stride_ah, stride_ah,
                                     stride_ah, tok, tok_ok, rank, k_begin, k_end, hidden, stride_xt, stride_xh,
                                     1, BLOCK_M, BLOCK_K, BLOCK_R, CAST_FP32, DOT_PRECISION)
    return acc


@triton.jit
def _workspace_lhs(buf_rows, stride_bp, stride_br, kk, tok_ok, rank, RANK: tl.constexpr, HAS_RANKS: tl.constexpr,
                   NUM_PARTIALS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr,
                   ZERO_TAIL: tl.constexpr):
    """(BLOCK_M, BLOCK_R) float32: the sum of the NUM_PARTIALS workspace planes at rank columns kk
    (columns past the slot's rank zeroed exactly: ZERO_TAIL, which per-slot ranks need)."""
    lhs = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    for p in tl.static_range(NUM_PARTIALS):                  # split-K planes: independent loads
        lhs += _load_rank_cols(buf_rows + p * stride_bp + kk[None, :] * stride_br, tok_ok, kk, rank,
                               RANK, HAS_RANKS, ZERO_TAIL).to(tl.float32)
    return lhs


@triton.jit
def _rank_dot(acc, lhs, bt, CAST_FP32: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """acc + lhs @ bt.T: lhs (BLOCK_M, BLOCK_R) float32, bt (BLOCK_N, BLOCK_R) in the weights' dtype."""
    if CAST_FP32:
        bt = bt.to(tl.float32)
    else:
        lhs = lhs.to(bt.dtype)
    return tl.dot(lhs, tl.trans(bt), acc, input_precision=DOT_PRECISION)


@triton.jit
def _y_tile(y_ptr, tok, tok_ok, cols, col_ok, y_col0, stride_yt, stride_yn, ADD_INPUTS: tl.constexpr):
    """Offsets and write mask of the output tile, and (ADD_INPUTS) its current values.

    Loaded before the tile's math so that its latency overlaps the weight loads, and kept in y's
    own dtype until the store (half the registers of float32 for 16-bit y: the expand's tile is
    register-limited at prefill sizes)."""
    y_offs = tok[:, None] * stride_yt + (y_col0 + cols)[None, :] * stride_yn
    write = tok_ok[:, None] & col_ok[None, :]                # rows of real LoRA tokens, slice columns
    y_old = tl.zeros((tok.shape[0], cols.shape[0]), dtype=y_ptr.dtype.element_ty)
    if ADD_INPUTS:
        y_old = tl.load(y_ptr + y_offs, mask=write, other=0.0)
    return y_offs, write, y_old


@triton.jit
def _store_slice(acc, y_old, out_ptr, y_offs, write, bias_ptr, lora_id, cols, col_ok, stride_cl, stride_cn,
                 has_bias):
    """y[tok, y_col0 + cols] = (y if ADD_INPUTS else 0) + acc + bias[lora_id, cols], cast once."""
    if has_bias:
        bias = tl.load(bias_ptr + lora_id.to(tl.int64) * stride_cl + cols * stride_cn, mask=col_ok, other=0.0)
        acc += bias.to(tl.float32)[None, :]
    tl.store(out_ptr + y_offs, (acc + y_old.to(tl.float32)).to(out_ptr.dtype.element_ty), mask=write)


@triton.jit
def _slice_of_tile(j, NT1: tl.constexpr, NT2: tl.constexpr, NT3: tl.constexpr, BLOCK_N: tl.constexpr):
    """Slice s of output tile j, and the tile's first column inside the slice.

    NT1..NT3: the first tile number of slices 1..3 (a large number for absent slices)."""
    s = (j >= NT1).to(tl.int32) + (j >= NT2).to(tl.int32) + (j >= NT3).to(tl.int32)
    first = tl.where(s == 0, 0, tl.where(s == 1, NT1, tl.where(s == 2, NT2, NT3)))
    return s, (j - first) * BLOCK_N


# ------------------------------------------------------------------------------------------ shrink

@triton.jit
def _store_rank_rows(out, acc, write, ATOMIC: tl.constexpr):
    if ATOMIC:
        tl.atomic_add(out, acc, mask=write, sem="relaxed")
    else:
        tl.store(out, acc, mask=write)


@triton.jit
def lora_shrink_kernel(
        x_ptr, a0_ptr, a1_ptr, a2_ptr, a3_ptr, ranks_ptr,
        mapping_ptr, sorted_ptr, counts_ptr, starts_ptr, active_ptr,
        scale, num_tokens, hidden, num_sorted, num_slots,
        stride_xt, stride_xh,
        sa0_l, sa0_r, sa0_h, sa1_l, sa1_r, sa1_h, sa2_l, sa2_r, sa2_h, sa3_l, sa3_r, sa3_h,
        stride_op, stride_os, stride_ot, stride_or,
        out_ptr,
        RANK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr,
        K_PER_SPLIT: tl.constexpr, NUM_GROUPS: tl.constexpr, GROUPS_P2: tl.constexpr,
        LORA_ONLY: tl.constexpr, ATOMIC: tl.constexpr, HAS_RANKS: tl.constexpr,
        CAST_FP32: tl.constexpr, DOT_PRECISION: tl.constexpr, ALIGNED: tl.constexpr,
        SMALL_T: tl.constexpr, USE_PDL: tl.constexpr, PREFETCH_LINES: tl.constexpr,
        PREFETCH_LINE: tl.constexpr, SLICES: tl.constexpr):
    """out[p, s, t, :RANK] = scale * x[t, chunk p] @ A_s[idx[t], :, chunk p].T.

    Grid (slice programs, SPLIT_K, tiles). SLICES == 1: program (s, p, tile) computes slice s.
    SLICES > 1 (grid axis 0 of size 1): each program computes all SLICES slices, loading every x
    tile once for all of them (a multi-slice shrink reads x once instead of once per slice).
    Plain stores write one plane per split (the workspace the expand kernel sums); ATOMIC adds
    every split into plane 0 of a zeroed output. Without LORA_ONLY (stand-alone shrink, no
    atomics), tokens of non-slot groups get zero rows. PREFETCH_LINES > 0 (with USE_PDL): the
    program's A chunks are prefetched into L2 while the kernel before it still runs.
    """
    s = tl.program_id(0)
    split = tl.program_id(1)
    pid = tl.program_id(2)
    # USE_PDL: launched as a programmatic dependent of the kernel before it. The metadata, ranks
    # and A are read before waiting for it (not outputs of a kernel that lets dependents start
    # early: see the module docstring); x only after.
    lora_id, tok, tok_ok, n_tok = _tile(pid, mapping_ptr, sorted_ptr, counts_ptr, starts_ptr, active_ptr,
                                        num_slots, num_tokens, num_sorted, BLOCK_M, NUM_GROUPS, GROUPS_P2,
                                        LORA_ONLY, SMALL_T)
    has_lora = (lora_id >= 0) & (lora_id < num_slots) & (n_tok > 0)  # False without LORA_ONLY: no-LoRA rows
    rank = _slot_rank(ranks_ptr, lora_id, has_lora, RANK, HAS_RANKS)
    slot = tl.where(has_lora, lora_id, 0)
    if SLICES == 1:
        a0_rows = _a_rows(_pick(s, a0_ptr, a1_ptr, a2_ptr, a3_ptr), slot,
                          _hint16(_pick(s, sa0_l, sa1_l, sa2_l, sa3_l), ALIGNED),
                          _hint16(_pick(s, sa0_r, sa1_r, sa2_r, sa3_r), ALIGNED), BLOCK_R)
        sa0_h = _pick(s, sa0_h, sa1_h, sa2_h, sa3_h)
    else:
        a0_rows = _a_rows(a0_ptr, slot, _hint16(sa0_l, ALIGNED), _hint16(sa0_r, ALIGNED), BLOCK_R)
    a1_rows = _a_rows(a1_ptr, slot, _hint16(sa1_l, ALIGNED), _hint16(sa1_r, ALIGNED), BLOCK_R)
    a2_rows = _a_rows(a2_ptr, slot, _hint16(sa2_l, ALIGNED), _hint16(sa2_r, ALIGNED), BLOCK_R)
    a3_rows = _a_rows(a3_ptr, slot, _hint16(sa3_l, ALIGNED), _hint16(sa3_r, ALIGNED), BLOCK_R)
    hidden = _hint16(hidden, ALIGNED)
    stride_xt = _hint16(stride_xt, ALIGNED)
    k_begin = split * K_PER_SPLIT
    k_end = tl.where(has_lora, tl.minimum(k_begin + K_PER_SPLIT, hidden), k_begin)  # no LoRA: no loop
    if PREFETCH_LINES > 0:
        rank_ok = tl.arange(0, BLOCK_R) < rank
        _prefetch_rows(a0_rows, rank_ok, k_begin, k_end, sa0_h, PREFETCH_LINES, PREFETCH_LINE)
        if SLICES > 1:
            _prefetch_rows(a1_rows, rank_ok, k_begin, k_end, sa1_h, PREFETCH_LINES, PREFETCH_LINE)
        if SLICES > 2:
            _prefetch_rows(a2_rows, rank_ok, k_begin, k_end, sa2_h, PREFETCH_LINES, PREFETCH_LINE)
        if SLICES > 3:
            _prefetch_rows(a3_rows, rank_ok, k_begin, k_end, sa3_h, PREFETCH_LINES, PREFETCH_LINE)
    if USE_PDL:
        # Every program waits, idle ones too: the grid must not complete (and let the expand and
        # the kernels after it run) before the kernel before it has.
        gdc_wait()
        gdc_launch_dependents()
    if n_tok <= 0:
        return
    acc0, acc1, acc2, acc3 = _shrink_slices(x_ptr, a0_rows, a1_rows, a2_rows, a3_rows, sa0_h, sa1_h, sa2_h, sa3_h,
                                            tok, tok_ok, rank, k_begin, k_end, hidden, stride_xt, stride_xh,
                                            SLICES, BLOCK_M, BLOCK_K, BLOCK_R, CAST_FP32, DOT_PRECISION)
    offs_r = tl.arange(0, BLOCK_R)
    plane = tl.where(ATOMIC, 0, split)
    stride_os = _hint16(stride_os, ALIGNED)
    out = (out_ptr + plane.to(tl.int64) * _hint16(stride_op, ALIGNED) + s * stride_os
           + tok[:, None] * _hint16(stride_ot, ALIGNED) + offs_r[None, :] * stride_or)
    write = tok_ok[:, None] & (offs_r < RANK)[None, :]       # real tokens, the buffer's rank columns
    _store_rank_rows(out, acc0 * scale, write, ATOMIC)
    if SLICES > 1:
        _store_rank_rows(out + stride_os, acc1 * scale, write, ATOMIC)
    if SLICES > 2:
        _store_rank_rows(out + 2 * stride_os, acc2 * scale, write, ATOMIC)
    if SLICES > 3:
        _store_rank_rows(out + 3 * stride_os, acc3 * scale, write, ATOMIC)


# ------------------------------------------------------------------------------------------ expand

@triton.jit
def _expand_y(j, live, tok, tok_ok, y_ptr, width0, width1, width2, width3, off0, off1, off2, off3, stride_yt,
              stride_yn, NUM_TILES: tl.constexpr, NT1: tl.constexpr, NT2: tl.constexpr, NT3: tl.constexpr,
              ADD_INPUTS: tl.constexpr, BLOCK_N: tl.constexpr, ALIGNED: tl.constexpr):
    """The current y of output tile j (zeros unless live > 0, past NUM_TILES, or outside its slice):
    what `_expand_tile` adds to, loaded one tile ahead by lora_expand_kernel's Y_AHEAD loop."""
    s, n0 = _slice_of_tile(tl.minimum(j, NUM_TILES - 1), NT1, NT2, NT3, BLOCK_N)
    cols = n0 + tl.arange(0, BLOCK_N)
    col_ok = ((cols < _hint16(_pick(s, width0, width1, width2, width3), ALIGNED)) & ((cols * 0 + j) < NUM_TILES)
              & ((cols * 0 + live) > 0))
    _, _, y_old = _y_tile(y_ptr, tok, tok_ok, cols, col_ok, _hint16(_pick(s, off0, off1, off2, off3), ALIGNED),
                          _hint16(stride_yt, ALIGNED), stride_yn, ADD_INPUTS)
    return y_old


@triton.jit
def _expand_tile(j, lora_id, tok, tok_ok, rank, buf_ptr, b0_ptr, b1_ptr, b2_ptr, b3_ptr,
                 c0_ptr, c1_ptr, c2_ptr, c3_ptr, y_ptr, out_ptr,
                 stride_bp, stride_bs, stride_bt, stride_br,
                 sb0_l, sb0_n, sb0_r, sb1_l, sb1_n, sb1_r, sb2_l, sb2_n, sb2_r, sb3_l, sb3_n, sb3_r,
                 sc0_l, sc0_n, sc1_l, sc1_n, sc2_l, sc2_n, sc3_l, sc3_n,
                 width0, width1, width2, width3, off0, off1, off2, off3, stride_yt, stride_yn,
                 RANK: tl.constexpr, NUM_PARTIALS: tl.constexpr, NUM_TILES: tl.constexpr, NT1: tl.constexpr,
                 NT2: tl.constexpr, NT3: tl.constexpr, BIAS0: tl.constexpr, BIAS1: tl.constexpr,
                 BIAS2: tl.constexpr, BIAS3: tl.constexpr, ADD_INPUTS: tl.constexpr, HAS_RANKS: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
                 CAST_FP32: tl.constexpr, DOT_PRECISION: tl.constexpr, ALIGNED: tl.constexpr,
                 WAIT: tl.constexpr, y_given, Y_GIVEN: tl.constexpr, lhs_given, LHS_GIVEN: tl.constexpr,
                 B_TAIL: tl.constexpr):
    """Output tile j (over all slices; none past NUM_TILES) of one token tile: see lora_expand_kernel.
    B_TAIL: zero B's columns past the slot's rank in registers (`_load_rank_cols` ZERO_TAIL; needed
    with per-slot ranks unless the rank is a multiple of 8).
    WAIT: gdc_wait (PDL) after the loads the shrink does not write (B tile, y tile), before the
    workspace's. Y_GIVEN: y_given is the tile's current y (`_expand_y`, loaded ahead), else loaded here.
    LHS_GIVEN (one rank block): lhs_given is the token tile's summed workspace rows of this tile's
    slice (`_workspace_lhs`, loaded once per program), else loaded here."""
    s, n0 = _slice_of_tile(tl.minimum(j, NUM_TILES - 1), NT1, NT2, NT3, BLOCK_N)
    b_ptr = _pick(s, b0_ptr, b1_ptr, b2_ptr, b3_ptr)
    stride_bl = _hint16(_pick(s, sb0_l, sb1_l, sb2_l, sb3_l), ALIGNED)
    stride_bn = _hint16(_pick(s, sb0_n, sb1_n, sb2_n, sb3_n), ALIGNED)
    stride_bk = _pick(s, sb0_r, sb1_r, sb2_r, sb3_r)
    cols = n0 + tl.arange(0, BLOCK_N)
    # the slice's own columns, of a real tile (a program's last tiles may lie past NUM_TILES)
    col_ok = (cols < _hint16(_pick(s, width0, width1, width2, width3), ALIGNED)) & ((cols * 0 + j) < NUM_TILES)
    offs_r = tl.arange(0, BLOCK_R)
    b_rows = b_ptr + lora_id.to(tl.int64) * stride_bl + cols[:, None] * stride_bn
    buf_rows = (buf_ptr + s * _hint16(stride_bs, ALIGNED) + tok[:, None] * _hint16(stride_bt, ALIGNED))
    stride_bp = _hint16(stride_bp, ALIGNED)
    y_offs, write, y_old = _y_tile(y_ptr, tok, tok_ok, cols, col_ok, _hint16(_pick(s, off0, off1, off2, off3), ALIGNED),
                                   _hint16(stride_yt, ALIGNED), stride_yn, ADD_INPUTS and not Y_GIVEN)
    if Y_GIVEN:
        y_old = y_given
    if RANK <= BLOCK_R:
        # One rank block (decode ranks): its B tile -- cold weights the shrink does not write --
        # is loaded before waiting for the shrink, off the critical path.
        bt = _load_rank_cols(b_rows + offs_r[None, :] * stride_bk, col_ok, offs_r, rank, RANK, HAS_RANKS, B_TAIL)
    if WAIT:
        # The shrink's workspace is complete past this point. Outside the rank loop on purpose:
        # the software pipeliner hoists the first iteration's loads above anything inside it.
        gdc_wait()
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if RANK <= BLOCK_R:
        if LHS_GIVEN:
            lhs = lhs_given
        else:
            lhs = _workspace_lhs(buf_rows, stride_bp, stride_br, offs_r, tok_ok, rank, RANK, HAS_RANKS,
                                 NUM_PARTIALS, BLOCK_M, BLOCK_R, HAS_RANKS or B_TAIL)
        acc = _rank_dot(acc, lhs, bt, CAST_FP32, DOT_PRECISION)
    else:
        for k0 in range(0, rank, BLOCK_R):                   # real rank only
            kk = k0 + offs_r
            bt = _load_rank_cols(b_rows + kk[None, :] * stride_bk, col_ok, kk, rank, RANK, HAS_RANKS, B_TAIL)
            lhs = _workspace_lhs(buf_rows, stride_bp, stride_br, kk, tok_ok, rank, RANK, HAS_RANKS,
                                 NUM_PARTIALS, BLOCK_M, BLOCK_R, HAS_RANKS)
            acc = _rank_dot(acc, lhs, bt, CAST_FP32, DOT_PRECISION)
    has_bias = _pick(s, BIAS0, BIAS1, BIAS2, BIAS3)
    _store_slice(acc, y_old, out_ptr, y_offs, write, _pick(s, c0_ptr, c1_ptr, c2_ptr, c3_ptr), lora_id,
                 cols, col_ok, _hint16(_pick(s, sc0_l, sc1_l, sc2_l, sc3_l), ALIGNED),
                 _pick(s, sc0_n, sc1_n, sc2_n, sc3_n), has_bias)


@triton.jit
def lora_expand_kernel(
        buf_ptr, b0_ptr, b1_ptr, b2_ptr, b3_ptr, c0_ptr, c1_ptr, c2_ptr, c3_ptr, ranks_ptr,
        mapping_ptr, sorted_ptr, counts_ptr, starts_ptr, active_ptr, y_ptr,
        num_tokens, num_sorted, num_slots,
        stride_bp, stride_bs, stride_bt, stride_br,
        sb0_l, sb0_n, sb0_r, sb1_l, sb1_n, sb1_r, sb2_l, sb2_n, sb2_r, sb3_l, sb3_n, sb3_r,
        sc0_l, sc0_n, sc1_l, sc1_n, sc2_l, sc2_n, sc3_l, sc3_n,
        width0, width1, width2, width3, off0, off1, off2, off3,
        stride_yt, stride_yn,
        out_ptr,
        RANK: tl.constexpr, NUM_PARTIALS: tl.constexpr, NUM_TILES: tl.constexpr, NT1: tl.constexpr,
        NT2: tl.constexpr, NT3: tl.constexpr, BIAS0: tl.constexpr, BIAS1: tl.constexpr, BIAS2: tl.constexpr,
        BIAS3: tl.constexpr, ADD_INPUTS: tl.constexpr, HAS_RANKS: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, TILES_N: tl.constexpr,
        Y_AHEAD: tl.constexpr, NUM_GROUPS: tl.constexpr, GROUPS_P2: tl.constexpr,
        CAST_FP32: tl.constexpr, DOT_PRECISION: tl.constexpr, ALIGNED: tl.constexpr,
        SMALL_T: tl.constexpr, USE_PDL: tl.constexpr, PREFETCH_LINES: tl.constexpr,
        PREFETCH_LINE: tl.constexpr, PREFETCH_Y_LINES: tl.constexpr, PREFETCH_Y_LINE: tl.constexpr,
        B_SELECT: tl.constexpr):
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
    per-slot ranks, which makes Triton stage it through shared memory (see `_load_rank_cols`).
    """
    if USE_PDL:
        # A programmatic dependent after this kernel (the next layer's shrink) may be scheduled
        # now; it waits (gdc_wait) for this grid to complete before it touches memory.
        gdc_launch_dependents()
    i = tl.program_id(0)
    pid = tl.program_id(1)
    lora_id, tok, tok_ok, n_tok = _tile(pid, mapping_ptr, sorted_ptr, counts_ptr, starts_ptr, active_ptr,
                                        num_slots, num_tokens, num_sorted, BLOCK_M, NUM_GROUPS, GROUPS_P2,
                                        True, SMALL_T)
    if n_tok <= 0:
        return
    rank = _slot_rank(ranks_ptr, lora_id, lora_id >= 0, RANK, HAS_RANKS)
    # Two call sites on purpose: one tile waits (PDL) between its B/y loads and its workspace loads,
    # which a loop would let the software pipeliner reorder; several tiles wait once, before a real
    # loop (scf.for) that the pipeliner overlaps -- unrolling it (static_range) would lose that.
    # Per-slot ranks: B's columns past a rank that is not a multiple of 8 are zeroed in registers,
    # which costs a pipelined loop a shared-memory round trip per B tile (measured: T2048 D4 expand
    # 15% slower). The rank is uniform over a program (one slot), so a pipelined loop over B tiles
    # (several output tiles, or rank blocks) is compiled twice, with and without that step
    # (B_TAIL), and each program runs the copy its rank needs. One tile of one rank block loads
    # its B tile once, outside any loop: one copy, with the step (two would cost registers:
    # 80 -> 142 at T128, rank 64).
    odd_rank = (rank % 8) != 0
    if TILES_N == 1:
        TWO_COPIES: tl.constexpr = HAS_RANKS and RANK > BLOCK_R
        for b_tail in tl.static_range(1 + TWO_COPIES):
            if _runs_copy(odd_rank, b_tail, TWO_COPIES):
                _expand_tile(i, lora_id, tok, tok_ok, rank, buf_ptr, b0_ptr, b1_ptr, b2_ptr, b3_ptr,
                             c0_ptr, c1_ptr, c2_ptr, c3_ptr, y_ptr, out_ptr, stride_bp, stride_bs, stride_bt,
                             stride_br, sb0_l, sb0_n, sb0_r, sb1_l, sb1_n, sb1_r, sb2_l, sb2_n, sb2_r,
                             sb3_l, sb3_n, sb3_r, sc0_l, sc0_n, sc1_l, sc1_n, sc2_l, sc2_n, sc3_l, sc3_n,
                             width0, width1, width2, width3, off0, off1, off2, off3, stride_yt, stride_yn,
                             RANK, NUM_PARTIALS, NUM_TILES, NT1, NT2, NT3, BIAS0, BIAS1, BIAS2, BIAS3, ADD_INPUTS,
                             HAS_RANKS, BLOCK_M, BLOCK_N, BLOCK_R, CAST_FP32, DOT_PRECISION, ALIGNED, USE_PDL,
                             0.0, False, 0.0, False, (b_tail == 1) or ((HAS_RANKS or B_SELECT) and not TWO_COPIES))
    else:
        # The program's tiles lie in one slice (plan_expand pads each slice's tiles to a multiple
        # of TILES_N): its slice s0 and first column n0.
        s0, n0 = _slice_of_tile(tl.minimum(i * TILES_N, NUM_TILES - 1), NT1, NT2, NT3, BLOCK_N)
        width_s0 = _pick(s0, width0, width1, width2, width3)
        if PREFETCH_LINES > 0:
            # The program's B tiles (weights: not written by the shrink) into L2 while it runs.
            b_rows0 = (_pick(s0, b0_ptr, b1_ptr, b2_ptr, b3_ptr)
                       + lora_id.to(tl.int64) * _hint16(_pick(s0, sb0_l, sb1_l, sb2_l, sb3_l), ALIGNED))
            stride_bn0 = _hint16(_pick(s0, sb0_n, sb1_n, sb2_n, sb3_n), ALIGNED)
            for tp in tl.static_range(TILES_N):
                cols = n0 + tp * BLOCK_N + tl.arange(0, BLOCK_N)
                _prefetch_rows(b_rows0 + cols * stride_bn0, cols < width_s0, 0, rank,
                               _pick(s0, sb0_r, sb1_r, sb2_r, sb3_r), PREFETCH_LINES, PREFETCH_LINE)
        if ADD_INPUTS and PREFETCH_Y_LINES > 0:
            # The program's y rows (final: the kernel before the shrink completed before the shrink
            # let this grid start) into L2 while the shrink runs.
            y_rows0 = (y_ptr + tok * _hint16(stride_yt, ALIGNED)
                       + (_hint16(_pick(s0, off0, off1, off2, off3), ALIGNED) + n0) * stride_yn)
            _prefetch_rows(y_rows0, tok_ok, 0, tl.minimum(TILES_N * BLOCK_N, width_s0 - n0), stride_yn,
                           PREFETCH_Y_LINES, PREFETCH_Y_LINE)
        if Y_AHEAD:
            # the first tile's y, before the wait (final already, as above)
            y_next = _expand_y(i * TILES_N, 1, tok, tok_ok, y_ptr, width0, width1, width2, width3,
                               off0, off1, off2, off3, stride_yt, stride_yn, NUM_TILES, NT1, NT2, NT3,
                               ADD_INPUTS, BLOCK_N, ALIGNED)
        else:
            y_next = 0.0
        if USE_PDL:
            gdc_wait()                                   # before the loop: every tile reads the workspace
        if RANK <= BLOCK_R:
            # one rank block: the token tile's workspace rows of slice s0, summed once
            lhs = _workspace_lhs(buf_ptr + s0 * _hint16(stride_bs, ALIGNED) + tok[:, None] * _hint16(stride_bt, ALIGNED),
                                 _hint16(stride_bp, ALIGNED), stride_br, tl.arange(0, BLOCK_R), tok_ok, rank, RANK,
                                 HAS_RANKS, NUM_PARTIALS, BLOCK_M, BLOCK_R, HAS_RANKS)
        else:
            lhs = 0.0
        for b_tail in tl.static_range(1 + HAS_RANKS):
            if _runs_copy(odd_rank, b_tail, HAS_RANKS):
                for t in range(TILES_N):
                    y_cur = y_next
                    if Y_AHEAD:
                        y_next = _expand_y(i * TILES_N + t + 1, TILES_N - 1 - t, tok, tok_ok, y_ptr, width0,
                                           width1, width2, width3, off0, off1, off2, off3, stride_yt, stride_yn,
                                           NUM_TILES, NT1, NT2, NT3, ADD_INPUTS, BLOCK_N, ALIGNED)
                    _expand_tile(i * TILES_N + t, lora_id, tok, tok_ok, rank, buf_ptr, b0_ptr, b1_ptr, b2_ptr,
                                 b3_ptr, c0_ptr, c1_ptr, c2_ptr, c3_ptr, y_ptr, out_ptr, stride_bp, stride_bs,
                                 stride_bt, stride_br, sb0_l, sb0_n, sb0_r, sb1_l, sb1_n, sb1_r, sb2_l, sb2_n,
                                 sb2_r, sb3_l, sb3_n, sb3_r, sc0_l, sc0_n, sc1_l, sc1_n, sc2_l, sc2_n, sc3_l, sc3_n,
                                 width0, width1, width2, width3, off0, off1, off2, off3, stride_yt, stride_yn,
                                 RANK, NUM_PARTIALS, NUM_TILES, NT1, NT2, NT3, BIAS0, BIAS1, BIAS2, BIAS3,
                                 ADD_INPUTS, HAS_RANKS, BLOCK_M, BLOCK_N, BLOCK_R, CAST_FP32, DOT_PRECISION,
                                 ALIGNED, False, y_cur, Y_AHEAD, lhs, RANK <= BLOCK_R, b_tail == 1)


# ------------------------------------------------------------------------------------------- fused

BARRIER_SPAN = tl.constexpr(1 << 20)  # what one launch adds to a token tile's barrier counter (> programs per tile)


# Polls after which a waiting program gives up with a `trap` (a CUDA error instead of a hang): at
# ~0.5-1 us per L2 round trip, 2^24 polls are 8-16 s, far beyond any legitimate wait (a tile's
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
def lora_fused_kernel(
        x_ptr, a0_ptr, a1_ptr, a2_ptr, a3_ptr, b0_ptr, b1_ptr, b2_ptr, b3_ptr,
        c0_ptr, c1_ptr, c2_ptr, c3_ptr, ranks_ptr,
        mapping_ptr, sorted_ptr, counts_ptr, starts_ptr, active_ptr, y_ptr, sync_ptr, ws_ptr,
        scale, num_tokens, hidden, num_sorted, num_slots,
        stride_xt, stride_xh,
        sa0_l, sa0_r, sa0_h, sa1_l, sa1_r, sa1_h, sa2_l, sa2_r, sa2_h, sa3_l, sa3_r, sa3_h,
        sb0_l, sb0_n, sb0_r, sb1_l, sb1_n, sb1_r, sb2_l, sb2_n, sb2_r, sb3_l, sb3_n, sb3_r,
        sc0_l, sc0_n, sc1_l, sc1_n, sc2_l, sc2_n, sc3_l, sc3_n,
        width0, width1, width2, width3, off0, off1, off2, off3,
        stride_yt, stride_yn, stride_wp, stride_ws, stride_wt,
        out_ptr,
        RANK: tl.constexpr, NUM_SLICES: tl.constexpr, SPLIT_K: tl.constexpr, SPLIT_P2: tl.constexpr,
        K_PER_SPLIT: tl.constexpr, WS_GROUP: tl.constexpr,
        NUM_TILES: tl.constexpr, NT1: tl.constexpr, NT2: tl.constexpr, NT3: tl.constexpr,
        BIAS0: tl.constexpr, BIAS1: tl.constexpr, BIAS2: tl.constexpr, BIAS3: tl.constexpr,
        ADD_INPUTS: tl.constexpr, HAS_RANKS: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr,
        NUM_GROUPS: tl.constexpr, GROUPS_P2: tl.constexpr, PHASE: tl.constexpr,
        CAST_FP32: tl.constexpr, DOT_PRECISION: tl.constexpr, ALIGNED: tl.constexpr,
        SMALL_T: tl.constexpr, USE_PDL: tl.constexpr, PREFETCH_LINES: tl.constexpr,
        PREFETCH_LINE: tl.constexpr, BARRIER_POLLS: tl.constexpr, B_SELECT: tl.constexpr):
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
    co-resident (decode grids of 33 tiles x 32 programs were refused on the H200): the launchers
    ask for it only when told to (FusedPlan.cooperative). The interpreter runs programs one after
    another, so it launches twice: PHASE 1 (steps 1-2 without waiting), PHASE 2 (step 3); PHASE 0
    (compiled) does everything in one launch. Needs BLOCK_R >= RANK (one rank block).
    USE_PDL: launched as a programmatic dependent of the kernel before it, waiting for it before
    reading x and y (metadata and weights are read, or prefetched, before: as in the shrink).
    """
    p = tl.program_id(0)
    row = tl.program_id(1)
    # Before waiting for the kernel before (USE_PDL): the metadata, the B tile (registers) and the
    # A chunk (L2 prefetch); x and y only after.
    lora_id, tok, tok_ok, n_tok = _tile(row, mapping_ptr, sorted_ptr, counts_ptr, starts_ptr, active_ptr,
                                        num_slots, num_tokens, num_sorted, BLOCK_M, NUM_GROUPS, GROUPS_P2,
                                        True, SMALL_T)
    busy = n_tok > 0
    lora_id = tl.where(busy, lora_id, 0)
    rank = _slot_rank(ranks_ptr, lora_id, busy, RANK, HAS_RANKS)
    offs_r = tl.arange(0, BLOCK_R)
    stride_wt = _hint16(stride_wt, ALIGNED)
    is_out = p < NUM_TILES
    s_out, n0 = _slice_of_tile(tl.minimum(p, NUM_TILES - 1), NT1, NT2, NT3, BLOCK_N)
    cols = n0 + tl.arange(0, BLOCK_N)
    col_ok = (cols < _hint16(_pick(s_out, width0, width1, width2, width3), ALIGNED)) & ((cols * 0 + p) < NUM_TILES)
    if PHASE != 1:
        b_ptr = _pick(s_out, b0_ptr, b1_ptr, b2_ptr, b3_ptr)
        bt = _load_rank_cols(b_ptr + lora_id.to(tl.int64) * _hint16(_pick(s_out, sb0_l, sb1_l, sb2_l, sb3_l), ALIGNED)
                             + cols[:, None] * _hint16(_pick(s_out, sb0_n, sb1_n, sb2_n, sb3_n), ALIGNED)
                             + offs_r[None, :] * _pick(s_out, sb0_r, sb1_r, sb2_r, sb3_r),
                             col_ok, offs_r, rank, RANK, HAS_RANKS, HAS_RANKS or B_SELECT)
    s_in = p % NUM_SLICES
    split = p // NUM_SLICES
    a_ptr = _pick(s_in, a0_ptr, a1_ptr, a2_ptr, a3_ptr)
    stride_al = _hint16(_pick(s_in, sa0_l, sa1_l, sa2_l, sa3_l), ALIGNED)
    stride_ar = _hint16(_pick(s_in, sa0_r, sa1_r, sa2_r, sa3_r), ALIGNED)
    stride_ah = _pick(s_in, sa0_h, sa1_h, sa2_h, sa3_h)
    hidden = _hint16(hidden, ALIGNED)
    k_begin = split * K_PER_SPLIT
    k_end = tl.where(p < NUM_SLICES * SPLIT_K, tl.minimum(k_begin + K_PER_SPLIT, hidden), k_begin)
    if PREFETCH_LINES > 0:
        _prefetch_rows(a_ptr + lora_id.to(tl.int64) * stride_al + offs_r * stride_ar, offs_r < rank,
                       k_begin, k_end, stride_ah, PREFETCH_LINES, PREFETCH_LINE)
    if USE_PDL:
        gdc_wait()                               # every program, idle ones too (see the shrink)
        gdc_launch_dependents()
    if n_tok <= 0:
        return                                   # the whole row (every program of it) is idle
    if PHASE != 1:
        y_offs, write, y_old = _y_tile(y_ptr, tok, tok_ok, cols, col_ok,
                                       _hint16(_pick(s_out, off0, off1, off2, off3), ALIGNED),
                                       _hint16(stride_yt, ALIGNED), stride_yn, ADD_INPUTS)
    if PHASE != 2:
        if p < NUM_SLICES * SPLIT_K:
            acc = _shrink_tile(x_ptr, a_ptr, tok, tok_ok, lora_id, rank, k_begin, k_end, hidden,
                               _hint16(stride_xt, ALIGNED), stride_xh, stride_al, stride_ar, stride_ah,
                               BLOCK_M, BLOCK_K, BLOCK_R, CAST_FP32, DOT_PRECISION)
            ws = (ws_ptr + split.to(tl.int64) * _hint16(stride_wp, ALIGNED) + s_in * _hint16(stride_ws, ALIGNED)
                  + tok[:, None] * stride_wt + offs_r[None, :])
            tl.store(ws, acc * scale, mask=tok_ok[:, None] & (offs_r < RANK)[None, :])
        _row_barrier(sync_ptr + row, p == 0, tl.num_programs(0), PHASE == 0, BARRIER_POLLS)
    if PHASE != 1:
        if is_out:
            # The SPLIT_K planes, WS_GROUP at a time in one load (all of a group in flight at once;
            # decode: every plane in one load), from L2 (".cg": not L1), summed.
            lhs = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
            for g in tl.static_range(0, SPLIT_P2, WS_GROUP):
                planes = g + tl.arange(0, WS_GROUP)
                ws_rows = (ws_ptr + planes[:, None, None].to(tl.int64) * _hint16(stride_wp, ALIGNED)
                           + s_out * _hint16(stride_ws, ALIGNED) + tok[None, :, None] * stride_wt
                           + offs_r[None, None, :])
                ws_ok = ((planes < SPLIT_K)[:, None, None] & tok_ok[None, :, None]
                         & (offs_r < rank)[None, None, :])
                lhs += tl.sum(tl.load(ws_rows, mask=ws_ok, other=0.0, cache_modifier=".cg"), axis=0)
            if CAST_FP32:
                bt = bt.to(tl.float32)
            else:
                lhs = lhs.to(bt.dtype)
            acc = tl.dot(lhs, tl.trans(bt), input_precision=DOT_PRECISION)
            _store_slice(acc, y_old, out_ptr, y_offs, write, _pick(s_out, c0_ptr, c1_ptr, c2_ptr, c3_ptr), lora_id,
                         cols, col_ok, _hint16(_pick(s_out, sc0_l, sc1_l, sc2_l, sc3_l), ALIGNED),
                         _pick(s_out, sc0_n, sc1_n, sc2_n, sc3_n), _pick(s_out, BIAS0, BIAS1, BIAS2, BIAS3))


# ------------------------------------------------------------------------------- launch planning
# Plain Python over shapes and dtype names: the torch and JAX launchers both call these, so the
# two sides launch identical kernels with identical meta-parameters.

def _cast_and_precision(dtypes: Sequence[str]) -> tuple[bool, str]:
    """(CAST_FP32, DOT_PRECISION): upcast under the interpreter or when operand dtypes differ."""
    cast = interpreting() or len(set(dtypes)) > 1
    fp32 = cast or "float32" in dtypes
    return cast, ("ieee" if fp32 else "tf32")


def _check_dot_dims(*dims: int) -> None:
    # The interpreter does not enforce tl.dot's rules; assert them so CPU tests catch them.
    for d in dims:
        if d < 16 or d & (d - 1):
            raise AssertionError(f"tl.dot block dims must be powers of two >= 16, got {d}")


def _slice_tiles(widths: Sequence[int], block_n: int, tiles_per_program: int = 1) -> dict:
    """NT1..NT3: the first output-tile number of slices 1..3, and the total number of tiles. Each
    slice's tile count is rounded up to a multiple of tiles_per_program, so that the tiles of one
    program never straddle two slices (the padding tiles lie past the slice's width: masked)."""
    starts, total = [], 0
    for w in widths:
        starts.append(total)
        total += triton.cdiv(triton.cdiv(int(w), block_n), tiles_per_program) * tiles_per_program
    big = 1 << 30
    nt = {f"NT{i}": (starts[i] if i < len(widths) else big) for i in (1, 2, 3)}
    return nt, total


SMALL_T_MAX = 32  # batches up to this many tokens use the one-tile-per-group mode (SMALL_T)


def small_t_block(num_tokens: int, block_m: int, config: dict | None = None) -> tuple[bool, int]:
    """(SMALL_T, BLOCK_M): the whole batch in one tile per group when T <= SMALL_T_MAX, unless the
    launch config says SMALL_T False (then BLOCK_M-token tiles of the sorted order, as past
    SMALL_T_MAX: smaller tiles at T = 17-32, two more dependent metadata loads)."""
    if num_tokens <= SMALL_T_MAX and (config or {}).get("SMALL_T", True):
        return True, max(block_m, max(16, next_pow2(num_tokens)))
    return False, block_m


def max_tiles(num_tokens: int, num_groups: int, block_m: int, small_t: bool = False,
              lora_only: bool = True) -> int:
    """Tiles of any mapping of num_tokens tokens into num_groups groups: the tile-axis grid size."""
    if small_t:
        # Program g serves group g. The active ids are unique values in ascending order, padded
        # (SPEC section 3): at most num_tokens + 1 groups (one of them -1) hold tokens.
        return min(num_groups, num_tokens + 1) if lora_only else num_groups + 1
    return triton.cdiv(num_tokens, block_m) + min(num_groups, num_tokens)


@dataclasses.dataclass(frozen=True, eq=False)
class ShrinkPlan:
    grid: tuple
    constexprs: dict
    num_warps: int
    num_stages: int
    num_partials: int          # planes of the output (1 for the stand-alone shrink)
    atomic: bool               # the output must be zeroed first

    @property
    def launch_pdl(self) -> bool:
        """Launched as a programmatic dependent of the kernel before it (USE_PDL: its first
        instruction is gdc_wait, so the kernel before -- which may write x, y or the metadata -- is
        complete before anything is read, and only then is the expand allowed to start)."""
        return bool(self.constexprs.get("USE_PDL"))

    @functools.cached_property
    def key(self) -> tuple:
        """Hashable identity of the launch (grid, meta-parameters, warps, stages)."""
        return (self.grid, tuple(sorted(self.constexprs.items())), self.num_warps, self.num_stages)


@dataclasses.dataclass(frozen=True, eq=False)
class ExpandPlan:
    grid: tuple
    constexprs: dict
    num_warps: int
    num_stages: int

    @functools.cached_property
    def key(self) -> tuple:
        """Hashable identity of the launch (grid, meta-parameters, warps, stages)."""
        return (self.grid, tuple(sorted(self.constexprs.items())), self.num_warps, self.num_stages)

    @property
    def launch_pdl(self) -> bool:
        """Launched as a programmatic dependent of the shrink before it (USE_PDL: its gdc_wait
        precedes every workspace read; the y tile it loads earlier was complete before the shrink,
        a normal launch, started)."""
        return bool(self.constexprs.get("USE_PDL"))


@dataclasses.dataclass(frozen=True, eq=False)
class FusedPlan(ExpandPlan):
    workspace_shape: tuple = ()   # (SPLIT_K, slices, T, rank) float32

    # Ask for a cooperative launch (co-residency checked by the driver, which refuses large decode
    # grids: see lora_fused_kernel). JAX_LORA_TRITON_COOPERATIVE=1 turns it on.
    cooperative = os.environ.get("JAX_LORA_TRITON_COOPERATIVE", "0") == "1"

    @property
    def sync_ints(self) -> int:
        """int32 barrier counters the launch needs, one per token tile (zeroed once, reused)."""
        return self.grid[1]

    @functools.cached_property
    def phases(self) -> tuple:
        """PHASE values to launch in order: one launch compiled, two under the interpreter."""
        phase = self.constexprs["PHASE"]
        return (1, 2) if interpreting() and phase == 0 else (phase,)


def _hidden_split(hidden: int, split: int, block_k: int) -> tuple[int, int]:
    """(SPLIT_K, K_PER_SPLIT): `split` clamped to 1..min(BLOCK_K chunks, MAX_PARTIALS), each split a
    whole number of BLOCK_K chunks, and the count of splits those chunks really make."""
    split = max(1, min(split, triton.cdiv(hidden, block_k), MAX_PARTIALS))
    k_per_split = triton.cdiv(triton.cdiv(hidden, split), block_k) * block_k
    return triton.cdiv(hidden, k_per_split), k_per_split


PREFETCH_MAX_LINES = 64  # L2 prefetch of at most this many 128-byte lines per weight row
# JAX_LORA_TRITON_PREFETCH: "0" / "1" turn the L2 weight prefetch off / on everywhere (experiments);
# otherwise configs.use_prefetch decides per size. Read once, here, for both places that ask.
PREFETCH_SWITCH = os.environ.get("JAX_LORA_TRITON_PREFETCH", "auto")
_DTYPE_BYTES = {"float16": 2, "bfloat16": 2, "float32": 4}


def _prefetch(pdl: bool, columns: int, w_dtype: str) -> dict:
    """PREFETCH_LINES / PREFETCH_LINE: prefetch a program's weight chunk into L2 before waiting for
    the kernel before it (PDL launches, compiled only: inline PTX)."""
    line = 128 // _DTYPE_BYTES.get(w_dtype, 2)
    off = not pdl or interpreting() or PREFETCH_SWITCH == "0"
    lines = 0 if off else min(PREFETCH_MAX_LINES, next_pow2(triton.cdiv(columns, line)))
    return dict(PREFETCH_LINES=lines, PREFETCH_LINE=line)


def plan_shrink(num_tokens: int, hidden: int, rank: int, num_slices: int, num_groups: int,
                x_dtype: str, w_dtype: str, config: dict, *, lora_only: bool, workspace: bool,
                has_ranks: bool, aligned: bool = False, pdl: bool = False) -> ShrinkPlan:
    """Grid and meta-parameters of `lora_shrink_kernel`.

    workspace=True: the output has one plane per split (the linear path); else SPLIT_K > 1 means
    atomic adds into a zeroed output. config: BLOCK_M, BLOCK_K, SPLIT_K, num_warps, num_stages,
    PREFETCH (default True: L2 prefetch of the A chunk before the PDL wait, if pdl), ALL_SLICES
    (default False: one program per slice; True: every program computes all the launch's slices,
    x read once for them -- SLICES = num_slices, grid axis 0 of size 1).
    """
    block_m, block_k = int(config["BLOCK_M"]), int(config["BLOCK_K"])
    small_t, block_m = small_t_block(num_tokens, block_m, config)
    block_r = max(16, next_pow2(rank))
    _check_dot_dims(block_m, block_k, block_r)
    split, k_per_split = _hidden_split(hidden, int(config.get("SPLIT_K", 1)), block_k)
    atomic = split > 1 and not workspace
    cast, precision = _cast_and_precision((x_dtype, w_dtype))
    constexprs = dict(RANK=rank, BLOCK_M=block_m, BLOCK_K=block_k, BLOCK_R=block_r,
                      K_PER_SPLIT=k_per_split, NUM_GROUPS=num_groups, GROUPS_P2=next_pow2(num_groups),
                      LORA_ONLY=bool(lora_only or atomic), ATOMIC=atomic, HAS_RANKS=bool(has_ranks),
                      CAST_FP32=cast, DOT_PRECISION=precision, ALIGNED=bool(aligned), SMALL_T=small_t,
                      USE_PDL=bool(pdl), **_prefetch(pdl and config.get("PREFETCH", True), k_per_split, w_dtype),
                      SLICES=num_slices if config.get("ALL_SLICES") else 1)
    grid = (num_slices // constexprs["SLICES"], split,
            max_tiles(num_tokens, num_groups, block_m, small_t, constexprs["LORA_ONLY"]))
    return ShrinkPlan(grid, constexprs, int(config.get("num_warps", 4)), int(config.get("num_stages", 2)),
                      split if workspace else 1, atomic)


def _epilogue_constexprs(widths, bias_flags, add_inputs, has_ranks, block_n, tiles_per_program=1):
    nt, total = _slice_tiles(widths, block_n, tiles_per_program)
    flags = list(bias_flags) + [False] * (MAX_SLICES - len(bias_flags))
    c = dict(nt)
    c.update({f"BIAS{i}": bool(flags[i]) for i in range(MAX_SLICES)})
    c.update(ADD_INPUTS=bool(add_inputs), HAS_RANKS=bool(has_ranks))
    return c, total


def plan_expand(num_tokens: int, rank: int, widths: Sequence[int], num_groups: int, num_partials: int,
                w_dtype: str, y_dtype: str, config: dict, *, add_inputs: bool, bias_flags: Sequence[bool],
                has_ranks: bool, aligned: bool = False, pdl: bool = False) -> ExpandPlan:
    """Grid and meta-parameters of `lora_expand_kernel`. config: BLOCK_M, BLOCK_N, BLOCK_R, warps, stages,
    TILES_N (output tiles per program, default 1), Y_AHEAD (with TILES_N > 1: load the next tile's y
    before this tile's math; default False), PREFETCH / PREFETCH_Y (with TILES_N > 1 and pdl:
    prefetch the program's B tiles / y rows into L2 before waiting for the shrink; default False),
    B_SELECT (with one tile and one rank block: B through shared memory, see the kernel; default
    True: H200 2026-11-30 17:48 (explore_b_select_20261130T1748.json), T128 D8 r16 7.7 -> 5.5 us, T32 D8 r64 10.0 -> 7.7, T1 r64 5.3 -> 4.6)."""
    assert 1 <= len(widths) <= MAX_SLICES
    block_m, block_n = int(config["BLOCK_M"]), int(config["BLOCK_N"])
    small_t, block_m = small_t_block(num_tokens, block_m, config)
    block_r = max(16, min(next_pow2(rank), int(config.get("BLOCK_R", 64))))
    _check_dot_dims(block_m, block_n, block_r)
    cast, precision = _cast_and_precision((w_dtype,) if not interpreting() else (w_dtype, y_dtype))
    tiles_n = max(1, min(int(config.get("TILES_N", 1)), max(triton.cdiv(int(w), block_n) for w in widths)))
    c, total = _epilogue_constexprs(widths, bias_flags, add_inputs, has_ranks, block_n, tiles_n)
    c.update(RANK=rank, NUM_PARTIALS=int(num_partials), NUM_TILES=total, BLOCK_M=block_m, BLOCK_N=block_n,
             BLOCK_R=block_r, TILES_N=tiles_n, Y_AHEAD=bool(config.get("Y_AHEAD", False)) and tiles_n > 1,
             NUM_GROUPS=num_groups, GROUPS_P2=next_pow2(num_groups),
             CAST_FP32=cast, DOT_PRECISION=precision, ALIGNED=bool(aligned), SMALL_T=small_t,
             USE_PDL=bool(pdl), **_prefetch(pdl and tiles_n > 1 and bool(config.get("PREFETCH", False)), rank, w_dtype))
    y_prefetch = _prefetch(pdl and tiles_n > 1 and bool(config.get("PREFETCH_Y", False)), tiles_n * block_n, y_dtype)
    c.update(PREFETCH_Y_LINES=y_prefetch["PREFETCH_LINES"], PREFETCH_Y_LINE=y_prefetch["PREFETCH_LINE"],
             B_SELECT=bool(config.get("B_SELECT", True)) and tiles_n == 1 and rank <= block_r)
    grid = (total // tiles_n, max_tiles(num_tokens, num_groups, block_m, small_t))
    return ExpandPlan(grid, c, int(config.get("num_warps", 4)), int(config.get("num_stages", 2)))


WS_LOAD_MAX = 4096  # floats of workspace planes the fused kernel loads at once (32 registers at 4 warps)


def plan_fused(num_tokens: int, hidden: int, rank: int, widths: Sequence[int], num_groups: int,
               x_dtype: str, w_dtype: str, config: dict, *, add_inputs: bool,
               bias_flags: Sequence[bool], has_ranks: bool, aligned: bool = False,
               pdl: bool = False) -> FusedPlan:
    """Grid and meta-parameters of `lora_fused_kernel`.

    config: BLOCK_M, BLOCK_N, BLOCK_K, SPLIT_K (hidden chunks per slice; 0: one shrink program per
    output tile), num_warps, num_stages. P = max(output tiles, slices * SPLIT_K) programs per token
    tile; the workspace has SPLIT_K planes (`FusedPlan.workspace_shape`).
    """
    assert 1 <= len(widths) <= MAX_SLICES
    block_m, block_n, block_k = int(config["BLOCK_M"]), int(config["BLOCK_N"]), int(config["BLOCK_K"])
    small_t, block_m = small_t_block(num_tokens, block_m, config)
    block_r = max(16, next_pow2(rank))
    _check_dot_dims(block_m, block_n, block_k, block_r)
    cast, precision = _cast_and_precision((x_dtype, w_dtype))
    c, total = _epilogue_constexprs(widths, bias_flags, add_inputs, has_ranks, block_n)
    num_slices = len(widths)
    split, k_per_split = _hidden_split(hidden, int(config.get("SPLIT_K", 0)) or max(1, total // num_slices),
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
             BARRIER_POLLS=BARRIER_POLL_LIMIT, B_SELECT=bool(config.get("B_SELECT", False)),
             **_prefetch(pdl and config.get("PREFETCH", True), k_per_split, w_dtype))
    grid = (max(total, num_slices * split), max_tiles(num_tokens, num_groups, block_m, small_t))
    return FusedPlan(grid, c, int(config.get("num_warps", 4)), int(config.get("num_stages", 2)),
                     (split, num_slices, num_tokens, rank))


def row_major_strides(shape: Sequence[int]) -> tuple:
    """Element strides of a contiguous array of `shape` (what jax arrays have)."""
    strides, acc = [], 1
    for d in reversed(shape):
        strides.append(acc)
        acc *= int(d)
    return tuple(reversed(strides))


def all_aligned(ints: Sequence[int]) -> bool:
    """ALIGNED meta-parameter: every integer argument (strides, sizes, offsets) other than 0 and 1
    is a multiple of 16, so the kernels may tell the compiler (see `_hint16`)."""
    return all(v % 16 == 0 for v in ints if v not in (0, 1))


def pad4(values: Sequence, fill) -> list:
    """values padded to MAX_SLICES entries with `fill` (unused slices' arguments)."""
    values = list(values)
    return values + [fill] * (MAX_SLICES - len(values))


def slice_weight_strides(weights: Sequence, strides_of) -> list:
    """The (slot, row, col) strides of up to MAX_SLICES weights, flattened; unused slices repeat
    the first. `strides_of(w)` gives an array's element strides (torch: `w.stride()`; jax:
    `row_major_strides(w.shape)`)."""
    flat = []
    for w in weights:
        flat.extend(strides_of(w))
    flat.extend(flat[:3] * (MAX_SLICES - len(weights)))
    return flat


def bias_args(bias, lo: int, hi: int, dummy, strides_of):
    """Pointers, (slot, col) strides and presence flags of slices lo..hi's biases, padded to
    MAX_SLICES. A missing bias passes `dummy` with zero strides (its flag keeps it unread)."""
    ptrs, strides, flags = [], [], []
    for s in range(lo, hi):
        c = None if bias is None else bias[s]
        if c is None:
            ptrs.append(dummy)
            strides.extend((0, 0))
            flags.append(False)
        else:
            c = c if c.ndim == 2 else c.reshape(c.shape[0], -1)
            ptrs.append(c)
            strides.extend(strides_of(c))
            flags.append(True)
    while len(ptrs) < MAX_SLICES:
        ptrs.append(dummy)
        strides.extend((0, 0))
    return ptrs, strides, tuple(flags)
