"""Concurrent callers of the serving front ends: `torch_lora.hf.MultiLoRAModel` (`__call__`,
`generate`, direct model calls) and `jax_lora.serving.ServingEngine.generate`.

Several threads serve requests with different adapters at once on tiny random models (CPU); every
thread must get exactly what it gets when it runs alone: its own adapter, never another thread's,
and no error from another thread's batch shape.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest

from lora_core.peft import save_peft_adapter

THREADS = 3
ROUNDS = 4


def _run_threads(work, n=THREADS):
    """Runs work(i) in n threads started together; ({i: result}, [exceptions])."""
    barrier = threading.Barrier(n)
    results, errors = {}, []

    def body(i):
        try:
            barrier.wait()
            results[i] = work(i)
        except BaseException as e:      # reported to the test thread
            errors.append(e)
    threads = [threading.Thread(target=body, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads), "a serving thread hangs"
    return results, errors


def _adapter_dirs(root, dims: dict, layers: int, n: int, seed: int = 0) -> list:
    """n PEFT adapters (rank 4) on q_proj / v_proj of every layer, large enough to change tokens."""
    rng = np.random.default_rng(seed)
    dirs = []
    for k in range(n):
        modules = {}
        for i in range(layers):
            for leaf in ("q_proj", "v_proj"):
                n_in, n_out = dims[leaf]
                modules[f"model.layers.{i}.self_attn.{leaf}"] = (rng.normal(size=(4, n_in)) / np.sqrt(n_in),
                                                                 rng.normal(size=(n_out, 4)) * 1.5)
        path = str(root / f"adapter{k}")
        save_peft_adapter(path, modules, r=4, lora_alpha=8.0)
        dirs.append(path)
    return dirs


# ----------------------------------------------------------------------------- torch

@pytest.fixture(scope="module")
def torch_model(tmp_path_factory):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from torch_lora.hf import MultiLoRAModel

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                   pad_token_id=0, tie_word_embeddings=False)
    model = transformers.LlamaForCausalLM(cfg).eval()
    dirs = _adapter_dirs(tmp_path_factory.mktemp("torch-adapters"), {"q_proj": (32, 32), "v_proj": (32, 16)}, 2,
                         THREADS)
    mm = MultiLoRAModel(model, max_loras=THREADS, max_rank=4, target_modules=["q_proj", "v_proj"])
    names = [f"a{k}" for k in range(THREADS)]
    for name, d in zip(names, dirs):
        mm.load_adapter(name, d)
    return mm, names


def _prompts(torch, k):
    g = torch.Generator().manual_seed(k)
    return torch.randint(1, 64, (2, 6), generator=g)


def test_threads_calling_generate_each_get_their_own_adapter(torch_model):
    import torch
    mm, names = torch_model
    kw = dict(max_new_tokens=6, min_new_tokens=6, do_sample=False, pad_token_id=0)
    expected = [mm.generate(_prompts(torch, k), adapter_names=[names[k]] * 2, **kw) for k in range(THREADS)]
    assert len({tuple(e.flatten().tolist()) for e in expected}) == THREADS      # the adapters differ

    def work(k):
        return [mm.generate(_prompts(torch, k), adapter_names=[names[k]] * 2, **kw) for _ in range(ROUNDS)]
    results, errors = _run_threads(work)
    assert not errors, errors
    for k in range(THREADS):
        for got in results[k]:
            assert torch.equal(got, expected[k]), f"thread {k} was served another adapter"


def test_threads_calling_the_model_each_get_their_own_adapter(torch_model):
    import torch
    mm, names = torch_model
    expected = [mm(_prompts(torch, k)[:, :3 + k], adapter_names=[names[k]] * 2).logits for k in range(THREADS)]

    def work(k):
        return [mm(_prompts(torch, k)[:, :3 + k], adapter_names=[names[k]] * 2).logits for _ in range(ROUNDS)]
    results, errors = _run_threads(work)
    assert not errors, errors
    for k in range(THREADS):
        for got in results[k]:
            assert torch.equal(got, expected[k]), f"thread {k} was served another adapter"


def test_a_direct_call_from_another_thread_never_uses_anothers_step(torch_model):
    """A step prepared in one thread and run from another is refused; under `mm.lock` a thread's
    prepare_step + direct call is never interleaved with another thread's generate."""
    import torch
    mm, names = torch_model
    ids = _prompts(torch, 0)[:, :4]
    with mm.lock, torch.no_grad():
        mm.prepare_step([names[0]] * 2, 4)
        alone = mm.model(input_ids=ids).logits
    failures = []

    def other():
        try:
            with torch.no_grad():
                mm.model(input_ids=ids)
        except RuntimeError as e:
            failures.append(str(e))
    t = threading.Thread(target=other)
    t.start()
    t.join(60)
    assert failures and "another thread" in failures[0]

    def work(k):
        if k == 0:
            out = []
            for _ in range(ROUNDS):
                with mm.lock, torch.no_grad():
                    mm.prepare_step([names[0]] * 2, 4)
                    out.append(mm.model(input_ids=ids).logits)
            return out
        return [mm.generate(_prompts(torch, k), adapter_names=[names[k]] * 2, max_new_tokens=3, do_sample=False,
                            pad_token_id=0) for _ in range(ROUNDS)]
    results, errors = _run_threads(work)
    assert not errors, errors
    assert all(torch.equal(got, alone) for got in results[0])


# ----------------------------------------------------------------------------- jax

@pytest.fixture(scope="module")
def jax_engine(tmp_path_factory):
    from flax import nnx

    from jax_lora.adapters import AdapterManager
    from jax_lora.models import add_lora
    from jax_lora.models.llama import LlamaConfig, LlamaForCausalLM
    from jax_lora.serving import ServingEngine

    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=64, rope_theta=10000.0, rms_norm_eps=1e-5)
    model = LlamaForCausalLM(cfg, rngs=nnx.Rngs(0))
    dirs = _adapter_dirs(tmp_path_factory.mktemp("jax-adapters"), {"q_proj": (32, 32), "v_proj": (32, 16)}, 2,
                         THREADS)
    add_lora(model, max_loras=THREADS, max_rank=4, target_modules=["q_proj", "v_proj"])
    mgr = AdapterManager(model)
    for k, d in enumerate(dirs):
        mgr.register(k + 1, d)
    return ServingEngine(model, mgr, max_seqs=4, max_len=32, max_prefill_tokens=64, min_prefill_len=8,
                         min_prefill_rows=4)


def test_threads_calling_the_serving_engine_each_get_their_own_adapter(jax_engine):
    from jax_lora.serving import Request

    def requests(k):
        rng = np.random.default_rng(k)
        return [Request([int(t) for t in rng.integers(1, 64, size=5)], lora_id=k + 1, max_new_tokens=5)
                for _ in range(2)]
    expected = [[c.tokens for c in jax_engine.generate(requests(k))] for k in range(THREADS)]
    assert len({str(e) for e in expected}) == THREADS

    def work(k):
        return [[c.tokens for c in jax_engine.generate(requests(k))] for _ in range(ROUNDS)]
    results, errors = _run_threads(work)
    assert not errors, errors
    for k in range(THREADS):
        assert all(got == expected[k] for got in results[k]), f"thread {k} was served another adapter"
