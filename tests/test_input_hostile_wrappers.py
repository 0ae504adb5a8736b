"""Hostile inputs at the wrappers and the host mapping (contract section 5-6): arguments that used to be
accepted in silence or to fail with an error naming nothing. Each case runs on both sides' reference
wrappers and on both bridge directions (the bridge wrappers run the other side's checks).

CPU.
"""

from __future__ import annotations

import logging

import numpy as np
import pytest

from lora_core.host_mapping import LongContextLoRAContext, LoRAMapping

from .impls import IMPLS

REF = [pytest.param(i, id=i.name) for i in IMPLS if i.name in ("jax-xla", "torch-ref", "torch-over-jax",
                                                               "jax-over-torch")]


def _step(impl, slots=4, num_tokens=2, hidden=32, rank=8, width=16):
    w = impl.wrapper(8, 4, slots)
    w.update_metadata(LoRAMapping((1, 3)[:num_tokens], (1,)), [1, 2, 3, None][:slots], slots, 10)
    f = lambda *s: impl.arr(np.ones(s, np.float32), "float32")
    return w, f, f(num_tokens, hidden), f(num_tokens, width), rank


@pytest.mark.parametrize("impl", REF)
def test_a_and_b_slot_counts_must_agree(impl):
    """A of 4 slots with B of 2: token 1's slot (1) has no B; JAX under jit dropped its LoRA."""
    w, f, x, y, r = _step(impl)
    with pytest.raises(ValueError, match=r"lora_a_stacked has 4 slots but lora_b_stacked has 5"):
        w.add_lora_linear(y, x, (f(4, 1, r, 32),), (f(5, 1, 16, r),), None, 1.0, (16,))
    with pytest.raises(ValueError, match=r"lora_a_stacked has 4 slots but lora_b_stacked has 2"):
        w.add_lora_logits(f(1, 16), f(1, 32), f(4, 1, r, 32), f(2, 1, 16, r), 1.0)


def test_a_and_b_slot_counts_must_agree_under_jit():
    import jax
    import jax.numpy as jnp

    import jax_lora
    w = jax_lora.PunicaWrapper(8, 4, "cpu", max_loras=4)
    w.update_metadata(LoRAMapping((1, 3), (1,)), [1, 2, 3, None], 4, 10)
    a, b = jnp.ones((4, 1, 8, 32)), jnp.ones((2, 1, 16, 8))
    with pytest.raises(ValueError, match=r"lora_a_stacked has 4 slots but lora_b_stacked has 2"):
        jax.jit(lambda w, y, x: w.add_lora_linear(y, x, (a,), (b,), None, 1.0, (16,)))(
            w, jnp.zeros((2, 16)), jnp.ones((2, 32)))


@pytest.mark.parametrize("impl", REF)
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_the_shrink_buffer_is_float32(impl, dtype):
    """Contract section 4: the shrink buffer is float32; a half-precision one rounded (and overflowed) the shrink."""
    w, f, x, y, r = _step(impl)
    buf = impl.arr(np.zeros((1, 2, r), np.float32), dtype)
    with pytest.raises(TypeError, match=r"buffer must have dtype in \('float32',\), got " + dtype):
        w.add_lora_linear(y, x, (f(4, 1, r, 32),), (f(4, 1, 16, r),), None, 1.0, (16,), buffer=buf)
    with pytest.raises(TypeError, match=r"buffer must have dtype in \('float32',\)"):
        w.add_lora_logits(f(1, 16), f(1, 32), f(4, 1, r, 32), f(4, 1, 16, r), 1.0,
                          buffer=impl.arr(np.zeros((1, 1, r), np.float32), dtype))


def test_torch_wrapper_before_update_metadata_refuses_tokens():
    """A torch wrapper never given a step returned y unchanged in silence."""
    import torch

    import torch_lora
    w = torch_lora.PunicaWrapper(64, 8, "cpu", max_loras=4, backend="torch")
    a, b = torch.ones(4, 1, 8, 32), torch.ones(4, 1, 16, 8)
    with pytest.raises(ValueError, match=r"x has 6 rows, but update_metadata has not been called"):
        w.add_lora_linear(torch.zeros(6, 16), torch.randn(6, 32), (a,), (b,), None, 1.0, (16,))
    with pytest.raises(ValueError, match=r"update_metadata has not been called"):
        w.add_shrink(torch.zeros(1, 6, 8), torch.randn(6, 32), (a,), 1.0)
    # zero tokens are nothing to compute
    assert w.add_lora_linear(torch.zeros(0, 16), torch.zeros(0, 32), (a,), (b,), None, 1.0, (16,)).shape == (0, 16)


@pytest.mark.parametrize("impl", [p for p in REF if p.values[0].side == "torch"])
def test_torch_plan_cache_does_not_admit_float_widths(impl):
    """(16.0,) hashes like (16,): a cached plan must not let it through where a fresh wrapper refuses it."""
    w, f, x, y, r = _step(impl)
    a, b = (f(4, 1, r, 32),), (f(4, 1, 16, r),)
    w.add_lora_linear(y, x, a, b, None, 1.0, (16,))
    with pytest.raises(TypeError, match=r"output_slices must be a sequence of ints"):
        w.add_lora_linear(y, x, a, b, None, 1.0, (16.0,))


@pytest.mark.parametrize("impl", REF)
def test_slot_table_cache_does_not_admit_bools_or_floats(impl):
    """[1, 9] cached, then [True, 9] / [1.0, 9] (equal, same hash) were accepted."""
    w = impl.wrapper(8, 4, 2)
    w.update_metadata(LoRAMapping((1, 9), (1,)), [1, 9], 2, 10)
    for ids in ([True, 9], [1.0, 9]):
        with pytest.raises(ValueError, match=r"lora_index_to_id\[0\] must be None or a positive int LoRA id, got"):
            w.update_metadata(LoRAMapping((1, 9), (1,)), ids, 2, 10)
    with pytest.raises(ValueError, match=r"lora_index_to_id\[0\] must be None or a positive int LoRA id, got list"):
        w.update_metadata(LoRAMapping((1,), (1,)), [[1], None], 2, 10)


@pytest.mark.parametrize("impl", REF)
def test_mapping_and_long_lora_values_are_not_narrowed(impl):
    w = impl.wrapper(8, 4, 2)
    with pytest.raises(TypeError, match=r"LoRAMapping.index_mapping must hold integer LoRA ids, got True at \[1\]"):
        LoRAMapping((1, True, 0), (1,))
    for offset, kind in ((2.7, "float"), ("abc", "str"), (True, "bool")):
        ctx = LongContextLoRAContext({1: offset})
        with pytest.raises(TypeError, match=rf"offsets_by_lora_id\[1\] must be an int position offset, got {kind}"):
            w.update_metadata(LoRAMapping((1, 0), (1,)), [1, None], 2, 10, 0, ctx)


@pytest.mark.parametrize("impl", REF)
def test_raw_errors_name_their_argument(impl):
    w, f, x, y, r = _step(impl)
    a, b = f(4, 1, r, 32), f(4, 1, 16, r)
    with pytest.raises(TypeError, match=r"lora_a_stacked must be one stacked weight .* not a (list|tuple) of 1"):
        w.add_lora_logits(f(1, 16), f(1, 32), [a], [b], 1.0)
    with pytest.raises(ValueError, match=r"x\[1\] has shape \(1, 8\), but x\[0\] has \(2, 8\)"):
        w.add_expand(f(2, 32), [f(2, r), f(1, r)], (b, b), None, (16, 16))
    with pytest.raises(ValueError, match=r"x must have a hidden size >= 1, got shape \(2, 0\)"):
        w.add_lora_linear(y, f(2, 0), (f(4, 1, r, 0),), (b,), None, 1.0, (16,))
    with pytest.raises(ValueError, match=r"lora_a_stacked\[0\] must hold at least one slot"):
        w.add_lora_linear(y, x, (f(0, 1, r, 32),), (f(0, 1, 16, r),), None, 1.0, (16,))
    if impl.side == "torch":
        with pytest.raises(TypeError, match=r"y must be a torch.Tensor, got None"):
            w.add_shrink(None, x, (a,), 1.0)


@pytest.mark.parametrize("side", ["jax", "torch"])
def test_unknown_wrapper_keywords_are_ignored_with_a_warning(side, caplog):
    """vLLM's wrappers take **kwargs (an engine may pass its own); ours ignore them, and say so."""
    import importlib
    pkg = importlib.import_module(f"{side}_lora")
    with caplog.at_level(logging.WARNING, logger=f"{side}_lora"):
        w = pkg.PunicaWrapper(8, 2, "cpu", max_loras=4, vllm_config=None, backnd="triton")
    assert w.max_loras == 4
    assert "ignores the keyword arguments ['backnd', 'vllm_config']" in caplog.text


@pytest.mark.parametrize("side", ["jax", "torch"])
def test_kernel_meta_takes_vllms_keyword(side):
    """vLLM builds LoRAKernelMeta(..., no_lora_flag_cpu=...)."""
    import importlib
    pkg = importlib.import_module(f"{side}_lora")
    z = np.zeros(3, np.int32)
    if side == "torch":
        import torch
        z = torch.from_numpy(z)
    meta = pkg.LoRAKernelMeta(token_lora_mapping=z, token_indices_sorted_by_lora_ids=z, active_lora_ids=z,
                              num_tokens_per_lora=z, lora_token_start_loc=z, no_lora_flag_cpu=z[:1])
    assert meta.no_lora is meta.no_lora_flag_cpu
    with pytest.raises(TypeError, match="takes the no-LoRA flag once"):
        pkg.LoRAKernelMeta(z, z, z, z, z, z[:1], no_lora_flag_cpu=z[:1])


def test_adapter_slots_refuse_ids_that_are_not_ints():
    """activate(["3"]) took the string as id 3 (both sides' AdapterManager share SlotTable)."""
    from lora_core.adapter_slots import SlotTable
    table = SlotTable(4)
    for ids, shown in ((["3"], "str '3'"), ([1, 2.0], "float 2.0"), ([True], "bool True")):
        with pytest.raises(TypeError, match=r"ids\[\d\] must be an int LoRA id .*got " + shown):
            table.activate(ids)
    with pytest.raises(TypeError, match=r"ids must be an iterable of LoRA ids"):
        table.activate("3")
    assert table.activate([0, None]) == [None] * 4


@pytest.mark.parametrize("impl", REF)
def test_add_inputs_is_a_bool(impl):
    """add_inputs="no" was read by its truth value (True)."""
    w, f, x, y, r = _step(impl)
    b = f(4, 1, 16, r)
    for bad, shown in (("no", "str 'no'"), (None, "NoneType None"), (0.5, "float 0.5"), (2, "int 2")):
        with pytest.raises(TypeError, match=rf"add_inputs must be a bool, got {shown}"):
            w.add_expand(y, f(1, 2, r), (b,), None, (16,), 0, bad)
    got = w.add_expand(y, f(1, 2, r), (b,), None, (16,), 0, np.bool_(False))   # NumPy's bool and 0 / 1 are fine
    assert tuple(got.shape) == (2, 16)


@pytest.mark.parametrize("side", ["jax", "torch"])
def test_ops_add_inputs_is_a_bool(side):
    import importlib
    ops = importlib.import_module(f"{side}_lora.ops")
    if side == "torch":
        import torch
        arr = lambda a: torch.from_numpy(np.asarray(a, np.float32))
        idx = torch.tensor([0, -1], dtype=torch.int32)
    else:
        import jax.numpy as jnp
        arr = lambda a: jnp.asarray(np.asarray(a, np.float32))
        idx = np.array([0, -1], np.int32)
    x, w_b, y = arr(np.ones((2, 4))), arr(np.ones((2, 8, 4))), arr(np.zeros((2, 8)))
    with pytest.raises(TypeError, match=r"add_inputs must be a bool, got str 'no'"):
        ops.bgmv_expand(x, w_b, y, idx, "no")
    with pytest.raises(TypeError, match=r"add_inputs must be a bool, got str 'no'"):
        ops.bgmv_expand_slice(x, w_b, arr(np.zeros((2, 16))), idx, 8, 8, "no")


def test_torch_ops_refuse_wide_unsigned_integers():
    """uint16/32/64 tensors (which torch cannot min/max on the CPU) are refused by name, not a raw
    NotImplementedError."""
    import torch

    import torch_lora
    x, w = torch.ones(4, 8), torch.ones(3, 4, 8)
    u32 = lambda v: torch.tensor(v, dtype=torch.uint32)
    with pytest.raises(TypeError, match=r"lora_ranks must have an integer dtype .*got uint32"):
        torch_lora.ops.bgmv_shrink(x, w, torch.tensor([0, 1, 0, 1], dtype=torch.int32), 1.0,
                                   lora_ranks=u32([4, 2 ** 31 + 1, 4]))
    with pytest.raises(TypeError, match=r"seq_start_locs must have dtype in .*got uint32"):
        torch_lora.ops.sgmv_shrink(x, w, u32([0, 2]), u32([2, 2]), u32([0, 1]), 2, 2, 4, 1.0)
