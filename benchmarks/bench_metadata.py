"""Cost of building one step's kernel metadata (docs/benchmarks.md target: <= 20 us on the GPU, T <= 512).

Measured on both sides, for T in {1, 32, 128, 512} tokens, 8 and 64 slots:
  torch graph:  LoRAKernelMeta.prepare_tensors captured in a CUDA graph, replayed (device time per build)
  torch eager:  the same call without a graph, wall time per call (host enqueue bound)
  jax scan:     jax_lora's jitted build_kernel_meta run N times inside one jitted scan (device time per build)
  jax call:     one jitted build per Python call, wall time (dispatch included)
  update us:    the whole `PunicaWrapper.update_metadata` (host conversion and metadata, one upload),
                wall time; since the wrappers build the metadata on the host (StepLayout), no kernel
                runs for it in a step

    PYTHONPATH=. python benchmarks/bench_metadata.py --out benchmarks/results
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

CASES = [(t, s) for t in (1, 32, 128, 512) for s in (8, 64)]


def _mapping(rng, t, slots):
    idx = rng.integers(-1, slots, t).astype(np.int32)
    return idx


def bench_torch(rng, t, slots, reps=200):
    import torch

    from torch_lora.meta import LoRAKernelMeta

    dev = torch.device("cuda")
    meta = LoRAKernelMeta.make(slots, 512, dev)
    idx = torch.from_numpy(_mapping(rng, t, slots)).to(dev)
    for _ in range(3):
        meta.prepare_tensors(idx)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(reps):
        meta.prepare_tensors(idx)
    torch.cuda.synchronize()
    eager_us = (time.perf_counter() - start) / reps * 1e6

    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        meta.prepare_tensors(idx)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    n_in_graph = 20
    with torch.cuda.graph(graph):
        for _ in range(n_in_graph):
            meta.prepare_tensors(idx)
    times = []
    for _ in range(10):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        graph.replay()
        e1.record()
        torch.cuda.synchronize()
        times.append(e0.elapsed_time(e1) * 1e3 / n_in_graph)
    return eager_us, statistics.median(times)


def bench_jax(rng, t, slots, reps=200):
    import jax
    import jax.numpy as jnp

    from jax_lora.meta import build_kernel_meta

    buf = np.full(512, -1, np.int32)
    buf[:t] = _mapping(rng, t, slots)
    m = jnp.asarray(buf)
    n = jnp.int32(t)
    jax.block_until_ready(build_kernel_meta(m, n, max_loras=slots))
    start = time.perf_counter()
    for _ in range(reps):
        out = build_kernel_meta(m, n, max_loras=slots)
    jax.block_until_ready(out)
    call_us = (time.perf_counter() - start) / reps * 1e6

    steps = 200

    @jax.jit
    def many(m, n):
        def body(carry, i):
            meta = build_kernel_meta(jnp.roll(m, i), n, max_loras=slots)
            return carry + meta.lora_token_start_loc[-1] + meta.token_indices_sorted_by_lora_ids[0], None
        return jax.lax.scan(body, jnp.int32(0), jnp.arange(steps))[0]

    jax.block_until_ready(many(m, n))
    times = []
    for _ in range(5):
        s = time.perf_counter()
        jax.block_until_ready(many(m, n))
        times.append((time.perf_counter() - s) / steps * 1e6)
    return call_us, statistics.median(times)


def bench_update(rng, t, slots, reps=100):
    import jax
    import torch

    import jax_lora
    import torch_lora

    ids = list(range(1, slots + 1))
    idx = _mapping(rng, t, slots)
    mapping = jax_lora.LoRAMapping(tuple(int(i) + 1 if i >= 0 else 0 for i in idx), tuple([1] * min(t, 8)))
    out = {}
    jw = jax_lora.PunicaWrapper(512, 64, None, max_loras=slots)
    tw = torch_lora.PunicaWrapper(512, 64, "cuda", max_loras=slots)
    for name, w, sync in (("jax", jw, lambda: jax.block_until_ready(jw.token_meta)),
                          ("torch", tw, torch.cuda.synchronize)):
        w.update_metadata(mapping, ids, slots + 1, 32000)
        sync()
        s = time.perf_counter()
        for _ in range(reps):
            w.update_metadata(mapping, ids, slots + 1, 32000)
        sync()
        out[name] = (time.perf_counter() - s) / reps * 1e6
    return out


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="benchmarks/results")
    p.add_argument("--commit", default=None, help="the git commit measured (the device copy has no .git)")
    args = p.parse_args()
    rng = np.random.default_rng(0)
    rows = []
    for t, slots in CASES:
        te, tg = bench_torch(rng, t, slots)
        jc, js = bench_jax(rng, t, slots)
        up = bench_update(rng, t, slots)
        rows.append(dict(T=t, slots=slots, torch_eager_us=te, torch_graph_us=tg, jax_call_us=jc, jax_scan_us=js,
                         update_jax_us=up["jax"], update_torch_us=up["torch"]))
        print(rows[-1], flush=True)
    import jax
    import torch
    meta = dict(date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                device=torch.cuda.get_device_name(), torch=torch.__version__, jax=jax.__version__)
    meta["commit"] = args.commit
    if meta["commit"] is None:
        try:
            import subprocess
            meta["commit"] = subprocess.check_output(["git", "rev-parse", "--short", "HEAD"], text=True,
                                                     stderr=subprocess.DEVNULL).strip()
        except Exception:
            meta["commit"] = "unknown"
    os.makedirs(args.out, exist_ok=True)
    stamp = meta["date"][:10]
    with open(os.path.join(args.out, f"metadata-{stamp}.json"), "w") as f:
        json.dump(dict(meta=meta, rows=rows), f, indent=1)
    lines = [f"metadata build, {meta}", "",
             "| T | slots | torch graph us | torch eager us | jax in-program us | jax per call us "
             "| update_metadata jax us | update_metadata torch us |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['T']} | {r['slots']} | {r['torch_graph_us']:.1f} | {r['torch_eager_us']:.1f} | "
                     f"{r['jax_scan_us']:.1f} | {r['jax_call_us']:.1f} | {r['update_jax_us']:.0f} | "
                     f"{r['update_torch_us']:.0f} |")
    with open(os.path.join(args.out, f"metadata-{stamp}.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
