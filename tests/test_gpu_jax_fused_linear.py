"""The fused linear kernels for JAX (`jax_lora.ops.fused_linear`) compiled, through the XLA FFI
launcher on a CUDA GPU (marked `gpu`; run on the device machine).

At Llama-3-8B layer shapes (qkv, o, gate_up, down; hidden 4096, intermediate 14336, GQA 4096 +
1024 + 1024) and decode row counts M = 1, 8, 32, 128, bfloat16, 32 slots of rank 16, slots -1
included: `gemm_lora` (with bias and add_inputs, and the GEMM alone) and `rms_norm_shrink`
against float64, under `jax.jit`, with the launch configs of the shared tables; the split-K GEMM
twice in a row (the handler's tile counters are 0 again after a launch); the pair as the model's
"norm" path runs it (its B read in place from the stacked (L, N, R) array).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("triton")

from jax_lora.ops import ffi_launcher
from jax_lora.ops.fused_linear import gemm_lora, rms_norm_shrink
from lora_core.kernels.fused_linear_configs import gemm_config

pytestmark = pytest.mark.gpu

LLAMA = {"qkv": (4096, (4096, 1024, 1024)), "o": (4096, (4096,)), "gate_up": (4096, (14336, 14336)),
         "down": (14336, (4096,))}
SLOTS, RANK, TOL = 32, 16, 2e-2


def _gpu():
    if jax.default_backend() != "gpu":
        pytest.skip("needs a CUDA GPU for JAX")
    if not ffi_launcher.available():
        pytest.skip(f"the XLA FFI launcher cannot be used here: {ffi_launcher.unavailable_reason()}")


def _f64(a) -> np.ndarray:
    return np.asarray(jnp.asarray(a).astype(jnp.float32), np.float64)


def _rel(got, ref) -> float:
    got = _f64(got)
    assert np.isfinite(got).all(), "NaN or Inf in the result"
    return float(np.linalg.norm(got - ref) / np.linalg.norm(ref))


def _inputs(m: int, layer: str, seed: int):
    k, widths = LLAMA[layer]
    n = sum(widths)
    rng = np.random.default_rng(seed)
    bf = lambda a: jnp.asarray(a.astype(np.float32), jnp.bfloat16)
    x = bf(rng.standard_normal((m, k)))
    w = bf(rng.standard_normal((n, k)) / np.sqrt(k))
    bias = bf(rng.standard_normal(n))
    b = bf(rng.standard_normal((SLOTS, n, RANK)) / np.sqrt(RANK))           # stacked: slices side by side
    buf = jnp.asarray(rng.standard_normal((len(widths), m, RANK)) / 4, jnp.float32)
    slots = jnp.asarray(rng.integers(-1, SLOTS, m).astype(np.int32))
    y0 = bf(rng.standard_normal((m, n)))
    return x, w, bias, b, buf, slots, y0, widths


def _oracle(x, w, bias, b, buf, slots, y0, widths) -> np.ndarray:
    ref = _f64(y0) + _f64(x) @ _f64(w).T + _f64(bias)[None]
    bd, sl, bufd = _f64(b), np.asarray(slots), np.asarray(buf, np.float64)
    off = 0
    for s, n in enumerate(widths):
        for slot in np.unique(sl):
            if slot >= 0:
                rows = sl == slot
                ref[rows, off:off + n] += bufd[s][rows] @ bd[slot, off:off + n].T
        off += n
    return ref


@pytest.mark.parametrize("m", [1, 8, 32, 128])
@pytest.mark.parametrize("layer", sorted(LLAMA))
def test_gpu_jax_gemm_lora_at_llama_shapes(layer, m):
    _gpu()
    x, w, bias, b, buf, slots, y0, widths = _inputs(m, layer, seed=m)
    run = jax.jit(lambda x, w, bias, buf, b, slots, y0: gemm_lora(x, w, bias, buf, b, slots, widths, y=y0,
                                                                  add_inputs=True))
    got = run(x, w, bias, buf, b, slots, y0)
    assert got.shape == y0.shape and got.dtype == jnp.bfloat16
    assert _rel(got, _oracle(x, w, bias, b, buf, slots, y0, widths)) <= TOL
    alone = jax.jit(lambda x, w: gemm_lora(x, w))(x, w)
    assert _rel(alone, _f64(x) @ _f64(w).T) <= TOL


@pytest.mark.parametrize("m", [8, 32])
def test_gpu_jax_gemm_lora_split_k_twice(m):
    """The split-K GEMM (its float32 workspace result and the handler's tile counters), twice in a
    row and in one program twice: the counters are 0 again after every launch."""
    _gpu()
    x, w, bias, b, buf, slots, y0, widths = _inputs(m, "qkv", seed=100 + m)
    cfg = {**gemm_config(m, widths), "SPLIT_K": 4}

    @jax.jit
    def twice(x, w, bias, buf, b, slots, y0):
        y1 = gemm_lora(x, w, bias, buf, b, slots, widths, y=y0, add_inputs=True, config=cfg)
        return y1, gemm_lora(x, w, bias, buf, b, slots, widths, y=y0, add_inputs=True, config=cfg)

    ref = _oracle(x, w, bias, b, buf, slots, y0, widths)
    for _ in range(2):
        y1, y2 = twice(x, w, bias, buf, b, slots, y0)
        assert _rel(y1, ref) <= TOL and np.array_equal(np.asarray(y1), np.asarray(y2))


@pytest.mark.parametrize("m", [1, 8, 32, 128])
def test_gpu_jax_rms_norm_shrink_then_gemm_lora_at_llama_shapes(m):
    """The model's "norm" path on qkv: the norm with the shrink (the table's split planes), then
    the GEMM with the expand, against float64 (the norm as Hugging Face rounds it)."""
    _gpu()
    k, widths = LLAMA["qkv"]
    rng = np.random.default_rng(200 + m)
    bf = lambda a: jnp.asarray(a.astype(np.float32), jnp.bfloat16)
    h = bf(rng.standard_normal((m, k)) * 2)
    g = bf(1 + 0.1 * rng.standard_normal(k))
    a = bf(rng.standard_normal((3, SLOTS, RANK, k)) / np.sqrt(k))
    w = bf(rng.standard_normal((sum(widths), k)) / np.sqrt(k))
    b = bf(rng.standard_normal((SLOTS, sum(widths), RANK)) / np.sqrt(RANK))
    slots = jnp.asarray(rng.integers(-1, SLOTS, m).astype(np.int32))

    @jax.jit
    def layer(h, g, a, w, b, slots):
        xn, buf = rms_norm_shrink(h, g, 1e-5, a, slots, 1.0)
        return xn, buf, gemm_lora(xn, w, None, buf, b, slots, widths)

    xn, buf, y = layer(h, g, a, w, b, slots)
    hf = h.astype(jnp.float32)
    want = (g.astype(jnp.float32) * (hf * jax.lax.rsqrt(jnp.mean(hf * hf, -1, keepdims=True) + 1e-5)).astype(
        jnp.bfloat16).astype(jnp.float32)).astype(jnp.bfloat16)
    # the sum of squares is added in another order than XLA's mean: a rare element may round the other way
    assert float(np.mean(np.asarray(xn) != np.asarray(want))) < 1e-3
    xd, ad, sl = _f64(want), _f64(a), np.asarray(slots)
    shrink = np.zeros((3, m, RANK))
    for s in range(3):
        for slot in np.unique(sl):
            if slot >= 0:
                shrink[s, sl == slot] = xd[sl == slot] @ ad[s, slot].T
    assert _rel(np.asarray(buf).sum(0), shrink) <= 1e-3
    zeros_y = jnp.zeros((m, sum(widths)), jnp.bfloat16)
    ref = _oracle(want, w, jnp.zeros(sum(widths), jnp.bfloat16), b, shrink, slots, zeros_y, widths)
    assert _rel(y, ref) <= TOL
