"""Tunes the MoE LoRA kernel's launch configs per shape bucket and writes the winners into the MoE table.

    PYTHONPATH=. python benchmarks/tune_moe_lora.py --table $OUT/NVIDIA_H200_moe.json --budget-s 150 --jobs 12
    PYTHONPATH=. python benchmarks/tune_moe_lora.py --quick --table /tmp/moe.json   # CPU interpreter, tiny

What it tunes: the buckets (`lora_core.kernels.moe_configs.bucket_key`) of the benchmark's layers
(`bench_moe_lora.MODELS`: Mixtral-8x7B and Qwen3-30B-A3B, w13 and w2) at the token counts 1, 16,
64, 256, 2048, 8192 and ranks 16 and 64 (`--models`, `--layers`, `--tokens`, `--ranks`), each in
the pair order and block size the engine gives it (`lora_core.moe_order`).

Candidates per bucket (a small curated grid, not a product): the default config with its K_SPLIT
and TILES_N resolved, the table's current entry if any, for the sorted order the structural moves
(`sorted_moves`: the alignment's block in sub-blocks of half and a quarter its rows, 1 and 4
programs per expected block, 128-column B tiles at 4 and 8 warps, one tile per expand program),
and the default with one knob moved at a time -- K_SPLIT halved / doubled, TILES_N halved /
doubled, BLOCK_N halved / doubled at the same columns per program, BLOCK_K halved / doubled, the
naive rank in 16-wide chunks, the other path (GEMV or tl.dot) for the naive order, the other warp
count and one stage more / fewer per launch.
After the single moves, the best value of each knob that won is combined into one more candidate.

Each candidate is checked against the benchmark's reference (relative error <= 2e-2) before it is
timed: us per call from a CUDA graph of many calls replayed (`bench_triton.Clock`), summed over the
bucket's cases -- one adapter, and 8 or 32 where the tokens allow (the routing's spread over the
(adapter, expert) runs changes which config wins). Compilation comes first and in parallel:
`--jobs` worker processes run every candidate once (Triton keeps the kernels in its on-disk
cache), then the timing runs alone on the GPU.

Which buckets first: those the table lacks, then the tuned ones again, token counts outermost in
each; `--losing FILE` (a `bench_moe_lora` result, its moe_lora.json or moe_lora.md) puts the
buckets of its cases slower than vLLM before all, the slowest first; `--only-untuned` skips the
tuned ones (losing ones excepted). A run cut by the budget has then spent it where vLLM wins:

    PYTHONPATH=. python benchmarks/tune_moe_lora.py --budget-s 140 --jobs 14 --max-candidates 10 \
        --losing benchmarks/results/moe_lora_20261203/moe_lora.md --only-untuned

Output: `--table` (default lora_core/kernels/tuned/<device>_moe.json) gets each bucket's winner
as soon as the bucket is done (entries of other buckets already in the file are kept), so a run
cut by `--budget-s` leaves what it finished; `<table>.log.json` beside it lists every candidate's
time or failure. Where the default wins, the entry is still written (explicit K_SPLIT / TILES_N).
The plan reads the table of the GPU present (`lora_core/kernels/tuned/NVIDIA_H200_moe.json` on an
H200) or the file LORA_CORE_MOE_TABLE names.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import bench_moe_lora as bench

TOKENS = (1, 16, 64, 256, 2048, 8192)
QUICK_TOKENS = (1, 40)
RANKS = (16, 64)
MAX_ERR = 2e-2


def bucket_of(shape: dict, layer: str, tokens: int, rank: int, slots: int):
    """(MoeShape, bucket key) of a layer call as the benchmark makes it."""
    from lora_core.kernels.moe_configs import MoeShape, bucket_key
    from lora_core.moe_order import moe_block_size, naive_block_assignment
    k, E = shape["top_k"], shape["experts"]
    pairs = tokens * k
    naive = naive_block_assignment(tokens, k, E, slots)
    w2 = layer == "w2"
    hidden, widest = (shape["inter"], shape["hidden"]) if w2 else (shape["hidden"], shape["inter"])
    slices = 1 if w2 else 2
    s = MoeShape(num_pairs=pairs, naive=naive, block_m=16 if naive else moe_block_size(pairs, E), num_slots=slots,
                 num_experts=E, hidden=hidden, widest=widest, slices=slices, shrink_slices=slices, rank=rank)
    return s, bucket_key(s)


def sorted_moves(d, shape) -> list:
    """The sorted order's structural candidates, tried before the single knob moves: the alignment's
    block in sub-blocks of half and a quarter its rows (the default of blocks that size), 1 and 4
    programs per expected block (PERSIST), wide B tiles
    (128 columns: 4 warps, and 8 at 64-row blocks) at one tile per program and at the default's
    columns per program, and one expand program per tile (the most programs)."""
    from lora_core.kernels import moe_configs
    out = []
    for rows in (shape.block_m // 2, shape.block_m // 4):
        if rows >= 16:                           # the default of blocks that size, on this alignment
            sub = moe_configs.default_moe_config(dataclasses.replace(shape, block_m=rows)).replace(
                BLOCK_M=rows, PERSIST=d.PERSIST)
            r = moe_configs.resolve(sub, shape)
            out.append(sub.replace(K_SPLIT=r.k_split, TILES_N=r.tiles_n, BLOCK_K=r.block_k, BLOCK_N=r.block_n,
                                   R_CHUNK=r.r_chunk))
    for persist in (1, 4):
        if persist != d.PERSIST:
            out.append(d.replace(PERSIST=persist))
    cols = d.BLOCK_N * d.TILES_N
    for warps in (4, 8) if shape.block_m >= 64 else (4,):
        for tiles in sorted({1, max(1, cols // 128)}):
            out.append(d.replace(BLOCK_N=128, TILES_N=tiles, expand_warps=warps, expand_stages=3))
    out.append(d.replace(TILES_N=1))
    return out


def candidates(shape, current: dict | None) -> list:
    """The bucket's candidate configs (module docstring), as dicts, the resolved default first, no duplicates."""
    from lora_core.kernels import moe_configs
    base = moe_configs.default_moe_config(shape)
    r = moe_configs.resolve(base, shape)
    d = base.replace(K_SPLIT=r.k_split, TILES_N=r.tiles_n, BLOCK_K=r.block_k, BLOCK_N=r.block_n,
                     R_CHUNK=r.r_chunk)
    out = [d]
    if current:
        out.append(d.replace(**current))
    if not shape.naive:
        out.extend(sorted_moves(d, shape))
    moves = [("K_SPLIT", max(1, d.K_SPLIT // 2)), ("K_SPLIT", d.K_SPLIT * 2),
             ("TILES_N", max(1, d.TILES_N // 2)), ("TILES_N", d.TILES_N * 2),
             ("BLOCK_K", max(16, d.BLOCK_K // 2)), ("BLOCK_K", d.BLOCK_K * 2),
             ("shrink_warps", 8 if d.shrink_warps == 4 else 4), ("expand_warps", 8 if d.expand_warps == 4 else 4),
             ("shrink_stages", d.shrink_stages + 1), ("shrink_stages", max(1, d.shrink_stages - 1)),
             ("expand_stages", d.expand_stages + 1), ("expand_stages", max(1, d.expand_stages - 1))]
    for knob, value in moves:
        out.append(d.replace(**{knob: value}))
    if d.BLOCK_N >= 32:
        out.append(d.replace(BLOCK_N=d.BLOCK_N // 2, TILES_N=d.TILES_N * 2))
    if d.TILES_N >= 2:
        out.append(d.replace(BLOCK_N=d.BLOCK_N * 2, TILES_N=d.TILES_N // 2))
    if shape.naive:
        out.append(d.replace(GEMV=not d.GEMV))
        if d.R_CHUNK > 16:
            out.append(d.replace(R_CHUNK=16))
    seen, unique = set(), []
    for c in out:
        key = tuple(sorted(c.as_dict().items()))
        if key not in seen:
            seen.add(key)
            unique.append(c.as_dict())
    return unique


def combine(results: list) -> dict | None:
    """The first candidate (the default) with every knob set to its value in a faster candidate that
    moved only that knob (None when fewer than two knobs won)."""
    ok = [r for r in results if r.get("us") is not None]
    if not ok or results[0].get("us") is None:
        return None
    base, base_us = results[0]["config"], results[0]["us"]
    best = {}
    for r in ok[1:]:
        changed = [k for k in base if r["config"][k] != base[k]]
        if r["us"] < base_us and changed:
            key = tuple(changed)
            if key not in best or r["us"] < best[key][0]:
                best[key] = (r["us"], {k: r["config"][k] for k in changed})
    if len(best) < 2:
        return None
    merged = dict(base)
    for _, values in sorted(best.values(), key=lambda v: -v[0]):      # the fastest move applied last
        merged.update(values)
    return merged


def _bucket_cases(models, model, layer, tokens, rank, slots, device, seed):
    """The bucket's timed cases: one adapter, and min(32, T, slots) adapters when T > 1 (8 for T <= 16)."""
    adapters = sorted({1, min(tokens, slots, 8 if tokens <= 16 else 32)})
    return [bench.Case(models[model], layer, tokens, d, rank, slots, device, seed + d) for d in adapters]


_WORKER_CASE: dict = {}


def _compile_job(job) -> str:
    """A worker's candidate: run once on its bucket's case (compiling its kernels into Triton's
    on-disk cache); the worker keeps its last bucket's case for the next candidate."""
    import torch

    from lora_core.kernels.moe_configs import MoeConfig, override_moe_config
    models, (model, layer, tokens, rank), slots, cfg, device = job
    try:
        key = (model, layer, tokens, rank)
        if key not in _WORKER_CASE:
            _WORKER_CASE.clear()
            _WORKER_CASE[key] = bench.Case(models[model], layer, tokens, 1, rank, slots, torch.device(device), 0)
        with override_moe_config(MoeConfig(**cfg)):
            _WORKER_CASE[key].ours()()
        if device == "cuda":
            torch.cuda.synchronize()
        return ""
    except Exception as e:                       # said; the timing compiles what is missing
        return f"{model} {layer} T{tokens} r{rank} {cfg}: {type(e).__name__}: {str(e)[:160]}"


def time_candidate(cfg: dict, cases, clock, tokens: int) -> dict:
    """{"config", "us" (summed over the cases) or "error"} of one candidate: checked, then timed."""
    from lora_core.kernels.moe_configs import MoeConfig, override_moe_config
    out = {"config": cfg}
    try:
        total, errs = 0.0, []
        with override_moe_config(MoeConfig(**cfg)):
            for case in cases:
                call = case.ours()
                err = case.error(call)
                errs.append(err)
                if not err <= MAX_ERR:
                    out["error"] = f"relative error {err:.2e} against the reference"
                    return out
                total += clock([call], tokens)
        out["us"], out["err"] = total, max(errs)
    except Exception as e:                       # a config the compiler refuses (resources): said, skipped
        out["error"] = f"{type(e).__name__}: {str(e)[:200]}"
    return out


def losing_cases(path: str, below: float = 1.0) -> list:
    """(model, layer, tokens, rank, speed-up) of every case of a `bench_moe_lora` result slower
    than `below` x vLLM: its moe_lora.json (rows with "speedup") or its moe_lora.md (the table)."""
    with open(path) as f:
        text = f.read()
    rows = []
    if path.endswith(".json"):
        data = json.loads(text)
        if not isinstance(data, dict) or not isinstance(data.get("rows"), list):
            raise ValueError(f"--losing {path}: expected a bench_moe_lora JSON with a list of rows")
        for r in data["rows"]:
            if r.get("speedup") is not None:
                rows.append((r["model"], r["layer"], int(r["tokens"]), int(r["rank"]), float(r["speedup"])))
    else:
        for line in text.splitlines():
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            if len(cells) >= 9 and cells[2].isdigit() and cells[4].isdigit():
                try:
                    rows.append((cells[0], cells[1], int(cells[2]), int(cells[4]), float(cells[8])))
                except ValueError:                   # "-": no vLLM time
                    continue
    if not rows:
        raise ValueError(f"--losing {path}: no case with a speed-up found")
    return [r for r in rows if r[4] < below]


def order_work(work: list, tuned: dict, losing: dict, only_untuned: bool) -> list:
    """The buckets in tuning order: those in `losing` ({key: worst speed-up}) first, the slowest
    first, then the ones the table lacks, then the tuned ones again, each group in its order; with
    only_untuned, the tuned ones are dropped (unless losing)."""
    first = sorted((w for w in work if w[5] in losing), key=lambda w: losing[w[5]])
    untuned = [w for w in work if w[5] not in losing and w[5] not in tuned]
    again = [] if only_untuned else [w for w in work if w[5] not in losing and w[5] in tuned]
    return first + untuned + again


def _write_json(path: str, data) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1, sort_keys=False)
        f.write("\n")
    os.replace(tmp, path)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--table", default="", help="the MoE table to update (default: lora_core/kernels/tuned/"
                                               "<device>_moe.json)")
    p.add_argument("--budget-s", type=float, default=150.0, help="stop starting buckets past this many seconds")
    p.add_argument("--compile-share", type=float, default=0.45,
                   help="share of the budget the parallel compilation may take at most")
    p.add_argument("--jobs", type=int, default=None,
                   help="worker processes compiling the candidates first (0: compile while timing; default: "
                        "the CPU count less 2, at most 14; --quick: 0)")
    p.add_argument("--quick", action="store_true", help="CPU, Triton's interpreter, tiny shapes (times mean nothing)")
    p.add_argument("--models", default="", help="comma list of model names (default: all)")
    p.add_argument("--layers", default="w13,w2", help="comma list of layers: w13, w2")
    p.add_argument("--tokens", default="", help="comma list of token counts")
    p.add_argument("--ranks", default="", help="comma list of ranks")
    p.add_argument("--max-candidates", type=int, default=0, help="candidates per bucket at most (0: all; "
                                                                 "--quick: 3)")
    p.add_argument("--losing", default="", help="a bench_moe_lora result (moe_lora.json or moe_lora.md): the "
                                                "buckets of its cases slower than vLLM go first, slowest first")
    p.add_argument("--losing-below", type=float, default=1.0,
                   help="with --losing: a case counts when its vLLM/ours speed-up is below this")
    p.add_argument("--only-untuned", action="store_true",
                   help="skip the buckets the table already holds (unless --losing names them)")
    args = p.parse_args(argv)
    limit = args.max_candidates or (3 if args.quick else 0)
    if args.quick:
        os.environ["TRITON_INTERPRET"] = "1"
    import torch
    cuda = not args.quick
    if cuda and not torch.cuda.is_available():
        print("needs a CUDA GPU (or --quick)", file=sys.stderr)
        return 2
    from bench_triton import Clock

    from lora_core.kernels import configs, moe_configs
    t0 = time.time()
    models = bench.QUICK_MODELS if args.quick else bench.MODELS
    if args.models:
        models = {m: models[m] for m in args.models.split(",")}
    layers = [v for v in args.layers.split(",") if v]
    if not layers or set(layers) - {"w13", "w2"}:
        p.error(f"--layers: expected a comma list of w13, w2, got {args.layers!r}")
    tokens = bench._ints(args.tokens) or (QUICK_TOKENS if args.quick else TOKENS)
    ranks = bench._ints(args.ranks) or (bench.QUICK_RANKS if args.quick else RANKS)
    slots = bench.QUICK_SLOTS if args.quick else bench.NUM_SLOTS
    device_name = torch.cuda.get_device_name() if cuda else "CPU interpreter"
    path = args.table or moe_configs.table_file(configs.device_name() or device_name)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    table = {"device": device_name, "format": 1, "buckets": {}}
    if os.path.exists(path):
        table["buckets"] = moe_configs.read_table(path)
    log = {"meta": bench.env_meta(cuda), "budget_s": args.budget_s, "buckets": {}}
    log_path = path + ".log.json"

    # 1. The buckets and their candidates (one bucket per key: the first (model, layer, T, r) that maps
    # to it), token counts outermost: a budget cut drops the largest batches of every layer alike.
    work, keys = [], set()
    for t in tokens:
        for model in models:
            for layer in layers:
                for r in ranks:
                    shape, key = bucket_of(models[model], layer, t, r, slots)
                    if key in keys:
                        continue
                    keys.add(key)
                    cands = candidates(shape, table["buckets"].get(key))
                    work.append((model, layer, t, r, shape, key, cands[:limit] if limit else cands))
    losing = {}
    if args.losing:
        for model, layer, t, r, speedup in losing_cases(args.losing, args.losing_below):
            if model in models and layer in layers:
                key = bucket_of(models[model], layer, t, r, slots)[1]
                losing[key] = min(speedup, losing.get(key, speedup))
        print(f"--losing: {len(losing)} buckets slower than {args.losing_below} x vLLM first", flush=True)
    work = order_work(work, table["buckets"], losing, args.only_untuned)
    print(f"{len(work)} buckets, {sum(len(w[-1]) for w in work)} candidates -> {path}", flush=True)

    # 2. Compilation in parallel, bounded by its share of the budget.
    jobs_n = args.jobs if args.jobs is not None else (0 if args.quick else max(1, min(14, (os.cpu_count() or 2) - 2)))
    if jobs_n > 0:
        dev = "cuda" if cuda else "cpu"
        jobs = [(models, (m, ly, t, r), slots, c, dev) for m, ly, t, r, _, _, cands in work for c in cands]
        try:
            failures = bench.pool_run(_compile_job, jobs, jobs_n, t0 + args.budget_s * args.compile_share)
        except Exception as e:                   # the pool itself failed: the timing compiles everything
            failures = [f"compile workers: {type(e).__name__}: {str(e)[:200]}"]
        log["compile_s"] = round(time.time() - t0, 1)
        log["compile_failures"] = failures
        print(f"compiled in {jobs_n} workers: {log['compile_s']} s; {len(failures)} failures", flush=True)

    # 3. Timing, bucket by bucket; each winner written at once.
    clock = Clock(cuda, target=lambda m: 32 if m <= 256 else 4)
    device = torch.device("cuda" if cuda else "cpu")
    skipped = []
    for i, (model, layer, t, r, _shape, key, cands) in enumerate(work):
        if time.time() - t0 > args.budget_s:
            skipped.append(key)
            continue
        cases = _bucket_cases(models, model, layer, t, r, slots, device, seed=1000 * (i + 1))
        results = [time_candidate(c, cases, clock, t) for c in cands]
        merged = combine(results)
        if merged is not None and merged not in cands and time.time() - t0 <= args.budget_s:
            results.append(time_candidate(merged, cases, clock, t))
        timed = [x for x in results if x.get("us") is not None]
        entry = {"case": f"{model} {layer} T{t} r{r}", "candidates": results}
        if timed:
            best = min(timed, key=lambda x: x["us"])
            table["buckets"][key] = best["config"]
            entry["winner_us"], entry["default_us"] = best["us"], results[0].get("us")
            print(f"{key} ({model} {layer} T{t} r{r}): {best['us']:.1f} us (default "
                  f"{bench._fmt(results[0].get('us'))}), {len(timed)}/{len(results)} ran", flush=True)
        else:
            print(f"{key}: no candidate ran: {results[0].get('error')}", flush=True)
        log["buckets"][key] = entry
        del cases
        _write_json(path, table)
        log["seconds"] = round(time.time() - t0, 1)
        log["skipped"] = skipped
        _write_json(log_path, log)
    log["skipped"] = skipped
    log["seconds"] = round(time.time() - t0, 1)
    _write_json(path, table)
    _write_json(log_path, log)
    print(f"{len(work) - len(skipped)} buckets tuned, {len(skipped)} skipped (budget) in {log['seconds']} s: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
