"""Several adapters per token, each with its own strength: the host build of the pair tables.

Math (contract section 10): a token t carries up to k (slot, weight) pairs (slot_{t,j}, w_{t,j}) and
computes

  y[t] += sum_j w_{t,j} * scale * (x[t] @ A[slot_{t,j}].T) @ B[slot_{t,j}].T

The kernels keep their grouping of tokens (contract section 3), over *groups* instead of slots: a
group is one distinct tuple of slots, so the tokens of a tile share every pair's weights.

  group[t]            = the rank of token t's slot tuple among the batch's distinct tuples
                        (ascending), -1 when the token has no adapter
  meta                = `kernel_meta.build_host(group, max_groups, capacity)`: the usual metadata,
                        its ids being group ids
  slots[g, j]         = slot of pair j of group g (-1: an empty pair), (max_groups, k) int32
  weights[t, j]       = w_{t,j} (0 for empty pairs and padding), (capacity, k) float32

k is a bucket (`PAIR_BUCKETS`), never a per-batch shape: a batch whose tokens name at most k
adapters runs the k-pair kernels, the pairs past a token's own empty.

The embedding and the LM head run the one-adapter ops once per pair (`PairRows`: each token's and
each sampled row's k slots, without groups): the wrappers' `add_lora_embedding_ids` and
`add_lora_logits` of a paired step.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np

from .kernel_meta import KernelMeta, build_host, field_shapes

__all__ = ["AdapterPairs", "PairRows", "PAIR_BUCKETS", "pair_bucket", "as_pair_entries", "build_pairs_host",
           "PairLayout"]

PAIR_BUCKETS = (1, 2, 4)
"""The pair counts the kernels are compiled for: a token's adapters are padded up to one of them."""


class AdapterPairs(NamedTuple):
    """The pair tables a launch with several adapters per token takes beside its (group) metadata.

    slots: (max_groups, k) int32, the slots of each group's pairs (-1: empty); weights:
    (capacity, k) float32, each token's pair weights. Any array type (NumPy, torch, jax)."""

    slots: Any
    weights: Any

    @property
    def num_pairs(self) -> int:
        return int(self.slots.shape[1])


class PairRows(NamedTuple):
    """Per-token and per-sampled-row pairs, for the ops that run once per pair (embedding, LM head).

    token_slots: (capacity, k) int32 (-1: empty); row_slots, row_weights: (capacity, k) int32 /
    float32, the sampled rows' (prompt_mapping's) pairs. The tokens' weights are
    AdapterPairs.weights."""

    token_slots: Any
    row_slots: Any
    row_weights: Any


def pair_bucket(num_pairs: int) -> int:
    """The smallest bucket of PAIR_BUCKETS holding `num_pairs` adapters (ValueError past the largest)."""
    for k in PAIR_BUCKETS:
        if num_pairs <= k:
            return k
    raise ValueError(f"a token takes at most {PAIR_BUCKETS[-1]} adapters, got {num_pairs}")


def _as_weight(name: str, v: Any) -> float:
    if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, float, np.integer, np.floating)):
        raise TypeError(f"{name} must be a real number, got {v!r}")
    w = float(v)
    if not math.isfinite(w):
        raise ValueError(f"{name} must be finite, got {w}")
    return w


def as_pair_entries(index_mapping: Sequence, index_weights: Sequence | None, name: str = "index_mapping",
                    weights_name: str = "index_weights") -> tuple[tuple, tuple]:
    """(ids, weights): per token a tuple of LoRA ids and a tuple of float weights of equal length.

    index_mapping: per token an int id or a sequence of ids; index_weights: None (every weight
    1.0), or per token a number (a token of one id) or a sequence with one weight per id.
    TypeError / ValueError name the token and what was expected.
    """
    if index_mapping is None or isinstance(index_mapping, (str, bytes)):
        raise TypeError(f"LoRAMapping.{name} must be a sequence, got {index_mapping!r}")
    ids_out, w_out = [], []
    if index_weights is not None and len(index_weights) != len(index_mapping):
        raise ValueError(f"LoRAMapping.{weights_name} has {len(index_weights)} entries, {name} "
                         f"{len(index_mapping)}: one per entry expected")
    for t, entry in enumerate(index_mapping):
        ids = tuple(entry) if isinstance(entry, (list, tuple, np.ndarray)) else (entry,)
        for v in ids:
            if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, np.integer)):
                raise TypeError(f"LoRAMapping.{name}[{t}] must hold integer LoRA ids, got {v!r}")
        ids = tuple(int(v) for v in ids)
        if index_weights is None:
            ws = (1.0,) * len(ids)
        else:
            wt = index_weights[t]
            wt = tuple(wt) if isinstance(wt, (list, tuple, np.ndarray)) else (wt,)
            if len(wt) != len(ids):
                raise ValueError(f"LoRAMapping.{weights_name}[{t}] has {len(wt)} weights for {len(ids)} LoRA ids")
            ws = tuple(_as_weight(f"LoRAMapping.{weights_name}[{t}]", v) for v in wt)
        ids_out.append(ids)
        w_out.append(ws)
    return tuple(ids_out), tuple(w_out)


def build_pairs_host(token_slots: np.ndarray, token_weights: np.ndarray, max_groups: int, capacity: int
                     ) -> tuple[KernelMeta, AdapterPairs]:
    """(group metadata, pair tables) of a batch (module docstring for the values).

    token_slots (T, k) int (-1: an empty pair, anywhere in the tuple), token_weights (T, k).

    1. A token's group key is its slot tuple; tuples of only -1 are "no adapter" (group -1).
       (`host_mapping.pair_step` packs each token's adapters to the front; the kernels skip an
       empty pair wherever it is.)
    2. The distinct tuples, ascending, are numbered 0..G-1 (ValueError when G > max_groups).
    3. The metadata: `build_host` over the group ids, with max_groups groups.
    4. slots[g] = tuple g (rows past G: -1); weights = token_weights padded with zeros to capacity.
    """
    slots = np.asarray(token_slots, np.int64)
    n, k = slots.shape
    if n > capacity:
        raise ValueError(f"the mapping has {n} tokens, more than the capacity {capacity}")
    has = (slots >= 0).any(axis=1) if k else np.zeros(n, bool)
    table = np.full((max_groups, k), -1, np.int32)
    group = np.full(n, -1, np.int64)
    if has.any():
        uniq, inverse = np.unique(slots[has], axis=0, return_inverse=True)
        if uniq.shape[0] > max_groups:
            raise ValueError(f"the mapping has {uniq.shape[0]} distinct adapter combinations, more than the "
                             f"{max_groups} groups one step holds (max_groups)")
        table[:uniq.shape[0]] = uniq
        group[has] = inverse.reshape(-1)
    weights = np.zeros((capacity, k), np.float32)
    weights[:n] = np.asarray(token_weights, np.float32)
    return build_host(group, max_groups, capacity), AdapterPairs(table, weights)


class PairLayout:
    """Where one step's pair metadata sits inside one flat int32 block (host staging and device copy),
    for `capacity` tokens, `max_groups` groups and k pairs: the group KernelMeta's fields in its
    order (`kernel_meta.field_shapes(capacity, max_groups)`), then slots (max_groups, k), then the
    weights (capacity, k) as the bits of float32 values. A wrapper keeps one device block per k
    bucket: its views never move (CUDA graphs), and one copy per step fills it.
    """

    def __init__(self, capacity: int, max_groups: int, num_pairs: int):
        self.capacity, self.max_groups, self.num_pairs = int(capacity), int(max_groups), int(num_pairs)
        shapes = [(f, shape) for f, shape in zip(KernelMeta._fields, field_shapes(self.capacity, self.max_groups))]
        rows = (self.capacity, self.num_pairs)
        shapes += [("slots", (self.max_groups, self.num_pairs)), ("weights", rows), ("token_slots", rows),
                   ("row_slots", rows), ("row_weights", rows)]
        self.segments, offset = [], 0
        for name, shape in shapes:
            offset = -(-offset // 4) * 4                     # 16-byte aligned segments
            size = int(np.prod(shape))
            self.segments.append((name, offset, size, shape))
            offset += size
        self.size = offset

    def views(self, block) -> tuple[KernelMeta, AdapterPairs, PairRows]:
        """(KernelMeta, AdapterPairs, PairRows) of int32 views of `block` (the weights' views hold
        float32 bits: the caller reinterprets them)."""
        v = {name: block[off:off + size].reshape(shape) for name, off, size, shape in self.segments}
        return (KernelMeta(*(v[f] for f in KernelMeta._fields)), AdapterPairs(v["slots"], v["weights"]),
                PairRows(v["token_slots"], v["row_slots"], v["row_weights"]))

    def fill(self, block: np.ndarray, meta: KernelMeta, pairs: AdapterPairs, rows: PairRows) -> np.ndarray:
        """Writes a host build (`host_mapping.pair_step`) into the int32 NumPy array `block`; returns it."""
        block[:] = 0
        m, p, r = self.views(block)
        for dst, src in zip(m, meta):
            dst[...] = src
        p.slots[...] = pairs.slots
        p.weights[...] = np.ascontiguousarray(pairs.weights, np.float32).view(np.int32)
        r.token_slots[...] = rows.token_slots
        r.row_slots[...] = rows.row_slots
        r.row_weights[...] = np.ascontiguousarray(rows.row_weights, np.float32).view(np.int32)
        return block
