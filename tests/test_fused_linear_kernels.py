"""The fused linear kernels (`torch_lora.ops.fused_linear`): `gemm_lora` (the base GEMM with the
LoRA expand in its epilogue) and `rms_norm_shrink` (RMSNorm with the LoRA shrink).

CPU: Triton's interpreter at small shapes (K <= 256, N <= 384 over three slices, M in {1, 5, 33},
four slots, ranks 8 and 16, slots -1 and past the slots), against a float64 NumPy oracle, outputs
poisoned with NaN first; both epilogue modes (per-row gathered B, one dot per distinct slot),
split-K, per-slot ranks (NaN past each rank must never be read), bias and add_inputs both ways,
float16 / bfloat16 / float32; the norm's rounding against Hugging Face's LlamaRMSNorm formula,
bit for bit. GPU (`gpu`): the compiled kernels at Llama-3-8B layer shapes.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available(),
                                reason="needs Triton's interpreter (TRITON_INTERPRET=1) or CUDA")

from torch_lora.ops.fused_linear import gemm_config, gemm_lora, rms_norm_shrink  # noqa: E402

from .fused_linear_cases import gemm_lora_oracle, lora_slots, rel_err  # noqa: E402

TOL = {torch.float32: 1e-5, torch.float16: 5e-3, torch.bfloat16: 2e-2}
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
DEV = "cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1" else "cpu"
L = 4
WIDTHS = (128, 64, 192)                 # N = 384 over three slices, each a multiple of BLOCK_N = 64
K = 256


def _assert_rounds_like_hf(out: torch.Tensor, want: torch.Tensor) -> None:
    """The normalised rows rounded to the input dtype before the gain, as LlamaRMSNorm does: equal to
    HF's bit for bit, except that the kernel's float32 sum of squares may add in another order than
    torch's mean (on a GPU), which moves the rounding of a few elements by one unit in the last place."""
    if DEV == "cpu":
        assert torch.equal(out, want), "the norm must round as LlamaRMSNorm does"
        return
    ulp = torch.finfo(want.dtype).eps * want.float().abs().clamp_min(torch.finfo(want.dtype).tiny)
    off = (out.float() - want.float()).abs()
    assert bool((off <= ulp).all()), f"the norm is off by more than one unit in the last place: {off.max()}"
    assert (off > 0).float().mean().item() <= 0.01, "more than 1% of the elements round differently from HF"


def _rel(got, ref) -> float:
    return rel_err(got.double().cpu() if isinstance(got, torch.Tensor) else got, ref)


def _t(a, dtype):
    return torch.from_numpy(np.asarray(a, np.float32)).to(DEV, dtype)


def _gemm_problem(seed, m, rank, dtype, widths=WIDTHS, planes=1):
    rng = np.random.default_rng(seed)
    n = sum(widths)
    x = rng.standard_normal((m, K))
    w = rng.standard_normal((n, K)) / np.sqrt(K)
    bias = rng.standard_normal(n)
    buf = rng.standard_normal((planes, len(widths), m, rank)).astype(np.float32)
    b = [rng.standard_normal((L, wd, rank)) / np.sqrt(rank) for wd in widths]
    y0 = rng.standard_normal((m, n))
    return rng, x, w, bias, buf, b, y0, lora_slots(rng, m, L)


def _gemm_oracle(x, w, bias, buf, b, slots, y0, widths, ranks=None):
    return gemm_lora_oracle(x, w, bias, buf, b, slots, y0, widths, L, ranks)


def _q(a, dtype):
    """a as the kernel sees it after the cast to dtype (the oracle starts from the same values)."""
    return _t(a, dtype).double().cpu().numpy()


@pytest.mark.parametrize("mode", ["rows", "slots"])
@pytest.mark.parametrize("m", [1, 5, 33])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).replace("torch.", ""))
def test_gemm_lora_matches_oracle(dtype, m, mode):
    seed = 7 * m + DTYPES.index(dtype) + (100 if mode == "slots" else 0)
    rank = (8, 16)[seed % 2]
    add_inputs, with_bias = bool(seed % 3 != 0), bool((seed // 2) % 2)
    rng, x, w, bias, buf, b, y0, slots = _gemm_problem(seed, m, rank, dtype)
    xt, wt, bt = _t(x, dtype), _t(w, dtype), [_t(v, dtype) for v in b]
    biast = _t(bias, dtype) if with_bias else None
    y = _t(y0, dtype) if add_inputs else torch.full((m, sum(WIDTHS)), float("nan"), dtype=dtype, device=DEV)
    cfg = dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, LORA_MODE=mode)
    out = gemm_lora(xt, wt, biast, torch.from_numpy(buf[0]).to(DEV), bt, torch.from_numpy(slots).to(DEV), WIDTHS,
                    y=y, add_inputs=add_inputs, config=cfg)
    assert out is y
    ref = _gemm_oracle(_q(x, dtype), _q(w, dtype), _q(bias, dtype) if with_bias else None, buf,
                       [_q(v, dtype) for v in b], slots, _q(y0, dtype) if add_inputs else None, WIDTHS)
    assert _rel(out, ref) <= TOL[dtype]


@pytest.mark.parametrize("mode", ["rows", "slots"])
def test_gemm_lora_split_k_planes_ragged_last_slice_and_ranks(mode):
    """Split-K over a K that is no multiple of BLOCK_K, a last slice that is no multiple of BLOCK_N,
    three planes of the shrink buffer, per-slot ranks with NaN past every rank (never read), and a
    second launch on the same counters (the kernel leaves them at 0)."""
    dtype, m, rank = torch.bfloat16, 33, 16
    widths = (64, 128, 72)
    rng = np.random.default_rng(3 + len(mode))
    k = 200
    x, w = rng.standard_normal((m, k)), rng.standard_normal((sum(widths), k)) / np.sqrt(k)
    buf = rng.standard_normal((3, 3, m, rank)).astype(np.float32)
    b = [rng.standard_normal((L, n, rank)) / 4 for n in widths]
    ranks = np.array([16, 3, 8, 0], np.int32)
    slots = lora_slots(rng, m, L)
    bt = [_t(v, dtype) for v in b]
    for slot, r in enumerate(ranks):
        buf[:, :, slots == slot, r:] = np.nan
        for t in bt:
            t[slot, :, r:] = float("nan")
    cfg = dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=64, SPLIT_K=3, LORA_MODE=mode)
    for _ in range(2):
        y = torch.full((m, sum(widths)), float("nan"), dtype=dtype, device=DEV)
        gemm_lora(_t(x, dtype), _t(w, dtype), None, torch.from_numpy(buf).to(DEV), bt,
                  torch.from_numpy(slots).to(DEV), widths, y=y, config=cfg,
                  lora_ranks=torch.from_numpy(ranks).to(DEV))
        ref = _gemm_oracle(_q(x, dtype), _q(w, dtype), None, np.nan_to_num(buf), [_q(v, dtype) for v in b], slots,
                           None, widths, ranks)
        assert _rel(y, ref) <= TOL[dtype]


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).replace("torch.", ""))
def test_gemm_without_lora_is_the_linear(dtype):
    rng = np.random.default_rng(11)
    m, n = 5, 96
    x, w, bias = rng.standard_normal((m, K)), rng.standard_normal((n, K)) / 16, rng.standard_normal(n)
    y = gemm_lora(_t(x, dtype), _t(w, dtype), _t(bias, dtype), None, None, None, None,
                  config=dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=128))
    assert y.shape == (m, n) and y.dtype == dtype
    assert _rel(y, _q(x, dtype) @ _q(w, dtype).T + _q(bias, dtype)) <= TOL[dtype]


def _hf_rms_norm(h: torch.Tensor, g: torch.Tensor, eps: float) -> torch.Tensor:
    """Hugging Face's LlamaRMSNorm.forward, line for line."""
    input_dtype = h.dtype
    hidden = h.to(torch.float32)
    variance = hidden.pow(2).mean(-1, keepdim=True)
    hidden = hidden * torch.rsqrt(variance + eps)
    return g * hidden.to(input_dtype)


NORM_CASES = [(m, mode, 1) for mode in ("rows", "slots") for m in (1, 5, 33)] + [(5, "rows", 3), (33, "slots", 3)]


@pytest.mark.parametrize("m,mode,planes", NORM_CASES)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).replace("torch.", ""))
def test_rms_norm_shrink_matches_hf_norm_and_oracle(dtype, m, mode, planes):
    seed = 5 * m + DTYPES.index(dtype) + (50 if mode == "slots" else 0)
    rank = (8, 16)[seed % 2]
    rng = np.random.default_rng(seed)
    h = _t(rng.standard_normal((m, K)) * 3 + 0.5, dtype)
    g = _t(1 + 0.2 * rng.standard_normal(K), dtype)
    a = [rng.standard_normal((L, rank, K)) / np.sqrt(K) for _ in range(3)]
    at = [_t(v, dtype) for v in a]
    slots = lora_slots(rng, m, L)
    out = torch.full((m, K), float("nan"), dtype=dtype, device=DEV)
    buf = torch.full((planes, 3, m, rank), float("nan"), dtype=torch.float32, device=DEV)
    cfg = dict(BLOCK_M=16 if mode == "slots" else 4, BLOCK_K=64, LORA_MODE=mode)
    got, got_buf = rms_norm_shrink(h, g, 1e-5, at, torch.from_numpy(slots).to(DEV), 0.5, out=out, buf=buf,
                                   config=cfg)
    assert got is out and got_buf is buf
    want = _hf_rms_norm(h, g, 1e-5)
    if dtype == torch.float32:
        assert _rel(out, want.double().cpu().numpy()) <= 1e-6
    else:
        _assert_rounds_like_hf(out, want)
    xn = want.double().cpu().numpy()
    ref = np.zeros((3, m, rank))
    for s in range(3):
        for i, slot in enumerate(slots):
            if 0 <= slot < L:
                ref[s, i] = 0.5 * xn[i] @ _q(a[s], dtype)[slot].T
    assert _rel(buf.sum(0), ref) <= TOL[torch.float32] * 10
    assert (buf.sum(0)[:, torch.from_numpy((slots < 0) | (slots >= L))] == 0).all()


def test_rms_norm_shrink_ranks_and_the_norm_alone():
    dtype, m, rank = torch.bfloat16, 5, 16
    rng = np.random.default_rng(21)
    h = _t(rng.standard_normal((m, K)), dtype)
    g = _t(1 + 0.1 * rng.standard_normal(K), torch.float32)            # a float32 weight: cast to h's dtype
    a = [_t(rng.standard_normal((L, rank, K)) / 16, dtype) for _ in range(2)]
    ranks = np.array([4, 16, 0, 9], np.int32)
    clean = [t.clone() for t in a]
    for t in a:
        for slot, r in enumerate(ranks):
            t[slot, r:] = float("nan")                                    # past the rank: never read
    slots = np.array([0, 1, 2, 3, -1], np.int32)
    out, buf = rms_norm_shrink(h, g, 1e-6, a, torch.from_numpy(slots).to(DEV), 1.0,
                               lora_ranks=torch.from_numpy(ranks).to(DEV),
                               config=dict(BLOCK_M=2, BLOCK_K=64, SPLIT_K=2, LORA_MODE="rows"))
    want = _hf_rms_norm(h, g, 1e-6).to(dtype)
    assert torch.equal(out, want)
    xn = want.double().cpu().numpy()
    for s in range(2):
        for i, slot in enumerate(slots):
            r = ranks[slot] if slot >= 0 else 0
            if r == 0:
                assert (buf.sum(0)[s, i] == 0).all()
                continue
            ref = np.zeros(rank)
            ref[:r] = xn[i] @ clean[s][slot, :r].double().cpu().numpy().T
            assert _rel(buf.sum(0)[s, i], ref) <= 1e-5
    alone, none = rms_norm_shrink(h, g, 1e-6, None, None, 1.0)
    assert none is None and torch.equal(alone, want)


def test_norm_shrink_then_gemm_lora_is_the_lora_linear():
    """The pair as a layer runs it: norm + shrink, then the GEMM with the expand, against float64."""
    dtype, m, rank = torch.bfloat16, 5, 16
    rng = np.random.default_rng(31)
    h = _t(rng.standard_normal((m, K)), dtype)
    g = _t(1 + 0.1 * rng.standard_normal(K), dtype)
    w = _t(rng.standard_normal((sum(WIDTHS), K)) / 16, dtype)
    a = [_t(rng.standard_normal((L, rank, K)) / 16, dtype) for _ in WIDTHS]
    b = [_t(rng.standard_normal((L, n, rank)) / 4, dtype) for n in WIDTHS]
    slots = torch.from_numpy(lora_slots(rng, m, L)).to(DEV)
    xn, buf = rms_norm_shrink(h, g, 1e-5, a, slots, 2.0)
    y = gemm_lora(xn, w, None, buf, b, slots, WIDTHS)
    xd = _hf_rms_norm(h, g, 1e-5).double()
    ref = xd @ w.double().T
    off = 0
    for s, n in enumerate(WIDTHS):
        for i, slot in enumerate(slots.tolist()):
            if 0 <= slot < L:
                ref[i, off:off + n] += (2.0 * xd[i] @ a[s][slot].double().T) @ b[s][slot].double().T
        off += n
    assert _rel(y, ref.cpu().numpy()) <= TOL[dtype]


# ----------------------------------------------------------------------------- bad input

def _small(dtype=torch.bfloat16):
    x = torch.zeros(3, 32, dtype=dtype, device=DEV)
    w = torch.zeros(96, 32, dtype=dtype, device=DEV)
    b = [torch.zeros(L, 64, 16, dtype=dtype, device=DEV), torch.zeros(L, 32, 16, dtype=dtype, device=DEV)]
    buf = torch.zeros(2, 3, 16, device=DEV)
    slots = torch.zeros(3, dtype=torch.int32, device=DEV)
    return x, w, b, buf, slots


def test_gemm_lora_rejects_bad_arguments_by_name():
    x, w, b, buf, slots = _small()
    with pytest.raises(ValueError, match="multiple of BLOCK_N=128"):
        gemm_lora(x, w, None, buf, b, slots, (64, 32), config=dict(BLOCK_M=16, BLOCK_N=128, BLOCK_K=32))
    with pytest.raises(ValueError, match="output_slices"):
        gemm_lora(x, w, None, buf, b, slots, (64, 64))
    with pytest.raises(TypeError, match="weight must have x's dtype"):
        gemm_lora(x, w.half(), None, buf, b, slots, (64, 32))
    with pytest.raises(ValueError, match="buf must have shape"):
        gemm_lora(x, w, None, buf[:, :2], b, slots, (64, 32))
    with pytest.raises(TypeError, match="buf must have dtype"):
        gemm_lora(x, w, None, buf.double(), b, slots, (64, 32))
    with pytest.raises(ValueError, match="slots must have shape"):
        gemm_lora(x, w, None, buf, b, slots[:2], (64, 32))
    with pytest.raises(TypeError, match="slots must be int32"):
        gemm_lora(x, w, None, buf, b, slots.float(), (64, 32))
    with pytest.raises(ValueError, match=r"lora_b_stacked\[1\] must have shape"):
        gemm_lora(x, w, None, buf, [b[0], b[0]], slots, (64, 32))
    with pytest.raises(ValueError, match="add_inputs=True needs y"):
        gemm_lora(x, w, None, buf, b, slots, (64, 32), add_inputs=True)
    with pytest.raises(ValueError, match="slots=None runs the GEMM alone"):
        gemm_lora(x, w, None, buf, b, None, (64, 32))
    with pytest.raises(ValueError, match="bias must have shape"):
        gemm_lora(x, w, torch.zeros(95, dtype=x.dtype, device=DEV), buf, b, slots, (64, 32))


def test_rms_norm_shrink_rejects_bad_arguments_by_name():
    h = torch.zeros(3, 32, dtype=torch.bfloat16, device=DEV)
    g = torch.ones(32, dtype=torch.bfloat16, device=DEV)
    a = [torch.zeros(L, 16, 32, dtype=torch.bfloat16, device=DEV)]
    slots = torch.zeros(3, dtype=torch.int32, device=DEV)
    with pytest.raises(ValueError, match="norm_weight must have shape"):
        rms_norm_shrink(h, g[:16], 1e-5, a, slots, 1.0)
    with pytest.raises(ValueError, match="eps must be"):
        rms_norm_shrink(h, g, -1.0, a, slots, 1.0)
    with pytest.raises(ValueError, match=r"lora_a_stacked\[0\] must have shape"):
        rms_norm_shrink(h, g, 1e-5, [a[0][:, :, :16]], slots, 1.0)
    with pytest.raises(ValueError, match="buf must have shape"):
        rms_norm_shrink(h, g, 1e-5, a, slots, 1.0, buf=torch.zeros(1, 2, 3, 16, device=DEV))
    with pytest.raises(TypeError, match="out must have h's dtype"):
        rms_norm_shrink(h, g, 1e-5, a, slots, 1.0, out=torch.zeros(3, 32, device=DEV))
    with pytest.raises(ValueError, match="slots=None runs the norm alone"):
        rms_norm_shrink(h, g, 1e-5, a, None, 1.0)


def test_gemm_config_halves_block_n_for_narrow_slices():
    cfg = gemm_config(4096, (4096, 1024, 1024))
    assert cfg["BLOCK_N"] == 256
    assert gemm_config(4096, (4096, 1024 - 128, 1024))["BLOCK_N"] == 128


# ----------------------------------------------------------------------------- GPU, Llama shapes

LLAMA = {"qkv": (4096, (4096, 1024, 1024)), "o": (4096, (4096,)), "gate_up": (4096, (14336, 14336)),
         "down": (14336, (4096,))}


@pytest.mark.gpu
@pytest.mark.skipif(DEV != "cuda", reason="compiled kernels need a CUDA GPU")
@pytest.mark.parametrize("m", [1, 8, 32, 256, 2048])
@pytest.mark.parametrize("layer", sorted(LLAMA))
def test_gpu_gemm_lora_at_llama_shapes(layer, m):
    _gpu_gemm_case(layer, m, None)


@pytest.mark.gpu
@pytest.mark.skipif(DEV != "cuda", reason="compiled kernels need a CUDA GPU")
@pytest.mark.parametrize("extra", [dict(PREFETCH_B=True), dict(SPLIT_K=2), dict(SPLIT_K=4, LORA_MODE="slots")],
                         ids=["prefetch-b", "split-2", "split-4-slots"])
@pytest.mark.parametrize("m", [8, 32])
def test_gpu_gemm_lora_compiled_options(m, extra):
    """The options the interpreter cannot run (the L2 prefetch) or runs one program at a time (the
    split-K counters), compiled, twice in a row (the counters are 0 again after a launch)."""
    from torch_lora.ops.fused_linear import gemm_config
    for _ in range(2):
        _gpu_gemm_case("qkv", m, {**gemm_config(m, LLAMA["qkv"][1]), **extra})


def _gpu_gemm_case(layer, m, config):
    k, widths = LLAMA[layer]
    dtype, rank, slots_n = torch.bfloat16, 16, 32
    gen = torch.Generator(device="cuda").manual_seed(m)
    rnd = lambda *s: torch.randn(*s, generator=gen, device="cuda")
    x = rnd(m, k).to(dtype)
    w = (rnd(sum(widths), k) / k ** 0.5).to(dtype)
    bias = rnd(sum(widths)).to(dtype)
    b = [(rnd(slots_n, n, rank) / rank ** 0.5).to(dtype) for n in widths]
    slots = torch.randint(-1, slots_n, (m,), generator=gen, device="cuda", dtype=torch.int32)
    buf = rnd(len(widths), m, rank) / 4
    y = rnd(m, sum(widths)).to(dtype)
    ref = y.double() + x.double() @ w.double().T + bias.double()
    for slot in slots.unique().tolist():
        rows = slots == slot
        off = 0
        for s, n in enumerate(widths):
            if slot >= 0:
                ref[rows, off:off + n] += buf[s][rows].double() @ b[s][slot].double().T
            off += n
    got = gemm_lora(x, w, bias, buf, b, slots, widths, y=y.clone(), add_inputs=True, config=config)
    assert _rel(got, ref.cpu().numpy()) <= TOL[dtype]
    base = gemm_lora(x, w, None, None, None, None, None, config=config)
    assert _rel(base, (x.double() @ w.double().T).cpu().numpy()) <= TOL[dtype]


@pytest.mark.gpu
@pytest.mark.skipif(DEV != "cuda", reason="compiled kernels need a CUDA GPU")
@pytest.mark.parametrize("m", [1, 8, 32, 256, 2048])
def test_gpu_rms_norm_shrink_at_llama_shapes(m):
    dtype, rank, slots_n, k = torch.bfloat16, 16, 32, 4096
    gen = torch.Generator(device="cuda").manual_seed(m)
    h = (torch.randn(m, k, generator=gen, device="cuda") * 2).to(dtype)
    g = (1 + 0.1 * torch.randn(k, generator=gen, device="cuda")).to(dtype)
    a = [(torch.randn(slots_n, rank, k, generator=gen, device="cuda") / k ** 0.5).to(dtype) for _ in range(3)]
    slots = torch.randint(-1, slots_n, (m,), generator=gen, device="cuda", dtype=torch.int32)
    out, buf = rms_norm_shrink(h, g, 1e-5, a, slots, 1.0)
    want = _hf_rms_norm(h, g, 1e-5)
    # the sum of squares is added in another order than torch's: a rare element may round the other way
    assert (out != want).float().mean().item() < 1e-3
    assert _rel(out, want.double().cpu().numpy()) <= 1e-3
    xs = want.double()
    for s in range(3):
        ref = torch.zeros(m, rank, dtype=torch.float64, device="cuda")
        for slot in slots.unique().tolist():
            if slot >= 0:
                ref[slots == slot] = xs[slots == slot] @ a[s][slot].double().T
        assert _rel(buf.sum(0)[s], ref.cpu().numpy()) <= 1e-3
