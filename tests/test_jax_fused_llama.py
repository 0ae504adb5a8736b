"""The JAX Llama's fused LoRA linear path (`add_lora(..., fused=...)`, `use_fused_lora`,
`jax_lora.nn.MultiLoRALinear.use_fused`) in Triton's interpreter.

On the tiny random Llama (tests/llama_checkpoint.CFG, with attention and MLP biases), four slots of
heterogeneous ranks (zero padding past each), tokens of every slot and tokens without an adapter:
the fused step ("gemm": the wrapper's shrink then the GEMM with the expand; "norm": the RMSNorm
kernel that also shrinks before qkv and gate_up) gives the unfused step's logits within float
tolerance, eagerly and under jit; the transposed base kernel is the base kernel's copy. A
deterministic wrapper takes the unfused path (logged); a step with several adapters per token,
DoRA, fp8 adapters and a quantized base are refused by name. "auto" runs the fused GEMM in exactly
the layers a fused linear table marks fused for the step's token count and rank, and the norm path
(rms_norm_shrink, then the GEMM) in the layers behind a norm it marks `use_norm_fused`.
"""

from __future__ import annotations

import dataclasses
import logging
import os

import numpy as np
import pytest

pytest.importorskip("triton")

import jax
import jax.numpy as jnp
from flax import nnx

import jax_lora
from jax_lora import nn as lnn
from jax_lora.models.llama import LlamaForCausalLM, add_lora, use_fused_lora
from lora_core.host_mapping import LoRAMapping

from .llama_checkpoint import CFG

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs Triton's interpreter")

SLOTS, RANK = 4, 8
SLOT_RANKS = (8, 4, 2, 6)
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _model(dtype):
    """The tiny Llama with random biases and norm weights, LoRA on the 7 targets, every slot filled
    with a random adapter of its rank (zeros past it)."""
    cfg = dataclasses.replace(CFG, attention_bias=True, mlp_bias=True)
    model = LlamaForCausalLM(cfg, dtype=dtype, rngs=nnx.Rngs(0))
    rng = np.random.default_rng(0)
    for _path, node in nnx.iter_graph(model):
        if isinstance(node, nnx.Linear) and node.bias is not None:
            node.bias.set_value(jnp.asarray(rng.standard_normal(node.bias.shape) * 0.1, dtype))
    for layer in model.model.layers:
        for norm in (layer.input_layernorm, layer.post_attention_layernorm):
            norm.weight.set_value(jnp.asarray(1 + 0.1 * rng.standard_normal(norm.weight.shape), dtype))
    add_lora(model, max_loras=SLOTS, max_rank=RANK, target_modules=TARGETS)
    ranks = np.array(SLOT_RANKS, np.int32)
    keep = (np.arange(RANK)[None, :] < ranks[:, None]).astype(np.float32)        # (L, r)
    for layer in lnn.lora_layers(model).values():
        a = rng.standard_normal(layer.lora_a.shape) * 0.3 * keep[None, :, :, None]
        b = rng.standard_normal(layer.lora_b.shape) * 0.3 * keep[:, None, :]
        layer.lora_a.set_value(jnp.asarray(a, dtype))
        layer.lora_b.set_value(jnp.asarray(b, dtype))
        layer.lora_ranks.set_value(jnp.asarray(ranks))
    return model


def _wrapper(index_mapping, deterministic=False):
    w = jax_lora.PunicaWrapper(16, 4, "cpu", max_loras=SLOTS, backend="xla", deterministic=deterministic)
    w.update_metadata(LoRAMapping(index_mapping, (1,), False), list(range(1, SLOTS + 1)), SLOTS, CFG.vocab_size)
    return w


# rows (B=3, S=2): ids 1..4 are slots 0..3, 0 is no adapter
TOKENS = np.array([[5, 9], [17, 3], [60, 33]], np.int32)
POSITIONS = np.array([[0, 1], [0, 1], [0, 1]], np.int32)
IDS = (1, 2, 0, 4, 3, 1)


def _logits(model, w):
    with lnn.punica_context(w):
        logits, _ = model(jnp.asarray(TOKENS), jnp.asarray(POSITIONS))
    return np.asarray(logits, np.float64)


def _rel(got, want) -> float:
    return float(np.linalg.norm(got - want) / np.linalg.norm(want))


@pytest.mark.parametrize("dtype,mode,tol", [(jnp.float32, "gemm", 1e-5), (jnp.float32, "norm", 1e-5),
                                            (jnp.bfloat16, "norm", 3e-2)])
def test_fused_step_matches_the_unfused_step(dtype, mode, tol):
    model = _model(dtype)
    w = _wrapper(IDS)
    want = _logits(model, w)
    base = _logits(model, None)
    assert _rel(base, want) > 0.05                      # the adapters move the logits: the check can fail
    changed = use_fused_lora(model, mode)
    assert len(changed) == 4 * CFG.num_hidden_layers
    qkv = model.model.layers[0].self_attn.qkv_proj
    assert qkv.fused == mode and model.model.layers[0].self_attn.o_proj.fused == "gemm"
    assert np.array_equal(np.asarray(qkv.kernel_nk.get_value()), np.asarray(qkv.base.kernel.get_value()).T)
    got = _logits(model, w)
    assert _rel(got, want) <= tol
    assert np.array_equal(_logits(model, None), base)   # without a wrapper: the base layers, unfused

    graphdef, state = nnx.split(model)

    @jax.jit
    def step(state, w, tokens, positions):
        with lnn.punica_context(w):
            return nnx.merge(graphdef, state)(tokens, positions)[0]

    jitted = np.asarray(step(state, w, jnp.asarray(TOKENS), jnp.asarray(POSITIONS)), np.float64)
    assert _rel(jitted, want) <= tol
    assert use_fused_lora(model, None) and not hasattr(qkv, "kernel_nk") and qkv.fused is None


def test_deterministic_wrapper_runs_unfused_and_says_so(caplog):
    model = _model(jnp.float32)
    w = _wrapper(IDS, deterministic=True)
    want = _logits(model, w)
    add_free = use_fused_lora(model, "norm")
    assert add_free
    with caplog.at_level(logging.INFO, logger="jax_lora"):
        lnn._log_fused_fallback.cache_clear()
        got = _logits(model, w)
    assert np.array_equal(got, want)
    assert any("unfused path" in r.getMessage() and "deterministic" in r.getMessage() for r in caplog.records)


def test_fused_path_refusals_name_the_reason():
    model = _model(jnp.float32)
    use_fused_lora(model, "gemm")
    paired = _wrapper(((1, 2), 2, 0, 2, (1, 2), 1))
    with pytest.raises(NotImplementedError, match="several adapters per token"):
        _logits(model, paired)
    qkv = model.model.layers[0].self_attn.qkv_proj
    with pytest.raises(ValueError, match="cannot serve DoRA"):
        qkv.enable_dora()
    with pytest.raises(ValueError, match="fp8 adapter weights are not supported on a fused"):
        qkv.use_fp8()
    with pytest.raises(ValueError, match="fused must be one of"):
        use_fused_lora(model, "yes")
    use_fused_lora(model, None)
    qkv.enable_dora()
    with pytest.raises(ValueError, match=r"model.layers.0.self_attn.qkv_proj: fused='gemm' is not supported with "
                                         r"DoRA"):
        use_fused_lora(model, "gemm")
    o = model.model.layers[0].self_attn.o_proj
    o.use_fp8()
    with pytest.raises(ValueError, match="fp8 adapter weights"):
        o.use_fused("gemm")
    quantized = lnn.MultiLoRALinear(jax_lora.quant.QuantizedLinear.from_kernel(
        np.ones((8, 16), np.float32), None, quantize="int8", dtype=jnp.float32), max_loras=2, max_rank=4)
    with pytest.raises(ValueError, match="quantized base layer"):
        quantized.use_fused("gemm")


def test_auto_fuses_the_layers_the_tuned_table_marks(tmp_path, monkeypatch, caplog):
    """fused="auto": the layers whose (in, slices), token count and rank the fused linear table marks
    fused run the fused GEMM (qkv and down here), gate_up, marked use_norm_fused, the norm path
    (rms_norm_shrink, then the GEMM), o the unfused path (marked today); qkv's entry has no
    use_norm_fused (an older table's): its norm runs unfused; the step equals the unfused one; each
    choice is logged with its reason."""
    import json

    from jax_lora.ops import fused_linear as jfl
    from lora_core.kernels import fused_linear_configs as flc
    cfg = {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 32, "num_warps": 4, "num_stages": 2}
    h, kv = CFG.num_attention_heads * CFG.head_dim, CFG.num_key_value_heads * CFG.head_dim
    qkv_key = flc.table_key((CFG.hidden_size, (h, kv, kv)), TOKENS.size, RANK)
    down_key = flc.table_key((CFG.intermediate_size, (CFG.hidden_size,)), TOKENS.size, RANK)
    o_key = flc.table_key((h, (CFG.hidden_size,)), TOKENS.size, RANK)
    gate_up_key = flc.table_key((CFG.hidden_size, (CFG.intermediate_size,) * 2), TOKENS.size, RANK)
    entries = {qkv_key: {"config": cfg, "use_fused": True, "reason": "marked fused"},
               gate_up_key: {"config": cfg, "use_fused": False, "reason": "marked today", "use_norm_fused": True,
                             "norm_reason": "marked norm"},
               down_key: {"config": {**cfg, "SPLIT_K": 2}, "use_fused": True, "reason": "marked fused"},
               o_key: {"config": cfg, "use_fused": False, "reason": "marked today"}}
    table = tmp_path / "fl.json"
    table.write_text(json.dumps({"device": "test", "format": 1, "entries": entries}))
    monkeypatch.setenv("LORA_CORE_FUSED_LINEAR_TABLE", str(table))
    flc.fused_linear_table.cache_clear()
    flc._log_choice.cache_clear()
    flc._log_norm_choice.cache_clear()
    calls, norm_calls = [], []
    real, real_norm = jfl.gemm_lora, jfl.rms_norm_shrink

    def counted(x, weight, *args, **kwargs):
        calls.append(tuple(weight.shape))
        return real(x, weight, *args, **kwargs)

    def counted_norm(h, norm_weight, eps, lora_a, *args, **kwargs):
        norm_calls.append(len(lora_a))                # the layer's output slices
        return real_norm(h, norm_weight, eps, lora_a, *args, **kwargs)
    monkeypatch.setattr(jfl, "gemm_lora", counted)
    monkeypatch.setattr(jfl, "rms_norm_shrink", counted_norm)
    try:
        model = _model(jnp.float32)
        w = _wrapper(IDS)
        want = _logits(model, w)
        assert calls == []
        assert len(use_fused_lora(model, "auto")) == 4 * CFG.num_hidden_layers
        with caplog.at_level(logging.INFO, logger="lora_core"):
            got = _logits(model, w)
    finally:
        flc.fused_linear_table.cache_clear()
        flc._log_choice.cache_clear()
        flc._log_norm_choice.cache_clear()
    assert sorted(set(calls)) == sorted({(h + 2 * kv, CFG.hidden_size), (CFG.hidden_size, CFG.intermediate_size),
                                         (2 * CFG.intermediate_size, CFG.hidden_size)})
    assert norm_calls and set(norm_calls) == {2}      # gate_up only
    assert _rel(got, want) <= 1e-5
    msgs = [r.getMessage() for r in caplog.records]
    assert f"LoRA linear {qkv_key}: the fused GEMM (shrink, then gemm_lora): marked fused" in msgs
    assert f"LoRA linear {o_key}: today's path (library GEMM + add_lora_linear): marked today" in msgs
    assert f"RMSNorm + LoRA linear {gate_up_key}: the fused norm path (rms_norm_shrink, then gemm_lora): " \
           "marked norm" in msgs
    assert any(m.startswith(f"RMSNorm + LoRA linear {qkv_key}: the norm, then") and "no norm path decision" in m
               for m in msgs)
    assert not any(f"LoRA linear {gate_up_key}: today's path" in m for m in msgs)   # no call asked use_fused
