"""`PunicaWrapper.warmup` for JAX: every Triton kernel variant an engine will launch, compiled before serving.

For each token count T (the engine's jit buckets) and each layer shape, `add_lora_linear` is traced
and lowered under `jax.jit` on a twin of the wrapper (its own metadata untouched) with abstract
stand-in arguments (`jax.ShapeDtypeStruct`: nothing is allocated or run). Tracing plans the kernels
and the XLA FFI launcher compiles and loads each Triton variant at that moment; XLA's own
compilation of the engine's step is the engine's jit, not this. On backends without separately
compiled kernels (xla, pallas_tpu inside XLA) it lowers and compiles nothing of value.

The cases are lowered by `workers` threads (lora_core.warmup.warmup_groups, balanced by the kernel
variants each group compiles, so threads rarely need the same variant); Triton's compiler and
ptxas release the GIL, and the FFI launcher compiles each variant once (a lock per variant), so
compiles overlap. A deterministic wrapper warms up its batch-invariant launches.

This module takes the wrapper as an argument and never imports `jax_lora.wrapper` (the wrapper's
`warmup` method calls it); the twin is built from the wrapper's own class.
"""

from __future__ import annotations

import concurrent.futures
import threading
import time
from collections.abc import Sequence

import jax
import jax.numpy as jnp

from lora_core.host_mapping import LoRAMapping
from lora_core.warmup import LinearShape, Progress, check_warmup, variants_of, vllm_capture_sizes, warmup_groups

__all__ = ["warmup", "LinearShape", "vllm_capture_sizes"]


def warmup(wrapper, layers: Sequence, token_counts: Sequence[int] | None = None, *, dtype=jnp.bfloat16,
           lora_ranks: bool = False, bias: bool = False, dora: bool = False, progress: bool = True,
           workers: int | None = None) -> dict:
    """Lowers `add_lora_linear` once per (token count, layer); returns {"calls", "seconds",
    "token_counts", "workers"}.

    layers: LinearShapes or (hidden, slices, rank) tuples; token_counts: default vLLM's capture sizes
    up to the wrapper's max_num_batched_tokens; lora_ranks / bias / dora: whether the engine passes
    per-slot ranks / LoRA biases / DoRA column scales (they select other kernel variants; bias and
    dora exclude each other, as a slice takes one); workers: threads lowering concurrently (the
    Triton compiles they trigger run in parallel; None: one per core up to 16 on a GPU with the
    Triton backend, else 1)."""
    try:
        dtype = jnp.dtype(dtype)
    except TypeError as e:
        raise ValueError(f"dtype must be float16, bfloat16 or float32 (the layers' activation and weight dtype), "
                         f"got {dtype!r}") from e
    if dtype not in (jnp.float16, jnp.bfloat16, jnp.float32):
        raise ValueError(f"dtype must be float16, bfloat16 or float32 (the layers' activation and weight dtype), "
                         f"got {dtype.name}")
    t_start = time.perf_counter()
    shapes, counts, workers = check_warmup(layers, token_counts, wrapper.max_num_batched_tokens, bias=bias, dora=dora,
                                           workers=workers,
                                           compiles=wrapper.backend == "triton" and jax.default_backend() == "gpu")
    deterministic = wrapper.deterministic
    variants = None
    if wrapper.backend == "triton" and workers > 1:
        variants = variants_of(wrapper.max_loras, jnp.dtype(dtype).name, bias=bias, dora=dora, lora_ranks=lora_ranks,
                               deterministic=deterministic)
    groups = warmup_groups(shapes, counts, max(1, workers), variants=variants)
    bar = Progress(len(counts) * len(shapes), "jax_lora warmup", progress)
    lock = threading.Lock()

    def lower_group(group) -> None:
        slots = wrapper.max_loras
        twin = type(wrapper)(wrapper.max_num_batched_tokens, wrapper.max_batches, wrapper.device, max_loras=slots,
                             backend=wrapper.backend, deterministic=deterministic)
        ids = [1] + [None] * (slots - 1)
        by_count: dict = {}
        for shape, ts in group:
            for t in ts:
                by_count.setdefault(t, []).append(shape)
        for num_tokens in sorted(by_count):
            twin.update_metadata(LoRAMapping((1,) * num_tokens, (1,)), ids, slots + 1, 32000)
            for shape in by_count[num_tokens]:
                _lower_case(twin, shape, num_tokens, slots, dtype, lora_ranks, bias, dora)
                with lock:
                    bar.step(f"T={num_tokens}")

    if len(groups) == 1:
        lower_group(groups[0])
    else:
        with concurrent.futures.ThreadPoolExecutor(len(groups), thread_name_prefix="jax_lora-warmup") as pool:
            for future in [pool.submit(lower_group, g) for g in groups]:
                future.result()
    return {"calls": bar.done, "seconds": time.perf_counter() - t_start, "token_counts": counts,
            "workers": len(groups)}


def _step(w, y, x, lora_a, lora_b, lora_bias, ranks, dora_scales, slices):
    return w.add_lora_linear(y, x, lora_a, lora_b, lora_bias, 1.0, slices, lora_ranks=ranks,
                             dora_scale_stacked=dora_scales)


def _lower_case(twin, shape: LinearShape, num_tokens: int, slots: int, dtype, lora_ranks: bool, bias: bool,
                dora: bool = False) -> None:
    """add_lora_linear of one layer shape at num_tokens, lowered with abstract stand-ins."""
    spec = jax.ShapeDtypeStruct
    lora_a = [spec((slots, 1, shape.rank, shape.hidden), dtype) for _ in shape.slices]
    lora_b = [spec((slots, 1, n, shape.rank), dtype) for n in shape.slices]
    lora_bias = [spec((slots, 1, n), dtype) for n in shape.slices] if bias else None
    ranks = spec((slots,), jnp.int32) if lora_ranks else None
    dora_scales = [spec((slots, n), jnp.float32) for n in shape.slices] if dora else None
    jax.jit(_step, static_argnums=(8,)).lower(
        twin, spec((num_tokens, sum(shape.slices)), dtype), spec((num_tokens, shape.hidden), dtype),
        lora_a, lora_b, lora_bias, ranks, dora_scales, tuple(shape.slices))
