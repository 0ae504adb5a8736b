"""DoRA on the torch side: torch_lora.PunicaWrapper's dora_scale_stacked (backends torch and
triton, against a float64 oracle, and its plan cache)."""

from __future__ import annotations

import numpy as np
import pytest

from .impls import torch_triton_device, triton_runs

torch = pytest.importorskip("torch")

import torch_lora  # noqa: E402
from torch_lora import LoRAMapping  # noqa: E402

T, L, R, H, WIDTHS = 6, 3, 16, 32, (16, 32)
IDS = (1, 0, 3, 2, 3, 1)                    # LoRA id per token (0: no adapter); slot = id - 1


def _backend(backend):
    if backend == "triton" and not triton_runs():
        pytest.skip("no GPU and Triton's interpreter is not on (TRITON_INTERPRET=1 before import)")
    return torch_triton_device() if backend == "triton" else "cpu"


def _case(seed=8):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((T, H)).astype(np.float32)
    a = [(rng.standard_normal((L, 1, R, H)) / 6).astype(np.float32) for _ in WIDTHS]
    b = [(rng.standard_normal((L, 1, n, R)) / 4).astype(np.float32) for n in WIDTHS]
    g = [rng.uniform(0.5, 2.0, (L, n)).astype(np.float32) for n in WIDTHS]
    y = rng.standard_normal((T, sum(WIDTHS))).astype(np.float32)
    return x, a, b, g, y


def _oracle(x, a, b, g, y, scale=0.5):
    """float64: y[t, slice s] = g_s[slot] * (y + scale * (x A_s^T) B_s^T) for tokens with a slot
    (g None: no scale), y unchanged elsewhere."""
    want = y.astype(np.float64).copy()
    for t, i in enumerate(IDS):
        if i:
            off = 0
            for s, n in enumerate(WIDTHS):
                d = scale * (x[t].astype(np.float64) @ a[s][i - 1, 0].T) @ b[s][i - 1, 0].T
                gs = 1.0 if g is None else g[s][i - 1]
                want[t, off:off + n] = gs * (want[t, off:off + n] + d)
                off += n
    return want


def _wrapper(backend, device, deterministic=False):
    w = torch_lora.PunicaWrapper(16, 4, device, max_loras=L, backend=backend, deterministic=deterministic)
    w.update_metadata(LoRAMapping(IDS, IDS), [1, 2, 3], L + 1, 64)
    return w


def _t(arrays, device):
    return [torch.from_numpy(v).to(device) for v in arrays]


@pytest.mark.parametrize("backend,deterministic", [("torch", False), ("torch", True), ("triton", False),
                                                   ("triton", True)])
def test_wrapper_dora_scales_equal_the_oracle(backend, deterministic):
    """add_lora_linear and add_expand with dora_scale_stacked: g_s[slot] * (y + delta) per token, as
    (L, n_s) and (L, 1, n_s) scales, within 1e-4 of the float64 oracle; rows without a slot untouched."""
    dev = _backend(backend)
    x, a, b, g, y = _case()
    w = _wrapper(backend, dev, deterministic)
    want = _oracle(x, a, b, g, y)
    A, B, G = _t(a, dev), _t(b, dev), _t(g, dev)
    for scales in (G, [G[0][:, None], G[1]]):
        got = torch.from_numpy(y.copy()).to(dev)
        w.add_lora_linear(got, torch.from_numpy(x).to(dev), A, B, None, 0.5, WIDTHS, dora_scale_stacked=scales)
        assert np.abs(got.cpu().double().numpy() - want).max() < 1e-4
        assert np.array_equal(got[1].cpu().numpy(), y[1])                          # token without adapter
    buf = torch.zeros(len(WIDTHS), T, R, device=dev)
    w.add_shrink(buf, torch.from_numpy(x).to(dev), A, 0.5)
    got = torch.from_numpy(y.copy()).to(dev)
    w.add_expand(got, buf, B, None, WIDTHS, dora_scale_stacked=G)
    assert np.abs(got.cpu().double().numpy() - want).max() < 1e-4
    half = _oracle(x, a, b, [g[0], np.ones_like(g[1])], y)                          # slice 1 unscaled
    got = torch.from_numpy(y.copy()).to(dev)
    w.add_lora_linear(got, torch.from_numpy(x).to(dev), A, B, None, 0.5, WIDTHS, dora_scale_stacked=[G[0], None])
    assert np.abs(got.cpu().double().numpy() - half).max() < 1e-4


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_plan_cache_keeps_dora_and_plain_calls_apart(backend):
    """The same weights called with scales, without, with other scale tensors, and after an in-place
    write of a scale: each call gets its own math (a plan is never shared between them)."""
    dev = _backend(backend)
    x, a, b, g, y = _case(9)
    w = _wrapper(backend, dev)
    A, B, G = _t(a, dev), _t(b, dev), _t(g, dev)
    xt = torch.from_numpy(x).to(dev)

    def run(scales):
        got = torch.from_numpy(y.copy()).to(dev)
        w.add_lora_linear(got, xt, A, B, None, 0.5, WIDTHS, dora_scale_stacked=scales)
        return got.cpu().double().numpy()

    plain, scaled = _oracle(x, a, b, None, y), _oracle(x, a, b, g, y)
    for _ in range(2):                                  # the second round runs cached plans
        assert np.abs(run(G) - scaled).max() < 1e-4
        assert np.abs(run(None) - plain).max() < 1e-4
    ones = [torch.ones_like(v) for v in G]
    assert np.abs(run(ones) - plain).max() < 1e-4       # other scale objects, same weights
    doubled = _oracle(x, a, b, [g[0], 2 * g[1]], y)
    G[1].mul_(2)                                        # a slot write in place is seen
    assert np.abs(run(G) - doubled).max() < 1e-4


def test_wrapper_dora_scale_errors_name_the_argument():
    x, a, b, g, y = _case()
    w = _wrapper("torch", "cpu")
    A, B, G = _t(a, "cpu"), _t(b, "cpu"), _t(g, "cpu")
    yt, xt = torch.from_numpy(y), torch.from_numpy(x)
    with pytest.raises(ValueError, match=r"dora_scale_stacked must have one entry per slice \(2\), got 1"):
        w.add_lora_linear(yt, xt, A, B, None, 0.5, WIDTHS, dora_scale_stacked=[G[0]])
    with pytest.raises(ValueError, match=r"dora_scale_stacked\[1\] must have shape \(3, 32\) or \(3, 1, 32\)"):
        w.add_lora_linear(yt, xt, A, B, None, 0.5, WIDTHS, dora_scale_stacked=[G[0], G[0]])
    with pytest.raises(TypeError, match=r"dora_scale_stacked\[0\] must have dtype in .*got int32"):
        w.add_lora_linear(yt, xt, A, B, None, 0.5, WIDTHS, dora_scale_stacked=[G[0].int(), G[1]])
    with pytest.raises(TypeError, match=r"dora_scale_stacked\[1\] must be a torch.Tensor, got ndarray"):
        w.add_lora_linear(yt, xt, A, B, None, 0.5, WIDTHS, dora_scale_stacked=[G[0], g[1]])
    bias = [None, torch.zeros(L, 32)]
    with pytest.raises(ValueError, match=r"slice 1 has both a LoRA bias \(lora_bias_stacked\[1\]\) and a DoRA "
                                         r"column scale \(dora_scale_stacked\[1\]\)"):
        w.add_lora_linear(yt, xt, A, B, bias, 0.5, WIDTHS, dora_scale_stacked=G)
    with pytest.raises(ValueError, match=r"slice 1 has both a LoRA bias"):
        w.add_expand(yt, torch.zeros(2, T, R), B, bias, WIDTHS, dora_scale_stacked=G)
    assert np.array_equal(yt.numpy(), _case()[4])       # nothing was written
