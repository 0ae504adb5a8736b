"""Multi-LoRA layers over a torch.distributed process group (tensor parallelism; NCCL on GPUs, gloo
on CPUs), each wrapping this rank's shard of a base layer and running the adapters' part of that
shard through the rank's PunicaWrapper (docs/parallel_torch.md).

  linear.py   ColumnParallelLinearWithLoRA, MergedColumnParallelLinearWithLoRA,
              QKVParallelLinearWithLoRA, RowParallelLinearWithLoRA
  vocab.py    VocabParallelEmbeddingWithLoRA, ParallelLMHeadWithLoRA (the logits)
  layout.py   which part of an adapter each rank keeps; the bytes each layout moves; the choice
  loading.py  load_lora_slot / clear_lora_slot: a full adapter in, this rank's shard kept
  comm.py     the collectives (blocking, current stream, CUDA-graph capturable)
  layer.py    the state the layers share (slots, ranks, layout, the wrapper)
  wrapper.py  ParallelPunicaWrapper: update_metadata checks that every rank runs the same step
  agreement.py  the check that the ranks agree (one all-gather of a few int64 digests)
"""

from .layer import ParallelLoRALayer
from .layout import LAYOUTS, LayoutCost, SliceShard, choose_layout
from .linear import (
                     ColumnParallelLinearWithLoRA,
                     MergedColumnParallelLinearWithLoRA,
                     QKVParallelLinearWithLoRA,
                     RowParallelLinearWithLoRA,
)
from .loading import clear_lora_slot, load_lora_slot
from .vocab import ParallelLMHeadWithLoRA, VocabParallelEmbeddingWithLoRA
from .wrapper import ParallelPunicaWrapper

__all__ = ["LAYOUTS", "ColumnParallelLinearWithLoRA", "LayoutCost", "MergedColumnParallelLinearWithLoRA",
           "ParallelLMHeadWithLoRA", "ParallelLoRALayer", "ParallelPunicaWrapper", "QKVParallelLinearWithLoRA",
           "RowParallelLinearWithLoRA", "SliceShard", "VocabParallelEmbeddingWithLoRA", "choose_layout",
           "clear_lora_slot", "load_lora_slot"]
