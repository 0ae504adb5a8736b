"""Layers of an nnx model by their graph path: the dotted name of a path and the swap of the layer
that stands at one, for the passes that replace layers in place (`jax_lora.quant.quantize_model`,
`jax_lora.nn.replace_lora_layers`).

A path is the tuple `nnx.iter_graph` yields: attribute names, and integer indices into lists (or
keys of containers indexed like them). `set_submodule` walks it to the parent:
  1. each step but the last is an index (`parent[p]`) when p is an int or the parent has no
     attribute named p, else an attribute (`getattr(parent, p)`);
  2. the last step is assigned the same way: `parent[p] = new` for an int, else `setattr`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = ["path_name", "set_submodule"]


def path_name(path: Sequence[Any]) -> str:
    """The dotted name of a graph path: ("layers", 0, "q_proj") -> "layers.0.q_proj"."""
    return ".".join(str(p) for p in path)


def set_submodule(model: Any, path: Sequence[Any], new: Any) -> None:
    """Puts `new` where `path` points inside `model` (the layer there is replaced)."""
    parent = model
    for p in path[:-1]:
        parent = parent[p] if isinstance(p, int) or not hasattr(parent, str(p)) else getattr(parent, p)
    if isinstance(path[-1], int):
        parent[path[-1]] = new
    else:
        setattr(parent, path[-1], new)
