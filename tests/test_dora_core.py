"""DoRA without a framework (lora_core.dora, lora_core.peft): PEFT's use_dora adapters are read with
their magnitude vectors, and the per-column scale g = m / ||W + s B A||_row reproduces PEFT's own
DoRA layer; the backends apply it in the expand's epilogue. Layers built without DoRA support
refuse DoRA adapters with a clear error (serving them: tests/test_dora_peft.py for JAX,
tests/test_dora_torch.py for torch).

CPU: the reference backends, torch's Triton backend in the interpreter, pallas_tpu in TPU
interpret mode.
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from lora_core.dora import column_scale
from lora_core.peft import AdapterError, load_peft_adapter

from . import jax_helpers
from .impls import torch_triton_device, triton_runs

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

CFG = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
           vocab_size=64)


@pytest.fixture(scope="module")
def dora_dir(tmp_path_factory):
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**CFG))
    pm = peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                                    use_dora=True, init_lora_weights=False))
    with torch.no_grad():                                   # a magnitude that is not the initial norm
        for module in pm.modules():
            if hasattr(module, "lora_magnitude_vector") and "default" in module.lora_magnitude_vector:
                module.lora_magnitude_vector["default"].weight.mul_(1.5).add_(0.1)
    path = str(tmp_path_factory.mktemp("dora"))
    pm.save_pretrained(path)
    return path, pm


def test_use_dora_adapters_are_read_with_their_magnitudes(dora_dir):
    path, _ = dora_dir
    ad = load_peft_adapter(path)
    q = ad.magnitudes["model.layers.0.self_attn.q_proj"]
    v = ad.magnitudes["model.layers.0.self_attn.v_proj"]
    assert q.shape == (32,) and v.shape == (16,) and q.dtype == np.float32
    assert ad.config["use_dora"] is True


def test_column_scale_reproduces_peft_dora_layer(dora_dir):
    path, pm = dora_dir
    ad = load_peft_adapter(path)
    layer = pm.base_model.model.model.layers[0].self_attn.q_proj
    x = torch.randn(5, 32, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = layer(x).double().numpy()
    m = ad.modules["model.layers.0.self_attn.q_proj"]
    w = layer.base_layer.weight.detach().double().numpy()
    g = column_scale(w, m.lora_a, m.lora_b, m.scaling, ad.magnitudes["model.layers.0.self_attn.q_proj"])
    xd = x.double().numpy()
    got = g * (xd @ w.T + m.scaling * (xd @ m.lora_a.T) @ m.lora_b.T)
    assert np.abs(got - want).max() < 1e-5 * max(1.0, np.abs(want).max())
    assert np.abs(g - 1).max() > 0.1                          # the scale matters in this test


def test_column_scale_rejects_bad_shapes_and_zero_rows():
    w, a, b = np.ones((4, 3)), np.ones((2, 3)), np.zeros((4, 2))
    with pytest.raises(ValueError, match="magnitude must have shape"):
        column_scale(w, a, b, 1.0, np.ones(3))
    with pytest.raises(ValueError, match="do not fit"):
        column_scale(w, a, np.ones((4, 3)), 1.0, np.ones(4))
    w[1] = 0
    with pytest.raises(ValueError, match="all-zero rows"):
        column_scale(w, a, b, 1.0, np.ones(4))


def _edit(src, dst, config=None, drop=None, reshape=None):
    from safetensors.numpy import load_file, save_file
    os.makedirs(dst, exist_ok=True)
    with open(os.path.join(src, "adapter_config.json")) as f:
        cfg = json.load(f)
    cfg.update(config or {})
    with open(os.path.join(dst, "adapter_config.json"), "w") as f:
        json.dump(cfg, f)
    tensors = load_file(os.path.join(src, "adapter_model.safetensors"))
    for key in list(tensors):
        if drop and drop in key:
            del tensors[key]
        elif reshape and reshape in key:
            tensors[key] = tensors[key][:-1]
    save_file(tensors, os.path.join(dst, "adapter_model.safetensors"), metadata={"format": "pt"})
    return dst


def test_bad_dora_files_name_what_is_wrong(dora_dir, tmp_path):
    path, _ = dora_dir
    with pytest.raises(AdapterError, match="use_dora false"):
        load_peft_adapter(_edit(path, str(tmp_path / "a"), config={"use_dora": False}))
    with pytest.raises(AdapterError, match="have no lora_magnitude_vector"):
        load_peft_adapter(_edit(path, str(tmp_path / "b"), drop="q_proj.lora_magnitude_vector"))
    with pytest.raises(AdapterError, match=r"expected \(32,\)"):
        load_peft_adapter(_edit(path, str(tmp_path / "c"), reshape="q_proj.lora_magnitude_vector"))
    with pytest.raises(AdapterError, match="'use_dora' must be true or false"):
        load_peft_adapter(_edit(path, str(tmp_path / "d"), config={"use_dora": "yes"}))


def test_torch_models_without_dora_take_dora_adapters(dora_dir):
    """A MultiLoRAModel built without dora=True takes a DoRA adapter: the column scale of each
    layer it reaches is allocated when the adapter is placed in a slot (ones for every other
    slot), as with dora=True up front."""
    path, _ = dora_dir
    import torch_lora.hf
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**CFG))
    mm = torch_lora.hf.MultiLoRAModel(model, max_loras=2, max_rank=8, backend="torch")
    assert not any(getattr(layer, "dora", False) for layer in mm.layers.values())
    mm.load_adapter("d", path)
    assert mm.loaded_adapters == ["d"]
    import torch
    with torch.no_grad():
        mm(torch.tensor([[1, 2, 3]]), adapter_names=["d"])
    scaled = [layer for layer in mm.layers.values() if getattr(layer, "dora", False)]
    assert scaled, "no layer allocated a DoRA column scale"
    for layer in scaled:
        assert layer.dora_scale.shape == (2, layer.out_features)
        assert not bool((layer.dora_scale == 1).all()), "the adapter's column scale was not written"


def test_reference_expands_apply_the_column_scale_per_token_slot():
    """Xla and torch reference expands (and their batch-invariant forms): a token's new slice
    values are g[slot] * (y + buf @ B[slot].T + bias), rows without a slot untouched."""
    import jax.numpy as jnp

    from jax_lora.meta import LoRAKernelMeta
    from jax_lora.ops import invariant as jinv
    from jax_lora.ops import xla
    from torch_lora.meta import LoRAKernelMeta as TorchMeta
    from torch_lora.ops import invariant as tinv
    from torch_lora.ops import torch_ref

    rng = np.random.default_rng(4)
    T, L, r, widths = 6, 3, 4, (5, 3)
    idx = np.array([0, -1, 2, 1, 2, 0], np.int32)
    buf = rng.standard_normal((2, T, r)).astype(np.float32)
    b = [rng.standard_normal((L, n, r)).astype(np.float32) for n in widths]
    bias = [rng.standard_normal((L, n)).astype(np.float32) for n in widths]
    g = [rng.uniform(0.5, 2.0, (L, n)).astype(np.float32) for n in widths]
    y = rng.standard_normal((T, 10)).astype(np.float32)
    offsets = (0, 5)
    want = y.astype(np.float64).copy()
    for t, i in enumerate(idx):
        if i < 0:
            continue
        for s, (n, off) in enumerate(zip(widths, offsets)):
            want[t, off:off + n] = g[s][i] * (want[t, off:off + n] + buf[s, t] @ b[s][i].T + bias[s][i])
    meta = LoRAKernelMeta.build(idx, L, T)
    for op in (xla.expand, jinv.expand):
        got = op(jnp.asarray(buf), [jnp.asarray(v) for v in b], jnp.asarray(y), meta, offsets, True,
                 bias=[jnp.asarray(v) for v in bias], col_scale=[jnp.asarray(v) for v in g])
        assert np.abs(np.asarray(got, np.float64) - want).max() < 1e-4
    tmeta = TorchMeta.make(max_loras=L, max_num_tokens=T, device="cpu")
    tmeta.prepare_tensors(torch.from_numpy(idx).long())
    for op in (torch_ref.expand, tinv.expand):
        yt = torch.from_numpy(y.copy())
        op(torch.from_numpy(buf), [torch.from_numpy(v) for v in b], yt, tmeta.meta_args(T), offsets, True,
           bias=[torch.from_numpy(v) for v in bias], col_scale=[torch.from_numpy(v) for v in g])
        assert np.abs(yt.double().numpy() - want).max() < 1e-4


@pytest.mark.parametrize("fused", [False, True])
def test_triton_kernels_apply_the_column_scale_in_the_epilogue(fused):
    """The JAX Triton backend (compiled on a GPU, Triton's interpreter elsewhere): expand and add_lora_linear's kernels
    (split shrink + expand, and the one-launch fused kernel) multiply a slice's new value by the
    slot's column scale in their epilogue, equal to the xla reference; a slice with both a bias and
    a scale is refused."""
    if not triton_runs():
        pytest.skip("no GPU and Triton's interpreter is not on (TRITON_INTERPRET=1 before import)")
    import jax.numpy as jnp

    from jax_lora.meta import LoRAKernelMeta
    from jax_lora.ops import triton as tri
    from jax_lora.ops import xla

    rng = np.random.default_rng(5)
    T, L, r, H, widths = 7, 3, 16, 32, (16, 32)
    idx = np.array([0, -1, 2, 1, 2, 0, 1], np.int32)
    x = jnp.asarray(rng.standard_normal((T, H)), jnp.float32)
    a = [jnp.asarray(rng.standard_normal((L, r, H)) / 6, jnp.float32) for _ in widths]
    b = [jnp.asarray(rng.standard_normal((L, n, r)) / 4, jnp.float32) for n in widths]
    g = [jnp.asarray(rng.uniform(0.5, 2.0, (L, n)), jnp.float32) for n in widths]
    bias = [None, jnp.asarray(rng.standard_normal((L, 32)), jnp.float32)]
    y = jnp.asarray(rng.standard_normal((T, 48)), jnp.float32)
    meta = LoRAKernelMeta.build(idx, L, T)
    scale_only = [g[0], None]                                   # slice 0 scaled, slice 1 biased
    buf = xla.shrink(x, a, meta, 0.5)
    want = xla.expand(buf, b, y, meta, (0, 16), True, bias=bias, col_scale=scale_only)
    got = tri.linear(y, x, a, b, meta, 0.5, (0, 16), bias=bias, fused=fused, col_scale=scale_only)
    assert np.abs(np.asarray(got) - np.asarray(want)).max() < 1e-4
    got = tri.expand(buf, b, y, meta, (0, 16), True, bias=bias, col_scale=scale_only)
    assert np.abs(np.asarray(got) - np.asarray(want)).max() < 1e-4
    with pytest.raises(ValueError, match="both a LoRA bias and a DoRA column scale"):
        tri.expand(buf, b, y, meta, (0, 16), True, bias=bias, col_scale=g)


@pytest.mark.parametrize("fused", [False, True])
def test_jax_triton_kernels_take_float32_scales_with_bfloat16_weights(fused):
    """A bf16 MultiLoRALinear(dora=True) passes float32 lora_scale beside bf16 weights: the kernels'
    unused epilogue slots must not mix pointer types (they take a present vector, not B)."""
    if not triton_runs():
        pytest.skip("no GPU and Triton's interpreter is not on (TRITON_INTERPRET=1 before import)")
    import jax.numpy as jnp

    from jax_lora.meta import LoRAKernelMeta
    from jax_lora.ops import triton as tri
    from jax_lora.ops import xla

    rng = np.random.default_rng(7)
    T, L, r, H = 5, 2, 16, 32
    idx = np.array([0, -1, 1, 1, 0], np.int32)
    x = jnp.asarray(rng.standard_normal((T, H)), jnp.bfloat16)
    a = [jnp.asarray(rng.standard_normal((L, r, H)) / 6, jnp.bfloat16)]
    b = [jnp.asarray(rng.standard_normal((L, 16, r)) / 4, jnp.bfloat16)]
    g = [jnp.asarray(rng.uniform(0.5, 2.0, (L, 16)), jnp.float32)]
    y = jnp.asarray(rng.standard_normal((T, 16)), jnp.bfloat16)
    meta = LoRAKernelMeta.build(idx, L, T)
    want = xla.expand(xla.shrink(x, a, meta, 0.5), b, y, meta, (0,), True, col_scale=g)
    got = tri.linear(y, x, a, b, meta, 0.5, (0,), fused=fused, col_scale=g)
    assert got.dtype == jnp.bfloat16
    assert np.abs(np.asarray(got, np.float32) - np.asarray(want, np.float32)).max() < 5e-2


@pytest.mark.parametrize("fused", [False, True])
def test_torch_triton_backend_applies_the_column_scale(fused):
    """torch's Triton backend (compiled on a GPU, the interpreter elsewhere): linear (split and fused) and expand
    equal the torch reference with a DoRA column scale on one slice and a bias on the other."""
    if not triton_runs():
        pytest.skip("no GPU and Triton's interpreter is not on (TRITON_INTERPRET=1 before import)")
    from torch_lora.meta import LoRAKernelMeta as TorchMeta
    from torch_lora.ops import torch_ref
    from torch_lora.ops import triton as tri

    gen = torch.Generator().manual_seed(6)
    dev = torch_triton_device()
    T, L, r, H, widths = 7, 3, 16, 32, (16, 32)
    idx = torch.tensor([0, -1, 2, 1, 2, 0, 1], device=dev)
    x = torch.randn(T, H, generator=gen).to(dev)
    a = [(torch.randn(L, r, H, generator=gen) / 6).to(dev) for _ in widths]
    b = [(torch.randn(L, n, r, generator=gen) / 4).to(dev) for n in widths]
    g = [(torch.rand(L, 16, generator=gen) + 0.5).to(dev), None]
    bias = [None, torch.randn(L, 32, generator=gen).to(dev)]
    y0 = torch.randn(T, 48, generator=gen).to(dev)
    meta = TorchMeta.make(max_loras=L, max_num_tokens=T, device=dev)
    meta.prepare_tensors(idx)
    args = meta.meta_args(T)
    buf = torch.empty(2, T, r, device=dev)
    torch_ref.shrink(x, a, buf, args, 0.5)
    want = y0.clone()
    torch_ref.expand(buf, b, want, args, (0, 16), True, bias=bias, col_scale=g)
    got = y0.clone()
    tri.linear(got, x, a, b, args, 0.5, (0, 16), bias=bias, fused=fused, col_scale=g)
    assert (got - want).abs().max() < 1e-4
    got = y0.clone()
    tri.expand(buf, b, got, args, (0, 16), True, bias=bias, col_scale=g)
    assert (got - want).abs().max() < 1e-4


@pytest.mark.parametrize("backend,deterministic", [("xla", False), ("xla", True), ("triton", False),
                                                   ("triton", True), ("pallas_tpu", False)])
def test_jax_wrapper_add_lora_linear_with_dora_scales(backend, deterministic):
    """jax_lora.PunicaWrapper.add_lora_linear(..., dora_scale_stacked=): every backend that applies
    the scale equals the float64 oracle; the others refuse it by name."""
    import jax.numpy as jnp

    import jax_lora
    from jax_lora import LoRAMapping
    if backend == "triton" and not triton_runs():
        pytest.skip("no GPU and Triton's interpreter is not on")
    rng = np.random.default_rng(8)
    T, L, r, H, widths = 6, 3, 16, 32, (16, 32)
    ids = (1, 0, 3, 2, 3, 1)
    x = rng.standard_normal((T, H)).astype(np.float32)
    a = [(rng.standard_normal((L, 1, r, H)) / 6).astype(np.float32) for _ in widths]
    b = [(rng.standard_normal((L, 1, n, r)) / 4).astype(np.float32) for n in widths]
    g = [rng.uniform(0.5, 2.0, (L, n)).astype(np.float32) for n in widths]
    y = rng.standard_normal((T, 48)).astype(np.float32)
    want = y.astype(np.float64).copy()
    for t, i in enumerate(ids):
        if i:
            off = 0
            for s, n in enumerate(widths):
                d = 0.5 * (x[t] @ a[s][i - 1, 0].T) @ b[s][i - 1, 0].T
                want[t, off:off + n] = g[s][i - 1] * (want[t, off:off + n] + d)
                off += n
    w = jax_lora.PunicaWrapper(16, 4, None, max_loras=L, backend=backend, deterministic=deterministic)
    w.update_metadata(LoRAMapping(ids, ids), [1, 2, 3], L + 1, 64)
    got = w.add_lora_linear(jnp.asarray(y), jnp.asarray(x), [jnp.asarray(v) for v in a], [jnp.asarray(v) for v in b],
                            None, 0.5, widths, dora_scale_stacked=[jnp.asarray(v) for v in g])
    assert np.abs(np.asarray(got, np.float64) - want).max() < 1e-4
    with pytest.raises(ValueError, match=r"dora_scale_stacked\[1\] must have shape"):
        w.add_lora_linear(jnp.asarray(y), jnp.asarray(x), a, b, None, 0.5, widths,
                          dora_scale_stacked=[g[0], g[0]])


def test_backends_without_column_scales_refuse_them(monkeypatch):
    """A backend that does not declare COLUMN_SCALE (every built-in one does) is refused by name,
    never handed scales it would ignore."""
    import jax.numpy as jnp

    import jax_lora
    from jax_lora import LoRAMapping
    from jax_lora.ops import pallas_tpu
    monkeypatch.setattr(pallas_tpu, "COLUMN_SCALE", False)
    w = jax_lora.PunicaWrapper(16, 4, None, max_loras=2, backend="pallas_tpu")
    w.update_metadata(LoRAMapping((1, 2), (1, 2)), [1, 2], 3, 64)
    a = [jnp.zeros((2, 16, 128), jnp.float32)]
    b = [jnp.zeros((2, 128, 16), jnp.float32)]
    with pytest.raises(ValueError, match="backend 'pallas_tpu' does not apply DoRA column scales"):
        w.add_lora_linear(jnp.zeros((2, 128)), jnp.zeros((2, 128)), a, b, None, 1.0, (128,),
                          dora_scale_stacked=[jnp.ones((2, 128))])


@pytest.mark.parametrize("backend", ["xla", "pallas_tpu"])
def test_jax_wrapper_refuses_a_bias_and_a_scale_on_one_slice(backend):
    """As the torch wrapper: one epilogue vector per slice, on every backend (the xla reference could
    compute both, the kernels cannot)."""
    import jax.numpy as jnp

    import jax_lora
    from jax_lora import LoRAMapping
    w = jax_lora.PunicaWrapper(16, 4, None, max_loras=2, backend=backend)
    w.update_metadata(LoRAMapping((1, 2), (1, 2)), [1, 2], 3, 64)
    a = [jnp.zeros((2, 1, 16, 32), jnp.float32)] * 2
    b = [jnp.zeros((2, 1, n, 16), jnp.float32) for n in (16, 32)]
    bias = [None, jnp.zeros((2, 32), jnp.float32)]
    with pytest.raises(ValueError, match=r"slice 1 has both a LoRA bias \(lora_bias_stacked\[1\]\) and a DoRA "
                                         r"column scale \(dora_scale_stacked\[1\]\)"):
        w.add_lora_linear(jnp.zeros((2, 48)), jnp.zeros((2, 32)), a, b, bias, 1.0, (16, 32),
                          dora_scale_stacked=[None, jnp.ones((2, 32))])
    with pytest.raises(ValueError, match=r"dora_scale_stacked\[0\] must have shape \(2, 16\)"):
        w.add_lora_linear(jnp.zeros((2, 48)), jnp.zeros((2, 32)), a, b, None, 1.0, (16, 32),
                          dora_scale_stacked=[jnp.ones((2, 8)), None])


def test_dora_column_scale_formula_and_wrapper_epilogue():
    """lora_core.dora.column_scale is g = m / ||W + s B A||_row; the wrapper's
    add_lora_linear(dora_scale_stacked=) gives a slot's tokens g[idx] * (y + delta) and leaves rows
    without adapter untouched; a slice with both a LoRA bias and a DoRA scale is refused naming
    both."""
    from lora_core.dora import column_scale
    W, a, b = jax_helpers.rand(6, 5), jax_helpers.rand(2, 5), jax_helpers.rand(6, 2)
    m = np.abs(jax_helpers.rand(6)) + 0.5
    g = column_scale(W, a, b, 0.7, m)
    np.testing.assert_allclose(g, m / np.linalg.norm(W.astype(np.float64) + 0.7 * b @ a, axis=1), rtol=1e-6)
    ids = (1, 0, 3, 1)
    idx = jax_helpers.ids_to_slots(ids)
    w = jax_helpers.wrapper(ids, jax_helpers.LORA_INDEX_TO_ID)
    T, H, r, L, widths = 4, 8, 4, 3, (6, 4)
    x, y = jax_helpers.rand(T, H), jax_helpers.rand(T, 10)
    A = [jax_helpers.rand(L, r, H) for _ in widths]
    Bw = [jax_helpers.rand(L, n, r) for n in widths]
    G = [np.abs(jax_helpers.rand(L, n)) + 0.5 for n in widths]
    out = w.add_lora_linear(y, x, A, Bw, None, 1.0, widths, dora_scale_stacked=G)
    want, o = np.array(y, np.float64), 0
    for s, n in enumerate(widths):
        want = jax_helpers.expand_ref(want, jax_helpers.shrink_ref(x, A[s], idx, 1.0), Bw[s], idx, o, True)
        for t, i in enumerate(idx):
            if i >= 0:
                want[t, o:o + n] *= G[s][i]
        o += n
    assert jax_helpers.rel_err(out, want) < 1e-5
    np.testing.assert_array_equal(np.asarray(out)[1], y[1])
    with pytest.raises(ValueError) as e:
        w.add_lora_linear(y, x, A, Bw, [jax_helpers.rand(L, 6), None], 1.0, widths, dora_scale_stacked=G)
    assert "lora_bias_stacked[0]" in str(e.value) and "dora_scale_stacked[0]" in str(e.value)


def test_pallas_tpu_dora_epilogue_through_the_wrapper():
    """The per-slot column scale belongs in the expand's epilogue on every backend:
    pallas_tpu (TPU interpret mode) applies DoRA column scales through
    add_lora_linear, equal to the float64 oracle."""
    ids = (1, 0, 2)
    idx = jax_helpers.ids_to_slots(ids)
    w = jax_helpers.wrapper(ids, jax_helpers.LORA_INDEX_TO_ID, backend="pallas_tpu")
    T, H, r, L, N = 3, 128, 8, 3, 128
    x, y = jax_helpers.rand(T, H), jax_helpers.rand(T, N)
    A, B = jax_helpers.rand(L, r, H, scale=0.2), jax_helpers.rand(L, N, r, scale=0.2)
    G = np.abs(jax_helpers.rand(L, N)) + 0.5
    out = w.add_lora_linear(y, x, [A], [B], None, 1.0, (N,), dora_scale_stacked=[G])
    want = jax_helpers.expand_ref(y, jax_helpers.shrink_ref(x, A, idx, 1.0), B, idx, 0, True)
    for t, i in enumerate(idx):
        if i >= 0:
            want[t] *= G[i]
    assert jax_helpers.rel_err(out, want) < 1e-5
