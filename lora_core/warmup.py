"""Warming up before serving: which layer shapes and token counts to compile, and a progress line.

A serving engine knows, before its first request, every LoRA'd linear of its model (hidden size,
output slices, rank of the stacked weights) and every token count it will launch with (its CUDA
graph capture sizes or jit buckets). `PunicaWrapper.warmup` on either side runs `add_lora_linear`
once per (token count, layer shape) with stand-in weights of those shapes, so that every kernel
variant is compiled (Triton's cache keeps them across processes, see docs/api.md) before the
first real step. Launch plans depend on shapes, dtypes and slot counts only, never on values or
on the mapping, so the stand-ins compile exactly what real steps will run.

Compiling is most of the warm-up (Triton: about half a second per kernel variant) and spreads
over CPU cores: `case_variants` names, on the host, the kernel variants a (layer, token count)
case compiles, `warmup_groups` splits the cases into groups that compile about as many variants
each and rarely the same ones, and each side compiles the groups concurrently before its own
pass, which then finds every variant compiled: torch in worker processes that fill Triton's cache
(`run_workers`), JAX in threads. A worker that fails only costs its head start: the pass after it
compiles whatever is missing, and says so in the log.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import os
import subprocess
import sys
import time
from collections.abc import Sequence

__all__ = ["LinearShape", "vllm_capture_sizes", "Progress", "check_warmup_arguments", "check_warmup_epilogue",
           "check_warmup", "case_variants", "variants_of", "warmup_groups",
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


def check_warmup(layers: Sequence, token_counts: Sequence[int] | None, max_num_batched_tokens: int, *,
                 bias, dora, workers, compiles: bool) -> tuple:
    """(layers as LinearShapes, token counts, workers) of one `warmup` call after checking its
    arguments (ValueError / TypeError naming the argument). token_counts None: vLLM's capture sizes
    up to max_num_batched_tokens; workers None: `default_workers(compiles)`."""
    check_warmup_epilogue(bias, dora)
    shapes, counts = check_warmup_arguments(
        layers, token_counts if token_counts is not None else vllm_capture_sizes(max_num_batched_tokens),
        max_num_batched_tokens)
    if workers is None:
        workers = default_workers(compiles)
    if not isinstance(workers, int) or isinstance(workers, bool) or workers < 0:
        raise ValueError(f"workers must be None or an int >= 0, got {workers!r}")
    return shapes, counts, workers


def variants_of(slots: int, dtype: str, *, bias: bool, dora: bool, lora_ranks: bool, deterministic: bool):
    """`variants(shape, num_tokens)` for `warmup_groups`: `case_variants` of one wrapper's slots,
    dtype name and epilogue."""
    return functools.partial(case_variants, slots=slots, dtype=dtype, bias=bias, dora=dora, lora_ranks=lora_ranks,
                             deterministic=deterministic)


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


def case_variants(shape: LinearShape, num_tokens: int, slots: int, dtype: str, *, bias: bool = False,
                  dora: bool = False, lora_ranks: bool = False, deterministic: bool = False,
                  device: str | None = None) -> frozenset:
    """Identities of the Triton kernel variants one `add_lora_linear` of `shape` at `num_tokens`
    compiles on `device` (None: the GPU present), planned on the host without an array.

    A variant is what Triton compiles once: (kernel, meta-parameters, warps, stages) and the
    specialisation of its token-dependent integers (a count of 1 is a constant; the float32
    buffer's token strides, T * rank, may or may not be multiples of 16). The plans are those
    both launchers make (`configs.use_fused`, the launch table's configs, `plan_shrink` /
    `plan_expand` / `plan_fused` per chunk of <= MAX_SLICES slices); pdl as the GPU allows. dtype:
    the activations' and weights' dtype name ("bfloat16", "float16", "float32")."""
    from .kernels import configs, plan_expand, plan_fused, plan_shrink
    from .kernels.planning import pdl_allowed, slice_chunks
    T, H, R, L = int(num_tokens), shape.hidden, shape.rank, int(slots)
    groups = L + 1                         # the metadata's active-slot list: every slot and "no LoRA"
    flag = 2 if dora else 1 if bias else 0
    pdl = pdl_allowed()
    tokens = ("one" if T == 1 else "many", (T * R) % 16 == 0)
    fused = configs.use_fused(T, R, len(shape.slices), L, device=device, deterministic=deterministic)
    found = set()
    for lo, hi in slice_chunks(len(shape.slices)):
        widths = tuple(shape.slices[lo:hi])
        flags = (flag,) * len(widths)
        if fused:
            cfg = configs.fused_config(T, H, max(widths), R, len(widths), L, device=device)
            plans = [plan_fused(T, H, R, widths, groups, dtype, dtype, cfg, add_inputs=True, bias_flags=flags,
                                has_ranks=lora_ranks, pdl=pdl)]
        else:
            scfg = configs.shrink_config(T, H, R, len(widths), L, device=device, deterministic=deterministic)
            splan = plan_shrink(T, H, R, len(widths), groups, dtype, dtype, scfg, lora_only=True, workspace=True,
                                has_ranks=lora_ranks, pdl=pdl, deterministic=deterministic)
            ecfg = configs.expand_config(T, max(widths), R, len(widths), L, device=device,
                                         deterministic=deterministic)
            plans = [splan, plan_expand(T, R, widths, groups, splan.num_partials, dtype, dtype, ecfg, add_inputs=True,
                                        bias_flags=flags, has_ranks=lora_ranks,
                                        pdl=bool(splan.constexprs.get("USE_PDL")), deterministic=deterministic)]
        found.update((type(plan).__name__, plan.key[1:], tokens) for plan in plans)
    return frozenset(found)


def warmup_groups(shapes: Sequence[LinearShape], counts: Sequence[int], workers: int, variants=None) -> list:
    """The (layer, token count) cases split into at most `workers` groups of [(layer, [counts])],
    each case in exactly one group.

    variants: None, or `variants(shape, num_tokens)` -> the case's kernel variants (e.g.
    `case_variants`). Then the groups are balanced by the variants they compile, the measure of a
    compile worker's time (about half a second each): the cases that bring variants not yet
    compiled are taken greedily (most new variants first), each into a group that stays within an
    even share of all variants, the one compiling fewest of the case's variants anew (so a case
    joins the group that already compiles its shrink or expand), else into the group left smallest;
    the other cases (every variant already somewhere) go to the group that compiles most of their
    variants, so they only load them.
    Without: a case's launch configs depend on its layer and token class (`configs.token_class`),
    so each (layer, class) pair goes to one group whole, the largest pairs first, each to the
    group with the fewest cases so far."""
    if variants is not None:
        return _groups_by_variants(shapes, counts, workers, variants)
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


def _groups_by_variants(shapes, counts, workers: int, variants) -> list:
    cases = {(shape, t): frozenset(variants(shape, t)) for shape in shapes for t in counts}
    order = list(cases)                                    # layer by layer, token counts ascending
    remaining = set().union(*cases.values())
    n = max(1, min(workers, len(remaining) or 1))
    compiles: list = [set() for _ in range(n)]             # variants each group compiles
    members: list = [[] for _ in range(n)]                 # its cases
    placed = set()
    target = -(-len(remaining) // n)                       # variants per group if none were compiled twice
    while remaining:
        _, case = max(((i, c) for i, c in enumerate(order) if c not in placed),
                      key=lambda ic: (len(cases[ic[1]] & remaining), -ic[0]))
        sizes = [len(compiles[i] | cases[case]) for i in range(n)]
        fits = [i for i in range(n) if sizes[i] <= target]
        if fits:      # the group that compiles fewest of them anew (one already holding some), then the emptiest
            g = min(fits, key=lambda i: (sizes[i] - len(compiles[i]), sizes[i], len(members[i])))
        else:
            g = min(range(n), key=lambda i: (sizes[i], len(members[i])))
        compiles[g] |= cases[case]
        members[g].append(case)
        placed.add(case)
        remaining -= cases[case]
    for case in order:
        if case not in placed:
            g = max(range(n), key=lambda i: (len(compiles[i] & cases[case]), -len(members[i])))
            members[g].append(case)
    groups = []
    for cs in members:
        by_shape: dict = {}
        for shape, t in cs:
            by_shape.setdefault(shape, []).append(t)
        if by_shape:
            groups.append([(shape, sorted(ts)) for shape, ts in by_shape.items()])
    return groups


def default_workers(compiles: bool) -> int:
    """Concurrent compile groups: the machine's cores (at most 16) when the backend compiles kernels,
    else 1 (nothing to spread)."""
    return max(1, min(16, os.cpu_count() or 1)) if compiles else 1


def run_workers(module: str, payloads: Sequence[dict], *, timeout: float = 600.0,
                env: dict | None = None) -> list:
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
