"""fp8 (e4m3) adapter weights on the JAX ops: the jnp reference ("xla"), the deterministic path and
the Pallas TPU kernels (TPU interpret mode, races checked) against a float64 oracle.

The oracle (tests/oracle.py's shrink / expand) runs on the dequantised weights, float64(w_q) *
scale, so it sees exactly the weights the kernels see; the error left is float32 accumulation
(tolerance: the contract's for the activation dtype, relative Frobenius error 1e-5 for float32,
2e-2 for bfloat16). The quantisation itself (per output channel, amax / 448, round to nearest even)
is written here in NumPy (`quantise`) and checked against jax_lora.quant.quantize_rows bit for bit.
Accuracy against the 16-bit adapter: e4m3 keeps 3 mantissa bits, so on Gaussian weights the
relative error of one LoRA product is a few percent (`test_fp8_accuracy_against_16_bit_weights`
bounds it by FP8_VS_16BIT_TOL and checks it is not zero).
"""

from __future__ import annotations

import logging
import types

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jax_lora import ops
from jax_lora.meta import build_kernel_meta
from jax_lora.ops import api as ops_api
from jax_lora.quant import dequantize_rows, quantize_rows

from . import jax_helpers, oracle
from .pallas_tpu_impl import races_checked

IMPLS = ("xla", "deterministic", "pallas_tpu")
TOL = {"float32": 1e-5, "bfloat16": 2e-2}
FP8_VS_16BIT_TOL = 0.08
"""Relative Frobenius error of an fp8 LoRA product against the same product with the 16-bit
weights it was quantised from (Gaussian weights): e4m3's step is 2^-3 of the value's power of two,
its round-off a few percent (measured about 0.03 on these shapes)."""


# ----------------------------------------------------------------------------- quantisation helpers

def quantise(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(w_q e4m3 (..., c, k), scale float32 (..., c)): per channel c, scale = amax(|w[c]|) / 448
    (1 where amax == 0), w_q = e4m3(clip(w / scale, -448, 448)) (round to nearest even)."""
    w = np.asarray(w, np.float32)
    amax = np.abs(w).max(axis=-1)
    scale = np.where(amax > 0, amax / np.float32(448.0), np.float32(1.0)).astype(np.float32)
    q = np.clip(w / scale[..., None], -448.0, 448.0).astype(ml_dtypes.float8_e4m3fn)
    return q, scale


def dequantise(q: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """float64(w_q[..., c, k]) * scale[..., c]."""
    return np.asarray(q).astype(np.float64) * np.asarray(scale, np.float64)[..., None]


def _rand(rng, *shape, dtype="float32"):
    return np.asarray(jnp.asarray(rng.standard_normal(shape).astype(np.float32), dtype))


def _run(impl: str, fn, *args, **kwargs):
    """fn(*args) on one implementation: backend "xla", "xla" with deterministic=True, or
    "pallas_tpu" in TPU interpret mode with races checked."""
    if impl == "deterministic":
        return fn(*args, backend="xla", deterministic=True, **kwargs)
    if impl == "pallas_tpu":
        with races_checked():
            return fn(*args, backend="pallas_tpu", **kwargs)
    return fn(*args, backend=impl, **kwargs)


def _assert_close(got, want, dtype: str):
    err = oracle.rel_err(np.asarray(jnp.asarray(got, jnp.float32)), want)
    assert err <= TOL[dtype], f"relative error {err} > {TOL[dtype]}"


IDX = np.array([0, 2, -1, 1, 1, 0, 2, -1, 0, 2, 1, 0], np.int32)   # T = 12 tokens, 3 slots, two without LoRA
L, R, H = 3, 8, 128


def test_quantise_helper_matches_the_library_rule():
    """The test's NumPy quantiser and jax_lora.quant.quantize_rows agree bit for bit (scales and
    e4m3 codes), an all-zero row gets scale 1, and the dequantised weights are within e4m3's step."""
    rng = np.random.default_rng(0)
    w = _rand(rng, L, R, H) * 3.0
    w[1, 2] = 0.0
    q, s = quantise(w)
    q_lib, s_lib = quantize_rows(w)
    np.testing.assert_array_equal(np.asarray(s_lib), s)
    np.testing.assert_array_equal(np.asarray(q_lib).view(np.uint8), q.view(np.uint8))
    assert s[1, 2] == 1.0 and not np.any(np.asarray(q[1, 2], np.float32))
    np.testing.assert_allclose(np.asarray(dequantize_rows(q_lib, s_lib)), dequantise(q, s), rtol=2.0 ** -24, atol=0)
    assert np.abs(dequantise(q, s) - w).max() <= np.abs(w).max() * 2.0 ** -4


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_lora_shrink_fp8_slices_match_oracle(impl, dtype):
    """lora_shrink with two fp8 slices (per-channel scales) and one bfloat16 slice (scale None):
    buf = scale * a_scale * x @ float32(A_q).T, 0 for tokens without LoRA."""
    rng = np.random.default_rng(1)
    x = _rand(rng, len(IDX), H, dtype=dtype)
    a16 = [_rand(rng, L, R, H, dtype="bfloat16") for _ in range(3)]
    (q0, s0), (q1, s1) = quantise(a16[0]), quantise(a16[1])
    meta = build_kernel_meta(IDX, len(IDX), max_loras=L)
    got = _run(impl, ops.lora_shrink, x, [q0, q1, a16[2]], meta, 0.5, lora_a_scale=(s0, s1, None))
    want = oracle.shrink(x, [dequantise(q0, s0), dequantise(q1, s1), a16[2]], IDX, 0.5)
    assert got.shape == (3, len(IDX), R) and got.dtype == jnp.float32
    _assert_close(got, want, dtype)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("add_inputs", [True, False])
def test_lora_expand_fp8_slices_match_oracle(impl, add_inputs):
    """lora_expand with an fp8 slice (per-channel (L, n) scale), an fp8 slice with a per-tensor (L,)
    scale and a 16-bit slice, laid from offset_start 8 in y; rows without LoRA untouched."""
    rng = np.random.default_rng(2)
    widths = (16, 24, 8)
    buf = _rand(rng, 3, len(IDX), R)
    b16 = [_rand(rng, L, n, R) for n in widths]
    q0, s0 = quantise(b16[0])
    q1 = np.clip(b16[1] * 40.0, -448, 448).astype(ml_dtypes.float8_e4m3fn)
    s1 = np.array([0.5, 0.25, 2.0], np.float32)                                     # per tensor: one per slot
    y = _rand(rng, len(IDX), 64)
    meta = build_kernel_meta(IDX, len(IDX), max_loras=L)
    got = _run(impl, ops.lora_expand, buf, [q0, q1, b16[2]], y, meta, 8, add_inputs,
               lora_b_scale=[s0, s1, None])
    s1_channels = np.broadcast_to(s1[:, None], (L, widths[1]))
    want = oracle.expand(buf, [dequantise(q0, s0), dequantise(q1, s1_channels), b16[2]], y, IDX, 8, add_inputs)
    _assert_close(got, want, "float32")
    rows = IDX < 0
    np.testing.assert_array_equal(np.asarray(got)[rows], y[rows])


@pytest.mark.parametrize("impl", IMPLS)
def test_fp8_with_lora_ranks_matches_oracle(impl):
    """fp8 A and B with per-slot ranks: the weights past a slot's rank count as zero, the scales of
    the remaining channels apply as without ranks."""
    rng = np.random.default_rng(3)
    ranks = np.array([8, 3, 5], np.int32)
    x = _rand(rng, len(IDX), H)
    qa, sa = quantise(_rand(rng, L, R, H))
    qb, sb = quantise(_rand(rng, L, 32, R))
    y = _rand(rng, len(IDX), 32)
    meta = build_kernel_meta(IDX, len(IDX), max_loras=L)
    buf = _run(impl, ops.lora_shrink, x, qa, meta, 1.0, lora_ranks=ranks, lora_a_scale=sa)
    got = _run(impl, ops.lora_expand, buf, qb, y, meta, 0, True, lora_ranks=ranks, lora_b_scale=sb)
    keep = np.arange(R)[None, :] < ranks[:, None]
    a_deq = dequantise(qa, sa) * keep[:, :, None]
    b_deq = dequantise(qb, sb) * keep[:, None, :]
    want_buf = oracle.shrink(x, [a_deq], IDX, 1.0)
    _assert_close(buf, want_buf, "float32")
    _assert_close(got, oracle.expand(want_buf, [b_deq], y, IDX, 0, True), "float32")


@pytest.mark.parametrize("impl", IMPLS)
def test_bgmv_and_sgmv_take_w_scale(impl):
    """bgmv_shrink / bgmv_expand / bgmv_expand_slice / sgmv_shrink with e4m3 weights and w_scale; a B
    wider than y (vocabulary padding) is cut with its scale."""
    rng = np.random.default_rng(4)
    x = _rand(rng, len(IDX), H)
    qa, sa = quantise(_rand(rng, L, R, H))
    qb, sb = quantise(_rand(rng, L, 40, R))
    a_deq, b_deq = dequantise(qa, sa), dequantise(qb, sb)
    buf = _run(impl, ops.bgmv_shrink, x, qa, IDX, 0.25, w_scale=sa)
    want_buf = oracle.shrink(x, [a_deq], IDX, 0.25)[0]
    _assert_close(buf, want_buf, "float32")
    y = _rand(rng, len(IDX), 32)                                                     # narrower than B's 40 rows
    got = _run(impl, ops.bgmv_expand, np.asarray(buf), qb, y, IDX, True, w_scale=sb)
    _assert_close(got, oracle.expand(want_buf[None], [b_deq[:, :32]], y, IDX, 0, True), "float32")
    y2 = _rand(rng, len(IDX), 64)
    got = _run(impl, ops.bgmv_expand_slice, np.asarray(buf), qb, y2, IDX, 16, 40, False,
               w_scale=sb[:, 0].copy())                                               # per tensor
    b_tensor = dequantise(qb, np.broadcast_to(sb[:, :1], sb.shape))
    _assert_close(got, oracle.expand(want_buf[None], [b_tensor], y2, IDX, 16, False), "float32")
    starts, lengths, loras = np.array([0, 5], np.int32), np.array([5, 7], np.int32), np.array([2, 0], np.int32)
    got = _run(impl, ops.sgmv_shrink, x, qa, starts, lengths, loras, 2, 7, 12, 1.0, w_scale=sa)
    seg_idx = oracle.segments_to_indices(starts, lengths, loras, len(IDX))
    _assert_close(got, oracle.shrink(x, [a_deq], seg_idx, 1.0)[0], "float32")


@pytest.mark.parametrize("row_order", ["token", "sorted"])
def test_pallas_expand_fp8_in_place_kernels(row_order):
    """pallas_tpu.expand on 128-aligned slices (y updated in place: by blocks in token order, by row
    DMAs in sorted order) with fp8 B scales read as (1, tn) blocks and a LoRA bias on one slice:
    y += b_scale * buf @ B_q.T + bias, against the oracle."""
    from jax_lora.ops import pallas_tpu
    from jax_lora.ops.pallas_tpu import plans

    rng = np.random.default_rng(11)
    idx = np.array([0, 2, -1, 1, 1, 0, 2, -1, 0, 2, 1, 0, 1, 1, -1, 2], np.int32)
    t, widths = len(idx), (128, 128)
    buf = _rand(rng, 2, t, R)
    (q0, s0), (q1, s1) = quantise(_rand(rng, L, 128, R)), quantise(_rand(rng, L, 128, R))
    bias = (None, _rand(rng, L, 128))
    y = _rand(rng, t, 384)
    plan = plans.plan_expand(t, widths, R, L, 128, "nr", (False, True), 1, w_scaled=(True, True))
    assert plans.plan_inplace(plan, (128, 256), 384, 4, by_rows=row_order == "sorted") is not None
    meta = build_kernel_meta(idx, t, max_loras=L)
    with races_checked():
        got = pallas_tpu.expand(buf, (q0, q1), y, meta, (128, 256), True, None, bias, row_order=row_order,
                                b_scales=(s0, s1))
    want = oracle.expand(buf, [dequantise(q0, s0), dequantise(q1, s1)], y, idx, 128, True, bias)
    _assert_close(got, want, "float32")


@pytest.mark.parametrize("impl", ["xla", "pallas_tpu"])
def test_fp8_accuracy_against_16_bit_weights(impl):
    """Quantised on the fly from bfloat16 weights, the fp8 LoRA delta (shrink then expand) is within
    FP8_VS_16BIT_TOL of the delta of the bfloat16 weights (float64 oracle), and not equal to it
    (the quantisation is really applied)."""
    rng = np.random.default_rng(5)
    x = _rand(rng, len(IDX), H)
    a16, b16 = _rand(rng, L, R, H, dtype="bfloat16"), _rand(rng, L, 32, R, dtype="bfloat16")
    (qa, sa), (qb, sb) = quantise(a16), quantise(b16)
    y = np.zeros((len(IDX), 32), np.float32)
    meta = build_kernel_meta(IDX, len(IDX), max_loras=L)
    buf = _run(impl, ops.lora_shrink, x, qa, meta, 1.0, lora_a_scale=sa)
    got = _run(impl, ops.lora_expand, buf, qb, y, meta, 0, True, lora_b_scale=sb)
    want16 = oracle.expand(oracle.shrink(x, [a16], IDX, 1.0), [b16], y, IDX, 0, True)
    err = oracle.rel_err(np.asarray(got), want16)
    assert 1e-3 < err < FP8_VS_16BIT_TOL, err


def test_deterministic_fp8_is_batch_invariant():
    """With deterministic=True a token's fp8 result is bitwise the same alone and inside a larger,
    shuffled batch."""
    rng = np.random.default_rng(6)
    x = _rand(rng, len(IDX), H)
    qa, sa = quantise(_rand(rng, L, R, H))
    qb, sb = quantise(_rand(rng, L, 24, R))
    y = _rand(rng, len(IDX), 24)

    def run(rows):
        buf = ops.bgmv_shrink(x[rows], qa, IDX[rows], 1.0, backend="xla", deterministic=True, w_scale=sa)
        return np.asarray(ops.bgmv_expand(buf, qb, y[rows], IDX[rows], True, backend="xla", deterministic=True,
                                          w_scale=sb))

    full = run(np.arange(len(IDX)))
    perm = rng.permutation(len(IDX))
    np.testing.assert_array_equal(run(perm), full[perm])
    np.testing.assert_array_equal(run(np.array([3])), full[3:4])


# ----------------------------------------------------------------------------- the wrapper

def _wrapper(impl: str):
    """A PunicaWrapper over 3 slots whose tokens use IDX (id i + 1 is slot i)."""
    ids = [i + 1 if i >= 0 else 0 for i in IDX]
    if impl == "deterministic":
        return jax_helpers.wrapper(ids, [1, 2, 3], backend="xla", deterministic=True)
    return jax_helpers.wrapper(ids, [1, 2, 3], backend=impl)


def _call(impl: str, fn, *args, **kwargs):
    if impl == "pallas_tpu":
        with races_checked():
            return fn(*args, **kwargs)
    return fn(*args, **kwargs)


@pytest.mark.parametrize("impl", IMPLS)
def test_wrapper_add_lora_linear_fp8_matches_oracle(impl):
    """PunicaWrapper.add_lora_linear with fp8 A and B (one slice 16-bit, one with per-tensor B scales)
    and a LoRA bias, then add_lora_linear_stacked with stacked scales: y += (scale * a_scale * x @
    A_q.T) @ (b_scale * B_q).T + bias, against the oracle on the dequantised weights."""
    rng = np.random.default_rng(8)
    widths = (16, 8)
    w = _wrapper(impl)
    x, y = _rand(rng, len(IDX), H), _rand(rng, len(IDX), sum(widths))
    (qa0, sa0), (qb0, sb0) = quantise(_rand(rng, L, R, H)), quantise(_rand(rng, L, widths[0], R))
    a1 = _rand(rng, L, R, H)
    qb1 = np.clip(_rand(rng, L, widths[1], R) * 30, -448, 448).astype(ml_dtypes.float8_e4m3fn)
    sb1 = np.array([0.1, 0.2, 0.3], np.float32)
    bias = [_rand(rng, L, widths[0]), None]
    got = _call(impl, w.add_lora_linear, y, x, (qa0, a1), (qb0, qb1), bias, 0.5, widths,
                lora_a_scale=(sa0, None), lora_b_scale=(sb0, sb1))
    b1 = dequantise(qb1, np.broadcast_to(sb1[:, None], (L, widths[1])))
    want = oracle.lora_linear(y, x, [dequantise(qa0, sa0), a1], [dequantise(qb0, sb0), b1], bias, 0.5, IDX)
    _assert_close(got, want, "float32")
    # stacked: lora_a (S, L, r, H), lora_b (L, N, r), scales (S, L, r) / (L, N)
    qa, sa = quantise(_rand(rng, 2, L, R, H))
    qb, sb = quantise(_rand(rng, L, sum(widths), R))
    got = _call(impl, w.add_lora_linear_stacked, y, x, qa, qb, 1.0, widths, lora_a_scale=sa, lora_b_scale=sb)
    b_deq = dequantise(qb, sb)
    want = oracle.lora_linear(y, x, [dequantise(qa[0], sa[0]), dequantise(qa[1], sa[1])],
                              [b_deq[:, :16], b_deq[:, 16:]], None, 1.0, IDX)
    _assert_close(got, want, "float32")


@pytest.mark.parametrize("impl", IMPLS)
def test_wrapper_shrink_expand_and_embedding_take_scales(impl):
    """add_shrink (lora_a_scale), add_expand (lora_b_scale) and add_lora_embedding (lora_b_scale) with
    e4m3 weights, against the oracle; an fp8 weight without its scale is a ValueError there too."""
    rng = np.random.default_rng(9)
    w = _wrapper(impl)
    x = _rand(rng, len(IDX), H)
    qa, sa = quantise(_rand(rng, L, R, H))
    qb, sb = quantise(_rand(rng, L, 24, R))
    buf = _call(impl, w.add_shrink, np.zeros((1, len(IDX), R), np.float32), x, (qa,), 2.0, lora_a_scale=(sa,))
    want_buf = oracle.shrink(x, [dequantise(qa, sa)], IDX, 2.0)
    _assert_close(buf, want_buf, "float32")
    y = _rand(rng, len(IDX), 24)
    got = _call(impl, w.add_expand, y, want_buf.astype(np.float32), (qb,), None, (24,), lora_b_scale=(sb,))
    _assert_close(got, oracle.expand(want_buf, [dequantise(qb, sb)], y, IDX, 0, True), "float32")
    rows = _rand(rng, len(IDX), R)
    got = _call(impl, w.add_lora_embedding, y, rows, qb, lora_b_scale=sb)
    _assert_close(got, oracle.expand(rows[None], [dequantise(qb, sb)], y, IDX, 0, True), "float32")
    with pytest.raises(ValueError, match="lora_b_scale"):
        w.add_expand(y, want_buf.astype(np.float32), (qb,), None, (24,))


@pytest.mark.parametrize("impl", IMPLS)
def test_wrapper_logits_take_scales(impl):
    """add_lora_logits with e4m3 A and B (B wider than y: cut with its scale) against the oracle; an
    fp8 A without its scale is a ValueError naming lora_a_scale (never used unscaled)."""
    rng = np.random.default_rng(11)
    w = _wrapper(impl)
    x, y = _rand(rng, len(IDX), H), _rand(rng, len(IDX), 32)
    qa, sa = quantise(_rand(rng, L, R, H))
    qb, sb = quantise(_rand(rng, L, 40, R))
    got = _call(impl, w.add_lora_logits, y, x, qa, qb, 0.5, lora_a_scale=sa, lora_b_scale=sb)
    buf = oracle.shrink(x, [dequantise(qa, sa)], IDX, 0.5)
    _assert_close(got, oracle.expand(buf, [dequantise(qb, sb)[:, :32]], y, IDX, 0, True), "float32")
    with pytest.raises(ValueError, match="lora_a_scale"):
        w.add_lora_logits(y, x, qa, qb, 0.5)


@pytest.mark.parametrize("impl", IMPLS)
def test_wrapper_several_adapters_per_token_fp8(impl):
    """A step with several adapters per token (weighted pairs) and fp8 A / B: y[t] += sum_j w[t, j] *
    (scale * a_scale * x @ A_q.T) @ (b_scale * B_q).T over the token's pairs, against the oracle."""
    from jax_lora import LoRAMapping, PunicaWrapper

    rng = np.random.default_rng(10)
    ids = [(1, 3), (2,), (), (3, 1), (1,), (2, 3)]
    weights = [(0.5, -0.25), (2.0,), (), (1.0, 1.5), (0.75,), (0.3, 0.6)]
    w = PunicaWrapper(max_num_batched_tokens=8, max_batches=8, max_loras=L,
                      backend="xla" if impl == "deterministic" else impl, deterministic=impl == "deterministic")
    w.update_metadata(LoRAMapping(ids, (0,) * len(ids), False, weights), [1, 2, 3], L + 1, 64)
    x, y = _rand(rng, len(ids), H), _rand(rng, len(ids), 24)
    (qa, sa), (qb, sb) = quantise(_rand(rng, L, R, H)), quantise(_rand(rng, L, 24, R))
    got = _call(impl, w.add_lora_linear, y, x, (qa,), (qb,), None, 0.5, (24,), lora_a_scale=(sa,),
                lora_b_scale=(sb,))
    slots = [[i - 1 for i in t] for t in ids]
    want = oracle.multi_lora_linear(y, x, [dequantise(qa, sa)], [dequantise(qb, sb)], 0.5, slots, weights)
    _assert_close(got, want, "float32")


def _embedding_oracle(y, ids, table, lora_b, slots, weights):
    """y[t] + sum_j weights[t][j] * table[slots[t][j], ids[t]] @ lora_b[slots[t][j]].T, float64."""
    out = np.asarray(y, np.float64).copy()
    for t in range(len(ids)):
        for s, wt in zip(slots[t], weights[t]):
            out[t] += wt * (np.asarray(lora_b[s], np.float64) @ np.asarray(table[s, ids[t]], np.float64))
    return out


@pytest.mark.parametrize("impl", IMPLS + ("triton",))
@pytest.mark.parametrize("granularity", ["row", "tensor"])
def test_wrapper_embedding_ids_take_scales(impl, granularity):
    """add_lora_embedding_ids with an e4m3 LoRA-A table (one scale per table row (L, V), or per slot
    (L,)) and an e4m3 B (per output channel): the looked-up row is float32(A_q[l, v]) * a_scale[l, v];
    then the e4m3 table with a 16-bit B; and inside jax.jit. "triton": JAX's Triton backend (the
    interpreter on the CPU)."""
    import jax

    rng = np.random.default_rng(12)
    vocab = 64                               # jax_helpers.wrapper's vocab_size
    w = _wrapper(impl)
    ids = rng.integers(0, vocab, len(IDX)).astype(np.int32)
    table = _rand(rng, L, vocab, R)
    if granularity == "row":
        qa, sa = quantise(table)
    else:
        qa, s_all = quantise(table.reshape(L, 1, -1))
        qa, sa = qa.reshape(table.shape), s_all[:, 0]
    a_deq = dequantise(qa, sa if granularity == "row" else np.broadcast_to(sa[:, None], (L, vocab)))
    qb, sb = quantise(_rand(rng, L, 24, R))
    y = _rand(rng, len(IDX), 24)
    one = ([[i] if i >= 0 else [] for i in IDX], [[1.0] if i >= 0 else [] for i in IDX])
    got = _call(impl, w.add_lora_embedding_ids, y, ids, qa, qb, lora_a_scale=sa, lora_b_scale=sb)
    _assert_close(got, _embedding_oracle(y, ids, a_deq, dequantise(qb, sb), *one), "float32")
    np.testing.assert_array_equal(np.asarray(got)[IDX < 0], y[IDX < 0])
    b16 = _rand(rng, L, 24, R)
    got = _call(impl, w.add_lora_embedding_ids, y, ids, qa, b16, lora_a_scale=sa)
    _assert_close(got, _embedding_oracle(y, ids, a_deq, b16, *one), "float32")
    jitted = jax.jit(lambda wr, yy, ii, a, b, s_a, s_b: wr.add_lora_embedding_ids(yy, ii, a, b, lora_a_scale=s_a,
                                                                                    lora_b_scale=s_b))
    got = _call(impl, jitted, w, y, ids, qa, qb, sa, sb)
    _assert_close(got, _embedding_oracle(y, ids, a_deq, dequantise(qb, sb), *one), "float32")


@pytest.mark.parametrize("impl", IMPLS)
def test_wrapper_embedding_ids_fp8_several_adapters_per_token(impl):
    """The embedding of a paired step with an e4m3 table and B: each pair's row times its table
    row's scale, weighted, summed in float32."""
    from jax_lora import LoRAMapping, PunicaWrapper

    rng = np.random.default_rng(13)
    pair_ids = [(1, 3), (2,), (), (3, 1), (1,), (2, 3)]
    weights = [(0.5, -0.25), (2.0,), (), (1.0, 1.5), (0.75,), (0.3, 0.6)]
    vocab = 16
    w = PunicaWrapper(max_num_batched_tokens=8, max_batches=8, max_loras=L,
                      backend="xla" if impl == "deterministic" else impl, deterministic=impl == "deterministic")
    w.update_metadata(LoRAMapping(pair_ids, (0,) * len(pair_ids), False, weights), [1, 2, 3], L + 1, vocab)
    ids = rng.integers(0, vocab, len(pair_ids)).astype(np.int32)
    (qa, sa), (qb, sb) = quantise(_rand(rng, L, vocab, R)), quantise(_rand(rng, L, 24, R))
    y = _rand(rng, len(pair_ids), 24)
    got = _call(impl, w.add_lora_embedding_ids, y, ids, qa, qb, lora_a_scale=sa, lora_b_scale=sb)
    slots = [[i - 1 for i in t] for t in pair_ids]
    _assert_close(got, _embedding_oracle(y, ids, dequantise(qa, sa), dequantise(qb, sb), slots, weights), "float32")


def test_embedding_ids_scale_errors_name_the_argument():
    """add_lora_embedding_ids: an e4m3 table or B without its scale, a scale for a 16-bit table, a
    scale of another shape or dtype: ValueError naming lora_a_scale / lora_b_scale."""
    rng = np.random.default_rng(14)
    w = _wrapper("xla")
    ids = rng.integers(0, 64, len(IDX)).astype(np.int32)
    (qa, sa), (qb, sb) = quantise(_rand(rng, L, 64, R)), quantise(_rand(rng, L, 24, R))
    y = _rand(rng, len(IDX), 24)
    with pytest.raises(ValueError, match="lora_a is float8_e4m3fn: lora_a_scale must give its scales"):
        w.add_lora_embedding_ids(y, ids, qa, qb, lora_b_scale=sb)
    with pytest.raises(ValueError, match="lora_b is float8_e4m3fn: lora_b_scale must give its scales"):
        w.add_lora_embedding_ids(y, ids, qa, qb, lora_a_scale=sa)
    with pytest.raises(ValueError, match="lora_a_scale is given, but lora_a is float32, not fp8"):
        w.add_lora_embedding_ids(y, ids, np.asarray(qa, np.float32), qb, lora_a_scale=sa, lora_b_scale=sb)
    with pytest.raises(ValueError, match=r"lora_a_scale must have shape \(3, 64\) per channel"):
        w.add_lora_embedding_ids(y, ids, qa, qb, lora_a_scale=np.ones((L, R), np.float32), lora_b_scale=sb)
    with pytest.raises(ValueError, match="lora_b_scale must be float32"):
        w.add_lora_embedding_ids(y, ids, qa, qb, lora_a_scale=sa, lora_b_scale=sb.astype(np.float16))


# ----------------------------------------------------------------------------- bad inputs

def _shrink_args():
    rng = np.random.default_rng(7)
    x = _rand(rng, 4, 32)
    q, s = quantise(_rand(rng, 2, 4, 32))
    return x, q, s, build_kernel_meta(np.array([0, 1, -1, 0], np.int32), 4, max_loras=2)


def test_fp8_weight_without_scale_is_refused():
    x, q, _, meta = _shrink_args()
    with pytest.raises(ValueError, match="lora_a_scale"):
        ops.lora_shrink(x, q, meta, 1.0)
    with pytest.raises(ValueError, match="lora_a_stacked is float8_e4m3fn: lora_a_scale must give its scales"):
        ops.lora_shrink(x, [q], meta, 1.0, lora_a_scale=[None])
    with pytest.raises(ValueError, match="w_scale"):
        ops.bgmv_expand(np.zeros((4, 4), np.float32), q.transpose(0, 2, 1).copy(), np.zeros((4, 32), np.float32),
                        np.array([0, 1, -1, 0], np.int32))


def test_scale_for_a_16_bit_weight_is_refused():
    x, q, s, meta = _shrink_args()
    w16 = np.asarray(q, np.float32)
    with pytest.raises(ValueError, match="lora_a_scale is given, but lora_a_stacked is float32, not fp8"):
        ops.lora_shrink(x, w16, meta, 1.0, lora_a_scale=s)


@pytest.mark.parametrize("bad, match", [
    (np.ones((2, 5), np.float32), r"lora_a_scale must have shape \(2, 4\)"),
    (np.ones((3,), np.float32), r"lora_a_scale must have shape \(2, 4\)"),
    (np.ones((2, 4), np.float16), "lora_a_scale must be float32 .* got dtype float16"),
    (np.ones((2, 4), np.float64), "lora_a_scale must be float32 .* got dtype float64"),
    (1.0, "lora_a_scale must be float32 .* got dtype float64"),
])
def test_scale_of_wrong_shape_or_dtype_is_refused(bad, match):
    x, q, _, meta = _shrink_args()
    with pytest.raises(ValueError, match=match):
        ops.lora_shrink(x, q, meta, 1.0, lora_a_scale=bad)


def test_scale_entry_count_must_match_slices():
    x, q, s, meta = _shrink_args()
    with pytest.raises(ValueError, match=r"lora_a_scale must hold one entry per slice of lora_a_stacked \(2\)"):
        ops.lora_shrink(x, [q, q], meta, 1.0, lora_a_scale=[s])


def test_backend_without_weight_scales_runs_the_reference_and_says_so(caplog):
    """A backend whose ops take no weight scales (declared WEIGHT_SCALES = False) is not handed fp8
    scales: the call runs on the xla reference, said once on the jax_lora logger."""
    backend = types.SimpleNamespace(NAME="no-scales", WEIGHT_SCALES=False)
    with caplog.at_level(logging.WARNING, logger="jax_lora"):
        impl, kw = ops_api.scale_keywords(backend, False, a_scales=(np.ones((2, 4), np.float32),))
    assert impl.NAME == "xla" and impl is not backend and set(kw) == {"a_scales"}
    assert "does not apply fp8 weight scales" in caplog.text
    impl, kw = ops_api.scale_keywords(backend, True, b_scales=(np.ones((2, 4), np.float32),))
    assert impl is ops_api.invariant and set(kw) == {"b_scales"}
    assert ops_api.scale_keywords(backend, False) == (backend, {})
