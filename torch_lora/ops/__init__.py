"""Multi-LoRA ops for PyTorch (contract section 4); the code is in `torch_lora.ops.api`.

  lora_shrink / lora_expand                      the grouped ops, in vLLM's GPU argument order
                                                 (`*meta.meta_args(T)` after the output tensor)
  bgmv_shrink / bgmv_expand / bgmv_expand_slice  one index per token
  sgmv_shrink / sgmv_expand / sgmv_expand_slice  one index per prefill segment
  fused_moe_lora / moe_lora_align_block_size     mixture-of-experts LoRA of routed pairs (`moe`)

Backends live beside it (`torch_ref`, `triton`; chosen in `dispatch`). The argument helpers the
wrapper and the bridge share are re-exported here too.
"""

from . import dispatch  # noqa: F401 - `torch_lora.ops.dispatch`, the backend choice
from .api import (  # noqa: F401 - the ops, and the argument helpers the wrapper, bridge and tests share
    as_lora_ranks,
    as_slices,
    bgmv_expand,
    bgmv_expand_slice,
    bgmv_shrink,
    check_tensors,
    lora_expand,
    lora_shrink,
    require_tensors,
    segment_indices,
    sgmv_expand,
    sgmv_expand_slice,
    sgmv_shrink,
    to_3d,
)
from .moe import fused_moe_lora, moe_lora_align_block_size

__all__ = ["lora_shrink", "lora_expand", "bgmv_shrink", "bgmv_expand", "bgmv_expand_slice",
           "sgmv_shrink", "sgmv_expand", "sgmv_expand_slice", "fused_moe_lora", "moe_lora_align_block_size"]
