"""torch_lora.hf.MultiLoRAModel over quantized base models, against PEFT on the same quantized model.

Each parity test builds PEFT's model over a quantized tiny Llama (tests/hf_llama.py's, three adapters),
takes its logits (a mixed batch, and each row alone), then removes PEFT's layers (`unload()`, which
hands back the very same quantized modules) and wraps that model with MultiLoRAModel: both compute
on the same quantized weights, so the logits agree to float32 rounding (1e-4 relative).

- torchao int8 weight-only and float8 weight-only (CPU; skipped without torchao);
- bitsandbytes' Linear8bitLt (CPU; skipped without bitsandbytes);
- a linear-like module that is not an nn.Linear (int8 weights with per-channel scales, written here)
  named in target_modules, against PEFT over the float model holding its dequantized weights;
- the rules: the adapter dtype of a module whose weight is not a float tensor is the model's
  activation dtype; modules without in/out features, a forward that does not return its base output
  and DoRA over quantized weights are refused with errors naming the module;
- marked `gpu` (the lead's H200; skipped without CUDA or the package): torchao float8 dynamic
  (activation and weight) and bitsandbytes 8-bit and 4-bit loaded by transformers'
  BitsAndBytesConfig, through the Triton kernels.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("peft")

from torch import nn  # noqa: E402

from lora_core.peft import AdapterError  # noqa: E402
from torch_lora.hf import MultiLoRAModel, select_target_modules  # noqa: E402

from . import hf_llama, torch_helpers  # noqa: E402

NAMES = ["sql", "__base__", "chat", "code"]
TARGETS = hf_llama.ALL7 + ["embed_tokens", "lm_head"]


@pytest.fixture(scope="module")
def llama_assets(tmp_path_factory):
    return hf_llama.write_assets(tmp_path_factory.mktemp("quantized_hf_llama"))


def _rel(got, want) -> float:
    got, want = got.double().cpu(), want.double().cpu()
    return float((got - want).abs().max() / want.abs().max())


def _peft_then_ours(quantized_factory, dirs, *, device="cpu", backend="torch", rtol=1e-4):
    """PEFT's logits over quantized_factory() (mixed batch and each row alone), then MultiLoRAModel
    over the same modules after PEFT's unload(); asserts they agree within rtol. Returns the wrapper."""
    adapters = {n: d for n, d in dirs.items() if not n.startswith("_")}
    pm = hf_llama.peft_model(quantized_factory, adapters)
    ids = torch.tensor(torch_helpers.rng(41).integers(1, 64, size=(len(NAMES), 6))).to(device)
    with torch.no_grad():
        mixed = pm(input_ids=ids, adapter_names=NAMES).logits
    alone = [hf_llama.peft_logits(pm, ids[j:j + 1], n)[0] for j, n in enumerate(NAMES)]
    with torch.no_grad(), pm.disable_adapter():
        base = pm(input_ids=ids).logits
    model = pm.unload()
    mm = MultiLoRAModel(model, max_loras=4, max_rank=8, target_modules=TARGETS, backend=backend)
    for n, d in adapters.items():
        mm.load_adapter(n, d)
    out = mm(ids, adapter_names=NAMES).logits
    assert _rel(out, mixed) < rtol
    for j, n in enumerate(NAMES):
        assert _rel(out[j], alone[j]) < rtol, n
        if n != "__base__":
            assert _rel(out[j], base[j]) > 10 * rtol, n           # the adapter moves the row's logits
    return mm


def _torchao_factory(fresh, config, device="cpu", dtype=torch.float32):
    from torchao.quantization import quantize_

    def factory():
        model = fresh().to(device=device, dtype=dtype)
        quantize_(model, config, filter_fn=lambda m, fqn: isinstance(m, nn.Linear) and not fqn.endswith("lm_head"))
        return model
    return factory


@pytest.mark.parametrize("config_name", ["Int8WeightOnlyConfig", "Float8WeightOnlyConfig"])
def test_torchao_weight_only_equals_peft_on_the_same_model(llama_assets, config_name):
    """torchao int8 / float8 weight-only linears (nn.Linear with a quantized tensor subclass as its
    weight) hold LoRA layers in the weight's reported float dtype; logits equal PEFT's."""
    quantization = pytest.importorskip("torchao.quantization")
    fresh, dirs = llama_assets
    factory = _torchao_factory(fresh, getattr(quantization, config_name)())
    mm = _peft_then_ours(factory, dirs)
    q_proj = mm.model.model.layers[0].self_attn.q_proj
    assert type(q_proj.weight).__name__ != "Parameter"                    # really quantized
    assert mm.layers["model.layers.0.self_attn.q_proj+k_proj+v_proj"].lora_a.dtype == torch.float32


def _bnb_8bit(model):
    """The model with every decoder nn.Linear replaced by bitsandbytes' Linear8bitLt (int8 weights)."""
    import bitsandbytes as bnb
    for _name, parent in list(model.named_modules()):
        for child_name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear) and child_name != "lm_head":
                q = bnb.nn.Linear8bitLt(child.in_features, child.out_features, bias=child.bias is not None,
                                        has_fp16_weights=False)
                q.load_state_dict(child.state_dict())
                setattr(parent, child_name, q.to("cpu"))
    model.is_loaded_in_8bit = True            # what transformers sets; PEFT dispatches on it
    return model


def test_bitsandbytes_8bit_on_cpu_equals_peft_on_the_same_model(llama_assets, caplog):
    """bitsandbytes' Linear8bitLt (int8 weight, an nn.Linear subclass) holds LoRA layers in the
    model's activation dtype (its weight is int8), said in one INFO line on the torch_lora logger;
    logits equal PEFT's; DoRA over it is refused."""
    pytest.importorskip("bitsandbytes")
    fresh, dirs = llama_assets
    with caplog.at_level("INFO", logger="torch_lora"):
        mm = _peft_then_ours(lambda: _bnb_8bit(fresh()), dirs)
    assert any("14 targeted modules (Linear8bitLt) hold no float weight" in r.getMessage() for r in caplog.records)
    q_proj = mm.model.model.layers[0].self_attn.q_proj
    assert q_proj.weight.dtype == torch.int8
    assert mm.layers["model.layers.0.self_attn.q_proj+k_proj+v_proj"].lora_a.dtype == torch.float32
    mm.unwrap()
    with pytest.raises(TypeError, match="dora=True needs plain float base weights"):
        MultiLoRAModel(_bnb_8bit(fresh()), max_loras=2, max_rank=8, dora=True, backend="torch")


class ToyInt8Linear(nn.Module):
    """A linear-like module that is not an nn.Linear: int8 weight (out, in) and float32 scales (out,)
    as buffers, y = x @ (q * s)^T + b. `returns` = "tuple" makes forward return (y, None)."""

    def __init__(self, linear: nn.Linear, returns: str = "tensor"):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        w = linear.weight.detach()
        scale = w.abs().amax(dim=1).clamp_min(1e-12) / 127
        self.register_buffer("qweight", torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8))
        self.register_buffer("scale", scale)
        self.bias = linear.bias
        self.returns = returns

    def dequantized(self) -> torch.Tensor:
        return self.qweight.float() * self.scale[:, None]

    def forward(self, x):
        y = nn.functional.linear(x, self.dequantized().to(x.dtype), self.bias)
        return (y, None) if self.returns == "tuple" else y


def _with_toy_o_proj(model, returns="tensor"):
    for layer in model.model.layers:
        layer.self_attn.o_proj = ToyInt8Linear(layer.self_attn.o_proj, returns)
    return model


def _dequantized_o_proj(model):
    """The float model whose o_proj nn.Linear weights are ToyInt8Linear's dequantized weights."""
    for layer in model.model.layers:
        layer.self_attn.o_proj.weight.data = ToyInt8Linear(layer.self_attn.o_proj).dequantized()
    return model


def test_linear_like_module_equals_peft_on_its_dequantized_weights(llama_assets):
    """A module with in_features / out_features that is not an nn.Linear (ToyInt8Linear, weights
    in buffers) holds a LoRA layer when target_modules names it; "all-linear" leaves it out (PEFT's
    rule); the logits equal PEFT over the float model holding the same dequantized o_proj weights."""
    fresh, dirs = llama_assets
    adapters = {n: d for n, d in dirs.items() if not n.startswith("_")}
    pm = hf_llama.peft_model(lambda: _dequantized_o_proj(fresh()), adapters)
    ids = torch.tensor(torch_helpers.rng(43).integers(1, 64, size=(len(NAMES), 5)))
    with torch.no_grad():
        want = pm(input_ids=ids, adapter_names=NAMES).logits
    model = _with_toy_o_proj(fresh())
    assert not any(n.endswith("o_proj") for n in select_target_modules(model, "all-linear"))
    mm = MultiLoRAModel(model, max_loras=4, max_rank=8, target_modules=TARGETS, backend="torch")
    assert "model.layers.0.self_attn.o_proj" in mm.layers
    for n, d in adapters.items():
        mm.load_adapter(n, d)
    got = mm(ids, adapter_names=NAMES).logits
    assert _rel(got, want) < 1e-4
    with torch.no_grad(), pm.disable_adapter():
        base = pm(input_ids=ids).logits
    assert _rel(got[2], base[2]) > 1e-2                  # "chat" targets o_proj


def test_modules_that_cannot_hold_lora_layers_are_refused(llama_assets, tmp_path):
    """A targeted module without int in_features / out_features (the MLP block) is a TypeError that
    states the rule; a linear-like module whose forward returns a tuple fails at the call naming
    the module and the expected width; DoRA over a module whose weights are not float tensors (here
    no `weight` at all) is refused at wrapping (dora=True) and at load (a DoRA adapter)."""
    fresh, _ = llama_assets
    with pytest.raises(TypeError, match="linear-like modules"):
        MultiLoRAModel(fresh(), max_loras=1, max_rank=4, target_modules=["mlp"], backend="torch")
    mm = MultiLoRAModel(_with_toy_o_proj(fresh(), returns="tuple"), max_loras=1, max_rank=4,
                        target_modules=["o_proj"], backend="torch")
    with pytest.raises(TypeError, match=r"o_proj.*returned a tuple.*out_features=32"):
        mm(torch.ones((1, 3), dtype=torch.long))
    with pytest.raises(TypeError, match="dora=True needs plain float base weights"):
        MultiLoRAModel(_with_toy_o_proj(fresh()), max_loras=1, max_rank=4, target_modules=["o_proj"], dora=True,
                       backend="torch")
    dora_dir = hf_llama.save_peft(fresh, tmp_path / "dora", 4, r=4, lora_alpha=8, use_dora=True,
                                  target_modules=["o_proj"])
    mm = MultiLoRAModel(_with_toy_o_proj(fresh()), max_loras=1, max_rank=4, target_modules=["o_proj"],
                        backend="torch")
    with pytest.raises(AdapterError, match="DoRA needs a float base"):
        mm.load_adapter("dora", dora_dir)


# ------------------------------------------------------------------------------------------ GPU

def _cuda():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    return torch.device("cuda")


@pytest.mark.gpu
def test_gpu_torchao_float8_dynamic_equals_peft(llama_assets):
    """torchao float8 dynamic (activations and weights in float8, row-wise scales) in bfloat16 on
    the GPU, through the Triton kernels: logits equal PEFT's on the same model (bfloat16: 2e-2)."""
    device = _cuda()
    quantization = pytest.importorskip("torchao.quantization")
    fresh, dirs = llama_assets
    config = quantization.Float8DynamicActivationFloat8WeightConfig(granularity=quantization.PerRow())
    _peft_then_ours(_torchao_factory(fresh, config, device, torch.bfloat16), dirs, device=device, backend=None,
                    rtol=2e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("bits", [8, 4])
def test_gpu_bitsandbytes_loaded_by_transformers_equals_peft(llama_assets, bits):
    """bitsandbytes 8-bit and 4-bit (nf4, bfloat16 compute) linears as transformers loads them
    (BitsAndBytesConfig), float16 / bfloat16 activations, through the Triton kernels: logits equal
    PEFT's on the same model (2e-2)."""
    device = _cuda()
    pytest.importorskip("bitsandbytes")
    import transformers
    _, dirs = llama_assets
    dtype = torch.float16 if bits == 8 else torch.bfloat16
    config = (transformers.BitsAndBytesConfig(load_in_8bit=True) if bits == 8 else
              transformers.BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                              bnb_4bit_compute_dtype=torch.bfloat16))

    def factory():
        return transformers.LlamaForCausalLM.from_pretrained(dirs["_model"], quantization_config=config,
                                                             dtype=dtype, device_map={"": 0}).eval()
    mm = _peft_then_ours(factory, dirs, device=device, backend=None, rtol=2e-2)
    assert mm.layers["model.layers.0.self_attn.q_proj+k_proj+v_proj"].lora_a.dtype == dtype
