"""benchmarks/tune_moe_lora.py --quick: the MoE tuner's whole pipeline (buckets, every candidate run first in a
worker process, candidates checked against the reference and timed, the winners written into a MoE table the
plan reads, the log beside it, a budget that stops it with what it finished) on the CPU in Triton's
interpreter at tiny shapes."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("torch")
pytest.importorskip("triton")

from . import torch_helpers

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _tune(table, *extra):
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "LORA_CORE_MOE_TABLE")}
    env.update(PYTHONPATH=ROOT, CUDA_VISIBLE_DEVICES="")
    return subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "tune_moe_lora.py"), "--quick",
                           "--table", str(table), "--layers", "w2", *extra], capture_output=True, text=True,
                          cwd=ROOT, env=env, timeout=600, check=False)


@pytest.mark.skipif(not torch_helpers.triton_interpreter_runs_loops(), reason="Triton's interpreter before 3.8")
def test_quick_run_writes_a_table_the_plan_reads(tmp_path, monkeypatch):
    from lora_core.kernels import moe_configs
    table = tmp_path / "moe.json"
    proc = _tune(table, "--tokens", "1,3", "--jobs", "1")      # one worker process runs every candidate first
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "compiled in 1 workers" in proc.stdout and "0 failures" in proc.stdout, proc.stdout
    buckets = moe_configs.read_table(str(table))
    assert sorted(k.split("/")[0] for k in buckets) == ["naive", "sorted16"]          # T1 naive, T3 sorted
    with open(str(table) + ".log.json") as f:
        log = json.load(f)
    for key, entry in log["buckets"].items():
        timed = [c for c in entry["candidates"] if "us" in c]
        assert timed and all(c["err"] <= 2e-2 for c in timed), entry
        assert buckets[key] == min(timed, key=lambda c: c["us"])["config"]
    monkeypatch.setenv("LORA_CORE_MOE_TABLE", str(table))
    moe_configs.table.cache_clear()
    try:
        assert moe_configs.table(None) == buckets
    finally:
        moe_configs.table.cache_clear()


def test_budget_stops_before_the_buckets_and_keeps_the_table(tmp_path):
    """--budget-s 0: no bucket is tuned, the entries already in the table stay, the skipped buckets are listed."""
    table = tmp_path / "moe.json"
    kept = {"naive/p16/r64/k9/n9/s1": {"BLOCK_N": 32}}
    table.write_text(json.dumps({"device": "x", "format": 1, "buckets": kept}))
    proc = _tune(table, "--tokens", "1", "--budget-s", "0")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert json.loads(table.read_text())["buckets"] == kept
    with open(str(table) + ".log.json") as f:
        assert json.load(f)["skipped"] == ["naive/p16/r16/k48/n64/s1"]


def test_losing_buckets_go_first_and_tuned_ones_are_skipped(tmp_path):
    """--losing (a bench_moe_lora markdown table) puts the buckets of cases slower than vLLM first,
    the slowest first; --only-untuned drops the buckets the table holds unless they are losing;
    without either, the buckets the table lacks go first (--budget-s 0: the order shows in the
    skipped list)."""
    md = tmp_path / "moe_lora.md"
    md.write_text("| model | layer | T | D | r | order | ours us | vLLM us | vLLM/ours | err ours | err vLLM |\n"
                  "|---|---|---|---|---|---|---|---|---|---|---|\n"
                  "| tiny | w2 | 1 | 1 | 16 | naive | 2.0 | 1.0 | 0.50 | 1e-3 | 1e-3 |\n"
                  "| tiny | w2 | 40 | 2 | 16 | sorted | 1.0 | 2.0 | 2.00 | 1e-3 | 1e-3 |\n"
                  "| tiny | w2 | 3 | 1 | 16 | sorted | 1.0 | 0.9 | 0.90 | 1e-3 | 1e-3 |\n")
    table = tmp_path / "moe.json"
    tuned = {"sorted16/p128/r16/k48/n64/s1": {"BLOCK_N": 32}, "naive/p16/r16/k48/n64/s1": {"BLOCK_N": 16}}
    table.write_text(json.dumps({"device": "x", "format": 1, "buckets": tuned}))
    proc = _tune(table, "--tokens", "1,3,40", "--budget-s", "0", "--losing", str(md), "--only-untuned")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    with open(str(table) + ".log.json") as f:
        skipped = json.load(f)["skipped"]
    assert skipped == ["naive/p16/r16/k48/n64/s1", "sorted16/p16/r16/k48/n64/s1"]      # T40's bucket: tuned
    proc = _tune(table, "--tokens", "1,3,40", "--budget-s", "0")                  # untuned first, then the tuned
    with open(str(table) + ".log.json") as f:
        assert json.load(f)["skipped"] == ["sorted16/p16/r16/k48/n64/s1", "naive/p16/r16/k48/n64/s1",
                                           "sorted16/p128/r16/k48/n64/s1"]


def test_sorted_candidates_include_sub_blocks_and_wide_tiles():
    """A 64-row bucket's candidates: sub-blocks of 32 and 16 rows with their own counts, 1 and 4
    programs per expected block, 128-column B tiles at 4 and 8 warps, one tile per expand program;
    every candidate a valid config."""
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import tune_moe_lora

    from lora_core.kernels.moe_configs import MoeConfig, MoeShape, check_config
    shape = MoeShape(num_pairs=16384, naive=False, block_m=64, num_slots=32, num_experts=8, hidden=4096,
                     widest=14336, slices=2, shrink_slices=2, rank=64)
    cands = tune_moe_lora.candidates(shape, None)
    for c in cands:
        check_config(MoeConfig(**c))
    assert {c["BLOCK_M"] for c in cands} == {0, 32, 16} and {c["PERSIST"] for c in cands} == {1, 2, 4}
    assert {c["expand_warps"] for c in cands if c["BLOCK_N"] == 128 and c["TILES_N"] == 1} == {4, 8}
    assert len({tuple(sorted(c.items())) for c in cands}) == len(cands)
