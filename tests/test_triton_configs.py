"""The launch configs (lora_core/kernels/configs.py + tuned/<device>.json): shape classes, the
slot-count variants, the fused/two-kernel choice, the table per device. Plain Python: no GPU, no kernels run."""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import sys

import pytest

from lora_core.kernels import configs

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


H200 = "NVIDIA H200"


@pytest.fixture
def compiled(monkeypatch):
    """configs as on an H200 (the interpreter's large-tile configs switched off, its tuned table)."""
    monkeypatch.setattr(configs, "interpreting", lambda: False)
    monkeypatch.setattr(configs, "device_name", lambda: H200)


def _with_variants(monkeypatch, variants, fused_classes=None):
    """The H200 table with other variants (and fused classes) as the table of the GPU present."""
    base = configs.table(H200)
    fused = base.fused_classes if fused_classes is None else frozenset(fused_classes)
    changed = dataclasses.replace(base, variants={**base.variants, **variants}, fused_classes=fused)
    monkeypatch.setattr(configs, "current_table", lambda: changed)
    return changed


def test_committed_table_loads_with_its_variants(compiled):
    h200 = configs.table(H200)
    assert h200.source.startswith("NVIDIA H200") and configs.current_table() is h200
    for key, variants in h200.variants.items():
        assert key in h200.shrink, key
        for max_slots, min_slices, overrides in variants:
            assert max_slots >= 1 and min_slices >= 1, (key, max_slots, min_slices)
            assert set(overrides) <= {"shrink", "expand", "fused", "use_fused"}, (key, overrides)
    # t1024/r64 up to 16 slots: 16 x 256 one-tile expands for one slice, 64-token tiles for 2+
    # slices; the class entry beyond 16 slots
    few = configs.expand_config(512, 4096, 64, 1, 16)
    few3 = configs.expand_config(512, 4096, 64, 3, 16)
    many = configs.expand_config(512, 4096, 64, 1, 17)
    assert (few["BLOCK_M"], few["BLOCK_N"]) == (16, 256) and few3["BLOCK_M"] == 64
    assert many == h200.expand[("t1024", "r64")]
    assert configs.shrink_config(512, 4096, 64, 1, 8)["BLOCK_M"] == 32
    assert configs.shrink_config(512, 4096, 64, 1, 64)["BLOCK_M"] == h200.shrink[("t1024", "r64")]["BLOCK_M"]
    # the fused kernel only for one slice at rank 16, 16 < T <= 64, <= 16 slots: never
    # at T <= 16 (shrink + expand: a 3-stage shrink for one slice, 2 stages for more), with 2+
    # slices, more slots, rank 64 or past T = 64
    assert configs.use_fused(32, 16, 1, 8) and configs.use_fused(64, 16, 1, 16)
    assert not configs.use_fused(32, 16, 3, 16) and not configs.use_fused(32, 16, 1, 32)
    assert not any(configs.use_fused(t, 16, s, 8) for t in (1, 8, 16) for s in (1, 3))
    assert configs.shrink_config(8, 4096, 16, 1, 8)["num_stages"] == 3
    assert configs.shrink_config(8, 4096, 16, 3, 8)["num_stages"] == 2
    assert configs.shrink_config(8, 4096, 16, 1, 8)["PREFETCH"]
    # 17-64 tokens (t64), tuned with the shrink a plain launch: the rank-16 shrink takes the
    # whole-batch tile (SMALL_T) for every slice and slot count, the expand never; rank 64 one
    # slice with few slots (a variant) keeps 16-token sorted tiles
    for r, s, slots in ((16, 1, 8), (16, 3, 8), (16, 1, 32), (64, 3, 8), (64, 1, 32)):
        assert configs.shrink_config(32, 4096, r, s, slots)["SMALL_T"] is True, (r, s, slots)
    for r, s, slots in ((16, 1, 8), (16, 3, 8), (16, 1, 32), (64, 1, 8), (64, 3, 8), (64, 1, 32)):
        assert configs.expand_config(32, 4096, r, s, slots)["SMALL_T"] is False
    assert configs.shrink_config(32, 4096, 64, 1, 8)["SMALL_T"] is False
    assert configs.fused_config(32, 4096, 4096, 16, 1, 8)["SMALL_T"] is False
    assert "SMALL_T" not in configs.shrink_config(8, 4096, 16, 1, 8)
    assert not configs.use_fused(32, 64, 1, 8) and not configs.use_fused(128, 16, 1, 8)


def test_variants_apply_by_slot_count_first_match_wins(compiled, monkeypatch):
    key = ("t256", "r16")
    small = configs.shrink_params(16, 64, 2, 4, 2)
    mid = configs.expand_params(32, 64, 16, 4, 2)
    table = _with_variants(monkeypatch, {key: [(4, 1, {"shrink": small, "use_fused": True}),
                                               (8, 1, {"expand": mid, "use_fused": False})]}, {key})
    assert configs.shrink_config(100, 4096, 16, 1, 4)["BLOCK_K"] == 64
    assert configs.shrink_config(100, 4096, 16, 1, 5)["BLOCK_K"] == table.shrink[key]["BLOCK_K"] != 64
    assert configs.expand_config(100, 4096, 16, 1, 4) == table.expand[key]     # first match: no expand
    assert configs.expand_config(100, 4096, 16, 1, 8) == mid
    assert configs.use_fused(100, 16, 1, 4) and not configs.use_fused(100, 16, 1, 8)
    assert configs.use_fused(100, 16, 1, 9)                                # the class says fused


def test_variants_by_slice_count(compiled, monkeypatch):
    key = ("tbig", "r64")
    three = configs.expand_params(64, 128, 64, 4, 2)
    table = _with_variants(monkeypatch, {key: [(16, 3, {"expand": three}), (configs.ANY_SLOTS, 2,
                                                                            {"use_fused": False})]})
    assert configs.expand_config(8192, 4096, 64, 3, 16) == three
    assert configs.expand_config(8192, 4096, 64, 3, 17) == table.expand[key]     # too many slots
    assert configs.expand_config(8192, 4096, 64, 2, 8) == table.expand[key]      # too few slices
    assert configs.expand_config(8192, 4096, 64, 1, 8) == table.expand[key]


def test_forced_fused_switch_beats_the_variants(compiled, monkeypatch):
    _with_variants(monkeypatch, {("t64", "r16"): [(64, 1, {"use_fused": False})]})
    assert not configs.use_fused(32, 16, 1, 8)
    with configs.override_policy(dataclasses.replace(configs.launch_policy(), force_fused=True)):
        assert configs.use_fused(32, 16, 1, 8)
        assert not configs.use_fused(32, 128, 1, 8)                       # rank > 64: never


def test_tuner_keeps_the_variants_it_does_not_measure():
    pytest.importorskip("torch")
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    try:
        from tune_triton import kept_variants
    finally:
        sys.path.pop(0)
    old = dict(shrink={}, expand={}, two_kernel_us=1.0, variants=[dict(max_slots=8, expand={})])
    new = dict(shrink={"BLOCK_M": 16}, expand={}, two_kernel_us=0.5)
    assert kept_variants(old, new)["variants"] == old["variants"]
    assert kept_variants({}, new) == new
    assert kept_variants(old, {**new, "variants": []})["variants"] == []
    assert kept_variants({**old, "use_fused": False}, new)["use_fused"] is False
    assert "use_fused" not in kept_variants({"use_fused": False}, new)       # no variants: measured anew


def test_tuner_without_fused_keeps_the_fused_side():
    """tune_triton --no-fused re-tunes a class's shrink and expand only: the class keeps the fused
    config and the use_fused decision the table file has (it stores no timings to decide from)."""
    pytest.importorskip("torch")
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    try:
        from tune_triton import kept_fused, kept_variants, table_entry
    finally:
        sys.path.pop(0)
    fused = configs.fused_params(16, 256, 512, 4, 2, 0)
    new = dict(shrink={"BLOCK_M": 16, "BLOCK_K": 256}, expand={"BLOCK_M": 16, "BLOCK_N": 128}, two_kernel_us=5.0)
    for use in (True, False):
        old = dict(shrink={"BLOCK_M": 16, "BLOCK_K": 64}, expand={"BLOCK_M": 16, "BLOCK_N": 64}, fused=fused,
                   use_fused=use)                                   # a table file's entry: no timings
        got = table_entry(kept_variants(old, kept_fused(old, new)))
        assert got == dict(shrink=new["shrink"], expand=new["expand"], fused=fused, use_fused=use)
        variants = [dict(max_slots=16, use_fused=not use)]
        got = table_entry(kept_variants({**old, "variants": variants}, kept_fused({**old, "variants": variants}, new)))
        assert got["fused"] == fused and got["use_fused"] is use and got["variants"] == variants
    # a class the table never gave a fused config or decision: still none, and two kernels
    assert table_entry(kept_fused(dict(shrink={}, expand={}), new)) == dict(shrink=new["shrink"],
                                                                           expand=new["expand"], use_fused=False)
    # an old fused timing is weighed against the new two-kernel time
    timed = dict(fused=fused, fused_us=4.0, use_fused=False)
    assert table_entry(kept_fused(timed, new))["use_fused"] is True
    assert table_entry(kept_fused(timed, {**new, "two_kernel_us": 3.0}))["use_fused"] is False
    assert "fused" not in new and "use_fused" not in new                # the entry itself untouched


def test_a_config_target_sets_the_split_rule(compiled):
    """SPLIT_K = 0 aims at TARGET programs (a config key, consumed) or the policy's target_programs."""
    base = configs.shrink_params(16, 256, 0, 8, 3)
    # T=32, 32 slots, one slice: 32 busy tiles; hidden 4096 = 16 chunks of 256
    assert configs.resolve_split(dict(base), 32, 4096, 64, 1, 32)["SPLIT_K"] == min(
        16, configs.launch_policy().target_programs // 32, configs.launch_policy().split_cap)
    got = configs.resolve_split(dict(base, TARGET=128), 32, 4096, 64, 1, 32)
    assert got["SPLIT_K"] == 4 and "TARGET" not in got
    assert configs.resolve_split(dict(base, TARGET=128), 32, 4096, 64, 3, 32)["SPLIT_K"] == 1


def test_explore_configs_cases_and_modes():
    """benchmarks/explore_configs.py: case strings (optional slot count) and a mode's SPLIT_K = 0
    resolved as the table's would be (TARGET consumed)."""
    pytest.importorskip("torch")
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    try:
        from explore_configs import parse_cases, resolved
    finally:
        sys.path.pop(0)
    assert parse_cases("dec:32:8:16:s1,pre:2048:16:64:s3:32,pre:2048:4:64:s1:het,dec:8:8:16:s1:16:het") == [
        ("dec", 32, 8, 16, "s1", 8, None), ("pre", 2048, 16, 64, "s3", 32, None),
        ("pre", 2048, 4, 64, "s1", 8, (8, 16, 32, 64)), ("dec", 8, 8, 16, "s1", 16, (8, 16, 16, 16))]
    assert parse_cases("dec:1:1:16:s1")[0][-2] == 8                        # max(8, D) as bench_triton
    mode = dict(label="x", fused=False, shrink_config=dict(configs.shrink_params(16, 512, 0, 8, 3), TARGET=132))
    got = resolved(mode, 32, 64, 1, 32)
    assert got["shrink_config"]["SPLIT_K"] == 4 and "TARGET" not in got["shrink_config"]
    assert got["fused"] is False and got["expand_config"] is None and got["fused_config"] is None
    assert mode["shrink_config"]["TARGET"] == 132                           # the mode itself untouched


def test_tuner_candidates_all_plan(compiled):
    """Every candidate the tuner times is a launch the planners accept (block rules, TILES_N,
    prefetch flags, TARGET) at its class's representative shape, one and three slices."""
    pytest.importorskip("torch")
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    try:
        import tune_triton
    finally:
        sys.path.pop(0)
    import lora_core.kernels as kernels
    for (tc, rc), (_kind, T, ds) in tune_triton.SHAPES.items():
        r = tune_triton.RANK_OF[rc]
        for widths in ((4096,), tune_triton.WIDTHS):
            for c in tune_triton.shrink_candidates(tc):
                cfg = configs.resolve_split(tune_triton.class_keys(tc, c), T, 4096, r, len(widths), max(8, max(ds)))
                plan = kernels.plan_shrink(T, 4096, r, len(widths), 9, "bfloat16", "bfloat16", cfg, lora_only=True,
                                     workspace=True, has_ranks=False, pdl=True)
                assert plan.grid[1] >= 1
            for c in tune_triton.expand_candidates(tc, r):
                plan = kernels.plan_expand(T, r, widths, 9, 2, "bfloat16", "bfloat16", tune_triton.class_keys(tc, c),
                                           add_inputs=True,
                                     bias_flags=(False,) * len(widths), has_ranks=False, pdl=True)
                assert plan.grid[0] * plan.constexprs["TILES_N"] == plan.constexprs["NUM_TILES"]


def test_a_gpu_without_a_table_gets_the_generic_defaults(monkeypatch, caplog):
    monkeypatch.setattr(configs, "interpreting", lambda: False)
    configs.table.cache_clear()
    try:
        with caplog.at_level("INFO", logger="lora_core"):
            unknown = configs.table("NVIDIA Imaginary 9000")
        assert unknown is configs.GENERIC and "generic defaults" in caplog.text
        assert "NVIDIA_Imaginary_9000.json" in caplog.text
        monkeypatch.setattr(configs, "device_name", lambda: "NVIDIA Imaginary 9000")
        assert configs.shrink_config(8, 4096, 16, 1, 8)["num_warps"] == configs.GENERIC_SHRINK[("t16",
                                                                                                "r16")]["num_warps"]
        assert not configs.use_fused(32, 16, 1, 8)
        assert configs.table(None) is configs.GENERIC
    finally:
        configs.table.cache_clear()


def test_every_tuned_table_is_data_only():
    """One JSON per device: classes of configs and decisions, no tuning history."""
    files = [f for f in os.listdir(configs.TUNED_DIR)
             if f.endswith(".json") and not f.endswith(("_moe.json", "_fused_linear.json"))]
    assert "NVIDIA_H200.json" in files
    for name in files:
        with open(os.path.join(configs.TUNED_DIR, name)) as f:
            data = json.load(f)
        assert {"device", "format", "classes"} <= set(data) <= {"device", "format", "classes", "deterministic",
                                                                 "policy"}, name
        for rank_name, kinds in data.get("deterministic", {}).items():
            assert rank_name in ("r16", "r64", "r256") and set(kinds) <= {"shrink", "expand"}, (name, rank_name)
        for key, entry in data["classes"].items():
            assert set(entry) <= {"shrink", "expand", "fused", "use_fused", "variants"}, (name, key)
            for variant in entry.get("variants", ()):
                assert set(variant) <= {"max_slots", "min_slices", "shrink", "expand", "fused", "use_fused"}
        assert configs._table_file(data["device"]).endswith(name)


def test_every_tuned_fused_linear_table_reads_and_holds_decisions():
    """The fused linear tables (`<device>_fused_linear.json`, lora_core/kernels/fused_linear_configs.py):
    each passes the reader's checks, names the device whose file it is, and every entry holds a
    config and a decision (its timings and reason are the decision's record)."""
    from lora_core.kernels import fused_linear_configs as flc
    for name in [f for f in os.listdir(configs.TUNED_DIR) if f.endswith("_fused_linear.json")]:
        path = os.path.join(configs.TUNED_DIR, name)
        entries = flc.read_fused_linear_table(path)
        with open(path) as f:
            data = json.load(f)
        assert name == data["device"].replace(" ", "_") + "_fused_linear.json", name
        assert entries and all({"config", "use_fused"} <= set(e) for e in entries.values()), name


def test_every_tuned_moe_table_is_data_only():
    """The MoE kernel's tables (`<device>_moe.json`, lora_core/kernels/moe_configs.py): buckets of
    checked configs, no tuning history (benchmarks/tune_moe_lora.py keeps that in its log)."""
    from lora_core.kernels import moe_configs
    for name in [f for f in os.listdir(configs.TUNED_DIR) if f.endswith("_moe.json")]:
        path = os.path.join(configs.TUNED_DIR, name)
        with open(path) as f:
            data = json.load(f)
        assert set(data) == {"device", "format", "buckets"}, name
        assert moe_configs.read_table(path) == data["buckets"]
        assert moe_configs.table_file(data["device"]).endswith(name)


TOKEN_COUNTS = (1, 2, 7, 16, 17, 31, 32, 33, 64, 100, 256, 1000, 1024, 4096, 8192)


def _launches(T, rank, slices, slots, deterministic):
    """The launch parameters (everything but the grid) of add_lora_linear's two kernels and of
    the stand-alone shrink for T tokens, as the Triton backends plan them."""
    import lora_core.kernels as kernels
    widths = (4096,) + (1024,) * (slices - 1)
    out = []
    for workspace in (True, False):
        cfg = configs.shrink_config(T, 4096, rank, slices, slots, deterministic=deterministic)
        s = kernels.plan_shrink(T, 4096, rank, slices, slots + 1, "bfloat16", "bfloat16", cfg, lora_only=workspace,
                                workspace=workspace, has_ranks=False, pdl=True, deterministic=deterministic)
        out.append((tuple(sorted(s.constexprs.items())), s.num_warps, s.num_stages, s.num_partials, s.atomic))
    cfg = configs.expand_config(T, max(widths), rank, slices, slots, deterministic=deterministic)
    e = kernels.plan_expand(T, rank, widths, slots + 1, out[0][3], "bfloat16", "bfloat16", cfg, add_inputs=True,
                            bias_flags=(False,) * slices, has_ranks=False, pdl=True, deterministic=deterministic)
    out.append((tuple(sorted(e.constexprs.items())), e.num_warps, e.num_stages))
    out.append(configs.use_fused(T, rank, slices, slots, deterministic=deterministic))
    return tuple(out)


@pytest.mark.parametrize("rank,slices,slots", [(8, 1, 8), (16, 1, 8), (16, 3, 64), (64, 1, 16), (64, 3, 8),
                                               (128, 1, 8)])
def test_deterministic_launches_do_not_depend_on_the_token_count(compiled, rank, slices, slots):
    """deterministic=True (H200 table): for any T, the same kernels with the same meta-parameters
    (block shapes, SPLIT_K, SMALL_T off, warps), shrink + expand, no atomic adds; only the grid
    changes. Without it the H200 launches change with T (split-K, tiles, the fused kernel)."""
    launches = {_launches(T, rank, slices, slots, True) for T in TOKEN_COUNTS}
    assert len(launches) == 1
    (ws, _, _, planes, atomic), (alone, _, _, alone_planes, alone_atomic), (expand, _, _), fused = launches.pop()
    assert not fused and not atomic and not alone_atomic and alone_planes == 1
    assert dict(ws)["SMALL_T"] is False and dict(alone)["SMALL_T"] is False and dict(expand)["SMALL_T"] is False
    assert dict(expand)["NUM_PARTIALS"] == planes
    assert len({_launches(T, rank, slices, slots, False) for T in TOKEN_COUNTS}) > 1


def test_deterministic_configs_come_from_the_table(compiled, monkeypatch, tmp_path):
    """A table's "deterministic" entries replace the generic ones per rank class and kind;
    SMALL_T is always off."""
    monkeypatch.setattr(configs, "TUNED_DIR", str(tmp_path))
    data = {"device": "NVIDIA Test 1", "format": 1, "classes": {},
            "deterministic": {"r64": {"shrink": configs.shrink_params(32, 64, 3, 8, 2)}}}
    (tmp_path / "NVIDIA_Test_1.json").write_text(json.dumps(data))
    configs.table.cache_clear()
    try:
        monkeypatch.setattr(configs, "device_name", lambda: "NVIDIA Test 1")
        got = configs.shrink_config(5, 4096, 64, 1, 8, deterministic=True)
        assert got == dict(configs.shrink_params(32, 64, 3, 8, 2), SMALL_T=False)
        assert configs.expand_config(5, 4096, 64, 1, 8, deterministic=True) == \
            configs.GENERIC_DETERMINISTIC["r64"]["expand"]
        assert configs.shrink_config(5, 4096, 16, 1, 8, deterministic=True) == \
            configs.GENERIC_DETERMINISTIC["r16"]["shrink"]
    finally:
        configs.table.cache_clear()
    with pytest.raises(ValueError, match="kind must be 'shrink' or 'expand', got 'fused'"):
        configs.deterministic_config("fused", 4096, 16)


def test_pdl_switch_per_kernel(compiled, monkeypatch):
    """LORA_CORE_PDL: unset/auto the expand always and a call's first kernel only for one-token
    calls, 1 every kernel, 0 none, a list names the kernels; kernels stay compiled with USE_PDL
    while any may use it (the setting changes launches, not the kernels' code)."""
    from lora_core.kernels import plan_expand, plan_fused, plan_shrink
    from lora_core.kernels.planning import pdl_allowed
    FIRST_KERNEL_PDL_MAX_TOKENS = configs.launch_policy().first_kernel_pdl_max_tokens

    def plans(T):
        cfg_s = configs.shrink_config(T, 4096, 16, 1, 8)
        s = plan_shrink(T, 4096, 16, 1, 9, "bfloat16", "bfloat16", cfg_s, lora_only=True, workspace=True,
                        has_ranks=False, pdl=pdl_allowed())
        cfg_e = configs.expand_config(T, 4096, 16, 1, 8)
        e = plan_expand(T, 16, (4096,), 9, s.num_partials, "bfloat16", "bfloat16", cfg_e, add_inputs=True,
                        bias_flags=(0,), has_ranks=False, pdl=pdl_allowed())
        cfg_f = configs.fused_config(T, 4096, 4096, 16, 1, 8)
        f = plan_fused(T, 4096, 16, (4096,), 9, "bfloat16", "bfloat16", cfg_f, add_inputs=True, bias_flags=(0,),
                       has_ranks=False, pdl=pdl_allowed())
        return s, e, f

    one, many = FIRST_KERNEL_PDL_MAX_TOKENS, FIRST_KERNEL_PDL_MAX_TOKENS + 31
    for value, T, want in ((None, one, (True, True, True)), (None, many, (False, True, False)),
                           ("auto", many, (False, True, False)), ("1", many, (True, True, True)),
                           ("0", one, (False, False, False)), ("expand", one, (False, True, False)),
                           ("shrink, expand", many, (True, True, False)), ("fused", many, (False, False, True))):
        if value is None:
            monkeypatch.delenv("LORA_CORE_PDL", raising=False)
        else:
            monkeypatch.setenv("LORA_CORE_PDL", value)
        got = plans(T)
        assert tuple(p.launch_pdl for p in got) == want, (value, T)
        assert all(p.constexprs["USE_PDL"] == (value != "0") for p in got), value
    monkeypatch.setenv("LORA_CORE_PDL", "expnad")
    with pytest.raises(ValueError, match="LORA_CORE_PDL"):
        pdl_allowed()


def test_pdl_first_kernel_where_the_launcher_spreads(compiled, monkeypatch):
    """auto: a launcher that spreads a dependent shrink's programs (torch's C launcher) sends a
    call's first kernel out as a dependent up to SPREAD_PDL_MAX_TOKENS tokens, others only at one
    token; `spreads` names the launches that get the spread shared memory (shrinks only); "1" and
    "0" do not depend on the launcher."""
    from lora_core.kernels import plan_expand, plan_fused, plan_shrink
    policy = configs.launch_policy()
    FIRST_KERNEL_PDL_MAX_TOKENS = policy.first_kernel_pdl_max_tokens
    SPREAD_PDL_MAX_TOKENS = policy.spread_pdl_max_tokens

    def plans(T):
        s = plan_shrink(T, 4096, 16, 1, 9, "bfloat16", "bfloat16", configs.shrink_config(T, 4096, 16, 1, 8),
                        lora_only=True, workspace=True, has_ranks=False, pdl=True)
        e = plan_expand(T, 16, (4096,), 9, s.num_partials, "bfloat16", "bfloat16",
                        configs.expand_config(T, 4096, 16, 1, 8), add_inputs=True, bias_flags=(0,), has_ranks=False,
                        pdl=True)
        f = plan_fused(T, 4096, 16, (4096,), 9, "bfloat16", "bfloat16", configs.fused_config(T, 4096, 4096, 16, 1, 8),
                       add_inputs=True, bias_flags=(0,), has_ranks=False, pdl=True)
        return s, e, f

    assert FIRST_KERNEL_PDL_MAX_TOKENS < SPREAD_PDL_MAX_TOKENS
    monkeypatch.delenv("LORA_CORE_PDL", raising=False)
    for T, spread, want in ((8, True, (True, True, True)), (SPREAD_PDL_MAX_TOKENS, True, (True, True, True)),
                            (SPREAD_PDL_MAX_TOKENS + 1, True, (False, True, False)), (8, False, (False, True, False)),
                            (FIRST_KERNEL_PDL_MAX_TOKENS, False, (True, True, True))):
        got = plans(T)
        assert tuple(p.pdl_for(spread) for p in got) == want, (T, spread)
        assert tuple(p.spreads() for p in got) == (FIRST_KERNEL_PDL_MAX_TOKENS < T <= SPREAD_PDL_MAX_TOKENS,
                                                   False, False), T
    for value, want in (("1", (True, True, True)), ("0", (False, False, False))):
        monkeypatch.setenv("LORA_CORE_PDL", value)
        for T in (8, 64):
            got = plans(T)
            assert tuple(p.pdl_for(True) for p in got) == tuple(p.pdl_for(False) for p in got) == want, (value, T)
        assert not any(p.spreads() for p in plans(64))


@pytest.mark.parametrize("num_sms,max_shared", [(132, 232448), (108, 166912), (20, 101376)])
def test_spread_shared_bytes_allows_ceil_programs_per_sm(num_sms, max_shared):
    """spread_shared_bytes: with the returned shared memory at most k = ceil(programs / SMs)
    blocks fit on an SM (by shared memory) and at least k do whenever it raised the request; it
    never lowers a request, never exceeds one block's maximum, and keeps the request when k per SM
    already follows from it."""
    from lora_core.kernels.planning import SHARED_RESERVED_PER_BLOCK, spread_shared_bytes
    per_sm = max_shared + SHARED_RESERVED_PER_BLOCK
    for programs in (1, 16, num_sms - 1, num_sms, num_sms + 1, 3 * num_sms, 10 * num_sms, 50 * num_sms):
        for shared in (0, 16384, 49152, 98304, max_shared):
            got = spread_shared_bytes(programs, shared, num_sms, max_shared)
            k = -(-programs // num_sms)
            assert shared <= got <= max(shared, max_shared), (programs, shared)
            fit = per_sm // (got + SHARED_RESERVED_PER_BLOCK)
            if got != shared:
                assert fit == k, (programs, shared, got)
            elif k <= 8:
                assert per_sm // (shared + SHARED_RESERVED_PER_BLOCK) <= k, (programs, shared)
    assert spread_shared_bytes(72, 32768, 132, 232448) == 115840         # the H200, a decode shrink: one per SM
    assert spread_shared_bytes(0, 32768, 132, 232448) == 32768
    assert spread_shared_bytes(72, 32768, 0, 232448) == 32768


def test_one_token_never_takes_the_fused_kernel(compiled, monkeypatch):
    """One token never takes the fused kernel (FUSED_MIN_TOKENS), even in a class whose table
    entry says the fused kernel wins; two tokens of that class do."""
    table = configs.table(H200)
    key = (configs.token_class(1), configs.rank_class(16))
    marked = dataclasses.replace(table, fused_classes=frozenset(table.fused_classes | {key}),
                                 variants=dict.fromkeys(table.variants, ()))
    monkeypatch.setattr(configs, "_table", lambda device: marked)
    assert configs.use_fused(2, 16, 1, 8)
    assert not configs.use_fused(1, 16, 1, 8)


def test_a_table_variant_is_read_through_lora_core_table(compiled, monkeypatch, tmp_path):
    """benchmarks/table_variant.py writes the H200 table with 128-column fused tiles taken for
    two classes (and their variants); LORA_CORE_TABLE makes every launch read it; a missing
    file is an error naming the variable."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
    import table_variant
    out = tmp_path / "narrow.json"
    cases = ((8, 1), (8, 3), (32, 1), (32, 3))
    before = {(T, S): configs.fused_config(T, 4096, 4096, 16, S, 8, device=H200) for T, S in cases}
    before_t128 = configs.fused_config(128, 4096, 4096, 16, 1, 8, device=H200)
    assert any(c["BLOCK_N"] != 128 for c in before.values())     # the edit changes something
    assert table_variant.main([str(out), "--classes", "t16/r16,t64/r16", "--fused",
                               '{"BLOCK_N": 128}', "--use-fused", "on"]) == 0
    base = json.loads(pathlib.Path(configs._table_file(H200)).read_text())["classes"]
    edited = json.loads(pathlib.Path(out).read_text())["classes"]
    assert {k: v for k, v in edited.items() if k not in ("t16/r16", "t64/r16")} == \
        {k: v for k, v in base.items() if k not in ("t16/r16", "t64/r16")}
    for name in ("t16/r16", "t64/r16"):
        assert edited[name]["shrink"] == base[name]["shrink"] and edited[name]["expand"] == base[name]["expand"]
    monkeypatch.setenv("LORA_CORE_TABLE", str(out))
    configs.table.cache_clear()
    try:
        assert "narrow.json" in configs.current_table().source
        for T, S in cases:
            cfg = configs.fused_config(T, 4096, 4096, 16, S, 8)
            assert cfg == {**before[T, S], "BLOCK_N": 128}, (T, S)      # exactly the edit
            assert configs.use_fused(T, 16, S, 8), (T, S)
        assert not configs.use_fused(1, 16, 1, 8)                  # one token: never fused
        assert configs.fused_config(128, 4096, 4096, 16, 1, 8) == before_t128   # a class not edited
        monkeypatch.setenv("LORA_CORE_TABLE", str(tmp_path / "missing.json"))
        configs.table.cache_clear()
        with pytest.raises(FileNotFoundError, match="LORA_CORE_TABLE"):
            configs.current_table()
        good = {"BLOCK_M": 16, "BLOCK_K": 64, "BLOCK_N": 64}
        for bad in ("{not json", '{"device": "x"}', '{"classes": {"t16/r16": {"expand": {}}}}', "[1, 2]",
                    json.dumps({"classes": {"t16/r16": {"shrink": good, "expand": dict(good, BLOCK_N=48)}}}),
                    json.dumps({"classes": {"t16/r16": {"shrink": good, "expand": good,
                                                        "variants": [{"fused": {"BLOCK_M": 16}}]}}})):
            (tmp_path / "bad.json").write_text(bad)
            monkeypatch.setenv("LORA_CORE_TABLE", str(tmp_path / "bad.json"))
            configs.table.cache_clear()
            with pytest.raises(ValueError, match="LORA_CORE_TABLE=.*is not a launch table"):
                configs.current_table()
    finally:
        monkeypatch.delenv("LORA_CORE_TABLE")
        configs.table.cache_clear()
    with pytest.raises(ValueError, match="not in the table"):
        table_variant.main([str(out), "--classes", "t7/r16", "--fused", "{}"])
