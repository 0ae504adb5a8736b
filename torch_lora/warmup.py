"""`PunicaWrapper.warmup` for torch: every kernel variant an engine will launch, compiled before serving.

    w = torch_lora.PunicaWrapper(512, 64, "cuda", max_loras=8)
    w.warmup([LinearShape(4096, (4096, 1024, 1024), 16), LinearShape(4096, (4096,), 16),
              LinearShape(4096, (14336, 14336), 16), LinearShape(14336, (4096,), 16)],
             token_counts=vllm_capture_sizes(512), dtype=torch.bfloat16)

For each token count T and each layer shape, `add_lora_linear` runs once on a twin of the wrapper
(same capacity, slots, backend and device; the wrapper's own metadata is untouched) with zero
stand-in weights of the layer's shape: launch plans and Triton's specialisations depend on shapes,
dtypes, strides and slot counts only, so this compiles exactly what real steps of those sizes run.
Compiled kernels go to Triton's cache (`TRITON_CACHE_DIR`, default `~/.triton/cache`), which later
processes reuse.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from lora_core.host_mapping import LoRAMapping
from lora_core.warmup import LinearShape, Progress, check_warmup_arguments, vllm_capture_sizes

__all__ = ["warmup", "LinearShape", "vllm_capture_sizes"]


def warmup(wrapper, layers: Sequence, token_counts: Optional[Sequence[int]] = None, *,
           dtype: torch.dtype = torch.bfloat16, lora_ranks: bool = False, bias: bool = False,
           progress: bool = True) -> dict:
    """Runs `add_lora_linear` once per (token count, layer); returns {"calls", "seconds", "token_counts"}.

    layers: LinearShapes or (hidden, slices, rank) tuples; token_counts: default vLLM's capture sizes
    up to the wrapper's max_num_batched_tokens; lora_ranks / bias: whether the engine passes per-slot
    ranks / biases (they select other kernel variants)."""
    from .wrapper import PunicaWrapper

    shapes, counts = check_warmup_arguments(
        layers, token_counts if token_counts is not None else vllm_capture_sizes(wrapper.max_num_batched_tokens),
        wrapper.max_num_batched_tokens)
    twin = PunicaWrapper(wrapper.max_num_batched_tokens, wrapper.max_batches, wrapper.device,
                         max_loras=wrapper.max_loras, backend=wrapper.backend)
    slots, device = wrapper.max_loras, wrapper.device
    stand_ins = []
    for shape in shapes:
        lora_a = [torch.zeros(slots, 1, shape.rank, shape.hidden, dtype=dtype, device=device) for _ in shape.slices]
        lora_b = [torch.zeros(slots, 1, n, shape.rank, dtype=dtype, device=device) for n in shape.slices]
        lora_bias = [torch.zeros(slots, 1, n, dtype=dtype, device=device) for n in shape.slices] if bias else None
        ranks = torch.full((slots,), shape.rank, dtype=torch.int32, device=device) if lora_ranks else None
        stand_ins.append((shape, lora_a, lora_b, lora_bias, ranks))
    bar = Progress(len(counts) * len(shapes), "torch_lora warmup", progress)
    ids = [1] + [None] * (slots - 1)
    for num_tokens in counts:
        twin.update_metadata(LoRAMapping((1,) * num_tokens, (1,)), ids, slots + 1, 32000)
        for shape, lora_a, lora_b, lora_bias, ranks in stand_ins:
            x = torch.zeros(num_tokens, shape.hidden, dtype=dtype, device=device)
            y = torch.zeros(num_tokens, sum(shape.slices), dtype=dtype, device=device)
            twin.add_lora_linear(y, x, lora_a, lora_b, lora_bias, 1.0, shape.slices, lora_ranks=ranks)
            bar.step(f"T={num_tokens}")
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return {"calls": bar.done, "seconds": bar.seconds, "token_counts": counts}
