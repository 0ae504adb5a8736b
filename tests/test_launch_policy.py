"""The launch policy (lora_core/kernels/policy.py, a table's "policy" key): the thresholds the
planners read per device, the generic defaults of a GPU without a table (target programs from its
SM count), the checks of a table's policy, and explicit overrides (`configs.override_policy`).
Plain Python: no GPU, no kernels run."""

from __future__ import annotations

import dataclasses
import json
import os
import sys

import pytest

from lora_core.kernels import configs, planning
from lora_core.kernels.policy import FALLBACK_TARGET_PROGRAMS, GENERIC_POLICY, PROGRAMS_PER_SM, LaunchPolicy

H200 = "NVIDIA H200"


@pytest.fixture
def compiled(monkeypatch):
    """configs as on a GPU (the interpreter's large-tile configs switched off)."""
    monkeypatch.setattr(configs, "interpreting", lambda: False)


@pytest.fixture
def table_dir(monkeypatch, tmp_path):
    """A directory of tuned tables in place of lora_core/kernels/tuned (the table cache cleared around)."""
    monkeypatch.setattr(configs, "TUNED_DIR", str(tmp_path))
    configs.table.cache_clear()
    yield tmp_path
    configs.table.cache_clear()


def _write(table_dir, device, policy):
    name = "_".join(device.split()) + ".json"
    (table_dir / name).write_text(json.dumps({"device": device, "format": 1, "classes": {}, "policy": policy}))


def test_the_h200_table_holds_its_policy():
    """The H200's thresholds live in its table; target_programs is two programs per SM of its 132."""
    got = configs.table(H200).policy
    assert got.target_programs == 264 == PROGRAMS_PER_SM * 132
    assert (got.split_cap, got.fused_min_tokens, got.small_t_max, got.prefetch_max_lines) == (8, 2, 32, 64)
    assert (got.first_kernel_pdl_max_tokens, got.spread_pdl_max_tokens) == (1, 32)
    assert (got.split_workspace_tokens, got.split_workspace_floats, got.unsplit_tokens, got.unsplit_rank) == (
        128, 256, 1024, 64)
    assert (got.prefetch_max_tokens, got.prefetch_low_rank, got.prefetch_low_rank_tokens) == (16, 16, (64, 256))
    assert got.force_fused is None and got.force_prefetch is None
    assert configs.GENERIC.policy is GENERIC_POLICY and GENERIC_POLICY.target_programs is None


def test_a_gpu_without_a_table_aims_at_two_programs_per_sm(compiled, monkeypatch):
    """Generic defaults: SPLIT_K = 0 aims at PROGRAMS_PER_SM x the SM count of the GPU present,
    FALLBACK_TARGET_PROGRAMS where the driver cannot say."""
    monkeypatch.setattr(configs, "device_name", lambda: "NVIDIA Imaginary 9000")
    monkeypatch.setattr(configs, "current_table", lambda: configs.GENERIC)
    cfg = configs.shrink_params(16, 128, 0, 4, 2)
    # 8 tokens, 8 slots: 8 busy tiles; hidden 16384 = 128 chunks, the cap lifted to see the target
    with configs.override_policy(dataclasses.replace(configs.launch_policy(), split_cap=64)):
        monkeypatch.setattr(configs, "device_sm_count", lambda: 20)
        assert configs.target_programs(configs.launch_policy()) == 40
        assert configs.resolve_split(dict(cfg), 8, 16384, 16, 1, 8)["SPLIT_K"] == 40 // 8
        monkeypatch.setattr(configs, "device_sm_count", lambda: None)
        assert configs.resolve_split(dict(cfg), 8, 16384, 16, 1, 8)["SPLIT_K"] == FALLBACK_TARGET_PROGRAMS // 8
        # a plan for another device than the one present does not use the present GPU's SM count
        monkeypatch.setattr(configs, "device_sm_count", lambda: 20)
        assert configs.target_programs(configs.launch_policy(), device="NVIDIA Other") == FALLBACK_TARGET_PROGRAMS


def test_a_table_policy_sets_the_fields_it_names(compiled, monkeypatch, table_dir):
    _write(table_dir, "NVIDIA Test 2", {"small_t_max": 16, "spread_pdl_max_tokens": 8, "split_cap": 2})
    monkeypatch.setattr(configs, "device_name", lambda: "NVIDIA Test 2")
    got = configs.launch_policy()
    assert (got.small_t_max, got.spread_pdl_max_tokens, got.split_cap) == (16, 8, 2)
    assert dataclasses.replace(got, small_t_max=32, spread_pdl_max_tokens=32, split_cap=8) == GENERIC_POLICY
    # the planners read it: 17-32 tokens are no longer one tile per group, the split is capped at 2
    assert planning.small_t_block(17, 16) == (False, 16) and planning.small_t_block(16, 16) == (True, 16)
    cfg = configs.resolve_split(configs.shrink_params(16, 128, 0, 4, 2), 8, 16384, 16, 1, 8)
    assert cfg["SPLIT_K"] == 2


@pytest.mark.parametrize("policy,match", [
    ({"small_t": 32}, r"unknown keys \['small_t'\]"),
    ({"force_fused": True}, r"unknown keys \['force_fused'\]"),
    ({"split_cap": 0}, r"LaunchPolicy\.split_cap: expected an integer >= 1, got 0"),
    ({"small_t_max": "32"}, r"LaunchPolicy\.small_t_max: expected an integer >= 0, got '32'"),
    ({"prefetch_low_rank_tokens": [256, 64]}, r"LaunchPolicy\.prefetch_low_rank_tokens: expected \(lo, hi\)"),
    ([1, 2], r"expected an object of LaunchPolicy fields, got list"),
])
def test_a_bad_table_policy_names_the_file_and_the_field(monkeypatch, table_dir, policy, match):
    _write(table_dir, "NVIDIA Test 3", policy)
    with pytest.raises(ValueError, match=r"NVIDIA_Test_3\.json policy: " + match):
        configs.table("NVIDIA Test 3")


def test_policy_values_are_checked_on_replace():
    with pytest.raises(ValueError, match="LaunchPolicy.target_programs: expected an integer >= 1, got 0"):
        dataclasses.replace(GENERIC_POLICY, target_programs=0)
    with pytest.raises(ValueError, match="LaunchPolicy.fused_min_tokens"):
        dataclasses.replace(GENERIC_POLICY, fused_min_tokens=True)
    with pytest.raises(TypeError, match="LaunchPolicy.force_fused: expected None, True or False, got 1"):
        dataclasses.replace(GENERIC_POLICY, force_fused=1)
    assert LaunchPolicy(prefetch_low_rank_tokens=[1, 2]).prefetch_low_rank_tokens == (1, 2)


def test_override_policy_governs_the_block_only(compiled, monkeypatch, caplog):
    """Inside `override_policy` every planner reads the given policy (nested blocks: the innermost);
    after the block, the device's again."""
    monkeypatch.setattr(configs, "device_name", lambda: H200)
    monkeypatch.delenv("LORA_CORE_PDL", raising=False)
    h200 = configs.launch_policy()
    assert not configs.use_fused(8, 16, 1, 8) and not planning.pdl_launch("shrink", 8)
    forced = dataclasses.replace(h200, force_fused=True, first_kernel_pdl_max_tokens=8, force_prefetch=False)
    with caplog.at_level("INFO", logger="lora_core"), configs.override_policy(forced) as active:
        assert active is forced and configs.launch_policy() is forced and configs.launch_policy(H200) is forced
        assert configs.use_fused(8, 16, 1, 8) and configs.fused_forced() is True
        assert not configs.use_fused(8, 16, 1, 8, deterministic=True)        # deterministic: never fused
        assert planning.pdl_launch("shrink", 8) and not planning.pdl_launch("shrink", 9)
        assert not configs.use_prefetch(8, 16)
        with configs.override_policy(dataclasses.replace(forced, force_fused=False, small_t_max=8)):
            assert not configs.use_fused(8, 16, 1, 8) and planning.small_t_block(9, 16) == (False, 16)
        assert configs.launch_policy() is forced
    assert "launch policy override" in caplog.text and "force_fused" in caplog.text
    assert configs.launch_policy() is h200 and configs.fused_forced() is None
    assert not configs.use_fused(8, 16, 1, 8) and configs.use_prefetch(8, 16)
    with pytest.raises(TypeError, match="override_policy: expected a LaunchPolicy, got dict"), \
            configs.override_policy({"force_fused": True}):
        pass
    with pytest.raises(RuntimeError), configs.override_policy(forced):
        raise RuntimeError("the block failed")
    assert configs.launch_policy() is h200                                    # restored on the way out


def test_prefetch_lines_follow_the_policy(monkeypatch):
    monkeypatch.setattr(planning, "interpreting", lambda: False)
    assert planning.prefetch_constexprs(True, 4096, "bfloat16")["PREFETCH_LINES"] == GENERIC_POLICY.prefetch_max_lines
    with configs.override_policy(dataclasses.replace(configs.launch_policy(), prefetch_max_lines=4)):
        assert planning.prefetch_constexprs(True, 4096, "bfloat16")["PREFETCH_LINES"] == 4
    with configs.override_policy(dataclasses.replace(configs.launch_policy(), force_prefetch=False)):
        assert planning.prefetch_constexprs(True, 4096, "bfloat16")["PREFETCH_LINES"] == 0


def test_a_table_variant_sets_policy_fields(monkeypatch, tmp_path):
    """benchmarks/table_variant.py --policy writes the base table with policy fields set (checked);
    LORA_CORE_TABLE makes the planners read them, the rest of the base's policy kept."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
    try:
        import table_variant
    finally:
        sys.path.pop(0)
    out = tmp_path / "no_spread.json"
    assert table_variant.main([str(out), "--policy", '{"spread_pdl_max_tokens": 1}']) == 0
    monkeypatch.setenv("LORA_CORE_TABLE", str(out))
    configs.table.cache_clear()
    try:
        got = configs.table(H200).policy
        assert got == dataclasses.replace(configs.GENERIC.policy, target_programs=264, spread_pdl_max_tokens=1)
    finally:
        configs.table.cache_clear()
    with pytest.raises(ValueError, match=r"--policy: unknown keys \['spread'\]"):
        table_variant.main([str(out), "--policy", '{"spread": 1}'])


def test_e2e_decode_forces_the_fused_kernel_through_an_override():
    """benchmarks/e2e_decode.py --fused on/off runs under a policy with force_fused set; auto under the device's."""
    from types import SimpleNamespace
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
    try:
        import e2e_decode
    finally:
        sys.path.pop(0)
    device = configs.launch_policy()
    for fused, want in (("on", True), ("off", False)):
        with e2e_decode.launch_policy(SimpleNamespace(fused=fused)):
            assert configs.fused_forced() is want
            assert configs.launch_policy() == dataclasses.replace(device, force_fused=want)
    with e2e_decode.launch_policy(SimpleNamespace(fused="auto")):
        assert configs.launch_policy() is device
