"""Tensor parallelism for the multi-LoRA layers: each device runs the ops on its shard.

Math. A layer computes y = x W + sum over tokens' adapters of (x A^T) B^T (contract section 4, per
slice). Over n devices of one mesh axis (default "tp"), device d holds one block of W and of the
adapter weights; the LoRA part is written so that each device calls the wrapper on local arrays
inside `jax.shard_map`, and the only collectives are the ones below. Shapes: T tokens, S slices,
r rank, L slots, H / K input features, N = n_0 + ... + n_{S-1} output features, V vocabulary,
D embedding width, n devices, d the device's index on the axis.

  layout          base W            A (L, r, in)        B (L, out, r)      LoRA collective
  column          columns split     replicated          rows split         none
  column_gather   columns split     rank split (r/n)    rows split         all-gather (S, T, r/n) -> (S, T, r)
  row_reduce      rows split        input split (K/n)   rows split         psum (S, T, r) partial shrinks
  row_partial     rows split        input split (K/n)   replicated         none (rides the psum of y)
  vocab           vocab rows split  vocab rows split    replicated         none (rides the psum of y)

  column, column_gather (qkv, gate_up; the LM head over the vocabulary, kind "logits"): x is
    replicated, y is split along its columns. Each slice is split on its own: device d holds
    columns [d n_s / n, (d + 1) n_s / n) of every slice s, so q, k, v of unequal widths (GQA) are
    each split evenly. A fused layer stores its columns in shard-major order, the n blocks
    [slice 0 part d | slice 1 part d | ...] one after the other (`column_permutation`), so that a
    plain split of the stored axis gives every device its part of every slice.
    column_gather: device d holds rank rows [d r/n, (d+1) r/n) of A, shrinks to (S, T, r/n) and the
    all-gather along the rank gives every device the (S, T, r) buffer its B rows need.
  row_reduce, row_partial (o, down): x is split along its features, y = psum of partial products,
    replicated. Shrinking a slice of the input gives a partial (S, T, r) sum.
    row_reduce: psum that buffer, then device d expands its B rows into its columns of its
    partial y; the psum of y the base layer needs anyway adds the column blocks together.
    row_partial: device d expands its partial buffer with all of B into its partial y (linear in
    the buffer, so the psum of y sums the LoRA parts too).
  vocab (the embedding): device d holds vocabulary rows [d V/n, (d+1) V/n) of the table and of the
    LoRA-A table; a token outside them gives zero rows, base and LoRA; the psum of y completes both.

Bytes moved per device and call (`layer_bytes`): the weights of the `a` active adapters read from
memory plus what the device receives over the interconnect (ring collectives: an all-gather of G
bytes receives (n-1)/n G, an all-reduce receives 2 (n-1)/n G), with w the weights' itemsize and
float32 buffers:

  column:         a w (S r H + r N/n)                     + 0
  column_gather:  a w (S r H/n + r N/n)                   + (n-1)/n * 4 S T r
  row_reduce:     a w (S r K/n + r N/n)                   + 2 (n-1)/n * 4 S T r
  row_partial:    a w (S r K/n + r N)                     + 0
  vocab:          T r w + a w D r                         + 0

`choose_layout` picks, per layer, the layout of its kind that moves fewer bytes for a given token
count (column_gather over column when 4 T < a w H; row_reduce over row_partial when 8 S T < a w N);
ties keep the layout without a collective. The psum of y (T N for row layers, T D for the
embedding) belongs to the base layer and is the same in every layout.

Using it: `shard_layer(layer, mesh, kind=...)` places one layer's variables with NamedShardings
(permuting a fused layer's columns) and sets `layer.tp`; the layer's `__call__` then runs the
shard_map above whenever a wrapper is installed (without one, the base layer runs as XLA
partitions it). `shard_model(model, mesh, plan)` does it for a model; jax_lora.models.llama gives
its plan. `place_slot_value` is what AdapterManager uses to put one slot's weights on the devices,
each device receiving only its block. Index arrays (the wrapper) are replicated on the mesh.

Backends run per shard: every backend sees the local arrays of one device (xla, pallas_tpu, and
triton, whose custom call or interpreter callback takes the local shapes), so no backend gathers
weights.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax import lax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from . import nn as lnn
from .ops import dispatch
from .parallel_layouts import KINDS, LAYOUTS, LayoutBytes, check_layout, choose_layout, layer_bytes, split_problem

_LOG = logging.getLogger("jax_lora")

__all__ = [
    "KINDS",
    "LAYOUTS",
    "LayoutBytes",
    "TensorParallel",
    "choose_layout",
    "column_permutation",
    "layer_bytes",
    "natural_columns",
    "place_slot_value",
    "shard_layer",
    "shard_model",
    "shard_plain_layer",
    "split_fused",
]

AXIS = "tp"

_LAYER_TYPE = {"column": lnn.MultiLoRALinear, "row": lnn.MultiLoRALinear, "embed": lnn.MultiLoRAEmbed,
               "logits": lnn.MultiLoRALogits}


# ----------------------------------------------------------------------------- layouts of the weights

def column_permutation(slices: Sequence[int], shards: int) -> np.ndarray:
    """(N,) int64: stored column j of a fused column-parallel layer holds natural column perm[j].

    Stored order is shard-major: block d (N/n columns) is [slice 0 part d | slice 1 part d | ...],
    part d of slice s being its natural columns off_s + [d n_s/n, (d+1) n_s/n). One slice (or one
    device) gives the identity.
    """
    n = int(shards)
    offs = np.concatenate([[0], np.cumsum(slices)[:-1]]).astype(np.int64)
    parts = [off + d * (w // n) + np.arange(w // n) for d in range(n) for off, w in zip(offs, slices)]
    return np.concatenate(parts) if parts else np.zeros(0, np.int64)


def natural_columns(stored: np.ndarray, slices: Sequence[int], shards: int, axis: int = -1) -> np.ndarray:
    """Undoes `column_permutation` along `axis` of a host array (the natural column order)."""
    perm = column_permutation(slices, shards)
    out = np.empty_like(stored)
    idx = [slice(None)] * stored.ndim
    idx[axis] = perm
    out[tuple(idx)] = stored
    return out


def split_fused(y: jax.Array, widths: Sequence[int], shards: int) -> tuple:
    """The slices of a fused output, each in natural column order: y (..., N) -> (..., n_s) per slice.

    shards = 1: plain column slices. shards = n: y's columns are in shard-major order
    (`column_permutation`); a reshape to (..., n, N/n) and a slice of the last axis give each slice's
    parts, which reshape back to (..., n_s). A split of y's last axis over the n devices stays a
    split of every result (no data moves).
    """
    widths = tuple(int(w) for w in widths)
    if sum(widths) != y.shape[-1] or any(w % shards for w in widths):
        raise ValueError(f"widths {widths} must sum to y's last dimension {y.shape[-1]} (y shape {y.shape}) and "
                         f"each be divisible by shards={shards}")
    if shards == 1:
        offs = np.concatenate([[0], np.cumsum(widths)])
        return tuple(y[..., offs[i]:offs[i + 1]] for i in range(len(widths)))
    lead = y.shape[:-1]
    blocks = y.reshape(lead + (shards, sum(widths) // shards))
    out, off = [], 0
    for w in widths:
        out.append(blocks[..., off:off + w // shards].reshape(lead + (w,)))
        off += w // shards
    return tuple(out)


def _spec(ndim: int, axis: str, dim: int | None) -> P:
    """A PartitionSpec of `ndim` dims splitting dimension `dim` (None: replicated), without
    trailing Nones: the form XLA gives outputs, so a value written back keeps an equal sharding
    (an unequal one would be a new jit cache key: a recompilation)."""
    return P() if dim is None else P(*([None] * dim + [axis]))


# variable -> the dimension split over the axis (None: replicated), per layout.
_SPLIT_DIMS = {
    "column": {"kernel": 1, "bias": 0, "lora_a": None, "lora_b": 1, "lora_ranks": None},
    "column_gather": {"kernel": 1, "bias": 0, "lora_a": -2, "lora_b": 1, "lora_ranks": None},
    "row_reduce": {"kernel": 0, "bias": None, "lora_a": -1, "lora_b": 1, "lora_ranks": None},
    "row_partial": {"kernel": 0, "bias": None, "lora_a": -1, "lora_b": None, "lora_ranks": None},
    "vocab": {"embedding": 0, "lora_a": 1, "lora_b": None, "lora_ranks": None},
}


@dataclasses.dataclass(frozen=True)
class TensorParallel:
    """How one multi-LoRA layer is split: the mesh, its axis, the layer kind and the layout.

    A static attribute of the layer (`layer.tp`); `apply` runs the layer's call on the mesh.
    """

    mesh: Mesh
    axis: str
    kind: str
    layout: str

    def __post_init__(self):
        check_layout(self.kind, self.layout)
        if self.axis not in self.mesh.shape:
            raise ValueError(f"axis {self.axis!r} is not an axis of the mesh {dict(self.mesh.shape)}")

    @property
    def size(self) -> int:
        return int(self.mesh.shape[self.axis])

    def split_dim(self, name: str, ndim: int):
        """The dimension of variable `name` split over the axis, or None when it is replicated."""
        dim = _SPLIT_DIMS[self.layout][name]
        return None if dim is None else dim % ndim

    def spec(self, name: str, ndim: int) -> P:
        return _spec(ndim, self.axis, self.split_dim(name, ndim))

    def sharding(self, name: str, ndim: int) -> NamedSharding:
        return NamedSharding(self.mesh, self.spec(name, ndim))

    def apply(self, layer, x: jax.Array, punica) -> jax.Array:
        """The layer's output with the wrapper `punica`, computed per device (see the module docstring)."""
        if self.kind == "embed":
            if not jnp.issubdtype(x.dtype, jnp.integer):
                raise TypeError(f"ids must be an integer array, got dtype {x.dtype}")
        elif x.ndim < 1 or x.shape[-1] != layer.in_features:
            raise ValueError(f"x must have shape (..., {layer.in_features}) (the layer's in_features), got "
                             f"{x.shape}")
        return {"column": _column_call, "logits": _logits_call, "row": _row_call,
                "embed": _embed_call}[self.kind](self, layer, x, punica)


# ----------------------------------------------------------------------------- placement

def _base_vars(layer) -> dict:
    """{name: variable} of the base layer's arrays (kernel / bias / embedding)."""
    base = layer.base if isinstance(layer, lnn.LORA_LAYER_TYPES) else layer
    names = ("embedding",) if isinstance(base, nnx.Embed) else ("kernel", "bias")
    return {n: getattr(base, n) for n in names if getattr(base, n, None) is not None}


def _lora_vars(layer) -> dict:
    return {n: getattr(layer, n) for n in ("lora_a", "lora_b", "lora_ranks")}


def _layer_sizes(layer, kind: str) -> tuple:
    """(slices, in_features, rank) of a multi-LoRA layer, as `layer_bytes` counts them."""
    if kind == "embed":
        return (layer.features,), layer.num_embeddings, layer.max_rank
    if kind == "logits":
        return (layer.out_features,), layer.in_features, layer.max_rank
    return layer.output_slices, layer.in_features, layer.max_rank


def shard_layer(layer, mesh: Mesh, *, kind: str, layout: str | None = None, axis: str = AXIS,
                tokens: int = 64, base_placed: bool = False) -> TensorParallel:
    """Places a multi-LoRA layer on `mesh` (split over `axis`) and sets `layer.tp`; returns it.

    kind: "column" (MultiLoRALinear, output split), "row" (MultiLoRALinear, input split), "embed"
    (MultiLoRAEmbed) or "logits" (MultiLoRALogits). layout: one of LAYOUTS[kind]; None picks the
    one moving the fewest bytes at `tokens` tokens with every slot active (`choose_layout`).
    base_placed: the base layer was split already (`shard_plain_layer`: columns permuted and
    placed), so only the adapter variables are placed.
    Steps: 1. check the sizes split evenly; 2. permute a fused column layer's columns (base kernel,
    bias and lora_b rows) to shard-major order; 3. put every variable on the mesh with its
    layout's NamedSharding (each device receives only its block).
    """
    if kind not in LAYOUTS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    if not isinstance(layer, _LAYER_TYPE[kind]):
        raise TypeError(f"layer for kind {kind!r} must be a {_LAYER_TYPE[kind].__name__}, got "
                        f"{type(layer).__name__}")
    if not isinstance(mesh, Mesh):
        raise TypeError(f"mesh must be a jax.sharding.Mesh, got {type(mesh).__name__}")
    if axis not in mesh.shape:
        raise ValueError(f"axis {axis!r} is not an axis of the mesh {dict(mesh.shape)}")
    if getattr(layer, "banked", False):
        raise ValueError("the layer's adapter variables live in a layer-stacked LoRA bank: give them back to "
                         "the layers first (jax_lora.nn.unstack_lora_layers(model); shard_model does)")
    if getattr(layer, "tp", None) is not None:
        raise ValueError(f"the layer is already split ({layer.tp.kind}, {layer.tp.layout}); build a new layer "
                         "to split it again")
    if getattr(layer, "dora", False):
        raise ValueError("a DoRA layer (dora=True) cannot be split over a mesh: its column scale would have to "
                         "follow the layout's reduction; serve DoRA adapters with unsplit layers")
    if getattr(layer, "lora_dtype", None) == "fp8":
        raise ValueError("a layer with fp8 adapter weights (lora_dtype='fp8') cannot be split over a mesh yet: its "
                         "channel scales are not laid out per device; serve fp8 adapters with unsplit layers")
    n = int(mesh.shape[axis])
    slices, in_features, rank = _layer_sizes(layer, kind)
    if layout is None:
        itemsize = jnp.dtype(layer.lora_b.get_value().dtype).itemsize
        layout = choose_layout(kind, tokens=tokens, active=min(layer.max_loras, tokens), slices=slices,
                               in_features=in_features, rank=rank, shards=n, itemsize=itemsize)
    check_layout(kind, layout)
    problem = split_problem(kind, layout, slices, in_features, rank, n)
    if problem is not None:
        raise ValueError(f"cannot split the {kind} layer in layout {layout!r} over {n} devices: {problem}")
    tp = TensorParallel(mesh, axis, kind, layout)
    permute = kind == "column" and len(slices) > 1 and n > 1
    perm = column_permutation(slices, n) if permute else None
    for name, var in {**({} if base_placed else _base_vars(layer)), **_lora_vars(layer)}.items():
        value = var.get_value()
        if perm is not None and name in ("kernel", "bias", "lora_b"):
            value = jnp.take(value, jnp.asarray(perm), axis={"kernel": 1, "bias": 0, "lora_b": 1}[name])
        var.set_value(jax.device_put(value, tp.sharding(name, value.ndim)))
    layer.tp = tp
    return tp


def shard_plain_layer(layer, mesh: Mesh, *, kind: str, slices: Sequence[int] | None = None,
                      axis: str = AXIS) -> None:
    """Places a plain `nnx.Linear` / `nnx.Embed` (no adapters) the way `shard_layer` places a
    multi-LoRA layer's base: columns split (kind column / logits; a fused layer with `slices`
    permuted to shard-major order), rows split (row), vocabulary rows split (embed). XLA
    partitions its computation. A model split this way treats a base layer already on `mesh` as
    split (`shard_model`)."""
    if kind not in LAYOUTS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    expected = nnx.Embed if kind == "embed" else nnx.Linear
    if not isinstance(layer, expected) or isinstance(layer, lnn.LORA_LAYER_TYPES):
        raise TypeError(f"layer for kind {kind!r} must be a plain {expected.__name__}, got {type(layer).__name__}")
    n = int(mesh.shape[axis])
    if kind == "embed":
        sizes = ((layer.features,), layer.num_embeddings)
    else:
        sizes = (tuple(slices) if slices else (layer.out_features,), layer.in_features)
    problem = split_problem(kind, LAYOUTS[kind][0], sizes[0], sizes[1], n, n)
    if problem is not None:
        raise ValueError(f"cannot split the plain {kind} layer over {n} devices: {problem}")
    layout = LAYOUTS[kind][0]
    perm = column_permutation(sizes[0], n) if kind == "column" and len(sizes[0]) > 1 and n > 1 else None
    for name, var in _base_vars(layer).items():
        value = var.get_value()
        if perm is not None:
            value = jnp.take(value, jnp.asarray(perm), axis={"kernel": 1, "bias": 0}[name])
        dim = _SPLIT_DIMS[layout][name]
        var.set_value(jax.device_put(value, NamedSharding(mesh, _spec(value.ndim, axis,
                                                                      None if dim is None else dim % value.ndim))))


def shard_model(model: nnx.Module, mesh: Mesh, plan: Mapping[str, tuple], *, axis: str = AXIS, tokens: int = 64,
                layouts: Mapping[str, str] | None = None) -> dict:
    """Splits every layer of `model` that `plan` names over `axis` of `mesh`.

    plan: {layer name (last part of the dotted path): (kind, slices or None)}. Multi-LoRA layers go
    through `shard_layer` (layout from `layouts` by path or last name, else `choose_layout` at
    `tokens` tokens), plain nnx.Linear / nnx.Embed through `shard_plain_layer`. Layers already split
    are left alone; a multi-LoRA layer whose base is already on `mesh` (split as a plain layer
    before adapters were added) gets only its adapter variables placed. Every other array variable
    is replicated on the mesh. Layer-stacked LoRA banks (jax_lora.lora_bank) are first given back
    to their layers (`jax_lora.nn.unstack_lora_layers`, logged): split layers keep per-layer,
    per-device adapter blocks. Returns {path: layout or "plain"} for the layers split now.
    """
    if lnn.unstack_lora_layers(model):
        _LOG.info("shard_model: the layer-stacked LoRA banks are split back into per-layer variables (a layer "
                  "split over a mesh holds its own adapter blocks)")
    layouts = dict(layouts or {})
    done = {}
    inside = [p for p, node in nnx.iter_graph(model) if isinstance(node, lnn.LORA_LAYER_TYPES)]
    for path, node in list(nnx.iter_graph(model)):
        if not path:
            continue
        name, leaf = ".".join(str(p) for p in path), str(path[-1])
        if leaf not in plan or any(tuple(path[:len(p)]) == tuple(p) and len(p) < len(path) for p in inside):
            continue
        kind, slices = plan[leaf]
        if isinstance(node, lnn.LORA_LAYER_TYPES):
            if node.tp is not None:
                continue
            tp = shard_layer(node, mesh, kind=kind, layout=layouts.get(name, layouts.get(leaf)), axis=axis,
                             tokens=tokens, base_placed=_is_placed(node.base, mesh))
            done[name] = tp.layout
        elif isinstance(node, (nnx.Linear, nnx.Embed)):
            if _is_placed(node, mesh):
                continue
            shard_plain_layer(node, mesh, kind=kind, slices=slices, axis=axis)
            done[name] = "plain"
    _replicate_rest(model, mesh)
    return done


def _replicate_rest(model: nnx.Module, mesh: Mesh) -> None:
    """Every array variable of `model` not yet on `mesh` (norms, layers outside the plan) is
    replicated on it, so a step's parameters all live on the mesh's devices."""
    replicated = NamedSharding(mesh, P())
    for _, node in nnx.iter_graph(model):
        if not isinstance(node, nnx.Variable):
            continue
        value = node.get_value()
        if isinstance(value, jax.Array) and not (isinstance(value.sharding, NamedSharding)
                                                 and value.sharding.mesh == mesh):
            node.set_value(jax.device_put(value, replicated))


def _is_placed(layer, mesh: Mesh) -> bool:
    value = next(iter(_base_vars(layer).values())).get_value()
    sharding = getattr(value, "sharding", None)
    return isinstance(sharding, NamedSharding) and sharding.mesh == mesh


def slot_sharding(layer, name: str) -> NamedSharding | None:
    """The sharding of one slot of variable `name` (the slot axis removed), None for an unsplit layer."""
    tp = getattr(layer, "tp", None)
    if tp is None:
        return None
    ndim = getattr(layer, name).get_value().ndim
    slot_axis = type(layer).slot_axis[name]
    dim = tp.split_dim(name, ndim)
    if dim is not None and dim > slot_axis:
        dim -= 1
    return NamedSharding(tp.mesh, _spec(ndim - 1, tp.axis, dim))


def place_slot_value(layer, name: str, value: np.ndarray):
    """One slot's host value of variable `name`, ready for the slot write: for a split layer,
    permuted like the layer's stored columns and put on the mesh with the slot's sharding (each
    device receives its block only); for an unsplit layer, the value itself."""
    tp = getattr(layer, "tp", None)
    if tp is None:
        return value
    value = np.asarray(value)
    if tp.kind == "column" and name == "lora_b" and len(layer.output_slices) > 1 and tp.size > 1:
        value = value[column_permutation(layer.output_slices, tp.size)]
    return jax.device_put(value, slot_sharding(layer, name))


# ----------------------------------------------------------------------------- the calls, per device

def _dot(base: nnx.Linear, x: jax.Array, kernel: jax.Array) -> jax.Array:
    """nnx.Linear's product without its bias: x (..., in) @ kernel (in, out) in the base's dtype rules."""
    x, kernel, _ = base.promote_dtype((x, kernel, None), dtype=base.dtype)
    kwargs = {}
    if getattr(base, "preferred_element_type", None) is not None:
        kwargs["preferred_element_type"] = base.preferred_element_type
    return base.dot_general(x, kernel, (((x.ndim - 1,), (0,)), ((), ())), precision=base.precision, **kwargs)


def _add_bias(base: nnx.Linear, y: jax.Array, bias) -> jax.Array:
    if bias is None:
        return y
    (bias,) = base.promote_dtype((bias,), dtype=base.dtype)
    return y + bias.reshape((1,) * (y.ndim - 1) + (-1,))


def _b_slices(b: jax.Array, widths: Sequence[int]) -> tuple:
    out, off = [], 0
    for w in widths:
        out.append(b[:, off:off + w, :])
        off += w
    return tuple(out)


def _local_ranks(tp: TensorParallel, ranks: jax.Array, local_rank: int) -> jax.Array:
    """Each slot's rank inside this device's rank rows [d r/n, (d+1) r/n) (column_gather)."""
    start = lax.axis_index(tp.axis) * local_rank
    return jnp.clip(ranks - start, 0, local_rank).astype(jnp.int32)


def _shard_map(tp: TensorParallel, body, in_specs, out_specs):
    # The operands of the manual computation are exactly the arrays the call passes: the body is
    # traced as a function of its own (jax.jit), so the array constants its ops create stay inside
    # it instead of becoming operands of the shard_map. A constant can be zero-sized (the index
    # array of a scatter over whole axes), and XLA does not compile a manual computation that reads
    # a zero-sized operand (jaxlib 0.11 crashes in Shardy's canonicalization).
    # check_vma=False: the kernels (pallas_call, callbacks, custom calls) carry no varying-axis
    # types; the specs below state what is split and what is replicated.
    return jax.shard_map(jax.jit(body), mesh=tp.mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)


def _bias_or_none(layer):
    b = layer.base.bias
    return None if b is None else b.get_value()


def _column_call(tp: TensorParallel, layer, x: jax.Array, punica) -> jax.Array:
    """Column-parallel MultiLoRALinear: x (..., H) replicated -> y (..., N) split along N (stored
    shard-major). Local: y_d = x W_d + b_d, then LoRA with the slices' local widths n_s / n."""
    n, lead = tp.size, x.shape[:-1]
    widths = tuple(w // n for w in layer.output_slices)
    count = len(widths)
    bias = _bias_or_none(layer)
    base = layer.base

    def body(w, x, kernel, bias, a, b, ranks):
        x2 = x.reshape(-1, x.shape[-1])
        y = _add_bias(base, _dot(base, x2, kernel), bias)
        lora_a = tuple(a[s] for s in range(count))
        if tp.layout == "column":
            y = w.add_lora_linear(y, x2, lora_a, _b_slices(b, widths), None, 1.0, widths, lora_ranks=ranks)
        else:
            r_local = a.shape[2]
            buf = w.add_shrink(jnp.zeros((count, x2.shape[0], r_local), jnp.float32), x2, lora_a, 1.0,
                               lora_ranks=_local_ranks(tp, ranks, r_local))
            buf = lax.all_gather(buf, tp.axis, axis=2, tiled=True)              # (S, T, r)
            y = w.add_expand(y, buf, _b_slices(b, widths), None, widths, 0, True, lora_ranks=ranks)
        return y.reshape(lead + (y.shape[-1],))

    a, b, ranks = layer.lora_a.get_value(), layer.lora_b.get_value(), layer.lora_ranks.get_value()
    kernel = base.kernel.get_value()
    specs = (P(), P(), tp.spec("kernel", 2), P() if bias is None else tp.spec("bias", 1),
             tp.spec("lora_a", a.ndim), tp.spec("lora_b", b.ndim), P())
    return _shard_map(tp, body, specs, _spec(len(lead) + 1, tp.axis, len(lead)))(
        punica, x, kernel, bias, a, b, ranks)


def _row_call(tp: TensorParallel, layer, x: jax.Array, punica) -> jax.Array:
    """Row-parallel MultiLoRALinear: x (..., K) split along K -> y (..., N) replicated.
    Local: partial y_d = x_d W_d; LoRA (layout) into it; y = psum(y_d) + bias."""
    n, lead = tp.size, x.shape[:-1]
    width = layer.out_features
    bias = _bias_or_none(layer)
    base = layer.base

    def body(w, x, kernel, bias, a, b, ranks):
        x2 = x.reshape(-1, x.shape[-1])
        y = _dot(base, x2, kernel)                                              # partial sum (T, N)
        if tp.layout == "row_partial":
            y = w.add_lora_linear(y, x2, (a[0],), (b,), None, 1.0, (width,), lora_ranks=ranks)
        else:
            buf = w.add_shrink(jnp.zeros((1, x2.shape[0], a.shape[2]), jnp.float32), x2, (a[0],), 1.0,
                               lora_ranks=ranks)
            buf = lax.psum(buf, tp.axis)                                        # (1, T, r), complete
            cols = width // n
            delta = w.add_expand(jnp.zeros((x2.shape[0], cols), jnp.float32), buf, (b,), None, (cols,), 0, True,
                                 lora_ranks=ranks)
            placed = lax.dynamic_update_slice(jnp.zeros((x2.shape[0], width), jnp.float32), delta,
                                              (0, lax.axis_index(tp.axis) * cols))
            y = (y.astype(jnp.float32) + placed).astype(y.dtype)
        y = _add_bias(base, lax.psum(y, tp.axis), bias)
        return y.reshape(lead + (width,))

    a, b, ranks = layer.lora_a.get_value(), layer.lora_b.get_value(), layer.lora_ranks.get_value()
    kernel = base.kernel.get_value()
    specs = (P(), _spec(x.ndim, tp.axis, x.ndim - 1), tp.spec("kernel", 2), P(),
             tp.spec("lora_a", a.ndim), tp.spec("lora_b", b.ndim), P())
    return _shard_map(tp, body, specs, P())(punica, x, kernel, bias, a, b, ranks)


def _embed_call(tp: TensorParallel, layer, ids: jax.Array, punica) -> jax.Array:
    """Vocab-parallel MultiLoRAEmbed: ids (...) replicated -> (..., D) replicated. Device d looks up
    the tokens in its rows [d V/n, (d+1) V/n) (zero rows elsewhere), base and LoRA-A, expands its
    LoRA rows into its partial y, and the psum of y completes both."""
    n, vocab, lead = tp.size, layer.num_embeddings, ids.shape
    rows_per = vocab // n
    base = layer.base
    t = int(np.prod(lead)) if lead else 1

    def body(w, ids, table, a, b, ranks):
        flat = ids.reshape(-1).astype(jnp.int32)
        local = flat - lax.axis_index(tp.axis) * rows_per
        inside = ((local >= 0) & (local < rows_per))[:, None]
        safe = jnp.clip(local, 0, rows_per - 1)
        (table,) = base.promote_dtype((table,), dtype=base.dtype, inexact=False)
        y = jnp.where(inside, jnp.take(table, safe, axis=0), jnp.zeros((), table.dtype))
        offsets = w.embeddings_indices[1]
        if offsets.shape[0] < t:
            raise ValueError(f"ids has {t} tokens but the wrapper's mapping has {offsets.shape[0]}")
        slot = offsets[:t] // vocab
        lora_table = a.reshape(-1, a.shape[-1])                                 # (L * V/n, r)
        lora_rows = jnp.take(lora_table, slot * rows_per + safe, axis=0, mode="clip")
        lora_rows = jnp.where(inside, lora_rows, jnp.zeros((), lora_rows.dtype))
        y = w.add_lora_embedding(y, lora_rows.astype(y.dtype), b, lora_ranks=ranks)
        return lax.psum(y, tp.axis).reshape(lead + (y.shape[-1],))

    a, b, ranks = layer.lora_a.get_value(), layer.lora_b.get_value(), layer.lora_ranks.get_value()
    specs = (P(), P(), tp.spec("embedding", 2), tp.spec("lora_a", a.ndim), tp.spec("lora_b", b.ndim), P())
    return _shard_map(tp, body, specs, P())(punica, ids, base.embedding.get_value(), a, b, ranks)


def _logits_call(tp: TensorParallel, layer, h: jax.Array, punica) -> jax.Array:
    """Vocab-parallel MultiLoRALogits: h (R, H) replicated -> logits (R, V) split along V. Rows are
    routed by the wrapper's sampler indices (add_lora_logits). column_gather shrinks this device's
    rank rows with the sampled rows' metadata, all-gathers the buffer, and expands."""
    lead = h.shape[:-1]
    bias = _bias_or_none(layer)
    base = layer.base

    def body(w, h, kernel, bias, a, b, ranks):
        h2 = h.reshape(-1, h.shape[-1])
        y = _add_bias(base, _dot(base, h2, kernel), bias)
        if tp.layout == "column":
            y = w.add_lora_logits(y, h2, a, b, 1.0, lora_ranks=ranks)
        else:
            impl = dispatch.load_backend(w.backend)
            r_local = a.shape[1]
            buf = impl.shrink(h2, (a,), w.prompt_meta, 1.0, _local_ranks(tp, ranks, r_local))
            buf = lax.all_gather(buf, tp.axis, axis=2, tiled=True)              # (1, R, r)
            y = impl.expand(buf, (b,), y, w.prompt_meta, (0,), True, ranks)
        return y.reshape(lead + (y.shape[-1],))

    a, b, ranks = layer.lora_a.get_value(), layer.lora_b.get_value(), layer.lora_ranks.get_value()
    rows = int(np.prod(lead)) if lead else 1
    if rows > punica.max_num_batched_tokens:
        raise ValueError(f"h has {rows} rows, more than the wrapper's max_num_batched_tokens="
                         f"{punica.max_num_batched_tokens}")
    specs = (P(), P(), tp.spec("kernel", 2), P() if bias is None else tp.spec("bias", 1),
             tp.spec("lora_a", a.ndim), tp.spec("lora_b", b.ndim), P())
    return _shard_map(tp, body, specs, _spec(len(lead) + 1, tp.axis, len(lead)))(
        punica, h, base.kernel.get_value(), bias, a, b, ranks)

