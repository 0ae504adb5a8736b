"""Reference MoE LoRA ("torch" backend's `fused_moe_lora`): the routed pairs gathered, in plain torch.

Math: `torch_lora.ops.moe` (contract section 9). Steps:

1. The pairs and their experts from the order given: sorted (each slot's blocks; position j of
   slot l is pair sorted[l, j] with expert expert_ids[l, j // block_size], live when j < its padded
   length and the pair is not the sentinel) or naive (pair p, expert expert_ids[p], slot from its
   token).
2. Live pairs: slot in range, adapter_enabled[slot] != 0, expert >= 0.
3. Per slice: rows = x[row(p)] (float32), t = A_s[slot, e] @ rows (gathered (P, r, K) weights),
   delta = B_s[slot, e] @ t, times the routed weight; added into the pair's output columns. fp8
   (e4m3) weights: t times a_scale_s[slot, e] per rank channel, delta times b_scale_s[slot, e]
   per output column (contract section 11: the scale applied once, to the float32 product).
The gathers select the pair's own slot and expert (never a one-hot product), so NaN in weights
no live pair uses cannot reach the output. Shapes depend on the live-pair count (a host sync on
CUDA): the reference, not the fast path.
"""

from __future__ import annotations

import torch


def pair_products(rows: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """(P, n) float32: rows[p] (P, m) float32 against the pair's own weights (P, n, m), an einsum."""
    return torch.einsum("pnm,pm->pn", weights.float(), rows)


@torch.no_grad()
def fused_moe_lora(output, x, lora_a, lora_b, topk_weights, sorted_ids, expert_ids, post_pad, token_lora,
                   max_lora_rank, top_k, adapter_enabled, mul_routed_weight, offset, block_size, *,
                   products=pair_products, lora_a_scale=None, lora_b_scale=None) -> None:
    """Step 3's products through `products(rows (P, m) float32, weights (P, n, m)) -> (P, n)`
    (torch_lora.ops.invariant: the batch-invariant ones)."""
    num_tokens = output.shape[0]
    num_pairs = num_tokens * top_k
    num_slots = lora_a[0].shape[0]
    device = output.device
    if sorted_ids is None:
        pairs = torch.arange(num_pairs, device=device)
        experts = expert_ids.reshape(-1).long()
        slots = token_lora[:num_tokens].long().to(device).repeat_interleave(top_k)
        live = torch.ones_like(pairs, dtype=torch.bool)
    else:
        em = sorted_ids.shape[1]
        pos = torch.arange(em, device=device)
        pairs = sorted_ids.long().reshape(-1)
        experts = expert_ids.long()[:, pos // block_size].reshape(-1)
        slots = torch.arange(num_slots, device=device).repeat_interleave(em)
        live = (pos[None, :] < post_pad.long()[:num_slots, None]).reshape(-1) & (pairs < num_pairs) & (pairs >= 0)
    live &= (slots >= 0) & (slots < num_slots) & (experts >= 0) & (experts < lora_a[0].shape[1])
    enabled = adapter_enabled.to(device)[torch.where(live, slots, torch.zeros_like(slots))] != 0
    live &= enabled
    pairs, slots, experts = pairs[live], slots[live], experts[live]
    rows = pairs if mul_routed_weight else pairs // top_k
    xf = x.float()[rows]
    weight = topk_weights.reshape(-1).float()[pairs] if mul_routed_weight else None
    flat = output.view(num_pairs, output.shape[2])
    col = offset
    a_scales = lora_a_scale if lora_a_scale is not None else (None,) * len(lora_a)
    b_scales = lora_b_scale if lora_b_scale is not None else (None,) * len(lora_b)
    for a, b, a_scale, b_scale in zip(lora_a, lora_b, a_scales, b_scales):
        t = products(xf, a[slots, experts])
        if a_scale is not None:
            t = t * a_scale[slots, experts].float()
        delta = products(t, b[slots, experts])
        if b_scale is not None:
            delta = delta * b_scale[slots, experts].float()
        if weight is not None:
            delta = delta * weight[:, None]
        n = b.shape[2]
        flat[pairs, col:col + n] = (flat[pairs, col:col + n].float() + delta).to(output.dtype)
        col += n
