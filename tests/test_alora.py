"""Activated LoRA (PEFT's alora_invocation_tokens) against peft itself (float32, CPU, tiny random Llama).

lora_core.alora's invocation search equals peft's `calculate_alora_offsets` on random prompts;
adapter_config.json's field is read and its bad values refused; torch's MultiLoRAModel forward
pass and generate() and the JAX ServingEngine equal peft's aLoRA forward / generate per request,
in batches that mix aLoRA rows (invocation once, twice, at the start, absent) with plain LoRA and
base rows. Before the invocation a row's tokens get no adapter, so its logits there are the base
model's; without an invocation the whole request is the base model's, as in peft.
"""

from __future__ import annotations

import numpy as np
import pytest

from lora_core import alora
from lora_core.peft import AdapterError, parse_adapter_config

from .impls import torch_triton_device, triton_runs
from .test_peft_roundtrip import VOCAB, build_peft_models

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

INVOCATION = [7, 3, 9]
ADAPTERS = {
    1: {"r": 4, "lora_alpha": 16, "target_modules": ["q_proj", "v_proj", "down_proj"],
        "alora_invocation_tokens": INVOCATION, "task_type": "CAUSAL_LM"},
    2: {"r": 8, "lora_alpha": 16, "target_modules": ["q_proj", "o_proj"], "task_type": "CAUSAL_LM"},
}
NAMES = {1: "act", 2: "plain", None: "__base__"}
MAX_NEW = 4


def _prompt(rng, n, where):
    """n random tokens (no accidental invocation) with the invocation at `where` (list of starts)."""
    p = [int(t) for t in rng.integers(10, VOCAB, size=n)]
    for j in where:
        p[j:j + len(INVOCATION)] = INVOCATION
    return p


PROMPTS = [  # (prompt maker, adapter id)
    (lambda rng: _prompt(rng, 9, [3]), 1),          # invocation in the middle
    (lambda rng: _prompt(rng, 10, [0, 6]), 1),      # twice: the last one counts
    (lambda rng: _prompt(rng, 8, []), 1),           # absent: the base model throughout
    (lambda rng: _prompt(rng, 6, [3]), 1),          # at the very end of the prompt
    (lambda rng: _prompt(rng, 7, [2]), 2),          # a plain LoRA adapter (the tokens mean nothing to it)
    (lambda rng: _prompt(rng, 5, [1]), None),       # base
]


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    return build_peft_models(tmp_path_factory.mktemp("alora"), ADAPTERS)


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.default_rng(0)
    return [(make(rng), lora_id) for make, lora_id in PROMPTS]


def _peft_generate(pm, prompt):
    """peft's greedy tokens and per-step logits (its own aLoRA offsets from the prompt)."""
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = pm.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_NEW,
                          min_new_tokens=MAX_NEW, do_sample=False, pad_token_id=0, output_logits=True,
                          return_dict_in_generate=True)
    return out.sequences[0, len(prompt):].tolist(), torch.cat(out.logits).numpy()


# ----------------------------------------------------------------------------- lora_core

def test_invocation_search_equals_peft():
    from peft.tuners.lora.variants import calculate_alora_offsets
    rng = np.random.default_rng(1)
    config = {"a": peft.LoraConfig(alora_invocation_tokens=[4, 5], task_type="CAUSAL_LM"),
              "b": peft.LoraConfig(alora_invocation_tokens=[4], task_type="CAUSAL_LM")}
    for _ in range(200):
        rows = rng.integers(0, 7, size=(3, int(rng.integers(1, 9))))
        for name in config:
            got = calculate_alora_offsets(config, name, torch.as_tensor(rows), adapter_names=[name] * 3)
            for row, offset in zip(rows, got):
                start = alora.invocation_start(row, config[name].alora_invocation_tokens)
                assert (None if start is None else len(row) - start) == offset, (row, name)


def test_active_from_and_token_ids():
    assert [alora.active_from(4, p, 3) for p in (0, 2, 4, 6)] == [3, 2, 0, 0]
    assert alora.active_from(None, 0, 5) == 5 and alora.active_from(None, 9, 1) == 1
    np.testing.assert_array_equal(alora.token_ids(7, 2, 0, 5), [0, 0, 7, 7, 7])
    np.testing.assert_array_equal(alora.token_ids(7, None, 0, 3), [0, 0, 0])
    assert alora.invocation_start([1, 2], [1, 2, 3]) is None
    with pytest.raises(ValueError, match="at least one token"):
        alora.invocation_start([1, 2], [])


@pytest.mark.parametrize("value", [[], "7 3", [1.5], [-1], [True], [2**31]])
def test_bad_invocation_tokens_are_refused(value):
    with pytest.raises(AdapterError, match="field 'alora_invocation_tokens' must be null or a non-empty list"):
        parse_adapter_config({"r": 2, "alora_invocation_tokens": value})


def test_invocation_tokens_are_read_and_dora_with_alora_refused():
    assert parse_adapter_config({"r": 2, "alora_invocation_tokens": [5, 6]}).alora_invocation_tokens == (5, 6)
    assert parse_adapter_config({"r": 2, "alora_invocation_tokens": None}).alora_invocation_tokens is None
    with pytest.raises(AdapterError, match="'alora_invocation_tokens' and 'use_dora' together"):
        parse_adapter_config({"r": 2, "alora_invocation_tokens": [5], "use_dora": True})


# ----------------------------------------------------------------------------- torch

def _mm(hf, backend="torch", device="cpu"):
    from torch_lora.hf import MultiLoRAModel
    root, dirs, _ = hf
    model = transformers.LlamaForCausalLM.from_pretrained(str(root / "base")).eval().to(device)
    mm = MultiLoRAModel(model, max_loras=2, max_rank=8, backend=backend)
    for lora_id, d in dirs.items():
        mm.load_adapter(NAMES[lora_id], d)
    return mm


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_torch_forward_equals_peft_per_row(hf, prompts, backend):
    """One padded batch (right padding, every row of one length): each row's logits equal peft's
    forward of that row alone, with peft's offsets computed from the same tokens (triton: in the
    interpreter on a CPU, compiled on a GPU)."""
    if backend == "triton" and not triton_runs():
        pytest.skip("no GPU and Triton's interpreter is not on")
    device = torch_triton_device() if backend == "triton" else "cpu"
    mm = _mm(hf, backend, device)
    assert mm.adapters.invocation_tokens(mm._ids["act"]) == tuple(INVOCATION)
    width = max(len(p) for p, _ in prompts)
    rows = [p + [11] * (width - len(p)) for p, _ in prompts]
    names = [NAMES[i] for _, i in prompts]
    with torch.no_grad():
        out = mm(torch.tensor(rows, device=device), adapter_names=names).logits.cpu().numpy()
    for j, (row, (_, lora_id)) in enumerate(zip(rows, prompts)):
        with torch.no_grad():
            want = hf[2][lora_id](torch.tensor([row])).logits[0].numpy()
        np.testing.assert_allclose(out[j], want, rtol=1e-4, atol=1e-5, err_msg=f"row {j}")
    base = hf[2][None]
    with torch.no_grad():
        plain = base(torch.tensor(rows[:1])).logits[0].numpy()
    np.testing.assert_allclose(out[0, :3], plain[:3], rtol=1e-5, atol=1e-6)       # before the invocation: base
    assert np.abs(out[0, 3:] - plain[3:]).max() > 1e-3                              # from it on: the adapter


def test_torch_generate_equals_peft_generate(hf, prompts):
    """Prompts of one length per generate call (no padding): greedy tokens and every step's logits
    equal peft's generate for the request alone."""
    mm = _mm(hf)
    by_len: dict = {}
    for p, lora_id in prompts:
        by_len.setdefault(len(p), []).append((p, lora_id))
    for group in by_len.values():
        ids = torch.tensor([p for p, _ in group])
        with torch.no_grad():
            out = mm.generate(ids, attention_mask=torch.ones_like(ids), adapter_names=[NAMES[i] for _, i in group],
                              max_new_tokens=MAX_NEW, min_new_tokens=MAX_NEW, do_sample=False, pad_token_id=0,
                              output_logits=True, return_dict_in_generate=True)
        logits = torch.stack(out.logits, dim=1).numpy()                  # (rows, steps, vocab)
        for j, (p, lora_id) in enumerate(group):
            tokens, want = _peft_generate(hf[2][lora_id], p)
            assert out.sequences[j, len(p):].tolist() == tokens, (p, lora_id)
            np.testing.assert_allclose(logits[j], want, rtol=1e-4, atol=1e-5)


def test_torch_alora_needs_input_ids(hf):
    mm = _mm(hf)
    embeds = torch.zeros(1, 4, 32)
    with pytest.raises(ValueError, match=r"aLoRA adapters \['act'\] need input_ids"):
        mm(inputs_embeds=embeds, adapter_names=["act"])
    with pytest.raises(ValueError, match=r"aLoRA adapters \['act'\] need input_ids"):
        mm.generate(inputs_embeds=embeds, adapter_names=["act"], max_new_tokens=1)


# ----------------------------------------------------------------------------- JAX

def test_serving_engine_equals_peft_generate(hf, prompts):
    from jax_lora.adapters import AdapterManager
    from jax_lora.models import add_lora, load_llama
    from jax_lora.serving import Request, ServingEngine
    root, dirs, _ = hf
    model = load_llama(str(root / "base"))
    add_lora(model, max_loras=2, max_rank=8)
    mgr = AdapterManager(model)
    for lora_id, d in dirs.items():
        mgr.register(lora_id, d)
    assert mgr.invocation_tokens(1) == tuple(INVOCATION) and mgr.invocation_tokens(2) is None
    engine = ServingEngine(model, mgr, max_seqs=4, max_len=32, keep_logits=True)
    reqs = [Request(p, lora_id=i, max_new_tokens=MAX_NEW) for p, i in prompts]
    done = engine.generate(reqs)
    for (p, lora_id), c in zip(prompts, done):
        tokens, want = _peft_generate(hf[2][lora_id], p)
        assert c.tokens == tokens, (p, lora_id)
        np.testing.assert_allclose(c.logits, want, rtol=1e-4, atol=1e-4)
    absent = prompts[2][0]                             # no invocation: peft and the engine serve the base model
    tokens, want = _peft_generate(hf[2][None], absent)
    assert done[2].tokens == tokens
    np.testing.assert_allclose(done[2].logits, want, rtol=1e-4, atol=1e-4)
    invoked = _peft_generate(hf[2][None], prompts[0][0])[1]
    assert np.abs(done[0].logits - invoked).max() > 1e-3     # with an invocation the adapter matters


def test_torch_base_prefix_cache_is_reused_by_the_alora_request(hf, prompts):
    """The KV cache of the tokens before the invocation is the base model's: a base pass over the
    prefix, then the aLoRA adapter over the rest with that cache, gives the logits of the one pass
    over the whole prompt (the invocation is searched in the rest)."""
    mm = _mm(hf)
    prompt = prompts[0][0]                                    # invocation at 3
    ids = torch.tensor([prompt])
    with torch.no_grad():
        whole = mm(ids, adapter_names=["act"]).logits
        prefix = mm(ids[:, :3], adapter_names=["__base__"], use_cache=True)
        rest = mm(ids[:, 3:], adapter_names=["act"], past_key_values=prefix.past_key_values).logits
    torch.testing.assert_close(rest, whole[:, 3:], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(prefix.logits, whole[:, :3], rtol=1e-5, atol=1e-6)
