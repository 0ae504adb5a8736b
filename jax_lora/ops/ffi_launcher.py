"""Launching the shared Triton kernels under `jax.jit` through an XLA FFI handler.

jax_triton's `triton_call` lowers to a legacy custom call, which XLA launches from the host one at
a time and never records into its command buffers (CUDA graphs); at decode sizes that host work is
the whole cost of a LoRA layer (docs/benchmarks.md). This module instead:

  * compiles each kernel variant with Triton (`triton.compile`, specialised the way Triton's own
    JIT specialises a launch: 16-byte aligned pointers, integers equal to 1 as constants, integers
    divisible by 16 marked so except the kernels' token counts, `planning.TOKEN_COUNT_PARAMS`), and
    loads the cubin on every local CUDA device (`jl_load_kernel`);
  * lowers a call to `jax.ffi.ffi_call` of one FFI target, `jax_lora_triton_launch`, whose handler
    (`lora_core/kernels/cuda_launch.c`, built at first use with the C compiler Triton itself needs) launches one or
    more of those kernels in order on XLA's stream, with programmatic dependent launch where asked.
    The handler is declared command-buffer compatible, so XLA can capture it into its graphs.

A call is a sequence of `Launch`es. Each names the kernel, grid, warps, stages and constexprs, and
gives every non-constexpr kernel parameter in order as `Arg(i)` (operand i's pointer), `Out(j)`
(result j's pointer), `Counters(n)` (n int32 of the device's persistent barrier counters), an int
or a float. `Out(j)` may stand anywhere in the list and in several launches of one call: a kernel
that writes several buffers gets one result per buffer (the MoE LoRA kernel: its rank buffer and
y, in the middle of its parameters), and a result aliased to an operand (`input_output_aliases`)
is that operand updated in place. Kernels that need Triton's global or profile scratch memory are
refused (the LoRA kernels need none).

`available()` says whether the launcher can be used here (a CUDA backend and a C compiler);
jax_lora's backend "triton" falls back to jax_triton otherwise, or when JAX_LORA_TRITON_LAUNCHER=jax_triton.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import hashlib
import os
import threading
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import numpy as np

from lora_core.kernels import cuda_launch
from lora_core.kernels.planning import TOKEN_COUNT_PARAMS

TARGET = "jax_lora_triton_launch"
_TRITON_TYPES = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32", "float64": "fp64",
                 "int8": "i8", "int16": "i16", "int32": "i32", "int64": "i64", "uint8": "u8",
                 "uint16": "u16", "uint32": "u32", "uint64": "u64", "bool": "i1",
                 "float8_e4m3fn": "fp8e4nv"}     # fp8 adapter weights (contract section 11)
# parameter kinds of the handler's `params` attribute (cuda_launch.c)
_ARG, _OUT, _I32, _F32, _I64, _NULL = (cuda_launch.ARG, cuda_launch.OUT, cuda_launch.I32, cuda_launch.F32,
                                       cuda_launch.I64, cuda_launch.NULL)
_COUNTERS, _ARG_AT = cuda_launch.COUNTERS, cuda_launch.ARG_AT
_LOCK = threading.Lock()
_KEY_LOCKS: dict = {}       # compile key -> its lock (_compile)
_LIB_LOCK = threading.Lock()
_LIBRARY: list = []         # the handler library once built (_library)


def _ensure_counters(ints: int) -> None:
    """Every local GPU's barrier-counter buffer holds at least `ints` int32 (at trace time)."""
    devices = _gpu_devices()
    if not devices:
        return
    lib = _library()
    err = ctypes.create_string_buffer(512)
    for d in devices:
        if lib.jl_ensure_counters(int(d.local_hardware_id), int(ints), err, len(err)):
            raise RuntimeError(err.value.decode())


class Arg(NamedTuple):
    """A kernel pointer parameter: operand `index` of the call, `offset` bytes into it (a view,
    e.g. one slice of stacked weights; 0 <= offset < the operand's size, index < 2**16)."""
    index: int
    offset: int = 0


class Counters(NamedTuple):
    """An int32 pointer parameter: `ints` barrier counters of the device's persistent, zeroed-once
    buffer (cuda_launch.c `jl_ensure_counters`; for kernels that leave them as they found them)."""
    ints: int


class Out(NamedTuple):
    """A kernel pointer parameter: result `index` of the call."""
    index: int


@dataclasses.dataclass(frozen=True)
class Launch:
    """One kernel launch of a call.

    params: one entry per non-constexpr parameter of `kernel`, in order (Arg, Out, int or float).
    zero_out: index of a result to set to zero on the stream before this launch (-1: none).
    pdl: launch as a programmatic dependent of the previous kernel on the stream (Hopper+).
    cooperative: a cooperative launch (the driver refuses a grid that cannot be co-resident).
    """
    kernel: Any
    grid: tuple
    num_warps: int
    num_stages: int
    constexprs: dict
    params: tuple
    zero_out: int = -1
    pdl: bool = False
    cooperative: bool = False


def launcher_choice() -> str:
    """'ffi' (default) or 'jax_triton' (JAX_LORA_TRITON_LAUNCHER)."""
    choice = os.environ.get("JAX_LORA_TRITON_LAUNCHER", "ffi")
    if choice not in ("ffi", "jax_triton"):
        raise ValueError(f"JAX_LORA_TRITON_LAUNCHER must be 'ffi' or 'jax_triton', got {choice!r}")
    return choice


def _library() -> ctypes.CDLL:
    """The handler library, built and registered with XLA once per process (thread-safe: warm-up
    threads may reach it together)."""
    if _LIBRARY:
        return _LIBRARY[0]
    with _LIB_LOCK:
        if not _LIBRARY:
            lib = cuda_launch.load_library(xla_ffi=True)          # verified, rebuilt when damaged
            from jaxlib import xla_client
            traits = xla_client.CustomCallTargetTraits.COMMAND_BUFFER_COMPATIBLE
            jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(lib.jl_triton_launch), platform="CUDA",
                                        api_version=1, traits=traits)
            _LIBRARY.append(lib)
    return _LIBRARY[0]


def handler_calls() -> int:
    """How many times XLA has run the handler (execute stage) in this process: launches replayed
    from XLA's command buffers do not count, recorded or eagerly issued ones do (diagnostics)."""
    lib = _library()
    lib.jl_handler_calls.restype = ctypes.c_int64
    return int(lib.jl_handler_calls())


def _gpu_devices() -> list:
    return [d for d in jax.local_devices() if d.platform == "gpu"]


def available() -> bool:
    """True when calls can go through the FFI launcher: CUDA devices, Triton's CUDA backend, a C compiler."""
    return not unavailable_reason()


@functools.cache
def unavailable_reason() -> str:
    """Why the FFI launcher cannot be used here ("" when it can); logged once by the caller."""
    if launcher_choice() != "ffi":
        return "JAX_LORA_TRITON_LAUNCHER=jax_triton"
    devices = _gpu_devices()
    if not devices:
        return "no GPU device"
    if "cuda" not in devices[0].client.platform_version.lower():
        return f"not a CUDA GPU ({devices[0].client.platform_version})"
    try:
        _library()
    except Exception as e:
        return f"the FFI handler could not be built or registered: {type(e).__name__}: {e}"
    return ""


def _triton_type(dtype) -> str:
    return _TRITON_TYPES[np.dtype(dtype).name]


class _Compiled(NamedTuple):
    id: int
    shared: int
    threads: int
    scratch: int  # trailing null pointers (Triton's global / profile scratch parameters)


_COMPILED: dict = {}


def _specialise(launch: Launch, operands, results):
    """(signature, constexprs, attrs, passed) the way Triton's JIT specialises this launch (ints
    equal to 1 are constants; ints divisible by 16 get the divisibility hint, except the token
    counts the kernels compile without it, planning.TOKEN_COUNT_PARAMS; pointers are aligned).

    passed: (kind, value) per kernel parameter handed to the handler (ints equal to 1 become
    constants and are not passed)."""
    names = launch.kernel.arg_names
    free = [n for n in names if n not in launch.constexprs]
    if len(free) != len(launch.params):
        raise ValueError(f"{launch.kernel.__name__}: {len(launch.params)} parameters given for {len(free)} "
                         f"non-constexpr kernel parameters")
    sig, consts, attrs, passed = {}, {}, {}, []
    values = dict(zip(free, launch.params))
    for i, name in enumerate(names):
        if name in launch.constexprs:
            sig[name] = "constexpr"
            consts[(i,)] = launch.constexprs[name]
            continue
        v = values[name]
        if isinstance(v, (Arg, Out)):
            aval = operands[v.index] if isinstance(v, Arg) else results[v.index]
            sig[name] = "*" + _triton_type(aval.dtype)
            offset = v.offset if isinstance(v, Arg) else 0
            if offset % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]          # XLA buffers are >= 16-byte aligned
            if offset:
                if not 0 <= v.index < 1 << 16 or offset < 0:
                    raise ValueError(f"{launch.kernel.__name__}.{name}: view of operand {v.index} at byte "
                                     f"offset {offset} cannot be encoded")
                passed.append((_ARG_AT, v.index | offset << 16))
            else:
                passed.append((_ARG if isinstance(v, Arg) else _OUT, v.index))
        elif isinstance(v, Counters):
            sig[name] = "*i32"
            attrs[(i,)] = [["tt.divisibility", 16]]
            passed.append((_COUNTERS, 0))
            _ensure_counters(v.ints)
        elif isinstance(v, (bool, np.bool_)):
            raise TypeError(f"{launch.kernel.__name__}.{name}: pass booleans as constexprs")
        elif isinstance(v, (int, np.integer)):
            v = int(v)
            if v == 1:
                sig[name] = "constexpr"
                consts[(i,)] = 1
                continue
            wide = not -2 ** 31 <= v < 2 ** 31
            sig[name] = "i64" if wide else "i32"
            if v % 16 == 0 and name not in TOKEN_COUNT_PARAMS:
                attrs[(i,)] = [["tt.divisibility", 16]]
            passed.append((_I64 if wide else _I32, v))
        elif isinstance(v, (float, np.floating)):
            sig[name] = "fp32"
            passed.append((_F32, int(np.array(v, np.float32).view(np.int32))))
        else:
            raise TypeError(f"{launch.kernel.__name__}.{name}: unsupported parameter {type(v).__name__}")
    return sig, consts, attrs, passed


def _capability() -> int:
    major, minor = (int(p) for p in _gpu_devices()[0].compute_capability.split("."))
    return 10 * major + minor


def _compile(launch: Launch, sig: dict, consts: dict, attrs: dict) -> _Compiled:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    cc = _capability()
    key = (launch.kernel.__module__, launch.kernel.__name__, tuple(sig.items()), tuple(sorted(consts.items())),
           tuple(sorted((k, str(v)) for k, v in attrs.items())), launch.num_warps, launch.num_stages, cc)
    hit = _COMPILED.get(key)
    if hit is not None:
        return hit
    with _LOCK:
        key_lock = _KEY_LOCKS.setdefault(key, threading.Lock())
    # One compile per variant; different variants compile concurrently (Triton's compiler and
    # ptxas release the GIL: jax_lora.warmup compiles from several threads).
    with key_lock:
        hit = _COMPILED.get(key)
        if hit is not None:
            return hit
        with _LOCK:
            if os.environ.get("TRITON_CACHE_DIR") == "":
                # jax_triton sets it to "" when imported; Triton then cannot compile ("Could not
                # create or locate cache dir")
                os.environ.pop("TRITON_CACHE_DIR")
        src = ASTSource(launch.kernel, sig, constexprs=consts, attrs=attrs)
        compiled = triton.compile(src, target=GPUTarget("cuda", cc, 32),
                                  options=dict(num_warps=launch.num_warps, num_stages=launch.num_stages))
        return _register(key, compiled)


def _register(key: tuple, compiled) -> _Compiled:
    """Loads a compiled kernel into every local GPU (under the launcher's lock) and records it."""
    with _LOCK:
        md = compiled.metadata
        if getattr(md, "global_scratch_size", 0) or getattr(md, "profile_scratch_size", 0):
            raise NotImplementedError(f"{md.name} needs Triton scratch memory, which the JAX "
                                      "launcher does not provide")
        if getattr(md, "num_ctas", 1) != 1:
            raise NotImplementedError("the JAX Triton launcher launches one CTA per program")
        cubin = compiled.asm["cubin"]
        digest = hashlib.sha256(cubin + md.name.encode()).digest()
        kid = (int.from_bytes(digest[:8], "little") & (2 ** 63 - 1)) or 1
        lib = _library()
        err = ctypes.create_string_buffer(512)
        for d in _gpu_devices():
            if lib.jl_load_kernel(kid, cubin, md.name.encode(), int(md.shared), int(d.local_hardware_id),
                                  err, len(err)):
                raise RuntimeError(err.value.decode())
        scratch = int(hasattr(md, "global_scratch_size")) + int(hasattr(md, "profile_scratch_size"))
        hit = _Compiled(kid, int(md.shared), 32 * int(md.num_warps), scratch)
        _COMPILED[key] = hit
        return hit


def call(launches: Sequence[Launch], operands: Sequence[jax.Array], result_shapes: Sequence[jax.ShapeDtypeStruct],
         input_output_aliases: dict | None = None) -> list:
    """Runs `launches` in order on XLA's stream; the results (list, one per result_shapes)."""
    kernels, launch_attr, params = [], [], []
    for ln in launches:
        sig, consts, attrs, passed = _specialise(ln, operands, result_shapes)
        c = _compile(ln, sig, consts, attrs)
        passed = passed + [(_NULL, 0)] * c.scratch
        grid = tuple(ln.grid) + (1,) * (3 - len(ln.grid))
        kernels.append(c.id)
        flags = (cuda_launch.FLAG_PDL if ln.pdl else 0) | (cuda_launch.FLAG_COOPERATIVE if ln.cooperative else 0)
        launch_attr += [*grid, c.threads, c.shared, flags, len(passed), ln.zero_out]
        params += [v for pair in passed for v in pair]
    fn = jax.ffi.ffi_call(TARGET, list(result_shapes), input_output_aliases=input_output_aliases or {})
    return fn(*operands, kernels=np.asarray(kernels, np.int64), launch=np.asarray(launch_attr, np.int64),
              params=np.asarray(params, np.int64))
