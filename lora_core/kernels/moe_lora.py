"""The mixture-of-experts LoRA kernel: each routed (token, expert) pair through its adapter's A / B of that expert.

Math (contract section 9), pair p = t * top_k + k of token t's k-th expert e = topk_ids[t, k],
slot l = token_lora_mapping[t], products accumulated in float32:

  shrink:  buf[s, p, :] = A_s[l, e] @ x[row(p)]                  A_s (L, E, r, K)
  expand:  y[p, offset + off_s : ... + n_s] += w(p) * B_s[l, e] @ buf[s, p]      B_s (L, E, n_s, r)

row(p) = p and w(p) = topk_weights[t, k] with MUL_ROUTED_WEIGHT (the down projection, whose
input has one row per pair and whose output the model weights by the router), else row(p) = t
and w(p) = 1 (gate_up, one input row per token). Pairs whose token has no adapter (l = -1), whose
slot's adapter has no expert LoRA (adapter_enabled[l] == 0) or whose expert is -1 are neither
read nor written: they cost nothing. vLLM folds the LoRA scaling into B; so does the caller here.

Work decomposition (vLLM's `moe_lora_align_block_size` layout). Two pair orders, one kernel:

1. Sorted (prefill, many pairs): per slot l, `sorted_token_ids[l]` lists the slot's pairs grouped
   by expert, each group padded with the sentinel num_pairs to a multiple of BLOCK_M;
   `expert_ids[l, m]` is block m's expert (-1: none) and `num_tokens_post_padded[l]` the slot's
   padded length. The blocks of all slots are numbered one after another (slot l's first block is
   the sum of the earlier slots' num_tokens_post_padded / BLOCK_M, found by a prefix sum over the
   slots in registers); each block is one expert of one slot, so A_s[l, e] and B_s[l, e] are loaded
   once for BLOCK_M pairs (tl.dot on tiles). A config may take the alignment's blocks in SUBS
   sub-blocks of BLOCK_M = block_size / SUBS rows each (a run of few pairs then pays for fewer
   padded rows; sub-block m's expert is expert_ids[l, m // SUBS]); a sub-block holding only
   padding returns at once.
2. Naive (decode, few pairs: sorted_token_ids None): `expert_ids` is topk_ids flattened (P,),
   program p takes pair p alone; its slot comes from token_lora_mapping[p // top_k].

The kernel runs in two phases (PHASE constexpr, two launches on one grid of blocks). PHASE 0
(shrink) writes the float32 rank-sized rows buf[s, p, :r] of its pairs (grid axis 1 = slice *
rank chunks * hidden parts). PHASE 1 (expand) reads them back, adds the hidden parts' planes once,
and adds B's columns in TILES_N tiles of BLOCK_N (grid axis 1 = slice * N_TILES + the program's
group of tiles). The shrink of a slice is never recomputed per output tile, and a pair's rows of
buf and y are touched by one program per tile, so no atomics. When the slices share one A (PEFT's
fused gate_up_proj, split into gate and up halves), SHARED_A: the shrink runs once (slice 0) and
every expand reads slice 0's rows. GEMV (naive order): a program's one pair as vectors -- x row
times an A tile summed over the hidden axis, B tile times the rank row summed over the rank axis --
instead of a 16-row tl.dot tile with one live row. Every tile and launch size comes from a
`moe_configs.MoeConfig` (per-device table, else defaults).

Grid sizes depend only on (num_pairs, max_loras, E, BLOCK_M), the rank and the widths, never on
the routing: the launch is CUDA-graph capturable. In the sorted order a program loops over blocks
pid, pid + G, ... (G programs) up to the routing's last block (the slots' num_tokens_post_padded
summed on the device), so a grid smaller than the bound on the blocks still covers any routing
and no program starts only to find no block.

HAS_RANKS: rank columns c >= ranks[l] (each slot's real rank) are neither read nor written, so
they count as zero whatever the padded weights hold.

Deterministic plans (`plan_moe_lora(deterministic=True)`, the naive order only): one launch
configuration for every batch -- no hidden split, the whole rank in one chunk, fixed tiles -- and
each program's one live pair in row 0 of its tile. A pair's values then come from one sequence of
float32 operations that depends on the weight shapes only: bitwise the same whatever the other
pairs of the batch and the pair's position.

`moe_lora_calls` builds the two launches' parameter lists once for every launcher (torch's,
jax_lora's FFI handler, the interpreter). The kernel writes two of its pointer parameters (the
rank buffer `buf_ptr` and `y_ptr`, in the middle of the list): it has no trailing `out`.

Interpreter: under TRITON_INTERPRET=1 tiles are upcast to float32 after loading (CAST_FP32).
"""

from __future__ import annotations

import dataclasses

import triton
import triton.language as tl

from .arguments import KernelCall, Strides
from .common import HAVE_PDL, gdc_launch_dependents, gdc_wait, weight_operand
from .moe_configs import MoeConfig, MoeShape, check_config, live_blocks, moe_config, resolve
from .planning import cast_and_precision, next_pow2, pdl_launch

MAX_SLICES = 2            # gate_up (w13) has two slices, down (w2) one
# The tl.dot expand loads a tile's y before its B tile and dots (both loads in flight at once) up
# to this rank; above it the y tile held across the dots spills registers at 64-row blocks
# (ptxas for sm_90), so y is loaded after them.
Y_FIRST_MAX_RANK = 32


@triton.jit
def moe_lora_kernel(
        # pointers: input rows, A and B per slice (slices 0..1), the float32 rank buffer, y
        x_ptr, a0_ptr, a1_ptr, b0_ptr, b1_ptr, buf_ptr, y_ptr,
        # pointers: fp8 channel scales of A (L, E, r) and B (L, E, n_s) per slice (read for e4m3 weights only)
        as0_ptr, as1_ptr, bs0_ptr, bs1_ptr,
        # pointers: routing and adapter metadata, each slot's real rank (read with HAS_RANKS)
        topk_weights_ptr, sorted_ptr, expert_ids_ptr, post_pad_ptr, token_lora_ptr, enabled_ptr, ranks_ptr,
        # sizes
        num_pairs, top_k, hidden, n0, n1, rank, max_blocks, num_slots, y_offset,
        # strides: x (row, hidden); A per slice (slot, expert, rank, hidden); B per slice (slot, expert, n, rank)
        stride_x_row, stride_x_hidden,
        stride_a0_slot, stride_a0_expert, stride_a0_rank, stride_a0_hidden,
        stride_a1_slot, stride_a1_expert, stride_a1_rank, stride_a1_hidden,
        stride_b0_slot, stride_b0_expert, stride_b0_n, stride_b0_rank,
        stride_b1_slot, stride_b1_expert, stride_b1_n, stride_b1_rank,
        # strides: the fp8 scales per slice (slot, expert; the channel axis contiguous)
        stride_as0_slot, stride_as0_expert, stride_as1_slot, stride_as1_expert,
        stride_bs0_slot, stride_bs0_expert, stride_bs1_slot, stride_bs1_expert,
        # strides: buf (slice, pair, rank), y (pair, column), sorted ids / expert ids per slot
        stride_buf_slice, stride_buf_pair, stride_y_pair, stride_y_col, stride_sorted_slot, stride_expert_slot,
        # meta-parameters
        PHASE: tl.constexpr, NAIVE: tl.constexpr, MUL_ROUTED_WEIGHT: tl.constexpr, SHARED_A: tl.constexpr,
        HAS_RANKS: tl.constexpr, GEMV: tl.constexpr, BF16_SPLIT: tl.constexpr, USE_PDL: tl.constexpr,
        Y_FIRST: tl.constexpr,
        N_TILES: tl.constexpr, TILES_N: tl.constexpr, BLOCK_M: tl.constexpr, SUBS: tl.constexpr, BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr, R_CHUNK: tl.constexpr, K_SPLIT: tl.constexpr,
        K_PER: tl.constexpr, SLOTS_P2: tl.constexpr, CAST_FP32: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """PHASE 0: buf[s * K_SPLIT + j, p, rank chunk] = A_s[l, e, chunk, K part j] @ x[row(p), K part j];
    PHASE 1: y[p, cols of s] += w(p) * B_s[l, e] @ sum_j buf[s' * K_SPLIT + j, p] (s' = 0 with SHARED_A,
    else s), for the pairs of the program's block, over TILES_N tiles of BLOCK_N columns (N_TILES
    programs per slice). GEMV (naive order): the pair's rows as vectors, products summed with tl.sum
    instead of tl.dot on a 16-row tile (see the module docstring). fp8 (e4m3) A or B: tiles enter
    the products in x's dtype (float32 under CAST_FP32 and in the GEMV path), and the float32
    result is multiplied once by the channel scales: buf's rank columns by a_scale_s[l, e, c], the
    expand's columns by b_scale_s[l, e, n] (before the routed weight)."""
    pid = tl.program_id(0)
    axis1 = tl.program_id(1)
    k_split = axis1 % K_SPLIT
    r_chunk = (axis1 // K_SPLIT) % (BLOCK_R // R_CHUNK)
    s = axis1 // N_TILES if PHASE == 1 else axis1 // (K_SPLIT * (BLOCK_R // R_CHUNK))
    n_prog = axis1 % N_TILES
    if PHASE == 0 and USE_PDL:
        gdc_launch_dependents()                      # the expand's programs may start (they wait below)
    if PHASE == 0 and SHARED_A:  # noqa: SIM102 - constexpr test apart from the runtime one
        if s > 0:
            return
    if PHASE == 1:                                   # the program's columns of slice s
        width = tl.where(s == 0, n0, n1)
        n_lo = n_prog * (TILES_N * BLOCK_N)
        if n_lo >= width:
            return
    offs_m = tl.arange(0, BLOCK_M)
    # 1. The program's blocks: naive, pair pid alone; sorted, blocks pid, pid + G, pid + 2G, ... (G
    # programs) of all slots' blocks one after another: slot l owns num_tokens_post_padded[l] /
    # BLOCK_M of them, so no program waits on a block past the routing's last.
    if NAIVE:
        blk_end = pid + 1
        step = 1
    else:
        offs_l = tl.arange(0, SLOTS_P2)
        blocks = tl.load(post_pad_ptr + offs_l, mask=offs_l < num_slots, other=0) // BLOCK_M
        ends = tl.cumsum(blocks, 0)
        blk_end = tl.sum(blocks, 0)
        step = tl.num_programs(0)
    if PHASE == 1 and USE_PDL:
        gdc_wait()                                   # the shrink's rank rows written and visible
    for blk in range(pid, blk_end, step):
        # 2. The block's slot, expert and pairs; a block without work (no adapter, a disabled slot,
        # expert -1, a sub-block of padding only) is skipped.
        if NAIVE:
            slot = tl.load(token_lora_ptr + blk // top_k)
            expert = tl.load(expert_ids_ptr + blk)
            pairs = tl.where(offs_m == 0, blk, num_pairs)
            live = (slot >= 0) & (slot < num_slots) & (expert >= 0)
        else:
            slot = tl.sum((ends <= blk).to(tl.int32), 0)
            block = blk - tl.sum(tl.where(offs_l < slot, blocks, 0), 0)
            live = (slot < num_slots) & (block < max_blocks)
            at_slot = tl.where(live, slot, 0)
            at_block = tl.where(live, block, 0)
            expert = tl.load(expert_ids_ptr + at_slot * stride_expert_slot + at_block // SUBS)
            pairs = tl.load(sorted_ptr + at_slot * stride_sorted_slot + at_block * BLOCK_M + offs_m)
            live = live & (expert >= 0) & (tl.min(pairs, 0) < num_pairs)
        slot = tl.where(live, slot, 0)                   # a real slot's index to read, live or not
        live = live & (tl.load(enabled_ptr + slot) != 0)
        if live:
            pair_ok = pairs < num_pairs
            pairs = tl.where(pair_ok, pairs, 0)
            live_rank = rank
            if HAS_RANKS:                            # rank columns past the slot's own are neither read nor written
                live_rank = tl.minimum(rank, tl.load(ranks_ptr + slot))
            slot64 = slot.to(tl.int64)
            expert64 = expert.to(tl.int64)
            blk64 = tl.cast(blk, tl.int64)
            first = s == 0
            if PHASE == 0:
                offs_r = r_chunk * R_CHUNK + tl.arange(0, R_CHUNK)
                rank_ok = offs_r < live_rank
                # 3. Shrink: x rows against A_s[l, e] (rank chunk, BLOCK_K) tiles, over the hidden part.
                a_ptr = tl.where(first, a0_ptr + slot64 * stride_a0_slot + expert64 * stride_a0_expert,
                                 a1_ptr + slot64 * stride_a1_slot + expert64 * stride_a1_expert)
                stride_ar = tl.where(first, stride_a0_rank, stride_a1_rank)
                stride_ak = tl.where(first, stride_a0_hidden, stride_a1_hidden)
                as_ptr = tl.where(first, as0_ptr + slot64 * stride_as0_slot + expert64 * stride_as0_expert,
                                  as1_ptr + slot64 * stride_as1_slot + expert64 * stride_as1_expert)
                k_lo = k_split * K_PER
                k_hi = tl.minimum(hidden, k_lo + K_PER)
                plane = s * K_SPLIT + k_split
                if GEMV:
                    row = blk64 if MUL_ROUTED_WEIGHT else blk64 // top_k
                    x_row = x_ptr + row * stride_x_row
                    vec = tl.zeros((R_CHUNK,), dtype=tl.float32)
                    for k0 in range(k_lo, k_hi, BLOCK_K):
                        offs_k = k0 + tl.arange(0, BLOCK_K)
                        k_ok = offs_k < k_hi
                        xv = tl.load(x_row + offs_k * stride_x_hidden, mask=k_ok, other=0.0).to(tl.float32)
                        at = tl.load(a_ptr + offs_r[:, None] * stride_ar + offs_k[None, :] * stride_ak,
                                     mask=rank_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
                        vec += tl.sum(at * xv[None, :], axis=1)
                    if a0_ptr.dtype.element_ty.is_fp8():
                        vec = vec * tl.load(as_ptr + offs_r, mask=rank_ok, other=1.0).to(tl.float32)
                    tl.store(buf_ptr + plane * stride_buf_slice + blk64 * stride_buf_pair + offs_r, vec, mask=rank_ok)
                else:
                    rows = pairs if MUL_ROUTED_WEIGHT else pairs // top_k
                    x_rows = x_ptr + rows.to(tl.int64)[:, None] * stride_x_row
                    acc = tl.zeros((BLOCK_M, R_CHUNK), dtype=tl.float32)
                    for k0 in range(k_lo, k_hi, BLOCK_K):
                        offs_k = k0 + tl.arange(0, BLOCK_K)
                        k_ok = offs_k < k_hi
                        xt = tl.load(x_rows + offs_k[None, :] * stride_x_hidden, mask=pair_ok[:, None] & k_ok[None, :],
                                     other=0.0)
                        at = tl.load(a_ptr + offs_r[None, :] * stride_ar + offs_k[:, None] * stride_ak,
                                     mask=rank_ok[None, :] & k_ok[:, None], other=0.0)
                        if CAST_FP32:
                            xt = xt.to(tl.float32)
                            at = at.to(tl.float32)
                        else:
                            at = weight_operand(at, x_ptr, CAST_FP32)
                        acc += tl.dot(xt, at, input_precision=DOT_PRECISION)
                    if a0_ptr.dtype.element_ty.is_fp8():
                        acc = acc * tl.load(as_ptr + offs_r, mask=rank_ok, other=1.0).to(tl.float32)[None, :]
                    out = (buf_ptr + plane * stride_buf_slice + pairs.to(tl.int64)[:, None] * stride_buf_pair
                           + offs_r[None, :])
                    tl.store(out, acc, mask=pair_ok[:, None] & rank_ok[None, :])
            else:
                # 4. Expand: the block's rank rows (the planes summed once) against B_s[l, e]'s TILES_N tiles
                # of BLOCK_N columns, weighted, added into y.
                offs_r = tl.arange(0, BLOCK_R)
                rank_ok = offs_r < live_rank
                b_ptr = tl.where(first, b0_ptr + slot64 * stride_b0_slot + expert64 * stride_b0_expert,
                                 b1_ptr + slot64 * stride_b1_slot + expert64 * stride_b1_expert)
                stride_bn = tl.where(first, stride_b0_n, stride_b1_n)
                stride_br = tl.where(first, stride_b0_rank, stride_b1_rank)
                bs_ptr = tl.where(first, bs0_ptr + slot64 * stride_bs0_slot + expert64 * stride_bs0_expert,
                                  bs1_ptr + slot64 * stride_bs1_slot + expert64 * stride_bs1_expert)
                col0 = tl.where(first, y_offset, y_offset + n0)
                src = 0 if SHARED_A else s
                if GEMV:
                    vec = tl.zeros((BLOCK_R,), dtype=tl.float32)
                    for j in tl.static_range(K_SPLIT):         # the shrink's partial sums, in plane order
                        vec += tl.load(buf_ptr + (src * K_SPLIT + j) * stride_buf_slice + blk64 * stride_buf_pair
                                       + offs_r, mask=rank_ok, other=0.0)
                    if MUL_ROUTED_WEIGHT:
                        w = tl.load(topk_weights_ptr + blk).to(tl.float32)
                    y_row = y_ptr + blk64 * stride_y_pair
                    for t in range(TILES_N):
                        offs_n = n_lo + t * BLOCK_N + tl.arange(0, BLOCK_N)
                        n_ok = offs_n < width
                        y_ptrs = y_row + (col0 + offs_n) * stride_y_col
                        prev = tl.load(y_ptrs, mask=n_ok, other=0.0)
                        bt = tl.load(b_ptr + offs_n[:, None] * stride_bn + offs_r[None, :] * stride_br,
                                     mask=n_ok[:, None] & rank_ok[None, :], other=0.0).to(tl.float32)
                        acc = tl.sum(bt * vec[None, :], axis=1)
                        if b0_ptr.dtype.element_ty.is_fp8():
                            acc = acc * tl.load(bs_ptr + offs_n, mask=n_ok, other=1.0).to(tl.float32)
                        if MUL_ROUTED_WEIGHT:
                            acc = acc * w
                        tl.store(y_ptrs, (prev.to(tl.float32) + acc).to(y_ptr.dtype.element_ty), mask=n_ok)
                else:
                    row_ptrs = buf_ptr + pairs.to(tl.int64)[:, None] * stride_buf_pair + offs_r[None, :]
                    rows = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
                    for j in tl.static_range(K_SPLIT):         # the shrink's partial sums, in plane order
                        rows += tl.load(row_ptrs + (src * K_SPLIT + j) * stride_buf_slice,
                                        mask=pair_ok[:, None] & rank_ok[None, :], other=0.0)
                    if MUL_ROUTED_WEIGHT:
                        w = tl.load(topk_weights_ptr + pairs, mask=pair_ok, other=0.0).to(tl.float32)
                    if BF16_SPLIT:                             # rows = hi + lo, two bfloat16 terms (16 mantissa bits)
                        hi = rows.to(tl.bfloat16)
                        lo = (rows - hi.to(tl.float32)).to(tl.bfloat16)
                    y_rows = y_ptr + pairs.to(tl.int64)[:, None] * stride_y_pair
                    for t in range(TILES_N):
                        offs_n = n_lo + t * BLOCK_N + tl.arange(0, BLOCK_N)
                        n_ok = offs_n < width
                        y_ptrs = y_rows + (col0 + offs_n)[None, :] * stride_y_col
                        ok = pair_ok[:, None] & n_ok[None, :]
                        if Y_FIRST:                    # y's load and B's in flight together, before the dots
                            prev = tl.load(y_ptrs, mask=ok, other=0.0)
                        bt = tl.load(b_ptr + offs_n[None, :] * stride_bn + offs_r[:, None] * stride_br,
                                     mask=n_ok[None, :] & rank_ok[:, None], other=0.0)
                        if BF16_SPLIT:
                            bt = weight_operand(bt, y_ptr, CAST_FP32)
                            acc = tl.dot(lo, bt)
                            acc = tl.dot(hi, bt, acc)
                        else:
                            acc = tl.dot(rows, bt.to(tl.float32), input_precision=DOT_PRECISION)
                        if b0_ptr.dtype.element_ty.is_fp8():
                            acc = acc * tl.load(bs_ptr + offs_n, mask=n_ok, other=1.0).to(tl.float32)[None, :]
                        if MUL_ROUTED_WEIGHT:
                            acc = acc * w[:, None]
                        if not Y_FIRST:
                            prev = tl.load(y_ptrs, mask=ok, other=0.0)
                        tl.store(y_ptrs, (prev.to(tl.float32) + acc).to(y_ptr.dtype.element_ty), mask=ok)


@dataclasses.dataclass(frozen=True)
class MoePlan:
    """A launch of `moe_lora_kernel`: its grids (shrink, expand), meta-parameters, and each launch's
    warps and stages (from its `MoeConfig`)."""

    shrink_grid: tuple
    expand_grid: tuple
    constexprs: dict
    max_blocks: int
    k_split: int
    """Partial-sum planes per slice: the rank buffer holds slices * k_split planes."""
    shrink_warps: int = 4
    shrink_stages: int = 3
    expand_warps: int = 4
    expand_stages: int = 3
    config: MoeConfig | None = None
    """The config the plan came from (None: a deterministic plan's fixed one)."""
    num_pairs: int = 0

    def phase(self, phase: int) -> MoePhase:
        """The launch plan of PHASE `phase` (0 shrink, 1 expand). The meta-parameters the phase does
        not read are set to fixed values (the shrink's N_TILES, TILES_N, BLOCK_N; the expand's
        BLOCK_K, R_CHUNK, K_PER), so that plans differing only in the other phase's tiles share
        its compiled kernel."""
        c = self.constexprs
        if phase == 0:
            return MoePhase(self.shrink_grid, {**c, "PHASE": 0, "N_TILES": 1, "TILES_N": 1, "BLOCK_N": 16},
                            self.shrink_warps, self.shrink_stages)
        return MoePhase(self.expand_grid, {**c, "PHASE": 1, "BLOCK_K": 16, "R_CHUNK": c["BLOCK_R"], "K_PER": 16},
                        self.expand_warps, self.expand_stages,
                        bool(c.get("USE_PDL")) and pdl_launch("expand", self.num_pairs))


@dataclasses.dataclass(frozen=True)
class MoePhase:
    """One launch of `moe_lora_kernel` (what a launcher reads of a plan: grid, warps, stages,
    constexprs)."""

    grid: tuple
    constexprs: dict
    num_warps: int = 4
    num_stages: int = 3
    launch_pdl: bool = False
    """Launched as a programmatic dependent of the launch before it (the expand after its shrink)."""


# The deterministic plan's fixed config: a function of nothing but the weight shapes (the rank
# chunk is the whole rank, no hidden split, one tile per expand program, the 16-row tile path).
DETERMINISTIC_CONFIG = MoeConfig(BLOCK_K=64, R_CHUNK=1 << 30, K_SPLIT=1, shrink_warps=4, shrink_stages=3,
                                 BLOCK_N=64, TILES_N=1, expand_warps=4, expand_stages=3, GEMV=False)


def plan_moe_lora(*, num_pairs: int, num_slots: int, num_experts: int, hidden: int, widths: tuple, rank: int,
                  naive: bool, sorted_len: int, block_m: int, mul_routed_weight: bool, shared_a: bool,
                  dtypes: tuple, has_ranks: bool = False, deterministic: bool = False,
                  config: MoeConfig | None = None, device: str | None = None, pdl: bool = False) -> MoePlan:
    """The grids and meta-parameters of one MoE LoRA call.

    1. Blocks: naive, one program per pair (the GEMV path: vectors; else BLOCK_M 16, only row 0
       live: tl.dot's smallest tile); sorted, the blocks of every slot one after another, each in
       SUBS = block_m / BLOCK_M sub-blocks (the config's BLOCK_M, `moe_configs.resolve`): at most
       cdiv(pairs, BLOCK_M) + SUBS * the number of (slot, expert) runs, min(slots * experts, pairs)
       (each run wastes under one block), never slots * sorted_len / BLOCK_M; with the config's
       PERSIST, at most PERSIST programs per block `moe_configs.live_blocks` expects, each looping
       over the blocks that many programs apart.
    2. The config: `config` if given, else `moe_configs.moe_config` (an override, the device
       table's entry for the shape's bucket, the default); BLOCK_R = the rank rounded up to a
       power of two >= 16; K_SPLIT / TILES_N resolved for the shape (`moe_configs.resolve`).
    3. The hidden size in K_SPLIT parts of K_PER elements (a multiple of BLOCK_K), each part's
       partial sum in its own plane of the rank buffer (slices * K_SPLIT planes), added by the
       expand in plane order: no atomics, no zeroing, x still read once.
    4. Shrink grid (blocks, slices * rank chunks * K_SPLIT); expand grid (blocks, slices *
       N_TILES), N_TILES = programs per slice, each over TILES_N tiles of BLOCK_N columns.
    deterministic (naive only): DETERMINISTIC_CONFIG whatever the table says -- the whole rank in
    one chunk, no hidden split, fixed tiles -- so every batch runs one configuration.
    has_ranks: the kernel reads each slot's rank (HAS_RANKS). pdl (Hopper and newer, the launcher's
    choice): USE_PDL, the expand launched as a programmatic dependent of the shrink (when
    `planning.pdl_launch("expand", ...)` allows it): its programs start while the shrink's last
    run, work out their blocks, and wait (gdc_wait) before reading the rank buffer and y.
    """
    if deterministic and not naive:
        raise ValueError("plan_moe_lora: deterministic plans take the naive order (one pair per program)")
    if len(widths) not in (1, 2):
        raise ValueError(f"lora_b_stacked: expected 1 or {MAX_SLICES} slices, got {len(widths)}")
    if naive:
        bm, max_blocks, blocks = 16, 1, num_pairs
    else:
        if block_m < 16 or block_m & (block_m - 1):
            raise ValueError(f"block_size: expected a power of two >= 16, got {block_m}")
        if sorted_len % block_m:
            raise ValueError(f"sorted_token_ids: expected a length per slot that is a multiple of block_size "
                             f"{block_m}, got {sorted_len}")
        bm = block_m
    slices_shared = shared_a and len(widths) > 1
    shape = MoeShape(num_pairs=num_pairs, naive=naive, block_m=bm, num_slots=num_slots, num_experts=num_experts,
                     hidden=hidden, widest=max(widths), slices=len(widths),
                     shrink_slices=1 if slices_shared else len(widths), rank=rank)
    if deterministic:
        cfg = DETERMINISTIC_CONFIG
    else:
        cfg = check_config(config) if config is not None else moe_config(shape, device=device)
        if not naive and cfg.GEMV:
            cfg = cfg.replace(GEMV=False)             # a sorted block holds many pairs: tl.dot
    r = resolve(cfg, shape)
    subs = bm // r.block_m
    if not naive:
        max_blocks = sorted_len // r.block_m
        blocks = triton.cdiv(num_pairs, r.block_m) + subs * min(num_slots * num_experts, num_pairs)
        if cfg.PERSIST:
            blocks = min(blocks, cfg.PERSIST * live_blocks(shape, r.block_m))
    block_r = shape.block_r
    cast, precision = cast_and_precision(dtypes)
    constexprs = dict(NAIVE=naive, MUL_ROUTED_WEIGHT=mul_routed_weight, SHARED_A=slices_shared,
                      HAS_RANKS=bool(has_ranks), GEMV=bool(cfg.GEMV), USE_PDL=bool(pdl and HAVE_PDL),
                      Y_FIRST=block_r <= Y_FIRST_MAX_RANK,
                      BF16_SPLIT=not cast and set(dtypes) == {"bfloat16"} and not deterministic,
                      N_TILES=r.n_programs, TILES_N=r.tiles_n, BLOCK_M=r.block_m, SUBS=subs, BLOCK_N=r.block_n,
                      BLOCK_K=r.block_k, BLOCK_R=block_r, R_CHUNK=r.r_chunk, K_SPLIT=r.k_split, K_PER=r.k_per,
                      SLOTS_P2=next_pow2(max(num_slots, 2)), CAST_FP32=cast, DOT_PRECISION=precision)
    return MoePlan((max(blocks, 1), len(widths) * (block_r // r.r_chunk) * r.k_split),
                   (max(blocks, 1), len(widths) * r.n_programs), constexprs, max_blocks, r.k_split,
                   cfg.shrink_warps, cfg.shrink_stages, cfg.expand_warps, cfg.expand_stages,
                   None if deterministic else cfg, num_pairs)


def moe_lora_calls(plan: MoePlan, x, lora_a, lora_b, buf, y, topk_weights, sorted_ids, expert_ids, post_pad,
                   token_lora, enabled, ranks, *, num_pairs: int, top_k: int, offset: int,
                   strides: Strides, lora_a_scale=None, lora_b_scale=None) -> tuple[KernelCall, KernelCall]:
    """The (shrink, expand) `KernelCall`s of one MoE LoRA call: the kernel's parameters in order,
    `out` None (the kernel writes `buf` and `y`, pointer parameters among the others).

    x (rows, K); lora_a / lora_b: 1 or 2 slices (L, E, r, K) / (L, E, n_s, r) (a second slice
    missing: slice 0 again); buf (slices * k_split, P, r) float32; y (P, N); topk_weights (P,)
    float32; sorted_ids (L, EM) and post_pad (L,) (naive order: any int32 array, never read);
    expert_ids (L, EM / BLOCK_M) or, naive, (P,); token_lora (>= P / top_k,); enabled (L,);
    ranks (L,) int32 (without HAS_RANKS: any int32 array, never read). lora_a_scale /
    lora_b_scale: None (16-bit weights) or, for e4m3 weights (every slice of A, or of B, one
    dtype), one float32 scale array per slice, (L, E, r) / (L, E, n_s), channel axis contiguous
    (a 16-bit side's scale pointers are `enabled`, never read). Arrays are whatever the launcher
    passes (tensors, jax arrays, placeholders); `strides(a)` gives their element strides.
    """
    a0, a1 = lora_a[0], lora_a[-1]
    b0, b1 = lora_b[0], lora_b[-1]
    num_slots, _, rank, hidden = a0.shape
    widths = (int(b0.shape[2]), int(b1.shape[2]))
    naive = bool(plan.constexprs["NAIVE"])
    as0, as1 = (enabled, enabled) if lora_a_scale is None else (lora_a_scale[0], lora_a_scale[-1])
    bs0, bs1 = (enabled, enabled) if lora_b_scale is None else (lora_b_scale[0], lora_b_scale[-1])
    scale_strides = tuple(v for sc, given in ((as0, lora_a_scale), (as1, lora_a_scale), (bs0, lora_b_scale),
                                              (bs1, lora_b_scale))
                          for v in (tuple(strides(sc)[:2]) if given is not None else (0, 0)))
    pointers = (x, a0, a1, b0, b1, buf, y, as0, as1, bs0, bs1, topk_weights, sorted_ids, expert_ids, post_pad,
                token_lora, enabled, ranks)
    scalars = (int(num_pairs), int(top_k), int(hidden), widths[0], widths[1], int(rank), plan.max_blocks,
               int(num_slots), int(offset), *strides(x), *strides(a0), *strides(a1), *strides(b0), *strides(b1),
               *scale_strides, *strides(buf)[:2], *strides(y), 0 if naive else strides(sorted_ids)[0],
               0 if naive else strides(expert_ids)[0])
    return tuple(KernelCall(moe_lora_kernel, plan.phase(phase), pointers, scalars, None) for phase in (0, 1))
