"""Device helpers shared by the three Triton kernels (shrink, expand, fused).

Each is a `@triton.jit` function inlined into the kernels that call it: which tile a program owns
(`token_tile`, from the kernel metadata of contract section 3), masked loads of rank columns
(`load_rank_cols`), the shrink's inner product over the hidden size (`shrink_slices`), the
expand's output tile (`y_tile`, `store_slice`), slice selection by a grid coordinate
(`pick_slice`) and L2 prefetch (`prefetch_rows`). Programmatic dependent launch (`gdc_wait`,
`gdc_launch_dependents`) is imported here once; `HAVE_PDL` says whether this Triton has it.
"""

from __future__ import annotations

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


@triton.jit
def group_tile(pid, counts_ptr, starts_ptr, active_ptr, num_slots,
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
def tile_tokens(sorted_ptr, pos0, n_tok, num_sorted, num_tokens, BLOCK_M: tl.constexpr):
    """Token ids of a tile and the mask of real ones (inside the group, the sorted array and x)."""
    offs = tl.arange(0, BLOCK_M)
    pos = pos0 + offs
    in_tile = (offs < n_tok) & (pos < num_sorted)
    tok = tl.load(sorted_ptr + pos, mask=in_tile, other=0)
    tok_ok = in_tile & (tok >= 0) & (tok < num_tokens)
    return tl.where(tok_ok, tok, 0).to(tl.int64), tok_ok


@triton.jit
def token_tile(pid, mapping_ptr, sorted_ptr, counts_ptr, starts_ptr, active_ptr, num_slots, num_tokens, num_sorted,
          BLOCK_M: tl.constexpr, NUM_GROUPS: tl.constexpr, GROUPS_P2: tl.constexpr, LORA_ONLY: tl.constexpr,
          SMALL_T: tl.constexpr):
    """(slot id, token ids (BLOCK_M,) int64, mask of real tokens, number of real tokens) of program pid.

    SMALL_T (the whole batch fits one tile, T <= BLOCK_M): program g serves group g, and its tokens
    are the rows whose mapping equals the group's id -- read together with the group ids in one
    round trip, without the sorted order (two fewer dependent loads: what decode latency is made
    of). Without LORA_ONLY one extra program (pid == NUM_GROUPS) owns the rows without LoRA (they
    get zero rows); programs of non-slot groups are idle.
    Otherwise tiles of BLOCK_M tokens of the sorted order (`group_tile`).
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
        lora_id, pos0, n = group_tile(pid, counts_ptr, starts_ptr, active_ptr, num_slots,
                                       BLOCK_M, NUM_GROUPS, GROUPS_P2, LORA_ONLY)
        tok, tok_ok = tile_tokens(sorted_ptr, pos0, n, num_sorted, num_tokens, BLOCK_M)
    n_tok = tl.sum(tok_ok.to(tl.int32), axis=0)
    return lora_id, tok, tok_ok, n_tok


@triton.jit
def hint16(v, ALIGNED: tl.constexpr):
    """v, with its divisibility by 16 made visible to the compiler when the launcher checked it
    (ALIGNED). Triton specialises integer arguments itself when launched from torch; through
    jax_triton it does not, and without the hint loads along a row are not vectorised."""
    if ALIGNED:
        v = v // 16 * 16
    return v


@triton.jit
def prefetch_l2(ptrs, mask):
    """Asks for the cache lines at ptrs (where mask) to be brought into L2, without waiting or
    using registers (PTX prefetch.global.L2). Compiled kernels only: not under the interpreter."""
    tl.inline_asm_elementwise("{ .reg .pred p; setp.ne.b32 p, $2, 0; @p prefetch.global.L2 [$1]; mov.u32 $0, 0; }",
                              "=r,l,r", [ptrs, mask.to(tl.int32)], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def prefetch_rows(row_ptrs, row_ok, k_begin, k_end, stride_k, LINES: tl.constexpr, LINE: tl.constexpr):
    """L2 prefetch of columns [k_begin, k_end) of the rows at row_ptrs (BLOCK,), LINE elements per
    128-byte line, at most LINES lines per row (columns contiguous: stride_k == 1 is the case that
    matters; other strides prefetch one element per line-sized step)."""
    k = k_begin + tl.arange(0, LINES) * LINE
    prefetch_l2(row_ptrs[:, None] + k[None, :] * stride_k, row_ok[:, None] & (k < k_end)[None, :])


@triton.jit
def pick_slice(s, v0, v1, v2, v3):
    """v_s for a slice number s in 0..3 (pointers or integers)."""
    return tl.where(s == 0, v0, tl.where(s == 1, v1, tl.where(s == 2, v2, v3)))


@triton.jit
def slot_rank(ranks_ptr, lora_id, has_lora, RANK: tl.constexpr, HAS_RANKS: tl.constexpr):
    """The rank columns slot `lora_id` really uses (RANK without a ranks array; 0 without LoRA)."""
    rank = RANK
    if HAS_RANKS:
        rank = tl.minimum(tl.load(ranks_ptr + tl.where(has_lora, lora_id, 0)), RANK)
        rank = tl.maximum(rank, 0)
    return tl.where(has_lora, rank, 0)


@triton.jit
def runs_copy(odd_rank, b_tail: tl.constexpr, HAS_RANKS: tl.constexpr):
    """Whether the program runs copy b_tail (1: with B_TAIL) of code compiled per B_TAIL: without
    per-slot ranks the only copy (0); with them, copy 1 for ranks that are not multiples of 8."""
    if HAS_RANKS:
        return odd_rank == (b_tail == 1)
    else:
        return True


@triton.jit
def load_rank_cols(ptrs, row_ok, kk, rank, RANK: tl.constexpr, HAS_RANKS: tl.constexpr,
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
def shrink_slices(x_ptr, a0_rows, a1_rows, a2_rows, a3_rows, stride_a0_hidden, stride_a1_hidden, stride_a2_hidden,
                  stride_a3_hidden, tok, tok_ok, rank,
                   k_begin, k_end, hidden, stride_x_token, stride_x_hidden, NUM_SLICES: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr,
                   CAST_FP32: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """(acc0, acc1, acc2, acc3), acc_s[m, r] = sum_{k in [k_begin, k_end)} x[tok[m], k] * A_s[r, k]
    for r < rank and the first NUM_SLICES slices (the others stay zero): a{s}_rows (BLOCK_R,) point
    at the rank rows of slice s's A for one slot, sa{s}_h is its column stride. Each x tile is
    loaded once for all the slices."""
    offs_k = tl.arange(0, BLOCK_K)
    rank_ok = tl.arange(0, BLOCK_R) < rank                   # real rank rows of A: padding is not read
    x_rows = x_ptr + tok[:, None] * stride_x_token
    acc0 = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    acc1 = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    acc2 = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    acc3 = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    for k0 in range(k_begin, k_end, BLOCK_K):
        k = k0 + offs_k
        k_ok = k < hidden                                    # the last chunk of a hidden size that
        xt = tl.load(x_rows + k[None, :] * stride_x_hidden,        # is not a multiple of BLOCK_K
                     mask=tok_ok[:, None] & k_ok[None, :], other=0.0)
        a_ok = rank_ok[:, None] & k_ok[None, :]
        at0 = tl.load(a0_rows[:, None] + k[None, :] * stride_a0_hidden, mask=a_ok, other=0.0)
        if CAST_FP32:
            xt = xt.to(tl.float32)
            at0 = at0.to(tl.float32)
        acc0 = tl.dot(xt, tl.trans(as_operand(at0, xt.dtype)), acc0, input_precision=DOT_PRECISION)
        if NUM_SLICES > 1:
            at1 = tl.load(a1_rows[:, None] + k[None, :] * stride_a1_hidden, mask=a_ok, other=0.0)
            acc1 = tl.dot(xt, tl.trans(as_operand(at1, xt.dtype)), acc1, input_precision=DOT_PRECISION)
        if NUM_SLICES > 2:
            at2 = tl.load(a2_rows[:, None] + k[None, :] * stride_a2_hidden, mask=a_ok, other=0.0)
            acc2 = tl.dot(xt, tl.trans(as_operand(at2, xt.dtype)), acc2, input_precision=DOT_PRECISION)
        if NUM_SLICES > 3:
            at3 = tl.load(a3_rows[:, None] + k[None, :] * stride_a3_hidden, mask=a_ok, other=0.0)
            acc3 = tl.dot(xt, tl.trans(as_operand(at3, xt.dtype)), acc3, input_precision=DOT_PRECISION)
    return acc0, acc1, acc2, acc3


# e4m3 -> 16-bit by moving bits, 4 values (one 32-bit register) per step. A byte s eeee mmm goes to
# the low byte of a 16-bit lane (prmt) and moves left (shl) until its 7 magnitude bits sit in the
# 16-bit format's exponent and mantissa fields; its sign, then one bit above them, is carried up to
# the lane's top bit by one multiply-add (t + (t & sign) * k: k = 2^(15 - sign position) - 1
# clears the bit and sets bit 15; multiply-adds run beside the integer unit). That is the same
# significand with the exponent still biased by e4m3's 7, i.e. the value times 2^(7 - bias) --
# exact for normal and subnormal e4m3 values alike (subnormals land on 16-bit subnormals). One fma
# by 2^(bias - 7) restores it: bf16 (bias 127, 8 exponent bits): shift 4, sign at bit 11, times
# 2^120 (0x7B80); fp16 (bias 15, 5 bits): shift 7, sign at bit 14, times 2^8 (0x5C00). The adding
# term is -0.0 (0x8000), so the fma is the exact product. e4m3's NaN (s 1111 111) comes out
# finite: quantised weights are clipped to +-448 and never NaN.
_E4M3_TO_16 = """{{
.reg .b32 lo, hi, s, m, z;
prmt.b32 lo, $2, 0, 0x4140;
prmt.b32 hi, $2, 0, 0x4342;
shl.b32 lo, lo, {shift};
shl.b32 hi, hi, {shift};
and.b32 s, lo, {sign};
mad.lo.u32 lo, s, {carry}, lo;
and.b32 s, hi, {sign};
mad.lo.u32 hi, s, {carry}, hi;
mov.b32 m, {mul};
mov.b32 z, 0x80008000;
fma.rn.{ty}x2 $0, lo, m, z;
fma.rn.{ty}x2 $1, hi, m, z;
}}"""
E4M3_TO_BF16_ASM = tl.constexpr(_E4M3_TO_16.format(shift=4, sign="0x08000800", carry=15, mul="0x7B807B80", ty="bf16"))
E4M3_TO_FP16_ASM = tl.constexpr(_E4M3_TO_16.format(shift=7, sign="0x40004000", carry=1, mul="0x5C005C00", ty="f16"))


@triton.jit
def as_operand(t, dtype: tl.constexpr):
    """t converted to `dtype` for tl.dot. An e4m3 tile going to bf16 or fp16 takes the bit moves of
    E4M3_TO_BF16_ASM / E4M3_TO_FP16_ASM (2.5 integer and float instructions per value), not
    Triton's conversion (e4m3 -> fp16 pairs, then one fp16 -> bf16 conversion per value: 1.5
    conversion-unit instructions per value, a unit that runs at a quarter of the integer rate and
    halves the bandwidth an fp8 kernel reaches). Compiled kernels only: the interpreter (float32
    operands, CAST_FP32) never asks for a 16-bit operand; everything else is `t.to(dtype)`."""
    if t.dtype == tl.float8e4nv and dtype == tl.bfloat16:
        t = tl.inline_asm_elementwise(E4M3_TO_BF16_ASM, "=r,=r,r", [t.to(tl.uint8, bitcast=True)],
                                      dtype=tl.bfloat16, is_pure=True, pack=4)
    elif t.dtype == tl.float8e4nv and dtype == tl.float16:
        t = tl.inline_asm_elementwise(E4M3_TO_FP16_ASM, "=r,=r,r", [t.to(tl.uint8, bitcast=True)],
                                      dtype=tl.float16, is_pure=True, pack=4)
    else:
        t = t.to(dtype)
    return t


@triton.jit
def weight_operand(t, like_ptr, CAST_FP32: tl.constexpr):
    """A weight tile as a tl.dot operand: an fp8 (e4m3) tile becomes float32 under CAST_FP32, else
    the element type of `like_ptr` (the activations': e4m3 values are exact in fp16, bf16 and
    float32); a 16-bit tile is returned as it is. The test is on the tile's dtype, which Triton
    specialises on: a 16-bit launch compiles none of this."""
    if t.dtype.is_fp8():
        if CAST_FP32:
            t = t.to(tl.float32)
        else:
            t = as_operand(t, like_ptr.dtype.element_ty)
    return t


@triton.jit
def channel_scaled(acc, w_ptr, scale_ptr, slot, stride_scale_slot, chans, ok):
    """acc (rows, len(chans)) float32 times the per-output-channel scales of slot `slot`'s weight,
    scale[slot, chans] (contiguous per slot; masked-off channels read 1.0), when w_ptr points at fp8
    weights; acc itself otherwise (nothing loaded or multiplied: the weight's element type is a
    compile-time constant, so a 16-bit launch compiles none of this)."""
    if w_ptr.dtype.element_ty.is_fp8():
        v = tl.load(scale_ptr + slot.to(tl.int64) * stride_scale_slot + chans, mask=ok, other=1.0)
        acc = acc * v.to(tl.float32)[None, :]
    return acc


@triton.jit
def lora_a_rows(a_ptr, lora_id, stride_a_slot, stride_a_rank, BLOCK_R: tl.constexpr):
    """(BLOCK_R,) pointers to the rank rows of slot lora_id's A."""
    return a_ptr + lora_id.to(tl.int64) * stride_a_slot + tl.arange(0, BLOCK_R) * stride_a_rank


@triton.jit
def shrink_tile(x_ptr, a_ptr, tok, tok_ok, lora_id, rank, k_begin, k_end, hidden,
                 stride_x_token, stride_x_hidden, stride_a_slot, stride_a_rank, stride_a_hidden,
                 BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr,
                 CAST_FP32: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """acc[m, r] = sum_{k in [k_begin, k_end)} x[tok[m], k] * A[lora_id, r, k], for r < rank."""
    a_rows = lora_a_rows(a_ptr, lora_id, stride_a_slot, stride_a_rank, BLOCK_R)
    acc, _1, _2, _3 = shrink_slices(x_ptr, a_rows, a_rows, a_rows, a_rows, stride_a_hidden, stride_a_hidden,
                                    stride_a_hidden,
                                     stride_a_hidden, tok, tok_ok, rank, k_begin, k_end, hidden, stride_x_token,
                                     stride_x_hidden,
                                     1, BLOCK_M, BLOCK_K, BLOCK_R, CAST_FP32, DOT_PRECISION)
    return acc


@triton.jit
def workspace_lhs(buf_rows, stride_buf_plane, stride_buf_rank, kk, tok_ok, rank, RANK: tl.constexpr,
                  HAS_RANKS: tl.constexpr,
                   NUM_PARTIALS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr,
                   ZERO_TAIL: tl.constexpr):
    """(BLOCK_M, BLOCK_R) float32: the sum of the NUM_PARTIALS workspace planes at rank columns kk
    (columns past the slot's rank zeroed exactly: ZERO_TAIL, which per-slot ranks need)."""
    lhs = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    for p in tl.static_range(NUM_PARTIALS):                  # split-K planes: independent loads
        lhs += load_rank_cols(buf_rows + p * stride_buf_plane + kk[None, :] * stride_buf_rank, tok_ok, kk, rank,
                               RANK, HAS_RANKS, ZERO_TAIL).to(tl.float32)
    return lhs


@triton.jit
def rank_dot(acc, lhs, bt, CAST_FP32: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """acc + lhs @ bt.T: lhs (BLOCK_M, BLOCK_R) float32, bt (BLOCK_N, BLOCK_R) in the weights' dtype."""
    if CAST_FP32:
        bt = bt.to(tl.float32)
    else:
        lhs = lhs.to(bt.dtype)
    return tl.dot(lhs, tl.trans(bt), acc, input_precision=DOT_PRECISION)


@triton.jit
def y_tile(y_ptr, tok, tok_ok, cols, col_ok, y_col0, stride_y_token, stride_y_col, ADD_INPUTS: tl.constexpr):
    """Offsets and write mask of the output tile, and (ADD_INPUTS) its current values.

    Loaded before the tile's math so that its latency overlaps the weight loads, and kept in y's
    own dtype until the store (half the registers of float32 for 16-bit y: the expand's tile is
    register-limited at prefill sizes)."""
    y_offs = tok[:, None] * stride_y_token + (y_col0 + cols)[None, :] * stride_y_col
    write = tok_ok[:, None] & col_ok[None, :]                # rows of real LoRA tokens, slice columns
    y_old = tl.zeros((tok.shape[0], cols.shape[0]), dtype=y_ptr.dtype.element_ty)
    if ADD_INPUTS:
        y_old = tl.load(y_ptr + y_offs, mask=write, other=0.0)
    return y_offs, write, y_old


@triton.jit
def store_slice(acc, y_old, out_ptr, y_offs, write, bias_ptr, lora_id, cols, col_ok, stride_bias_slot,
                stride_bias_col,
                 has_bias, ANY_EPILOGUE: tl.constexpr):
    """y[tok, y_col0 + cols] = (y if ADD_INPUTS else 0) + acc + bias[lora_id, cols], cast once.

    has_bias is the slice's epilogue (arguments.epilogue): 0 none, 1 the vector is a bias (added),
    2 the vector is DoRA's column scale g: y = g[lora_id, cols] * ((y if ADD_INPUTS else 0) + acc)."""
    out = acc + y_old.to(tl.float32)
    if ANY_EPILOGUE:
        # branch-free (no scf.if around the load: Triton 3.6's software pipeliner fails on one
        # inside the output-tile loop): the vector reads as 0 where the slice has none
        has_vec = (cols * 0 + has_bias) != 0              # per column (the interpreter wants a vector mask)
        vec = tl.load(bias_ptr + lora_id.to(tl.int64) * stride_bias_slot + cols * stride_bias_col,
                      mask=col_ok & has_vec, other=0.0).to(tl.float32)[None, :]
        out = tl.where(has_bias == 2, out * vec, out + vec)
    tl.store(out_ptr + y_offs, out.to(out_ptr.dtype.element_ty), mask=write)


@triton.jit
def slice_of_tile(j, NT1: tl.constexpr, NT2: tl.constexpr, NT3: tl.constexpr, BLOCK_N: tl.constexpr):
    """Slice s of output tile j, and the tile's first column inside the slice.

    NT1..NT3: the first tile number of slices 1..3 (a large number for absent slices)."""
    s = (j >= NT1).to(tl.int32) + (j >= NT2).to(tl.int32) + (j >= NT3).to(tl.int32)
    first = tl.where(s == 0, 0, tl.where(s == 1, NT1, tl.where(s == 2, NT2, NT3)))
    return s, (j - first) * BLOCK_N
