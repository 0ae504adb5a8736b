"""Pallas TPU kernels (jax_lora.ops.pallas_tpu) in TPU interpret mode, against the float64 oracle.

Every kernel call runs under `pltpu.InterpretParams(detect_races=True)` (out-of-bounds reads raise,
uninitialised memory reads as NaN, a detected race fails the test). Shapes are small (interpret
mode compiles a host program per configuration) but chosen so that groups straddle m-tiles, slices
span several column tiles and the hidden dim several k-tiles. Every tiling plan the tests and the
anchor sweep generate is checked against the TPU block-shape rules.

Also: bf16 slices with heterogeneous ranks and NaN rank padding through the wrapper, and a rank-0
weight refused. CPU only (TPU interpret mode).
"""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_lora import ops, tpu_rules
from jax_lora.meta import LoRAKernelMeta
from jax_lora.ops import pallas_tpu as P
from jax_lora.ops.pallas_tpu import schedule as pallas_schedule

from . import jax_helpers, oracle
from .impls import round_to
from .pallas_tpu_impl import races_checked

JNP = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


# ----------------------------------------------------------------------------- helpers

def mapping(rng, num_tokens, num_slots, frac_none=0.25, sorted_runs=False):
    idx = rng.integers(0, num_slots, num_tokens)
    if sorted_runs:  # prefill-like: each adapter's tokens contiguous
        idx = np.sort(idx)
    idx[rng.random(num_tokens) < frac_none] = -1
    return idx.astype(np.int32)


def zero_past_rank(w, ranks, axis):
    """Weights with rank entries >= ranks[slot] zeroed: what lora_ranks must equal."""
    if ranks is None:
        return w
    w = np.array(w, copy=True)
    for slot, rk in enumerate(ranks):
        sl = [slot, slice(None), slice(None)]
        sl[axis] = slice(int(rk), None)
        w[tuple(sl)] = 0
    return w


def assert_close(got, want, dtype, what):
    got = np.asarray(got, np.float64)
    assert not np.isnan(got).any(), f"{what}: NaN in the result (an unwritten row?)"
    err = oracle.rel_err(got, want)
    assert err <= oracle.TOL[dtype], f"{what}: relative error {err:.3g} > {oracle.TOL[dtype]}"


def run_shrink(x, a, meta, scale, ranks=None, **kw):
    with races_checked():
        return np.asarray(P.shrink(x, a, meta, scale, ranks, **kw), np.float64)


def run_expand(buf, b, y, meta, offsets, add_inputs, ranks=None, bias=None, **kw):
    with races_checked():
        return np.asarray(P.expand(buf, b, y, meta, offsets, add_inputs, ranks, bias, **kw).astype(jnp.float32),
                          np.float64)


# ----------------------------------------------------------------------------- shrink

SHRINK_CASES = {
    # name: (T, H, S, r, L, tm_max, tk_max, ranks, sorted_runs)
    "decode-3slices": (13, 256, 3, 16, 5, 256, 8192, None, False),
    "multi-tile-k-tiles": (40, 384, 1, 32, 4, 16, 128, None, False),
    "prefill-runs-het-ranks": (37, 128, 2, 64, 4, 16, 8192, (8, 64, 16, 32), True),
    "one-token": (1, 128, 1, 16, 3, 256, 8192, None, False),
}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("case", list(SHRINK_CASES))
def test_shrink_matches_oracle(case, dtype):
    t, h, s_count, r, num_slots, tm_max, tk_max, ranks, runs = SHRINK_CASES[case]
    rng = np.random.default_rng(hash((case, dtype)) % 2**32)
    idx = mapping(rng, t, num_slots, sorted_runs=runs)
    x = round_to(rng.standard_normal((t, h)), dtype)
    a = [round_to(rng.standard_normal((num_slots, r, h)) / np.sqrt(h), dtype) for _ in range(s_count)]
    meta = LoRAKernelMeta.build(idx, num_slots)
    got = run_shrink(jnp.asarray(x, JNP[dtype]), tuple(jnp.asarray(w, JNP[dtype]) for w in a), meta, 0.5,
                     None if ranks is None else jnp.asarray(ranks, jnp.int32), tm_max=tm_max, tk_max=tk_max)
    want = oracle.shrink(x, [zero_past_rank(w, ranks, 1) for w in a], idx, 0.5)
    assert got.shape == (s_count, t, r)
    assert_close(got, want, dtype, f"shrink {case}")
    assert np.all(got[:, idx < 0] == 0), "rows of -1 tokens must be exactly 0"


def test_shrink_mixed_dtypes_fp16_x_with_bf16_weights():
    rng = np.random.default_rng(7)
    t, h, r, num_slots = 9, 128, 16, 3
    idx = mapping(rng, t, num_slots)
    x = round_to(rng.standard_normal((t, h)), "float16")
    a = round_to(rng.standard_normal((num_slots, r, h)) / np.sqrt(h), "bfloat16")
    got = run_shrink(jnp.asarray(x, jnp.float16), (jnp.asarray(a, jnp.bfloat16),),
                     LoRAKernelMeta.build(idx, num_slots), 1.0)
    assert_close(got, oracle.shrink(x, [a], idx, 1.0), "float16", "shrink fp16 x bf16")


# ----------------------------------------------------------------------------- expand

EXPAND_CASES = {
    # name: (T, widths, N extra, r, L, tm_max, tn_max, ranks)
    "qkv-unequal-widths": (13, (24, 8, 16), 5, 16, 5, 256, 4096, None),
    "column-tiles-multi-step": (29, (256, 128), 3, 16, 4, 16, 128, None),
    "het-ranks": (21, (128, 40), 0, 32, 4, 16, 4096, (8, 32, 16, 24)),
}


@pytest.mark.parametrize("case,dtype,layout", [
    ("qkv-unequal-widths", "float32", "nr"), ("qkv-unequal-widths", "bfloat16", "rn"),
    ("column-tiles-multi-step", "bfloat16", "nr"), ("column-tiles-multi-step", "float32", "rn"),
    ("het-ranks", "bfloat16", "nr"), ("het-ranks", "float32", "rn")])
def test_expand_matches_oracle(case, dtype, layout):
    t, widths, extra, r, num_slots, tm_max, tn_max, ranks = EXPAND_CASES[case]
    rng = np.random.default_rng(hash((case, dtype, layout)) % 2**32)
    idx = mapping(rng, t, num_slots)
    buf = rng.standard_normal((len(widths), t, r)).astype(np.float32)
    b = [round_to(rng.standard_normal((num_slots, n, r)) / np.sqrt(r), dtype) for n in widths]
    with_bias = case != "het-ranks"
    bias = [round_to(rng.standard_normal((num_slots, n)), dtype) for n in widths] if with_bias else None
    if with_bias and len(widths) > 2:
        bias[1] = None  # a slice without bias among slices with
    offset0 = 3 if extra else 0
    offsets = tuple(offset0 + sum(widths[:s]) for s in range(len(widths)))
    y0 = round_to(rng.standard_normal((t, offset0 + sum(widths) + extra)), dtype)
    meta = LoRAKernelMeta.build(idx, num_slots)
    b_dev = tuple(jnp.asarray(w, JNP[dtype]) for w in b)
    if layout == "rn":
        b_dev = P.transpose_lora_b(b_dev)
    bias_dev = None if bias is None else tuple(None if v is None else jnp.asarray(v, JNP[dtype]) for v in bias)
    rk = None if ranks is None else jnp.asarray(ranks, jnp.int32)
    b_ref = [zero_past_rank(w, ranks, 2) for w in b]
    for add_inputs in ((True, False) if case == "qkv-unequal-widths" else (layout == "nr",)):
        got = run_expand(jnp.asarray(buf), b_dev, jnp.asarray(y0, JNP[dtype]), meta, offsets, add_inputs, rk,
                         bias_dev, b_layout=layout, tm_max=tm_max, tn_max=tn_max)
        want = oracle.expand(buf, b_ref, y0, idx, offset0, add_inputs, bias)
        assert_close(got, want, dtype, f"expand {case} add_inputs={add_inputs}")
        np.testing.assert_array_equal(got[idx < 0], y0[idx < 0], err_msg="rows of -1 tokens changed")
        np.testing.assert_array_equal(got[:, :offset0], y0[:, :offset0], err_msg="columns before the slices")
        np.testing.assert_array_equal(got[:, offsets[-1] + widths[-1]:], y0[:, offsets[-1] + widths[-1]:],
                                      err_msg="columns after the slices changed")


@pytest.mark.parametrize("runs,dtype,layout", [(True, "bfloat16", "nr"), (True, "float32", "rn"),
                                               (False, "bfloat16", "rn")],
                         ids=["contiguous-bf16-nr", "contiguous-fp32-rn", "shuffled-bf16-rn"])
def test_expand_aligned_slices_in_place(runs, dtype, layout):
    """Slices on 128-column boundaries: the token-order branch updates y blocks inside the kernel
    (aliased in and out, T a multiple of the row tile); the sorted branch moves y rows by DMA."""
    rng = np.random.default_rng(23)
    t, r, num_slots, widths, offsets, n_cols = 64, 16, 4, (256, 128, 128), (128, 384, 512), 768
    idx = mapping(rng, t, num_slots, frac_none=0.2, sorted_runs=runs)
    meta = LoRAKernelMeta.build(idx, num_slots)
    plan = P.plan_expand(t, widths, r, num_slots, 128, layout, (True, False, True), tm_max=16, tn_max=128)
    inplace = P.plan_inplace(plan, offsets, n_cols, 2, tn_max=128)
    assert inplace is not None
    nbytes = jnp.dtype(JNP[dtype]).itemsize
    cost = P.expand_order_cost(plan, inplace, nbytes, nbytes)
    assert bool(P.prefers_token_order(meta, t, num_slots, 16, cost)) == runs
    buf = rng.standard_normal((3, t, r)).astype(np.float32)
    b = [round_to(rng.standard_normal((num_slots, n, r)) / np.sqrt(r), dtype) for n in widths]
    bias = [round_to(rng.standard_normal((num_slots, widths[0])), dtype), None,
            round_to(rng.standard_normal((num_slots, widths[2])), dtype)]
    y0 = round_to(rng.standard_normal((t, n_cols)), dtype)
    b_dev = tuple(jnp.asarray(w, JNP[dtype]) for w in b)
    if layout == "rn":
        b_dev = P.transpose_lora_b(b_dev)
    bias_dev = tuple(None if v is None else jnp.asarray(v, JNP[dtype]) for v in bias)
    for add_inputs in ((True, False) if runs and dtype == "bfloat16" else (runs,)):
        got = run_expand(jnp.asarray(buf), b_dev, jnp.asarray(y0, JNP[dtype]), meta, offsets, add_inputs, None,
                         bias_dev, b_layout=layout, tm_max=16, tn_max=128)
        want = oracle.expand(buf, b, y0, idx, offsets[0], add_inputs, bias)
        assert_close(got, want, dtype, f"in-place expand add_inputs={add_inputs}")
        np.testing.assert_array_equal(got[idx < 0], y0[idx < 0], err_msg="rows of -1 tokens changed")
        np.testing.assert_array_equal(got[:, :128], y0[:, :128], err_msg="columns before the slices")
        np.testing.assert_array_equal(got[:, 640:], y0[:, 640:], err_msg="columns after the slices")
    if runs:  # same shapes, no recompilation: a step without any LoRA token (an empty grid)
        none = LoRAKernelMeta.build(np.full(t, -1, np.int32), num_slots)
        got = run_expand(jnp.asarray(buf), b_dev, jnp.asarray(y0, JNP[dtype]), none, offsets, True, None, bias_dev,
                         b_layout=layout, tm_max=16, tn_max=128)
        np.testing.assert_array_equal(got, y0, err_msg="no LoRA token: y must come back unchanged")


@pytest.mark.parametrize("runs,aligned,het,order,row_dma", [
    (True, True, True, None, True), (False, False, False, None, True), (True, True, False, "sorted", True),
    (False, True, False, None, False)],
    ids=["contiguous-in-place-het-ranks", "shuffled-unaligned", "forced-sorted-row-dma", "sorted-no-row-dma"])
def test_linear_one_row_order_for_both_kernels(runs, aligned, het, order, row_dma):
    """`linear` (the wrapper's add_lora_linear path): shrink and expand in one program, the rank
    rows kept in the chosen row order between them; in place by blocks (token order), by row DMAs
    (sorted order, aligned slices) or through a float32 delta (unaligned)."""
    rng = np.random.default_rng(31)
    t, h, r, num_slots = 64, 128, 32, 4
    widths, offsets, n_cols = ((256, 128), (128, 384), 640) if aligned else ((24, 40), (3, 27), 70)
    ranks = np.array([8, 32, 16, 24]) if het else None
    idx = mapping(rng, t, num_slots, frac_none=0.2, sorted_runs=runs)
    x = round_to(rng.standard_normal((t, h)), "bfloat16")
    a = [round_to(rng.standard_normal((num_slots, r, h)) / np.sqrt(h), "bfloat16") for _ in widths]
    b = [round_to(rng.standard_normal((num_slots, n, r)) / np.sqrt(r), "bfloat16") for n in widths]
    bias = [round_to(rng.standard_normal((num_slots, n)), "bfloat16") for n in widths]
    y0 = round_to(rng.standard_normal((t, n_cols)), "bfloat16")
    def dev(v):
        return jnp.asarray(v, jnp.bfloat16)

    with races_checked():
        got = P.linear(dev(y0), dev(x), tuple(map(dev, a)), tuple(map(dev, b)), LoRAKernelMeta.build(idx, num_slots),
                       0.5, offsets, None if ranks is None else jnp.asarray(ranks, jnp.int32),
                       tuple(map(dev, bias)), tm_max=16, tn_max=128, row_order=order, row_dma=row_dma)
    got = np.asarray(got.astype(jnp.float32), np.float64)
    a_ref = [zero_past_rank(w, ranks, 1) for w in a]
    b_ref = [zero_past_rank(w, ranks, 2) for w in b]
    want = oracle.expand(oracle.shrink(x, a_ref, idx, 0.5), b_ref, y0, idx, offsets[0], True, bias)
    assert_close(got, want, "bfloat16", "linear")
    np.testing.assert_array_equal(got[idx < 0], y0[idx < 0], err_msg="rows of -1 tokens changed")
    np.testing.assert_array_equal(got[:, :offsets[0]], y0[:, :offsets[0]], err_msg="columns before the slices")


@pytest.mark.parametrize("runs,aligned,order", [(True, True, None), (True, True, "sorted"), (False, False, None)],
                         ids=["in-place-token", "sorted-row-dma", "unaligned-delta"])
def test_linear_applies_dora_column_scales_in_the_epilogue(runs, aligned, order):
    """A DoRA slice (col_scale) beside a biased one: y[t, slice] = g[idx[t]] * (y + delta) in the
    kernel's epilogue (in place by blocks, by row DMAs) or the delta path's XLA epilogue; -1 rows and
    columns outside the slices untouched; a slice with both a bias and a scale is refused."""
    rng = np.random.default_rng(37)
    t, h, r, num_slots = 32, 128, 16, 4
    widths, offsets, n_cols = ((256, 128), (128, 384), 640) if aligned else ((24, 40), (3, 27), 70)
    idx = mapping(rng, t, num_slots, frac_none=0.2, sorted_runs=runs)
    x = round_to(rng.standard_normal((t, h)), "bfloat16")
    a = [round_to(rng.standard_normal((num_slots, r, h)) / np.sqrt(h), "bfloat16") for _ in widths]
    b = [round_to(rng.standard_normal((num_slots, n, r)) / np.sqrt(r), "bfloat16") for n in widths]
    g = round_to(rng.uniform(0.5, 2.0, (num_slots, widths[0])), "bfloat16")
    bias1 = round_to(rng.standard_normal((num_slots, widths[1])), "bfloat16")
    y0 = round_to(rng.standard_normal((t, n_cols)), "bfloat16")

    def dev(v):
        return None if v is None else jnp.asarray(v, jnp.bfloat16)

    meta = LoRAKernelMeta.build(idx, num_slots)
    with races_checked():
        got = P.linear(dev(y0), dev(x), tuple(map(dev, a)), tuple(map(dev, b)), meta, 0.5, offsets, None,
                       (None, dev(bias1)), tm_max=16, tn_max=128, row_order=order, col_scale=(dev(g), None))
    want = oracle.expand(oracle.shrink(x, a, idx, 0.5), b, y0, idx, offsets[0], True,
                         [np.zeros((num_slots, widths[0])), bias1])
    lo, hi = offsets[0], offsets[0] + widths[0]
    live = idx >= 0
    want[live, lo:hi] *= g[idx[live]]
    got = np.asarray(got.astype(jnp.float32), np.float64)
    assert_close(got, want, "bfloat16", "linear with a DoRA scale")
    np.testing.assert_array_equal(got[~live], y0[~live], err_msg="rows of -1 tokens changed")
    np.testing.assert_array_equal(got[:, :lo], y0[:, :lo], err_msg="columns before the slices")
    with pytest.raises(ValueError, match="slice 0 has both a LoRA bias and a DoRA column scale"):
        P.expand(jnp.zeros((2, t, r), jnp.float32), tuple(map(dev, b)), dev(y0), meta, offsets, True, None,
                 (dev(g), None), col_scale=(dev(g), None))


def test_expand_dora_scale_without_add_inputs():
    """expand(add_inputs=False) on a DoRA slice: y[t, slice] = g[idx[t]] * delta (the old y is not
    part of the new value), on the in-place path."""
    rng = np.random.default_rng(41)
    t, r, num_slots, offsets, n_cols = 32, 16, 3, (128,), 256
    idx = mapping(rng, t, num_slots, frac_none=0.2, sorted_runs=True)
    buf = rng.standard_normal((1, t, r)).astype(np.float32)
    b = [round_to(rng.standard_normal((num_slots, 128, r)) / np.sqrt(r), "float32")]
    g = rng.uniform(0.5, 2.0, (num_slots, 128)).astype(np.float32)
    y0 = rng.standard_normal((t, n_cols)).astype(np.float32)
    meta = LoRAKernelMeta.build(idx, num_slots)
    got = run_expand(jnp.asarray(buf), (jnp.asarray(b[0]),), jnp.asarray(y0), meta, offsets, False, None, None,
                     tm_max=16, tn_max=128, col_scale=(jnp.asarray(g),))
    want = oracle.expand(buf, b, y0, idx, offsets[0], False)
    live = idx >= 0
    want[live, 128:] *= g[idx[live]]
    assert_close(got, want, "float32", "expand(add_inputs=False) with a DoRA scale")
    np.testing.assert_array_equal(np.asarray(got)[~live], y0[~live])


# ----------------------------------------------------------------------------- metadata edge cases

def test_meta_capacity_larger_than_tokens():
    """A meta covering C > T tokens (a sampler mapping padded to a bucket, real ids past T):
    the kernels use mapping[:T] only."""
    rng = np.random.default_rng(11)
    t, cap, h, r, num_slots = 10, 16, 128, 16, 4
    full = mapping(rng, cap, num_slots, frac_none=0.2)
    meta = LoRAKernelMeta.build(full, num_slots, max_num_tokens=cap + 2)
    idx = full[:t]
    x = round_to(rng.standard_normal((t, h)), "float32")
    a = round_to(rng.standard_normal((num_slots, r, h)), "float32")
    got = run_shrink(jnp.asarray(x), (jnp.asarray(a),), meta, 1.0, tm_max=16)
    assert_close(got, oracle.shrink(x, [a], idx, 1.0), "float32", "shrink with C > T")
    b = round_to(rng.standard_normal((num_slots, 40, r)), "float32")
    y0 = round_to(rng.standard_normal((t, 40)), "float32")
    got = run_expand(jnp.asarray(got, jnp.float32), (jnp.asarray(b),), jnp.asarray(y0), meta, (0,), True)
    assert_close(got, oracle.expand(oracle.shrink(x, [a], idx, 1.0), [b], y0, idx), "float32", "expand C > T")


def test_jit_one_compilation_for_every_mapping():
    """Inside jit the mapping is data: several mappings (all -1, one adapter, shuffled, ids out of
    range) run through one compiled program and each result is right."""
    rng = np.random.default_rng(5)
    t, h, r, num_slots, widths = 24, 128, 16, 4, (128, 32)
    x = round_to(rng.standard_normal((t, h)), "bfloat16")
    a = [round_to(rng.standard_normal((num_slots, r, h)) / np.sqrt(h), "bfloat16") for _ in widths]
    b = [round_to(rng.standard_normal((num_slots, n, r)) / np.sqrt(r), "bfloat16") for n in widths]
    y0 = round_to(rng.standard_normal((t, sum(widths))), "bfloat16")
    def dev(v):
        return jnp.asarray(v, jnp.bfloat16)

    @jax.jit
    def step(x, a, b, y, idx):
        meta = LoRAKernelMeta.build(idx, num_slots)
        buf = P.shrink(x, a, meta, 0.5, tm_max=16)
        return P.expand(buf, b, y, meta, (0, widths[0]), True, tm_max=16)

    mappings = [np.full(t, -1, np.int32), np.full(t, 2, np.int32), mapping(rng, t, num_slots),
                np.where(rng.random(t) < 0.3, num_slots + 3, mapping(rng, t, num_slots, 0.0)).astype(np.int32)]
    with races_checked():
        for idx in mappings:
            got = np.asarray(step(dev(x), tuple(map(dev, a)), tuple(map(dev, b)), dev(y0), jnp.asarray(idx))
                             .astype(jnp.float32), np.float64)
            clean = np.where((idx >= 0) & (idx < num_slots), idx, -1)
            want = oracle.lora_linear(y0, x, a, b, None, 0.5, clean)
            assert_close(got, want, "bfloat16", f"jit step, mapping {idx[:6]}...")
    assert step._cache_size() == 1, "the mapping must not change the compiled program"


@pytest.mark.parametrize("seed", range(6))
def test_schedule_covers_each_group_tile_once(seed):
    """Live steps visit each (group, m-tile) pair the group touches exactly once, in tile order;
    the padding tail repeats the last live step; nothing exceeds the static capacity."""
    rng = np.random.default_rng(seed)
    t, num_slots, tm = int(rng.integers(1, 70)), int(rng.integers(1, 9)), 16
    idx = mapping(rng, t, num_slots, frac_none=rng.random() * 0.5, sorted_runs=bool(seed % 2))
    meta = LoRAKernelMeta.build(idx, num_slots)
    sched = jax.tree.map(np.asarray, P.make_schedule(meta, t, num_slots, tm))
    order = np.argsort(np.where(idx < 0, -1, idx), kind="stable")
    want = set()
    for p, tok in enumerate(order):
        if idx[tok] >= 0:
            want.add((int(idx[tok]), p // tm))
    live = sched.live.astype(bool)
    got = list(zip(sched.slot[live].tolist(), sched.tile[live].tolist()))
    assert len(got) == len(set(got)) and set(got) == want
    assert len(sched.tile) == P.num_steps(t, num_slots, tm) >= len(got)
    assert np.all(np.diff(sched.tile) >= 0), "output tiles must be revisited only consecutively"
    if live.any() and not live.all():
        last = np.flatnonzero(live)[-1]
        assert np.all(sched.tile[last:] == sched.tile[last]) and np.all(sched.slot[last:] == sched.slot[last])


@pytest.mark.parametrize("seed", range(4))
def test_token_schedule_covers_each_tile_slot_pair_once(seed):
    rng = np.random.default_rng(100 + seed)
    t, num_slots, tm = int(rng.integers(1, 70)), int(rng.integers(1, 9)), 16
    idx = mapping(rng, t, num_slots, frac_none=rng.random() * 0.5, sorted_runs=bool(seed % 2))
    sched = jax.tree.map(np.asarray, P.make_token_schedule(jnp.asarray(idx), t, num_slots, tm))
    want = {(p // tm, int(s)) for p, s in enumerate(idx) if s >= 0}
    live = sched.live.astype(bool)
    got = list(zip(sched.tile[live].tolist(), sched.slot[live].tolist()))
    assert len(got) == len(set(got)) and set(got) == want
    assert len(sched.tile) == P.num_token_steps(t, num_slots, tm) >= len(got)
    assert np.all(np.diff(sched.tile) >= 0)


@pytest.mark.parametrize("seed", range(3))
def test_rank_chunks_fetched_only_up_to_each_rank(seed):
    """Simulates the pipeline on the chunk index maps: a (slot, chunk) block is fetched when its
    index changes; only chunks below a slot's rank are fetched (plus, for a chunk no step needs, the
    one initial fetch every BlockSpec makes), and every needed one is."""
    rng = np.random.default_rng(200 + seed)
    t, num_slots, tm, rank, rc = 48, 6, 16, 64, 16
    ranks = rng.choice([8, 16, 32, 64], num_slots)
    idx = mapping(rng, t, num_slots, frac_none=0.1, sorted_runs=bool(seed % 2))
    meta = LoRAKernelMeta.build(idx, num_slots)
    sched = P.make_schedule(meta, t, num_slots, tm)
    live = int(np.asarray(sched.live).sum())
    chunk_slot = np.asarray(P.chunk_slots(sched, jnp.asarray(ranks, jnp.int32), rc, rank // rc))
    chunk_slot = chunk_slot.reshape(rank // rc, -1)[:, :live]
    active = {int(v) for v in np.asarray(sched.slot)[:live]}
    for c in range(rank // rc):
        seq = chunk_slot[c]
        fetched = {int(seq[i]) for i in range(live) if i == 0 or seq[i] != seq[i - 1]}
        needed = {sl for sl in active if ranks[sl] > c * rc}
        assert fetched == needed or (not needed and len(fetched) == 1), (c, fetched, needed)


def test_unwritten_rows_are_caught(monkeypatch):
    """The harness catches a kernel that skips rows: drop one live step and NaN must appear."""
    rng = np.random.default_rng(3)
    t, h, r, num_slots = 20, 128, 16, 3
    idx = mapping(rng, t, num_slots, frac_none=0.0)
    for name in ("make_schedule", "make_token_schedule"):  # patched where the launchers look them up
        real = getattr(pallas_schedule, name)

        def lossy(*args, _real=real, **kwargs):
            sched = _real(*args, **kwargs)
            return sched._replace(live=sched.live.at[0].set(0))

        monkeypatch.setattr(pallas_schedule, name, lossy)
    x = jnp.asarray(rng.standard_normal((t, h)), jnp.float32)
    a = jnp.asarray(rng.standard_normal((num_slots, r, h)), jnp.float32)
    got = run_shrink(x, (a,), LoRAKernelMeta.build(idx, num_slots), 1.0, tm_max=16)
    assert np.isnan(got).any()


@pytest.mark.parametrize("runs", [True, False], ids=["contiguous-token-order", "shuffled-sorted-order"])
def test_both_row_orders(runs):
    """Contiguous adapters (prefill) run in token order, shuffled ones over several tiles in sorted
    order; both give the oracle's result (shrink then expand)."""
    rng = np.random.default_rng(17)
    t, h, r, num_slots, widths = 64, 128, 16, 4, (128,)
    idx = mapping(rng, t, num_slots, frac_none=0.2, sorted_runs=runs)
    meta = LoRAKernelMeta.build(idx, num_slots)
    cost = P.shrink_order_cost(P.plan_shrink(t, h, 1, r, num_slots, 4, 4, tm_max=16), 4, 4)
    assert bool(P.prefers_token_order(meta, t, num_slots, 16, cost)) == runs
    x = round_to(rng.standard_normal((t, h)), "float32")
    a = round_to(rng.standard_normal((num_slots, r, h)) / np.sqrt(h), "float32")
    b = round_to(rng.standard_normal((num_slots, widths[0], r)) / np.sqrt(r), "float32")
    y0 = round_to(rng.standard_normal((t, widths[0])), "float32")
    buf = run_shrink(jnp.asarray(x), (jnp.asarray(a),), meta, 0.5, tm_max=16)
    want_buf = oracle.shrink(x, [a], idx, 0.5)
    assert_close(buf, want_buf, "float32", "shrink")
    got = run_expand(jnp.asarray(buf, jnp.float32), (jnp.asarray(b),), jnp.asarray(y0), meta, (0,), True,
                     tm_max=16)
    assert_close(got, oracle.expand(want_buf, [b], y0, idx), "float32", "expand")


# ----------------------------------------------------------------------------- block-shape rules

def test_block_rule_checker():
    ok = [((64, 4096), (16, 4096)), ((64, 4096), (16, 512)), ((5, 16, 4096), (None, 16, 2048)),
          ((13, 40), (13, 40)), ((4, 1, 40), (None, 1, 40)), ((300,), (128,))]
    bad = [((64, 4096), (12, 4096)), ((64, 4096), (16, 100)), ((5, 24, 4096), (None, 12, 4096)),
           ((4, 40), (None, 40)), ((300,), (100,)), ((64, 128), (16, 256))]
    for arr, blk in ok:
        tpu_rules.check_block_spec("ok", arr, blk)
    for arr, blk in bad:
        with pytest.raises(tpu_rules.BlockShapeError):
            tpu_rules.check_block_spec("bad", arr, blk)
    assert tpu_rules.lane_utilization((None, 4096, 16)) == 16 / 128


def _all_plans():
    """Every plan the tests above use, the anchor sweep's shapes, and a grid of odd shapes."""
    yield from (P.plan_shrink(t, h, s, r, l, tm_max=tm, tk_max=tk)
                for t, h, s, r, l, tm, tk, _, _ in SHRINK_CASES.values())
    yield from (P.plan_expand(t, w, r, l, 128, lay, (True,) * len(w), tm_max=tm, tn_max=tn)
                for t, w, _, r, l, tm, tn, _ in EXPAND_CASES.values() for lay in ("nr", "rn"))
    sweep_t = (1, 8, 32, 128, 512, 2048, 8192)
    for t, r, outs, l in itertools.product(sweep_t, (16, 64), ((4096,), (4096, 1024, 1024)), (8, 16, 32, 64)):
        yield P.plan_shrink(t, 4096, len(outs), r, l)
        for lay in ("nr", "rn"):
            plan = P.plan_expand(t, outs, r, l, -(-len(outs) * r // 128) * 128, lay)
            yield plan
            offsets = tuple(sum(outs[:s]) for s in range(len(outs)))
            inplace = P.plan_inplace(plan, offsets, sum(outs), 2)
            if inplace is not None:
                yield inplace
    for t, h, r, s, n in itertools.product((3, 17, 100), (64, 200, 640, 5120), (8, 16, 128), (1, 2),
                                           (40, 384, 14336)):
        yield P.plan_shrink(t, h, s, r, 5, x_bytes=4, a_bytes=4)
        yield P.plan_expand(t, (n,) * s, r, 5, -(-s * r // 128) * 128, "nr", (True,) * s, b_bytes=4)


def test_every_plan_obeys_block_rules_and_fits_vmem():
    count = 0
    for plan in _all_plans():
        count += tpu_rules.check_blocks(plan.block_uses())
        vmem = plan.vmem_bytes(2, 2) if isinstance(plan, P.ShrinkPlan) else plan.vmem_bytes(2)
        assert vmem <= P.VMEM_BUDGET or (plan.tm == 16 and vmem <= 96 * 2**20), (plan, vmem)
    assert count > 1000


# ----------------------------------------------------------------------------- TPU lowering

@pytest.mark.parametrize("layout", ["nr", "rn"])
def test_lowers_to_mosaic_for_tpu(layout):
    """Cross-platform lowering (no TPU needed) runs the Pallas -> Mosaic conversion: the kernels
    must produce one tpu_custom_call per op and row order (expand covers all slices in one), with
    rank chunks, bias, both B layouts and the in-place expand."""
    t, h, r, num_slots, widths = 48, 256, 32, 4, (256, 128, 128)  # T % tm == 0: in-place expand
    x = jnp.zeros((t, h), jnp.bfloat16)
    a = tuple(jnp.zeros((num_slots, r, h), jnp.bfloat16) for _ in widths)
    b = tuple(jnp.zeros((num_slots, n, r), jnp.bfloat16) for n in widths)
    if layout == "rn":
        b = P.transpose_lora_b(b)
    bias = tuple(jnp.zeros((num_slots, n), jnp.bfloat16) for n in widths)
    y = jnp.zeros((t, sum(widths)), jnp.bfloat16)

    def step(x, a, b, y, idx):
        meta = LoRAKernelMeta.build(idx, num_slots)
        ranks = jnp.asarray([8, 32, 16, 24], jnp.int32)  # rank chunks (A; B when rank-major)
        buf = P.shrink(x, a, meta, 0.5, ranks, tm_max=16)
        return P.expand(buf, b, y, meta, (0, 256, 384), True, ranks, bias=bias, b_layout=layout, tm_max=16,
                        tn_max=128)

    with P.interpret_mode(False):
        text = jax.jit(step).trace(x, a, b, y, jnp.zeros(t, jnp.int32)).lower(
            lowering_platforms=("tpu",)).as_text()
    assert text.count("tpu_custom_call") == 4  # per op: the token-order and the sorted branch


def test_pallas_tpu_bf16_slices_ranks_and_nan_padding_match_oracle():
    """The Pallas TPU kernels (backend="pallas_tpu", TPU interpret mode on the CPU)
    compute lora_shrink / lora_expand within bf16 tolerance (2e-2) of the float64 oracle: two
    slices, -1 tokens untouched, heterogeneous lora_ranks with NaN in the rank padding ignored."""
    T, H, r, L, N = 3, 128, 16, 2, 128
    idx = np.array([1, -1, 0], np.int32)
    ranks = np.array([5, 16], np.int32)
    f = lambda a: np.asarray(a, np.float32)
    x, y = jax_helpers.rand(T, H).astype(jnp.bfloat16), jax_helpers.rand(T, 2 * N).astype(jnp.bfloat16)
    A = [jax_helpers.rand(L, r, H, scale=0.1).astype(jnp.bfloat16) for _ in range(2)]
    B = [jax_helpers.rand(L, N, r, scale=0.1).astype(jnp.bfloat16) for _ in range(2)]
    A0, B0 = [f(a) for a in A], [f(b) for b in B]
    for s in range(2):
        A[s][0, 5:], B[s][0, :, 5:] = np.nan, np.nan
        A0[s][0, 5:], B0[s][0, :, 5:] = 0, 0
    meta = LoRAKernelMeta.build(idx, max_loras=L)
    buf = ops.lora_shrink(x, A, meta, 1.0, backend="pallas_tpu", lora_ranks=ranks)
    out = ops.lora_expand(buf, B, y, meta, 0, True, backend="pallas_tpu", lora_ranks=ranks)
    want = f(y)
    for s in range(2):
        sb = jax_helpers.shrink_ref(f(x), A0[s], idx, 1.0)
        assert jax_helpers.rel_err(buf[s], sb) < 2e-2
        want = jax_helpers.expand_ref(want, sb, B0[s], idx, N * s, True)
    assert out.dtype == jnp.bfloat16
    assert jax_helpers.rel_err(f(out), want) < 2e-2
    np.testing.assert_array_equal(f(out)[1], f(y)[1])


def test_tpu_block_shape_rule_checker():
    """The TPU block-shape checker accepts blocks whose last two dims are multiples
    of (8, 128) or equal to the array's, and refuses others with a BlockShapeError (a ValueError)
    naming the operand."""
    from jax_lora import tpu_rules
    assert tpu_rules.block_shape_problem((16, 256), (8, 128)) is None
    assert tpu_rules.block_shape_problem((16, 100), (16, 100)) is None
    assert tpu_rules.block_shape_problem((16, 256), (4, 128)) is not None
    assert tpu_rules.block_shape_problem((16, 256), (8, 64)) is not None
    with pytest.raises(ValueError, match="lora_b"):
        tpu_rules.check_block_spec("lora_b", (2, 16, 256), (None, 8, 100))


def test_pallas_tpu_rank_zero_is_a_clear_error():
    """pallas_tpu with rank-0 weights is a clear ValueError naming the argument (was a
    ZeroDivisionError); docs/api.md: pallas_tpu needs rank >= 1."""
    meta = LoRAKernelMeta.build(np.array([0], np.int32), max_loras=2)
    with pytest.raises(ValueError, match="lora_a_stacked"):
        ops.lora_shrink(jax_helpers.rand(1, 128), [np.zeros((2, 0, 128), np.float32)], meta, 1.0, backend="pallas_tpu")
