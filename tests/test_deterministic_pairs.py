"""Deterministic mode with several adapters per token (contract section 10 under `deterministic=True`).

A probe token carries k = 2 or 4 weighted (adapter, strength) pairs. Its add_lora_linear row and
its add_lora_logits row (the LM head, run one pair at a time) through a
`PunicaWrapper(..., deterministic=True)` are computed alone (a batch of one token) and inside
larger mixed batches: neighbours with k pairs, fewer pairs, one adapter and none, the probe at a
random position. The rows must be bitwise the same in every batch, and every batch's result must
match the float64 oracle (`oracle.multi_lora_linear`), so a path that is invariant but wrong fails
too. Across pair buckets: a 2-pair token and a one-adapter token give the same bits in a batch
whose neighbour names 4 adapters (the 4-pair kernels) as alone, and the one-adapter token's bits
equal those of the plain (unweighted, pair-free) step. Through the serving loop (xla): a request
with two weighted adapters gets the same tokens alone and in batches with four-adapter neighbours.

On the CPU: the reference backends (jax xla, torch) and the Triton kernels in Triton's
interpreter (jax-triton through its callback, torch-triton on CPU tensors; the bucket check on
torch-triton only), tiny shapes.
tests/test_gpu_deterministic.py runs `check_pairs_invariance` on the compiled kernels (bfloat16,
a 4096-wide layer, batches up to 512 tokens).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from lora_core.host_mapping import LoRAMapping

from . import oracle
from .impls import IMPLS, round_to

CPU_NAMES = ("jax-xla", "jax-triton", "torch-ref", "torch-triton")
CPU_PARAMS = [pytest.param(impl, k, id=f"{impl.name}-k{k}", marks=impl.marks)
              for impl in IMPLS if impl.name in CPU_NAMES for k in (2, 4)]
SCALE = 0.5


@dataclasses.dataclass(frozen=True)
class PairShapes:
    hidden: int = 64
    rank: int = 32          # > the interpreter's deterministic BLOCK_R (16): the expand's rank loop runs
    slots: int = 6
    slices: tuple = (24, 8)
    vocab: int = 32
    dtype: str = "float32"

    @property
    def lora_ids(self) -> list:
        return [101 + s for s in range(self.slots)]


class PairTraffic:
    """Weights (rounded to the dtype), a probe token with k pairs, and random mixed batches around it."""

    def __init__(self, k: int, shapes: PairShapes = PairShapes(), seed: int = 0):
        rng = self.rng = np.random.default_rng(seed)
        sh, self.k, self.shapes = shapes, k, shapes

        def rand(*shape, fan_in=1):
            return round_to(rng.standard_normal(shape) / np.sqrt(fan_in), sh.dtype)
        self.lora_a = [rand(sh.slots, sh.rank, sh.hidden, fan_in=sh.hidden) for _ in sh.slices]
        self.lora_b = [rand(sh.slots, n, sh.rank, fan_in=sh.rank) for n in sh.slices]
        self.head_a = rand(sh.slots, sh.rank, sh.hidden, fan_in=sh.hidden)
        self.head_b = rand(sh.slots, sh.vocab, sh.rank, fan_in=sh.rank)
        self.probe_x, self.probe_y = rand(sh.hidden), rand(sum(sh.slices))
        self.probe_slots = rng.choice(sh.slots, size=k, replace=False)
        self.probe_weights = rng.uniform(-1.0, 2.0, size=k).astype(np.float32)

    def batch(self, size: int):
        """(x, y, slots (size, k) -1 padded, weights (size, k), probe row) of a mixed batch."""
        rng, k, sh = self.rng, self.k, self.shapes
        x = round_to(rng.standard_normal((size, sh.hidden)), sh.dtype)
        y = round_to(rng.standard_normal((size, sum(sh.slices))), sh.dtype)
        slots = np.full((size, k), -1, np.int64)
        weights = np.zeros((size, k), np.float32)
        for t in range(size):
            n = [k, k, 1, 0, int(rng.integers(0, k + 1))][t % 5]       # k pairs, one adapter, none, any
            slots[t, :n] = rng.choice(sh.slots, size=n, replace=False)
            weights[t, :n] = rng.uniform(-1.0, 2.0, size=n)
        row = int(rng.integers(0, size))
        x[row], y[row] = self.probe_x, self.probe_y
        slots[row], weights[row] = self.probe_slots, self.probe_weights
        return x, y, slots, weights, row


def _mapping(lora_ids, slots, weights) -> LoRAMapping:
    """A paired mapping (weights given), or the plain one-adapter mapping when `weights` is None."""
    ids = [tuple(lora_ids[s] for s in row if s >= 0) for row in slots]
    if weights is None:
        flat = tuple(i[0] if i else 0 for i in ids)
        return LoRAMapping(flat, flat)
    ws = [tuple(float(w) for s, w in zip(row, wrow) if s >= 0) for row, wrow in zip(slots, weights)]
    return LoRAMapping(ids, ids, False, ws, ws)


def run_pairs(impl, traffic: PairTraffic, x, y, slots, weights):
    """(add_lora_linear's y, add_lora_logits' y, the step's pair bucket) of one batch through a
    deterministic wrapper, results in float64."""
    sh, n = traffic.shapes, len(x)
    device = None if impl.side == "jax" else impl.device
    w = impl.pkg.PunicaWrapper(max(n, 8), max(n, 8), device, max_loras=sh.slots, backend=impl.backend,
                               deterministic=True)
    w.update_metadata(_mapping(sh.lora_ids, slots, weights), sh.lora_ids, sh.slots + 1, sh.vocab)
    dt = sh.dtype
    lin = impl.arr(y.copy(), dt)                        # a copy: torch shares a NumPy array's memory
    head = impl.arr(np.zeros((n, sh.vocab), np.float32), dt)
    out = w.add_lora_linear(lin, impl.arr(x, dt), [impl.arr(a, dt) for a in traffic.lora_a],
                            [impl.arr(b, dt) for b in traffic.lora_b], None, SCALE, sh.slices)
    lin = lin if impl.mutates else out                  # torch writes y in place, JAX returns the new y
    out = w.add_lora_logits(head, impl.arr(x, dt), impl.arr(traffic.head_a, dt), impl.arr(traffic.head_b, dt),
                            SCALE)
    head = head if impl.mutates else out
    return impl.to_np(lin), impl.to_np(head), w.num_pairs


def _check_oracle(traffic: PairTraffic, x, y, slots, weights, lin, head) -> None:
    sh = traffic.shapes
    if weights is None:
        weights = (slots >= 0).astype(np.float32)
    tol = oracle.TOL[sh.dtype]
    want = oracle.multi_lora_linear(y, x, traffic.lora_a, traffic.lora_b, SCALE, slots, weights)
    assert oracle.rel_err(lin, want) <= tol
    want_head = oracle.multi_lora_linear(np.zeros((len(x), sh.vocab), np.float32), x, [traffic.head_a],
                                         [traffic.head_b], SCALE, slots, weights)
    assert oracle.rel_err(head, want_head) <= tol


def check_pairs_invariance(impl, traffic: PairTraffic, sizes, oracle_every: int = 1) -> None:
    """The probe's rows (add_lora_linear, add_lora_logits) alone and in batches of `sizes` tokens are
    bitwise equal; the probe alone and every `oracle_every`-th batch equal the float64 oracle."""
    x1, y1 = traffic.probe_x[None], traffic.probe_y[None]
    s1, w1 = traffic.probe_slots[None], traffic.probe_weights[None]
    alone = run_pairs(impl, traffic, x1, y1, s1, w1)
    assert alone[2] == traffic.k
    _check_oracle(traffic, x1, y1, s1, w1, *alone[:2])
    for i, size in enumerate(sizes):
        x, y, slots, weights, row = traffic.batch(int(size))
        got = run_pairs(impl, traffic, x, y, slots, weights)
        if i % oracle_every == 0:
            _check_oracle(traffic, x, y, slots, weights, *got[:2])
        for name, a, b in zip(("add_lora_linear", "add_lora_logits"), got, alone):
            assert a[row].tobytes() == b[0].tobytes(), (
                f"{name}: the probe's row differs in a batch of {size} tokens (row {row}, k={traffic.k})")


@pytest.mark.parametrize("impl,k", CPU_PARAMS)
def test_pairs_rows_bitwise_equal_in_every_batch(impl, k):
    # The interpreters take one batch (19 tokens: past the 1-16 launch class), the references two.
    check_pairs_invariance(impl, PairTraffic(k, seed=k), sizes=(19,) if impl.small else (5, 19))


# jax-triton launches the same kernels as torch-triton (lora_core.kernels) through a callback: the
# bucket check runs once, on the torch side, to keep the interpreter's time down.
@pytest.mark.parametrize("impl", [pytest.param(i, id=i.name, marks=i.marks) for i in IMPLS
                                  if i.name in CPU_NAMES and i.name != "jax-triton"])
def test_a_token_keeps_its_bits_across_pair_buckets(impl):
    """A 2-pair token and a one-adapter token next to a 4-adapter neighbour (the step runs the 4-pair
    kernels) give the bits they get alone (2-pair and 1-pair steps); the one-adapter token's bits
    are also those of the plain step (no weights: the pair-free kernels; compiled, the pair kernels
    add the row up in their order, docs/api.md)."""
    traffic = PairTraffic(4, seed=7)
    rng = traffic.rng
    x0, y0 = traffic.probe_x[None], traffic.probe_y[None]
    plain = run_pairs(impl, traffic, x0, y0, np.array([[2]]), None)
    assert plain[2] == 0
    for probe_slots, probe_weights in (([1, 3], [0.7, -0.4]), ([2], [1.0])):
        k = len(probe_slots)
        ps, pw = np.array([probe_slots]), np.array([probe_weights], np.float32)
        alone = run_pairs(impl, traffic, x0, y0, ps, pw)
        assert alone[2] == k
        x, y, slots, weights, _ = traffic.batch(6)
        slots[:], weights[:] = -1, 0.0
        slots[0], weights[0] = [0, 1, 2, 3], [0.5, -0.5, 1.5, 0.25]
        slots[4, 0], weights[4, 0] = 5, 1.0
        row = int(rng.integers(1, 4))
        x[row], y[row] = x0[0], y0[0]
        slots[row, :k], weights[row, :k] = ps[0], pw[0]
        got = run_pairs(impl, traffic, x, y, slots, weights)
        assert got[2] == 4
        _check_oracle(traffic, x, y, slots, weights, *got[:2])
        for name, a, b in zip(("add_lora_linear", "add_lora_logits"), got, alone):
            assert a[row].tobytes() == b[0].tobytes(), f"{name}: {k} pair(s) alone vs in a 4-pair step"
        if k == 1:
            for name, a, b in zip(("add_lora_linear", "add_lora_logits"), got, plain):
                assert a[row].tobytes() == b[0].tobytes(), f"{name}: the plain step vs a 4-pair step"


def check_deterministic_pair_tokens(model, adapters, backend, rng) -> None:
    """The serving loop in deterministic mode: a request summing two weighted adapters, served alone
    (a 2-row engine) and inside batches with one-adapter, base and four-adapter requests (an 8-row
    engine, other prefill buckets, the 4-pair kernels), gets the same greedy tokens and logits."""
    from jax_lora.serving import Request, ServingEngine
    kw = dict(max_len=48, min_prefill_rows=1, keep_logits=True, backend=backend, deterministic=True)
    alone_engine = ServingEngine(model, adapters, max_seqs=2, **kw)
    batch_engine = ServingEngine(model, adapters, max_seqs=8, **kw)
    request = Request([int(t) for t in rng.integers(0, 512, size=5)], lora_ids=(3, 1), lora_weights=(0.7, -0.4),
                      max_new_tokens=5, request_id="r")
    alone = alone_engine.generate([request])[0]

    def other(i):
        prompt = [int(t) for t in rng.integers(0, 512, size=int(rng.integers(2, 12)))]
        if i % 3 == 2:
            return Request(prompt, lora_ids=(1, 2, 3, 4), lora_weights=(0.5, 0.5, -0.25, 1.0), max_new_tokens=4)
        return Request(prompt, lora_id=[2, None][i % 3], max_new_tokens=4)
    for size in (3, 7):
        others = [other(i) for i in range(size - 1)]
        pos = int(rng.integers(0, size))
        out = batch_engine.generate(others[:pos] + [request] + others[pos:])
        assert out[pos].request_id == "r" and out[pos].tokens == alone.tokens, (size, pos)
        np.testing.assert_allclose(out[pos].logits, alone.logits, rtol=1e-5, atol=1e-5)


def test_deterministic_serving_of_several_adapters_per_request(tmp_path):
    from jax_lora.adapters import AdapterManager
    from jax_lora.cli import build_demo_assets
    from jax_lora.models import add_lora, load_llama
    model_dir, dirs = build_demo_assets(str(tmp_path), seed=3)
    model = load_llama(model_dir)
    add_lora(model, max_loras=4, max_rank=16)
    mgr = AdapterManager(model)
    for i, d in enumerate(dirs + dirs[:1]):
        mgr.register(i + 1, d)
    check_deterministic_pair_tokens(model, mgr, "xla", np.random.default_rng(11))
