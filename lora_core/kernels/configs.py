"""Launch configurations for the Triton LoRA kernels, per shape class (tuned on the H200).

A shape class is (token class, rank class): tokens T in <=16, <=64, <=256, <=1024, <=4096, larger; rank
(the stacked weights' rank) in <=16, <=64, larger. The dicts below are hand-written defaults; the
tuned table, `tuned_h200.json` beside this file, is written by `benchmarks/tune_triton.py` on the
lent H200 and overrides them when present (TUNED_ON says which is in use). Configs change block
shapes, warps, stages and the fused/two-kernel choice, never the semantics. `SPLIT_K = 0` means "choose from
the grid": enough splits of the hidden size that about TARGET_PROGRAMS programs run (decode sizes,
where a handful of adapters would otherwise leave most SMs idle).

`use_fused(...)` decides between the one-launch fused kernel and shrink + expand: the tuner times
both per decode class and keeps the fused kernel where it wins (on the H200, 2026-11-30, since
session 8: one slice at rank 16, 17-64 tokens, <= 16 slots; see docs/benchmarks.md); an entry's
"use_fused" (or a variant's) overrides the figures, and a single token
never uses it (FUSED_MIN_TOKENS). A table entry may carry `variants`: configs for launches with at
most `max_slots` adapter slots and at least `min_slices` slices (VARIANTS; both are static). `use_prefetch(...)`
decides where the shrink prefetches its weights into L2 before its PDL wait. For T > 128 the split-K count is capped (workspace re-reads).
Under Triton's interpreter (CPU tests) large tiles are used instead: the interpreter's cost is per
program and per loop trip, not per element.
"""

from __future__ import annotations

import json
import os

from .planning import PREFETCH_SWITCH, interpreting, next_pow2

TARGET_PROGRAMS = 264  # two waves of the H200's 132 SMs
# At most this many split-K planes from the SPLIT_K = 0 rule: the expand sums every plane of its
# rows, a cost the shrink's extra parallelism must pay for. Measured on the H200 (2026-11-30,
# benchmarks/results/split_cap_20261130, decode T <= 128, D <= 8): caps 2 / 4 / 8 / 16 / 32 gave
# 14.5 / 8.9 / 6.7 / 6.9 / 10.0 us for T1 D1 r16 with one slice; 8 was best or within noise of
# the best in most cases. JAX_LORA_TRITON_SPLIT_CAP overrides it (tuning runs).
SPLIT_CAP = int(os.environ.get("JAX_LORA_TRITON_SPLIT_CAP", "8"))

# One token means one adapter: the two-kernel path (its expand's B tile staged through shared
# memory, B_SELECT) beats the fused kernel's barrier there. H200, 2026-11-30 17:50
# (benchmarks/results/explore_b_select_fused_20261130T1750.json): T1 D1 r16 3.43 vs 3.62 us (s1), 3.49 vs 3.65 (s3).
FUSED_MIN_TOKENS = 2

_TOKEN_CLASSES = ((16, "t16"), (64, "t64"), (256, "t256"), (1024, "t1024"), (4096, "t4096"))
_RANK_CLASSES = ((16, "r16"), (64, "r64"))


def token_class(num_tokens: int) -> str:
    for bound, name in _TOKEN_CLASSES:
        if num_tokens <= bound:
            return name
    return "tbig"


def rank_class(rank: int) -> str:
    for bound, name in _RANK_CLASSES:
        if rank <= bound:
            return name
    return "r256"


def _s(bm, bk, split, warps, stages):
    return dict(BLOCK_M=bm, BLOCK_K=bk, SPLIT_K=split, num_warps=warps, num_stages=stages)


def _e(bm, bn, br, warps, stages):
    return dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_R=br, num_warps=warps, num_stages=stages)


def _f(bm, bn, bk, warps, stages, split=0):
    return dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, SPLIT_K=split, num_warps=warps, num_stages=stages)


# (token class, rank class) -> config. BEGIN TABLE (rewritten by benchmarks/tune_triton.py)
SHRINK = {
    ("t16", "r16"): _s(16, 256, 0, 4, 2), ("t16", "r64"): _s(16, 128, 0, 4, 2),
    ("t16", "r256"): _s(16, 64, 0, 4, 2),
    ("t64", "r16"): _s(16, 256, 0, 4, 2), ("t64", "r64"): _s(16, 128, 0, 4, 2),
    ("t64", "r256"): _s(16, 64, 0, 4, 2),
    ("t256", "r16"): _s(16, 256, 0, 4, 2), ("t256", "r64"): _s(16, 128, 0, 4, 2),
    ("t256", "r256"): _s(16, 64, 0, 4, 2),
    ("t1024", "r16"): _s(32, 128, 0, 4, 3), ("t1024", "r64"): _s(32, 128, 0, 4, 3),
    ("t1024", "r256"): _s(32, 64, 0, 4, 3),
    ("t4096", "r16"): _s(64, 128, 0, 4, 3), ("t4096", "r64"): _s(64, 64, 0, 4, 4),
    ("t4096", "r256"): _s(64, 64, 0, 8, 3),
    ("tbig", "r16"): _s(64, 128, 0, 4, 3), ("tbig", "r64"): _s(64, 128, 0, 4, 3),
    ("tbig", "r256"): _s(64, 64, 0, 8, 3),
}
EXPAND = {
    ("t16", "r16"): _e(16, 128, 16, 4, 2), ("t16", "r64"): _e(16, 128, 64, 4, 2),
    ("t16", "r256"): _e(16, 64, 64, 4, 2),
    ("t64", "r16"): _e(16, 128, 16, 4, 2), ("t64", "r64"): _e(16, 128, 64, 4, 2),
    ("t64", "r256"): _e(16, 64, 64, 4, 2),
    ("t256", "r16"): _e(16, 128, 16, 4, 2), ("t256", "r64"): _e(16, 128, 64, 4, 2),
    ("t256", "r256"): _e(16, 64, 64, 4, 2),
    ("t1024", "r16"): _e(32, 128, 16, 4, 2), ("t1024", "r64"): _e(32, 128, 64, 4, 2),
    ("t1024", "r256"): _e(32, 128, 64, 4, 2),
    ("t4096", "r16"): _e(64, 128, 16, 4, 2), ("t4096", "r64"): _e(128, 64, 64, 4, 2),
    ("t4096", "r256"): _e(64, 128, 64, 8, 2),
    ("tbig", "r16"): _e(64, 128, 16, 4, 2), ("tbig", "r64"): _e(64, 128, 64, 4, 2),
    ("tbig", "r256"): _e(64, 128, 64, 8, 2),
}
FUSED = {
    ("t16", "r16"): _f(16, 128, 128, 4, 2), ("t16", "r64"): _f(16, 128, 128, 4, 2, 8),
    ("t64", "r16"): _f(16, 128, 128, 4, 2), ("t64", "r64"): _f(16, 128, 128, 4, 2, 8),
}
FUSED_CLASSES = set()  # shape classes where the one-launch fused kernel wins (the tuned table says)
# END TABLE
# (token class, rank class) -> [(max_slots, min_slices, {"shrink"/"expand"/"fused": config,
# "use_fused": bool})]: a class's configs for launches with at most max_slots adapter slots
# (max_loras) and at least min_slices slices, first match wins. Both are static (the slot count
# sizes the weight stacks, the slice count is the layer's), so the launch shape still never
# depends on the mapping. Few slots means many tokens per adapter, which wants larger token tiles
# (measured on the H200: T = 320-1024, rank 64, <= 16 slots ran 1.3-1.7x faster with 64-token
# expand tiles, and 1.7x slower with 64 slots; benchmarks/results/explore_*_20261130T15*); three
# slices triple the shrink's programs and the workspace, which wants fewer splits (rank-64 prefill).
VARIANTS: dict = {}
ANY_SLOTS = 1 << 30  # a variant without max_slots applies to any slot count


def _load_tuned(path: str) -> str:
    """Overrides the defaults above with the table `benchmarks/tune_triton.py` wrote (JSON)."""
    global FUSED_CLASSES
    try:
        with open(path) as f:
            tuned = json.load(f)
    except (OSError, ValueError):
        return "defaults (no tuned table)"
    for key, entry in tuned["best"].items():
        k = tuple(key.split("/"))
        SHRINK[k] = dict(entry["shrink"])
        EXPAND[k] = dict(entry["expand"])
        if entry.get("fused"):
            FUSED[k] = dict(entry["fused"])
        VARIANTS[k] = [(int(v.get("max_slots", ANY_SLOTS)), int(v.get("min_slices", 1)),
                        {n: v[n] for n in ("shrink", "expand", "fused", "use_fused") if n in v})
                       for v in entry.get("variants", ())]
    FUSED_CLASSES = {tuple(k.split("/")) for k, e in tuned["best"].items()
                     if e.get("use_fused", e.get("fused_us", float("inf")) < e["two_kernel_us"])}
    return f"{tuned.get('device', '?')} ({os.path.basename(path)}, {tuned.get('date', '?')})"


TUNED_ON = _load_tuned(os.path.join(os.path.dirname(os.path.abspath(__file__)), "tuned_h200.json"))


def _variant(num_tokens: int, rank: int, num_slots: int, num_slices: int) -> dict:
    """The first VARIANTS entry of the shape class that applies to num_slots slots and num_slices
    slices ({} if none)."""
    for max_slots, min_slices, overrides in VARIANTS.get((token_class(num_tokens), rank_class(rank)), ()):
        if num_slots <= max_slots and num_slices >= min_slices:
            return overrides
    return {}


def _estimated_tiles(num_tokens: int, num_slots: int, block_m: int) -> int:
    """Busy token tiles to expect without reading the mapping: one per adapter at decode sizes,
    cdiv(T, BLOCK_M) at prefill sizes (the launch shape may not depend on the mapping)."""
    return max(1, min(num_tokens, num_slots), -(-num_tokens // block_m))


def table_shrink_config(num_tokens: int, rank: int, num_slices: int, num_slots: int) -> dict:
    """The table's shrink config for a launch as written (SPLIT_K 0 and TARGET not yet resolved)."""
    return dict(_variant(num_tokens, rank, num_slots, num_slices).get("shrink")
                or SHRINK[(token_class(num_tokens), rank_class(rank))])


def shrink_config(num_tokens: int, hidden: int, rank: int, num_slices: int, num_slots: int) -> dict:
    if interpreting():
        return _s(16, min(256, max(16, next_pow2(hidden))), 1, 4, 1)
    return resolve_split(table_shrink_config(num_tokens, rank, num_slices, num_slots), num_tokens, hidden, rank,
                         num_slices, num_slots)


def use_prefetch(num_tokens: int, rank: int) -> bool:
    """Whether the shrink prefetches its A chunk into L2 before waiting for the kernel before it
    (PDL launches only). Measured on the H200 (2026-11-30 13:48, the whole sweep with and without,
    benchmarks/results/triton_h200_20261130T1348_prefetch_on / _1349_prefetch_off): 2-11% faster
    for T <= 16 and for T <= 256 at rank 16 (few adapters); up to 40% slower at T = 32 with 8
    adapters and 10-20% slower at rank 64 from T = 128 on (many programs prefetching the same
    chunks). JAX_LORA_TRITON_PREFETCH=0 / 1 turns it off / on everywhere (experiments)."""
    if PREFETCH_SWITCH in ("0", "1"):
        return PREFETCH_SWITCH == "1"
    return num_tokens <= 16 or (num_tokens <= 256 and rank <= 16 and num_tokens > 64)


def resolve_split(cfg: dict, num_tokens: int, hidden: int, rank: int, num_slices: int, num_slots: int) -> dict:
    """cfg (a shrink config) with SPLIT_K = 0 resolved and the split caps applied (in place);
    PREFETCH (use_prefetch) set unless the config says. A config's TARGET (programs the SPLIT_K = 0
    rule aims at; TARGET_PROGRAMS if absent) is consumed here; a config that names its TARGET is
    not subject to the T > 128 caps below (a tuned choice, measured with the expand that sums
    the planes once per program: lora_expand_kernel with TILES_N > 1)."""
    cfg.setdefault("PREFETCH", use_prefetch(num_tokens, rank))
    own_target = "TARGET" in cfg
    target = int(cfg.pop("TARGET", TARGET_PROGRAMS))
    chunks = max(1, -(-hidden // cfg["BLOCK_K"]))
    if cfg["SPLIT_K"] == 0:
        programs_per_tile = 1 if cfg.get("ALL_SLICES") else num_slices
        busy = programs_per_tile * _estimated_tiles(num_tokens, num_slots, cfg["BLOCK_M"])
        cfg["SPLIT_K"] = max(1, min(chunks, target // busy, SPLIT_CAP))
        if num_tokens > 128 and not own_target:
            # Past decode sizes every expand program re-reads its rows of all SPLIT_K workspace
            # planes (SPLIT_K * rank floats per token per output tile): keep that below ~1 KB per
            # token, and at prefill sizes with rank >= 64 do not split at all (measured: T=2048,
            # rank 64 ran 49 us unsplit, 68 us with 4 splits; T=512, rank 64 ran 31 us with 16
            # splits, 18.6 us with 4). A table entry with an explicit SPLIT_K (tuned) is kept.
            cap = 1 if (num_tokens > 1024 and rank >= 64) else 256 // max(rank, 1)
            cfg["SPLIT_K"] = max(1, min(cfg["SPLIT_K"], cap))
    cfg["SPLIT_K"] = max(1, min(cfg["SPLIT_K"], chunks))
    return cfg


def expand_config(num_tokens: int, width: int, rank: int, num_slices: int, num_slots: int) -> dict:
    if interpreting():
        return _e(16, min(256, max(16, next_pow2(width))), 64, 4, 1)
    return dict(_variant(num_tokens, rank, num_slots, num_slices).get("expand") or EXPAND[(token_class(num_tokens), rank_class(rank))])


def fused_config(num_tokens: int, hidden: int, width: int, rank: int, num_slices: int,
                 num_slots: int) -> dict:
    if interpreting():
        return _f(16, min(256, max(16, next_pow2(width))), min(256, max(16, next_pow2(hidden))), 4, 1, 0)
    key = (token_class(num_tokens), rank_class(rank))
    return dict(_variant(num_tokens, rank, num_slots, num_slices).get("fused") or FUSED.get(key, _f(16, 128, 128, 4, 2)))


# JAX_LORA_TRITON_FUSED=1 / 0 forces the fused kernel on / off where `linear` is not told
# (benchmarks, experiments); unset or "auto": the table decides.
_FORCE_FUSED = os.environ.get("JAX_LORA_TRITON_FUSED", "auto")


def fused_forced():
    """True / False when JAX_LORA_TRITON_FUSED forces the fused kernel on / off, else None."""
    return None if _FORCE_FUSED not in ("0", "1") else _FORCE_FUSED == "1"


def use_fused(num_tokens: int, hidden: int, rank: int, num_slices: int, num_slots: int) -> bool:
    """True when the one-launch fused kernel is expected to beat shrink + expand (decode sizes).
    The fused kernel needs the whole rank in one block (rank <= 64 here)."""
    if rank > 64:
        return False
    if _FORCE_FUSED in ("0", "1"):
        return _FORCE_FUSED == "1"
    if num_tokens < FUSED_MIN_TOKENS:
        return False
    variant = _variant(num_tokens, rank, num_slots, num_slices)
    if "use_fused" in variant:
        return bool(variant["use_fused"])
    return (token_class(num_tokens), rank_class(rank)) in FUSED_CLASSES
