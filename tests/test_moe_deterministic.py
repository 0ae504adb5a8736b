"""Deterministic MoE LoRA (`fused_moe_lora(..., deterministic=True)`): a request's rows are bitwise
the same in every batch.

One request (two tokens of one adapter, fixed routing and inputs) runs alone and inside random
batches: neighbours with other adapters, tokens without LoRA, other experts, the request at a
random position, the pairs in the naive order or sorted in blocks of 16 or 32 (what the wrappers
pick by batch size). Its rows of gate_up (two slices at a column offset) and of down (router
weights) must be bitwise equal to the rows it gets alone, and every result equals the float64
oracle. On the CPU: the reference backends (xla, pallas_tpu, torch) and the Triton kernel in
Triton's interpreter on both sides; tests/test_gpu_moe_lora.py runs `check_request_invariance` on
the compiled kernel.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

from . import oracle
from .impls import IMPLS, round_to

IMPL_PARAMS = [pytest.param(impl, id=impl.name, marks=impl.marks) for impl in IMPLS if impl.moe_lora]


class Traffic:
    """Weights, one request (slot `request_slot`, fixed experts) and random batches around it."""

    def __init__(self, dtype: str, *, hidden=32, inter=24, experts=4, top_k=2, slots=3, rank=8, request_slot=1,
                 seed=0):
        rng = np.random.default_rng(seed)
        self.rng, self.dtype, self.experts, self.top_k, self.slots = rng, dtype, experts, top_k, slots

        def weights(*shape):
            return round_to(rng.standard_normal(shape) / np.sqrt(shape[-1]), dtype)

        self.gu_a = [weights(slots, experts, rank, hidden) for _ in range(2)]
        self.gu_b = [weights(slots, experts, inter, rank) for _ in range(2)]
        self.dn_a = [weights(slots, experts, rank, inter)]
        self.dn_b = [weights(slots, experts, hidden, rank)]
        self.enabled = np.ones(slots, np.int32)
        self.hidden, self.inter = hidden, inter
        self.request = self._tokens(2, slot=request_slot)

    def _tokens(self, n: int, slot=None) -> dict:
        rng = self.rng
        ids = np.stack([rng.choice(self.experts, self.top_k, replace=False) for _ in range(n)]).astype(np.int32)
        w = rng.random((n, self.top_k)).astype(np.float32) + 0.1
        return dict(topk_ids=ids, topk_weights=w / w.sum(1, keepdims=True),
                    slot=np.full(n, slot, np.int32) if slot is not None
                    else rng.choice(np.arange(-1, self.slots), n).astype(np.int32),
                    x=round_to(rng.standard_normal((n, self.hidden)), self.dtype),
                    h=round_to(rng.standard_normal((n * self.top_k, self.inter)), self.dtype),
                    y13=round_to(rng.standard_normal((n, self.top_k, 2 * self.inter + 3)), self.dtype),
                    y2=round_to(rng.standard_normal((n, self.top_k, self.hidden)), self.dtype))

    def batch(self, size: int) -> tuple[dict, np.ndarray]:
        """(a batch of `size` tokens holding the request at a random position, the request's rows)."""
        n = len(self.request["slot"])
        at = int(self.rng.integers(0, size - n + 1))
        others = self._tokens(size - n)
        out = {}
        for key, mine in self.request.items():
            per_token = mine.shape[0] // n
            cut = at * per_token
            out[key] = np.concatenate([others[key][:cut], mine, others[key][cut:]])
        return out, np.arange(at, at + n)


def _run(impl, traffic: Traffic, batch: dict, order, dtype: str, deterministic: bool = True) -> tuple:
    """(gate_up y, down y) of one batch in pair order `order` (None: naive, else the sorted block
    size)."""
    kw = dict(naive=order is None, block_size=order or 16, dtype=dtype, deterministic=deterministic)
    y13 = impl.fused_moe_lora(batch["y13"], batch["x"], traffic.gu_a, traffic.gu_b, batch["topk_ids"],
                              batch["topk_weights"], batch["slot"], traffic.enabled, False, 2, **kw)
    y2 = impl.fused_moe_lora(batch["y2"], batch["h"], traffic.dn_a, traffic.dn_b, batch["topk_ids"],
                             batch["topk_weights"], batch["slot"], traffic.enabled, True, 0, **kw)
    return y13, y2


def _check_oracle(traffic: Traffic, batch: dict, got: tuple, dtype: str) -> None:
    want13 = oracle.fused_moe_lora(batch["y13"], batch["x"], traffic.gu_a, traffic.gu_b, batch["topk_ids"],
                                   batch["topk_weights"], batch["slot"], traffic.enabled, False, 2)
    want2 = oracle.fused_moe_lora(batch["y2"], batch["h"], traffic.dn_a, traffic.dn_b, batch["topk_ids"],
                                  batch["topk_weights"], batch["slot"], traffic.enabled, True, 0)
    for g, w, what in ((got[0], want13, "gate_up"), (got[1], want2, "down")):
        err = oracle.rel_err(g, w)
        assert err <= oracle.TOL[dtype], f"{what}: relative error {err:.3g} > {oracle.TOL[dtype]} ({dtype})"


def check_request_invariance(impl, traffic: Traffic, sizes, orders=(None, 16, 32), oracle_every: int = 1,
                             deterministic: bool = True) -> None:
    """The request's gate_up and down rows in every batch of `sizes` (each in the orders given, in
    turn) are bitwise its rows alone; every `oracle_every`-th result is checked against the
    float64 oracle."""
    dtype = traffic.dtype
    alone = _run(impl, traffic, traffic.request, None, dtype, deterministic)
    _check_oracle(traffic, traffic.request, alone, dtype)
    for i, size in enumerate(sizes):
        batch, rows = traffic.batch(size)
        order = orders[i % len(orders)]
        got = _run(impl, traffic, batch, order, dtype, deterministic)
        if i % oracle_every == 0:
            _check_oracle(traffic, batch, got, dtype)
        for what, mine, theirs in (("gate_up", alone[0], got[0]), ("down", alone[1], got[1])):
            assert mine.tobytes() == theirs[rows].tobytes(), (
                f"{impl.name}: the request's {what} rows differ in a batch of {size} tokens (order "
                f"{'naive' if order is None else f'sorted, blocks of {order}'}, at rows {rows[0]}..{rows[-1]})")


@pytest.mark.parametrize("impl", IMPL_PARAMS)
def test_request_rows_bitwise_equal_in_every_batch(impl):
    """The request alone (2 tokens, 4 pairs) and in batches of 6 and 13 tokens with other adapters,
    in the naive order and sorted in blocks of 16 and 32; float32 outputs (no rounding to a
    narrower dtype hides a last-bit difference)."""
    check_request_invariance(impl, Traffic("float32", hidden=256), sizes=(6, 6, 13))


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="the interpreter's float32 sums")
def test_the_check_sees_a_batch_dependent_plan():
    """Without deterministic, the Triton kernel's plan follows the batch (the naive order's
    BLOCK_K 128 against the sorted order's 64, in float32 in the interpreter): the same check
    finds the request's rows changed, so it can tell an invariant path from one that is not."""
    impl = next(i for i in IMPLS if i.name == "torch-triton")
    with pytest.raises(AssertionError, match="rows differ"):
        check_request_invariance(impl, Traffic("float32", hidden=256), sizes=(6, 6, 13), deterministic=False)


def test_the_triton_deterministic_plan_is_one_configuration():
    """The kernel's deterministic plan is the same for 2 pairs and for 4096: no hidden split, the
    whole rank in one chunk, one pair per program; it refuses the sorted order."""
    from lora_core.kernels.moe_lora import plan_moe_lora

    def plan(pairs, naive=True):
        return plan_moe_lora(num_pairs=pairs, num_slots=4, num_experts=8, hidden=4096, widths=(1024, 1024), rank=16,
                             naive=naive, sorted_len=0 if naive else 64, block_m=16, mul_routed_weight=False,
                             shared_a=False, dtypes=("bfloat16",) * 3, deterministic=True)
    small, large = plan(2), plan(4096)
    assert small.constexprs == large.constexprs and small.k_split == large.k_split == 1
    assert small.constexprs["R_CHUNK"] == small.constexprs["BLOCK_R"] and small.shrink_grid[1] == 2
    with pytest.raises(ValueError, match="naive order"):
        plan(64, naive=False)
