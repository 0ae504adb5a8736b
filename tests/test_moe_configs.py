"""The MoE LoRA kernel's launch configs (lora_core/kernels/moe_configs.py): the defaults' rules,
the K split and tile grouping for a shape, the per-device table and its checks, and the kernel
under every kind of config (GEMV and tl.dot naive paths, rank chunks, hidden parts, several tiles
per expand program) in Triton's interpreter against the float64 oracle."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from lora_core.kernels import moe_configs
from lora_core.kernels.moe_configs import MoeConfig, MoeShape

from . import oracle

MIXTRAL_W13 = dict(num_slots=32, num_experts=8, hidden=4096, widest=14336, slices=2, shrink_slices=2)
QWEN_W2 = dict(num_slots=32, num_experts=128, hidden=768, widest=2048, slices=1, shrink_slices=1)


def _device() -> str:
    """Where the kernel tests run: compiled on a CUDA GPU when one is present, else the interpreter."""
    import torch
    return "cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1" else "cpu"


def _shape(pairs, rank, naive=True, block_m=16, **sizes) -> MoeShape:
    return MoeShape(num_pairs=pairs, naive=naive, block_m=16 if naive else block_m, rank=rank,
                    **(sizes or MIXTRAL_W13))


@pytest.fixture
def compiled_defaults(monkeypatch):
    """The defaults a GPU gets (the interpreter's are its own), with 132 SMs."""
    monkeypatch.setattr(moe_configs, "interpreting", lambda: False)
    monkeypatch.setattr(moe_configs, "sm_count", lambda: 132)


def _programs(shape, cfg=None):
    r = moe_configs.resolve(cfg or moe_configs.default_moe_config(shape), shape, sms=132)
    shrink = moe_configs.live_blocks(shape) * shape.shrink_slices * (shape.block_r // r.r_chunk) * r.k_split
    expand = moe_configs.live_blocks(shape) * shape.slices * r.n_programs
    return r, shrink, expand


def test_wide_ranks_do_not_multiply_the_naive_programs(compiled_defaults):
    """Naive decode at rank 64 runs no more shrink or expand programs than at rank 16 once rank 16
    fills the GPU (the whole rank per program, tiles of a fixed element count); below that, rank
    64's programs move at least as many weight bytes each as rank 16's."""
    for pairs in (32, 256):
        _, s16, e16 = _programs(_shape(pairs, 16))
        _, s64, e64 = _programs(_shape(pairs, 64))
        assert s64 <= s16 and e64 <= e16, (pairs, s16, s64, e16, e64)
    _, s16, e16 = _programs(_shape(2, 16))
    _, s64, e64 = _programs(_shape(2, 64))
    assert 64 / s64 >= 16 / s16 and 64 / e64 >= 16 / e16, (s16, s64, e16, e64)


def test_defaults_fill_the_gpu_and_cover_the_shape(compiled_defaults):
    """Every default resolves to parts that cover the hidden size (multiples of BLOCK_K), a power-of-two
    TILES_N whose programs cover the widest slice, and enough programs for the SMs where the
    shape has the work."""
    for sizes in (MIXTRAL_W13, QWEN_W2):
        for pairs, naive, bm in ((2, True, 16), (32, True, 16), (512, True, 16), (512, False, 16),
                                 (4096, False, 64), (16384, False, 64)):
            for rank in (16, 64):
                shape = _shape(pairs, rank, naive, bm, **sizes)
                r, shrink, expand = _programs(shape)
                assert r.k_per % r.block_k == 0 and (r.k_split - 1) * r.k_per < shape.hidden <= r.k_split * r.k_per
                assert 1 <= r.k_split <= (moe_configs.MAX_K_SPLIT_NAIVE if naive else moe_configs.MAX_K_SPLIT)
                assert r.tiles_n & (r.tiles_n - 1) == 0
                assert (r.n_programs - 1) * r.tiles_n * r.block_n < shape.widest <= r.n_programs * r.tiles_n * r.block_n
                units = moe_configs.live_blocks(shape) * shape.shrink_slices * (shape.block_r // r.r_chunk)
                cap = moe_configs.MAX_K_SPLIT_NAIVE if naive else moe_configs.MAX_K_SPLIT
                parts = min(cap, shape.hidden // max(moe_configs.MIN_K_PER, r.block_k))
                assert shrink >= min(4 * 132, units * parts) // 2, (shape, r)     # parts rounded to BLOCK_K
                assert naive == r.config.GEMV


def test_sorted_defaults_give_64_row_blocks_8_warps(compiled_defaults):
    """16-row blocks: 4 warps, B tiles of 128 columns at rank 64; 64-row blocks: 8 warps in both launches."""
    small = moe_configs.default_moe_config(_shape(512, 64, naive=False, block_m=16))
    big = moe_configs.default_moe_config(_shape(16384, 16, naive=False, block_m=64))
    assert small.BLOCK_N == 128 and small.expand_warps == small.shrink_warps == 4 and not small.GEMV
    assert big.expand_warps == big.shrink_warps == 8 and not big.GEMV


def test_bucket_keys_name_the_order_and_sizes():
    assert moe_configs.bucket_key(_shape(32, 64)) == "naive/p32/r64/k4096/n14336/s2"
    assert moe_configs.bucket_key(_shape(600, 40, naive=False, block_m=64, **QWEN_W2)) == \
        "sorted64/p1024/r64/k768/n2048/s1"


def test_table_entries_are_read_checked_and_applied(tmp_path, monkeypatch, compiled_defaults):
    """A LORA_CORE_MOE_TABLE file's entry overrides the named fields of its bucket's default; the
    plan reads it; entries with unknown fields or bad values are refused, naming the field."""
    from lora_core.kernels.moe_lora import plan_moe_lora
    shape = _shape(32, 64)
    path = tmp_path / "moe.json"
    path.write_text(json.dumps({"device": "test", "format": 1, "buckets": {
        moe_configs.bucket_key(shape): {"BLOCK_N": 32, "TILES_N": 4, "expand_warps": 8, "GEMV": False}}}))
    monkeypatch.setenv("LORA_CORE_MOE_TABLE", str(path))
    moe_configs.table.cache_clear()
    try:
        plan = plan_moe_lora(num_pairs=32, num_slots=32, num_experts=8, hidden=4096, widths=(14336, 14336),
                             rank=64, naive=True, sorted_len=0, block_m=16, mul_routed_weight=False, shared_a=False,
                             dtypes=("bfloat16",) * 3)
        assert plan.constexprs["BLOCK_N"] == 32 and plan.constexprs["TILES_N"] == 4
        assert plan.constexprs["GEMV"] is False and plan.phase(1).num_warps == 8
        assert plan.expand_grid == (32, 2 * plan.constexprs["N_TILES"])
        for bad, field in (({"BLOCK_N": 48}, "BLOCK_N"), ({"SPLIT": 2}, "SPLIT"), ({"expand_stages": 0}, "stages"),
                           ({"GEMV": 1}, "GEMV")):
            path.write_text(json.dumps({"buckets": {"naive/p32/r64/k4096/n14336/s2": bad}}))
            moe_configs.table.cache_clear()
            with pytest.raises(ValueError, match=field):
                moe_configs.table(None)
    finally:
        moe_configs.table.cache_clear()


def test_untuned_pair_counts_borrow_the_nearest_bucket_without_its_counts():
    """A batch between tuned ones takes the nearest tuned pair count's tiles (same order and sizes),
    never its K_SPLIT / TILES_N; another order or size borrows nothing."""
    tuned = {"sorted16/p128/r64/k4096/n14336/s2": {"BLOCK_N": 64, "K_SPLIT": 3, "TILES_N": 4, "expand_warps": 8},
             "sorted16/p1024/r64/k4096/n14336/s2": {"BLOCK_N": 256},
             "sorted64/p256/r64/k4096/n14336/s2": {"BLOCK_N": 32}}
    exact = moe_configs.table_entry(tuned, _shape(128, 64, naive=False, block_m=16))
    assert exact == tuned["sorted16/p128/r64/k4096/n14336/s2"]
    assert moe_configs.table_entry(tuned, _shape(200, 64, naive=False, block_m=16)) == \
        {"BLOCK_N": 64, "expand_warps": 8}                                          # p256: p128 is nearest
    assert moe_configs.table_entry(tuned, _shape(600, 64, naive=False, block_m=16)) == {"BLOCK_N": 256}
    assert moe_configs.table_entry(tuned, _shape(600, 16, naive=False, block_m=16)) == {}      # rank 16
    assert moe_configs.table_entry(tuned, _shape(600, 64, naive=True)) == {}                    # naive


def test_override_and_deterministic_plans():
    """override_moe_config governs a block's plans; deterministic plans keep their fixed config."""
    from lora_core.kernels.moe_lora import DETERMINISTIC_CONFIG, plan_moe_lora
    cfg = MoeConfig(BLOCK_K=32, R_CHUNK=16, K_SPLIT=2, shrink_warps=2, shrink_stages=2, BLOCK_N=32, TILES_N=2,
                    expand_warps=2, expand_stages=2, GEMV=True)

    def plan(deterministic=False):
        return plan_moe_lora(num_pairs=8, num_slots=4, num_experts=4, hidden=256, widths=(64,), rank=32, naive=True,
                             sorted_len=0, block_m=16, mul_routed_weight=True, shared_a=False,
                             dtypes=("float32",) * 3, deterministic=deterministic)
    with moe_configs.override_moe_config(cfg):
        p, d = plan(), plan(True)
    assert p.config == cfg and p.k_split == 2 and p.constexprs["R_CHUNK"] == 16 and p.shrink_grid == (8, 4)
    assert p.phase(0).num_warps == 2 and p.phase(1).num_stages == 2
    assert d.config is None and d.k_split == 1 and d.constexprs["GEMV"] is False
    assert d.constexprs["R_CHUNK"] == d.constexprs["BLOCK_R"] and DETERMINISTIC_CONFIG.TILES_N == 1
    with pytest.raises(TypeError, match="MoeConfig"), moe_configs.override_moe_config({"BLOCK_K": 32}):
        pass
    with pytest.raises(ValueError, match="R_CHUNK"), moe_configs.override_moe_config(cfg.replace(R_CHUNK=24)):
        pass


CONFIGS = {
    "gemv": MoeConfig(BLOCK_K=32, R_CHUNK=16, K_SPLIT=3, shrink_warps=4, shrink_stages=1, BLOCK_N=16, TILES_N=2,
                      expand_warps=4, expand_stages=1, GEMV=True),
    "dot": MoeConfig(BLOCK_K=32, R_CHUNK=32, K_SPLIT=2, shrink_warps=4, shrink_stages=1, BLOCK_N=32, TILES_N=4,
                     expand_warps=4, expand_stages=1, GEMV=False),
    "wide": MoeConfig(BLOCK_K=128, R_CHUNK=64, K_SPLIT=1, shrink_warps=4, shrink_stages=1, BLOCK_N=64, TILES_N=1,
                      expand_warps=4, expand_stages=1, GEMV=True),
}


@pytest.mark.parametrize("name", sorted(CONFIGS))
@pytest.mark.parametrize("order", ["naive", "sorted"])
@pytest.mark.parametrize("down", [False, True], ids=["gate_up", "down"])
def test_kernel_matches_the_oracle_under_each_config(name, order, down):
    """Rank 24 (a rank chunk past the rank, masked), hidden 80 (a short last part and loop trip),
    widths 40 / 72 (several tiles per program, a partial last tile), slot 1 disabled, tokens
    without an adapter: the torch op in the interpreter equals the float64 oracle."""
    torch = pytest.importorskip("torch")
    from torch_lora.ops import fused_moe_lora, moe_lora_align_block_size
    rng = np.random.default_rng(7 + down)
    tokens, top_k, experts, slots, rank = 6, 2, 4, 3, 24
    hidden, inter = (40, 80) if down else (80, 40)
    k_in, widths = (inter, (hidden,)) if down else (hidden, (inter, inter))
    a = [rng.standard_normal((slots, experts, rank, k_in)).astype(np.float32) / np.sqrt(k_in) for _ in widths]
    b = [rng.standard_normal((slots, experts, n, rank)).astype(np.float32) / np.sqrt(rank) for n in widths]
    x = rng.standard_normal((tokens * top_k if down else tokens, k_in)).astype(np.float32)
    topk_ids = np.stack([rng.choice(experts, top_k, replace=False) for _ in range(tokens)]).astype(np.int32)
    w = rng.random((tokens, top_k)).astype(np.float32) + 0.1
    token_lora = np.array([0, 2, -1, 1, 2, 0], np.int32)
    enabled = np.array([1, 0, 1], np.int32)
    y0 = rng.standard_normal((tokens, top_k, sum(widths) + 1)).astype(np.float32)
    dev = _device()

    def t(v):
        return torch.from_numpy(v).to(dev)

    ids, lmap, en = t(topk_ids), t(token_lora), t(enabled)
    if order == "naive":
        align, block = (None, ids.reshape(-1), None), None
    else:
        align, block = moe_lora_align_block_size(ids, lmap, experts, 16, slots, en), 16
    y = t(y0.copy())
    with moe_configs.override_moe_config(CONFIGS[name]):
        fused_moe_lora(y, t(x), [t(v) for v in a], [t(v) for v in b], t(w), *align, lmap, rank, top_k, en, down, 1,
                       block_size=block, backend="triton")
    want = oracle.fused_moe_lora(y0, x, a, b, topk_ids, w, token_lora, enabled, down, 1)
    np.testing.assert_allclose(y.cpu().numpy(), want, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("sub,persist,rank", [(16, 0, 16), (16, 1, 16), (32, 2, 40)])
@pytest.mark.parametrize("down", [False, True], ids=["gate_up", "down"])
def test_sub_blocks_of_an_aligned_block_match_the_oracle(sub, persist, rank, down):
    """The alignment in blocks of 64, the kernel in sub-blocks of `sub` rows (config BLOCK_M): a run
    of 30 pairs (two 16-row sub-blocks live, the rest padding), short runs (one live sub-block,
    the others padding only), a disabled slot and tokens without an adapter equal the float64
    oracle, with one program per block of the bound (PERSIST 0) or fewer programs than blocks,
    each looping over several (PERSIST 1, 2); rank 40 (past Y_FIRST_MAX_RANK: y loaded after the
    dots) as well as 16."""
    torch = pytest.importorskip("torch")
    from lora_core.kernels.moe_lora import plan_moe_lora
    from torch_lora.ops import fused_moe_lora, moe_lora_align_block_size
    rng = np.random.default_rng(11 + down)
    tokens, top_k, experts, slots, align = 20, 2, 3, 3, 64
    hidden, inter = (24, 40) if down else (40, 24)
    k_in, widths = (inter, (hidden,)) if down else (hidden, (inter, inter))
    a = [rng.standard_normal((slots, experts, rank, k_in)).astype(np.float32) / np.sqrt(k_in) for _ in widths]
    b = [rng.standard_normal((slots, experts, n, rank)).astype(np.float32) / np.sqrt(rank) for n in widths]
    x = rng.standard_normal((tokens * top_k if down else tokens, k_in)).astype(np.float32)
    topk_ids = np.stack([rng.choice(experts, top_k, replace=False) for _ in range(tokens)]).astype(np.int32)
    topk_ids[:15] = [0, 1]                                  # slot 0's runs of experts 0 and 1: 15+ pairs each
    w = rng.random((tokens, top_k)).astype(np.float32) + 0.1
    token_lora = np.array([0] * 15 + [2, -1, 1, 2, 0], np.int32)
    enabled = np.array([1, 0, 1], np.int32)
    y0 = rng.standard_normal((tokens, top_k, sum(widths))).astype(np.float32)
    dev = _device()

    def t(v):
        return torch.from_numpy(v).to(dev)

    ids, lmap, en = t(topk_ids), t(token_lora), t(enabled)
    align_out = moe_lora_align_block_size(ids, lmap, experts, align, slots, en)
    cfg = CONFIGS["dot"].replace(BLOCK_M=sub, PERSIST=persist)
    plan = plan_moe_lora(num_pairs=tokens * top_k, num_slots=slots, num_experts=experts, hidden=k_in, widths=widths,
                         rank=rank, naive=False, sorted_len=align_out[0].numel() // slots, block_m=align,
                         mul_routed_weight=down, shared_a=False, dtypes=("float32",) * 3, config=cfg)
    assert plan.constexprs["BLOCK_M"] == sub and plan.constexprs["SUBS"] == align // sub
    assert plan.constexprs["Y_FIRST"] == (rank <= 32)
    bound = -(-tokens * top_k // sub) + (align // sub) * min(slots * experts, tokens * top_k)
    live = -(-tokens * top_k // sub) + experts                       # moe_configs.live_blocks
    assert plan.shrink_grid[0] == plan.expand_grid[0] == (min(bound, persist * live) if persist else bound)
    blocks = int(align_out[2].sum()) // sub
    assert persist != 1 or plan.shrink_grid[0] < blocks              # some programs take several blocks
    y = t(y0.copy())
    with moe_configs.override_moe_config(cfg):
        fused_moe_lora(y, t(x), [t(v) for v in a], [t(v) for v in b], t(w), *align_out, lmap, rank, top_k, en, down,
                       0, block_size=align, backend="triton")
    want = oracle.fused_moe_lora(y0, x, a, b, topk_ids, w, token_lora, enabled, down, 0)
    np.testing.assert_allclose(y.cpu().numpy(), want, rtol=2e-5, atol=2e-5)


def test_block_m_is_checked_and_clipped_to_the_alignment(compiled_defaults):
    """BLOCK_M: 0 (the whole block) or a power of two >= 16, clipped to the alignment's block; the
    naive order always takes 16 rows."""
    base = moe_configs.default_moe_config(_shape(4096, 16, naive=False, block_m=64))
    for bad in (8, 24, True):
        with pytest.raises(ValueError, match="BLOCK_M"):
            moe_configs.check_config(base.replace(BLOCK_M=bad))
    assert moe_configs.resolve(base, _shape(4096, 16, naive=False, block_m=64)).block_m == 64
    assert moe_configs.resolve(base.replace(BLOCK_M=16), _shape(4096, 16, naive=False, block_m=64)).block_m == 16
    assert moe_configs.resolve(base.replace(BLOCK_M=128), _shape(4096, 16, naive=False, block_m=32)).block_m == 32
    assert moe_configs.resolve(base.replace(BLOCK_M=64), _shape(32, 16)).block_m == 16


def test_block_size_follows_the_pairs_per_expert():
    """Few pairs per expert (128 experts at top 8) take 16- or 32-row blocks where 64 rows would be
    mostly padding; 8 experts keep their blocks (16 through 256 tokens, 64 at prefill)."""
    from lora_core.moe_order import moe_block_size
    assert [moe_block_size(t * 8, 128) for t in (256, 2048, 8192)] == [16, 32, 64]
    assert [moe_block_size(t * 2, 8) for t in (64, 256, 2048, 8192)] == [16, 16, 64, 64]
    assert moe_block_size(2048) == 64 and moe_block_size(1024) == 16
    with pytest.raises(ValueError, match="num_experts"):
        moe_block_size(64, 0)


def test_pdl_plans_launch_the_expand_as_a_dependent(monkeypatch):
    """pdl=True: the kernel compiled with USE_PDL (where this Triton has PDL), the expand launched as
    a programmatic dependent of the shrink, the shrink plainly; LORA_CORE_PDL=0 launches neither."""
    from lora_core.kernels.common import HAVE_PDL
    from lora_core.kernels.moe_lora import plan_moe_lora

    def plan(pdl):
        return plan_moe_lora(num_pairs=64, num_slots=4, num_experts=8, hidden=256, widths=(64, 64), rank=16,
                             naive=False, sorted_len=256, block_m=16, mul_routed_weight=False, shared_a=False,
                             dtypes=("bfloat16",) * 3, pdl=pdl)
    monkeypatch.delenv("LORA_CORE_PDL", raising=False)
    p = plan(True)
    assert p.constexprs["USE_PDL"] is HAVE_PDL
    assert p.phase(1).launch_pdl is HAVE_PDL and p.phase(0).launch_pdl is False
    assert plan(False).constexprs["USE_PDL"] is False and plan(False).phase(1).launch_pdl is False
    monkeypatch.setenv("LORA_CORE_PDL", "0")
    assert plan(True).phase(1).launch_pdl is False
