"""The batch-invariant reference ops: what backends "xla" and "pallas_tpu" run with `deterministic=True`.

Math as the xla backend (contract section 4), idx[t] the slot of token t or -1, products in float32:

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

The mixture-of-experts op (`fused_moe_lora`, contract section 9) is xla_moe's with each routed
pair's products computed the same way (`pair_products`): a pair's values depend on its own row and
its own (slot, expert) weights only.

The module supplies only how each token's own product is computed (`shrink_rows`, `expand_rows`);
slot selection, rank masking, bias, fp8 weight scales (one elementwise multiply per token and
channel, after the tree sum: batch invariant too) and the masked write are the xla backend's
(`xla.shrink` and `xla.expand` with these rows).

The Pallas TPU kernels tile rows and the hidden size by the token count (plans.py) and choose the
row order per call, so with `deterministic=True` the pallas_tpu backend runs this formulation too.
The cost: every token's products are materialised, (T, r, H) for the shrink and (T, n, r) for the
expand, in chunks of CHUNK_VALUES float32 values.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from . import xla, xla_moe

NAME = "xla"
COLUMN_SCALE = True        # expand takes col_scale (DoRA)
WEIGHT_SCALES = True       # shrink / expand take a_scales / b_scales (fp8 weights; xla's per-token epilogue)
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


def _chunks(num_tokens: int, values_per_token: int) -> list:
    step = max(1, CHUNK_VALUES // max(1, values_per_token))
    return [(lo, min(lo + step, num_tokens)) for lo in range(0, num_tokens, step)]


def _rows(parts: list, width: int) -> jax.Array:
    """The chunks' (c, width) float32 rows, concatenated ((0, width) for no tokens)."""
    if not parts:
        return jnp.zeros((0, width), jnp.float32)
    return parts[0] if len(parts) == 1 else jnp.concatenate(parts)


def shrink_rows(xf: jax.Array, a: jax.Array, slot: jax.Array) -> jax.Array:
    """(T, r) float32: xf[t] @ a[slot[t]].T as elementwise products, (c, r, H) per chunk of
    tokens, summed by `tree_sum`."""
    t, (_, rank, hidden) = xf.shape[0], a.shape
    return _rows([tree_sum(xf[lo:hi, None, :] * a[slot[lo:hi]].astype(jnp.float32))
                  for lo, hi in _chunks(t, rank * hidden)], rank)


def expand_rows(x: jax.Array, slot: jax.Array, b: jax.Array, keep=None) -> jax.Array:
    """(T, n) float32: x[t] @ b[slot[t]].T (rank columns outside `keep` (L, r) zeroed) as elementwise
    products, (c, n, r) per chunk of tokens, summed by `tree_sum`."""
    _, width, rank = b.shape
    parts = []
    for lo, hi in _chunks(x.shape[0], width * rank):
        own_b = b[slot[lo:hi]].astype(jnp.float32)                                  # (c, n, r)
        if keep is not None:
            own_b = jnp.where(keep[slot[lo:hi]][:, None, :], own_b, 0.0)
        parts.append(tree_sum(x[lo:hi, None, :] * own_b))
    return _rows(parts, width)


shrink = functools.partial(xla.shrink, rows=shrink_rows)
shrink.__doc__ = "xla.shrink with the batch-invariant rows: x (T, H); lora_a[s] (L, r, H) -> (S, T, r) float32."
expand = functools.partial(xla.expand, rows=expand_rows)
expand.__doc__ = "xla.expand with the batch-invariant rows: buf (S, T, r); lora_b[s] (L, n_s, r); y (T, N) -> y."


def pair_products(rows: jax.Array, weights: jax.Array) -> jax.Array:
    """(P, n) float32: rows[p] (P, m) float32 against the pair's own weights (P, n, m) as
    elementwise products, (c, n, m) per chunk of pairs, summed by `tree_sum`."""
    num_pairs, width, inner = weights.shape
    return _rows([tree_sum(rows[lo:hi, None, :] * weights[lo:hi].astype(jnp.float32))
                  for lo, hi in _chunks(num_pairs, width * inner)], width)


fused_moe_lora = functools.partial(xla_moe.fused_moe_lora, products=pair_products)
fused_moe_lora.__doc__ = "xla_moe.fused_moe_lora with the batch-invariant pair products -> the new y3."
