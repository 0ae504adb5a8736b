"""JAX per-step behaviour: the wrapper as a jit argument compiles once per bucket, never syncs."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_lora
from jax_lora.meta import build_kernel_meta
from lora_core.host_mapping import LoRAMapping

from . import oracle

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
