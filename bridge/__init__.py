"""bridge: zero-copy DLPack exchange between torch and JAX, and each side's API over the other's kernels.

Public names (contract section 8):
  to_jax(x, *, copy=False, stream=None)    torch.Tensor -> jax.Array sharing its memory
  to_torch(x, *, copy=False, stream=None)  jax.Array -> torch.Tensor sharing its memory
  CopyRequiredError                        raised for what cannot be shared without a copy
  TorchPunicaWrapper                       torch_lora's wrapper API computed by jax_lora's kernels
  JaxPunicaWrapper                         jax_lora's wrapper API computed by torch_lora's kernels
  torch_over_jax, jax_over_torch           the ops (lora_shrink, lora_expand, bgmv_*, sgmv_*) with
                                           one side's signatures over the other side's ops
See docs/bridge.md for when to use which direction, what is zero-copy, and what is refused.
"""

from . import jax_over_torch, torch_over_jax
from .dlpack import ConversionCache, CopyRequiredError, jax_device_for, to_jax, to_torch, torch_device_for
from .jax_over_torch import JaxPunicaWrapper
from .torch_over_jax import TorchPunicaWrapper

__all__ = ["to_jax", "to_torch", "CopyRequiredError", "ConversionCache", "TorchPunicaWrapper", "JaxPunicaWrapper",
           "torch_over_jax", "jax_over_torch", "jax_device_for", "torch_device_for"]
