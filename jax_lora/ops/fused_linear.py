"""The fused linear kernels for JAX: the base GEMM with the LoRA expand in its epilogue
(`gemm_lora`) and RMSNorm with the LoRA shrink (`rms_norm_shrink`), functional and jittable.

Together they compute a LoRA linear after an RMSNorm without a LoRA kernel on the serial path:

  xn, buf = rms_norm_shrink(h, g, eps, lora_a, slots, scale)      # buf: (P, S, M, R) float32
  y = gemm_lora(xn, W, bias, buf, lora_b, slots, output_slices)    # xn @ W.T + bias + LoRA term

with, per row m of slot i = slots[m] (no term for -1 or i >= L) and output slice s:

  xn[m]       = g * RMSNorm(h[m])         (rounded as Hugging Face's LlamaRMSNorm, in h's dtype)
  buf[p, s, m] = scale * xn[m, chunk p] @ A_s[i, :, chunk p].T        (P split-K planes of K)
  y[m, slice s] = xn[m] @ W[slice s].T + bias[slice s] + (sum_p buf[p, s, m]) @ B_s[i].T

Math and launch plans: lora_core/kernels/gemm_lora.py and norm_shrink.py; launch configs:
lora_core.kernels.fused_linear_configs (the device's tuned table by layer, M and rank, else by row
count M; or `config=`); parameter lists: lora_core.kernels.arguments (`gemm_lora_call`,
`norm_shrink_call`), the builder the torch launchers (torch_lora.ops.fused_linear) use too, so
both frameworks launch identical kernels.

Launching is backend "triton"'s (jax_lora.ops.triton): one XLA FFI call per op on a CUDA GPU
(command-buffer compatible; the norm is inside the custom call, so XLA cannot split the fusion
around it), Triton's interpreter inside `jax.pure_callback` on the CPU with TRITON_INTERPRET=1.
The jax_triton launcher cannot run them (the norm's kernel writes xn mid-list, the split-K GEMM
needs the handler's barrier counters): a RuntimeError says so. Split-K of the GEMM (config
SPLIT_K > 1) takes a float32 workspace (SPLIT_K, M, N), a second result of the call, and one
counter per output tile from the handler's persistent buffer (the kernel leaves them at 0).

Weights: W is (N, K), K contiguous (torch's nn.Linear layout, the one whose tiles the kernel reads
in long runs); a Flax kernel (in, out) is W.T (jax_lora.nn.MultiLoRALinear keeps a transposed
copy when its fused path is on). lora_a / lora_b are S per-slice arrays, or the stacked arrays
jax_lora.nn.MultiLoRALinear holds, read in place (`jax_lora.ops.triton.View`): lora_a (S, L, R, K),
lora_b (L, N, R) with slice s at columns off_s .. off_s + n_s.

Not supported (ValueError / TypeError here; the model's fused path refuses them by name): several
adapters per token (adapter pairs), fp8 adapter weights, DoRA column scales, batch-invariant
(deterministic) launches.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from lora_core.kernels import arguments
from lora_core.kernels.fused_linear_configs import gemm_config, norm_shrink_config
from lora_core.kernels.gemm_lora import plan_gemm_lora
from lora_core.kernels.norm_shrink import plan_norm_shrink
from lora_core.kernels.planning import MAX_SLICES

from . import triton as triton_ops

__all__ = ["gemm_lora", "rms_norm_shrink"]

_FLOATS = ("float16", "bfloat16", "float32")


# ------------------------------------------------------------------------------------- checks

def _array(name: str, a):
    """a as a jax array (a View stays a View); TypeError for anything without a shape and dtype."""
    if isinstance(a, triton_ops.View):
        return a
    if isinstance(a, (jax.Array, np.ndarray)):
        return jnp.asarray(a)
    raise TypeError(f"{name} must be a jax.Array, got {type(a).__name__}")


def _dtype(a) -> str:
    return jnp.dtype(a.dtype).name


def _float(name: str, a, dtypes=_FLOATS) -> None:
    if _dtype(a) not in dtypes:
        raise TypeError(f"{name} must have dtype in {list(dtypes)}, got {_dtype(a)}")


def _shape(name: str, a, want: tuple, what: str) -> None:
    if tuple(a.shape) != tuple(want):
        raise ValueError(f"{name} must have shape {tuple(want)} ({what}), got {tuple(a.shape)}")


def _slots(slots, m: int):
    slots = _array("slots", slots)
    if isinstance(slots, triton_ops.View) or _dtype(slots) not in ("int32", "int64"):
        raise TypeError(f"slots must be an int32 array (one slot per row, -1 for none), got {_dtype(slots)}")
    _shape("slots", slots, (m,), "one slot per row")
    return slots.astype(jnp.int32)


def _ranks(lora_ranks, num_slots: int):
    if lora_ranks is None:
        return None
    ranks = _array("lora_ranks", lora_ranks)
    _shape("lora_ranks", ranks, (num_slots,), "one rank per slot")
    if _dtype(ranks) not in ("int32", "int64"):
        raise TypeError(f"lora_ranks must be int32, got {_dtype(ranks)}")
    return ranks.astype(jnp.int32)


def _one_dtype(name: str, slices: Sequence) -> None:
    for i, t in enumerate(slices):
        _float(f"{name}[{i}]", t)
        if _dtype(t) != _dtype(slices[0]):
            raise TypeError(f"every {name} slice must have slice 0's dtype {_dtype(slices[0])}, got {_dtype(t)} "
                            f"(slice {i})")


def _b_slices(lora_b, widths: tuple) -> tuple:
    """lora_b as S (L, n_s, R) slices: a sequence as given, or one (L, N, R) array read as views."""
    if isinstance(lora_b, (list, tuple)):
        b = tuple(_array(f"lora_b_stacked[{i}]", t) for i, t in enumerate(lora_b))
        if len(b) != len(widths):
            raise ValueError(f"lora_b_stacked must hold one array per output slice ({len(widths)}), got {len(b)}")
    else:
        stacked = _array("lora_b_stacked", lora_b)
        if stacked.ndim != 3 or stacked.shape[1] != sum(widths):
            raise ValueError(f"lora_b_stacked must be (L, {sum(widths)}, R) (the slices side by side) or one "
                             f"(L, n_s, R) array per slice, got shape {tuple(stacked.shape)}")
        if len(widths) == 1:
            b = (stacked,)
        else:
            if isinstance(stacked, triton_ops.View):
                raise TypeError("lora_b_stacked as a View must be given per slice")
            offsets = np.cumsum((0,) + widths[:-1])
            b = tuple(triton_ops.view(stacked, (slice(None), slice(int(o), int(o) + n)))
                      for o, n in zip(offsets, widths))
    lead = (b[0].shape[0], b[0].shape[-1]) if b[0].ndim == 3 else None
    for i, (t, n) in enumerate(zip(b, widths)):
        if t.ndim != 3 or t.shape[1] != n or (t.shape[0], t.shape[2]) != lead:
            raise ValueError(f"lora_b_stacked[{i}] must have shape (L, {n}, R) (L, R as slice 0's), got "
                             f"{tuple(t.shape)}")
    _one_dtype("lora_b_stacked", b)
    return b


def _a_slices(lora_a, k: int) -> tuple:
    """lora_a as S (L, R, K) slices: a sequence as given, or one (S, L, R, K) array read as views."""
    if isinstance(lora_a, (list, tuple)):
        a = tuple(_array(f"lora_a_stacked[{i}]", t) for i, t in enumerate(lora_a))
    else:
        stacked = _array("lora_a_stacked", lora_a)
        if stacked.ndim == 3:
            a = (stacked,)
        elif stacked.ndim == 4 and not isinstance(stacked, triton_ops.View):
            a = tuple(triton_ops.view(stacked, (s,)) for s in range(stacked.shape[0]))
        else:
            raise ValueError(f"lora_a_stacked must be (S, L, R, {k}), (L, R, {k}) or one (L, R, {k}) array per "
                             f"slice, got shape {tuple(stacked.shape)}")
    if not 1 <= len(a) <= MAX_SLICES:
        raise ValueError(f"lora_a_stacked must hold 1 to {MAX_SLICES} slices, got {len(a)}")
    for i, t in enumerate(a):
        if t.ndim != 3 or t.shape[2] != k or tuple(t.shape[:2]) != tuple(a[0].shape[:2]):
            raise ValueError(f"lora_a_stacked[{i}] must have shape (L, R, {k}) (L, R as slice 0's), got "
                             f"{tuple(t.shape)}")
    _one_dtype("lora_a_stacked", a)
    return a


def _scalar(name: str, v, minimum=None) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float, np.integer, np.floating)):
        raise TypeError(f"{name} must be a Python float (a launch constant), got {type(v).__name__}")
    if minimum is not None and not v >= minimum:
        raise ValueError(f"{name} must be a float >= {minimum}, got {v!r}")
    return float(v)


def _run(launch, results: list, arrays: Sequence) -> list:
    """The launch through the FFI handler (GPU) or the interpreter (CPU)."""
    interpret = triton_ops._use_interpreter(*arrays)
    if not interpret and not triton_ops._use_ffi():
        from . import ffi_launcher
        raise RuntimeError("jax_lora.ops.fused_linear runs through the XLA FFI launcher, which cannot be used here "
                           f"({ffi_launcher.unavailable_reason()}); jax_triton cannot launch these kernels")
    return triton_ops._run([launch], results, interpret)


# ------------------------------------------------------------------------------------- gemm_lora

def gemm_lora(x, weight, bias=None, buf=None, lora_b_stacked=None, slots=None,
              output_slices: Sequence[int] | None = None, y=None, add_inputs: bool = False,
              config: dict | None = None, *, lora_ranks=None) -> jax.Array:
    """New y (M, N) in x's dtype: (y if add_inputs else 0) + x @ weight.T + bias + each row's LoRA term
    (sum_p buf[p, s, m]) @ B_s[slots[m]].T at slice s's columns (none for slot -1 or >= L).

    x: (M, K) float16 / bfloat16 / float32; weight: (N, K), x's dtype; bias: (N,) or None;
    buf: the float32 shrink buffer, (S, M, R) or (P, S, M, R) (P split-K planes, summed), e.g.
    `rms_norm_shrink`'s; lora_b_stacked: S arrays (L, n_s, R) of one dtype, or one (L, N, R)
    array with the slices side by side (read in place); slots: (M,) int32, or None for the GEMM
    alone (then buf, lora_b_stacked and lora_ranks must be None); output_slices: (n_0, ...)
    summing to N (None: one slice); y: (M, N) in x's dtype, read with add_inputs; lora_ranks:
    (L,) int32 or None (each slot's real rank: columns past it are never read).
    """
    x, weight = _array("x", x), _array("weight", weight)
    _float("x", x)
    if x.ndim != 2:
        raise ValueError(f"x must be 2-D (M, K), got shape {tuple(x.shape)}")
    m, k = (int(d) for d in x.shape)
    if weight.ndim != 2 or weight.shape[1] != k:
        raise ValueError(f"weight must have shape (N, {k}) (out_features, in_features: a Flax kernel transposed), "
                         f"got {tuple(weight.shape)}")
    if _dtype(weight) != _dtype(x):
        raise TypeError(f"weight must have x's dtype {_dtype(x)}, got {_dtype(weight)}")
    n = int(weight.shape[0])
    widths = (n,) if output_slices is None else tuple(int(w) for w in output_slices)
    if any(w <= 0 for w in widths) or sum(widths) != n:
        raise ValueError(f"output_slices must be positive widths adding up to weight's {n} rows, got {widths}")
    if len(widths) > MAX_SLICES:
        raise ValueError(f"gemm_lora takes at most {MAX_SLICES} output slices, got {len(widths)}")
    if bias is not None:
        bias = _array("bias", bias)
        _float("bias", bias)
        _shape("bias", bias, (n,), "one value per output column")
    if add_inputs:
        if y is None:
            raise ValueError("add_inputs=True needs y (the values the result is added to)")
        y = _array("y", y)
        _shape("y", y, (m, n), "rows of x, columns of weight")
        if _dtype(y) != _dtype(x):
            raise TypeError(f"y must have x's dtype {_dtype(x)}, got {_dtype(y)}")
    has_lora = slots is not None
    if has_lora:
        if buf is None or lora_b_stacked is None:
            raise ValueError("slots given: buf and lora_b_stacked are needed too (slots=None runs the GEMM alone)")
        slots = _slots(slots, m)
        b = _b_slices(lora_b_stacked, widths)
        num_slots, rank = int(b[0].shape[0]), int(b[0].shape[2])
        buf = _array("buf", buf)
        _float("buf", buf, ("float32",))
        if buf.ndim == 3:
            buf = buf[None]
        if buf.ndim != 4 or tuple(buf.shape[1:]) != (len(widths), m, rank):
            raise ValueError(f"buf must have shape ({len(widths)}, {m}, {rank}) or (P, {len(widths)}, {m}, {rank}) "
                             f"(slices, rows of x, lora_b's rank), got {tuple(buf.shape)}")
        ranks = _ranks(lora_ranks, num_slots)
    else:
        if buf is not None or lora_b_stacked is not None or lora_ranks is not None:
            raise ValueError("slots=None runs the GEMM alone: buf, lora_b_stacked and lora_ranks must be None too")
        b, rank, ranks = None, 16, None
    result = jax.ShapeDtypeStruct((m, n), x.dtype)
    if m == 0:
        return y if add_inputs else jnp.zeros((0, n), x.dtype)
    cfg = dict(config) if config else gemm_config(m, widths, k, rank if has_lora else None)
    plan = plan_gemm_lora(m, n, k, widths, rank, _dtype(x), _dtype(weight), _dtype(b[0]) if has_lora else None,
                          cfg, has_bias=bias is not None, add_inputs=bool(add_inputs), has_lora=has_lora,
                          has_ranks=ranks is not None)
    out = y if add_inputs else triton_ops._Result(0, (m, n), x.dtype)
    results = [result]
    workspace = lock = None
    if plan.split_k > 1:
        workspace = triton_ops._Result(1, (plan.split_k, m, n), jnp.float32)
        lock = triton_ops._Counters(plan.grid[0])
        results.append(triton_ops._shape(workspace))
    call = arguments.gemm_lora_call(plan, x, weight, bias, buf if has_lora else None, b, slots, ranks, out,
                                    workspace, lock, triton_ops._strides)
    return _run(triton_ops._Launch(call, 0), results, (x, weight))[0]


# ------------------------------------------------------------------------------------- rms_norm_shrink

def rms_norm_shrink(h, norm_weight, eps: float, lora_a_stacked, slots, scale: float, *, lora_ranks=None,
                    planes: int | None = None, config: dict | None = None) -> tuple:
    """(xn, buf): xn = RMSNorm(h) * norm_weight rounded as Hugging Face's LlamaRMSNorm, in h's dtype
    (rstd = 1 / sqrt(mean_k h^2 + eps) in float32, h * rstd cast to h's dtype, times norm_weight in
    float32, cast again); buf[p, s, m] = scale * xn[m, chunk p] @ A_s[slots[m], :, chunk p].T
    (float32, summed over p by `gemm_lora`; zeros for slot -1 or >= L).

    h: (M, K) float16 / bfloat16 / float32; norm_weight: (K,) (any float dtype); eps: float >= 0;
    lora_a_stacked: S arrays (L, R, K) of one dtype, or one (S, L, R, K) array (read in place), or
    None with slots None: the norm alone (buf None); slots: (M,) int32; scale: float; lora_ranks:
    (L,) int32 or None; planes: P, the split of K (default: the config's SPLIT_K). buf is
    (P, S, M, R) float32.
    """
    h, norm_weight = _array("h", h), _array("norm_weight", norm_weight)
    _float("h", h)
    if h.ndim != 2:
        raise ValueError(f"h must be 2-D (M, K), got shape {tuple(h.shape)}")
    m, k = (int(d) for d in h.shape)
    _float("norm_weight", norm_weight)
    _shape("norm_weight", norm_weight, (k,), "one weight per column of h")
    eps = _scalar("eps", eps, minimum=0.0)
    has_lora = slots is not None
    if has_lora:
        if lora_a_stacked is None:
            raise ValueError("slots given: lora_a_stacked is needed too (slots=None runs the norm alone)")
        a = _a_slices(lora_a_stacked, k)
        scale = _scalar("scale", scale)
        slots = _slots(slots, m)
        num_slots, rank = int(a[0].shape[0]), int(a[0].shape[1])
        ranks = _ranks(lora_ranks, num_slots)
        cfg = dict(config) if config else norm_shrink_config(m, rank)
    else:
        if lora_a_stacked is not None or lora_ranks is not None:
            raise ValueError("slots=None runs the norm alone: lora_a_stacked and lora_ranks must be None too")
        a, rank, ranks = None, 16, None
        cfg = dict(config) if config else norm_shrink_config(m, rank)
        cfg["LORA_MODE"] = "none"
    if planes is not None and (isinstance(planes, bool) or not isinstance(planes, int) or planes < 1):
        raise ValueError(f"planes must be an int >= 1 (the split of K), got {planes!r}")
    plan = plan_norm_shrink(m, k, rank, len(a) if has_lora else 1, _dtype(h), _dtype(a[0]) if has_lora else _dtype(h),
                            cfg, has_ranks=ranks is not None, planes=planes)
    buf_shape = (plan.planes, len(a), m, rank) if has_lora else None
    if m == 0:
        return jnp.zeros((0, k), h.dtype), None if buf_shape is None else jnp.zeros(buf_shape, jnp.float32)
    xn = triton_ops._Result(0, (m, k), h.dtype)
    buf = triton_ops._Result(1, buf_shape, jnp.float32) if has_lora else None
    call = arguments.norm_shrink_call(plan, h, norm_weight, a, slots, ranks, xn, buf, eps,
                                      scale if has_lora else 1.0, triton_ops._strides)
    results = [triton_ops._shape(xn)] + ([triton_ops._shape(buf)] if has_lora else [])
    out = _run(triton_ops._Launch(call, 1 if has_lora else 0), results, (h, norm_weight))
    return out[0], (out[1] if has_lora else None)
