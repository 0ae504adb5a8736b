"""The batch-invariant reference ops: what backend "torch" runs with `deterministic=True`.

Math as torch_ref (SPEC section 4), idx[t] the slot of token t or -1, every product in float32:

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

No matmul and no library reduction: a BLAS GEMM (or a reduction kernel) may block its inner
dimension, and so order its additions, differently for a different number of rows, which is why
backend "torch" without `deterministic` gives a token slightly different bits in different
batches. The cost: the products are materialised, (chunk, r, H) for the shrink and (chunk, n, r)
for the expand, CHUNK_VALUES float32 values at a time.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

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


def _slots(idx: torch.Tensor, num_slots: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(valid (T,) bool, slot (T,) int64): valid is false for -1 and anything outside 0..L-1, whose
    slot is 0 (a safe index; their results are masked out with `valid`)."""
    valid = (idx >= 0) & (idx < num_slots)
    return valid, torch.where(valid, idx, torch.zeros_like(idx)).long()


def _rank_keep(lora_ranks: torch.Tensor, num_slots: int, rank: int, device) -> torch.Tensor:
    """(L, r) bool: True for the first lora_ranks[l] rank columns of slot l (the rest is padding)."""
    cols = torch.arange(rank, device=device)[None, :]
    return cols < lora_ranks[:num_slots, None].to(device)


def _chunks(num_tokens: int, values_per_token: int):
    step = max(1, CHUNK_VALUES // max(1, values_per_token))
    return [(lo, min(lo + step, num_tokens)) for lo in range(0, num_tokens, step)]


@torch.no_grad()
def shrink(x: torch.Tensor, lora_a: Sequence[torch.Tensor], out: torch.Tensor, meta_args: tuple,
           scale: float, lora_ranks: Optional[torch.Tensor] = None) -> None:
    t = x.shape[0]
    idx = meta_args[0][:t]
    for s, a in enumerate(lora_a):
        num_slots, rank, hidden = a.shape
        valid, slot = _slots(idx, num_slots)
        keep = valid[:, None]
        if lora_ranks is not None:
            keep = keep & _rank_keep(lora_ranks, num_slots, rank, x.device)[slot]
        for lo, hi in _chunks(t, rank * hidden):
            products = x[lo:hi, None, :].to(torch.float32) * a[slot[lo:hi]].to(torch.float32)   # (c, r, H)
            own = scale * tree_sum(products)
            out[s, lo:hi].copy_(torch.where(keep[lo:hi], own, torch.zeros_like(own)))


@torch.no_grad()
def expand(buf: torch.Tensor, lora_b: Sequence[torch.Tensor], y: torch.Tensor, meta_args: tuple,
           offsets: Sequence[int], add_inputs: bool, lora_ranks: Optional[torch.Tensor] = None,
           bias=None) -> None:
    """With lora_ranks, B's columns past a slot's rank and buf's values past a token's rank are
    ignored."""
    t = y.shape[0]
    idx = meta_args[0][:t]
    for s, (b, off) in enumerate(zip(lora_b, offsets)):
        num_slots, width, rank = b.shape
        valid, slot = _slots(idx, num_slots)
        xs = buf[s].to(torch.float32)
        keep = None
        if lora_ranks is not None:
            keep = _rank_keep(lora_ranks, num_slots, rank, y.device)[slot]       # (T, r)
            xs = torch.where(keep, xs, torch.zeros_like(xs))                        # past the token's rank
        for lo, hi in _chunks(t, width * rank):
            own_b = b[slot[lo:hi]].to(torch.float32)                                # (c, n, r)
            if keep is not None:
                own_b = torch.where(keep[lo:hi, None, :], own_b, torch.zeros_like(own_b))
            delta = tree_sum(xs[lo:hi, None, :] * own_b)                            # (c, n)
            if bias is not None and bias[s] is not None:
                delta = delta + bias[s][slot[lo:hi]].to(torch.float32)
            old = y[lo:hi, off:off + width]
            new = old.to(torch.float32) + delta if add_inputs else delta
            old.copy_(torch.where(valid[lo:hi, None], new.to(y.dtype), old))
