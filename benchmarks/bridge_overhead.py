"""Overhead of the bridge: per converted tensor and per bridged `add_lora_linear` call.

    PYTHONPATH=. python benchmarks/bridge_overhead.py --device cuda --out benchmarks/results
    PYTHONPATH=. python benchmarks/bridge_overhead.py --device cpu  --out benchmarks/results

What is measured (host time, `time.perf_counter`, median of `--repeats` blocks of `--iters` calls):
  * per tensor: bridge.to_jax / bridge.to_torch on a (T, 4096) bf16 activation, against the public
    jnp.from_dlpack / torch.from_dlpack; on CUDA, to_jax with an explicit producer stream too.
  * per call: `add_lora_linear` (bf16, hidden 4096, rank 16, 8 slots, decode batches; one slice and
    QKV-like slices) through the bridge against the native call of the side whose kernels run:
      torch-over-jax: bridge.TorchPunicaWrapper vs jax_lora.PunicaWrapper on the same arrays;
      jax-over-torch: bridge.JaxPunicaWrapper vs torch_lora.PunicaWrapper on the same tensors.
    Bridged and native calls are interleaved block by block, so drifting machine load hits both.
    "enqueue" is host time per call without synchronising (what a serving loop pays on the host);
    "synced" synchronises after every call (CUDA only; on the CPU every call is synchronous).
    The overhead per converted tensor divides the difference by the tensors converted per call
    (torch-over-jax: x, y in, the result out = 3; jax-over-torch: x, y in, the result out = 3, plus
    the clone of y that JAX's immutability requires; weights are cached and not counted).
    "torch-over-jax jit" is TorchPunicaWrapper(jit=True) against the same jitted JAX call.
    On the CPU the bridged torch-over-jax call waits for JAX's result (it copies it into y), so the
    native JAX call is timed up to block_until_ready too.
  * the pieces of one bridged call, timed alone (sum = what the bridge adds).
Target: at most 10 us per converted tensor beyond the native call.
Writes bridge_overhead_<device>.json and .md under --out.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

HIDDEN = 4096
RANK = 16
SLOTS = 8
SLICES = {"s1": (4096,), "s3": (4096, 1024, 1024)}
TOKENS = (1, 32, 128)


def _timer(fn, iters: int, repeats: int, sync=None, best: bool = False) -> float:
    """Median (or with best=True the minimum) over `repeats` blocks of the mean host time per call, in us.

    `sync` (optional) runs after each block, so queued device work is inside the block's time. The
    minimum is the better estimate of the intrinsic cost on a shared, loaded host (CPU runs here).
    """
    for _ in range(max(3, iters // 10)):
        fn()
    if sync:
        sync()
    blocks = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        if sync:
            sync()
        blocks.append((time.perf_counter() - t0) / iters * 1e6)
    return min(blocks) if best else statistics.median(blocks)


def _interleaved(a, b, iters: int, repeats: int, sync=None, sync_each: bool = False) -> tuple[float, float]:
    """Medians of a and b timed in alternating blocks (so load drift affects both alike).

    sync_each: synchronise after every call (device time included), else after each block.
    """
    for fn in (a, b):
        for _ in range(max(3, iters // 10)):
            fn()
    if sync:
        sync()
    ta, tb = [], []
    for _ in range(repeats):
        for fn, out in ((a, ta), (b, tb)):
            t0 = time.perf_counter()
            for _ in range(iters):
                fn()
                if sync_each:
                    sync()
            if sync:
                sync()
            out.append((time.perf_counter() - t0) / iters * 1e6)
    return statistics.median(ta), statistics.median(tb)


def _to_jax_parts(x, iters: int, repeats: int) -> dict:
    """Host us of each step of bridge.to_jax on a CUDA tensor, timed alone."""
    import torch

    from bridge import dlpack
    jdev = dlpack.jax_device_for(x.device)
    jstream = dlpack._jax_ready_stream(jdev)
    producer = torch.cuda.current_stream(x.device)
    event = torch.cuda.Event()
    external = torch.cuda.ExternalStream(jstream, device=x.device)
    return {
        "current_stream": _timer(lambda: torch.cuda.current_stream(x.device), iters, repeats),
        "raw_current_stream": _timer(lambda: torch._C._cuda_getCurrentRawStream(x.device.index), iters, repeats),
        "event_record": _timer(lambda: event.record(producer), iters, repeats),
        "wait_event": _timer(lambda: external.wait_event(event), iters, repeats),
        "wait_for_producer": _timer(lambda: dlpack._wait_for_producer(jstream, producer, x.device), iters, repeats),
        "torch_to_dlpack": _timer(lambda: dlpack._TO_DLPACK(x), iters, repeats),
        "to_dlpack_and_import": _timer(
            lambda: dlpack._import_capsule(dlpack._TO_DLPACK(x), jdev, jstream, dlpack._DL_CUDA), iters, repeats),
        "import_no_stream": _timer(lambda: dlpack._import_capsule(dlpack._TO_DLPACK(x), jdev, None, dlpack._DL_CUDA),
                                   iters, repeats),
    }


def _case(T: int, slices, rng, device, torch):
    from lora_core.host_mapping import LoRAMapping
    ids = list(range(1, SLOTS + 1))
    idx = rng.integers(0, SLOTS, T)
    mapping = LoRAMapping(tuple(int(ids[i]) for i in idx), tuple(int(ids[i]) for i in idx))

    def tt(shape, scale=1.0):
        a = (rng.standard_normal(shape) * scale).astype(np.float32)
        return torch.from_numpy(a).to(device=device, dtype=torch.bfloat16)

    x = tt((T, HIDDEN))
    y = tt((T, sum(slices)))
    a = [tt((SLOTS, 1, RANK, HIDDEN), HIDDEN ** -0.5) for _ in slices]
    b = [tt((SLOTS, 1, n, RANK), RANK ** -0.5) for n in slices]
    return mapping, ids, x, y, a, b


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--tokens", default=",".join(map(str, TOKENS)))
    ap.add_argument("--jax-backend", default=None, help="backend of the JAX kernels (torch-over-jax)")
    ap.add_argument("--torch-backend", default=None, help="backend of the torch kernels (jax-over-torch)")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch intra-op threads (default: 1 on the CPU, where a shared host's scheduling "
                         "otherwise adds ms-scale noise to small parallel copies)")
    ap.add_argument("--parts-only", action="store_true", help="per-tensor figures only, printed, not written")
    args = ap.parse_args()

    import torch
    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.device == "cpu":
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
    # torch and JAX share the GPU: JAX must not grab 75% of its memory at first use.
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    import jax
    import jax.numpy as jnp

    import bridge
    import jax_lora
    import torch_lora

    device = torch.device(args.device)
    cuda = device.type == "cuda"
    if args.threads or not cuda:
        torch.set_num_threads(args.threads or 1)
    sync = None
    if cuda:
        def sync():
            torch.cuda.synchronize(device)
    rng = np.random.default_rng(0)
    it, rep = args.iters, args.repeats
    results: dict = {"per_tensor": [], "bridge_only": [], "per_call": [], "pieces": []}

    # ------------------------------------------------------------------ per tensor
    for T in (1, 128):
        x = torch.randn(T, HIDDEN, device=device).to(torch.bfloat16)
        xj = bridge.to_jax(x)
        jx = jnp.asarray(np.asarray(xj))
        if cuda:
            jx = jax.device_put(jx, bridge.jax_device_for(device))
        row = {"shape": [T, HIDDEN], "dtype": "bfloat16",
               "to_jax_us": _timer(lambda: bridge.to_jax(x), it * 5, rep),
               "to_jax_min_us": _timer(lambda: bridge.to_jax(x), it * 5, rep, best=True),
               "jnp_from_dlpack_us": _timer(lambda: jnp.from_dlpack(x), it * 5, rep),
               "to_torch_us": _timer(lambda: bridge.to_torch(jx), it * 5, rep),
               "to_torch_min_us": _timer(lambda: bridge.to_torch(jx), it * 5, rep, best=True),
               "torch_from_dlpack_us": _timer(lambda: torch.from_dlpack(jx), it * 5, rep)}
        if cuda:
            side = torch.cuda.Stream(device)
            row["to_jax_side_stream_us"] = _timer(lambda: bridge.to_jax(x, stream=side), it * 5, rep)
            row["to_jax_parts_us"] = _to_jax_parts(x, it * 5, rep)
        results["per_tensor"].append(row)
        print("per tensor", row, flush=True)

    # ------------------------------------------------------------------ per call
    for T in () if args.parts_only else (int(t) for t in args.tokens.split(",")):
        for sname, slices in SLICES.items():
            mapping, ids, x, y, a, b = _case(T, slices, rng, device, torch)
            # torch-over-jax vs native jax_lora on the same (shared) arrays
            tw = bridge.TorchPunicaWrapper(max(T, 8), 8, device, max_loras=SLOTS, backend=args.jax_backend)
            nj = jax_lora.PunicaWrapper(max(T, 8), 8, bridge.jax_device_for(device), max_loras=SLOTS,
                                        backend=tw.backend)
            for w in (tw, nj):
                w.update_metadata(mapping, ids, SLOTS + 1, 32000)
            xj, yj = bridge.to_jax(x), bridge.to_jax(y)
            aj, bj = [bridge.to_jax(v) for v in a], [bridge.to_jax(v) for v in b]
            y_t = y.clone()

            def bridged_tj():
                return tw.add_lora_linear(y_t, x, a, b, None, 1.0, slices)

            def native_tj():
                return nj.add_lora_linear(yj, xj, aj, bj, None, 1.0, slices)

            # jit=True: one compiled program per call, against the same program called natively.
            tw_jit = bridge.TorchPunicaWrapper(max(T, 8), 8, device, max_loras=SLOTS, backend=tw.backend, jit=True)
            tw_jit.update_metadata(mapping, ids, SLOTS + 1, 32000)
            native_jit = jax.jit(lambda w, y_, x_, a_, b_: w.add_lora_linear(y_, x_, a_, b_, None, 1.0, slices))

            def bridged_tj_jit():
                return tw_jit.add_lora_linear(y_t, x, a, b, None, 1.0, slices)

            def native_tj_jit():
                return native_jit(nj, yj, xj, aj, bj)

            if not cuda:  # the bridged call waits for JAX's result (to copy it into y): so must the native one
                native_tj_async, native_tj_jit_async = native_tj, native_tj_jit
                native_tj = lambda: jax.block_until_ready(native_tj_async())
                native_tj_jit = lambda: jax.block_until_ready(native_tj_jit_async())

            # jax-over-torch vs native torch_lora on the same tensors
            jw = bridge.JaxPunicaWrapper(max(T, 8), 8, bridge.jax_device_for(device), max_loras=SLOTS,
                                         backend=args.torch_backend)
            nt = torch_lora.PunicaWrapper(max(T, 8), 8, device, max_loras=SLOTS, backend=jw.backend)
            for w in (jw, nt):
                w.update_metadata(mapping, ids, SLOTS + 1, 32000)
            y_n = y.clone()
            out_j = [None]

            def bridged_jt():
                out_j[0] = jw.add_lora_linear(yj, xj, aj, bj, None, 1.0, slices)

            def native_jt():
                return nt.add_lora_linear(y_n, x, a, b, None, 1.0, slices)

            # Bridge only: the same bridged calls with the inner kernels replaced by a stub that returns
            # a ready result, so the time is exactly what the bridge adds (checks, conversions, cache
            # lookups, the write into y / the clone of y).
            ready_j = native_tj()
            ready_t = y.clone()
            tw.jax_wrapper.add_lora_linear = lambda *a_, **k_: ready_j
            jw.torch_wrapper.add_lora_linear = lambda *a_, **k_: ready_t
            for name, fn in (("torch-over-jax", bridged_tj), ("jax-over-torch", bridged_jt)):
                med = _timer(fn, it * 2, rep, sync)
                low = _timer(fn, it * 2, rep, sync, best=True)
                row = {"direction": name, "T": T, "slices": sname, "bridge_only_us": med, "bridge_only_min_us": low,
                       "per_converted_tensor_us": med / 3, "per_converted_tensor_min_us": low / 3}
                results["bridge_only"].append(row)
                print("bridge only", row, flush=True)
            del tw.jax_wrapper.add_lora_linear, jw.torch_wrapper.add_lora_linear  # the real kernels again

            for name, br, na, backend in (("torch-over-jax", bridged_tj, native_tj, tw.backend),
                                          ("torch-over-jax jit", bridged_tj_jit, native_tj_jit, tw.backend),
                                          ("jax-over-torch", bridged_jt, native_jt, jw.backend)):
                tb, tn = _interleaved(br, na, it, rep, sync)
                row = {"direction": name, "backend": backend, "T": T, "slices": sname,
                       "enqueue_bridged_us": tb, "enqueue_native_us": tn, "enqueue_overhead_us": tb - tn,
                       "per_converted_tensor_us": (tb - tn) / 3}
                if cuda:
                    sb, sn = _interleaved(br, na, max(it // 4, 10), rep, sync, sync_each=True)
                    row.update(synced_bridged_us=sb, synced_native_us=sn, synced_overhead_us=sb - sn)
                results["per_call"].append(row)
                print("per call", row, flush=True)

            if int(args.tokens.split(",")[0]) == T or T == 128:
                res = nj.add_lora_linear(yj, xj, aj, bj, None, 1.0, slices)
                pieces = {"T": T, "slices": sname,
                          "to_jax_x_us": _timer(lambda: bridge.to_jax(x), it, rep),
                          "to_jax_y_us": _timer(lambda: bridge.to_jax(y_t), it, rep),
                          "weights_cache_hits_us": _timer(lambda: tw._weight(a, "a") and tw._weight(b, "b"), it, rep),
                          "weights_per_tensor_cache_hit_us": _timer(lambda: tw._weight(a, "a") and tw._weight(b, "b"),
                                                                    it, rep) / (2 * len(slices)),
                          "to_torch_result_us": _timer(lambda: bridge.to_torch(res), it, rep),
                          "y_copy_us": _timer(lambda: y_t.copy_(y), it, rep, sync),
                          "to_torch_x_us": _timer(lambda: bridge.to_torch(xj), it, rep),
                          "y_clone_us": _timer(lambda: y.clone(), it, rep, sync)}
                results["pieces"].append(pieces)
                print("pieces", pieces, flush=True)

    meta = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "device": torch.cuda.get_device_name(device) if cuda else platform.processor() or platform.machine(),
            "python": platform.python_version(), "torch": torch.__version__, "jax": jax.__version__,
            "host_cores": os.cpu_count(), "iters": it, "repeats": rep}
    meta["commit"] = os.environ.get("GIT_COMMIT")  # first: a device copy may carry a stale .git
    if not meta["commit"]:
        try:
            import subprocess
            meta["commit"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                            text=True, cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip()
        except OSError:
            pass
    results["meta"] = meta
    if args.parts_only:
        print(json.dumps(results, indent=1))
        return
    os.makedirs(args.out, exist_ok=True)
    stem = os.path.join(args.out, f"bridge_overhead_{device.type}")
    with open(stem + ".json", "w") as f:
        json.dump(results, f, indent=1)
    with open(stem + ".md", "w") as f:
        f.write(_markdown(results))
    print(f"wrote {stem}.json and {stem}.md")


def _markdown(r: dict) -> str:
    m = r["meta"]
    lines = [f"# Bridge overhead ({m['device']}, {m['date']}, torch {m['torch']}, jax {m['jax']})", "",
             "## Per tensor (host us)", "",
             "| shape | bridge.to_jax (min) | jnp.from_dlpack | bridge.to_torch (min) | torch.from_dlpack |",
             "|---|---|---|---|---|"]
    for p in r["per_tensor"]:
        lines.append(f"| {p['shape']} | {p['to_jax_us']:.1f} ({p['to_jax_min_us']:.1f}) | "
                     f"{p['jnp_from_dlpack_us']:.1f} | {p['to_torch_us']:.1f} ({p['to_torch_min_us']:.1f}) | "
                     f"{p['torch_from_dlpack_us']:.1f} |")
    lines += ["", "## What the bridge adds to one add_lora_linear call (host us; kernels stubbed out)", "",
              "| direction | T | slices | median | min | median / 3 tensors | min / 3 tensors |",
              "|---|---|---|---|---|---|---|"]
    for p in r["bridge_only"]:
        lines.append(f"| {p['direction']} | {p['T']} | {p['slices']} | {p['bridge_only_us']:.1f} | "
                     f"{p['bridge_only_min_us']:.1f} | {p['per_converted_tensor_us']:.1f} | "
                     f"{p['per_converted_tensor_min_us']:.1f} |")
    lines += ["", "## Per add_lora_linear call (host us, bridged vs native on the same data)", "",
              "| direction | backend | T | slices | bridged | native | overhead | per converted tensor | "
              "synced overhead |", "|---|---|---|---|---|---|---|---|---|"]
    for p in r["per_call"]:
        synced = f"{p['synced_overhead_us']:.1f}" if "synced_overhead_us" in p else "-"
        lines.append(f"| {p['direction']} | {p['backend']} | {p['T']} | {p['slices']} | "
                     f"{p['enqueue_bridged_us']:.1f} | {p['enqueue_native_us']:.1f} | {p['enqueue_overhead_us']:.1f} | "
                     f"{p['per_converted_tensor_us']:.1f} | {synced} |")
    lines += ["", "## Pieces of one bridged call, timed alone (host us)", ""]
    for p in r["pieces"]:
        lines.append("- " + ", ".join(f"{k} {v:.1f}" if isinstance(v, float) else f"{k} {v}" for k, v in p.items()))
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
