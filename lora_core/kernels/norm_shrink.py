"""RMSNorm fused with the LoRA shrink of the linears that read its output (q/k/v, gate/up).

Math (h (M, K), the norm weight g (K,), slot[m] in -1..L-1, A_s (L, R, K) per slice s), rounded
as Hugging Face's LlamaRMSNorm rounds (`weight * hidden.to(input_dtype)`: the normalised row is
computed in float32 and cast to h's dtype, then multiplied by g in float32 and cast once more):

  rstd[m]       = 1 / sqrt(sum_k h[m, k]^2 / K + eps)                                (float32)
  xn[m, k]      = cast(g[k] * cast(h[m, k] * rstd[m]))                    (cast: to h's dtype)
  buf[p, s, m, r] = scale * sum_{k in chunk p} xn[m, k] A_s[slot[m], r, k]   (float32; 0 for slot -1
                                                                              or >= L, r >= rank)

xn is what the model's norm returns (the base GEMM's input), buf the shrink of that same xn, in
P split-K planes that `gemm_lora_kernel` sums when it reads them (NUM_PARTIALS).

Grid (row blocks, P): program (i, p) owns rows i * BLOCK_M ... and hidden chunk p (k_per_split
columns, a whole number of BLOCK_K tiles).
  1. The row block's sum of squares over all of K, BLOCK_K columns at a time. The norm needs the
     whole row, and a row of a Llama layer (K = 4096: 8 KB in bf16; 14336 would not fit a tile
     of registers for more than a few rows) is read in tiles: two passes over the chunk's columns
     (the second read hits L2), and every split program reads the whole row block once for its
     rstd (P x the row block's bytes from L2, against a grid P times larger for the shrink's
     weight reads, which is what decode needs).
  2. Over the program's chunk: xn's tile, stored, and its product with every slice's A:
     LORA_MODE 1 ("rows", decode: rows mostly have distinct slots) gathers each row's A tile
     (a (BLOCK_M, BLOCK_R, BLOCK_K) load) and reduces over k on the CUDA cores; LORA_MODE 2
     ("slots", prefill) loops over the distinct slots of the row block, one tl.dot each with the
     other rows zeroed in the left operand. LORA_MODE 0 ("none"): the norm alone.
  3. The P planes of buf: every row of the block, every rank column (zeros where no term).
"""

from __future__ import annotations

import dataclasses

import triton
import triton.language as tl

from .planning import MAX_SLICES, cast_and_precision, check_dot_dims, interpreting, next_pow2

LORA_MODES = {"none": 0, "rows": 1, "slots": 2}


@triton.jit
def _cast(v, dtype: tl.constexpr, RNE_BF16: tl.constexpr):
    """float32 v cast to dtype. RNE_BF16 (the interpreter, whose float32 -> bfloat16 cast truncates):
    rounded to the nearest bfloat16 (ties to even) by hand first, as compiled kernels and torch round."""
    if RNE_BF16:
        u = v.to(tl.uint32, bitcast=True)
        u = (u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000
        v = u.to(tl.float32, bitcast=True)
    return v.to(dtype)


@triton.jit
def _a_rows(xn, a_ptr, slot, rank_row, k, k_ok, stride_a_slot, stride_a_rank, stride_a_k, BLOCK_R: tl.constexpr):
    """(BLOCK_M, BLOCK_R) float32: xn[m, :] @ A[slot[m], :, k].T with each row's A tile gathered."""
    rr = tl.arange(0, BLOCK_R)
    ptrs = (a_ptr + slot.to(tl.int64)[:, None, None] * stride_a_slot + rr[None, :, None] * stride_a_rank
            + k[None, None, :] * stride_a_k)
    mask = (rr[None, :] < rank_row[:, None])[:, :, None] & k_ok[None, None, :]
    at = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
    return tl.sum(xn.to(tl.float32)[:, None, :] * at, axis=2)


@triton.jit
def _a_slot(acc, lhs, a_ptr, u, rank, k, k_ok, stride_a_slot, stride_a_rank, stride_a_k, BLOCK_R: tl.constexpr,
            CAST_FP32: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """acc + lhs @ A[u, :, k].T (lhs: xn with the rows of other slots zeroed)."""
    rr = tl.arange(0, BLOCK_R)
    at = tl.load(a_ptr + u.to(tl.int64) * stride_a_slot + rr[:, None] * stride_a_rank + k[None, :] * stride_a_k,
                 mask=(rr < rank)[:, None] & k_ok[None, :], other=0.0)
    if CAST_FP32:
        at = at.to(tl.float32)
        lhs = lhs.to(tl.float32)
    else:
        lhs = lhs.to(at.dtype)
    return tl.dot(lhs, tl.trans(at), acc, input_precision=DOT_PRECISION)


@triton.jit(do_not_specialize=("M",))
def rms_norm_shrink_kernel(
        h_ptr, g_ptr, a0_ptr, a1_ptr, a2_ptr, a3_ptr, slots_ptr, ranks_ptr, xn_ptr,
        M, K, k_per_split, num_slots, eps, scale,
        stride_hm, stride_hk, stride_g, stride_xnm, stride_xnk,
        stride_a0_slot, stride_a0_rank, stride_a0_k, stride_a1_slot, stride_a1_rank, stride_a1_k,
        stride_a2_slot, stride_a2_rank, stride_a2_k, stride_a3_slot, stride_a3_rank, stride_a3_k,
        stride_buf_plane, stride_buf_slice, stride_buf_m, stride_buf_r,
        buf_ptr,
        BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, NUM_SLICES: tl.constexpr,
        RANK: tl.constexpr, BLOCK_R: tl.constexpr, LORA_MODE: tl.constexpr, HAS_RANKS: tl.constexpr,
        CAST_FP32: tl.constexpr, DOT_PRECISION: tl.constexpr, RNE_BF16: tl.constexpr):
    """xn = RMSNorm(h) * g and buf[p, s] = scale * xn[:, chunk p] @ A_s[slot, :, chunk p].T (module
    docstring). Grid (cdiv(M, BLOCK_M), P)."""
    pid_m = tl.program_id(0)
    split = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < M
    rows64 = rows.to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K)
    h_rows = h_ptr + rows64[:, None] * stride_hm
    # 1. rstd of every row of the block
    ss = tl.zeros((BLOCK_M,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + offs_k
        ht = tl.load(h_rows + k[None, :] * stride_hk, mask=row_ok[:, None] & (k < K)[None, :], other=0.0)
        ht = ht.to(tl.float32)
        ss += tl.sum(ht * ht, axis=1)
    rstd = tl.math.rsqrt(ss / K + eps)
    # the rows' slots and ranks (none read by the norm alone)
    if LORA_MODE != 0:
        slot = tl.load(slots_ptr + rows, mask=row_ok, other=-1)
    else:
        slot = tl.full((BLOCK_M,), -1, tl.int32)
    lora_row = (slot >= 0) & (slot < num_slots)
    slot = tl.where(lora_row, slot, 0)
    if HAS_RANKS:
        rank_row = tl.maximum(tl.minimum(tl.load(ranks_ptr + slot, mask=lora_row, other=0), RANK), 0)
    else:
        rank_row = slot * 0 + RANK
    rank_row = tl.where(lora_row, rank_row, 0)
    # 2. this split's chunk: xn stored, its products with the slices' A
    acc0 = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    acc1 = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    acc2 = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    acc3 = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    k_begin = split * k_per_split
    k_end = tl.minimum(k_begin + k_per_split, K)
    for k0 in range(k_begin, k_end, BLOCK_K):
        k = k0 + offs_k
        k_ok = k < k_end
        ht = tl.load(h_rows + k[None, :] * stride_hk, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        gt = tl.load(g_ptr + k * stride_g, mask=k_ok, other=0.0).to(tl.float32)
        normed = _cast(ht.to(tl.float32) * rstd[:, None], ht.dtype, RNE_BF16).to(tl.float32)
        xn = _cast(gt[None, :] * normed, xn_ptr.dtype.element_ty, RNE_BF16)
        tl.store(xn_ptr + rows64[:, None] * stride_xnm + k[None, :] * stride_xnk, xn,
                 mask=row_ok[:, None] & k_ok[None, :])
        if LORA_MODE == 1:
            acc0 += _a_rows(xn, a0_ptr, slot, rank_row, k, k_ok, stride_a0_slot, stride_a0_rank, stride_a0_k, BLOCK_R)
            if NUM_SLICES > 1:
                acc1 += _a_rows(xn, a1_ptr, slot, rank_row, k, k_ok, stride_a1_slot, stride_a1_rank, stride_a1_k,
                                BLOCK_R)
            if NUM_SLICES > 2:
                acc2 += _a_rows(xn, a2_ptr, slot, rank_row, k, k_ok, stride_a2_slot, stride_a2_rank, stride_a2_k,
                                BLOCK_R)
            if NUM_SLICES > 3:
                acc3 += _a_rows(xn, a3_ptr, slot, rank_row, k, k_ok, stride_a3_slot, stride_a3_rank, stride_a3_k,
                                BLOCK_R)
        elif LORA_MODE == 2:
            remaining = lora_row.to(tl.int32)
            while tl.max(remaining, axis=0) > 0:
                u = tl.min(tl.where(remaining > 0, slot, 2147483647), axis=0)    # the smallest slot left
                mine = (remaining > 0) & (slot == u)
                rank = tl.max(tl.where(mine, rank_row, 0), axis=0)
                lhs = tl.where(mine[:, None], xn, tl.zeros_like(xn))
                acc0 = _a_slot(acc0, lhs, a0_ptr, u, rank, k, k_ok, stride_a0_slot, stride_a0_rank, stride_a0_k,
                               BLOCK_R, CAST_FP32, DOT_PRECISION)
                if NUM_SLICES > 1:
                    acc1 = _a_slot(acc1, lhs, a1_ptr, u, rank, k, k_ok, stride_a1_slot, stride_a1_rank, stride_a1_k,
                                   BLOCK_R, CAST_FP32, DOT_PRECISION)
                if NUM_SLICES > 2:
                    acc2 = _a_slot(acc2, lhs, a2_ptr, u, rank, k, k_ok, stride_a2_slot, stride_a2_rank, stride_a2_k,
                                   BLOCK_R, CAST_FP32, DOT_PRECISION)
                if NUM_SLICES > 3:
                    acc3 = _a_slot(acc3, lhs, a3_ptr, u, rank, k, k_ok, stride_a3_slot, stride_a3_rank, stride_a3_k,
                                   BLOCK_R, CAST_FP32, DOT_PRECISION)
                remaining = tl.where(mine, 0, remaining)
    if LORA_MODE == 0:
        return                                   # the norm alone: no buf
    # 3. this split's plane of buf
    rr = tl.arange(0, BLOCK_R)
    out = (buf_ptr + split.to(tl.int64) * stride_buf_plane + rows64[:, None] * stride_buf_m
           + rr[None, :] * stride_buf_r)
    write = row_ok[:, None] & (rr < RANK)[None, :]
    tl.store(out, acc0 * scale, mask=write)
    if NUM_SLICES > 1:
        tl.store(out + stride_buf_slice, acc1 * scale, mask=write)
    if NUM_SLICES > 2:
        tl.store(out + 2 * stride_buf_slice, acc2 * scale, mask=write)
    if NUM_SLICES > 3:
        tl.store(out + 3 * stride_buf_slice, acc3 * scale, mask=write)


# ------------------------------------------------------------------------------- launch plan

@dataclasses.dataclass(frozen=True)
class NormShrinkPlan:
    """How `rms_norm_shrink_kernel` is launched; `planes` is P, the split-K planes of buf."""

    grid: tuple
    constexprs: dict
    num_warps: int
    num_stages: int
    planes: int
    k_per_split: int             # columns of K per split (a multiple of BLOCK_K; a runtime argument)


def plan_norm_shrink(M: int, K: int, rank: int, num_slices: int, h_dtype: str, a_dtype: str, config: dict, *,
                     has_ranks: bool, planes: int | None = None) -> NormShrinkPlan:
    """Grid and meta-parameters of `rms_norm_shrink_kernel`. config: BLOCK_M, BLOCK_K, SPLIT_K
    (P, default 1), LORA_MODE ("rows" or "slots"; default rows up to 32 rows of M), num_warps,
    num_stages. planes: P fixed by a given buffer (overrides SPLIT_K); splits past K write zeros."""
    if not 1 <= num_slices <= MAX_SLICES:
        raise ValueError(f"rms_norm_shrink takes 1 to {MAX_SLICES} slices of lora_a_stacked, got {num_slices}")
    bm, bk = int(config["BLOCK_M"]), int(config["BLOCK_K"])
    mode = config.get("LORA_MODE", "rows" if M <= 32 else "slots")
    if mode not in LORA_MODES:
        raise ValueError(f"LORA_MODE must be one of {sorted(LORA_MODES)}, got {mode!r}")
    block_r = max(16, next_pow2(max(rank, 1)))
    if mode == "slots":
        check_dot_dims(bm, bk, block_r)
    elif bm & (bm - 1) or bk & (bk - 1):
        raise ValueError(f"BLOCK_M and BLOCK_K must be powers of two, got {bm}, {bk}")
    p = int(planes if planes is not None else config.get("SPLIT_K", 1))
    if p < 1:
        raise ValueError(f"the split count (planes of buf) must be >= 1, got {p}")
    k_per_split = triton.cdiv(triton.cdiv(K, p), bk) * bk
    cast, precision = cast_and_precision((h_dtype, a_dtype))
    constexprs = dict(BLOCK_M=bm, BLOCK_K=bk, NUM_SLICES=int(num_slices), RANK=int(rank),
                      BLOCK_R=block_r, LORA_MODE=LORA_MODES[mode], HAS_RANKS=bool(has_ranks), CAST_FP32=cast,
                      DOT_PRECISION=precision, RNE_BF16=interpreting() and h_dtype == "bfloat16")
    return NormShrinkPlan((triton.cdiv(M, bm), p), constexprs, int(config.get("num_warps", 4)),
                          int(config.get("num_stages", 2)), p, k_per_split)
