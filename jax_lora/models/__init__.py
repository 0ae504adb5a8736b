"""Model families served by jax_lora (Flax NNX)."""

from . import llama, mixtral
from .llama import (
                    HF_LORA_TARGETS,
                    KVCache,
                    LlamaConfig,
                    LlamaForCausalLM,
                    init_cache,
                    load_llama,
                    save_llama,
)
from .mixtral import MIXTRAL_LORA_TARGETS, MixtralConfig, MixtralForCausalLM, load_mixtral, save_mixtral


def add_lora(model, **kwargs) -> dict:
    """Multi-LoRA layers on the layers of `model` that `target_modules` names: `llama.add_lora` for a
    LlamaForCausalLM, `mixtral.add_lora` for a MixtralForCausalLM (the experts included); the same
    keywords (max_loras, max_rank, target_modules, dtype). Returns {path: layer}."""
    if isinstance(model, MixtralForCausalLM):
        return mixtral.add_lora(model, **kwargs)
    return llama.add_lora(model, **kwargs)

__all__ = ["HF_LORA_TARGETS", "KVCache", "LlamaConfig", "LlamaForCausalLM", "add_lora", "init_cache",
           "load_llama", "save_llama", "MIXTRAL_LORA_TARGETS", "MixtralConfig", "MixtralForCausalLM",
           "load_mixtral", "save_mixtral"]
