"""The "triton" backend's `fused_moe_lora` for JAX: `lora_core.kernels.moe_lora` under `jax.jit`.

Math: jax_lora.ops.fused_moe (contract section 9). The torch side's twin is
torch_lora.ops.moe_triton; both take the kernel's parameter lists from `moe_lora_calls`. Steps:

1. The plan (`plan_moe_lora`): the layout's sorted blocks (its block size is BLOCK_M; a block size
   that is not a power of two >= 16, tl.dot's smallest tile, takes the naive order below), tile sizes,
   SHARED_A when both slices' A are one array (PEFT's fused gate_up_proj), HAS_RANKS with
   lora_ranks. The layout already leaves out the pairs of disabled slots, so every slot counts as
   enabled here.
2. The kernel's two written buffers are placeholders among its parameters (jax_lora.ops.triton,
   "What a launch writes"): y (P, N) is result 0 updated in place (aliased to the operand, so XLA
   updates it without a copy); the float32 rank buffer (slices * K_SPLIT planes, P, r) is result 1,
   never zeroed: each live pair's rows are written by the shrink launch before the expand launch
   reads them.
3. The shrink launch, then the expand launch, through jax_lora.ops.triton's runners: one XLA FFI
   call with both launches on the GPU (command-buffer compatible; on sm_90 and newer the expand a
   programmatic dependent of the shrink, `triton._pdl`), Triton's interpreter inside
   `jax.pure_callback` on the CPU (TRITON_INTERPRET=1).

fp8 (e4m3) expert weights: `lora_a_scale` / `lora_b_scale` ((L, E, rows) float32 per slice) are
the kernel's scale pointers (`moe_lora_calls`); the tiles enter tl.dot in the activations' dtype
(`planning.dot_dtype`) and the float32 products are scaled once per channel.

The naive order (NAIVE_ORDER: without sorted ids the op hands this module a `NaiveOrder`, each
pair's expert and each token's slot, instead of building a layout) takes one pair per program, as
vLLM's decode path does.

deterministic=True (`deterministic_backend()`): the pairs in the naive order, one per program
(from a layout, each pair's expert and its token's slot are read back, `pairs_of_layout`), with the
batch-invariant plan (`plan_moe_lora(deterministic=True)`): a pair's values are bitwise the same
whatever the other pairs and its position.

Where the FFI handler cannot run (no C compiler, a non-CUDA GPU, JAX_LORA_TRITON_LAUNCHER=
jax_triton), the op runs the xla backend's (its invariant form when deterministic), said once on
the `jax_lora` logger: jax_triton hands a kernel its outputs after all inputs, and this kernel
writes two buffers in the middle of its parameter list.
"""

from __future__ import annotations

import functools
import logging
import types

import jax
import jax.numpy as jnp

from lora_core.kernels.moe_lora import moe_lora_calls, plan_moe_lora
from lora_core.kernels.planning import dot_dtype, interpreting

from . import invariant, triton, xla_moe
from .moe_layout import MoELayout, NaiveOrder, align_layout, pairs_of_layout

NAME = "triton"
NAIVE_ORDER = True          # takes a NaiveOrder when the caller gives no sorted ids
_LOG = logging.getLogger("jax_lora")


@functools.cache
def _log_fallback(reason: str) -> None:
    _LOG.info("backend 'triton': fused_moe_lora runs the xla backend's (the MoE kernel needs the FFI "
              "launcher: %s)", reason)


def _naive_order(layout, num_tokens: int, top_k: int) -> NaiveOrder:
    """The NaiveOrder of a layout's pairs, -1 where it holds none (a token's live pairs all carry
    its slot, so the largest of its pairs' slots is it); a NaiveOrder as it is."""
    if isinstance(layout, NaiveOrder):
        return layout
    pair_slot, pair_expert = pairs_of_layout(layout, num_tokens * top_k)
    experts = jnp.where(pair_slot >= 0, pair_expert, -1)
    return NaiveOrder(experts, pair_slot.reshape(num_tokens, top_k).max(axis=1))


def fused_moe_lora(y3, x, lora_a, lora_b, pair_weight, layout: MoELayout, offsets, lora_ranks, *,
                   deterministic: bool = False, lora_a_scale=None, lora_b_scale=None) -> jax.Array:
    """y3 (M, k, N); x (M, K) one row per token (pair_weight None) or (P, K) one per pair;
    lora_a / lora_b: S arrays (L, E, r, K) / (L, E, n_s, r); pair_weight (P,) float32 or None
    (the router weights, mul_routed_weight); layout: a MoELayout (one row per slot) or a
    NaiveOrder; offsets: S static column
    offsets, slice 1 right after slice 0; lora_ranks (L,) int32 or None; lora_a_scale /
    lora_b_scale: None or S float32 arrays (L, E, r) / (L, E, n_s) of fp8 weights -> the new y3."""
    m, k, n_total = y3.shape
    p = m * k
    if p == 0:
        return y3
    interpret = triton._use_interpreter(y3, x, *lora_a)
    if not interpret and not triton._use_ffi():
        from . import ffi_launcher
        _log_fallback(ffi_launcher.unavailable_reason())
        reference = invariant if deterministic else xla_moe
        if isinstance(layout, NaiveOrder):
            layout = align_layout(layout.experts.reshape(m, k), layout.token_slots, lora_a[0].shape[1], 16,
                                  lora_a[0].shape[0])
        return reference.fused_moe_lora(y3, x, lora_a, lora_b, pair_weight, layout, offsets, lora_ranks,
                                        lora_a_scale=lora_a_scale, lora_b_scale=lora_b_scale)
    launches, results = moe_launches(y3, x, lora_a, lora_b, pair_weight, layout, offsets, lora_ranks,
                                     deterministic=deterministic, lora_a_scale=lora_a_scale,
                                     lora_b_scale=lora_b_scale)
    out = triton._run(launches, results, interpret)[0]                                      # step 3
    return out.reshape(y3.shape)


def moe_launches(y3, x, lora_a, lora_b, pair_weight, layout: MoELayout, offsets, lora_ranks, *,
                 deterministic: bool = False, lora_a_scale=None, lora_b_scale=None) -> tuple[list, list]:
    """(the shrink and expand `_Launch`es, the call's results [y (P, N), the rank buffer]) of
    `fused_moe_lora`'s arguments (steps 1-2)."""
    m, k, n_total = y3.shape
    p = m * k
    lora_a, lora_b = tuple(lora_a), tuple(lora_b)
    num_slots, num_experts, rank, hidden = lora_a[0].shape
    block = 16 if isinstance(layout, NaiveOrder) else layout.block_size
    naive = deterministic or isinstance(layout, NaiveOrder) or block < 16 or block & (block - 1) != 0
    if naive:
        experts, token_slots = _naive_order(layout, m, k)
        sorted_ids = post_pad = experts                                  # never read in the naive order
    else:
        sorted_ids, experts, post_pad = layout
        token_slots = post_pad                                           # never read in the sorted order
    plan = plan_moe_lora(num_pairs=p, num_slots=num_slots, num_experts=num_experts, hidden=hidden,
                         widths=tuple(int(b.shape[2]) for b in lora_b), rank=rank, naive=naive,
                         sorted_len=0 if naive else sorted_ids.shape[1], block_m=16 if naive else block,
                         mul_routed_weight=pair_weight is not None,
                         shared_a=len(lora_a) == 2 and lora_a[0] is lora_a[1], has_ranks=lora_ranks is not None,
                         deterministic=deterministic,
                         dtypes=(jnp.dtype(x.dtype).name,
                                 *(dot_dtype(jnp.dtype(w.dtype).name, jnp.dtype(x.dtype).name)
                                   for w in (lora_a[0], lora_b[0]))),
                         pdl=not interpreting() and triton._pdl())
    y = triton._InPlace(0, y3.reshape(p, n_total))                                          # step 2
    buf = triton._Result(1, (len(lora_a) * plan.k_split, p, rank), jnp.float32)
    enabled = jnp.ones((num_slots,), jnp.int32)
    ranks = enabled if lora_ranks is None else lora_ranks.astype(jnp.int32)
    weights = x if pair_weight is None else pair_weight                 # never read without router weights
    calls = moe_lora_calls(plan, x, lora_a, lora_b, buf, y, weights, sorted_ids, experts, post_pad, token_slots,
                           enabled, ranks, num_pairs=p, top_k=k, offset=int(offsets[0]), strides=triton._strides,
                           lora_a_scale=lora_a_scale, lora_b_scale=lora_b_scale)
    results = [jax.ShapeDtypeStruct((p, n_total), y3.dtype), jax.ShapeDtypeStruct(buf.shape, jnp.float32)]
    return [triton._Launch(call, -1, call.plan.launch_pdl) for call in calls], results


def deterministic_backend():
    """This module with the batch-invariant plan bound (`deterministic=True`): what
    jax_lora.ops.dispatch.deterministic_impl hands out."""
    return _DETERMINISTIC


_DETERMINISTIC = types.SimpleNamespace(NAME=NAME, deterministic=True, NAIVE_ORDER=True,
                                       fused_moe_lora=functools.partial(fused_moe_lora, deterministic=True))
