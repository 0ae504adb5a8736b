"""The Llama model's decode attention (`jax_lora.models.llama._decode_attention`) against a float64
oracle, on both of its paths: multiply-and-reduce under XLA (every device) and cuDNN's fused
attention (a CUDA GPU with a 16-bit cache; marked `gpu`), and the `JAX_LORA_ATTENTION` choice.

Cases: GQA (8 query heads over 2 KV heads), rows at different positions including position 0 (one
key), the last position and past the cache (every key), cache entries past a row's position filled
with large values (a read past the mask would show)."""

from __future__ import annotations

import logging
import math

import numpy as np
import pytest

jax = pytest.importorskip("jax")
jnp = jax.numpy
from jax_lora.models import llama  # noqa: E402

B, M, NH, NKV, HD = 5, 48, 8, 2, 64
POSITIONS = np.array([0, 7, 47, 60, 23], np.int32)      # 60 >= M: the whole cache


def _problem(seed=0):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((B, 1, NH, HD))
    k = rng.standard_normal((B, M, NKV, HD))
    v = rng.standard_normal((B, M, NKV, HD))
    for b, p in enumerate(POSITIONS):                    # unwritten cache: poison past the mask
        k[b, p + 1:] = 1e3
        v[b, p + 1:] = -1e3
    return q, k, v


def _oracle(q, k, v):
    """float64: softmax over positions 0..min(p, M-1) of q . k / sqrt(hd), GQA group g -> kv head g // (NH/NKV)."""
    out = np.zeros((B, 1, NH * HD))
    for b, p in enumerate(POSITIONS):
        n = min(int(p), M - 1) + 1
        for h in range(NH):
            kv = h // (NH // NKV)
            s = k[b, :n, kv] @ q[b, 0, h] / math.sqrt(HD)
            w = np.exp(s - s.max())
            w /= w.sum()
            out[b, 0, h * HD:(h + 1) * HD] = w @ v[b, :n, kv]
    return out


def _run(q, k, v, dtype):
    key_pos = jnp.broadcast_to(jnp.arange(M, dtype=jnp.int32), (B, M))
    pos = jnp.asarray(POSITIONS)[:, None]
    f = jax.jit(lambda q, k, v: llama._decode_attention(q, k, v, key_pos, pos, dtype))
    return np.asarray(f(jnp.asarray(q, dtype), jnp.asarray(k, dtype), jnp.asarray(v, dtype)), np.float64)


@pytest.mark.parametrize("dtype,tol", [(jnp.float32, 1e-5), (jnp.bfloat16, 3e-2)])
def test_xla_decode_attention_matches_the_oracle(monkeypatch, dtype, tol):
    monkeypatch.setenv(llama.ATTENTION_ENV, "xla")
    q, k, v = _problem()
    rq, rk, rv = (np.asarray(jnp.asarray(a, dtype), np.float64) for a in (q, k, v))   # the inputs as stored
    ref = _oracle(rq, rk, rv)
    got = _run(q, k, v, dtype)
    assert np.isfinite(got).all()
    assert np.abs(got - ref).max() / np.abs(ref).max() < tol


def test_the_choice_is_checked_and_logged(monkeypatch, caplog):
    monkeypatch.setenv(llama.ATTENTION_ENV, "flash")
    with pytest.raises(ValueError, match=r"JAX_LORA_ATTENTION='flash'.*auto, xla, cudnn"):
        llama.decode_attention_backend(jnp.bfloat16, jnp.bfloat16, 128)
    monkeypatch.setenv(llama.ATTENTION_ENV, "xla")
    with caplog.at_level(logging.INFO, logger="jax_lora"):
        llama._log_attention.cache_clear()
        assert llama.decode_attention_backend(jnp.bfloat16, jnp.bfloat16, 128) == ("xla", "JAX_LORA_ATTENTION=xla")
    assert "decode attention: xla (JAX_LORA_ATTENTION=xla)" in caplog.text
    monkeypatch.setenv(llama.ATTENTION_ENV, "auto")       # float32 never takes cuDNN
    backend, why = llama.decode_attention_backend(jnp.float32, jnp.float32, 128)
    assert backend == "xla" and why.startswith("auto: ")
    backend, why = llama.decode_attention_backend(jnp.bfloat16, jnp.bfloat16, 100)
    assert backend == "xla"


def test_auto_takes_cudnn_from_the_row_threshold(monkeypatch):
    """Where cuDNN applies, `auto` takes it for steps of CUDNN_MIN_ROWS rows or more (and when the
    row count is not given); `cudnn` at any row count."""
    monkeypatch.setattr(llama, "_cudnn_unavailable", lambda *a: "")
    monkeypatch.setenv(llama.ATTENTION_ENV, "auto")
    n = llama.CUDNN_MIN_ROWS
    small = llama.decode_attention_backend(jnp.bfloat16, jnp.bfloat16, 128, n - 1)
    assert small == ("xla", f"auto: {n - 1} rows < {n} (XLA's attention makes the smaller steps faster)")
    assert llama.decode_attention_backend(jnp.bfloat16, jnp.bfloat16, 128, n)[0] == "cudnn"
    assert llama.decode_attention_backend(jnp.bfloat16, jnp.bfloat16, 128)[0] == "cudnn"
    monkeypatch.setenv(llama.ATTENTION_ENV, "cudnn")
    assert llama.decode_attention_backend(jnp.bfloat16, jnp.bfloat16, 128, 1)[0] == "cudnn"


@pytest.mark.skipif(jax.default_backend() == "gpu", reason="the CPU machine's refusal")
def test_cudnn_is_refused_by_name_where_it_cannot_run(monkeypatch):
    monkeypatch.setenv(llama.ATTENTION_ENV, "cudnn")
    with pytest.raises(ValueError, match="JAX_LORA_ATTENTION=cudnn, but cuDNN attention does not apply here: "
                                         "JAX's default backend is"):
        llama.decode_attention_backend(jnp.bfloat16, jnp.bfloat16, 128)


@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="JAX's default backend is not a GPU")
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_cudnn_decode_attention_matches_the_oracle(monkeypatch, dtype):
    monkeypatch.setenv(llama.ATTENTION_ENV, "cudnn")              # B rows: below auto's threshold
    assert llama.decode_attention_backend(dtype, dtype, HD, B)[0] == "cudnn"
    q, k, v = _problem(seed=1)
    rq, rk, rv = (np.asarray(jnp.asarray(a, dtype), np.float64) for a in (q, k, v))
    ref = _oracle(rq, rk, rv)
    got = _run(q, k, v, dtype)
    assert np.isfinite(got).all()
    assert np.abs(got - ref).max() / np.abs(ref).max() < 3e-2
    monkeypatch.setenv(llama.ATTENTION_ENV, "xla")
    xla = _run(q, k, v, dtype)
    assert np.abs(got - xla).max() / np.abs(xla).max() < 3e-2
