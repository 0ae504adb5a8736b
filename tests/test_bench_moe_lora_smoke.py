"""benchmarks/bench_moe_lora.py --quick: the MoE LoRA benchmark's whole pipeline (every case run first in a
worker process, routing, alignment, our kernel against the reference in both pair orders, vLLM's kernels
attempted, the JSON and markdown report) on the CPU in Triton's interpreter at tiny shapes."""

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
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "bench_moe_lora.py"), "--quick",
                           "--warm-jobs", "1", "--out", str(tmp_path)], capture_output=True, text=True, cwd=ROOT,
                          env=env, timeout=600, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "compiled in 1 workers" in proc.stdout and "0 failures" in proc.stdout, proc.stdout[-3000:]
    with open(tmp_path / "moe_lora.json") as f:
        res = json.load(f)
    assert {"date", "device", "torch", "triton", "commit"} <= set(res["meta"])
    rows = res["rows"]
    vllm_present = "vllm" not in res["meta"]        # absent: meta says how to fetch vLLM's kernels
    assert {(r["layer"], r["order"]) for r in rows} == {("w13", "naive"), ("w13", "sorted"), ("w2", "naive"),
                                                        ("w2", "sorted")}
    for r in rows:
        assert r["err_ours"] <= 2e-2, r                     # bf16 against the float64 reference
        assert isinstance(r["ours_us"], float)
        if vllm_present:
            assert ("vllm_us" in r) != ("vllm_error" in r), r   # vLLM timed, or why not
        else:
            assert "vllm_us" not in r and "vllm_error" not in r, r
    md = (tmp_path / "moe_lora.md").read_text()
    assert "| tiny | w13 | 1 | 1 | 16 | naive |" in md and "Geometric mean" in md
