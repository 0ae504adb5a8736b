"""A named set of backend modules, imported on first use (shared by both sides' dispatch).

Framework-free: `jax_lora.ops.dispatch` and `torch_lora.ops.dispatch` each hold one registry.
"""

from __future__ import annotations

import importlib


class BackendRegistry:
    """name -> module path; `load(name)` imports once and explains unknown or unavailable names."""

    def __init__(self, modules: dict):
        self.modules = dict(modules)
        self.names = tuple(self.modules)
        self._loaded: dict = {}

    def load(self, name: str):
        if name not in self.modules:
            raise ValueError(f"backend must be one of {self.names} (or None to let the device decide), "
                             f"got {name!r}")
        if name not in self._loaded:
            try:
                self._loaded[name] = importlib.import_module(self.modules[name])
            except ImportError as e:
                raise RuntimeError(f"backend {name!r} is not available on this machine: {e}") from e
        return self._loaded[name]
