"""Hypothesis property tests over shapes and mappings (reference implementations: interpreters
are too slow for a sweep; they run the fixed conformance cases).

CPU.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lora_core.host_mapping import LoRAMapping, compute_meta_host

from . import oracle
from .impls import IMPLS

FAST = [pytest.param(i, id=i.name) for i in IMPLS if not i.small and i.wrapper_factory is None]


@st.composite
def problems(draw):
    num_slots = draw(st.integers(1, 5))
    num_tokens = draw(st.integers(1, 24))
    hidden = draw(st.sampled_from([1, 8, 24, 40]))
    rank = draw(st.integers(1, 12))
    slices = tuple(draw(st.lists(st.integers(1, 20), min_size=1, max_size=3)))
    idx = draw(st.lists(st.integers(-1, num_slots - 1), min_size=num_tokens, max_size=num_tokens))
    with_bias = draw(st.booleans())
    seed = draw(st.integers(0, 2**31 - 1))
    return num_slots, hidden, rank, slices, np.array(idx, np.int32), with_bias, seed


@pytest.mark.parametrize("impl", FAST)
@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(problem=problems())
def test_add_lora_linear_any_shape_and_mapping(impl, problem):
    num_slots, hidden, rank, slices, idx, with_bias, seed = problem
    rng = np.random.default_rng(seed)
    t = len(idx)
    x = rng.standard_normal((t, hidden)).astype(np.float32)
    a = [rng.standard_normal((num_slots, 1, rank, hidden)).astype(np.float32) for _ in slices]
    b = [rng.standard_normal((num_slots, 1, n, rank)).astype(np.float32) for n in slices]
    bias = [rng.standard_normal((num_slots, n)).astype(np.float32) for n in slices] if with_bias else None
    y = rng.standard_normal((t, sum(slices))).astype(np.float32)
    ids = [100 + s for s in range(num_slots)]
    mapping = LoRAMapping(tuple(0 if i < 0 else ids[i] for i in idx), (0,), False)
    w = impl.wrapper(t + 2, 4, num_slots)
    w.update_metadata(mapping, ids, num_slots + 1, 10, 0)
    arr = lambda v: impl.arr(v, "float32")
    got = impl.wrapper_call(w, "add_lora_linear", arr(y), arr(x), [arr(v) for v in a], [arr(v) for v in b],
                            None if bias is None else [arr(v) for v in bias], 0.5, slices)
    want = oracle.lora_linear(y, x, a, b, bias, 0.5, idx)
    assert oracle.rel_err(got, want) <= 1e-5
    np.testing.assert_array_equal(got[idx < 0], y[idx < 0].astype(np.float64))


@settings(max_examples=60, deadline=None)
@given(idx=st.lists(st.integers(-1, 6), min_size=0, max_size=40))
def test_compute_meta_segments_rebuild_the_mapping(idx):
    meta = compute_meta_host(np.array(idx, np.int32))
    rebuilt = oracle.segments_to_indices(meta.seq_start_locs, meta.seq_lengths, meta.lora_indices_per_batch,
                                         len(idx))
    assert rebuilt.tolist() == idx
    assert meta.token_nums == len(idx) and meta.batch_size == len(meta.seq_lengths)
    assert all(meta.lora_indices_per_batch[i] != meta.lora_indices_per_batch[i + 1]
               for i in range(meta.batch_size - 1))


@pytest.mark.parametrize("impl", FAST)
@settings(max_examples=40, deadline=None)
@given(idx=st.lists(st.integers(-1, 5), min_size=1, max_size=30), extra=st.integers(0, 5))
def test_kernel_meta_invariants(impl, idx, extra):
    max_loras = 6
    n = len(idx)
    meta = impl.meta(np.array(idx, np.int32), max_loras, capacity=n + extra)
    mapping, order, num, start, active, no_lora = [np.asarray(impl.to_np(a)).astype(np.int64).reshape(-1)
                                                   for a in meta.meta_args(n)]
    assert sorted(order.tolist()) == list(range(n))
    assert num.sum() == n and start[0] == 0
    for k in range(max_loras + 1):
        group = order[start[k]:start[k] + num[k]]
        assert all(mapping[t] == active[k] for t in group)
    k = int((num > 0).sum())
    assert list(active[:k]) == sorted(set(idx)) and (active[k:] == -1).all() and (num[k:] == 0).all()
    assert bool(no_lora[0]) == all(i == -1 for i in idx)


@settings(max_examples=40, deadline=None)
@given(idx=st.lists(st.integers(-2, 6), min_size=0, max_size=30), extra=st.integers(0, 5),
       max_loras=st.integers(1, 6))
def test_host_metadata_equals_both_device_builds(idx, extra, max_loras):
    """The wrappers build kernel metadata on the host; it must equal the jitted JAX build and the
    torch device build, field by field (including padding; out-of-range slots are -1 in the host and
    traced builds, a ValueError from a CPU tensor, so torch gets them as -1)."""
    import jax
    import torch

    import torch_lora
    from jax_lora.meta import LoRAKernelMeta as JaxMeta
    from lora_core.host_mapping import kernel_meta_host

    n = len(idx)
    capacity = n + extra if n + extra > 0 else 1
    host = kernel_meta_host(np.array(idx, np.int32), max_loras, capacity)
    jm = jax.jit(lambda m: JaxMeta.build(m, max_loras, capacity))(np.array(idx, np.int32))
    tm = torch_lora.LoRAKernelMeta.make(max_loras, capacity, "cpu")
    in_range = [i if -1 <= i < max_loras else -1 for i in idx]
    if in_range != idx:
        with pytest.raises(ValueError, match="token_lora_mapping holds"):
            tm.prepare_tensors(torch.tensor(idx, dtype=torch.int32))
    tm.prepare_tensors(torch.tensor(in_range, dtype=torch.int32))
    fields = ("token_lora_mapping", "token_indices_sorted_by_lora_ids", "active_lora_ids", "num_tokens_per_lora",
              "lora_token_start_loc")
    for key, field in zip(("mapping", "sorted", "active", "num", "start"), fields):
        assert host[key].tolist() == np.asarray(getattr(jm, field)).tolist() == getattr(tm, field).tolist(), field
    assert bool(host["no_lora"][0]) == bool(jm.no_lora) == bool(tm.no_lora[0])
