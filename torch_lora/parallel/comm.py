"""The collectives of the tensor-parallel LoRA layers, over a torch.distributed process group.

Every call is a blocking collective (`async_op=False`): with NCCL (torch >= 2.8) it is launched on the
current CUDA stream, so it is ordered with the kernels around it and can be captured in a CUDA graph;
with gloo (CPU) it returns when done. Shapes depend only on the arguments' shapes, never on values,
and nothing is read back to the host.

Two gathers place a rank-sized piece of each rank side by side:

  gather_rank_buffer   (S, T, r/P) per rank -> (S, T, r): rank p's piece at columns [p r/P, (p+1) r/P)
  gather_columns       (T, n) per rank      -> (T, P n):  rank p's piece at columns [p n, (p+1) n)

Both are one all-gather into a (P * first axis, ...) tensor (the pieces concatenated along their
first axis, rank p's p-th: the form every backend takes), viewed as (P, ...), and one copy that
moves the rank axis next to the columns.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["all_reduce_sum", "gather_columns", "gather_rank_buffer", "group_rank_and_size"]


def group_rank_and_size(group: dist.ProcessGroup | None) -> tuple[int, int]:
    """(this process's rank in `group`, the group's size); `group=None` is the default group."""
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("torch.distributed is not initialised: call torch.distributed.init_process_group "
                           "(nccl on GPUs, gloo on CPUs) before building tensor-parallel LoRA layers")
    if group is not None and not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"group must be a torch.distributed.ProcessGroup or None, got {type(group).__name__}")
    rank = dist.get_rank(group)
    if rank < 0:
        raise ValueError("this process is not a member of `group`")
    return rank, dist.get_world_size(group)


def all_reduce_sum(t: torch.Tensor, group) -> torch.Tensor:
    """t = sum over the group's ranks of t, in place (t contiguous)."""
    dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group)
    return t


def _all_gather(out: torch.Tensor, inp: torch.Tensor, group) -> None:
    # all_gather_single is torch >= 2.12's name for all_gather_into_tensor.
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(out, inp, group=group)


def gather_rank_buffer(buf: torch.Tensor, group, world: int) -> torch.Tensor:
    """(S, T, q) on every rank -> (S, T, world * q), rank p's buffer at columns [p q, (p + 1) q)."""
    s, t, q = buf.shape
    pieces = torch.empty((world * s, t, q), dtype=buf.dtype, device=buf.device)
    _all_gather(pieces, buf.contiguous(), group)
    return pieces.view(world, s, t, q).permute(1, 2, 0, 3).reshape(s, t, world * q)


def gather_columns(part: torch.Tensor, group, world: int) -> torch.Tensor:
    """(T, n) on every rank -> (T, world * n), rank p's part at columns [p n, (p + 1) n)."""
    t, n = part.shape
    pieces = torch.empty((world * t, n), dtype=part.dtype, device=part.device)
    _all_gather(pieces, part.contiguous(), group)
    return pieces.view(world, t, n).permute(1, 0, 2).reshape(t, world * n)
