"""Slots and the float64 oracle of `gemm_lora` (the base GEMM with the LoRA expand in its epilogue),
shared by its torch tests (tests/test_fused_linear_kernels.py) and its JAX tests
(tests/test_jax_fused_linear.py).

The oracle, in float64, per row m with slot l = slots[m] and per slice s of width n_s at offset off_s:

    ref[m] = (y0[m] or 0) + x[m] @ w.T + bias
    ref[m, off_s : off_s + n_s] += (sum_p buf[p, s, m, :r]) @ B_s[l, :, :r].T     for 0 <= l < num_slots

with r the slot's rank (B_s's rank without per-slot ranks); slots -1 and >= num_slots add no LoRA.
"""

from __future__ import annotations

import numpy as np


def lora_slots(rng, m: int, num_slots: int) -> np.ndarray:
    """(m,) int32 slots: random slots, -1 (no LoRA) for a quarter of the rows and one row past the
    slots (num_slots: no LoRA either) when there is room."""
    s = rng.integers(0, num_slots, m).astype(np.int32)
    if m > 1:
        s[rng.permutation(m)[: max(1, m // 4)]] = -1
    if m > 4:
        s[rng.integers(0, m)] = num_slots
    return s


def gemm_lora_oracle(x, w, bias, buf, b, slots, y0, widths, num_slots: int, ranks=None) -> np.ndarray:
    """The module docstring's ref: x (m, K), w (N, K), bias (N,) or None, buf (planes, S, m, R) or
    None (the GEMM alone), b per slice (L, n_s, R), y0 (m, N) or None, all float64 (buf any float)."""
    ref = x @ w.T + (0 if bias is None else bias[None, :]) + (0 if y0 is None else y0)
    if buf is None:
        return ref
    s_buf = np.asarray(buf, np.float64).sum(0)
    off = 0
    for s, n in enumerate(widths):
        for m, slot in enumerate(slots):
            if 0 <= slot < num_slots:
                r = b[s].shape[2] if ranks is None else ranks[slot]
                ref[m, off:off + n] += s_buf[s, m, :r] @ b[s][slot][:, :r].T
        off += n
    return ref


def rel_err(got, ref) -> float:
    """||got - ref|| / ||ref|| of float64 arrays; fails on a NaN in got (an unwritten output, or
    padding that was read)."""
    got = np.asarray(got, np.float64)
    assert not np.isnan(got).any(), "NaN in the result (an unwritten output, or padding that was read)"
    return float(np.linalg.norm(got - ref) / max(np.linalg.norm(ref), 1e-30))
