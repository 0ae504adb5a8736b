"""Hostile inputs (contract section 6): values a conversion used to change in silence, and arguments whose
error named nothing, get a ValueError/TypeError naming the argument, what was expected and what was
received, at the public boundary of both sides. Also: the torch wrapper's cached plan follows a
weight whose storage is swapped (`.data =`, `set_`).

CPU; one gpu-marked test (int64 values beyond int32 on CUDA).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from lora_core.host_mapping import LoRAMapping

from . import oracle
from .impls import IMPLS

SIDES = {}
for _impl in IMPLS:
    SIDES.setdefault(_impl.side, _impl)  # the reference entry of each side
SIDE_PARAMS = [pytest.param(impl, id=impl.side) for impl in SIDES.values()]

BIG = 2 ** 32 + 1       # int64; cut to int32 it would be slot 1
HUGE_ID = 2 ** 70       # beyond int64
F32 = r"\('float16', 'bfloat16', 'float32'\)"
WEIGHTS = r"\('float16', 'bfloat16', 'float32', 'float8_e4m3fn'\)"     # checks.WEIGHT_DTYPES: fp8 too


def on_host(impl):
    """The side with its torch tensors on the CPU, where int64 values are read and refused. On an
    accelerator reading them would be a host sync: there they are saturated to the int32 bounds
    instead (test_cuda_int64_beyond_int32_is_saturated_to_no_lora)."""
    return dataclasses.replace(impl, torch_device="cpu") if impl.side == "torch" else impl


def host(impl, a):
    """A host array as the side's user would pass it: NumPy for JAX (converted by the library, which
    is where a silent narrowing would happen), a CPU tensor of the same dtype for torch."""
    a = np.asarray(a)
    if impl.side == "jax":
        return a
    import torch
    return torch.from_numpy(a.copy())


def setup(impl, slices=(8, 4), rank=4, hidden=16, slots=3, num_tokens=4):
    rng = np.random.default_rng(0)
    w = impl.wrapper(8, 4, slots)
    w.update_metadata(LoRAMapping((11, 0, 13, 12)[:num_tokens], (11,)), [11, 12, 13][:slots], slots + 1, 32, 0)
    f = lambda *s: impl.arr(rng.standard_normal(s).astype(np.float32), "float32")
    x = f(num_tokens, hidden)
    a = [f(slots, 1, rank, hidden) for _ in slices]
    b = [f(slots, 1, n, rank) for n in slices]
    y = f(num_tokens, sum(slices))
    return w, x, a, b, y, f


# ----------------------------------------------------------------------------- 64-bit integers

@pytest.mark.parametrize("impl", SIDE_PARAMS)
def test_int64_index_beyond_int32_is_refused_by_the_ops(impl):
    impl = on_host(impl)
    rng = np.random.default_rng(1)
    x = impl.arr(rng.standard_normal((4, 16)).astype(np.float32), "float32")
    wa = impl.arr(rng.standard_normal((3, 4, 16)).astype(np.float32), "float32")
    wb = impl.arr(rng.standard_normal((3, 8, 4)).astype(np.float32), "float32")
    buf = impl.arr(rng.standard_normal((4, 4)).astype(np.float32), "float32")
    y = impl.arr(np.zeros((4, 8), np.float32), "float32")
    idx = host(impl, np.array([0, BIG, 1, -1], np.int64))
    with pytest.raises(ValueError, match=r"lora_indices_tensor holds slot 4294967297"):
        impl.ops.bgmv_shrink(x, wa, idx, 1.0)
    with pytest.raises(ValueError, match=r"lora_indices_tensor holds slot 4294967297"):
        impl.ops.bgmv_expand(buf, wb, y, idx)
    meta = impl.meta([0, 0, 1, -1], 3)
    mapping = host(impl, np.array([0, BIG, 1, -1], np.int64))
    args = (mapping,) + tuple(meta.meta_args(4)[1:])
    with pytest.raises(ValueError, match=r"token_lora_mapping holds (slot )?4294967297"):
        if impl.side == "jax":
            impl.ops.lora_shrink(x, [wa], args, 1.0)
        else:
            impl.ops.lora_shrink(x, [wa], impl.arr(np.zeros((1, 4, 4), np.float32), "float32"), *args, 1.0)


@pytest.mark.parametrize("impl", SIDE_PARAMS)
def test_int64_segments_and_ranks_beyond_int32_are_refused(impl):
    impl = on_host(impl)
    rng = np.random.default_rng(2)
    x = impl.arr(rng.standard_normal((4, 16)).astype(np.float32), "float32")
    wa = impl.arr(rng.standard_normal((3, 4, 16)).astype(np.float32), "float32")
    starts, lengths = host(impl, np.array([0, 2], np.int64)), host(impl, np.array([2, 2], np.int64))
    loras = host(impl, np.array([1, BIG], np.int64))
    with pytest.raises(ValueError, match=r"lora_indices_per_batch holds 4294967297, outside the int32 range"):
        impl.ops.sgmv_shrink(x, wa, starts, lengths, loras, 2, 2, 4, 1.0)
    ranks = host(impl, np.array([4, BIG, 4], np.int64))
    idx = impl.idx([0, 1, 2, -1])
    with pytest.raises(ValueError, match=r"lora_ranks holds 4294967297, outside the int32 range"):
        impl.ops.bgmv_shrink(x, wa, idx, 1.0, lora_ranks=ranks)


@pytest.mark.gpu
def test_cuda_int64_beyond_int32_is_saturated_to_no_lora():
    """On CUDA, int64 indices and ranks are not read on the host (a sync): values beyond int32 are
    saturated to the int32 bounds, so a token's slot 2**32 + 1 is no LoRA (not slot 1, its wrap),
    and a rank beyond int32 is the weights' full rank. Host segment arrays are still refused."""
    import torch

    import torch_lora
    g = torch.Generator().manual_seed(3)
    x = torch.randn(4, 16, generator=g).cuda()
    wa = torch.randn(3, 4, 16, generator=g).cuda()
    idx = torch.tensor([0, BIG, 1, -BIG], device="cuda")
    got = torch_lora.ops.bgmv_shrink(x, wa, idx, 1.0, lora_ranks=torch.tensor([4, BIG, 4], device="cuda"))
    want = oracle.shrink(x.double().cpu().numpy(), [wa.double().cpu().numpy()], np.array([0, -1, 1, -1]), 1.0)[0]
    assert oracle.rel_err(got.cpu().numpy(), want) < 1e-5
    assert torch.all(got[1] == 0) and torch.all(got[3] == 0)
    with pytest.raises(ValueError, match=r"lora_indices_per_batch holds 4294967297, outside the int32 range"):
        torch_lora.ops.sgmv_shrink(x, wa, torch.tensor([0, 2]), torch.tensor([2, 2]), torch.tensor([1, BIG]),
                                   2, 2, 4, 1.0)


@pytest.mark.parametrize("impl", SIDE_PARAMS)
def test_kernel_metadata_refuses_host_slots_outside_the_slots(impl):
    """LoRAKernelMeta from host values (NumPy, a CPU tensor): a slot outside -1..max_loras-1 is a
    ValueError naming token_lora_mapping -- int64 values beyond int32 included, which the int32 cast
    would otherwise wrap to a real slot (2**32 + 1 -> 1)."""
    for values, message in ((np.array([0, 1, BIG], np.int64), r"token_lora_mapping holds slot 4294967297"),
                            (np.array([0, -5, 1], np.int64), r"token_lora_mapping holds -5"),
                            (np.array([0, 2], np.int32), r"token_lora_mapping holds slot 2, but .* 2 slots")):
        with pytest.raises(ValueError, match=message):
            if impl.side == "jax":
                impl.pkg.LoRAKernelMeta.build(values, max_loras=2)
            else:
                impl.pkg.LoRAKernelMeta.make(2, 5, "cpu").prepare_tensors(host(impl, values))


def test_kernel_metadata_masks_traced_slots_outside_the_slots():
    """Inside jit the values cannot be read: slots outside 0..max_loras-1 are -1 (no LoRA)."""
    import jax

    from jax_lora import LoRAKernelMeta
    meta = jax.jit(lambda m: LoRAKernelMeta.build(m, max_loras=2))(np.array([7, 0, -5, 1, 2], np.int32))
    assert np.asarray(meta.token_lora_mapping).tolist() == [-1, 0, -1, 1, -1]
    assert np.asarray(meta.num_tokens_per_lora)[:3].tolist() == [3, 1, 1]


@pytest.mark.parametrize("impl", SIDE_PARAMS)
def test_compute_meta_refuses_int64_beyond_int32(impl):
    with pytest.raises(ValueError, match=r"token_lora_tensor holds 4294967297, outside the int32 range.*wrap it to 1"):
        impl.pkg.compute_meta(host(impl, np.array([BIG, BIG, 0], np.int64)))


# ----------------------------------------------------------------------------- LoRA ids

@pytest.mark.parametrize("impl", SIDE_PARAMS)
def test_lora_id_beyond_int64(impl):
    w = impl.wrapper(8, 4, 3)
    with pytest.raises(ValueError,
                       match=rf"LoRA id {HUGE_ID} \(mapping.index_mapping\[1\]\) is outside the int64 range"):
        w.update_metadata(LoRAMapping((11, HUGE_ID), (11,)), [11, 12, 13], 4, 32, 0)
    with pytest.raises(ValueError, match=rf"LoRA id {HUGE_ID} \(mapping.prompt_mapping\[0\]\)"):
        impl.pkg.convert_mapping(LoRAMapping((11,), (HUGE_ID,)), [11], 2, 32, 0)
    with pytest.raises(ValueError, match=rf"lora_index_to_id\[1\] must be None or a positive LoRA id <= 2\*\*63 - 1, "
                                         rf"got {HUGE_ID}"):
        w.update_metadata(LoRAMapping((11,), (11,)), [11, HUGE_ID, 13], 4, 32, 0)
    with pytest.raises(TypeError, match=r"LoRAMapping.index_mapping must hold integer LoRA ids, got 'a'"):
        LoRAMapping([1, HUGE_ID, "a"], [])


@pytest.mark.parametrize("impl", SIDE_PARAMS)
def test_lora_index_to_id_none(impl):
    w = impl.wrapper(8, 4, 3)
    with pytest.raises(TypeError, match=r"lora_index_to_id must be a sequence with one entry per slot .*got None"):
        w.update_metadata(LoRAMapping((11,), (11,)), None, 4, 32, 0)
    with pytest.raises(TypeError, match=r"lora_index_to_id must be a sequence .*got int"):
        impl.pkg.convert_mapping(LoRAMapping((11,), (11,)), 11, 2, 32, 0)


# ----------------------------------------------------------------------------- ranks

def test_rank_zero_weights_on_pallas_tpu_are_refused_before_dispatch():
    import jax.numpy as jnp

    import jax_lora
    w = jax_lora.PunicaWrapper(8, 4, None, max_loras=3, backend="pallas_tpu")
    w.update_metadata(LoRAMapping((11, 0, 13, 12), (11,)), [11, 12, 13], 4, 32, 0)
    x, y = jnp.ones((4, 16)), jnp.ones((4, 8))
    a0, b0 = jnp.ones((3, 1, 0, 16)), jnp.ones((3, 1, 8, 0))
    with pytest.raises(ValueError, match=r"lora_a_stacked has rank 0, but backend 'pallas_tpu' needs rank >= 1"):
        w.add_lora_linear(y, x, [a0], [b0], None, 1.0, (8,))
    with pytest.raises(ValueError, match=r"lora_b_stacked has rank 0, but backend 'pallas_tpu' needs rank >= 1"):
        w.add_expand(y, jnp.ones((1, 4, 0)), [b0], None, (8,))
    idx = np.array([0, 1, 2, -1], np.int32)
    with pytest.raises(ValueError, match=r"lora_a_weights has rank 0, but backend 'pallas_tpu'"):
        jax_lora.ops.bgmv_shrink(x, a0[:, 0], idx, backend="pallas_tpu")
    with pytest.raises(ValueError, match=r"lora_b_weights has rank 0, but backend 'pallas_tpu'"):
        jax_lora.ops.bgmv_expand(jnp.ones((4, 0)), b0[:, 0], y, idx, backend="pallas_tpu")
    # The reference computes a rank-0 LoRA (it adds nothing).
    ref = jax_lora.PunicaWrapper(8, 4, None, max_loras=3, backend="xla")
    ref.update_metadata(LoRAMapping((11, 0, 13, 12), (11,)), [11, 12, 13], 4, 32, 0)
    assert np.array_equal(np.asarray(ref.add_lora_linear(y, x, [a0], [b0], None, 1.0, (8,))), np.asarray(y))


# ----------------------------------------------------------------------------- scale, slices, offsets

@pytest.mark.parametrize("impl", SIDE_PARAMS)
def test_scale_none(impl):
    w, x, a, b, y, f = setup(impl)
    with pytest.raises(TypeError, match=r"scale must be a real number \(e.g. 1.0\), got NoneType None"):
        w.add_lora_linear(y, x, a, b, None, None, (8, 4))
    with pytest.raises(TypeError, match=r"scale must be a real number"):
        w.add_shrink(impl.arr(np.zeros((2, 4, 4), np.float32), "float32"), x, a, None)
    with pytest.raises(TypeError, match=r"scale must be a real number"):
        w.add_lora_logits(f(1, 16), f(1, 16), a[0], f(3, 1, 16, 4), None)
    with pytest.raises(TypeError, match=r"scale must be a real number"):
        impl.ops.bgmv_shrink(x, a[0][:, 0], impl.idx([0, 1, 2, -1]), None)
    with pytest.raises(TypeError, match=r"scale must be a real number .*got str"):
        w.add_lora_linear(y, x, a, b, None, "1.0", (8, 4))


@pytest.mark.parametrize("impl", SIDE_PARAMS)
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf"), np.float32("nan")],
                         ids=["nan", "inf", "-inf", "float32-nan"])
def test_scale_nan_or_infinite(impl, bad):
    """Every LoRA term would be NaN or infinite: refused at every entry point that takes a scale
    (the torch wrapper's add_lora_linear once let any Python float through unchecked)."""
    w, x, a, b, y, f = setup(impl)
    message = rf"scale must be a finite real number, got {float(bad)}"
    with pytest.raises(ValueError, match=message):
        w.add_lora_linear(y, x, a, b, None, bad, (8, 4))
    with pytest.raises(ValueError, match=message):
        w.add_shrink(impl.arr(np.zeros((2, 4, 4), np.float32), "float32"), x, a, bad)
    with pytest.raises(ValueError, match=message):
        w.add_lora_logits(f(1, 16), f(1, 16), a[0], f(3, 1, 16, 4), bad)
    with pytest.raises(ValueError, match=message):
        w.shrink(x, a[0], bad)
    with pytest.raises(ValueError, match=message):
        impl.ops.bgmv_shrink(x, a[0][:, 0], impl.idx([0, 1, 2, -1]), bad)


@pytest.mark.parametrize("impl", SIDE_PARAMS)
def test_negative_lora_ranks(impl):
    """A negative rank acted as 0 in silence; host values (a list, NumPy, a CPU tensor / CPU array)
    are refused naming the slot. 0 (the slot adds nothing) is a rank."""
    impl = on_host(impl)
    w, x, a, b, y, f = setup(impl)
    forms = [[4, -2, 4], np.array([4, -2, 4], np.int32), host(impl, np.array([4, -2, 4], np.int64))]
    if impl.side == "jax":
        import jax
        forms.append(jax.device_put(np.array([4, -2, 4], np.int32), jax.devices("cpu")[0]))  # a concrete CPU array
    message = (r"lora_ranks must hold ranks >= 0 \(each slot's real rank, 0 for a slot that adds nothing\), "
               r"got -2 for slot 1")
    for ranks in forms:
        with pytest.raises(ValueError, match=message):
            w.add_lora_linear(y, x, a, b, None, 1.0, (8, 4), lora_ranks=ranks)
        with pytest.raises(ValueError, match=message):
            w.add_lora_logits(f(1, 16), f(1, 16), a[0], f(3, 1, 16, 4), 1.0, lora_ranks=ranks)
        with pytest.raises(ValueError, match=message):
            impl.ops.bgmv_shrink(x, a[0][:, 0], impl.idx([0, 1, 2, -1]), 1.0, lora_ranks=ranks)
    zero = impl.wrapper_call(w, "add_lora_linear", impl.arr(impl.to_np(y), "float32"), x, a, b, None, 1.0, (8, 4),
                             lora_ranks=[4, 0, 4])
    assert np.isfinite(zero).all()


@pytest.mark.parametrize("impl", SIDE_PARAMS)
def test_output_slices_none(impl):
    w, x, a, b, y, f = setup(impl)
    with pytest.raises(TypeError, match=r"output_slices must be a sequence of ints \(one width per slice\), got None"):
        w.add_lora_linear(y, x, a, b, None, 1.0, None)
    with pytest.raises(TypeError, match=r"output_slices must be a sequence of ints"):
        w.add_expand(y, f(2, 4, 4), b, None, None)


@pytest.mark.parametrize("impl", SIDE_PARAMS)
def test_integral_offsets_of_any_type_are_accepted(impl):
    w, x, a, b, _, f = setup(impl)
    buf, y0 = f(2, 4, 4), f(4, 15)
    want = impl.to_np(w.add_expand(impl.arr(impl.to_np(y0), "float32"), buf, b, None, (8, 4), 3))
    for offset in (np.int64(3), np.int32(3), np.uint8(3)):
        got = impl.to_np(w.add_expand(impl.arr(impl.to_np(y0), "float32"), buf, b, None, (8, 4), offset))
        np.testing.assert_array_equal(got, want)
    idx = impl.idx([0, 1, 2, -1])
    want = impl.call_op("bgmv_expand_slice", buf[0], b[1][:, 0], impl.arr(impl.to_np(y0), "float32"), idx, 3, 4)
    got = impl.call_op("bgmv_expand_slice", buf[0], b[1][:, 0], impl.arr(impl.to_np(y0), "float32"), idx,
                       np.int64(3), 4)
    np.testing.assert_array_equal(got, want)
    with pytest.raises(TypeError, match=r"offset_start must be an integer >= 0, got float 1.5"):
        w.add_expand(y0, buf, b, None, (8, 4), 1.5)
    with pytest.raises(ValueError, match=r"offset_start must be an integer >= 0, got -1"):
        w.add_expand(y0, buf, b, None, (8, 4), np.int64(-1))


# ----------------------------------------------------------------------------- types and dtypes

def test_numpy_activations_to_the_torch_wrapper():
    import torch
    w, x, a, b, y, _ = setup(SIDES["torch"])
    w.add_lora_linear(y, x, a, b, None, 1.0, (8, 4))     # a cached plan for these weights exists
    xn, yn = x.cpu().numpy(), y.cpu().numpy()
    with pytest.raises(TypeError, match=r"x must be a torch.Tensor, got ndarray"):
        w.add_lora_linear(y, xn, a, b, None, 1.0, (8, 4))
    with pytest.raises(TypeError, match=r"y must be a torch.Tensor, got ndarray"):
        w.add_lora_linear(yn, x, a, b, None, 1.0, (8, 4))
    with pytest.raises(TypeError, match=r"x must be a torch.Tensor, got ndarray"):
        w.add_shrink(torch.zeros(2, 4, 4, device=x.device), xn, a, 1.0)
    import torch_lora
    with pytest.raises(TypeError, match=r"x must be a torch.Tensor, got ndarray"):
        torch_lora.ops.bgmv_shrink(xn, a[0][:, 0], torch.zeros(4, dtype=torch.int32, device=x.device))


@pytest.mark.parametrize("impl", [pytest.param(i, id=i.name) for i in IMPLS])
def test_integer_bias_is_refused_on_every_backend(impl):
    w, x, a, b, y, f = setup(impl)
    bias_int = [impl.arr(np.ones((3, 8), np.int32)), None]
    with pytest.raises(TypeError, match=rf"lora_bias_stacked\[0\] must have dtype in {F32}, got int32"):
        w.add_lora_linear(y, x, a, b, bias_int, 1.0, (8, 4))
    with pytest.raises(TypeError, match=rf"lora_bias_stacked\[0\] must have dtype in {F32}, got int32"):
        w.add_expand(y, f(2, 4, 4), b, bias_int, (8, 4))


@pytest.mark.parametrize("impl", [pytest.param(i, id=i.name) for i in IMPLS
                                  if i.name in ("jax-xla", "torch-ref", "torch-triton")])
def test_bias_with_none_entries_in_add_lora_linear(impl):
    """A None entry is a slice without bias, in add_lora_linear as in add_expand (and cached twice)."""
    w, x, a, b, y, f = setup(impl)
    bias0 = f(3, 8)
    idx = [0, -1, 2, 1]
    want = oracle.lora_linear(impl.to_np(y), impl.to_np(x), [impl.to_np(t) for t in a], [impl.to_np(t) for t in b],
                              [impl.to_np(bias0), np.zeros((3, 4))], 1.0, idx)
    for _ in range(2):
        got = impl.wrapper_call(w, "add_lora_linear", impl.arr(impl.to_np(y), "float32"), x, a, b, [bias0, None],
                                1.0, (8, 4))
        assert oracle.rel_err(got, want) < 1e-5


@pytest.mark.parametrize("impl", SIDE_PARAMS)
def test_float64_is_refused_with_the_same_message_on_both_sides(impl):
    """Contract section 4 dtypes: torch refuses float64; JAX must too, not narrow NumPy float64 to float32."""
    impl = on_host(impl)
    w, x, a, b, y, f = setup(impl)
    x64, y64 = host(impl, impl.to_np(x)), host(impl, impl.to_np(y))
    a64 = [host(impl, impl.to_np(t)) for t in a]
    with pytest.raises(TypeError, match=rf"^x must have dtype in {F32}, got float64$"):
        w.add_lora_linear(y, x64, a, b, None, 1.0, (8, 4))
    with pytest.raises(TypeError, match=rf"^y must have dtype in {F32}, got float64$"):
        w.add_lora_linear(y64, x, a, b, None, 1.0, (8, 4))
    with pytest.raises(TypeError, match=rf"^lora_a_stacked\[0\] must have dtype in {WEIGHTS}, got float64$"):
        w.add_lora_linear(y, x, a64, b, None, 1.0, (8, 4))
    with pytest.raises(TypeError, match=rf"^lora_bias_stacked\[1\] must have dtype in {F32}, got float64$"):
        w.add_lora_linear(y, x, a, b, [None, host(impl, np.zeros((3, 4)))], 1.0, (8, 4))
    with pytest.raises(TypeError, match=rf"^x must have dtype in {F32}, got float64$"):
        impl.ops.bgmv_shrink(x64, a[0][:, 0], impl.idx([0, 1, 2, -1]))


# ----------------------------------------------------------------------------- torch: storage swaps

def _torch_case(backend, seed=0):
    """A wrapper and its weights: on CUDA for the Triton backend when a GPU is present (its compiled
    kernels), else on the CPU (the reference, or Triton's interpreter)."""
    import torch

    import torch_lora
    dev = "cuda" if backend == "triton" and torch.cuda.is_available() else "cpu"
    w = torch_lora.PunicaWrapper(8, 4, dev, max_loras=3, backend=backend)
    w.update_metadata(LoRAMapping((5, 0, 7, 6), (5,)), [5, 6, 7], 4, 32)
    g = torch.Generator().manual_seed(seed)
    a = tuple(torch.randn(3, 1, 4, 16, generator=g).to(dev) for _ in range(2))
    b = tuple(torch.randn(3, 1, n, 4, generator=g).to(dev) for n in (8, 4))
    return w, a, b, torch.randn(4, 16, generator=g).to(dev), torch.randn(4, 12, generator=g).to(dev), g


def _check(w, a, b, x, y):
    got = w.add_lora_linear(y.clone(), x, a, b, None, 1.0, (8, 4))
    host = lambda t: t.cpu().numpy()
    want = oracle.lora_linear(host(y), host(x), [host(t) for t in a], [host(t) for t in b], None, 1.0,
                              [0, -1, 2, 1])
    assert oracle.rel_err(host(got), want) < 1e-5


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_torch_plan_follows_a_swapped_storage(backend):
    import torch
    w, a, b, x, y, g = _torch_case(backend)
    dev = x.device
    _check(w, a, b, x, y)
    a[0].data = torch.randn(3, 1, 4, 16, generator=g).to(dev)          # new storage, same object
    _check(w, a, b, x, y)
    b[1].set_(torch.randn(3, 1, 4, 4, generator=g).to(dev))            # set_: new storage, same object
    _check(w, a, b, x, y)
    fresh = torch.randn(3, 1, 4, 16, generator=g).to(dev)
    a[1].set_(fresh.untyped_storage(), 0, fresh.shape, fresh.stride())
    _check(w, a, b, x, y)


def test_torch_plan_rechecks_a_swapped_in_tensor_of_another_rank():
    import torch
    w, a, b, x, y, g = _torch_case("torch")
    _check(w, a, b, x, y)
    a[0].data = torch.randn(3, 1, 2, 16, generator=g)
    with pytest.raises(ValueError, match=r"every slice of lora_a_stacked must have the same \(num_slots, rank\), "
                                         r"got \[\(3, 2\), \(3, 4\)\]"):
        w.add_lora_linear(y, x, a, b, None, 1.0, (8, 4))
    a[1].data = a[1].data[:, :, :2]                              # a view of the same storage, rank 2
    with pytest.raises(ValueError, match=r"lora_b_stacked\[0\] has rank 4 .*ranks differ"):
        w.add_lora_linear(y, x, a, b, None, 1.0, (8, 4))
    b[0].data, b[1].data = b[0].data[..., :2], b[1].data[..., :2]
    _check(w, a, b, x, y)                                        # consistent again: a new plan, correct


def test_torch_plan_rechecks_a_swapped_dtype_and_shape_of_the_same_storage():
    import torch
    w, a, b, x, y, _ = _torch_case("torch")
    _check(w, a, b, x, y)
    a[0].data = a[0].data.view(torch.int32)                     # same storage, sizes and strides
    with pytest.raises(TypeError, match=r"lora_a_stacked\[0\] must have dtype .* got int32"):
        w.add_lora_linear(y, x, a, b, None, 1.0, (8, 4))
    a[0].data = a[0].data.view(torch.float32)
    _check(w, a, b, x, y)
    a[0].data = a[0].data[:2]                                   # same storage and pointer, 2 slots
    with pytest.raises(ValueError, match=r"every slice of lora_a_stacked must have the same \(num_slots, rank\)"):
        w.add_lora_linear(y, x, a, b, None, 1.0, (8, 4))


def test_torch_plan_is_kept_across_in_place_updates():
    w, a, b, x, y, _ = _torch_case("torch")
    _check(w, a, b, x, y)
    plan = next(iter(w._plans.values()))
    a[0][2].mul_(3.0)                 # an adapter loaded into slot 2, in place: same storage
    b[1].copy_(b[1] * 0.5)
    _check(w, a, b, x, y)
    assert next(iter(w._plans.values())) is plan
