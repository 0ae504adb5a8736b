"""Backend "triton" for JAX: the shared Triton kernels of `lora_core.kernels` under `jax.jit`.

A call is planned once and described as `_Launch`es: the `KernelCall` that `lora_core`'s argument
builder makes (the same builder the torch launchers use, so both sides launch identical kernels),
and the result it writes. Buffers the call itself provides are placeholders among the call's
arguments: `_Result(i, shape, dtype)` for result i (the shrink's workspace, the stand-alone
shrink's output), `_Counters(n)` for the fused kernel's barrier counters.

What a launch writes, two ways:

  * a trailing `out` parameter (`KernelCall.out`, the dense kernels): the array there is an
    operand aliased to result `_Launch.result`, and the kernel gets that result's pointer last;
  * pointer parameters anywhere in the list (`KernelCall.out` None; the MoE kernel writes its rank
    buffer and y mid-list): a `_Result` placeholder there is a fresh result, an `_InPlace(i, array)`
    placeholder is result i aliased to `array` (it starts as `array` and the kernel updates it in
    place). The call's results are then exactly its placeholders; `_Launch.result` is -1.

Three runners execute launches:

  * GPU, default: one XLA FFI call (`ffi_launcher`), declared command-buffer compatible so XLA
    records it into its CUDA graphs; add_lora_linear's shrink and expand are one call with two
    launches, the expand a programmatic dependent of the shrink on Hopper; y is aliased in and out,
    so XLA updates it in place; the fused kernel's barrier counters are the handler's persistent
    per-device buffer.
  * GPU, without a C compiler, on a non-CUDA GPU, or with JAX_LORA_TRITON_LAUNCHER=jax_triton:
    `jax_triton.triton_call`, one legacy custom call per launch, without PDL (and never the fused
    kernel, which needs the handler's counters, nor a kernel that writes mid-list: jax_triton
    hands its outputs to the kernel after all inputs; `writes_mid_list` says so beforehand).
  * CPU (tests), with TRITON_INTERPRET=1 set before import: Triton's interpreter inside
    `jax.pure_callback`, on NumPy memory (`lora_core.kernels.launch.HostArray`): no other framework.

Contract (jax_lora.ops.dispatch): shrink -> (S, T, r) float32; expand -> new y; `linear` is the
add_lora_linear path (y + sum_s slices, add_inputs=True): split-K shrink into a workspace + expand,
or the one-launch fused kernel where the launch configs say it wins. fp8 (e4m3) weights (contract
section 11) come with `a_scales` / `b_scales`: per slice None or the (L, r) / (L, n_s) float32
channel scales, handed to the kernels beside the weights (`arguments`).
"""
from __future__ import annotations

import dataclasses
import functools
import logging
import os
import types
from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from lora_core.kernel_meta import KernelMeta
from lora_core.kernels import arguments, configs
from lora_core.kernels.common import HAVE_PDL
from lora_core.kernels.expand import plan_expand
from lora_core.kernels.fused import plan_fused
from lora_core.kernels.launch import HostArray, triton_launch
from lora_core.kernels.planning import interpreting, pdl_allowed, slice_chunks
from lora_core.kernels.shrink import plan_shrink

from ..meta import LoRAKernelMeta

NAME = "triton"
COLUMN_SCALE = True        # expand and linear take col_scale (DoRA)
READS_VIEWS = True          # lora_a / lora_b entries may be `View`s (jax_lora.wrapper, nn.MultiLoRALinear)
WEIGHT_SCALES = True        # shrink / expand / linear take a_scales / b_scales (fp8 weights, e4m3)
CUSTOM_CALLS = True         # FFI / legacy custom calls, callbacks: partitioned by jax_lora.ops.partition
_LOG = logging.getLogger("jax_lora")


class _Result(NamedTuple):
    """A buffer the call provides: result `index` of the call."""
    index: int
    shape: tuple
    dtype: object


class _InPlace(NamedTuple):
    """An array a kernel updates in place through a pointer parameter anywhere in its list:
    result `index` of the call, aliased to the operand `array` (the result starts as it)."""
    index: int
    array: object

    @property
    def shape(self) -> tuple:
        return tuple(self.array.shape)

    @property
    def dtype(self):
        return self.array.dtype


class _Counters(NamedTuple):
    """The fused kernel's barrier counters: `ints` int32, zeroed once (the launcher's own buffer)."""
    ints: int

    @property
    def shape(self) -> tuple:
        return (self.ints,)


class View(NamedTuple):
    """`base[index]` (ints and unit-step slices) as the kernels read it: element `offset` into
    `base` with `shape` and element `strides`. A slice of a stacked weight handed to a custom call
    is a copy in XLA (a layer's fused q/k/v B slices: every slot's B, every step); a view is a
    pointer into the stacked array instead (ffi_launcher.Arg's byte offset). The interpreter reads
    the same view of its NumPy copy; jax_triton launches get `materialize()`."""
    base: jax.Array
    index: tuple
    offset: int
    shape: tuple
    strides: tuple

    @property
    def dtype(self):
        return self.base.dtype

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def materialize(self) -> jax.Array:
        return self.base[self.index]


def view(base: jax.Array, index: tuple) -> View:
    """The View of base[index]; index: ints and slices of step 1 (at most base.ndim entries)."""
    strides = arguments.row_major_strides(base.shape)
    offset, shape, kept = 0, [], []
    for axis, ix in enumerate(index):
        if isinstance(ix, slice):
            start, stop, step = ix.indices(base.shape[axis])
            if step != 1 or stop < start:
                raise ValueError(f"view: slice {ix} of axis {axis} is not a unit-step range")
            offset += start * strides[axis]
            shape.append(stop - start)
            kept.append(strides[axis])
        else:
            i = int(ix)
            if not 0 <= i < base.shape[axis]:
                raise ValueError(f"view: index {i} out of range for axis {axis} of size {base.shape[axis]}")
            offset += i * strides[axis]
    shape.extend(base.shape[len(index):])
    kept.extend(strides[len(index):])
    return View(base, tuple(index), offset, tuple(shape), tuple(kept))


def _strides(a) -> tuple:
    """Element strides of a kernel array argument: a View's own, else row-major."""
    return a.strides if isinstance(a, View) else arguments.row_major_strides(a.shape)


class _Launch(NamedTuple):
    """A kernel call and the result its `out` parameter writes (-1: the call has no `out`; it
    writes through `_Result` / `_InPlace` placeholders among its pointers); pdl: a programmatic
    dependent of the kernel before it on the stream."""
    call: arguments.KernelCall
    result: int
    pdl: bool = False


def _shape(result: _Result) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(result.shape, result.dtype)


def _dtype_name(a) -> str:
    return jnp.dtype(a.dtype).name


def _is_array(v) -> bool:
    return hasattr(v, "shape") and hasattr(v, "dtype") and not isinstance(
        v, (int, float, np.generic, _Result, _InPlace, View))


def writes_mid_list(launches: Sequence[_Launch]) -> bool:
    """Whether a launch writes through a pointer parameter that is not its last (`out` None):
    what the jax_triton launcher cannot run."""
    return any(launch.call.out is None for launch in launches)


def _platform(*arrays) -> str:
    for a in arrays:
        if isinstance(a, jax.Array) and not isinstance(a, jax.core.Tracer):
            try:
                return next(iter(a.devices())).platform
            except Exception:
                pass
    return jax.default_backend()


def _use_interpreter(*arrays) -> bool:
    if _platform(*arrays) in ("gpu", "cuda"):
        return False
    if not interpreting():
        raise RuntimeError("backend 'triton' on the CPU runs Triton's interpreter: set TRITON_INTERPRET=1 "
                           "before importing jax_lora (or run on a CUDA GPU, or use backend='xla')")
    return True


def _meta_arrays(meta: LoRAKernelMeta) -> KernelMeta:
    """The metadata record over the whole capacity (`meta_args` of every token): the kernels bound
    their reads by the token count they are given."""
    return meta.meta_args(meta.max_num_tokens)


def _ranks(lora_ranks):
    return None if lora_ranks is None else jnp.asarray(lora_ranks, jnp.int32)


@functools.cache
def _pdl() -> bool:
    """Programmatic dependent launch for the FFI launcher's shrink -> expand (Hopper and newer)."""
    if not HAVE_PDL or not pdl_allowed():
        return False
    devices = [d for d in jax.local_devices() if d.platform == "gpu"]
    return bool(devices) and int(devices[0].compute_capability.split(".")[0]) >= 9


# --------------------------------------------------------------------------------- launches

def _part(scales, lo: int, hi: int):
    """Slices lo..hi of per-slice fp8 channel scales (None stays None)."""
    return None if scales is None else tuple(scales[lo:hi])


def _shrink_launch(x, lora_a, meta, scale, lora_ranks, *, workspace: bool, config=None, pdl=False,
                   result: int = 0, deterministic: bool = False, pairs=None, a_scales=None) -> _Launch:
    """lora_shrink_kernel into result `result`, (planes, S, T, r) float32 (planes = 1 unless workspace split-K;
    k * r rank columns with k adapter pairs)."""
    T, H = x.shape
    L, R, _ = lora_a[0].shape
    S = len(lora_a)
    cfg = config or configs.shrink_config(T, H, R, S, L, deterministic=deterministic,
                                           w_dtype=_dtype_name(lora_a[0]))
    plan = plan_shrink(T, H, R, S, meta.active_lora_ids.shape[0], _dtype_name(x), _dtype_name(lora_a[0]), cfg,
                       lora_only=workspace, workspace=workspace, has_ranks=lora_ranks is not None, pdl=pdl,
                       deterministic=deterministic, pairs=0 if pairs is None else pairs.num_pairs)
    out = _Result(result, (plan.num_partials, S, T, R * (1 if pairs is None else pairs.num_pairs)), jnp.float32)
    call = arguments.shrink_call(plan, x, lora_a, _ranks(lora_ranks), _meta_arrays(meta), float(scale), out,
                                 _strides, pairs, a_scales)
    return _Launch(call.with_alignment_hints(), result, pdl and plan.launch_pdl)


def _expand_launch(buf, lora_b, y, meta, offsets, add_inputs, lora_ranks, bias, config=None, pdl=False,
                   deterministic: bool = False, pairs=None, b_scales=None) -> _Launch:
    """lora_expand_kernel writing y (result 0); buf: the (planes, S, T, r) float32 array or a _Result."""
    T = y.shape[0]
    L, _, R = lora_b[0].shape
    widths = tuple(int(b.shape[1]) for b in lora_b)
    cfg = config or configs.expand_config(T, max(widths), R, len(widths), L, deterministic=deterministic,
                                           w_dtype=_dtype_name(lora_b[0]))
    plan = plan_expand(T, R, widths, meta.active_lora_ids.shape[0], buf.shape[0], _dtype_name(lora_b[0]),
                       _dtype_name(y), cfg, add_inputs=add_inputs,
                       bias_flags=arguments.bias_flags(bias, len(lora_b)),
                       has_ranks=lora_ranks is not None, pdl=pdl, deterministic=deterministic,
                       pairs=0 if pairs is None else pairs.num_pairs)
    call = arguments.expand_call(plan, buf, lora_b, bias, _ranks(lora_ranks), _meta_arrays(meta), y, offsets,
                                 _strides, pairs, b_scales)
    return _Launch(call.with_alignment_hints(), 0, pdl and plan.launch_pdl)


def _fused_launch(y, x, lora_a, lora_b, meta, scale, offsets, lora_ranks, bias, config=None, pdl=False,
                  pairs=None, a_scales=None, b_scales=None) -> _Launch:
    """lora_fused_kernel writing y (result 0); its workspace is result 1."""
    T, H = x.shape
    L, R, _ = lora_a[0].shape
    widths = tuple(int(b.shape[1]) for b in lora_b)
    cfg = config or configs.fused_config(T, H, max(widths), R, len(widths), L, w_dtype=_dtype_name(lora_a[0]))
    plan = plan_fused(T, H, R, widths, meta.active_lora_ids.shape[0], _dtype_name(x), _dtype_name(lora_a[0]), cfg,
                      add_inputs=True,
                      bias_flags=arguments.bias_flags(bias, len(lora_b)),
                      has_ranks=lora_ranks is not None, pdl=pdl, pairs=0 if pairs is None else pairs.num_pairs)
    workspace = _Result(1, plan.workspace_shape, jnp.float32)
    call = arguments.fused_call(plan, x, lora_a, lora_b, bias, _ranks(lora_ranks), _meta_arrays(meta), y,
                                _Counters(plan.sync_ints), workspace, float(scale), offsets, _strides, pairs,
                                a_scales, b_scales)
    return _Launch(call.with_alignment_hints(), 0, pdl and plan.launch_pdl)


# --------------------------------------------------------------------------------- runners

def _operands(launches: Sequence[_Launch]) -> tuple:
    """(operands, {id(array): operand index}, {operand index: result index} of arrays written in
    place: a trailing `out` array, or the array of an `_InPlace` placeholder)."""
    operands, index, aliases = [], {}, {}
    for launch in launches:
        for v in launch.call.pointers:
            written = v.index if isinstance(v, _InPlace) else None
            v = v.base if isinstance(v, View) else v.array if isinstance(v, _InPlace) else v
            if _is_array(v) and id(v) not in index:
                index[id(v)] = len(operands)
                operands.append(v)
            if written is not None:
                aliases[index[id(v)]] = written
        if _is_array(launch.call.out):
            aliases[index[id(launch.call.out)]] = launch.result
    return operands, index, aliases


def _ffi_launches(launches: Sequence[_Launch]) -> tuple:
    """(ffi_launcher.Launch list, operands, aliases) of the launches: arrays become operands,
    _Result and _InPlace placeholders and every `out` the call's results (an _InPlace result is
    aliased to its operand, so the kernel's pointer is the operand's buffer), _Counters the
    handler's counters."""
    from . import ffi_launcher

    operands, index, aliases = _operands(launches)

    def parameter(v):
        if isinstance(v, (_Result, _InPlace)):
            return ffi_launcher.Out(v.index)
        if isinstance(v, _Counters):
            return ffi_launcher.Counters(v.ints)
        if isinstance(v, View):
            return ffi_launcher.Arg(index[id(v.base)], v.offset * jnp.dtype(v.dtype).itemsize)
        if _is_array(v):
            return ffi_launcher.Arg(index[id(v)])
        return v

    ffi = []
    for launch in launches:
        call, plan = launch.call, launch.call.plan
        params = tuple(parameter(v) for v in (*call.pointers, *call.scalars))
        if call.out is not None:
            params += (ffi_launcher.Out(launch.result),)
        ffi.append(ffi_launcher.Launch(call.kernel, plan.grid, plan.num_warps, plan.num_stages, plan.constexprs,
                                       params, zero_out=launch.result if getattr(plan, "atomic", False) else -1,
                                       pdl=launch.pdl, cooperative=bool(getattr(plan, "cooperative", False))))
    return ffi, operands, aliases


def _run_ffi(launches: Sequence[_Launch], results: Sequence[jax.ShapeDtypeStruct]) -> list:
    from . import ffi_launcher
    ffi, operands, aliases = _ffi_launches(launches)
    return ffi_launcher.call(ffi, operands, results, aliases)


def _jax_triton():
    # jax_triton sets os.environ["TRITON_CACHE_DIR"] = "" when imported, which breaks every later
    # Triton compile of other callers in this process. Restore the caller's setting.
    prev = os.environ.get("TRITON_CACHE_DIR")
    try:
        import jax_triton
    except ImportError as e:  # pragma: no cover - depends on the machine
        raise RuntimeError("backend 'triton' on the GPU needs the jax-triton package when the FFI launcher "
                           "cannot be used (pip install jax-triton)") from e
    finally:
        if prev is None:
            os.environ.pop("TRITON_CACHE_DIR", None)
        else:
            os.environ["TRITON_CACHE_DIR"] = prev
    return jax_triton


def _run_jax_triton(launches: Sequence[_Launch], results: Sequence[jax.ShapeDtypeStruct]) -> list:
    """One `jax_triton.triton_call` per launch, in order (no PDL, no barrier counters, no writes
    mid-list: `writes_mid_list`)."""
    if writes_mid_list(launches):
        raise NotImplementedError("the jax_triton launcher passes a kernel's outputs after its inputs; a kernel "
                                  "that writes mid-list runs through the FFI handler or the interpreter")
    jax_triton = _jax_triton()
    produced = {}
    for launch in launches:
        call, plan = launch.call, launch.call.plan
        values = [produced[v.index] if isinstance(v, _Result) else v.materialize() if isinstance(v, View) else v
                  for v in (*call.pointers, *call.scalars)]
        in_place = [i for i, v in enumerate(values) if _is_array(call.out) and v is call.out]
        produced[launch.result] = jax_triton.triton_call(
            *values, kernel=call.kernel, out_shape=results[launch.result], grid=plan.grid,
            num_warps=plan.num_warps, num_stages=plan.num_stages,
            input_output_aliases={in_place[0]: 0} if in_place else {},
            zeroed_outputs=(0,) if getattr(plan, "atomic", False) else (), **plan.constexprs)
    return [produced.get(i) for i in range(len(results))]


def _run_interpreter(launches: Sequence[_Launch], results: Sequence[jax.ShapeDtypeStruct]) -> list:
    """The launches in Triton's interpreter, inside `jax.pure_callback`, on NumPy copies: results
    start as zeros, or as a copy of the array written in place (a trailing `out`, an _InPlace)."""
    operands, index, aliases = _operands(launches)

    def host(*arrays):
        outputs = [np.zeros(r.shape, r.dtype) for r in results]
        for operand, result in aliases.items():
            outputs[result] = np.array(arrays[operand])
        numpy_arrays = {i: outputs[aliases[i]] if i in aliases else np.ascontiguousarray(a)
                        for i, a in enumerate(arrays)}
        memory = {i: HostArray(a) for i, a in numpy_arrays.items()}
        wrapped_outputs = [HostArray(o) for o in outputs]

        def host_value(v):
            if isinstance(v, (_Result, _InPlace)):
                return wrapped_outputs[v.index]
            if isinstance(v, _Counters):
                return HostArray(np.zeros(v.ints, np.int32))
            if isinstance(v, View):
                return HostArray(numpy_arrays[index[id(v.base)]], offset=v.offset, shape=v.shape, strides=v.strides)
            if _is_array(v):
                return memory[index[id(v)]]
            return v

        for launch in launches:
            call = launch.call
            out = None if call.out is None else wrapped_outputs[launch.result]
            triton_launch(dataclasses.replace(call, pointers=tuple(host_value(v) for v in call.pointers), out=out))
        return tuple(outputs)

    return list(jax.pure_callback(host, tuple(results), *operands, vmap_method="sequential"))


def _use_ffi() -> bool:
    from . import ffi_launcher
    return ffi_launcher.available()


@functools.cache
def _log_launcher(name: str, reason: str) -> None:
    _LOG.info("backend 'triton' launches through %s%s", name, f" ({reason})" if reason else "")


def _run(launches: Sequence[_Launch], results: Sequence[jax.ShapeDtypeStruct], interpret: bool) -> list:
    if interpret:
        _log_launcher("Triton's interpreter", "CPU arrays, TRITON_INTERPRET=1")
        return _run_interpreter(launches, results)
    if _use_ffi():
        _log_launcher("the XLA FFI handler", "")
        return _run_ffi(launches, results)
    from . import ffi_launcher
    _log_launcher("jax_triton", ffi_launcher.unavailable_reason())
    return _run_jax_triton(launches, results)


# --------------------------------------------------------------------------------- backend API

def shrink(x, lora_a: Sequence[jax.Array], meta: LoRAKernelMeta, scale: float, lora_ranks=None, *,
           config: dict | None = None, deterministic: bool = False, pairs=None, a_scales=None) -> jax.Array:
    """(S, T, r) float32: scale * x[t] @ lora_a[s][idx[t]].T, 0 for tokens without LoRA (fp8 A_s:
    times a_scales[s][idx[t]], its (L, r) float32 channel scales).
    deterministic: batch-invariant launches (configs.deterministic_config; unsplit, no atomics).
    pairs: several adapters per token (lora_core.adapter_pairs): (S, T, k * r), pair j's weighted
    product at columns j*r..(j+1)*r."""
    T = x.shape[0]
    S, R = len(lora_a), lora_a[0].shape[1] * (1 if pairs is None else pairs.num_pairs)
    if T == 0:
        return jnp.zeros((S, 0, R), jnp.float32)
    interpret = _use_interpreter(x, *lora_a)
    parts = []
    for lo, hi in slice_chunks(S, lora_a):
        launch = _shrink_launch(x, lora_a[lo:hi], meta, scale, lora_ranks, workspace=False, config=config,
                                deterministic=deterministic, pairs=pairs, a_scales=_part(a_scales, lo, hi))
        parts.append(_run([launch], [_shape(launch.call.out)], interpret)[0][0])
    return parts[0] if len(parts) == 1 else jnp.concatenate(parts)


def expand(buf, lora_b: Sequence[jax.Array], y, meta: LoRAKernelMeta, offsets: Sequence[int],
           add_inputs: bool, lora_ranks=None, bias=None, *, config: dict | None = None,
           deterministic: bool = False, col_scale=None, pairs=None, b_scales=None) -> jax.Array:
    """New y: y[t, off_s:off_s+n_s] = (y if add_inputs else 0) + buf[s, t] @ lora_b[s][idx[t]].T + bias,
    times col_scale[s][idx[t]] where given (DoRA). deterministic: batch-invariant launches
    (configs.deterministic_config). pairs: several adapters per token, summed (buf (S, T, k * r)).
    b_scales: per slice None or the (L, n_s) float32 channel scales of an fp8 B_s."""
    if y.shape[0] == 0:
        return y
    offsets = tuple(int(o) for o in offsets)
    bias = arguments.epilogue(bias, col_scale, len(lora_b))
    interpret = _use_interpreter(y, buf, *lora_b)
    for lo, hi in slice_chunks(len(lora_b), lora_b):
        launch = _expand_launch(buf[None, lo:hi], lora_b[lo:hi], y, meta, offsets[lo:hi], add_inputs, lora_ranks,
                                None if bias is None else tuple(bias[lo:hi]), config, deterministic=deterministic,
                                pairs=pairs, b_scales=_part(b_scales, lo, hi))
        y = _run([launch], [jax.ShapeDtypeStruct(y.shape, y.dtype)], interpret)[0]
    return y


def linear(y, x, lora_a: Sequence[jax.Array], lora_b: Sequence[jax.Array], meta: LoRAKernelMeta,
           scale: float, offsets: Sequence[int], lora_ranks=None, bias=None, *, fused: bool | None = None,
           shrink_config: dict | None = None, expand_config: dict | None = None,
           fused_config: dict | None = None, deterministic: bool = False, col_scale=None, pairs=None,
           a_scales=None, b_scales=None) -> jax.Array:
    """add_lora_linear's math: new y with y[t, slice s] += (scale * x[t] @ A_s[idx].T) @ B_s[idx].T + bias
    (and, where col_scale[s] is given, the slice's new value times col_scale[s][idx[t]]: DoRA).

    The fused one-launch kernel where configs.use_fused says so (or fused=True), else a split-K
    shrink into a float32 workspace plus an expand that sums the workspace planes.
    deterministic=True: always shrink + expand with the batch-invariant configs
    (configs.deterministic_config); fused=True is then an error. pairs: several adapters per token
    (lora_core.adapter_pairs), summed, on either path. a_scales / b_scales: per slice None or the
    channel scales of an fp8 A_s (L, r) / B_s (L, n_s).
    """
    if fused and deterministic:
        raise ValueError("fused=True cannot be deterministic: deterministic launches always run shrink + "
                         "expand (one kernel path for every token count); pass fused=None or False")
    T = x.shape[0]
    if T == 0:
        return y
    L, R, _ = lora_a[0].shape
    offsets = tuple(int(o) for o in offsets)
    bias = arguments.epilogue(bias, col_scale, len(lora_b))
    if deterministic:
        fused = False
    elif fused is None:
        forced = configs.fused_forced()
        fused = forced if forced is not None else configs.use_fused(T, R, len(lora_a), L,
                                                                                  w_dtype=_dtype_name(lora_a[0]))
    interpret = _use_interpreter(y, x, *lora_a)
    on_handler = interpret or _use_ffi()
    fused = fused and on_handler            # jax_triton launches: always shrink + expand
    pdl = _pdl() and on_handler and not interpret
    for lo, hi in slice_chunks(len(lora_a), lora_a, lora_b):
        chunk_bias = None if bias is None else tuple(bias[lo:hi])
        y_shape = jax.ShapeDtypeStruct(y.shape, y.dtype)
        if fused:
            launch = _fused_launch(y, x, lora_a[lo:hi], lora_b[lo:hi], meta, scale, offsets[lo:hi], lora_ranks,
                                   chunk_bias, fused_config, pdl, pairs, _part(a_scales, lo, hi),
                                   _part(b_scales, lo, hi))
            y = _run([launch], [y_shape, _shape(launch.call.pointers[-1])], interpret)[0]
            continue
        shrink_launch = _shrink_launch(x, lora_a[lo:hi], meta, scale, lora_ranks, workspace=True,
                                       config=shrink_config, pdl=pdl, result=1, deterministic=deterministic,
                                       pairs=pairs, a_scales=_part(a_scales, lo, hi))
        workspace = shrink_launch.call.out
        expand_launch = _expand_launch(workspace, lora_b[lo:hi], y, meta, offsets[lo:hi], True, lora_ranks,
                                       chunk_bias, expand_config, pdl, deterministic=deterministic, pairs=pairs,
                                       b_scales=_part(b_scales, lo, hi))
        y = _run([shrink_launch, expand_launch], [y_shape, _shape(workspace)], interpret)[0]
    return y


def deterministic_backend():
    """This backend with batch-invariant launches (`deterministic=True` bound): what
    jax_lora.ops.dispatch hands out for deterministic=True."""
    return _DETERMINISTIC


_DETERMINISTIC = types.SimpleNamespace(
    NAME=NAME, deterministic=True, READS_VIEWS=True, COLUMN_SCALE=True, CUSTOM_CALLS=True,
    shrink=functools.partial(shrink, deterministic=True), expand=functools.partial(expand, deterministic=True),
    linear=functools.partial(linear, deterministic=True))
