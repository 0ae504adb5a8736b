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

__version__ = "0.1.0"

try:
    import torch as _torch  # noqa: F401 - the one hard requirement of this package
except ModuleNotFoundError as _missing:
    if _missing.name != "torch":
        raise
    # An install without the `torch` extra: the package (and the `torch-lora` script's --help and
    # --version) still import; every public name says what to install.
    _TORCH_HINT = ("torch_lora needs PyTorch, which is not installed: pip install 'jax-torch-lora[torch]' "
                   "(on a CPU machine with PyTorch's CPU index, see the README)")

    def __getattr__(name):
        if name.startswith("__"):
            raise AttributeError(name)
        raise ModuleNotFoundError(f"{_TORCH_HINT} (torch_lora.{name})", name="torch")
else:
    from lora_core.host_mapping import LongContextLoRAContext, LoRAMapping

    from . import ops
    from .adapters import AdapterError, AdapterManager, PeftAdapter, adapter_tensors, load_peft_adapter
    from .mapping import compute_meta, convert_mapping
    from .meta import LoRAKernelMeta
    from .wrapper import PunicaWrapper

__all__ = ["LoRAMapping", "LongContextLoRAContext", "convert_mapping", "compute_meta", "LoRAKernelMeta",
           "PunicaWrapper", "ops", "AdapterError", "AdapterManager", "PeftAdapter", "adapter_tensors",
           "load_peft_adapter"]
