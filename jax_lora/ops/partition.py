"""GSPMD partitioning of the kernel backends' ops: under plain `jax.jit` with sharded inputs, each op
runs on every device's blocks, as its math splits.

Math (contract section 4; idx[t] the slot of token t):

  shrink:  buf[s, t, :] = scale * x[t] @ A_s[idx[t]].T                     x (T, H), A_s (L, r, H)
  expand:  y[t, off_s : off_s + n_s] (+)= buf[s, t] @ B_s[idx[t]].T       buf (S, T, r), B_s (L, n_s, r)
  linear:  y[t, slice s] += (scale * x[t] @ A_s[idx[t]].T) @ B_s[idx[t]].T   (add_lora_linear)

A kernel is a custom call (`pallas_call` on a TPU, Triton through XLA FFI on a GPU, an interpreter's
host callback elsewhere) that XLA's partitioner cannot look into: it runs it replicated, gathering
every split operand (the weights included) to every device first. Here each op is a
`jax.experimental.custom_partitioning` call: when XLA partitions the program, `plan` reads the
operands' shardings and the op runs per device on local blocks, with these splits:

  split (mesh axes of)            operands sharing it                    per device
  tokens T                        x dim 0, y dim 0, buf dim 1            its tokens; the metadata rebuilt
                                                                         from its part of the mapping
  input features H (row)          x dim 1, every A_s dim 2               a partial shrink, then one psum
                                                                         of the (S, T_local, r) buffer
  output features N (column)      y dim 1, B_s dim 1, bias_s /           its columns of y with its rows
                                  col_scale_s / b_scale_s dim 1          of B: no collective
                                  (one slice, all y)

fp8 weights (contract section 11) carry their float32 channel scales as operands beside them:
b_scale_s (L, n_s) is split with B's output rows (column parallel), a_scale_s (L, r) is never split
(its channels are the rank; a row split shards A's input features, and each device's partial
shrink is scaled by the whole a_scale before the psum, which the scale commutes with).

Any combination of the three (over distinct mesh axes) composes: e.g. tokens over "data" and H over
"tp". The slot and rank axes of the weights, the metadata and lora_ranks are replicated. A weight
split only along a dimension its activation is not split along takes the activation's split
instead: x (or y) is sliced locally, never the weight gathered (A split along H with x replicated
is row-parallel). Everything else runs replicated (XLA gathers what is split), said once per
compilation on the `jax_lora` logger (`plan` gives the reason): several slices with y's columns
split (device d's columns of y are then not one block of every slice in the natural column order;
`jax_lora.parallel.shard_layer` stores fused layers shard-major for that), B's rows split on other
axes than y's columns, a split slot or rank axis of a weight, a split that does not divide its
dimension, shardings that are not `NamedSharding`s.

Steps of one call (an op of `partitioned(impl)`): 1. the arrays are laid out as a flat list of
operands (weights once each: a Triton `View` contributes its base array, its index is static), the
op is traced once and the arrays it makes while traced become operands too (custom_partitioning
takes no constants); 2. `custom_partitioning` binds them with the op's Shardy sharding rule
(tokens, H and N as shared factors, every other dimension its own), so the result follows y (or x
for shrink) through propagation; 3. at partition time `plan` decides, the operands are requested
with its shardings, and the local program calls the backend on local shapes (plus the psum for a
split H). Outside a partitioned program (one device,
inside `jax.shard_map`, eager single-device calls) the backend runs directly.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental.custom_partitioning import ArrayMapping, SdyShardingRule, custom_partitioning
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from ..meta import LoRAKernelMeta, build_kernel_meta

__all__ = ["Plan", "partitioned", "plan"]

_LOG = logging.getLogger("jax_lora")
_META_FIELDS = tuple(f.name for f in dataclasses.fields(LoRAKernelMeta))


@dataclasses.dataclass(frozen=True)
class Plan:
    """How one op is split: the mesh axes over which the tokens, the input features H (row
    parallel) and the output features N (column parallel) are split; `reason` is None when the op
    runs split like its math, else why it runs replicated (every axis tuple then empty)."""

    tokens: tuple = ()
    inputs: tuple = ()
    outputs: tuple = ()
    reason: str | None = None


_REPLICATED = Plan()


# ----------------------------------------------------------------------------- the static description

@dataclasses.dataclass(frozen=True)
class _Ref:
    """One weight entry: operand `pos` among the call's weight operands, read whole (index None) or
    as a Triton View of it (`index`: ints and (start, stop) pairs, stop None for a whole axis)."""

    pos: int
    index: tuple | None = None


@dataclasses.dataclass(frozen=True)
class _Call:
    """What one op call is, apart from its arrays (hashable: the static argument of the custom
    call). Operands: [x] [y] [buf] weights... meta fields... [lora_ranks]."""

    op: str                      # "shrink" | "expand" | "linear"
    impl: object = dataclasses.field(compare=False)
    impl_id: int
    has_x: bool
    has_y: bool
    has_buf: bool
    weights: int                 # how many weight operands
    weight_ndims: tuple
    a: tuple                     # _Ref per slice (shrink, linear)
    b: tuple                     # _Ref per slice (expand, linear)
    bias: tuple | None           # None or per slice None / _Ref
    col_scale: tuple | None
    a_scale: tuple | None        # fp8: None or per slice None / _Ref of A's (L, r) channel scales
    b_scale: tuple | None        # fp8: None or per slice None / _Ref of B's (L, n_s) channel scales
    has_ranks: bool
    scale: float
    offsets: tuple
    add_inputs: bool
    widths: tuple                # n_s per slice (expand, linear)
    options: tuple               # other keyword arguments of the backend op, as (name, value) pairs

    @property
    def b_row_dim(self) -> int:
        """The dimension of B holding the output features: 1 for (L, n, r), 2 for (L, r, n)."""
        return 2 if dict(self.options).get("b_layout", "nr") == "rn" else 1

    def unpack(self, leaves: Sequence) -> tuple:
        """(x, y, buf, weights, meta, lora_ranks) from the operands."""
        it = iter(leaves)
        x = next(it) if self.has_x else None
        y = next(it) if self.has_y else None
        buf = next(it) if self.has_buf else None
        weights = tuple(next(it) for _ in range(self.weights))
        meta = LoRAKernelMeta(*(next(it) for _ in _META_FIELDS))
        ranks = next(it) if self.has_ranks else None
        return x, y, buf, weights, meta, ranks


def _index_key(index: tuple, shape: tuple) -> tuple:
    """A View's index as hashable ints and (start, stop) pairs; a slice over a whole axis is
    (0, None), so that the same index reads a local block of that axis too."""
    out = []
    for axis, ix in enumerate(index):
        if isinstance(ix, slice):
            start, stop, _ = ix.indices(shape[axis])
            out.append((0, None) if (start, stop) == (0, shape[axis]) else (start, stop))
        else:
            out.append(int(ix))
    return tuple(out)


def _read(weights: Sequence, ref: _Ref | None):
    """The entry `ref` refers to: its weight operand, or the View of it (on local blocks too)."""
    if ref is None:
        return None
    base = weights[ref.pos]
    if ref.index is None:
        return base
    from .triton import view  # only a Triton call holds Views
    return view(base, tuple(ix if isinstance(ix, int) else slice(*ix) for ix in ref.index))


class _Weights:
    """Collects the weight operands of one call, each array once (several Views share a base)."""

    def __init__(self):
        self.arrays: list = []

    def ref(self, a) -> _Ref | None:
        if a is None:
            return None
        base, index = (a.base, a.index) if _is_view(a) else (a, None)
        pos = next((p for p, known in enumerate(self.arrays) if known is base), len(self.arrays))
        if pos == len(self.arrays):
            self.arrays.append(base)
        return _Ref(pos, None if index is None else _index_key(index, base.shape))

    def refs(self, entries):
        return None if entries is None else tuple(self.ref(e) for e in entries)


def _is_view(a) -> bool:
    return hasattr(a, "base") and hasattr(a, "index") and hasattr(a, "strides")


# ----------------------------------------------------------------------------- the ops, whole and local

def _run(call: _Call, leaves: Sequence, plan_: Plan = _REPLICATED):
    """The op on `leaves` (whole arrays, or one device's blocks under `plan_`)."""
    x, y, buf, weights, meta, ranks = call.unpack(leaves)
    impl, options = call.impl, dict(call.options)
    if plan_.tokens:
        local = (x if x is not None else y).shape[0]
        meta = _local_meta(meta, plan_.tokens, local)
    a = tuple(_read(weights, r) for r in call.a)
    b = tuple(_read(weights, r) for r in call.b)
    bias = None if call.bias is None else tuple(_read(weights, r) for r in call.bias)
    extra = {} if call.col_scale is None else {"col_scale": tuple(_read(weights, r) for r in call.col_scale)}
    a_sc = {} if call.a_scale is None else {"a_scales": tuple(_read(weights, r) for r in call.a_scale)}
    b_sc = {} if call.b_scale is None else {"b_scales": tuple(_read(weights, r) for r in call.b_scale)}
    if call.op == "shrink":
        out = impl.shrink(x, a, meta, call.scale, ranks, **options, **a_sc)
        return lax.psum(out, plan_.inputs) if plan_.inputs else out
    if call.op == "expand":
        return impl.expand(buf, b, y, meta, call.offsets, call.add_inputs, ranks, bias, **options, **extra, **b_sc)
    if plan_.inputs:  # row parallel: partial shrinks, one psum of the rank-r buffer, then the expand
        buf = lax.psum(impl.shrink(x, a, meta, call.scale, ranks, **a_sc), plan_.inputs)
        return impl.expand(buf, b, y, meta, call.offsets, True, ranks, bias, **extra, **b_sc)
    return impl.linear(y, x, a, b, meta, call.scale, call.offsets, ranks, bias, **options, **extra, **a_sc, **b_sc)


def _local_meta(meta: LoRAKernelMeta, axes: tuple, local_tokens: int) -> LoRAKernelMeta:
    """The metadata of this device's tokens [d T_local, (d + 1) T_local), d its index over `axes`:
    its part of the (replicated) mapping, grouped again (`build_kernel_meta`)."""
    start = lax.axis_index(axes) * local_tokens
    mapping = lax.dynamic_slice_in_dim(meta.token_lora_mapping, start, local_tokens)
    return build_kernel_meta(mapping, jnp.int32(local_tokens), max_loras=meta.max_loras)


# ----------------------------------------------------------------------------- the plan

def _axes(sharding, ndim: int) -> tuple:
    """Per dimension, the tuple of mesh axes splitting it (a replicated or unknown sharding: all
    empty)."""
    if not isinstance(sharding, NamedSharding):
        return ((),) * ndim
    spec = tuple(sharding.spec) + (None,) * (ndim - len(sharding.spec))
    return tuple(() if s is None else (s,) if isinstance(s, str) else tuple(s) for s in spec[:ndim])


def _weight_roles(call: _Call) -> dict:
    """{weight operand: (kind, dims)}: kind "a" / "b" / "vector" (bias, col_scale, b_scale) /
    "a_scale" (A's fp8 channel scales, no dimension that splits); dims maps the dimension meaning
    ("h" for A's input features, "n" for output features) to the operand's dimension, counting a
    View's index."""
    roles = {}

    def add(ref, kind, dim_name, view_dim):
        if ref is None:
            return
        ndim = call.weight_ndims[ref.pos]
        dim = _base_dim(ref, view_dim, ndim)
        roles.setdefault(ref.pos, (kind, {}))[1][dim_name] = dim

    for r in call.a:
        add(r, "a", "h", 2)
    for r in call.b:
        add(r, "b", "n", call.b_row_dim)
    for entries in (call.bias, call.col_scale, call.b_scale):
        for r in entries or ():
            add(r, "vector", "n", 1)
    for r in call.a_scale or ():
        if r is not None:
            roles.setdefault(r.pos, ("a_scale", {}))
    return roles


def _base_dim(ref: _Ref, view_dim: int, ndim: int) -> int:
    """The operand dimension that dimension `view_dim` of the entry `ref` reads."""
    if ref.index is None:
        return view_dim
    kept = [axis for axis, ix in enumerate(ref.index) if not isinstance(ix, int)]
    kept += list(range(len(ref.index), ndim))
    return kept[view_dim]


def plan(call: _Call, shapes: Sequence, result) -> Plan:
    """How `call` runs given its operands' and result's shardings (`shapes`: objects with .shape
    and .sharding, in the call's operand order). See the module docstring for the rules."""
    for s in (*shapes, result):
        if s.sharding is not None and not isinstance(s.sharding, NamedSharding):
            return Plan(reason=f"a sharding that is not a NamedSharding ({type(s.sharding).__name__})")
    x, y, buf, weights, _, _ = call.unpack(list(shapes))
    mesh = next((s.sharding.mesh for s in (*shapes, result) if isinstance(s.sharding, NamedSharding)), None)
    if mesh is None:
        return _REPLICATED
    size = functools.partial(_size, mesh)
    out = result if call.op != "shrink" else None
    # 1. tokens: the result's (y's) split for expand / linear, x's for shrink.
    tokens = _axes(out.sharding, 2)[0] if out is not None else _axes(x.sharding, 2)[0]
    # 2. input features: x's split of H, else the A weights' common split (x is then sliced locally).
    roles = _weight_roles(call)
    inputs = ()
    if call.op != "expand":
        x_h = _axes(x.sharding, 2)[1]
        a_h = {_axes(weights[p].sharding, weights[p].ndim)[dims["h"]] for p, (k, dims) in roles.items() if k == "a"}
        a_split = a_h - {()}
        if x_h and a_split - {x_h}:
            return Plan(reason=f"x's input features are split over {x_h} but lora_a's over {sorted(a_split)}")
        if not x_h and len(a_split) > 1:
            return Plan(reason=f"the lora_a slices split their input features differently: {sorted(a_split)}")
        inputs = x_h or (next(iter(a_split)) if a_split else ())
    # 3. output features: y's (the result's) split of N; B's rows must follow it or be whole.
    outputs = ()
    if out is not None:
        outputs = _axes(out.sharding, 2)[1]
        b_n = {_axes(weights[p].sharding, weights[p].ndim)[dims["n"]] for p, (k, dims) in roles.items()
               if k in ("b", "vector")} - {()}
        if b_n - {outputs}:
            return Plan(reason=f"lora_b's output rows are split over {sorted(b_n)} but y's columns over "
                               f"{outputs or 'no axis'}")
        if outputs and not (len(call.widths) == 1 and call.offsets == (0,) and call.widths[0] == y.shape[1]):
            return Plan(reason=f"y's columns are split over {outputs} and the op writes {len(call.widths)} "
                               f"slice(s) of widths {call.widths} at offsets {call.offsets} of y's {y.shape[1]} "
                               "columns: a device's columns are not one block of every slice (one slice "
                               "covering y splits; jax_lora.parallel.shard_layer stores fused layers shard-major)")
    # 4. nothing else of a weight may be split (slots, ranks, the slice axis of a stacked base).
    for p, (kind, dims) in roles.items():
        free = set(dims.values())
        for dim, axes in enumerate(_axes(weights[p].sharding, weights[p].ndim)):
            if axes and dim not in free:
                name = {"a": "lora_a", "b": "lora_b", "vector": "a bias / DoRA scale / lora_b scale",
                        "a_scale": "a lora_a scale"}[kind]
                return Plan(reason=f"{name} (shape {tuple(weights[p].shape)}) is split along dimension {dim} over "
                                   f"{axes}: only its feature dimension splits")
    if buf is not None:
        b_axes = _axes(buf.sharding, 3)
        if b_axes[0] or b_axes[2]:
            return Plan(reason=f"the shrink buffer (shape {tuple(buf.shape)}) is split along its slice or rank axis")
    # 5. distinct axes, even blocks.
    used = [*tokens, *inputs, *outputs]
    if len(set(used)) != len(used):
        return Plan(reason=f"one mesh axis splits two of tokens {tokens}, input features {inputs}, output "
                           f"features {outputs}")
    t = (x if x is not None else y if y is not None else None)
    num_tokens = t.shape[0] if t is not None else buf.shape[1]
    checks = [("tokens", num_tokens, tokens)]
    if inputs:
        checks.append(("input features", x.shape[1], inputs))
    if outputs:
        checks.append(("output features", y.shape[1], outputs))
    for what, n, axes in checks:
        if n % size(axes):
            return Plan(reason=f"{n} {what} do not split evenly over {axes} ({size(axes)} devices)")
    for ref in (*call.a, *call.b, *(call.bias or ()), *(call.col_scale or ()), *(call.b_scale or ())):
        if ref is None or ref.index is None:
            continue
        for name, dim in roles[ref.pos][1].items():
            if dim < len(ref.index) and ref.index[dim] != (0, None) and (inputs if name == "h" else outputs):
                return Plan(reason=f"a View of a weight (index {ref.index}) reads part of its split dimension {dim}")
    return Plan(tokens=tokens, inputs=inputs, outputs=outputs)


def _size(mesh, axes: tuple) -> int:
    return math.prod(int(mesh.shape[a]) for a in axes)


def _specs(call: _Call, plan_: Plan, shapes: Sequence) -> tuple:
    """The operands' PartitionSpecs under `plan_` (in operand order)."""
    tok, inp, outp = (plan_.tokens or None), (plan_.inputs or None), (plan_.outputs or None)
    specs = []
    if call.has_x:
        specs.append(P(tok, inp))
    if call.has_y:
        specs.append(P(tok, outp))
    if call.has_buf:
        specs.append(P(None, tok, None))
    roles = _weight_roles(call)
    for p in range(call.weights):
        dims = [None] * call.weight_ndims[p]
        for name, dim in roles.get(p, ("", {}))[1].items():
            dims[dim] = inp if name == "h" else outp
        specs.append(P(*dims))
    specs.extend(P() for _ in range(len(shapes) - len(specs)))
    return tuple(specs)


def _result_spec(call: _Call, plan_: Plan) -> P:
    if call.op == "shrink":
        return P(None, plan_.tokens or None, None)
    return P(plan_.tokens or None, plan_.outputs or None)


# ----------------------------------------------------------------------------- custom_partitioning

def _partition(call: _Call, traced, mesh, shapes, result):
    plan_ = plan(call, shapes, result)
    if plan_.reason is not None:
        _LOG.warning("backend %r: %s runs replicated on every device (%s)", call.impl.NAME, call.op, plan_.reason)
    arg_shardings = tuple(NamedSharding(mesh, s) for s in _specs(call, plan_, shapes))
    count = len(traced.consts)
    result_sharding = NamedSharding(mesh, _result_spec(call, plan_))
    return mesh, (lambda *ops: _run(call, ops[:len(ops) - count], plan_)), result_sharding, arg_shardings


def _infer(call: _Call, traced, mesh, shapes, result):
    return NamedSharding(mesh, _result_spec(call, plan(call, shapes, result)))


def _rule(call: _Call, traced, mesh, operand_types, result_types) -> SdyShardingRule:
    """Shardy's view of the op: tokens "t", input features "h" and output features "n" shared where
    the math shares them (n only for one slice covering y), every other dimension its own factor."""
    ndims = [len(ir_type.shape) for ir_type in operand_types]
    counter = iter(range(1 << 30))

    def own(k: int) -> list:
        return [f"u{next(counter)}" for _ in range(k)]

    whole_n = call.op != "shrink" and len(call.widths) == 1 and call.offsets == (0,)
    mappings = []
    if call.has_x:
        mappings.append(["t", "h"])
    if call.has_y:
        mappings.append(["t", "n"])
    if call.has_buf:
        mappings.append([*own(1), "t", *own(1)])
    roles = _weight_roles(call)
    for p in range(call.weights):
        dims = own(ndims[len(mappings)])
        for name, dim in roles.get(p, ("", {}))[1].items():
            if name == "h" or whole_n:
                dims[dim] = name
        mappings.append(dims)
    while len(mappings) < len(ndims):
        mappings.append(own(ndims[len(mappings)]))
    result = [*own(1), "t", *own(1)] if call.op == "shrink" else ["t", "n"]
    return SdyShardingRule(tuple(ArrayMapping(*m) for m in mappings), (ArrayMapping(*result),))


def _whole(call: _Call, traced, *operands):
    """The unpartitioned op: `jaxpr` (the op traced beforehand) on the operands, its constants last."""
    count = len(traced.consts)
    return jax.core.eval_jaxpr(traced.jaxpr, operands[len(operands) - count:], *operands[:len(operands) - count])[0]


def _partitioned_call(call: _Call, *leaves):
    """Binds the op's custom partitioning. The op is traced first: the arrays it makes while traced
    (offsets, scalars) become operands, as custom_partitioning takes no constants."""
    jaxpr = jax.make_jaxpr(lambda *ops: _run(call, ops))(*leaves)
    return _OP(call, _Consts(jaxpr), *leaves, *jaxpr.consts)


class _Consts:
    """A traced op as a static argument (hashed by identity: one per call)."""

    def __init__(self, jaxpr):
        self.jaxpr = jaxpr.jaxpr
        self.consts = jaxpr.consts


_OP = custom_partitioning(_whole, static_argnums=(0, 1))
_OP.def_partition(_partition, infer_sharding_from_operands=_infer, sharding_rule=_rule)


# ----------------------------------------------------------------------------- the backend

def _is_traced(leaves) -> bool:
    return any(isinstance(v, jax.core.Tracer) for v in leaves)


def _on_several_devices(leaves) -> bool:
    for v in leaves:
        try:
            if isinstance(v, jax.Array) and len(v.sharding.device_set) > 1:
                return True
        except Exception:
            continue
    return False


def _call(call: _Call, leaves: list):
    """The op: partitioned inside a trace (XLA decides at compile time), jitted once for concrete
    arrays on several devices, direct for concrete arrays on one, and direct where the backend
    cannot be partitioned now (`partitionable()` false: said once)."""
    hook = getattr(call.impl, "partitionable", None)
    if hook is not None and not hook():
        if call.impl_id not in _SAID_UNPARTITIONABLE:
            _SAID_UNPARTITIONABLE.add(call.impl_id)
            _LOG.info("backend %r: its kernels run host callbacks now (TPU interpret mode) that a partitioned "
                      "program cannot carry; under a jit over several devices XLA runs them replicated",
                      call.impl.NAME)
        return _run(call, leaves)
    if _is_traced(leaves):
        return _partitioned_call(call, *leaves)
    if _on_several_devices(leaves):
        return jax.jit(_partitioned_call, static_argnums=0)(call, *leaves)
    return _run(call, leaves)


def _leaves(call_args: dict, weights: _Weights, meta: LoRAKernelMeta, ranks) -> list:
    leaves = [v for v in (call_args.get("x"), call_args.get("y"), call_args.get("buf")) if v is not None]
    leaves += weights.arrays
    leaves += [getattr(meta, f) for f in _META_FIELDS]
    if ranks is not None:
        leaves.append(ranks)
    return leaves


def _describe(op, impl, arrays: dict, weights: _Weights, *, a=(), b=(), widths=(), bias=None, col_scale=None,
              a_scale=None, b_scale=None, ranks=None, scale=1.0, offsets=(), add_inputs=True, options=None) -> _Call:
    return _Call(op=op, impl=impl, impl_id=id(impl), has_x="x" in arrays, has_y="y" in arrays, has_buf="buf" in arrays,
                 weights=len(weights.arrays), weight_ndims=tuple(w.ndim for w in weights.arrays), a=a, b=b,
                 bias=bias, col_scale=col_scale, a_scale=a_scale, b_scale=b_scale, has_ranks=ranks is not None,
                 scale=float(scale),
                 offsets=tuple(int(o) for o in offsets), add_inputs=bool(add_inputs), widths=tuple(widths),
                 options=tuple(sorted((options or {}).items())))


def _widths(lora_b, options: dict) -> tuple:
    return tuple(int(b.shape[2 if options.get("b_layout", "nr") == "rn" else 1]) for b in lora_b)


def _direct_pairs(impl, options: dict) -> bool:
    """Whether the op takes adapter pairs (several adapters per token, contract section 10): they are
    not partitioned here, so the backend runs directly (under a jit over several devices XLA runs
    the custom call replicated), said once per backend."""
    for key, what in (("pairs", "steps with several adapters per token"),):
        if options.get(key) is None:
            continue
        if (what, id(impl)) not in _SAID_UNPARTITIONABLE:
            _SAID_UNPARTITIONABLE.add((what, id(impl)))
            _LOG.info("backend %r: %s run its kernels unpartitioned; under a jit over several devices XLA runs "
                      "them replicated", impl.NAME, what)
        return True
    return False


def _scale_kw(a_scales=None, b_scales=None) -> dict:
    """The fp8 scale keywords that are given (the backend's defaults otherwise)."""
    return {k: v for k, v in (("a_scales", a_scales), ("b_scales", b_scales)) if v is not None}


def _shrink(impl, x, lora_a, meta, scale, lora_ranks=None, *, a_scales=None, **options):
    if x.shape[0] == 0 or _direct_pairs(impl, options):
        return impl.shrink(x, lora_a, meta, scale, lora_ranks, **options, **_scale_kw(a_scales))
    weights = _Weights()
    arrays = {"x": x}
    call = _describe("shrink", impl, arrays, weights, a=weights.refs(lora_a), a_scale=weights.refs(a_scales),
                     ranks=lora_ranks, scale=scale, options=options)
    return _call(call, _leaves(arrays, weights, meta, lora_ranks))


def _expand(impl, buf, lora_b, y, meta, offsets, add_inputs, lora_ranks=None, bias=None, *, col_scale=None,
            b_scales=None, **options):
    if y.shape[0] == 0 or _direct_pairs(impl, options):
        return impl.expand(buf, lora_b, y, meta, offsets, add_inputs, lora_ranks, bias, col_scale=col_scale,
                           **options, **_scale_kw(b_scales=b_scales))
    weights = _Weights()
    arrays = {"y": y, "buf": buf}
    call = _describe("expand", impl, arrays, weights, b=weights.refs(lora_b), widths=_widths(lora_b, options),
                     bias=weights.refs(bias), col_scale=weights.refs(col_scale), b_scale=weights.refs(b_scales),
                     ranks=lora_ranks,
                     offsets=offsets, add_inputs=add_inputs, options=options)
    return _call(call, _leaves(arrays, weights, meta, lora_ranks))


def _linear(impl, y, x, lora_a, lora_b, meta, scale, offsets, lora_ranks=None, bias=None, *, col_scale=None,
            a_scales=None, b_scales=None, **options):
    if x.shape[0] == 0 or _direct_pairs(impl, options):
        return impl.linear(y, x, lora_a, lora_b, meta, scale, offsets, lora_ranks, bias, col_scale=col_scale,
                           **options, **_scale_kw(a_scales, b_scales))
    weights = _Weights()
    arrays = {"x": x, "y": y}
    call = _describe("linear", impl, arrays, weights, a=weights.refs(lora_a), b=weights.refs(lora_b),
                     widths=_widths(lora_b, options), bias=weights.refs(bias), col_scale=weights.refs(col_scale),
                     a_scale=weights.refs(a_scales), b_scale=weights.refs(b_scales),
                     ranks=lora_ranks, scale=scale, offsets=offsets, options=options)
    return _call(call, _leaves(arrays, weights, meta, lora_ranks))


_PARTITIONED: dict = {}
_SAID_UNPARTITIONABLE: set = set()


def partitioned(impl):
    """Backend `impl` with its ops partitioned like their math under GSPMD (the module docstring),
    when it runs custom calls (`CUSTOM_CALLS = True`); a backend of plain XLA ops, which XLA
    partitions itself, is returned as it is."""
    if not getattr(impl, "CUSTOM_CALLS", False):
        return impl
    key = id(impl)
    if key not in _PARTITIONED:
        ops = {"shrink": functools.partial(_shrink, impl), "expand": functools.partial(_expand, impl)}
        if hasattr(impl, "linear"):
            ops["linear"] = functools.partial(_linear, impl)
        _PARTITIONED[key] = (impl, _Partitioned(impl, ops))
    return _PARTITIONED[key][1]


class _Partitioned:
    """A backend's partitioned ops (`shrink`, `expand`, `linear`) beside the backend itself
    (`backend`); its declarations (NAME, COLUMN_SCALE, ...) are read from the backend at each
    lookup, so they stay the backend's."""

    PARTITIONED = True
    _FORWARDED = frozenset(("NAME", "COLUMN_SCALE", "WEIGHT_SCALES", "READS_VIEWS", "deterministic",
                            "partitionable"))

    def __init__(self, impl, ops: dict):
        self.backend = impl
        self.__dict__.update(ops)

    def __getattr__(self, name):
        if name in _Partitioned._FORWARDED:
            return getattr(self.backend, name)
        raise AttributeError(f"partitioned backend {getattr(self.backend, 'NAME', '?')!r} has no attribute {name!r}")
