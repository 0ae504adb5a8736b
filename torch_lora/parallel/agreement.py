"""Checking that the ranks of a tensor-parallel group agree on what must be the same on every rank:
each layer's geometry, each step's mapping, and the adapters in the slots a step uses.

Why. Every collective of the layers has a size set by `max_rank` and the token count, and the sum
over the ranks is the layer's output only when every rank holds its part of the same adapter. A
rank that differs makes gloo abort a process (a collective of another size), NCCL hang, or the
output silently wrong (a slot empty on one rank adds nothing there).

Math. Each rank describes what must agree as K int64 fields f_p = (f_p[0], ..., f_p[K-1]): small
values as they are (counts, sizes, flags), everything else as a digest (the first 8 bytes of
BLAKE2b over its canonical bytes). The group all-gathers them into a (P, K) table F, F[p] = f_p,
and every rank compares the same table: the ranks agree iff F[p, k] = F[0, k] for every p and k.

Steps (`check_fields`):
  1. f = (digest of the field names, the field values); the names' digest makes ranks running
     different checks disagree at column 0 instead of comparing unrelated numbers.
  2. One all-gather of f (K int64 on every rank: the same size everywhere whatever the values, so
     the collective itself cannot abort or hang).
  3. Every column k with more than one value is named, with the ranks holding each value (values
     shown for counts and sizes, "a different digest" for the rest), in one ValueError raised on
     every rank: all ranks see the same table, so all raise or none does.

Where the fields live: the group's backend device (a gloo group, or a group with a gloo part such
as "cpu:gloo,cuda:nccl": the host; NCCL: the current CUDA device, and reading the (P, K) table back
synchronises the host with the stream once).

Digests of tensors (`tensor_digest`): BLAKE2b over (dtype, shape, bytes), read in chunks of rows
of at most 4 MiB; a device tensor is copied to the host chunk by chunk (no full-size copy on the
device).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np
import torch
import torch.distributed as dist

from . import comm

__all__ = ["Field", "check_fields", "digest", "disagreement", "exchange", "gather_fields", "tensor_digest"]

_CHUNK_BYTES = 4 << 20


class Field(tuple):
    """(name, int64 value, shown): `shown` says whether the value means something to a reader (a
    count or a size) or is a digest."""

    def __new__(cls, name: str, value: int, shown: bool = True):
        return super().__new__(cls, (name, _int64(value), bool(shown)))


def _int64(value: int) -> int:
    value = int(value)
    return (value + 2**63) % 2**64 - 2**63


def digest(obj) -> int:
    """An int64 digest of `obj` (ints, strings, None, tuples and lists of them, NumPy arrays,
    bytes): BLAKE2b of its canonical bytes, equal on every process for equal values."""
    h = hashlib.blake2b(digest_size=8)
    _feed(h, obj)
    return int.from_bytes(h.digest(), "little", signed=True)


def _feed(h, obj) -> None:
    if isinstance(obj, np.ndarray):
        h.update(repr(("ndarray", str(obj.dtype), obj.shape)).encode())
        h.update(np.ascontiguousarray(obj).view(np.uint8).reshape(-1))
    elif isinstance(obj, (bytes, bytearray)):
        h.update(b"bytes%d:" % len(obj))
        h.update(obj)
    elif isinstance(obj, (tuple, list)):
        h.update(b"(%d:" % len(obj))
        for item in obj:
            _feed(h, item)
        h.update(b")")
    else:
        h.update(repr(obj).encode() + b";")


def tensor_digest(t) -> int:
    """An int64 digest of a tensor or NumPy array's dtype, shape and bytes (see the module docstring)."""
    if isinstance(t, np.ndarray):
        t = torch.from_numpy(t)
    h = hashlib.blake2b(digest_size=8)
    h.update(repr((str(t.dtype), tuple(t.shape))).encode())
    if t.numel():
        rows = t.reshape(1, -1) if t.dim() == 0 else t
        row_bytes = max(1, rows[0].numel() * t.element_size())
        step = max(1, _CHUNK_BYTES // row_bytes)
        with torch.no_grad():
            for i in range(0, rows.shape[0], step):
                chunk = rows[i:i + step].detach().to("cpu").contiguous().reshape(-1)
                h.update(chunk.view(torch.uint8).numpy())
    return int.from_bytes(h.digest(), "little", signed=True)


def _device(group) -> torch.device:
    backend = str(dist.get_backend(group)).lower()
    if "gloo" in backend or "mpi" in backend or "nccl" not in backend:
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())


def exchange(values: Sequence[int], group, world: int) -> np.ndarray:
    """(P, K) int64 table of every rank's `values` (K int64 each, K equal on every rank): one all-gather."""
    mine = torch.tensor([_int64(v) for v in values], dtype=torch.int64, device=_device(group))
    table = torch.empty(world * mine.numel(), dtype=torch.int64, device=mine.device)
    comm._all_gather(table, mine, group)
    return table.cpu().numpy().reshape(world, mine.numel())


def _groups(column: np.ndarray) -> list[tuple[int, list[int]]]:
    """(value, ranks holding it) for each distinct value of a table column, in order of first rank."""
    out: dict[int, list[int]] = {}
    for rank, v in enumerate(column.tolist()):
        out.setdefault(v, []).append(rank)
    return list(out.items())


def describe(name: str, column: np.ndarray, shown: bool) -> str:
    """'name: rank 0 has 8, rank 1 has 16' (or, for a digest, which ranks hold which value)."""
    parts = []
    for k, (value, ranks) in enumerate(_groups(column)):
        who = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {ranks}"
        parts.append(f"{who} {'has' if len(ranks) == 1 else 'have'} "
                     + (str(value) if shown else ("one value" if k == 0 else "a different one")))
    return f"{name}: " + ", ".join(parts)


def gather_fields(what: str, fields: Sequence[Field], group, world: int, rank: int) -> tuple[np.ndarray, list]:
    """Steps 1-2 and the comparison of step 3: ((P, K) table of every rank's field values, the
    indices of the fields that differ). Raises ValueError on every rank when the ranks run different
    checks (the field names' digests differ)."""
    names = tuple(f[0] for f in fields)
    table = exchange([digest(names)] + [f[1] for f in fields], group, world)
    if len(set(table[:, 0].tolist())) > 1:
        raise ValueError(f"tensor-parallel ranks disagree on {what}: they run different checks "
                         f"({describe('checked fields', table[:, 0], False)}); every rank must run the same "
                         f"code (this is rank {rank})")
    table = table[:, 1:]
    return table, [k for k in range(len(fields)) if len(set(table[:, k].tolist())) > 1]


def disagreement(what: str, fields: Sequence[Field], table: np.ndarray, differ: Sequence[int], rank: int,
                 hint: str = "") -> ValueError:
    """The error naming each differing field, with the ranks holding each value (step 3)."""
    bad = [describe(fields[k][0], table[:, k], fields[k][2]) for k in differ]
    return ValueError(f"tensor-parallel ranks disagree on {what}: " + "; ".join(bad)
                      + f" (this is rank {rank}; every rank raises this error){hint}")


def check_fields(what: str, fields: Sequence[Field], group, world: int, rank: int, hint: str = "") -> np.ndarray:
    """All-gathers `fields` over `group` and raises the same ValueError on every rank when any field
    differs between ranks (see the module docstring); returns the (P, K) table otherwise."""
    table, differ = gather_fields(what, fields, group, world, rank)
    if differ:
        raise disagreement(what, fields, table, differ, rank, hint)
    return table


_changes = 0


def note_change() -> None:
    """Counts a change of what the per-step check reads from the layers (a slot written, a wrapper
    installed), so that a wrapper recomputes its layers' part only after one."""
    global _changes
    _changes += 1


def changes() -> int:
    return _changes


def capturing() -> bool:
    """Whether the current CUDA stream is capturing a graph (no collective may be added then)."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()
