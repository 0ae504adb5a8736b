"""torch_lora.parallel on CPU process groups (gloo, 2 and 4 processes on 127.0.0.1): every sharded
layer equals the unsharded layer (torch_lora on one process, and the float64 oracle), in both layouts;
the collectives each layout issues match layout.py's byte formulas; the layout choice by bytes.

The cases run in tests/parallel_cases.py, on every rank of a pool started once per group size.
"""

from __future__ import annotations

import pytest

from torch_lora.parallel import layout as L

from . import parallel_cases as cases
from .distributed import ProcessPool, gloo_env_ok

pytestmark = pytest.mark.skipif(not gloo_env_ok(), reason="needs torch.distributed with gloo")

WORLDS = (2, 4)
TOL = {"float32": 1e-5, "bfloat16": 2e-2}


@pytest.fixture(scope="module")
def pools():
    started: dict[int, ProcessPool] = {}

    def get(world: int) -> ProcessPool:
        if world not in started or started[world].broken:
            started[world] = ProcessPool(world, "gloo", timeout=60)
        return started[world]

    yield get
    for pool in started.values():
        pool.close()


def _check_equal(results, dtype="float32"):
    for rank, r in enumerate(results):
        assert r["err_oracle"] < TOL[dtype], (rank, r["err_oracle"])
        assert r["err_ref"] < TOL[dtype], (rank, r["err_ref"])
        assert r["untouched"], f"rank {rank}: rows without LoRA changed"


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("fully_sharded", [False, True], ids=["replicated", "fully_sharded"])
@pytest.mark.parametrize("kind", ["column", "merged", "qkv"])
def test_column_layers_equal_the_unsharded_layer(pools, world, kind, fully_sharded):
    results = pools(world).run(cases.case_linear, kind=kind, fully_sharded=fully_sharded)
    _check_equal(results)
    for rank, r in enumerate(results):
        assert r["layout"] == ("fully_sharded" if fully_sharded else "replicated")
        # this rank holds only its shard: A's rank chunk when fully sharded, B's rows always
        a_rows = cases.MAX_RANK // world if fully_sharded else cases.MAX_RANK
        assert all(shape[1] == a_rows for shape in r["shapes"][: len(r["shapes"]) // 2]), r["shapes"]
        assert sum(shape[1] for shape in r["shapes"][len(r["shapes"]) // 2:]) < r["full_out"] or world == 1
        assert r["lora_calls"] == r["formula"], (rank, r["lora_calls"], r["formula"])


def test_kv_heads_replicated_when_fewer_than_ranks():
    """4 q heads, 2 kv heads of size 4 over 4 ranks: q split, each kv head on two ranks."""
    assert [L.qkv_ranges(4, 2, 4, p, 4) for p in range(4)] == [
        ((0, 4), (0, 4), (0, 4)), ((4, 8), (0, 4), (0, 4)), ((8, 12), (4, 8), (4, 8)), ((12, 16), (4, 8), (4, 8))]
    assert [L.qkv_ranges(4, 2, 4, p, 2)[1] for p in range(2)] == [(0, 4), (4, 8)]
    with pytest.raises(ValueError, match="num_kv_heads=3 must divide the process group size 4"):
        L.qkv_ranges(8, 3, 4, 0, 4)
    with pytest.raises(ValueError, match="num_heads=6 must be divisible by the process group size 4"):
        L.qkv_ranges(6, 2, 4, 0, 4)
