"""bridge on the CPU: zero-copy by pointer identity, refusals, caching, bridged == native.

The conformance suite runs both bridged directions against the float64 oracle (tests/bridge_impl.py);
this file checks what is specific to the bridge: that nothing is copied, that what cannot be shared
is refused with a clear error (and copied only with copy=True), that persistent tensors are converted
once and reconverted when they change, and that a bridged call gives bit for bit the result of the
native call of the side whose kernels it runs.

Also the bridge as docs/bridge.md shows it: both bridged wrappers against the native ones,
`copy=True` seeing writes through `.data` and NumPy, tensors requiring grad refused. CPU only; the
CUDA counterpart is tests/test_gpu_bridge.py.
"""

from __future__ import annotations

import gc
import random

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import bridge
import jax_lora
import torch_lora
from bridge import dlpack
from lora_core.host_mapping import LoRAMapping

from . import jax_helpers, torch_helpers

DTYPES = ["float32", "bfloat16", "float16", "int32", "int8", "uint8", "bool"]


@pytest.fixture(autouse=True)
def _jax_on_the_cpu():
    """These tests pair JAX arrays with CPU torch tensors, so JAX's side runs on its CPU device too
    (on a GPU machine JAX's default device is the GPU); tests/test_gpu_bridge.py pairs CUDA ones."""
    with jax.default_device(jax.devices("cpu")[0]):
        yield


def _torch_tensor(dtype: str, shape=(8, 32)) -> torch.Tensor:
    t = torch.arange(int(np.prod(shape)), dtype=torch.float32).reshape(shape) % 7
    return t.to(getattr(torch, dtype))


# ----------------------------------------------------------------------------- zero-copy

@pytest.mark.parametrize("dtype", DTYPES)
def test_to_jax_shares_memory(dtype):
    t = _torch_tensor(dtype)
    a = bridge.to_jax(t)
    assert a.unsafe_buffer_pointer() == t.data_ptr()
    assert str(a.dtype) == dtype and a.shape == tuple(t.shape)
    want = t.numpy() if dtype != "bfloat16" else t.float().numpy().astype(a.dtype)
    np.testing.assert_array_equal(np.asarray(a), want)


@pytest.mark.parametrize("dtype", DTYPES)
def test_to_torch_shares_memory(dtype):
    a = jnp.asarray(np.arange(256).reshape(8, 32) % 7).astype(dtype)
    t = bridge.to_torch(a)
    assert t.data_ptr() == a.unsafe_buffer_pointer()
    assert t.dtype == getattr(torch, dtype) and tuple(t.shape) == a.shape
    np.testing.assert_array_equal(t.float().numpy(), np.asarray(a).astype(np.float32))


def test_round_trip_and_views_share_memory():
    t = torch.randn(64, 48)
    assert bridge.to_torch(bridge.to_jax(t)).data_ptr() == t.data_ptr()
    tt = t.T  # a transpose is a permutation of a dense layout: shared
    np.testing.assert_array_equal(np.asarray(bridge.to_jax(tt)), tt.numpy())
    assert bridge.to_jax(tt).unsafe_buffer_pointer() == t.data_ptr()
    rows = t[16:32]  # a row slice at a 64-byte aligned offset: shared
    assert bridge.to_jax(rows).unsafe_buffer_pointer() == rows.data_ptr()
    empty = torch.zeros(0, 5)
    assert bridge.to_jax(empty).shape == (0, 5)


def test_public_fallback_path_shares_memory_too(monkeypatch):
    """If a jaxlib changes the private DLPack entry points, the public functions take over."""
    monkeypatch.setitem(dlpack._fast, "import", False)
    monkeypatch.setitem(dlpack._fast, "export", False)
    t = torch.randn(16, 64).to(torch.bfloat16)
    a = bridge.to_jax(t)
    assert a.unsafe_buffer_pointer() == t.data_ptr() and a.dtype == jnp.bfloat16
    assert bridge.to_torch(a).data_ptr() == t.data_ptr()
    with pytest.raises(bridge.CopyRequiredError):
        bridge.to_jax(t[:, ::2])


def test_shared_buffer_is_shared():
    """A torch write into an exported tensor changes the JAX value (documented, not a bug)."""
    t = torch.zeros(16)
    a = bridge.to_jax(t)
    t[3] = 5.0
    assert float(a[3]) == 5.0


def test_int64_with_x64_is_shared():
    t = torch.arange(16, dtype=torch.int64)
    with jax.enable_x64(True):
        a = bridge.to_jax(t)
        assert a.dtype == jnp.int64 and a.unsafe_buffer_pointer() == t.data_ptr()


# ----------------------------------------------------------------------------- refusals

def _misaligned():
    base = torch.zeros(100)
    return base[1:33]  # 4 bytes past a 64-byte boundary


REFUSED = {
    "step": (lambda: torch.randn(8, 32)[:, ::2], "not a permutation of a dense layout"),
    "column_slice": (lambda: torch.randn(8, 32)[:, 3:], "not a permutation of a dense layout"),
    "expand": (lambda: torch.randn(1, 32).expand(8, 32), "not a permutation of a dense layout"),
    "misaligned": (_misaligned, "not 64-byte aligned"),
    "int64": (lambda: torch.arange(10), "needs jax_enable_x64"),
    "requires_grad": (lambda: torch.randn(4, requires_grad=True), "requires grad"),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_to_jax_refuses_what_needs_a_copy(case):
    make, message = REFUSED[case]
    t = make()
    with pytest.raises(bridge.CopyRequiredError, match=message) as info:
        bridge.to_jax(t)
    assert "copy=True" in str(info.value) and str(tuple(t.shape)) in str(info.value)
    a = bridge.to_jax(t, copy=True)  # a copy is permitted: right values
    want = t.detach().to(torch.int32) if t.dtype == torch.int64 else t.detach()
    np.testing.assert_array_equal(np.asarray(a), want.numpy())
    if case == "int64":
        assert a.dtype == jnp.int32  # the explicit index conversion


def test_from_numpy_tensors_are_usually_refused_and_fixed_by_torch_allocation():
    arr = np.ones((5, 3), np.float32)
    t = torch.from_numpy(arr)
    if t.data_ptr() % 64:
        with pytest.raises(bridge.CopyRequiredError, match="64-byte"):
            bridge.to_jax(t)
    c = t.clone()  # torch's allocator aligns to 64 bytes
    assert bridge.to_jax(c).unsafe_buffer_pointer() == c.data_ptr()


def test_compact_predicate_matches_jaxlib():
    """`_is_compact` against jaxlib's own importer on random permuted/sliced/expanded/stepped views."""
    rng = random.Random(0)
    checked = 0
    for _ in range(300):
        shape = [rng.choice([1, 2, 3, 4]) for _ in range(rng.randint(1, 4))]
        v = torch.arange(int(np.prod(shape)), dtype=torch.float32).reshape(shape)
        for op in rng.sample(["perm", "slice", "unsq", "expand", "step"], k=rng.randint(0, 3)):
            if op == "perm":
                v = v.permute(*rng.sample(range(v.dim()), v.dim()))
            elif op == "slice" and v.dim() and max(v.shape) > 1:
                d = max(range(v.dim()), key=lambda i: v.shape[i])
                v = v.narrow(d, 1, v.shape[d] - 1)
            elif op == "unsq":
                v = v.unsqueeze(rng.randint(0, v.dim()))
            elif op == "expand" and 1 in v.shape:
                s = list(v.shape)
                s[s.index(1)] = 3
                v = v.expand(*s)
            elif op == "step" and v.dim():
                d = rng.randrange(v.dim())
                v = v[(slice(None),) * d + (slice(None, None, 2),)]
        if v.data_ptr() % 64 or v.numel() == 0:
            continue
        try:
            jnp.from_dlpack(v, copy=False)
            jax_ok = True
        except Exception:
            jax_ok = False
        assert dlpack._is_compact(v.shape, v.stride()) == jax_ok, (tuple(v.shape), v.stride())
        checked += 1
    assert checked > 100


def test_to_torch_refusals():
    with pytest.raises(TypeError, match="inside jax.jit"):
        jax.jit(lambda a: bridge.to_torch(a))(jnp.ones(3))
    with pytest.raises(TypeError, match="jax.Array"):
        bridge.to_torch(np.ones(3))
    with pytest.raises(TypeError, match="torch.Tensor"):
        bridge.to_jax(np.ones(3))
    a = jnp.ones(4) + 1
    a.delete()
    with pytest.raises(bridge.CopyRequiredError, match="deleted"):
        bridge.to_torch(a)
    devices = jax.devices("cpu")
    if len(devices) >= 2:
        mesh = jax.sharding.Mesh(np.array(devices[:2]), ("d",))
        sharded = jax.device_put(jnp.arange(8.0), jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("d")))
        with pytest.raises(bridge.CopyRequiredError, match="sharded over 2 devices"):
            bridge.to_torch(sharded)
        np.testing.assert_array_equal(bridge.to_torch(sharded, copy=True).numpy(), np.arange(8.0))


# ----------------------------------------------------------------------------- the weight cache

def test_conversion_cache_identity_version_and_death():
    cache = bridge.ConversionCache()
    calls = []

    def convert(t):
        calls.append(1)
        return bridge.to_jax(t)

    w = torch.randn(4, 8, 16)
    a1 = cache.get(w, convert)
    assert cache.get(w, convert) is a1 and len(calls) == 1      # converted once
    w[2].mul_(2.0)                                               # in-place change through a view
    a2 = cache.get(w, convert)
    assert len(calls) == 2 and a2 is not a1                      # version bumped: converted again
    np.testing.assert_array_equal(np.asarray(a2), w.numpy())
    same_values = w.clone()                                      # equal values, another object
    cache.get(same_values, convert)
    assert len(calls) == 3
    del w, a1, a2
    gc.collect()
    assert len(cache) == 1                                       # the dead tensor's entry is gone
    # Never keyed on the data pointer alone: a new tensor at a reused address is a miss.
    for _ in range(20):
        t = torch.randn(4, 8, 16)
        cache.get(t, convert)
        del t
    assert len(calls) == 23


def test_inference_tensors_are_cached_without_a_version():
    cache = bridge.ConversionCache()
    with torch.inference_mode():
        w = torch.randn(4, 8)
    a = cache.get(w, bridge.to_jax)
    assert cache.get(w, bridge.to_jax) is a
    with torch.inference_mode():
        w[1] = 3.0  # shared memory: the cached JAX view sees the update
    assert float(a[1, 0]) == 3.0


# ----------------------------------------------------------------------------- bridged == native, bit for bit

def _case(seed=0, dtype="bfloat16", tokens=11, hidden=64, rank=16, slices=(24, 8, 16), slots=4):
    rng = np.random.default_rng(seed)
    ids = [101, None, 103, 104]
    idx = rng.choice([0, 2, 3, -1], size=tokens)
    mapping = LoRAMapping(tuple(0 if i < 0 else ids[i] for i in idx), tuple(0 if i < 0 else ids[i] for i in idx[:5]))
    f = lambda *s: rng.standard_normal(s).astype(np.float32)
    return dict(mapping=mapping, ids=ids, x=f(tokens, hidden), y=f(tokens, sum(slices) + 3),
                a=[f(slots, 1, rank, hidden) / 8 for _ in slices], b=[f(slots, 1, n, rank) / 4 for n in slices],
                bias=[f(slots, n) for n in slices], slices=slices, dtype=dtype, slots=slots, rank=rank)


def _t(a, dtype):
    return torch.from_numpy(a).to(getattr(torch, dtype)).clone()


def _j(a, dtype):
    return jnp.asarray(a).astype(dtype)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_torch_over_jax_equals_native_jax_bitwise(dtype):
    c = _case(1, dtype)
    bw = bridge.TorchPunicaWrapper(16, 4, "cpu", max_loras=c["slots"], backend="xla")
    nw = jax_lora.PunicaWrapper(16, 4, "cpu", max_loras=c["slots"], backend="xla")
    for w in (bw, nw):
        w.update_metadata(c["mapping"], c["ids"], c["slots"] + 1, 32)
    a_t, b_t, bias_t = ([_t(v, dtype) for v in c[k]] for k in ("a", "b", "bias"))
    y_t = _t(c["y"], dtype)
    ptr = y_t.data_ptr()
    got = bw.add_lora_linear(y_t, _t(c["x"], dtype), a_t, b_t, bias_t, 0.5, c["slices"])
    assert got is y_t and y_t.data_ptr() == ptr
    want = nw.add_lora_linear(_j(c["y"], dtype), _j(c["x"], dtype), [_j(v, dtype) for v in c["a"]],
                              [_j(v, dtype) for v in c["b"]], [_j(v, dtype) for v in c["bias"]], 0.5, c["slices"])
    np.testing.assert_array_equal(got.float().numpy(), np.asarray(want).astype(np.float32))
    # logits and embedding through the same wrapper
    ylog = _t(c["y"][:5, :24], dtype)
    got = bw.add_lora_logits(ylog, _t(c["x"][:5], dtype), a_t[0], b_t[0], 0.5)
    want = nw.add_lora_logits(_j(c["y"][:5, :24], dtype), _j(c["x"][:5], dtype), _j(c["a"][0], dtype),
                              _j(c["b"][0], dtype), 0.5)
    np.testing.assert_array_equal(got.float().numpy(), np.asarray(want).astype(np.float32))
    xe = np.random.default_rng(2).standard_normal((11, c["rank"])).astype(np.float32)
    got = bw.add_lora_embedding(_t(c["y"][:, :24], dtype), _t(xe, dtype), b_t[0])
    want = nw.add_lora_embedding(_j(c["y"][:, :24], dtype), _j(xe, dtype), _j(c["b"][0], dtype))
    np.testing.assert_array_equal(got.float().numpy(), np.asarray(want).astype(np.float32))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_jax_over_torch_equals_native_torch_bitwise(dtype):
    c = _case(3, dtype)
    bw = bridge.JaxPunicaWrapper(16, 4, "cpu", max_loras=c["slots"], backend="torch")
    nw = torch_lora.PunicaWrapper(16, 4, "cpu", max_loras=c["slots"], backend="torch")
    for w in (bw, nw):
        w.update_metadata(c["mapping"], c["ids"], c["slots"] + 1, 32)
    y_j = _j(c["y"], dtype)
    got = bw.add_lora_linear(y_j, _j(c["x"], dtype), [_j(v, dtype) for v in c["a"]], [_j(v, dtype) for v in c["b"]],
                             [_j(v, dtype) for v in c["bias"]], 0.5, c["slices"])
    y_t = _t(c["y"], dtype)
    nw.add_lora_linear(y_t, _t(c["x"], dtype), [_t(v, dtype) for v in c["a"]], [_t(v, dtype) for v in c["b"]],
                       [_t(v, dtype) for v in c["bias"]], 0.5, c["slices"])
    np.testing.assert_array_equal(np.asarray(got).astype(np.float32), y_t.float().numpy())
    np.testing.assert_array_equal(np.asarray(y_j).astype(np.float32),
                                  np.asarray(_j(c["y"], dtype)).astype(np.float32))  # input never mutated


# ----------------------------------------------------------------------------- wrappers: caching, zero-copy, errors

def _linear_setup(wrapper_cls, conv, device="cpu"):
    c = _case(5, "float32", slices=(16,))
    w = wrapper_cls(16, 4, device, max_loras=c["slots"])
    w.update_metadata(c["mapping"], c["ids"], c["slots"] + 1, 32)
    return c, w, conv(c["a"][0]), conv(c["b"][0])


def test_torch_wrapper_converts_weights_once_and_sees_updates(monkeypatch):
    c, w, a, b = _linear_setup(bridge.TorchPunicaWrapper, lambda v: torch.from_numpy(v).clone())
    seen = []
    real = bridge.torch_over_jax.to_jax

    def spy(t, **kw):
        seen.append(t.data_ptr())
        return real(t, **kw)

    monkeypatch.setattr(bridge.torch_over_jax, "to_jax", spy)
    x = torch.from_numpy(c["x"]).clone()

    def step():
        seen.clear()
        y = torch.from_numpy(c["y"][:, :16]).clone()
        return w.add_lora_linear(y, x, [a], [b], None, 1.0, (16,)), y

    first, _ = step()
    assert a.data_ptr() in seen and b.data_ptr() in seen
    second, y = step()
    assert sorted(seen) == sorted([y.data_ptr(), x.data_ptr()])  # per call: activations only
    np.testing.assert_array_equal(first.numpy(), second.numpy())
    with torch.no_grad():
        a[0].mul_(3.0)                                    # load new weights into slot 0, in place
    third, _ = step()
    assert a.data_ptr() in seen and b.data_ptr() not in seen
    from tests import oracle
    want = oracle.lora_linear(c["y"][:, :16], c["x"], [a.numpy()], [b.numpy()], None, 1.0,
                              [-1 if i == 0 else c["ids"].index(i) for i in c["mapping"].index_mapping])
    np.testing.assert_allclose(third.numpy(), want, rtol=1e-5, atol=1e-5)


def test_jax_wrapper_converts_weights_once(monkeypatch):
    c, w, a, b = _linear_setup(bridge.JaxPunicaWrapper, jnp.asarray)
    seen = []
    real = bridge.jax_over_torch.to_torch

    def spy(v, **kw):
        seen.append(v.unsafe_buffer_pointer())
        return real(v, **kw)

    monkeypatch.setattr(bridge.jax_over_torch, "to_torch", spy)
    x, y = jnp.asarray(c["x"]), jnp.asarray(c["y"][:, :16])
    out1 = w.add_lora_linear(y, x, [a], [b], None, 1.0, (16,))
    assert a.unsafe_buffer_pointer() in seen
    seen.clear()
    out2 = w.add_lora_linear(y, x, [a], [b], None, 1.0, (16,))
    assert sorted(seen) == sorted([y.unsafe_buffer_pointer(), x.unsafe_buffer_pointer()])
    np.testing.assert_array_equal(np.asarray(out1), np.asarray(out2))
    assert out2.unsafe_buffer_pointer() not in (y.unsafe_buffer_pointer(), out1.unsafe_buffer_pointer())


def _fp8_linear_setup(wrapper_cls, conv):
    """_linear_setup's case with A and B quantised to e4m3 with per-channel float32 scales
    (tests/oracle.py's rule), each converted by `conv` from NumPy: (c, w, a_q, b_q, a_scale, b_scale)."""
    from tests import oracle
    c, w, _, _ = _linear_setup(wrapper_cls, lambda v: v)
    a_q, a_s = oracle.fp8_quantize(c["a"][0])
    b_q, b_s = oracle.fp8_quantize(c["b"][0])
    a_s, b_s = a_s.reshape(a_s.shape[0], -1), b_s.reshape(b_s.shape[0], -1)     # (L, 1, rows) -> (L, rows)
    return c, w, conv(a_q), conv(b_q), conv(a_s), conv(b_s)


def _torch_fp8(v):
    """A torch tensor (torch's allocator: 64-byte aligned) of a NumPy array, e4m3 kept bit for bit."""
    v = np.ascontiguousarray(v)
    if v.dtype == np.dtype(jnp.float8_e4m3fn):
        return torch.from_numpy(v.view(np.uint8)).view(torch.float8_e4m3fn).clone()
    return torch.from_numpy(v).clone()


def test_fp8_tensors_are_shared_both_ways():
    t = _torch_fp8(np.arange(64, dtype=np.float32).reshape(4, 16).astype(jnp.float8_e4m3fn))
    a = bridge.to_jax(t)
    assert a.dtype == jnp.float8_e4m3fn and a.unsafe_buffer_pointer() == t.data_ptr()
    np.testing.assert_array_equal(np.asarray(a).astype(np.float32), t.float().numpy())
    back = bridge.to_torch(jnp.asarray(np.arange(8, dtype=np.float32)).astype(jnp.float8_e4m3fn))
    assert back.dtype == torch.float8_e4m3fn and back.float().tolist() == list(range(8))


def test_torch_wrapper_shares_and_caches_fp8_scales(monkeypatch):
    """fp8 weights and their scales cross to JAX once (pointer identity), later calls convert only the
    activations, and the result is bit for bit the JAX wrapper's on the same arrays."""
    c, w, a, b, sa, sb = _fp8_linear_setup(bridge.TorchPunicaWrapper, _torch_fp8)
    seen, shared = [], {}
    real = bridge.torch_over_jax.to_jax

    def spy(t, **kw):
        out = real(t, **kw)
        seen.append(t.data_ptr())
        shared[t.data_ptr()] = out.unsafe_buffer_pointer()
        return out

    monkeypatch.setattr(bridge.torch_over_jax, "to_jax", spy)
    x = torch.from_numpy(c["x"]).clone()
    results = []
    for _ in range(2):
        seen.clear()
        y = torch.from_numpy(c["y"][:, :16]).clone()
        results.append(w.add_lora_linear(y, x, [a], [b], None, 1.0, (16,), lora_a_scale=[sa], lora_b_scale=[sb]))
        if len(results) == 1:
            assert {t.data_ptr() for t in (a, b, sa, sb)} <= set(seen)
            assert all(shared[t.data_ptr()] == t.data_ptr() for t in (a, b, sa, sb))    # zero-copy
    assert sorted(seen) == sorted([y.data_ptr(), x.data_ptr()])                         # per call: activations
    weights = [bridge.to_jax(t) for t in (a, b, sa, sb)]
    dev = next(iter(weights[0].devices()))               # the bridge's JAX device for CPU tensors
    native = jax_lora.PunicaWrapper(16, 4, dev, max_loras=c["slots"])
    native.update_metadata(c["mapping"], c["ids"], c["slots"] + 1, 32)
    want = native.add_lora_linear(jax.device_put(c["y"][:, :16], dev), jax.device_put(c["x"], dev), [weights[0]],
                                  [weights[1]], None, 1.0, (16,), lora_a_scale=[weights[2]],
                                  lora_b_scale=[weights[3]])
    np.testing.assert_array_equal(results[1].numpy(), np.asarray(want))
    unscaled = torch.from_numpy(c["y"][:, :16]).clone()
    with pytest.raises(ValueError, match="lora_b_stacked is float8_e4m3fn: lora_b_scale must give"):
        w.add_lora_linear(unscaled, x, [a], [b], None, 1.0, (16,), lora_a_scale=[sa])


def test_torch_wrapper_fp8_scale_refusals():
    """A float64 scale is refused (not narrowed to float32), by add_lora_linear and add_lora_logits
    alike; fp8 weights without their scales are refused by name."""
    c, w, a, b, sa, sb = _fp8_linear_setup(bridge.TorchPunicaWrapper, _torch_fp8)
    x, y = torch.from_numpy(c["x"]).clone(), torch.from_numpy(c["y"][:, :16]).clone()
    with pytest.raises(ValueError, match="lora_a_scale"):
        w.add_lora_linear(y, x, [a], [b], None, 1.0, (16,), lora_a_scale=[sa.double()], lora_b_scale=[sb])
    with pytest.raises(ValueError, match="lora_b_scale must be float32"):
        w.add_lora_logits(y[:5], x[:5], a, b, 1.0, lora_a_scale=sa, lora_b_scale=sb.double())
    with pytest.raises(ValueError, match="lora_a_stacked is float8_e4m3fn: lora_a_scale must give"):
        w.add_lora_logits(y[:5], x[:5], a, b, 1.0, lora_b_scale=sb)


@pytest.mark.parametrize("jit", [False, True])
def test_torch_wrapper_fp8_logits_equal_native_and_the_oracle(jit):
    """add_lora_logits with fp8 A and B: per-channel and per-tensor scales cross like the weights
    (zero-copy), the result is bit for bit the JAX wrapper's on the same arrays (jitted alike) and
    matches the float64 oracle on the dequantised weights (rows of sampler index -1 unchanged)."""
    from tests import oracle
    c, w, a, b, sa, sb = _fp8_linear_setup(bridge.TorchPunicaWrapper, _torch_fp8)
    w.jit = jit
    sb_tensor = sb.amax(dim=1).contiguous()                        # (L,): one scale per slot for B
    x = torch.from_numpy(c["x"][:5]).clone()
    ys = torch.from_numpy(c["y"][:5, :16]).clone()
    dev = next(iter(bridge.to_jax(a).devices()))               # the bridge's JAX device for CPU tensors
    native = jax_lora.PunicaWrapper(16, 4, dev, max_loras=c["slots"])
    native.update_metadata(c["mapping"], c["ids"], c["slots"] + 1, 32)

    def call(yj, xj, aj, bj, saj, sbj):
        return native.add_lora_logits(yj, xj, aj, bj, 0.5, lora_a_scale=saj, lora_b_scale=sbj)

    for a_scale, b_scale in ((sa, sb), (sa, sb_tensor)):
        y = ys.clone()
        got = w.add_lora_logits(y, x, a, b, 0.5, lora_a_scale=a_scale, lora_b_scale=b_scale)
        assert got is y
        weights = [bridge.to_jax(t) for t in (a, b, a_scale, b_scale)]
        assert all(v.unsafe_buffer_pointer() == t.data_ptr() for v, t in zip(weights, (a, b, a_scale, b_scale)))
        want = (jax.jit(call) if jit else call)(jax.device_put(c["y"][:5, :16], dev), jax.device_put(c["x"][:5], dev),
                                                *weights)
        np.testing.assert_array_equal(got.numpy(), np.asarray(want))
        a64 = oracle.fp8_dequantize(a.view(torch.uint8).numpy().view(jnp.float8_e4m3fn)[:, 0], a_scale.numpy())
        b64 = oracle.fp8_dequantize(b.view(torch.uint8).numpy().view(jnp.float8_e4m3fn)[:, 0], b_scale.numpy())
        slot_of = {lid: s for s, lid in enumerate(c["ids"]) if lid is not None}
        ref = oracle.f64(c["y"][:5, :16]).copy()
        for j, lid in enumerate(c["mapping"].prompt_mapping):
            if lid > 0:
                s = slot_of[lid]
                ref[j] += (0.5 * oracle.f64(c["x"][j]) @ a64[s].T) @ b64[s].T
        assert any(lid <= 0 for lid in c["mapping"].prompt_mapping)           # a row that stays unchanged
        np.testing.assert_allclose(got.numpy(), ref, rtol=1e-4, atol=1e-4)


def test_jax_wrapper_shares_and_caches_fp8_scales(monkeypatch):
    """The JAX-facing wrapper hands fp8 weights and scales to torch once (pointer identity), then only
    the activations; the result is bit for bit torch_lora's wrapper's on the same tensors."""
    c, w, a, b, sa, sb = _fp8_linear_setup(bridge.JaxPunicaWrapper, jnp.asarray)
    seen = []
    real = bridge.jax_over_torch.to_torch

    def spy(v, **kw):
        out = real(v, **kw)
        seen.append(v.unsafe_buffer_pointer())
        assert out.data_ptr() == v.unsafe_buffer_pointer()
        return out

    monkeypatch.setattr(bridge.jax_over_torch, "to_torch", spy)
    x, y = jnp.asarray(c["x"]), jnp.asarray(c["y"][:, :16])
    out1 = w.add_lora_linear(y, x, [a], [b], None, 1.0, (16,), lora_a_scale=[sa], lora_b_scale=[sb])
    assert {v.unsafe_buffer_pointer() for v in (a, b, sa, sb)} <= set(seen)
    seen.clear()
    out2 = w.add_lora_linear(y, x, [a], [b], None, 1.0, (16,), lora_a_scale=[sa], lora_b_scale=[sb])
    assert sorted(seen) == sorted([y.unsafe_buffer_pointer(), x.unsafe_buffer_pointer()])
    np.testing.assert_array_equal(np.asarray(out1), np.asarray(out2))
    native = torch_lora.PunicaWrapper(16, 4, "cpu", max_loras=c["slots"], backend=w.torch_wrapper.backend)
    native.update_metadata(c["mapping"], c["ids"], c["slots"] + 1, 32)
    y_t = torch.from_numpy(c["y"][:, :16]).clone()
    native.add_lora_linear(y_t, torch.from_numpy(c["x"]), [real(a)], [real(b)], None, 1.0, (16,),
                           lora_a_scale=[real(sa)], lora_b_scale=[real(sb)])
    np.testing.assert_array_equal(np.asarray(out2), y_t.numpy())


def test_torch_wrapper_result_is_written_in_place_zero_copy_inputs(monkeypatch):
    """Every tensor handed to JAX is the caller's own memory (pointer identity), none a copy."""
    c, w, a, b = _linear_setup(bridge.TorchPunicaWrapper, lambda v: torch.from_numpy(v).clone())
    pairs = []
    real = bridge.torch_over_jax.to_jax

    def spy(t, **kw):
        out = real(t, **kw)
        pairs.append((t.data_ptr(), out.unsafe_buffer_pointer()))
        return out

    monkeypatch.setattr(bridge.torch_over_jax, "to_jax", spy)
    x, y = torch.from_numpy(c["x"]).clone(), torch.from_numpy(c["y"][:, :16]).clone()
    w.add_lora_linear(y, x, [a], [b], None, 1.0, (16,))
    assert len(pairs) == 4 and all(p == q for p, q in pairs)


def test_wrapper_errors():
    c, w, a, b = _linear_setup(bridge.TorchPunicaWrapper, lambda v: torch.from_numpy(v).clone())
    y = torch.from_numpy(c["y"][:, :16]).clone()
    x_numpy = torch.from_numpy(np.ascontiguousarray(c["x"]))
    if x_numpy.data_ptr() % 64:
        with pytest.raises(bridge.CopyRequiredError, match="64-byte"):
            w.add_lora_linear(y, x_numpy, [a], [b], None, 1.0, (16,))
    lenient = bridge.TorchPunicaWrapper(16, 4, "cpu", max_loras=c["slots"], copy=True)
    lenient.update_metadata(c["mapping"], c["ids"], c["slots"] + 1, 32)
    lenient.add_lora_linear(y.clone(), x_numpy, [a], [b], None, 1.0, (16,))
    x = x_numpy.clone()
    a_grad = a.clone().requires_grad_(True)
    with pytest.raises(ValueError, match="requires grad"):
        w.add_lora_linear(y, x, [a_grad], [b], None, 1.0, (16,))
    with torch.no_grad():
        w.add_lora_linear(y, x, [a_grad], [b], None, 1.0, (16,))
    with pytest.raises(ValueError, match="mapped only 11"):
        w.add_lora_linear(torch.zeros(12, 16), torch.zeros(12, 64), [a], [b], None, 1.0, (16,))
    jw = bridge.JaxPunicaWrapper(16, 4, "cpu", max_loras=c["slots"])
    jw.update_metadata(c["mapping"], c["ids"], c["slots"] + 1, 32)
    with pytest.raises(TypeError, match="outside jax.jit"):
        jax.jit(lambda y, x: jw.add_lora_linear(y, x, [jnp.asarray(c["a"][0])], [jnp.asarray(c["b"][0])], None, 1.0,
                                                (16,)))(jnp.asarray(c["y"][:, :16]), jnp.asarray(c["x"]))


def test_index_tensors_int64_are_converted_to_int32():
    rng = np.random.default_rng(0)
    x = torch.from_numpy(rng.standard_normal((6, 32)).astype(np.float32)).clone()
    wa = torch.from_numpy(rng.standard_normal((3, 8, 32)).astype(np.float32)).clone()
    idx64 = torch.tensor([0, 2, -1, 1, 1, 0], dtype=torch.int64)
    got = bridge.torch_over_jax.bgmv_shrink(x, wa, idx64, 0.5)
    want = torch_lora.ops.bgmv_shrink(x, wa, idx64.to(torch.int32), 0.5)
    np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-5, atol=1e-6)


# ----------------------------------------------------------------------------- every method and op, bit for bit

def _calls(side, c, w, ops, meta_for, seg):
    """(label, thunk) pairs: each wrapper method and op on one side's arrays (`side`: a converter)."""
    x, s = side(c["x"]), c["slices"]
    a, b, bias = ([side(v) for v in c[k]] for k in ("a", "b", "bias"))
    rng = np.random.default_rng(7)
    buf = side(rng.standard_normal((len(s), 11, c["rank"])).astype(np.float32), "float32")
    fresh = lambda: side(c["y"])
    a0, b0 = a[0], b[0]
    idx = c["idx"]
    yield "add_shrink", lambda: w.add_shrink(side(np.zeros((len(s), 11, c["rank"]), np.float32), "float32"), x, a,
                                             0.5)
    for add_inputs in (True, False):
        yield f"add_expand {add_inputs}", lambda add_inputs=add_inputs: w.add_expand(
            fresh(), buf, b, bias, s, offset_start=2, add_inputs=add_inputs)
    yield "add_lora_embedding", lambda: w.add_lora_embedding(side(c["y"][:, :24]), buf[0], b0)
    yield "add_lora_linear", lambda: w.add_lora_linear(fresh(), x, a, b, bias, 0.5, s)
    yield "add_lora_logits", lambda: w.add_lora_logits(side(c["y"][:5, :24]), x[:5], a0, b0, 0.5)
    yield "bgmv_shrink", lambda: ops.bgmv_shrink(x, a0, idx, 0.5)
    yield "bgmv_expand", lambda: ops.bgmv_expand(buf[0], b0, fresh(), idx, True)
    yield "bgmv_expand_slice", lambda: ops.bgmv_expand_slice(buf[0], b0, fresh(), idx, 5, 24, False)
    yield "sgmv_shrink", lambda: ops.sgmv_shrink(x, a0, *seg, 0.5)
    yield "sgmv_expand", lambda: ops.sgmv_expand(buf[0], b0, fresh(), *seg, True)
    yield "sgmv_expand_slice", lambda: ops.sgmv_expand_slice(buf[0], b0, fresh(), *seg, 3, 24, False)
    yield "lora_shrink", lambda: meta_for("shrink", x, a)
    yield "lora_expand", lambda: meta_for("expand", buf, b, fresh())


def _both_sides(dtype):
    c = _case(11, dtype)
    c["idx_np"] = np.array([-1 if i == 0 else c["ids"].index(i) for i in c["mapping"].index_mapping], np.int32)
    c["mapping"] = LoRAMapping(c["mapping"].index_mapping, c["mapping"].prompt_mapping, True)  # prefill segments
    return c


def _torch_side(c, dtype, bridged):
    import torch_lora as tl
    w = (bridge.TorchPunicaWrapper if bridged else tl.PunicaWrapper)(16, 8, "cpu", max_loras=c["slots"])
    w.update_metadata(c["mapping"], c["ids"], c["slots"] + 1, 32)
    ops = bridge.torch_over_jax if bridged else tl.ops
    conv = lambda v, dt=dtype: torch.from_numpy(np.asarray(v, np.float32)).to(getattr(torch, dt)).clone()
    c = dict(c, idx=torch.from_numpy(c["idx_np"]).clone())
    meta = tl.LoRAKernelMeta.make(c["slots"], 16, "cpu")
    meta.prepare_tensors(c["idx"])

    def meta_for(kind, inp, weights, y=None):
        if kind == "shrink":
            out = torch.zeros((len(weights), inp.shape[0], weights[0].shape[-2]))
            return ops.lora_shrink(inp, weights, out, *meta.meta_args(inp.shape[0]), 0.5)
        return ops.lora_expand(inp, weights, y, *meta.meta_args(y.shape[0]), offset_start=1, add_inputs=True)

    return _calls(conv, c, w, ops, meta_for, w.prefill_metadata)


def _jax_side(c, dtype, bridged):
    import jax_lora
    w = (bridge.JaxPunicaWrapper if bridged else jax_lora.PunicaWrapper)(16, 8, "cpu", max_loras=c["slots"])
    w.update_metadata(c["mapping"], c["ids"], c["slots"] + 1, 32)
    ops = bridge.jax_over_torch if bridged else jax_lora.ops
    conv = lambda v, dt=dtype: jnp.asarray(np.asarray(v, np.float32)).astype(dt)
    c = dict(c, idx=jnp.asarray(c["idx_np"]))
    meta = jax_lora.LoRAKernelMeta.build(c["idx"], c["slots"], 16)

    def meta_for(kind, inp, weights, y=None):
        if kind == "shrink":
            return ops.lora_shrink(inp, weights, meta, 0.5)
        return ops.lora_expand(inp, weights, y, meta, 1, True)

    return _calls(conv, c, w, ops, meta_for, w.prefill_metadata)


def _np(v):
    return v.detach().double().numpy() if isinstance(v, torch.Tensor) else np.asarray(v).astype(np.float64)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("direction", ["torch-over-jax", "jax-over-torch"])
def test_every_method_and_op_equals_native_bitwise(direction, dtype):
    """The bridged call runs the other side's public API: same values in, same bits out."""
    c = _both_sides(dtype)
    if direction == "torch-over-jax":   # torch API, JAX kernels: compare with jax_lora itself
        bridged, native = _torch_side(c, dtype, True), _jax_side(c, dtype, False)
    else:                               # JAX API, torch kernels: compare with torch_lora itself
        bridged, native = _jax_side(c, dtype, True), _torch_side(c, dtype, False)
    labels = []
    for (label, got), (label2, want) in zip(bridged, native):
        assert label == label2
        np.testing.assert_array_equal(_np(got()), _np(want()), err_msg=f"{direction} {label}")
        labels.append(label)
    assert len(labels) == 14


def test_torch_wrapper_jit_mode_matches_eager():
    """jit=True: one compiled program per call shape; same results as the eager JAX wrapper."""
    c = _case(13, "float32")
    eager = bridge.TorchPunicaWrapper(16, 4, "cpu", max_loras=c["slots"])
    jitted = bridge.TorchPunicaWrapper(16, 4, "cpu", max_loras=c["slots"], jit=True)
    for w in (eager, jitted):
        w.update_metadata(c["mapping"], c["ids"], c["slots"] + 1, 32)
    a, b, bias = ([_t(v, "float32") for v in c[k]] for k in ("a", "b", "bias"))
    x = _t(c["x"], "float32")
    outs = []
    for w in (eager, jitted):
        for _ in range(2):  # the second jitted call reuses the compiled program
            y = _t(c["y"], "float32")
            assert w.add_lora_linear(y, x, a, b, bias, 0.5, c["slices"]) is y
        outs.append(y.numpy())
        ylog = _t(c["y"][:5, :24], "float32")
        outs.append(w.add_lora_logits(ylog, x[:5], a[0], b[0], 0.5).numpy())
        ranks = torch.tensor([16, 3, 8, 1])  # int64: converted to int32 explicitly
        outs.append(w.add_lora_linear(_t(c["y"], "float32"), x, a, b, bias, 0.5, c["slices"], lora_ranks=ranks).numpy())
    for k in range(3):
        np.testing.assert_allclose(outs[3 + k], outs[k], rtol=1e-5, atol=1e-5)
    assert not np.allclose(outs[2], outs[0])  # the ranks were used
    assert len(jitted._jitted) == 2
    assert jitted._max_slot == 2  # ids 101 (slot 0) and 103 (slot 2) are used
    with pytest.raises(ValueError, match="slot 2, but the weights have only 2 slots"):
        jitted.add_lora_linear(_t(c["y"], "float32"), x, [v[:2] for v in a], [v[:2] for v in b], None, 0.5,
                               c["slices"])


def test_bridge_to_jax_zero_copy_and_refusals():
    """bridge.to_jax / to_torch share CPU memory (pointer identity)
    for float32 and bfloat16; what cannot be shared without a copy (a strided view, a tensor that
    requires grad, int64 without x64) raises CopyRequiredError (a ValueError) unless copy=True;
    int64 is converted to int32 explicitly, and int64 values outside int32 are refused even with
    copy=True (never wrapped); a tracer given to to_torch is a TypeError."""
    torch = pytest.importorskip("torch")
    import bridge
    for dtype in (torch.float32, torch.bfloat16):
        t = torch.randn(8, 16).to(dtype)
        a = bridge.to_jax(t)
        assert a.unsafe_buffer_pointer() == t.data_ptr() and a.shape == (8, 16)
        assert bridge.to_torch(a).data_ptr() == t.data_ptr()
    t = torch.randn(8, 16)
    for bad in (t[:, ::2], torch.ones(4, requires_grad=True), torch.tensor([1, 2], dtype=torch.int64)):
        with pytest.raises(bridge.CopyRequiredError):
            bridge.to_jax(bad)
    assert issubclass(bridge.CopyRequiredError, ValueError)
    np.testing.assert_array_equal(bridge.to_jax(t[:, ::2], copy=True), t[:, ::2].numpy())
    ints = bridge.to_jax(torch.tensor([1, -1, 7], dtype=torch.int64), copy=True)
    assert ints.dtype == jnp.int32
    np.testing.assert_array_equal(ints, [1, -1, 7])
    with pytest.raises(ValueError):
        bridge.to_jax(torch.tensor([2**32 + 1], dtype=torch.int64), copy=True)
    with pytest.raises(TypeError):
        jax.jit(lambda a: bridge.to_torch(a))(jnp.ones(2))


def test_bridge_jax_api_over_torch_kernels_equals_native():
    """bridge.JaxPunicaWrapper (JAX API, torch_lora kernels) returns a new y equal to
    jax_lora's native wrapper (xla) for add_lora_linear, never mutates its inputs, leaves rows past
    the mapping unchanged, and refuses traced arguments (outside jit only) with a TypeError."""
    pytest.importorskip("torch")
    import bridge
    ids = (1, 0, 3)
    jw = bridge.JaxPunicaWrapper(8, 8, None, max_loras=3)
    jw.update_metadata(LoRAMapping(ids, ids), jax_helpers.LORA_INDEX_TO_ID, 4, 64)
    native = jax_helpers.wrapper(ids, jax_helpers.LORA_INDEX_TO_ID, capacity=8)
    T, H, r, L = 5, 8, 4, 3                                   # two rows past the mapping
    x, y = jnp.asarray(jax_helpers.rand(T, H)), jnp.asarray(jax_helpers.rand(T, 6))
    y_copy = np.array(y)
    A, B = [jnp.asarray(jax_helpers.rand(L, r, H))], [jnp.asarray(jax_helpers.rand(L, 6, r))]
    got = jw.add_lora_linear(y, x, A, B, None, 0.5, (6,))
    want = native.add_lora_linear(y, x, A, B, None, 0.5, (6,))
    assert isinstance(got, jax.Array)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(np.asarray(y), y_copy)
    np.testing.assert_array_equal(np.asarray(got)[3:], y_copy[3:])
    with pytest.raises(TypeError):
        jax.jit(lambda y, x: jw.add_lora_linear(y, x, A, B, None, 0.5, (6,)))(y, x)


def test_torch_facing_bridged_wrapper_equals_native_and_updates_y_in_place():
    """bridge.TorchPunicaWrapper (torch API over jax_lora's kernels) updates y in
    place, returns it, and equals the native torch wrapper and the float64 oracle."""
    import bridge
    rng = torch_helpers.rng(40)
    widths = (6, 3)
    a, b = torch_helpers.stacked(rng, 2, 4, 16, widths)
    bias = [torch.tensor(rng.standard_normal((2, 6)), dtype=torch.float32), None]
    ids = (1, 0, 2, 1)
    x = torch.tensor(rng.standard_normal((4, 16)), dtype=torch.float32)
    y0 = torch.tensor(rng.standard_normal((4, 9)), dtype=torch.float32)
    bw = bridge.TorchPunicaWrapper(16, 4, "cpu", max_loras=2)
    bw.update_metadata(LoRAMapping(ids, ids), [1, 2], 3, 16)
    y = y0.clone()
    assert bw.add_lora_linear(y, x, a, b, bias, 0.5, widths) is y
    native = torch_helpers.wrapper(ids, [1, 2]).add_lora_linear(y0.clone(), x, a, b, bias, 0.5, widths)
    torch.testing.assert_close(y, native, rtol=1e-5, atol=1e-5)
    assert torch_helpers.rel(y.numpy(), torch_helpers.oracle_linear(y0, x, a, b, bias, 0.5, [0, -1, 1, 0],
                                                                    widths)) < 1e-5
    assert torch.equal(y[1], y0[1])


def test_bridged_wrapper_copy_true_sees_writes_through_data_and_numpy():
    """bridge.TorchPunicaWrapper(copy=True) sees updates made through `.data` and
    through a NumPy array aliased by torch.from_numpy (weights that have to be copied)."""
    import bridge
    rng = torch_helpers.rng(41)
    host_a = rng.standard_normal((2, 4, 16)).astype(np.float32)
    a = torch.from_numpy(host_a)                 # NumPy memory: not necessarily shareable
    b = torch.tensor(rng.standard_normal((2, 5, 4)), dtype=torch.float32)
    ids = (1, 2, 1)
    x = torch.tensor(rng.standard_normal((3, 16)), dtype=torch.float32)
    bw = bridge.TorchPunicaWrapper(16, 4, "cpu", max_loras=2, copy=True)
    bw.update_metadata(LoRAMapping(ids, ids), [1, 2], 3, 16)
    bw.add_lora_linear(torch.zeros(3, 5), x, a, b, None, 1.0, (5,))
    host_a[:] = rng.standard_normal(host_a.shape)           # a write torch's version counter misses
    y = bw.add_lora_linear(torch.zeros(3, 5), x, a, b, None, 1.0, (5,))
    want = torch_helpers.oracle_linear(torch.zeros(3, 5), x, [torch.from_numpy(host_a.copy())], [b], None, 1.0,
                                       [0, 1, 0], (5,))
    assert torch_helpers.rel(y.numpy(), want) < 1e-5
    new_b = torch.tensor(rng.standard_normal((2, 5, 4)), dtype=torch.float32)
    b.data = new_b
    y = bw.add_lora_linear(torch.zeros(3, 5), x, a, b, None, 1.0, (5,))
    want = torch_helpers.oracle_linear(torch.zeros(3, 5), x, [torch.from_numpy(host_a.copy())], [new_b], None, 1.0,
                                       [0, 1, 0], (5,))
    assert torch_helpers.rel(y.numpy(), want) < 1e-5


def test_bridged_wrapper_refuses_tensors_requiring_grad():
    """docs/bridge.md (tensors requiring grad are refused unless detached): the
    torch-facing wrapper refuses an x requiring grad while grad mode is on."""
    import bridge
    a, b = torch_helpers.stacked(torch_helpers.rng(42), 2, 4, 8, (5,))
    bw = bridge.TorchPunicaWrapper(16, 4, "cpu", max_loras=2)
    bw.update_metadata(LoRAMapping((1, 2), (1, 2)), [1, 2], 3, 16)
    x = torch.zeros(2, 8, requires_grad=True)
    with pytest.raises((ValueError, TypeError), match="grad"):
        bw.add_lora_linear(torch.zeros(2, 5), x, a, b, None, 1.0, (5,))
