"""jax_lora.nn: the Flax NNX multi-adapter layers against a float64 NumPy oracle, eager and under jit.

CPU, xla backend.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jax_lora import LoRAMapping, PunicaWrapper
from jax_lora import nn as lnn

L = 3            # slots
R = 4            # max rank
RTOL = 1e-5


def _rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30)


def _wrapper(token_ids, row_ids=None, vocab=64):
    """Wrapper with slot i holding LoRA id i + 1 (ids 0 -> no adapter)."""
    w = PunicaWrapper(64, 64, None, max_loras=L)
    row_ids = token_ids if row_ids is None else row_ids
    w.update_metadata(LoRAMapping(token_ids, row_ids), [1, 2, 3], L + 1, vocab)
    return w


def _fill(var, rng):
    var.set_value(jnp.asarray(rng.normal(size=var.get_value().shape), jnp.float32))
    return np.asarray(var.get_value(), np.float64)


def test_linear_fused_unequal_slices_matches_oracle():
    rng = np.random.default_rng(0)
    slices = (16, 8, 8)                               # q, k, v of a GQA projection
    layer = lnn.MultiLoRALinear(nnx.Linear(12, 32, rngs=nnx.Rngs(0)), max_loras=L, max_rank=R,
                                output_slices=slices)
    a = _fill(layer.lora_a, rng)                      # (S, L, R, in)
    b = _fill(layer.lora_b, rng)                      # (L, out, R)
    x = rng.normal(size=(2, 5, 12)).astype(np.float32)
    ids = np.array([1, 0, 3, 3, 2, 2, 0, 1, 1, 3])    # per token, (2, 5) flattened
    w = _wrapper(ids)
    kernel = np.asarray(layer.base.kernel.get_value(), np.float64)
    bias = np.asarray(layer.base.bias.get_value(), np.float64)
    xf = x.reshape(-1, 12).astype(np.float64)
    expect = xf @ kernel + bias
    for t, i in enumerate(ids):
        if i == 0:
            continue
        off = 0
        for s, n in enumerate(slices):
            expect[t, off:off + n] += xf[t] @ a[s, i - 1].T @ b[i - 1, off:off + n].T
            off += n
    got = layer(jnp.asarray(x), punica=w)
    assert got.shape == (2, 5, 32)
    assert _rel(got.reshape(-1, 32), expect) < RTOL
    with lnn.punica_context(w):                       # the context gives the same result
        assert _rel(layer(jnp.asarray(x)).reshape(-1, 32), expect) < RTOL
    np.testing.assert_allclose(layer(jnp.asarray(x)), layer.base(jnp.asarray(x)))  # no wrapper: base


@pytest.mark.parametrize("backend,deterministic", [("xla", False), ("triton", False), ("triton", True)])
def test_stacked_slices_equal_separate_slices_on_every_backend(backend, deterministic):
    """MultiLoRALinear's call (add_lora_linear_stacked: the triton backend reads the slices of the
    stacked A and B in place as views) equals add_lora_linear on separate slice arrays, under jit,
    with per-slot ranks, unequal slices and rows without an adapter."""
    rng = np.random.default_rng(3)
    slices, H, T = (16, 8, 24), 32, 7
    a = jnp.asarray(rng.normal(size=(3, L, R, H)), jnp.float32)
    b = jnp.asarray(rng.normal(size=(L, sum(slices), R)), jnp.float32)
    x = jnp.asarray(rng.normal(size=(T, H)), jnp.float32)
    y = jnp.asarray(rng.normal(size=(T, sum(slices) + 8)), jnp.float32)      # wider y: columns past the slices
    ranks = jnp.asarray([4, 2, 3], jnp.int32)
    w = PunicaWrapper(64, 64, None, max_loras=L, backend=backend, deterministic=deterministic)
    w.update_metadata(LoRAMapping((1, 0, 3, 3, 2, 0, 1), (1, 0, 3, 3, 2, 0, 1)), [1, 2, 3], L + 1, 64)
    got = jax.jit(lambda y, x, a, b: w.add_lora_linear_stacked(y, x, a, b, 0.5, slices, lora_ranks=ranks))(y, x, a, b)
    sep_b = (b[:, :16], b[:, 16:24], b[:, 24:48])
    want = w.add_lora_linear(y, x, tuple(a[s] for s in range(3)), sep_b, None, 0.5, slices, lora_ranks=ranks)
    assert np.array_equal(np.asarray(got), np.asarray(want))
    oracle = np.asarray(y, np.float64).copy()
    a64, b64, x64 = (np.asarray(v, np.float64) for v in (a, b, x))
    for t, i in enumerate((1, 0, 3, 3, 2, 0, 1)):
        if i:
            r, off = int(ranks[i - 1]), 0
            for s, n in enumerate(slices):
                oracle[t, off:off + n] += 0.5 * x64[t] @ a64[s, i - 1, :r].T @ b64[i - 1, off:off + n, :r].T
                off += n
    assert _rel(got, oracle) < RTOL
    with pytest.raises(ValueError, match="lora_b"):
        w.add_lora_linear_stacked(y, x, a, b[:, :40], 0.5, slices)
    with pytest.raises(ValueError, match="lora_b"):                          # rank of B != rank of A
        w.add_lora_linear_stacked(y, x, a, b[:, :, :2], 0.5, slices)


def test_linear_under_jit_with_wrapper_argument():
    rng = np.random.default_rng(1)
    layer = lnn.MultiLoRALinear(nnx.Linear(8, 12, use_bias=False, rngs=nnx.Rngs(1)), max_loras=L, max_rank=R,
                                output_slices=(6, 6))
    _fill(layer.lora_a, rng)
    _fill(layer.lora_b, rng)
    graphdef, state = nnx.split(layer)

    @jax.jit
    def f(state, w, x):
        with lnn.punica_context(w):
            return nnx.merge(graphdef, state)(x)

    x = jnp.asarray(rng.normal(size=(6, 8)), jnp.float32)
    for ids in ([1, 2, 3, 0, 0, 1], [0, 0, 0, 0, 0, 0], [3, 3, 3, 2, 2, 2]):
        w = _wrapper(np.array(ids))
        assert _rel(f(state, w, x), layer(x, punica=w)) < RTOL
    assert f._cache_size() == 1                       # new mappings, same program


def test_embedding_matches_oracle():
    rng = np.random.default_rng(2)
    vocab, dim = 40, 10
    layer = lnn.MultiLoRAEmbed(nnx.Embed(vocab, dim, rngs=nnx.Rngs(2)), max_loras=L, max_rank=R)
    a = _fill(layer.lora_a, rng)                      # (L, V, R)
    b = _fill(layer.lora_b, rng)                      # (L, D, R)
    tokens = np.array([[3, 7, 39, 0], [5, 5, 12, 1]])
    ids = np.array([2, 0, 1, 3, 3, 0, 1, 2])
    w = _wrapper(ids, vocab=vocab)
    table = np.asarray(layer.base.embedding.get_value(), np.float64)
    expect = table[tokens.reshape(-1)]
    for t, (tok, i) in enumerate(zip(tokens.reshape(-1), ids)):
        if i:
            expect[t] += a[i - 1, tok] @ b[i - 1].T
    got = layer(jnp.asarray(tokens), punica=w)
    assert got.shape == (2, 4, dim)
    assert _rel(got.reshape(-1, dim), expect) < RTOL


def test_logits_rows_follow_the_prompt_mapping():
    rng = np.random.default_rng(3)
    hidden, vocab = 16, 50
    layer = lnn.MultiLoRALogits(nnx.Linear(hidden, vocab, use_bias=False, rngs=nnx.Rngs(3)), max_loras=L,
                                max_rank=R)
    a = _fill(layer.lora_a, rng)
    b = _fill(layer.lora_b, rng)
    h = rng.normal(size=(4, hidden)).astype(np.float32)     # one sampled row per sequence
    tokens = np.array([1, 1, 1, 0, 0, 2, 3, 3])             # per-token ids differ from the rows'
    rows = np.array([0, 3, 2, 1])
    w = _wrapper(tokens, rows, vocab=vocab)
    expect = h.astype(np.float64) @ np.asarray(layer.base.kernel.get_value(), np.float64)
    for j, i in enumerate(rows):
        if i:
            expect[j] += h[j] @ a[i - 1].T @ b[i - 1].T
    assert _rel(layer(jnp.asarray(h), punica=w), expect) < RTOL


class _Block(nnx.Module):
    def __init__(self, rngs):
        self.q_proj = nnx.Linear(8, 8, rngs=rngs)
        self.kv_proj = nnx.Linear(8, 12, rngs=rngs)
        self.mlp = nnx.Linear(8, 8, rngs=rngs)


class _Toy(nnx.Module):
    def __init__(self, rngs):
        self.embed = nnx.Embed(20, 8, rngs=rngs)
        self.blocks = nnx.List([_Block(rngs) for _ in range(2)])
        self.lm_head = nnx.Linear(8, 20, rngs=rngs)

    def __call__(self, ids):
        x = self.embed(ids)
        for blk in self.blocks:
            x = blk.q_proj(x) + blk.kv_proj(x)[..., :8] + blk.mlp(x)
        return self.lm_head(x[:, -1])


def test_replace_lora_layers_swaps_targets_in_place():
    model = _Toy(nnx.Rngs(0))
    ids = jnp.array([[1, 2, 3]])
    before = model(ids)
    replaced = lnn.replace_lora_layers(model, ["q_proj", "kv_proj", "embed", "lm_head"], max_loras=2, max_rank=4,
                                       output_slices={"kv_proj": (4, 8)})
    assert sorted(replaced) == ["blocks.0.kv_proj", "blocks.0.q_proj", "blocks.1.kv_proj", "blocks.1.q_proj",
                                "embed", "lm_head"]
    assert isinstance(model.blocks[1].q_proj, lnn.MultiLoRALinear)
    assert model.blocks[0].kv_proj.output_slices == (4, 8)
    assert isinstance(model.embed, lnn.MultiLoRAEmbed)
    assert isinstance(model.lm_head, lnn.MultiLoRALogits)
    assert isinstance(model.blocks[0].mlp, nnx.Linear)
    np.testing.assert_allclose(model(ids), before)                    # no wrapper: unchanged model
    assert set(lnn.lora_layers(model)) == set(replaced)
    lora_state = nnx.state(model, lnn.LoRAWeight)                      # filterable adapter weights
    assert len(jax.tree.leaves(lora_state)) == 3 * len(replaced)             # lora_a, lora_b, lora_ranks
    # A regex over the full path, as PEFT's string form.
    model2 = _Toy(nnx.Rngs(0))
    got = lnn.replace_lora_layers(model2, r"blocks\.1\..*proj", max_loras=2, max_rank=2)
    assert sorted(got) == ["blocks.1.kv_proj", "blocks.1.q_proj"]
    # A second call never wraps the base layer inside a multi-LoRA layer.
    again = lnn.replace_lora_layers(model2, r".*proj.*", max_loras=2, max_rank=2)
    assert sorted(again) == ["blocks.0.kv_proj", "blocks.0.q_proj"]


def test_replace_and_layer_errors():
    with pytest.raises(ValueError, match="match no"):
        lnn.replace_lora_layers(_Toy(nnx.Rngs(0)), ["nope"], max_loras=2, max_rank=2)
    with pytest.raises(ValueError, match="output_slices"):
        lnn.MultiLoRALinear(nnx.Linear(4, 10, rngs=nnx.Rngs(0)), max_loras=2, max_rank=2, output_slices=(4, 4))
    with pytest.raises(ValueError, match="max_rank"):
        lnn.MultiLoRALinear(nnx.Linear(4, 10, rngs=nnx.Rngs(0)), max_loras=2, max_rank=0)
    with pytest.raises(TypeError, match="nnx.Linear"):
        lnn.MultiLoRALinear(nnx.Embed(4, 10, rngs=nnx.Rngs(0)), max_loras=2, max_rank=2)


def test_linear_bf16_weights_and_activations():
    rng = np.random.default_rng(4)
    layer = lnn.MultiLoRALinear(nnx.Linear(16, 24, use_bias=False, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16,
                                           rngs=nnx.Rngs(4)), max_loras=L, max_rank=R, output_slices=(16, 8))
    assert layer.lora_a.get_value().dtype == jnp.bfloat16          # adapter dtype follows the base layer
    a = _fill(layer.lora_a, rng)
    b = _fill(layer.lora_b, rng)
    layer.lora_a.set_value(layer.lora_a.get_value().astype(jnp.bfloat16))
    layer.lora_b.set_value(layer.lora_b.get_value().astype(jnp.bfloat16))
    x = jnp.asarray(rng.normal(size=(5, 16)), jnp.bfloat16)
    ids = np.array([1, 0, 2, 3, 3])
    got = layer(x, punica=_wrapper(ids))
    assert got.dtype == jnp.bfloat16
    xf = np.asarray(x, np.float64)
    expect = xf @ np.asarray(layer.base.kernel.get_value(), np.float64)
    for t, i in enumerate(ids):
        if i:
            expect[t, :16] += xf[t] @ a[0, i - 1].T @ b[i - 1, :16].T
            expect[t, 16:] += xf[t] @ a[1, i - 1].T @ b[i - 1, 16:].T
    assert _rel(got.astype(jnp.float32), expect) < 2e-2
