"""The JAX MoE LoRA op beyond the conformance cases: NaN or Inf in weights no routed pair may read
(an empty slot, a slot whose adapter_enabled is 0, rank padding past lora_ranks) never reaches a
result, on backends xla, pallas_tpu (TPU interpret mode, races checked) and triton (Triton's
interpreter; blocks of 4 pairs take its naive order), each running its own kernel (triton: the
xla one, logged, where the FFI launcher cannot run); the wrapper's
add_lora_w13 / add_lora_w2 under jax.jit with the wrapper a traced argument and a bucket-padded
batch equal the float64 oracle on the real tokens and leave the padded ones untouched; the
aligned layout holds every live pair once.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_lora import PunicaWrapper
from jax_lora.ops import fused_moe_lora, moe_lora_align_block_size
from lora_core.host_mapping import LoRAMapping

from . import oracle
from .pallas_tpu_impl import races_checked

M, K, E, L, R, H, I = 9, 2, 4, 3, 8, 32, 12


def _case(seed):
    rng = np.random.default_rng(seed)
    ids = np.stack([rng.choice(E, K, replace=False) for _ in range(M)]).astype(np.int32)
    weights = rng.random((M, K)).astype(np.float32)
    slot = rng.choice([-1, 0, 1, 2], M).astype(np.int32)
    a = [(rng.standard_normal((L, E, R, H)) / 6).astype(np.float32) for _ in range(2)]
    b = [(rng.standard_normal((L, E, I, R)) / 3).astype(np.float32) for _ in range(2)]
    x = rng.standard_normal((M, H)).astype(np.float32)
    y = rng.standard_normal((M, K, 2 * I)).astype(np.float32)
    return ids, weights, slot, a, b, x, y


@pytest.mark.parametrize("backend", ["xla", "pallas_tpu", "triton"])
@pytest.mark.parametrize("naive", [False, True], ids=["aligned", "naive"])
def test_weights_no_pair_reads_never_reach_a_result(backend, naive):
    """Slot 1 disabled (adapter_enabled 0) and its weights NaN; slot 0's columns past its rank 5
    Inf: the result equals the oracle with those weights zeroed, and slot 1's pairs are untouched."""
    ids, weights, slot, a, b, x, y = _case(1)
    enabled = np.array([1, 0, 1], np.int32)
    ranks = np.array([5, 8, 8], np.int32)
    clean_a, clean_b = [v.copy() for v in a], [v.copy() for v in b]
    for v in clean_a:
        v[0, :, 5:] = 0
    for v in clean_b:
        v[0, :, :, 5:] = 0
    for v in a:
        v[1] = np.nan
        v[0, :, 5:] = np.inf
    for v in b:
        v[1] = np.nan
        v[0, :, :, 5:] = np.inf
    layout = ((None, ids.reshape(-1), None) if naive
              else moe_lora_align_block_size(ids, slot, E, 4, L, enabled))
    with races_checked():
        got = fused_moe_lora(y, x, a, b, weights, *layout, slot, R, K, enabled, False, 0, backend=backend,
                             lora_ranks=ranks)
    want = oracle.fused_moe_lora(y, x, clean_a, clean_b, ids, weights, slot, enabled, False)
    assert oracle.rel_err(np.asarray(got), want) <= oracle.TOL["float32"]
    dead = (slot < 0) | (slot == 1)
    np.testing.assert_array_equal(np.asarray(got)[dead], y[dead])


def test_each_backend_runs_its_own_kernel():
    """pallas_tpu runs its Pallas kernel, xla its gather, triton the shared Triton kernel; their
    deterministic forms: Triton's with the batch-invariant plan, the others the invariant sums."""
    from jax_lora.ops import fused_moe, invariant, pallas_tpu, triton_moe, xla_moe
    assert fused_moe.backend_module("pallas_tpu").fused_moe_lora is pallas_tpu.fused_moe_lora
    assert fused_moe.backend_module("xla").fused_moe_lora is xla_moe.fused_moe_lora
    assert fused_moe.backend_module("triton").fused_moe_lora is triton_moe.fused_moe_lora
    for name in ("xla", "pallas_tpu"):
        assert fused_moe.backend_module(name, True).fused_moe_lora is invariant.fused_moe_lora
    det = fused_moe.backend_module("triton", True).fused_moe_lora
    assert det.func is triton_moe.fused_moe_lora and det.keywords == {"deterministic": True}


def test_layout_holds_every_live_pair_once():
    """Each pair of an enabled slot's token appears once, in its slot's row, in a block whose expert
    is the pair's; blocks past a slot's padded length are -1; the rest is the sentinel."""
    ids, _, slot, *_ = _case(2)
    enabled = np.array([1, 0, 1], np.int32)
    bs = 4
    sorted_ids, expert_ids, post_pad = (np.asarray(v) for v in moe_lora_align_block_size(ids, slot, E, bs, L,
                                                                                          enabled))
    rows, blocks = sorted_ids.reshape(L, -1), expert_ids.reshape(L, -1)
    p = M * K
    for l in range(L):
        live = [int(q) for q in rows[l, :post_pad[l]] if q < p]
        want = [t * K + k for t in range(M) for k in range(K) if slot[t] == l and enabled[l]]
        assert sorted(live) == want
        for j, q in enumerate(rows[l, :post_pad[l]]):
            if q < p:
                assert blocks[l, j // bs] == ids[q // K, q % K]
        assert np.all(rows[l, post_pad[l]:] == p) and np.all(blocks[l, post_pad[l] // bs:] == -1)
        assert post_pad[l] % bs == 0


def test_w13_w2_under_jit_with_a_padded_bucket():
    """The wrapper (capacity 16) traced into a jitted step over a 12-row bucket of which 9 rows are
    mapped: the mapped rows equal the oracle, the padded rows keep y."""
    ids, weights, slot, a, b, x, y = _case(3)
    enabled = np.ones(L, np.int32)
    lora_ids = [101, 102, 103]
    mapping = LoRAMapping(tuple(0 if s < 0 else lora_ids[s] for s in slot), (0,), False)
    w = PunicaWrapper(16, 4, max_loras=L, backend="xla")
    w.update_metadata(mapping, lora_ids, L + 1, 64)
    pad = 3
    ids_p = np.concatenate([ids, np.zeros((pad, K), np.int32)])
    weights_p = np.concatenate([weights, np.ones((pad, K), np.float32)])
    x_p = np.concatenate([x, np.ones((pad, H), np.float32)])
    y_p = np.concatenate([y, np.full((pad, K, 2 * I), 7.0, np.float32)])
    h = np.random.default_rng(4).standard_normal(((M + pad) * K, I)).astype(np.float32)
    y2 = np.random.default_rng(5).standard_normal((M + pad, K, H)).astype(np.float32)
    a2 = [np.random.default_rng(6).standard_normal((L, E, R, I)).astype(np.float32) / 4]
    b2 = [np.random.default_rng(7).standard_normal((L, E, H, R)).astype(np.float32) / 3]

    @jax.jit
    def step(w, y, x, y2, h):
        y, *layout = w.add_lora_w13(y, x, a, b, ids_p, weights_p, None, None, None, M + pad, K, L, enabled, E, K, 2,
                                    False, False)
        return y, w.add_lora_w2(y2, h, a2, b2, weights_p, *layout, M + pad, None, None, K, L, enabled, K, False, 0,
                                False)

    got13, got2 = (np.asarray(v) for v in step(w, jnp.asarray(y_p), jnp.asarray(x_p), jnp.asarray(y2),
                                               jnp.asarray(h)))
    slot_p = np.concatenate([slot, np.full(pad, -1, np.int32)])
    want13 = oracle.fused_moe_lora(y_p, x_p, a, b, ids_p, weights_p, slot_p, enabled, False)
    want2 = oracle.fused_moe_lora(y2, h, a2, b2, ids_p, weights_p, slot_p, enabled, True)
    assert oracle.rel_err(got13, want13) <= oracle.TOL["float32"]
    assert oracle.rel_err(got2, want2) <= oracle.TOL["float32"]
    np.testing.assert_array_equal(got13[M:], y_p[M:])
    np.testing.assert_array_equal(got2[M:], y2[M:])


@pytest.mark.parametrize("naive", [False, True], ids=["aligned", "naive"])
def test_triton_without_the_ffi_launcher_runs_xla_and_says_so(monkeypatch, caplog, naive):
    """On a GPU where the FFI launcher cannot run (jax_triton cannot pass the kernel's mid-list
    outputs), the triton MoE op runs the xla backend's, from a naive order too, and logs why."""
    import logging

    from jax_lora.ops import ffi_launcher, triton, triton_moe
    ids, weights, slot, a, b, x, y = _case(3)
    enabled = np.array([1, 0, 1], np.int32)
    layout = (None, ids.reshape(-1), None) if naive else moe_lora_align_block_size(ids, slot, E, 16, L, enabled)
    monkeypatch.setattr(triton, "_use_interpreter", lambda *arrays: False)
    monkeypatch.setattr(triton, "_use_ffi", lambda: False)
    monkeypatch.setattr(ffi_launcher, "unavailable_reason", lambda: "JAX_LORA_TRITON_LAUNCHER=jax_triton")
    triton_moe._log_fallback.cache_clear()
    with caplog.at_level(logging.INFO, logger="jax_lora"):
        got = fused_moe_lora(y, x, a, b, weights, *layout, slot, R, K, enabled, False, 0, backend="triton")
    assert "runs the xla backend's" in caplog.text and "jax_triton" in caplog.text
    want = oracle.fused_moe_lora(y, x, a, b, ids, weights, slot, enabled, False)
    assert oracle.rel_err(np.asarray(got), want) <= oracle.TOL["float32"]
