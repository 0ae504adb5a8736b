"""The torch API over JAX's kernels: `TorchPunicaWrapper` and torch-style ops (contract section 5, 8).

For a torch engine that wants jax_lora's kernels (its XLA and Triton paths, on the CPU or CUDA
device that holds the torch tensors; torch cannot hold TPU memory): torch tensors in and out, `y`
updated in place and returned, exactly `torch_lora`'s API. Nothing of the LoRA math lives here: each
call converts its tensors with `bridge.to_jax` (zero-copy), calls the public
`jax_lora.PunicaWrapper` / `jax_lora.ops`, and converts the result back with `bridge.to_torch`
(zero-copy).

    w = TorchPunicaWrapper(512, 64, "cuda", max_loras=8)           # a jax_lora.PunicaWrapper inside
    w.update_metadata(mapping, lora_index_to_id, 9, vocab_size)    # host conversion, once per step
    y = w.add_lora_linear(y, x, lora_a_stacked, lora_b_stacked, None, 1.0, (4096,))   # y in place

Per call, only the activations are converted (x, y: two exports to JAX, one import of the result)
plus one `y.copy_(result)`: JAX is functional, so the new y is computed into a JAX buffer and copied
into the caller's y, which is what "in place" costs across the bridge. Persistent tensors (stacked
weights, biases) are converted once and cached (`bridge.ConversionCache`: identity + torch
`_version` + pointer/shape/strides), so an in-place update of a weight (loading an adapter into a
slot) is picked up on the next call; a weight that `copy=True` had to copy is not cached but copied
on every call, so no write to it can be missed. `jit=True` runs each call as one compiled JAX
program (the JAX wrapper is a pytree) instead of op by op.

Semantics kept from the torch side: `sampler_indices` / `sampler_indices_padded` are not bucket-padded
(JAX pads the prompt mapping to a power of two for its compiler; these two properties are recomputed
from the unpadded mapping, lazily, once per step), and x with more rows than the mapping is an error.
Autograd: the kernels run in JAX, so nothing here is differentiable; a tensor requiring grad is
refused while grad mode is on, and detached (zero-copy) under `torch.no_grad()`/`inference_mode`.

CUDA streams: inputs are exported on torch's current stream (JAX waits for it), the result is
imported on the current stream (it waits for JAX) and copied into y there. The converted inputs are
kept alive until that wait is enqueued, and everything the JAX computation reads precedes the
result it waits for, so torch can reuse the inputs' memory right after the call.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
import torch

import jax_lora
import jax_lora.ops as jops
from lora_core import checks, segments
from lora_core.host_mapping import LoRAMapping, convert_mapping_host
from lora_core.kernel_meta import KernelMeta
from torch_lora.ops import as_slices, check_tensors, require_tensors

from .dlpack import ConversionCache, jax_device_for, to_jax, to_torch

__all__ = ["TorchPunicaWrapper", "lora_shrink", "lora_expand", "bgmv_shrink", "bgmv_expand",
           "bgmv_expand_slice", "sgmv_shrink", "sgmv_expand", "sgmv_expand_slice"]


def _usable(t: torch.Tensor, name: str) -> torch.Tensor:
    """A tensor requiring grad is detached under no_grad (zero-copy), refused otherwise."""
    if t.requires_grad:
        if torch.is_grad_enabled():
            raise ValueError(f"{name} requires grad, but the bridged kernels run in JAX and are not "
                             "differentiable: call under torch.no_grad() / torch.inference_mode(), or detach it")
        return t.detach()
    return t


def _index(t, name: str):
    """An index tensor for JAX: int64 -> int32 explicitly (the contract: int32 on every device), then shared
    (copied when it cannot be shared: index arrays are a few hundred bytes, often views at odd offsets).

    int64 values outside int32 would wrap (2**32 + 1 -> slot 1): on the CPU they are refused; on CUDA,
    where reading them would be a host sync, they are saturated to the int32 bounds, which are out of
    range for every index array, so the ops mask them like any other out-of-range index."""
    if not isinstance(t, torch.Tensor):
        return t
    if t.dtype == torch.int64:
        if t.device.type == "cpu":
            if t.numel():
                lo, hi = torch.aminmax(t)
                checks.check_int32_range(name, int(lo), int(hi))
        else:
            t = t.clamp(checks.INT32_MIN, checks.INT32_MAX)
        t = t.to(torch.int32)
    return to_jax(_usable(t, name), copy=True)


# dtypes that to_jax(copy=True) would narrow without jax_enable_x64: refused as dtypes outside the contract instead.
_WIDE = frozenset({torch.float64, torch.complex128, torch.int64})


def _check_not_wide(t: torch.Tensor, name: str, allowed) -> None:
    if t.dtype in _WIDE:
        checks.check_dtype(name, t.dtype, allowed)


def _check_scale_not_wide(t, name: str) -> None:
    """An fp8 scale of a 64-bit dtype is refused here (ValueError, as jax_lora refuses a scale of a
    wrong dtype): the conversion would narrow it to float32 in silence."""
    if isinstance(t, torch.Tensor) and t.dtype in _WIDE:
        raise ValueError(f"{name} must be float32 (fp8 weight scales, contract section 11), got dtype "
                         f"{checks.dtype_name(t.dtype)}")


# ----------------------------------------------------------------------------- wrapper

class TorchPunicaWrapper:
    """torch_lora's PunicaWrapper API (contract section 5) computed by jax_lora's kernels.

    Args:
      max_num_batched_tokens, max_batches, device, max_loras: as `torch_lora.PunicaWrapper`; `device`
        is the torch device of the tensors ("cpu" or "cuda[:i]"); the kernels run on the JAX device
        holding the same memory.
      backend: a JAX backend ("xla", "pallas_tpu", "triton"); default: chosen by the device.
      copy: permit copies of tensors that cannot be shared with JAX (bridge.to_jax's rules:
        misaligned CPU pointers, strided views, ...). Default False: such a tensor raises
        `bridge.CopyRequiredError`, so every call is known to be zero-copy. With True, a weight that
        has to be copied is copied on every call (a kept copy would miss writes through `.data` or a
        NumPy alias); shareable weights are still shared and converted once.
      jit: run each `add_*` call as one jitted JAX program (the JAX wrapper is a pytree) instead of
        op by op: one dispatch per call instead of one per op, compiled once per shape and static
        arguments (scale, output_slices, ...). Default False (what jax_lora does outside jit).
    """

    def __init__(self, max_num_batched_tokens: int, max_batches: int, device="cpu", *, max_loras: int,
                 backend: str | None = None, copy: bool = False, jit: bool = False, **options: Any):
        self.device = torch.device(device if device is not None else "cpu")
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.copy = bool(copy)
        self._cuda, self._index = self.device.type == "cuda", (self.device.index if self.device.type == "cuda" else -1)
        self.jax_wrapper = jax_lora.PunicaWrapper(max_num_batched_tokens, max_batches, jax_device_for(self.device),
                                                  max_loras=max_loras, backend=backend, **options)
        self.max_num_batched_tokens = self.jax_wrapper.max_num_batched_tokens
        self.max_batches = self.jax_wrapper.max_batches
        self.max_loras = self.jax_wrapper.max_loras
        self.backend = self.jax_wrapper.backend
        self._weights = ConversionCache()
        self.jit = bool(jit)
        self._jitted: dict = {}
        self._max_slot = -1
        self._step: tuple | None = None
        self._props: dict = {}
        self._num_tokens = 0
        self._num_rows = 0

    # ------------------------------------------------------------------ metadata
    def update_metadata(self, mapping: LoRAMapping, lora_index_to_id: Sequence[int | None], max_loras: int,
                        vocab_size: int, extra_vocab_size: int = 0, long_lora_context=None, **kwargs: Any) -> None:
        """As torch_lora's: converts the mapping on the host, uploads the step (to the JAX device)."""
        self.jax_wrapper.update_metadata(mapping, lora_index_to_id, max_loras, vocab_size, extra_vocab_size,
                                         long_lora_context, **kwargs)
        self._step = (mapping, tuple(lora_index_to_id), max_loras, vocab_size, extra_vocab_size,
                      long_lora_context)
        self._props = {}
        self._num_tokens = len(mapping.index_mapping)
        self._num_rows = len(mapping.prompt_mapping)
        # The largest slot in use, for the host check of the weights' slot count under jit (the JAX
        # wrapper checks it itself when eager; its update_metadata already rejected unknown ids).
        slot_of = {lid: slot for slot, lid in enumerate(lora_index_to_id) if lid is not None}
        used = {i for ids in mapping.index_mapping + mapping.prompt_mapping
                for i in (ids if mapping.paired else (ids,))}     # (a paired mapping: a tuple of ids each)
        self._max_slot = max((slot_of[i] for i in used if i > 0 and i in slot_of), default=-1)

    def _run(self, method: str, arrays: tuple, stacked, lora_ranks, scales=None, **static):
        """Calls the JAX wrapper's `method`: eagerly, or as one jitted program (static: hashable args).

        `lora_ranks` (a torch tensor, array-like or None) is converted here: an int32 array for JAX.
        `scales`: the fp8 scale keywords ({"lora_a_scale": ..., "lora_b_scale": ...}), converted
        already (`_scales`), passed as arrays (traced under jit) where given.
        """
        dyn = {"lora_ranks": _index(lora_ranks, "lora_ranks")}
        dyn.update({k: v for k, v in (scales or {}).items() if v is not None})
        if not self.jit:
            return getattr(self.jax_wrapper, method)(*arrays, **dyn, **static)
        first = stacked[0] if isinstance(stacked, tuple) else stacked
        if self._max_slot >= first.shape[0]:
            raise ValueError(f"the mapping uses slot {self._max_slot}, but the weights have only {first.shape[0]} "
                             f"slots (0..{first.shape[0] - 1})")
        key = (method, tuple(sorted(static.items())))
        fn = self._jitted.get(key)
        if fn is None:
            fn = self._jitted[key] = jax.jit(_method_call(method, dict(static)))
        if dyn["lora_ranks"] is not None and not isinstance(dyn["lora_ranks"], jax.Array):
            dyn["lora_ranks"] = jax.numpy.asarray(dyn["lora_ranks"], jax.numpy.int32)
        return fn(self.jax_wrapper, arrays, dyn)

    def _prop(self, name: str, make):
        value = self._props.get(name)
        if value is None:
            value = self._props[name] = make()
        return value

    def _unpadded_host(self):
        """torch-side (unpadded prompt mapping) host indices, for the two sampler properties."""
        def make():
            if self._step is None:
                empty = torch.zeros(0, dtype=torch.int32, device=self.device)
                return empty, empty
            h = convert_mapping_host(*self._step)
            return (torch.from_numpy(h.sampler_indices).to(self.device),
                    torch.from_numpy(h.sampler_indices_padded).to(self.device))
        return self._prop("host", make)

    @property
    def token_lora_indices(self) -> torch.Tensor:
        """(T,) int32 slot per token, -1 for no LoRA (shares the JAX wrapper's array)."""
        return self._prop("token", lambda: to_torch(self.jax_wrapper.token_lora_indices))

    @property
    def sampler_indices(self) -> torch.Tensor:
        """(R,) int32 slot per sampled row (R = len(prompt_mapping), not bucket-padded)."""
        return self._unpadded_host()[0]

    @property
    def sampler_indices_padded(self) -> torch.Tensor:
        """(R,) int32 flat row indices `j + p_j * R` (contract section 2), R unpadded."""
        return self._unpadded_host()[1]

    @property
    def embeddings_indices(self) -> torch.Tensor:
        """(2, T) int32 embedding-table offsets."""
        return self._prop("emb", lambda: to_torch(self.jax_wrapper.embeddings_indices))

    @property
    def long_lora_indices(self) -> torch.Tensor:
        """(T,) int32 long-context offsets (empty without a long-LoRA context)."""
        return self._prop("long", lambda: to_torch(self.jax_wrapper.long_lora_indices))

    @property
    def prefill_metadata(self) -> tuple:
        """(seq_start_locs, seq_lengths, lora_indices_per_batch, batch_size, max_length, token_nums)."""
        def make():
            starts, lengths, loras, b, max_len, n = self.jax_wrapper.prefill_metadata
            return (to_torch(starts), to_torch(lengths), to_torch(loras), int(b), int(max_len), int(n))
        return self._prop("prefill", make)

    # ------------------------------------------------------------------ conversions
    def _act(self, t, name: str, mapped: int | None = None, what: str = "tokens"):
        """An activation: checked and shared with JAX (every call).

        Checks that it is a tensor on the wrapper's device and, when `mapped` is given, that its token
        rows (all axes but the last) fit the capacity and the mapping (torch_lora's rule).
        """
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.is_cuda != self._cuda or t.get_device() != self._index:
            raise ValueError(f"{name} is on {t.device}, but the wrapper was made for {self.device}")
        if mapped is not None:
            if t.dim() < 2:
                raise ValueError(f"{name} must have shape (..., features) with a token axis, got {tuple(t.shape)}")
            rows = math.prod(t.shape[:-1])
            checks.check_capacity(f"{name} (tokens)", rows, self.max_num_batched_tokens, "max_num_batched_tokens")
            if rows > mapped:
                raise ValueError(f"{name} has {rows} rows, but update_metadata mapped only {mapped} {what}")
        if t.requires_grad:
            t = _usable(t, name)
        if t.dtype in _WIDE:  # with copy=True it would become float32 in silence; torch_lora refuses it
            _check_not_wide(t, name, checks.ACTIVATION_DTYPES)
        return to_jax(t, copy=self.copy)

    def _weight(self, stacked, name: str):
        """Persistent tensors (one, or a list/tuple with None entries): converted once, cached.

        A cache hit costs one identity + version/pointer/shape check per tensor; type and device are
        checked when a tensor is converted (they cannot change without changing the stamp).
        """
        if stacked is None:
            return None
        get, convert = self._weights.get, self._convert_weight
        if isinstance(stacked, (list, tuple)):
            out = []
            for i, w in enumerate(stacked):
                if w is None:
                    out.append(None)
                    continue
                if isinstance(w, torch.Tensor) and w.requires_grad and torch.is_grad_enabled():
                    _usable(w, f"{name}[{i}]")  # raises: not differentiable
                out.append(get(w, convert, name, i))
            return tuple(out)
        if isinstance(stacked, torch.Tensor) and stacked.requires_grad and torch.is_grad_enabled():
            _usable(stacked, name)
        return get(stacked, convert, name, None)

    def _scales(self, scales, name: str):
        """fp8 weight scales (one tensor, or a list/tuple per slice with None entries) for JAX:
        shared zero-copy and cached like the weights (a scale is persistent beside its weight). A
        float64 scale is refused (contract section 11: float32), not narrowed; jax_lora checks the
        rest (shapes, which slices take scales) and names `name`."""
        if scales is None:
            return None
        entries = scales if isinstance(scales, (list, tuple)) else (scales,)
        for i, sc in enumerate(entries):
            _check_scale_not_wide(sc, name if not isinstance(scales, (list, tuple)) else f"{name}[{i}]")
        return self._weight(scales, name)

    def _convert_weight(self, w, name: str, i: int | None):
        """A cache miss: the cache passes a detached alias of the caller's tensor."""
        label = name if i is None else f"{name}[{i}]"
        if not isinstance(w, torch.Tensor):
            raise TypeError(f"{label} must be a torch.Tensor, got {type(w).__name__}")
        if w.device != self.device:
            raise ValueError(f"{label} is on {w.device}, but the wrapper was made for {self.device}")
        _check_not_wide(w, label, checks.WEIGHT_DTYPES)
        return to_jax(w, copy=self.copy)

    @staticmethod
    def _write_back(y: torch.Tensor, result) -> torch.Tensor:
        """y <- result (the JAX wrapper returns y's shape); torch's current stream waits for JAX."""
        y.copy_(to_torch(result))
        return y

    # ------------------------------------------------------------------ ops
    def add_shrink(self, y: torch.Tensor, x: torch.Tensor, lora_a_stacked, scale: float, *, lora_ranks=None,
                   lora_a_scale=None, **kwargs) -> torch.Tensor:
        """y[s] = scale * x @ A_s[idx].T per token (0 for -1), written into y (S, T, r). x: (..., H).
        lora_a_scale: fp8 A's float32 scales (contract section 11), shared like the weights."""
        xj = self._act(x, "x", self._num_tokens)
        a = self._weight(lora_a_stacked, "lora_a_stacked")
        res = self._run("add_shrink", (self._act(y, "y"), xj, a), a, lora_ranks,
                        {"lora_a_scale": self._scales(lora_a_scale, "lora_a_scale")}, scale=checks.as_scale(scale))
        return self._write_back(y, res)

    def add_expand(self, y: torch.Tensor, x, lora_b_stacked, lora_bias_stacked, output_slices: Sequence[int],
                   offset_start: int = 0, add_inputs: bool = True, *, lora_ranks=None, lora_b_scale=None,
                   **kwargs) -> torch.Tensor:
        """y[:, off_s:off_s+n_s] = (y if add_inputs else 0) + x[s] @ B_s[idx].T + bias_s[idx], in place.
        lora_b_scale: fp8 B's float32 scales (contract section 11), shared like the weights."""
        yj = self._act(y, "y", self._num_tokens)
        if isinstance(x, (list, tuple)):
            buf = [self._act(p, f"x[{i}]") for i, p in enumerate(x)]
        else:
            buf = self._act(x, "x")
        b = self._weight(lora_b_stacked, "lora_b_stacked")
        res = self._run("add_expand", (yj, buf, b, self._weight(lora_bias_stacked, "lora_bias_stacked")), b,
                        lora_ranks, {"lora_b_scale": self._scales(lora_b_scale, "lora_b_scale")},
                        output_slices=_static_ints(output_slices),
                        offset_start=checks.as_offset("offset_start", offset_start),
                        add_inputs=checks.as_flag("add_inputs", add_inputs))
        return self._write_back(y, res)

    def add_lora_embedding(self, y: torch.Tensor, x: torch.Tensor, lora_b_stacked: torch.Tensor,
                           add_inputs: bool = True, *, lora_ranks=None, lora_b_scale=None,
                           **kwargs) -> torch.Tensor:
        """y (+)= x @ lora_b_stacked[idx].T per token, in place. x: (T, r); y: (T, N). lora_b_scale:
        an fp8 B's float32 scales, (L, N) or (L,)."""
        yj = self._act(y, "y", self._num_tokens)
        b = self._weight(lora_b_stacked, "lora_b_stacked")
        res = self._run("add_lora_embedding", (yj, self._act(x, "x"), b), b, lora_ranks,
                        {"lora_b_scale": self._scales(lora_b_scale, "lora_b_scale")},
                        add_inputs=checks.as_flag("add_inputs", add_inputs))
        return self._write_back(y, res)

    def add_lora_embedding_ids(self, y: torch.Tensor, ids: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
                               *, lora_ranks=None, lora_a_scale=None, lora_b_scale=None, **kwargs) -> torch.Tensor:
        """y[t] += lora_a[slot_t, ids[t]] @ lora_b[slot_t].T (each token's pairs in a paired step), in
        place. y: (T, D); ids: (T,) token ids; lora_a: (L, V, r); lora_b: (L, D, r). lora_a_scale /
        lora_b_scale: an fp8 table's / B's float32 scales ((L, V) / (L, D) or (L,); contract section
        11), shared zero-copy and cached like the weights."""
        yj = self._act(y, "y", self._num_tokens)
        a, b = self._weight(lora_a, "lora_a"), self._weight(lora_b, "lora_b")
        res = self._run("add_lora_embedding_ids", (yj, _index(ids, "ids"), a, b), a, lora_ranks,
                        {"lora_a_scale": self._scales(lora_a_scale, "lora_a_scale"),
                         "lora_b_scale": self._scales(lora_b_scale, "lora_b_scale")})
        return self._write_back(y, res)

    def add_lora_linear(self, y: torch.Tensor, x: torch.Tensor, lora_a_stacked, lora_b_stacked, lora_bias_stacked,
                        scale: float, output_slices: Sequence[int], *, buffer: torch.Tensor | None = None,
                        lora_ranks=None, lora_a_scale=None, lora_b_scale=None, **kwargs) -> torch.Tensor:
        """y[t] += sum_s (scale * x[t] @ A_s[idx].T) @ B_s[idx].T + bias_s[idx], in place; returns y.

        `buffer` (S, T, r) float32 is checked but not needed (the JAX kernels allocate their own).
        lora_a_scale / lora_b_scale: fp8 weights' float32 scales (contract section 11), shared
        zero-copy and cached like the weights.
        """
        xj = self._act(x, "x", self._num_tokens)
        if buffer is not None:
            a = lora_a_stacked if isinstance(lora_a_stacked, (list, tuple)) else [lora_a_stacked]
            self._check_buffer(buffer, (len(a), math.prod(x.shape[:-1]), a[0].shape[-2]))
        a = self._weight(lora_a_stacked, "lora_a_stacked")
        res = self._run("add_lora_linear", (self._act(y, "y"), xj, a, self._weight(lora_b_stacked, "lora_b_stacked"),
                                            self._weight(lora_bias_stacked, "lora_bias_stacked")), a,
                        lora_ranks, {"lora_a_scale": self._scales(lora_a_scale, "lora_a_scale"),
                                     "lora_b_scale": self._scales(lora_b_scale, "lora_b_scale")},
                        scale=checks.as_scale(scale), output_slices=_static_ints(output_slices))
        return self._write_back(y, res)

    def add_lora_logits(self, y: torch.Tensor, x: torch.Tensor, lora_a_stacked: torch.Tensor,
                        lora_b_stacked: torch.Tensor, scale: float, *, buffer: torch.Tensor | None = None,
                        lora_ranks=None, lora_a_scale=None, lora_b_scale=None, **kwargs) -> torch.Tensor:
        """y[j] += (scale * x[j] @ A[s_j].T) @ B[s_j].T, s_j the sampler index of row j, in place.
        lora_a_scale / lora_b_scale: fp8 weights' float32 scales ((L, r) / (L, V') per channel or
        (L,) per tensor; contract section 11), shared zero-copy and cached like the weights."""
        xj = self._act(x, "x", self._num_rows, "sampled rows")
        if buffer is not None:  # (1, R, r), or any shape of R * r elements (torch_lora's rule)
            rows, rank = math.prod(x.shape[:-1]), lora_a_stacked.shape[-2]
            self._check_buffer(buffer.reshape(1, rows, rank) if buffer.numel() == rows * rank else buffer,
                               (1, rows, rank))
        a = self._weight(lora_a_stacked, "lora_a_stacked")
        res = self._run("add_lora_logits", (self._act(y, "y"), xj, a, self._weight(lora_b_stacked, "lora_b_stacked")),
                        a, lora_ranks, {"lora_a_scale": self._scales(lora_a_scale, "lora_a_scale"),
                                        "lora_b_scale": self._scales(lora_b_scale, "lora_b_scale")},
                        scale=checks.as_scale(scale))
        return self._write_back(y, res)

    def _check_buffer(self, buf, shape: tuple) -> None:
        if not isinstance(buf, torch.Tensor):
            raise TypeError(f"buffer must be a torch.Tensor, got {type(buf).__name__}")
        if buf.device != self.device:
            raise ValueError(f"buffer is on {buf.device}, but the wrapper was made for {self.device}")
        _check_buffer("buffer", buf, shape)


def _static_ints(values) -> tuple:
    """output_slices as a hashable tuple of Python ints (a static argument under jit), with
    check_output_slices' rules: each width an integer (int, NumPy integer, 0-d integer tensor; a
    float such as 16.9 or a string "16" is a TypeError, never truncated or parsed) and positive. The
    count against the B slices is checked by the JAX wrapper."""
    try:
        count = len(values)
    except TypeError:
        count = None
    if count is None or isinstance(values, (str, bytes)):
        raise TypeError(f"output_slices must be a sequence of ints (one width per slice), got {values!r}")
    return checks.check_output_slices(values, count)


def _check_buffer(name: str, buf: torch.Tensor, shape: tuple) -> None:
    """add_lora_linear's / add_lora_logits' shrink buffer: `shape`, float32 (contract section 4)."""
    if tuple(buf.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)} (num_slices, num_tokens, rank), "
                         f"got {tuple(buf.shape)}")
    checks.check_dtype(name, buf.dtype, checks.SHRINK_BUFFER_DTYPES)


# ----------------------------------------------------------------------------- ops (torch_lora.ops's API)
# Same signatures as torch_lora.ops; `backend` names a JAX backend. Activations and weights are shared
# (copy=True permits copies); index tensors are converted to int32 and may be copied (they are tiny).

def _acts(value, name: str, copy: bool):
    if isinstance(value, (list, tuple)):
        return tuple(_act(v, f"{name}[{i}]", copy) for i, v in enumerate(value))
    return _act(value, name, copy)


def _act(t, name: str, copy: bool):
    if isinstance(t, torch.Tensor):
        _check_not_wide(t, name, checks.ACTIVATION_DTYPES)
    return to_jax(_usable(t, name), copy=copy)


def _weight_scales(value, name: str, copy: bool):
    """fp8 scales for jax_lora.ops (None, one tensor, or a list/tuple per slice with None entries):
    shared zero-copy like the weights; a float64 scale is refused (float32 only), not narrowed."""
    if value is None:
        return None
    if isinstance(value, (list, tuple)):
        return tuple(None if v is None else _weight_scales(v, f"{name}[{i}]", copy) for i, v in enumerate(value))
    _check_scale_not_wide(value, name)
    return to_jax(_usable(value, name), copy=copy)


def _method_call(method: str, static: dict):
    """f(wrapper, args, dyn) = wrapper.<method>(*args, **dyn, **static): what the wrapper jits once
    per (method, static arguments)."""
    def call(wrapper, args, dyn):
        return getattr(wrapper, method)(*args, **dyn, **static)
    return call


def _meta(meta_args) -> tuple:
    """The six `meta_args(T)` values for JAX: the five index tensors must be tensors (as in
    torch_lora.ops), converted to int32."""
    m = KernelMeta(*meta_args)
    require_tensors(token_lora_mapping=m.token_lora_mapping,
                    token_indices_sorted_by_lora_ids=m.token_indices_sorted_by_lora_ids,
                    num_tokens_per_lora=m.num_tokens_per_lora, lora_token_start_loc=m.lora_token_start_loc,
                    lora_ids=m.active_lora_ids)
    flag = m.no_lora
    if isinstance(flag, torch.Tensor) and flag.numel() == 1:
        flag = flag.reshape(())
    return KernelMeta(*(_index(a, "meta") for a in m._replace(no_lora=flag)))


def _slices(name: str, stacked) -> tuple:
    """The S stacked weights as a tuple (torch_lora.ops.as_slices: a None slice is a ValueError), each a
    tensor, at least one."""
    slices = as_slices(name, stacked)
    if not slices:
        raise ValueError(f"{name} must hold at least one slice, got none")
    require_tensors(**{f"{name}[{i}]" if len(slices) > 1 else name: w for i, w in enumerate(slices)})
    return slices


def _check_out(name: str, t: torch.Tensor, shape: tuple) -> None:
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)}, got {tuple(t.shape)}")
    checks.check_dtype(name, t.dtype, checks.ACTIVATION_DTYPES)


def lora_shrink(inputs: torch.Tensor, lora_a_weights, output_tensor: torch.Tensor, token_lora_mapping,
                token_indices_sorted_by_lora_ids, num_tokens_per_lora, lora_token_start_loc, lora_ids,
                no_lora_flag, scaling: float, *, backend: str | None = None, lora_ranks=None,
                copy: bool = False, lora_a_scale=None) -> torch.Tensor:
    """torch_lora.ops.lora_shrink over jax_lora.ops.lora_shrink: writes output_tensor (S, T, r), returns it.
    lora_a_scale: fp8 slices' float32 scales, shared like the weights."""
    require_tensors(inputs=inputs, output_tensor=output_tensor)
    a = _slices("lora_a_weights", lora_a_weights)
    check_tensors(inputs=inputs, lora_a_weights=list(a), output_tensor=output_tensor)
    _check_out("output_tensor", output_tensor, (len(a), inputs.shape[0], a[0].shape[-2]))
    meta = _meta((token_lora_mapping, token_indices_sorted_by_lora_ids, num_tokens_per_lora, lora_token_start_loc,
                  lora_ids, no_lora_flag))
    res = jops.lora_shrink(_acts(inputs, "inputs", copy), _acts(a, "lora_a_weights", copy), meta, scaling,
                           backend=backend, lora_ranks=_index(lora_ranks, "lora_ranks"),
                           lora_a_scale=_weight_scales(lora_a_scale, "lora_a_scale", copy))
    output_tensor.copy_(to_torch(res))
    return output_tensor


def lora_expand(inputs: torch.Tensor, lora_b_weights, output_tensor: torch.Tensor, token_lora_mapping,
                token_indices_sorted_by_lora_ids, num_tokens_per_lora, lora_token_start_loc, lora_ids,
                no_lora_flag, offset_start: int = 0, add_inputs: bool = False, *, backend: str | None = None,
                lora_ranks=None, copy: bool = False, lora_b_scale=None) -> torch.Tensor:
    """torch_lora.ops.lora_expand over jax_lora.ops.lora_expand: updates output_tensor in place, returns it.
    lora_b_scale: fp8 slices' float32 scales, shared like the weights."""
    require_tensors(inputs=inputs, output_tensor=output_tensor)
    b = _slices("lora_b_weights", lora_b_weights)
    check_tensors(inputs=inputs, lora_b_weights=list(b), output_tensor=output_tensor)
    meta = _meta((token_lora_mapping, token_indices_sorted_by_lora_ids, num_tokens_per_lora, lora_token_start_loc,
                  lora_ids, no_lora_flag))
    res = jops.lora_expand(_acts(inputs, "inputs", copy), _acts(b, "lora_b_weights", copy),
                           _acts(output_tensor, "output_tensor", copy), meta, offset_start, add_inputs,
                           backend=backend, lora_ranks=_index(lora_ranks, "lora_ranks"),
                           lora_b_scale=_weight_scales(lora_b_scale, "lora_b_scale", copy))
    output_tensor.copy_(to_torch(res))
    return output_tensor


def bgmv_shrink(x: torch.Tensor, w: torch.Tensor, idx: torch.Tensor, scale: float = 1.0, *,
                out: torch.Tensor | None = None, backend: str | None = None, lora_ranks=None,
                copy: bool = False, w_scale=None) -> torch.Tensor:
    """(T, r) float32: scale * x[t] @ w[idx[t]].T (a new tensor, or written into `out`); w_scale: an
    fp8 w's float32 scales."""
    require_tensors(x=x, lora_a_weights=w)
    check_tensors(x=x, lora_a_weights=w, lora_indices_tensor=idx, out=out)
    res = to_torch(jops.bgmv_shrink(_acts(x, "x", copy), _acts(w, "lora_a_weights", copy),
                                    _index(idx, "lora_indices_tensor"), scale, backend=backend,
                                    lora_ranks=_index(lora_ranks, "lora_ranks"),
                                    w_scale=_weight_scales(w_scale, "w_scale", copy)))
    if out is None:
        return res  # owns its (JAX-allocated) buffer: nothing else references it
    _check_out("out", out, tuple(res.shape))
    return out.copy_(res)


def _expand_call(fn, x, w, y, idx_args, tail, copy, backend, lora_ranks, w_scale=None):
    res = fn(_acts(x, "inputs", copy), _acts(w, "lora_b_weights", copy), _acts(y, "y", copy), *idx_args, *tail,
             backend=backend, lora_ranks=_index(lora_ranks, "lora_ranks"),
             w_scale=_weight_scales(w_scale, "w_scale", copy))
    y.copy_(to_torch(res))
    return y


def bgmv_expand(x: torch.Tensor, w: torch.Tensor, y: torch.Tensor, idx: torch.Tensor, add_inputs: bool = True, *,
                backend: str | None = None, lora_ranks=None, copy: bool = False, w_scale=None) -> torch.Tensor:
    """y[t, :c] (+)= (x[t] @ w[idx[t]].T)[:c], in place; returns y."""
    require_tensors(inputs=x, lora_b_weights=w, y=y)
    check_tensors(inputs=x, lora_b_weights=w, y=y, lora_indices_tensor=idx)
    return _expand_call(jops.bgmv_expand, x, w, y, (_index(idx, "lora_indices_tensor"),), (add_inputs,), copy,
                        backend, lora_ranks, w_scale)


def bgmv_expand_slice(x: torch.Tensor, w: torch.Tensor, y: torch.Tensor, idx: torch.Tensor, y_offset: int,
                      y_slice_size: int, add_inputs: bool = True, *, backend: str | None = None,
                      lora_ranks=None, copy: bool = False, w_scale=None) -> torch.Tensor:
    """y[t, y_offset:y_offset+y_slice_size] (+)= x[t] @ w[idx[t]].T, in place; returns y."""
    require_tensors(inputs=x, lora_b_weights=w, y=y)
    check_tensors(inputs=x, lora_b_weights=w, y=y, lora_indices_tensor=idx)
    return _expand_call(jops.bgmv_expand_slice, x, w, y, (_index(idx, "lora_indices_tensor"),),
                        (y_offset, y_slice_size, add_inputs), copy, backend, lora_ranks, w_scale)


def _segment_scalar(name: str, v):
    """batch_size / max_length / token_nums for JAX: an integer scalar as a Python int (a CPU 0-d
    tensor read; a float is refused, not truncated); a CUDA 0-d tensor as an int32 JAX scalar (not
    read: a host sync), which jax_lora.ops checks by dtype only."""
    if isinstance(v, torch.Tensor):
        readable = v.device.type == "cpu"
        segments.as_count(name, v, readable)
        return operator.index(v) if readable else _index(v, name)
    if isinstance(v, np.integer):
        return operator.index(v)
    return v  # Python values: jax_lora.ops checks them (and names them)


def _segments(seq_start_locs, seq_lengths, lora_indices_per_batch, batch_size, max_length, token_nums) -> tuple:
    """The six prefill-metadata values for jax_lora.ops. Tensors' dtypes and shapes are checked here,
    before the conversion (which would make a float64 array float32): lora_core.segments; their
    values are checked by jax_lora.ops on the JAX side (host arrays) or masked there (CUDA)."""
    arrays = (seq_start_locs, seq_lengths, lora_indices_per_batch)
    if all(isinstance(a, torch.Tensor) for a in arrays):
        segments.check_segment_arrays([a.dtype for a in arrays], [tuple(a.shape) for a in arrays])
    return tuple(_index(a, name) for name, a in zip(segments.SEGMENT_ARRAYS, arrays)) + tuple(
        _segment_scalar(name, v) for name, v in (("batch_size", batch_size), ("max_length", max_length),
                                                 ("token_nums", token_nums)))


def sgmv_shrink(x, w, seq_start_locs, seq_lengths, lora_indices_per_batch, batch_size, max_length, token_nums,
                scale: float = 1.0, *, backend: str | None = None, lora_ranks=None, copy: bool = False,
                w_scale=None):
    """bgmv_shrink with each segment's tokens using the segment's index; returns a new (T, r) tensor.

    Segment arguments as in torch_lora.ops.sgmv_shrink: integer (B,) arrays of one length, integer
    scalars >= 0; segment values checked when the tensors are on the CPU, masked on CUDA.
    """
    require_tensors(x=x, lora_a_weights=w)
    check_tensors(x=x, lora_a_weights=w)
    seg = _segments(seq_start_locs, seq_lengths, lora_indices_per_batch, batch_size, max_length, token_nums)
    return to_torch(jops.sgmv_shrink(_acts(x, "x", copy), _acts(w, "lora_a_weights", copy), *seg, scale,
                                     backend=backend, lora_ranks=_index(lora_ranks, "lora_ranks"),
                                     w_scale=_weight_scales(w_scale, "w_scale", copy)))


def sgmv_expand(x, w, y, seq_start_locs, seq_lengths, lora_indices_per_batch, batch_size, max_length, token_nums,
                add_inputs: bool = True, *, backend: str | None = None, lora_ranks=None, copy: bool = False,
                w_scale=None):
    """bgmv_expand with each segment's tokens using the segment's index; y in place. Segment
    arguments checked as in sgmv_shrink."""
    require_tensors(inputs=x, lora_b_weights=w, y=y)
    check_tensors(inputs=x, lora_b_weights=w, y=y)
    seg = _segments(seq_start_locs, seq_lengths, lora_indices_per_batch, batch_size, max_length, token_nums)
    return _expand_call(jops.sgmv_expand, x, w, y, seg, (add_inputs,), copy, backend, lora_ranks, w_scale)


def sgmv_expand_slice(x, w, y, seq_start_locs, seq_lengths, lora_indices_per_batch, batch_size, max_length,
                      token_nums, y_offset: int, y_slice_size: int, add_inputs: bool = True, *,
                      backend: str | None = None, lora_ranks=None, copy: bool = False, w_scale=None):
    """bgmv_expand_slice with each segment's tokens using the segment's index; y in place. Segment
    arguments checked as in sgmv_shrink."""
    require_tensors(inputs=x, lora_b_weights=w, y=y)
    check_tensors(inputs=x, lora_b_weights=w, y=y)
    seg = _segments(seq_start_locs, seq_lengths, lora_indices_per_batch, batch_size, max_length, token_nums)
    return _expand_call(jops.sgmv_expand_slice, x, w, y, seg, (y_offset, y_slice_size, add_inputs), copy, backend,
                        lora_ranks, w_scale)
