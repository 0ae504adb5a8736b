"""The base-model prefix cache (lora_core.prefix_blocks's token-block trie, jax_lora.prefix_cache in
the ServingEngine; float32, CPU, a tiny random Llama with peft's aLoRA and plain LoRA adapters).

The index: whole blocks only, a prefix that differs at token t matches the blocks before t, LRU
eviction of leaves (never a block whose chain is still cached), a full pool never evicts the
chain being stored. The engine: an aLoRA request after a base request with the same prefix reuses
the whole blocks before its invocation (Completion.cached_tokens, the engine's counters) and still
equals peft's aLoRA generate and the engine without the cache; a prefix one token different reuses
nothing past the difference; K/V computed with an adapter (plain LoRA, an aLoRA request from its
invocation on) are never stored; eviction in the engine; the reused prefill runs in the existing
prefill buckets (no compilation once warm); the counters read from a progress callback; a model
split over 2 CPU devices (the pool split like the cache). Marked
`gpu`: a bfloat16 model (a 16-bit cache: cuDNN's attention reads the copied keys) with the Triton
backend gives the tokens of the engine without the cache.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest

from lora_core.prefix_blocks import PrefixBlockIndex

from .test_alora import ADAPTERS, INVOCATION, MAX_NEW, _peft_generate
from .test_peft_roundtrip import VOCAB, build_peft_models
from .test_serving import count_compilations

BLOCK = 4


# ----------------------------------------------------------------------------- the index

def test_index_matches_whole_blocks_up_to_the_first_difference():
    idx = PrefixBlockIndex(num_blocks=8, block_size=4)
    p = list(range(10, 21))                                     # 11 tokens: 2 whole blocks
    assert idx.match(p, len(p)) == []
    new = idx.insert(p, len(p))
    assert [b for b, _ in new] == [0, 1] and idx.cached_blocks == 2
    assert idx.match(p, len(p)) == [s for _, s in new]
    assert idx.match(p, 7) == [new[0][1]]                       # the limit cuts block 1
    q = list(p)
    q[5] = 99                                                   # differs in block 1
    assert idx.match(q, len(q)) == [new[0][1]]
    q[0] = 99                                                   # differs in block 0
    assert idx.match(q, len(q)) == []
    assert idx.insert(p, len(p)) == []                          # cached already: nothing to write
    r = p[:4] + [1, 2, 3, 4]                                    # shares block 0, branches at block 1
    assert [b for b, _ in idx.insert(r, 8)] == [1] and idx.cached_blocks == 3


def test_index_keys_are_token_ids_not_positions_alone():
    idx = PrefixBlockIndex(num_blocks=4, block_size=2)
    idx.insert([1, 2, 3, 4], 4)
    assert idx.match([3, 4, 1, 2], 4) == []                     # block (3, 4) cached only after (1, 2)
    assert len(idx.match([1, 2, 3, 4, 5], 5)) == 2


def test_index_evicts_least_recently_used_leaves():
    idx = PrefixBlockIndex(num_blocks=3, block_size=2)
    a, b, c = [1, 1, 2, 2], [3, 3], [4, 4]
    idx.insert(a, 4)                                            # two blocks: (1,1) <- (2,2)
    idx.insert(b, 2)
    assert idx.cached_blocks == 3
    idx.match(a, 4)                                             # a is now the most recent
    idx.insert(c, 2)                                            # evicts b (the LRU leaf)
    assert idx.match(b, 2) == [] and len(idx.match(a, 4)) == 2 and idx.evicted_blocks == 1
    idx.insert([5, 5], 2)                                       # LRU is c now
    assert idx.match(c, 2) == []
    idx.insert([6, 6], 2)                                       # LRU: a's two blocks; the leaf goes, not its root
    assert idx.match(a, 4) == idx.match([1, 1], 2) and len(idx.match(a, 4)) == 1
    assert idx.evicted_blocks == 3 and idx.stored_blocks == 6


def test_index_does_not_evict_the_chain_it_stores():
    idx = PrefixBlockIndex(num_blocks=2, block_size=1)
    assert [b for b, _ in idx.insert([1, 2, 3, 4], 4)] == [0, 1]        # the pool holds two of the four
    assert len(idx.match([1, 2, 3, 4], 4)) == 2 and idx.evicted_blocks == 0
    held = set()                                                        # one write batch of two prompts
    first = idx.insert([5, 6], 2, held)
    second = idx.insert([7, 8], 2, held)
    assert len(first) == 2 and second == []                             # no slot handed out twice
    assert len(idx.match([5, 6], 2)) == 2 and idx.match([7], 1) == []
    assert len({s for _, s in first}) == 2
    with pytest.raises(ValueError, match="block_size must be an int >= 1"):
        PrefixBlockIndex(2, 0)


# ----------------------------------------------------------------------------- the engine

@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    return build_peft_models(tmp_path_factory.mktemp("prefix"), ADAPTERS)


def _engine(hf, dtype=None, **kw):
    from jax_lora.adapters import AdapterManager
    from jax_lora.models import add_lora, load_llama
    from jax_lora.serving import ServingEngine
    root, dirs, _ = hf
    model = load_llama(str(root / "base")) if dtype is None else load_llama(str(root / "base"), dtype=dtype)
    add_lora(model, max_loras=2, max_rank=8)
    mgr = AdapterManager(model)
    for lora_id, d in dirs.items():
        mgr.register(lora_id, d)
    return ServingEngine(model, mgr, max_seqs=4, max_len=40, keep_logits=True, **kw)


def _tokens(rng, n):
    return [int(t) for t in rng.integers(10, VOCAB, size=n)]       # ids >= 10: no accidental invocation


def _req(prompt, lora_id=None):
    from jax_lora.serving import Request
    return Request(prompt, lora_id=lora_id, max_new_tokens=MAX_NEW)


@pytest.fixture(scope="module")
def cached(hf):
    return _engine(hf, prefix_cache_tokens=64, prefix_block_size=BLOCK)


@pytest.fixture(scope="module")
def plain(hf):
    return _engine(hf)


def test_alora_request_reuses_the_base_prefix_and_equals_peft(hf, cached, plain):
    rng = np.random.default_rng(0)
    prefix = _tokens(rng, 10)                                   # 2 whole blocks of 4
    base = prefix + _tokens(rng, 3)
    act = prefix + INVOCATION + _tokens(rng, 2)                 # invocation at 10
    before = cached.prefix_cache_stats()
    first = cached.generate([_req(base)])[0]
    assert first.cached_tokens == 0
    stats = cached.prefix_cache_stats()
    assert stats["stored_tokens"] - before["stored_tokens"] == 12          # the base prompt's 3 whole blocks
    done = cached.generate([_req(act, 1)])[0]
    assert done.cached_tokens == 8                              # blocks 0, 1: before the invocation
    assert cached.last_stats["prefix_reused_tokens"] == 8
    after = cached.prefix_cache_stats()
    assert after["reused_tokens"] - stats["reused_tokens"] == 8
    assert after["stored_tokens"] == stats["stored_tokens"]     # its base blocks were cached already
    tokens, want = _peft_generate(hf[2][1], act)
    assert done.tokens == tokens
    np.testing.assert_allclose(done.logits, want, rtol=1e-4, atol=1e-4)
    ref = plain.generate([_req(act, 1)])[0]
    assert ref.cached_tokens == 0 and ref.tokens == done.tokens
    np.testing.assert_allclose(done.logits, ref.logits, rtol=1e-5, atol=1e-5)
    again = cached.generate([_req(base)])[0]                    # the whole prompt cached: all but its last
    assert again.cached_tokens == len(base) - 1 and again.tokens == first.tokens
    np.testing.assert_allclose(again.logits, first.logits, rtol=1e-5, atol=1e-5)
    tokens, want = _peft_generate(hf[2][None], base)
    assert first.tokens == tokens
    np.testing.assert_allclose(first.logits, want, rtol=1e-4, atol=1e-4)


def test_mixed_batch_with_reuse_equals_peft_per_request(hf, cached):
    """Base, aLoRA (invocation present and absent) and plain LoRA requests sharing one prefix, served
    after the prefix was cached, and an aLoRA request with a strength (the paired step): each equals
    peft's generate for the request alone."""
    rng = np.random.default_rng(1)
    prefix = _tokens(rng, 9)
    cached.generate([_req(prefix + _tokens(rng, 2))])
    reqs = [(prefix + INVOCATION + _tokens(rng, 1), 1), (prefix + _tokens(rng, 4), 1),
            (prefix + _tokens(rng, 3), 2), (prefix + _tokens(rng, 2), None)]
    out = cached.generate([_req(p, i) for p, i in reqs])
    assert [c.cached_tokens for c in out] == [8, 8, 0, 8]       # plain LoRA: an adapter on every token
    weighted = _req(prefix + INVOCATION + _tokens(rng, 2), 1)   # the paired step (a strength given)
    weighted.lora_weights = 1.0
    reqs.append((weighted.prompt, 1))
    out += cached.generate([weighted])
    assert out[-1].cached_tokens == 8
    for (p, lora_id), c in zip(reqs, out):
        tokens, want = _peft_generate(hf[2][lora_id], p)
        assert c.tokens == tokens, (p, lora_id)
        np.testing.assert_allclose(c.logits, want, rtol=1e-4, atol=1e-4)


def test_one_token_difference_reuses_nothing_past_it(cached, plain):
    rng = np.random.default_rng(2)
    p = _tokens(rng, 14)
    cached.generate([_req(p)])
    for t in (0, 3, 6, 12):
        q = list(p)
        q[t] = 10 + (q[t] - 9) % (VOCAB - 10)                   # another token id, still >= 10
        got = cached.generate([_req(q)])[0]
        assert got.cached_tokens == (t // BLOCK) * BLOCK, t
        want = plain.generate([_req(q)])[0]
        assert got.tokens == want.tokens
        np.testing.assert_allclose(got.logits, want.logits, rtol=1e-5, atol=1e-5)


def test_adapter_computed_kv_is_never_stored(hf, cached):
    engine = cached
    rng = np.random.default_rng(3)
    p = _tokens(rng, 12)
    before = engine.prefix_cache_stats()["stored_tokens"]
    engine.generate([_req(p, 2)])                               # plain LoRA: every token has the adapter
    assert engine.prefix_cache_stats()["stored_tokens"] == before
    assert engine.generate([_req(p)])[0].cached_tokens == 0
    act = _tokens(rng, 5) + INVOCATION + _tokens(rng, 6)        # invocation at 5: only block 0 is base
    engine.generate([_req(act, 1)])
    assert engine.prefix_cache_stats()["stored_tokens"] - before == 12 + 4
    base = engine.generate([_req(act)])[0]                      # the same prompt served by the base model
    assert base.cached_tokens == 4                              # not the aLoRA request's blocks from 5 on
    again = engine.generate([_req(act, 1)])[0]                  # the base request stored them: reused up to 5
    assert again.cached_tokens == 4
    tokens, want = _peft_generate(hf[2][1], act)
    assert again.tokens == tokens
    np.testing.assert_allclose(again.logits, want, rtol=1e-4, atol=1e-4)


def test_eviction_in_the_engine(hf, plain):
    engine = _engine(hf, prefix_cache_tokens=2 * BLOCK + 3, prefix_block_size=BLOCK)     # two blocks
    assert engine.prefix_cache_stats()["capacity_tokens"] == 2 * BLOCK
    rng = np.random.default_rng(4)
    a, b = _tokens(rng, 6), _tokens(rng, 6)                     # one whole block each
    engine.generate([_req(a)])
    engine.generate([_req(b)])
    assert engine.generate([_req(a + [11])])[0].cached_tokens == BLOCK         # a is the most recent now
    c = _tokens(rng, 5)
    engine.generate([_req(c)])                                  # evicts b
    stats = engine.prefix_cache_stats()
    assert stats["evicted_tokens"] == BLOCK and stats["cached_tokens"] == 2 * BLOCK
    got = engine.generate([_req(b)])[0]
    assert got.cached_tokens == 0
    want = plain.generate([_req(b)])[0]
    assert got.tokens == want.tokens
    engine.clear_prefix_cache()
    assert engine.generate([_req(a + [12])])[0].cached_tokens == 0
    engine.clear_prefix_cache()
    x, y = _tokens(rng, 9), _tokens(rng, 9)                     # two blocks each, prefilled in one step
    engine.generate([_req(x), _req(y)])
    got = engine.generate([_req(x)])[0]                         # x stored; y finds the pool held by x
    assert got.cached_tokens == 2 * BLOCK and engine.prefix_cache_stats()["cached_tokens"] == 2 * BLOCK
    want = plain.generate([_req(x)])[0]
    assert got.tokens == want.tokens
    np.testing.assert_allclose(got.logits, want.logits, rtol=1e-5, atol=1e-5)
    off = _engine(hf)
    assert off.prefix_cache_stats() is None and off.prefix_cache is None


def test_reuse_compiles_nothing_once_warm(cached):
    """The rest of a prompt is prefilled in an existing bucket; the two block copies are one program
    each: a second round of the same shapes compiles nothing."""
    engine = cached
    for seed in (5, 6):
        rng = np.random.default_rng(seed)
        prefix = _tokens(rng, 8)
        with count_compilations() as events:
            engine.generate([_req(prefix + _tokens(rng, 3))])
            engine.generate([_req(prefix + INVOCATION + _tokens(rng, 2), 1), _req(_tokens(rng, 20))])
        if seed == 6:
            assert events == []


@pytest.mark.parametrize("kw, match", [({"prefix_cache_tokens": -1}, "prefix_cache_tokens must be an int >= 0"),
                                       ({"prefix_cache_tokens": 1.5}, "prefix_cache_tokens must be an int >= 0"),
                                       ({"prefix_block_size": 0}, r"prefix_block_size must be an int in \[1, max_len"),
                                       ({"prefix_block_size": 41}, r"prefix_block_size must be an int in \[1, max_len"),
                                       ({"prefix_cache_tokens": 3, "prefix_block_size": 4}, "holds no whole block")])
def test_bad_prefix_cache_arguments(hf, kw, match):
    with pytest.raises(ValueError, match=match):
        _engine(hf, **kw)


def test_stats_from_a_progress_callback(cached):
    """progress runs inside generate (the engine's lock held by this thread): the counters are read
    without waiting for the lock."""
    seen, finished = [], []

    def serve():
        cached.generate([_req(_tokens(np.random.default_rng(8), 6))],
                        progress=lambda done, total: seen.append(cached.prefix_cache_stats()["lookups"]))
        finished.append(True)
    worker = threading.Thread(target=serve, daemon=True)
    worker.start()
    worker.join(timeout=120)
    assert finished and len(seen) == 1 and seen[0] >= 1


@pytest.mark.gpu
def test_reuse_with_triton_and_a_16_bit_cache(hf):
    import jax.numpy as jnp
    cached16 = _engine(hf, jnp.bfloat16, backend="triton", prefix_cache_tokens=64, prefix_block_size=BLOCK)
    plain16 = _engine(hf, jnp.bfloat16, backend="triton")
    rng = np.random.default_rng(9)
    prefix = _tokens(rng, 11)
    reqs = [_req(prefix + _tokens(rng, 3)), _req(prefix + INVOCATION + _tokens(rng, 2), 1),
            _req(prefix + _tokens(rng, 5))]
    cached16.generate(reqs[:1])
    got = cached16.generate(reqs[1:])
    want = plain16.generate(reqs[1:])
    assert [c.cached_tokens for c in got] == [8, 8]
    for g, w in zip(got, want):
        assert g.tokens == w.tokens
        np.testing.assert_allclose(g.logits, w.logits, rtol=5e-2, atol=5e-2)


def test_reuse_on_a_mesh(hf, plain):
    """The model split over 2 CPU devices (the pool split along the KV heads like the cache): an aLoRA
    request reusing a base prefix gives the unsplit engine's tokens."""
    import jax
    from jax.sharding import Mesh
    if jax.default_backend() != "cpu":
        pytest.skip("CPU-device meshes; JAX's default backend here is not the CPU")
    mesh = Mesh(np.array(jax.devices("cpu")[:2]), ("tp",))
    engine = _engine(hf, mesh=mesh, prefix_cache_tokens=32, prefix_block_size=BLOCK)
    assert engine.prefix_cache.pool.k[0].sharding == engine.model.cache_sharding()
    rng = np.random.default_rng(10)
    prefix = _tokens(rng, 9)
    engine.generate([_req(prefix + _tokens(rng, 2))])
    act = prefix + INVOCATION + _tokens(rng, 2)
    got = engine.generate([_req(act, 1)])[0]
    assert got.cached_tokens == 8
    want = plain.generate([_req(act, 1)])[0]
    assert got.tokens == want.tokens
    np.testing.assert_allclose(got.logits, want.logits, rtol=1e-4, atol=1e-4)
