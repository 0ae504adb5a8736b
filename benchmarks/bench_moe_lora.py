"""Mixture-of-experts LoRA: our kernel (`lora_core.kernels.moe_lora`) against vLLM 0.33's fused MoE LoRA kernels.

    PYTHONPATH=. python benchmarks/bench_moe_lora.py --out $OUT            # one GPU (vLLM's files in .vllm/)
    PYTHONPATH=. python benchmarks/bench_moe_lora.py --layers w2 --models qwen3-30b-a3b --out $OUT
    PYTHONPATH=. python benchmarks/bench_moe_lora.py --quick --out /tmp/m  # CPU interpreter, tiny shapes

Layer shapes (bf16): Mixtral-8x7B (H 4096, I 14336, 8 experts, top 2) and Qwen3-30B-A3B (H 2048,
I 768, 128 experts, top 8); per model both expert weights: w13 (gate_up: two slices of I columns,
x (T, H), no router weight) and w2 (down: x (T * top_k, I), one row per pair, router weights
applied). T tokens: decode 1, 16, 64, 256 and prefill 2048, 8192 (`--tokens`); D adapters among
32 slots: 1, 8, 32 (at most T; `--adapters`); ranks 16 and 64. Routing: each token's top_k distinct
experts uniformly at random, router weights normalised; tokens assigned to the D adapters in
random order. The pair order both sides get is vLLM's choice (`add_lora_w13`): naive when
T * top_k * 8 <= E * 32 slots, else sorted by (slot, expert) in blocks of 16, 32 or 64 rows by the
pairs per expert (ours: `torch_lora.ops.moe.moe_block_size`) / of vLLM's configured BLOCK_SIZE_M (64),
each from `torch_lora.ops.moe_lora_align_block_size` (vLLM's alignment is a CUDA extension outside
its Triton files); the alignment is done once per layer call in the engine and is not timed here.

Weights are drawn on the device, once per (model, layer, rank) and shared by that layer's cases
(the routing and adapters change per case); `--warm-jobs N` first runs every case once in N
worker processes, so that Triton's compilations (ours and vLLM's, into Triton's on-disk cache)
overlap instead of adding up in the timed loop.

Per case: us per call from a CUDA graph of many calls replayed (median), for `ours`
(`torch_lora.ops.fused_moe_lora`, backend triton) and `vllm` (`fused_moe_lora` with the configs
vLLM's `get_lora_op_configs` gives: its defaults without a tuned-config folder); the speed-up
vllm / ours; each side's relative Frobenius error against a float32 reference computed once per case on the
device (the added LoRA term of every live pair, grouped by (slot, expert); the error's norms in
float64). vLLM folds the LoRA scaling into B; so do we.
Output: `moe_lora.json` (meta, rows, skipped) and `moe_lora.md` in --out, rewritten after every
case, with the geometric mean of the speed-ups. `--budget-s` skips cases past it (listed).
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

MODELS = {"mixtral-8x7b": dict(hidden=4096, inter=14336, experts=8, top_k=2),
          "qwen3-30b-a3b": dict(hidden=2048, inter=768, experts=128, top_k=8)}
QUICK_MODELS = {"tiny": dict(hidden=64, inter=48, experts=4, top_k=2)}
TOKENS = (1, 16, 64, 256, 2048, 8192)
QUICK_TOKENS = (1, 40)
ADAPTERS = (1, 8, 32)
QUICK_ADAPTERS = (2,)
RANKS = (16, 64)
QUICK_RANKS = (16,)
NUM_SLOTS = 32
QUICK_SLOTS = 8
def reference(x, a, b, topk_ids, topk_weights, token_lora, pair_rows: bool):
    """(T, top_k, N) float32: every live pair's LoRA term (slices concatenated), grouped by (slot, expert),
    on x's device (TF32 off: float32 products, far below bf16's rounding)."""
    import torch
    num_tokens, top_k = topk_ids.shape
    lora = token_lora.long().repeat_interleave(top_k)
    expert = topk_ids.reshape(-1).long()
    rows = torch.arange(num_tokens * top_k, device=x.device)
    xrow = rows if pair_rows else rows // top_k
    out = torch.zeros(num_tokens * top_k, sum(bb.shape[2] for bb in b), dtype=torch.float32, device=x.device)
    live = lora >= 0
    key = torch.where(live, lora * 100000 + expert, torch.full_like(lora, -1))      # (slot, expert) groups
    order = torch.argsort(key)
    keys, counts = torch.unique_consecutive(key[order], return_counts=True)
    starts = torch.cumsum(counts, 0) - counts
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        for k, start, count in zip(keys.tolist(), starts.tolist(), counts.tolist()):
            if k < 0:
                continue
            pick = order[start:start + count]
            slot, e = divmod(k, 100000)
            xs = x[xrow[pick]].float()
            col = 0
            for aa, bb in zip(a, b):
                term = (xs @ aa[slot, e].float().T) @ bb[slot, e].float().T
                if pair_rows:
                    term = term * topk_weights.reshape(-1)[pick].float()[:, None]
                out[pick, col:col + bb.shape[2]] = term
                col += bb.shape[2]
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32
    return out.view(num_tokens, top_k, -1)


def rel_err(got, ref) -> float:
    """||got - ref|| / ||ref|| (Frobenius, the norms in float64), inf for a non-finite result."""
    import torch
    if not torch.isfinite(got).all():
        return float("inf")
    diff = float(torch.linalg.vector_norm((got.float() - ref).reshape(-1), dtype=torch.float64))
    return diff / max(float(torch.linalg.vector_norm(ref.reshape(-1), dtype=torch.float64)), 1e-30)


_WEIGHTS: dict = {}


def layer_weights(shape: dict, layer: str, rank: int, slots: int, device, seed: int):
    """(A slices, B slices) of a layer at a rank, drawn on the device once and shared by its cases
    (the previous layer's are dropped: one layer's weights in memory at a time)."""
    import torch
    key = (tuple(sorted(shape.items())), layer, rank, slots, str(device))
    if key not in _WEIGHTS:
        _WEIGHTS.clear()
        gen = torch.Generator(device=device).manual_seed(seed)
        H, I, E = shape["hidden"], shape["inter"], shape["experts"]
        k_in, widths = (I, (H,)) if layer == "w2" else (H, (I, I))

        def rand(*size, scale):
            return (torch.randn(*size, generator=gen, device=device, dtype=torch.bfloat16) * scale)

        _WEIGHTS[key] = ([rand(slots, E, rank, k_in, scale=k_in ** -0.5) for _ in widths],
                         [rand(slots, E, n, rank, scale=rank ** -0.5) for n in widths])
    return _WEIGHTS[key]


class Case:
    """One layer call's inputs: weights in NUM_SLOTS slots, routing, x, y, the alignment."""

    def __init__(self, shape: dict, layer: str, tokens: int, adapters: int, rank: int, slots: int, device, seed: int):
        import torch

        from torch_lora.ops import moe_lora_align_block_size
        from torch_lora.ops.moe import moe_block_size, naive_block_assignment
        gen = torch.Generator(device="cpu").manual_seed(seed)
        H, I, E, k = shape["hidden"], shape["inter"], shape["experts"], shape["top_k"]
        self.top_k, self.rank, self.experts, self.slots = k, rank, E, slots
        dt = torch.bfloat16
        self.w2 = layer == "w2"
        k_in, widths = (I, (H,)) if self.w2 else (H, (I, I))
        self.a, self.b = layer_weights(shape, layer, rank, slots, device, seed=rank * 7 + self.w2)
        self.x = (torch.randn(tokens * k if self.w2 else tokens, k_in, generator=gen)).to(device, dt)
        self.y = torch.zeros(tokens, k, sum(widths), dtype=dt, device=device)
        self.topk_ids = torch.argsort(torch.rand(tokens, E, generator=gen), dim=1)[:, :k].to(device, torch.int32)
        w = torch.rand(tokens, k, generator=gen) + 0.1
        self.topk_weights = (w / w.sum(1, keepdim=True)).to(device, torch.float32)
        used = torch.randperm(slots, generator=gen)[:adapters]
        self.token_lora = used[torch.randint(0, adapters, (tokens,), generator=gen)].to(device, torch.int32)
        self.enabled = torch.zeros(slots + 1, dtype=torch.int32, device=device)
        self.enabled[used.to(device)] = 1
        self._ref = None
        self.naive = naive_block_assignment(tokens, k, E, slots)
        self.block = moe_block_size(tokens * k, E)
        self.align = {}
        for block in {self.block, 64}:
            self.align[block] = ((None, self.topk_ids.reshape(-1), None) if self.naive else
                                 moe_lora_align_block_size(self.topk_ids, self.token_lora, E, block, slots,
                                                           self.enabled))

    def ours(self):
        from torch_lora.ops import fused_moe_lora
        sorted_ids, expert_ids, post_pad = self.align[self.block]

        def call():
            fused_moe_lora(self.y, self.x, self.a, self.b, self.topk_weights, sorted_ids, expert_ids, post_pad,
                           self.token_lora, self.rank, self.top_k, self.enabled, self.w2, 0,
                           block_size=None if self.naive else self.block, backend="triton")
        return call

    def vllm(self, vk):
        cfg = {}
        for op in ("shrink", "expand"):
            c = vk.utils.get_lora_op_configs(f"fused_moe_lora_{'w2' if self.w2 else 'w13'}_{op}", self.slots,
                                             self.y.shape[0], self.x.shape[1], self.rank, len(self.a),
                                             moe_intermediate_size=self.b[0].shape[2])
            cfg[op] = vk.utils._normalize_lora_config_keys(c)
        block = int(cfg["shrink"].get("BLOCK_SIZE_M") or 64)
        if block not in self.align:
            raise RuntimeError(f"vLLM's BLOCK_SIZE_M {block}: no alignment prepared")
        sorted_ids, expert_ids, post_pad = self.align[block]
        if sorted_ids is not None:
            sorted_ids = sorted_ids.view(self.slots, -1)
            expert_ids = expert_ids.view(self.slots, -1)
        meta = vk.LoRAKernelMeta.make(self.slots, max(self.y.shape[0], 1), self.x.device)
        meta.prepare_tensors(self.token_lora)
        token_lora, _, _, _, lora_ids, _, num_active = meta.meta_args(self.y.shape[0], False)
        a, b = [t.contiguous() for t in self.a], [t.contiguous() for t in self.b]

        def knobs(c):
            return [c.get("BLOCK_SIZE_M", 64), c.get("BLOCK_SIZE_N", 64), c.get("BLOCK_SIZE_K", 32),
                    c.get("GROUP_SIZE_M", 8), c.get("NUM_WARPS", 4), c.get("NUM_STAGES", 3), c.get("SPLIT_K", 1)]

        def call():
            vk.fused_moe_lora(self.y, self.x, a, b, self.topk_weights, sorted_ids, expert_ids, post_pad, token_lora,
                              self.rank, self.top_k, lora_ids, num_active, self.enabled,
                              *knobs(cfg["shrink"]), *knobs(cfg["expand"]), self.w2, False, 0)
        return call, cfg

    def error(self, call) -> float:
        """call's relative error against the reference (computed once per case)."""
        self.y.zero_()
        call()
        if self._ref is None:
            self._ref = reference(self.x, self.a, self.b, self.topk_ids, self.topk_weights, self.token_lora, self.w2)
        return rel_err(self.y, self._ref)


def geomean(values) -> float | None:
    values = [v for v in values if v and v > 0 and math.isfinite(v)]
    return math.exp(sum(math.log(v) for v in values) / len(values)) if values else None


def markdown(res) -> str:
    rows = res["rows"]
    out = [f"# MoE LoRA: ours vs vLLM's fused_moe_lora ({res['meta']['device']})", "",
           "| model | layer | T | D | r | order | ours us | vLLM us | vLLM/ours | err ours | err vLLM |",
           "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        speed = r.get("speedup")
        out.append(f"| {r['model']} | {r['layer']} | {r['tokens']} | {r['adapters']} | {r['rank']} | {r['order']} | "
                   f"{r['ours_us']:.1f} | {_fmt(r.get('vllm_us'))} | {_fmt(speed, '.2f')} | {r['err_ours']:.1e} | "
                   f"{_fmt(r.get('err_vllm'), '.1e')} |")
    g = geomean(r.get("speedup") for r in rows)
    slower = [r for r in rows if r.get("speedup") is not None and r["speedup"] < 1.0]
    out += ["", f"Geometric mean of vLLM/ours: {_fmt(g, '.2f')}; cases slower than vLLM: {len(slower)}"]
    groups = sorted({(r["model"], r["layer"]) for r in rows})
    if len(groups) > 1:
        out += ["", "Per model and layer: " + "; ".join(
            f"{m} {ly} {_fmt(geomean(r.get('speedup') for r in rows if (r['model'], r['layer']) == (m, ly)), '.2f')}"
            for m, ly in groups)]
    if slower:
        out += ["", "Slower than vLLM: " + "; ".join(
            f"{r['model']} {r['layer']} T{r['tokens']} D{r['adapters']} r{r['rank']} ({r['speedup']:.2f})"
            for r in slower)]
    errors = sorted({r["vllm_error"] for r in rows if r.get("vllm_error")})
    if errors:
        out += ["", "vLLM not run: " + "; ".join(errors)]
    if res["skipped"]:
        out += ["", "Skipped: " + "; ".join(res["skipped"])]
    return "\n".join(out) + "\n"


def _fmt(v, spec=".1f") -> str:
    return "-" if v is None else format(v, spec)


def env_meta(cuda: bool) -> dict:
    from bench_triton import kernel_bench_meta
    return kernel_bench_meta(cuda, slots=NUM_SLOTS if cuda else QUICK_SLOTS)


def _ints(text: str) -> tuple:
    return tuple(int(v) for v in text.split(",") if v)


def case_list(models: dict, layers, tokens, adapters, ranks) -> list:
    """(model, layer, T, D, r) of every case in run order (D past T only for the first adapter count)."""
    out = []
    for model in models:
        for layer in layers:
            for t in tokens:
                for d in adapters:
                    if d > t and d != adapters[0]:
                        continue
                    out.extend((model, layer, t, min(d, t), r) for r in ranks)
    return out


def _warm_one(job) -> str:
    """A worker's case: built and run once (ours, then vLLM's), compiling into Triton's on-disk cache."""
    import torch
    models, label, (model, layer, t, d, r), slots, seed, device = job
    try:
        import vllm_kernels
        vk = vllm_kernels.load()
        case = Case(models[model], layer, t, d, r, slots, torch.device(device), seed)
        case.ours()()
        if vk is not None and device == "cuda":
            case.vllm(vk)[0]()
            torch.cuda.synchronize()
        return ""
    except Exception as e:                                 # said; the timed run compiles what is missing
        return f"{label}: {type(e).__name__}: {str(e)[:120]}"


def pool_run(fn, jobs: list, workers: int, deadline: float) -> list:
    """fn(job) for every job in `workers` spawned processes, in order, until `deadline` (time.time()):
    jobs not started by then are cancelled, the running ones finish. Returns fn's non-empty
    results (messages) and one line per stop. Each process compiles a distinct launch once and
    keeps it in Triton's on-disk cache, which the timed process then reads."""
    import concurrent.futures
    import multiprocessing
    if workers <= 0 or not jobs:
        return []
    messages = []
    pool = concurrent.futures.ProcessPoolExecutor(max_workers=workers, mp_context=multiprocessing.get_context("spawn"))
    try:
        futures = [pool.submit(fn, j) for j in jobs]
        for f in futures:
            try:
                msg = f.result(timeout=max(0.0, deadline - time.time()))
            except concurrent.futures.TimeoutError:
                messages.append(f"stopped at the deadline ({sum(not g.done() for g in futures)} of "
                                f"{len(futures)} jobs left)")
                break
            if msg:
                messages.append(msg)
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
    return messages


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    day = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%d")
    p.add_argument("--out", default=f"benchmarks/results/moe_lora_{day}")
    p.add_argument("--quick", action="store_true", help="CPU, Triton's interpreter, tiny shapes (times mean nothing)")
    p.add_argument("--budget-s", type=float, default=540.0, help="start no case past this many seconds")
    p.add_argument("--models", default="", help="comma list of model names (default: all)")
    p.add_argument("--layers", default="w13,w2", help="comma list of layers: w13 (gate_up), w2 (down)")
    p.add_argument("--tokens", default="", help="comma list of token counts")
    p.add_argument("--adapters", default="", help="comma list of adapter counts")
    p.add_argument("--ranks", default="", help="comma list of ranks")
    p.add_argument("--warm-jobs", type=int, default=0,
                   help="worker processes that run every case once first, compiling its kernels (0: none)")
    p.add_argument("--warm-share", type=float, default=0.35, help="share of --budget-s the compile workers may take")
    args = p.parse_args(argv)
    if args.quick:
        os.environ["TRITON_INTERPRET"] = "1"          # before Triton is imported
    import torch
    cuda = not args.quick
    if cuda and not torch.cuda.is_available():
        print("needs a CUDA GPU (or --quick)", file=sys.stderr)
        return 2
    import vllm_kernels
    vk = vllm_kernels.load()
    models = QUICK_MODELS if args.quick else MODELS
    if args.models:
        models = {m: models[m] for m in args.models.split(",")}
    layers = [v for v in args.layers.split(",") if v]
    if not layers or set(layers) - {"w13", "w2"}:
        p.error(f"--layers: expected a comma list of w13, w2, got {args.layers!r}")
    tokens = _ints(args.tokens) or (QUICK_TOKENS if args.quick else TOKENS)
    adapters = _ints(args.adapters) or (QUICK_ADAPTERS if args.quick else ADAPTERS)
    ranks = _ints(args.ranks) or (QUICK_RANKS if args.quick else RANKS)
    slots = QUICK_SLOTS if args.quick else NUM_SLOTS
    device = torch.device("cuda" if cuda else "cpu")
    from bench_triton import Clock
    clock = Clock(cuda, target=lambda tokens: 32 if tokens <= 256 else 4)
    os.makedirs(args.out, exist_ok=True)
    res = dict(meta=env_meta(cuda), rows=[], skipped=[])
    if vk is None:
        res["meta"]["vllm"] = "absent: run benchmarks/fetch_vllm_kernels.sh"

    def write():
        with open(os.path.join(args.out, "moe_lora.json"), "w") as f:
            json.dump(res, f, indent=1, default=str)
        with open(os.path.join(args.out, "moe_lora.md"), "w") as f:
            f.write(markdown(res))

    t0 = time.perf_counter()
    cases = case_list(models, layers, tokens, adapters, ranks)
    if args.warm_jobs > 0:
        jobs = [(models, f"{m} {ly} T{t} D{d} r{r}", (m, ly, t, d, r), slots, i, device.type)
                for i, (m, ly, t, d, r) in enumerate(cases, 1)]
        try:
            failed = pool_run(_warm_one, jobs, args.warm_jobs, time.time() + args.budget_s * args.warm_share)
        except Exception as e:                   # the pool itself failed: the timed loop compiles everything
            failed = [f"compile workers: {type(e).__name__}: {str(e)[:200]}"]
        res["meta"]["warm_s"] = round(time.perf_counter() - t0, 1)
        res["meta"]["warm_failures"] = failed
        print(f"compiled in {args.warm_jobs} workers: {res['meta']['warm_s']} s, {len(failed)} failures", flush=True)
    for seed, (model, layer, t, d, r) in enumerate(cases, 1):
        label = f"{model} {layer} T{t} D{d} r{r}"
        if time.perf_counter() - t0 > args.budget_s:
            res["skipped"].append(label)
            continue
        case = Case(models[model], layer, t, d, r, slots, device, seed)
        ours = case.ours()
        row = dict(model=model, layer=layer, tokens=t, adapters=d, rank=r,
                   order="naive" if case.naive else "sorted", err_ours=case.error(ours),
                   ours_us=clock([ours], t))
        if vk is not None:
            try:
                call, cfg = case.vllm(vk)
                row["err_vllm"] = case.error(call)
                row["vllm_us"] = clock([call], t)
                row["vllm_configs"] = cfg
                row["speedup"] = row["vllm_us"] / row["ours_us"]
            except Exception as e:           # vLLM's kernels need a GPU (CUDA queries): said
                row["vllm_error"] = f"{type(e).__name__}: {str(e)[:160]}"
        res["rows"].append(row)
        print(label, {k: v for k, v in row.items() if k != "vllm_configs"}, flush=True)
        del case
        write()
    res["seconds"] = time.perf_counter() - t0
    res["geomean_speedup"] = geomean(r.get("speedup") for r in res["rows"])
    write()
    print(markdown(res))
    return 1 if any(r["err_ours"] > 2e-2 for r in res["rows"]) else 0


if __name__ == "__main__":
    sys.exit(main())
