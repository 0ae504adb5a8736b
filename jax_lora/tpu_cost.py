"""Cost model of the Pallas TPU kernels against the one-hot einsum over all slots (docs/tpu.md).

No TPU was available to measure, so this counts what each formulation must move through HBM, how
many grid steps the kernels run and how much VMEM a step holds, for the anchor sweep of
docs/benchmarks.md (bf16, hidden 4096, `add_lora_linear` = shrink + expand, s1 = one 4096 slice,
s3 = 4096 + 1024 + 1024). Tiling comes from the kernels' own planners (`plan_shrink`,
`plan_expand`), and group/tile counts from the kernels' own schedule rule on a sampled mapping.

Run `python -m jax_lora.tpu_cost` to print the markdown tables of docs/tpu.md.

Model (bytes; b = 2 for bf16; T_l tokens with a LoRA, D active adapters, L slots, N = sum n_s):
  The row order (sorted or token) is the kernels' own choice (`prefers_token_order` with the summed
  costs of both kernels) on a sampled mapping; a weight block is counted each time a step's slot
  differs from the previous step's.
  The op is `pallas_tpu.linear` (add_lora_linear): shrink and expand in one program, one row order.
  grouped shrink  = x: token order: tiles (visited * tm*H*b); sorted: rows with a LoRA by DMA
                    (T_l*H*b; an XLA gather instead when H is split in k tiles)
                    + A blocks fetched (S*r*H*b each; with lora_ranks only the 16-row chunks below
                    the slot's rank) + packed rank rows written (tiles * tm*P*4)
  grouped expand  = rank rows re-read per column tile (J * tiles * tm*P*4)
                    + B blocks fetched (N*r_hbm*b each; rank chunks as for A when rank-major)
                    + y in place, aligned slices only (token order: tiles * tm*N*b read and write;
                    sorted: T_l*N*b by row DMA) or a float32 delta (tiles * tm*N*4 write, T*N*4
                    read) + y (T*N*b read and write)
  one-hot einsum  = x (T*H*b) + A of all L slots (L*S*r*H*b) + (T, L, r) f32 per slice written
                    and read (2*S*T*L*r*4) + buffer (S*T*r*4 write, read) + the same for expand
                    with all L slots' B (L*N*r_hbm*b) + y (T*N*b read and write)
  r_hbm = r for B stored rank-major (L, r, n); round_up(r, 128) for vLLM's (L, n, r) if the HBM
  layout pads the minor dim to a lane tile (to be measured; see docs/tpu.md).
Time estimate = max(bytes / HBM bandwidth, MXU flops / peak, grid steps * step overhead) (the
pipeline overlaps each step's fixed cost with its DMAs); the one-hot einsum has no grid steps.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import numpy as np

from .meta import LoRAKernelMeta
from .ops.pallas_tpu import (
    OrderCost,
    expand_order_cost,
    plan_expand,
    plan_inplace,
    plan_shrink,
    prefers_token_order,
    shrink_order_cost,
)


@dataclasses.dataclass(frozen=True)
class Chip:
    name: str
    hbm_bw: float  # bytes / s
    vmem: int  # bytes per TensorCore
    bf16_flops: float  # per chip


# HBM bandwidth and bf16 peak: cloud.google.com/tpu/docs/v6e (table comparing v5e and v6e:
# 819 GBps / 1640 GBps, 197 / 918 TFLOPs). VMEM: jax.experimental.pallas.tpu.get_tpu_info_for_chip
# (jax/_src/pallas/mosaic/tpu_info.py, jax 0.10.2): 128 MiB per core on both.
CHIPS = {
    "v5e": Chip("TPU v5e", 819e9, 128 * 2**20, 197e12),
    "v6e": Chip("TPU v6e", 1640e9, 128 * 2**20, 918e12),
}
# Fixed cost of one Pallas TPU grid step, in seconds: the figure the JAX Pallas TPU matmul guide quotes.
STEP_OVERHEAD_S = 0.35e-6
HIDDEN = 4096
BYTES = 2  # bf16


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    num_tokens: int
    num_adapters: int
    rank: int
    prefill: bool = False
    frac_none: float = 0.0
    ranks: tuple | None = None  # heterogeneous: the rank of each adapter (max = rank)
    resident: int | None = None  # slots loaded; default max(8, D) as in the sweep

    @property
    def slots(self) -> int:
        return self.resident or max(8, self.num_adapters)


def sweep_cases() -> list:
    """The anchor sweep of docs/benchmarks.md (decode, prefill, heterogeneous ranks)."""
    cases = []
    for t in (1, 8, 32, 128, 512):
        for d in sorted({1, min(t, 8), min(t, 32 if t <= 32 else 64)}):
            for r in (16, 64):
                cases.append(Case(f"dec T{t} D{d} r{r}", t, d, r))
    cases.append(Case("dec T128 D8 r16 25% -1", 128, 8, 16, frac_none=0.25))
    for t in (2048, 8192):
        for d in (1, 4, 16):
            for r in (16, 64):
                cases.append(Case(f"pre T{t} D{d} r{r}", t, d, r, prefill=True))
    cases.append(Case("het T128 D8 r{8,16,32,64}", 128, 8, 64, ranks=(8, 16, 32, 64) * 2))
    return cases


def resident_cases(slots: int = 64) -> list:
    """Beyond the sweep: `slots` adapters resident, few of them active in the step (what a server
    with max_loras = 64 sees most steps). The one-hot einsum reads all of them."""
    return [Case(f"dec T{t} D{d} r{r} L{slots}", t, d, r, resident=slots)
            for t in (8, 128, 512) for d in (1, 4, 8) for r in (16, 64) if d <= t]


def sample_mapping(case: Case, seed: int = 0) -> np.ndarray:
    """Decode: each token its own request, exactly D adapters, shuffled. Prefill: contiguous runs."""
    rng = np.random.default_rng(seed)
    t, d = case.num_tokens, case.num_adapters
    if case.prefill:
        idx = np.repeat(np.arange(d), -(-t // d))[:t]
    else:
        idx = np.concatenate([np.arange(d), rng.integers(0, d, t - d)])
        rng.shuffle(idx)
    idx = idx.astype(np.int32)
    if case.frac_none:
        idx[rng.permutation(t)[: int(round(case.frac_none * t))]] = -1
    return idx


def _visits(idx: np.ndarray, tm: int, token_order: bool) -> tuple:
    """(live steps, distinct m-tiles visited, slot of each weight fetch) of the kernels' schedule:
    a weight block is fetched when a step's slot differs from the previous step's."""
    if token_order:
        rows = np.arange(len(idx))
    else:
        rows = np.argsort(np.where(idx < 0, -1, idx), kind="stable")
    pairs = sorted({(p // tm, int(idx[tok])) for p, tok in enumerate(rows) if idx[tok] >= 0},
                   key=lambda ts: (ts[0], ts[1]) if token_order else (ts[1], ts[0]))
    fetches = [sl for i, (_, sl) in enumerate(pairs) if i == 0 or pairs[i - 1][1] != sl]
    return len(pairs), len({tile for tile, _ in pairs}), fetches


@dataclasses.dataclass
class Cost:
    bytes: float
    flops: float
    grid_steps: int = 0
    vmem: int = 0
    path: str = ""

    def seconds(self, chip: Chip) -> float:
        # The pipeline overlaps a step's fixed cost with its DMAs: the grid takes the longest of
        # moving the bytes, doing the flops and paying the per-step overhead.
        return max(self.bytes / chip.hbm_bw, self.flops / chip.bf16_flops, self.grid_steps * STEP_OVERHEAD_S)


def grouped_cost(case: Case, outs: Sequence[int], b_layout: str = "rn") -> tuple:
    """(shrink Cost, expand Cost, plans) of `pallas_tpu.linear` (add_lora_linear: both kernels in
    one program sharing one row order, chosen by the kernels' own rule on the sampled mapping)."""
    t, h, r, s_count, L = case.num_tokens, HIDDEN, case.rank, len(outs), case.slots
    n_total = sum(outs)
    offsets = tuple(sum(outs[:s]) for s in range(s_count))
    idx = sample_mapping(case)
    het = case.ranks is not None  # the kernels then read 16-row rank chunks up to each rank
    sp = plan_shrink(t, h, s_count, r, L, chunked=het)
    ep = plan_expand(t, tuple(outs), r, L, sp.lanes, b_layout, tm_max=sp.tm, chunked=het)
    if ep.tm != sp.tm:
        sp = plan_shrink(t, h, s_count, r, L, tm_max=ep.tm, chunked=het)
    inplace = plan_inplace(ep, offsets, n_total, BYTES)
    scatter = plan_inplace(ep, offsets, n_total, BYTES, by_rows=True)
    t_l = int((idx >= 0).sum())
    tp, lanes, k, tm = sp.tiles_m * sp.tm, sp.lanes, sp.tiles_k, sp.tm
    sc, ec = shrink_order_cost(sp, BYTES, BYTES), expand_order_cost(ep, inplace, BYTES, BYTES, scatter)
    cost = OrderCost(sc.step_weight_bytes + ec.step_weight_bytes, sc.token_rows_bytes + ec.token_rows_bytes,
                     sc.sorted_rows_bytes + ec.sorted_rows_bytes)
    token = bool(prefers_token_order(LoRAKernelMeta.build(idx, L), t, L, tm, cost))
    live, tiles, fetches = _visits(idx, tm, token)
    slot_rank = np.asarray(case.ranks if het else (r,) * L)

    def rows_read(slot):
        return _round_up(int(slot_rank[slot]), 16) if het and r > 16 else r

    # shrink: x (token order: whole tiles, after a pad copy unless T % tm == 0; sorted order: the
    # rows with a LoRA DMA'd by the kernel, or an XLA gather when H is split in k tiles), the A
    # blocks fetched, the packed rank rows written (read back by the expand).
    gather_dma = not token and k == 1
    rows_in = 0 if (token and tp == t) or gather_dma else t * h * BYTES + tp * h * BYTES
    a_reads = sum(rows_read(sl) for sl in fetches) * s_count * h * BYTES * (k if k > 1 else 1)
    x_reads = t_l * h * BYTES if gather_dma else (tiles if k == 1 else live) * tm * h * BYTES
    shrink_bytes = rows_in + x_reads + a_reads + tiles * tm * lanes * 4
    shrink = Cost(shrink_bytes, live * k * tm * h * s_count * r * 2, live * k,
                  sp.vmem_bytes(BYTES, BYTES), "token" if token else "sorted")
    # expand: rank rows re-read per column tile, the B blocks fetched, then y: in place (token order:
    # whole tiles; sorted order: the rows with a LoRA, by DMA; aligned slices only) or a float32
    # delta that XLA adds to y.
    if b_layout == "rn":
        b_reads = sum(rows_read(sl) for sl in fetches) * n_total * BYTES
    else:  # rank in lanes: padded to 128 whatever the rank
        b_reads = len(fetches) * n_total * _round_up(r, 128) * BYTES
    use_inplace = inplace is not None if token else scatter is not None
    eplan = (inplace if token else scatter) if use_inplace else ep
    if use_inplace:
        y_bytes = 2 * (tiles * tm if token else t_l) * n_total * BYTES
    else:
        y_bytes = tiles * tm * n_total * 4 + t * n_total * 4 + 2 * t * n_total * BYTES
    expand_bytes = eplan.grid_n * tiles * tm * lanes * 4 + b_reads + y_bytes
    expand_flops = live * tm * (n_total * r + eplan.grid_n * lanes * r) * 2
    expand = Cost(expand_bytes, expand_flops, eplan.grid_n * live, eplan.vmem_bytes(BYTES),
                  ("token" if token else "sorted") + ((" in place" if token else " row DMA") if use_inplace else ""))
    return shrink, expand, (sp, eplan)


def onehot_cost(case: Case, outs: Sequence[int], b_layout: str = "rn") -> Cost:
    """The one-hot einsum over all L slots (jax_lora's "xla" backend; vLLM's TPU formulation)."""
    t, h, r, s_count, L = case.num_tokens, HIDDEN, case.rank, len(outs), case.slots
    n_total = sum(outs)
    r_hbm = r if b_layout == "rn" else _round_up(r, 128)
    shrink = t * h * BYTES + L * s_count * r * h * BYTES + 2 * s_count * t * L * r * 4 + s_count * t * r * 4
    expand = (s_count * t * r * 4 + 2 * s_count * t * L * r * 4 + L * n_total * r_hbm * BYTES
              + 2 * t * n_total * BYTES)
    flops = 2 * t * L * r * (s_count * h + n_total)
    return Cost(shrink + expand, flops)


def minimal_bytes(case: Case, outs: Sequence[int]) -> float:
    """docs/benchmarks.md's minimal bytes (tokens with a LoRA only, true ranks)."""
    idx = sample_mapping(case)
    t_l = int((idx >= 0).sum())
    d = len(set(idx[idx >= 0].tolist()))
    s_count, n_total, h = len(outs), sum(outs), HIDDEN
    ranks = case.ranks[:d] if case.ranks else (case.rank,) * d
    shrink = t_l * h * 2 + sum(ranks) * s_count * h * 2 + s_count * t_l * case.rank * 4
    expand = s_count * t_l * case.rank * 4 + sum(ranks) * n_total * 2 + 2 * t_l * n_total * 2
    return shrink + expand


def _round_up(v: int, m: int) -> int:
    return -(-v // m) * m


OUTS = {"s1": (4096,), "s3": (4096, 1024, 1024)}


def rows(shape: str = "s1", b_layout: str = "rn", cases: list | None = None) -> list:
    """One dict per case (default: the sweep): bytes (MB), steps, VMEM (KiB), us on v5e / v6e."""
    out = []
    for case in (sweep_cases() if cases is None else cases):
        outs = OUTS[shape]
        shrink, expand, (sp, ep) = grouped_cost(case, outs, b_layout)
        base = onehot_cost(case, outs, b_layout)
        ours = Cost(shrink.bytes + expand.bytes, shrink.flops + expand.flops,
                    shrink.grid_steps + expand.grid_steps)
        out.append(dict(
            case=case.name, slots=case.slots, min_mb=minimal_bytes(case, outs) / 1e6,
            ours_mb=ours.bytes / 1e6, onehot_mb=base.bytes / 1e6, ratio=base.bytes / ours.bytes,
            path=f"{shrink.path} / {expand.path}", steps=f"{shrink.grid_steps}+{expand.grid_steps}",
            tiles=f"tm{sp.tm} tk{sp.tk} tn{'/'.join(map(str, sorted(set(ep.tn), reverse=True)))}",
            vmem_kib=max(shrink.vmem, expand.vmem) / 1024,
            **{f"ours_us_{c}": ours.seconds(CHIPS[c]) * 1e6 for c in CHIPS},
            **{f"onehot_us_{c}": base.seconds(CHIPS[c]) * 1e6 for c in CHIPS},
        ))
    return out


def markdown(shape: str = "s1", b_layout: str = "rn", cases: list | None = None) -> str:
    head = ("| case | slots | min MB | grouped MB | one-hot MB | one-hot / grouped | row order (shrink / expand) "
            "| grid steps (shrink+expand) | tiles | VMEM/step KiB | grouped us v5e | one-hot us v5e | grouped us v6e "
            "| one-hot us v6e |\n|" + "---|" * 14)
    lines = [head]
    for r in rows(shape, b_layout, cases):
        lines.append(
            f"| {r['case']} | {r['slots']} | {r['min_mb']:.2f} | {r['ours_mb']:.2f} | {r['onehot_mb']:.2f} "
            f"| {r['ratio']:.2f}x | {r['path']} | {r['steps']} | {r['tiles']} | {r['vmem_kib']:.0f} "
            f"| {r['ours_us_v5e']:.1f} | {r['onehot_us_v5e']:.1f} | {r['ours_us_v6e']:.1f} "
            f"| {r['onehot_us_v6e']:.1f} |")
    return "\n".join(lines)


def summary(shape: str, b_layout: str, cases: list | None = None) -> str:
    """Geometric means of one-hot / grouped (bytes, estimated time) and how many cases grouped wins."""
    rs = rows(shape, b_layout, cases)
    out = [f"{shape}, B {b_layout}: bytes one-hot/grouped geomean "
           f"{math.exp(np.mean([math.log(r['ratio']) for r in rs])):.2f} (grouped smaller in "
           f"{sum(r['ratio'] > 1 for r in rs)}/{len(rs)})"]
    for c in CHIPS:
        q = [r[f"onehot_us_{c}"] / r[f"ours_us_{c}"] for r in rs]
        out.append(f"time {c} geomean {math.exp(np.mean(np.log(q))):.2f} (grouped faster in "
                   f"{sum(v > 1 for v in q)}/{len(q)})")
    return "; ".join(out)


def main() -> None:
    for shape in OUTS:
        for layout in ("rn", "nr"):
            print(f"\n### Sweep, {shape}, B layout {layout}\n")
            print(markdown(shape, layout))
            print("\n" + summary(shape, layout))
    for shape in OUTS:
        print(f"\n### 64 resident slots, {shape}, B layout rn\n")
        print(markdown(shape, "rn", resident_cases()))
        print("\n" + summary(shape, "rn", resident_cases()))


if __name__ == "__main__":
    main()
