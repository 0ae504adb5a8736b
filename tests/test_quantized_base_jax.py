"""LoRA over a weight-only quantized base in JAX (jax_lora.quant): int8 and float8_e4m3fn kernels with
per-output-channel scales, against float64 NumPy oracles and the dequantized model.

Quantization (scales, rounding, clipping, zero columns) against a float64 oracle; `QuantizedLinear` and
a `MultiLoRALinear` over it (float32 and bfloat16 activations) against x @ (Q s) + b + LoRA in
float64; the tiny Llama loaded with `load_llama(..., quantize=...)` served by `ServingEngine` with
mixed adapters equal to the dequantized float model with each adapter merged; `quantize_model` gives
the same layers as quantizing on load; the refusals (unknown quantize, DoRA over a quantized base,
quantizing after add_lora, save_llama, shard / mesh). CPU, xla backend; the serving check again with
the Triton backend on a GPU (marked `gpu`).
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx

from jax_lora import nn as lnn
from jax_lora import quant
from jax_lora.adapters import AdapterError, AdapterManager, dora_scales, load_peft_adapter
from jax_lora.cli import verify
from jax_lora.models import add_lora, load_llama, save_llama
from jax_lora.serving import Request, ServingEngine

from . import jax_helpers, llama_checkpoint

QMAX = {"int8": 127.0, "fp8": 448.0}
MAX_LEN = 32


def oracle_quantize(w: np.ndarray, kind: str) -> tuple:
    """(Q as float64, s float64) of a kernel (in, out): the module docstring's rule in float64."""
    w = np.asarray(w, np.float64)
    amax = np.abs(w).max(axis=0)
    s = np.where(amax > 0, amax / QMAX[kind], 1.0)
    q = w / s
    if kind == "int8":
        q = np.clip(np.rint(q), -127, 127)
    else:
        q = np.clip(q, -448, 448).astype(ml_dtypes.float8_e4m3fn).astype(np.float64)
    return q, s


@pytest.mark.parametrize("kind", ["int8", "fp8"])
def test_quantize_kernel_matches_float64_oracle(kind):
    """Q and s equal the float64 oracle (s in float32 rounding; Q exactly); a zero column gets s = 1
    and Q = 0; every weight is within half a step (int8) / 2^-4 relative plus half the smallest
    subnormal step (fp8) of its dequantized value."""
    w = jax_helpers.rand(24, 10, scale=0.7)
    w[:, 3] = 0.0
    w[5, 7] = 9.0                                               # one outlier sets its column's scale
    q, s = quant.quantize_kernel(w, kind)
    assert q.dtype == quant.QUANTIZED_DTYPES[kind][0] and s.dtype == jnp.float32
    want_q, want_s = oracle_quantize(w, kind)
    np.testing.assert_allclose(np.asarray(s, np.float64), want_s, rtol=1e-7)
    np.testing.assert_array_equal(np.asarray(q).astype(np.float64), want_q)
    assert float(s[3]) == 1.0 and not np.any(np.asarray(q)[:, 3].astype(np.float64))
    deq = np.asarray(q).astype(np.float64) * want_s
    err = np.abs(deq - w)
    bound = want_s / 2 if kind == "int8" else np.abs(w) * 2.0 ** -4 + want_s * 2.0 ** -10
    assert np.all(err <= bound + 1e-12)
    assert float(np.abs(np.asarray(q).astype(np.float64)).max()) == QMAX[kind]


@pytest.mark.parametrize("kind", ["int8", "fp8"])
@pytest.mark.parametrize("dtype,tol", [(jnp.float32, 1e-6), (jnp.bfloat16, 2e-2)])
def test_lora_over_quantized_linear_equals_dequantized_oracle(kind, dtype, tol):
    """A MultiLoRALinear (two slices) over a QuantizedLinear with a bias: base-only and with one
    adapter per token (slot -1 = none) equal x @ (Q s) + b + x A^T B^T in float64 (relative error
    within tol: float32 1e-6, bfloat16 2e-2); the adapter weights take the activation dtype."""
    h, widths, r = 16, (8, 12), 4
    w, b = jax_helpers.rand(h, sum(widths), scale=0.3), jax_helpers.rand(sum(widths))
    base = quant.QuantizedLinear.from_kernel(w, b, quantize=kind, dtype=dtype)
    layer = lnn.MultiLoRALinear(base, max_loras=2, max_rank=r, output_slices=widths)
    assert layer.lora_a.get_value().dtype == jnp.dtype(dtype)
    a = jax_helpers.rand(2, 2, r, h, scale=0.5)
    bb = jax_helpers.rand(2, sum(widths), r, scale=0.5)
    layer.lora_a.set_value(jnp.asarray(a, dtype))
    layer.lora_b.set_value(jnp.asarray(bb, dtype))
    x = jax_helpers.rand(5, h)
    ids = [1, 0, 2, 2, 1]
    wrapper = jax_helpers.wrapper(ids, [1, 2], vocab=8)
    got = np.asarray(layer(jnp.asarray(x, dtype), punica=wrapper), np.float64)
    got_base = np.asarray(layer(jnp.asarray(x, dtype)), np.float64)
    xd = np.asarray(jnp.asarray(x, dtype), np.float64)            # the input as the layer sees it
    a_d = np.asarray(jnp.asarray(a, dtype), np.float64)
    b_d = np.asarray(jnp.asarray(bb, dtype), np.float64)
    deq = np.asarray(base.qkernel.get_value()).astype(np.float64) * np.asarray(base.scale.get_value(), np.float64)
    want_base = xd @ deq + np.asarray(base.bias.get_value(), np.float64)
    want = want_base.copy()
    for t, slot in enumerate(jax_helpers.ids_to_slots(ids)):
        if slot < 0:
            continue
        off = 0
        for s, n in enumerate(widths):
            want[t, off:off + n] += (xd[t] @ a_d[s, slot].T) @ b_d[slot, off:off + n].T
            off += n
    assert jax_helpers.rel_err(got_base, want_base) < tol
    assert jax_helpers.rel_err(got, want) < tol
    assert jax_helpers.rel_err(got, got_base) > 10 * tol            # the adapters move the output


@pytest.fixture(scope="module")
def llama_dirs(tmp_path_factory):
    return llama_checkpoint.write_assets(tmp_path_factory.mktemp("quantized_llama"))


def _dequantized_float_model(model_dir, qmodel):
    """The float Llama whose linears hold the quantized model's dequantized kernels Q s."""
    ref = load_llama(model_dir)
    for path, layer in quant.quantized_layers(qmodel).items():
        node = ref
        for p in path.split("."):
            node = node[int(p)] if p.isdigit() else getattr(node, p)
        node.kernel.set_value(layer.dequantized_kernel())
    return ref


def _serve_and_verify(model_dir, dirs, qmodel, backend=None):
    """Serves mixed requests (three adapters and base rows) on the quantized model and checks each
    completion against the dequantized float model with its adapter merged (1e-4, greedy tokens)."""
    ref = _dequantized_float_model(model_dir, qmodel)
    add_lora(qmodel, max_loras=2, max_rank=8)
    mgr = AdapterManager(qmodel, host_cache_size=2)
    for i, d in dirs.items():
        mgr.register(i, d)
    engine = ServingEngine(qmodel, mgr, max_seqs=4, max_len=MAX_LEN, keep_logits=True, backend=backend)
    rng = np.random.default_rng(5)
    reqs = [Request([int(t) for t in rng.integers(0, 64, size=int(rng.integers(2, 9)))], lora_id=lid,
                    max_new_tokens=4, request_id=i) for i, lid in enumerate([1, None, 2, 3, 2, None])]
    out = engine.generate(reqs)
    matches, worst, _ = verify(ref, {i: load_peft_adapter(d) for i, d in dirs.items()}, out, max_len=MAX_LEN,
                               rtol=1e-4)
    assert all(matches), worst
    return ref


@pytest.mark.parametrize("kind", ["int8", "fp8"])
def test_serving_engine_on_quantized_llama_equals_dequantized_merged_model(llama_dirs, kind):
    """load_llama(quantize=...) quantizes the four decoder linears (embedding and LM head stay
    float); ServingEngine.generate with three adapters and base rows mixed gives, per completion,
    the logits (1e-4 relative) and greedy tokens of the dequantized float model with its adapter
    merged; quantize_model on the float model gives the same quantized layers as quantizing on load."""
    qmodel = load_llama(llama_dirs["model"], quantize=kind)
    layers = quant.quantized_layers(qmodel)
    assert sorted(p.rsplit(".", 1)[-1] for p in layers) == ["down_proj", "gate_up_proj", "o_proj", "qkv_proj"]
    assert all(layer.quantize == kind for layer in layers.values())
    again = load_llama(llama_dirs["model"])
    assert set(quant.quantize_model(again, kind)) == set(layers)
    for path, layer in quant.quantized_layers(again).items():
        for name in ("qkernel", "scale"):
            np.testing.assert_array_equal(np.asarray(getattr(layer, name).get_value()),
                                          np.asarray(getattr(layers[path], name).get_value()))
    dirs = {1: llama_dirs["a1"], 2: llama_dirs["a2"], 3: llama_dirs["a3"]}
    ref = _serve_and_verify(llama_dirs["model"], dirs, qmodel)
    # The quantization is real: the float model's logits differ from the quantized model's.
    float_model = load_llama(llama_dirs["model"])
    tokens, pos = np.array([[1, 5, 9, 2]], np.int32), np.arange(4, dtype=np.int32)[None]
    f = np.asarray(float_model(tokens, pos)[0], np.float64)
    d = np.asarray(ref(tokens, pos)[0], np.float64)
    assert jax_helpers.rel_err(d, f) > 1e-3          # int8 moves them by ~3e-3, fp8 by ~3e-2


def test_quantized_base_refusals(llama_dirs, tmp_path):
    """Unknown quantize names, DoRA over a quantized base (dora=True, or a DoRA adapter loaded onto
    it), quantize_model after add_lora or with nothing matching, save_llama of a quantized model and
    splitting it over a mesh are refused with errors naming the cause."""
    with pytest.raises(ValueError, match="quantize"):
        load_llama(llama_dirs["model"], quantize="int4")
    with pytest.raises(ValueError, match="quantize"):
        quant.quantize_kernel(np.ones((2, 2), np.float32), "nf4")
    with pytest.raises(ValueError, match="NaN"):
        quant.quantize_kernel(np.array([[1.0, np.nan]], np.float32), "int8")
    with pytest.raises(TypeError, match="qkernel"):
        quant.QuantizedLinear(jnp.ones((2, 2), jnp.float32), jnp.ones((2,)))
    base = quant.QuantizedLinear.from_kernel(jax_helpers.rand(4, 4), quantize="fp8")
    with pytest.raises(ValueError, match="dora"):
        lnn.MultiLoRALinear(base, max_loras=1, max_rank=2, dora=True)
    qmodel = load_llama(llama_dirs["model"], quantize="int8")
    with pytest.raises(ValueError, match="save the model before quantizing"):
        save_llama(qmodel, str(tmp_path / "q"))
    mesh = nnx.Rngs  # any object: the refusal comes before the mesh is read
    with pytest.raises(NotImplementedError, match="mesh"):
        qmodel.shard(mesh)
    with pytest.raises(NotImplementedError, match="mesh"):
        load_llama(llama_dirs["model"], quantize="fp8", mesh=mesh)
    with pytest.raises(ValueError, match="match no"):
        quant.quantize_model(load_llama(llama_dirs["model"]), "int8", target_modules=["qproj"])
    model = load_llama(llama_dirs["model"])
    add_lora(model, max_loras=1, max_rank=2, target_modules=["q_proj"])
    with pytest.raises(ValueError, match="before adding multi-LoRA layers"):
        quant.quantize_model(model, "int8")
    # A DoRA adapter (a1 with magnitudes on q_proj) over the quantized qkv_proj is refused at load.
    add_lora(qmodel, max_loras=1, max_rank=8)
    plain = load_peft_adapter(llama_dirs["a1"])
    module = "model.layers.0.self_attn.q_proj"
    dora_adapter = dataclasses.replace(plain, magnitudes={module: np.ones(32, np.float32)})
    with pytest.raises(AdapterError, match="quantized layer"):
        dora_scales(qmodel, dora_adapter)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["int8", "fp8"])
def test_gpu_triton_serving_on_quantized_llama_equals_dequantized_merged_model(llama_dirs, kind):
    """The serving check above on a GPU with the Triton backend (float32 model, full-precision
    matmuls): completions equal the dequantized float model with each adapter merged (1e-4)."""
    import jax
    if jax.default_backend() != "gpu":
        pytest.skip("JAX has no GPU here")
    dirs = {1: llama_dirs["a1"], 2: llama_dirs["a2"], 3: llama_dirs["a3"]}
    _serve_and_verify(llama_dirs["model"], dirs, load_llama(llama_dirs["model"], quantize=kind), backend="triton")
