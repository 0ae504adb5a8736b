"""torch's C launcher: a PreparedLinear's kernel launches as prepared C launches.

`lora_core/kernels/cuda_launch.c` keeps each kernel's parameter block, built once here from the
compiled Triton kernel's signature (`launch_spec`); a call patches the per-call values (x, y,
lora_ranks, workspace, barrier counters, scale: `float_bits`) and launches without Triton's
Python launcher. This launcher also picks each launch's programmatic-dependent flag and, for
the dependent shrink of 2-32 tokens, the dynamic shared memory that spreads its programs over the
SMs (`planning.spread_shared_bytes`, `sm_resources`, `allow_shared`).

TORCH_LORA_LAUNCHER: "c" (default: PreparedLinear's launches from C), "direct" (compiled kernels
launched from Python without Triton's launcher), "triton" (Triton's own launcher for every call).
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import struct

import triton

from lora_core.kernels import planning

_LOG = logging.getLogger("torch_lora")
LAUNCHER = os.environ.get("TORCH_LORA_LAUNCHER", "c")
if LAUNCHER not in ("c", "direct", "triton"):
    raise ValueError(f"TORCH_LORA_LAUNCHER must be 'c', 'direct' or 'triton', got {LAUNCHER!r}")

_ENABLED = [LAUNCHER == "c"]


def float_bits(v: float) -> int:
    """v's float32 bit pattern: the value a prepared launch's fp32 parameter slot takes."""
    return struct.unpack("<I", struct.pack("<f", v))[0]


def prepared_launches(steps, device: int = 0):
    """PreparedLinear's launches as C prepared launches (lora_core/kernels/cuda_launch.c): each
    kernel's parameter block built once, launched without Triton's Python launcher. None when the
    direct path is off, the C library cannot be built, or a kernel's parameters are not understood
    (then Triton's launcher keeps running them)."""
    if steps is None or not _ENABLED[0]:
        return None
    try:
        from lora_core.kernels import cuda_launch
        out = []
        for _ws_shape, launches in steps:
            specs = []
            for _run, g0, g1, g2, function, _packed, template, slots, compiled, names, plan in launches:
                spec = launch_spec(cuda_launch, compiled, names, template, dict(slots), (g0, g1, g2), function,
                                      plan, device)
                if spec is None:
                    return None
                specs.append(spec)
            out.append(cuda_launch.PreparedLaunches(specs))
        return tuple(out)
    except Exception as e:
        _ENABLED[0] = False
        _LOG.warning("the C launcher is off (launches from Python from now on): %s: %s", type(e).__name__, e)
        return None


def launch_spec(cuda_launch, compiled, names, template, slots, grid, function, plan=None, device: int = 0):
    """(function, grid, threads, shared, flags, params, slots) of one launch for cuda_launch.PreparedLaunches.

    With the launch's `plan`, this launcher spreads (`planning.pdl_launch(..., spread=True)`): a
    call's first kernel of <= spread_pdl_max_tokens tokens (the launch policy's) goes out as a programmatic dependent,
    a shrink of more than one token (`plan.spreads()`) with the shared memory of
    `planning.spread_shared_bytes`, so that its programs spread over the SMs. Without a plan the
    launch is Triton's own (its compiled launch_pdl and shared memory)."""
    md = compiled.metadata
    sig = getattr(compiled.src, "signature", None)
    if not isinstance(sig, dict) or getattr(md, "num_ctas", 1) != 1:
        return None
    if getattr(md, "global_scratch_size", 0) or getattr(md, "profile_scratch_size", 0):
        return None
    params, c_slots = [], []
    for pos, name in enumerate(names):
        ty = sig.get(name)
        if ty == "constexpr":
            continue
        if ty is None or not isinstance(ty, str):
            return None
        if pos in slots:
            c_slots.append((len(params), slots[pos]))
        v = template[pos]
        if ty.startswith("*"):
            params.append((cuda_launch.PTR, int(v)))
        elif ty in ("i32", "u32"):
            params.append((cuda_launch.I32, int(v)))
        elif ty in ("i64", "u64"):
            params.append((cuda_launch.I64, int(v)))
        elif ty == "fp32":
            params.append((cuda_launch.F32, float(v)))
        else:
            return None
    params += [(cuda_launch.NULL, 0)] * (int(hasattr(md, "global_scratch_size")) + int(hasattr(md,
                                                                                               "profile_scratch_size")))
    pdl = bool(getattr(md, "launch_pdl", False)) if plan is None else plan.pdl_for(spread=True)
    shared = int(md.shared)
    resources = sm_resources(device) if plan is not None and plan.spreads() else None
    if resources is not None:
        num_sms, max_shared = resources
        spread = planning.spread_shared_bytes(grid[0] * grid[1] * grid[2], shared, num_sms, max_shared)
        if spread != shared and allow_shared(cuda_launch, function, max_shared):
            shared = spread
    flags = (cuda_launch.FLAG_PDL if pdl else 0) | (
        cuda_launch.FLAG_COOPERATIVE if getattr(md, "launch_cooperative_grid", False) else 0)
    return (function, grid, 32 * int(md.num_warps), shared, flags, params, c_slots)


@functools.cache
def sm_resources(device: int) -> tuple | None:
    """(SMs, largest opt-in shared memory of one block in bytes) of CUDA device `device`, or None
    (said once) where this Triton cannot tell: dependent shrinks then go out unspread."""
    try:
        props = triton.runtime.driver.active.utils.get_device_properties(device)
        return int(props["multiprocessor_count"]), int(props["max_shared_mem"])
    except Exception as e:
        _LOG.warning("spreading dependent shrinks over the SMs is off (device %s properties: %s: %s)", device,
                     type(e).__name__, e)
        return None


_SHARED_ALLOWED: set = set()


def allow_shared(cuda_launch, function: int, max_shared: int) -> bool:
    """Lets `function` take up to max_shared bytes of dynamic shared memory (once per function)."""
    if function not in _SHARED_ALLOWED:
        r = cuda_launch.plain_library().jl_allow_shared(ctypes.c_void_p(function), int(max_shared))
        if r:
            _LOG.warning("spreading a dependent shrink's programs is off for this kernel: "
                         "cuFuncSetAttribute returned %s", r)
            return False
        _SHARED_ALLOWED.add(function)
    return True
