"""DoRA served on the torch side: torch_lora.PunicaWrapper's dora_scale_stacked (backends torch and
triton, against a float64 oracle, and its plan cache), and torch_lora.hf.MultiLoRAModel(dora=True)
against peft itself on a tiny random Llama with biased attention (float32, CPU): DoRA rows, plain
LoRA rows and rows without an adapter in one batch, through a forward pass, generate() and slot churn.
"""

from __future__ import annotations

import numpy as np
import pytest

from . import hf_llama
from .impls import torch_triton_device, triton_runs
from .test_dora_peft import _raise_magnitudes
from .test_peft_roundtrip import VOCAB, _rel, build_peft_models

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

import torch_lora  # noqa: E402
from torch_lora import LoRAMapping  # noqa: E402
from torch_lora.hf import MultiLoRAModel  # noqa: E402
from torch_lora.layers import LoRALinear  # noqa: E402

from . import torch_helpers  # noqa: E402

RTOL = 1e-4
T, L, R, H, WIDTHS = 6, 3, 16, 32, (16, 32)
IDS = (1, 0, 3, 2, 3, 1)                    # LoRA id per token (0: no adapter); slot = id - 1


def _backend(backend):
    if backend == "triton" and not triton_runs():
        pytest.skip("no GPU and Triton's interpreter is not on (TRITON_INTERPRET=1 before import)")
    return torch_triton_device() if backend == "triton" else "cpu"


def _case(seed=8):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((T, H)).astype(np.float32)
    a = [(rng.standard_normal((L, 1, R, H)) / 6).astype(np.float32) for _ in WIDTHS]
    b = [(rng.standard_normal((L, 1, n, R)) / 4).astype(np.float32) for n in WIDTHS]
    g = [rng.uniform(0.5, 2.0, (L, n)).astype(np.float32) for n in WIDTHS]
    y = rng.standard_normal((T, sum(WIDTHS))).astype(np.float32)
    return x, a, b, g, y


def _oracle(x, a, b, g, y, scale=0.5):
    """float64: y[t, slice s] = g_s[slot] * (y + scale * (x A_s^T) B_s^T) for tokens with a slot
    (g None: no scale), y unchanged elsewhere."""
    want = y.astype(np.float64).copy()
    for t, i in enumerate(IDS):
        if i:
            off = 0
            for s, n in enumerate(WIDTHS):
                d = scale * (x[t].astype(np.float64) @ a[s][i - 1, 0].T) @ b[s][i - 1, 0].T
                gs = 1.0 if g is None else g[s][i - 1]
                want[t, off:off + n] = gs * (want[t, off:off + n] + d)
                off += n
    return want


def _wrapper(backend, device, deterministic=False):
    w = torch_lora.PunicaWrapper(16, 4, device, max_loras=L, backend=backend, deterministic=deterministic)
    w.update_metadata(LoRAMapping(IDS, IDS), [1, 2, 3], L + 1, 64)
    return w


def _t(arrays, device):
    return [torch.from_numpy(v).to(device) for v in arrays]


@pytest.mark.parametrize("backend,deterministic", [("torch", False), ("torch", True), ("triton", False),
                                                   ("triton", True)])
def test_wrapper_dora_scales_equal_the_oracle(backend, deterministic):
    """add_lora_linear and add_expand with dora_scale_stacked: g_s[slot] * (y + delta) per token, as
    (L, n_s) and (L, 1, n_s) scales, within 1e-4 of the float64 oracle; rows without a slot untouched."""
    dev = _backend(backend)
    x, a, b, g, y = _case()
    w = _wrapper(backend, dev, deterministic)
    want = _oracle(x, a, b, g, y)
    A, B, G = _t(a, dev), _t(b, dev), _t(g, dev)
    for scales in (G, [G[0][:, None], G[1]]):
        got = torch.from_numpy(y.copy()).to(dev)
        w.add_lora_linear(got, torch.from_numpy(x).to(dev), A, B, None, 0.5, WIDTHS, dora_scale_stacked=scales)
        assert np.abs(got.cpu().double().numpy() - want).max() < 1e-4
        assert np.array_equal(got[1].cpu().numpy(), y[1])                          # token without adapter
    buf = torch.zeros(len(WIDTHS), T, R, device=dev)
    w.add_shrink(buf, torch.from_numpy(x).to(dev), A, 0.5)
    got = torch.from_numpy(y.copy()).to(dev)
    w.add_expand(got, buf, B, None, WIDTHS, dora_scale_stacked=G)
    assert np.abs(got.cpu().double().numpy() - want).max() < 1e-4
    half = _oracle(x, a, b, [g[0], np.ones_like(g[1])], y)                          # slice 1 unscaled
    got = torch.from_numpy(y.copy()).to(dev)
    w.add_lora_linear(got, torch.from_numpy(x).to(dev), A, B, None, 0.5, WIDTHS, dora_scale_stacked=[G[0], None])
    assert np.abs(got.cpu().double().numpy() - half).max() < 1e-4


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_plan_cache_keeps_dora_and_plain_calls_apart(backend):
    """The same weights called with scales, without, with other scale tensors, and after an in-place
    write of a scale: each call gets its own math (a plan is never shared between them)."""
    dev = _backend(backend)
    x, a, b, g, y = _case(9)
    w = _wrapper(backend, dev)
    A, B, G = _t(a, dev), _t(b, dev), _t(g, dev)
    xt = torch.from_numpy(x).to(dev)

    def run(scales):
        got = torch.from_numpy(y.copy()).to(dev)
        w.add_lora_linear(got, xt, A, B, None, 0.5, WIDTHS, dora_scale_stacked=scales)
        return got.cpu().double().numpy()

    plain, scaled = _oracle(x, a, b, None, y), _oracle(x, a, b, g, y)
    for _ in range(2):                                  # the second round runs cached plans
        assert np.abs(run(G) - scaled).max() < 1e-4
        assert np.abs(run(None) - plain).max() < 1e-4
    ones = [torch.ones_like(v) for v in G]
    assert np.abs(run(ones) - plain).max() < 1e-4       # other scale objects, same weights
    doubled = _oracle(x, a, b, [g[0], 2 * g[1]], y)
    G[1].mul_(2)                                        # a slot write in place is seen
    assert np.abs(run(G) - doubled).max() < 1e-4


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_float32_scales_with_bfloat16_weights(backend):
    """What a bf16 model's DoRA layers pass: bf16 x, y and weights, float32 scales, on one slice, on
    one of two slices (the other without), and beside a bf16 LoRA bias on the other slice (the
    Triton kernels take one dtype for a launch's epilogue vectors: refused by name there)."""
    dev = _backend(backend)
    x, a, b, g, y = _case(10)
    bf = torch.bfloat16
    xb, yb = torch.from_numpy(x).to(bf), torch.from_numpy(y).to(bf)
    A, B = [v.to(bf) for v in _t(a, "cpu")], [v.to(bf) for v in _t(b, "cpu")]
    r = [v.float().numpy() for v in (xb, yb)] + [[v.float().numpy() for v in A], [v.float().numpy() for v in B]]
    w = _wrapper(backend, dev)
    want = _oracle(r[0], r[2], r[3], [g[0], np.ones_like(g[1])], r[1])
    got = yb.clone().to(dev)
    w.add_lora_linear(got, xb.to(dev), [v.to(dev) for v in A], [v.to(dev) for v in B], None, 0.5, WIDTHS,
                      dora_scale_stacked=[torch.from_numpy(g[0]).to(dev), None])
    assert np.abs(got.cpu().double().numpy() - want).max() < 2e-2 * max(1.0, np.abs(want).max())
    got = yb[:, :16].clone().to(dev)
    w.add_lora_linear(got, xb.to(dev), [A[0].to(dev)], [B[0].to(dev)], None, 0.5, (16,),
                      dora_scale_stacked=[torch.from_numpy(g[0]).to(dev)])
    assert np.abs(got.cpu().double().numpy() - want[:, :16]).max() < 2e-2 * max(1.0, np.abs(want).max())
    bias = [None, torch.zeros(L, 32, dtype=bf, device=dev)]
    scales = [torch.from_numpy(g[0]).to(dev), None]
    args = (yb.clone().to(dev), xb.to(dev), [v.to(dev) for v in A], [v.to(dev) for v in B], bias, 0.5, WIDTHS)
    if backend == "triton":
        with pytest.raises(ValueError, match=r"biases / DoRA column scales must share one dtype .* float32 "
                                             r"\(slice 0\), bfloat16 \(slice 1\)"):
            w.add_lora_linear(*args, dora_scale_stacked=scales)
    else:
        w.add_lora_linear(*args, dora_scale_stacked=scales)


def test_wrapper_dora_scale_errors_name_the_argument():
    x, a, b, g, y = _case()
    w = _wrapper("torch", "cpu")
    A, B, G = _t(a, "cpu"), _t(b, "cpu"), _t(g, "cpu")
    yt, xt = torch.from_numpy(y), torch.from_numpy(x)
    with pytest.raises(ValueError, match=r"dora_scale_stacked must have one entry per slice \(2\), got 1"):
        w.add_lora_linear(yt, xt, A, B, None, 0.5, WIDTHS, dora_scale_stacked=[G[0]])
    with pytest.raises(ValueError, match=r"dora_scale_stacked\[1\] must have shape \(3, 32\) or \(3, 1, 32\)"):
        w.add_lora_linear(yt, xt, A, B, None, 0.5, WIDTHS, dora_scale_stacked=[G[0], G[0]])
    with pytest.raises(TypeError, match=r"dora_scale_stacked\[0\] must have dtype in .*got int32"):
        w.add_lora_linear(yt, xt, A, B, None, 0.5, WIDTHS, dora_scale_stacked=[G[0].int(), G[1]])
    with pytest.raises(TypeError, match=r"dora_scale_stacked\[1\] must be a torch.Tensor, got ndarray"):
        w.add_lora_linear(yt, xt, A, B, None, 0.5, WIDTHS, dora_scale_stacked=[G[0], g[1]])
    bias = [None, torch.zeros(L, 32)]
    with pytest.raises(ValueError, match=r"slice 1 has both a LoRA bias \(lora_bias_stacked\[1\]\) and a DoRA "
                                         r"column scale \(dora_scale_stacked\[1\]\)"):
        w.add_lora_linear(yt, xt, A, B, bias, 0.5, WIDTHS, dora_scale_stacked=G)
    with pytest.raises(ValueError, match=r"slice 1 has both a LoRA bias"):
        w.add_expand(yt, torch.zeros(2, T, R), B, bias, WIDTHS, dora_scale_stacked=G)
    assert np.array_equal(yt.numpy(), _case()[4])       # nothing was written


# ----------------------------------------------------------------------------- MultiLoRAModel vs peft

ADAPTERS = {
    1: {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj", "o_proj", "up_proj", "down_proj"],
        "use_dora": True},
    2: {"r": 8, "lora_alpha": 16, "target_modules": ["q_proj", "k_proj", "o_proj", "up_proj"]},
    3: {"r": 2, "lora_alpha": 4, "target_modules": ["k_proj", "gate_proj"], "use_dora": True},
}
NAMES = {1: "dora-a", 2: "lora", 3: "dora-b"}


def _biases(model) -> None:
    """Non-zero attention biases (q/k/v/o): DoRA adds the base bias after its scale."""
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, torch.nn.Linear) and module.bias is not None:
                module.bias.copy_(torch.randn(module.bias.shape, generator=gen) / 2)


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    return build_peft_models(tmp_path_factory.mktemp("dora-torch"), ADAPTERS, tweak=_raise_magnitudes,
                             edit_base=_biases, attention_bias=True)


def _wrapped(hf, device="cpu", **kw):
    root, dirs, _ = hf
    model = transformers.LlamaForCausalLM.from_pretrained(str(root / "base")).eval().to(device)
    mm = MultiLoRAModel(model, **{"max_loras": 3, "max_rank": 8, "backend": "torch", "dora": True, **kw})
    for lora_id, d in dirs.items():
        mm.load_adapter(NAMES[lora_id], d)
    return mm


def _alone(hf, lora_id, tokens):
    with torch.no_grad():
        return hf[2][lora_id](torch.as_tensor(np.asarray(tokens))[None]).logits[0].numpy()


@pytest.mark.parametrize("backend,inference", [("torch", False), ("triton", False), ("torch", True)])
def test_mixed_dora_lora_and_base_rows_equal_peft(hf, backend, inference):
    """Two DoRA adapters, a plain LoRA one and base rows in one batch: each row's logits are peft's
    for that request alone. The adapters cover a fused group with biases (q/k/v), a lone linear
    with a bias (o_proj), a group without (gate/up) and a lone one without (down_proj). Under
    torch.inference_mode() too (a group's members then compute the group each)."""
    dev = _backend(backend)
    mm = _wrapped(hf, dev, backend=backend)
    biased = mm.layers["model.layers.0.self_attn.q_proj+k_proj+v_proj"]
    assert biased.dora and tuple(biased.dora_scale.shape) == (3, 64)
    rows = [1, 2, None, 3, 1]
    tokens = np.random.default_rng(0).integers(0, VOCAB, size=(len(rows), 6))
    with torch.inference_mode(inference):
        out = mm(torch.as_tensor(tokens, device=dev), adapter_names=[NAMES.get(r, "__base__") for r in rows]).logits
    out = out.cpu().numpy()
    for j, lora_id in enumerate(rows):
        want = _alone(hf, lora_id, tokens[j])
        assert _rel(out[j], want) < RTOL, (j, lora_id, _rel(out[j], want))
        if lora_id is not None:
            assert _rel(want, _alone(hf, None, tokens[j])) > 1e-3                     # the adapter matters
    g = biased.dora_scale[mm.adapters.slot_of(1)].cpu()
    assert (g[:32] - 1).abs().max() > 0.05 and torch.equal(g[32:48], torch.ones(16))   # q scaled, k not
    assert torch.equal(biased.dora_scale[mm.adapters.slot_of(2)].cpu(), torch.ones(64))  # plain LoRA: 1


def test_generate_greedy_tokens_equal_peft(hf):
    mm = _wrapped(hf)
    rows = [3, None, 1, 2]
    tokens = torch.as_tensor(np.random.default_rng(1).integers(1, VOCAB, size=(len(rows), 5)))
    gen = dict(max_new_tokens=4, min_new_tokens=4, do_sample=False, pad_token_id=0)
    out = mm.generate(tokens, attention_mask=torch.ones_like(tokens),
                      adapter_names=[NAMES.get(r, "__base__") for r in rows], **gen)
    for j, lora_id in enumerate(rows):
        with torch.no_grad():
            ref = hf[2][lora_id].generate(input_ids=tokens[j:j + 1], attention_mask=torch.ones_like(tokens[j:j + 1]),
                                          **gen)
        assert out[j].tolist() == ref[0].tolist(), (j, lora_id)


def test_slot_churn_rewrites_scales_from_the_host_cache(hf):
    """Two slots for three adapters: evicted DoRA adapters come back from the host cache with their
    scales; a slot a DoRA adapter leaves to a plain one holds ones again; unload writes ones."""
    mm = _wrapped(hf, max_loras=2)
    tokens = np.random.default_rng(2).integers(0, VOCAB, size=(2, 5))
    for pair in ([1, 3], [2, 3], [1, 2], [3, 1], [2, 1]):
        out = mm(torch.as_tensor(tokens), adapter_names=[NAMES[i] for i in pair]).logits.numpy()
        for j, lora_id in enumerate(pair):
            assert _rel(out[j], _alone(hf, lora_id, tokens[j])) < RTOL, (pair, j)
    assert mm.adapters.stats["host_hits"] >= 3 and mm.adapters.stats["disk_loads"] == 3
    down = mm.layers["model.layers.1.mlp.down_proj"]
    slot = mm.adapters.slot_of(1)
    assert (down.dora_scale[slot] - 1).abs().max() > 0.05
    mm.unload_adapter(NAMES[1])
    assert torch.equal(down.dora_scale[slot], torch.ones(32))


def test_dora_loads_into_a_model_built_without_dora(hf):
    """MultiLoRAModel without dora=True: plain LoRA rows are served with no column scale; the first
    DoRA adapter put into a slot allocates the scale of the layers it touches only (a new buffer,
    counted in the manager's stats), and every row then equals peft; the plain rows are bitwise what
    they were before."""
    root, dirs, _ = hf
    mm = MultiLoRAModel(transformers.LlamaForCausalLM.from_pretrained(str(root / "base")).eval(), max_loras=3,
                        max_rank=8, backend="torch")
    assert not mm.dora and not any(hasattr(layer, "dora_scale") for layer in mm.layers.values())
    mm.load_adapter("lora", dirs[2])
    tokens = torch.as_tensor(np.random.default_rng(5).integers(0, VOCAB, size=(4, 6)))
    before = mm(tokens[:2], adapter_names=["lora", "__base__"]).logits
    mm.load_adapter("dora-b", dirs[3])                     # k_proj, gate_proj: the q/k/v and gate/up groups
    assert not mm.dora                                     # read and prepared; allocated when put into a slot
    mm(tokens[:1], adapter_names=["dora-b"])
    scaled = sorted(p.rsplit(".", 1)[-1] for p, layer in mm.layers.items() if layer.dora and ".layers.0." in p)
    assert scaled == ["gate_proj+up_proj", "q_proj+k_proj+v_proj"] and mm.dora
    assert mm.adapters.stats["dora_layers_enabled"] == 4
    mm.load_adapter("dora-a", dirs[1])                     # q, v, o, up, down: o_proj and down_proj now too
    rows = [1, 2, None, 3]
    out = mm(tokens, adapter_names=[NAMES.get(r, "__base__") for r in rows]).logits.numpy()
    for j, lora_id in enumerate(rows):
        assert _rel(out[j], _alone(hf, lora_id, tokens[j].numpy())) < RTOL, (j, lora_id)
    assert all(layer.dora for layer in mm.layers.values())
    torch.testing.assert_close(mm(tokens[:2], adapter_names=["lora", "__base__"]).logits, before, rtol=0, atol=0)
    with pytest.raises(TypeError, match="dora must be a bool"):
        MultiLoRAModel(transformers.LlamaForCausalLM.from_pretrained(str(root / "base")), max_loras=2, max_rank=8,
                       dora="yes")


def test_dora_layer_arguments():
    kw = dict(max_loras=2, max_rank=4, dtype=torch.float32, device="cpu")
    with pytest.raises(ValueError, match=r"dora=True needs base_weights, one tensor per member module with shapes "
                                         r"\[\(8, 6\), \(4, 6\)\]"):
        LoRALinear(("q", "k"), 6, (8, 4), dora=True, **kw)
    with pytest.raises(ValueError, match=r"base_weights must have shapes \[\(8, 6\), \(4, 6\)\] .* got "
                                         r"\[\(8, 6\), \(6, 4\)\]"):
        LoRALinear(("q", "k"), 6, (8, 4), dora=True, base_weights=[torch.zeros(8, 6), torch.zeros(6, 4)], **kw)
    later = LoRALinear(("q",), 6, (8,), base_weights=[torch.zeros(8, 6)], **kw)     # DoRA allowed, not allocated
    assert not later.dora and not hasattr(later, "dora_scale")
    assert later.enable_dora() and not later.enable_dora()
    assert torch.equal(later.dora_scale, torch.ones(2, 8))
    with pytest.raises(ValueError, match="has no base_weights, which DoRA's column scale is computed from"):
        LoRALinear(("q",), 6, (8,), **kw).enable_dora()
    with pytest.raises(ValueError, match=r"base_weights must be one tensor per member module with shapes \[\(8, 6\)\]"):
        LoRALinear(("q",), 6, (8,), base_weights=torch.zeros(8, 6), **kw)
    layer = LoRALinear(("q", "k"), 6, (8, 4), dora=True, base_weights=[torch.zeros(8, 6), torch.zeros(4, 6)], **kw)
    assert torch.equal(layer.dora_scale, torch.ones(2, 12)) and layer.dora_scale.dtype == torch.float32
    assert not hasattr(LoRALinear(("q",), 6, (8,), **kw), "dora_scale")


@pytest.fixture(scope="module")
def llama_assets(tmp_path_factory):
    """A tiny random transformers Llama and three peft adapters (tests/hf_llama.py): (fresh, dirs)."""
    return hf_llama.write_assets(tmp_path_factory.mktemp("hf_llama"))


def test_dora_adapter_without_dora_true_equals_peft(llama_assets, tmp_path):
    """docs/torch.md: a use_dora adapter loads into a MultiLoRAModel built without dora=True, and
    its rows equal peft's, next to a plain LoRA adapter's rows and base rows."""
    from torch_lora.hf import MultiLoRAModel
    fresh, dirs = llama_assets
    d = hf_llama.save_peft(fresh, tmp_path / "dora", 5, r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                           use_dora=True)
    mm = MultiLoRAModel(fresh(), max_loras=2, max_rank=8, backend="torch")
    mm.load_adapter("sql", dirs["sql"])
    mm.load_adapter("my-dora", d)
    pm = hf_llama.peft_model(fresh, {"my-dora": d, "sql": dirs["sql"]})
    ids = torch.as_tensor(np.random.default_rng(6).integers(0, 64, size=(3, 5)))
    names = ["my-dora", "sql", "__base__"]
    with torch.no_grad():
        out = mm(ids, adapter_names=names).logits
    for j, name in enumerate(names):
        torch.testing.assert_close(out[j], hf_llama.peft_logits(pm, ids[j:j + 1], name)[0], rtol=1e-4, atol=1e-5)


def test_dora_mixed_with_lora_and_base_rows_equals_peft(tmp_path):
    """docs/torch.md 'DoRA adapters': MultiLoRAModel(dora=True) serves a use_dora
    adapter, a plain LoRA adapter and '__base__' rows in one batch, each row equal to peft (fp32,
    1e-4), on a Llama with biased attention; plain LoRA and base rows are bit for bit what a model
    without dora=True gives; generate() keeps each row's adapter too."""
    from torch_lora.hf import MultiLoRAModel
    state = hf_llama.tiny_llama(attention_bias=True).state_dict()

    def fresh():
        m = hf_llama.tiny_llama(attention_bias=True)
        m.load_state_dict(state)
        return m
    dirs = {"dora": hf_llama.save_peft(fresh, tmp_path / "dora", 1, r=4, lora_alpha=8, use_dora=True,
                               target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "down_proj"]),
            "plain": hf_llama.save_peft(fresh, tmp_path / "plain", 2, r=4, lora_alpha=8, target_modules=["q_proj",
                                                                                                         "o_proj"])}
    mm = MultiLoRAModel(fresh(), max_loras=2, max_rank=4, target_modules=hf_llama.ALL7, backend="torch", dora=True)
    for n, d in dirs.items():
        mm.load_adapter(n, d)
    pm = hf_llama.peft_model(fresh, dirs)
    ids = torch.tensor(torch_helpers.rng(28).integers(1, 64, size=(4, 5)))
    names = ["dora", "__base__", "plain", "dora"]
    out = mm(ids, adapter_names=names).logits
    for j, n in enumerate(names):
        ref = hf_llama.peft_logits(pm, ids[j:j + 1], n)[0]
        assert float((out[j] - ref).abs().max() / ref.abs().max()) < 1e-4, n
    assert float((out[0] - hf_llama.peft_logits(pm, ids[:1], "__base__")[0]).abs().max()) > 1e-4   # DoRA is active
    plain_model = MultiLoRAModel(fresh(), max_loras=2, max_rank=4, target_modules=hf_llama.ALL7, backend="torch")
    plain_model.load_adapter("plain", dirs["plain"])
    same = plain_model(ids, adapter_names=["__base__", "__base__", "plain", "__base__"]).logits
    assert torch.equal(out[1:3], same[1:3])   # plain LoRA and base rows: exactly what dora=False gives
    kw = dict(max_new_tokens=3, do_sample=False, pad_token_id=0)
    seqs = mm.generate(ids[:2], attention_mask=torch.ones_like(ids[:2]), adapter_names=["dora", "plain"], **kw)
    for j, n in enumerate(["dora", "plain"]):
        pm.set_adapter(n)
        with torch.no_grad():
            ref = pm.generate(input_ids=ids[j:j + 1], attention_mask=torch.ones_like(ids[j:j + 1]), **kw)
        assert seqs[j].tolist() == ref[0].tolist(), n


def test_dora_scale_stacked_in_the_epilogue_and_bias_plus_scale_refused():
    """docs/api.md: add_lora_linear(..., dora_scale_stacked=) gives a token with
    slot i g_s[i] * (y + delta) in its slice (rows without LoRA untouched); a slice with both a
    LoRA bias and a DoRA scale is refused naming lora_bias_stacked and dora_scale_stacked."""
    rng = torch_helpers.rng(33)
    widths = (4, 3)
    a, b = torch_helpers.stacked(rng, 2, 2, 8, widths)
    g = [torch.tensor(rng.uniform(0.5, 1.5, (2, n)), dtype=torch.float32) for n in widths]
    w = torch_helpers.wrapper((1, 0, 2), [1, 2])
    x = torch.tensor(rng.standard_normal((3, 8)), dtype=torch.float32)
    y0 = torch.tensor(rng.standard_normal((3, 7)), dtype=torch.float32)
    y = y0.clone()
    w.add_lora_linear(y, x, a, b, None, 1.0, widths, dora_scale_stacked=g)
    plain = torch_helpers.oracle_linear(y0, x, a, b, None, 1.0, [0, -1, 1], widths)
    want = plain.copy()
    for t, i in enumerate([0, -1, 1]):
        if i >= 0:
            want[t] *= np.concatenate([g[0][i].double().numpy(), g[1][i].double().numpy()])
    assert torch_helpers.rel(y.numpy(), want) < 1e-5
    assert torch.equal(y[1], y0[1])
    bias = [torch.zeros(2, 4), None]
    with pytest.raises(ValueError, match=r"lora_bias_stacked\[0\].*dora_scale_stacked\[0\]|"
                                         r"dora_scale_stacked\[0\].*lora_bias_stacked\[0\]"):
        w.add_lora_linear(y, x, a, b, bias, 1.0, widths, dora_scale_stacked=[g[0], None])
