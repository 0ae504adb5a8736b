"""Times explicit launch configs of `add_lora_linear` on chosen sweep cases (GPU): the experiments
behind a tuned-table change, before the tuner is taught a new candidate.

    PYTHONPATH=. python benchmarks/explore_configs.py --cases dec:32:8:16:s1,dec:512:8:64:s1 \
        --modes benchmarks/modes.json --out benchmarks/results/explore.json

`--modes` is a JSON list of {"label": ..., "fused": true/false/null, "shrink_config": {...},
"expand_config": {...}, "fused_config": {...}, "shrink_extra": {...}, "expand_extra": {...},
"fused_extra": {...}} (absent
keys: what the table says; the *_extra dicts are merged into the table's config of each case). The label
"table" (fused null, no configs) is always timed first. Each case is timed the way bench_triton
times it (CUDA-graph replay over enough input sets to keep the weights cold, bf16, hidden 4096;
cases kind:T:D:rank:slices[:slots][:het], slots -- the adapter slots, max_loras -- defaulting to
max(8, D) as in bench_triton, het -- the sweep's heterogeneous ranks per slot); a shrink config with
SPLIT_K 0 is resolved as the table's would be. Prints one line per (case, mode) and writes them all
as JSON.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench_triton import (
    HIDDEN,
    L2_BYTES,
    SLICES,
    InputSet,
    graph_time_us,
    min_bytes,
    rel_err,
)
from profile_kernels import parse_cases

from lora_core.kernels import configs
from torch_lora.ops import triton as torch_triton


class ModeSet(InputSet):
    """An input set whose call uses the mode under test (`ModeSet.mode`: linear's keywords)."""
    mode: dict = {}

    def call(self, y=None):
        torch_triton.linear(self.y if y is None else y, self.x, self.a, self.b, self.meta.meta_args(self.x.shape[0]),
                  self.scale, self.offsets, self.ranks, **ModeSet.mode)


def resolved(mode: dict, T: int, rank: int, num_slices: int, slots: int) -> dict:
    """linear's keywords for a mode: SPLIT_K 0 of a shrink config resolved as the table's is; a
    mode's "shrink_extra" / "expand_extra" (dicts) are merged into the table's config for the case
    (one mode that changes a single key of every class's config)."""
    out = {k: mode.get(k) for k in ("fused", "shrink_config", "expand_config", "fused_config")}
    if mode.get("shrink_extra"):
        base = out["shrink_config"] or configs.table_shrink_config(T, rank, num_slices, slots)
        out["shrink_config"] = {**base, **mode["shrink_extra"]}
    if mode.get("expand_extra"):
        base = out["expand_config"] or configs.expand_config(T, HIDDEN, rank, num_slices, slots)
        out["expand_config"] = {**base, **mode["expand_extra"]}
    if mode.get("fused_extra"):
        base = out["fused_config"] or configs.fused_config(T, HIDDEN, HIDDEN, rank, num_slices, slots)
        out["fused_config"] = {**base, **mode["fused_extra"]}
    if out["shrink_config"] is not None:
        out["shrink_config"] = configs.resolve_split(dict(out["shrink_config"]), T, HIDDEN, rank, num_slices, slots)
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--cases", required=True, help="kind:T:D:rank:slices[:slots][:het],...")
    p.add_argument("--modes", required=True, help="JSON file: a list of modes (see the module docstring)")
    p.add_argument("--out", default="")
    p.add_argument("--replays", type=int, default=10)
    args = p.parse_args()
    with open(args.modes) as f:
        modes = [dict(label="table")] + json.load(f)
    device = torch.device("cuda")
    rows = []
    for kind, T, D, r, sl, slots, ranks in parse_cases(args.cases):
        widths = SLICES[sl]
        gen = torch.Generator().manual_seed(0)
        n_sets = int(min(200, max(3, math.ceil(4 * L2_BYTES / min_bytes(T, D, widths, r)))))
        sets = [ModeSet(kind, T, D, r, widths, slots, 0.0, ranks, gen, device) for _ in range(n_sets)]
        ref = sets[0].reference()
        y0 = sets[0].y.clone()                   # the graph replays below accumulate into sets[0].y
        for mode in modes:
            ModeSet.mode = resolved(mode, T, r, len(widths), slots)
            try:
                y = y0.clone()
                sets[0].call(y)
                torch.cuda.synchronize()
                err = rel_err(y, ref)
                us = graph_time_us(sets, replays=args.replays)
            except Exception as e:
                err, us = float("nan"), float("inf")
                print(f"   {mode['label']}: failed {type(e).__name__}: {str(e)[:200]}", flush=True)
            case = f"{kind}:{T}:{D}:{r}:{sl}:{slots}" + (":het" if ranks else "")
            rows.append(dict(case=case, label=mode["label"], us=us, rel_err=err, mode=mode, ranks=ranks))
            print(f"{kind} T{T} D{D} r{r} {sl} L{slots} | {mode['label']:<28} {us:8.2f} us  err {err:.1e}", flush=True)
        del sets
        torch.cuda.empty_cache()
    if args.out:
        meta = dict(date=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), device=torch.cuda.get_device_name(),
                    commit=os.environ.get("GIT_COMMIT", ""), table=configs.current_table().source)
        with open(args.out, "w") as f:
            json.dump(dict(meta=meta, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
