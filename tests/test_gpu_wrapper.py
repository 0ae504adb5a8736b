"""GPU checks of the foundation (marked `gpu`; run on the device machine).

- torch: `update_metadata` and every `add_*` method raise no synchronising CUDA call
  (torch.cuda.set_sync_debug_mode("error")), results equal the CPU reference.
- JAX: the jitted step with the wrapper as an argument does no device-to-host transfer on the GPU.
"""

from __future__ import annotations

import numpy as np
import pytest

from . import oracle

pytestmark = pytest.mark.gpu


def _problem(seed=0, slots=4, hidden=256, rank=16, slices=(128, 32, 32), tokens=24):
    rng = np.random.default_rng(seed)
    idx = rng.integers(-1, slots, tokens).astype(np.int32)
    a = [(rng.standard_normal((slots, 1, rank, hidden)) / np.sqrt(hidden)).astype(np.float32) for _ in slices]
    b = [(rng.standard_normal((slots, 1, n, rank)) / np.sqrt(rank)).astype(np.float32) for n in slices]
    x = rng.standard_normal((tokens, hidden)).astype(np.float32)
    y = rng.standard_normal((tokens, sum(slices))).astype(np.float32)
    return idx, a, b, x, y, slices


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_torch_wrapper_on_cuda_never_syncs(backend):
    torch = pytest.importorskip("torch")
    import torch_lora
    if backend == "triton":
        pytest.importorskip("triton")
    idx, a, b, x, y, slices = _problem()
    ids = [11, 12, 13, 14]
    mapping = torch_lora.LoRAMapping(tuple(0 if i < 0 else ids[i] for i in idx), (11, 0, 14))
    dev = torch.device("cuda")
    t = lambda v: torch.from_numpy(v).to(dev, torch.bfloat16)
    ta, tb, tx, ty = tuple(t(v) for v in a), tuple(t(v) for v in b), t(x), t(y)
    w = torch_lora.PunicaWrapper(64, 16, dev, max_loras=4, backend=backend)
    w.update_metadata(mapping, ids, 5, 1000)
    w.add_lora_linear(ty.clone(), tx, ta, tb, None, 0.5, slices)  # compile / warm up outside the check
    torch.cuda.synchronize()
    y_out = ty.clone()
    torch.cuda.set_sync_debug_mode("error")
    try:
        w.update_metadata(mapping, ids, 5, 1000)
        w.add_lora_linear(y_out, tx, ta, tb, None, 0.5, slices)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    got = y_out.float().cpu().numpy()
    ref_in = [oracle.f64(torch.from_numpy(v).to(torch.bfloat16).float().numpy()) for v in (x, y)]
    qa = [torch.from_numpy(v).to(torch.bfloat16).float().numpy() for v in a]
    qb = [torch.from_numpy(v).to(torch.bfloat16).float().numpy() for v in b]
    want = oracle.lora_linear(ref_in[1], ref_in[0], qa, qb, None, 0.5, idx)
    assert oracle.rel_err(got, want) <= oracle.TOL["bfloat16"]


def test_jax_step_on_gpu_has_no_host_transfer():
    jax = pytest.importorskip("jax")
    if jax.default_backend() != "gpu":
        pytest.skip("JAX has no GPU backend here")
    import jax.numpy as jnp

    import jax_lora
    idx, a, b, x, y, slices = _problem(1)
    ids = [11, 12, 13, 14]
    mapping = jax_lora.LoRAMapping(tuple(0 if i < 0 else ids[i] for i in idx), (11,))
    w = jax_lora.PunicaWrapper(64, 16, None, max_loras=4)
    w.update_metadata(mapping, ids, 5, 1000)
    ja, jb = [jnp.asarray(v, jnp.bfloat16) for v in a], [jnp.asarray(v, jnp.bfloat16) for v in b]

    @jax.jit
    def step(w, y, x):
        return w.add_lora_linear(y, x, ja, jb, None, 0.5, slices)

    jx, jy = jnp.asarray(x, jnp.bfloat16), jnp.asarray(y, jnp.bfloat16)
    step(w, jy, jx).block_until_ready()
    with jax.transfer_guard_device_to_host("disallow"):
        out = step(w, jy, jx)
        out.block_until_ready()
    qa = [np.asarray(v.astype(jnp.float32)) for v in ja]
    qb = [np.asarray(v.astype(jnp.float32)) for v in jb]
    want = oracle.lora_linear(np.asarray(jy.astype(jnp.float32)), np.asarray(jx.astype(jnp.float32)), qa, qb,
                              None, 0.5, idx)
    assert oracle.rel_err(np.asarray(out.astype(jnp.float32)), want) <= oracle.TOL["bfloat16"]


def test_jax_stacked_lora_weights_reach_the_kernels_without_copies():
    """A fused q/k/v layer's A and B slices are pointers into the stacked weights (no slice ops in
    the compiled program), where separate slice arrays cut from the same stacks are copies; both
    give the same y."""
    import re

    jax = pytest.importorskip("jax")
    import jax.numpy as jnp

    import jax_lora
    from jax_lora import LoRAMapping
    if jax.default_backend() != "gpu":
        pytest.skip("JAX has no GPU here")
    rng = np.random.default_rng(0)
    L, R, H, slices, T = 4, 16, 256, (256, 128, 128), 24
    a = jnp.asarray(rng.standard_normal((3, L, R, H)) / 16, jnp.bfloat16)
    b = jnp.asarray(rng.standard_normal((L, sum(slices), R)) / 4, jnp.bfloat16)
    x = jnp.asarray(rng.standard_normal((T, H)), jnp.bfloat16)
    y = jnp.asarray(rng.standard_normal((T, sum(slices))), jnp.bfloat16)
    w = jax_lora.PunicaWrapper(64, 64, None, max_loras=L, backend="triton")
    ids = tuple(int(i) for i in rng.integers(0, L + 1, T))
    w.update_metadata(LoRAMapping(ids, ids), [1, 2, 3, 4], L + 1, 64)

    def stacked(y, x, a, b):
        return w.add_lora_linear_stacked(y, x, a, b, 1.0, slices)

    def separate(y, x, a, b):
        return w.add_lora_linear(y, x, tuple(a[s] for s in range(3)),
                                 (b[:, :256], b[:, 256:384], b[:, 384:]), None, 1.0, slices)

    slice_op = re.compile(r"\bslice\(")                    # the scheduled HLO prints no operand types
    hlo = {f.__name__: jax.jit(f).lower(y, x, a, b).compile().as_text() for f in (stacked, separate)}
    assert slice_op.search(hlo["separate"])                  # the check can see a copy
    assert not slice_op.search(hlo["stacked"]), [ln for ln in hlo["stacked"].splitlines() if "slice" in ln]
    assert np.array_equal(np.asarray(jax.jit(stacked)(y, x, a, b), np.float32),
                          np.asarray(jax.jit(separate)(y, x, a, b), np.float32))
