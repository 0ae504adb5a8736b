"""benchmarks/bench_fused_linear.py --quick: the fused linear benchmark's whole pipeline (input sets,
float64 references, the config grids, cuBLAS / today's path / gemm_lora / rms_norm_shrink and the
norm chains, the JSON and markdown report) on the CPU in Triton's interpreter at tiny shapes."""

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


@pytest.mark.skipif(not torch_helpers.triton_interpreter_runs_loops(), reason="Triton's interpreter before 3.8")
def test_quick_run_writes_checked_results(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(PYTHONPATH=ROOT, CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "bench_fused_linear.py"), "--quick",
                           "--out", str(tmp_path)], capture_output=True, text=True, cwd=ROOT, env=env, timeout=600,
                          check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    with open(tmp_path / "fused_linear.json") as f:
        res = json.load(f)
    assert {"date", "device", "torch", "triton", "commit"} <= set(res["meta"])
    rows = res["rows"]
    assert {r["layer"] for r in rows} == {"qkv", "down"} and not res["skipped"]
    for r in rows:
        assert "error" not in r, r
        # bf16 results against the float64 reference (docs/contract.md section 4)
        for key in ("err_cublas", "err_nolora", "err_today", "err_fused"):
            assert r[key] <= 2e-2, (key, r)
        assert r["grid_epilogue"] and all(isinstance(g["us"], float) for g in r["grid_epilogue"])
    qkv = next(r for r in rows if r["layer"] == "qkv")
    assert qkv["err_chain_fused"] <= 2e-2 and qkv["norm_shrink_cfg"]
    md = (tmp_path / "fused_linear.md").read_text()
    assert "| qkv | 5 |" in md and "chain fused" in md
