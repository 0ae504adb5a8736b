"""torch_lora.hf.MultiLoRAModel on mixture-of-experts models (Mixtral, Qwen2-MoE, Qwen3-MoE) against PEFT.

Tiny random models; adapters made and saved by peft with `target_parameters` on the fused expert
weights (gate_up_proj and / or down_proj), mixed with attention LoRA, expert LoRA only, attention
LoRA only, rank / alpha patterns and rsLoRA. A mixed batch (rows with different adapters and
without one) must give, row by row, peft's logits for that request alone (float32, CPU), in a
forward pass and through generate(); the Triton kernels (interpreter) too. unwrap() restores the
experts' own forward. An adapter on per-expert linears (the older Mixtral layout) equals the
model with its deltas merged into the fused expert weights. LoRAExperts alone equals the
float64 oracle of a whole MoE block (tests/oracle.py), on both backends.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from torch_lora.experts import LoRAExperts  # noqa: E402
from torch_lora.hf import MultiLoRAModel  # noqa: E402

RTOL = 1e-4
VOCAB = 64
FAMILIES = {
    "mixtral": ("MixtralConfig", "MixtralForCausalLM",
                dict(intermediate_size=24, num_local_experts=4, num_experts_per_tok=2)),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM",
                  dict(intermediate_size=24, moe_intermediate_size=16, shared_expert_intermediate_size=24,
                       num_experts=4, num_experts_per_tok=2, decoder_sparse_step=1)),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  dict(intermediate_size=24, moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2,
                       head_dim=8, decoder_sparse_step=1, norm_topk_prob=True)),
}
COMMON = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=64, pad_token_id=0, tie_word_embeddings=False)
EXPERTS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
ADAPTERS = {
    "both": dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], target_parameters=EXPERTS),
    "experts": dict(r=8, lora_alpha=4, use_rslora=True, target_modules=[], target_parameters=EXPERTS,
                    rank_pattern={"down_proj": 2}, alpha_pattern={"gate_up_proj": 16}),
    "down": dict(r=2, lora_alpha=4, target_modules=[], target_parameters=["mlp.experts.down_proj"]),
    "attn": dict(r=4, lora_alpha=4, target_modules=["o_proj"]),
}


def _rel(got, want) -> float:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.abs(got - want).max() / max(1.0, np.abs(want).max()))


class MoeFamily:
    def __init__(self, root, name):
        cfg_name, model_name, extra = FAMILIES[name]
        self.name, self.model_cls = name, getattr(transformers, model_name)
        torch.manual_seed(0)
        self.base_dir = str(root / "base")
        self.model_cls(getattr(transformers, cfg_name)(**COMMON, **extra)).eval().save_pretrained(self.base_dir)
        self.dirs, self.peft = {}, {}
        for i, (adapter, kw) in enumerate(ADAPTERS.items()):
            torch.manual_seed(100 + i)
            pm = peft.get_peft_model(self.fresh(), peft.LoraConfig(init_lora_weights=False, **kw)).eval()
            with torch.no_grad():                # PEFT initialises B small: make the expert LoRA matter
                for module in pm.modules():
                    if type(module).__name__ == "ParamWrapper":
                        module.lora_B["default"].weight.mul_(20.0)
            self.dirs[adapter] = str(root / adapter)
            pm.save_pretrained(self.dirs[adapter])
            self.peft[adapter] = pm
        self.peft["__base__"] = self.fresh()

    def fresh(self):
        return self.model_cls.from_pretrained(self.base_dir).eval()

    def wrapped(self, **kw):
        mm = MultiLoRAModel(self.fresh(), **{"max_loras": 4, "max_rank": 8, **kw})
        for a, path in self.dirs.items():
            mm.load_adapter(a, path)
        return mm

    def alone(self, adapter, tokens):
        with torch.no_grad():
            return self.peft[adapter](torch.as_tensor(tokens)[None]).logits[0].numpy()


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory):
    return MoeFamily(tmp_path_factory.mktemp(request.param), request.param)


def test_mixed_batch_equals_peft_per_request(family):
    mm = family.wrapped()
    assert sum(isinstance(layer, LoRAExperts) for layer in mm.layers.values()) == 2
    rows = ["both", "experts", "__base__", "down", "attn", "both"]
    tokens = torch.as_tensor(np.random.default_rng(1).integers(1, VOCAB, size=(len(rows), 5)))
    out = mm(tokens, adapter_names=rows).logits.numpy()
    for j, adapter in enumerate(rows):
        want = family.alone(adapter, tokens[j])
        assert _rel(out[j], want) < RTOL, (family.name, j, adapter, _rel(out[j], want))
        if adapter != "__base__":
            assert _rel(want, family.alone("__base__", tokens[j])) > 1e-3, adapter


def test_generate_with_mixed_adapters_equals_peft_per_request(family):
    mm = family.wrapped()
    rows = ["experts", "__base__", "both"]
    rng = np.random.default_rng(2)
    prompts = [rng.integers(1, VOCAB, size=n) for n in (4, 3, 5)]
    width = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros(len(prompts), width, dtype=torch.long)
    for j, p in enumerate(prompts):
        ids[j, width - len(p):] = torch.as_tensor(p)
        mask[j, width - len(p):] = 1
    gen = dict(max_new_tokens=4, min_new_tokens=4, do_sample=False, output_logits=True, return_dict_in_generate=True,
               pad_token_id=0)
    out = mm.generate(ids, attention_mask=mask, adapter_names=rows, **gen)
    logits = torch.stack(out.logits, dim=1).numpy()
    for j, (adapter, p) in enumerate(zip(rows, prompts)):
        with torch.no_grad():
            ref = family.peft[adapter].generate(input_ids=torch.as_tensor(p)[None], **gen)
        assert out.sequences[j, width:].tolist() == ref.sequences[0, len(p):].tolist(), (family.name, j, adapter)
        assert _rel(logits[j], torch.stack(ref.logits, dim=1)[0].numpy()) < RTOL, (family.name, j, adapter)


# The Triton backend on CPU tensors runs in Triton's interpreter (set by tests/conftest.py without
# CUDA); on a GPU machine tests/test_gpu_moe_lora.py runs the compiled kernels, MultiLoRAModel on a
# Mixtral on CUDA included.
INTERPRETED = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                 reason="Triton on CPU tensors needs the interpreter (CUDA present)")


@INTERPRETED
def test_triton_kernels_and_unwrap(tmp_path):
    """The Triton backend (interpreter on CPU) equals peft too; unwrap() gives back the experts'
    own forward and the base model's logits."""
    fam = MoeFamily(tmp_path, "mixtral")
    mm = fam.wrapped(backend="triton")
    rows = ["experts", "down", "__base__"]
    tokens = torch.as_tensor(np.random.default_rng(3).integers(1, VOCAB, size=(len(rows), 3)))
    out = mm(tokens, adapter_names=rows).logits.numpy()
    for j, adapter in enumerate(rows):
        assert _rel(out[j], fam.alone(adapter, tokens[j])) < RTOL, (j, adapter)
    model = mm.unwrap()
    assert all("forward" not in m.__dict__ for m in model.modules())
    with torch.no_grad():
        plain = model(tokens).logits.numpy()
    for j in range(len(rows)):
        assert _rel(plain[j], fam.alone("__base__", tokens[j])) < RTOL


def test_per_expert_linear_adapter_equals_merged_weights(tmp_path):
    """An adapter saved on per-expert linears (`block_sparse_moe.experts.<e>.w1 / w3 / w2`, the
    older Mixtral layout) served on the fused experts equals the base model with each expert's
    B @ A * scaling merged into its gate / up / down rows."""
    from lora_core.peft import save_peft_adapter
    cfg_name, model_name, extra = FAMILIES["mixtral"]
    torch.manual_seed(0)
    model = getattr(transformers, model_name)(getattr(transformers, cfg_name)(**COMMON, **extra)).eval()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    hidden, inter, rank = 32, 24, 4
    rng = np.random.default_rng(5)
    modules = {}
    for layer in (0, 1):
        for e in (0, 3):
            prefix = f"model.layers.{layer}.block_sparse_moe.experts.{e}"
            for name, (n_in, n_out) in {"w1": (hidden, inter), "w3": (hidden, inter), "w2": (inter, hidden)}.items():
                modules[f"{prefix}.{name}"] = (rng.normal(size=(rank, n_in)) / 2, rng.normal(size=(n_out, rank)) / 2)
    save_peft_adapter(str(tmp_path / "per-expert"), modules, r=rank, lora_alpha=8)
    merged = getattr(transformers, model_name)(model.config).eval()
    merged.load_state_dict(state)
    with torch.no_grad():
        for key, (a, b) in modules.items():
            layer, e, name = int(key.split(".")[2]), int(key.split(".")[5]), key.split(".")[6]
            experts = merged.model.layers[layer].mlp.experts
            delta = torch.as_tensor(2.0 * b @ a, dtype=torch.float32)
            if name == "w2":
                experts.down_proj[e] += delta
            else:
                rows = slice(0, inter) if name == "w1" else slice(inter, 2 * inter)
                experts.gate_up_proj[e, rows] += delta
    mm = MultiLoRAModel(model, max_loras=2, max_rank=8)
    mm.load_adapter("per-expert", str(tmp_path / "per-expert"))
    tokens = torch.as_tensor(np.random.default_rng(6).integers(1, VOCAB, size=(2, 6)))
    out = mm(tokens, adapter_names=["per-expert", "__base__"]).logits.numpy()
    with torch.no_grad():
        want = merged(tokens[:1]).logits[0].numpy()
    assert _rel(out[0], want) < RTOL
    with torch.no_grad():
        plain = mm.unwrap()(tokens).logits.numpy()                   # the base model
    assert _rel(out[1], plain[1]) < RTOL                             # the row without adapter
    assert _rel(want, plain[0]) > 1e-3                               # the adapter matters


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=INTERPRETED)])
def test_lora_experts_forward_equals_the_float64_block(backend):
    """LoRAExperts.forward_experts on a Mixtral experts module, slots filled directly, against the
    oracle's whole MoE block (gate_up LoRA, SiLU gate, down LoRA, router weights) in float64."""
    from lora_core.host_mapping import LoRAMapping
    from torch_lora import PunicaWrapper
    from torch_lora.experts import LoRAExperts

    from . import oracle
    torch.manual_seed(0)
    cfg = transformers.MixtralConfig(hidden_size=16, intermediate_size=12, num_local_experts=4, num_experts_per_tok=2)
    experts = transformers.models.mixtral.modeling_mixtral.MixtralExperts(cfg)
    with torch.no_grad():
        experts.gate_up_proj.normal_(0, 0.3)
        experts.down_proj.normal_(0, 0.3)
    tokens, slots = 6, 3
    punica = PunicaWrapper(8, 4, "cpu", max_loras=slots, backend=backend)
    layer = LoRAExperts("experts", 4, 16, 12, max_loras=slots, max_rank=4, punica=punica)
    with torch.no_grad():
        for t in (layer.gu_a, layer.gu_b, layer.dn_a, layer.dn_b):
            t.normal_(0, 0.3)
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
    want = oracle.moe_block_lora(x.numpy(), experts.gate_up_proj.detach().numpy(), experts.down_proj.detach().numpy(),
                                 top_k_index.numpy(), top_k_weights.numpy(), enabled_idx, layer.gu_a.numpy(),
                                 layer.gu_b.numpy(), layer.dn_a.numpy(), layer.dn_b.numpy(), [1.0] * slots)
    assert oracle.rel_err(got, want) < 1e-5
    base = oracle.moe_block_lora(x.numpy(), experts.gate_up_proj.detach().numpy(), experts.down_proj.detach().numpy(),
                                 top_k_index.numpy(), top_k_weights.numpy(), np.full(tokens, -1), None, None, None,
                                 None, [])
    assert oracle.rel_err(got, base) > 1e-3
