"""GPU checks of several adapters per token (marked `gpu`; run on the device machine).

- The compiled Triton PAIRS kernels (torch launcher) in bfloat16 at decode and prefill sizes, k = 1
  (weighted), 2 and 4, against the float64 oracle (contract section 4's bfloat16 tolerance).
- The torch wrapper with a paired step captured in one CUDA graph: a later step of the same pair
  bucket, replayed without re-capture, gives that step's result (the pair block's addresses stay).
- The JAX wrapper's paired `add_lora_linear` under `jax.jit` through the XLA FFI launcher, one
  compilation per pair bucket.
"""

from __future__ import annotations

import numpy as np
import pytest

from lora_core.adapter_pairs import AdapterPairs, build_pairs_host
from lora_core.host_mapping import LoRAMapping
from lora_core.kernel_meta import KernelMeta

from . import oracle

pytestmark = pytest.mark.gpu


def _pairs_case(seed, tokens, hidden, rank, widths, slots_n, k):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((tokens, hidden)).astype(np.float32)
    a = [(rng.standard_normal((slots_n, rank, hidden)) / np.sqrt(hidden)).astype(np.float32) for _ in widths]
    b = [(rng.standard_normal((slots_n, n, rank)) / np.sqrt(rank)).astype(np.float32) for n in widths]
    requests = max(1, tokens // 16)
    combos = [rng.choice(slots_n, size=int(rng.integers(1, k + 1)), replace=False) for _ in range(requests)]
    slots = np.full((tokens, k), -1, np.int64)
    weights = np.zeros((tokens, k), np.float32)
    owner = rng.integers(0, requests, tokens)
    for t in range(tokens):
        if t % 7 == 3:
            continue                                              # some tokens without adapters
        c = combos[owner[t]]
        slots[t, :len(c)] = c
        weights[t, :len(c)] = rng.uniform(0.25, 1.5, len(c))
    y = rng.standard_normal((tokens, sum(widths))).astype(np.float32)
    return x, a, b, slots, weights, y


def _round(v):
    import ml_dtypes
    return np.asarray(v, np.float32).astype(ml_dtypes.bfloat16).astype(np.float32)


@pytest.mark.parametrize("tokens", [1, 8, 128, 2048])
@pytest.mark.parametrize("k", [1, 2, 4])
@pytest.mark.parametrize("rank", [16, 64])
def test_compiled_pair_kernels_bf16(tokens, k, rank):
    torch = pytest.importorskip("torch")
    from torch_lora.ops import triton as tt
    widths = (1024, 256, 256)
    x, a, b, slots, weights, y = _pairs_case(tokens + k + rank, tokens, 1024, rank, widths, 8, k)
    x, a, b, y = _round(x), [_round(v) for v in a], [_round(v) for v in b], _round(y)
    meta, pairs = build_pairs_host(slots, weights, max(8, tokens), tokens)
    dev = torch.device("cuda")
    m = KernelMeta(*(torch.from_numpy(np.ascontiguousarray(v)).to(dev) for v in meta))
    p = AdapterPairs(torch.from_numpy(pairs.slots).to(dev), torch.from_numpy(pairs.weights).to(dev))
    bf = lambda v: torch.from_numpy(v).to(dev, torch.bfloat16)
    yt = bf(y)
    tt.linear(yt, bf(x), [bf(v) for v in a], [bf(v) for v in b], m, 0.5, (0, 1024, 1280), None, None, pairs=p)
    want = oracle.multi_lora_linear(y, x, a, b, 0.5, slots, weights)
    assert oracle.rel_err(yt.float().cpu().numpy(), want) <= oracle.TOL["bfloat16"]


def test_torch_wrapper_paired_step_in_a_cuda_graph():
    torch = pytest.importorskip("torch")
    import torch_lora
    dev = torch.device("cuda")
    x, a, b, slots, weights, y = _pairs_case(1, 32, 512, 16, (256, 128), 4, 2)
    ids = [21, 22, 23, 24]

    def mapping(slots, weights):
        entries = [tuple(ids[s] for s in row if s >= 0) for row in slots]
        ws = [tuple(float(w) for s, w in zip(row, wr) if s >= 0) for row, wr in zip(slots, weights)]
        return LoRAMapping(entries, entries[:4], False, ws, ws[:4])

    w = torch_lora.PunicaWrapper(64, 16, dev, max_loras=4, backend="triton")
    w.update_metadata(mapping(slots, weights), ids, 5, 32000)
    ta = tuple(torch.from_numpy(v[:, None]).to(dev) for v in a)
    tb = tuple(torch.from_numpy(v[:, None]).to(dev) for v in b)
    tx, ty = torch.from_numpy(x).to(dev), torch.from_numpy(y).to(dev)
    out = ty.clone()
    w.add_lora_linear(out, tx, ta, tb, None, 0.5, (256, 128))          # compiles outside the graph
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out.copy_(ty)
        w.add_lora_linear(out, tx, ta, tb, None, 0.5, (256, 128))
    slots2 = np.roll(slots, 5, axis=0)
    weights2 = np.roll(weights, 5, axis=0) * 0.5
    w.update_metadata(mapping(slots2, weights2), ids, 5, 32000)     # same bucket: same block
    g.replay()
    torch.cuda.synchronize()
    want = oracle.multi_lora_linear(y, x, a, b, 0.5, slots2, weights2)
    assert oracle.rel_err(out.cpu().numpy(), want) <= 1e-3           # tf32 dots on the GPU


def test_jax_wrapper_paired_step_under_jit():
    jax = pytest.importorskip("jax")
    if jax.default_backend() != "gpu":
        pytest.skip("needs a JAX GPU")
    import jax.numpy as jnp

    import jax_lora
    x, a, b, slots, weights, y = _pairs_case(2, 24, 512, 16, (256,), 4, 4)
    ids = [5, 6, 7, 8]
    entries = [tuple(ids[s] for s in row if s >= 0) for row in slots]
    ws = [tuple(float(w) for s, w in zip(row, wr) if s >= 0) for row, wr in zip(slots, weights)]
    w = jax_lora.PunicaWrapper(32, 8, max_loras=4, backend="triton")
    w.update_metadata(LoRAMapping(entries, [()], False, ws, [()]), ids, 5, 32000)
    step = jax.jit(lambda w, y, x: w.add_lora_linear(y, x, (jnp.asarray(a[0]),), (jnp.asarray(b[0]),), None, 0.5,
                                                     (256,)))
    got = np.asarray(step(w, jnp.asarray(y), jnp.asarray(x)))
    assert oracle.rel_err(got, oracle.multi_lora_linear(y, x, a, b, 0.5, slots, weights)) <= 1e-3
    w.update_metadata(LoRAMapping(entries[::-1], [()], False, ws[::-1], [()]), ids, 5, 32000)
    got = np.asarray(step(w, jnp.asarray(y), jnp.asarray(x)))
    assert step._cache_size() == 1                                     # one program per pair bucket
    want = oracle.multi_lora_linear(y, x, a, b, 0.5, slots[::-1], weights[::-1])
    assert oracle.rel_err(got, want) <= 1e-3
