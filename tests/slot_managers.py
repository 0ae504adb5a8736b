"""Small adapter managers whose slots say which adapter they hold, for the pinning and thread tests.

One LoRA'd projection (q_proj of a one-layer Llama in JAX, a LoRALinear in torch); each adapter's
lora_A is the constant of its LoRA id, so `read_slot(slot)` returns the id of the adapter in it.
"""

from __future__ import annotations

import numpy as np

from lora_core.peft import save_peft_adapter

H, Q, V = 16, 16, 32
QMOD = "model.layers.0.self_attn.q_proj"
IDS = (1, 2, 3, 4)


def jax_manager(slots: int = 2):
    """(jax_lora AdapterManager with `slots` slots, read_slot(slot) -> float)."""
    from flax import nnx

    from jax_lora.adapters import AdapterManager
    from jax_lora.models import LlamaConfig, LlamaForCausalLM, add_lora
    cfg = LlamaConfig(vocab_size=V, hidden_size=H, intermediate_size=24, num_hidden_layers=1, num_attention_heads=4,
                      num_key_value_heads=2)
    model = LlamaForCausalLM(cfg, rngs=nnx.Rngs(0))
    add_lora(model, max_loras=slots, max_rank=4, target_modules=("q_proj",))
    mgr = AdapterManager(model, host_cache_size=2)
    layer = mgr.layers["model.layers.0.self_attn.qkv_proj"]
    return mgr, lambda slot: float(np.asarray(layer.lora_a.get_value())[0, slot, 0, 0])


def torch_manager(slots: int = 2):
    """(torch_lora AdapterManager with `slots` slots, read_slot(slot) -> float)."""
    import torch

    from torch_lora.adapters import AdapterManager
    from torch_lora.layers import LoRALinear
    layer = LoRALinear((QMOD,), H, (Q,), max_loras=slots, max_rank=4, dtype=torch.float32, device="cpu")
    mgr = AdapterManager({"q": layer}, host_cache_size=2)
    return mgr, lambda slot: float(layer.slot_views(slot)[0][0, 0])


MANAGERS = {"jax": jax_manager, "torch": torch_manager}


def write_constant_adapters(root) -> dict:
    """{id: directory} of PEFT adapters on q_proj (rank 2), lora_A the constant id, under `root`."""
    out = {}
    for i in IDS:
        out[i] = str(root / f"a{i}")
        save_peft_adapter(out[i], {QMOD: (np.full((2, H), float(i)), np.ones((Q, 2)))}, r=2, lora_alpha=2)
    return out
