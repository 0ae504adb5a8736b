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

__all__ = ["HF_LORA_TARGETS", "KVCache", "LlamaConfig", "LlamaForCausalLM", "add_lora", "init_cache",
           "load_llama", "save_llama"]
