"""torch_lora.parallel on CPU process groups (gloo, 2 and 4 processes on 127.0.0.1): every sharded
layer equals the unsharded layer (torch_lora on one process, and the float64 oracle), in both layouts;
the collectives each layout issues match layout.py's byte formulas; the layout choice by bytes.

The cases run in tests/parallel_cases.py, on every rank of a pool started once per group size. One
more test starts its own two gloo processes on a worker script: QKV with fewer kv heads than ranks,
the LM head with a padded last shard, the bytes worked by hand, and AdapterManager writing only its
rank's shard. CPU only; the NCCL counterpart is tests/test_gpu_parallel_torch.py.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys

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


REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


_TP_WORKER = r'''
import os, sys, numpy as np, torch, torch.distributed as dist
import torch_lora
from torch_lora import LoRAMapping
from torch_lora.parallel import (ColumnParallelLinearWithLoRA, ParallelLMHeadWithLoRA, QKVParallelLinearWithLoRA,
                                 RowParallelLinearWithLoRA)
from torch_lora.adapters import save_peft_adapter

rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
dist.init_process_group("gloo", rank=rank, world_size=world)
H, N_COL, N_ROW, R = 16, 8, 12, 4
rng = np.random.default_rng(0)                                   # same full weights on every rank
W_col, W_row = rng.standard_normal((N_COL, H)), rng.standard_normal((N_ROW, H))
adapters = {0: (rng.standard_normal((2, H)), rng.standard_normal((N_COL, 2)), rng.standard_normal((N_ROW, 2))),
            1: (rng.standard_normal((4, H)), rng.standard_normal((N_COL, 4)), rng.standard_normal((N_ROW, 4)))}
x = rng.standard_normal((5, H))
slots = [0, -1, 1, 0, 1]                                          # per token; -1 = no LoRA
ids = [{0: 1, 1: 2, -1: 0}[s] for s in slots]
SCALE = 0.5

def expected(W, which):
    y = x @ W.T
    for t, s in enumerate(slots):
        if s >= 0:
            A, B = adapters[s][0], adapters[s][which]
            y[t] += SCALE * (x[t] @ A.T) @ B.T
    return y

cols = slice(rank * N_COL // world, (rank + 1) * N_COL // world)
ins = slice(rank * H // world, (rank + 1) * H // world)

class RowBase(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.tensor(W_row[:, ins], dtype=torch.float32), requires_grad=False)
    def forward(self, xp):
        y = xp @ self.weight.T
        dist.all_reduce(y)
        return y

def punica():
    w = torch_lora.PunicaWrapper(16, 4, "cpu", max_loras=2, backend="torch")
    w.update_metadata(LoRAMapping(tuple(ids), tuple(ids)), [1, 2], 3, 32)
    return w

failures = []
for fs in (False, True):
    base = torch.nn.Linear(H, N_COL // world, bias=False)
    base.weight.data = torch.tensor(W_col[cols], dtype=torch.float32)
    col = ColumnParallelLinearWithLoRA(base, input_size=H, output_size=N_COL, max_loras=2, max_rank=R,
                                       fully_sharded=fs)
    row = RowParallelLinearWithLoRA(RowBase(), input_size=H, output_size=N_ROW, max_loras=2, max_rank=R,
                                    fully_sharded=fs)
    for layer in (col, row):
        layer.set_mapping(punica())
    for s, (A, Bc, Br) in adapters.items():
        col.set_lora(s, A, Bc, scaling=SCALE)
        row.set_lora(s, A, Br, scaling=SCALE)
    with torch.no_grad():
        yc = col(torch.tensor(x, dtype=torch.float32)).double().numpy()
        yr = row(torch.tensor(x[:, ins], dtype=torch.float32)).double().numpy()
    for name, got, want in (("column", yc, expected(W_col, 1)[:, cols]), ("row", yr, expected(W_row, 2))):
        err = np.linalg.norm(got - want) / np.linalg.norm(want)
        if not err < 1e-5:
            failures.append(f"{name} fully_sharded={fs}: rel err {err}")
    # rows without an adapter are the base layer's output bit for bit
    with torch.no_grad():
        plain = base(torch.tensor(x, dtype=torch.float32))[1:2].double().numpy()
    if not np.array_equal(yc[1:2], plain):
        failures.append(f"column fully_sharded={fs}: no-LoRA row changed")

# QKV with fewer kv heads than ranks (each kv head replicated) and an LM head whose last shard is padded
NH, NKV, HD, V = 4, 1, 2, 7
Wq, Wk, Wv, W_head = (rng.standard_normal((n, H)) for n in (NH * HD, NKV * HD, NKV * HD, V))
qkv_ad = {s: [(rng.standard_normal((r, H)), rng.standard_normal((n, r))) for n in (NH * HD, NKV * HD, NKV * HD)]
          for s, r in ((0, 2), (1, 4))}
head_ad = {s: (rng.standard_normal((r, H)), rng.standard_normal((V, r))) for s, r in ((0, 2), (1, 4))}
q_rows = slice(rank * NH * HD // world, (rank + 1) * NH * HD // world)
part = -(-V // world)
v_rows = slice(rank * part, min((rank + 1) * part, V))

class Fixed(torch.nn.Module):
    def __init__(self, W):
        super().__init__()
        self.W = torch.tensor(W, dtype=torch.float32)
    def forward(self, h):
        return h @ self.W.T

head_w = np.zeros((part, H))
head_w[: v_rows.stop - v_rows.start] = W_head[v_rows]
for fs in (False, True):
    qkv = QKVParallelLinearWithLoRA(Fixed(np.concatenate([Wq[q_rows], Wk, Wv])), input_size=H, num_heads=NH,
                                    num_kv_heads=NKV, head_size=HD, max_loras=2, max_rank=R, fully_sharded=fs)
    head = ParallelLMHeadWithLoRA(Fixed(head_w), input_size=H, vocab_size=V, max_loras=2, max_rank=R,
                                  fully_sharded=fs)
    for layer in (qkv, head):
        layer.set_mapping(punica())
    for s in (0, 1):
        qkv.set_lora(s, [f[0] for f in qkv_ad[s]], [f[1] for f in qkv_ad[s]], scaling=SCALE)
        head.set_lora(s, *head_ad[s], scaling=SCALE)
    with torch.no_grad():
        got_qkv = qkv(torch.tensor(x, dtype=torch.float32)).double().numpy()
        got_head = head(torch.tensor(x, dtype=torch.float32)).double().numpy()
    want = []
    for k, (W, rows) in enumerate(((Wq, q_rows), (Wk, slice(None)), (Wv, slice(None)))):
        y = x @ W.T
        for t, s in enumerate(slots):
            if s >= 0:
                y[t] += SCALE * (x[t] @ qkv_ad[s][k][0].T) @ qkv_ad[s][k][1].T
        want.append(y[:, rows])
    want = np.concatenate(want, 1)
    if not np.abs(got_qkv - want).max() < 1e-4:
        failures.append(f"qkv (replicated kv heads) fully_sharded={fs}: error {np.abs(got_qkv - want).max()}")
    logits = x @ W_head.T
    for t, s in enumerate(slots):
        if s >= 0:
            logits[t] += SCALE * (x[t] @ head_ad[s][0].T) @ head_ad[s][1].T
    want = np.zeros((len(slots), part))
    want[:, : v_rows.stop - v_rows.start] = logits[:, v_rows]
    if not np.abs(got_head - want).max() < 1e-4:
        failures.append(f"LM head (padded shard) fully_sharded={fs}: error {np.abs(got_head - want).max()}")

# bytes per call (docs/parallel_torch.md formulas, worked by hand for P=2, T=5, D=2, r=4, w=f=e=4)
costs = col.layout_costs(5)
got = {k: (c.weight_bytes, tuple(c.collectives), c.link_bytes) for k, c in costs.items()}
want = {"replicated": (2 * (4 * 16 + 4 * 4) * 4, (), 0),
        "fully_sharded": (2 * (2 * 16 + 4 * 4) * 4, (("all_gather", 5 * 4 * 4),), 40)}
if got != want:
    failures.append(f"column layout_costs {got} != {want}")
costs = row.layout_costs(5)
got = {k: (c.weight_bytes, tuple(c.collectives), c.link_bytes) for k, c in costs.items()}
want = {"replicated": (2 * (4 * 8 + 12 * 4) * 4, (("all_reduce", 80),), 80),
        "fully_sharded": (2 * (4 * 8 + 6 * 4) * 4, (("all_reduce", 80), ("all_gather", 5 * 12 * 4)), 80 + 120)}
if got != want:
    failures.append(f"row layout_costs {got} != {want}")

try:
    ColumnParallelLinearWithLoRA(torch.nn.Linear(H, N_COL // world), input_size=H, output_size=N_COL, max_loras=2,
                                 max_rank=3, fully_sharded=True)
    failures.append("max_rank 3 over 2 ranks with fully_sharded=True did not raise")
except ValueError:
    pass
try:
    ColumnParallelLinearWithLoRA(torch.nn.Linear(H, N_COL // world), input_size=H, output_size=N_COL, max_loras=2,
                                 max_rank=4)
    failures.append("no layout and no tokens_per_step did not raise")
except ValueError:
    pass

# AdapterManager on a tensor-parallel layer: each rank keeps only its shard of B
name = "model.layers.0.mlp.up_proj"
path = os.path.join(sys.argv[1], f"adapter-rank{rank}")
A, Bc, _ = adapters[1]
save_peft_adapter(path, {name: (A, Bc)}, r=4, lora_alpha=2.0)
base = torch.nn.Linear(H, N_COL // world, bias=False)
base.weight.data = torch.tensor(W_col[cols], dtype=torch.float32)
col = ColumnParallelLinearWithLoRA(base, input_size=H, output_size=N_COL, max_loras=2, max_rank=R, fully_sharded=False)
col.module_names = (name,)
mgr = torch_lora.AdapterManager({"col": col})
mgr.register(2, path)
mgr.activate([2])
if tuple(col.lora_b_stacked[0].shape) != (2, N_COL // world, R):
    failures.append(f"manager slot B shape {tuple(col.lora_b_stacked[0].shape)}: not this rank's shard")
slot = mgr.slot_of(2)
want_b = Bc[cols] * (2.0 / 4)
if not np.allclose(col.lora_b_stacked[0][slot].numpy(), want_b, atol=1e-6):
    failures.append("manager wrote another part of B than this rank's rows")
print("RANK", rank, "FAILURES", failures, flush=True)
dist.destroy_process_group()
sys.exit(1 if failures else 0)
'''


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_tensor_parallel_layers_over_two_gloo_processes(tmp_path):
    """On CPU with gloo processes: column-, row-, QKV- (GQA, kv heads
    replicated over ranks) parallel layers and the LM head (padded last vocabulary shard), in both
    layouts, equal the unsharded computation (float64 oracle) with mixed adapters, the bytes each
    layout moves (layout_costs) equal the documented formulas worked by hand,
    heterogeneous ranks and a no-LoRA row (bit-for-bit base output); fully_sharded=True with a
    rank not divisible by P and a layer without a layout choice raise; AdapterManager writes only
    this rank's shard of a column-parallel layer's B."""
    script = tmp_path / "tp_worker.py"
    script.write_text(_TP_WORKER)
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), WORLD_SIZE="2",
               OMP_NUM_THREADS="1")
    env.pop("TRITON_INTERPRET", None)
    procs = [subprocess.Popen([sys.executable, str(script), str(tmp_path)], cwd=REPO, env=dict(env, RANK=str(r)),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in range(2)]
    outs = [p.communicate(timeout=120)[0] for p in procs]
    for p, out in zip(procs, outs):
        assert p.returncode == 0, out[-3000:]
