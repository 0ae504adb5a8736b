"""PEFT LoRA adapters in a Flax model: slot placement, and a slot manager with an LRU cache.

Reading an adapter directory is framework-free and lives in `lora_core.peft` (re-exported here:
`load_peft_adapter`, `save_peft_adapter`, `PeftAdapter`, `AdapterError`); it returns the adapter's
NumPy weights with each module's scaling, which `prepare_adapter` folds into B so the layers run
with scale 1.

Placement: `prepare_adapter(model, adapter)` checks every tensor against the model's multi-LoRA layers
(jax_lora.nn) and returns host arrays in slot layout, zero-padded to the layers' max_rank (ranks
differ between adapters; padding changes no result). `AdapterManager` owns the model's slots: it
loads adapters on demand (host LRU cache, then disk), evicts the least recently used slot not needed
by the current batch, and writes a slot with one jitted update whose shapes never change, so
load / unload / hot-swap never recompile the serving step. For layers split over a mesh
(jax_lora.parallel), a slot's weights go to each device as that device's block only.

fp8 storage: `AdapterManager(model, lora_dtype="fp8")` (or layers built with lora_dtype="fp8")
keeps the linear layers', the LM head's, the embeddings' and the experts' adapter weights in e4m3
with float32 scales. A 16-bit (or float32) PEFT adapter is quantised when it is prepared, after
its scaling is folded into B: per row c of each placed weight (an output channel; a token's row of
an embedding's table A.T (V, r); an expert stack's rows per expert),
scale[c] = amax(|w[c, :]|) / 448 (1 for an all-zero row),
w_q = e4m3(clip(w / scale[c], -448, 448)) (jax_lora.quant.quantize_rows); the host cache holds the
quantised form. An fp8 PEFT file's linear, LM-head and embedding modules (`PeftAdapter.fp8`) keep
the file's e4m3 values and scales as they are (B's scales times the module's scaling). The scales
are arrays of fixed shape beside the weights, so the serving step is still compiled once per bucket.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from lora_core import checks, dora
from lora_core.adapter_slots import SlotTable
from lora_core.peft import (  # noqa: F401  (CONFIG_NAME, WEIGHTS_NAME: the file names, for callers)
    CONFIG_NAME,
    WEIGHTS_NAME,
    AdapterError,
    ModuleShape,
    PeftAdapter,
    load_peft_adapter,
    save_peft_adapter,
)
from lora_core.peft.experts import EXPERT_KIND

from . import nn as lnn
from . import parallel
from .lora_bank import LoRABank
from .moe import MoEExperts
from .quant import QuantizedLinear, quantize_rows

EXPERT_PARAMS = ("gate_up_proj", "down_proj")
_LOG = logging.getLogger("jax_lora")

__all__ = [
    "AdapterError",
    "AdapterManager",
    "PeftAdapter",
    "load_peft_adapter",
    "merge_adapter",
    "module_shapes",
    "prepare_adapter",
    "adapter_ranks",
    "save_peft_adapter",
]


# ----------------------------------------------------------------------------- placement

def _module_index(layers: Mapping[str, nnx.Module], packed: Mapping[str, Sequence[str]], num_slices) -> dict:
    """{Hugging Face module name: (layer path, slice index)} of the model's layers.

    A layer whose last path part is a packed name (`packed_modules_mapping`, e.g. qkv_proj ->
    q_proj, k_proj, v_proj) with one output slice per member holds the members' names, one per
    slice; any other single-slice layer holds its own path. A fused layer's own name (qkv_proj of a
    layer with q / k / v slices) names no module: an adapter targeting it is refused, never placed
    into its first slice. A MultiLoRAExperts layer holds its parameters' names, `<path>.gate_up_proj`
    (0) and `<path>.down_proj` (1), PEFT's target_parameters names (lora_core.peft.experts).
    num_slices(path, layer) -> the layer's number of output slices."""
    index = {}
    for path, layer in layers.items():
        head, _, leaf = path.rpartition(".")
        n = num_slices(path, layer)
        subs = tuple(packed.get(leaf) or ())
        if isinstance(layer, lnn.MultiLoRAExperts):         # its two 3-D parameters, by name
            names = [f"{path}.{param}" for param in EXPERT_PARAMS]
        elif subs and len(subs) == n:
            names = [f"{head}.{sub}" if head else sub for sub in subs]
        else:
            names = [path] if n == 1 else []
        for s, name in enumerate(names):
            if name in index:
                raise ValueError(f"module {name!r} is held by two LoRA layers: {index[name][0]!r} and {path!r}")
            index[name] = (path, s)
    return index


def _lora_index(model: nnx.Module, layers: Mapping[str, nnx.Module]) -> dict:
    """_module_index of the model's multi-LoRA layers."""
    packed = getattr(model, "packed_modules_mapping", {}) or {}
    return _module_index(layers, packed, lambda _path, layer: len(getattr(layer, "output_slices", (0,))))


def module_shapes(model: nnx.Module) -> dict:
    """{module name: lora_core.peft.ModuleShape} of every module the model's multi-LoRA layers hold:
    what an adapter file's header is checked against before its tensors are read."""
    layers = lnn.lora_layers(model)
    out = {}
    for module, (path, s) in _lora_index(model, layers).items():
        layer = layers[path]
        if isinstance(layer, lnn.MultiLoRAExperts):
            out[module] = ModuleShape(EXPERT_KIND, *_expert_dims(layer, s), layer.max_rank, layer.num_experts)
        elif isinstance(layer, lnn.MultiLoRALinear):
            out[module] = ModuleShape("linear", layer.in_features, layer.output_slices[s], layer.max_rank)
        elif isinstance(layer, lnn.MultiLoRAEmbed):
            out[module] = ModuleShape("embedding", layer.num_embeddings, layer.features, layer.max_rank)
        else:
            out[module] = ModuleShape("linear", layer.in_features, layer.out_features, layer.max_rank)
    return out


def _expert_dims(layer, s: int) -> tuple[int, int]:
    """(in_features, out_features) of a MultiLoRAExperts layer's parameter s (gate_up_proj: H -> 2I,
    down_proj: I -> H), in Hugging Face's (experts, out, in) orientation."""
    base = layer.base
    return ((base.hidden_size, 2 * base.intermediate_size) if s == 0
            else (base.intermediate_size, base.hidden_size))


def _experts_zeros(layer) -> dict:
    """A MultiLoRAExperts layer's slot data, zeros (adapter_enabled 0: the slot's pairs cost nothing)."""
    e, r, h, i = layer.num_experts, layer.max_rank, layer.base.hidden_size, layer.base.intermediate_size
    return {"w13_lora_a": np.zeros((2, e, r, h), np.float32), "w13_lora_b": np.zeros((2, e, i, r), np.float32),
            "w2_lora_a": np.zeros((e, r, i), np.float32), "w2_lora_b": np.zeros((e, h, r), np.float32),
            "adapter_enabled": np.int32(0)}


def _place_experts(adapter: PeftAdapter, module: str, layer, s: int, slot: dict, a, b, scaling, kind) -> None:
    """One kind "experts" module (A (E, r, in), B (E, out, r)) into a MultiLoRAExperts slot: gate_up's
    A in both w13 slices and B's halves (gate rows first), down's into w2; scaling folded into B."""
    if kind != EXPERT_KIND:
        raise AdapterError(f"adapter {adapter.label}: {module!r} is an expert parameter, but the adapter holds "
                           f"{kind} weights for it")
    in_f, out_f = _expert_dims(layer, s)
    e, rank = layer.num_experts, a.shape[1]
    if a.shape != (e, rank, in_f) or b.shape != (e, out_f, rank):
        raise AdapterError(f"adapter {adapter.label}, module {module!r}: lora_A {a.shape} / lora_B {b.shape} do not "
                           f"fit the experts: expected ({e}, r, {in_f}) and ({e}, {out_f}, r)")
    if rank > layer.max_rank:
        raise AdapterError(f"adapter {adapter.label}, module {module!r}: rank {rank} exceeds the model's "
                           f"max_rank={layer.max_rank}; rebuild the LoRA layers with max_rank >= {rank}")
    with np.errstate(over="ignore", invalid="ignore"):
        bs = (b * scaling).astype(np.float32)
    if s == 0:
        i = layer.base.intermediate_size
        slot["w13_lora_a"][:, :, :rank] = a[None]
        slot["w13_lora_b"][0, :, :, :rank] = bs[:, :i]
        slot["w13_lora_b"][1, :, :, :rank] = bs[:, i:]
    else:
        slot["w2_lora_a"][:, :rank] = a
        slot["w2_lora_b"][:, :, :rank] = bs
    slot["adapter_enabled"] = np.int32(1)


def prepare_adapter(model: nnx.Module, adapter: PeftAdapter) -> dict:
    """Checks `adapter` against the model's multi-LoRA layers and returns slot data on the host.

    Returns {layer path: (A, B)} with every layer of the model present (zeros where the adapter has
    nothing): MultiLoRALinear A (S, max_rank, in), B (out, max_rank); MultiLoRAEmbed A (vocab,
    max_rank), B (dim, max_rank); MultiLoRALogits A (max_rank, in), B (vocab, max_rank);
    MultiLoRAExperts {variable name: one slot's value} (`_experts_zeros`). Scaling is folded into B.
    Raises AdapterError naming the module, expected and received shapes.
    """
    layers = lnn.lora_layers(model)
    if not layers:
        raise AdapterError(f"{type(model).__name__} has no multi-LoRA layers: call add_lora / "
                           "jax_lora.nn.replace_lora_layers first")
    index = _lora_index(model, layers)
    out = {}
    for path, layer in layers.items():
        r = layer.max_rank
        if isinstance(layer, lnn.MultiLoRAExperts):
            out[path] = _experts_zeros(layer)
        elif isinstance(layer, lnn.MultiLoRALinear):
            out[path] = (np.zeros((len(layer.output_slices), r, layer.in_features), np.float32),
                         np.zeros((layer.out_features, r), np.float32))
        elif isinstance(layer, lnn.MultiLoRAEmbed):
            out[path] = (np.zeros((layer.num_embeddings, r), np.float32),
                         np.zeros((layer.features, r), np.float32))
        else:
            out[path] = (np.zeros((r, layer.in_features), np.float32),
                         np.zeros((layer.out_features, r), np.float32))
    for module, (a, b, scaling, kind) in adapter.modules.items():
        where = index.get(module)
        if where is None:
            raise AdapterError(checks.unknown_adapter_module(adapter.label, module, index))
        path, s = where
        layer = layers[path]
        if isinstance(layer, lnn.MultiLoRAExperts):
            _place_experts(adapter, module, layer, s, out[path], a, b, scaling, kind)
            continue
        if kind == EXPERT_KIND:
            raise AdapterError(f"adapter {adapter.label}: {module!r} holds expert weights but {path!r} is not an "
                               "experts layer")
        rank = a.shape[0]
        saved = adapter.base_layer_shapes.get(module)
        if saved is not None:
            expect = ((layer.num_embeddings, layer.features) if isinstance(layer, lnn.MultiLoRAEmbed)
                      else (layer.out_features, layer.in_features))
            if tuple(saved) != expect:
                raise AdapterError(f"adapter {adapter.label} was trained on a {module!r} of shape {saved} "
                                   f"(resized vocabulary?), the model's is {expect}")
        if rank > layer.max_rank:
            raise AdapterError(f"adapter {adapter.label}, module {module!r}: rank {rank} exceeds the model's "
                               f"max_rank={layer.max_rank}; rebuild the LoRA layers with max_rank >= {rank}")
        A, B = out[path]
        with np.errstate(over="ignore", invalid="ignore"):     # non-finite results: refused below, by name
            bs = (b * scaling).astype(np.float32)
        if isinstance(layer, lnn.MultiLoRALinear):
            if kind != "linear":
                raise AdapterError(f"adapter {adapter.label}: {module!r} is an embedding adapter but "
                                   f"{path!r} is a linear layer")
            width = layer.output_slices[s]
            off = sum(layer.output_slices[:s])
            if a.shape[1] != layer.in_features or b.shape[0] != width:
                raise AdapterError(f"adapter {adapter.label}, module {module!r}: lora_A {a.shape} / lora_B "
                                   f"{b.shape} do not fit the layer: expected lora_A ({rank}, "
                                   f"{layer.in_features}) and lora_B ({width}, {rank})")
            A[s, :rank] = a
            B[off:off + width, :rank] = bs
        elif isinstance(layer, lnn.MultiLoRAEmbed):
            if kind != "embedding":
                raise AdapterError(f"adapter {adapter.label}: {module!r} holds linear weights but {path!r} "
                                   "is an embedding")
            if a.shape[1] != layer.num_embeddings or b.shape[0] != layer.features:
                raise AdapterError(f"adapter {adapter.label}, module {module!r}: lora_embedding_A {a.shape} / "
                                   f"lora_embedding_B {b.shape} do not fit the embedding: expected "
                                   f"({rank}, {layer.num_embeddings}) and ({layer.features}, {rank})")
            A[:, :rank] = a.T
            B[:, :rank] = bs
        else:
            if kind != "linear":
                raise AdapterError(f"adapter {adapter.label}: {module!r} is an embedding adapter but "
                                   f"{path!r} is the LM head")
            if a.shape[1] != layer.in_features or b.shape[0] != layer.out_features:
                raise AdapterError(f"adapter {adapter.label}, module {module!r}: lora_A {a.shape} / lora_B "
                                   f"{b.shape} do not fit the LM head: expected ({rank}, {layer.in_features}) "
                                   f"and ({layer.out_features}, {rank})")
            A[:rank] = a
            B[:, :rank] = bs
    for path, parts in out.items():             # the check torch's placement runs too
        if isinstance(parts, dict):
            # fp8 experts hold the factors quantised with a float32 scale: their range is float32's
            dtype = "float32" if _is_fp8(layers[path]) else layers[path].w13_lora_a.get_value().dtype
            parts = [v for k, v in parts.items() if k != "adapter_enabled"]
        else:
            # fp8 layers hold the factors quantised with a float32 scale: their range is float32's
            dtype = "float32" if _is_fp8(layers[path]) else layers[path].lora_a.dtype
        checks.check_placed_adapter(adapter.label, path, parts, dtype)
    return out


def _is_fp8(layer) -> bool:
    return getattr(layer, "lora_dtype", None) == "fp8"


def quantize_prepared(model: nnx.Module, placed: dict, adapter: PeftAdapter | None = None) -> dict:
    """prepare_adapter's {path: (A, B)} with the fp8 layers' entries quantised per row (an output
    channel; a token's row of an embedding's table): (A_q (S, r, in) e4m3, or an embedding's (V, r),
    B_q (out, r) e4m3, a_scale (S, r) or (V,), b_scale (out,) float32) (jax_lora.quant.quantize_rows);
    an fp8 MultiLoRAExperts layer's entry (a dict) gets each stack quantised per expert and row, its
    scales under `<stack>_scale`; other layers' entries unchanged. `adapter`, when given and read
    from an fp8 PEFT file
    (`adapter.fp8`): its modules' rows hold the file's e4m3 values and scales as they are (B's
    scales times the module's scaling, which B holds), not a requantisation of the dequantised
    values (a row's quantisation depends on that row alone, so the other rows are unchanged)."""
    layers = lnn.lora_layers(model)
    out = dict(placed)
    for path, parts in placed.items():
        if _is_fp8(layers[path]) and isinstance(parts, dict):
            quantised = dict(parts)
            for name in lnn.MultiLoRAExperts.STACKS:
                quantised[name], quantised[f"{name}_scale"] = quantize_rows(parts[name])
            out[path] = quantised
        elif _is_fp8(layers[path]):
            (qa, sa), (qb, sb) = quantize_rows(parts[0]), quantize_rows(parts[1])
            out[path] = (qa, qb, sa, sb)
    if adapter is not None and adapter.fp8:
        index = _lora_index(model, layers)
        for module, factors in adapter.fp8.items():
            path, s = index[module]
            if _is_fp8(layers[path]):
                _keep_fp8(layers[path], s, factors, adapter.modules[module].scaling, out[path])
    return out


def _keep_fp8(layer, s: int, factors, scaling: float, quantised: tuple) -> None:
    """Writes an fp8 file's module (lora_core.peft.Fp8Factors) as it is into slice s of a quantised
    entry (A_q, B_q, a_scale, b_scale) of `quantize_prepared`, in place: A's rows (an embedding's
    table A.T, one row per token id) and their scales, B's rows with scale * scaling."""
    qa, qb, sa, sb = quantised
    rank = factors.a_q.shape[0]
    fp8 = qa.dtype
    b_scale = (factors.b_scale.astype(np.float64) * scaling).astype(np.float32)
    if isinstance(layer, lnn.MultiLoRAEmbed):
        qa[:, :rank], sa[:] = factors.a_q.T.astype(fp8), factors.a_scale
        rows = slice(0, layer.features)
    elif isinstance(layer, lnn.MultiLoRALinear):
        qa[s, :rank], sa[s, :rank] = factors.a_q.astype(fp8), factors.a_scale
        off = sum(layer.output_slices[:s])
        rows = slice(off, off + layer.output_slices[s])
    else:
        qa[:rank], sa[:rank] = factors.a_q.astype(fp8), factors.a_scale
        rows = slice(0, layer.out_features)
    qb[rows, :rank], sb[rows] = factors.b_q.astype(fp8), b_scale


def dora_scales(model: nnx.Module, adapter: PeftAdapter) -> dict:
    """{layer path: (out,) float32 DoRA column scale} for every MultiLoRALinear that `adapter`'s DoRA
    modules touch (ones at the columns of its other members): g = m / ||W + s B A||_row per member
    module (lora_core.dora.column_scale) with W the layer's base kernel at that member's columns.
    Empty for a plain LoRA adapter. A layer built without dora=True is given to it all the same:
    the AdapterManager adds the layer's scale when it writes the adapter (`enable_dora`). Raises
    AdapterError when a DoRA module lands in an embedding, the LM head, a layer split over a mesh or
    a quantized layer."""
    layers = lnn.lora_layers(model)
    index = _lora_index(model, layers)
    out: dict = {}
    for module, m in sorted(adapter.magnitudes.items()):
        where = index.get(module)
        if where is None:
            continue                                   # prepare_adapter names unknown modules
        path, s = where
        layer = layers[path]
        quantized = isinstance(layer, lnn.MultiLoRALinear) and isinstance(layer.base, QuantizedLinear)
        if not isinstance(layer, lnn.MultiLoRALinear) or layer.tp is not None or quantized:
            what = ("a quantized layer (its column scale reads a float kernel)" if quantized else
                    "a layer split over a mesh" if isinstance(layer, lnn.MultiLoRALinear) else
                    "an embedding" if isinstance(layer, lnn.MultiLoRAEmbed) else "the LM head")
            raise AdapterError(f"adapter {adapter.label} is a DoRA adapter (use_dora) with a magnitude on {module!r}, "
                               f"which is {what} ({path!r}): DoRA is served on unsplit float linear layers only")
        out.setdefault(path, np.ones(layer.out_features, np.float32))
        a, b, scaling, _kind = adapter.modules[module]
        off, width = sum(layer.output_slices[:s]), layer.output_slices[s]
        kernel = np.asarray(layer.base.kernel[...], np.float64)[:, off:off + width]        # (in, n_s)
        try:
            out[path][off:off + width] = dora.column_scale(kernel.T, a, b, scaling, m)
        except ValueError as e:
            raise AdapterError(f"adapter {adapter.label}, module {module!r}: {e}") from None
    for path in sorted({index[module][0] for module in adapter.magnitudes if module in index}):
        checks.check_dora_scale(adapter.label, path, out[path])
    return out


def adapter_ranks(model: nnx.Module, adapter: PeftAdapter) -> dict:
    """{layer path: the adapter's rank there} for every multi-LoRA layer of the model: the largest
    rank among the adapter's modules placed in that layer (the slices of a fused layer may differ,
    with PEFT's rank_pattern), 0 where the adapter has nothing. Call after `prepare_adapter` has
    validated the adapter against the model."""
    layers = lnn.lora_layers(model)
    index = _lora_index(model, layers)
    ranks = dict.fromkeys(layers, 0)
    for module, (a, _b, _scaling, _kind) in adapter.modules.items():
        where = index.get(module)
        if where is not None:
            ranks[where[0]] = max(ranks[where[0]], int(a.shape[-2]))        # (E,) r, in
    return ranks


def _slot_variables(layer) -> tuple:
    """The names of a multi-LoRA layer's per-slot variables, in the order AdapterManager writes them."""
    if isinstance(layer, lnn.MultiLoRAExperts):
        return tuple(n for n in type(layer).slot_axis if _is_fp8(layer) or not n.endswith("_scale"))
    return (("lora_a", "lora_b", "lora_ranks") + (("lora_scale",) if getattr(layer, "dora", False) else ())
            + (("lora_a_scale", "lora_b_scale") if _is_fp8(layer) else ()))


def _largest_rank(prepared: tuple) -> int:
    """An adapter's largest rank from its prepared slot data (the per-layer ranks)."""
    return max(prepared[1].values(), default=0)


def _write_slot_impl(arrays, slot, new, axes):
    """arrays[i] with index `slot` along axes[i] replaced by new[i] (shapes never change)."""
    out = []
    for arr, n, ax in zip(arrays, new, axes):
        idx = (slice(None),) * ax + (slot,)
        out.append(arr.at[idx].set(n.astype(arr.dtype)))
    return tuple(out)


_write_slot = jax.jit(_write_slot_impl, static_argnames=("axes",), donate_argnums=(0,))


class AdapterManager(SlotTable):
    """Owns the adapter slots of a model with multi-LoRA layers.

    Args:
      model: the NNX model (after add_lora / replace_lora_layers). Its LoRA layers' variables are
        updated in place (new arrays of the same shapes); `version` increases with every write.
      host_cache_size: adapters kept prepared on the host (LRU) so a reload skips the disk.
      lora_dtype: None (each layer's storage as built) or "fp8": every MultiLoRALinear, the
        MultiLoRALogits and every MultiLoRAEmbed store their adapter weights in e4m3 with float32
        scales, per output channel (an embedding's table: per row) (`use_fp8`; new variables, so
        build the manager before the serving step is first traced); adapters are quantised when
        prepared (module docstring); so do the MultiLoRAExperts layers (per expert and output
        channel).

    Adapters are registered under a LoRA id (int > 0) from a directory or a PeftAdapter;
    `activate(ids)` puts them into slots; `lora_index_to_id` is the wrapper's slot table (the
    registry, LRU slots and host cache are lora_core.adapter_slots.SlotTable's, shared with torch).

    Adapter directories are untrusted: their headers are checked against the model's modules
    (`module_shapes(model)`) before any tensor data is read, and all of an adapter's tensors against
    `max_adapter_bytes` (attribute; None: the model's largest adapter).

    Threads: every method holds `lock` (a threading.RLock) around the registry, host cache and slot
    table, so concurrent callers never corrupt them; `register` reads files before taking it. A
    thread that runs a step on the slots holds `with manager.lock:` across `activate` and the step
    (another thread's activate may evict its slots).

    Pinning: `pin(adapter)` / `unpin(adapter)` (a LoRA id or a registered name) keep an adapter in its
    slot whatever the LRU would evict (lora_core.adapter_slots, "Pinning").
    """

    def __init__(self, model: nnx.Module, *, host_cache_size: int = 8, lora_dtype=None):
        self.model = model
        self.layers = lnn.lora_layers(model)
        if not self.layers:
            raise AdapterError(f"{type(model).__name__} has no multi-LoRA layers")
        self.lora_dtype = lnn.check_lora_dtype(lora_dtype)
        if lora_dtype == "fp8":
            for layer in self.layers.values():
                layer.use_fp8()
        slots = {l.max_loras for l in self.layers.values()}
        if len(slots) != 1:
            raise AdapterError(f"the model's LoRA layers disagree on max_loras: {sorted(slots)}")
        super().__init__(slots.pop(), host_cache_size=host_cache_size)
        self._paths = sorted(self.layers)
        self._path_by_id = {id(self.layers[p]): p for p in self._paths}
        self._list_variables()
        self.layout_version = 0             # +1 each time a layer gains variables (a DoRA scale)
        self._shapes = module_shapes(model)

    def _list_variables(self) -> None:
        """The variables a slot write updates, as (owner, variable name) with owner a layer or a shared
        LoRABank (jax_lora.lora_bank); the layer paths whose values each holds (a layer's own path, a
        bank's layers' in its layer order); their slot axes (a bank's one more: its leading axis is
        the layer)."""
        entries, banks = [], set()
        for p in self._paths:
            layer = self.layers[p]
            if not getattr(layer, "banked", False):
                entries += [(layer, n, (p,)) for n in _slot_variables(layer)]
            elif id(layer.bank) not in banks:
                banks.add(id(layer.bank))
                members = sorted((q for q in self._paths if getattr(self.layers[q], "banked", False)
                                  and self.layers[q].bank is layer.bank), key=lambda q: self.layers[q].layer_index)
                if [self.layers[q].layer_index for q in members] != list(range(layer.bank.num_layers)):
                    raise AdapterError(f"the LoRA bank of {p!r} holds {layer.bank.num_layers} layers, but the model's "
                                       f"LoRA layers sharing it are {members}")
                entries += [(layer.bank, n, tuple(members)) for n in layer.bank.names()]
        self._vars = [(owner, n) for owner, n, _paths in entries]
        self._var_paths = [paths for _owner, _n, paths in entries]
        self._axes = tuple(lnn.MultiLoRALinear.slot_axis[n] + 1 if isinstance(owner, LoRABank)
                           else type(owner).slot_axis[n] for owner, n in self._vars)

    # -------------------------------------------------------------- SlotTable's framework part
    def _module_shapes(self) -> dict:
        return self._shapes

    def _prepare_uncounted(self, adapter: PeftAdapter) -> tuple:
        """(prepare_adapter's {path: (A, B)}, adapter_ranks' {path: rank}, dora_scales' {path: g}): one
        slot's host data."""
        return (quantize_prepared(self.model, prepare_adapter(self.model, adapter), adapter),
                adapter_ranks(self.model, adapter), dora_scales(self.model, adapter))

    def _largest_rank(self, prepared: tuple) -> int:
        return _largest_rank(prepared)

    def _write_slot(self, slot: int, prepared: tuple | None) -> None:
        """One jitted update of every LoRA variable at `slot`: the adapter's weights and per-layer
        ranks, or zeros (rank 0: the kernels skip the slot) when prepared is None. The first DoRA
        adapter written into a layer built without dora=True gives that layer its column scale
        (`MultiLoRALinear.enable_dora`, ones in every slot) and bumps `layout_version`: the model's
        graph has a new variable, so a jitted step that takes it is compiled again, once."""
        if prepared is not None:
            added = [self.layers[p].enable_dora() for p in sorted(prepared[2])]
            if any(added):
                self.layout_version += 1
        # Listed now: the layers may have joined or left banks since (a model split over a mesh
        # gives its layers their own variables back), or gained variables (DoRA, fp8 scales).
        self._list_variables()
        new = []
        for (owner, n), paths, axis in zip(self._vars, self._var_paths, self._axes):
            shape = list(getattr(owner, n).get_value().shape)
            del shape[axis]
            if isinstance(owner, LoRABank):      # the bank's layers' values, stacked in its layer order
                new.append(np.stack([self._slot_value(self.layers[p], n, p, shape[1:], prepared) for p in paths]))
            else:
                new.append(self._slot_value(owner, n, paths[0], shape, prepared))
        old = tuple(getattr(owner, n).get_value() for owner, n in self._vars)
        if any(getattr(owner, "tp", None) is not None for owner, _n in self._vars):
            # Layers split over a mesh (jax_lora.parallel): each device receives its block of the slot.
            slot_dev = np.int32(slot)
            new_dev = tuple(v if isinstance(owner, LoRABank) else parallel.place_slot_value(owner, n, v)
                            for (owner, n), v in zip(self._vars, new))
        else:
            slot_dev, new_dev = jax.device_put((np.int32(slot), tuple(new)))
        updated = _write_slot(old, slot_dev, new_dev, axes=self._axes)
        for (owner, n), arr in zip(self._vars, updated):
            getattr(owner, n).set_value(arr)

    @staticmethod
    def _slot_value(layer, n: str, path: str, shape: list, prepared: tuple | None):
        """One layer's value of variable `n` at a slot (its shape without the slot axis): the
        adapter's, or an empty slot's (zeros; rank 0; scales 1)."""
        if n == "lora_scale":                  # an empty slot, a plain LoRA adapter, a layer it skips: 1
            g = None if prepared is None else prepared[2].get(path)
            return np.ones(shape, np.float32) if g is None else g
        if n in ("lora_a_scale", "lora_b_scale"):    # fp8 channel scales; an empty slot: 1
            return (np.ones(shape, np.float32) if prepared is None
                    else prepared[0][path][2 if n == "lora_a_scale" else 3])
        if isinstance(layer, lnn.MultiLoRAExperts) and n.endswith("_scale") and prepared is None:
            return np.ones(shape, np.float32)     # an empty slot's fp8 expert scales: 1
        if isinstance(layer, lnn.MultiLoRAExperts) and n != "lora_ranks":
            return (_experts_zeros(layer) if prepared is None else prepared[0][path])[n]
        if prepared is None:
            return np.zeros(shape, np.float32)
        if n == "lora_ranks":
            return np.int32(prepared[1][path])
        return prepared[0][path][0 if n == "lora_a" else 1]

# ----------------------------------------------------------------------------- merged weights (oracle)

def merge_adapter(model: nnx.Module, adapter: PeftAdapter) -> nnx.Module:
    """A copy of a plain model (no multi-LoRA layers) with `adapter` merged into its weights.

    W' = W + scaling * B @ A for linear layers (at the slice's columns of fused layers; for a DoRA
    module each row of W' then rescaled to its magnitude m: (m / ||W'||_row) * W'), and per expert
    W_e' = W_e + scaling * B_e @ A_e for the experts of a MoE layer (jax_lora.moe.MoEExperts),
    E' = E + scaling * A.T @ B.T for embeddings. Computed in float64. This is the test oracle; the
    serving path never merges.
    """
    merged = nnx.clone(model)
    modules = {".".join(str(p) for p in path): node for path, node in nnx.iter_graph(merged)
               if isinstance(node, (nnx.Linear, nnx.Embed))}
    packed = getattr(model, "packed_modules_mapping", {}) or {}
    slices = model.lora_slices() if hasattr(model, "lora_slices") else {}
    index = _module_index(modules, packed, lambda path, _layer: len(slices.get(path.rsplit(".", 1)[-1], (0,))))
    experts = {".".join(str(p) for p in path): node for path, node in nnx.iter_graph(merged)
               if isinstance(node, MoEExperts)}
    for path in experts:
        for s, param in enumerate(EXPERT_PARAMS):
            index[f"{path}.{param}"] = (path, s)
    for module, (a, b, scaling, _kind) in adapter.modules.items():
        where = index.get(module)
        if where is None:
            raise AdapterError(f"adapter {adapter.label} targets {module!r}, which the model does not have")
        path, s = where
        if path in experts:                  # W_e' = W_e + scaling * B_e @ A_e, stored (E, in, out)
            var = experts[path].gate_up_proj if s == 0 else experts[path].down_proj
            delta = scaling * np.einsum("eor,eri->eio", b.astype(np.float64), a.astype(np.float64))
            var.set_value(jnp.asarray(np.asarray(var.get_value(), np.float64) + delta, var.get_value().dtype))
            continue
        layer = modules[path]
        delta = scaling * (b.astype(np.float64) @ a.astype(np.float64))      # (out, in) / (dim, vocab)
        if isinstance(layer, nnx.Embed):
            e = np.asarray(layer.embedding.get_value(), np.float64) + delta.T
            layer.embedding.set_value(jnp.asarray(e, layer.embedding.get_value().dtype))
        else:
            k = np.asarray(layer.kernel.get_value(), np.float64)                   # (in, out)
            widths = slices.get(path.rsplit(".", 1)[-1], (k.shape[1],))
            off = sum(widths[:s])
            w = k[:, off:off + delta.shape[0]].T + delta                            # W' (n, in)
            if module in adapter.magnitudes:                                        # DoRA: rows to m / ||W'||
                m = adapter.magnitudes[module].astype(np.float64)
                w = w * (m / np.linalg.norm(w, axis=1))[:, None]
            k[:, off:off + delta.shape[0]] = w.T
            layer.kernel.set_value(jnp.asarray(k, layer.kernel.get_value().dtype))
    return merged
