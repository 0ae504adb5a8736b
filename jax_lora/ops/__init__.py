"""Multi-LoRA ops for JAX (contract section 4); the code is in `jax_lora.ops.api`.

  lora_shrink / lora_expand                      the grouped ops, driven by `LoRAKernelMeta`
  bgmv_shrink / bgmv_expand / bgmv_expand_slice  one index per token
  sgmv_shrink / sgmv_expand / sgmv_expand_slice  one index per prefill segment
  fused_moe_lora / moe_lora_align_block_size     LoRA on a MoE layer's routed pairs (`fused_moe`)

Backends live beside it (`xla`, `pallas_tpu`, `triton`; chosen in `dispatch`). The argument
helpers the wrapper and the bridge share are re-exported here too.
"""

from . import dispatch  # noqa: F401 - `jax_lora.ops.dispatch`, the backend choice
from .api import (  # noqa: F401 - the ops, and the argument helpers the wrapper, bridge and tests share
    as_array,
    as_lora_ranks,
    as_slices,
    bgmv_expand,
    bgmv_expand_slice,
    bgmv_shrink,
    check_same_device,
    fused_moe_lora,
    lora_expand,
    lora_shrink,
    moe_lora_align_block_size,
    segment_indices,
    sgmv_expand,
    sgmv_expand_slice,
    sgmv_shrink,
    to_3d,
)

__all__ = ["lora_shrink", "lora_expand", "bgmv_shrink", "bgmv_expand", "bgmv_expand_slice",
           "sgmv_shrink", "sgmv_expand", "sgmv_expand_slice", "fused_moe_lora", "moe_lora_align_block_size"]
