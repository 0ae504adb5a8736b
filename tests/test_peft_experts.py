"""Expert LoRA read from PEFT files (lora_core.peft.experts): target_parameters on fused 3-D expert
weights equal PEFT's own delta weights (rank / alpha patterns, rsLoRA, attention LoRA beside them);
per-expert linear layers gathered into the fused weights; save / load round trip; untrusted
headers refused before any data is read."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from lora_core.peft import AdapterError, ModuleShape, load_peft_adapter, save_peft_adapter
from lora_core.peft.experts import group_expert_linears, join_expert_factors, split_expert_factors

H, I, E = 16, 6, 4
GU = "model.layers.0.mlp.experts.gate_up_proj"
DN = "model.layers.0.mlp.experts.down_proj"
Q = "model.layers.0.self_attn.q_proj"
SHAPES = {Q: ModuleShape("linear", H, H, 8), GU: ModuleShape("experts", H, 2 * I, 8, E),
          DN: ModuleShape("experts", I, H, 8, E)}


def _tiny_mixtral():
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.MixtralConfig(vocab_size=32, hidden_size=H, intermediate_size=I, num_hidden_layers=1,
                                     num_attention_heads=2, num_key_value_heads=1, num_local_experts=E,
                                     num_experts_per_tok=2)
    return transformers.MixtralForCausalLM(cfg)


@pytest.mark.parametrize("rslora", [False, True])
def test_target_parameters_equal_peft_delta_weights(tmp_path, rslora):
    peft = pytest.importorskip("peft")
    model = _tiny_mixtral()
    config = peft.LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj"], use_rslora=rslora,
                             target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"],
                             rank_pattern={"down_proj": 3}, alpha_pattern={"gate_up_proj": 5},
                             init_lora_weights=False)
    peft_model = peft.get_peft_model(model, config)
    peft_model.save_pretrained(tmp_path)
    adapter = load_peft_adapter(tmp_path, module_shapes=SHAPES)
    assert sorted(adapter.modules) == sorted([GU, DN, Q])
    assert adapter.modules[GU].lora_a.shape == (E, 2, H) and adapter.modules[GU].lora_b.shape == (E, 2 * I, 2)
    assert adapter.modules[DN].lora_a.shape == (E, 3, I) and adapter.modules[DN].lora_b.shape == (E, H, 3)
    assert sorted(adapter.expert_modules) == [DN, GU]
    wrappers = [m for m in peft_model.modules() if type(m).__name__ == "ParamWrapper"]
    assert len(wrappers) == 2
    for wrapper in wrappers:
        module = adapter.modules[f"model.layers.0.mlp.experts.{wrapper.parameter_name}"]
        assert module.scaling == pytest.approx(wrapper.scaling["default"])
        want = wrapper.get_delta_weight("default").detach().double().numpy()
        got = np.einsum("eor,eri->eoi", module.lora_b.astype(np.float64), module.lora_a.astype(np.float64))
        np.testing.assert_allclose(got * module.scaling, want, rtol=1e-6, atol=1e-7)


def test_only_down_proj_and_only_experts(tmp_path):
    peft = pytest.importorskip("peft")
    model = _tiny_mixtral()
    config = peft.LoraConfig(r=2, lora_alpha=2, target_modules=[], target_parameters=["mlp.experts.down_proj"],
                             init_lora_weights=False)
    peft_model = peft.get_peft_model(model, config)
    peft_model.save_pretrained(tmp_path)
    adapter = load_peft_adapter(tmp_path, module_shapes=SHAPES)
    assert list(adapter.modules) == [DN]
    wrapper = next(m for m in peft_model.modules() if type(m).__name__ == "ParamWrapper")
    got = np.einsum("eor,eri->eoi", adapter.modules[DN].lora_b, adapter.modules[DN].lora_a)
    np.testing.assert_allclose(got, wrapper.get_delta_weight("default").detach().numpy(), rtol=1e-5, atol=1e-6)


def test_save_load_round_trip(tmp_path):
    rng = np.random.default_rng(0)
    modules = {GU: (rng.normal(size=(E, 4, H)), rng.normal(size=(E, 2 * I, 4))),
               DN: (rng.normal(size=(E, 4, I)), rng.normal(size=(E, H, 4))),
               Q: (rng.normal(size=(4, H)), rng.normal(size=(H, 4)))}
    save_peft_adapter(str(tmp_path), modules, r=4, lora_alpha=8)
    adapter = load_peft_adapter(tmp_path, module_shapes=SHAPES)
    for name, (a, b) in modules.items():
        np.testing.assert_allclose(adapter.modules[name].lora_a, a.astype(np.float32))
        np.testing.assert_allclose(adapter.modules[name].lora_b, b.astype(np.float32))
        assert adapter.modules[name].scaling == 2.0
    a3, b3 = modules[GU]
    np.testing.assert_array_equal(split_expert_factors(*join_expert_factors(a3, b3), E)[1], b3)


def test_per_expert_linears_grouped_into_fused_weights(tmp_path):
    rng = np.random.default_rng(1)
    prefix = "model.layers.0.block_sparse_moe.experts"
    modules = {}
    for e in (0, 2):
        modules[f"{prefix}.{e}.w1"] = (rng.normal(size=(2, H)), rng.normal(size=(I, 2)))
        modules[f"{prefix}.{e}.w3"] = (rng.normal(size=(2, H)), rng.normal(size=(I, 2)))
        modules[f"{prefix}.{e}.w2"] = (rng.normal(size=(2, I)), rng.normal(size=(H, 2)))
    save_peft_adapter(str(tmp_path), modules, r=2, lora_alpha=3)
    adapter = load_peft_adapter(tmp_path, module_shapes=SHAPES)
    assert sorted(adapter.modules) == [DN, GU]
    gate_up = adapter.modules[GU]
    assert gate_up.lora_a.shape == (E, 4, H) and gate_up.scaling == 1.0
    delta = np.einsum("eor,eri->eoi", gate_up.lora_b.astype(np.float64), gate_up.lora_a.astype(np.float64))
    for e in range(E):
        for name, rows in (("w1", slice(0, I)), ("w3", slice(I, 2 * I))):
            want = 1.5 * (modules[f"{prefix}.{e}.{name}"][1] @ modules[f"{prefix}.{e}.{name}"][0]
                          if e in (0, 2) else np.zeros((I, H)))
            np.testing.assert_allclose(delta[e, rows], want, rtol=1e-5, atol=1e-5)
    down = adapter.modules[DN]
    np.testing.assert_allclose(down.lora_b[2] @ down.lora_a[2], 1.5 * modules[f"{prefix}.2.w2"][1]
                               @ modules[f"{prefix}.2.w2"][0], rtol=1e-5, atol=1e-5)
    with pytest.raises(AdapterError, match="max_rank"):
        group_expert_linears({f"{prefix}.0.w1": (np.zeros((5, H)), np.zeros((I, 5)), 1.0, (GU, 0, 0, 2)),
                              f"{prefix}.0.w3": (np.zeros((5, H)), np.zeros((I, 5)), 1.0, (GU, 0, 1, 2))}, SHAPES)


def _write_header_only(path, tensors: dict, config: dict) -> None:
    """A safetensors file whose header declares `tensors` {name: shape} (F32, zero data)."""
    header, offset = {}, 0
    for name, shape in tensors.items():
        n = int(np.prod(shape)) * 4
        header[name] = {"dtype": "F32", "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    text = json.dumps(header).encode()
    with open(os.path.join(path, "adapter_model.safetensors"), "wb") as f:
        f.write(len(text).to_bytes(8, "little") + text + bytes(offset))
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump(config, f)


@pytest.mark.parametrize("shape_a, shape_b, match", [
    ((2 * E, H + 1), (2 * I, 2 * E), "do not fit"),          # in_features wrong
    ((2 * 5, H), (2 * I, 2 * 5), "5 experts"),               # expert count wrong
    ((7, H), (2 * I, 7), "r \\* experts"),                    # rows not a multiple of r
    ((16 * E, H), (2 * I, 16 * E), "r \\* experts|max_rank"),  # rank above max_rank
])
def test_header_shapes_refused_before_reading(tmp_path, shape_a, shape_b, match):
    prefix = "base_model.model.model.layers.0.mlp.experts.base_layer"
    r = 16 if shape_a[0] == 16 * E else 2
    _write_header_only(tmp_path, {f"{prefix}.lora_A.weight": shape_a, f"{prefix}.lora_B.weight": shape_b},
                       {"r": r, "lora_alpha": 2, "target_parameters": ["mlp.experts.gate_up_proj",
                                                                       "mlp.experts.down_proj"]})
    with pytest.raises(AdapterError, match=match):
        load_peft_adapter(tmp_path, module_shapes=SHAPES)


def test_nesting_deeper_than_targets_refused(tmp_path):
    prefix = "base_model.model.model.layers.0.mlp.experts.base_layer.base_layer"
    _write_header_only(tmp_path, {f"{prefix}.lora_A.weight": (2 * E, H), f"{prefix}.lora_B.weight": (2 * I, 2 * E)},
                       {"r": 2, "target_parameters": ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]})
    with pytest.raises(AdapterError, match="nested 2 wrappers deep"):
        load_peft_adapter(tmp_path)


def test_target_parameters_with_dora_refused(tmp_path):
    _write_header_only(tmp_path, {}, {"r": 2, "use_dora": True, "target_parameters": ["mlp.experts.down_proj"]})
    with pytest.raises(AdapterError, match="target_parameters"):
        load_peft_adapter(tmp_path)


def test_nesting_in_another_order_is_read_by_shape(tmp_path):
    """A class that registers down_proj before gate_up_proj nests them the other way round (down_proj
    innermost, under ".base_layer"): given the model's shapes, each pair goes to the parameter it fits."""
    from safetensors.numpy import save_file
    rng = np.random.default_rng(3)
    gu_a, gu_b = rng.normal(size=(E, 2, H)), rng.normal(size=(E, 2 * I, 2))
    dn_a, dn_b = rng.normal(size=(E, 2, I)), rng.normal(size=(E, H, 2))
    prefix = "base_model.model.model.layers.0.mlp.experts"
    tensors = {}
    for where, (a, b) in ((prefix + ".base_layer", (dn_a, dn_b)), (prefix, (gu_a, gu_b))):
        a2, b2 = join_expert_factors(a.astype(np.float32), b.astype(np.float32))
        tensors[f"{where}.lora_A.weight"], tensors[f"{where}.lora_B.weight"] = a2, b2
    save_file(tensors, str(tmp_path / "adapter_model.safetensors"))
    (tmp_path / "adapter_config.json").write_text(json.dumps(
        {"r": 2, "lora_alpha": 2, "target_modules": [], "target_parameters": ["mlp.experts.gate_up_proj",
                                                                              "mlp.experts.down_proj"]}))
    adapter = load_peft_adapter(tmp_path, module_shapes=SHAPES)
    np.testing.assert_allclose(adapter.modules[GU].lora_b, gu_b.astype(np.float32))
    np.testing.assert_allclose(adapter.modules[DN].lora_a, dn_a.astype(np.float32))
