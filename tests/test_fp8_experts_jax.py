"""fp8 (e4m3) expert LoRA slots on the JAX side (contract section 11): `MultiLoRAExperts(...,
lora_dtype="fp8")`, `AdapterManager(model, lora_dtype="fp8")` and the Flax Mixtral's
`add_lora(..., lora_dtype="fp8")`.

A tiny random transformers Mixtral (tests/hf_mixtral.py) loaded into the Flax Mixtral, PEFT adapters
on its fused experts (and attention). With fp8 slots the four expert stacks are e4m3 with float32
scales per expert and output channel (ones while empty), holding exactly `quantize_rows` of the
16-bit model's slots; one MoE block under a wrapper equals the float64 oracle of the whole block on
the dequantised slots (backends xla, pallas_tpu in interpret mode, triton in Triton's interpreter);
the served model's logits equal the float32 model holding the dequantised slots within float32's
tolerance and stay within FP8_OF_EFFECT (tests/test_fp8_storage.py) of the 16-bit model relative to
the adapter's effect.
"""

from __future__ import annotations

import os

import jax.numpy as jnp
import numpy as np
import pytest

from jax_lora import nn as lnn
from jax_lora.adapters import AdapterManager
from jax_lora.models import load_mixtral
from jax_lora.models.mixtral import add_lora
from jax_lora.quant import dequantize_rows, quantize_rows

from . import hf_mixtral, oracle

torch = pytest.importorskip("torch")
peft = pytest.importorskip("peft")

# tests/test_fp8_storage.py's bound (not imported: that module needs transformers' torch side only)
FP8_OF_EFFECT = 0.15
ADAPTERS = {   # name: (seed, LoraConfig keywords)
    "experts": (5, dict(r=4, lora_alpha=8, target_modules=[], target_parameters=hf_mixtral.EXPERT_PARAMS)),
    "mixed": (6, dict(r=8, lora_alpha=8, use_rslora=True, target_modules=["q_proj", "v_proj"],
                      target_parameters=hf_mixtral.EXPERT_PARAMS)),
}
TARGETS = ["q_proj", "k_proj", "v_proj", "experts"]
INTERPRETED = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                 reason="Triton on the CPU needs the interpreter (CUDA: the gpu test of the op)")


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    root = tmp_path_factory.mktemp("fp8_mixtral")
    hf_mixtral.tiny_mixtral().save_pretrained(str(root / "model"))
    dirs = {name: hf_mixtral.save_expert_adapter(hf_mixtral.tiny_mixtral, root / name, seed, **kw)
            for name, (seed, kw) in ADAPTERS.items()}
    return str(root / "model"), dirs


def _served(assets, lora_dtype=None):
    """(model, manager) of the Flax Mixtral with both adapters registered and in slots (ids 1, 2)."""
    model_dir, dirs = assets
    model = load_mixtral(model_dir)
    add_lora(model, max_loras=2, max_rank=8, target_modules=TARGETS, lora_dtype=lora_dtype)
    manager = AdapterManager(model, lora_dtype=lora_dtype)
    for lora_id, name in enumerate(ADAPTERS, start=1):
        manager.register(lora_id, dirs[name])
    manager.activate([1, 2])
    return model, manager


def _experts(model) -> dict:
    return {p: layer for p, layer in lnn.lora_layers(model).items() if isinstance(layer, lnn.MultiLoRAExperts)}


def test_fp8_expert_slots_hold_quantize_rows_of_the_16_bit_slots(assets):
    model_dir, _ = assets
    empty = load_mixtral(model_dir)
    add_lora(empty, max_loras=2, max_rank=8, target_modules=["experts"], lora_dtype="fp8")
    for layer in _experts(empty).values():
        assert layer.lora_dtype == "fp8"
        assert np.all(np.asarray(layer.w13_lora_b_scale.get_value()) == 1.0)       # ones while empty
    late = load_mixtral(model_dir)                  # 16-bit layers, made fp8 by the manager
    add_lora(late, max_loras=2, max_rank=8, target_modules=["experts"])
    AdapterManager(late, lora_dtype="fp8")
    assert all(layer.lora_dtype == "fp8" and layer.w2_lora_b.get_value().dtype == jnp.float8_e4m3fn
               for layer in _experts(late).values())
    fp8, manager = _served(assets, "fp8")
    full, full_manager = _served(assets)
    assert manager.lora_index_to_id == full_manager.lora_index_to_id
    layers, twins = _experts(fp8), _experts(full)
    assert len(layers) == 2
    e, i, h = 4, 24, 32
    shapes = {"w13_lora_a": (2, 2, e, 8), "w13_lora_b": (2, 2, e, i), "w2_lora_a": (2, e, 8), "w2_lora_b": (2, e, h)}
    for path, layer in layers.items():
        for name in lnn.MultiLoRAExperts.STACKS:
            stack, scale = getattr(layer, name).get_value(), getattr(layer, f"{name}_scale").get_value()
            assert stack.dtype == jnp.float8_e4m3fn and scale.dtype == jnp.float32 and scale.shape == shapes[name]
            want_q, want_scale = quantize_rows(np.asarray(getattr(twins[path], name).get_value()))
            np.testing.assert_array_equal(np.asarray(scale), want_scale)
            np.testing.assert_array_equal(np.asarray(stack).view(np.uint8), want_q.view(np.uint8))
            # the contract rule in float64 (tests/oracle.py) gives the same scales
            np.testing.assert_array_equal(oracle.fp8_quantize(np.asarray(getattr(twins[path], name).get_value()))[1],
                                          want_scale)
        np.testing.assert_array_equal(np.asarray(layer.adapter_enabled.get_value()),
                                      np.asarray(twins[path].adapter_enabled.get_value()))


@pytest.mark.parametrize("backend", ["xla", "pallas_tpu", pytest.param("triton", marks=INTERPRETED)])
def test_fp8_moe_block_equals_the_float64_block_on_the_dequantised_slots(assets, backend):
    """One MoE block of the fp8 model under a wrapper (tokens of both adapters and none) against the
    oracle's whole block on the dequantised expert slots (routing from the same router)."""
    from jax_lora import moe
    from jax_lora.wrapper import PunicaWrapper
    from lora_core.host_mapping import LoRAMapping
    model, manager = _served(assets, "fp8")
    block = model.model.layers[0].mlp
    x = np.random.default_rng(0).standard_normal((6, 32)).astype(np.float32)
    ids_per_token = [1, 0, 2, 1, 0, 2]
    w = PunicaWrapper(8, 4, max_loras=2, backend=backend)
    w.update_metadata(LoRAMapping(tuple(ids_per_token), tuple(ids_per_token), False), manager.lora_index_to_id, 3,
                      64)
    with lnn.punica_context(w):
        got = np.asarray(block(jnp.asarray(x)[None]))[0]
    weights, ids = moe.route_top_k(block.gate(jnp.asarray(x)), 2)
    experts = block.experts
    deq = {name: np.asarray(dequantize_rows(getattr(experts, name).get_value(),
                                            getattr(experts, f"{name}_scale").get_value()))
           for name in lnn.MultiLoRAExperts.STACKS}
    token_lora = np.array([manager.lora_index_to_id.index(i) if i else -1 for i in ids_per_token])
    gu_b = np.concatenate([deq["w13_lora_b"][0], deq["w13_lora_b"][1]], axis=2)          # (L, E, 2I, r)
    np.testing.assert_array_equal(deq["w13_lora_a"][0], deq["w13_lora_a"][1])          # PEFT's one A
    gate_up = np.asarray(experts.base.gate_up_proj.get_value()).transpose(0, 2, 1)
    down = np.asarray(experts.base.down_proj.get_value()).transpose(0, 2, 1)
    want = oracle.moe_block_lora(x, gate_up, down, np.asarray(ids), np.asarray(weights), token_lora,
                                 deq["w13_lora_a"][0], gu_b, deq["w2_lora_a"], deq["w2_lora_b"], [1.0, 1.0])
    assert oracle.rel_err(got, want) <= oracle.TOL["float32"]
    base = np.asarray(experts.base(jnp.asarray(x), ids, weights))
    assert oracle.rel_err(base, want) > 1e-3, "the adapters changed nothing"


def _dequantise_into(model, twin) -> None:
    """Every fp8 variable of `model`'s LoRA layers, dequantised, into the same variable of `twin`'s."""
    twins = lnn.lora_layers(twin)
    for path, layer in lnn.lora_layers(model).items():
        for name in ("lora_a", "lora_b") + lnn.MultiLoRAExperts.STACKS:
            if hasattr(layer, f"{name}_scale"):
                value = dequantize_rows(getattr(layer, name).get_value(), getattr(layer, f"{name}_scale").get_value())
                getattr(twins[path], name).set_value(value.astype(getattr(twins[path], name).get_value().dtype))


def test_fp8_mixtral_logits_match_the_16_bit_model(assets):
    """Prefill logits of three requests (expert adapter, attention + expert adapter, none) served in
    one batch: the fp8 model equals the float32 model holding its dequantised slots (float32's
    tolerance) and stays within FP8_OF_EFFECT of the 16-bit model relative to each adapter's effect."""
    from jax_lora.serving import Request, ServingEngine
    fp8, fp8_manager = _served(assets, "fp8")
    full, full_manager = _served(assets)
    deq, deq_manager = _served(assets)
    _dequantise_into(fp8, deq)
    prompts = [[3, 7, 11, 5, 9], [9, 2, 40, 17], [1, 2, 3, 4]]
    lora_ids = [1, 2, None]
    logits = {}
    for key, model, manager in (("fp8", fp8, fp8_manager), ("full", full, full_manager), ("deq", deq, deq_manager)):
        engine = ServingEngine(model, manager, max_seqs=6, max_len=32, keep_logits=True)
        requests = [Request(p, lora_id=i, max_new_tokens=1) for p, i in zip(prompts, lora_ids)]
        if key == "full":                                   # the base model's logits, in the same batch
            requests += [Request(p, max_new_tokens=1) for p in prompts]
        logits[key] = [np.asarray(c.logits, np.float64) for c in engine.generate(requests)]
    base = logits["full"][len(prompts):]
    for j, lora_id in enumerate(lora_ids):
        assert oracle.rel_err(logits["fp8"][j], logits["deq"][j]) <= 1e-5, j
        if lora_id is None:
            np.testing.assert_allclose(logits["fp8"][j], logits["full"][j], rtol=1e-5, atol=1e-5)
            continue
        effect = np.abs(logits["full"][j] - base[j]).max()
        assert effect > 1e-3, "the adapter changed nothing"
        err = np.abs(logits["fp8"][j] - logits["full"][j]).max()
        assert err <= FP8_OF_EFFECT * effect, (lora_id, err, effect)
        assert err > 1e-7, "the expert slots hold the 16-bit values"
