"""Plain `jax.jit` with NamedSharding inputs (GSPMD, no jax_lora.parallel): the ops run per device
like their math (jax_lora.ops.partition), against the float64 oracle and the unsharded op.

Cases on CPU meshes (tests/conftest.py gives 8 CPU devices): column parallel (x, A replicated; B
and y split along the output features), row parallel (x and A split along the input features, y
replicated: one psum of the rank-r buffer), tokens split with replicated weights, tokens and input
features on a 2-D mesh; each checks the result, the output sharding and the compiled program's
collectives (no all-gather, no weight-sized payload). Backends: "xla" (plain XLA ops, which XLA
partitions itself), "pallas_tpu" (Pallas' generic interpreter: plain XLA ops inside the
custom-partitioned op; on a TPU the kernels compiled) and the partitioning rule on the reference
math (fast). Also the fallbacks (replicated, with a log line), eager calls on sharded arrays, and
"triton" compiled (its interpreter's callback takes the local shapes).
"""

import logging
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jax_lora import LoRAMapping, PunicaWrapper
from jax_lora.meta import LoRAKernelMeta
from jax_lora.ops import pallas_tpu, partition, xla

from . import oracle
from .jax_helpers import cpu_mesh, hlo_collectives

pytestmark = pytest.mark.skipif(jax.default_backend() != "cpu",
                                reason="CPU-device meshes; JAX's default backend here is not the CPU")

L, R, H, N, T = 3, 8, 32, 64, 8
IDS = (1, 0, 3, 3, 2, 2, 0, 1)          # LoRA id per token, 0 = none; slot = id - 1
RANKS = (8, 3, 5)
TOL = 1e-5

# name: (y spec, x spec, A spec, B spec, bias spec, expected output spec, collectives)
CASES = {
    "column": (P(None, "tp"), P(), P(), P(None, "tp"), P(None, "tp"), P(None, "tp"), []),
    "row": (P(), P(None, "tp"), P(None, None, "tp"), P(), P(), P(), [("all-reduce", f"f32[1,{T},{R}]")]),
    "tokens": (P("tp"), P("tp"), P(), P(), P(), P("tp"), []),
}

# The reference math declared a custom-call backend: the partitioning rule at the speed of plain XLA.
XLA_AS_CUSTOM_CALL = types.SimpleNamespace(NAME="xla-as-custom-call", COLUMN_SCALE=True, CUSTOM_CALLS=True,
                                           shrink=xla.shrink, expand=xla.expand)


def _data(seed=0, slices=(N,)):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(T, H)).astype(np.float32)
    y = rng.normal(size=(T, sum(slices))).astype(np.float32)
    a = [rng.normal(size=(L, R, H)).astype(np.float32) for _ in slices]
    b = [rng.normal(size=(L, n, R)).astype(np.float32) for n in slices]
    bias = [rng.normal(size=(L, n)).astype(np.float32) for n in slices]
    return x, y, a, b, bias


def _cut(w, rank_axis):
    """Float64 weights with the rank columns past each slot's rank zeroed (what lora_ranks means)."""
    w = np.array(w, np.float64)
    for slot, r in enumerate(RANKS):
        index = [slot] + [slice(None)] * (w.ndim - 1)
        index[rank_axis] = slice(r, None)
        w[tuple(index)] = 0.0
    return w


def _want(x, y, a, b, bias, scale=0.5):
    idx = [i - 1 for i in IDS]
    return oracle.lora_linear(y, x, [_cut(w, 1) for w in a], [_cut(w, 2) for w in b], bias, scale, idx)


def _wrapper(backend, mesh=None):
    w = PunicaWrapper(16, 8, None if mesh is None else NamedSharding(mesh, P()), max_loras=L, backend=backend)
    w.update_metadata(LoRAMapping(IDS, IDS), [1, 2, 3], L + 1, 100)
    return w


def _linear(w, y, x, a, b, bias, ranks):
    return w.add_lora_linear(y, x, a, b, bias, 0.5, tuple(v.shape[1] for v in b), lora_ranks=ranks)


def _sharded_call(backend, case, seed=0):
    """(result, want, compiled HLO text) of add_lora_linear under jit with the case's shardings."""
    y_spec, x_spec, a_spec, b_spec, bias_spec, _, _ = CASES[case]
    mesh = cpu_mesh()
    x, y, a, b, bias = _data(seed)

    def put(v, spec):
        return jax.device_put(jnp.asarray(v), NamedSharding(mesh, spec))

    w = _wrapper(backend, mesh)
    args = (w, put(y, y_spec), put(x, x_spec), tuple(put(v, a_spec) for v in a), tuple(put(v, b_spec) for v in b),
            tuple(put(v, bias_spec) for v in bias), put(np.asarray(RANKS, np.int32), P()))
    step = jax.jit(lambda *args: _linear(*args))    # a new function: no program cached by another test
    return step(*args), _want(x, y, a, b, bias), step.lower(*args).compile().as_text()


def _check(got, want, hlo, case):
    *_, out_spec, collectives = CASES[case]
    assert oracle.rel_err(np.asarray(got), want) < TOL
    assert got.sharding.spec == out_spec
    assert sorted(hlo_collectives(hlo)) == sorted(collectives)


# ----------------------------------------------------------------------------- the three splits

@pytest.mark.parametrize("case", list(CASES))
def test_xla_backend_splits_like_the_math(case):
    """Plain XLA ops: XLA's partitioner splits them itself; no weight is gathered."""
    got, want, hlo = _sharded_call("xla", case)
    *_, out_spec, _ = CASES[case]
    assert oracle.rel_err(np.asarray(got), want) < TOL and got.sharding.spec == out_spec
    found = hlo_collectives(hlo)
    if case == "tokens":      # XLA moves a few index entries between devices for the token-split gathers
        assert all(op == "collective-permute" and shape.startswith("s32") for op, shape in found)
    elif case == "row":       # the reference shrink multiplies x by every slot's A: a (T, L, r) psum
        assert found == [("all-reduce", f"f32[{T},{L},{R}]")]
    else:
        assert found == []


@pytest.mark.parametrize("case", list(CASES))
def test_pallas_tpu_splits_like_the_math(case):
    """The Pallas kernels (generic interpreter) per device: no all-gather of B or A, the row split's
    only collective the psum of the (1, T, r) buffer."""
    with pallas_tpu.interpret_mode(True):
        got, want, hlo = _sharded_call("pallas_tpu", case)
    _check(got, want, hlo, case)


@pytest.mark.parametrize("case", list(CASES))
def test_the_rule_on_the_reference_math(case, monkeypatch):
    """The partitioning rule alone, on the reference math declared a custom-call backend."""
    monkeypatch.setattr(PunicaWrapper, "_impl", lambda self: partition.partitioned(XLA_AS_CUSTOM_CALL))
    got, want, hlo = _sharded_call("xla", case)
    _check(got, want, hlo, case)


def test_tokens_and_input_features_on_a_2d_mesh():
    """Tokens over "data", the input features over "tp": each device shrinks its tokens' part of H,
    one psum over "tp" of its (1, T/2, r) buffer."""
    mesh = cpu_mesh((2, 2), ("data", "tp"))
    x, y, a, b, bias = _data(3)
    xs = jax.device_put(jnp.asarray(x), NamedSharding(mesh, P("data", "tp")))
    ys = jax.device_put(jnp.asarray(y), NamedSharding(mesh, P("data")))
    a_s = (jax.device_put(jnp.asarray(a[0]), NamedSharding(mesh, P(None, None, "tp"))),)
    w = partition.partitioned(XLA_AS_CUSTOM_CALL)
    meta = LoRAKernelMeta.build(np.asarray(IDS, np.int32) - 1, L, T)
    step = jax.jit(lambda y, x, a, b, meta: w.expand(w.shrink(x, a, meta, 0.5), b, y, meta, (0,), True))
    args = (ys, xs, a_s, (jnp.asarray(b[0]),), meta)
    got = step(*args)
    assert oracle.rel_err(np.asarray(got), oracle.lora_linear(y, x, a, b, None, 0.5, [i - 1 for i in IDS])) < TOL
    assert got.sharding.spec == P("data")
    assert hlo_collectives(step.lower(*args).compile().as_text()) == [("all-reduce", f"f32[1,{T // 2},{R}]")]


def test_eager_call_on_sharded_arrays_runs_per_device():
    """Outside jit, concrete arrays on several devices: the op is jitted once and splits the same way."""
    mesh = cpu_mesh()
    x, y, a, b, _ = _data(4)
    w = partition.partitioned(XLA_AS_CUSTOM_CALL)
    meta = LoRAKernelMeta.build(np.asarray(IDS, np.int32) - 1, L, T)
    got = w.expand(w.shrink(jnp.asarray(x), (jnp.asarray(a[0]),), meta, 0.5), (jax.device_put(
        jnp.asarray(b[0]), NamedSharding(mesh, P(None, "tp"))),), jax.device_put(
        jnp.asarray(y), NamedSharding(mesh, P(None, "tp"))), meta, (0,), True)
    assert got.sharding.spec == P(None, "tp")
    assert oracle.rel_err(np.asarray(got), oracle.lora_linear(y, x, a, b, None, 0.5, [i - 1 for i in IDS])) < TOL


# ----------------------------------------------------------------------------- fallbacks

def test_several_slices_with_y_split_run_replicated_and_say_so(caplog):
    """q, k, v slices with y's columns split in natural order: a device's columns are not a block of
    every slice, so the op runs replicated (the right result) and the log says why."""
    mesh = cpu_mesh()
    slices = (32, 16, 16)
    x, y, a, b, bias = _data(5, slices)
    put = lambda v, spec: jax.device_put(jnp.asarray(v), NamedSharding(mesh, spec))
    args = (put(y, P(None, "tp")), jnp.asarray(x), tuple(jnp.asarray(v) for v in a),
            tuple(put(v, P(None, "tp")) for v in b), tuple(jnp.asarray(v) for v in bias),
            jnp.asarray(RANKS, jnp.int32))
    w = _wrapper("xla", mesh)
    with caplog.at_level(logging.WARNING, logger="jax_lora"):
        monkey = pytest.MonkeyPatch()
        monkey.setattr(PunicaWrapper, "_impl", lambda self: partition.partitioned(XLA_AS_CUSTOM_CALL))
        try:
            got = jax.jit(lambda *args: _linear(*args))(w, *args)
        finally:
            monkey.undo()
    assert oracle.rel_err(np.asarray(got), _want(x, y, a, b, bias)) < TOL
    said = [r.getMessage() for r in caplog.records if r.name == "jax_lora"]
    assert any("runs replicated" in m and "3 slice(s)" in m for m in said), said


def _shapes(mesh, **specs):
    """ShapeDtypeStructs with shardings, as the partitioner hands them over."""
    return {k: jax.ShapeDtypeStruct(shape, jnp.float32, sharding=NamedSharding(mesh, spec))
            for k, (shape, spec) in specs.items()}


def _linear_call(widths=(N,), offsets=(0,)):
    weights = partition._Weights()
    a = weights.refs([np.zeros((L, R, H), np.float32) for _ in widths])
    b = weights.refs([np.zeros((L, n, R), np.float32) for n in widths])
    return partition._describe("linear", XLA_AS_CUSTOM_CALL, {"x": 0, "y": 0}, weights, a=a, b=b, widths=widths,
                               scale=1.0, offsets=offsets)


def _plan(call, mesh, x, y, a, b, out):
    meta = [jax.ShapeDtypeStruct((16,), jnp.int32, sharding=NamedSharding(mesh, P()))] * 6
    s = _shapes(mesh, x=((T, H), x), y=((T, N), y), a=((L, R, H), a), b=((L, N, R), b), out=((T, N), out))
    return partition.plan(call, [s["x"], s["y"], s["a"], s["b"], *meta], s["out"])


def test_plan_reasons():
    """What runs replicated, and why; what splits."""
    mesh = cpu_mesh((2, 2), ("data", "tp"))
    call = _linear_call()
    assert _plan(call, mesh, P(), P(None, "tp"), P(), P(None, "tp"), P(None, "tp")) == \
        partition.Plan(outputs=("tp",))
    assert _plan(call, mesh, P("data", "tp"), P("data"), P(), P(), P("data")) == \
        partition.Plan(tokens=("data",), inputs=("tp",))
    # A split along H with x replicated: row parallel, x sliced locally
    assert _plan(call, mesh, P(), P(), P(None, None, "tp"), P(), P()).inputs == ("tp",)
    reasons = {
        "B split, y not": _plan(call, mesh, P(), P(), P(), P(None, "tp"), P()),
        "slot axis": _plan(call, mesh, P(), P(), P("tp"), P(), P()),
        "rank axis": _plan(call, mesh, P(), P(), P(None, "tp"), P(), P()),
        "x and A disagree": _plan(call, mesh, P(None, "tp"), P(), P(None, None, "data"), P(), P()),
        "one axis twice": _plan(call, mesh, P(), P("tp"), P(None, None, "tp"), P(), P("tp")),
    }
    for name, plan in reasons.items():
        assert plan.reason is not None and (plan.tokens, plan.inputs, plan.outputs) == ((), (), ()), name
    uneven = _plan(call, cpu_mesh((8,), ("tp",)), P(), P(None, "tp"), P(), P(None, "tp"), P(None, "tp"))
    assert uneven.outputs == ("tp",)                               # 64 columns over 8: even
    odd = partition._describe("shrink", XLA_AS_CUSTOM_CALL, {"x": 0}, partition._Weights())
    s = _shapes(cpu_mesh((8,), ("tp",)), x=((6, H), P("tp")), out=((1, 6, R), P(None, "tp")))
    meta = [jax.ShapeDtypeStruct((16,), jnp.int32, sharding=None)] * 6
    assert "do not split evenly" in partition.plan(odd, [s["x"], *meta], s["out"]).reason


def test_backends_without_custom_calls_are_left_to_xla():
    assert partition.partitioned(xla) is xla
    wrapped = partition.partitioned(pallas_tpu)
    assert wrapped is partition.partitioned(pallas_tpu) and wrapped.NAME == "pallas_tpu" and wrapped.PARTITIONED


def test_tpu_interpret_mode_runs_unpartitioned_and_says_so(caplog):
    """TPU interpret mode (the default off a TPU) runs ordered host callbacks, which a partitioned
    sub-program cannot carry: the op runs directly, right, with a log line."""
    x, y, a, b, bias = _data(6)
    partition._SAID_UNPARTITIONABLE.discard(id(pallas_tpu))
    with caplog.at_level(logging.INFO, logger="jax_lora"), pallas_tpu.interpret_mode(pallas_tpu.DEFAULT_INTERPRET):
        got = jax.jit(_linear)(_wrapper("pallas_tpu"), jnp.asarray(y), jnp.asarray(x),
                               tuple(map(jnp.asarray, a)), tuple(map(jnp.asarray, b)), tuple(map(jnp.asarray, bias)),
                               jnp.asarray(RANKS, jnp.int32))
    assert oracle.rel_err(np.asarray(got), _want(x, y, a, b, bias)) < TOL
    assert any("TPU interpret mode" in r.getMessage() for r in caplog.records if r.name == "jax_lora")


# ----------------------------------------------------------------------------- triton (compiled only)

def test_triton_column_split_takes_local_blocks():
    """Compiled (not run): the Triton launch (on the CPU, its interpreter's callback) gets each
    device's block of B and y, and the program has no collective. On a GPU it is the FFI call,
    through the same partitioning code."""
    pytest.importorskip("triton")
    y_spec, x_spec, a_spec, b_spec, bias_spec, _, _ = CASES["column"]
    mesh = cpu_mesh()
    x, y, a, b, bias = _data(7)

    def put(v, spec):
        return jax.device_put(jnp.asarray(v), NamedSharding(mesh, spec))

    args = (_wrapper("triton", mesh), put(y, y_spec), put(x, x_spec), tuple(put(v, a_spec) for v in a),
            tuple(put(v, b_spec) for v in b), tuple(put(v, bias_spec) for v in bias),
            put(np.asarray(RANKS, np.int32), P()))
    hlo = jax.jit(_linear).lower(*args).compile().as_text()
    assert hlo_collectives(hlo) == []
    calls = [line for line in hlo.splitlines() if "custom-call(" in line]
    assert any(f"f32[{L},{N // 4},{R}]" in c for c in calls), calls
    assert not any(f"f32[{L},{N},{R}]" in c for c in calls)


def test_triton_stacked_views_split_by_columns():
    """add_lora_linear_stacked hands Triton Views of the stacked weights: a View over all of B's
    rows reads each device's block (compiled, not run; no collective, local B in the launch)."""
    pytest.importorskip("triton")
    mesh = cpu_mesh()
    x, y, a, b, _ = _data(8)

    def put(v, spec):
        return jax.device_put(jnp.asarray(v), NamedSharding(mesh, spec))

    step = jax.jit(lambda w, y, x, a, b: w.add_lora_linear_stacked(y, x, a, b, 0.5, (N,)))
    args = (_wrapper("triton", mesh), put(y, P(None, "tp")), put(x, P()), put(np.stack(a), P()),
            put(b[0], P(None, "tp")))
    hlo = step.lower(*args).compile().as_text()
    assert hlo_collectives(hlo) == []
    calls = [line for line in hlo.splitlines() if "custom-call(" in line]
    assert any(f"f32[{L},{N // 4},{R}]" in c for c in calls) and not any(f"f32[{L},{N},{R}]" in c for c in calls)


# ----------------------------------------------------------------------------- fp8 adapter weights

# The reference math with fp8 weight scales, declared a custom-call backend (contract section 11).
XLA_FP8_AS_CUSTOM_CALL = types.SimpleNamespace(NAME="xla-fp8-as-custom-call", COLUMN_SCALE=True, CUSTOM_CALLS=True,
                                               WEIGHT_SCALES=True, shrink=xla.shrink, expand=xla.expand)


def _fp8(weights):
    """(e4m3 weights as jnp, (L, rows) float32 scales, dequantised float64) per slice (tests/oracle.py's rule)."""
    out = []
    for w in weights:
        q, s = oracle.fp8_quantize(w)
        out.append((jnp.asarray(q), s, oracle.fp8_dequantize(q, s)))
    return out


def _fp8_sharded_call(backend, case):
    """(result, want, compiled HLO) of add_lora_linear with fp8 A and B and their scales under the
    case's shardings (B's scales split with B's rows, A's whole)."""
    y_spec, x_spec, a_spec, b_spec, bias_spec, _, _ = CASES[case]
    mesh = cpu_mesh()
    x, y, a, b, bias = _data(9)
    a8, b8 = _fp8(a), _fp8(b)

    def put(v, spec):
        return jax.device_put(jnp.asarray(v), NamedSharding(mesh, spec))

    b_scale_spec = P(None, "tp") if case == "column" else P()
    args = (_wrapper(backend, mesh), put(y, y_spec), put(x, x_spec), tuple(put(q, a_spec) for q, _, _ in a8),
            tuple(put(q, b_spec) for q, _, _ in b8), tuple(put(v, bias_spec) for v in bias),
            put(np.asarray(RANKS, np.int32), P()), tuple(put(s, P()) for _, s, _ in a8),
            tuple(put(s, b_scale_spec) for _, s, _ in b8))

    def step(w, y, x, a, b, bias, ranks, sa, sb):
        return w.add_lora_linear(y, x, a, b, bias, 0.5, (N,), lora_ranks=ranks, lora_a_scale=sa, lora_b_scale=sb)

    fn = jax.jit(step)
    return fn(*args), _want(x, y, [d for *_, d in a8], [d for *_, d in b8], bias), fn.lower(*args).compile().as_text()


@pytest.mark.parametrize("case", list(CASES))
def test_fp8_weights_split_like_16_bit_ones(case, monkeypatch):
    """fp8 A and B with their channel scales under each split: B's scales follow B's output rows
    (column), A's stay whole (row: the psum of the scaled partial shrinks; tokens: replicated). The
    result matches the oracle on the dequantised weights, and the program has exactly the 16-bit
    case's collectives (the op is partitioned, not run replicated)."""
    monkeypatch.setattr(PunicaWrapper, "_impl", lambda self: partition.partitioned(XLA_FP8_AS_CUSTOM_CALL))
    _check(*_fp8_sharded_call("xla", case), case)


@pytest.mark.parametrize("case", ["column", "row"])
def test_pallas_tpu_fp8_splits_like_the_math(case):
    """The Pallas kernels (generic interpreter: a custom-partitioned op XLA cannot look into) with fp8
    weights: per device, no all-gather of B or A, the row split's only collective the buffer's psum."""
    with pallas_tpu.interpret_mode(True):
        got, want, hlo = _fp8_sharded_call("pallas_tpu", case)
    _check(got, want, hlo, case)


def test_fp8_scales_in_the_plan():
    """B's scales split with B's rows (and y's columns); a B scale split otherwise, or an A scale split
    at all, runs replicated with the reason."""
    mesh = cpu_mesh((2, 2), ("data", "tp"))
    weights = partition._Weights()
    a = weights.refs([np.zeros((L, R, H), np.float32)])
    b = weights.refs([np.zeros((L, N, R), np.float32)])
    sa = weights.refs([np.zeros((L, R), np.float32)])
    sb = weights.refs([np.zeros((L, N), np.float32)])
    call = partition._describe("linear", XLA_FP8_AS_CUSTOM_CALL, {"x": 0, "y": 0}, weights, a=a, b=b, widths=(N,),
                               a_scale=sa, b_scale=sb, scale=1.0, offsets=(0,))
    meta = [jax.ShapeDtypeStruct((16,), jnp.int32, sharding=NamedSharding(mesh, P()))] * 6

    whole = P()

    def plan(b_spec, out, sa_spec=whole, sb_spec=whole, a_spec=whole, x=whole):
        s = _shapes(mesh, x=((T, H), x), y=((T, N), out), a=((L, R, H), a_spec), b=((L, N, R), b_spec),
                    sa=((L, R), sa_spec), sb=((L, N), sb_spec), out=((T, N), out))
        return partition.plan(call, [s["x"], s["y"], s["a"], s["b"], s["sa"], s["sb"], *meta], s["out"])

    assert plan(P(None, "tp"), P(None, "tp"), sb_spec=P(None, "tp")) == partition.Plan(outputs=("tp",))
    assert plan(P(), P(), a_spec=P(None, None, "tp")) == partition.Plan(inputs=("tp",))
    assert plan(P(), P("data"), x=P("data")) == partition.Plan(tokens=("data",))
    assert "lora_b's output rows" in plan(P(), P(), sb_spec=P(None, "tp")).reason
    assert "a lora_a scale" in plan(P(), P(), sa_spec=P(None, "tp")).reason
    assert "a lora_a scale" in plan(P(), P(), sa_spec=P("data")).reason
    specs = partition._specs(call, partition.Plan(outputs=("tp",)), [None] * (call.weights + 8))
    assert specs[2:6] == (P(None, None, None), P(None, "tp", None), P(None, None), P(None, "tp"))
