"""benchmarks/tune_fused_linear.py --quick: the fused linear tuner's whole pipeline (cases by layer, M
bucket and rank, every launch compiled first in a worker process, each candidate checked against
float64 and timed, cuBLAS and today's path timed beside it, the decision written into a table that
lora_core.kernels.fused_linear_configs reads, the log beside it, a budget that stops it with what
it finished; for a layer behind an RMSNorm the norm path, rms_norm_shrink + gemm_lora, against the
step's norm + today's path, and its decision `use_norm_fused`) on the CPU in Triton's interpreter at
tiny shapes."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("torch")
pytest.importorskip("triton")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _tune(table, *extra, layers="down"):
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "LORA_CORE_FUSED_LINEAR_TABLE")}
    env.update(PYTHONPATH=ROOT, CUDA_VISIBLE_DEVICES="")
    return subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "tune_fused_linear.py"), "--quick",
                           "--table", str(table), "--layers", layers, *extra], capture_output=True, text=True,
                          cwd=ROOT, env=env, timeout=600, check=False)


def test_quick_run_writes_a_table_the_policy_reads(tmp_path, monkeypatch):
    from lora_core.kernels import fused_linear_configs as flc
    table = tmp_path / "fl.json"
    proc = _tune(table, "--ms", "8", "--jobs", "1")       # one worker process compiles every launch first
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "in 1 workers" in proc.stdout and "0 failures" in proc.stdout, proc.stdout
    entries = flc.read_fused_linear_table(str(table))
    (key,) = entries
    assert key == "k192/n64/m8/r16"                      # the tiny down layer, M 8, rank 8 in the r16 bucket
    entry = entries[key]
    with open(str(table) + ".log.json") as f:
        log = json.load(f)
    row = log["cases"][key]
    timed = [c for c in row["fused"] if "us" in c]
    assert timed and all(c["err"] <= 2e-2 for c in row["epilogue"] + row["nolora"] if "err" in c)
    assert entry["config"] == min(timed, key=lambda c: c["us"])["config"]
    assert entry["use_fused"] == (entry["fused_us"] <= (1 - 0.02) * entry["today_us"])
    assert entry["fused_us"] == round(row["fused_us"], 3) and entry["cublas_us"] == round(row["cublas_us"], 3)
    assert len(row["epilogue"]) >= 2 and row["today_us"] > 0
    monkeypatch.setenv("LORA_CORE_FUSED_LINEAR_TABLE", str(table))
    flc.fused_linear_table.cache_clear()
    try:
        assert flc.use_fused_linear((192, (64,)), 5, 8) == entry["use_fused"]
        assert flc.gemm_config(5, (64,), 192, 8) == entry["config"]
        assert "use_norm_fused" not in entry and not flc.use_norm_fused_linear((192, (64,)), 5, 8)   # no norm in front
    finally:
        flc.fused_linear_table.cache_clear()


def test_quick_run_times_the_norm_path_of_a_layer_behind_a_norm(tmp_path, monkeypatch):
    """qkv (its input an RMSNorm's output): the entry also holds norm_us (rms_norm_shrink + gemm_lora
    with the entry's config, checked against float64), today_with_norm_us (the step's norm + cuBLAS
    + add_lora_linear) and use_norm_fused decided from them, which use_norm_fused_linear reads."""
    from lora_core.kernels import fused_linear_configs as flc
    table = tmp_path / "fl.json"
    proc = _tune(table, "--ms", "8", "--jobs", "1", layers="qkv")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "0 failures" in proc.stdout and "norm path" in proc.stdout, proc.stdout
    entries = flc.read_fused_linear_table(str(table))
    (key,) = entries
    assert key == "k128/n64+32+32/m8/r16"
    entry = entries[key]
    with open(str(table) + ".log.json") as f:
        row = json.load(f)["cases"][key]
    assert row["norm"]["config"] == entry["config"] and row["norm"]["err"] <= 2e-2
    assert entry["norm_us"] == round(row["norm_us"], 3) and entry["today_with_norm_us"] == round(
        row["today_with_norm_us"], 3) > 0
    assert entry["use_norm_fused"] == (entry["norm_us"] <= (1 - 0.02) * entry["today_with_norm_us"])
    assert ("norm path" in entry["norm_reason"]) and entry["use_fused"] == (
        entry["fused_us"] <= (1 - 0.02) * entry["today_us"])
    monkeypatch.setenv("LORA_CORE_FUSED_LINEAR_TABLE", str(table))
    flc.fused_linear_table.cache_clear()
    try:
        assert flc.use_norm_fused_linear((128, (64, 32, 32)), 8, 8) == entry["use_norm_fused"]
        assert flc.use_fused_linear((128, (64, 32, 32)), 8, 8) == entry["use_fused"]
    finally:
        flc.fused_linear_table.cache_clear()


def test_budget_stops_before_the_cases_and_keeps_the_table(tmp_path):
    """--budget-s 0: no case is tuned, the entries already in the table stay, the skipped cases are listed."""
    table = tmp_path / "fl.json"
    kept = {"k9/n9/m8/r16": {"config": {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 64}, "use_fused": True}}
    table.write_text(json.dumps({"device": "x", "format": 1, "entries": kept}))
    proc = _tune(table, "--ms", "1", "--budget-s", "0")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert json.loads(table.read_text())["entries"] == kept
    with open(str(table) + ".log.json") as f:
        assert json.load(f)["skipped"] == ["k192/n64/m1/r16"]
    proc = _tune(table, "--ms", "3")
    assert proc.returncode == 2 and "M buckets" in proc.stderr
