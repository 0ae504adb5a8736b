"""Valid but unusual inputs through the public API, against the float64 oracle (tests/oracle.py).

Each case here failed before its fix:
- torch `lora_ranks` given as a strided int32 view (`ranks[::2]`): the Triton kernels read slot i
  at `ranks_ptr + i`, so they used other slots' ranks (wrong numbers, no error).
- torch `lora_shrink` / `lora_expand` metadata tensors given as strided views (`meta_args` entries
  spread with a step): the Triton kernels read them as dense arrays (wrong rows, NaN).

Also: torch add_lora_linear with a bias list holding None and a NumPy offset_start. CPU.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import torch_lora
from torch_lora import LoRAMapping, ops

from . import oracle, torch_helpers
from .impls import torch_triton_device, triton_runs

BACKENDS = ["torch", pytest.param("triton", marks=pytest.mark.skipif(not triton_runs(),
                                                                      reason="Triton cannot run here"))]


def _device(backend: str) -> str:
    return torch_triton_device() if backend == "triton" else "cpu"


def _randn(rng, *shape, device="cpu"):
    return torch.from_numpy(rng.standard_normal(shape).astype(np.float32)).to(device)


def _spread(t: torch.Tensor, fill: int = -7) -> torch.Tensor:
    """A stride-2 view holding t's values, with `fill` in the gaps (what a dense read would see)."""
    big = torch.full((2 * t.shape[0],) + tuple(t.shape[1:]), fill, dtype=t.dtype, device=t.device)
    big[::2] = t
    view = big[::2]
    assert not view.is_contiguous() and torch.equal(view, t)
    return view


def _np(t: torch.Tensor) -> np.ndarray:
    return t.detach().to("cpu").double().numpy()


@pytest.mark.parametrize("backend", BACKENDS)
def test_strided_lora_ranks(backend):
    """lora_ranks as a strided int32 view: every op and wrapper method uses each slot's own rank."""
    device = _device(backend)
    rng = np.random.default_rng(0)
    T, H, r, L = 3, 16, 4, 3
    idx = [2, 1, 0]
    x, a, b = _randn(rng, T, H, device=device), _randn(rng, L, 1, r, H, device=device), _randn(rng, L, 1, 6, r,
                                                                                               device=device)
    ranks = _spread(torch.tensor([1, 4, 2], dtype=torch.int32, device=device), fill=4)
    a0, b0 = _np(a).copy(), _np(b).copy()
    for slot, rank in enumerate([1, 4, 2]):
        a0[slot, :, rank:] = 0
        b0[slot, :, :, rank:] = 0
    w = torch_lora.PunicaWrapper(8, 4, device, max_loras=L, backend=backend)
    ids = tuple(i + 1 for i in idx)
    w.update_metadata(LoRAMapping(ids, ids, False), [1, 2, 3], L + 1, 32)

    y = _randn(rng, T, 6, device=device)
    want = oracle.lora_linear(_np(y), _np(x), [a0], [b0], None, 1.0, idx)
    w.add_lora_linear(y, x, [a], [b], None, 1.0, (6,), lora_ranks=ranks)
    assert oracle.rel_err(_np(y), want) <= 1e-5

    want_buf = oracle.shrink(_np(x), [a0], idx, 1.0)
    out = ops.bgmv_shrink(x, a, torch.tensor(idx, device=device), 1.0, backend=backend, lora_ranks=ranks)
    assert oracle.rel_err(_np(out), want_buf[0]) <= 1e-5

    buf = torch.full((1, T, r), float("nan"), device=device)
    w.add_shrink(buf, x, [a], 1.0, lora_ranks=ranks)
    assert oracle.rel_err(_np(buf), want_buf) <= 1e-5
    y = _randn(rng, T, 6, device=device)
    want = oracle.expand(_np(buf), [b0], _np(y), idx, 0, True)
    w.add_expand(y, buf, [b], None, (6,), 0, True, lora_ranks=ranks)
    assert oracle.rel_err(_np(y), want) <= 1e-5


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("spread", [(0,), (4,), (0, 1, 2, 3, 4)], ids=["mapping", "lora_ids", "all"])
def test_strided_kernel_metadata(backend, spread):
    """lora_shrink / lora_expand with meta_args entries as strided views give the dense results."""
    device = _device(backend)
    rng = np.random.default_rng(1)
    T, H, r, L = 4, 16, 3, 3
    idx = [2, -1, 0, 2]
    x, a, b = _randn(rng, T, H, device=device), _randn(rng, L, 1, r, H, device=device), _randn(rng, L, 1, 5, r,
                                                                                               device=device)
    meta = torch_lora.LoRAKernelMeta.make(L, T, device)
    meta.prepare_tensors(torch.tensor(idx, dtype=torch.int32, device=device))
    args = list(meta.meta_args(T))
    for i in spread:
        args[i] = _spread(args[i])

    buf = torch.full((1, T, r), float("nan"), device=device)
    ops.lora_shrink(x, a, buf, *args, 0.5, backend=backend)
    want = oracle.shrink(_np(x), [_np(a)], idx, 0.5)
    assert oracle.rel_err(_np(buf), want) <= 1e-5

    y = _randn(rng, T, 7, device=device)
    y0 = y.clone()
    ops.lora_expand(buf, b, y, *args, offset_start=1, add_inputs=True, backend=backend)
    assert oracle.rel_err(_np(y), oracle.expand(want, [_np(b)], _np(y0), idx, 1, True)) <= 1e-5
    assert torch.equal(y[1], y0[1])  # the -1 row is untouched


def test_bias_with_none_entries_and_numpy_offset_start():
    """add_lora_linear takes a bias list [tensor, None] (as add_expand does), and an
    `offset_start` given as np.int64 is accepted."""
    rng = torch_helpers.rng(10)
    a, b = torch_helpers.stacked(rng, 2, 4, 8, (3, 4))
    bias = [torch.tensor(rng.standard_normal((2, 3)), dtype=torch.float32), None]
    w = torch_helpers.wrapper((1, 0, 2), [1, 2])
    x = torch.tensor(rng.standard_normal((3, 8)), dtype=torch.float32)
    y = torch.zeros(3, 7)
    w.add_lora_linear(y, x, a, b, bias, 1.0, (3, 4))
    assert torch_helpers.rel(y.numpy(), torch_helpers.oracle_linear(torch.zeros(3, 7), x, a, b, bias, 1.0, [0, -1, 1],
                                                                    (3, 4))) < 1e-5
    buf = torch.tensor(rng.standard_normal((2, 3, 4)), dtype=torch.float32)
    y2 = torch.zeros(3, 9)
    w.add_expand(y2, buf, b, bias, (3, 4), np.int64(2), True)
    assert torch.equal(y2[:, :2], torch.zeros(3, 2)) and torch.equal(y2[1], torch.zeros(9))
    want = buf[0, 0].double().numpy() @ b[0][0, 0].double().numpy().T + bias[0][0].double().numpy()
    np.testing.assert_allclose(y2[0, 2:5].numpy(), want, rtol=1e-5, atol=1e-5)
