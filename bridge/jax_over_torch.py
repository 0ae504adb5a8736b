"""The JAX API over torch's kernels: `JaxPunicaWrapper` and JAX-style ops (contract section 5, 8).

For a JAX program beside torch code that wants torch_lora's kernels (its Triton kernels on CUDA):
JAX arrays in, new JAX arrays out (the inputs are never mutated), exactly `jax_lora`'s API, outside
`jax.jit` (the kernels are torch calls; inside jit use `jax_lora.PunicaWrapper`, which is a pytree).
Nothing of the LoRA math lives here: each call converts its arrays with `bridge.to_torch`
(zero-copy), runs the public `torch_lora.PunicaWrapper` / `torch_lora.ops` on a fresh output tensor,
and hands that tensor to JAX with `bridge.to_jax` (zero-copy).

    w = JaxPunicaWrapper(512, 64, device=None, max_loras=8)         # a torch_lora.PunicaWrapper inside
    w.update_metadata(mapping, lora_index_to_id, 9, vocab_size)     # host conversion, once per step
    y = w.add_lora_linear(y, x, lora_a_stacked, lora_b_stacked, None, 1.0, (4096,))   # a new y

Per call: x and y are exported to torch (zero-copy), y is cloned on the torch side (the torch kernels
update in place, and a JAX array must never change: the clone is the new y, what `y.at[].set`
costs in JAX), and the clone is imported into JAX (zero-copy). Stacked weights are converted once and
cached by identity (JAX arrays are immutable; `bridge.ConversionCache`).

Semantics kept from the JAX side: the prompt mapping is bucket-padded as `jax_lora.PunicaWrapper`
pads it (so `sampler_indices`/`sampler_indices_padded` are the JAX ones), and x/y may have more rows
than the mapping (a bucket-padded batch): those rows are "no LoRA" and come back unchanged (their
shrink rows are 0). The index properties are small views at arbitrary offsets of one torch block, so
they are shared when aligned and copied otherwise.

CUDA streams: torch's current stream waits for the JAX inputs, computes, and JAX waits for it before
reading the result. The input views are kept alive until torch's stream has finished with them
(an event per call, polled without blocking), so JAX cannot reuse their memory too early.
"""

from __future__ import annotations

import collections
import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import torch

import torch_lora
import torch_lora.ops as tops
from jax_lora.ops import as_array
from lora_core import checks, segments
from lora_core.host_mapping import LoRAMapping, pad_prompt_mapping
from lora_core.kernel_meta import KernelMeta

from .dlpack import _ARRAY_IMPL, ConversionCache, current_stream, default_jax_device, to_jax, to_torch, torch_device_for

__all__ = ["JaxPunicaWrapper", "lora_shrink", "lora_expand", "bgmv_shrink", "bgmv_expand",
           "bgmv_expand_slice", "sgmv_shrink", "sgmv_expand", "sgmv_expand_slice"]


def _jax_device(device):
    if device is None:
        return default_jax_device()
    if isinstance(device, str):
        platform = device.split(":")[0].lower()
        platform = "gpu" if platform == "cuda" else platform
        return jax.devices(platform)[int(device.split(":")[1]) if ":" in device else 0]
    return device


def _as_torch(a, name: str = "array"):
    """A torch view of a JAX array (numpy / Python values go through jnp.asarray first)."""
    if type(a) is _ARRAY_IMPL:  # the common case first
        return to_torch(a)
    if a is None or isinstance(a, torch.Tensor):
        return a
    if isinstance(a, jax.core.Tracer):
        raise TypeError(f"{name} is a tracer: the bridged torch kernels run outside jax.jit (inside jit use "
                        "jax_lora.PunicaWrapper / jax_lora.ops)")
    # A host value goes through jax_lora's conversion, which refuses what JAX would change in silence
    # (float64 narrowed to float32, int64 outside int32 wrapped).
    return to_torch(a if isinstance(a, jax.Array) else as_array(name, a))


def _required(a, name: str):
    """_as_torch for an argument without a default: None is a TypeError naming it."""
    if a is None:
        raise TypeError(f"{name} must be a jax.Array, got NoneType")
    return _as_torch(a, name)


class _KeepAlive:
    """Holds torch views of JAX buffers until torch's stream has finished reading them (CUDA only)."""

    def __init__(self):
        self._pending: collections.deque = collections.deque()

    def hold(self, device: torch.device, *tensors) -> None:
        if device.type != "cuda":
            return  # CPU torch ops are synchronous: done when they return
        while self._pending and self._pending[0][0].query():
            self._pending.popleft()
        event = torch.cuda.Event()
        event.record(current_stream(device.index if device.index is not None else torch.cuda.current_device()))
        self._pending.append((event, tensors))


_keepalive = _KeepAlive()


# ----------------------------------------------------------------------------- wrapper

class JaxPunicaWrapper:
    """jax_lora's PunicaWrapper API (contract section 5) computed by torch_lora's kernels, outside jit.

    Args:
      max_num_batched_tokens, max_batches, max_loras: as `jax_lora.PunicaWrapper`.
      device: a JAX device, platform string ("cpu", "gpu") or None (JAX's default device, a
        `jax.default_device` context included); the kernels run on the torch device holding the
        same memory.
      backend: a torch backend ("torch", "triton"); default: chosen by the device.
    """

    def __init__(self, max_num_batched_tokens: int, max_batches: int, device=None, *, max_loras: int,
                 backend: str | None = None, **options: Any):
        self.device = _jax_device(device)
        self.torch_device = torch_device_for(self.device)
        self.torch_wrapper = torch_lora.PunicaWrapper(max_num_batched_tokens, max_batches, self.torch_device,
                                                      max_loras=max_loras, backend=backend, **options)
        self.max_num_batched_tokens = self.torch_wrapper.max_num_batched_tokens
        self.max_batches = self.torch_wrapper.max_batches
        self.max_loras = self.torch_wrapper.max_loras
        self.backend = self.torch_wrapper.backend
        self._weights = ConversionCache()
        self._props: dict = {}
        self._num_tokens = 0
        self._num_rows = 0

    # ------------------------------------------------------------------ metadata
    def update_metadata(self, mapping: LoRAMapping, lora_index_to_id: Sequence[int | None], max_loras: int,
                        vocab_size: int, extra_vocab_size: int = 0, long_lora_context=None, **kwargs: Any) -> None:
        """As jax_lora's: the prompt mapping is padded to its bucket, then torch_lora uploads the step."""
        if not isinstance(mapping, LoRAMapping):
            raise TypeError(f"mapping must be a LoRAMapping, got {type(mapping).__name__}")
        padded = LoRAMapping(mapping.index_mapping,
                             pad_prompt_mapping(mapping.prompt_mapping, self.max_num_batched_tokens),
                             mapping.is_prefill, mapping.index_weights)
        self.torch_wrapper.update_metadata(padded, lora_index_to_id, max_loras, vocab_size, extra_vocab_size,
                                           long_lora_context, **kwargs)
        self._props = {}
        self._num_tokens = len(padded.index_mapping)
        self._num_rows = len(padded.prompt_mapping)

    def _prop(self, name: str, make):
        value = self._props.get(name)
        if value is None:
            value = self._props[name] = make()
        return value

    def _index_prop(self, name: str):
        # Views at arbitrary offsets of the torch wrapper's one index block: shared when aligned.
        return self._prop(name, lambda: to_jax(getattr(self.torch_wrapper, name), copy=True))

    @property
    def token_lora_indices(self) -> jax.Array:
        """(T,) int32 slot per token, -1 for no LoRA."""
        return self._index_prop("token_lora_indices")

    @property
    def sampler_indices(self) -> jax.Array:
        """(R_padded,) int32 slot per sampled row, the prompt mapping padded with -1 to a bucket."""
        return self._index_prop("sampler_indices")

    @property
    def sampler_indices_padded(self) -> jax.Array:
        """(R_padded,) int32 flat row indices `j + p_j * R_padded` (contract section 2)."""
        return self._index_prop("sampler_indices_padded")

    @property
    def embeddings_indices(self) -> jax.Array:
        """(2, T) int32 embedding-table offsets."""
        return self._index_prop("embeddings_indices")

    @property
    def long_lora_indices(self) -> jax.Array:
        """(T,) int32 long-context offsets (empty without a long-LoRA context)."""
        return self._index_prop("long_lora_indices")

    @property
    def prefill_metadata(self) -> tuple:
        """(seq_start_locs, seq_lengths, lora_indices_per_batch, batch_size, max_length, token_nums)."""
        def make():
            starts, lengths, loras, b, max_len, n = self.torch_wrapper.prefill_metadata
            return (to_jax(starts, copy=True), to_jax(lengths, copy=True), to_jax(loras, copy=True), b, max_len, n)
        return self._prop("prefill", make)

    # ------------------------------------------------------------------ conversions
    def _weight(self, stacked, name: str):
        """Persistent arrays (one, or a list/tuple with None entries): converted once, cached by identity."""
        if stacked is None:
            return None
        if isinstance(stacked, (list, tuple)):
            return tuple(None if w is None else self._weight_one(w, name) for w in stacked)
        return self._weight_one(stacked, name)

    def _weight_one(self, w, name: str):
        if isinstance(w, jax.Array) and not isinstance(w, jax.core.Tracer):
            return self._weights.get(w, to_torch)
        return _as_torch(w, name)  # numpy / tracer (raises): not cached, a numpy array can change in place

    def _out(self, y, name: str = "y") -> torch.Tensor:
        """A fresh torch tensor holding y's values: the torch kernels update it, JAX receives it."""
        return _as_torch(y, name).clone(memory_format=torch.contiguous_format)

    def _mapped(self, t: torch.Tensor, mapped: int, axis: int = 0) -> torch.Tensor:
        """The first `mapped` token rows of a (.., T, ..) view: rows past the mapping are "no LoRA".

        Along axis 0 of a contiguous tensor this is a contiguous view; along axis 1 of an (S, T, r)
        buffer it is made contiguous (a small copy, only for a bucket-padded batch), since kernels
        may assume dense buffers.
        """
        if t.shape[axis] <= mapped:
            return t
        part = t.narrow(axis, 0, mapped)
        return part if axis == 0 else part.contiguous()

    def _rows(self, a: torch.Tensor, name: str) -> torch.Tensor:
        """(..., F) -> (T, F) view, T checked against the capacity."""
        if a.dim() < 2:
            raise ValueError(f"{name} must have shape (..., features) with a token axis, got {tuple(a.shape)}")
        a2 = a if a.dim() == 2 else a.reshape(-1, a.shape[-1])
        if a2.shape[0] > self.max_num_batched_tokens:
            checks.check_capacity(f"{name} (tokens)", a2.shape[0], self.max_num_batched_tokens,
                                  "max_num_batched_tokens")
        return a2

    def _finish(self, out: torch.Tensor, *inputs) -> jax.Array:
        _keepalive.hold(self.torch_device, *inputs)
        return to_jax(out)

    # ------------------------------------------------------------------ ops
    def add_shrink(self, y, x, lora_a_stacked, scale: float, *, lora_ranks=None, lora_a_scale=None,
                   **kwargs) -> jax.Array:
        """Returns y' (S, T, r) with y's dtype: scale * x @ A_s[idx].T per token (0 for -1 and unmapped rows).
        lora_a_scale: fp8 A's float32 scales (contract section 11), shared and cached like the weights."""
        y_t, x_t = _as_torch(y, "y"), self._rows(_as_torch(x, "x"), "x")
        a_scale = self._weight(lora_a_scale, "lora_a_scale")
        n = self._num_tokens
        if y_t.dim() != 3 or y_t.shape[1] <= n:  # every row is mapped (or a bad y: the torch wrapper says so)
            out = torch.empty(y_t.shape, dtype=y_t.dtype, device=y_t.device)  # shrink writes every row
            self.torch_wrapper.add_shrink(out, x_t, self._weight(lora_a_stacked, "lora_a_stacked"), scale,
                                          lora_ranks=_as_torch(lora_ranks, "lora_ranks"), lora_a_scale=a_scale)
        else:  # a bucket-padded batch: rows past the mapping are 0
            out = torch.zeros(y_t.shape, dtype=y_t.dtype, device=y_t.device)
            part = out[:, :n].contiguous()
            self.torch_wrapper.add_shrink(part, self._mapped(x_t, n), self._weight(lora_a_stacked, "lora_a_stacked"),
                                          scale, lora_ranks=_as_torch(lora_ranks, "lora_ranks"), lora_a_scale=a_scale)
            out[:, :n] = part
        return self._finish(out, x_t, y_t)

    def add_expand(self, y, x, lora_b_stacked, lora_bias_stacked, output_slices: Sequence[int],
                   offset_start: int = 0, add_inputs: bool = True, *, lora_ranks=None, lora_b_scale=None,
                   **kwargs) -> jax.Array:
        """Returns y' with y'[:, off_s:off_s+n_s] = (y if add_inputs else 0) + x[s] @ B_s[idx].T + bias_s[idx].
        lora_b_scale: fp8 B's float32 scales, shared and cached like the weights."""
        out = self._out(y)
        out2 = self._rows(out, "y")
        n = self._num_tokens
        if isinstance(x, (list, tuple)):
            buf = [self._mapped(_as_torch(p, "x"), n) for p in x]
        else:
            buf = _as_torch(x, "x")
            buf = self._mapped(buf, n, axis=1) if buf.dim() == 3 else buf
        self.torch_wrapper.add_expand(self._mapped(out2, n), buf, self._weight(lora_b_stacked, "lora_b_stacked"),
                                      self._weight(lora_bias_stacked, "lora_bias_stacked"), output_slices,
                                      offset_start=offset_start, add_inputs=add_inputs,
                                      lora_ranks=_as_torch(lora_ranks, "lora_ranks"),
                                      lora_b_scale=self._weight(lora_b_scale, "lora_b_scale"))
        return self._finish(out, buf)

    def add_lora_embedding(self, y, x, lora_b_stacked, add_inputs: bool = True, *, lora_ranks=None,
                           lora_b_scale=None, **kwargs) -> jax.Array:
        """Returns y' = y (+)= x @ lora_b_stacked[idx].T per token. x: (T, r); y: (T, N). lora_b_scale:
        an fp8 B's float32 scales."""
        out = self._out(y)
        x_t = _as_torch(x, "x")
        n = self._num_tokens
        self.torch_wrapper.add_lora_embedding(self._mapped(self._rows(out, "y"), n), self._mapped(x_t, n),
                                              self._weight(lora_b_stacked, "lora_b_stacked"), add_inputs=add_inputs,
                                              lora_ranks=_as_torch(lora_ranks, "lora_ranks"),
                                              lora_b_scale=self._weight(lora_b_scale, "lora_b_scale"))
        return self._finish(out, x_t)

    def add_lora_embedding_ids(self, y, ids, lora_a, lora_b, *, lora_ranks=None, lora_a_scale=None,
                               lora_b_scale=None, **kwargs) -> jax.Array:
        """Returns y' = y + lora_a[slot_t, ids[t]] @ lora_b[slot_t].T per token (each token's pairs in a
        paired step). y: (T, D); ids: (T,) token ids; lora_a: (L, V, r); lora_b: (L, D, r).
        lora_a_scale / lora_b_scale: an fp8 table's / B's float32 scales, shared and cached like the
        weights."""
        out = self._out(y)
        ids_t = _as_torch(ids, "ids").reshape(-1)
        n = self._num_tokens
        self.torch_wrapper.add_lora_embedding_ids(self._mapped(self._rows(out, "y"), n), self._mapped(ids_t, n),
                                                  self._weight(lora_a, "lora_a"), self._weight(lora_b, "lora_b"),
                                                  lora_ranks=_as_torch(lora_ranks, "lora_ranks"),
                                                  lora_a_scale=self._weight(lora_a_scale, "lora_a_scale"),
                                                  lora_b_scale=self._weight(lora_b_scale, "lora_b_scale"))
        return self._finish(out, ids_t)

    def add_lora_linear(self, y, x, lora_a_stacked, lora_b_stacked, lora_bias_stacked, scale: float,
                        output_slices: Sequence[int], *, buffer=None, lora_ranks=None, lora_a_scale=None,
                        lora_b_scale=None, **kwargs) -> jax.Array:
        """Returns y' = y + sum_s (scale * x @ A_s[idx].T) @ B_s[idx].T + bias_s[idx] at the slice offsets.

        `buffer` is only checked (as in jax_lora: JAX is functional). lora_a_scale / lora_b_scale:
        fp8 weights' float32 scales (contract section 11), shared zero-copy and cached like the weights.
        """
        out = self._out(y)
        out2, x_t = self._rows(out, "y"), self._rows(_as_torch(x, "x"), "x")
        if x_t.shape[0] != out2.shape[0]:
            raise ValueError(f"x has {x_t.shape[0]} tokens (shape {jnp.shape(x)}) but y has {out2.shape[0]} "
                             f"(shape {jnp.shape(y)})")
        if buffer is not None:
            a = lora_a_stacked if isinstance(lora_a_stacked, (list, tuple)) else [lora_a_stacked]
            _check_buffer(buffer, (len(a), x_t.shape[0], jnp.shape(a[0])[-2]))
        n = self._num_tokens
        self.torch_wrapper.add_lora_linear(self._mapped(out2, n), self._mapped(x_t, n),
                                           self._weight(lora_a_stacked, "lora_a_stacked"),
                                           self._weight(lora_b_stacked, "lora_b_stacked"),
                                           self._weight(lora_bias_stacked, "lora_bias_stacked"), scale, output_slices,
                                           lora_ranks=_as_torch(lora_ranks, "lora_ranks"),
                                           lora_a_scale=self._weight(lora_a_scale, "lora_a_scale"),
                                           lora_b_scale=self._weight(lora_b_scale, "lora_b_scale"))
        return self._finish(out, x_t)

    def add_lora_logits(self, y, x, lora_a_stacked, lora_b_stacked, scale: float, *, buffer=None, lora_ranks=None,
                        lora_a_scale=None, lora_b_scale=None, **kwargs) -> jax.Array:
        """Returns y' with y'[j] = y[j] + (scale * x[j] @ A[s_j].T) @ B[s_j].T, s_j the sampler index of row j.
        lora_a_scale / lora_b_scale: fp8 weights' float32 scales (torch_lora's add_lora_logits takes them)."""
        out = self._out(y)
        out2, x_t = self._rows(out, "y"), self._rows(_as_torch(x, "x"), "x")
        if x_t.shape[0] != out2.shape[0]:
            raise ValueError(f"x has {x_t.shape[0]} rows but y has {out2.shape[0]}")
        if buffer is not None:
            shape = (1, x_t.shape[0], jnp.shape(lora_a_stacked)[-2])
            _check_buffer(buffer if jnp.size(buffer) != math.prod(shape) else jnp.reshape(buffer, shape), shape)
        n = self._num_rows
        self.torch_wrapper.add_lora_logits(self._mapped(out2, n), self._mapped(x_t, n),
                                           self._weight(lora_a_stacked, "lora_a_stacked"),
                                           self._weight(lora_b_stacked, "lora_b_stacked"), scale,
                                           lora_ranks=_as_torch(lora_ranks, "lora_ranks"),
                                           lora_a_scale=self._weight(lora_a_scale, "lora_a_scale"),
                                           lora_b_scale=self._weight(lora_b_scale, "lora_b_scale"))
        return self._finish(out, x_t)


def _check_buffer(buf, shape: tuple) -> None:
    """add_lora_linear's / add_lora_logits' shrink buffer (only checked: JAX is functional): `shape`,
    float32 (contract section 4)."""
    if tuple(jnp.shape(buf)) != tuple(shape):
        raise ValueError(f"buffer must have shape {tuple(shape)} (num_slices, num_tokens, rank), got "
                         f"{tuple(jnp.shape(buf))}")
    checks.check_dtype("buffer", jnp.result_type(buf), checks.SHRINK_BUFFER_DTYPES)


# ----------------------------------------------------------------------------- ops (jax_lora.ops's API)
# Same signatures as jax_lora.ops (functional: a new array is returned); `backend` names a torch backend.

def _torch_all(value, name: str):
    if isinstance(value, (list, tuple)):
        return [_as_torch(v, f"{name}[{i}]") for i, v in enumerate(value)]
    return _as_torch(value, name)


def _scales_torch(value, name: str):
    """fp8 scales for torch_lora.ops (None, one array, or a list/tuple per slice with None entries):
    torch views of the arrays (zero-copy)."""
    if value is None:
        return None
    if isinstance(value, (list, tuple)):
        return [None if v is None else _as_torch(v, f"{name}[{i}]") for i, v in enumerate(value)]
    return _as_torch(value, name)


def _meta_args(meta, num_tokens: int) -> tuple:
    """torch meta_args(T) from a jax_lora LoRAKernelMeta or its meta_args tuple (vLLM's order)."""
    m = KernelMeta(*meta) if isinstance(meta, (list, tuple)) else KernelMeta(
        meta.token_lora_mapping, meta.token_indices_sorted_by_lora_ids, meta.num_tokens_per_lora,
        meta.lora_token_start_loc, meta.active_lora_ids, meta.no_lora)
    t = KernelMeta(*(_as_torch(a, "meta") for a in m))
    if t.token_lora_mapping.shape[0] < num_tokens:
        raise ValueError(f"meta covers {t.token_lora_mapping.shape[0]} tokens, but the input has {num_tokens}")
    return t._replace(token_lora_mapping=t.token_lora_mapping[:num_tokens],
                      token_indices_sorted_by_lora_ids=t.token_indices_sorted_by_lora_ids[:num_tokens],
                      no_lora=t.no_lora.reshape(1))


def lora_shrink(x, lora_a_stacked, meta, scale: float, *, backend: str | None = None,
                lora_ranks=None, lora_a_scale=None) -> jax.Array:
    """jax_lora.ops.lora_shrink over torch_lora.ops.lora_shrink: returns (S, T, r) float32. lora_a_scale:
    fp8 slices' float32 scales, shared like the weights."""
    x_t = _required(x, "x")
    a_t = _torch_all(lora_a_stacked, "lora_a_stacked")
    a_list = a_t if isinstance(a_t, list) else [a_t]
    num_slots, rank, _ = checks.check_shrink(tuple(x_t.shape), x_t.dtype, [a.shape for a in a_list],
                                             [a.dtype for a in a_list])
    out = torch.empty((len(a_list), x_t.shape[0], rank), dtype=torch.float32, device=x_t.device)
    tops.lora_shrink(x_t, a_t, out, *_meta_args(meta, x_t.shape[0]), scale, backend=backend,
                     lora_ranks=_as_torch(lora_ranks, "lora_ranks"),
                     lora_a_scale=_scales_torch(lora_a_scale, "lora_a_scale"))
    _keepalive.hold(x_t.device, x_t, a_t)
    return to_jax(out)


def lora_expand(buf, lora_b_stacked, y, meta, offset_start: int = 0, add_inputs: bool = False, *,
                backend: str | None = None, lora_ranks=None, lora_b_scale=None) -> jax.Array:
    """jax_lora.ops.lora_expand over torch_lora.ops.lora_expand: returns a new y. lora_b_scale: fp8
    slices' float32 scales, shared like the weights."""
    out = _required(y, "y").clone(memory_format=torch.contiguous_format)
    buf_t = _required(buf, "buf")
    tops.lora_expand(buf_t, _torch_all(lora_b_stacked, "lora_b_stacked"), out, *_meta_args(meta, out.shape[0]),
                     offset_start=offset_start, add_inputs=add_inputs, backend=backend,
                     lora_ranks=_as_torch(lora_ranks, "lora_ranks"),
                     lora_b_scale=_scales_torch(lora_b_scale, "lora_b_scale"))
    _keepalive.hold(out.device, buf_t)
    return to_jax(out)


def bgmv_shrink(x, w, idx, scale: float = 1.0, *, backend: str | None = None, lora_ranks=None,
                w_scale=None) -> jax.Array:
    """(T, r) float32: scale * x[t] @ w[idx[t]].T, 0 where idx[t] = -1; w_scale: an fp8 w's scales."""
    x_t = _required(x, "x")
    res = tops.bgmv_shrink(x_t, _required(w, "w"), _as_torch(idx, "idx"), scale, backend=backend,
                           lora_ranks=_as_torch(lora_ranks, "lora_ranks"), w_scale=_as_torch(w_scale, "w_scale"))
    _keepalive.hold(x_t.device, x_t)
    return to_jax(res)


def _expand(fn, x, w, y, idx_args, tail, backend, lora_ranks, w_scale=None) -> jax.Array:
    out = _required(y, "y").clone(memory_format=torch.contiguous_format)
    x_t = _required(x, "x")
    fn(x_t, _required(w, "w"), out, *idx_args, *tail, backend=backend, lora_ranks=_as_torch(lora_ranks, "lora_ranks"),
       w_scale=_as_torch(w_scale, "w_scale"))
    _keepalive.hold(out.device, x_t)
    return to_jax(out)


def bgmv_expand(x, w, y, idx, add_inputs: bool = True, *, backend: str | None = None,
                lora_ranks=None, w_scale=None) -> jax.Array:
    """A new y with y[t, :c] (+)= (x[t] @ w[idx[t]].T)[:c]."""
    return _expand(tops.bgmv_expand, x, w, y, (_as_torch(idx, "idx"),), (add_inputs,), backend, lora_ranks, w_scale)


def bgmv_expand_slice(x, w, y, idx, y_offset: int, y_slice_size: int, add_inputs: bool = True, *,
                      backend: str | None = None, lora_ranks=None, w_scale=None) -> jax.Array:
    """A new y with y[t, y_offset:y_offset+y_slice_size] (+)= x[t] @ w[idx[t]].T."""
    return _expand(tops.bgmv_expand_slice, x, w, y, (_as_torch(idx, "idx"),), (y_offset, y_slice_size, add_inputs),
                   backend, lora_ranks, w_scale)


def _segment_scalar(name: str, v):
    """batch_size / max_length / token_nums for torch: an integer scalar (a 0-d JAX or NumPy array,
    a NumPy integer) as a Python int, read where it is on the host (a float is refused, not
    truncated); a 0-d array on an accelerator as a 0-d tensor there (not read: a host sync), which
    torch_lora.ops checks by dtype only. Other values go to torch_lora.ops, which checks them."""
    if isinstance(v, jax.Array) and not isinstance(v, jax.core.Tracer):
        readable = all(d.platform == "cpu" for d in v.devices())
        count = segments.as_count(name, v, readable)
        return count if readable else to_torch(v)
    if isinstance(v, (np.ndarray, np.generic)):
        return segments.as_count(name, v)
    return v


def _segments(seq_start_locs, seq_lengths, lora_indices_per_batch, batch_size, max_length, token_nums) -> tuple:
    """The six prefill-metadata values for torch_lora.ops. Arrays' dtypes and shapes are checked here,
    before the conversion (which would refuse a float64 NumPy array for its width, not its kind):
    lora_core.segments; their values are checked by torch_lora.ops (host arrays: NumPy, lists, JAX
    arrays on a CPU device)."""
    arrays = (seq_start_locs, seq_lengths, lora_indices_per_batch)
    if all(isinstance(a, (jax.Array, np.ndarray)) for a in arrays):
        segments.check_segment_arrays([a.dtype for a in arrays], [tuple(a.shape) for a in arrays])
    # NumPy arrays stay on the host (a CPU tensor: torch_lora.ops reads and checks host values);
    # through jnp they would land on JAX's default device, where nothing is read back.
    return tuple(torch.from_numpy(np.ascontiguousarray(a)) if isinstance(a, np.ndarray)
                 else _as_torch(a, name) if isinstance(a, jax.Array) else a
                 for name, a in zip(segments.SEGMENT_ARRAYS, arrays)) + tuple(
        _segment_scalar(name, v) for name, v in (("batch_size", batch_size), ("max_length", max_length),
                                                 ("token_nums", token_nums)))


def sgmv_shrink(x, w, seq_start_locs, seq_lengths, lora_indices_per_batch, batch_size, max_length, token_nums,
                scale: float = 1.0, *, backend: str | None = None, lora_ranks=None, w_scale=None) -> jax.Array:
    """bgmv_shrink with each segment's tokens using the segment's index."""
    x_t = _required(x, "x")
    seg = _segments(seq_start_locs, seq_lengths, lora_indices_per_batch, batch_size, max_length, token_nums)
    res = tops.sgmv_shrink(x_t, _required(w, "w"), *seg, scale, backend=backend,
                           lora_ranks=_as_torch(lora_ranks, "lora_ranks"), w_scale=_as_torch(w_scale, "w_scale"))
    _keepalive.hold(x_t.device, x_t)
    return to_jax(res)


def sgmv_expand(x, w, y, seq_start_locs, seq_lengths, lora_indices_per_batch, batch_size, max_length, token_nums,
                add_inputs: bool = True, *, backend: str | None = None, lora_ranks=None, w_scale=None) -> jax.Array:
    """bgmv_expand with each segment's tokens using the segment's index; returns a new y."""
    seg = _segments(seq_start_locs, seq_lengths, lora_indices_per_batch, batch_size, max_length, token_nums)
    return _expand(tops.sgmv_expand, x, w, y, seg, (add_inputs,), backend, lora_ranks, w_scale)


def sgmv_expand_slice(x, w, y, seq_start_locs, seq_lengths, lora_indices_per_batch, batch_size, max_length,
                      token_nums, y_offset: int, y_slice_size: int, add_inputs: bool = True, *,
                      backend: str | None = None, lora_ranks=None, w_scale=None) -> jax.Array:
    """bgmv_expand_slice with each segment's tokens using the segment's index; returns a new y."""
    seg = _segments(seq_start_locs, seq_lengths, lora_indices_per_batch, batch_size, max_length, token_nums)
    return _expand(tops.sgmv_expand_slice, x, w, y, seg, (y_offset, y_slice_size, add_inputs), backend, lora_ranks,
                   w_scale)
