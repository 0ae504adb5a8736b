"""The launch policy: the thresholds by which the planners choose a launch, per device.

The launch table of a device (`configs.table`, `tuned/<device>.json`) holds block shapes per shape
class and, under its "policy" key, the thresholds below: how many programs the split of the hidden
size aims at, how far it may split, from how many tokens the fused kernel may run, up to how many
tokens a batch is one tile per group, how much of a weight row is prefetched into L2, and which
launches go out as programmatic dependents. None of them changes a result; each changes which
launch computes it.

A table names the fields it sets ({"policy": {"split_cap": 8, ...}}); a field it leaves out takes
the generic default below, the values of `LaunchPolicy()`. A GPU without a table runs the generic
defaults, with its own SM count for `target_programs` (`configs.launch_policy`).

Overrides are explicit: build a policy with `dataclasses.replace(configs.launch_policy(), ...)`
and run the launches under `configs.override_policy(policy)` (benchmarks use this to force the
fused kernel or the L2 prefetch, or to measure another threshold), or write a table variant and
name it in LORA_CORE_TABLE (`benchmarks/table_variant.py --policy`).
"""

from __future__ import annotations

import dataclasses

# Two waves: the split of the hidden size aims at two programs per SM where a table does not name
# its own target, so that programs that finish early leave no SM idle at decode sizes.
PROGRAMS_PER_SM = 2
# Programs aimed at where neither the table nor the driver gives a number (no CUDA driver to ask:
# plans for a GPU that is not present); two waves of a 128-SM GPU.
FALLBACK_TARGET_PROGRAMS = 256

_OVERRIDES_ONLY = ("force_fused", "force_prefetch")


@dataclasses.dataclass(frozen=True)
class LaunchPolicy:
    """Thresholds of launch planning (see the module docstring); the defaults are the generic ones.

    Split of the hidden size (`configs.resolve_split`, for shrink configs with SPLIT_K = 0):
      target_programs: programs the split aims at (SPLIT_K ~ target / busy tiles); None:
        PROGRAMS_PER_SM x the SM count of the GPU present.
      split_cap: at most this many split planes: the expand sums every plane of its rows, a cost the
        shrink's extra parallelism must pay for.
      split_workspace_tokens, split_workspace_floats: past split_workspace_tokens tokens, SPLIT_K x
        rank <= split_workspace_floats (the workspace floats each expand program re-reads per token).
      unsplit_tokens, unsplit_rank: past unsplit_tokens tokens at rank >= unsplit_rank no split at
        all (enough token tiles to fill the GPU; the split only adds workspace traffic).
    The fused kernel (`configs.use_fused`):
      fused_min_tokens: fewer tokens never take it (one token is one adapter: the two-kernel path,
        its expand's B tile staged through shared memory, avoids the fused kernel's barrier).
    Tiling (`planning.small_t_block`):
      small_t_max: batches of at most this many tokens run one tile per group (SMALL_T).
    L2 prefetch of the weights before a dependent kernel's wait (`configs.use_prefetch`,
    `planning.prefetch_constexprs`):
      prefetch_max_lines: at most this many 128-byte lines per weight row.
      prefetch_max_tokens: the shrink prefetches for batches of at most this many tokens, and
      prefetch_low_rank, prefetch_low_rank_tokens: for rank <= prefetch_low_rank with
        lo < T <= hi tokens (few adapters, few programs reading the same chunks).
    Programmatic dependent launch with LORA_CORE_PDL unset or "auto" (`planning.pdl_launch`):
      first_kernel_pdl_max_tokens: a call's first kernel (shrink or fused) is a dependent of the
        kernel before it for at most this many tokens;
      spread_pdl_max_tokens: up to this many where the launcher spreads a dependent shrink's
        programs over the SMs (`planning.spread_shared_bytes`).
    Overrides for experiments (never read from a table):
      force_fused: True / False runs the fused kernel / shrink + expand wherever the caller does
        not choose (rank <= 64, not deterministic); None: the table decides.
      force_prefetch: True / False turns the L2 weight prefetch on / off everywhere; None: by size.
    """
    target_programs: int | None = None
    split_cap: int = 8
    split_workspace_tokens: int = 128
    split_workspace_floats: int = 256
    unsplit_tokens: int = 1024
    unsplit_rank: int = 64
    fused_min_tokens: int = 2
    small_t_max: int = 32
    prefetch_max_lines: int = 64
    prefetch_max_tokens: int = 16
    prefetch_low_rank: int = 16
    prefetch_low_rank_tokens: tuple = (64, 256)
    first_kernel_pdl_max_tokens: int = 1
    spread_pdl_max_tokens: int = 32
    force_fused: bool | None = None
    force_prefetch: bool | None = None

    def __post_init__(self):
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if f.name in _OVERRIDES_ONLY:
                if v is not None and not isinstance(v, bool):
                    raise TypeError(f"LaunchPolicy.{f.name}: expected None, True or False, got {v!r}")
            elif f.name == "prefetch_low_rank_tokens":
                if not (isinstance(v, (tuple, list)) and len(v) == 2 and all(_count(x) for x in v) and v[0] <= v[1]):
                    raise ValueError(f"LaunchPolicy.prefetch_low_rank_tokens: expected (lo, hi) token counts with "
                                     f"0 <= lo <= hi, got {v!r}")
                object.__setattr__(self, f.name, tuple(int(x) for x in v))
            elif f.name == "target_programs" and v is None:
                continue
            elif not _count(v) or (f.name in ("target_programs", "split_cap", "split_workspace_floats") and v < 1):
                least = 1 if f.name in ("target_programs", "split_cap", "split_workspace_floats") else 0
                raise ValueError(f"LaunchPolicy.{f.name}: expected an integer >= {least}, got {v!r}")

    @classmethod
    def from_table(cls, entries: dict, where: str = "policy") -> LaunchPolicy:
        """The policy of a table's "policy" object: the fields it names over the generic defaults."""
        if not isinstance(entries, dict):
            raise ValueError(f"{where}: expected an object of LaunchPolicy fields, got {type(entries).__name__}")
        known = [f.name for f in dataclasses.fields(cls) if f.name not in _OVERRIDES_ONLY]
        unknown = sorted(set(entries) - set(known))
        if unknown:
            raise ValueError(f"{where}: unknown keys {unknown}; a table's policy may set {known}")
        try:
            return cls(**entries)
        except (TypeError, ValueError) as e:
            raise ValueError(f"{where}: {e}") from e

    def changes(self, other: LaunchPolicy) -> dict:
        """{field: value} of this policy where it differs from `other` (for logs)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                if getattr(self, f.name) != getattr(other, f.name)}


def _count(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


GENERIC_POLICY = LaunchPolicy()
