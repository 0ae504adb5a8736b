"""torch_lora.PunicaWrapper specifics: add_lora_linear in place against a float64 oracle (and the
buffer it fills with the shrink), logits routed by the sampler indices, vLLM's wrapper methods
shrink / expand / expand_slice, stable index addresses (CUDA graphs), and the checked-argument cache
(in-place weight updates seen, swapped storage re-checked, no weights kept alive). CPU, torch
backend; the GPU counterpart is tests/test_gpu_wrapper.py.
"""

from __future__ import annotations

import gc

import numpy as np
import pytest
import torch

import torch_lora
from torch_lora import LoRAMapping

from . import oracle, torch_helpers

IDS = [5, 6, 7]


def _weights(seed, slots=3, rank=4, hidden=16, slices=(8, 4)):
    g = torch.Generator().manual_seed(seed)
    a = tuple(torch.randn(slots, 1, rank, hidden, generator=g) for _ in slices)
    b = tuple(torch.randn(slots, 1, n, rank, generator=g) for n in slices)
    return a, b


def _wrapper():
    w = torch_lora.PunicaWrapper(8, 4, "cpu", max_loras=3, backend="torch")
    w.update_metadata(LoRAMapping((5, 0, 7, 6), (5,)), IDS, 4, 32)
    return w


def test_index_tensors_keep_their_addresses_across_steps():
    w = _wrapper()
    ptrs = [t.data_ptr() for t in (w._token_lora_indices, w.token_mapping_meta.token_lora_mapping,
                                    w.token_mapping_meta.token_indices_sorted_by_lora_ids,
                                    w.token_mapping_meta.lora_token_start_loc)]
    w.update_metadata(LoRAMapping((7, 7, 0), (7, 6)), IDS, 4, 32)
    assert ptrs == [t.data_ptr() for t in (w._token_lora_indices, w.token_mapping_meta.token_lora_mapping,
                                           w.token_mapping_meta.token_indices_sorted_by_lora_ids,
                                           w.token_mapping_meta.lora_token_start_loc)]
    assert w.token_lora_indices.tolist() == [2, 2, -1]


@pytest.mark.parametrize("sizes", [(8, 4, 3), (7, 3, 5), (13, 1, 1), (256, 16, 64)])
def test_every_kernel_argument_view_is_16_byte_aligned(sizes):
    """The index tensors and kernel metadata are views of one step block; Triton specialises
    pointer arguments on 16-byte alignment and the direct launch path takes aligned ones only, so
    every view must start 16-byte aligned, whatever the capacities (StepLayout.ALIGN)."""
    t, b, loras = sizes
    w = torch_lora.PunicaWrapper(t, b, "cpu", max_loras=loras, backend="torch")
    views = [w._token_lora_indices, w._sampler_indices, w._sampler_indices_padded, w._embeddings_indices,
             w._long_lora_indices, w._seq_start_locs, w._seq_lengths, w._lora_indices_per_batch]
    for meta in (w.token_mapping_meta, w.prompt_mapping_meta):
        views += [meta.token_lora_mapping, meta.token_indices_sorted_by_lora_ids, meta.num_tokens_per_lora,
                  meta.lora_token_start_loc, meta.active_lora_ids, meta.no_lora]
    assert all(v.data_ptr() % 16 == 0 for v in views), [v.data_ptr() % 16 for v in views]


def test_in_place_weight_update_is_seen_through_the_cache():
    w = _wrapper()
    a, b = _weights(0)
    x, y = torch.randn(4, 16), torch.zeros(4, 12)
    w.add_lora_linear(y.clone(), x, a, b, None, 1.0, (8, 4))
    a[0][2].mul_(3.0)  # a new adapter loaded into slot 2, in place
    got = w.add_lora_linear(y.clone(), x, a, b, None, 1.0, (8, 4))
    want = oracle.lora_linear(y.numpy(), x.numpy(), [t.numpy() for t in a], [t.numpy() for t in b], None, 1.0,
                              [0, -1, 2, 1])
    assert oracle.rel_err(got.numpy(), want) < 1e-5


def test_new_weights_are_checked_again():
    w = _wrapper()
    a, b = _weights(1)
    x, y = torch.randn(4, 16), torch.zeros(4, 12)
    w.add_lora_linear(y, x, a, b, None, 1.0, (8, 4))
    bad_b = (b[0], torch.randn(3, 1, 4, 5))
    with pytest.raises(ValueError, match=r"lora_b_stacked\[1\] has rank 5"):
        w.add_lora_linear(y, x, a, bad_b, None, 1.0, (8, 4))
    with pytest.raises(ValueError, match=r"x has hidden size 17|hidden size"):
        w.add_lora_linear(y, torch.randn(4, 17), a, b, None, 1.0, (8, 4))


def test_cache_does_not_keep_weights_alive():
    w = _wrapper()
    a, b = _weights(2)
    w.add_lora_linear(torch.zeros(4, 12), torch.randn(4, 16), a, b, None, 1.0, (8, 4))
    assert len(w._plans) == 1
    del a, b
    gc.collect()
    assert len(w._plans) == 0


def test_per_step_checks_still_run_on_the_cached_path():
    w = _wrapper()
    a, b = _weights(3)
    w.add_lora_linear(torch.zeros(4, 12), torch.randn(4, 16), a, b, None, 1.0, (8, 4))
    with pytest.raises(ValueError, match=r"x has 5 rows, but update_metadata mapped only 4"):
        w.add_lora_linear(torch.zeros(5, 12), torch.randn(5, 16), a, b, None, 1.0, (8, 4))
    w.update_metadata(LoRAMapping((7,), (7,)), [5, 6, 7], 4, 32)
    small_a = tuple(t[:2] for t in a)
    small_b = tuple(t[:2] for t in b)
    with pytest.raises(ValueError, match=r"mapping uses slot 2"):
        w.add_lora_linear(torch.zeros(1, 12), torch.randn(1, 16), small_a, small_b, None, 1.0, (8, 4))


def test_the_default_backend_is_said_once(caplog):
    """A wrapper built without `backend=` says which backend the device's default picked (once per
    backend and device, however many wrappers), as the ops do."""
    import logging

    from torch_lora.ops import dispatch
    dispatch._REGISTRY.log_choice.cache_clear()
    with caplog.at_level(logging.INFO, logger="torch_lora"):
        for _ in range(3):
            w = torch_lora.PunicaWrapper(8, 4, "cpu", max_loras=3)
    assert w.backend == "torch"
    said = [r.getMessage() for r in caplog.records if r.name == "torch_lora"]
    assert said == ["backend 'torch' on cpu (the device's default)"]


def test_add_lora_linear_updates_y_in_place_and_matches_oracle():
    """Contract section 5: torch add_lora_linear updates y in place and returns it; unequal slices,
    bias per slot, tokens without LoRA untouched; equal to a float64 oracle within 1e-5 (fp32)."""
    rng = torch_helpers.rng(1)
    widths = (6, 3, 5)
    a, b = torch_helpers.stacked(rng, 3, 4, 16, widths)
    bias = [torch.tensor(rng.standard_normal((3, n)), dtype=torch.float32) for n in widths]
    ids = (1, 0, 2, 2, 3, 0, 1)
    w = torch_helpers.wrapper(ids, [1, 2, 3])
    idx = [{0: -1, 1: 0, 2: 1, 3: 2}[i] for i in ids]
    x = torch.tensor(rng.standard_normal((7, 16)), dtype=torch.float32)
    y = torch.tensor(rng.standard_normal((7, 14)), dtype=torch.float32)
    y0 = y.clone()
    ret = w.add_lora_linear(y, x, a, b, bias, 0.5, widths)
    assert ret is y
    want = torch_helpers.oracle_linear(y0, x, a, b, bias, 0.5, idx, widths)
    assert torch_helpers.rel(y.numpy(), want) < 1e-5
    assert torch.equal(y[1], y0[1]) and torch.equal(y[5], y0[5])


def test_logits_route_by_sampler_indices_and_embedding_by_token_indices():
    """Contract section 5: add_lora_logits uses the prompt mapping (one slot per sampled row),
    add_lora_embedding the token mapping."""
    rng = torch_helpers.rng(3)
    w = torch_helpers.wrapper((1, 1, 2, 0), [1, 2], prompt_ids=(2, 0, 1))
    a = torch.tensor(rng.standard_normal((2, 4, 8)), dtype=torch.float32)
    b = torch.tensor(rng.standard_normal((2, 10, 4)), dtype=torch.float32)
    x = torch.tensor(rng.standard_normal((3, 8)), dtype=torch.float32)
    y = torch.zeros(3, 10)
    w.add_lora_logits(y, x, a, b, 1.0)
    for j, slot in enumerate([1, -1, 0]):
        want = np.zeros(10) if slot < 0 else (x[j].double().numpy() @ a[slot].double().numpy().T) @ \
            b[slot].double().numpy().T
        np.testing.assert_allclose(y[j].numpy(), want, rtol=1e-5, atol=1e-5)
    xe = torch.tensor(rng.standard_normal((4, 4)), dtype=torch.float32)
    ye = torch.zeros(4, 10)
    w.add_lora_embedding(ye, xe, b)
    for t, slot in enumerate([0, 0, 1, -1]):
        want = np.zeros(10) if slot < 0 else xe[t].double().numpy() @ b[slot].double().numpy().T
        np.testing.assert_allclose(ye[t].numpy(), want, rtol=1e-5, atol=1e-5)


def test_swapped_weight_storage_is_seen_and_rechecked():
    """The wrapper's cached plan follows `A.data = ...` / `B.set_(...)`, and a
    swapped-in tensor of another rank is checked again (refused when it no longer fits B)."""
    rng = torch_helpers.rng(8)
    a, b = torch_helpers.stacked(rng, 2, 4, 8, (5,))
    w = torch_helpers.wrapper((1, 2), [1, 2])
    x = torch.tensor(rng.standard_normal((2, 8)), dtype=torch.float32)
    w.add_lora_linear(torch.zeros(2, 5), x, a, b, None, 1.0, (5,))
    new_a = torch.tensor(rng.standard_normal((2, 1, 4, 8)), dtype=torch.float32)
    a[0].data = new_a
    y = torch.zeros(2, 5)
    w.add_lora_linear(y, x, a, b, None, 1.0, (5,))
    assert torch_helpers.rel(y.numpy(), torch_helpers.oracle_linear(torch.zeros(2, 5), x, [new_a], b, None, 1.0,
                                                                    [0, 1], (5,))) < 1e-5
    new_b = torch.tensor(rng.standard_normal((2, 1, 5, 4)), dtype=torch.float32)
    b[0].set_(new_b)
    y = torch.zeros(2, 5)
    w.add_lora_linear(y, x, a, b, None, 1.0, (5,))
    assert torch_helpers.rel(y.numpy(), torch_helpers.oracle_linear(torch.zeros(2, 5), x, [new_a], [new_b], None, 1.0,
                                                                    [0, 1], (5,))) < 1e-5
    a[0].data = torch.zeros(2, 1, 3, 8)           # rank 3 against B's rank 4
    with pytest.raises(ValueError, match="rank"):
        w.add_lora_linear(torch.zeros(2, 5), x, a, b, None, 1.0, (5,))


def test_shrink_expand_expand_slice_methods():
    """docs/api.md: vLLM's TPU wrapper's shrink(x, w_t_all, scale), expand(y, x, w_t_all,
    add_inputs) and expand_slice(y, x, w_t_all, y_offset, y_slice_size, add_inputs) on the torch
    wrapper, with the token's slot from the step's metadata; expand cuts a wider output to y;
    expand_slice needs y_slice_size == n; add_inputs has no default."""
    rng = torch_helpers.rng(32)
    ids = (2, 0, 1, 2)
    idx = [1, -1, 0, 1]
    w = torch_helpers.wrapper(ids, [1, 2])
    x = torch.tensor(rng.standard_normal((4, 8)), dtype=torch.float32)
    wa = torch.tensor(rng.standard_normal((2, 1, 3, 8)), dtype=torch.float32)
    s = w.shrink(x, wa, 0.5)
    assert tuple(s.shape) == (4, 3) and s.dtype == torch.float32
    for t, i in enumerate(idx):
        want = np.zeros(3) if i < 0 else 0.5 * x[t].double().numpy() @ wa[i, 0].double().numpy().T
        np.testing.assert_allclose(s[t].numpy(), want, rtol=1e-5, atol=1e-6)
    wb = torch.tensor(rng.standard_normal((2, 7, 3)), dtype=torch.float32)
    y = torch.full((4, 5), 2.0)
    assert w.expand(y, s, wb, True) is y
    for t, i in enumerate(idx):
        want = np.full(5, 2.0) if i < 0 else 2.0 + (s[t].double().numpy() @ wb[i].double().numpy().T)[:5]
        np.testing.assert_allclose(y[t].numpy(), want, rtol=1e-5, atol=1e-5)
    y = torch.full((4, 9), 2.0)
    w.expand_slice(y, s, wb, 1, 7, False)
    for t, i in enumerate(idx):
        want = np.full(9, 2.0)
        if i >= 0:
            want[1:8] = s[t].double().numpy() @ wb[i].double().numpy().T
        np.testing.assert_allclose(y[t].numpy(), want, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="y_slice_size"):
        w.expand_slice(y, s, wb, 1, 6, False)
    with pytest.raises(TypeError):
        w.expand(y, s, wb)


def test_add_lora_linear_buffer_receives_the_shrink():
    """Contract section 5: add_lora_linear(..., buffer=) -- the (S, T, r) float32 buffer gets the shrink result
    and y the same as without it."""
    rng = torch_helpers.rng(51)
    a, b = torch_helpers.stacked(rng, 2, 4, 8, (3, 5))
    w = torch_helpers.wrapper((1, 0, 2), [1, 2])
    x = torch.tensor(rng.standard_normal((3, 8)), dtype=torch.float32)
    buf = torch.full((2, 3, 4), 9.0)
    y = w.add_lora_linear(torch.zeros(3, 8), x, a, b, None, 0.5, (3, 5), buffer=buf)
    torch.testing.assert_close(y, w.add_lora_linear(torch.zeros(3, 8), x, a, b, None, 0.5, (3, 5)))
    for s_ in range(2):
        want = 0.5 * x[0].double().numpy() @ a[s_][0, 0].double().numpy().T
        np.testing.assert_allclose(buf[s_, 0].numpy(), want, rtol=1e-5, atol=1e-6)
        assert torch.equal(buf[s_, 1], torch.zeros(4))
