"""Checks of the SGMV segment arguments (contract section 2, 4 and 6), shared by both sides and the bridge.

An SGMV op takes the prefill metadata (seq_start_locs (B,), seq_lengths (B,), lora_indices_per_batch
(B,), batch_size, max_length, token_nums): segment i covers tokens [seq_start_locs[i],
seq_start_locs[i] + seq_lengths[i]) of x, all with slot lora_indices_per_batch[i] (-1: no LoRA), for
i < batch_size (entries past batch_size are padding and never read).

Framework-free (NumPy only): callers pass dtypes (any object with a dtype name: a torch, NumPy or JAX
dtype), shapes as tuples and, where the values are on the host, NumPy arrays of them. What is
checked where:
  * always (host metadata, no device read): the three arrays are 1-D of one integer dtype kind (a
    float or bool array is a TypeError naming it, not truncated), of one length (ValueError naming
    the three lengths); batch_size, max_length and token_nums are integer scalars (TypeError: a float
    is not truncated, a bool is not an int);
  * when the scalars are readable (Python ints, NumPy integers, CPU tensors, concrete CPU arrays):
    each is >= 0 and batch_size <= the arrays' length (ValueError naming it);
  * when the arrays' values are on the host (NumPy, lists, CPU tensors, concrete CPU JAX arrays):
    check_segment_values: lengths >= 0, starts >= 0, every segment inside the x's tokens and no two
    segments sharing a token, slots -1 .. num_slots-1 (ValueError naming the argument).
Inside jit or on an accelerator the values are not read (that would be a host sync): the ops then
mask, as they always did: a token outside every live segment gets no LoRA, a slot out of range
contributes nothing.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import Any

import numpy as np

from .checks import dtype_name

# The three segment arrays, in the ops' argument order.
SEGMENT_ARRAYS = ("seq_start_locs", "seq_lengths", "lora_indices_per_batch")


def is_integer_dtype(dtype: Any) -> bool:
    """Whether `dtype` (a torch, NumPy or JAX dtype, or its name) is a signed or unsigned integer
    dtype; bool is not one."""
    name = dtype_name(dtype)
    return name.startswith("int") or name.startswith("uint")


def check_segment_arrays(dtypes: Sequence[Any], shapes: Sequence[Sequence[int]],
                         names: Sequence[str] = SEGMENT_ARRAYS) -> int:
    """The three segment arrays' dtypes and shapes: integer, 1-D, one length. Returns that length.

    dtypes[i] may be None for a value without a dtype that holds no entries (an empty list).
    """
    for name, dtype, shape in zip(names, dtypes, shapes):
        if dtype is not None and not is_integer_dtype(dtype):
            raise TypeError(f"{name} must have an integer dtype (int32 or int64: one entry per segment), got "
                            f"{dtype_name(dtype)}")
        if len(shape) != 1:
            raise ValueError(f"{name} must be 1-D (one entry per segment), got shape {tuple(shape)}")
    lengths = [int(shape[0]) for shape in shapes]
    if len(set(lengths)) != 1:
        got = ", ".join(f"{name} has {n}" for name, n in zip(names, lengths))
        raise ValueError(f"{', '.join(names[:-1])} and {names[-1]} must have one length (one entry per "
                         f"segment), got: {got}")
    return lengths[0]


def as_segment_array(name: str, value: Any, native: tuple) -> Any:
    """A segment array as it is when it is one of the `native` array types or NumPy (a tracer
    included), else (a list or tuple) as a NumPy array; an empty list, which has no dtype, is an
    empty int32 array. None, strings and ragged sequences are TypeErrors naming it."""
    if isinstance(value, native + (np.ndarray,)):
        return value
    if value is None or isinstance(value, (str, bytes)):
        raise TypeError(f"{name} must be a 1-D integer array (one entry per segment), got "
                        f"{type(value).__name__} {value!r}")
    try:
        arr = np.asarray(value)
    except (TypeError, ValueError, OverflowError) as e:
        raise TypeError(f"{name} must be a 1-D integer array (one entry per segment), got "
                        f"{type(value).__name__}: {e}") from None
    return arr.astype(np.int32) if arr.size == 0 else arr


def check_segment_args(arrays: Sequence[Any], batch_size: Any, max_length: Any, token_nums: Any,
                       num_tokens: int, readable) -> tuple[int, int | None]:
    """Everything an SGMV op checks without reading the arrays' values: the three arrays' dtypes
    and lengths, and the three scalars (`readable(value)`: whether a scalar can be read without a
    host sync). Returns (the arrays' length, batch_size or None where it is not readable)."""
    length = check_segment_arrays([a.dtype for a in arrays], [tuple(a.shape) for a in arrays])
    b = as_count("batch_size", batch_size, readable(batch_size))
    as_count("max_length", max_length, readable(max_length))
    check_token_nums(as_count("token_nums", token_nums, readable(token_nums)), num_tokens)
    check_batch_size(b, length)
    return length, b


def as_count(name: str, value: Any, readable: bool = True) -> int | None:
    """An integer scalar >= 0 (batch_size, max_length, token_nums): a Python int, a NumPy integer,
    or a 0-d integer array / tensor. Returns its value, or None when `readable` is False (a traced
    value, or one on an accelerator: only its dtype and shape are checked).

    A bool, a float (even integral: 2.0) or a string is a TypeError naming the argument; a negative
    value is a ValueError.
    """
    expected = f"{name} must be an int >= 0"
    if value is None or isinstance(value, (bool, np.bool_, str, bytes)):
        raise TypeError(f"{expected}, got {type(value).__name__} {value!r}")
    dtype = getattr(value, "dtype", None)
    if dtype is not None:
        shape = tuple(getattr(value, "shape", ()))
        if shape != () or not is_integer_dtype(dtype):
            raise TypeError(f"{expected}, got {type(value).__name__} of dtype {dtype_name(dtype)} and shape {shape}")
        if not readable:
            return None
    try:
        count = operator.index(value)
    except TypeError:
        raise TypeError(f"{expected}, got {type(value).__name__} {value!r}") from None
    if count < 0:
        raise ValueError(f"{expected}, got {count}")
    return count


def check_batch_size(batch_size: int | None, length: int) -> None:
    """batch_size (None: not readable, unchecked) must not exceed the segment arrays' length."""
    if batch_size is not None and batch_size > length:
        raise ValueError(f"batch_size is {batch_size}, but seq_start_locs, seq_lengths and lora_indices_per_batch "
                         f"have only {length} entries (one per segment)")


def check_token_nums(token_nums: int | None, num_tokens: int) -> None:
    """token_nums (None: not readable, unchecked) must not exceed the tokens of x."""
    if token_nums is not None and token_nums > num_tokens:
        raise ValueError(f"token_nums={token_nums} exceeds the {num_tokens} tokens of x")


def check_segment_values(starts: np.ndarray, lengths: np.ndarray, loras: np.ndarray | None, batch_size: int,
                         num_tokens: int, num_slots: int | None = None) -> None:
    """Host values of the first `batch_size` segments: a ValueError naming the argument for a
    negative length or start, a segment past the `num_tokens` tokens of x, two segments sharing a
    token, or (when `loras` and `num_slots` are given) a slot outside -1 .. num_slots-1.

    starts, lengths, loras: 1-D integer NumPy arrays of >= batch_size entries.
    """
    s = np.asarray(starts, np.int64)[:batch_size]
    n = np.asarray(lengths, np.int64)[:batch_size]
    if not batch_size:
        return
    if n.min() < 0:
        i = int(n.argmin())
        raise ValueError(f"seq_lengths must be >= 0 (tokens per segment), got {int(n[i])} for segment {i}")
    if s.min() < 0:
        i = int(s.argmin())
        raise ValueError(f"seq_start_locs must be >= 0 (a token position in x), got {int(s[i])} for segment {i}")
    ends = s + n
    if ends.max() > num_tokens:
        i = int(ends.argmax())
        raise ValueError(f"segment {i} covers tokens [{int(s[i])}, {int(ends[i])}) (seq_start_locs[{i}] + "
                         f"seq_lengths[{i}]), past the {num_tokens} tokens of x")
    live = np.flatnonzero(n > 0)  # empty segments cover no token
    order = live[np.argsort(s[live], kind="stable")]
    clash = np.flatnonzero(s[order[1:]] < ends[order[:-1]])
    if clash.size:
        i, j = int(order[clash[0]]), int(order[clash[0] + 1])
        raise ValueError(f"segments {i} [{int(s[i])}, {int(ends[i])}) and {j} [{int(s[j])}, {int(ends[j])}) "
                         "overlap (seq_start_locs, seq_lengths): each token belongs to at most one segment")
    if loras is not None:
        v = np.asarray(loras, np.int64)[:batch_size]
        if v.min() < -1:
            i = int(v.argmin())
            raise ValueError(f"lora_indices_per_batch holds {int(v[i])} for segment {i}; a segment's slot is -1 "
                             "(no LoRA) or 0 .. num_slots-1")
        if num_slots is not None and v.max() >= num_slots:
            i = int(v.argmax())
            raise ValueError(f"lora_indices_per_batch holds slot {int(v[i])} for segment {i}, but the weights have "
                             f"only {num_slots} slots (0..{num_slots - 1})")
