"""Deterministic mode on the compiled Triton kernels (marked `gpu`; run on the device machine).

A request's rows of every op (lora_shrink, lora_expand, BGMV, SGMV) and of add_lora_linear, on the
torch and the JAX Triton backends, are bitwise the same alone and inside 100 random batches of
1-512 tokens (random neighbours, adapters and positions), at ranks 16 and 64 with three slices of
a 4096-wide layer; the same batch twice gives the same bits. The MoE LoRA op's request rows
(gate_up and down, Mixtral's hidden size, 8 experts, top 2) likewise in 40 batches of 2-512 tokens
in the naive and sorted pair orders. And the Flax serving loop with the Triton backend gives a
request the same greedy tokens alone and in any batch. With several adapters per token (k = 2 and 4
weighted pairs), a probe token's add_lora_linear and add_lora_logits rows are bitwise the same alone
and in 40 random mixed batches of 1-512 tokens, and the serving loop gives a request with two
weighted adapters the same tokens alone and in mixed batches.
(tests/test_deterministic.py, tests/test_moe_deterministic.py and tests/test_deterministic_pairs.py
run the same checks on the CPU:
reference backends, interpreter.)
"""

from __future__ import annotations

import numpy as np
import pytest

from . import test_moe_deterministic as moe
from .impls import IMPLS
from .test_deterministic import Shapes, Traffic, check_request_invariance
from .test_deterministic_pairs import PairShapes, PairTraffic, check_deterministic_pair_tokens, check_pairs_invariance
from .test_serving import check_deterministic_tokens, served  # noqa: F401 - the module's engine fixture

pytestmark = pytest.mark.gpu

# Batch sizes: the edges of the token classes and of SMALL_T (1, 16, 17, 32, 33, 64, ...) and others.
SIZES = (1, 2, 3, 7, 8, 15, 16, 17, 31, 32, 33, 48, 63, 64, 65, 100, 127, 128, 129, 200, 255, 256, 257, 383,
         511, 512)
GPU_IMPLS = [pytest.param(impl, id=impl.name) for impl in IMPLS if impl.name in ("jax-triton", "torch-triton")]


@pytest.mark.parametrize("rank", [16, 64])
@pytest.mark.parametrize("impl", GPU_IMPLS)
def test_request_rows_bitwise_equal_in_100_batches(impl, rank):
    shapes = Shapes(hidden=4096, rank=rank, slots=8, slices=(4096, 1024, 1024), request_tokens=4, request_slot=5)
    traffic = Traffic("bfloat16", shapes, seed=rank)
    sizes = np.random.default_rng(rank).choice(SIZES, size=100)
    check_request_invariance(impl, traffic, sizes, oracle_every=10)


@pytest.mark.parametrize("impl", GPU_IMPLS)
def test_moe_request_rows_bitwise_equal_in_40_batches(impl):
    traffic = moe.Traffic("bfloat16", hidden=4096, inter=1024, experts=8, top_k=2, slots=4, rank=16, seed=3)
    sizes = np.random.default_rng(3).integers(2, 513, size=40)
    moe.check_request_invariance(impl, traffic, sizes, orders=(None, 16, 32, 64), oracle_every=10)


def test_deterministic_serving_with_triton(served):  # noqa: F811 - the imported fixture
    engine, base, adapters, _ = served
    check_deterministic_tokens(engine.model, engine.adapters, base, adapters, "triton", np.random.default_rng(9))


@pytest.mark.parametrize("k", [2, 4])
@pytest.mark.parametrize("impl", GPU_IMPLS)
def test_pairs_rows_bitwise_equal_in_40_batches(impl, k):
    shapes = PairShapes(hidden=4096, rank=64, slots=8, slices=(4096, 1024, 1024), vocab=2048, dtype="bfloat16")
    sizes = np.random.default_rng(k).choice(SIZES, size=40)
    check_pairs_invariance(impl, PairTraffic(k, shapes, seed=k), sizes, oracle_every=10)


def test_deterministic_serving_of_several_adapters_with_triton(served):  # noqa: F811 - the imported fixture
    engine = served[0]
    check_deterministic_pair_tokens(engine.model, engine.adapters, "triton", np.random.default_rng(12))
