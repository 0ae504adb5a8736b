"""jax_lora.parallel: every tensor-parallel layout on meshes of 2, 4 and 8 CPU devices against the
float64 oracle (tests/oracle.py) and the unsplit layer, the backends per shard, the collectives in
the compiled HLO, the byte model, and bad input.

Needs 8 host devices: tests/conftest.py sets --xla_force_host_platform_device_count=8.

Also the layouts on 2 devices with the wrapper's index arrays replicated, and shard_layer's
refusals. CPU-device meshes; skipped where JAX's default backend is not the CPU.
"""


import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jax_lora import LoRAMapping, PunicaWrapper, parallel
from jax_lora import nn as lnn

from . import jax_helpers, oracle
from .jax_helpers import cpu_mesh, hlo_collectives

# The meshes here are of host CPU devices: on a machine whose default backend is an accelerator,
# run these with JAX_PLATFORMS=cpu. Multi-GPU meshes are tested apart.
pytestmark = pytest.mark.skipif(jax.default_backend() != "cpu",
                                reason="CPU-device meshes; JAX's default backend here is not the CPU")

L = 3                      # slots; slot i holds LoRA id i + 1
R = 8                      # max rank (divisible by 8: column_gather splits the rank)
RANKS = (8, 3, 5)          # heterogeneous real ranks per slot; weights past them hold noise
IDS = (1, 0, 3, 3, 2, 2, 0, 1, 1, 3, 0, 2)       # LoRA id per token / sampled row, 0 = none
SLICES = (32, 16, 16)      # q, k, v of a GQA projection: unequal widths
H, K, V, D = 24, 64, 64, 16
TOL = 1e-5

CASES = [("column", "column"), ("column", "column_gather"), ("row", "row_reduce"), ("row", "row_partial"),
         ("embed", "vocab"), ("logits", "column"), ("logits", "column_gather")]


def _wrapper(device=None, backend="xla", ids=IDS):
    w = PunicaWrapper(32, 32, device, max_loras=L, backend=backend)
    w.update_metadata(LoRAMapping(ids, ids), [1, 2, 3], L + 1, V)
    return w


def _noise(var, rng):
    var.set_value(jnp.asarray(rng.normal(size=var.get_value().shape), jnp.float32))


def _layer(kind, rng):
    """A multi-LoRA layer of `kind` with random base, adapter weights (noise past each slot's
    rank) and the heterogeneous RANKS."""
    if kind == "column":
        layer = lnn.MultiLoRALinear(nnx.Linear(H, sum(SLICES), rngs=nnx.Rngs(0)), max_loras=L, max_rank=R,
                                    output_slices=SLICES)
    elif kind == "row":
        layer = lnn.MultiLoRALinear(nnx.Linear(K, H * 2, rngs=nnx.Rngs(0)), max_loras=L, max_rank=R)
    elif kind == "embed":
        layer = lnn.MultiLoRAEmbed(nnx.Embed(V, D, rngs=nnx.Rngs(0)), max_loras=L, max_rank=R)
    else:
        layer = lnn.MultiLoRALogits(nnx.Linear(H, V, use_bias=True, rngs=nnx.Rngs(0)), max_loras=L, max_rank=R)
    for name in ("kernel", "bias", "embedding"):
        var = getattr(layer.base, name, None)
        if var is not None:
            _noise(var, rng)
    _noise(layer.lora_a, rng)
    _noise(layer.lora_b, rng)
    layer.lora_ranks.set_value(jnp.asarray(RANKS, jnp.int32))
    return layer


def _input(kind, rng):
    t = len(IDS)
    if kind == "embed":
        return jnp.asarray(rng.integers(0, V, size=(2, t // 2)), jnp.int32)
    if kind == "row":
        return jnp.asarray(rng.normal(size=(2, t // 2, K)), jnp.float32)
    return jnp.asarray(rng.normal(size=(t, H)), jnp.float32)


def _rank_cut(w, rank_axis):
    """Host float64 copy of stacked weights with rank columns past each slot's rank zeroed
    (slot axis 0 after the slice axis is removed)."""
    w = np.array(w, np.float64)
    for slot, r in enumerate(RANKS):
        idx = [slot] + [slice(None)] * (w.ndim - 1)
        idx[rank_axis] = slice(r, None)
        w[tuple(idx)] = 0.0
    return w


def _expected(kind, layer, x):
    """The float64 oracle of the unsplit layer (natural column order)."""
    idx = [i - 1 for i in IDS]
    a, b = np.asarray(layer.lora_a.get_value()), np.asarray(layer.lora_b.get_value())
    if kind == "embed":
        table = np.asarray(layer.base.embedding.get_value(), np.float64)
        ids = np.asarray(x).reshape(-1)
        a = _rank_cut(a, 2)                                      # (L, V, r)
        y = table[ids]
        rows = np.stack([a[max(i, 0), t] for i, t in zip(idx, ids)])
        return oracle.expand(rows[None], [_rank_cut(b, 2)], y, idx)
    kernel = np.asarray(layer.base.kernel.get_value(), np.float64)
    bias = layer.base.bias
    x2 = np.asarray(x, np.float64).reshape(-1, kernel.shape[0])
    y = x2 @ kernel + (0.0 if bias is None else np.asarray(bias.get_value(), np.float64))
    if kind == "logits":
        return oracle.logits(y, x2, _rank_cut(a, 1), _rank_cut(b, 2), 1.0, idx)
    slices = layer.output_slices
    lora_a = [_rank_cut(a[s], 1) for s in range(len(slices))]
    offs = np.concatenate([[0], np.cumsum(slices)])
    lora_b = [_rank_cut(b[:, offs[s]:offs[s + 1]], 2) for s in range(len(slices))]
    return oracle.lora_linear(y, x2, lora_a, lora_b, None, 1.0, idx)


def _run(layer, w, x):
    graphdef, state = nnx.split(layer)

    @jax.jit
    def call(state, w, x):
        return nnx.merge(graphdef, state)(x, punica=w)

    return call, state


def _natural(kind, layer, y, n):
    y = np.asarray(y)
    if kind == "column":
        y = np.concatenate(parallel.split_fused(y, layer.output_slices, n), -1)
    return y.reshape(-1, y.shape[-1])


# ----------------------------------------------------------------------------- layouts against the oracle

@pytest.mark.parametrize("n", [2, 4, 8])
@pytest.mark.parametrize("kind,layout", CASES)
def test_split_layer_equals_unsplit_layer_and_oracle(kind, layout, n):
    rng = np.random.default_rng(10 * CASES.index((kind, layout)) + n)
    layer = _layer(kind, rng)
    x = _input(kind, rng)
    expect = _expected(kind, layer, x)
    call, state = _run(layer, _wrapper(), x)
    unsplit = np.asarray(call(state, _wrapper(), x)).reshape(expect.shape)
    assert oracle.rel_err(unsplit, expect) < TOL

    mesh = cpu_mesh((n,))
    tp = parallel.shard_layer(layer, mesh, kind=kind, layout=layout)
    assert (layer.tp, tp.layout, tp.size) == (tp, layout, n)
    w = _wrapper(NamedSharding(mesh, P()))
    call, state = _run(layer, w, x)
    got = call(state, w, x)
    if kind in ("column", "logits"):     # output split along its columns, one block per device
        assert got.sharding.spec[-1] == "tp"
    got = _natural(kind, layer, got, n)
    assert oracle.rel_err(got, expect) < TOL
    assert oracle.rel_err(got, unsplit) < TOL
    untouched = [t for t, i in enumerate(IDS) if i == 0]     # rows without adapter: the base only
    base = _expected_base(kind, layer, x, n)
    np.testing.assert_allclose(got[untouched], base[untouched], rtol=1e-5, atol=1e-5)


def _expected_base(kind, layer, x, n):
    """The base layer alone, float64, from the split layer's stored (possibly permuted) weights."""
    if kind == "embed":
        return np.asarray(layer.base.embedding.get_value(), np.float64)[np.asarray(x).reshape(-1)]
    kernel = np.asarray(layer.base.kernel.get_value(), np.float64)
    bias = 0.0 if layer.base.bias is None else np.asarray(layer.base.bias.get_value(), np.float64)
    y = np.asarray(x, np.float64).reshape(-1, kernel.shape[0]) @ kernel + bias
    return _natural(kind, layer, y, n)


def test_split_layer_without_wrapper_runs_the_base_layer():
    rng = np.random.default_rng(3)
    layer = _layer("column", rng)
    x = _input("column", rng)
    parallel.shard_layer(layer, cpu_mesh((4,)), kind="column")
    got = _natural("column", layer, jax.jit(lambda x: layer(x))(x), 4)
    np.testing.assert_allclose(got, _expected_base("column", layer, x, 4), rtol=1e-5, atol=1e-5)


def test_fused_columns_are_split_per_slice():
    """Device d holds part d of q, of k and of v (not a contiguous block of the fused output)."""
    perm = parallel.column_permutation((4, 2, 2), 2)
    np.testing.assert_array_equal(perm, [0, 1, 4, 6, 2, 3, 5, 7])
    rng = np.random.default_rng(4)
    layer = _layer("column", rng)
    natural_b = np.asarray(layer.lora_b.get_value())
    n = 4
    parallel.shard_layer(layer, cpu_mesh((n,)), kind="column", layout="column")
    stored = layer.lora_b.get_value()
    for shard in stored.addressable_shards:
        d = shard.index[1].start // (sum(SLICES) // n)
        parts, off = [], 0
        for w in SLICES:
            parts.append(natural_b[:, off + d * w // n: off + (d + 1) * w // n])
            off += w
        np.testing.assert_array_equal(np.asarray(shard.data), np.concatenate(parts, axis=1))
    np.testing.assert_array_equal(parallel.natural_columns(np.asarray(stored), SLICES, n, axis=1), natural_b)


# ----------------------------------------------------------------------------- backends per shard

@pytest.mark.parametrize("kind,layout", [("column", "column"), ("row", "row_reduce"), ("column", "column_gather")])
def test_pallas_tpu_runs_per_shard(kind, layout):
    """The Pallas TPU kernels (interpret mode on the CPU) inside the shard_map, 2 devices."""
    rng = np.random.default_rng(5)
    layer = _layer(kind, rng)
    x = _input(kind, rng)
    expect = _expected(kind, layer, x)
    mesh = cpu_mesh((2,))
    parallel.shard_layer(layer, mesh, kind=kind, layout=layout)
    w = _wrapper(NamedSharding(mesh, P()), backend="pallas_tpu")
    call, state = _run(layer, w, x)
    got = _natural(kind, layer, call(state, w, x), 2)
    assert oracle.rel_err(got, expect) < TOL


def _compiled(layer, w, x):
    call, state = _run(layer, w, x)
    return call.lower(state, w, x).compile().as_text()


def test_triton_path_sees_local_shapes_only():
    """Compiled (not run) with the Triton backend on 4 devices: the kernel launch (on the CPU, the
    interpreter's callback) takes each device's block of B, and the program has no collective."""
    pytest.importorskip("triton")
    rng = np.random.default_rng(6)
    layer = _layer("column", rng)
    x = _input("column", rng)
    mesh = cpu_mesh((4,))
    parallel.shard_layer(layer, mesh, kind="column", layout="column")
    hlo = _compiled(layer, _wrapper(NamedSharding(mesh, P()), backend="triton"), x)
    assert hlo_collectives(hlo) == []
    calls = [line for line in hlo.splitlines() if "custom-call(" in line]
    assert calls, "expected the Triton launch as a custom call"
    local_b = f"f32[{L},{SLICES[0] // 4},{R}]"
    global_b = f"f32[{L},{SLICES[0]},{R}]"
    assert any(local_b in c for c in calls) and not any(global_b in c for c in calls)


# ----------------------------------------------------------------------------- collectives in the HLO

EXPECTED_COLLECTIVES = {
    # layout: [(op, result shape)] with T = 12 tokens, S slices, rank R, y (T, N)
    ("column", "column"): [],
    ("column", "column_gather"): [("all-gather", f"f32[3,12,{R}]")],
    ("row", "row_reduce"): [("all-reduce", f"f32[1,12,{R}]"), ("all-reduce", f"f32[12,{2 * H}]")],
    ("row", "row_partial"): [("all-reduce", f"f32[12,{2 * H}]")],
    ("embed", "vocab"): [("all-reduce", f"f32[12,{D}]")],
    ("logits", "column"): [],
    ("logits", "column_gather"): [("all-gather", f"f32[1,12,{R}]")],
}


@pytest.mark.parametrize("kind,layout", CASES)
def test_only_the_layout_collectives_are_compiled(kind, layout):
    """No weight is gathered: the compiled program's collectives are exactly the layout's (the
    LoRA buffer's all-gather or psum, the base layer's psum of y), and their payload is
    layer_bytes' `collective` plus the base layer's y."""
    rng = np.random.default_rng(7)
    layer = _layer(kind, rng)
    x = _input(kind, rng)
    mesh = cpu_mesh((4,))
    parallel.shard_layer(layer, mesh, kind=kind, layout=layout)
    found = hlo_collectives(_compiled(layer, _wrapper(NamedSharding(mesh, P())), x))
    assert sorted(found) == sorted(EXPECTED_COLLECTIVES[kind, layout])
    slices, in_features, rank = parallel._layer_sizes(layer, kind)
    model = parallel.layer_bytes(kind, layout, tokens=len(IDS), active=3, slices=slices, in_features=in_features,
                                 rank=rank, shards=4, itemsize=4)
    dims = [[int(v) for v in s[s.index("[") + 1:-1].split(",")] for _, s in found]
    lora = [d for d in dims if len(d) == 3]                  # the (S, T, r) buffers; y is (T, N)
    assert sum(4 * int(np.prod(d)) for d in lora) == model.collective


# ----------------------------------------------------------------------------- operands of the shard_maps

@pytest.mark.parametrize("kind,layout", CASES)
def test_shard_map_operands_are_the_arrays_the_call_passes(kind, layout):
    """A split layer's manual computation takes exactly the wrapper's block, x and the layer's
    arrays, none zero-sized: the ops' constants (the empty index array of a scatter over whole
    axes among them) stay inside the per-device function, and XLA does not compile a manual
    computation that reads a zero-sized operand (jaxlib 0.11 crashes in Shardy)."""
    rng = np.random.default_rng(8)
    layer = _layer(kind, rng)
    x = _input(kind, rng)
    mesh = cpu_mesh((2,))
    parallel.shard_layer(layer, mesh, kind=kind, layout=layout)
    w = _wrapper(NamedSharding(mesh, P()))
    call, state = _run(layer, w, x)
    (operands,) = jax_helpers.shard_map_operands(call.lower(state, w, x).as_text())
    passed = len(jax.tree_util.tree_leaves(w)) + 1 + len(parallel._base_vars(layer)) + len(parallel._lora_vars(layer))
    assert len(operands) == passed, operands
    assert not [t for t in operands if jax_helpers.zero_sized(t)]


def test_ops_in_a_shard_map_of_ones_own_pass_no_constant_operand():
    """The xla backend writes column blocks with update slices (no index array), so a shard_map of
    the caller's around add_lora_linear of one slice spanning y's width takes only its arguments,
    and it computes what the call without a mesh computes."""
    rng = np.random.default_rng(9)
    mesh = cpu_mesh((2,))
    w = _wrapper(NamedSharding(mesh, P()))
    t, n = len(IDS), 2 * H
    y, x = jnp.asarray(rng.normal(size=(t, n)), jnp.float32), jnp.asarray(rng.normal(size=(t, H)), jnp.float32)
    a, b = jnp.asarray(rng.normal(size=(L, R, H)), jnp.float32), jnp.asarray(rng.normal(size=(L, n, R)), jnp.float32)

    def body(w, y, x, a, b):
        return w.add_lora_linear(y, x, (a,), (b,), None, 1.0, (n,))

    step = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(), out_specs=P(), check_vma=False))
    (operands,) = jax_helpers.shard_map_operands(step.lower(w, y, x, a, b).as_text())
    assert len(operands) == len(jax.tree_util.tree_leaves((w, y, x, a, b))), operands
    plain = _wrapper()
    np.testing.assert_array_equal(np.asarray(step(w, y, x, a, b)), np.asarray(jax.jit(body)(plain, y, x, a, b)))


# ----------------------------------------------------------------------------- the byte model

def test_byte_model_and_layout_choice():
    n, w = 4, 2
    kw = {"active": 1, "slices": (4096, 1024, 1024), "in_features": 4096, "rank": 16, "shards": n, "itemsize": w}
    col = parallel.layer_bytes("column", "column", tokens=8, **kw)
    gat = parallel.layer_bytes("column", "column_gather", tokens=8, **kw)
    assert col.received == 0 and col.collective == 0
    assert gat.collective == 4 * 3 * 8 * 16 and gat.received == 3 * gat.collective // 4
    assert col.weights - gat.weights == w * 3 * 16 * 4096 * (n - 1) // n
    # column_gather moves fewer bytes exactly when 4 T < a w H (here 4 T < 8192).
    assert parallel.choose_layout("column", tokens=2047, **kw) == "column_gather"
    assert parallel.choose_layout("column", tokens=2048, **kw) == "column"      # tie: no collective
    # row_reduce moves fewer bytes exactly when 8 S T < a w N (S = 1, N = 4096: T < 1024).
    kw = {"active": 1, "slices": (4096,), "in_features": 11008, "rank": 16, "shards": n, "itemsize": w}
    assert parallel.choose_layout("row", tokens=1023, **kw) == "row_reduce"
    assert parallel.choose_layout("row", tokens=1024, **kw) == "row_partial"
    # A rank that n does not divide cannot be gathered by rank.
    kw = {"active": 1, "slices": (4096,), "in_features": 4096, "rank": 6, "shards": n, "itemsize": w}
    assert parallel.choose_layout("column", tokens=1, **kw) == "column"


def test_shard_layer_picks_the_layout_by_bytes():
    rng = np.random.default_rng(8)
    small, large = _layer("column", rng), _layer("column", rng)
    # 3 slots, H = 24, float32: column_gather when 4 T < 3 * 4 * 24 = 288.
    assert parallel.shard_layer(small, cpu_mesh((2,)), kind="column", tokens=8).layout == "column_gather"
    assert parallel.shard_layer(large, cpu_mesh((2,)), kind="column", tokens=512).layout == "column"


# ----------------------------------------------------------------------------- bad input

def test_bad_input_is_refused_with_the_argument_named():
    rng = np.random.default_rng(9)
    mesh = cpu_mesh((8,))
    odd = lnn.MultiLoRALinear(nnx.Linear(H, 36, rngs=nnx.Rngs(0)), max_loras=L, max_rank=R,
                              output_slices=(20, 8, 8))
    with pytest.raises(ValueError, match=r"output slice widths \(20, 8, 8\) must each be divisible by 8"):
        parallel.shard_layer(odd, mesh, kind="column", layout="column")
    with pytest.raises(ValueError, match=r"layout for a column layer must be one of .*got 'row_reduce'"):
        parallel.shard_layer(_layer("column", rng), mesh, kind="column", layout="row_reduce")
    with pytest.raises(ValueError, match=r"kind must be one of .*got 'qkv'"):
        parallel.shard_layer(_layer("column", rng), mesh, kind="qkv")
    with pytest.raises(TypeError, match=r"layer for kind 'embed' must be a MultiLoRAEmbed, got MultiLoRALinear"):
        parallel.shard_layer(_layer("column", rng), mesh, kind="embed")
    with pytest.raises(TypeError, match=r"mesh must be a jax.sharding.Mesh, got list"):
        parallel.shard_layer(_layer("column", rng), list(mesh.devices.flat), kind="column")
    with pytest.raises(ValueError, match=r"axis 'model' is not an axis of the mesh"):
        parallel.shard_layer(_layer("column", rng), mesh, kind="column", axis="model")
    r6 = lnn.MultiLoRALinear(nnx.Linear(H, 64, rngs=nnx.Rngs(0)), max_loras=L, max_rank=6)
    with pytest.raises(ValueError, match=r"rank 6 must be divisible by 8 for column_gather"):
        parallel.shard_layer(r6, mesh, kind="column", layout="column_gather")
    layer = _layer("row", rng)
    parallel.shard_layer(layer, mesh, kind="row")
    with pytest.raises(ValueError, match=r"already split"):
        parallel.shard_layer(layer, mesh, kind="row")
    x = jnp.ones((4, K + 1), jnp.float32)
    with pytest.raises(ValueError, match=rf"x must have shape \(\.\.\., {K}\) .*got \(4, {K + 1}\)"):
        layer(x, punica=_wrapper(NamedSharding(mesh, P())))
    with pytest.raises(ValueError, match=r"layer_bytes needs integers: .*'shards': 0"):
        parallel.layer_bytes("row", "row_reduce", tokens=8, active=1, slices=(64,), in_features=64, rank=8,
                             shards=0, itemsize=2)
    with pytest.raises(ValueError, match=r"widths \(4, 4\) must sum to y's last dimension 6"):
        parallel.split_fused(jnp.ones((2, 6)), (4, 4), 2)


def test_dora_layers_are_not_split_over_a_mesh():
    """A DoRA layer's column scale multiplies the whole output (after a row split's reduction): it is
    refused by name rather than split in a way that would drop or misplace the scale."""
    mesh = Mesh(np.array(jax.devices("cpu")[:2]), ("tp",))
    layer = lnn.MultiLoRALinear(nnx.Linear(16, 32, rngs=nnx.Rngs(0)), max_loras=2, max_rank=4, dora=True)
    for kind in ("column", "row"):
        with pytest.raises(ValueError, match=r"a DoRA layer \(dora=True\) cannot be split over a mesh"):
            parallel.shard_layer(layer, mesh, kind=kind)
    assert layer.tp is None


# Meshes of host CPU devices (tests/conftest.py forces 8). On a GPU machine JAX's default backend
# is the GPU, with one device here, and XLA's CPU compiler crashed on these shard_map programs
# (tests/test_parallel.py): skipped there; multi-GPU meshes are tested apart.
_CPU_MESHES = pytest.mark.skipif(jax.default_backend() != "cpu",
                                 reason="CPU-device meshes; JAX's default backend here is not the CPU")


TP_IDS = (1, 0, 3, 2, 1)


def _tp_layer(kind, L=3, r=4):
    rngs = nnx.Rngs(5)
    if kind == "column":
        layer = lnn.MultiLoRALinear(nnx.Linear(16, 16, rngs=rngs), max_loras=L, max_rank=r, output_slices=(8, 4, 4))
        layer.lora_a.set_value(jnp.asarray(jax_helpers.rand(3, L, r, 16, scale=0.3)))
    elif kind == "row":
        layer = lnn.MultiLoRALinear(nnx.Linear(16, 8, rngs=rngs), max_loras=L, max_rank=r)
        layer.lora_a.set_value(jnp.asarray(jax_helpers.rand(1, L, r, 16, scale=0.3)))
    elif kind == "embed":
        layer = lnn.MultiLoRAEmbed(nnx.Embed(16, 8, rngs=rngs), max_loras=L, max_rank=r)
        layer.lora_a.set_value(jnp.asarray(jax_helpers.rand(L, 16, r, scale=0.3)))
    else:
        layer = lnn.MultiLoRALogits(nnx.Linear(8, 16, rngs=rngs), max_loras=L, max_rank=r)
        layer.lora_a.set_value(jnp.asarray(jax_helpers.rand(L, r, 8, scale=0.3)))
    layer.lora_b.set_value(jnp.asarray(jax_helpers.rand(*layer.lora_b.get_value().shape, scale=0.3)))
    layer.lora_ranks.set_value(jnp.asarray([4, 1, 2], jnp.int32))         # heterogeneous ranks
    return layer


@pytest.mark.parametrize("kind, layout", [("column", "column"), ("column", "column_gather"), ("row", "row_reduce"),
                                          ("row", "row_partial"), ("embed", "vocab"), ("logits", "column_gather")])
@_CPU_MESHES
def test_sharded_layer_equals_unsharded(kind, layout):
    """On 2 CPU devices every layout (column with unequal q/k/v slices,
    column_gather = fully sharded, row_reduce = psum of the small buffer, row_partial, vocab-parallel
    embedding, logits) equals the unsharded layer: mixed adapters, no-LoRA rows, heterogeneous
    ranks; the wrapper's index arrays replicated with NamedSharding(mesh, P())."""
    layer = _tp_layer(kind)
    x = jax_helpers.RNG.integers(0, 16, (len(TP_IDS),)).astype(np.int32) if kind == "embed" else \
        jax_helpers.rand(len(TP_IDS), 8 if kind == "logits" else 16)
    # vocab=16: the embedding's vocabulary
    w = jax_helpers.wrapper(TP_IDS, jax_helpers.LORA_INDEX_TO_ID, capacity=8, vocab=16)
    want = np.asarray(layer(x, punica=w))
    mesh = Mesh(np.array(jax.devices()[:2]), ("tp",))
    parallel.shard_layer(layer, mesh, kind=kind, layout=layout)
    wm = PunicaWrapper(8, 8, NamedSharding(mesh, P()), max_loras=3, backend="xla")
    wm.update_metadata(LoRAMapping(TP_IDS, TP_IDS), jax_helpers.LORA_INDEX_TO_ID, 4, 16)
    graphdef, state = nnx.split(layer)
    got = jax.jit(lambda s, w, x: nnx.merge(graphdef, s)(x, punica=w))(state, wm, x)
    if kind == "column":
        got = jnp.concatenate(parallel.split_fused(got, (8, 4, 4), 2), axis=-1)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)


@_CPU_MESHES
def test_shard_layer_refusals_and_byte_model():
    """shard_layer refuses sizes that do not split (a ValueError naming the sizes and the
    device count) and a DoRA layer (by name); choose_layout picks column_gather over column exactly
    when 4 T < a w H, and row_reduce over row_partial exactly when 8 S T < a w N (docs/parallel.md)."""
    mesh = Mesh(np.array(jax.devices()[:2]), ("tp",))
    odd = lnn.MultiLoRALinear(nnx.Linear(8, 9, rngs=nnx.Rngs(0)), max_loras=2, max_rank=2, output_slices=(4, 5))
    with pytest.raises(ValueError) as e:
        parallel.shard_layer(odd, mesh, kind="column", layout="column")
    assert "(4, 5)" in str(e.value) and "2" in str(e.value)
    dora = lnn.MultiLoRALinear(nnx.Linear(8, 8, rngs=nnx.Rngs(0)), max_loras=2, max_rank=2, dora=True)
    with pytest.raises(ValueError, match="DoRA"):
        parallel.shard_layer(dora, mesh, kind="column")
    common = dict(slices=(4096,), rank=16, shards=8, itemsize=2)
    assert parallel.choose_layout("column", tokens=8, active=4, in_features=4096, **common) == "column_gather"
    assert parallel.choose_layout("column", tokens=2047, active=1, in_features=4096, **common) == "column_gather"
    # 4 T == a w H: a tie keeps the layout without a collective
    assert parallel.choose_layout("column", tokens=2048, active=1, in_features=4096, **common) == "column"
    assert parallel.choose_layout("column", tokens=2049, active=1, in_features=4096, **common) == "column"
    assert parallel.choose_layout("row", tokens=8, active=4, in_features=4096, **common) == "row_reduce"
    assert parallel.choose_layout("row", tokens=1024, active=1, in_features=4096, **common) == "row_partial"
