"""The reference backends ("xla", "torch") select a token's slot, never multiply other slots by 0.

tests/test_conformance_poison.py checks the results on every implementation; this file checks
what is specific to the two reference backends: the selection stays jit- and vmap-friendly (JAX:
one compilation, no transfer to the host, a vmapped call equal to the per-example calls) and free
of host syncs (torch), with NaN/Inf in slots the tokens do not use and in the rank padding; and,
through each wrapper, NaN/Inf in an unused slot never reaching another row of add_lora_linear,
add_lora_logits or add_lora_embedding, add_shrink writing 0 on rows without LoRA. CPU only.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest
import torch

from jax_lora import LoRAKernelMeta, ops

from . import jax_helpers, oracle, torch_helpers

SLOTS, HIDDEN, RANK, WIDTH, T = 4, 32, 8, 24, 6
IDX = np.array([0, -1, 2, 2, -1, 0], np.int32)       # slots 1 and 3 unused
RANKS = np.array([3, 0, 8, 5], np.int32)


def _data(seed=0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((T, HIDDEN)).astype(np.float32)
    a = (rng.standard_normal((SLOTS, RANK, HIDDEN)) / np.sqrt(HIDDEN)).astype(np.float32)
    b = (rng.standard_normal((SLOTS, WIDTH, RANK)) / np.sqrt(RANK)).astype(np.float32)
    bias = rng.standard_normal((SLOTS, WIDTH)).astype(np.float32)
    y = rng.standard_normal((T, WIDTH)).astype(np.float32)
    clean_a, clean_b = a.copy(), b.copy()
    for slot, r in enumerate(RANKS):           # the clean computation: padding zeroed
        clean_a[slot, r:] = 0
        clean_b[slot, :, r:] = 0
    pa, pb, pbias = clean_a.copy(), clean_b.copy(), bias.copy()
    pa[1], pb[1], pbias[1] = np.nan, np.inf, np.nan        # unused slots
    pa[3], pb[3], pbias[3] = -np.inf, np.nan, np.inf
    for slot, r in enumerate(RANKS):           # rank padding (used slots too)
        pa[slot, r:] = np.nan
        pb[slot, :, r:] = np.inf
    return x, y, (clean_a, clean_b, bias), (pa, pb, pbias)


def _want(x, y, clean, idx):
    a, b, bias = clean
    buf = oracle.shrink(x, [a], idx, 0.5)
    return buf, oracle.expand(buf, [b], y, idx, 0, True, [bias])


# ----------------------------------------------------------------------------- JAX "xla"

@pytest.mark.parametrize("path", ["gather", "scan"])
def test_xla_poison_under_jit_and_vmap(path, monkeypatch):
    """Both formulations of the expand (all slots then a gather; a scan over the slots)."""
    import jax
    import jax.numpy as jnp

    from jax_lora.meta import LoRAKernelMeta
    from jax_lora.ops import xla

    if path == "scan":
        monkeypatch.setattr(xla, "EXPAND_GATHER_MAX", 0)

    x, y, clean, (pa, pb, pbias) = _data()
    # device arrays enter as arguments: a device array closed over would be copied to the host to be
    # embedded in the program as a constant (on a GPU), which the guard below would catch
    meta0 = LoRAKernelMeta.build(IDX, SLOTS, T)
    ranks = jnp.asarray(RANKS)

    def step(x, y, idx, ranks, meta0):
        meta = dataclasses.replace(meta0, token_lora_mapping=idx)
        buf = xla.shrink(x, (jnp.asarray(pa),), meta, 0.5, ranks)
        return buf, xla.expand(buf, (jnp.asarray(pb),), y, meta, (0,), True, ranks, (jnp.asarray(pbias),))

    jitted = jax.jit(step)
    with jax.transfer_guard_device_to_host("disallow"):
        buf, out = jitted(jnp.asarray(x), jnp.asarray(y), jnp.asarray(IDX), ranks, meta0)
    want_buf, want = _want(x, y, clean, IDX)
    assert oracle.rel_err(np.asarray(buf)[0], want_buf[0]) < 1e-5
    assert np.all(np.asarray(buf)[0, IDX < 0] == 0)
    assert oracle.rel_err(np.asarray(out), want) < 1e-5
    np.testing.assert_array_equal(np.asarray(out)[IDX < 0], y[IDX < 0])

    # vmap over a batch of steps with different mappings: each equal to its own call.
    idxs = np.stack([IDX, IDX[::-1], np.full(T, -1, np.int32)])
    xs, ys = np.stack([x, x[::-1], x]), np.stack([y, y * 2, y])
    bufs, outs = jax.jit(jax.vmap(step, in_axes=(0, 0, 0, None, None)))(
        jnp.asarray(xs), jnp.asarray(ys), jnp.asarray(idxs), ranks, meta0)
    for i in range(3):
        want_buf, want = _want(xs[i], ys[i], clean, idxs[i])
        assert oracle.rel_err(np.asarray(bufs)[i, 0], want_buf[0]) < 1e-5
        assert oracle.rel_err(np.asarray(outs)[i], want) < 1e-5
    assert jitted._cache_size() == 1


@pytest.mark.parametrize("path", ["gather", "scan"])
def test_xla_out_of_range_index_is_no_lora_with_poison(path, monkeypatch):
    """Inside jit an index >= L is treated as -1 (contract section 6): its row stays untouched, and it
    must not pick up any slot's NaN either."""
    import jax.numpy as jnp

    from jax_lora.meta import LoRAKernelMeta
    from jax_lora.ops import xla

    if path == "scan":
        monkeypatch.setattr(xla, "EXPAND_GATHER_MAX", 0)

    x, y, clean, (pa, pb, pbias) = _data(1)
    idx = IDX.copy()
    idx[1] = SLOTS + 3
    meta = dataclasses.replace(LoRAKernelMeta.build(IDX, SLOTS, T), token_lora_mapping=jnp.asarray(idx))
    buf = xla.shrink(jnp.asarray(x), (jnp.asarray(pa),), meta, 0.5, jnp.asarray(RANKS))
    out = np.asarray(xla.expand(buf, (jnp.asarray(pb),), jnp.asarray(y), meta, (0,), True, jnp.asarray(RANKS),
                                (jnp.asarray(pbias),)))
    assert np.all(np.asarray(buf)[0, 1] == 0)
    np.testing.assert_array_equal(out[1], y[1])
    assert oracle.rel_err(out, _want(x, y, clean, np.where(idx >= SLOTS, -1, idx))[1]) < 1e-5


# ----------------------------------------------------------------------------- torch "torch"

def _torch_step(torch_ref, x, y, idx, pa, pb, pbias, ranks):
    import torch
    meta_args = (idx,)                     # the reference reads only the token mapping
    buf = torch.full((1, x.shape[0], RANK), float("nan"), dtype=torch.float32, device=x.device)
    torch_ref.shrink(x, (pa,), buf, meta_args, 0.5, ranks)
    torch_ref.expand(buf, (pb,), y, meta_args, (0,), True, ranks, (pbias,))
    return buf


@pytest.mark.parametrize("path", ["gather", "loop"])
def test_torch_ref_poison(path, monkeypatch):
    """Both formulations of the expand (all slots then a gather; a loop over the slots), with an
    out-of-range index (treated as -1)."""
    import torch

    from torch_lora.ops import torch_ref

    if path == "loop":
        monkeypatch.setattr(torch_ref, "EXPAND_GATHER_MAX", 0)
    x, y, clean, (pa, pb, pbias) = _data(2)
    idx = IDX.copy()
    idx[4] = SLOTS + 2
    t = torch.from_numpy
    yt = t(y.copy())
    buf = _torch_step(torch_ref, t(x), yt, t(idx), t(pa), t(pb), t(pbias), t(RANKS))
    want_buf, want = _want(x, y, clean, np.where(idx >= SLOTS, -1, idx))
    assert oracle.rel_err(buf.numpy()[0], want_buf[0]) < 1e-5
    assert np.all(buf.numpy()[0, (idx < 0) | (idx >= SLOTS)] == 0)
    assert oracle.rel_err(yt.numpy(), want) < 1e-5
    np.testing.assert_array_equal(yt.numpy()[(idx < 0) | (idx >= SLOTS)], y[(idx < 0) | (idx >= SLOTS)])


@pytest.mark.parametrize("path", ["gather", "loop"])
def test_torch_ref_has_no_data_dependent_op(path, monkeypatch):
    """On the `meta` device every value is unknown: an op that needs one (.item(), nonzero, boolean
    masking, a data-dependent shape -- a host sync on CUDA, a break in CUDA-graph capture) raises.
    The reference must run there, shapes only."""
    import torch

    from torch_lora.ops import torch_ref

    if path == "loop":
        monkeypatch.setattr(torch_ref, "EXPAND_GATHER_MAX", 0)
    m = {"device": "meta"}
    y = torch.empty(T, WIDTH, **m)
    buf = _torch_step(torch_ref, torch.empty(T, HIDDEN, **m), y, torch.empty(T, dtype=torch.int32, **m),
                      torch.empty(SLOTS, RANK, HIDDEN, **m), torch.empty(SLOTS, WIDTH, RANK, **m),
                      torch.empty(SLOTS, WIDTH, **m), torch.empty(SLOTS, dtype=torch.int32, **m))
    assert buf.shape == (1, T, RANK) and y.shape == (T, WIDTH)


def test_nan_in_unused_slot_never_reaches_other_rows_xla():
    """A NaN/Inf in a slot no token uses (A, B and bias) leaves every other row
    finite and equal to the oracle on "xla", for linear, logits and embedding; add_shrink writes 0
    (not NaN) on no-LoRA rows; NaN in an expand buffer's no-LoRA row or in a LoRA vocabulary past
    y's width changes nothing."""
    ids = (1, 0, 2, 1)                       # slots 0 and 1 used, slot 2 poisoned
    idx = jax_helpers.ids_to_slots(ids)
    w = jax_helpers.wrapper(ids, jax_helpers.LORA_INDEX_TO_ID)
    T, H, r, L, N = 4, 8, 4, 3, 6
    x, y = jax_helpers.rand(T, H), jax_helpers.rand(T, N)
    A, B, bias = jax_helpers.rand(L, r, H), jax_helpers.rand(L, N, r), jax_helpers.rand(L, N)
    A[2, 0, 0], B[2, 1, 1], bias[2, 3] = np.nan, np.inf, np.nan
    out = w.add_lora_linear(y, x, [A], [B], [bias], 1.0, (N,))
    want = jax_helpers.expand_ref(y, jax_helpers.shrink_ref(x, A, idx, 1.0), B, idx, 0, True)
    for t, i in enumerate(idx):
        if i >= 0:
            want[t] += bias[i]
    assert jax_helpers.rel_err(out, want) < 1e-5
    buf = w.add_shrink(jnp.zeros((1, T, r), jnp.float32), x, [A], 1.0)
    assert np.all(np.asarray(buf)[0, 1] == 0)
    logits = w.add_lora_logits(y, x, A, B, 1.0)
    assert jax_helpers.rel_err(logits, jax_helpers.expand_ref(y, jax_helpers.shrink_ref(x, A, idx, 1.0), B, idx, 0,
                                                              True)) < 1e-5
    emb = w.add_lora_embedding(y, jax_helpers.rand(T, r), B)
    assert np.all(np.isfinite(np.asarray(emb)))
    nan_buf = np.asarray(buf).copy()
    nan_buf[0, 1] = np.nan                                   # an expand buffer's no-LoRA row
    np.testing.assert_array_equal(np.asarray(w.add_expand(y, nan_buf, [B], None, (N,)))[1], y[1])
    wide = np.concatenate([B, np.full((L, 3, r), np.nan, np.float32)], axis=1)   # vocabulary past y
    assert np.all(np.isfinite(np.asarray(w.add_lora_logits(y, x, A, wide, 1.0))))


def test_rank_padding_with_nan_is_ignored_xla():
    """With lora_ranks, values past a slot's rank (NaN here) are ignored on "xla":
    the result equals the computation with the padding zeroed; heterogeneous ranks, -1 tokens."""
    T, H, r, L, N = 4, 16, 8, 3, 12
    idx = np.array([0, 2, -1, 1], np.int32)
    ranks = np.array([3, 8, 5], np.int32)
    x, y = jax_helpers.rand(T, H), jax_helpers.rand(T, N)
    A, B = jax_helpers.rand(L, r, H, scale=0.2), jax_helpers.rand(L, N, r, scale=0.2)
    A0, B0 = A.copy(), B.copy()
    for s, k in enumerate(ranks):
        A[s, k:], B[s, :, k:] = np.nan, np.nan
        A0[s, k:], B0[s, :, k:] = 0, 0
    meta = LoRAKernelMeta.build(idx, max_loras=L)
    buf = ops.lora_shrink(x, [A], meta, 1.0, backend="xla", lora_ranks=ranks)
    assert jax_helpers.rel_err(buf[0], jax_helpers.shrink_ref(x, A0, idx, 1.0)) < 1e-5
    out = ops.lora_expand(buf, [B], y, meta, 0, True, backend="xla", lora_ranks=ranks)
    assert jax_helpers.rel_err(out, jax_helpers.expand_ref(y, jax_helpers.shrink_ref(x, A0, idx, 1.0), B0, idx, 0,
                                                           True)) < 1e-5
    np.testing.assert_array_equal(np.asarray(out)[2], y[2])


def test_nan_in_an_unused_slot_stays_there_linear_logits_embedding():
    """A NaN/Inf in one slot's A, B or bias -- a slot no token uses -- never reaches
    another row, on the torch backend, for linear, logits and embedding."""
    rng = torch_helpers.rng(5)
    a, b = torch_helpers.stacked(rng, 3, 4, 8, (5,))
    bias = [torch.tensor(rng.standard_normal((3, 5)), dtype=torch.float32)]
    clean = [t.clone() for t in (a[0], b[0], bias[0])]
    a[0][2].fill_(float("nan"))
    b[0][2, 0, 0, 0] = float("inf")
    bias[0][2].fill_(float("nan"))
    w = torch_helpers.wrapper((1, 0, 2, 1), [1, 2, 3], prompt_ids=(2, 0, 1))
    x = torch.tensor(rng.standard_normal((4, 8)), dtype=torch.float32)
    y = torch.zeros(4, 5)
    w.add_lora_linear(y, x, a, b, bias, 1.0, (5,))
    want = torch_helpers.oracle_linear(torch.zeros(4, 5), x, [clean[0]], [clean[1]], [clean[2]], 1.0, [0, -1, 1, 0],
                                       (5,))
    assert torch.isfinite(y).all()
    assert torch_helpers.rel(y.numpy(), want) < 1e-5
    yl = torch.zeros(3, 5)
    w.add_lora_logits(yl, x[:3], a[0][:, 0], b[0][:, 0], 1.0)
    assert torch.isfinite(yl).all() and torch.equal(yl[1], torch.zeros(5))
    ye = torch.zeros(4, 5)
    w.add_lora_embedding(ye, torch.ones(4, 4), b[0][:, 0])
    assert torch.isfinite(ye).all() and torch.equal(ye[1], torch.zeros(5))


def test_add_shrink_writes_zero_rows_for_tokens_without_lora_despite_nan_weights():
    """Contract section 4: add_shrink writes 0 on no-LoRA rows (never NaN), whatever another
    slot holds."""
    rng = torch_helpers.rng(6)
    a, _ = torch_helpers.stacked(rng, 2, 4, 8, (5,))
    a[0][1].fill_(float("nan"))
    w = torch_helpers.wrapper((1, 0, 1), [1, 2])
    buf = torch.full((1, 3, 4), float("nan"))
    w.add_shrink(buf, torch.ones(3, 8), a, 1.0)
    assert torch.equal(buf[0, 1], torch.zeros(4))
    assert torch.isfinite(buf).all()


def test_lora_ranks_ignores_nan_in_the_rank_padding():
    """With lora_ranks=, NaN in the rank padding gives the zero-padded result."""
    rng = torch_helpers.rng(7)
    a, b = torch_helpers.stacked(rng, 2, 8, 8, (6,))
    ranks = torch.tensor([3, 8], dtype=torch.int32)
    a_clean, b_clean = a[0].clone(), b[0].clone()
    a_clean[0, :, 3:] = 0
    b_clean[0, :, :, 3:] = 0
    a[0][0, :, 3:] = float("nan")
    b[0][0, :, :, 3:] = float("nan")
    w = torch_helpers.wrapper((1, 2, 1), [1, 2])
    x = torch.tensor(rng.standard_normal((3, 8)), dtype=torch.float32)
    y = torch.zeros(3, 6)
    w.add_lora_linear(y, x, a, b, None, 1.0, (6,), lora_ranks=ranks)
    want = torch_helpers.oracle_linear(torch.zeros(3, 6), x, [a_clean], [b_clean], None, 1.0, [0, 1, 0], (6,))
    assert torch_helpers.rel(y.numpy(), want) < 1e-5
