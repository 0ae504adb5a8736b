"""The jit serving loop (jax_lora.serving): mixed adapters equal merged weights, one compilation per
bucket, hot swap, LRU swaps with fewer slots than adapters, and requests checked before anything
runs. CPU, xla backend; tests/llama_checkpoint.py's tiny Llama is the model of the later tests.
"""

import contextlib
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_lora.adapters import AdapterManager, load_peft_adapter
from jax_lora.cli import build_demo_assets, verify
from jax_lora.models import add_lora, load_llama
from jax_lora.serving import Request, ServingEngine

from . import llama_checkpoint

MAX_LEN = 48


@contextlib.contextmanager
def count_compilations():
    """Counts XLA backend compilations (of anything) inside the block."""
    events = []

    def listener(name, _secs, **_kw):
        if name == "/jax/core/compile/backend_compile_duration":
            events.append(name)
    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        yield events
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    root = tmp_path_factory.mktemp("serving")
    model_dir, adapter_dirs = build_demo_assets(str(root), seed=3)
    # Two more adapters (copies of 1 and 3 under new ids) so 5 adapters share 4 slots: LRU swaps.
    extra = [shutil.copytree(adapter_dirs[0], str(root / "a4")), shutil.copytree(adapter_dirs[2], str(root / "a5"))]
    dirs = adapter_dirs + extra
    model = load_llama(model_dir)
    add_lora(model, max_loras=4, max_rank=16)
    mgr = AdapterManager(model, host_cache_size=3)
    for i, d in enumerate(dirs):
        mgr.register(i + 1, d)
    engine = ServingEngine(model, mgr, max_seqs=8, max_len=MAX_LEN, keep_logits=True)
    adapters = {i + 1: load_peft_adapter(d) for i, d in enumerate(dirs)}
    return engine, load_llama(model_dir), adapters, dirs


def _requests(rng, n, ids, vocab=512, new=(3, 9)):
    return [Request([int(t) for t in rng.integers(0, vocab, size=int(rng.integers(2, 17)))], lora_id=ids[i % len(ids)],
                    max_new_tokens=int(rng.integers(*new)), request_id=i) for i in range(n)]


def _check(engine, base, adapters, completions):
    matches, worst, differ = verify(base, adapters, completions, max_len=MAX_LEN)
    assert all(matches), (worst, matches)
    return differ


def test_mixed_adapters_equal_merged_weights(served):
    engine, base, adapters, _ = served
    reqs = _requests(np.random.default_rng(0), 14, [1, None, 2, 3])
    out = engine.generate(reqs)
    assert [c.request_id for c in out] == list(range(14))
    assert all(len(c.tokens) == r.max_new_tokens for c, r in zip(out, reqs))
    assert _check(engine, base, adapters, out) > 0.2            # the adapters really change the outputs
    assert engine.compile_count == 2                             # one prefill bucket + decode
    # Without adapters the same loop serves the base model (the baseline).
    plain = engine.generate(reqs[:4], use_lora=False)
    assert all(c.lora_id is None for c in plain)
    assert _check(engine, base, {}, plain) == 0.0


def test_no_recompilation_once_buckets_are_warm(served):
    engine, base, adapters, _ = served
    engine.generate(_requests(np.random.default_rng(1), 3, [2]))          # warm (may be warm already)
    programs = engine.compile_count
    rng = np.random.default_rng(2)
    for ids, n in (([None], 1), ([3, 1], 5), ([2, 2, None, 1, 3], 11), ([1, 2, 3, 4], 9)):
        out = engine.generate(_requests(rng, n, ids))
        if n == 11:
            _check(engine, base, adapters, out)      # (the oracle compiles its own program)
    assert engine.compile_count == programs
    with count_compilations() as compiles:
        engine.generate(_requests(rng, 6, [4, 1, None]))
    assert compiles == [] and engine.compile_count == programs


def test_lru_swaps_and_hot_swap_without_recompiling(served):
    engine, base, adapters, dirs = served
    mgr = engine.adapters
    engine.generate(_requests(np.random.default_rng(3), 2, [1]))
    programs = engine.compile_count
    evictions = mgr.stats["evictions"]
    with count_compilations() as compiles:
        out = engine.generate(_requests(np.random.default_rng(4), 15, [5, 4, 1, 2, 3]))   # 5 adapters, 4 slots
    assert compiles == [] and mgr.stats["evictions"] > evictions
    _check(engine, base, adapters, out)
    # Hot swap: id 1 now names adapter 2's weights; same slot shapes, no new program.
    try:
        mgr.register(1, dirs[1])
        with count_compilations() as compiles:
            out = engine.generate(_requests(np.random.default_rng(5), 4, [1]))
        assert compiles == []
        _check(engine, base, {1: adapters[2]}, out)
    finally:
        mgr.register(1, dirs[0])
    assert engine.compile_count == programs


def test_batch_invariance_eos_and_donation(served):
    engine, _, _, _ = served
    reqs = _requests(np.random.default_rng(6), 6, [3, None, 1])
    together = engine.generate(reqs)
    alone = engine.generate([reqs[2]])[0]
    assert alone.tokens == together[2].tokens
    np.testing.assert_allclose(alone.logits, together[2].logits, rtol=1e-5, atol=1e-5)
    eos = together[0].tokens[0]
    stopped = engine.generate([Request(reqs[0].prompt, reqs[0].lora_id, max_new_tokens=8, eos_token_id=eos)])[0]
    assert stopped.tokens == [eos]
    old = engine.cache.k[0]
    engine.generate([Request([1, 2], None, max_new_tokens=1)])
    assert old.is_deleted()                                       # the KV cache buffers were donated


def test_no_implicit_transfer_on_the_serving_path(served):
    """A warm serving loop makes no implicit transfer: no `.item()` / `float()` / `bool()` of a device
    value and no implicit upload anywhere on the per-step path (the guard raises on those)."""
    engine = served[0]
    reqs = _requests(np.random.default_rng(7), 5, [2, None, 5, 3])
    engine.generate(reqs)
    with jax.transfer_guard("disallow"):
        engine.generate(reqs)


def test_prefill_buckets(served):
    engine = served[0]
    assert engine.prefill_shape(1, 5) == (8, 16)          # vLLM's minimum of 8 rows
    assert engine.prefill_shape(3, 30) == (8, 32)
    saved = engine.max_prefill_tokens
    try:
        engine.max_prefill_tokens = 64                     # long prompts get fewer rows
        assert engine.prefill_shape(1, 30) == (2, 32)
        assert engine.prefill_shape(2, 17) == (2, 32)
        assert engine.prefill_shape(3, 30) is None
    finally:
        engine.max_prefill_tokens = saved


def test_request_errors(served):
    engine = served[0]
    with pytest.raises(ValueError, match="exceeds max_len"):
        engine.generate([Request([1] * 40, None, max_new_tokens=20)])
    with pytest.raises(ValueError, match="not registered"):
        engine.generate([Request([1, 2], 42)])
    with pytest.raises(ValueError, match="token ids"):
        engine.generate([Request([1, 9999], None)])
    with pytest.raises(ValueError, match="empty prompt"):
        engine.generate([Request([], None)])
    # Every field is checked by type too, naming the request and the field, before anything runs
    # (a NaN max_new_tokens once passed the range checks and decoded forever).
    bad = [(Request([1], max_new_tokens=float("nan")), TypeError, "request 0: max_new_tokens must be an int"),
           (Request([1], max_new_tokens=2.5), TypeError, "max_new_tokens must be an int"),
           (Request([1], max_new_tokens=True), TypeError, "max_new_tokens must be an int"),
           (Request([1.7, 2.2]), TypeError, "prompt must be a 1-D sequence of integer token ids"),
           (Request("abc"), TypeError, "prompt must be a sequence of token ids, got str"),
           (Request(None), TypeError, "prompt must be a sequence of token ids, got NoneType"),
           (Request([[1, 2]]), TypeError, "prompt must be a 1-D sequence"),
           (Request([1], lora_id=True), TypeError, "lora_id must be None or an int"),
           (Request([1], lora_id=1.0), TypeError, "lora_id must be None or an int"),
           (Request([1], eos_token_id=-1), ValueError, "eos_token_id must be None or a token id in"),
           ([1, 2], TypeError, "request 0: expected a jax_lora.serving.Request, got list")]
    for req, kind, message in bad:
        with pytest.raises(kind, match=message):
            engine.generate([req])
    assert engine.generate([Request(np.array([1, 2]), np.int64(1), max_new_tokens=np.int32(2))])[0].tokens


def test_colliding_request_ids_are_refused(served):
    """Completions are told apart by request_id: two requests of one call that would share one
    (the same id twice, or an id equal to the index another request without id takes) are refused
    before anything runs; distinct ids, and the same Request object without id twice, are served."""
    engine = served[0]
    steps = engine.last_stats
    for reqs, kind, message in (
            ([Request([1, 2], request_id="a"), Request([3], request_id="a")], ValueError,
             r"request 1: request_id 'a' is already in flight in this call \(request 0's\)"),
            ([Request([1, 2]), Request([3], request_id=0)], ValueError,
             r"request 1: request_id 0 is already in flight in this call \(request 0's index \(it has no "
             r"request_id\)\)"),
            ([Request([1, 2], request_id=np.int64(1)), Request([3])], ValueError,
             r"request 1: request_id 1 is already in flight"),
            ([Request([1, 2], request_id=["a"])], TypeError,
             r"request 0: request_id must be hashable \(it tells the Completions apart\), got list \['a'\]")):
        with pytest.raises(kind, match=message):
            engine.generate(reqs)
        assert engine.last_stats is steps                 # refused before anything ran
    twice = Request([1, 2], max_new_tokens=2)
    out = engine.generate([twice, twice, Request([3], request_id="x", max_new_tokens=2)])
    assert [c.request_id for c in out] == [0, 1, "x"] and out[0].tokens == out[1].tokens


def test_engine_arguments_and_an_adapterless_engine(served):
    base = served[1]
    for kw, message in ((dict(max_seqs=0), "max_seqs must be an int >= 1, got 0"),
                        (dict(max_len=-5), "max_len must be an int >= 1, got -5"),
                        (dict(max_seqs="4"), "max_seqs must be an int >= 1, got '4'")):
        with pytest.raises(ValueError, match=message):
            ServingEngine(base, None, **kw)
    with pytest.raises(TypeError, match="model must be a jax_lora.models LlamaForCausalLM"):
        ServingEngine(None)
    plain = ServingEngine(base, None, max_seqs=2, max_len=16)
    with pytest.raises(ValueError, match="request 0 names adapter 1 but the engine has no adapters"):
        plain.generate([Request([1, 2, 3], lora_id=1, max_new_tokens=2)])   # never served as the base model in silence
    assert plain.generate([Request([1, 2, 3], lora_id=1, max_new_tokens=2)], use_lora=False)[0].lora_id is None


def test_a_16_bit_model_gets_a_16_bit_cache(served):
    """The engine's KV cache has the model's dtype (a float32 cache doubled its memory and kept a
    bf16 model off cuDNN's attention, which needs one 16-bit dtype)."""
    import jax.numpy as jnp
    from flax import nnx

    from jax_lora.models import LlamaForCausalLM
    cfg = served[1].config
    model = LlamaForCausalLM(cfg, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    engine = ServingEngine(model, None, max_seqs=2, max_len=16)
    assert {a.dtype for a in jax.tree.leaves(engine.cache)} == {jnp.dtype(jnp.bfloat16)}
    assert ServingEngine(served[1], None, max_seqs=2, max_len=16).cache.k[0].dtype == jnp.float32
    assert len(engine.generate([Request([1, 2, 3], max_new_tokens=2)])[0].tokens) == 2


def test_demo_command_verifies_every_request(capsys):
    from jax_lora.cli import main
    assert main(["demo", "--requests", "7", "--max-new-tokens", "3", "--slots", "2"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert out[-1] == "verified: 7/7 requests match merged-weights outputs"
    assert any(line.startswith("recompilations after warm-up: 0") for line in out)
    assert any("tokens/s" in line for line in out) and any("LoRA overhead" in line for line in out)


def test_demo_command_reports_a_bad_adapter(tmp_path, capsys):
    from jax_lora.cli import main
    assert main(["demo", str(tmp_path), str(tmp_path)]) == 2
    assert "error" in capsys.readouterr().err


def check_deterministic_tokens(model, adapters, base, peft_adapters, backend, rng):
    """Deterministic mode through the serving loop: one request served alone (a 2-row engine) and
    inside batches of 2-8 requests with other adapters (an 8-row engine, the request at a random
    row, prefill buckets of other sizes) gets the same greedy tokens, and every batch still equals
    the merged-weights outputs."""
    kw = dict(max_len=MAX_LEN, min_prefill_rows=1, keep_logits=True, backend=backend, deterministic=True)
    alone_engine = ServingEngine(model, adapters, max_seqs=2, **kw)
    batch_engine = ServingEngine(model, adapters, max_seqs=8, **kw)
    assert alone_engine.punica.deterministic and batch_engine.punica.deterministic
    request = Request([int(t) for t in rng.integers(0, 512, size=5)], lora_id=3, max_new_tokens=6, request_id="r")
    alone = alone_engine.generate([request])[0]
    for size in (2, 5, 8):
        others = _requests(rng, size - 1, [1, None, 2, 4])
        pos = int(rng.integers(0, size))
        out = batch_engine.generate(others[:pos] + [request] + others[pos:])
        assert out[pos].request_id == "r" and out[pos].tokens == alone.tokens, (size, pos)
        np.testing.assert_allclose(out[pos].logits, alone.logits, rtol=1e-5, atol=1e-5)
        _check(batch_engine, base, peft_adapters, out)


def test_deterministic_serving_gives_a_request_the_same_tokens_in_any_batch(served):
    engine, base, adapters, _ = served
    check_deterministic_tokens(engine.model, engine.adapters, base, adapters, "xla", np.random.default_rng(8))


@pytest.fixture(scope="module")
def llama_dirs(tmp_path_factory):
    """A tiny random Llama checkpoint and three PEFT adapters (tests/llama_checkpoint.py): directory per key."""
    return llama_checkpoint.write_assets(tmp_path_factory.mktemp("llama_checkpoint"))


@pytest.fixture(scope="module")
def engine(llama_dirs):
    model = load_llama(llama_dirs["model"])
    add_lora(model, max_loras=2, max_rank=8)
    mgr = AdapterManager(model, host_cache_size=1)
    for i in (1, 2, 3):
        mgr.register(i, llama_dirs[f"a{i}"])
    return ServingEngine(model, mgr, max_seqs=4, max_len=32, keep_logits=True)


def test_serving_mixed_adapters_lru_and_hot_swap_without_recompiling(llama_dirs, engine):
    """The jit continuous-batching loop serves requests naming different PEFT
    adapters (ranks 4 / 8 rsLoRA with embed_tokens and lm_head / 2, or none) with 2 slots for 3
    adapters (LRU swaps), each request equal to the model with its adapter merged (logits 1e-4,
    greedy tokens); the manager writes each slot's real rank per layer; once the buckets are warm,
    more batches, LRU evictions and a hot swap (register an id again) compile nothing; the hot swap
    keeps the slot; NaN/Inf left in the KV cache rows never reach a new request (row hygiene)."""
    dirs = {0: None, 1: llama_dirs["a1"], 2: llama_dirs["a2"], 3: llama_dirs["a3"]}
    reqs = [Request([1, 2, 3], 1, 3), Request([4, 5], None, 3), Request([7, 8, 9, 10], 2, 3),
            Request([11, 3], 3, 2), Request([9, 9, 9], 1, 2)]
    out = engine.generate(reqs)
    assert [c.request_id for c in out] == list(range(5))
    llama_checkpoint.check_against_merged(llama_dirs, out, dirs)
    warm = engine.compile_count
    mgr = engine.adapters
    ranks = {p: np.asarray(layer.lora_ranks.get_value()) for p, layer in mgr.layers.items()}
    for lora_id, path, rank in [(1, "model.layers.0.self_attn.qkv_proj", 4), (2, "lm_head", 8),
                                (2, "model.embed_tokens", 8), (2, "model.layers.0.self_attn.qkv_proj", 0)]:
        if mgr.slot_of(lora_id) is not None:                  # per-slot, per-layer real ranks
            assert ranks[path][mgr.slot_of(lora_id)] == rank, (lora_id, path)
    out2 = engine.generate([Request([5, 6], 3, 2), Request([2, 2, 2], 2, 2), Request([8], 1, 2)])
    llama_checkpoint.check_against_merged(llama_dirs, out2, dirs)
    assert mgr.stats["evictions"] > 0
    slot = mgr.slot_of(1)
    if slot is None:
        slot = mgr.load(1)
    mgr.register(1, llama_dirs["a3"])                    # hot swap: id 1 now serves a3's weights
    assert mgr.slot_of(1) == slot
    out3 = engine.generate([Request([1, 2, 3], 1, 2)])
    llama_checkpoint.check_against_merged(llama_dirs, out3, {1: llama_dirs["a3"]})
    mgr.register(1, llama_dirs["a1"])
    # row hygiene: NaN / Inf an earlier request left in the KV cache never reach a new request
    from jax_lora.models import KVCache
    engine.cache = KVCache(tuple(jnp.full_like(k, jnp.nan) for k in engine.cache.k),
                           tuple(jnp.full_like(v, jnp.inf) for v in engine.cache.v))
    llama_checkpoint.check_against_merged(llama_dirs, engine.generate([Request([4, 4, 1], 2, 2), Request([6], None,
                                                                                                         2)]), dirs)
    assert engine.compile_count == warm


def test_serving_request_checks(engine):
    """Requests are checked before anything runs (TypeError/ValueError naming the
    request and field): empty prompt, token out of vocab, unregistered adapter, bool max_new_tokens,
    two requests with one request_id; an engine without adapters refuses a request naming one;
    prefill steps use vLLM's bucketed shapes."""
    cases = [
        ([Request([], 1, 2)], ValueError, "request 0"),
        ([Request([1, 64], None, 2)], ValueError, "request 0"),
        ([Request([1], 9, 2)], ValueError, "9"),
        ([Request([1], None, True)], TypeError, "max_new_tokens"),
        ([Request([1], None, 2, request_id="a"), Request([2], None, 2, request_id="a")], ValueError, "request_id"),
        ([Request([1], None, 2), Request([2], None, 2, request_id=0)], ValueError, "request_id"),
    ]
    for reqs, exc, word in cases:
        with pytest.raises(exc) as e:
            engine.generate(reqs)
        assert word in str(e.value)
    # bucketed prefill shapes: rows max(next_pow2(n), 8) capped at max_seqs = 4, length
    # max(16, next_pow2(longest prompt))
    assert engine.prefill_shape(1, 3) == (4, 16) and engine.prefill_shape(3, 17) == (4, 32)
    bare = ServingEngine(engine.model, None, max_seqs=2, max_len=16)
    with pytest.raises(ValueError, match="adapter"):
        bare.generate([Request([1, 2], 1, 1)])
