"""Layer-stacked LoRA banks (jax_lora.lora_bank, jax_lora.nn.stack_lora_layers): the decoder layers'
MultiLoRALinears of one projection kind share one array per adapter variable.

Covered on the CPU with a tiny random Llama:
- the model state's adapter arrays do not grow with the layer count (2 and 4 layers: the same
  number of LoRAWeight leaves), and the serving engine's base step takes no adapter array;
- a served batch is bit for bit the same as with per-layer variables (`add_lora(...,
  stack_layers=False)`): heterogeneous ranks (per module, as PEFT's rank_pattern), a DoRA adapter
  arriving in a model built without dora (the banks gain their scale), fp8 storage, more adapters
  than slots (LRU eviction writes), an adapter unloaded and one replaced under its id; on the xla
  backend and on the Triton backend in Triton's interpreter (its views read a layer's entry of the
  stacked arrays at the layer's offset), the fused LoRA linears included; on a CUDA GPU (marked
  `gpu`) through the XLA FFI launcher;
- a banked layer's `lora_a` etc. read and write its entry; `unstack_lora_layers` gives the layers
  their own arrays back, unchanged; the wrapper's `layer=` checks its arguments.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jax_lora import nn as lnn
from jax_lora.adapters import AdapterManager
from jax_lora.lora_bank import BankedVariable, LoRABank
from jax_lora.models import LlamaConfig, LlamaForCausalLM, add_lora
from jax_lora.serving import Request, ServingEngine
from lora_core.peft import PeftAdapter
from lora_core.peft.adapter import LoraModule

from . import jax_helpers

CFG = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=64)
SHAPES = {"self_attn.q_proj": (32, 32), "self_attn.k_proj": (32, 16), "self_attn.v_proj": (32, 16),
          "self_attn.o_proj": (32, 32), "mlp.gate_proj": (32, 48), "mlp.up_proj": (32, 48),
          "mlp.down_proj": (48, 32)}


def _model(layers: int = 2, *, stack: bool = True, dtype=jnp.float32, **kw) -> LlamaForCausalLM:
    model = LlamaForCausalLM(dataclasses.replace(CFG, num_hidden_layers=layers), dtype=dtype, rngs=nnx.Rngs(0))
    add_lora(model, max_loras=2, max_rank=8, stack_layers=stack, **kw)
    return model


def _adapter(name: str, seed: int, ranks: dict, *, dora: bool = False, layers: int = 2) -> PeftAdapter:
    """A PEFT adapter on every layer's modules in `ranks` ({module: rank}: ranks differ per module),
    with DoRA magnitudes when `dora`, and a rank-3 LM head and embedding for "b"."""
    rng = np.random.default_rng(seed)
    modules, mags = {}, {}
    for layer in range(layers):
        for module, r in ranks.items():
            i, o = SHAPES[module]
            name_l = f"model.layers.{layer}.{module}"
            modules[name_l] = LoraModule(rng.standard_normal((r, i)).astype(np.float32) * 0.3,
                                         rng.standard_normal((o, r)).astype(np.float32) * 0.3, 0.5, "linear")
            if dora:
                mags[name_l] = rng.uniform(0.5, 2.0, o).astype(np.float32)
    if name == "b":
        modules["lm_head"] = LoraModule(rng.standard_normal((3, 32)).astype(np.float32) * 0.3,
                                        rng.standard_normal((64, 3)).astype(np.float32) * 0.3, 1.0, "linear")
        modules["model.embed_tokens"] = LoraModule(rng.standard_normal((3, 64)).astype(np.float32) * 0.3,
                                                   rng.standard_normal((32, 3)).astype(np.float32) * 0.3, 1.0,
                                                   "embedding")
    return PeftAdapter(name=name, r=max(ranks.values()), lora_alpha=1.0, use_rslora=False,
                       target_modules=sorted(ranks), modules=modules, magnitudes=mags)


ADAPTERS = {1: ("a", 1, {"self_attn.q_proj": 4, "self_attn.v_proj": 8, "mlp.down_proj": 2}, False),
            2: ("b", 2, {"self_attn.k_proj": 6, "self_attn.o_proj": 8, "mlp.up_proj": 3, "mlp.gate_proj": 5}, False),
            3: ("c", 3, {"self_attn.q_proj": 2, "mlp.down_proj": 4, "mlp.gate_proj": 8}, True)}


def _lora_leaves(model) -> int:
    return len(jax.tree.leaves(nnx.state(model, lnn.LoRAWeight)))


def test_adapter_arrays_do_not_grow_with_layers():
    """LoRAWeight leaves: per layer, 3 per projection kind per layer plus the embedding's and LM
    head's; stacked, 3 per kind whatever the layer count. The engine's base step takes none."""
    counts = {(n, stack): _lora_leaves(_model(n, stack=stack)) for n in (2, 4) for stack in (True, False)}
    assert counts[(2, True)] == counts[(4, True)] == 3 * 4 + 3 + 3
    assert counts[(2, False)] == 3 * 4 * 2 + 6 and counts[(4, False)] == 3 * 4 * 4 + 6
    fp8 = _model(2, lora_dtype="fp8", dora=True)                   # + lora_scale, lora_a_scale, lora_b_scale
    assert _lora_leaves(fp8) == _lora_leaves(_model(4, lora_dtype="fp8", dora=True)) == 6 * 4 + 5 + 5
    m = _model(2)
    engine = ServingEngine(m, AdapterManager(m), max_seqs=2, max_len=16)
    assert len(engine._state_leaves[0]) == _lora_leaves(m)
    engine.generate([Request([1, 2, 3], max_new_tokens=2)], use_lora=False)
    for key, program in engine._programs.items():
        assert not key[2]                                           # base programs only
        assert jax.tree.leaves(program.args_info[0][0][0]) == []    # no adapter argument


def _serve(model, backend: str, lora_dtype=None, dora: bool = True) -> list:
    """Logits of a scripted run: three adapters over two slots (evictions), DoRA arriving late
    (adapter 3; without `dora`, its plain LoRA twin), an adapter unloaded, one replaced under its id."""
    mgr = AdapterManager(model, lora_dtype=lora_dtype)
    for lora_id, (name, seed, ranks, is_dora) in ADAPTERS.items():
        mgr.register(lora_id, _adapter(name, seed, ranks, dora=is_dora and dora))
    engine = ServingEngine(model, mgr, max_seqs=2, max_len=16, min_prefill_len=8, keep_logits=True, backend=backend)
    out = []

    def run(ids):
        reqs = [Request([5 + i, 7, 11 + 2 * i], lora_id=lid, max_new_tokens=2, request_id=i)
                for i, lid in enumerate(ids)]
        out.extend(np.asarray(c.logits) for c in engine.generate(reqs))
    run([1, 2])
    run([3, None])                           # DoRA arrives: the banks gain lora_scale (layout change)
    mgr.unload(2)
    run([1, 3])
    mgr.unregister(1)
    mgr.register(1, _adapter("a2", 9, {"self_attn.o_proj": 7, "mlp.up_proj": 1}))
    run([1, 2])
    return out


@pytest.mark.parametrize("lora_dtype", [None, "fp8"])
def test_stacked_equals_per_layer_xla(lora_dtype):
    got = _serve(_model(stack=True), "xla", lora_dtype)
    want = _serve(_model(stack=False), "xla", lora_dtype)
    assert len(got) == len(want) == 8
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g, w)
    assert max(float(np.abs(g - got[0][:1]).max()) for g in got[1:]) > 0      # the adapters change the logits


def test_stacked_equals_per_layer_triton_interpreter():
    """The Triton backend reads a banked layer's weights as views of the stacked arrays (the layer's
    element offset); Triton's interpreter runs the kernels on the CPU."""
    got = _serve(_model(stack=True), "triton")
    want = _serve(_model(stack=False), "triton")
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g, w)


def test_stacked_fused_path_equals_per_layer_triton_interpreter():
    """fused="norm" (qkv and gate_up: the norm with the shrink, then the GEMM with the expand; o and
    down: "gemm"): a banked layer hands the fused kernels views of its entry of the stacked arrays."""
    got = _serve(_model(stack=True, fused="norm"), "triton", dora=False)
    want = _serve(_model(stack=False, fused="norm"), "triton", dora=False)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g, w)


def test_banked_variables_read_and_write_their_entry():
    model = _model(2)
    banks = dict(model.lora_banks.items())
    assert sorted(banks) == ["mlp_down_proj", "mlp_gate_up_proj", "self_attn_o_proj", "self_attn_qkv_proj"]
    qkv = [layer.self_attn.qkv_proj for layer in model.model.layers]
    assert all(q.banked and q.bank is banks["self_attn_qkv_proj"] for q in qkv)
    assert [q.layer_index for q in qkv] == [0, 1]
    assert isinstance(qkv[1].lora_a, BankedVariable) and qkv[1].lora_a.shape == (3, 2, 8, 32)
    value = jax_helpers.rand(3, 2, 8, 32)
    qkv[1].lora_a.set_value(value)
    np.testing.assert_array_equal(banks["self_attn_qkv_proj"].lora_a.get_value()[1], value)
    assert not np.asarray(banks["self_attn_qkv_proj"].lora_a.get_value()[0]).any()
    with pytest.raises(ValueError, match=r"lora_a of layer 1 has shape \(3, 2, 8, 32\)"):
        qkv[1].lora_a.set_value(value[0])
    assert qkv[0].use_fp8() and not qkv[1].use_fp8()                # one bank: both layers switch
    assert qkv[1].lora_dtype == "fp8" and qkv[1].lora_a_scale.shape == (3, 2, 8)
    before = {n: np.asarray(getattr(qkv[1], n).get_value()) for n in banks["self_attn_qkv_proj"].names()}
    assert lnn.unstack_lora_layers(model)
    assert getattr(model, "lora_banks", None) is None and not qkv[1].banked
    assert qkv[1].lora_dtype == "fp8" and not qkv[1].dora
    for n, v in before.items():
        np.testing.assert_array_equal(np.asarray(getattr(qkv[1], n).get_value()), v)
    assert _lora_leaves(model) == 5 * 2 + 3 * 3 * 2 + 6          # fp8 qkv per layer, 3 kinds, embedding, head


def test_split_model_gives_the_layers_their_variables_back():
    """shard (tensor parallelism) splits layers one by one: the banks are given back first (the
    values kept), and shard_layer refuses a banked layer by name."""
    from jax_lora import parallel
    model = _model(2)
    qkv = model.model.layers[1].self_attn.qkv_proj
    value = jax_helpers.rand(3, 2, 8, 32)
    qkv.lora_a.set_value(value)
    with pytest.raises(ValueError, match="layer-stacked LoRA bank"):
        parallel.shard_layer(qkv, jax_helpers.cpu_mesh((2,)), kind="column")
    model.shard(jax_helpers.cpu_mesh((2,)))
    assert not qkv.banked and qkv.tp is not None and getattr(model, "lora_banks", None) is None
    assert _lora_leaves(model) == 3 * 4 * 2 + 6
    np.testing.assert_array_equal(np.asarray(qkv.lora_a.get_value()), value)     # A's global value


def test_wrapper_layer_argument_is_checked():
    bank = LoRABank({"lora_a": jnp.zeros((2, 1, 2, 4, 8)), "lora_b": jnp.zeros((2, 2, 8, 4)),
                     "lora_ranks": jnp.full((2, 2), 4, jnp.int32)})
    w = jax_helpers.wrapper([0, 1], [1, 2])
    y, x = jnp.zeros((2, 8)), jnp.ones((2, 8))
    args = (y, x, bank.lora_a.get_value(), bank.lora_b.get_value(), 1.0, (8,))
    with pytest.raises(ValueError, match=r"layer must be in \[0, 2\)"):
        w.add_lora_linear_stacked(*args, lora_ranks=bank.lora_ranks.get_value(), layer=2)
    with pytest.raises(TypeError, match="layer must be an int"):
        w.add_lora_linear_stacked(*args, layer=True)
    with pytest.raises(ValueError, match="lora_ranks must be stacked over the same 2 layers"):
        w.add_lora_linear_stacked(*args, lora_ranks=jnp.full((3,), 4, jnp.int32), layer=0)
    with pytest.raises(ValueError, match=r"with layer=, lora_a must be \(n, S, L, r, H\)"):
        w.add_lora_linear_stacked(y, x, jnp.zeros((1, 2, 4, 8)), jnp.zeros((2, 8, 4)), 1.0, (8,), layer=0)


def _gpu():
    from jax_lora.ops import ffi_launcher
    if jax.default_backend() != "gpu":
        pytest.skip("needs a CUDA GPU for JAX")
    if not ffi_launcher.available():
        pytest.skip(f"the XLA FFI launcher cannot be used here: {ffi_launcher.unavailable_reason()}")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_gpu_stacked_equals_per_layer_ffi(dtype):
    """On a CUDA GPU the Triton kernels run through the XLA FFI launcher, reading a banked layer's
    weights at its byte offset into the stacked operands: the same logits bit for bit as per-layer
    variables (16-bit and fp8 storage)."""
    _gpu()
    for lora_dtype in (None, "fp8"):
        got = _serve(_model(stack=True, dtype=dtype), "triton", lora_dtype)
        want = _serve(_model(stack=False, dtype=dtype), "triton", lora_dtype)
        for g, w in zip(got, want):
            np.testing.assert_array_equal(g, w)


@pytest.mark.gpu
@pytest.mark.parametrize("fused", ["gemm", "norm"])
def test_gpu_stacked_fused_path_equals_per_layer(fused):
    """The fused LoRA linears (jax_lora.ops.fused_linear) of banked layers read their entry of the
    stacked arrays as views: the same logits as per-layer variables (no DoRA: the fused path has
    no column scale)."""
    _gpu()
    got = _serve(_model(stack=True, dtype=jnp.bfloat16, fused=fused), "triton", dora=False)
    want = _serve(_model(stack=False, dtype=jnp.bfloat16, fused=fused), "triton", dora=False)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g, w)
