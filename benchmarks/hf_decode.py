"""Hugging Face decode step: PEFT's mixed batch against MultiLoRAModel (eager and in a CUDA graph)
and against the base model, on a Llama-3-8B-shaped transformers model.

    PYTHONPATH=. python benchmarks/hf_decode.py --out benchmarks/results          # one H200, all cases
    PYTHONPATH=. python benchmarks/hf_decode.py --cases 'B32 D8 r16' --out /tmp/hf  # a regex over names
    PYTHONPATH=. python benchmarks/hf_decode.py --smoke --out /tmp/hf              # CPU, tiny model

The model: transformers' LlamaForCausalLM with Llama-3-8B's shape (32 layers, hidden 4096, 32 / 8
heads, intermediate 14336, vocab 128256), bf16, random weights (transformers' own init, on the GPU).
Two copies of it: one wrapped by peft, one by `torch_lora.hf.MultiLoRAModel`. Adapters: NUM_ADAPTERS
random PEFT adapters (peft's `init_lora_weights=False`: A and B both random, so no adapter is a
no-op) on all seven projections, made by peft and handed to MultiLoRAModel as the same factors
(`PeftAdapter`s built from the peft modules: one set of numbers for both).

One decode step: every row one token at KV position CONTEXT of a `transformers.StaticCache` of
MAX_LEN positions (the same step shape for every implementation), `logits_to_keep=1`. Rows take
the case's D adapters in turn (shuffled); per case and implementation, N steps timed with CUDA
events, median:
  * base: the unwrapped model (its own copy), eager and captured in a CUDA graph;
  * peft: `peft_model(input_ids, adapter_names=names, ...)`, eager (peft's mixed-batch path loops
    over the batch's adapters in every LoRA module; it cannot be captured: it indexes rows on the host);
  * ours eager: `MultiLoRAModel(input_ids, adapter_names=names, ...)`;
  * ours graph: the step captured once per batch size and rank, `prepare_step(names, 1, 1)` then
    the replay (hot-swapping adapters between replays needs no re-capture).
LoRA overhead = ours graph - base graph, next to the LoRA kernels' own GPU time in one replay
(torch's profiler: the `lora_*` kernels' durations summed; programmatic dependent launches start
early and wait, so this sum can exceed the overhead).

Correctness, before any time is taken: ours eager and ours graph against peft's logits of the same
step (relative error of the logits). Both sides run bf16 through 32 layers of random weights and
round differently (peft rounds x A and (x A) B to bf16 in every module, our kernels accumulate in
float32): measured on the H200, 0.049-0.052 at every batch size, so the tolerance is TOL = 0.1, and
peft's LoRA effect (its logits against the base's, ~1.4 here) must be at least 10x the error, which
a wrong adapter, slot or scale could not meet.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import os
import platform
import re
import subprocess
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

NUM_ADAPTERS = 32
TOL = 0.1
EFFECT_OVER_ERR = 10
CONTEXT, MAX_LEN = 512, 1024
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def cases(smoke: bool) -> list:
    if smoke:
        return [(4, 1, 4), (4, 4, 4), (8, 2, 8)]
    out = []
    for r in (16, 64):
        for b in (1, 8, 32, 128):
            for d in sorted({min(b, 1), min(b, 8), min(b, 32)}):
                out.append((b, d, r))
    return out


def name_of(case) -> str:
    b, d, r = case
    return f"B{b} D{d} r{r}"


def model_config(smoke: bool):
    from transformers import LlamaConfig
    if smoke:
        return LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=2, vocab_size=256, max_position_embeddings=256)
    return LlamaConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                       num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192, rope_theta=500000.0)


def peft_factors(peft_model, adapter: str, rank: int):
    """The adapter's factors as a lora_core PeftAdapter (module names of the base model)."""
    from lora_core.peft import LoraModule, PeftAdapter
    modules = {}
    for name, module in peft_model.named_modules():
        if hasattr(module, "lora_A") and adapter in getattr(module, "lora_A", {}):
            base_name = name.removeprefix("base_model.model.")
            modules[base_name] = LoraModule(module.lora_A[adapter].weight.detach().float().cpu().numpy(),
                                            module.lora_B[adapter].weight.detach().float().cpu().numpy(),
                                            float(module.scaling[adapter]), "linear")
    return PeftAdapter(name=adapter, r=rank, lora_alpha=float(2 * rank), use_rslora=False, target_modules=TARGETS,
                       modules=modules)


class Step:
    """Inputs of one decode step of `rows` rows at position CONTEXT (or MAX_LEN // 2 when smaller)."""

    def __init__(self, bench, rows: int):
        import inspect

        import torch
        import transformers
        self.rows = rows
        dev = bench.device
        self.max_len = bench.max_len
        self.pos = min(CONTEXT, self.max_len // 2)
        self.ids = torch.randint(1, bench.cfg.vocab_size, (rows, 1), generator=bench.gen).to(dev)
        self.cache = transformers.StaticCache(config=bench.cfg, max_cache_len=self.max_len)
        params = inspect.signature(bench.base.forward).parameters
        self.cache_kw = "past_key_values" if "past_key_values" in params else "cache"
        self.with_cache_position = "cache_position" in params
        self.position_ids = torch.full((rows, 1), self.pos, dtype=torch.long, device=dev)
        self.cache_position = torch.full((1,), self.pos, dtype=torch.long, device=dev)

    def rewind(self) -> None:
        """Puts the cache's write position back to `pos` (transformers >= 5.20 appends at a
        per-layer counter; older versions write at `cache_position`): every implementation's step
        then reads the same cache. Called before each check and each timed series (a series
        advances the counter by its N + 1 steps, the same for every implementation)."""
        for layer in getattr(self.cache, "layers", ()):
            counter = getattr(layer, "cumulative_length", None)
            if counter is not None and hasattr(counter, "fill_"):
                counter.fill_(self.pos)

    def kwargs(self) -> dict:
        kw = {"input_ids": self.ids, "position_ids": self.position_ids, self.cache_kw: self.cache,
              "use_cache": True, "logits_to_keep": 1}
        if self.with_cache_position:
            kw["cache_position"] = self.cache_position
        return kw


class Bench:
    def __init__(self, args):
        import peft
        import torch
        import transformers

        import torch_lora.hf
        self.args = args
        self.smoke = args.smoke
        self.cuda = not args.smoke
        self.device = torch.device("cuda" if self.cuda else "cpu")
        self.dtype = torch.float32 if self.smoke else torch.bfloat16
        self.max_len = 64 if self.smoke else MAX_LEN
        self.gen = torch.Generator().manual_seed(0)
        self.cfg = model_config(self.smoke)
        self.phases = {}
        t0 = time.perf_counter()
        torch.manual_seed(0)
        with torch.device(self.device):
            self.base = transformers.LlamaForCausalLM(self.cfg).to(self.dtype).eval()
        self.ours_model = copy.deepcopy(self.base)
        self.phases["models_s"] = time.perf_counter() - t0
        self.peft_model = None
        self.rank = None
        max_rank = max(r for *_, r in args.case_list)
        self.mm = torch_lora.hf.MultiLoRAModel(self.ours_model, max_loras=NUM_ADAPTERS, max_rank=max_rank,
                                               max_num_tokens=256, max_num_seqs=256,
                                               host_cache_size=NUM_ADAPTERS)
        self.peft, self.transformers = peft, transformers
        self.steps: dict = {}
        self.base_times: dict = {}

    # ------------------------------------------------------------------ adapters
    def set_rank(self, rank: int) -> None:
        """NUM_ADAPTERS random peft adapters at `rank` on the peft copy, the same factors in ours."""
        import torch
        t0 = time.perf_counter()
        for name in list(self.mm.loaded_adapters):
            self.mm.unload_adapter(name)
        if self.peft_model is not None:
            self.peft_model = self.peft_model.unload()           # the base copy back, no LoRA modules
        cfg = self.peft.LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=TARGETS, init_lora_weights=False)
        torch.manual_seed(rank)
        model = self.peft_model if self.peft_model is not None else copy.deepcopy(self.base)
        self.peft_model = self.peft.get_peft_model(model, cfg, adapter_name="a0").eval()
        for i in range(1, NUM_ADAPTERS):
            self.peft_model.add_adapter(f"a{i}", cfg)
        for module in self.peft_model.modules():                  # peft's random B is tiny: make it count
            if hasattr(module, "lora_B"):
                for lin in module.lora_B.values():
                    lin.weight.data.normal_(0, 0.5 / rank ** 0.5)
        self.peft_model.to(self.dtype)
        for i in range(NUM_ADAPTERS):
            self.mm.load_adapter(f"a{i}", peft_factors(self.peft_model, f"a{i}", rank))
        self.rank = rank
        self.phases[f"set_rank_{rank}_s"] = time.perf_counter() - t0

    # ------------------------------------------------------------------ runners
    def step(self, rows: int) -> Step:
        if rows not in self.steps:
            self.steps[rows] = Step(self, rows)
        return self.steps[rows]

    def timed(self, fn, n: int, st: Step) -> float:
        """Median us of n calls of fn after one untimed call from the step's rewound cache (CUDA
        events; host clock on the CPU)."""
        import torch
        st.rewind()
        fn()
        times = []
        for _ in range(n):
            if self.cuda:
                e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                e0.record()
                fn()
                e1.record()
                torch.cuda.synchronize()
                times.append(e0.elapsed_time(e1) * 1e3)
            else:
                t0 = time.perf_counter()
                fn()
                times.append((time.perf_counter() - t0) * 1e6)
        return float(np.median(times))

    def graph(self, fn):
        """fn captured in a CUDA graph (after two eager warm-up calls on a side stream): (replay, output)."""
        import torch
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side), torch.no_grad():
            for _ in range(2):
                fn()
        torch.cuda.current_stream().wait_stream(side)
        g = torch.cuda.CUDAGraph()
        with torch.no_grad(), torch.cuda.graph(g):
            out = fn()
        return g, out

    def base_step(self, st: Step) -> dict:
        """The base model's step at this batch size, eager and graph (once per batch size)."""
        import torch
        if st.rows in self.base_times:
            return self.base_times[st.rows]
        with torch.no_grad():
            run = lambda: self.base(**st.kwargs()).logits[:, -1]
            out = {"base_eager_us": self.timed(run, self.args.steps, st)}
            st.rewind()
            out["base_logits"] = run().float().cpu()
            if self.cuda:
                g, _ = self.graph(run)
                out["base_graph_us"] = self.timed(g.replay, self.args.steps, st)
                del g
        self.base_times[st.rows] = out
        return out

    def lora_kernel_us(self, replay) -> float:
        """GPU time of the lora_* kernels in one replay (torch's profiler, mean of 3)."""
        import torch
        from torch.profiler import ProfilerActivity, profile
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(3):
                replay()
            torch.cuda.synchronize()
        total = sum(e.device_time_total for e in prof.key_averages() if e.key.startswith("lora_"))
        return total / 3

    def run_case(self, case) -> dict:
        import torch
        rows, adapters, rank = case
        if self.rank != rank:
            self.set_rank(rank)
        st = self.step(rows)
        rng = np.random.default_rng(rows * 100 + adapters)
        chosen = rng.permutation(NUM_ADAPTERS)[:adapters]
        names = [f"a{int(chosen[i % adapters])}" for i in rng.permutation(rows)]
        base = self.base_step(st)
        res = dict(case=name_of(case), rows=rows, adapters=adapters, rank=rank,
                   **{k: v for k, v in base.items() if k.endswith("_us")})
        with torch.no_grad():
            peft_run = lambda: self.peft_model(adapter_names=names, **st.kwargs()).logits[:, -1]
            ours_run = lambda: self.mm(adapter_names=names, **st.kwargs()).logits[:, -1]
            st.rewind()
            want = peft_run().float().cpu()
            st.rewind()
            got = ours_run().float().cpu()
            effect = rel(want, base["base_logits"])
            res.update(err_eager=rel(got, want), lora_effect=effect)
            res["peft_us"] = self.timed(peft_run, self.args.steps, st)
            res["ours_eager_us"] = self.timed(ours_run, self.args.steps, st)
            if self.cuda:
                self.mm.prepare_step(names, 1, 1)
                g, out = self.graph(lambda: self.mm.model(**st.kwargs()).logits[:, -1])

                def replay():
                    self.mm.prepare_step(names, 1, 1)
                    g.replay()
                st.rewind()
                replay()
                res["err_graph"] = rel(out.float().cpu(), want)
                res["ours_graph_us"] = self.timed(replay, self.args.steps, st)
                res["lora_kernels_us"] = self.lora_kernel_us(replay)
                res["overhead_us"] = res["ours_graph_us"] - res["base_graph_us"]
                res["peft_over_ours_graph"] = res["peft_us"] / res["ours_graph_us"]
                del g, out
        res["peft_over_ours_eager"] = res["peft_us"] / res["ours_eager_us"]
        errs = [res["err_eager"]] + ([res["err_graph"]] if "err_graph" in res else [])
        res["check_passed"] = bool(max(errs) <= TOL and effect >= EFFECT_OVER_ERR * max(errs))
        return res


def rel(got, want) -> float:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    if not np.all(np.isfinite(got)):
        return float("inf")
    return float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30))


def line(r) -> str:
    graph = (f" | ours graph {r['ours_graph_us']:9.1f} (base {r['base_graph_us']:9.1f}, overhead "
             f"{r['overhead_us']:8.1f}, lora kernels {r['lora_kernels_us']:8.1f}) peft/graph "
             f"{r['peft_over_ours_graph']:6.1f}x") if "ours_graph_us" in r else ""
    return (f"{r['case']:14s} peft {r['peft_us']:10.1f} | ours eager {r['ours_eager_us']:10.1f} "
            f"(peft/eager {r['peft_over_ours_eager']:5.1f}x){graph} | err {r['err_eager']:.1e} effect "
            f"{r['lora_effect']:.1e}{'' if r['check_passed'] else ' CHECK FAILED'}")


def markdown(results: list) -> str:
    head = ("| case | peft us | ours eager us | ours graph us | base graph us | LoRA overhead us (% base) | "
            "LoRA kernels us | peft / ours graph | peft / ours eager | err |\n"
            "|---|---|---|---|---|---|---|---|---|---|\n")
    rows = []
    for r in results:
        g = r.get("ours_graph_us")
        over = (f"{r['overhead_us']:.1f} ({100 * r['overhead_us'] / r['base_graph_us']:.1f}%)" if g else "-")
        rows.append(f"| {r['case']} | {r['peft_us']:.1f} | {r['ours_eager_us']:.1f} | "
                    f"{g:.1f} | {r['base_graph_us']:.1f} | {over} | {r['lora_kernels_us']:.1f} | "
                    f"{r['peft_over_ours_graph']:.1f}x | {r['peft_over_ours_eager']:.1f}x | {r['err_eager']:.1e} |"
                    if g else
                    f"| {r['case']} | {r['peft_us']:.1f} | {r['ours_eager_us']:.1f} | - | - | - | - | - | "
                    f"{r['peft_over_ours_eager']:.1f}x | {r['err_eager']:.1e} |")
    return head + "\n".join(rows) + "\n"


def env_meta(args) -> dict:
    import peft
    import torch
    import transformers
    commit = os.environ.get("GIT_COMMIT")
    if not commit:
        try:
            commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                    check=True, cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip()
        except (OSError, subprocess.CalledProcessError):
            commit = "unknown"
    return dict(date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), commit=commit,
                device=torch.cuda.get_device_name() if torch.cuda.is_available() and not args.smoke else "cpu",
                torch=torch.__version__, transformers=transformers.__version__, peft=peft.__version__,
                python=platform.python_version(), smoke=bool(args.smoke), steps=args.steps,
                num_adapters=NUM_ADAPTERS, context=CONTEXT, max_len=MAX_LEN)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="benchmarks/results")
    p.add_argument("--cases", default=None, help="regex over case names, e.g. 'B32 D8 r16'")
    p.add_argument("--smoke", action="store_true", help="CPU, tiny model, float32: the pipeline, not times")
    p.add_argument("--steps", type=int, default=None, help="timed steps per implementation (default 10, smoke 2)")
    p.add_argument("--tag", default="")
    args = p.parse_args(argv)
    args.steps = args.steps or (2 if args.smoke else 10)
    args.case_list = [c for c in cases(args.smoke) if not args.cases or re.search(args.cases, name_of(c))]
    if not args.case_list:
        print("no case matches")
        return 2
    t_start = time.perf_counter()
    meta = env_meta(args)
    bench = Bench(args)
    results = []
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%S")
    base = os.path.join(args.out, f"hf_{'smoke' if args.smoke else 'h200'}_{stamp}{args.tag}")
    os.makedirs(args.out, exist_ok=True)
    for case in sorted(args.case_list, key=lambda c: (c[2], c[0], c[1])):
        res = bench.run_case(case)
        results.append(res)
        print(line(res), flush=True)
        with open(base + ".json", "w") as f:
            json.dump(dict(meta={**meta, "phases_s": bench.phases, "wall_s": time.perf_counter() - t_start},
                           cases=results), f, indent=1)
    md = markdown(results)
    with open(base + ".md", "w") as f:
        f.write(f"run {json.dumps(meta)}\n\n" + md)
    print(md)
    print(f"wrote {base}.json / .md in {time.perf_counter() - t_start:.0f} s")
    failed = [r["case"] for r in results if not r["check_passed"]]
    if failed:
        print(f"CHECK FAILED: {failed}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
