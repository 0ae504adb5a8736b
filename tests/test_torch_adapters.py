"""torch_lora.adapters: PEFT directories read by lora_core, placement into the multi-LoRA layers
(torch_lora.layers), and the slot manager (LRU under churn, host cache, hot swap, bad adapters
leaving everything intact). Layers are computed through a PunicaWrapper and compared with a float64
NumPy oracle built from the adapter files' own factors.

Also lora_core's reader used by torch, every bad adapter file refused by AdapterError, and unload.
CPU; one gpu-marked test (a slot write waits for the step in flight on CUDA streams).
"""

from __future__ import annotations

import json
import math
import os
import pathlib
import random
import re
import shutil

import numpy as np
import pytest
import torch

import torch_lora
from lora_core import peft as core
from torch_lora import AdapterError, AdapterManager, LoRAMapping, PunicaWrapper
from torch_lora.adapters import (
    adapter_tensors,
    load_peft_adapter,
    prepare_adapter,
    save_peft_adapter,
)
from torch_lora.layers import LoRAEmbedding, LoRALinear, LoRALogits

from . import torch_helpers

H, V, Q, KV, I = 16, 32, 16, 8, 24
MODULE = {"q_proj": "model.layers.0.self_attn.q_proj", "k_proj": "model.layers.0.self_attn.k_proj",
          "v_proj": "model.layers.0.self_attn.v_proj", "o_proj": "model.layers.0.self_attn.o_proj",
          "gate_proj": "model.layers.0.mlp.gate_proj", "embed_tokens": "model.embed_tokens", "lm_head": "lm_head"}
DIMS = {"q_proj": (H, Q), "k_proj": (H, KV), "v_proj": (H, KV), "o_proj": (Q, H), "gate_proj": (H, I)}


def _layers(slots=3, rank=8, dtype=torch.float32):
    """The layers of a one-block model: fused q/k/v (unequal widths), o, the embedding and the head."""
    kw = dict(max_loras=slots, max_rank=rank, dtype=dtype, device="cpu")
    return {"qkv": LoRALinear((MODULE["q_proj"], MODULE["k_proj"], MODULE["v_proj"]), H, (Q, KV, KV), **kw),
            "o": LoRALinear((MODULE["o_proj"],), Q, (H,), **kw),
            "embed": LoRAEmbedding(MODULE["embed_tokens"], V, H, **kw),
            "head": LoRALogits(MODULE["lm_head"], H, V, **kw)}


def _write(tmp_path, name, r, targets=("q_proj", "v_proj"), alpha=None, rslora=False, seed=0, rank_pattern=None):
    """A PEFT adapter directory (lora_core's writer, PEFT's format) with random non-zero factors."""
    rng = np.random.default_rng(seed)
    mods = {}
    for t in targets:
        rr = (rank_pattern or {}).get(t, r)
        if t == "embed_tokens":
            mods[MODULE[t]] = (rng.normal(size=(rr, V)), rng.normal(size=(H, rr)))
        elif t == "lm_head":
            mods[MODULE[t]] = (rng.normal(size=(rr, H)), rng.normal(size=(V, rr)))
        else:
            mods[MODULE[t]] = (rng.normal(size=(rr, DIMS[t][0])), rng.normal(size=(DIMS[t][1], rr)))
    path = str(tmp_path / name)
    save_peft_adapter(path, mods, r=r, lora_alpha=alpha or 2 * r, use_rslora=rslora, rank_pattern=rank_pattern)
    return path


def _oracle(adapter, module, x=None, ids=None):
    """float64 LoRA term of `module` for inputs x (T, in) or token ids (T,); zeros when absent."""
    m = adapter.modules.get(module) if adapter is not None else None
    width = {MODULE["q_proj"]: Q, MODULE["k_proj"]: KV, MODULE["v_proj"]: KV, MODULE["o_proj"]: H,
             MODULE["embed_tokens"]: H, MODULE["lm_head"]: V}[module]
    n = len(ids) if ids is not None else x.shape[0]
    if m is None:
        return np.zeros((n, width))
    a, b = m.lora_a.astype(np.float64), m.lora_b.astype(np.float64)
    if ids is not None:
        return m.scaling * a.T[ids] @ b.T
    return m.scaling * x @ a.T @ b.T


def _run(layers, manager, rows, sources, tokens_per_row=3, seed=0):
    """Every layer's LoRA terms for a batch whose row j uses LoRA id rows[j] (0: none), against the
    oracle built from `sources` ({lora id: adapter directory}); returns the largest relative error."""
    rng = np.random.default_rng(seed)
    ids = np.repeat(np.asarray(rows), tokens_per_row)
    t = len(ids)
    w = PunicaWrapper(64, 64, "cpu", max_loras=manager.num_slots)
    w.update_metadata(LoRAMapping(ids, ids, is_prefill=True), manager.lora_index_to_id, manager.num_slots + 1, V)
    for layer in layers.values():
        layer.punica = w
    x = rng.normal(size=(t, H))
    xo = rng.normal(size=(t, Q))
    tok = rng.integers(0, V, size=t)
    adapters = {i: load_peft_adapter(sources[i]) for i in set(rows) if i}
    worst = 0.0

    def check(got, module, inputs=None, token_ids=None):
        nonlocal worst
        want = np.stack([_oracle(adapters.get(i), module, x=None if inputs is None else inputs[k:k + 1],
                                 ids=None if token_ids is None else token_ids[k:k + 1])[0]
                         for k, i in enumerate(ids)])
        err = np.abs(got.numpy().astype(np.float64) - want).max() / max(1.0, np.abs(want).max())
        worst = max(worst, err)

    xt = torch.tensor(x, dtype=torch.float32)
    with torch.no_grad():
        outs = [torch.zeros(t, n) for n in (Q, KV, KV)]
        for s in range(3):
            layers["qkv"].apply(s, xt, outs[s])
        for s, name in enumerate(("q_proj", "k_proj", "v_proj")):
            check(outs[s], MODULE[name], inputs=x)
        out = torch.zeros(t, H)
        check(layers["o"].apply(0, torch.tensor(xo, dtype=torch.float32), out), MODULE["o_proj"], inputs=xo)
        out = torch.zeros(t, H)
        check(layers["embed"].apply(torch.tensor(tok), out), MODULE["embed_tokens"], token_ids=tok)
        out = torch.zeros(t, V)
        check(layers["head"].apply(xt, out), MODULE["lm_head"], inputs=x)
    return worst


# ----------------------------------------------------------------------------- reading

def test_reading_is_the_framework_free_parser():
    """torch_lora reads adapters with lora_core.peft's reader itself (as jax_lora.adapters does, see
    test_adapters.py): one implementation, the same checks and messages on both sides."""
    for name in ("AdapterError", "PeftAdapter", "load_peft_adapter", "save_peft_adapter"):
        assert getattr(torch_lora.adapters, name) is getattr(core, name), name
    assert torch_lora.load_peft_adapter is core.load_peft_adapter


def test_adapter_tensors_are_torch_and_keep_scaling(tmp_path):
    a = load_peft_adapter(_write(tmp_path, "a", 4, targets=("q_proj", "embed_tokens"), alpha=6, rslora=True),
                          name="mine")
    assert a.name == "mine"
    t = adapter_tensors(a, dtype=torch.float64)
    q = t[MODULE["q_proj"]]
    assert q.lora_a.dtype == torch.float64 and tuple(q.lora_a.shape) == (4, H) and tuple(q.lora_b.shape) == (Q, 4)
    assert q.scaling == pytest.approx(6 / math.sqrt(4)) and q.kind == "linear"
    np.testing.assert_array_equal(q.lora_a.numpy(), a.modules[MODULE["q_proj"]].lora_a)
    assert t[MODULE["embed_tokens"]].kind == "embedding"
    with pytest.raises(TypeError, match="adapter must be a PeftAdapter"):
        adapter_tensors({"not": "an adapter"})


def test_pickle_only_adapter_is_refused_with_the_fix(tmp_path):
    d = tmp_path / "bin"
    d.mkdir()
    (d / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 2, "lora_alpha": 4,
                                                        "target_modules": ["q_proj"]}))
    (d / "adapter_model.bin").write_bytes(b"\x80\x04not really a pickle")
    with pytest.raises(AdapterError, match=r"adapter_model\.bin: a pickle.*safe_serialization=True"):
        torch_lora.load_peft_adapter(str(d))


# ----------------------------------------------------------------------------- placement

def test_prepare_places_slices_pads_ranks_and_folds_scaling(tmp_path):
    layers = _layers(rank=8)
    a = load_peft_adapter(_write(tmp_path, "a", 4, targets=("q_proj", "v_proj", "lm_head"), alpha=8,
                                 rank_pattern={"v_proj": 2}))
    p = prepare_adapter(layers, a)
    qa, ka, _va, qb, kb, vb = p.tensors["qkv"]
    assert tuple(qa.shape) == (8, H) and tuple(qb.shape) == (Q, 8) and tuple(vb.shape) == (KV, 8)
    m = a.modules[MODULE["q_proj"]]
    np.testing.assert_allclose(qa[:4].numpy(), m.lora_a)
    np.testing.assert_allclose(qb[:, :4].numpy(), m.lora_b * 2.0, rtol=1e-6)           # alpha 8 / r 4
    assert not qa[4:].any() and not qb[:, 4:].any() and not ka.any() and not kb.any()  # padding, k absent
    np.testing.assert_allclose(vb[:, :2].numpy(), a.modules[MODULE["v_proj"]].lora_b * 4.0, rtol=1e-6)  # r 2
    assert p.ranks == {"qkv": 4, "o": 0, "embed": 0, "head": 4} and p.max_rank == 4
    assert "o" not in p.tensors and "embed" not in p.tensors
    assert not qa.is_pinned()                                          # pinned only for CUDA layers


def test_placement_errors_name_module_and_shapes(tmp_path):
    layers = _layers(rank=4)
    big = load_peft_adapter(_write(tmp_path, "big", 8))
    with pytest.raises(AdapterError, match=r"rank 8 exceeds the model's max_rank=4"):
        prepare_adapter(layers, big)
    other = load_peft_adapter(_write(tmp_path, "mlp", 2, targets=("gate_proj",)))
    with pytest.raises(AdapterError, match=r"targets 'model\.layers\.0\.mlp\.gate_proj', which is not a LoRA module"):
        prepare_adapter(layers, other)
    ok = load_peft_adapter(_write(tmp_path, "ok", 2))
    ok.modules[MODULE["q_proj"]] = core.LoraModule(np.ones((2, H + 1), np.float32), np.ones((Q, 2), np.float32),
                                                   1.0, "linear")
    with pytest.raises(AdapterError, match=r"lora_A \(2, 17\) / lora_B \(16, 2\) do not fit the module: expected "
                                           r"lora_A \(2, 16\) and lora_B \(16, 2\)"):
        prepare_adapter(layers, ok)
    with pytest.raises(TypeError, match="layers must be a non-empty mapping"):
        prepare_adapter({}, ok)


# ----------------------------------------------------------------------------- the manager

def test_mixed_batch_through_the_layers_matches_the_oracle(tmp_path):
    layers = _layers(slots=3, rank=8)
    mgr = AdapterManager(layers)
    src = {1: _write(tmp_path, "a", 4, targets=("q_proj", "k_proj", "v_proj", "o_proj"), seed=1),
           2: _write(tmp_path, "b", 8, targets=("v_proj", "embed_tokens", "lm_head"), rslora=True, seed=2,
                     rank_pattern={"lm_head": 3}),
           3: _write(tmp_path, "c", 2, targets=("q_proj", "lm_head"), seed=3)}
    for i, path in src.items():
        mgr.register(i, path)
    mgr.activate([1, 2, 3])
    assert _run(layers, mgr, [1, 0, 2, 3, 2, 0, 1], src) < 1e-5
    # Each layer holds each slot's real rank there (the kernels skip the padding).
    s1, s2, s3 = (mgr.slot_of(i) for i in (1, 2, 3))
    assert layers["qkv"].lora_ranks.tolist() == [4 if s == s1 else 8 if s == s2 else 2 for s in range(3)]
    assert layers["head"].lora_ranks[s2] == 3 and layers["head"].lora_ranks[s1] == 0
    assert layers["o"].lora_ranks[s3] == 0


def test_lru_eviction_under_churn(tmp_path):
    """Six adapters of different ranks through three slots: random batches, every step checked
    against the oracle (stale columns of a larger evicted rank would show) and against LRU order."""
    layers = _layers(slots=3, rank=8)
    mgr = AdapterManager(layers, host_cache_size=2)
    targets = [("q_proj", "v_proj"), ("q_proj", "k_proj", "o_proj"), ("embed_tokens", "lm_head"),
               ("v_proj",), ("q_proj", "k_proj", "v_proj", "o_proj", "embed_tokens", "lm_head"), ("o_proj",)]
    src = {i: _write(tmp_path, f"a{i}", r, targets=t, seed=10 + i)
           for i, (r, t) in enumerate(zip((8, 2, 4, 6, 1, 3), targets), start=1)}
    for i, path in src.items():
        mgr.register(i, path)
    rng = random.Random(0)
    order: list = []                                   # least recently used first
    slots: list = [None, None, None]
    for step in range(30):
        need = rng.sample(range(1, 7), rng.randint(1, 3))
        for i in need:                                 # the expected placement
            if i not in slots:
                if None in slots:
                    slots[slots.index(None)] = i
                else:
                    victim = next(v for v in order if v not in need)
                    order.remove(victim)
                    slots[slots.index(victim)] = i
            if i in order:
                order.remove(i)
            order.append(i)
        assert mgr.activate(need) == slots, step
        rows = [rng.choice(need + [0]) for _ in range(5)]
        assert _run(layers, mgr, rows, src, seed=step) < 1e-5, (step, need, rows)
    st = mgr.stats
    assert st["evictions"] > 5 and st["slot_hits"] > 5 and st["host_hits"] > 0 and st["disk_loads"] > 6
    assert st["slot_loads"] == st["evictions"] + 3


def test_unload_zeroes_and_hot_swap_rewrites_in_place(tmp_path):
    layers = _layers(slots=2, rank=8)
    mgr = AdapterManager(layers)
    mgr.load(1, _write(tmp_path, "a", 8, targets=("q_proj", "lm_head"), seed=1))
    slot = mgr.slot_of(1)
    ptrs = [t.data_ptr() for layer in layers.values() for t in layer.buffers()]
    new = _write(tmp_path, "a2", 2, targets=("k_proj",), seed=2)
    mgr.register(1, new)                                                             # hot swap
    assert mgr.slot_of(1) == slot and mgr.stats["hot_swaps"] == 1
    assert [t.data_ptr() for layer in layers.values() for t in layer.buffers()] == ptrs
    assert _run(layers, mgr, [1, 0, 1], {1: new}) < 1e-5
    assert layers["head"].lora_ranks[slot] == 0 and layers["qkv"].lora_ranks[slot] == 2
    mgr.unload(1)
    assert mgr.lora_index_to_id == [None, None]
    assert not any(layer.lora_ranks.any() or layer.lora_a.any() for layer in layers.values())
    assert 1 in mgr.registered
    mgr.unregister(1)
    assert mgr.registered == {}
    with pytest.raises(ValueError, match=r"LoRA ids \[1\] are not registered"):
        mgr.activate([1])


def _bad_adapters(tmp_path):
    """Name -> (directory, a regex the error must match): every way an adapter file can be bad."""
    out = {}
    d = tmp_path / "no-config"
    d.mkdir()
    good = _write(tmp_path, "good-src", 2)
    (d / "adapter_model.safetensors").write_bytes(pathlib.Path(good, "adapter_model.safetensors").read_bytes())
    out["missing config"] = (str(d), r"adapter_config\.json is missing")
    d = _write(tmp_path, "bad-json", 2)
    with open(os.path.join(d, "adapter_config.json"), "w") as f:
        f.write('{"r": 2, "lora_alpha": 4,')
    out["malformed JSON"] = (d, r"adapter_config\.json: expected a JSON object, got malformed JSON")
    d = tmp_path / "pickle"
    d.mkdir()
    (d / "adapter_config.json").write_text(pathlib.Path(good, "adapter_config.json").read_text())
    (d / "adapter_model.bin").write_bytes(b"\x80\x04")
    out["pickle only"] = (str(d), r"adapter_model\.bin: a pickle")
    rng = np.random.default_rng(0)
    d = str(tmp_path / "wrong-shape")
    save_peft_adapter(d, {MODULE["q_proj"]: (rng.normal(size=(2, H + 3)), rng.normal(size=(Q, 2)))}, r=2,
                      lora_alpha=4)
    out["wrong shapes"] = (d, r"lora_A \(2, 19\) / lora_B \(16, 2\) do not fit the module")
    out["rank above max_rank"] = (_write(tmp_path, "rank16", 16), r"rank 16 exceeds the model's max_rank=8")
    out["unknown target"] = (_write(tmp_path, "mlp", 2, targets=("gate_proj",)),
                             r"'model\.layers\.0\.mlp\.gate_proj', which is not a LoRA module")
    d = _write(tmp_path, "truncated", 2)
    f = pathlib.Path(d, "adapter_model.safetensors")
    f.write_bytes(f.read_bytes()[:-7])
    out["truncated safetensors"] = (d, r"adapter_model\.safetensors: .*(truncated|end past)")
    return out


def test_bad_adapters_fail_clearly_and_change_nothing(tmp_path):
    layers = _layers(slots=3, rank=8)
    mgr = AdapterManager(layers)
    src = {1: _write(tmp_path, "a", 4, targets=("q_proj", "embed_tokens"), seed=1),
           2: _write(tmp_path, "b", 8, targets=("v_proj", "o_proj", "lm_head"), seed=2)}
    for i, path in src.items():
        mgr.register(i, path)
    mgr.activate([1, 2])
    before = {k: v.clone() for k, v in ((f"{p}.{n}", t) for p, l in layers.items() for n, t in l.named_buffers())}
    state = (mgr.lora_index_to_id, mgr.registered, dict(mgr.stats), list(mgr._host))
    for what, (path, pattern) in _bad_adapters(tmp_path).items():
        for lora_id in (3, 1):                      # a new adapter, and a hot swap of a loaded one
            with pytest.raises(AdapterError, match=pattern):
                mgr.register(lora_id, path)
            assert (mgr.lora_index_to_id, mgr.registered, dict(mgr.stats), list(mgr._host)) == state, what
            for k, v in ((f"{p}.{n}", t) for p, l in layers.items() for n, t in l.named_buffers()):
                assert torch.equal(v, before[k]), (what, k)
    assert _run(layers, mgr, [1, 2, 0], src) < 1e-5


def test_a_failed_reload_in_activate_changes_nothing(tmp_path):
    """An adapter evicted from the host cache and broken on disk since: activate raises before any
    slot is written, so the batch's other adapters and the LRU order are untouched."""
    layers = _layers(slots=2, rank=8)
    mgr = AdapterManager(layers, host_cache_size=1)
    paths = {i: _write(tmp_path, f"a{i}", 2 * i, seed=i) for i in (1, 2, 3)}
    for i, p in paths.items():
        mgr.register(i, p)
    mgr.activate([1])
    mgr.activate([2])                                  # host cache now holds only 3 -> 2
    with open(os.path.join(paths[3], "adapter_config.json"), "w") as f:
        f.write("{")
    mgr.register(2, paths[2])                          # refreshes the cache: 3 is no longer cached
    state = (mgr.lora_index_to_id, dict(mgr.stats), list(mgr._slot_use))
    with pytest.raises(AdapterError, match="changed since it was registered"):
        mgr.activate([1, 3])
    assert (mgr.lora_index_to_id, dict(mgr.stats), list(mgr._slot_use)) == state
    assert _run(layers, mgr, [1, 2], paths) < 1e-5


def test_manager_argument_errors(tmp_path):
    layers = _layers(slots=2)
    mgr = AdapterManager(layers)
    with pytest.raises(ValueError, match=r"lora_id must be an int in 1\.\.2\*\*63 - 1"):
        mgr.register(0, _write(tmp_path, "a", 2))
    with pytest.raises(TypeError, match="adapter must be a PEFT adapter directory .* got dict"):
        mgr.register(1, {"q": 1})
    mgr.register(1, _write(tmp_path, "a", 2))
    mgr.register(2, _write(tmp_path, "b", 2, seed=2))
    mgr.register(3, _write(tmp_path, "c", 2, seed=3))
    with pytest.raises(ValueError, match="3 distinct adapters requested at once, but there are 2 slots"):
        mgr.activate([1, 2, 3])
    with pytest.raises(ValueError, match="host_cache_size must be an int >= 1, got 0"):
        AdapterManager(layers, host_cache_size=0)
    mixed = dict(layers, extra=LoRALinear(("x",), H, (H,), max_loras=4, max_rank=2, dtype=torch.float32,
                                          device="cpu"))
    with pytest.raises(ValueError, match=r"disagree on max_loras: \[2, 4\]"):
        AdapterManager(mixed)
    with pytest.raises(TypeError, match=r"layers\['x'\] must be a LoRALinear"):
        AdapterManager({"x": torch.nn.Linear(2, 2)})


def test_bf16_layers_hold_the_adapter_in_their_dtype(tmp_path):
    layers = _layers(slots=2, rank=4, dtype=torch.bfloat16)
    mgr = AdapterManager(layers)
    mgr.load(1, _write(tmp_path, "a", 4, seed=5))
    a = load_peft_adapter(_write(tmp_path, "a", 4, seed=5))
    got = layers["qkv"].lora_a[0, mgr.slot_of(1), :4].float().numpy()
    np.testing.assert_allclose(got, a.modules[MODULE["q_proj"]].lora_a, rtol=1e-2, atol=1e-2)
    assert layers["qkv"].lora_b_0.dtype == torch.bfloat16


def test_factors_beyond_the_layers_dtype_are_refused(tmp_path):
    """The scaling folded into lora_B can exceed float16's range (65504) where the adapter's own
    float32 factors are finite: refused at load, naming the adapter, the layer and the dtype,
    instead of serving infinities; the same adapter fits float32 layers."""
    rng = np.random.default_rng(6)
    d = str(tmp_path / "big")
    save_peft_adapter(d, {MODULE["v_proj"]: (rng.normal(size=(1, H)), np.full((KV, 1), 20.0))}, r=1,
                      lora_alpha=4096)                                 # B x scaling = 20 x 4096 = 81920
    mgr = AdapterManager(_layers(slots=2, rank=4, dtype=torch.float16))
    with pytest.raises(AdapterError,
                       match=rf"adapter 'big' \({re.escape(d)}\): the factors placed in 'qkv' reach 81920 "
                             r".*beyond the largest float16 value 65504"):
        mgr.load(1, d)
    assert mgr.registered == {}
    AdapterManager(_layers(slots=2, rank=4)).load(1, d)


def test_adapter_errors_name_the_adapter_as_registered(tmp_path):
    """An AdapterError names the adapter by the name it is registered under (not its directory's
    name, nor the name a PeftAdapter was built with), and its directory; nothing is registered."""
    mgr = AdapterManager(_layers(slots=2, rank=4))
    big = _write(tmp_path, "dir-big", 8)
    with pytest.raises(AdapterError, match=rf"adapter 'math' \({re.escape(big)}\), module '.*q_proj': rank 8 exceeds"):
        mgr.register(1, big, name="math")
    built = load_peft_adapter(big)
    with pytest.raises(AdapterError, match=rf"adapter 'chat' \({re.escape(big)}\), module '.*q_proj': rank 8 exceeds"):
        mgr.register(1, built, name="chat")
    missing = str(tmp_path / "none")
    with pytest.raises(AdapterError, match=rf"adapter 'code': {re.escape(missing)}: expected a PEFT adapter directory"):
        mgr.register(1, missing, name="code")
    assert built.name == "dir-big" and mgr.registered == {}


# ----------------------------------------------------------------------------- CUDA: stream order

@pytest.mark.gpu
def test_cuda_uploads_wait_for_the_step_in_flight_and_the_next_step_waits_for_them(tmp_path):
    """A step still running on the compute stream (a long sleep, then a read of the slot) must read
    the old weights although the hot swap was enqueued meanwhile; a step enqueued after
    wait_uploads() reads the new ones. The host cache is pinned; no slot tensor is reallocated."""
    kw = dict(max_loras=2, max_rank=8, dtype=torch.float32, device="cuda")
    layers = {"qkv": LoRALinear((MODULE["q_proj"], MODULE["k_proj"], MODULE["v_proj"]), H, (Q, KV, KV), **kw)}
    mgr = AdapterManager(layers)
    old, new = _write(tmp_path, "old", 8, seed=1), _write(tmp_path, "new", 8, seed=2)
    mgr.load(1, old)
    mgr.wait_uploads()
    assert all(t.is_pinned() for t in mgr._host[1].tensors["qkv"])
    slot = mgr.slot_of(1)
    ptr = layers["qkv"].lora_a.data_ptr()
    torch.cuda.synchronize()
    torch.cuda._sleep(200_000_000)                     # the step in flight (~0.1 s of GPU time)
    during = layers["qkv"].lora_a[0, slot].clone()     # ... which reads the slot at its end
    mgr.register(1, new)                               # hot swap, enqueued while the step runs
    mgr.wait_uploads()
    after = layers["qkv"].lora_a[0, slot].clone()      # the next step
    torch.cuda.synchronize()
    a_old = load_peft_adapter(old).modules[MODULE["q_proj"]].lora_a
    a_new = load_peft_adapter(new).modules[MODULE["q_proj"]].lora_a
    np.testing.assert_array_equal(during.cpu().numpy(), a_old)
    np.testing.assert_array_equal(after.cpu().numpy(), a_new)
    assert layers["qkv"].lora_a.data_ptr() == ptr


def test_a_reload_from_changed_files_is_refused(tmp_path):
    """An adapter evicted from the host cache is read again from its directory when it comes back:
    if the files changed since registration, that raises (naming the adapter and the directory)
    instead of serving other weights under the same id, and changes nothing; registering again
    takes the new files."""
    layers = _layers(slots=1, rank=8)
    mgr = AdapterManager(layers, host_cache_size=1)
    a = _write(tmp_path, "a", 4, seed=1)
    mgr.register(1, a)
    mgr.register(2, _write(tmp_path, "b", 4, seed=2))          # host cache of 1: adapter 1 leaves it
    mgr.activate([2])
    shutil.rmtree(a)
    _write(tmp_path, "a", 8, seed=3)                           # other weights in the same directory
    before = [t.clone() for t in layers["qkv"].buffers()]
    with pytest.raises(AdapterError, match=r"adapter 'a' \(LoRA id 1\): the files in .* changed since it was "
                                           r"registered; register it again"):
        mgr.activate([1])
    assert mgr.lora_index_to_id == [2]
    assert all(torch.equal(x, y) for x, y in zip(layers["qkv"].buffers(), before))
    mgr.register(1, a)
    mgr.activate([1])
    assert _run(layers, mgr, [1, 0], {1: a}) < 1e-5


Q_MODULE = "model.layers.0.self_attn.q_proj"


def _write_adapter(path, modules, *, r, lora_alpha, **config_extra):
    """A PEFT directory written by hand: {module: (A (r, in), B (out, r))} in PEFT's tensor names."""
    from safetensors.numpy import save_file
    os.makedirs(path, exist_ok=True)
    tensors = {}
    for m, (a, b) in modules.items():
        tensors[f"base_model.model.{m}.lora_A.weight"] = np.ascontiguousarray(a, np.float32)
        tensors[f"base_model.model.{m}.lora_B.weight"] = np.ascontiguousarray(b, np.float32)
    save_file(tensors, os.path.join(path, "adapter_model.safetensors"))
    cfg = {"peft_type": "LORA", "r": r, "lora_alpha": lora_alpha,
           "target_modules": sorted({m.rsplit(".", 1)[-1] for m in modules}), **config_extra}
    cfg = {k: v for k, v in cfg.items() if v is not _DROP}
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump(cfg, f)
    return str(path)


_DROP = object()


def _q_adapter(path, rank, seed, *, hidden=8, out=6, alpha=None, **extra):
    rng = torch_helpers.rng(seed)
    return _write_adapter(path, {Q_MODULE: (rng.standard_normal((rank, hidden)), rng.standard_normal((out, rank)))},
                          r=rank, lora_alpha=alpha if alpha is not None else 2 * rank, **extra)


def _q_layers(max_loras=2, max_rank=4, hidden=8, out=6):
    from torch_lora.layers import LoRALinear
    return {"q": LoRALinear((Q_MODULE,), hidden, (out,), max_loras=max_loras, max_rank=max_rank, dtype=torch.float32,
                            device="cpu")}


def test_load_peft_adapter_is_the_shared_reader_and_reads_scaling(tmp_path):
    """torch_lora.load_peft_adapter is lora_core's reader (one implementation with
    JAX); rsLoRA scaling alpha/sqrt(r); a missing lora_alpha means PEFT's default 8;
    adapter_tensors gives the factors as torch tensors."""
    import lora_core.peft
    assert torch_lora.load_peft_adapter is lora_core.peft.load_peft_adapter
    ad = torch_lora.load_peft_adapter(_q_adapter(tmp_path / "rs", 4, 0, alpha=8, use_rslora=True))
    assert math.isclose(ad.modules[Q_MODULE].scaling, 8 / math.sqrt(4))
    ad = torch_lora.load_peft_adapter(_q_adapter(tmp_path / "noalpha", 4, 0, alpha=_DROP))
    assert math.isclose(ad.modules[Q_MODULE].scaling, 8 / 4)
    tensors = torch_lora.adapter_tensors(ad)
    assert isinstance(tensors[Q_MODULE].lora_a, torch.Tensor) and tuple(tensors[Q_MODULE].lora_a.shape) == (4, 8)
    assert tuple(tensors[Q_MODULE].lora_b.shape) == (6, 4)


@pytest.mark.parametrize("case", ["missing_config", "malformed_json", "list_config", "missing_r", "r_zero",
                                  "pickle_only", "truncated", "garbage", "empty", "huge_header", "alora",
                                  "symlink_outside", "untargeted_tensor"])
def test_bad_adapter_files_raise_adapter_error_naming_file_and_field(tmp_path, case):
    """Unclear adapter files (fields outside the PEFT allowlist, files outside the directory, tensors of
    modules the config does not target, bad adapter files): each is an AdapterError (a
    ValueError) naming the file and, for config problems, the field; `adapter_model.bin` is never
    unpickled."""
    d = _q_adapter(tmp_path / "ad", 4, 1)
    cfg_path = os.path.join(d, "adapter_config.json")
    st_path = os.path.join(d, "adapter_model.safetensors")
    cfg = json.loads(pathlib.Path(cfg_path).read_text())
    expect = [os.path.basename(cfg_path)]
    if case == "missing_config":
        os.remove(cfg_path)
    elif case == "malformed_json":
        pathlib.Path(cfg_path).write_text("{\"r\": 4,,}")
    elif case == "list_config":
        pathlib.Path(cfg_path).write_text(json.dumps([cfg]))
    elif case in ("missing_r", "r_zero", "alora"):
        if case == "missing_r":
            del cfg["r"]
        elif case == "r_zero":
            cfg["r"] = 0
        else:
            cfg["alora_invocation_tokens"] = []
        pathlib.Path(cfg_path).write_text(json.dumps(cfg))
        expect.append({"missing_r": "r", "r_zero": "r", "alora": "alora_invocation_tokens"}[case])
    elif case == "pickle_only":
        os.remove(st_path)
        pathlib.Path(d, "adapter_model.bin").write_bytes(b"\x80\x04K\x01.")   # would unpickle to 1
        expect = ["adapter_model.bin"]
    elif case in ("truncated", "garbage", "empty", "huge_header"):
        data = pathlib.Path(st_path).read_bytes()
        new = {"truncated": data[: len(data) - 40], "garbage": os.urandom(200), "empty": b"",
               "huge_header": (2**40).to_bytes(8, "little") + b"{}"}[case]
        pathlib.Path(st_path).write_bytes(new)
        expect = ["adapter_model.safetensors"]
    elif case == "untargeted_tensor":          # a k_proj tensor while the config targets q_proj only
        from safetensors.numpy import save_file
        rng = torch_helpers.rng(2)
        save_file({f"base_model.model.{Q_MODULE}.lora_A.weight": rng.standard_normal((4, 8)).astype(np.float32),
                   f"base_model.model.{Q_MODULE}.lora_B.weight": rng.standard_normal((6, 4)).astype(np.float32),
                   "base_model.model.model.layers.0.self_attn.k_proj.lora_A.weight":
                       rng.standard_normal((4, 8)).astype(np.float32),
                   "base_model.model.model.layers.0.self_attn.k_proj.lora_B.weight":
                       rng.standard_normal((6, 4)).astype(np.float32)}, st_path)
        expect = ["adapter_model.safetensors", "k_proj"]
    elif case == "symlink_outside":
        outside = tmp_path / "elsewhere.safetensors"
        os.replace(st_path, outside)
        os.symlink(outside, st_path)
        expect = ["adapter_model.safetensors"]
    with pytest.raises(torch_lora.AdapterError) as info:
        torch_lora.load_peft_adapter(d)
    assert isinstance(info.value, ValueError)
    for word in expect:
        assert word in str(info.value), (word, str(info.value))


def test_adapter_manager_places_pads_scales_and_evicts_lru(tmp_path):
    """Fixed slots (zero-padded to max_rank, scaling folded into B, per-slot real
    rank in lora_ranks), LRU eviction of the least recently used slot the batch does not need."""
    layers = _q_layers()
    mgr = torch_lora.AdapterManager(layers)
    dirs = {i: _q_adapter(tmp_path / f"a{i}", r, i) for i, r in ((1, 2), (2, 4), (3, 3))}
    for i, d in dirs.items():
        mgr.register(i, d)
    mgr.activate([1])
    mgr.activate([2])
    assert mgr.lora_index_to_id == [1, 2]
    s1 = mgr.slot_of(1)
    ad = torch_lora.load_peft_adapter(dirs[1])
    a, b, scaling, _ = ad.modules[Q_MODULE]
    layer = layers["q"]
    np.testing.assert_allclose(layer.lora_a[0, s1, :2].numpy(), a, rtol=1e-6)
    assert torch.equal(layer.lora_a[0, s1, 2:], torch.zeros(2, 8))
    np.testing.assert_allclose(layer.lora_b[0][s1, :, :2].numpy(), b * scaling, rtol=1e-6)
    assert layer.lora_ranks.tolist()[s1] == 2 and layer.lora_ranks.tolist()[mgr.slot_of(2)] == 4
    mgr.activate([1])                   # 1 used more recently than 2
    mgr.activate([3])                   # evicts 2
    assert mgr.slot_of(2) is None and mgr.slot_of(1) == s1 and mgr.slot_of(3) is not None
    assert mgr.stats["evictions"] == 1
    assert layer.lora_ranks.tolist()[mgr.slot_of(3)] == 3
    with pytest.raises(ValueError):
        mgr.activate([1, 2, 3])         # more adapters than slots


def test_adapter_manager_hot_swap_same_slot_and_bad_adapter_changes_nothing(tmp_path):
    """Registering an id again hot-swaps it (same slot, new weights); a bad adapter
    (rank above max_rank) raises AdapterError and leaves every slot and weight intact."""
    layers = _q_layers()
    mgr = torch_lora.AdapterManager(layers)
    mgr.register(1, _q_adapter(tmp_path / "a", 2, 1))
    mgr.activate([1])
    slot = mgr.slot_of(1)
    new = _q_adapter(tmp_path / "b", 3, 7)
    mgr.register(1, new)
    assert mgr.slot_of(1) == slot
    a_new = torch_lora.load_peft_adapter(new).modules[Q_MODULE].lora_a
    np.testing.assert_allclose(layers["q"].lora_a[0, slot, :3].numpy(), a_new, rtol=1e-6)
    assert layers["q"].lora_ranks.tolist()[slot] == 3
    before = [t.clone() for t in (layers["q"].lora_a, layers["q"].lora_b[0], layers["q"].lora_ranks)]
    with pytest.raises(torch_lora.AdapterError, match="max_rank"):
        mgr.register(1, _q_adapter(tmp_path / "big", 6, 3))
    with pytest.raises(torch_lora.AdapterError):
        mgr.register(2, _q_adapter(tmp_path / "wide", 2, 3, hidden=9))
    after = (layers["q"].lora_a, layers["q"].lora_b[0], layers["q"].lora_ranks)
    assert all(torch.equal(x, y) for x, y in zip(before, after))
    assert mgr.lora_index_to_id[slot] == 1 and 2 not in mgr.registered


def test_failed_reload_inside_activate_leaves_lru_intact(tmp_path):
    """A reload failing inside activate() changes nothing (the would-be victim stays
    in its slot and on the LRU list); afterwards the right adapter is evicted and a 2-slot batch of
    2 adapters still activates. the AdapterError names the adapter as registered and its
    directory."""
    layers = _q_layers()
    mgr = torch_lora.AdapterManager(layers, host_cache_size=1)
    d3 = _q_adapter(tmp_path / "three", 2, 3)
    mgr.register(1, _q_adapter(tmp_path / "one", 2, 1))
    mgr.register(2, _q_adapter(tmp_path / "two", 2, 2))
    mgr.register(3, d3, name="my-third")
    mgr.activate([1])
    mgr.activate([2])               # host cache (size 1) now holds 2 only: 3 reloads from disk
    cfg = json.loads(pathlib.Path(d3, "adapter_config.json").read_text())
    cfg["r"] = 99
    pathlib.Path(d3, "adapter_config.json").write_text(json.dumps(cfg))
    state = (mgr.lora_index_to_id, layers["q"].lora_a.clone())
    with pytest.raises(torch_lora.AdapterError) as info:
        mgr.activate([3])
    assert "my-third" in str(info.value) and str(tmp_path / "three") in str(info.value)
    assert mgr.lora_index_to_id == state[0] and torch.equal(layers["q"].lora_a, state[1])
    mgr.register(3, _q_adapter(tmp_path / "three-b", 2, 3), name="my-third")
    mgr.activate([2, 3])            # 1 is the least recently used and not needed: evicted
    assert mgr.slot_of(1) is None and mgr.slot_of(2) is not None and mgr.slot_of(3) is not None


def test_unload_zeroes_the_slot_and_rank(tmp_path):
    """docs/torch.md (the adapter manager): unload zeroes the slot, rank 0; the adapter stays registered."""
    layers = _q_layers()
    mgr = torch_lora.AdapterManager(layers)
    mgr.register(1, _q_adapter(tmp_path / "a", 4, 1))
    slot = mgr.load(1)
    assert layers["q"].lora_a[0, slot].abs().sum() > 0
    mgr.unload(1)
    assert mgr.lora_index_to_id[slot] is None
    assert torch.equal(layers["q"].lora_a[0, slot], torch.zeros(4, 8))
    assert torch.equal(layers["q"].lora_b[0][slot], torch.zeros(6, 4))
    assert layers["q"].lora_ranks.tolist()[slot] == 0
    assert 1 in mgr.registered
