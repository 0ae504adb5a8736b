"""Deterministic mode (`deterministic=True`): a request's rows are bitwise the same in every batch.

One request (a few tokens of one adapter, fixed inputs) is served alone and inside random batches
of 1-64 tokens: random neighbours with random adapters (and tokens without LoRA), the request at a
random position. Its rows of lora_shrink, lora_expand and add_lora_linear (through a
`PunicaWrapper(..., deterministic=True)`) must be bitwise equal to the rows it gets alone, and the
same batch run twice must give the same bits. Every result is also checked against the float64
oracle, so a deterministic path that computes the wrong thing fails too.

On the CPU: the reference backends (xla, torch) and the Triton kernels in Triton's interpreter;
tests/test_gpu_deterministic.py runs the compiled kernels on a GPU.
"""

from __future__ import annotations

import numpy as np
import pytest

from . import oracle
from .impls import IMPLS, round_to

NAMES = ("jax-xla", "jax-pallas_tpu", "jax-triton", "torch-ref", "torch-triton")
DET_IMPLS = [pytest.param(impl, id=impl.name, marks=impl.marks) for impl in IMPLS if impl.name in NAMES]

HIDDEN, RANK, SLOTS, SLICES = 64, 32, 4, (24, 8)
REQUEST_TOKENS, REQUEST_SLOT = 3, 1
SCALE = 0.5
BATCH_SIZES = (1, 5, 16, 23, 40, 64)


class Traffic:
    """Weights, one request and random batches around it (NumPy, already rounded to `dtype`)."""

    def __init__(self, dtype: str, seed: int = 0):
        rng = self.rng = np.random.default_rng(seed)
        self.dtype = dtype
        self.lora_a = [round_to(rng.standard_normal((SLOTS, 1, RANK, HIDDEN)) / 8, dtype) for _ in SLICES]
        self.lora_b = [round_to(rng.standard_normal((SLOTS, 1, n, RANK)) / 4, dtype) for n in SLICES]
        self.bias = [round_to(rng.standard_normal((SLOTS, n)), dtype) for n in SLICES]
        self.req_x = round_to(rng.standard_normal((REQUEST_TOKENS, HIDDEN)), dtype)
        self.req_y = round_to(rng.standard_normal((REQUEST_TOKENS, sum(SLICES) + 3)), dtype)
        self.req_buf = rng.standard_normal((len(SLICES), REQUEST_TOKENS, RANK)).astype(np.float32)

    def batch(self, size: int):
        """(x, y, buf, idx, rows): a batch of `size` tokens holding the request's tokens at `rows`
        (the request is cut to the batch when the batch is smaller)."""
        rng = self.rng
        n = min(REQUEST_TOKENS, size)
        start = int(rng.integers(0, size - n + 1))
        rows = np.arange(start, start + n)
        idx = rng.integers(-1, SLOTS, size).astype(np.int32)
        idx[rows] = REQUEST_SLOT
        x = round_to(rng.standard_normal((size, HIDDEN)), self.dtype)
        y = round_to(rng.standard_normal((size, sum(SLICES) + 3)), self.dtype)
        buf = rng.standard_normal((len(SLICES), size, RANK)).astype(np.float32)
        x[rows], y[rows], buf[:, rows] = self.req_x[:n], self.req_y[:n], self.req_buf[:, :n]
        return x, y, buf, idx, rows


def _ids(idx):
    return tuple(0 if i < 0 else 101 + int(i) for i in idx)


def run_ops(impl, traffic: Traffic, x, y, buf, idx):
    """(shrink (S, T, r), expand y, add_lora_linear y) of one batch, deterministic, as float64 NumPy."""
    from lora_core.host_mapping import LoRAMapping

    dt = traffic.dtype
    a = [impl.arr(w, dt) for w in traffic.lora_a]
    b = [impl.arr(w, dt) for w in traffic.lora_b]
    meta = impl.meta(idx, SLOTS, capacity=len(idx) + 2)
    kw = dict(backend=impl.backend, deterministic=True)
    xs = impl.arr(x, dt)
    if impl.side == "jax":
        shrunk = impl.ops.lora_shrink(xs, a, meta, SCALE, **kw)
        expanded = impl.ops.lora_expand(impl.arr(buf, "float32"), b, impl.arr(y, dt), meta, 0, True, **kw)
    else:
        import torch
        shrunk = torch.full((len(SLICES), len(idx), RANK), float("nan"), dtype=torch.float32, device=impl.device)
        impl.ops.lora_shrink(xs, a, shrunk, *meta.meta_args(len(idx)), SCALE, **kw)
        expanded = impl.arr(y, dt)
        impl.ops.lora_expand(impl.arr(buf, "float32"), b, expanded, *meta.meta_args(len(idx)), offset_start=0,
                             add_inputs=True, **kw)
    device = None if impl.side == "jax" else impl.device
    w = impl.pkg.PunicaWrapper(64, 4, device, max_loras=SLOTS, backend=impl.backend, deterministic=True)
    w.update_metadata(LoRAMapping(_ids(idx), _ids(idx[:1])), [101 + s for s in range(SLOTS)], SLOTS + 1, 32)
    linear = w.add_lora_linear(impl.arr(y, dt), xs, a, b, [impl.arr(v, dt) for v in traffic.bias], SCALE, SLICES)
    return impl.to_np(shrunk), impl.to_np(expanded), impl.to_np(linear)


def _check_oracle(traffic, x, y, buf, idx, got):
    shrunk, expanded, linear = got
    tol = oracle.TOL[traffic.dtype]
    assert oracle.rel_err(shrunk, oracle.shrink(x, traffic.lora_a, idx, SCALE)) <= tol
    assert oracle.rel_err(expanded, oracle.expand(buf, traffic.lora_b, y, idx, 0, True)) <= tol
    want = oracle.lora_linear(y, x, traffic.lora_a, traffic.lora_b, traffic.bias, SCALE, idx)
    assert oracle.rel_err(linear, want) <= tol


def _request_rows(got, rows):
    shrunk, expanded, linear = got
    return (shrunk[:, rows].tobytes(), expanded[rows].tobytes(), linear[rows].tobytes())


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("impl", DET_IMPLS)
def test_request_rows_bitwise_equal_in_every_batch(impl, dtype):
    traffic = Traffic(dtype)
    alone = {}
    for n in range(1, REQUEST_TOKENS + 1):  # the request alone, and its first n tokens alone
        x, y, buf = traffic.req_x[:n], traffic.req_y[:n], traffic.req_buf[:, :n]
        idx = np.full(n, REQUEST_SLOT, np.int32)
        got = run_ops(impl, traffic, x, y, buf, idx)
        _check_oracle(traffic, x, y, buf, idx, got)
        alone[n] = got
    for size in BATCH_SIZES:
        x, y, buf, idx, rows = traffic.batch(size)
        got = run_ops(impl, traffic, x, y, buf, idx)
        _check_oracle(traffic, x, y, buf, idx, got)
        want = _request_rows(alone[len(rows)], np.arange(len(rows)))
        for what, g, w in zip(("lora_shrink", "lora_expand", "add_lora_linear"), _request_rows(got, rows), want):
            assert g == w, f"{what}: the request's rows differ in a batch of {size} (rows {rows[0]}..{rows[-1]})"
        if size == BATCH_SIZES[-1]:  # run to run: the same batch again
            assert _request_rows(run_ops(impl, traffic, x, y, buf, idx), slice(None)) == _request_rows(got, slice(None))


@pytest.mark.parametrize("impl", [pytest.param(i, id=i.side) for i in IMPLS if i.name in ("jax-xla", "torch-ref")])
def test_deterministic_must_be_a_bool(impl):
    with pytest.raises(TypeError, match="deterministic must be a bool, got 'yes'"):
        impl.pkg.PunicaWrapper(8, 2, None if impl.side == "jax" else "cpu", max_loras=2, deterministic="yes")
    x = impl.arr(np.zeros((2, 16), np.float32))
    a = impl.arr(np.zeros((2, 4, 16), np.float32))
    with pytest.raises(TypeError, match="deterministic must be a bool, got 1"):
        impl.ops.bgmv_shrink(x, a, impl.idx([0, 1]), 1.0, backend=impl.backend, deterministic=1)


def test_triton_linear_refuses_fused_and_deterministic():
    torch = pytest.importorskip("torch")
    import jax.numpy as jnp
    from jax_lora.ops import triton as jax_triton
    from torch_lora.ops import triton as torch_triton
    y, x = torch.zeros(2, 16), torch.zeros(2, 16)
    with pytest.raises(ValueError, match="fused=True cannot be deterministic"):
        torch_triton.linear(y, x, (torch.zeros(2, 4, 16),), (torch.zeros(2, 16, 4),), None, 1.0, (0,),
                            fused=True, deterministic=True)
    with pytest.raises(ValueError, match="fused=True cannot be deterministic"):
        jax_triton.linear(jnp.zeros((2, 16)), jnp.zeros((2, 16)), (jnp.zeros((2, 4, 16)),), (jnp.zeros((2, 16, 4)),),
                          None, 1.0, (0,), fused=True, deterministic=True)
