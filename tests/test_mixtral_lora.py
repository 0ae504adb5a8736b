"""Expert LoRA served by the Flax Mixtral against PEFT: adapters made by peft itself on a tiny random
transformers Mixtral (`target_parameters` on the fused experts, with and without attention
`target_modules`, and attention only), loaded by AdapterManager, served by the ServingEngine in one
mixed batch with a base-model request; each request's greedy tokens equal PEFT's generate with its
adapter (fp32, CPU), on a Qwen3-MoE too; the MoE block with LoRA equals the float64 oracle (tests/oracle.py's
moe_block_lora); an adapter on per-expert linears (w1 / w3 / w2) equal to hand-merged weights; an
expert adapter refused by a model without expert LoRA layers; backend pallas_tpu (interpret mode)
serving equal to xla.
"""

from __future__ import annotations

import numpy as np
import pytest

from jax_lora.adapters import AdapterError, AdapterManager, load_peft_adapter, module_shapes
from jax_lora.models import load_mixtral
from jax_lora.models.mixtral import add_lora

from . import hf_mixtral, oracle

torch = pytest.importorskip("torch")
peft = pytest.importorskip("peft")

ADAPTERS = {   # name: (seed, LoraConfig keywords)
    "experts": (5, dict(r=4, lora_alpha=8, target_modules=[], target_parameters=hf_mixtral.EXPERT_PARAMS)),
    "mixed": (6, dict(r=8, lora_alpha=8, use_rslora=True, target_modules=["q_proj", "v_proj"],
                      target_parameters=hf_mixtral.EXPERT_PARAMS)),
    "attn": (7, dict(r=4, lora_alpha=16, target_modules=["q_proj", "o_proj"])),
}


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    root = tmp_path_factory.mktemp("mixtral_lora")
    hf_mixtral.tiny_mixtral().save_pretrained(str(root / "model"))
    dirs = {name: hf_mixtral.save_expert_adapter(hf_mixtral.tiny_mixtral, root / name, seed, **kw)
            for name, (seed, kw) in ADAPTERS.items()}
    return str(root / "model"), dirs


def _peft_greedy(dirs, name, prompt, new_tokens):
    model = peft.PeftModel.from_pretrained(hf_mixtral.tiny_mixtral(), dirs[name]).eval()
    return hf_mixtral.hf_greedy(model, prompt, new_tokens)


def test_mixed_batch_greedy_tokens_equal_peft(assets):
    """Four requests in one engine (expert-only, attention + expert, attention-only adapters and the
    base model): each request's tokens equal PEFT's."""
    from jax_lora.serving import Request, ServingEngine
    model_dir, dirs = assets
    model = load_mixtral(model_dir)
    add_lora(model, max_loras=3, max_rank=8)
    manager = AdapterManager(model)
    for lora_id, name in enumerate(ADAPTERS, start=1):
        manager.register(lora_id, dirs[name])
    prompts = {1: [3, 7, 11, 5], 2: [9, 2, 40], 3: [1, 2, 3, 4, 5], 0: [3, 7, 11, 5]}
    engine = ServingEngine(model, manager, max_seqs=4, max_len=32)
    out = engine.generate([Request(p, lora_id=i or None, max_new_tokens=6) for i, p in prompts.items()])
    names = dict(enumerate(ADAPTERS, start=1))
    for completion, (lora_id, prompt) in zip(out, prompts.items()):
        want = (hf_mixtral.hf_greedy(hf_mixtral.tiny_mixtral(), prompt, 6) if lora_id == 0
                else _peft_greedy(dirs, names[lora_id], prompt, 6))
        assert completion.tokens == want, f"request with adapter {names.get(lora_id, 'none')}"
    assert out[0].tokens != out[3].tokens, "the expert adapter changed nothing: the test would not see a bug"


def test_qwen3_moe_expert_adapter_equals_peft(tmp_path):
    """A Qwen3-MoE (q/k norms, no top-k renormalisation) with an adapter on attention and the
    experts: greedy tokens equal PEFT's, beside a base-model request."""
    from jax_lora.models import add_lora as add_lora_any
    from jax_lora.serving import Request, ServingEngine
    hf_mixtral.tiny_qwen3_moe().save_pretrained(str(tmp_path / "model"))
    path = hf_mixtral.save_expert_adapter(hf_mixtral.tiny_qwen3_moe, tmp_path / "adapter", 9, r=4, lora_alpha=8,
                                          target_modules=["k_proj", "o_proj"],
                                          target_parameters=hf_mixtral.EXPERT_PARAMS)
    model = load_mixtral(str(tmp_path / "model"))
    add_lora_any(model, max_loras=1, max_rank=4, target_modules=["k_proj", "o_proj", "experts"])
    manager = AdapterManager(model)
    manager.register(1, path)
    prompt = [3, 7, 11, 5]
    out = ServingEngine(model, manager, max_seqs=2, max_len=32).generate(
        [Request(prompt, lora_id=1, max_new_tokens=6), Request(prompt, max_new_tokens=6)])
    lora = peft.PeftModel.from_pretrained(hf_mixtral.tiny_qwen3_moe(), path).eval()
    assert out[0].tokens == hf_mixtral.hf_greedy(lora, prompt, 6)
    assert out[1].tokens == hf_mixtral.hf_greedy(hf_mixtral.tiny_qwen3_moe(), prompt, 6)


def test_moe_block_with_lora_equals_the_oracle(assets):
    """One MoE block's output under a wrapper (tokens of two adapters and none) against the float64
    oracle of the whole block (routing from the same router)."""
    import jax.numpy as jnp

    from jax_lora import moe
    from jax_lora import nn as lnn
    from jax_lora.wrapper import PunicaWrapper
    from lora_core.host_mapping import LoRAMapping
    model_dir, dirs = assets
    model = load_mixtral(model_dir)
    add_lora(model, max_loras=2, max_rank=8, target_modules=["experts"])
    manager = AdapterManager(model)
    manager.register(1, dirs["experts"])
    manager.activate([1])
    block = model.model.layers[0].mlp
    rng = np.random.default_rng(0)
    x = rng.standard_normal((6, 32)).astype(np.float32)
    ids_per_token = [1, 0, 1, 1, 0, 1]
    w = PunicaWrapper(8, 4, max_loras=2, backend="xla")
    w.update_metadata(LoRAMapping(tuple(ids_per_token), tuple(ids_per_token), False), manager.lora_index_to_id, 3,
                      64)
    with lnn.punica_context(w):
        got = np.asarray(block(jnp.asarray(x)[None]))[0]
    weights, ids = moe.route_top_k(block.gate(jnp.asarray(x)), 2)
    experts = block.experts
    slot = manager.lora_index_to_id.index(1)
    token_lora = np.array([slot if i else -1 for i in ids_per_token])
    a13, b13 = np.asarray(experts.w13_lora_a.get_value()), np.asarray(experts.w13_lora_b.get_value())
    gu_b = np.concatenate([b13[0], b13[1]], axis=2)                         # (L, E, 2I, r)
    want = oracle.moe_block_lora(x, np.asarray(experts.base.gate_up_proj.get_value()).transpose(0, 2, 1),
                                 np.asarray(experts.base.down_proj.get_value()).transpose(0, 2, 1),
                                 np.asarray(ids), np.asarray(weights), token_lora, a13[0], gu_b,
                                 np.asarray(experts.w2_lora_a.get_value()), np.asarray(experts.w2_lora_b.get_value()),
                                 [1.0, 1.0])
    assert oracle.rel_err(got, want) <= oracle.TOL["float32"]
    base = np.asarray(experts.base(jnp.asarray(x), ids, weights))
    assert oracle.rel_err(base, want) > 1e-3, "the adapter changed nothing"


def test_expert_adapter_needs_expert_lora_layers(assets):
    """A model whose experts have no LoRA layers refuses an adapter with expert LoRA, naming the
    module; the attention-only adapter loads."""
    model_dir, dirs = assets
    model = load_mixtral(model_dir)
    add_lora(model, max_loras=1, max_rank=8, target_modules=["q_proj", "v_proj", "o_proj"])
    with pytest.raises(AdapterError, match="experts"):
        load_peft_adapter(dirs["experts"], module_shapes=module_shapes(model))
    manager = AdapterManager(model)
    manager.register(1, dirs["attn"])
    manager.activate([1])


def test_demo_with_the_built_in_mixtral_verifies_every_request(capsys):
    """`jax-lora demo --model mixtral`: expert adapters served and checked against merged weights."""
    from jax_lora.cli import main
    assert main(["demo", "--model", "mixtral", "--requests", "6", "--max-new-tokens", "3", "--slots", "2"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert out[-1] == "verified: 6/6 requests match merged-weights outputs"
    assert any("4 experts (top 2)" in line for line in out)
    assert any(line.startswith("recompilations after warm-up: 0") for line in out)


def test_pallas_tpu_serving_equals_xla():
    """The demo Mixtral with an attention + expert adapter served on backend pallas_tpu (TPU
    interpret mode on a CPU) gives xla's tokens and logits."""
    import tempfile

    from jax_lora.cli import build_demo_assets
    from jax_lora.models import add_lora as add_lora_any
    from jax_lora.serving import Request, ServingEngine
    with tempfile.TemporaryDirectory() as tmp:
        model_dir, adapter_dirs = build_demo_assets(tmp, model="mixtral")
        served = {}
        for backend in ("xla", "pallas_tpu"):
            model = load_mixtral(model_dir)
            add_lora_any(model, max_loras=1, max_rank=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj",
                                                                         "experts"])
            manager = AdapterManager(model)
            manager.register(1, adapter_dirs[1])
            engine = ServingEngine(model, manager, max_seqs=2, max_len=32, backend=backend, min_prefill_rows=1,
                                   keep_logits=True)
            served[backend] = engine.generate([Request([5, 6, 7], lora_id=1, max_new_tokens=3),
                                               Request([9, 8], max_new_tokens=3)])
    for a, b in zip(served["xla"], served["pallas_tpu"]):
        assert a.tokens == b.tokens
        assert oracle.rel_err(b.logits, a.logits) <= oracle.TOL["float32"]


def test_per_expert_linear_adapter_equals_hand_merged_weights(assets, tmp_path):
    """An adapter on Mixtral's per-expert linears (`block_sparse_moe.experts.E.w1 / w3 / w2`, some
    experts only, gate and up of different ranks), served through the fused experts' LoRA, equals
    the plain model with each expert's W += scaling * B @ A merged by hand in float64."""
    import jax.numpy as jnp

    from jax_lora import nn as lnn
    from jax_lora.adapters import save_peft_adapter
    from jax_lora.wrapper import PunicaWrapper
    from lora_core.host_mapping import LoRAMapping
    model_dir, _ = assets
    rng = np.random.default_rng(3)
    shapes = {"w1": (24, 32), "w3": (24, 32), "w2": (32, 24)}          # (out, in)
    ranks = {"w1": 2, "w3": 3, "w2": 2}
    modules = {}
    for layer in range(2):
        for expert in (0, 2, 3):
            for name, (n_out, n_in) in shapes.items():
                r = ranks[name]
                modules[f"model.layers.{layer}.block_sparse_moe.experts.{expert}.{name}"] = (
                    rng.standard_normal((r, n_in)) / 4, rng.standard_normal((n_out, r)) / 4)
    save_peft_adapter(str(tmp_path / "per_expert"), modules, r=3, lora_alpha=6,
                      rank_pattern={"w1": 2, "w2": 2})
    served = load_mixtral(model_dir)
    add_lora(served, max_loras=1, max_rank=8, target_modules=["experts"])
    manager = AdapterManager(served)
    manager.register(1, str(tmp_path / "per_expert"))
    manager.activate([1])
    merged = load_mixtral(model_dir)
    for (name, (a, b)) in modules.items():
        parts = name.split(".")
        layer, expert, linear = int(parts[2]), int(parts[5]), parts[6]
        scaling = 6 / ranks[linear]
        delta = scaling * (b @ a).T                                           # (in, out)
        experts = merged.model.layers[layer].mlp.experts
        var = experts.down_proj if linear == "w2" else experts.gate_up_proj
        w = np.asarray(var.get_value(), np.float64)
        cols = slice(None) if linear == "w2" else (slice(0, 24) if linear == "w1" else slice(24, 48))
        w[expert, :, cols] += delta
        var.set_value(jnp.asarray(w, jnp.float32))
    tokens = np.array([[3, 7, 11, 5, 9, 2, 40, 33]], np.int32)
    positions = np.arange(8, dtype=np.int32)[None]
    w = PunicaWrapper(8, 4, max_loras=1, backend="xla")
    w.update_metadata(LoRAMapping((1,) * 8, (1,), False), manager.lora_index_to_id, 2, 64)
    with lnn.punica_context(w):
        got = np.asarray(served(tokens, positions)[0])
    want = np.asarray(merged(tokens, positions)[0])
    base = np.asarray(load_mixtral(model_dir)(tokens, positions)[0])
    assert oracle.rel_err(got, want) <= 1e-5
    assert oracle.rel_err(base, want) > 1e-3, "the adapter changed nothing"
