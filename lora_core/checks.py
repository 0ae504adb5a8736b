"""Argument checks shared by both sides (contract section 6), on shapes and dtype names only.

Framework-free: callers pass shapes as tuples and dtypes as their string names, so the same
messages come from `jax_lora` and `torch_lora`. Every error names the argument, what was expected
and what was received.
"""

from __future__ import annotations

import logging
import math
import numbers
import operator
from collections.abc import Sequence
from typing import Any

import numpy as np

from .errors import AdapterError

# contract section 4: activations fp16/bf16/fp32; weights fp16/bf16 (fp32 on reference paths too),
# or fp8 e4m3 with per-output-channel float32 scales (contract section 11, `check_weight_scales`).
ACTIVATION_DTYPES = ("float16", "bfloat16", "float32")
FP8_DTYPES = ("float8_e4m3fn",)
WEIGHT_DTYPES = ("float16", "bfloat16", "float32") + FP8_DTYPES
# Weights that take no scale (the layers that keep fp8 out: tensor-parallel, experts), and LoRA
# biases and DoRA column scales: 16-bit or float32, never fp8.
UNSCALED_WEIGHT_DTYPES = ("float16", "bfloat16", "float32")
VECTOR_DTYPES = UNSCALED_WEIGHT_DTYPES
# contract section 11: the largest finite e4m3 value, what a channel's amax maps to.
FP8_MAX = 448.0
INDEX_DTYPES = ("int32", "int64", "int16", "int8", "uint8")
# contract section 4: the shrink buffer (add_lora_linear's and add_lora_logits' `buffer`) is float32.
SHRINK_BUFFER_DTYPES = ("float32",)
# contract section 1: indices are int32 on every device.
INT32_MIN, INT32_MAX = -(2 ** 31), 2 ** 31 - 1
# Backends whose kernels need a rank of at least this (a zero-width rank block cannot be tiled).
MIN_RANK = {"pallas_tpu": 1}


def dtype_name(dtype: Any) -> str:
    """'torch.bfloat16' / dtype('bfloat16') / jnp.bfloat16 -> 'bfloat16'."""
    name = getattr(dtype, "name", None) if not isinstance(dtype, str) else dtype
    if name is None:
        name = str(dtype)
    return str(name).replace("torch.", "")


def check_dtype(name: str, dtype: Any, allowed: Sequence[str]) -> None:
    got = dtype_name(dtype)
    if got not in allowed:
        raise TypeError(f"{name} must have dtype in {tuple(allowed)}, got {got}")


def check_ndim(name: str, shape: Sequence[int], ndims: Sequence[int], meaning: str) -> None:
    if len(shape) not in ndims:
        raise ValueError(f"{name} must be {meaning}, got shape {tuple(shape)}")


def weight_dims(name: str, shape: Sequence[int], what: str) -> tuple[int, int, int]:
    """A stacked weight's (num_slots, rows, cols); accepts (L, 1, a, b) and (L, a, b)."""
    shape = tuple(int(s) for s in shape)
    if len(shape) == 4 and shape[1] == 1:
        return shape[0], shape[2], shape[3]
    if len(shape) == 3:
        return shape
    raise ValueError(f"{name} must have shape (num_slots, 1, {what}) or (num_slots, {what}), "
                     f"got {shape}")


def check_has_slots(name: str, num_slots: int, shape: Sequence[int]) -> None:
    """A stacked weight holds at least one slot (slot 0 is where a mapping's first adapter goes)."""
    if num_slots < 1:
        raise ValueError(f"{name} must hold at least one slot (num_slots >= 1), got shape {tuple(shape)}")


def check_slot_counts(num_slots_a: int, num_slots_b: int, arg_a="lora_a_stacked", arg_b="lora_b_stacked") -> None:
    """A and B of one layer hold the same slots (slot i of both is one adapter)."""
    if num_slots_a != num_slots_b:
        raise ValueError(f"{arg_a} has {num_slots_a} slots but {arg_b} has {num_slots_b}: slot i of both "
                         "holds one adapter, so the counts must be equal")


def check_single_weight(**named) -> None:
    """Arguments that take one stacked weight (add_lora_logits' A and B: one slice), not a sequence."""
    for name, value in named.items():
        if isinstance(value, (list, tuple)):
            raise TypeError(f"{name} must be one stacked weight (num_slots, [1,] rows, cols), not a "
                            f"{type(value).__name__} of {len(value)}: this method has one slice")


def check_slice_buffers(shapes: Sequence[Sequence[int]], name: str = "x") -> None:
    """`name` given as a sequence of per-slice buffers: each (num_tokens, rank), all one shape."""
    if len(shapes) == 0:
        raise ValueError(f"{name} as a sequence must hold one (num_tokens, rank) buffer per slice, got none")
    for i, shape in enumerate(shapes):
        if len(shape) != 2 or tuple(shape) != tuple(shapes[0]):
            raise ValueError(f"{name}[{i}] has shape {tuple(shape)}, but {name}[0] has {tuple(shapes[0])}: every "
                             "slice's buffer must be 2-D (num_tokens, rank), all of one shape")


def check_shrink(x_shape, x_dtype, a_shapes, a_dtypes, arg_x="x", arg_a="lora_a_stacked") -> tuple[int, int, int]:
    """Checks x (T, H) against lora_a slices (L, [1,] r, H); returns (num_slots, rank, hidden)."""
    check_ndim(arg_x, x_shape, (2,), "2-D (num_tokens, hidden_size)")
    check_dtype(arg_x, x_dtype, ACTIVATION_DTYPES)
    if len(a_shapes) == 0:
        raise ValueError(f"{arg_a} must hold at least one slice, got none")
    hidden = int(x_shape[1])
    if hidden < 1:
        raise ValueError(f"{arg_x} must have a hidden size >= 1, got shape {tuple(x_shape)}")
    dims = []
    for s, (shape, dtype) in enumerate(zip(a_shapes, a_dtypes)):
        nm = f"{arg_a}[{s}]"
        check_dtype(nm, dtype, WEIGHT_DTYPES)
        num_slots, rank, h = weight_dims(nm, shape, "rank, hidden_size")
        check_has_slots(nm, num_slots, shape)
        if h != hidden:
            raise ValueError(f"{nm} has hidden size {h} (shape {tuple(shape)}), but {arg_x} has hidden "
                             f"size {hidden} (shape {tuple(x_shape)})")
        dims.append((num_slots, rank))
    if len(set(dims)) != 1:
        raise ValueError(f"every slice of {arg_a} must have the same (num_slots, rank), got {dims}")
    return dims[0][0], dims[0][1], hidden


def is_fp8(dtype: Any) -> bool:
    """Whether a weight dtype is fp8 (e4m3): such a weight needs channel scales."""
    return dtype_name(dtype) in FP8_DTYPES


def check_weight_scales(name: str, scales: Sequence[Any] | None, weight_shapes: Sequence[Sequence[int]],
                        weight_dtypes: Sequence[Any], arg_w: str) -> tuple:
    """Checks the fp8 scales of a stacked weight's slices (contract section 11).

    scales: None, or one entry per slice: None, or (shape, dtype) of that slice's scale.
    weight_shapes: (L, [1,] rows, cols) per slice; a slice's channels are its rows (A: the rank,
    B: the output columns). A slice's scale is given iff its weight is fp8; it is float32,
    (L, rows) per channel or (L,) per tensor (one per slot).
    Returns per slice None (16-bit weight), "channel" or "tensor". ValueError naming `name` (and
    the slice) otherwise.
    """
    n = len(weight_shapes)
    if scales is not None and len(scales) != n:
        raise ValueError(f"{name} must hold one entry per slice of {arg_w} ({n}), got {len(scales)}")
    kinds = []
    for s in range(n):
        entry = None if scales is None else scales[s]
        label = name if n == 1 else f"{name}[{s}]"
        wlabel = arg_w if n == 1 else f"{arg_w}[{s}]"
        num_slots, rows, _ = weight_dims(wlabel, weight_shapes[s], "rows, cols")
        want = f"({num_slots}, {rows}) per channel or ({num_slots},) per tensor, float32"
        if not is_fp8(weight_dtypes[s]):
            if entry is not None:
                raise ValueError(f"{label} is given, but {wlabel} is {dtype_name(weight_dtypes[s])}, not fp8 "
                                 f"({FP8_DTYPES[0]}): only fp8 weights take scales")
            kinds.append(None)
            continue
        if entry is None:
            raise ValueError(f"{wlabel} is {FP8_DTYPES[0]}: {label} must give its scales, {want}")
        shape, dtype = tuple(int(d) for d in entry[0]), entry[1]
        if dtype_name(dtype) != "float32":
            raise ValueError(f"{label} must be float32 ({want}), got dtype {dtype_name(dtype)}")
        if shape == (num_slots, rows):
            kinds.append("channel")
        elif shape == (num_slots,):
            kinds.append("tensor")
        else:
            raise ValueError(f"{label} must have shape {want}, got shape {shape}")
    return tuple(kinds)


def check_expert_scales(name: str, scales: Sequence[Any] | None, weight_shapes: Sequence[Sequence[int]],
                        weight_dtypes: Sequence[Any], arg_w: str) -> tuple:
    """Checks the fp8 scales of the MoE LoRA op's stacked expert weights (contract sections 9, 11).

    scales: None, or one entry per slice: None, or (shape, dtype) of that slice's scale.
    weight_shapes: (L, E, rows, cols) per slice; a slice's channels are its rows (A: the rank, B:
    the output columns). The slices of one argument share one weight dtype (a launch reads them
    alike). A slice's scale is given iff its weight is fp8; it is float32, (L, E, rows) per
    channel or (L,) per tensor (one per slot, every expert). Returns per slice None (16-bit),
    "channel" or "tensor". ValueError naming `name` (and the slice) otherwise.
    """
    n = len(weight_shapes)
    if len({is_fp8(d) for d in weight_dtypes}) > 1:
        raise ValueError(f"the slices of {arg_w} must be all fp8 ({FP8_DTYPES[0]}) or all 16-bit, got "
                         f"{[dtype_name(d) for d in weight_dtypes]}")
    if scales is not None and len(scales) != n:
        raise ValueError(f"{name} must hold one entry per slice of {arg_w} ({n}), got {len(scales)}")
    kinds = []
    for s in range(n):
        entry = None if scales is None else scales[s]
        label = name if n == 1 else f"{name}[{s}]"
        wlabel = arg_w if n == 1 else f"{arg_w}[{s}]"
        num_slots, experts, rows = (int(d) for d in weight_shapes[s][:3])
        want = f"({num_slots}, {experts}, {rows}) per channel or ({num_slots},) per tensor, float32"
        if not is_fp8(weight_dtypes[s]):
            if entry is not None:
                raise ValueError(f"{label} is given, but {wlabel} is {dtype_name(weight_dtypes[s])}, not fp8 "
                                 f"({FP8_DTYPES[0]}): only fp8 weights take scales")
            kinds.append(None)
            continue
        if entry is None:
            raise ValueError(f"{wlabel} is {FP8_DTYPES[0]}: {label} must give its scales, {want}")
        shape, dtype = tuple(int(d) for d in entry[0]), entry[1]
        if dtype_name(dtype) != "float32":
            raise ValueError(f"{label} must be float32 ({want}), got dtype {dtype_name(dtype)}")
        if shape == (num_slots, experts, rows):
            kinds.append("channel")
        elif shape == (num_slots,):
            kinds.append("tensor")
        else:
            raise ValueError(f"{label} must have shape {want}, got shape {shape}")
    return tuple(kinds)


def check_expand(buf_shape, buf_dtype, b_shapes, b_dtypes, y_shape, y_dtype, offset_start: int,
                 arg_buf="x", arg_b="lora_b_stacked", arg_y="y") -> tuple[int, int, list[int]]:
    """Checks buf (S, T, r), lora_b slices (L, [1,] n_s, r) and y (T, N).

    Returns (num_slots, rank, slice widths). The slices must fit: offset_start + sum(n_s) <= N.
    """
    check_ndim(arg_buf, buf_shape, (3,), "3-D (num_slices, num_tokens, rank)")
    check_dtype(arg_buf, buf_dtype, ACTIVATION_DTYPES)
    check_ndim(arg_y, y_shape, (2,), "2-D (num_tokens, out_features)")
    check_dtype(arg_y, y_dtype, ACTIVATION_DTYPES)
    num_slices, num_tokens, rank = (int(v) for v in buf_shape)
    if num_slices != len(b_shapes):
        raise ValueError(f"{arg_buf} has {num_slices} slices (shape {tuple(buf_shape)}), but {arg_b} "
                         f"has {len(b_shapes)}")
    if int(y_shape[0]) != num_tokens:
        raise ValueError(f"{arg_y} has {y_shape[0]} rows (shape {tuple(y_shape)}), but {arg_buf} has "
                         f"{num_tokens} tokens (shape {tuple(buf_shape)})")
    widths, slots = [], set()
    for s, (shape, dtype) in enumerate(zip(b_shapes, b_dtypes)):
        nm = f"{arg_b}[{s}]"
        check_dtype(nm, dtype, WEIGHT_DTYPES)
        num_slots, n, r = weight_dims(nm, shape, "out_features, rank")
        check_has_slots(nm, num_slots, shape)
        if r != rank:
            raise ValueError(f"{nm} has rank {r} (shape {tuple(shape)}), but {arg_buf} has rank {rank} "
                             f"(shape {tuple(buf_shape)}): A and B ranks differ")
        widths.append(n)
        slots.add(num_slots)
    if len(slots) != 1:
        raise ValueError(f"every slice of {arg_b} must have the same number of slots, got {sorted(slots)}")
    offset_start = as_offset("offset_start", offset_start)
    if offset_start + sum(widths) > int(y_shape[1]):
        raise ValueError(f"offset_start {offset_start} + slice widths {widths} = "
                         f"{offset_start + sum(widths)} exceed {arg_y}'s {y_shape[1]} columns")
    return slots.pop(), rank, widths


def as_offset(name: str, value: Any) -> int:
    """A column offset as a Python int >= 0; any integral scalar (int, NumPy integer, 0-d integer
    tensor or array) is accepted, bools and floats are not."""
    if isinstance(value, bool):
        raise TypeError(f"{name} must be an integer >= 0, got bool {value!r}")
    try:
        offset = operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be an integer >= 0, got {type(value).__name__} {value!r}") from None
    if offset < 0:
        raise ValueError(f"{name} must be an integer >= 0, got {offset}")
    return offset


def as_scale(scale: Any) -> float:
    """The LoRA scale as a finite Python float; None, strings and arrays of several values are
    refused (TypeError), and so are NaN and infinities (ValueError: every LoRA term would be
    non-finite)."""
    if scale is None or isinstance(scale, (str, bytes)):
        raise TypeError(f"scale must be a real number (e.g. 1.0), got {type(scale).__name__} {scale!r}")
    try:
        value = float(scale)
    except (TypeError, ValueError) as e:
        raise TypeError(f"scale must be a real number (e.g. 1.0), got {type(scale).__name__}: {e}") from e
    if not math.isfinite(value):
        raise ValueError(f"scale must be a finite real number, got {value}")
    return value


def check_lora_ranks_values(name: str, lo: int, slot: int) -> None:
    """lo: the smallest entry of host `lora_ranks` values, at `slot`. A rank is >= 0 (0: the slot
    adds nothing); a negative one would act as 0 in silence."""
    if lo < 0:
        raise ValueError(f"{name} must hold ranks >= 0 (each slot's real rank, 0 for a slot that adds nothing), "
                         f"got {lo} for slot {slot}")


def first_repeat(ids: Sequence[Any], label: str, why: str) -> tuple[int, int] | None:
    """(i, j), j < i, for the first id equal to an earlier one (ids[i] == ids[j]), or None.
    An unhashable id is a TypeError naming `label.format(i)` and saying `why` it must hash."""
    first: dict = {}
    for i, rid in enumerate(ids):
        try:
            j = first.setdefault(rid, i)
        except TypeError:
            raise TypeError(f"{label.format(i)} must be hashable ({why}), got "
                            f"{type(rid).__name__} {rid!r:.80}") from None
        if j != i:
            return i, j
    return None


def check_output_slices(output_slices: Sequence[int], num_b: int, arg_b="lora_b_stacked") -> tuple[int, ...]:
    if output_slices is None or isinstance(output_slices, (str, bytes)):
        raise TypeError(f"output_slices must be a sequence of ints (one width per slice), got {output_slices!r}")
    try:
        slices = tuple(operator.index(s) for s in output_slices)
    except TypeError:
        raise TypeError(f"output_slices must be a sequence of ints (one width per slice), got "
                        f"{output_slices!r}") from None
    if len(slices) != num_b:
        raise ValueError(f"len(output_slices) = {len(slices)} but {arg_b} has {num_b} slices")
    if any(s <= 0 for s in slices):
        raise ValueError(f"output_slices must be positive widths, got {slices}")
    return slices


def check_slice_widths(output_slices: Sequence[int], widths: Sequence[int], arg_b="lora_b_stacked") -> None:
    if tuple(output_slices) != tuple(widths):
        raise ValueError(f"output_slices {tuple(output_slices)} differ from the widths of {arg_b}: "
                         f"{tuple(widths)}")


def check_bias(bias_shapes: Sequence[Sequence[int] | None], output_slices: Sequence[int],
               num_slots: int, arg="lora_bias_stacked", bias_dtypes: Sequence[Any] | None = None) -> None:
    """Bias entries (None, or (L, n_s) / (L, 1, n_s)) against the slices; dtypes, when given, must be
    weight dtypes (a float dtype: an integer bias would be reinterpreted or refused by a kernel)."""
    if len(bias_shapes) != len(output_slices):
        raise ValueError(f"{arg} has {len(bias_shapes)} slices, but output_slices has {len(output_slices)}")
    for s, (shape, width) in enumerate(zip(bias_shapes, output_slices)):
        if shape is None:
            continue
        if bias_dtypes is not None:
            check_dtype(f"{arg}[{s}]", bias_dtypes[s], VECTOR_DTYPES)
        shape = tuple(int(v) for v in shape)
        core = shape if len(shape) == 2 else (shape[0], shape[2]) if len(shape) == 3 and shape[1] == 1 else None
        if core is None or core != (num_slots, width):
            raise ValueError(f"{arg}[{s}] must have shape ({num_slots}, {width}) or ({num_slots}, 1, "
                             f"{width}), got {shape}")


def check_dora_scales(scale_shapes: Sequence[Sequence[int] | None], scale_dtypes: Sequence[Any],
                      output_slices: Sequence[int], num_slots: int,
                      bias_present: Sequence[bool] | None = None, arg="dora_scale_stacked") -> None:
    """DoRA column scales (lora_core.dora): one entry per slice, each None or (L, n_s) / (L, 1, n_s)
    of a float dtype. bias_present, when given, says per slice whether a LoRA bias is given too:
    a slice takes one or the other (the kernels' epilogue holds one vector; a DoRA adapter has no
    LoRA bias in PEFT)."""
    if len(scale_shapes) != len(output_slices):
        raise ValueError(f"{arg} must have one entry per slice ({len(output_slices)}), got {len(scale_shapes)}")
    for s, (shape, width) in enumerate(zip(scale_shapes, output_slices)):
        if shape is None:
            continue
        check_dtype(f"{arg}[{s}]", scale_dtypes[s], VECTOR_DTYPES)
        shape = tuple(int(v) for v in shape)
        if shape not in ((num_slots, width), (num_slots, 1, width)):
            raise ValueError(f"{arg}[{s}] must have shape ({num_slots}, {width}) or ({num_slots}, 1, {width}) "
                             f"(slots, the slice's width), got {shape}")
        if bias_present is not None and bias_present[s]:
            raise ValueError(f"slice {s} has both a LoRA bias (lora_bias_stacked[{s}]) and a DoRA column scale "
                             f"({arg}[{s}]); a slice takes one (a DoRA adapter has no LoRA bias in PEFT)")


def check_indices(name: str, shape: Sequence[int], dtype: Any, num_tokens: int | None = None) -> None:
    check_ndim(name, shape, (1,), "1-D (one index per token)")
    check_dtype(name, dtype, INDEX_DTYPES)
    if num_tokens is not None and int(shape[0]) < num_tokens:
        raise ValueError(f"{name} has {shape[0]} entries but there are {num_tokens} tokens")


def check_index_values(name: str, lo: int, hi: int, num_slots: int, arg_w: str) -> None:
    """lo/hi: min and max of an index array (host values). Valid: -1 .. num_slots-1."""
    if lo < -1:
        raise ValueError(f"{name} holds {lo}; indices must be -1 (no LoRA) or a slot 0..{num_slots - 1}")
    if hi >= num_slots:
        raise ValueError(f"{name} holds slot {hi}, but {arg_w} has only {num_slots} slots "
                         f"(0..{num_slots - 1})")


def check_int32_range(name: str, lo: int, hi: int) -> None:
    """lo/hi: min and max of host integer values that become int32 (contract section 1). A value outside
    int32 would wrap around in the conversion (2**32 + 1 would become 1), so it is refused."""
    for v in (lo, hi):
        if not INT32_MIN <= v <= INT32_MAX:
            wrapped = (v - INT32_MIN) % 2 ** 32 + INT32_MIN
            raise ValueError(f"{name} holds {v}, outside the int32 range [{INT32_MIN}, {INT32_MAX}]: indices are "
                             f"int32 on every device, and converting it would wrap it to {wrapped}")


def check_backend_rank(backend: str, rank: int, arg: str) -> None:
    """Some backends cannot run every rank the others can (MIN_RANK)."""
    need = MIN_RANK.get(backend)
    if need is not None and rank < need:
        raise ValueError(f"{arg} has rank {rank}, but backend {backend!r} needs rank >= {need} (use backend='xla' "
                         "for rank-0 weights, which add nothing)")


def as_flag(name: str, value: Any) -> bool:
    """A yes/no argument such as add_inputs: a bool (NumPy's too) or the int 0 / 1; anything else
    (a string "no", None, 0.5) is a TypeError rather than read by its truth value."""
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    if isinstance(value, numbers.Integral) and value in (0, 1):
        return bool(value)
    raise TypeError(f"{name} must be a bool, got {type(value).__name__} {value!r:.80}")


def check_deterministic(deterministic: Any) -> bool:
    """The wrappers' and ops' `deterministic` flag: a bool (TypeError naming it otherwise)."""
    if not isinstance(deterministic, bool):
        raise TypeError(f"deterministic must be a bool, got {deterministic!r}")
    return deterministic


def check_capacity(name: str, count: int, capacity: int, capacity_name: str) -> None:
    if count > capacity:
        raise ValueError(f"{name} has {count} entries, more than {capacity_name}={capacity}")


def check_embedding_rows(name: str, num_embeddings: int, step_rows) -> None:
    """An embedding of `num_embeddings` rows against the vocab_size + extra_vocab_size its step was
    prepared with (`step_rows`; None: unknown, not checked): embeddings_indices[1] = slot * that
    sum, so another row count would read other slots' rows."""
    if step_rows is not None and step_rows != num_embeddings:
        raise ValueError(f"{name} has {num_embeddings} rows, but the step's metadata was prepared with vocab_size + "
                         f"extra_vocab_size = {step_rows}: pass vocab_size={num_embeddings} (and extra_vocab_size=0) "
                         "to update_metadata")


def check_wrapper_sizes(*, options: dict, logger: str, **sizes) -> None:
    """PunicaWrapper's constructor arguments: positive ints. Other keywords are accepted and
    ignored, as vLLM's wrappers do (`**kwargs`: an engine may pass its own), with a warning on
    `logger` that names them (a misspelt `backend=` must not go unnoticed)."""
    for name, v in sizes.items():
        if not isinstance(v, numbers.Integral) or isinstance(v, bool) or v < 1:  # NumPy ints are Integral
            raise ValueError(f"{name} must be an int >= 1, got {v!r}")
    if options:
        logging.getLogger(logger).warning("PunicaWrapper ignores the keyword arguments %s (it takes max_loras, "
                                          "backend and deterministic)", sorted(options))


def check_seed_slice(y_offset: Any, y_slice_size: Any, width: int, y_shape: Sequence[int],
                     arg_w: str = "w_t_all") -> None:
    """expand_slice (TPU seed): y_offset >= 0, y_slice_size equal to the weight's width, and the
    slice [y_offset, y_offset + y_slice_size) inside y's columns."""
    for name, v in (("y_offset", y_offset), ("y_slice_size", y_slice_size)):
        if not isinstance(v, numbers.Integral) or isinstance(v, bool) or v < 0:
            raise ValueError(f"{name} must be an int >= 0, got {v!r}")
    if int(y_slice_size) != width:
        raise ValueError(f"y_slice_size is {y_slice_size}, but {arg_w} has {width} output rows")
    if int(y_offset) + width > int(y_shape[-1]):
        raise ValueError(f"y_offset {y_offset} + y_slice_size {y_slice_size} = {int(y_offset) + width} exceed "
                         f"y's {y_shape[-1]} columns (shape {tuple(y_shape)})")


def check_seed_expand(x_shape, x_dtype, w_shape, w_dtype, y_shape, y_dtype, arg_w: str = "w_t_all") -> int:
    """expand / expand_slice (TPU seed): x (T, r), the weight (L, [1,] n, r), y (T, N). Returns n."""
    check_ndim("x", x_shape, (2,), "2-D (num_tokens, rank)")
    check_dtype("x", x_dtype, ACTIVATION_DTYPES)
    check_ndim("y", y_shape, (2,), "2-D (num_tokens, out_features)")
    check_dtype("y", y_dtype, ACTIVATION_DTYPES)
    check_dtype(arg_w, w_dtype, WEIGHT_DTYPES)
    _, width, rank = weight_dims(arg_w, w_shape, "out_features, rank")
    if rank != int(x_shape[1]):
        raise ValueError(f"{arg_w} has rank {rank} (shape {tuple(w_shape)}), but x has rank {x_shape[1]} "
                         f"(shape {tuple(x_shape)})")
    if int(y_shape[0]) != int(x_shape[0]):
        raise ValueError(f"y has {y_shape[0]} rows (shape {tuple(y_shape)}), but x has {x_shape[0]} tokens "
                         f"(shape {tuple(x_shape)})")
    return width


# ----------------------------------------------------------------------------- adapters placed into slots

# The largest finite value of each layer dtype an adapter's factors may be stored in.
FLOAT_MAX = {"float16": 65504.0, "bfloat16": 3.3895313892515355e38, "float32": 3.4028234663852886e38,
             "float64": 1.7976931348623157e308}


def unknown_adapter_module(label: str, module: str, names: Sequence[str]) -> str:
    """The message for an adapter module that no LoRA layer of the model holds (both frameworks)."""
    names = sorted(names)
    return (f"adapter {label} targets {module!r}, which is not a LoRA module of the model (LoRA modules: "
            f"{names[:6]}{' ...' if len(names) > 6 else ''}); add it to the model's target_modules")


def check_placed_adapter(label: str, path: str, parts: Sequence[np.ndarray], dtype: Any) -> None:
    """An adapter's factors as placed into layer `path` (lora_B with its scaling lora_alpha / r folded
    in, float32 on the host): every value finite, and within the layer dtype's range (`dtype`, any
    spelling dtype_name reads), since a larger one would be infinite once stored. Both frameworks'
    placement calls it, so they refuse the same adapters with the same message (an AdapterError)."""
    name = dtype_name(dtype)
    limit = FLOAT_MAX.get(name, FLOAT_MAX["float32"])
    for array in parts:
        if not np.all(np.isfinite(array)):
            raise AdapterError(f"adapter {label}: the factors placed in {path!r} hold NaN or infinite values (the "
                               "adapter's weights, or its scaling lora_alpha / r beyond float32)")
        largest = float(np.abs(array).max()) if array.size else 0.0
        if largest > limit:
            raise AdapterError(f"adapter {label}: the factors placed in {path!r} reach {largest:.6g} (lora_B with the "
                               f"scaling lora_alpha / r folded in), beyond the largest {name} value {limit:.6g}: they "
                               "would be infinite in the layer's dtype")


def check_dora_scale(label: str, path: str, scale: np.ndarray) -> None:
    """A DoRA column scale g = m / ||W + s B A||_row placed into layer `path`: every value finite
    (a NaN or infinite magnitude, or base weights that are not finite, make it NaN / inf)."""
    if not np.all(np.isfinite(scale)):
        raise AdapterError(f"adapter {label}: the DoRA column scale of {path!r} holds NaN or infinite values "
                           "(magnitudes or base weights that are not finite)")
