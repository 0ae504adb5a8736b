"""Audit of the JAX side and the framework-free core against the issue texts (2, 4, 5, 6, 16, 17,
19, 20, 22), written as an outside test author calls the public API (README, docs/*.md, docs/contract.md).

CPU only: the "xla" backend (the jnp reference) for product behaviour, "pallas_tpu" in TPU
interpret mode on single tiny op calls. Several CPU devices come from tests/conftest.py.
Each test's docstring names the issue and the promise it checks.
"""

from __future__ import annotations

import json
import logging
import math
import os
import struct
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jax_lora
from jax_lora import LoRAKernelMeta, LoRAMapping, PunicaWrapper, compute_meta, convert_mapping, ops

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RNG = np.random.default_rng(1234)


# ----------------------------------------------------------------------------- float64 oracles

def _rand(*shape, scale=1.0, dtype=np.float32):
    return (RNG.standard_normal(shape) * scale).astype(dtype)


def shrink_ref(x, a, idx, scale):
    """(T, r) float64: scale * x[t] @ a[idx[t]].T, 0 for idx -1. a: (L, r, H)."""
    x, a = np.asarray(x, np.float64), np.asarray(a, np.float64)
    out = np.zeros((x.shape[0], a.shape[1]))
    for t, i in enumerate(idx):
        if i >= 0:
            out[t] = scale * x[t] @ a[i].T
    return out


def expand_ref(y, buf, b, idx, offset, add_inputs):
    """y with columns offset:offset+n of rows idx >= 0 set to (y if add else 0) + buf[t] @ b[idx].T."""
    y = np.array(y, np.float64)
    buf, b = np.asarray(buf, np.float64), np.asarray(b, np.float64)
    n = b.shape[1]
    for t, i in enumerate(idx):
        if i >= 0:
            base = y[t, offset:offset + n] if add_inputs else 0.0
            y[t, offset:offset + n] = base + buf[t] @ b[i].T
    return y


def rel_err(got, want):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert np.all(np.isfinite(got)), "NaN/Inf in the result"
    denom = max(np.linalg.norm(want), 1e-30)
    return float(np.linalg.norm(got - want) / denom)


def _wrapper(idx_ids, lora_index_to_id, *, prompt=None, prefill=False, capacity=32, backend="xla", vocab=64, **kw):
    w = PunicaWrapper(max_num_batched_tokens=capacity, max_batches=16, device=None,
                      max_loras=len(lora_index_to_id), backend=backend, **kw)
    w.update_metadata(LoRAMapping(tuple(idx_ids), tuple(prompt if prompt is not None else idx_ids), prefill),
                      lora_index_to_id, max_loras=len(lora_index_to_id) + 1, vocab_size=vocab)
    return w


# ============================================================================= issue 2: foundation

def test_convert_mapping_worked_example_spec_section_2():
    """Issue 2: convert_mapping follows contract section 2 (base, sampler, sampler_padded, 2-row
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
    """Issue 22: convert_mapping takes vLLM's order (..., extra_vocab_size, device,
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
    """Issues 2/17/22: a LoRA id in no slot, a duplicate slot id, lora_index_to_id=None and an id of
    2**70 raise a clear ValueError/TypeError naming the entry (contract section 2/6)."""
    with pytest.raises(exc) as e:
        convert_mapping(LoRAMapping(mapping, mapping[:1]), l2i, 3, 10, 0)
    for w in words:
        assert w in str(e.value)


def test_compute_meta_segments():
    """Issue 2: compute_meta merges runs of equal consecutive indices into segments (contract section 2);
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
    """Issue 2: LoRAKernelMeta (contract section 3): stable argsort, active ids ascending with -1 first
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
    """Issue 2: the metadata is built by a jitted function with static shapes: building it inside
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
    """Issues 17/22: JAX prepare_tensors updates the object in place like vLLM (a caller that
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


LORA_INDEX_TO_ID = [1, 2, 3]        # three slots, ids 1..3 in slots 0..2


def _ids_to_slots(ids):
    return [i - 1 if i > 0 else -1 for i in ids]


@pytest.mark.parametrize("add_inputs", [True, False])
def test_ops_shrink_expand_match_float64_oracle(add_inputs):
    """Issue 2: lora_shrink / lora_expand (xla) equal the float64 oracle: unequal slice widths,
    -1 tokens (shrink 0, expand rows untouched), offset_start, add_inputs both ways, float32
    buffer; columns outside the slices untouched."""
    T, H, r, L, widths, off = 6, 16, 4, 3, (5, 3), 2
    idx = np.array([0, -1, 2, 1, -1, 0], np.int32)
    x = _rand(T, H)
    A = [_rand(L, 1, r, H) for _ in widths]
    B = [_rand(L, 1, n, r) for n in widths]
    meta = LoRAKernelMeta.build(idx, max_loras=L)
    buf = ops.lora_shrink(x, A, meta, 0.5, backend="xla")
    assert buf.shape == (2, T, r) and buf.dtype == jnp.float32
    for s in range(2):
        assert rel_err(buf[s], shrink_ref(x, A[s][:, 0], idx, 0.5)) < 1e-5
        assert np.all(np.asarray(buf[s])[idx < 0] == 0)
    y = _rand(T, 12)
    out = ops.lora_expand(buf, B, y, meta, off, add_inputs, backend="xla")
    want = np.array(y, np.float64)
    o = off
    for s, n in enumerate(widths):
        want = expand_ref(want, np.asarray(buf[s]), B[s][:, 0], idx, o, add_inputs)
        o += n
    assert rel_err(out, want) < 1e-5
    np.testing.assert_array_equal(np.asarray(out)[idx < 0], y[idx < 0])
    np.testing.assert_array_equal(np.asarray(out)[:, :off], y[:, :off])
    np.testing.assert_array_equal(np.asarray(out)[:, off + 8:], y[:, off + 8:])


def test_bgmv_and_sgmv_ops_match_oracle_and_each_other():
    """Issue 2: BGMV (one index per token) and SGMV (one index per prefill segment, from
    compute_meta) ops equal the float64 oracle; SGMV equals BGMV on the expanded indices;
    bgmv_expand cuts a LoRA output wider than y (vLLM)."""
    T, H, r, L = 7, 8, 4, 3
    idx = np.array([1, 1, -1, -1, 0, 2, 2], np.int32)
    x, A, B = _rand(T, H), _rand(L, r, H), _rand(L, 10, r)
    s = ops.bgmv_shrink(x, A, idx, 0.25, backend="xla")
    assert rel_err(s, shrink_ref(x, A, idx, 0.25)) < 1e-5
    seg = compute_meta(idx)[:6]
    np.testing.assert_array_equal(ops.sgmv_shrink(x, A, *seg, 0.25, backend="xla"), s)
    y = _rand(T, 16)
    e = ops.bgmv_expand(s, B, y, idx, True, backend="xla")
    assert rel_err(e, expand_ref(y, s, B, idx, 0, True)) < 1e-5
    np.testing.assert_array_equal(ops.sgmv_expand(s, B, y, *seg, True, backend="xla"), e)
    es = ops.bgmv_expand_slice(s, B, y, idx, 3, 10, False, backend="xla")
    assert rel_err(es, expand_ref(y, s, B, idx, 3, False)) < 1e-5
    np.testing.assert_array_equal(ops.sgmv_expand_slice(s, B, y, *seg, 3, 10, False, backend="xla"), es)
    narrow = _rand(T, 6)                                      # n = 10 > N = 6: cut to 6 columns
    cut = ops.bgmv_expand(s, B, narrow, idx, True, backend="xla")
    assert rel_err(cut, expand_ref(narrow, s, B[:, :6], idx, 0, True)) < 1e-5


def test_wrapper_add_lora_linear_with_bias_and_unequal_slices():
    """Issue 2: PunicaWrapper.add_lora_linear = per-slot bias (0 for -1) + shrink + expand over
    unequal slices at their offsets, returning a new y (JAX never mutates y)."""
    ids = (1, 0, 3, 2, 2, 0)
    idx = _ids_to_slots(ids)
    w = _wrapper(ids, LORA_INDEX_TO_ID)
    T, H, r, L, widths = len(ids), 16, 4, 3, (8, 4, 4)
    x, y = _rand(T, H), _rand(T, 20)
    y_before = np.array(y)
    A = [_rand(L, 1, r, H) for _ in widths]
    B = [_rand(L, 1, n, r) for n in widths]
    bias = [_rand(L, n) for n in widths]
    out = w.add_lora_linear(jnp.asarray(y), x, A, B, bias, 0.5, widths)
    want, o = np.array(y, np.float64), 0
    for s, n in enumerate(widths):
        want = expand_ref(want, shrink_ref(x, A[s][:, 0], idx, 0.5), B[s][:, 0], idx, o, True)
        for t, i in enumerate(idx):
            if i >= 0:
                want[t, o:o + n] += bias[s][i]
        o += n
    assert rel_err(out, want) < 1e-5
    np.testing.assert_array_equal(y, y_before)
    np.testing.assert_array_equal(np.asarray(out)[1], y[1])        # no-LoRA rows untouched (no bias)


def test_wrapper_logits_follow_sampler_indices_and_embedding():
    """Issue 2: add_lora_logits routes rows by the sampler indices (prompt_mapping), cutting a wider
    LoRA vocabulary to y; add_lora_embedding adds x @ B[idx].T per token."""
    tokens, prompts = (1, 1, 2, 2, 0), (2, 0, 1)
    w = _wrapper(tokens, LORA_INDEX_TO_ID, prompt=prompts)
    R, H, r, L, V = 3, 8, 4, 3, 12
    h, logits = _rand(R, H), _rand(R, V)
    A, B = _rand(L, r, H), _rand(L, V + 4, r)                 # LoRA vocabulary wider than y
    out = w.add_lora_logits(logits, h, A, B, 2.0)
    sidx = _ids_to_slots(prompts)
    want = expand_ref(logits, shrink_ref(h, A, sidx, 2.0), B[:, :V], sidx, 0, True)
    assert rel_err(out, want) < 1e-5
    tidx = _ids_to_slots(tokens)
    xe, ye, Be = _rand(len(tokens), r), _rand(len(tokens), 6), _rand(L, 6, r)
    emb = w.add_lora_embedding(ye, xe, Be)
    assert rel_err(emb, expand_ref(ye, xe, Be, tidx, 0, True)) < 1e-5


def test_wrapper_add_shrink_add_expand_bias_kept_without_add_inputs():
    """Issue 2 (docs/api.md choices): add_shrink overwrites its buffer (0 for no-LoRA rows);
    add_expand(add_inputs=False) with a bias writes bias + x @ B.T (the bias is not dropped),
    placed at offset_start."""
    ids = (2, 0, 1)
    idx = _ids_to_slots(ids)
    w = _wrapper(ids, LORA_INDEX_TO_ID)
    T, H, r, L = 3, 8, 4, 3
    x, A = _rand(T, H), _rand(L, r, H)
    buf = w.add_shrink(jnp.full((1, T, r), 7.0, jnp.float32), x, [A], 1.5)
    assert rel_err(buf[0], shrink_ref(x, A, idx, 1.5)) < 1e-5
    assert np.all(np.asarray(buf)[0, 1] == 0)
    B, bias = _rand(L, 5, r), _rand(L, 5)
    y = _rand(T, 9)
    out = w.add_expand(y, buf, [B], [bias], (5,), offset_start=np.int64(2), add_inputs=False)
    want = expand_ref(y, np.asarray(buf[0]), B, idx, 2, False)
    for t, i in enumerate(idx):
        if i >= 0:
            want[t, 2:7] += bias[i]
    assert rel_err(out, want) < 1e-5


def test_wrapper_properties_and_prompt_padding():
    """Issue 2: the wrapper's properties (token_lora_indices, sampler indices padded with -1 to
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


def test_wrapper_in_jit_compiles_once_per_bucket_without_host_transfers():
    """Issue 2: the wrapper is a pytree passed into jax.jit; a jitted step compiles once for several
    mappings of the same bucket, runs with no device-to-host transfer, and gives the same result
    as eagerly; a bucket-padded x leaves its padded rows unchanged; inside jit the index properties
    are the fixed-length buffers padded with 0."""
    T, H, r, L = 8, 8, 4, 3
    A, B = [_rand(L, r, H)], [_rand(L, 6, r)]
    traces = []

    @jax.jit
    def step(w, y, x):
        traces.append(1)
        return w.add_lora_linear(y, x, A, B, None, 1.0, (6,))

    for ids in [(1, 2, 0, 3, 1), (3, 3, 3, 0, 0, 2), (0, 0, 0)]:
        w = _wrapper(ids, LORA_INDEX_TO_ID, capacity=16)
        x, y = jnp.asarray(_rand(T, H)), jnp.asarray(_rand(T, 6))    # padded to T = 8 rows
        with jax.transfer_guard_device_to_host("disallow"):
            got = step(w, y, x)
        np.testing.assert_allclose(got, w.add_lora_linear(y, x, A, B, None, 1.0, (6,)), rtol=1e-6, atol=1e-6)
        idx = _ids_to_slots(ids) + [-1] * (T - len(ids))
        assert rel_err(got, expand_ref(y, shrink_ref(x, A[0], idx, 1.0), B[0], idx, 0, True)) < 1e-5
        np.testing.assert_array_equal(np.asarray(got)[len(ids):], np.asarray(y)[len(ids):])
    assert len(traces) == 1
    # inside jit the properties are the fixed-length buffers, padded with 0 (contract section 2)
    tok, emb = jax.jit(lambda w: (w.token_lora_indices, w.embeddings_indices))(w)
    np.testing.assert_array_equal(tok, [-1, -1, -1] + [0] * 13)
    assert emb.shape == (2, 16) and not np.any(np.asarray(emb)[:, 3:])


def test_wrapper_bad_input_errors_name_the_argument():
    """Issue 2 / contract section 6 (and 17, 22): clear ValueError/TypeError naming the argument for mismatched
    hidden size, A/B rank mismatch, len(output_slices) != len(lora_b), a slot past the weights' slots,
    too many tokens, float64 activations, NaN or None scale, a bad backend name or deterministic flag,
    and arrays on another device than the wrapper's index arrays."""
    ids = (1, 3, 0)
    w = _wrapper(ids, LORA_INDEX_TO_ID, capacity=4)
    T, H, r, L = 3, 8, 4, 3
    x, y, A, B = _rand(T, H), _rand(T, 6), [_rand(L, r, H)], [_rand(L, 6, r)]

    def err(exc, *words, **kw):
        args = dict(y=y, x=x, lora_a_stacked=A, lora_b_stacked=B, lora_bias_stacked=None, scale=1.0,
                    output_slices=(6,))
        args.update(kw)
        with pytest.raises(exc) as e:
            w.add_lora_linear(**args)
        msg = str(e.value)
        for word in words:
            assert word in msg, msg

    err(ValueError, "lora_a_stacked", x=_rand(T, H + 1))
    err(ValueError, "rank", lora_b_stacked=[_rand(L, 6, r + 1)])
    err(ValueError, "output_slices", output_slices=(3, 3))
    err(ValueError, "slot", lora_a_stacked=[_rand(2, r, H)], lora_b_stacked=[_rand(2, 6, r)])
    err(ValueError, "max_num_batched_tokens", x=_rand(5, H), y=_rand(5, 6))
    err((TypeError, ValueError), "float64", x=np.zeros((T, H), np.float64))
    err((TypeError, ValueError), "int32", lora_a_stacked=[np.zeros((L, r, H), np.int32)])
    err(TypeError, "scale", scale=None)
    err(ValueError, "scale", scale=float("nan"))
    err((TypeError, ValueError), "output_slices", output_slices=None)
    # committed arrays on another device than the wrapper's (committed) index arrays
    w_dev = PunicaWrapper(4, 4, jax.devices("cpu")[0], max_loras=3, backend="xla")
    w_dev.update_metadata(LoRAMapping(ids, ids), LORA_INDEX_TO_ID, 4, 64)
    with pytest.raises(ValueError) as e:
        w_dev.add_lora_linear(y, jax.device_put(x, jax.devices("cpu")[1]), A, B, None, 1.0, (6,))
    assert "x" in str(e.value) and "index arrays" in str(e.value)
    with pytest.raises(ValueError, match="bogus"):
        PunicaWrapper(4, 4, None, max_loras=2, backend="bogus")
    with pytest.raises(TypeError):
        PunicaWrapper(4, 4, None, max_loras=2, deterministic="yes")
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        w.update_metadata(LoRAMapping((1,) * 5, (1,)), LORA_INDEX_TO_ID, 4, 64)


def test_op_index_checks_on_host_values():
    """Issues 17/22 / contract section 6: host index values >= the slots are refused naming the argument; int64
    indices outside int32 are refused (never wrapped to another slot); a negative host lora_ranks
    entry is refused naming its slot."""
    x, A = _rand(2, 8), _rand(3, 4, 8)
    with pytest.raises(ValueError, match="lora_indices_tensor|index|slot"):
        ops.bgmv_shrink(x, A, np.array([0, 3], np.int32), backend="xla")
    with pytest.raises(ValueError, match="int32|2147483647|4294967297"):
        ops.bgmv_shrink(x, A, np.array([0, 2**32 + 1], np.int64), backend="xla")
    meta = LoRAKernelMeta.build(np.array([0, 1], np.int32), max_loras=3)
    with pytest.raises(ValueError, match="slot 1|\\[1\\]"):
        ops.lora_shrink(x, [A], meta, 1.0, backend="xla", lora_ranks=np.array([4, -1, 4], np.int32))


# ============================================================================= issue 17: NaN stays in its slot

def test_nan_in_unused_slot_never_reaches_other_rows_xla():
    """Issue 17 item 1: a NaN/Inf in a slot no token uses (A, B and bias) leaves every other row
    finite and equal to the oracle on "xla", for linear, logits and embedding; add_shrink writes 0
    (not NaN) on no-LoRA rows; NaN in an expand buffer's no-LoRA row or in a LoRA vocabulary past
    y's width changes nothing."""
    ids = (1, 0, 2, 1)                       # slots 0 and 1 used, slot 2 poisoned
    idx = _ids_to_slots(ids)
    w = _wrapper(ids, LORA_INDEX_TO_ID)
    T, H, r, L, N = 4, 8, 4, 3, 6
    x, y = _rand(T, H), _rand(T, N)
    A, B, bias = _rand(L, r, H), _rand(L, N, r), _rand(L, N)
    A[2, 0, 0], B[2, 1, 1], bias[2, 3] = np.nan, np.inf, np.nan
    out = w.add_lora_linear(y, x, [A], [B], [bias], 1.0, (N,))
    want = expand_ref(y, shrink_ref(x, A, idx, 1.0), B, idx, 0, True)
    for t, i in enumerate(idx):
        if i >= 0:
            want[t] += bias[i]
    assert rel_err(out, want) < 1e-5
    buf = w.add_shrink(jnp.zeros((1, T, r), jnp.float32), x, [A], 1.0)
    assert np.all(np.asarray(buf)[0, 1] == 0)
    logits = w.add_lora_logits(y, x, A, B, 1.0)
    assert rel_err(logits, expand_ref(y, shrink_ref(x, A, idx, 1.0), B, idx, 0, True)) < 1e-5
    emb = w.add_lora_embedding(y, _rand(T, r), B)
    assert np.all(np.isfinite(np.asarray(emb)))
    nan_buf = np.asarray(buf).copy()
    nan_buf[0, 1] = np.nan                                   # an expand buffer's no-LoRA row
    np.testing.assert_array_equal(np.asarray(w.add_expand(y, nan_buf, [B], None, (N,)))[1], y[1])
    wide = np.concatenate([B, np.full((L, 3, r), np.nan, np.float32)], axis=1)   # vocabulary past y
    assert np.all(np.isfinite(np.asarray(w.add_lora_logits(y, x, A, wide, 1.0))))


def test_rank_padding_with_nan_is_ignored_xla():
    """Issue 17 item 2: with lora_ranks, values past a slot's rank (NaN here) are ignored on "xla":
    the result equals the computation with the padding zeroed; heterogeneous ranks, -1 tokens."""
    T, H, r, L, N = 4, 16, 8, 3, 12
    idx = np.array([0, 2, -1, 1], np.int32)
    ranks = np.array([3, 8, 5], np.int32)
    x, y = _rand(T, H), _rand(T, N)
    A, B = _rand(L, r, H, scale=0.2), _rand(L, N, r, scale=0.2)
    A0, B0 = A.copy(), B.copy()
    for s, k in enumerate(ranks):
        A[s, k:], B[s, :, k:] = np.nan, np.nan
        A0[s, k:], B0[s, :, k:] = 0, 0
    meta = LoRAKernelMeta.build(idx, max_loras=L)
    buf = ops.lora_shrink(x, [A], meta, 1.0, backend="xla", lora_ranks=ranks)
    assert rel_err(buf[0], shrink_ref(x, A0, idx, 1.0)) < 1e-5
    out = ops.lora_expand(buf, [B], y, meta, 0, True, backend="xla", lora_ranks=ranks)
    assert rel_err(out, expand_ref(y, shrink_ref(x, A0, idx, 1.0), B0, idx, 0, True)) < 1e-5
    np.testing.assert_array_equal(np.asarray(out)[2], y[2])


def test_pallas_tpu_bf16_slices_ranks_and_nan_padding_match_oracle():
    """Issues 4/17: the Pallas TPU kernels (backend="pallas_tpu", TPU interpret mode on the CPU)
    compute lora_shrink / lora_expand within bf16 tolerance (2e-2) of the float64 oracle: two
    slices, -1 tokens untouched, heterogeneous lora_ranks with NaN in the rank padding ignored."""
    T, H, r, L, N = 3, 128, 16, 2, 128
    idx = np.array([1, -1, 0], np.int32)
    ranks = np.array([5, 16], np.int32)
    f = lambda a: np.asarray(a, np.float32)
    x, y = _rand(T, H).astype(jnp.bfloat16), _rand(T, 2 * N).astype(jnp.bfloat16)
    A = [_rand(L, r, H, scale=0.1).astype(jnp.bfloat16) for _ in range(2)]
    B = [_rand(L, N, r, scale=0.1).astype(jnp.bfloat16) for _ in range(2)]
    A0, B0 = [f(a) for a in A], [f(b) for b in B]
    for s in range(2):
        A[s][0, 5:], B[s][0, :, 5:] = np.nan, np.nan
        A0[s][0, 5:], B0[s][0, :, 5:] = 0, 0
    meta = LoRAKernelMeta.build(idx, max_loras=L)
    buf = ops.lora_shrink(x, A, meta, 1.0, backend="pallas_tpu", lora_ranks=ranks)
    out = ops.lora_expand(buf, B, y, meta, 0, True, backend="pallas_tpu", lora_ranks=ranks)
    want = f(y)
    for s in range(2):
        sb = shrink_ref(f(x), A0[s], idx, 1.0)
        assert rel_err(buf[s], sb) < 2e-2
        want = expand_ref(want, sb, B0[s], idx, N * s, True)
    assert out.dtype == jnp.bfloat16
    assert rel_err(f(out), want) < 2e-2
    np.testing.assert_array_equal(f(out)[1], f(y)[1])


def test_tpu_block_shape_rule_checker():
    """Issue 4 item 2: the TPU block-shape checker accepts blocks whose last two dims are multiples
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
    """Issue 17: pallas_tpu with rank-0 weights is a clear ValueError naming the argument (was a
    ZeroDivisionError); docs/api.md: pallas_tpu needs rank >= 1."""
    meta = LoRAKernelMeta.build(np.array([0], np.int32), max_loras=2)
    with pytest.raises(ValueError, match="lora_a_stacked"):
        ops.lora_shrink(_rand(1, 128), [np.zeros((2, 0, 128), np.float32)], meta, 1.0, backend="pallas_tpu")


# ============================================================================= issue 19: seed methods, determinism, DoRA

def test_seed_shrink_expand_expand_slice_methods():
    """Issue 19 item 3: vLLM's TPU wrapper's wrapper methods shrink(x, w_t_all, scale), expand(y, x,
    w_t_all, add_inputs) (cut to y's width) and expand_slice(y, x, w_t_all, y_offset,
    y_slice_size, add_inputs) use the step's token indices; rows past the mapped tokens are "no
    LoRA"; y_slice_size must equal w_t_all's n."""
    ids = (2, 0, 1)
    idx = _ids_to_slots(ids) + [-1]                       # x has one row past the mapping
    w = _wrapper(ids, LORA_INDEX_TO_ID)
    T, H, r, L = 4, 8, 4, 3
    x, A = _rand(T, H), _rand(L, 1, r, H)
    s = w.shrink(x, A, 0.5)
    assert s.shape == (T, r) and s.dtype == jnp.float32
    assert rel_err(s, shrink_ref(x, A[:, 0], idx, 0.5)) < 1e-5
    B, y = _rand(L, 9, r), _rand(T, 7)                    # n = 9 > N = 7: cut
    e = w.expand(y, s, B, True)
    assert rel_err(e, expand_ref(y, s, B[:, :7], idx, 0, True)) < 1e-5
    Bs, y2 = _rand(L, 3, r), _rand(T, 10)
    es = w.expand_slice(y2, s, Bs, 4, 3, False)
    assert rel_err(es, expand_ref(y2, s, Bs, idx, 4, False)) < 1e-5
    np.testing.assert_array_equal(np.asarray(es)[3], y2[3])
    with pytest.raises(ValueError):
        w.expand_slice(y2, s, Bs, 4, 4, False)


def test_seed_methods_refuse_float64_host_arrays():
    """Issue 17 ("JAX silently downcasts float64") / docs/api.md "Nothing is changed in silence":
    host float64 activations and weights are refused at every public entry, vLLM's wrapper
    methods shrink / expand / expand_slice included."""
    w = _wrapper((1, 0), LORA_INDEX_TO_ID)
    x64, A = np.ones((2, 8), np.float64), _rand(3, 4, 8)
    with pytest.raises((TypeError, ValueError), match="float64"):
        w.shrink(x64, A, 1.0)
    with pytest.raises((TypeError, ValueError), match="float64"):
        w.shrink(_rand(2, 8), A.astype(np.float64), 1.0)
    with pytest.raises((TypeError, ValueError), match="float64"):
        w.expand(_rand(2, 6), np.ones((2, 4), np.float64), _rand(3, 6, 4), True)
    with pytest.raises((TypeError, ValueError), match="float64"):
        w.expand_slice(np.ones((2, 6), np.float64), _rand(2, 4), _rand(3, 2, 4), 0, 2, True)


def test_deterministic_wrapper_rows_are_bitwise_batch_invariant():
    """Issue 19 item 1: PunicaWrapper(deterministic=True): a token's add_lora_linear row is bitwise
    the same whatever the batch size, its position and its neighbours' adapters (xla, under jit:
    one program per bucket size)."""
    H, r, L, N = 32, 8, 3, 16
    A, B = [_rand(L, r, H)], [_rand(L, N, r)]
    probe = _rand(1, H)
    step = jax.jit(lambda w, y, x: w.add_lora_linear(y, x, A, B, None, 0.5, (N,)))
    rows = []
    for size, pos in [(1, 0), (6, 4)]:
        ids = list(RNG.integers(0, 4, size))
        ids[pos] = 2
        x = _rand(size, H)
        x[pos] = probe[0]
        w = _wrapper(ids, LORA_INDEX_TO_ID, capacity=16, deterministic=True)
        assert w.deterministic is True
        rows.append(np.asarray(step(w, np.zeros((size, N), np.float32), x))[pos])
    np.testing.assert_array_equal(rows[1], rows[0])


def test_dora_column_scale_formula_and_wrapper_epilogue():
    """Issue 19 item 2: lora_core.dora.column_scale is g = m / ||W + s B A||_row; the wrapper's
    add_lora_linear(dora_scale_stacked=) gives a slot's tokens g[idx] * (y + delta) and leaves rows
    without adapter untouched; a slice with both a LoRA bias and a DoRA scale is refused naming
    both."""
    from lora_core.dora import column_scale
    W, a, b, m = _rand(6, 5), _rand(2, 5), _rand(6, 2), np.abs(_rand(6)) + 0.5
    g = column_scale(W, a, b, 0.7, m)
    np.testing.assert_allclose(g, m / np.linalg.norm(W.astype(np.float64) + 0.7 * b @ a, axis=1), rtol=1e-6)
    ids = (1, 0, 3, 1)
    idx = _ids_to_slots(ids)
    w = _wrapper(ids, LORA_INDEX_TO_ID)
    T, H, r, L, widths = 4, 8, 4, 3, (6, 4)
    x, y = _rand(T, H), _rand(T, 10)
    A = [_rand(L, r, H) for _ in widths]
    Bw = [_rand(L, n, r) for n in widths]
    G = [np.abs(_rand(L, n)) + 0.5 for n in widths]
    out = w.add_lora_linear(y, x, A, Bw, None, 1.0, widths, dora_scale_stacked=G)
    want, o = np.array(y, np.float64), 0
    for s, n in enumerate(widths):
        want = expand_ref(want, shrink_ref(x, A[s], idx, 1.0), Bw[s], idx, o, True)
        for t, i in enumerate(idx):
            if i >= 0:
                want[t, o:o + n] *= G[s][i]
        o += n
    assert rel_err(out, want) < 1e-5
    np.testing.assert_array_equal(np.asarray(out)[1], y[1])
    with pytest.raises(ValueError) as e:
        w.add_lora_linear(y, x, A, Bw, [_rand(L, 6), None], 1.0, widths, dora_scale_stacked=G)
    assert "lora_bias_stacked[0]" in str(e.value) and "dora_scale_stacked[0]" in str(e.value)


def test_pallas_tpu_dora_epilogue_through_the_wrapper():
    """Issue 19 item 2 ("the per-slot column scale belongs in the expand's epilogue (all
    backends)"): pallas_tpu (TPU interpret mode) applies DoRA column scales through
    add_lora_linear, equal to the float64 oracle."""
    ids = (1, 0, 2)
    idx = _ids_to_slots(ids)
    w = _wrapper(ids, LORA_INDEX_TO_ID, backend="pallas_tpu")
    T, H, r, L, N = 3, 128, 8, 3, 128
    x, y = _rand(T, H), _rand(T, N)
    A, B, G = _rand(L, r, H, scale=0.2), _rand(L, N, r, scale=0.2), np.abs(_rand(L, N)) + 0.5
    out = w.add_lora_linear(y, x, [A], [B], None, 1.0, (N,), dora_scale_stacked=[G])
    want = expand_ref(y, shrink_ref(x, A, idx, 1.0), B, idx, 0, True)
    for t, i in enumerate(idx):
        if i >= 0:
            want[t] *= G[i]
    assert rel_err(out, want) < 1e-5


# ============================================================================= issues 6/17/22: PEFT files (lora_core.peft)

from lora_core import peft as core_peft  # noqa: E402
from lora_core.peft import AdapterError  # noqa: E402


def _write_adapter(path, config: dict, tensors: dict):
    from safetensors.numpy import save_file
    os.makedirs(path, exist_ok=True)
    save_file({k: np.ascontiguousarray(v, np.float32) for k, v in tensors.items()},
              os.path.join(path, "adapter_model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump(config, f)
    return str(path)


def _plain_config(**kw):
    cfg = {"peft_type": "LORA", "r": 2, "lora_alpha": 4, "target_modules": ["q_proj"]}
    cfg.update(kw)
    return cfg


def _q_tensors(r=2, module="model.layers.0.self_attn.q_proj", i=8, o=8):
    return {f"base_model.model.{module}.lora_A.weight": _rand(r, i),
            f"base_model.model.{module}.lora_B.weight": _rand(o, r)}


def test_peft_scaling_rslora_rank_and_alpha_patterns(tmp_path):
    """Issues 6/17: load_peft_adapter reads r, lora_alpha (PEFT's default 8 when absent), use_rslora
    (alpha / sqrt(r)), rank_pattern / alpha_pattern per module, as float32 NumPy factors."""
    t = {**_q_tensors(4), **_q_tensors(2, "model.layers.0.self_attn.v_proj")}
    d = _write_adapter(tmp_path / "a", _plain_config(r=4, lora_alpha=16, target_modules=["q_proj", "v_proj"],
                                                     rank_pattern={"v_proj": 2}, alpha_pattern={"v_proj": 3}), t)
    ad = core_peft.load_peft_adapter(d)
    q, v = ad.modules["model.layers.0.self_attn.q_proj"], ad.modules["model.layers.0.self_attn.v_proj"]
    assert q.lora_a.dtype == np.float32 and q.lora_a.shape == (4, 8) and q.lora_b.shape == (8, 4)
    assert math.isclose(q.scaling, 16 / 4) and math.isclose(v.scaling, 3 / 2)
    cfg = _plain_config(r=4, use_rslora=True)
    cfg.pop("lora_alpha")
    d2 = _write_adapter(tmp_path / "b", cfg, _q_tensors(4))
    assert math.isclose(core_peft.load_peft_adapter(d2).modules["model.layers.0.self_attn.q_proj"].scaling,
                        8 / math.sqrt(4))
    d3 = _write_adapter(tmp_path / "c", _plain_config(lora_dropout=0.1, task_type="CAUSAL_LM",
                                                      init_lora_weights="gaussian"), _q_tensors())
    core_peft.load_peft_adapter(d3)                       # metadata fields are accepted


@pytest.mark.parametrize("field, value", [
    ("alora_invocation_tokens", [32001, 32002]),
    ("lora_bias", True),
    ("modules_to_save", ["lm_head"]),
    ("init_lora_weights", "pissa"),
    ("some_future_field", 1),
    ("r", 0),
])
def test_peft_fields_that_change_the_math_are_refused(tmp_path, field, value):
    """Issue 17 item 5: an allowlist of PEFT fields: aLoRA, LoRA bias, modules_to_save, PiSSA init, an
    unknown field and r=0 raise AdapterError (a ValueError) naming the file and the field."""
    d = _write_adapter(tmp_path / "a", _plain_config(**{field: value}), _q_tensors())
    with pytest.raises(AdapterError) as e:
        core_peft.load_peft_adapter(d)
    assert isinstance(e.value, ValueError)
    assert "adapter_config.json" in str(e.value) and field in str(e.value)


def test_peft_bad_files_fail_cleanly(tmp_path):
    """Issue 17: malformed or list-shaped adapter_config.json, a config without r, a truncated /
    empty / garbage / huge-header safetensors, tensors of a module the config does not target, a
    pickle-only adapter and a safetensors symlinked outside the directory all raise AdapterError
    naming the file (or field)."""
    good = _write_adapter(tmp_path / "good", _plain_config(), _q_tensors())
    weights = os.path.join(good, "adapter_model.safetensors")
    data = open(weights, "rb").read()

    def case(name, config_text=None, weights_bytes=None, tensors=None, config=None):
        d = tmp_path / name
        d.mkdir()
        (d / "adapter_config.json").write_text(config_text if config_text is not None else
                                               json.dumps(config or _plain_config()))
        if tensors is not None:
            _write_adapter(d, config or _plain_config(), tensors)
        elif weights_bytes is not None:
            (d / "adapter_model.safetensors").write_bytes(weights_bytes)
        return str(d)

    bad = {
        "malformed": (case("malformed", config_text="{r: 2"), "adapter_config.json"),
        "list": (case("list", config_text="[1, 2]"), "adapter_config.json"),
        "truncated": (case("truncated", weights_bytes=data[:-5]), "adapter_model.safetensors"),
        "empty": (case("empty", weights_bytes=b""), "adapter_model.safetensors"),
        "huge": (case("huge", weights_bytes=struct.pack("<Q", 2**40) + b"{}"), "adapter_model.safetensors"),
        "untargeted": (case("untargeted", tensors={**_q_tensors(), **_q_tensors(2, "model.layers.0.mlp.up_proj")}),
                       "up_proj"),
        "garbage": (case("garbage", weights_bytes=b"\x10\x00\x00\x00\x00\x00\x00\x00not json at all!"),
                    "adapter_model.safetensors"),
        "missing-r": (case("missing_r", config={"peft_type": "LORA", "lora_alpha": 4, "target_modules": ["q_proj"]}),
                      "'r'"),
    }
    pickle_dir = tmp_path / "pickle"
    pickle_dir.mkdir()
    (pickle_dir / "adapter_config.json").write_text(json.dumps(_plain_config()))
    (pickle_dir / "adapter_model.bin").write_bytes(b"\x80\x04not really")
    bad["pickle"] = (str(pickle_dir), "safe_serialization")
    link_dir = tmp_path / "link"
    link_dir.mkdir()
    (link_dir / "adapter_config.json").write_text(json.dumps(_plain_config()))
    os.symlink(weights, link_dir / "adapter_model.safetensors")
    bad["symlink"] = (str(link_dir), "adapter_model.safetensors")
    for name, (d, word) in bad.items():
        with pytest.raises(AdapterError) as e:
            core_peft.load_peft_adapter(d)
        assert word in str(e.value), (name, str(e.value))


def test_adapter_names_are_reexported_from_jax_lora_adapters():
    """Issue 16 item 7 / docs/flax.md: jax_lora.adapters re-exports lora_core.peft's
    load_peft_adapter, save_peft_adapter, PeftAdapter and AdapterError (the same objects), and
    jax_lora.LoRAMapping is lora_core's one LoRAMapping class."""
    from jax_lora import adapters
    for name in ("load_peft_adapter", "save_peft_adapter", "PeftAdapter", "AdapterError"):
        assert getattr(adapters, name) is getattr(core_peft, name)
    import lora_core
    assert jax_lora.LoRAMapping is lora_core.LoRAMapping
    for mod in ("ops", "nn", "adapters", "models", "serving", "parallel"):
        assert hasattr(jax_lora, mod)


# ============================================================================= issue 6: model, adapters, serving

from jax_lora import nn as lnn  # noqa: E402
from jax_lora.adapters import AdapterManager, load_peft_adapter, merge_adapter, save_peft_adapter  # noqa: E402
from jax_lora.models import LlamaConfig, add_lora, load_llama, save_llama  # noqa: E402
from jax_lora.serving import Request, ServingEngine  # noqa: E402

CFG = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=64)
SHAPES = {"self_attn.q_proj": (32, 32), "self_attn.k_proj": (32, 16), "self_attn.v_proj": (32, 16),
          "self_attn.o_proj": (32, 32), "mlp.gate_proj": (32, 64), "mlp.up_proj": (32, 64),
          "mlp.down_proj": (64, 32)}


def _modules(names, r, scale=0.3, embed=False, head=False):
    out = {}
    for layer in range(CFG.num_hidden_layers):
        for n in names:
            i, o = SHAPES[n]
            out[f"model.layers.{layer}.{n}"] = (_rand(r, i, scale=scale), _rand(o, r, scale=scale))
    if embed:
        out["model.embed_tokens"] = (_rand(r, CFG.vocab_size, scale=scale), _rand(CFG.hidden_size, r, scale=scale))
    if head:
        out["lm_head"] = (_rand(r, CFG.hidden_size, scale=scale), _rand(CFG.vocab_size, r, scale=scale))
    return out


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    """A tiny random Llama written in Hugging Face format (config.json + model.safetensors) and three
    PEFT adapters of different ranks."""
    from safetensors.numpy import save_file
    root = tmp_path_factory.mktemp("audit_assets")
    os.makedirs(root / "model")
    c = CFG
    weights = {"model.embed_tokens.weight": _rand(c.vocab_size, c.hidden_size),
               "model.norm.weight": 1 + _rand(c.hidden_size, scale=0.1),
               "lm_head.weight": _rand(c.vocab_size, c.hidden_size, scale=0.2)}
    for i in range(c.num_hidden_layers):
        for n, (fan_in, fan_out) in SHAPES.items():                  # Hugging Face layout: (out, in)
            weights[f"model.layers.{i}.{n}.weight"] = _rand(fan_out, fan_in, scale=fan_in ** -0.5)
        for n in ("input_layernorm", "post_attention_layernorm"):
            weights[f"model.layers.{i}.{n}.weight"] = 1 + _rand(c.hidden_size, scale=0.1)
    save_file(weights, str(root / "model" / "model.safetensors"))
    (root / "model" / "config.json").write_text(json.dumps(c.to_dict()))
    save_peft_adapter(str(root / "a1"), _modules(["self_attn.q_proj", "self_attn.v_proj"], 4), r=4, lora_alpha=8)
    save_peft_adapter(str(root / "a2"), _modules(["self_attn.o_proj", "mlp.down_proj", "mlp.gate_proj"], 8,
                                                 embed=True, head=True), r=8, lora_alpha=16, use_rslora=True)
    save_peft_adapter(str(root / "a3"), _modules(["self_attn.k_proj", "mlp.up_proj"], 2), r=2, lora_alpha=2)
    return {"root": root, "model": str(root / "model"), **{k: str(root / k) for k in ("a1", "a2", "a3")}}


_ORACLE: dict = {}
ORACLE_LEN = 16


def _merged_logits(assets, adapter_dir, tokens):
    """The oracle: the base checkpoint with `adapter_dir` merged into its weights (float64 merge),
    run on `tokens` padded to ORACLE_LEN (causal: the padding never reaches earlier positions)."""
    if adapter_dir not in _ORACLE:
        base = load_llama(assets["model"])
        model = base if adapter_dir is None else merge_adapter(base, load_peft_adapter(adapter_dir))
        graphdef, state = nnx.split(model)
        if "forward" not in _ORACLE:
            pos = np.arange(ORACLE_LEN, dtype=np.int32)[None]
            _ORACLE["forward"] = jax.jit(lambda st, t: nnx.merge(graphdef, st)(t, pos)[0][0])
        _ORACLE[adapter_dir] = state
    t = np.zeros((1, ORACLE_LEN), np.int32)
    t[0, :len(tokens)] = tokens
    return np.asarray(_ORACLE["forward"](_ORACLE[adapter_dir], t), np.float64)[:len(tokens)]


def test_llama_checkpoint_round_trip_and_host_range_checks(assets, tmp_path):
    """Issues 6/22: load_llama / save_llama round-trip a Hugging Face-format checkpoint (same
    logits); token ids outside [0, vocab) and sample_idx outside [0, S) held on the host are
    refused naming the argument, and clamped (finite logits, no NaN) under jax.jit."""
    model = load_llama(assets["model"])
    save_llama(model, str(tmp_path / "again"))
    again = load_llama(str(tmp_path / "again"))
    for a, b in zip(jax.tree.leaves(nnx.state(model)), jax.tree.leaves(nnx.state(again))):
        np.testing.assert_array_equal(a, b)
    tok, pos = np.array([[1, 5, 9]], np.int32), np.arange(3, dtype=np.int32)[None]
    with pytest.raises(ValueError, match="tokens"):
        model(np.array([[1, 64]], np.int32), pos[:, :2])
    with pytest.raises(ValueError, match="sample_idx"):
        model(tok, pos, sample_idx=np.array([3], np.int32))
    tokens = np.array([1, 999, 3] + [0] * (ORACLE_LEN - 3), np.int32)
    logits = _merged_logits(assets, None, tokens)         # jitted: the id 999 is clamped, not NaN
    assert np.all(np.isfinite(logits))
    np.testing.assert_array_equal(logits, _merged_logits(assets, None, np.where(tokens == 999, 63, tokens)))


def test_add_lora_and_replace_lora_layers_refuse_typos(assets):
    """Issues 6/22: add_lora(target_modules="q_proj") (a string) is a TypeError, not read letter by
    letter; unknown names are a ValueError; replace_lora_layers raises when nothing matches, and
    replaces a list-named layer (last path part) and an lm_head (as MultiLoRALogits) in place."""
    model = load_llama(assets["model"])
    with pytest.raises(TypeError):
        add_lora(model, max_loras=2, max_rank=4, target_modules="q_proj")
    with pytest.raises(ValueError, match="qproj"):
        add_lora(model, max_loras=2, max_rank=4, target_modules=["qproj"])

    class Tiny(nnx.Module):
        def __init__(self):
            self.proj = nnx.Linear(8, 8, rngs=nnx.Rngs(0))
            self.lm_head = nnx.Linear(8, 16, rngs=nnx.Rngs(1))

    tiny = Tiny()
    with pytest.raises(ValueError):
        lnn.replace_lora_layers(tiny, ["porj"], max_loras=2, max_rank=2)
    new = lnn.replace_lora_layers(tiny, ["proj", "lm_head"], max_loras=2, max_rank=2)
    assert set(new) == {"proj", "lm_head"}
    assert isinstance(tiny.proj, lnn.MultiLoRALinear) and isinstance(tiny.lm_head, lnn.MultiLoRALogits)
    x = _rand(3, 8)
    np.testing.assert_array_equal(tiny.proj(x), tiny.proj.base(x))          # no wrapper: base only


@pytest.fixture(scope="module")
def engine(assets):
    model = load_llama(assets["model"])
    add_lora(model, max_loras=2, max_rank=8)
    mgr = AdapterManager(model, host_cache_size=1)
    for i in (1, 2, 3):
        mgr.register(i, assets[f"a{i}"])
    return ServingEngine(model, mgr, max_seqs=4, max_len=32, keep_logits=True)


def _check_against_merged(assets, completions, dirs):
    for c in completions:
        seq = list(c.prompt) + list(c.tokens)
        want = _merged_logits(assets, dirs[c.lora_id or 0], seq)[len(c.prompt) - 1:len(seq) - 1]
        assert rel_err(c.logits, want) < 1e-4, c.request_id
        assert list(np.argmax(want, axis=-1)) == list(c.tokens), c.request_id


def test_serving_mixed_adapters_lru_and_hot_swap_without_recompiling(assets, engine):
    """Issue 6 items 1-4: the jit continuous-batching loop serves requests naming different PEFT
    adapters (ranks 4 / 8 rsLoRA with embed_tokens and lm_head / 2, or none) with 2 slots for 3
    adapters (LRU swaps), each request equal to the model with its adapter merged (logits 1e-4,
    greedy tokens); the manager writes each slot's real rank per layer; once the buckets are warm,
    more batches, LRU evictions and a hot swap (register an id again) compile nothing; the hot swap
    keeps the slot; NaN/Inf left in the KV cache rows never reach a new request (row hygiene)."""
    dirs = {0: None, 1: assets["a1"], 2: assets["a2"], 3: assets["a3"]}
    reqs = [Request([1, 2, 3], 1, 3), Request([4, 5], None, 3), Request([7, 8, 9, 10], 2, 3),
            Request([11, 3], 3, 2), Request([9, 9, 9], 1, 2)]
    out = engine.generate(reqs)
    assert [c.request_id for c in out] == list(range(5))
    _check_against_merged(assets, out, dirs)
    warm = engine.compile_count
    mgr = engine.adapters
    ranks = {p: np.asarray(layer.lora_ranks.get_value()) for p, layer in mgr.layers.items()}
    for lora_id, path, rank in [(1, "model.layers.0.self_attn.qkv_proj", 4), (2, "lm_head", 8),
                                (2, "model.embed_tokens", 8), (2, "model.layers.0.self_attn.qkv_proj", 0)]:
        if mgr.slot_of(lora_id) is not None:                  # per-slot, per-layer real ranks
            assert ranks[path][mgr.slot_of(lora_id)] == rank, (lora_id, path)
    out2 = engine.generate([Request([5, 6], 3, 2), Request([2, 2, 2], 2, 2), Request([8], 1, 2)])
    _check_against_merged(assets, out2, dirs)
    assert mgr.stats["evictions"] > 0
    slot = mgr.slot_of(1)
    if slot is None:
        slot = mgr.load(1)
    mgr.register(1, assets["a3"])                    # hot swap: id 1 now serves a3's weights
    assert mgr.slot_of(1) == slot
    out3 = engine.generate([Request([1, 2, 3], 1, 2)])
    _check_against_merged(assets, out3, {1: assets["a3"]})
    mgr.register(1, assets["a1"])
    # row hygiene: NaN / Inf an earlier request left in the KV cache never reach a new request
    from jax_lora.models import KVCache
    engine.cache = KVCache(tuple(jnp.full_like(k, jnp.nan) for k in engine.cache.k),
                           tuple(jnp.full_like(v, jnp.inf) for v in engine.cache.v))
    _check_against_merged(assets, engine.generate([Request([4, 4, 1], 2, 2), Request([6], None, 2)]), dirs)
    assert engine.compile_count == warm


def test_serving_request_checks(engine):
    """Issues 6/22: requests are checked before anything runs (TypeError/ValueError naming the
    request and field): empty prompt, token out of vocab, unregistered adapter, bool max_new_tokens,
    two requests with one request_id; an engine without adapters refuses a request naming one;
    prefill steps use vLLM's bucketed shapes."""
    cases = [
        ([Request([], 1, 2)], ValueError, "request 0"),
        ([Request([1, 64], None, 2)], ValueError, "request 0"),
        ([Request([1], 9, 2)], ValueError, "9"),
        ([Request([1], None, True)], TypeError, "max_new_tokens"),
        ([Request([1], None, 2, request_id="a"), Request([2], None, 2, request_id="a")], ValueError, "request_id"),
        ([Request([1], None, 2), Request([2], None, 2, request_id=0)], ValueError, "request_id"),
    ]
    for reqs, exc, word in cases:
        with pytest.raises(exc) as e:
            engine.generate(reqs)
        assert word in str(e.value)
    # bucketed prefill shapes: rows max(next_pow2(n), 8) capped at max_seqs = 4, length
    # max(16, next_pow2(longest prompt))
    assert engine.prefill_shape(1, 3) == (4, 16) and engine.prefill_shape(3, 17) == (4, 32)
    bare = ServingEngine(engine.model, None, max_seqs=2, max_len=16)
    with pytest.raises(ValueError, match="adapter"):
        bare.generate([Request([1, 2], 1, 1)])


def test_adapter_manager_failed_reload_changes_nothing(assets, tmp_path):
    """Issue 17 item 6: with the host cache too small, an adapter whose files changed since
    registration fails to reload inside activate() with an AdapterError (naming the adapter as
    registered and its directory) and leaves slots, weights and the LRU order as they were: the
    next activation evicts the least recently used adapter, as if the failure never happened."""
    import shutil
    model = load_llama(assets["model"])
    add_lora(model, max_loras=2, max_rank=8)
    mgr = AdapterManager(model, host_cache_size=1)
    d3 = str(tmp_path / "a3")
    shutil.copytree(assets["a3"], d3)
    mgr.register(1, assets["a1"])
    mgr.register(2, assets["a2"])
    mgr.register(3, d3, name="my-third")
    mgr.activate([1])
    mgr.activate([2])                                 # LRU order: 1 then 2
    before = [np.asarray(v) for v in jax.tree.leaves(nnx.state(model, lnn.LoRAWeight))]
    slots = list(mgr.lora_index_to_id)
    with open(os.path.join(d3, "adapter_model.safetensors"), "ab") as f:
        f.write(b"garbage")
    with pytest.raises(AdapterError) as e:
        mgr.activate([3])
    assert "my-third" in str(e.value) and d3 in str(e.value)
    assert mgr.lora_index_to_id == slots
    after = [np.asarray(v) for v in jax.tree.leaves(nnx.state(model, lnn.LoRAWeight))]
    assert all(np.array_equal(a, b) for a, b in zip(before, after))
    mgr.register(3, assets["a3"], name="my-third")   # register again: the new files
    mgr.activate([3])
    assert mgr.slot_of(1) is None and mgr.slot_of(2) is not None and mgr.slot_of(3) is not None
    mgr.activate([2, 3])
    with pytest.raises(ValueError):
        mgr.activate([1, 2, 3])                       # more adapters than slots
    mgr.unload(3)
    assert mgr.slot_of(3) is None and mgr.slot_ranks[mgr.lora_index_to_id.index(None)] == 0


def test_adapter_rank_above_max_rank_names_module(assets, tmp_path):
    """Issue 6 item 2: shapes are validated against the model with clear errors: an adapter whose
    rank exceeds the model's max_rank raises AdapterError naming the module and the ranks."""
    model = load_llama(assets["model"])
    add_lora(model, max_loras=2, max_rank=2)
    mgr = AdapterManager(model)
    with pytest.raises(AdapterError) as e:
        mgr.register(1, assets["a1"])
    assert "q_proj" in str(e.value) and "4" in str(e.value)
    assert mgr.registered == {}


def _dora_adapter(assets, path):
    """A PEFT use_dora adapter on q_proj and down_proj of the tiny Llama (rank 4, magnitudes)."""
    mods = _modules(["self_attn.q_proj", "mlp.down_proj"], 4)
    tensors = {}
    for m, (a, b) in mods.items():
        tensors[f"base_model.model.{m}.lora_A.weight"] = a
        tensors[f"base_model.model.{m}.lora_B.weight"] = b
        tensors[f"base_model.model.{m}.lora_magnitude_vector"] = RNG.uniform(0.5, 2.0, b.shape[0])
    cfg = _plain_config(r=4, lora_alpha=8, use_dora=True, target_modules=["q_proj", "down_proj"])
    return _write_adapter(path, cfg, tensors)


def test_dora_and_lora_adapters_mixed_in_one_batch_equal_merged(assets, tmp_path):
    """Issue 19 item 2: a PEFT use_dora adapter (magnitude vectors) loads, and in one batch of the
    Flax Llama (add_lora(dora=True)) DoRA, plain LoRA and no-adapter rows each equal the model with
    that row's adapter merged (DoRA: rows of W' rescaled to m / ||W'||), float32 1e-4."""
    d = _dora_adapter(assets, tmp_path / "dora")
    ad = load_peft_adapter(d)
    assert set(ad.magnitudes) == {m for m in ad.modules}
    model = load_llama(assets["model"])
    add_lora(model, max_loras=2, max_rank=4, target_modules=["q_proj", "v_proj", "down_proj"], dora=True)
    mgr = AdapterManager(model)
    mgr.register(1, d)
    mgr.register(2, assets["a1"])
    mgr.activate([1, 2])
    S = 5
    tokens = RNG.integers(0, CFG.vocab_size, (3, S)).astype(np.int32)
    row_ids = [1, 2, 0]
    token_ids = tuple(int(i) for i in np.repeat(row_ids, S))
    w = PunicaWrapper(16, 8, None, max_loras=2, backend="xla")
    w.update_metadata(LoRAMapping(token_ids, token_ids), mgr.lora_index_to_id, 3, CFG.vocab_size)
    graphdef, state = nnx.split(model)

    @jax.jit
    def forward(state, w, tokens):
        with lnn.punica_context(w):
            return nnx.merge(graphdef, state)(tokens, jnp.broadcast_to(jnp.arange(S), tokens.shape))[0]

    got = np.asarray(forward(state, w, tokens))
    for b, lora in enumerate(row_ids):
        want = _merged_logits(assets, {0: None, 1: d, 2: assets["a1"]}[lora], tokens[b])
        assert rel_err(got[b], want) < 1e-4, lora


# ============================================================================= issue 20: tensor parallelism on CPU devices

from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P

from jax_lora import parallel  # noqa: E402

# Meshes of host CPU devices (tests/conftest.py forces 8). On a GPU machine JAX's default backend
# is the GPU, with one device here, and XLA's CPU compiler crashed on these shard_map programs
# (tests/test_parallel.py): skipped there; multi-GPU meshes are tested apart.
_CPU_MESHES = pytest.mark.skipif(jax.default_backend() != "cpu",
                                 reason="CPU-device meshes; JAX's default backend here is not the CPU")

TP_IDS = (1, 0, 3, 2, 1)


def _tp_layer(kind, L=3, r=4):
    rngs = nnx.Rngs(5)
    if kind == "column":
        layer = lnn.MultiLoRALinear(nnx.Linear(16, 16, rngs=rngs), max_loras=L, max_rank=r, output_slices=(8, 4, 4))
        layer.lora_a.set_value(jnp.asarray(_rand(3, L, r, 16, scale=0.3)))
    elif kind == "row":
        layer = lnn.MultiLoRALinear(nnx.Linear(16, 8, rngs=rngs), max_loras=L, max_rank=r)
        layer.lora_a.set_value(jnp.asarray(_rand(1, L, r, 16, scale=0.3)))
    elif kind == "embed":
        layer = lnn.MultiLoRAEmbed(nnx.Embed(16, 8, rngs=rngs), max_loras=L, max_rank=r)
        layer.lora_a.set_value(jnp.asarray(_rand(L, 16, r, scale=0.3)))
    else:
        layer = lnn.MultiLoRALogits(nnx.Linear(8, 16, rngs=rngs), max_loras=L, max_rank=r)
        layer.lora_a.set_value(jnp.asarray(_rand(L, r, 8, scale=0.3)))
    layer.lora_b.set_value(jnp.asarray(_rand(*layer.lora_b.get_value().shape, scale=0.3)))
    layer.lora_ranks.set_value(jnp.asarray([4, 1, 2], jnp.int32))         # heterogeneous ranks
    return layer


@pytest.mark.parametrize("kind, layout", [("column", "column"), ("column", "column_gather"), ("row", "row_reduce"),
                                          ("row", "row_partial"), ("embed", "vocab"), ("logits", "column_gather")])
@_CPU_MESHES
def test_sharded_layer_equals_unsharded(kind, layout):
    """Issue 20 item 1: on 2 CPU devices every layout (column with unequal q/k/v slices,
    column_gather = fully sharded, row_reduce = psum of the small buffer, row_partial, vocab-parallel
    embedding, logits) equals the unsharded layer: mixed adapters, no-LoRA rows, heterogeneous
    ranks; the wrapper's index arrays replicated with NamedSharding(mesh, P())."""
    layer = _tp_layer(kind)
    x = RNG.integers(0, 16, (len(TP_IDS),)).astype(np.int32) if kind == "embed" else \
        _rand(len(TP_IDS), 8 if kind == "logits" else 16)
    w = _wrapper(TP_IDS, LORA_INDEX_TO_ID, capacity=8, vocab=16)      # the embedding's vocabulary
    want = np.asarray(layer(x, punica=w))
    mesh = Mesh(np.array(jax.devices()[:2]), ("tp",))
    parallel.shard_layer(layer, mesh, kind=kind, layout=layout)
    wm = PunicaWrapper(8, 8, NamedSharding(mesh, P()), max_loras=3, backend="xla")
    wm.update_metadata(LoRAMapping(TP_IDS, TP_IDS), LORA_INDEX_TO_ID, 4, 16)
    graphdef, state = nnx.split(layer)
    got = jax.jit(lambda s, w, x: nnx.merge(graphdef, s)(x, punica=w))(state, wm, x)
    if kind == "column":
        got = jnp.concatenate(parallel.split_fused(got, (8, 4, 4), 2), axis=-1)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)


@_CPU_MESHES
def test_shard_layer_refusals_and_byte_model():
    """Issue 20: shard_layer refuses sizes that do not split (a ValueError naming the sizes and the
    device count) and a DoRA layer (by name); choose_layout picks column_gather over column exactly
    when 4 T < a w H, and row_reduce over row_partial exactly when 8 S T < a w N (docs/parallel.md)."""
    mesh = Mesh(np.array(jax.devices()[:2]), ("tp",))
    odd = lnn.MultiLoRALinear(nnx.Linear(8, 9, rngs=nnx.Rngs(0)), max_loras=2, max_rank=2, output_slices=(4, 5))
    with pytest.raises(ValueError) as e:
        parallel.shard_layer(odd, mesh, kind="column", layout="column")
    assert "(4, 5)" in str(e.value) and "2" in str(e.value)
    dora = lnn.MultiLoRALinear(nnx.Linear(8, 8, rngs=nnx.Rngs(0)), max_loras=2, max_rank=2, dora=True)
    with pytest.raises(ValueError, match="DoRA"):
        parallel.shard_layer(dora, mesh, kind="column")
    common = dict(slices=(4096,), rank=16, shards=8, itemsize=2)
    assert parallel.choose_layout("column", tokens=8, active=4, in_features=4096, **common) == "column_gather"
    assert parallel.choose_layout("column", tokens=2047, active=1, in_features=4096, **common) == "column_gather"
    # 4 T == a w H: a tie keeps the layout without a collective
    assert parallel.choose_layout("column", tokens=2048, active=1, in_features=4096, **common) == "column"
    assert parallel.choose_layout("column", tokens=2049, active=1, in_features=4096, **common) == "column"
    assert parallel.choose_layout("row", tokens=8, active=4, in_features=4096, **common) == "row_reduce"
    assert parallel.choose_layout("row", tokens=1024, active=1, in_features=4096, **common) == "row_partial"


@_CPU_MESHES
def test_adapter_slots_of_a_split_model_keep_their_sharding(assets):
    """Issue 20 item 3: the adapter manager writes each device's shard of a split layer: after
    activating adapters on a model split over 2 devices, a column-parallel layer's B keeps its
    NamedSharding (rows split) and holds the adapter's weights in the layer's stored column order."""
    mesh = Mesh(np.array(jax.devices()[:2]), ("tp",))
    model = load_llama(assets["model"], mesh=mesh)
    add_lora(model, max_loras=2, max_rank=8, target_modules=["q_proj", "v_proj"])
    layer = model.model.layers[0].self_attn.qkv_proj
    sharding = layer.lora_b.get_value().sharding
    mgr = AdapterManager(model)
    mgr.register(1, assets["a1"])
    mgr.activate([1])
    b = layer.lora_b.get_value()
    assert b.sharding.is_equivalent_to(sharding, b.ndim)
    assert b.sharding.shard_shape(b.shape)[1] == b.shape[1] // 2
    stored = np.asarray(b)[mgr.slot_of(1)]                       # (out, r), shard-major columns
    natural = parallel.natural_columns(stored, layer.output_slices, 2, axis=0)
    ad = load_peft_adapter(assets["a1"])
    q = ad.modules["model.layers.0.self_attn.q_proj"]
    np.testing.assert_allclose(natural[:32, :4], q.lora_b * q.scaling, rtol=1e-6)
    np.testing.assert_array_equal(natural[32:48], 0)               # k has no adapter


# ============================================================================= issues 6/17: the jax-lora CLI

from jax_lora import cli  # noqa: E402


@pytest.mark.parametrize("argv, word", [(["demo", "--max-seqs", "0"], "--max-seqs"),
                                        (["demo", "--backend", "bogus"], "--backend"),
                                        (["demo", "--dtype", "int8"], "--dtype")])
def test_cli_bad_options_exit_2_with_argparse_message(argv, word, capsys):
    """Issue 17: bad demo options (counts that are not positive, unknown backend or dtype) exit with
    status 2 and argparse's message, no traceback."""
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert word in err and "Traceback" not in err


@_CPU_MESHES
def test_demo_with_model_and_adapter_directories_verifies(assets, capsys):
    """Issue 6 item 5 (the main job, with arguments) and issue 20 (`--tp N`): `jax-lora demo MODEL_DIR
    ADAPTER_DIR... --tp 2` serves mixed-adapter requests (some without adapter) through the jit loop
    split over 2 CPU devices, here with one slot for two adapters (LRU swapping), reports no
    recompilation after warm-up, prints tokens/s and the LoRA overhead, and ends with
    `verified: N/N requests match merged-weights outputs`, exit status 0."""
    rc = cli.main(["demo", assets["model"], assets["a1"], assets["a2"], "--num-requests", "3",
                   "--max-new-tokens", "2", "--max-seqs", "2", "--slots", "1", "--tp", "2"])
    out = capsys.readouterr().out
    assert rc == 0, out
    lines = out.strip().splitlines()
    assert lines[-1] == "verified: 3/3 requests match merged-weights outputs"
    assert "recompilations after warm-up: 0" in out and "LoRA overhead" in out and "tokens/s" in out
    assert "tensor parallel: 2 devices" in out


def test_cli_version(capsys):
    """Issue 17: `jax-lora --version` prints the version and exits 0."""
    with pytest.raises(SystemExit) as e:
        cli.main(["--version"])
    assert e.value.code == 0
    assert jax_lora.__version__ in capsys.readouterr().out


def test_cli_bad_directories_and_adapters_one_line_exit_2(assets, tmp_path, capsys):
    """Issues 6/17: `jax-lora demo MODEL_DIR ADAPTER_DIR` with an adapter that cannot be loaded (an
    aLoRA field), a missing directory, no adapter after MODEL_DIR, or --prompt with a MODEL_DIR that
    has no tokenizer exits 2 with one line `jax-lora demo: error: <what and why>`, no traceback."""
    bad = _write_adapter(tmp_path / "alora", _plain_config(alora_invocation_tokens=[5]), _q_tensors(
        2, "model.layers.0.self_attn.q_proj", 32, 32))
    for argv, word in [([assets["model"], bad], "alora_invocation_tokens"),
                       ([assets["model"], str(tmp_path / "missing")], "missing"),
                       ([assets["model"]], "adapter"),
                       ([assets["model"], assets["a1"], "--prompt", "hi"], "tokenizer")]:
        assert cli.main(["demo", *argv]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("jax-lora demo: error:") and word in err[0], err


# ============================================================================= issues 16/17: packages, logging (fresh interpreter)

def test_core_imports_no_framework_and_jax_side_no_torch_and_logs_backend():
    """Issue 16 item 1: lora_core (host mapping, checks, PEFT reading, slots, DoRA, registry) imports
    neither JAX nor torch; using jax_lora (wrapper, ops, nn, adapters, serving) loads no torch and no
    torch_lora. Issue 17: the backend chosen is said on the `jax_lora` logger with the reason, and a
    forced Triton backend on a CPU without TRITON_INTERPRET=1 is a clear error saying so."""
    code = textwrap.dedent("""
        import logging, sys
        import lora_core, lora_core.host_mapping, lora_core.checks, lora_core.peft, lora_core.adapter_slots
        import lora_core.dora, lora_core.backend_registry
        bad = [m for m in ("jax", "torch", "jax_lora", "torch_lora", "flax") if m in sys.modules]
        assert not bad, bad
        logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="%(name)s %(message)s")
        import numpy as np
        import jax_lora, jax_lora.nn, jax_lora.adapters, jax_lora.serving
        from jax_lora import LoRAMapping, PunicaWrapper
        w = PunicaWrapper(4, 4, None, max_loras=2)
        w.update_metadata(LoRAMapping((1, 0), (1, 0)), [1, None], 3, 10)
        w.add_lora_linear(np.zeros((2, 4), np.float32), np.ones((2, 8), np.float32),
                          [np.ones((2, 2, 8), np.float32)], [np.ones((2, 4, 2), np.float32)], None, 1.0, (4,))
        bad = [m for m in ("torch", "torch_lora") if m in sys.modules]
        assert not bad, bad
        try:
            jax_lora.ops.bgmv_shrink(np.ones((1, 8), np.float32), np.ones((2, 2, 8), np.float32),
                                     np.zeros(1, np.int32), backend="triton")
        except Exception as e:
            print("TRITON-ERROR", type(e).__name__, e)
        print("DONE")
    """)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["JAX_PLATFORMS"] = "cpu"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, env=env,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = proc.stdout
    assert "DONE" in out
    assert any(line.startswith("jax_lora ") and "'xla'" in line and "cpu" in line for line in out.splitlines()), out
    triton = [line for line in out.splitlines() if line.startswith("TRITON-ERROR")]
    assert triton and "TRITON_INTERPRET=1" in triton[0], out


def test_core_backend_registry_says_fallbacks_with_the_reason(caplog):
    """Issue 17: nothing falls back in silence: the shared registry warns once, on the side's
    logger, which backend could not run where, what runs instead, and why."""
    from lora_core.backend_registry import BackendRegistry
    reg = BackendRegistry({"a": "lora_core.checks", "b": "lora_core.dora"}, "jax_lora")
    with caplog.at_level(logging.INFO, logger="jax_lora"):
        assert reg.fallback("a", "b", "tpu", RuntimeError("no libtpu")) == "b"
        reg.fallback("a", "b", "tpu", RuntimeError("no libtpu"))
    warnings = [r for r in caplog.records if r.name == "jax_lora" and r.levelno == logging.WARNING]
    assert len(warnings) == 1
    msg = warnings[0].getMessage()
    assert "'a'" in msg and "'b'" in msg and "tpu" in msg and "no libtpu" in msg
    with pytest.raises(ValueError, match="'zzz'"):
        reg.load("zzz")


# ============================================================================= issues 5/17: the bridge, JAX direction

def test_bridge_to_jax_zero_copy_and_refusals():
    """Issue 5 item 1 (and 17 item 3): bridge.to_jax / to_torch share CPU memory (pointer identity)
    for float32 and bfloat16; what cannot be shared without a copy (a strided view, a tensor that
    requires grad, int64 without x64) raises CopyRequiredError (a ValueError) unless copy=True;
    int64 is converted to int32 explicitly, and int64 values outside int32 are refused even with
    copy=True (never wrapped); a tracer given to to_torch is a TypeError."""
    torch = pytest.importorskip("torch")
    import bridge
    for dtype in (torch.float32, torch.bfloat16):
        t = torch.randn(8, 16).to(dtype)
        a = bridge.to_jax(t)
        assert a.unsafe_buffer_pointer() == t.data_ptr() and a.shape == (8, 16)
        assert bridge.to_torch(a).data_ptr() == t.data_ptr()
    t = torch.randn(8, 16)
    for bad in (t[:, ::2], torch.ones(4, requires_grad=True), torch.tensor([1, 2], dtype=torch.int64)):
        with pytest.raises(bridge.CopyRequiredError):
            bridge.to_jax(bad)
    assert issubclass(bridge.CopyRequiredError, ValueError)
    np.testing.assert_array_equal(bridge.to_jax(t[:, ::2], copy=True), t[:, ::2].numpy())
    ints = bridge.to_jax(torch.tensor([1, -1, 7], dtype=torch.int64), copy=True)
    assert ints.dtype == jnp.int32
    np.testing.assert_array_equal(ints, [1, -1, 7])
    with pytest.raises(ValueError):
        bridge.to_jax(torch.tensor([2**32 + 1], dtype=torch.int64), copy=True)
    with pytest.raises(TypeError):
        jax.jit(lambda a: bridge.to_torch(a))(jnp.ones(2))


def test_bridge_jax_api_over_torch_kernels_equals_native():
    """Issue 5 item 2: bridge.JaxPunicaWrapper (JAX API, torch_lora kernels) returns a new y equal to
    jax_lora's native wrapper (xla) for add_lora_linear, never mutates its inputs, leaves rows past
    the mapping unchanged, and refuses traced arguments (outside jit only) with a TypeError."""
    pytest.importorskip("torch")
    import bridge
    ids = (1, 0, 3)
    jw = bridge.JaxPunicaWrapper(8, 8, None, max_loras=3)
    jw.update_metadata(LoRAMapping(ids, ids), LORA_INDEX_TO_ID, 4, 64)
    native = _wrapper(ids, LORA_INDEX_TO_ID, capacity=8)
    T, H, r, L = 5, 8, 4, 3                                   # two rows past the mapping
    x, y = jnp.asarray(_rand(T, H)), jnp.asarray(_rand(T, 6))
    y_copy = np.array(y)
    A, B = [jnp.asarray(_rand(L, r, H))], [jnp.asarray(_rand(L, 6, r))]
    got = jw.add_lora_linear(y, x, A, B, None, 0.5, (6,))
    want = native.add_lora_linear(y, x, A, B, None, 0.5, (6,))
    assert isinstance(got, jax.Array)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(np.asarray(y), y_copy)
    np.testing.assert_array_equal(np.asarray(got)[3:], y_copy[3:])
    with pytest.raises(TypeError):
        jax.jit(lambda y, x: jw.add_lora_linear(y, x, A, B, None, 0.5, (6,)))(y, x)
