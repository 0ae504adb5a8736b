"""The "triton" backend's `fused_moe_lora`: `lora_core.kernels.moe_lora` launched on torch tensors.

Math: `torch_lora.ops.moe` (contract section 9). Steps:
1. The plan (`plan_moe_lora`): naive or sorted blocks, tile sizes, SHARED_A when both slices'
   A are one tensor (PEFT's fused gate_up_proj), so its shrink runs once.
2. A float32 rank buffer (slices * K_SPLIT partial-sum planes, pairs, r), never zeroed: each live
   pair's rows are written by the shrink launch before the expand launch reads them; other rows
   are never read.
3. The shrink launch, then the expand launch, on one grid of blocks (Triton's own launcher; the
   parameter lists from `moe_lora_calls`); on sm_90 and newer the expand is a programmatic
   dependent of the shrink (`pdl.pdl_enabled`).
fp8 (e4m3) A and / or B (contract section 11): the float32 channel scales (`lora_a_scale` (L, E,
r), `lora_b_scale` (L, E, n) per slice) go to the kernel beside the weights; the plan takes the
dtype the weight tiles enter the products in (the activations').
deterministic: the pairs in the naive order (a sorted layout is read back into each pair's
expert) with the batch-invariant plan (`plan_moe_lora(deterministic=True)`): a pair's values are
bitwise the same whatever the batch.
"""

from __future__ import annotations

import torch

from lora_core.kernels.launch import triton_launch
from lora_core.kernels.moe_lora import moe_lora_calls, plan_moe_lora
from lora_core.kernels.planning import dot_dtype

from .pdl import pdl_enabled


def _dtype_name(t: torch.Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")


def _shares_a(lora_a) -> bool:
    return (len(lora_a) == 2 and lora_a[0].data_ptr() == lora_a[1].data_ptr()
            and lora_a[0].shape == lora_a[1].shape and lora_a[0].stride() == lora_a[1].stride())


def _naive_experts(sorted_ids, expert_ids, post_pad, num_pairs: int, block_size: int) -> torch.Tensor:
    """(P,) int32: each pair's expert in a block-sorted layout, -1 for pairs it does not hold (the
    naive order's expert_ids; the slot still comes from token_lora_mapping, whose disabled slots
    the kernel skips)."""
    num_slots, em = sorted_ids.shape
    pos = torch.arange(em, device=sorted_ids.device)
    experts = expert_ids.long()[:, pos // block_size]
    held = (pos[None, :] < post_pad.long()[:num_slots, None]) & (sorted_ids >= 0) & (sorted_ids < num_pairs)
    target = torch.where(held, sorted_ids.long(), torch.full_like(experts, num_pairs)).reshape(-1)
    out = torch.full((num_pairs + 1,), -1, dtype=torch.int32, device=sorted_ids.device)
    out.scatter_(0, target, experts.reshape(-1).to(torch.int32))
    out[num_pairs] = -1
    return out[:num_pairs]


@torch.no_grad()
def fused_moe_lora(output, x, lora_a, lora_b, topk_weights, sorted_ids, expert_ids, post_pad, token_lora,
                   max_lora_rank, top_k, adapter_enabled, mul_routed_weight, offset, block_size, *,
                   deterministic: bool = False, lora_a_scale=None, lora_b_scale=None) -> None:
    num_tokens = output.shape[0]
    num_pairs = num_tokens * top_k
    if num_pairs == 0:
        return
    if deterministic and sorted_ids is not None:      # step 1: one pair per program
        expert_ids = _naive_experts(sorted_ids, expert_ids, post_pad, num_pairs, block_size)
        sorted_ids = None
    num_slots, num_experts, rank, hidden = lora_a[0].shape
    widths = tuple(b.shape[2] for b in lora_b)
    naive = sorted_ids is None
    plan = plan_moe_lora(num_pairs=num_pairs, num_slots=num_slots, num_experts=num_experts, hidden=hidden,
                         widths=widths, rank=rank, naive=naive, sorted_len=0 if naive else sorted_ids.shape[1],
                         block_m=block_size or 16, mul_routed_weight=mul_routed_weight,
                         shared_a=_shares_a(lora_a), deterministic=deterministic,
                         dtypes=(_dtype_name(x), dot_dtype(_dtype_name(lora_a[0]), _dtype_name(x)),
                                 dot_dtype(_dtype_name(lora_b[0]), _dtype_name(x))),
                         pdl=pdl_enabled())
    buf = torch.empty((len(lora_a) * plan.k_split, num_pairs, rank), dtype=torch.float32, device=output.device)
    y = output.view(num_pairs, output.shape[2]) if output.is_contiguous() else output.reshape(num_pairs, -1)
    weights = topk_weights.reshape(-1)
    if not weights.is_contiguous():
        weights = weights.contiguous()
    experts = expert_ids if naive else expert_ids.reshape(num_slots, -1)
    sorted_t = experts if naive else sorted_ids
    pads = experts if naive else post_pad
    token_map = token_lora.to(device=output.device)
    enabled = adapter_enabled.to(device=output.device)
    for call in moe_lora_calls(plan, x, lora_a, lora_b, buf, y, weights, sorted_t, experts, pads, token_map,
                               enabled, enabled, num_pairs=num_pairs, top_k=top_k, offset=offset,
                               strides=torch.Tensor.stride, lora_a_scale=lora_a_scale, lora_b_scale=lora_b_scale):
        triton_launch(call, **({"launch_pdl": True} if call.plan.launch_pdl else {}))
    if y.data_ptr() != output.data_ptr():
        output.copy_(y.view_as(output))
