"""PunicaWrapper for PyTorch: vLLM's multi-LoRA wrapper API (contract section 5), updating y in place.

    w = PunicaWrapper(max_num_batched_tokens=512, max_batches=64, device="cuda", max_loras=8)
    w.update_metadata(mapping, lora_index_to_id, max_loras=9, vocab_size=32000)   # per step
    y = w.add_lora_linear(y, x, lora_a_stacked, lora_b_stacked, None, 1.0, (4096,))

`update_metadata` converts the mapping on the host (NumPy), writes every index buffer into one
pinned staging block and sends it with a single non-blocking copy into one persistent device
block (the index tensors are views of it, so their addresses never change: CUDA graphs captured
once stay valid), then rebuilds the kernel metadata on the device. Nothing is read back to the
host, on any path. The `add_*` methods write into `y` and also return it, so
`y = w.add_lora_linear(y, ...)` works on both sides.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Sequence
from math import isfinite
from typing import Any

import torch

from lora_core import checks
from lora_core.adapter_pairs import AdapterPairs, PairLayout, PairRows
from lora_core.host_mapping import LoRAMapping, StepLayout, max_pair_groups, prepare_step

from .meta import LoRAKernelMeta
from .ops import dispatch
from .ops import moe as _moe
from .ops.api import as_lora_ranks, as_slices, check_tensors, to_3d, weight_scales
from .warmup import warmup as _warmup

__all__ = ["PunicaWrapper"]


class PunicaWrapper:
    """Multi-LoRA wrapper over the torch ops (contract section 5).

    Args:
      max_num_batched_tokens: token capacity T_max of one step.
      max_batches: capacity for prefill segments.
      device: where the index tensors and metadata live ("cuda", "cpu", a torch.device).
      max_loras: number of weight slots (keyword-only, as in vLLM).
      backend: force "torch" or "triton"; default: chosen by the device.
      deterministic: every method gives a token bitwise the same result whatever the batch it is
        in and from run to run (batch-invariant launches; docs/api.md, "Deterministic mode").
    """

    def __init__(self, max_num_batched_tokens: int, max_batches: int, device="cpu", *, max_loras: int,
                 backend: str | None = None, deterministic: bool = False, **options: Any):
        checks.check_wrapper_sizes(max_num_batched_tokens=max_num_batched_tokens, max_batches=max_batches,
                                   max_loras=max_loras, options=options, logger="torch_lora")
        self.max_num_batched_tokens = t = int(max_num_batched_tokens)
        self.max_batches = b = int(max_batches)
        self.max_loras = int(max_loras)
        self.device = torch.device(device if device is not None else "cpu")
        self.backend = backend if backend is not None else dispatch.default_backend_name(self.device, log=True)
        dispatch.check_backend_device(self.backend, self.device)
        self._impl = dispatch.load_backend(self.backend)
        self.deterministic = dispatch.check_deterministic(deterministic)
        if self.deterministic:
            self._impl = dispatch.deterministic_impl(self._impl)

        # One device block; every index tensor is a fixed view of it.
        # One device block holds the step: index tensors and both kernel metadata are fixed views of
        # it (stable addresses for CUDA graphs), filled by one copy per step (StepLayout).
        self._layout = StepLayout(t, b, self.max_loras)
        self._block = torch.zeros(self._layout.size, dtype=torch.int32, device=self.device)
        v = self._layout.views(self._block)
        (self._token_lora_indices, self._sampler_indices, self._sampler_indices_padded,
         self._embeddings_indices, self._long_lora_indices, self._seq_start_locs, self._seq_lengths,
         self._lora_indices_per_batch) = (v[k] for k in ("token_lora_indices", "sampler_indices",
                                                          "sampler_indices_padded", "embeddings_indices",
                                                          "long_lora_indices", "seq_start_locs", "seq_lengths",
                                                          "lora_indices_per_batch"))
        self.indices_len: list = [None] * 5
        self.batch_size = -1
        self.max_length = 0
        self.token_nums = 0
        self.is_prefill = False
        self.no_lora = False
        self._max_slot = -1
        self._embedding_rows = None      # vocab_size + extra_vocab_size of the last update_metadata
        self.token_mapping_meta = _meta_view(self._layout, self._block, "token_meta")
        self.prompt_mapping_meta = _meta_view(self._layout, self._block, "prompt_meta")
        self._block.copy_(torch.from_numpy(self._layout.empty_block(pad_prompt=False)))
        self._plans: dict = {}
        self._token_meta_args: dict = {}   # T -> token_mapping_meta.meta_args(T): views, valid forever
        # Several adapters per token: one device block per pair bucket k (stable views: CUDA graphs),
        # and the bucket of this step (0: one adapter per token, the block above).
        self._pair_blocks: dict = {}       # k -> (PairLayout, block, KernelMeta, AdapterPairs, PairRows views)
        self.num_pairs = 0

    # ------------------------------------------------------------------ metadata
    def update_metadata(self, mapping: LoRAMapping, lora_index_to_id: Sequence[int | None],
                        max_loras: int, vocab_size: int, extra_vocab_size: int = 0,
                        long_lora_context=None, **kwargs: Any) -> None:
        """Converts `mapping` on the host and uploads this step's index tensors (no host sync).

        Raises ValueError for more tokens than max_num_batched_tokens, a LoRA id in no slot, a slot
        >= the wrapper's max_loras, or more prefill segments than max_batches.
        """
        step = prepare_step(mapping, lora_index_to_id, max_loras, vocab_size, extra_vocab_size,
                            long_lora_context, max_num_batched_tokens=self.max_num_batched_tokens,
                            max_batches=self.max_batches, num_slots=self.max_loras, pad_prompt=False)
        staging = torch.empty(self._layout.size, dtype=torch.int32, pin_memory=self.device.type == "cuda")
        self._layout.fill(staging.numpy(), step)
        # The caching pinned allocator keeps `staging` alive until this copy has run.
        self._block.copy_(staging, non_blocking=True)
        self.num_pairs = 0
        if step.pairs is not None:
            self.num_pairs = self._upload_pairs(*step.pairs)

        p = step.prefill
        self.indices_len = list(step.indices.indices_len)
        self.batch_size, self.max_length, self.token_nums = p.batch_size, p.max_length, p.token_nums
        self.is_prefill = step.is_prefill
        self.no_lora = step.no_lora
        self._max_slot = step.max_slot
        self._embedding_rows = int(vocab_size) + int(extra_vocab_size)

    def _upload_pairs(self, meta, pairs, rows) -> int:
        """Copies a step's pair metadata (lora_core.adapter_pairs) into its bucket's device block
        (made on the bucket's first step); returns the bucket k."""
        k = pairs.num_pairs
        entry = self._pair_blocks.get(k)
        if entry is None:
            layout = PairLayout(self.max_num_batched_tokens, max_pair_groups(self.max_batches, self.max_loras), k)
            block = torch.zeros(layout.size, dtype=torch.int32, device=self.device)
            views, p, r = layout.views(block)
            entry = self._pair_blocks[k] = (layout, block, views, AdapterPairs(p.slots, p.weights.view(torch.float32)),
                                            PairRows(r.token_slots, r.row_slots, r.row_weights.view(torch.float32)))
        layout, block = entry[:2]
        staging = torch.empty(layout.size, dtype=torch.int32, pin_memory=self.device.type == "cuda")
        layout.fill(staging.numpy(), meta, pairs, rows)
        block.copy_(staging, non_blocking=True)
        return k

    def _pair_args(self, t: int) -> tuple:
        """(group metadata for T = t tokens, AdapterPairs) of this step's pair bucket."""
        m, pairs = self._pair_blocks[self.num_pairs][2:4]
        return m._replace(token_lora_mapping=m.token_lora_mapping[:t],
                          token_indices_sorted_by_lora_ids=m.token_indices_sorted_by_lora_ids[:t]), pairs

    def _refuse_pairs(self, method: str) -> None:
        if self.num_pairs:
            raise ValueError(f"{method} takes one adapter per token, but this step's mapping gives tokens several "
                             "adapters or weights (LoRAMapping tuples / index_weights): add_lora_linear, "
                             "add_lora_embedding_ids and add_lora_logits serve such a step")

    def _add_per_pair(self, y2, slots, weights, x, lora_b, shrink_a=None, scale: float = 1.0, *,
                      a_scale=None, b_scale=None) -> None:
        """y2[t] (+)= sum_j weights[t, j] * (x[t] or scale * x[t] @ shrink_a[slot].T) @ lora_b[slot].T over
        the pairs (slots (n, k), -1: empty), one float32 sum and one cast; rows without a pair untouched.
        The one-adapter BGMV ops once per pair (the embedding and the LM head of a paired step);
        a_scale / b_scale: fp8 shrink_a's / lora_b's channel scales (the ops' w_scale)."""
        from . import ops
        n = y2.shape[0]
        acc = y2.to(torch.float32)
        for j in range(slots.shape[1]):
            idx = slots[:n, j]
            if shrink_a is None:
                part = x[j].to(torch.float32)
            else:
                part = ops.bgmv_shrink(x, shrink_a, idx, scale, backend=self.backend,
                                       deterministic=self.deterministic, w_scale=a_scale)
            ops.bgmv_expand(part * weights[:n, j, None], lora_b, acc, idx, True, backend=self.backend,
                            deterministic=self.deterministic, w_scale=b_scale)
        any_pair = (slots[:n] >= 0).any(dim=1, keepdim=True)
        y2.copy_(torch.where(any_pair, acc.to(y2.dtype), y2))

    def add_lora_embedding_ids(self, y: torch.Tensor, ids: torch.Tensor, lora_a: torch.Tensor,
                               lora_b: torch.Tensor, *, lora_ranks=None, lora_a_scale=None,
                               lora_b_scale=None) -> torch.Tensor:
        """The embedding's LoRA term from token ids, in place: y[t] += sum_j w_tj * lora_a[slot_tj, ids[t]]
        @ lora_b[slot_tj].T over each token's pairs (a plain step: its one slot at weight 1, the same
        as looking the rows up at `embeddings_indices[1]` and calling add_lora_embedding).

        y: (T, D); ids: (T,) token ids; lora_a: (L, V, r) the LoRA-A embedding table; lora_b: (L, D, r).
        lora_a_scale / lora_b_scale (contract section 11): the float32 scales of an fp8 lora_a / lora_b,
        (L, V) (one per table row) / (L, D) (one per output channel), or (L,) per tensor. An fp8 row
        is looked up as float32(lora_a[l, v]) * a_scale[l, v], kept in float32 for the expand.
        """
        check_tensors(y=y, ids=ids, lora_a=lora_a, lora_b=lora_b, lora_a_scale=lora_a_scale,
                      lora_b_scale=lora_b_scale)
        checks.check_ndim("lora_a", tuple(lora_a.shape), (3,), "3-D (max_loras, num_embeddings, rank)")
        a_scales = weight_scales("lora_a_scale", lora_a_scale, (lora_a,), "lora_a")
        a_scale = None if a_scales is None else a_scales[0]          # (L, V) float32
        b_scales = weight_scales("lora_b_scale", lora_b_scale, (lora_b,), "lora_b")
        b_scale = None if b_scales is None else b_scales[0]          # (L, D) float32
        flat = ids.reshape(-1)
        if not self.num_pairs:
            rows = self.embeddings_indices[1][:flat.shape[0]] + flat
            looked_up = lora_a.reshape(-1, lora_a.shape[-1]).index_select(0, rows)
            if a_scale is None:
                looked_up = looked_up.to(y.dtype)
            else:
                looked_up = looked_up.to(torch.float32) * a_scale.reshape(-1).index_select(0, rows)[:, None]
            return self.add_lora_embedding(y, looked_up, lora_b, lora_ranks=lora_ranks, lora_b_scale=b_scale)
        self._check_embedding_rows("lora_a", lora_a.shape[1])
        rows = self._pair_blocks[self.num_pairs][4]
        weights = self._pair_blocks[self.num_pairs][3].weights
        t = flat.shape[0]
        self._check_tokens("ids", t, self.indices_len[0])
        looked_up = []
        for j in range(self.num_pairs):
            slot = rows.token_slots[:t, j].clamp(min=0).long()
            row = lora_a[slot, flat.long()]                                               # (T, r)
            looked_up.append(row if a_scale is None else row.to(torch.float32) * a_scale[slot, flat.long()][:, None])
        self._add_per_pair(y, rows.token_slots, weights, looked_up, lora_b, b_scale=b_scale)
        return y

    def warmup(self, layers, token_counts=None, *, dtype=torch.bfloat16, lora_ranks: bool = False,
               bias: bool = False, dora: bool = False, progress: bool = True, workers=None) -> dict:
        """Compiles every kernel variant `add_lora_linear` will launch for these layer shapes
        (`lora_core.warmup.LinearShape` or (hidden, slices, rank)) and token counts (default vLLM's
        capture sizes), before serving, in `workers` processes first (default: one per core up to
        16 on a GPU); this wrapper's metadata is untouched (see torch_lora.warmup)."""
        return _warmup(self, layers, token_counts, dtype=dtype, lora_ranks=lora_ranks, bias=bias, dora=dora,
                      progress=progress, workers=workers)

    # ------------------------------------------------------------------ properties
    @property
    def token_lora_indices(self) -> torch.Tensor:
        """(T,) int32 slot per token, -1 for no LoRA."""
        return self._token_lora_indices[: self.indices_len[0] or 0]

    @property
    def sampler_indices(self) -> torch.Tensor:
        """(R,) int32 slot per sampled row."""
        return self._sampler_indices[: self.indices_len[1] or 0]

    @property
    def sampler_indices_padded(self) -> torch.Tensor:
        """(R,) int32 flat row indices `j + p_j * R` (contract section 2)."""
        return self._sampler_indices_padded[: self.indices_len[2] or 0]

    @property
    def embeddings_indices(self) -> torch.Tensor:
        """(2, T) int32 embedding-table offsets (contract section 2)."""
        return self._embeddings_indices[:, : self.indices_len[3] or 0]

    @property
    def long_lora_indices(self) -> torch.Tensor:
        """(T,) int32 long-context offsets (empty without a long-LoRA context)."""
        return self._long_lora_indices[: self.indices_len[4] or 0]

    @property
    def prefill_metadata(self) -> tuple:
        """(seq_start_locs, seq_lengths, lora_indices_per_batch, batch_size, max_length, token_nums)."""
        b = max(self.batch_size, 0)
        return (self._seq_start_locs[:b], self._seq_lengths[:b], self._lora_indices_per_batch[:b],
                self.batch_size, self.max_length, self.token_nums)

    # ------------------------------------------------------------------ vLLM's TPU wrapper's per-token ops
    # bgmv_shrink / bgmv_expand / bgmv_expand_slice with each token's slot taken from this step's
    # token_lora_indices (through the token kernel metadata already on the device).
    def shrink(self, x: torch.Tensor, w_t_all: torch.Tensor, scale: float) -> torch.Tensor:
        """(T, r) float32, a new tensor: scale * x[t] @ w_t_all[idx[t]].T, 0 where idx[t] = -1.

        x: (T, H); w_t_all: (L, [1,] r, H).
        """
        self._check_tensors(x=x, w_t_all=w_t_all)
        num_slots, rank, _ = checks.check_shrink(tuple(x.shape), x.dtype, [w_t_all.shape], [w_t_all.dtype],
                                                 arg_a="w_t_all")
        self._check_tokens("x", x.shape[0], self.indices_len[0])
        self._check_slots("w_t_all", num_slots)
        out = torch.empty((1, x.shape[0], rank), dtype=torch.float32, device=x.device)
        self._impl.shrink(x, (to_3d(w_t_all),), out, self.token_mapping_meta.meta_args(x.shape[0]),
                          checks.as_scale(scale), None)
        return out[0]

    def expand(self, y: torch.Tensor, x: torch.Tensor, w_t_all: torch.Tensor, add_inputs: bool) -> torch.Tensor:
        """y[t, :c] = (y[t, :c] if add_inputs else 0) + (x[t] @ w_t_all[idx[t]].T)[:c], in place, c = min(n, N).

        x: (T, r); w_t_all: (L, [1,] n, r); y: (T, N). A LoRA output wider than y is cut to y's
        width (vLLM's bgmv_expand). Rows with index -1 are untouched. Returns y.
        """
        width = self._check_seed_expand(y, x, w_t_all)
        self._expand(y, x.unsqueeze(0), (w_t_all,), None, (width,), 0, add_inputs, self.token_mapping_meta,
                     self.indices_len[0], cut_to_y=True)
        return y

    def expand_slice(self, y: torch.Tensor, x: torch.Tensor, w_t_all: torch.Tensor, y_offset: int,
                     y_slice_size: int, add_inputs: bool) -> torch.Tensor:
        """y[t, y_offset:y_offset+y_slice_size] = (old if add_inputs else 0) + x[t] @ w_t_all[idx[t]].T, in place.

        x: (T, r); w_t_all: (L, [1,] y_slice_size, r); y: (T, N). Rows with index -1 and columns
        outside the slice are untouched. Returns y.
        """
        width = self._check_seed_expand(y, x, w_t_all)
        checks.check_seed_slice(y_offset, y_slice_size, width, tuple(y.shape))
        self._expand(y, x.unsqueeze(0), (w_t_all,), None, (width,), int(y_offset), add_inputs,
                     self.token_mapping_meta, self.indices_len[0])
        return y

    def _check_seed_expand(self, y, x, w_t_all) -> int:
        """Checks expand / expand_slice arguments under their own names; returns w_t_all's width."""
        self._check_tensors(y=y, x=x, w_t_all=w_t_all)
        return checks.check_seed_expand(tuple(x.shape), x.dtype, tuple(w_t_all.shape), w_t_all.dtype,
                                        tuple(y.shape), y.dtype)

    # ------------------------------------------------------------------ ops
    def _check_tensors(self, **named) -> None:
        """`check_tensors` (every value a tensor, all on one device) with this wrapper's index
        tensors among them: a kernel must not get metadata from another device."""
        for name in ("y", "x"):     # check_tensors skips None (optional arguments); these are not
            if name in named and named[name] is None:
                raise TypeError(f"{name} must be a torch.Tensor, got None")
        check_tensors(**named, **{"the wrapper's index tensors": self._block})

    def _check_tokens(self, name: str, num_tokens: int, available: int | None) -> None:
        checks.check_capacity(f"{name} (tokens)", num_tokens, self.max_num_batched_tokens,
                              "max_num_batched_tokens")
        if available is None and num_tokens > 0:
            raise ValueError(f"{name} has {num_tokens} rows, but update_metadata has not been called on this "
                             "wrapper: call it with the step's mapping first")
        if available is not None and num_tokens > available:
            raise ValueError(f"{name} has {num_tokens} rows, but update_metadata mapped only {available}")

    def _check_embedding_rows(self, name: str, num_embeddings: int) -> None:
        """Refuses an embedding whose row count is not the step's vocab_size + extra_vocab_size."""
        checks.check_embedding_rows(name, num_embeddings, self._embedding_rows)

    def _check_slots(self, name: str, num_slots: int) -> None:
        if self._max_slot >= num_slots:
            raise ValueError(f"the mapping uses slot {self._max_slot}, but {name} has only {num_slots} slots "
                             f"(0..{num_slots - 1})")

    def add_shrink(self, y: torch.Tensor, x: torch.Tensor, lora_a_stacked, scale: float, *, lora_ranks=None,
                   lora_a_scale=None, **kwargs) -> torch.Tensor:
        """y[s] = scale * x @ A_s[idx].T per token (0 for -1), written into y (S, T, r). x: (..., H).
        lora_a_scale: the float32 scales of fp8 slices (contract section 11; see add_lora_linear)."""
        self._refuse_pairs("add_shrink")
        lora_a = as_slices("lora_a_stacked", lora_a_stacked)
        self._check_tensors(y=y, x=x, lora_a_stacked=lora_a, lora_a_scale=_tensors_of(lora_a_scale))
        x2 = _flat_tokens(x, "x")
        num_slots, rank, _ = checks.check_shrink(tuple(x2.shape), x2.dtype, [a.shape for a in lora_a],
                                                 [a.dtype for a in lora_a])
        _check_buffer("y", y, (len(lora_a), x2.shape[0], rank))
        self._check_tokens("x", x2.shape[0], self.indices_len[0])
        self._check_slots("lora_a_stacked", num_slots)
        a_scales = weight_scales("lora_a_scale", lora_a_scale, lora_a, "lora_a_stacked")
        self._impl.shrink(x2, tuple(to_3d(a) for a in lora_a), y,
                          self.token_mapping_meta.meta_args(x2.shape[0]), checks.as_scale(scale),
                          as_lora_ranks(lora_ranks, num_slots, x.device), **_scale_kw(a_scales=a_scales))
        return y

    def add_expand(self, y: torch.Tensor, x, lora_b_stacked, lora_bias_stacked,
                   output_slices: Sequence[int], offset_start: int = 0, add_inputs: bool = True, *,
                   lora_ranks=None, dora_scale_stacked=None, lora_b_scale=None, **kwargs) -> torch.Tensor:
        """y[:, off_s:off_s+n_s] = (y if add_inputs else 0) + x[s] @ B_s[idx].T + bias_s[idx], in place.

        y: (..., N); x: (S, T, r) or S tensors (T, r). Rows with index -1 are untouched.
        dora_scale_stacked: see add_lora_linear (the new slice value times g_s[idx]). lora_b_scale:
        the float32 scales of fp8 slices (see add_lora_linear).
        """
        self._refuse_pairs("add_expand")
        if isinstance(x, (list, tuple)):
            check_tensors(x=list(x))
            checks.check_slice_buffers([tuple(p.shape) for p in x])
            buf = torch.stack(list(x))
        else:
            buf = x
        self._expand(y, buf, lora_b_stacked, lora_bias_stacked, output_slices, offset_start, add_inputs,
                     self.token_mapping_meta, self.indices_len[0], lora_ranks=lora_ranks,
                     dora_scale_stacked=dora_scale_stacked, lora_b_scale=lora_b_scale)
        return y

    def _expand(self, y, buf, lora_b_stacked, lora_bias_stacked, output_slices, offset_start, add_inputs,
                meta: LoRAKernelMeta, available, cut_to_y: bool = False, lora_ranks=None,
                dora_scale_stacked=None, lora_b_scale=None) -> None:
        lora_b = as_slices("lora_b_stacked", lora_b_stacked)
        self._check_tensors(y=y, x=buf, lora_b_stacked=lora_b, lora_b_scale=_tensors_of(lora_b_scale))
        b_scales = weight_scales("lora_b_scale", lora_b_scale, lora_b, "lora_b_stacked")
        y2 = _token_view(y)
        slices = checks.check_output_slices(output_slices, len(lora_b))
        offset_start = checks.as_offset("offset_start", offset_start)
        if cut_to_y:  # logits: a LoRA vocabulary wider than y is cut to y's width (vLLM)
            lora_b = tuple(b[..., : y2.shape[1], :] for b in lora_b)
            b_scales = None if b_scales is None else tuple(None if sc is None else sc[:, : y2.shape[1]]
                                                           for sc in b_scales)
            slices = tuple(min(s, y2.shape[1]) for s in slices)
        num_slots, _, widths = checks.check_expand(tuple(buf.shape), buf.dtype, [b.shape for b in lora_b],
                                                   [b.dtype for b in lora_b], tuple(y2.shape), y2.dtype,
                                                   offset_start, arg_buf="x")
        checks.check_slice_widths(slices, widths)
        self._check_tokens("y", y2.shape[0], available)
        self._check_slots("lora_b_stacked", num_slots)
        bias = None
        if lora_bias_stacked is not None:
            bias_list = list(lora_bias_stacked) if isinstance(lora_bias_stacked, (list, tuple)) \
                else [lora_bias_stacked]
            check_tensors(y=y, lora_bias_stacked=[b for b in bias_list if b is not None])
            checks.check_bias([None if b is None else tuple(b.shape) for b in bias_list], slices, num_slots,
                              bias_dtypes=[None if b is None else b.dtype for b in bias_list])
            bias = tuple(None if b is None else b.reshape(num_slots, -1) for b in bias_list)
        offsets, off = [], offset_start
        for s in slices:
            offsets.append(off)
            off += s
        extra = _scale_kw(b_scales=b_scales)
        if dora_scale_stacked is not None:
            extra["col_scale"] = _dora_scales(y, dora_scale_stacked, slices, num_slots, bias)
        self._impl.expand(buf, tuple(to_3d(b) for b in lora_b), y2, meta.meta_args(y2.shape[0]),
                          tuple(offsets), checks.as_flag("add_inputs", add_inputs),
                          as_lora_ranks(lora_ranks, num_slots, y.device), bias,
                          **extra)

    def add_lora_embedding(self, y: torch.Tensor, x: torch.Tensor, lora_b_stacked: torch.Tensor,
                           add_inputs: bool = True, *, lora_ranks=None, lora_b_scale=None, **kwargs) -> torch.Tensor:
        """y (+)= x @ lora_b_stacked[idx].T per token, in place. x: (T, r); y: (T, N). lora_b_scale:
        an fp8 lora_b_stacked's float32 scales, (L, N) per channel or (L,) per tensor."""
        self._refuse_pairs("add_lora_embedding")
        check_tensors(y=y, x=x, lora_b_stacked=lora_b_stacked)
        if x.dim() != 2:
            raise ValueError(f"x must be 2-D (num_tokens, rank), got shape {tuple(x.shape)}")
        _, width, _ = checks.weight_dims("lora_b_stacked", tuple(lora_b_stacked.shape), "out_features, rank")
        self._expand(y, x.unsqueeze(0), (lora_b_stacked,), None, (width,), 0, add_inputs,
                     self.token_mapping_meta, self.indices_len[0], lora_ranks=lora_ranks, lora_b_scale=lora_b_scale)
        return y

    def add_lora_linear(self, y: torch.Tensor, x: torch.Tensor, lora_a_stacked, lora_b_stacked,
                        lora_bias_stacked, scale: float, output_slices: Sequence[int], *,
                        buffer: torch.Tensor | None = None, lora_ranks=None, dora_scale_stacked=None,
                        lora_a_scale=None, lora_b_scale=None, **kwargs) -> torch.Tensor:
        """y[t] += sum_s (scale * x[t] @ A_s[idx].T) @ B_s[idx].T + bias_s[idx], in place.

        x: (..., H); y: (..., N); `buffer` (S, T, r) float32, optional: when given, the shrink result
        is written there (two launches); without it the backend may fuse shrink and expand.
        `lora_ranks` (L,) int32, optional: each slot's real rank (kernels skip the zero padding).
        `dora_scale_stacked`, optional: per slice None or (L, [1,] n_s) float, each slot's DoRA
        column scale g (lora_core.dora; 1 for plain LoRA slots): a token with slot i gets
        y[t, slice s] = g_s[i] * (y[t, slice s] + delta), in the expand's epilogue. A slice takes a
        LoRA bias or a DoRA scale, not both.
        `lora_a_scale` / `lora_b_scale`, optional (contract section 11): the float32 scales of
        fp8 (e4m3) slices, one entry per slice (None for a 16-bit slice; one tensor for one slice),
        (L, r) / (L, n_s) per output channel or (L,) per tensor. Per-channel scales are read in
        place (like the weights); per-tensor ones are broadcast to the channels at every call.

        The hot path of a forward pass: the checks of the persistent arguments (weights, bias,
        DoRA scales, slices, dtypes, devices) run once per combination and are cached (see
        `_LinearPlan`); each call checks only what changes per step (token count, slots in use).
        """
        if not (isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor)):
            check_tensors(y=y, x=x)  # raises: names the argument that is not a tensor
        if type(scale) is not float or not isfinite(scale):
            scale = checks.as_scale(scale)          # raises for NaN and infinities
        plan = self._linear_plan(y, x, lora_a_stacked, lora_b_stacked, lora_bias_stacked, output_slices,
                                 dora_scale_stacked, lora_a_scale, lora_b_scale)
        x2 = x if x.dim() == 2 else x.reshape(-1, plan.hidden)
        y2 = y if y.dim() == 2 else _token_view(y)
        t = x2.shape[0]
        if y2.shape[0] != t or t > (self.indices_len[0] or 0) or self._max_slot >= plan.num_slots:
            if y2.shape[0] != t:
                raise ValueError(f"x has {t} tokens (shape {tuple(x.shape)}) but y has {y2.shape[0]} "
                                 f"(shape {tuple(y.shape)})")
            self._check_tokens("x", t, self.indices_len[0])
            self._check_slots("lora_a_stacked", plan.num_slots)
        ranks = None if lora_ranks is None else as_lora_ranks(lora_ranks, plan.num_slots, x.device)
        if self.num_pairs:
            self._linear_pairs(y2, x2, plan, scale, ranks, buffer, dora_scale_stacked)
            return y
        meta_args = self._token_meta_args.get(t)
        if meta_args is None:
            meta_args = self._token_meta_args[t] = self.token_mapping_meta.meta_args(t)
        if buffer is None and plan.prepare is not None:
            run = plan.prepared.get(t)
            if run is None:
                if len(plan.prepared) >= 64:          # (prefill token counts vary without bound)
                    plan.prepared.clear()
                run = plan.prepared[t] = plan.prepare(plan.lora_a, plan.lora_b, meta_args, plan.offsets, plan.bias)
            run(y2, x2, scale, ranks)
            return y
        if buffer is None and plan.linear is not None:
            plan.linear(y2, x2, plan.lora_a, plan.lora_b, meta_args, scale, plan.offsets, ranks, plan.bias)
            return y
        shape = (len(plan.lora_a), t, plan.rank)
        if buffer is None:
            buffer = torch.empty(shape, dtype=torch.float32, device=x.device)
        else:
            check_tensors(x=x, buffer=buffer)
            _check_buffer("buffer", buffer, shape, checks.SHRINK_BUFFER_DTYPES)
        plan.shrink(x2, plan.lora_a, buffer, meta_args, scale, ranks)
        plan.expand(buffer, plan.lora_b, y2, meta_args, plan.offsets, True, ranks, plan.bias)
        return y

    def _linear_pairs(self, y2, x2, plan, scale, ranks, buffer, dora_scale_stacked) -> None:
        """add_lora_linear for a step with several adapters per token (contract section 10):
        y[t] += sum_j w[t, j] * scale * (x[t] @ A[slot_j].T) @ B[slot_j].T per slice, the pairs'
        shrink products side by side in a (S, T, k * r) float32 buffer."""
        if plan.bias is not None and any(b is not None for b in plan.bias) or dora_scale_stacked is not None:
            raise ValueError("several adapters per token take no LoRA bias or DoRA column scale: "
                             "lora_bias_stacked and dora_scale_stacked must be None for this step")
        t = x2.shape[0]
        meta_args, pairs = self._pair_args(t)
        if buffer is None and plan.prepare is not None:
            key = ("pairs", self.num_pairs, t)          # the bucket's block views: valid forever
            run = plan.prepared.get(key)
            if run is None:
                if len(plan.prepared) >= 64:
                    plan.prepared.clear()
                run = plan.prepared[key] = plan.prepare(plan.lora_a, plan.lora_b, meta_args, plan.offsets, None,
                                                        pairs=pairs)
            run(y2, x2, scale, ranks)
            return
        if buffer is None and plan.linear is not None:
            plan.linear(y2, x2, plan.lora_a, plan.lora_b, meta_args, scale, plan.offsets, ranks, None, pairs=pairs)
            return
        shape = (len(plan.lora_a), t, plan.rank * self.num_pairs)
        if buffer is None:
            buffer = torch.empty(shape, dtype=torch.float32, device=x2.device)
        else:
            check_tensors(x=x2, buffer=buffer)
            _check_buffer("buffer", buffer, shape, checks.SHRINK_BUFFER_DTYPES)
        plan.shrink(x2, plan.lora_a, buffer, meta_args, scale, ranks, pairs=pairs)
        plan.expand(buffer, plan.lora_b, y2, meta_args, plan.offsets, True, ranks, None, pairs=pairs)

    def _linear_plan(self, y, x, lora_a_stacked, lora_b_stacked, lora_bias_stacked, output_slices,
                     dora_scale_stacked=None, lora_a_scale=None, lora_b_scale=None):
        seq = (list, tuple)
        lora_a = tuple(lora_a_stacked) if isinstance(lora_a_stacked, seq) else (lora_a_stacked,)
        lora_b = tuple(lora_b_stacked) if isinstance(lora_b_stacked, seq) else (lora_b_stacked,)
        bias_list = None if lora_bias_stacked is None else (
            tuple(lora_bias_stacked) if isinstance(lora_bias_stacked, seq) else (lora_bias_stacked,))
        tensors = lora_a + lora_b + (bias_list or ())
        try:
            # the widths' types too: (16.0,) == (16,), but only the ints pass check_output_slices
            slices_key = (tuple(output_slices), tuple(map(type, output_slices)))
        except TypeError:
            slices_key = output_slices
        key = (tuple(map(id, tensors)), len(lora_a), slices_key, x.dtype, x.shape[-1] if x.dim() else None,
               x.device, y.dtype, y.shape[-1] if y.dim() else None, y.device)
        scales = None
        if dora_scale_stacked is not None:
            # A DoRA call's key is ("dora", the plain key, the scales' ids): never equal to a plain
            # key, and the scale tensors are watched like the weights.
            scales = tuple(dora_scale_stacked) if isinstance(dora_scale_stacked, seq) else (dora_scale_stacked,)
            key = ("dora", key, tuple(map(id, scales)))
            tensors = tensors + scales
        fp8 = None
        if lora_a_scale is not None or lora_b_scale is not None:
            # fp8 weights: the key names the scale tensors too (watched like the weights)
            fp8 = (lora_a_scale, lora_b_scale)
            fp8_tensors = tuple(_scale_entries(lora_a_scale)) + tuple(_scale_entries(lora_b_scale))
            key = ("fp8", key, tuple(map(id, fp8_tensors)), len(_scale_entries(lora_a_scale)))
            tensors = tensors + fp8_tensors
        plan = self._plans.get(key)
        if plan is not None and plan.refers_to(tensors):
            return plan
        if plan is not None:   # a weight's storage, shape, strides or dtype changed (`.data =`, `set_`)
            del self._plans[key]
        plan = self._build_linear_plan(y, x, lora_a, lora_b, bias_list, output_slices, scales, fp8)
        plan.watch(tensors, self._plans, key)
        if len(self._plans) >= 1024:
            self._plans.pop(next(iter(self._plans)))
        self._plans[key] = plan
        return plan

    def _build_linear_plan(self, y, x, lora_a, lora_b, bias_list, output_slices, scales=None,
                           fp8=None) -> _LinearPlan:
        """Every check of contract section 6 that does not depend on the step. With DoRA scales, the
        plan's backend entry points (linear, prepare_linear, expand) have them bound as col_scale;
        with fp8 weights (fp8 = (lora_a_scale, lora_b_scale)) the channel scales are bound as
        a_scales / b_scales (`_bind_fp8_scales`)."""
        lora_a = as_slices("lora_a_stacked", lora_a)
        lora_b = as_slices("lora_b_stacked", lora_b)
        output_slices = checks.check_output_slices(output_slices, len(lora_b))
        if not (len(lora_a) == len(lora_b) == len(output_slices)):
            raise ValueError(f"lora_a_stacked, lora_b_stacked and output_slices must have one entry per "
                             f"slice, got {len(lora_a)}, {len(lora_b)} and {len(output_slices)}")
        self._check_tensors(y=y, x=x, lora_a_stacked=lora_a, lora_b_stacked=lora_b,
                      lora_bias_stacked=[b for b in (bias_list or ()) if b is not None],
                      **({} if fp8 is None else {"lora_a_scale": _tensors_of(fp8[0]),
                                                  "lora_b_scale": _tensors_of(fp8[1])}))
        x2 = _flat_tokens(x, "x")
        num_slots, rank, hidden = checks.check_shrink(tuple(x2.shape), x2.dtype, [a.shape for a in lora_a],
                                                      [a.dtype for a in lora_a])
        y2 = _token_view(y)
        slices = checks.check_output_slices(output_slices, len(lora_b))
        num_slots_b, _, widths = checks.check_expand((len(lora_b), x2.shape[0], rank), "float32",
                                                     [b.shape for b in lora_b], [b.dtype for b in lora_b],
                                                     (x2.shape[0], y2.shape[1]), y2.dtype, 0, arg_buf="x")
        checks.check_slice_widths(slices, widths)
        checks.check_slot_counts(num_slots, num_slots_b)
        bias = None
        if bias_list is not None:
            checks.check_bias([None if b is None else tuple(b.shape) for b in bias_list], slices, num_slots,
                              bias_dtypes=[None if b is None else b.dtype for b in bias_list])
            bias = tuple(None if b is None else b.detach().reshape(num_slots, -1) for b in bias_list)
        offsets = tuple(sum(slices[:s]) for s in range(len(slices)))
        linear = getattr(self._impl, "linear", None)
        prepare = getattr(self._impl, "prepare_linear", None)
        expand = self._impl.expand
        shrink = self._impl.shrink
        if scales is not None:
            col_scale = _dora_scales(y, scales, slices, num_slots, bias)
            linear, prepare, expand = (None if f is None else functools.partial(f, col_scale=col_scale)
                                       for f in (linear, prepare, expand))
        if fp8 is not None:
            shrink, linear, prepare, expand = _bind_fp8_scales(fp8, lora_a, lora_b, shrink, linear, prepare, expand)
        else:   # fp8 weights without scales: the ValueError naming the missing argument
            weight_scales("lora_a_scale", None, lora_a, "lora_a_stacked")
            weight_scales("lora_b_scale", None, lora_b, "lora_b_stacked")
        return _LinearPlan(hidden, num_slots, rank, tuple(to_3d(a.detach()) for a in lora_a),
                           tuple(to_3d(b.detach()) for b in lora_b), bias, offsets, linear, prepare, expand,
                           shrink)

    def add_lora_logits(self, y: torch.Tensor, x: torch.Tensor, lora_a_stacked: torch.Tensor,
                        lora_b_stacked: torch.Tensor, scale: float, *, buffer: torch.Tensor | None = None,
                        lora_ranks=None, lora_a_scale=None, lora_b_scale=None, **kwargs) -> torch.Tensor:
        """y[j] += (scale * x[j] @ A[s_j].T) @ B[s_j].T, s_j the sampler index of row j, in place.

        x: (R, H); y: (R, V); B: (L, [1,] V', r), cut to V columns when V' > V. lora_a_scale /
        lora_b_scale: the float32 scales of an fp8 A / B (see add_lora_linear).
        """
        checks.check_single_weight(lora_a_stacked=lora_a_stacked, lora_b_stacked=lora_b_stacked)
        self._check_tensors(y=y, x=x, lora_a_stacked=lora_a_stacked, lora_b_stacked=lora_b_stacked, buffer=buffer)
        x2 = _flat_tokens(x, "x")
        num_slots, rank, _ = checks.check_shrink(tuple(x2.shape), x2.dtype, [lora_a_stacked.shape],
                                                 [lora_a_stacked.dtype])
        shape = (1, x2.shape[0], rank)
        if buffer is None:
            buffer = torch.empty(shape, dtype=torch.float32, device=x.device)
        else:
            buffer = buffer.view(shape) if buffer.numel() == x2.shape[0] * rank else buffer
            _check_buffer("buffer", buffer, shape, checks.SHRINK_BUFFER_DTYPES)
        self._check_tokens("x", x2.shape[0], self.indices_len[1])
        self._check_slots("lora_a_stacked", num_slots)
        a_scales = weight_scales("lora_a_scale", lora_a_scale, (lora_a_stacked,), "lora_a_stacked")
        if self.num_pairs:
            b_scales = weight_scales("lora_b_scale", lora_b_scale, (lora_b_stacked,), "lora_b_stacked")
            rows = self._pair_blocks[self.num_pairs][4]
            self._add_per_pair(_token_view(y), rows.row_slots, rows.row_weights, x2, to_3d(lora_b_stacked),
                               to_3d(lora_a_stacked), checks.as_scale(scale), a_scale=a_scales and a_scales[0],
                               b_scale=b_scales and b_scales[0])
            return y
        self._impl.shrink(x2, (to_3d(lora_a_stacked),), buffer, self.prompt_mapping_meta.meta_args(x2.shape[0]),
                          checks.as_scale(scale), as_lora_ranks(lora_ranks, num_slots, x.device),
                          **_scale_kw(a_scales=a_scales))
        num_slots_b, width, _ = checks.weight_dims("lora_b_stacked", tuple(lora_b_stacked.shape), "vocab_size, rank")
        checks.check_slot_counts(num_slots, num_slots_b)
        self._expand(y, buffer, (lora_b_stacked,), None, (width,), 0, True, self.prompt_mapping_meta,
                     self.indices_len[1], cut_to_y=True, lora_ranks=lora_ranks, lora_b_scale=lora_b_scale)
        return y

    # ------------------------------------------------------------------ mixture-of-experts LoRA

    def moe_lora_align_block_size(self, topk_ids: torch.Tensor, num_tokens: int, block_size: int, num_experts: int,
                                  max_loras: int, adapter_enabled: torch.Tensor, expert_map: torch.Tensor | None = None,
                                  pad_sorted_ids: bool = False, naive_block_assignment: bool = False) -> tuple:
        """The routed pairs of this step's tokens grouped by (slot, expert) for the MoE LoRA kernels
        (contract section 9). Returns (token_lora_mapping (T,), sorted_token_ids (L * EM,) or None,
        expert_ids, num_tokens_post_padded (L,) or None); naive_block_assignment: no grouping,
        expert_ids = topk_ids flattened (mapped through expert_map when given)."""
        self._check_tensors(topk_ids=topk_ids, adapter_enabled=adapter_enabled, expert_map=expert_map)
        self._check_tokens("topk_ids", int(num_tokens), self.indices_len[0])
        token_lora_mapping = self.token_mapping_meta.meta_args(int(num_tokens)).token_lora_mapping
        if naive_block_assignment:
            experts = topk_ids.reshape(-1)
            if expert_map is not None:
                experts = torch.where(experts >= 0, expert_map.to(experts.device)[experts.clamp(min=0).long()],
                                      experts)
            return token_lora_mapping, None, experts, None
        sorted_ids, expert_ids, post_pad = _moe.moe_lora_align_block_size(
            topk_ids, token_lora_mapping, num_experts, block_size, max_loras, adapter_enabled, expert_map,
            pad_sorted_ids)
        return token_lora_mapping, sorted_ids, expert_ids, post_pad

    def add_lora_fused_moe(self, y: torch.Tensor, x: torch.Tensor, lora_a_stacked, lora_b_stacked,
                           topk_weights: torch.Tensor, sorted_token_ids: torch.Tensor | None, expert_ids: torch.Tensor,
                           num_tokens_post_padded: torch.Tensor | None, max_lora_rank: int, top_k_num: int,
                           shrink_config: dict, expand_config: dict, adapter_enabled: torch.Tensor,
                           mul_routed_weight: bool = False, fully_sharded: bool = False, offset: int = 0,
                           token_lora_mapping: torch.Tensor | None = None, *, lora_a_scale=None,
                           lora_b_scale=None) -> torch.Tensor:
        """y[t, k, offset + cols_s] += w(p) * B_s[l, e] @ A_s[l, e] @ x[row(p)] for every routed pair
        (contract section 9), in place; returns y. A_s (L, E, r, K), B_s (L, E, n_s, r), the scaling
        folded into B. The block size of a sorted order is read from the arrays (shrink_config /
        expand_config choose vLLM's tiles and are not used by these kernels); fully_sharded (tensor
        parallel LoRA) is refused. lora_a_scale / lora_b_scale (contract section 11): for fp8 (e4m3)
        A_s / B_s, one float32 scale per slice, (L, E, r) / (L, E, n_s) per channel or (L,) per slot
        (`torch_lora.ops.fused_moe_lora`'s arguments); None for 16-bit weights."""
        if fully_sharded:
            raise ValueError("fully_sharded: expected False; fully sharded MoE LoRA across tensor-parallel ranks is "
                             "not supported")
        if token_lora_mapping is None:
            token_lora_mapping = self.token_mapping_meta.meta_args(y.shape[0]).token_lora_mapping
        self._check_tokens("y", y.shape[0], self.indices_len[0])
        self._check_tensors(y=y, lora_a_scale=_tensors_of(lora_a_scale), lora_b_scale=_tensors_of(lora_b_scale))
        block = None
        if sorted_token_ids is not None:
            block = sorted_token_ids.numel() // max(expert_ids.numel(), 1)
        _moe.fused_moe_lora(y, x, lora_a_stacked, lora_b_stacked, topk_weights, sorted_token_ids, expert_ids,
                            num_tokens_post_padded, token_lora_mapping, max_lora_rank, top_k_num, adapter_enabled,
                            mul_routed_weight, offset, block_size=block, backend=self.backend,
                            deterministic=self.deterministic, lora_a_scale=lora_a_scale, lora_b_scale=lora_b_scale)
        return y

    def add_lora_w13(self, y: torch.Tensor, x: torch.Tensor, lora_a_stacked, lora_b_stacked, topk_ids: torch.Tensor,
                     topk_weights: torch.Tensor, expert_map: torch.Tensor | None, w1: torch.Tensor, w2: torch.Tensor,
                     num_tokens: int, top_k_num: int, max_loras: int, adapter_enabled: torch.Tensor,
                     local_num_experts: int, top_k: int, num_slices: int, fully_sharded: bool,
                     use_tuned_config: bool, token_lora_mapping: torch.Tensor | None = None,
                     add_inputs: bool = True, *, lora_a_scale=None, lora_b_scale=None) -> tuple:
        """The gate_up (w13) expert LoRA of a MoE layer: aligns the routed pairs (naive order when
        pairs are sparse: num_tokens * top_k * 8 <= local_num_experts * max_loras and no
        expert_map, vLLM's rule), then `add_lora_fused_moe` without routed weights into y
        (T, top_k, N). Returns (sorted_token_ids, expert_ids, num_tokens_post_padded,
        token_lora_mapping) for `add_lora_w2`. w1 / w2 (the base expert weights) and
        use_tuned_config only steer vLLM's tile choice; add_inputs must be True (y accumulates).
        lora_a_scale / lora_b_scale: the fp8 slices' scales (`add_lora_fused_moe`)."""
        if not add_inputs:
            raise ValueError("add_inputs: expected True; the MoE LoRA ops add into y")
        if len(lora_a_stacked) != num_slices or len(lora_b_stacked) != num_slices:
            raise ValueError(f"num_slices: expected len(lora_a_stacked) = len(lora_b_stacked) = {num_slices}, got "
                             f"{len(lora_a_stacked)} and {len(lora_b_stacked)}")
        naive = _moe.naive_block_assignment(int(num_tokens), int(top_k), int(local_num_experts), int(max_loras),
                                            expert_map)
        block = _moe.moe_block_size(int(num_tokens) * int(top_k), int(local_num_experts))
        mapping, sorted_ids, expert_ids, post_pad = self.moe_lora_align_block_size(
            topk_ids, num_tokens, block, local_num_experts, max_loras, adapter_enabled, expert_map,
            naive_block_assignment=naive)
        if token_lora_mapping is None:
            token_lora_mapping = mapping
        max_lora_rank = lora_a_stacked[0].shape[-2]
        self.add_lora_fused_moe(y.view(-1, top_k_num, y.shape[-1]), x, lora_a_stacked, lora_b_stacked, topk_weights,
                                sorted_ids, expert_ids, post_pad, max_lora_rank, top_k, {}, {}, adapter_enabled,
                                fully_sharded=fully_sharded, token_lora_mapping=token_lora_mapping,
                                lora_a_scale=lora_a_scale, lora_b_scale=lora_b_scale)
        return sorted_ids, expert_ids, post_pad, token_lora_mapping

    def add_lora_w2(self, y: torch.Tensor, x: torch.Tensor, lora_a_stacked, lora_b_stacked,
                    topk_weights: torch.Tensor, sorted_token_ids_lora: torch.Tensor | None,
                    expert_ids_lora: torch.Tensor | None, num_tokens_post_padded_lora: torch.Tensor | None,
                    token_lora_mapping: torch.Tensor | None, num_tokens: int, w1: torch.Tensor, w2: torch.Tensor,
                    top_k_num: int, max_loras: int, adapter_enabled: torch.Tensor, top_k: int, fully_sharded: bool,
                    tp_rank: int, use_tuned_config: bool, add_inputs: bool = True, *, lora_a_scale=None,
                    lora_b_scale=None) -> torch.Tensor:
        """The down (w2) expert LoRA: `add_lora_fused_moe` with the router weights applied
        (mul_routed_weight) on the alignment `add_lora_w13` returned; x (T * top_k, I), one row per
        pair; y (T, top_k, H), the per-pair output before the sum over k. Returns y.
        lora_a_scale / lora_b_scale: the fp8 slices' scales (`add_lora_fused_moe`)."""
        if not add_inputs:
            raise ValueError("add_inputs: expected True; the MoE LoRA ops add into y")
        if expert_ids_lora is None:
            raise ValueError("expert_ids_lora: expected the expert ids add_lora_w13 returned, got None")
        max_lora_rank = lora_a_stacked[0].shape[-2]
        return self.add_lora_fused_moe(y, x, lora_a_stacked, lora_b_stacked, topk_weights, sorted_token_ids_lora,
                                       expert_ids_lora, num_tokens_post_padded_lora, max_lora_rank, top_k, {}, {},
                                       adapter_enabled, True, fully_sharded=fully_sharded,
                                       token_lora_mapping=token_lora_mapping, lora_a_scale=lora_a_scale,
                                       lora_b_scale=lora_b_scale)


def _meta_view(layout: StepLayout, block: torch.Tensor, prefix: str) -> LoRAKernelMeta:
    """A LoRAKernelMeta whose tensors are views of the wrapper's block (filled on the host); the
    flag is the low byte of its int32 0/1, as a (1,) bool."""
    meta = layout.kernel_meta(block, prefix)
    return LoRAKernelMeta(**meta._replace(no_lora=meta.no_lora.view(torch.bool)[:1])._asdict())


def _scale_entries(scales) -> list:
    """The tensors among fp8 scale arguments (None, one tensor, or a sequence per slice), in order."""
    items = scales if isinstance(scales, (list, tuple)) else (scales,)
    return [sc for sc in items if sc is not None]


def _tensors_of(scales) -> list:
    """fp8 scale arguments as a list for `check_tensors` (which names a non-tensor entry)."""
    return _scale_entries(scales)


def _scale_kw(**scales) -> dict:
    """The backend keywords of fp8 channel scales that are given ({} for 16-bit weights)."""
    return {k: v for k, v in scales.items() if v is not None}


def _bind_fp8_scales(fp8, lora_a, lora_b, shrink, linear, prepare, expand) -> tuple:
    """(shrink, linear, prepare, expand) with the fp8 weights' channel scales bound (a_scales,
    b_scales; checked here, `weight_scales`). Per-channel scales are views of the caller's tensors
    (in-place updates are seen), bound once. A per-tensor scale (L,) is broadcast to its channels
    (a new tensor) at every call instead, so an in-place update of it is seen too; the prepared
    launches, which hold pointers, are then not used (prepare is None)."""
    a_src, b_src = fp8

    def current():
        return (weight_scales("lora_a_scale", a_src, lora_a, "lora_a_stacked"),
                weight_scales("lora_b_scale", b_src, lora_b, "lora_b_stacked"))

    a_scales, b_scales = current()
    per_tensor = any(sc.dim() == 1 for sc in _scale_entries(a_src) + _scale_entries(b_src))
    if not per_tensor:
        bind = functools.partial
        return (bind(shrink, **_scale_kw(a_scales=a_scales)),
                None if linear is None else bind(linear, **_scale_kw(a_scales=a_scales, b_scales=b_scales)),
                None if prepare is None else bind(prepare, **_scale_kw(a_scales=a_scales, b_scales=b_scales)),
                bind(expand, **_scale_kw(b_scales=b_scales)))

    def per_call(f, which):
        def run(*args, **kwargs):
            a, b = current()
            given = {"a_scales": a, "b_scales": b}
            return f(*args, **kwargs, **_scale_kw(**{k: given[k] for k in which}))
        return run
    return (per_call(shrink, ("a_scales",)), None if linear is None else per_call(linear, ("a_scales", "b_scales")),
            None, per_call(expand, ("b_scales",)))


class _LinearPlan:
    """The checked, normalised persistent arguments of `add_lora_linear`: weights as 3-D tensors
    sharing the caller's storage, bias as (L, n_s), slice offsets.

    Lifetime: the plan holds detached views (they share storage, so in-place weight updates are
    seen, but they do not keep the caller's tensor objects alive) and weak references to the
    caller's tensors. It is found by the tensors' ids and accepted only if the weak references
    still point to those very objects (ids are reused after a tensor dies); when any of them dies,
    its callback drops the plan, releasing the storage.

    Storage swaps: `w.data = other` and `w.set_(...)` keep the tensor object but give it other
    memory (or another shape, strides or dtype), which the plan's views would not follow. So each
    call also checks, per tensor, `is_set_to` against a detached alias taken when the plan was made
    (same storage, offset, sizes and strides: one C++ call, no device sync) and the dtype; any
    difference re-checks and re-plans. In-place writes (`w[slot].copy_(...)`) keep the storage and
    need nothing.

    `prepared[T]`: the backend's `prepare_linear` result for T tokens (the kernels' argument lists
    with the weights' and the metadata views' pointers filled in; the views of the wrapper's
    metadata block for T never change).
    """

    __slots__ = ("_aliases", "_refs", "bias", "expand", "hidden", "linear", "lora_a", "lora_b", "num_slots",
                 "offsets", "prepare", "prepared", "rank", "shrink")

    def __init__(self, hidden, num_slots, rank, lora_a, lora_b, bias, offsets, linear, prepare, expand, shrink):
        self._refs, self._aliases = (), ()
        self.hidden, self.num_slots, self.rank = hidden, num_slots, rank
        self.lora_a, self.lora_b, self.bias, self.offsets, self.linear = lora_a, lora_b, bias, offsets, linear
        self.prepare, self.prepared, self.expand, self.shrink = prepare, {}, expand, shrink

    def watch(self, tensors, cache: dict, key) -> None:
        """Weak references to `tensors` (None entries, bias slices without bias, stay None: the
        cache key's ids fix where they are); a dying tensor drops this plan from `cache`."""
        def drop(_ref, cache=cache, key=key):
            cache.pop(key, None)
        self._refs = tuple(None if t is None else weakref.ref(t, drop) for t in tensors)
        self._aliases = tuple(None if t is None else t.detach() for t in tensors)

    def refers_to(self, tensors) -> bool:
        if len(tensors) != len(self._refs):
            return False
        for r, t, alias in zip(self._refs, tensors, self._aliases):  # (a plain loop: every call runs it)
            if t is None:
                continue
            if r() is not t or not t.is_set_to(alias) or t.dtype is not alias.dtype:
                return False
        return True


def _dora_scales(y: torch.Tensor, dora_scale_stacked, output_slices, num_slots: int, bias) -> tuple:
    """add_lora_linear's / add_expand's `dora_scale_stacked` checked (lora_core.checks.check_dora_scales:
    one entry per slice, None or (L, [1,] n_s) float, on y's device, no slice with a LoRA bias too)
    and returned as the backends' col_scale: per slice None or an (L, n_s) view (never a copy: the
    slots are written in place)."""
    seq = (list, tuple)
    scales = tuple(dora_scale_stacked) if isinstance(dora_scale_stacked, seq) else (dora_scale_stacked,)
    check_tensors(y=y, dora_scale_stacked=list(scales))
    checks.check_dora_scales([None if g is None else tuple(g.shape) for g in scales],
                             [None if g is None else g.dtype for g in scales], output_slices, num_slots,
                             bias_present=None if bias is None else [b is not None for b in bias])
    return tuple(None if g is None else (g.detach() if g.dim() == 2 else g.detach().squeeze(1)) for g in scales)


def _token_view(y: torch.Tensor) -> torch.Tensor:
    """(..., N) -> (T, N) view sharing y's memory (in-place updates must reach y)."""
    if y.dim() < 2:
        raise ValueError(f"y must have shape (..., features) with a token axis, got {tuple(y.shape)}")
    try:
        return y.view(-1, y.shape[-1])
    except RuntimeError:
        raise ValueError(f"y (shape {tuple(y.shape)}, strides {y.stride()}) cannot be viewed as "
                         "(tokens, features) without a copy, so it cannot be updated in place") from None


def _flat_tokens(t: torch.Tensor, name: str) -> torch.Tensor:
    """(..., F) -> (T, F); fewer than two axes unchanged (the shape checks name them)."""
    if t.dim() <= 2:
        return t
    if t.shape[-1] == 0:
        raise ValueError(f"{name} must have a feature axis (its last) of size >= 1, got shape {tuple(t.shape)}")
    return t.reshape(-1, t.shape[-1])


def _check_buffer(name: str, buf: torch.Tensor, shape: tuple, dtypes=checks.ACTIVATION_DTYPES) -> None:
    if tuple(buf.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)} (num_slices, num_tokens, rank), "
                         f"got {tuple(buf.shape)}")
    checks.check_dtype(name, buf.dtype, dtypes)
