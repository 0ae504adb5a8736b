"""CPU tests of the Triton kernels in Triton's interpreter (TRITON_INTERPRET=1, set by conftest).

Small shapes and large tiles (the interpreter's cost is per program and per loop trip). Both
token-tiling modes are covered (T <= 32: one tile per adapter found through the mapping; T > 32:
tiles of the sorted order), split-K through a workspace and through atomics, heterogeneous ranks,
bias, -1 tokens, ids that are no slot of the weights, more slices than one launch takes, and the
JAX backend through jax.pure_callback. Results against a float64 NumPy oracle; outputs poisoned.

Also `backend='triton'` forced through the torch wrapper with lora_ranks as a strided view. CPU
only (the interpreter); compiled runs are tests/test_gpu_triton.py.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available(),
                                reason="needs Triton's interpreter (TRITON_INTERPRET=1) or CUDA")

import lora_core.kernels as kernels  # noqa: E402
from lora_core.kernels import configs  # noqa: E402

from . import torch_helpers  # noqa: E402

TOL = {torch.float32: 1e-5, torch.float16: 5e-3, torch.bfloat16: 2e-2}
DEV = "cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1" else "cpu"


def _rel(got, ref):
    got = np.asarray(got, np.float64)
    assert not np.isnan(got).any(), "NaN in the result (unwritten output?)"
    return np.linalg.norm(got - ref) / max(np.linalg.norm(ref), 1e-30)


def _meta(idx, num_slots, capacity=None):
    from torch_lora.meta import LoRAKernelMeta
    meta = LoRAKernelMeta.make(num_slots, capacity or len(idx), DEV)
    meta.prepare_tensors(torch.as_tensor(np.asarray(idx, np.int32), device=DEV))
    return meta


def _problem(seed, T, H, R, widths, L, dtype, frac_none=0.25):
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, L, T).astype(np.int32)
    idx[rng.random(T) < frac_none] = -1
    f = lambda a: torch.from_numpy(np.asarray(a, np.float32)).to(DEV, dtype)
    x = f(rng.standard_normal((T, H)))
    a = [f(rng.standard_normal((L, R, H)) / np.sqrt(H)) for _ in widths]
    b = [f(rng.standard_normal((L, n, R)) / np.sqrt(R)) for n in widths]
    return rng, idx, x, a, b


def _nan_past_ranks(a, b, ranks):
    """Writes NaN into every slot's A rows and B columns past its rank (in place); returns the
    weights with those entries zero, for the oracle."""
    for aa, bb in zip(a, b):
        for slot, r in enumerate(ranks):
            aa[slot, r:] = float("nan")
            bb[slot, :, r:] = float("nan")
    return [torch.nan_to_num(aa, nan=0.0) for aa in a], [torch.nan_to_num(bb, nan=0.0) for bb in b]


def _np(t):
    return t.detach().to("cpu", torch.float64).numpy()


def _oracle_linear(y, x, a, b, idx, scale, offsets, ranks=None, bias=None, add_inputs=True):
    y, x = _np(y).copy(), _np(x)
    for t, slot in enumerate(idx):
        if slot < 0 or slot >= a[0].shape[0]:
            continue
        for s, (aa, bb, off) in enumerate(zip(a, b, offsets)):
            A, B = _np(aa[slot]), _np(bb[slot])
            if ranks is not None:
                A, B = A[:ranks[slot]], B[:, :ranks[slot]]
            d = (scale * x[t] @ A.T) @ B.T
            if bias is not None and bias[s] is not None:
                d = d + _np(bias[s][slot])
            y[t, off:off + B.shape[0]] = (y[t, off:off + B.shape[0]] if add_inputs else 0) + d
    return y


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("T,fused", [(9, False), (9, True), (40, False), (40, True)])
def test_linear_ranks_bias(dtype, T, fused):
    from torch_lora.ops import triton as torch_triton
    H, R, widths, L = 96, 16, (48, 16, 32), 4
    rng, idx, x, a, b = _problem(1, T, H, R, widths, L, dtype)
    bias = [torch.from_numpy(rng.standard_normal((L, n)).astype(np.float32)).to(DEV, dtype) if s != 1 else None
            for s, n in enumerate(widths)]
    ranks = np.array([16, 5, 0, 9], np.int32)
    offsets = (3, 51, 67)
    y = torch.from_numpy(rng.standard_normal((T, 101)).astype(np.float32)).to(DEV, dtype)
    ref = _oracle_linear(y, x, a, b, idx, 0.5, offsets, ranks, bias)
    out = y.clone()
    torch_triton.linear(out, x, a, b, _meta(idx, L).meta_args(T), 0.5, offsets, torch.from_numpy(ranks).to(DEV), bias,
              fused=fused)
    assert _rel(_np(out), ref) < TOL[dtype]
    keep = idx < 0
    assert torch.equal(out[torch.from_numpy(keep).to(DEV)], y[torch.from_numpy(keep).to(DEV)])
    assert torch.equal(out[:, :3], y[:, :3]) and torch.equal(out[:, 99:], y[:, 99:])


@pytest.mark.parametrize("tiles_n,rank,ahead", [(2, 16, False), (4, 16, True), (4, 40, False), (3, 40, True)])
def test_expand_several_output_tiles_per_program(tiles_n, rank, ahead):
    """TILES_N output tiles per expand program (prefill configs): slices whose tile counts are not
    multiples of TILES_N (padded, so a program's tiles share one slice and, with one rank block,
    its summed workspace rows), the rank in one block and in several, two split-K workspace
    planes, the next tile's y loaded ahead (Y_AHEAD) or not."""
    from torch_lora.ops import triton as torch_triton
    T, H, widths, L = 40, 64, (48, 16, 32), 4
    rng, idx, x, a, b = _problem(11, T, H, rank, widths, L, torch.float16)
    bias = [torch.from_numpy(rng.standard_normal((L, n)).astype(np.float32)).to(DEV, torch.float16)
            if s != 1 else None for s, n in enumerate(widths)]
    ranks = np.array([rank, 5, 0, 9], np.int32)
    offsets = (3, 51, 67)
    y = torch.from_numpy(rng.standard_normal((T, 101)).astype(np.float32)).to(DEV, torch.float16)
    ref = _oracle_linear(y, x, a, b, idx, 0.5, offsets, ranks, bias)
    plan = kernels.plan_expand(T, rank, widths, L + 1, 1, "float16", "float16",
                         dict(BLOCK_M=16, BLOCK_N=16, BLOCK_R=16, TILES_N=tiles_n, Y_AHEAD=ahead), add_inputs=True,
                         bias_flags=(True, False, True), has_ranks=True)
    tn = plan.constexprs["TILES_N"]
    assert tn == min(tiles_n, 3)                                     # at most the largest slice's tiles
    padded = sum(-(-n // tn) * tn for n in (3, 1, 2))                # 3 + 1 + 2 tiles of 16, padded
    assert plan.constexprs["NUM_TILES"] == padded and plan.grid[0] == padded // tn
    assert (plan.constexprs["NT1"], plan.constexprs["NT2"]) == (-(-3 // tn) * tn, padded - -(-2 // tn) * tn)
    assert plan.constexprs["Y_AHEAD"] == ahead
    out = y.clone()
    torch_triton.linear(out, x, a, b, _meta(idx, L).meta_args(T), 0.5, offsets, torch.from_numpy(ranks).to(DEV), bias,
              fused=False, expand_config=dict(BLOCK_M=16, BLOCK_N=16, BLOCK_R=16, TILES_N=tiles_n,
                                              Y_AHEAD=ahead, num_warps=4, num_stages=1),
              shrink_config=dict(BLOCK_M=16, BLOCK_K=32, SPLIT_K=2, num_warps=4, num_stages=1))
    assert _rel(_np(out), ref) < TOL[torch.float16]
    assert torch.equal(out[:, :3], y[:, :3]) and torch.equal(out[:, 99:], y[:, 99:])
    keep = torch.from_numpy(idx < 0).to(DEV)
    assert torch.equal(out[keep], y[keep])


@pytest.mark.parametrize("T,ranks", [(9, None), (40, None), (40, (16, 5, 8, 0))])
def test_expand_b_select(T, ranks):
    """B_SELECT (one output tile per program, one rank block): the B tile goes through the rank
    select without per-slot ranks too (a code-generation choice); same result as the oracle, and
    the plan drops it where it does not apply (several tiles per program)."""
    from torch_lora.ops import triton as torch_triton
    H, R, widths, L = 64, 16, (48, 32), 4
    rng, idx, x, a, b = _problem(19, T, H, R, widths, L, torch.float16)
    r = None if ranks is None else torch.tensor(ranks, dtype=torch.int32, device=DEV)
    y = torch.from_numpy(rng.standard_normal((T, 80)).astype(np.float32)).to(DEV, torch.float16)
    ref = _oracle_linear(y, x, a, b, idx, 0.5, (0, 48), None if ranks is None else np.array(ranks))
    cfg = dict(BLOCK_M=16, BLOCK_N=16, BLOCK_R=16, B_SELECT=True, num_warps=4, num_stages=1)
    plan = kernels.plan_expand(T, R, widths, L + 1, 1, "float16", "float16", cfg, add_inputs=True,
                         bias_flags=(False, False), has_ranks=ranks is not None)
    assert plan.constexprs["B_SELECT"]
    assert not kernels.plan_expand(T, R, widths, L + 1, 1, "float16", "float16", dict(cfg, TILES_N=2), add_inputs=True,
                             bias_flags=(False, False), has_ranks=False).constexprs["B_SELECT"]
    out = y.clone()
    torch_triton.linear(out, x, a, b, _meta(idx, L).meta_args(T), 0.5, (0, 48), r, fused=False, expand_config=cfg)
    assert _rel(_np(out), ref) < TOL[torch.float16]


@pytest.mark.parametrize("fused", [False, True])
def test_small_batch_in_sorted_tiles(fused):
    """SMALL_T False in a launch config: a batch of at most small_t_max tokens (the launch policy's) is tiled like a
    large one (BLOCK_M-token tiles of the sorted order) instead of one whole-batch tile per
    adapter; same result as the oracle, with -1 tokens and heterogeneous ranks."""
    from torch_lora.ops import triton as torch_triton
    T, H, R, widths, L = 20, 64, 16, (48, 32), 3
    rng, idx, x, a, b = _problem(23, T, H, R, widths, L, torch.float16)
    ranks = np.array([16, 5, 8], np.int32)
    y = torch.from_numpy(rng.standard_normal((T, 80)).astype(np.float32)).to(DEV, torch.float16)
    ref = _oracle_linear(y, x, a, b, idx, 0.5, (0, 48), ranks)
    s_cfg = dict(BLOCK_M=16, BLOCK_K=64, SPLIT_K=2, num_warps=4, num_stages=1, SMALL_T=False)
    e_cfg = dict(BLOCK_M=16, BLOCK_N=16, BLOCK_R=16, num_warps=4, num_stages=1, SMALL_T=False)
    f_cfg = dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=64, SPLIT_K=0, num_warps=4, num_stages=1, SMALL_T=False)
    G = L + 1
    plans = [kernels.plan_shrink(T, H, R, 2, G, "float16", "float16", s_cfg, lora_only=True, workspace=True,
                           has_ranks=True),
             kernels.plan_expand(T, R, widths, G, 2, "float16", "float16", e_cfg, add_inputs=True,
                           bias_flags=(False, False), has_ranks=True),
             kernels.plan_fused(T, H, R, widths, G, "float16", "float16", f_cfg, add_inputs=True,
                          bias_flags=(False, False), has_ranks=True)]
    for plan in plans:
        assert not plan.constexprs["SMALL_T"] and plan.constexprs["BLOCK_M"] == 16
        assert plan.grid[-1] == kernels.max_tiles(T, G, 16)                       # cdiv(T, 16) + min(G, T)
    assert kernels.plan_expand(T, R, widths, G, 2, "float16", "float16", dict(e_cfg, SMALL_T=True), add_inputs=True,
                         bias_flags=(False, False), has_ranks=True).constexprs["BLOCK_M"] == 32
    out = y.clone()
    torch_triton.linear(out, x, a, b, _meta(idx, L).meta_args(T), 0.5, (0, 48), torch.from_numpy(ranks).to(DEV),
                        fused=fused,
              shrink_config=s_cfg, expand_config=e_cfg, fused_config=f_cfg)
    assert _rel(_np(out), ref) < TOL[torch.float16]


@pytest.mark.parametrize("T,fused,tiles_n", [(9, True, 1), (40, False, 1), (40, False, 2)])
def test_rank_padding_may_hold_nan(T, fused, tiles_n):
    """Per-slot ranks: whatever the weights hold past a slot's rank -- NaN here -- never reaches y.
    B is loaded to the next multiple of 8 rank columns (vectorised), so for ranks that are not
    multiples of 8 the extra columns must be zeroed in registers (the expand's B_TAIL copy of its
    loop); ranks that are multiples of 8 run the copy without that step."""
    from torch_lora.ops import triton as torch_triton
    H, R, widths, L = 64, 16, (48, 32), 4
    rng, idx, x, a, b = _problem(17, T, H, R, widths, L, torch.float16)
    ranks = np.array([16, 5, 8, 11], np.int32)
    clean_a, clean_b = _nan_past_ranks(a, b, ranks)
    y = torch.from_numpy(rng.standard_normal((T, 80)).astype(np.float32)).to(DEV, torch.float16)
    ref = _oracle_linear(y, x, clean_a, clean_b, idx, 0.5, (0, 48), ranks)
    out = y.clone()
    kw = dict(fused=True) if fused else dict(
        fused=False, expand_config=dict(BLOCK_M=16, BLOCK_N=16, BLOCK_R=16, TILES_N=tiles_n, num_warps=4,
                                        num_stages=1))
    torch_triton.linear(out, x, a, b, _meta(idx, L).meta_args(T), 0.5, (0, 48), torch.from_numpy(ranks).to(DEV), **kw)
    assert not torch.isnan(out).any()
    assert _rel(_np(out), ref) < TOL[torch.float16]


@pytest.mark.parametrize("T", [6, 40])
def test_fused_barrier_counters_advance_by_one_span_per_launch(T):
    """The fused kernel's per-tile barrier: every program of a busy token tile arrives exactly once
    per launch (the counter moves by BARRIER_SPAN), idle tiles never; split-K over several planes
    and several output tiles per token tile, so the tile really has many programs."""
    from torch_lora.ops import triton as torch_triton
    H, R, widths, L = 256, 16, (64, 32), 4
    rng, idx, x, a, b = _problem(3, T, H, R, widths, L, torch.float32)
    idx[: T // 3] = 2                            # some adapters busy, slot 3 never: idle tiles
    idx[idx == 3] = -1
    meta = _meta(idx, L)
    cfg = dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=64, SPLIT_K=4, num_warps=4, num_stages=1)
    plan = torch_triton._fused_plan(T, H, R, widths, meta.meta_args(T)[4].shape[0], L, "float32", "float32", (False,
                                                                                                              False),
                          False, torch_triton._key(cfg))
    assert plan.grid[0] == max(sum(-(-w // 16) for w in widths), 2 * 4) > 4 and plan.constexprs["SPLIT_K"] == 4
    torch_triton._SYNC_BUFFERS.clear()
    ref = None
    for launch in range(1, 3):
        y = torch.zeros(T, sum(widths), dtype=torch.float32, device=DEV)
        torch_triton.linear(y, x, a, b, meta.meta_args(T), 0.5, (0, 64), fused=True, fused_config=cfg)
        counters = next(iter(torch_triton._SYNC_BUFFERS.values()))[: plan.grid[1]].cpu().numpy().astype(np.int64)
        busy = counters != 0
        assert busy.sum() >= 2 and (~busy).sum() >= 1, counters
        assert np.all(counters[busy] == launch * kernels.BARRIER_SPAN.value), counters
        ref = ref if ref is not None else _oracle_linear(torch.zeros(T, 96), x, a, b, idx, 0.5, (0, 64))
        assert _rel(_np(y), ref) < TOL[torch.float32]


@pytest.mark.parametrize("T", [9, 40])
def test_fused_sums_the_workspace_planes_in_groups(T, monkeypatch):
    """Large token tiles: the fused kernel loads WS_GROUP planes at a time (here one plane per
    load, four planes) instead of all of them in one block of registers; same result."""
    from torch_lora.ops import triton as torch_triton
    H, R, widths, L = 256, 16, (48, 32), 4
    rng, idx, x, a, b = _problem(5, T, H, R, widths, L, torch.float32)
    import lora_core.kernels.fused as fused_module
    monkeypatch.setattr(fused_module, "WS_LOAD_MAX", 16 * 16)
    torch_triton._fused_plan.cache_clear()
    cfg = dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=64, SPLIT_K=4, num_warps=4, num_stages=1)
    plan = torch_triton._fused_plan(T, H, R, widths, L + 1, L, "float32", "float32", (False, False), False,
                                    torch_triton._key(cfg))
    assert plan.constexprs["SPLIT_P2"] == 4 and plan.constexprs["WS_GROUP"] == 1
    y = torch.from_numpy(rng.standard_normal((T, 80)).astype(np.float32)).to(DEV)
    ref = _oracle_linear(y, x, a, b, idx, 0.5, (0, 48))
    out = y.clone()
    torch_triton.linear(out, x, a, b, _meta(idx, L).meta_args(T), 0.5, (0, 48), fused=True, fused_config=cfg)
    torch_triton._fused_plan.cache_clear()
    assert _rel(_np(out), ref) < TOL[torch.float32]


@pytest.mark.parametrize("kind", ["sync", "workspace"])
def test_stream_buffers_are_per_stream_zeroed_and_never_freed(kind):
    """The fused kernel's barrier counters (int32) and PreparedLinear's workspace (float32): one
    zeroed buffer per (device, stream); an outgrown one is replaced and kept (graphs may hold it)."""
    from torch_lora.ops import triton as torch_triton
    get, store, dtype = {"sync": (torch_triton._sync_buffer, torch_triton._SYNC_BUFFERS, torch.int32),
                         "workspace": (torch_triton._workspace_buffer, torch_triton._WORKSPACES, torch.float32)}[kind]
    store.clear()
    dev = torch.device(DEV)
    a = get(dev, 1, 8)
    assert a.dtype == dtype and a.numel() >= 8 and not a.any()
    assert get(dev, 1, 8) is a                              # one buffer per (device, stream)
    assert get(dev, 2, 8) is not a
    big = get(dev, 1, a.numel() + 1)                        # outgrown: a new one, the old one kept
    assert big is not a and big.numel() > a.numel() and any(o is a for o in torch_triton._OUTGROWN)
    assert get(dev, 1, 8) is big
    store.clear()


@pytest.mark.parametrize("T", [7, 37])
def test_shrink_poisoned_and_split(T):
    """Every row written (0 without LoRA); split-K by atomics and by workspace planes agree."""
    from torch_lora.ops import triton as torch_triton
    H, R, widths, L = 160, 16, (32, 32), 3
    _, idx, x, a, b = _problem(2, T, H, R, widths, L, torch.float32)
    meta = _meta(idx, L, capacity=T + 5)
    ref = np.stack([np.where((idx >= 0)[:, None],
                             0.25 * np.einsum("th,trh->tr", _np(x), _np(aa)[np.maximum(idx, 0)]), 0.0)
                    for aa in a])
    for cfg in (None, dict(BLOCK_M=16, BLOCK_K=64, SPLIT_K=3, num_warps=4, num_stages=1)):
        out = torch.full((2, T, R), float("nan"), device=DEV)
        torch_triton.shrink(x, a, out, meta.meta_args(T), 0.25, None, config=cfg)
        assert _rel(_np(out), ref) < 1e-5
    # the workspace path of linear with 3 planes equals the unsplit one
    y = torch.randn(T, 64, device=DEV)
    y1, y2 = y.clone(), y.clone()
    torch_triton.linear(y1, x, a, b, meta.meta_args(T), 0.25, (0, 32), fused=False)
    torch_triton.linear(y2, x, a, b, meta.meta_args(T), 0.25, (0, 32), fused=False,
              shrink_config=dict(BLOCK_M=16, BLOCK_K=64, SPLIT_K=3, num_warps=4, num_stages=1))
    assert _rel(_np(y2), _np(y1)) < 1e-6


@pytest.mark.parametrize("T", [7, 37])
@pytest.mark.parametrize("num_slices", [2, 3, 4])
def test_shrink_all_slices_in_one_program(T, num_slices):
    """ALL_SLICES: each shrink program computes every slice of the launch from one x tile (grid
    axis 0 of size 1). Equal to the oracle stand-alone (plain stores; split-K by atomics) with
    heterogeneous ranks, and through linear's workspace (two planes) for unequal output widths."""
    from torch_lora.ops import triton as torch_triton
    H, R, L = 160, 16, 3
    widths = (32, 16, 48, 24)[:num_slices]
    _, idx, x, a, b = _problem(4, T, H, R, widths, L, torch.float16)
    meta = _meta(idx, L, capacity=T + 5)
    ranks = np.array([16, 3, 9], np.int32)
    kept = (np.arange(R) < ranks[np.maximum(idx, 0)][:, None])[..., None]     # (T, R, 1): rank padding cut
    ref = np.stack([np.where((idx >= 0)[:, None],
                             0.25 * np.einsum("th,trh->tr", _np(x), _np(aa)[np.maximum(idx, 0)] * kept),
                             0.0)
                    for aa in a])
    for split in (1, 3):
        cfg = dict(BLOCK_M=16, BLOCK_K=64, SPLIT_K=split, num_warps=4, num_stages=1, ALL_SLICES=True)
        plan = kernels.plan_shrink(T, H, R, num_slices, L + 1, "float16", "float16", cfg, lora_only=False,
                             workspace=False, has_ranks=True)
        assert plan.grid[0] == 1 and plan.constexprs["SLICES"] == num_slices and plan.atomic == (split > 1)
        out = torch.full((num_slices, T, R), float("nan"), device=DEV)
        torch_triton.shrink(x, a, out, meta.meta_args(T), 0.25, torch.from_numpy(ranks).to(DEV), config=cfg)
        assert _rel(_np(out), ref) < TOL[torch.float16]
    offsets = tuple(int(v) for v in np.cumsum((0,) + widths[:-1]))
    y = torch.randn(T, sum(widths), device=DEV).to(torch.float16)
    ref_y = _oracle_linear(y, x, a, b, idx, 0.25, offsets, ranks)
    out = y.clone()
    torch_triton.linear(out, x, a, b, meta.meta_args(T), 0.25, offsets, torch.from_numpy(ranks).to(DEV), fused=False,
              shrink_config=dict(BLOCK_M=16, BLOCK_K=64, SPLIT_K=2, num_warps=4, num_stages=1, ALL_SLICES=True))
    assert _rel(_np(out), ref_y) < TOL[torch.float16]


@pytest.mark.parametrize("T", [6, 34])
def test_expand_replace_and_offsets(T):
    from torch_lora.ops import triton as torch_triton
    R, widths, L = 16, (40, 24), 3
    rng, idx, _, _, b = _problem(3, T, 8, R, widths, L, torch.float16)
    buf = torch.from_numpy(rng.standard_normal((2, T, R)).astype(np.float32)).to(DEV)
    y = torch.from_numpy(rng.standard_normal((T, 80)).astype(np.float32)).to(DEV, torch.float16)
    out = y.clone()
    torch_triton.expand(buf, b, out, _meta(idx, L).meta_args(T), (10, 50), False, None, None)
    ref = _np(y).copy()
    for s, (bb, off) in enumerate(zip(b, (10, 50))):
        d = np.einsum("tr,tnr->tn", _np(buf[s]), _np(bb)[np.maximum(idx, 0)])
        ref[idx >= 0, off:off + bb.shape[1]] = d[idx >= 0]
    assert _rel(_np(out), ref) < 5e-3


def test_more_slices_than_one_launch_and_bad_ids():
    """5 slices (two launches) and mapping ids that are no slot of the weights (no LoRA)."""
    from torch_lora.ops import triton as torch_triton
    T, H, R, widths, L = 11, 64, 16, (16, 16, 32, 16, 16), 3
    rng, idx, x, a, b = _problem(4, T, H, R, widths, L, torch.float32, frac_none=0.0)
    idx[[1, 4]] = [4, 3]                              # slots the metadata knows, the weights do not
    meta = _meta(idx, 5)
    y = torch.from_numpy(rng.standard_normal((T, 96)).astype(np.float32)).to(DEV)
    offsets = tuple(int(o) for o in np.cumsum((0,) + widths)[:-1])
    for fused in (False, True):
        out = y.clone()
        torch_triton.linear(out, x, a, b, meta.meta_args(T), 1.0, offsets, fused=fused)
        assert _rel(_np(out), _oracle_linear(y, x, a, b, idx, 1.0, offsets)) < 1e-5
        assert torch.equal(out[[1, 4]], y[[1, 4]])


def test_no_lora_batch_leaves_y():
    from torch_lora.ops import triton as torch_triton
    T, L = 5, 2
    _, _, x, a, b = _problem(5, T, 32, 16, (16,), L, torch.float32)
    meta = _meta(np.full(T, -1), L)
    y = torch.randn(T, 16, device=DEV)
    out = y.clone()
    torch_triton.linear(out, x, a, b, meta.meta_args(T), 1.0, (0,))
    assert torch.equal(out, y)
    buf = torch.full((1, T, 16), float("nan"), device=DEV)
    torch_triton.shrink(x, a, buf, meta.meta_args(T), 1.0, None)
    assert torch.count_nonzero(buf) == 0


def test_plans_are_mapping_independent_and_checked():
    p1 = kernels.plan_shrink(8, 4096, 16, 3, 9, "bfloat16", "bfloat16", dict(BLOCK_M=16, BLOCK_K=128, SPLIT_K=4),
                       lora_only=True, workspace=True, has_ranks=False)
    assert p1.grid == (3, 4, 9) and p1.constexprs["SMALL_T"] and p1.num_partials == 4
    p2 = kernels.plan_expand(1000, 64, (4096, 1024, 1024), 9, 1, "bfloat16", "bfloat16",
                       dict(BLOCK_M=64, BLOCK_N=128), add_inputs=True, bias_flags=(False,) * 3, has_ranks=False)
    assert p2.grid == (32 + 8 + 8, 16 + 9) and not p2.constexprs["SMALL_T"]
    with pytest.raises(AssertionError):
        kernels.plan_expand(100, 16, (64,), 3, 1, "float16", "float16", dict(BLOCK_M=8, BLOCK_N=64),
                      add_inputs=True, bias_flags=(False,), has_ranks=False)
    assert configs.token_class(8) == "t16" and configs.rank_class(64) == "r64"


@pytest.mark.parametrize("fused", [False, True])
def test_jax_backend_in_interpreter(fused):
    jax = pytest.importorskip("jax")
    import jax.numpy as jnp

    from jax_lora.meta import LoRAKernelMeta
    from jax_lora.ops import triton as jax_triton_backend
    from jax_lora.ops import xla as jax_xla
    rng = np.random.default_rng(6)
    T, H, R, widths, L = 10, 64, 16, (32, 16), 3
    idx = rng.integers(-1, L, T).astype(np.int32)
    meta = LoRAKernelMeta.build(jnp.asarray(idx), L, T + 3)
    x = jnp.asarray(rng.standard_normal((T, H)), jnp.bfloat16)
    a = tuple(jnp.asarray(rng.standard_normal((L, R, H)) / 8, jnp.bfloat16) for _ in widths)
    b = tuple(jnp.asarray(rng.standard_normal((L, n, R)) / 4, jnp.bfloat16) for n in widths)
    bias = (jnp.asarray(rng.standard_normal((L, 32)), jnp.bfloat16), None)
    ranks = jnp.asarray([16, 7, 0], jnp.int32)
    y = jnp.asarray(rng.standard_normal((T, 50)), jnp.bfloat16)
    offs = (2, 34)
    buf_ref = jax_xla.shrink(x, a, meta, 0.5, ranks)
    y_ref = jax_xla.expand(buf_ref, b, y, meta, offs, True, ranks, bias)
    buf = jax.jit(lambda x_, m_: jax_triton_backend.shrink(x_, a, m_, 0.5, ranks))(x, meta)
    assert _rel(np.asarray(buf, np.float64), np.asarray(buf_ref, np.float64)) < 1e-5
    y2 = jax.jit(lambda y_, x_, m_: jax_triton_backend.linear(y_, x_, a, b, m_, 0.5, offs, ranks, bias,
                                                              fused=fused))(y, x, meta)
    ref = np.asarray(y_ref.astype(jnp.float32), np.float64)
    assert _rel(np.asarray(y2.astype(jnp.float32), np.float64), ref) < 2e-2
    y3 = jax.jit(lambda b_, y_, m_: jax_triton_backend.expand(b_, b, y_, m_, offs, True, ranks, bias))(buf_ref, y, meta)
    assert _rel(np.asarray(y3.astype(jnp.float32), np.float64), ref) < 2e-2


_INTERPRETED = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                  reason="Triton on CPU tensors needs TRITON_INTERPRET=1 before import")


@_INTERPRETED
def test_triton_backend_on_cpu_runs_the_interpreter_with_strided_lora_ranks():
    """Contract section 8 (a forced kernel backend runs in its interpreter on CPU), and lora_ranks as a
    strided view (it once gave wrong numbers on torch's Triton backend): backend='triton' equals the
    float64 oracle with unequal slices, a bias and lora_ranks given as a strided view."""
    rng = torch_helpers.rng(60)
    widths = (6, 3)
    a, b = torch_helpers.stacked(rng, 2, 4, 8, widths)
    bias = [torch.tensor(rng.standard_normal((2, 6)), dtype=torch.float32), None]
    ranks = torch.tensor([2, 99, 4, 99], dtype=torch.int32)[::2]
    a_pad = [t.clone() for t in a]
    b_pad = [t.clone() for t in b]
    for t in a_pad:
        t[0, :, 2:] = 0
    for t in b_pad:
        t[0, :, :, 2:] = 0
    w = torch_helpers.wrapper((1, 0, 2), [1, 2], backend="triton")
    x = torch.tensor(rng.standard_normal((3, 8)), dtype=torch.float32)
    y0 = torch.tensor(rng.standard_normal((3, 9)), dtype=torch.float32)
    y = w.add_lora_linear(y0.clone(), x, a, b, bias, 0.5, widths, lora_ranks=ranks)
    assert torch_helpers.rel(y.numpy(), torch_helpers.oracle_linear(y0, x, a_pad, b_pad, bias, 0.5, [0, -1, 1],
                                                                    widths)) < 1e-5
    assert torch.equal(y[1], y0[1])
