"""The tensor-parallel layouts of a multi-LoRA layer and the byte model that chooses between them.

`layer_bytes` counts, per device and call, the weight bytes a layout reads and the bytes it
receives over the interconnect; `choose_layout` picks the layout that moves fewer (docs/parallel.md
writes the formulas out). `jax_lora.parallel` places and runs the layouts.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

# kind -> its layouts (the first is the one shard_plain_layer splits a plain base like).
LAYOUTS = {
    "column": ("column", "column_gather"),
    "row": ("row_reduce", "row_partial"),
    "embed": ("vocab",),
    "logits": ("column", "column_gather"),
}
KINDS = tuple(LAYOUTS)


@dataclasses.dataclass(frozen=True)
class LayoutBytes:
    """Bytes one device moves in one call: adapter weights read, bytes received by collectives,
    and the payload of the LoRA collective (the buffer's size; 0 without one)."""

    weights: int
    received: int
    collective: int

    @property
    def total(self) -> int:
        return self.weights + self.received


def layer_bytes(kind: str, layout: str, *, tokens: int, active: int, slices: Sequence[int], in_features: int,
                rank: int, shards: int, itemsize: int) -> LayoutBytes:
    """The module docstring's byte formula for one layer, one device and one call.

    tokens: T (rows of x). active: a, the distinct adapters of the call (at most min(L, T)).
    slices: output widths (N is their sum; D for an embedding, V for logits). in_features: H, K or,
    for an embedding, V. shards: n. itemsize: of the adapter weights.
    """
    check_layout(kind, layout)
    sizes = {"tokens": tokens, "active": active, "in_features": in_features, "rank": rank, "itemsize": itemsize}
    bad = {k: v for k, v in sizes.items() if int(v) != v or v < 0}
    if bad or int(shards) != shards or shards < 1 or not slices or any(int(w) != w or w < 1 for w in slices):
        raise ValueError(f"layer_bytes needs integers: tokens, active, in_features, rank, itemsize >= 0, "
                         f"shards >= 1 and slices >= 1; got {dict(sizes, shards=shards, slices=tuple(slices))}")
    s, n, t, r, a, w = len(slices), int(shards), int(tokens), int(rank), int(active), int(itemsize)
    out, inp = int(sum(slices)), int(in_features)
    buf = 4 * s * t * r
    if layout == "column":
        return LayoutBytes(a * w * (s * r * inp + r * out // n), 0, 0)
    if layout == "column_gather":
        return LayoutBytes(a * w * (s * r * inp // n + r * out // n), (n - 1) * buf // n, buf)
    if layout == "row_reduce":
        return LayoutBytes(a * w * (s * r * inp // n + r * out // n), 2 * (n - 1) * buf // n, buf)
    if layout == "row_partial":
        return LayoutBytes(a * w * (s * r * inp // n + r * out), 0, 0)
    return LayoutBytes(t * r * w + a * w * out * r, 0, 0)          # vocab


def choose_layout(kind: str, *, tokens: int, active: int, slices: Sequence[int], in_features: int, rank: int,
                  shards: int, itemsize: int) -> str:
    """The layout of `kind` that moves the fewest bytes (`layer_bytes`); a tie keeps the first
    (the one without a collective, or the default), and layouts the sizes cannot split are skipped."""
    best = None
    for layout in _layouts_by_preference(kind):
        if split_problem(kind, layout, slices, in_features, rank, shards) is not None:
            continue
        total = layer_bytes(kind, layout, tokens=tokens, active=active, slices=slices, in_features=in_features,
                            rank=rank, shards=shards, itemsize=itemsize).total
        if best is None or total < best[1]:
            best = (layout, total)
    if best is None:
        problem = split_problem(kind, LAYOUTS[kind][0], slices, in_features, rank, shards)
        raise ValueError(f"no {kind} layout splits slices {tuple(slices)}, in_features {in_features}, rank {rank} "
                         f"over {shards} devices: {problem}")
    return best[0]


def _layouts_by_preference(kind: str) -> tuple:
    """Tie order: the layout without a LoRA collective first."""
    return {"column": ("column", "column_gather"), "row": ("row_partial", "row_reduce"), "embed": ("vocab",),
            "logits": ("column", "column_gather")}[kind]


def check_layout(kind: str, layout: str) -> None:
    if kind not in LAYOUTS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    if layout not in LAYOUTS[kind]:
        raise ValueError(f"layout for a {kind} layer must be one of {LAYOUTS[kind]}, got {layout!r}")


def split_problem(kind: str, layout: str, slices: Sequence[int], in_features: int, rank: int, shards: int):
    """Why the sizes cannot be split over `shards` devices in `layout`, or None."""
    n = shards
    if kind in ("column", "logits"):
        bad = [w for w in slices if w % n]
        if bad:
            return f"output slice widths {tuple(slices)} must each be divisible by {n}"
    if kind == "row":
        if in_features % n:
            return f"in_features {in_features} must be divisible by {n}"
        if len(slices) != 1:
            return f"a row-parallel layer has one output slice, got {tuple(slices)}"
        if layout == "row_reduce" and slices[0] % n:
            return f"out_features {slices[0]} must be divisible by {n} for row_reduce"
    if kind == "embed" and in_features % n:
        return f"the vocabulary {in_features} must be divisible by {n}"
    if layout == "column_gather" and rank % n:
        return f"rank {rank} must be divisible by {n} for column_gather"
    return None
