"""Launch configs of the fused linear kernels (`gemm_lora`, `rms_norm_shrink`), by row count M, and
the per-device choice between the fused LoRA linear and today's path: the tables both frameworks'
launchers read (torch_lora.ops.fused_linear, jax_lora.ops.fused_linear).

`gemm_config(m, widths, k, rank)` is the tuned table's config for the layer (K, widths) at M rows
and the rank when the device has one (below), else GEMM_CONFIGS' entry for M rows; either with
BLOCK_N halved until every output slice but the last is a whole number of column tiles (the
kernel's one-slice-per-tile rule). `norm_shrink_config(m, rank)` is NORM_SHRINK_CONFIGS' entry
with, in rows mode, BLOCK_K shrunk with the rank.

The tuned table: `tuned/<device name>_fused_linear.json` beside this file (e.g.
`NVIDIA_H200_fused_linear.json`, written by `benchmarks/tune_fused_linear.py`) for the GPU present,
read at first use and cached; LORA_CORE_FUSED_LINEAR_TABLE names another file of the same format
instead. Format:

    {"device": "NVIDIA H200", "format": 1, "margin": 0.02,
     "entries": {"k4096/n4096+1024+1024/m8/r16": {"config": {"BLOCK_M": 16, ...}, "use_fused": false,
                                                  "reason": "...", "fused_us": ..., "today_us": ..., ...,
                                                  "use_norm_fused": true, "norm_reason": "...",
                                                  "norm_us": ..., "today_with_norm_us": ...}}}

An entry's key is the layer (K, the output slices' widths), the M bucket (the smallest of
M_BUCKETS at or above M) and the rank bucket (the rank rounded up to a power of two, at least 16).
`config` is the tuned `gemm_lora` launch (LoRA in the epilogue); `use_fused` says whether the LoRA
linear of that layer, M and rank runs as the fused GEMM (the shrink, then `gemm_lora`) instead of
today's path (the library GEMM, then `add_lora_linear`); the timings and `reason` are what the
tuner decided it from. For a layer whose input is an RMSNorm's output (qkv, gate_up), an entry
may also hold `use_norm_fused`: whether the norm and the LoRA linear run as the fused "norm" path
(`rms_norm_shrink`, the norm with the shrink in one kernel, then `gemm_lora`) instead of the
step's own norm and today's path; `norm_us`, `today_with_norm_us` and `norm_reason` are its
timings and reason. An entry without it (a table of an older tuner, a layer without a norm in
front) means False. The fused GEMM serves LoRA steps only: a step without LoRA keeps the library
GEMM whatever the table says.

`use_fused_linear((k, widths), m, rank)` is that decision: False without a table entry (a shape,
M or rank the table does not hold: today's path, no silent change), logged once per (layer, M
bucket, rank) with its reason through the package logger. `use_norm_fused_linear` is the "norm"
path's decision, read and logged the same way (False without an entry or without the key).
"""

from __future__ import annotations

import functools
import logging
import os
import re
from collections.abc import Sequence

from .. import safe_json
from .configs import TUNED_DIR, device_name, tuned_file
from .planning import next_pow2

__all__ = ["GEMM_CONFIGS", "NORM_SHRINK_CONFIGS", "M_BUCKETS", "gemm_config", "norm_shrink_config",
           "fused_linear_table", "fused_linear_table_file", "read_fused_linear_table", "table_key", "tuned_entry",
           "use_fused_linear", "use_norm_fused_linear"]

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


def gemm_config(m: int, widths: Sequence[int], k: int | None = None, rank: int | None = None, *,
                device: str | None = None, table: dict | None = None) -> dict:
    """The launch config of `gemm_lora` for M rows: the tuned table's (of `device`, default the GPU
    present; or `table`, a `read_fused_linear_table` result) for the layer (k, widths) at M and
    `rank` when k and rank are given and it holds one, else GEMM_CONFIGS' entry for M rows; BLOCK_N
    halved (logged) until every slice but the last is a whole number of column tiles."""
    entry = tuned_entry((k, widths), m, rank, device=device, table=table) if k is not None and rank else None
    base = dict(entry["config"]) if entry else _bucket(GEMM_CONFIGS, m)
    cfg = dict(base)
    while cfg["BLOCK_N"] > 16 and any(w % cfg["BLOCK_N"] for w in widths[:-1]):
        cfg["BLOCK_N"] //= 2
    if cfg != base:
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


# ------------------------------------------------------------------------------ the tuned table

# The row counts the tuned table is keyed by: an entry serves M up to its bucket (M 2..8 read the
# entry of 8); M above the last bucket has no entry (today's path).
M_BUCKETS = (1, 8, 16, 32, 64, 128, 256)
_CONFIG_KEYS = {"BLOCK_M", "BLOCK_N", "BLOCK_K", "GROUP_M", "SPLIT_K", "num_warps", "num_stages", "LORA_MODE",
                "R_CHUNK", "PREFETCH_B"}
_POW2_KEYS = ("BLOCK_M", "BLOCK_N", "BLOCK_K", "num_warps")


def _widths(layer_shape) -> tuple:
    """(k, widths) of a layer shape (k, widths or N)."""
    if not (isinstance(layer_shape, (tuple, list)) and len(layer_shape) == 2):
        raise TypeError(f"layer_shape must be (k, output slice widths), got {layer_shape!r}")
    k, widths = layer_shape
    widths = (widths,) if isinstance(widths, int) else tuple(widths)
    if not (isinstance(k, int) and k >= 1 and widths and all(isinstance(w, int) and w >= 1 for w in widths)):
        raise ValueError(f"layer_shape must be (k >= 1, positive output slice widths), got {layer_shape!r}")
    return k, widths


def m_bucket(m: int) -> int | None:
    """The M bucket of m rows (the smallest of M_BUCKETS >= m), None above the last."""
    return next((b for b in M_BUCKETS if m <= b), None)


def rank_bucket(rank: int) -> int:
    return max(16, next_pow2(int(rank)))


def table_key(layer_shape, m: int, rank: int) -> str | None:
    """The table key of a layer (k, widths) at m rows and a rank, "k4096/n4096+1024+1024/m8/r16";
    None when m is above the last M bucket."""
    k, widths = _widths(layer_shape)
    mb = m_bucket(m)
    if mb is None:
        return None
    return f"k{k}/n{'+'.join(str(w) for w in widths)}/m{mb}/r{rank_bucket(rank)}"


_KEY = re.compile(r"k\d+/n\d+(\+\d+)*/m\d+/r\d+")


def read_fused_linear_table(path: str) -> dict:
    """{key: entry} of a fused linear table file (module docstring), each entry checked: a key as
    `table_key` writes it, a `config` object of the plan's keys with power-of-two block sizes and
    warps, `use_fused` a bool, `use_norm_fused` a bool when present. ValueError names the file and the entry."""
    with open(path) as f:
        data = safe_json.load(f, path)
    name = os.path.basename(path)
    entries = data.get("entries") if isinstance(data, dict) else None
    if not isinstance(entries, dict):
        raise ValueError(f"{name}: expected {{\"entries\": {{key: entry, ...}}}}, got {type(data).__name__}")
    for key, entry in entries.items():
        where = f"{name} entry {key!r}"
        if not _KEY.fullmatch(key):
            raise ValueError(f"{where}: keys are 'k<K>/n<w1>+<w2>.../m<M>/r<rank>'")
        if not isinstance(entry, dict) or not isinstance(entry.get("use_fused"), bool):
            raise ValueError(f"{where}: expected an object with a bool 'use_fused', got {entry!r}")
        if not isinstance(entry.get("use_norm_fused", False), bool):
            raise ValueError(f"{where}: 'use_norm_fused' must be a bool when present, got "
                             f"{entry['use_norm_fused']!r}")
        cfg = entry.get("config")
        if not isinstance(cfg, dict) or set(cfg) - _CONFIG_KEYS:
            raise ValueError(f"{where}: 'config' must be an object with keys among {sorted(_CONFIG_KEYS)}, "
                             f"got {cfg!r}")
        for k in _POW2_KEYS:
            v = cfg.get(k)
            required = k in ("BLOCK_M", "BLOCK_N", "BLOCK_K")
            if (required or v is not None) and not (isinstance(v, int) and v >= 1 and v & (v - 1) == 0):
                raise ValueError(f"{where}: config {k} must be a power of two, got {v!r}")
        for k in ("SPLIT_K", "GROUP_M", "num_stages"):
            if k in cfg and not (isinstance(cfg[k], int) and cfg[k] >= 1):
                raise ValueError(f"{where}: config {k} must be an int >= 1, got {cfg[k]!r}")
    return {k: dict(v) for k, v in entries.items()}


def fused_linear_table_file(device: str) -> str:
    return os.path.join(TUNED_DIR, re.sub(r"[^A-Za-z0-9]+", "_", device).strip("_") + "_fused_linear.json")


@functools.cache
def fused_linear_table(device: str | None) -> dict:
    """The fused linear table of a device by name: LORA_CORE_FUSED_LINEAR_TABLE's file if set, else
    its tuned file, else {} (every layer on today's path)."""
    path, from_env = tuned_file("LORA_CORE_FUSED_LINEAR_TABLE",
                                fused_linear_table_file(device) if device else None, "fused linear table")
    if path is None:
        if device:
            _LOG.info("fused linear table: none for %s (%s): every LoRA linear on today's path", device,
                      os.path.basename(fused_linear_table_file(device)))
        return {}
    found = read_fused_linear_table(path)
    if from_env:
        _LOG.info("fused linear table: %s (LORA_CORE_FUSED_LINEAR_TABLE, %d entries)", path, len(found))
    else:
        _LOG.info("fused linear table: %s (%d entries)", os.path.basename(path), len(found))
    return found


def _device_table(device: str | None) -> dict:
    return fused_linear_table(device if device is not None else device_name())


def tuned_entry(layer_shape, m: int, rank: int, *, device: str | None = None, table: dict | None = None) -> dict | None:
    """The table entry of a layer (k, widths) at m rows and a rank; None without one. table: a
    `read_fused_linear_table` result (default: the table of `device`, default the GPU present)."""
    key = table_key(layer_shape, m, rank)
    if key is None:
        return None
    found = (table if table is not None else _device_table(device)).get(key)
    return dict(found) if found is not None else None


def _decision_entry(layer_shape, m: int, rank: int, device, table) -> tuple:
    """(key for the log, entry or None, why there is none) of a policy call, its arguments checked."""
    k, widths = _widths(layer_shape)
    if not isinstance(m, int) or m < 0:
        raise ValueError(f"m must be an int >= 0 (rows), got {m!r}")
    if not isinstance(rank, int) or rank < 1:
        raise ValueError(f"rank must be an int >= 1, got {rank!r}")
    key = table_key((k, widths), m, rank)
    entry = tuned_entry((k, widths), m, rank, device=device, table=table)
    if entry is not None:
        return key, entry, ""
    why = (f"M={m} is above the tuned row counts (at most {M_BUCKETS[-1]})" if key is None
           else "no tuned entry for it")
    return f"k{k}/n{'+'.join(map(str, widths))}/m{m_bucket(m)}/r{rank_bucket(rank)}", None, why


def use_fused_linear(layer_shape, m: int, rank: int, device: str | None = None, *, table: dict | None = None) -> bool:
    """Whether the LoRA linear of a layer (k, output slice widths) at m rows and a rank runs fused
    (the shrink, then `gemm_lora` with the expand in its epilogue) rather than today's path (the
    library GEMM, then `add_lora_linear`): the tuned table entry's `use_fused`; False without an
    entry. Logged once per (layer, M bucket, rank) with the reason."""
    key, entry, why = _decision_entry(layer_shape, m, rank, device, table)
    if entry is None:
        _log_choice(key, False, why)
        return False
    fused = bool(entry["use_fused"])
    _log_choice(key, fused, str(entry.get("reason") or "the tuned table's decision"))
    return fused


def use_norm_fused_linear(layer_shape, m: int, rank: int, device: str | None = None, *,
                          table: dict | None = None) -> bool:
    """Whether RMSNorm(x) * w followed by the LoRA linear of a layer (k, output slice widths) at m
    rows and a rank runs as the fused "norm" path (`rms_norm_shrink`: the norm and the LoRA shrink
    in one kernel, then `gemm_lora` with the expand in its epilogue) rather than the step's own
    norm and the path `use_fused_linear` picks: the tuned table entry's `use_norm_fused`; False
    without an entry or without the key (a table from before the key, a layer the tuner did not
    time behind a norm). Logged once per (layer, M bucket, rank) with the reason."""
    key, entry, why = _decision_entry(layer_shape, m, rank, device, table)
    if entry is None:
        _log_norm_choice(key, False, why)
        return False
    if "use_norm_fused" not in entry:
        _log_norm_choice(key, False, "the tuned entry has no norm path decision (use_norm_fused)")
        return False
    fused = bool(entry["use_norm_fused"])
    _log_norm_choice(key, fused, str(entry.get("norm_reason") or "the tuned table's decision"))
    return fused


@functools.cache
def _log_choice(key: str, fused: bool, why: str) -> None:
    path = "the fused GEMM (shrink, then gemm_lora)" if fused else "today's path (library GEMM + add_lora_linear)"
    _LOG.info("LoRA linear %s: %s: %s", key, path, why)


@functools.cache
def _log_norm_choice(key: str, fused: bool, why: str) -> None:
    path = ("the fused norm path (rms_norm_shrink, then gemm_lora)" if fused
            else "the norm, then the LoRA linear's own choice")
    _LOG.info("RMSNorm + LoRA linear %s: %s: %s", key, path, why)
