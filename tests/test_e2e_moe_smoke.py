"""benchmarks/e2e_moe.py in --smoke mode: the MoE model-step benchmark's whole pipeline (the Flax
Mixtral with attention and expert LoRA under jit, the torch MoE decoder over the same weights in
its captured-step form, both checks, alternate timing, the JSON/markdown report) on the CPU with a
tiny model and the reference backends."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("torch")
pytest.importorskip("flax")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow
def test_smoke_run_writes_checked_results(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "TRITON_INTERPRET")}
    env.update(PYTHONPATH=ROOT, JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "e2e_moe.py"), "--smoke", "--out",
                           str(tmp_path)], capture_output=True, text=True, cwd=ROOT, env=env, timeout=900, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    with open(tmp_path / "e2e_moe.json") as f:
        res = json.load(f)
    meta = res["meta"]
    assert meta["smoke"] is True and meta["device"] == "cpu" and meta["layers"] == 2
    assert meta["lora_targets"] == ["q_proj", "k_proj", "v_proj", "o_proj", "experts"]
    assert {(r["case"], r["framework"]) for r in res["rows"]} == {
        (c, fw) for c in ("dec B1 D1 r16", "dec B8 D3 r16", "pre 1x16 D1 r16") for fw in ("torch", "jax")}
    for r in res["rows"]:
        check = r["check"]
        assert check["ok"] is True
        if "effect" in check:                       # the adapters move the logits: the check can fail
            assert check["effect"] > 0.05 and check["err"] <= 0.2 * check["effect"]
        assert r["base_us"] > 0 and r["lora_us"] > 0
        assert r["overhead_us"] == pytest.approx(r["lora_us"] - r["base_us"], abs=0.2)
    assert any("rows_ok" in r["check"] for r in res["rows"] if r["framework"] == "jax")
    with open(tmp_path / "e2e_moe.md") as f:
        assert f.read().count("| ok |") == 6
