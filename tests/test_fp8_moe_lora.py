"""fp8 (e4m3) expert weights in the mixture-of-experts LoRA op (contract sections 9 and 11).

`torch_lora.ops.fused_moe_lora(..., lora_a_scale=, lora_b_scale=)` with A and / or B in e4m3 and
float32 channel scales (A: (L, E, r) per rank row, B: (L, E, n) per output column, or (L,) per
slot), on the "torch" reference and the Triton kernel (`lora_core.kernels.moe_lora`, in Triton's
interpreter on the CPU; the same cases compiled on CUDA are marked `gpu`), against the float64
oracle (tests/oracle.py) run on the dequantised weights: gate_up (two slices, one x row per token)
and down (one slice, router-weighted), the naive and the sorted pair order, a disabled slot,
tokens without an adapter and an expert -1 left untouched. Bad scales are refused by name.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

torch = pytest.importorskip("torch")

from . import oracle  # noqa: E402

T, TOP_K, E, L, RANK, K = 6, 2, 4, 3, 8, 32


def _quantized(w, per_tensor: bool):
    """(e4m3 tensor, float32 scale tensor, float64 dequantised array) of w (L, E, rows, cols):
    contract section 11's rule per row, or one scale per slot (L,)."""
    if per_tensor:
        q, scale = oracle.fp8_quantize(w.reshape(w.shape[0], 1, -1))
        q, scale = q.reshape(w.shape), scale.reshape(-1)
        deq = q.astype(np.float64) * scale.astype(np.float64)[:, None, None, None]
    else:
        q, scale = oracle.fp8_quantize(w)
        deq = oracle.fp8_dequantize(q, scale)
    tensor = torch.from_numpy(np.ascontiguousarray(q).view(np.uint8)).view(torch.float8_e4m3fn)
    return tensor, torch.from_numpy(np.ascontiguousarray(scale, np.float32)), deq


def _case(down: bool, a_fp8: bool, b_fp8: bool, per_tensor: bool, seed: int, device: str,
          dtype=torch.float32) -> dict:
    rng = np.random.default_rng(seed)
    widths = (K,) if down else (16, 16)
    k_in = 24 if down else K
    a, b, a_scale, b_scale, a64, b64 = [], [], [], [], [], []
    for n in widths:
        wa = rng.normal(size=(L, E, RANK, k_in)) / np.sqrt(k_in)
        wb = rng.normal(size=(L, E, n, RANK)) / np.sqrt(RANK)
        for w, fp8, out, scales, deqs in ((wa, a_fp8, a, a_scale, a64), (wb, b_fp8, b, b_scale, b64)):
            if fp8:
                t, sc, deq = _quantized(w, per_tensor)
                out.append(t.to(device))
                scales.append(sc.to(device))
                deqs.append(deq)
            else:
                t = torch.from_numpy(w).to(dtype)
                out.append(t.to(device))
                deqs.append(t.double().numpy())
    topk_ids = np.stack([rng.permutation(E)[:TOP_K] for _ in range(T)]).astype(np.int32)
    topk_ids[4, 1] = -1                                     # a choice without an expert
    token_lora = np.array([0, 2, -1, 1, 0, 2], np.int32)   # token 2 without an adapter; slot 1 disabled
    enabled = np.array([1, 0, 1], np.int32)
    w = rng.random((T, TOP_K)) + 0.1
    topk_weights = (w / w.sum(1, keepdims=True)).astype(np.float32)
    x = rng.normal(size=(T * TOP_K if down else T, k_in)).astype(np.float32)
    y = rng.normal(size=(T, TOP_K, sum(widths))).astype(np.float32)
    return dict(a=a, b=b, a_scale=a_scale or None, b_scale=b_scale or None, a64=a64, b64=b64, topk_ids=topk_ids,
                token_lora=token_lora, enabled=enabled, topk_weights=topk_weights, x=x, y=y, down=down,
                device=device, dtype=dtype)


def _run(c: dict, backend: str, order: str) -> np.ndarray:
    from torch_lora.ops import fused_moe_lora, moe_lora_align_block_size
    dev = c["device"]
    t = lambda v, dt=None: torch.from_numpy(v).to(dev) if dt is None else torch.from_numpy(v).to(dev, dt)
    topk_ids, token_lora, enabled = t(c["topk_ids"]), t(c["token_lora"]), t(c["enabled"])
    if order == "naive":
        sorted_ids, expert_ids, post_pad, block = None, topk_ids.reshape(-1), None, None
    else:
        block = 16
        sorted_ids, expert_ids, post_pad = moe_lora_align_block_size(topk_ids, token_lora, E, block, L, enabled)
    y = t(c["y"].copy(), c["dtype"])
    fused_moe_lora(y, t(c["x"], c["dtype"]), c["a"], c["b"], t(c["topk_weights"]), sorted_ids, expert_ids, post_pad,
                   token_lora, RANK, TOP_K, enabled, c["down"], 0, block_size=block, backend=backend,
                   lora_a_scale=c["a_scale"], lora_b_scale=c["b_scale"])
    return y.float().cpu().numpy()


def _want(c: dict) -> np.ndarray:
    return oracle.fused_moe_lora(c["y"], c["x"], c["a64"], c["b64"], c["topk_ids"], c["topk_weights"],
                                 c["token_lora"], c["enabled"], c["down"])


FP8_SIDES = [(True, True, False), (True, False, False), (False, True, False), (True, True, True)]
SIDE_IDS = ["fp8_a_b", "fp8_a", "fp8_b", "per_tensor"]


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("order", ["naive", "sorted"])
@pytest.mark.parametrize("down", [False, True], ids=["gate_up", "down"])
@pytest.mark.parametrize("a_fp8,b_fp8,per_tensor", FP8_SIDES, ids=SIDE_IDS)
def test_fp8_moe_lora_matches_the_float64_oracle_on_the_dequantised_weights(backend, order, down, a_fp8, b_fp8,
                                                                             per_tensor):
    c = _case(down, a_fp8, b_fp8, per_tensor, seed=int(down) * 7 + int(a_fp8) * 3 + int(b_fp8), device="cpu")
    got = _run(c, backend, order)
    want = _want(c)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    untouched = (c["token_lora"] == -1) | (c["enabled"][np.maximum(c["token_lora"], 0)] == 0)
    np.testing.assert_array_equal(got[untouched], c["y"][untouched])       # no adapter / a disabled slot
    np.testing.assert_array_equal(got[4, 1], c["y"][4, 1])                 # expert -1
    assert oracle.rel_err(got, c["y"]) > 1e-3                              # the live pairs moved


def test_fp8_moe_lora_deterministic_matches_the_oracle():
    """deterministic=True (the batch-invariant products / plan) takes the scales as well."""
    from torch_lora.ops import fused_moe_lora
    c = _case(False, True, True, False, seed=3, device="cpu")
    for backend in ("torch", "triton"):
        y = torch.from_numpy(c["y"].copy())
        fused_moe_lora(y, torch.from_numpy(c["x"]), c["a"], c["b"], torch.from_numpy(c["topk_weights"]), None,
                       torch.from_numpy(c["topk_ids"]).reshape(-1), None, torch.from_numpy(c["token_lora"]), RANK,
                       TOP_K, torch.from_numpy(c["enabled"]), False, 0, backend=backend, deterministic=True,
                       lora_a_scale=c["a_scale"], lora_b_scale=c["b_scale"])
        np.testing.assert_allclose(y.numpy(), _want(c), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("change,match", [
    ("no_scale", r"lora_a_stacked\[0\] is float8_e4m3fn: lora_a_scale\[0\] must give its scales, \(3, 4, 8\) per "
                 r"channel or \(3,\) per tensor"),
    ("shape", r"lora_b_scale\[1\] must have shape \(3, 4, 16\) per channel"),
    ("dtype", r"lora_a_scale\[0\] must be float32"),
    ("16bit_scale", r"lora_b_scale\[0\] is given, but lora_b_stacked\[0\] is float32, not fp8"),
    ("mixed_slices", r"the slices of lora_a_stacked must be all fp8"),
])
def test_bad_fp8_moe_scales_are_refused(change, match):
    from torch_lora.ops import fused_moe_lora
    c = _case(False, True, True, False, seed=5, device="cpu")
    a, b, a_scale, b_scale = list(c["a"]), list(c["b"]), list(c["a_scale"]), list(c["b_scale"])
    if change == "no_scale":
        a_scale[0] = None
    elif change == "shape":
        b_scale[1] = b_scale[1][:, :, :3]
    elif change == "dtype":
        a_scale[0] = a_scale[0].double()
    elif change == "16bit_scale":
        b = [w.float() for w in b]
    else:
        a[1] = a[1].float()
    with pytest.raises(ValueError, match=match):
        fused_moe_lora(torch.from_numpy(c["y"].copy()), torch.from_numpy(c["x"]), a, b,
                       torch.from_numpy(c["topk_weights"]), None, torch.from_numpy(c["topk_ids"]).reshape(-1), None,
                       torch.from_numpy(c["token_lora"]), RANK, TOP_K, torch.from_numpy(c["enabled"]), False, 0,
                       backend="torch", lora_a_scale=a_scale, lora_b_scale=b_scale)


@pytest.mark.gpu
@pytest.mark.parametrize("order", ["naive", "sorted"])
@pytest.mark.parametrize("down", [False, True], ids=["gate_up", "down"])
@pytest.mark.parametrize("a_fp8,b_fp8,per_tensor", FP8_SIDES, ids=SIDE_IDS)
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_gpu_fp8_moe_lora_matches_the_float64_oracle(order, down, a_fp8, b_fp8, per_tensor, dtype):
    """The compiled kernel on CUDA (16-bit activations: e4m3 tiles enter the tensor-core products
    in the activations' dtype, the bfloat16 expand split in two terms) against the oracle on the
    dequantised weights and the 16-bit activations as given, within the activation dtype's
    rounding of the output."""
    dt = getattr(torch, dtype)
    c = _case(down, a_fp8, b_fp8, per_tensor, seed=11, device="cuda", dtype=dt)
    x16 = torch.from_numpy(c["x"]).to(dt).float().numpy()
    y16 = torch.from_numpy(c["y"]).to(dt).float().numpy()
    c16 = dict(c, x=x16, y=y16)
    got = _run(c16, "triton", order)
    want = _want(c16)
    tol = 2e-2 if dtype == "bfloat16" else 1e-2      # the output's rounding; the float16 expand's tf32 dot
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol)
    untouched = (c["token_lora"] == -1) | (c["enabled"][np.maximum(c["token_lora"], 0)] == 0)
    np.testing.assert_array_equal(got[untouched], y16[untouched])


def test_quantized_fixture_is_the_contract_rule():
    """The fixtures' e4m3 values: tests/oracle.py's rule (amax / 448 per row), exact in float32."""
    w = np.random.default_rng(0).normal(size=(L, E, RANK, K))
    t, scale, deq = _quantized(w, per_tensor=False)
    q = t.view(torch.uint8).numpy().view(ml_dtypes.float8_e4m3fn)
    assert np.allclose(deq, w, rtol=2 ** -4, atol=0)
    np.testing.assert_array_equal(scale.numpy(), (np.abs(w).max(-1) / 448).astype(np.float32))
    np.testing.assert_array_equal(deq, q.astype(np.float64) * scale.numpy().astype(np.float64)[..., None])

