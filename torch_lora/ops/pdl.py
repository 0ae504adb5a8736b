"""Whether the "triton" backend launches with programmatic dependent launch (Hopper and newer).

A dependent kernel's programs start while the kernel before it on the stream finishes, work out
what they can without its results, and wait (gdc_wait) before reading them: `linear`'s expand
after its shrink, the MoE LoRA expand after its shrink. Which launches are dependents:
`lora_core.kernels.planning.pdl_launch` (LORA_CORE_PDL). Decided at the first launch, not at
import (importing must not initialise CUDA).
"""

from __future__ import annotations

import functools

import torch

from lora_core.kernels.common import HAVE_PDL
from lora_core.kernels.planning import interpreting, pdl_allowed


@functools.cache
def pdl_enabled() -> bool:
    """This Triton has PDL, LORA_CORE_PDL allows it, no interpreter, and the GPU is sm_90 or newer."""
    return (HAVE_PDL and not interpreting() and pdl_allowed()
            and torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9)
