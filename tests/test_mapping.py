"""LoRAMapping to index arrays and kernel metadata (contract sections 2-3), as a caller meets them.

`convert_mapping` (worked example, vLLM's argument order, unknown or duplicate ids refused naming
them), `compute_meta`'s prefill segments, `LoRAKernelMeta` (fields, `meta_args` order, built under
jit with static shapes, `prepare_tensors` in place, int64 ids out of range), the wrapper's index
properties with the prompt-mapping padding; JAX and torch. CPU only; the worked values as exact
tests are in tests/test_worked_examples.py, the metadata against vLLM's algorithm in
tests/test_contract_api.py.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import jax_lora
import torch_lora
from jax_lora import LoRAKernelMeta, LoRAMapping, PunicaWrapper, compute_meta, convert_mapping


def test_convert_mapping_worked_example():
    """convert_mapping follows contract section 2 (base, sampler, sampler_padded, 2-row
    embeddings with extra_vocab_size, long-LoRA offsets, indices_len), int32 jax arrays."""
    m = LoRAMapping(index_mapping=(1, 1, 0, 2), prompt_mapping=(1, 0, 2))
    ctx = jax_lora.LongContextLoRAContext({1: 5, 2: 7})
    base, sampler, padded, emb, long_, lens = convert_mapping(m, [1, 2, None, None], 5, 100, 10, ctx)
    for a in (base, sampler, padded, emb, long_):
        assert isinstance(a, jax.Array) and a.dtype == jnp.int32
    np.testing.assert_array_equal(base, [0, 0, -1, 1])
    np.testing.assert_array_equal(sampler, [0, -1, 1])
    # p = [0, max_loras - 1 = 4, 1], n = 3: j + p * n
    np.testing.assert_array_equal(padded, [0, 1 + 4 * 3, 2 + 1 * 3])
    np.testing.assert_array_equal(emb, [[0, 0, 0, 10], [0, 0, 0, 110]])
    np.testing.assert_array_equal(long_, [5, 5, 0, 7])
    assert list(lens) == [4, 3, 3, 4, 4]
    # without a long-LoRA context: None, and None in indices_len
    out = convert_mapping(m, [1, 2, None, None], 5, 100, 10)
    assert out[4] is None and out[5][4] is None


def test_convert_mapping_vllm_argument_order_and_platform_string():
    """convert_mapping takes vLLM's order (..., extra_vocab_size, device,
    long_lora_context) with a platform string as the device, same results."""
    m = LoRAMapping((2, 0, 1), (2, 1))
    ctx = jax_lora.LongContextLoRAContext({1: 3})
    ours = convert_mapping(m, [1, 2], 3, 50, 0, ctx)
    vllm = convert_mapping(m, [1, 2], 3, 50, 0, "cpu", ctx)
    for a, b in zip(ours[:5], vllm[:5]):
        np.testing.assert_array_equal(a, b)
    assert ours[5] == vllm[5]


@pytest.mark.parametrize("l2i, mapping, exc, words", [
    ([1, None], (1, 3), ValueError, ["3"]),                     # id in no slot: named, never -1
    ([1, 1], (1,), ValueError, ["1", "twice"]),                 # duplicate id in the slot list
    (None, (1,), TypeError, ["lora_index_to_id"]),              # not a sequence
    ([1, None], (1, 2**70), ValueError, [str(2**70)]),          # beyond int64
])
def test_convert_mapping_bad_ids_raise_naming_them(l2i, mapping, exc, words):
    """A LoRA id in no slot, a duplicate slot id, lora_index_to_id=None and an id of
    2**70 raise a clear ValueError/TypeError naming the entry (contract section 2/6)."""
    with pytest.raises(exc) as e:
        convert_mapping(LoRAMapping(mapping, mapping[:1]), l2i, 3, 10, 0)
    for w in words:
        assert w in str(e.value)


def test_compute_meta_segments():
    """compute_meta merges runs of equal consecutive indices into segments (contract section 2);
    no_lora only when the single segment is -1; an empty input gives zero segments, no_lora True."""
    starts, lengths, loras, b, max_len, tok, no_lora = compute_meta(np.array([0, 0, 1, 1, 1, -1, 0], np.int32))
    np.testing.assert_array_equal(starts, [0, 2, 5, 6])
    np.testing.assert_array_equal(lengths, [2, 3, 1, 1])
    np.testing.assert_array_equal(loras, [0, 1, -1, 0])
    assert (b, max_len, tok, bool(no_lora)) == (4, 3, 7, False)
    assert bool(compute_meta(np.array([-1, -1], np.int32))[-1]) is True
    empty = compute_meta(np.zeros(0, np.int32))
    assert empty[3] == 0 and bool(empty[-1]) is True


def test_kernel_meta_fields_and_meta_args_order():
    """LoRAKernelMeta (contract section 3): stable argsort, active ids ascending with -1 first
    padded with -1 to max_loras+1, counts padded with 0, start_loc [0, cumsum] then 0 (length
    max_loras+2), no_lora a device scalar; meta_args(T) in vLLM's order."""
    m = np.array([2, -1, 0, 2, 0], np.int32)
    meta = LoRAKernelMeta.build(m, max_loras=4, max_num_tokens=8)
    np.testing.assert_array_equal(meta.token_lora_mapping[:5], m)
    np.testing.assert_array_equal(meta.token_indices_sorted_by_lora_ids[:5], np.argsort(m, kind="stable"))
    np.testing.assert_array_equal(meta.active_lora_ids, [-1, 0, 2, -1, -1])
    np.testing.assert_array_equal(meta.num_tokens_per_lora, [1, 2, 2, 0, 0])
    np.testing.assert_array_equal(meta.lora_token_start_loc, [0, 1, 3, 5, 0, 0])
    assert isinstance(meta.no_lora, jax.Array) and meta.no_lora.shape == () and not bool(meta.no_lora)
    args = meta.meta_args(5)
    assert len(args) == 6
    np.testing.assert_array_equal(args[0], m)
    np.testing.assert_array_equal(args[1], np.argsort(m, kind="stable"))
    np.testing.assert_array_equal(args[2], meta.num_tokens_per_lora)
    np.testing.assert_array_equal(args[3], meta.lora_token_start_loc)
    np.testing.assert_array_equal(args[4], meta.active_lora_ids)
    assert args[5] is meta.no_lora
    assert bool(LoRAKernelMeta.build(np.full(3, -1, np.int32), max_loras=2).no_lora)


def test_kernel_meta_is_built_under_jit_with_static_shapes():
    """The metadata is built by a jitted function with static shapes: building it inside
    jax.jit from a traced mapping gives the same arrays as outside, one compilation for two
    mappings of one capacity."""
    traces = []

    @jax.jit
    def build(m):
        traces.append(1)
        return LoRAKernelMeta.build(m, max_loras=3)

    for m in (np.array([1, -1, 1, 0], np.int32), np.array([2, 2, -1, -1], np.int32)):
        inside = build(m)
        outside = LoRAKernelMeta.build(m, max_loras=3)
        for f in ("token_lora_mapping", "token_indices_sorted_by_lora_ids", "active_lora_ids",
                  "num_tokens_per_lora", "lora_token_start_loc", "no_lora"):
            np.testing.assert_array_equal(getattr(inside, f), getattr(outside, f))
    assert len(traces) == 1


def test_prepare_tensors_updates_in_place_and_int64_out_of_range_is_never_slot_1():
    """JAX prepare_tensors updates the object in place like vLLM (a caller that
    ignores the result sees the new mapping); an int64 slot 2**32+1 never becomes slot 1: a host
    value is refused (contract section 6), a traced one is -1."""
    meta = LoRAKernelMeta.make(max_loras=3, max_num_tokens=4, device="cpu")
    assert bool(meta.no_lora)
    meta.prepare_tensors(np.array([1, 0, 1, -1], np.int32))
    np.testing.assert_array_equal(meta.token_lora_mapping, [1, 0, 1, -1])
    assert not bool(meta.no_lora_flag_cpu)
    with pytest.raises(ValueError, match=r"token_lora_mapping holds slot 4294967297"):
        LoRAKernelMeta.build(np.array([2**32 + 1, 0], np.int64), max_loras=3)
    traced = jax.jit(lambda m: LoRAKernelMeta.build(m, max_loras=3))(np.array([7, 0], np.int32))
    np.testing.assert_array_equal(traced.token_lora_mapping, [-1, 0])


def test_wrapper_properties_and_prompt_padding():
    """The wrapper's properties (token_lora_indices, sampler indices padded with -1 to
    max(next_pow2(R), 8), sampler_indices_padded j + p*R_padded, embeddings_indices,
    long_lora_indices, prefill_metadata for prefill mappings only)."""
    w = PunicaWrapper(32, 8, None, max_loras=3, backend="xla")
    w.update_metadata(LoRAMapping((1, 1, 0, 3, 3, 3), (1, 0, 3), is_prefill=True), [1, None, 3], 4, 100,
                      extra_vocab_size=2, long_lora_context=jax_lora.LongContextLoRAContext({3: 9}))
    np.testing.assert_array_equal(w.token_lora_indices, [0, 0, -1, 2, 2, 2])
    np.testing.assert_array_equal(w.sampler_indices, [0, -1, 2, -1, -1, -1, -1, -1])
    p = np.array([0, 3, 2, 3, 3, 3, 3, 3])
    np.testing.assert_array_equal(w.sampler_indices_padded, np.arange(8) + p * 8)
    np.testing.assert_array_equal(w.embeddings_indices, [[0, 0, 0, 4, 4, 4], [0, 0, 0, 204, 204, 204]])
    np.testing.assert_array_equal(w.long_lora_indices, [0, 0, 0, 9, 9, 9])
    starts, lengths, loras, b, max_len, tok = w.prefill_metadata
    np.testing.assert_array_equal(starts, [0, 2, 3])
    np.testing.assert_array_equal(lengths, [2, 1, 3])
    np.testing.assert_array_equal(loras, [0, -1, 2])
    assert (b, max_len, tok) == (3, 3, 6)
    w.update_metadata(LoRAMapping((1, 0), (1, 0), is_prefill=False), [1, None, 3], 4, 100)
    assert w.prefill_metadata[3] == 0                       # a decode step has no segments


def test_convert_mapping_worked_values_and_unknown_id():
    """Contract section 2: base/sampler indices, sampler_indices_padded = j + p_j * n (-1 -> max_loras - 1),
    embeddings_indices rows; an id in no slot raises a ValueError naming the id."""
    m = LoRAMapping((3, 0, 5), (5, 0))
    base, sampler, padded, emb, long_idx, lens = torch_lora.convert_mapping(m, [5, 3, None], 4, 100, 2)
    assert base.tolist() == [1, -1, 0]
    assert sampler.tolist() == [0, -1]
    assert padded.tolist() == [0 + 0 * 2, 1 + 3 * 2]
    assert emb.tolist() == [[2, 0, 0], [102, 0, 0]]
    assert long_idx is None
    assert base.dtype == torch.int32
    with pytest.raises(ValueError, match="7"):
        torch_lora.convert_mapping(LoRAMapping((7,), (7,)), [5, 3], 3, 100, 0)


def test_kernel_meta_worked_example():
    """Contract section 3: LoRAKernelMeta.make / prepare_tensors: sorted token order (stable),
    active ids ascending (-1 first) padded with -1, counts, start locations, no_lora flag."""
    meta = torch_lora.LoRAKernelMeta.make(3, 8, "cpu")
    meta.prepare_tensors(torch.tensor([1, -1, 0, 1, -1], dtype=torch.int32))
    mapping, order, counts, starts, active, no_lora = meta.meta_args(5)
    assert mapping.tolist() == [1, -1, 0, 1, -1]
    assert order.tolist() == [1, 4, 2, 0, 3]
    assert active.tolist() == [-1, 0, 1, -1]
    assert counts.tolist() == [2, 1, 2, 0]
    assert starts.tolist()[:4] == [0, 2, 3, 5]
    assert bool(no_lora.reshape(-1)[0]) is False
    meta.prepare_tensors(torch.tensor([-1, -1], dtype=torch.int32))
    assert bool(meta.meta_args(2)[5].reshape(-1)[0]) is True
