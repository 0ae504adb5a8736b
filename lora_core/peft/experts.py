"""Expert LoRA: PEFT adapters on the fused expert weights of mixture-of-experts models, as NumPy.

A mixture-of-experts layer holds E experts' weights stacked in 3-D parameters (transformers'
Mixtral and Qwen2/3-MoE: `mlp.experts.gate_up_proj` (E, 2I, H) and `mlp.experts.down_proj`
(E, H, I), stored (experts, out, in)). Expert e's LoRA adds, for a token x routed to it,

    gate_up(x) += scaling * B_e @ (A_e @ x)        A_e (r, H), B_e (2I, r)
    down(h)    += scaling * B_e @ (A_e @ h)        A_e (r, I), B_e (H, r)

and this package holds each such weight's factors as one `LoraModule` of kind "experts":
lora_a (E, r, in), lora_b (E, out, r), named by the parameter
("model.layers.0.mlp.experts.gate_up_proj").

PEFT writes them two ways:

1. `target_parameters` (PEFT's ParamWrapper): one lora_A.weight (r * E, in) and one lora_B.weight
   (out, r * E) per parameter; rows of A are expert-major (row e * r + k is A_e[k]), columns of B
   rank-major (column k * E + e is B_e[:, k]), so A_e = A.reshape(E, r, in)[e] and
   B_e = B.reshape(out, r, E)[:, :, e]. Several parameters of one module are wrapped in nested
   wrappers, the parameter registered first innermost, so the tensors of the parameter that is
   i-th last of the n targeted are saved under `<module>` + ".base_layer" * i (e.g.
   `mlp.experts.base_layer.lora_A.weight` is gate_up_proj, `mlp.experts.lora_A.weight`
   down_proj). r, alpha (rank_pattern / alpha_pattern) and scaling are looked up by the
   parameter's full name, as PEFT does. A 3-D parameter stored (experts, in, out) gives the same
   A and B (PEFT swaps its in / out); only the model's ModuleShape says which is which.
2. `target_modules` on per-expert linear layers (models with `experts.<e>.w1` / `w3` / `w2` or
   `experts.<e>.gate_proj` / `up_proj` / `down_proj`): ordinary (r, in) / (out, r) pairs. Given a
   model whose experts are fused, `group_expert_linears` gathers them into the fused weight's
   kind "experts" module: gate (w1) and up (w3) are the two halves of gate_up_proj's output, each
   with its own A, so their A's are stacked along the rank and B is block-diagonal in the rank;
   every expert's scaling is folded into its B (the module's scaling is 1); experts without
   LoRA hold zeros. The result is exact: B_e @ A_e equals the sum of the per-expert products.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

import numpy as np

from .config import AdapterError

__all__ = ["EXPERT_KIND", "PER_EXPERT_LINEARS", "experts_shapes", "group_expert_linears", "join_expert_factors",
           "parameter_of", "per_expert_target", "split_expert_factors"]

EXPERT_KIND = "experts"

# Per-expert linear layer name -> (the fused parameter it is part of, its slice, the slices).
PER_EXPERT_LINEARS = {
    "w1": ("gate_up_proj", 0, 2), "w3": ("gate_up_proj", 1, 2), "w2": ("down_proj", 0, 1),
    "gate_proj": ("gate_up_proj", 0, 2), "up_proj": ("gate_up_proj", 1, 2), "down_proj": ("down_proj", 0, 1),
}
# Parameters in the order transformers' experts modules register them (PEFT nests in that order).
_REGISTRATION_ORDER = ("gate_up_proj", "down_proj")
# Older module names of an experts module's parent, as transformers renames them when loading.
_PARENT_ALIASES = {"block_sparse_moe": "mlp"}
_PER_EXPERT = re.compile(r"^(?P<prefix>.+\.experts)\.(?P<expert>\d+)\.(?P<linear>[A-Za-z0-9_]+)$")
_BASE_LAYER = ".base_layer"


def parameter_of(module: str, config, module_shapes: Mapping | None, where: str,
                 shapes: tuple | None = None) -> str | None:
    """The full name of the parameter whose PEFT ParamWrapper saved its tensors under `module`
    (e.g. "model.layers.0.mlp.experts.base_layer" -> "model.layers.0.mlp.experts.gate_up_proj"),
    or None when `module` holds no parameter LoRA (no target_parameters entry names a parameter of it).

    1. Strip the trailing ".base_layer"s: their count d is the wrapper's depth (0 = outermost).
    2. The parameters of the module that target_parameters names, in registration order: the
       model's (the order of module_shapes) where given, else transformers' (gate_up_proj before
       down_proj); the one at depth d is the (n - 1 - d)-th.
    3. With module_shapes and the tensors' header shapes (A, B): when exactly one targeted
       parameter's ModuleShape fits them (in, out, a multiple of its experts), that one. A class
       registering its parameters in another order nests them in that order, which neither
       module_shapes' order nor transformers' need follow; the shapes decide where they can.
    """
    depth = 0
    owner = module
    while owner.endswith(_BASE_LAYER):
        owner = owner[: -len(_BASE_LAYER)]
        depth += 1
    names = {t.rpartition(".")[2] for t in config.target_parameters}
    targeted = [p for p in names if config.targets_parameter(f"{owner}.{p}")]
    if not targeted:
        if depth:
            raise AdapterError(f"{where}: tensors of {module!r} belong to a wrapped parameter of {owner!r}, but "
                               f"target_parameters={list(config.target_parameters)!r} names none of its parameters")
        return None
    order = [name.rpartition(".")[2] for name in (module_shapes or {}) if name.rpartition(".")[0] == owner]
    order += [p for p in _REGISTRATION_ORDER if p not in order]

    def rank(p):
        if p in order:
            return order.index(p)
        if len(targeted) > 1:
            raise AdapterError(f"{where}: module {owner!r} has {len(targeted)} targeted parameters {sorted(targeted)}; "
                               f"the order PEFT nested them in is unknown for {p!r} (pass the model's module_shapes)")
        return 0

    targeted.sort(key=rank)
    if module_shapes is not None and shapes is not None:
        shape_a, shape_b = shapes
        fits = [p for p in targeted if _fits(module_shapes.get(f"{owner}.{p}"), shape_a, shape_b)]
        if len(fits) == 1:
            return f"{owner}.{fits[0]}"
    if depth >= len(targeted):
        raise AdapterError(f"{where}: tensors of {module!r} are nested {depth} wrappers deep, but target_parameters "
                           f"names only {len(targeted)} parameter(s) of {owner!r}: {targeted}")
    return f"{owner}.{targeted[len(targeted) - 1 - depth]}"


def _fits(shape, shape_a: tuple, shape_b: tuple) -> bool:
    """Whether A (r * E, in) and B (out, r * E) header shapes fit a kind "experts" ModuleShape."""
    return (shape is not None and shape.kind == EXPERT_KIND and len(shape_a) == 2 and len(shape_b) == 2
            and shape_a[1] == shape.in_features and shape_b[0] == shape.out_features
            and shape_a[0] % shape.num_experts == 0)


def experts_shapes(name: str, shape_a: tuple, shape_b: tuple, rank: int, where: str) -> tuple[int, int, int]:
    """(experts E, in, out) of a parameter LoRA saved as A (r * E, in) and B (out, r * E), with the
    config's rank r; AdapterError when the shapes do not have that form."""
    if len(shape_a) != 2 or len(shape_b) != 2 or shape_a[0] != shape_b[1] or shape_a[0] % rank or not shape_a[0]:
        raise AdapterError(f"{where}: parameter {name!r}: expected lora_A (r * experts, in) and lora_B (out, r * "
                           f"experts) with r={rank} from the config, got {shape_a} and {shape_b}")
    return shape_a[0] // rank, shape_a[1], shape_b[0]


def split_expert_factors(a: np.ndarray, b: np.ndarray, experts: int) -> tuple[np.ndarray, np.ndarray]:
    """PEFT's stacked A (r * E, in) and B (out, r * E) -> A (E, r, in), B (E, out, r) (see the
    module docstring for the layout)."""
    rank = a.shape[0] // experts
    a3 = a.reshape(experts, rank, a.shape[1])
    b3 = b.reshape(b.shape[0], rank, experts).transpose(2, 0, 1)
    return np.ascontiguousarray(a3), np.ascontiguousarray(b3)


def join_expert_factors(a3: np.ndarray, b3: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The inverse of `split_expert_factors`: A (E, r, in), B (E, out, r) -> PEFT's A (r * E, in), B (out, r * E)."""
    experts, rank, n_in = a3.shape
    a = a3.reshape(experts * rank, n_in)
    b = np.asarray(b3).transpose(1, 2, 0).reshape(b3.shape[1], rank * experts)
    return np.ascontiguousarray(a), np.ascontiguousarray(b)


def per_expert_target(module: str, module_shapes: Mapping) -> tuple[str, int, int, int] | None:
    """(fused parameter name, expert, slice, slices) when `module` is a per-expert linear layer
    (`<...>.experts.<e>.w1`) of an experts module the model holds fused (its module_shapes has the
    fused parameter, of kind "experts"); None otherwise."""
    found = _PER_EXPERT.match(module)
    if found is None or found.group("linear") not in PER_EXPERT_LINEARS:
        return None
    parameter, part, parts = PER_EXPERT_LINEARS[found.group("linear")]
    prefix = found.group("prefix")
    candidates = [prefix] + [prefix.replace(f".{old}.", f".{new}.") for old, new in _PARENT_ALIASES.items()
                             if f".{old}." in prefix]
    for owner in candidates:
        shape = module_shapes.get(f"{owner}.{parameter}")
        if shape is not None and shape.kind == EXPERT_KIND:
            return f"{owner}.{parameter}", int(found.group("expert")), part, parts
    return None


def group_expert_linears(pieces: Mapping[str, tuple], module_shapes: Mapping) -> dict:
    """Per-expert linear LoRA gathered into the fused weights' modules (see the module docstring).

    pieces: {per-expert module name: (a (r, in), b (out / slices, r), scaling, (fused name,
      expert, slice, slices))}. Returns {fused name: (A (E, R, in), B (E, out, R))}, float32,
      each expert's scaling folded into B, R the sum over slices of the largest rank of the slice.
    Raises AdapterError when R exceeds the fused module's max_rank.
    """
    by_target: dict = {}
    for module, (a, b, scaling, (target, expert, part, parts)) in pieces.items():
        by_target.setdefault(target, []).append((module, a, b, scaling, expert, part, parts))
    out = {}
    for target, items in sorted(by_target.items()):
        shape = module_shapes[target]
        parts = items[0][6]
        ranks = [max((a.shape[0] for _m, a, _b, _c, _e, p, _n in items if p == s), default=0) for s in range(parts)]
        offsets = np.concatenate([[0], np.cumsum(ranks)]).astype(int)
        total = int(offsets[-1])
        if total > shape.max_rank:
            raise AdapterError(f"per-expert LoRA of {target!r}: gate and up ranks {ranks} stack to rank {total}, more "
                               f"than the model's max_rank={shape.max_rank}; wrap the model with max_rank >= {total}")
        width = shape.out_features // parts
        a3 = np.zeros((shape.num_experts, total, shape.in_features), np.float32)
        b3 = np.zeros((shape.num_experts, shape.out_features, total), np.float32)
        seen = set()
        for module, a, b, scaling, expert, part, _n in items:
            if (expert, part) in seen:
                raise AdapterError(f"per-expert LoRA of {target!r}: expert {expert} slice {part} appears twice "
                                   f"({module!r})")
            seen.add((expert, part))
            r = a.shape[0]
            a3[expert, offsets[part]: offsets[part] + r] = a
            b3[expert, part * width: (part + 1) * width, offsets[part]: offsets[part] + r] = np.float32(scaling) * b
        out[target] = (a3, b3)
    return out
