"""Tensor-parallel layouts of the LoRA weights: which part of an adapter each rank keeps, and what a
layout costs per forward call.

Math. A LoRA layer adds `delta = (x @ A.T) @ B.T` (A: (r, in), B: (out, r)). Over P ranks:

  column-parallel base (y sharded along out):  delta[:, part_p] = (x @ A.T) @ B[part_p].T
      replicated:     A whole on every rank, B's rows part_p           no communication
      fully_sharded:  A's rank rows chunk_p, B's rows part_p           all-gather of the (S, T, r) buffer
  row-parallel base (x sharded along in):      x @ A.T = sum_p x[:, in_p] @ A[:, in_p].T
      replicated:     A's columns in_p, B whole                        all-reduce of the (1, T, r) buffer
      fully_sharded:  A's columns in_p, B's rows part_p                all-reduce of the buffer, then
                                                                       all-gather of delta's columns (T, N)
  embedding (A a table of vocabulary rows):
      replicated:     the whole table, B whole                         no communication
      fully_sharded:  the table's vocabulary rows part_p, B whole      all-reduce of the (T, r) rows

Byte model, per rank and per forward call. Symbols: T tokens (sampled rows for an LM head), H the
full input size, N the full output size, n_p this rank's output width (per slice for fused layers,
S slices), r the stacked rank, P ranks, D adapters active in the step (kernels read each active
adapter's weights once), L slots, w the weight element size, e the element size of y, f = 4 (the rank
buffer is float32), V the vocabulary, E the embedding width.

  weight_bytes (adapter weights read):
    column replicated      D * (S * r * H + sum(n_p) * r) * w
    column fully_sharded   D * (S * (r / P) * H + sum(n_p) * r) * w
    row replicated         D * (r * H / P + N * r) * w
    row fully_sharded      D * (r * H / P + (N / P) * r) * w
    embedding (both)       T * r * w + D * E * r * w          (T table rows gathered, B)
  collectives (payload: the all-reduced tensor, or the all-gathered output):
    column fully_sharded   all_gather S * T * r * f
    row replicated         all_reduce T * r * f
    row fully_sharded      all_reduce T * r * f, all_gather T * N * e
    embedding sharded      all_reduce T * r * f
  link_bytes (sent by each rank, ring algorithms): all_reduce 2 (P - 1) / P * payload,
    all_gather (P - 1) / P * payload.

The layout moving fewer `weight_bytes + link_weight * link_bytes` is chosen (`choose_layout`;
`link_weight` 1 counts a byte over the interconnect like a byte of memory traffic; the ratio of the
memory to the link bandwidth, about 10 for HBM3e over NVLink 4, counts time). Traffic that is
equal in both layouts (reading x, reading and writing y) is left out. For an embedding the sharded
layout always moves more; it exists to hold 1/P of the table (`resident_bytes`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence

__all__ = ["LAYOUTS", "LayoutCost", "SliceShard", "choose_layout", "column_costs", "embedding_costs",
           "even_range", "link_bytes", "padded_range", "qkv_ranges", "row_costs"]

LAYOUTS = ("replicated", "fully_sharded")
_F32 = 4


@dataclasses.dataclass(frozen=True)
class SliceShard:
    """Where one output slice's adapter weights live on this rank.

    `a_rank`, `a_in`, `b_out` are half-open (start, stop) ranges of the full adapter weights
    A (r, full_in) and B (full_out, r): rows of A along the rank axis, columns of A along the input,
    rows of B along the output. `a_in` and `b_out` may reach past `full_in` / `full_out` (a padded
    vocabulary shard): what lies past stays zero. `a_table`: A is stored as (slots, in, rank), an
    embedding table; otherwise as (slots, rank, in).
    """

    a_rank: tuple[int, int]
    a_in: tuple[int, int]
    b_out: tuple[int, int]
    full_in: int
    full_out: int
    a_table: bool = False

    @property
    def a_shape(self) -> tuple[int, int]:
        """Per-slot shape of this rank's A."""
        rows, cols = self.a_rank[1] - self.a_rank[0], self.a_in[1] - self.a_in[0]
        return (cols, rows) if self.a_table else (rows, cols)

    @property
    def b_rows(self) -> int:
        return self.b_out[1] - self.b_out[0]


def even_range(name: str, size: int, rank: int, world: int) -> tuple[int, int]:
    """Rank `rank`'s part of `size` split into `world` equal parts; `size` must divide evenly."""
    if size % world:
        raise ValueError(f"{name}={size} must be divisible by the process group size {world}")
    part = size // world
    return rank * part, (rank + 1) * part


def padded_range(size: int, rank: int, world: int) -> tuple[int, int]:
    """Rank `rank`'s part of `size` in parts of ceil(size / world); the last may reach past `size`."""
    part = -(-size // world)
    return rank * part, (rank + 1) * part


def qkv_ranges(num_heads: int, num_kv_heads: int, head_size: int, rank: int,
               world: int) -> tuple[tuple[int, int], tuple[int, int], tuple[int, int]]:
    """Rows of q, k and v (each within its own slice) held by rank `rank`, as a QKV-parallel base
    layer shards them: q heads split evenly; kv heads split evenly when there are at least `world` of
    them, otherwise each kv head replicated on world / num_kv_heads consecutive ranks (vLLM's
    `kv_shard_id = rank // num_kv_head_replicas`).
    """
    for name, v in (("num_heads", num_heads), ("num_kv_heads", num_kv_heads), ("head_size", head_size)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"{name} must be a positive int, got {v!r}")
    if num_heads % world:
        raise ValueError(f"num_heads={num_heads} must be divisible by the process group size {world}")
    q_heads = num_heads // world
    q = (rank * q_heads * head_size, (rank + 1) * q_heads * head_size)
    if num_kv_heads >= world:
        if num_kv_heads % world:
            raise ValueError(f"num_kv_heads={num_kv_heads} must be divisible by the process group size "
                             f"{world} (or divide it, for replicated kv heads)")
        kv_heads, first = num_kv_heads // world, rank * (num_kv_heads // world)
    else:
        if world % num_kv_heads:
            raise ValueError(f"num_kv_heads={num_kv_heads} must divide the process group size {world} "
                             "when there are fewer kv heads than ranks")
        kv_heads, first = 1, rank // (world // num_kv_heads)
    kv = (first * head_size, (first + kv_heads) * head_size)
    return q, kv, kv


@dataclasses.dataclass(frozen=True)
class LayoutCost:
    """What one forward call of a layout moves, per rank (see the module docstring's formulas).

    weight_bytes: adapter weights read. collectives: (kind, payload bytes) per collective call, in
    call order. link_bytes: bytes this rank sends for them. resident_bytes: adapter weights held
    (every slot).
    """

    layout: str
    weight_bytes: int
    collectives: tuple[tuple[str, int], ...]
    link_bytes: float
    resident_bytes: int

    def moved_bytes(self, link_weight: float = 1.0) -> float:
        return self.weight_bytes + link_weight * self.link_bytes


def link_bytes(collectives: Sequence[tuple[str, int]], world: int) -> float:
    """Bytes one rank sends for `collectives` under ring algorithms (see the module docstring)."""
    factor = {"all_reduce": 2.0 * (world - 1) / world, "all_gather": (world - 1) / world}
    total = 0.0
    for kind, payload in collectives:
        if kind not in factor:
            raise ValueError(f"collective kind must be one of {sorted(factor)}, got {kind!r}")
        total += factor[kind] * payload
    return total


def _cost(layout, weight_elems, collectives, resident_elems, world, elem_bytes) -> LayoutCost:
    collectives = tuple(collectives)
    return LayoutCost(layout, int(weight_elems * elem_bytes), collectives, link_bytes(collectives, world),
                      int(resident_elems * elem_bytes))


def _check_workload(num_tokens, num_adapters, max_loras):
    if not isinstance(num_tokens, int) or isinstance(num_tokens, bool) or num_tokens < 0:
        raise ValueError(f"num_tokens must be an int >= 0, got {num_tokens!r}")
    if not isinstance(num_adapters, int) or isinstance(num_adapters, bool) or not 0 <= num_adapters <= max_loras:
        raise ValueError(f"num_adapters must be an int in [0, max_loras={max_loras}], got {num_adapters!r}")


def column_costs(*, input_size: int, local_widths: Sequence[int], max_rank: int, max_loras: int, world: int,
                 num_tokens: int, num_adapters: int, weight_bytes: int) -> dict[str, LayoutCost]:
    """Costs of a column-parallel layer (one entry of `local_widths` per slice: this rank's n_p)."""
    _check_workload(num_tokens, num_adapters, max_loras)
    s, n, r, h = len(local_widths), sum(local_widths), max_rank, input_size
    rep = s * r * h + n * r
    shard = s * (r // world) * h + n * r
    return {"replicated": _cost("replicated", num_adapters * rep, (), max_loras * rep, world, weight_bytes),
            "fully_sharded": _cost("fully_sharded", num_adapters * shard,
                                   (("all_gather", s * num_tokens * r * _F32),), max_loras * shard, world,
                                   weight_bytes)}


def row_costs(*, input_size: int, output_size: int, max_rank: int, max_loras: int, world: int, num_tokens: int,
              num_adapters: int, weight_bytes: int, output_bytes: int) -> dict[str, LayoutCost]:
    """Costs of a row-parallel layer (input_size H and output_size N are the full sizes)."""
    _check_workload(num_tokens, num_adapters, max_loras)
    r, h, n = max_rank, input_size, output_size
    rep = r * (h // world) + n * r
    shard = r * (h // world) + (n // world) * r
    reduce = ("all_reduce", num_tokens * r * _F32)
    return {"replicated": _cost("replicated", num_adapters * rep, (reduce,), max_loras * rep, world, weight_bytes),
            "fully_sharded": _cost("fully_sharded", num_adapters * shard,
                                   (reduce, ("all_gather", num_tokens * n * output_bytes)), max_loras * shard,
                                   world, weight_bytes)}


def embedding_costs(*, num_embeddings: int, embedding_dim: int, max_rank: int, max_loras: int, world: int,
                    num_tokens: int, num_adapters: int, weight_bytes: int) -> dict[str, LayoutCost]:
    """Costs of a vocabulary-parallel embedding's adapter (table rows looked up per token, then B)."""
    _check_workload(num_tokens, num_adapters, max_loras)
    r, v, e = max_rank, num_embeddings, embedding_dim
    read = num_tokens * r + num_adapters * e * r
    part = -(-v // world)
    return {"replicated": _cost("replicated", read, (), max_loras * (v * r + e * r), world, weight_bytes),
            "fully_sharded": _cost("fully_sharded", read, (("all_reduce", num_tokens * r * _F32),),
                                   max_loras * (part * r + e * r), world, weight_bytes)}


def choose_layout(costs: Mapping[str, LayoutCost], link_weight: float = 1.0) -> str:
    """The layout with the fewest `moved_bytes(link_weight)`; a tie keeps "replicated" (fewer calls)."""
    if not isinstance(link_weight, (int, float)) or isinstance(link_weight, bool) or not \
            (link_weight >= 0 and math.isfinite(link_weight)):
        raise ValueError(f"link_weight must be a finite number >= 0, got {link_weight!r}")
    missing = [k for k in LAYOUTS if k not in costs]
    if missing:
        raise ValueError(f"costs must hold an entry for each of {LAYOUTS}, missing {missing}")
    rep, shard = (costs[k].moved_bytes(link_weight) for k in LAYOUTS)
    return "fully_sharded" if shard < rep else "replicated"


def check_layout_args(fully_sharded: bool | None, tokens_per_step: int | None) -> None:
    """A layer needs either its layout or the step size to choose one by bytes."""
    if fully_sharded is not None and not isinstance(fully_sharded, bool):
        raise TypeError(f"fully_sharded must be True, False or None (choose by bytes), got {fully_sharded!r}")
    if fully_sharded is None and tokens_per_step is None:
        raise ValueError("pass fully_sharded=True/False, or tokens_per_step= (the typical tokens, or sampled "
                         "rows for an LM head, per forward call) to choose the layout that moves fewer bytes")
