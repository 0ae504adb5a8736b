"""Tunes the launch configs of the Triton LoRA kernels per shape class on the GPU at hand.

    PYTHONPATH=. python benchmarks/tune_triton.py --out benchmarks/results

For one representative shape per (token class, rank class) of lora_core/kernels/configs.py it
times `add_lora_linear` (one slice of 4096 and three slices 4096/1024/1024, scored by the geometric
mean of the two; bf16, hidden 4096, cold weights, CUDA-graph replay as in bench_triton.py) over a
small candidate list: first the shrink config with the
default expand, then the expand config with the best shrink, then (decode classes) the fused
kernel. It writes the winning table into `lora_core/kernels/tuned/<device>.json` (where configs.py
reads it; the classes not tuned this time keep their entries, the table its "policy" and
"deterministic" keys) and every timing into
`--out`/tune_triton_<device>_all.json (the measurements behind the table's choices).

`--lora-dtype fp8`: the same with fp8 (e4m3) adapter weights (quantised per output channel from the
bf16 ones, as bench_triton.py does). Candidates are the table's fp8 lookup for the class (its
"fp8" entry, else its 16-bit config: timed first, the baseline), every 16-bit candidate as it is
and each made for fp8 by configs.fp8_scaled; the winners go into the class's "fp8" object (shrink,
expand, fused, use_fused), which fp8 launches read; the 16-bit side of the table is left as it is.
`--budget-s` also stops a class's candidate list once spent (the class keeps the best timed).
    PYTHONPATH=. python benchmarks/tune_triton.py --lora-dtype fp8 --classes t64,t256,t1024 --budget-s 150
With --no-fused an fp8 object gets no "use_fused" of its own (fp8 launches then follow the
class's 16-bit decision and variants).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench_triton import L2_BYTES, InputSet, graph_time_us, min_bytes, quantize_fp8

from lora_core.kernels import configs
from torch_lora.ops import triton as torch_triton

# (token class, rank class) -> representative (kind, T, D)
# (token class, rank class) -> representative (kind, T, adapter counts). Mid classes are scored
# on few and many adapters: tuned on D=64 alone (12:16), their explicit-split shrinks lost 1.3-2.4x
# at T128 D1/D8 (sweep 12:33), where the SPLIT_K = 0 rule splits more.
SHAPES = {
    ("t16", "r16"): ("dec", 8, (8,)), ("t16", "r64"): ("dec", 8, (8,)),
    ("t64", "r16"): ("dec", 32, (32,)), ("t64", "r64"): ("dec", 32, (32,)),
    ("t256", "r16"): ("dec", 128, (8, 64)), ("t256", "r64"): ("dec", 128, (8, 64)),
    ("t1024", "r16"): ("dec", 512, (8, 64)), ("t1024", "r64"): ("dec", 512, (8, 64)),
    ("t4096", "r16"): ("pre", 2048, (16,)), ("t4096", "r64"): ("pre", 2048, (16,)),
    ("tbig", "r16"): ("pre", 8192, (4,)), ("tbig", "r64"): ("pre", 8192, (4,)),
}
RANK_OF = {"r16": 16, "r64": 64}
WIDTHS = (4096, 1024, 1024)


def class_keys(tc: str, cfg: dict) -> dict:
    """cfg with the keys every config of shape class tc carries unless it sets them itself: at
    t64 (17-64 tokens) SMALL_T False -- 17-32 tokens in 16-token tiles of the sorted order, not
    one whole-batch tile per adapter (faster with every kernel a dependent launch, at one and three
    slices; docs/benchmarks_evidence.md)."""
    return {"SMALL_T": False, **cfg} if tc == "t64" else cfg


def shrink_candidates(tc):
    if tc in ("t16", "t64"):
        # (+ 512-column chunks split for ~132 programs: T32 rank 64, explore 2026-11-30 15:09)
        # (+ 4 warps, 3 stages, A prefetched into L2 before the PDL wait at T 17-64 too: faster
        # with many adapters)
        # (+ 2026-12-02: the shrink is a plain launch from 2 tokens up (planning.pdl_launch), so
        # its metadata loads are no longer hidden behind the kernel before it: whole-batch tiles
        # (SMALL_T, one round trip for the metadata) again at 17-32 tokens)
        return [configs.shrink_params(16, bk, 0, w, st) for bk, w, st in
                ((64, 4, 2), (128, 4, 2), (256, 4, 2), (256, 8, 3), (512, 8, 2))] + [
                dict(configs.shrink_params(16, 512, 0, 8, 3), TARGET=132),
                dict(configs.shrink_params(16, 256, 0, 4, 3), PREFETCH=True)] + (
                [dict(configs.shrink_params(16, 256, 0, w, st), SMALL_T=True) for w, st in ((4, 3), (8, 3))]
                if tc == "t64" else [])
    if tc in ("t256", "t1024", "t4096"):
        # Explicit splits next to the SPLIT_K = 0 rule: at rank 64 the expand's unrolled sum of
        # the workspace planes costs ~12 registers per plane (134 at 4 planes, 86 at 1: ptxas, T=512).
        # (+ 128-column chunks with 4 stages at rank 16 with many adapters; at T2048 64-token tiles
        # with 4 splits, or the split rule aimed at 400 programs)
        out = [configs.shrink_params(bm, bk, sp, w, st) for bm, bk, sp, w, st in
               ((16, 256, 0, 4, 2), (16, 128, 0, 4, 2), (32, 128, 0, 4, 3), (64, 64, 0, 4, 3),
                (16, 256, 1, 4, 3), (16, 128, 2, 4, 3), (32, 128, 2, 4, 3), (32, 256, 1, 8, 3),
                (64, 128, 2, 4, 3), (16, 128, 0, 4, 4), (16, 256, 2, 4, 3))]
        if tc == "t4096":
            out += [configs.shrink_params(64, 128, 4, 4, 3), dict(configs.shrink_params(64, 128, 0, 4, 3), TARGET=400)]
        # (every slice in one program: wins with 2+ slices at T512 rank 64 with few slots, loses at
        # T2048)
        out += [dict(configs.shrink_params(16, 128, 0, 4, 4), ALL_SLICES=True)]
        return out
    # (prefill: ncu, 2026-11-30: the unsplit BLOCK_M 64 shrink runs 137 programs at T=8192, 6.4%
    # achieved occupancy, 54% of DRAM bandwidth -- hence smaller token tiles and splits)
    # (+ the split rule aimed at 264 programs -- 2 splits at T8192 with one slice, 1 with three --
    # since the expand sums the workspace planes once per program)
    # (+ every slice in one program, 32-token tiles, 2 splits: wins with three slices at rank 16,
    # loses at rank 64)
    return [configs.shrink_params(bm, bk, sp, w, st) for bm, bk, sp, w, st in
            ((64, 128, 0, 4, 3), (64, 64, 1, 4, 4), (128, 64, 1, 4, 3), (128, 128, 1, 8, 3),
             (64, 128, 1, 4, 3), (32, 128, 1, 4, 3), (64, 128, 2, 4, 3), (64, 128, 4, 4, 3),
             (64, 128, 1, 8, 4), (32, 256, 2, 8, 3))] + [dict(configs.shrink_params(64, 128, 0, 4, 3), TARGET=264),
                                                         dict(configs.shrink_params(32, 128, 2, 4, 3), ALL_SLICES=True)]


def expand_candidates(tc, rank):
    br = min(64, max(16, rank))
    if tc in ("t16", "t64"):
        # (+ 2 tiles per program with the B tiles prefetched into L2 before the PDL wait: wins at
        # T32 with 32 adapters, loses with one adapter)
        return [configs.expand_params(16, bn, br, w, st) for bn, w, st in
                ((64, 4, 2), (128, 4, 2), (256, 4, 2), (256, 8, 2), (512, 8, 2))] + [
                dict(configs.expand_params(16, 128, br, 4, 2), TILES_N=2, PREFETCH=True)] + (
                [dict(configs.expand_params(16, 128, br, 4, 2), SMALL_T=True)] if tc == "t64" else [])
    if tc in ("t256", "t1024", "t4096"):
        # 8 warps and 32-wide rank blocks lower the registers per thread at rank 64 (ptxas, T=512,
        # 16x128 tile, 4 planes: 134 at 4 warps, 89 at 8 warps, 92 with BLOCK_R 32)
        out = [configs.expand_params(bm, bn, br, w, st) for bm, bn, w, st in
               ((16, 128, 4, 2), (16, 128, 8, 2), (16, 256, 8, 2), (32, 128, 4, 2), (32, 128, 8, 2),
                (64, 128, 4, 2), (64, 128, 8, 2), (16, 64, 4, 2))]
        if rank > 32:
            out += [configs.expand_params(bm, bn, 32, w, st) for bm, bn, w, st in ((16, 128, 4, 2), (32, 128, 8, 2))]
        # several output tiles per program, the workspace rows summed once: 4 tiles at many adapters,
        # 2 (+ y prefetch) with 64-token tiles at few,
        # 4-8 tiles of 32 tokens at T2048 (+ the next y ahead with one slice)
        out += [dict(configs.expand_params(bm, bn, br, 4, st), TILES_N=tn) for bm, bn, tn, st in
                ((16, 128, 4, 3), (16, 128, 2, 2), (16, 64, 8, 3), (32, 128, 4, 3))]
        out += [dict(configs.expand_params(64, 128, br, 4, 3), TILES_N=2, PREFETCH_Y=True)]
        # (one 16x256 tile with B through shared memory -- B_SELECT, on by default for one-tile
        # expands -- at T512 with few slots)
        out += [configs.expand_params(16, 256, br, 4, 2)]
        if tc == "t4096":
            out += [dict(configs.expand_params(32, 128, br, 4, 3), TILES_N=8),
                    dict(configs.expand_params(32, 128, br, 4, 3), TILES_N=4, Y_AHEAD=True)]
        return out
    # (prefill: ncu, 2026-11-30: the 64x128 expand tile is register-limited, 108-136 registers,
    # 18-25% occupancy -- hence also smaller tiles and 32-wide rank blocks at rank 64)
    out = [configs.expand_params(bm, bn, br, w, st) for bm, bn, w, st in
           ((64, 128, 4, 2), (128, 128, 8, 2), (64, 256, 8, 2), (128, 64, 4, 2), (128, 256, 8, 2),
            (32, 128, 4, 2), (32, 256, 8, 2), (64, 64, 4, 2), (64, 128, 8, 2), (64, 128, 4, 3))]
    if rank > 32:
        out += [configs.expand_params(bm, bn, 32, w, st) for bm, bn, w, st in ((64, 128, 4, 2), (32, 128, 4, 2))]
    # several output tiles per program (explore 2026-11-30 15:19: 4 tiles, 3 stages at rank 16; 8
    # tiles with the next y loaded ahead at rank 64)
    out += [dict(configs.expand_params(32, 128, br, 4, 3), TILES_N=4),
            dict(configs.expand_params(64, 128, br, 4, 2), TILES_N=8, Y_AHEAD=True)]
    # (32-token tiles, 8 or 16 per program, 3 stages; rank 64 one slice)
    out += [dict(configs.expand_params(32, 128, br, 4, 3), TILES_N=8),
            dict(configs.expand_params(32, 128, br, 4, 3), TILES_N=16, Y_AHEAD=True)]
    return out


def fused_candidates(rank):
    """(BLOCK_N, BLOCK_K, SPLIT_K, warps, stages). SPLIT_K 0: one hidden chunk per output tile
    (slices * SPLIT_K ~ output tiles). The expand's sum loads all SPLIT_K planes at once
    (BLOCK_M * rank floats each), so rank 64 takes fewer, larger chunks."""
    if rank <= 16:
        # (13:47, T8 D8: BLOCK_N 256 with 8 warps best; 64-wide tiles 2-3x slower)
        # (+ 256/512 with 4 warps: best at T1-T64 with 8 slots, explore 2026-11-30 15:07-15:10)
        cands = ((256, 256, 0, 8, 2), (256, 128, 0, 4, 2), (256, 128, 0, 8, 2), (512, 256, 0, 8, 2),
                 (256, 512, 0, 8, 2), (128, 256, 0, 4, 2), (256, 256, 8, 8, 2), (256, 512, 0, 4, 2))
    else:
        cands = ((256, 128, 8, 8, 2), (128, 128, 4, 4, 2), (256, 256, 4, 8, 2), (256, 128, 4, 8, 2),
                 (512, 128, 4, 8, 2))
    out = [configs.fused_params(16, bn, bk, w, st, sp) for bn, bk, sp, w, st in cands]
    # the L2 weight prefetch before the PDL wait lost at T = 32 in the two-kernel shrink (13:48)
    out += [dict(c, PREFETCH=False) for c in out[:2]]
    return out


FP8 = "float8_e4m3fn"


def fp8_candidates(kind: str, cands: list, table_cfg: dict, size: int) -> list:
    """fp8 candidates of one kind: the table's fp8 config for the class first (the baseline), then
    each 16-bit candidate as it is and made for fp8 (configs.fp8_scaled), without repeats."""
    out = []
    for c in [table_cfg] + [v for cand in cands for v in (dict(cand), configs.fp8_scaled(kind, cand, size))]:
        if c not in out:
            out.append(c)
    return out


class Tuned(InputSet):
    mode = dict(fused=False, shrink_config=None, expand_config=None, fused_config=None)
    fp8 = False                     # --lora-dtype fp8: the weights quantised to e4m3 per output channel

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.scales = {}
        if Tuned.fp8:
            qa, qb = [quantize_fp8(w) for w in self.a], [quantize_fp8(w) for w in self.b]
            self.a, self.b = [q for q, _ in qa], [q for q, _ in qb]
            self.scales = dict(a_scales=tuple(sc for _, sc in qa), b_scales=tuple(sc for _, sc in qb))

    def call(self, y=None):
        torch_triton.linear(self.y if y is None else y, self.x, self.a, self.b, self.meta.meta_args(self.x.shape[0]),
                  self.scale, self.offsets, self.ranks, **Tuned.mode, **self.scales)


def timed(sets, **mode):
    Tuned.mode = dict(fused=False, shrink_config=None, expand_config=None, fused_config=None)
    Tuned.mode.update(mode)
    try:
        return graph_time_us(sets, replays=5)
    except Exception as e:
        print("   failed:", type(e).__name__, str(e)[:200], flush=True)
        return float("inf")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="benchmarks/results")
    p.add_argument("--budget-s", type=float, default=420)
    p.add_argument("--classes", default="", help="token classes to tune (default all), e.g. t16,t64")
    p.add_argument("--table", default="", help="the table to update (default: lora_core/kernels/tuned/<device>.json)")
    p.add_argument("--no-fused", action="store_true",
                   help="skip the fused kernel's candidates (each class keeps its fused config and use_fused)")
    p.add_argument("--fused-only", action="store_true",
                   help="time the table's shrink + expand once, then only the fused candidates")
    p.add_argument("--lora-dtype", choices=("bf16", "fp8"), default="bf16",
                   help="the adapter weights' dtype: fp8 tunes the classes' \"fp8\" entries (fp8 launches' configs)")
    args = p.parse_args()
    fp8 = args.lora_dtype == "fp8"
    Tuned.fp8 = fp8
    w_dtype = FP8 if fp8 else None
    t_start = time.time()
    device = torch.device("cuda")
    results, best = {}, {}
    table_path = args.table or configs._table_file(torch.cuda.get_device_name())
    kept = {}                                            # the table's launch policy and deterministic configs
    if os.path.exists(table_path):                       # keep the classes not tuned this time
        with open(table_path) as f:
            old_table = json.load(f)
        best.update(old_table["classes"])
        kept = {k: old_table[k] for k in ("policy", "deterministic") if k in old_table}
    only = set(filter(None, args.classes.split(",")))
    for (tc, rc), (kind, T, Ds) in SHAPES.items():
        if only and tc not in only:
            continue
        if time.time() - t_start > args.budget_s:
            print("budget exhausted; remaining classes keep their defaults", flush=True)
            break

        def spent(done: int) -> bool:
            """Past the budget with at least one candidate of the list timed: skip the rest."""
            if done and time.time() - t_start > args.budget_s:
                print("   budget exhausted: the rest of this candidate list is skipped", flush=True)
                return True
            return False
        r = RANK_OF[rc]
        slots = max(8, Ds[-1])
        gen = torch.Generator().manual_seed(0)
        # Each candidate is timed on one slice and on three (WIDTHS), for each adapter count, and
        # scored by the geometric mean: a class's best block shapes differ between them (grids of
        # 1x vs 3x the programs; split-K wants few adapters).
        groups = []
        for D in Ds:
            for widths in ((4096,), WIDTHS):
                nbytes = min_bytes(T, D, widths, r)
                n_sets = int(min(60, max(3, math.ceil(4 * L2_BYTES / nbytes))))
                groups.append((len(widths), max(8, D),
                               [Tuned(kind, T, D, r, widths, max(8, D), 0.0, None, gen, device)
                                for _ in range(n_sets)]))
        key = f"{tc}/{rc}"
        results[key] = dict(shrink=[], expand=[], fused=[])
        e_default = configs.expand_config(T, 4096, r, 3, slots, w_dtype=w_dtype)
        if fp8:
            lookup = configs.current_table()
            s_cands = fp8_candidates("shrink", [class_keys(tc, c) for c in shrink_candidates(tc)],
                                     lookup.config("shrink", T, r, 3, slots, FP8, 4096), 4096)
            e_cands = fp8_candidates("expand", [class_keys(tc, c) for c in expand_candidates(tc, r)], e_default, 4096)
            f_cands = fp8_candidates("fused", [class_keys(tc, c) for c in fused_candidates(r)],
                                     lookup.config("fused", T, r, 3, slots, FP8, 4096), 4096)
        else:
            s_cands = [class_keys(tc, c) for c in shrink_candidates(tc)]
            e_cands = [class_keys(tc, c) for c in expand_candidates(tc, r)]
            f_cands = [class_keys(tc, c) for c in fused_candidates(r)]

        def score(shrink_cfg, expand_cfg, groups=groups):
            ts = [timed(sets_, shrink_config=_resolve_split(shrink_cfg, T, sl, r, n_sl), expand_config=expand_cfg)
                  for n_sl, sl, sets_ in groups]
            return math.prod(ts) ** (1 / len(ts)), ts

        if args.fused_only:
            c_s = configs.current_table().config("shrink", T, r, 3, slots, w_dtype, 4096)
            c_e = configs.current_table().config("expand", T, r, 3, slots, w_dtype, 4096)
            t_e, ts = score(c_s, c_e)
            results[key]["expand"].append(dict(config=c_e, us=t_e, us_s1_s3=ts, table=True))
        shr = []
        for c in s_cands if not args.fused_only else ():
            if spent(len(shr)):
                break
            t, ts = score(c, e_default)
            shr.append((t, c))
            results[key]["shrink"].append(dict(config=c, us=t, us_s1_s3=ts))
        if not args.fused_only:
            t_s, c_s = min(shr, key=lambda v: v[0])
            exp = []
            for c in e_cands:
                if spent(len(exp)):
                    break
                t, ts = score(c_s, c)
                exp.append((t, c))
                results[key]["expand"].append(dict(config=c, us=t, us_s1_s3=ts))
            t_e, c_e = min(exp, key=lambda v: v[0])
        entry = dict(shrink=c_s, expand=c_e, two_kernel_us=t_e)
        old = best.get(key, {}).get("fp8", {}) if fp8 else best.get(key, {})
        if args.fused_only and old:                  # the table's two-kernel entry stays as it was
            entry = {**old, "two_kernel_us": t_e}
            entry.pop("use_fused", None)
        if tc in ("t16", "t64") and not args.no_fused:
            fus = []
            for c in f_cands:
                if spent(len(fus)):
                    break
                ts = [timed(sets_, fused=True, fused_config=c) for _, _, sets_ in groups]
                t = math.prod(ts) ** (1 / len(groups))
                fus.append((t, c))
                results[key]["fused"].append(dict(config=c, us=t, us_s1_s3=ts))
                print(f"   fused {c}: {t:.2f} us {[f'{v:.2f}' for v in ts]}", flush=True)
            t_f, c_f = min(fus, key=lambda v: v[0])
            entry.update(fused=c_f, fused_us=t_f)
        if args.no_fused:
            entry = kept_fused(old, entry)
        if fp8:
            # the class's 16-bit side as it was; the fp8 object: the new configs, their use_fused
            base = best.get(key) or {kind: configs.current_table().config(kind, T, r, 3, slots)
                                     for kind in ("shrink", "expand")}
            own = table_entry(kept_variants(old, entry))
            if "fused_us" not in entry and "use_fused" not in old:
                own.pop("use_fused")        # the fused kernel not timed with fp8: the 16-bit decision stands
            best[key] = {**base, "fp8": own}
        else:
            best[key] = kept_variants(old, {**entry, **({"fp8": old["fp8"]} if "fp8" in old else {})})
        print(f"{key}: two-kernel {t_e:.2f} us shrink {c_s} expand {c_e}"
              + (f" | fused {entry.get('fused_us', float('nan')):.2f} us {entry['fused']}" if "fused" in entry else ""),
              flush=True)
        del groups
        torch.cuda.empty_cache()
    os.makedirs(args.out, exist_ok=True)
    stamp = time.strftime("%Y-%m-%dT%H:%MZ", time.gmtime())
    device_file = os.path.basename(configs._table_file(torch.cuda.get_device_name()))[:-len(".json")]
    with open(os.path.join(args.out, f"tune_triton_{device_file}_all.json"), "w") as f:
        json.dump(dict(device=torch.cuda.get_device_name(), date=stamp, results=results, best=best), f, indent=1)
    table = dict(device=torch.cuda.get_device_name(), format=1, **kept,
                 classes={key: table_entry(e) for key, e in best.items()})
    with open(table_path, "w") as f:
        json.dump(table, f, indent=1)
    print(f"# ---- {table_path}")
    for key, e in best.items():
        e = e.get("fp8", {}) if fp8 else e
        if not e:
            continue
        print(f"{key} SHRINK {e.get('shrink')} EXPAND {e.get('expand')} FUSED {e.get('fused')} "
              f"two={e.get('two_kernel_us', float('nan')):.2f} fused={e.get('fused_us', float('nan')):.2f}")


def table_entry(entry: dict) -> dict:
    """What the device table keeps of a class's tuning: its configs and the fused/two-kernel
    decision (the timings stay in the results file)."""
    kept = {k: entry[k] for k in ("shrink", "expand", "fused", "variants", "fp8") if k in entry}
    kept["use_fused"] = bool(entry.get("use_fused", entry.get("fused_us", float("inf"))
                                       < entry.get("two_kernel_us", float("inf"))))
    return kept


def kept_fused(old: dict, entry: dict) -> dict:
    """entry (a class re-tuned with --no-fused: no fused candidates timed) with the old entry's
    fused side carried over: its fused config, and its fused timing where it has one (then
    table_entry weighs it against the new two-kernel time), else its use_fused decision as it
    stands -- an entry read from the table file has no timings (table_entry drops them), so there
    is nothing to decide it again from."""
    entry = dict(entry)
    if "fused" in old:
        entry["fused"] = old["fused"]
    if "fused_us" in old:
        entry["fused_us"] = old["fused_us"]
    elif "use_fused" in old:
        entry["use_fused"] = old["use_fused"]
    return entry


def kept_variants(old: dict, entry: dict) -> dict:
    """entry with the old entry's `variants` (the table's variants: by slot count and slice count)
    carried over: they come from explore_configs.py measurements at other slot counts, or from one
    slice count alone, which this tuner (scoring one representative slot count, and s1 with s3
    together) does not repeat. The entry-level "use_fused" override (set by hand with variants
    that undo it for some slot counts, e.g. t64/r16) is carried over with them; without variants
    the new measurement decides."""
    if old.get("variants") and "variants" not in entry:
        entry = {**entry, "variants": old["variants"]}
    if old.get("variants") and "use_fused" in old and "use_fused" not in entry:
        entry = {**entry, "use_fused": old["use_fused"]}
    return entry


def _resolve_split(cfg, T, slots, rank, num_slices):
    """A candidate resolved the way configs.shrink_config resolves a table entry."""
    return configs.resolve_split(dict(cfg), T, 4096, rank, num_slices, slots)


if __name__ == "__main__":
    main()
