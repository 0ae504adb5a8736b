"""Kernel metadata for the JAX side (contract section 3), built by one jitted function.

Fields, values and invariants: `lora_core.kernel_meta` (the record `KernelMeta`, in `meta_args(T)`'s
order). From a (max_num_tokens,) index buffer of which the first `num_tokens` entries are real, the
build here:

  1. masks the real tokens' valid slots (the rest is -1) and keys each token by bin slot + 1, the
     padding positions by the last bin, max_loras + 1, so they sort after every group;
  2. counts the tokens per bin with a scatter-add over max_loras + 2 bins (no `jnp.unique`);
  3. compacts the present bins to the front, ascending (a sort over max_loras + 1 small keys):
     the active ids, their counts and their running sums (the start locations);
  4. sorts the tokens by key once, stably (tokens keep their order inside a group).

Every shape depends only on (max_num_tokens, max_loras), never on the mapping, so one compiled
program serves every step, and nothing is read back to the host; `no_lora` is a device bool scalar.

Values outside -1 .. max_loras-1 (which only a caller inside jit, or with accelerator arrays that
are not read back, can pass unchecked) are treated as -1: they never index weights.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from lora_core import checks
from lora_core.adapter_pairs import AdapterPairs
from lora_core.kernel_meta import KernelMeta

from .devices import resolve_device

__all__ = ["LoRAKernelMeta", "build_kernel_meta", "build_pair_meta"]


@functools.partial(jax.jit, static_argnames=("max_loras",))
def build_kernel_meta(token_lora_mapping: jax.Array, num_tokens: jax.Array, *, max_loras: int
                      ) -> LoRAKernelMeta:
    """Builds LoRAKernelMeta from a (max_num_tokens,) int32 index buffer and the real token count.

    Args:
      token_lora_mapping: (max_num_tokens,) integer slots (-1 = no LoRA); entries at positions
        >= num_tokens are ignored.
      num_tokens: int32 scalar (may be a traced value): how many leading entries are real.
      max_loras: number of slots (static).
    """
    m = jnp.asarray(token_lora_mapping)
    capacity = m.shape[0]
    pos = jnp.arange(capacity, dtype=jnp.int32)
    real = pos < num_tokens
    valid = (m >= 0) & (m < max_loras)   # on the input dtype: a 64-bit slot must not wrap into range
    mapping = jnp.where(real & valid, m, -1).astype(jnp.int32)
    # Step 1: sort key. Bin b = slot + 1 for real tokens (0 for -1); padding goes to the last bin,
    # max_loras + 1, so it sorts after every group and is counted in no group.
    key = jnp.where(real, mapping + 1, max_loras + 1)
    # Step 2: counts per bin by a scatter-add (no sort, no dynamic shapes).
    counts = jnp.zeros(max_loras + 2, jnp.int32).at[key].add(1)[: max_loras + 1]
    # Step 3: compact the present ids to the front, ascending. The sort is over max_loras + 1
    # small keys: present bins keep their id order, absent bins go last.
    present = counts > 0
    bins = jnp.arange(max_loras + 1, dtype=jnp.int32)
    order = jnp.argsort(jnp.where(present, bins, max_loras + 1 + bins), stable=True)
    active_present = present[order]
    active_lora_ids = jnp.where(active_present, order - 1, -1).astype(jnp.int32)
    num_tokens_per_lora = jnp.where(active_present, counts[order], 0).astype(jnp.int32)
    # [0, cumsum of the active ids' counts], then 0 past the active ids (vLLM's padding).
    lora_token_start_loc = jnp.concatenate(
        [jnp.zeros(1, jnp.int32), jnp.where(active_present, jnp.cumsum(num_tokens_per_lora, dtype=jnp.int32), 0)])
    # Step 4: token order grouped by bin; stable so tokens keep their order inside a group.
    sorted_tokens = jnp.argsort(key, stable=True).astype(jnp.int32)
    return LoRAKernelMeta(token_lora_mapping=mapping, token_indices_sorted_by_lora_ids=sorted_tokens,
                          active_lora_ids=active_lora_ids, num_tokens_per_lora=num_tokens_per_lora,
                          lora_token_start_loc=lora_token_start_loc, no_lora=jnp.sum(counts[1:]) == 0)


@functools.partial(jax.jit, static_argnames=("max_loras", "max_groups"))
def build_pair_meta(token_slots: jax.Array, token_weights: jax.Array, num_tokens: jax.Array, *, max_loras: int,
                    max_groups: int) -> tuple:
    """(LoRAKernelMeta over groups, AdapterPairs) of several adapters per token, on the device
    (lora_core.adapter_pairs; equal to its host build `build_pairs_host` for valid inputs).

    token_slots: (max_num_tokens, k) int slots (-1: empty pair), token_weights: (max_num_tokens, k);
    the first `num_tokens` rows are real (may be traced).

    1. Slots outside 0..max_loras-1 and rows past num_tokens become -1 (weight 0).
    2. The rows are sorted lexicographically by their slot tuple (first pair primary); a row
       whose tuple differs from the row before starts a new group: group ids follow the tuples in
       ascending order, rows with no adapter (every slot -1) are group -1.
    3. Groups past max_groups cannot be refused inside jit: their rows become group -1 (they add
       nothing, as contract section 6 treats indices that cannot be checked).
    4. slots[g] = group g's tuple (a scatter of each group's rows), weights padded with zeros;
       the metadata: `build_kernel_meta` over the group ids with max_groups groups.
    """
    slots = jnp.asarray(token_slots).astype(jnp.int32)
    capacity, k = slots.shape
    real = (jnp.arange(capacity) < num_tokens)[:, None]
    slots = jnp.where(real & (slots >= 0) & (slots < max_loras), slots, -1)
    weights = jnp.where(slots >= 0, jnp.asarray(token_weights, jnp.float32), 0.0)
    order = jnp.lexsort(tuple(slots[:, j] for j in reversed(range(k))))
    ordered = slots[order]
    has = ordered.max(axis=1) >= 0
    new = jnp.concatenate([jnp.ones(1, bool), jnp.any(ordered[1:] != ordered[:-1], axis=1)]) & has
    group_sorted = jnp.cumsum(new.astype(jnp.int32)) - 1
    group_sorted = jnp.where(has & (group_sorted < max_groups), group_sorted, -1)
    group = jnp.zeros(capacity, jnp.int32).at[order].set(group_sorted)
    table = jnp.full((max_groups, k), -1, jnp.int32).at[jnp.where(group_sorted >= 0, group_sorted, max_groups)].set(
        ordered, mode="drop")
    meta = build_kernel_meta(group, jnp.asarray(num_tokens, jnp.int32), max_loras=max_groups)
    return meta, AdapterPairs(table, weights)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True, init=False)
class LoRAKernelMeta:
    """Token-to-adapter metadata for the grouped kernels (a pytree of int32 device arrays).

    Shapes: token_lora_mapping, token_indices_sorted_by_lora_ids: (max_num_tokens,);
    active_lora_ids, num_tokens_per_lora: (max_loras + 1,); lora_token_start_loc: (max_loras + 2,);
    no_lora: () bool. The arrays are immutable; `prepare_tensors` rebinds them (vLLM's in-place
    API) and returns the object, so `meta.prepare_tensors(m)` and `meta = meta.prepare_tensors(m)`
    both work.
    """

    token_lora_mapping: jax.Array
    token_indices_sorted_by_lora_ids: jax.Array
    active_lora_ids: jax.Array
    num_tokens_per_lora: jax.Array
    lora_token_start_loc: jax.Array
    no_lora: jax.Array

    def __init__(self, token_lora_mapping, token_indices_sorted_by_lora_ids, active_lora_ids, num_tokens_per_lora,
                 lora_token_start_loc, no_lora=None, *, no_lora_flag_cpu=None):
        """The fields in vLLM's order; the no-LoRA flag as `no_lora` or by vLLM's keyword
        `no_lora_flag_cpu` (one of them)."""
        if (no_lora is None) == (no_lora_flag_cpu is None):
            raise TypeError("LoRAKernelMeta takes the no-LoRA flag once: as no_lora or as no_lora_flag_cpu")
        values = (token_lora_mapping, token_indices_sorted_by_lora_ids, active_lora_ids, num_tokens_per_lora,
                  lora_token_start_loc, no_lora if no_lora is not None else no_lora_flag_cpu)
        for field, value in zip(dataclasses.fields(self), values):
            object.__setattr__(self, field.name, value)  # (a frozen dataclass)

    @property
    def max_loras(self) -> int:
        return self.active_lora_ids.shape[0] - 1

    @property
    def max_num_tokens(self) -> int:
        return self.token_lora_mapping.shape[0]

    @staticmethod
    def make(max_loras: int, max_num_tokens: int, device=None) -> LoRAKernelMeta:
        """Metadata for `max_num_tokens` tokens and `max_loras` slots, every token without LoRA."""
        if max_loras < 1 or max_num_tokens < 1:
            raise ValueError(f"max_loras and max_num_tokens must be >= 1, got {max_loras}, {max_num_tokens}")
        meta = build_kernel_meta(jnp.full(max_num_tokens, -1, jnp.int32), jnp.int32(0),
                                 max_loras=max_loras)
        if device is None:
            return meta
        return jax.device_put(meta, resolve_device(device))

    @staticmethod
    def build(token_lora_mapping, max_loras: int, max_num_tokens: int | None = None,
              num_tokens=None) -> LoRAKernelMeta:
        """Metadata for a (T,) index array, padded to `max_num_tokens` (default T) capacity.

        `num_tokens` (default T) may be a traced scalar when called inside jit. Values known on the
        host without a transfer (NumPy arrays, sequences, concrete arrays on CPU devices) are
        checked: a slot outside -1..max_loras-1 is a ValueError. Inside jit, or on an accelerator,
        such slots are treated as -1 (they never index weights).
        """
        host = _host_mapping(token_lora_mapping)
        if host is not None and host.size:
            checks.check_index_values("token_lora_mapping", int(host.min()), int(host.max()), max_loras,
                                      "the metadata (max_loras)")
            token_lora_mapping = host.astype(np.int32)
        m = jnp.asarray(token_lora_mapping)
        if m.ndim != 1 or not jnp.issubdtype(m.dtype, jnp.integer):
            raise ValueError(f"token_lora_mapping must be a 1-D integer array, got {m.shape} {m.dtype}")
        t = m.shape[0]
        capacity = t if max_num_tokens is None else max_num_tokens
        if t > capacity:
            raise ValueError(f"token_lora_mapping has {t} tokens, more than max_num_tokens={capacity}")
        if t < capacity:
            m = jnp.concatenate([m.astype(jnp.int32), jnp.full(capacity - t, -1, jnp.int32)])
        n = jnp.int32(t) if num_tokens is None else jnp.asarray(num_tokens, jnp.int32)
        return build_kernel_meta(m, n, max_loras=max_loras)

    def prepare_tensors(self, token_lora_mapping) -> LoRAKernelMeta:
        """vLLM's `prepare_tensors`: this metadata (same capacity) for a (T,) mapping; returns self.

        As in vLLM the object is updated in place (its fields are rebound to the new arrays;
        arrays already taken from it, or pytrees flattened from it, keep the old values). Called
        inside jit on an object made outside (a closure), the traced result is only returned:
        storing tracers in it would leak them.
        """
        new = LoRAKernelMeta.build(token_lora_mapping, self.max_loras, self.max_num_tokens)
        if _is_concrete(new.token_lora_mapping) or not _is_concrete(self.token_lora_mapping):
            for field in dataclasses.fields(self):
                object.__setattr__(self, field.name, getattr(new, field.name))  # (a frozen dataclass)
            return self
        return new

    @property
    def no_lora_flag_cpu(self) -> jax.Array:
        """vLLM's name for `no_lora` (here a device scalar, never read back to the host)."""
        return self.no_lora

    def meta_args(self, token_nums: int) -> KernelMeta:
        """(token_lora_mapping[:T], token_indices_sorted_by_lora_ids[:T], num_tokens_per_lora,
        lora_token_start_loc, active_lora_ids, no_lora) for T = token_nums, vLLM's order: a
        `KernelMeta` (a tuple)."""
        return KernelMeta(self.token_lora_mapping[:token_nums], self.token_indices_sorted_by_lora_ids[:token_nums],
                          self.num_tokens_per_lora, self.lora_token_start_loc, self.active_lora_ids, self.no_lora)


def _host_mapping(m) -> np.ndarray | None:
    """An integer mapping's values when they are on the host already (NumPy, a sequence, a
    concrete array on CPU devices); None otherwise (a tracer, an accelerator array, not integers)."""
    if isinstance(m, jax.Array):
        if not _is_concrete(m) or any(d.platform != "cpu" for d in m.devices()):
            return None
    elif not isinstance(m, (np.ndarray, list, tuple)):
        return None
    arr = np.asarray(m)
    return arr if arr.ndim == 1 and arr.dtype.kind in "iu" else None


def _is_concrete(x) -> bool:
    return not isinstance(x, jax.core.Tracer)


def host_value(x):
    """NumPy value of a concrete array (None for a tracer): for checks outside jit."""
    return None if not _is_concrete(x) else np.asarray(x)
