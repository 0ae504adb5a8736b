"""Bad input (contract section 6): every error gets a clear ValueError/TypeError naming the argument,
what was expected and what was received, on both sides.

The section 6 catalogue on each side's reference wrapper (tests/impls.py), then the checks a caller
meets first: mismatched hidden sizes, ranks, slice counts and slots; host index values past the
slots and int64 ids; float64 host arrays (vLLM's shrink / expand / expand_slice wrapper methods
included); unknown backends; None where a value is required; non-finite scales; negative host
lora_ranks; arrays on another device than the wrapper's. CPU only (two forced JAX CPU devices, the
torch `meta` device).
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest
import torch

import torch_lora
from jax_lora import LoRAKernelMeta, PunicaWrapper, ops
from lora_core.host_mapping import LoRAMapping

from . import jax_helpers, torch_helpers
from .impls import IMPLS

SIDES = {}
for _impl in IMPLS:
    SIDES.setdefault(_impl.side, _impl)  # the reference entry of each side
SIDE_PARAMS = [pytest.param(impl, id=impl.side) for impl in SIDES.values()]


def setup(impl, num_tokens=6, hidden=32, rank=8, slices=(16, 8), slots=3, capacity=8):
    rng = np.random.default_rng(0)
    w = impl.wrapper(capacity, 4, slots)
    ids = [11, 12, 13][:slots]
    w.update_metadata(LoRAMapping((11, 0, 13, 12, 11, 0)[:num_tokens], (11,)), ids, slots + 1, 32, 0)
    f = lambda *s: impl.arr(rng.standard_normal(s).astype(np.float32), "float32")
    x = f(num_tokens, hidden)
    a = [f(slots, 1, rank, hidden) for _ in slices]
    b = [f(slots, 1, n, rank) for n in slices]
    y = f(num_tokens, sum(slices))
    return w, x, a, b, y, f


@pytest.mark.parametrize("impl", SIDE_PARAMS)
def test_mismatched_hidden_size(impl):
    w, x, a, b, y, f = setup(impl)
    bad_a = [f(3, 1, 8, 31), a[1]]
    with pytest.raises(ValueError, match=r"lora_a_stacked\[0\] has hidden size 31.*x has hidden size 32"):
        w.add_lora_linear(y, x, bad_a, b, None, 1.0, (16, 8))


@pytest.mark.parametrize("impl", SIDE_PARAMS)
def test_rank_differs_between_a_and_b(impl):
    w, x, a, b, y, f = setup(impl)
    bad_b = [f(3, 1, 16, 4), b[1]]
    with pytest.raises(ValueError, match=r"lora_b_stacked\[0\] has rank 4.*ranks differ"):
        w.add_lora_linear(y, x, a, bad_b, None, 1.0, (16, 8))


@pytest.mark.parametrize("impl", SIDE_PARAMS)
def test_output_slices_length(impl):
    w, x, a, b, y, f = setup(impl)
    with pytest.raises(ValueError, match="output_slices"):
        w.add_lora_linear(y, x, a, b, None, 1.0, (24,))
    buf = impl.arr(np.zeros((2, 6, 8), np.float32), "float32")
    with pytest.raises(ValueError, match=r"len\(output_slices\) = 1 but lora_b_stacked has 2"):
        w.add_expand(y, buf, b, None, (24,))
    with pytest.raises(ValueError, match=r"output_slices \(16, 9\) differ"):
        w.add_expand(impl.arr(np.zeros((6, 30), np.float32), "float32"), buf, b, None, (16, 9))


@pytest.mark.parametrize("impl", SIDE_PARAMS)
def test_slices_wider_than_y(impl):
    w, x, a, b, _, f = setup(impl)
    with pytest.raises(ValueError, match=r"exceed y's 20 columns"):
        w.add_lora_linear(f(6, 20), x, a, b, None, 1.0, (16, 8))


@pytest.mark.parametrize("impl", SIDE_PARAMS)
def test_bias_shape(impl):
    w, x, a, b, y, f = setup(impl)
    with pytest.raises(ValueError, match=r"lora_bias_stacked\[1\] must have shape \(3, 8\)"):
        w.add_lora_linear(y, x, a, b, [f(3, 16), f(3, 9)], 1.0, (16, 8))


@pytest.mark.parametrize("impl", SIDE_PARAMS)
def test_index_beyond_slots_in_ops(impl):
    """Index values are checked where they live on the host (NumPy, CPU arrays and tensors); on a
    GPU they are not read back (no host sync): out-of-range indices are masked there instead."""
    if impl.side == "jax":
        import jax
        with jax.default_device(jax.devices("cpu")[0]):
            _index_beyond_slots(impl)
    else:
        _index_beyond_slots(dataclasses.replace(impl, torch_device="cpu"))


def _index_beyond_slots(impl):
    rng = np.random.default_rng(1)
    x = impl.arr(rng.standard_normal((4, 16)).astype(np.float32), "float32")
    wa = impl.arr(rng.standard_normal((2, 4, 16)).astype(np.float32), "float32")
    with pytest.raises(ValueError, match=r"lora_indices_tensor holds slot 2, but lora_a_weights has only 2 slots"):
        impl.ops.bgmv_shrink(x, wa, impl.idx([0, 1, 2, -1]), 1.0)
    with pytest.raises(ValueError, match=r"lora_indices_tensor holds -2"):
        impl.ops.bgmv_shrink(x, wa, impl.idx([0, 1, -2, -1]), 1.0)
    with pytest.raises(ValueError, match=r"token_lora_mapping holds slot 3"):
        impl.lora_shrink(x, [wa], np.array([0, 3, 1, -1]), 1.0, max_loras=4)


@pytest.mark.parametrize("impl", SIDE_PARAMS)
def test_mapping_slot_beyond_weights(impl):
    """The wrapper knows (on the host) which slots the step uses: weights with fewer slots fail."""
    w, x, _, _, y, f = setup(impl, slots=3)
    small_a = [f(2, 1, 8, 32)]
    small_b = [f(2, 1, 24, 8)]
    with pytest.raises(ValueError, match=r"mapping uses slot 2, but lora_a_stacked has only 2 slots"):
        w.add_lora_linear(y, x, small_a, small_b, None, 1.0, (24,))


@pytest.mark.parametrize("impl", SIDE_PARAMS)
def test_lora_id_in_no_slot(impl):
    w = impl.wrapper(8, 4, 3)
    with pytest.raises(ValueError, match=r"LoRA id 77 \(mapping.index_mapping\[1\]\) is in no slot"):
        w.update_metadata(LoRAMapping((11, 77), (11,)), [11, None, 12], 4, 32, 0)
    with pytest.raises(ValueError, match=r"LoRA id 5 \(mapping.prompt_mapping\[0\]\) is in no slot"):
        impl.pkg.convert_mapping(LoRAMapping((11,), (5,)), [11], 2, 32, 0)


@pytest.mark.parametrize("impl", SIDE_PARAMS)
def test_slot_beyond_wrapper_max_loras(impl):
    w = impl.wrapper(8, 4, 2)
    with pytest.raises(ValueError, match=r"slot 2 is used, but the wrapper was made with max_loras=2"):
        w.update_metadata(LoRAMapping((13, 0), (0,)), [11, 12, 13], 4, 32, 0)


@pytest.mark.parametrize("impl", SIDE_PARAMS)
def test_too_many_tokens(impl):
    w, x, a, b, y, f = setup(impl, capacity=6)
    with pytest.raises(ValueError, match=r"mapping.index_mapping has 7 entries, more than max_num_batched_tokens=6"):
        w.update_metadata(LoRAMapping((11,) * 7, (11,)), [11, 12, 13], 4, 32, 0)
    with pytest.raises(ValueError, match=r"more than max_num_batched_tokens=6"):
        w.add_lora_linear(f(7, 24), f(7, 32), a, b, None, 1.0, (16, 8))


@pytest.mark.parametrize("impl", SIDE_PARAMS)
def test_too_many_prefill_segments(impl):
    w = impl.wrapper(8, 2, 3)
    with pytest.raises(ValueError, match=r"prefill segments has 3 entries, more than max_batches=2"):
        w.update_metadata(LoRAMapping((11, 12, 11), (11,), True), [11, 12, 13], 4, 32, 0)


@pytest.mark.parametrize("impl", SIDE_PARAMS)
def test_dtypes_outside_spec(impl):
    w, x, a, b, y, f = setup(impl)
    x_int = impl.arr(np.ones((6, 32), np.int32))
    with pytest.raises(TypeError, match=r"x must have dtype in .*got int32"):
        w.add_lora_linear(y, x_int, a, b, None, 1.0, (16, 8))
    a_int = [impl.arr(np.ones((3, 1, 8, 32), np.int32)), a[1]]
    with pytest.raises(TypeError, match=r"lora_a_stacked\[0\] must have dtype"):
        w.add_lora_linear(y, x, a_int, b, None, 1.0, (16, 8))
    idx_f = impl.arr(np.zeros(6, np.float32), "float32")
    with pytest.raises((TypeError, ValueError), match=r"lora_indices_tensor"):
        impl.ops.bgmv_shrink(x, a[0], idx_f, 1.0)


@pytest.mark.parametrize("impl", SIDE_PARAMS)
def test_bad_mapping_and_sizes(impl):
    with pytest.raises(TypeError, match="mapping must be a LoRAMapping"):
        impl.wrapper(8, 4, 2).update_metadata({"index_mapping": (1,)}, [1], 3, 32, 0)
    with pytest.raises(ValueError, match="lora_index_to_id holds LoRA id 4 twice"):
        impl.pkg.convert_mapping(LoRAMapping((4,), (4,)), [4, 4], 3, 32, 0)
    with pytest.raises(ValueError, match="max_num_batched_tokens must be an int >= 1"):
        impl.wrapper(0, 4, 2)
    with pytest.raises(ValueError, match="backend must be one of"):
        impl.pkg.PunicaWrapper(8, 4, None if impl.side == "jax" else "cpu", max_loras=2, backend="cuda-magic")


@pytest.mark.parametrize("impl", SIDE_PARAMS)
def test_shape_errors_in_ops(impl):
    rng = np.random.default_rng(2)
    f = lambda *s: impl.arr(rng.standard_normal(s).astype(np.float32), "float32")
    with pytest.raises(ValueError, match=r"x must be 2-D"):
        impl.ops.bgmv_shrink(f(2, 3, 16), f(2, 4, 16), impl.idx([0, 1]), 1.0)
    with pytest.raises(ValueError, match=r"lora_b_weights must have shape"):
        impl.ops.bgmv_expand(f(2, 4), f(2, 2, 2, 8, 4), f(2, 8), impl.idx([0, 1]))
    with pytest.raises(ValueError, match=r"y_slice_size is 6"):
        impl.ops.bgmv_expand_slice(f(2, 4), f(2, 8, 4), f(2, 16), impl.idx([0, 1]), 0, 6)


@pytest.mark.parametrize("impl", SIDE_PARAMS)
def test_vllm_wrapper_methods_name_their_arguments(impl):
    """Shrink / expand / expand_slice (TPU seed) name x, w_t_all, y, y_offset and y_slice_size."""
    w, x, a, b, y, f = setup(impl)
    buf = f(6, 8)
    with pytest.raises(ValueError, match=r"w_t_all\[0\] has hidden size 31.*x has hidden size 32"):
        w.shrink(x, f(3, 1, 8, 31), 1.0)
    with pytest.raises(TypeError, match=r"w_t_all\[0\] must have dtype"):
        w.shrink(x, impl.arr(np.zeros((3, 8, 32), np.int32)), 1.0)
    with pytest.raises(ValueError, match=r"the mapping uses slot 2, but w_t_all has only 2 slots"):
        w.shrink(x, f(2, 8, 32), 1.0)
    with pytest.raises(ValueError, match=r"w_t_all has rank 4 .* but x has rank 8"):
        w.expand(y, buf, f(3, 16, 4), True)
    with pytest.raises(ValueError, match=r"x must be 2-D \(num_tokens, rank\)"):
        w.expand(y, f(1, 6, 8), f(3, 16, 8), True)
    with pytest.raises(ValueError, match=r"y has 5 rows .* but x has 6 tokens"):
        w.expand_slice(f(5, 24), buf, f(3, 16, 8), 0, 16, True)
    with pytest.raises(ValueError, match=r"y_slice_size is 8, but w_t_all has 16 output rows"):
        w.expand_slice(y, buf, f(3, 16, 8), 0, 8, True)
    with pytest.raises(ValueError, match=r"y_offset must be an int >= 0, got -1"):
        w.expand_slice(y, buf, f(3, 16, 8), -1, 16, True)
    with pytest.raises(ValueError, match=r"y_offset 10 \+ y_slice_size 16 = 26 exceed y's 24 columns"):
        w.expand_slice(y, buf, f(3, 16, 8), 10, 16, True)


def test_torch_tensors_on_different_devices():
    torch = pytest.importorskip("torch")
    import torch_lora
    x = torch.randn(4, 16)
    w_meta = torch.empty(2, 4, 16, device="meta")
    with pytest.raises(ValueError, match=r"tensors are on different devices: x on cpu, lora_a_weights on meta"):
        torch_lora.ops.bgmv_shrink(x, w_meta, torch.zeros(4, dtype=torch.int32))


def test_jax_arrays_on_different_devices():
    import jax

    import jax_lora
    devices = jax.devices("cpu")
    if len(devices) < 2:
        pytest.skip("needs two CPU devices (XLA_FLAGS=--xla_force_host_platform_device_count=2)")
    x = jax.device_put(np.ones((4, 16), np.float32), devices[0])
    w = jax.device_put(np.ones((2, 4, 16), np.float32), devices[1])
    with pytest.raises(ValueError, match=r"arrays are on different devices"):
        jax_lora.ops.bgmv_shrink(x, w, np.zeros(4, np.int32))


def test_triton_on_cpu_without_interpreter_is_a_clear_error(monkeypatch):
    torch = pytest.importorskip("torch")
    from torch_lora.ops import dispatch
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        dispatch.resolve("triton", torch.device("cpu"))


def test_wrapper_bad_input_errors_name_the_argument():
    """Contract section 6: clear ValueError/TypeError naming the argument for mismatched
    hidden size, A/B rank mismatch, len(output_slices) != len(lora_b), a slot past the weights' slots,
    too many tokens, float64 activations, NaN or None scale, a bad backend name or deterministic flag,
    and arrays on another device than the wrapper's index arrays."""
    ids = (1, 3, 0)
    w = jax_helpers.wrapper(ids, jax_helpers.LORA_INDEX_TO_ID, capacity=4)
    T, H, r, L = 3, 8, 4, 3
    x, y = jax_helpers.rand(T, H), jax_helpers.rand(T, 6)
    A, B = [jax_helpers.rand(L, r, H)], [jax_helpers.rand(L, 6, r)]

    def err(exc, *words, **kw):
        args = dict(y=y, x=x, lora_a_stacked=A, lora_b_stacked=B, lora_bias_stacked=None, scale=1.0,
                    output_slices=(6,))
        args.update(kw)
        with pytest.raises(exc) as e:
            w.add_lora_linear(**args)
        msg = str(e.value)
        for word in words:
            assert word in msg, msg

    err(ValueError, "lora_a_stacked", x=jax_helpers.rand(T, H + 1))
    err(ValueError, "rank", lora_b_stacked=[jax_helpers.rand(L, 6, r + 1)])
    err(ValueError, "output_slices", output_slices=(3, 3))
    err(ValueError, "slot", lora_a_stacked=[jax_helpers.rand(2, r, H)], lora_b_stacked=[jax_helpers.rand(2, 6, r)])
    err(ValueError, "max_num_batched_tokens", x=jax_helpers.rand(5, H), y=jax_helpers.rand(5, 6))
    err((TypeError, ValueError), "float64", x=np.zeros((T, H), np.float64))
    err((TypeError, ValueError), "int32", lora_a_stacked=[np.zeros((L, r, H), np.int32)])
    err(TypeError, "scale", scale=None)
    err(ValueError, "scale", scale=float("nan"))
    err((TypeError, ValueError), "output_slices", output_slices=None)
    # committed arrays on another device than the wrapper's (committed) index arrays
    w_dev = PunicaWrapper(4, 4, jax.devices("cpu")[0], max_loras=3, backend="xla")
    w_dev.update_metadata(LoRAMapping(ids, ids), jax_helpers.LORA_INDEX_TO_ID, 4, 64)
    with pytest.raises(ValueError) as e:
        w_dev.add_lora_linear(y, jax.device_put(x, jax.devices("cpu")[1]), A, B, None, 1.0, (6,))
    assert "x" in str(e.value) and "index arrays" in str(e.value)
    with pytest.raises(ValueError, match="bogus"):
        PunicaWrapper(4, 4, None, max_loras=2, backend="bogus")
    with pytest.raises(TypeError):
        PunicaWrapper(4, 4, None, max_loras=2, deterministic="yes")
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        w.update_metadata(LoRAMapping((1,) * 5, (1,)), jax_helpers.LORA_INDEX_TO_ID, 4, 64)


def test_op_index_checks_on_host_values():
    """Contract section 6: host index values >= the slots are refused naming the argument; int64
    indices outside int32 are refused (never wrapped to another slot); a negative host lora_ranks
    entry is refused naming its slot."""
    x, A = jax_helpers.rand(2, 8), jax_helpers.rand(3, 4, 8)
    with pytest.raises(ValueError, match="lora_indices_tensor|index|slot"):
        ops.bgmv_shrink(x, A, np.array([0, 3], np.int32), backend="xla")
    with pytest.raises(ValueError, match="int32|2147483647|4294967297"):
        ops.bgmv_shrink(x, A, np.array([0, 2**32 + 1], np.int64), backend="xla")
    meta = LoRAKernelMeta.build(np.array([0, 1], np.int32), max_loras=3)
    with pytest.raises(ValueError, match="slot 1|\\[1\\]"):
        ops.lora_shrink(x, [A], meta, 1.0, backend="xla", lora_ranks=np.array([4, -1, 4], np.int32))


def test_shrink_expand_methods_refuse_float64_host_arrays():
    """docs/api.md "Nothing is changed in silence":
    host float64 activations and weights are refused at every public entry, vLLM's wrapper
    methods shrink / expand / expand_slice included."""
    w = jax_helpers.wrapper((1, 0), jax_helpers.LORA_INDEX_TO_ID)
    x64, A = np.ones((2, 8), np.float64), jax_helpers.rand(3, 4, 8)
    with pytest.raises((TypeError, ValueError), match="float64"):
        w.shrink(x64, A, 1.0)
    with pytest.raises((TypeError, ValueError), match="float64"):
        w.shrink(jax_helpers.rand(2, 8), A.astype(np.float64), 1.0)
    with pytest.raises((TypeError, ValueError), match="float64"):
        w.expand(jax_helpers.rand(2, 6), np.ones((2, 4), np.float64), jax_helpers.rand(3, 6, 4), True)
    with pytest.raises((TypeError, ValueError), match="float64"):
        w.expand_slice(np.ones((2, 6), np.float64), jax_helpers.rand(2, 4), jax_helpers.rand(3, 2, 4), 0, 2, True)


def test_bad_inputs_name_the_argument():
    """Contract section 6 / README: bad input raises ValueError/TypeError naming the argument:
    mismatched hidden sizes, wrong slice count, too many tokens, float64, a NumPy x."""
    rng = torch_helpers.rng(4)
    a, b = torch_helpers.stacked(rng, 2, 4, 8, (5,))
    w = torch_helpers.wrapper((1, 2), [1, 2])
    y = torch.zeros(2, 5)
    with pytest.raises(ValueError, match="lora_a_stacked|hidden"):
        w.add_lora_linear(y, torch.zeros(2, 9), a, b, None, 1.0, (5,))
    with pytest.raises(ValueError, match="output_slices"):
        w.add_lora_linear(y, torch.zeros(2, 8), a, b, None, 1.0, (2, 3))
    with pytest.raises((TypeError, ValueError), match="x"):
        w.add_lora_linear(y, torch.zeros(2, 8, dtype=torch.float64), a, b, None, 1.0, (5,))
    with pytest.raises(TypeError, match=r"\bx\b"):
        w.add_lora_linear(y, np.zeros((2, 8), np.float32), a, b, None, 1.0, (5,))
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        w.update_metadata(LoRAMapping((1,) * 65, (1,)), [1, 2], 3, 16)


def test_unknown_backend_is_a_clear_error():
    """Contract section 8: backend= forces an implementation; an unknown name is an error naming it."""
    with pytest.raises(ValueError, match="bogus"):
        torch_lora.PunicaWrapper(16, 4, "cpu", max_loras=2, backend="bogus")


def test_unclear_inputs_name_their_argument():
    """Unclear inputs: scale=None, output_slices=None, a LoRA id of 2**70,
    lora_index_to_id=None, an int32 bias: each a ValueError/TypeError naming the argument."""
    rng = torch_helpers.rng(9)
    a, b = torch_helpers.stacked(rng, 2, 4, 8, (5,))
    w = torch_helpers.wrapper((1, 2), [1, 2])
    x, y = torch.zeros(2, 8), torch.zeros(2, 5)
    with pytest.raises(TypeError, match="scale"):
        w.add_lora_linear(y, x, a, b, None, None, (5,))
    with pytest.raises((TypeError, ValueError), match="output_slices"):
        w.add_lora_linear(y, x, a, b, None, 1.0, None)
    with pytest.raises(ValueError, match=str(2**70)):
        w.update_metadata(LoRAMapping((2**70,), (2**70,)), [1, 2], 3, 16)
    with pytest.raises(TypeError, match="lora_index_to_id"):
        w.update_metadata(LoRAMapping((1,), (1,)), None, 3, 16)
    with pytest.raises((TypeError, ValueError), match="lora_bias_stacked"):
        w.add_lora_linear(y, x, a, b, [torch.zeros(2, 5, dtype=torch.int32)], 1.0, (5,))


def test_nonfinite_scale_refused():
    """A NaN or infinite scale is refused (ValueError naming scale)
    by the wrapper and the ops."""
    rng = torch_helpers.rng(11)
    a, b = torch_helpers.stacked(rng, 2, 4, 8, (5,))
    w = torch_helpers.wrapper((1, 2), [1, 2])
    for bad in (float("nan"), float("inf")):
        with pytest.raises(ValueError, match="scale"):
            w.add_lora_linear(torch.zeros(2, 5), torch.zeros(2, 8), a, b, None, bad, (5,))
        with pytest.raises(ValueError, match="scale"):
            torch_lora.ops.bgmv_shrink(torch.zeros(2, 8), a[0], torch.tensor([0, 1]), bad, backend="torch")


def test_negative_host_lora_ranks_refused_naming_the_slot():
    """A negative lora_ranks value held on the host is refused, naming its slot."""
    rng = torch_helpers.rng(12)
    a, b = torch_helpers.stacked(rng, 3, 4, 8, (5,))
    w = torch_helpers.wrapper((1, 2), [1, 2, 3])
    with pytest.raises(ValueError, match=r"lora_ranks.*2|slot 2"):
        w.add_lora_linear(torch.zeros(2, 5), torch.zeros(2, 8), a, b, None, 1.0, (5,),
                          lora_ranks=torch.tensor([4, 4, -1], dtype=torch.int32))
