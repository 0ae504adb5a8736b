"""Engine start-up: compiling every kernel variant of a Llama-3-8B layer's LoRA'd linears.

    PYTHONPATH=. python benchmarks/startup.py --out benchmarks/results [--frameworks torch,jax]

What an engine pays before serving: the first `add_lora_linear` of each of vLLM's default CUDA-graph
capture sizes (1, 2, 4, 8..512 step 8: 67 token counts) on the four LoRA'd linears of a
Llama-3-8B layer (qkv 4096 -> 4096/1024/1024, o 4096 -> 4096, gate_up 4096 -> 2 x 14336, down
14336 -> 4096), rank 16, 8 slots, bf16 (`PunicaWrapper.warmup`). Each framework runs in a fresh
process with an empty Triton cache (and an empty C-launcher cache); the figures are that process's
warm-up time and the files and compiled kernels (cubins) it left in the cache, with the warm-up's
compile workers (`--workers auto,1`: the default, one per core up to 16, and none). vLLM 0.33's kernels
did the same in 11.75 s with 201 cache files on the H200 (measured side by side, carried here as
constants).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

VLLM_SECONDS, VLLM_CACHE_FILES = 11.75, 201
LAYERS = [(4096, (4096, 1024, 1024), 16), (4096, (4096,), 16), (4096, (14336, 14336), 16), (14336, (4096,), 16)]

_CHILD = r"""
import json, sys, time
t0 = time.perf_counter()
framework, rank, slots, max_tokens = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
layers = [(h, tuple(s), rank) for h, s, _ in json.loads(sys.argv[5])]
if framework == "torch":
    import torch, torch_lora
    w = torch_lora.PunicaWrapper(max_tokens, 64, "cuda", max_loras=slots)
    dtype = torch.bfloat16
else:
    import jax, jax.numpy as jnp, jax_lora
    w = jax_lora.PunicaWrapper(max_tokens, 64, None, max_loras=slots)
    dtype = jnp.bfloat16
t_import = time.perf_counter() - t0
workers = None if sys.argv[6] == "auto" else int(sys.argv[6])
stats = w.warmup(layers, dtype=dtype, progress=True, workers=workers)
w_info = stats.get("workers")
print(json.dumps(dict(import_s=t_import, warmup_s=stats["seconds"], calls=stats["calls"],
                      token_counts=len(stats["token_counts"]), backend=w.backend,
                      workers=len(w_info) if isinstance(w_info, list) else w_info,
                      workers_failed=sum(not r["ok"] for r in w_info) if isinstance(w_info, list) else 0)))
"""


def _count(cache_dir: str) -> tuple:
    files = cubins = 0
    for _base, _dirs, names in os.walk(cache_dir):
        files += len(names)
        cubins += sum(1 for n in names if n.endswith(".cubin"))
    return files, cubins


def run(framework: str, rank: int, slots: int, max_tokens: int, workers: str = "auto") -> dict:
    with tempfile.TemporaryDirectory(prefix="startup-triton-") as triton_cache, \
            tempfile.TemporaryDirectory(prefix="startup-lora-core-") as launcher_cache:
        env = {**os.environ, "TRITON_CACHE_DIR": triton_cache, "LORA_CORE_CACHE_DIR": launcher_cache,
               "PYTHONUNBUFFERED": "1"}
        env.pop("TRITON_INTERPRET", None)
        t0 = time.perf_counter()
        out = subprocess.run([sys.executable, "-c", _CHILD, framework, str(rank), str(slots), str(max_tokens),
                              json.dumps(LAYERS), workers], capture_output=True, text=True, env=env, timeout=1800)
        wall = time.perf_counter() - t0
        if out.returncode != 0:
            raise RuntimeError(f"{framework} warm-up failed:\n{out.stderr[-4000:]}")
        result = json.loads(out.stdout.strip().splitlines()[-1])
        files, cubins = _count(triton_cache)
        return dict(framework=framework, process_s=wall, cache_files=files, compiled_kernels=cubins,
                    workers_arg=workers, **result)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="benchmarks/results")
    p.add_argument("--frameworks", default="torch,jax")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--slots", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=512)
    p.add_argument("--workers", default="auto,1",
                   help="comma list of warm-up workers settings to run: auto (warmup's default) and/or ints")
    args = p.parse_args()
    rows = [run(f, args.rank, args.slots, args.max_tokens, w) for w in args.workers.split(",") if w
            for f in args.frameworks.split(",") if f]
    import torch
    meta = dict(date=time.strftime("%Y-%m-%dT%H:%M:%S+00:00", time.gmtime()), device=torch.cuda.get_device_name(),
                torch=torch.__version__, commit=os.environ.get("GIT_COMMIT", ""),
                vllm_seconds=VLLM_SECONDS, vllm_cache_files=VLLM_CACHE_FILES)
    stamp = time.strftime("%Y%m%dT%H%M", time.gmtime())
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"startup_h200_{stamp}.json"), "w") as f:
        json.dump(dict(meta=meta, rows=rows), f, indent=1)
    lines = ["| framework | workers | warm-up s | process s | cache files | compiled kernels | calls |",
             "|---|---|---|---|---|---|---|"]
    lines += [f"| {r['framework']} | {r['workers_arg']} ({r.get('workers')}, {r.get('workers_failed', 0)} failed) | "
              f"{r['warmup_s']:.1f} | {r['process_s']:.1f} | {r['cache_files']} | {r['compiled_kernels']} | "
              f"{r['calls']} |" for r in rows]
    lines.append(f"| vLLM 0.33 (measured earlier) | - | {VLLM_SECONDS} | - | {VLLM_CACHE_FILES} | - | 268 |")
    text = "\n".join(lines)
    with open(os.path.join(args.out, f"startup_h200_{stamp}.md"), "w") as f:
        f.write(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
