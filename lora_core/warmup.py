"""Warming up before serving: which layer shapes and token counts to compile, and a progress line.

A serving engine knows, before its first request, every LoRA'd linear of its model (hidden size,
output slices, rank of the stacked weights) and every token count it will launch with (its CUDA
graph capture sizes or jit buckets). `PunicaWrapper.warmup` on either side runs `add_lora_linear`
once per (token count, layer shape) with stand-in weights of those shapes, so that every kernel
variant is compiled (Triton's cache keeps them across processes, see docs/api.md) before the
first real step. Launch plans depend on shapes, dtypes and slot counts only, never on values or
on the mapping, so the stand-ins compile exactly what real steps will run.

Compiling is most of the warm-up (Triton: about half a second per kernel variant) and spreads
over CPU cores: `warmup_groups` splits the (layer, token count) cases into groups that share
launch configs (a layer and a token class: the cases of a group mostly compile the same variants,
different groups different ones), and each side compiles the groups concurrently before its own
pass, which then finds every variant compiled: torch in worker processes that fill Triton's cache
(`run_workers`), JAX in threads. A worker that fails only costs its head start: the pass after it
compiles whatever is missing, and says so in the log.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import subprocess
import sys
import time
from typing import Optional, Sequence

__all__ = ["LinearShape", "vllm_capture_sizes", "Progress", "check_warmup_arguments", "check_warmup_epilogue",
           "warmup_groups",
           "default_workers", "run_workers"]

_LOG = logging.getLogger("lora_core")


@dataclasses.dataclass(frozen=True)
class LinearShape:
    """One LoRA'd linear layer: x (T, hidden) -> y (T, sum(slices)), stacked weights of `rank`.

    Example, a Llama-3-8B layer: LinearShape(4096, (4096, 1024, 1024), 16) for qkv,
    LinearShape(4096, (4096,), 16) for o, LinearShape(4096, (14336, 14336), 16) for gate_up,
    LinearShape(14336, (4096,), 16) for down."""
    hidden: int
    slices: tuple
    rank: int


def vllm_capture_sizes(max_tokens: int = 512) -> list:
    """vLLM's default CUDA-graph capture sizes up to max_tokens: 1, 2, 4, then 8, 16, ... step 8."""
    sizes = [1, 2, 4] + list(range(8, max_tokens + 1, 8))
    return [s for s in sizes if s <= max_tokens]


def check_warmup_arguments(layers: Sequence, token_counts: Sequence[int], max_num_batched_tokens: int) -> tuple:
    """(layers as LinearShapes, token counts) after checking them; ValueError naming what is wrong."""
    shapes = []
    for i, layer in enumerate(layers):
        if not isinstance(layer, LinearShape):
            try:
                hidden, slices, rank = layer
                layer = LinearShape(int(hidden), tuple(int(s) for s in slices), int(rank))
            except (TypeError, ValueError) as e:
                raise TypeError(f"layers[{i}] must be a LinearShape or (hidden, slices, rank), got {layer!r}") from e
        if layer.hidden < 1 or layer.rank < 1 or not layer.slices or min(layer.slices) < 1:
            raise ValueError(f"layers[{i}] must have hidden >= 1, rank >= 1 and slices >= 1, got {layer}")
        shapes.append(layer)
    if not shapes:
        raise ValueError("layers must name at least one LoRA'd linear")
    counts = sorted({int(t) for t in token_counts})
    if not counts or counts[0] < 1 or counts[-1] > max_num_batched_tokens:
        raise ValueError(f"token_counts must be between 1 and max_num_batched_tokens={max_num_batched_tokens}, "
                         f"got {list(token_counts)[:8]}{'...' if len(token_counts) > 8 else ''}")
    return shapes, counts


def check_warmup_epilogue(bias, dora) -> None:
    """warmup's `bias` / `dora` flags: booleans, not both (a slice's epilogue takes a LoRA bias or a
    DoRA column scale, never both)."""
    for name, v in (("bias", bias), ("dora", dora)):
        if not isinstance(v, bool):
            raise TypeError(f"{name} must be a bool, got {type(v).__name__}")
    if bias and dora:
        raise ValueError("bias and dora cannot both be True: a slice takes a LoRA bias or a DoRA column scale, "
                         "never both (warm up the two kinds of layers in two calls)")


class Progress:
    """A one-line progress bar on stderr (redrawn in place on a terminal, a line per 10% elsewhere)."""

    def __init__(self, total: int, label: str = "warmup", enabled: bool = True, stream=None):
        self.total, self.label, self.enabled = max(total, 1), label, enabled
        self.stream = stream if stream is not None else sys.stderr
        self.done = 0
        self.start = time.perf_counter()
        self._tty = hasattr(self.stream, "isatty") and self.stream.isatty()
        self._last_decile = -1

    def step(self, what: str = "") -> None:
        self.done += 1
        if not self.enabled:
            return
        decile = 10 * self.done // self.total
        if not self._tty and decile == self._last_decile and self.done != self.total:
            return
        self._last_decile = decile
        filled = 30 * self.done // self.total
        line = (f"{self.label} [{'#' * filled}{' ' * (30 - filled)}] {self.done}/{self.total} "
                f"{time.perf_counter() - self.start:6.1f}s {what}")
        self.stream.write(("\r" + line) if self._tty else line + "\n")
        if self._tty and self.done == self.total:
            self.stream.write("\n")
        self.stream.flush()

    @property
    def seconds(self) -> float:
        return time.perf_counter() - self.start


def warmup_groups(shapes: Sequence[LinearShape], counts: Sequence[int], workers: int) -> list:
    """The (layer, token count) cases split into at most `workers` groups of [(layer, [counts])].

    A case's launch configs depend on its layer and its token class (`configs.token_class`), so
    the cases of one (layer, class) pair compile the same few variants: each pair goes to one group
    whole, the largest pairs first, each to the group with the fewest cases so far."""
    from .kernels.configs import token_class
    pairs: dict = {}
    for shape in shapes:
        for t in counts:
            pairs.setdefault((shape, token_class(t)), []).append(t)
    groups: list = [[] for _ in range(max(1, min(workers, len(pairs))))]
    sizes = [0] * len(groups)
    for (shape, _cls), ts in sorted(pairs.items(), key=lambda kv: -len(kv[1])):
        g = sizes.index(min(sizes))
        groups[g].append((shape, ts))
        sizes[g] += len(ts)
    return [g for g in groups if g]


def default_workers(compiles: bool) -> int:
    """Concurrent compile groups: the machine's cores (at most 16) when the backend compiles kernels,
    else 1 (nothing to spread)."""
    return max(1, min(16, os.cpu_count() or 1)) if compiles else 1


def run_workers(module: str, payloads: Sequence[dict], *, timeout: float = 600.0,
                env: Optional[dict] = None) -> list:
    """Runs `python -m <module> --warmup-worker <payload as JSON>` once per payload, concurrently,
    and waits for all (each at most `timeout` seconds). Returns per worker {"ok", "seconds",
    "error"}; never raises: a failed worker is logged (the caller's own pass compiles what it left)."""
    env = {**os.environ, **(env or {})}
    procs, t0 = [], time.perf_counter()
    for payload in payloads:
        try:
            procs.append(subprocess.Popen([sys.executable, "-m", module, "--warmup-worker", json.dumps(payload)],
                                          stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env))
        except OSError as e:
            procs.append(e)
    results = []
    for proc in procs:
        if isinstance(proc, OSError):
            results.append({"ok": False, "seconds": 0.0, "error": f"could not start: {proc}"})
            continue
        try:
            _, err = proc.communicate(timeout=max(1.0, timeout - (time.perf_counter() - t0)))
            ok = proc.returncode == 0
            tail = "" if ok else err.decode(errors="replace")[-2000:]
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
            ok, tail = False, f"timed out after {timeout:.0f} s"
        results.append({"ok": ok, "seconds": time.perf_counter() - t0, "error": tail})
    failed = [r for r in results if not r["ok"]]
    if failed:
        _LOG.warning("%d of %d warm-up workers failed (their variants compile in the main pass): %s",
                     len(failed), len(results), failed[0]["error"].strip().splitlines()[-1:] or failed[0]["error"])
    else:
        _LOG.info("%d warm-up workers compiled in %.1f s", len(results), time.perf_counter() - t0)
    return results
