"""Backend registry and selection for the JAX ops (contract section 5 and 8).

A backend is a module (or object) with:
  NAME: str
  shrink(x (T,H), lora_a: tuple of (L,r,H), meta: LoRAKernelMeta, scale, lora_ranks) -> (S,T,r) f32
  expand(buf (S,T,r), lora_b: tuple of (L,n_s,r), y (T,N), meta, offsets: tuple[int], add_inputs,
         lora_ranks, bias=None) -> y      (bias: None or S entries of None / (L, n_s))
  COLUMN_SCALE: True when expand (and linear) also take col_scale= (S entries of None / (L, n_s):
      a slice's new value times g[idx] instead of plus a bias, DoRA); the wrapper refuses DoRA
      scales for a backend without it
Weights arrive as 3-D arrays (the size-1 axis removed), indices through the metadata (contract
section 3), already checked. Adding a backend means registering it here; callers never change.

Optional, for `deterministic=True`:
  deterministic_backend() -> an object with the contract above whose results are batch invariant
      (a token's values are bitwise the same whatever the batch and from run to run)
A backend without it ("xla", "pallas_tpu") runs `jax_lora.ops.invariant` (the reference math,
batch invariant) when asked to be deterministic (`deterministic_impl`).

Without `backend=`, the device decides: TPU -> "pallas_tpu", GPU -> "triton", CPU -> "xla", each
falling back to "xla" when its kernels are not importable on this machine.
"""

from __future__ import annotations

import jax

from lora_core.backend_registry import BackendRegistry
from lora_core.checks import check_deterministic

_REGISTRY = BackendRegistry({
    "xla": "jax_lora.ops.xla",
    "pallas_tpu": "jax_lora.ops.pallas_tpu",
    "triton": "jax_lora.ops.triton",
}, "jax_lora")
BACKENDS = _REGISTRY.names
_DEVICE_DEFAULT = {"tpu": "pallas_tpu", "gpu": "triton", "cuda": "triton", "rocm": "xla", "cpu": "xla"}


def load_backend(name: str):
    """The backend module `name`; a clear error if it is unknown or cannot run here."""
    return _REGISTRY.load(name)


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


def default_backend_name(device=None, *, log: bool = False) -> str:
    """The platform's default backend (xla where its kernels cannot run, said as a fallback).
    log=True says the choice once on the `jax_lora` logger."""
    platform = platform_of(device)
    name = _DEVICE_DEFAULT.get(platform, "xla")
    if name != "xla":
        try:
            load_backend(name)
        except RuntimeError as e:
            name = _REGISTRY.fallback(name, "xla", platform, e)
    if log:
        _REGISTRY.log_choice(name, platform, "the device's default")
    return name


def resolve(backend: str | None, device=None, *, deterministic: bool = False):
    """The backend module for an explicit name, or the device's default (said once on the
    `jax_lora` logger); its batch-invariant form with deterministic=True (`deterministic_impl`)."""
    if backend is not None:
        impl = load_backend(backend)
    else:
        impl = load_backend(default_backend_name(device, log=True))
    return deterministic_impl(impl) if check_deterministic(deterministic) else impl


def deterministic_impl(impl):
    """The batch-invariant form of backend `impl`: its own `deterministic_backend()` (Triton:
    fixed launch configs), else the reference math of `jax_lora.ops.invariant`."""
    hook = getattr(impl, "deterministic_backend", None)
    if hook is not None:
        return hook()
    from . import invariant
    return invariant

