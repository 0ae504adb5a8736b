"""One `add_lora_linear` per case under Nsight Compute: the evidence behind docs/benchmarks.md's
"why the misses" (prefill bandwidth, decode latency). One CUDA GPU, ncu on the PATH:

    ncu --profile-from-start off --clock-control none --section SpeedOfLight \
        --section MemoryWorkloadAnalysis --section Occupancy --section LaunchStats \
        --section WarpStateStats -o prof python benchmarks/profile_kernels.py
    ncu --import prof.ncu-rep --page details > profile.txt

Each case is warmed up (compiled) first; only the profiled call sits between cudaProfilerStart and
cudaProfilerStop. Cases: (kind, T, adapters, rank, slices, slots) of bench_triton's sweep; `--cases
pre:2048:4:64:s1,dec:512:1:16:s1` profiles others (kind:T:D:rank:slices[:slots], slots -- the
adapter slots, max_loras -- defaulting to max(8, D) as in bench_triton). `--lora-dtype fp8` profiles
the same calls with e4m3 weights (per output channel scales, bench_triton's quantize_fp8); `--lora-dtype
both` profiles bf16 then fp8 for each case, so the two sit side by side in one report.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_triton import SLICES, InputSet

CASES = [("pre", 8192, 1, 16, "s1", 8, None), ("pre", 8192, 4, 64, "s1", 8, None), ("dec", 1, 1, 16, "s1", 8, None),
         ("dec", 128, 64, 64, "s1", 64, None)]


HET_RANKS = (8, 16, 32, 64)  # the sweep's heterogeneous ranks (slot i has HET_RANKS[i % 4], capped at the rank)


def parse_cases(text: str) -> list:
    """'dec:32:8:16:s1,dec:32:8:16:s1:32,pre:2048:4:64:s1:8:het' -> [(kind, T, D, rank, slices, slots,
    ranks), ...]; a trailing 'het' gives the slots the sweep's heterogeneous ranks (else None)."""
    out = []
    for item in filter(None, text.split(",")):
        kind, T, D, r, sl, *rest = item.split(":")
        het = bool(rest) and rest[-1] == "het"
        rest = rest[:-1] if het else rest
        ranks = tuple(min(v, int(r)) for v in HET_RANKS) if het else None
        out.append((kind, int(T), int(D), int(r), sl, int(rest[0]) if rest else max(8, int(D)), ranks))
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--cases", default="", help="kind:T:D:rank:slices[:slots][:het],... (default: CASES)")
    p.add_argument("--lora-dtype", choices=("bf16", "fp8", "both"), default="bf16",
                   help="the adapter weights' dtype (both: bf16 then fp8 per case)")
    args = p.parse_args()
    cases = parse_cases(args.cases) or CASES
    dtypes = ("bf16", "fp8") if args.lora_dtype == "both" else (args.lora_dtype,)
    device = torch.device("cuda")
    for kind, T, D, r, sl, slots, ranks in cases:
        s = InputSet(kind, T, D, r, SLICES[sl], slots, 0.0, ranks, torch.Generator().manual_seed(0), device)
        for dtype in dtypes:
            if dtype == "fp8":
                s.with_fp8()
            call = s.call_fp8 if dtype == "fp8" else s.call
            for _ in range(3):
                call()
            torch.cuda.synchronize()
            torch.cuda.cudart().cudaProfilerStart()
            call()
            torch.cuda.synchronize()
            torch.cuda.cudart().cudaProfilerStop()
            print(f"profiled {kind} T{T} D{D} r{r} {sl} L{slots}{' ranks ' + str(ranks) if ranks else ''} {dtype}",
                  flush=True)


if __name__ == "__main__":
    main()
