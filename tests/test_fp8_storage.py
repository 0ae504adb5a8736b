"""fp8 (e4m3) adapter storage on the torch side (contract section 11): `MultiLoRAModel(...,
lora_dtype="fp8")` against PEFT, and fp8 PEFT files.

A tiny random Llama in float32 on the CPU (tests/test_torch_hf.py's `Family`). With fp8 slots a
mixed batch stays within FP8_OF_EFFECT of PEFT relative to the adapter's own effect on the logits
(the quantisation error of e4m3: a few percent of the LoRA term, never of the base model); an fp8
PEFT file (F8_E4M3 weights with `weight_scale` tensors) loads as it is into fp8 slots (the stored
bits are the file's) and dequantised into 16/32-bit slots, both equal to PEFT running the
dequantised weights within float32's tolerance; bad fp8 files are refused from their header. The LM
head's slots are fp8 too (against the float64 oracle on its dequantised slot, and an fp8 file's
LM-head values kept as they are), and so are the embedding's: its LoRA-A table with one scale per
row, against the float64 oracle on its dequantised slot, and the whole fp8 model with an embedding
LoRA equal to PEFT running the dequantised adapter.
"""

from __future__ import annotations

import json
import os

import ml_dtypes
import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
safetensors_torch = pytest.importorskip("safetensors.torch")

from torch_lora import AdapterError  # noqa: E402

from . import oracle  # noqa: E402
from .test_torch_hf import RTOL, VOCAB, Family, _rel  # noqa: E402

# A mixed batch's logits through fp8 slots differ from PEFT's by at most this fraction of the
# adapter's own effect (max |peft - base|): e4m3 rounds each weight by at most 2^-4 relative, so a
# product of an A and a B term by at most about 2 * 2^-4 = 0.125 (measured here: 0.05-0.10).
FP8_OF_EFFECT = 0.15
ROWS = ["a", "b", "__base__", "c", "d", "b"]
INTERPRETER_ONLY = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1",
    reason="Triton on CPU tensors runs in the interpreter (a GPU run takes the cuda case)")


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return Family(tmp_path_factory.mktemp("fp8-llama"), "llama")


def _tokens(n=None):
    return torch.as_tensor(np.random.default_rng(5).integers(1, VOCAB, size=(n or len(ROWS), 6)))


def test_fp8_slots_match_peft_within_the_quantisation_error(llama):
    mm = llama.wrapped(lora_dtype="fp8")
    linear = [layer for layer in mm.layers.values() if type(layer).__name__ == "LoRALinear"]
    assert linear and all(layer.lora_a.dtype == torch.float8_e4m3fn and layer.lora_b[0].dtype == torch.float8_e4m3fn
                          for layer in linear)
    head = [layer for layer in mm.layers.values() if type(layer).__name__ == "LoRALogits"]
    assert head and all(layer.lora_a.dtype == torch.float8_e4m3fn and layer.lora_b.dtype == torch.float8_e4m3fn
                        for layer in head)                   # the LM head's slots: fp8 too ("c" targets it)
    embed = [layer for layer in mm.layers.values() if type(layer).__name__ == "LoRAEmbedding"]
    assert embed and all(layer.lora_a.dtype == torch.float8_e4m3fn and layer.lora_b.dtype == torch.float8_e4m3fn
                         and layer.lora_a_scale.shape == (layer.max_loras, layer.num_embeddings)
                         for layer in embed)                 # the embedding's slots: fp8 too ("c" targets it)
    tokens = _tokens()
    out = mm(tokens, adapter_names=ROWS).logits.numpy()
    full = llama.wrapped()(tokens, adapter_names=ROWS).logits.numpy()
    for j, adapter in enumerate(ROWS):
        want = llama.alone(adapter, tokens[j])
        if adapter == "__base__":
            assert _rel(out[j], want) < RTOL
            continue
        effect = _rel(want, llama.alone("__base__", tokens[j]))
        assert _rel(out[j], want) <= FP8_OF_EFFECT * effect, (adapter, _rel(out[j], want), effect)
        assert _rel(out[j], full[j]) > 1e-7                        # the slots really hold e4m3 values


def _quantize_file(src: str, dst: str, per_tensor_b: bool) -> dict:
    """dst: src's PEFT adapter with every linear lora_A / lora_B in F8_E4M3 (contract section 11's
    rule, tests/oracle.py) and their weight_scale tensors (A per channel, B per channel or per
    tensor); returns {tensor name: dequantised float64 array}."""
    os.makedirs(dst, exist_ok=True)
    with open(os.path.join(src, "adapter_config.json")) as f:
        config = json.load(f)
    with open(os.path.join(dst, "adapter_config.json"), "w") as f:
        json.dump(config, f)
    tensors = safetensors_torch.load_file(os.path.join(src, "adapter_model.safetensors"))
    out, deq = {}, {}
    for name, t in tensors.items():
        if ".lora_A." not in name and ".lora_B." not in name:
            out[name] = t
            continue
        w = t.double().numpy()
        if per_tensor_b and ".lora_B." in name:
            q, scale = oracle.fp8_quantize(w.reshape(1, -1))
            q, scale = q.reshape(w.shape), scale.reshape(())
        else:
            q, scale = oracle.fp8_quantize(w)
        out[name] = torch.from_numpy(np.ascontiguousarray(q).view(np.uint8)).view(torch.float8_e4m3fn)
        out[name.removesuffix(".weight") + ".weight_scale"] = torch.from_numpy(np.asarray(scale, np.float32))
        deq[name] = oracle.fp8_dequantize(q[None], np.reshape(scale, (1,) + np.shape(scale)))[0] \
            if np.ndim(scale) else oracle.fp8_dequantize(q[None], np.reshape(scale, (1,)))[0]
    safetensors_torch.save_file(out, os.path.join(dst, "adapter_model.safetensors"))
    return deq


def test_fp8_peft_file_loads_as_it_is(llama, tmp_path):
    """An fp8 file of adapter "b" (every linear module, rank_pattern, rslora): into fp8 slots its e4m3
    bits unchanged, into float32 slots dequantised; both equal PEFT with the dequantised weights."""
    deq = _quantize_file(llama.dirs["b"], str(tmp_path / "b8"), per_tensor_b=True)
    pm = llama.peft["b"]
    with torch.no_grad():
        state = {k: v.clone() for k, v in pm.state_dict().items()}
        for k in state:
            key = k.replace(".default", "")
            if key in deq:
                state[k] = torch.from_numpy(deq[key]).float()
        dequantised = peft.get_peft_model(llama.fresh(), pm.peft_config["default"]).eval()
        dequantised.load_state_dict(state)
    tokens = _tokens(3)
    with torch.no_grad():
        want = [dequantised(tokens[j][None]).logits[0].numpy() for j in range(3)]
    for lora_dtype in ("fp8", None):
        mm = llama.wrapped(adapters=(), lora_dtype=lora_dtype)
        mm.load_adapter("b8", str(tmp_path / "b8"))
        out = mm(tokens, adapter_names=["b8", "b8", "__base__"]).logits.numpy()
        assert _rel(out[0], want[0]) < RTOL and _rel(out[1], want[1]) < RTOL, lora_dtype
        if lora_dtype == "fp8":
            q_file = safetensors_torch.load_file(str(tmp_path / "b8" / "adapter_model.safetensors"))
            layer = mm.layers["model.layers.0.self_attn.q_proj+k_proj+v_proj"]
            slot = int(np.flatnonzero(np.asarray([i or 0 for i in mm.adapters.lora_index_to_id]) == mm._ids["b8"])[0])
            a_file = q_file["base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"]
            assert torch.equal(layer.lora_a[0, slot, :a_file.shape[0]].view(torch.uint8), a_file.view(torch.uint8))


@pytest.mark.parametrize("change,match", [
    ("drop_scale", "F8_E4M3 without its scale"),
    ("scale_shape", r"expected F32 \(\d+,\) per channel or \(\) / \(1,\) per tensor"),
    ("scale_f16", "expected F32"),
    ("one_side", "both lora_A and lora_B are F8_E4M3"),
    ("stray_scale", "have no lora_A / lora_B pair"),
])
def test_bad_fp8_files_are_refused_from_the_header(llama, tmp_path, change, match):
    _quantize_file(llama.dirs["a"], str(tmp_path / "ok"), per_tensor_b=False)
    path = str(tmp_path / "ok" / "adapter_model.safetensors")
    tensors = safetensors_torch.load_file(path)
    a_key = next(k for k in sorted(tensors) if k.endswith("lora_A.weight"))
    scale_key = a_key.removesuffix(".weight") + ".weight_scale"
    if change == "drop_scale":
        del tensors[scale_key]
    elif change == "scale_shape":
        tensors[scale_key] = torch.ones(3)
    elif change == "scale_f16":
        tensors[scale_key] = tensors[scale_key].half()
    elif change == "one_side":
        tensors[a_key] = tensors[a_key].float()
        del tensors[scale_key]
    else:
        tensors["base_model.model.model.layers.0.self_attn.o_proj.lora_A.weight_scale"] = torch.ones(4)
    safetensors_torch.save_file(tensors, path)
    mm = llama.wrapped(adapters=(), lora_dtype="fp8")
    with pytest.raises(AdapterError, match=match):
        mm.load_adapter("bad", str(tmp_path / "ok"))


@pytest.mark.parametrize("backend, device", [("torch", "cpu"), pytest.param("triton", "cpu", marks=INTERPRETER_ONLY),
                                             pytest.param("triton", "cuda", marks=pytest.mark.gpu)])
def test_fp8_lm_head_slot_holds_the_contract_quantisation_and_matches_the_float64_oracle(tmp_path, backend, device):
    """LoRALogits(lora_dtype="fp8") under AdapterManager: the slot holds contract section 11's e4m3
    values and scales of the placed A (r, H) and B * scaling (V, r) (tests/oracle.py's rule), and
    the layer's logits (torch reference ops, Triton's kernels) equal the float64 oracle on those
    dequantised weights (a row without an adapter unchanged)."""
    from lora_core.host_mapping import LoRAMapping
    from torch_lora import PunicaWrapper
    from torch_lora.adapters import AdapterManager, load_peft_adapter, save_peft_adapter
    from torch_lora.layers import LoRALogits

    H, V, R, L = 16, 40, 8, 2
    rng = np.random.default_rng(3)
    path = str(tmp_path / "head")
    save_peft_adapter(path, {"lm_head": (rng.normal(size=(4, H)) / 4, rng.normal(size=(V, 4)))}, r=4, lora_alpha=8)
    punica = PunicaWrapper(8, 4, device, max_loras=L, backend=backend)
    head = LoRALogits("lm_head", H, V, max_loras=L, max_rank=R, dtype=torch.float32, device=device, punica=punica,
                      lora_dtype="fp8")
    assert head.lora_a.dtype == head.lora_b.dtype == torch.float8_e4m3fn
    assert head.lora_a_scale.shape == (L, R) and head.lora_b_scale.shape == (L, V)
    mgr = AdapterManager({"head": head})
    mgr.register(7, path)
    slot = list(mgr.activate([7])).index(7)
    a, b, scaling, _ = load_peft_adapter(path).modules["lm_head"]
    a_pad, b_pad = np.zeros((R, H)), np.zeros((V, R))
    a_pad[:4], b_pad[:, :4] = a, b * scaling
    (a_q, a_s), (b_q, b_s) = oracle.fp8_quantize(a_pad), oracle.fp8_quantize(b_pad)
    host = {name: getattr(head, name).cpu() for name in ("lora_a", "lora_b", "lora_a_scale", "lora_b_scale")}
    assert np.array_equal(host["lora_a"][slot].view(torch.uint8).numpy(), np.asarray(a_q).view(np.uint8))
    assert np.array_equal(host["lora_b"][slot].view(torch.uint8).numpy(), np.asarray(b_q).view(np.uint8))
    assert np.array_equal(host["lora_a_scale"][slot].numpy(), a_s)
    assert np.array_equal(host["lora_b_scale"][slot].numpy(), b_s)
    rows = (7, 0, 7)
    punica.update_metadata(LoRAMapping(rows, rows), mgr.lora_index_to_id, mgr.num_slots + 1, V)
    x = rng.standard_normal((3, H)).astype(np.float32)
    y = rng.standard_normal((3, V)).astype(np.float32)
    got = head.apply(torch.from_numpy(x).to(device), torch.from_numpy(y.copy()).to(device)).cpu().numpy()
    stacked = lambda w, s: oracle.fp8_dequantize(w.view(torch.uint8).numpy().view(ml_dtypes.float8_e4m3fn),
                                                 s.numpy())
    idx = np.array([slot if r else -1 for r in rows])
    a64, b64 = stacked(host["lora_a"], host["lora_a_scale"]), stacked(host["lora_b"], host["lora_b_scale"])
    want = oracle.logits(y, x, a64, b64, 1.0, idx)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(got[1], y[1])


def _round_trip_embeddings(src: str, dst: str) -> None:
    """dst: src's adapter with its (16-bit) embedding factors replaced by what an fp8 embedding slot
    holds, dequantised: the table A.T (V, r) per token row, B * scaling per output row (divided by
    the scaling again: the loader folds it in), so float32 slots of dst hold fp8 slots' values of src."""
    from torch_lora.adapters import load_peft_adapter

    def round_trip(w):
        q, scale = oracle.fp8_quantize(w[None])
        return oracle.fp8_dequantize(q, scale)[0]

    os.makedirs(dst, exist_ok=True)
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        with open(os.path.join(src, name), "rb") as f, open(os.path.join(dst, name), "wb") as g:
            g.write(f.read())
    path = os.path.join(dst, "adapter_model.safetensors")
    tensors = safetensors_torch.load_file(path)
    for module, (a, b, scaling, kind) in load_peft_adapter(src).modules.items():
        if kind == "embedding":
            a64, b64 = np.asarray(a, np.float64), np.asarray(b, np.float64)
            tensors[f"base_model.model.{module}.lora_embedding_A"] = torch.from_numpy(round_trip(a64.T).T).float()
            tensors[f"base_model.model.{module}.lora_embedding_B"] = torch.from_numpy(
                round_trip(b64 * scaling) / scaling).float()
    safetensors_torch.save_file(tensors, path)


def test_fp8_peft_file_keeps_its_lm_head_values_in_fp8_slots(llama, tmp_path):
    """An fp8 file of adapter "c" (embedding, LM head, up_proj): the LM head's fp8 slot holds the
    file's A bits and scales as they are, B's scales times the module's scaling; the logits equal
    the float32 slots' of the same file (the dequantised values; its 16-bit embedding factors
    replaced by their fp8 round trip, as the fp8 embedding slot quantises them) within float32
    rounding."""
    _quantize_file(llama.dirs["c"], str(tmp_path / "c8"), per_tensor_b=False)
    _round_trip_embeddings(str(tmp_path / "c8"), str(tmp_path / "c8deq"))
    q_file = safetensors_torch.load_file(str(tmp_path / "c8" / "adapter_model.safetensors"))
    tokens = _tokens(2)
    outs = {}
    for lora_dtype in ("fp8", None):
        mm = llama.wrapped(adapters=(), lora_dtype=lora_dtype)
        mm.load_adapter("c8", str(tmp_path / ("c8" if lora_dtype == "fp8" else "c8deq")))
        outs[lora_dtype] = mm(tokens, adapter_names=["c8", "__base__"]).logits.numpy()
        if lora_dtype == "fp8":
            head = mm.layers["lm_head"]
            slot = int(np.flatnonzero(np.asarray([i or 0 for i in mm.adapters.lora_index_to_id]) == mm._ids["c8"])[0])
            a_file = q_file["base_model.model.lm_head.lora_A.weight"]
            r = a_file.shape[0]
            assert torch.equal(head.lora_a[slot, :r].view(torch.uint8), a_file.view(torch.uint8))
            assert torch.equal(head.lora_a_scale[slot, :r], q_file["base_model.model.lm_head.lora_A.weight_scale"])
            scaling = 4 / 2                                                      # lora_alpha / r
            assert torch.allclose(head.lora_b_scale[slot],
                                  q_file["base_model.model.lm_head.lora_B.weight_scale"] * scaling, rtol=1e-7)
    assert _rel(outs["fp8"][0], outs[None][0]) < RTOL and _rel(outs["fp8"][1], outs[None][1]) < RTOL


def _dequantised_peft(llama, adapter: str):
    """PEFT's model of `adapter` with every factor replaced by what an fp8 slot holds, dequantised
    (float64 oracle rule, tests/oracle.py): the slot quantises A (r, H) per rank row, an embedding's
    table A.T (V, r) per token row, and B * scaling (out, r) per output row; B is divided by the
    scaling again here (PEFT multiplies by it)."""
    from torch_lora.adapters import load_peft_adapter

    def round_trip(w):
        q, scale = oracle.fp8_quantize(w[None])
        return oracle.fp8_dequantize(q, scale)[0]

    deq = {}
    for module, (a, b, scaling, kind) in load_peft_adapter(llama.dirs[adapter]).modules.items():
        a64, b64 = np.asarray(a, np.float64), np.asarray(b, np.float64)
        names = ("lora_embedding_A", "lora_embedding_B") if kind == "embedding" else ("lora_A", "lora_B")
        deq[(module, names[0])] = round_trip(a64.T).T if kind == "embedding" else round_trip(a64)
        deq[(module, names[1])] = round_trip(b64 * scaling) / scaling
    pm = llama.peft[adapter]
    with torch.no_grad():
        state = {k: v.clone() for k, v in pm.state_dict().items()}
        for (module, name), w in deq.items():
            key = next(k for k in state if k.startswith(f"base_model.model.{module}.{name}."))
            state[key] = torch.from_numpy(w).to(state[key].dtype)
        model = peft.get_peft_model(llama.fresh(), pm.peft_config["default"]).eval()
        model.load_state_dict(state)
    return model, deq


def test_fp8_model_with_an_embedding_lora_equals_peft_on_the_dequantised_adapter(llama):
    """Adapter "c" (embedding, LM head, up_proj) in an fp8 model: the logits equal PEFT's with the
    adapter's factors replaced by their fp8 round trip, within float32's tolerance; the embedding's
    fp8 term matters (it differs from the 16-bit adapter's)."""
    model, deq = _dequantised_peft(llama, "c")
    assert any(name == "lora_embedding_A" for _, name in deq)
    tokens = _tokens(2)
    mm = llama.wrapped(adapters=("c",), lora_dtype="fp8")
    out = mm(tokens, adapter_names=["c", "__base__"]).logits.numpy()
    with torch.no_grad():
        want = model(tokens[:1]).logits[0].numpy()
    assert _rel(out[0], want) < RTOL, _rel(out[0], want)
    assert _rel(out[1], llama.alone("__base__", tokens[1])) < RTOL
    assert _rel(out[0], llama.alone("c", tokens[0])) > 10 * RTOL          # the slots really hold e4m3 values


@pytest.mark.parametrize("backend, device", [("torch", "cpu"), pytest.param("triton", "cpu", marks=INTERPRETER_ONLY),
                                             pytest.param("triton", "cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("pairs", [False, True], ids=["one_adapter", "two_adapters"])
def test_fp8_embedding_slot_holds_the_contract_quantisation_and_matches_the_float64_oracle(tmp_path, backend,
                                                                                              device, pairs):
    """LoRAEmbedding(lora_dtype="fp8") under AdapterManager: the slot holds contract section 11's
    e4m3 values and scales of the placed table A.T (V, r) (one scale per token row) and of B *
    scaling (D, r) (tests/oracle.py's rule), and the layer's output equals the float64 oracle on
    those dequantised weights (a token without an adapter unchanged), one adapter per token or two
    weighted ones."""
    from lora_core.host_mapping import LoRAMapping
    from torch_lora import PunicaWrapper
    from torch_lora.adapters import AdapterManager, load_peft_adapter, save_peft_adapter
    from torch_lora.layers import LoRAEmbedding

    V, D, R, L = 24, 16, 8, 2
    rng = np.random.default_rng(4)
    paths = []
    for name in ("e1", "e2"):
        paths.append(str(tmp_path / name))
        save_peft_adapter(paths[-1], {"embed_tokens": (rng.normal(size=(4, V)), rng.normal(size=(D, 4)))}, r=4,
                          lora_alpha=8)
    punica = PunicaWrapper(8, 4, device, max_loras=L, backend=backend)
    emb = LoRAEmbedding("embed_tokens", V, D, max_loras=L, max_rank=R, dtype=torch.float32, device=device,
                        punica=punica, lora_dtype="fp8")
    assert emb.lora_a.dtype == emb.lora_b.dtype == torch.float8_e4m3fn
    assert emb.lora_a_scale.shape == (L, V) and emb.lora_b_scale.shape == (L, D)
    mgr = AdapterManager({"embed": emb})
    for lid, path in zip((7, 8), paths):
        mgr.register(lid, path)
    slots = list(mgr.activate([7, 8]))
    host = {name: getattr(emb, name).cpu() for name in ("lora_a", "lora_b", "lora_a_scale", "lora_b_scale")}
    for lid, path in zip((7, 8), paths):
        slot = slots.index(lid)
        a, b, scaling, kind = load_peft_adapter(path).modules["embed_tokens"]
        assert kind == "embedding"
        a_pad, b_pad = np.zeros((V, R)), np.zeros((D, R))
        a_pad[:, :4], b_pad[:, :4] = np.asarray(a).T, b * scaling
        (a_q, a_s), (b_q, b_s) = oracle.fp8_quantize(a_pad), oracle.fp8_quantize(b_pad)
        assert np.array_equal(host["lora_a"][slot].view(torch.uint8).numpy(), np.asarray(a_q).view(np.uint8))
        assert np.array_equal(host["lora_b"][slot].view(torch.uint8).numpy(), np.asarray(b_q).view(np.uint8))
        assert np.array_equal(host["lora_a_scale"][slot].numpy(), a_s)
        assert np.array_equal(host["lora_b_scale"][slot].numpy(), b_s)
    stacked = lambda w, s: oracle.fp8_dequantize(w.view(torch.uint8).numpy().view(ml_dtypes.float8_e4m3fn),
                                                 s.numpy())
    a64, b64 = stacked(host["lora_a"], host["lora_a_scale"]), stacked(host["lora_b"], host["lora_b_scale"])
    ids = np.array([3, 0, 23, 11, 5])
    if pairs:
        rows, weights = ((7, 8), (), (8,), (8, 7), (7,)), ((0.5, -1.5), (), (2.0,), (1.0, 0.25), (0.75,))
        mapping = LoRAMapping(rows, (7,) * len(rows), False, weights)
    else:
        rows, weights = ((7,), (), (8,), (8,), (7,)), ((1.0,), (), (1.0,), (1.0,), (1.0,))
        mapping = LoRAMapping(tuple(r[0] if r else 0 for r in rows), (7,) * len(rows))
    punica.update_metadata(mapping, mgr.lora_index_to_id, mgr.num_slots + 1, V)
    y = rng.standard_normal((len(ids), D)).astype(np.float32)
    got = emb.apply(torch.from_numpy(ids).to(device), torch.from_numpy(y.copy()).to(device)).cpu().numpy()
    want = y.astype(np.float64)
    for t, (lids, ws) in enumerate(zip(rows, weights)):
        for lid, wt in zip(lids, ws):
            s = slots.index(lid)
            want[t] += wt * (b64[s] @ a64[s, ids[t]])
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(got[1], y[1])
