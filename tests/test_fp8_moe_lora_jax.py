"""fp8 (e4m3) expert weights in JAX's mixture-of-experts LoRA op (contract sections 9 and 11).

`jax_lora.ops.fused_moe_lora(..., lora_a_scale=, lora_b_scale=)` with A and / or B in e4m3 and
float32 channel scales ((L, E, r) per rank row / (L, E, n) per output column, or (L,) per slot) on
the backends xla (the jnp reference), pallas_tpu (TPU interpret mode) and triton (Triton's
interpreter through the launcher), their deterministic forms too, under `jax.jit`, against the
float64 oracle (tests/oracle.py) on the dequantised weights: gate_up (two slices, one x row per
token) and down (one slice, router-weighted), the aligned and the naive pair order, a disabled
slot, tokens without an adapter and an expert -1 left untouched. The wrapper's add_lora_w13 /
add_lora_w2 forward the scales; bad scales are refused by name; a backend whose MoE kernel takes no
scales runs the xla one, said on the `jax_lora` logger.
"""

from __future__ import annotations

import logging
import os

import jax
import ml_dtypes
import numpy as np
import pytest

from jax_lora import PunicaWrapper
from jax_lora.ops import fused_moe_lora, moe_lora_align_block_size
from lora_core.host_mapping import LoRAMapping

from . import oracle

T, TOP_K, E, L, RANK, K = 6, 2, 4, 3, 8, 32
# Triton on the CPU runs in the interpreter (tests/conftest.py sets it without CUDA); on a GPU
# machine the compiled kernel is checked by the gpu-marked test below, with 16-bit activations.
INTERPRETED = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                 reason="Triton on the CPU needs the interpreter (CUDA present: the gpu test)")
BACKENDS = ["xla", "pallas_tpu", pytest.param("triton", marks=INTERPRETED)]


def _quantized(w, per_tensor: bool):
    """(e4m3 array, float32 scale, float64 dequantised array) of w (L, E, rows, cols): contract
    section 11's rule per row, or one scale per slot (L,)."""
    if per_tensor:
        q, scale = oracle.fp8_quantize(w.reshape(w.shape[0], 1, -1))
        q, scale = q.reshape(w.shape), scale.reshape(-1)
        return q, scale, q.astype(np.float64) * scale.astype(np.float64)[:, None, None, None]
    q, scale = oracle.fp8_quantize(w)
    return q, scale, oracle.fp8_dequantize(q, scale)


def _case(down: bool, a_fp8: bool, b_fp8: bool, per_tensor: bool, seed: int) -> dict:
    rng = np.random.default_rng(seed)
    widths = (K,) if down else (16, 16)
    k_in = 24 if down else K
    a, b, a_scale, b_scale, a64, b64 = [], [], [], [], [], []
    for n in widths:
        wa = rng.normal(size=(L, E, RANK, k_in)) / np.sqrt(k_in)
        wb = rng.normal(size=(L, E, n, RANK)) / np.sqrt(RANK)
        for w, fp8, out, scales, deqs in ((wa, a_fp8, a, a_scale, a64), (wb, b_fp8, b, b_scale, b64)):
            if fp8:
                q, sc, deq = _quantized(w, per_tensor)
                out.append(q)
                scales.append(sc)
                deqs.append(deq)
            else:
                out.append(w.astype(np.float32))
                deqs.append(w.astype(np.float32).astype(np.float64))
    topk_ids = np.stack([rng.permutation(E)[:TOP_K] for _ in range(T)]).astype(np.int32)
    topk_ids[4, 1] = -1                                     # a choice without an expert
    token_lora = np.array([0, 2, -1, 1, 0, 2], np.int32)   # token 2 without an adapter; slot 1 disabled
    enabled = np.array([1, 0, 1], np.int32)
    w = rng.random((T, TOP_K)) + 0.1
    topk_weights = (w / w.sum(1, keepdims=True)).astype(np.float32)
    x = rng.normal(size=(T * TOP_K if down else T, k_in)).astype(np.float32)
    y = rng.normal(size=(T, TOP_K, sum(widths))).astype(np.float32)
    return dict(a=a, b=b, a_scale=a_scale or None, b_scale=b_scale or None, a64=a64, b64=b64, topk_ids=topk_ids,
                token_lora=token_lora, enabled=enabled, topk_weights=topk_weights, x=x, y=y, down=down)


def _want(c: dict) -> np.ndarray:
    return oracle.fused_moe_lora(c["y"], c["x"], c["a64"], c["b64"], c["topk_ids"], c["topk_weights"],
                                 c["token_lora"], c["enabled"], c["down"])


def _run(c: dict, backend: str, order: str, deterministic: bool = False) -> np.ndarray:
    if order == "naive":
        layout = (None, c["topk_ids"].reshape(-1), None)
    else:
        layout = moe_lora_align_block_size(c["topk_ids"], c["token_lora"], E, 16, L, c["enabled"])

    @jax.jit
    def step(y, x, a, b, a_scale, b_scale):
        return fused_moe_lora(y, x, a, b, c["topk_weights"], *layout, c["token_lora"], RANK, TOP_K, c["enabled"],
                              c["down"], 0, backend=backend, deterministic=deterministic, lora_a_scale=a_scale,
                              lora_b_scale=b_scale)
    return np.asarray(step(c["y"], c["x"], c["a"], c["b"], c["a_scale"], c["b_scale"]))


def _check(c: dict, got: np.ndarray) -> None:
    np.testing.assert_allclose(got, _want(c), rtol=1e-5, atol=1e-5)
    untouched = (c["token_lora"] == -1) | (c["enabled"][np.maximum(c["token_lora"], 0)] == 0)
    np.testing.assert_array_equal(got[untouched], c["y"][untouched])       # no adapter / a disabled slot
    np.testing.assert_array_equal(got[4, 1], c["y"][4, 1])                 # expert -1
    assert oracle.rel_err(got, c["y"]) > 1e-3                              # the live pairs moved


FP8_SIDES = [(True, True, False), (True, False, False), (False, True, False), (True, True, True)]
SIDE_IDS = ["fp8_a_b", "fp8_a", "fp8_b", "per_tensor"]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("order", ["naive", "sorted"])
@pytest.mark.parametrize("down", [False, True], ids=["gate_up", "down"])
@pytest.mark.parametrize("a_fp8,b_fp8,per_tensor", FP8_SIDES, ids=SIDE_IDS)
def test_fp8_moe_lora_matches_the_float64_oracle_on_the_dequantised_weights(backend, order, down, a_fp8, b_fp8,
                                                                             per_tensor):
    c = _case(down, a_fp8, b_fp8, per_tensor, seed=int(down) * 7 + int(a_fp8) * 3 + int(b_fp8))
    assert any(str(w.dtype) == "float8_e4m3fn" for w in c["a"] + c["b"])
    _check(c, _run(c, backend, order))


@pytest.mark.parametrize("backend", BACKENDS)
def test_fp8_moe_lora_deterministic_matches_the_oracle(backend):
    """deterministic=True (the batch-invariant products / plan) takes the scales as well."""
    c = _case(False, True, True, False, seed=3)
    _check(c, _run(c, backend, "sorted", deterministic=True))


def test_the_scales_reach_the_result():
    """Doubling one expert's A scales of a live slot doubles that expert's LoRA terms (the kernel
    reads the scales, not the e4m3 values alone)."""
    c = _case(True, True, False, False, seed=5)
    base = _run(c, "xla", "sorted")
    c2 = dict(c, a_scale=[c["a_scale"][0].copy()])
    c2["a_scale"][0][0, :] *= 2
    moved = _run(c2, "xla", "sorted")
    assert not np.allclose(base, moved)
    for backend in ("pallas_tpu",) + (("triton",) if os.environ.get("TRITON_INTERPRET") == "1" else ()):
        np.testing.assert_allclose(_run(c2, backend, "sorted"), moved, rtol=1e-5, atol=1e-5)


def test_bad_scales_are_refused_by_name():
    c = _case(True, True, True, False, seed=1)
    with pytest.raises(ValueError, match="lora_a_scale must give its scales"):
        _run(dict(c, a_scale=None), "xla", "naive")
    with pytest.raises(ValueError, match=r"lora_b_scale must have shape \(3, 4, 32\)"):
        _run(dict(c, b_scale=[c["b_scale"][0][:, :2]]), "xla", "naive")
    with pytest.raises(ValueError, match="lora_b_scale must be float32"):
        _run(dict(c, b_scale=[c["b_scale"][0].astype(np.float16)]), "xla", "naive")
    c16 = _case(True, False, False, False, seed=1)
    with pytest.raises(ValueError, match="lora_a_scale is given"):
        _run(dict(c16, a_scale=[np.ones((L, E, RANK), np.float32)]), "xla", "naive")
    mixed = _case(False, True, True, False, seed=2)
    mixed["a"] = [mixed["a"][0], mixed["a"][1].astype(np.float32)]
    with pytest.raises(ValueError, match="must be all fp8"):
        _run(mixed, "xla", "naive")


def test_a_backend_without_expert_scales_runs_xla_and_says_so(monkeypatch, caplog):
    """A backend whose fused_moe_lora takes no lora_a_scale gets the xla backend's for fp8 expert
    weights, with a warning on the jax_lora logger (16-bit calls keep the backend)."""
    import types

    from jax_lora.ops import fused_moe, xla_moe

    calls = []

    def unscaled(y3, x, lora_a, lora_b, pair_weight, layout, offsets, lora_ranks):
        calls.append(1)
        return xla_moe.fused_moe_lora(y3, x, lora_a, lora_b, pair_weight, layout, offsets, lora_ranks)
    fake = types.SimpleNamespace(NAME="unscaled_test", fused_moe_lora=unscaled)
    monkeypatch.setattr(fused_moe, "backend_module", lambda backend, deterministic=False: fake)
    c = _case(True, True, True, False, seed=4)
    with caplog.at_level(logging.WARNING, logger="jax_lora"):
        got = _run(c, "unscaled_test", "sorted")
    assert not calls and "does not apply fp8 expert weight scales" in caplog.text
    _check(c, got)
    _run(_case(True, False, False, False, seed=4), "unscaled_test", "sorted")
    assert calls


def test_wrapper_w13_w2_forward_the_scales_under_jit():
    """add_lora_w13 / add_lora_w2 with fp8 slices and their scales, traced with the wrapper as an
    argument, equal the oracle on the dequantised weights."""
    up = _case(False, True, True, False, seed=8)
    down = _case(True, True, True, True, seed=9)
    lora_ids = [101, 102, 103]
    mapping = LoRAMapping(tuple(0 if s < 0 else lora_ids[s] for s in up["token_lora"]), (0,), False)
    w = PunicaWrapper(8, 4, max_loras=L, backend="xla")
    w.update_metadata(mapping, lora_ids, L + 1, 64)
    enabled = up["enabled"]

    @jax.jit
    def step(w, y, x, y2, h):
        y, *layout = w.add_lora_w13(y, x, up["a"], up["b"], up["topk_ids"], up["topk_weights"], None, None, None, T,
                                    TOP_K, L, enabled, E, TOP_K, 2, False, False, lora_a_scale=up["a_scale"],
                                    lora_b_scale=up["b_scale"])
        return y, w.add_lora_w2(y2, h, down["a"], down["b"], up["topk_weights"], *layout, T, None, None, TOP_K, L,
                                enabled, TOP_K, False, 0, False, lora_a_scale=down["a_scale"],
                                lora_b_scale=down["b_scale"])

    got13, got2 = (np.asarray(v) for v in step(w, up["y"], up["x"], down["y"], down["x"]))
    _check(up, got13)
    want2 = oracle.fused_moe_lora(down["y"], down["x"], down["a64"], down["b64"], up["topk_ids"],
                                  up["topk_weights"], up["token_lora"], enabled, True)
    np.testing.assert_allclose(got2, want2, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match=r"lora_a_scale\[0\] must give its scales"):
        w.add_lora_w13(up["y"], up["x"], up["a"], up["b"], up["topk_ids"], up["topk_weights"], None, None, None, T,
                       TOP_K, L, enabled, E, TOP_K, 2, False, False, lora_b_scale=up["b_scale"])



@pytest.mark.gpu
@pytest.mark.parametrize("order", ["naive", "sorted"])
@pytest.mark.parametrize("down", [False, True], ids=["gate_up", "down"])
@pytest.mark.parametrize("a_fp8,b_fp8,per_tensor", FP8_SIDES, ids=SIDE_IDS)
def test_gpu_fp8_moe_lora_triton_matches_the_float64_oracle(order, down, a_fp8, b_fp8, per_tensor):
    """The compiled Triton kernel through the XLA FFI launcher under jax.jit, bfloat16 activations
    (e4m3 tiles enter the tensor-core products in bfloat16), against the oracle on the dequantised
    weights and the bfloat16 activations as given, within bfloat16's rounding of the output."""
    assert jax.default_backend() == "gpu"
    c = _case(down, a_fp8, b_fp8, per_tensor, seed=11)
    x16, y16 = c["x"].astype(ml_dtypes.bfloat16), c["y"].astype(ml_dtypes.bfloat16)
    got = _run(dict(c, x=x16, y=y16), "triton", order).astype(np.float32)
    c32 = dict(c, x=x16.astype(np.float32), y=y16.astype(np.float32))
    np.testing.assert_allclose(got, _want(c32), rtol=2e-2, atol=2e-2)
    untouched = (c["token_lora"] == -1) | (c["enabled"][np.maximum(c["token_lora"], 0)] == 0)
    np.testing.assert_array_equal(got[untouched], c32["y"][untouched])
