"""LoRA on the experts of a mixture-of-experts layer: vLLM's `fused_moe_lora` and
`moe_lora_align_block_size`, functional (a new y is returned) and jittable.

Math, for each routed pair p = t * top_k + k of token t (expert e = topk_ids[t, k], slot
l = token_lora_mapping[t], l >= 0 and adapter_enabled[l] != 0), every product in float32:

  y[t, k, offset + o_s : offset + o_s + n_s] += w_p * (x_p @ A_s[l, e].T) @ B_s[l, e].T

with o_s = n_0 + ... + n_{s-1} (slices s: gate and up of w13, or the one slice of w2). With
mul_routed_weight (w2, contract section 9): w_p = topk_weights[t, k], the router weight where the
model applies it (after the down projection in Mixtral), and x_p = x[p] (one row per pair: the
activated gate_up output); without (w13): w_p = 1 and x_p = x[t] (the hidden states). With
lora_ranks, rank columns c >= lora_ranks[l] count as zero. Pairs of tokens without an adapter, of
slots whose adapter_enabled is 0 and of experts routed to -1 (expert_map) are untouched and cost
nothing.

Layout (vLLM 0.33's, built by `moe_lora_align_block_size`; flat, L rows of EM): per slot l, the
pairs of slot l's tokens grouped by expert (ascending expert, pairs ascending inside a group), each
group padded to a multiple of block_size with the sentinel P = num_tokens * top_k:
  sorted_token_ids (L * EM,)      pair ids, EM = round_up(P + E * (block_size - 1), block_size)
  expert_ids (L * EM / block_size,) the expert of each block, -1 past the slot's last block
  num_tokens_post_padded (L,)     the slot's padded length
Every shape depends on (P, E, L, block_size) only: one compiled program for every routing.
`sorted_token_ids=None` is vLLM's naive assignment: expert_ids is then topk_ids flattened (P,), and
the layout is built here with block size 16.

fp8 (e4m3) expert weights (contract section 11): A_s and / or B_s in float8_e4m3fn with float32
channel scales `lora_a_scale` (one per slice, (L, E, r)) / `lora_b_scale` ((L, E, n_s)), or (L,)
per slot (broadcast here to every expert and channel); each scale multiplies the float32 product
once, before the router weight:

  y[t, k, cols of s] += w_p * b_scale_s[l, e] * ((a_scale_s[l, e] * (x_p @ A_s[l, e].T)) @ B_s[l, e].T)

The rules are `lora_core.checks.check_expert_scales` (torch_lora.ops.fused_moe_lora's). A backend
takes them as keywords `lora_a_scale` / `lora_b_scale` ((L, E, rows) float32 per slice, None for a
16-bit side); one whose `fused_moe_lora` has no such parameter runs the xla backend's, said once
on the `jax_lora` logger.

Backends: a backend's MoE module defines `fused_moe_lora(y3, x, lora_a, lora_b, pair_weight,
layout, offsets, lora_ranks) -> y3` (x: one row per token or per pair; a module with NAIVE_ORDER
True receives a `moe_layout.NaiveOrder` as layout when sorted_token_ids is None, the others a
layout built here; "xla": jax_lora.ops.xla_moe;
"pallas_tpu": jax_lora.ops.pallas_tpu.moe_op; "triton": jax_lora.ops.triton_moe, the shared Triton
kernel). A backend without one runs the xla one, said once on the `jax_lora` logger.

deterministic=True: the backend's batch-invariant form (dispatch.deterministic_impl: Triton's
deterministic plan, else jax_lora.ops.invariant's elementwise sums): a pair's values are bitwise
the same whatever the other pairs of the batch and its position.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from lora_core import checks

from . import dispatch
from .moe_layout import MoELayout, align_layout, naive_order

__all__ = ["fused_moe_lora", "moe_lora_align_block_size"]

_LOG = logging.getLogger("jax_lora")
_FALLBACK_SAID: set = set()
NAIVE_BLOCK_SIZE = 16


def moe_lora_align_block_size(topk_ids, token_lora_mapping, num_experts: int, block_size: int, max_loras: int,
                              adapter_enabled=None, expert_map=None, pad_sorted_ids: bool = False) -> tuple:
    """(sorted_token_ids (L * EM,), expert_ids (L * EM / block_size,), num_tokens_post_padded (L,)),
    int32: the block-sorted layout of the pairs (module docstring), on the device, jittable. EM is
    a multiple of block_size whatever pad_sorted_ids (the kernels take whole blocks).

    topk_ids (M, k) int: each token's experts; token_lora_mapping (M,) int: slot per token (-1 none,
    out-of-range values none); adapter_enabled (L,) int or None (all enabled): a slot with 0 gets no
    pairs; expert_map (E_global,) int or None: global expert -> local expert (-1: not here).

    Steps: 1. each pair's (slot, expert), invalid ones keyed past every group; 2. counts per
    (slot, expert) by a scatter-add, padded to block_size, their running sums the group starts;
    3. a stable sort of the pairs by key gives each its rank in its group, hence its position;
    4. scatter the pair ids, and the expert of every block from the group ends.
    """
    layout = align_layout(topk_ids, token_lora_mapping, num_experts, block_size, max_loras, adapter_enabled,
                          expert_map)
    return tuple(a.reshape(-1) for a in layout[:2]) + (layout[2],)


def backend_module(backend: str | None, deterministic: bool = False):
    """The module whose `fused_moe_lora` runs for `backend` (None: the device's default): the
    backend's MoE module (unpartitioned: no MoE layer is split over a mesh; "triton":
    jax_lora.ops.triton_moe), its batch-invariant form with deterministic=True, or "xla"'s for a
    backend without a MoE kernel, said once on the `jax_lora` logger."""
    module = dispatch.load_backend(backend if backend is not None else dispatch.default_backend_name(log=True))
    if module.NAME == "triton":
        from . import triton_moe
        module = triton_moe
    if dispatch.check_deterministic(deterministic):
        module = dispatch.deterministic_impl(module)
    if hasattr(module, "fused_moe_lora"):
        return module
    xla = dispatch.load_backend("xla")
    if module.NAME not in _FALLBACK_SAID:
        _FALLBACK_SAID.add(module.NAME)
        _LOG.info("jax_lora: backend %r has no fused MoE LoRA kernel; fused_moe_lora runs the xla backend's",
                  module.NAME)
    return dispatch.deterministic_impl(xla) if deterministic else xla


def takes_expert_scales(module) -> bool:
    """Whether a backend's MoE module applies fp8 expert weight scales (a `lora_a_scale` parameter
    of its fused_moe_lora)."""
    try:
        return "lora_a_scale" in inspect.signature(module.fused_moe_lora).parameters
    except (TypeError, ValueError):
        return False


def scaled_backend_module(module, deterministic: bool):
    """`module` when it applies fp8 expert scales, else the xla backend's (its batch-invariant form
    when deterministic), said once per backend on the `jax_lora` logger."""
    if takes_expert_scales(module):
        return module
    if module.NAME not in _SCALE_FALLBACK_SAID:
        _SCALE_FALLBACK_SAID.add(module.NAME)
        _LOG.warning("jax_lora: backend %r's fused MoE LoRA does not apply fp8 expert weight scales; fp8 expert "
                     "weights run on the xla backend's", module.NAME)
    xla = dispatch.load_backend("xla")
    return dispatch.deterministic_impl(xla) if deterministic else xla


_SCALE_FALLBACK_SAID: set = set()


def expert_scales(name: str, scales, weights: Sequence, arg_w: str) -> tuple | None:
    """The fp8 scales of the expert weights checked (`checks.check_expert_scales`) and made float32
    (L, E, rows) per slice (a per-slot (L,) scale broadcast to every expert and channel; None for a
    16-bit slice); None when no slice is fp8."""
    if scales is not None and not isinstance(scales, (list, tuple)):
        scales = (scales,)
    if scales is None and not any(checks.is_fp8(w.dtype) for w in weights):
        return None
    entries = None if scales is None else [None if sc is None else sc if hasattr(sc, "shape") and
                                           hasattr(sc, "dtype") else np.asarray(sc) for sc in scales]
    kinds = checks.check_expert_scales(name, None if entries is None else
                                       [None if sc is None else (tuple(sc.shape), sc.dtype) for sc in entries],
                                       [tuple(w.shape) for w in weights], [w.dtype for w in weights], arg_w)
    if all(k is None for k in kinds):
        return None
    out = []
    for w, sc, kind in zip(weights, entries, kinds):
        sc = jnp.asarray(sc)
        out.append(jnp.broadcast_to(sc[:, None, None], tuple(int(d) for d in w.shape[:3])) if kind == "tensor"
                   else sc)
    return tuple(out)


def fused_moe_lora(y, x, lora_a_stacked: Sequence, lora_b_stacked: Sequence, topk_weights, sorted_token_ids,
                   expert_ids, num_tokens_post_padded, token_lora_mapping, max_lora_rank: int, top_k_num: int,
                   adapter_enabled=None, mul_routed_weight: bool = False, offset: int = 0, *, block_size=None,
                   backend: str | None = None, lora_ranks=None, deterministic: bool = False, lora_a_scale=None,
                   lora_b_scale=None) -> jax.Array:
    """The new y with every routed pair's LoRA term added (module docstring).

    y (M, top_k, N) or (M * top_k, N); x (M, K) (mul_routed_weight False: one row per token) or
    (M * top_k, K) (mul_routed_weight True: one row per pair); lora_a_stacked: S arrays
    (L, E, r, K); lora_b_stacked: S arrays (L, E, n_s, r) with offset + sum n_s <= N;
    topk_weights (M, top_k); the layout from `moe_lora_align_block_size` (flat or one row per slot;
    block_size, when given, must be its block size) or sorted_token_ids None and expert_ids the
    (M * top_k,) experts; token_lora_mapping (M,) slots (-1 none); lora_ranks (L,), optional;
    deterministic: batch-invariant (module docstring). lora_a_scale / lora_b_scale: for fp8 A / B,
    one float32 scale per slice, (L, E, r) / (L, E, n_s) per channel or (L,) per slot (module
    docstring); None for 16-bit weights.
    """
    lora_a = tuple(lora_a_stacked) if isinstance(lora_a_stacked, (list, tuple)) else (lora_a_stacked,)
    lora_b = tuple(lora_b_stacked) if isinstance(lora_b_stacked, (list, tuple)) else (lora_b_stacked,)
    if not lora_a or len(lora_a) != len(lora_b):
        raise ValueError(f"lora_a_stacked and lora_b_stacked must have one entry per slice, got {len(lora_a)} "
                         f"and {len(lora_b)}")
    weights = jnp.asarray(topk_weights)
    if weights.ndim != 2:
        raise ValueError(f"topk_weights must be (num_tokens, top_k), got shape {weights.shape}")
    m, k = weights.shape
    if int(top_k_num) != k:
        raise ValueError(f"top_k_num={top_k_num} but topk_weights has {k} columns")
    p = m * k
    y = jnp.asarray(y)
    if y.dtype.name not in checks.ACTIVATION_DTYPES or x.dtype.name not in checks.ACTIVATION_DTYPES:
        raise TypeError(f"y and x must be one of {checks.ACTIVATION_DTYPES}, got {y.dtype} and {x.dtype}")
    if y.ndim == 2 and y.shape[0] == p:
        y3 = y.reshape(m, k, y.shape[1])
    elif y.ndim == 3 and y.shape[:2] == (m, k):
        y3 = y
    else:
        raise ValueError(f"y must be (num_tokens, top_k, N) = ({m}, {k}, N) or ({p}, N), got shape {y.shape}")
    want_rows = p if mul_routed_weight else m
    if x.ndim != 2 or x.shape[0] != want_rows:
        what = "one row per pair (mul_routed_weight=True)" if mul_routed_weight else "one row per token"
        raise ValueError(f"x must be ({want_rows}, K), {what}, got shape {x.shape}")
    num_slots, num_experts, rank, hidden = _check_weights(lora_a, lora_b, x.shape[1])
    fp8 = {key: checked for key, checked in (
        ("lora_a_scale", expert_scales("lora_a_scale", lora_a_scale, lora_a, "lora_a_stacked")),
        ("lora_b_scale", expert_scales("lora_b_scale", lora_b_scale, lora_b, "lora_b_stacked")))
        if checked is not None}
    if int(max_lora_rank) < rank:
        raise ValueError(f"max_lora_rank={max_lora_rank} is smaller than lora_a_stacked's rank {rank}")
    widths = tuple(int(b.shape[2]) for b in lora_b)
    offset = int(offset)
    if offset < 0 or offset + sum(widths) > y3.shape[2]:
        raise ValueError(f"offset {offset} + slice widths {widths} exceed y's {y3.shape[2]} columns")
    offsets = tuple(offset + sum(widths[:s]) for s in range(len(widths)))
    mapping = jnp.asarray(token_lora_mapping).astype(jnp.int32)
    if mapping.ndim != 1 or mapping.shape[0] < m:
        raise ValueError(f"token_lora_mapping must be (>= {m},) slots, got shape {mapping.shape}")
    module = backend_module(backend, deterministic)
    if fp8:
        module = scaled_backend_module(module, deterministic)
    if sorted_token_ids is None:
        topk_ids = jnp.asarray(expert_ids).astype(jnp.int32)
        if topk_ids.size != p:
            raise ValueError(f"with sorted_token_ids=None, expert_ids must hold the {p} routed experts, got shape "
                             f"{topk_ids.shape}")
        if getattr(module, "NAIVE_ORDER", False):
            layout = naive_order(topk_ids.reshape(m, k), mapping, num_experts, num_slots, adapter_enabled)
        else:
            layout = align_layout(topk_ids.reshape(m, k), mapping, num_experts, NAIVE_BLOCK_SIZE, num_slots,
                                  adapter_enabled)
    else:
        layout = MoELayout(jnp.asarray(sorted_token_ids).astype(jnp.int32).reshape(num_slots, -1),
                           jnp.asarray(expert_ids).astype(jnp.int32).reshape(num_slots, -1),
                           jnp.asarray(num_tokens_post_padded).astype(jnp.int32).reshape(num_slots))
        em, nb = layout.sorted_token_ids.shape[1], layout.expert_ids.shape[1]
        if em % nb or (block_size is not None and em != nb * int(block_size)):
            raise ValueError(f"sorted_token_ids ({em} per slot) and expert_ids ({nb} per slot) must hold one expert "
                             f"per block of block_size={block_size if block_size is not None else 'EM / blocks'} pairs")
        if adapter_enabled is not None:          # a disabled slot's pairs cost nothing
            enabled = jnp.asarray(adapter_enabled).astype(jnp.int32)[:num_slots] != 0
            layout = layout._replace(num_tokens_post_padded=jnp.where(enabled, layout.num_tokens_post_padded, 0))
    pair_weight = weights.reshape(p).astype(jnp.float32) if mul_routed_weight else None
    ranks = None if lora_ranks is None else jnp.asarray(lora_ranks).astype(jnp.int32)
    out = module.fused_moe_lora(y3, x, lora_a, lora_b, pair_weight, layout, offsets, ranks, **fp8)
    return out.reshape(y.shape)


def _check_weights(lora_a, lora_b, hidden: int) -> tuple[int, int, int, int]:
    shapes_a = {tuple(a.shape) for a in lora_a}
    if len(shapes_a) != 1 or len(next(iter(shapes_a))) != 4:
        raise ValueError(f"lora_a_stacked must be arrays of one shape (L, E, r, K), got {sorted(shapes_a)}")
    num_slots, num_experts, rank, k_dim = next(iter(shapes_a))
    if k_dim != hidden:
        raise ValueError(f"lora_a_stacked's K = {k_dim} but x has {hidden} columns")
    for s, b in enumerate(lora_b):
        if b.ndim != 4 or b.shape[0] != num_slots or b.shape[1] != num_experts or b.shape[3] != rank:
            raise ValueError(f"lora_b_stacked[{s}] must be (L, E, n, r) = ({num_slots}, {num_experts}, n, {rank}), "
                             f"got shape {tuple(b.shape)}")
    for w in lora_a + lora_b:
        if checks.dtype_name(w.dtype) not in checks.WEIGHT_DTYPES:
            raise TypeError(f"LoRA weights must be one of {checks.WEIGHT_DTYPES} (fp8 with lora_a_scale / "
                            f"lora_b_scale), got {w.dtype}")
    return num_slots, num_experts, rank, k_dim
