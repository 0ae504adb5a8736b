"""The kernel-metadata record (contract section 3): one field order from the host build to the launch.

From a per-token index array `m` (a slot, or -1 for no LoRA) of T real tokens, in buffers of fixed
capacity (`capacity` tokens, `max_loras` slots):

  token_lora_mapping[t]               = m[t] for t < T; -1 past it and for slots outside 0..max_loras-1
  token_indices_sorted_by_lora_ids    = stable argsort of the mapping, the positions past T last (so
                                        [:T'] is a permutation of 0..T'-1 for every T' >= T)
  num_tokens_per_lora[i]              = how many tokens have id active_lora_ids[i] (0 for padding)
  lora_token_start_loc                = [0, cumsum(num_tokens_per_lora)] over the active ids, then 0
                                        (vLLM's padding); group i's tokens are
                                        sorted[start[i] : start[i] + num_tokens_per_lora[i]]
  active_lora_ids                     = the distinct ids of the real tokens, ascending (-1 first when
                                        present), padded with -1
  no_lora                             = no real token has a slot

Lengths: capacity, capacity, max_loras + 1, max_loras + 2, max_loras + 1, and the flag (one value).

Invariants the kernels rely on: sum(num_tokens_per_lora) == T; a group's tokens are contiguous in
the sorted order and groups ascend by id; entries of active_lora_ids past the active ones are -1 with
count 0.

`KernelMeta` holds these six arrays in `meta_args(T)`'s order (the order the kernels take them:
the first five are the kernels' metadata pointer parameters). It is generic over the array type:
NumPy on the host (`build_host`, what the wrappers send in their step block), `jax.Array` and
`torch.Tensor` on the devices (`LoRAKernelMeta.meta_args(T)` of each side returns one), and the
argument builder (`lora_core.kernels.arguments`) reads its fields by name.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

__all__ = ["KernelMeta", "build_host", "field_shapes"]


class KernelMeta(NamedTuple):
    """The six metadata arrays in `meta_args(T)`'s order (module docstring: values and invariants).

    Any array type; `no_lora` is None where only the index arrays travel (the kernels never read
    the flag: a launcher decides on it).
    """

    token_lora_mapping: Any
    token_indices_sorted_by_lora_ids: Any
    num_tokens_per_lora: Any
    lora_token_start_loc: Any
    active_lora_ids: Any
    no_lora: Any = None


def field_shapes(capacity: int, max_loras: int) -> KernelMeta:
    """Each field's shape for `capacity` tokens and `max_loras` slots (the flag as one int32)."""
    return KernelMeta((capacity,), (capacity,), (max_loras + 1,), (max_loras + 2,), (max_loras + 1,), (1,))


def build_host(token_lora_mapping: np.ndarray, max_loras: int, capacity: int) -> KernelMeta:
    """The metadata of a (T,) integer mapping, computed on the host in NumPy; equal, field by field,
    to `jax_lora.meta.build_kernel_meta` and to torch's `LoRAKernelMeta.prepare_tensors`.

    The wrappers have every step's mapping on the host anyway (it comes from a LoRAMapping), so they
    build the metadata here and send it with the index arrays in one copy: no kernel runs for it.
    Every field is int32 (`field_shapes`); `no_lora` is (1,), 1 when no token uses a LoRA.

    1. Slots outside 0..max_loras-1 become -1; bin b = slot + 1 (bin 0: no LoRA).
    2. Count the tokens per bin; the present bins, ascending, are the active ids.
    3. Start locations: the running sum of the active ids' counts, 0 past them.
    4. Token order: a stable argsort of the bins, then the padding positions T..capacity-1.
    """
    m = np.asarray(token_lora_mapping, dtype=np.int64)
    n = m.shape[0]
    if n > capacity:
        raise ValueError(f"token_lora_mapping has {n} tokens, more than the capacity {capacity}")
    m = np.where((m >= 0) & (m < max_loras), m, -1)
    key = m + 1
    counts = np.bincount(key, minlength=max_loras + 1)
    present = np.flatnonzero(counts)
    k = present.shape[0]
    active = np.full(max_loras + 1, -1, np.int32)
    active[:k] = present - 1
    num = np.zeros(max_loras + 1, np.int32)
    num[:k] = counts[present]
    start = np.zeros(max_loras + 2, np.int32)
    start[1:k + 1] = np.cumsum(num[:k])
    mapping = np.full(capacity, -1, np.int32)
    mapping[:n] = m
    order = np.concatenate([np.argsort(key, kind="stable"), np.arange(n, capacity)]).astype(np.int32)
    return KernelMeta(token_lora_mapping=mapping, token_indices_sorted_by_lora_ids=order, num_tokens_per_lora=num,
                      lora_token_start_loc=start, active_lora_ids=active,
                      no_lora=np.array([int(counts[1:].sum() == 0)], np.int32))
