"""torch launchers of the fused linear kernels: the base GEMM with the LoRA expand in its epilogue
(`gemm_lora`) and RMSNorm with the LoRA shrink (`rms_norm_shrink`).

Together they compute a LoRA linear after an RMSNorm without a LoRA kernel on the serial path:

  xn, buf = rms_norm_shrink(h, g, eps, lora_a, slots, scale)     # buf: (P, S, M, R) float32
  y = gemm_lora(xn, W, bias, buf, lora_b, slots, output_slices)   # xn @ W.T + bias + LoRA term

Math: lora_core/kernels/gemm_lora.py and norm_shrink.py. `slots` (M,) int32 holds each row's slot
(-1: no adapter; values >= L are treated as -1); it is not read on the host (no sync), so both
calls can be captured in a CUDA graph and replayed with new slots. Launch configs come from the
tables of lora_core.kernels.fused_linear_configs (the device's tuned table by layer, M and rank,
else by row count M), or `config=` (a dict of the plan's keys). The kernels' parameter lists come
from lora_core.kernels.arguments (`gemm_lora_call`, `norm_shrink_call`), the builder JAX's
launchers use too.

Split-K of the GEMM (config SPLIT_K > 1) uses a float32 workspace (SPLIT_K, M, N) and one int32
counter per output tile, shared by the launches of one (device, stream) (they run one after
another); the kernel leaves the counters at 0. A buffer first needed during a CUDA-graph capture
is allocated in the graph's pool; an outgrown buffer is kept (graphs captured earlier point at it).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from lora_core.kernels.arguments import gemm_lora_call, norm_shrink_call
from lora_core.kernels.fused_linear_configs import GEMM_CONFIGS, NORM_SHRINK_CONFIGS, gemm_config, norm_shrink_config
from lora_core.kernels.gemm_lora import plan_gemm_lora
from lora_core.kernels.launch import triton_launch
from lora_core.kernels.norm_shrink import plan_norm_shrink
from lora_core.kernels.planning import MAX_SLICES, next_pow2

from .api import as_int32, as_lora_ranks, check_tensors, to_3d

__all__ = ["gemm_lora", "rms_norm_shrink", "GEMM_CONFIGS", "NORM_SHRINK_CONFIGS", "gemm_config", "norm_shrink_config"]

_FLOATS = (torch.float16, torch.bfloat16, torch.float32)
_NAMES = {torch.float16: "float16", torch.bfloat16: "bfloat16", torch.float32: "float32"}

# ------------------------------------------------------------------------------------- buffers

_WORKSPACES: dict = {}
_LOCKS: dict = {}
_OUTGROWN: list = []


def _stream_buffer(store: dict, dtype, n: int, device: torch.device) -> torch.Tensor:
    """store's zeroed buffer of (device, current stream), at least n elements (a power of two)."""
    key = (device.index, torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0)
    buf = store.get(key)
    if buf is None or buf.numel() < n:
        if buf is not None:
            _OUTGROWN.append(buf)
        buf = torch.zeros(max(1024, next_pow2(n)), dtype=dtype, device=device)
        store[key] = buf
    return buf


# ------------------------------------------------------------------------------------- checks

def _float(name: str, t: torch.Tensor, dtypes=_FLOATS) -> None:
    if t.dtype not in dtypes:
        raise TypeError(f"{name} must have dtype in {[_NAMES[d] for d in dtypes]}, got {t.dtype}")


def _shape(name: str, t: torch.Tensor, want: tuple, what: str) -> None:
    if tuple(t.shape) != tuple(want):
        raise ValueError(f"{name} must have shape {tuple(want)} ({what}), got {tuple(t.shape)}")


def _slots(slots, m: int) -> torch.Tensor:
    if not isinstance(slots, torch.Tensor):
        raise TypeError(f"slots must be a torch.Tensor of int32 (one slot per row, -1 for none), got "
                        f"{type(slots).__name__}")
    if slots.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"slots must be int32 (or int64), got {slots.dtype}")
    _shape("slots", slots, (m,), "one slot per row of x")
    return as_int32("slots", slots).contiguous()


def _b_slices(lora_b_stacked, widths: tuple) -> tuple:
    b = tuple(lora_b_stacked) if isinstance(lora_b_stacked, (list, tuple)) else (lora_b_stacked,)
    if len(b) != len(widths):
        raise ValueError(f"lora_b_stacked must hold one tensor per output slice ({len(widths)}), got {len(b)}")
    for i, t in enumerate(b):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"lora_b_stacked[{i}] must be a torch.Tensor, got {type(t).__name__}")
    b = tuple(to_3d(t) for t in b)
    lead = (b[0].shape[0], b[0].shape[2]) if b[0].dim() == 3 else None
    for i, (t, n) in enumerate(zip(b, widths)):
        if t.dim() != 3 or t.shape[1] != n or (t.shape[0], t.shape[2]) != lead:
            raise ValueError(f"lora_b_stacked[{i}] must have shape (L, {n}, R) (L, R as slice 0's), got "
                             f"{tuple(t.shape)}")
        _float(f"lora_b_stacked[{i}]", t)
        if t.dtype != b[0].dtype:
            raise TypeError(f"every lora_b_stacked slice must have slice 0's dtype {b[0].dtype}, got {t.dtype} "
                            f"(slice {i})")
    return b


def _a_slices(lora_a_stacked) -> tuple:
    if isinstance(lora_a_stacked, torch.Tensor) and lora_a_stacked.dim() == 4 and lora_a_stacked.shape[1] != 1:
        a = tuple(lora_a_stacked[s] for s in range(lora_a_stacked.shape[0]))      # LoRALinear.lora_a (S, L, R, K)
    else:
        a = tuple(lora_a_stacked) if isinstance(lora_a_stacked, (list, tuple)) else (lora_a_stacked,)
    for i, t in enumerate(a):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"lora_a_stacked[{i}] must be a torch.Tensor, got {type(t).__name__}")
    return tuple(to_3d(t) for t in a)


def _stride(t: torch.Tensor) -> tuple:
    return t.stride()


# ------------------------------------------------------------------------------------- gemm_lora

def gemm_lora(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, buf: torch.Tensor | None,
              lora_b_stacked, slots: torch.Tensor | None, output_slices: Sequence[int] | None,
              y: torch.Tensor | None = None, add_inputs: bool = False, config: dict | None = None, *,
              lora_ranks=None) -> torch.Tensor:
    """y = (y if add_inputs else 0) + x @ weight.T + bias + each row's LoRA term; returns y.

    x: (M, K) float16 / bfloat16 / float32; weight: (N, K), x's dtype; bias: (N,) or None;
    buf: the float32 shrink buffer, (S, M, R) or (P, S, M, R) (P split-K planes, summed), e.g.
    `rms_norm_shrink`'s; lora_b_stacked: S tensors (L, n_s, R) (or (L, 1, n_s, R)), one dtype;
    slots: (M,) int32, or None for the GEMM alone (then buf and lora_b_stacked must be None);
    output_slices: (n_0, ..., n_{S-1}) summing to N (None: one slice); y: (M, N) in x's dtype,
    written whole (allocated when None; needed for add_inputs); lora_ranks: (L,) int32 or None."""
    check_tensors(x=x, weight=weight, bias=bias, buf=buf, y=y, slots=slots,
                  lora_b_stacked=list(lora_b_stacked) if isinstance(lora_b_stacked, (list, tuple))
                  else lora_b_stacked)
    for name, t in (("x", x), ("weight", weight)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    _float("x", x)
    if x.dim() != 2:
        raise ValueError(f"x must be 2-D (M, K), got shape {tuple(x.shape)}")
    m, k = x.shape
    if weight.dim() != 2 or weight.shape[1] != k:
        raise ValueError(f"weight must have shape (N, {k}) (nn.Linear's (out_features, in_features)), got "
                         f"{tuple(weight.shape)}")
    if weight.dtype != x.dtype:
        raise TypeError(f"weight must have x's dtype {x.dtype}, got {weight.dtype}")
    n = weight.shape[0]
    widths = (n,) if output_slices is None else tuple(int(w) for w in output_slices)
    if any(w <= 0 for w in widths) or sum(widths) != n:
        raise ValueError(f"output_slices must be positive widths adding up to weight's {n} rows, got {widths}")
    if bias is not None:
        _float("bias", bias)
        _shape("bias", bias, (n,), "one value per output column")
    if y is None:
        if add_inputs:
            raise ValueError("add_inputs=True needs y (the values the result is added to)")
        y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    else:
        _shape("y", y, (m, n), "rows of x, columns of weight")
        if y.dtype != x.dtype:
            raise TypeError(f"y must have x's dtype {x.dtype}, got {y.dtype}")
    has_lora = slots is not None
    if has_lora:
        if buf is None or lora_b_stacked is None:
            raise ValueError("slots given: buf and lora_b_stacked are needed too (slots=None runs the GEMM alone)")
        slots = _slots(slots, m)
        b = _b_slices(lora_b_stacked, widths)
        num_slots, rank = b[0].shape[0], b[0].shape[2]
        _float("buf", buf, (torch.float32,))
        if buf.dim() == 3:
            buf = buf.unsqueeze(0)
        if buf.dim() != 4 or tuple(buf.shape[1:]) != (len(widths), m, rank):
            raise ValueError(f"buf must have shape ({len(widths)}, {m}, {rank}) or (P, {len(widths)}, {m}, {rank}) "
                             f"(slices, rows of x, lora_b's rank), got {tuple(buf.shape)}")
        ranks = as_lora_ranks(lora_ranks, num_slots, x.device)
    else:
        if buf is not None or lora_b_stacked is not None or lora_ranks is not None:
            raise ValueError("slots=None runs the GEMM alone: buf, lora_b_stacked and lora_ranks must be None too")
        b, num_slots, rank, ranks = (weight,), 0, 16, None
    if m == 0:
        return y
    cfg = dict(config) if config else gemm_config(m, widths, k, rank if has_lora else None)
    plan = plan_gemm_lora(m, n, k, widths, rank, _NAMES[x.dtype], _NAMES[weight.dtype],
                          _NAMES[b[0].dtype] if has_lora else None, cfg, has_bias=bias is not None,
                          add_inputs=add_inputs, has_lora=has_lora, has_ranks=ranks is not None)
    ws = lock = None
    if plan.split_k > 1:
        ws = _stream_buffer(_WORKSPACES, torch.float32, plan.split_k * m * n, x.device)
        lock = _stream_buffer(_LOCKS, torch.int32, plan.grid[0], x.device)
    triton_launch(gemm_lora_call(plan, x, weight, bias, buf if has_lora else None, b if has_lora else None,
                                 slots if has_lora else None, ranks, y, ws, lock, _stride))
    return y


# ------------------------------------------------------------------------------------- rms_norm_shrink

def rms_norm_shrink(h: torch.Tensor, norm_weight: torch.Tensor, eps: float, lora_a_stacked, slots, scale: float,
                    out: torch.Tensor | None = None, buf: torch.Tensor | None = None, *, lora_ranks=None,
                    config: dict | None = None) -> tuple:
    """(out, buf): out = RMSNorm(h) * norm_weight rounded as Hugging Face's LlamaRMSNorm, in h's
    dtype; buf[p, s, m] = scale * out[m, chunk p] @ A_s[slots[m], :, chunk p].T (float32, summed
    over p by `gemm_lora`; zeros for slot -1).

    h: (M, K) float16 / bfloat16 / float32; norm_weight: (K,) (any float dtype: the product is taken
    in float32 and cast to h's dtype); lora_a_stacked: S tensors (L, R, K) (or (L, 1, R, K), or
    LoRALinear's (S, L, R, K)), one dtype, or None with slots None: the norm alone (buf None);
    slots: (M,) int32; out: (M, K) in h's dtype; buf: (P, S, M, R) float32 (P sets the split of K;
    allocated with the config's when None) or (S, M, R) (P = 1); lora_ranks: (L,) int32 or None."""
    check_tensors(h=h, norm_weight=norm_weight, out=out, buf=buf, slots=slots,
                  lora_a_stacked=list(lora_a_stacked) if isinstance(lora_a_stacked, (list, tuple))
                  else lora_a_stacked)
    for name, t in (("h", h), ("norm_weight", norm_weight)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    _float("h", h)
    if h.dim() != 2:
        raise ValueError(f"h must be 2-D (M, K), got shape {tuple(h.shape)}")
    m, k = h.shape
    _float("norm_weight", norm_weight)
    _shape("norm_weight", norm_weight, (k,), "one weight per column of h")
    if not isinstance(eps, (int, float)) or isinstance(eps, bool) or not eps >= 0:
        raise ValueError(f"eps must be a float >= 0, got {eps!r}")
    if out is None:
        out = torch.empty_like(h, memory_format=torch.contiguous_format)
    else:
        _shape("out", out, (m, k), "h's shape")
        if out.dtype != h.dtype:
            raise TypeError(f"out must have h's dtype {h.dtype}, got {out.dtype}")
    has_lora = slots is not None
    if has_lora:
        if lora_a_stacked is None:
            raise ValueError("slots given: lora_a_stacked is needed too (slots=None runs the norm alone)")
        a = _a_slices(lora_a_stacked)
        if not 1 <= len(a) <= MAX_SLICES:
            raise ValueError(f"lora_a_stacked must hold 1 to {MAX_SLICES} slices, got {len(a)}")
        for i, t in enumerate(a):
            if t.dim() != 3 or t.shape[2] != k or tuple(t.shape[:2]) != tuple(a[0].shape[:2]):
                raise ValueError(f"lora_a_stacked[{i}] must have shape (L, R, {k}) (L, R as slice 0's), got "
                                 f"{tuple(t.shape)}")
            _float(f"lora_a_stacked[{i}]", t)
            if t.dtype != a[0].dtype:
                raise TypeError(f"every lora_a_stacked slice must have slice 0's dtype {a[0].dtype}, got {t.dtype} "
                                f"(slice {i})")
        if not isinstance(scale, (int, float)) or isinstance(scale, bool):
            raise TypeError(f"scale must be a float, got {type(scale).__name__}")
        slots = _slots(slots, m)
        num_slots, rank = a[0].shape[0], a[0].shape[1]
        ranks = as_lora_ranks(lora_ranks, num_slots, h.device)
        cfg = dict(config) if config else norm_shrink_config(m, rank)
        if buf is not None:
            _float("buf", buf, (torch.float32,))
            if buf.dim() == 3:
                buf = buf.unsqueeze(0)
            if buf.dim() != 4 or tuple(buf.shape[1:]) != (len(a), m, rank):
                raise ValueError(f"buf must have shape (P, {len(a)}, {m}, {rank}) or ({len(a)}, {m}, {rank}) "
                                 f"(planes, slices, rows of h, lora_a's rank), got {tuple(buf.shape)}")
    else:
        if lora_a_stacked is not None or buf is not None or lora_ranks is not None:
            raise ValueError("slots=None runs the norm alone: lora_a_stacked, buf and lora_ranks must be None too")
        a, num_slots, rank, ranks = (norm_weight.view(1, 1, k),), 0, 16, None
        cfg = dict(config) if config else norm_shrink_config(m, rank)
        cfg["LORA_MODE"] = "none"
    plan = plan_norm_shrink(m, k, rank, len(a), _NAMES[h.dtype], _NAMES[a[0].dtype], cfg,
                            has_ranks=ranks is not None, planes=None if buf is None else buf.shape[0])
    if has_lora and buf is None:
        buf = torch.empty(plan.planes, len(a), m, rank, dtype=torch.float32, device=h.device)
    if m == 0:
        return out, buf
    triton_launch(norm_shrink_call(plan, h, norm_weight, a if has_lora else None, slots if has_lora else None,
                                   ranks, out, buf if has_lora else None, eps, scale if has_lora else 1.0, _stride))
    return out, buf
