"""Zero-copy exchange of tensors between torch and JAX through DLPack (contract section 6 and 8).

    to_jax(x: torch.Tensor, *, copy=False, stream=None) -> jax.Array
    to_torch(x: jax.Array, *, copy=False, stream=None) -> torch.Tensor

The result shares the input's memory: pointer identity holds (`to_jax(t).unsafe_buffer_pointer()
== t.data_ptr()`), nothing is copied, on the CPU and on CUDA, for every dtype the contract uses (float32,
bfloat16, float16, int32, int8, uint8, bool, float8_e4m3fn (fp8 adapter weights); int64/float64 only
with `jax_enable_x64`).

What cannot be shared without a copy is refused with `CopyRequiredError` (a ValueError naming the
tensor's shape, strides, dtype or address and the rule it breaks), unless `copy=True` permits a copy
(contract section 8: `copy=True` permits a copy where zero-copy is impossible; a shareable tensor is
still shared):
  * strided views that are not a permutation of a dense block (`t[:, ::2]`, `t[:, 3:]`, `expand`):
    XLA buffers have no strides, only a dense layout (transposes are fine);
  * CPU tensors whose data pointer is not 64-byte aligned (JAX's CPU runtime requires 64; tensors
    from `torch.from_numpy` usually sit at 16 mod 64), CUDA tensors not 16-byte aligned (XLA's
    GPU kernels assume aligned parameters);
  * int64 / float64 / complex128 while `jax_enable_x64` is off: JAX would silently make a
    32-bit copy. With `copy=True` the tensor is converted on its device with an explicit
    `.to(int32)` (and so on), which is what the contract wants for index tensors (int32 everywhere);
    int64 values outside int32 are refused (ValueError) rather than wrapped, and finite float64
    values beyond float32's range rather than made infinite (reading the range is a device sync
    on CUDA);
  * tensors that require grad (autograd's view of them would silently diverge from JAX's), and
    tensors with the conjugate/negative bit set: with `copy=True`, a detached/resolved copy.
In the other direction every single-device CPU/GPU `jax.Array` is shareable; arrays sharded over
several devices, on a TPU, or of a dtype torch lacks are refused (`copy=True`: gathered/moved).

Stream ordering on CUDA (DLPack's rule is "the consumer waits for the producer"):
  * to_jax: JAX waits for the torch stream that *produced* `x`: `stream` if given (a
    `torch.cuda.Stream`), else torch's current stream on x's device. torch's own `__dlpack__` uses
    the current stream of the *current device* at export time, so JAX may read a tensor written on
    a side stream and exported outside that stream's context before the write completes: pass
    `stream=`.
    Implementation: an event recorded on the producer stream, waited on by the stream JAX uses for
    external buffers (`get_stream_for_external_ready_events`); the imported buffer's definition
    event is recorded on that stream, so every JAX computation reading it waits.
  * to_torch: the torch stream that will *consume* the tensor (`stream`, else torch's current
    stream) waits for the JAX computation that defines `x` (JAX enqueues the wait).
  * On the CPU there is nothing to order: exporting a JAX array waits until it is computed.

Sharing is sharing: a torch in-place write into a tensor exported to JAX changes the JAX value, and
a JAX array exported to torch must be treated as read-only by torch code (JAX assumes immutability).
A tensor from `to_torch` holds its own reference to the JAX buffer: deleting (or donating) the source
array afterwards leaves the tensor valid (a GPU refuses the donation while the tensor lives).
The cross-side wrappers never write into a shared buffer (see torch_over_jax / jax_over_torch).

Speed: the public `jnp.from_dlpack` spends most of its host time in Python (an exception on the
CPU, `jnp.asarray` and torch's `__dlpack__`); this module calls the two C++ entry points directly
(`torch._C._to_dlpack`, jaxlib's `dlpack_managed_tensor_to_buffer`, and back
`buffer_to_dlpack_managed_tensor`, `torch._C._from_dlpack`). If a future jaxlib changes
those private signatures, it falls back to the public `jax.dlpack.from_dlpack` /
`torch.from_dlpack` with the same checks and stream handling (slower, same results).
"""

from __future__ import annotations

import logging
import threading
import weakref
from collections.abc import Callable
from typing import Any

import jax
import torch

_LOG = logging.getLogger("bridge")

__all__ = ["to_jax", "to_torch", "CopyRequiredError", "ConversionCache", "jax_device_for",
           "torch_device_for", "shareable_problem"]


class CopyRequiredError(ValueError):
    """The tensor cannot be shared without a copy, and the caller did not pass copy=True."""


# Data-pointer alignment JAX requires to wrap a foreign buffer (bytes), per torch device type.
ALIGNMENT = {"cpu": 64, "cuda": 16}

_TORCH_TO_JAX_DTYPE = {
    torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16",
    torch.int32: "int32", torch.int16: "int16", torch.int8: "int8", torch.uint8: "uint8",
    torch.bool: "bool", torch.int64: "int64", torch.float64: "float64", torch.complex64: "complex64",
    torch.complex128: "complex128", torch.float8_e4m3fn: "float8_e4m3fn",
}
# 64-bit dtypes JAX keeps only with jax_enable_x64, and the 32-bit dtype JAX would otherwise use.
_X64_NARROW = {torch.int64: torch.int32, torch.float64: torch.float32, torch.complex128: torch.complex64}
_JAX_TO_TORCH_DTYPE = {
    "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "int32": torch.int32,
    "int16": torch.int16, "int8": torch.int8, "uint8": torch.uint8, "bool": torch.bool,
    "int64": torch.int64, "float64": torch.float64, "complex64": torch.complex64,
    "complex128": torch.complex128, "float8_e4m3fn": torch.float8_e4m3fn,
}
_DL_CPU, _DL_CUDA = 1, 2  # DLDeviceType codes
_INT32_MIN, _INT32_MAX = -(2 ** 31), 2 ** 31 - 1


# ----------------------------------------------------------------------------- private fast path

try:  # jaxlib's C++ DLPack entry points (what jax.dlpack wraps in Python)
    from jax._src.lib import _jax as _jaxlib
    _IMPORT = getattr(_jaxlib, "dlpack_managed_tensor_to_buffer", None)
    _EXPORT = getattr(_jaxlib, "buffer_to_dlpack_managed_tensor", None)
except ImportError:  # pragma: no cover - very different jaxlib
    _IMPORT = _EXPORT = None
_TO_DLPACK = getattr(torch._C, "_to_dlpack", None)
_FROM_DLPACK = getattr(torch._C, "_from_dlpack", None)
_fast = {"import": _IMPORT is not None and _TO_DLPACK is not None,
         "export": _EXPORT is not None and _FROM_DLPACK is not None}


def _import_capsule(capsule, device, stream, dl_type: int):
    """jaxlib: DLPack capsule -> jax.Array sharing its memory (copy forbidden)."""
    try:
        return _IMPORT(capsule, device, stream, False, dl_type)
    except TypeError:  # older 4-argument signature
        return _IMPORT(capsule, device, stream, False)


# ----------------------------------------------------------------------------- devices

_jax_devices: dict = {}


def jax_device_for(device) -> jax.Device:
    """The JAX device holding the memory of a torch device ("cpu", "cuda:1", torch.device)."""
    dev = torch.device(device)
    key = (dev.type, dev.index)
    found = _jax_devices.get(key)
    if found is not None:
        return found
    if dev.type == "cpu":
        found = jax.devices("cpu")[0]
    elif dev.type == "cuda":
        index = dev.index if dev.index is not None else torch.cuda.current_device()
        try:
            gpus = jax.devices("gpu")
        except RuntimeError:
            gpus = []
        found = next((d for d in gpus if getattr(d, "local_hardware_id", d.id) == index), None)
        if found is None:
            raise CopyRequiredError(f"JAX has no CUDA device for torch device {dev} (JAX devices: "
                                    f"{jax.devices()}); install jax with CUDA, or pass copy=True to "
                                    "move the tensor to the host")
    else:
        raise CopyRequiredError(f"torch device type {dev.type!r} cannot be shared with JAX (only cpu and "
                                "cuda); pass copy=True to move the tensor to the host")
    _jax_devices[key] = found
    return found


def default_jax_device():
    """JAX's default device where arrays are created now: the `jax.default_device` context or
    setting when one is in force, else the first device of the default backend."""
    chosen = jax.config.jax_default_device
    if chosen is None:
        return jax.devices()[0]
    if isinstance(chosen, str):
        platform = chosen.split(":")[0].lower()
        platform = "gpu" if platform == "cuda" else platform
        return jax.devices(platform)[int(chosen.split(":")[1]) if ":" in chosen else 0]
    return chosen


def torch_device_for(device) -> torch.device:
    """The torch device holding the memory of a JAX device (or platform string, or None: JAX's
    default device, `default_jax_device()`)."""
    if device is None:
        device = default_jax_device()
    if isinstance(device, str):
        platform = device.split(":")[0].lower()
        index = int(device.split(":")[1]) if ":" in device else 0
        if platform == "cpu":
            return torch.device("cpu")
        if platform in ("gpu", "cuda"):
            device = jax.devices("gpu")[index]
        else:
            raise ValueError(f"JAX platform {platform!r} has no torch equivalent (only cpu and gpu)")
    platform = device.platform
    if platform == "cpu":
        return torch.device("cpu")
    if platform in ("gpu", "cuda"):
        return torch.device("cuda", getattr(device, "local_hardware_id", device.id))
    raise ValueError(f"JAX device {device} ({platform}) has no torch equivalent: torch cannot hold its "
                     "memory (only cpu and gpu)")


# ----------------------------------------------------------------------------- streams

_tls = threading.local()
_jax_streams: dict = {}


def _jax_ready_stream(jdev) -> int:
    """The CUDA stream JAX records external buffers' definition events on (per JAX device)."""
    s = _jax_streams.get(jdev)
    if s is None:
        s = _jax_streams[jdev] = int(jdev.get_stream_for_external_ready_events())
    return s


def _wait_for_producer(jax_stream: int, producer: torch.cuda.Stream, device: torch.device) -> None:
    """Makes `jax_stream` wait for the work enqueued so far on torch stream `producer`."""
    cache = getattr(_tls, "events", None)
    if cache is None:
        cache = _tls.events = {}
    key = (device.index, jax_stream)
    entry = cache.get(key)
    if entry is None:
        entry = cache[key] = (torch.cuda.Event(), torch.cuda.ExternalStream(jax_stream, device=device))
    event, external = entry
    # An event may be recorded again once a wait on it is enqueued: the wait keeps the old state.
    event.record(producer)
    external.wait_event(event)


def current_stream(index: int) -> torch.cuda.Stream:
    """torch's current stream on CUDA device `index`, as a Stream object.

    `torch.cuda.current_stream` builds a new Python object per call; this reads the raw handle
    (one C call) and keeps one ExternalStream per handle (per thread)."""
    raw = torch._C._cuda_getCurrentRawStream(index)
    cache = getattr(_tls, "streams", None)
    if cache is None:
        cache = _tls.streams = {}
    s = cache.get((index, raw))
    if s is None:
        if len(cache) > 256:
            cache.clear()
        dev = torch.device("cuda", index)
        s = cache[(index, raw)] = (torch.cuda.current_stream(dev) if raw == 0  # the legacy default stream
                                   else torch.cuda.ExternalStream(raw, device=dev))
    return s


def _consumer_stream_ptr(stream, device: torch.device) -> int:
    if stream is None:
        index = device.index if device.index is not None else torch.cuda.current_device()
        ptr = torch._C._cuda_getCurrentRawStream(index)
    else:
        ptr = int(stream.cuda_stream) if not isinstance(stream, int) else stream
    return 1 if ptr == 0 else ptr  # DLPack: 1 names CUDA's legacy default stream


# ----------------------------------------------------------------------------- checks

def _is_compact(shape, strides) -> bool:
    """True when the strides are a permutation of a dense layout (what XLA can wrap).

    Size-1 dimensions are ignored (their stride is never used). Checked against jaxlib's importer
    on 3000 random permuted/sliced/expanded/stepped views (tests/test_bridge.py keeps a sample).
    """
    expected = 1
    for stride, size in sorted((s, n) for n, s in zip(shape, strides) if n != 1):
        if stride != expected:
            return False
        expected *= size
    return True


def shareable_problem(x: torch.Tensor) -> str | None:
    """Why `x` cannot be shared with JAX without a copy, or None when it can."""
    if x.requires_grad:
        return "it requires grad (detach it: JAX would not see autograd's updates)"
    if x.layout != torch.strided:
        return f"its layout is {x.layout} (only strided tensors have a DLPack form)"
    if x.is_conj() or x.is_neg():
        return "it has the conjugate/negative bit set (call resolve_conj()/resolve_neg())"
    if x.dtype not in _TORCH_TO_JAX_DTYPE:
        return f"dtype {x.dtype} has no JAX equivalent"
    if x.dtype in _X64_NARROW and not jax.config.jax_enable_x64:
        return (f"dtype {x.dtype} needs jax_enable_x64; without it JAX would make a "
                f"{_X64_NARROW[x.dtype]} copy (convert explicitly, e.g. x.to(torch.int32) for indices)")
    if x.device.type not in ALIGNMENT:
        return f"it is on {x.device} (JAX can share only cpu and cuda memory)"
    if x.numel() and not x.is_contiguous() and not _is_compact(x.shape, x.stride()):
        return (f"its strides {tuple(x.stride())} for shape {tuple(x.shape)} are not a permutation of a "
                "dense layout (XLA buffers have no strides; transposes are fine, steps, column slices "
                "and expand are not)")
    align = ALIGNMENT[x.device.type]
    if x.numel() and x.data_ptr() % align:
        return (f"its data pointer {x.data_ptr():#x} is not {align}-byte aligned (JAX needs {align} on "
                f"{x.device.type}; torch.from_numpy tensors and offset views often are not)")
    return None


def _check_narrowing(x: torch.Tensor, narrowed: torch.Tensor) -> None:
    """Refuses what narrowing x (int64 / float64 / complex128) changed beyond rounding: int64 values outside
    int32 (wrapped: 2**32 + 1 -> 1), finite values beyond float32's largest (made infinite). A device sync
    on CUDA (the explicit copy=True path)."""
    what = (f"cannot convert x, the {str(x.dtype)[6:]} tensor (shape {tuple(x.shape)}, device {x.device}), to JAX's "
            f"{str(narrowed.dtype)[6:]} (jax_enable_x64 is off): it holds")
    if x.dtype == torch.int64 and x.numel():
        lo, hi = (int(v) for v in torch.aminmax(x))
        if lo < _INT32_MIN or hi > _INT32_MAX:
            raise ValueError(f"{what} {lo if lo < _INT32_MIN else hi}, outside [{_INT32_MIN}, {_INT32_MAX}], which "
                             "the conversion would wrap. Enable jax_enable_x64 to share int64, or keep values in "
                             "int32 range")
    elif x.dtype != torch.int64:
        wide, thin = ((torch.view_as_real(t) if t.is_complex() else t) for t in (x, narrowed))
        overflow = torch.isinf(thin) & torch.isfinite(wide)
        if bool(overflow.any()):
            raise ValueError(f"{what} {float(wide[overflow][0])!r}, outside float32's finite range (+-"
                             f"{torch.finfo(torch.float32).max!r}), which the conversion would make infinite. Enable "
                             "jax_enable_x64 to share float64, or scale the values into float32's range")


def _copy_for_jax(x: torch.Tensor) -> torch.Tensor:
    """A shareable version of `x` (the copy=True path): the fewest changes that make it shareable."""
    if x.device.type not in ALIGNMENT:
        x = x.to("cpu")
    x = x.detach().resolve_conj().resolve_neg()
    if x.dtype in _X64_NARROW and not jax.config.jax_enable_x64:
        narrowed = x.to(_X64_NARROW[x.dtype])
        _check_narrowing(x, narrowed)
        x = narrowed
    if x.layout != torch.strided:
        x = x.to_dense()
    if shareable_problem(x) is not None:  # strides, alignment, or grad: a fresh dense tensor
        x = x.clone(memory_format=torch.contiguous_format)
    return x


# ----------------------------------------------------------------------------- to_jax

# dtypes shared as they are (64-bit ones depend on jax_enable_x64, complex on the conjugate bit).
_DIRECT = frozenset({torch.float32, torch.bfloat16, torch.float16, torch.int32, torch.int16, torch.int8,
                     torch.uint8, torch.bool, torch.float8_e4m3fn})
_STRIDED = torch.strided


def to_jax(x: torch.Tensor, *, copy: bool = False, stream: torch.cuda.Stream | None = None) -> jax.Array:
    """A `jax.Array` sharing `x`'s memory (zero-copy).

    Args:
      x: a CPU or CUDA torch.Tensor.
      copy: permit a copy when `x` cannot be shared (see the module docstring); a shareable tensor
        is shared even then.
      stream: CUDA only: the torch stream that produced `x` (default: torch's current stream on
        x's device). JAX's use of the result waits for it.
    Returns: a jax.Array on the JAX device of x's device, same shape; same dtype, except that with
      copy=True a 64-bit dtype without jax_enable_x64 becomes its 32-bit version.
    Raises: TypeError for a non-tensor; CopyRequiredError (a ValueError) for what cannot be shared
      without a copy when copy=False; ValueError, with copy=True while jax_enable_x64 is off, for
      int64 values outside int32 (they would wrap) and finite float64 / complex128 values beyond
      float32's finite range (they would become infinities).
    """
    # Fast path: the common shareable case in a few attribute reads; anything
    # unusual goes through shareable_problem, which also writes the error message.
    if (isinstance(x, torch.Tensor) and x.dtype in _DIRECT and not x.requires_grad and x.layout is _STRIDED
            and not x.is_neg()):
        cuda = x.is_cuda
        if (cuda or x.is_cpu) and x.data_ptr() % (16 if cuda else 64) == 0 and (
                x.is_contiguous() or _is_compact(x.shape, x.stride())):
            return _share_or_move(x, stream, cuda, copy)
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"to_jax expects a torch.Tensor, got {type(x).__name__}")
    problem = shareable_problem(x)
    if problem is not None:
        if not copy:
            raise CopyRequiredError(f"cannot share the torch tensor (shape {tuple(x.shape)}, dtype {x.dtype}, "
                                    f"device {x.device}) with JAX without a copy: {problem}. Pass copy=True to "
                                    "allow a copy")
        if x.device.type == "cuda":
            with torch.cuda.stream(stream if stream is not None else torch.cuda.current_stream(x.device)):
                x = _copy_for_jax(x)  # ordered after the producer's work, on the producer's stream
        else:
            x = _copy_for_jax(x)
    return _share_or_move(x, stream, x.is_cuda, copy)


def _share_or_move(x: torch.Tensor, stream, cuda: bool, copy: bool) -> jax.Array:
    """Shares x; a CUDA tensor JAX has no device for (a CPU-only jax) is moved to the host if copy."""
    try:
        return _share_with_jax(x, stream, cuda)
    except CopyRequiredError:
        if not (copy and cuda):
            raise
        with torch.cuda.stream(stream if stream is not None else torch.cuda.current_stream(x.device)):
            host = x.to("cpu")  # synchronous: ordered after the producer stream's work
        return _share_with_jax(_copy_for_jax(host), None, False)


_jdev_by_index: dict = {}


def _share_with_jax(x: torch.Tensor, stream, cuda: bool) -> jax.Array:
    """Exports a shareable tensor; orders JAX after the producer stream on CUDA."""
    index = x.get_device()  # -1 on the CPU
    jdev = _jdev_by_index.get(index)
    if jdev is None:
        jdev = _jdev_by_index[index] = jax_device_for(x.device)
    producer = None
    if cuda:
        producer = stream if stream is not None else current_stream(index)
    if _fast["import"]:
        jstream = None
        if cuda:
            jstream = _jax_ready_stream(jdev)
            _wait_for_producer(jstream, producer, x.device)
        try:
            return _import_capsule(_TO_DLPACK(x), jdev, jstream, _DL_CUDA if cuda else _DL_CPU)
        except TypeError as e:
            _fast_path_off("import", e)
    return jax.dlpack.from_dlpack(_Exported(x, producer), copy=False)


class _Exported:
    """DLPack producer for the public fallback: orders JAX's stream after the real producer stream."""

    def __init__(self, x: torch.Tensor, producer):
        self._x, self._producer = x, producer

    def __dlpack_device__(self):
        return self._x.__dlpack_device__()

    def __dlpack__(self, stream=None, **kwargs):
        if self._producer is None:  # CPU
            return self._x.__dlpack__()
        if stream is not None and stream != -1:  # the stream JAX will record the buffer's readiness on
            _wait_for_producer(int(stream), self._producer, self._x.device)
        # -1: torch adds no synchronisation of its own (it would wait on the *current* stream only).
        return self._x.__dlpack__(stream=-1)


# ----------------------------------------------------------------------------- to_torch

try:  # the concrete array type (no array is created: that would initialise JAX's backend at import)
    from jax._src.array import ArrayImpl as _ARRAY_IMPL
except ImportError:  # pragma: no cover - the fast path's type test then never matches
    _ARRAY_IMPL = None
# A second array object over the same buffer (what jax's own to_dlpack exports): the DLPack capsule,
# and so the torch tensor, holds that object's reference, so `x.delete()` on the caller's array
# leaves the buffer alive. Exporting `x` itself would put a usage hold on x's buffer, and deleting x
# while torch holds it aborts the process (a jaxlib check failure).
_SHARD = getattr(_ARRAY_IMPL, "_fully_replicated_shard", None)


def _export_alias(x):
    if _SHARD is not None:
        try:
            return _SHARD(x)
        except Exception:
            pass
    return x.addressable_data(0)
_SINGLE = jax.sharding.SingleDeviceSharding
_JAX_DTYPES = {jax.numpy.dtype(k): v for k, v in _JAX_TO_TORCH_DTYPE.items()}
_targets: dict = {}  # JAX device -> (is_cuda, torch device), for shareable devices


def _target(device) -> tuple | None:
    found = _targets.get(device)
    if found is None:
        platform = device.platform
        if platform not in ("cpu", "gpu", "cuda"):
            return None
        found = _targets[device] = (platform != "cpu", torch_device_for(device))
    return found


def to_torch(x: jax.Array, *, copy: bool = False, stream: torch.cuda.Stream | None = None) -> torch.Tensor:
    """A torch.Tensor sharing `x`'s memory (zero-copy). Treat it as read-only: JAX arrays are immutable.

    Args:
      x: a concrete, single-device jax.Array on a CPU or GPU (not a tracer: call outside jit).
      copy: permit a copy when `x` cannot be shared (sharded over several devices, on a TPU): the
        array is gathered to one device / moved to the host first.
      stream: CUDA only: the torch stream that will consume the tensor (default: torch's current
        stream on the device); it waits for the JAX computation defining `x`.
    Returns: a tensor of the same shape and dtype on the torch device of x's device.
    """
    if type(x) is _ARRAY_IMPL and _fast["export"]:
        sharding = x.sharding
        target = _target(sharding._device) if type(sharding) is _SINGLE else None
        if target is not None and x.dtype in _JAX_DTYPES:
            cuda, tdev = target
            try:
                ptr = _consumer_stream_ptr(stream, tdev) if cuda else None
                return _FROM_DLPACK(_EXPORT(_export_alias(x), stream=ptr))
            except TypeError as e:
                _fast_path_off("export", e)
            except Exception:
                pass
    if isinstance(x, jax.core.Tracer):
        raise TypeError("to_torch needs a concrete jax.Array; it cannot run inside jax.jit (got a tracer: "
                        "call it outside jit)")
    if not isinstance(x, jax.Array):
        raise TypeError(f"to_torch expects a jax.Array, got {type(x).__name__}")
    problem = _torch_share_problem(x)
    if problem is not None:
        if not copy:
            raise CopyRequiredError(f"cannot share the JAX array (shape {x.shape}, dtype {x.dtype}, sharding "
                                    f"{x.sharding}) with torch without a copy: {problem}. Pass copy=True to "
                                    "allow a copy")
        x = _copy_for_torch(x)
    device = next(iter(x.devices()))
    cuda, tdev = _target(device)
    ptr = _consumer_stream_ptr(stream, tdev) if cuda else None
    if _fast["export"]:
        try:
            return _FROM_DLPACK(_EXPORT(_export_alias(x), stream=ptr))
        except TypeError as e:
            _fast_path_off("export", e)
    capsule = x.__dlpack__(stream=ptr) if cuda else x.__dlpack__()
    return torch.utils.dlpack.from_dlpack(capsule)


def _fast_path_off(direction: str, error: Exception) -> None:
    """The private jaxlib DLPack path of `direction` is off from now on (a jaxlib with another
    signature): the public DLPack protocol is used instead, and the logger says so once."""
    _fast[direction] = False
    _LOG.warning("DLPack %s: jaxlib's private fast path failed (%s: %s); the public DLPack protocol is used "
                 "from now on", direction, type(error).__name__, error)


def _torch_share_problem(x: jax.Array) -> str | None:
    if x.is_deleted():
        return "it was deleted (or donated)"
    devices = x.devices()
    if len(devices) != 1:
        return f"it is sharded over {len(devices)} devices (a torch tensor lives on one)"
    platform = next(iter(devices)).platform
    if platform not in ("cpu", "gpu", "cuda"):
        return f"it is on a {platform} device, whose memory torch cannot hold"
    if str(x.dtype) not in _JAX_TO_TORCH_DTYPE:
        return f"dtype {x.dtype} has no torch equivalent in the bridge"
    return None


def _copy_for_torch(x: jax.Array) -> jax.Array:
    if x.is_deleted():
        raise ValueError("the JAX array was deleted (or donated): there is nothing to copy")
    devices = x.devices()
    platform = next(iter(devices)).platform
    if platform not in ("cpu", "gpu", "cuda"):
        x = jax.device_put(x, jax.devices("cpu")[0])
    elif len(devices) != 1:
        x = jax.device_put(x, sorted(devices, key=lambda d: d.id)[0])
    if str(x.dtype) not in _JAX_TO_TORCH_DTYPE:
        raise TypeError(f"dtype {x.dtype} has no torch equivalent; convert it in JAX first")
    return x


# ----------------------------------------------------------------------------- cache of persistent tensors

class ConversionCache:
    """Converted persistent tensors (stacked weights), reused until the source changes.

    An entry is keyed by the source object's identity and holds a weak reference to it, so a dead
    source never matches (an `id` reused by a new object finds a dead reference) and its entry is
    dropped when it dies. A torch source also records what an in-place change or a storage swap
    alters: its `_version` counter (bumped by every in-place op, on the tensor or any view of it),
    data pointer, shape, strides and dtype; any difference means "convert again". Inference tensors
    (`torch.inference_mode`) have no version counter: their entries are still checked on pointer,
    shape and strides, and since the conversion shares memory, in-place updates stay visible.
    JAX arrays are immutable: identity is enough. Never keyed on a data pointer alone (stale when
    memory is reused).

    Only conversions that share the source's memory are kept. A copy (what `to_jax(copy=True)`
    makes of a tensor it cannot share) is returned but not kept: writes that torch's version
    counter does not see (through `.data`, a NumPy alias of a `torch.from_numpy` tensor, an
    inference tensor) would leave a kept copy stale, so such a source is converted on every call.
    """

    def __init__(self):
        self._entries: dict = {}

    def __len__(self) -> int:
        return len(self._entries)

    def clear(self) -> None:
        self._entries.clear()

    def get(self, source: Any, convert: Callable[..., Any], *args: Any) -> Any:
        """`convert(source, *args)`, from the cache when `source` is unchanged since it was converted."""
        key = id(source)
        stamp = _stamp(source)
        entry = self._entries.get(key)
        if entry is not None and entry[1] == stamp and entry[0]() is source:
            return entry[2]
        # A torch source is converted through a detached alias (same storage and version counter, a
        # new TensorImpl): the DLPack capsule then holds the alias, not the source's TensorImpl, which
        # would keep the source's Python object alive (torch preserves it while C++ holds the impl),
        # so its weak reference would never die and the entry would leak.
        value = convert(source.detach() if isinstance(source, torch.Tensor) else source, *args)
        if not _shares_memory(source, value):
            if entry is not None:
                del self._entries[key]
            return value
        entries = self._entries

        def forget(ref, key=key, entries=entries):
            current = entries.get(key)
            if current is not None and current[0] is ref:
                del entries[key]

        self._entries[key] = (weakref.ref(source, forget), stamp, value)
        return value


def _shares_memory(source: Any, value: Any) -> bool:
    """Whether the conversion of a torch tensor to a jax.Array is a view of the tensor's memory (True for
    anything else: JAX sources are immutable)."""
    if not isinstance(source, torch.Tensor) or not isinstance(value, jax.Array):
        return True
    if source.numel() == 0:
        return True
    try:
        return value.unsafe_buffer_pointer() == source.data_ptr()
    except Exception:
        return False


def _stamp(source: Any) -> tuple:
    if isinstance(source, torch.Tensor):
        try:
            version = source._version
        except RuntimeError:  # inference tensors do not track versions
            version = None
        # The pointer also changes with the device; dtype and shape changes without a new pointer
        # need `.data =`/`set_` tricks, still caught by shape and strides.
        return (version, source.data_ptr(), source.shape, source.stride(), source.dtype)
    return ()
