"""Reference backend "xla": the ops in plain jnp, written for clarity (the oracle's twin).

Math (SPEC section 4), with idx[t] the slot of token t or -1 and every product in float32:

  shrink:  buf[s, t, :] = scale * x[t] @ A_s[idx[t]].T            (0 where idx[t] = -1)
  expand:  y[t, off_s : off_s + n_s] = (y[t, ...] if add_inputs else 0) + buf[s, t] @ B_s[idx[t]].T
           (rows with idx[t] = -1 untouched), off_s = offset_start + n_0 + ... + n_{s-1}

The slot is selected with a one-hot matrix over all slots (the formulation vLLM's TPU path uses):
one matmul against every slot's weights, so nothing of shape (T, r, H) is materialised. It reads all
slots' weights, so it is the fallback, not the fast path.
"""

from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp

from ..meta import LoRAKernelMeta

NAME = "xla"
HIGHEST = jax.lax.Precision.HIGHEST


def _one_hot(idx: jax.Array, num_slots: int) -> jax.Array:
    """(T, L) float32; an all-zero row for -1 (and for anything outside 0..L-1)."""
    return jax.nn.one_hot(idx, num_slots, dtype=jnp.float32)


def shrink(x: jax.Array, lora_a: Sequence[jax.Array], meta: LoRAKernelMeta, scale: float,
           lora_ranks=None) -> jax.Array:
    """x (T, H); lora_a[s] (L, r, H) -> (S, T, r) float32."""
    t = x.shape[0]
    idx = meta.token_lora_mapping[:t]
    xf = x.astype(jnp.float32)
    outs = []
    for a in lora_a:
        num_slots, rank, _ = a.shape
        hot = _one_hot(idx, num_slots)                                   # (T, L)
        every = jnp.einsum("th,lrh->tlr", xf, a.astype(jnp.float32), precision=HIGHEST)
        if lora_ranks is not None:
            every = every * _rank_mask(lora_ranks, num_slots, rank)[None]
        outs.append(scale * jnp.einsum("tl,tlr->tr", hot, every, precision=HIGHEST))
    return jnp.stack(outs)


def expand(buf: jax.Array, lora_b: Sequence[jax.Array], y: jax.Array, meta: LoRAKernelMeta,
           offsets: Sequence[int], add_inputs: bool, lora_ranks=None, bias=None) -> jax.Array:
    """buf (S, T, r); lora_b[s] (L, n_s, r); y (T, N) -> y with the slices written.

    bias: None or S entries, each None or (L, n_s): bias[s][idx[t]] is added to the slice too.
    """
    t = y.shape[0]
    idx = meta.token_lora_mapping[:t]
    for s, (b, off) in enumerate(zip(lora_b, offsets)):
        num_slots, width, rank = b.shape
        has_lora = ((idx >= 0) & (idx < num_slots))[:, None]
        hot = _one_hot(idx, num_slots)                                   # (T, L)
        routed = hot[:, :, None] * buf[s].astype(jnp.float32)[:, None, :]  # (T, L, r)
        if lora_ranks is not None:
            routed = routed * _rank_mask(lora_ranks, num_slots, rank)[None]
        delta = jnp.einsum("tlr,lnr->tn", routed, b.astype(jnp.float32), precision=HIGHEST)
        if bias is not None and bias[s] is not None:
            delta = delta + jnp.einsum("tl,ln->tn", hot, bias[s].astype(jnp.float32), precision=HIGHEST)
        old = y[:, off:off + width]
        new = (old.astype(jnp.float32) + delta) if add_inputs else delta
        y = y.at[:, off:off + width].set(jnp.where(has_lora, new.astype(y.dtype), old))
    return y


def _rank_mask(lora_ranks: jax.Array, num_slots: int, rank: int) -> jax.Array:
    """(L, r) float32: 1 for the first lora_ranks[l] rank columns of slot l, else 0."""
    return (jnp.arange(rank)[None, :] < jnp.asarray(lora_ranks)[:num_slots, None]).astype(jnp.float32)
