"""Random multi-LoRA linear problems on the CUDA device and their float64 reference, for the GPU
tests of the compiled Triton kernels (tests/test_gpu_triton.py, tests/test_gpu_fp8.py).

`linear_problem` draws x (T, H), per slice A (L, R, H) / sqrt(H) and B (L, n_s, R) / sqrt(R), each
token's slot among D chosen slots (a fraction `frac_none` of them -1: no LoRA), the kernel metadata
(capacity T + 5), optional per-slot ranks in [0, R] and optional per-slice biases (none for slice 1),
all from one seed. `ref_linear` is add_lora_linear's math in float64 (contract section 5):

    out[t, off_s : off_s + n_s] = y[t] + (scale * x[t] @ A_s[idx[t], :k].T) @ B_s[idx[t], :, :k].T + c_s[idx[t]]

with k the slot's rank (R without ranks), rows with idx -1 unchanged.
"""

from __future__ import annotations

import math

import numpy as np
import torch


def linear_problem(T, H, R, widths, L, D, dtype, seed, frac_none=0.2, ranks=False, bias=False, kind="dec"):
    """(x, a, b, idx, meta, ranks or None, bias or None) on "cuda". kind "dec": slots in random
    order; "pre": sorted (prefill-like runs of one slot)."""
    from torch_lora.meta import LoRAKernelMeta
    g = torch.Generator(device="cuda").manual_seed(seed)
    kw = dict(device="cuda", generator=g)
    rng = np.random.default_rng(seed)
    x = torch.randn(T, H, **kw).to(dtype)
    a = [(torch.randn(L, R, H, **kw) / math.sqrt(H)).to(dtype) for _ in widths]
    b = [(torch.randn(L, n, R, **kw) / math.sqrt(R)).to(dtype) for n in widths]
    chosen = rng.choice(L, size=min(D, L), replace=False)
    if kind == "dec":
        idx = chosen[rng.integers(0, len(chosen), T)]
    else:
        idx = np.sort(chosen[rng.integers(0, len(chosen), T)])
    idx = np.where(rng.random(T) < frac_none, -1, idx).astype(np.int32)
    meta = LoRAKernelMeta.make(L, T + 5, "cuda")
    meta.prepare_tensors(torch.from_numpy(idx).cuda())
    rk = torch.from_numpy(rng.integers(0, R + 1, L).astype(np.int32)).cuda() if ranks else None
    c = [(torch.randn(L, n, **kw)).to(dtype) if i != 1 else None for i, n in enumerate(widths)] if bias else None
    return x, a, b, idx, meta, rk, c


def ref_linear(y, x, a, b, idx, scale, offsets, ranks=None, bias=None):
    """float64 (module docstring): a and b per slice, in any dtype (float64 ones, e.g. dequantised
    fp8 weights, are used as they are)."""
    out = y.double().clone()
    x = x.double()
    for slot in np.unique(idx):
        if slot < 0:
            continue
        rows = torch.from_numpy(np.nonzero(idx == slot)[0]).cuda()
        for s, (aa, bb, off) in enumerate(zip(a, b, offsets)):
            A, B = aa[slot].double(), bb[slot].double()
            if ranks is not None:
                k = int(ranks[slot])
                A, B = A[:k], B[:, :k]
            d = (scale * x[rows] @ A.T) @ B.T
            if bias is not None and bias[s] is not None:
                d = d + bias[s][slot].double()
            out[rows, off:off + bb.shape[1]] += d
    return out
