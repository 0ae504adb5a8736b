"""PEFT LoRA adapters for torch_lora: reading, placement into multi-LoRA layers, and the slot manager.

Reading is framework-free and shared with the JAX side: `load_peft_adapter` IS
`lora_core.peft.load_peft_adapter` (same checks, same `AdapterError` messages; safetensors only,
`adapter_model.bin` is refused). It returns a `PeftAdapter` of NumPy factors; `adapter_tensors`
gives them as torch tensors.

Placement: `prepare_adapter(layers, adapter)` checks every module of the adapter against the
multi-LoRA layers (`torch_lora.layers`) and lays it out on the host in slot order: zero-padded to
the layers' max_rank, scaling folded into B, in the layers' dtype, in one pinned buffer when the
layers are on CUDA (so uploads are asynchronous copies). A DoRA adapter (PEFT's use_dora) also gets
each DoRA layer's column scale g = m / ||W + s B A||_row (`dora_scales`, from the layer's base
weights), which the layers need `dora=True` to hold. A `LoRALinear` (or the LM head's `LoRALogits`,
a `LoRAEmbedding`: its table per token row, or a `LoRAExperts`: per expert and row) with
`lora_dtype="fp8"` gets its slices quantised to e4m3 per output channel (contract section 11:
scale = amax / 448, the cast rounds to nearest even), or, for an adapter read from an fp8 PEFT file
(`PeftAdapter.fp8`), the file's e4m3 values and scales as they are (B's scale times the module's
scaling; expert factors are never read from fp8 files).

`AdapterManager` owns the slots: adapters are registered under a LoRA id, `activate(ids)` puts a
batch's adapters into slots (free slots first, then the least recently used slot the batch does not
need), prepared adapters are kept in a host LRU cache. On CUDA, slot writes run on a side stream
ordered by events (see `AdapterManager`), never reallocating a slot tensor, so CUDA graphs captured
once stay valid across loads, evictions and hot swaps.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Mapping

import numpy as np
import torch

from lora_core import checks, dora
from lora_core.adapter_slots import SlotTable
from lora_core.peft import (  # noqa: F401  (CONFIG_NAME, WEIGHTS_NAME: the file names, for callers)
    CONFIG_NAME,
    WEIGHTS_NAME,
    AdapterError,
    LoraModule,
    ModuleShape,
    PeftAdapter,
    load_peft_adapter,
    save_peft_adapter,
)

from .experts import LoRAExperts
from .layers import LoRAEmbedding, LoRALinear, LoRALogits
from .parallel import loading as parallel_loading
from .parallel.layer import ParallelLoRALayer

__all__ = [
    "AdapterError",
    "AdapterManager",
    "PeftAdapter",
    "PreparedAdapter",
    "adapter_tensors",
    "dora_scales",
    "load_peft_adapter",
    "module_shapes",
    "prepare_adapter",
    "save_peft_adapter",
]

_LAYER_TYPES = (LoRALinear, LoRAEmbedding, LoRALogits, LoRAExperts, ParallelLoRALayer)


def _is_fp8_layer(layer) -> bool:
    return isinstance(layer, (LoRALinear, LoRAEmbedding, LoRALogits, LoRAExperts)) and layer.lora_dtype == "fp8"


def _layer_dtype(layer) -> torch.dtype:
    if isinstance(layer, LoRAExperts):
        return layer.gu_a.dtype
    return layer.dtype if isinstance(layer, ParallelLoRALayer) else layer.lora_a.dtype


def adapter_tensors(adapter: PeftAdapter, *, device=None, dtype: torch.dtype = torch.float32) -> dict:
    """{module name: LoraModule(lora_a, lora_b, scaling, kind)} with the factors as torch tensors.

    lora_a (r, in) / lora_b (out, r) for a linear module, (r, vocab) / (dim, r) for an embedding;
    scaling not applied (multiply the product by it, as PEFT does).
    """
    if not isinstance(adapter, PeftAdapter):
        raise TypeError(f"adapter must be a PeftAdapter (from load_peft_adapter), got {type(adapter).__name__}")
    return {name: LoraModule(torch.as_tensor(m.lora_a, dtype=dtype, device=device),
                             torch.as_tensor(m.lora_b, dtype=dtype, device=device), m.scaling, m.kind)
            for name, m in adapter.modules.items()}


# ----------------------------------------------------------------------------- placement

@dataclasses.dataclass
class PreparedAdapter:
    """An adapter laid out for the slots, on the host.

    tensors: {layer path: tuple of tensors}, in the order of that layer's `slot_views` (shapes equal
      to one slot's); absent for layers the adapter does not touch (their slot is zeroed).
    ranks: {layer path: the adapter's rank there} (the largest over a fused layer's slices), every
      layer present, 0 where the adapter has nothing.
    scales: {layer path: (out_features,) float32 DoRA column scale} for the DoRA layers (dora=True)
      a DoRA adapter touches; absent elsewhere (those layers' slots get ones).
    """

    name: str
    tensors: dict
    ranks: dict
    nbytes: int
    scales: dict = dataclasses.field(default_factory=dict)

    @property
    def max_rank(self) -> int:
        return max(self.ranks.values(), default=0)


def _check_layers(layers) -> dict:
    if not isinstance(layers, Mapping) or not layers:
        raise TypeError(f"layers must be a non-empty mapping {{path: LoRALinear | LoRAEmbedding | LoRALogits}}, "
                        f"got {type(layers).__name__}{' (empty)' if isinstance(layers, Mapping) else ''}")
    for path, layer in layers.items():
        if not isinstance(layer, _LAYER_TYPES):
            raise TypeError(f"layers[{path!r}] must be a LoRALinear, LoRAEmbedding, LoRALogits or a "
                            f"torch_lora.parallel layer, got {type(layer).__name__}")
        if isinstance(layer, ParallelLoRALayer) and len(layer.module_names) != layer.num_slices:
            raise ValueError(f"layers[{path!r}] is a tensor-parallel layer with {layer.num_slices} output "
                             f"slice(s): set its module_names to the PEFT module name of each slice "
                             f"(got {layer.module_names!r})")
    return dict(layers)


def _module_index(layers: Mapping) -> dict:
    """{module name: (layer path, slice)} over every layer's module_names."""
    index = {}
    for path, layer in layers.items():
        for s, module in enumerate(layer.module_names):
            if module in index:
                raise ValueError(f"module {module!r} is held by two LoRA layers: {index[module][0]!r} and {path!r}")
            index[module] = (path, s)
    return index


def module_shapes(layers: Mapping) -> dict:
    """{module name: lora_core.peft.ModuleShape} of every module the layers hold: what an adapter
    file's header is checked against before its tensors are read."""
    layers = _check_layers(layers)
    out = {}
    for module, (path, s) in _module_index(layers).items():
        layer = layers[path]
        if isinstance(layer, ParallelLoRALayer):
            shard = layer.slice_shards[s]
            out[module] = ModuleShape("embedding" if shard.a_table else "linear", shard.full_in, shard.full_out,
                                      layer.max_rank)
        elif isinstance(layer, LoRALinear):
            out[module] = ModuleShape("linear", layer.in_features, layer.output_slices[s], layer.max_rank)
        elif isinstance(layer, LoRAExperts):
            out[module] = ModuleShape("experts", layer.in_features[s], layer.out_features[s], layer.max_rank,
                                      layer.num_experts)
        elif isinstance(layer, LoRAEmbedding):
            out[module] = ModuleShape("embedding", layer.num_embeddings, layer.embedding_dim, layer.max_rank)
        else:
            out[module] = ModuleShape("linear", layer.in_features, layer.out_features, layer.max_rank)
    return out


def prepare_adapter(layers: Mapping, adapter: PeftAdapter, *, pin_memory: bool = False) -> PreparedAdapter:
    """Checks `adapter` against the multi-LoRA `layers` and lays it out on the host in slot order.

    layers: {path: LoRALinear | LoRAEmbedding | LoRALogits}; each layer's module_names say which
    adapter modules it takes. Per touched layer the tensors are (see each layer's `slot_views`):
    LoRALinear A_s (max_rank, H) per slice then B_s (n_s, max_rank); LoRAEmbedding A (V, max_rank)
    (lora_embedding_A transposed) and B (D, max_rank); LoRALogits A (max_rank, H) and B (V, max_rank).
    Ranks below max_rank are zero-padded; B holds the module's scaling (and an embedding's
    embed_scale). Everything sits in one buffer per dtype, pinned when `pin_memory`.

    A DoRA adapter's column scales (`dora_scales`) come along in `scales`, float32.

    Raises AdapterError naming the adapter, the module, the expected and the received shapes: a
    module no layer holds, a rank above max_rank, a linear adapter on an embedding (or the reverse),
    factors that do not fit the module, a saved base layer of another shape (a resized vocabulary),
    a DoRA module on a layer without DoRA support. Nothing is written to any slot here.
    """
    layers = _check_layers(layers)
    if not isinstance(adapter, PeftAdapter):
        raise TypeError(f"adapter must be a PeftAdapter (from load_peft_adapter), got {type(adapter).__name__}")
    index = _module_index(layers)
    arrays: dict = {}
    exact: dict = {}                 # (path, part): (e4m3 values, scales) of an fp8 file's module
    ranks = dict.fromkeys(layers, 0)
    for module, (a, b, scaling, kind) in sorted(adapter.modules.items()):
        where = index.get(module)
        if where is None:
            raise AdapterError(checks.unknown_adapter_module(adapter.label, module, index))
        path, s = where
        layer = layers[path]
        rank = int(a.shape[-2])
        if rank > layer.max_rank:
            raise AdapterError(f"adapter {adapter.label}, module {module!r}: rank {rank} exceeds the model's "
                               f"max_rank={layer.max_rank}; wrap the model with max_rank >= {rank}")
        _check_base_layer(layer, s, module, adapter)
        with np.errstate(over="ignore", invalid="ignore"):     # non-finite results: refused below, by name
            _place_module(arrays, path, layer, s, module, adapter, a, b, scaling, kind, rank)
        ranks[path] = max(ranks[path], rank)
        if _is_fp8_layer(layer) and module in adapter.fp8 and not isinstance(layer, LoRAExperts):
            _keep_fp8(exact, path, layer, s, adapter.fp8[module], scaling, rank)
    _check_placed_values(arrays, layers, adapter)
    for path, layer in layers.items():
        if _is_fp8_layer(layer) and path in arrays:
            arrays[path], arrays[(path, "fp8")] = _quantize_parts(path, arrays[path], exact)
    scales = dora_scales(layers, adapter)
    for path, g in scales.items():
        checks.check_dora_scale(adapter.label, path, g)
    tensors, nbytes = _pack(layers, {**arrays, **{(path, "dora"): [g] for path, g in scales.items()}}, pin_memory)
    scale_tensors = {path: tensors.pop((path, "dora"))[0] for path in scales}
    for path in [key[0] for key in tensors if isinstance(key, tuple) and key[1] == "fp8"]:
        tensors[path] = tensors[path] + tensors.pop((path, "fp8"))      # slot_views' order: weights, scales
    return PreparedAdapter(adapter.name, tensors, ranks, nbytes, scale_tensors)


def _check_base_layer(layer, s: int, module: str, adapter: PeftAdapter) -> None:
    """Refuses an adapter whose saved copy of `module`'s base layer (PEFT keeps one for a targeted
    embedding / LM head) has another shape than the model's: a resized vocabulary."""
    saved = adapter.base_layer_shapes.get(module)
    if saved is not None:
        if isinstance(layer, ParallelLoRALayer):
            sh = layer.slice_shards[s]
            expect = (sh.full_in, sh.full_out) if sh.a_table else (sh.full_out, sh.full_in)
        else:
            expect = ((layer.num_embeddings, layer.embedding_dim) if isinstance(layer, LoRAEmbedding)
                      else (layer.out_features, layer.in_features))
        if tuple(saved) != expect:
            raise AdapterError(f"adapter {adapter.label} was trained on a {module!r} of shape {tuple(saved)} "
                               f"(resized vocabulary?), the model's is {expect}")


def _place_module(arrays: dict, path: str, layer, s: int, module: str, adapter: PeftAdapter, a, b, scaling: float,
                  kind: str, rank: int) -> None:
    """Writes one adapter module's factors (A (rank, in), B (out, rank)) into `arrays[path]` in the
    layer's slot layout (see prepare_adapter), zero-padded to max_rank, scaling folded into B;
    refuses factors of the wrong kind or shape for the layer."""
    r = layer.max_rank
    if isinstance(layer, LoRAExperts):
        if kind != "experts":
            raise AdapterError(f"adapter {adapter.label}: {module!r} holds {kind} factors but the model's module is "
                               f"a 3-D expert weight (expected target_parameters factors)")
        want_a = (layer.num_experts, rank, layer.in_features[s])
        want_b = (layer.num_experts, layer.out_features[s], rank)
        if tuple(a.shape) != want_a or tuple(b.shape) != want_b:
            raise AdapterError(f"adapter {adapter.label}, module {module!r}: expert factors {a.shape} / {b.shape} do "
                               f"not fit the experts: expected A {want_a} and B {want_b}")
        out = arrays.setdefault(path, [np.zeros(v.shape, np.float32) for v in layer.slot_views(0)[:4]])
        out[2 * s][:, :rank] = a
        out[2 * s + 1][:, :, :rank] = b * scaling
    elif isinstance(layer, ParallelLoRALayer):
        _place_shard(arrays, path, layer, s, module, adapter, a, b, scaling, kind, rank)
    elif isinstance(layer, LoRALinear):
        if kind != "linear":
            raise AdapterError(f"adapter {adapter.label}: {module!r} holds embedding factors but the model's "
                               f"module is a linear layer")
        width = layer.output_slices[s]
        if a.shape[1] != layer.in_features or b.shape[0] != width:
            raise AdapterError(f"adapter {adapter.label}, module {module!r}: lora_A {a.shape} / lora_B {b.shape} "
                               f"do not fit the module: expected lora_A ({rank}, {layer.in_features}) and "
                               f"lora_B ({width}, {rank})")
        n = len(layer.module_names)
        out = arrays.setdefault(path, [np.zeros((r, layer.in_features), np.float32) for _ in range(n)]
                                + [np.zeros((w, r), np.float32) for w in layer.output_slices])
        out[s][:rank] = a
        out[n + s][:, :rank] = b * scaling
    elif isinstance(layer, LoRAEmbedding):
        if kind != "embedding":
            raise AdapterError(f"adapter {adapter.label}: {module!r} holds linear factors (lora_A / lora_B) but "
                               "the model's module is an embedding")
        if a.shape[1] != layer.num_embeddings or b.shape[0] != layer.embedding_dim:
            raise AdapterError(f"adapter {adapter.label}, module {module!r}: lora_embedding_A {a.shape} / "
                               f"lora_embedding_B {b.shape} do not fit the embedding: expected ({rank}, "
                               f"{layer.num_embeddings}) and ({layer.embedding_dim}, {rank})")
        A = np.zeros((layer.num_embeddings, r), np.float32)
        B = np.zeros((layer.embedding_dim, r), np.float32)
        A[:, :rank] = a.T
        B[:, :rank] = b * (scaling * layer.embed_scale)
        arrays[path] = [A, B]
    else:
        if kind != "linear":
            raise AdapterError(f"adapter {adapter.label}: {module!r} holds embedding factors but the model's "
                               "module is the LM head (a linear layer)")
        if a.shape[1] != layer.in_features or b.shape[0] != layer.out_features:
            raise AdapterError(f"adapter {adapter.label}, module {module!r}: lora_A {a.shape} / lora_B {b.shape} "
                               f"do not fit the LM head: expected ({rank}, {layer.in_features}) and "
                               f"({layer.out_features}, {rank})")
        A = np.zeros((r, layer.in_features), np.float32)
        B = np.zeros((layer.out_features, r), np.float32)
        A[:rank] = a
        B[:, :rank] = b * scaling
        arrays[path] = [A, B]


def _keep_fp8(exact: dict, path: str, layer, s: int, factors, scaling: float, rank: int) -> None:
    """Records an fp8 file's module for slice s of an fp8 layer (a LoRALinear, the LM head's
    LoRALogits or a LoRAEmbedding: one slice) as it is: A's e4m3 values and channel scales, B's
    values (out, rank) and row scales times the module's scaling (B holds the scaling; an
    embedding's B its embed_scale too), zero-padded to the layer's max_rank (padding rows of A get
    scale 1). An embedding's A is its table lora_embedding_A.T (vocab, rank) with the file's one
    scale per token row."""
    r = layer.max_rank
    if isinstance(layer, LoRAEmbedding):
        a_q = np.zeros((layer.num_embeddings, r), np.float32)
        a_q[:, :rank] = factors.a_q.T
        exact[(path, 0)] = (a_q, factors.a_scale)
        b_q = np.zeros((layer.embedding_dim, r), np.float32)
        b_q[:, :rank] = factors.b_q
        exact[(path, 1)] = (b_q, (factors.b_scale.astype(np.float64) * (scaling * layer.embed_scale))
                            .astype(np.float32))
        return
    n = len(layer.module_names)
    a_q = np.zeros((r, layer.in_features), np.float32)
    a_q[:rank] = factors.a_q
    a_scale = np.ones(r, np.float32)
    a_scale[:rank] = factors.a_scale
    width = layer.out_features if isinstance(layer, LoRALogits) else layer.output_slices[s]
    b_q = np.zeros((width, r), np.float32)
    b_q[:, :rank] = factors.b_q
    exact[(path, s)] = (a_q, a_scale)
    exact[(path, n + s)] = (b_q, (factors.b_scale.astype(np.float64) * scaling).astype(np.float32))


def _quantize_parts(path: str, parts: list, exact: dict) -> tuple:
    """(values to store, float32 per-row scales) of an fp8 layer's placed float32 parts (A_0..,
    B_0.. as `_place_module` lays them out; an expert layer's (E, rows, cols) parts per expert and
    row, scales (E, rows)): contract section 11's rule per output channel, scale
    = amax / 448 (1 for an all-zero row), values clip(w / scale, -448, 448), which the e4m3 cast in
    `_pack` rounds to nearest even; an fp8 file's module (`exact`) is kept as it is."""
    values, scales = [], []
    for i, p in enumerate(parts):
        if (path, i) in exact:
            q, scale = exact[(path, i)]
        else:
            amax = np.abs(p).max(axis=-1) if p.size else np.zeros(p.shape[:-1], np.float32)
            scale = np.where(amax == 0, 1.0, amax / checks.FP8_MAX).astype(np.float32)
            q = np.clip(p / scale[..., None], -checks.FP8_MAX, checks.FP8_MAX).astype(np.float32)
        values.append(q)
        scales.append(scale)
    return values, scales


def _check_placed_values(arrays: dict, layers: Mapping, adapter: PeftAdapter) -> None:
    """Refuses placed factors that hold NaN / infinities or overflow their layer's dtype (the check
    JAX's placement runs too: lora_core.checks.check_placed_adapter)."""
    for path, parts in arrays.items():
        # fp8 layers: the float32 factors before quantisation (their scales keep every value in range)
        dtype = torch.float32 if _is_fp8_layer(layers[path]) else _layer_dtype(layers[path])
        checks.check_placed_adapter(adapter.label, path, parts, dtype)


def dora_scales(layers: Mapping, adapter: PeftAdapter) -> dict:
    """{layer path: (out_features,) float32 DoRA column scale} for every LoRALinear that `adapter`'s
    DoRA modules touch, ones at the columns of its other members:
    g = m / ||W + s B A||_row per member module (lora_core.dora.column_scale, float64), with W that
    member's base weight (out, in) (`LoRALinear.base_weights`; PEFT's fan_in_fan_out layouts are
    refused when the adapter is read). Empty for a plain LoRA adapter.

    A LoRALinear built without dora=True but with its base_weights (as MultiLoRAModel builds them) is
    given its scales all the same: the manager allocates the layer's dora_scale when it writes the
    adapter (`LoRALinear.enable_dora`). Raises AdapterError naming the adapter and the module when a
    DoRA module lands in a layer that cannot scale (a LoRALinear without base_weights, the LM head,
    an embedding, a tensor-parallel layer), or when g is undefined (an all-zero row of W + s B A).
    Modules no layer holds are left to prepare_adapter's message."""
    if not adapter.magnitudes:
        return {}
    layers = _check_layers(layers)
    index = _module_index(layers)
    out: dict = {}
    for module, m in sorted(adapter.magnitudes.items()):
        where = index.get(module)
        if where is None:
            continue
        path, s = where
        layer = layers[path]
        if not isinstance(layer, LoRALinear):
            what = ("a tensor-parallel LoRA layer" if isinstance(layer, ParallelLoRALayer) else
                    "the LM head" if isinstance(layer, LoRALogits) else "an embedding")
            raise AdapterError(f"adapter {adapter.label} is a DoRA adapter (use_dora) with a magnitude on {module!r}, "
                               f"which is {what} ({path!r}): DoRA is served on linear layers only (LoRALinear "
                               "with dora=True)")
        if layer.base_weights is None:
            raise AdapterError(f"adapter {adapter.label} is a DoRA adapter (use_dora; module {module!r}), but LoRA "
                               f"layer {path!r} has no base weights to compute its column scale from: build it with "
                               "LoRALinear(..., base_weights=[each member's weight]) (MultiLoRAModel does, except over "
                               "quantized modules, whose weights are not float: DoRA needs a float base)")
        a, b, scaling, _kind = adapter.modules[module]
        weight = layer.base_weights[s].detach().to("cpu", torch.float64).numpy()        # (n_s, H)
        try:
            g = dora.column_scale(weight, a, b, scaling, m)
        except ValueError as e:
            raise AdapterError(f"adapter {adapter.label}, module {module!r}: {e}") from None
        off, width = layer.offsets[s], layer.output_slices[s]
        out.setdefault(path, np.ones(layer.out_features, np.float32))[off:off + width] = g
    return out


def _place_shard(arrays: dict, path: str, layer: ParallelLoRALayer, s: int, module: str, adapter: PeftAdapter,
                 a: np.ndarray, b: np.ndarray, scaling: float, kind: str, rank: int) -> None:
    """This rank's shard of one module's factors into `arrays[path]` (the layer's slot_views order,
    zero elsewhere): torch_lora.parallel.loading's cut, so the host cache and the slots never hold
    another rank's part of an adapter."""
    shard = layer.slice_shards[s]
    table = shard.a_table
    if kind != ("embedding" if table else "linear"):
        raise AdapterError(f"adapter {adapter.label}: {module!r} holds {kind} factors but the model's module is "
                           f"{'an embedding' if table else 'a linear layer'}")
    if a.shape[1] != shard.full_in or b.shape[0] != shard.full_out:
        raise AdapterError(f"adapter {adapter.label}, module {module!r}: factors {a.shape} / {b.shape} do not fit "
                           f"the module: expected ({rank}, {shard.full_in}) and ({shard.full_out}, {rank})")
    out = arrays.setdefault(path, [np.zeros(sh.a_shape, np.float32) for sh in layer.slice_shards]
                            + [np.zeros((sh.b_rows, layer.max_rank), np.float32) for sh in layer.slice_shards])
    a_piece, b_piece, _ = parallel_loading.shard_cut(shard, a, b)
    if a_piece is not None:
        out[s][: a_piece.shape[0], : a_piece.shape[1]] = a_piece
    if b_piece is not None:
        out[layer.num_slices + s][: b_piece.shape[0], :rank] = b_piece * scaling


def _pack(layers: Mapping, arrays: Mapping, pin_memory: bool) -> tuple:
    """Copies the host arrays into one (pinned) torch buffer per dtype; returns ({key: views}, bytes).
    A key is a layer path (the layer's dtype) or (path, "dora"), a DoRA column scale (float32)."""
    def dtype_of(key):
        return torch.float32 if isinstance(key, tuple) else _layer_dtype(layers[key])

    sizes: dict = collections.Counter()
    for path, parts in arrays.items():
        sizes[dtype_of(path)] += sum(p.size for p in parts)
    buffers = {dtype: torch.empty(n, dtype=dtype, pin_memory=pin_memory) for dtype, n in sizes.items()}
    used: dict = collections.Counter()
    out = {}
    for path, parts in arrays.items():
        dtype = dtype_of(path)
        views = []
        for p in parts:
            view = buffers[dtype][used[dtype]:used[dtype] + p.size].view(p.shape)
            view.copy_(torch.from_numpy(p))
            used[dtype] += p.size
            views.append(view)
        out[path] = tuple(views)
    return out, sum(b.numel() * b.element_size() for b in buffers.values())


# ----------------------------------------------------------------------------- the slot manager

class AdapterManager(SlotTable):
    """Owns the adapter slots of a set of multi-LoRA layers.

    Args:
      layers: {path: LoRALinear | LoRAEmbedding | LoRALogits}, all with one max_loras and on one
        device (torch_lora.hf.MultiLoRAModel builds them). Their buffers are written in place: a
        slot gets the adapter's factors and ranks, and in a DoRA layer (LoRALinear(dora=True)) its
        column scales (ones for a plain LoRA adapter and for a freed slot).
      host_cache_size: prepared adapters kept on the host (LRU; pinned on CUDA) so that a reload
        skips the disk.

    Adapters are registered under a LoRA id (int > 0) from a directory or a PeftAdapter;
    `activate(ids)` puts them into slots; `lora_index_to_id` is the wrapper's slot table (the
    registry, LRU slots and host cache are lora_core.adapter_slots.SlotTable's, shared with JAX).

    Adapter directories are untrusted: their headers are checked against the layers' modules
    (`module_shapes(layers)`) before any tensor data is read, and all of an adapter's tensors against
    `max_adapter_bytes` (attribute; None: the model's largest adapter).

    Threads: every method holds `lock` (a threading.RLock) around the registry, host cache and slot
    table, so concurrent callers never corrupt them; `register` reads files before taking it. A
    thread that runs a step on the slots holds `with manager.lock:` across `activate` and the step
    (another thread's activate may evict its slots).

    Pinning: `pin(adapter)` / `unpin(adapter)` (a LoRA id or a registered name) keep an adapter in its
    slot whatever the LRU would evict (lora_core.adapter_slots, "Pinning").

    Slot writes on CUDA. A write (load, eviction, hot swap, unload) is enqueued on the manager's
    upload stream: that stream first waits on an event recorded on the current stream at the time of
    the write, i.e. after every step already enqueued there (eager kernels or a CUDA graph replay),
    so a step in flight never sees a half-written slot; then the copies from pinned host memory run
    and an event is recorded after them. `wait_uploads()` makes the current stream wait on that
    event: call it before launching the next step that reads the slots (MultiLoRAModel.prepare_step
    does). The host never blocks. Slot tensors are never reallocated, so graphs captured once
    replay with the current adapters. On CPU the writes are plain copies.
    """

    def __init__(self, layers: Mapping, *, host_cache_size: int = 8):
        self.layers = _check_layers(layers)
        slots = {layer.max_loras for layer in self.layers.values()}
        if len(slots) != 1:
            raise ValueError(f"the LoRA layers disagree on max_loras: {sorted(slots)}")
        devices = {layer.lora_ranks.device for layer in self.layers.values()}
        if len(devices) != 1:
            raise ValueError(f"the LoRA layers are on several devices: {sorted(map(str, devices))}")
        _module_index(self.layers)                      # no module held twice
        super().__init__(slots.pop(), host_cache_size=host_cache_size)
        self.device = devices.pop()
        self._pin = self.device.type == "cuda"
        self._upload_stream = torch.cuda.Stream(self.device) if self._pin else None
        self._uploaded: torch.cuda.Event | None = None

    def wait_uploads(self, stream: torch.cuda.Stream | None = None) -> None:
        """Makes `stream` (the current one by default) wait until every slot write enqueued so far has
        run. No host synchronisation; nothing to do on CPU."""
        if self._uploaded is not None:
            (stream if stream is not None else torch.cuda.current_stream(self.device)).wait_event(self._uploaded)

    # -------------------------------------------------------------- SlotTable's framework part
    def _module_shapes(self) -> dict:
        return module_shapes(self.layers)

    def _prepare_uncounted(self, adapter: PeftAdapter) -> PreparedAdapter:
        return prepare_adapter(self.layers, adapter, pin_memory=self._pin)

    def _largest_rank(self, prepared: PreparedAdapter) -> int:
        return prepared.max_rank

    def _write_slot(self, slot: int, prepared: PreparedAdapter | None) -> None:
        """Writes `prepared` (or zeros and rank 0 when None) into `slot` of every layer: on CUDA
        enqueued on the upload stream after the steps already enqueued (see the class docstring).
        The first DoRA adapter written into a LoRALinear built without dora=True allocates its
        dora_scale first (ones, on the current stream, so the upload below is ordered after it)."""
        if prepared is not None:
            for path in sorted(prepared.scales):
                layer = self.layers[path]
                if not layer.dora:
                    if self._upload_stream is not None and torch.cuda.is_current_stream_capturing():
                        raise RuntimeError("adapter slots cannot be written while a CUDA graph is being captured; "
                                           "load adapters before capturing or between replays")
                    layer.enable_dora()
                    self.stats["dora_layers_enabled"] += 1
        if self._upload_stream is None:
            self._copy(slot, prepared)
            return
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError("adapter slots cannot be written while a CUDA graph is being captured; load "
                               "adapters before capturing or between replays")
        after_steps = torch.cuda.Event()
        after_steps.record(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._upload_stream):
            self._upload_stream.wait_event(after_steps)
            self._copy(slot, prepared)
            done = torch.cuda.Event()
            done.record(self._upload_stream)
        self._uploaded = done

    def _copy(self, slot: int, prepared: PreparedAdapter | None) -> None:
        non_blocking = self._upload_stream is not None
        for path, layer in self.layers.items():
            host = None if prepared is None else prepared.tensors.get(path)
            views = layer.slot_views(slot)
            if host is None:
                for view in views:
                    view.zero_()
            else:
                for view, src in zip(views, host):
                    view.copy_(src, non_blocking=non_blocking)
            if getattr(layer, "dora", False):               # DoRA column scale: 1 unless a DoRA adapter
                g = None if prepared is None else prepared.scales.get(path)
                if g is None:
                    layer.dora_scale[slot].fill_(1.0)
                else:
                    layer.dora_scale[slot].copy_(g, non_blocking=non_blocking)
            rank = 0 if prepared is None else prepared.ranks[path]
            layer.lora_ranks[slot].fill_(rank)
            if isinstance(layer, LoRAExperts):              # no expert LoRA in the slot: its pairs cost nothing
                layer.adapter_enabled[slot].fill_(int(host is not None))
            if isinstance(layer, ParallelLoRALayer):
                layer.lora_ranks_local[slot].fill_(parallel_loading.local_rank(layer.slice_shards[0], rank))
