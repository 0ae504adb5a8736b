"""The Flax Mixtral (jax_lora.models.MixtralForCausalLM) against transformers' Mixtral: a tiny random
checkpoint saved by transformers loads with `load_mixtral`, its logits equal transformers' (fp32,
CPU), greedy tokens from the ServingEngine equal `generate`'s, and so for a Qwen3-MoE checkpoint;
the three expert layouts (Mixtral's per-expert w1/w2/w3, per-expert gate/up/down, fused
gate_up_proj/down_proj) load to the same model; the router matches a float64 top-k softmax;
configs the model cannot serve are refused by name.
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from jax_lora import moe
from jax_lora.models import MixtralConfig, load_mixtral, save_mixtral

from . import hf_mixtral

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def hf_model_dir(tmp_path_factory):
    model = hf_mixtral.tiny_mixtral()
    path = tmp_path_factory.mktemp("mixtral") / "model"
    model.save_pretrained(str(path))
    return model, str(path)


def test_logits_and_greedy_tokens_equal_transformers(hf_model_dir):
    """Same logits as transformers' Mixtral on a prompt, and greedy tokens of two requests served
    together by the ServingEngine (prefill + cached decode) equal transformers' generate."""
    from jax_lora.serving import Request, ServingEngine
    hf, path = hf_model_dir
    model = load_mixtral(path)
    tokens = np.array([[3, 7, 11, 5, 9, 2]], np.int32)
    ours = np.asarray(model(tokens, np.arange(6, dtype=np.int32)[None])[0])
    with torch.no_grad():
        ref = hf(torch.tensor(tokens.astype(np.int64))).logits.numpy()
    np.testing.assert_allclose(ours, ref, atol=2e-5, rtol=0)
    prompts = [[3, 7, 11, 5], [1, 2, 3]]
    engine = ServingEngine(model, None, max_seqs=2, max_len=32)
    got = [c.tokens for c in engine.generate([Request(p, max_new_tokens=8) for p in prompts])]
    assert got == [hf_mixtral.hf_greedy(hf, p, 8) for p in prompts]


def test_qwen3_moe_logits_and_greedy_tokens_equal_transformers(tmp_path):
    """A Qwen3-MoE checkpoint (q/k norms, explicit head_dim, norm_topk_prob false) loads with
    load_mixtral: same logits and greedy tokens as transformers'."""
    from jax_lora.serving import Request, ServingEngine
    hf = hf_mixtral.tiny_qwen3_moe()
    hf.save_pretrained(str(tmp_path / "qwen"))
    model = load_mixtral(str(tmp_path / "qwen"))
    assert model.config.qk_norm and not model.config.norm_topk_prob and model.config.head_dim == 16
    tokens = np.array([[3, 7, 11, 5, 9, 2]], np.int32)
    ours = np.asarray(model(tokens, np.arange(6, dtype=np.int32)[None])[0])
    with torch.no_grad():
        ref = hf(torch.tensor(tokens.astype(np.int64))).logits.numpy()
    np.testing.assert_allclose(ours, ref, atol=2e-5, rtol=0)
    got = ServingEngine(model, None, max_seqs=1, max_len=32).generate([Request([3, 7, 11, 5], max_new_tokens=6)])
    assert got[0].tokens == hf_mixtral.hf_greedy(hf, [3, 7, 11, 5], 6)


def test_expert_layouts_load_the_same_model(hf_model_dir, tmp_path):
    """save_mixtral in the fused layout, and the per-expert gate_proj/up_proj/down_proj naming, load
    to the weights transformers' own per-expert w1/w2/w3 checkpoint gives."""
    from safetensors.numpy import load_file, save_file
    _, path = hf_model_dir
    model = load_mixtral(path)
    save_mixtral(model, str(tmp_path / "fused"), fused_experts=True)
    assert any(k.endswith("mlp.experts.gate_up_proj") for k in load_file(str(tmp_path / "fused/model.safetensors")))
    tensors = load_file(os.path.join(path, "model.safetensors"))
    renamed = {k.replace("block_sparse_moe", "mlp").replace(".w1.", ".gate_proj.").replace(".w3.", ".up_proj.")
               .replace(".w2.", ".down_proj."): v for k, v in tensors.items()}
    os.makedirs(tmp_path / "qwen_style")
    save_file(renamed, str(tmp_path / "qwen_style/model.safetensors"))
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    with open(tmp_path / "qwen_style/config.json", "w") as f:
        json.dump(config, f)
    want = _leaves(model)
    for other in ("fused", "qwen_style"):
        for a, b in zip(want, _leaves(load_mixtral(str(tmp_path / other)))):
            np.testing.assert_array_equal(a, b)


def _leaves(model):
    import jax
    from flax import nnx
    return [np.asarray(x) for x in jax.tree.leaves(nnx.state(model))]


def test_router_is_a_top_k_softmax():
    """route_top_k against float64: the k largest probabilities renormalised (norm_topk_prob) or not."""
    rng = np.random.default_rng(0)
    logits = rng.standard_normal((9, 6)).astype(np.float32) * 3
    p = np.exp(logits.astype(np.float64) - logits.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    ids = np.argsort(-p, axis=1, kind="stable")[:, :2]
    top = np.take_along_axis(p, ids, 1)
    for norm, want in ((True, top / top.sum(1, keepdims=True)), (False, top)):
        w, i = moe.route_top_k(logits, 2, norm)
        np.testing.assert_array_equal(np.asarray(i), ids)
        np.testing.assert_allclose(np.asarray(w), want, rtol=1e-6)


def test_config_refuses_what_the_model_cannot_serve():
    with pytest.raises(ValueError, match="num_experts_per_tok"):
        MixtralConfig(num_local_experts=2, num_experts_per_tok=3)
    with pytest.raises(NotImplementedError, match="sliding_window"):
        MixtralConfig.from_dict({"sliding_window": 4096})
    with pytest.raises(NotImplementedError, match="shared experts"):
        MixtralConfig.from_dict({"shared_expert_intermediate_size": 64})
    qwen = MixtralConfig.from_dict({"num_experts": 6, "moe_intermediate_size": 40, "norm_topk_prob": False,
                                    "hidden_size": 32, "num_attention_heads": 4})
    assert (qwen.num_local_experts, qwen.intermediate_size, qwen.norm_topk_prob) == (6, 40, False)
