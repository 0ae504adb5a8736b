"""fp8 PEFT files with an embedding LoRA (contract section 11), on both frameworks' AdapterManagers.

An fp8 file's `lora_embedding_A` (r, V) is F8_E4M3 with `lora_embedding_A.weight_scale` (V,) float32,
one per token id (a column of lora_embedding_A: the row of the table A.T the token looks up), or
one per tensor; its `lora_embedding_B` (D, r) has `(D,)` or per-tensor scales, as any B. The files
here use scales twice the contract's amax / 448, so a requantisation of the dequantised values would
give other bytes: fp8 slots hold the file's bytes and scales as they are (B's scale times the
module's scaling), and the layer's output equals the float64 oracle run on the file's dequantised
weights; float32 slots hold the dequantised weights and equal the same oracle. Bad scale tensors
are refused from the header, with the tensor named and the shape expected.
"""

from __future__ import annotations

import os

import ml_dtypes
import numpy as np
import pytest

from lora_core.peft import AdapterError, load_peft_adapter, save_peft_adapter

from . import oracle

V, D, RANK, ALPHA = 24, 16, 4, 8
SCALING = ALPHA / RANK
INTERPRETER_ONLY = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1",
    reason="Triton on CPU tensors runs in the interpreter (a GPU run takes the cuda case)")


def _quantize(w, axis: int, per_tensor: bool = False):
    """(e4m3 values, float32 scales) of w with one scale per slice along `axis` (or one per tensor):
    twice the contract's amax / 448, so the values span [-224, 224] (not the manager's own rule)."""
    w = np.asarray(w, np.float64)
    amax = np.abs(w).max() if per_tensor else np.abs(w).max(axis=axis)
    scale = np.asarray(2 * amax / oracle.FP8_MAX, np.float32)
    s64 = scale.astype(np.float64) if per_tensor else np.expand_dims(scale.astype(np.float64), axis)
    return (w / s64).astype(ml_dtypes.float8_e4m3fn), scale


def write_fp8_embedding_file(path: str, module: str, seed: int = 0, per_tensor_b: bool = False,
                             vocab: int = V, dim: int = D, edit=None) -> dict:
    """An adapter directory with `module` (an embedding) in fp8: lora_embedding_A (RANK, vocab) with
    one scale per column (token id), lora_embedding_B (dim, RANK) per row (or per tensor); `edit`
    (optional) changes the {name: array} dict before it is written (uint8 arrays become F8_E4M3).
    Returns the stored values: {"a_q" (r, V), "a_scale" (V,), "b_q" (D, r), "b_scale" (D,) or ()}."""
    from safetensors.numpy import save_file

    rng = np.random.default_rng(seed)
    a, b = rng.normal(size=(RANK, vocab)), rng.normal(size=(dim, RANK))
    save_peft_adapter(path, {module: (a, b)}, r=RANK, lora_alpha=ALPHA)
    a_q, a_scale = _quantize(a, axis=0)
    b_q, b_scale = _quantize(b, axis=1, per_tensor=per_tensor_b)
    prefix = f"base_model.model.{module}."
    tensors = {prefix + "lora_embedding_A": a_q.view(np.uint8), prefix + "lora_embedding_A.weight_scale": a_scale,
               prefix + "lora_embedding_B": b_q.view(np.uint8), prefix + "lora_embedding_B.weight_scale": b_scale}
    if edit is not None:
        edit(tensors)
    save_file(tensors, os.path.join(path, "adapter_model.safetensors"))
    _retag_fp8(os.path.join(path, "adapter_model.safetensors"))
    return {"a_q": a_q, "a_scale": a_scale, "b_q": b_q, "b_scale": b_scale}


def _retag_fp8(file: str) -> None:
    """Marks the U8 tensors of a safetensors file as F8_E4M3 (same bytes; safetensors.numpy has no
    e4m3 dtype): the header rewritten, padded to 8 bytes, the data section unchanged."""
    import json
    import struct

    with open(file, "rb") as f:
        data = f.read()
    n = struct.unpack("<Q", data[:8])[0]
    header = json.loads(data[8:8 + n])
    for info in header.values():
        if isinstance(info, dict) and info.get("dtype") == "U8":
            info["dtype"] = "F8_E4M3"
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    with open(file, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text + data[8 + n:])


def _dequantised(stored: dict):
    """float64 (A (r, V), B (D, r)) the file stands for: a_q * a_scale per column, b_q * b_scale."""
    a = stored["a_q"].astype(np.float64) * stored["a_scale"].astype(np.float64)[None, :]
    b = stored["b_q"].astype(np.float64) * np.reshape(stored["b_scale"].astype(np.float64), (-1, 1))
    return a, b


def test_the_loader_reads_an_fp8_embedding_as_its_dequantised_factors(tmp_path):
    stored = write_fp8_embedding_file(str(tmp_path / "e"), "model.embed_tokens", per_tensor_b=True)
    adapter = load_peft_adapter(str(tmp_path / "e"))
    a, b = _dequantised(stored)
    module = adapter.modules["model.embed_tokens"]
    assert module.kind == "embedding"
    np.testing.assert_array_equal(module.lora_a, a.astype(np.float32))
    np.testing.assert_array_equal(module.lora_b, b.astype(np.float32))
    factors = adapter.fp8["model.embed_tokens"]
    assert factors.a_scale.shape == (V,) and factors.b_scale.shape == (D,)
    np.testing.assert_array_equal(factors.a_q, stored["a_q"].astype(np.float32))


@pytest.mark.parametrize("change,match", [
    ("a_scale_per_rank", r"lora_embedding_A.weight_scale' is F32 \(4,\); expected F32 \(24,\) per token id"),
    ("b_scale_shape", r"lora_embedding_B.weight_scale' is F32 \(3,\); expected F32 \(16,\) per channel"),
    ("a_scale_f16", r"lora_embedding_A.weight_scale' is F16 \(24,\); expected F32"),
    ("drop_a_scale", r"lora_embedding_A' is F8_E4M3 without its scale"),
    ("one_side", r"both lora_embedding_A and lora_embedding_B are F8_E4M3"),
    ("linear_scale", r"is an embedding \(lora_embedding_A / lora_embedding_B\) but has a weight_scale of lora_A"),
])
def test_bad_fp8_embedding_files_are_refused_from_the_header(tmp_path, change, match):
    prefix = "base_model.model.model.embed_tokens."

    def edit(tensors):
        if change == "a_scale_per_rank":
            tensors[prefix + "lora_embedding_A.weight_scale"] = np.ones(RANK, np.float32)
        elif change == "b_scale_shape":
            tensors[prefix + "lora_embedding_B.weight_scale"] = np.ones(3, np.float32)
        elif change == "a_scale_f16":
            tensors[prefix + "lora_embedding_A.weight_scale"] = np.ones(V, np.float16)
        elif change == "drop_a_scale":
            del tensors[prefix + "lora_embedding_A.weight_scale"]
        elif change == "one_side":
            tensors[prefix + "lora_embedding_A"] = np.ones((RANK, V), np.float32)
            del tensors[prefix + "lora_embedding_A.weight_scale"]
        else:
            tensors[prefix + "lora_A.weight_scale"] = np.ones(RANK, np.float32)

    path = str(tmp_path / "e")
    write_fp8_embedding_file(path, "model.embed_tokens", edit=edit)
    with pytest.raises(AdapterError, match=match):
        load_peft_adapter(path)


# ----------------------------------------------------------------------------- torch

@pytest.mark.parametrize("backend, device", [("torch", "cpu"), pytest.param("triton", "cpu", marks=INTERPRETER_ONLY),
                                             pytest.param("triton", "cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("lora_dtype", ["fp8", None])
def test_torch_manager_keeps_an_fp8_embedding_file_and_matches_the_float64_oracle(tmp_path, backend, device,
                                                                                   lora_dtype):
    """LoRAEmbedding under torch's AdapterManager, fp8 slots: the file's bytes and scales as they
    are (B's scale times the scaling); float32 slots: the dequantised weights; both: the layer's
    output equals the float64 oracle on the file's dequantised weights, a token without an adapter
    unchanged."""
    torch = pytest.importorskip("torch")
    from lora_core.host_mapping import LoRAMapping
    from torch_lora import PunicaWrapper
    from torch_lora.adapters import AdapterManager
    from torch_lora.layers import LoRAEmbedding

    L, R = 2, 8
    stored = [write_fp8_embedding_file(str(tmp_path / f"e{i}"), "embed_tokens", seed=i, per_tensor_b=bool(i))
              for i in range(2)]
    punica = PunicaWrapper(8, 4, device, max_loras=L, backend=backend)
    emb = LoRAEmbedding("embed_tokens", V, D, max_loras=L, max_rank=R, dtype=torch.float32, device=device,
                        punica=punica, lora_dtype=lora_dtype)
    mgr = AdapterManager({"embed": emb})
    for i in range(2):
        mgr.register(7 + i, str(tmp_path / f"e{i}"))
    slots = list(mgr.activate([7, 8]))
    if lora_dtype == "fp8":
        for i, st in enumerate(stored):
            s = slots.index(7 + i)
            assert np.array_equal(emb.lora_a[s, :, :RANK].cpu().view(torch.uint8).numpy(), st["a_q"].T.view(np.uint8))
            assert np.array_equal(emb.lora_b[s, :, :RANK].cpu().view(torch.uint8).numpy(), st["b_q"].view(np.uint8))
            assert np.array_equal(emb.lora_a_scale[s].cpu().numpy(), st["a_scale"])
            b_scale = np.broadcast_to(st["b_scale"].astype(np.float64) * SCALING, (D,)).astype(np.float32)
            assert np.array_equal(emb.lora_b_scale[s].cpu().numpy(), b_scale)
    ids = np.array([3, 0, 23, 11, 5])
    rows = (7, 0, 8, 8, 7)
    punica.update_metadata(LoRAMapping(rows, (7,) * len(rows)), mgr.lora_index_to_id, mgr.num_slots + 1, V)
    y = np.random.default_rng(9).standard_normal((len(ids), D)).astype(np.float32)
    got = emb.apply(torch.from_numpy(ids).to(device), torch.from_numpy(y.copy()).to(device)).cpu().numpy()
    want = y.astype(np.float64)
    for t, lid in enumerate(rows):
        if lid:
            a, b = _dequantised(stored[lid - 7])
            want[t] += SCALING * (b @ a[:, ids[t]])
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(got[1], y[1])


# ----------------------------------------------------------------------------- JAX

@pytest.mark.parametrize("lora_dtype", ["fp8", None])
def test_jax_manager_keeps_an_fp8_embedding_file_and_matches_the_float64_oracle(tmp_path, lora_dtype):
    """MultiLoRAEmbed of a tiny Llama under JAX's AdapterManager: the same checks as the torch test
    (fp8 slots: the file's bytes and scales; float32 slots: the dequantised weights; the output:
    the float64 oracle on the file's dequantised weights)."""
    jnp = pytest.importorskip("jax.numpy")
    from flax import nnx

    from jax_lora import PunicaWrapper
    from jax_lora import nn as lnn
    from jax_lora.adapters import AdapterManager
    from jax_lora.models import LlamaConfig, LlamaForCausalLM, add_lora
    from lora_core.host_mapping import LoRAMapping

    L, R = 2, 8
    cfg = LlamaConfig(vocab_size=V, hidden_size=D, intermediate_size=24, num_hidden_layers=1, num_attention_heads=4,
                      num_key_value_heads=2)
    model = LlamaForCausalLM(cfg, rngs=nnx.Rngs(0))
    add_lora(model, max_loras=L, max_rank=R, target_modules=("q_proj", "embed_tokens"), lora_dtype=lora_dtype)
    mgr = AdapterManager(model, lora_dtype=lora_dtype)
    emb = next(layer for layer in mgr.layers.values() if isinstance(layer, lnn.MultiLoRAEmbed))
    stored = [write_fp8_embedding_file(str(tmp_path / f"e{i}"), "model.embed_tokens", seed=i, per_tensor_b=bool(i))
              for i in range(2)]
    for i in range(2):
        mgr.register(7 + i, str(tmp_path / f"e{i}"))
    slots = list(mgr.activate([7, 8]))
    if lora_dtype == "fp8":
        assert emb.lora_a.get_value().dtype == jnp.float8_e4m3fn
        for i, st in enumerate(stored):
            s = slots.index(7 + i)
            a_q = np.asarray(emb.lora_a.get_value())[s, :, :RANK]
            b_q = np.asarray(emb.lora_b.get_value())[s, :, :RANK]
            assert np.array_equal(a_q.view(np.uint8), st["a_q"].T.view(np.uint8))
            assert np.array_equal(b_q.view(np.uint8), st["b_q"].view(np.uint8))
            assert np.array_equal(np.asarray(emb.lora_a_scale.get_value())[s], st["a_scale"])
            b_scale = np.broadcast_to(st["b_scale"].astype(np.float64) * SCALING, (D,)).astype(np.float32)
            assert np.array_equal(np.asarray(emb.lora_b_scale.get_value())[s], b_scale)
    ids = np.array([3, 0, 23, 11, 5])
    rows = (7, 0, 8, 8, 7)
    w = PunicaWrapper(16, 16, None, max_loras=L)
    w.update_metadata(LoRAMapping(rows, rows), slots, L + 1, V)
    got = np.asarray(emb(jnp.asarray(ids), punica=w), np.float64)
    want = np.asarray(emb.base.embedding.get_value(), np.float64)[ids]
    for t, lid in enumerate(rows):
        if lid:
            a, b = _dequantised(stored[lid - 7])
            want[t] += SCALING * (b @ a[:, ids[t]])
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
