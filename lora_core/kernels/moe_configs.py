"""Launch configurations of the mixture-of-experts LoRA kernel (`moe_lora`), per shape bucket and per device.

A config (`MoeConfig`) holds every tile and launch choice of one call; configs never change the
semantics (which pairs are read and written, the float32 accumulation), only the work split:

  shrink: BLOCK_K (hidden elements per loop trip), R_CHUNK (rank columns per program), K_SPLIT
          (hidden parts, each its own partial-sum plane; 0: from the target program count),
          num_warps, num_stages;
  expand: BLOCK_N (output columns per tile), TILES_N (tiles per program, one rank row sum for
          all of them; 0: from the target program count), num_warps, num_stages;
  GEMV:   the naive order's programs as vector products (one pair, no 16-row tile);
  BLOCK_M: the sorted order's rows per program, a divisor of the alignment's block size (0: the
          whole block): a 64-row block in sub-blocks of 16 or 32 rows pays for fewer padded rows
          where the (adapter, expert) runs are short, at the cost of more loads of A and B;
  PERSIST: the sorted order's programs, PERSIST per block `live_blocks` expects (at most the
          routing-free bound on the blocks), each looping over the blocks that many programs
          apart (0: one program per block of the bound: most find no block and return). The
          bound counts a run for every (slot, expert), 4096 at 32 slots of 128 experts: a grid
          that large spends its time starting programs without work.

A bucket is (pair order, pairs, rank, hidden, widest output, slices): `bucket_key` writes it
"naive/p64/r64/k4096/n14336/s2" or "sorted16/...": the order (naive, or sorted in blocks of
BLOCK_M), the pair count rounded up to a power of two (at least 16), the rank rounded up to a
power of two (at least 16), the exact sizes of the layer. Model layers have a handful of shapes, so
exact sizes key them; a shape without an entry gets `default_moe_config`.

Where the configs come from: `tuned/<device name>_moe.json` beside this file (e.g.
`NVIDIA_H200_moe.json`, written by `benchmarks/tune_moe_lora.py`), for the GPU present, loaded at
first use and cached; LORA_CORE_MOE_TABLE names another file of the same format instead. Format:

    {"device": "NVIDIA H200", "format": 1,
     "buckets": {"naive/p64/r64/k4096/n14336/s2": {"BLOCK_K": 128, "R_CHUNK": 64, ...}, ...}}

a bucket's entry may name only some fields: the others come from the default. A shape whose
bucket has no entry borrows the tile fields of the nearest tuned pair count of its order and sizes
(`table_entry`: K_SPLIT and TILES_N then follow its own program count). Under Triton's
interpreter (CPU tests) the table is never read. `override_moe_config` runs a block of launches
under one given config (the tuner's candidates).

The default (`default_moe_config`), from the bytes each program moves and the programs per SM:
  * naive order: GEMV; the whole rank (up to 64) per shrink program, so a pair's x row is read
    once per hidden part, and tiles of a fixed element count (BLOCK_K = GEMV_SHRINK_TILE / rank
    chunk, BLOCK_N = GEMV_EXPAND_TILE / rank) so that rank 64 does not take 4x the programs of
    rank 16;
  * sorted order: tl.dot on BLOCK_M-row tiles; the whole rank per shrink program (a block's x
    rows read once); blocks of 16 rows: BLOCK_K 128 up to rank 32, 64 above, BLOCK_N 256 / 128,
    4 warps; blocks of 64 rows: BLOCK_K 64, BLOCK_N 128 / 64, 8 warps (a 64-row tile's gathered
    row pointers and dot operands fill a 4-warp program's registers);
  * sorted order: BLOCK_M 0 (the alignment's block: `moe_order.moe_block_size` already sizes it
    by the pairs per expert) and PERSIST 2;
  * both: K_SPLIT and TILES_N from TARGET_PER_SM programs per SM (`device_sm_count`, else
    FALLBACK_SMS): the hidden split until the shrink has that many programs (parts of at least
    MIN_K_PER elements, at most MAX_K_SPLIT planes, MAX_K_SPLIT_NAIVE in the naive order, whose
    planes are single rows), the expand's tiles grouped until it has about that many; TILES_N a
    power of two (few compiled variants), so programs past the width return at once.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import os
import re

import triton

from .. import safe_json
from .configs import TUNED_DIR, device_name, device_sm_count, interpreting, next_pow2, tuned_file

_LOG = logging.getLogger("lora_core")

TARGET_PER_SM = 4          # programs per SM the K split and the tile grouping aim at
FALLBACK_SMS = 132         # SMs assumed without a CUDA driver to ask
MIN_K_PER = 256            # hidden elements per shrink program at least
MAX_K_SPLIT = 16           # partial-sum planes per slice at most (the expand adds them, unrolled)
MAX_K_SPLIT_NAIVE = 32     # the naive order's: a pair's planes are single rank rows
GEMV_SHRINK_TILE = 4096    # elements of one GEMV shrink tile (rank chunk x BLOCK_K)
GEMV_EXPAND_TILE = 8192    # elements of one GEMV expand tile (BLOCK_N x rank)
FIELDS = ("BLOCK_K", "R_CHUNK", "K_SPLIT", "shrink_warps", "shrink_stages",
          "BLOCK_N", "TILES_N", "expand_warps", "expand_stages", "GEMV", "BLOCK_M", "PERSIST")


@dataclasses.dataclass(frozen=True)
class MoeConfig:
    """Every tile and launch choice of one MoE LoRA call (see the module docstring). K_SPLIT and
    TILES_N 0 mean "from the target program count" (`resolve`); BLOCK_M 0, the alignment's block;
    PERSIST 0, one program per block of the bound."""

    BLOCK_K: int
    R_CHUNK: int
    K_SPLIT: int
    shrink_warps: int
    shrink_stages: int
    BLOCK_N: int
    TILES_N: int
    expand_warps: int
    expand_stages: int
    GEMV: bool
    BLOCK_M: int = 0
    PERSIST: int = 2

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)

    def replace(self, **changes) -> MoeConfig:
        return dataclasses.replace(self, **changes)


def _pow2_at_least(name: str, value, low: int = 1) -> int:
    if not (isinstance(value, int) and not isinstance(value, bool) and value >= low and value & (value - 1) == 0):
        raise ValueError(f"MoE config {name}: expected a power of two >= {low}, got {value!r}")
    return value


def check_config(cfg: MoeConfig, where: str = "MoE config") -> MoeConfig:
    """cfg with every field checked (ValueError naming the field): tile sizes powers of two (tl.dot's
    and tl.arange's rule), K_SPLIT and TILES_N >= 0, warps 1-16 a power of two, stages 1-8."""
    try:
        _pow2_at_least("BLOCK_K", cfg.BLOCK_K, 16)
        _pow2_at_least("R_CHUNK", cfg.R_CHUNK, 16)
        _pow2_at_least("BLOCK_N", cfg.BLOCK_N, 16)
        for name in ("shrink_warps", "expand_warps"):
            if _pow2_at_least(name, getattr(cfg, name)) > 16:
                raise ValueError(f"MoE config {name}: expected at most 16, got {getattr(cfg, name)}")
        for name in ("K_SPLIT", "TILES_N"):
            v = getattr(cfg, name)
            if not (isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= 1024):
                raise ValueError(f"MoE config {name}: expected an int in 0..1024, got {v!r}")
        for name in ("shrink_stages", "expand_stages"):
            v = getattr(cfg, name)
            if not (isinstance(v, int) and not isinstance(v, bool) and 1 <= v <= 8):
                raise ValueError(f"MoE config {name}: expected an int in 1..8, got {v!r}")
        if cfg.BLOCK_M != 0 and not (isinstance(cfg.BLOCK_M, int) and not isinstance(cfg.BLOCK_M, bool)
                                     and cfg.BLOCK_M >= 16 and cfg.BLOCK_M & (cfg.BLOCK_M - 1) == 0):
            raise ValueError(f"MoE config BLOCK_M: expected 0 or a power of two >= 16, got {cfg.BLOCK_M!r}")
        if not (isinstance(cfg.PERSIST, int) and not isinstance(cfg.PERSIST, bool) and 0 <= cfg.PERSIST <= 64):
            raise ValueError(f"MoE config PERSIST: expected an int in 0..64, got {cfg.PERSIST!r}")
        if not isinstance(cfg.GEMV, bool):
            raise ValueError(f"MoE config GEMV: expected a bool, got {cfg.GEMV!r}")
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None
    return cfg


@dataclasses.dataclass(frozen=True)
class MoeShape:
    """What a MoE LoRA call's config depends on: the pair order and sizes (never the routing)."""

    num_pairs: int
    naive: bool
    block_m: int
    num_slots: int
    num_experts: int
    hidden: int
    widest: int
    slices: int
    shrink_slices: int
    rank: int

    @property
    def block_r(self) -> int:
        return max(16, next_pow2(self.rank))


def bucket_key(shape: MoeShape) -> str:
    """The table key of a call's shape, e.g. "sorted16/p512/r64/k4096/n14336/s2" (module docstring)."""
    order = "naive" if shape.naive else f"sorted{shape.block_m}"
    return (f"{order}/p{max(16, next_pow2(shape.num_pairs))}/r{shape.block_r}/k{shape.hidden}/n{shape.widest}"
            f"/s{shape.slices}")


def sm_count() -> int:
    return device_sm_count() or FALLBACK_SMS


def default_moe_config(shape: MoeShape) -> MoeConfig:
    """The config a shape gets without a table entry (module docstring); K_SPLIT and TILES_N 0."""
    br = shape.block_r
    if interpreting():
        # The interpreter's cost is per program and per loop trip: large tiles, the naive order's
        # rank in 16-wide chunks and the dot path kept reachable by tests through overrides.
        return MoeConfig(BLOCK_K=128, R_CHUNK=16 if shape.naive else br, K_SPLIT=0, shrink_warps=4,
                         shrink_stages=1, BLOCK_N=64, TILES_N=0, expand_warps=4, expand_stages=1, GEMV=shape.naive)
    if shape.naive:
        r_chunk = min(br, 64)
        block_k = max(32, min(512, GEMV_SHRINK_TILE // r_chunk))
        block_n = max(32, min(512, GEMV_EXPAND_TILE // br))
        # A narrow rank's B tile is BLOCK_N rows of a few elements each: 8 warps hold it in fewer
        # registers a thread (more programs resident), a rank-64 tile fits 4.
        return MoeConfig(BLOCK_K=block_k, R_CHUNK=r_chunk, K_SPLIT=0, shrink_warps=4, shrink_stages=3,
                         BLOCK_N=block_n, TILES_N=0, expand_warps=8 if br <= 32 else 4, expand_stages=3, GEMV=True)
    bm = shape.block_m
    if bm >= 64:
        # 64-row tiles: 8 warps for both launches (the gathered rows' pointer tiles and the tf32 /
        # split-bfloat16 operands fill a 4-warp program's registers), narrower B tiles at rank 64.
        return MoeConfig(BLOCK_K=64, R_CHUNK=min(br, 128), K_SPLIT=0, shrink_warps=8, shrink_stages=3,
                         BLOCK_N=128 if br <= 32 else 64, TILES_N=0, expand_warps=8, expand_stages=2, GEMV=False)
    return MoeConfig(BLOCK_K=128 if br <= 32 else 64, R_CHUNK=min(br, 128), K_SPLIT=0, shrink_warps=4,
                     shrink_stages=3, BLOCK_N=256 if br <= 32 else 128, TILES_N=0, expand_warps=4, expand_stages=2,
                     GEMV=False)


def live_blocks(shape: MoeShape, block_m: int | None = None) -> int:
    """Blocks with work to expect without reading the routing: every pair (naive), else one block
    per block_m pairs (default: the alignment's block) plus a partial block per expert of one
    adapter (few adapters: the common case)."""
    if shape.naive:
        return max(1, shape.num_pairs)
    rows = block_m or shape.block_m
    return max(1, triton.cdiv(shape.num_pairs, rows) + min(shape.num_experts, shape.num_pairs))


def rows_per_block(cfg: MoeConfig, shape: MoeShape) -> int:
    """The rows one program takes: 16 in the naive order, else the config's BLOCK_M clipped to the
    alignment's block (0: the whole block)."""
    if shape.naive:
        return 16
    return min(cfg.BLOCK_M or shape.block_m, shape.block_m)


@dataclasses.dataclass(frozen=True)
class Resolved:
    """A config with its derived sizes: the kernel's BLOCK_M (rows per program), BLOCK_K, R_CHUNK,
    K_SPLIT, K_PER, BLOCK_N, TILES_N and N_PROGRAMS (expand programs per slice)."""

    config: MoeConfig
    block_m: int
    block_k: int
    r_chunk: int
    k_split: int
    k_per: int
    block_n: int
    tiles_n: int
    n_programs: int


def resolve(cfg: MoeConfig, shape: MoeShape, *, sms: int | None = None) -> Resolved:
    """cfg's K_SPLIT / TILES_N 0 resolved for `shape`, every size clipped to the shape (module docstring)."""
    target = TARGET_PER_SM * (sms or sm_count())
    br = shape.block_r
    block_m = rows_per_block(cfg, shape)
    live = live_blocks(shape, block_m)
    r_chunk = min(cfg.R_CHUNK, br)
    block_k = min(cfg.BLOCK_K, max(16, next_pow2(shape.hidden)))
    units = live * shape.shrink_slices * (br // r_chunk)
    cap = MAX_K_SPLIT_NAIVE if shape.naive else MAX_K_SPLIT
    k_split = cfg.K_SPLIT
    if k_split == 0:
        k_split = max(1, min(cap, shape.hidden // MIN_K_PER, triton.cdiv(target, units)))
    k_split = max(1, min(k_split, cap, triton.cdiv(shape.hidden, block_k)))
    k_per = triton.cdiv(triton.cdiv(shape.hidden, k_split), block_k) * block_k
    k_split = triton.cdiv(shape.hidden, k_per)
    block_n = min(cfg.BLOCK_N, max(16, next_pow2(shape.widest)))
    n_tiles = triton.cdiv(shape.widest, block_n)
    tiles_n = cfg.TILES_N
    if tiles_n == 0:
        programs = max(1, min(n_tiles, triton.cdiv(target, live * shape.slices)))
        tiles_n = next_pow2(triton.cdiv(n_tiles, programs))
    tiles_n = max(1, min(tiles_n, next_pow2(n_tiles)))
    return Resolved(cfg, block_m, block_k, r_chunk, k_split, k_per, block_n, tiles_n, triton.cdiv(n_tiles, tiles_n))


# ----------------------------------------------------------------------------- the per-device table

def table_file(device: str) -> str:
    return os.path.join(TUNED_DIR, re.sub(r"[^A-Za-z0-9]+", "_", device).strip("_") + "_moe.json")


def read_table(path: str) -> dict:
    """{bucket key: {field: value}} of a MoE table file, every entry checked against the default fields."""
    with open(path) as f:
        data = safe_json.load(f, path)
    buckets = data.get("buckets") if isinstance(data, dict) else None
    if not isinstance(buckets, dict):
        raise ValueError(f"{path}: expected {{\"buckets\": {{key: config, ...}}}}, got {type(data).__name__}")
    probe = MoeConfig(BLOCK_K=64, R_CHUNK=16, K_SPLIT=0, shrink_warps=4, shrink_stages=3, BLOCK_N=64, TILES_N=0,
                      expand_warps=4, expand_stages=3, GEMV=False)
    for key, entry in buckets.items():
        if not isinstance(entry, dict) or set(entry) - set(FIELDS):
            raise ValueError(f"{os.path.basename(path)} bucket {key}: expected an object with fields among "
                             f"{FIELDS}, got {entry!r}")
        check_config(probe.replace(**entry), f"{os.path.basename(path)} bucket {key}")
    return {k: dict(v) for k, v in buckets.items()}


@functools.cache
def table(device: str | None) -> dict:
    """The MoE table of a device by name: LORA_CORE_MOE_TABLE's file if set, else its tuned file, else {}."""
    path, from_env = tuned_file("LORA_CORE_MOE_TABLE", table_file(device) if device else None, "MoE launch table")
    if path is None:
        if device:
            _LOG.info("MoE launch configs: no tuned table for %s (%s): defaults", device,
                      os.path.basename(table_file(device)))
        return {}
    found = read_table(path)
    if from_env:
        _LOG.info("MoE launch configs: %s (LORA_CORE_MOE_TABLE, %d buckets)", path, len(found))
    else:
        _LOG.info("MoE launch configs: %s (%d buckets)", os.path.basename(path), len(found))
    return found


_OVERRIDE: list = []


@contextlib.contextmanager
def override_moe_config(cfg: MoeConfig):
    """Plans the block's MoE LoRA calls with `cfg` (process-wide, nestable; deterministic plans
    keep their fixed config). Torch plans at every call; JAX plans while tracing."""
    if not isinstance(cfg, MoeConfig):
        raise TypeError(f"override_moe_config: expected a MoeConfig, got {type(cfg).__name__}")
    _OVERRIDE.append(check_config(cfg))
    try:
        yield cfg
    finally:
        _OVERRIDE.pop()


def table_entry(buckets: dict, shape: MoeShape) -> dict:
    """The fields a table gives a shape: its bucket's entry; else the entry of the nearest pair count
    of the same order, rank and sizes (an untuned batch size between tuned ones) without its
    K_SPLIT and TILES_N, which the shape's own program count decides; else {}."""
    key = bucket_key(shape)
    if key in buckets:
        return dict(buckets[key])
    order, pairs, *rest = key.split("/")
    want = int(pairs[1:])
    near = []
    for other, entry in buckets.items():
        o_order, o_pairs, *o_rest = other.split("/")
        if o_order == order and o_rest == rest and o_pairs[1:].isdigit():
            near.append((abs(int(o_pairs[1:]).bit_length() - want.bit_length()), int(o_pairs[1:]), entry))
    if not near:
        return {}
    entry = min(near, key=lambda n: (n[0], n[1]))[2]
    return {k: v for k, v in entry.items() if k not in ("K_SPLIT", "TILES_N")}


def moe_config(shape: MoeShape, *, device: str | None = None) -> MoeConfig:
    """The config of a call: the innermost override, else the device table's entry for the shape
    (`table_entry`) over the default, else the default."""
    if _OVERRIDE:
        return _OVERRIDE[-1]
    base = default_moe_config(shape)
    if interpreting():
        return base
    entry = table_entry(table(device if device is not None else device_name()), shape)
    return base.replace(**entry) if entry else base
