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

On a GPU with the Triton backend the cases are first compiled concurrently by worker processes
(`workers`, default one per core up to 16; `lora_core.warmup.warmup_groups` splits the cases by
the kernel variants each compiles, `lora_core.warmup.case_variants`, so that every worker compiles
about as many variants and rarely one another's), which fill Triton's cache; the pass in this
process then loads what they compiled. `python -m torch_lora.warmup_worker --warmup-worker JSON` is
the worker. A deterministic wrapper warms up its batch-invariant launches.

This module takes the wrapper as an argument and never imports `torch_lora.wrapper` (the wrapper's
`warmup` method calls it); the twin is built from the wrapper's own class.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence

import torch

from lora_core.host_mapping import LoRAMapping
from lora_core.warmup import (
    LinearShape,
    Progress,
    check_warmup,
    run_workers,
    variants_of,
    vllm_capture_sizes,
    warmup_groups,
)

__all__ = ["warmup", "LinearShape", "vllm_capture_sizes"]


def warmup(wrapper, layers: Sequence, token_counts: Sequence[int] | None = None, *,
           dtype: torch.dtype = torch.bfloat16, lora_ranks: bool = False, bias: bool = False,
           dora: bool = False, progress: bool = True, workers: int | None = None) -> dict:
    """Runs `add_lora_linear` once per (token count, layer); returns {"calls", "seconds",
    "token_counts", "workers"} (workers: per worker process {"ok", "seconds", "error"}).

    layers: LinearShapes or (hidden, slices, rank) tuples; token_counts: default vLLM's capture sizes
    up to the wrapper's max_num_batched_tokens; lora_ranks / bias / dora: whether the engine passes
    per-slot ranks / LoRA biases / DoRA column scales (they select other kernel variants; bias and
    dora exclude each other, as a slice takes one); workers: processes that compile first
    (None: one per core up to 16 on a GPU with the Triton backend, else none; 0 or 1: none)."""
    if dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"dtype must be torch.float16, torch.bfloat16 or torch.float32 (the layers' activation and "
                         f"weight dtype), got {dtype!r}")
    t_start = time.perf_counter()
    shapes, counts, workers = check_warmup(layers, token_counts, wrapper.max_num_batched_tokens, bias=bias, dora=dora,
                                           workers=workers,
                                           compiles=wrapper.backend == "triton" and wrapper.device.type == "cuda")
    worker_results = []
    deterministic = wrapper.deterministic
    if workers > 1:
        dtype_name = str(dtype).removeprefix("torch.")
        common = dict(max_num_batched_tokens=wrapper.max_num_batched_tokens, max_batches=wrapper.max_batches,
                      device=str(wrapper.device), max_loras=wrapper.max_loras, backend=wrapper.backend,
                      dtype=dtype_name, lora_ranks=lora_ranks, bias=bias, dora=dora, deterministic=deterministic)

        variants = variants_of(wrapper.max_loras, dtype_name, bias=bias, dora=dora, lora_ranks=lora_ranks,
                               deterministic=deterministic)
        payloads = [dict(common, cases=[(dataclasses.astuple(shape), ts) for shape, ts in group])
                    for group in warmup_groups(shapes, counts, workers, variants=variants)]
        worker_results = run_workers("torch_lora.warmup_worker", payloads)
    twin = type(wrapper)(wrapper.max_num_batched_tokens, wrapper.max_batches, wrapper.device,
                         max_loras=wrapper.max_loras, backend=wrapper.backend, deterministic=deterministic)
    slots, device = wrapper.max_loras, wrapper.device
    stand_ins = []
    for shape in shapes:
        lora_a = [torch.zeros(slots, 1, shape.rank, shape.hidden, dtype=dtype, device=device) for _ in shape.slices]
        lora_b = [torch.zeros(slots, 1, n, shape.rank, dtype=dtype, device=device) for n in shape.slices]
        lora_bias = [torch.zeros(slots, 1, n, dtype=dtype, device=device) for n in shape.slices] if bias else None
        ranks = torch.full((slots,), shape.rank, dtype=torch.int32, device=device) if lora_ranks else None
        scales = [torch.ones(slots, n, dtype=torch.float32, device=device) for n in shape.slices] if dora else None
        stand_ins.append((shape, lora_a, lora_b, lora_bias, ranks, scales))
    bar = Progress(len(counts) * len(shapes), "torch_lora warmup", progress)
    ids = [1] + [None] * (slots - 1)
    for num_tokens in counts:
        twin.update_metadata(LoRAMapping((1,) * num_tokens, (1,)), ids, slots + 1, 32000)
        for shape, lora_a, lora_b, lora_bias, ranks, scales in stand_ins:
            x = torch.zeros(num_tokens, shape.hidden, dtype=dtype, device=device)
            y = torch.zeros(num_tokens, sum(shape.slices), dtype=dtype, device=device)
            twin.add_lora_linear(y, x, lora_a, lora_b, lora_bias, 1.0, shape.slices, lora_ranks=ranks,
                                 dora_scale_stacked=scales)
            bar.step(f"T={num_tokens}")
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return {"calls": bar.done, "seconds": time.perf_counter() - t_start, "token_counts": counts,
            "workers": worker_results}
