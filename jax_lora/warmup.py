"""`PunicaWrapper.warmup` for JAX: every Triton kernel variant an engine will launch, compiled before serving.

For each token count T (the engine's jit buckets) and each layer shape, `add_lora_linear` is traced
and lowered under `jax.jit` on a twin of the wrapper (its own metadata untouched) with abstract
stand-in arguments (`jax.ShapeDtypeStruct`: nothing is allocated or run). Tracing plans the kernels
and the XLA FFI launcher compiles and loads each Triton variant at that moment; XLA's own
compilation of the engine's step is the engine's jit, not this. On backends without separately
compiled kernels (xla, pallas_tpu inside XLA) it lowers and compiles nothing of value.
"""

from __future__ import annotations

from typing import Optional, Sequence

import jax
import jax.numpy as jnp

from lora_core.host_mapping import LoRAMapping
from lora_core.warmup import LinearShape, Progress, check_warmup_arguments, vllm_capture_sizes

__all__ = ["warmup", "LinearShape", "vllm_capture_sizes"]


def warmup(wrapper, layers: Sequence, token_counts: Optional[Sequence[int]] = None, *, dtype=jnp.bfloat16,
           lora_ranks: bool = False, bias: bool = False, progress: bool = True) -> dict:
    """Lowers `add_lora_linear` once per (token count, layer); returns {"calls", "seconds", "token_counts"}.

    layers: LinearShapes or (hidden, slices, rank) tuples; token_counts: default vLLM's capture sizes
    up to the wrapper's max_num_batched_tokens; lora_ranks / bias: whether the engine passes per-slot
    ranks / biases (they select other kernel variants)."""
    from .wrapper import PunicaWrapper

    shapes, counts = check_warmup_arguments(
        layers, token_counts if token_counts is not None else vllm_capture_sizes(wrapper.max_num_batched_tokens),
        wrapper.max_num_batched_tokens)
    slots = wrapper.max_loras
    twin = PunicaWrapper(wrapper.max_num_batched_tokens, wrapper.max_batches, wrapper.device, max_loras=slots,
                         backend=wrapper.backend)
    ids = [1] + [None] * (slots - 1)
    bar = Progress(len(counts) * len(shapes), "jax_lora warmup", progress)

    def step(w, y, x, lora_a, lora_b, lora_bias, ranks, slices):
        return w.add_lora_linear(y, x, lora_a, lora_b, lora_bias, 1.0, slices, lora_ranks=ranks)

    for num_tokens in counts:
        twin.update_metadata(LoRAMapping((1,) * num_tokens, (1,)), ids, slots + 1, 32000)
        for shape in shapes:
            spec = jax.ShapeDtypeStruct
            lora_a = [spec((slots, 1, shape.rank, shape.hidden), dtype) for _ in shape.slices]
            lora_b = [spec((slots, 1, n, shape.rank), dtype) for n in shape.slices]
            lora_bias = [spec((slots, 1, n), dtype) for n in shape.slices] if bias else None
            ranks = spec((slots,), jnp.int32) if lora_ranks else None
            jax.jit(step, static_argnums=(7,)).lower(
                twin, spec((num_tokens, sum(shape.slices)), dtype), spec((num_tokens, shape.hidden), dtype),
                lora_a, lora_b, lora_bias, ranks, tuple(shape.slices))
            bar.step(f"T={num_tokens}")
    return {"calls": bar.done, "seconds": bar.seconds, "token_counts": counts}
