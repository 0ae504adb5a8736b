"""`load_peft_adapter`: a PEFT adapter directory as NumPy factors and per-module scaling; `save_peft_adapter`."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import time
from collections.abc import Mapping
from typing import Any, NamedTuple

import numpy as np

from ..checks import unknown_adapter_module
from .config import (
    CONFIG_NAME,
    MAX_ADAPTER_BYTES,
    MAX_HEADER_BYTES,
    MAX_TENSOR_BYTES,
    PICKLE_NAME,
    TRAINING_STATE_TENSORS,
    WEIGHTS_NAME,
    AdapterError,
)
from .experts import (
    EXPERT_KIND,
    experts_shapes,
    group_expert_linears,
    join_expert_factors,
    parameter_of,
    per_expert_target,
    split_expert_factors,
)
from .files import read_adapter_config, resolve_adapter_file
from .patterns import MATCH_BUDGET_S, MAX_NAME_CHARS
from .safetensors_format import read_safetensors, read_safetensors_header

# ----------------------------------------------------------------------------- the adapter

class ModuleShape(NamedTuple):
    """What a model's LoRA module accepts, to check an adapter file's header against before reading:
    kind "linear" takes lora_A (r, in_features) and lora_B (out_features, r); kind "embedding"
    takes lora_embedding_A (r, in_features = vocabulary) and lora_embedding_B (out_features =
    embedding dim, r); kind "experts" (a 3-D expert weight, lora_core.peft.experts) takes per
    expert A (r, in_features) and B (out_features, r) for num_experts experts; r <= max_rank."""

    kind: str
    in_features: int
    out_features: int
    max_rank: int
    num_experts: int = 1


def largest_adapter_bytes(module_shapes: Mapping[str, ModuleShape]) -> int:
    """The bytes of the largest adapter a model takes: every module at its max_rank, in float64 (the
    widest dtype read), plus a DoRA magnitude (out_features,) per module. An adapter file within the
    model's shapes never holds more LoRA data than this."""
    return sum((m.num_experts * m.max_rank * (m.in_features + m.out_features) + m.out_features) * 8
               for m in module_shapes.values())


class LoraModule(NamedTuple):
    """One module's LoRA: lora_a (r, in) and lora_b (out, r) for a linear layer, lora_a (r, vocab) and
    lora_b (dim, r) for an embedding (kind "embedding"), lora_a (E, r, in) and lora_b (E, out, r)
    for a 3-D expert weight (kind "experts", one pair per expert); float32. scaling is not applied."""

    lora_a: np.ndarray
    lora_b: np.ndarray
    scaling: float
    kind: str

    @property
    def rank(self) -> int:
        return int(self.lora_a.shape[-2])


class Fp8Factors(NamedTuple):
    """An fp8 (e4m3) module of a PEFT file as it is stored (contract section 11): a_q (r, in) and
    b_q (out, r), the e4m3 values as float32 (exactly), and their per-channel float32 scales (a
    per-tensor scale broadcast to the channels). A linear module's a_scale (r,) is per row of a_q
    (a rank channel); an embedding's (kind "embedding": a_q is lora_embedding_A (r, vocab)) a_scale
    (vocab,) is per column of a_q, one per token id (the row of the table A.T a token looks up);
    b_scale (out,) is per row of b_q. The module's LoraModule holds the dequantised factors:
    a_q * a_scale[:, None] (an embedding's a_q * a_scale[None, :]), b_q * b_scale[:, None]."""

    a_q: np.ndarray
    a_scale: np.ndarray
    b_q: np.ndarray
    b_scale: np.ndarray


@dataclasses.dataclass
class PeftAdapter:
    """A LoRA adapter in PEFT terms, weights on the host as NumPy.

    modules: {module name in the base model (e.g. "model.layers.0.self_attn.q_proj"): LoraModule}
      (a named tuple: lora_a, lora_b, scaling, kind); each module has its own rank and scaling.
    config: adapter_config.json as decoded; base_layer_shapes: {module: shape} of the base weights
      PEFT saved beside an embedding / LM-head LoRA (their data is not read).
    """

    name: str
    r: int
    lora_alpha: float
    use_rslora: bool
    target_modules: Any
    modules: dict
    config: dict = dataclasses.field(default_factory=dict)
    base_layer_shapes: dict = dataclasses.field(default_factory=dict)
    path: str | None = None
    magnitudes: dict = dataclasses.field(default_factory=dict)
    """DoRA (use_dora): {module: its (out,) magnitude vector m, PEFT's lora_magnitude_vector};
    lora_core.dora turns it into the module's column scale. Empty for a plain LoRA adapter."""
    invocation_tokens: tuple | None = None
    """aLoRA (alora_invocation_tokens): the token ids from whose last occurrence in a request on the
    adapter applies (lora_core.alora); None for an adapter that applies to every token."""
    fp8: dict = dataclasses.field(default_factory=dict)
    """fp8 files (safetensors F8_E4M3 with `...lora_A.weight_scale` / `...lora_B.weight_scale`):
    {module: Fp8Factors} as stored, for layers that keep e4m3 weights (no requantisation); `modules`
    holds the same factors dequantised. Empty for a 16-bit adapter."""

    @property
    def label(self) -> str:
        """How error messages name the adapter: its name and, when read from disk, its directory."""
        return f"{self.name!r} ({self.path})" if self.path else repr(self.name)

    @property
    def max_rank(self) -> int:
        return max(m[0].shape[-2] for m in self.modules.values())

    @property
    def ranks(self) -> set:
        return {m[0].shape[-2] for m in self.modules.values()}

    @property
    def expert_modules(self) -> dict:
        """{parameter name: LoraModule} of the kind "experts" modules (empty: no expert LoRA)."""
        return {name: m for name, m in self.modules.items() if m.kind == EXPERT_KIND}


_KEY = re.compile(r"^(?P<module>.+?)\.(?P<kind>lora_A|lora_B|lora_embedding_A|lora_embedding_B)(?P<rest>(\.[^.]+)*)$")
_PAIRS = {"linear": ("lora_A", "lora_B"), "embedding": ("lora_embedding_A", "lora_embedding_B")}


def load_peft_adapter(path: str | os.PathLike, name: str | None = None, *, max_tensor_bytes: int = MAX_TENSOR_BYTES,
                      max_header_bytes: int = MAX_HEADER_BYTES, module_shapes: Mapping[str, ModuleShape] | None = None,
                      max_total_bytes: int | None = None) -> PeftAdapter:
    """Reads a PEFT LoRA adapter directory (adapter_config.json + adapter_model.safetensors).

    Everything is checked before tensor data is read: the config (see the module docstring), the
    files' real paths, the safetensors header, and every module: a lora_A / lora_B (or
    lora_embedding_A / lora_embedding_B) pair of 2-D tensors with one rank equal to the config's r
    for that module, on a module the config targets. Expert LoRA (lora_core.peft.experts): a
    target_parameters pair becomes a kind "experts" module named by its parameter; per-expert
    linear layers of a model whose module_shapes hold the experts fused are gathered into them.

    module_shapes: {module name: ModuleShape} of the model the adapter is for (the managers pass
      theirs). Given, every module of the header must be one of them, of its kind, with a rank
      <= its max_rank and A / B shapes that fit it, all before any tensor data is read, so a file
      declaring tensors larger than the model's layers is refused without reading or allocating them.
    max_total_bytes: the most bytes the LoRA tensors read may hold together (counted at the larger
      of their stored size and float32). None: `largest_adapter_bytes(module_shapes)` when
      module_shapes is given, else MAX_ADAPTER_BYTES.

    Returns float32 factors and each module's scaling. Raises AdapterError naming the file and the
    field or tensor.
    """
    directory = os.fspath(path)
    if not os.path.isdir(directory):
        raise AdapterError(f"{directory}: expected a PEFT adapter directory, got "
                           f"{'a file' if os.path.exists(directory) else 'nothing (no such path)'}")
    config, raw = read_adapter_config(directory)
    weights_path = os.path.join(directory, WEIGHTS_NAME)
    weights = resolve_adapter_file(directory, WEIGHTS_NAME)
    if weights is None:
        if os.path.lexists(os.path.join(directory, PICKLE_NAME)):
            raise AdapterError(f"{os.path.join(directory, PICKLE_NAME)}: a pickle, which can run code when loaded, so "
                               f"it is never read; only {WEIGHTS_NAME} is. Re-save the adapter with "
                               "save_pretrained(..., safe_serialization=True)")
        raise AdapterError(f"{weights_path}: missing ({CONFIG_NAME} is there)")
    header = read_safetensors_header(weights, max_header_bytes=max_header_bytes)
    parts, base_layers, magnitudes, weight_scales = _sort_tensors(header, config, raw, weights_path)
    name = name or os.path.basename(os.path.normpath(directory))
    plan = _module_plan(parts, header, config, raw, weights_path, module_shapes, f"{name!r} ({directory})")
    _check_magnitudes(magnitudes, plan, header, config, weights_path)
    _check_fp8_scales(weight_scales, plan, header, weights_path)
    names = ([k for a, b, _ in plan.values() for k in (a, b)] + list(magnitudes.values())
             + [k for pair in weight_scales.values() for k in pair.values()])
    _check_total_bytes(header, names, weights_path, module_shapes, max_total_bytes)
    arrays = read_safetensors(weights, names, max_header_bytes=max_header_bytes, max_tensor_bytes=max_tensor_bytes)
    modules = {}
    pieces = {}
    fp8 = {}
    for module, (a, b, kind) in plan.items():
        lora_a, lora_b = np.asarray(arrays[a], np.float32), np.asarray(arrays[b], np.float32)
        if module in weight_scales:
            kind_a, kind_b = _PAIRS["embedding" if kind == "embedding" else "linear"]
            factors = _fp8_factors(lora_a, lora_b, arrays[weight_scales[module][kind_a]],
                                   arrays[weight_scales[module][kind_b]], kind)
            fp8[module] = factors
            lora_a = factors.a_q * (factors.a_scale[None, :] if kind == "embedding" else factors.a_scale[:, None])
            lora_b = factors.b_q * factors.b_scale[:, None]
        if kind == EXPERT_KIND:
            lora_a, lora_b = split_expert_factors(lora_a, lora_b, lora_a.shape[0] // config.rank(module))
        if module_shapes is not None and module not in module_shapes:
            pieces[module] = (lora_a, lora_b, config.scaling(module), per_expert_target(module, module_shapes))
            continue
        modules[module] = LoraModule(lora_a, lora_b, config.scaling(module), kind)
    for target, (lora_a, lora_b) in group_expert_linears(pieces, module_shapes or {}).items():
        modules[target] = LoraModule(lora_a, lora_b, 1.0, EXPERT_KIND)
    dora = {module: np.asarray(arrays[key], np.float32) for module, key in magnitudes.items()}
    if config.alora_invocation_tokens is not None:
        embeddings = sorted(m for m, (_a, _b, kind) in plan.items() if kind == "embedding")
        if embeddings:
            raise AdapterError(f"{weights_path}: an aLoRA adapter (alora_invocation_tokens) with embedding LoRA on "
                               f"{embeddings}: PEFT applies aLoRA to linear layers only")
    return PeftAdapter(name, config.r, config.lora_alpha,
                       config.use_rslora, raw.get("target_modules"), modules, raw, base_layers, directory, dora,
                       config.alora_invocation_tokens, fp8)


def _fp8_factors(a_q, b_q, a_scale, b_scale, kind: str = "linear") -> Fp8Factors:
    """An fp8 module's stored values and its scales broadcast to one per channel: a linear A's rows,
    an embedding A's columns (token ids), B's rows (shapes checked from the header:
    `_check_fp8_scales`)."""
    channels_a = a_q.shape[1] if kind == "embedding" else a_q.shape[0]
    a_scale = np.broadcast_to(np.asarray(a_scale, np.float32).reshape(-1), (channels_a,)).copy()
    b_scale = np.broadcast_to(np.asarray(b_scale, np.float32).reshape(-1), (b_q.shape[0],)).copy()
    return Fp8Factors(a_q, a_scale, b_q, b_scale)


def _check_fp8_scales(weight_scales: dict, plan: dict, header: dict, weights_path: str) -> None:
    """fp8 files (contract section 11), from the header before any data is read: a module's A / B
    are F8_E4M3 exactly when both have a `weight_scale`, float32, one per channel or () / (1,) per
    tensor. The channels: a linear module's lora_A (r, in) per row (r,), lora_B (out, r) per row
    (out,); an embedding's lora_embedding_A (r, vocab) per column (vocab,), one per token id (the
    row of the table A.T the token looks up), lora_embedding_B (dim, r) per row (dim,). Expert
    weights (target_parameters) are refused."""
    for module, (key_a, key_b, kind) in sorted(plan.items()):
        dtypes = {header[key_a].dtype, header[key_b].dtype}
        scales = weight_scales.get(module, {})
        if "F8_E4M3" not in dtypes and not scales:
            continue
        if kind not in _PAIRS:
            raise AdapterError(f"{weights_path}: module {module!r}: fp8 weights are read for linear modules "
                               f"(lora_A / lora_B) and embeddings (lora_embedding_A / lora_embedding_B) only, not "
                               f"for {kind} (target_parameters) weights")
        part_a, part_b = _PAIRS[kind]
        stray = sorted(set(scales) - {part_a, part_b})
        if stray:
            what = "an embedding" if kind == "embedding" else "a linear module"
            raise AdapterError(f"{weights_path}: module {module!r} is {what} ({part_a} / {part_b}) but has a "
                               f"weight_scale of {stray[0]}")
        for part, key in ((part_a, key_a), (part_b, key_b)):
            scale = scales.get(part)
            if header[key].dtype != "F8_E4M3":
                raise AdapterError(f"{weights_path}: tensor {key!r} is {header[key].dtype} but module {module!r} has "
                                   f"fp8 tensors: both {part_a} and {part_b} are F8_E4M3 with their weight_scale, "
                                   "or neither")
            if scale is None:
                raise AdapterError(f"{weights_path}: tensor {key!r} is F8_E4M3 without its scale "
                                   f"{key.removesuffix('.weight') + '.weight_scale'!r} (float32 per channel)")
            per_column = part == "lora_embedding_A"
            channels = header[key].shape[1 if per_column else 0]
            what = "per token id (a column of lora_embedding_A)" if per_column else "per channel"
            shape = tuple(header[scale].shape)
            if header[scale].dtype != "F32" or shape not in ((channels,), (), (1,)):
                raise AdapterError(f"{weights_path}: tensor {scale!r} is {header[scale].dtype} {shape}; expected "
                                   f"F32 ({channels},) {what} or () / (1,) per tensor")
    stray = sorted(set(weight_scales) - set(plan))
    if stray:
        raise AdapterError(f"{weights_path}: weight_scale tensors of module {stray[0]!r} have no lora_A / lora_B pair")


def _sort_tensors(header: dict, config, raw: dict, weights_path: str) -> tuple:
    """The safetensors header's names sorted into modules before any data is read: ({module:
    {kind: tensor name}}, {module: shape of PEFT's base-layer copy}, {module: DoRA magnitude
    tensor name}, {module: {kind: fp8 weight_scale tensor name}}); training-state tensors the
    config names are skipped, anything else refused."""
    skip = tuple(part for field, parts in TRAINING_STATE_TENSORS.items() if raw.get(field) is not None
                 for part in parts)
    parts: dict = {}
    base_layers = {}
    magnitudes = {}
    weight_scales: dict = {}
    for key, info in header.items():
        if len(key) > MAX_NAME_CHARS + len("base_model.model.") + len(".lora_embedding_A.weight"):
            raise AdapterError(f"{weights_path}: tensor name {key[:80]!r} ... has {len(key)} characters; module names "
                               f"are at most {MAX_NAME_CHARS} (lora_core.peft.patterns.MAX_NAME_CHARS)")
        name_in_model = key.removeprefix("base_model.model.")
        if name_in_model.endswith(".lora_magnitude_vector") or name_in_model.endswith(".lora_magnitude_vector.weight"):
            module = name_in_model[: name_in_model.index(".lora_magnitude_vector")]
            if not config.use_dora:
                raise AdapterError(f"{weights_path}: tensor {key!r} is a DoRA magnitude, but {CONFIG_NAME} has "
                                   "use_dora false")
            magnitudes[module] = key
            continue
        if name_in_model.endswith(".base_layer.weight"):
            # PEFT's copy of a targeted embedding / LM head (for resized vocabularies): the base
            # model's own weight; only its shape is checked against the model.
            base_layers[name_in_model[: -len(".base_layer.weight")]] = info.shape
            continue
        if skip and any(f".{part}." in f".{name_in_model}." for part in skip):
            continue
        m = _KEY.match(name_in_model)
        rest = m.group("rest").split(".")[1:] if m else []
        if m is not None and rest and rest[-1] == "weight_scale" and len(rest) <= 2 and "bias" not in rest:
            # an fp8 file's per-channel (or per-tensor) scale of lora_A / lora_B (checked with the pair)
            pair = weight_scales.setdefault(m.group("module"), {})
            if m.group("kind") in pair:
                raise AdapterError(f"{weights_path}: tensors {pair[m.group('kind')]!r} and {key!r} are both the "
                                   f"weight_scale of {m.group('kind')} of module {m.group('module')!r}")
            pair[m.group("kind")] = key
            continue
        if m is None or "bias" in rest or len(rest) > 2 or (len(rest) == 2 and rest[-1] != "weight"):
            raise AdapterError(f"{weights_path}: tensor {key!r} is not a LoRA A/B weight (expected "
                               "<module>.lora_A.weight, .lora_B.weight, .lora_embedding_A or .lora_embedding_B); "
                               "an unsupported PEFT feature?")
        kinds = parts.setdefault(m.group("module"), {})
        if m.group("kind") in kinds:
            raise AdapterError(f"{weights_path}: tensors {kinds[m.group('kind')]!r} and {key!r} are both "
                               f"{m.group('kind')} of module {m.group('module')!r}")
        kinds[m.group("kind")] = key
    if not parts:
        raise AdapterError(f"{weights_path}: expected LoRA weights, got none (tensors: {sorted(header)[:6]})")

    return parts, base_layers, magnitudes, weight_scales


def _check_total_bytes(header: dict, names: list, weights_path: str, module_shapes, max_total_bytes) -> None:
    """Refuses an adapter whose tensors to read hold more than the limit (see load_peft_adapter)."""
    if max_total_bytes is not None:
        if not isinstance(max_total_bytes, int) or isinstance(max_total_bytes, bool) or max_total_bytes < 1:
            raise ValueError(f"max_total_bytes must be an int >= 1 or None, got {max_total_bytes!r}")
        limit, why = max_total_bytes, "max_total_bytes"
    elif module_shapes is not None:
        limit, why = largest_adapter_bytes(module_shapes), "the model's largest adapter: every LoRA module at max_rank"
    else:
        limit, why = MAX_ADAPTER_BYTES, "MAX_ADAPTER_BYTES, no model to size it by"
    total = sum(max(header[k].nbytes, 4 * math.prod(header[k].shape)) for k in names)
    if total > limit:
        raise AdapterError(f"{weights_path}: its LoRA tensors hold {total} bytes, more than the limit of {limit} bytes "
                           f"per adapter ({why}); raise it with max_total_bytes= (AdapterManager.max_adapter_bytes)")


def _check_fits_model(label: str, module: str, key_a: str, kind: str, shape_a: tuple, shape_b: tuple,
                      module_shapes: Mapping[str, ModuleShape]) -> None:
    """One module's header shapes against the model's ModuleShape, with placement's messages (the
    adapter's label names its directory; the tensor named is in its adapter_model.safetensors)."""
    where = f"(tensor {key_a!r} of {WEIGHTS_NAME}, checked from its header)"
    want = module_shapes.get(module)
    piece = per_expert_target(module, module_shapes) if want is None and kind == "linear" else None
    if piece is not None:
        target, expert, _part, parts = piece
        fused = module_shapes[target]
        want = ModuleShape("linear", fused.in_features, fused.out_features // parts, fused.max_rank)
        if expert >= fused.num_experts:
            raise AdapterError(f"adapter {label}, module {module!r}: expert {expert} of {target!r}, which has "
                               f"{fused.num_experts} experts {where}")
    if want is None:
        raise AdapterError(f"{unknown_adapter_module(label, module, module_shapes)} {where}")
    if kind == EXPERT_KIND:
        if want.kind != EXPERT_KIND:
            raise AdapterError(f"adapter {label}: {module!r} holds expert (target_parameters) factors but the model's "
                               f"module is {'an embedding' if want.kind == 'embedding' else 'a linear layer'} {where}")
        rank = shape_a[0] // want.num_experts
        if shape_a[0] != rank * want.num_experts or shape_a[0] != shape_b[1]:
            raise AdapterError(f"adapter {label}, module {module!r}: lora_A {shape_a} / lora_B {shape_b} do not stack "
                               f"{want.num_experts} experts (expected r * {want.num_experts} rows) {where}")
        if rank > want.max_rank:
            raise AdapterError(f"adapter {label}, module {module!r}: rank {rank} exceeds the model's max_rank="
                               f"{want.max_rank}; wrap the model with max_rank >= {rank} {where}")
        if shape_a[1] != want.in_features or shape_b[0] != want.out_features:
            raise AdapterError(f"adapter {label}, module {module!r}: lora_A {shape_a} / lora_B {shape_b} do not fit "
                               f"the {want.num_experts} experts: expected lora_A ({rank} * {want.num_experts}, "
                               f"{want.in_features}) and lora_B ({want.out_features}, {rank} * {want.num_experts}) "
                               f"{where}")
        return
    if kind != want.kind:
        raise AdapterError(f"adapter {label}: {module!r} holds {kind} factors but the model's module is "
                           f"{'an embedding' if want.kind == 'embedding' else 'a linear layer'} {where}")
    rank = shape_a[0]
    if rank > want.max_rank:
        raise AdapterError(f"adapter {label}, module {module!r}: rank {rank} exceeds the model's max_rank="
                           f"{want.max_rank}; wrap the model with max_rank >= {rank} {where}")
    if shape_a[1] != want.in_features or shape_b[0] != want.out_features:
        a_name, b_name = ("lora_A", "lora_B") if kind == "linear" else ("lora_embedding_A", "lora_embedding_B")
        raise AdapterError(f"adapter {label}, module {module!r}: {a_name} {shape_a} / {b_name} {shape_b} do not fit "
                           f"the module: expected {a_name} ({rank}, {want.in_features}) and {b_name} "
                           f"({want.out_features}, {rank}) {where}")


def _module_plan(parts: dict, header: dict, config, raw: dict, weights_path: str, module_shapes=None,
                 label: str = "") -> dict:
    """{module: (A tensor name, B tensor name, kind)}: each module's pair checked against the
    header's shapes, the model's (module_shapes, when given; before the config's patterns run, so
    they only ever see the model's own module names) and the config (targeted, its rank)."""
    plan = {}
    deadline = time.monotonic() + MATCH_BUDGET_S
    for module, kinds in sorted(parts.items()):
        if time.monotonic() > deadline:
            raise AdapterError(f"{weights_path}: matching {CONFIG_NAME}'s patterns (target_modules, rank_pattern, ...) "
                               f"against the tensor names took more than {MATCH_BUDGET_S} s; refused")
        kind = next((k for k, pair in _PAIRS.items() if set(kinds) == set(pair)), None)
        parameter = None
        if config.target_parameters and kind == "linear":
            parameter = parameter_of(module, config, module_shapes, weights_path,
                                     (header[kinds["lora_A"]].shape, header[kinds["lora_B"]].shape))
        elif config.target_parameters:
            parameter = parameter_of(module, config, module_shapes, weights_path)
        if parameter is not None:
            if kind != "linear":
                raise AdapterError(f"{weights_path}: parameter {parameter!r} (tensors of {module!r}) has tensors "
                                   f"{sorted(kinds)}; expected lora_A and lora_B")
            key_a, key_b = kinds["lora_A"], kinds["lora_B"]
            shape_a, shape_b = header[key_a].shape, header[key_b].shape
            experts, _, _ = experts_shapes(parameter, shape_a, shape_b, config.rank(parameter), weights_path)
            want = (module_shapes or {}).get(parameter)
            if want is not None and want.kind == EXPERT_KIND and experts != want.num_experts:
                raise AdapterError(f"{weights_path}: parameter {parameter!r}: {key_a!r} {shape_a} is rank "
                                   f"{config.rank(parameter)} (the config's) times {experts} experts, but the model's "
                                   f"{parameter!r} has {want.num_experts} experts")
            if module_shapes is not None:
                _check_fits_model(label, parameter, key_a, EXPERT_KIND, shape_a, shape_b, module_shapes)
            if parameter in plan:
                raise AdapterError(f"{weights_path}: parameter {parameter!r} has two pairs of tensors")
            plan[parameter] = (key_a, key_b, EXPERT_KIND)
            continue
        if kind is None:
            raise AdapterError(f"{weights_path}: module {module!r} has tensors {sorted(kinds)}; expected lora_A and "
                               "lora_B (or lora_embedding_A and lora_embedding_B)")
        key_a, key_b = (kinds[k] for k in _PAIRS[kind])
        shape_a, shape_b = header[key_a].shape, header[key_b].shape
        if len(shape_a) != 2 or len(shape_b) != 2 or shape_a[0] != shape_b[1]:
            raise AdapterError(f"{weights_path}: module {module!r}: expected A (r, in) and B (out, r) with one r, got "
                               f"{key_a!r} {shape_a} and {key_b!r} {shape_b}")
        if module_shapes is not None:
            _check_fits_model(label, module, key_a, kind, shape_a, shape_b, module_shapes)
        if not config.targets(module):
            raise AdapterError(f"{weights_path}: tensor {key_a!r} is for module {module!r}, which {CONFIG_NAME} does "
                               f"not target (target_modules={raw.get('target_modules')!r}, layers_to_transform="
                               f"{raw.get('layers_to_transform')!r}, exclude_modules={raw.get('exclude_modules')!r}); "
                               "PEFT would not load it")
        if shape_a[0] != config.rank(module):
            raise AdapterError(f"{weights_path}: module {module!r} has rank {shape_a[0]} ({key_a!r} {shape_a}), but "
                               f"{CONFIG_NAME} says r={config.rank(module)}")
        plan[module] = (key_a, key_b, kind)
    return plan


def _check_magnitudes(magnitudes: dict, plan: dict, header: dict, config, weights_path: str) -> None:
    """DoRA: every magnitude belongs to a linear module's pair and has its out_features; with
    use_dora every linear module has one."""
    for module, key in sorted(magnitudes.items()):
        if module not in plan or plan[module][2] != "linear":
            raise AdapterError(f"{weights_path}: DoRA magnitude {key!r} has no lora_A / lora_B pair of a linear "
                               f"module {module!r}")
        want = (header[plan[module][1]].shape[0],)
        if tuple(header[key].shape) != want:
            raise AdapterError(f"{weights_path}: DoRA magnitude {key!r} has shape {tuple(header[key].shape)}, "
                               f"expected {want} (the module's out_features)")
    if config.use_dora:
        missing = sorted(m for m, (_a, _b, kind) in plan.items() if kind == "linear" and m not in magnitudes)
        if missing:
            raise AdapterError(f"{weights_path}: {CONFIG_NAME} has use_dora true (a DoRA adapter), but modules "
                               f"{missing[:4]} have no lora_magnitude_vector")


def save_peft_adapter(path: str, modules: Mapping[str, tuple], *, r: int, lora_alpha: float,
                      use_rslora: bool = False, base_model_name_or_path: str | None = None,
                      rank_pattern: dict | None = None) -> None:
    """Writes an adapter in PEFT's format (what `PeftModel.save_pretrained` writes).

    modules: {Hugging Face module name: (A, B)}; embeddings are recognised by name ("embed_tokens")
    and stored as lora_embedding_A (r, vocab) / lora_embedding_B (dim, r). 3-D factors A (E, r, in),
    B (E, out, r) name an expert parameter ("model.layers.0.mlp.experts.gate_up_proj") and are
    stored as PEFT's target_parameters (lora_core.peft.experts): stacked, the parameters of one
    experts module nested in transformers' registration order (gate_up_proj innermost).
    """
    from safetensors.numpy import save_file
    os.makedirs(path, exist_ok=True)
    tensors = {}
    parameters = sorted(m for m, (a, _b) in modules.items() if np.ndim(a) == 3)
    owners: dict = {}
    for name in parameters:
        owners.setdefault(name.rpartition(".")[0], []).append(name.rpartition(".")[2])
    for module, (a, b) in modules.items():
        if np.ndim(a) == 3:
            owner, _, param = module.rpartition(".")
            order = sorted(owners[owner], key=lambda p: (p != "gate_up_proj", p != "down_proj", p))
            depth = len(order) - 1 - order.index(param)
            a, b = join_expert_factors(np.asarray(a, np.float32), np.asarray(b, np.float32))
            prefix = f"base_model.model.{owner}" + ".base_layer" * depth
            tensors[f"{prefix}.lora_A.weight"] = a
            tensors[f"{prefix}.lora_B.weight"] = b
            continue
        emb = module.split(".")[-1] in ("embed_tokens", "wte", "word_embeddings")
        ka, kb = ("lora_embedding_A", "lora_embedding_B") if emb else ("lora_A.weight", "lora_B.weight")
        tensors[f"base_model.model.{module}.{ka}"] = np.ascontiguousarray(a, np.float32)
        tensors[f"base_model.model.{module}.{kb}"] = np.ascontiguousarray(b, np.float32)
    save_file(tensors, os.path.join(path, WEIGHTS_NAME), metadata={"format": "pt"})
    targets = sorted({m.split(".")[-1] for m in modules if m not in parameters})
    target_parameters = sorted({".".join(m.split(".")[-3:]) for m in parameters})
    cfg = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": int(r), "lora_alpha": lora_alpha,
           "use_rslora": bool(use_rslora), "target_modules": targets, "lora_dropout": 0.0, "bias": "none",
           "fan_in_fan_out": False, "use_dora": False, "modules_to_save": None,
           "rank_pattern": rank_pattern or {}, "alpha_pattern": {}, "init_lora_weights": True,
           "base_model_name_or_path": base_model_name_or_path, "inference_mode": True}
    if target_parameters:
        cfg["target_parameters"] = target_parameters
    with open(os.path.join(path, CONFIG_NAME), "w") as f:
        json.dump(cfg, f, indent=2)
