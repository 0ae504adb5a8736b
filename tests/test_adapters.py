"""jax_lora.adapters: PEFT directories, placement into slots, the slot manager (LRU, hot swap).

Also: the reader's names re-exported from lora_core.peft, a reload that fails inside `activate`
changing nothing, and an adapter rank above the model's max_rank refused naming the module (on
tests/llama_checkpoint.py's tiny Llama). CPU, xla backend.
"""

import json
import math
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jax_lora
from jax_lora import nn as lnn
from jax_lora.adapters import (
    AdapterError,
    AdapterManager,
    adapter_ranks,
    load_peft_adapter,
    merge_adapter,
    prepare_adapter,
    save_peft_adapter,
)
from jax_lora.models import LlamaConfig, LlamaForCausalLM, add_lora, load_llama
from lora_core import peft as core_peft

from . import llama_checkpoint

CFG = LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=24, num_hidden_layers=1,
                  num_attention_heads=4, num_key_value_heads=2)      # q 16, k/v 8: unequal slices
Q, KV, I, H, V = CFG.q_size, CFG.kv_size, CFG.intermediate_size, CFG.hidden_size, CFG.vocab_size


def _model(slots=3, rank=8):
    m = LlamaForCausalLM(CFG, rngs=nnx.Rngs(0))
    add_lora(m, max_loras=slots, max_rank=rank)
    return m


def _write(tmp_path, name, r, targets=("q_proj", "v_proj"), alpha=None, rslora=False, seed=0, rank_pattern=None):
    rng = np.random.default_rng(seed)
    dims = {"q_proj": (H, Q), "k_proj": (H, KV), "v_proj": (H, KV), "o_proj": (Q, H), "gate_proj": (H, I),
            "up_proj": (H, I), "down_proj": (I, H)}
    mods = {}
    for t in targets:
        rr = (rank_pattern or {}).get(t, r)
        if t == "embed_tokens":
            mods["model.embed_tokens"] = (rng.normal(size=(rr, V)), rng.normal(size=(H, rr)))
        elif t == "lm_head":
            mods["lm_head"] = (rng.normal(size=(rr, H)), rng.normal(size=(V, rr)))
        else:
            part = "self_attn" if "proj" in t and t[0] in "qkvo" else "mlp"
            mods[f"model.layers.0.{part}.{t}"] = (rng.normal(size=(rr, dims[t][0])), rng.normal(size=(dims[t][1], rr)))
    path = str(tmp_path / name)
    save_peft_adapter(path, mods, r=r, lora_alpha=alpha or 2 * r, use_rslora=rslora, rank_pattern=rank_pattern)
    return path, mods


def test_reading_is_the_framework_free_parser():
    """jax_lora.adapters re-exports lora_core.peft's reader, so both sides read adapters alike."""
    from jax_lora import adapters
    from lora_core import peft as core
    for name in ("AdapterError", "PeftAdapter", "load_peft_adapter", "save_peft_adapter"):
        assert getattr(adapters, name) is getattr(core, name), name


def test_load_scaling_and_patterns(tmp_path):
    path, mods = _write(tmp_path, "a", 4, targets=("q_proj", "down_proj"), alpha=8, rank_pattern={"down_proj": 2})
    ad = load_peft_adapter(path)
    assert ad.r == 4 and ad.lora_alpha == 8 and not ad.use_rslora
    a, _, s, kind = ad.modules["model.layers.0.self_attn.q_proj"]
    assert kind == "linear" and s == pytest.approx(8 / 4)
    np.testing.assert_allclose(a, mods["model.layers.0.self_attn.q_proj"][0], rtol=1e-6)
    assert ad.modules["model.layers.0.mlp.down_proj"][2] == pytest.approx(8 / 2)   # rank_pattern r=2
    path2, _ = _write(tmp_path, "b", 16, alpha=16, rslora=True, targets=("q_proj", "embed_tokens"))
    ad2 = load_peft_adapter(path2)
    assert ad2.modules["model.layers.0.self_attn.q_proj"][2] == pytest.approx(16 / math.sqrt(16))
    assert ad2.modules["model.embed_tokens"][3] == "embedding"


def test_prepare_places_slices_pads_ranks_and_folds_scaling(tmp_path):
    model = _model(rank=8)
    path, mods = _write(tmp_path, "a", 4, targets=("q_proj", "v_proj", "gate_proj", "lm_head"), alpha=12)
    prepared = prepare_adapter(model, load_peft_adapter(path))
    A, B = prepared["model.layers.0.self_attn.qkv_proj"]
    assert A.shape == (3, 8, H) and B.shape == (Q + 2 * KV, 8)
    qa, qb = mods["model.layers.0.self_attn.q_proj"]
    va, vb = mods["model.layers.0.self_attn.v_proj"]
    np.testing.assert_allclose(A[0, :4], qa, rtol=1e-6)
    np.testing.assert_allclose(A[2, :4], va, rtol=1e-6)
    assert not A[1].any() and not A[:, 4:].any()                   # k slice empty, rank padding zero
    np.testing.assert_allclose(B[:Q, :4], qb * 3.0, rtol=1e-6)     # scaling 12 / 4 folded into B
    assert not B[Q:Q + KV].any()
    np.testing.assert_allclose(B[Q + KV:, :4], vb * 3.0, rtol=1e-6)
    _, gB = prepared["model.layers.0.mlp.gate_up_proj"]
    assert gB[:I, :4].any() and not gB[I:].any()                    # gate slice only
    assert not prepared["model.layers.0.mlp.down_proj"][0].any()    # untargeted layer: zeros
    assert prepared["lm_head"][1].shape == (V, 8)


def test_shape_and_format_errors(tmp_path):
    model = _model(rank=4)
    with pytest.raises(AdapterError, match="rank 8 exceeds the model's max_rank=4"):
        prepare_adapter(model, load_peft_adapter(_write(tmp_path, "big", 8)[0]))
    bad = str(tmp_path / "bad")
    save_peft_adapter(bad, {"model.layers.0.self_attn.q_proj": (np.ones((2, H + 1)), np.ones((Q, 2)))}, r=2,
                      lora_alpha=2)
    with pytest.raises(AdapterError, match=r"expected lora_A \(2, 16\) and lora_B \(16, 2\)"):
        prepare_adapter(model, load_peft_adapter(bad))
    other = str(tmp_path / "other")
    save_peft_adapter(other, {"model.layers.0.self_attn.rotary": (np.ones((2, H)), np.ones((Q, 2)))}, r=2,
                      lora_alpha=2)
    with pytest.raises(AdapterError, match="not a LoRA module of the model"):
        prepare_adapter(model, load_peft_adapter(other))
    pickled = tmp_path / "pickled"
    pickled.mkdir()
    (pickled / "adapter_config.json").write_text(json.dumps({"r": 2, "peft_type": "LORA"}))
    (pickled / "adapter_model.bin").write_bytes(b"\x80\x04not loaded")
    with pytest.raises(AdapterError, match="pickle"):
        load_peft_adapter(str(pickled))
    with pytest.raises(AdapterError, match="adapter_config.json is missing"):
        load_peft_adapter(str(tmp_path))
    dora, _ = _write(tmp_path, "dora", 2)
    cfg_path = os.path.join(dora, "adapter_config.json")
    with open(cfg_path) as f:
        cfg = json.load(f)
    cfg["use_dora"] = True
    with open(cfg_path, "w") as f:
        json.dump(cfg, f)
    with pytest.raises(AdapterError, match="DoRA"):
        load_peft_adapter(dora)


def test_adapter_errors_name_the_adapter_as_registered(tmp_path):
    """An AdapterError names the adapter by the name it is registered under (not its directory's
    name, nor the name a PeftAdapter was built with), and its directory; nothing is registered."""
    mgr = AdapterManager(_model(rank=4))
    big = _write(tmp_path, "dir-big", 8)[0]
    with pytest.raises(AdapterError, match=rf"adapter 'math' \({re.escape(big)}\), module '.*q_proj': rank 8 exceeds"):
        mgr.register(1, big, name="math")
    built = load_peft_adapter(big)
    with pytest.raises(AdapterError, match=rf"adapter 'chat' \({re.escape(big)}\), module '.*q_proj': rank 8 exceeds"):
        mgr.register(1, built, name="chat")
    missing = str(tmp_path / "none")
    with pytest.raises(AdapterError, match=rf"adapter 'code': {re.escape(missing)}: expected a PEFT adapter directory"):
        mgr.register(1, missing, name="code")
    assert built.name == "dir-big" and mgr.registered == {}


def _slot_weights(model, slot):
    layer = model.model.layers[0].self_attn.qkv_proj
    return np.asarray(layer.lora_a.get_value()[:, slot]), np.asarray(layer.lora_b.get_value()[slot])


def test_manager_slots_lru_and_host_cache(tmp_path):
    model = _model(slots=2)
    mgr = AdapterManager(model, host_cache_size=2)
    paths = [_write(tmp_path, f"a{i}", 2 + i, seed=i)[0] for i in range(3)]
    for i, p in enumerate(paths):
        mgr.register(i + 1, p)
    assert mgr.lora_index_to_id == [None, None]
    assert mgr.activate([1, 2, 0, None]) == [1, 2]
    mgr.activate([1])                                   # 1 is now the most recently used
    assert mgr.activate([3]) == [1, 3]                  # evicts 2, the least recently used
    assert list(mgr.slot_ranks) == [2, 4]
    assert mgr.stats["evictions"] == 1
    a, _ = _slot_weights(model, 1)
    assert a[0, :4].any() and not a[0, 4:].any()        # adapter 3 (rank 4) padded to max_rank 8
    # Host LRU of 2 entries: 1 was evicted when 3 was registered; bringing 1 back reads the disk.
    loads = mgr.stats["disk_loads"]
    mgr.activate([2])                                   # 2 in host cache: no disk read
    assert mgr.stats["disk_loads"] == loads and mgr.stats["host_hits"] >= 1
    mgr.activate([1])
    assert mgr.stats["disk_loads"] == loads + 1
    with pytest.raises(ValueError, match="3 distinct adapters"):
        mgr.activate([1, 2, 3])
    with pytest.raises(ValueError, match="not registered"):
        mgr.activate([9])
    for bad in (0, 2**63, np.uint64(2**63)):             # 2**63: past the wrappers' int64 slot tables
        with pytest.raises(ValueError, match=r"lora_id must be an int in 1\.\.2\*\*63 - 1"):
            mgr.register(bad, paths[0])
    mgr.register(2**63 - 1, paths[0])
    assert 2**63 - 1 in mgr.activate([2**63 - 1])


def test_a_failed_load_in_activate_changes_nothing(tmp_path):
    """An adapter whose file goes bad after registration fails inside activate(); the manager is
    left exactly as before the call: the same adapters in the same slots with the same weights, the
    same LRU order (the next eviction takes the least recently used adapter), the same counters."""
    model = _model(slots=2)
    mgr = AdapterManager(model, host_cache_size=1)          # one cached adapter: reloads read the disk
    paths = [_write(tmp_path, f"a{i}", 2 + i, seed=i)[0] for i in range(4)]
    for i, p in enumerate(paths[:3]):
        mgr.register(i + 1, p)
    assert mgr.activate([1, 2]) == [1, 2]                   # 1 is the least recently used
    files = [os.path.join(p, "adapter_model.safetensors") for p in paths]
    good = []
    for name in files:
        with open(name, "rb") as f:
            good.append(f.read())

    def state():
        return (mgr.lora_index_to_id, list(mgr.slot_ranks), dict(mgr.stats), mgr.version,
                [w for slot in range(2) for w in _slot_weights(model, slot)])

    def same(before, after):
        assert before[:4] == after[:4]
        for b, a in zip(before[4], after[4]):
            np.testing.assert_array_equal(b, a)

    with open(files[2], "wb") as f:
        f.write(good[2][:-9])                               # truncated after registration
    before = state()
    with pytest.raises(AdapterError, match=r"adapter 'a2' \(LoRA id 3\): the files in .* changed since it was "
                                           "registered"):
        mgr.activate([3])
    same(before, state())
    with open(files[2], "wb") as f:
        f.write(good[2])
    mgr.register(3, paths[2])                               # changed files are served once registered again
    assert mgr.activate([2, 3]) == [3, 2]                   # evicts 1, the least recently used
    # Several adapters at once: one that loads and one that fails; neither is placed, none evicted.
    mgr.register(4, paths[3])
    with open(files[0], "wb") as f:
        f.write(b"garbage")
    before = state()
    with pytest.raises(AdapterError, match="changed since it was registered"):
        mgr.activate([4, 1])
    same(before, state())
    with open(files[0], "wb") as f:
        f.write(good[0])
    mgr.register(1, paths[0])
    assert mgr.activate([4, 1]) == [1, 4]                   # 4 evicts 2, then 1 evicts 3
    assert mgr.stats["evictions"] == 3


def test_manager_writes_each_layers_rank_and_the_wrapper_uses_it(tmp_path):
    """Per-layer ranks (PEFT rank_pattern): the slot's `lora_ranks` entry is the adapter's largest
    rank among the layer's modules, 0 where it has none and after unload; the layers pass it to
    the wrapper, which reads only those rank columns (a rank set too low changes the result, the
    real one gives the padded result)."""
    from jax_lora import LoRAMapping, PunicaWrapper
    model = _model(slots=2, rank=8)
    mgr = AdapterManager(model)
    p, _ = _write(tmp_path, "pat", 4, targets=("q_proj", "v_proj", "down_proj"),
                  rank_pattern={"down_proj": 2, "v_proj": 6})
    slot = mgr.load(1, p)
    assert adapter_ranks(model, load_peft_adapter(p))["model.layers.0.self_attn.qkv_proj"] == 6
    layers = lnn.lora_layers(model)
    ranks = {path: int(layer.lora_ranks.get_value()[slot]) for path, layer in layers.items()}
    assert ranks["model.layers.0.self_attn.qkv_proj"] == 6              # max(q 4, v 6)
    assert ranks["model.layers.0.mlp.down_proj"] == 2
    assert ranks["model.layers.0.self_attn.o_proj"] == 0                # not targeted
    assert all(int(layer.lora_ranks.get_value()[1 - slot]) == 8 for layer in layers.values())  # default
    qkv = layers["model.layers.0.self_attn.qkv_proj"]
    x = jnp.asarray(np.random.default_rng(3).normal(size=(5, H)), jnp.float32)
    w = PunicaWrapper(8, 8, None, max_loras=2)
    w.update_metadata(LoRAMapping((1, 0, 1, 1, 0), (1,)), mgr.lora_index_to_id, 2, V)
    real = np.asarray(qkv(x, punica=w))
    full = qkv.lora_ranks.get_value()
    qkv.lora_ranks.set_value(full.at[slot].set(8))
    np.testing.assert_allclose(np.asarray(qkv(x, punica=w)), real, rtol=1e-6, atol=1e-6)  # padding is zero
    qkv.lora_ranks.set_value(full.at[slot].set(1))
    assert not np.allclose(np.asarray(qkv(x, punica=w)), real, atol=1e-3)        # rank 1: columns dropped
    qkv.lora_ranks.set_value(full)
    mgr.unload(1)
    assert all(int(layer.lora_ranks.get_value()[slot]) == 0 for layer in layers.values())


def test_unload_zeroes_and_hot_swap_rewrites_in_place(tmp_path):
    model = _model(slots=2)
    mgr = AdapterManager(model)
    p1, _ = _write(tmp_path, "one", 4, seed=1)
    p2, mods2 = _write(tmp_path, "two", 4, seed=2)
    assert mgr.load(1, p1) == 0
    v = mgr.version
    mgr.register(1, p2)                                 # hot swap: same id, same slot, new weights
    assert mgr.slot_of(1) == 0 and mgr.version > v and mgr.stats["hot_swaps"] == 1
    a, _ = _slot_weights(model, 0)
    np.testing.assert_allclose(a[0, :4], mods2["model.layers.0.self_attn.q_proj"][0], rtol=1e-6)
    mgr.unload(1)
    a, b = _slot_weights(model, 0)
    assert not a.any() and not b.any() and mgr.lora_index_to_id == [None, None]
    # A bad adapter is refused at registration and changes nothing.
    with pytest.raises(AdapterError):
        mgr.register(1, str(tmp_path))
    assert mgr.load(1) == 0


def test_merge_adapter_matches_the_lora_layers(tmp_path):
    """merge_adapter (the oracle) and the multi-LoRA model agree on one adapter."""
    from jax_lora import LoRAMapping, PunicaWrapper
    path, _ = _write(tmp_path, "m", 4, targets=("q_proj", "k_proj", "o_proj", "up_proj", "embed_tokens", "lm_head"))
    base = LlamaForCausalLM(CFG, rngs=nnx.Rngs(0))
    merged = merge_adapter(base, load_peft_adapter(path))
    model = _model()
    mgr = AdapterManager(model)
    mgr.load(5, path)
    tokens = jnp.array([[1, 4, 9, 16, 25, 2]], jnp.int32)
    pos = jnp.arange(6)[None]
    w = PunicaWrapper(16, 16, None, max_loras=3)
    w.update_metadata(LoRAMapping([5] * 6, [5] * 6), mgr.lora_index_to_id, 4, V)
    with lnn.punica_context(w):
        got = model(tokens, pos)[0]
    want = merged(tokens, pos)[0]
    assert np.abs(np.asarray(got) - np.asarray(want)).max() < 1e-4 * np.abs(np.asarray(want)).max()
    assert np.abs(np.asarray(want) - np.asarray(base(tokens, pos)[0])).max() > 1e-2   # it did change


def test_llama_checkpoint_round_trip_sharding_and_errors(tmp_path):
    from safetensors.numpy import load_file, save_file

    from jax_lora.models import load_llama, save_llama
    model = LlamaForCausalLM(CFG, rngs=nnx.Rngs(1))
    save_llama(model, str(tmp_path / "one"))
    tokens, pos = jnp.array([[3, 1, 4, 1, 5]]), jnp.arange(5)[None]
    want = np.asarray(model(tokens, pos)[0])
    np.testing.assert_array_equal(np.asarray(load_llama(str(tmp_path / "one"))(tokens, pos)[0]), want)
    # A sharded checkpoint (model.safetensors.index.json), as large Hugging Face models are saved.
    weights = load_file(str(tmp_path / "one" / "model.safetensors"))
    names = sorted(weights)
    shard = tmp_path / "sharded"
    shard.mkdir()
    (shard / "config.json").write_text((tmp_path / "one" / "config.json").read_text())
    halves = {"model-00001-of-00002.safetensors": names[: len(names) // 2],
              "model-00002-of-00002.safetensors": names[len(names) // 2:]}
    for fn, keys in halves.items():
        save_file({k: weights[k] for k in keys}, str(shard / fn))
    index = {"weight_map": {k: fn for fn, keys in halves.items() for k in keys}}
    (shard / "model.safetensors.index.json").write_text(json.dumps(index))
    np.testing.assert_array_equal(np.asarray(load_llama(str(shard))(tokens, pos)[0]), want)
    # Errors name the tensor and the shapes.
    bad = dict(weights)
    bad["model.norm.weight"] = np.ones(H + 1, np.float32)
    save_file(bad, str(tmp_path / "one" / "model.safetensors"))
    with pytest.raises(ValueError, match=r"'model.norm.weight' has shape \(17,\), expected \(16,\)"):
        load_llama(str(tmp_path / "one"))
    del bad["model.norm.weight"]
    save_file(bad, str(tmp_path / "one" / "model.safetensors"))
    with pytest.raises(ValueError, match="lacks tensor 'model.norm.weight'"):
        load_llama(str(tmp_path / "one"))
    os.remove(tmp_path / "one" / "model.safetensors")
    (tmp_path / "one" / "pytorch_model.bin").write_bytes(b"pickle")
    with pytest.raises(FileNotFoundError, match="pickled"):
        load_llama(str(tmp_path / "one"))


@pytest.fixture(scope="module")
def llama_dirs(tmp_path_factory):
    """A tiny random Llama checkpoint and three PEFT adapters (tests/llama_checkpoint.py): directory per key."""
    return llama_checkpoint.write_assets(tmp_path_factory.mktemp("llama_checkpoint"))


def test_adapter_names_are_reexported_from_jax_lora_adapters():
    """docs/flax.md: jax_lora.adapters re-exports lora_core.peft's
    load_peft_adapter, save_peft_adapter, PeftAdapter and AdapterError (the same objects), and
    jax_lora.LoRAMapping is lora_core's one LoRAMapping class."""
    from jax_lora import adapters
    for name in ("load_peft_adapter", "save_peft_adapter", "PeftAdapter", "AdapterError"):
        assert getattr(adapters, name) is getattr(core_peft, name)
    import lora_core
    assert jax_lora.LoRAMapping is lora_core.LoRAMapping
    for mod in ("ops", "nn", "adapters", "models", "serving", "parallel"):
        assert hasattr(jax_lora, mod)


def test_adapter_manager_failed_reload_changes_nothing(llama_dirs, tmp_path):
    """With the host cache too small, an adapter whose files changed since
    registration fails to reload inside activate() with an AdapterError (naming the adapter as
    registered and its directory) and leaves slots, weights and the LRU order as they were: the
    next activation evicts the least recently used adapter, as if the failure never happened."""
    import shutil
    model = load_llama(llama_dirs["model"])
    add_lora(model, max_loras=2, max_rank=8)
    mgr = AdapterManager(model, host_cache_size=1)
    d3 = str(tmp_path / "a3")
    shutil.copytree(llama_dirs["a3"], d3)
    mgr.register(1, llama_dirs["a1"])
    mgr.register(2, llama_dirs["a2"])
    mgr.register(3, d3, name="my-third")
    mgr.activate([1])
    mgr.activate([2])                                 # LRU order: 1 then 2
    before = [np.asarray(v) for v in jax.tree.leaves(nnx.state(model, lnn.LoRAWeight))]
    slots = list(mgr.lora_index_to_id)
    with open(os.path.join(d3, "adapter_model.safetensors"), "ab") as f:
        f.write(b"garbage")
    with pytest.raises(AdapterError) as e:
        mgr.activate([3])
    assert "my-third" in str(e.value) and d3 in str(e.value)
    assert mgr.lora_index_to_id == slots
    after = [np.asarray(v) for v in jax.tree.leaves(nnx.state(model, lnn.LoRAWeight))]
    assert all(np.array_equal(a, b) for a, b in zip(before, after))
    mgr.register(3, llama_dirs["a3"], name="my-third")   # register again: the new files
    mgr.activate([3])
    assert mgr.slot_of(1) is None and mgr.slot_of(2) is not None and mgr.slot_of(3) is not None
    mgr.activate([2, 3])
    with pytest.raises(ValueError):
        mgr.activate([1, 2, 3])                       # more adapters than slots
    mgr.unload(3)
    assert mgr.slot_of(3) is None and mgr.slot_ranks[mgr.lora_index_to_id.index(None)] == 0


def test_adapter_rank_above_max_rank_names_module(llama_dirs, tmp_path):
    """Shapes are validated against the model with clear errors: an adapter whose
    rank exceeds the model's max_rank raises AdapterError naming the module and the ranks."""
    model = load_llama(llama_dirs["model"])
    add_lora(model, max_loras=2, max_rank=2)
    mgr = AdapterManager(model)
    with pytest.raises(AdapterError) as e:
        mgr.register(1, llama_dirs["a1"])
    assert "q_proj" in str(e.value) and "4" in str(e.value)
    assert mgr.registered == {}
