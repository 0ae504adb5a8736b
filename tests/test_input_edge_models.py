"""Valid but unusual inputs to the product layer (torch_lora.hf, jax_lora.models), each checked
against the ground truth of the rest of the suite: peft per request for torch, the model's own
loading rules for JAX.

CPU.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("peft")

from tests.test_torch_hf import VOCAB, Family, _rel  # noqa: E402

RTOL = 1e-4


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return Family(tmp_path_factory.mktemp("edges-llama"), "llama")


# ----------------------------------------------------------------------------- torch.inference_mode()

def test_grouped_layers_serve_under_inference_mode(llama):
    """q/k/v and gate/up groups under torch.inference_mode() (which the layers' own error message
    recommends): the forward pass and generate() equal peft per request. The group's reuse check
    read the input's version counter, which inference tensors do not have (RuntimeError)."""
    mm = llama.wrapped()
    rows = ["a", "b", "__base__", "d"]
    tokens = torch.as_tensor(np.random.default_rng(11).integers(1, VOCAB, size=(len(rows), 5)))
    with torch.inference_mode():
        out = mm(tokens, adapter_names=rows).logits.numpy()
        gen = mm.generate(tokens, adapter_names=rows, max_new_tokens=3, min_new_tokens=3, do_sample=False,
                          pad_token_id=0, output_logits=True, return_dict_in_generate=True)
    for j, adapter in enumerate(rows):
        assert _rel(out[j], llama.alone(adapter, tokens[j])) < RTOL, (j, adapter)
        with torch.no_grad():
            ref = llama.peft[adapter].generate(tokens[j:j + 1], max_new_tokens=3, min_new_tokens=3, do_sample=False,
                                               pad_token_id=0)
        assert gen.sequences[j].tolist() == ref[0].tolist(), (j, adapter)


def test_a_model_wrapped_under_inference_mode_loads_adapters_outside_it(llama):
    """Built inside torch.inference_mode(), the slots and the wrapper's metadata were inference
    tensors: the first slot write outside it raised 'Inplace update to inference tensor'."""
    with torch.inference_mode():
        mm = llama.wrapped(adapters=("a",), max_loras=2)
    tokens = torch.as_tensor(np.random.default_rng(12).integers(1, VOCAB, size=(3, 5)))
    mm.load_adapter("b", llama.dirs["b"])
    mm.load_adapter("d", llama.dirs["d"])
    rows = ["a", "b", "__base__"]
    out = mm(tokens, adapter_names=rows).logits.numpy()
    out2 = mm(tokens, adapter_names=["d", "b", "d"]).logits.numpy()                 # evicts a
    for j, adapter in enumerate(rows):
        assert _rel(out[j], llama.alone(adapter, tokens[j])) < RTOL, (j, adapter)
    assert _rel(out2[0], llama.alone("d", tokens[0])) < RTOL


# ----------------------------------------------------------------------------- jax_lora.models.add_lora

def test_add_lora_target_modules_as_a_string_or_an_iterator(tmp_path):
    """A string was iterated character by character ("target_modules ['q', '_', 'p', ...] are not
    LoRA-targetable"); an iterator was consumed by the name check and then matched nothing."""
    pytest.importorskip("jax")
    from jax_lora.cli import build_demo_assets
    from jax_lora.models import add_lora, load_llama

    model_dir, _ = build_demo_assets(str(tmp_path), seed=0)
    with pytest.raises(TypeError, match=r"target_modules must be a list of module names from .*'q_proj'.*got str "
                                        r"'q_proj'"):
        add_lora(load_llama(model_dir), max_loras=2, max_rank=2, target_modules="q_proj")
    layers = add_lora(load_llama(model_dir), max_loras=2, max_rank=2, target_modules=(t for t in ("v_proj", "o_proj")))
    assert sorted(layers) == [f"model.layers.{i}.self_attn.{p}" for i in range(2) for p in ("o_proj", "qkv_proj")]


# ----------------------------------------------------------------------------- generate(inputs=...)

def test_generate_takes_the_prompt_as_inputs(llama):
    """Transformers' generate names its prompt `inputs`; MultiLoRAModel.generate passed its own
    input_ids (None) positionally next to it: TypeError 'got multiple values for argument inputs'."""
    mm = llama.wrapped()
    rows = ["b", "__base__", "c"]
    tokens = torch.as_tensor(np.random.default_rng(13).integers(1, VOCAB, size=(len(rows), 4)))
    gen = dict(max_new_tokens=3, min_new_tokens=3, do_sample=False, pad_token_id=0)
    out = mm.generate(inputs=tokens, adapter_names=rows, **gen)
    for j, adapter in enumerate(rows):
        with torch.no_grad():
            ref = llama.peft[adapter].generate(tokens[j:j + 1], **gen)
        assert out[j].tolist() == ref[0].tolist(), (j, adapter)
    with pytest.raises(ValueError, match="adapter_names has 2 names, but the batch has 3 prompts"):
        mm.generate(inputs=tokens, adapter_names=rows[:2], **gen)
    with pytest.raises(ValueError, match="the prompt twice, as input_ids and as inputs"):
        mm.generate(tokens, inputs=tokens, adapter_names=rows, **gen)


# ----------------------------------------------------------------------------- embedding rows and the step's vocabulary

def test_lora_embedding_refuses_a_step_prepared_for_another_vocabulary():
    """The LoRA embedding reads row `slot * V + id` of its (L * V, r) table, with the step's
    embeddings_indices[1] = slot * (vocab_size + extra_vocab_size): a step prepared with another
    vocabulary would read other slots' rows in silence. Both sides refuse it naming vocab_size, and
    a step prepared with the layer's V gives the oracle's rows."""
    jax = pytest.importorskip("jax")
    jnp = jax.numpy
    from flax import nnx

    import jax_lora
    import torch_lora
    from jax_lora.nn import MultiLoRAEmbed
    from torch_lora.layers import LoRAEmbedding

    V, D, L, R = 16, 8, 2, 4
    ids = np.array([3, 5, 7, 9], np.int32)
    lora_ids = (1, 2, 0, 2)
    rng = np.random.default_rng(0)
    a = rng.standard_normal((L, V, R)).astype(np.float32)           # row per token id, per slot
    b = rng.standard_normal((L, D, R)).astype(np.float32)
    want = np.zeros((len(ids), D), np.float32)
    for t, lid in enumerate(lora_ids):
        if lid:
            want[t] = a[lid - 1, ids[t]] @ b[lid - 1].T

    jw = jax_lora.PunicaWrapper(8, 2, max_loras=L, backend="xla")
    embed = nnx.Embed(V, D, rngs=nnx.Rngs(0))
    layer = MultiLoRAEmbed(embed, max_loras=L, max_rank=R)
    layer.lora_a.set_value(jnp.asarray(a))
    layer.lora_b.set_value(jnp.asarray(b))
    layer.lora_ranks.set_value(jnp.full((L,), R, jnp.int32))
    base = np.asarray(embed(jnp.asarray(ids)))
    mapping = jax_lora.LoRAMapping(lora_ids, lora_ids)
    for vocab, extra in ((V + 4, 0), (V, 2)):
        jw.update_metadata(mapping, [1, 2], L, vocab, extra)
        with pytest.raises(ValueError, match=f"vocab_size={V}"):
            layer(jnp.asarray(ids), jw)
    jw.update_metadata(mapping, [1, 2], L, V)
    np.testing.assert_allclose(np.asarray(layer(jnp.asarray(ids), jw)) - base, want, rtol=1e-5, atol=1e-5)

    tw = torch_lora.PunicaWrapper(8, 2, "cpu", max_loras=L, backend="torch")
    tl = LoRAEmbedding("embed_tokens", V, D, max_loras=L, max_rank=R, dtype=torch.float32, device="cpu", punica=tw)
    tl.lora_a.copy_(torch.from_numpy(a))
    tl.lora_b.copy_(torch.from_numpy(b))
    tl.lora_ranks.fill_(R)
    tmapping = torch_lora.LoRAMapping(lora_ids, lora_ids)
    for vocab, extra in ((V + 4, 0), (V, 2)):
        tw.update_metadata(tmapping, [1, 2], L, vocab, extra)
        with pytest.raises(ValueError, match=f"vocab_size={V}"):
            tl.apply(torch.from_numpy(ids), torch.zeros(len(ids), D))
    tw.update_metadata(tmapping, [1, 2], L, V)
    out = tl.apply(torch.from_numpy(ids), torch.zeros(len(ids), D))
    np.testing.assert_allclose(out.numpy(), want, rtol=1e-5, atol=1e-5)
