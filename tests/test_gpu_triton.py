"""GPU tests of the Triton kernels (marked `gpu`; run on the lent H200 with PYTHONPATH=.).

Compiled kernels (not the interpreter) against a float64 reference: torch launches (shrink, expand,
linear fused and two-kernel), CUDA-graph capture then replay with changed mappings, a vLLM-scale
sweep (ranks 1-256, 1-128 adapters, 1-3 slices, hidden sizes that are not multiples of the block
sizes), heterogeneous ranks, and the JAX backend under jax.jit through jax_triton.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from .cuda_cases import linear_problem, ref_linear  # noqa: E402

pytestmark = pytest.mark.gpu

TOL = {torch.float32: 1e-3, torch.float16: 5e-3, torch.bfloat16: 2e-2}


def _err(got, ref):
    got = got.double()
    assert not torch.isnan(got).any()
    return float(torch.linalg.norm(got - ref) / torch.linalg.norm(ref))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("ranks", [False, True])
def test_linear(dtype, fused, ranks):
    from torch_lora.ops import triton as torch_triton
    T, H, R, widths, L = 37, 1000, 32, (520, 130, 130), 6
    x, a, b, idx, meta, rk, c = linear_problem(T, H, R, widths, L, 5, dtype, 1, ranks=ranks, bias=True)
    N = sum(widths) + 10
    y = torch.randn(T, N, device="cuda").to(dtype)
    offsets = (10, 530, 660)
    ref = ref_linear(y, x, a, b, idx, 0.7, offsets, None if rk is None else rk.cpu(), c)
    y2 = y.clone()
    torch_triton.linear(y2, x, a, b, meta.meta_args(T), 0.7, offsets, rk, c, fused=fused)
    assert _err(y2, ref) < TOL[dtype]
    none = torch.from_numpy(idx < 0).cuda()
    assert torch.equal(y2[none], y[none])            # rows without LoRA untouched, bit for bit
    assert torch.equal(y2[:, :10], y[:, :10])        # columns outside the slices untouched


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_shrink_expand(dtype):
    from torch_lora.ops import triton as torch_triton
    T, H, R, widths, L = 64, 4096 + 24, 16, (4096, 1024, 1024), 8
    x, a, b, idx, meta, rk, _ = linear_problem(T, H, R, widths, L, 8, dtype, 2)
    buf = torch.full((3, T, R), float("nan"), device="cuda")
    torch_triton.shrink(x, a, buf, meta.meta_args(T), 0.5, None)
    sel = torch.from_numpy(np.maximum(idx, 0)).cuda()
    ref = torch.stack([0.5 * torch.einsum("th,trh->tr", x.double(), aa[sel].double()) for aa in a])
    ref[:, torch.from_numpy(idx < 0).cuda()] = 0
    assert _err(buf, ref) < 1e-3
    y = torch.randn(T, sum(widths), device="cuda").to(dtype)
    y2 = y.clone()
    torch_triton.expand(buf, b, y2, meta.meta_args(T), (0, 4096, 5120), False, None, None)
    yr = y.double().clone()
    for s, (bb, off) in enumerate(zip(b, (0, 4096, 5120))):
        d = torch.einsum("tr,tnr->tn", buf[s].double(), bb[sel].double())
        m = torch.from_numpy(idx >= 0).cuda()
        yr[m, off:off + bb.shape[1]] = d[m]
    assert _err(y2, yr) < TOL[dtype]


SWEEP = [  # (T, H, rank, widths, slots, adapters, kind)
    (1, 4096, 1, (4096,), 8, 1, "dec"), (7, 3000, 8, (3000, 500, 500), 16, 7, "dec"),
    (33, 5120, 16, (5120,), 32, 32, "dec"), (128, 4096, 64, (4096, 1024, 1024), 64, 64, "dec"),
    (200, 2000, 128, (2000, 300, 300), 128, 128, "dec"), (512, 4096, 256, (4096,), 8, 8, "dec"),
    (77, 1234, 33, (999, 111), 5, 3, "dec"), (1000, 4096, 16, (4096, 1024, 1024), 16, 4, "pre"),
    (3000, 2880, 64, (2880, 720), 8, 3, "pre"), (4096, 4096, 256, (4096,), 4, 2, "pre"),
    (8192, 4096, 16, (4096,), 8, 1, "pre"), (8192, 4096, 64, (4096, 1024, 1024), 8, 4, "pre"),
]


@pytest.mark.parametrize("case", SWEEP, ids=[f"T{c[0]}-H{c[1]}-r{c[2]}-S{len(c[3])}-L{c[4]}" for c in SWEEP])
def test_vllm_scale_sweep(case):
    from torch_lora.ops import triton as torch_triton
    T, H, R, widths, L, D, kind = case
    x, a, b, idx, meta, rk, c = linear_problem(T, H, R, widths, L, D, torch.bfloat16, 3, kind=kind)
    y = torch.randn(T, sum(widths), device="cuda").to(torch.bfloat16)
    offsets = tuple(int(v) for v in np.cumsum((0,) + widths)[:-1])
    ref = ref_linear(y, x, a, b, idx, 1.0, offsets)
    for fused in (False, True):
        y2 = y.clone()
        torch_triton.linear(y2, x, a, b, meta.meta_args(T), 1.0, offsets, None, None, fused=fused)
        assert _err(y2, ref) < 2e-2, fused


def test_graph_capture_replay_with_new_mappings():
    """Capture once, then change the mapping in place (prepare_tensors) and replay: new results."""
    from torch_lora.ops import triton as torch_triton
    T, H, R, widths, L = 24, 2048, 16, (2048, 512, 512), 8
    for fused in (False, True):
        x, a, b, idx, meta, rk, _ = linear_problem(T, H, R, widths, L, 6, torch.bfloat16, 4)
        y = torch.randn(T, sum(widths), device="cuda").to(torch.bfloat16)
        offsets = (0, 2048, 2560)
        work = y.clone()
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            torch_triton.linear(work, x, a, b, meta.meta_args(T), 0.5, offsets, None, None, fused=fused)
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            torch_triton.linear(work, x, a, b, meta.meta_args(T), 0.5, offsets, None, None, fused=fused)
        rng = np.random.default_rng(5)
        for trial in range(4):
            new_idx = rng.integers(-1, L, T).astype(np.int32)
            if trial == 3:
                new_idx[:] = -1                          # the no-LoRA case, decided on the device
            meta.prepare_tensors(torch.from_numpy(new_idx).cuda())
            work.copy_(y)
            g.replay()
            torch.cuda.synchronize()
            ref = ref_linear(y, x, a, b, new_idx, 0.5, offsets)
            assert _err(work, ref) < 2e-2, (fused, trial)


@pytest.mark.parametrize("c_launch", [True, False])
@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("ranks", [False, True])
def test_prepared_linear_direct_path(fused, ranks, c_launch, monkeypatch):
    """PreparedLinear (the wrapper's per-layer launcher): after its first call every call goes
    through the direct path -- launched from C (lora_core/kernels/cuda_launch.c) or through
    Triton's launcher -- with new x, y, scale and lora_ranks, bit-equal to `linear`; captured in
    a graph it follows in-place mapping changes; misaligned or differently laid out activations
    take the generic path, still correct."""
    from torch_lora.ops import c_launch as torch_c_launch
    from torch_lora.ops import triton as torch_triton
    monkeypatch.setattr(torch_c_launch, "_ENABLED", [c_launch])
    T, H, R, widths, L = 24, 1000, 32, (520, 130, 130), 6
    x, a, b, idx, meta, rk, c = linear_problem(T, H, R, widths, L, 5, torch.bfloat16, 7, ranks=ranks, bias=True)
    offsets = (0, 520, 650)
    run = torch_triton.PreparedLinear(a, b, meta.meta_args(T), offsets, c, fused=fused)
    g = torch.Generator(device="cuda").manual_seed(8)
    for call in range(4):
        xs = torch.randn(T, H, device="cuda", generator=g).to(torch.bfloat16)
        ys = torch.randn(T, sum(widths), device="cuda", generator=g).to(torch.bfloat16)
        rks = None if rk is None else torch.randint(0, R + 1, (L,), device="cuda", generator=g, dtype=torch.int32)
        scale = 0.25 + call
        want = ys.clone()
        torch_triton.linear(want, xs, a, b, meta.meta_args(T), scale, offsets, rks, c, fused=fused)
        got = ys.clone()
        run(got, xs, scale, rks)
        assert run._steps is not None, "the direct path was not built"
        assert (run._c_steps is not None) == c_launch, "the C launches were not built"
        assert torch.equal(got, want), call
        ref = ref_linear(ys, xs, a, b, idx, scale, offsets, None if rks is None else rks.cpu(), c)
        assert _err(got, ref) < 2e-2
    # misaligned x (2 bytes off a 16-byte boundary) and another layout: generic path, same result
    big = torch.randn(T * H + 1, device="cuda").to(torch.bfloat16)
    xm = big[1:].view(T, H)
    for xx, yy in ((xm, ys), (xs[:, :], torch.randn(T, 2 * sum(widths), device="cuda").to(torch.bfloat16)[:, ::2])):
        want, got = yy.clone(), yy.clone()
        torch_triton.linear(want, xx, a, b, meta.meta_args(T), 0.5, offsets, rks, c, fused=fused)
        run(got, xx, 0.5, rks)
        assert torch.equal(got, want)
    # captured in a CUDA graph, replayed after in-place mapping changes
    work = ys.clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run(work, xs, 0.5, rks)
    rng = np.random.default_rng(9)
    for trial in range(3):
        new_idx = rng.integers(-1, L, T).astype(np.int32)
        meta.prepare_tensors(torch.from_numpy(new_idx).cuda())
        work.copy_(ys)
        graph.replay()
        torch.cuda.synchronize()
        ref = ref_linear(ys, xs, a, b, new_idx, 0.5, offsets, None if rks is None else rks.cpu(), c)
        assert _err(work, ref) < 2e-2, trial


@pytest.mark.parametrize("fused", [False, True])
def test_chained_calls_wait_for_the_previous_kernel(fused):
    """Programmatic dependent launch: each call's shrink (or fused kernel) may be scheduled while the
    previous call still runs -- reading metadata and prefetching weights -- and must wait for it
    (gdc_wait) before reading x. Chain 12 calls where x of call i+1 is y of call i, eagerly and in a
    CUDA graph, and compare bit for bit with the same chain synchronised after every call (no
    overlap possible)."""
    from torch_lora.ops import triton as torch_triton
    T, H, R, L = 16, 2048, 16, 4
    x, a, b, idx, meta, _, _ = linear_problem(T, H, R, (H,), L, 4, torch.bfloat16, 12, frac_none=0.0)
    ys0 = [torch.randn(T, H, device="cuda").to(torch.bfloat16) for _ in range(12)]

    def chain(ys, sync):
        prev = x
        for y in ys:
            torch_triton.linear(y, prev, a, b, meta.meta_args(T), 0.5, (0,), fused=fused)
            if sync:
                torch.cuda.synchronize()
            prev = y
        return ys

    want = chain([y.clone() for y in ys0], sync=True)
    got = chain([y.clone() for y in ys0], sync=False)
    torch.cuda.synchronize()
    for i, (g_, w_) in enumerate(zip(got, want)):
        assert torch.equal(g_, w_), i
    work = [y.clone() for y in ys0]
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        chain(work, sync=False)
    for _ in range(3):
        for w_, y in zip(work, ys0):
            w_.copy_(y)
        graph.replay()
        torch.cuda.synchronize()
        for i, (g_, w_) in enumerate(zip(work, want)):
            assert torch.equal(g_, w_), i


@pytest.mark.parametrize("fused", [False, True])
def test_prepared_linears_share_the_stream_workspace(fused):
    """Every PreparedLinear on a stream uses that stream's one workspace (`_workspace_buffer`): a
    call's first kernel writes it only after the previous call's last kernel completed. Chain 12
    calls of two layers with different workspace sizes (rank 16 with three slices, rank 64 with
    one), x of call i+1 = y of call i, on two streams at once, eagerly and in a CUDA graph, and
    compare bit for bit with `linear` (fresh workspaces) synchronised after every call."""
    from torch_lora.ops import triton as torch_triton
    T, H, L = 16, 2048, 4
    widths3 = (1024, 512, 512)
    _, a16, b16, idx, meta, _, _ = linear_problem(T, H, 16, widths3, L, 4, torch.bfloat16, 21, frac_none=0.1)
    _, a64, b64, _, _, _, _ = linear_problem(T, H, 64, (H,), L, 4, torch.bfloat16, 22)
    layers = [(a16, b16, (0, 1024, 1536)), (a64, b64, (0,))]
    preps = [torch_triton.PreparedLinear(a, b, meta.meta_args(T), off, fused=fused) for a, b, off in layers]
    streams = [torch.cuda.current_stream(), torch.cuda.Stream()]
    x0s = [torch.randn(T, H, device="cuda").to(torch.bfloat16) for _ in streams]
    ys0 = [[torch.randn(T, H, device="cuda").to(torch.bfloat16) for _ in range(12)] for _ in streams]

    def chain(x, ys, prepared):
        prev = x
        for i, y in enumerate(ys):
            a, b, off = layers[i % 2]
            if prepared:
                preps[i % 2](y, prev, 0.5)
            else:
                torch_triton.linear(y, prev, a, b, meta.meta_args(T), 0.5, off, fused=fused)
                torch.cuda.synchronize()
            prev = y

    want = [[y.clone() for y in ys] for ys in ys0]
    for x, ys in zip(x0s, want):
        chain(x, ys, prepared=False)
    for ys in ys0:                                         # first calls: compile, build the direct path
        chain(x0s[0], [y.clone() for y in ys], prepared=True)
    torch.cuda.synchronize()
    assert all(p._steps is not None for p in preps)
    got = [[y.clone() for y in ys] for ys in ys0]
    torch.cuda.synchronize()
    for stream, x, ys in zip(streams, x0s, got):           # both chains in flight at once
        with torch.cuda.stream(stream):
            chain(x, ys, prepared=True)
    torch.cuda.synchronize()
    assert len({(k, v.data_ptr()) for k, v in torch_triton._WORKSPACES.items() if k[0] == x0s[0].device.index}) >= 2
    for c, (g_, w_) in enumerate(zip(got, want)):
        for i, (gi, wi) in enumerate(zip(g_, w_)):
            assert torch.equal(gi, wi), (c, i)
    work = [y.clone() for y in ys0[0]]
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        chain(x0s[0], work, prepared=True)
    for _ in range(2):
        for w_, y in zip(work, ys0[0]):
            w_.copy_(y)
        graph.replay()
        torch.cuda.synchronize()
        for i, (gi, wi) in enumerate(zip(work, want[0])):
            assert torch.equal(gi, wi), i


_TRAP_CHILD = """
import math, torch
import lora_core.kernels as kernels
kernels.BARRIER_POLL_LIMIT = 1 << 12                  # give up after ~ms, not seconds
from torch_lora.meta import LoRAKernelMeta
from torch_lora.ops import triton as torch_triton
T, H, L = 8, 1024, 4
g = torch.Generator(device="cuda").manual_seed(0)
x = torch.randn(T, H, device="cuda", generator=g).to(torch.bfloat16)
a = [(torch.randn(L, 16, H, device="cuda", generator=g) / math.sqrt(H)).to(torch.bfloat16)]
b = [(torch.randn(L, H, 16, device="cuda", generator=g) / 4).to(torch.bfloat16)]
meta = LoRAKernelMeta.make(L, T + 5, "cuda")
meta.prepare_tensors(torch.arange(T, device="cuda", dtype=torch.int32) % L)
y = torch.zeros(T, H, device="cuda", dtype=torch.bfloat16)
torch_triton.linear(y, x, a, b, meta.meta_args(T), 1.0, (0,), fused=True)
torch.cuda.synchronize()
print("FIRST OK", float(y.float().abs().sum()) > 0, flush=True)
for buf in torch_triton._SYNC_BUFFERS.values():
    buf.fill_(1)                                # not a multiple of BARRIER_SPAN: no launch completes it
torch_triton.linear(y, x, a, b, meta.meta_args(T), 1.0, (0,), fused=True)
try:
    torch.cuda.synchronize()
    print("NO ERROR", flush=True)
except RuntimeError as e:
    print("TRAPPED", str(e).splitlines()[0], flush=True)
"""


def test_prepared_linear_spreads_a_dependent_decode_shrink(monkeypatch):
    """Under LORA_CORE_PDL=auto the C launcher sends a shrink of <= spread_pdl_max_tokens tokens
    out as a programmatic dependent with planning.spread_shared_bytes (its programs spread over
    the SMs) and a larger call's shrink plainly with its own shared memory, on this device's real
    compiled kernels; a chain of such calls (x of call i+1 = y of call i) equals `linear`
    synchronised after every call, bit for bit."""
    from lora_core.kernels import HAVE_PDL, configs, cuda_launch, planning
    from torch_lora.ops import c_launch as torch_c_launch
    from torch_lora.ops import triton as torch_triton
    if not HAVE_PDL or torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("programmatic dependent launch needs Hopper or newer")
    monkeypatch.delenv("LORA_CORE_PDL", raising=False)
    monkeypatch.setattr(torch_c_launch, "_ENABLED", [True])
    H, L = 4096, 8
    num_sms, max_shared = torch_c_launch.sm_resources(torch.cuda.current_device())
    SPREAD_MAX = configs.launch_policy().spread_pdl_max_tokens
    for T in (8, SPREAD_MAX, 64):
        x, a, b, idx, meta, _, _ = linear_problem(T, H, 16, (H,), L, 8, torch.bfloat16, 30 + T, frac_none=0.0)
        run = torch_triton.PreparedLinear(a, b, meta.meta_args(T), (0,), fused=False)
        ys0 = [torch.randn(T, H, device="cuda").to(torch.bfloat16) for _ in range(6)]
        want, prev = [y.clone() for y in ys0], x
        for y in want:
            torch_triton.linear(y, prev, a, b, meta.meta_args(T), 0.5, (0,), fused=False)
            torch.cuda.synchronize()
            prev = y
        run(ys0[0].clone(), x, 0.5)                        # first call: compiles, builds the C launches
        assert run._c_steps is not None
        specs = {}
        for _ws, launches in run._steps:
            for _run, g0, g1, g2, fn, _p, template, slots, compiled, names, plan in launches:
                specs[plan.KERNEL] = (plan, (g0, g1, g2), torch_c_launch.launch_spec(
                    cuda_launch, compiled, names, template, dict(slots), (g0, g1, g2), fn, plan,
                    torch.cuda.current_device()), int(compiled.metadata.shared))
        plan, grid, spec, own = specs["shrink"]
        if T <= SPREAD_MAX:
            assert spec[4] & cuda_launch.FLAG_PDL, T
            assert spec[3] == planning.spread_shared_bytes(grid[0] * grid[1] * grid[2], own, num_sms, max_shared), T
        else:
            assert (spec[3], spec[4] & cuda_launch.FLAG_PDL) == (own, 0), T
        assert specs["expand"][2][4] & cuda_launch.FLAG_PDL
        got, prev = [y.clone() for y in ys0], x
        for y in got:
            run(y, prev, 0.5)
            prev = y
        torch.cuda.synchronize()
        for i, (g_, w_) in enumerate(zip(got, want)):
            assert torch.equal(g_, w_), (T, i)


def test_fused_barrier_that_cannot_complete_fails_instead_of_hanging():
    """The fused kernel's barrier wait is bounded (`lora_triton.BARRIER_POLL_LIMIT`): with its
    counters corrupted so that no launch can complete it, the launch must fail with a CUDA error
    (PTX trap) within the poll limit, not hang. In a child process: the error poisons its context."""
    import os
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-c", _TRAP_CHILD], env=env, cwd=root, capture_output=True,
                          text=True, timeout=300)
    out = proc.stdout + proc.stderr[-2000:]
    assert "FIRST OK True" in proc.stdout, out
    assert "TRAPPED" in proc.stdout, out


def test_wrapper_add_lora_linear_many_steps():
    """The torch wrapper's cached per-layer launchers across steps of changing mappings and token
    counts (bucketed decode sizes and a prefill), against the float64 reference."""
    import torch_lora
    H, R, widths, L = 512, 16, (512, 128, 128), 4
    g = torch.Generator(device="cuda").manual_seed(10)
    a = [(torch.randn(L, 1, R, H, device="cuda", generator=g) / math.sqrt(H)).to(torch.bfloat16) for _ in widths]
    b = [(torch.randn(L, 1, n, R, device="cuda", generator=g) / math.sqrt(R)).to(torch.bfloat16) for n in widths]
    ids = [21, 22, 23, 24]
    w = torch_lora.PunicaWrapper(256, 16, torch.device("cuda"), max_loras=L, backend="triton")
    rng = np.random.default_rng(11)
    for step, T in enumerate((8, 8, 16, 8, 200, 16, 8)):
        idx = rng.integers(-1, L, T).astype(np.int32)
        if T > 16:
            idx = np.sort(idx)                       # a prefill: each adapter's tokens contiguous
        mapping = torch_lora.LoRAMapping(tuple(0 if i < 0 else ids[i] for i in idx),
                                         tuple(0 if i < 0 else ids[i] for i in idx), is_prefill=T > 16)
        w.update_metadata(mapping, ids, L, 1000)
        x = torch.randn(T, H, device="cuda", generator=g).to(torch.bfloat16)
        y = torch.randn(T, sum(widths), device="cuda", generator=g).to(torch.bfloat16)
        y0 = y.clone()
        w.add_lora_linear(y, x, a, b, None, 0.5, widths)
        ref = ref_linear(y0, x, [t[:, 0] for t in a], [t[:, 0] for t in b], idx, 0.5, (0, 512, 640))
        assert _err(y, ref) < 2e-2, (step, T)


def test_heterogeneous_ranks_equal_padded():
    from torch_lora.ops import triton as torch_triton
    T, H, R, widths, L = 96, 4096, 64, (4096, 1024, 1024), 8
    x, a, b, idx, meta, _, _ = linear_problem(T, H, R, widths, L, 8, torch.bfloat16, 6, frac_none=0.0)
    ranks = torch.tensor([8, 16, 32, 64, 8, 16, 32, 64], dtype=torch.int32, device="cuda")
    pa, pb = [aa.clone() for aa in a], [bb.clone() for bb in b]
    for l in range(L):
        k = int(ranks[l])
        for aa, bb in zip(pa, pb):
            aa[l, k:] = 0
            bb[l, :, k:] = 0
    y = torch.randn(T, sum(widths), device="cuda").to(torch.bfloat16)
    offsets = (0, 4096, 5120)
    y1, y2 = y.clone(), y.clone()
    torch_triton.linear(y1, x, a, b, meta.meta_args(T), 1.0, offsets, ranks, None)
    torch_triton.linear(y2, x, pa, pb, meta.meta_args(T), 1.0, offsets, None, None)
    assert _err(y1, y2.double()) < 1e-2


@pytest.fixture(params=["ffi", "jax_triton"])
def jax_launcher(request, monkeypatch):
    """The JAX side's two launchers: the FFI handler (default) and jax_triton's custom call."""
    pytest.importorskip("jax")
    from jax_lora.ops import ffi_launcher
    if request.param == "jax_triton":
        pytest.importorskip("jax_triton")
    monkeypatch.setenv("JAX_LORA_TRITON_LAUNCHER", request.param)
    ffi_launcher.unavailable_reason.cache_clear()
    # on a CUDA GPU the FFI launcher must really be used (no silent fallback to jax_triton)
    assert ffi_launcher.available() == (request.param == "ffi")
    yield request.param
    ffi_launcher.unavailable_reason.cache_clear()


@pytest.mark.parametrize("fused", [False, True])
def test_jax_triton_under_jit(fused, jax_launcher):
    import jax
    import jax.numpy as jnp

    from jax_lora.meta import LoRAKernelMeta as JMeta
    from jax_lora.ops import triton as jax_triton_backend
    T, H, R, widths, L = 40, 1500, 16, (1500, 300, 300), 8
    x, a, b, idx, meta, rk, c = linear_problem(T, H, R, widths, L, 6, torch.bfloat16, 7, ranks=True, bias=True)
    y = torch.randn(T, sum(widths), device="cuda").to(torch.bfloat16)
    offsets = (0, 1500, 1800)
    ref = ref_linear(y, x, a, b, idx, 0.5, offsets, rk.cpu(), c)
    j = lambda t: jnp.from_dlpack(t.contiguous())
    jm = JMeta.build(jnp.asarray(idx), L, T + 3)
    ja, jb = tuple(j(t) for t in a), tuple(j(t) for t in b)
    jc = tuple(None if t is None else j(t) for t in c)
    f = jax.jit(lambda y_, x_, m_: jax_triton_backend.linear(y_, x_, ja, jb, m_, 0.5, offsets, j(rk), jc, fused=fused))
    out = f(j(y), j(x), jm)
    assert _err(torch.from_dlpack(out), ref) < 2e-2
    # shrink + expand separately, through the dispatch contract
    buf = jax.jit(lambda x_, m_: jax_triton_backend.shrink(x_, ja, m_, 0.5, j(rk)))(j(x), jm)
    y3 = jax.jit(lambda b_, y_, m_: jax_triton_backend.expand(b_, jb, y_, m_, offsets, True, j(rk), jc))(buf, j(y), jm)
    assert _err(torch.from_dlpack(y3), ref) < 2e-2


def test_jax_chained_calls_under_jit_match_separate_calls(jax_launcher):
    """JAX: 12 chained add_lora_linear calls (x of call i+1 = y of call i) in one jitted, unrolled
    scan -- where XLA may record the calls into a command buffer and the FFI launcher runs the
    expand as a programmatic dependent of the shrink -- equal bit for bit the same chain run as
    separate jitted calls, each waited for."""
    import jax
    import jax.numpy as jnp

    from jax_lora.meta import LoRAKernelMeta as JMeta
    from jax_lora.ops import triton as jax_triton_backend
    T, H, R, L, steps = 16, 2048, 16, 4, 12
    x, a, b, idx, _, _, _ = linear_problem(T, H, R, (H,), L, 4, torch.bfloat16, 13, frac_none=0.0)
    j = lambda t: jnp.from_dlpack(t.contiguous())
    jm = JMeta.build(jnp.asarray(idx), L, T)
    ja, jb = (j(a[0]),), (j(b[0]),)
    ys = jnp.asarray(np.random.default_rng(13).standard_normal((steps, T, H)), jnp.bfloat16)
    one = jax.jit(lambda y_, x_, m_: jax_triton_backend.linear(y_, x_, ja, jb, m_, 0.5, (0,)))
    want, prev = [], j(x)
    for i in range(steps):
        prev = one(ys[i], prev, jm).block_until_ready()
        want.append(prev)

    @jax.jit
    def chain(ys_, x_, m_):
        def body(prev_, y_):
            out = jax_triton_backend.linear(y_, prev_, ja, jb, m_, 0.5, (0,))
            return out, out
        return jax.lax.scan(body, x_, ys_, unroll=True)[1]

    for _ in range(3):
        got = chain(ys, j(x), jm)
        for i in range(steps):
            assert bool(jnp.array_equal(got[i], want[i])), i


def _table_feature_cases():
    """(T, rank, slots, slices) shapes, one per distinct (shrink, expand) config of the tuned table
    that uses a multi-tile expand (TILES_N, Y_AHEAD, L2 prefetch) or a variant (slot / slice count)."""
    from lora_core.kernels import configs
    seen, cases = set(), []
    for T in (8, 32, 128, 512, 2048, 8192):
        for R in (16, 64):
            for L in (8, 64):
                for S in (1, 3):
                    e = configs.expand_config(T, 4096, R, S, L)
                    special = (e.get("TILES_N", 1) > 1 or e.get("PREFETCH") or e.get("PREFETCH_Y")
                               or configs.current_table().variant(T, R, L, S))
                    key = (str(sorted(configs.shrink_config(T, 4096, R, S, L).items())), str(sorted(e.items())))
                    if special and key not in seen and not configs.use_fused(T, R, S, L):
                        seen.add(key)
                        cases.append((T, R, L, S))
    return cases


@pytest.mark.parametrize("case", _table_feature_cases(), ids=lambda c: f"T{c[0]}-r{c[1]}-L{c[2]}-S{c[3]}")
def test_tuned_table_multi_tile_configs_torch_and_jax(case):
    """Every distinct table config with several output tiles per expand program (workspace rows
    summed once, slices padded), the next y ahead, the B / y L2 prefetch, or a slot/slice variant:
    torch and JAX (FFI launcher, under jit) against float64, with the table's own launch configs."""
    import jax
    import jax.numpy as jnp

    from jax_lora.meta import LoRAKernelMeta as JMeta
    from jax_lora.ops import triton as jax_triton_backend
    from torch_lora.ops import triton as torch_triton
    T, R, L, S = case
    widths = (4096,) if S == 1 else (4096, 1024, 1024)
    D = min(L, 8 if T >= 2048 else L)
    x, a, b, idx, meta, _, _ = linear_problem(T, 4096, R, widths, L, D, torch.bfloat16, 17,
                                              kind="pre" if T >= 2048 else "dec")
    y = torch.randn(T, sum(widths), device="cuda").to(torch.bfloat16)
    offsets = tuple(int(v) for v in np.cumsum((0,) + widths)[:-1])
    ref = ref_linear(y, x, a, b, idx, 0.5, offsets)
    y_t = y.clone()
    torch_triton.linear(y_t, x, a, b, meta.meta_args(T), 0.5, offsets)
    assert _err(y_t, ref) < 2e-2
    j = lambda t: jnp.from_dlpack(t.contiguous())
    jm = JMeta.build(jnp.asarray(idx), L, T)
    ja, jb = tuple(j(t) for t in a), tuple(j(t) for t in b)
    out = jax.jit(lambda y_, x_, m_: jax_triton_backend.linear(y_, x_, ja, jb, m_, 0.5, offsets))(j(y), j(x), jm)
    assert _err(torch.from_dlpack(out), ref) < 2e-2
