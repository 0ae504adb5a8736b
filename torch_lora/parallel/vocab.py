"""Vocabulary-parallel layers with multi-LoRA: the input embedding and the LM head (logits).

Math, per token t with token id v_t and adapter slot i (nothing is added for i = -1), P ranks,
this rank p, and PEFT's factors A (r, V) (lora_embedding_A) and B (E, r) for the embedding,
A (r, H) and B (V, r) for the LM head:

  embedding:  y[t] += A[i][:, v_t] @ B[i].T
              the table A.T is looked up, then expanded by B (the wrapper's add_lora_embedding)
  LM head:    logits_p[j] += (h[j] @ A[i_j].T) @ B[i_j][vocab_p].T
              row j of the sampled hidden states h uses the sampler index i_j (add_lora_logits)

Layouts (layout.py has the byte formulas; `fully_sharded=None` picks by bytes for `tokens_per_step`):
  embedding replicated     the whole table on every rank; no communication
  embedding fully_sharded  table rows vocab_p = [p ceil(V/P), (p+1) ceil(V/P)): each rank looks up
                           the ids in its rows (zero elsewhere), the (T, r) rows are all-reduced
                           (float32), then every rank expands them by the whole B
  LM head replicated       A whole, B's rows vocab_p (the base layer's logits columns): no communication
  LM head fully_sharded    A's rank rows chunk_p: shrink to (1, R, r/P), all-gather to (1, R, r), expand

The base embedding returns the full embeddings (it all-reduces its own output, vLLM's
VocabParallelEmbedding); the base LM head returns this rank's logits columns (vLLM's ParallelLMHead
before the logits gather), so the adapters' part is added before the engine gathers the logits.
Every shape depends only on the token count and nothing is read back to the host (CUDA-graph
capturable).
"""

from __future__ import annotations

import torch

from .. import ops
from . import comm
from .layer import ParallelLoRALayer, positive_int
from .layout import LayoutCost, SliceShard, column_costs, embedding_costs, padded_range

__all__ = ["ParallelLMHeadWithLoRA", "VocabParallelEmbeddingWithLoRA"]


class VocabParallelEmbeddingWithLoRA(ParallelLoRALayer):
    """A vocabulary-parallel input embedding with multi-LoRA.

    Args:
      base_layer: this rank's shard, ids (...) int -> (..., embedding_dim), the full embeddings on
        every rank (or a tuple starting with them).
      num_embeddings: V, the vocabulary the adapters' A covers; embedding_dim: E.
      max_loras, max_rank: slots L and the stacked rank r.
      group, fully_sharded, tokens_per_step, adapters_per_step, link_weight, dtype, device,
        check_agreement: as for the linear layers (linear.py); sharding the table never moves fewer
        bytes, it holds 1/P of it.

    Slots: lora_a_0 (L, V or ceil(V/P), r), the table; lora_b_0 (L, E, r).
    """

    def __init__(self, base_layer: torch.nn.Module, *, num_embeddings: int, embedding_dim: int, max_loras: int,
                 max_rank: int, group=None, fully_sharded: bool | None = None,
                 tokens_per_step: int | None = None, adapters_per_step: int | None = None,
                 link_weight: float = 1.0, dtype=None, device=None,
                 check_agreement: bool = True):
        super().__init__(base_layer, max_loras=max_loras, max_rank=max_rank, group=group,
                         check_agreement=check_agreement)
        self.num_embeddings = positive_int("num_embeddings", num_embeddings)
        self.embedding_dim = positive_int("embedding_dim", embedding_dim)
        self._build(fully_sharded=fully_sharded, tokens_per_step=tokens_per_step,
                    adapters_per_step=adapters_per_step, link_weight=link_weight, dtype=dtype, device=device,
                    lora_bias=False)

    @property
    def vocab_range(self) -> tuple[int, int]:
        """The token ids whose table rows this rank holds (past num_embeddings: zero rows)."""
        return self.slice_shards[0].a_in

    def _slice_shards(self):
        rows = (padded_range(self.num_embeddings, self.tp_rank, self.tp_size) if self.fully_sharded
                else (0, self.num_embeddings))
        return [SliceShard(a_rank=(0, self.max_rank), a_in=rows, b_out=(0, self.embedding_dim),
                           full_in=self.num_embeddings, full_out=self.embedding_dim, a_table=True)]

    def layout_costs(self, num_tokens: int, num_adapters: int | None = None) -> dict[str, LayoutCost]:
        """Bytes moved per forward call in each layout (layout.embedding_costs)."""
        return embedding_costs(num_embeddings=self.num_embeddings, embedding_dim=self.embedding_dim,
                               max_rank=self.max_rank, max_loras=self.max_loras, world=self.tp_size,
                               num_tokens=num_tokens, num_adapters=self._adapters(num_adapters),
                               weight_bytes=self.dtype.itemsize)

    def forward(self, ids: torch.Tensor):
        """ids (...) token ids -> the base layer's output (..., E) with every adapter's rows added.

        1. The base layer's embeddings y (T, E), T = ids.numel(); the wrapper's token indices give
           each token's slot (-1: none; those rows of y are never written).
        2. rows[t] = table[slot_t, v_t - vocab_start] where v_t lies in this rank's vocabulary rows,
           else 0 (ids outside 0..V-1 get 0 on every rank); float32, (T, r).
        3. Fully sharded: rows summed over the ranks (each id's row is held by exactly one rank).
        4. y[t] += rows[t] @ B[slot_t].T (add_lora_embedding, in place).
        """
        if not isinstance(ids, torch.Tensor) or ids.dtype.is_floating_point or ids.dtype == torch.bool:
            raise TypeError(f"ids must be an integer torch.Tensor, got "
                            f"{ids.dtype if isinstance(ids, torch.Tensor) else type(ids).__name__}")
        self._check_step_rows("ids", ids.numel())
        out, y = self._run_base(ids, self.embedding_dim, "embedding_dim")
        w = self.punica_wrapper
        if w is None:
            return out
        flat = ids.reshape(-1)
        slots = w.token_lora_indices
        if slots.shape[0] < flat.shape[0]:
            raise ValueError(f"ids has {flat.shape[0]} tokens, but the wrapper's mapping has {slots.shape[0]}")
        start, stop = self.vocab_range
        rows_held = stop - start
        local = flat.to(torch.int64) - start
        inside = (local >= 0) & (local < min(rows_held, self.num_embeddings - start))
        slot = slots[: flat.shape[0]].to(torch.int64).clamp(min=0)
        table = self.lora_a_0.view(self.max_loras * rows_held, self.max_rank)
        rows = table.index_select(0, slot * rows_held + local.clamp(0, rows_held - 1)).to(torch.float32)
        rows = rows * inside[:, None]
        if self.fully_sharded:
            comm.all_reduce_sum(rows, self.group)
        w.add_lora_embedding(y, rows, self.lora_b_0, True, lora_ranks=self.lora_ranks)
        return out


class ParallelLMHeadWithLoRA(ParallelLoRALayer):
    """A vocabulary-parallel LM head with multi-LoRA: this rank's logits columns plus the adapters'
    (vLLM's LogitsProcessorWithLoRA, with B sharded over the vocabulary like the base layer).

    Args:
      base_layer: this rank's shard, h (R, input_size) -> logits (R, vocab_range width), the sampled
        rows of the step in the order of the mapping's prompt_mapping (or a tuple starting with them).
      input_size: H; vocab_size: V, the full vocabulary.
      vocab_range: (start, stop), this rank's logits columns; default: [p ceil(V/P), (p+1) ceil(V/P)).
        Columns past V (padding) get nothing added.
      max_loras, max_rank: slots L and the stacked rank r.
      group, fully_sharded, tokens_per_step (sampled rows per call), adapters_per_step, link_weight,
        dtype, device, check_agreement: as for the linear layers (linear.py).

    Slots: lora_a_0 (L, r or r/P, H); lora_b_0 (L, vocab_range width, r).
    """

    def __init__(self, base_layer: torch.nn.Module, *, input_size: int, vocab_size: int, max_loras: int,
                 max_rank: int, vocab_range: tuple[int, int] | None = None, group=None,
                 fully_sharded: bool | None = None, tokens_per_step: int | None = None,
                 adapters_per_step: int | None = None, link_weight: float = 1.0, dtype=None, device=None,
                 check_agreement: bool = True):
        super().__init__(base_layer, max_loras=max_loras, max_rank=max_rank, group=group,
                         check_agreement=check_agreement)
        self.input_size = positive_int("input_size", input_size)
        self.vocab_size = positive_int("vocab_size", vocab_size)
        if vocab_range is None:
            vocab_range = padded_range(vocab_size, self.tp_rank, self.tp_size)
        if (not isinstance(vocab_range, (tuple, list)) or len(vocab_range) != 2
                or not all(isinstance(v, int) and not isinstance(v, bool) for v in vocab_range)
                or not 0 <= vocab_range[0] < vocab_range[1]):
            raise ValueError(f"vocab_range must be (start, stop) ints with 0 <= start < stop, got {vocab_range!r}")
        self.vocab_range = (int(vocab_range[0]), int(vocab_range[1]))
        self._build(fully_sharded=fully_sharded, tokens_per_step=tokens_per_step,
                    adapters_per_step=adapters_per_step, link_weight=link_weight, dtype=dtype, device=device,
                    lora_bias=False)

    @property
    def vocab_width(self) -> int:
        return self.vocab_range[1] - self.vocab_range[0]

    def _sharding_problem(self) -> str | None:
        if self.max_rank % self.tp_size:
            return (f"max_rank={self.max_rank} must be divisible by the process group size {self.tp_size} to "
                    "split A along the rank")
        return None

    def _slice_shards(self):
        return [SliceShard(a_rank=self._rank_chunk(), a_in=(0, self.input_size), b_out=self.vocab_range,
                           full_in=self.input_size, full_out=self.vocab_size)]

    def layout_costs(self, num_tokens: int, num_adapters: int | None = None) -> dict[str, LayoutCost]:
        """Bytes moved per forward call of `num_tokens` sampled rows in each layout (layout.column_costs
        with one slice of the vocabulary width)."""
        return column_costs(input_size=self.input_size, local_widths=(self.vocab_width,), max_rank=self.max_rank,
                            max_loras=self.max_loras, world=self.tp_size, num_tokens=num_tokens,
                            num_adapters=self._adapters(num_adapters), weight_bytes=self.dtype.itemsize)

    def forward(self, h: torch.Tensor):
        """h (R, H), the sampled rows -> the base layer's logits (R, vocab width) with this rank's
        columns of every adapter's logits added (in place). Rows are routed by the sampler indices.

        1. y = base_layer(h), (R, vocab width).
        2. Replicated: add_lora_logits(y, h, A, B_p, 1) on this rank alone.
        3. Fully sharded: part = h @ A[chunk_p].T, (1, R, r/P) float32 (lora_shrink over the prompt
           mapping's metadata, with lora_ranks_local); all-gathered to (1, R, r) in A's row order;
           y += buf @ B_p.T (lora_expand, per-slot ranks).
        """
        h2 = self._tokens(h, self.input_size, "h")
        self._check_step_rows("h", h2.shape[0], sampled=True)
        out, y = self._run_base(h, self.vocab_width, "vocab_range")
        w = self.punica_wrapper
        if w is None:
            return out
        if not self.fully_sharded:
            w.add_lora_logits(y, h2, self.lora_a_0, self.lora_b_0, 1.0, lora_ranks=self.lora_ranks)
            return out
        rows = h2.shape[0]
        if rows > (w.indices_len[1] or 0):
            raise ValueError(f"h has {rows} rows, but update_metadata mapped only {w.indices_len[1] or 0} "
                             "sampled rows")
        meta = w.prompt_mapping_meta.meta_args(rows)
        part = torch.empty((1, rows, self.max_rank // self.tp_size), dtype=torch.float32, device=h2.device)
        ops.lora_shrink(h2, (self.lora_a_0,), part, *meta, 1.0, backend=w.backend, lora_ranks=self.lora_ranks_local)
        buf = comm.gather_rank_buffer(part, self.group, self.tp_size)
        ops.lora_expand(buf, (self.lora_b_0,), y, *meta, offset_start=0, add_inputs=True, backend=w.backend,
                        lora_ranks=self.lora_ranks)
        return out
