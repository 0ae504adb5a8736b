"""Backend registry and selection for the torch ops (contract section 5 and 8).

A backend is a module with:
  NAME: str
  shrink(x (T,H), lora_a: tuple of (L,r,H), out (S,T,r) float32, meta_args, scale, lora_ranks) -> None
      writes every row of `out` (0 for tokens without LoRA)
  expand(buf (S,T,r), lora_b: tuple of (L,n_s,r), y (T,N), meta_args, offsets: tuple[int], add_inputs,
         lora_ranks, bias, *, col_scale=None) -> None
      writes the slices of y in place; bias: None or S entries of None / (L, n_s); col_scale (DoRA):
      None or S entries of None / (L, n_s), a token's new slice values times col_scale[s][idx[t]]
Optional:
  linear(y, x, lora_a, lora_b, meta_args, scale, offsets, lora_ranks, bias, *, col_scale=None) -> None
      add_lora_linear's math in place (y += shrink then expand), in the backend's best way
  prepare_linear(lora_a, lora_b, meta_args, offsets, bias, *, col_scale=None) -> run(y, x, scale, lora_ranks)
      `linear` with the persistent arguments bound, for repeated calls with new activations
      (the wrapper keeps one per layer and token count; see torch_lora.ops.triton.PreparedLinear)
fp8 (e4m3) weights (contract section 11): `shrink(..., a_scales=)`, `expand(..., b_scales=)`,
`linear` / `prepare_linear(..., a_scales=, b_scales=)`, each a tuple per slice of None (a 16-bit
slice) or the (L, r) / (L, n_s) float32 per-channel scales (the ops broadcast per-tensor scales
first); passed only when some weight is fp8, so a backend without fp8 keeps its signature.
`meta_args` is `LoRAKernelMeta.meta_args(T)`: a `lora_core.kernel_meta.KernelMeta` (contract section
3), whose fields the backends read by name (the reference backend reads only its first,
`token_lora_mapping`). Weights arrive as 3-D views (the size-1 axis removed), arguments already
checked.

Optional, for `deterministic=True`:
  deterministic_backend() -> an object with the contract above whose results are batch invariant
      (a token's values are bitwise the same whatever the batch and from run to run)
A backend without it runs `torch_lora.ops.invariant` (the reference math, batch invariant) when
asked to be deterministic (`deterministic_impl`).

Without `backend=`, the device decides: CUDA -> "triton" (when importable), otherwise "torch".
Forcing "triton" on a CPU tensor runs Triton's interpreter, which needs TRITON_INTERPRET=1 set
before this package was imported.
"""

from __future__ import annotations

import os

import torch

from lora_core.backend_registry import BackendRegistry
from lora_core.checks import check_deterministic

from . import invariant

_REGISTRY = BackendRegistry({"torch": "torch_lora.ops.torch_ref", "triton": "torch_lora.ops.triton"}, "torch_lora")
BACKENDS = _REGISTRY.names


def load_backend(name: str):
    """The backend module `name`; a clear error if it is unknown or cannot run here."""
    return _REGISTRY.load(name)


def default_backend_name(device, *, log: bool = False) -> str:
    """The device's default backend: triton on CUDA (torch where Triton cannot run, said as a
    fallback), torch elsewhere. log=True says the choice once on the `torch_lora` logger."""
    dev = torch.device(device) if device is not None else torch.device("cpu")
    name = "torch"
    if dev.type == "cuda":
        try:
            load_backend("triton")
            name = "triton"
        except RuntimeError as e:
            name = _REGISTRY.fallback("triton", "torch", "cuda", e)
    if log:
        _REGISTRY.log_choice(name, dev.type, "the device's default")
    return name


def check_backend_device(name: str, device) -> None:
    """A kernel backend on a CPU tensor needs the interpreter (contract section 8)."""
    if name == "triton" and torch.device(device).type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError("backend 'triton' on CPU tensors runs in Triton's interpreter: set "
                           "TRITON_INTERPRET=1 before importing torch_lora (or use CUDA tensors)")


def resolve(backend: str | None, device, *, deterministic: bool = False):
    name = backend if backend is not None else default_backend_name(device, log=True)
    check_backend_device(name, device)
    impl = load_backend(name)
    return deterministic_impl(impl) if check_deterministic(deterministic) else impl


def deterministic_impl(impl):
    """The batch-invariant form of backend module `impl`: its own `deterministic_backend()`
    (Triton: fixed launch configs), else the reference math of `torch_lora.ops.invariant`."""
    hook = getattr(impl, "deterministic_backend", None)
    return hook() if hook is not None else invariant

