"""The batch-invariant reference ops: what backends "xla" and "pallas_tpu" run with `deterministic=True`.

Math as the xla backend (SPEC section 4), idx[t] the slot of token t or -1, products in float32:

  shrink:  buf[s, t, :] = scale * x[t] @ A_s[idx[t]].T               (0 where idx[t] = -1)
  expand:  y[t, off_s : off_s + n_s] = (y[t, ...] if add_inputs else 0) + buf[s, t] @ B_s[idx[t]].T
           + bias_s[idx[t]]                                         (rows with idx -1 untouched)

Invariant: every value of token t is computed from token t's own inputs (its row of x or of the
buffer, its slot's weights) by one sequence of float32 operations that depends on the shapes of
the weights only -- not on the number of tokens, the token's position or the other tokens. So a
token's result is bitwise the same in every batch (every bucket size under jit) and in every run.
How:

  * the token's slot is selected with a gather (never a one-hot matmul: 0 * NaN = NaN);
  * products are elementwise, x[t, k] * A[idx[t], j, k];
  * the sum over k is `tree_sum`: a fixed pairwise tree of elementwise float32 adds.

No dot and no reduce: XLA blocks a dot's (or a reduction's) inner dimension, and so orders its
additions, by the whole operand shape -- on the CPU a row's sum changes between 3 and 4 rows --
which is why the xla backend without `deterministic` gives a token slightly different bits in
different batches. Elementwise code is the same for every element; XLA may fuse a product with the
first addition into one FMA, and then does so for every element alike.

The Pallas TPU kernels tile rows and the hidden size by the token count (plans.py) and choose the
row order per call, so with `deterministic=True` the pallas_tpu backend runs this formulation too.
The cost: every token's products are materialised, (T, r, H) for the shrink and (T, n, r) for the
expand, in chunks of CHUNK_VALUES float32 values.
"""

from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp

from ..meta import LoRAKernelMeta

NAME = "xla"
CHUNK_VALUES = 1 << 22
"""float32 products materialised at once (16 MiB): tokens are processed in static chunks of
max(1, CHUNK_VALUES // (values per token)); chunking never changes a token's result."""


def tree_sum(v: jax.Array) -> jax.Array:
    """Sum over the last axis as a fixed pairwise tree of elementwise adds: the axis is zero-padded
    to a power of two p, then halved, v[..., :p/2] + v[..., p/2:], until one element is left.
    The additions of each output element, and their order, depend on the axis length only."""
    n = v.shape[-1]
    p = 1 << max(0, n - 1).bit_length()
    if p != n:
        v = jnp.pad(v, [(0, 0)] * (v.ndim - 1) + [(0, p - n)])
    while v.shape[-1] > 1:
        half = v.shape[-1] // 2
        v = v[..., :half] + v[..., half:]
    return v[..., 0]


def _slots(idx: jax.Array, num_slots: int) -> tuple[jax.Array, jax.Array]:
    """(valid (T,) bool, slot (T,) int32): valid is false for -1 and anything outside 0..L-1, whose
    slot is 0 (a safe index; their results are masked out with `valid`)."""
    valid = (idx >= 0) & (idx < num_slots)
    return valid, jnp.where(valid, idx, 0)


def _rank_keep(lora_ranks: jax.Array, num_slots: int, rank: int) -> jax.Array:
    """(L, r) bool: True for the first lora_ranks[l] rank columns of slot l (the rest is padding)."""
    return jnp.arange(rank)[None, :] < jnp.asarray(lora_ranks)[:num_slots, None]


def _chunks(num_tokens: int, values_per_token: int) -> list:
    step = max(1, CHUNK_VALUES // max(1, values_per_token))
    return [(lo, min(lo + step, num_tokens)) for lo in range(0, num_tokens, step)]


def _rows(parts: list, width: int) -> jax.Array:
    """The chunks' (c, width) float32 rows, concatenated ((0, width) for no tokens)."""
    if not parts:
        return jnp.zeros((0, width), jnp.float32)
    return parts[0] if len(parts) == 1 else jnp.concatenate(parts)


def shrink(x: jax.Array, lora_a: Sequence[jax.Array], meta: LoRAKernelMeta, scale: float,
           lora_ranks=None) -> jax.Array:
    """x (T, H); lora_a[s] (L, r, H) -> (S, T, r) float32."""
    t = x.shape[0]
    idx = meta.token_lora_mapping[:t]
    xf = x.astype(jnp.float32)
    outs = []
    for a in lora_a:
        num_slots, rank, hidden = a.shape
        valid, slot = _slots(idx, num_slots)
        keep = valid[:, None]
        if lora_ranks is not None:
            keep = keep & _rank_keep(lora_ranks, num_slots, rank)[slot]
        parts = []
        for lo, hi in _chunks(t, rank * hidden):
            products = xf[lo:hi, None, :] * a[slot[lo:hi]].astype(jnp.float32)          # (c, r, H)
            parts.append(jnp.where(keep[lo:hi], scale * tree_sum(products), 0.0))
        outs.append(_rows(parts, rank))
    return jnp.stack(outs)


def expand(buf: jax.Array, lora_b: Sequence[jax.Array], y: jax.Array, meta: LoRAKernelMeta,
           offsets: Sequence[int], add_inputs: bool, lora_ranks=None, bias=None) -> jax.Array:
    """buf (S, T, r); lora_b[s] (L, n_s, r); y (T, N) -> y with the slices written.

    bias: None or S entries, each None or (L, n_s). With lora_ranks, B's columns past a slot's rank
    and buf's values past a token's rank are ignored.
    """
    t = y.shape[0]
    idx = meta.token_lora_mapping[:t]
    for s, (b, off) in enumerate(zip(lora_b, offsets)):
        num_slots, width, rank = b.shape
        valid, slot = _slots(idx, num_slots)
        xs = buf[s].astype(jnp.float32)
        keep = None
        if lora_ranks is not None:
            keep = _rank_keep(lora_ranks, num_slots, rank)[slot]                    # (T, r)
            xs = jnp.where(keep, xs, 0.0)                                           # past the token's rank
        parts = []
        for lo, hi in _chunks(t, width * rank):
            own_b = b[slot[lo:hi]].astype(jnp.float32)                              # (c, n, r)
            if keep is not None:
                own_b = jnp.where(keep[lo:hi, None, :], own_b, 0.0)
            delta = tree_sum(xs[lo:hi, None, :] * own_b)                            # (c, n)
            if bias is not None and bias[s] is not None:
                delta = delta + bias[s][slot[lo:hi]].astype(jnp.float32)
            parts.append(delta)
        delta = _rows(parts, width)
        old = y[:, off:off + width]
        new = (old.astype(jnp.float32) + delta) if add_inputs else delta
        y = y.at[:, off:off + width].set(jnp.where(valid[:, None], new.astype(y.dtype), old))
    return y
