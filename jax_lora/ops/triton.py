"""Backend "triton" for JAX: the shared Triton kernels (`jax_lora.kernels.lora_triton`) under jit.

On a GPU the kernels are called through `jax_triton.triton_call` (a custom call inside the jitted
program; y is aliased in and out, so XLA can update it in place). The grids and meta-parameters come
from the same `plan_*` functions the torch side uses, so both sides run identical kernels.

On the CPU (tests), with TRITON_INTERPRET=1 set before import, the same kernels run in Triton's
interpreter through `jax.pure_callback` (the interpreter needs torch tensors, so torch is imported
lazily there). Without the interpreter a clear error says what to do.

Contract (jax_lora.ops.dispatch): shrink -> (S, T, r) float32; expand -> new y; `linear` is the
add_lora_linear path (y + sum_s slices, add_inputs=True): split-K shrink into a workspace + expand,
or the one-launch fused kernel where the tuned table says it wins. jax_triton cannot launch with
programmatic dependent launch, so the JAX side runs the kernels with USE_PDL off (same results).
"""

from __future__ import annotations

import os
from typing import Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from ..kernels import configs
from ..kernels import lora_triton as K
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


# --------------------------------------------------------------------------------- GPU (jax_triton)

def _gpu_shrink(x, lora_a, meta, scale, lora_ranks, *, workspace: bool, config=None):
    """(planes, S, T, r) float32 (planes = 1 unless workspace split-K)."""
    jt = _jt()
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
                         aligned=K.all_aligned(hinted))
    a = list(lora_a) + [lora_a[0]] * (MAX_SLICES - S)
    return jt.triton_call(
        x, *a, _ranks(lora_ranks, counts), mapping, sorted_ids, counts, starts, active,
        float(scale), T, H, sorted_ids.shape[0], L,
        *K.row_major_strides(x.shape), *_wstrides(lora_a),
        *K.row_major_strides(out_shape.shape),
        kernel=K.lora_shrink_kernel, out_shape=out_shape, grid=plan.grid,
        num_warps=plan.num_warps, num_stages=plan.num_stages,
        zeroed_outputs=(0,) if plan.atomic else (), **plan.constexprs)


def _gpu_expand(buf4, lora_b, y, meta, offsets, add_inputs, lora_ranks, bias, config=None):
    jt = _jt()
    mapping, sorted_ids, counts, starts, active = _meta_arrays(meta)
    T = y.shape[0]
    L, _, R = lora_b[0].shape
    widths = tuple(int(b.shape[1]) for b in lora_b)
    c_ptrs, c_strides, flags = _bias(bias, 0, len(lora_b), lora_b[0])
    cfg = config or configs.expand_config(T, max(widths), R, len(widths), L)
    hinted = [*widths, *offsets, *K.row_major_strides(buf4.shape)[:3], K.row_major_strides(y.shape)[0],
              *c_strides[0::2]] + [v for w in lora_b for v in K.row_major_strides(w.shape)[:2]]
    plan = K.plan_expand(T, R, widths, active.shape[0], buf4.shape[0], _dn(lora_b[0]), _dn(y), cfg,
                         add_inputs=add_inputs, bias_flags=flags, has_ranks=lora_ranks is not None,
                         aligned=K.all_aligned(hinted))
    b = list(lora_b) + [lora_b[0]] * (MAX_SLICES - len(lora_b))
    args = [buf4, *b, *c_ptrs, _ranks(lora_ranks, counts), mapping, sorted_ids, counts, starts, active, y]
    y_index = len(args) - 1
    return jt.triton_call(
        *args, T, sorted_ids.shape[0], L,
        *K.row_major_strides(buf4.shape), *_wstrides(lora_b), *c_strides,
        *K.pad4(widths, 0), *K.pad4(offsets, 0), *K.row_major_strides(y.shape),
        kernel=K.lora_expand_kernel, out_shape=jax.ShapeDtypeStruct(y.shape, y.dtype), grid=plan.grid,
        num_warps=plan.num_warps, num_stages=plan.num_stages,
        input_output_aliases={y_index: 0}, **plan.constexprs)


def _gpu_fused(y, x, lora_a, lora_b, meta, scale, offsets, lora_ranks, bias, config=None):
    jt = _jt()
    mapping, sorted_ids, counts, starts, active = _meta_arrays(meta)
    T, H = x.shape
    L, R, _ = lora_a[0].shape
    widths = tuple(int(b.shape[1]) for b in lora_b)
    c_ptrs, c_strides, flags = _bias(bias, 0, len(lora_b), lora_b[0])
    cfg = config or configs.fused_config(T, H, max(widths), R, len(widths), L)
    hinted = [H, *widths, *offsets, K.row_major_strides(x.shape)[0], K.row_major_strides(y.shape)[0],
              *c_strides[0::2]] + [v for w in (*lora_a, *lora_b) for v in K.row_major_strides(w.shape)[:2]]
    plan = K.plan_fused(T, H, R, widths, active.shape[0], _dn(x), _dn(lora_a[0]), cfg, add_inputs=True,
                        bias_flags=flags, has_ranks=lora_ranks is not None, aligned=K.all_aligned(hinted))
    a = list(lora_a) + [lora_a[0]] * (MAX_SLICES - len(lora_a))
    b = list(lora_b) + [lora_b[0]] * (MAX_SLICES - len(lora_b))
    args = [x, *a, *b, *c_ptrs, _ranks(lora_ranks, counts), mapping, sorted_ids, counts, starts, active, y]
    y_index = len(args) - 1
    return jt.triton_call(
        *args, float(scale), T, H, sorted_ids.shape[0], L,
        *K.row_major_strides(x.shape), *_wstrides(lora_a), *_wstrides(lora_b), *c_strides,
        *K.pad4(widths, 0), *K.pad4(offsets, 0), *K.row_major_strides(y.shape),
        kernel=K.lora_fused_kernel, out_shape=jax.ShapeDtypeStruct(y.shape, y.dtype), grid=plan.grid,
        num_warps=plan.num_warps, num_stages=plan.num_stages,
        input_output_aliases={y_index: 0}, **plan.constexprs)


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
        fused = configs.use_fused(T, H, R, len(lora_a), L)
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
    for lo, hi in _chunks(len(lora_a)):
        c = None if bias is None else tuple(bias[lo:hi])
        if fused:
            y = _gpu_fused(y, x, lora_a[lo:hi], lora_b[lo:hi], meta, scale, offsets[lo:hi], lora_ranks, c,
                           config=fused_config)
        else:
            ws = _gpu_shrink(x, lora_a[lo:hi], meta, scale, lora_ranks, workspace=True, config=shrink_config)
            y = _gpu_expand(ws, lora_b[lo:hi], y, meta, offsets[lo:hi], True, lora_ranks, c,
                            config=expand_config)
    return y
