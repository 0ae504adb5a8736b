"""Compile every Triton launch of the benchmark sweep for a GPU target, without a GPU.

    PYTHONPATH=. python benchmarks/compile_launches.py                        # the installed Triton
    PYTHONPATH=/tmp/triton36:. python benchmarks/compile_launches.py          # another Triton (a wheel
                                                                              # unpacked with pip --target)
    PYTHONPATH=. python benchmarks/compile_launches.py --lora-dtype fp8 --modes 0   # fp8 adapter weights

The GPU image can carry another Triton than the development machine (3.6 against 3.9 here), and
Triton's compiler passes differ between versions: a launch that compiles here can fail there. This
builds, for each sweep case (`bench_triton.sweep_cases`, both slice sets) and each epilogue mode
(none, a LoRA bias on every slice, a DoRA column scale on every slice), the launches
`torch_lora.ops.triton` makes on an H200 -- the launch table's configs, the fused kernel where the
table picks it, else the shrink and the expand -- and compiles each kernel for sm_90 with the
argument specialisations a real launch gets (integers equal to 1 become constants, multiples of 16
get divisibility hints except the token counts, `planning.TOKEN_COUNT_PARAMS`, pointers are
16-byte aligned), as Triton's launcher and the JAX FFI launcher do. Prints one line per distinct
launch and the failures; exits 1 if any failed. A kernel whose shared memory exceeds an H200
block's (SMEM_LIMIT) counts as failed: it compiles, but its launch would be refused. `--lora-dtype
fp8`: e4m3 weights with float32 channel scales and the fp8 launch configs (the table's "fp8" entries,
else its 16-bit configs). Compiling is CPU work (about 0.5 s a kernel).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
if __name__ == "__main__":
    # Compiled kernels, not the interpreter's: before the kernels are decorated. Only when run as a
    # script: a test that imports this module keeps its process's interpreter setting.
    os.environ.pop("TRITON_INTERPRET", None)

import torch  # noqa: E402

from lora_core.kernels import arguments, configs, fused, plan_expand, plan_shrink  # noqa: E402
from lora_core.kernels.planning import TOKEN_COUNT_PARAMS  # noqa: E402

DEVICE = "NVIDIA H200"
HIDDEN = 4096
SMEM_LIMIT = 232448          # bytes of shared memory one block may use on an H200 (227 KiB)
_TYPES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", torch.int32: "i32",
          torch.int64: "i64", torch.float8_e4m3fn: "fp8e4nv"}


def _strides(t: torch.Tensor) -> tuple:
    return tuple(t.stride())


def signature(call: arguments.KernelCall) -> tuple:
    """(signature, constants, attributes) of `call` as a real launch specialises it."""
    names = call.kernel.arg_names
    sig, consts, attrs = {}, {}, {}
    for n, v in call.plan.constexprs.items():
        sig[n] = "constexpr"
        consts[(names.index(n),)] = v
    free = [n for n in names if n not in call.plan.constexprs]
    for n, v in zip(free, call.args):
        i = names.index(n)
        if isinstance(v, torch.Tensor):
            sig[n] = "*" + _TYPES[v.dtype]
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif isinstance(v, float):
            sig[n] = "fp32"
        elif int(v) == 1:
            sig[n] = "constexpr"
            consts[(i,)] = 1
        else:
            sig[n] = "i32"
            if int(v) % 16 == 0 and n not in TOKEN_COUNT_PARAMS:
                attrs[(i,)] = [["tt.divisibility", 16]]
    return {n: sig[n] for n in names}, consts, attrs


def variant_key(call: arguments.KernelCall) -> tuple:
    """What Triton compiles `call` as, hashable: kernel, meta-parameters, warps, stages and the
    specialised signature (types, constants, divisibility hints)."""
    sig, consts, attrs = signature(call)
    return (call.kernel.__name__, call.plan.key[1:], repr(sig), tuple(sorted(consts.items())),
            repr(sorted(attrs.items())))


def compile_call(call: arguments.KernelCall, capability: int = 90) -> str:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    sig, consts, attrs = signature(call)
    try:
        compiled = triton.compile(ASTSource(call.kernel, sig, constexprs=consts, attrs=attrs),
                                  target=GPUTarget("cuda", capability, 32),
                                  options=dict(num_warps=call.plan.num_warps, num_stages=call.plan.num_stages))
        shared = int(compiled.metadata.shared)
        return "ok" if shared <= SMEM_LIMIT else f"FAILED shared memory {shared} > {SMEM_LIMIT} bytes"
    except Exception as e:
        return f"FAILED {type(e).__name__}: {str(e).strip().splitlines()[-1][:160] if str(e).strip() else ''}"


def launches(T: int, rank: int, widths: tuple, slots: int, mode: int, dtype=torch.bfloat16,
             hidden: int = HIDDEN, fused_extra: dict | None = None, fp8: bool = False) -> list:
    """[(label, KernelCall)] of one add_lora_linear as the torch Triton backend launches it on an
    H200; mode: 0 no epilogue vector, 1 a LoRA bias on every slice, 2 a DoRA scale on every slice.
    fused_extra: the fused kernel for every launch it can take (rank <= 64), its table config
    updated with these keys (configs to try on the GPU, e.g. {"BLOCK_N": 128, "BLOCK_K": 256}).
    fp8: e4m3 A and B with float32 channel scales, launched with the fp8 configs."""
    from torch_lora.meta import LoRAKernelMeta
    wd = "bfloat16" if dtype == torch.bfloat16 else "float16"
    S = len(widths)
    x = torch.zeros(T, hidden, dtype=dtype)
    w_torch = torch.float8_e4m3fn if fp8 else dtype
    w_name = "float8_e4m3fn" if fp8 else wd
    a = [torch.zeros(slots, rank, hidden, dtype=w_torch) for _ in widths]
    b = [torch.zeros(slots, n, rank, dtype=w_torch) for n in widths]
    a_scales = tuple(torch.ones(slots, rank) for _ in widths) if fp8 else None
    b_scales = tuple(torch.ones(slots, n) for n in widths) if fp8 else None
    y = torch.zeros(T, sum(widths), dtype=dtype)
    vec_dtype = torch.float32 if mode == 2 else dtype
    vectors = [torch.zeros(slots, n, dtype=vec_dtype) for n in widths] if mode else None
    bias = None if not mode else tuple(arguments.ColumnScale(v) if mode == 2 else v for v in vectors)
    flags = arguments.bias_flags(bias, S)
    meta = LoRAKernelMeta.make(slots, T, "cpu")
    meta.prepare_tensors(torch.zeros(T, dtype=torch.long))
    m = meta.meta_args(T)[:5]
    groups = m[4].shape[0]
    offsets = tuple(int(sum(widths[:i])) for i in range(S))
    if rank <= 64 and (fused_extra is not None or configs.use_fused(T, rank, S, slots, device=DEVICE,
                                                                    w_dtype=w_name)):
        cfg = {**configs.fused_config(T, hidden, max(widths), rank, S, slots, device=DEVICE, w_dtype=w_name),
               **(fused_extra or {})}
        plan = fused.plan_fused(T, hidden, rank, widths, groups, wd, w_name, cfg, add_inputs=True, bias_flags=flags,
                                has_ranks=False, pdl=True)
        ws = torch.zeros(plan.workspace_shape)
        sync = torch.zeros(plan.sync_ints, dtype=torch.int32)
        return [("fused", arguments.fused_call(plan, x, a, b, bias, None, m, y, sync, ws, 0.5, offsets, _strides,
                                               a_scales=a_scales, b_scales=b_scales))]
    scfg = configs.shrink_config(T, hidden, rank, S, slots, device=DEVICE, w_dtype=w_name)
    splan = plan_shrink(T, hidden, rank, S, groups, wd, w_name, scfg, lora_only=True, workspace=True,
                        has_ranks=False, pdl=True)
    ws = torch.zeros(splan.num_partials, S, T, rank)
    ecfg = configs.expand_config(T, max(widths), rank, S, slots, device=DEVICE, w_dtype=w_name)
    eplan = plan_expand(T, rank, widths, groups, splan.num_partials, w_name, wd, ecfg, add_inputs=True,
                        bias_flags=flags, has_ranks=False, pdl=bool(splan.constexprs.get("USE_PDL")))
    return [("shrink", arguments.shrink_call(splan, x, a, None, m, 0.5, ws, _strides, a_scales=a_scales)),
            ("expand", arguments.expand_call(eplan, ws, b, bias, None, m, y, offsets, _strides, b_scales=b_scales))]


def main(argv=None) -> int:
    import bench_triton
    import triton
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--modes", default="0,1,2", help="epilogue modes: 0 none, 1 bias, 2 DoRA scale")
    p.add_argument("--cases", default=None, help="substring of the sweep case names to keep")
    p.add_argument("--fused-extra", default=None,
                   help="JSON: force the fused kernel (rank <= 64) with these keys over the table's fused config, "
                        "e.g. '{\"BLOCK_N\": 128, \"BLOCK_K\": 256}'")
    p.add_argument("--hidden", type=int, default=HIDDEN, help="the hidden size (the sweep's is 4096)")
    p.add_argument("--lora-dtype", choices=("bf16", "fp8"), default="bf16",
                   help="the adapter weights' dtype (fp8: e4m3 with channel scales, the fp8 launch configs)")
    args = p.parse_args(argv)
    fused_extra = json.loads(args.fused_extra) if args.fused_extra else None
    modes = [int(v) for v in args.modes.split(",")]
    print(f"Triton {triton.__version__}, sm_90, launch table of {DEVICE}, {args.lora_dtype} weights", flush=True)
    seen, failed, t0 = set(), [], time.perf_counter()
    for name, _kind, T, D, rank, _frac, _ranks in bench_triton.sweep_cases():
        if args.cases and args.cases not in name:
            continue
        for slices, widths in bench_triton.SLICES.items():
            for mode in modes:
                if fused_extra is not None and rank > 64:
                    continue
                for label, call in launches(T, rank, tuple(widths), max(8, D), mode, hidden=args.hidden,
                                            fused_extra=fused_extra, fp8=args.lora_dtype == "fp8"):
                    key = variant_key(call)
                    if key in seen:
                        continue
                    seen.add(key)
                    result = compile_call(call)
                    print(f"{name} {slices} mode {mode} {label}: {result}", flush=True)
                    if result != "ok":
                        failed.append(f"{name} {slices} mode {mode} {label}")
    print(f"{len(seen)} distinct launches compiled in {time.perf_counter() - t0:.0f} s; {len(failed)} failed"
          + (f": {failed}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
