"""The Triton kernels compile for the H200 (sm_90) on a machine without a GPU.

The interpreter (tests/test_triton_kernels.py, the conformance suite) checks the kernels' results
but not that Triton's compiler accepts them: loop-carried types, constexpr branches, PDL
instructions and dot shapes are only checked when compiling. Triton compiles to PTX and a cubin
without a GPU (its bundled ptxas), so each launch variant the backends use is compiled here for
GPUTarget("cuda", 90, 32). Running them stays with the `gpu` tests. "deterministic": the
deterministic launches' tensor-core instruction sequence is the same for any token count.
"pair-order": a one-adapter token's deterministic expand adds up in the same order in the pair
kernels as in the pair-free ones (the same instructions, the output's old value entering the sum at
the same place: tests/test_deterministic_pairs.py checks the bits on a GPU). "fp8":
the three kernels with fp8 (e4m3) weights and float32 channel scales (contract section 11), A and
B both fp8 or one of them.

The test session runs with TRITON_INTERPRET=1 (kernels become interpreted functions), so the
compiles run in a child process without it: `python tests/test_triton_compile.py KERNEL`.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
INT32_POINTERS = {"ranks_ptr", "mapping_ptr", "sorted_ptr", "counts_ptr", "starts_ptr", "active_ptr", "sync_ptr",
                  "pair_slots_ptr", "expert_ids_ptr", "post_pad_ptr", "token_lora_ptr", "enabled_ptr"}


def _signature(kernel, plan, act: str, float32_pointers=(), fp8_pointers=()) -> dict:
    sig = {}
    for name in kernel.arg_names:
        if name in plan.constexprs:
            sig[name] = "constexpr"
        elif name in INT32_POINTERS:
            sig[name] = "*i32"
        elif name in fp8_pointers:
            sig[name] = "*fp8e4nv"
        elif name in float32_pointers or name == "pair_weights_ptr":
            sig[name] = "*fp32"
        elif name.endswith("_ptr"):
            sig[name] = f"*{act}"
        elif name == "scale":
            sig[name] = "fp32"
        else:
            sig[name] = "i32"
    return sig


def _cfg(**kw):
    return dict(num_warps=4, num_stages=2, **kw)


def _weights(kind: str, fp8: bool) -> tuple:
    """(fp8 pointers, float32 scale pointers) of a launch whose `kind` weights ("a", "b") are fp8."""
    if not fp8:
        return (), ()
    return tuple(f"{kind}{s}_ptr" for s in range(4)), tuple(f"{kind}s{s}_ptr" for s in range(4))


def _fp8_variants():
    """(label, kernel, plan, activation dtype, float32 pointers, fp8 pointers): the kernels with fp8
    weights (the plans name the weight dtype "float8_e4m3fn")."""
    import lora_core.kernels as kernels
    fp8 = "float8_e4m3fn"
    a8, a_sc = _weights("a", True)
    b8, b_sc = _weights("b", True)
    out = []
    for label, T, rank, S, cfg, kw in (
            ("decode-pdl-ranks", 8, 16, 3, _cfg(BLOCK_M=16, BLOCK_K=256, SPLIT_K=8),
             dict(lora_only=True, workspace=True, has_ranks=True, pdl=True)),
            ("all-slices-prefetch", 512, 64, 3, _cfg(BLOCK_M=16, BLOCK_K=128, SPLIT_K=4, ALL_SLICES=True,
                                                     PREFETCH=True),
             dict(lora_only=True, workspace=True, has_ranks=True, pdl=True)),
            ("atomic-fp16", 512, 16, 2, _cfg(BLOCK_M=32, BLOCK_K=128, SPLIT_K=4),
             dict(lora_only=False, workspace=False, has_ranks=False)),
            ("pairs2", 8, 16, 3, _cfg(BLOCK_M=16, BLOCK_K=256, SPLIT_K=8),
             dict(lora_only=True, workspace=True, has_ranks=True, pdl=True, pairs=2)),
            ("pairs4-all-slices", 512, 64, 3, _cfg(BLOCK_M=32, BLOCK_K=128, SPLIT_K=4, ALL_SLICES=True),
             dict(lora_only=False, workspace=False, has_ranks=False, pairs=4))):
        act = "float16" if "fp16" in label else "bfloat16"
        plan = kernels.plan_shrink(T, 4096, rank, S, 9 if "pairs" not in label else 257, act, fp8, cfg, **kw)
        assert not plan.constexprs["CAST_FP32"]           # the dot runs in the activations' dtype
        out.append((f"shrink-{label}", kernels.lora_shrink_kernel, plan, "fp16" if act == "float16" else "bf16",
                    ("out_ptr",) + a_sc, a8))
    for label, T, rank, block_r, cfg_extra, kw in (
            ("r16-pdl-ranks-bias", 8, 16, 16, {}, dict(bias_flags=(True, False, False), has_ranks=True, pdl=True)),
            ("r128-looped", 8, 128, 64, {}, dict(bias_flags=(False,) * 3, has_ranks=False)),
            ("b-select-r64", 128, 64, 64, dict(B_SELECT=True, BLOCK_N=256), dict(bias_flags=(False,) * 3,
                                                                                 has_ranks=False, pdl=True)),
            ("tiles4-ahead-prefetch", 8192, 16, 16, dict(TILES_N=4, Y_AHEAD=True, PREFETCH=True, PREFETCH_Y=True,
                                                         BLOCK_M=32),
             dict(bias_flags=(False,) * 3, has_ranks=True, pdl=True)),
            ("dora-tiles2", 512, 64, 64, dict(TILES_N=2, BLOCK_M=64), dict(bias_flags=(2, 2, 2), has_ranks=False)),
            ("pairs2-tiles2-ranks", 512, 128, 64, dict(TILES_N=2, BLOCK_M=64),
             dict(bias_flags=(False,) * 3, has_ranks=True, pairs=2))):
        cfg = _cfg(**{"BLOCK_M": 16, "BLOCK_N": 128, "BLOCK_R": block_r, **cfg_extra})
        plan = kernels.plan_expand(T, rank, (4096, 1024, 1024), 9 if "pairs" not in label else 257, 2, fp8,
                                   "bfloat16", cfg, add_inputs=True, **kw)
        f32 = ("buf_ptr",) + b_sc + (tuple(f"bias{s}_ptr" for s in range(4)) if "dora" in label else ())
        out.append((f"expand-{label}", kernels.lora_expand_kernel, plan, "bf16", f32, b8))
    # float32 activations: the e4m3 tiles enter an IEEE float32 dot
    plan = kernels.plan_shrink(8, 4096, 16, 1, 9, "float32", fp8, _cfg(BLOCK_M=16, BLOCK_K=128, SPLIT_K=4),
                               lora_only=True, workspace=True, has_ranks=False)
    out.append(("shrink-fp32-activations", kernels.lora_shrink_kernel, plan, "fp32", ("out_ptr",) + a_sc, a8))
    plan = kernels.plan_expand(8, 16, (4096,), 9, 4, fp8, "float32", _cfg(BLOCK_M=16, BLOCK_N=128, BLOCK_R=16),
                               add_inputs=True, bias_flags=(False,), has_ranks=False)
    out.append(("expand-fp32-y", kernels.lora_expand_kernel, plan, "fp32", ("buf_ptr",) + b_sc, b8))
    for label, T, rank, a_fp8, b_fp8, pairs in (("T8-r16-both", 8, 16, True, True, 0),
                                                 ("T100-r64-a-only", 100, 64, True, False, 0),
                                                 ("T8-r16-b-only", 8, 16, False, True, 0),
                                                 ("pairs2-T8-r16-both", 8, 16, True, True, 2)):
        plan = kernels.plan_fused(T, 4096, rank, (4096, 1024), 9 if not pairs else 257,
                                  "bfloat16", fp8 if a_fp8 else "bfloat16", _cfg(BLOCK_M=16, BLOCK_N=128, BLOCK_K=128),
                                  add_inputs=True, bias_flags=(False, not pairs), has_ranks=True, pdl=True,
                                  pairs=pairs)
        (pa, sa), (pb, sb) = _weights("a", a_fp8), _weights("b", b_fp8)
        out.append((f"fused-{label}", kernels.lora_fused_kernel, plan, "bf16", ("ws_ptr",) + sa + sb, pa + pb))
    return out


def _variants(kernel_name: str):
    """(label, kernel, plan, activation dtype, float32 pointer arguments) per launch variant."""
    import lora_core.kernels as kernels
    from lora_core.kernels import configs
    if kernel_name == "fp8":
        return _fp8_variants()
    if kernel_name == "shrink":
        return [
            # the linear path at decode on Hopper: workspace planes, per-slot ranks, PDL
            ("decode-pdl-ranks", kernels.lora_shrink_kernel,
             kernels.plan_shrink(8, 4096, 16, 3, 9, "bfloat16", "bfloat16", _cfg(BLOCK_M=16, BLOCK_K=256, SPLIT_K=8),
                           lora_only=True, workspace=True, has_ranks=True, pdl=True), "bf16", ("out_ptr",)),
            ("prefill-fp16", kernels.lora_shrink_kernel,
             kernels.plan_shrink(2048, 4096, 64, 1, 5, "float16", "float16", _cfg(BLOCK_M=64, BLOCK_K=128, SPLIT_K=1),
                           lora_only=True, workspace=True, has_ranks=False), "fp16", ("out_ptr",)),
            # the stand-alone shrink: split-K atomics into a zeroed output
            # every slice of the launch in one program (ALL_SLICES), with ranks, prefetch and PDL
            ("all-slices-pdl-ranks", kernels.lora_shrink_kernel,
             kernels.plan_shrink(512, 4096, 64, 3, 9, "bfloat16", "bfloat16",
                           _cfg(BLOCK_M=16, BLOCK_K=128, SPLIT_K=4, ALL_SLICES=True, PREFETCH=True),
                           lora_only=True, workspace=True, has_ranks=True, pdl=True), "bf16", ("out_ptr",)),
            ("atomic", kernels.lora_shrink_kernel,
             kernels.plan_shrink(512, 4096, 16, 2, 9, "bfloat16", "bfloat16", _cfg(BLOCK_M=32, BLOCK_K=128, SPLIT_K=4),
                           lora_only=False, workspace=False, has_ranks=False), "bf16", ("out_ptr",)),
            # several adapters per token (PAIRS): the linear path with ranks and PDL, and the
            # stand-alone shrink's atomics, one tile per batch
            ("pairs2-decode-pdl-ranks", kernels.lora_shrink_kernel,
             kernels.plan_shrink(8, 4096, 16, 3, 9, "bfloat16", "bfloat16", _cfg(BLOCK_M=16, BLOCK_K=256, SPLIT_K=8),
                           lora_only=True, workspace=True, has_ranks=True, pdl=True, pairs=2), "bf16", ("out_ptr",)),
            ("pairs4-atomic-all-slices", kernels.lora_shrink_kernel,
             kernels.plan_shrink(512, 4096, 64, 3, 257, "bfloat16", "bfloat16",
                           _cfg(BLOCK_M=32, BLOCK_K=128, SPLIT_K=4, ALL_SLICES=True),
                           lora_only=False, workspace=False, has_ranks=False, pairs=4), "bf16", ("out_ptr",)),
        ] + [
            # deterministic launches (configs.deterministic_config): the linear path with PDL and
            # the stand-alone shrink, per rank class
            (f"deterministic-r{rank}-{'ws' if ws else 'alone'}", kernels.lora_shrink_kernel,
             kernels.plan_shrink(100, 4096, rank, 3, 9, "bfloat16", "bfloat16",
                                 configs.shrink_config(100, 4096, rank, 3, 8, deterministic=True), lora_only=ws,
                                 workspace=ws, has_ranks=False, pdl=ws, deterministic=True), "bf16", ("out_ptr",))
            for rank in (16, 64, 128) for ws in (True, False)
        ]
    if kernel_name == "expand":
        out = []
        # one rank block (B loaded before the PDL wait) and looped rank blocks
        for rank, block_r, pdl, ranks in ((16, 16, True, True), (128, 64, False, False), (64, 64, True, False)):
            plan = kernels.plan_expand(8, rank, (4096, 1024, 1024), 9, 8, "bfloat16", "bfloat16",
                                 _cfg(BLOCK_M=16, BLOCK_N=128, BLOCK_R=block_r), add_inputs=True,
                                 bias_flags=(True, False, False), has_ranks=ranks, pdl=pdl)
            out.append((f"r{rank}-R{block_r}-pdl{int(pdl)}-ranks{int(ranks)}", kernels.lora_expand_kernel, plan,
                        "bf16", ("buf_ptr",)))
        # one tile, one rank block, the B tile through the rank select without per-slot ranks
        plan = kernels.plan_expand(128, 64, (4096,), 9, 8, "bfloat16", "bfloat16",
                             _cfg(BLOCK_M=16, BLOCK_N=256, BLOCK_R=64, B_SELECT=True), add_inputs=True,
                             bias_flags=(False,), has_ranks=False, pdl=True)
        assert plan.constexprs["B_SELECT"]
        out.append(("b-select-r64", kernels.lora_expand_kernel, plan, "bf16", ("buf_ptr",)))
        # several output tiles per program (prefill and mid-decode configs): one rank block and
        # looped ones, the next y loaded ahead, the B tiles prefetched into L2 before the PDL wait
        for rank, block_r, ahead, prefetch in ((16, 16, False, False), (16, 16, True, True), (64, 32, True, False),
                                               (64, 64, False, True)):
            plan = kernels.plan_expand(8192, rank, (4096, 1024, 1024), 5, 2, "bfloat16", "bfloat16",
                                 _cfg(BLOCK_M=32, BLOCK_N=128, BLOCK_R=block_r, TILES_N=4, Y_AHEAD=ahead,
                                      PREFETCH=prefetch, PREFETCH_Y=prefetch),
                                 add_inputs=True, bias_flags=(False, False, False), has_ranks=prefetch, pdl=True)
            assert plan.constexprs["PREFETCH_LINES"] == (1 if prefetch else 0)
            assert plan.constexprs["PREFETCH_Y_LINES"] == (8 if prefetch else 0)   # 512 columns, 64 per line
            out.append((f"tiles4-r{rank}-R{block_r}-ahead{int(ahead)}-prefetch{int(prefetch)}",
                        kernels.lora_expand_kernel,
                        plan, "bf16", ("buf_ptr",)))
        # an epilogue vector on every slice inside the output-tile loop (the H200 table's T512 r64
        # three-slice config): a bias (added) and DoRA column scales (float32, multiplied)
        for flags, f32 in (((1, 1, 1), ("buf_ptr",)), ((2, 2, 2), ("buf_ptr", "bias0_ptr", "bias1_ptr", "bias2_ptr",
                                                                   "bias3_ptr"))):
            plan = kernels.plan_expand(512, 64, (4096, 1024, 1024), 9, 1, "bfloat16", "bfloat16",
                                       dict(num_warps=4, num_stages=3, BLOCK_M=64, BLOCK_N=128, BLOCK_R=64, TILES_N=2,
                                            PREFETCH_Y=True),
                                       add_inputs=True, bias_flags=flags, has_ranks=False, pdl=True)
            out.append((f"tiles2-epilogue{flags[0]}-all-slices", kernels.lora_expand_kernel, plan, "bf16", f32))
        for rank in (16, 64, 128):    # deterministic launches (configs.deterministic_config)
            plan = kernels.plan_expand(100, rank, (4096, 1024, 1024), 9, 4, "bfloat16", "bfloat16",
                                       configs.expand_config(100, 4096, rank, 3, 8, deterministic=True),
                                       add_inputs=True, bias_flags=(True, False, False), has_ranks=False, pdl=True,
                                       deterministic=True)
            out.append((f"deterministic-r{rank}", kernels.lora_expand_kernel, plan, "bf16", ("buf_ptr",)))
        # several adapters per token (PAIRS): decode with PDL, prefill with several tiles and ranks
        for T, rank, k, tiles, ranks in ((8, 16, 2, 1, False), (2048, 64, 4, 4, True), (512, 128, 2, 2, True)):
            plan = kernels.plan_expand(T, rank, (4096, 1024, 1024), 257, 2, "bfloat16", "bfloat16",
                                       _cfg(BLOCK_M=16 if T <= 8 else 64, BLOCK_N=128, BLOCK_R=64, TILES_N=tiles),
                                       add_inputs=True, bias_flags=(False, False, False), has_ranks=ranks,
                                       pdl=T <= 8, pairs=k)
            out.append((f"pairs{k}-T{T}-r{rank}-tiles{tiles}", kernels.lora_expand_kernel, plan, "bf16",
                        ("buf_ptr",)))
        return out
    if kernel_name == "moe":
        return _moe_variants()
    if kernel_name == "moe-fp8":
        return _moe_fp8_variants()
    out = []
    # decode (one tile per group) and token tiles; rank 16 and 64; with and without PDL
    for T, rank, pdl in ((8, 16, True), (8, 64, False), (100, 16, True)):
        plan = kernels.plan_fused(T, 4096, rank, (4096, 1024), 9, "bfloat16", "bfloat16",
                            _cfg(BLOCK_M=16, BLOCK_N=128, BLOCK_K=128), add_inputs=True,
                            bias_flags=(False, True), has_ranks=True, pdl=pdl)
        out.append((f"T{T}-r{rank}-pdl{int(pdl)}", kernels.lora_fused_kernel, plan, "bf16", ("ws_ptr",)))
    for T, rank, k in ((8, 16, 2), (32, 64, 4)):                 # several adapters per token (PAIRS)
        plan = kernels.plan_fused(T, 4096, rank, (4096, 1024), 257, "bfloat16", "bfloat16",
                                  _cfg(BLOCK_M=16, BLOCK_N=128, BLOCK_K=128), add_inputs=True,
                                  bias_flags=(False, False), has_ranks=True, pdl=True, pairs=k)
        out.append((f"pairs{k}-T{T}-r{rank}", kernels.lora_fused_kernel, plan, "bf16", ("ws_ptr",)))
    return out


def _moe_variants():
    """The MoE LoRA kernel's two launches at Mixtral-8x7B / Qwen3-30B-A3B shapes: the naive order's
    GEMV and tl.dot paths, sorted blocks of 16 and 64 rows (the split-bfloat16 expand), router
    weights, per-slot ranks, a shared A, the deterministic plan, and a config of every knob moved."""
    from lora_core.kernels import moe_configs
    from lora_core.kernels.moe_lora import moe_lora_kernel, plan_moe_lora
    moved = moe_configs.MoeConfig(BLOCK_K=256, R_CHUNK=16, K_SPLIT=4, shrink_warps=8, shrink_stages=4, BLOCK_N=32,
                                  TILES_N=8, expand_warps=8, expand_stages=4, GEMV=False)
    out = []
    for label, pairs, naive, bm, rank, hidden, widths, down, extra in (
            ("mixtral-w13-T16-r64-gemv", 32, True, 16, 64, 4096, (14336, 14336), False, {}),
            ("mixtral-w2-T1-r16-gemv-ranks", 2, True, 16, 16, 14336, (4096,), True, dict(has_ranks=True)),
            ("qwen-w13-T64-r16-dot", 512, True, 16, 16, 2048, (768, 768), False,
             dict(config=moved.replace(R_CHUNK=16, BLOCK_N=64, TILES_N=2, shrink_warps=4, expand_warps=4))),
            ("mixtral-w13-T256-r64-sorted16", 512, False, 16, 64, 4096, (14336, 14336), False, {}),
            ("mixtral-w13-T2048-r16-sorted64-shared-a", 4096, False, 64, 16, 4096, (14336, 14336), False,
             dict(shared_a=True)),
            ("qwen-w2-T2048-r64-sorted64", 16384, False, 64, 64, 768, (2048,), True, {}),
            ("mixtral-w13-T64-r64-moved", 128, False, 16, 64, 4096, (14336, 14336), False, dict(config=moved)),
            ("deterministic-r64", 32, True, 16, 64, 4096, (14336, 14336), False, dict(deterministic=True)),
            ("qwen-w13-T256-r16-sorted16-pdl", 2048, False, 16, 16, 2048, (768, 768), False, dict(pdl=True)),
            ("mixtral-w13-T8192-r64-sub32-pdl", 16384, False, 64, 64, 4096, (14336, 14336), False,
             dict(pdl=True, config=moved.replace(BLOCK_M=32, PERSIST=1, BLOCK_N=128, TILES_N=1)))):
        em = -(-(pairs + 128 * (bm - 1)) // bm) * bm
        plan = plan_moe_lora(num_pairs=pairs, num_slots=32, num_experts=128, hidden=hidden, widths=widths, rank=rank,
                             naive=naive, sorted_len=0 if naive else em, block_m=bm, mul_routed_weight=down,
                             dtypes=("bfloat16",) * 3, **{"shared_a": False, **extra})
        for phase in (0, 1):
            out.append((f"{label}-{'shrink' if phase == 0 else 'expand'}", moe_lora_kernel, plan.phase(phase), "bf16",
                        ("buf_ptr", "topk_weights_ptr")))
    return out


def _moe_fp8_variants():
    """The MoE LoRA kernel's launches with fp8 (e4m3) expert weights and float32 channel scales: A
    and B both fp8 or one of them, the naive order's GEMV and tl.dot paths, sorted blocks of 16 and
    64 rows (64: the split-bfloat16 expand with an e4m3 B tile), float16 and float32 activations."""
    from lora_core.kernels.moe_lora import moe_lora_kernel, plan_moe_lora
    from lora_core.kernels.planning import dot_dtype
    fp8 = "float8_e4m3fn"
    out = []
    for label, pairs, naive, bm, rank, widths, down, act, a_fp8, b_fp8 in (
            ("w13-T16-r64-gemv-both", 32, True, 16, 64, (14336, 14336), False, "bfloat16", True, True),
            ("w2-T64-r16-dot-b-only", 512, True, 16, 16, (4096,), True, "bfloat16", False, True),
            ("w13-T256-r64-sorted16-a-only-fp16", 512, False, 16, 64, (14336, 14336), False, "float16", True, False),
            ("w13-T2048-r16-sorted64-both-split", 4096, False, 64, 16, (14336, 14336), False, "bfloat16", True, True),
            ("w2-T256-r16-sorted16-both-fp32", 512, False, 16, 16, (4096,), True, "float32", True, True)):
        em = -(-(pairs + 128 * (bm - 1)) // bm) * bm
        w_a, w_b = fp8 if a_fp8 else act, fp8 if b_fp8 else act
        plan = plan_moe_lora(num_pairs=pairs, num_slots=32, num_experts=128, hidden=4096, widths=widths, rank=rank,
                             naive=naive, sorted_len=0 if naive else em, block_m=bm, mul_routed_weight=down,
                             shared_a=False, dtypes=(act, dot_dtype(w_a, act), dot_dtype(w_b, act)))
        assert not plan.constexprs["CAST_FP32"]           # the tiles enter the products in the activations' dtype
        fp8_ptrs = (("a0_ptr", "a1_ptr") if a_fp8 else ()) + (("b0_ptr", "b1_ptr") if b_fp8 else ())
        f32 = ("buf_ptr", "topk_weights_ptr", "as0_ptr", "as1_ptr", "bs0_ptr", "bs1_ptr")
        short = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}[act]
        for phase in (0, 1):
            out.append((f"{label}-{'shrink' if phase == 0 else 'expand'}", moe_lora_kernel, plan.phase(phase), short,
                        f32, fp8_ptrs))
    return out


def compile_all(kernel_name: str) -> int:
    """Child process: compiles every variant of one kernel for sm_90; prints one line each."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    failed = 0
    for label, kernel, plan, act, f32, *fp8 in _variants(kernel_name):
        names = kernel.arg_names
        src = ASTSource(kernel, _signature(kernel, plan, act, f32, *fp8),
                        constexprs={(names.index(k),): v for k, v in plan.constexprs.items()})
        try:
            compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                                      options=dict(num_warps=plan.num_warps, num_stages=plan.num_stages))
            ok = bool(compiled.asm.get("cubin"))
            print(f"{kernel_name} {label}: {'ok' if ok else 'no cubin'}", flush=True)
            failed += not ok
        except Exception as e:
            print(f"{kernel_name} {label}: FAILED {type(e).__name__}: {str(e)[:2000]}", flush=True)
            failed += 1
    return failed


def _mma_lines(ptx: str) -> list:
    """The tensor-core instructions of a kernel's PTX, in order, register names left out."""
    return [re.sub(r"%\w+", "%r", line.strip()) for line in ptx.splitlines() if "mma" in line]


def compare_deterministic() -> int:
    """Child process: a deterministic launch's tensor-core instructions (the order of a dot's
    additions) do not change with Triton's specialisation of the token count (num_tokens divisible
    by 16 or not), the one thing of T that reaches the compiled kernel besides the grid."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    import lora_core.kernels as kernels
    from lora_core.kernels import configs
    failed = 0
    for rank in (16, 64, 128):
        shrink = kernels.plan_shrink(100, 4096, rank, 3, 9, "bfloat16", "bfloat16",
                                     configs.shrink_config(100, 4096, rank, 3, 8, deterministic=True), lora_only=True,
                                     workspace=True, has_ranks=False, pdl=True, deterministic=True)
        expand = kernels.plan_expand(100, rank, (4096, 1024, 1024), 9, shrink.num_partials, "bfloat16", "bfloat16",
                                     configs.expand_config(100, 4096, rank, 3, 8, deterministic=True),
                                     add_inputs=True, bias_flags=(False,) * 3, has_ranks=False, pdl=True,
                                     deterministic=True)
        for label, kernel, plan, f32 in (("shrink", kernels.lora_shrink_kernel, shrink, ("out_ptr",)),
                                         ("expand", kernels.lora_expand_kernel, expand, ("buf_ptr",))):
            names = kernel.arg_names
            mma = []
            for attrs in ({}, {(names.index("num_tokens"),): [["tt.divisibility", 16]]}):
                src = ASTSource(kernel, _signature(kernel, plan, "bf16", f32),
                                constexprs={(names.index(k),): v for k, v in plan.constexprs.items()}, attrs=attrs)
                compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                                          options=dict(num_warps=plan.num_warps, num_stages=plan.num_stages))
                mma.append(_mma_lines(compiled.asm["ptx"]))
            ok = bool(mma[0]) and mma[0] == mma[1]
            print(f"deterministic {label} r{rank} ({len(mma[0])} mma): {'ok' if ok else 'DIFFERENT'}", flush=True)
            failed += not ok
    return failed


def _dot_starts(ttgir: str) -> list:
    """Where the accumulator chain of each tt.dot of a TTGIR module starts, in order: "y" (a value
    loaded from memory: the output tile y, which Triton folds into the dot as `dot(a, b, 0) + y` ->
    `dot(a, b, y)`), "0" (a zero constant) or the defining op. Followed back through layout
    conversions, float extensions and loop-carried values (to their initial value)."""
    defs = {}
    for line in ttgir.splitlines():
        m = re.match(r"\s*(%[\w.]+)(?::\d+)? = (\S+) (.*)", line)
        if m:
            defs[m.group(1)] = (m.group(2), m.group(3))
        for args in re.findall(r"iter_args\(([^)]*)\)", line):
            for pair in args.split(", "):
                name, _, init = pair.partition(" = ")
                defs[name.strip()] = ("iter_arg", init.strip())
    starts = []
    for line in ttgir.splitlines():
        m = re.search(r"= tt\.dot (%[\w.]+), (%[\w.]+), (%[\w.]+)", line)
        if not m:
            continue
        value = m.group(3)
        while value in defs and defs[value][0] in ("iter_arg", "ttg.convert_layout", "arith.extf"):
            value = defs[value][1].split()[0].rstrip(",")
        op, rest = defs.get(value, ("?", ""))
        starts.append("y" if op == "tt.load" else "0" if op == "arith.constant" and "dense<0.0" in rest else op)
    return starts


def compare_pair_order() -> int:
    """Child process: a token with one adapter adds up its expand in the same order in a paired step
    (the PAIRS kernels) as in a plain one, for the deterministic launches: the same tensor-core
    instructions, and every dot's accumulator chain starting where the pair-free kernel's does -- from
    y for 16-bit weights and one rank block (Triton folds the pair-free `dot(lhs, B, 0) + y`), from 0
    with rank blocks in a loop (y added last) -- bfloat16 (tensor cores) and float32 (FMA chains)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    import lora_core.kernels as kernels
    from lora_core.kernels import configs
    failed = 0
    for dtype, act, rank, start in (("bfloat16", "bf16", 16, "y"), ("bfloat16", "bf16", 64, "y"),
                                    ("bfloat16", "bf16", 128, "0"), ("float32", "fp32", 16, "y")):
        found = []
        for pairs in (0, 1):
            plan = kernels.plan_expand(100, rank, (4096,), 9, 2, dtype, dtype,
                                       configs.expand_config(100, 4096, rank, 1, 8, deterministic=True),
                                       add_inputs=True, bias_flags=(False,), has_ranks=False, pdl=True,
                                       deterministic=True, pairs=pairs)
            kernel, names = kernels.lora_expand_kernel, kernels.lora_expand_kernel.arg_names
            src = ASTSource(kernel, _signature(kernel, plan, act, ("buf_ptr",)),
                            constexprs={(names.index(k),): v for k, v in plan.constexprs.items()})
            compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                                      options=dict(num_warps=plan.num_warps, num_stages=plan.num_stages))
            found.append((_mma_lines(compiled.asm["ptx"]), sorted(set(_dot_starts(compiled.asm["ttgir"])))))
        ok = found[0] == found[1] and found[0][1] == [start]
        print(f"pair order {dtype} r{rank} (starts plain {found[0][1]}, paired {found[1][1]}; {len(found[0][0])} mma): "
              f"{'ok' if ok else 'DIFFERENT'}", flush=True)
        failed += not ok
    return failed


@pytest.mark.parametrize("kernel_name", ["shrink", "expand", "fused", "deterministic", "pair-order", "moe", "fp8",
                                         "moe-fp8"])
def test_kernel_compiles_for_sm90(kernel_name):
    triton = pytest.importorskip("triton")
    try:
        import triton.backends.nvidia.compiler
    except ImportError:  # pragma: no cover - depends on the Triton build
        pytest.skip(f"Triton {triton.__version__} has no CUDA backend")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run([sys.executable, os.path.abspath(__file__), kernel_name], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0 and "FAILED" not in proc.stdout, proc.stdout + proc.stderr[-3000:]
    assert proc.stdout.count(": ok") == len(proc.stdout.strip().splitlines())


def test_compile_launches_tool_specialises_like_a_launch():
    """benchmarks/compile_launches.py (the sweep's launches compiled for sm_90 under any Triton, with
    a real launch's specialisations) on one decode case: every launch of every epilogue mode compiles."""
    triton = pytest.importorskip("triton")
    try:
        import triton.backends.nvidia.compiler
    except ImportError:  # pragma: no cover
        pytest.skip(f"Triton {triton.__version__} has no CUDA backend")
    pytest.importorskip("torch")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "compile_launches.py"), "--cases",
                           "dec T8 D8 r16", "--modes", "0,1,2"], env=env, cwd=ROOT, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = [ln for ln in proc.stdout.splitlines() if " mode " in ln]
    assert len(lines) >= 4 and all(ln.endswith(": ok") for ln in lines), proc.stdout
    assert "; 0 failed" in proc.stdout



def test_importing_compile_launches_keeps_the_interpreter_setting(monkeypatch):
    """benchmarks/compile_launches.py turns Triton's interpreter off only when run as a script: a
    test that imports it (tests/test_warmup.py) must leave its worker's TRITON_INTERPRET alone, or
    every later interpreted test in that worker plans compiled launches for interpreted kernels."""
    import importlib
    pytest.importorskip("torch")
    monkeypatch.syspath_prepend(os.path.join(ROOT, "benchmarks"))
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    import compile_launches
    importlib.reload(compile_launches)                 # runs the module's top level again
    assert os.environ.get("TRITON_INTERPRET") == "1"

if __name__ == "__main__":
    MODES = {"deterministic": compare_deterministic, "pair-order": compare_pair_order}
    sys.exit(min(1, MODES[sys.argv[1]]() if sys.argv[1] in MODES else compile_all(sys.argv[1])))
