"""The fused linear kernels for JAX (`jax_lora.ops.fused_linear`): `gemm_lora` (the base GEMM with the
LoRA expand in its epilogue) and `rms_norm_shrink` (RMSNorm with the LoRA shrink), in Triton's
interpreter under `jax.jit`.

Each op is checked against a float64 NumPy oracle on random data (slots -1 and past the slots
included) and against the torch launcher (`torch_lora.ops.fused_linear`) on the same inputs, bit
for bit (the same kernel, the same parameter list from lora_core.kernels.arguments); both epilogue
modes, split-K of the GEMM (its workspace and counters), split planes of the norm's buffer,
per-slot ranks (NaN past each rank must never be read), bias and add_inputs, float32 and bfloat16,
the stacked weights read in place (views) against per-slice arrays, and the errors for bad input.
The compiled kernels through the XLA FFI launcher: tests/test_gpu_jax_fused_linear.py.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

pytest.importorskip("triton")
torch = pytest.importorskip("torch")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs Triton's interpreter")

from jax_lora.ops.fused_linear import gemm_lora, rms_norm_shrink  # noqa: E402
from torch_lora.ops import fused_linear as torch_fused  # noqa: E402

from .fused_linear_cases import gemm_lora_oracle, lora_slots, rel_err  # noqa: E402

L, K = 4, 64
WIDTHS = (32, 16, 16)                  # q, k, v of a small GQA layer
TOL = {"float32": 1e-5, "bfloat16": 2e-2}


def _j(a, dtype: str):
    return jnp.asarray(np.asarray(a, np.float32), dtype)


def _torch(a):
    """jax array -> torch tensor of the same dtype (bfloat16 through float32, exactly)."""
    if a.dtype == jnp.bfloat16:
        return torch.from_numpy(np.array(a.astype(jnp.float32))).to(torch.bfloat16)
    return torch.from_numpy(np.array(a))


def _f64(a) -> np.ndarray:
    return np.asarray(jnp.asarray(a).astype(jnp.float32), np.float64)


def _rel(got, ref) -> float:
    return rel_err(_f64(got), ref)


def _gemm_oracle(x, w, bias, buf, b, slots, y0, ranks=None):
    return gemm_lora_oracle(x, w, bias, buf, b, slots, y0, WIDTHS, L, ranks)


GEMM_CASES = [("float32", 5, "rows", True, False), ("bfloat16", 1, "rows", False, True),
              ("bfloat16", 33, "slots", True, True)]


@pytest.mark.parametrize("dtype,m,mode,with_bias,add_inputs", GEMM_CASES)
def test_gemm_lora_matches_oracle_and_the_torch_launcher(dtype, m, mode, with_bias, add_inputs):
    rng = np.random.default_rng(m + len(dtype))
    rank, n = 8, sum(WIDTHS)
    x, w = _j(rng.standard_normal((m, K)), dtype), _j(rng.standard_normal((n, K)) / 8, dtype)
    bias = _j(rng.standard_normal(n), dtype) if with_bias else None
    buf = jnp.asarray(rng.standard_normal((2, 3, m, rank)), jnp.float32)
    b = [_j(rng.standard_normal((L, wd, rank)) / 3, dtype) for wd in WIDTHS]
    y0 = _j(rng.standard_normal((m, n)), dtype)
    slots = jnp.asarray(lora_slots(rng, m, L))
    cfg = dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=32, LORA_MODE=mode)

    @jax.jit
    def run(x, w, bias, buf, b, slots, y0):
        return gemm_lora(x, w, bias, buf, b, slots, WIDTHS, y=y0 if add_inputs else None, add_inputs=add_inputs,
                         config=cfg)

    got = run(x, w, bias, buf, b, slots, y0)
    assert got.shape == (m, n) and got.dtype == x.dtype
    ref = _gemm_oracle(_f64(x), _f64(w), None if bias is None else _f64(bias), buf, [_f64(v) for v in b],
                       np.asarray(slots), _f64(y0) if add_inputs else None)
    assert _rel(got, ref) <= TOL[dtype]
    y_t = _torch(y0) if add_inputs else None
    want = torch_fused.gemm_lora(_torch(x), _torch(w), None if bias is None else _torch(bias), _torch(buf),
                                 [_torch(v) for v in b], _torch(slots), WIDTHS, y=y_t, add_inputs=add_inputs,
                                 config=cfg)
    assert torch.equal(_torch(got), want), "the JAX launch must equal the torch launch of the same kernel"


def test_gemm_lora_split_k_ranks_and_stacked_b():
    """Split-K (workspace and tile counters), per-slot ranks with NaN past each rank, lora_b as the
    stacked (L, N, R) array read in place: equal to the per-slice call and to the oracle."""
    rng = np.random.default_rng(3)
    m, rank, n = 6, 16, sum(WIDTHS)
    x, w = _j(rng.standard_normal((m, K)), "float32"), _j(rng.standard_normal((n, K)) / 8, "float32")
    ranks = np.array([4, 16, 0, 9], np.int32)
    b_clean = rng.standard_normal((L, n, rank)) / 4
    b_nan = b_clean.copy()
    for slot, r in enumerate(ranks):
        b_nan[slot, :, r:] = np.nan
    stacked = jnp.asarray(b_nan, jnp.float32)
    offsets = np.cumsum((0,) + WIDTHS[:-1])
    per_slice = [stacked[:, o:o + wd] for o, wd in zip(offsets, WIDTHS)]
    buf = jnp.asarray(rng.standard_normal((3, m, rank)), jnp.float32)
    slots = jnp.asarray(np.array([0, 1, 2, 3, -1, 1], np.int32))
    cfg = dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=16, SPLIT_K=3, LORA_MODE="rows")
    run = jax.jit(lambda b: gemm_lora(x, w, None, buf, b, slots, WIDTHS, lora_ranks=jnp.asarray(ranks), config=cfg))
    got = run(stacked)
    assert np.array_equal(np.asarray(got), np.asarray(run(per_slice)))
    ref = _gemm_oracle(_f64(x), _f64(w), None, np.asarray(buf)[None],
                       [b_clean[:, o:o + wd] for o, wd in zip(offsets, WIDTHS)], np.asarray(slots), None, ranks)
    assert _rel(got, ref) <= 1e-5
    alone = jax.jit(lambda x, w: gemm_lora(x, w, config=cfg))(x, w)
    assert _rel(alone, _f64(x) @ _f64(w).T) <= 1e-5


def _hf_rms_norm(h, g, eps: float) -> np.ndarray:
    """Hugging Face's LlamaRMSNorm (float32 normalisation, cast to h's dtype, times g), in jnp."""
    hf = h.astype(jnp.float32)
    normed = (hf * jax.lax.rsqrt(jnp.mean(hf * hf, axis=-1, keepdims=True) + eps)).astype(h.dtype)
    return (g.astype(jnp.float32) * normed.astype(jnp.float32)).astype(h.dtype)


NORM_CASES = [("float32", 5, "rows", 1), ("bfloat16", 1, "rows", 4), ("bfloat16", 33, "slots", 2)]


@pytest.mark.parametrize("dtype,m,mode,planes", NORM_CASES)
def test_rms_norm_shrink_matches_hf_norm_oracle_and_the_torch_launcher(dtype, m, mode, planes):
    rng = np.random.default_rng(10 + m)
    rank = 8
    h = _j(rng.standard_normal((m, K)) * 3 + 0.5, dtype)
    g = _j(1 + 0.2 * rng.standard_normal(K), dtype)
    a = _j(rng.standard_normal((3, L, rank, K)) / 8, dtype)          # (S, L, R, K): read in place
    slots = jnp.asarray(lora_slots(rng, m, L))
    cfg = dict(BLOCK_M=16 if mode == "slots" else 4, BLOCK_K=16, LORA_MODE=mode)
    xn, buf = jax.jit(lambda h, g, a, s: rms_norm_shrink(h, g, 1e-5, a, s, 0.5, planes=planes, config=cfg))(
        h, g, a, slots)
    assert xn.dtype == h.dtype and buf.shape == (planes, 3, m, rank) and buf.dtype == jnp.float32
    want = _hf_rms_norm(h, g, 1e-5)
    if dtype == "float32":
        assert _rel(xn, _f64(want)) <= 1e-6
    else:
        assert np.array_equal(np.asarray(xn), np.asarray(want)), "the norm must round as LlamaRMSNorm does"
    ref = np.zeros((3, m, rank))
    for s in range(3):
        for i, slot in enumerate(np.asarray(slots)):
            if 0 <= slot < L:
                ref[s, i] = 0.5 * _f64(want)[i] @ _f64(a[s, slot]).T
    assert _rel(np.asarray(buf).sum(0), ref) <= 1e-4
    out_t = torch.empty(m, K, dtype=_torch(h).dtype)
    buf_t = torch.empty(planes, 3, m, rank)
    torch_fused.rms_norm_shrink(_torch(h), _torch(g), 1e-5, [_torch(a[s]) for s in range(3)], _torch(slots), 0.5,
                                out=out_t, buf=buf_t, config=cfg)
    assert torch.equal(_torch(xn), out_t) and torch.equal(_torch(buf), buf_t)


def test_rms_norm_shrink_ranks_the_norm_alone_and_the_pair_as_a_layer():
    """Per-slot ranks (NaN past each rank unread), the norm alone, and norm + shrink then the GEMM
    with the expand: the LoRA linear after an RMSNorm, against float64."""
    rng = np.random.default_rng(21)
    m, rank, n = 5, 16, sum(WIDTHS)
    h = _j(rng.standard_normal((m, K)), "bfloat16")
    g = _j(1 + 0.1 * rng.standard_normal(K), "float32")               # a float32 gain on bfloat16 rows
    a_clean = rng.standard_normal((3, L, rank, K)) / 8
    ranks = np.array([4, 16, 0, 9], np.int32)
    a_nan = a_clean.copy()
    for slot, r in enumerate(ranks):
        a_nan[:, slot, r:] = np.nan
    a = _j(a_nan, "bfloat16")
    w = _j(rng.standard_normal((n, K)) / 8, "bfloat16")
    b = _j(rng.standard_normal((L, n, rank)) / 4, "bfloat16")
    slots = jnp.asarray(np.array([0, 1, 2, 3, -1], np.int32))

    @jax.jit
    def layer(h, g, a, w, b, slots, ranks):
        xn, buf = rms_norm_shrink(h, g, 1e-6, a, slots, 2.0, lora_ranks=ranks)
        return xn, buf, gemm_lora(xn, w, None, buf, b, slots, WIDTHS, lora_ranks=ranks)

    xn, buf, y = layer(h, g, a, w, b, slots, jnp.asarray(ranks))
    want = _hf_rms_norm(h, g, 1e-6)
    assert np.array_equal(np.asarray(xn), np.asarray(want))
    xd, a_q, b_q = _f64(want), _f64(_j(a_clean, "bfloat16")), _f64(b)
    ref = xd @ _f64(w).T
    off = 0
    for s, wd in enumerate(WIDTHS):
        for i, slot in enumerate(np.asarray(slots)):
            if slot >= 0:
                r = ranks[slot]
                ref[i, off:off + wd] += (2.0 * xd[i] @ a_q[s, slot, :r].T) @ b_q[slot, off:off + wd, :r].T
        off += wd
    assert _rel(y, ref) <= TOL["bfloat16"]
    alone, none = rms_norm_shrink(h, g, 1e-6, None, None, 1.0)
    assert none is None and np.array_equal(np.asarray(alone), np.asarray(want))


# ----------------------------------------------------------------------------- bad input

def test_gemm_lora_rejects_bad_arguments_by_name():
    x, w = jnp.zeros((3, 32), jnp.bfloat16), jnp.zeros((96, 32), jnp.bfloat16)
    b = [jnp.zeros((L, 64, 16), jnp.bfloat16), jnp.zeros((L, 32, 16), jnp.bfloat16)]
    buf, slots = jnp.zeros((2, 3, 16), jnp.float32), jnp.zeros(3, jnp.int32)
    with pytest.raises(ValueError, match="multiple of BLOCK_N=128"):
        gemm_lora(x, w, None, buf, b, slots, (64, 32), config=dict(BLOCK_M=16, BLOCK_N=128, BLOCK_K=32))
    with pytest.raises(ValueError, match="output_slices"):
        gemm_lora(x, w, None, buf, b, slots, (64, 64))
    with pytest.raises(ValueError, match=r"weight must have shape \(N, 32\)"):
        gemm_lora(x, w.T, None, buf, b, slots, (64, 32))
    with pytest.raises(TypeError, match="weight must have x's dtype"):
        gemm_lora(x, w.astype(jnp.float16), None, buf, b, slots, (64, 32))
    with pytest.raises(ValueError, match="buf must have shape"):
        gemm_lora(x, w, None, buf[:, :2], b, slots, (64, 32))
    with pytest.raises(TypeError, match="buf must have dtype"):
        gemm_lora(x, w, None, buf.astype(jnp.bfloat16), b, slots, (64, 32))
    with pytest.raises(ValueError, match="slots must have shape"):
        gemm_lora(x, w, None, buf, b, slots[:2], (64, 32))
    with pytest.raises(TypeError, match="slots must be an int32"):
        gemm_lora(x, w, None, buf, b, slots.astype(jnp.float32), (64, 32))
    with pytest.raises(ValueError, match=r"lora_b_stacked\[1\] must have shape"):
        gemm_lora(x, w, None, buf, [b[0], b[0]], slots, (64, 32))
    with pytest.raises(ValueError, match=r"lora_b_stacked must be \(L, 96, R\)"):
        gemm_lora(x, w, None, buf, b[0], slots, (64, 32))
    with pytest.raises(ValueError, match="add_inputs=True needs y"):
        gemm_lora(x, w, None, buf, b, slots, (64, 32), add_inputs=True)
    with pytest.raises(ValueError, match="slots=None runs the GEMM alone"):
        gemm_lora(x, w, None, buf, b, None, (64, 32))
    with pytest.raises(ValueError, match="bias must have shape"):
        gemm_lora(x, w, jnp.zeros(95, jnp.bfloat16), buf, b, slots, (64, 32))
    with pytest.raises(ValueError, match="lora_ranks must have shape"):
        gemm_lora(x, w, None, buf, b, slots, (64, 32), lora_ranks=jnp.zeros(3, jnp.int32))
    with pytest.raises(TypeError, match="x must be a jax.Array"):
        gemm_lora([[0.0]], w, None, buf, b, slots, (64, 32))


def test_rms_norm_shrink_rejects_bad_arguments_by_name():
    h, g = jnp.zeros((3, 32), jnp.bfloat16), jnp.ones(32, jnp.bfloat16)
    a, slots = [jnp.zeros((L, 16, 32), jnp.bfloat16)], jnp.zeros(3, jnp.int32)
    with pytest.raises(ValueError, match="norm_weight must have shape"):
        rms_norm_shrink(h, g[:16], 1e-5, a, slots, 1.0)
    with pytest.raises(ValueError, match="eps must be"):
        rms_norm_shrink(h, g, -1.0, a, slots, 1.0)
    with pytest.raises(TypeError, match="scale must be a Python float"):
        rms_norm_shrink(h, g, 1e-5, a, slots, jnp.float32(1.0))
    with pytest.raises(ValueError, match=r"lora_a_stacked\[0\] must have shape"):
        rms_norm_shrink(h, g, 1e-5, [a[0][:, :, :16]], slots, 1.0)
    with pytest.raises(ValueError, match="1 to 4 slices"):
        rms_norm_shrink(h, g, 1e-5, a * 5, slots, 1.0)
    with pytest.raises(TypeError, match="every lora_a_stacked slice"):
        rms_norm_shrink(h, g, 1e-5, [a[0], a[0].astype(jnp.float16)], slots, 1.0)
    with pytest.raises(ValueError, match="planes must be"):
        rms_norm_shrink(h, g, 1e-5, a, slots, 1.0, planes=0)
    with pytest.raises(ValueError, match="slots=None runs the norm alone"):
        rms_norm_shrink(h, g, 1e-5, a, None, 1.0)
