"""Small builders and a float64 oracle for torch-side tests written against the public API.

`stacked` draws weights in vLLM's layout, `oracle_linear` is add_lora_linear's math as plain loops
(contract section 5), `wrapper` builds a torch_lora.PunicaWrapper (CPU, 64 tokens) already updated
with a mapping.
"""

from __future__ import annotations

import numpy as np
import torch

from torch_lora import LoRAMapping, PunicaWrapper


def rng(seed=0):
    return np.random.default_rng(seed)


def stacked(rng, num_slots, rank, hidden, widths, dtype=torch.float32):
    """(A list of (L, 1, r, H), B list of (L, 1, n_s, r)) in vLLM's layout."""
    a = [torch.tensor(rng.standard_normal((num_slots, 1, rank, hidden)), dtype=dtype) for _ in widths]
    b = [torch.tensor(rng.standard_normal((num_slots, 1, n, rank)), dtype=dtype) for n in widths]
    return a, b


def oracle_linear(y, x, a, b, bias, scale, idx, widths):
    """float64 NumPy: y[t] += sum_s (scale x[t] A_s[i].T) B_s[i].T + bias_s[i] at the slice offsets."""
    out = y.detach().double().numpy().copy()
    xs = x.detach().double().numpy()
    off = 0
    for s, n in enumerate(widths):
        A = a[s].detach().double().numpy().reshape(a[s].shape[0], -1, xs.shape[1])
        B = b[s].detach().double().numpy().reshape(b[s].shape[0], n, -1)
        for t, i in enumerate(idx):
            if i < 0:
                continue
            delta = (scale * xs[t] @ A[i].T) @ B[i].T
            if bias is not None and bias[s] is not None:
                delta = delta + bias[s].detach().double().numpy().reshape(A.shape[0], n)[i]
            out[t, off:off + n] += delta
        off += n
    return out


def rel(a, b):
    """Relative Frobenius error of `a` against `b` in float64."""
    a = np.asarray(a, np.float64)
    b = np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def wrapper(token_ids, lora_index_to_id, *, prompt_ids=None, num_slots=None, backend="torch", **kw):
    """A CPU PunicaWrapper (64 tokens, 8 batches) updated with `token_ids` (and `prompt_ids`, default
    the same), vocabulary 16; one slot per entry of `lora_index_to_id` unless `num_slots`."""
    num_slots = num_slots or len(lora_index_to_id)
    w = PunicaWrapper(64, 8, "cpu", max_loras=num_slots, backend=backend, **kw)
    prompt_ids = token_ids if prompt_ids is None else prompt_ids
    w.update_metadata(LoRAMapping(tuple(token_ids), tuple(prompt_ids)), list(lora_index_to_id), num_slots + 1, 16)
    return w


def triton_interpreter_runs_loops() -> bool:
    """Whether Triton's interpreter runs the kernels whose loop bounds are scalar arguments (the
    fused linear and MoE kernels): before Triton 3.8 it fails on them ("only 0-dimensional arrays
    can be converted"); the project needs Triton >= 3.8 (pyproject.toml), GPU images may carry an
    older one for the compiled kernels."""
    import triton
    return tuple(int(p) for p in triton.__version__.split(".")[:2]) >= (3, 8)
