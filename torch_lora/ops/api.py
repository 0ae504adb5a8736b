"""Multi-LoRA ops for PyTorch (contract section 4). They write into their output tensor and return it.

vLLM's GPU argument order for the metadata-driven ops:

  lora_shrink(inputs (T,H), lora_a_weights, output_tensor (S,T,r) fp32, *meta.meta_args(T), scaling)
  lora_expand(inputs (S,T,r), lora_b_weights, output_tensor (T,N), *meta.meta_args(T),
              offset_start=0, add_inputs=False)

BGMV / SGMV, as in contract section 4 (shrink returns a new float32 tensor, expand updates y in place):

  bgmv_shrink(x (T,H), w (L,[1,]r,H), idx (T,), scale=1.0) -> (T, r)
  bgmv_expand(x (T,r), w (L,[1,]n,r), y (T,N), idx, add_inputs=True) -> y   (columns [0, min(n,N)))
  bgmv_expand_slice(x, w, y, idx, y_offset, y_slice_size, add_inputs=True) -> y
  sgmv_*: BGMV with `idx` replaced by the six prefill-metadata values (seq_start_locs, seq_lengths,
          lora_indices_per_batch, batch_size, max_length, token_nums).

Every op accumulates in float32; tokens with index -1 contribute nothing. fp8 (e4m3) weights
(contract section 11) take their float32 scales as keyword arguments: `lora_a_scale` /
`lora_b_scale` (lora_shrink / lora_expand, one entry per slice) and `w_scale` (BGMV / SGMV), each
(L, rows) per output channel or (L,) per tensor (broadcast to the channels here). `backend=` forces "torch"
or "triton". `deterministic=True` (every op): a token's result is bitwise the same whatever the
batch it is in (size, position, other tokens and their adapters) and from run to run
(dispatch.deterministic_impl; docs/api.md, "Deterministic mode"). Index *values* are checked when
the indices are CPU tensors; on CUDA that would need a host sync, so out-of-range indices are
masked instead (never read or written out of bounds).
SGMV segment arguments: dtypes, lengths and the integer scalars are checked on every call; the
segments' values (lengths and starts >= 0, inside x's tokens, not overlapping, valid slots) when the
arrays are on the host (lists, NumPy, CPU tensors); on CUDA they are masked (segment_indices).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from lora_core import checks, segments
from lora_core.kernel_meta import KernelMeta

from ..meta import LoRAKernelMeta
from . import dispatch
from .moe import fused_moe_lora, moe_lora_align_block_size  # noqa: F401 - re-exported with the other ops

__all__ = ["lora_shrink", "lora_expand", "bgmv_shrink", "bgmv_expand", "bgmv_expand_slice",
           "sgmv_shrink", "sgmv_expand", "sgmv_expand_slice"]


# ----------------------------------------------------------------------------- helpers

def as_slices(name: str, stacked) -> tuple:
    if isinstance(stacked, (list, tuple)):
        if len(stacked) and any(w is None for w in stacked):
            raise ValueError(f"{name} holds None; every slice needs weights")
        return tuple(stacked)
    return (stacked,)


def to_3d(w: torch.Tensor) -> torch.Tensor:
    """(L, 1, a, b) -> (L, a, b) view; 3-D unchanged."""
    return w.squeeze(1) if w.dim() == 4 else w


def check_tensors(**named) -> None:
    """Every value must be a tensor, and all on one device."""
    devices = {}
    for name, value in named.items():
        items = value if isinstance(value, (list, tuple)) else (value,)
        for i, t in enumerate(items):
            if t is None:
                continue
            label = name if len(items) == 1 else f"{name}[{i}]"
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{label} must be a torch.Tensor, got {type(t).__name__}")
            devices.setdefault(t.device, label)
    if len(devices) > 1:
        desc = ", ".join(f"{label} on {dev}" for dev, label in devices.items())
        raise ValueError(f"tensors are on different devices: {desc}")


def require_tensors(**named) -> None:
    """Every value must be a torch.Tensor (None included: these arguments have no default), so a
    missing or list argument is a TypeError naming it rather than an AttributeError later."""
    for name, value in named.items():
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")


def check_index_values(name: str, idx: torch.Tensor, num_slots: int, arg_w: str) -> None:
    """Checks CPU index values (-1 .. num_slots-1); on CUDA nothing is read (no host sync)."""
    if idx.device.type == "cpu" and idx.numel():
        checks.check_index_values(name, int(idx.min()), int(idx.max()), num_slots, arg_w)


def _check_meta_args(token_lora_mapping, token_indices_sorted_by_lora_ids, num_tokens_per_lora,
                     lora_token_start_loc, lora_ids, num_tokens: int, num_slots: int, arg_w: str):
    for name, t in (("token_lora_mapping", token_lora_mapping),
                    ("token_indices_sorted_by_lora_ids", token_indices_sorted_by_lora_ids),
                    ("num_tokens_per_lora", num_tokens_per_lora),
                    ("lora_token_start_loc", lora_token_start_loc), ("lora_ids", lora_ids)):
        checks.check_ndim(name, t.shape, (1,), "1-D")
        if t.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"{name} must be int32 (or int64), got {t.dtype}")
    if token_lora_mapping.shape[0] < num_tokens or token_indices_sorted_by_lora_ids.shape[0] < num_tokens:
        raise ValueError(f"token_lora_mapping / token_indices_sorted_by_lora_ids cover "
                         f"{token_lora_mapping.shape[0]} / {token_indices_sorted_by_lora_ids.shape[0]} "
                         f"tokens, but the inputs have {num_tokens}")
    if lora_token_start_loc.shape[0] != lora_ids.shape[0] + 1 or num_tokens_per_lora.shape[0] != lora_ids.shape[0]:
        raise ValueError(f"lora_ids ({lora_ids.shape[0]}), num_tokens_per_lora ({num_tokens_per_lora.shape[0]}) "
                         f"and lora_token_start_loc ({lora_token_start_loc.shape[0]}) must have lengths "
                         "K, K and K + 1")
    check_index_values("token_lora_mapping", token_lora_mapping[:num_tokens], num_slots, arg_w)


def _require_meta(token_lora_mapping, token_indices_sorted_by_lora_ids, num_tokens_per_lora,
                  lora_token_start_loc, lora_ids) -> None:
    """The five index tensors of `meta_args(T)` must be tensors (the sixth, the no-LoRA flag, is
    passed through to the backends as it is)."""
    require_tensors(token_lora_mapping=token_lora_mapping,
                    token_indices_sorted_by_lora_ids=token_indices_sorted_by_lora_ids,
                    num_tokens_per_lora=num_tokens_per_lora, lora_token_start_loc=lora_token_start_loc,
                    lora_ids=lora_ids)


def _kernel_meta(token_lora_mapping, token_indices_sorted_by_lora_ids, num_tokens_per_lora,
                 lora_token_start_loc, lora_ids, no_lora_flag) -> KernelMeta:
    """The six metadata tensors as the backends take them, a KernelMeta: the five index tensors
    contiguous (the Triton kernels read entry i at `ptr + i`, so a strided view, e.g.
    `mapping[::2]`, would give them other entries; contiguous ones, as `LoRAKernelMeta.meta_args`
    returns, are passed as they are)."""
    return KernelMeta(*(t.contiguous() for t in (token_lora_mapping, token_indices_sorted_by_lora_ids,
                                                 num_tokens_per_lora, lora_token_start_loc, lora_ids)),
                      no_lora=no_lora_flag)


def as_int32(name: str, t: torch.Tensor) -> torch.Tensor:
    """An integer tensor as int32 (contract section 1), never wrapping a 64-bit value into range: on the
    CPU, values outside int32 are refused; on an accelerator (reading them would be a host sync) they
    are saturated to the int32 bounds, which are out of range for every index, ranks and segment array
    (so they are masked, or clamped to the weights' rank, like any other out-of-range value)."""
    if t.dtype == torch.int32:
        return t
    if t.dtype in (torch.uint16, torch.uint32, torch.uint64):   # torch has no min/max for these
        raise TypeError(f"{name} must have dtype in {checks.INDEX_DTYPES}, got {checks.dtype_name(t.dtype)}")
    if t.dtype == torch.int64:
        if t.device.type == "cpu":
            if t.numel():
                lo, hi = torch.aminmax(t)
                checks.check_int32_range(name, int(lo), int(hi))
        else:
            t = t.clamp(checks.INT32_MIN, checks.INT32_MAX)
    return t.to(torch.int32)


def int32_on(name: str, values, device) -> torch.Tensor:
    """Integer values (a list, NumPy array or tensor) as an int32 tensor on `device`. Host values are
    read where they are, so an int64 beyond int32 is refused before it moves (as_int32); a tensor
    already on an accelerator is saturated there."""
    return as_int32(name, torch.as_tensor(values)).to(device)


def as_lora_ranks(lora_ranks, num_slots: int, device):
    """lora_ranks as a contiguous int32 tensor on `device` (the Triton kernels read slot i at
    `ranks_ptr + i`: a strided view, e.g. `ranks[::2]`, would give them other slots' values). Host
    values (a list, NumPy, a CPU tensor) are read: a negative rank is refused. A tensor on an
    accelerator is not read (that would be a host sync): there a negative rank acts as 0 (the slot
    adds nothing). A bool, float or complex dtype is a TypeError; a shape other than (>= num_slots,)
    a ValueError."""
    if lora_ranks is None:
        return None
    try:
        r = torch.as_tensor(lora_ranks)
    except (TypeError, ValueError, RuntimeError) as e:
        raise TypeError(f"lora_ranks must be a 1-D integer tensor (one rank per slot), got "
                        f"{type(lora_ranks).__name__}: {e}") from None
    # A bool or float tensor is refused, not cast: True would act as rank 1, 2.7 as rank 2.
    if checks.dtype_name(r.dtype) not in checks.INDEX_DTYPES:
        raise TypeError(f"lora_ranks must have an integer dtype (int32 or int64: one rank per slot), got "
                        f"{checks.dtype_name(r.dtype)}")
    if r.dim() != 1 or r.shape[0] < num_slots:
        raise ValueError(f"lora_ranks must be a 1-D integer tensor of >= {num_slots} entries (one per "
                         f"slot), got shape {tuple(r.shape)} dtype {r.dtype}")
    if r.is_cpu and r.numel() and int(r.min()) < 0:
        checks.check_lora_ranks_values("lora_ranks", int(r.min()), int(r.argmin()))
    return int32_on("lora_ranks", r, device).contiguous()


def weight_scales(name: str, scales, weights: Sequence[torch.Tensor], arg_w: str) -> tuple | None:
    """The fp8 channel scales of `weights` (S slices (L, [1,] rows, cols)) as the backends take them:
    None when no slice is fp8, else per slice None (16-bit) or an (L, rows) float32 tensor with
    contiguous channels: the given one itself when its channels are (a view such as one slice's
    columns of a fused (L, out) scale is not copied; the kernels take its slot stride), else a
    contiguous copy (an (L,) per-tensor scale broadcast to every channel). `scales`: None, one tensor (one slice) or
    a sequence with one entry per slice. Checked by `checks.check_weight_scales` (ValueError naming
    `name`); a non-tensor entry is a TypeError."""
    if scales is None and not any(w.dtype == torch.float8_e4m3fn for w in weights):
        return None                                   # 16-bit weights, no scales: nothing to check
    if scales is not None and not isinstance(scales, (list, tuple)):
        scales = (scales,)
    if scales is not None:
        for s, sc in enumerate(scales):
            if sc is not None and not isinstance(sc, torch.Tensor):
                label = name if len(scales) == 1 else f"{name}[{s}]"
                raise TypeError(f"{label} must be a torch.Tensor (float32 scales) or None, got {type(sc).__name__}")
    kinds = checks.check_weight_scales(name, None if scales is None else
                                       [None if sc is None else (tuple(sc.shape), sc.dtype) for sc in scales],
                                       [tuple(w.shape) for w in weights], [w.dtype for w in weights], arg_w)
    if all(k is None for k in kinds):
        return None
    out = []
    for w, sc, kind in zip(weights, scales, kinds):
        if kind is None:
            out.append(None)
            continue
        rows = to_3d(w).shape[1]
        full = (sc[:, None].expand(sc.shape[0], rows) if kind == "tensor" else sc).to(device=w.device)
        out.append(full if full.stride(-1) == 1 or rows == 1 else full.contiguous())
    return tuple(out)


def _offsets(offset_start: int, widths: Sequence[int]) -> tuple:
    out, off = [], offset_start
    for w in widths:
        out.append(off)
        off += w
    return tuple(out)


# ----------------------------------------------------------------------------- metadata-driven ops

def lora_shrink(inputs: torch.Tensor, lora_a_weights, output_tensor: torch.Tensor,
                token_lora_mapping: torch.Tensor, token_indices_sorted_by_lora_ids: torch.Tensor,
                num_tokens_per_lora: torch.Tensor, lora_token_start_loc: torch.Tensor,
                lora_ids: torch.Tensor, no_lora_flag: torch.Tensor, scaling: float, *,
                backend: str | None = None, lora_ranks=None, deterministic: bool = False,
                lora_a_scale=None) -> torch.Tensor:
    """output_tensor[s, t] = scaling * inputs[t] @ lora_a_weights[s][idx[t]].T (0 for idx -1).

    inputs: (T, H); lora_a_weights: S tensors (L, [1,] r, H); output_tensor: (S, T, r), written
    whole. The six metadata tensors are `LoRAKernelMeta.meta_args(T)`. lora_a_scale: the float32
    scales of fp8 slices, per slice (L, r) or (L,) (None for a 16-bit slice; `weight_scales`).
    """
    require_tensors(inputs=inputs, output_tensor=output_tensor)
    _require_meta(token_lora_mapping, token_indices_sorted_by_lora_ids, num_tokens_per_lora, lora_token_start_loc,
                  lora_ids)
    lora_a = as_slices("lora_a_weights", lora_a_weights)
    check_tensors(inputs=inputs, lora_a_weights=lora_a, output_tensor=output_tensor,
                  token_lora_mapping=token_lora_mapping, lora_a_scale=_scale_list(lora_a_scale))
    num_slots, rank, _ = checks.check_shrink(tuple(inputs.shape), inputs.dtype, [a.shape for a in lora_a],
                                             [a.dtype for a in lora_a], arg_x="inputs", arg_a="lora_a_weights")
    a_scales = weight_scales("lora_a_scale", lora_a_scale, lora_a, "lora_a_weights")
    _check_out("output_tensor", output_tensor, (len(lora_a), inputs.shape[0], rank))
    _check_meta_args(token_lora_mapping, token_indices_sorted_by_lora_ids, num_tokens_per_lora,
                     lora_token_start_loc, lora_ids, inputs.shape[0], num_slots, "lora_a_weights")
    meta = _kernel_meta(token_lora_mapping, token_indices_sorted_by_lora_ids, num_tokens_per_lora,
                        lora_token_start_loc, lora_ids, no_lora_flag)
    scaling = checks.as_scale(scaling)
    impl = dispatch.resolve(backend, inputs.device, deterministic=deterministic)
    impl.shrink(inputs, tuple(to_3d(a) for a in lora_a), output_tensor, meta, scaling,
                as_lora_ranks(lora_ranks, num_slots, inputs.device), **_kw("a_scales", a_scales))
    return output_tensor


def lora_expand(inputs: torch.Tensor, lora_b_weights, output_tensor: torch.Tensor,
                token_lora_mapping: torch.Tensor, token_indices_sorted_by_lora_ids: torch.Tensor,
                num_tokens_per_lora: torch.Tensor, lora_token_start_loc: torch.Tensor,
                lora_ids: torch.Tensor, no_lora_flag: torch.Tensor, offset_start: int = 0,
                add_inputs: bool = False, *, backend: str | None = None, lora_ranks=None,
                deterministic: bool = False, lora_b_scale=None) -> torch.Tensor:
    """output_tensor[t, off_s:off_s+n_s] = (old if add_inputs else 0) + inputs[s, t] @ B_s[idx[t]].T.

    inputs: (S, T, r); lora_b_weights: S tensors (L, [1,] n_s, r); output_tensor: (T, N), updated in
    place from column `offset_start`. Rows with idx -1 and columns outside the slices are untouched.
    lora_b_scale: the float32 scales of fp8 slices, per slice (L, n_s) or (L,) (`weight_scales`).
    """
    require_tensors(inputs=inputs, output_tensor=output_tensor)
    _require_meta(token_lora_mapping, token_indices_sorted_by_lora_ids, num_tokens_per_lora, lora_token_start_loc,
                  lora_ids)
    lora_b = as_slices("lora_b_weights", lora_b_weights)
    check_tensors(inputs=inputs, lora_b_weights=lora_b, output_tensor=output_tensor,
                  token_lora_mapping=token_lora_mapping, lora_b_scale=_scale_list(lora_b_scale))
    offset_start = checks.as_offset("offset_start", offset_start)
    num_slots, _, widths = checks.check_expand(tuple(inputs.shape), inputs.dtype, [b.shape for b in lora_b],
                                               [b.dtype for b in lora_b], tuple(output_tensor.shape),
                                               output_tensor.dtype, offset_start, arg_buf="inputs",
                                               arg_b="lora_b_weights", arg_y="output_tensor")
    _check_meta_args(token_lora_mapping, token_indices_sorted_by_lora_ids, num_tokens_per_lora,
                     lora_token_start_loc, lora_ids, output_tensor.shape[0], num_slots, "lora_b_weights")
    b_scales = weight_scales("lora_b_scale", lora_b_scale, lora_b, "lora_b_weights")
    meta = _kernel_meta(token_lora_mapping, token_indices_sorted_by_lora_ids, num_tokens_per_lora,
                        lora_token_start_loc, lora_ids, no_lora_flag)
    impl = dispatch.resolve(backend, output_tensor.device, deterministic=deterministic)
    impl.expand(inputs, tuple(to_3d(b) for b in lora_b), output_tensor, meta, _offsets(offset_start, widths),
                checks.as_flag("add_inputs", add_inputs),
                as_lora_ranks(lora_ranks, num_slots, output_tensor.device), None, **_kw("b_scales", b_scales))
    return output_tensor


def _scale_list(scales) -> tuple:
    """scales as a tuple of its tensors, for the device check (non-tensors are refused later)."""
    items = scales if isinstance(scales, (list, tuple)) else (scales,)
    return tuple(sc for sc in items if isinstance(sc, torch.Tensor))


def _kw(name: str, scales) -> dict:
    """{name: scales} for a backend call with fp8 weights; {} for 16-bit ones (backends called as
    before)."""
    return {} if scales is None else {name: scales}


def _check_out(name: str, t: torch.Tensor, shape: tuple) -> None:
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)} (num_slices, num_tokens, rank), "
                         f"got {tuple(t.shape)}")
    checks.check_dtype(name, t.dtype, checks.ACTIVATION_DTYPES)


# ----------------------------------------------------------------------------- BGMV

def _index_meta(idx: torch.Tensor, num_tokens: int, num_slots: int, arg_w: str) -> KernelMeta:
    if not isinstance(idx, torch.Tensor):
        raise TypeError(f"lora_indices_tensor must be a torch.Tensor, got {type(idx).__name__}")
    checks.check_indices("lora_indices_tensor", tuple(idx.shape), idx.dtype, num_tokens)
    check_index_values("lora_indices_tensor", idx[:num_tokens], num_slots, arg_w)
    meta = LoRAKernelMeta.make(num_slots, max(num_tokens, 1), idx.device)
    meta._fill(idx[:num_tokens])   # values checked above (CPU) or masked (device): not read twice
    return meta.meta_args(num_tokens)


def bgmv_shrink(x: torch.Tensor, w: torch.Tensor, idx: torch.Tensor, scale: float = 1.0, *,
                out: torch.Tensor | None = None, backend: str | None = None,
                lora_ranks=None, deterministic: bool = False, w_scale=None) -> torch.Tensor:
    """(T, r) float32: scale * x[t] @ w[idx[t]].T, 0 where idx[t] = -1. w: (L, [1,] r, H); w_scale:
    an fp8 w's float32 scales, (L, r) per channel or (L,) per tensor."""
    require_tensors(x=x, lora_a_weights=w)
    check_tensors(x=x, lora_a_weights=w, lora_indices_tensor=idx, out=out, w_scale=_scale_list(w_scale))
    num_slots, rank, _ = checks.check_shrink(tuple(x.shape), x.dtype, [w.shape], [w.dtype],
                                             arg_a="lora_a_weights")
    a_scales = weight_scales("w_scale", w_scale, (w,), "lora_a_weights")
    scale = checks.as_scale(scale)
    result = torch.empty((1, x.shape[0], rank), dtype=torch.float32, device=x.device)
    impl = dispatch.resolve(backend, x.device, deterministic=deterministic)
    impl.shrink(x, (to_3d(w),), result, _index_meta(idx, x.shape[0], num_slots, "lora_a_weights"), scale,
                as_lora_ranks(lora_ranks, num_slots, x.device), **_kw("a_scales", a_scales))
    if out is None:
        return result[0]
    _check_out("out", out, (x.shape[0], rank))
    return out.copy_(result[0])


def bgmv_expand(x: torch.Tensor, w: torch.Tensor, y: torch.Tensor, idx: torch.Tensor,
                add_inputs: bool = True, *, backend: str | None = None, lora_ranks=None,
                deterministic: bool = False, w_scale=None) -> torch.Tensor:
    """y[t, :c] = (y[t, :c] if add_inputs else 0) + (x[t] @ w[idx[t]].T)[:c], c = min(n, N), in place.

    x: (T, r); w: (L, [1,] n, r); y: (T, N). A LoRA output wider than y is cut to y's width (vLLM).
    w_scale: an fp8 w's float32 scales, (L, n) per channel or (L,) per tensor.
    """
    require_tensors(inputs=x, lora_b_weights=w, y=y)
    check_tensors(inputs=x, lora_b_weights=w, y=y, lora_indices_tensor=idx, w_scale=_scale_list(w_scale))
    checks.weight_dims("lora_b_weights", tuple(w.shape), "out_features, rank")
    w3 = to_3d(w)
    scales = weight_scales("w_scale", w_scale, (w3,), "lora_b_weights")
    if y.dim() == 2 and w3.shape[1] > y.shape[1]:
        w3 = w3[:, : y.shape[1]]
        scales = None if scales is None else (scales[0][:, : y.shape[1]],)
    return _expand_one(x, w3, y, idx, 0, add_inputs, backend, lora_ranks, deterministic, scales)


def bgmv_expand_slice(x: torch.Tensor, w: torch.Tensor, y: torch.Tensor, idx: torch.Tensor,
                      y_offset: int, y_slice_size: int, add_inputs: bool = True, *,
                      backend: str | None = None, lora_ranks=None, deterministic: bool = False,
                      w_scale=None) -> torch.Tensor:
    """y[t, y_offset:y_offset+y_slice_size] (+)= x[t] @ w[idx[t]].T in place; w: (L, [1,] y_slice_size, r);
    w_scale: an fp8 w's float32 scales, (L, y_slice_size) per channel or (L,) per tensor."""
    require_tensors(inputs=x, lora_b_weights=w, y=y)
    check_tensors(inputs=x, lora_b_weights=w, y=y, lora_indices_tensor=idx, w_scale=_scale_list(w_scale))
    # Types first: a y_slice_size of "16" or 16.0 is a TypeError, not a width mismatch.
    y_offset = checks.as_offset("y_offset", y_offset)
    y_slice_size = checks.as_offset("y_slice_size", y_slice_size)
    _, n, _ = checks.weight_dims("lora_b_weights", tuple(w.shape), "out_features, rank")
    if n != y_slice_size:
        raise ValueError(f"lora_b_weights has {n} output rows (shape {tuple(w.shape)}), but y_slice_size "
                         f"is {y_slice_size}")
    scales = weight_scales("w_scale", w_scale, (w,), "lora_b_weights")
    return _expand_one(x, to_3d(w), y, idx, y_offset, add_inputs, backend, lora_ranks, deterministic, scales)


def _expand_one(x, w3, y, idx, offset, add_inputs, backend, lora_ranks, deterministic=False, b_scales=None):
    if x.dim() != 2:
        raise ValueError(f"inputs must be 2-D (num_tokens, rank), got shape {tuple(x.shape)}")
    offset = checks.as_offset("y_offset", offset)
    num_slots, _, widths = checks.check_expand((1,) + tuple(x.shape), x.dtype, [w3.shape], [w3.dtype],
                                               tuple(y.shape), y.dtype, offset, arg_buf="inputs",
                                               arg_b="lora_b_weights")
    impl = dispatch.resolve(backend, y.device, deterministic=deterministic)
    impl.expand(x[None], (w3,), y, _index_meta(idx, y.shape[0], num_slots, "lora_b_weights"), (offset,),
                checks.as_flag("add_inputs", add_inputs), as_lora_ranks(lora_ranks, num_slots, y.device), None,
                **_kw("b_scales", b_scales))
    return y


# ----------------------------------------------------------------------------- SGMV
# Checks of the segment arguments (lora_core.segments): dtypes, shapes and the integer scalars on
# every call; the segments' values where they are on the host (lists, NumPy, CPU tensors). Segment
# arrays on an accelerator are not read (a host sync): there a token outside every live segment
# gets no LoRA, and a slot out of range contributes nothing.

def _segment_array(name: str, value):
    """A segment array as a tensor where it is, else `segments.as_segment_array`."""
    return segments.as_segment_array(name, value, (torch.Tensor,))


def _host_int32(name: str, value) -> torch.Tensor:
    """A checked integer segment array as int32, where it is (a NumPy array: on the CPU); values
    beyond int32 are refused on the host, saturated on an accelerator (as_int32)."""
    if isinstance(value, np.ndarray):
        if value.size:
            checks.check_int32_range(name, int(value.min()), int(value.max()))
        return torch.from_numpy(value.astype(np.int32))
    return as_int32(name, value)


def _readable(value) -> bool:
    """Whether a scalar can be read without a host sync (anything but a tensor on an accelerator)."""
    return not (isinstance(value, torch.Tensor) and value.device.type != "cpu")


def _num_slots(w) -> int | None:
    """The slot count of a stacked weight (L, [1,] a, b), or None when w is not one (checked later)."""
    shape = getattr(w, "shape", None)
    return int(shape[0]) if shape is not None and len(shape) in (3, 4) else None


def segment_indices(seq_start_locs, seq_lengths, lora_indices_per_batch, batch_size, max_length, token_nums,
                    num_tokens: int, device, num_slots: int | None = None) -> torch.Tensor:
    """(num_tokens,) int32 per-token index from SGMV segments; -1 for tokens in no segment.

    Checks the six prefill-metadata values first (lora_core.segments): the arrays' dtypes (integer)
    and lengths (equal), batch_size / max_length / token_nums (ints >= 0, batch_size at most the
    arrays' length, token_nums at most num_tokens) and, for host arrays, the segments' values
    (lengths and starts >= 0, inside the num_tokens tokens, not overlapping, slots -1 .. num_slots-1).
    """
    arrays = [_segment_array(name, v) for name, v in zip(segments.SEGMENT_ARRAYS,
                                                          (seq_start_locs, seq_lengths, lora_indices_per_batch))]
    length, b = segments.check_segment_args(arrays, batch_size, max_length, token_nums, num_tokens, _readable)
    starts, lengths, loras = (_host_int32(name, a) for name, a in zip(segments.SEGMENT_ARRAYS, arrays))
    if b is not None and all(t.device.type == "cpu" for t in (starts, lengths, loras)):
        segments.check_segment_values(starts.numpy(), lengths.numpy(), loras.numpy(), b, num_tokens, num_slots)
    starts, lengths, loras = (t.to(device) for t in (starts, lengths, loras))
    live = torch.arange(length, device=device) < (b if b is not None else batch_size.to(device))
    t = torch.arange(num_tokens, device=device, dtype=torch.int32)[:, None]
    inside = (t >= starts[None]) & (t < (starts + lengths)[None]) & live[None]
    marked = torch.where(inside, loras[None] + 1, 0)
    best = marked.max(dim=1).values if marked.shape[1] else torch.zeros(num_tokens, dtype=torch.int32,
                                                                         device=device)
    return (best - 1).to(torch.int32)


def _rows(name: str, t) -> int:
    """The token count of x / y (its first axis), checked to be a tensor first."""
    require_tensors(**{name: t})
    return t.shape[0] if t.dim() else 0


def sgmv_shrink(x, w, seq_start_locs, seq_lengths, lora_indices_per_batch, batch_size, max_length,
                token_nums, scale: float = 1.0, *, backend: str | None = None, lora_ranks=None,
                deterministic: bool = False, w_scale=None):
    """bgmv_shrink with each segment's tokens using the segment's index (prefill metadata).

    x: (T, H); w: (L, [1,] r, H); seq_start_locs / seq_lengths / lora_indices_per_batch: (B,) integer
    (tensors, NumPy arrays or lists); batch_size, max_length, token_nums: ints >= 0 (batch_size <= B,
    token_nums <= T). Returns (T, r) float32. Segment values are checked when they are on the host;
    on an accelerator they are masked instead (segment_indices).
    """
    num_tokens = _rows("x", x)
    idx = segment_indices(seq_start_locs, seq_lengths, lora_indices_per_batch, batch_size, max_length, token_nums,
                          num_tokens, x.device, _num_slots(w))
    return bgmv_shrink(x, w, idx, scale, backend=backend, lora_ranks=lora_ranks, deterministic=deterministic,
                       w_scale=w_scale)


def sgmv_expand(x, w, y, seq_start_locs, seq_lengths, lora_indices_per_batch, batch_size, max_length,
                token_nums, add_inputs: bool = True, *, backend: str | None = None, lora_ranks=None,
                deterministic: bool = False, w_scale=None):
    """bgmv_expand with each segment's tokens using the segment's index (prefill metadata).

    x: (T, r); w: (L, [1,] n, r); y: (T, N), updated in place and returned. The segment arguments
    are checked as in sgmv_shrink.
    """
    num_tokens = _rows("y", y)
    idx = segment_indices(seq_start_locs, seq_lengths, lora_indices_per_batch, batch_size, max_length, token_nums,
                          num_tokens, y.device, _num_slots(w))
    return bgmv_expand(x, w, y, idx, add_inputs, backend=backend, lora_ranks=lora_ranks,
                       deterministic=deterministic, w_scale=w_scale)


def sgmv_expand_slice(x, w, y, seq_start_locs, seq_lengths, lora_indices_per_batch, batch_size, max_length,
                      token_nums, y_offset: int, y_slice_size: int, add_inputs: bool = True, *,
                      backend: str | None = None, lora_ranks=None, deterministic: bool = False, w_scale=None):
    """bgmv_expand_slice with each segment's tokens using the segment's index.

    x: (T, r); w: (L, [1,] y_slice_size, r); y: (T, N), columns [y_offset, y_offset + y_slice_size)
    updated in place. The segment arguments are checked as in sgmv_shrink.
    """
    num_tokens = _rows("y", y)
    idx = segment_indices(seq_start_locs, seq_lengths, lora_indices_per_batch, batch_size, max_length, token_nums,
                          num_tokens, y.device, _num_slots(w))
    return bgmv_expand_slice(x, w, y, idx, y_offset, y_slice_size, add_inputs, backend=backend,
                             lora_ranks=lora_ranks, deterministic=deterministic, w_scale=w_scale)
