"""fp8 (e4m3) adapter weights on the torch side and in lora_core (contract section 11): the
argument rules and their errors.

`checks.check_weight_scales` (missing, extra, wrong-shape, wrong-dtype scales; per-channel and
per-tensor forms), the same rules through the public ops and the wrapper (each error names the
argument), the kernel-argument builder's own checks (one weight dtype per launch, contiguous
channels), and the quantisation rule of tests/oracle.py against torch's e4m3 cast. The numbers
themselves are checked by the conformance suite (tests/test_conformance.py, `fp8`).
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from lora_core import checks
from lora_core.kernels import arguments
from torch_lora import ops
from torch_lora.meta import LoRAKernelMeta

from . import oracle

# the compiled kernels where a CUDA GPU is present and the interpreter is off, else the interpreter
DEV = "cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1" else "cpu"

FP8 = torch.float8_e4m3fn


def _fp8(w):
    q, scale = oracle.fp8_quantize(w.numpy())
    return torch.from_numpy(q.view(np.uint8)).view(FP8), torch.from_numpy(scale)


def _setup(num_tokens=4, hidden=32, rank=16, width=24, num_slots=3):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(num_tokens, hidden, generator=g)
    a, a_scale = _fp8(torch.randn(num_slots, rank, hidden, generator=g))
    b, b_scale = _fp8(torch.randn(num_slots, width, rank, generator=g))
    idx = torch.tensor([0, 2, -1, 1][:num_tokens], dtype=torch.int32)
    return x, a, a_scale, b, b_scale, idx


# ----------------------------------------------------------------------------- checks.check_weight_scales

def test_check_weight_scales_kinds():
    shapes, dtypes = [(3, 16, 32), (3, 1, 8, 32), (3, 16, 32)], ["float8_e4m3fn", "float8_e4m3fn", "bfloat16"]
    kinds = checks.check_weight_scales("s", [((3, 16), "float32"), ((3,), "float32"), None], shapes, dtypes, "w")
    assert kinds == ("channel", "tensor", None)
    assert checks.check_weight_scales("s", None, [(3, 16, 32)], ["bfloat16"], "w") == (None,)
    assert "float8_e4m3fn" in checks.WEIGHT_DTYPES and checks.is_fp8("float8_e4m3fn")


@pytest.mark.parametrize("scales,dtype,match", [
    (None, "float8_e4m3fn", r"w is float8_e4m3fn: s must give its scales, \(3, 16\) per channel"),
    ([((3, 16), "float32")], "bfloat16", r"s is given, but w is bfloat16, not fp8"),
    ([((3, 15), "float32")], "float8_e4m3fn", r"s must have shape \(3, 16\) per channel or \(3,\) per tensor"),
    ([((16,), "float32")], "float8_e4m3fn", r"got shape \(16,\)"),
    ([((3, 16), "bfloat16")], "float8_e4m3fn", r"s must be float32 .* got dtype bfloat16"),
    ([((3, 16), "float32"), None], "float8_e4m3fn", r"one entry per slice of w \(1\), got 2"),
])
def test_check_weight_scales_errors(scales, dtype, match):
    with pytest.raises(ValueError, match=match):
        checks.check_weight_scales("s", scales, [(3, 16, 32)], [dtype], "w")


def test_fp8_is_no_bias_or_dora_dtype():
    with pytest.raises(TypeError, match="float8_e4m3fn"):
        checks.check_bias([(3, 24)], (24,), 3, bias_dtypes=["float8_e4m3fn"])


# ----------------------------------------------------------------------------- the ops

@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_ops_refuse_missing_extra_and_misshapen_scales(backend):
    x, a, a_scale, b, b_scale, idx = _setup()
    with pytest.raises(ValueError, match="w_scale must give its scales"):
        ops.bgmv_shrink(x, a, idx, backend=backend)
    with pytest.raises(ValueError, match="w_scale is given, but lora_a_weights is float32"):
        ops.bgmv_shrink(x, a.float(), idx, backend=backend, w_scale=a_scale)
    with pytest.raises(ValueError, match=r"w_scale must have shape \(3, 16\) per channel"):
        ops.bgmv_shrink(x, a, idx, backend=backend, w_scale=a_scale[:, :8])
    with pytest.raises(ValueError, match="w_scale must be float32"):
        ops.bgmv_shrink(x, a, idx, backend=backend, w_scale=a_scale.double())
    with pytest.raises(TypeError, match="w_scale must be a torch.Tensor"):
        ops.bgmv_shrink(x, a, idx, backend=backend, w_scale=a_scale.numpy())
    y = torch.zeros(4, 30)
    with pytest.raises(ValueError, match=r"w_scale must have shape \(3, 24\) per channel"):
        ops.bgmv_expand_slice(torch.zeros(4, 16), b, y, idx, 2, 24, backend=backend, w_scale=a_scale)
    meta = LoRAKernelMeta.make(3, 4, "cpu")
    meta.prepare_tensors(idx)
    out = torch.zeros(2, 4, 16)
    with pytest.raises(ValueError, match=r"lora_a_scale\[1\] is given, but lora_a_weights\[1\] is float32"):
        ops.lora_shrink(x, [a, a.float()], out, *meta.meta_args(4), 1.0, backend=backend,
                        lora_a_scale=[a_scale, a_scale])
    with pytest.raises(ValueError, match=r"lora_b_scale must hold one entry per slice of lora_b_weights \(2\)"):
        ops.lora_expand(torch.zeros(2, 4, 16), [b, b], torch.zeros(4, 48), *meta.meta_args(4), backend=backend,
                        lora_b_scale=[b_scale])


def test_per_tensor_scale_equals_its_broadcast():
    """A per-tensor scale (L,) is the per-channel scale with every channel equal."""
    x, a, _, _, _, idx = _setup()
    s = torch.tensor([0.5, 2.0, 0.125])
    got = ops.bgmv_shrink(x, a, idx, backend="torch", w_scale=s)
    want = ops.bgmv_shrink(x, a, idx, backend="torch", w_scale=s[:, None].expand(3, 16).contiguous())
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert not torch.equal(got, ops.bgmv_shrink(x, a, idx, backend="torch", w_scale=torch.ones(3)))


def test_wrapper_add_lora_linear_scale_errors():
    import torch_lora
    x, a, a_scale, b, b_scale, _ = _setup()
    w = torch_lora.PunicaWrapper(8, 4, "cpu", max_loras=3, backend="torch")
    w.update_metadata(torch_lora.LoRAMapping((1, 3, 0, 2), (1, 3, 0, 2), False), [1, 2, 3], 3, 32)
    y = torch.zeros(4, 24)
    with pytest.raises(ValueError, match="lora_b_stacked is float8_e4m3fn: lora_b_scale must give its scales"):
        w.add_lora_linear(y, x, (a,), (b,), None, 1.0, (24,), lora_a_scale=a_scale)
    with pytest.raises(ValueError, match="lora_a_stacked is float8_e4m3fn: lora_a_scale must give its scales"):
        w.add_lora_linear(y, x, (a,), (b.float(),), None, 1.0, (24,))
    w.add_lora_linear(y, x, (a,), (b,), None, 1.0, (24,), lora_a_scale=a_scale, lora_b_scale=b_scale)
    assert torch.isfinite(y).all() and y.abs().sum() > 0


def test_wrapper_add_lora_embedding_ids_scale_errors():
    """add_lora_embedding_ids: an e4m3 table or B without its scale, a scale for a 16-bit table, a
    table scale of another shape ((L, V) per row or (L,)) or dtype: ValueError naming the argument."""
    import torch_lora
    w = torch_lora.PunicaWrapper(8, 4, "cpu", max_loras=3, backend="torch")
    w.update_metadata(torch_lora.LoRAMapping((1, 3, 0, 2), (1, 3, 0, 2), False), [1, 2, 3], 3, 16)
    q, s = oracle.fp8_quantize(np.random.default_rng(3).standard_normal((3, 16, 4)))
    table = torch.from_numpy(q.view(np.uint8)).view(FP8)
    a_scale = torch.from_numpy(s)
    b = torch.randn(3, 24, 4).to(FP8)
    b_scale = torch.ones(3)
    y, ids = torch.zeros(4, 24), torch.tensor([1, 5, 0, 15])
    with pytest.raises(ValueError, match="lora_a is float8_e4m3fn: lora_a_scale must give its scales"):
        w.add_lora_embedding_ids(y, ids, table, b, lora_b_scale=b_scale)
    with pytest.raises(ValueError, match="lora_b is float8_e4m3fn: lora_b_scale must give its scales"):
        w.add_lora_embedding_ids(y, ids, table, b, lora_a_scale=a_scale)
    with pytest.raises(ValueError, match="lora_a_scale is given, but lora_a is float32, not fp8"):
        w.add_lora_embedding_ids(y, ids, table.float(), b, lora_a_scale=a_scale, lora_b_scale=b_scale)
    with pytest.raises(ValueError, match=r"lora_a_scale must have shape \(3, 16\) per channel"):
        w.add_lora_embedding_ids(y, ids, table, b, lora_a_scale=torch.ones(3, 4), lora_b_scale=b_scale)
    with pytest.raises(ValueError, match="lora_a_scale must be float32"):
        w.add_lora_embedding_ids(y, ids, table, b, lora_a_scale=a_scale.half(), lora_b_scale=b_scale)
    with pytest.raises(TypeError, match="lora_b_scale must be a torch.Tensor"):
        w.add_lora_embedding_ids(y, ids, table, b, lora_a_scale=a_scale, lora_b_scale=[1.0])
    assert not y.any()
    w.add_lora_embedding_ids(y, ids, table, b, lora_a_scale=a_scale, lora_b_scale=b_scale)
    assert torch.isfinite(y).all() and y[2].abs().sum() == 0 and y.abs().sum() > 0


def test_column_views_of_a_fused_scale_reach_the_kernels_uncopied():
    """A fused layer's B scale (L, out) split into its slices' columns: each view (channels
    contiguous, slot stride out) is handed on as it is (no copy), and the Triton expand over the
    views equals the expand over contiguous copies."""
    from torch_lora.ops.api import weight_scales
    g = torch.Generator().manual_seed(1)
    widths = (24, 8)
    b_q, fused = _fp8(torch.randn(3, sum(widths), 16, generator=g))            # (L, out, r), (L, out)
    b_q, fused = b_q.to(DEV), fused.to(DEV)
    b = (b_q[:, :24], b_q[:, 24:])
    views = (fused[:, :24], fused[:, 24:])
    got = weight_scales("lora_b_scale", views, b, "lora_b_weights")
    assert all(v.data_ptr() == w.data_ptr() and v.stride() == w.stride() == (32, 1) for v, w in zip(got, views))
    per_tensor = weight_scales("lora_b_scale", (fused[:, 0], fused[:, 1]), b, "lora_b_weights")
    assert all(t.is_contiguous() and t.shape == (3, n) for t, n in zip(per_tensor, widths))
    buf = torch.randn(2, 4, 16, generator=g).to(DEV)
    idx = torch.tensor([0, 2, -1, 1], dtype=torch.int32)
    meta = LoRAKernelMeta.make(3, 4, DEV)
    meta.prepare_tensors(idx.to(DEV))
    outs = []
    for scales in (views, tuple(v.contiguous() for v in views)):
        y = torch.zeros(4, 32, device=DEV)
        ops.lora_expand(buf, b, y, *meta.meta_args(4), backend="triton", lora_b_scale=scales)
        outs.append(y)
    torch.testing.assert_close(outs[0], outs[1], rtol=0, atol=0)
    want = torch.zeros(4, 32, dtype=torch.float64)
    for t, slot in enumerate(idx.tolist()):
        if slot >= 0:
            for s, (lo, hi) in enumerate(((0, 24), (24, 32))):
                deq = b_q[slot, lo:hi].double().cpu() * fused[slot, lo:hi, None].double().cpu()
                want[t, lo:hi] = buf[s, t].double().cpu() @ deq.T
    torch.testing.assert_close(outs[0].double().cpu(), want, rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------- the argument builder

def test_builder_refuses_mixed_slices_and_strided_channels():
    """The kernels pick a slice's weight pointer with tl.where: one weight dtype per launch; the
    channel scales are read at slot * stride + channel (contiguous channels)."""
    x, a, a_scale, _, _, idx = _setup()
    meta = LoRAKernelMeta.make(3, 4, "cpu")
    meta.prepare_tensors(idx)
    from lora_core.kernels.shrink import plan_shrink
    plan = plan_shrink(4, 32, 16, 2, 4, "float32", "float8_e4m3fn", {"BLOCK_M": 16, "BLOCK_K": 32},
                       lora_only=False, workspace=False, has_ranks=False)
    out = torch.zeros(1, 2, 4, 16)
    with pytest.raises(ValueError, match="must share one weight dtype"):
        arguments.shrink_call(plan, x, [a, a.float()], None, meta.meta_args(4), 1.0, out, torch.Tensor.stride,
                              a_scales=(a_scale, None))
    with pytest.raises(ValueError, match="contiguous channels"):
        arguments.shrink_call(plan, x, [a], None, meta.meta_args(4), 1.0, out[:, :1], torch.Tensor.stride,
                              a_scales=(torch.ones(16, 3).T,))
    call = arguments.shrink_call(plan, x, [a, a], None, meta.meta_args(4), 1.0, out, torch.Tensor.stride,
                                 a_scales=(a_scale, a_scale))
    named = dict(zip(call.kernel.arg_names, call.args))
    assert named["as0_ptr"] is a_scale and named["stride_as0_slot"] == 16


# ----------------------------------------------------------------------------- the quantisation rule

def test_oracle_quantize_matches_torch_cast_and_bounds():
    """tests/oracle.fp8_quantize rounds like torch's e4m3 cast, keeps every value within 448, maps
    each channel's amax to 448 and gives an all-zero channel scale 1."""
    w = torch.randn(2, 5, 40, dtype=torch.float64) * torch.tensor([1e-3, 1.0, 30.0, 0.0, 5.0])[None, :, None]
    q, scale = oracle.fp8_quantize(w.numpy())
    qt = torch.from_numpy(q.view(np.uint8)).view(FP8)
    want = (w / torch.from_numpy(scale).double()[..., None]).clamp(-448, 448).to(FP8)
    assert torch.equal(qt.view(torch.uint8), want.view(torch.uint8))
    assert np.all(scale[:, 3] == 1.0)
    assert np.allclose(np.abs(q.astype(np.float32)).max(axis=-1)[:, [0, 1, 2, 4]], 448.0)
    deq = oracle.fp8_dequantize(q, scale)
    assert oracle.rel_err(deq, w.numpy()) < oracle.FP8_QUANT_TOL


# ----------------------------------------------------------------------------- JAX's Triton backend

@pytest.mark.parametrize("fused", [False, True], ids=["two_kernels", "fused"])
def test_jax_triton_backend_takes_channel_scales(fused):
    """jax_lora.ops.triton (the backend contract: a_scales / b_scales per slice, per channel) in
    Triton's interpreter: shrink, expand and linear with fp8 A and B against the float64 oracle on
    the dequantised weights; a 16-bit B beside fp8 A (b_scales None)."""
    jnp = pytest.importorskip("jax.numpy")
    from jax_lora.meta import LoRAKernelMeta as JaxMeta
    from jax_lora.ops import triton as jt
    rng = np.random.default_rng(3)
    T, H, R, L, widths = 6, 64, 16, 3, (32, 16)
    x = rng.standard_normal((T, H)).astype(np.float32)
    qa = [oracle.fp8_quantize(rng.standard_normal((L, R, H)) / 8) for _ in widths]
    qb = [oracle.fp8_quantize(rng.standard_normal((L, n, R)) / 4) for n in widths]
    idx = np.array([0, 2, -1, 1, 2, 0], np.int32)
    meta = JaxMeta.build(idx, L, T)
    xj = jnp.asarray(x).astype(jnp.bfloat16)
    xr = np.asarray(xj.astype(jnp.float32))
    a_deq = [oracle.fp8_dequantize(q, s) for q, s in qa]
    b_deq = [oracle.fp8_dequantize(q, s) for q, s in qb]
    buf = jt.shrink(xj, tuple(jnp.asarray(q) for q, _ in qa), meta, 0.5, a_scales=tuple(jnp.asarray(s) for _, s in qa))
    assert oracle.rel_err(np.asarray(buf), oracle.shrink(xr, a_deq, idx, 0.5)) < oracle.FP8_TOL["float32"]
    y0 = rng.standard_normal((T, sum(widths) + 3)).astype(np.float32)
    y = jt.expand(buf, tuple(jnp.asarray(q) for q, _ in qb), jnp.asarray(y0), meta, (0, 32), True,
                  b_scales=tuple(jnp.asarray(s) for _, s in qb))
    want = oracle.expand(np.asarray(buf), b_deq, y0, idx, 0, True)
    assert oracle.rel_err(np.asarray(y), want) < oracle.FP8_TOL["float32"]
    b16 = [np.asarray(d, np.float32) for d in b_deq]
    y = jt.linear(jnp.asarray(y0).astype(jnp.bfloat16), xj, tuple(jnp.asarray(q) for q, _ in qa),
                  tuple(jnp.asarray(b).astype(jnp.bfloat16) for b in b16), meta, 0.5, (0, 32), fused=fused,
                  a_scales=tuple(jnp.asarray(s) for _, s in qa))
    b16r = [np.asarray(jnp.asarray(b).astype(jnp.bfloat16).astype(jnp.float32)) for b in b16]
    want = oracle.lora_linear(np.asarray(jnp.asarray(y0).astype(jnp.bfloat16).astype(jnp.float32)), xr, a_deq, b16r,
                              None, 0.5, idx)
    assert oracle.rel_err(np.asarray(y.astype(jnp.float32)), want) < oracle.FP8_TOL["bfloat16"]


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_fp8_deterministic_rows_are_batch_invariant(backend):
    """deterministic=True with fp8 weights: a token's shrink row is bitwise the same alone and inside
    a larger batch, and equals the default mode's within float32 rounding."""
    x, a, a_scale, _, _, idx = _setup(num_tokens=4)
    big = torch.cat([x, torch.randn(9, 32, generator=torch.Generator().manual_seed(1))])
    big_idx = torch.cat([idx, torch.tensor([2, 1, 0, -1, 2, 2, 1, 0, 1], dtype=torch.int32)])
    dev = DEV if backend == "triton" else "cpu"
    x, a, a_scale, idx, big, big_idx = (t.to(dev) for t in (x, a, a_scale, idx, big, big_idx))
    alone = ops.bgmv_shrink(x[:1], a, idx[:1], 0.5, backend=backend, deterministic=True, w_scale=a_scale)
    batch = ops.bgmv_shrink(big, a, big_idx, 0.5, backend=backend, deterministic=True, w_scale=a_scale)
    assert torch.equal(alone[0], batch[0])
    default = ops.bgmv_shrink(big, a, big_idx, 0.5, backend=backend, w_scale=a_scale)
    torch.testing.assert_close(batch, default, rtol=1e-5, atol=1e-5)


def test_slices_mixing_fp8_and_16_bit_weights_run_as_separate_launches():
    """One call whose slices mix fp8 and float32 weights (A: [fp8, f32, fp8]; B: [f32, fp8, fp8]) on
    the Triton backends of both frameworks, in Triton's interpreter: the fp8 and the 16-bit runs of
    slices go in separate launches (`planning.slice_chunks`), and the result equals the float64
    oracle on the dequantised weights."""
    from lora_core.kernels.planning import slice_chunks
    from torch_lora.ops import triton as tt
    jnp = pytest.importorskip("jax.numpy")
    from jax_lora.meta import LoRAKernelMeta as JaxMeta
    from jax_lora.ops import triton as jt
    rng = np.random.default_rng(5)
    T, H, R, L, widths = 5, 32, 16, 3, (16, 24, 8)
    idx = np.array([0, 2, -1, 1, 2], np.int32)
    x = rng.standard_normal((T, H)).astype(np.float32)
    y0 = rng.standard_normal((T, sum(widths))).astype(np.float32)
    a_fp8, b_fp8 = (True, False, True), (False, True, True)
    a = [oracle.fp8_quantize(rng.standard_normal((L, R, H)) / 8) if q else (rng.standard_normal((L, R, H)) / 8, None)
         for q in a_fp8]
    b = [oracle.fp8_quantize(rng.standard_normal((L, n, R)) / 4) if q else (rng.standard_normal((L, n, R)) / 4, None)
         for q, n in zip(b_fp8, widths)]
    a_ref = [np.asarray(w, np.float32) if s is None else oracle.fp8_dequantize(w, s) for w, s in a]
    b_ref = [np.asarray(w, np.float32) if s is None else oracle.fp8_dequantize(w, s) for w, s in b]
    want = oracle.lora_linear(y0, x, a_ref, b_ref, None, 0.5, idx)

    def torch_w(w, s):
        return (torch.from_numpy(np.asarray(w).view(np.uint8)).view(FP8) if s is not None
                else torch.from_numpy(np.asarray(w, np.float32))).to(DEV)

    ta, tb = [torch_w(*p) for p in a], [torch_w(*p) for p in b]
    assert slice_chunks(3, ta, tb) == [(0, 1), (1, 2), (2, 3)] and slice_chunks(3, ta) == [(0, 1), (1, 2), (2, 3)]
    t_scales = lambda ps: tuple(None if s is None else torch.from_numpy(np.asarray(s, np.float32)).to(DEV)
                                for _, s in ps)
    meta = LoRAKernelMeta.make(L, T, DEV)
    meta.prepare_tensors(torch.from_numpy(idx).to(DEV))
    y = torch.from_numpy(y0.copy()).to(DEV)
    tt.linear(y, torch.from_numpy(x).to(DEV), ta, tb, meta.meta_args(T), 0.5, (0, 16, 40), fused=False,
              a_scales=t_scales(a), b_scales=t_scales(b))
    assert oracle.rel_err(y.cpu().numpy(), want) < oracle.FP8_TOL["float32"]

    def jax_w(w, s):
        return jnp.asarray(np.asarray(w)) if s is not None else jnp.asarray(np.asarray(w, np.float32))

    j_scales = lambda ps: tuple(None if s is None else jnp.asarray(np.asarray(s, np.float32)) for _, s in ps)
    got = jt.linear(jnp.asarray(y0), jnp.asarray(x), tuple(jax_w(*p) for p in a), tuple(jax_w(*p) for p in b),
                    JaxMeta.build(idx, L, T), 0.5, (0, 16, 40), fused=False, a_scales=j_scales(a),
                    b_scales=j_scales(b))
    assert oracle.rel_err(np.asarray(got), want) < oracle.FP8_TOL["float32"]
