"""The serving engine's ahead-of-time step calls (`ServingEngine(..., aot_calls=True)`, the default)
against its jitted calls (aot_calls=False): bitwise the same greedy tokens and logits over two
prefill buckets, decode, a step without adapters, a two-adapter request (a pair bucket) and LRU
adapter swaps; the same program count, no program for same-shape slot writes; the KV cache
donated to each Compiled program; a step whose arguments differ from its bucket's program refused
by name. CPU, xla backend, tests/llama_checkpoint.py's tiny Llama.
"""

import jax.numpy as jnp
import numpy as np
import pytest

from jax_lora.adapters import AdapterManager
from jax_lora.models import add_lora, load_llama
from jax_lora.serving import Request, ServingEngine

from . import llama_checkpoint


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    """Two engines on one model and one AdapterManager (2 slots for 3 adapters): AOT calls and jit calls."""
    dirs = llama_checkpoint.write_assets(tmp_path_factory.mktemp("llama_checkpoint"))
    model = load_llama(dirs["model"])
    add_lora(model, max_loras=2, max_rank=8)
    mgr = AdapterManager(model, host_cache_size=1)
    for i in (1, 2, 3):
        mgr.register(i, dirs[f"a{i}"])
    make = dict(max_seqs=4, max_len=40, keep_logits=True)
    return ServingEngine(model, mgr, **make), ServingEngine(model, mgr, aot_calls=False, **make)


def _same(a, b):
    assert [c.tokens for c in a] == [c.tokens for c in b]
    for x, y in zip(a, b):
        np.testing.assert_array_equal(x.logits, y.logits)


def test_aot_calls_equal_jit_calls_and_compile_each_bucket_once(engines):
    """Prompts of up to 16 and of 17-32 tokens (two prefill buckets), more requests than rows
    (continuous batching), 3 adapters over 2 slots: tokens and logits bitwise equal to the jitted
    calls', one Compiled program per bucket (as many as jit compiles), none for the slot writes of
    a second batch; a base-model step and a two-adapter request add their own buckets."""
    aot, jit = engines
    assert aot.aot_calls and not jit.aot_calls
    rng = np.random.default_rng(0)
    reqs = [Request([int(t) for t in rng.integers(0, 64, size=n)], lora, new)
            for n, lora, new in [(3, 1, 3), (20, 2, 4), (5, None, 2), (9, 3, 3), (18, 1, 2), (2, 2, 3)]]
    first = aot.generate(reqs)
    _same(first, jit.generate(reqs))
    assert aot.compile_count == jit.compile_count == len(aot._programs) == 3      # prefill x2, decode
    assert {key[:3] for key in aot._programs} == {((4, 16), False, True), ((4, 32), False, True),
                                                  ((4, 1), True, True)}
    swaps = aot.adapters.stats["evictions"]
    again = [Request([7, 1, 4], 3, 3), Request([30, 2], 1, 2), Request(list(range(1, 19)), 2, 2)]
    _same(aot.generate(again), jit.generate(again))
    assert aot.adapters.stats["evictions"] > swaps                                 # same-shape slot writes
    assert aot.compile_count == jit.compile_count == 3
    base = aot.generate(reqs[:2], use_lora=False)
    _same(base, jit.generate(reqs[:2], use_lora=False))
    assert aot.compile_count == jit.compile_count == 5                            # the base model's two buckets
    pair = [Request([5, 6, 7], lora_ids=[1, 2], lora_weights=[0.5, -1.0], max_new_tokens=2)]
    _same(aot.generate(pair), jit.generate(pair))
    assert aot.compile_count == jit.compile_count == 7                            # its pair bucket: prefill, decode
    assert any(key[3] > 0 for key in aot._programs)


def test_aot_step_donates_the_cache_and_refuses_other_arguments(engines):
    """Each Compiled step deletes the KV cache it was given (donated, as under jit); a call whose
    tokens differ in dtype from its bucket's program is a TypeError naming the bucket and
    aot_calls=False, and leaves the cache alive."""
    aot, _ = engines
    aot.generate([Request([1, 2, 3], 1, 2)])
    old = aot.cache
    aot.generate([Request([4, 5], 2, 2)], use_lora=False)              # (and the base decode bucket exists)
    assert old.k[0].is_deleted() and not aot.cache.k[0].is_deleted()
    rows = aot.max_seqs
    with pytest.raises(TypeError, match=r"aot_calls=False") as e:
        aot._call_step(None, jnp.zeros((rows, 1), jnp.float32), jnp.zeros((rows, 1), jnp.int32), None,
                       jnp.zeros(rows, jnp.int32), False)
    assert "((4, 1), True, False, 0)" in str(e.value)
    assert not aot.cache.k[0].is_deleted()
    with pytest.raises(TypeError, match="aot_calls"):
        ServingEngine(aot.model, aot.adapters, aot_calls=1)
