"""Reference backend "xla": the ops in plain jnp, written for clarity (the oracle's twin).

Math (contract section 4), with idx[t] the slot of token t or -1 and every product in float32:

  shrink:  buf[s, t, :] = scale * x[t] @ A_s[idx[t]].T            (0 where idx[t] = -1)
  expand:  y[t, off_s : off_s + n_s] = (y[t, ...] if add_inputs else 0) + buf[s, t] @ B_s[idx[t]].T
           (rows with idx[t] = -1 untouched), off_s = offset_start + n_0 + ... + n_{s-1}

Invariant: a slot's weights reach only the tokens of that slot. A slot is *selected* (a gather, or
`where` on the token's slot), never multiplied by a one-hot 0: 0 * NaN = NaN, so a NaN or Inf in
any slot -- one no token uses, an empty one, the rank padding -- would otherwise turn every LoRA row
of the batch NaN. For the same reason rank padding and no-LoRA rows are masked with `where`.

  shrink: one matmul of x against every slot's A, (T, L, r), then each token takes its own slot's
          row (a gather): nothing of shape (T, r, H) is materialised.
  expand: every slot's buf @ B_l.T, (T, L, n), then a gather of the token's own slot (small
          sizes), or a scan over the slots keeping slot l's product (`where`) only on slot l's
          tokens (memory (T, n) whatever L; about the cost of one matmul over all slots).
fp8 weights (e4m3): a slice's weights are upcast to float32 in the product, and its per-channel
float32 scale multiplies the float32 sum once per output channel (shrink: a_scale_s[idx[t], c] on
rank column c; expand: b_scale_s[idx[t], n] on output column n, before the bias):

  shrink:  buf[s, t, c] = scale * a_scale_s[idx[t], c] * sum_k x[t, k] * float32(A_s[idx[t], c, k])
  expand:  y[t, off_s + n] (+)= b_scale_s[idx[t], n] * sum_c buf[s, t, c] * float32(B_s[idx[t], n, c])

Several adapters per token (`pairs`, lora_core.adapter_pairs): the metadata's ids are groups;
pair j of token t is slot pairs.slots[group[t], j] with weight pairs.weights[t, j]. The shrink
writes pair j's weighted product at the rank columns j*r .. (j+1)*r of the buffer, and the expand
adds every pair's product to y once.

Both read all slots' weights and compute every slot for every token (static shapes, no host sync,
jit- and vmap-friendly), so this is the fallback, not the fast path.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp

from ..meta import LoRAKernelMeta
from .xla_moe import fused_moe_lora  # noqa: F401 - the backend's fused MoE LoRA (jax_lora.ops.fused_moe)

NAME = "xla"
COLUMN_SCALE = True        # expand takes col_scale (DoRA)
WEIGHT_SCALES = True       # shrink / expand take a_scales / b_scales (fp8 weights)
HIGHEST = jax.lax.Precision.HIGHEST
EXPAND_GATHER_MAX = 1 << 20
"""Expand computes all slots at once while T * L * n_s <= this many float32 values (4 MiB), and
scans over the slots above it (see `_expand_slots`)."""


def _slots(idx: jax.Array, num_slots: int) -> tuple[jax.Array, jax.Array]:
    """(valid (T,) bool, slot (T,) int32): valid is false for -1 and anything outside 0..L-1, whose
    slot is 0 (a safe index; their results are masked out with `valid`)."""
    valid = (idx >= 0) & (idx < num_slots)
    return valid, jnp.where(valid, idx, 0)


def _rank_keep(lora_ranks: jax.Array, num_slots: int, rank: int) -> jax.Array:
    """(L, r) bool: True for the first lora_ranks[l] rank columns of slot l (the rest is padding)."""
    return jnp.arange(rank)[None, :] < jnp.asarray(lora_ranks)[:num_slots, None]


def _shrink_rows(xf: jax.Array, a: jax.Array, slot: jax.Array) -> jax.Array:
    """(T, r) float32: xf[t] @ a[slot[t]].T -- one matmul against every slot, (T, L, r), then each
    token's own slot (a gather)."""
    every = jnp.einsum("th,lrh->tlr", xf, a.astype(jnp.float32), precision=HIGHEST)
    return jnp.take_along_axis(every, slot[:, None, None], axis=1)[:, 0]


def pair_columns(idx: jax.Array, pairs) -> list[tuple[jax.Array, jax.Array]]:
    """[(slot (T,), weight (T,) float32) per pair]: each token's pair j, from its group id idx (-1:
    no adapter, every pair's slot -1) and the pair tables."""
    t = idx.shape[0]
    slots, weights = jnp.asarray(pairs.slots), jnp.asarray(pairs.weights)
    has = (idx >= 0) & (idx < slots.shape[0])
    g = jnp.where(has, idx, 0)
    return [(jnp.where(has, slots[g, j], -1), weights[:t, j].astype(jnp.float32)) for j in range(slots.shape[1])]


def _scale_of(scales, s: int):
    """Slice s's per-channel weight scale (L, c), or None (no scales, or a 16-bit slice)."""
    return None if scales is None else scales[s]


def shrink(x: jax.Array, lora_a: Sequence[jax.Array], meta: LoRAKernelMeta, scale: float,
           lora_ranks=None, *, rows=_shrink_rows, pairs=None, a_scales=None) -> jax.Array:
    """x (T, H); lora_a[s] (L, r, H) -> (S, T, r) float32 ((S, T, k * r) with k adapter pairs, pair j
    at columns j*r..). rows(xf, a, slot) -> (T, r): how each token's own product is computed
    (jax_lora.ops.invariant passes its batch-invariant form). a_scales: None or S entries of None /
    (L, r) float32, the per-rank-row scales of fp8 slices (applied to each token's own row)."""
    t = x.shape[0]
    idx = meta.token_lora_mapping[:t]
    xf = x.astype(jnp.float32)
    columns = [(idx, None)] if pairs is None else pair_columns(idx, pairs)
    outs = []
    for s, a in enumerate(lora_a):
        num_slots, rank, _ = a.shape
        a_scale = _scale_of(a_scales, s)
        parts = []
        for idx_j, weight in columns:
            valid, slot = _slots(idx_j, num_slots)
            own = rows(xf, a, slot)                                                       # (T, r)
            if a_scale is not None:
                own = own * a_scale[slot].astype(jnp.float32)                             # per rank row
            keep = valid[:, None]
            if lora_ranks is not None:
                keep = keep & _rank_keep(lora_ranks, num_slots, rank)[slot]
            own = scale * own if weight is None else (scale * weight)[:, None] * own
            parts.append(jnp.where(keep, own, 0.0))
        outs.append(jnp.concatenate(parts, axis=1))
    return jnp.stack(outs)


def _expand_slots(x: jax.Array, slot: jax.Array, b: jax.Array, keep=None) -> jax.Array:
    """(T, n) float32: x[t] @ b[slot[t]].T. x (T, r) float32; b (L, n, r); keep: None or (L, r)
    bool, the rank columns of each slot to use (the padding is masked with `where`).

    Two formulations of the same selection, chosen from the shapes alone (static under jit):
    small (decode) sizes compute every slot for every token, (T, L, n), and gather each token's
    own slot -- one matmul, cheap to compile; larger ones scan over the slots and keep slot l's
    product only on slot l's tokens, so memory stays (T, n) whatever L.
    """
    num_slots, width, _ = b.shape
    if x.shape[0] * num_slots * width <= EXPAND_GATHER_MAX:
        bf = b.astype(jnp.float32)
        if keep is not None:
            bf = jnp.where(keep[:, None, :], bf, 0.0)
        every = jnp.einsum("tr,lnr->tln", x, bf, precision=HIGHEST)                 # (T, L, n)
        return jnp.take_along_axis(every, slot[:, None, None], axis=1)[:, 0]

    def one_slot(acc, item):
        l, b_l, *keep_l = item
        b_l = b_l.astype(jnp.float32)
        if keep_l:
            b_l = jnp.where(keep_l[0][None, :], b_l, 0.0)
        part = jnp.dot(x, b_l.T, precision=HIGHEST)
        return jnp.where((slot == l)[:, None], part, acc), None

    init = jnp.zeros((x.shape[0], width), jnp.float32)
    per_slot = (jnp.arange(num_slots, dtype=slot.dtype), b) + (() if keep is None else (keep,))
    out, _ = jax.lax.scan(one_slot, init, per_slot)
    return out


def expand(buf: jax.Array, lora_b: Sequence[jax.Array], y: jax.Array, meta: LoRAKernelMeta,
           offsets: Sequence[int], add_inputs: bool, lora_ranks=None, bias=None, *,
           rows=None, col_scale=None, pairs=None, b_scales=None) -> jax.Array:
    """buf (S, T, r); lora_b[s] (L, n_s, r); y (T, N) -> y with the slices written.
    pairs: several adapters per token (module docstring; buf (S, T, k * r); no bias or col_scale).

    bias: None or S entries, each None or (L, n_s): bias[s][idx[t]] is added to the slice too.
    With lora_ranks, B's columns past a slot's rank and buf's values past a token's rank are ignored.
    rows(x, slot, b, keep) -> (T, n): each token's own product (default `_expand_slots`;
    jax_lora.ops.invariant passes its batch-invariant form). col_scale: None or S entries, each None
    or (L, n_s): the new slice values of a token are multiplied by col_scale[s][idx[t]] (DoRA's
    column scale, lora_core.dora), after the bias. b_scales: None or S entries of None / (L, n_s)
    float32, the per-output-row scales of fp8 slices: the product of a token is multiplied by
    b_scales[s][idx[t]] before the bias.
    """
    rows = rows or _expand_slots
    t = y.shape[0]
    idx = meta.token_lora_mapping[:t]
    if pairs is not None:
        return _expand_pairs(buf, lora_b, y, pair_columns(idx, pairs), offsets, add_inputs, lora_ranks, bias,
                             col_scale, rows, b_scales)
    for s, (b, off) in enumerate(zip(lora_b, offsets)):
        num_slots, width, rank = b.shape
        valid, slot = _slots(idx, num_slots)
        x = buf[s].astype(jnp.float32)
        keep = None
        if lora_ranks is not None:
            keep = _rank_keep(lora_ranks, num_slots, rank)                   # (L, r)
            x = jnp.where(keep[slot], x, 0.0)                                # past the token's rank
        delta = rows(x, slot, b, keep)
        if _scale_of(b_scales, s) is not None:
            delta = delta * b_scales[s][slot].astype(jnp.float32)                # per output column
        if bias is not None and bias[s] is not None:
            delta = delta + bias[s][slot].astype(jnp.float32)                 # (T, n): own slot only
        old = y[:, off:off + width]
        new = (old.astype(jnp.float32) + delta) if add_inputs else delta
        if col_scale is not None and col_scale[s] is not None:
            new = new * col_scale[s][slot].astype(jnp.float32)                # DoRA: g[slot] per column
        y = set_columns(y, jnp.where(valid[:, None], new.astype(y.dtype), old), off)
    return y


def set_columns(y: jax.Array, block: jax.Array, start: int) -> jax.Array:
    """y (T, N) with its columns [start, start + n) replaced by block (T, n); start is static.

    An update slice, whose offsets are scalars, rather than `y.at[:, start:start + n].set(block)`: that
    scatter carries an index array, empty when the block spans y's whole width, and an op called
    inside `jax.shard_map` hands its array constants to the manual computation as operands. XLA's
    Shardy partitioner does not take a zero-sized operand of a manual computation (jaxlib 0.11 crashes
    canonicalizing it), so the ops write column blocks without index arrays.
    """
    return jax.lax.dynamic_update_slice_in_dim(y, block, start, axis=1)


def _expand_pairs(buf, lora_b, y, columns, offsets, add_inputs, lora_ranks, bias, col_scale, rows,
                  b_scales=None) -> jax.Array:
    """`expand` with adapter pairs: y[t, slice s] (+)= sum_j buf[s, t, j*r:(j+1)*r] @ B_s[slot_j].T over
    the token's pairs; rows without any pair are untouched."""
    if bias is not None and any(b is not None for b in bias) or col_scale is not None and any(
            g is not None for g in col_scale):
        raise ValueError("several adapters per token take no LoRA bias or DoRA column scale (lora_bias_stacked / "
                         "dora_scale_stacked must be None)")
    for s, (b, off) in enumerate(zip(lora_b, offsets)):
        num_slots, width, rank = b.shape
        keep = None if lora_ranks is None else _rank_keep(lora_ranks, num_slots, rank)     # (L, r)
        delta = jnp.zeros((y.shape[0], width), jnp.float32)
        any_pair = jnp.zeros(y.shape[0], bool)
        for j, (idx_j, _) in enumerate(columns):
            valid, slot = _slots(idx_j, num_slots)
            x = buf[s][:, j * rank:(j + 1) * rank].astype(jnp.float32)
            if keep is not None:
                x = jnp.where(keep[slot], x, 0.0)
            own = rows(x, slot, b, keep)
            if _scale_of(b_scales, s) is not None:
                own = own * b_scales[s][slot].astype(jnp.float32)
            delta = delta + jnp.where(valid[:, None], own, 0.0)
            any_pair = any_pair | valid
        old = y[:, off:off + width]
        new = (old.astype(jnp.float32) + delta) if add_inputs else delta
        y = set_columns(y, jnp.where(any_pair[:, None], new.astype(y.dtype), old), off)
    return y
