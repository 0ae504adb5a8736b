"""The reference backends ("xla", "torch") select a token's slot, never multiply other slots by 0.

tests/test_conformance_poison.py checks the results on every implementation; this file checks
what is specific to the two reference backends: the selection stays jit- and vmap-friendly (JAX:
one compilation, no transfer to the host, a vmapped call equal to the per-example calls) and free
of host syncs (torch), with NaN/Inf in slots the tokens do not use and in the rank padding.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from . import oracle

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
