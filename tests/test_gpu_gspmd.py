"""GPU check of the GSPMD partitioning (marked `gpu`; needs 2 GPUs of one host): the Triton XLA FFI
call under a plain `jax.jit` with NamedSharding inputs runs per device like its math.

Column (B and y split along N), row (x and A split along K, one psum of the rank-r buffer) and token
splits of `add_lora_linear`, and the column split of `add_lora_linear_stacked` (Views of the stacked
weights): results equal the float64 oracle, the output sharding is the expected one, the compiled
program has no all-gather and only the row split's (1, T, r) all-reduce, and the FFI calls take the
local blocks. The same partitioning code runs on the CPU in tests/test_gspmd.py.
"""

from __future__ import annotations

import numpy as np
import pytest

from . import oracle
from .jax_helpers import hlo_collectives

pytestmark = pytest.mark.gpu

L, R, H, N, T = 4, 16, 256, 512, 32


def _setup():
    jax = pytest.importorskip("jax")
    pytest.importorskip("triton")
    gpus = [d for d in jax.devices() if d.platform == "gpu"]
    if len(gpus) < 2:
        pytest.skip(f"needs 2 GPUs of one host, found {len(gpus)}")
    from jax.sharding import Mesh
    return jax, Mesh(np.array(gpus[:2]), ("tp",))


@pytest.mark.parametrize("case", ["column", "row", "tokens", "column_stacked"])
def test_triton_ffi_splits_like_the_math(case):
    jax, mesh = _setup()
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from jax_lora import LoRAMapping, PunicaWrapper

    rng = np.random.default_rng(0)
    ids = tuple(int(i) for i in rng.integers(0, L + 1, T))
    x = (rng.standard_normal((T, H)) / np.sqrt(H)).astype(np.float32)
    y = rng.standard_normal((T, N)).astype(np.float32)
    a = (rng.standard_normal((L, R, H)) / np.sqrt(H)).astype(np.float32)
    b = (rng.standard_normal((L, N, R)) / np.sqrt(R)).astype(np.float32)
    want = oracle.lora_linear(y, x, [a], [b], None, 0.5, [i - 1 for i in ids])
    y_spec, x_spec, a_spec, b_spec, out_spec, expected = {
        "column": (P(None, "tp"), P(), P(), P(None, "tp"), P(None, "tp"), []),
        "column_stacked": (P(None, "tp"), P(), P(), P(None, "tp"), P(None, "tp"), []),
        "row": (P(), P(None, "tp"), P(None, None, "tp"), P(), P(), [("all-reduce", f"f32[1,{T},{R}]")]),
        "tokens": (P("tp"), P("tp"), P(), P(), P("tp"), []),
    }[case]
    w = PunicaWrapper(T, 8, NamedSharding(mesh, P()), max_loras=L, backend="triton")
    w.update_metadata(LoRAMapping(ids, ids), list(range(1, L + 1)), L + 1, 1000)

    def put(v, spec):
        return jax.device_put(jnp.asarray(v), NamedSharding(mesh, spec))

    if case == "column_stacked":
        a, a_spec = a[None], P(None, *a_spec)

        def step(w, y, x, a, b):
            return w.add_lora_linear_stacked(y, x, a, b, 0.5, (N,))
    else:
        def step(w, y, x, a, b):
            return w.add_lora_linear(y, x, (a,), (b,), None, 0.5, (N,))

    args = (w, put(y, y_spec), put(x, x_spec), put(a, a_spec), put(b, b_spec))
    jitted = jax.jit(step)
    got = jitted(*args)
    assert oracle.rel_err(np.asarray(got), want) < 1e-4
    assert got.sharding.spec == out_spec
    hlo = jitted.lower(*args).compile().as_text()
    assert sorted(hlo_collectives(hlo)) == sorted(expected)
    if case.startswith("column"):
        calls = [line for line in hlo.splitlines() if "custom-call(" in line]
        assert any(f"f32[{T},{N // 2}]" in c for c in calls) and not any(f"f32[{L},{N},{R}]" in c for c in calls)
