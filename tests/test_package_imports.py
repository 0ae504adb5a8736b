"""The house: lora_core at the bottom (NumPy + Triton), jax_lora and torch_lora on it, neither
importing the other or the other's framework; the bridge above both. Each import runs in a fresh
interpreter and its sys.modules is checked."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
JAX_SIDE = {"jax", "jaxlib", "flax", "jax_lora"}
TORCH_SIDE = {"torch", "torch_lora"}


def _loaded(code: str, env: dict | None = None) -> set:
    """Top-level packages in sys.modules after running `code` in a fresh interpreter."""
    probe = code + "\nimport sys, json; print(json.dumps(sorted({m.split('.')[0] for m in sys.modules})))"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=ROOT, timeout=300,
                         env={**os.environ, "PYTHONPATH": ROOT, **(env or {})})
    assert out.returncode == 0, out.stderr[-3000:]
    return set(json.loads(out.stdout.strip().splitlines()[-1]))


@pytest.mark.parametrize("module", ["lora_core", "lora_core.host_mapping", "lora_core.checks",
                                    "lora_core.backend_registry", "lora_core.peft",
                                    "lora_core.kernels.configs"])
def test_the_core_imports_no_framework(module):
    if module == "lora_core.kernels.configs":
        pytest.importorskip("triton")
    loaded = _loaded(f"import {module}")
    assert not loaded & (JAX_SIDE | TORCH_SIDE | {"bridge"}), loaded & (JAX_SIDE | TORCH_SIDE)


@pytest.mark.parametrize("module", ["jax_lora", "jax_lora.ops", "jax_lora.ops.triton", "jax_lora.wrapper",
                                    "jax_lora.nn", "jax_lora.adapters", "jax_lora.models", "jax_lora.serving",
                                    "jax_lora.parallel"])
def test_jax_lora_loads_nothing_of_torch(module):
    pytest.importorskip("jax")
    if module.endswith("triton"):
        pytest.importorskip("triton")
    loaded = _loaded(f"import {module}")
    assert not loaded & TORCH_SIDE, loaded & TORCH_SIDE


@pytest.mark.parametrize("module", ["torch_lora", "torch_lora.ops", "torch_lora.ops.triton", "torch_lora.wrapper",
                                    "torch_lora.parallel", "torch_lora.layers", "torch_lora.adapters"])
def test_torch_lora_loads_nothing_of_jax(module):
    pytest.importorskip("torch")
    if module.endswith("triton"):
        pytest.importorskip("triton")
    loaded = _loaded(f"import {module}")
    assert not loaded & JAX_SIDE, loaded & JAX_SIDE
    assert "lora_core" in loaded


def test_the_jax_interpreter_path_runs_without_torch():
    """backend 'triton' on the CPU: the kernels in Triton's interpreter on NumPy memory."""
    pytest.importorskip("jax")
    pytest.importorskip("triton")
    if os.path.exists("/dev/nvidiactl"):
        pytest.skip("the CPU machine's path (a GPU runs the compiled kernels; the GPU image's Triton 3.6 "
                    "interpreter also fails with its NumPy 2.5)")
    code = """
import numpy as np, jax, jax.numpy as jnp
from jax_lora.meta import LoRAKernelMeta
from jax_lora.ops import triton as backend, xla
rng = np.random.default_rng(0)
T, H, R, L = 6, 32, 16, 2
meta = LoRAKernelMeta.build(jnp.asarray(np.array([0, 1, -1, 1, 0, 0], np.int32)), L, T)
x = jnp.asarray(rng.standard_normal((T, H)), jnp.float32)
a = (jnp.asarray(rng.standard_normal((L, R, H)), jnp.float32),)
b = (jnp.asarray(rng.standard_normal((L, 16, R)), jnp.float32),)
y = jnp.zeros((T, 16), jnp.float32)
got = jax.jit(lambda y, x: backend.linear(y, x, a, b, meta, 0.5, (0,)))(y, x)
want = xla.expand(xla.shrink(x, a, meta, 0.5), b, y, meta, (0,), True)
assert float(jnp.abs(got - want).max()) < 1e-3
"""
    loaded = _loaded(code, {"TRITON_INTERPRET": "1", "JAX_PLATFORMS": "cpu"})
    assert not loaded & TORCH_SIDE, loaded & TORCH_SIDE
