"""Host-side mapping from user LoRA ids to slot indices (contract section 2), in plain NumPy.

Both sides build their index arrays here, on the host, before anything reaches a device:
`jax_lora` turns the results into `jax.Array`s, `torch_lora` into `torch.Tensor`s. This module
imports neither framework, so `torch_lora` can use it without importing JAX.

Words (contract section 1): a *slot* is a row of the stacked weights (`0 .. num_slots-1`); a *LoRA id*
is a positive integer naming an adapter (`0`, or any id <= 0, means "no LoRA"); an *index* is the
slot of a token's adapter, or `-1` for no LoRA. All index arrays are int32.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from . import checks
from .adapter_pairs import AdapterPairs, PairRows, as_pair_entries, build_pairs_host, pair_bucket
from .kernel_meta import KernelMeta, build_host, field_shapes

__all__ = [
    "LoRAMapping",
    "LongContextLoRAContext",
    "HostIndices",
    "PrefillMeta",
    "HostStep",
    "prepare_step",
    "StepLayout",
    "kernel_meta_host",
    "convert_mapping_host",
    "convert_mapping_args",
    "compute_meta_host",
    "pad_prompt_mapping",
    "next_power_of_two",
    "MIN_NUM_SEQS",
]

_INT32_MAX, _INT32_MIN = int(np.iinfo(np.int32).max), int(np.iinfo(np.int32).min)
# LoRA ids are looked up as int64 on the host (they never reach a device).
_ID_MAX = int(np.iinfo(np.int64).max)

# The TPU seed pads the prompt mapping to at least this many rows (vLLM's MIN_NUM_SEQS).
MIN_NUM_SEQS = 8


@dataclasses.dataclass
class LoRAMapping:
    """Which adapter each token and each sampled row uses, as LoRA ids (0 = no LoRA).

    Attributes:
      index_mapping: one LoRA id per token of the batch, length T; or, for several adapters per
        token (contract section 10), per token a tuple of LoRA ids (up to PAIR_BUCKETS[-1]).
      prompt_mapping: one LoRA id per sampled row (logits row), length R.
      is_prefill: whether the batch is a prefill batch (tokens of a request contiguous).
      index_weights: None (every adapter at strength 1), or per token one weight per id of
        `index_mapping` (a number for a token of one id): the strength w of each adapter.
      prompt_weights: the same for the sampled rows, whose `prompt_mapping` entries may be tuples
        of ids too (the LM head's adapters per row of logits).

    With tuples or weights (a *paired* mapping), `index_mapping` / `prompt_mapping` hold a tuple
    of ids per entry and `index_weights` / `prompt_weights` a tuple of floats per entry (both
    sides become paired when either is); `first_ids` / `prompt_first_ids` are each entry's first
    id (0 for none): what one-adapter consumers (token and sampler indices, prefill segments) read.
    `num_pairs` is the kernels' pair bucket (0 for a plain mapping).
    """

    index_mapping: tuple
    prompt_mapping: tuple
    is_prefill: bool = False
    index_weights: tuple | None = None
    prompt_weights: tuple | None = None

    def __post_init__(self):
        def has_tuples(entries):
            return isinstance(entries, (list, tuple)) and any(isinstance(v, (list, tuple, np.ndarray))
                                                              for v in entries)
        paired = (self.index_weights is not None or self.prompt_weights is not None
                  or has_tuples(self.index_mapping) or has_tuples(self.prompt_mapping))
        if paired:
            self.index_mapping, self.index_weights = as_pair_entries(self.index_mapping, self.index_weights)
            self.prompt_mapping, self.prompt_weights = as_pair_entries(self.prompt_mapping, self.prompt_weights,
                                                                       "prompt_mapping", "prompt_weights")
        else:
            self.index_mapping = _as_id_tuple("index_mapping", self.index_mapping)
            self.prompt_mapping = _as_id_tuple("prompt_mapping", self.prompt_mapping)
        self.is_prefill = bool(self.is_prefill)

    @property
    def paired(self) -> bool:
        """Whether the mapping gives tokens (or rows) tuples of ids or weights: several adapters each."""
        return self.index_weights is not None

    @property
    def first_ids(self) -> tuple[int, ...]:
        """Each token's first LoRA id (0 for none); the ids themselves for a plain mapping."""
        if not self.paired:
            return self.index_mapping
        return _as_id_tuple("index_mapping", tuple(ids[0] if ids else 0 for ids in self.index_mapping))

    @property
    def prompt_first_ids(self) -> tuple[int, ...]:
        """Each sampled row's first LoRA id (0 for none); the ids themselves for a plain mapping."""
        if not self.paired:
            return self.prompt_mapping
        return _as_id_tuple("prompt_mapping", tuple(ids[0] if ids else 0 for ids in self.prompt_mapping))

    @property
    def num_pairs(self) -> int:
        """The pair bucket of the kernels (lora_core.adapter_pairs.PAIR_BUCKETS) holding every token's
        and row's adapters; 0 for a plain mapping (the one-adapter kernels)."""
        if not self.paired:
            return 0
        return pair_bucket(max((sum(1 for i in ids if i > 0) for ids in self.index_mapping + self.prompt_mapping),
                               default=1))


@dataclasses.dataclass
class LongContextLoRAContext:
    """Long-context LoRA offsets: `offsets_by_lora_id[id]` is added to positions of that id's tokens.

    Any object with an `offsets_by_lora_id` mapping can be passed instead (vLLM's class works).
    """

    offsets_by_lora_id: dict[int, int] = dataclasses.field(default_factory=dict)


def _as_id_tuple(name: str, ids: Any) -> tuple[int, ...]:
    """The ids as a tuple of Python ints (their range is checked where they are looked up)."""
    if type(ids) is tuple and all(type(v) is int for v in ids):  # the common case, kept as is
        return ids
    if ids is None or isinstance(ids, (str, bytes)):
        raise TypeError(f"LoRAMapping.{name} must be a 1-D sequence of int LoRA ids, got {ids!r}")
    if isinstance(ids, (list, tuple)):  # NumPy would read (1, True) as ints
        bad = next(((i, v) for i, v in enumerate(ids) if isinstance(v, (bool, np.bool_))), None)
        if bad:
            raise TypeError(f"LoRAMapping.{name} must hold integer LoRA ids, got {bad[1]!r} at [{bad[0]}]")
    arr = np.asarray(ids)
    if arr.ndim != 1:
        raise ValueError(f"LoRAMapping.{name} must be a 1-D sequence of int LoRA ids, got shape {arr.shape}")
    if arr.dtype == object:  # Python ints beyond int64, or mixed objects
        bad = [(i, v) for i, v in enumerate(arr.tolist())
               if not isinstance(v, (int, np.integer)) or isinstance(v, bool)]
        if bad:
            raise TypeError(f"LoRAMapping.{name} must hold integer LoRA ids, got {bad[0][1]!r} at [{bad[0][0]}]")
        return tuple(int(v) for v in arr.tolist())
    if arr.size and not np.issubdtype(arr.dtype, np.integer):
        raise TypeError(f"LoRAMapping.{name} must hold integer LoRA ids, got dtype {arr.dtype}")
    return tuple(arr.tolist())


def next_power_of_two(n: int) -> int:
    """Smallest power of two >= n (1 for n <= 1)."""
    return 1 if n <= 1 else 2 ** math.ceil(math.log2(n))


def pad_prompt_mapping(prompt_mapping: Sequence[int], capacity: int | None = None) -> tuple[int, ...]:
    """Pads a prompt mapping with -1 to `max(next_power_of_two(n), MIN_NUM_SEQS)` entries.

    This is vLLM's TPU wrapper's shape bucketing: one compiled program serves every batch whose number of
    sampled rows falls in the same bucket. `capacity`, when given, caps the padded length (a buffer
    of that many rows holds it); the padded entries mean "no LoRA" and never change real rows.
    """
    n = len(prompt_mapping)
    padded = max(next_power_of_two(n), MIN_NUM_SEQS)
    if capacity is not None:
        padded = max(n, min(padded, capacity))
    return tuple(prompt_mapping) + (-1,) * (padded - n)


def _slot_table(lora_index_to_id: Sequence[int | None]) -> _SlotTable:
    """LoRA id -> slot lookup, cached per slot list (it changes only when adapters are loaded)."""
    if lora_index_to_id is None or isinstance(lora_index_to_id, (str, bytes)):
        raise TypeError("lora_index_to_id must be a sequence with one entry per slot (a LoRA id, or None for an "
                        f"empty slot), got {lora_index_to_id!r}")
    try:
        entries = tuple(lora_index_to_id)
    except TypeError:
        raise TypeError("lora_index_to_id must be a sequence with one entry per slot (a LoRA id, or None for an "
                        f"empty slot), got {type(lora_index_to_id).__name__}") from None
    for slot, lora_id in enumerate(entries):   # before the cache: True and 1.0 hash like 1
        _check_slot_id(slot, lora_id)
    return _slot_table_cached(entries)


def _check_slot_id(slot: int, lora_id) -> None:
    if lora_id is not None and (not isinstance(lora_id, (int, np.integer)) or isinstance(lora_id, bool)
                                or int(lora_id) <= 0):
        raise ValueError(f"lora_index_to_id[{slot}] must be None or a positive int LoRA id, got "
                         f"{type(lora_id).__name__} {lora_id!r:.80}")


class _SlotTable:
    """Sorted LoRA ids and their slots, for a vectorised lookup."""

    def __init__(self, table: dict):
        self.ids = sorted(table)
        self.keys = np.array(self.ids, dtype=np.int64)
        self.slots = np.array([table[k] for k in self.ids], dtype=np.int32)


@functools.lru_cache(maxsize=64)
def _slot_table_cached(lora_index_to_id: tuple) -> _SlotTable:
    """Rejects duplicate or non-positive ids in the slot list."""
    table: dict[int, int] = {}
    for slot, lora_id in enumerate(lora_index_to_id):
        if lora_id is None:
            continue
        _check_slot_id(slot, lora_id)
        if int(lora_id) > _ID_MAX:
            raise ValueError(f"lora_index_to_id[{slot}] must be None or a positive LoRA id <= 2**63 - 1, got "
                             f"{int(lora_id)}")
        if int(lora_id) in table:
            raise ValueError(
                f"lora_index_to_id holds LoRA id {int(lora_id)} twice (slots {table[int(lora_id)]} and {slot})")
        table[int(lora_id)] = slot
    return _SlotTable(table)


def _slots_of(name: str, ids: Sequence[int], table: _SlotTable, num_slots_allowed: int,
              none_value: int) -> np.ndarray:
    """Slot per LoRA id (vectorised lookup); ids <= 0 give `none_value`."""
    try:
        ids_arr = np.asarray(ids, dtype=np.int64)
    except OverflowError:  # a Python int beyond int64: no slot can hold it
        i, v = next((i, v) for i, v in enumerate(ids) if not -_ID_MAX - 1 <= v <= _ID_MAX)
        raise ValueError(f"LoRA id {v} (mapping.{name}[{i}]) is outside the int64 range of LoRA ids, so it is in "
                         f"no slot: lora_index_to_id holds {table.ids}") from None
    out = np.full(ids_arr.shape[0], none_value, dtype=np.int32)
    want = ids_arr > 0
    if not want.any():
        return out
    keys, slots = table.keys, table.slots
    pos = np.clip(np.searchsorted(keys, ids_arr), 0, max(len(keys) - 1, 0))
    found = want & (keys[pos] == ids_arr) if len(keys) else np.zeros_like(want)
    missing = np.flatnonzero(want & ~found)
    if missing.size:
        i = int(missing[0])
        raise ValueError(f"LoRA id {int(ids_arr[i])} (mapping.{name}[{i}]) is in no slot: lora_index_to_id "
                         f"holds {table.ids}")
    out[want] = slots[pos[want]]
    too_big = np.flatnonzero(out >= num_slots_allowed)
    if too_big.size:
        i = int(too_big[0])
        raise ValueError(f"LoRA id {int(ids_arr[i])} (mapping.{name}[{i}]) is in slot {int(out[i])}, but "
                         f"max_loras={num_slots_allowed} allows slots 0..{num_slots_allowed - 1}")
    return out


@dataclasses.dataclass(frozen=True)
class HostIndices:
    """The six results of `convert_mapping`, as NumPy int32 arrays (contract section 2).

    base_indices: (T,) slot per token, -1 for no LoRA ("token_lora_indices").
    sampler_indices: (R,) slot per sampled row, -1 for no LoRA.
    sampler_indices_padded: (R,) `j + p_j * R`, p_j the sampler slot with -1 -> max_loras - 1.
    embeddings_indices: (2, T) offsets into the added-vocab and LoRA-A embedding tables.
    long_lora_indices: (T,) long-context offsets, or None without a long-LoRA context.
    indices_len: the lengths of the five arrays above (None for an absent long-LoRA array).
    """

    base_indices: np.ndarray
    sampler_indices: np.ndarray
    sampler_indices_padded: np.ndarray
    embeddings_indices: np.ndarray
    long_lora_indices: np.ndarray | None
    indices_len: list

    def as_tuple(self):
        return (self.base_indices, self.sampler_indices, self.sampler_indices_padded,
                self.embeddings_indices, self.long_lora_indices, self.indices_len)


def convert_mapping_host(
    mapping: LoRAMapping,
    lora_index_to_id: Sequence[int | None],
    max_loras: int,
    vocab_size: int,
    extra_vocab_size: int,
    long_lora_context: Any | None = None,
) -> HostIndices:
    """Converts a LoRAMapping to slot-index arrays on the host (contract section 2).

    Args:
      mapping: LoRA id per token (`index_mapping`, length T) and per sampled row (`prompt_mapping`,
        length R).
      lora_index_to_id: slot -> LoRA id (None for an empty slot).
      max_loras: the caller's table height (vLLM passes number of slots + 1: the extra row is the
        "no LoRA" row of the sampler table). Slots must be < max_loras.
      vocab_size, extra_vocab_size: sizes of the base and added vocabularies.
      long_lora_context: an object with `offsets_by_lora_id`, or None.

    Raises:
      ValueError: a LoRA id in the mapping that no slot holds, a slot >= max_loras, bad sizes.
    """
    if not isinstance(mapping, LoRAMapping):
        raise TypeError(f"mapping must be a LoRAMapping, got {type(mapping).__name__}")
    _check_convert_args(max_loras, vocab_size, extra_vocab_size, long_lora_context)
    return _convert_ids(mapping.first_ids, mapping.prompt_first_ids, lora_index_to_id, max_loras, vocab_size,
                        extra_vocab_size, long_lora_context)


def convert_mapping_args(sixth: Any, rest: tuple, device: Any, is_device) -> tuple[Any, Any]:
    """(long_lora_context, device) from `convert_mapping`'s arguments after `extra_vocab_size`.

    Both orders are accepted: this project's `(..., extra_vocab_size, long_lora_context=None, *,
    device=None)` and vLLM's `(..., extra_vocab_size, device, long_lora_context=None)` (vLLM's TPU
    wrapper calls `convert_mapping(mapping, ids, max_loras, vocab, extra, "cpu", long_lora_context)`).
    `sixth` is the sixth positional argument, `rest` the ones after it, `device` the keyword;
    `is_device(v)` says whether a value is a device of the caller's framework (a str counts).
    """
    if is_device(sixth):
        if device is not None:
            raise TypeError(f"convert_mapping got a device twice: {sixth!r} (sixth argument, vLLM's order) and "
                            f"device={device!r}")
        if len(rest) > 1:
            raise TypeError(f"convert_mapping takes at most 7 positional arguments (vLLM's order: ..., device, "
                            f"long_lora_context), got {6 + len(rest)}")
        return (rest[0] if rest else None), sixth
    if rest:
        raise TypeError(f"convert_mapping's sixth argument is long_lora_context unless it is a device (vLLM's "
                        f"order: ..., device, long_lora_context); got {type(sixth).__name__} and "
                        f"{len(rest)} more positional argument(s)")
    return sixth, device


def _check_convert_args(max_loras, vocab_size, extra_vocab_size, long_lora_context) -> None:
    for name, value in (("max_loras", max_loras), ("vocab_size", vocab_size),
                        ("extra_vocab_size", extra_vocab_size)):
        if not isinstance(value, (int, np.integer)) or isinstance(value, bool):
            raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if max_loras < 1:
        raise ValueError(f"max_loras must be >= 1, got {max_loras}")
    if vocab_size < 0 or extra_vocab_size < 0:
        raise ValueError(
            f"vocab_size and extra_vocab_size must be >= 0, got {vocab_size} and {extra_vocab_size}")
    if long_lora_context is not None and not hasattr(long_lora_context, "offsets_by_lora_id"):
        raise TypeError("long_lora_context must have an `offsets_by_lora_id` mapping, got "
                        f"{type(long_lora_context).__name__}")


def _long_lora_offset(value, lora_id) -> int:
    """An entry of long_lora_context.offsets_by_lora_id: an integer (bools, floats and strings are
    refused, not truncated or parsed)."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"long_lora_context.offsets_by_lora_id[{lora_id!r}] must be an int position offset, got "
                        f"{type(value).__name__} {value!r:.80}")
    return int(value)


def _convert_ids(index_ids: Sequence[int], prompt_ids: Sequence[int], lora_index_to_id, max_loras: int,
                 vocab_size: int, extra_vocab_size: int, long_lora_context) -> HostIndices:
    """convert_mapping_host's work on already-validated id sequences."""
    table = _slot_table(lora_index_to_id)
    base = _slots_of("index_mapping", index_ids, table, max_loras, none_value=-1)
    sampler = _slots_of("prompt_mapping", prompt_ids, table, max_loras, none_value=-1)

    num_rows = len(sampler)
    sampler_padded = np.where(sampler == -1, max_loras - 1, sampler).astype(np.int64)
    sampler_padded = (np.arange(num_rows, dtype=np.int64) + sampler_padded * num_rows)

    emb_slot = np.where(base == -1, 0, base).astype(np.int64)
    embeddings = np.stack([emb_slot * extra_vocab_size, emb_slot * (vocab_size + extra_vocab_size)])
    embeddings[embeddings == -1] = max_loras - 1  # vLLM's rule; unreachable for ids > 0

    long_lora = None
    if long_lora_context is not None:
        offsets = long_lora_context.offsets_by_lora_id
        long_lora = np.asarray([_long_lora_offset(offsets.get(i, 0), i) for i in index_ids], dtype=np.int64)

    for name, arr in (("sampler_indices_padded", sampler_padded), ("embeddings_indices", embeddings),
                      ("long_lora_indices", long_lora)):
        if arr is not None and arr.size and (arr.max() > _INT32_MAX or arr.min() < _INT32_MIN):
            raise ValueError(f"{name} overflows int32 (max {arr.max()}): vocabulary or table too large")

    def i32(a):
        return None if a is None else np.ascontiguousarray(a, dtype=np.int32)

    indices_len = [len(base), num_rows, num_rows, embeddings.shape[-1],
                   None if long_lora is None else len(long_lora)]
    return HostIndices(i32(base), i32(sampler), i32(sampler_padded), i32(embeddings), i32(long_lora),
                       indices_len)


@dataclasses.dataclass(frozen=True)
class PrefillMeta:
    """Segments of consecutive equal token indices (SGMV metadata, contract section 2).

    seq_start_locs: (B,) int32 first token of each segment.
    seq_lengths: (B,) int32 tokens in each segment.
    lora_indices_per_batch: (B,) int32 the segment's slot (-1 = no LoRA).
    batch_size: B. max_length: the longest segment. token_nums: the total number of tokens.
    no_lora: True when no token uses a LoRA (the only segment is -1, or there are no tokens).
    """

    seq_start_locs: np.ndarray
    seq_lengths: np.ndarray
    lora_indices_per_batch: np.ndarray
    batch_size: int
    max_length: int
    token_nums: int
    no_lora: bool

    def as_tuple(self):
        return (self.seq_start_locs, self.seq_lengths, self.lora_indices_per_batch, self.batch_size,
                self.max_length, self.token_nums, self.no_lora)


def compute_meta_host(token_lora_indices: Any) -> PrefillMeta:
    """Merges runs of equal consecutive token indices into segments (vLLM's `compute_meta`).

    Example: indices [2, 2, -1, 0, 0, 0] -> starts [0, 2, 3], lengths [2, 1, 3],
    lora indices [2, -1, 0], batch_size 3, max_length 3, token_nums 6, no_lora False.
    """
    m = np.asarray(token_lora_indices)
    if m.ndim != 1:
        raise ValueError(f"token_lora_tensor must be 1-D (one index per token), got shape {m.shape}")
    if m.size and not np.issubdtype(m.dtype, np.integer):
        raise TypeError(f"token_lora_tensor must hold integer indices, got dtype {m.dtype}")
    if m.size and (m.dtype.itemsize > 4 or m.dtype == np.uint32):
        checks.check_int32_range("token_lora_tensor", int(m.min()), int(m.max()))
    m = m.astype(np.int32)
    n = m.shape[0]
    if n == 0:
        empty = np.zeros(0, np.int32)
        return PrefillMeta(empty, empty, empty, 0, 0, 0, True)
    boundaries = np.flatnonzero(np.diff(m)) + 1
    starts = np.concatenate([[0], boundaries]).astype(np.int32)
    lengths = np.diff(np.concatenate([starts, [n]])).astype(np.int32)
    loras = m[starts]
    no_lora = bool(len(loras) == 1 and loras[0] == -1)
    return PrefillMeta(starts, lengths, loras.astype(np.int32), int(len(starts)), int(lengths.max()),
                       int(n), no_lora)


@dataclasses.dataclass(frozen=True)
class HostStep:
    """One wrapper step's host-side data: the converted indices and prefill segments, checked.

    `buffers()` lists the eight index arrays every wrapper stores, in this order: base (token)
    indices, sampler indices, sampler_indices_padded, embeddings_indices (2, T), long-LoRA indices
    (empty without a context), and the segments' starts, lengths and slots.
    """

    indices: HostIndices
    prefill: PrefillMeta
    max_slot: int     # the largest slot the step uses (-1: none), to check weights on the host
    no_lora: bool     # no token uses a LoRA
    is_prefill: bool
    pairs: tuple | None = None   # several adapters per token: (group KernelMeta, AdapterPairs), NumPy

    def buffers(self) -> tuple:
        h, p = self.indices, self.prefill
        long_lora = h.long_lora_indices if h.long_lora_indices is not None else np.zeros(0, np.int32)
        return (h.base_indices, h.sampler_indices, h.sampler_indices_padded, h.embeddings_indices, long_lora,
                p.seq_start_locs, p.seq_lengths, p.lora_indices_per_batch)


def prepare_step(mapping: LoRAMapping, lora_index_to_id: Sequence[int | None], max_loras: int,
                 vocab_size: int, extra_vocab_size: int, long_lora_context: Any | None, *,
                 max_num_batched_tokens: int, max_batches: int, num_slots: int,
                 pad_prompt: bool) -> HostStep:
    """`update_metadata`'s host half, shared by both wrappers (contract section 2 and 6).

    Checks the mapping against the wrapper's capacities (tokens, sampled rows, prefill segments) and
    slot count, pads the prompt mapping when `pad_prompt` (vLLM's TPU wrapper's bucketing), converts it,
    and computes prefill segments for prefill mappings only (vLLM: a decode step has none).
    """
    if not isinstance(mapping, LoRAMapping):
        raise TypeError(f"mapping must be a LoRAMapping, got {type(mapping).__name__}")
    for name, ids in (("mapping.index_mapping", mapping.index_mapping),
                      ("mapping.prompt_mapping", mapping.prompt_mapping)):
        if len(ids) > max_num_batched_tokens:
            raise ValueError(f"{name} has {len(ids)} entries, more than max_num_batched_tokens="
                             f"{max_num_batched_tokens}")
    prompt = pad_prompt_mapping(mapping.prompt_first_ids, max_num_batched_tokens) if pad_prompt \
        else mapping.prompt_first_ids
    _check_convert_args(max_loras, vocab_size, extra_vocab_size, long_lora_context)
    host = _convert_ids(mapping.first_ids, prompt, lora_index_to_id, max_loras, vocab_size, extra_vocab_size,
                        long_lora_context)
    used = np.concatenate([host.base_indices, host.sampler_indices])
    max_slot = int(used.max()) if used.size else -1
    if max_slot >= num_slots:
        raise ValueError(f"slot {max_slot} is used, but the wrapper was made with max_loras={num_slots} "
                         f"(slots 0..{num_slots - 1})")
    prefill = compute_meta_host(host.base_indices if mapping.is_prefill else np.zeros(0, np.int32))
    if prefill.batch_size > max_batches:
        raise ValueError(f"the prefill segments has {prefill.batch_size} entries, more than max_batches="
                         f"{max_batches}")
    pairs = None
    if mapping.paired:
        pairs = pair_step(mapping, lora_index_to_id, max_loras, capacity=max_num_batched_tokens,
                          max_groups=max_pair_groups(max_batches, num_slots))
        max_slot = max(max_slot, int(pairs[1].slots.max(initial=-1)), int(pairs[2].row_slots.max(initial=-1)))
        if max_slot >= num_slots:
            raise ValueError(f"slot {max_slot} is used, but the wrapper was made with max_loras={num_slots} "
                             f"(slots 0..{num_slots - 1})")
    return HostStep(host, prefill, max_slot, bool(np.all(host.base_indices < 0)), mapping.is_prefill, pairs)


def max_pair_groups(max_batches: int, num_slots: int) -> int:
    """How many distinct adapter combinations one step holds (the pair metadata's group capacity):
    one per request, or one per slot, whichever is larger."""
    return max(int(max_batches), int(num_slots))


def _pair_tables(name: str, entries: tuple, weights: tuple, table: _SlotTable, max_loras: int, k: int
                 ) -> tuple[np.ndarray, np.ndarray]:
    """((n, k) slots, (n, k) weights) of paired entries: every id through the slot table
    (ValueError for an id in no slot), ids <= 0 dropped, each entry's pairs packed and padded."""
    slots = _slots_of(name, [i for ids in entries for i in ids], table, max_loras, none_value=-1)
    out_slots = np.full((len(entries), k), -1, np.int32)
    out_weights = np.zeros((len(entries), k), np.float32)
    pos = 0
    for t, (ids, ws) in enumerate(zip(entries, weights)):
        j = 0
        for slot, w in zip(slots[pos:pos + len(ids)], ws):
            if slot >= 0:
                out_slots[t, j], out_weights[t, j] = slot, w
                j += 1
        pos += len(ids)
    return out_slots, out_weights


def pair_step(mapping: LoRAMapping, lora_index_to_id: Sequence[int | None], max_loras: int, *, capacity: int,
              max_groups: int) -> tuple[KernelMeta, AdapterPairs, PairRows]:
    """(group KernelMeta, AdapterPairs, PairRows) of a mapping with several adapters per token
    (lora_core.adapter_pairs), each entry's pairs padded to the mapping's bucket `num_pairs`."""
    table = _slot_table(lora_index_to_id)
    k = mapping.num_pairs
    token_slots, token_weights = _pair_tables("index_mapping", mapping.index_mapping, mapping.index_weights, table,
                                              max_loras, k)
    row_slots, row_weights = _pair_tables("prompt_mapping", mapping.prompt_mapping, mapping.prompt_weights, table,
                                          max_loras, k)
    meta, pairs = build_pairs_host(token_slots, token_weights, max_groups, capacity)
    rows = PairRows(np.full((capacity, k), -1, np.int32), np.full((capacity, k), -1, np.int32),
                    np.zeros((capacity, k), np.float32))
    rows.token_slots[:len(token_slots)] = token_slots
    rows.row_slots[:len(row_slots)] = row_slots
    rows.row_weights[:len(row_slots)] = row_weights
    return meta, pairs, rows


def kernel_meta_host(token_lora_mapping: np.ndarray, max_loras: int, capacity: int) -> dict:
    """`kernel_meta.build_host`'s record as a dict with the short keys mapping, sorted, num, start,
    active and no_lora (the same NumPy int32 arrays)."""
    meta = build_host(token_lora_mapping, max_loras, capacity)
    return dict(zip(("mapping", "sorted", "num", "start", "active", "no_lora"), meta))


class StepLayout:
    """Where a step's arrays sit inside one flat int32 block (host staging and device copy).

    Both wrappers send a whole step in ONE host-to-device transfer of this block, in this order
    (t = max_num_batched_tokens, b = max_batches, L = max_loras):

      token_lora_indices, sampler_indices, sampler_indices_padded (t each), embeddings_indices (2, t),
      long_lora_indices (t) (the wrappers' names of these arrays),
      seq_start_locs, seq_lengths, lora_indices_per_batch (b each),
      tail (10): indices_len[0..4] (-1 for None), batch_size, max_length, token_nums, is_prefill, no_lora,
      token_meta.* and prompt_meta.*: the kernel metadata of the tokens / sampled rows, one segment per
                                      `KernelMeta` field in its order (`kernel_meta.field_shapes`)

    Index arrays are zero-padded to their capacity (vLLM's TPU wrapper's padding). Every segment starts
    at a multiple of ALIGN int32s (16 bytes; the gaps are zeros): a kernel argument pointing into
    the device block is then 16-byte aligned, which Triton specialises on (vectorised loads, and
    torch_lora's direct launch path takes only aligned pointers).
    """

    TAIL = 10
    ALIGN = 4

    def __init__(self, max_num_batched_tokens: int, max_batches: int, max_loras: int):
        t, b, L = int(max_num_batched_tokens), int(max_batches), int(max_loras)
        self.t, self.b, self.max_loras = t, b, L
        shapes = [("token_lora_indices", (t,)), ("sampler_indices", (t,)), ("sampler_indices_padded", (t,)),
                  ("embeddings_indices", (2, t)), ("long_lora_indices", (t,)), ("seq_start_locs", (b,)),
                  ("seq_lengths", (b,)), ("lora_indices_per_batch", (b,)), ("tail", (self.TAIL,))]
        for prefix in ("token_meta", "prompt_meta"):
            shapes += [(f"{prefix}.{f}", shape) for f, shape in zip(KernelMeta._fields, field_shapes(t, L))]
        self.segments, offset = [], 0
        for name, shape in shapes:
            size = int(np.prod(shape))
            offset = -(-offset // self.ALIGN) * self.ALIGN
            self.segments.append((name, offset, size, shape))
            offset += size
        self.size = offset
        self._index = {name: (off, size, shape) for name, off, size, shape in self.segments}

    def __eq__(self, other):
        return isinstance(other, StepLayout) and (self.t, self.b, self.max_loras) == (
            other.t, other.b, other.max_loras)

    def __hash__(self):
        return hash((StepLayout, self.t, self.b, self.max_loras))

    def views(self, block) -> dict:
        """name -> view (slice, reshaped) of `block`: NumPy, torch and jax arrays alike."""
        return {name: block[off:off + size].reshape(shape) for name, off, size, shape in self.segments}

    def view(self, block, name: str):
        """One segment of `block` (a static slice: free inside jit)."""
        off, size, shape = self._index[name]
        return block[off:off + size].reshape(shape)

    def kernel_meta(self, block, prefix: str) -> KernelMeta:
        """The "token_meta" or "prompt_meta" segments of `block` as a KernelMeta of views (`no_lora`
        as its (1,) int32 0/1)."""
        return KernelMeta(*(self.view(block, f"{prefix}.{f}") for f in KernelMeta._fields))

    def empty_block(self, pad_prompt: bool) -> np.ndarray:
        """The block of a step without tokens (a wrapper's state before its first update)."""
        step = prepare_step(LoRAMapping((), ()), [], 1, 0, 0, None, max_num_batched_tokens=self.t,
                            max_batches=self.b, num_slots=self.max_loras, pad_prompt=pad_prompt)
        return self.fill(np.empty(self.size, np.int32), step)

    def fill(self, block: np.ndarray, step: HostStep) -> np.ndarray:
        """Writes `step` (indices, segments, tail and both kernel metadata) into the int32 NumPy
        array `block` (length `size`); returns it."""
        block[:] = 0
        v = self.views(block)
        names = ("token_lora_indices", "sampler_indices", "sampler_indices_padded", "embeddings_indices",
                 "long_lora_indices", "seq_start_locs", "seq_lengths", "lora_indices_per_batch")
        for name, src in zip(names, step.buffers()):
            v[name][..., : src.shape[-1]] = src
        lens, p = step.indices.indices_len, step.prefill
        v["tail"][:] = [lens[0], lens[1], lens[2], lens[3], -1 if lens[4] is None else lens[4],
                        p.batch_size, p.max_length, p.token_nums, int(step.is_prefill), int(step.no_lora)]
        for prefix, mapping in (("token_meta", step.indices.base_indices),
                                ("prompt_meta", step.indices.sampler_indices)):
            for field, arr in zip(KernelMeta._fields, build_host(mapping, self.max_loras, self.t)):
                v[f"{prefix}.{field}"][:] = arr
        return block
