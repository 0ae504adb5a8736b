"""torch_lora.hf.MultiLoRAModel against PEFT itself, on tiny random models of every supported family.

Adapters are made and saved by peft (r, lora_alpha, use_rslora, rank_pattern, alpha_pattern,
layers_to_transform, embed_tokens / lm_head targets, adapters on only some modules); a mixed batch
through MultiLoRAModel must give, row by row, the logits of peft running that row's request alone
with that adapter (relative error < 1e-4 in float32) and the same greedy tokens, in a forward pass
and through generate(). Bad adapter files fail with clear errors and lose nothing.

Also Qwen2 and Gemma adapters on some layers only (layers_to_transform). CPU, float32; the
CUDA counterpart is tests/test_gpu_torch_hf.py.
"""

from __future__ import annotations

import os
import pathlib
import shutil

import numpy as np
import pytest

from . import hf_llama

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from torch_lora import AdapterError  # noqa: E402
from torch_lora.hf import MultiLoRAModel, select_target_modules  # noqa: E402

from . import torch_helpers  # noqa: E402

RTOL = 1e-4
VOCAB = 128
LINEAR = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
ALL = LINEAR + ["embed_tokens", "lm_head"]
COMMON = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0)
FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {"tie_word_embeddings": False}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {"tie_word_embeddings": False}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {"tie_word_embeddings": False}),   # q/k/v with bias
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 8, "tie_word_embeddings": False}),
    "gemma": ("GemmaConfig", "GemmaForCausalLM", {"head_dim": 8}),                   # tied, scaled embedding
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", {"head_dim": 8}),                # + logit softcapping
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", {"head_dim": 8}),
}
ADAPTERS = {
    "a": {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"]},
    "b": {"r": 8, "lora_alpha": 16, "use_rslora": True, "rank_pattern": {"down_proj": 2, "k_proj": 3},
          "alpha_pattern": {"o_proj": 4}, "target_modules": LINEAR},
    "c": {"r": 2, "lora_alpha": 4, "target_modules": ["embed_tokens", "lm_head", "up_proj"]},
    "d": {"r": 6, "lora_alpha": 3, "target_modules": ["k_proj", "gate_proj"], "layers_to_transform": [1]},
}


def _rel(got, want) -> float:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.abs(got - want).max() / max(1.0, np.abs(want).max()))


def _greedy_equal(got, want, rtol=RTOL) -> bool:
    """Argmax equal at every position whose top two logits are apart by more than the tolerance."""
    got, want = np.asarray(got), np.asarray(want)
    top2 = np.sort(want, axis=-1)[..., -2:]
    clear = (top2[..., 1] - top2[..., 0]) > 10 * rtol * max(1.0, np.abs(want).max())
    return bool(np.all((got.argmax(-1) == want.argmax(-1)) | ~clear))


class Family:
    """A tiny random model of one family saved in HF format, its PEFT adapters and peft's models."""

    def __init__(self, root, name):
        cfg_name, model_name, extra = FAMILIES[name]
        self.name = name
        self.model_cls = getattr(transformers, model_name)
        torch.manual_seed(0)
        self.config = getattr(transformers, cfg_name)(**COMMON, **extra)
        self.base_dir = str(root / "base")
        self.model_cls(self.config).eval().save_pretrained(self.base_dir)
        self.dirs, self.peft = {}, {}
        for i, (adapter, kw) in enumerate(ADAPTERS.items()):
            torch.manual_seed(100 + i)
            pm = peft.get_peft_model(self.fresh(), peft.LoraConfig(init_lora_weights=False, **kw)).eval()
            self.dirs[adapter] = str(root / adapter)
            pm.save_pretrained(self.dirs[adapter])
            self.peft[adapter] = pm
        self.peft["__base__"] = self.fresh()

    def fresh(self):
        return self.model_cls.from_pretrained(self.base_dir).eval()

    def wrapped(self, adapters=tuple(ADAPTERS), **kw):
        kw = {"max_loras": 4, "max_rank": 8, "target_modules": ALL, **kw}
        mm = MultiLoRAModel(self.fresh(), **kw)
        for a in adapters:
            mm.load_adapter(a, self.dirs[a])
        return mm

    def alone(self, adapter, tokens, **kw):
        """peft's logits for one request (1-D tokens) with its adapter (or the base model)."""
        with torch.no_grad():
            return self.peft[adapter](torch.as_tensor(tokens)[None], **kw).logits[0].numpy()


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory):
    return Family(tmp_path_factory.mktemp(request.param), request.param)


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return Family(tmp_path_factory.mktemp("llama-only"), "llama")


# ----------------------------------------------------------------------------- PEFT parity, every family

def test_mixed_batch_equals_peft_per_request(family):
    mm = family.wrapped()
    rows = ["a", "b", "__base__", "c", "d", "b", "a"]
    tokens = torch.as_tensor(np.random.default_rng(1).integers(1, VOCAB, size=(len(rows), 6)))
    out = mm(tokens, adapter_names=rows).logits.numpy()
    for j, adapter in enumerate(rows):
        want = family.alone(adapter, tokens[j])
        assert _rel(out[j], want) < RTOL, (family.name, j, adapter, _rel(out[j], want))
        assert _greedy_equal(out[j], want), (family.name, j, adapter)
        if adapter != "__base__":                                    # the adapter matters
            assert _rel(want, family.alone("__base__", tokens[j])) > 1e-3, adapter


def test_generate_with_mixed_adapters_equals_peft_per_request(family):
    """Prompts of different lengths, left-padded in one batch; each row's greedy continuation and
    its logits at every step equal peft's generate on that prompt alone."""
    mm = family.wrapped()
    rows = ["c", "a", "__base__", "b", "d"]
    rng = np.random.default_rng(2)
    prompts = [rng.integers(1, VOCAB, size=n) for n in (5, 3, 7, 4, 6)]
    width = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros(len(prompts), width, dtype=torch.long)
    for j, p in enumerate(prompts):
        ids[j, width - len(p):] = torch.as_tensor(p)
        mask[j, width - len(p):] = 1
    new = 6
    gen = dict(max_new_tokens=new, min_new_tokens=new, do_sample=False, output_logits=True,
               return_dict_in_generate=True, pad_token_id=0)
    out = mm.generate(ids, attention_mask=mask, adapter_names=rows, **gen)
    logits = torch.stack(out.logits, dim=1).numpy()                   # (rows, new, vocab)
    for j, (adapter, p) in enumerate(zip(rows, prompts)):
        with torch.no_grad():
            ref = family.peft[adapter].generate(input_ids=torch.as_tensor(p)[None], **gen)
        assert out.sequences[j, width:].tolist() == ref.sequences[0, len(p):].tolist(), (family.name, j, adapter)
        want = torch.stack(ref.logits, dim=1)[0].numpy()
        assert _rel(logits[j], want) < RTOL, (family.name, j, adapter, _rel(logits[j], want))


# ----------------------------------------------------------------------------- the wrapping

def test_default_targets_and_one_call_per_group(llama):
    """Default targets: every decoder linear, not the LM head. q/k/v and gate/up each run as ONE
    add_lora_linear call; o_proj and down_proj one each: 4 calls per decoder layer."""
    mm = MultiLoRAModel(llama.fresh(), max_loras=2, max_rank=8)
    assert sorted(mm.layers) == sorted(f"model.layers.{i}.{p}" for i in range(2) for p in (
        "self_attn.q_proj+k_proj+v_proj", "self_attn.o_proj", "mlp.gate_proj+up_proj", "mlp.down_proj"))
    qkv = mm.layers["model.layers.0.self_attn.q_proj+k_proj+v_proj"]
    assert qkv.output_slices == (32, 16, 16) and qkv.module_names[1] == "model.layers.0.self_attn.k_proj"
    calls = []
    real = mm.punica.add_lora_linear
    mm.punica.add_lora_linear = lambda *a, **k: calls.append(a[0].shape) or real(*a, **k)
    mm.load_adapter("b", llama.dirs["b"])
    tokens = torch.randint(1, VOCAB, (3, 5))
    out = mm(tokens, adapter_names=["b", "__base__", "b"]).logits
    assert len(calls) == 8
    assert _rel(out[0].numpy(), llama.alone("b", tokens[0])) < RTOL
    with pytest.raises(AdapterError, match=r"targets 'lm_head', which is not a LoRA module.*add it to the model's "
                                           r"target_modules"):
        mm.load_adapter("c", llama.dirs["c"])
    assert mm.loaded_adapters == ["b"]


def test_target_module_selection_errors(llama):
    model = llama.fresh()
    with pytest.raises(ValueError, match=r"target_modules=\['q_prj'\] matches no nn.Linear"):
        select_target_modules(model, ["q_prj"])
    with pytest.raises(TypeError, match=r"matches 'model.layers.0.mlp', a LlamaMLP; only nn.Linear and nn.Embedding"):
        select_target_modules(model, r"model\.layers\.0\.mlp")
    with pytest.raises(TypeError, match="target_modules must be None, 'all-linear', a list"):
        select_target_modules(model, 3)
    with pytest.raises(ValueError, match=r"\['qproj_typo'\] match no nn.Linear"):   # a typo among valid names
        select_target_modules(model, ["q_proj", "qproj_typo"])
    assert set(select_target_modules(model, r".*\.1\.self_attn\.(q|v)_proj")) == {
        "model.layers.1.self_attn.q_proj", "model.layers.1.self_attn.v_proj"}
    with pytest.raises(ValueError, match="max_rank must be an int > 0, got 0"):
        MultiLoRAModel(model, max_loras=2, max_rank=0)


def test_padding_and_logits_to_keep_follow_each_row(llama):
    mm = llama.wrapped()
    rows = ["c", "b", "__base__"]
    rng = np.random.default_rng(3)
    tokens = torch.as_tensor(rng.integers(1, VOCAB, size=(3, 7)))
    last = mm(tokens, adapter_names=rows, logits_to_keep=2).logits.numpy()     # the LM head sees 2 rows each
    assert last.shape == (3, 2, VOCAB)
    for j, adapter in enumerate(rows):
        assert _rel(last[j], llama.alone(adapter, tokens[j])[-2:]) < RTOL
    mask = torch.ones_like(tokens)
    mask[0, 4:] = 0                                                            # right padding
    mask[2, 5:] = 0
    out = mm(tokens, attention_mask=mask, adapter_names=rows).logits.numpy()
    for j, adapter in enumerate(rows):
        n = int(mask[j].sum())
        assert _rel(out[j, :n], llama.alone(adapter, tokens[j, :n])) < RTOL


def test_lru_eviction_under_churn_through_the_model(llama):
    mm = llama.wrapped(max_loras=2)
    rng = np.random.default_rng(4)
    names = list(ADAPTERS)
    for step in range(8):
        pair = list(rng.choice(names, size=2, replace=False))
        rows = [pair[k % 2] if k != 2 else "__base__" for k in range(4)]
        tokens = torch.as_tensor(rng.integers(1, VOCAB, size=(4, 5)))
        out = mm(tokens, adapter_names=rows).logits.numpy()
        for j, adapter in enumerate(rows):
            assert _rel(out[j], llama.alone(adapter, tokens[j])) < RTOL, (step, rows, j)
    st = mm.adapters.stats
    assert st["evictions"] >= 4 and st["slot_loads"] == st["evictions"] + 2


def test_hot_swap_unload_and_unwrap(llama):
    mm = llama.wrapped(adapters=("a",))
    tokens = torch.as_tensor(np.random.default_rng(5).integers(1, VOCAB, size=(2, 5)))
    mm(tokens, adapter_names=["a", "__base__"])
    slot = mm.adapters.slot_of(1)
    mm.load_adapter("a", llama.dirs["b"])                                      # same name: hot swap
    assert mm.adapters.slot_of(1) == slot and mm.loaded_adapters == ["a"]
    out = mm(tokens, adapter_names=["a", "__base__"]).logits.numpy()
    assert _rel(out[0], llama.alone("b", tokens[0])) < RTOL
    mm.unload_adapter("a")
    with pytest.raises(ValueError, match=r"adapter_names holds 'a', which is not a loaded adapter"):
        mm(tokens, adapter_names=["a", "__base__"])
    with pytest.raises(ValueError, match=r"no adapter named 'a' is loaded"):
        mm.unload_adapter("a")
    plain = mm.unwrap()
    with torch.no_grad():
        assert _rel(plain(tokens).logits[0].numpy(), llama.alone("__base__", tokens[0])) < 1e-6
    for closed in (lambda: mm(tokens, adapter_names=["__base__", "__base__"]),       # unwrapped: refused
                   lambda: mm.generate(tokens, adapter_names=["__base__", "__base__"], max_new_tokens=1),
                   lambda: mm.load_adapter("a", llama.dirs["a"]), lambda: mm.prepare_step(["__base__"], 4)):
        with pytest.raises(ValueError, match="this MultiLoRAModel was unwrapped"):
            closed()
    again = MultiLoRAModel(plain, max_loras=2, max_rank=8, target_modules=ALL)   # the model can be wrapped again
    again.load_adapter("b", llama.dirs["b"])
    assert _rel(again(tokens, adapter_names=["b", "__base__"]).logits[0].numpy(), llama.alone("b", tokens[0])) < RTOL


def test_a_model_is_wrapped_once(llama):
    mm = llama.wrapped(adapters=("a",))
    with pytest.raises(ValueError, match="already wrapped by a MultiLoRAModel .*unwrap"):
        MultiLoRAModel(mm.model, max_loras=2, max_rank=8)


def test_call_errors(llama):
    mm = llama.wrapped(adapters=("a",))
    tokens = torch.randint(1, VOCAB, (2, 4))
    with pytest.raises(ValueError, match="adapter_names has 3 names, but the batch has 2 rows"):
        mm(tokens, adapter_names=["a", "a", "a"])
    with pytest.raises(ValueError, match="adapter_names has 1 names, but the batch has 2 prompts"):
        mm.generate(tokens, adapter_names=["a"], max_new_tokens=1)        # never repeated across prompts
    with pytest.raises(TypeError, match="adapter_names must be a list of adapter names"):
        mm(tokens, adapter_names="a")
    with pytest.raises(ValueError, match="other than '__base__'"):
        mm.load_adapter("__base__", llama.dirs["a"])
    with pytest.raises(TypeError, match="name must be a str, got int"):
        mm.load_adapter(3, llama.dirs["a"])
    mm.prepare_step(["a", "__base__"], 4)
    with torch.no_grad():
        mm.model(tokens)                                      # the prepared shape: fine
        with pytest.raises(ValueError, match=r"the input has 6 tokens, but the step's LoRA metadata maps 8; call "
                                             r"MultiLoRAModel\.prepare_step"):
            mm.model(tokens[:, :3])
    with pytest.raises(RuntimeError, match="serve inference only"):
        mm.model(tokens)
    with pytest.raises(ValueError, match=r"logits_per_row must be an int or one int per row, each in 0\.\.4"):
        mm.prepare_step(["a", "a"], 4, logits_per_row=[1, 5])
    small = llama.wrapped(adapters=("a",), max_num_tokens=16, max_num_seqs=2)
    with pytest.raises(ValueError, match=r"the batch has 3 rows, more than max_num_seqs=2"):
        small(torch.randint(1, VOCAB, (3, 2)), adapter_names=["a", "a", "a"])
    with pytest.raises(ValueError, match=r"the batch has 2 x 9 = 18 tokens, more than max_num_tokens=16"):
        small(torch.randint(1, VOCAB, (2, 9)), adapter_names=["a", "a"])


# ----------------------------------------------------------------------------- bad adapter files

def _bad_adapters(llama, root) -> dict:
    """Name -> (directory, regex of the error): each way a PEFT adapter directory can be bad."""
    out = {}
    good = llama.dirs["a"]

    def copy(name):
        d = str(root / name)
        shutil.copytree(good, d)
        return d

    d = copy("no-config")
    os.remove(os.path.join(d, "adapter_config.json"))
    out["missing config"] = (d, r"adapter_config\.json is missing")
    d = copy("bad-json")
    with open(os.path.join(d, "adapter_config.json"), "a") as f:
        f.write("}")
    out["malformed JSON"] = (d, r"adapter_config\.json: expected a JSON object, got malformed JSON")
    d = str(root / "pickle")
    llama.peft["a"].save_pretrained(d, safe_serialization=False)                # peft's own pickle format
    assert os.path.exists(os.path.join(d, "adapter_model.bin"))
    out["pickle only"] = (d, r"adapter_model\.bin: a pickle, which can run code")
    other = llama.model_cls(transformers.LlamaConfig(**{**COMMON, "intermediate_size": 40}))
    d = str(root / "other-model")
    peft.get_peft_model(other, peft.LoraConfig(r=2, target_modules=["down_proj"], init_lora_weights=False)
                        ).save_pretrained(d)
    out["wrong shapes"] = (d, (r"module 'model\.layers\.0\.mlp\.down_proj': lora_A \(2, 40\) / lora_B \(32, 2\) do "
                               r"not fit the module: expected lora_A \(2, 48\)"))
    d = str(root / "rank16")
    peft.get_peft_model(llama.fresh(), peft.LoraConfig(r=16, target_modules=["q_proj"], init_lora_weights=False)
                        ).save_pretrained(d)
    out["rank above max_rank"] = (d, r"rank 16 exceeds the model's max_rank=8; wrap the model with max_rank >= 16")
    out["unknown target modules"] = (llama.dirs["c"], r"targets 'lm_head', which is not a LoRA module")
    d = copy("truncated")
    f = pathlib.Path(d, "adapter_model.safetensors")
    data = f.read_bytes()
    f.write_bytes(data[: len(data) // 2])
    out["truncated safetensors"] = (d, r"adapter_model\.safetensors: .*(truncated|end past)")
    return out


def test_bad_adapter_files_fail_clearly_and_lose_nothing(llama, tmp_path):
    mm = llama.wrapped(adapters=("a", "b"), target_modules=LINEAR)
    rows = ["a", "b", "__base__"]
    tokens = torch.as_tensor(np.random.default_rng(6).integers(1, VOCAB, size=(3, 5)))
    before = mm(tokens, adapter_names=rows).logits.clone()
    for what, (path, pattern) in _bad_adapters(llama, tmp_path).items():
        for name in ("new", "a"):                          # a new adapter, and replacing a loaded one
            with pytest.raises(AdapterError, match=pattern):
                mm.load_adapter(name, path)
            assert mm.loaded_adapters == ["a", "b"], what
            assert torch.equal(mm(tokens, adapter_names=rows).logits, before), (what, name)
    for j, adapter in enumerate(rows):
        assert _rel(before[j].numpy(), llama.alone(adapter, tokens[j])) < RTOL


def test_beam_search_rows_keep_their_prompts_adapter(llama):
    """num_beams expands each prompt into consecutive rows; each keeps its prompt's adapter, so beam
    search over the batch equals peft's beam search on each prompt alone."""
    mm = llama.wrapped()
    rows = ["b", "__base__", "c"]
    tokens = torch.as_tensor(np.random.default_rng(7).integers(1, VOCAB, size=(3, 5)))
    gen = dict(num_beams=3, max_new_tokens=4, min_new_tokens=4, do_sample=False, pad_token_id=0)
    out = mm.generate(tokens, adapter_names=rows, **gen)
    for j, adapter in enumerate(rows):
        with torch.no_grad():
            ref = llama.peft[adapter].generate(input_ids=tokens[j:j + 1], **gen)
        assert out[j].tolist() == ref[0].tolist(), (j, adapter)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                    reason="the CPU path: Triton's interpreter (a GPU machine runs the compiled kernels in "
                           "test_gpu_torch_hf.py)")
def test_triton_kernels_match_peft(llama):
    """The same model through the Triton kernels (here in the interpreter): every layer kind (fused
    groups with unequal slices, embedding, logits) with per-slot ranks, equal to peft."""
    mm = llama.wrapped(backend="triton")
    assert mm.punica.backend == "triton"
    rows = ["a", "b", "__base__", "c", "d"]
    tokens = torch.as_tensor(np.random.default_rng(8).integers(1, VOCAB, size=(len(rows), 6)))
    out = mm(tokens, adapter_names=rows).logits.numpy()
    last = mm(tokens, adapter_names=rows, logits_to_keep=1).logits.numpy()
    for j, adapter in enumerate(rows):
        want = llama.alone(adapter, tokens[j])
        assert _rel(out[j], want) < RTOL and _rel(last[j], want[-1:]) < RTOL, (j, adapter)


@pytest.mark.parametrize("mode", ["no_grad", "inference_mode"])
def test_group_terms_follow_an_input_changed_in_place(mode):
    """A group (q/k/v) computes its members' LoRA terms once per input; a module that changes its
    input in place between the members' calls gets each member's term for the input it saw (under
    inference_mode, where the input has no version counter, too)."""
    from torch import nn

    from lora_core.peft import LoraModule
    from torch_lora import PeftAdapter

    h, r = 8, 2

    class Attn(nn.Module):
        def __init__(self):
            super().__init__()
            self.q_proj, self.k_proj, self.v_proj = nn.Linear(h, h), nn.Linear(h, h), nn.Linear(h, h)

        def forward(self, input_ids=None):
            x = input_ids
            q = self.q_proj(x)
            x.mul_(2.0)
            return q + self.k_proj(x) + self.v_proj(x)

    torch.manual_seed(0)
    rng = np.random.default_rng(0)
    weights = {n: (rng.standard_normal((r, h)).astype(np.float32), rng.standard_normal((h, r)).astype(np.float32))
               for n in ("q_proj", "k_proj", "v_proj")}
    adapter = PeftAdapter(name="x", r=r, lora_alpha=float(r), use_rslora=False, target_modules=list(weights),
                          modules={n: LoraModule(a, b, 1.0, "linear") for n, (a, b) in weights.items()})
    model = Attn()
    x = torch.randn(2, 3, h)

    def term(name, inp):
        a, b = (torch.as_tensor(w) for w in weights[name])
        return getattr(model, name)(inp) + (inp @ a.T) @ b.T
    with torch.no_grad():
        want = term("q_proj", x) + term("k_proj", 2 * x) + term("v_proj", 2 * x)
    mm = MultiLoRAModel(model, max_loras=1, max_rank=4, target_modules=list(weights))
    assert list(mm.layers) == ["q_proj+k_proj+v_proj"]
    mm.load_adapter("x", adapter)
    mm.prepare_step(["x", "x"], 3)
    with getattr(torch, mode)():
        got = model(input_ids=x.clone())
    assert float((got - want).abs().max()) < 1e-4


def _family_model(family, seed=0):
    import transformers
    torch.manual_seed(seed)
    common = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False)
    if family == "qwen2":
        return transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**common)).eval()
    if family == "mistral":
        return transformers.MistralForCausalLM(transformers.MistralConfig(**common)).eval()
    if family == "gemma":
        return transformers.GemmaForCausalLM(transformers.GemmaConfig(head_dim=8, **common)).eval()
    raise ValueError(family)


@pytest.mark.parametrize("family", ["qwen2", "gemma"])
def test_other_families_mixed_batch_equals_peft(family, tmp_path):
    """Qwen2 (biased q/k/v) and Gemma (scaled embedding, LoRA on embed_tokens) as
    the installed transformers defines them: a mixed batch with two adapters (one restricted by
    layers_to_transform) and a base row equals peft per row (fp32, 1e-4)."""
    from torch_lora.hf import MultiLoRAModel
    state = _family_model(family).state_dict()

    def fresh():
        m = _family_model(family)
        m.load_state_dict(state)
        return m
    dirs = {"x": hf_llama.save_peft(fresh, tmp_path / "x", 1, r=4, lora_alpha=8, target_modules=hf_llama.ALL7,
                                    layers_to_transform=[1]),
            "y": hf_llama.save_peft(fresh, tmp_path / "y", 2, r=2, lora_alpha=4, use_rslora=True,
                            target_modules=["k_proj", "up_proj", "embed_tokens"])}
    mm = MultiLoRAModel(fresh(), max_loras=2, max_rank=4, target_modules=hf_llama.ALL7 + ["embed_tokens"],
                        backend="torch")
    for n, d in dirs.items():
        mm.load_adapter(n, d)
    pm = hf_llama.peft_model(fresh, dirs)
    ids = torch.tensor(torch_helpers.rng(27).integers(1, 64, size=(3, 5)))
    names = ["y", "x", "__base__"]
    out = mm(ids, adapter_names=names).logits
    for j, n in enumerate(names):
        ref = hf_llama.peft_logits(pm, ids[j:j + 1], n)[0]
        assert float((out[j] - ref).abs().max() / ref.abs().max()) < 1e-4, n
        if n != "__base__":
            assert float((ref - hf_llama.peft_logits(pm, ids[j:j + 1], "__base__")[0]).abs().max()) > 1e-4
