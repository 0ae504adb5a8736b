"""Backend registry and selection for the JAX ops (contract section 5 and 8).

A backend is a module (or object) with:
  NAME: str
  shrink(x (T,H), lora_a: tuple of (L,r,H), meta: LoRAKernelMeta, scale, lora_ranks) -> (S,T,r) f32
  expand(buf (S,T,r), lora_b: tuple of (L,n_s,r), y (T,N), meta, offsets: tuple[int], add_inputs,
         lora_ranks, bias=None) -> y      (bias: None or S entries of None / (L, n_s))
  COLUMN_SCALE: True when expand (and linear) also take col_scale= (S entries of None / (L, n_s):
      a slice's new value times g[idx] instead of plus a bias, DoRA); the wrapper refuses DoRA
      scales for a backend without it
  WEIGHT_SCALES: True when shrink / expand (and linear) also take a_scales= / b_scales= (S entries
      of None / (L, r) and (L, n_s) float32, already per channel: the scales of e4m3 weights,
      applied once per output channel after the float32 sum); the ops hand fp8 calls of a backend
      without them to the xla reference, said on the logger (`api.scale_keywords`). A backend that
      does not declare it is read from its shrink's signature (an explicit `a_scales` parameter)
  CUSTOM_CALLS: True when the ops run custom calls XLA's partitioner cannot look into (Pallas,
      Triton): `resolve` then hands out `jax_lora.ops.partition.partitioned(impl)`, whose ops run
      per device like their math under a jit with sharded inputs
  fused_moe_lora(y3, x, lora_a, lora_b, pair_weight, layout, offsets, lora_ranks) -> y3, optional:
      LoRA on a mixture-of-experts layer's routed pairs (jax_lora.ops.fused_moe; "xla" and
      "pallas_tpu" have it, "triton" in its MoE module jax_lora.ops.triton_moe; a backend without
      it runs the xla one, said on the logger)
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

from lora_core.backend_registry import BackendRegistry
from lora_core.checks import check_deterministic

from ..devices import platform_of
from . import invariant, partition

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
    `jax_lora` logger); its batch-invariant form with deterministic=True (`deterministic_impl`);
    partitioned under GSPMD when it runs custom calls (`partition.partitioned`)."""
    if backend is not None:
        impl = load_backend(backend)
    else:
        impl = load_backend(default_backend_name(device, log=True))
    return partition.partitioned(deterministic_impl(impl) if check_deterministic(deterministic) else impl)


def deterministic_impl(impl):
    """The batch-invariant form of backend `impl`: its own `deterministic_backend()` (Triton:
    fixed launch configs), else the reference math of `jax_lora.ops.invariant`."""
    hook = getattr(impl, "deterministic_backend", None)
    return hook() if hook is not None else invariant

