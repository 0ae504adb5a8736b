"""Adapters saved by the peft library load into the Flax model and give peft's outputs.

A tiny transformers Llama (random weights, GQA) is saved in Hugging Face format and converted by
`load_llama`; adapters are made and saved by peft itself (r, lora_alpha, use_rslora, rank_pattern,
alpha_pattern, embed_tokens / lm_head targets). Mixed-adapter batches through the wrapper, and the
jit serving loop, must reproduce peft's logits on the torch model.

CPU; every test here is marked slow.
"""

import jax.numpy as jnp
import numpy as np
import pytest

from jax_lora import LoRAMapping, PunicaWrapper
from jax_lora import nn as lnn
from jax_lora.adapters import AdapterManager, load_peft_adapter, save_peft_adapter
from jax_lora.models import add_lora, load_llama
from jax_lora.serving import Request, ServingEngine

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

RTOL = 1e-4
VOCAB = 96
ADAPTERS = {
    1: {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"]},
    2: {"r": 8, "lora_alpha": 16, "use_rslora": True, "rank_pattern": {"down_proj": 2}, "alpha_pattern": {"o_proj": 4},
        "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]},
    3: {"r": 2, "lora_alpha": 4, "target_modules": ["embed_tokens", "lm_head", "up_proj"]},
}


def _rel(a, b):
    return float(np.abs(np.asarray(a) - np.asarray(b)).max() / max(1.0, np.abs(np.asarray(b)).max()))


def build_peft_models(root, adapters: dict, tweak=None, edit_base=None, **config) -> tuple:
    """A tiny Llama saved under root/"base" and one peft model per {lora_id: LoraConfig kwargs}
    (random A and B; `tweak(peft_model)` may edit it before saving), saved under root/adapter<id>.
    `config`: LlamaConfig fields over the tiny defaults (e.g. attention_bias=True); `edit_base(model)`
    may edit the base model before it is saved (e.g. non-zero biases).
    Returns (root, {id: directory}, {id: peft model, None: the base model})."""
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(**{**dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48,
                                             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                             max_position_embeddings=64, tie_word_embeddings=False), **config})
    base = transformers.LlamaForCausalLM(cfg).eval()
    if edit_base is not None:
        edit_base(base)
    base.save_pretrained(str(root / "base"), safe_serialization=True)

    def fresh():
        return transformers.LlamaForCausalLM.from_pretrained(str(root / "base")).eval()

    peft_models, dirs = {}, {}
    for lora_id, kw in adapters.items():
        torch.manual_seed(lora_id)
        pm = peft.get_peft_model(fresh(), peft.LoraConfig(init_lora_weights=False, **kw)).eval()
        if tweak is not None:
            tweak(pm)
        dirs[lora_id] = str(root / f"adapter{lora_id}")
        pm.save_pretrained(dirs[lora_id])
        peft_models[lora_id] = pm
    peft_models[None] = fresh()
    return root, dirs, peft_models


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    return build_peft_models(tmp_path_factory.mktemp("peft"), ADAPTERS)


def _torch_logits(model, tokens):
    with torch.no_grad():
        return model(torch.as_tensor(np.asarray(tokens), dtype=torch.long)).logits.numpy()


def _ours(root, dirs):
    model = load_llama(str(root / "base"))
    add_lora(model, max_loras=4, max_rank=8)
    mgr = AdapterManager(model)
    for lora_id, d in dirs.items():
        mgr.register(lora_id, d)
    mgr.activate(list(dirs))
    return model, mgr


def test_peft_config_fields_are_read(hf):
    _, dirs, _ = hf
    a2 = load_peft_adapter(dirs[2])
    assert a2.r == 8 and a2.use_rslora
    a, _, s, _ = a2.modules["model.layers.0.mlp.down_proj"]
    assert a.shape[0] == 2 and s == pytest.approx(16 / np.sqrt(2))          # rank_pattern, rslora
    assert a2.modules["model.layers.1.self_attn.o_proj"][2] == pytest.approx(4 / np.sqrt(8))  # alpha_pattern
    a3 = load_peft_adapter(dirs[3])
    assert a3.modules["model.embed_tokens"][3] == "embedding" and "lm_head" in a3.modules


def check_mixed_batch_equals_peft(model, mgr, peft_models, rows, seq_len: int, max_loras: int, backend=None):
    """One prefill of `rows` (a lora_id or None per row, seq_len random tokens each) through our
    model under a wrapper: each row's logits equal peft's model of that row's adapter (RTOL), and
    each adapter's effect on peft's logits is real."""
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, VOCAB, size=(len(rows), seq_len))
    ids = np.repeat([r or 0 for r in rows], tokens.shape[1])
    w = PunicaWrapper(64, 64, None, max_loras=max_loras, backend=backend)
    # Every position's logits are computed, so every token is also a sampled row.
    w.update_metadata(LoRAMapping(ids, ids, is_prefill=True), mgr.lora_index_to_id, max_loras + 1, VOCAB)
    pos = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
    with lnn.punica_context(w):
        ours = np.asarray(model(jnp.asarray(tokens, jnp.int32), pos)[0])
    base = _torch_logits(peft_models[None], tokens)
    for b, lora_id in enumerate(rows):
        ref = _torch_logits(peft_models[lora_id], tokens[b:b + 1])[0]
        assert _rel(ours[b], ref) < RTOL, (lora_id, _rel(ours[b], ref))
        if lora_id is not None:
            assert _rel(ref, base[b]) > 1e-3                                 # the adapter matters


def test_mixed_batch_equals_peft(hf):
    root, dirs, peft_models = hf
    model, mgr = _ours(root, dirs)
    check_mixed_batch_equals_peft(model, mgr, peft_models, [1, 2, 3, None, 2], 7, 4)


def test_serving_loop_equals_peft(hf):
    root, dirs, peft_models = hf
    model, mgr = _ours(root, dirs)
    engine = ServingEngine(model, mgr, max_seqs=4, max_len=32, keep_logits=True)
    rng = np.random.default_rng(1)
    reqs = [Request([int(t) for t in rng.integers(0, VOCAB, size=int(rng.integers(3, 10)))], lora_id=i,
                    max_new_tokens=5) for i in [1, 2, 3, None, 3, 1]]
    for req, c in zip(reqs, engine.generate(reqs)):
        seq = np.array([list(req.prompt) + c.tokens[:-1]])
        ref = _torch_logits(peft_models[req.lora_id], seq)[0, len(req.prompt) - 1:]
        assert _rel(c.logits, ref) < RTOL
        assert list(ref.argmax(-1)) == c.tokens


def test_our_writer_is_loadable_by_peft(hf, tmp_path):
    """save_peft_adapter (used by the demo) writes directories that peft itself loads."""
    root, _, _ = hf
    rng = np.random.default_rng(2)
    mods = {"model.embed_tokens": (rng.normal(size=(3, VOCAB)), rng.normal(size=(32, 3)))}
    for i in range(2):   # peft targets a name in every layer: give every layer weights
        mods[f"model.layers.{i}.self_attn.q_proj"] = (rng.normal(size=(3, 32)), rng.normal(size=(32, 3)))
        mods[f"model.layers.{i}.mlp.gate_proj"] = (rng.normal(size=(3, 32)), rng.normal(size=(48, 3)))
    save_peft_adapter(str(tmp_path / "ours"), mods, r=3, lora_alpha=6.0)
    base = transformers.LlamaForCausalLM.from_pretrained(str(root / "base")).eval()
    pm = peft.PeftModel.from_pretrained(base, str(tmp_path / "ours")).eval()
    model, mgr = _ours(root, {7: str(tmp_path / "ours")})
    tokens = rng.integers(0, VOCAB, size=(1, 6))
    w = PunicaWrapper(16, 16, None, max_loras=4)
    w.update_metadata(LoRAMapping([7] * 6, [7] * 6), mgr.lora_index_to_id, 5, VOCAB)
    with lnn.punica_context(w):
        ours = np.asarray(model(jnp.asarray(tokens, jnp.int32), jnp.arange(6)[None])[0])
    assert _rel(ours, _torch_logits(pm, tokens)) < RTOL


def test_tied_embeddings_and_biases(tmp_path):
    """A tied-embedding Llama with attention and MLP biases converts exactly; LoRA on embed_tokens."""
    torch.manual_seed(4)
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=40, num_hidden_layers=1,
                                   num_attention_heads=2, num_key_value_heads=1, head_dim=24,
                                   tie_word_embeddings=True, attention_bias=True, mlp_bias=True)
    hf_model = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in hf_model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    hf_model.save_pretrained(str(tmp_path / "base"), safe_serialization=True)
    pm = peft.get_peft_model(hf_model, peft.LoraConfig(r=2, lora_alpha=3, init_lora_weights=False,
                                                       target_modules=["embed_tokens", "q_proj", "up_proj"])).eval()
    pm.save_pretrained(str(tmp_path / "adapter"))
    model = load_llama(str(tmp_path / "base"))
    assert model.lm_head is None and model.config.head_dim == 24
    add_lora(model, max_loras=2, max_rank=2, target_modules=["embed_tokens", "q_proj", "up_proj"])
    mgr = AdapterManager(model)
    mgr.load(1, str(tmp_path / "adapter"))
    tokens = np.random.default_rng(3).integers(0, VOCAB, size=(2, 5))
    w = PunicaWrapper(16, 16, None, max_loras=2)
    ids = [1] * 5 + [0] * 5
    w.update_metadata(LoRAMapping(ids, ids), mgr.lora_index_to_id, 3, VOCAB)
    with lnn.punica_context(w):
        ours = np.asarray(model(jnp.asarray(tokens, jnp.int32), jnp.broadcast_to(jnp.arange(5), (2, 5)))[0])
    assert _rel(ours[0], _torch_logits(pm, tokens[:1])[0]) < RTOL
    with pm.disable_adapter():
        assert _rel(ours[1], _torch_logits(pm, tokens[1:])[0]) < RTOL
