"""bridge: what used to be changed in silence or crash the process.

- `to_torch(a)` then `a.delete()`: the tensor keeps the buffer alive (it used to abort the process
  on a jaxlib check failure; tested in a child process).
- int64 values outside int32 are refused, not wrapped, where they are converted on the host.
- float64 is refused as on the native side (SPEC section 4 dtypes), not narrowed to float32.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import jax.numpy as jnp
import numpy as np
import pytest
import torch

import bridge
from lora_core.host_mapping import LoRAMapping


BIG = 2 ** 32 + 1
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
F32 = r"\('float16', 'bfloat16', 'float32'\)"


def _run_child(code: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, env=env,
                           timeout=300, cwd=ROOT)


# ----------------------------------------------------------------------------- to_torch, then delete

@pytest.mark.parametrize("fast", [True, False], ids=["fast-path", "public-path"])
def test_to_torch_then_delete_or_donate_keeps_the_buffer(fast):
    child = _run_child(f"""
        import gc
        import jax, jax.numpy as jnp, numpy as np
        import bridge
        from bridge import dlpack
        dlpack._fast["export"] = {fast}
        a = jnp.arange(1 << 16, dtype=jnp.float32) + 1
        want = np.asarray(a).copy()
        t = bridge.to_torch(a)
        assert t.data_ptr() == a.unsafe_buffer_pointer()          # still zero-copy
        a.delete()
        del a
        gc.collect()
        junk = [jnp.full((1 << 16,), 7.0) + i for i in range(16)]  # reuse freed memory, if any was freed
        assert np.array_equal(t.numpy(), want), "the torch tensor lost its buffer"
        b = jnp.arange(1 << 16, dtype=jnp.float32) + 1
        u = bridge.to_torch(b)
        c = jax.jit(lambda v: v * 2, donate_argnums=0)(b)           # donation while torch holds the buffer
        junk = [jnp.full((1 << 16,), 7.0) + i for i in range(16)]
        assert np.array_equal(u.numpy(), want) and np.array_equal(np.asarray(c), 2 * want)
        print("OK")
    """)
    assert child.returncode == 0 and "OK" in child.stdout, (child.returncode, child.stdout, child.stderr[-3000:])


# ----------------------------------------------------------------------------- int64 beyond int32

def test_to_jax_int64_copy_refuses_values_beyond_int32():
    t = torch.tensor([0, BIG, -1], dtype=torch.int64)
    with pytest.raises(ValueError, match=r"int64 tensor \(shape \(3,\), device cpu\).*holds 4294967297, outside "
                                         r"\[-2147483648, 2147483647\]"):
        bridge.to_jax(t, copy=True)
    with pytest.raises(ValueError, match=r"holds -4294967297"):
        bridge.to_jax(-t, copy=True)
    ok = bridge.to_jax(torch.tensor([0, 2 ** 31 - 1, -2 ** 31], dtype=torch.int64), copy=True)
    assert ok.dtype == jnp.int32 and np.asarray(ok).tolist() == [0, 2 ** 31 - 1, -2 ** 31]


def test_bridged_ops_refuse_int64_indices_beyond_int32():
    rng = np.random.default_rng(0)
    x = torch.from_numpy(rng.standard_normal((4, 16)).astype(np.float32)).clone()
    wa = torch.from_numpy(rng.standard_normal((3, 4, 16)).astype(np.float32)).clone()
    idx = torch.tensor([0, BIG, 1, -1], dtype=torch.int64)
    with pytest.raises(ValueError, match=r"lora_indices_tensor holds 4294967297, outside the int32 range"):
        bridge.torch_over_jax.bgmv_shrink(x, wa, idx)
    with pytest.raises(ValueError, match=r"idx holds 4294967297, outside the int32 range"):
        bridge.jax_over_torch.bgmv_shrink(jnp.asarray(x.numpy()), jnp.asarray(wa.numpy()),
                                          np.array([0, BIG, 1, -1], np.int64))


# ----------------------------------------------------------------------------- float64 is refused, not narrowed

def test_torch_over_jax_refuses_float64_even_with_copy():
    w = bridge.TorchPunicaWrapper(8, 4, "cpu", max_loras=3, copy=True)
    w.update_metadata(LoRAMapping((5, 0, 7, 6), (5,)), [5, 6, 7], 4, 32)
    x, y = torch.randn(4, 16), torch.zeros(4, 8)
    a, b = torch.randn(3, 1, 4, 16), torch.randn(3, 1, 8, 4)
    with pytest.raises(TypeError, match=rf"^x must have dtype in {F32}, got float64$"):
        w.add_lora_linear(y, x.double(), [a], [b], None, 1.0, (8,))
    with pytest.raises(TypeError, match=rf"^lora_a_stacked\[0\] must have dtype in {F32}, got float64$"):
        w.add_lora_linear(y, x, [a.double()], [b], None, 1.0, (8,))
    with pytest.raises(TypeError, match=rf"^x must have dtype in {F32}, got float64$"):
        bridge.torch_over_jax.bgmv_shrink(x.double(), a[:, 0], torch.zeros(4, dtype=torch.int32), copy=True)


def test_jax_over_torch_refuses_numpy_float64():
    jw = bridge.JaxPunicaWrapper(8, 4, "cpu", max_loras=3)
    jw.update_metadata(LoRAMapping((5, 0, 7, 6), (5,)), [5, 6, 7], 4, 32)
    rng = np.random.default_rng(1)
    x, y = rng.standard_normal((4, 16)), np.zeros((4, 8), np.float32)
    a, b = jnp.ones((3, 1, 4, 16)), jnp.ones((3, 1, 8, 4))
    with pytest.raises(TypeError, match=r"^x must have a 32-bit \(or narrower\) dtype, got float64"):
        jw.add_lora_linear(y, x, [a], [b], None, 1.0, (8,))
    with pytest.raises(TypeError, match=r"^x must have a 32-bit \(or narrower\) dtype, got float64"):
        bridge.jax_over_torch.bgmv_shrink(x, a[:, 0], np.zeros(4, np.int32))
