"""DoRA (weight-decomposed LoRA) at inference: the per-column scale a DoRA adapter puts on a layer.

Math (PEFT's DoRA linear layer, dropout off). A DoRA adapter on a linear layer W (out, in), bias b,
has lora_A (r, in), lora_B (out, r), scaling s and a magnitude vector m (out,):

    W' = W + s B A                          the adapted weight
    g  = m / ||W'||_row                     ||W'||_row[o] = sqrt(sum_i W'[o, i]^2), one per output
    y  = g * (x W^T + s (x A^T) B^T) + b    = (m / ||W'||_row) * (x W'^T) + b

PEFT computes ||W'|| detached from the graph (it is a constant for the forward pass), so at
inference g is a constant per output column, computed once at load from the frozen base weight:
serving a DoRA adapter is serving its LoRA factors with the layer's output (without its bias)
scaled per column by g. For a plain LoRA slot g = 1.

`column_scale` computes g in float64; a fused layer (q/k/v, gate/up) gets each member's g at that
member's columns.
"""

from __future__ import annotations

import numpy as np

__all__ = ["column_scale"]


def column_scale(weight, lora_a, lora_b, scaling: float, magnitude) -> np.ndarray:
    """g = magnitude / ||weight + scaling * lora_b @ lora_a||_row as float32 (out,).

    weight: (out, in), the base layer's (PyTorch orientation; transpose a Flax kernel (in, out));
    lora_a: (r, in); lora_b: (out, r); magnitude: (out,). Raises ValueError for mismatched shapes or
    a zero row norm (the adapted weight has an all-zero row: g is undefined)."""
    w = np.asarray(weight, np.float64)
    a, b, m = (np.asarray(v, np.float64) for v in (lora_a, lora_b, magnitude))
    if w.ndim != 2 or a.ndim != 2 or b.ndim != 2 or a.shape[1] != w.shape[1] or b.shape != (w.shape[0], a.shape[0]):
        raise ValueError(f"DoRA: weight (out, in) {w.shape}, lora_a (r, in) {a.shape} and lora_b (out, r) {b.shape} "
                         "do not fit together")
    if m.shape != (w.shape[0],):
        raise ValueError(f"DoRA: magnitude must have shape ({w.shape[0]},) (out_features), got {m.shape}")
    norm = np.linalg.norm(w + float(scaling) * (b @ a), axis=1)
    if not np.all(norm > 0):
        raise ValueError(f"DoRA: the adapted weight has {int(np.sum(norm == 0))} all-zero rows: the column scale "
                         "magnitude / norm is undefined there")
    return (m / norm).astype(np.float32)


def epilogue_vectors(bias, col_scale, num_slices: int) -> tuple:
    """(vectors, has_vector, scaled) of a launch's slices: per slice the (L, n_s) vector its expand
    epilogue reads -- a LoRA bias (added) or a DoRA column scale (multiplied) -- or None, whether it
    has one, and whether it is a scale. A slice takes one: both is a ValueError naming the slice (a
    DoRA adapter has no LoRA bias in PEFT). vectors is None when no slice has one."""
    vectors, scaled = [], []
    for s in range(num_slices):
        b = None if bias is None else bias[s]
        g = None if col_scale is None else col_scale[s]
        if b is not None and g is not None:
            raise ValueError(f"slice {s} has both a LoRA bias and a DoRA column scale; the kernels take one (a DoRA "
                             "adapter has no LoRA bias in PEFT)")
        vectors.append(b if g is None else g)
        scaled.append(g is not None)
    has = tuple(v is not None for v in vectors)
    return (tuple(vectors) if any(has) else None), has, tuple(scaled)
