"""GPU tests of the bridge, marked `gpu`: run on the lent H200 with PYTHONPATH=. .

  * zero-copy on CUDA by pointer identity, both directions, every dtype the contract uses;
  * stream ordering: a tensor written on a side stream after a long device-side sleep, exported
    outside that stream's context with `stream=side`, is read fresh by JAX (torch's own
    export path read it stale); the reverse: a slow JAX computation read by torch on a side stream;
  * what CUDA refuses (a view 4 bytes past an allocation: XLA assumes aligned parameters);
  * both bridged wrappers on CUDA give the native call's result, y's memory is kept (torch) / the
    input is never mutated (JAX), weights are not re-exported.
Skipped without CUDA (tests/conftest.py), and every JAX part is skipped when JAX has no GPU.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
jax = pytest.importorskip("jax")
jnp = jax.numpy

pytestmark = pytest.mark.gpu

DTYPES = ["float32", "bfloat16", "float16", "int32", "int8", "uint8", "bool"]
SLEEP_CYCLES = 200_000_000  # ~0.1 s of device time on a ~2 GHz SM clock: JAX would run first if unordered


@pytest.fixture(scope="module", autouse=True)
def _needs_jax_gpu():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    try:
        jax.devices("gpu")
    except RuntimeError:
        pytest.skip("JAX has no GPU backend here")


def _bridge():
    import bridge
    return bridge


@pytest.mark.parametrize("dtype", DTYPES)
def test_cuda_zero_copy_both_ways(dtype):
    bridge = _bridge()
    t = (torch.arange(4096, device="cuda") % 5).to(getattr(torch, dtype)).reshape(64, 64)
    a = bridge.to_jax(t)
    assert a.unsafe_buffer_pointer() == t.data_ptr()
    assert a.devices() == {bridge.jax_device_for(t.device)}
    np.testing.assert_array_equal(np.asarray(a.astype(jnp.float32)), t.float().cpu().numpy())
    j = (jnp.arange(4096) % 5).astype(dtype).reshape(64, 64)
    back = bridge.to_torch(j)
    assert back.data_ptr() == j.unsafe_buffer_pointer() and back.is_cuda
    np.testing.assert_array_equal(back.float().cpu().numpy(), np.asarray(j.astype(jnp.float32)))


@pytest.mark.parametrize("path", ["fast", "public"])
def test_side_stream_producer_is_waited_for(path, monkeypatch):
    """The stale read: written on a side stream, exported outside its context."""
    bridge = _bridge()
    if path == "public":  # the fallback through jax.dlpack.from_dlpack orders streams the same way
        monkeypatch.setitem(bridge.dlpack._fast, "import", False)
    n = 1 << 24
    side = torch.cuda.Stream()
    results = {}
    for how in ("stream=side", "inside the context"):
        x = torch.zeros(n, device="cuda")
        torch.cuda.synchronize()
        with torch.cuda.stream(side):
            torch.cuda._sleep(SLEEP_CYCLES)  # the write below lands ~0.1 s later
            x.fill_(1.0)
            if how == "inside the context":
                a = bridge.to_jax(x)  # the current stream is the producer
        if how == "stream=side":
            a = bridge.to_jax(x, stream=side)  # outside the context: the producer named explicitly
        results[how] = float(jnp.sum(a))
        torch.cuda.synchronize()
    # The hazard the bridge fixes, for the record (torch's export waits on the current stream only).
    x = torch.zeros(n, device="cuda")
    torch.cuda.synchronize()
    with torch.cuda.stream(side):
        torch.cuda._sleep(SLEEP_CYCLES)
        x.fill_(1.0)
    native = float(jnp.sum(jnp.from_dlpack(x)))
    torch.cuda.synchronize()
    assert results == {"stream=side": float(n), "inside the context": float(n)}, (
        f"{results}; jnp.from_dlpack read {native} of {n} (stale when < {n})")


@pytest.mark.parametrize("path", ["fast", "public"])
def test_side_stream_consumer_waits_for_jax(path, monkeypatch):
    bridge = _bridge()
    if path == "public":
        monkeypatch.setitem(bridge.dlpack._fast, "export", False)
    side = torch.cuda.Stream()
    m = jnp.full((4096, 4096), 1.0 / 4096, jnp.float32)

    @jax.jit
    def slow(m):
        acc = m
        for _ in range(40):
            acc = acc @ m  # stays 1/4096 everywhere: exact in float32
        return acc + 1.0

    slow(m).block_until_ready()
    for how in ("stream=side", "inside the context"):
        a = slow(m)  # enqueued, not finished
        if how == "stream=side":
            t = bridge.to_torch(a, stream=side)
            with torch.cuda.stream(side):
                total = t.double().sum()
        else:
            with torch.cuda.stream(side):
                t = bridge.to_torch(a)
                total = t.double().sum()
        side.synchronize()
        want = 4096 * 4096 * (1.0 + 1.0 / 4096)
        assert abs(float(total) - want) < 1e-3 * want, how


def test_cuda_refusals():
    bridge = _bridge()
    base = torch.zeros(1024, device="cuda")
    view = base[1:257]  # 4 bytes past a 256-byte aligned allocation
    with pytest.raises(bridge.CopyRequiredError, match="16-byte aligned"):
        bridge.to_jax(view)
    np.testing.assert_array_equal(np.asarray(bridge.to_jax(view, copy=True)), np.zeros(256, np.float32))
    with pytest.raises(bridge.CopyRequiredError, match="dense layout"):
        bridge.to_jax(torch.zeros(8, 8, device="cuda")[:, ::2])
    idx = torch.arange(16, device="cuda")
    with pytest.raises(bridge.CopyRequiredError, match="jax_enable_x64"):
        bridge.to_jax(idx)
    assert bridge.to_jax(idx, copy=True).dtype == jnp.int32


def _case(T=24, H=512, R=16, slices=(256, 64, 64), L=4, dtype=torch.bfloat16, seed=0):
    from lora_core.host_mapping import LoRAMapping
    g = torch.Generator(device="cuda").manual_seed(seed)
    rnd = lambda *s: torch.randn(*s, device="cuda", generator=g).to(dtype)
    ids = [7, None, 9, 11]
    rng = np.random.default_rng(seed)
    idx = rng.choice([0, 2, 3, -1], size=T)
    mapping = LoRAMapping(tuple(0 if i < 0 else ids[i] for i in idx), tuple(0 if i < 0 else ids[i] for i in idx))
    return dict(mapping=mapping, ids=ids, L=L, slices=slices, x=rnd(T, H), y=rnd(T, sum(slices)),
                a=[rnd(L, 1, R, H) / H ** 0.5 for _ in slices], b=[rnd(L, 1, n, R) / R ** 0.5 for n in slices])


def test_torch_over_jax_on_cuda_equals_native_jax():
    bridge = _bridge()
    import jax_lora
    c = _case()
    bw = bridge.TorchPunicaWrapper(32, 8, "cuda", max_loras=c["L"])
    nw = jax_lora.PunicaWrapper(32, 8, bridge.jax_device_for("cuda"), max_loras=c["L"], backend=bw.backend)
    for w in (bw, nw):
        w.update_metadata(c["mapping"], c["ids"], c["L"] + 1, 32000)
    y = c["y"].clone()
    ptr = y.data_ptr()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # the whole call on a side stream after a long sleep
        torch.cuda._sleep(SLEEP_CYCLES)
        got = bw.add_lora_linear(y, c["x"], c["a"], c["b"], None, 0.5, c["slices"])
    side.synchronize()
    assert got is y and y.data_ptr() == ptr
    want = nw.add_lora_linear(bridge.to_jax(c["y"]), bridge.to_jax(c["x"]), [bridge.to_jax(v) for v in c["a"]],
                              [bridge.to_jax(v) for v in c["b"]], None, 0.5, c["slices"])
    np.testing.assert_array_equal(y.float().cpu().numpy(), np.asarray(want.astype(jnp.float32)))
    assert len(bw._weights) == 2 * len(c["slices"])  # converted once, cached


@pytest.mark.parametrize("backend", ["torch", None])
def test_jax_over_torch_on_cuda_equals_native_torch(backend):
    bridge = _bridge()
    import torch_lora
    c = _case(seed=1)
    bw = bridge.JaxPunicaWrapper(32, 8, "gpu", max_loras=c["L"], backend=backend)
    nw = torch_lora.PunicaWrapper(32, 8, "cuda", max_loras=c["L"], backend=bw.backend)
    for w in (bw, nw):
        w.update_metadata(c["mapping"], c["ids"], c["L"] + 1, 32000)
    yj, xj = bridge.to_jax(c["y"].clone()), bridge.to_jax(c["x"])
    aj, bj = [bridge.to_jax(v) for v in c["a"]], [bridge.to_jax(v) for v in c["b"]]
    before = np.asarray(yj.astype(jnp.float32))
    got = bw.add_lora_linear(yj, xj, aj, bj, None, 0.5, c["slices"])
    y = c["y"].clone()
    nw.add_lora_linear(y, c["x"], c["a"], c["b"], None, 0.5, c["slices"])
    np.testing.assert_array_equal(np.asarray(got.astype(jnp.float32)), y.float().cpu().numpy())
    np.testing.assert_array_equal(np.asarray(yj.astype(jnp.float32)), before)  # the input is unchanged
    assert len(bw._weights) == 2 * len(c["slices"])
