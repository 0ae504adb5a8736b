"""GPU tests of the Triton kernels with fp8 (e4m3) adapter weights (marked `gpu`; contract section 11).

Compiled kernels on CUDA, bf16 activations, weights quantised per output channel (or per tensor)
by the contract's rule, against a float64 reference computed from the DEQUANTISED weights: the
stand-alone shrink and expand ops, `linear` on both paths (fused kernel, shrink + expand), the
prepared launches (`prepare_linear`: the C launcher), heterogeneous ranks, bias, fp8 A with bf16 B,
several adapters per token, ranks above one rank block, 1-3 slices, deterministic mode's batch
invariance; the e4m3 -> 16-bit operand conversion on all 256 codes; JAX's Triton backend (the XLA
FFI launcher) under jax.jit; MultiLoRAModel(lora_dtype="fp8") with the compiled kernels against the
torch reference.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")
triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")

from lora_core.kernels import common as kernel_common  # noqa: E402

from .cuda_cases import linear_problem, ref_linear  # noqa: E402

pytestmark = pytest.mark.gpu

TOL = 2e-2          # bf16 activations and outputs (tests/oracle.py FP8_TOL["bfloat16"])
FP8 = torch.float8_e4m3fn


def quantize(w: torch.Tensor, per_tensor: bool = False):
    """(w_q e4m3, scale float32 (L, rows) or (L,)): contract section 11's rule on (L, rows, cols)."""
    w32 = w.float()
    amax = w32.abs().amax(dim=(1, 2)) if per_tensor else w32.abs().amax(dim=2)
    scale = torch.where(amax == 0, torch.ones_like(amax), amax / 448.0)
    full = scale[:, None, None] if per_tensor else scale[:, :, None]
    return (w32 / full).clamp(-448, 448).to(FP8), scale


def dequantize(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    full = scale[:, None, None] if scale.dim() == 1 else scale[:, :, None]
    return q.double() * full.double()


def _rel(got, want) -> float:
    got, want = got.double(), want.double()
    assert torch.isfinite(got).all()
    return float((got - want).norm() / want.norm().clamp_min(1e-30))


CASES = [  # (T, H, R, widths, L, D)
    (1, 4096, 16, (4096,), 8, 1),
    (4, 4096, 8, (1024, 1024, 4096), 16, 4),
    (16, 2048, 64, (2048, 512), 32, 8),
    (64, 1000, 128, (1536,), 8, 8),           # rank > one rank block, hidden not a multiple of 16
    (256, 4096, 32, (4096, 1024, 1024), 64, 16),
    (1024, 2048, 16, (5504,), 4, 4),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"T{c[0]}-H{c[1]}-r{c[2]}-S{len(c[3])}")
@pytest.mark.parametrize("fused", [False, True], ids=["two_kernels", "fused"])
def test_fp8_linear_matches_float64(case, fused):
    from torch_lora.ops import triton as tri
    T, H, R, widths, L, D = case
    x, a, b, idx, meta, _, _ = linear_problem(T, H, R, widths, L, D, torch.bfloat16, seed=T + R)
    qa = [quantize(w) for w in a]
    qb = [quantize(w) for w in b]
    offsets = tuple(sum(widths[:s]) for s in range(len(widths)))
    y = torch.randn(T, sum(widths) + 8, device="cuda").to(torch.bfloat16)
    y0 = y.clone()
    tri.linear(y, x, [q for q, _ in qa], [q for q, _ in qb], meta.meta_args(T), 0.5, offsets, fused=fused,
               a_scales=tuple(s for _, s in qa), b_scales=tuple(s for _, s in qb))
    want = ref_linear(y0, x, [dequantize(*p) for p in qa], [dequantize(*p) for p in qb], idx, 0.5, offsets)
    assert _rel(y, want) < TOL
    assert torch.equal(y[torch.from_numpy(idx < 0).cuda()], y0[torch.from_numpy(idx < 0).cuda()])


@pytest.mark.parametrize("per_tensor", [False, True], ids=["channel", "tensor"])
@pytest.mark.parametrize("T", [3, 200])
def test_fp8_shrink_expand_ops(per_tensor, T):
    """The public ops (lora_shrink / lora_expand) with fp8 weights and lora_a_scale / lora_b_scale."""
    from torch_lora import ops
    x, a, b, idx, meta, _, _ = linear_problem(T, 2048, 16, (1024, 256), 8, 4, torch.bfloat16, seed=7 + T)
    qa = [quantize(w, per_tensor) for w in a]
    qb = [quantize(w, per_tensor) for w in b]
    out = torch.full((2, T, 16), float("nan"), device="cuda")
    ops.lora_shrink(x, [q for q, _ in qa], out, *meta.meta_args(T), 0.5, backend="triton",
                    lora_a_scale=[s for _, s in qa])
    rows = torch.from_numpy(np.nonzero(idx >= 0)[0]).cuda()
    for s in range(2):
        A = dequantize(*qa[s])
        want = torch.stack([0.5 * A[int(idx[t])] @ x[t].double() for t in rows.tolist()])
        assert _rel(out[s, rows], want) < 1e-3
    y = torch.randn(T, 1300, device="cuda").to(torch.bfloat16)
    y0 = y.clone()
    ops.lora_expand(out, [q for q, _ in qb], y, *meta.meta_args(T), offset_start=10, add_inputs=True,
                    backend="triton", lora_b_scale=[s for _, s in qb])
    want = y0.double().clone()
    for t in rows.tolist():
        col = 10
        for s in range(2):
            B = dequantize(*qb[s])[int(idx[t])]
            want[t, col:col + B.shape[0]] += B @ out[s, t].double()
            col += B.shape[0]
    assert _rel(y, want) < TOL


@pytest.mark.parametrize("T", [1, 8, 96])
def test_fp8_prepared_linear_ranks_bias_mixed(T):
    """prepare_linear (the C launcher's prepared launches) with heterogeneous ranks, a bias on two
    of three slices, and fp8 A with bf16 B; called twice (the second call is the prepared path)."""
    from torch_lora.ops import triton as tri
    widths = (1024, 512, 512)
    x, a, b, idx, meta, rk, c = linear_problem(T, 2048, 32, widths, 16, 6, torch.bfloat16, seed=40 + T, ranks=True,
                                               bias=True)
    qa = [quantize(w) for w in a]
    offsets = tuple(sum(widths[:s]) for s in range(len(widths)))
    run = tri.prepare_linear([q for q, _ in qa], b, meta.meta_args(T), offsets, tuple(c),
                             a_scales=tuple(s for _, s in qa))
    want = None
    for _ in range(2):
        y = torch.randn(T, sum(widths), device="cuda").to(torch.bfloat16)
        y0 = y.clone()
        run(y, x, 0.25, rk)
        want = ref_linear(y0, x, [dequantize(*p) for p in qa], [w.double() for w in b], idx, 0.25, offsets,
                           ranks=rk.cpu(), bias=c)
        assert _rel(y, want) < TOL


@pytest.mark.parametrize("T", [4, 64])
def test_fp8_several_adapters_per_token(T):
    """Two weighted adapters per token (contract section 10) with fp8 A and B, both paths."""
    from lora_core.adapter_pairs import AdapterPairs
    from torch_lora.ops import triton as tri
    from torch_lora.ops.torch_ref import pair_columns
    L, R, H, widths = 8, 16, 1024, (512, 256)
    x, a, b, _, _, _, _ = linear_problem(T, H, R, widths, L, L, torch.bfloat16, seed=60 + T)
    qa = [quantize(w) for w in a]
    qb = [quantize(w) for w in b]
    rng = np.random.default_rng(T)
    groups = rng.integers(-1, 3, T).astype(np.int32)
    slots = torch.tensor([[0, 3], [5, -1], [2, 7]], dtype=torch.int32, device="cuda")
    weights = torch.from_numpy(rng.random((T, 2)).astype(np.float32)).cuda()
    from torch_lora.meta import LoRAKernelMeta
    meta = LoRAKernelMeta.make(3, T + 5, "cuda")
    meta.prepare_tensors(torch.from_numpy(groups).cuda())
    pairs = AdapterPairs(slots, weights)
    offsets = (0, 512)
    for fused in (False, True):
        y = torch.randn(T, 768, device="cuda").to(torch.bfloat16)
        y0 = y.clone()
        tri.linear(y, x, [q for q, _ in qa], [q for q, _ in qb], meta.meta_args(T), 0.5, offsets, fused=fused,
                   pairs=pairs, a_scales=tuple(s for _, s in qa), b_scales=tuple(s for _, s in qb))
        want = y0.double().clone()
        for slot, w in pair_columns(torch.from_numpy(groups).cuda(), pairs):
            for t in range(T):
                if int(slot[t]) < 0:
                    continue
                for s, off in enumerate(offsets):
                    A, B = dequantize(*qa[s])[int(slot[t])], dequantize(*qb[s])[int(slot[t])]
                    want[t, off:off + B.shape[0]] += float(w[t]) * (B @ (0.5 * A @ x[t].double()))
        assert _rel(y, want) < TOL, f"fused={fused}"


@pytest.mark.parametrize("T", [4, 300])
@pytest.mark.parametrize("fused", [False, True], ids=["two_kernels", "fused"])
def test_fp8_jax_triton_backend_on_gpu(T, fused):
    """JAX's Triton backend (the XLA FFI launcher) with fp8 A and B under jax.jit on the GPU."""
    jax = pytest.importorskip("jax")
    jnp = jax.numpy
    from jax_lora.meta import LoRAKernelMeta as JaxMeta
    from jax_lora.ops import triton as jt

    from . import oracle
    if jax.default_backend() != "gpu":
        pytest.skip("JAX has no GPU here")
    rng = np.random.default_rng(T)
    H, R, L, widths = 2048, 32, 8, (1024, 512)
    x = jnp.asarray(rng.standard_normal((T, H)).astype(np.float32)).astype(jnp.bfloat16)
    qa = [oracle.fp8_quantize(rng.standard_normal((L, R, H)) / math.sqrt(H)) for _ in widths]
    qb = [oracle.fp8_quantize(rng.standard_normal((L, n, R)) / math.sqrt(R)) for n in widths]
    idx = np.where(rng.random(T) < 0.2, -1, rng.integers(0, L, T)).astype(np.int32)
    meta = JaxMeta.build(idx, L, T)
    y0 = jnp.asarray(rng.standard_normal((T, sum(widths))).astype(np.float32)).astype(jnp.bfloat16)
    run = jax.jit(lambda y, x, a, b, sa, sb, m: jt.linear(y, x, a, b, m, 0.5, (0, widths[0]), fused=fused,
                                                          a_scales=sa, b_scales=sb))
    y = run(y0, x, tuple(jnp.asarray(q) for q, _ in qa), tuple(jnp.asarray(q) for q, _ in qb),
            tuple(jnp.asarray(s) for _, s in qa), tuple(jnp.asarray(s) for _, s in qb), meta)
    want = oracle.lora_linear(np.asarray(y0.astype(jnp.float32)), np.asarray(x.astype(jnp.float32)),
                              [oracle.fp8_dequantize(q, s) for q, s in qa],
                              [oracle.fp8_dequantize(q, s) for q, s in qb], None, 0.5, idx)
    assert oracle.rel_err(np.asarray(y.astype(jnp.float32)), want) < TOL


def test_fp8_multilora_model_triton_equals_reference(tmp_path):
    """MultiLoRAModel(lora_dtype="fp8") of a tiny float32 Llama on CUDA: the compiled kernels equal
    the torch reference on the same fp8 slots (1e-4); adapter a1 targets the embedding and the LM
    head too (their fp8 slots: the embedding's table with one scale per row)."""
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    from torch_lora.hf import MultiLoRAModel
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                   tie_word_embeddings=False)
    transformers.LlamaForCausalLM(cfg).save_pretrained(str(tmp_path / "base"))
    for i, r in enumerate((4, 8)):
        torch.manual_seed(10 + i)
        model = transformers.LlamaForCausalLM.from_pretrained(str(tmp_path / "base"))
        extra = ["embed_tokens", "lm_head"] if i else []
        peft.get_peft_model(model, peft.LoraConfig(r=r, lora_alpha=2 * r, init_lora_weights=False, target_modules=[
            "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"] + extra)).save_pretrained(
            str(tmp_path / f"a{i}"))
    tokens = torch.randint(1, 128, (3, 7), generator=torch.Generator().manual_seed(1))
    rows = ["a0", "__base__", "a1"]
    out = {}
    for backend in ("torch", "triton"):
        base = transformers.LlamaForCausalLM.from_pretrained(str(tmp_path / "base")).cuda().eval()
        mm = MultiLoRAModel(base, max_loras=2, max_rank=8, backend=backend, lora_dtype="fp8",
                            target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
                                            "embed_tokens", "lm_head"])
        assert mm.layers["model.embed_tokens"].lora_a.dtype == torch.float8_e4m3fn
        for i in range(2):
            mm.load_adapter(f"a{i}", str(tmp_path / f"a{i}"))
        with torch.no_grad():
            out[backend] = mm(tokens.cuda(), adapter_names=rows).logits.float().cpu()
    rel = float((out["triton"] - out["torch"]).abs().max() / out["torch"].abs().max())
    assert rel < 1e-4, rel


@pytest.mark.parametrize("S", [1, 3])
def test_fp8_deterministic_is_batch_invariant(S):
    """deterministic=True with fp8 weights (the deterministic configs of the
    rank's): the first rows' outputs are bitwise the same in a batch of 4 and of 300 tokens, and
    match the float64 reference on the dequantised weights."""
    from torch_lora.meta import LoRAKernelMeta
    from torch_lora.ops import triton as tri
    H, R, L = 4096, 16, 8
    widths = (4096, 1024, 1024)[:S]
    x, a, b, idx, _, _, _ = linear_problem(300, H, R, widths, L, 8, torch.bfloat16, seed=5)
    qa, qb = [quantize(w) for w in a], [quantize(w) for w in b]
    offsets = tuple(sum(widths[:s]) for s in range(S))
    y0 = torch.randn(300, sum(widths), device="cuda").to(torch.bfloat16)
    outs = []
    for T in (4, 300):
        meta = LoRAKernelMeta.make(L, T, "cuda")
        meta.prepare_tensors(torch.from_numpy(idx[:T]).cuda())
        y = y0[:T].clone()
        tri.linear(y, x[:T], [q for q, _ in qa], [q for q, _ in qb], meta.meta_args(T), 0.5, offsets,
                   deterministic=True, a_scales=tuple(s for _, s in qa), b_scales=tuple(s for _, s in qb))
        outs.append(y)
    assert torch.equal(outs[0], outs[1][:4])
    want = ref_linear(y0, x, [dequantize(*p) for p in qa], [dequantize(*p) for p in qb], idx, 0.5, offsets)
    assert _rel(outs[1], want) < TOL


@triton.jit
def _convert_e4m3(w_ptr, out_ptr, dot_ptr, DT: tl.constexpr):
    """out = as_operand(w, DT) and dot = I @ as_operand(w, DT) (float32) for a 16 x 16 e4m3 tile."""
    r = tl.arange(0, 16)
    offs = r[:, None] * 16 + r[None, :]
    w = tl.load(w_ptr + offs)
    tl.store(out_ptr + offs, kernel_common.as_operand(w, DT))
    eye = tl.where(r[:, None] == r[None, :], 1.0, 0.0).to(DT)
    tl.store(dot_ptr + offs, tl.dot(eye, kernel_common.as_operand(w, DT)))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_e4m3_operand_conversion_is_exact(dtype):
    """common.as_operand's bit moves (inline PTX) on all 256 e4m3 codes, compiled: stored as they
    come out, and as the B operand of a tl.dot with the identity (the dot-operand register layout
    packs other values together); both equal torch's e4m3 -> 16-bit cast at every finite code."""
    codes = torch.arange(256, dtype=torch.uint8, device="cuda").view(FP8).reshape(16, 16)
    out = torch.empty(16, 16, dtype=dtype, device="cuda")
    dot = torch.empty(16, 16, dtype=torch.float32, device="cuda")
    _convert_e4m3[(1,)](codes, out, dot, tl.bfloat16 if dtype == torch.bfloat16 else tl.float16)
    want = codes.to(torch.float32)
    finite = torch.isfinite(want)
    assert int(finite.sum()) == 254
    assert torch.equal(out.float()[finite], want[finite])
    assert torch.equal(dot[finite], want[finite])
