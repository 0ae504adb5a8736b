"""The fused linear kernels against cuBLAS and today's LoRA path, at Llama-3-8B layer shapes (one GPU).

    PYTHONPATH=. python benchmarks/bench_fused_linear.py --out $OUT        # H200, ~6 min
    PYTHONPATH=. python benchmarks/bench_fused_linear.py --quick --out /tmp/f  # CPU interpreter, tiny shapes

Layers (bf16, nn.Linear layout W (N, K)): qkv 4096 -> 4096 + 1024 + 1024, o 4096 -> 4096, gate_up
4096 -> 14336 + 14336, down 14336 -> 4096; M (rows) in 1, 8, 32, 128, 256, 2048, 8192; rank 16 (and
64 at M 8, 32, 256 with the rank-16 winners' configs); D = min(M, 8) adapters among 32 slots (decode:
every row its own request, shuffled; M >= 2048: 4 contiguous prefill runs).

Per (layer, M, rank), every figure is us per call from a CUDA graph of many calls replayed (median
of the replays), the calls rotating over enough input sets (weights, adapters, x, y) that the
weights they read exceed 2x the 60 MB L2:
  * cublas: `torch.nn.functional.linear(x, W)`, the base alone;
  * triton_nolora: `gemm_lora` without slots (the GEMM alone), best of a small config grid; the
    target is within 2% of cuBLAS at every decode shape;
  * today: cuBLAS + `PunicaWrapper.add_lora_linear` (what torch_lora.layers runs);
  * epilogue: `gemm_lora` with the shrink buffer given (the expand in the epilogue), best of the
    grid (its config is the tuning result);
  * fused: `PunicaWrapper.add_shrink` + `gemm_lora` (best config): today's replacement;
  * for qkv and gate_up (inputs of an RMSNorm): hf_norm (torch ops as LlamaRMSNorm), triton_norm
    (`rms_norm_shrink` without LoRA), norm_shrink (with the shrink, best of a small grid), and the
    chains chain_base (hf_norm + cuBLAS), chain_today (+ add_lora_linear) and chain_fused
    (`rms_norm_shrink` + `gemm_lora`).
Errors: relative Frobenius error against a float64 reference on input set 0 (x @ W.T + each row's
(x @ A[slot].T) @ B[slot].T; for the normed layers x is the HF-rounded norm of h).
Output: `fused_linear.json` (meta, rows, every grid timing, skipped cases) and `fused_linear.md` in
--out, rewritten after every case. `--budget-s` skips what would start past it (listed). Configs in
the markdown: BLOCK_M/BLOCK_N/BLOCK_K/num_warps/num_stages/SPLIT_K/GROUP_M[/LORA_MODE][/prefetch B];
rms_norm_shrink's: BLOCK_M/BLOCK_K/num_warps/num_stages/SPLIT_K (its planes)/LORA_MODE. The JSON
keeps every grid point (`grid_nolora`, `grid_epilogue`, `grid_norm_shrink`).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

LAYERS = {"qkv": (4096, (4096, 1024, 1024)), "o": (4096, (4096,)), "gate_up": (4096, (14336, 14336)),
          "down": (14336, (4096,))}
QUICK_LAYERS = {"qkv": (128, (64, 32, 32)), "down": (192, (64,))}
NORMED = ("qkv", "gate_up")
MS = (8, 32, 1, 128, 256, 2048, 8192)             # decode first: what the targets are about
QUICK_MS = (5,)
R64_MS = (8, 32, 256)
NUM_SLOTS = 32
L2_BYTES = 60e6
EPS = 1e-5


def gemm_grid(m: int) -> list:
    """The small config grid of gemm_lora per row count (compile time counts: ~25 configs in all)."""
    def c(bm, bn, bk, w, st, split=1, group=1, prefetch=False):
        cfg = dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, num_warps=w, num_stages=st, SPLIT_K=split, GROUP_M=group)
        return {**cfg, "PREFETCH_B": True} if prefetch else cfg
    if m <= 16:
        # o and down have N = 4096: 64 column tiles of 64 leave half the SMs idle; 32-wide tiles or
        # split-K fill them
        return [c(16, 32, 128, 4, 5), c(16, 64, 128, 4, 4), c(16, 64, 256, 4, 3), c(16, 64, 128, 4, 4, 2),
                c(16, 32, 128, 4, 4, 2), c(16, 64, 128, 4, 4, 4), c(16, 128, 128, 4, 4),
                c(16, 32, 128, 4, 5, prefetch=True)]
    if m <= 32:
        return [c(32, 32, 128, 4, 5), c(32, 64, 128, 4, 4), c(16, 64, 128, 4, 4), c(32, 64, 128, 4, 4, 2),
                c(32, 32, 128, 4, 4, 2), c(32, 32, 128, 4, 5, prefetch=True)]
    if m <= 128:
        return [c(64, 128, 64, 4, 4), c(128, 128, 64, 8, 3), c(64, 64, 128, 4, 4), c(128, 64, 64, 4, 4)]
    if m <= 256:
        return [c(128, 128, 64, 8, 3), c(128, 256, 64, 8, 3), c(64, 128, 64, 4, 4), c(128, 128, 64, 4, 4)]
    return [c(128, 256, 64, 8, 3, group=8), c(128, 128, 64, 8, 4, group=8), c(128, 128, 64, 4, 4, group=8)]


def norm_grid(m: int, rank: int) -> list:
    from torch_lora.ops.fused_linear import norm_shrink_config
    base = norm_shrink_config(m, rank)
    if m > 32:
        return [base, {**base, "SPLIT_K": base["SPLIT_K"] * 2}]
    return [base, {**base, "SPLIT_K": max(1, base["SPLIT_K"] // 2)}, {**base, "SPLIT_K": base["SPLIT_K"] * 2}]


def quick_grid(_m: int, *_rest) -> list:
    return [dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=64, num_warps=4, num_stages=2)]


def quick_norm_grid(m: int, rank: int) -> list:
    return [dict(BLOCK_M=4, BLOCK_K=64, SPLIT_K=2, LORA_MODE="rows"),
            dict(BLOCK_M=16, BLOCK_K=64, SPLIT_K=1, LORA_MODE="slots")]


def hf_rms_norm(h, g):
    """LlamaRMSNorm.forward (Hugging Face), as torch ops."""
    import torch
    hidden = h.to(torch.float32)
    hidden = hidden * torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + EPS)
    return g * hidden.to(h.dtype)


def rel_err(got, ref) -> float:
    import torch
    got = got.double()
    if torch.isnan(got).any():
        return float("inf")
    return float(torch.linalg.norm(got - ref) / torch.linalg.norm(ref))


class InputSet:
    """One layer's weights, adapters and activations (bf16; the shrink buffers float32)."""

    def __init__(self, k, widths, m, rank, slots_n, normed, gen, device):
        import torch
        dg = torch.Generator(device=device).manual_seed(int(torch.randint(0, 2**31, (1,), generator=gen)))
        rnd = lambda *s: torch.randn(*s, generator=dg, device=device)
        n = sum(widths)
        bf = torch.bfloat16
        self.w = (rnd(n, k) / math.sqrt(k)).to(bf)
        self.a = [(rnd(slots_n, rank, k) / math.sqrt(k)).to(bf) for _ in widths]
        self.b = [(rnd(slots_n, wd, rank) / math.sqrt(rank)).to(bf) for wd in widths]
        self.h = rnd(m, k).to(bf) if normed else None
        self.g = (1 + 0.1 * rnd(k)).to(bf) if normed else None
        self.x = hf_rms_norm(self.h, self.g) if normed else rnd(m, k).to(bf)
        self.xn = torch.empty_like(self.x)
        self.y = torch.empty(m, n, dtype=bf, device=device)
        self.buf = torch.zeros(len(widths), m, rank, dtype=torch.float32, device=device)

    def reference(self, slots, widths, lora=True):
        """float64 x @ W.T (+ (x @ A[slot].T) @ B[slot].T per row with a slot)."""
        import torch
        x = self.x.double()
        ref = x @ self.w.double().T
        if lora:
            for slot in torch.unique(slots).tolist():
                if slot < 0:
                    continue
                rows = (slots == slot).nonzero().squeeze(1)
                off = 0
                for a, b, n in zip(self.a, self.b, widths):
                    ref[rows, off:off + n] += (x[rows] @ a[slot].double().T) @ b[slot].double().T
                    off += n
        return ref


def best_of(clock, grid: list, make, m: int) -> tuple:
    """(best us, its config, [(config, us or error)]) over the grid; make(cfg) -> the calls."""
    results = []
    for cfg in grid:
        try:
            results.append((cfg, clock(make(cfg), m)))
        except Exception as e:                       # a config that does not compile or fit: reported
            results.append((cfg, f"{type(e).__name__}: {str(e)[:200]}"))
    timed = [(us, cfg) for cfg, us in results if isinstance(us, float)]
    if not timed:
        raise RuntimeError(f"no config of the grid ran: {results}")
    us, cfg = min(timed, key=lambda t: t[0])
    return us, cfg, [dict(config=c, us=u) for c, u in results]


class Bench:
    def __init__(self, args):
        import torch
        self.args, self.quick = args, args.quick
        self.cuda = not args.quick
        self.device = torch.device("cuda" if self.cuda else "cpu")
        from bench_triton import Clock
        self.clock = Clock(self.cuda)
        self.layers = QUICK_LAYERS if self.quick else LAYERS
        self.slots_n = 4 if self.quick else NUM_SLOTS
        self.t0 = time.perf_counter()
        self.gen = torch.Generator().manual_seed(0)
        import torch_lora
        cap = max(QUICK_MS if self.quick else MS)
        self.punica = torch_lora.PunicaWrapper(cap, cap, self.device, max_loras=self.slots_n)
        self.rows, self.skipped = [], []
        self.best = {}                     # (layer, m) -> (gemm config, norm config, cuBLAS us) of rank 16

    def slots_for(self, m: int):
        from bench_triton import make_mapping

        import torch_lora
        d = min(m, 8, self.slots_n) if m < 2048 else 4
        idx = make_mapping("dec" if m < 2048 else "pre", m, d, self.slots_n, 0.0, self.gen)
        ids = list(range(1, self.slots_n + 1))
        mapped = tuple(0 if i < 0 else ids[i] for i in idx.tolist())
        self.punica.update_metadata(torch_lora.LoRAMapping(mapped, mapped, is_prefill=False), ids, self.slots_n,
                                    32000)
        return idx.to(self.device), d

    def n_sets(self, k, widths) -> int:
        if self.quick:
            return 1
        return max(1, math.ceil(2 * L2_BYTES / (k * sum(widths) * 2)))

    def run_case(self, layer: str, m: int, rank: int) -> dict:
        import torch
        import torch.nn.functional as F

        from torch_lora.ops.fused_linear import gemm_lora, rms_norm_shrink
        k, widths = self.layers[layer]
        normed = layer in NORMED
        slots, d = self.slots_for(m)
        sets = [InputSet(k, widths, m, rank, self.slots_n, normed, self.gen, self.device)
                for _ in range(self.n_sets(k, widths))]
        s0, punica, clock = sets[0], self.punica, self.clock
        row = dict(layer=layer, M=m, D=d, rank=rank, n_sets=len(sets), N=sum(widths), K=k)
        ref_base = s0.reference(slots, widths, lora=False)
        ref = s0.reference(slots, widths)
        tuned = rank == 16 or self.quick
        grid = (quick_grid if self.quick else gemm_grid)(m)
        if not tuned:
            grid = [self.best[(layer, m)][0]]

        def lin(s):
            return F.linear(s.x, s.w)

        def today(s):
            y = F.linear(s.x, s.w)
            punica.add_lora_linear(y, s.x, s.a, s.b, None, 1.0, widths)
            return y

        def epilogue(s, cfg):
            return gemm_lora(s.x, s.w, None, s.buf, s.b, slots, widths, y=s.y, config=cfg)

        def fused(s, cfg):
            punica.add_shrink(s.buf, s.x, s.a, 1.0)
            return gemm_lora(s.x, s.w, None, s.buf, s.b, slots, widths, y=s.y, config=cfg)

        with torch.no_grad():
            if tuned:
                row["cublas_us"] = clock([lambda s=s: lin(s) for s in sets], m)
                row["err_cublas"] = rel_err(lin(s0), ref_base)
                plain = [g for g in grid if not g.get("PREFETCH_B")]       # (a LoRA-only option)

                def alone(c):
                    return [lambda s=s: gemm_lora(s.x, s.w, None, None, None, None, None, y=s.y, config=c)
                            for s in sets]
                us, cfg, row["grid_nolora"] = best_of(clock, plain, alone, m)
                row.update(triton_nolora_us=us, nolora_cfg=cfg, nolora_vs_cublas=us / row["cublas_us"])
                row["err_nolora"] = rel_err(gemm_lora(s0.x, s0.w, None, None, None, None, None, config=cfg), ref_base)
            row["today_us"] = clock([lambda s=s: today(s) for s in sets], m)
            row["err_today"] = rel_err(today(s0), ref)
            for s in sets:
                punica.add_shrink(s.buf, s.x, s.a, 1.0)
            us, cfg, row["grid_epilogue"] = best_of(clock, grid, lambda c: [lambda s=s: epilogue(s, c) for s in sets],
                                                    m)
            row.update(epilogue_us=us, epilogue_cfg=cfg)
            row["fused_us"] = clock([lambda s=s: fused(s, cfg) for s in sets], m)
            row["err_fused"] = rel_err(fused(s0, cfg), ref)
            gemm_cfg = cfg
            norm_cfg = None
            if normed:
                row["hf_norm_us"] = clock([lambda s=s: hf_rms_norm(s.h, s.g) for s in sets], m)
                alone = dict(BLOCK_M=4, BLOCK_K=64) if self.quick else None
                row["triton_norm_us"] = clock([lambda s=s: rms_norm_shrink(s.h, s.g, EPS, None, None, 1.0, out=s.xn,
                                                                           config=alone) for s in sets], m)
                ngrid = (quick_norm_grid if self.quick else norm_grid)(m, rank)
                if not tuned:
                    ngrid = [self.best[(layer, m)][1]]
                us, norm_cfg, row["grid_norm_shrink"] = best_of(
                    clock, ngrid, lambda c: [lambda s=s: rms_norm_shrink(s.h, s.g, EPS, s.a, slots, 1.0, out=s.xn,
                                                                         config=c) for s in sets], m)
                row.update(norm_shrink_us=us, norm_shrink_cfg=norm_cfg)

                def chain_base(s):
                    return F.linear(hf_rms_norm(s.h, s.g), s.w)

                def chain_today(s):
                    xn = hf_rms_norm(s.h, s.g)
                    y = F.linear(xn, s.w)
                    punica.add_lora_linear(y, xn, s.a, s.b, None, 1.0, widths)
                    return y

                def chain_fused(s):
                    xn, buf = rms_norm_shrink(s.h, s.g, EPS, s.a, slots, 1.0, out=s.xn, config=norm_cfg)
                    return gemm_lora(xn, s.w, None, buf, s.b, slots, widths, y=s.y, config=gemm_cfg)

                for name, fn in (("chain_base", chain_base), ("chain_today", chain_today),
                                 ("chain_fused", chain_fused)):
                    row[f"{name}_us"] = clock([lambda s=s, fn=fn: fn(s) for s in sets], m)
                row["err_chain_today"] = rel_err(chain_today(s0), ref)
                row["err_chain_fused"] = rel_err(chain_fused(s0), ref)
            if tuned:
                self.best[(layer, m)] = (gemm_cfg, norm_cfg, row["cublas_us"])
            base = self.best[(layer, m)][2]
            row.update(today_overhead_us=row["today_us"] - base, fused_overhead_us=row["fused_us"] - base)
        sets.clear()
        if self.cuda:
            torch.cuda.empty_cache()
        return row

    def cases(self) -> list:
        ms = QUICK_MS if self.quick else MS
        out = [(layer, m, 8 if self.quick else 16) for m in ms for layer in self.layers]
        if not self.quick and not self.args.no_r64:
            out += [(layer, m, 64) for m in R64_MS for layer in self.layers]
        return out

    def run(self, write) -> None:
        for layer, m, rank in self.cases():
            if self.args.cases and not any(f"{layer} M{m} r{rank}" == c.strip() for c in self.args.cases.split(",")):
                continue
            elapsed = time.perf_counter() - self.t0
            if elapsed > self.args.budget_s:
                self.skipped.append(f"{layer} M{m} r{rank} (budget: {elapsed:.0f} s spent)")
                continue
            if not self.quick and rank != 16 and (layer, m) not in self.best:
                self.skipped.append(f"{layer} M{m} r{rank} (no rank-16 result to take its configs from)")
                continue
            t = time.perf_counter()
            try:
                row = self.run_case(layer, m, rank)
            except Exception as e:
                import traceback
                traceback.print_exc()
                row = dict(layer=layer, M=m, rank=rank, error=f"{type(e).__name__}: {str(e)[:500]}")
            row["seconds"] = time.perf_counter() - t
            self.rows.append(row)
            print(line(row), flush=True)
            write()


def _fmt(v, spec=".1f"):
    return "-" if v is None else (format(v, spec) if isinstance(v, (int, float)) else str(v))


def _cfg(c) -> str:
    if not c:
        return "-"
    keys = ("BLOCK_M", "BLOCK_N", "BLOCK_K", "num_warps", "num_stages", "SPLIT_K", "GROUP_M", "LORA_MODE")
    return "/".join(str(c[k]) for k in keys if k in c) + ("/prefetch B" if c.get("PREFETCH_B") else "")


def line(r) -> str:
    if "error" in r:
        return f"{r['layer']:8s} M{r['M']:<5d} r{r['rank']}: ERROR {r['error']}"
    return (f"{r['layer']:8s} M{r['M']:<5d} D{r['D']} r{r['rank']}: cublas {_fmt(r.get('cublas_us'))} "
            f"nolora {_fmt(r.get('triton_nolora_us'))} ({_fmt(r.get('nolora_vs_cublas'), '.3f')}x) today "
            f"{_fmt(r['today_us'])} epilogue {_fmt(r['epilogue_us'])} fused {_fmt(r['fused_us'])} "
            f"chain base/today/fused {_fmt(r.get('chain_base_us'))}/{_fmt(r.get('chain_today_us'))}/"
            f"{_fmt(r.get('chain_fused_us'))} err fused {_fmt(r['err_fused'], '.1e')} ({r['seconds']:.0f} s)")


def markdown(res) -> str:
    meta = res["meta"]
    out = [f"# Fused linear kernels ({meta['device']}, {meta['date']})", "",
           f"torch {meta['torch']}, Triton {meta['triton']}, commit {meta['commit']}, sources "
           f"{meta['source_digest']}; us per call (CUDA-graph replay medians; --quick: host clock, meaningless).",
           "", "## GEMM (+ LoRA)", "",
           "| layer | M | D | r | cuBLAS | Triton no-LoRA (x cuBLAS) | no-LoRA config | today: cuBLAS + "
           "add_lora_linear (LoRA us) | epilogue only | shrink + gemm_lora (LoRA us) | epilogue config | "
           "err today / fused |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in res["rows"]:
        if "error" in r:
            out.append(f"| {r['layer']} | {r['M']} | | {r['rank']} | error: {r['error'][:120]} |||||||")
            continue
        out.append(f"| {r['layer']} | {r['M']} | {r['D']} | {r['rank']} | {_fmt(r.get('cublas_us'))} | "
                   f"{_fmt(r.get('triton_nolora_us'))} ({_fmt(r.get('nolora_vs_cublas'), '.3f')}) | "
                   f"{_cfg(r.get('nolora_cfg'))} | {_fmt(r['today_us'])} ({_fmt(r['today_overhead_us'])}) | "
                   f"{_fmt(r['epilogue_us'])} | {_fmt(r['fused_us'])} ({_fmt(r['fused_overhead_us'])}) | "
                   f"{_cfg(r['epilogue_cfg'])} | {_fmt(r['err_today'], '.1e')} / "
                   f"{_fmt(r['err_fused'], '.1e')} |")
    out += ["", "## RMSNorm + GEMM (+ LoRA) (qkv, gate_up)", "",
            "| layer | M | r | HF norm | Triton norm | rms_norm_shrink | its config | chain base | chain today | "
            "chain fused | err today / fused |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in res["rows"]:
        if "chain_fused_us" not in r:
            continue
        out.append(f"| {r['layer']} | {r['M']} | {r['rank']} | {_fmt(r['hf_norm_us'])} | {_fmt(r['triton_norm_us'])} "
                   f"| {_fmt(r['norm_shrink_us'])} | {_cfg(r['norm_shrink_cfg'])} | {_fmt(r['chain_base_us'])} | "
                   f"{_fmt(r['chain_today_us'])} | {_fmt(r['chain_fused_us'])} | "
                   f"{_fmt(r['err_chain_today'], '.1e')} / {_fmt(r['err_chain_fused'], '.1e')} |")
    if res["skipped"]:
        out += ["", "Skipped: " + "; ".join(res["skipped"])]
    return "\n".join(out) + "\n"


def env_meta(cuda: bool) -> dict:
    from bench_triton import kernel_bench_meta
    return kernel_bench_meta(cuda, l2_bytes=L2_BYTES, slots=NUM_SLOTS)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    day = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%d")
    p.add_argument("--out", default=f"benchmarks/results/fused_linear_{day}")
    p.add_argument("--quick", action="store_true", help="CPU, Triton's interpreter, tiny shapes (times mean nothing)")
    p.add_argument("--budget-s", type=float, default=330.0, help="start no case past this many seconds")
    p.add_argument("--no-r64", action="store_true", help="rank 16 only")
    p.add_argument("--cases", default="", help="comma list of 'layer M<m> r<rank>' to run (default: all)")
    args = p.parse_args(argv)
    if args.quick:
        os.environ["TRITON_INTERPRET"] = "1"          # before Triton is imported
    import torch
    if not args.quick and not torch.cuda.is_available():
        print("needs a CUDA GPU (or --quick)", file=sys.stderr)
        return 2
    torch.backends.cuda.matmul.allow_tf32 = False
    bench = Bench(args)
    os.makedirs(args.out, exist_ok=True)
    res = dict(meta=env_meta(bench.cuda), rows=bench.rows, skipped=bench.skipped)

    def write():
        with open(os.path.join(args.out, "fused_linear.json"), "w") as f:
            json.dump(res, f, indent=1, default=str)
        with open(os.path.join(args.out, "fused_linear.md"), "w") as f:
            f.write(markdown(res))

    bench.run(write)
    res["seconds"] = time.perf_counter() - bench.t0
    write()
    print(markdown(res))
    return 1 if any("error" in r for r in bench.rows) else 0


if __name__ == "__main__":
    sys.exit(main())
