"""DoRA served by the Flax Llama and its serving loop, mixed with plain LoRA adapters and rows without
an adapter, against peft itself (float32, CPU): peft's use_dora adapters (its own magnitudes moved
away from their initial norms) loaded by lora_core.peft, column scales computed at load
(lora_core.dora), applied in the expand's epilogue (xla backend here; triton in the interpreter)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jax_lora import LoRAMapping, PunicaWrapper
from jax_lora import nn as lnn
from jax_lora.adapters import AdapterError, AdapterManager, load_peft_adapter, merge_adapter
from jax_lora.models import add_lora, load_llama
from jax_lora.serving import Request, ServingEngine

from . import jax_helpers, llama_checkpoint
from .impls import triton_runs
from .jax_helpers import plain_config, write_adapter
from .test_peft_roundtrip import VOCAB, _rel, _torch_logits, build_peft_models, check_mixed_batch_equals_peft

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

RTOL = 1e-4
ADAPTERS = {
    1: {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj", "down_proj"], "use_dora": True},
    2: {"r": 8, "lora_alpha": 16, "target_modules": ["q_proj", "k_proj", "o_proj", "up_proj"]},
}


def _raise_magnitudes(pm) -> None:
    """Moves peft's DoRA magnitudes away from their initial norms (else g would be 1)."""
    with torch.no_grad():
        for module in pm.modules():
            mags = getattr(module, "lora_magnitude_vector", None)
            if mags is not None and "default" in mags:
                mags["default"].weight.mul_(1.3).add_(0.05)


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    return build_peft_models(tmp_path_factory.mktemp("dora-peft"), ADAPTERS, tweak=_raise_magnitudes)


def _ours(root, dirs):
    model = load_llama(str(root / "base"))
    add_lora(model, max_loras=3, max_rank=8, dora=True)
    mgr = AdapterManager(model)
    for lora_id, d in dirs.items():
        mgr.register(lora_id, d)
    mgr.activate(list(dirs))
    return model, mgr


# pallas_tpu's DoRA epilogue is tested per op and through the wrapper (tests/test_pallas_tpu.py,
# tests/test_dora_core.py): a whole eager model in Pallas' TPU interpret mode hung in a full run on
# the 2-core CI machine (its io_callback thread dispatching JAX ops while the main thread waited).
@pytest.mark.parametrize("backend", ["xla", "triton"])
def test_mixed_dora_lora_and_base_rows_equal_peft(hf, backend):
    if backend == "triton" and not triton_runs():
        pytest.skip("no GPU and Triton's interpreter is not on")
    root, dirs, peft_models = hf
    model, mgr = _ours(root, dirs)
    check_mixed_batch_equals_peft(model, mgr, peft_models, [1, 2, None, 1], 6, 3, backend)


def test_serving_loop_with_dora_equals_peft(hf):
    root, dirs, peft_models = hf
    model, mgr = _ours(root, dirs)
    engine = ServingEngine(model, mgr, max_seqs=4, max_len=32, keep_logits=True)
    rng = np.random.default_rng(1)
    reqs = [Request([int(t) for t in rng.integers(0, VOCAB, size=int(rng.integers(3, 9)))], lora_id=i,
                    max_new_tokens=4) for i in [1, 2, None, 1]]
    for req, c in zip(reqs, engine.generate(reqs)):
        seq = np.array([list(req.prompt) + c.tokens[:-1]])
        ref = _torch_logits(peft_models[req.lora_id], seq)[0, len(req.prompt) - 1:]
        assert _rel(c.logits, ref) < RTOL
        assert list(ref.argmax(-1)) == c.tokens


def test_merged_dora_weights_equal_peft(hf):
    root, dirs, peft_models = hf
    merged = merge_adapter(load_llama(str(root / "base")), load_peft_adapter(dirs[1]))
    tokens = np.random.default_rng(2).integers(0, VOCAB, size=(2, 5))
    pos = jnp.broadcast_to(jnp.arange(5), tokens.shape)
    ours = np.asarray(merged(jnp.asarray(tokens, jnp.int32), pos)[0])
    assert _rel(ours, _torch_logits(peft_models[1], tokens)) < RTOL


def _serve_equals_peft(engine, peft_models, lora_ids, seed):
    rng = np.random.default_rng(seed)
    reqs = [Request([int(t) for t in rng.integers(0, VOCAB, size=int(rng.integers(3, 9)))], lora_id=i,
                    max_new_tokens=3) for i in lora_ids]
    for req, c in zip(reqs, engine.generate(reqs)):
        seq = np.array([list(req.prompt) + c.tokens[:-1]])
        ref = _torch_logits(peft_models[req.lora_id], seq)[0, len(req.prompt) - 1:]
        assert _rel(c.logits, ref) < RTOL
        assert list(ref.argmax(-1)) == c.tokens


def test_dora_loads_into_a_model_built_without_dora(hf):
    """add_lora without dora=True: plain LoRA is served with no column scale anywhere; the first
    DoRA adapter written gives the layers it touches their scale (layout_version 1, the serving
    step compiled again) and every row, DoRA, plain and base, equals peft before and after."""
    root, dirs, peft_models = hf
    model = load_llama(str(root / "base"))
    add_lora(model, max_loras=3, max_rank=8)
    mgr = AdapterManager(model)
    mgr.register(2, dirs[2])
    engine = ServingEngine(model, mgr, max_seqs=4, max_len=32, keep_logits=True)
    _serve_equals_peft(engine, peft_models, [2, None], 3)
    assert not any(getattr(layer, "dora", False) for layer in mgr.layers.values())
    compiled = engine.compile_count
    mgr.register(1, dirs[1])                      # read and prepared; the layers change when it is written
    assert mgr.layout_version == 0
    _serve_equals_peft(engine, peft_models, [1, 2, None, 1], 4)
    assert mgr.layout_version == 1 and engine.compile_count > compiled
    with_scale = sorted(p for p, layer in mgr.layers.items() if getattr(layer, "dora", False))
    assert with_scale == [f"model.layers.{i}.{m}" for i in range(2) for m in ("mlp.down_proj", "self_attn.qkv_proj")]
    check_mixed_batch_equals_peft(model, mgr, peft_models, [1, 2, None, 1], 6, 3, "xla")


def test_dora_on_the_lm_head_is_refused_by_name(hf, tmp_path):
    root, _, _ = hf
    model = load_llama(str(root / "base"))
    add_lora(model, max_loras=2, max_rank=8, target_modules=["q_proj", "lm_head"])
    a = load_peft_adapter(hf[1][1])
    rng = np.random.default_rng(0)
    head = model.lm_head                          # MultiLoRALogits
    factors = (rng.standard_normal((2, head.in_features)).astype(np.float32),
               rng.standard_normal((head.out_features, 2)).astype(np.float32), 1.0, "linear")
    bad = dataclasses.replace(a, modules={"lm_head": factors}, magnitudes={"lm_head": np.ones(head.out_features,
                                                                                              np.float32)})
    with pytest.raises(AdapterError, match=r"magnitude on 'lm_head', which is the LM head"):
        AdapterManager(model).register(1, bad)


@pytest.fixture(scope="module")
def llama_dirs(tmp_path_factory):
    """A tiny random Llama checkpoint and three PEFT adapters (tests/llama_checkpoint.py): directory per key."""
    return llama_checkpoint.write_assets(tmp_path_factory.mktemp("llama_checkpoint"))






def _dora_adapter(llama_dirs, path):
    """A PEFT use_dora adapter on q_proj and down_proj of the tiny Llama (rank 4, magnitudes)."""
    mods = llama_checkpoint.modules(["self_attn.q_proj", "mlp.down_proj"], 4)
    tensors = {}
    for m, (a, b) in mods.items():
        tensors[f"base_model.model.{m}.lora_A.weight"] = a
        tensors[f"base_model.model.{m}.lora_B.weight"] = b
        tensors[f"base_model.model.{m}.lora_magnitude_vector"] = jax_helpers.RNG.uniform(0.5, 2.0, b.shape[0])
    cfg = plain_config(r=4, lora_alpha=8, use_dora=True, target_modules=["q_proj", "down_proj"])
    return write_adapter(path, cfg, tensors)


def test_dora_and_lora_adapters_mixed_in_one_batch_equal_merged(llama_dirs, tmp_path):
    """A PEFT use_dora adapter (magnitude vectors) loads, and in one batch of the
    Flax Llama (add_lora(dora=True)) DoRA, plain LoRA and no-adapter rows each equal the model with
    that row's adapter merged (DoRA: rows of W' rescaled to m / ||W'||), float32 1e-4."""
    d = _dora_adapter(llama_dirs, tmp_path / "dora")
    ad = load_peft_adapter(d)
    assert set(ad.magnitudes) == set(ad.modules)
    model = load_llama(llama_dirs["model"])
    add_lora(model, max_loras=2, max_rank=4, target_modules=["q_proj", "v_proj", "down_proj"], dora=True)
    mgr = AdapterManager(model)
    mgr.register(1, d)
    mgr.register(2, llama_dirs["a1"])
    mgr.activate([1, 2])
    S = 5
    tokens = jax_helpers.RNG.integers(0, llama_checkpoint.CFG.vocab_size, (3, S)).astype(np.int32)
    row_ids = [1, 2, 0]
    token_ids = tuple(int(i) for i in np.repeat(row_ids, S))
    w = PunicaWrapper(16, 8, None, max_loras=2, backend="xla")
    w.update_metadata(LoRAMapping(token_ids, token_ids), mgr.lora_index_to_id, 3, llama_checkpoint.CFG.vocab_size)
    graphdef, state = nnx.split(model)

    @jax.jit
    def forward(state, w, tokens):
        with lnn.punica_context(w):
            return nnx.merge(graphdef, state)(tokens, jnp.broadcast_to(jnp.arange(S), tokens.shape))[0]

    got = np.asarray(forward(state, w, tokens))
    for b, lora in enumerate(row_ids):
        want = llama_checkpoint.merged_logits(llama_dirs, {0: None, 1: d, 2: llama_dirs["a1"]}[lora], tokens[b])
        assert jax_helpers.rel_err(got[b], want) < 1e-4, lora
