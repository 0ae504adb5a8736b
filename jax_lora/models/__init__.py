"""Model families served by jax_lora (Flax NNX)."""

from .llama import (
                    HF_LORA_TARGETS,
                    KVCache,
                    LlamaConfig,
                    LlamaForCausalLM,
                    add_lora,
                    init_cache,
                    load_llama,
                    save_llama,
)
from .mixtral import MIXTRAL_LORA_TARGETS, MixtralConfig, MixtralForCausalLM, load_mixtral, save_mixtral

__all__ = ["HF_LORA_TARGETS", "KVCache", "LlamaConfig", "LlamaForCausalLM", "add_lora", "init_cache",
           "load_llama", "save_llama", "MIXTRAL_LORA_TARGETS", "MixtralConfig", "MixtralForCausalLM",
           "load_mixtral", "save_mixtral"]
