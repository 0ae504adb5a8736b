"""benchmarks/hf_decode.py in --smoke mode: the Hugging Face benchmark's pipeline (peft adapters made
by peft, the same factors in MultiLoRAModel, the static-cache decode step rewound between
implementations, the check against peft, timing, the report) on the CPU with a tiny Llama."""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("peft")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_smoke_run_matches_peft_and_reports(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(PYTHONPATH=ROOT, CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "hf_decode.py"), "--smoke",
                           "--out", str(tmp_path)], capture_output=True, text=True, cwd=ROOT, env=env, timeout=600,
                          check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (path,) = glob.glob(str(tmp_path / "hf_smoke_*.json"))
    with open(path) as f:
        res = json.load(f)
    assert [c["case"] for c in res["cases"]] == ["B4 D1 r4", "B4 D4 r4", "B8 D2 r8"]
    for c in res["cases"]:
        assert c["check_passed"] and c["err_eager"] < 1e-5 < c["lora_effect"], c
        assert c["peft_us"] > 0 and c["ours_eager_us"] > 0
    assert os.path.exists(path[:-5] + ".md")
