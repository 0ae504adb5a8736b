"""fp8 (e4m3) adapter storage on the JAX side: MultiLoRALinear(lora_dtype="fp8"), AdapterManager(...,
lora_dtype="fp8") quantising 16-bit PEFT adapters on load, and the ServingEngine on the tiny random
Llama (tests/llama_checkpoint.py) on the CPU.

The reference is the float model with each adapter merged after the same quantisation, its weights
dequantised (float32(w_q) * scale, B with its scaling folded in first, as the manager quantises it):
the served completions match it in greedy tokens and within 1e-4 relative logits (cli.verify), while
the 16-bit adapters' merged model differs (the quantisation is applied). The LM head's adapters
and the embedding's adapters are fp8 too (the embedding's table with one scale per token row).
Slot writes keep the variables' shapes and dtypes: one compiled step.
"""

from __future__ import annotations

import dataclasses
import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jax_lora import nn as lnn
from jax_lora.adapters import AdapterManager, load_peft_adapter, prepare_adapter
from jax_lora.cli import verify
from jax_lora.models import add_lora, load_llama
from jax_lora.quant import dequantize_rows, quantize_rows
from jax_lora.serving import Request, ServingEngine

from . import llama_checkpoint

MAX_LEN = 32


@pytest.fixture(scope="module")
def llama_dirs(tmp_path_factory):
    return llama_checkpoint.write_assets(tmp_path_factory.mktemp("fp8_llama"))


def dequantised_adapter(adapter):
    """The adapter with every module (the decoder's linears, the LM head, the embedding) replaced by
    its fp8 round trip: A per rank row (an embedding's table A.T (V, r) per token row), B * scaling
    per output row (scaling then 1), each float32(w_q) * scale."""
    modules = {}
    for name, m in adapter.modules.items():
        if m.kind not in ("linear", "embedding"):
            modules[name] = m
            continue
        if m.kind == "embedding":
            a = np.asarray(dequantize_rows(*quantize_rows(np.asarray(m.lora_a, np.float32).T))).T
        else:
            a = np.asarray(dequantize_rows(*quantize_rows(np.asarray(m.lora_a, np.float32))))
        b = np.asarray(dequantize_rows(*quantize_rows((m.lora_b * m.scaling).astype(np.float32))))
        modules[name] = m._replace(lora_a=a, lora_b=b, scaling=1.0)
    return dataclasses.replace(adapter, modules=modules)


def test_fp8_layer_storage_and_manager_quantise_on_load(llama_dirs, caplog):
    """add_lora(lora_dtype="fp8") gives the decoder linears e4m3 weights with (S, L, r) / (L, out)
    float32 scales (ones while empty), the LM head e4m3 weights with (L, r) / (L, V) scales and the
    embedding an e4m3 table with (L, V) / (L, D) scales (nothing kept 16-bit, nothing said);
    activating an adapter writes exactly quantize_rows of its placed (scaling-folded) weights; an
    unknown lora_dtype is a ValueError naming it."""
    model = load_llama(llama_dirs["model"])
    layers = add_lora(model, max_loras=2, max_rank=8, lora_dtype="fp8")
    linears = {p: layer for p, layer in layers.items() if type(layer) is lnn.MultiLoRALinear}
    assert linears and all(layer.lora_a.get_value().dtype == jnp.float8_e4m3fn for layer in linears.values())
    qkv = next(layer for p, layer in linears.items() if p.endswith("qkv_proj"))
    assert qkv.lora_a_scale.get_value().shape == (3, 2, 8)
    assert qkv.lora_b_scale.get_value().shape == (2, qkv.out_features)
    assert np.all(np.asarray(qkv.lora_b_scale.get_value()) == 1.0)
    (head_path, head), = ((p, layer) for p, layer in layers.items() if type(layer) is lnn.MultiLoRALogits)
    assert head.lora_a.get_value().dtype == head.lora_b.get_value().dtype == jnp.float8_e4m3fn
    assert head.lora_a_scale.get_value().shape == (2, 8)
    assert head.lora_b_scale.get_value().shape == (2, head.out_features)
    (embed_path, embed), = ((p, layer) for p, layer in layers.items() if type(layer) is lnn.MultiLoRAEmbed)
    assert embed.lora_a.get_value().dtype == embed.lora_b.get_value().dtype == jnp.float8_e4m3fn
    assert embed.lora_a_scale.get_value().shape == (2, embed.num_embeddings)
    assert embed.lora_b_scale.get_value().shape == (2, embed.features)
    with caplog.at_level(logging.INFO, logger="jax_lora"):
        mgr = AdapterManager(model, lora_dtype="fp8")
    assert not [r for r in caplog.records if "16-bit storage" in r.getMessage()]
    mgr.register(2, llama_dirs["a2"])                       # a2 targets embed_tokens and lm_head too
    slot = list(mgr.activate([2])).index(2)
    placed = prepare_adapter(model, load_peft_adapter(llama_dirs["a2"]))
    assert np.any(placed[embed_path][0])
    for path, layer in {**linears, head_path: head, embed_path: embed}.items():
        qa, sa = quantize_rows(placed[path][0])
        qb, sb = quantize_rows(placed[path][1])
        a_slot = (slice(None), slot) if layer in linears.values() else slot     # the linears' A: (S, L, ...)
        np.testing.assert_array_equal(np.asarray(layer.lora_a_scale.get_value())[a_slot], sa)
        np.testing.assert_array_equal(np.asarray(layer.lora_b_scale.get_value())[slot], sb)
        np.testing.assert_array_equal(np.asarray(layer.lora_a.get_value())[a_slot].view(np.uint8), qa.view(np.uint8))
        np.testing.assert_array_equal(np.asarray(layer.lora_b.get_value())[slot].view(np.uint8), qb.view(np.uint8))
    with pytest.raises(ValueError, match="lora_dtype"):
        AdapterManager(model, lora_dtype="int4")


def test_fp8_slot_writes_keep_one_compiled_program(llama_dirs):
    """A jitted forward over the model's state is compiled once across loading, swapping and
    evicting fp8 adapters (the weights and their scales keep shape and dtype)."""
    model = load_llama(llama_dirs["model"])
    add_lora(model, max_loras=1, max_rank=8)
    mgr = AdapterManager(model, lora_dtype="fp8")          # converts the float layers in place
    for i in (1, 2, 3):
        mgr.register(i, llama_dirs[f"a{i}"])
    graphdef, _ = nnx.split(model)

    @jax.jit
    def forward(state, tokens):
        m = nnx.merge(graphdef, state)
        return m(tokens, jnp.arange(tokens.shape[1], dtype=jnp.int32)[None])[0]

    tokens = np.array([[1, 5, 9, 2]], np.int32)
    outs = []
    for lid in (1, 2, 3):
        mgr.activate([lid])
        outs.append(np.asarray(forward(nnx.state(model), tokens)))
    assert forward._cache_size() == 1
    assert np.all(np.isfinite(outs))


def test_serving_engine_with_fp8_adapters_equals_dequantised_merged_model(llama_dirs):
    """ServingEngine.generate with three fp8 adapters and base rows mixed gives, per completion, the
    greedy tokens and logits (1e-4 relative) of the float model with the dequantised adapter merged;
    the 16-bit adapters' merged model gives other logits (the fp8 round trip is real)."""
    model = load_llama(llama_dirs["model"])
    add_lora(model, max_loras=2, max_rank=8, lora_dtype="fp8")
    mgr = AdapterManager(model, host_cache_size=2, lora_dtype="fp8")
    dirs = {1: llama_dirs["a1"], 2: llama_dirs["a2"], 3: llama_dirs["a3"]}
    for i, d in dirs.items():
        mgr.register(i, d)
    engine = ServingEngine(model, mgr, max_seqs=4, max_len=MAX_LEN, keep_logits=True)
    rng = np.random.default_rng(5)
    reqs = [Request([int(t) for t in rng.integers(0, 64, size=int(rng.integers(2, 9)))], lora_id=lid,
                    max_new_tokens=4, request_id=i) for i, lid in enumerate([1, None, 2, 3, 2, None])]
    out = engine.generate(reqs)
    ref = load_llama(llama_dirs["model"])
    adapters = {i: load_peft_adapter(d) for i, d in dirs.items()}
    matches, worst, _ = verify(ref, {i: dequantised_adapter(a) for i, a in adapters.items()}, out,
                               max_len=MAX_LEN, rtol=1e-4)
    assert all(matches), worst
    _, worst16, _ = verify(ref, adapters, [c for c in out if c.lora_id == 2], max_len=MAX_LEN, rtol=1e-4)
    assert worst16 > 1e-4, worst16


def test_fp8_peft_file_keeps_its_values_in_jax_fp8_slots(llama_dirs, tmp_path):
    """An fp8 PEFT file (per-channel scales from the largest magnitude, the contract's rule; its
    scaling alpha / r = 2) loads into the JAX manager's fp8 slots as it is: the slots hold the file's
    e4m3 bits, A's scales equal the file's and B's the file's times the scaling (folded into B)."""
    torch = pytest.importorskip("torch")
    safetensors_torch = pytest.importorskip("safetensors.torch")

    from .test_fp8_storage import _quantize_file
    _quantize_file(llama_dirs["a1"], str(tmp_path / "a1_fp8"), per_tensor_b=False)
    model = load_llama(llama_dirs["model"])
    layers = add_lora(model, max_loras=2, max_rank=8, lora_dtype="fp8")
    mgr = AdapterManager(model, lora_dtype="fp8")
    mgr.register(1, str(tmp_path / "a1_fp8"))
    slot = list(mgr.activate([1])).index(1)
    raw = {k: (v.view(torch.uint8) if v.dtype == torch.float8_e4m3fn else v).numpy()
           for k, v in safetensors_torch.load_file(str(tmp_path / "a1_fp8" / "adapter_model.safetensors")).items()}
    qkv = next(layer for p, layer in layers.items() if p.endswith("layers.0.self_attn.qkv_proj"))
    prefix = "base_model.model.model.layers.0.self_attn.q_proj."
    a_q, b_q = raw[prefix + "lora_A.weight"], raw[prefix + "lora_B.weight"]
    rank, out_q = a_q.shape[0], b_q.shape[0]
    np.testing.assert_array_equal(np.asarray(qkv.lora_a.get_value())[0, slot, :rank].view(np.uint8),
                                  a_q)
    np.testing.assert_array_equal(np.asarray(qkv.lora_a_scale.get_value())[0, slot, :rank],
                                  raw[prefix + "lora_A.weight_scale"])
    np.testing.assert_array_equal(np.asarray(qkv.lora_b.get_value())[slot, :out_q, :rank].view(np.uint8),
                                  b_q)
    np.testing.assert_array_equal(np.asarray(qkv.lora_b_scale.get_value())[slot, :out_q],
                                  raw[prefix + "lora_B.weight_scale"] * np.float32(2.0))
