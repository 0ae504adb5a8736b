"""Tunes `gemm_lora` (the base GEMM with the LoRA expand in its epilogue) per (layer, M bucket, rank)
and writes the fused-or-today decision of each into the fused linear table.

    PYTHONPATH=. python benchmarks/tune_fused_linear.py --table $OUT/NVIDIA_H200_fused_linear.json \\
        --budget-s 180 --jobs 14                                          # H200, about 200 s
    PYTHONPATH=. python benchmarks/tune_fused_linear.py --quick --table /tmp/fl.json   # CPU interpreter, tiny

What it tunes: the layers of `--models` (llama3-8b: qkv 4096 -> 4096 + 1024 + 1024, o 4096 ->
4096, gate_up 4096 -> 14336 + 14336, down 14336 -> 4096, the shapes Mistral-7B has too; qwen2-7b:
qkv 3584 -> 3584 + 512 + 512, o 3584 -> 3584, gate_up 3584 -> 18944 + 18944, down 18944 -> 3584)
at the row counts of lora_core.kernels.fused_linear_configs.M_BUCKETS (the e2e decode batches 8,
1, 32, 128 first: a budget cut drops the others) and `--ranks` (16; 64 if asked), bf16, D =
min(M, 8) adapters among 32 slots, every row its own request (bench_fused_linear's decode mapping).

Per case, every figure is us per call from a CUDA graph of many calls replayed (`bench_triton.Clock`),
the calls rotating over enough input sets that the weights they read exceed 2x the L2:
  1. cublas: `F.linear(x, W)`; today: cuBLAS + `PunicaWrapper.add_lora_linear` (the library path);
  2. epilogue: `gemm_lora` with the shrink buffer given, for each candidate (`candidates`: the
     current GEMM_CONFIGS entry, then BLOCK_M 16-128 x BLOCK_N 32-256 x split-K 1-8 whose program
     count is within [SMS / 2, 8 SMS], each with a few (BLOCK_K 64-256, warps, stages) that fit in
     shared memory, closest to 2 programs per SM first, `--max-candidates` kept, and variants of
     the best few: GROUP_M 8 with several row tiles, the other LORA_MODE at 16-64 rows, PREFETCH_B
     in rows mode); each checked against float64 (relative error <= 2e-2) before it is timed;
  3. fused: `PunicaWrapper.add_shrink` + `gemm_lora`, for the FUSED_TOP best epilogue configs:
     what the fused LoRA linear runs; its best config is the entry's `config`;
  4. nolora: `gemm_lora` without LoRA for the same configs and the default (recorded, not
     decided on: the fused GEMM serves LoRA steps only, steps without LoRA keep cuBLAS);
  5. for the layers whose input is an RMSNorm's output (NORMED: qkv, gate_up; x is then the
     RMSNorm of a residual h, rounded as Hugging Face's LlamaRMSNorm): norm: `rms_norm_shrink`
     (the norm and the LoRA shrink in one kernel, its default launch config) + `gemm_lora` with
     the entry's config, what the fused "norm" path runs; today_with_norm: the base step's own
     norm (torch ops, as benchmarks/e2e_decode.py's TorchDecoder runs it) + cuBLAS +
     add_lora_linear.
Decisions: use_fused = fused <= (1 - --margin) * today (`reason` says the figures); for the NORMED
layers also use_norm_fused = norm <= (1 - --margin) * today_with_norm (`norm_reason`).

Compilation comes first and in parallel: `--jobs` worker processes run every distinct launch
(candidate x with / without LoRA, today's kernels and, for the NORMED layers, `rms_norm_shrink`
per case) once, into Triton's on-disk cache,
bounded by `--compile-share` of the budget; then the timing runs alone on the GPU.

Output: `--table` (default lora_core/kernels/tuned/<device>_fused_linear.json, the file
lora_core.kernels.fused_linear_configs reads) gets each case's entry as soon as it is done
(entries already in the file are kept), so a run cut by `--budget-s` leaves what it finished, and
`--skip-done` resumes it; `<table>.log.json` beside it keeps every candidate's time or failure.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

MODELS = {
    "llama3-8b": {"qkv": (4096, (4096, 1024, 1024)), "o": (4096, (4096,)), "gate_up": (4096, (14336, 14336)),
                  "down": (14336, (4096,))},
    "qwen2-7b": {"qkv": (3584, (3584, 512, 512)), "o": (3584, (3584,)), "gate_up": (3584, (18944, 18944)),
                 "down": (18944, (3584,))},
}
QUICK_MODELS = {"tiny": {"qkv": (128, (64, 32, 32)), "down": (192, (64,))}}
NORMED = ("qkv", "gate_up")                     # the layers whose input is an RMSNorm's output
# rms_norm_shrink's config in Triton's interpreter (--quick: few programs); on a GPU its launcher's default
QUICK_NORM_CONFIG = dict(BLOCK_M=4, BLOCK_K=64, SPLIT_K=2, LORA_MODE="rows")
MS = (8, 1, 32, 128, 16, 64, 256)              # the e2e decode batches first
QUICK_MS = (1, 8)
RANKS = (16,)
NUM_SLOTS = 32
QUICK_SLOTS = 4
MAX_ERR = 2e-2
FUSED_TOP = 2                                   # epilogue winners timed with the shrink in front
NOLORA_TOP = 2                                  # epilogue winners timed without LoRA (+ the default)
SMEM_BYTES = 200 * 1024                         # the operand tiles' pipeline must fit (H200: 228 KiB)
FALLBACK_SMS = 132


def k_choices(bm: int, bn: int) -> list:
    """(BLOCK_K, warps, stages) per tile shape: deep pipelines of 128-wide K chunks, 256-wide chunks
    with 4 or 8 warps, 64-wide with many stages (skinny tiles are bandwidth bound: the loads in
    flight matter, not the math)."""
    out = [(128, 4, 4), (256, 4, 3), (128, 4, 6), (256, 8, 3), (64, 4, 6)]
    if bm >= 64:
        out = [(64, 4, 4), (64, 8, 3), (128, 8, 3), (64, 4, 3)]
    if bn >= 256:
        out.append((64, 8, 4))
    return [(bk, w, st) for bk, w, st in out if st * (bm + bn) * bk * 2 <= SMEM_BYTES]


def candidates(m: int, k: int, widths: tuple, sms: int, limit: int) -> list:
    """The case's candidate configs (module docstring), the current default first, no duplicates."""
    from lora_core.kernels.fused_linear_configs import gemm_config
    n = sum(widths)
    default = gemm_config(m, widths)
    bms = (16,) if m <= 16 else (16, 32) if m <= 32 else (32, 64) if m <= 64 else (64, 128)
    scored = []
    for bm in bms:
        row_tiles = -(-m // bm)
        for bn in (32, 64, 128, 256):
            if any(w % bn for w in widths[:-1]) or bn > max(32, 2 * n):
                continue
            tiles = row_tiles * -(-n // bn)
            for split in (1, 2, 4, 8):
                if split > 1 and k // split < 512:
                    continue
                programs = tiles * split
                if not sms / 2 <= programs <= 8 * sms and not (split == 1 and programs < sms / 2):
                    continue
                for i, (bk, w, st) in enumerate(k_choices(bm, bn)):
                    cfg = dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, num_warps=w, num_stages=st, SPLIT_K=split,
                               GROUP_M=1)
                    scored.append((abs(math.log2(programs / (2 * sms))) + 0.35 * i + 0.2 * (split > 1), cfg))
    scored.sort(key=lambda t: t[0])
    mode = "rows" if m <= 32 else "slots"
    out = _unique([default] + [{**c, "LORA_MODE": mode} for _, c in scored])[:max(1, limit)]
    return _unique(out + variants(out[:2], m))


def variants(best: list, m: int) -> list:
    """More candidates from the first few: GROUP_M 8 with several row tiles, the other LORA_MODE at
    16-64 rows, PREFETCH_B in rows mode."""
    out = []
    for cfg in best:
        mode = cfg.get("LORA_MODE", "rows" if m <= 32 else "slots")
        if -(-m // cfg["BLOCK_M"]) > 1:
            out.append({**cfg, "GROUP_M": 8})
        if 16 <= m <= 64:
            out.append({**cfg, "LORA_MODE": "slots" if mode == "rows" else "rows"})
        if mode == "rows":
            out.append({**cfg, "LORA_MODE": "rows", "PREFETCH_B": True})
    return out


def without_lora(cfg: dict) -> dict:
    """cfg without the epilogue's keys (the GEMM alone)."""
    return {k: v for k, v in cfg.items() if k not in ("LORA_MODE", "PREFETCH_B", "R_CHUNK")}


def _unique(cfgs: list) -> list:
    """cfgs without duplicates, SPLIT_K and GROUP_M written out (1 when absent)."""
    seen, out = set(), []
    for c in cfgs:
        c = {**c, "SPLIT_K": c.get("SPLIT_K", 1), "GROUP_M": c.get("GROUP_M", 1)}
        key = tuple(sorted(c.items()))
        if key not in seen:
            seen.add(key)
            out.append(dict(c))
    return out


class Case:
    """One (layer, M, rank): input sets rotating past the L2, the adapters' mapping, the references."""

    def __init__(self, k, widths, m, rank, slots_n, quick, device, seed, normed=False):
        import bench_fused_linear as bfl
        import torch
        from bench_triton import make_mapping

        import torch_lora
        self.k, self.widths, self.m, self.rank = k, tuple(widths), m, rank
        self.normed = normed
        self.norm_config = QUICK_NORM_CONFIG if quick else None
        gen = torch.Generator().manual_seed(seed)
        d = min(m, 8, slots_n)
        idx = make_mapping("dec", m, d, slots_n, 0.0, gen)
        ids = list(range(1, slots_n + 1))
        mapped = tuple(0 if i < 0 else ids[i] for i in idx.tolist())
        self.punica = torch_lora.PunicaWrapper(max(m, 16), max(m, 16), device, max_loras=slots_n)
        self.punica.update_metadata(torch_lora.LoRAMapping(mapped, mapped, is_prefill=False), ids, slots_n, 32000)
        self.slots = idx.to(device)
        self.d = d
        n_sets = 1 if quick else max(1, math.ceil(2 * bfl.L2_BYTES / (k * sum(widths) * 2)))
        self.sets = [bfl.InputSet(k, widths, m, rank, slots_n, normed, gen, device) for _ in range(n_sets)]
        s0 = self.sets[0]
        self.punica.add_shrink(s0.buf, s0.x, s0.a, 1.0)
        self.ref = s0.reference(self.slots, self.widths)
        self.ref_base = s0.reference(self.slots, self.widths, lora=False)
        for s in self.sets[1:]:
            self.punica.add_shrink(s.buf, s.x, s.a, 1.0)
        if normed:                                  # the norm path's shrink planes (P, S, M, R), one per set
            from torch_lora.ops.fused_linear import rms_norm_shrink
            for s in self.sets:
                s.planes = rms_norm_shrink(s.h, s.g, bfl.EPS, s.a, self.slots, 1.0, out=s.xn,
                                           config=self.norm_config)[1]

    # the timed calls, one per input set
    def cublas(self):
        import torch.nn.functional as F
        return [lambda s=s: F.linear(s.x, s.w) for s in self.sets]

    def today(self):
        import torch.nn.functional as F
        punica, widths = self.punica, self.widths

        def call(s):
            y = F.linear(s.x, s.w)
            punica.add_lora_linear(y, s.x, s.a, s.b, None, 1.0, widths)
            return y
        return [lambda s=s: call(s) for s in self.sets]

    def epilogue(self, cfg):
        from torch_lora.ops.fused_linear import gemm_lora
        return [lambda s=s: gemm_lora(s.x, s.w, None, s.buf, s.b, self.slots, self.widths, y=s.y, config=cfg)
                for s in self.sets]

    def fused(self, cfg):
        from torch_lora.ops.fused_linear import gemm_lora

        def call(s):
            self.punica.add_shrink(s.buf, s.x, s.a, 1.0)
            return gemm_lora(s.x, s.w, None, s.buf, s.b, self.slots, self.widths, y=s.y, config=cfg)
        return [lambda s=s: call(s) for s in self.sets]

    def nolora(self, cfg):
        from torch_lora.ops.fused_linear import gemm_lora
        plain = without_lora(cfg)
        return [lambda s=s: gemm_lora(s.x, s.w, None, None, None, None, None, y=s.y, config=plain)
                for s in self.sets]

    def rms_norm(self):
        """The base step's RMSNorm alone (torch ops, LlamaRMSNorm's rounding)."""
        import bench_fused_linear as bfl
        return [lambda s=s: bfl.hf_rms_norm(s.h, s.g) for s in self.sets]

    def today_with_norm(self):
        """The base step's RMSNorm, then today's path (cuBLAS + add_lora_linear) on its output."""
        import bench_fused_linear as bfl
        import torch.nn.functional as F
        punica, widths = self.punica, self.widths

        def call(s):
            xn = bfl.hf_rms_norm(s.h, s.g)
            y = F.linear(xn, s.w)
            punica.add_lora_linear(y, xn, s.a, s.b, None, 1.0, widths)
            return y
        return [lambda s=s: call(s) for s in self.sets]

    def norm(self, cfg):
        """The fused "norm" path: rms_norm_shrink (norm + shrink), then gemm_lora with config cfg."""
        import bench_fused_linear as bfl

        from torch_lora.ops.fused_linear import gemm_lora, rms_norm_shrink

        def call(s):
            rms_norm_shrink(s.h, s.g, bfl.EPS, s.a, self.slots, 1.0, out=s.xn, buf=s.planes, config=self.norm_config)
            return gemm_lora(s.xn, s.w, None, s.planes, s.b, self.slots, self.widths, y=s.y, config=cfg)
        return [lambda s=s: call(s) for s in self.sets]

    def error(self, calls, lora=True) -> float:
        import bench_fused_linear as bfl
        return bfl.rel_err(calls[0](), self.ref if lora else self.ref_base)


def timed(clock, case, calls, m, lora=True) -> dict:
    """{"us", "err"} of one set of calls, or {"error"}: checked first, then timed."""
    try:
        err = case.error(calls, lora)
        if not err <= MAX_ERR:
            return {"error": f"relative error {err:.2e} against float64"}
        return {"us": clock(calls, m), "err": err}
    except Exception as e:                          # a config the compiler refuses (resources): said, skipped
        return {"error": f"{type(e).__name__}: {str(e)[:200]}"}


def decide(row: dict, margin: float) -> tuple:
    """(use_fused, reason) from a case's timings: the fused LoRA linear where it beats cuBLAS +
    add_lora_linear by the margin."""
    fused, today, cublas = row.get("fused_us"), row.get("today_us"), row.get("cublas_us")
    if fused is None or today is None:
        return False, "no fused or today's timing (the tuner could not run it)"
    figures = f"fused {fused:.1f} us, today {today:.1f} us, cuBLAS {cublas:.1f} us"
    if fused <= (1 - margin) * today:
        return True, f"{figures}: the fused GEMM beats today's path by {100 * (1 - fused / today):.1f}%"
    return False, f"{figures}: the fused GEMM is not {100 * margin:.0f}% faster than today's path"


def decide_norm(row: dict, margin: float) -> tuple:
    """(use_norm_fused, norm_reason) of a layer behind an RMSNorm: the fused "norm" path
    (rms_norm_shrink + gemm_lora) where it beats the base step's norm + cuBLAS + add_lora_linear by
    the margin."""
    norm, today = row.get("norm_us"), row.get("today_with_norm_us")
    if norm is None or today is None:
        return False, "no norm path or today-with-norm timing (the tuner could not run it)"
    figures = f"norm path {norm:.1f} us, norm + today {today:.1f} us"
    if norm <= (1 - margin) * today:
        return True, f"{figures}: the norm path beats the norm + today's path by {100 * (1 - norm / today):.1f}%"
    return False, f"{figures}: the norm path is not {100 * margin:.0f}% faster than the norm + today's path"


# ------------------------------------------------------------------------------ parallel compilation

_WORKER: dict = {}


def _compile_job(job) -> str:
    """A worker's launch: run once (compiling into Triton's on-disk cache) on empty tensors of the
    case's shape; kind "lora" / "nolora" one gemm_lora config, "today" add_shrink + add_lora_linear,
    "norm" rms_norm_shrink with config cfg (None: its default)."""
    import torch

    import torch_lora
    from torch_lora.ops.fused_linear import gemm_lora, rms_norm_shrink
    number, kind, (k, widths, m, rank, slots_n), cfg, device = job
    try:
        key = (k, widths, m, rank)
        if key not in _WORKER:
            _WORKER.clear()
            dev = torch.device(device)
            bf = torch.bfloat16
            n = sum(widths)
            t = dict(x=torch.zeros(m, k, dtype=bf, device=dev), w=torch.zeros(n, k, dtype=bf, device=dev),
                     a=[torch.zeros(slots_n, rank, k, dtype=bf, device=dev) for _ in widths],
                     b=[torch.zeros(slots_n, wd, rank, dtype=bf, device=dev) for wd in widths],
                     y=torch.zeros(m, n, dtype=bf, device=dev),
                     buf=torch.zeros(len(widths), m, rank, dtype=torch.float32, device=dev),
                     slots=torch.arange(m, dtype=torch.int32, device=dev) % slots_n)
            ids = list(range(1, slots_n + 1))
            mapped = tuple(1 + i % slots_n for i in range(m))
            punica = torch_lora.PunicaWrapper(max(m, 16), max(m, 16), dev, max_loras=slots_n)
            punica.update_metadata(torch_lora.LoRAMapping(mapped, mapped, is_prefill=False), ids, slots_n, 32000)
            t["punica"] = punica
            _WORKER[key] = t
        t = _WORKER[key]
        if kind == "today":
            t["punica"].add_shrink(t["buf"], t["x"], t["a"], 1.0)
            t["punica"].add_lora_linear(t["y"], t["x"], t["a"], t["b"], None, 1.0, widths)
        elif kind == "norm":
            rms_norm_shrink(t["x"], t["x"][0], 1e-5, t["a"], t["slots"], 1.0, config=cfg)
        elif kind == "lora":
            gemm_lora(t["x"], t["w"], None, t["buf"], t["b"], t["slots"], widths, y=t["y"], config=cfg)
        else:
            gemm_lora(t["x"], t["w"], None, None, None, None, None, y=t["y"], config=without_lora(cfg))
        if device == "cuda":
            torch.cuda.synchronize()
        return ""
    except Exception as e:                       # said; the timing compiles what is missing (or fails it)
        return f"#{number} {kind} K{k} N{widths} M{m} r{rank} {cfg}: {type(e).__name__}: {str(e)[:160]}"


def _plan_key(kind, shape, cfg):
    """What decides the compiled kernel of a launch (its constexprs, warps, stages, and how its
    integer arguments specialize)."""
    from lora_core.kernels.gemm_lora import plan_gemm_lora
    k, widths, m, rank, _ = shape
    if kind in ("today", "norm"):
        return (kind, k, len(widths) if kind == "norm" else widths, m, rank)
    try:
        lora = kind == "lora"
        cfg = cfg if lora else without_lora(cfg)
        plan = plan_gemm_lora(m, sum(widths), k, widths, rank if lora else 16, "bfloat16", "bfloat16",
                              "bfloat16" if lora else None, cfg, has_bias=False, add_inputs=False, has_lora=lora,
                              has_ranks=False)
    except ValueError:
        return (kind, k, widths, m, rank, tuple(sorted(cfg.items())))
    # Triton specializes integer arguments equal to 1 or divisible by 16: the layer's sizes, the
    # split's K chunk, the slices' first tiles and their B strides
    ints = (sum(widths), k, plan.k_per_split, *plan.slice_tiles, *(w * rank for w in widths))
    spec = tuple((v == 1, v % 16 == 0) for v in ints)
    return (tuple(sorted(plan.constexprs.items())), plan.num_warps, plan.num_stages, spec)


def _write_json(path: str, data) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1)
        f.write("\n")
    os.replace(tmp, path)


def _ints(text: str) -> tuple:
    return tuple(int(v) for v in text.split(",") if v.strip())


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--table", default="", help="the table to update (default: lora_core/kernels/tuned/"
                                               "<device>_fused_linear.json)")
    p.add_argument("--budget-s", type=float, default=180.0, help="start no case past this many seconds")
    p.add_argument("--compile-share", type=float, default=0.4,
                   help="share of the budget the parallel compilation may take at most")
    p.add_argument("--jobs", type=int, default=None,
                   help="worker processes compiling every launch first (0: compile while timing; default: the "
                        "CPU count less 2, at most 14; --quick: 0)")
    p.add_argument("--quick", action="store_true", help="CPU, Triton's interpreter, tiny shapes (times mean nothing)")
    p.add_argument("--models", default="llama3-8b", help=f"comma list among {sorted(MODELS)}")
    p.add_argument("--layers", default="", help="comma list of layers (default: all of each model)")
    p.add_argument("--ms", default="", help="comma list of row counts (default: the M buckets, e2e batches first)")
    p.add_argument("--ranks", default="", help="comma list of ranks (default 16)")
    p.add_argument("--max-candidates", type=int, default=0,
                   help="generated candidates per case at most, before the variants (default 10; --quick 2)")
    p.add_argument("--margin", type=float, default=0.02,
                   help="use_fused only where fused <= (1 - margin) * today (default 0.02)")
    p.add_argument("--skip-done", action="store_true", help="skip cases whose entry the table holds already")
    args = p.parse_args(argv)
    limit = args.max_candidates or (2 if args.quick else 10)
    if args.quick:
        os.environ["TRITON_INTERPRET"] = "1"
    import torch
    cuda = not args.quick
    if cuda and not torch.cuda.is_available():
        print("needs a CUDA GPU (or --quick)", file=sys.stderr)
        return 2
    torch.backends.cuda.matmul.allow_tf32 = False
    from bench_moe_lora import pool_run
    from bench_triton import Clock, kernel_bench_meta

    from lora_core.kernels import configs
    from lora_core.kernels import fused_linear_configs as flc
    t0 = time.time()
    models = QUICK_MODELS if args.quick else {m: MODELS[m] for m in args.models.split(",") if m}
    layers = [v for v in args.layers.split(",") if v]
    ms = _ints(args.ms) or (QUICK_MS if args.quick else MS)
    if any(flc.m_bucket(m) != m for m in ms):
        p.error(f"--ms: every row count must be one of the table's M buckets {flc.M_BUCKETS}, got {ms}")
    ranks = _ints(args.ranks) or ((8,) if args.quick else RANKS)
    slots_n = QUICK_SLOTS if args.quick else NUM_SLOTS
    device_name = torch.cuda.get_device_name() if cuda else "CPU interpreter"
    sms = torch.cuda.get_device_properties(0).multi_processor_count if cuda else FALLBACK_SMS
    path = args.table or flc.fused_linear_table_file(configs.device_name() or device_name)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    table = {"device": device_name, "format": 1, "margin": args.margin,
             "base_path": "steps without LoRA keep the library GEMM; use_fused concerns LoRA steps only",
             "entries": {}}
    if os.path.exists(path):
        table["entries"] = flc.read_fused_linear_table(path)
    log = {"meta": kernel_bench_meta(cuda, slots=slots_n, sms=sms), "budget_s": args.budget_s, "cases": {}}
    log_path = path + ".log.json"

    # 1. The cases (rows outermost: a budget cut drops whole row counts) and their candidates.
    work = []
    for m in ms:
        for model, shapes in models.items():
            for layer, (k, widths) in shapes.items():
                if layers and layer not in layers:
                    continue
                for r in ranks:
                    key = flc.table_key((k, widths), m, r)
                    if any(w[0] == key for w in work) or (args.skip_done and key in table["entries"]):
                        continue
                    work.append((key, model, layer, k, widths, m, r, candidates(m, k, widths, sms, limit)))
    print(f"{len(work)} cases, {sum(len(w[-1]) for w in work)} candidates -> {path}", flush=True)

    # 2. Compilation in parallel, bounded by its share of the budget (what is left compiles while
    # timing); a launch that failed to compile is not tried again.
    failed: dict = {}
    jobs_n = args.jobs if args.jobs is not None else (0 if args.quick else max(1, min(14, (os.cpu_count() or 2) - 2)))
    if jobs_n > 0:
        dev = "cuda" if cuda else "cpu"
        jobs, seen = [], set()
        for _key, _model, layer, k, widths, m, r, cands in work:
            shape = (k, tuple(widths), m, r, slots_n)
            norm = [("norm", QUICK_NORM_CONFIG if args.quick else None)] if layer in NORMED else []
            for kind, cfg in [("today", None)] + norm + [(kd, c) for c in cands for kd in ("lora", "nolora")]:
                pk = _plan_key(kind, shape, cfg)
                if pk not in seen:
                    seen.add(pk)
                    jobs.append((len(jobs), kind, shape, cfg, dev))
        try:
            failures = pool_run(_compile_job, jobs, jobs_n, t0 + args.budget_s * args.compile_share)
        except Exception as e:                   # the pool itself failed: the timing compiles everything
            failures = [f"compile workers: {type(e).__name__}: {str(e)[:200]}"]
        for msg in failures:
            if msg.startswith("#"):
                _n, kind, shape, cfg, _dev = jobs[int(msg[1:].split(" ", 1)[0])]
                failed[_plan_key(kind, shape, cfg)] = msg.split(" ", 1)[1]
        log["compile_s"] = round(time.time() - t0, 1)
        log["compile_jobs"] = len(jobs)
        log["compile_failures"] = failures
        print(f"compiled {len(jobs)} launches in {jobs_n} workers: {log['compile_s']} s; {len(failures)} failures",
              flush=True)

    # 3. Timing, case by case; each entry written at once.
    clock = Clock(cuda)
    device = torch.device("cuda" if cuda else "cpu")
    skipped = []
    for i, (key, model, layer, k, widths, m, r, cands) in enumerate(work):
        if time.time() - t0 > args.budget_s:
            skipped.append(key)
            continue
        t_case = time.time()
        with torch.no_grad():
            case = Case(k, widths, m, r, slots_n, args.quick, device, seed=1000 + i, normed=layer in NORMED)
            row = {"case": f"{model} {layer} M{m} r{r}", "D": case.d, "n_sets": len(case.sets)}
            row["cublas_us"] = clock(case.cublas(), m)
            today = timed(clock, case, case.today(), m)
            row["today_us"] = today.get("us")
            shape = (k, tuple(widths), m, r, slots_n)
            results = [{"config": c, "error": f"did not compile: {failed[_plan_key('lora', shape, c)]}"}
                       if _plan_key("lora", shape, c) in failed else
                       {"config": c, **timed(clock, case, case.epilogue(c), m)} for c in cands]
            ok = sorted((x for x in results if "us" in x), key=lambda x: x["us"])
            row["epilogue"] = results
            fused = [{"config": x["config"], **timed(clock, case, case.fused(x["config"]), m)} for x in ok[:FUSED_TOP]]
            row["fused"] = fused
            fused_ok = sorted((x for x in fused if "us" in x), key=lambda x: x["us"])
            nolora_cfgs = _unique([without_lora(c) for c in [cands[0]] + [x["config"] for x in ok[:NOLORA_TOP]]])
            nolora = [{"config": c, **timed(clock, case, case.nolora(c), m, lora=False)} for c in nolora_cfgs]
            row["nolora"] = nolora
            nolora_ok = [x for x in nolora if "us" in x]
            if case.normed:
                row["rms_norm_us"] = clock(case.rms_norm(), m)
                row["today_with_norm_us"] = timed(clock, case, case.today_with_norm(), m).get("us")
                if fused_ok and _plan_key("norm", shape, case.norm_config) in failed:
                    row["norm"] = {"error": f"did not compile: {failed[_plan_key('norm', shape, case.norm_config)]}"}
                elif fused_ok:
                    best_cfg = fused_ok[0]["config"]
                    row["norm"] = {"config": best_cfg, **timed(clock, case, case.norm(best_cfg), m)}
                    row["norm_us"] = row["norm"].get("us")
        if fused_ok:
            best = fused_ok[0]
            row.update(fused_us=best["us"], epilogue_us=next(x["us"] for x in ok if x["config"] == best["config"]),
                       config=best["config"])
        if nolora_ok:
            row["nolora_us"] = min(x["us"] for x in nolora_ok)
            row["nolora_vs_cublas"] = row["nolora_us"] / row["cublas_us"]
        use, reason = decide(row, args.margin)
        if "config" in row:
            entry = {"config": row["config"], "use_fused": use, "reason": reason,
                     **{f: round(row[f], 3) for f in ("cublas_us", "today_us", "epilogue_us", "fused_us", "nolora_us",
                                                      "nolora_vs_cublas") if row.get(f) is not None},
                     "case": row["case"]}
            if case.normed:
                use_norm, norm_reason = decide_norm(row, args.margin)
                entry.update(use_norm_fused=use_norm, norm_reason=norm_reason,
                             **{f: round(row[f], 3) for f in ("norm_us", "today_with_norm_us", "rms_norm_us")
                                if row.get(f) is not None})
            table["entries"][key] = entry
        row["seconds"] = round(time.time() - t_case, 1)
        log["cases"][key] = row
        print(f"{key} ({row['case']}): cuBLAS {row['cublas_us']:.1f} today {_fmt(row.get('today_us'))} epilogue "
              f"{_fmt(row.get('epilogue_us'))} fused {_fmt(row.get('fused_us'))} no-LoRA {_fmt(row.get('nolora_us'))} "
              f"-> {'FUSED' if use else 'today'}"
              + (f"; norm + today {_fmt(row.get('today_with_norm_us'))} norm path {_fmt(row.get('norm_us'))} -> "
                 f"{'NORM' if table['entries'].get(key, {}).get('use_norm_fused') else 'norm + above'}"
                 if case.normed else "")
              + f" ({len(ok)}/{len(results)} ran, {row['seconds']} s)", flush=True)
        del case
        if cuda:
            torch.cuda.empty_cache()
        log["skipped"] = skipped
        log["seconds"] = round(time.time() - t0, 1)
        _write_json(path, table)
        _write_json(log_path, log)
    log["skipped"] = skipped
    log["seconds"] = round(time.time() - t0, 1)
    _write_json(path, table)
    _write_json(log_path, log)
    fused_n = sum(e["use_fused"] for e in table["entries"].values())
    norm_n = sum(e.get("use_norm_fused", False) for e in table["entries"].values())
    print(f"{len(work) - len(skipped)} cases tuned, {len(skipped)} skipped (budget) in {log['seconds']} s; "
          f"{fused_n} of {len(table['entries'])} entries use the fused GEMM, {norm_n} the norm path: {path}")
    return 0


def _fmt(v) -> str:
    return "-" if v is None else f"{v:.1f}"


if __name__ == "__main__":
    sys.exit(main())
