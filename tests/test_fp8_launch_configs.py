"""fp8 (e4m3) launch configs and the e4m3 -> 16-bit operand conversion (CPU; docs/contract.md section 11).

fp8 launches look their configs up with the weights' dtype (`configs.shrink_config(...,
w_dtype=...)` and the expand's and fused kernel's): a table class's "fp8" object (its variants,
then its configs) where it has one, else the 16-bit config with the tile doubled along the
weight's contiguous axis (`configs.fp8_scaled`). Checked: the rule (doubling, caps, TILES_N), the
lookup order on a table read from a file, the file checks, the interpreter's configs (fp8 and bf16
differ at hidden / width 512), and `linear` with those differing configs against the float64
oracle. The bit moves that turn an e4m3 tile into a bf16 / fp16 dot operand in compiled kernels
(`common.E4M3_TO_BF16_ASM`, inline PTX the interpreter cannot run) are replayed in numpy from the
constants in the PTX text, for all 256 codes (the compiled conversion itself:
tests/test_gpu_fp8.py::test_e4m3_operand_conversion_is_exact).
"""

from __future__ import annotations

import json
import re
from unittest import mock

import ml_dtypes
import numpy as np
import pytest
import torch

from lora_core.kernels import common, configs
from torch_lora.meta import LoRAKernelMeta
from torch_lora.ops import triton as tri

from . import oracle

FP8 = "float8_e4m3fn"


# ----------------------------------------------------------------------------- the rule

def test_fp8_scaled_doubles_the_contiguous_tile_and_the_warps():
    s = configs.shrink_params(16, 128, 0, 4, 3)
    assert configs.fp8_scaled("shrink", s) == {**s, "BLOCK_K": 256, "num_warps": 8}
    assert configs.fp8_scaled("shrink", s, size=200)["BLOCK_K"] == 256      # next_pow2(200) = 256
    assert configs.fp8_scaled("shrink", s, size=100) == s                    # capped at next_pow2(100): kept
    assert configs.fp8_scaled("shrink", configs.shrink_params(16, 256, 0, 8, 3))["BLOCK_K"] == 256  # 8 warps: kept
    assert configs.fp8_scaled("shrink", configs.shrink_params(16, 512, 0, 2, 3))["BLOCK_K"] == configs.FP8_MAX_BLOCK
    e = dict(configs.expand_params(16, 128, 64, 4, 3), TILES_N=4)
    assert configs.fp8_scaled("expand", e) == {**e, "BLOCK_N": 256, "TILES_N": 2, "num_warps": 8}  # same columns
    assert configs.fp8_scaled("expand", configs.expand_params(16, 128, 16, 2, 2))["num_warps"] == 4
    f = configs.fused_params(16, 256, 128, 4, 2)
    assert configs.fp8_scaled("fused", f) == {**f, "BLOCK_K": 256, "num_warps": 8}
    assert s == configs.shrink_params(16, 128, 0, 4, 3)                      # a copy, the input unchanged
    with pytest.raises(ValueError, match="kind must be"):
        configs.fp8_scaled("gemm", s)


# ----------------------------------------------------------------------------- the table lookup

def _table(tmp_path, fp8_entry=None):
    shrink16 = dict(configs.shrink_params(16, 128, 0, 4, 3))
    expand16 = dict(configs.expand_params(16, 128, 16, 4, 2), TILES_N=2)
    classes = {"t256/r16": {"shrink": shrink16, "expand": expand16, "use_fused": False,
                            "variants": [{"max_slots": 16, "shrink": configs.shrink_params(16, 64, 0, 4, 2)}]},
               "t64/r16": {"shrink": shrink16, "expand": expand16, "use_fused": True,
                           "fused": configs.fused_params(16, 128, 128, 4, 2)}}
    if fp8_entry is not None:
        classes["t256/r16"]["fp8"] = fp8_entry
    path = tmp_path / "table.json"
    path.write_text(json.dumps({"device": "test", "format": 1, "classes": classes}))
    return configs._read_table(str(path), "test"), shrink16, expand16


def test_lookup_without_fp8_entries_takes_the_16bit_configs(tmp_path):
    """A GPU table without an "fp8" object gives fp8 launches the class's 16-bit configs as written
    (the doubling rule measured slower on the H200; it stays a tuner candidate)."""
    t, shrink16, expand16 = _table(tmp_path)
    assert t.config("shrink", 200, 16, 1, 64) == shrink16                           # 16-bit: as written
    assert t.config("shrink", 200, 16, 1, 64, FP8) == shrink16
    assert t.config("shrink", 200, 16, 1, 64, "bfloat16") == shrink16
    assert t.config("expand", 200, 16, 1, 64, FP8, 4096) == expand16
    assert t.config("shrink", 200, 16, 1, 8, FP8)["BLOCK_K"] == 64                  # the 16-bit variant
    assert t.config("fused", 40, 16, 1, 64, FP8)["BLOCK_K"] == 128
    assert t.fused_wins(40, 16, 64, 1, FP8) and not t.fused_wins(200, 16, 64, 1, FP8)


def test_the_rule_doubles_the_contiguous_tile_and_the_warps():
    shrink16 = dict(configs.shrink_params(16, 128, 0, 4, 3))
    expand16 = dict(configs.expand_params(16, 128, 16, 4, 2), TILES_N=2)
    assert configs.fp8_scaled("shrink", shrink16) == {**shrink16, "BLOCK_K": 256, "num_warps": 8}
    assert configs.fp8_scaled("expand", expand16, 4096) == {**expand16, "BLOCK_N": 256, "TILES_N": 1, "num_warps": 8}
    assert configs.fp8_scaled("shrink", shrink16, 128) == shrink16                  # capped by the hidden size


def test_lookup_prefers_the_fp8_entry(tmp_path):
    own = configs.shrink_params(32, 512, 2, 8, 4)
    var = configs.shrink_params(16, 1024, 0, 8, 2)
    t, shrink16, expand16 = _table(tmp_path, {"shrink": own, "use_fused": True,
                                              "variants": [{"max_slots": 8, "shrink": var, "use_fused": False}]})
    assert t.config("shrink", 200, 16, 1, 64, FP8) == own
    assert t.config("shrink", 200, 16, 1, 8, FP8) == var                # the fp8 variant first
    assert t.config("expand", 200, 16, 1, 64, FP8) == expand16          # a kind the entry lacks: 16-bit
    assert t.config("shrink", 200, 16, 1, 64) == shrink16               # 16-bit launches never see it
    assert t.config("shrink", 200, 16, 1, 8)["BLOCK_K"] == 64
    assert t.fused_wins(200, 16, 64, 1, FP8) and not t.fused_wins(200, 16, 8, 1, FP8)
    assert not t.fused_wins(200, 16, 64, 1)


@pytest.mark.parametrize("entry,match", [
    ([], r'"fp8" must be an object'),
    ({"shrink": {"BLOCK_M": 16, "BLOCK_K": 100}}, r"t256/r16 fp8: shrink BLOCK_K must be a power of two"),
    ({"variants": [{"expand": {"BLOCK_M": 16}}]}, r"fp8 variant: expand BLOCK_N must be a power of two"),
])
def test_bad_fp8_entries_are_refused(tmp_path, entry, match):
    with pytest.raises(ValueError, match=match):
        _table(tmp_path, entry)


def test_h200_table_fp8_lookups_are_valid_launches():
    """Every class of the shipped H200 table gives fp8 launches configs the plans accept."""
    from lora_core.kernels import plan_expand, plan_shrink
    t = configs.table("NVIDIA H200")
    for (tc, rc) in t.shrink:
        T = {"t16": 8, "t64": 32, "t256": 128, "t1024": 512, "t4096": 2048, "tbig": 8192}[tc]
        r = {"r16": 16, "r64": 64, "r256": 128}[rc]
        for slots, slices in ((8, 1), (64, 3)):
            s = t.config("shrink", T, r, slices, slots, FP8, 4096)
            e = t.config("expand", T, r, slices, slots, FP8, 4096)
            assert s["BLOCK_K"] >= t.config("shrink", T, r, slices, slots)["BLOCK_K"]
            assert s["num_warps"] <= configs.FP8_MAX_WARPS and e["num_warps"] <= configs.FP8_MAX_WARPS
            s = configs.resolve_split(s, T, 4096, r, slices, slots, device="NVIDIA H200")
            sp = plan_shrink(T, 4096, r, slices, slots + 1, "bfloat16", FP8, s, lora_only=True, workspace=True,
                             has_ranks=False)
            plan_expand(T, r, (4096,) * slices, slots + 1, sp.num_partials, FP8, "bfloat16", e, add_inputs=True,
                        bias_flags=(0,) * slices, has_ranks=False)


# ----------------------------------------------------------------------------- interpreter launches

@pytest.mark.skipif(not configs.interpreting(), reason="the interpreter's launch configs (TRITON_INTERPRET=1)")
def test_interpreter_configs_differ_for_fp8():
    assert configs.shrink_config(4, 512, 16, 1, 3)["BLOCK_K"] == 256
    assert configs.shrink_config(4, 512, 16, 1, 3, w_dtype=FP8)["BLOCK_K"] == 512
    assert configs.expand_config(4, 512, 16, 1, 3)["BLOCK_N"] == 256
    assert configs.expand_config(4, 512, 16, 1, 3, w_dtype=FP8)["BLOCK_N"] == 512
    assert configs.fused_config(4, 512, 512, 16, 1, 3, w_dtype=FP8)["BLOCK_K"] == 512


def _fp8(w):
    q, scale = oracle.fp8_quantize(w.numpy())
    return torch.from_numpy(q.view(np.uint8)).view(torch.float8_e4m3fn), torch.from_numpy(scale)


@pytest.mark.skipif(not configs.interpreting(), reason="the interpreter's launch configs (TRITON_INTERPRET=1)")
@pytest.mark.parametrize("fused", [False, True], ids=["two_kernels", "fused"])
def test_fp8_linear_with_its_own_configs_matches_float64(fused):
    """hidden 512 and slices of 512 / 256: the fp8 launches take BLOCK_K / BLOCK_N 512 where bf16
    launches take 256 (one hidden chunk instead of two, one output tile instead of two)."""
    T, H, R, widths, L = 5, 512, 16, (512, 256), 3
    g = torch.Generator().manual_seed(3)
    x = torch.randn(T, H, generator=g)
    qa = [_fp8(torch.randn(L, R, H, generator=g)) for _ in widths]
    qb = [_fp8(torch.randn(L, n, R, generator=g)) for n in widths]
    idx = np.array([2, 0, -1, 2, 1], dtype=np.int32)
    meta = LoRAKernelMeta.make(L, T, "cpu")
    meta.prepare_tensors(torch.from_numpy(idx))
    offsets = (0, 512)
    y = torch.randn(T, sum(widths), generator=g)
    want = y.double().numpy().copy()
    for s, ((a, sa), (b, sb), off) in enumerate(zip(qa, qb, offsets)):
        A = oracle.fp8_dequantize(a.view(torch.uint8).numpy().view(ml_dtypes.float8_e4m3fn), sa.numpy())
        B = oracle.fp8_dequantize(b.view(torch.uint8).numpy().view(ml_dtypes.float8_e4m3fn), sb.numpy())
        for t, slot in enumerate(idx):
            if slot >= 0:
                want[t, off:off + widths[s]] += (0.5 * x[t].double().numpy() @ A[slot].T) @ B[slot].T
    seen = []

    def spy(real, kind, key):
        def plan(*args, **kw):
            out = real(*args, **kw)
            seen.append((kind, out.constexprs[key]))
            return out
        return plan

    for fn in (tri._shrink_plan, tri._expand_plan, tri._fused_plan):
        fn.cache_clear()                                     # plans made afresh, through the spies below
    with mock.patch.object(tri, "plan_shrink", spy(tri.plan_shrink, "shrink", "BLOCK_K")), \
            mock.patch.object(tri, "plan_expand", spy(tri.plan_expand, "expand", "BLOCK_N")), \
            mock.patch.object(tri, "plan_fused", spy(tri.plan_fused, "fused", "BLOCK_K")):
        tri.linear(y, x, [a for a, _ in qa], [b for b, _ in qb], meta.meta_args(T), 0.5, offsets, fused=fused,
                   a_scales=tuple(s for _, s in qa), b_scales=tuple(s for _, s in qb))
    np.testing.assert_allclose(y.double().numpy(), want, rtol=1e-4, atol=1e-4)
    # the launches took the fp8 configs (a bf16 launch of these shapes: 256)
    assert seen and all(v == 512 for kind, v in seen if kind != "expand")
    assert fused or ("expand", 512) in seen


# ----------------------------------------------------------------------------- the operand conversion

def _replay(asm: str, pairs: np.ndarray, target) -> np.ndarray:
    """The bit moves of `asm` (E4M3_TO_BF16_ASM / _FP16_) in numpy, on a 32-bit register holding
    two codes (pairs (n, 2) uint8: the low lane's and the high lane's, as prmt 0x4140 / 0x4342
    spreads them); shl, and (sign mask), multiply-add (carry) in 32-bit arithmetic as the PTX does
    them, times the fma's multiplier -- every constant read from the PTX text. Returns (n, 2)."""
    assert re.search(r"prmt\.b32 lo, \$2, 0, 0x4140;", asm) and re.search(r"prmt\.b32 hi, \$2, 0, 0x4342;", asm)
    shift = int(re.search(r"shl\.b32 lo, lo, (\d+);", asm).group(1))
    sign = int(re.search(r"and\.b32 s, lo, (0x[0-9A-Fa-f]+);", asm).group(1), 16)
    carry = int(re.search(r"mad\.lo\.u32 lo, s, (\d+), lo;", asm).group(1))
    mul = int(re.search(r"mov\.b32 m, (0x[0-9A-Fa-f]+);", asm).group(1), 16)
    assert mul >> 16 == mul & 0xFFFF
    reg = pairs[:, 0].astype(np.uint64) | (pairs[:, 1].astype(np.uint64) << np.uint64(16))
    t = (reg << np.uint64(shift)) & np.uint64(0xFFFFFFFF)
    out = (t + (t & np.uint64(sign)) * np.uint64(carry)) & np.uint64(0xFFFFFFFF)
    lanes = np.stack([out & np.uint64(0xFFFF), out >> np.uint64(16)], axis=1).astype(np.uint16)
    factor = np.array([mul & 0xFFFF], np.uint16).view(target).astype(np.float64)[0]
    return lanes.view(target).astype(np.float64) * factor


@pytest.mark.parametrize("name,target", [("E4M3_TO_BF16_ASM", ml_dtypes.bfloat16), ("E4M3_TO_FP16_ASM", np.float16)])
def test_e4m3_bit_moves_are_exact(name, target):
    asm = getattr(common, name).value
    codes = np.arange(256, dtype=np.uint8)
    pairs = np.stack(np.meshgrid(codes, codes, indexing="ij"), axis=-1).reshape(-1, 2)   # every (low, high)
    want = pairs.view(ml_dtypes.float8_e4m3fn).astype(np.float64)
    finite = np.isfinite(want).all(axis=1)
    got = _replay(asm, pairs, target)
    assert finite.sum() == 254 * 254
    np.testing.assert_array_equal(got[finite], want[finite])        # normals, subnormals, +-0, both lanes
    assert np.all(np.isfinite(got))


# ----------------------------------------------------------------------------- the tuner's fp8 candidates

def test_tuner_fp8_candidates_start_with_the_lookup_and_all_plan():
    """benchmarks/tune_triton.py --lora-dtype fp8: each class's candidate list starts with the
    table's fp8 config (the baseline), repeats nothing, and every candidate is an fp8 launch the
    planners accept at the class's shape (one and three slices)."""
    import os
    import sys

    from lora_core.kernels import plan_expand, plan_shrink
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
    try:
        import tune_triton
    finally:
        sys.path.pop(0)
    t = configs.table("NVIDIA H200")
    for (tc, rc), (_kind, T, ds) in tune_triton.SHAPES.items():
        r, slots = tune_triton.RANK_OF[rc], max(8, ds[-1])
        base = t.config("shrink", T, r, 3, slots, FP8, 4096)
        cands = tune_triton.fp8_candidates("shrink", [tune_triton.class_keys(tc, c)
                                                      for c in tune_triton.shrink_candidates(tc)], base, 4096)
        assert cands[0] == base and all(c not in cands[:i] for i, c in enumerate(cands))
        e_cands = tune_triton.fp8_candidates("expand", [tune_triton.class_keys(tc, c)
                                                        for c in tune_triton.expand_candidates(tc, r)],
                                             t.config("expand", T, r, 3, slots, FP8, 4096), 4096)
        for widths in ((4096,), tune_triton.WIDTHS):
            for c in cands:
                cfg = configs.resolve_split(dict(c), T, 4096, r, len(widths), slots, device="NVIDIA H200")
                plan_shrink(T, 4096, r, len(widths), 9, "bfloat16", FP8, cfg, lora_only=True, workspace=True,
                            has_ranks=False, pdl=True)
            for c in e_cands:
                plan = plan_expand(T, r, widths, 9, 2, FP8, "bfloat16", c, add_inputs=True,
                                   bias_flags=(0,) * len(widths), has_ranks=False, pdl=True)
                assert plan.grid[0] * plan.constexprs["TILES_N"] == plan.constexprs["NUM_TILES"]
