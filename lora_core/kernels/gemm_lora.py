"""The base GEMM with the LoRA expand in its epilogue.

Math (x (M, K), W (N, K) as torch's nn.Linear keeps it, slot[m] in -1..L-1, the shrink buffer
buf (P, S, M, R) float32 whose P split-K planes are summed, B_s (L, n_s, R) per output slice s,
the slices laid side by side over N), every product accumulated in float32, cast once:

  y[m, n] = (y[m, n] if add_inputs else 0) + sum_k x[m, k] W[n, k] + bias[n]
            + [0 <= slot[m] < L] * sum_{r < rank(slot[m])} (sum_p buf[p, s(n), m, r]) B_s(n)[slot[m], n - off_s(n), r]

One program per (BLOCK_M x BLOCK_N) output tile and split of K:
  1. The tile's product over its K chunk (tl.dot, float32 accumulator; the row blocks of one
     GROUP_M band take the column tiles in turn, so that W tiles are reused from L2 at prefill).
  2. SPLIT_K > 1: each split stores its partial tile in plane `split` of a float32 workspace,
     then takes a ticket on the tile's int32 counter; the last split to arrive resets the counter
     to 0 (it is 0 between launches) and sums the SPLIT_K planes in plane order (deterministic).
     The others are done.
  3. Epilogue: + bias, + the LoRA term of each row, + y when add_inputs, one cast, one store.
     Every slice but the last is a whole number of BLOCK_N tiles (checked on the host), so a
     tile lies in one slice: s = the number of slice starts (in tiles, nt1..nt3) at or before it.
     LORA_MODE 1 ("rows", decode: rows mostly have distinct slots): each row's B tile is
     gathered at once (a (BLOCK_M, BLOCK_N, R_CHUNK) load per rank chunk, all rows' loads in
     flight together) and reduced over the rank on the CUDA cores. LORA_MODE 2 ("slots",
     prefill: a row block holds few adapters): a loop over the distinct slots of the tile's rows,
     one (BLOCK_M x R) @ (R x BLOCK_N) tl.dot each, the rows of other slots zeroed in its
     left operand. PREFETCH_B (rows mode, compiled kernels): each row's B tile is prefetched into
     L2 before step 1, so the epilogue's loads do not wait for DRAM after the product.

Rows whose slot is -1 or >= L get no LoRA term (they still get the product). Per-slot ranks
(HAS_RANKS): only the first ranks[slot] rank columns are read (masked loads; the padding is never
used). Under TRITON_INTERPRET tiles are cast to float32 after loading (CAST_FP32: the interpreter
computes bf16 arithmetic wrongly).
"""

from __future__ import annotations

import dataclasses

import triton
import triton.language as tl

from .common import pick_slice, prefetch_l2
from .planning import MAX_SLICES, cast_and_precision, check_dot_dims, interpreting, next_pow2

LORA_MODES = {"rows": 1, "slots": 2}


@triton.jit
def _tile_slice(pid_n, nt1, nt2, nt3):
    """Slice s of column tile pid_n, and the number of its first tile: nt1..nt3 are the first
    tiles of slices 1..3 (a large number for absent slices)."""
    s = (pid_n >= nt1).to(tl.int32) + (pid_n >= nt2).to(tl.int32) + (pid_n >= nt3).to(tl.int32)
    first = tl.where(s == 0, 0, tl.where(s == 1, nt1, tl.where(s == 2, nt2, nt3)))
    return s, first


@triton.jit
def _row_ranks(slot, lora_row, ranks_ptr, RANK: tl.constexpr, HAS_RANKS: tl.constexpr):
    """(BLOCK_M,) the rank columns each row reads: RANK (or ranks[slot], at most RANK), 0 without LoRA."""
    if HAS_RANKS:
        r = tl.load(ranks_ptr + slot, mask=lora_row, other=0)
        r = tl.maximum(tl.minimum(r, RANK), 0)
    else:
        r = slot * 0 + RANK
    return tl.where(lora_row, r, 0)


@triton.jit
def _lora_rows(acc, buf_rows, stride_buf_plane, stride_buf_r, b_rows, stride_b_r, col_ok, rank_row,
               num_partials, BLOCK_R: tl.constexpr, R_CHUNK: tl.constexpr):
    """acc + delta, delta[m, n] = sum_r lhs[m, r] * B[slot[m], n, r] with the B tiles of all rows
    gathered at once; buf_rows (BLOCK_M, 1) points at each row's rank buffer, b_rows
    (BLOCK_M, BLOCK_N, 1) at each row's B columns. Columns r >= rank_row[m] are not read."""
    for r0 in tl.static_range(0, BLOCK_R, R_CHUNK):
        rr = r0 + tl.arange(0, R_CHUNK)
        r_ok = rr[None, :] < rank_row[:, None]                                  # (BLOCK_M, R_CHUNK)
        lhs = tl.zeros((rank_row.shape[0], R_CHUNK), dtype=tl.float32)
        for p in range(num_partials):
            lhs += tl.load(buf_rows + p * stride_buf_plane + rr[None, :] * stride_buf_r, mask=r_ok, other=0.0)
        bt = tl.load(b_rows + rr[None, None, :] * stride_b_r, mask=r_ok[:, None, :] & col_ok[None, :, None],
                     other=0.0).to(tl.float32)
        acc += tl.sum(lhs[:, None, :] * bt, axis=2)
    return acc


@triton.jit
def _lora_slots(acc, buf_rows, stride_buf_plane, stride_buf_r, b_ptr, stride_b_slot, b_cols, stride_b_r, col_ok,
                slot, lora_row, ranks_ptr, RANK: tl.constexpr, HAS_RANKS: tl.constexpr,
                num_partials, BLOCK_R: tl.constexpr, LORA_CAST: tl.constexpr,
                LORA_PRECISION: tl.constexpr):
    """acc + delta as _lora_rows, one tl.dot per distinct slot u of the rows: the rows of u keep
    their rank buffer in the left operand, the others are zeroed; B[u]'s tile is the right one.
    b_cols (BLOCK_N,): element offsets of the tile's columns inside a slot's B."""
    rr = tl.arange(0, BLOCK_R)
    remaining = lora_row.to(tl.int32)
    while tl.max(remaining, axis=0) > 0:
        u = tl.min(tl.where(remaining > 0, slot, 2147483647), axis=0)     # the smallest slot left
        mine = (remaining > 0) & (slot == u)
        rank = RANK
        if HAS_RANKS:
            rank = tl.maximum(tl.minimum(tl.load(ranks_ptr + u), RANK), 0)
        r_ok = rr < rank
        lhs = tl.zeros((slot.shape[0], BLOCK_R), dtype=tl.float32)
        for p in range(num_partials):
            lhs += tl.load(buf_rows + p * stride_buf_plane + rr[None, :] * stride_buf_r,
                           mask=mine[:, None] & r_ok[None, :], other=0.0)
        bt = tl.load(b_ptr + u.to(tl.int64) * stride_b_slot + b_cols[:, None] + rr[None, :] * stride_b_r,
                     mask=col_ok[:, None] & r_ok[None, :], other=0.0)
        if LORA_CAST:
            bt = bt.to(tl.float32)
        else:
            lhs = lhs.to(bt.dtype)
        acc = tl.dot(lhs, tl.trans(bt), acc, input_precision=LORA_PRECISION)
        remaining = tl.where(mine, 0, remaining)
    return acc


@triton.jit(do_not_specialize=("M", "num_partials"))
def gemm_lora_kernel(
        x_ptr, w_ptr, bias_ptr, buf_ptr, b0_ptr, b1_ptr, b2_ptr, b3_ptr, slots_ptr, ranks_ptr, y_ptr,
        ws_ptr, lock_ptr,
        M, N, K, k_per_split, num_slots, num_partials, nt1, nt2, nt3,
        stride_xm, stride_xk, stride_wn, stride_wk, stride_ym, stride_yn, stride_bias,
        stride_buf_plane, stride_buf_slice, stride_buf_m, stride_buf_r,
        stride_b0_slot, stride_b0_col, stride_b0_rank, stride_b1_slot, stride_b1_col, stride_b1_rank,
        stride_b2_slot, stride_b2_col, stride_b2_rank, stride_b3_slot, stride_b3_col, stride_b3_rank,
        out_ptr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
        SPLIT_K: tl.constexpr, EVEN_K: tl.constexpr,
        HAS_BIAS: tl.constexpr, ADD_INPUTS: tl.constexpr, HAS_LORA: tl.constexpr, LORA_MODE: tl.constexpr,
        RANK: tl.constexpr, BLOCK_R: tl.constexpr, R_CHUNK: tl.constexpr,
        HAS_RANKS: tl.constexpr, CAST_FP32: tl.constexpr, DOT_PRECISION: tl.constexpr,
        LORA_CAST: tl.constexpr, LORA_PRECISION: tl.constexpr, PREFETCH_B: tl.constexpr):
    """out[m, n] = (y if ADD_INPUTS else 0) + x[m] @ W[n] + bias[n] + the LoRA term of row m (module
    docstring). Grid (tiles, SPLIT_K): split p covers columns [p, p + 1) * k_per_split of K (a
    multiple of BLOCK_K; a runtime argument, so that one compiled kernel serves every K). y_ptr
    (read) and out_ptr (written) are the same array.
    ws_ptr: float32 (SPLIT_K, M, N) and lock_ptr: int32, one counter per tile (0 between launches),
    read only when SPLIT_K > 1. num_partials: P, the planes of buf (a runtime argument: the shrink's
    split does not compile another GEMM)."""
    pid = tl.program_id(0)
    split = tl.program_id(1)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    in_band = GROUP_M * num_pid_n
    first_m = (pid // in_band) * GROUP_M
    band_m = tl.minimum(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % in_band) % band_m
    pid_n = (pid % in_band) // band_m
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < M
    col_ok = cols < N
    rows64 = rows.to(tl.int64)
    if HAS_LORA:
        # the LoRA term's addresses (used by the epilogue; the slots' load is not waited for before)
        s, first = _tile_slice(pid_n, nt1, nt2, nt3)
        slot = tl.load(slots_ptr + rows, mask=row_ok, other=-1)
        lora_row = (slot >= 0) & (slot < num_slots)
        slot = tl.where(lora_row, slot, 0)
        b_ptr = pick_slice(s, b0_ptr, b1_ptr, b2_ptr, b3_ptr)
        stride_b_slot = pick_slice(s, stride_b0_slot, stride_b1_slot, stride_b2_slot, stride_b3_slot)
        stride_b_col = pick_slice(s, stride_b0_col, stride_b1_col, stride_b2_col, stride_b3_col)
        stride_b_r = pick_slice(s, stride_b0_rank, stride_b1_rank, stride_b2_rank, stride_b3_rank)
        b_cols = ((pid_n - first) * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64) * stride_b_col
        buf_rows = buf_ptr + s * stride_buf_slice + rows64[:, None] * stride_buf_m
        if PREFETCH_B:
            # the rows' B tiles into L2 while the product runs (compiled only): the epilogue's
            # gathered loads then wait for L2, not DRAM; the program waits for its slots here
            prefetch_l2(b_ptr + slot.to(tl.int64)[:, None] * stride_b_slot + b_cols[None, :],
                        lora_row[:, None] & col_ok[None, :])
    # 1. the product over this split's K chunk
    offs_k = tl.arange(0, BLOCK_K)
    x_rows = x_ptr + rows64[:, None] * stride_xm
    w_rows = w_ptr + cols.to(tl.int64)[:, None] * stride_wn
    k_begin = split * k_per_split
    k_end = tl.minimum(k_begin + k_per_split, K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_begin, k_end, BLOCK_K):
        k = k0 + offs_k
        if EVEN_K:
            xt = tl.load(x_rows + k[None, :] * stride_xk, mask=row_ok[:, None], other=0.0)
            wt = tl.load(w_rows + k[None, :] * stride_wk, mask=col_ok[:, None], other=0.0)
        else:
            k_ok = k < k_end
            xt = tl.load(x_rows + k[None, :] * stride_xk, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            wt = tl.load(w_rows + k[None, :] * stride_wk, mask=col_ok[:, None] & k_ok[None, :], other=0.0)
        if CAST_FP32:
            xt = xt.to(tl.float32)
            wt = wt.to(tl.float32)
        acc = tl.dot(xt, tl.trans(wt), acc, input_precision=DOT_PRECISION)
    # 2. split-K: the last split to arrive sums the planes
    if SPLIT_K > 1:
        tile_ok = row_ok[:, None] & col_ok[None, :]
        plane = rows64[:, None] * N + cols[None, :]
        plane_size = M.to(tl.int64) * N
        tl.store(ws_ptr + split.to(tl.int64) * plane_size + plane, acc, mask=tile_ok)
        tl.debug_barrier()                       # every thread's partial stored before the ticket
        lock = lock_ptr + pid_m * num_pid_n + pid_n
        ticket = tl.atomic_add(lock, 1, sem="acq_rel", scope="gpu")
        if ticket != SPLIT_K - 1:
            return
        tl.atomic_xchg(lock, 0, sem="relaxed", scope="gpu")           # 0 again for the next launch
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for p in tl.static_range(SPLIT_K):
            acc += tl.load(ws_ptr + p * plane_size + plane, mask=tile_ok, other=0.0, cache_modifier=".cg")
    # 3. epilogue
    if ADD_INPUTS:
        acc += tl.load(y_ptr + rows64[:, None] * stride_ym + cols[None, :] * stride_yn,
                       mask=row_ok[:, None] & col_ok[None, :], other=0.0).to(tl.float32)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols * stride_bias, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    if HAS_LORA:
        if LORA_MODE == 1:
            rank_row = _row_ranks(slot, lora_row, ranks_ptr, RANK, HAS_RANKS)
            b_rows = b_ptr + slot.to(tl.int64)[:, None, None] * stride_b_slot + b_cols[None, :, None]
            acc = _lora_rows(acc, buf_rows, stride_buf_plane, stride_buf_r, b_rows, stride_b_r, col_ok, rank_row,
                             num_partials, BLOCK_R, R_CHUNK)
        else:
            acc = _lora_slots(acc, buf_rows, stride_buf_plane, stride_buf_r, b_ptr, stride_b_slot, b_cols,
                              stride_b_r, col_ok, slot, lora_row, ranks_ptr, RANK, HAS_RANKS, num_partials,
                              BLOCK_R, LORA_CAST, LORA_PRECISION)
    tl.store(out_ptr + rows64[:, None] * stride_ym + cols[None, :] * stride_yn, acc.to(out_ptr.dtype.element_ty),
             mask=row_ok[:, None] & col_ok[None, :])


# ------------------------------------------------------------------------------- launch plan

@dataclasses.dataclass(frozen=True)
class GemmLoRAPlan:
    """How `gemm_lora_kernel` is launched: grid, meta-parameters, warps, stages, and the slice
    starts in column tiles (nt1..nt3: runtime arguments, so one compiled kernel serves every
    layer shape)."""

    grid: tuple
    constexprs: dict
    num_warps: int
    num_stages: int
    slice_tiles: tuple
    split_k: int
    k_per_split: int


def plan_gemm_lora(M: int, N: int, K: int, widths, rank: int, x_dtype: str, w_dtype: str, b_dtype: str | None,
                   config: dict, *, has_bias: bool, add_inputs: bool, has_lora: bool,
                   has_ranks: bool) -> GemmLoRAPlan:
    """Grid and meta-parameters of `gemm_lora_kernel`.

    widths: the output slices' widths (sum N); every one but the last must be a multiple of
    BLOCK_N (ValueError otherwise). config: BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages, and
    optionally GROUP_M (1), SPLIT_K (1), LORA_MODE ("rows" or "slots"; default rows up to 32 rows
    of M, else slots), R_CHUNK (rank columns per gathered load in rows mode), PREFETCH_B (rows mode,
    compiled: the rows' B tiles prefetched into L2 before the product; default False). The number of
    split-K planes the kernel really runs is `plan.split_k` (<= SPLIT_K)."""
    widths = tuple(int(w) for w in widths)
    if sum(widths) != N:
        raise ValueError(f"output_slices must add up to the weight's {N} rows, got {widths} (sum {sum(widths)})")
    if len(widths) > MAX_SLICES:
        raise ValueError(f"gemm_lora takes at most {MAX_SLICES} output slices, got {len(widths)}")
    bm, bn, bk = int(config["BLOCK_M"]), int(config["BLOCK_N"]), int(config["BLOCK_K"])
    check_dot_dims(bm, bn, bk)
    bad = [w for w in widths[:-1] if w % bn]
    if bad:
        raise ValueError(f"gemm_lora: every output slice but the last must be a multiple of BLOCK_N={bn} (one slice "
                         f"per column tile), got widths {widths}; pick a config with a smaller BLOCK_N")
    split = max(1, int(config.get("SPLIT_K", 1)))
    k_per_split = triton.cdiv(triton.cdiv(K, split), bk) * bk
    split = triton.cdiv(K, k_per_split)
    starts, total = [], 0
    for w in widths:
        starts.append(total)
        total += triton.cdiv(w, bn)
    big = 1 << 30
    nt = tuple(starts[i] if i < len(widths) else big for i in (1, 2, 3))
    mode = config.get("LORA_MODE", "rows" if M <= 32 else "slots")
    if mode not in LORA_MODES:
        raise ValueError(f"LORA_MODE must be one of {sorted(LORA_MODES)}, got {mode!r}")
    block_r = max(16, next_pow2(max(rank, 1)))
    r_chunk = int(config.get("R_CHUNK", max(1, min(block_r, 4096 // (bm * bn)))))
    if r_chunk & (r_chunk - 1) or r_chunk > block_r:
        raise ValueError(f"R_CHUNK must be a power of two <= {block_r}, got {r_chunk}")
    cast, precision = cast_and_precision((x_dtype, w_dtype))
    lora_cast, lora_precision = cast_and_precision((b_dtype or w_dtype,))
    constexprs = dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=int(config.get("GROUP_M", 1)), SPLIT_K=split,
                      EVEN_K=K % bk == 0, HAS_BIAS=bool(has_bias),
                      ADD_INPUTS=bool(add_inputs), HAS_LORA=bool(has_lora), LORA_MODE=LORA_MODES[mode],
                      RANK=int(rank), BLOCK_R=block_r, R_CHUNK=r_chunk,
                      HAS_RANKS=bool(has_ranks), CAST_FP32=cast, DOT_PRECISION=precision,
                      LORA_CAST=lora_cast, LORA_PRECISION=lora_precision,
                      PREFETCH_B=bool(config.get("PREFETCH_B", False)) and has_lora and mode == "rows"
                      and not interpreting())
    grid = (triton.cdiv(M, bm) * triton.cdiv(N, bn), split)
    return GemmLoRAPlan(grid, constexprs, int(config.get("num_warps", 4)), int(config.get("num_stages", 3)), nt,
                        split, k_per_split)
