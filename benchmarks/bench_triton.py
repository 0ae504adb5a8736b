"""The anchor sweep of docs/benchmarks.md for the Triton kernels (torch and JAX), on one CUDA GPU.

One command runs everything and writes JSON + markdown + a roofline plot (PNG):

    PYTHONPATH=. python benchmarks/bench_triton.py --out benchmarks/results

What is measured (docs/benchmarks.md "How to time"):
  * graph: `add_lora_linear` (torch_lora.ops.triton.linear: shrink + expand with add_inputs, or the
    fused kernel at decode sizes) captured once per input set into one CUDA graph; enough input
    sets (fresh weights, x, y and mapping each) that the bytes touched exceed 4x the 60 MB L2, so
    weights are cold; the graph is replayed ~10 times and the median per call is reported.
  * host: CPU time to enqueue one eager call (no graph), median over many calls.
  * jax: the same op under jax.jit through jax_triton, called many times in one program (a scan),
    compared with torch timed the same way (one input set, hot weights, graph of as many calls).
Correctness is checked on every case before timing (relative error vs float64).

`--deterministic`: every sweep case is also timed with `linear(..., deterministic=True)` (the
batch-invariant launch configs, always shrink + expand) on the same input sets, reported beside
the default as `det_us` and its cost `det_cost` = det_us / time_us.
`--dora`: every sweep case is also timed with a DoRA column scale on every slice (`col_scale=`,
the expand's epilogue multiplies each row's new value by its slot's g), reported as `dora_us` and
`dora_cost` = dora_us / time_us, its error against the float64 reference of g * (y + delta).
`--wrapper-graph`: every case is also timed through `PunicaWrapper.add_lora_linear` in the same
graphs (`wrapper_us`, `wrapper_over_op`).
`--lora-dtype fp8`: the sweep with fp8 (e4m3) adapter weights (contract section 11), quantised per
output channel from each input set's bf16 weights: our kernels with fp8 weights (`fp8_us`), beside
ours with the bf16 weights (`time_us`) and vLLM 0.33's fp8 kernels loaded in the same process
(`vllm_fp8_us`; benchmarks/vllm_kernels.FP8_MODE says which mode, printed and recorded in the
results), timed the same way on the same input sets. Errors against the float64 oracle on the
dequantised weights (`fp8_rel_err`, `vllm_fp8_rel_err`) and ours against the bf16 weights
(`fp8_vs_bf16_err`: the quantisation itself). Decode cases with D >= 8 in about two minutes:
    PYTHONPATH=. python benchmarks/bench_triton.py --lora-dtype fp8 --cases 'dec T[0-9]+ D(8|32|64) r' \
        --pairs '' --no-host --no-jax --out /tmp/fp8
`--pairs 2,4` (the default; "" for none): every case is also timed with k adapters per token, each
with its own weight (contract section 10: shrink per pair, expand summed, one launch each): a
token's first adapter is its k = 1 adapter, the others the next ones of the case's D adapters, so
the batch has as many adapter combinations as adapters. Reported as `pairs{k}_us`, their cost
`pairs{k}_cost` = pairs{k}_us / time_us beside the k = 1 time, and their error.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import math
import os
import platform
import subprocess
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from lora_core.adapter_pairs import AdapterPairs, build_pairs_host
from lora_core.kernel_meta import KernelMeta
from torch_lora.meta import LoRAKernelMeta
from torch_lora.ops import triton as torch_triton

HIDDEN = 4096
SLICES = {"s1": (4096,), "s3": (4096, 1024, 1024)}
PEAK_GBS = 4300.0
L2_BYTES = 60e6
LAUNCH_US = 2.0

# vLLM 0.33.0 Triton kernels on this H200 (docs/benchmarks.md), us per add_lora_linear: (s1, s3).
VLLM = {
    "dec T1 D1 r16": (9.3, 14.5), "dec T8 D1 r16": (8.4, 12.8), "dec T8 D8 r64": (16.0, 76.4),
    "dec T32 D8 r16": (10.5, 37.5), "dec T32 D32 r64": (42.7, 284), "dec T128 D8 r16": (20.1, 39.3),
    "dec T128 D64 r64": (57.8, 255), "dec T512 D8 r64": (27.6, 79.2), "dec T512 D64 r64": (74.0, 383),
    "dec T128 D8 r16 25% -1": (19.9, 39.7), "pre T2048 D4 r16": (37.0, 145),
    "pre T2048 D16 r64": (67.3, 305), "pre T8192 D1 r16": (107, 552), "pre T8192 D4 r64": (182, 837),
    "pre T8192 D16 r64": (210, 1157),
}


# ------------------------------------------------------------------------------------------ cases

def sweep_cases(quick: bool = False):
    """(name, kind, T, D, rank, frac_none, ranks_of_slots or None)."""
    cases = []
    for T in (1, 8, 32, 128, 512):
        big = 32 if T <= 32 else 64
        for D in sorted({1, min(T, 8), min(T, big)}):
            for r in (16, 64):
                cases.append((f"dec T{T} D{D} r{r}", "dec", T, D, r, 0.0, None))
    cases.append(("dec T128 D8 r16 25% -1", "dec", 128, 8, 16, 0.25, None))
    for T in (2048, 8192):
        for D in (1, 4, 16):
            for r in (16, 64):
                cases.append((f"pre T{T} D{D} r{r}", "pre", T, D, r, 0.0, None))
    het = (8, 16, 32, 64)
    cases.append(("het dec T128 D8 r{8..64}", "dec", 128, 8, 64, 0.0, het))
    cases.append(("het pre T2048 D4 r{8..64}", "pre", 2048, 4, 64, 0.0, het))
    # the same batches computed at their true ranks would need separate launches per rank; the
    # padded (max-rank) time is the het case with ranks=None, measured as its own case:
    cases.append(("pad dec T128 D8 r64", "dec", 128, 8, 64, 0.0, None))
    if quick:
        cases = [c for c in cases if c[0] in ("dec T8 D8 r64", "dec T128 D64 r64", "pre T8192 D4 r64")]
    return cases


def make_mapping(kind, T, D, slots, frac_none, gen):
    """int32 (T,) slots: decode = every token its own request with exactly D distinct adapters
    (shuffled); prefill = tokens of one adapter contiguous."""
    chosen = torch.randperm(slots, generator=gen)[:D]
    if kind == "dec":
        idx = chosen[torch.arange(T) % D]
        idx = idx[torch.randperm(T, generator=gen)]
    else:
        bounds = torch.linspace(0, T, D + 1).round().long()
        idx = torch.empty(T, dtype=torch.long)
        for i in range(D):
            idx[bounds[i]:bounds[i + 1]] = chosen[i]
    if frac_none > 0:
        none = torch.randperm(T, generator=gen)[: int(round(frac_none * T))]
        idx[none] = -1
    return idx.to(torch.int32)


def min_bytes(T_l, D, S_widths, r, H=HIDDEN, rank_sum=None):
    """docs/benchmarks.md minimal bytes (shrink + expand), tokens with a LoRA only; rank_sum: the sum
    of the active adapters' real ranks (D * r when all have rank r)."""
    S = len(S_widths)
    n = sum(S_widths)
    rank_sum = D * r if rank_sum is None else rank_sum
    shrink = T_l * H * 2 + S * rank_sum * H * 2 + S * T_l * r * 4
    expand = S * T_l * r * 4 + n * rank_sum * 2 + 2 * T_l * n * 2
    return shrink + expand


class InputSet:
    def __init__(self, kind, T, D, r, widths, slots, frac_none, ranks, gen, device, dtype=torch.bfloat16):
        H = HIDDEN
        dg = torch.Generator(device=device).manual_seed(int(torch.randint(0, 2**31, (1,), generator=gen)))
        kw = dict(generator=dg, device=device)
        self.x = torch.randn(T, H, **kw).to(dtype)
        self.y = torch.randn(T, sum(widths), **kw).to(dtype)
        self.a = [(torch.randn(slots, r, H, **kw) / math.sqrt(H)).to(dtype) for _ in widths]
        self.b = [(torch.randn(slots, n, r, **kw) / math.sqrt(r)).to(dtype) for n in widths]
        self.idx = make_mapping(kind, T, D, slots, frac_none, gen).to(device)
        self.meta = LoRAKernelMeta.make(slots, T, device)
        self.meta.prepare_tensors(self.idx)
        self.ranks = None
        if ranks is not None:
            self.ranks = torch.tensor([ranks[i % len(ranks)] for i in range(slots)], dtype=torch.int32,
                                      device=device)
        self.offsets = tuple(int(v) for v in np.cumsum((0,) + tuple(widths))[:-1])
        self.scale = 0.5
        self.deterministic = False
        self.col_scale = None          # DoRA: per slice (slots, n) float32, see with_dora_scales
        self.pairs = None              # k adapters per token: (slots (T, k), weights, group meta, AdapterPairs)

    def with_pairs(self, k: int, gen) -> None:
        """k adapters per token (k = 0: back to one): a token's first is its own slot, pair j the
        j-th next of the batch's adapters (in slot order), weights in [0.5, 1]."""
        if not k:
            self.pairs = None
            return
        idx = self.idx.cpu().numpy().astype(np.int64)
        chosen = np.unique(idx[idx >= 0])
        pos = {int(v): i for i, v in enumerate(chosen)}
        slots = np.full((idx.shape[0], k), -1, np.int64)
        for t, v in enumerate(idx):
            if v >= 0:
                slots[t] = [chosen[(pos[int(v)] + j) % len(chosen)] for j in range(k)]
        weights = np.where(slots >= 0, 0.5 + 0.5 * torch.rand(slots.shape, generator=gen).numpy(), 0.0)
        meta, tables = build_pairs_host(slots, weights, max(self.a[0].shape[0], idx.shape[0]), idx.shape[0])
        dev = self.x.device
        meta = KernelMeta(*(torch.from_numpy(np.ascontiguousarray(m)).to(dev) for m in meta))
        self.pairs = (slots, weights.astype(np.float32), meta, AdapterPairs(torch.from_numpy(tables.slots).to(dev),
                                                                           torch.from_numpy(tables.weights).to(dev)))

    def with_dora_scales(self, gen) -> None:
        """A DoRA column scale on every slice, g in [0.9, 1.1] (replays multiply y by it again and
        again: values stay in range)."""
        dg = torch.Generator(device=self.x.device).manual_seed(int(torch.randint(0, 2**31, (1,), generator=gen)))
        self.col_scale = [0.9 + 0.2 * torch.rand(b.shape[0], b.shape[1], generator=dg, device=self.x.device)
                          for b in self.b]

    def with_fp8(self) -> None:
        """fp8 copies of the weights (contract section 11's rule, per output channel) beside the bf16
        ones: a_q / b_q e4m3, a_scales / b_scales float32, and their dequantised float64 values."""
        self.fp8 = [quantize_fp8(w) for w in self.a], [quantize_fp8(w) for w in self.b]

    def call_fp8(self, y=None):
        (qa, qb) = self.fp8
        torch_triton.linear(self.y if y is None else y, self.x, [q for q, _ in qa], [q for q, _ in qb],
                            self.meta.meta_args(self.x.shape[0]), self.scale, self.offsets, self.ranks,
                            a_scales=tuple(s for _, s in qa), b_scales=tuple(s for _, s in qb))

    def reference_fp8(self):
        """float64 reference of `call_fp8`: `reference` with the dequantised weights."""
        a, b = self.a, self.b
        self.a = [dequantize_fp8(*p) for p in self.fp8[0]]
        self.b = [dequantize_fp8(*p) for p in self.fp8[1]]
        try:
            return self.reference()
        finally:
            self.a, self.b = a, b

    def call(self, y=None):
        kw = {} if self.col_scale is None else {"col_scale": self.col_scale}
        meta = self.meta.meta_args(self.x.shape[0])
        if self.pairs is not None:
            meta, kw = self.pairs[2], {**kw, "pairs": self.pairs[3]}
        torch_triton.linear(self.y if y is None else y, self.x, self.a, self.b, meta,
                  self.scale, self.offsets, self.ranks, deterministic=self.deterministic, **kw)

    def reference(self):
        """float64 y + sum_s (scale x A_s^T) B_s^T, grouped by adapter (no (T, r, H) gather); with
        pairs, sum_j w_j * scale ... over each token's pairs, grouped by adapter combination."""
        y = self.y.double().clone()
        x = self.x.double()
        if self.pairs is not None:
            slots, weights = self.pairs[:2]
            combos = {tuple(row) for row in slots.tolist() if row[0] >= 0}
            for combo in combos:
                rows = torch.as_tensor(np.flatnonzero((slots == np.asarray(combo)).all(axis=1)), device=y.device)
                for j, slot in enumerate(combo):
                    w = torch.as_tensor(weights[rows.cpu().numpy(), j], dtype=torch.float64, device=y.device)
                    for a, b, off in zip(self.a, self.b, self.offsets):
                        aa, bb = a[slot].double(), b[slot].double()
                        if self.ranks is not None:
                            k = int(self.ranks[slot])
                            aa, bb = aa[:k], bb[:, :k]
                        y[rows, off:off + b.shape[1]] += w[:, None] * ((self.scale * x[rows] @ aa.T) @ bb.T)
            return y
        for slot in torch.unique(self.idx).tolist():
            if slot < 0:
                continue
            rows = (self.idx == slot).nonzero().squeeze(1)
            for a, b, off in zip(self.a, self.b, self.offsets):
                aa, bb = a[slot].double(), b[slot].double()
                if self.ranks is not None:
                    k = int(self.ranks[slot])
                    aa, bb = aa[:k], bb[:, :k]
                y[rows, off:off + b.shape[1]] += (self.scale * x[rows] @ aa.T) @ bb.T
        if self.col_scale is not None:
            live = (self.idx >= 0).nonzero().squeeze(1)
            for g, b, off in zip(self.col_scale, self.b, self.offsets):
                y[live, off:off + b.shape[1]] *= g[self.idx[live].long()].double()
        return y


def quantize_fp8(w):
    """(w_q e4m3, scale (L, rows) float32): contract section 11's rule per output channel (row)."""
    w32 = w.float()
    amax = w32.abs().amax(dim=-1)
    scale = torch.where(amax == 0, torch.ones_like(amax), amax / 448.0)
    return (w32 / scale[..., None]).clamp(-448, 448).to(torch.float8_e4m3fn), scale.contiguous()


def dequantize_fp8(q, scale):
    return q.double() * scale.double()[..., None]


def run_fp8_case(case, slice_name, device, vk, seed=0):
    """One case with fp8 weights (--lora-dtype fp8): ours fp8, ours bf16 and vLLM's fp8 kernels
    (vllm_kernels.FP8_MODE; None without .vllm/) on the same input sets, graph-timed as run_case."""
    import vllm_kernels
    name, kind, T, D, r, frac_none, ranks = case
    widths = SLICES[slice_name]
    slots = max(8, D)
    gen = torch.Generator().manual_seed(seed)
    first = InputSet(kind, T, D, r, widths, slots, frac_none, ranks, gen, device)
    first.with_fp8()
    ref16, ref8 = first.reference(), first.reference_fp8()
    y0 = first.y.clone()
    y = y0.clone()
    first.call_fp8(y)
    y16 = y0.clone()
    first.call(y16)
    torch.cuda.synchronize()
    out = dict(case=name, slices=slice_name, kind=kind, T=T, D=D, rank=r, slots=slots, lora_dtype="fp8",
               fp8_rel_err=rel_err(y, ref8), fp8_vs_bf16_err=rel_err(y, ref16), rel_err=rel_err(y16, ref16))
    T_l = int((first.idx >= 0).sum())
    nbytes = min_bytes(T_l, D, widths, r)
    mem_per_set = sum(t.numel() * t.element_size() for t in [first.x, first.y, *first.a, *first.b])
    n_sets = int(max(3, min(400, math.ceil(4 * L2_BYTES / (nbytes / 2)), 20e9 // (2 * mem_per_set))))
    sets = [first] + [InputSet(kind, T, D, r, widths, slots, frac_none, ranks, gen, device)
                      for _ in range(n_sets - 1)]
    for s in sets[1:]:
        s.with_fp8()
    out["time_us"] = graph_time_us(sets)
    out["fp8_us"] = graph_replay_us_warm([s.call_fp8 for s in sets]) / len(sets)
    out["fp8_over_bf16"] = out["fp8_us"] / out["time_us"]
    out["n_sets"] = n_sets
    if vk is not None:
        calls = []
        for s in sets:
            vmeta = vk.LoRAKernelMeta.make(slots, T, device)     # each set's own mapping
            vmeta.prepare_tensors(s.idx)
            qa, qb = s.fp8
            x_q, x_scale = vllm_kernels.quantize_per_token(s.x)
            buffer = torch.zeros((len(widths), T, r), dtype=torch.float32, device=device)
            shrink, _ = vllm_kernels.lora_linear_fp8_calls(vk, vmeta, s.y, x_q, x_scale, [q for q, _ in qa],
                                                          [sc for _, sc in qa], [q for q, _ in qb],
                                                          [sc for _, sc in qb], s.scale, buffer, None, None)
            shrink()
            buf_q, buf_scale = vllm_kernels.quantize_per_token(buffer)
            yv = y0.clone() if s is first else s.y
            shrink, expand = vllm_kernels.lora_linear_fp8_calls(vk, vmeta, yv, x_q, x_scale, [q for q, _ in qa],
                                                               [sc for _, sc in qa], [q for q, _ in qb],
                                                               [sc for _, sc in qb], s.scale, buffer, buf_q,
                                                               buf_scale)
            if s is first:
                expand()                               # the end-to-end W8A8 result, checked
                torch.cuda.synchronize()
                out["vllm_fp8_rel_err"] = rel_err(yv, ref8)
                shrink, expand = vllm_kernels.lora_linear_fp8_calls(
                    vk, vmeta, s.y, x_q, x_scale, [q for q, _ in qa], [sc for _, sc in qa], [q for q, _ in qb],
                    [sc for _, sc in qb], s.scale, buffer, buf_q, buf_scale)
            calls += [shrink, expand]
        out["vllm_fp8_us"] = graph_replay_us_warm(calls) / len(sets)
        out["fp8_speedup_vs_vllm_fp8"] = out["vllm_fp8_us"] / out["fp8_us"]
    base = VLLM.get(name)
    out["vllm_bf16_us"] = base[0 if slice_name == "s1" else 1] if base else None
    del sets
    torch.cuda.empty_cache()
    return out


def graph_replay_us_warm(calls, replays=10):
    """`graph_replay_us` after one eager pass of the calls on a side stream (compiles, plans)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for c in calls:
            c()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    return graph_replay_us(calls, replays)


def fp8_markdown(res) -> str:
    lines = [f"fp8 weights; vLLM: {res['meta'].get('vllm_fp8_mode', 'absent')}", "",
             "| case | slices | ours bf16 us | ours fp8 us | fp8/bf16 | vLLM fp8 us | ours fp8 vs vLLM fp8 "
             "| fp8 err | vLLM fp8 err | fp8 vs bf16 weights |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in res["sweep"]:
        v = f"{r['vllm_fp8_us']:.2f}" if r.get("vllm_fp8_us") else "-"
        sp = f"{r['fp8_speedup_vs_vllm_fp8']:.2f}x" if r.get("fp8_speedup_vs_vllm_fp8") else "-"
        ve = f"{r['vllm_fp8_rel_err']:.1e}" if "vllm_fp8_rel_err" in r else "-"
        lines.append(f"| {r['case']} | {r['slices']} | {r['time_us']:.2f} | {r['fp8_us']:.2f} "
                     f"| {r['fp8_over_bf16']:.2f}x | {v} | {sp} | {r['fp8_rel_err']:.1e} | {ve} "
                     f"| {r['fp8_vs_bf16_err']:.1e} |")
    return "\n".join(lines)


def rel_err(got, ref):
    got = got.double()
    if torch.isnan(got).any():
        return float("inf")
    return float(torch.linalg.norm(got - ref) / torch.linalg.norm(ref))


def graph_time_us(sets, replays=10):
    """Median us per call: one graph holding one call per input set, replayed `replays` times.
    Every call runs once eagerly first, as an engine warms up before it captures: compiles, and
    each wrapper builds its direct launch path, which the graph then records."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for s in sets:
            s.call()                                   # warm-up / compile outside the graph
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    return graph_replay_us([s.call for s in sets], replays) / len(sets)


def graph_replay_us(calls, replays=10):
    """Median us (CUDA events) of replaying one graph that holds `calls` in order."""
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for call in calls:
            call()
    g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        g.replay()
        e1.record()
        e1.synchronize()
        times.append(e0.elapsed_time(e1) * 1e3)
    del g
    return float(np.median(times))


class Clock:
    """us per call of a list of calls (each call does its work again when called): CUDA-graph
    replays on a GPU, the sequence repeated to about `target(m)` calls per graph (m: the calls'
    rows or tokens), or the host clock of one eager pass after a warm one (CPU: the
    interpreter's times mean nothing)."""

    def __init__(self, cuda: bool, target=lambda m: 48 if m <= 256 else (8 if m <= 2048 else 4)):
        self.cuda, self.target = cuda, target

    def __call__(self, calls: list, m: int, replays: int = 5) -> float:
        if not self.cuda:
            for c in calls:
                c()                                  # compile (interpreter: nothing) and warm
            t0 = time.perf_counter()
            for c in calls:
                c()
            return (time.perf_counter() - t0) * 1e6 / len(calls)
        seq = calls * max(1, math.ceil(self.target(m) / len(calls)))
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for c in calls:
                c()                                  # compiles and plans outside the capture
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
        return graph_replay_us(seq, replays) / len(seq)


def host_time_us(s, n=300):
    """CPU time to enqueue one eager call (median of per-batch means)."""
    return _host_us(s.call, n)


def _host_us(fn, n):
    """us per call of fn() on the host: 20 warm-up calls, then the median of 5 batches of n // 5
    (the GPU drained between batches)."""
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    per = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(n // 5):
            fn()
        per.append((time.perf_counter() - t0) * 1e6 / (n // 5))
        torch.cuda.synchronize()
    return float(np.median(per))


def host_breakdown(s, n=3000) -> str:
    """The parts of one PreparedLinear call, timed alone on this host (us per call, median of 5
    batches): what the host figure is made of (--profile-host). The workspace allocation is timed
    for comparison: PreparedLinear reuses its stream's buffer instead."""
    prepared = torch_triton.PreparedLinear(s.a, s.b, s.meta.meta_args(s.x.shape[0]), s.offsets)
    prepared(s.y, s.x, s.scale, s.ranks)                    # builds the direct path
    prepared(s.y, s.x, s.scale, s.ranks)                    # fills in the per-call values
    torch.cuda.synchronize()
    steps = prepared._steps or ()
    ws_shape = next((shape for shape, _ in steps if shape is not None), (8, 1, 8, 16))
    dev = s.x.device
    c_steps = prepared._c_steps
    parts = {
        "torch.empty(workspace) + free": lambda: torch.empty(ws_shape, dtype=torch.float32, device=dev),
        "current raw stream": lambda: torch._C._cuda_getCurrentRawStream(dev.index),
        "x/y data_ptr + layout tuple": lambda: (s.x.data_ptr(), s.y.data_ptr(), s.x.shape, s.x.stride(),
                                                s.x.dtype, s.y.shape, s.y.stride(), s.y.dtype),
        "PreparedLinear call": lambda: prepared(s.y, s.x, s.scale, s.ranks),
    }
    if c_steps:
        vals = prepared._c_vars                              # as the last call left them
        stream = torch._C._cuda_getCurrentRawStream(dev.index)
        parts["C launches only"] = lambda: [c.launch(stream, vals) for c in c_steps]
    lines = [f"host breakdown ({len(steps)} chunk(s), {sum(len(lc) for _, lc in steps)} launch(es), "
             f"C launcher {'on' if c_steps else 'off'}):"]
    lines += [f"  {name:34s} {_host_us(fn, n):7.2f} us" for name, fn in parts.items()]
    return "\n".join(lines)


class WrapperCall:
    """One eager `PunicaWrapper.add_lora_linear` (docs/benchmarks.md's host figure): the input set's
    weights as (L, 1, n, r) stacks, its mapping through `update_metadata` (once; a step's
    metadata is shared by every layer)."""

    def __init__(self, s: InputSet, widths):
        import torch_lora
        self.s, self.widths = s, tuple(widths)
        slots = s.a[0].shape[0]
        ids = list(range(1, slots + 1))
        idx = s.idx.cpu().tolist()
        m = tuple(0 if i < 0 else ids[i] for i in idx)
        self.w = torch_lora.PunicaWrapper(max(len(idx), 8), 256, s.x.device, max_loras=slots, backend="triton")
        self.w.update_metadata(torch_lora.LoRAMapping(m, m, is_prefill=False), ids, slots, 32000)
        self.a = [t[:, None] for t in s.a]
        self.b = [t[:, None] for t in s.b]

    def call(self, y=None):
        self.w.add_lora_linear(self.s.y if y is None else y, self.s.x, self.a, self.b, None, self.s.scale,
                               self.widths, lora_ranks=self.s.ranks)


def run_case(case, slice_name, device, seed=0, deterministic=False, wrapper_graph=False, dora=False, pairs=()):
    name, kind, T, D, r, frac_none, ranks = case
    widths = SLICES[slice_name]
    slots = max(8, D)
    gen = torch.Generator().manual_seed(seed)
    first = InputSet(kind, T, D, r, widths, slots, frac_none, ranks, gen, device)
    # correctness on fresh data, poisoned nothing (y is read: add_inputs) but compared in full
    ref = first.reference()
    y0 = first.y.clone()              # the timed replays below add into first.y: later checks start here
    y = y0.clone()
    first.call(y)
    torch.cuda.synchronize()
    err = rel_err(y, ref)
    T_l = int((first.idx >= 0).sum())
    rank_sum = None
    if first.ranks is not None:
        active = torch.unique(first.idx[first.idx >= 0]).long()
        rank_sum = int(first.ranks[active].sum())
    nbytes = min_bytes(T_l, D, widths, r, rank_sum=rank_sum)
    per_set_touched = nbytes
    n_sets = int(min(400, max(3, math.ceil(4 * L2_BYTES / per_set_touched))))
    mem_per_set = sum(t.numel() * t.element_size() for t in [first.x, first.y, *first.a, *first.b])
    n_sets = int(max(3, min(n_sets, (20e9 // mem_per_set))))
    sets = [first] + [InputSet(kind, T, D, r, widths, slots, frac_none, ranks, gen, device)
                      for _ in range(n_sets - 1)]
    t_us = graph_time_us(sets)
    det = {}
    if deterministic:
        for s in sets:
            s.deterministic = True
        y = y0.clone()
        first.call(y)
        torch.cuda.synchronize()
        det_us = graph_time_us(sets)
        det = dict(det_us=det_us, det_cost=det_us / t_us, det_rel_err=rel_err(y, ref))
    if wrapper_graph:
        # the same input sets through the public PunicaWrapper.add_lora_linear (its own metadata,
        # (L, 1, n, r) stacks, its launcher), captured the same way: the wrapper path against the op
        calls = [WrapperCall(s, widths) for s in sets]
        y = y0.clone()
        calls[0].call(y)
        torch.cuda.synchronize()
        wrapper_us = graph_time_us(calls)
        det.update(wrapper_us=wrapper_us, wrapper_over_op=wrapper_us / t_us, wrapper_rel_err=rel_err(y, ref))
        del calls
    for k in pairs:
        # k adapters per token on the same input sets (before DoRA: pairs take no column scale)
        for s in sets:
            s.deterministic = False
            s.with_pairs(k, gen)
        first.y.copy_(y0)
        pref = first.reference()
        y = y0.clone()
        first.call(y)
        torch.cuda.synchronize()
        k_us = graph_time_us(sets)
        det.update({f"pairs{k}_us": k_us, f"pairs{k}_cost": k_us / t_us, f"pairs{k}_rel_err": rel_err(y, pref)})
        for s in sets:
            s.with_pairs(0, gen)
    if dora:
        for s in sets:
            s.deterministic = False
            s.with_dora_scales(gen)
        first.y.copy_(y0)
        dref = first.reference()
        y = y0.clone()
        first.call(y)
        torch.cuda.synchronize()
        dora_us = graph_time_us(sets)
        det.update(dora_us=dora_us, dora_cost=dora_us / t_us, dora_rel_err=rel_err(y, dref))
    floor_us = max(nbytes / (PEAK_GBS * 1e3), LAUNCH_US if T <= 1024 else 0.0)
    base_name = name if name in VLLM else None
    vllm = VLLM[base_name][0 if slice_name == "s1" else 1] if base_name else None
    del sets
    torch.cuda.empty_cache()
    return dict(case=name, slices=slice_name, kind=kind, T=T, D=D, rank=r, slots=slots,
                ranks=list(ranks) if ranks else None, frac_none=frac_none, rel_err=err,
                fused=bool(torch_triton.configs.use_fused(T, r, len(widths), slots)),
                time_us=t_us, min_bytes=nbytes, gbs=nbytes / (t_us * 1e3),
                pct_peak=100 * nbytes / (t_us * 1e3) / PEAK_GBS, floor_us=nbytes / (PEAK_GBS * 1e3),
                floor_launch_us=floor_us, n_sets=n_sets, vllm_us=vllm,
                speedup_vs_vllm=(vllm / t_us) if vllm else None, **det)


# ------------------------------------------------------------------------------------------ JAX

def jax_vs_torch(device, cases, steps=50, long_steps=200, jax_fused=None, barrier=True, donate=True):
    """Per-op time of the JAX triton backend under jit (a scan of `steps` calls) vs torch (a graph of
    `steps` calls on the same inputs). Both hot (same weights each call), so only launch and kernel
    efficiency differ.

    Two readings per side. `jax_us` / `torch_hot_us`: one program of `steps` calls, divided by
    `steps` -- JAX timed on the host (dispatch of the jitted call to block_until_ready: its fixed
    cost, tens of microseconds, is spread over the steps), torch by CUDA events around the graph
    replay (no host part). `jax_slope_us` / `torch_slope_us`: the per-call increment between
    programs of `steps` and `long_steps` calls, (t_long - t_short) / (long_steps - steps), which
    both sides measure the same way and which leaves out every fixed cost of launching and waiting
    for one program (what a serving loop of many layers per step pays once, not per op).

    barrier: each step's x goes through `lax.optimization_barrier` together with the carried y, so
    XLA can neither merge the steps' identical shrinks (x @ A does not depend on y: with
    separate shrink and expand custom calls, XLA's CSE kept one shrink for all steps -- the JAX
    figures before 2026-11-30 12:30 were measured that way) nor start a step before the previous
    one: the steps are serialised like layers, as torch's graph is. donate: y is donated and fed
    back, as a serving loop does (stable buffers, so XLA's command buffers are not re-recorded)."""
    import jax
    import jax.numpy as jnp

    from jax_lora.meta import LoRAKernelMeta as JMeta
    from jax_lora.ops import ffi_launcher
    from jax_lora.ops import triton as jax_triton_backend

    out = []
    for case, slice_name in cases:
        name, kind, T, D, r, frac_none, ranks = case
        widths = SLICES[slice_name]
        slots = max(8, D)
        gen = torch.Generator().manual_seed(1)
        s = InputSet(kind, T, D, r, widths, slots, frac_none, ranks, gen, device)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            s.call()
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
        torch_total = {n: graph_replay_us([s.call] * n) for n in (steps, long_steps)}

        def j(t):
            return jnp.from_dlpack(t.contiguous())

        x, y0 = j(s.x), j(s.y)
        a = tuple(j(t) for t in s.a)
        b = tuple(j(t) for t in s.b)
        meta = JMeta.build(j(s.idx), slots, T)
        offsets, scale = s.offsets, s.scale

        @jax.jit
        def one(y, x, a, b, meta):
            return jax_triton_backend.linear(y, x, a, b, meta, scale, offsets, fused=jax_fused)

        def program(n):
            def many(y, x, a, b, meta):
                def body(c, _):
                    xs = x
                    if barrier:
                        xs, c = jax.lax.optimization_barrier((x, c))
                    return jax_triton_backend.linear(c, xs, a, b, meta, scale, offsets, fused=jax_fused), None
                return jax.lax.scan(body, y, None, length=n, unroll=True)[0]
            return jax.jit(many, donate_argnums=(0,) if donate else ())

        y1 = one(y0, x, a, b, meta)
        ref = s.reference()
        jerr = rel_err(torch.from_dlpack(y1), ref)
        ffi = ffi_launcher.available()
        jax_total, handler_per_step = {}, None
        for n in (steps, long_steps):
            many = program(n)
            yc = many(jnp.copy(y0), x, a, b, meta)
            yc.block_until_ready()
            jt = []
            calls0 = ffi_launcher.handler_calls() if ffi else 0
            for _ in range(10):
                t0 = time.perf_counter()
                yc = many(yc if donate else y0, x, a, b, meta)
                yc.block_until_ready()
                jt.append((time.perf_counter() - t0) * 1e6)
            if n == steps:
                # FFI handler executions per step: 0 when XLA replays its command buffer, 1 when
                # each call is recorded again or launched eagerly
                handler_per_step = (ffi_launcher.handler_calls() - calls0) / (10 * n) if ffi else None
            jax_total[n] = float(np.median(jt))
            del many, yc
        dn = long_steps - steps
        jax_us, torch_us = jax_total[steps] / steps, torch_total[steps] / steps
        jax_slope = (jax_total[long_steps] - jax_total[steps]) / dn
        torch_slope = (torch_total[long_steps] - torch_total[steps]) / dn
        out.append(dict(case=name, slices=slice_name, torch_hot_us=torch_us, jax_us=jax_us,
                        ratio=jax_us / torch_us, jax_slope_us=jax_slope, torch_slope_us=torch_slope,
                        ratio_slope=jax_slope / torch_slope, steps=(steps, long_steps),
                        jax_total_us=jax_total, torch_total_us=torch_total, jax_rel_err=jerr,
                        launcher="ffi" if ffi else "jax_triton", barrier=barrier, donate=donate,
                        ffi_handler_calls_per_step=handler_per_step))
        print(f"JAX {name} {slice_name}: jax {jax_us:.2f} us torch {torch_us:.2f} us ratio {jax_us / torch_us:.2f}; "
              f"per-op slope jax {jax_slope:.2f} torch {torch_slope:.2f} ratio {jax_slope / torch_slope:.2f}; "
              f"err {jerr:.2e} handler calls/step {handler_per_step}", flush=True)
    return out


# ------------------------------------------------------------------------------------------ report

def geomean(v):
    v = [x for x in v if x]
    return float(math.exp(sum(math.log(x) for x in v) / len(v))) if v else float("nan")


def markdown(res):
    lines = ["| case | slices | time us | vLLM us | speedup | min MB | GB/s | % of 4300 | floor us | err |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in res["sweep"]:
        v = f"{r['vllm_us']:.1f}" if r["vllm_us"] else "-"
        sp = f"{r['speedup_vs_vllm']:.2f}x" if r["speedup_vs_vllm"] else "-"
        lines.append(f"| {r['case']}{' (fused)' if r['fused'] else ''} | {r['slices']} | {r['time_us']:.2f} | {v} "
                     f"| {sp} | {r['min_bytes'] / 1e6:.2f} | {r['gbs']:.0f} | {r['pct_peak']:.1f} "
                     f"| {r['floor_us']:.2f} | {r['rel_err']:.1e} |")
    s = res["summary"]
    det = [r for r in res["sweep"] if "det_us" in r]
    if det:
        lines.append("")
        lines.append("| deterministic=True | slices | default us | deterministic us | cost | err |")
        lines.append("|---|---|---|---|---|---|")
        for r in det:
            lines.append(f"| {r['case']}{' (fused)' if r['fused'] else ''} | {r['slices']} | {r['time_us']:.2f} "
                         f"| {r['det_us']:.2f} | {r['det_cost']:.2f}x | {r['det_rel_err']:.1e} |")
        lines.append("")
        lines.append(f"deterministic cost, geomean: {geomean([r['det_cost'] for r in det]):.2f}x over "
                     f"{len(det)} cases (worst {max(r['det_cost'] for r in det):.2f}x)")
    pair_ks = sorted({int(k[5:-3]) for r in res["sweep"] for k in r if k.startswith("pairs") and k.endswith("_us")})
    if pair_ks:
        lines += ["", "| adapters per token | slices | k=1 us | " + " | ".join(f"k={k} us | cost" for k in pair_ks)
                  + " | err |", "|---|---|---|" + "---|---|" * len(pair_ks) + "---|"]
        for r in res["sweep"]:
            if f"pairs{pair_ks[0]}_us" not in r:
                continue
            cols = " | ".join(f"{r[f'pairs{k}_us']:.2f} | {r[f'pairs{k}_cost']:.2f}x" for k in pair_ks)
            err = max(r[f"pairs{k}_rel_err"] for k in pair_ks)
            lines.append(f"| {r['case']}{' (fused)' if r['fused'] else ''} | {r['slices']} | {r['time_us']:.2f} "
                         f"| {cols} | {err:.1e} |")
        for k in pair_ks:
            costs = [r[f"pairs{k}_cost"] for r in res["sweep"] if f"pairs{k}_cost" in r]
            lines.append(f"\nk={k} / k=1, geomean: {geomean(costs):.2f}x over {len(costs)} cases "
                         f"(range {min(costs):.2f}x-{max(costs):.2f}x)")
    for key, title, what in (("dora", "DoRA column scale", "DoRA"), ("wrapper", "PunicaWrapper.add_lora_linear",
                                                                     "wrapper path")):
        rows = [r for r in res["sweep"] if f"{key}_us" in r]
        if not rows:
            continue
        ratio = "dora_cost" if key == "dora" else "wrapper_over_op"
        lines += ["", f"| {title} | slices | op us | {what} us | ratio | err |", "|---|---|---|---|---|---|"]
        for r in rows:
            lines.append(f"| {r['case']}{' (fused)' if r['fused'] else ''} | {r['slices']} | {r['time_us']:.2f} "
                         f"| {r[key + '_us']:.2f} | {r[ratio]:.2f}x | {r[key + '_rel_err']:.1e} |")
        lines += ["", f"{what} / op, geomean: {geomean([r[ratio] for r in rows]):.2f}x over {len(rows)} cases "
                      f"(range {min(r[ratio] for r in rows):.2f}x-{max(r[ratio] for r in rows):.2f}x)"]
    lines.append("")
    lines.append(f"geomean speedup vs vLLM: {s['geomean_speedup']:.2f}x over {s['n_vs_vllm']} cases; "
                 f"worst ratio ours/vLLM {s['worst_ratio']:.2f} ({s['worst_case']})")
    if "wrapper_geomean_speedup" in s:
        lines.append(f"PunicaWrapper.add_lora_linear vs vLLM: geomean {s['wrapper_geomean_speedup']:.2f}x, "
                     f"{s['wrapper_under_2x']} case(s) under 2x; worst ratio ours/vLLM {s['wrapper_worst_ratio']:.2f} "
                     f"({s['wrapper_worst_case']})")
    if res.get("host"):
        lines.append("")
        lines.append("| host enqueue (eager) | ops.linear us | PreparedLinear us | PunicaWrapper.add_lora_linear us |")
        lines.append("|---|---|---|---|")
        nan = float("nan")
        for h in res["host"]:
            lines.append(f"| {h['case']} {h['slices']} | {h['host_us']:.1f} | {h.get('prepared_host_us', nan):.1f} "
                         f"| {h.get('wrapper_host_us', nan):.1f} |")
    if res.get("jax"):
        lines.append("")
        lines.append("| JAX vs torch (hot, per op) | slices | jax us | torch us | ratio | jax slope us "
                     "| torch slope us | slope ratio | jax err |")
        lines.append("|---|---|---|---|---|---|---|---|---|")
        for j in res["jax"]:
            slope = (f"{j['jax_slope_us']:.2f} | {j['torch_slope_us']:.2f} | {j['ratio_slope']:.2f}"
                     if "jax_slope_us" in j else "- | - | -")
            lines.append(f"| {j['case']} | {j['slices']} | {j['jax_us']:.2f} | {j['torch_hot_us']:.2f} "
                         f"| {j['ratio']:.2f} | {slope} | {j['jax_rel_err']:.1e} |")
        lines.append("")
        lines.append("jax / torch us: one program of 50 calls / 50 (JAX: host-timed dispatch to ready; torch: "
                     "CUDA events around the graph replay). slope: per-call increment from 50 to 200 calls, "
                     "both sides, fixed costs of one program left out.")
    return "\n".join(lines) + "\n"


def plot(res, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(8, 5.5))
    mb = np.logspace(-2, 3, 200)
    ax.plot(mb, np.maximum(mb * 1e6 / (PEAK_GBS * 1e3), 0.0), "k--", lw=1, label="bytes / 4300 GB/s")
    ax.axhline(LAUNCH_US, color="gray", lw=0.8, ls=":", label="~launch floor (2 us)")
    for sl, mk in (("s1", "o"), ("s3", "s")):
        pts = [r for r in res["sweep"] if r["slices"] == sl]
        ax.scatter([r["min_bytes"] / 1e6 for r in pts], [r["time_us"] for r in pts], marker=mk, c="C0",
                   label=f"ours {sl}")
        vp = [r for r in pts if r["vllm_us"]]
        ax.scatter([r["min_bytes"] / 1e6 for r in vp], [r["vllm_us"] for r in vp], marker=mk, facecolors="none",
                   edgecolors="C3", label=f"vLLM 0.33 {sl}")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("minimal bytes per add_lora_linear (MB)")
    ax.set_ylabel("time per call, CUDA-graph replay (us)")
    ax.set_title(f"multi-LoRA add_lora_linear on {res['meta']['device']} (bf16, H=4096)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def host_cpu() -> str:
    """The host CPU's model name: host-time figures differ up to 2x between machines of one kind."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


_SOURCE_DIRS = ("lora_core", "jax_lora", "torch_lora", "bridge", "benchmarks")
_SOURCE_EXTS = (".py", ".c", ".json")


def source_digest(root: str | None = None) -> str:
    """sha256 (16 hex digits) of the library and benchmark sources (paths and bytes, sorted): names
    the tree a result came from even where .git is stale (the device machine's copy). Compare with
    `python benchmarks/bench_triton.py --digest` on a checkout."""
    import hashlib
    root = root or os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    h = hashlib.sha256()
    files = []
    for d in _SOURCE_DIRS:
        for base, dirs, names in os.walk(os.path.join(root, d)):
            dirs[:] = sorted(x for x in dirs if x not in ("results", "__pycache__"))
            files += [os.path.join(base, n) for n in names if n.endswith(_SOURCE_EXTS)]
    for f in sorted(files):
        h.update(os.path.relpath(f, root).encode() + b"\0")
        with open(f, "rb") as fh:
            h.update(fh.read() + b"\0")
    return h.hexdigest()[:16]


def git_commit() -> str:
    """The tree's commit: $GIT_COMMIT first (the device machine's copy of the tree may carry a stale
    .git), else `git rev-parse HEAD` of this checkout, else "unknown"."""
    commit = os.environ.get("GIT_COMMIT")
    if commit:
        return commit
    try:
        return subprocess.check_output(["git", "rev-parse", "HEAD"], text=True, stderr=subprocess.DEVNULL,
                                       cwd=os.path.dirname(os.path.abspath(__file__))).strip()
    except Exception:
        return "unknown"


def kernel_bench_meta(cuda: bool, **extra) -> dict:
    """The provenance of a kernel benchmark's results (date, device, torch, Triton, Python, commit,
    source digest, host CPU), with `extra` keys; cuda=False names the CPU and Triton's interpreter."""
    import triton
    return dict(date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                device=torch.cuda.get_device_name() if cuda else f"CPU (Triton interpreter, {host_cpu()})",
                torch=torch.__version__, triton=triton.__version__, python=platform.python_version(),
                commit=git_commit(), source_digest=source_digest(), host_cpu=host_cpu(), **extra)


def env_meta():
    commit = git_commit()
    import triton
    meta = dict(date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                python=platform.python_version(), commit=commit, source_digest=source_digest(),
                host_cpu=host_cpu())
    from importlib import metadata
    for pkg in ("jax", "jax-triton"):
        with contextlib.suppress(Exception):
            meta[pkg] = metadata.version(pkg)
    from lora_core.kernels import configs
    meta["configs"] = configs.current_table().source
    return meta


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="benchmarks/results")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--no-jax", action="store_true")
    p.add_argument("--tag", default="")
    p.add_argument("--profile-host", action="store_true", help="cProfile of eager calls, top entries")
    p.add_argument("--host-only", action="store_true", help="no graph sweep: host enqueue figures (and jax)")
    p.add_argument("--no-host", action="store_true", help="no host enqueue figures")
    p.add_argument("--cases", default=None, help="regex: only the sweep cases whose name matches")
    p.add_argument("--digest", action="store_true", help="print the sources' digest (meta.source_digest) and exit")
    p.add_argument("--wrapper-graph", action="store_true",
                   help="also time every sweep case through PunicaWrapper.add_lora_linear in the same graphs "
                        "(wrapper_us, wrapper_over_op: the wrapper path against the op)")
    p.add_argument("--dora", action="store_true",
                   help="also time every sweep case with a DoRA column scale on every slice (dora_us, dora_cost)")
    p.add_argument("--pairs", default="2,4",
                   help="comma list of adapters per token k also timed on every case (pairs{k}_us); '' for none")
    p.add_argument("--lora-dtype", choices=("bf16", "fp8"), default="bf16",
                   help="fp8: the sweep with fp8 (e4m3) adapter weights, ours fp8 vs ours bf16 vs vLLM's fp8 "
                        "kernels (see the module docstring)")
    p.add_argument("--deterministic", action="store_true",
                   help="also time every sweep case with deterministic=True (batch-invariant launches), "
                        "reported beside the default as det_us and det_cost")
    args = p.parse_args()
    if args.digest:
        print(source_digest())
        return
    device = torch.device("cuda")
    torch.backends.cuda.matmul.allow_tf32 = False
    res = dict(meta=env_meta(), sweep=[], host=[], jax=[])
    cases = sweep_cases(args.quick)
    if args.cases:
        import re
        cases = [c for c in cases if re.search(args.cases, c[0])]
    if args.profile_host:
        import cProfile
        import pstats
        s = WrapperCall(InputSet("dec", 8, 8, 16, SLICES["s3"], 8, 0.0, None, torch.Generator().manual_seed(3),
                                 device), SLICES["s3"])
        for _ in range(50):
            s.call()
        torch.cuda.synchronize()
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(500):
            s.call()
        prof.disable()
        torch.cuda.synchronize()
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "host_profile.txt"), "w") as f:
            pstats.Stats(prof, stream=f).sort_stats("tottime").print_stats(30)
        with open(os.path.join(args.out, "host_profile.txt")) as f:
            print(f.read()[:6000])
        print(host_breakdown(s.s), flush=True)
    os.makedirs(args.out, exist_ok=True)
    if args.lora_dtype == "fp8":
        run_fp8_sweep(args, cases, device, res)
        return
    partial = os.path.join(args.out, f"triton_h200_partial{args.tag}.json")
    for case in [] if args.host_only else cases:
        for sl in ("s1", "s3"):
            r = run_case(case, sl, device, deterministic=args.deterministic, wrapper_graph=args.wrapper_graph,
                         dora=args.dora, pairs=tuple(int(k) for k in args.pairs.split(",") if k.strip()))
            res["sweep"].append(r)
            with open(partial, "w") as f:          # what a run cut short leaves (the sweep so far)
                json.dump(res, f, indent=1)
            v = f"vLLM {r['vllm_us']:.1f}" if r["vllm_us"] else ""
            d = (f" deterministic {r['det_us']:8.2f} us ({r['det_cost']:.2f}x, err {r['det_rel_err']:.1e})"
                 if "det_us" in r else "")
            d += (f" wrapper {r['wrapper_us']:8.2f} us ({r['wrapper_over_op']:.2f}x, err {r['wrapper_rel_err']:.1e})"
                  if "wrapper_us" in r else "")
            d += (f" dora {r['dora_us']:8.2f} us ({r['dora_cost']:.2f}x, err {r['dora_rel_err']:.1e})"
                  if "dora_us" in r else "")
            d += "".join(f" k={k[5:-3]} {r[k]:8.2f} us ({r[k[:-3] + '_cost']:.2f}x)" for k in r
                         if k.startswith("pairs") and k.endswith("_us"))
            print(f"{r['case']:28s} {sl} {r['time_us']:8.2f} us {r['pct_peak']:5.1f}% err {r['rel_err']:.1e} "
                  f"{v}{d}", flush=True)
    for case in [] if args.no_host else [c for c in cases if c[0] in ("dec T8 D8 r64", "dec T8 D1 r16",
                                                                      "pre T2048 D4 r16")]:
        for sl in ("s1", "s3"):
            name, kind, T, D, r, fn, rk = case
            s = InputSet(kind, T, D, r, SLICES[sl], max(8, D), fn, rk, torch.Generator().manual_seed(2), device)
            h = host_time_us(s)
            prepared = torch_triton.PreparedLinear(s.a, s.b, s.meta.meta_args(T), s.offsets)
            hp = _host_us(lambda: prepared(s.y, s.x, s.scale, s.ranks), 300)
            wc = WrapperCall(s, SLICES[sl])
            yw = s.y.clone()
            ref = s.reference()
            wc.call(yw)
            torch.cuda.synchronize()
            hw = host_time_us(wc)
            direct = all(p._steps is not None for plan in wc.w._plans.values() for p in plan.prepared.values())
            res["host"].append(dict(case=name, slices=sl, host_us=h, prepared_host_us=hp, wrapper_host_us=hw,
                                    wrapper_rel_err=rel_err(yw, ref), wrapper_direct_launch=direct))
            print(f"host {name} {sl}: ops.linear {h:.1f} us, PreparedLinear {hp:.1f} us, "
                  f"PunicaWrapper.add_lora_linear {hw:.1f} us (err {rel_err(yw, ref):.1e}, direct {direct})",
                  flush=True)
    if not args.no_jax:
        try:
            jc = [c for c in cases if c[0] in ("dec T8 D8 r64", "dec T1 D1 r16", "dec T128 D64 r64",
                                               "pre T8192 D4 r64")]
            res["jax"] = jax_vs_torch(device, [(c, sl) for c in jc for sl in ("s1", "s3")])
        except Exception as e:
            import traceback
            traceback.print_exc()
            res["jax_error"] = repr(e)
    vs = [r for r in res["sweep"] if r["vllm_us"]]
    worst = max(vs, key=lambda r: r["time_us"] / r["vllm_us"]) if vs else None
    res["summary"] = dict(geomean_speedup=geomean([r["speedup_vs_vllm"] for r in vs]), n_vs_vllm=len(vs),
                          worst_ratio=(worst["time_us"] / worst["vllm_us"]) if worst else float("nan"),
                          worst_case=f"{worst['case']} {worst['slices']}" if worst else "")
    wv = [r for r in vs if r.get("wrapper_us")]
    if wv:
        # the public path (PunicaWrapper.add_lora_linear, its C launcher) against vLLM
        ww = max(wv, key=lambda r: r["wrapper_us"] / r["vllm_us"])
        res["summary"].update(wrapper_geomean_speedup=geomean([r["vllm_us"] / r["wrapper_us"] for r in wv]),
                              wrapper_worst_ratio=ww["wrapper_us"] / ww["vllm_us"],
                              wrapper_worst_case=f"{ww['case']} {ww['slices']}",
                              wrapper_under_2x=sum(r["vllm_us"] / r["wrapper_us"] < 2 for r in wv))
    os.makedirs(args.out, exist_ok=True)
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M")
    base = os.path.join(args.out, f"triton_h200_{stamp}{args.tag}")
    with open(base + ".json", "w") as f:
        json.dump(res, f, indent=1)
    if os.path.exists(partial):
        os.remove(partial)
    md = markdown(res)
    with open(base + ".md", "w") as f:
        f.write(f"run {res['meta']}\n\n" + md)
    try:
        plot(res, base + ".png")
    except Exception as e:
        print("plot failed:", e)
    print(md)


def run_fp8_sweep(args, cases, device, res) -> None:
    """--lora-dtype fp8: `run_fp8_case` over the cases and both slice sets; JSON + markdown."""
    import vllm_kernels
    vk = vllm_kernels.load()
    mode = vllm_kernels.FP8_MODE if vk is not None else "absent: run benchmarks/fetch_vllm_kernels.sh"
    res["meta"]["vllm_fp8_mode"] = mode
    print(f"vLLM fp8 side: {mode}", flush=True)
    # vLLM 0.33's fp8 expand over three slices returns inf (dec T8 D8 r16) and then faults with an
    # illegal memory access (dec T8 D8 r64) on the H200, which ends the process's CUDA context: its
    # three-slice calls are not made, and the run says so.
    res["meta"]["vllm_fp8_three_slices"] = "not run: vLLM 0.33's fp8 expand over three slices gave inf / an " \
                                           "illegal memory access on the H200"
    partial = os.path.join(args.out, f"triton_h200_fp8_partial{args.tag}.json")
    os.makedirs(args.out, exist_ok=True)
    t0 = time.perf_counter()
    for case in cases:
        for sl in ("s1", "s3"):
            r = run_fp8_case(case, sl, device, vk if sl == "s1" else None)
            res["sweep"].append(r)
            with open(partial, "w") as f:          # what a run cut short leaves (the sweep so far)
                json.dump(res, f, indent=1)
            v = (f" vLLM fp8 {r['vllm_fp8_us']:8.2f} us (err {r['vllm_fp8_rel_err']:.1e})"
                 if r.get("vllm_fp8_us") else "")
            print(f"{r['case']:28s} {sl} bf16 {r['time_us']:8.2f} us  fp8 {r['fp8_us']:8.2f} us "
                  f"({r['fp8_over_bf16']:.2f}x, err {r['fp8_rel_err']:.1e}, vs bf16 weights "
                  f"{r['fp8_vs_bf16_err']:.1e}){v}", flush=True)
    res["meta"]["fp8_sweep_seconds"] = time.perf_counter() - t0
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M")
    base = os.path.join(args.out, f"triton_h200_fp8_{stamp}{args.tag}")
    with open(base + ".json", "w") as f:
        json.dump(res, f, indent=1)
    if os.path.exists(partial):
        os.remove(partial)
    md = fp8_markdown(res)
    with open(base + ".md", "w") as f:
        f.write(f"run {res['meta']}\n\n" + md)
    print(md)


if __name__ == "__main__":
    main()
