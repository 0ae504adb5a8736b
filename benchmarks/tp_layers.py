"""Tensor-parallel multi-LoRA layers: the LoRA'd projections of a Llama-3-8B layer split over n devices.

    PYTHONPATH=. python benchmarks/tp_layers.py --tp 1,2,4 --out benchmarks/results   # GPUs (NCCL / XLA)
    PYTHONPATH=. python benchmarks/tp_layers.py --smoke --tp 1,2 --out /tmp/tp         # CPU: host devices, gloo

What an engine runs at tensor parallelism n for the four LoRA'd linears of each decoder layer,
chained as in the model (attention, norms and embeddings left out): h (B, 4096) replicated ->
qkv (column-parallel: q 4096, k 1024, v 1024) -> the local q columns -> o (row-parallel: the base
layer's all-reduce) + h -> gate_up (column-parallel, 2 x 14336) -> silu(gate) * up -> down
(row-parallel, all-reduced) + h, repeated over `--layers` layers (32: the weights of each layer are
read cold, 435 MB per layer at n = 1). Decode: B tokens, one per request, `--adapters` distinct
adapters of rank `--rank` in `--slots` slots. Each framework runs in a child process:

  * JAX: `jax_lora.nn.MultiLoRALinear` layers split by `jax_lora.parallel.shard_layer` (column
    layers `column` or `column_gather`, row layers `row_reduce` or `row_partial`), the chain under
    one `jax.jit` (a `fori_loop` over the layers), timed on the host to `block_until_ready`.
  * torch: one process per device (NCCL; gloo with --smoke), `torch_lora.parallel`'s
    QKV / MergedColumn / Row layers over this rank's base shards (the row base layers all-reduce
    their own output), `fully_sharded` False or True; the chain captured in one CUDA graph per
    batch (eager with --smoke), timed with CUDA events on rank 0.

Base and LoRA chains alternate (base, LoRA, base, ...); medians of `--steps`. Reported per
framework, n, layout set and batch: base us and LoRA us per layer, the overhead and its share of
the base; and per layer, the LoRA bytes a device reads (adapter weights of the active adapters)
and sends (the LoRA's own collectives, ring algorithms), by each side's byte model
(`jax_lora.parallel.layer_bytes`; torch: the layers' `layout_costs`, whose replicated row layer
reads all of B and all-reduces the rank buffer) and, from `layer_bytes`, for vLLM's layouts (its
default layers: A whole / B split for column layers, A split / B whole with the partial LoRA
output added before the base all-reduce for row layers, i.e. our `column` and `row_partial`;
`fully_sharded_loras`: our `column_gather` and `row_reduce`). Nothing is checked here: that the
split layers equal the unsplit ones is the tests' (tests/test_parallel*.py, and on GPUs
tests/test_gpu_parallel_torch.py).
With --model, JAX also times the decode step of the whole Llama-3-8B-shaped model of
benchmarks/e2e_decode.py split by `LlamaForCausalLM.shard` (rows "jax model step": time per
step, not per layer). The target: the LoRA overhead fraction at n = 2 no more than at
n = 1.

With --smoke the model is tiny and float32 on CPU host devices (JAX) and gloo processes (torch):
it checks the pipeline, not the times. Output: `tp_<device>_<time>.{json,md}`.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import math
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

# (hidden, q width, kv width, intermediate) of the measured model and of --smoke
SIZES = {"llama3-8b": (4096, 4096, 1024, 14336), "smoke": (64, 64, 32, 128)}
# our layout sets: column layers, row layers (JAX names; torch: fully_sharded False / True)
LAYOUT_SETS = {"replicated": ("column", "row_reduce"), "fully_sharded": ("column_gather", "row_reduce"),
               "partial": ("column", "row_partial")}
TORCH_LAYOUT_SETS = {"replicated": False, "fully_sharded": True}
VLLM_LAYOUTS = {"vLLM": ("column", "row_partial"), "vLLM fully_sharded": ("column_gather", "row_reduce")}


def projections(sizes) -> dict:
    """{name: (kind, input width, output slices)} of a layer's four LoRA'd linears."""
    h, q, kv, i = sizes
    return {"qkv": ("column", h, (q, kv, kv)), "o": ("row", q, (h,)), "gate_up": ("column", h, (i, i)),
            "down": ("row", i, (h,))}


def lora_bytes(sizes, layouts, *, tokens: int, adapters: int, rank: int, shards: int, itemsize: int = 2) -> dict:
    """Per device and layer: {"read": adapter weight bytes, "sent": bytes sent by the LoRA's own
    collectives} of the four linears in `layouts` (column layout, row layout)."""
    from jax_lora.parallel_layouts import layer_bytes
    read = sent = 0
    for kind, inp, slices in projections(sizes).values():
        layout = layouts[0] if kind == "column" else layouts[1]
        b = layer_bytes(kind, layout, tokens=tokens, active=adapters, slices=slices, in_features=inp, rank=rank,
                        shards=shards, itemsize=itemsize)
        read += b.weights
        sent += b.received
    return {"read": read, "sent": sent}


# ------------------------------------------------------------------------------------------ JAX

def run_jax(args) -> list:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx
    from jax.sharding import Mesh

    from jax_lora import LoRAMapping, PunicaWrapper, parallel
    from jax_lora import nn as lnn

    sizes = SIZES["smoke" if args.smoke else "llama3-8b"]
    dtype = jnp.float32 if args.smoke else jnp.bfloat16
    backend = "xla" if args.smoke else "triton"
    devices = jax.devices()
    rows = []
    rng = np.random.default_rng(0)
    for n in args.tp:
        if n > len(devices):
            print(f"jax: skipping tp={n}: {len(devices)} devices", flush=True)
            continue
        mesh = Mesh(np.array(devices[:n]), ("tp",))
        for set_name in args.layout_sets:
            col_layout, row_layout = LAYOUT_SETS[set_name]
            layers = {}
            for name, (kind, inp, slices) in projections(sizes).items():
                base = nnx.Linear(inp, sum(slices), use_bias=False, dtype=dtype, param_dtype=dtype,
                                  rngs=nnx.Rngs(int(rng.integers(1 << 30))))
                layer = lnn.MultiLoRALinear(base, max_loras=args.slots, max_rank=args.rank,
                                            output_slices=slices if len(slices) > 1 else None)
                a_shape, b_shape = layer.lora_a.get_value().shape, layer.lora_b.get_value().shape
                key = jax.random.key(int(rng.integers(1 << 30)))
                ka, kb = jax.random.split(key)
                layer.lora_a.set_value((jax.random.normal(ka, a_shape, jnp.float32) / math.sqrt(inp)).astype(dtype))
                layer.lora_b.set_value((jax.random.normal(kb, b_shape, jnp.float32) / math.sqrt(args.rank))
                                       .astype(dtype))
                layer.lora_ranks.set_value(jnp.full((args.slots,), args.rank, jnp.int32))
                parallel.shard_layer(layer, mesh, kind=kind, layout=col_layout if kind == "column" else row_layout)
                layers[name] = layer
            graphdef, state = nnx.split(layers)
            widths = {name: s for name, (_, _, s) in projections(sizes).items()}

            def chain(state, h, punica, use_lora, graphdef=graphdef, widths=widths, n=n):
                mods = nnx.merge(graphdef, state)

                def one_layer(_, h):
                    with lnn.punica_context(punica if use_lora else None):
                        q, _k, _v = parallel.split_fused(mods["qkv"](h), widths["qkv"], n)
                        h = h + mods["o"](q)
                        gate, up = parallel.split_fused(mods["gate_up"](h), widths["gate_up"], n)
                        h = h + mods["down"](jax.nn.silu(gate) * up)
                    return h * 0.5
                return jax.lax.fori_loop(0, args.layers, one_layer, h)

            step = jax.jit(chain, static_argnums=(3,))
            for batch in args.batches:
                punica = PunicaWrapper(max(args.batches), max(args.batches), None, max_loras=args.slots,
                                       backend=backend)
                slots = rng.permutation(args.slots)[: min(args.adapters, batch)]
                ids = [int(s) + 1 for s in slots[np.arange(batch) % len(slots)]]
                punica.update_metadata(LoRAMapping(ids, ids), list(range(1, args.slots + 1)), args.slots + 1, 32000)
                h = jnp.asarray(rng.standard_normal((batch, sizes[0]), np.float32), dtype)
                times = {False: [], True: []}
                for use_lora in (False, True):
                    step(state, h, punica, use_lora).block_until_ready()        # compile, warm
                for _ in range(args.steps):
                    for use_lora in (False, True):
                        t0 = time.perf_counter()
                        step(state, h, punica, use_lora).block_until_ready()
                        times[use_lora].append((time.perf_counter() - t0) * 1e6 / args.layers)
                moved = lora_bytes(sizes, (col_layout, row_layout), tokens=batch, adapters=min(args.adapters, batch),
                                   rank=args.rank, shards=n, itemsize=jnp.dtype(dtype).itemsize)
                rows.append(_row("jax", n, set_name, (col_layout, row_layout), batch, times, args, moved))
                print(_line(rows[-1]), flush=True)
    return rows


def run_jax_model(args) -> list:
    """The decode step of the whole Llama-3-8B-shaped model of benchmarks/e2e_decode.py (random bf16
    weights, LoRA on its 7 projections in 32 slots at --rank), split by `LlamaForCausalLM.shard`
    over n devices (its default layouts; KV caches split along the KV heads), base step against
    LoRA step, per batch with --adapters distinct adapters: time per step on the host to
    `block_until_ready` (as e2e_decode's JAX rows)."""
    import e2e_decode as e2e
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh

    from jax_lora import LoRAMapping, PunicaWrapper
    from jax_lora.models import llama

    cfg = e2e.model_config(args.smoke)
    dtype = jnp.bfloat16
    max_len = 64 if args.smoke else 1024
    devices = jax.devices()
    rows = []
    for n in args.tp:
        if n > len(devices):
            continue
        jm = e2e.JaxModel(cfg, seed=n)
        jm.set_rank(args.rank)
        jm.model.shard(Mesh(np.array(devices[:n]), ("tp",)))
        key, lora_leaves, rest, empty = jm.states()
        step = jax.jit(functools.partial(e2e._jax_step, *key), static_argnums=(8,), donate_argnums=(2,))
        for batch in args.batches:
            rng = np.random.default_rng(batch)
            punica = PunicaWrapper(max(args.batches), max(args.batches), None, max_loras=e2e.NUM_SLOTS,
                                   backend="xla" if args.smoke else "triton")
            slots = rng.permutation(e2e.NUM_SLOTS)[: min(args.adapters, batch)]
            ids = [int(s) + 1 for s in slots[np.arange(batch) % len(slots)]]
            punica.update_metadata(LoRAMapping(ids, ids), list(range(1, e2e.NUM_SLOTS + 1)), e2e.NUM_SLOTS + 1,
                                   cfg.vocab_size)
            cache = llama.init_cache(cfg, batch, max_len, dtype, sharding=jm.model.cache_sharding())
            tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, (batch, 1)), jnp.int32)
            positions = jnp.full((batch, 1), max_len // 2, jnp.int32)
            sample_idx = jnp.zeros((batch,), jnp.int32)
            calls = {False: (empty, None), True: (lora_leaves, punica)}
            times = {False: [], True: []}
            for rep in range(args.steps + 1):                       # the first round compiles and warms
                for use_lora in (False, True):
                    t0 = time.perf_counter()
                    cache, tok, _ = step(calls[use_lora][0], rest, cache, calls[use_lora][1], tokens, positions,
                                         None, sample_idx, use_lora)
                    tok.block_until_ready()
                    if rep:
                        times[use_lora].append((time.perf_counter() - t0) * 1e6)
            base, lora = statistics.median(times[False]), statistics.median(times[True])
            rows.append(dict(framework="jax model step", tp=n, layouts="model default", column_layout=None,
                             row_layout=None, batch=batch, adapters=min(args.adapters, batch), rank=args.rank,
                             base_us=base, lora_us=lora, overhead_us=lora - base,
                             overhead_pct=100.0 * (lora - base) / base, bytes=None))
            print(f"jax model step tp={n} B{batch:<4d} base {base:9.1f} us LoRA {lora:9.1f} us overhead "
                  f"{lora - base:8.1f} us ({100.0 * (lora - base) / base:5.1f}%)", flush=True)
            del cache
        del jm, lora_leaves, rest, empty, step
    return rows


# ------------------------------------------------------------------------------------------ torch

def _torch_rank(rank: int, world: int, port: int, args, out_path: str) -> None:
    import datetime as dt

    import numpy as np
    import torch
    import torch.distributed as dist

    import torch_lora
    from lora_core.host_mapping import LoRAMapping
    from torch_lora.parallel import (
        MergedColumnParallelLinearWithLoRA,
        QKVParallelLinearWithLoRA,
        RowParallelLinearWithLoRA,
    )

    class RowBase(torch.nn.Module):
        """A row-parallel base layer: this rank's input columns, the full output all-reduced."""

        def __init__(self, linear):
            super().__init__()
            self.linear = linear

        def forward(self, x):
            y = self.linear(x)
            dist.all_reduce(y)
            return y

    smoke = args.smoke
    backend = "gloo" if smoke else "nccl"
    device = torch.device("cpu") if smoke else torch.device("cuda", rank)
    if not smoke:
        torch.cuda.set_device(device)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=dt.timedelta(seconds=300))
    try:
        h_size, q, kv, inter = SIZES["smoke" if smoke else "llama3-8b"]
        dtype = torch.float32 if smoke else torch.bfloat16
        head = 16 if smoke else 128
        gen = torch.Generator().manual_seed(1234)     # the same full factors on every rank
        rows = []
        for set_name in args.layout_sets:
            if set_name not in TORCH_LAYOUT_SETS:
                continue
            fully = TORCH_LAYOUT_SETS[set_name]

            def linear(i, o):
                lin = torch.nn.Linear(i, o, bias=False, dtype=dtype, device=device)
                with torch.no_grad():
                    lin.weight.normal_(0.0, 1.0 / math.sqrt(i))
                return lin
            q_local, kv_local = q // world, max(kv // head // world, 1) * head     # vLLM's QKV shard widths
            qkv = QKVParallelLinearWithLoRA(linear(h_size, q_local + 2 * kv_local), input_size=h_size,
                                            num_heads=q // head, num_kv_heads=kv // head, head_size=head,
                                            max_loras=args.slots, max_rank=args.rank, fully_sharded=fully)
            o = RowParallelLinearWithLoRA(RowBase(linear(q // world, h_size)), input_size=q, output_size=h_size,
                                          max_loras=args.slots, max_rank=args.rank, fully_sharded=fully)
            gate_up = MergedColumnParallelLinearWithLoRA(linear(h_size, 2 * inter // world), input_size=h_size,
                                                         output_sizes=(inter, inter), max_loras=args.slots,
                                                         max_rank=args.rank, fully_sharded=fully)
            down = RowParallelLinearWithLoRA(RowBase(linear(inter // world, h_size)), input_size=inter,
                                             output_size=h_size, max_loras=args.slots, max_rank=args.rank,
                                             fully_sharded=fully)
            for slot in range(args.slots):
                for layer, inp, outs in ((qkv, h_size, (q, kv, kv)), (o, q, (h_size,)),
                                         (gate_up, h_size, (inter, inter)), (down, inter, (h_size,))):
                    a = [torch.randn(args.rank, inp, generator=gen) / math.sqrt(inp) for _ in outs]
                    b = [torch.randn(n, args.rank, generator=gen) / math.sqrt(args.rank) for n in outs]
                    layer.set_lora(slot, a if len(outs) > 1 else a[0], b if len(outs) > 1 else b[0])
            for batch in args.batches:
                punica = torch_lora.PunicaWrapper(max(args.batches), max(args.batches), device,
                                                  max_loras=args.slots, backend="torch" if smoke else "triton")
                rng = np.random.default_rng(batch)
                slots = rng.permutation(args.slots)[: min(args.adapters, batch)]
                ids = [int(s) + 1 for s in slots[np.arange(batch) % len(slots)]]
                punica.update_metadata(LoRAMapping(ids, ids), list(range(1, args.slots + 1)), args.slots + 1, 32000)
                h0 = torch.randn(batch, h_size, generator=gen).to(device=device, dtype=dtype)

                def chain(use_lora, h0=h0, punica=punica):
                    for layer in (qkv, o, gate_up, down):
                        layer.set_mapping(punica if use_lora else None)
                    h = h0
                    for _ in range(args.layers):
                        x = qkv(h)
                        h = h + o(x[:, :q_local].contiguous())
                        g = gate_up(h)
                        half = g.shape[1] // 2
                        h = (h + down(torch.nn.functional.silu(g[:, :half]) * g[:, half:])) * 0.5
                    return h
                times = {False: [], True: []}
                if smoke:
                    for _ in range(args.steps):
                        for use_lora in (False, True):
                            t0 = time.perf_counter()
                            chain(use_lora)
                            times[use_lora].append((time.perf_counter() - t0) * 1e6 / args.layers)
                else:
                    graphs = {}
                    for use_lora in (False, True):
                        s = torch.cuda.Stream()
                        s.wait_stream(torch.cuda.current_stream())
                        with torch.cuda.stream(s):
                            chain(use_lora)                            # compile, plan, warm
                        torch.cuda.current_stream().wait_stream(s)
                        g = torch.cuda.CUDAGraph()
                        with torch.cuda.graph(g):
                            chain(use_lora)
                        graphs[use_lora] = g
                    for use_lora in (False, True):
                        graphs[use_lora].replay()
                    torch.cuda.synchronize()
                    for _ in range(args.steps):
                        for use_lora in (False, True):
                            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                            dist.barrier()
                            start.record()
                            graphs[use_lora].replay()
                            end.record()
                            end.synchronize()
                            times[use_lora].append(start.elapsed_time(end) * 1e3 / args.layers)
                    del graphs
                costs = [layer.layout_costs(batch, min(args.adapters, batch))[layer.layout]
                         for layer in (qkv, o, gate_up, down)]
                moved = {"read": sum(c.weight_bytes for c in costs), "sent": sum(c.link_bytes for c in costs)}
                rows.append(_row("torch", world, set_name, (qkv.layout, o.layout), batch, times, args, moved))
                if rank == 0:
                    print(_line(rows[-1]), flush=True)
        if rank == 0:
            with open(out_path, "w") as f:
                json.dump(rows, f)
    finally:
        dist.destroy_process_group()


def run_torch(args) -> list:
    import socket

    import torch
    import torch.multiprocessing as mp
    rows = []
    available = os.cpu_count() if args.smoke else torch.cuda.device_count()
    for n in args.tp:
        if n > available:
            print(f"torch: skipping tp={n}: {available} devices", flush=True)
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        out_path = os.path.join(args.tmp, f"torch_tp{n}.json")
        mp.spawn(_torch_rank, args=(n, port, args, out_path), nprocs=n, join=True)
        with open(out_path) as f:
            rows += json.load(f)
    return rows


# ------------------------------------------------------------------------------------------ report

def _row(framework, n, set_name, layouts, batch, times, args, moved) -> dict:
    """One result row; moved: {"read", "sent"} LoRA bytes per device and layer."""
    base, lora = statistics.median(times[False]), statistics.median(times[True])
    return dict(framework=framework, tp=n, layouts=set_name, column_layout=layouts[0], row_layout=layouts[1],
                batch=batch, adapters=min(args.adapters, batch), rank=args.rank, base_us=base, lora_us=lora,
                overhead_us=lora - base, overhead_pct=100.0 * (lora - base) / base, bytes=moved)


def _line(r) -> str:
    return (f"{r['framework']:5s} tp={r['tp']} {r['layouts']:13s} B{r['batch']:<4d} base {r['base_us']:9.1f} us "
            f"LoRA {r['lora_us']:9.1f} us overhead {r['overhead_us']:8.1f} us ({r['overhead_pct']:5.1f}%) "
            f"read {r['bytes']['read'] / 1e6:6.2f} MB sent {r['bytes']['sent'] / 1e3:6.1f} kB per layer")


def vllm_rows(args, sizes) -> list:
    """vLLM's layouts' LoRA bytes per device and layer, from their shapes (no time)."""
    out = []
    for n in args.tp:
        for name, layouts in VLLM_LAYOUTS.items():
            for batch in args.batches:
                out.append(dict(layouts=name, tp=n, batch=batch,
                                bytes=lora_bytes(sizes, layouts, tokens=batch, adapters=min(args.adapters, batch),
                                                 rank=args.rank, shards=n, itemsize=4 if args.smoke else 2)))
    return out


def markdown(rows, vllm) -> str:
    lines = ["| framework | TP | layouts | batch | base us/layer (model: /step) | LoRA us | overhead | "
             "LoRA read MB/layer | "
             "LoRA sent kB/layer |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        moved = r["bytes"] or {}
        read = f"{moved['read'] / 1e6:.2f}" if moved else "-"
        sent = f"{moved['sent'] / 1e3:.1f}" if moved else "-"
        lines.append(f"| {r['framework']} | {r['tp']} | {r['layouts']} | {r['batch']} | {r['base_us']:.1f} | "
                     f"{r['lora_us']:.1f} | {r['overhead_us']:.1f} us ({r['overhead_pct']:.1f}%) | {read} | {sent} |")
    lines += ["", "| vLLM layouts (bytes from shapes) | TP | batch | LoRA read MB/layer | LoRA sent kB/layer |",
              "|---|---|---|---|---|"]
    for r in vllm:
        lines.append(f"| {r['layouts']} | {r['tp']} | {r['batch']} | {r['bytes']['read'] / 1e6:.2f} | "
                     f"{r['bytes']['sent'] / 1e3:.1f} |")
    return "\n".join(lines) + "\n"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="benchmarks/results")
    p.add_argument("--tp", default="1,2", help="tensor-parallel degrees, e.g. 1,2,4")
    p.add_argument("--batches", default="8,32,128")
    p.add_argument("--adapters", type=int, default=8)
    p.add_argument("--slots", type=int, default=8)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--frameworks", default="jax,torch")
    p.add_argument("--layout-sets", default="replicated,fully_sharded",
                   help=f"comma list of {sorted(LAYOUT_SETS)} (torch: replicated, fully_sharded)")
    p.add_argument("--smoke", action="store_true", help="CPU: tiny float32 layers, host devices / gloo")
    p.add_argument("--model", action="store_true",
                   help="JAX: also the decode step of the whole Llama-3-8B-shaped model split over n devices")
    p.add_argument("--child", choices=("jax", "torch"), help=argparse.SUPPRESS)
    p.add_argument("--tmp", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.tp = [int(v) for v in args.tp.split(",") if v]
    args.batches = [int(v) for v in args.batches.split(",") if v]
    args.layout_sets = [v for v in args.layout_sets.split(",") if v]
    bad = [v for v in args.layout_sets if v not in LAYOUT_SETS]
    if bad or not args.tp or min(args.tp) < 1 or not args.batches or min(args.batches) < 1:
        p.error(f"--tp and --batches need positive ints, --layout-sets names from {sorted(LAYOUT_SETS)}; got "
                f"{args.tp}, {args.batches}, {bad}")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.child:
        rows = (run_jax(args) + (run_jax_model(args) if args.model else [])) if args.child == "jax" \
            else run_torch(args)
        with open(os.path.join(args.tmp, f"{args.child}.json"), "w") as f:
            json.dump(rows, f)
        return 0
    import tempfile
    os.makedirs(args.out, exist_ok=True)
    rows = []
    with tempfile.TemporaryDirectory(prefix="tp_layers-") as tmp:
        for fw in [f for f in args.frameworks.split(",") if f]:
            env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]),
                       XLA_PYTHON_CLIENT_PREALLOCATE="false")
            if args.smoke:
                env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count="
                                    f"{max(args.tp)}").strip()
                env["JAX_PLATFORMS"] = "cpu"
                env.pop("TRITON_INTERPRET", None)
            child = [sys.executable, os.path.abspath(__file__), "--child", fw, "--tmp", tmp,
                     *(argv if argv is not None else sys.argv[1:])]
            proc = subprocess.run(child, env=env)
            if proc.returncode != 0:
                print(f"{fw}: the child process failed (exit {proc.returncode})", flush=True)
                return 1
            with open(os.path.join(tmp, f"{fw}.json")) as f:
                rows += json.load(f)
    sizes = SIZES["smoke" if args.smoke else "llama3-8b"]
    vllm = vllm_rows(args, sizes)
    device = "cpu" if args.smoke else _device_name()
    meta = dict(date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), device=device,
                commit=os.environ.get("GIT_COMMIT", ""), smoke=args.smoke, layers=args.layers, steps=args.steps,
                versions=_versions())
    stamp = time.strftime("%Y%m%dT%H%M", time.gmtime())
    base = os.path.join(args.out, f"tp_{'smoke' if args.smoke else 'h200'}_{stamp}")
    with open(base + ".json", "w") as f:
        json.dump(dict(meta=meta, rows=rows, vllm=vllm), f, indent=1)
    text = markdown(rows, vllm)
    with open(base + ".md", "w") as f:
        f.write(f"run {json.dumps(meta)}\n\n" + text)
    print(text)
    return 0


def _device_name() -> str:
    try:
        import torch
        return f"{torch.cuda.device_count()}x {torch.cuda.get_device_name()}"
    except Exception:
        return "unknown"


def _versions() -> dict:
    out = {}
    for name in ("torch", "triton", "jax"):
        try:
            out[name] = __import__(name).__version__
        except Exception:
            out[name] = None
    return out


if __name__ == "__main__":
    sys.exit(main())
