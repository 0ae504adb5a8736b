"""The batch-invariant reference ops: what backend "torch" runs with `deterministic=True`.

Math as torch_ref (contract section 4), idx[t] the slot of token t or -1, every product in float32:

  shrink:  out[s, t, :] = scale * x[t] @ A_s[idx[t]].T               (0 where idx[t] = -1)
  expand:  y[t, off_s : off_s + n_s] = (y[t, ...] if add_inputs else 0) + buf[s, t] @ B_s[idx[t]].T
           + bias_s[idx[t]]                                         (rows with idx -1 untouched)

Invariant: every value of token t is computed from token t's own inputs (its row of x or of the
buffer, its slot's weights) by one sequence of float32 operations that depends on the shapes of
the weights only -- not on the number of tokens, the token's position or the other tokens. So a
token's result is bitwise the same in every batch and in every run. How:

  * the token's slot is selected with a gather (never a one-hot matmul: 0 * NaN = NaN);
  * products are elementwise, x[t, k] * A[idx[t], j, k];
  * the sum over k is `tree_sum`: a fixed pairwise tree of elementwise float32 adds.

The mixture-of-experts op (`fused_moe_lora`, contract section 9) is moe_ref's with each routed
pair's products computed the same way (`pair_products`): a pair's values depend on its own row
and its own (slot, expert) weights only.

The module supplies only how each token's own product is computed (`shrink_rows`, `expand_rows`);
slot selection, rank masking, bias and the masked write are torch_ref's (`torch_ref.shrink` and
`torch_ref.expand` with these rows).

No matmul and no library reduction: a BLAS GEMM (or a reduction kernel) may block its inner
dimension, and so order its additions, differently for a different number of rows, which is why
backend "torch" without `deterministic` gives a token slightly different bits in different
batches. The cost: the products are materialised, (chunk, r, H) for the shrink and (chunk, n, r)
for the expand, CHUNK_VALUES float32 values at a time.
"""

from __future__ import annotations

import functools

import torch

from . import moe_ref, torch_ref

NAME = "torch"
CHUNK_VALUES = 1 << 22
"""float32 products materialised at once (16 MiB): tokens are processed in chunks of
max(1, CHUNK_VALUES // (values per token)); chunking never changes a token's result."""


def tree_sum(v: torch.Tensor) -> torch.Tensor:
    """Sum over the last axis as a fixed pairwise tree of elementwise adds: the axis is zero-padded
    to a power of two p, then halved, v[..., :p/2] + v[..., p/2:], until one element is left.
    The additions of each output element, and their order, depend on the axis length only."""
    n = v.shape[-1]
    p = 1 << max(0, n - 1).bit_length()
    if p != n:
        v = torch.nn.functional.pad(v, (0, p - n))
    while v.shape[-1] > 1:
        half = v.shape[-1] // 2
        v = v[..., :half] + v[..., half:]
    return v[..., 0]


def _chunks(num_tokens: int, values_per_token: int):
    step = max(1, CHUNK_VALUES // max(1, values_per_token))
    return [(lo, min(lo + step, num_tokens)) for lo in range(0, num_tokens, step)]


def shrink_rows(xf: torch.Tensor, a: torch.Tensor, slot: torch.Tensor) -> torch.Tensor:
    """(T, r) float32: xf[t] @ a[slot[t]].T as elementwise products, (c, r, H) per chunk of
    tokens, summed by `tree_sum`."""
    _, rank, hidden = a.shape
    out = xf.new_empty((xf.shape[0], rank))
    for lo, hi in _chunks(xf.shape[0], rank * hidden):
        out[lo:hi] = tree_sum(xf[lo:hi, None, :] * a[slot[lo:hi]].to(torch.float32))
    return out


def expand_rows(x: torch.Tensor, slot: torch.Tensor, b: torch.Tensor, keep: torch.Tensor | None) -> torch.Tensor:
    """(T, n) float32: x[t] @ b[slot[t]].T (rank columns outside `keep` (L, r) zeroed) as elementwise
    products, (c, n, r) per chunk of tokens, summed by `tree_sum`."""
    _, width, rank = b.shape
    out = x.new_empty((x.shape[0], width))
    for lo, hi in _chunks(x.shape[0], width * rank):
        own_b = b[slot[lo:hi]].to(torch.float32)                                    # (c, n, r)
        if keep is not None:
            own_b = torch.where(keep[slot[lo:hi]][:, None, :], own_b, torch.zeros_like(own_b))
        out[lo:hi] = tree_sum(x[lo:hi, None, :] * own_b)
    return out


shrink = functools.partial(torch_ref.shrink, rows=shrink_rows)
shrink.__doc__ = "torch_ref.shrink with the batch-invariant rows: writes out[s] (T, r) float32."
expand = functools.partial(torch_ref.expand, rows=expand_rows)
expand.__doc__ = "torch_ref.expand with the batch-invariant rows: writes y's slices in place."


def pair_products(rows: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """(P, n) float32: rows[p] (P, m) float32 against the pair's own weights (P, n, m) as
    elementwise products, (c, n, m) per chunk of pairs, summed by `tree_sum`."""
    num_pairs, width, inner = weights.shape
    out = rows.new_empty((num_pairs, width))
    for lo, hi in _chunks(num_pairs, width * inner):
        out[lo:hi] = tree_sum(rows[lo:hi, None, :] * weights[lo:hi].to(torch.float32))
    return out


fused_moe_lora = functools.partial(moe_ref.fused_moe_lora, products=pair_products)
fused_moe_lora.__doc__ = "moe_ref.fused_moe_lora with the batch-invariant pair products: updates output in place."
