"""torch wrapper specifics: stable index addresses (CUDA graphs), the checked-argument cache."""

from __future__ import annotations

import gc

import pytest
import torch

import torch_lora
from torch_lora import LoRAMapping

from . import oracle

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
