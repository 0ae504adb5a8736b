"""The op functions as a caller uses them (contract section 5), against float64 oracles.

JAX: lora_shrink / lora_expand with add_inputs both ways, BGMV and SGMV equal to the oracle and to each
other. torch: the ops take vLLM's argument order, and the wrapper's prefill_metadata feeds SGMV, which
equals BGMV. Reference backends on the CPU; every implementation on the same cases is
tests/test_conformance.py.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
import torch

import torch_lora
from jax_lora import LoRAKernelMeta, compute_meta, ops
from torch_lora import LoRAMapping, PunicaWrapper

from . import jax_helpers, torch_helpers


@pytest.mark.parametrize("add_inputs", [True, False])
def test_ops_shrink_expand_match_float64_oracle(add_inputs):
    """lora_shrink / lora_expand (xla) equal the float64 oracle: unequal slice widths,
    -1 tokens (shrink 0, expand rows untouched), offset_start, add_inputs both ways, float32
    buffer; columns outside the slices untouched."""
    T, H, r, L, widths, off = 6, 16, 4, 3, (5, 3), 2
    idx = np.array([0, -1, 2, 1, -1, 0], np.int32)
    x = jax_helpers.rand(T, H)
    A = [jax_helpers.rand(L, 1, r, H) for _ in widths]
    B = [jax_helpers.rand(L, 1, n, r) for n in widths]
    meta = LoRAKernelMeta.build(idx, max_loras=L)
    buf = ops.lora_shrink(x, A, meta, 0.5, backend="xla")
    assert buf.shape == (2, T, r) and buf.dtype == jnp.float32
    for s in range(2):
        assert jax_helpers.rel_err(buf[s], jax_helpers.shrink_ref(x, A[s][:, 0], idx, 0.5)) < 1e-5
        assert np.all(np.asarray(buf[s])[idx < 0] == 0)
    y = jax_helpers.rand(T, 12)
    out = ops.lora_expand(buf, B, y, meta, off, add_inputs, backend="xla")
    want = np.array(y, np.float64)
    o = off
    for s, n in enumerate(widths):
        want = jax_helpers.expand_ref(want, np.asarray(buf[s]), B[s][:, 0], idx, o, add_inputs)
        o += n
    assert jax_helpers.rel_err(out, want) < 1e-5
    np.testing.assert_array_equal(np.asarray(out)[idx < 0], y[idx < 0])
    np.testing.assert_array_equal(np.asarray(out)[:, :off], y[:, :off])
    np.testing.assert_array_equal(np.asarray(out)[:, off + 8:], y[:, off + 8:])


def test_bgmv_and_sgmv_ops_match_oracle_and_each_other():
    """BGMV (one index per token) and SGMV (one index per prefill segment, from
    compute_meta) ops equal the float64 oracle; SGMV equals BGMV on the expanded indices;
    bgmv_expand cuts a LoRA output wider than y (vLLM)."""
    T, H, r, L = 7, 8, 4, 3
    idx = np.array([1, 1, -1, -1, 0, 2, 2], np.int32)
    x, A, B = jax_helpers.rand(T, H), jax_helpers.rand(L, r, H), jax_helpers.rand(L, 10, r)
    s = ops.bgmv_shrink(x, A, idx, 0.25, backend="xla")
    assert jax_helpers.rel_err(s, jax_helpers.shrink_ref(x, A, idx, 0.25)) < 1e-5
    seg = compute_meta(idx)[:6]
    np.testing.assert_array_equal(ops.sgmv_shrink(x, A, *seg, 0.25, backend="xla"), s)
    y = jax_helpers.rand(T, 16)
    e = ops.bgmv_expand(s, B, y, idx, True, backend="xla")
    assert jax_helpers.rel_err(e, jax_helpers.expand_ref(y, s, B, idx, 0, True)) < 1e-5
    np.testing.assert_array_equal(ops.sgmv_expand(s, B, y, *seg, True, backend="xla"), e)
    es = ops.bgmv_expand_slice(s, B, y, idx, 3, 10, False, backend="xla")
    assert jax_helpers.rel_err(es, jax_helpers.expand_ref(y, s, B, idx, 3, False)) < 1e-5
    np.testing.assert_array_equal(ops.sgmv_expand_slice(s, B, y, *seg, 3, 10, False, backend="xla"), es)
    narrow = jax_helpers.rand(T, 6)                                      # n = 10 > N = 6: cut to 6 columns
    cut = ops.bgmv_expand(s, B, narrow, idx, True, backend="xla")
    assert jax_helpers.rel_err(cut, jax_helpers.expand_ref(narrow, s, B[:, :6], idx, 0, True)) < 1e-5


def test_ops_take_vllms_argument_order():
    """Contract section 8: torch_lora.ops.lora_shrink(x, lora_a, y, *meta.meta_args(T), scale) and
    lora_expand(x, lora_b, y, *meta.meta_args(T), offset_start=..., add_inputs=...) write into y."""
    rng = torch_helpers.rng(2)
    a, b = torch_helpers.stacked(rng, 2, 4, 8, (5,))
    x = torch.tensor(rng.standard_normal((4, 8)), dtype=torch.float32)
    meta = torch_lora.LoRAKernelMeta.make(2, 16, "cpu")
    idx = torch.tensor([1, -1, 0, 1], dtype=torch.int32)
    meta.prepare_tensors(idx)
    buf = torch.full((1, 4, 4), 7.0)
    torch_lora.ops.lora_shrink(x, a, buf, *meta.meta_args(4), 2.0, backend="torch")
    A = a[0][:, 0].double().numpy()
    for t, i in enumerate(idx.tolist()):
        want = np.zeros(4) if i < 0 else 2.0 * x[t].double().numpy() @ A[i].T
        np.testing.assert_allclose(buf[0, t].numpy(), want, rtol=1e-5, atol=1e-5)
    y = torch.ones(4, 9)
    torch_lora.ops.lora_expand(buf, b, y, *meta.meta_args(4), offset_start=3, add_inputs=True, backend="torch")
    B = b[0][:, 0].double().numpy()
    for t, i in enumerate(idx.tolist()):
        want = np.ones(9)
        if i >= 0:
            want[3:8] += buf[0, t].double().numpy() @ B[i].T
        np.testing.assert_allclose(y[t].numpy(), want, rtol=1e-5, atol=1e-5)


def test_prefill_metadata_feeds_sgmv_which_equals_bgmv():
    """Contract section 2/4 + docs/api.md: compute_meta merges runs of equal indices; a prefill wrapper's
    prefill_metadata unpacks into the SGMV ops, which equal BGMV on the expanded indices."""
    starts, lengths, loras, batch, max_len, tokens, no_lora = torch_lora.compute_meta(
        torch.tensor([0, 0, 1, 1, 1, -1]))
    assert starts.tolist() == [0, 2, 5] and lengths.tolist() == [2, 3, 1] and loras.tolist() == [0, 1, -1]
    assert (batch, max_len, tokens, no_lora) == (3, 3, 6, False)
    ids = (1, 1, 2, 2, 2, 0)
    w = PunicaWrapper(16, 4, "cpu", max_loras=2, backend="torch")
    w.update_metadata(LoRAMapping(ids, (1, 2, 0), is_prefill=True), [1, 2], 3, 16)
    rng = torch_helpers.rng(50)
    x = torch.tensor(rng.standard_normal((6, 8)), dtype=torch.float32)
    wa = torch.tensor(rng.standard_normal((2, 4, 8)), dtype=torch.float32)
    s = torch_lora.ops.sgmv_shrink(x, wa, *w.prefill_metadata, 0.5, backend="torch")
    idx = torch.tensor([0, 0, 1, 1, 1, -1], dtype=torch.int32)
    torch.testing.assert_close(s, torch_lora.ops.bgmv_shrink(x, wa, idx, 0.5, backend="torch"))
    wb = torch.tensor(rng.standard_normal((2, 5, 4)), dtype=torch.float32)
    y1, y2 = torch.ones(6, 5), torch.ones(6, 5)
    torch_lora.ops.sgmv_expand(s, wb, y1, *w.prefill_metadata, True, backend="torch")
    torch_lora.ops.bgmv_expand(s, wb, y2, idx, True, backend="torch")
    torch.testing.assert_close(y1, y2)
    assert torch.equal(y1[5], torch.ones(5))
