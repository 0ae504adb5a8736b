"""A named set of backend modules, imported on first use (shared by both sides' dispatch).

Framework-free: `jax_lora.ops.dispatch` and `torch_lora.ops.dispatch` each hold one registry.
"""

from __future__ import annotations

import functools
import importlib
import logging


class BackendRegistry:
    """name -> module path; `load(name)` imports once and explains unknown or unavailable names."""

    def __init__(self, modules: dict, logger: str):
        self.modules = dict(modules)
        self.names = tuple(self.modules)
        self._loaded: dict = {}
        self.log = logging.getLogger(logger)

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

    @functools.cache  # noqa: B019 - registries live for the process
    def log_choice(self, name: str, where: str, why: str) -> None:
        """Says once per (backend, device, reason) which backend runs and why."""
        self.log.info("backend %r on %s (%s)", name, where, why)

    def fallback(self, wanted: str, instead: str, where: str, error: Exception) -> str:
        """`instead`, after saying (a warning, once) why `wanted` cannot run on `where`."""
        self._warn_fallback(wanted, instead, where, f"{type(error).__name__}: {error}")
        return instead

    @functools.cache  # noqa: B019
    def _warn_fallback(self, wanted: str, instead: str, where: str, why: str) -> None:
        self.log.warning("backend %r cannot run on %s, using %r instead: %s", wanted, where, instead, why)
