"""Where arrays go: a device argument ("cpu", "gpu", "cuda:1", "tpu", a Device, a Sharding or None)
read as a platform name or a jax Device.

The bottom of `jax_lora`: the metadata, the mapping functions, the wrapper and the backend choice
(`ops/dispatch.py`) all read device arguments through these two functions, so every public
function accepts the same spellings and names the string in its error.
"""

from __future__ import annotations

import jax

__all__ = ["platform_of", "resolve_device"]


def platform_of(device) -> str:
    """'cpu' / 'gpu' / 'tpu' for a jax Device, a Sharding (its devices' platform), a platform
    string, or None (the default backend)."""
    if device is None:
        return jax.default_backend()
    if isinstance(device, str):
        p = device.split(":")[0].lower()
        return "gpu" if p in ("cuda", "gpu") else p
    if isinstance(device, jax.sharding.Sharding):
        device = next(iter(device.device_set))
    return getattr(device, "platform", "cpu")


def resolve_device(device):
    """A jax Device for a platform string ("cpu", "gpu", "cuda:1", "tpu"); other values (None, a
    Device, a Sharding) unchanged. ValueError naming the string when no such device exists."""
    if device is None or not isinstance(device, str):
        return device
    platform = platform_of(device)
    idx = int(device.split(":")[1]) if ":" in device else 0
    try:
        return jax.devices(platform)[idx]
    except (RuntimeError, IndexError) as e:
        raise ValueError(f"device {device!r} is not available: {e}") from e
