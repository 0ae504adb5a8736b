"""bridge: conversions that used to change values in silence or crash the process (CPU).

- `to_jax` shares memory (pointer identity) and `to_torch` back; a strided view is refused
  (CopyRequiredError) unless copy=True.
- `to_torch(a)` then `a.delete()`: the tensor keeps the buffer alive (it used to abort the process
  on a jaxlib check failure; tested in a child process).
- int64 values outside int32 are refused, not wrapped, where they are converted on the host.
- `TorchPunicaWrapper(copy=True)`: a weight that has to be copied is copied on every call, so writes
  torch's version counter cannot see (`.data`, a NumPy alias, an inference tensor) are seen.
- float64 is refused as on the native side (contract section 4 dtypes), not narrowed to float32.
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
import torch_lora
from lora_core.host_mapping import LoRAMapping

from . import oracle

BIG = 2 ** 32 + 1
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
F32 = r"\('float16', 'bfloat16', 'float32'\)"
WEIGHTS = r"\('float16', 'bfloat16', 'float32', 'float8_e4m3fn'\)"     # checks.WEIGHT_DTYPES: fp8 too


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
        assert np.array_equal(t.cpu().numpy(), want), "the torch tensor lost its buffer"
        b = jnp.arange(1 << 16, dtype=jnp.float32) + 1
        u = bridge.to_torch(b)
        try:                                                          # donation while torch holds the buffer
            c = jax.jit(lambda v: v * 2, donate_argnums=0)(b)
        except Exception as e:                                        # a GPU refuses it: b is untouched
            assert "external reference" in str(e), e
            c = jax.jit(lambda v: v * 2)(b)
        junk = [jnp.full((1 << 16,), 7.0) + i for i in range(16)]
        assert np.array_equal(u.cpu().numpy(), want) and np.array_equal(np.asarray(c), 2 * want)
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
    with pytest.raises(TypeError, match=rf"^lora_a_stacked\[0\] must have dtype in {WEIGHTS}, got float64$"):
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


# ----------------------------------------------------------------------------- copy=True sees every write

def _misaligned(values: np.ndarray) -> tuple:
    """A NumPy array and its torch.from_numpy tensor, at 16 mod 64 bytes: JAX cannot share it."""
    n = values.size
    raw = np.empty(n + 16, np.float32)
    skip = ((16 - raw.ctypes.data % 64) % 64) // 4
    arr = raw[skip:skip + n].reshape(values.shape)
    arr[...] = values
    t = torch.from_numpy(arr)
    assert t.data_ptr() % 64 == 16
    return arr, t


def _copy_case():
    rng = np.random.default_rng(2)
    w = bridge.TorchPunicaWrapper(8, 4, "cpu", max_loras=3, copy=True)
    w.update_metadata(LoRAMapping((5, 0, 7, 6), (5,)), [5, 6, 7], 4, 32)
    x = torch.from_numpy(rng.standard_normal((4, 16)).astype(np.float32)).clone()
    y = torch.from_numpy(rng.standard_normal((4, 8)).astype(np.float32)).clone()
    a_np, a = _misaligned(rng.standard_normal((3, 1, 4, 16)).astype(np.float32))
    b = torch.from_numpy(rng.standard_normal((3, 1, 8, 4)).astype(np.float32)).clone()  # shareable
    return w, x, y, a_np, a, b


def _expect(w, x, y, a, b):
    got = w.add_lora_linear(y.clone(), x, [a], [b], None, 1.0, (8,))
    want = oracle.lora_linear(y.numpy(), x.numpy(), [a.numpy()], [b.numpy()], None, 1.0, [0, -1, 2, 1])
    assert oracle.rel_err(got.numpy(), want) < 1e-5


def test_copy_true_sees_writes_through_a_numpy_alias_and_data():
    w, x, y, a_np, a, b = _copy_case()
    _expect(w, x, y, a, b)
    a_np[2] *= 3.0                     # a NumPy write: torch's version counter does not move
    _expect(w, x, y, a, b)
    a.data[0].mul_(-2.0)               # through .data: the version counter of `a` does not move
    _expect(w, x, y, a, b)
    b.data[1].mul_(0.5)                # a shared weight: JAX sees the same memory
    _expect(w, x, y, a, b)
    # The shareable weight is cached (converted once), the copied one is not kept.
    assert len(w._weights) == 1


def test_copy_true_sees_in_place_writes_to_inference_tensors():
    w, x, y, _, _, b = _copy_case()
    with torch.inference_mode():
        store = torch.randn(3 * 4 * 16 + 4)
        a = store[4:].view(3, 1, 4, 16)  # 16 bytes past an aligned allocation: copied, no version counter
        assert a.data_ptr() % 64 == 16
    _expect(w, x, y, a, b)
    with torch.inference_mode():
        a[1].mul_(5.0)
    _expect(w, x, y, a, b)


def test_conversion_cache_keeps_shared_conversions_only():
    cache = bridge.ConversionCache()
    shared = torch.randn(4, 8)
    _, copied = _misaligned(np.ones((4, 8), np.float32))
    first = cache.get(shared, bridge.to_jax)
    assert cache.get(shared, bridge.to_jax) is first and len(cache) == 1
    c1 = cache.get(copied, lambda t: bridge.to_jax(t, copy=True))
    c2 = cache.get(copied, lambda t: bridge.to_jax(t, copy=True))
    assert c1 is not c2 and len(cache) == 1
    copied.numpy()[...] = 2.0
    assert float(cache.get(copied, lambda t: bridge.to_jax(t, copy=True))[0, 0]) == 2.0


def test_native_torch_wrapper_still_agrees():
    """After a NumPy write, copy=True gives the native torch wrapper's result (same tensors, same mapping)."""
    w, x, y, a_np, a, b = _copy_case()
    native = torch_lora.PunicaWrapper(8, 4, "cpu", max_loras=3, backend="torch")
    native.update_metadata(LoRAMapping((5, 0, 7, 6), (5,)), [5, 6, 7], 4, 32)
    w.add_lora_linear(y.clone(), x, [a], [b], None, 1.0, (8,))
    a_np[1] += 1.0
    got = w.add_lora_linear(y.clone(), x, [a], [b], None, 1.0, (8,))
    want = native.add_lora_linear(y.clone(), x, [a], [b], None, 1.0, (8,))
    np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-5, atol=1e-5)


REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_to_jax_zero_copy_refusals_and_int64():
    """to_jax shares memory (pointer identity) and to_torch back;
    a strided view raises CopyRequiredError (a ValueError) unless copy=True; int64 becomes int32
    explicitly with copy=True, and values beyond int32 are refused instead of wrapping."""
    import bridge
    t = torch.arange(64 * 4, dtype=torch.float32).reshape(64, 4)
    if t.data_ptr() % 64 == 0:
        j = bridge.to_jax(t)
        assert j.unsafe_buffer_pointer() == t.data_ptr()
        assert bridge.to_torch(j).data_ptr() == t.data_ptr()
    with pytest.raises(bridge.CopyRequiredError):
        bridge.to_jax(t[:, ::2])
    assert issubclass(bridge.CopyRequiredError, ValueError)
    np.testing.assert_array_equal(np.asarray(bridge.to_jax(t[:, ::2], copy=True)), t[:, ::2].numpy())
    small = torch.tensor([1, -1, 3], dtype=torch.int64)
    j = bridge.to_jax(small, copy=True)
    assert str(j.dtype) == "int32" and np.asarray(j).tolist() == [1, -1, 3]
    with pytest.raises(ValueError):
        bridge.to_jax(torch.tensor([2**32 + 1], dtype=torch.int64), copy=True)


def test_to_torch_then_delete_keeps_the_tensor_valid():
    """bridge.to_torch(a) followed by a.delete() must not abort the process; the
    torch tensor keeps the buffer alive (or the delete is refused cleanly). A child process, since
    the failure mode is an abort."""
    code = textwrap.dedent("""
        import jax, jax.numpy as jnp, torch, bridge
        a = jnp.arange(1024, dtype=jnp.float32) * 2
        t = bridge.to_torch(a)
        try:
            a.delete()
        except Exception as e:
            print("REFUSED", type(e).__name__)
        b = jnp.ones(1 << 16, jnp.float32) * 3
        b.block_until_ready()
        print("SUM", float(t.sum()))
    """)
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120,
                         env=dict(os.environ, JAX_PLATFORMS="cpu"))
    assert out.returncode == 0, out.stderr[-2000:]
    assert f"SUM {float(sum(range(1024)) * 2)}" in out.stdout
