"""jax_lora: multi-LoRA (Punica) ops, metadata and wrapper for JAX.

Public names (contract section 8): LoRAMapping, convert_mapping, compute_meta, LoRAKernelMeta,
PunicaWrapper; `jax_lora.ops` (lora_shrink, lora_expand, bgmv_*, sgmv_*); `jax_lora.nn` (Flax).

Imports are lazy (`import jax_lora` loads nothing else until a name is used). The host mapping,
argument checks and Triton kernels live in the framework-free `lora_core` package.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

_EXPORTS = {
    "LoRAMapping": "lora_core.host_mapping",
    "LongContextLoRAContext": "lora_core.host_mapping",
    "convert_mapping": "jax_lora.mapping",
    "compute_meta": "jax_lora.mapping",
    "LoRAKernelMeta": "jax_lora.meta",
    "PunicaWrapper": "jax_lora.wrapper",
}
_SUBMODULES = ("ops", "nn", "meta", "mapping", "wrapper", "models", "adapters", "serving", "cli", "parallel",
               "quant")

__all__ = list(_EXPORTS) + ["ops", "nn"]


def __getattr__(name):
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
        globals()[name] = value
        return value
    if name in _SUBMODULES:
        return importlib.import_module(f"jax_lora.{name}")
    raise AttributeError(f"module 'jax_lora' has no attribute {name!r}")


def __dir__():
    return sorted(__all__)
