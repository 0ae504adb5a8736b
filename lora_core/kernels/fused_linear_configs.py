"""Launch configs of the fused linear kernels (`gemm_lora`, `rms_norm_shrink`), by row count M: the
tables both frameworks' launchers read (torch_lora.ops.fused_linear, jax_lora.ops.fused_linear).

`gemm_config(m, widths)` is GEMM_CONFIGS' entry for M rows with BLOCK_N halved until every output
slice but the last is a whole number of column tiles (the kernel's one-slice-per-tile rule);
`norm_shrink_config(m, rank)` is NORM_SHRINK_CONFIGS' entry with, in rows mode, BLOCK_K shrunk
with the rank.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Sequence

from .planning import next_pow2

__all__ = ["GEMM_CONFIGS", "NORM_SHRINK_CONFIGS", "gemm_config", "norm_shrink_config"]

_LOG = logging.getLogger("lora_core")

# UNTUNED DEFAULTS, to be replaced from a GPU run of benchmarks/bench_fused_linear.py (its
# "best config" column per row count). Key: the largest M (rows) a config serves.
GEMM_CONFIGS = {
    # decode: 32-wide column tiles, so that N = 4096 (o, down) makes 128 programs for the 132 SMs
    16: dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=128, SPLIT_K=1, num_warps=4, num_stages=5, LORA_MODE="rows"),
    32: dict(BLOCK_M=32, BLOCK_N=32, BLOCK_K=128, SPLIT_K=1, num_warps=4, num_stages=5, LORA_MODE="rows"),
    64: dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=64, num_warps=4, num_stages=4, LORA_MODE="slots"),
    128: dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, num_warps=4, num_stages=4, LORA_MODE="slots"),
    256: dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, num_warps=8, num_stages=3, LORA_MODE="slots"),
    1 << 62: dict(BLOCK_M=128, BLOCK_N=256, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=3, LORA_MODE="slots"),
}
# UNTUNED DEFAULTS, as above. SPLIT_K is P, the planes of the shrink buffer (decode: the hidden size
# is split so that enough programs read the adapters' A).
NORM_SHRINK_CONFIGS = {
    1: dict(BLOCK_M=2, BLOCK_K=64, SPLIT_K=32, num_warps=2, num_stages=2, LORA_MODE="rows"),
    8: dict(BLOCK_M=2, BLOCK_K=64, SPLIT_K=16, num_warps=4, num_stages=2, LORA_MODE="rows"),
    32: dict(BLOCK_M=4, BLOCK_K=64, SPLIT_K=16, num_warps=4, num_stages=2, LORA_MODE="rows"),
    256: dict(BLOCK_M=16, BLOCK_K=128, SPLIT_K=4, num_warps=4, num_stages=2, LORA_MODE="slots"),
    1 << 62: dict(BLOCK_M=64, BLOCK_K=64, SPLIT_K=1, num_warps=4, num_stages=2, LORA_MODE="slots"),
}


def _bucket(table: dict, m: int) -> dict:
    return dict(table[min(k for k in table if m <= k)])


def gemm_config(m: int, widths: Sequence[int]) -> dict:
    """The table's config for M rows, BLOCK_N halved (logged) until every slice but the last is a
    whole number of column tiles."""
    cfg = _bucket(GEMM_CONFIGS, m)
    while cfg["BLOCK_N"] > 16 and any(w % cfg["BLOCK_N"] for w in widths[:-1]):
        cfg["BLOCK_N"] //= 2
    if cfg != _bucket(GEMM_CONFIGS, m):
        _log_block_n(m, tuple(widths), cfg["BLOCK_N"])
    return cfg


@functools.cache
def _log_block_n(m: int, widths: tuple, block_n: int) -> None:
    _LOG.info("gemm_lora: BLOCK_N %d for M=%d (output slices %s are not multiples of the table's)", block_n, m, widths)


def norm_shrink_config(m: int, rank: int) -> dict:
    """The table's config for M rows; in rows mode BLOCK_K shrinks with the rank (the gathered A
    tile is BLOCK_M x rank x BLOCK_K)."""
    cfg = _bucket(NORM_SHRINK_CONFIGS, m)
    if cfg["LORA_MODE"] == "rows":
        cfg["BLOCK_K"] = max(16, min(cfg["BLOCK_K"], 4096 // (cfg["BLOCK_M"] * max(16, next_pow2(rank)))))
    return cfg
