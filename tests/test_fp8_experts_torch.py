"""fp8 (e4m3) expert LoRA slots on the torch side (contract section 11): `LoRAExperts(...,
lora_dtype="fp8")` and `MultiLoRAModel(..., lora_dtype="fp8")` over mixture-of-experts models.

A tiny random Mixtral and Qwen2-MoE in float32 on the CPU (tests/test_torch_hf_moe.py's
`MoeFamily`, PEFT adapters with `target_parameters` on the fused experts). With fp8 slots the
expert stacks are float8_e4m3fn with float32 scales per expert and output channel, holding the
contract quantisation of the 16-bit model's slots (bit for bit); a mixed batch's logits stay within
FP8_OF_EFFECT (tests/test_fp8_storage.py) of PEFT relative to the adapter's effect, on the torch
reference backend and the Triton kernels (interpreter). `LoRAExperts.forward_experts` with fp8
slots equals the float64 oracle of the whole MoE block on the dequantised weights; the wrapper's
MoE methods forward `lora_a_scale` / `lora_b_scale` (fp8 weights without scales are refused).
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("peft")

from torch_lora.experts import LoRAExperts  # noqa: E402

from . import oracle  # noqa: E402
from .test_fp8_storage import FP8_OF_EFFECT  # noqa: E402
from .test_torch_hf_moe import INTERPRETED, RTOL, VOCAB, MoeFamily, _rel  # noqa: E402

ROWS = ["both", "experts", "__base__", "down", "attn", "both"]


class DecisiveMoeFamily(MoeFamily):
    """MoeFamily with the routers scaled up 20x: routing far from ties, so that the e4m3 rounding of
    the adapter's effect never flips a token's experts (a flip would change the logits by far more
    than the quantisation error)."""

    def fresh(self):
        model = super().fresh()
        with torch.no_grad():
            for layer in model.model.layers:
                layer.mlp.gate.weight.mul_(20.0)
        return model


@pytest.fixture(scope="module", params=["mixtral", "qwen2_moe"])
def family(request, tmp_path_factory):
    return DecisiveMoeFamily(tmp_path_factory.mktemp(f"fp8-{request.param}"), request.param)


def _experts(mm) -> list:
    return [layer for layer in mm.layers.values() if isinstance(layer, LoRAExperts)]


def test_fp8_expert_slots_hold_the_contract_quantisation(family):
    """Every expert stack of the fp8 model is e4m3 with float32 (L, E, rows) scales, equal bit for
    bit to oracle.fp8_quantize of the float32 model's slot (same adapters, same slots)."""
    fp8, full = family.wrapped(lora_dtype="fp8"), family.wrapped()
    for mm in (fp8, full):
        mm.adapters.activate([mm._ids[name] for name in ("both", "experts", "down")])
    layers_fp8, layers_full = _experts(fp8), _experts(full)
    assert len(layers_fp8) == 2
    for q_layer, f_layer in zip(layers_fp8, layers_full):
        assert q_layer.lora_dtype == "fp8" and "lora_dtype=fp8" in repr(q_layer)
        for name, rows in (("gu_a", q_layer.max_rank), ("gu_b", 2 * q_layer.intermediate),
                           ("dn_a", q_layer.max_rank), ("dn_b", q_layer.hidden)):
            stack, scale = getattr(q_layer, name), getattr(q_layer, f"{name}_scale")
            assert stack.dtype == torch.float8_e4m3fn and scale.dtype == torch.float32
            assert tuple(scale.shape) == (q_layer.max_loras, q_layer.num_experts, rows)
            want_q, want_scale = oracle.fp8_quantize(getattr(f_layer, name).numpy())
            np.testing.assert_array_equal(scale.numpy(), want_scale)
            np.testing.assert_array_equal(stack.view(torch.uint8).numpy(), want_q.view(np.uint8))
        assert int(q_layer.adapter_enabled.sum()) > 0
        assert torch.equal(q_layer.adapter_enabled, f_layer.adapter_enabled)


def _dequantise_into(fp8, full) -> None:
    """Writes every fp8 slot of `fp8`'s layers, dequantised (float32(q) * its row's scale), into the
    same buffer of `full`'s layers (the same adapters in the same slots)."""
    for path, layer in fp8.layers.items():
        for name, buf in layer.named_buffers():
            if buf.dtype != torch.float8_e4m3fn:
                continue
            scale_name = name.replace("lora_b_", "lora_b_scale_") if name.startswith("lora_b_") else f"{name}_scale"
            scale = getattr(layer, scale_name)
            getattr(full.layers[path], name).copy_(buf.float() * scale[..., None])


def _routing(mm) -> list:
    """Records, call by call, the top_k_index every experts layer of `mm` receives."""
    seen = []
    for layer in _experts(mm):
        def record(module, x, top_k_index, top_k_weights, _run=layer.forward_experts):
            seen.append(top_k_index.clone())
            return _run(module, x, top_k_index, top_k_weights)
        layer.forward_experts = record
    return seen


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=INTERPRETED)])
def test_fp8_expert_slots_match_the_16_bit_model(family, backend):
    """A mixed batch through the fp8 model (1) equals the float32 model holding the dequantised fp8
    slots within float32's tolerance, and (2) stays within FP8_OF_EFFECT of PEFT (relative to the
    adapter's effect) at every position whose experts the e4m3 rounding did not change (a changed
    top-k choice moves the logits by far more than the quantisation error; at most a quarter of the
    positions may change)."""
    if backend == "triton" and family.name != "mixtral":
        pytest.skip("the interpreter runs one family (the kernel is the same)")
    rows = ROWS if backend == "torch" else ["experts", "__base__", "down"]
    mm = family.wrapped(backend=backend, lora_dtype="fp8")
    full, deq = family.wrapped(backend="torch"), family.wrapped(backend="torch")
    assert all(t.dtype == torch.float8_e4m3fn for layer in _experts(mm) for t in layer.slot_views(0)[:4])
    for m in (mm, full, deq):
        m.adapters.activate([m._ids[name] for name in sorted(set(rows) - {"__base__"})])
    _dequantise_into(mm, deq)
    tokens = torch.as_tensor(np.random.default_rng(7).integers(1, VOCAB, size=(len(rows), 4)))
    routes_fp8, routes_full = _routing(mm), _routing(full)
    out = mm(tokens, adapter_names=rows).logits.numpy()
    want16 = full(tokens, adapter_names=rows).logits.numpy()
    assert _rel(out, deq(tokens, adapter_names=rows).logits.numpy()) < RTOL
    kept = np.ones(tokens.shape, bool)
    for got_ids, want_ids in zip(routes_fp8, routes_full):
        kept &= (got_ids.sort(-1).values == want_ids.sort(-1).values).all(-1).view(tokens.shape).numpy()
    assert kept.mean() >= 0.75, kept
    for j, adapter in enumerate(rows):
        want = family.alone(adapter, tokens[j])
        assert _rel(want16[j], want) < RTOL
        if adapter == "__base__":
            assert _rel(out[j], want) < RTOL
            continue
        effect = _rel(want, family.alone("__base__", tokens[j]))
        for pos in np.flatnonzero(kept[j]):
            assert _rel(out[j, pos], want[pos]) <= FP8_OF_EFFECT * effect, (adapter, pos, _rel(out[j, pos], want[pos]))
        if adapter != "attn":
            assert _rel(out[j], want16[j]) > 1e-7            # the expert slots really hold e4m3 values


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=INTERPRETED)])
def test_fp8_lora_experts_forward_equals_the_float64_block(backend):
    """LoRAExperts(lora_dtype="fp8").forward_experts, slots written directly (e4m3 values, scales per
    expert and row), against the oracle's whole MoE block on the dequantised stacks."""
    from lora_core.host_mapping import LoRAMapping
    from torch_lora import PunicaWrapper

    torch.manual_seed(0)
    cfg = transformers.MixtralConfig(hidden_size=16, intermediate_size=12, num_local_experts=4, num_experts_per_tok=2)
    experts = transformers.models.mixtral.modeling_mixtral.MixtralExperts(cfg)
    with torch.no_grad():
        experts.gate_up_proj.normal_(0, 0.3)
        experts.down_proj.normal_(0, 0.3)
    tokens, slots = 6, 3
    punica = PunicaWrapper(8, 4, "cpu", max_loras=slots, backend=backend)
    layer = LoRAExperts("experts", 4, 16, 12, max_loras=slots, max_rank=4, punica=punica, lora_dtype="fp8")
    deq = {}
    rng = np.random.default_rng(3)
    with torch.no_grad():
        for name in ("gu_a", "gu_b", "dn_a", "dn_b"):
            stack = getattr(layer, name)
            q, scale = oracle.fp8_quantize(rng.normal(0, 0.3, size=tuple(stack.shape)))
            stack.view(torch.uint8).copy_(torch.from_numpy(q.view(np.uint8)))
            getattr(layer, f"{name}_scale").copy_(torch.from_numpy(scale))
            deq[name] = oracle.fp8_dequantize(q, scale)
        layer.adapter_enabled[:slots] = torch.tensor([1, 1, 0], dtype=torch.int32)
    idx = np.array([0, -1, 1, 2, 0, 1], np.int32)                 # slot 2: no expert LoRA
    ids = [0 if i < 0 else 101 + i for i in idx]
    punica.update_metadata(LoRAMapping(ids, ids, False), [101, 102, 103], slots + 1, 32)
    x = torch.randn(tokens, 16)
    top_k_index = torch.stack([torch.randperm(4)[:2] for _ in range(tokens)])
    top_k_weights = torch.softmax(torch.randn(tokens, 2), dim=-1)
    with torch.no_grad():
        got = layer.forward_experts(experts, x, top_k_index, top_k_weights).double().numpy()
    enabled_idx = np.where((idx >= 0) & (layer.adapter_enabled[np.maximum(idx, 0)].numpy() != 0), idx, -1)
    w_gu, w_dn = experts.gate_up_proj.detach().numpy(), experts.down_proj.detach().numpy()
    want = oracle.moe_block_lora(x.numpy(), w_gu, w_dn, top_k_index.numpy(), top_k_weights.numpy(), enabled_idx,
                                 deq["gu_a"], deq["gu_b"], deq["dn_a"], deq["dn_b"], [1.0] * slots)
    assert oracle.rel_err(got, want) < 1e-5
    base = oracle.moe_block_lora(x.numpy(), w_gu, w_dn, top_k_index.numpy(), top_k_weights.numpy(),
                                 np.full(tokens, -1), None, None, None, None, [])
    assert oracle.rel_err(got, base) > 1e-3


def test_wrapper_moe_methods_take_and_check_the_scales():
    """add_lora_w13 / add_lora_w2 forward lora_a_scale / lora_b_scale to the op: fp8 slices without
    their scales are refused by name, and a scale on a 16-bit slice too."""
    from lora_core.host_mapping import LoRAMapping
    from torch_lora import PunicaWrapper

    punica = PunicaWrapper(8, 4, "cpu", max_loras=2, backend="torch")
    punica.update_metadata(LoRAMapping([1, 2], [1, 2], False), [1, 2], 3, 32)
    a = torch.zeros(2, 4, 2, 8, dtype=torch.float8_e4m3fn)
    b = torch.zeros(2, 4, 6, 2, dtype=torch.float8_e4m3fn)
    y = torch.zeros(2, 2, 6)
    x = torch.randn(2, 8)
    topk = torch.tensor([[0, 1], [2, 3]])
    w = torch.full((2, 2), 0.5)
    enabled = torch.ones(3, dtype=torch.int32)
    args = (topk, w, None, None, None, 2, 2, 2, enabled, 4, 2, 1, False, False)
    with pytest.raises(ValueError, match="lora_a_scale must give its scales"):
        punica.add_lora_w13(y, x, (a,), (b,), *args)
    scales = dict(lora_a_scale=(torch.ones(2, 4, 2),), lora_b_scale=(torch.ones(2),))
    align = punica.add_lora_w13(y, x, (a,), (b,), *args, **scales)
    with pytest.raises(ValueError, match="lora_b_scale is given"):
        punica.add_lora_w2(y, torch.randn(4, 8), (a,), (b.float(),), w, *align, 2, None, None, 2, 2, enabled, 2,
                           False, 0, False, lora_a_scale=(torch.ones(2, 4, 2),), lora_b_scale=(torch.ones(2),))


@pytest.mark.gpu
def test_fp8_expert_slots_on_cuda_match_the_dequantised_model(family):
    """The compiled Triton kernels on CUDA (float32 model): the fp8 model equals the float32 model
    holding its dequantised slots, and its expert stacks are e4m3."""
    if family.name != "mixtral":
        pytest.skip("one family on the GPU")
    from torch_lora.hf import MultiLoRAModel
    torch.backends.cuda.matmul.allow_tf32 = False
    models = []
    for kw in ({"lora_dtype": "fp8"}, {}):
        mm = MultiLoRAModel(family.fresh().cuda(), max_loras=4, max_rank=8, backend="triton", **kw)
        for name in ("both", "experts", "down"):
            mm.load_adapter(name, family.dirs[name])
        mm.adapters.activate([mm._ids[name] for name in ("both", "experts", "down")])
        models.append(mm)
    mm, deq = models
    assert all(t.dtype == torch.float8_e4m3fn for layer in _experts(mm) for t in layer.slot_views(0)[:4])
    _dequantise_into(mm, deq)
    rows = ["both", "experts", "__base__", "down"]
    tokens = torch.as_tensor(np.random.default_rng(9).integers(1, VOCAB, size=(len(rows), 5))).cuda()
    out = mm(tokens, adapter_names=rows).logits.cpu().numpy()
    want = deq(tokens, adapter_names=rows).logits.cpu().numpy()
    assert _rel(out, want) < 1e-4
