"""TPU block-shape rules, checked on the host (Pallas interpret modes do not check them).

A Pallas TPU BlockSpec maps a block of an array in HBM to a buffer in VMEM. Mosaic lays VMEM out in
(8, 128) tiles (sublanes x lanes), so it accepts a block shape only when, for the block's last two
dims (dims given as None are squeezed and count as 1):

  block[-1] % 128 == 0  or  block[-1] == array[-1]        (lanes)
  block[-2] % 8   == 0  or  block[-2] == array[-2]        (sublanes)

A 1-D block needs only the lane rule. Neither `interpret=True` nor TPU interpret mode enforces this,
so a kernel that breaks it passes every CPU test and fails to compile on a TPU; the launchers in
`jax_lora.ops.pallas_tpu` call `check_block_spec` for every operand while tracing, and the tests run
`check_blocks` over every configuration they generate.

This module checks the *rule* only. Whether a legal block is also *dense* (all 128 lanes used) is a
performance question answered by `lane_utilization`.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

__all__ = ["LANES", "SUBLANES", "BlockShapeError", "BlockUse", "block_shape_problem",
           "check_block_spec", "check_blocks", "lane_utilization"]

LANES = 128
SUBLANES = 8


class BlockShapeError(ValueError):
    """A block shape that Mosaic would reject."""


@dataclass(frozen=True)
class BlockUse:
    """One operand of one pallas_call: the array's shape and the block shape its BlockSpec uses."""

    name: str
    array_shape: tuple
    block_shape: tuple  # entries: int or None (squeezed dim)


def _dims(block_shape: Sequence[int | None]) -> tuple:
    return tuple(1 if d is None else int(d) for d in block_shape)


def block_shape_problem(array_shape: Sequence[int], block_shape: Sequence[int | None]) -> str | None:
    """None when the block is legal for the array, else a sentence saying which rule breaks."""
    array_shape, block = tuple(int(d) for d in array_shape), _dims(block_shape)
    if len(array_shape) != len(block):
        return f"block rank {len(block)} differs from array rank {len(array_shape)}"
    if not array_shape:
        return None
    for i, (b, a) in enumerate(zip(block, array_shape)):
        if b < 1 or b > a:
            return f"block dim {i} is {b}, outside 1..{a} (the array's dim)"
    lane_b, lane_a = block[-1], array_shape[-1]
    if lane_b % LANES and lane_b != lane_a:
        return (f"last block dim {lane_b} is neither a multiple of {LANES} nor the array's last dim "
                f"{lane_a}")
    if len(block) >= 2:
        sub_b, sub_a = block[-2], array_shape[-2]
        if sub_b % SUBLANES and sub_b != sub_a:
            return (f"second-to-last block dim {sub_b} is neither a multiple of {SUBLANES} nor the "
                    f"array's dim {sub_a}")
    return None


def check_block_spec(name: str, array_shape: Sequence[int], block_shape: Sequence[int | None]) -> None:
    """Raises BlockShapeError naming the operand when its block breaks the TPU rules."""
    problem = block_shape_problem(array_shape, block_shape)
    if problem is not None:
        raise BlockShapeError(f"{name}: block {tuple(block_shape)} for array {tuple(array_shape)}: "
                              f"{problem}")


def check_blocks(uses: Iterable[BlockUse]) -> int:
    """Checks every BlockUse; returns how many were checked."""
    n = 0
    for u in uses:
        check_block_spec(u.name, u.array_shape, u.block_shape)
        n += 1
    return n


def lane_utilization(block_shape: Sequence[int | None]) -> float:
    """Fraction of the 128 lanes the block's last dim fills once Mosaic pads it to whole lane tiles."""
    last = _dims(block_shape)[-1]
    return last / (-(-last // LANES) * LANES)
