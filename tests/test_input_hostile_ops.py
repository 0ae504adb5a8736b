"""Hostile arguments to the ops of both sides and of both bridge directions (contract section 6): each is
refused with a TypeError/ValueError naming the argument, the expected and the received value, where
it used to be narrowed (a float cast to int, a bool taken as 1, float64 made infinite) or to fail
with an error naming nothing.

- SGMV segment arguments: integer dtypes, one length, batch_size / max_length / token_nums integer
  scalars >= 0, and (host values) non-negative, in-bounds, non-overlapping segments with valid slots;
  inside jit only dtypes and shapes are checked and the values are masked.
- y_offset / y_slice_size of the expand_slice ops, `lora_ranks` dtypes.
- TorchPunicaWrapper's output_slices and scale (checked as torch_lora checks them).
- bridge.to_jax(copy=True) of float64 beyond float32's range; Python floats beyond it given to JAX.
- lora_shrink / lora_expand / bgmv_* with None or a list where a tensor is required.

CPU.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import bridge
import jax_lora
import torch_lora
from bridge import jax_over_torch, torch_over_jax
from lora_core.host_mapping import LoRAMapping

from . import oracle

T, H, R, N, SLOTS = 6, 16, 4, 8, 3
STARTS, LENGTHS, LORAS = [0, 2, 5], [2, 3, 1], [1, -1, 2]   # tokens 0-1 slot 1, 2-4 none, 5 slot 2
TOKEN_IDX = [1, 1, -1, -1, -1, 2]


@dataclasses.dataclass
class Side:
    """One public ops API: its module, and how its users pass floats and integer arrays."""
    name: str
    ops: Any
    torch_api: bool      # torch tensors in (torch_lora.ops, bridge.torch_over_jax), else JAX arrays

    def arr(self, a):
        a = np.asarray(a, np.float32)
        return torch.tensor(a) if self.torch_api else jnp.asarray(a)  # torch.tensor: 64-byte aligned, shareable

    def ints(self, a, dtype=np.int32):
        a = np.asarray(a, dtype)
        return torch.tensor(a) if self.torch_api else jnp.asarray(a)

    def scalar(self, v, dtype):
        return torch.tensor(v, dtype=getattr(torch, dtype)) if self.torch_api else jnp.asarray(v, dtype)

    def to_np(self, a):
        return a.numpy() if isinstance(a, torch.Tensor) else np.asarray(a)


SIDES = [Side("torch_lora", torch_lora.ops, True), Side("jax_lora", jax_lora.ops, False),
         Side("torch_over_jax", torch_over_jax, True), Side("jax_over_torch", jax_over_torch, False)]
SIDE_PARAMS = [pytest.param(s, id=s.name) for s in SIDES]


def data(side: Side):
    rng = np.random.default_rng(0)
    return dict(x=rng.standard_normal((T, H)), a=rng.standard_normal((SLOTS, R, H)),
                buf=rng.standard_normal((T, R)), b=rng.standard_normal((SLOTS, N, R)),
                y=rng.standard_normal((T, 2 * N)))


def call_sgmv(side: Side, op: str, starts, lengths, loras, batch_size=3, max_length=3, token_nums=T):
    d = {k: side.arr(v) for k, v in data(side).items()}
    seg = (starts, lengths, loras, batch_size, max_length, token_nums)
    if op == "sgmv_shrink":
        return side.ops.sgmv_shrink(d["x"], d["a"], *seg, 0.5)
    if op == "sgmv_expand":
        return side.ops.sgmv_expand(d["buf"], d["b"], d["y"], *seg, True)
    return side.ops.sgmv_expand_slice(d["buf"], d["b"], d["y"], *seg, N, N, False)


def want_sgmv(op: str) -> np.ndarray:
    """The result of `op` on data() with the segments of STARTS / LENGTHS / LORAS (the oracle)."""
    d = {k: np.asarray(v, np.float32).astype(np.float64) for k, v in data(None).items()}
    idx = np.array(TOKEN_IDX)
    if op == "sgmv_shrink":
        return oracle.shrink(d["x"], [d["a"]], idx, 0.5)[0]
    if op == "sgmv_expand":
        y = d["y"].copy()
        y[:, :N] = oracle.expand(d["buf"][None], [d["b"]], d["y"][:, :N], idx, 0, True)
        return y
    return oracle.expand(d["buf"][None], [d["b"]], d["y"], idx, N, False)


SGMV_OPS = ("sgmv_shrink", "sgmv_expand", "sgmv_expand_slice")
SEG_NAMES = ("seq_start_locs", "seq_lengths", "lora_indices_per_batch")


def segs(side: Side, starts=STARTS, lengths=LENGTHS, loras=LORAS, dtype=np.int32):
    return side.ints(starts, dtype), side.ints(lengths, dtype), side.ints(loras, dtype)


# ----------------------------------------------------------------------------- SGMV: valid inputs

@pytest.mark.parametrize("op", SGMV_OPS)
@pytest.mark.parametrize("side", SIDE_PARAMS)
def test_sgmv_valid_segments_still_match_the_oracle(side, op):
    """Native int32 / int64 arrays, NumPy arrays, lists, NumPy and 0-d integer scalars all work."""
    want = want_sgmv(op)
    for seg in (segs(side), segs(side, dtype=np.int64) if side.torch_api else segs(side),
                tuple(np.asarray(v) for v in (STARTS, LENGTHS, LORAS)), (STARTS, LENGTHS, LORAS)):
        got = call_sgmv(side, op, *seg)
        np.testing.assert_allclose(side.to_np(got), want, rtol=1e-5, atol=1e-5)
    got = call_sgmv(side, op, *segs(side), np.int64(3), side.scalar(3, "int32"), T)
    np.testing.assert_allclose(side.to_np(got), want, rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------- SGMV: dtypes and lengths

@pytest.mark.parametrize("dtype", ["float32", "bool"])
@pytest.mark.parametrize("which", range(3))
@pytest.mark.parametrize("side", SIDE_PARAMS)
def test_sgmv_refuses_float_or_bool_segment_arrays(side, which, dtype):
    seg = list(segs(side))
    values = [(0.0, 2.7, 5.0), (True, True, False), (1.0, 0.0, 2.0)][which]
    seg[which] = side.ints(values, np.float32 if dtype == "float32" else np.bool_)
    for op in SGMV_OPS:
        with pytest.raises(TypeError, match=rf"{SEG_NAMES[which]} must have an integer dtype .*got {dtype}"):
            call_sgmv(side, op, *seg)


@pytest.mark.parametrize("side", SIDE_PARAMS)
def test_sgmv_refuses_float64_segment_arrays_by_their_kind(side):
    """A float64 array is refused for being float (before a conversion could narrow it)."""
    seg = list(segs(side))
    seg[0] = torch.tensor([0.0, 2.0, 5.0], dtype=torch.float64) if side.torch_api else np.array([0.0, 2.0, 5.0])
    with pytest.raises(TypeError, match=r"seq_start_locs must have an integer dtype .*got float64"):
        call_sgmv(side, "sgmv_shrink", *seg)
    with pytest.raises(TypeError, match=r"seq_lengths must have an integer dtype .*got float64"):
        call_sgmv(side, "sgmv_shrink", STARTS, [2.0, 3.0, 1.0], LORAS)


@pytest.mark.parametrize("side", SIDE_PARAMS)
def test_sgmv_refuses_segment_arrays_of_different_lengths(side):
    seg = segs(side, starts=[0, 2, 5, 6])
    for op in SGMV_OPS:
        with pytest.raises(ValueError, match=r"must have one length .*seq_start_locs has 4, seq_lengths has 3, "
                                             r"lora_indices_per_batch has 3"):
            call_sgmv(side, op, *seg)
    with pytest.raises(ValueError, match=r"seq_lengths must be 1-D \(one entry per segment\), got shape \(3, 1\)"):
        call_sgmv(side, "sgmv_shrink", side.ints(STARTS), side.ints([[2], [3], [1]]), side.ints(LORAS))


# ----------------------------------------------------------------------------- SGMV: scalars

@pytest.mark.parametrize("side", SIDE_PARAMS)
def test_sgmv_batch_size_must_be_an_int_within_the_arrays(side):
    seg = segs(side)
    for op in SGMV_OPS:
        with pytest.raises(ValueError, match=r"batch_size must be an int >= 0, got -1"):
            call_sgmv(side, op, *seg, batch_size=-1)
        with pytest.raises(ValueError, match=r"batch_size is 4, but seq_start_locs, seq_lengths and "
                                             r"lora_indices_per_batch have only 3 entries"):
            call_sgmv(side, op, *seg, batch_size=4)
    for bad in (3.0, 2.7, True, "3", None):
        with pytest.raises(TypeError, match=r"batch_size must be an int >= 0, got"):
            call_sgmv(side, "sgmv_shrink", *seg, batch_size=bad)
    with pytest.raises(TypeError, match=r"batch_size must be an int >= 0, got .*dtype float32"):
        call_sgmv(side, "sgmv_shrink", *seg, batch_size=side.scalar(2.7, "float32"))
    with pytest.raises(TypeError, match=r"token_nums must be an int >= 0, got float 6.0"):
        call_sgmv(side, "sgmv_shrink", *seg, token_nums=6.0)
    with pytest.raises(ValueError, match=r"token_nums=7 exceeds the 6 tokens of x"):
        call_sgmv(side, "sgmv_shrink", *seg, token_nums=7)
    with pytest.raises(TypeError, match=r"max_length must be an int >= 0, got str"):
        call_sgmv(side, "sgmv_shrink", *seg, max_length="3")


@pytest.mark.parametrize("side", SIDE_PARAMS)
def test_sgmv_batch_size_limits_the_live_segments(side):
    """Entries past batch_size are padding: never checked, never used (here: garbage)."""
    got = call_sgmv(side, "sgmv_shrink", *segs(side, starts=[0, 2, -9], lengths=[2, 3, 99], loras=[1, -1, -7]),
                    batch_size=2)
    want = want_sgmv("sgmv_shrink")
    want[5] = 0
    np.testing.assert_allclose(side.to_np(got), want, rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------- SGMV: host values

BAD_SEGMENTS = [
    ("negative length", dict(lengths=[3, -2, 1]), r"seq_lengths must be >= 0 .*got -2 for segment 1"),
    ("negative start", dict(starts=[-1, 2, 5], lengths=[3, 3, 1]),
     r"seq_start_locs must be >= 0 .*got -1 for segment 0"),
    ("past the tokens", dict(lengths=[2, 3, 2]), r"segment 2 covers tokens \[5, 7\) .*past the 6 tokens of x"),
    ("overlap", dict(starts=[0, 1, 5]), r"segments 0 \[0, 2\) and 1 \[1, 4\) overlap"),
    ("slot below -1", dict(loras=[1, -5, 2]), r"lora_indices_per_batch holds -5 for segment 1"),
    ("slot past the weights", dict(loras=[1, 3, 2]),
     r"lora_indices_per_batch holds slot 3 for segment 1, but the weights have only 3 slots"),
]


@pytest.mark.parametrize("case,kw,message", BAD_SEGMENTS, ids=[c[0] for c in BAD_SEGMENTS])
@pytest.mark.parametrize("side", SIDE_PARAMS)
def test_sgmv_refuses_bad_host_segment_values(side, case, kw, message):
    """Native CPU arrays, NumPy arrays and lists are read on the host and checked (JAX arrays
    committed to a CPU device: the default device may be an accelerator, whose values are not read)."""
    v = {**dict(starts=STARTS, lengths=LENGTHS, loras=LORAS), **kw}
    native = segs(side, **v)
    if not side.torch_api:
        native = tuple(jax.device_put(a, jax.devices("cpu")[0]) for a in native)
    forms = (native, tuple(np.asarray(v[k]) for k in ("starts", "lengths", "loras")),
             (v["starts"], v["lengths"], v["loras"]))
    for seg in forms:
        for op in SGMV_OPS:
            with pytest.raises(ValueError, match=message):
                call_sgmv(side, op, *seg)


def test_empty_segments_may_share_a_start_and_sit_at_the_end():
    """Zero-length segments cover no token: they overlap nothing and may start at T."""
    got = torch_lora.ops.sgmv_shrink(torch.ones(T, H), torch.ones(SLOTS, R, H), [0, 0, 6], [0, 6, 0], [0, 1, 2],
                                     3, 6, T, 1.0)
    assert torch.all(got == H)
    got = jax_lora.ops.sgmv_shrink(jnp.ones((T, H)), jnp.ones((SLOTS, R, H)), [0, 0, 6], [0, 6, 0], [0, 1, 2],
                                   3, 6, T, 1.0)
    assert bool(jnp.all(got == H))


# ----------------------------------------------------------------------------- SGMV: inside jit

def test_sgmv_inside_jit_checks_dtypes_and_masks_values():
    x, a = jnp.asarray(data(None)["x"], jnp.float32), jnp.asarray(data(None)["a"], jnp.float32)

    @jax.jit
    def run(starts, lengths, loras, batch_size, token_nums):
        return jax_lora.ops.sgmv_shrink(x, a, starts, lengths, loras, batch_size, 3, token_nums, 0.5)

    seg = tuple(jnp.asarray(v, jnp.int32) for v in (STARTS, LENGTHS, LORAS))
    np.testing.assert_allclose(run(*seg, 3, T), want_sgmv("sgmv_shrink"), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(run(*seg, jnp.int32(3), jnp.int32(T)), want_sgmv("sgmv_shrink"), rtol=1e-5,
                               atol=1e-5)
    # Traced values are not read: a negative length covers no token (masked), nothing is raised.
    got = run(seg[0], jnp.asarray([2, -2, 1], jnp.int32), seg[2], jnp.int32(3), jnp.int32(T))
    want = want_sgmv("sgmv_shrink")
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    with pytest.raises(TypeError, match=r"seq_lengths must have an integer dtype .*got float32"):
        run(seg[0], jnp.asarray([2.0, 3.0, 1.0]), seg[2], 3, T)
    with pytest.raises(TypeError, match=r"batch_size must be an int >= 0, got .*dtype float32"):
        run(*seg, jnp.float32(3), T)


def test_sgmv_inside_jit_with_the_wrappers_prefill_metadata():
    w = jax_lora.PunicaWrapper(8, 4, None, max_loras=SLOTS)
    w.update_metadata(LoRAMapping((11, 11, 0, 0, 0, 13), (11,), True), [11, 12, 13], SLOTS + 1, 32, 0)
    x, a = jnp.asarray(data(None)["x"], jnp.float32), jnp.asarray(data(None)["a"], jnp.float32)
    eager = jax_lora.ops.sgmv_shrink(x, a, *w.prefill_metadata, 0.5)
    jitted = jax.jit(lambda w, x: jax_lora.ops.sgmv_shrink(x, a, *w.prefill_metadata, 0.5))(w, x)
    want = oracle.shrink(np.asarray(x, np.float64), [np.asarray(a, np.float64)], np.array([0, 0, -1, -1, -1, 2]),
                         0.5)[0]
    np.testing.assert_allclose(eager, want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(jitted, want, rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------- y_offset / y_slice_size

@pytest.mark.parametrize("side", SIDE_PARAMS)
def test_expand_slice_offsets_must_be_ints(side):
    d = {k: side.arr(v) for k, v in data(side).items()}
    idx = side.ints(TOKEN_IDX)
    for name, (off, size) in (("y_slice_size", (0, "8")), ("y_slice_size", (0, 8.0)), ("y_slice_size", (0, True)),
                              ("y_offset", ("0", 8)), ("y_offset", (8.0, 8)), ("y_offset", (False, 8))):
        with pytest.raises(TypeError, match=rf"{name} must be an integer >= 0, got"):
            side.ops.bgmv_expand_slice(d["buf"], d["b"], d["y"], idx, off, size)
        with pytest.raises(TypeError, match=rf"{name} must be an integer >= 0, got"):
            side.ops.sgmv_expand_slice(d["buf"], d["b"], d["y"], *segs(side), 3, 3, T, off, size)
    with pytest.raises(ValueError, match=r"y_slice_size must be an integer >= 0, got -8"):
        side.ops.bgmv_expand_slice(d["buf"], d["b"], d["y"], idx, 0, -8)
    got = side.ops.bgmv_expand_slice(d["buf"], d["b"], d["y"], idx, np.int64(N), np.int32(N), False)
    np.testing.assert_allclose(side.to_np(got), want_sgmv("sgmv_expand_slice"), rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------- lora_ranks

@pytest.mark.parametrize("side", SIDE_PARAMS)
def test_lora_ranks_must_be_integers(side):
    d = {k: side.arr(v) for k, v in data(side).items()}
    idx = side.ints(TOKEN_IDX)
    for ranks in (side.ints([True] * SLOTS, np.bool_), side.ints([4.0, 2.0, 4.0], np.float32), [True] * SLOTS,
                  [4.0, 2.5, 4.0]):
        with pytest.raises(TypeError, match=r"lora_ranks must have an integer dtype .*got (bool|float32|float64)"):
            side.ops.bgmv_shrink(d["x"], d["a"], idx, 1.0, lora_ranks=ranks)
        with pytest.raises(TypeError, match=r"lora_ranks must have an integer dtype"):
            side.ops.bgmv_expand(d["buf"], d["b"], d["y"], idx, lora_ranks=ranks)
    got = side.ops.bgmv_shrink(d["x"], d["a"], idx, 0.5, lora_ranks=side.ints([R] * SLOTS))
    np.testing.assert_allclose(side.to_np(got), want_sgmv("sgmv_shrink"), rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------- None / lists for tensors

def test_torch_ops_name_a_missing_or_list_tensor():
    meta = torch_lora.LoRAKernelMeta.make(SLOTS, T, "cpu")
    meta.prepare_tensors(torch.tensor(TOKEN_IDX, dtype=torch.int32))
    x, a, out = torch.zeros(T, H), torch.zeros(SLOTS, R, H), torch.zeros(1, T, R)
    buf, b, y = torch.zeros(1, T, R), torch.zeros(SLOTS, N, R), torch.zeros(T, N)
    for ops in (torch_lora.ops, torch_over_jax):
        with pytest.raises(TypeError, match=r"inputs must be a torch.Tensor, got NoneType"):
            ops.lora_shrink(None, [a], out, *meta.meta_args(T), 1.0)
        with pytest.raises(TypeError, match=r"output_tensor must be a torch.Tensor, got NoneType"):
            ops.lora_shrink(x, [a], None, *meta.meta_args(T), 1.0)
        with pytest.raises(TypeError, match=r"token_lora_mapping must be a torch.Tensor, got list"):
            ops.lora_shrink(x, [a], out, TOKEN_IDX, *meta.meta_args(T)[1:], 1.0)
        with pytest.raises(TypeError, match=r"inputs must be a torch.Tensor, got list"):
            ops.lora_expand(buf.tolist(), [b], y, *meta.meta_args(T))
        with pytest.raises(TypeError, match=r"lora_ids must be a torch.Tensor, got NoneType"):
            ops.lora_expand(buf, [b], y, *meta.meta_args(T)[:4], None, meta.no_lora)
        with pytest.raises(TypeError, match=r"x must be a torch.Tensor, got NoneType"):
            ops.bgmv_shrink(None, a, torch.tensor(TOKEN_IDX))
        with pytest.raises(TypeError, match=r"y must be a torch.Tensor, got NoneType"):
            ops.bgmv_expand(buf[0], b, None, torch.tensor(TOKEN_IDX))
        with pytest.raises(TypeError, match=r"x must be a torch.Tensor, got NoneType"):
            ops.sgmv_shrink(None, a, STARTS, LENGTHS, LORAS, 3, 3, T, 1.0)
        with pytest.raises(ValueError, match=r"lora_a_weights must hold at least one slice"):
            ops.lora_shrink(x, [], out, *meta.meta_args(T), 1.0)
        with pytest.raises(ValueError, match=r"lora_b_weights holds None"):
            ops.lora_expand(buf, [None], y, *meta.meta_args(T))


def test_jax_over_torch_ops_name_a_missing_array():
    meta = jax_lora.LoRAKernelMeta.build(jnp.asarray(TOKEN_IDX, jnp.int32), max_loras=SLOTS)
    a, b = jnp.zeros((SLOTS, R, H)), jnp.zeros((SLOTS, N, R))
    with pytest.raises(TypeError, match=r"x must be a jax.Array, got NoneType"):
        jax_over_torch.lora_shrink(None, [a], meta, 1.0)
    with pytest.raises(TypeError, match=r"y must be a jax.Array, got NoneType"):
        jax_over_torch.lora_expand(jnp.zeros((1, T, R)), [b], None, meta)
    with pytest.raises(TypeError, match=r"w must be a jax.Array, got NoneType"):
        jax_over_torch.bgmv_shrink(jnp.zeros((T, H)), None, jnp.asarray(TOKEN_IDX))
    with pytest.raises(TypeError, match=r"x must be a jax.Array, got NoneType"):
        jax_over_torch.sgmv_shrink(None, a, STARTS, LENGTHS, LORAS, 3, 3, T, 1.0)


# ----------------------------------------------------------------------------- TorchPunicaWrapper

def wrappers():
    mapping = LoRAMapping((11, 11, 0, 0, 0, 13), (11,))
    for jit in (False, True):
        w = bridge.TorchPunicaWrapper(8, 4, "cpu", max_loras=SLOTS, jit=jit)
        w.update_metadata(mapping, [11, 12, 13], SLOTS + 1, 32, 0)
        yield f"torch_over_jax(jit={jit})", w, torch.tensor   # torch.tensor: 64-byte aligned, shareable
    w = bridge.JaxPunicaWrapper(8, 4, "cpu", max_loras=SLOTS)
    w.update_metadata(mapping, [11, 12, 13], SLOTS + 1, 32, 0)
    yield "jax_over_torch", w, lambda a: jax.device_put(a, jax.devices("cpu")[0])   # the wrapper's device


def test_bridged_wrappers_refuse_non_int_output_slices_and_non_real_scales():
    rng = np.random.default_rng(1)
    for label, w, native in wrappers():
        f = lambda *s, native=native: native(rng.standard_normal(s).astype(np.float32))
        x, y, a, b = f(T, H), f(T, N), [f(SLOTS, 1, R, H)], [f(SLOTS, 1, N, R)]
        for bad in ((8.9,), ("8",), (8.0,), "8", None, 8):
            with pytest.raises(TypeError, match=r"output_slices must be a sequence of ints"):
                w.add_lora_linear(y, x, a, b, None, 1.0, bad)
        with pytest.raises(TypeError, match=r"output_slices must be a sequence of ints"):
            w.add_expand(y, f(1, T, R), b, None, (8.5,))
        for bad in ("1.0", None, [1.0, 2.0]):
            with pytest.raises(TypeError, match=r"scale must be a real number"):
                w.add_lora_linear(y, x, a, b, None, bad, (N,))
            with pytest.raises(TypeError, match=r"scale must be a real number"):
                w.add_shrink(f(1, T, R), x, a, bad)
        with pytest.raises(ValueError, match=r"scale must be a finite real number"):
            w.add_lora_linear(y, x, a, b, None, float("nan"), (N,))
        with pytest.raises(TypeError, match=r"offset_start must be an integer >= 0, got float"):
            w.add_expand(y, f(1, T, R), b, None, (N,), offset_start=0.0)
        got = w.add_lora_linear(y, x, a, b, None, np.float32(0.5), (np.int64(N),))   # NumPy scalars are fine
        assert tuple(got.shape) == (T, N), label


# ----------------------------------------------------------------------------- 64-bit floats into JAX

def test_to_jax_copy_refuses_float64_beyond_float32():
    for values in ([1e300], [1.0, -1e39], [3.5e38]):
        with pytest.raises(ValueError, match=r"cannot convert x, the float64 tensor \(shape .*\), to JAX's float32 "
                                             r".*outside float32's finite range"):
            bridge.to_jax(torch.tensor(values, dtype=torch.float64), copy=True)
    with pytest.raises(ValueError, match=r"cannot convert x, the complex128 tensor .* to JAX's complex64"):
        bridge.to_jax(torch.tensor([1 + 1e300j], dtype=torch.complex128), copy=True)
    # In range, or already infinite / NaN: converted as before (rounding to float32).
    got = bridge.to_jax(torch.tensor([1.5, float("inf"), float("nan"), 3.4e38, 1e-300], dtype=torch.float64),
                        copy=True)
    assert got.dtype == jnp.float32
    v = np.asarray(got)
    assert v[0] == 1.5 and np.isposinf(v[1]) and np.isnan(v[2]) and np.isfinite(v[3]) and v[4] == 0
    with pytest.raises(ValueError, match=r"cannot convert x, the int64 tensor .* outside \[-2147483648"):
        bridge.to_jax(torch.tensor([2 ** 32 + 1]), copy=True)


def test_python_floats_beyond_float32_are_refused_on_the_jax_side():
    """Host values without a dtype (lists) go through jnp.asarray, which would make 1e300 inf."""
    a, idx = jnp.zeros((SLOTS, R, H)), jnp.asarray(TOKEN_IDX)
    x = [[1e300] * H] + [[0.0] * H] * (T - 1)
    with pytest.raises(ValueError, match=r"x holds 1e\+300, outside float32's finite range"):
        jax_over_torch.bgmv_shrink(x, a, idx)
    with pytest.raises(ValueError, match=r"x holds 1e\+300, outside float32's finite range"):
        jax_lora.ops.as_array("x", x)
    got = jax_over_torch.bgmv_shrink([[1.0] * H] * T, jnp.ones((SLOTS, R, H)), idx)
    assert float(got[0, 0]) == H
