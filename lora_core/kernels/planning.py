"""Launch planning shared by the three kernels: plain Python over shapes and dtype names.

The torch and JAX launchers both plan through `plan_shrink` / `plan_expand` / `plan_fused` (each
beside its kernel), which use these helpers, so the two sides launch identical kernels with
identical meta-parameters. Nothing here touches an array.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Sequence

import triton

from ..checks import is_fp8
from .configs import interpreting, launch_policy, next_pow2

MAX_SLICES = 4  # slices handled by one launch; more are launched in groups of MAX_SLICES
MAX_PARTIALS = 32  # split-K planes the expand kernel sums (unrolled loads)

# The kernels' token-count parameters, compiled without Triton's divisible-by-16 specialisation
# (`do_not_specialize_on_alignment`): they only bound masks and loops over token rows, where the
# hint buys nothing, and specialising them compiled every launch config twice (token counts that
# are and are not multiples of 16: 68 kernels instead of 36 for a Llama layer's warm-up). A count
# of 1 is still a constant. Every launcher that specialises by itself (the XLA FFI launcher,
# benchmarks/compile_launches.py) follows this list.
TOKEN_COUNT_PARAMS = ("num_tokens", "num_sorted")


PDL_KERNELS = ("shrink", "expand", "fused")
# With LORA_CORE_PDL unset ("auto"), a call's first kernel (shrink or fused) is launched as a
# programmatic dependent of the kernel before it only for small batches: at most the launch
# policy's `first_kernel_pdl_max_tokens` tokens, or `spread_pdl_max_tokens` where the launcher
# spreads a dependent shrink's programs over the SMs (`spread_shared_bytes`: the C launcher of
# torch's PreparedLinear, which the wrapper and the layers use). Why: in a model the kernel before
# a call is the base layer's GEMM. A dependent kernel's programs start on the SMs the GEMM frees
# first, as many per SM as fit, and wait there; a shrink of tens to hundreds of programs piled
# onto a few SMs then reads its weights through those SMs alone, which costs more than the
# overlap saves. Asking for enough shared memory that at most ceil(programs / SMs) share an SM
# removes the pile-up, so small batches gain from the overlap; larger shrinks need their
# occupancy, which the spreading takes away, so they keep a plain first kernel. A one-token
# shrink's few programs do not pile up: it stays dependent without spreading. Back-to-back LoRA
# calls with nothing between gain from a dependent first kernel at every size: LORA_CORE_PDL=1.
# (Measurements: docs/benchmarks_evidence.md, "Rules in the code and their measurements".)
_PDL_MEANING = {"auto": None, "1": "every kernel", "0": "none"}


def _auto_meaning() -> str:
    p = launch_policy()
    return (f"the expand always, a call's first kernel for calls of <= {p.first_kernel_pdl_max_tokens} tokens "
            f"(<= {p.spread_pdl_max_tokens} where the launcher spreads it)")


def _pdl_setting() -> str:
    value = os.environ.get("LORA_CORE_PDL", "auto").strip() or "auto"
    if value not in _PDL_MEANING:
        _pdl_names(value)                      # raises for a name that is no kernel
    _log_pdl_setting(value)
    return value


@functools.cache
def _log_pdl_setting(value: str) -> None:
    """Says once per setting which launches may be programmatic dependents (Hopper and newer)."""
    meaning = _auto_meaning() if value == "auto" else _PDL_MEANING.get(value, f"the kernels listed ({value})")
    logging.getLogger("lora_core").info("programmatic dependent launch (LORA_CORE_PDL=%s): %s", value, meaning)


def _pdl_names(value: str) -> frozenset:
    names = frozenset(v.strip() for v in value.split(",") if v.strip())
    unknown = names - set(PDL_KERNELS)
    if unknown:
        raise ValueError(f"LORA_CORE_PDL: expected auto, 1, 0 or a comma list of {PDL_KERNELS}, got {value!r}")
    return names


def pdl_allowed() -> bool:
    """Whether any kernel may be launched as a programmatic dependent (both launchers; Hopper and
    newer only), by LORA_CORE_PDL: unset or "auto" (see `pdl_launch`) and "1" every kernel, "0"
    none, or a comma list of kernel names ("shrink", "expand", "fused"). The kernels are compiled
    with USE_PDL whenever any kernel may use it; `pdl_launch` then decides each launch, so the
    setting changes launches, not the kernels' code (torch's Triton cache keys the launch option:
    a changed setting compiles its entries once)."""
    value = _pdl_setting()
    return value != "0" and (value in _PDL_MEANING or bool(_pdl_names(value)))


def pdl_launch(kernel: str, num_tokens: int, spread: bool = False) -> bool:
    """Whether a launch of `kernel` compiled with USE_PDL goes out as a programmatic dependent of
    the kernel before it. "auto": the expand always (the kernel before it is the call's own
    shrink), the shrink and the fused kernel -- whose predecessor in a model is the base layer's
    GEMM -- only for calls of <= first_kernel_pdl_max_tokens tokens, or <= spread_pdl_max_tokens
    when the launcher spreads a dependent shrink's programs (`spread=True`, `spread_shared_bytes`;
    both thresholds from the launch policy, `configs.launch_policy`).
    A kernel compiled with USE_PDL but launched plainly still lets its expand start early
    (gdc_launch_dependents); its gdc_wait returns at once."""
    value = _pdl_setting()
    if value == "auto":
        policy = launch_policy()
        limit = policy.spread_pdl_max_tokens if spread else policy.first_kernel_pdl_max_tokens
        return kernel == "expand" or num_tokens <= limit
    if value in _PDL_MEANING:
        return value == "1"
    return kernel in _pdl_names(value)


# Bytes of shared memory the hardware keeps per resident block on every GPU these kernels run on
# (sm_80 and newer: 1 KB per block, counted against the SM's shared memory, not the block's).
SHARED_RESERVED_PER_BLOCK = 1024


def spread_shared_bytes(programs: int, shared: int, num_sms: int, max_shared: int) -> int:
    """Dynamic shared memory (bytes) for a launch of `programs` programs that needs `shared`, so
    that at most k = ceil(programs / num_sms) of them are resident on one SM: a programmatic
    dependent launch then spreads over the SMs instead of piling onto the first ones its
    predecessor frees. `max_shared`: the largest opt-in shared memory of one block (the SM holds
    that plus SHARED_RESERVED_PER_BLOCK). Returns `shared` when it already allows no more than k
    per SM, or when no size lets exactly k fit.

    want = the smallest multiple of 128 bytes with (k + 1) * (want + reserved) > per_sm; kept only
    if k * (want + reserved) <= per_sm (k blocks still fit) and want <= max_shared.
    """
    if programs <= 0 or num_sms <= 0 or max_shared <= 0:
        return shared
    per_sm = max_shared + SHARED_RESERVED_PER_BLOCK
    k = -(-programs // num_sms)
    want = -(-(per_sm // (k + 1) + 1 - SHARED_RESERVED_PER_BLOCK) // 128) * 128
    if shared < want <= max_shared and k * (want + SHARED_RESERVED_PER_BLOCK) <= per_sm:
        return want
    return shared


def slice_chunks(num_slices: int, *weights: Sequence) -> list:
    """(lo, hi) slice ranges of at most MAX_SLICES slices: one launch each.

    weights: per-slice weight lists (A, and B for a linear); a launch's slices share one weight
    dtype per list (the kernels specialise on the pointer's element type), so a range ends where
    a slice's fp8-ness changes in any of them: fp8 and 16-bit slices of one layer go in separate
    launches (contract section 11)."""
    kinds = [tuple(is_fp8(ws[s].dtype) for ws in weights) for s in range(num_slices)]
    chunks, lo = [], 0
    for s in range(1, num_slices + 1):
        if s == num_slices or s - lo == MAX_SLICES or kinds[s] != kinds[lo]:
            chunks.append((lo, s))
            lo = s
    return chunks


def cast_and_precision(dtypes: Sequence[str]) -> tuple[bool, str]:
    """(CAST_FP32, DOT_PRECISION): upcast under the interpreter or when operand dtypes differ."""
    cast = interpreting() or len(set(dtypes)) > 1
    fp32 = cast or "float32" in dtypes
    return cast, ("ieee" if fp32 else "tf32")


def check_dot_dims(*dims: int) -> None:
    # The interpreter does not enforce tl.dot's rules; assert them so CPU tests catch them.
    for d in dims:
        if d < 16 or d & (d - 1):
            raise AssertionError(f"tl.dot block dims must be powers of two >= 16, got {d}")


def slice_tiles(widths: Sequence[int], block_n: int, tiles_per_program: int = 1) -> dict:
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


def small_t_block(num_tokens: int, block_m: int, config: dict | None = None) -> tuple[bool, int]:
    """(SMALL_T, BLOCK_M): the whole batch in one tile per group when T <= the launch policy's
    small_t_max, unless the launch config says SMALL_T False (then BLOCK_M-token tiles of the
    sorted order, as past small_t_max: smaller tiles, two more dependent metadata loads)."""
    if num_tokens <= launch_policy().small_t_max and (config or {}).get("SMALL_T", True):
        return True, max(block_m, max(16, next_pow2(num_tokens)))
    return False, block_m


def max_tiles(num_tokens: int, num_groups: int, block_m: int, small_t: bool = False,
              lora_only: bool = True) -> int:
    """Tiles of any mapping of num_tokens tokens into num_groups groups: the tile-axis grid size."""
    if small_t:
        # Program g serves group g. The active ids are unique values in ascending order, padded
        # (contract section 3): at most num_tokens + 1 groups (one of them -1) hold tokens.
        return min(num_groups, num_tokens + 1) if lora_only else num_groups + 1
    return triton.cdiv(num_tokens, block_m) + min(num_groups, num_tokens)


def hidden_split(hidden: int, split: int, block_k: int) -> tuple[int, int]:
    """(SPLIT_K, K_PER_SPLIT): `split` clamped to 1..min(BLOCK_K chunks, MAX_PARTIALS), each split a
    whole number of BLOCK_K chunks, and the count of splits those chunks really make."""
    split = max(1, min(split, triton.cdiv(hidden, block_k), MAX_PARTIALS))
    k_per_split = triton.cdiv(triton.cdiv(hidden, split), block_k) * block_k
    return triton.cdiv(hidden, k_per_split), k_per_split


DTYPE_BYTES = {"float16": 2, "bfloat16": 2, "float32": 4, "float8_e4m3fn": 1}
FP8_DTYPES = ("float8_e4m3fn",)


def dot_dtype(w_dtype: str, act_dtype: str) -> str:
    """The dtype a weight enters tl.dot in: its own, or for fp8 (e4m3) weights the activations'
    (`common.weight_operand` converts the tile after its load; the per-channel scale is applied
    to the float32 result)."""
    return act_dtype if w_dtype in FP8_DTYPES else w_dtype


def prefetch_constexprs(pdl: bool, columns: int, w_dtype: str) -> dict:
    """PREFETCH_LINES / PREFETCH_LINE: prefetch a program's weight chunk into L2 before waiting for
    the kernel before it (PDL launches, compiled only: inline PTX): at most the launch policy's
    prefetch_max_lines 128-byte lines per weight row; none where the policy's force_prefetch is False."""
    line = 128 // DTYPE_BYTES.get(w_dtype, 2)
    policy = launch_policy()
    off = not pdl or interpreting() or policy.force_prefetch is False
    lines = 0 if off else min(policy.prefetch_max_lines, next_pow2(triton.cdiv(columns, line)))
    return dict(PREFETCH_LINES=lines, PREFETCH_LINE=line)


def epilogue_constexprs(widths, bias_flags, add_inputs, has_ranks, block_n, tiles_per_program=1):
    nt, total = slice_tiles(widths, block_n, tiles_per_program)
    flags = list(bias_flags) + [0] * (MAX_SLICES - len(bias_flags))
    c = dict(nt)
    # each slice's epilogue: 0 none, 1 bias, 2 DoRA column scale (arguments.epilogue)
    c.update({f"BIAS{i}": int(flags[i]) for i in range(MAX_SLICES)})
    c.update(ADD_INPUTS=bool(add_inputs), HAS_RANKS=bool(has_ranks))
    return c, total


class PlanKey:
    """Mixin of the three plans: `key` (hashable identity of the launch) and `launch_pdl`."""

    @functools.cached_property
    def key(self) -> tuple:
        """Hashable identity of the launch (grid, meta-parameters, warps, stages)."""
        return (self.grid, tuple(sorted(self.constexprs.items())), self.num_warps, self.num_stages)

    KERNEL = ""  # "shrink", "expand" or "fused": the name LORA_CORE_PDL lists
    num_tokens = 0  # tokens of the launch (set by the plans whose launch policy depends on it)

    @functools.cached_property
    def launch_pdl(self) -> bool:
        """Launched as a programmatic dependent of the kernel before it: compiled with USE_PDL and
        chosen by `pdl_launch` (a launcher that does not spread a dependent's programs)."""
        return self.pdl_for(spread=False)

    def pdl_for(self, spread: bool) -> bool:
        """`launch_pdl` for a launcher that spreads a dependent shrink's programs (spread=True) or not."""
        return bool(self.constexprs.get("USE_PDL")) and pdl_launch(self.KERNEL, self.num_tokens, spread)

    def spreads(self) -> bool:
        """Whether a spreading launcher gives this launch `spread_shared_bytes`: a shrink of
        first_kernel_pdl_max_tokens < T <= spread_pdl_max_tokens tokens (the launch policy's)
        launched as a programmatic dependent (a one-token shrink's few programs do not pile up on
        a few SMs: spreading them only lowers their occupancy)."""
        policy = launch_policy()
        return (self.KERNEL == "shrink"
                and policy.first_kernel_pdl_max_tokens < self.num_tokens <= policy.spread_pdl_max_tokens
                and self.pdl_for(spread=True))
