"""jax_lora.PunicaWrapper per step: the add_* methods against float64 oracles (bias per slot,
unequal slices, logits routed by the sampler indices, add_shrink / add_expand with and without
add_inputs), vLLM's TPU wrapper methods shrink / expand / expand_slice, and the wrapper as a jit
argument: one compilation per bucket for many mappings, no device-to-host transfer inside the
jitted step. CPU, xla backend; the GPU counterpart is tests/test_gpu_wrapper.py.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_lora
from jax_lora.meta import build_kernel_meta
from lora_core.host_mapping import LoRAMapping

from . import jax_helpers, oracle

SLOTS, HIDDEN, RANK, SLICES, BUCKET = 4, 32, 8, (16, 8), 16
IDS = [21, 22, None, 24]


def _weights(rng):
    a = [jnp.asarray(rng.standard_normal((SLOTS, 1, RANK, HIDDEN)), jnp.float32) for _ in SLICES]
    b = [jnp.asarray(rng.standard_normal((SLOTS, 1, n, RANK)), jnp.float32) for n in SLICES]
    return a, b


def _random_mapping(rng, n):
    ids = rng.choice([0, 21, 22, 24], size=n)
    return LoRAMapping(tuple(int(i) for i in ids), tuple(int(i) for i in ids[: max(1, n // 3)]))


def test_one_compilation_for_many_mappings_of_a_bucket():
    rng = np.random.default_rng(0)
    a, b = _weights(rng)
    w = jax_lora.PunicaWrapper(BUCKET, 8, None, max_loras=SLOTS, backend="xla")

    @jax.jit
    def step(w, y, x):
        return w.add_lora_linear(y, x, a, b, None, 0.5, SLICES)

    for n in (16, 5, 11, 1, 16):  # different real token counts and mappings, same bucket
        mapping = _random_mapping(rng, n)
        w.update_metadata(mapping, IDS, SLOTS + 1, 100, 0)
        x = np.zeros((BUCKET, HIDDEN), np.float32)
        x[:n] = rng.standard_normal((n, HIDDEN))
        y = rng.standard_normal((BUCKET, sum(SLICES))).astype(np.float32)
        got = np.asarray(step(w, jnp.asarray(y), jnp.asarray(x)))
        idx = [IDS.index(i) if i > 0 else -1 for i in mapping.index_mapping] + [-1] * (BUCKET - n)
        want = oracle.lora_linear(y, x, [np.asarray(t) for t in a], [np.asarray(t) for t in b], None, 0.5, idx)
        assert oracle.rel_err(got, want) < 1e-5
    assert step._cache_size() == 1, "the step recompiled for a new mapping of the same bucket"


def test_metadata_build_compiles_once():
    rng = np.random.default_rng(1)
    before = build_kernel_meta._cache_size()
    for _ in range(4):
        m = rng.integers(-1, SLOTS, 32).astype(np.int32)
        build_kernel_meta(jnp.asarray(m), jnp.int32(rng.integers(0, 33)), max_loras=SLOTS)
    assert build_kernel_meta._cache_size() - before <= 1


def test_no_host_sync_inside_the_step():
    """Device-to-host transfers are disallowed while the jitted step runs (vLLM's TPU goal)."""
    rng = np.random.default_rng(2)
    a, b = _weights(rng)
    w = jax_lora.PunicaWrapper(BUCKET, 8, None, max_loras=SLOTS, backend="xla")
    w.update_metadata(_random_mapping(rng, 9), IDS, SLOTS + 1, 100, 0)
    x = jnp.asarray(rng.standard_normal((BUCKET, HIDDEN)), jnp.float32)
    y = jnp.asarray(rng.standard_normal((BUCKET, sum(SLICES))), jnp.float32)
    hx = jnp.asarray(rng.standard_normal((8, HIDDEN)), jnp.float32)
    logits = jnp.zeros((8, 40), jnp.float32)
    la = jnp.asarray(rng.standard_normal((SLOTS, RANK, HIDDEN)), jnp.float32)
    lb = jnp.asarray(rng.standard_normal((SLOTS, 40, RANK)), jnp.float32)

    @jax.jit
    def step(w, y, x, logits):
        y = w.add_lora_linear(y, x, a, b, [jnp.ones((SLOTS, 16)), None], 0.5, SLICES)
        y = w.add_lora_embedding(y[:, :16], x[:, :RANK], b[0])
        return y, w.add_lora_logits(logits, hx, la, lb, 1.0)

    step(w, y, x, logits)  # compile outside the guard
    with jax.transfer_guard_device_to_host("disallow"):
        out = step(w, y, x, logits)
        jax.block_until_ready(out)


def test_wrapper_properties_inside_jit():
    rng = np.random.default_rng(3)
    w = jax_lora.PunicaWrapper(BUCKET, 8, None, max_loras=SLOTS)
    w.update_metadata(LoRAMapping((21, 21, 0, 24), (21,), True), IDS, SLOTS + 1, 100, 0)

    @jax.jit
    def read(w):
        starts, lengths, loras, batch, max_len, tokens = w.prefill_metadata
        return w.token_lora_indices, starts, lengths, loras, batch, max_len, tokens

    tok, starts, lengths, loras, batch, max_len, tokens = read(w)
    assert tok.shape == (BUCKET,) and np.asarray(tok)[:4].tolist() == [0, 0, -1, 3]
    assert int(batch) == 3 and int(max_len) == 2 and int(tokens) == 4
    assert np.asarray(starts)[:3].tolist() == [0, 2, 3] and np.asarray(loras)[:3].tolist() == [0, -1, 3]
    del rng


def test_wrapper_is_a_pytree_with_static_sizes():
    w = jax_lora.PunicaWrapper(BUCKET, 8, None, max_loras=SLOTS)
    leaves, treedef = jax.tree_util.tree_flatten(w)
    assert all(isinstance(leaf, jax.Array) for leaf in leaves)
    w2 = jax.tree_util.tree_unflatten(treedef, leaves)
    assert (w2.max_num_batched_tokens, w2.max_loras, w2.backend) == (BUCKET, SLOTS, w.backend)


@pytest.mark.parametrize("n_prompts,expected", [(1, 8), (8, 8), (9, 16), (13, 16), (17, 32)])
def test_prompt_mapping_bucket(n_prompts, expected):
    w = jax_lora.PunicaWrapper(64, 8, None, max_loras=SLOTS)
    w.update_metadata(LoRAMapping((21,) * 4, (21,) * n_prompts), IDS, SLOTS + 1, 100, 0)
    s = np.asarray(w.sampler_indices)
    assert s.shape == (expected,)
    assert (s[:n_prompts] == 0).all() and (s[n_prompts:] == -1).all()


def test_wrapper_add_lora_linear_with_bias_and_unequal_slices():
    """PunicaWrapper.add_lora_linear = per-slot bias (0 for -1) + shrink + expand over
    unequal slices at their offsets, returning a new y (JAX never mutates y)."""
    ids = (1, 0, 3, 2, 2, 0)
    idx = jax_helpers.ids_to_slots(ids)
    w = jax_helpers.wrapper(ids, jax_helpers.LORA_INDEX_TO_ID)
    T, H, r, L, widths = len(ids), 16, 4, 3, (8, 4, 4)
    x, y = jax_helpers.rand(T, H), jax_helpers.rand(T, 20)
    y_before = np.array(y)
    A = [jax_helpers.rand(L, 1, r, H) for _ in widths]
    B = [jax_helpers.rand(L, 1, n, r) for n in widths]
    bias = [jax_helpers.rand(L, n) for n in widths]
    out = w.add_lora_linear(jnp.asarray(y), x, A, B, bias, 0.5, widths)
    want, o = np.array(y, np.float64), 0
    for s, n in enumerate(widths):
        want = jax_helpers.expand_ref(want, jax_helpers.shrink_ref(x, A[s][:, 0], idx, 0.5), B[s][:, 0], idx, o, True)
        for t, i in enumerate(idx):
            if i >= 0:
                want[t, o:o + n] += bias[s][i]
        o += n
    assert jax_helpers.rel_err(out, want) < 1e-5
    np.testing.assert_array_equal(y, y_before)
    np.testing.assert_array_equal(np.asarray(out)[1], y[1])        # no-LoRA rows untouched (no bias)


def test_wrapper_logits_follow_sampler_indices_and_embedding():
    """add_lora_logits routes rows by the sampler indices (prompt_mapping), cutting a wider
    LoRA vocabulary to y; add_lora_embedding adds x @ B[idx].T per token."""
    tokens, prompts = (1, 1, 2, 2, 0), (2, 0, 1)
    w = jax_helpers.wrapper(tokens, jax_helpers.LORA_INDEX_TO_ID, prompt=prompts)
    R, H, r, L, V = 3, 8, 4, 3, 12
    h, logits = jax_helpers.rand(R, H), jax_helpers.rand(R, V)
    A, B = jax_helpers.rand(L, r, H), jax_helpers.rand(L, V + 4, r)                 # LoRA vocabulary wider than y
    out = w.add_lora_logits(logits, h, A, B, 2.0)
    sidx = jax_helpers.ids_to_slots(prompts)
    want = jax_helpers.expand_ref(logits, jax_helpers.shrink_ref(h, A, sidx, 2.0), B[:, :V], sidx, 0, True)
    assert jax_helpers.rel_err(out, want) < 1e-5
    tidx = jax_helpers.ids_to_slots(tokens)
    xe, ye, Be = jax_helpers.rand(len(tokens), r), jax_helpers.rand(len(tokens), 6), jax_helpers.rand(L, 6, r)
    emb = w.add_lora_embedding(ye, xe, Be)
    assert jax_helpers.rel_err(emb, jax_helpers.expand_ref(ye, xe, Be, tidx, 0, True)) < 1e-5


def test_wrapper_add_shrink_add_expand_bias_kept_without_add_inputs():
    """docs/api.md's choices: add_shrink overwrites its buffer (0 for no-LoRA rows);
    add_expand(add_inputs=False) with a bias writes bias + x @ B.T (the bias is not dropped),
    placed at offset_start."""
    ids = (2, 0, 1)
    idx = jax_helpers.ids_to_slots(ids)
    w = jax_helpers.wrapper(ids, jax_helpers.LORA_INDEX_TO_ID)
    T, H, r, L = 3, 8, 4, 3
    x, A = jax_helpers.rand(T, H), jax_helpers.rand(L, r, H)
    buf = w.add_shrink(jnp.full((1, T, r), 7.0, jnp.float32), x, [A], 1.5)
    assert jax_helpers.rel_err(buf[0], jax_helpers.shrink_ref(x, A, idx, 1.5)) < 1e-5
    assert np.all(np.asarray(buf)[0, 1] == 0)
    B, bias = jax_helpers.rand(L, 5, r), jax_helpers.rand(L, 5)
    y = jax_helpers.rand(T, 9)
    out = w.add_expand(y, buf, [B], [bias], (5,), offset_start=np.int64(2), add_inputs=False)
    want = jax_helpers.expand_ref(y, np.asarray(buf[0]), B, idx, 2, False)
    for t, i in enumerate(idx):
        if i >= 0:
            want[t, 2:7] += bias[i]
    assert jax_helpers.rel_err(out, want) < 1e-5


def test_wrapper_in_jit_compiles_once_per_bucket_without_host_transfers():
    """The wrapper is a pytree passed into jax.jit; a jitted step compiles once for several
    mappings of the same bucket, runs with no device-to-host transfer, and gives the same result
    as eagerly; a bucket-padded x leaves its padded rows unchanged; inside jit the index properties
    are the fixed-length buffers padded with 0."""
    T, H, r, L = 8, 8, 4, 3
    A, B = [jax_helpers.rand(L, r, H)], [jax_helpers.rand(L, 6, r)]
    traces = []

    @jax.jit
    def step(w, y, x):
        traces.append(1)
        return w.add_lora_linear(y, x, A, B, None, 1.0, (6,))

    for ids in [(1, 2, 0, 3, 1), (3, 3, 3, 0, 0, 2), (0, 0, 0)]:
        w = jax_helpers.wrapper(ids, jax_helpers.LORA_INDEX_TO_ID, capacity=16)
        x, y = jnp.asarray(jax_helpers.rand(T, H)), jnp.asarray(jax_helpers.rand(T, 6))    # padded to T = 8 rows
        with jax.transfer_guard_device_to_host("disallow"):
            got = step(w, y, x)
        np.testing.assert_allclose(got, w.add_lora_linear(y, x, A, B, None, 1.0, (6,)), rtol=1e-6, atol=1e-6)
        idx = jax_helpers.ids_to_slots(ids) + [-1] * (T - len(ids))
        assert jax_helpers.rel_err(got, jax_helpers.expand_ref(y, jax_helpers.shrink_ref(x, A[0], idx, 1.0), B[0],
                                                               idx, 0, True)) < 1e-5
        np.testing.assert_array_equal(np.asarray(got)[len(ids):], np.asarray(y)[len(ids):])
    assert len(traces) == 1
    # inside jit the properties are the fixed-length buffers, padded with 0 (contract section 2)
    tok, emb = jax.jit(lambda w: (w.token_lora_indices, w.embeddings_indices))(w)
    np.testing.assert_array_equal(tok, [-1, -1, -1] + [0] * 13)
    assert emb.shape == (2, 16) and not np.any(np.asarray(emb)[:, 3:])


def test_shrink_expand_expand_slice_methods():
    """vLLM's TPU wrapper's wrapper methods shrink(x, w_t_all, scale), expand(y, x,
    w_t_all, add_inputs) (cut to y's width) and expand_slice(y, x, w_t_all, y_offset,
    y_slice_size, add_inputs) use the step's token indices; rows past the mapped tokens are "no
    LoRA"; y_slice_size must equal w_t_all's n."""
    ids = (2, 0, 1)
    idx = jax_helpers.ids_to_slots(ids) + [-1]                       # x has one row past the mapping
    w = jax_helpers.wrapper(ids, jax_helpers.LORA_INDEX_TO_ID)
    T, H, r, L = 4, 8, 4, 3
    x, A = jax_helpers.rand(T, H), jax_helpers.rand(L, 1, r, H)
    s = w.shrink(x, A, 0.5)
    assert s.shape == (T, r) and s.dtype == jnp.float32
    assert jax_helpers.rel_err(s, jax_helpers.shrink_ref(x, A[:, 0], idx, 0.5)) < 1e-5
    B, y = jax_helpers.rand(L, 9, r), jax_helpers.rand(T, 7)                    # n = 9 > N = 7: cut
    e = w.expand(y, s, B, True)
    assert jax_helpers.rel_err(e, jax_helpers.expand_ref(y, s, B[:, :7], idx, 0, True)) < 1e-5
    Bs, y2 = jax_helpers.rand(L, 3, r), jax_helpers.rand(T, 10)
    es = w.expand_slice(y2, s, Bs, 4, 3, False)
    assert jax_helpers.rel_err(es, jax_helpers.expand_ref(y2, s, Bs, idx, 4, False)) < 1e-5
    np.testing.assert_array_equal(np.asarray(es)[3], y2[3])
    with pytest.raises(ValueError):
        w.expand_slice(y2, s, Bs, 4, 4, False)
