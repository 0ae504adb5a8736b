"""JAX at decode: the launchers of jax_lora's Triton kernels under jit, and XLA's command buffers.
One CUDA GPU; each XLA_FLAGS setting runs in its own process (XLA reads the flags once).

    PYTHONPATH=. python benchmarks/jax_launch_modes.py --out benchmarks/results

jax_triton lowers each kernel to the custom call `triton_kernel_call` (api_version 2, a legacy
registration); XLA records a custom call into a command buffer only if it is an FFI handler marked
command-buffer compatible (or, in XLA versions that have the flag, a legacy target listed in
`--legacy_command_buffer_custom_call_targets`), so each launch of the unrolled scan is otherwise a
separate launch from the host. jax_lora's own FFI launcher (jax_lora/ops/ffi_launcher.py) is such
a handler. The timing is
bench_triton.jax_vs_torch's: the per-op time of a jitted, unrolled scan of 50 calls vs torch in a
CUDA graph of 50 calls.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys

MODES = {  # name -> (XLA_FLAGS, jax_lora.ops.triton.linear's `fused`, extra environment)
    # the FFI launcher (default since 2026-11-30 12:40): command-buffer compatible, PDL shrink -> expand
    "ffi": ("", None, {}),
    "ffi_no_pdl": ("", None, {"LORA_CORE_PDL": "0"}),
    # XLA's command buffers off: what the FFI launcher gains from being recorded into them
    "ffi_no_cmdbuf": ("--xla_gpu_enable_command_buffer=", None, {}),
    # CUSTOM_CALL named explicitly among the command buffer types (in case it is not a default)
    "ffi_cmdbuf_custom_call": ("--xla_gpu_enable_command_buffer=+CUSTOM_CALL", None, {}),
    # jax_triton's legacy custom call (the only launcher before)
    "jax_triton": ("", None, {"JAX_LORA_TRITON_LAUNCHER": "jax_triton"}),
    # one launch per op (the fused kernel) instead of two: fewer of XLA's per-launch costs
    "jax_triton_fused": ("", True, {"JAX_LORA_TRITON_LAUNCHER": "jax_triton"}),
    # is jaxlib's legacy triton call captured with CUSTOM_CALL command buffers? (no: slower, 10:45)
    "jax_triton_cmdbuf": ("--xla_gpu_enable_command_buffer=+CUSTOM_CALL --xla_gpu_graph_min_graph_size=1", None,
                          {"JAX_LORA_TRITON_LAUNCHER": "jax_triton"}),
    # the measurement before 12:30: no barrier (XLA merged the steps' shrinks), y not donated
    "ffi_as_before": ("", None, {"BENCH_JAX_BARRIER": "0", "BENCH_JAX_DONATE": "0"}),
    "jax_triton_as_before": ("", None, {"JAX_LORA_TRITON_LAUNCHER": "jax_triton", "BENCH_JAX_BARRIER": "0",
                                        "BENCH_JAX_DONATE": "0"}),
    # (`--legacy_command_buffer_custom_call_targets=triton_kernel_call` would name the legacy target, but
    # jax 0.11.2's XLA rejects it: "Unknown flag in XLA_FLAGS", run of 2026-11-30T10:41)
}
CASES = ("dec T1 D1 r16", "dec T8 D8 r64", "dec T128 D64 r64")


def child(mode: str) -> None:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import bench_triton
    import torch
    cases = [c for c in bench_triton.sweep_cases() if c[0] in CASES]
    flags, fused, _env = MODES[mode]
    from jax_lora.ops import ffi_launcher
    res = bench_triton.jax_vs_torch(torch.device("cuda"), [(c, sl) for c in cases for sl in ("s1", "s3")],
                                    jax_fused=fused, barrier=os.environ.get("BENCH_JAX_BARRIER", "1") != "0",
                                    donate=os.environ.get("BENCH_JAX_DONATE", "1") != "0")
    print("RESULT " + json.dumps(dict(mode=mode, xla_flags=flags, jax_fused=fused, env=_env,
                                      launcher="ffi" if ffi_launcher.available() else "jax_triton",
                                      results=res)), flush=True)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="benchmarks/results")
    p.add_argument("--child", default=None)
    p.add_argument("--commit", default=None)
    p.add_argument("--modes", default=None, help="comma-separated subset of MODES")
    args = p.parse_args()
    if args.child:
        child(args.child)
        return
    runs = []
    for mode, (flags, _fused, extra) in MODES.items():
        if args.modes and mode not in args.modes.split(","):
            continue
        env = dict(os.environ, XLA_FLAGS=(os.environ.get("XLA_FLAGS", "") + " " + flags).strip(), **extra)
        proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", mode], env=env,
                              capture_output=True, text=True, timeout=400)
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
        if lines:
            runs.append(json.loads(lines[-1][len("RESULT "):]))
        else:
            runs.append(dict(mode=mode, xla_flags=flags, error=(proc.stderr or proc.stdout)[-3000:]))
        print(mode, "->", "ok" if lines else "FAILED", flush=True)
        print(proc.stdout[-2000:], proc.stderr[-1500:] if not lines else "", flush=True)
    import jax
    import torch
    meta = dict(date=datetime.datetime.now(datetime.timezone.utc).isoformat(), jax=jax.__version__,
                torch=torch.__version__, device=torch.cuda.get_device_name(0), commit=args.commit)
    os.makedirs(args.out, exist_ok=True)
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M")
    path = os.path.join(args.out, f"jax_launch_modes_h200_{stamp}.json")
    with open(path, "w") as f:
        json.dump(dict(meta=meta, runs=runs), f, indent=1)
    for r in runs:
        for j in r.get("results", []):
            print(f"{r['mode']:14s} {j['case']:18s} {j['slices']} jax {j['jax_us']:7.2f} us "
                  f"torch {j['torch_hot_us']:6.2f} us ratio {j['ratio']:.2f} err {j['jax_rel_err']:.1e} "
                  f"handler calls/step {j.get('ffi_handler_calls_per_step')}")
    print("wrote", path)


if __name__ == "__main__":
    main()
