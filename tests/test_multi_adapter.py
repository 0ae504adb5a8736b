"""Several adapters per token, each with its own strength (contract section 10).

Covers: `LoRAMapping` with per-token id tuples and weights (parsing, errors, the pair bucket,
`first_ids`); the host build of the pair tables (`lora_core.adapter_pairs`: groups, slots,
weights, the group capacity); the Triton kernels' PAIRS path (torch, Triton's interpreter on the
CPU) against the float64 oracle for k = 1 (weighted), 2 and 4 pairs, with per-slot ranks, split-K
workspaces, atomic split-K, one tile per batch (SMALL_T), several rank blocks and the fused
one-launch kernel; that a plain
mapping plans PAIRS = 0 (today's kernels); that the wrapper refuses the one-adapter methods and a
bias in a paired step. The conformance suite (tests/test_conformance.py) runs every backend on
paired mappings; the models' merged-weights parity is tests/test_multi_adapter_models.py.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

from lora_core.adapter_pairs import PAIR_BUCKETS, AdapterPairs, PairLayout, build_pairs_host, pair_bucket
from lora_core.host_mapping import LoRAMapping, prepare_step

from . import oracle

torch = pytest.importorskip("torch")


# ----------------------------------------------------------------------------- the mapping

def test_mapping_with_tuples_and_weights():
    m = LoRAMapping([(3, 5), 3, (), (5,)], (3, 0), False, [(0.5, 0.25), 2.0, (), [1.5]])
    assert m.paired and m.num_pairs == 2
    assert m.index_mapping == ((3, 5), (3,), (), (5,))
    assert m.index_weights == ((0.5, 0.25), (2.0,), (), (1.5,))
    assert m.first_ids == (3, 3, 0, 5)
    plain = LoRAMapping((3, 0), (3,))
    assert not plain.paired and plain.num_pairs == 0 and plain.first_ids == (3, 0)
    assert LoRAMapping([(1, 2, 3)], (0,)).num_pairs == 4          # bucketed: 3 adapters run the 4-pair kernels
    assert LoRAMapping([(1, 2)], (0,)).index_weights == ((1.0, 1.0),)


@pytest.mark.parametrize("entries,weights,error,words", [
    ([(1, 2)], [(0.5,)], ValueError, "index_weights[0] has 1 weights for 2"),
    ([1, 2], [1.0], ValueError, "index_weights has 1 entries"),
    ([(1, True)], None, TypeError, "integer LoRA ids"),
    ([(1,)], [(float("nan"),)], ValueError, "finite"),
    ([(1,)], [("a",)], TypeError, "real number"),
    ([(1, 2, 3, 4, 5)], None, ValueError, "at most 4 adapters"),
])
def test_mapping_errors_name_the_token(entries, weights, error, words):
    with pytest.raises(error, match=words.replace("[", r"\[").replace("]", r"\]")):
        _ = LoRAMapping(entries, (0,), False, weights).num_pairs


def test_pair_bucket():
    assert [pair_bucket(n) for n in (0, 1, 2, 3, 4)] == [1, 1, 2, 4, 4]
    assert PAIR_BUCKETS == (1, 2, 4)


def test_build_pairs_host_groups_and_tables():
    slots = np.array([[2, 0], [-1, -1], [2, 0], [1, -1], [0, 2]])
    weights = np.array([[0.5, 0.5], [0, 0], [0.25, 1.0], [3.0, 0], [1, 1]], np.float32)
    meta, pairs = build_pairs_host(slots, weights, max_groups=4, capacity=8)
    # groups: the distinct tuples ascending: (0, 2) -> 0, (1, -1) -> 1, (2, 0) -> 2; no adapter -> -1
    np.testing.assert_array_equal(meta.token_lora_mapping[:5], [2, -1, 2, 1, 0])
    np.testing.assert_array_equal(pairs.slots[:3], [[0, 2], [1, -1], [2, 0]])
    np.testing.assert_array_equal(pairs.slots[3], [-1, -1])
    np.testing.assert_array_equal(pairs.weights[:5], weights)
    np.testing.assert_array_equal(pairs.weights[5:], 0)
    assert pairs.num_pairs == 2 and meta.active_lora_ids.shape == (5,)
    with pytest.raises(ValueError, match="3 distinct adapter combinations, more than the 2 groups"):
        build_pairs_host(slots, weights, max_groups=2, capacity=8)


def test_prepare_step_pairs_and_unknown_id():
    m = LoRAMapping([(7, 9), (9,), ()], (7, 0, 0), False, [(1.0, -0.5), (2.0,), ()])
    step = prepare_step(m, [9, None, 7], 4, 32, 0, None, max_num_batched_tokens=8, max_batches=4, num_slots=3,
                        pad_prompt=False)
    meta, pairs, rows = step.pairs
    np.testing.assert_array_equal(step.indices.base_indices, [2, 0, -1])     # first adapter per token
    group = meta.token_lora_mapping[:3]
    assert group[2] == -1
    np.testing.assert_array_equal(pairs.slots[group[0]], [2, 0])
    np.testing.assert_array_equal(pairs.slots[group[1]], [0, -1])
    np.testing.assert_array_equal(pairs.weights[:3], [[1.0, -0.5], [2.0, 0.0], [0.0, 0.0]])
    np.testing.assert_array_equal(rows.token_slots[:3], [[2, 0], [0, -1], [-1, -1]])
    np.testing.assert_array_equal(rows.row_slots[:3], [[2, -1], [-1, -1], [-1, -1]])   # prompt ids: (7,), 0, 0
    np.testing.assert_array_equal(rows.row_weights[:1], [[1.0, 0.0]])
    layout = PairLayout(8, 4, 2)
    block = layout.fill(np.empty(layout.size, np.int32), meta, pairs, rows)
    _, views, row_views = layout.views(block)
    np.testing.assert_array_equal(views.weights.view(np.float32), pairs.weights)
    np.testing.assert_array_equal(row_views.token_slots, rows.token_slots)
    with pytest.raises(ValueError, match="LoRA id 8"):
        prepare_step(LoRAMapping([(7, 8)], (0,)), [9, None, 7], 4, 32, 0, None, max_num_batched_tokens=8,
                     max_batches=4, num_slots=3, pad_prompt=False)


# ----------------------------------------------------------------------------- the Triton kernels

def _case(seed, num_tokens, hidden, rank, widths, num_slots, num_pairs):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((num_tokens, hidden)).astype(np.float32)
    lora_a = [(rng.standard_normal((num_slots, rank, hidden)) / np.sqrt(hidden)).astype(np.float32) for _ in widths]
    lora_b = [(rng.standard_normal((num_slots, n, rank)) / np.sqrt(rank)).astype(np.float32) for n in widths]
    slots = np.full((num_tokens, num_pairs), -1, np.int64)
    weights = np.zeros((num_tokens, num_pairs), np.float32)
    for t in range(num_tokens):
        n = num_pairs if t % 4 == 0 else int(rng.integers(0, num_pairs + 1))
        slots[t, :n] = rng.choice(num_slots, size=n, replace=False)
        weights[t, :n] = rng.uniform(-1.0, 2.0, size=n)
    y = rng.standard_normal((num_tokens, sum(widths) + 3)).astype(np.float32)
    return x, lora_a, lora_b, slots, weights, y


# compiled on a GPU machine (tests/conftest.py sets TRITON_INTERPRET=1 only without CUDA)
DEV = "cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1" else "cpu"


def _dev(a: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(a)).to(DEV)


def _torch_meta(slots, weights, max_groups, capacity):
    from lora_core.kernel_meta import KernelMeta
    meta, pairs = build_pairs_host(slots, weights, max_groups, capacity)
    t = slots.shape[0]
    m = KernelMeta(*[_dev(np.ascontiguousarray(a)) for a in meta])
    m = m._replace(token_lora_mapping=m.token_lora_mapping[:t],
                   token_indices_sorted_by_lora_ids=m.token_indices_sorted_by_lora_ids[:t])
    return m, AdapterPairs(_dev(pairs.slots), _dev(pairs.weights))


SHRINK = dict(BLOCK_M=16, BLOCK_K=32, num_warps=4, num_stages=2)
EXPAND = dict(BLOCK_M=16, BLOCK_N=16, BLOCK_R=16, num_warps=4, num_stages=2)


@pytest.mark.parametrize("num_pairs,small_t,split,tiles_n,ranks", [
    (1, True, 1, 1, False),
    (2, False, 2, 2, True),
    (4, True, 2, 1, True),
    (4, False, 1, 2, False),
], ids=["k1-weighted", "k2-split-ranks", "k4-smallT-split-ranks", "k4-tiles"])
def test_triton_linear_pairs_equal_oracle(num_pairs, small_t, split, tiles_n, ranks):
    from torch_lora.ops import triton as tt
    rank = 32                                                    # two rank blocks of BLOCK_R = 16
    x, lora_a, lora_b, slots, weights, y = _case(num_pairs, 13, 64, rank, (24, 16), 5, num_pairs)
    lora_ranks = np.array([32, 5, 16, 9, 24], np.int32) if ranks else None
    if ranks:
        for a, b in zip(lora_a, lora_b):
            for s, r in enumerate(lora_ranks):
                a[s, r:] = 0.0                                   # the oracle's weights: zero past each rank
                b[s, :, r:] = 0.0
    meta, pairs = _torch_meta(slots, weights, 16, 16)
    yt = _dev(y.copy())
    tt.linear(yt, _dev(x), [_dev(a) for a in lora_a], [_dev(b) for b in lora_b],
              meta, 0.75, (0, 24), None if lora_ranks is None else _dev(lora_ranks), None, pairs=pairs,
              shrink_config=dict(SHRINK, SPLIT_K=split, SMALL_T=small_t),
              expand_config=dict(EXPAND, TILES_N=tiles_n, SMALL_T=small_t))
    want = oracle.multi_lora_linear(y, x, lora_a, lora_b, 0.75, slots, weights)
    assert oracle.rel_err(yt.cpu().numpy(), want) <= 1e-5
    none = slots[:, 0] < 0
    np.testing.assert_array_equal(yt.cpu().numpy()[none], y[none])


@pytest.mark.parametrize("num_pairs,split,ranks", [(1, 2, False), (2, 0, True), (4, 2, True)])
def test_triton_fused_kernel_pairs_equal_oracle(num_pairs, split, ranks):
    """The one-launch fused kernel (decode sizes) with PAIRS: each pair's shrink into the workspace's
    rank columns, the pairs summed through their own B after the barrier."""
    from torch_lora.ops import triton as tt
    x, lora_a, lora_b, slots, weights, y = _case(30 + num_pairs, 9, 64, 16, (32, 16), 5, num_pairs)
    lora_ranks = np.array([16, 5, 8, 9, 12], np.int32) if ranks else None
    if ranks:
        for a, b in zip(lora_a, lora_b):
            for s, r in enumerate(lora_ranks):
                a[s, r:] = 0.0
                b[s, :, r:] = 0.0
    meta, pairs = _torch_meta(slots, weights, 16, 16)
    yt = _dev(y.copy())
    tt.linear(yt, _dev(x), [_dev(a) for a in lora_a], [_dev(b) for b in lora_b],
              meta, 0.75, (0, 32), None if lora_ranks is None else _dev(lora_ranks), None, pairs=pairs,
              fused=True, fused_config=dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=32, SPLIT_K=split, num_warps=4,
                                            num_stages=2, SMALL_T=split != 0))
    want = oracle.multi_lora_linear(y, x, lora_a, lora_b, 0.75, slots, weights)
    assert oracle.rel_err(yt.cpu().numpy(), want) <= 1e-5
    none = slots[:, 0] < 0
    np.testing.assert_array_equal(yt.cpu().numpy()[none], y[none])


def test_triton_standalone_shrink_atomic_split_and_expand():
    """The stand-alone shrink (zero rows for tokens without adapters; split-K by atomic adds) writes
    each pair's weighted product at its rank columns; the expand sums the pairs."""
    from torch_lora.ops import triton as tt
    num_pairs, rank = 2, 16
    x, lora_a, lora_b, slots, weights, y = _case(7, 11, 64, rank, (24,), 4, num_pairs)
    meta, pairs = _torch_meta(slots, weights, 8, 16)
    buf = torch.full((1, 11, num_pairs * rank), float("nan"), device=DEV)
    tt.shrink(_dev(x), [_dev(lora_a[0])], buf, meta, 0.5, pairs=pairs,
              config=dict(SHRINK, SPLIT_K=2, SMALL_T=False))
    for j in range(num_pairs):
        for t in range(11):
            s = slots[t, j]
            want = 0.0 if s < 0 else 0.5 * weights[t, j] * (lora_a[0][s] @ x[t])
            np.testing.assert_allclose(buf[0, t, j * rank:(j + 1) * rank].cpu().numpy(), want, rtol=1e-5, atol=1e-5)
    yt = _dev(y.copy())
    tt.expand(buf, [_dev(lora_b[0])], yt, meta, (2,), True, pairs=pairs,
              config=dict(EXPAND, SMALL_T=False))
    want = y.astype(np.float64).copy()
    want[:, 2:26] = oracle.multi_lora_linear(y[:, 2:26], x, lora_a, lora_b, 0.5, slots, weights)
    assert oracle.rel_err(yt.cpu().numpy(), want) <= 1e-5


def test_plain_mapping_plans_today_kernels():
    """One adapter at strength 1 launches PAIRS = 0: the pair code is compiled out."""
    from lora_core.kernels.expand import plan_expand
    from lora_core.kernels.shrink import plan_shrink
    splan = plan_shrink(8, 64, 16, 2, 5, "float16", "float16", dict(SHRINK), lora_only=True, workspace=True,
                        has_ranks=False)
    eplan = plan_expand(8, 16, (24, 16), 5, 1, "float16", "float16", dict(EXPAND), add_inputs=True,
                        bias_flags=(0, 0), has_ranks=False)
    assert splan.constexprs["PAIRS"] == 0 and eplan.constexprs["PAIRS"] == 0
    with pytest.raises(ValueError, match="no LoRA bias or DoRA column scale"):
        plan_expand(8, 16, (24,), 5, 1, "float16", "float16", dict(EXPAND), add_inputs=True, bias_flags=(1,),
                    has_ranks=False, pairs=2)


# ----------------------------------------------------------------------------- the wrapper

def test_torch_wrapper_pair_steps_and_refusals():
    import torch_lora
    w = torch_lora.PunicaWrapper(8, 4, "cpu", max_loras=3, backend="torch")
    w.update_metadata(LoRAMapping([(5, 7), (7,)], (5, 7), False, [(0.5, 0.5), (2.0,)]), [5, 7, None], 4, 16)
    assert w.num_pairs == 2
    assert w.token_lora_indices.tolist() == [0, 1]            # the first adapter of each token
    x, y = torch.zeros(2, 8), torch.zeros(2, 6)
    a, b = torch.zeros(3, 4, 8), torch.zeros(3, 6, 4)
    with pytest.raises(ValueError, match="add_lora_embedding takes one adapter per token"):
        w.add_lora_embedding(y, torch.zeros(2, 4), b)
    with pytest.raises(ValueError, match="add_shrink takes one adapter per token"):
        w.add_shrink(torch.zeros(1, 2, 4), x, a, 1.0)
    with pytest.raises(ValueError, match="no LoRA bias or DoRA column scale"):
        w.add_lora_linear(y, x, (a,), (b,), (torch.zeros(3, 6),), 1.0, (6,))
    block = w._pair_blocks[2][1]
    w.update_metadata(LoRAMapping([(5,), (7, 5)], (0, 0), False), [5, 7, None], 4, 16)
    assert w.num_pairs == 2 and w._pair_blocks[2][1] is block     # one block per bucket: stable addresses
    w.update_metadata(LoRAMapping((5, 7), (0, 0)), [5, 7, None], 4, 16)
    assert w.num_pairs == 0


@pytest.mark.parametrize("side", ["torch", "jax"])
def test_wrapper_embedding_and_logits_per_pair(side):
    """add_lora_embedding_ids and add_lora_logits of a paired step: each token's / row's pairs,
    weighted, against float64 loops (torch and JAX wrappers, reference backends)."""
    rng = np.random.default_rng(9)
    vocab, dim, rank, slots_n = 12, 8, 4, 3
    emb_a = rng.standard_normal((slots_n, vocab, rank)).astype(np.float32)
    emb_b = rng.standard_normal((slots_n, dim, rank)).astype(np.float32)
    head_a = rng.standard_normal((slots_n, rank, dim)).astype(np.float32)
    head_b = rng.standard_normal((slots_n, vocab + 2, rank)).astype(np.float32)      # LoRA vocab wider: cut
    ids = np.array([3, 7, 1, 0, 11])
    tok = [(5, 7), (9,), (), (7, 9), (5, 7)]
    tok_w = [(0.5, -1.0), (2.0,), (), (1.0, 0.25), (0.5, -1.0)]
    rows_ids, rows_w = [(5, 7), (), (7, 9)], [(0.5, -1.0), (), (1.0, 0.25)]
    slot = {5: 0, 7: 1, 9: 2}
    mapping = LoRAMapping(tok, rows_ids, False, tok_w, rows_w)
    y_emb = rng.standard_normal((5, dim)).astype(np.float32)
    x_head = rng.standard_normal((3, dim)).astype(np.float32)
    y_head = rng.standard_normal((3, vocab)).astype(np.float32)
    want_emb = y_emb.astype(np.float64).copy()
    for t, (i_s, w_s) in enumerate(zip(tok, tok_w)):
        for i, w in zip(i_s, w_s):
            want_emb[t] += w * (emb_b[slot[i]].astype(np.float64) @ emb_a[slot[i], ids[t]])
    want_head = y_head.astype(np.float64).copy()
    for r, (i_s, w_s) in enumerate(zip(rows_ids, rows_w)):
        for i, w in zip(i_s, w_s):
            want_head[r] += w * 0.5 * (head_b[slot[i], :vocab].astype(np.float64) @ (head_a[slot[i]] @ x_head[r]))
    if side == "torch":
        import torch_lora
        w = torch_lora.PunicaWrapper(8, 4, "cpu", max_loras=3, backend="torch")
        w.update_metadata(mapping, [5, 7, 9], 4, vocab)
        t = torch.from_numpy
        got_emb = w.add_lora_embedding_ids(t(y_emb.copy()), t(ids), t(emb_a), t(emb_b)).numpy()
        got_head = w.add_lora_logits(t(y_head.copy()), t(x_head), t(head_a), t(head_b), 0.5).numpy()
    else:
        jnp = pytest.importorskip("jax.numpy")
        import jax_lora
        w = jax_lora.PunicaWrapper(8, 4, max_loras=3, backend="xla")
        w.update_metadata(mapping, [5, 7, 9], 4, vocab)
        got_emb = np.asarray(w.add_lora_embedding_ids(jnp.asarray(y_emb), jnp.asarray(ids), jnp.asarray(emb_a),
                                                      jnp.asarray(emb_b)))
        got_head = np.asarray(w.add_lora_logits(jnp.asarray(y_head), jnp.asarray(x_head), jnp.asarray(head_a),
                                                jnp.asarray(head_b), 0.5))
    assert oracle.rel_err(got_emb, want_emb) <= 1e-5
    assert oracle.rel_err(got_head, want_head) <= 1e-5
    np.testing.assert_array_equal(got_emb[2], y_emb[2])              # a token without adapters
    np.testing.assert_array_equal(got_head[1], y_head[1])


def test_tensor_parallel_wrapper_refuses_paired_mappings(tmp_path):
    """The tensor-parallel wrapper takes one adapter per token: a paired mapping is a ValueError
    saying so (not the first adapter of each token in silence)."""
    import torch.distributed as dist

    from torch_lora.parallel.wrapper import ParallelPunicaWrapper
    if dist.is_initialized():
        pytest.skip("a process group is already set up in this process")
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        for check in (False, True):
            w = ParallelPunicaWrapper(16, 4, "cpu", max_loras=2, check_agreement=check)
            with pytest.raises(ValueError, match="tensor-parallel wrapper takes one adapter per token"):
                w.update_metadata(LoRAMapping([(1, 2)], [1], False), [1, 2], 3, 64)
            w.update_metadata(LoRAMapping([1, 2], [1]), [1, 2], 3, 64)          # a plain mapping is served
    finally:
        dist.destroy_process_group()


def test_jax_device_pair_meta_equals_host_build():
    """jax_lora.meta.build_pair_meta (jitted, on the device) gives the host build's metadata and
    tables; invalid slots and rows past num_tokens become "no adapter"."""
    jnp = pytest.importorskip("jax.numpy")
    from jax_lora.meta import build_pair_meta
    rng = np.random.default_rng(11)
    for k in (1, 2, 4):
        slots = np.full((12, k), -1, np.int64)
        for t in range(10):
            n = int(rng.integers(0, k + 1))
            slots[t, :n] = rng.choice(5, size=n, replace=False)
        weights = rng.uniform(-1, 1, size=(12, k)).astype(np.float32) * (slots >= 0)
        meta, pairs = build_pairs_host(slots[:10], weights[:10], 8, 12)
        dmeta, dpairs = build_pair_meta(jnp.asarray(slots), jnp.asarray(weights), jnp.int32(10), max_loras=5,
                                        max_groups=8)
        for field in ("token_lora_mapping", "token_indices_sorted_by_lora_ids", "active_lora_ids",
                      "num_tokens_per_lora", "lora_token_start_loc"):
            np.testing.assert_array_equal(np.asarray(getattr(dmeta, field)), getattr(meta, field), err_msg=field)
        np.testing.assert_array_equal(np.asarray(dpairs.slots), pairs.slots)
        np.testing.assert_array_equal(np.asarray(dpairs.weights), pairs.weights)
    bad = np.array([[7, 1], [-1, -1], [2, 9]])                  # slots past max_loras: empty pairs
    dmeta, dpairs = build_pair_meta(jnp.asarray(bad), jnp.ones((3, 2)), jnp.int32(3), max_loras=5, max_groups=4)
    group = np.asarray(dmeta.token_lora_mapping)
    np.testing.assert_array_equal(np.asarray(dpairs.slots)[group[[0, 2]]], [[-1, 1], [2, -1]])
    assert group[1] == -1


def test_host_build_keeps_a_tuple_with_an_empty_first_pair():
    meta, pairs = build_pairs_host(np.array([[-1, 2], [-1, -1]]), np.array([[0.0, 1.5], [0, 0]]), 4, 4)
    g = meta.token_lora_mapping
    assert g[0] >= 0 and g[1] == -1
    np.testing.assert_array_equal(pairs.slots[g[0]], [-1, 2])


def test_gspmd_partitioned_backend_runs_pairs_unpartitioned_and_says_so(caplog):
    """Under plain jit with sharded inputs, a custom-call backend's ops (jax_lora.ops.partition) take
    the pair tables by running the backend directly (XLA runs it replicated), said on the logger."""
    import logging
    import types

    jax = pytest.importorskip("jax")
    jnp = pytest.importorskip("jax.numpy")
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from jax_lora.meta import LoRAKernelMeta
    from jax_lora.ops import partition, xla
    if jax.default_backend() != "cpu" or len(jax.devices("cpu")) < 4:
        pytest.skip("needs 4 CPU devices (tests/conftest.py)")
    impl = types.SimpleNamespace(NAME="xla-as-custom-call-pairs", COLUMN_SCALE=True, CUSTOM_CALLS=True,
                                 shrink=xla.shrink, expand=xla.expand)
    ops = partition.partitioned(impl)
    x, lora_a, lora_b, slots, weights, y = _case(12, 8, 32, 8, (16,), 3, 2)
    meta, pairs = build_pairs_host(slots, weights, 8, 8)
    jmeta = LoRAKernelMeta(*(jnp.asarray(v) for v in meta[:5]), no_lora=jnp.asarray(meta.no_lora[0] != 0))
    jpairs = AdapterPairs(jnp.asarray(pairs.slots), jnp.asarray(pairs.weights))
    mesh = Mesh(np.array(jax.devices("cpu")[:4]), ("tp",))
    shard = NamedSharding(mesh, P("tp"))
    a, b = (jnp.asarray(lora_a[0]),), (jnp.asarray(lora_b[0]),)

    def step(x, y):
        buf = ops.shrink(x, a, jmeta, 0.75, None, pairs=jpairs)
        return ops.expand(buf, b, y, jmeta, (0,), True, None, None, pairs=jpairs)
    with caplog.at_level(logging.INFO, logger="jax_lora"):
        got = jax.jit(step)(jax.device_put(jnp.asarray(x), shard), jax.device_put(jnp.asarray(y), shard))
    want = oracle.multi_lora_linear(y, x, lora_a, lora_b, 0.75, slots, weights)
    assert oracle.rel_err(np.asarray(got), want) <= 1e-5
    assert any("several adapters per token run its kernels unpartitioned" in r.getMessage() for r in caplog.records)
