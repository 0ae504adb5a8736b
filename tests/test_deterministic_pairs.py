"""Deterministic mode with several adapters per token (contract section 10 under `deterministic=True`).

A probe token carries k = 2 or 4 weighted (adapter, strength) pairs. Its add_lora_linear row
through a `PunicaWrapper(..., deterministic=True)` is computed alone (a batch of one token) and
inside larger mixed batches: neighbours with k pairs, fewer pairs, one plain adapter and none, the
probe at a random position. The row must be bitwise the same in every batch, and every batch's
result must match the float64 oracle (`oracle.multi_lora_linear`), so a path that is invariant but
wrong fails too. The paired add_lora_logits (the LM head, one pair at a time) is checked the same way.

On the CPU: the reference backends (jax xla, torch) and the Triton kernels in Triton's
interpreter (jax-triton through its callback, torch-triton on CPU tensors), tiny shapes.
tests/test_gpu_deterministic.py's `test_pairs_rows_bitwise_equal_compiled` runs the Triton
kernels compiled on a GPU.
"""

from __future__ import annotations

import numpy as np
import pytest

from lora_core.host_mapping import LoRAMapping

from . import oracle
from .impls import IMPLS

HIDDEN, RANK, SLOTS, SLICES, SCALE, VOCAB = 64, 32, 6, (24, 8), 0.5, 32
LORA_IDS = [101 + s for s in range(SLOTS)]
CPU_NAMES = ("jax-xla", "jax-triton", "torch-ref", "torch-triton")
CPU_PARAMS = [pytest.param(impl, k, id=f"{impl.name}-k{k}", marks=impl.marks)
              for impl in IMPLS if impl.name in CPU_NAMES for k in (2, 4)]


class PairTraffic:
    """Weights (float32), a probe token with k pairs, and random mixed batches around it."""

    def __init__(self, k: int, seed: int = 0):
        rng = self.rng = np.random.default_rng(seed)
        self.k = k
        self.lora_a = [(rng.standard_normal((SLOTS, RANK, HIDDEN)) / np.sqrt(HIDDEN)).astype(np.float32)
                       for _ in SLICES]
        self.lora_b = [(rng.standard_normal((SLOTS, n, RANK)) / np.sqrt(RANK)).astype(np.float32) for n in SLICES]
        self.head_a = (rng.standard_normal((SLOTS, RANK, HIDDEN)) / np.sqrt(HIDDEN)).astype(np.float32)
        self.head_b = (rng.standard_normal((SLOTS, VOCAB, RANK)) / np.sqrt(RANK)).astype(np.float32)
        self.probe_x = rng.standard_normal(HIDDEN).astype(np.float32)
        self.probe_y = rng.standard_normal(sum(SLICES)).astype(np.float32)
        self.probe_slots = rng.choice(SLOTS, size=k, replace=False)
        self.probe_weights = rng.uniform(-1.0, 2.0, size=k).astype(np.float32)

    def batch(self, size: int):
        """(x, y, slots (size, k) -1 padded, weights (size, k), probe row) of a mixed batch."""
        rng, k = self.rng, self.k
        x = rng.standard_normal((size, HIDDEN)).astype(np.float32)
        y = rng.standard_normal((size, sum(SLICES))).astype(np.float32)
        slots = np.full((size, k), -1, np.int64)
        weights = np.zeros((size, k), np.float32)
        for t in range(size):
            n = [k, k, 1, 0, int(rng.integers(0, k + 1))][t % 5]       # k pairs, one adapter, none, any
            slots[t, :n] = rng.choice(SLOTS, size=n, replace=False)
            weights[t, :n] = rng.uniform(-1.0, 2.0, size=n) if n != 1 or t % 2 else 1.0
        row = int(rng.integers(0, size))
        x[row], y[row] = self.probe_x, self.probe_y
        slots[row], weights[row] = self.probe_slots, self.probe_weights
        return x, y, slots, weights, row


def _mapping(slots, weights) -> LoRAMapping:
    ids = [tuple(LORA_IDS[s] for s in row if s >= 0) for row in slots]
    ws = [tuple(float(w) for s, w in zip(row, wrow) if s >= 0) for row, wrow in zip(slots, weights)]
    return LoRAMapping(ids, ids, False, ws, ws)


def _run(impl, traffic: PairTraffic, x, y, slots, weights):
    """(add_lora_linear's y, add_lora_logits' y) of one batch through a deterministic wrapper, float64."""
    n = len(x)
    device = None if impl.side == "jax" else impl.device
    w = impl.pkg.PunicaWrapper(max(n, 8), max(n, 8), device, max_loras=SLOTS, backend=impl.backend,
                               deterministic=True)
    w.update_metadata(_mapping(slots, weights), LORA_IDS, SLOTS + 1, VOCAB)
    assert w.num_pairs == traffic.k
    lin, head = impl.arr(y.copy()), impl.arr(np.zeros((n, VOCAB), np.float32))   # torch shares NumPy memory
    out = w.add_lora_linear(lin, impl.arr(x), [impl.arr(a) for a in traffic.lora_a],
                            [impl.arr(b) for b in traffic.lora_b], None, SCALE, SLICES)
    lin = lin if impl.mutates else out                  # torch writes y in place, JAX returns the new y
    out = w.add_lora_logits(head, impl.arr(x), impl.arr(traffic.head_a), impl.arr(traffic.head_b), SCALE)
    head = head if impl.mutates else out
    return impl.to_np(lin), impl.to_np(head)


def _check_oracle(traffic: PairTraffic, x, y, slots, weights, lin, head) -> None:
    want = oracle.multi_lora_linear(y, x, traffic.lora_a, traffic.lora_b, SCALE, slots, weights)
    assert oracle.rel_err(lin, want) <= 1e-5
    want_head = oracle.multi_lora_linear(np.zeros((len(x), VOCAB), np.float32), x, [traffic.head_a],
                                         [traffic.head_b], SCALE, slots, weights)
    assert oracle.rel_err(head, want_head) <= 1e-5


@pytest.mark.parametrize("impl,k", CPU_PARAMS)
def test_pairs_rows_bitwise_equal_in_every_batch(impl, k):
    check_pairs_invariance(impl, k, sizes=(5, 16, 23))


def check_pairs_invariance(impl, k: int, sizes) -> None:
    """The probe's rows (add_lora_linear, add_lora_logits) alone and in batches of `sizes` tokens are
    bitwise equal; every result equals the float64 oracle."""
    traffic = PairTraffic(k, seed=k)
    x1, y1 = traffic.probe_x[None], traffic.probe_y[None]
    s1, w1 = traffic.probe_slots[None], traffic.probe_weights[None]
    alone = _run(impl, traffic, x1, y1, s1, w1)
    _check_oracle(traffic, x1, y1, s1, w1, *alone)
    for size in sizes:
        x, y, slots, weights, row = traffic.batch(size)
        got = _run(impl, traffic, x, y, slots, weights)
        _check_oracle(traffic, x, y, slots, weights, *got)
        for name, a, b in zip(("add_lora_linear", "add_lora_logits"), got, alone):
            assert a[row].tobytes() == b[0].tobytes(), (
                f"{name}: the probe's row differs in a batch of {size} tokens (row {row}, k={k})")
