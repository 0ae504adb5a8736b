"""The benchmark's source digest (results' `meta.source_digest`): names the tree a result came
from even where .git is stale (the device machine's copy), so it must depend on the sources only.

Plain Python on the CPU.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

pytest.importorskip("torch")      # bench_triton imports torch (and triton) at module level
pytest.importorskip("triton")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))


def test_the_source_digest_follows_the_sources_and_ignores_results(tmp_path):
    import bench_triton
    for d in bench_triton._SOURCE_DIRS:
        shutil.copytree(os.path.join(ROOT, d), tmp_path / d,
                        ignore=shutil.ignore_patterns("__pycache__", "results"))
    here = bench_triton.source_digest(ROOT)
    copy = bench_triton.source_digest(str(tmp_path))
    assert copy == here and len(here) == 16
    (tmp_path / "benchmarks" / "results").mkdir()
    (tmp_path / "benchmarks" / "results" / "new.json").write_text("{}")      # results do not count
    assert bench_triton.source_digest(str(tmp_path)) == here
    kernel = tmp_path / "lora_core" / "kernels" / "shrink.py"
    kernel.write_text(kernel.read_text() + "\n# changed\n")
    assert bench_triton.source_digest(str(tmp_path)) != here


def test_the_digest_is_printed_without_a_gpu():
    out = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "bench_triton.py"), "--digest"],
                         capture_output=True, text=True, cwd=ROOT, timeout=120,
                         env={**os.environ, "PYTHONPATH": ROOT})
    assert out.returncode == 0, out.stderr[-2000:]
    import bench_triton
    assert out.stdout.strip().splitlines()[-1] == bench_triton.source_digest(ROOT)
