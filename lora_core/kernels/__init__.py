"""The multi-LoRA Triton kernels, shared by `torch_lora` and `jax_lora` (imports Triton, no framework).

Math (contract section 4), idx[t] = slot of token t (or -1), every product accumulated in float32:

  shrink:  buf[s, t, :] = scale * x[t] @ A_s[idx[t]].T                     (0 where idx[t] = -1)
  expand:  y[t, off_s:off_s+n_s] = (y[t, ...] if add_inputs else 0) + buf[s, t] @ B_s[idx[t]].T
                                   + bias_s[idx[t]]        (rows with idx[t] = -1 untouched)
  fused:   expand(shrink(x)) in one launch, the rank-sized intermediate in a float32 workspace.

Modules: `shrink`, `expand`, `fused` (each kernel with its launch plan), `common` (their device
helpers), `planning` (what the plans share), `arguments` (the one kernel-argument builder every
launcher uses), `launch` (Triton's own launcher and the interpreter on NumPy memory), `configs`
(launch configurations, tuned per device in `tuned/<device>.json`), `cuda_launch` (the C launcher:
torch's direct launches and JAX's XLA FFI handler).

Work decomposition. Tokens are grouped by adapter through the kernel metadata (contract section 3):
group g holds the tokens sorted[start[g] : start[g] + count[g]] of slot active[g]. A group is cut
into tiles of BLOCK_M tokens, and the grid's "tile" axis enumerates the tiles of all groups one
after another: program p finds its group by a prefix sum over the (max_loras + 1) per-group tile
counts, done in registers at the start of every program (`common.group_tile`). The number of tiles
is at most cdiv(T, BLOCK_M) + number of groups, so a grid of that size covers every mapping, and
the grid depends only on (T, max_loras), never on the mapping (CUDA-graph capturable, one jit
program). Programs past the last tile return at once. Each active adapter's weights are read by
the programs of its own tiles only: inactive slots are never read, and with one tile per group
(decode) each weight byte is read once per step.

Weights: A_s is (L, r, H), B_s (L, n_s, r), any strides. Several slices go in one launch: the
slice is a grid coordinate and its pointers/strides are picked with a select (up to MAX_SLICES
per launch). Heterogeneous ranks: with `ranks` given, slot l uses only its first ranks[l] rank
rows/columns (masked loads, so the padding is neither read nor used), equal to the zero-padded
computation.

Small batches (T <= the launch policy's small_t_max, decode): the whole batch is one tile per group; program g takes
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

Deterministic launches (`configs.deterministic_config`, `deterministic=True` on the plans): the
same meta-parameters for every token count -- block shapes, warps, a fixed SPLIT_K whose planes
the expand adds in plane order, SMALL_T off -- no atomic adds (the stand-alone shrink runs
unsplit) and never the fused kernel, so a token's result does not depend on its batch.

Interpreter: under TRITON_INTERPRET=1 tiles are upcast to float32 right after loading
(CAST_FP32): the interpreter computes bf16 arithmetic wrongly. Compiled kernels never do.
"""

from .arguments import KernelCall, expand_call, fused_call, shrink_call
from .common import HAVE_PDL
from .expand import ExpandPlan, lora_expand_kernel, plan_expand
from .fused import BARRIER_POLL_LIMIT, BARRIER_SPAN, FusedPlan, lora_fused_kernel, plan_fused
from .planning import MAX_SLICES, interpreting, max_tiles, next_pow2, small_t_block
from .shrink import ShrinkPlan, lora_shrink_kernel, plan_shrink

__all__ = [
    "KernelCall", "shrink_call", "expand_call", "fused_call", "HAVE_PDL",
    "lora_shrink_kernel", "lora_expand_kernel", "lora_fused_kernel",
    "ShrinkPlan", "ExpandPlan", "FusedPlan", "plan_shrink", "plan_expand", "plan_fused",
    "BARRIER_SPAN", "BARRIER_POLL_LIMIT", "MAX_SLICES", "interpreting", "max_tiles", "next_pow2", "small_t_block",
]
