"""Mixture-of-experts LoRA ops for PyTorch (contract section 9), vLLM 0.33's semantics and argument order.

Pair p = t * top_k + k is token t's k-th routed expert e = topk_ids[t, k]; slot l =
token_lora_mapping[t] (-1: no adapter). For each slice s of the adapter weights
(A_s (L, E, r, K), B_s (L, E, n_s, r), the LoRA scaling folded into B, as vLLM does):

  output[t, k, offset + cols of s] += w(p) * B_s[l, e] @ (A_s[l, e] @ x[row(p)])

with row(p) = p and w(p) = topk_weights[t, k] when mul_routed_weight (the down projection w2: x
holds one row per pair), else row(p) = t and w(p) = 1 (gate_up w13: x holds one row per token).
Pairs of tokens without an adapter, of slots with adapter_enabled[l] == 0 (no expert LoRA) and of
expert -1 are untouched.

  moe_lora_align_block_size(topk_ids, token_lora_mapping, num_experts, block_size, max_loras,
                            adapter_enabled, expert_map=None, pad_sorted_ids=False)
      -> (sorted_token_ids (L * EM,), expert_ids (L * EM / block_size,), num_tokens_post_padded (L,))
  fused_moe_lora(output, x, lora_a_stacked, lora_b_stacked, topk_weights, sorted_token_ids,
                 expert_ids, num_tokens_post_padded, token_lora_mapping, max_lora_rank, top_k_num,
                 adapter_enabled, mul_routed_weight=False, offset=0, *, block_size=None, backend=None,
                 lora_a_scale=None, lora_b_scale=None)

fp8 (e4m3) expert weights (contract section 11): A_s and / or B_s in float8_e4m3fn with float32
channel scales a_scale_s (L, E, r) (per rank row) and b_scale_s (L, E, n_s) (per output column),
or (L,) per slot; the scale multiplies the float32 product once:

  output[t, k, offset + cols of s] += w(p) * b_scale_s[l, e] * (B_s[l, e] @ (a_scale_s[l, e] * (A_s[l, e] @ x)))

The alignment groups each slot's pairs by expert, padded to block_size (sentinel: the number of
pairs), all in tensors of sizes fixed by (pairs, L, E, block_size): no host sync, capturable.
sorted_token_ids None with expert_ids = topk_ids flattened is the naive order (one pair per block).
Backends: "torch" (reference, `moe_ref`), "triton" (`lora_core.kernels.moe_lora`); with
deterministic=True their batch-invariant forms (`invariant.fused_moe_lora`, the Triton kernel's
deterministic plan).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from lora_core import checks
from lora_core.moe_order import moe_block_size, naive_block_assignment  # noqa: F401 - the order rules, shared

from . import dispatch


def require_tensors(**named) -> None:
    """Every value must be a torch.Tensor (a TypeError naming the argument otherwise)."""
    for name, value in named.items():
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")


def check_tensors(**named) -> None:
    """Every tensor given (lists and tuples item by item, None skipped) on one device."""
    devices = {}
    for name, value in named.items():
        items = value if isinstance(value, (list, tuple)) else (value,)
        for i, t in enumerate(items):
            if t is None:
                continue
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{name}[{i}] must be a torch.Tensor, got {type(t).__name__}")
            devices.setdefault(t.device, name if len(items) == 1 else f"{name}[{i}]")
    if len(devices) > 1:
        raise ValueError("tensors are on different devices: "
                         + ", ".join(f"{label} on {dev}" for dev, label in devices.items()))


def max_num_tokens_padded(num_pairs: int, num_experts: int, block_size: int, pad_sorted_ids: bool = False) -> int:
    """The length per slot of sorted_token_ids: every pair plus block_size - 1 padding per expert
    (rounded up to a multiple of block_size whatever pad_sorted_ids: the kernels take whole blocks)."""
    padded = num_pairs + num_experts * (block_size - 1)
    return -(-padded // block_size) * block_size


@torch.no_grad()
def moe_lora_align_block_size(topk_ids: torch.Tensor, token_lora_mapping: torch.Tensor, num_experts: int,
                              block_size: int, max_loras: int, adapter_enabled: torch.Tensor,
                              expert_map: torch.Tensor | None = None, pad_sorted_ids: bool = False):
    """Each slot's pairs sorted by expert, each expert's run padded to a multiple of block_size.

    1. key(p) = l * E + e for a pair of an enabled slot l with expert e >= 0, else L * E (dropped).
    2. A stable sort by key; a pair's place in its run is its sorted position minus the run's start.
    3. Run (l, e) starts at the sum of the padded run lengths of slot l's experts before e; the
       pair goes to sorted_token_ids[l, start + place]; the rest holds the sentinel num_pairs.
    4. expert_ids[l, m] is the expert whose padded run holds block m (-1 past the slot's end);
       expert_map (expert parallelism) maps it to the local expert.
    Returns (sorted_token_ids (L * EM,) int32, expert_ids (L * EM // block_size,) int32,
    num_tokens_post_padded (L,) int32), EM = max_num_tokens_padded(...).
    """
    require_tensors(topk_ids=topk_ids, token_lora_mapping=token_lora_mapping, adapter_enabled=adapter_enabled)
    if topk_ids.dim() != 2:
        raise ValueError(f"topk_ids: expected (num_tokens, top_k), got shape {tuple(topk_ids.shape)}")
    if block_size < 1:
        raise ValueError(f"block_size: expected an int >= 1, got {block_size}")
    device = topk_ids.device
    num_tokens, top_k = topk_ids.shape
    pairs = num_tokens * top_k
    em = max_num_tokens_padded(pairs, num_experts, block_size, pad_sorted_ids)
    blocks = em // block_size
    lora = token_lora_mapping[:num_tokens].long().repeat_interleave(top_k)
    expert = topk_ids.reshape(-1).long()
    valid_lora = (lora >= 0) & (lora < max_loras)
    safe_lora = torch.where(valid_lora, lora, torch.zeros_like(lora))
    enabled = adapter_enabled[:max_loras].to(device)[safe_lora] != 0
    keep = valid_lora & enabled & (expert >= 0) & (expert < num_experts)
    groups = max_loras * num_experts
    key = torch.where(keep, safe_lora * num_experts + expert.clamp(0, num_experts - 1),
                      torch.full_like(lora, groups))
    # a scatter-add, not torch.bincount, whose CUDA kernel reads the largest key on the host (no
    # capture in a CUDA graph)
    counts = torch.zeros(groups + 1, dtype=torch.int64, device=device).scatter_add_(0, key, torch.ones_like(key))
    counts = counts[:groups].view(max_loras, num_experts)
    padded = (counts + block_size - 1) // block_size * block_size
    run_end = torch.cumsum(padded, dim=1)
    run_start = run_end - padded
    order = torch.sort(key, stable=True).indices
    sorted_key = key[order]
    first = torch.cumsum(torch.cat([counts.new_zeros(1), counts.reshape(-1)]), 0)[:-1]
    kept = sorted_key < groups
    group = torch.where(kept, sorted_key, torch.zeros_like(sorted_key))
    place = torch.arange(pairs, device=device) - first[group]
    slot_of = group // num_experts
    dest = slot_of * em + run_start.reshape(-1)[group] + place
    sorted_ids = torch.full((max_loras * em,), pairs, dtype=torch.int32, device=device)
    dest = torch.where(kept, dest, torch.full_like(dest, max_loras * em))
    sorted_ids = torch.cat([sorted_ids, sorted_ids.new_zeros(1)])
    sorted_ids.scatter_(0, dest, order.to(torch.int32))
    sorted_ids = sorted_ids[:-1]
    total = run_end[:, -1]
    block_start = torch.arange(blocks, device=device) * block_size
    expert_of_block = (run_end[:, None, :] <= block_start[None, :, None]).sum(-1)
    expert_ids = torch.where(block_start[None, :] < total[:, None], expert_of_block,
                             torch.full_like(expert_of_block, -1))
    if expert_map is not None:
        mapped = expert_map.to(device).long()[expert_ids.clamp(min=0)]
        expert_ids = torch.where(expert_ids >= 0, mapped, expert_ids)
    return sorted_ids, expert_ids.reshape(-1).to(torch.int32), total.to(torch.int32)


def _check_fused_args(output, x, lora_a, lora_b, topk_weights, sorted_ids, expert_ids, post_pad, token_lora,
                      top_k_num, adapter_enabled, mul_routed_weight, offset):
    require_tensors(output=output, x=x, topk_weights=topk_weights, expert_ids=expert_ids,
                    token_lora_mapping=token_lora, adapter_enabled=adapter_enabled)
    check_tensors(output=output, x=x, lora_a_stacked=tuple(lora_a), lora_b_stacked=tuple(lora_b),
                  topk_weights=topk_weights, expert_ids=expert_ids)
    if not lora_a or len(lora_a) != len(lora_b) or len(lora_a) > 2:
        raise ValueError(f"lora_a_stacked / lora_b_stacked: expected 1 or 2 slices each, the same number, got "
                         f"{len(lora_a)} and {len(lora_b)}")
    if output.dim() != 3 or topk_weights.dim() != 2 or output.shape[:2] != topk_weights.shape:
        raise ValueError(f"output: expected (num_tokens, top_k, N) matching topk_weights (num_tokens, top_k) "
                         f"{tuple(topk_weights.shape)}, got {tuple(output.shape)}")
    if top_k_num != topk_weights.shape[1]:
        raise ValueError(f"top_k_num: expected topk_weights.shape[1] = {topk_weights.shape[1]}, got {top_k_num}")
    num_tokens = output.shape[0]
    rows = num_tokens * top_k_num if mul_routed_weight else num_tokens
    if x.dim() != 2 or x.shape[0] != rows:
        what = "one row per (token, expert) pair" if mul_routed_weight else "one row per token"
        raise ValueError(f"x: expected ({rows}, K) ({what}), got {tuple(x.shape)}")
    for s, (a, b) in enumerate(zip(lora_a, lora_b)):
        if a.dim() != 4 or b.dim() != 4 or a.shape[:2] != b.shape[:2] or a.shape[2] != b.shape[3]:
            raise ValueError(f"slice {s}: expected lora_a (L, E, r, K) and lora_b (L, E, n, r), got "
                             f"{tuple(a.shape)} and {tuple(b.shape)}")
        if a.shape[3] != x.shape[1]:
            raise ValueError(f"lora_a_stacked[{s}]: expected K = x.shape[1] = {x.shape[1]}, got {tuple(a.shape)}")
    width = sum(b.shape[2] for b in lora_b)
    if offset < 0 or offset + width > output.shape[2]:
        raise ValueError(f"offset: the slices' {width} columns from offset {offset} must fit output's "
                         f"{output.shape[2]} columns")
    if sorted_ids is None:
        if expert_ids.numel() != num_tokens * top_k_num:
            raise ValueError(f"expert_ids: without sorted_token_ids expected topk_ids flattened "
                             f"({num_tokens * top_k_num},), got {tuple(expert_ids.shape)}")
    elif post_pad is None:
        raise ValueError("num_tokens_post_padded: required with sorted_token_ids")


def expert_scales(name: str, scales, weights: Sequence[torch.Tensor], arg_w: str) -> tuple | None:
    """The fp8 scales of the MoE op's expert weights checked (`checks.check_expert_scales`) and made
    float32 (L, E, rows) contiguous per slice (a per-slot (L,) scale broadcast to every expert and
    channel); None for 16-bit weights."""
    if isinstance(scales, torch.Tensor):
        scales = (scales,)
    if scales is not None:
        scales = tuple(scales)
        for s, sc in enumerate(scales):
            if sc is not None and not isinstance(sc, torch.Tensor):
                raise TypeError(f"{name}[{s}] must be a torch.Tensor or None, got {type(sc).__name__}")
    kinds = checks.check_expert_scales(name, None if scales is None else
                                       [None if sc is None else (sc.shape, sc.dtype) for sc in scales],
                                       [w.shape for w in weights], [w.dtype for w in weights], arg_w)
    if all(k is None for k in kinds):
        return None
    out = []
    for sc, w, kind in zip(scales, weights, kinds):
        if kind == "tensor":
            sc = sc[:, None, None].expand(w.shape[:3])
        out.append(sc.to(w.device).contiguous())
    return tuple(out)


def fused_moe_lora(output: torch.Tensor, x: torch.Tensor, lora_a_stacked: Sequence[torch.Tensor],
                   lora_b_stacked: Sequence[torch.Tensor], topk_weights: torch.Tensor,
                   sorted_token_ids: torch.Tensor | None, expert_ids: torch.Tensor,
                   num_tokens_post_padded: torch.Tensor | None, token_lora_mapping: torch.Tensor,
                   max_lora_rank: int, top_k_num: int, adapter_enabled: torch.Tensor,
                   mul_routed_weight: bool = False, offset: int = 0, *, block_size: int | None = None,
                   backend: str | None = None, deterministic: bool = False, lora_a_scale=None,
                   lora_b_scale=None) -> torch.Tensor:
    """output (T, top_k, N) updated in place with the slices' LoRA of every routed pair (module
    docstring) and returned. sorted_token_ids (L, EM) or (L * EM,) and expert_ids from
    `moe_lora_align_block_size` with block_size (default: EM's largest power-of-two divisor, at
    most 64), or None and topk_ids flattened (the naive order). deterministic: a pair's values
    bitwise the same whatever the other pairs and its position (the backend's batch-invariant
    form, dispatch.deterministic_impl). lora_a_scale / lora_b_scale: one entry per slice for fp8
    weights (module docstring), None for 16-bit ones."""
    lora_a, lora_b = tuple(lora_a_stacked), tuple(lora_b_stacked)
    _check_fused_args(output, x, lora_a, lora_b, topk_weights, sorted_token_ids, expert_ids,
                      num_tokens_post_padded, token_lora_mapping, top_k_num, adapter_enabled, mul_routed_weight,
                      offset)
    fp8 = {}
    for key, name, scales, weights, arg_w in (("lora_a_scale", "lora_a_scale", lora_a_scale, lora_a, "lora_a_stacked"),
                                              ("lora_b_scale", "lora_b_scale", lora_b_scale, lora_b, "lora_b_stacked")):
        checked = expert_scales(name, scales, weights, arg_w)
        if checked is not None:
            fp8[key] = checked
    num_slots = lora_a[0].shape[0]
    if sorted_token_ids is not None:
        sorted_token_ids = sorted_token_ids.reshape(num_slots, -1)
        em = sorted_token_ids.shape[1]
        if block_size is None:
            block_size = min(64, em & -em) if em else 16
        expert_ids = expert_ids.reshape(num_slots, -1)
        if expert_ids.shape[1] * block_size != em:
            raise ValueError(f"expert_ids: expected {em // block_size} blocks per slot for block_size {block_size}, "
                             f"got {expert_ids.shape[1]}")
    impl = dispatch.resolve(backend, output.device, deterministic=deterministic)
    run = getattr(impl, "fused_moe_lora", None)
    if run is None:
        raise ValueError(f"backend {impl.NAME!r} has no fused_moe_lora")
    run(output, x, lora_a, lora_b, topk_weights, sorted_token_ids, expert_ids, num_tokens_post_padded,
        token_lora_mapping, max_lora_rank, top_k_num, adapter_enabled, bool(mul_routed_weight), int(offset),
        block_size, **fp8)
    return output
