"""torch_lora.parallel on CPU process groups (gloo, 2 and 4 processes on 127.0.0.1): every sharded
layer equals the unsharded layer (torch_lora on one process, and the float64 oracle), in both layouts;
the collectives each layout issues match layout.py's byte formulas; the layout choice by bytes.

The cases run in tests/parallel_cases.py, on every rank of a pool started once per group size.
"""

from __future__ import annotations

import os

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


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("fully_sharded", [False, True], ids=["replicated", "fully_sharded"])
def test_row_layer_equals_the_unsharded_layer(pools, world, fully_sharded):
    """The partial (1, T, r) buffers are all-reduced, never y (the base layer reduces its own y):
    replicated issues exactly one all-reduce of T * r * 4 bytes beyond the base layer's; fully
    sharded adds the all-gather of its (T, N / P) columns."""
    results = pools(world).run(cases.case_linear, kind="row", fully_sharded=fully_sharded)
    _check_equal(results)
    t, r = len(cases.TOKENS), cases.MAX_RANK
    want = [("all_reduce", t * r * 4)] + ([("all_gather", t * 24 * 4)] if fully_sharded else [])
    for rank, res in enumerate(results):
        assert res["lora_calls"] == res["formula"] == want, (rank, res["lora_calls"], res["formula"])
        a_shape, b_shape = res["shapes"]
        assert a_shape == (cases.MAX_LORAS, r, cases.HIDDEN // world)
        assert b_shape == (cases.MAX_LORAS, 24 // world if fully_sharded else 24, r)


@pytest.mark.parametrize("kind", ["qkv", "row"])
def test_bfloat16_layers(pools, kind):
    results = pools(2).run(cases.case_linear, kind=kind, fully_sharded=True, dtype="bfloat16")
    _check_equal(results, "bfloat16")


@pytest.mark.parametrize("kind", cases.LINEAR_KINDS)
@pytest.mark.parametrize("tokens", [1, 4096])
def test_layout_chosen_by_bytes(pools, kind, tokens):
    """fully_sharded=None: the layer takes the layout whose formula moves fewer bytes for
    tokens_per_step (here one token: sharding the weights wins; 4096 tokens: replicating them)."""
    results = pools(2).run(cases.case_linear, kind=kind, fully_sharded=None, tokens_per_step=tokens)
    _check_equal(results)
    for res in results:
        costs = res["costs"]
        assert res["layout"] == min(costs, key=lambda k: (costs[k], k != "replicated")), res
        assert res["layout"] == ("fully_sharded" if tokens == 1 else "replicated"), costs


def test_bad_input_names_the_argument(pools):
    for res in pools(2).run(cases.case_bad_input):
        e = res["errors"]
        expected = {
            "no_layout": ("ValueError", "pass fully_sharded=True/False, or tokens_per_step="),
            "rank_split": ("ValueError", "max_rank=3 must be divisible by the process group size 2"),
            "bad_flag": ("TypeError", "fully_sharded must be True, False or None"),
            "uneven_out": ("ValueError", "output_size=25 must be divisible by the process group size 2"),
            "not_module": ("TypeError", "base_layer must be a torch.nn.Module, got function"),
            "bad_dtype": ("TypeError", "dtype must have dtype in ('float16', 'bfloat16', 'float32'), got float64"),
            "row_split": ("ValueError", "output_size=7 must be divisible by the process group size 2"),
            "x_width": ("ValueError", f"x must have shape (..., {cases.HIDDEN}) on this rank, got (7, 33)"),
            "base_width": ("ValueError", "base_layer returned shape (7, 5), but the layer's output shard has 12"),
            "slot": ("ValueError", "slot must be an int in [0, 4)"),
            "a_shape": ("ValueError", f"lora_a must have shape (rank <= 8, {cases.HIDDEN}), got (2, 33)"),
            "a_rank": ("ValueError", f"lora_a must have shape (rank <= 8, {cases.HIDDEN}), got (9, 32)"),
            "b_shape": ("ValueError", "lora_b must have shape (24, 2)"),
            "half_none": ("ValueError", "lora_a and lora_b must both be given or both be None"),
            "bias_unwanted": ("ValueError", "lora_bias was given, but the layer was built with lora_bias=False"),
            "int_weights": ("TypeError", "lora_a must hold floating-point values"),
            "not_a_layer": ("TypeError", "layer must be a tensor-parallel LoRA layer"),
            "slices": ("ValueError", "lora_a must be a sequence of 2 per-slice tensors"),
        }
        for name, (kind, text) in expected.items():
            assert name in e, f"{name}: no error raised"
            assert e[name][0] == kind and text in e[name][1], (name, e[name])
        assert res["base_only"]


def test_byte_formulas_by_hand():
    """layout.py's formulas on numbers worked out by hand (H 4096, r 16, P 2, 4 active adapters, bf16)."""
    col = L.column_costs(input_size=4096, local_widths=(2048,), max_rank=16, max_loras=8, world=2, num_tokens=1,
                         num_adapters=4, weight_bytes=2)
    assert col["replicated"].weight_bytes == 4 * (16 * 4096 + 2048 * 16) * 2 == 786432
    assert col["fully_sharded"].weight_bytes == 4 * (8 * 4096 + 2048 * 16) * 2 == 524288
    assert col["fully_sharded"].collectives == (("all_gather", 1 * 16 * 4),)
    assert col["fully_sharded"].link_bytes == 32.0
    assert col["replicated"].resident_bytes == 8 * (16 * 4096 + 2048 * 16) * 2
    assert L.choose_layout(col) == "fully_sharded"
    row = L.row_costs(input_size=4096, output_size=4096, max_rank=16, max_loras=8, world=4, num_tokens=64,
                      num_adapters=4, weight_bytes=2, output_bytes=2)
    assert row["replicated"].collectives == (("all_reduce", 64 * 16 * 4),)
    assert row["replicated"].link_bytes == 2 * 3 / 4 * 4096
    assert row["fully_sharded"].collectives == (("all_reduce", 4096), ("all_gather", 64 * 4096 * 2))
    assert row["fully_sharded"].link_bytes == 6144 + 3 / 4 * 64 * 4096 * 2
    # sharding B saves 4 adapters * 3/4 * (4096 * 16 * 2) = 393216 bytes read and sends 3/4 * 64 * 4096 * 2 =
    # 393216 more: a tie, which keeps the replicated layout (one collective fewer)
    assert row["replicated"].weight_bytes - row["fully_sharded"].weight_bytes == 393216
    assert L.choose_layout(row) == "replicated"
    assert L.choose_layout(row, link_weight=0.5) == "fully_sharded"
    emb = L.embedding_costs(num_embeddings=1000, embedding_dim=64, max_rank=8, max_loras=2, world=4, num_tokens=5,
                            num_adapters=2, weight_bytes=4)
    assert emb["replicated"].weight_bytes == emb["fully_sharded"].weight_bytes == (5 * 8 + 2 * 64 * 8) * 4
    assert emb["fully_sharded"].resident_bytes == 2 * (250 * 8 + 64 * 8) * 4
    assert L.choose_layout(emb) == "replicated"
    with pytest.raises(ValueError, match="num_adapters must be an int in \\[0, max_loras=8\\], got 9"):
        L.column_costs(input_size=8, local_widths=(8,), max_rank=2, max_loras=8, world=2, num_tokens=1,
                       num_adapters=9, weight_bytes=2)
    with pytest.raises(ValueError, match="link_weight must be a finite number >= 0, got -1"):
        L.choose_layout(col, link_weight=-1)
    with pytest.raises(ValueError, match="collective kind must be one of"):
        L.link_bytes([("broadcast", 4)], 2)


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("fully_sharded", [False, True], ids=["replicated", "fully_sharded"])
@pytest.mark.parametrize("kind", ["embedding", "lm_head"])
def test_vocab_layers_equal_the_unsharded_layer(pools, world, kind, fully_sharded):
    """Vocabulary 50 over 2 and 4 ranks (shards of 25, and 13 with the last one padded)."""
    results = pools(world).run(cases.case_vocab, kind=kind, fully_sharded=fully_sharded)
    _check_equal(results)
    t, r = len(cases.TOKENS if kind == "embedding" else cases.ROWS), cases.MAX_RANK
    if not fully_sharded:
        want = []
    elif kind == "embedding":
        want = [("all_reduce", t * r * 4)]
    else:
        want = [("all_gather", t * r * 4)]
    part = -(-cases.VOCAB // world)
    for rank, res in enumerate(results):
        assert res["lora_calls"] == res["formula"] == want, (rank, res["lora_calls"], res["formula"])
        a_shape, b_shape = res["shapes"]
        if kind == "embedding":    # the table's vocabulary rows; B whole
            assert a_shape == (cases.MAX_LORAS, part if fully_sharded else cases.VOCAB, r)
            assert b_shape == (cases.MAX_LORAS, cases.EMBED, r)
        else:                      # A's rank chunk; B's vocabulary rows
            assert a_shape == (cases.MAX_LORAS, r // world if fully_sharded else r, cases.HIDDEN)
            assert b_shape == (cases.MAX_LORAS, part, r)


@pytest.mark.parametrize("kind,tokens,want", [("embedding", 1, "replicated"), ("lm_head", 1, "fully_sharded"),
                                              ("lm_head", 4096, "replicated")])
def test_vocab_layout_chosen_by_bytes(pools, kind, tokens, want):
    results = pools(2).run(cases.case_vocab, kind=kind, fully_sharded=None, tokens_per_step=tokens)
    _check_equal(results)
    for res in results:
        assert res["layout"] == want, res["costs"]


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("fully_sharded", [False, True], ids=["replicated", "fully_sharded"])
def test_slot_loading_keeps_only_this_ranks_shard(pools, world, fully_sharded):
    q, kv = 16, 8                   # QKV: 4 q heads and 2 kv heads of size 4
    for rank, res in enumerate(pools(world).run(cases.case_loading, fully_sharded=fully_sharded)):
        assert res["kept"] == [False] * 6, "the layer shares memory with, or keeps, the caller's full B"
        assert res["b_rows"] == [q // world, max(kv // world, 4), max(kv // world, 4)]
        assert all(res["b_ok"]) and all(res["a_ok"]) and res["q_complete"], res
        # slots 0, 1, 2 hold adapters of ranks 2, 4, 8; with A split along the rank, rank p holds
        # the part of each adapter's rank in its chunk [p r/P, (p+1) r/P)
        assert res["layer_ranks"] == res["ranks"] == [2, 4, 8, 0]
        chunk = cases.MAX_RANK // world if fully_sharded else cases.MAX_RANK
        first = rank * chunk if fully_sharded else 0
        assert res["local_ranks"] == [max(0, min(r, first + chunk) - first) for r in (2, 4, 8, 0)]
        assert res["reload_ok"] and res["ranks_after_reload"] == [2, 4, 2, 0]
        assert res["cleared"] and res["ranks_after_clear"] == [2, 0, 2, 0]
        assert res["in_place"], "loading must write into the existing slot tensors (CUDA graphs keep addresses)"
        assert res["table_ok"]


@pytest.mark.parametrize("case,kind", [(cases.case_linear, "qkv"), (cases.case_linear, "row"),
                                       (cases.case_vocab, "embedding"), (cases.case_vocab, "lm_head")])
def test_triton_backend_in_the_interpreter(pools, case, kind):
    """The layers over the Triton kernels (Triton's interpreter on the CPU), fully sharded."""
    pytest.importorskip("triton")
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("Triton's interpreter needs TRITON_INTERPRET=1 before import (tests/conftest.py sets it)")
    _check_equal(pools(2).run(case, kind=kind, fully_sharded=True, backend="triton"))


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("fully_sharded", [False, True], ids=["replicated", "fully_sharded"])
def test_adapter_manager_loads_each_ranks_shard(pools, world, fully_sharded):
    """torch_lora.AdapterManager over tensor-parallel layers: every rank's slots equal what the
    per-rank loader writes (after activation, a hot swap and an eviction), and neither the slots
    nor the host cache hold more than the rank's shard of B."""
    for rank, res in enumerate(pools(world).run(cases.case_manager, fully_sharded=fully_sharded)):
        assert res["first"] and res["second"], (rank, res)
        assert res["host_elems"] == res["slot_elems"], res
        assert sum(res["b_rows"]) * cases.MAX_RANK < res["full_b_elems"], res
        assert 4 in res["table"] and None not in res["table"][:3], res
