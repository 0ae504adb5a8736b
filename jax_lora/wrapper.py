"""PunicaWrapper for JAX: vLLM's multi-LoRA wrapper API (contract section 5), functional and jittable.

The wrapper holds one step's index arrays, padded to fixed buffer lengths so that their shapes
never change (one compiled program per bucket). It is a pytree with one leaf, the step's int32
block (`StepLayout`: index arrays, prefill segments and both kernel metadata, sliced where used), and
static sizes and backend, so a jitted step function can take it as an argument:

    w = PunicaWrapper(max_num_batched_tokens=512, max_batches=64, device=None, max_loras=8)
    w.update_metadata(mapping, lora_index_to_id, max_loras=9, vocab_size=32000)   # host, per step
    step = jax.jit(lambda w, y, x: w.add_lora_linear(y, x, A, B, None, 1.0, (4096,)))
    y = step(w, y, x)

`update_metadata` runs on the host (outside jit): it converts the mapping with NumPy, pads it (the
prompt mapping with -1 to `max(next_power_of_two(n), 8)` rows, every buffer with 0 to its length),
builds the kernel metadata (equal to `LoRAKernelMeta.build`'s) and sends the block in one transfer. The `add_*`
methods never mutate: they return the new `y` (vLLM TPU semantics). Inside the ops, positions past
the real token count are treated as "no LoRA", so padded rows never change and cost nothing.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from lora_core import checks, moe_order
from lora_core.adapter_pairs import AdapterPairs, PairLayout, PairRows
from lora_core.host_mapping import LoRAMapping, StepLayout, max_pair_groups, prepare_step

from .devices import resolve_device
from .meta import LoRAKernelMeta
from .ops import dispatch, fused_moe, partition
from .ops.api import (
    WEIGHT_DTYPES,
    as_array,
    as_lora_ranks,
    as_slices,
    check_same_device,
    scale_keywords,
    to_3d,
    weight_scales,
)
from .warmup import warmup as _warmup

__all__ = ["PunicaWrapper"]

# Positions in the `_tail` leaf (StepLayout's tail).
(_N_TOKENS, _N_SAMPLER, _N_SAMPLER_PADDED, _N_EMBEDDINGS, _N_LONG, _BATCH, _MAX_LEN, _TOKEN_NUMS, _IS_PREFILL,
 _NO_LORA) = range(StepLayout.TAIL)


@jax.tree_util.register_pytree_node_class
class PunicaWrapper:
    """Multi-LoRA wrapper over the JAX ops (contract section 5).

    Args:
      max_num_batched_tokens: token capacity T_max of one step (index buffers have this length).
      max_batches: capacity for prefill segments (SGMV metadata buffers).
      device: a jax Device, a platform string ("cpu", "gpu", "tpu"), None (the default device), or a
        Sharding (e.g. NamedSharding(mesh, P()): the index arrays replicated on a mesh, for
        jax_lora.parallel).
      max_loras: number of weight slots (keyword-only, as in vLLM).
      backend: force "xla", "pallas_tpu" or "triton"; default: chosen by the device.
      deterministic: every method gives a token bitwise the same result whatever the batch it is
        in (every bucket size under jit) and from run to run (batch-invariant launches and
        formulations; docs/api.md, "Deterministic mode"). A static field of the pytree.
    """

    def __init__(self, max_num_batched_tokens: int, max_batches: int, device=None, *, max_loras: int,
                 backend: str | None = None, deterministic: bool = False, **options: Any):
        checks.check_wrapper_sizes(max_num_batched_tokens=max_num_batched_tokens, max_batches=max_batches,
                                   max_loras=max_loras, options=options, logger="jax_lora")
        self.max_num_batched_tokens = int(max_num_batched_tokens)
        self.max_batches = int(max_batches)
        self.max_loras = int(max_loras)
        self.device = resolve_device(device)
        self.backend = backend if backend is not None else dispatch.default_backend_name(self.device, log=True)
        dispatch.load_backend(self.backend)  # fail now, not at the first op
        self.deterministic = dispatch.check_deterministic(deterministic)
        self._layout = StepLayout(self.max_num_batched_tokens, self.max_batches, self.max_loras)
        self._upload(self._layout.empty_block(pad_prompt=True))
        # Several adapters per token: the step's pair block (lora_core.adapter_pairs.PairLayout) and
        # its bucket k, a static size (one compiled program per bucket); None and 0 otherwise.
        self._pair_block, self.num_pairs = None, 0
        self._host_max_slot = -1
        self._host_embedding_rows = None   # vocab_size + extra_vocab_size of the last update_metadata

    # ------------------------------------------------------------------ pytree
    # One leaf: the step's int32 block (StepLayout). Every index array and both kernel metadata are
    # static slices of it, taken where they are used: free inside jit (XLA fuses them), and a jitted
    # step flattens one array per wrapper instead of seventeen.
    def tree_flatten(self):
        aux = (self.max_num_batched_tokens, self.max_batches, self.max_loras, self.device, self.backend,
               self._layout, self.deterministic, self.num_pairs)
        return (self._block, self._pair_block), aux

    @classmethod
    def tree_unflatten(cls, aux, children):
        obj = object.__new__(cls)
        (obj.max_num_batched_tokens, obj.max_batches, obj.max_loras, obj.device, obj.backend,
         obj._layout, obj.deterministic, obj.num_pairs) = aux
        (obj._block, obj._pair_block) = children
        obj._host_tail = None       # read from the block when concrete; traced inside jit
        obj._host_max_slot = None   # unknown inside a trace: index values are masked, not checked
        obj._host_embedding_rows = None
        return obj

    # ------------------------------------------------------------------ metadata (host)
    def update_metadata(self, mapping: LoRAMapping, lora_index_to_id: Sequence[int | None],
                        max_loras: int, vocab_size: int, extra_vocab_size: int = 0,
                        long_lora_context=None, **kwargs: Any) -> None:
        """Converts `mapping` on the host and uploads this step in one transfer (no kernel runs).

        Raises ValueError for more tokens than max_num_batched_tokens, a LoRA id in no slot, a slot
        >= the wrapper's max_loras, or more prefill segments than max_batches.
        """
        step = prepare_step(mapping, lora_index_to_id, max_loras, vocab_size, extra_vocab_size,
                            long_lora_context, max_num_batched_tokens=self.max_num_batched_tokens,
                            max_batches=self.max_batches, num_slots=self.max_loras, pad_prompt=True)
        self._upload(self._layout.fill(np.empty(self._layout.size, np.int32), step))
        self._pair_block, self.num_pairs = None, 0
        if step.pairs is not None:
            layout = self._pair_layout(step.pairs[1].num_pairs)
            self._pair_block = jax.device_put(layout.fill(np.empty(layout.size, np.int32), *step.pairs), self.device)
            self.num_pairs = layout.num_pairs
        self._host_max_slot = step.max_slot
        self._host_embedding_rows = int(vocab_size) + int(extra_vocab_size)

    def warmup(self, layers, token_counts=None, *, dtype=jnp.bfloat16, lora_ranks: bool = False,
               bias: bool = False, dora: bool = False, progress: bool = True, workers=None) -> dict:
        """Compiles the Triton kernel variants `add_lora_linear` will launch for these layer shapes
        (`lora_core.warmup.LinearShape` or (hidden, slices, rank)) and token counts (default vLLM's
        capture sizes), before serving, from `workers` threads (default: one per core up to 16 on a
        GPU); this wrapper's metadata is untouched (see jax_lora.warmup)."""
        return _warmup(self, layers, token_counts, dtype=dtype, lora_ranks=lora_ranks, bias=bias, dora=dora,
                      progress=progress, workers=workers)

    def _upload(self, block: np.ndarray) -> None:
        """The packed step (indices, segments, tail, both kernel metadata built on the host) to the device."""
        self._block = jax.device_put(block, self.device)
        self._host_tail = self._layout.views(block)["tail"].copy()

    def _pair_layout(self, num_pairs: int) -> PairLayout:
        return PairLayout(self.max_num_batched_tokens, max_pair_groups(self.max_batches, self.max_loras), num_pairs)

    def _pair_args(self) -> tuple:
        """(group LoRAKernelMeta, AdapterPairs, PairRows) of this step's pair block (static slices: free
        in jit)."""
        meta, pairs, rows = self._pair_layout(self.num_pairs).views(self._pair_block)
        meta = LoRAKernelMeta(**meta._replace(no_lora=meta.no_lora[0] != 0)._asdict())
        as_f32 = functools.partial(jax.lax.bitcast_convert_type, new_dtype=jnp.float32)
        return (meta, AdapterPairs(pairs.slots, as_f32(pairs.weights)),
                PairRows(rows.token_slots, rows.row_slots, as_f32(rows.row_weights)))

    def _refuse_pairs(self, method: str) -> None:
        if self.num_pairs:
            raise ValueError(f"{method} takes one adapter per token, but this step's mapping gives tokens several "
                             "adapters or weights (LoRAMapping tuples / index_weights): add_lora_linear, "
                             "add_lora_embedding_ids and add_lora_logits serve such a step")

    def _add_per_pair(self, y2, slots, weights, x, lora_b, shrink_a=None, scale: float = 1.0, *,
                      a_scale=None, b_scale=None) -> jax.Array:
        """y2[t] + sum_j weights[t, j] * (x[j][t] or scale * x[t] @ shrink_a[slot].T) @ lora_b[slot].T over
        the pairs (slots (n, k), -1: empty), one float32 sum and one cast; rows without a pair
        unchanged. The one-adapter BGMV ops once per pair (the embedding and LM head of a paired step).
        a_scale / b_scale: (L, r) / (L, V') float32 scales of an fp8 shrink_a / lora_b (else None)."""
        from . import ops
        n = y2.shape[0]
        acc = y2.astype(jnp.float32)
        for j in range(slots.shape[1]):
            idx = slots[:n, j]
            part = x[j].astype(jnp.float32) if shrink_a is None else ops.bgmv_shrink(
                x, shrink_a, idx, scale, backend=self.backend, deterministic=self.deterministic, w_scale=a_scale)
            acc = ops.bgmv_expand(part * weights[:n, j, None], lora_b, acc, idx, True, backend=self.backend,
                                  deterministic=self.deterministic, w_scale=b_scale)
        any_pair = jnp.any(slots[:n] >= 0, axis=1, keepdims=True)
        return jnp.where(any_pair, acc.astype(y2.dtype), y2)

    def add_lora_embedding_ids(self, y, ids, lora_a, lora_b, *, lora_ranks=None, lora_a_scale=None,
                               lora_b_scale=None) -> jax.Array:
        """The embedding's LoRA term from token ids: y[t] + sum_j w_tj * lora_a[slot_tj, ids[t]] @
        lora_b[slot_tj].T over each token's pairs (a plain step: its one slot at weight 1, the same as
        looking the rows up at `embeddings_indices[1]` and calling add_lora_embedding).

        y: (T, D); ids: (T,) token ids; lora_a: (L, V, r) the LoRA-A embedding table; lora_b: (L, D, r).
        lora_a_scale / lora_b_scale (contract section 11): the float32 scales of an fp8 lora_a / lora_b,
        (L, V) (one per table row) / (L, D) (one per output channel), or (L,) per tensor. An fp8 row
        is looked up as float32(lora_a[l, v]) * a_scale[l, v], kept in float32 for the expand.
        Returns the new y.
        """
        y = as_array("y", y, checks.ACTIVATION_DTYPES)
        lora_a = as_array("lora_a", lora_a, checks.WEIGHT_DTYPES)
        lora_b = as_array("lora_b", lora_b, checks.WEIGHT_DTYPES)
        checks.check_ndim("lora_a", lora_a.shape, (3,), "3-D (max_loras, num_embeddings, rank)")
        a_scales = weight_scales("lora_a_scale", lora_a_scale, (lora_a,), "lora_a")
        a_scale = None if a_scales is None else a_scales[0]          # (L, V) float32
        b_scales = weight_scales("lora_b_scale", lora_b_scale, (lora_b,), "lora_b")
        b_scale = None if b_scales is None else b_scales[0]          # (L, D) float32
        flat = jnp.asarray(ids).reshape(-1).astype(jnp.int32)
        t = flat.shape[0]
        if not self.num_pairs:
            rows = flat + self.embeddings_indices[1][:t]
            looked_up = jnp.take(lora_a.reshape(-1, lora_a.shape[-1]), rows, axis=0, mode="clip")
            if a_scale is None:
                looked_up = looked_up.astype(y.dtype)
            else:
                looked_up = (looked_up.astype(jnp.float32)
                             * jnp.take(a_scale.reshape(-1), rows, axis=0, mode="clip")[:, None])
            return self.add_lora_embedding(y, looked_up, lora_b, lora_ranks=lora_ranks, lora_b_scale=b_scale)
        self._check_embedding_rows("lora_a", lora_a.shape[1])
        self._check_tokens("ids", t)
        _, pairs, rows = self._pair_args()
        looked_up = []
        for j in range(self.num_pairs):
            slot, token = jnp.maximum(rows.token_slots[:t, j], 0), jnp.clip(flat, 0, lora_a.shape[1] - 1)
            row = lora_a[slot, token]                                                     # (T, r)
            looked_up.append(row if a_scale is None else row.astype(jnp.float32) * a_scale[slot, token][:, None])
        return self._add_per_pair(_flatten_tokens(y, "y"), rows.token_slots, pairs.weights, looked_up, lora_b,
                                  b_scale=b_scale).reshape(y.shape)

    def _view(self, name: str) -> jax.Array:
        return self._layout.view(self._block, name)

    def _meta(self, prefix: str) -> LoRAKernelMeta:
        """The block's "token_meta" / "prompt_meta" segments as a LoRAKernelMeta (the flag a bool scalar)."""
        meta = self._layout.kernel_meta(self._block, prefix)
        return LoRAKernelMeta(**meta._replace(no_lora=meta.no_lora[0] != 0)._asdict())

    @property
    def token_meta(self) -> LoRAKernelMeta:
        """Kernel metadata of the tokens (contract section 3), capacity max_num_batched_tokens."""
        return self._meta("token_meta")

    @property
    def prompt_meta(self) -> LoRAKernelMeta:
        """Kernel metadata of the sampled rows (the padded prompt mapping)."""
        return self._meta("prompt_meta")

    # ------------------------------------------------------------------ properties
    def _tail(self):
        """The tail as host ints (NumPy) outside jit, or the traced int32 array inside jit."""
        if self._host_tail is not None:
            return self._host_tail
        tail = self._view("tail")
        return tail if isinstance(tail, jax.core.Tracer) else np.asarray(tail)

    def _narrow(self, name: str, i: int):
        buf, tail = self._view(name), self._tail()
        if isinstance(tail, jax.core.Tracer):
            return buf
        n = int(tail[i])
        return buf[..., : max(n, 0)]

    @property
    def token_lora_indices(self) -> jax.Array:
        """(T,) int32 slot per token (-1 no LoRA). Inside jit: the whole (T_max,) buffer, 0-padded."""
        return self._narrow("token_lora_indices", _N_TOKENS)

    @property
    def sampler_indices(self) -> jax.Array:
        """(R_padded,) int32 slot per sampled row, the prompt mapping padded with -1 to a bucket."""
        return self._narrow("sampler_indices", _N_SAMPLER)

    @property
    def sampler_indices_padded(self) -> jax.Array:
        """(R_padded,) int32 flat row indices `j + p_j * R_padded` (contract section 2)."""
        return self._narrow("sampler_indices_padded", _N_SAMPLER_PADDED)

    @property
    def embeddings_indices(self) -> jax.Array:
        """(2, T) int32 embedding-table offsets (contract section 2)."""
        return self._narrow("embeddings_indices", _N_EMBEDDINGS)

    @property
    def long_lora_indices(self) -> jax.Array:
        """(T,) int32 long-context offsets (empty without a long-LoRA context; inside jit, the buffer)."""
        return self._narrow("long_lora_indices", _N_LONG)

    @property
    def indices_len(self) -> list:
        v = self._tail()
        if isinstance(v, jax.core.Tracer):
            raise RuntimeError("indices_len is host data; read it outside jit")
        return [int(v[0]), int(v[1]), int(v[2]), int(v[3]), None if v[4] < 0 else int(v[4])]

    @property
    def prefill_metadata(self) -> tuple:
        """(seq_start_locs, seq_lengths, lora_indices_per_batch, batch_size, max_length, token_nums).

        Outside jit: arrays of length batch_size and Python ints. Inside jit: the max_batches-long
        buffers and int32 scalars (entries past batch_size have length 0).
        """
        v, starts, lengths, loras = (self._tail(), self._view("seq_start_locs"), self._view("seq_lengths"),
                                     self._view("lora_indices_per_batch"))
        if isinstance(v, jax.core.Tracer):
            return starts, lengths, loras, v[_BATCH], v[_MAX_LEN], v[_TOKEN_NUMS]
        b = int(v[_BATCH])
        return starts[:b], lengths[:b], loras[:b], b, int(v[_MAX_LEN]), int(v[_TOKEN_NUMS])

    @property
    def is_prefill(self):
        return _host_bool(self._tail()[_IS_PREFILL] != 0)

    @property
    def no_lora(self):
        return _host_bool(self._tail()[_NO_LORA] != 0)

    # ------------------------------------------------------------------ vLLM's TPU wrapper's per-token ops
    # bgmv_shrink / bgmv_expand / bgmv_expand_slice with each token's slot taken from this step's
    # token_lora_indices (through the token kernel metadata); positions past the mapped tokens
    # count as "no LoRA", as in every op of the wrapper.
    def shrink(self, x, w_t_all, scale: float) -> jax.Array:
        """(T, r) float32: scale * x[t] @ w_t_all[idx[t]].T, 0 where idx[t] = -1.

        x: (T, H); w_t_all: (L, [1,] r, H).
        """
        x, w = as_array("x", x, checks.ACTIVATION_DTYPES), as_array("w_t_all", w_t_all, checks.WEIGHT_DTYPES)
        num_slots, _, _ = checks.check_shrink(x.shape, x.dtype, [w.shape], [w.dtype], arg_a="w_t_all")
        self._check_tokens("x", x.shape[0])
        self._check_slots("w_t_all", num_slots)
        self._check_devices(x=x, w_t_all=w)
        return self._impl().shrink(x, (to_3d(w),), self.token_meta, checks.as_scale(scale), None)[0]

    def expand(self, y, x, w_t_all, add_inputs: bool) -> jax.Array:
        """New y: y[t, :c] = (y[t, :c] if add_inputs else 0) + (x[t] @ w_t_all[idx[t]].T)[:c], c = min(n, N).

        x: (T, r); w_t_all: (L, [1,] n, r); y: (T, N). A LoRA output wider than y is cut to y's
        width (vLLM's bgmv_expand). Rows with index -1 are unchanged.
        """
        y, x, w = self._seed_expand_inputs(y, x, w_t_all)
        width = checks.check_seed_expand(x.shape, x.dtype, w.shape, w.dtype, y.shape, y.dtype)
        return self._expand(y, x[None], (w,), None, (width,), 0, add_inputs, self.token_meta, cut_to_y=True)

    def expand_slice(self, y, x, w_t_all, y_offset: int, y_slice_size: int, add_inputs: bool) -> jax.Array:
        """New y: y[t, y_offset:y_offset+y_slice_size] = (old if add_inputs else 0) + x[t] @ w_t_all[idx[t]].T.

        x: (T, r); w_t_all: (L, [1,] y_slice_size, r); y: (T, N). Rows with index -1 and columns
        outside the slice are unchanged.
        """
        y, x, w = self._seed_expand_inputs(y, x, w_t_all)
        width = checks.check_seed_expand(x.shape, x.dtype, w.shape, w.dtype, y.shape, y.dtype)
        checks.check_seed_slice(y_offset, y_slice_size, width, y.shape)
        return self._expand(y, x[None], (w,), None, (width,), int(y_offset), add_inputs, self.token_meta)

    @staticmethod
    def _seed_expand_inputs(y, x, w_t_all) -> tuple:
        """y, x, w_t_all as jax arrays, host float64 (or other dtypes outside contract section 4) refused
        rather than narrowed in silence (as every other entry point)."""
        return (as_array("y", y, checks.ACTIVATION_DTYPES), as_array("x", x, checks.ACTIVATION_DTYPES),
                as_array("w_t_all", w_t_all, checks.WEIGHT_DTYPES))

    # ------------------------------------------------------------------ ops
    def _impl(self):
        impl = dispatch.load_backend(self.backend)
        return partition.partitioned(dispatch.deterministic_impl(impl) if self.deterministic else impl)

    def _check_tokens(self, name: str, num_tokens: int) -> None:
        checks.check_capacity(f"{name} (tokens)", num_tokens, self.max_num_batched_tokens,
                              "max_num_batched_tokens")

    def _check_embedding_rows(self, name: str, num_embeddings: int) -> None:
        """Refuses an embedding whose row count is not the step's vocab_size + extra_vocab_size
        (known on the host; unknown inside a trace: not checked)."""
        checks.check_embedding_rows(name, num_embeddings, self._host_embedding_rows)

    def _check_slots(self, name: str, num_slots: int) -> None:
        if self._host_max_slot is not None and self._host_max_slot >= num_slots:
            raise ValueError(f"the mapping uses slot {self._host_max_slot}, but {name} has only "
                             f"{num_slots} slots (0..{num_slots - 1})")

    def _check_devices(self, **arrays) -> None:
        """The arguments (None entries skipped) and this wrapper's index arrays on one device set
        (committed, concrete arrays only: inside jit nothing is checked)."""
        arrays = {k: v for k, v in arrays.items() if v is not None}
        check_same_device(**arrays, **{"the wrapper's index arrays": self._block})

    def _check_rank(self, name: str, rank: int) -> None:
        checks.check_backend_rank(self.backend, rank, name)

    def add_shrink(self, y, x, lora_a_stacked, scale: float, *, lora_ranks=None, lora_a_scale=None,
                   **kwargs) -> jax.Array:
        """y[s] = scale * x @ lora_a_stacked[s][idx].T per token (0 for -1): returns y (S, T, r).

        y: (S, T, r) buffer (its dtype is kept); x: (..., H), flattened to (T, H). lora_a_scale: the
        float32 scales of e4m3 slices (ops.lora_shrink's; None without fp8 weights).
        """
        self._refuse_pairs("add_shrink")
        y = as_array("y", y, checks.ACTIVATION_DTYPES)
        x = _flatten_tokens(as_array("x", x, checks.ACTIVATION_DTYPES), "x")
        lora_a = as_slices("lora_a_stacked", lora_a_stacked)
        num_slots, rank, _ = checks.check_shrink(x.shape, x.dtype, [a.shape for a in lora_a],
                                                 [a.dtype for a in lora_a])
        a_scales = weight_scales("lora_a_scale", lora_a_scale, lora_a, "lora_a_stacked")
        scale = checks.as_scale(scale)
        _check_buffer("y", y, (len(lora_a), x.shape[0], rank))
        self._check_tokens("x", x.shape[0])
        self._check_slots("lora_a_stacked", num_slots)
        self._check_rank("lora_a_stacked", rank)
        self._check_devices(x=x, lora_a_stacked=lora_a, y=y, lora_a_scale=_present(a_scales))
        impl, kw = scale_keywords(self._impl(), self.deterministic, a_scales=a_scales)
        out = impl.shrink(x, tuple(to_3d(a) for a in lora_a), self.token_meta, scale,
                          as_lora_ranks(lora_ranks, num_slots), **kw)
        return out.astype(y.dtype)

    def add_expand(self, y, x, lora_b_stacked, lora_bias_stacked, output_slices: Sequence[int],
                   offset_start: int = 0, add_inputs: bool = True, *, lora_ranks=None, dora_scale_stacked=None,
                   lora_b_scale=None, **kwargs) -> jax.Array:
        """y[:, off_s:off_s+n_s] = (y if add_inputs else 0) + x[s] @ B_s[idx].T + bias_s[idx].

        y: (..., N); x: (S, T, r) or S arrays (T, r); slices laid from `offset_start`. Rows with
        index -1 are unchanged. Returns the new y (same shape). dora_scale_stacked: see
        add_lora_linear. lora_b_scale: the float32 scales of e4m3 slices (ops.lora_expand's).
        """
        self._refuse_pairs("add_expand")
        y = as_array("y", y, checks.ACTIVATION_DTYPES)
        y2 = _flatten_tokens(y, "y")
        buf = _stack_buffer(x)
        return self._expand(y2, buf, lora_b_stacked, lora_bias_stacked, output_slices, offset_start,
                            add_inputs, self.token_meta, lora_ranks=lora_ranks,
                            dora_scale_stacked=dora_scale_stacked, lora_b_scale=lora_b_scale).reshape(y.shape)

    def _expand(self, y2, buf, lora_b_stacked, lora_bias_stacked, output_slices, offset_start, add_inputs,
                meta, cut_to_y=False, lora_ranks=None, dora_scale_stacked=None, num_slots_a=None,
                lora_b_scale=None):
        lora_b, offsets, bias = self._expand_args(y2, buf.shape, buf.dtype, lora_b_stacked, lora_bias_stacked,
                                                  output_slices, offset_start, cut_to_y, num_slots_a)
        b_scales = _b_scales(lora_b_stacked, lora_b_scale, lora_b)
        self._check_devices(x=buf, lora_b_stacked=lora_b, y=y2, lora_bias_stacked=bias,
                            lora_b_scale=_present(b_scales))
        impl = self._impl()
        extra = self._col_scale(impl, dora_scale_stacked, lora_b, bias)
        impl, kw = scale_keywords(impl, self.deterministic, b_scales=b_scales)
        return impl.expand(buf, lora_b, y2, meta, offsets, checks.as_flag("add_inputs", add_inputs),
                           as_lora_ranks(lora_ranks, lora_b[0].shape[0]), bias, **extra, **kw)

    def _col_scale(self, impl, dora_scale_stacked, lora_b, bias) -> dict:
        """{"col_scale": per slice None or (L, n_s)} for the backend, or {} without scales; checks
        them (`checks.check_dora_scales`: one entry per slice, (L, [1,] n_s) of a float dtype, no
        slice with a LoRA bias as well, on every backend) and that the backend applies them."""
        if dora_scale_stacked is None:
            return {}
        scales = list(dora_scale_stacked) if isinstance(dora_scale_stacked, (list, tuple)) else [dora_scale_stacked]
        scales = [None if g is None else as_array(f"dora_scale_stacked[{i}]", g, checks.VECTOR_DTYPES)
                  for i, g in enumerate(scales)]
        widths = [b.shape[1] for b in lora_b]
        checks.check_dora_scales([None if g is None else g.shape for g in scales],
                                 [None if g is None else g.dtype for g in scales], widths, lora_b[0].shape[0],
                                 [bias is not None and b is not None for b in (bias or [None] * len(lora_b))])
        if not getattr(impl, "COLUMN_SCALE", False):
            raise ValueError(f"dora_scale_stacked: backend {self.backend!r} does not apply DoRA column scales yet "
                             "(backends 'xla', 'triton' and 'pallas_tpu' do)")
        return {"col_scale": tuple(None if g is None else g.reshape(g.shape[0], g.shape[-1]) for g in scales)}

    def _expand_args(self, y2, buf_shape, buf_dtype, lora_b_stacked, lora_bias_stacked, output_slices,
                     offset_start, cut_to_y=False, num_slots_a=None):
        """Checks the expand half (and, given num_slots_a, that B holds A's slot count); returns
        (3-D lora_b, slice offsets, bias as (L, n_s) or None)."""
        lora_b = as_slices("lora_b_stacked", lora_b_stacked)
        slices = checks.check_output_slices(output_slices, len(lora_b))
        offset_start = checks.as_offset("offset_start", offset_start)
        if cut_to_y:  # logits: a LoRA vocabulary wider than y is cut to y's width (vLLM)
            lora_b = tuple(b[..., : y2.shape[1], :] for b in lora_b)
            slices = tuple(min(s, y2.shape[1]) for s in slices)
        num_slots, rank, widths = checks.check_expand(buf_shape, buf_dtype, [b.shape for b in lora_b],
                                                      [b.dtype for b in lora_b], y2.shape,
                                                      y2.dtype, offset_start)
        checks.check_slice_widths(slices, widths)
        if num_slots_a is not None:
            checks.check_slot_counts(num_slots_a, num_slots)
        self._check_tokens("y", y2.shape[0])
        self._check_slots("lora_b_stacked", num_slots)
        self._check_rank("lora_b_stacked", rank)
        bias = None
        if lora_bias_stacked is not None:
            bias_list = list(lora_bias_stacked) if isinstance(lora_bias_stacked, (list, tuple)) \
                else [lora_bias_stacked]
            checks.check_bias([None if b is None else jnp.shape(b) for b in bias_list], slices, num_slots,
                              bias_dtypes=[None if b is None else _dtype_of(b) for b in bias_list])
            bias = tuple(None if b is None else as_array(f"lora_bias_stacked[{i}]", b).reshape(num_slots, -1)
                         for i, b in enumerate(bias_list))
        offsets = tuple(offset_start + sum(slices[:s]) for s in range(len(slices)))
        return tuple(to_3d(b) for b in lora_b), offsets, bias

    def add_lora_embedding(self, y, x, lora_b_stacked, add_inputs: bool = True, *, lora_ranks=None,
                           lora_b_scale=None, **kwargs) -> jax.Array:
        """y (+)= x @ lora_b_stacked[idx].T per token. x: (T, r) looked-up LoRA-A rows; y: (T, N).
        lora_b_scale: float32 (L, N) or (L,), the scale of an e4m3 lora_b_stacked."""
        self._refuse_pairs("add_lora_embedding")
        y = as_array("y", y, checks.ACTIVATION_DTYPES)
        y2 = _flatten_tokens(y, "y")
        x = as_array("x", x, checks.ACTIVATION_DTYPES)
        if x.ndim != 2:
            raise ValueError(f"x must be 2-D (num_tokens, rank), got shape {x.shape}")
        b = as_array("lora_b_stacked", lora_b_stacked, WEIGHT_DTYPES)
        _, width, _ = checks.weight_dims("lora_b_stacked", b.shape, "out_features, rank")
        return self._expand(y2, x[None], (b,), None, (width,), 0, add_inputs, self.token_meta,
                            lora_ranks=lora_ranks, lora_b_scale=lora_b_scale).reshape(y.shape)

    def add_lora_linear(self, y, x, lora_a_stacked, lora_b_stacked, lora_bias_stacked, scale: float,
                        output_slices: Sequence[int], *, buffer=None, lora_ranks=None, dora_scale_stacked=None,
                        lora_a_scale=None, lora_b_scale=None, **kwargs) -> jax.Array:
        """y[t] += sum_s (scale * x[t] @ A_s[idx].T) @ B_s[idx].T + bias_s[idx], at the slice offsets.

        x: (..., H) -> (T, H); y: (..., N) with N >= sum(output_slices); A_s: (L, [1,] r, H);
        B_s: (L, [1,] n_s, r); bias_s: (L, [1,] n_s) or None. `buffer` (S, T, r), optional, is only
        checked (JAX is functional: the shrink result is a new array). `lora_ranks` (L,) int32,
        optional: each slot's real rank (kernels then skip the zero padding). `dora_scale_stacked`,
        optional: per slice None or (L, [1,] n_s), DoRA's column scale g of each slot
        (lora_core.dora; 1 for plain LoRA slots): a token's new slice value is g[idx] times
        (y + delta), in the expand's epilogue. `lora_a_scale` / `lora_b_scale`: the float32
        per-channel scales of e4m3 slices (per slice None or (L, r) / (L, n_s), or (L,) per tensor;
        None without fp8 weights), applied once per channel after the float32 sums. Returns the new y.
        """
        lora_a = as_slices("lora_a_stacked", lora_a_stacked)
        lora_b = as_slices("lora_b_stacked", lora_b_stacked)
        output_slices = checks.check_output_slices(output_slices, len(lora_b))
        if not (len(lora_a) == len(lora_b) == len(output_slices)):
            raise ValueError(f"lora_a_stacked, lora_b_stacked and output_slices must have one entry per "
                             f"slice, got {len(lora_a)}, {len(lora_b)} and {len(output_slices)}")
        y = as_array("y", y, checks.ACTIVATION_DTYPES)
        y2 = _flatten_tokens(y, "y")
        x2 = _flatten_tokens(as_array("x", x, checks.ACTIVATION_DTYPES), "x")
        if x2.shape[0] != y2.shape[0]:
            raise ValueError(f"x has {x2.shape[0]} tokens (shape {jnp.shape(x)}) but y has {y2.shape[0]} "
                             f"(shape {y.shape})")
        num_slots, rank, _ = checks.check_shrink(x2.shape, x2.dtype, [a.shape for a in lora_a],
                                                 [a.dtype for a in lora_a])
        a_scales = weight_scales("lora_a_scale", lora_a_scale, lora_a, "lora_a_stacked")
        b_scales = _b_scales(lora_b_stacked, lora_b_scale, lora_b)
        scale = checks.as_scale(scale)
        if buffer is not None:
            _check_buffer("buffer", as_array("buffer", buffer, checks.SHRINK_BUFFER_DTYPES),
                          (len(lora_a), x2.shape[0], rank), dtypes=checks.SHRINK_BUFFER_DTYPES)
        self._check_tokens("x", x2.shape[0])
        self._check_slots("lora_a_stacked", num_slots)
        self._check_rank("lora_a_stacked", rank)
        self._check_devices(x=x2, lora_a_stacked=lora_a, lora_a_scale=_present(a_scales),
                            lora_b_scale=_present(b_scales))
        lora_a3 = tuple(to_3d(a) for a in lora_a)
        ranks = as_lora_ranks(lora_ranks, num_slots)
        impl, kw = scale_keywords(self._impl(), self.deterministic, a_scales=a_scales, b_scales=b_scales)
        a_kw = {k: v for k, v in kw.items() if k == "a_scales"}
        if self.num_pairs:
            return self._linear_pairs(y2, x2, lora_a3, lora_b, lora_bias_stacked, dora_scale_stacked, scale,
                                      output_slices, ranks, num_slots, rank, impl, kw).reshape(y.shape)
        if buffer is None and hasattr(impl, "linear"):  # the backend may fuse shrink and expand
            lora_b3, offsets, bias = self._expand_args(y2, (len(lora_b), x2.shape[0], rank), "float32",
                                                       lora_b, lora_bias_stacked, output_slices, 0,
                                                       num_slots_a=num_slots)
            self._check_devices(x=x2, lora_b_stacked=lora_b3, y=y2, lora_bias_stacked=bias)
            extra = self._col_scale(impl, dora_scale_stacked, lora_b3, bias)
            return impl.linear(y2, x2, lora_a3, lora_b3, self.token_meta, scale, offsets, ranks,
                               bias, **extra, **kw).reshape(y.shape)
        buf = impl.shrink(x2, lora_a3, self.token_meta, scale, ranks, **a_kw)
        return self._expand(y2, buf, lora_b, lora_bias_stacked, output_slices, 0, True, self.token_meta,
                            lora_ranks=lora_ranks, dora_scale_stacked=dora_scale_stacked,
                            num_slots_a=num_slots, lora_b_scale=b_scales).reshape(y.shape)

    def _linear_pairs(self, y2, x2, lora_a3, lora_b, lora_bias_stacked, dora_scale_stacked, scale, output_slices,
                      ranks, num_slots, rank, impl, kw=None) -> jax.Array:
        """add_lora_linear for a step with several adapters per token (contract section 10):
        y[t] += sum_j w[t, j] * scale * (x[t] @ A[slot_j].T) @ B[slot_j].T per slice."""
        if lora_bias_stacked is not None or dora_scale_stacked is not None:
            raise ValueError("several adapters per token take no LoRA bias or DoRA column scale: "
                             "lora_bias_stacked and dora_scale_stacked must be None for this step")
        lora_b3, offsets, _ = self._expand_args(y2, (len(lora_b), x2.shape[0], rank), "float32", lora_b, None,
                                                output_slices, 0, num_slots_a=num_slots)
        self._check_devices(x=x2, lora_b_stacked=lora_b3, y=y2)
        meta, pairs, _ = self._pair_args()
        kw = kw or {}
        if hasattr(impl, "linear"):
            return impl.linear(y2, x2, lora_a3, lora_b3, meta, scale, offsets, ranks, None, pairs=pairs, **kw)
        buf = impl.shrink(x2, lora_a3, meta, scale, ranks, pairs=pairs,
                          **{k: v for k, v in kw.items() if k == "a_scales"})
        return impl.expand(buf, lora_b3, y2, meta, offsets, True, ranks, None, pairs=pairs,
                           **{k: v for k, v in kw.items() if k == "b_scales"})

    def add_lora_linear_stacked(self, y, x, lora_a, lora_b, scale: float, output_slices: Sequence[int], *,
                                lora_ranks=None, dora_scale=None, lora_a_scale=None, lora_b_scale=None,
                                layer: int | None = None) -> jax.Array:
        """add_lora_linear with the slices' weights stacked, as jax_lora.nn.MultiLoRALinear keeps them.

        lora_a: (S, L, r, H), slice s's A is lora_a[s]; lora_b: (L, N, r) with N = sum(output_slices),
        slice s's B is lora_b[:, off_s:off_s + n_s]. Same math and result as
        `add_lora_linear(y, x, tuple(A_s), tuple(B_s), None, scale, output_slices, lora_ranks=...)`.
        Backend "triton" reads the slices in place (ops.triton.View: no copy of every slot's
        weights per call, which XLA makes for a slice handed to a custom call); the others get
        the slices. dora_scale: None or (L, N), the slots' DoRA column scales (add_lora_linear's
        dora_scale_stacked, stacked the same way as B's columns). fp8 (e4m3) lora_a / lora_b take
        lora_a_scale (S, L, r) / lora_b_scale (L, N) float32, stacked the same way (per-tensor
        scales: give per-slice (L,) entries to add_lora_linear).

        layer: None, or an int l: every weight argument carries a leading layer axis (lora_a
        (n, S, L, r, H), lora_b (n, L, N, r), lora_ranks (n, L), dora_scale (n, L, N), the fp8 scales
        likewise: a jax_lora.lora_bank.LoRABank's arrays) and the call reads entry l of each, with
        the result of passing those entries. Backend "triton" reads them in place at layer l's
        offset; the others get the entries (a static slice in the program).
        """
        lora_a, lora_b = as_array("lora_a", lora_a), as_array("lora_b", lora_b)
        impl = self._impl()
        scaled = lora_a_scale is not None or lora_b_scale is not None
        views = getattr(impl, "READS_VIEWS", False) and not self.num_pairs and not scaled   # pairs, fp8: slices
        pre = ()                               # the index of the weights' layer entry the views read
        if layer is not None:
            entries = _layer_entries(layer, lora_a=lora_a, lora_b=lora_b, lora_ranks=lora_ranks,
                                     dora_scale=dora_scale, lora_a_scale=lora_a_scale, lora_b_scale=lora_b_scale)
            lora_ranks = entries["lora_ranks"]
            if views:
                pre = (int(layer),)
            else:
                lora_a, lora_b, dora_scale = entries["lora_a"], entries["lora_b"], entries["dora_scale"]
                lora_a_scale, lora_b_scale = entries["lora_a_scale"], entries["lora_b_scale"]
        a_shape, b_shape = lora_a.shape[len(pre):], lora_b.shape[len(pre):]
        if len(a_shape) != 4 or len(b_shape) != 3:
            raise ValueError(f"lora_a must be (S, L, r, H) and lora_b (L, N, r), got shapes {a_shape} "
                             f"and {b_shape}")
        output_slices = checks.check_output_slices(output_slices, a_shape[0])
        if sum(output_slices) != b_shape[1] or b_shape[0] != a_shape[1]:
            raise ValueError(f"lora_b {b_shape} must be (L, sum(output_slices), r) with L = "
                             f"lora_a.shape[1] = {a_shape[1]} and output_slices {output_slices}")
        offsets = tuple(sum(output_slices[:s]) for s in range(len(output_slices)))
        b_index = [(slice(None), slice(o, o + n)) for o, n in zip(offsets, output_slices)]
        if dora_scale is not None:
            dora_scale = as_array("dora_scale", dora_scale, checks.VECTOR_DTYPES)
            if dora_scale.shape[len(pre):] != (b_shape[0], b_shape[1]):
                raise ValueError(f"dora_scale must have shape {(b_shape[0], b_shape[1])} (slots, "
                                 f"sum(output_slices)), got {dora_scale.shape[len(pre):]}")
        if not views:
            return self.add_lora_linear(y, x, tuple(lora_a[s] for s in range(lora_a.shape[0])),
                                        tuple(lora_b[i] for i in b_index), None, scale, output_slices,
                                        lora_ranks=lora_ranks,
                                        dora_scale_stacked=None if dora_scale is None else
                                        tuple(dora_scale[i] for i in b_index),
                                        lora_a_scale=_stacked_scales("lora_a_scale", lora_a_scale, lora_a.shape[:3],
                                                                     [(s,) for s in range(lora_a.shape[0])]),
                                        lora_b_scale=_stacked_scales("lora_b_scale", lora_b_scale, lora_b.shape[:2],
                                                                     b_index))
        from .ops import triton as triton_ops
        y = as_array("y", y, checks.ACTIVATION_DTYPES)
        y2 = _flatten_tokens(y, "y")
        x2 = _flatten_tokens(as_array("x", x, checks.ACTIVATION_DTYPES), "x")
        if x2.shape[0] != y2.shape[0]:
            raise ValueError(f"x has {x2.shape[0]} tokens (shape {jnp.shape(x)}) but y has {y2.shape[0]} "
                             f"(shape {y.shape})")
        S = a_shape[0]
        num_slots, rank, _ = checks.check_shrink(x2.shape, x2.dtype, [a_shape[1:]] * S, [lora_a.dtype] * S,
                                                 arg_a="lora_a")
        checks.check_expand((S, x2.shape[0], rank), "float32",
                            [(b_shape[0], n, b_shape[2]) for n in output_slices],
                            [lora_b.dtype] * S, y2.shape, y2.dtype, 0, arg_b="lora_b")
        self._check_tokens("x", x2.shape[0])
        self._check_slots("lora_a", num_slots)
        self._check_rank("lora_a", rank)
        self._check_devices(x=x2, lora_a=lora_a, lora_b=lora_b, y=y2)
        a_views = tuple(triton_ops.view(lora_a, (*pre, s)) for s in range(S))
        b_views = tuple(triton_ops.view(lora_b, (*pre, *i)) for i in b_index)
        extra = {} if dora_scale is None else {"col_scale": tuple(triton_ops.view(dora_scale, (*pre, *i))
                                                                  for i in b_index)}
        return impl.linear(y2, x2, a_views, b_views, self.token_meta, checks.as_scale(scale), offsets,
                           as_lora_ranks(lora_ranks, num_slots), None, **extra).reshape(y.shape)

    def add_lora_logits(self, y, x, lora_a_stacked, lora_b_stacked, scale: float, *, buffer=None,
                        lora_ranks=None, lora_a_scale=None, lora_b_scale=None, **kwargs) -> jax.Array:
        """y[j] += (scale * x[j] @ A[s_j].T) @ B[s_j].T with s_j the sampler index of row j.

        x: (R, H) hidden states of the sampled rows; y: (R, V) logits; A: (L, [1,] r, H);
        B: (L, [1,] V', r), cut to V columns when V' > V. Rows past the sampler indices, and rows
        whose sampler index is -1, are unchanged. lora_a_scale / lora_b_scale: the float32 scales
        of an fp8 A / B ((L, r) / (L, V') per channel or (L,) per tensor; see add_lora_linear).
        """
        y = as_array("y", y, checks.ACTIVATION_DTYPES)
        y2 = _flatten_tokens(y, "y")
        x2 = _flatten_tokens(as_array("x", x, checks.ACTIVATION_DTYPES), "x")
        if x2.shape[0] != y2.shape[0]:
            raise ValueError(f"x has {x2.shape[0]} rows but y has {y2.shape[0]}")
        checks.check_single_weight(lora_a_stacked=lora_a_stacked, lora_b_stacked=lora_b_stacked)
        a = as_array("lora_a_stacked", lora_a_stacked, checks.WEIGHT_DTYPES)
        b = as_array("lora_b_stacked", lora_b_stacked, checks.WEIGHT_DTYPES)
        num_slots, rank, _ = checks.check_shrink(x2.shape, x2.dtype, [a.shape], [a.dtype])
        scale = checks.as_scale(scale)
        a_scales = weight_scales("lora_a_scale", lora_a_scale, (a,), "lora_a_stacked")
        b_scales = weight_scales("lora_b_scale", lora_b_scale, (b,), "lora_b_stacked")
        if buffer is not None:
            _check_buffer("buffer", as_array("buffer", buffer, checks.SHRINK_BUFFER_DTYPES), (x2.shape[0], rank),
                          allow_leading_one=True, dtypes=checks.SHRINK_BUFFER_DTYPES)
        self._check_tokens("x", x2.shape[0])
        self._check_slots("lora_a_stacked", num_slots)
        self._check_rank("lora_a_stacked", rank)
        self._check_devices(x=x2, lora_a_stacked=a, lora_b_stacked=b, y=y2, lora_a_scale=_present(a_scales),
                            lora_b_scale=_present(b_scales))
        if self.num_pairs:
            rows = self._pair_args()[2]
            return self._add_per_pair(y2, rows.row_slots, rows.row_weights, x2, to_3d(b), to_3d(a), scale,
                                      a_scale=a_scales and a_scales[0],
                                      b_scale=b_scales and b_scales[0]).reshape(y.shape)
        impl, kw = scale_keywords(self._impl(), self.deterministic, a_scales=a_scales)
        buf = impl.shrink(x2, (to_3d(a),), self.prompt_meta, scale, as_lora_ranks(lora_ranks, num_slots), **kw)
        _, width, _ = checks.weight_dims("lora_b_stacked", b.shape, "vocab_size, rank")
        return self._expand(y2, buf, (b,), None, (width,), 0, True, self.prompt_meta, cut_to_y=True,
                            lora_ranks=lora_ranks, num_slots_a=num_slots, lora_b_scale=b_scales).reshape(y.shape)

    # ------------------------------------------------------------------ mixture of experts (contract section 9)
    def moe_lora_align_block_size(self, topk_ids, num_tokens: int, block_size: int, num_experts: int,
                                  max_loras: int, adapter_enabled=None, expert_map=None, pad_sorted_ids: bool = False,
                                  naive_block_assignment: bool = False) -> tuple:
        """The routed pairs of this step's tokens grouped by (slot, expert) for `add_lora_fused_moe`
        (jax_lora.ops.fused_moe). Returns (token_lora_mapping (T,), sorted_token_ids (L * EM,) or None,
        expert_ids, num_tokens_post_padded (L,) or None); naive_block_assignment: no grouping,
        expert_ids = topk_ids flattened (mapped through expert_map when given). topk_ids
        (num_tokens, top_k); tokens past the mapped count have no adapter."""
        topk_ids = as_array("topk_ids", topk_ids)
        num_tokens = int(num_tokens)
        if topk_ids.ndim != 2 or topk_ids.shape[0] != num_tokens:
            raise ValueError(f"topk_ids must be (num_tokens, top_k) = ({num_tokens}, top_k), got shape "
                             f"{topk_ids.shape}")
        self._check_tokens("topk_ids", num_tokens)
        mapping = self.token_meta.token_lora_mapping[:num_tokens]
        if naive_block_assignment:
            experts = topk_ids.reshape(-1).astype(jnp.int32)
            if expert_map is not None:
                emap = jnp.asarray(expert_map).astype(jnp.int32)
                experts = jnp.where(experts >= 0, emap[jnp.clip(experts, 0, emap.shape[0] - 1)], experts)
            return mapping, None, experts, None
        layout = fused_moe.moe_lora_align_block_size(topk_ids, mapping, num_experts, block_size, max_loras,
                                                     adapter_enabled, expert_map, pad_sorted_ids)
        return (mapping,) + layout

    def add_lora_fused_moe(self, y, x, lora_a_stacked, lora_b_stacked, topk_weights, sorted_token_ids, expert_ids,
                           num_tokens_post_padded, max_lora_rank: int, top_k_num: int, shrink_config=None,
                           expand_config=None, adapter_enabled=None, mul_routed_weight: bool = False,
                           fully_sharded: bool = False, offset: int = 0, token_lora_mapping=None, *,
                           lora_ranks=None, lora_a_scale=None, lora_b_scale=None) -> jax.Array:
        """y[t, k, offset + cols_s] += w(p) * B_s[l, e] @ A_s[l, e] @ x[row(p)] for every routed pair
        (contract section 9; jax_lora.ops.fused_moe); returns the new y (T, top_k, N).

        A_s (L, E, r, K), B_s (L, E, n_s, r), the scaling folded into B. x: (T, K) without
        mul_routed_weight, (T * top_k, K) with it (then w(p) = topk_weights[t, k]). The layout from
        `moe_lora_align_block_size`, or sorted_token_ids None and expert_ids the routed experts
        (naive). token_lora_mapping: default this step's. shrink_config / expand_config (vLLM's
        Triton tiles) are accepted and unused; fully_sharded=True is refused. lora_ranks (L,),
        optional: each slot's real rank. lora_a_scale / lora_b_scale (contract section 11): for fp8
        (e4m3) A_s / B_s, one float32 scale per slice, (L, E, r) / (L, E, n_s) per channel or (L,)
        per slot; None for 16-bit weights.
        """
        if fully_sharded:
            raise ValueError("fully_sharded: expected False; fully sharded MoE LoRA across tensor-parallel ranks is "
                             "not supported")
        weights = as_array("topk_weights", topk_weights)
        if weights.ndim != 2:
            raise ValueError(f"topk_weights must be (num_tokens, top_k), got shape {weights.shape}")
        num_tokens = weights.shape[0]
        self._check_tokens("topk_weights", num_tokens)
        lora_a = as_slices("lora_a_stacked", lora_a_stacked)
        lora_b = as_slices("lora_b_stacked", lora_b_stacked)
        self._check_slots("lora_a_stacked", int(lora_a[0].shape[0]))
        a_scales = fused_moe.expert_scales("lora_a_scale", lora_a_scale, lora_a, "lora_a_stacked")
        b_scales = fused_moe.expert_scales("lora_b_scale", lora_b_scale, lora_b, "lora_b_stacked")
        self._check_devices(x=as_array("x", x), y=as_array("y", y), lora_a_stacked=lora_a, lora_b_stacked=lora_b,
                            lora_a_scale=_present(a_scales), lora_b_scale=_present(b_scales))
        if token_lora_mapping is None:
            token_lora_mapping = self.token_meta.token_lora_mapping[:num_tokens]
        return fused_moe.fused_moe_lora(y, x, lora_a, lora_b, weights, sorted_token_ids, expert_ids,
                                        num_tokens_post_padded, token_lora_mapping, max_lora_rank, top_k_num,
                                        adapter_enabled, mul_routed_weight, offset, lora_ranks=lora_ranks,
                                        backend=self.backend, deterministic=self.deterministic,
                                        lora_a_scale=a_scales, lora_b_scale=b_scales)

    def add_lora_w13(self, y, x, lora_a_stacked, lora_b_stacked, topk_ids, topk_weights, expert_map, w1, w2,
                     num_tokens: int, top_k_num: int, max_loras: int, adapter_enabled, local_num_experts: int,
                     top_k: int, num_slices: int, fully_sharded: bool, use_tuned_config: bool,
                     token_lora_mapping=None, add_inputs: bool = True, *, lora_ranks=None, lora_a_scale=None,
                     lora_b_scale=None) -> tuple:
        """The gate_up (w13) expert LoRA of a MoE layer: aligns the routed pairs (the naive order when
        pairs are sparse, num_tokens * top_k * 8 <= local_num_experts * max_loras without expert_map,
        vLLM's rule; static under jit), then `add_lora_fused_moe` without router weights into y
        (T, top_k, N). Returns (the new y, sorted_token_ids, expert_ids, num_tokens_post_padded,
        token_lora_mapping), the last four for `add_lora_w2`. w1 / w2 (the base expert weights) and
        use_tuned_config only steer vLLM's tiles and are unused; add_inputs must be True.
        lora_a_scale / lora_b_scale: the fp8 slices' scales (`add_lora_fused_moe`)."""
        if not add_inputs:
            raise ValueError("add_inputs: expected True; the MoE LoRA ops add into y")
        lora_a = as_slices("lora_a_stacked", lora_a_stacked)
        lora_b = as_slices("lora_b_stacked", lora_b_stacked)
        if len(lora_a) != num_slices or len(lora_b) != num_slices:
            raise ValueError(f"num_slices: expected len(lora_a_stacked) = len(lora_b_stacked) = {num_slices}, got "
                             f"{len(lora_a)} and {len(lora_b)}")
        naive = moe_order.naive_block_assignment(int(num_tokens), int(top_k), int(local_num_experts), int(max_loras),
                                                 expert_map)
        block = moe_order.moe_block_size(int(num_tokens) * int(top_k), int(local_num_experts))
        mapping, sorted_ids, expert_ids, post_pad = self.moe_lora_align_block_size(
            topk_ids, num_tokens, block, local_num_experts, max_loras, adapter_enabled, expert_map,
            naive_block_assignment=naive)
        if token_lora_mapping is None:
            token_lora_mapping = mapping
        y = as_array("y", y)
        out = self.add_lora_fused_moe(y.reshape(-1, top_k_num, y.shape[-1]), x, lora_a, lora_b, topk_weights,
                                      sorted_ids, expert_ids, post_pad, lora_a[0].shape[-2], top_k, None, None,
                                      adapter_enabled, False, fully_sharded, 0, token_lora_mapping,
                                      lora_ranks=lora_ranks, lora_a_scale=lora_a_scale, lora_b_scale=lora_b_scale)
        return out.reshape(y.shape), sorted_ids, expert_ids, post_pad, token_lora_mapping

    def add_lora_w2(self, y, x, lora_a_stacked, lora_b_stacked, topk_weights, sorted_token_ids_lora,
                    expert_ids_lora, num_tokens_post_padded_lora, token_lora_mapping, num_tokens: int, w1, w2,
                    top_k_num: int, max_loras: int, adapter_enabled, top_k: int, fully_sharded: bool, tp_rank: int,
                    use_tuned_config: bool, add_inputs: bool = True, *, lora_ranks=None, lora_a_scale=None,
                    lora_b_scale=None) -> jax.Array:
        """The down (w2) expert LoRA: `add_lora_fused_moe` with the router weights applied
        (mul_routed_weight) on the alignment `add_lora_w13` returned; x (T * top_k, I), one row per
        pair; y (T, top_k, H), the per-pair output before the sum over k. Returns the new y.
        lora_a_scale / lora_b_scale: the fp8 slices' scales (`add_lora_fused_moe`)."""
        if not add_inputs:
            raise ValueError("add_inputs: expected True; the MoE LoRA ops add into y")
        if expert_ids_lora is None:
            raise ValueError("expert_ids_lora: expected the expert ids add_lora_w13 returned, got None")
        lora_a = as_slices("lora_a_stacked", lora_a_stacked)
        return self.add_lora_fused_moe(y, x, lora_a, lora_b_stacked, topk_weights, sorted_token_ids_lora,
                                       expert_ids_lora, num_tokens_post_padded_lora, lora_a[0].shape[-2], top_k, None,
                                       None, adapter_enabled, True, fully_sharded, 0, token_lora_mapping,
                                       lora_ranks=lora_ranks, lora_a_scale=lora_a_scale, lora_b_scale=lora_b_scale)

def _present(scales) -> list:
    """The given (not None) entries of per-slice weight scales, for the device check."""
    return [v for v in scales or () if v is not None]


def _b_scales(lora_b_stacked, lora_b_scale, lora_b) -> tuple | None:
    """Per-slice B scales checked against the B slices as given (`weight_scales`), cut to the widths
    of `lora_b` (the 3-D slices the expand uses: a logits B is cut to y's width)."""
    given = as_slices("lora_b_stacked", lora_b_stacked) if lora_b_scale is not None else lora_b
    scales = weight_scales("lora_b_scale", lora_b_scale, given, "lora_b_stacked")
    if scales is None:
        return None
    return tuple(None if v is None else v[:, :b.shape[-2]] for v, b in zip(scales, lora_b))


def _layer_entries(layer, **stacked) -> dict:
    """add_lora_linear_stacked's weight arguments stacked over layers ({name: array (n, ...) or None})
    as entry `layer` of each ({name: array or None}): a ValueError unless layer is an int in [0, n)
    and every given array has the same leading size n (lora_a 5-D, lora_b 4-D)."""
    if isinstance(layer, bool) or not isinstance(layer, (int, np.integer)):
        raise TypeError(f"layer must be an int (the entry of the layer-stacked weights to read), got {layer!r}")
    a, b = stacked["lora_a"], stacked["lora_b"]
    if a.ndim != 5 or b.ndim != 4:
        raise ValueError(f"with layer=, lora_a must be (n, S, L, r, H) and lora_b (n, L, N, r) (stacked over n "
                         f"layers), got shapes {a.shape} and {b.shape}")
    n = a.shape[0]
    if not 0 <= int(layer) < n:
        raise ValueError(f"layer must be in [0, {n}) (the weights' leading layer axis), got {layer}")
    out = {}
    for name, value in stacked.items():
        if value is None:
            out[name] = None
            continue
        value = as_array(name, value, None) if name not in ("lora_a", "lora_b") else value
        if value.ndim < 1 or value.shape[0] != n:
            raise ValueError(f"with layer=, {name} must be stacked over the same {n} layers as lora_a (leading "
                             f"axis {n}), got shape {value.shape}")
        out[name] = value[int(layer)]
    return out


def _stacked_scales(name: str, scales, shape: tuple, index: list):
    """A stacked scale array (add_lora_linear_stacked's) as per-slice entries: scales[index[s]];
    None stays None. shape: the leading weight dims it must have ((S, L, r) or (L, N))."""
    if scales is None:
        return None
    got = checks.dtype_name(getattr(scales, "dtype", type(scales).__name__))
    if got != "float32":
        raise ValueError(f"{name} must be a float32 array, got {got}")
    scales = jnp.asarray(scales)
    if tuple(scales.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)} (one float32 scale per slot and channel, stacked "
                         f"as the weights), got {tuple(scales.shape)}")
    return tuple(scales[i] for i in index)


def _host_bool(v):
    return v if isinstance(v, jax.core.Tracer) else bool(np.asarray(v))


def _flatten_tokens(a: jax.Array, name: str) -> jax.Array:
    if a.ndim < 2:
        raise ValueError(f"{name} must have shape (..., features) with a token axis, got {a.shape}")
    if a.ndim == 2:
        return a
    if a.shape[-1] == 0:
        raise ValueError(f"{name} must have a feature axis (its last) of size >= 1, got shape {a.shape}")
    return a.reshape(-1, a.shape[-1])


def _stack_buffer(x) -> jax.Array:
    if isinstance(x, (list, tuple)):
        parts = [as_array(f"x[{i}]", p, checks.ACTIVATION_DTYPES) for i, p in enumerate(x)]
        checks.check_slice_buffers([p.shape for p in parts])
        return jnp.stack(parts)
    return as_array("x", x, checks.ACTIVATION_DTYPES)


def _dtype_of(a):
    """An array's dtype without converting it (a Python list: its jnp dtype)."""
    dtype = getattr(a, "dtype", None)
    return dtype if dtype is not None else jnp.asarray(a).dtype


def _check_buffer(name: str, buf: jax.Array, shape: tuple, allow_leading_one: bool = False,
                  dtypes=checks.ACTIVATION_DTYPES) -> None:
    got = tuple(buf.shape)
    if got != tuple(shape) and not (allow_leading_one and got == (1,) + tuple(shape)):
        raise ValueError(f"{name} must have shape {tuple(shape)} (num_slices, num_tokens, rank), got {got}")
    checks.check_dtype(name, buf.dtype, dtypes)
