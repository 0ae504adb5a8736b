"""Tensor-parallel linear layers with multi-LoRA: each wraps this rank's shard of a base layer and
adds the adapters' part of that shard through the rank's PunicaWrapper.

Math, per token t with adapter slot i (nothing is added for i = -1), P ranks, this rank p:

  column-parallel (y_p = x @ W[part_p].T, x whole):
      y_p[t, slice s] += (x[t] @ A_s[i].T) @ B_s[i][part_p(s)].T
  row-parallel (y = sum_p x_p @ W[:, in_p].T, all-reduced by the base layer):
      y[t] += (sum_p x_p[t] @ A[i][:, in_p].T) @ B[i].T

The column layers differ only in how the base layer splits its output into slices:
  ColumnParallelLinearWithLoRA        one slice, split evenly
  MergedColumnParallelLinearWithLoRA  several slices (gate, up), each split evenly; the base layer's
                                      output is [slice 0's part, slice 1's part, ...]
  QKVParallelLinearWithLoRA           q, k, v: q heads split evenly, kv heads split evenly or, with
                                      fewer kv heads than ranks, each replicated on P / num_kv_heads
                                      ranks (layout.qkv_ranges)

Layouts (layout.py has the byte formulas; `fully_sharded=None` picks by bytes for `tokens_per_step`):
  column replicated     A whole, B's rows part_p: `add_lora_linear` on the shard, no communication
  column fully_sharded  A's rank rows chunk_p: shrink to (S, T, r/P), all-gather to (S, T, r), expand
  row replicated        A's columns in_p, B whole: shrink to a partial (1, T, r), all-reduce it, expand
                        into the (already reduced) y on every rank
  row fully_sharded     B's rows part_p too: shrink, all-reduce, expand into a zeroed (T, N/P), all-gather
                        its columns and add them to y

Every shape depends only on the token count, nothing is read back to the host, and the collectives
are blocking (on the current stream with NCCL), so a forward pass can be captured in a CUDA graph.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from . import comm
from .layer import ParallelLoRALayer, positive_int
from .layout import LayoutCost, SliceShard, column_costs, even_range, qkv_ranges, row_costs

__all__ = ["ColumnParallelLinearWithLoRA", "MergedColumnParallelLinearWithLoRA", "QKVParallelLinearWithLoRA",
           "RowParallelLinearWithLoRA"]


class _ColumnParallelLoRA(ParallelLoRALayer):
    """Shared by the column-parallel layers: `self.input_size` and, per slice, its full width
    (`self.output_sizes`) and this rank's rows of it (`self.output_ranges`)."""

    def _init_column(self, input_size: int, output_sizes: Sequence[int],
                     output_ranges: Sequence[tuple[int, int]], layout_kwargs: dict) -> None:
        self.input_size = positive_int("input_size", input_size)
        self.output_sizes = tuple(output_sizes)
        self.output_ranges = tuple(output_ranges)
        self._build(**layout_kwargs)

    @property
    def output_slices(self) -> tuple[int, ...]:
        """This rank's width of each slice (the base layer shard's output is their concatenation)."""
        return tuple(stop - start for start, stop in self.output_ranges)

    def _sharding_problem(self) -> str | None:
        if self.max_rank % self.tp_size:
            return (f"max_rank={self.max_rank} must be divisible by the process group size {self.tp_size} to "
                    "split A along the rank")
        return None

    def _slice_shards(self):
        chunk = self._rank_chunk()
        return [SliceShard(a_rank=chunk, a_in=(0, self.input_size), b_out=rng, full_in=self.input_size,
                           full_out=full) for full, rng in zip(self.output_sizes, self.output_ranges)]

    def layout_costs(self, num_tokens: int, num_adapters: int | None = None) -> dict[str, LayoutCost]:
        """Bytes moved per forward call of `num_tokens` tokens with `num_adapters` active (default:
        max_loras), in each layout (layout.column_costs)."""
        return column_costs(input_size=self.input_size, local_widths=self.output_slices, max_rank=self.max_rank,
                            max_loras=self.max_loras, world=self.tp_size, num_tokens=num_tokens,
                            num_adapters=self._adapters(num_adapters), weight_bytes=self.dtype.itemsize)

    def forward(self, x: torch.Tensor):
        """x (..., input_size), whole on every rank -> the base layer's output (..., sum(output_slices))
        with this rank's columns of every adapter's output added (in place).

        1. y = base_layer(x), viewed as (T, sum(n_p)): the slices' parts side by side.
        2. Replicated: add_lora_linear(y, x, A, B_p, bias_p, 1, n_p) on this rank alone.
        3. Fully sharded: part = x @ A[chunk_p].T, (S, T, r/P) float32, computed with each slot's
           rank inside the chunk (lora_ranks_local); all-gathered to (S, T, r) with rank p's part at
           columns [p r/P, (p+1) r/P), the order of A's rows, so it equals x @ A.T; then
           y += buf @ B_p.T (+ bias_p) with each slot's full rank (add_expand).
        Rows of tokens without an adapter are never written.
        """
        x2 = self._tokens(x, self.input_size, "x")
        self._check_step_rows("x", x2.shape[0])
        out, y = self._run_base(x, sum(self.output_slices), "the layer's output shard")
        w = self.punica_wrapper
        if w is None:
            return out
        if not self.fully_sharded:
            w.add_lora_linear(y, x2, self.lora_a_stacked, self.lora_b_stacked, self.lora_bias_stacked, 1.0,
                              self.output_slices, lora_ranks=self.lora_ranks)
            return out
        chunk = self.max_rank // self.tp_size
        part = torch.empty((self.num_slices, x2.shape[0], chunk), dtype=torch.float32, device=x2.device)
        w.add_shrink(part, x2, self.lora_a_stacked, 1.0, lora_ranks=self.lora_ranks_local)
        buf = comm.gather_rank_buffer(part, self.group, self.tp_size)
        w.add_expand(y, buf, self.lora_b_stacked, self.lora_bias_stacked, self.output_slices, 0, True,
                     lora_ranks=self.lora_ranks)
        return out


_LAYOUT_DOC = """
      group: the torch.distributed process group the base layer is sharded over (None: the default).
      fully_sharded: True / False forces the layout; None chooses the one moving fewer bytes for
        `tokens_per_step` tokens and `adapters_per_step` active adapters (default max_loras)
        (layout.choose_layout with `link_weight`).
      lora_bias: keep a per-slot bias per slice (added where an adapter applies).
      dtype, device: of the adapter slots (default: the base layer's first parameter's).
      check_agreement: check that every rank builds the same layer (one small all-gather, here) and
        keep a digest of each slot's adapter for ParallelPunicaWrapper's per-step check; False for
        an engine that guarantees agreement itself (the same value on every rank)."""


class ColumnParallelLinearWithLoRA(_ColumnParallelLoRA):
    __doc__ = """A column-parallel linear layer (output split evenly over the ranks) with multi-LoRA.

    Args:
      base_layer: this rank's shard, x (..., input_size) -> (..., output_size / P) (or a tuple whose
        first element is that, as vLLM's `(output, output_bias)`; returned as the base returns it).
      input_size, output_size: the full (unsharded) sizes.
      max_loras, max_rank: slots L and the stacked rank r (smaller adapters are zero-padded).""" + _LAYOUT_DOC

    def __init__(self, base_layer: torch.nn.Module, *, input_size: int, output_size: int, max_loras: int,
                 max_rank: int, group=None, fully_sharded: bool | None = None,
                 tokens_per_step: int | None = None, adapters_per_step: int | None = None,
                 link_weight: float = 1.0, lora_bias: bool = False, dtype=None, device=None,
                 check_agreement: bool = True):
        super().__init__(base_layer, max_loras=max_loras, max_rank=max_rank, group=group,
                         check_agreement=check_agreement)
        positive_int("output_size", output_size)
        rng = even_range("output_size", output_size, self.tp_rank, self.tp_size)
        self._init_column(input_size, (output_size,), (rng,), dict(
            fully_sharded=fully_sharded, tokens_per_step=tokens_per_step, adapters_per_step=adapters_per_step,
            link_weight=link_weight, dtype=dtype, device=device, lora_bias=lora_bias))


class MergedColumnParallelLinearWithLoRA(_ColumnParallelLoRA):
    __doc__ = """Several column-parallel projections fused in one base layer (gate_up), each slice split
    evenly over the ranks; each slice has its own adapter factors.

    Args:
      base_layer: this rank's shard, x (..., input_size) -> (..., sum(output_sizes) / P), laid out
        [slice 0's part, slice 1's part, ...] (vLLM's MergedColumnParallelLinear).
      input_size: the full input size; output_sizes: the full width of each slice.
      max_loras, max_rank: slots L and the stacked rank r.""" + _LAYOUT_DOC

    def __init__(self, base_layer: torch.nn.Module, *, input_size: int, output_sizes: Sequence[int], max_loras: int,
                 max_rank: int, group=None, fully_sharded: bool | None = None,
                 tokens_per_step: int | None = None, adapters_per_step: int | None = None,
                 link_weight: float = 1.0, lora_bias: bool = False, dtype=None, device=None,
                 check_agreement: bool = True):
        super().__init__(base_layer, max_loras=max_loras, max_rank=max_rank, group=group,
                         check_agreement=check_agreement)
        if not isinstance(output_sizes, (list, tuple)) or not output_sizes:
            raise ValueError(f"output_sizes must be a non-empty sequence of slice widths, got {output_sizes!r}")
        sizes = [positive_int(f"output_sizes[{s}]", n) for s, n in enumerate(output_sizes)]
        ranges = [even_range(f"output_sizes[{s}]", n, self.tp_rank, self.tp_size) for s, n in enumerate(sizes)]
        self._init_column(input_size, sizes, ranges, dict(
            fully_sharded=fully_sharded, tokens_per_step=tokens_per_step, adapters_per_step=adapters_per_step,
            link_weight=link_weight, dtype=dtype, device=device, lora_bias=lora_bias))


class QKVParallelLinearWithLoRA(_ColumnParallelLoRA):
    __doc__ = """The fused q, k, v projection of attention (GQA: fewer kv heads than q heads), three
    slices with their own adapter factors (vLLM's MergedQKVParallelLinearWithLoRA).

    Args:
      base_layer: this rank's shard, x (..., input_size) -> (..., q_p + k_p + v_p) with q_p =
        num_heads / P * head_size and k_p = v_p = max(num_kv_heads / P, 1) * head_size (vLLM's
        QKVParallelLinear).
      input_size: the full input size; num_heads, num_kv_heads, head_size: the model's totals.
      max_loras, max_rank: slots L and the stacked rank r.""" + _LAYOUT_DOC

    def __init__(self, base_layer: torch.nn.Module, *, input_size: int, num_heads: int, num_kv_heads: int,
                 head_size: int, max_loras: int, max_rank: int, group=None, fully_sharded: bool | None = None,
                 tokens_per_step: int | None = None, adapters_per_step: int | None = None,
                 link_weight: float = 1.0, lora_bias: bool = False, dtype=None, device=None,
                 check_agreement: bool = True):
        super().__init__(base_layer, max_loras=max_loras, max_rank=max_rank, group=group,
                         check_agreement=check_agreement)
        ranges = qkv_ranges(num_heads, num_kv_heads, head_size, self.tp_rank, self.tp_size)
        self.num_heads, self.num_kv_heads, self.head_size = num_heads, num_kv_heads, head_size
        sizes = (num_heads * head_size, num_kv_heads * head_size, num_kv_heads * head_size)
        self._init_column(input_size, sizes, ranges, dict(
            fully_sharded=fully_sharded, tokens_per_step=tokens_per_step, adapters_per_step=adapters_per_step,
            link_weight=link_weight, dtype=dtype, device=device, lora_bias=lora_bias))


class RowParallelLinearWithLoRA(ParallelLoRALayer):
    __doc__ = """A row-parallel linear layer (input split evenly over the ranks) with multi-LoRA.

    Args:
      base_layer: this rank's shard, x_p (..., input_size / P) -> y (..., output_size), the full
        output, all-reduced by the base layer itself (vLLM's RowParallelLinear with
        input_is_parallel=True and reduce_results=True); or a tuple starting with it.
      input_size, output_size: the full (unsharded) sizes.
      max_loras, max_rank: slots L and the stacked rank r.""" + _LAYOUT_DOC

    def __init__(self, base_layer: torch.nn.Module, *, input_size: int, output_size: int, max_loras: int,
                 max_rank: int, group=None, fully_sharded: bool | None = None,
                 tokens_per_step: int | None = None, adapters_per_step: int | None = None,
                 link_weight: float = 1.0, lora_bias: bool = False, dtype=None, device=None,
                 check_agreement: bool = True):
        super().__init__(base_layer, max_loras=max_loras, max_rank=max_rank, group=group,
                         check_agreement=check_agreement)
        self.input_size = positive_int("input_size", input_size)
        self.output_size = positive_int("output_size", output_size)
        self.input_range = even_range("input_size", input_size, self.tp_rank, self.tp_size)
        self._build(fully_sharded=fully_sharded, tokens_per_step=tokens_per_step,
                    adapters_per_step=adapters_per_step, link_weight=link_weight, dtype=dtype, device=device,
                    lora_bias=lora_bias)

    @property
    def input_size_per_partition(self) -> int:
        return self.input_range[1] - self.input_range[0]

    def _sharding_problem(self) -> str | None:
        if self.output_size % self.tp_size:
            return (f"output_size={self.output_size} must be divisible by the process group size {self.tp_size} "
                    "to split B along the output")
        return None

    def _slice_shards(self):
        out = (even_range("output_size", self.output_size, self.tp_rank, self.tp_size) if self.fully_sharded
               else (0, self.output_size))
        return [SliceShard(a_rank=(0, self.max_rank), a_in=self.input_range, b_out=out, full_in=self.input_size,
                           full_out=self.output_size)]

    def layout_costs(self, num_tokens: int, num_adapters: int | None = None) -> dict[str, LayoutCost]:
        """Bytes moved per forward call in each layout (layout.row_costs; y's element size taken as
        the adapter dtype's)."""
        return row_costs(input_size=self.input_size, output_size=self.output_size, max_rank=self.max_rank,
                         max_loras=self.max_loras, world=self.tp_size, num_tokens=num_tokens,
                         num_adapters=self._adapters(num_adapters), weight_bytes=self.dtype.itemsize,
                         output_bytes=self.dtype.itemsize)

    def forward(self, x: torch.Tensor):
        """x_p (..., input_size / P), this rank's part of the input -> the base layer's output
        (..., output_size), the same on every rank, with every adapter's output added (in place).

        1. y = base_layer(x_p), (T, N), already summed over the ranks by the base layer.
        2. buf = x_p @ A[:, in_p].T, (1, T, r) float32, this rank's partial sum (0 for tokens without
           an adapter); all-reduced, buf = x @ A.T on every rank.
        3. Replicated: y += buf @ B.T (+ bias) (add_expand; every rank adds the same values).
           Fully sharded: part = buf @ B[part_p].T (+ bias_p) into a zeroed (T, N/P) (rows without an
           adapter stay 0); its columns all-gathered to (T, N), rank p's at [p N/P, (p+1) N/P); y += it.
        """
        x2 = self._tokens(x, self.input_size_per_partition, "x")
        self._check_step_rows("x", x2.shape[0])
        out, y = self._run_base(x, self.output_size, "the layer's output")
        w = self.punica_wrapper
        if w is None:
            return out
        buf = torch.empty((1, x2.shape[0], self.max_rank), dtype=torch.float32, device=x2.device)
        w.add_shrink(buf, x2, self.lora_a_stacked, 1.0, lora_ranks=self.lora_ranks)
        comm.all_reduce_sum(buf, self.group)
        if not self.fully_sharded:
            w.add_expand(y, buf, self.lora_b_stacked, self.lora_bias_stacked, (self.output_size,), 0, True,
                         lora_ranks=self.lora_ranks)
            return out
        width = self.output_size // self.tp_size
        part = torch.zeros((x2.shape[0], width), dtype=y.dtype, device=y.device)
        w.add_expand(part, buf, self.lora_b_stacked, self.lora_bias_stacked, (width,), 0, True,
                     lora_ranks=self.lora_ranks)
        y.add_(comm.gather_columns(part, self.group, self.tp_size))
        return out
