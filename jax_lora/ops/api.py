"""Multi-LoRA ops for JAX (contract section 4): functional, they return the result.

  lora_shrink(x (T,H), lora_a_stacked, meta, scale) -> (S, T, r) float32
  lora_expand(buf (S,T,r), lora_b_stacked, y (T,N), meta, offset_start=0, add_inputs=False) -> y
  bgmv_shrink(x (T,H), w (L,[1,]r,H), idx (T,), scale=1.0) -> (T, r) float32
  bgmv_expand(x (T,r), w (L,[1,]n,r), y (T,N), idx, add_inputs=True) -> y     (columns [0, min(n,N)))
  bgmv_expand_slice(x, w, y, idx, y_offset, y_slice_size, add_inputs=True) -> y
  sgmv_shrink / sgmv_expand / sgmv_expand_slice: as BGMV with `idx` replaced by the six prefill
      metadata values (seq_start_locs, seq_lengths, lora_indices_per_batch, batch_size, max_length,
      token_nums): every token of a segment uses the segment's index.

fp8 weights (e4m3, `jnp.float8_e4m3fn`) come with float32 per-output-channel scales (keyword-only
`lora_a_scale` / `lora_b_scale`, `w_scale` for BGMV/SGMV; (L, c) per channel or (L,) per tensor,
broadcast here): w[l, c, k] ~ scale[l, c] * float32(w_q[l, c, k]); the scale is applied once per
output channel after the float32 sum (`weight_scales`). A backend that does not apply scales hands
the call to the xla reference, said on the logger (`scale_keywords`).

Every op accumulates in float32; tokens with index -1 contribute nothing (shrink rows are 0, expand
rows are left untouched). `backend=` forces "xla", "pallas_tpu" or "triton"; None lets the device
decide. `deterministic=True` (every op): a token's result is bitwise the same whatever the batch it
is in (size, position, other tokens and their adapters) and from run to run
(dispatch.deterministic_impl; docs/api.md, "Deterministic mode"). `lora_ranks` (L,) int32,
optional: each slot's real rank; results equal the computation with the weights past that rank
zeroed.

Checks: shapes, dtypes, slices and devices are checked on every call. Host inputs (NumPy arrays)
are checked before they become jax arrays, so nothing is changed in silence: float64 activations or
weights are refused (contract section 4 dtypes; JAX would make them float32), and 64-bit integers
outside int32 are refused (JAX would wrap them). Index *values* are checked when they are concrete
and on the host CPU (NumPy arrays, CPU jax arrays); on accelerators and inside jit they cannot be
read without a host sync, so out-of-range indices are masked instead: they never read or write out
of bounds and contribute nothing. SGMV segment arguments: see segment_indices.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from lora_core import checks, segments
from lora_core.kernel_meta import KernelMeta

from ..meta import LoRAKernelMeta, build_kernel_meta
from . import dispatch, invariant
from .fused_moe import fused_moe_lora, moe_lora_align_block_size  # noqa: F401 - re-exported with the other ops

__all__ = ["lora_shrink", "lora_expand", "bgmv_shrink", "bgmv_expand", "bgmv_expand_slice",
           "sgmv_shrink", "sgmv_expand", "sgmv_expand_slice"]

ArrayLike = jax.Array | np.ndarray
_LOG = logging.getLogger("jax_lora")


# ----------------------------------------------------------------------------- helpers

# Host dtypes that jnp.asarray narrows without jax_enable_x64 (int64 is checked on its values).
_NARROWED = ("float64", "complex128")


def as_array(name: str, a, dtypes: Sequence[str] | None = None) -> jax.Array:
    """`jnp.asarray(a)`, refusing what the conversion of a host value would change in silence.

    A jax.Array passes through (its dtype is checked with its shape). A host array (NumPy, or anything
    with a dtype) is checked first: against `dtypes` when given, else only against the 64-bit float
    dtypes (without jax_enable_x64 a float64 array would become float32), and, for 64-bit integers,
    on its values (outside int32 they would wrap: contract section 1, indices are int32).
    """
    if isinstance(a, jax.Array):
        return a
    dtype = getattr(a, "dtype", None)
    if dtype is not None:
        if dtypes is not None:
            checks.check_dtype(name, dtype, dtypes)
        elif checks.dtype_name(dtype) in _NARROWED and not jax.config.jax_enable_x64:
            raise TypeError(f"{name} must have a 32-bit (or narrower) dtype, got {checks.dtype_name(dtype)}: JAX "
                            "(jax_enable_x64 off) would narrow it in silence")
        check_host_int32(name, a)
    elif a is None:
        raise TypeError(f"{name} must be an array, got None")
    elif isinstance(a, (list, tuple, int, float)) and not jax.config.jax_enable_x64:
        check_python_values(name, a)
    return jnp.asarray(a)


def check_python_values(name: str, a) -> None:
    """Python numbers (a scalar or nested lists) that jnp.asarray would narrow to 32 bits in silence:
    a finite float beyond float32's largest (it would become an infinity) or an int outside int32
    (jnp.asarray would raise an OverflowError naming nothing) is a ValueError naming `name`."""
    try:
        v = np.asarray(a)
    except (TypeError, ValueError, OverflowError):
        return  # not numbers (or ragged): jnp.asarray raises its own error
    if v.dtype == np.float64 and v.size:
        big = np.isfinite(v) & (np.abs(v) > np.finfo(np.float32).max)
        if big.any():
            raise ValueError(f"{name} holds {float(v[big][0])!r}, outside float32's finite range (+-"
                             f"{float(np.finfo(np.float32).max)!r}): JAX (jax_enable_x64 off) would make it an "
                             "infinity in silence")
    elif v.dtype.kind == "i" and v.size:
        checks.check_int32_range(name, int(v.min()), int(v.max()))


def check_host_int32(name: str, a) -> None:
    """Host integer values wider than int32 must fit int32 (NumPy arrays; other values: no-op)."""
    if isinstance(a, np.ndarray) and a.dtype.kind in "iu" and (a.dtype.itemsize > 4 or a.dtype == np.uint32) \
            and a.size:
        checks.check_int32_range(name, int(a.min()), int(a.max()))


def as_slices(name: str, stacked, dtypes: Sequence[str] | None = None) -> tuple:
    """A tuple of arrays from a tuple/list of stacked weights or one stacked array (dtypes: default
    WEIGHT_DTYPES, the 16-bit, float32 and fp8 weights)."""
    dtypes = WEIGHT_DTYPES if dtypes is None else dtypes
    if isinstance(stacked, (list, tuple)):
        if any(w is None for w in stacked):
            raise ValueError(f"{name} holds None; every slice needs weights")
        return tuple(as_array(f"{name}[{i}]", w, dtypes) for i, w in enumerate(stacked))
    return (as_array(name, stacked, dtypes),)


def to_3d(w: jax.Array) -> jax.Array:
    """(L, 1, a, b) -> (L, a, b); 3-D unchanged (shapes already checked)."""
    return w.reshape(w.shape[0], w.shape[-2], w.shape[-1]) if w.ndim == 4 else w


def _on_host(a) -> bool:
    if isinstance(a, np.ndarray):
        return True
    if isinstance(a, jax.core.Tracer) or not isinstance(a, jax.Array):
        return False
    try:
        return all(d.platform == "cpu" for d in a.devices())
    except Exception:
        return False


def check_same_device(**arrays) -> None:
    """All committed, concrete jax arrays among `arrays` must live on the same device(s)."""
    seen = {}
    for name, a in arrays.items():
        items = a if isinstance(a, (list, tuple)) else (a,)
        for i, item in enumerate(items):
            if isinstance(item, jax.Array) and not isinstance(item, jax.core.Tracer):
                try:
                    if not item.committed:
                        continue
                    devs = frozenset(item.devices())
                except Exception:
                    continue
                label = name if len(items) == 1 else f"{name}[{i}]"
                seen.setdefault(devs, label)
    if len(seen) > 1:
        desc = ", ".join(f"{label} on {sorted(str(d) for d in devs)}" for devs, label in seen.items())
        raise ValueError(f"arrays are on different devices: {desc}")


def check_index_values(name: str, idx, num_slots: int, arg_w: str) -> None:
    """Checks concrete host-resident index values (-1 .. num_slots-1); no-op otherwise."""
    if _on_host(idx):
        v = np.asarray(idx)
        if v.size:
            checks.check_index_values(name, int(v.min()), int(v.max()), num_slots, arg_w)


def as_meta(meta) -> LoRAKernelMeta:
    if isinstance(meta, LoRAKernelMeta):
        return meta
    if isinstance(meta, (tuple, list)) and len(meta) == 6:
        record = KernelMeta(*meta)
        return LoRAKernelMeta(**{f: as_array(f"meta.{f}", v) for f, v in record._asdict().items()})
    raise TypeError("meta must be a LoRAKernelMeta or its meta_args(T) tuple, got "
                    f"{type(meta).__name__}")


def _check_meta(meta: LoRAKernelMeta, num_tokens: int, num_slots: int, arg_w: str) -> None:
    if meta.token_lora_mapping.shape[0] < num_tokens:
        raise ValueError(f"meta covers {meta.token_lora_mapping.shape[0]} tokens, but the input has "
                         f"{num_tokens}")
    check_index_values("meta.token_lora_mapping", meta.token_lora_mapping[:num_tokens], num_slots, arg_w)


def as_lora_ranks(lora_ranks, num_slots: int):
    """lora_ranks as an int32 array. Host values (a list, NumPy, a concrete array on the CPU) are
    read: a negative rank is refused. Tracers and accelerator arrays are not read: there a negative
    rank acts as 0 (the slot adds nothing). A bool, float or complex dtype is a TypeError; a shape
    other than (>= num_slots,) a ValueError."""
    if lora_ranks is None:
        return None
    host = lora_ranks if isinstance(lora_ranks, (list, tuple, np.ndarray)) else None
    r = as_array("lora_ranks", lora_ranks)
    # A bool or float array is refused, not cast: True would act as rank 1, 2.7 as rank 2.
    if not jnp.issubdtype(r.dtype, jnp.integer):
        raise TypeError(f"lora_ranks must have an integer dtype (int32 or int64: one rank per slot), got {r.dtype}")
    if r.ndim != 1 or r.shape[0] < num_slots:
        raise ValueError(f"lora_ranks must be a 1-D integer array of >= {num_slots} entries (one per "
                         f"slot), got shape {r.shape} dtype {r.dtype}")
    if host is not None or _on_host(r):
        v = np.asarray(r if host is None else host)
        if v.size:
            slot = int(v.argmin())
            checks.check_lora_ranks_values("lora_ranks", int(v[slot]), slot)
    return r.astype(jnp.int32)


def _index_meta(idx, num_tokens: int, num_slots: int, arg_w: str, arg="lora_indices_tensor") -> LoRAKernelMeta:
    if isinstance(idx, np.ndarray):  # values first: the int32 conversion could wrap an int64 into range
        checks.check_indices(arg, idx.shape, idx.dtype, num_tokens)
        check_index_values(arg, idx[:num_tokens], num_slots, arg_w)
        idx = jnp.asarray(idx)
    else:
        idx = as_array(arg, idx)
        checks.check_indices(arg, idx.shape, idx.dtype, num_tokens)
        check_index_values(arg, idx[:num_tokens], num_slots, arg_w)
    # values checked above (host) or masked (jit, accelerators): the build need not read them again
    return build_kernel_meta(idx[:num_tokens].astype(jnp.int32), jnp.int32(num_tokens), max_loras=num_slots)


def _segment_array(name: str, value):
    """A segment array as a jax.Array (a tracer included) where it is, else `segments.as_segment_array`."""
    return segments.as_segment_array(name, value, (jax.Array,))


def _readable(value) -> bool:
    """Whether a scalar can be read without a host sync: not a tracer, not on an accelerator."""
    if isinstance(value, jax.Array):
        return _on_host(value)
    return not isinstance(value, jax.core.Tracer)


def _num_slots(w) -> int | None:
    """The slot count of a stacked weight (L, [1,] a, b), or None when w is not one (checked later)."""
    shape = getattr(w, "shape", None)
    return int(shape[0]) if shape is not None and len(shape) in (3, 4) else None


def segment_indices(seq_start_locs, seq_lengths, lora_indices_per_batch, batch_size, max_length, token_nums,
                    num_tokens: int, num_slots: int | None = None) -> jax.Array:
    """(num_tokens,) int32 per-token index from SGMV segments; -1 for tokens in no segment.

    Works inside jit (batch_size may be traced); buffers longer than batch_size are ignored. Checks
    first (lora_core.segments), on every call: the arrays' dtypes (integer) and lengths (equal), and
    batch_size / max_length / token_nums (integer scalars). When a scalar is readable (not traced,
    not on an accelerator): >= 0, batch_size at most the arrays' length, token_nums at most
    num_tokens. When the arrays are concrete and on the host (NumPy, lists, CPU arrays): the
    segments' values (lengths and starts >= 0, inside the num_tokens tokens, not overlapping, slots
    -1 .. num_slots-1). Elsewhere (jit, accelerators) the values are masked: a token outside every
    live segment gets no LoRA, a slot out of range contributes nothing.
    """
    arrays = [_segment_array(name, v) for name, v in zip(segments.SEGMENT_ARRAYS,
                                                          (seq_start_locs, seq_lengths, lora_indices_per_batch))]
    length, b = segments.check_segment_args(arrays, batch_size, max_length, token_nums, num_tokens, _readable)
    starts, lengths, loras = (as_array(name, a) for name, a in zip(segments.SEGMENT_ARRAYS, arrays))
    if b is not None and all(_on_host(a) for a in arrays):
        segments.check_segment_values(*(np.asarray(a) for a in (starts, lengths, loras)), b, num_tokens,
                                      num_slots)
    starts, lengths, loras = (a.astype(jnp.int32) for a in (starts, lengths, loras))
    live = jnp.arange(length) < (b if b is not None else batch_size)
    t = jnp.arange(num_tokens, dtype=jnp.int32)[:, None]
    inside = (t >= starts[None]) & (t < (starts + lengths)[None]) & live[None]
    return (jnp.max(jnp.where(inside, loras[None] + 1, 0), axis=1, initial=0) - 1).astype(jnp.int32)


# ----------------------------------------------------------------------------- fp8 weight scales

FP8_DTYPE = "float8_e4m3fn"
WEIGHT_DTYPES = tuple(checks.WEIGHT_DTYPES)
"""The weight dtypes the ops take: 16-bit, float32 and e4m3 (with a per-channel float32 scale)."""


def is_fp8(dtype) -> bool:
    """Whether `dtype` is the fp8 weight dtype (e4m3)."""
    return checks.dtype_name(dtype) == FP8_DTYPE


def weight_scales(name: str, scales, weights: Sequence, arg_w: str) -> tuple | None:
    """The per-channel float32 scales of fp8 weights, as the backends take them.

    `weights`: the S slices, (L, [1,] c, k) (c: the output channels, rows of A or B). `scales`: None
    (no fp8 slice), one array (S = 1) or S entries, each None for a 16-bit slice or, for an fp8
    slice, float32 (L, c) per channel or (L,) per tensor (one per slot, broadcast to (L, c)).
    Returns None when no slice is fp8, else S entries of None / (L, c) float32.

    1. The rules are `lora_core.checks.check_weight_scales` (shared with torch_lora): ValueError
       naming `name` (and the slice) for an fp8 slice without a scale, a scale for a 16-bit slice,
       a wrong entry count, shape or dtype. An entry without a dtype is read as a NumPy array.
    2. Here the arrays are only converted: a per-tensor (L,) scale is broadcast to (L, c).
    """
    if scales is None and not any(is_fp8(w.dtype) for w in weights):
        return None                                   # 16-bit weights, no scales: nothing to check
    entries = None if scales is None else (list(scales) if isinstance(scales, (list, tuple)) else [scales])
    if entries is not None:
        entries = [None if sc is None else sc if hasattr(sc, "dtype") and hasattr(sc, "shape") else np.asarray(sc)
                   for sc in entries]
    kinds = checks.check_weight_scales(name, None if entries is None else
                                       [None if sc is None else (tuple(sc.shape), sc.dtype) for sc in entries],
                                       [tuple(w.shape) for w in weights], [w.dtype for w in weights], arg_w)
    if all(k is None for k in kinds):
        return None
    out = []
    for w, sc, kind in zip(weights, entries, kinds):
        if kind is None:
            out.append(None)
            continue
        sc = jnp.asarray(sc)
        out.append(jnp.broadcast_to(sc[:, None], (int(w.shape[0]), int(w.shape[-2]))) if kind == "tensor" else sc)
    return tuple(out)


def scale_keywords(impl, deterministic: bool, a_scales=None, b_scales=None) -> tuple:
    """(impl, keywords) for a call with fp8 weight scales: {} and `impl` as it is without scales; with
    them the backend if it applies weight scales, else the xla reference (jax_lora.ops.invariant when
    deterministic), said once per backend on the `jax_lora` logger -- never dropped in silence."""
    kw = {k: v for k, v in (("a_scales", a_scales), ("b_scales", b_scales)) if v is not None}
    if not kw or takes_weight_scales(impl):
        return impl, kw
    fallback = invariant if deterministic else dispatch.load_backend("xla")
    name = getattr(impl, "NAME", "?")
    if name not in _SAID_SCALE_FALLBACK:
        _SAID_SCALE_FALLBACK.add(name)
        _LOG.warning("backend %r does not apply fp8 weight scales: fp8 adapter weights run on the xla reference "
                     "instead", name)
    return fallback, kw


_SAID_SCALE_FALLBACK: set = set()


def takes_weight_scales(impl) -> bool:
    """Whether backend `impl` applies fp8 weight scales: its `WEIGHT_SCALES` declaration, else an
    explicit `a_scales` parameter of its shrink."""
    declared = getattr(impl, "WEIGHT_SCALES", None)
    if declared is not None:
        return bool(declared)
    base = getattr(impl, "backend", impl)
    try:
        return "a_scales" in inspect.signature(base.shrink).parameters
    except (TypeError, ValueError, AttributeError):
        return False


# ----------------------------------------------------------------------------- metadata-driven ops

def lora_shrink(x: ArrayLike, lora_a_stacked, meta, scale: float, *, backend: str | None = None,
                lora_ranks=None, deterministic: bool = False, lora_a_scale=None) -> jax.Array:
    """buf[s, t] = scale * x[t] @ lora_a_stacked[s][idx[t]].T, 0 for idx -1; for an fp8 slice
    buf[s, t, c] = scale * a_scale_s[idx[t], c] * x[t] @ float32(A_s[idx[t], c]).

    Args:
      x: (T, H) fp16/bf16/fp32.
      lora_a_stacked: S arrays (L, 1, r, H) or (L, r, H) (or one array: S = 1), 16-bit, float32 or
        e4m3 (float8_e4m3fn).
      meta: LoRAKernelMeta covering >= T tokens (or its `meta_args(T)` tuple).
      scale: float multiplier.
      lora_a_scale: None without fp8 slices; else one array (S = 1) or S entries, each None (16-bit
        slice) or float32 (L, r) per rank row, or (L,) per tensor (broadcast).
    Returns: (S, T, r) float32.
    """
    x = as_array("x", x, checks.ACTIVATION_DTYPES)
    lora_a = as_slices("lora_a_stacked", lora_a_stacked)
    num_slots, rank, _ = checks.check_shrink(x.shape, x.dtype, [a.shape for a in lora_a],
                                             [a.dtype for a in lora_a])
    a_scales = weight_scales("lora_a_scale", lora_a_scale, lora_a, "lora_a_stacked")
    scale = checks.as_scale(scale)
    meta = as_meta(meta)
    check_same_device(x=x, lora_a_stacked=lora_a, lora_a_scale=[v for v in a_scales or () if v is not None])
    _check_meta(meta, x.shape[0], num_slots, "lora_a_stacked")
    impl = dispatch.resolve(backend, _device_of(x), deterministic=deterministic)
    checks.check_backend_rank(impl.NAME, rank, "lora_a_stacked")
    impl, kw = scale_keywords(impl, deterministic, a_scales=a_scales)
    return impl.shrink(x, tuple(to_3d(a) for a in lora_a), meta, scale, as_lora_ranks(lora_ranks, num_slots), **kw)


def lora_expand(buf: ArrayLike, lora_b_stacked, y: ArrayLike, meta, offset_start: int = 0,
                add_inputs: bool = False, *, backend: str | None = None, lora_ranks=None,
                deterministic: bool = False, lora_b_scale=None) -> jax.Array:
    """y[t, off_s:off_s+n_s] = (y[t, ...] if add_inputs else 0) + buf[s, t] @ B_s[idx[t]].T; for an fp8
    slice the product is b_scale_s[idx[t], n] * buf[s, t] @ float32(B_s[idx[t], n]).

    Args:
      buf: (S, T, r) float (the shrink buffer, normally float32).
      lora_b_stacked: S arrays (L, 1, n_s, r) or (L, n_s, r); widths may differ; 16-bit, float32 or e4m3.
      y: (T, N); slices start at `offset_start` and are laid side by side.
      meta: LoRAKernelMeta covering >= T tokens (or its `meta_args(T)` tuple).
      lora_b_scale: None without fp8 slices; else one array (S = 1) or S entries, each None (16-bit
        slice) or float32 (L, n_s) per output row, or (L,) per tensor (broadcast).
    Returns: a new y (same shape and dtype). Rows with index -1 and columns outside the slices are
    unchanged.
    """
    buf, y = as_array("inputs", buf, checks.ACTIVATION_DTYPES), as_array("y", y, checks.ACTIVATION_DTYPES)
    lora_b = as_slices("lora_b_stacked", lora_b_stacked)
    offset_start = checks.as_offset("offset_start", offset_start)
    num_slots, rank, widths = checks.check_expand(buf.shape, buf.dtype, [b.shape for b in lora_b],
                                                  [b.dtype for b in lora_b], y.shape, y.dtype,
                                                  offset_start, arg_buf="inputs")
    b_scales = weight_scales("lora_b_scale", lora_b_scale, lora_b, "lora_b_stacked")
    meta = as_meta(meta)
    check_same_device(inputs=buf, lora_b_stacked=lora_b, y=y,
                      lora_b_scale=[v for v in b_scales or () if v is not None])
    _check_meta(meta, y.shape[0], num_slots, "lora_b_stacked")
    impl = dispatch.resolve(backend, _device_of(y), deterministic=deterministic)
    checks.check_backend_rank(impl.NAME, rank, "lora_b_stacked")
    impl, kw = scale_keywords(impl, deterministic, b_scales=b_scales)
    return impl.expand(buf, tuple(to_3d(b) for b in lora_b), y, meta, _offsets(offset_start, widths),
                       checks.as_flag("add_inputs", add_inputs), as_lora_ranks(lora_ranks, num_slots), **kw)


def _offsets(offset_start: int, widths: Sequence[int]) -> tuple[int, ...]:
    out, off = [], offset_start
    for w in widths:
        out.append(off)
        off += w
    return tuple(out)


def _device_of(a):
    if isinstance(a, jax.Array) and not isinstance(a, jax.core.Tracer):
        try:
            return next(iter(a.devices()))
        except Exception:
            return None
    return None


# ----------------------------------------------------------------------------- BGMV

def bgmv_shrink(x: ArrayLike, w: ArrayLike, idx: ArrayLike, scale: float = 1.0, *,
                backend: str | None = None, lora_ranks=None, deterministic: bool = False,
                w_scale=None) -> jax.Array:
    """(T, r) float32: scale * x[t] @ w[idx[t]].T, 0 where idx[t] = -1. w: (L, [1,] r, H); an e4m3 w
    takes w_scale, float32 (L, r) per rank row or (L,) per tensor: w[l, c] ~ w_scale[l, c] * w_q[l, c]."""
    x, w = as_array("x", x, checks.ACTIVATION_DTYPES), as_array("lora_a_weights", w, WEIGHT_DTYPES)
    num_slots, rank, _ = checks.check_shrink(x.shape, x.dtype, [w.shape], [w.dtype],
                                             arg_a="lora_a_weights")
    a_scales = weight_scales("w_scale", w_scale, (w,), "lora_a_weights")
    scale = checks.as_scale(scale)
    check_same_device(x=x, lora_a_weights=w, lora_indices_tensor=idx, w_scale=a_scales[0] if a_scales else None)
    meta = _index_meta(idx, x.shape[0], num_slots, "lora_a_weights")
    impl = dispatch.resolve(backend, _device_of(x), deterministic=deterministic)
    checks.check_backend_rank(impl.NAME, rank, "lora_a_weights")
    impl, kw = scale_keywords(impl, deterministic, a_scales=a_scales)
    return impl.shrink(x, (to_3d(w),), meta, scale, as_lora_ranks(lora_ranks, num_slots), **kw)[0]


def bgmv_expand(x: ArrayLike, w: ArrayLike, y: ArrayLike, idx: ArrayLike, add_inputs: bool = True, *,
                backend: str | None = None, lora_ranks=None, deterministic: bool = False,
                w_scale=None) -> jax.Array:
    """y[t, :c] = (y[t, :c] if add_inputs else 0) + (x[t] @ w[idx[t]].T)[:c], c = min(n, N).

    x: (T, r); w: (L, [1,] n, r); y: (T, N). Rows with idx -1 untouched. A LoRA output wider than y
    (vocabulary padding) is cut to y's width, as in vLLM. An e4m3 w takes w_scale, float32 (L, n) per
    output row or (L,) per tensor.
    """
    x, w, y = _expand_inputs(x, w, y)
    w3 = to_3d(w) if w.ndim in (3, 4) else w
    cut = w.ndim in (3, 4) and y.ndim == 2 and w3.shape[1] > y.shape[1]
    if cut:
        w3 = w3[:, : y.shape[1]]
    return _expand_one(x, w3, w, y, idx, 0, add_inputs, backend, lora_ranks, deterministic, w_scale,
                       y.shape[1] if cut else None)


def bgmv_expand_slice(x: ArrayLike, w: ArrayLike, y: ArrayLike, idx: ArrayLike, y_offset: int,
                      y_slice_size: int, add_inputs: bool = True, *, backend: str | None = None,
                      lora_ranks=None, deterministic: bool = False, w_scale=None) -> jax.Array:
    """y[t, y_offset:y_offset+y_slice_size] (+)= x[t] @ w[idx[t]].T; w: (L, [1,] y_slice_size, r)
    (e4m3 with w_scale: float32 (L, y_slice_size) or (L,), as bgmv_expand)."""
    # Types first: a y_slice_size of "16" or 16.0 is a TypeError, not a width mismatch.
    y_offset = checks.as_offset("y_offset", y_offset)
    y_slice_size = checks.as_offset("y_slice_size", y_slice_size)
    x, w, y = _expand_inputs(x, w, y)
    w3 = to_3d(w) if w.ndim in (3, 4) else w
    if w.ndim in (3, 4) and w3.shape[1] != y_slice_size:
        raise ValueError(f"lora_b_weights has {w3.shape[1]} output rows (shape {w.shape}), but "
                         f"y_slice_size is {y_slice_size}")
    return _expand_one(x, w3, w, y, idx, y_offset, add_inputs, backend, lora_ranks, deterministic, w_scale)


def _expand_inputs(x, w, y) -> tuple:
    return (as_array("inputs", x, checks.ACTIVATION_DTYPES), as_array("lora_b_weights", w, WEIGHT_DTYPES),
            as_array("y", y, checks.ACTIVATION_DTYPES))


def _expand_one(x, w3, w_orig, y, idx, offset, add_inputs, backend, lora_ranks, deterministic=False, w_scale=None,
                cut: int | None = None):
    """The BGMV expand of one weight w3 (w_orig cut to `cut` output rows when given; its scale too)."""
    if x.ndim != 2:
        raise ValueError(f"inputs must be 2-D (num_tokens, rank), got shape {x.shape}")
    checks.weight_dims("lora_b_weights", w_orig.shape, "out_features, rank")
    offset = checks.as_offset("y_offset", offset)
    num_slots, rank, widths = checks.check_expand((1,) + x.shape, x.dtype, [w3.shape], [w3.dtype],
                                                  y.shape, y.dtype, offset, arg_buf="inputs",
                                                  arg_b="lora_b_weights")
    b_scales = weight_scales("w_scale", w_scale, (w_orig,), "lora_b_weights")
    if b_scales is not None and cut is not None:
        b_scales = (b_scales[0][:, :cut],)
    check_same_device(inputs=x, lora_b_weights=w3, y=y, lora_indices_tensor=idx,
                      w_scale=b_scales[0] if b_scales else None)
    meta = _index_meta(idx, y.shape[0], num_slots, "lora_b_weights")
    impl = dispatch.resolve(backend, _device_of(y), deterministic=deterministic)
    checks.check_backend_rank(impl.NAME, rank, "lora_b_weights")
    impl, kw = scale_keywords(impl, deterministic, b_scales=b_scales)
    return impl.expand(x[None], (w3,), y, meta, (offset,), checks.as_flag("add_inputs", add_inputs),
                       as_lora_ranks(lora_ranks, num_slots), **kw)


# ----------------------------------------------------------------------------- SGMV

def sgmv_shrink(x, w, seq_start_locs, seq_lengths, lora_indices_per_batch, batch_size, max_length,
                token_nums, scale: float = 1.0, *, backend: str | None = None, lora_ranks=None,
                deterministic: bool = False, w_scale=None):
    """bgmv_shrink with each segment's tokens using the segment's index (prefill metadata).

    x: (T, H); w: (L, [1,] r, H); seq_start_locs / seq_lengths / lora_indices_per_batch: (B,) integer
    (arrays or lists); batch_size, max_length, token_nums: ints >= 0 (batch_size <= B, token_nums <= T;
    int32 scalars inside jit). Returns (T, r) float32. What is checked where: segment_indices.
    """
    x = as_array("x", x, checks.ACTIVATION_DTYPES)
    idx = segment_indices(seq_start_locs, seq_lengths, lora_indices_per_batch, batch_size, max_length, token_nums,
                          x.shape[0] if x.ndim else 0, _num_slots(w))
    return bgmv_shrink(x, w, idx, scale, backend=backend, lora_ranks=lora_ranks, deterministic=deterministic,
                       w_scale=w_scale)


def sgmv_expand(x, w, y, seq_start_locs, seq_lengths, lora_indices_per_batch, batch_size, max_length,
                token_nums, add_inputs: bool = True, *, backend: str | None = None, lora_ranks=None,
                deterministic: bool = False, w_scale=None):
    """bgmv_expand with each segment's tokens using the segment's index (prefill metadata).

    x: (T, r); w: (L, [1,] n, r); y: (T, N). Returns a new y. The segment arguments are checked as in
    sgmv_shrink.
    """
    y = as_array("y", y, checks.ACTIVATION_DTYPES)
    idx = segment_indices(seq_start_locs, seq_lengths, lora_indices_per_batch, batch_size, max_length, token_nums,
                          y.shape[0] if y.ndim else 0, _num_slots(w))
    return bgmv_expand(x, w, y, idx, add_inputs, backend=backend, lora_ranks=lora_ranks,
                       deterministic=deterministic, w_scale=w_scale)


def sgmv_expand_slice(x, w, y, seq_start_locs, seq_lengths, lora_indices_per_batch, batch_size,
                      max_length, token_nums, y_offset: int, y_slice_size: int, add_inputs: bool = True,
                      *, backend: str | None = None, lora_ranks=None, deterministic: bool = False,
                      w_scale=None):
    """bgmv_expand_slice with each segment's tokens using the segment's index.

    x: (T, r); w: (L, [1,] y_slice_size, r); y: (T, N). Returns a new y with columns [y_offset,
    y_offset + y_slice_size) updated. The segment arguments are checked as in sgmv_shrink.
    """
    y = as_array("y", y, checks.ACTIVATION_DTYPES)
    idx = segment_indices(seq_start_locs, seq_lengths, lora_indices_per_batch, batch_size, max_length, token_nums,
                          y.shape[0] if y.ndim else 0, _num_slots(w))
    return bgmv_expand_slice(x, w, y, idx, y_offset, y_slice_size, add_inputs, backend=backend,
                             lora_ranks=lora_ranks, deterministic=deterministic, w_scale=w_scale)
