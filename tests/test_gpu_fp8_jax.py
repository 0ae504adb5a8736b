"""fp8 (e4m3) adapter weights on the JAX ops on a CUDA GPU, through the default GPU backend (marked
`gpu`; run on the device machine).

The ops run with backend=None, so the device picks "triton"; the fp8 scales must reach its kernels
(jax_lora.ops.triton's a_scales / b_scales): a backend that does not apply them hands the call to
the xla reference and says so on the `jax_lora` logger, which these tests refuse. They pass once the
Triton fp8 path is in jax_lora/ops/triton.py. Checked against the float64 oracle on the dequantised
weights (bf16 activations: relative error 2e-2; float32: 1e-5), plain and under jit through the
wrapper (add_lora_linear_stacked, as MultiLoRALinear calls it).
"""

from __future__ import annotations

import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_lora import ops
from jax_lora.meta import build_kernel_meta
from jax_lora.ops import dispatch

from . import jax_helpers, oracle
from .test_fp8_jax_conformance import dequantise, quantise

pytestmark = pytest.mark.gpu

FALLBACK = "does not apply fp8 weight scales"


def _gpu():
    if jax.default_backend() != "gpu":
        pytest.skip("needs a CUDA GPU for JAX")
    return jax.devices("gpu")[0]


@pytest.mark.parametrize("dtype,tol", [("float32", 1e-5), ("bfloat16", 2e-2)])
def test_jax_fp8_ops_on_the_default_gpu_backend(caplog, dtype, tol):
    """lora_shrink + lora_expand with fp8 A and B (two slices, one 16-bit B) and bgmv_expand with a
    per-tensor scale on the device's default backend ("triton"), no fallback to the reference."""
    dev = _gpu()
    assert dispatch.default_backend_name(dev) == "triton"
    rng = np.random.default_rng(0)
    slots, rank, hidden, widths, t = 4, 16, 256, (128, 64), 40
    idx = rng.integers(-1, slots, t).astype(np.int32)
    x = np.asarray(jnp.asarray(rng.standard_normal((t, hidden)).astype(np.float32), dtype))
    a = [quantise(rng.standard_normal((slots, rank, hidden)).astype(np.float32) / 16) for _ in widths]
    qb0, sb0 = quantise(rng.standard_normal((slots, widths[0], rank)).astype(np.float32) / 4)
    b1 = np.asarray(jnp.asarray(rng.standard_normal((slots, widths[1], rank)).astype(np.float32) / 4, dtype))
    y = np.asarray(jnp.asarray(rng.standard_normal((t, sum(widths))).astype(np.float32), dtype))
    put = lambda v: jax.device_put(v, dev)
    meta = jax.device_put(build_kernel_meta(idx, t, max_loras=slots), dev)
    with caplog.at_level(logging.INFO, logger="jax_lora"):
        buf = ops.lora_shrink(put(x), [put(q) for q, _ in a], meta, 0.5, lora_a_scale=[put(s) for _, s in a])
        out = ops.lora_expand(buf, [put(qb0), put(b1)], put(y), meta, 0, True, lora_b_scale=[put(sb0), None])
        yb = ops.bgmv_expand(buf[0], put(qb0), put(y[:, :128]), put(idx), True, w_scale=put(sb0[:, 0].copy()))
    assert FALLBACK not in caplog.text
    want_buf = oracle.shrink(x, [dequantise(q, s) for q, s in a], idx, 0.5)
    assert oracle.rel_err(np.asarray(buf), want_buf) < tol
    want = oracle.expand(want_buf, [dequantise(qb0, sb0), b1], y, idx, 0, True)
    assert oracle.rel_err(np.asarray(out, np.float32), want) < tol
    per_tensor = dequantise(qb0, np.broadcast_to(sb0[:, :1], sb0.shape))
    want_b = oracle.expand(want_buf[:1], [per_tensor], y[:, :128], idx, 0, True)
    assert oracle.rel_err(np.asarray(yb, np.float32), want_b) < tol


def test_jax_fp8_stacked_linear_under_jit_on_gpu(caplog):
    """A jitted add_lora_linear_stacked with e4m3 stacked weights and (S, L, r) / (L, N) scales on the
    default GPU backend equals the oracle on the dequantised weights, without the reference fallback."""
    _gpu()
    rng = np.random.default_rng(1)
    ids = [1, 0, 2, 3, 1, 2, 0, 3] * 3
    idx = np.array([i - 1 for i in ids], np.int32)
    w = jax_helpers.wrapper(ids, [1, 2, 3], backend=None, capacity=32)
    assert w.backend == "triton"
    widths, rank, hidden = (64, 32), 16, 128
    qa, sa = quantise(rng.standard_normal((2, 3, rank, hidden)).astype(np.float32) / 8)
    qb, sb = quantise(rng.standard_normal((3, sum(widths), rank)).astype(np.float32) / 4)
    x = rng.standard_normal((len(ids), hidden)).astype(np.float32)
    y = rng.standard_normal((len(ids), sum(widths))).astype(np.float32)

    @jax.jit
    def step(wr, y, x, qa, qb, sa, sb):
        return wr.add_lora_linear_stacked(y, x, qa, qb, 1.0, widths, lora_a_scale=sa, lora_b_scale=sb)

    with caplog.at_level(logging.INFO, logger="jax_lora"):
        got = step(w, y, x, qa, qb, sa, sb)
    assert FALLBACK not in caplog.text
    b_deq = dequantise(qb, sb)
    want = oracle.lora_linear(y, x, [dequantise(qa[0], sa[0]), dequantise(qa[1], sa[1])],
                              [b_deq[:, :64], b_deq[:, 64:]], None, 1.0, idx)
    assert oracle.rel_err(np.asarray(got), want) < 1e-5
