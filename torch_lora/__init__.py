"""torch_lora: multi-LoRA (Punica) ops, metadata and wrapper for PyTorch.

Public names (contract section 8): LoRAMapping, convert_mapping, compute_meta, LoRAKernelMeta,
PunicaWrapper; `torch_lora.ops` (lora_shrink, lora_expand in vLLM's GPU wrapper's argument order,
bgmv_*, sgmv_*). `LoRAMapping` is the same class as `jax_lora.LoRAMapping`.
`torch_lora.parallel` (imported on its own: it loads torch.distributed) has the tensor-parallel layers.

Adapters: `load_peft_adapter` (lora_core's PEFT reader, shared with the JAX side), `AdapterManager`
(fixed slots, LRU, host cache, stream-ordered uploads), `torch_lora.layers` (the multi-LoRA layers)
and `torch_lora.hf.MultiLoRAModel` (a Hugging Face causal LM served with many adapters per batch;
imported on its own: `from torch_lora.hf import MultiLoRAModel`).
"""

from lora_core.host_mapping import LongContextLoRAContext, LoRAMapping

from . import ops
from .adapters import AdapterError, AdapterManager, PeftAdapter, adapter_tensors, load_peft_adapter
from .mapping import compute_meta, convert_mapping
from .meta import LoRAKernelMeta
from .wrapper import PunicaWrapper

__version__ = "0.1.0"
__all__ = ["LoRAMapping", "LongContextLoRAContext", "convert_mapping", "compute_meta", "LoRAKernelMeta",
           "PunicaWrapper", "ops", "AdapterError", "AdapterManager", "PeftAdapter", "adapter_tensors",
           "load_peft_adapter"]
