"""torch_lora.hf.MultiLoRAModel's API on a tiny random Llama, against peft itself (float32, CPU,
torch backend).

A mixed batch (one adapter per row, "__base__" rows) and `generate` equal peft per request; a padded
mixed batch equals peft's own mixed batch; q/k/v and gate/up run as one call per group; inference
mode, `logits_to_keep`, `generate(inputs=)`; direct calls of another shape, unknown adapter names and
wrong row counts refused; hot swap and unload keep the other adapters; target modules matching
nothing raise; wrapping keeps the model and `unwrap` restores it; a model wrapped inside inference
mode serves outside it. The model and adapters are tests/hf_llama.py's; other model families:
tests/test_torch_hf.py.
"""

from __future__ import annotations

import pytest
import torch

import torch_lora

from . import hf_llama, torch_helpers


@pytest.fixture(scope="module")
def llama_assets(tmp_path_factory):
    """A tiny random transformers Llama and three peft adapters (tests/hf_llama.py): (fresh, dirs)."""
    return hf_llama.write_assets(tmp_path_factory.mktemp("hf_llama"))


@pytest.fixture(scope="module")
def served(llama_assets):
    """One MultiLoRAModel (torch backend) with the three adapters, and peft with the same three."""
    from torch_lora.hf import MultiLoRAModel
    fresh, dirs = llama_assets
    mm = MultiLoRAModel(fresh(), max_loras=4, max_rank=8, target_modules=hf_llama.ALL7 + ["embed_tokens", "lm_head"],
                        backend="torch")
    adapters = {n: d for n, d in dirs.items() if not n.startswith("_")}
    for n, d in adapters.items():
        mm.load_adapter(n, d)
    return mm, hf_llama.peft_model(fresh, adapters)


def test_mixed_batch_equals_peft_per_row(served):
    """Tests: one mixed batch (one adapter per row, '__base__' rows) equals peft
    running each row with its adapter alone: fp32 logits within 1e-4 relative, same greedy tokens;
    regex target_modules, rank/alpha patterns, rsLoRA, embed_tokens and lm_head LoRA."""
    mm, pm = served
    names = ["sql", "__base__", "chat", "code", "chat"]
    ids = torch.tensor(torch_helpers.rng(20).integers(1, 64, size=(5, 6)))
    out = mm(ids, adapter_names=names)
    for j, n in enumerate(names):
        ref = hf_llama.peft_logits(pm, ids[j:j + 1], n)[0]
        got = out.logits[j]
        assert float((got - ref).abs().max() / ref.abs().max()) < 1e-4, n
        assert torch.equal(got.argmax(-1), ref.argmax(-1)), n
    base = hf_llama.peft_logits(pm, ids[:1], "__base__")[0]
    for j, n in enumerate(names):
        if n != "__base__":
            assert float((out.logits[j] - hf_llama.peft_logits(pm, ids[j:j + 1], "__base__")[0]).abs().max()) > 1e-3, n
    assert base.shape == out.logits[0].shape


def test_mixed_batch_with_padding_equals_peft_mixed_batch(served):
    """A drop-in for peft's `model(input_ids, adapter_names=[...])`): a left-padded mixed
    batch with an attention mask gives peft's own mixed-batch logits (fp32, 1e-4)."""
    mm, pm = served
    ids = torch.tensor(torch_helpers.rng(29).integers(1, 64, size=(3, 6)))
    mask = torch.ones_like(ids)
    mask[0, :2] = 0
    mask[2, :1] = 0
    names = ["chat", "__base__", "code"]
    got = mm(ids, attention_mask=mask, adapter_names=names).logits
    with torch.no_grad():
        ref = pm(input_ids=ids, attention_mask=mask, adapter_names=names).logits
    assert float((got - ref).abs().max() / ref.abs().max()) < 1e-4


def test_generate_mixed_adapters_equals_peft_per_request(served):
    """generate(input_ids, adapter_names=...) keeps each row's adapter for the whole
    generation; greedy tokens equal peft's generate for each request alone."""
    mm, pm = served
    names = ["code", "__base__", "sql"]
    ids = torch.tensor(torch_helpers.rng(21).integers(1, 64, size=(3, 5)))
    seqs = mm.generate(ids, attention_mask=torch.ones_like(ids), adapter_names=names, max_new_tokens=4,
                       do_sample=False, pad_token_id=0)
    for j, n in enumerate(names):
        with torch.no_grad():
            if n == "__base__":
                with pm.disable_adapter():
                    ref = pm.generate(input_ids=ids[j:j + 1], attention_mask=torch.ones_like(ids[j:j + 1]),
                                      max_new_tokens=4, do_sample=False, pad_token_id=0)
            else:
                pm.set_adapter(n)
                ref = pm.generate(input_ids=ids[j:j + 1], attention_mask=torch.ones_like(ids[j:j + 1]),
                                  max_new_tokens=4, do_sample=False, pad_token_id=0)
        assert seqs[j].tolist() == ref[0].tolist(), n


def test_groups_are_one_call_and_named_by_members(served):
    """docs/torch.md (q/k/v and gate/up fused into one multi-slice call): the group
    layers are named parent + members joined by '+', and a decoder layer costs four add_lora_linear
    calls (q/k/v, o, gate/up, down) under no_grad."""
    mm, _ = served
    assert "model.layers.0.self_attn.q_proj+k_proj+v_proj" in mm.layers
    assert "model.layers.1.mlp.gate_proj+up_proj" in mm.layers
    calls = []
    original = mm.punica.add_lora_linear

    def counting(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)
    mm.punica.add_lora_linear = counting
    try:
        mm(torch.ones(2, 3, dtype=torch.long), adapter_names=["chat", "sql"])
    finally:
        del mm.punica.add_lora_linear
    assert len(calls) == 4 * 2


def test_inference_mode_gives_the_no_grad_result(served):
    """Under torch.inference_mode() the grouped q/k/v and
    gate/up layers work and give the same logits as under no_grad."""
    mm, _ = served
    ids = torch.tensor(torch_helpers.rng(22).integers(1, 64, size=(3, 4)))
    names = ["chat", "sql", "__base__"]
    want = mm(ids, adapter_names=names).logits
    with torch.inference_mode():
        got = mm(ids, adapter_names=names).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_logits_to_keep_and_generate_inputs_keyword(served):
    """docs/torch.md (lm_head LoRA follows logits_to_keep row by row: an int or a 1-D tensor), and
    generate(inputs=...) (it used to raise): logits_to_keep=1 / [1, 3] equal those rows of the full
    logits; generate(inputs=ids) equals generate(ids)."""
    mm, _ = served
    ids = torch.tensor(torch_helpers.rng(23).integers(1, 64, size=(2, 5)))
    names = ["code", "chat"]
    full = mm(ids, adapter_names=names).logits
    last = mm(ids, adapter_names=names, logits_to_keep=1).logits
    torch.testing.assert_close(last[:, -1], full[:, -1], rtol=1e-5, atol=1e-5)
    picked = mm(ids, adapter_names=names, logits_to_keep=torch.tensor([1, 3])).logits
    torch.testing.assert_close(picked, full[:, [1, 3]], rtol=1e-5, atol=1e-5)
    kw = dict(adapter_names=["code", "sql"], max_new_tokens=2, do_sample=False, pad_token_id=0,
              attention_mask=torch.ones_like(ids))
    assert torch.equal(mm.generate(inputs=ids, **kw), mm.generate(ids, **kw))


def test_direct_model_call_with_another_shape_is_refused(served):
    """docs/torch.md ('A step'): a layer refuses an input whose token count differs from the prepared
    one, so a direct model call cannot silently use another batch's mapping."""
    mm, _ = served
    mm.prepare_step(["chat", "sql"], 3)
    with torch.no_grad(), pytest.raises(ValueError, match="prepare_step"):
        mm.model(input_ids=torch.ones(2, 5, dtype=torch.long))


def test_unknown_adapter_name_and_wrong_row_count_are_clear(served):
    """PEFT's convention of one adapter name per row: an unknown name or a name list of the wrong
    length raises a ValueError naming the problem."""
    mm, _ = served
    ids = torch.ones(2, 3, dtype=torch.long)
    with pytest.raises(ValueError, match="nope"):
        mm(ids, adapter_names=["chat", "nope"])
    with pytest.raises(ValueError, match="adapter_names"):
        mm(ids, adapter_names=["chat"])


def test_hot_swap_unload_and_refusals_keep_loaded_adapters(llama_assets, tmp_path):
    """docs/torch.md: load_adapter of a loaded name hot-swaps it (same slot, new
    outputs); an adapter targeting a module outside target_modules is refused naming the module
    and target_modules; a rank above max_rank is refused; nothing changes on failure;
    unload_adapter forgets the name."""
    from torch_lora.hf import MultiLoRAModel
    fresh, dirs = llama_assets
    mm = MultiLoRAModel(fresh(), max_loras=2, max_rank=4, target_modules=["q_proj", "v_proj"], backend="torch")
    mm.load_adapter("a", dirs["sql"])
    ids = torch.tensor(torch_helpers.rng(24).integers(1, 64, size=(1, 5)))
    before = mm(ids, adapter_names=["a"]).logits
    slot = mm.adapters.slot_of(1)
    with pytest.raises(torch_lora.AdapterError, match="o_proj|embed_tokens|lm_head") as info:
        mm.load_adapter("b", dirs["code"])           # targets o_proj, embed_tokens, lm_head
    assert "target_modules" in str(info.value)
    with pytest.raises(torch_lora.AdapterError, match="max_rank"):
        mm.load_adapter("a", hf_llama.save_peft(fresh, tmp_path / "big", 4, r=8, lora_alpha=8,
                                                target_modules=["q_proj"]))
    assert mm.loaded_adapters == ["a"]
    torch.testing.assert_close(mm(ids, adapter_names=["a"]).logits, before, rtol=0, atol=0)
    other = hf_llama.save_peft(fresh, tmp_path / "sql2", 9, r=4, lora_alpha=8, target_modules=["q_proj"])
    mm.load_adapter("a", other)
    assert mm.adapters.slot_of(1) == slot
    swapped = mm(ids, adapter_names=["a"]).logits
    assert float((swapped - before).abs().max()) > 1e-4
    pm = hf_llama.peft_model(fresh, {"a": other})
    ref = hf_llama.peft_logits(pm, ids, "a")
    assert float((swapped - ref).abs().max() / ref.abs().max()) < 1e-4
    mm.unload_adapter("a")
    assert mm.loaded_adapters == []
    with pytest.raises(ValueError, match="'a'"):
        mm(ids, adapter_names=["a"])


def test_target_modules_that_match_nothing_raise(llama_assets):
    """docs/torch.md ('What gets LoRA'): a target name matching nothing raises (a typo never yields
    a model without adapters)."""
    from torch_lora.hf import MultiLoRAModel
    fresh, _ = llama_assets
    with pytest.raises(ValueError, match="q_prj"):
        MultiLoRAModel(fresh(), max_loras=2, max_rank=4, target_modules=["q_prj"], backend="torch")
    with pytest.raises(ValueError, match="q_prj"):
        MultiLoRAModel(fresh(), max_loras=2, max_rank=4, target_modules=["q_proj", "q_prj"], backend="torch")


def test_wrapping_keeps_the_model_and_unwrap_restores_it(llama_assets):
    """docs/torch.md ('How it is wrapped'): no module is replaced -- class, state_dict keys and
    parameters stay; unwrap() removes the hooks (base outputs again) and the model can be wrapped
    again; a model wrapped twice is refused."""
    from torch_lora.hf import MultiLoRAModel
    fresh, dirs = llama_assets
    model = fresh()
    keys = list(model.state_dict())
    ids = torch.tensor(torch_helpers.rng(25).integers(1, 64, size=(1, 4)))
    with torch.no_grad():
        base = model(ids).logits
    mm = MultiLoRAModel(model, max_loras=2, max_rank=8, backend="torch")
    assert type(mm.model).__name__ == "LlamaForCausalLM" and list(model.state_dict()) == keys
    with pytest.raises(ValueError, match="unwrap"):
        MultiLoRAModel(model, max_loras=2, max_rank=8, backend="torch")
    mm.load_adapter("chat", dirs["chat"])
    assert float((mm(ids, adapter_names=["chat"]).logits - base).abs().max()) > 1e-4
    assert mm.unwrap() is model
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, base, rtol=0, atol=0)
    MultiLoRAModel(model, max_loras=2, max_rank=8, backend="torch").unwrap()


def test_wrapped_inside_inference_mode_loads_and_serves_outside(llama_assets):
    """A model wrapped inside torch.inference_mode() can load adapters outside it."""
    from torch_lora.hf import MultiLoRAModel
    fresh, dirs = llama_assets
    with torch.inference_mode():
        mm = MultiLoRAModel(fresh(), max_loras=2, max_rank=8, backend="torch")
    mm.load_adapter("chat", dirs["chat"])
    ids = torch.tensor(torch_helpers.rng(26).integers(1, 64, size=(1, 4)))
    ref = hf_llama.peft_logits(hf_llama.peft_model(fresh, {"chat": dirs["chat"]}), ids, "chat")
    got = mm(ids, adapter_names=["chat"]).logits
    assert float((got - ref).abs().max() / ref.abs().max()) < 1e-4
