"""Launch configurations of the Triton LoRA kernels, per shape class and per device.

A shape class is (token class, rank class): tokens T in <=16, <=64, <=256, <=1024, <=4096, larger;
rank (the stacked weights' rank) in <=16, <=64, larger. A config gives block shapes, warps, stages
and switches of one kernel; configs never change the semantics.

Where the configs come from: `tuned/<device name>.json` beside this file (e.g. `NVIDIA_H200.json`,
written by `benchmarks/tune_triton.py` and edited from `benchmarks/explore_configs.py`
measurements), for the GPU actually present (`device_name()`, asked of the CUDA driver), loaded at
first use and cached (`table`); the environment variable LORA_CORE_TABLE names another file of the
same format to use instead (`benchmarks/table_variant.py` writes variants to measure). A GPU
without a table, and the CPU, get the generic defaults below (logged once). Under Triton's
interpreter (CPU tests) large tiles are used instead: the interpreter's cost is per program and
per loop trip, not per element.

A table entry per class: "shrink", "expand", "fused" configs, "use_fused" (whether the one-launch
fused kernel beats shrink + expand for the class) and optional "variants": configs for launches
with at most `max_slots` adapter slots and at least `min_slices` slices, first match wins. Both are
static (the slot count sizes the weight stacks, the slice count is the layer's), so the launch
shape never depends on the mapping. Few slots means many tokens per adapter, which wants larger
token tiles; three slices triple the shrink's programs and the workspace, which wants fewer splits.

`SPLIT_K = 0` in a shrink config means "choose from the grid" (`resolve_split`): enough splits of
the hidden size that about the policy's `target_programs` programs run at decode sizes, where a
handful of adapters would otherwise leave most SMs idle; capped past decode sizes, where the expand
re-reads every plane. Batches below the policy's `fused_min_tokens` never use the fused kernel.
The thresholds of these rules are the device's launch policy (`policy.LaunchPolicy`, the table's
"policy" key; `launch_policy`), overridden only explicitly (`override_policy`).

Deterministic launches (`deterministic=True`, `deterministic_config`): one shrink and one expand
config per rank class whatever the token count, with a fixed SPLIT_K, SMALL_T off and never the
fused kernel, so that a token's result does not depend on the batch it is in (see
`deterministic_config`). A table may override them under a top-level "deterministic" key:
{"r16": {"shrink": {...}, "expand": {...}}, ...}.

fp8 (e4m3) weights (`w_dtype="float8_e4m3fn"` on every lookup): a load of an fp8 tile moves half
the bytes of the same 16-bit tile, so the 16-bit configs would keep half as many bytes in flight
per program. A class entry's "fp8" object ({"shrink", "expand", "fused", "use_fused", "variants"}
like the class itself, written by `benchmarks/tune_triton.py --lora-dtype fp8`) gives fp8 launches
their own configs; a kind it does not give takes the class's 16-bit config as it is. The rule
`fp8_scaled` (the tile doubled along the weight's contiguous axis -- the shrink's and the fused
kernel's BLOCK_K, the expand's BLOCK_N with half the TILES_N -- and the warps doubled, so that each
load moves the 16-bit tile's bytes) is a tuner candidate and the interpreter's fp8 config; measured
on a GPU it was slower than the 16-bit configs at most decode cases (docs/benchmarks.md, fp8), so a
GPU table does not apply it by default.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import functools
import logging
import os
import re

from .. import safe_json
from ..checks import FP8_DTYPES
from .policy import FALLBACK_TARGET_PROGRAMS, GENERIC_POLICY, PROGRAMS_PER_SM, LaunchPolicy

_LOG = logging.getLogger("lora_core")
TUNED_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tuned")


def interpreting() -> bool:
    """True when Triton runs kernels in its interpreter (TRITON_INTERPRET=1 at import time)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


ANY_SLOTS = 1 << 30  # a variant without max_slots applies to any slot count

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


def shrink_params(block_m, block_k, split_k, num_warps, num_stages) -> dict:
    return dict(BLOCK_M=block_m, BLOCK_K=block_k, SPLIT_K=split_k, num_warps=num_warps, num_stages=num_stages)


def expand_params(block_m, block_n, block_r, num_warps, num_stages) -> dict:
    return dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_R=block_r, num_warps=num_warps, num_stages=num_stages)


def fused_params(block_m, block_n, block_k, num_warps, num_stages, split_k=0) -> dict:
    return dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, SPLIT_K=split_k, num_warps=num_warps,
                num_stages=num_stages)


_CLASSES = [(t, r) for t in ("t16", "t64", "t256", "t1024", "t4096", "tbig") for r in ("r16", "r64", "r256")]
# Generic defaults: what a GPU without a tuned table runs (sensible for any recent NVIDIA GPU).
GENERIC_SHRINK = {
    **{(t, r): shrink_params(16, bk, 0, 4, 2) for t in ("t16", "t64", "t256")
       for r, bk in (("r16", 256), ("r64", 128), ("r256", 64))},
    ("t1024", "r16"): shrink_params(32, 128, 0, 4, 3), ("t1024", "r64"): shrink_params(32, 128, 0, 4, 3),
    ("t1024", "r256"): shrink_params(32, 64, 0, 4, 3),
    ("t4096", "r16"): shrink_params(64, 128, 0, 4, 3), ("t4096", "r64"): shrink_params(64, 64, 0, 4, 4),
    ("t4096", "r256"): shrink_params(64, 64, 0, 8, 3),
    ("tbig", "r16"): shrink_params(64, 128, 0, 4, 3), ("tbig", "r64"): shrink_params(64, 128, 0, 4, 3),
    ("tbig", "r256"): shrink_params(64, 64, 0, 8, 3),
}
GENERIC_EXPAND = {
    **{(t, r): expand_params(16, bn, br, 4, 2) for t in ("t16", "t64", "t256")
       for r, bn, br in (("r16", 128, 16), ("r64", 128, 64), ("r256", 64, 64))},
    ("t1024", "r16"): expand_params(32, 128, 16, 4, 2), ("t1024", "r64"): expand_params(32, 128, 64, 4, 2),
    ("t1024", "r256"): expand_params(32, 128, 64, 4, 2),
    ("t4096", "r16"): expand_params(64, 128, 16, 4, 2), ("t4096", "r64"): expand_params(128, 64, 64, 4, 2),
    ("t4096", "r256"): expand_params(64, 128, 64, 8, 2),
    ("tbig", "r16"): expand_params(64, 128, 16, 4, 2), ("tbig", "r64"): expand_params(64, 128, 64, 4, 2),
    ("tbig", "r256"): expand_params(64, 128, 64, 8, 2),
}
GENERIC_FUSED = {
    ("t16", "r16"): fused_params(16, 128, 128, 4, 2), ("t16", "r64"): fused_params(16, 128, 128, 4, 2, 8),
    ("t64", "r16"): fused_params(16, 128, 128, 4, 2), ("t64", "r64"): fused_params(16, 128, 128, 4, 2, 8),
}
_FUSED_FALLBACK = fused_params(16, 128, 128, 4, 2)
# Deterministic launches: per rank class, one config for every token count (`deterministic_config`).
# Block shapes like the tuned table's mid-size entries (16-token tiles, 128-wide K and N blocks),
# not tuned (`bench_triton.py --deterministic` measures them); a fixed split of the hidden size in
# the linear path's workspace (added by the expand in plane order), none for ranks past 64.
GENERIC_DETERMINISTIC = {
    "r16": {"shrink": dict(shrink_params(16, 128, 4, 4, 3), PREFETCH=True, SMALL_T=False),
            "expand": dict(expand_params(16, 128, 16, 4, 3), TILES_N=4, SMALL_T=False)},
    "r64": {"shrink": dict(shrink_params(16, 128, 2, 4, 3), PREFETCH=True, SMALL_T=False),
            "expand": dict(expand_params(16, 128, 64, 4, 3), TILES_N=4, SMALL_T=False)},
    "r256": {"shrink": dict(shrink_params(16, 64, 1, 4, 3), PREFETCH=True, SMALL_T=False),
             "expand": dict(expand_params(16, 128, 64, 4, 2), SMALL_T=False)},
}


FP8_MAX_BLOCK = 512  # the fp8 rule doubles a tile up to this many elements along the weight's contiguous axis
FP8_MAX_WARPS = 8    # ... and the warps with it, up to this many


def fp8_scaled(kind: str, cfg: dict, size: int | None = None) -> dict:
    """A 16-bit launch config made for fp8 (e4m3) weights: the tile along the weight's contiguous
    axis doubled, so that each load moves as many bytes as the 16-bit launch's -- the shrink's and
    the fused kernel's BLOCK_K (A's hidden axis), the expand's BLOCK_N (B's rows, whose rank columns
    are contiguous: the rank is one block at decode ranks) with TILES_N halved (a program spans as
    many output columns) -- and num_warps doubled with it: a thread holds as many weight values
    as in the 16-bit launch (ptxas, Triton 3.6, sm_90, T512 rank 64: the doubled tile on 4 warps
    takes 128-140 registers, on 8 warps 78-100, the 16-bit launch 76-86). Applied only where both
    can double: the tile up to FP8_MAX_BLOCK and up to next_pow2(size) (the hidden size for the
    shrink and the fused kernel, the widest slice for the expand; None: no such cap), the warps up
    to FP8_MAX_WARPS; otherwise the config is kept as it is. Returns a new dict."""
    key = {"shrink": "BLOCK_K", "fused": "BLOCK_K", "expand": "BLOCK_N"}.get(kind)
    if key is None:
        raise ValueError(f"kind must be 'shrink', 'expand' or 'fused', got {kind!r}")
    cfg = dict(cfg)
    cap = FP8_MAX_BLOCK if size is None else min(FP8_MAX_BLOCK, max(16, next_pow2(size)))
    block, warps = int(cfg[key]), int(cfg.get("num_warps", 4))
    if 2 * block <= cap and 2 * warps <= FP8_MAX_WARPS:
        if kind == "expand" and int(cfg.get("TILES_N", 1)) > 1:
            cfg["TILES_N"] = int(cfg["TILES_N"]) // 2
        cfg[key], cfg["num_warps"] = 2 * block, 2 * warps
    return cfg


def is_fp8_dtype(w_dtype: str | None) -> bool:
    """Whether a weight dtype name (as the plans take it: "float8_e4m3fn", "bfloat16", ...) is fp8."""
    return w_dtype in FP8_DTYPES


@dataclasses.dataclass(frozen=True)
class LaunchTable:
    """The launch configs of one device: per class `shrink`, `expand`, `fused` configs, the classes
    that use the fused kernel, the variants by slot and slice count, and the launch policy."""
    source: str
    shrink: dict
    expand: dict
    fused: dict
    fused_classes: frozenset
    variants: dict
    deterministic: dict = dataclasses.field(default_factory=lambda: GENERIC_DETERMINISTIC)
    policy: LaunchPolicy = GENERIC_POLICY
    # per class: the class entry's "fp8" object ({"shrink", "expand", "fused", "use_fused"} as
    # given, "variants" as (max_slots, min_slices, overrides) like `variants`)
    fp8: dict = dataclasses.field(default_factory=dict)

    def variant(self, num_tokens: int, rank: int, num_slots: int, num_slices: int, w_dtype: str | None = None) -> dict:
        """The first variant of the shape class that applies to num_slots slots and num_slices slices ({} if none);
        with fp8 weights, of the class's "fp8" variants."""
        key = (token_class(num_tokens), rank_class(rank))
        found = self.fp8.get(key, {}).get("variants", ()) if is_fp8_dtype(w_dtype) else self.variants.get(key, ())
        for max_slots, min_slices, overrides in found:
            if num_slots <= max_slots and num_slices >= min_slices:
                return overrides
        return {}

    def config(self, kind: str, num_tokens: int, rank: int, num_slices: int, num_slots: int,
               w_dtype: str | None = None, size: int | None = None) -> dict:
        """A copy of the "shrink", "expand" or "fused" config of a launch, as the table writes it.
        fp8 weights (w_dtype): the class's "fp8" variant, else its "fp8" config of `kind`, else
        the 16-bit config (`size` is kept for the lookups' signature: the interpreter's rule uses it)."""
        key = (token_class(num_tokens), rank_class(rank))
        if is_fp8_dtype(w_dtype):
            chosen = (self.variant(num_tokens, rank, num_slots, num_slices, w_dtype).get(kind)
                      or self.fp8.get(key, {}).get(kind))
            if chosen is not None:
                return dict(chosen)
            return self.config(kind, num_tokens, rank, num_slices, num_slots)
        chosen = self.variant(num_tokens, rank, num_slots, num_slices).get(kind)
        if chosen is None:
            chosen = getattr(self, kind).get(key, _FUSED_FALLBACK) if kind == "fused" else getattr(self, kind)[key]
        return dict(chosen)

    def fused_wins(self, num_tokens: int, rank: int, num_slots: int, num_slices: int,
                   w_dtype: str | None = None) -> bool:
        """Whether the class (or its variant) uses the fused kernel; fp8 weights: the class's "fp8"
        variant or object where it says ("use_fused"), else the 16-bit answer."""
        if is_fp8_dtype(w_dtype):
            variant = self.variant(num_tokens, rank, num_slots, num_slices, w_dtype)
            own = self.fp8.get((token_class(num_tokens), rank_class(rank)), {})
            for where in (variant, own):
                if "use_fused" in where:
                    return bool(where["use_fused"])
        variant = self.variant(num_tokens, rank, num_slots, num_slices)
        if "use_fused" in variant:
            return bool(variant["use_fused"])
        return (token_class(num_tokens), rank_class(rank)) in self.fused_classes


def _table_file(device: str) -> str:
    return os.path.join(TUNED_DIR, re.sub(r"[^A-Za-z0-9]+", "_", device).strip("_") + ".json")


_REQUIRED = {"shrink": ("BLOCK_M", "BLOCK_K"), "expand": ("BLOCK_M", "BLOCK_N"),
             "fused": ("BLOCK_M", "BLOCK_N", "BLOCK_K")}


def _check_config(where: str, kind: str, cfg) -> None:
    """A table's config: a dict with its kind's block sizes, each a power of two >= 1."""
    if not isinstance(cfg, dict):
        raise ValueError(f"{where}: the {kind} config must be an object, got {type(cfg).__name__}")
    for key in _REQUIRED[kind]:
        v = cfg.get(key)
        if not (isinstance(v, int) and v >= 1 and v & (v - 1) == 0):
            raise ValueError(f"{where}: {kind} {key} must be a power of two, got {v!r}")


def _variants(entry: dict) -> tuple:
    """A class entry's (or its "fp8" object's) "variants" as (max_slots, min_slices, overrides)."""
    return tuple((int(v.get("max_slots", ANY_SLOTS)), int(v.get("min_slices", 1)),
                  {n: v[n] for n in ("shrink", "expand", "fused", "use_fused") if n in v})
                 for v in entry.get("variants", ()))


def _read_table(path: str, device: str) -> LaunchTable:
    with open(path) as f:
        data = safe_json.load(f, path)
    for name, entry in data["classes"].items():
        for kind in ("shrink", "expand", "fused"):
            if kind in entry or kind != "fused":
                _check_config(f"{os.path.basename(path)} class {name}", kind, entry.get(kind))
        fp8_entry = entry.get("fp8", {})
        if not isinstance(fp8_entry, dict):
            raise ValueError(f"{os.path.basename(path)} class {name}: \"fp8\" must be an object, "
                             f"got {type(fp8_entry).__name__}")
        for where, e in (("", entry), (" fp8", fp8_entry)):
            for kind in ("shrink", "expand", "fused"):
                if where and kind in e:
                    _check_config(f"{os.path.basename(path)} class {name}{where}", kind, e[kind])
            for v in e.get("variants", ()):
                for kind in ("shrink", "expand", "fused"):
                    if kind in v:
                        _check_config(f"{os.path.basename(path)} class {name}{where} variant", kind, v[kind])
    shrink, expand, fused = dict(GENERIC_SHRINK), dict(GENERIC_EXPAND), dict(GENERIC_FUSED)
    fused_classes, variants, fp8 = set(), {}, {}
    for name, entry in data["classes"].items():
        key = tuple(name.split("/"))
        shrink[key] = dict(entry["shrink"])
        expand[key] = dict(entry["expand"])
        if entry.get("fused"):
            fused[key] = dict(entry["fused"])
        if entry.get("use_fused"):
            fused_classes.add(key)
        variants[key] = _variants(entry)
        if entry.get("fp8"):
            fp8[key] = {**{n: entry["fp8"][n] for n in ("shrink", "expand", "fused", "use_fused")
                           if n in entry["fp8"]}, "variants": _variants(entry["fp8"])}
    deterministic = {r: dict(kinds) for r, kinds in GENERIC_DETERMINISTIC.items()}
    for rank_name, kinds in data.get("deterministic", {}).items():
        deterministic[rank_name] = {**deterministic.get(rank_name, {}),
                                    **{k: {**v, "SMALL_T": False} for k, v in kinds.items()}}
    policy = LaunchPolicy.from_table(data.get("policy", {}), f"{os.path.basename(path)} policy")
    return LaunchTable(f"{device} ({os.path.basename(path)})", shrink, expand, fused, frozenset(fused_classes),
                       variants, deterministic, policy, fp8)


GENERIC = LaunchTable("generic defaults", GENERIC_SHRINK, GENERIC_EXPAND, GENERIC_FUSED, frozenset(), {})


@functools.cache
def table(device: str | None) -> LaunchTable:
    """The launch table of a device by name ("NVIDIA H200"): the file LORA_CORE_TABLE names if set
    (a table written for this GPU elsewhere, or a variant to measure), else its tuned file, else
    the generic defaults."""
    override = os.environ.get("LORA_CORE_TABLE")
    if override:
        if not os.path.isfile(override):
            raise FileNotFoundError(f"LORA_CORE_TABLE: no launch table file at {override!r}")
        try:
            found = _read_table(override, device or "any device")
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise ValueError(f"LORA_CORE_TABLE={override!r} is not a launch table ({type(e).__name__}: {e}); "
                             f"expected the format of lora_core/kernels/tuned/*.json: "
                             f'{{"classes": {{"t16/r16": {{"shrink": {{...}}, "expand": {{...}}}}, ...}}}}') from e
        _LOG.info("launch configs: %s (LORA_CORE_TABLE)", found.source)
        return found
    if device:
        path = _table_file(device)
        if os.path.exists(path):
            found = _read_table(path, device)
            _LOG.info("launch configs: %s", found.source)
            return found
        _LOG.info("launch configs: no tuned table for %s (%s): generic defaults", device, os.path.basename(path))
    return GENERIC


def tuned_file(env_var: str, default_path: str | None, what: str) -> tuple[str | None, bool]:
    """(the file a tuned table is read from, whether the environment named it): the path in
    `env_var` when it is set (FileNotFoundError naming the variable and `what` when no file is
    there), else `default_path` when that file exists, else None."""
    override = os.environ.get(env_var)
    if override:
        if not os.path.isfile(override):
            raise FileNotFoundError(f"{env_var}: no {what} file at {override!r}")
        return override, True
    if default_path and os.path.exists(default_path):
        return default_path, False
    return None, False


@functools.cache
def device_name() -> str | None:
    """The name of CUDA device 0 as the driver reports it ("NVIDIA H200"), None without a CUDA driver."""
    try:
        driver = ctypes.CDLL("libcuda.so.1")
        device = ctypes.c_int()
        name = ctypes.create_string_buffer(256)
        if driver.cuInit(0) or driver.cuDeviceGet(ctypes.byref(device), 0):
            return None
        if driver.cuDeviceGetName(name, len(name), device):
            return None
        return name.value.decode()
    except OSError:
        return None


def current_table() -> LaunchTable:
    """The table of the GPU present (generic defaults without one)."""
    return table(device_name())


def _table(device: str | None) -> LaunchTable:
    return current_table() if device is None else table(device)


@functools.cache
def device_sm_count() -> int | None:
    """The multiprocessor (SM) count of CUDA device 0 as the driver reports it, None without a CUDA driver."""
    try:
        driver = ctypes.CDLL("libcuda.so.1")
        device, count = ctypes.c_int(), ctypes.c_int()
        if driver.cuInit(0) or driver.cuDeviceGet(ctypes.byref(device), 0):
            return None
        if driver.cuDeviceGetAttribute(ctypes.byref(count), _CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, device):
            return None
        return int(count.value) or None
    except OSError:
        return None


_CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT = 16
_OVERRIDE: list = []          # the policies of the `override_policy` blocks entered, innermost last


def launch_policy(device: str | None = None) -> LaunchPolicy:
    """The launch policy in effect: the innermost `override_policy`'s, else the table's of `device`
    (default: the GPU present; generic defaults without a table)."""
    return _OVERRIDE[-1] if _OVERRIDE else _table(device).policy


@contextlib.contextmanager
def override_policy(policy: LaunchPolicy):
    """Runs the block's launches under `policy` instead of the device's (process-wide, nestable).

        with configs.override_policy(dataclasses.replace(configs.launch_policy(), force_fused=True)):
            ...

    The policy is read when a launch is planned: torch caches a shape's plans at its first launch
    (PreparedLinear records its launches), JAX plans while tracing and keeps the compiled program;
    so enter the block before the first launch it should govern, and plans made inside it keep its
    policy after the block."""
    if not isinstance(policy, LaunchPolicy):
        raise TypeError(f"override_policy: expected a LaunchPolicy, got {type(policy).__name__}")
    base = launch_policy()
    _LOG.info("launch policy override: %s", policy.changes(base) or "same as the device's")
    _OVERRIDE.append(policy)
    try:
        yield policy
    finally:
        _OVERRIDE.pop()


def target_programs(policy: LaunchPolicy, device: str | None = None) -> int:
    """Programs the SPLIT_K = 0 rule aims at: the policy's target, else PROGRAMS_PER_SM x the SM
    count of the GPU present (when `device` is that GPU), else FALLBACK_TARGET_PROGRAMS."""
    if policy.target_programs is not None:
        return policy.target_programs
    sms = device_sm_count() if device is None or device == device_name() else None
    return PROGRAMS_PER_SM * sms if sms else FALLBACK_TARGET_PROGRAMS


def _estimated_tiles(num_tokens: int, num_slots: int, block_m: int) -> int:
    """Busy token tiles to expect without reading the mapping: one per adapter at decode sizes,
    cdiv(T, BLOCK_M) at prefill sizes (the launch shape may not depend on the mapping)."""
    return max(1, min(num_tokens, num_slots), -(-num_tokens // block_m))


def table_shrink_config(num_tokens: int, rank: int, num_slices: int, num_slots: int, *,
                        device: str | None = None, w_dtype: str | None = None, hidden: int | None = None) -> dict:
    """The table's shrink config for a launch as written (SPLIT_K 0 and TARGET not yet resolved);
    fp8 weights (w_dtype): see `LaunchTable.config` (hidden caps the fp8 rule's BLOCK_K)."""
    return _table(device).config("shrink", num_tokens, rank, num_slices, num_slots, w_dtype, hidden)


def _interpreter_fp8(kind: str, cfg: dict, size: int, w_dtype: str | None) -> dict:
    """Under the interpreter, fp8 launches follow the same rule as on a GPU without fp8 entries."""
    return fp8_scaled(kind, cfg, size) if is_fp8_dtype(w_dtype) else cfg


def shrink_config(num_tokens: int, hidden: int, rank: int, num_slices: int, num_slots: int, *,
                  device: str | None = None, deterministic: bool = False, w_dtype: str | None = None) -> dict:
    """The shrink config of a launch, SPLIT_K resolved. w_dtype: A's dtype name (fp8 launches get
    their own configs: the module docstring); None or a 16-bit name: the 16-bit configs."""
    if deterministic:
        return deterministic_config("shrink", hidden, rank, device=device, w_dtype=w_dtype)
    if interpreting():
        return _interpreter_fp8("shrink", shrink_params(16, min(256, max(16, next_pow2(hidden))), 1, 4, 1), hidden,
                                w_dtype)
    return resolve_split(table_shrink_config(num_tokens, rank, num_slices, num_slots, device=device, w_dtype=w_dtype,
                                             hidden=hidden), num_tokens,
                         hidden, rank, num_slices, num_slots, device=device)


def use_prefetch(num_tokens: int, rank: int, *, device: str | None = None) -> bool:
    """Whether the shrink prefetches its A chunk into L2 before waiting for the kernel before it
    (PDL launches only): for small batches (T <= prefetch_max_tokens), where the weights are most
    of the bytes and few programs share a chunk, and for rank <= prefetch_low_rank with a few
    adapters' worth of tokens (prefetch_low_rank_tokens); not where many programs would prefetch
    the same chunks. The policy's `force_prefetch` overrides it."""
    policy = launch_policy(device)
    if policy.force_prefetch is not None:
        return policy.force_prefetch
    lo, hi = policy.prefetch_low_rank_tokens
    return num_tokens <= policy.prefetch_max_tokens or (rank <= policy.prefetch_low_rank and lo < num_tokens <= hi)


def resolve_split(cfg: dict, num_tokens: int, hidden: int, rank: int, num_slices: int, num_slots: int, *,
                  device: str | None = None) -> dict:
    """cfg (a shrink config) with SPLIT_K = 0 resolved and the split caps applied (in place);
    PREFETCH (use_prefetch) set unless the config says. A config's TARGET (programs the SPLIT_K = 0
    rule aims at; `target_programs` of the policy if absent) is consumed here; a config that names
    its TARGET is not subject to the prefill caps below (a tuned choice, measured with the expand
    that sums the planes once per program: lora_expand_kernel with TILES_N > 1)."""
    policy = launch_policy(device)
    cfg.setdefault("PREFETCH", use_prefetch(num_tokens, rank, device=device))
    own_target = "TARGET" in cfg
    target = int(cfg.pop("TARGET")) if own_target else None
    chunks = max(1, -(-hidden // cfg["BLOCK_K"]))
    if cfg["SPLIT_K"] == 0:
        if target is None:
            target = target_programs(policy, device)
        programs_per_tile = 1 if cfg.get("ALL_SLICES") else num_slices
        busy = programs_per_tile * _estimated_tiles(num_tokens, num_slots, cfg["BLOCK_M"])
        cfg["SPLIT_K"] = max(1, min(chunks, target // busy, policy.split_cap))
        if num_tokens > policy.split_workspace_tokens and not own_target:
            # Past decode sizes every expand program re-reads its rows of all SPLIT_K workspace
            # planes (SPLIT_K * rank floats per token per output tile): keep that at most
            # split_workspace_floats per token; with many tokens at a large rank there are token
            # tiles enough to fill the GPU, and a split only adds that traffic: none. A table entry
            # with an explicit SPLIT_K (tuned) is kept.
            unsplit = num_tokens > policy.unsplit_tokens and rank >= policy.unsplit_rank
            cap = 1 if unsplit else policy.split_workspace_floats // max(rank, 1)
            cfg["SPLIT_K"] = max(1, min(cfg["SPLIT_K"], cap))
    cfg["SPLIT_K"] = max(1, min(cfg["SPLIT_K"], chunks))
    return cfg


def expand_config(num_tokens: int, width: int, rank: int, num_slices: int, num_slots: int, *,
                  device: str | None = None, deterministic: bool = False, w_dtype: str | None = None) -> dict:
    """The expand config of a launch; w_dtype: B's dtype name (as in `shrink_config`)."""
    if deterministic:
        return deterministic_config("expand", width, rank, device=device, w_dtype=w_dtype)
    if interpreting():
        return _interpreter_fp8("expand", expand_params(16, min(256, max(16, next_pow2(width))), 64, 4, 1), width,
                                w_dtype)
    return _table(device).config("expand", num_tokens, rank, num_slices, num_slots, w_dtype, width)


def fused_config(num_tokens: int, hidden: int, width: int, rank: int, num_slices: int,
                 num_slots: int, *, device: str | None = None, w_dtype: str | None = None) -> dict:
    """The fused kernel's config of a launch; w_dtype: A's dtype name (as in `shrink_config`)."""
    if interpreting():
        return _interpreter_fp8("fused", fused_params(16, min(256, max(16, next_pow2(width))),
                                                      min(256, max(16, next_pow2(hidden))), 4, 1, 0), hidden, w_dtype)
    return _table(device).config("fused", num_tokens, rank, num_slices, num_slots, w_dtype, hidden)


def fused_forced():
    """The policy's `force_fused`: True / False when an override forces the fused kernel on / off, else None."""
    return launch_policy().force_fused


def use_fused(num_tokens: int, rank: int, num_slices: int, num_slots: int, *,
              device: str | None = None, deterministic: bool = False, w_dtype: str | None = None) -> bool:
    """True when the one-launch fused kernel is expected to beat shrink + expand (decode sizes).
    The fused kernel needs the whole rank in one block (rank <= 64 here). Deterministic launches
    never use it (one kernel path for every token count), the policy's `force_fused`
    notwithstanding; batches below its `fused_min_tokens` never do either."""
    if rank > 64 or deterministic:
        return False
    policy = launch_policy(device)
    if policy.force_fused is not None:
        return policy.force_fused
    if num_tokens < policy.fused_min_tokens:
        return False
    return _table(device).fused_wins(num_tokens, rank, num_slots, num_slices, w_dtype)


def deterministic_config(kind: str, size: int, rank: int, *, device: str | None = None,
                         w_dtype: str | None = None) -> dict:
    """The "shrink" or "expand" config of a deterministic launch: a function of the rank (and,
    under the interpreter, of `size`: the hidden size for the shrink, the widest slice for the
    expand), never of the token count or the mapping.

    What makes a token's row the same in every batch, run after run (`plan_shrink` / `plan_expand`
    with deterministic=True also enforce "no atomic adds" and "SMALL_T off" whatever a config says):
      * the same BLOCK_M, BLOCK_K, BLOCK_R and warps for every T: tl.dot's reduction order for one
        output element is set by the K blocking and the MMA instruction, which these fix; the
        other rows of a tile do not enter it, nor does the row's position in the tile;
      * the same SPLIT_K: in the linear path the shrink writes that many float32 planes and the
        expand adds them in plane order; the stand-alone shrink runs unsplit (no atomic adds);
      * BLOCK_R fixed: the expand's rank loop adds the same rank blocks in the same order;
      * SMALL_T off: the same tile scheme (sorted token tiles) for every T;
      * shrink + expand always, never the fused kernel (`use_fused`).
    fp8 weights (w_dtype): the rank's 16-bit config on a GPU, under the interpreter the same small
    tiles as 16-bit weights.
    """
    if kind not in ("shrink", "expand"):
        raise ValueError(f"kind must be 'shrink' or 'expand', got {kind!r}")
    if interpreting():
        # Small tiles that still split the hidden size in two planes and the rank in blocks of 16,
        # so that CPU tests run the plane sum and the rank loop.
        if kind == "shrink":
            return dict(shrink_params(16, min(256, max(16, next_pow2(size) // 2)), 2, 4, 1), SMALL_T=False)
        return dict(expand_params(16, min(256, max(16, next_pow2(size))), 16, 4, 1), SMALL_T=False)
    return dict(_table(device).deterministic[rank_class(rank)][kind])
