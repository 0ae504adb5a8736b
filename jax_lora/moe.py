"""Mixture-of-experts feed-forward pieces shared by the MoE models: the top-k router and the experts.

Router (Hugging Face's Mixtral): logits = x @ gate.T (T, E) in float32, probabilities = softmax over
the E experts, the top k of them per token; with `norm_topk_prob` the k weights are divided by
their sum, which equals a softmax over the k chosen logits (Mixtral always normalises; Qwen-MoE
configs say). Ties go to the lower expert index, as torch.topk does.

Experts (SiLU-gated, per expert e): gate_up_proj (E, H, 2I) and down_proj (E, I, H) in the
(in, out) orientation of nnx.Linear's kernel (Hugging Face stores their transposes,
(E, 2I, H) and (E, H, I)). For each (token, slot k) pair p = t * top_k + k with expert e = ids[t, k]:

  h[p]   = x[t] @ gate_up_proj[e]                           (2I,)  gate = h[:I], up = h[I:]
  a[p]   = silu(gate) * up                                   (I,)
  out[t] = sum_k weights[t, k] * (a[p] @ down_proj[e])       (H,)

Steps: the pairs are ordered by expert (a stable sort), each expert's rows multiplied by its own
weights in one grouped product (`jax.lax.ragged_dot`), and the rows put back in pair order, so a
token only meets the experts it was routed to. LoRA on the experts (jax_lora.nn.MultiLoRAExperts)
adds its terms to the pair-ordered gate_up output (T, k, 2I) and the weighted down output (T, k, H)
between these steps, as vLLM's fused MoE LoRA does.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

__all__ = ["MoEExperts", "route_top_k"]

HIGHEST = jax.lax.Precision.HIGHEST


def route_top_k(logits: jax.Array, top_k: int, norm_topk_prob: bool = True) -> tuple[jax.Array, jax.Array]:
    """(weights (T, k) float32, ids (T, k) int32) from router logits (T, E): the k most probable
    experts of each token and their softmax probabilities (renormalised over the k when
    norm_topk_prob)."""
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    weights, ids = jax.lax.top_k(probs, top_k)
    if norm_topk_prob:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return weights, ids.astype(jnp.int32)


class ExpertOrder:
    """The pairs of one step ordered by expert: order (P,) pair indices sorted by expert (stable),
    group_sizes (E,) pairs per expert. Built once per MoE call, used by both grouped products."""

    def __init__(self, ids: jax.Array, num_experts: int):
        flat = ids.reshape(-1)
        self.order = jnp.argsort(flat, stable=True)
        self.group_sizes = jnp.bincount(flat, length=num_experts).astype(jnp.int32)

    def grouped(self, rows: jax.Array, weights: jax.Array) -> jax.Array:
        """(P, out): rows[p] (pair order, (P, in)) times weights[expert of p] ((E, in, out))."""
        sorted_rows = rows[self.order]
        out = jax.lax.ragged_dot(sorted_rows, weights.astype(sorted_rows.dtype), self.group_sizes,
                                 precision=HIGHEST)
        return jnp.zeros_like(out).at[self.order].set(out)


class MoEExperts(nnx.Module):
    """E SiLU-gated experts: gate_up_proj (E, H, 2I), down_proj (E, I, H) (module docstring).

    __call__(x (T, H), ids (T, k), weights (T, k)) -> (T, H). `gate_up(x, ids, order)` and
    `down(a, ids, weights, order)` are its two halves, the places where expert LoRA adds its terms.
    """

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, *, dtype, rngs: nnx.Rngs):
        self.num_experts = int(num_experts)
        self.hidden_size = int(hidden_size)
        self.intermediate_size = int(intermediate_size)
        init = nnx.initializers.lecun_normal()
        self.gate_up_proj = nnx.Param(init(rngs.params(), (num_experts, hidden_size, 2 * intermediate_size), dtype))
        self.down_proj = nnx.Param(init(rngs.params(), (num_experts, intermediate_size, hidden_size), dtype))

    def gate_up(self, x: jax.Array, ids: jax.Array, order: ExpertOrder) -> jax.Array:
        """(T, k, 2I): each pair's x[t] @ gate_up_proj[e]."""
        t, k = ids.shape
        rows = jnp.repeat(x, k, axis=0)                                               # (P, H), pair order
        return order.grouped(rows, self.gate_up_proj.get_value()).reshape(t, k, -1)

    def down(self, a: jax.Array, ids: jax.Array, weights: jax.Array, order: ExpertOrder) -> jax.Array:
        """(T, k, H): each pair's weights[t, k] * (a[p] @ down_proj[e]); a (P, I) in pair order."""
        t, k = ids.shape
        out = order.grouped(a, self.down_proj.get_value()).reshape(t, k, -1)
        return (out.astype(jnp.float32) * weights[..., None]).astype(a.dtype)

    @staticmethod
    def activate(h: jax.Array) -> jax.Array:
        """(P, I): silu(gate) * up of the pair-ordered gate_up output (T, k, 2I)."""
        i = h.shape[-1] // 2
        h = h.reshape(-1, h.shape[-1])
        return jax.nn.silu(h[:, :i]) * h[:, i:]

    def __call__(self, x: jax.Array, ids: jax.Array, weights: jax.Array) -> jax.Array:
        order = ExpertOrder(ids, self.num_experts)
        a = self.activate(self.gate_up(x, ids, order))
        return self.down(a, ids, weights, order).sum(axis=1)
