"""JAX-facing mapping functions: contract section 2's results as int32 `jax.Array`s.

The conversion itself runs on the host (`host_mapping`, NumPy); these functions only place the
results on a device.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from lora_core.host_mapping import (
    LongContextLoRAContext,
    LoRAMapping,
    compute_meta_host,
    convert_mapping_args,
    convert_mapping_host,
)

from .devices import resolve_device

__all__ = ["LoRAMapping", "LongContextLoRAContext", "convert_mapping", "compute_meta"]


def convert_mapping(mapping: LoRAMapping, lora_index_to_id: Sequence[int | None], max_loras: int,
                    vocab_size: int, extra_vocab_size: int, long_lora_context: Any | None = None,
                    *vllm_args: Any, device=None):
    """(base_indices (T,), sampler_indices (R,), sampler_indices_padded (R,), embeddings_indices
    (2, T), long_lora_indices (T,) or None, indices_len) as int32 jax arrays; see contract section 2.

    `device`: a jax Device, a Sharding, a platform string ("cpu", "tpu") or None (the default device).
    vLLM's order `(..., extra_vocab_size, device, long_lora_context=None)` is accepted too: a str,
    Device or Sharding in the sixth position is taken as the device, a seventh argument as the context.
    """
    long_lora_context, device = convert_mapping_args(
        long_lora_context, vllm_args, device,
        lambda v: isinstance(v, (str, jax.Device, jax.sharding.Sharding)))
    host = convert_mapping_host(mapping, lora_index_to_id, max_loras, vocab_size, extra_vocab_size,
                                long_lora_context)
    arrays = jax.device_put(host.as_tuple()[:5], resolve_device(device))
    return (*arrays, list(host.indices_len))


def compute_meta(token_lora_tensor):
    """(seq_start_locs, seq_lengths, lora_indices_per_batch, batch_size, max_length, token_nums,
    no_lora): segments of equal consecutive indices, computed on the host (the values are read)."""
    meta = compute_meta_host(np.asarray(token_lora_tensor))
    return (jnp.asarray(meta.seq_start_locs), jnp.asarray(meta.seq_lengths),
            jnp.asarray(meta.lora_indices_per_batch), meta.batch_size, meta.max_length, meta.token_nums,
            meta.no_lora)
