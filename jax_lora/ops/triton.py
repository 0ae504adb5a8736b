"""Backend "triton" for JAX: the shared Triton kernels (`lora_core.kernels.lora_triton`) under jit.

On a CUDA GPU the kernels are compiled by Triton and launched by an XLA FFI handler
(`ffi_launcher`): one custom call per operation (add_lora_linear's shrink and expand are one call
with two launches, the expand a programmatic dependent of the shrink on Hopper), declared
command-buffer compatible so XLA records it into its CUDA graphs; y is aliased in and out, so XLA
updates it in place. Without a C compiler, on a non-CUDA GPU, or with
JAX_LORA_TRITON_LAUNCHER=jax_triton, `jax_triton.triton_call` launches them instead (a legacy
custom call, launched from the host one by one, without PDL). The grids and meta-parameters come
from the same `plan_*` functions the torch side uses, so both sides run identical kernels.

On the CPU (tests), with TRITON_INTERPRET=1 set before import, the same kernels run in Triton's
interpreter through `jax.pure_callback` (the interpreter needs torch tensors, so torch is imported
lazily there). Without the interpreter a clear error says what to do.

Contract (jax_lora.ops.dispatch): shrink -> (S, T, r) float32; expand -> new y; `linear` is the
add_lora_linear path (y + sum_s slices, add_inputs=True): split-K shrink into a workspace + expand,
or the one-launch fused kernel where the tuned table says it wins (FFI launcher only; its barrier
counters are the handler's persistent per-device buffer, `ffi_launcher.Counters`).
"""
from __future__ import annotations

import functools
import os
from typing import NamedTuple, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from lora_core.kernels import configs
from lora_core.kernels import lora_triton as K
from ..meta import LoRAKernelMeta

NAME = "triton"
MAX_SLICES = K.MAX_SLICES


def _dn(a) -> str:
    return jnp.dtype(a.dtype).name


def _chunks(n: int):
    return [(i, min(i + MAX_SLICES, n)) for i in range(0, n, MAX_SLICES)]


def _platform(*arrays) -> str:
    for a in arrays:
        if isinstance(a, jax.Array) and not isinstance(a, jax.core.Tracer):
            try:
                return next(iter(a.devices())).platform
            except Exception:  # noqa: BLE001
                pass
    return jax.default_backend()


def _use_interpreter(*arrays) -> bool:
    if _platform(*arrays) in ("gpu", "cuda"):
        return False
    if not K.interpreting():
        raise RuntimeError("backend 'triton' on the CPU runs Triton's interpreter: set TRITON_INTERPRET=1 "
                           "before importing jax_lora (or run on a CUDA GPU, or use backend='xla')")
    return True


def _jt():
    # jax_triton sets os.environ["TRITON_CACHE_DIR"] = "" when imported, which breaks every later
    # Triton compile of other callers in this process (torch_lora: "Could not create or locate
    # cache dir"). Restore the caller's setting.
    prev = os.environ.get("TRITON_CACHE_DIR")
    try:
        import jax_triton as jt  # noqa: PLC0415 - optional GPU dependency
    except ImportError as e:  # pragma: no cover - depends on the machine
        raise RuntimeError("backend 'triton' on the GPU needs the jax-triton package "
                           "(pip install jax-triton)") from e
    finally:
        if prev is None:
            os.environ.pop("TRITON_CACHE_DIR", None)
        else:
            os.environ["TRITON_CACHE_DIR"] = prev
    return jt


def _meta_arrays(meta: LoRAKernelMeta):
    return (meta.token_lora_mapping, meta.token_indices_sorted_by_lora_ids, meta.num_tokens_per_lora,
            meta.lora_token_start_loc, meta.active_lora_ids)


def _jax_strides(a) -> tuple:
    return K.row_major_strides(a.shape)


def _wstrides(ws) -> list:
    return K.slice_weight_strides(ws, _jax_strides)


def _bias(bias, lo, hi, dummy):
    return K.bias_args(bias, lo, hi, dummy, _jax_strides)


def _ranks(lora_ranks, counts):
    return counts if lora_ranks is None else jnp.asarray(lora_ranks, jnp.int32)


# --------------------------------------------------------------------------------- GPU
#
# Each kernel call is first described as a `_Spec`: the kernel, its plan, its non-constexpr
# parameters in order (arrays, Python scalars, or WORKSPACE: the shrink's output inside a combined
# call) and its output. The default launcher (ffi_launcher: an XLA FFI handler that XLA can record
# into its command buffers) runs specs; jax_triton's `triton_call` is the fallback
# (JAX_LORA_TRITON_LAUNCHER=jax_triton, or no C compiler / non-CUDA GPU).

# Whether jit-compiled calls follow the tuned table's fused classes, as torch does (same kernels,
# same numerics on both sides). It was off while the JAX fused call zeroed its barrier counters
# with a memset node per call (T1: 14.0-14.4 us against 7.8-10.3 for the two-kernel call); with the
# handler's persistent counters the two are within JAX's run-to-run spread (T1 s1 8.9 vs 11.1, s3
# 10.1 vs 9.4 us; H200 2026-11-30, benchmarks/results/jax_fused_vs_two_kernel_20261130T1405.md).
JAX_FUSED_BY_TABLE = True

WORKSPACE = object()  # parameter placeholder: the workspace written by the shrink of the same call
SYNC = object()       # parameter placeholder: the fused kernel's barrier counters (the handler's)


class _Spec(NamedTuple):
    kernel: object
    plan: object
    values: list          # the kernel's parameters before out_ptr
    out_shape: jax.ShapeDtypeStruct
    y_pos: int = -1       # position in values of the array the output aliases (-1: none)
    extra: tuple = ()     # (result index, ShapeDtypeStruct) of the WORKSPACE / SYNC results it needs


def _is_array(v) -> bool:
    return hasattr(v, "shape") and hasattr(v, "dtype") and not isinstance(v, (int, float, np.generic))


@functools.lru_cache(maxsize=None)
def _pdl() -> bool:
    """Programmatic dependent launch for the FFI launcher's shrink -> expand (Hopper and newer)."""
    if not K.HAVE_PDL or os.environ.get("JAX_LORA_TRITON_PDL", "1") == "0":
        return False
    devices = [d for d in jax.local_devices() if d.platform == "gpu"]
    return bool(devices) and int(devices[0].compute_capability.split(".")[0]) >= 9


def _shrink_spec(x, lora_a, meta, scale, lora_ranks, *, workspace: bool, config=None, pdl=False) -> _Spec:
    """lora_shrink_kernel's launch; its output is (planes, S, T, r) float32 (planes = 1 unless workspace split-K)."""
    mapping, sorted_ids, counts, starts, active = _meta_arrays(meta)
    T, H = x.shape
    L, R, _ = lora_a[0].shape
    S = len(lora_a)
    cfg = config or configs.shrink_config(T, H, R, S, L)
    split = K.plan_shrink(T, H, R, S, active.shape[0], _dn(x), _dn(lora_a[0]), cfg, lora_only=workspace,
                          workspace=workspace, has_ranks=lora_ranks is not None).num_partials
    out_shape = jax.ShapeDtypeStruct((split, S, T, R), jnp.float32)
    hinted = [H, *K.row_major_strides(x.shape)[:1], *K.row_major_strides(out_shape.shape)[:3]]
    hinted += [v for w in lora_a for v in K.row_major_strides(w.shape)[:2]]
    plan = K.plan_shrink(T, H, R, S, active.shape[0], _dn(x), _dn(lora_a[0]), cfg, lora_only=workspace,
                         workspace=workspace, has_ranks=lora_ranks is not None,
                         aligned=K.all_aligned(hinted), pdl=pdl)
    a = list(lora_a) + [lora_a[0]] * (MAX_SLICES - S)
    values = [x, *a, _ranks(lora_ranks, counts), mapping, sorted_ids, counts, starts, active,
              float(scale), T, H, sorted_ids.shape[0], L,
              *K.row_major_strides(x.shape), *_wstrides(lora_a), *K.row_major_strides(out_shape.shape)]
    return _Spec(K.lora_shrink_kernel, plan, values, out_shape)


def _expand_spec(buf, buf_shape, lora_b, y, meta, offsets, add_inputs, lora_ranks, bias, config=None,
                 pdl=False) -> _Spec:
    """lora_expand_kernel's launch; buf: the (planes, S, T, r) workspace array, or WORKSPACE."""
    mapping, sorted_ids, counts, starts, active = _meta_arrays(meta)
    T = y.shape[0]
    L, _, R = lora_b[0].shape
    widths = tuple(int(b.shape[1]) for b in lora_b)
    c_ptrs, c_strides, flags = _bias(bias, 0, len(lora_b), lora_b[0])
    cfg = config or configs.expand_config(T, max(widths), R, len(widths), L)
    hinted = [*widths, *offsets, *K.row_major_strides(buf_shape)[:3], K.row_major_strides(y.shape)[0],
              *c_strides[0::2]] + [v for w in lora_b for v in K.row_major_strides(w.shape)[:2]]
    plan = K.plan_expand(T, R, widths, active.shape[0], buf_shape[0], _dn(lora_b[0]), _dn(y), cfg,
                         add_inputs=add_inputs, bias_flags=flags, has_ranks=lora_ranks is not None,
                         aligned=K.all_aligned(hinted), pdl=pdl)
    b = list(lora_b) + [lora_b[0]] * (MAX_SLICES - len(lora_b))
    values = [buf, *b, *c_ptrs, _ranks(lora_ranks, counts), mapping, sorted_ids, counts, starts, active, y]
    y_pos = len(values) - 1
    values += [T, sorted_ids.shape[0], L, *K.row_major_strides(buf_shape), *_wstrides(lora_b), *c_strides,
               *K.pad4(widths, 0), *K.pad4(offsets, 0), *K.row_major_strides(y.shape)]
    return _Spec(K.lora_expand_kernel, plan, values, jax.ShapeDtypeStruct(y.shape, y.dtype), y_pos)


def _fused_spec(y, x, lora_a, lora_b, meta, scale, offsets, lora_ranks, bias, config=None, pdl=False) -> _Spec:
    """lora_fused_kernel's launch: result 0 is y, 1 the float32 workspace; its barrier counters are
    the FFI handler's persistent per-device buffer (SYNC)."""
    mapping, sorted_ids, counts, starts, active = _meta_arrays(meta)
    T, H = x.shape
    L, R, _ = lora_a[0].shape
    widths = tuple(int(b.shape[1]) for b in lora_b)
    c_ptrs, c_strides, flags = _bias(bias, 0, len(lora_b), lora_b[0])
    cfg = config or configs.fused_config(T, H, max(widths), R, len(widths), L)
    args = (T, H, R, widths, active.shape[0], _dn(x), _dn(lora_a[0]), cfg)
    kw = dict(add_inputs=True, bias_flags=flags, has_ranks=lora_ranks is not None, pdl=pdl)
    ws_shape = K.plan_fused(*args, **kw).workspace_shape
    hinted = [H, *widths, *offsets, K.row_major_strides(x.shape)[0], K.row_major_strides(y.shape)[0],
              *K.row_major_strides(ws_shape)[:3], *c_strides[0::2]]
    hinted += [v for w in (*lora_a, *lora_b) for v in K.row_major_strides(w.shape)[:2]]
    plan = K.plan_fused(*args, aligned=K.all_aligned(hinted), **kw)
    a = list(lora_a) + [lora_a[0]] * (MAX_SLICES - len(lora_a))
    b = list(lora_b) + [lora_b[0]] * (MAX_SLICES - len(lora_b))
    values = [x, *a, *b, *c_ptrs, _ranks(lora_ranks, counts), mapping, sorted_ids, counts, starts, active, y,
              SYNC, WORKSPACE]
    y_pos = len(values) - 3
    values += [float(scale), T, H, sorted_ids.shape[0], L,
               *K.row_major_strides(x.shape), *_wstrides(lora_a), *_wstrides(lora_b), *c_strides,
               *K.pad4(widths, 0), *K.pad4(offsets, 0), *K.row_major_strides(y.shape),
               *K.row_major_strides(ws_shape)[:3]]
    extra = ((1, jax.ShapeDtypeStruct(ws_shape, jnp.float32)),)
    return _Spec(K.lora_fused_kernel, plan, values, jax.ShapeDtypeStruct(y.shape, y.dtype), y_pos, extra)


def _run_jax_triton(spec: _Spec):
    jt = _jt()
    aliases = {spec.y_pos: 0} if spec.y_pos >= 0 else {}
    zeroed = (0,) if getattr(spec.plan, "atomic", False) else ()
    return jt.triton_call(*spec.values, kernel=spec.kernel, out_shape=spec.out_shape, grid=spec.plan.grid,
                          num_warps=spec.plan.num_warps, num_stages=spec.plan.num_stages,
                          input_output_aliases=aliases, zeroed_outputs=zeroed, **spec.plan.constexprs)


def _run_ffi(specs: Sequence[_Spec], outs: Sequence[int], pdl: Sequence[bool] = ()) -> list:
    """One FFI call running `specs` in order; spec i writes result outs[i] (results are numbered
    0.. by outs; a spec whose output aliases its y operand updates y in place). WORKSPACE
    parameters are result 1. Returns the results."""
    from . import ffi_launcher as F  # noqa: PLC0415
    operands, index, aliases, launches = [], {}, {}, []
    results = {}
    for i, spec in enumerate(specs):
        results.setdefault(outs[i], spec.out_shape)
        for j, shape in spec.extra:
            results.setdefault(j, shape)
        params = []
        for pos, v in enumerate(spec.values):
            if v is WORKSPACE:
                params.append(F.Out(1))
            elif v is SYNC:
                params.append(F.Counters(spec.plan.sync_ints))
            elif _is_array(v):
                if id(v) not in index:
                    index[id(v)] = len(operands)
                    operands.append(v)
                params.append(F.Arg(index[id(v)]))
                if pos == spec.y_pos:
                    aliases[index[id(v)]] = outs[i]
            else:
                params.append(v)
        params.append(F.Out(outs[i]))
        launches.append(F.Launch(spec.kernel, spec.plan.grid, spec.plan.num_warps, spec.plan.num_stages,
                                 spec.plan.constexprs, tuple(params),
                                 zero_out=outs[i] if getattr(spec.plan, "atomic", False) else -1,
                                 pdl=bool(pdl[i]) if pdl else False,
                                 cooperative=bool(getattr(spec.plan, "cooperative", False))))
    shapes = [results[j] for j in range(len(results))]
    return F.call(launches, operands, shapes, aliases)


def _use_ffi() -> bool:
    from . import ffi_launcher as F  # noqa: PLC0415
    return F.available()


def _gpu_shrink(x, lora_a, meta, scale, lora_ranks, *, workspace: bool, config=None):
    """(planes, S, T, r) float32 (planes = 1 unless workspace split-K)."""
    spec = _shrink_spec(x, lora_a, meta, scale, lora_ranks, workspace=workspace, config=config)
    return _run_ffi([spec], [0])[0] if _use_ffi() else _run_jax_triton(spec)


def _gpu_expand(buf4, lora_b, y, meta, offsets, add_inputs, lora_ranks, bias, config=None):
    spec = _expand_spec(buf4, buf4.shape, lora_b, y, meta, offsets, add_inputs, lora_ranks, bias, config)
    return _run_ffi([spec], [0])[0] if _use_ffi() else _run_jax_triton(spec)


def _gpu_fused(y, x, lora_a, lora_b, meta, scale, offsets, lora_ranks, bias, config=None):
    """The fused kernel in one FFI call (FFI launcher only: jax_triton cannot provide its
    workspace and barrier words, see `linear`)."""
    pdl = _pdl()
    spec = _fused_spec(y, x, lora_a, lora_b, meta, scale, offsets, lora_ranks, bias, config, pdl=pdl)
    return _run_ffi([spec], [0], [pdl])[0]


def _gpu_linear_two_kernel(y, x, lora_a, lora_b, meta, scale, offsets, lora_ranks, bias, shrink_config,
                           expand_config):
    """Split-K shrink into a float32 workspace, then the expand; one FFI call with both launches
    (the expand a programmatic dependent of the shrink on Hopper) or two jax_triton calls."""
    if not _use_ffi():
        ws = _run_jax_triton(_shrink_spec(x, lora_a, meta, scale, lora_ranks, workspace=True,
                                          config=shrink_config))
        return _run_jax_triton(_expand_spec(ws, ws.shape, lora_b, y, meta, offsets, True, lora_ranks, bias,
                                            expand_config))
    pdl = _pdl()
    shrink = _shrink_spec(x, lora_a, meta, scale, lora_ranks, workspace=True, config=shrink_config, pdl=pdl)
    expand = _expand_spec(WORKSPACE, shrink.out_shape.shape, lora_b, y, meta, offsets, True, lora_ranks, bias,
                          expand_config, pdl=pdl)
    return _run_ffi([shrink, expand], [1, 0], [pdl, pdl])[0]


# --------------------------------------------------------------------------------- CPU (interpreter)

def _to_torch(a):
    import torch  # noqa: PLC0415 - the interpreter works on torch tensors
    a = np.asarray(a)
    if a.dtype.name == "bfloat16":
        return torch.from_numpy(np.array(a.view(np.int16))).view(torch.bfloat16)
    return torch.from_numpy(np.array(a))


def _to_numpy(t, dtype):
    import torch  # noqa: PLC0415
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(dtype)
    return t.numpy().astype(dtype, copy=False)


def _meta_tuple(meta_np):
    mapping, sorted_ids, counts, starts, active = (_to_torch(m) for m in meta_np)
    return (mapping, sorted_ids, counts, starts, active, None)


def _interp_call(fn, out_aval, *arrays):
    return jax.pure_callback(fn, out_aval, *arrays, vmap_method="sequential")


# --------------------------------------------------------------------------------- backend API

def shrink(x, lora_a: Sequence[jax.Array], meta: LoRAKernelMeta, scale: float, lora_ranks=None, *,
           config: Optional[dict] = None) -> jax.Array:
    """(S, T, r) float32: scale * x[t] @ lora_a[s][idx[t]].T, 0 for tokens without LoRA."""
    T = x.shape[0]
    S, R = len(lora_a), lora_a[0].shape[1]
    if T == 0:
        return jnp.zeros((S, 0, R), jnp.float32)
    if _use_interpreter(x, *lora_a):
        from torch_lora.ops import triton as TT  # noqa: PLC0415

        def host(x_, ranks_, m0, m1, m2, m3, m4, *a_):
            out = _to_torch(np.zeros((S, T, R), np.float32))
            TT.shrink(_to_torch(x_), tuple(_to_torch(a) for a in a_), out, _meta_tuple((m0, m1, m2, m3, m4)),
                      scale, None if lora_ranks is None else _to_torch(ranks_), config=config)
            return out.numpy()

        ranks = _ranks(lora_ranks, meta.num_tokens_per_lora)
        return _interp_call(host, jax.ShapeDtypeStruct((S, T, R), jnp.float32), x, ranks,
                            *_meta_arrays(meta), *lora_a)
    parts = [_gpu_shrink(x, lora_a[lo:hi], meta, scale, lora_ranks, workspace=False, config=config)[0]
             for lo, hi in _chunks(S)]
    return parts[0] if len(parts) == 1 else jnp.concatenate(parts)


def expand(buf, lora_b: Sequence[jax.Array], y, meta: LoRAKernelMeta, offsets: Sequence[int],
           add_inputs: bool, lora_ranks=None, bias=None, *, config: Optional[dict] = None) -> jax.Array:
    """New y: y[t, off_s:off_s+n_s] = (y if add_inputs else 0) + buf[s, t] @ lora_b[s][idx[t]].T + bias."""
    if y.shape[0] == 0:
        return y
    offsets = tuple(int(o) for o in offsets)
    if _use_interpreter(y, buf, *lora_b):
        from torch_lora.ops import triton as TT  # noqa: PLC0415
        S = len(lora_b)
        bias_idx = [s for s in range(S) if bias is not None and bias[s] is not None]

        def host(buf_, y_, ranks_, m0, m1, m2, m3, m4, *rest):
            b_, c_ = rest[:S], rest[S:]
            cs = [None] * S
            for s, c in zip(bias_idx, c_):
                cs[s] = _to_torch(c)
            yt = _to_torch(y_)
            TT.expand(_to_torch(buf_), tuple(_to_torch(b) for b in b_), yt, _meta_tuple((m0, m1, m2, m3, m4)),
                      offsets, add_inputs, None if lora_ranks is None else _to_torch(ranks_),
                      None if bias is None else cs, config=config)
            return _to_numpy(yt, y_.dtype)

        ranks = _ranks(lora_ranks, meta.num_tokens_per_lora)
        return _interp_call(host, jax.ShapeDtypeStruct(y.shape, y.dtype), buf, y, ranks, *_meta_arrays(meta),
                            *lora_b, *[bias[s] for s in bias_idx])
    for lo, hi in _chunks(len(lora_b)):
        y = _gpu_expand(buf[None, lo:hi], lora_b[lo:hi], y, meta, offsets[lo:hi], add_inputs, lora_ranks,
                        None if bias is None else tuple(bias[lo:hi]), config=config)
    return y


def linear(y, x, lora_a: Sequence[jax.Array], lora_b: Sequence[jax.Array], meta: LoRAKernelMeta,
           scale: float, offsets: Sequence[int], lora_ranks=None, bias=None, *, fused: Optional[bool] = None,
           shrink_config: Optional[dict] = None, expand_config: Optional[dict] = None,
           fused_config: Optional[dict] = None) -> jax.Array:
    """add_lora_linear's math: new y with y[t, slice s] += (scale * x[t] @ A_s[idx].T) @ B_s[idx].T + bias.

    The fused one-launch kernel where configs.use_fused says so (or fused=True), else a split-K
    shrink into a float32 workspace plus an expand that sums the workspace planes.
    """
    T, H = x.shape
    if T == 0:
        return y
    L, R, _ = lora_a[0].shape
    offsets = tuple(int(o) for o in offsets)
    if fused is None:
        forced = configs.fused_forced()
        fused = forced if forced is not None else (
            configs.use_fused(T, H, R, len(lora_a), L) and (K.interpreting() or JAX_FUSED_BY_TABLE))
    if _use_interpreter(y, x, *lora_a):
        from torch_lora.ops import triton as TT  # noqa: PLC0415
        S = len(lora_b)
        bias_idx = [s for s in range(S) if bias is not None and bias[s] is not None]

        def host(y_, x_, ranks_, m0, m1, m2, m3, m4, *rest):
            a_, b_, c_ = rest[:S], rest[S:2 * S], rest[2 * S:]
            cs = [None] * S
            for s, c in zip(bias_idx, c_):
                cs[s] = _to_torch(c)
            yt = _to_torch(y_)
            TT.linear(yt, _to_torch(x_), tuple(_to_torch(a) for a in a_), tuple(_to_torch(b) for b in b_),
                      _meta_tuple((m0, m1, m2, m3, m4)), scale, offsets,
                      None if lora_ranks is None else _to_torch(ranks_), None if bias is None else cs,
                      fused=fused, shrink_config=shrink_config, expand_config=expand_config,
                      fused_config=fused_config)
            return _to_numpy(yt, y_.dtype)

        ranks = _ranks(lora_ranks, meta.num_tokens_per_lora)
        return _interp_call(host, jax.ShapeDtypeStruct(y.shape, y.dtype), y, x, ranks, *_meta_arrays(meta),
                            *lora_a, *lora_b, *[bias[s] for s in bias_idx])
    fused = fused and _use_ffi()         # jax_triton launches: always shrink + expand
    for lo, hi in _chunks(len(lora_a)):
        c = None if bias is None else tuple(bias[lo:hi])
        if fused:
            y = _gpu_fused(y, x, lora_a[lo:hi], lora_b[lo:hi], meta, scale, offsets[lo:hi], lora_ranks, c,
                           config=fused_config)
        else:
            y = _gpu_linear_two_kernel(y, x, lora_a[lo:hi], lora_b[lo:hi], meta, scale, offsets[lo:hi],
                                       lora_ranks, c, shrink_config, expand_config)
    return y
