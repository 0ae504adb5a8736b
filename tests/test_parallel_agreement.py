"""Tensor-parallel ranks that disagree (gloo, 2 processes on 127.0.0.1): a different `max_rank`, token
count or mapping, an adapter loaded on one rank only, different adapter contents, a bad mapping or
bad layer arguments on one rank, and AdapterManager slot tables that differ. Each gives the same
clear ValueError on every rank, naming the field (and slot) and the ranks' values, within seconds:
never an aborted process, a hang or a wrong row. When the ranks agree the layers' outputs equal the
unsharded computation, the check is one all-gather per layer built and per update_metadata, and
check_agreement=False removes it.

The cases run on every rank of one pool (tests/distributed.py), the functions below.
"""

from __future__ import annotations

import time

import pytest
import torch

from torch_lora import LoRAMapping
from torch_lora.parallel import ColumnParallelLinearWithLoRA, ParallelPunicaWrapper, RowParallelLinearWithLoRA
from torch_lora.parallel.layout import even_range

from . import parallel_cases as cases
from .distributed import CollectiveLog, ProcessPool, gloo_env_ok

pytestmark = pytest.mark.skipif(not gloo_env_ok(), reason="needs torch.distributed with gloo")

WORLD = 2
HIDDEN, OUT, MAX_LORAS = 32, 24, 4
IDS = [5, 6, 7, None]                          # slot -> LoRA id
RANKS = {5: 2, 6: 4, 7: 8}
TOKENS = (5, 0, 7, 6, 7, 0, 5)
BOUND_S = 10.0                                 # an error comes at once, not after a collective's timeout


@pytest.fixture(scope="module")
def pool():
    p = ProcessPool(WORLD, "gloo", timeout=20)
    yield p
    p.close()


# ----------------------------------------------------------------------------- what each rank runs

def _layers(rank, world, *, max_rank=8, fully_sharded=True, check_agreement=True):
    """A fully sharded column layer (its all-gather's size depends on max_rank) and a row layer (its
    all-reduce's on the token count), around real base layer shards."""
    g = torch.Generator().manual_seed(0)
    w_col, b_col = torch.randn(OUT, HIDDEN, generator=g), torch.randn(OUT, generator=g)
    w_row, b_row = torch.randn(OUT, HIDDEN, generator=g), torch.randn(OUT, generator=g)
    rows = torch.arange(*even_range("n", OUT, rank, world))
    col = ColumnParallelLinearWithLoRA(cases.ColumnShard(w_col, b_col, rows),
                                       input_size=HIDDEN, output_size=OUT, max_loras=MAX_LORAS, max_rank=max_rank,
                                       fully_sharded=fully_sharded, check_agreement=check_agreement)
    row = RowParallelLinearWithLoRA(cases.RowShard(w_row, b_row, slice(*even_range("in", HIDDEN, rank, world))),
                                    input_size=HIDDEN, output_size=OUT, max_loras=MAX_LORAS, max_rank=max_rank,
                                    fully_sharded=fully_sharded, check_agreement=check_agreement)
    return col, row, (w_col, b_col, w_row, b_row)


def _adapter(lora_id, seed=0):
    g = torch.Generator().manual_seed(100 * lora_id + seed)
    r = RANKS[lora_id]
    return (torch.randn(r, HIDDEN, generator=g) / HIDDEN ** 0.5, torch.randn(OUT, r, generator=g),
            torch.randn(r, HIDDEN, generator=g) / HIDDEN ** 0.5, torch.randn(OUT, r, generator=g))


def _load(col, row, skip=(), seeds=None):
    for slot, i in enumerate(IDS):
        if i is None or i in skip:
            continue
        a_col, b_col, a_row, b_row = _adapter(i, (seeds or {}).get(i, 0))
        col.set_lora(slot, a_col, b_col, scaling=0.5)
        row.set_lora(slot, a_row, b_row, scaling=0.5)


def _attempt(fn) -> dict:
    start = time.monotonic()
    try:
        value = fn()
    except Exception as e:                      # the test asserts on the type and message
        return {"error": (type(e).__name__, str(e)), "seconds": time.monotonic() - start}
    return {"error": None, "value": value, "seconds": time.monotonic() - start}


def _step(rank, world, *, max_rank=8, tokens=TOKENS, table=IDS, skip=(), seeds=None, check_agreement=True,
          layers_check=True, log=False) -> dict:
    """Builds both layers, loads the adapters, maps one step and runs it; returns each layer's largest
    relative error against the unsharded computation (float64), and the collectives issued."""
    with CollectiveLog() as build_log:
        col, row, (w_col, b_col, w_row, b_row) = _layers(rank, world, max_rank=max_rank,
                                                         check_agreement=layers_check)
    _load(col, row, skip, seeds)
    w = ParallelPunicaWrapper(16, 4, "cpu", max_loras=MAX_LORAS, check_agreement=check_agreement)
    col.set_mapping(w)
    row.set_mapping(w)
    with CollectiveLog() as step_log:
        w.update_metadata(LoRAMapping(tokens, tokens[:2]), table, MAX_LORAS + 1, 64)
    x = torch.randn(len(tokens), HIDDEN, generator=torch.Generator().manual_seed(1))
    in_cols = slice(*even_range("in", HIDDEN, rank, world))
    out_cols = slice(*even_range("n", OUT, rank, world))
    y_col, y_row = col(x), row(x[:, in_cols])

    def expected(w_full, b_full, part):
        y = x.double() @ w_full.double().T + b_full.double()
        for t, i in enumerate(tokens):
            if i:
                a, b = _adapter(i)[part:part + 2]
                y[t] += 0.5 * (x[t].double() @ a.double().T) @ b.double().T
        return y

    def rel(got, want):
        return float((got.double() - want).abs().max() / want.abs().max())

    return dict(err_col=rel(y_col, expected(w_col, b_col, 0)[:, out_cols]),
                err_row=rel(y_row, expected(w_row, b_row, 2)),
                build_calls=build_log.calls if log else None, step_calls=step_log.calls if log else None,
                digests=[col.slot_digests, row.slot_digests])


def case_disagree(rank: int, world: int, what: str) -> dict:
    """The last rank differs from the others in `what`; returns _attempt's record of the step."""
    odd = rank == world - 1
    kwargs = {
        "max_rank": dict(max_rank=16 if odd else 8),
        "max_rank_at_step": dict(max_rank=16 if odd else 8, layers_check=False),
        "tokens": dict(tokens=TOKENS[:-1] if odd else TOKENS),
        "mapping": dict(tokens=(6,) + TOKENS[1:] if odd else TOKENS),
        "slot_table": dict(table=[5, 7, 6, None] if odd else IDS),
        "adapter_on_one_rank": dict(skip=(6,) if odd else ()),
        "adapter_contents": dict(seeds={7: 1} if odd else {}),
        "bad_mapping_on_one_rank": dict(tokens=(9,) + TOKENS[1:] if odd else TOKENS),
        "agree": {},
    }[what]
    return _attempt(lambda: _step(rank, world, **kwargs))


def case_bad_build_on_one_rank(rank: int, world: int) -> dict:
    """The last rank's layer fails its own argument check (max_rank 3 cannot be split over 2 ranks)."""
    return _attempt(lambda: _layers(rank, world, max_rank=3 if rank == world - 1 else 8))


def case_forward_rows_on_one_rank(rank: int, world: int) -> dict:
    """The ranks agree on a 7-token step; the last rank's forward passes 6 tokens to the row layer
    (whose base layer would all-reduce at once). The others run nothing."""
    col, row, _ = _layers(rank, world)
    _load(col, row)
    w = ParallelPunicaWrapper(16, 4, "cpu", max_loras=MAX_LORAS)
    row.set_mapping(w)
    w.update_metadata(LoRAMapping(TOKENS, TOKENS[:2]), IDS, MAX_LORAS + 1, 64)
    if rank != world - 1:
        return {"error": None, "calls": []}
    with CollectiveLog() as log:
        result = _attempt(lambda: row(torch.zeros(len(TOKENS) - 1, HIDDEN // world)))
    return dict(result, calls=log.calls)


def case_vocab_rows(rank: int, world: int) -> dict:
    """The embedding (ids: one per token) and the LM head (h: one row per sampled row), fully
    sharded, under a ParallelPunicaWrapper: the mapped counts run; one more raises, before any
    collective (the same on every rank here, so nobody waits)."""
    from torch_lora.parallel import ParallelLMHeadWithLoRA, VocabParallelEmbeddingWithLoRA
    from torch_lora.parallel.layout import padded_range

    vocab, g = 50, torch.Generator().manual_seed(3)
    part = padded_range(vocab, rank, world)
    emb = VocabParallelEmbeddingWithLoRA(cases.VocabShardEmbedding(torch.randn(vocab, 16, generator=g), part),
                                         num_embeddings=vocab, embedding_dim=16, max_loras=MAX_LORAS, max_rank=8,
                                         fully_sharded=True)
    head = ParallelLMHeadWithLoRA(cases.LMHeadShard(torch.randn(vocab, HIDDEN, generator=g), part),
                                  input_size=HIDDEN, vocab_size=vocab, max_loras=MAX_LORAS, max_rank=8,
                                  fully_sharded=True)
    w = ParallelPunicaWrapper(16, 4, "cpu", max_loras=MAX_LORAS)
    emb.set_mapping(w)
    head.set_mapping(w)
    w.update_metadata(LoRAMapping(TOKENS, TOKENS[:2]), IDS, MAX_LORAS + 1, vocab)
    emb(torch.arange(len(TOKENS)))
    head(torch.randn(2, HIDDEN, generator=g))
    with CollectiveLog() as log:
        errors = [_attempt(lambda: emb(torch.arange(len(TOKENS) + 1)))["error"],
                  _attempt(lambda: head(torch.randn(3, HIDDEN, generator=g)))["error"]]
    return {"errors": errors, "calls": log.calls}


def case_reload_after_a_step(rank: int, world: int) -> dict:
    """An agreed step, then the last rank alone clears slot 1 and another step with the same mapping."""
    col, row, _ = _layers(rank, world)
    _load(col, row)
    w = ParallelPunicaWrapper(16, 4, "cpu", max_loras=MAX_LORAS)
    col.set_mapping(w)
    row.set_mapping(w)
    first = _attempt(lambda: w.update_metadata(LoRAMapping(TOKENS, TOKENS[:2]), IDS, MAX_LORAS + 1, 64))
    if rank == world - 1:
        row.reset_lora(1)
    return {"first": first, "second": _attempt(lambda: w.update_metadata(LoRAMapping(TOKENS, TOKENS[:2]), IDS,
                                                                         MAX_LORAS + 1, 64))}


def case_agree_costs(rank: int, world: int, check_agreement: bool) -> dict:
    return _step(rank, world, check_agreement=check_agreement, layers_check=check_agreement, log=True)


def case_manager_slot_tables(rank: int, world: int) -> dict:
    """AdapterManagers over the layers: the last rank activates one adapter fewer; the engine passes
    each manager's slot table to update_metadata."""
    from lora_core.peft import LoraModule, PeftAdapter
    from torch_lora.adapters import AdapterManager

    col, row, _ = _layers(rank, world)
    col.module_names, row.module_names = ("m.up",), ("m.down",)
    manager = AdapterManager({"col": col, "row": row})
    for i in (5, 6):
        a_col, b_col, a_row, b_row = (t.numpy() for t in _adapter(i))
        manager.register(i, PeftAdapter(name=f"a{i}", r=RANKS[i], lora_alpha=RANKS[i], use_rslora=False,
                                        target_modules=None, config={}, base_layer_shapes={},
                                        modules={"m.up": LoraModule(a_col, b_col, 1.0, "linear"),
                                                 "m.down": LoraModule(a_row, b_row, 1.0, "linear")}))
    table = manager.activate([5] if rank == world - 1 else [5, 6])
    w = ParallelPunicaWrapper(16, 4, "cpu", max_loras=MAX_LORAS)
    col.set_mapping(w)
    row.set_mapping(w)
    return _attempt(lambda: w.update_metadata(LoRAMapping((5, 6, 0), (5,)), table, MAX_LORAS + 1, 64))


# ----------------------------------------------------------------------------- the tests

def _errors(results) -> list[str]:
    for rank, r in enumerate(results):
        assert r["error"] is not None, f"rank {rank} ran the step: {r.get('value')}"
        assert r["error"][0] == "ValueError", (rank, r["error"])
        assert r["seconds"] < BOUND_S, (rank, r["seconds"])
    return [r["error"][1] for r in results]


@pytest.mark.parametrize("what,wanted", [
    ("max_rank", ["ranks disagree on the ColumnParallelLinearWithLoRA being built", "max_rank: rank 0 has 8, "
                  "rank 1 has 16"]),
    ("max_rank_at_step", ["ranks disagree on the step passed to update_metadata", "layer geometry"]),
    ("tokens", ["tokens: rank 0 has 7, rank 1 has 6", "token mapping (LoRA id per token)"]),
    ("mapping", ["token mapping (LoRA id per token): rank 0 has one value, rank 1 has a different one"]),
    ("slot_table", ["slot table (lora_index_to_id)"]),
    ("adapter_on_one_rank", ["the adapters in the slots this step uses", "slot 1 (LoRA id 6): rank 0: adapter",
                             "rank 1: empty", "layer 0 (ColumnParallelLinearWithLoRA)",
                             "layer 1 (RowParallelLinearWithLoRA)"]),
    ("adapter_contents", ["slot 2 (LoRA id 7): rank 0: adapter", "rank 1: adapter"]),
    ("bad_mapping_on_one_rank", ["update_metadata's own checks failed (1 or 0): rank 0 has 0, rank 1 has 1"]),
])
def test_disagreement_raises_on_every_rank(pool, what, wanted):
    messages = _errors(pool.run(case_disagree, what=what))
    for rank, message in enumerate(messages):
        for text in wanted:
            assert text in message, (rank, text, message)
        assert f"this is rank {rank}" in message
    assert len({m.replace(f"this is rank {r}", "") for r, m in enumerate(messages)}) <= 2


def test_adapter_contents_name_only_the_slot_that_differs(pool):
    for message in _errors(pool.run(case_disagree, what="adapter_contents")):
        assert "slot 2" in message and "slot 0" not in message and "slot 1 " not in message, message


def test_the_rank_whose_own_check_failed_says_why(pool):
    messages = _errors(pool.run(case_disagree, what="bad_mapping_on_one_rank"))
    assert "on this rank" not in messages[0]
    assert "on this rank: ValueError" in messages[1] and "9" in messages[1], messages[1]
    messages = _errors(pool.run(case_bad_build_on_one_rank))
    for message in messages:
        assert "the layer's own argument checks failed (1 or 0): rank 0 has 0, rank 1 has 1" in message, message
        assert "max_rank: rank 0 has 8, rank 1 has 3" in message, message
    assert "max_rank=3 must be divisible by the process group size 2" in messages[1]


def test_forward_with_another_token_count_raises_before_any_collective(pool):
    results = pool.run(case_forward_rows_on_one_rank)
    assert results[0]["error"] is None
    assert results[1]["error"][0] == "ValueError", results[1]
    assert "x has 6 tokens, but update_metadata mapped 7 tokens on every rank" in results[1]["error"][1]
    assert results[1]["calls"] == [], "a collective was issued before the check"


def test_vocab_layers_take_the_mapped_counts(pool):
    for r in pool.run(case_vocab_rows):
        assert r["errors"][0][0] == "ValueError" and "ids has 8 tokens, but update_metadata mapped 7" in \
            r["errors"][0][1], r
        assert "h has 3 sampled rows, but update_metadata mapped 2 sampled rows" in r["errors"][1][1], r
        assert r["calls"] == [], r


def test_a_slot_changed_after_a_step_is_seen_at_the_next(pool):
    results = pool.run(case_reload_after_a_step)
    assert all(r["first"]["error"] is None for r in results), results
    for message in _errors([r["second"] for r in results]):
        assert "layer 1 (RowParallelLinearWithLoRA) slot 1 (LoRA id 6): rank 0: adapter" in message, message
        assert "rank 1: empty" in message and "layer 0" not in message, message


def test_manager_slot_tables_that_differ(pool):
    for message in _errors(pool.run(case_manager_slot_tables)):
        assert "slot table (lora_index_to_id): rank 0 has one value, rank 1 has a different one" in message, message


def test_agreeing_ranks_run_the_step(pool):
    results = pool.run(case_disagree, what="agree")
    for rank, r in enumerate(results):
        assert r["error"] is None, (rank, r["error"])
        assert r["value"]["err_col"] < 1e-5 and r["value"]["err_row"] < 1e-5, (rank, r["value"])
    assert results[0]["value"]["digests"] == results[1]["value"]["digests"]


@pytest.mark.parametrize("check", [True, False], ids=["checked", "unchecked"])
def test_the_check_costs_one_small_all_gather(pool, check):
    """One all-gather of a few int64 per rank per layer built and per update_metadata; none when off."""
    for r in pool.run(case_agree_costs, check_agreement=check):
        assert r["err_col"] < 1e-5 and r["err_row"] < 1e-5, r
        if check:
            assert r["build_calls"] == [("all_gather", WORLD * 11 * 8)] * 2, r["build_calls"]
            assert r["step_calls"] == [("all_gather", WORLD * 16 * 8)], r["step_calls"]
        else:
            assert r["build_calls"] == [] and r["step_calls"] == [], r
        assert all(d == ([0] * MAX_LORAS if not check else d) for d in r["digests"])
        if check:
            assert all(d[3] == 0 and len(set(d[:3])) == 3 for d in r["digests"]), r["digests"]


def test_check_agreement_must_be_a_bool():
    with pytest.raises(TypeError, match="check_agreement must be True or False, got 1"):
        ParallelPunicaWrapper(16, 4, "cpu", max_loras=MAX_LORAS, check_agreement=1)
