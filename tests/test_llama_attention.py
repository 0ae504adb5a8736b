"""The Llama model's attention (`jax_lora.models.attention.decode_attention`, `prefill_attention`)
against a float64 oracle, on both of its paths: XLA's (every device) and cuDNN's fused attention (a
CUDA GPU with a 16-bit cache; marked `gpu`), and the `JAX_LORA_ATTENTION` choice.

Decode cases: GQA (8 query heads over 2 KV heads), rows at different positions including position 0 (one
key), the last position and past the cache (every key), cache entries past a row's position filled
with large values (a read past the mask would show)."""

from __future__ import annotations

import logging
import math

import numpy as np
import pytest

jax = pytest.importorskip("jax")
jnp = jax.numpy
from jax_lora.models import attention, llama  # noqa: E402

B, M, NH, NKV, HD = 5, 48, 8, 2, 64
POSITIONS = np.array([0, 7, 47, 60, 23], np.int32)      # 60 >= M: the whole cache


def _problem(seed=0, poison=(1e3, -1e3)):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((B, 1, NH, HD))
    k = rng.standard_normal((B, M, NKV, HD))
    v = rng.standard_normal((B, M, NKV, HD))
    for b, p in enumerate(POSITIONS):                    # unwritten cache: poison past the mask
        k[b, p + 1:] = poison[0]
        v[b, p + 1:] = poison[1]
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
    f = jax.jit(lambda q, k, v: attention.decode_attention(q, k, v, key_pos, pos, dtype))
    return np.asarray(f(jnp.asarray(q, dtype), jnp.asarray(k, dtype), jnp.asarray(v, dtype)), np.float64)


@pytest.mark.parametrize("dtype,tol", [(jnp.float32, 1e-5), (jnp.bfloat16, 3e-2)])
def test_xla_decode_attention_matches_the_oracle(monkeypatch, dtype, tol):
    monkeypatch.setenv(attention.ATTENTION_ENV, "xla")
    q, k, v = _problem()
    rq, rk, rv = (np.asarray(jnp.asarray(a, dtype), np.float64) for a in (q, k, v))   # the inputs as stored
    ref = _oracle(rq, rk, rv)
    got = _run(q, k, v, dtype)
    assert np.isfinite(got).all()
    assert np.abs(got - ref).max() / np.abs(ref).max() < tol


@pytest.mark.parametrize("poison", [(np.nan, np.nan), (np.inf, -np.inf)])
def test_xla_decode_attention_keeps_non_finite_unread_entries_out(monkeypatch, poison):
    """NaN or Inf past a row's position (what an earlier request may leave) never reaches the row's
    result: masked scores are replaced and masked values zeroed (0 x NaN would be NaN)."""
    monkeypatch.setenv(attention.ATTENTION_ENV, "xla")
    q, k, v = _problem(poison=poison)
    ref = _oracle(q, k, v)
    got = _run(q, k, v, jnp.float32)
    assert np.isfinite(got).all()
    assert np.abs(got - ref).max() / np.abs(ref).max() < 1e-5


def test_the_choice_is_checked_and_logged(monkeypatch, caplog):
    monkeypatch.setenv(attention.ATTENTION_ENV, "flash")
    with pytest.raises(ValueError, match=r"JAX_LORA_ATTENTION='flash'.*auto, xla, cudnn"):
        attention.attention_backend(jnp.bfloat16, jnp.bfloat16, 128)
    monkeypatch.setenv(attention.ATTENTION_ENV, "xla")
    with caplog.at_level(logging.INFO, logger="jax_lora"):
        attention._log_attention.cache_clear()
        assert attention.attention_backend(jnp.bfloat16, jnp.bfloat16, 128) == ("xla", "JAX_LORA_ATTENTION=xla")
    assert "attention: xla (JAX_LORA_ATTENTION=xla)" in caplog.text
    monkeypatch.setenv(attention.ATTENTION_ENV, "auto")       # float32 never takes cuDNN
    backend, why = attention.attention_backend(jnp.float32, jnp.float32, 128)
    assert backend == "xla" and why.startswith("auto: ")
    backend, why = attention.attention_backend(jnp.bfloat16, jnp.bfloat16, 100)
    assert backend == "xla"


def test_auto_takes_cudnn_wherever_it_applies(monkeypatch):
    """Where cuDNN applies, `auto` and `cudnn` take it (a model split over a mesh: `cudnn` only);
    where it does not, `auto` takes XLA's and says why."""
    monkeypatch.setattr(attention, "_cudnn_unavailable", lambda *a: "")
    for setting in ("auto", "cudnn"):
        monkeypatch.setenv(attention.ATTENTION_ENV, setting)
        assert attention.attention_backend(jnp.bfloat16, jnp.bfloat16, 128) == (
            "cudnn", f"{setting}: cuDNN fused attention applies")
    monkeypatch.setenv(attention.ATTENTION_ENV, "auto")
    backend, why = attention.attention_backend(jnp.bfloat16, jnp.bfloat16, 128, tensor_parallel=True)
    assert backend == "xla" and why.startswith("auto: the model is split over a mesh")
    monkeypatch.setenv(attention.ATTENTION_ENV, "cudnn")                  # forced: taken under a mesh too
    assert attention.attention_backend(jnp.bfloat16, jnp.bfloat16, 128, tensor_parallel=True)[0] == "cudnn"
    monkeypatch.setenv(attention.ATTENTION_ENV, "auto")
    monkeypatch.setattr(attention, "_cudnn_unavailable", lambda *a: "head_dim 100 (cuDNN needs a multiple of 8)")
    assert attention.attention_backend(jnp.bfloat16, jnp.bfloat16, 100) == (
        "xla", "auto: head_dim 100 (cuDNN needs a multiple of 8)")


@pytest.mark.skipif(jax.default_backend() == "gpu", reason="the CPU machine's refusal")
def test_cudnn_is_refused_by_name_where_it_cannot_run(monkeypatch):
    monkeypatch.setenv(attention.ATTENTION_ENV, "cudnn")
    with pytest.raises(ValueError, match="JAX_LORA_ATTENTION=cudnn, but cuDNN attention does not apply here: "
                                         "JAX's default backend is"):
        attention.attention_backend(jnp.bfloat16, jnp.bfloat16, 128)


@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="JAX's default backend is not a GPU")
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_cudnn_decode_attention_matches_the_oracle(monkeypatch, dtype):
    monkeypatch.setenv(attention.ATTENTION_ENV, "cudnn")
    assert attention.attention_backend(dtype, dtype, HD)[0] == "cudnn"
    q, k, v = _problem(seed=1)
    rq, rk, rv = (np.asarray(jnp.asarray(a, dtype), np.float64) for a in (q, k, v))
    ref = _oracle(rq, rk, rv)
    got = _run(q, k, v, dtype)
    assert np.isfinite(got).all()
    assert np.abs(got - ref).max() / np.abs(ref).max() < 3e-2
    monkeypatch.setenv(attention.ATTENTION_ENV, "xla")
    xla = _run(q, k, v, dtype)
    assert np.abs(got - xla).max() / np.abs(xla).max() < 3e-2


# ------------------------------------------------------------------------------------------ prefill
# Rows of S queries against M cached keys: row 0 a fresh prompt (positions 0..S-1), row 1 a later
# chunk of a longer prompt (positions 20..20+S-1: it also reads the earlier chunk's keys), row 2
# a prompt whose last positions run past the cache (every key). Keys past a query's position are
# poisoned (a read past the mask would show).
S = 12
PREFILL_START = np.array([0, 20, M - 4], np.int32)


def _prefill_problem(seed=0, poison=(1e3, -1e3)):
    rng = np.random.default_rng(seed)
    rows = len(PREFILL_START)
    positions = PREFILL_START[:, None] + np.arange(S, dtype=np.int32)[None]      # (R, S)
    q = rng.standard_normal((rows, S, NH, HD))
    k = rng.standard_normal((rows, M, NKV, HD))
    v = rng.standard_normal((rows, M, NKV, HD))
    for r in range(rows):
        last = min(int(positions[r, -1]), M - 1)
        k[r, last + 1:] = poison[0]
        v[r, last + 1:] = poison[1]
    return q, k, v, positions


def _prefill_oracle(q, k, v, positions):
    """float64: query (r, s) over the keys m <= positions[r, s] (m < M), GQA as in `_oracle`."""
    rows = q.shape[0]
    out = np.zeros((rows, S, NH * HD))
    for r in range(rows):
        for t in range(S):
            n = min(int(positions[r, t]), M - 1) + 1
            for h in range(NH):
                kv = h // (NH // NKV)
                sc = k[r, :n, kv] @ q[r, t, h] / math.sqrt(HD)
                w = np.exp(sc - sc.max())
                w /= w.sum()
                out[r, t, h * HD:(h + 1) * HD] = w @ v[r, :n, kv]
    return out


def _run_prefill(q, k, v, positions, dtype):
    key_pos = jnp.broadcast_to(jnp.arange(M, dtype=jnp.int32), (q.shape[0], M))
    pos = jnp.asarray(positions)
    f = jax.jit(lambda q, k, v: attention.prefill_attention(q, k, v, key_pos, pos, dtype))
    return np.asarray(f(jnp.asarray(q, dtype), jnp.asarray(k, dtype), jnp.asarray(v, dtype)), np.float64)


@pytest.mark.parametrize("dtype,tol", [(jnp.float32, 1e-5), (jnp.bfloat16, 3e-2)])
def test_xla_prefill_attention_matches_the_oracle(monkeypatch, dtype, tol):
    monkeypatch.setenv(attention.ATTENTION_ENV, "xla")
    q, k, v, positions = _prefill_problem()
    rq, rk, rv = (np.asarray(jnp.asarray(a, dtype), np.float64) for a in (q, k, v))
    ref = _prefill_oracle(rq, rk, rv, positions)
    got = _run_prefill(q, k, v, positions, dtype)
    assert np.isfinite(got).all()
    assert np.abs(got - ref).max() / np.abs(ref).max() < tol


@pytest.mark.parametrize("poison", [(np.nan, np.nan), (np.inf, -np.inf)])
def test_xla_prefill_attention_keeps_non_finite_unread_entries_out(monkeypatch, poison):
    monkeypatch.setenv(attention.ATTENTION_ENV, "xla")
    q, k, v, positions = _prefill_problem(poison=poison)
    ref = _prefill_oracle(q, k, v, positions)
    got = _run_prefill(q, k, v, positions, jnp.float32)
    assert np.isfinite(got).all()
    assert np.abs(got - ref).max() / np.abs(ref).max() < 1e-5


@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="JAX's default backend is not a GPU")
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_cudnn_prefill_attention_matches_the_oracle(monkeypatch, dtype):
    monkeypatch.setenv(attention.ATTENTION_ENV, "cudnn")
    q, k, v, positions = _prefill_problem(seed=2)
    rq, rk, rv = (np.asarray(jnp.asarray(a, dtype), np.float64) for a in (q, k, v))
    ref = _prefill_oracle(rq, rk, rv, positions)
    got = _run_prefill(q, k, v, positions, dtype)
    assert np.isfinite(got).all()
    assert np.abs(got - ref).max() / np.abs(ref).max() < 3e-2
    monkeypatch.setenv(attention.ATTENTION_ENV, "xla")
    xla = _run_prefill(q, k, v, positions, dtype)
    assert np.abs(got - xla).max() / np.abs(xla).max() < 3e-2


@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="JAX's default backend is not a GPU")
def test_cudnn_and_xla_attention_agree_in_a_model_step(monkeypatch):
    """A bf16 Llama prefill then decode step through the cache: cuDNN's attention (forced) against
    XLA's, logits within bf16 tolerance."""
    from flax import nnx
    cfg = llama.LlamaConfig(vocab_size=64, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    model = llama.LlamaForCausalLM(cfg, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    rng = np.random.default_rng(3)
    tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, (2, 16)), jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(16, dtype=jnp.int32), (2, 16))
    nxt = jnp.asarray(rng.integers(0, cfg.vocab_size, (2, 1)), jnp.int32)

    def run():
        cache = llama.init_cache(cfg, 2, 32, jnp.bfloat16)
        pre, cache = model(tokens, positions, cache=cache)
        dec, _ = model(nxt, jnp.full((2, 1), 16, jnp.int32), cache=cache)
        return np.asarray(pre, np.float64), np.asarray(dec, np.float64)
    monkeypatch.setenv(attention.ATTENTION_ENV, "cudnn")
    got = run()
    monkeypatch.setenv(attention.ATTENTION_ENV, "xla")
    ref = run()
    for g, r in zip(got, ref):
        assert np.isfinite(g).all()
        assert np.abs(g - r).max() / np.abs(r).max() < 3e-2


def _tiny_model(dtype):
    from flax import nnx
    cfg = llama.LlamaConfig(vocab_size=64, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    return cfg, llama.LlamaForCausalLM(cfg, dtype=dtype, rngs=nnx.Rngs(0))


@pytest.mark.parametrize("backend", ["xla", pytest.param("cudnn", marks=[pytest.mark.gpu, pytest.mark.skipif(
    jax.default_backend() != "gpu", reason="JAX's default backend is not a GPU")])])
def test_a_dirty_cache_row_does_not_reach_the_next_request(monkeypatch, backend):
    """A row that an earlier request left full of NaN (and Inf in another row): a prompt prefilled
    into it (rows given, as the serving loop does) and the decode steps after it give exactly what
    they give on a zeroed cache. The prefill zeroes its rows past its last position; reads before
    that never reach the stale entries."""
    monkeypatch.setenv(attention.ATTENTION_ENV, backend)
    dtype = jnp.bfloat16 if backend == "cudnn" else jnp.float32
    cfg, model = _tiny_model(dtype)
    rng = np.random.default_rng(4)
    n_rows, max_len, s = 4, 32, 8
    tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, (2, s)), jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (2, s))
    rows = jnp.asarray([2, 0], jnp.int32)
    steps = jnp.asarray(rng.integers(0, cfg.vocab_size, (3, n_rows, 1)), jnp.int32)

    def run(cache):
        out = []
        logits, cache = model(tokens, positions, cache=cache, rows=rows)
        out.append(np.asarray(logits, np.float64))
        for part in (cache.k, cache.v):                     # the prompt's rows: zero past its last position
            for layer in part:
                assert not np.asarray(layer[np.asarray(rows), s:], np.float64).any()
        for i in range(3):                                  # decode every row, rows=None (in place)
            pos = jnp.full((n_rows, 1), s + i, jnp.int32)
            logits, cache = model(steps[i], pos, cache=cache)
            out.append(np.asarray(logits, np.float64)[np.asarray(rows)])
        return out
    clean = llama.init_cache(cfg, n_rows, max_len, dtype)
    dirty = llama.KVCache(*(tuple(c.at[2].set(jnp.nan).at[0].set(jnp.inf) for c in part) for part in (clean.k,
                                                                                                      clean.v)))
    for got, ref in zip(run(dirty), run(clean)):
        assert np.isfinite(got).all()
        np.testing.assert_array_equal(got, ref)


def test_negative_rows_are_padding():
    """A row index < 0 writes nowhere (as one >= the cache's rows), never into the last rows."""
    cfg, model = _tiny_model(jnp.float32)
    cache = llama.init_cache(cfg, 3, 16, jnp.float32)
    tokens = jnp.ones((2, 4), jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(4, dtype=jnp.int32), (2, 4))
    _, cache = model(tokens, positions, cache=cache, rows=jnp.asarray([-1, 1], jnp.int32))
    for part in (cache.k, cache.v):
        for layer in part:
            layer = np.asarray(layer)
            assert layer[1, :4].any() and not layer[0].any() and not layer[2].any()


def test_token_ids_and_sample_idx_out_of_range():
    """Values the host holds are refused, naming the argument, the range and the value; under jit
    (no host read) they are clamped: finite logits, equal to those of the nearest valid value (an
    id past the vocabulary once read NaN from the embedding, a sample_idx past S NaN positions)."""
    cfg, model = _tiny_model(jnp.float32)
    v = cfg.vocab_size
    tokens = np.array([[3, 1, 4, 1], [5, 9, 2, 6]], np.int32)
    positions = np.broadcast_to(np.arange(4, dtype=np.int32), (2, 4))
    for bad_tokens, got in ((np.where(tokens == 9, v, tokens), v), (np.where(tokens == 9, -2, tokens), -2)):
        for form in (bad_tokens, jax.device_put(bad_tokens, jax.devices("cpu")[0]), bad_tokens.tolist()):
            with pytest.raises(ValueError, match=rf"tokens must be in \[0, {v}\) \(token ids, vocab_size = {v}\), "
                                                 rf"got {got}$"):
                model(form, positions)
    for bad, got in (([3, 4], 4), ([-1, 1], -1)):
        with pytest.raises(ValueError, match=rf"sample_idx must be in \[0, 4\) \(a position of the step's S = 4\), "
                                             rf"got {got}$"):
            model(tokens, positions, sample_idx=np.array(bad, np.int32))

    step = jax.jit(lambda t, p, i: model(t, p, sample_idx=i)[0])
    clamped_tokens, clamped_sample = np.where(tokens == 9, v - 1, tokens), np.array([3, 0], np.int32)
    want = np.asarray(step(clamped_tokens, positions, clamped_sample))
    got = np.asarray(step(np.where(tokens == 9, v + 7, tokens), positions, np.array([4 + 5, -3], np.int32)))
    assert np.isfinite(got).all()
    np.testing.assert_array_equal(got, want)
    full = np.asarray(jax.jit(lambda t, p: model(t, p)[0])(np.where(tokens == 9, -5, tokens), positions))
    assert np.isfinite(full).all()
