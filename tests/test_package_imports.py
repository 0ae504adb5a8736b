"""The house: lora_core at the bottom (NumPy + Triton), jax_lora and torch_lora on it, neither
importing the other or the other's framework; the bridge above both. Each import runs in a fresh
interpreter and its sys.modules is checked; using jax_lora also says on the `jax_lora` logger which
backend runs and why. CPU only.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

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
    """Backend 'triton' on the CPU: the kernels in Triton's interpreter on NumPy memory."""
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


REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_core_imports_no_framework_and_jax_side_no_torch_and_logs_backend():
    """lora_core (host mapping, checks, PEFT reading, slots, DoRA, registry) imports
    neither JAX nor torch; using jax_lora (wrapper, ops, nn, adapters, serving) loads no torch and no
    torch_lora. the backend chosen is said on the `jax_lora` logger with the reason, and a
    forced Triton backend on a CPU without TRITON_INTERPRET=1 is a clear error saying so."""
    code = textwrap.dedent("""
        import logging, sys
        import lora_core, lora_core.host_mapping, lora_core.checks, lora_core.peft, lora_core.adapter_slots
        import lora_core.dora, lora_core.backend_registry
        bad = [m for m in ("jax", "torch", "jax_lora", "torch_lora", "flax") if m in sys.modules]
        assert not bad, bad
        logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="%(name)s %(message)s")
        import numpy as np
        import jax_lora, jax_lora.nn, jax_lora.adapters, jax_lora.serving
        from jax_lora import LoRAMapping, PunicaWrapper
        w = PunicaWrapper(4, 4, None, max_loras=2)
        w.update_metadata(LoRAMapping((1, 0), (1, 0)), [1, None], 3, 10)
        w.add_lora_linear(np.zeros((2, 4), np.float32), np.ones((2, 8), np.float32),
                          [np.ones((2, 2, 8), np.float32)], [np.ones((2, 4, 2), np.float32)], None, 1.0, (4,))
        bad = [m for m in ("torch", "torch_lora") if m in sys.modules]
        assert not bad, bad
        try:
            jax_lora.ops.bgmv_shrink(np.ones((1, 8), np.float32), np.ones((2, 2, 8), np.float32),
                                     np.zeros(1, np.int32), backend="triton")
        except Exception as e:
            print("TRITON-ERROR", type(e).__name__, e)
        print("DONE")
    """)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["JAX_PLATFORMS"] = "cpu"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, env=env,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = proc.stdout
    assert "DONE" in out
    assert any(line.startswith("jax_lora ") and "'xla'" in line and "cpu" in line for line in out.splitlines()), out
    triton = [line for line in out.splitlines() if line.startswith("TRITON-ERROR")]
    assert triton and "TRITON_INTERPRET=1" in triton[0], out
