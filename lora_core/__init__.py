"""lora_core: the framework-free half of jax-torch-lora (NumPy, and Triton for the GPU kernels).

Everything here is shared by `jax_lora` and `torch_lora` and imports neither JAX nor PyTorch:

- `host_mapping`: contract section 2-3 on the host (LoRAMapping -> index arrays -> kernel metadata,
  and `StepLayout`, a whole step packed into one int32 block).
- `checks`: the public-boundary argument checks and their messages (contract section 6).
- `peft`: PEFT LoRA adapters read as NumPy (adapter_config.json against an allowlist of fields,
  adapter_model.safetensors with its header checked before any data is read), for both sides.
- `backend_registry`: how each side's `ops.dispatch` names and finds its backends.
- `kernels`: the Triton kernels (shrink, expand, fused), their launch plans, the one
  kernel-argument builder every launcher uses, the per-device launch configs and the C launcher.
  Importing `lora_core.kernels` imports Triton; nothing else here does.
"""

from __future__ import annotations

from .host_mapping import LongContextLoRAContext, LoRAMapping

__all__ = ["LoRAMapping", "LongContextLoRAContext"]
