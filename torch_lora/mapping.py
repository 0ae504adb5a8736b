"""Torch-facing mapping functions: contract section 2's results as int32 `torch.Tensor`s.

The conversion runs on the host in NumPy (`lora_core.host_mapping`, framework-free); these
functions place the results on a device.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from lora_core.host_mapping import (
    LongContextLoRAContext,
    LoRAMapping,
    compute_meta_host,
    convert_mapping_args,
    convert_mapping_host,
)

__all__ = ["LoRAMapping", "LongContextLoRAContext", "convert_mapping", "compute_meta"]


def convert_mapping(mapping: LoRAMapping, lora_index_to_id: Sequence[int | None], max_loras: int,
                    vocab_size: int, extra_vocab_size: int, long_lora_context: Any | None = None,
                    *vllm_args: Any, device=None):
    """(base_indices (T,), sampler_indices (R,), sampler_indices_padded (R,), embeddings_indices
    (2, T), long_lora_indices (T,) or None, indices_len) as int32 tensors; see contract section 2.

    vLLM's order `(..., extra_vocab_size, device, long_lora_context=None)` is accepted too: a str or
    torch.device in the sixth position is taken as the device, a seventh argument as the context.
    """
    long_lora_context, device = convert_mapping_args(long_lora_context, vllm_args, device,
                                                     lambda v: isinstance(v, (str, torch.device)))
    host = convert_mapping_host(mapping, lora_index_to_id, max_loras, vocab_size, extra_vocab_size,
                                long_lora_context)
    out = [None if a is None else torch.from_numpy(np.ascontiguousarray(a)).to(device or "cpu")
           for a in host.as_tuple()[:5]]
    return (*out, list(host.indices_len))


def compute_meta(token_lora_tensor):
    """(seq_start_locs, seq_lengths, lora_indices_per_batch, batch_size, max_length, token_nums,
    no_lora): segments of equal consecutive indices. Reads the values (a host sync on CUDA)."""
    t = torch.as_tensor(token_lora_tensor)
    meta = compute_meta_host(t.detach().cpu().numpy())
    to = lambda a: torch.from_numpy(a).to(t.device)
    return (to(meta.seq_start_locs), to(meta.seq_lengths), to(meta.lora_indices_per_batch),
            meta.batch_size, meta.max_length, meta.token_nums, meta.no_lora)
