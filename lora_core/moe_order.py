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


def moe_block_size(num_pairs: int) -> int:
    """The sorted order's block size for `num_pairs` routed pairs: 16 up to 1024 pairs (decode: few
    pairs per expert, little padding), 64 above (prefill: fewer, fuller blocks)."""
    return 16 if num_pairs <= 1024 else 64
