"""The routed pairs' order for the mixture-of-experts LoRA kernels (contract section 9), the same on both sides.

A call's (token, expert) pairs go to the kernel in one of two orders: naive (no alignment, one pair
per block) or sorted by (slot, expert) in blocks (`moe_lora_align_block_size`). These rules choose.
"""

from __future__ import annotations

SPARSITY_FACTOR = 8


def naive_block_assignment(num_tokens: int, top_k: int, num_experts: int, max_loras: int, expert_map=None) -> bool:
    """vLLM's rule for the naive pair order: no expert_map and num_tokens * top_k * 8 <=
    num_experts * max_loras (pairs so sparse that sorted blocks would be mostly padding)."""
    return expert_map is None and num_tokens * top_k * SPARSITY_FACTOR <= num_experts * max_loras


def moe_block_size(num_pairs: int, num_experts: int | None = None) -> int:
    """The sorted order's block size for `num_pairs` routed pairs over `num_experts` experts.

    Each (adapter, expert) run is padded to a whole block, so the block follows the pairs one
    expert gets: 16 up to 64 pairs per expert, 32 up to 256, 64 above (many experts and few pairs
    each, e.g. 128 experts at top 8, keep short blocks where a 64-row block would be mostly
    padding; few experts with long runs take fuller blocks, fewer loads of A and B). Without
    num_experts: 16 up to 1024 pairs, 64 above."""
    if num_experts is None:
        return 16 if num_pairs <= 1024 else 64
    if num_experts < 1:
        raise ValueError(f"num_experts: expected an int >= 1, got {num_experts}")
    per_expert = num_pairs / num_experts
    return 16 if per_expert <= 64 else 32 if per_expert <= 256 else 64
