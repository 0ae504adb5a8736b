"""Reference backend "torch": the ops in plain torch, written for clarity (the oracle's twin).

Math (contract section 4), idx[t] the slot of token t or -1, every product in float32:

  shrink:  out[s, t, :] = scale * x[t] @ A_s[idx[t]].T               (0 where idx[t] = -1)
  expand:  y[t, off_s : off_s + n_s] = (y[t, ...] if add_inputs else 0) + buf[s, t] @ B_s[idx[t]].T
           + bias_s[idx[t]]                                         (rows with idx -1 untouched)

fp8 (e4m3) weights (contract section 11): every product is computed with the fp8 values as float32
and each token's own (T, r) / (T, n) product is multiplied once by its slot's channel scales
(a_scales[s] (L, r), b_scales[s] (L, n_s)), as the kernels do:

  shrink:  out[s, t, c] = scale * a_scale_s[idx[t], c] * x[t] @ float32(A_q,s[idx[t], c]).T
  expand:  delta[t, n]  = b_scale_s[idx[t], n] * buf[s, t] @ float32(B_q,s[idx[t], n]).T

Invariant: a slot's weights reach only the tokens of that slot. A slot is *selected* (a gather, or
`where` on the token's slot), never multiplied by a one-hot 0: 0 * NaN = NaN, so a NaN or Inf in
any slot -- one no token uses, an empty one, the rank padding -- would otherwise turn every LoRA row
of the batch NaN. For the same reason rank padding and no-LoRA rows are masked with `where`.

  shrink: one matmul of x against every slot's A, (T, L, r), then each token takes its own slot's
          row (a gather).
  expand: every slot's buf @ B_l.T, (T, L, n), then a gather of the token's own slot (small
          sizes), or a loop over the L slots keeping slot l's product only on slot l's tokens
          (memory (T, n) whatever L).
Several adapters per token (`pairs`, lora_core.adapter_pairs): the metadata's ids are groups;
pair j of token t is slot pairs.slots[group[t], j] with weight pairs.weights[t, j]. The shrink
writes pair j's weighted product at the rank columns j*r .. (j+1)*r of the buffer, and the expand
adds every pair's product to y once (one float32 sum, one write).

No data-dependent shapes and no host sync on any device (CUDA-graph capturable), at the price of
reading every slot's weights and computing every slot for every token: it is the fallback, not the
fast path.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

NAME = "torch"
EXPAND_GATHER_MAX = 1 << 20
"""Expand computes all slots at once while T * L * n_s <= this many float32 values (4 MiB), and
loops over the slots above it (see `_expand_slots`)."""


def _slots(idx: torch.Tensor, num_slots: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(valid (T,) bool, slot (T,) int64): valid is false for -1 and anything outside 0..L-1, whose
    slot is 0 (a safe index; their results are masked out with `valid`)."""
    valid = (idx >= 0) & (idx < num_slots)
    return valid, torch.where(valid, idx, torch.zeros_like(idx)).long()


def _rank_keep(lora_ranks: torch.Tensor, num_slots: int, rank: int, device) -> torch.Tensor:
    """(L, r) bool: True for the first lora_ranks[l] rank columns of slot l (the rest is padding)."""
    cols = torch.arange(rank, device=device)[None, :]
    return cols < lora_ranks[:num_slots, None].to(device)


def _shrink_rows(xf: torch.Tensor, a: torch.Tensor, slot: torch.Tensor) -> torch.Tensor:
    """(T, r) float32: xf[t] @ a[slot[t]].T -- one matmul against every slot, (T, L, r), then each
    token's own slot (a gather)."""
    every = torch.einsum("th,lrh->tlr", xf, a.to(torch.float32))
    return torch.take_along_dim(every, slot[:, None, None], dim=1)[:, 0]


def pair_columns(idx: torch.Tensor, pairs) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """[(slot (T,), weight (T,) float32) per pair]: each token's pair j, from its group id idx (-1:
    no adapter, every pair's slot -1) and the pair tables."""
    t = idx.shape[0]
    slots, weights = pairs.slots.to(idx.device), pairs.weights.to(idx.device)
    has = (idx >= 0) & (idx < slots.shape[0])
    g = torch.where(has, idx, torch.zeros_like(idx)).long()
    out = []
    for j in range(slots.shape[1]):
        slot = torch.where(has, slots[g, j], torch.full_like(slots[g, j], -1))
        out.append((slot, weights[:t, j].to(torch.float32)))
    return out


@torch.no_grad()
def shrink(x: torch.Tensor, lora_a: Sequence[torch.Tensor], out: torch.Tensor, meta_args: tuple,
           scale: float, lora_ranks: torch.Tensor | None = None, *, rows=_shrink_rows, pairs=None,
           a_scales=None) -> None:
    """out[s] (T, r) float32 written ((T, k * r) with k adapter pairs: pair j at columns j*r..). rows(xf,
    a, slot) -> (T, r): how each token's own product is computed (torch_lora.ops.invariant passes
    its batch-invariant form). a_scales: None or S entries, each None or the (L, r) float32
    channel scales of an fp8 A_s."""
    t = x.shape[0]
    idx = meta_args[0][:t]   # token_lora_mapping, meta_args' first entry (the only one read here)
    xf = x.to(torch.float32)
    columns = [(idx, None)] if pairs is None else pair_columns(idx, pairs)
    for s, a in enumerate(lora_a):
        num_slots, rank, _ = a.shape
        for j, (idx_j, weight) in enumerate(columns):
            valid, slot = _slots(idx_j, num_slots)
            own = rows(xf, a, slot)                                                # (T, r)
            if a_scales is not None and a_scales[s] is not None:
                own = own * a_scales[s].to(torch.float32)[slot]                    # fp8: own slot's scales
            keep = valid[:, None]
            if lora_ranks is not None:
                keep = keep & _rank_keep(lora_ranks, num_slots, rank, x.device)[slot]
            own = scale * own if weight is None else (scale * weight)[:, None] * own
            out[s][:, j * rank:(j + 1) * rank].copy_(torch.where(keep, own, torch.zeros_like(own)))


def _expand_slots(x: torch.Tensor, slot: torch.Tensor, b: torch.Tensor,
                  keep: torch.Tensor | None) -> torch.Tensor:
    """(T, n) float32: x[t] @ b[slot[t]].T. x (T, r) float32; b (L, n, r); keep: None or (L, r)
    bool, the rank columns of each slot to use (the padding is masked with `where`).

    Small (decode) sizes compute every slot for every token, (T, L, n), and gather each token's
    own slot (one matmul); larger ones loop over the slots (L static) and keep slot l's product
    only on slot l's tokens, so memory stays (T, n) whatever L.
    """
    num_slots, width, rank = b.shape
    t = x.shape[0]
    if t * num_slots * width <= EXPAND_GATHER_MAX:
        bf = b.to(torch.float32)
        if keep is not None:
            bf = torch.where(keep[:, None, :], bf, torch.zeros_like(bf))
        every = (x @ bf.reshape(num_slots * width, rank).T).view(t, num_slots, width)    # (T, L, n)
        return torch.take_along_dim(every, slot[:, None, None], dim=1)[:, 0]
    out = x.new_zeros((t, width))
    part = torch.empty_like(out)
    for l in range(num_slots):
        b_l = b[l].to(torch.float32)
        if keep is not None:
            b_l = torch.where(keep[l][None, :], b_l, torch.zeros_like(b_l))
        torch.matmul(x, b_l.T, out=part)
        torch.where((slot == l)[:, None], part, out, out=out)
    return out


@torch.no_grad()
def expand(buf: torch.Tensor, lora_b: Sequence[torch.Tensor], y: torch.Tensor, meta_args: tuple,
           offsets: Sequence[int], add_inputs: bool, lora_ranks: torch.Tensor | None = None,
           bias=None, *, rows=None, col_scale=None, pairs=None, b_scales=None) -> None:
    """With lora_ranks, B's columns past a slot's rank and buf's values past a token's rank are
    ignored. rows(x, slot, b, keep) -> (T, n): each token's own product (default `_expand_slots`;
    torch_lora.ops.invariant passes its batch-invariant form). col_scale: None or S entries, each
    None or (L, n_s): a token's new slice values are multiplied by col_scale[s][idx[t]] (DoRA's
    column scale, lora_core.dora), after the bias. pairs: several adapters per token (the module
    docstring; no bias or col_scale then). b_scales: None or S entries, each None or the (L, n_s)
    float32 channel scales of an fp8 B_s (a token's product times its slot's row, before the bias)."""
    rows = rows or _expand_slots
    t = y.shape[0]
    idx = meta_args[0][:t]   # token_lora_mapping, meta_args' first entry (the only one read here)
    if pairs is not None:
        _expand_pairs(buf, lora_b, y, pair_columns(idx, pairs), offsets, add_inputs, lora_ranks, bias, col_scale,
                      rows, b_scales)
        return
    for s, (b, off) in enumerate(zip(lora_b, offsets)):
        num_slots, width, rank = b.shape
        valid, slot = _slots(idx, num_slots)
        x = buf[s].to(torch.float32)
        keep = None
        if lora_ranks is not None:
            keep = _rank_keep(lora_ranks, num_slots, rank, y.device)              # (L, r)
            x = torch.where(keep[slot], x, torch.zeros_like(x))                    # past the token's rank
        delta = _channel_scaled(rows(x, slot, b, keep), b_scales, s, slot)
        if bias is not None and bias[s] is not None:
            delta = delta + bias[s][slot].to(torch.float32)                        # own slot only
        old = y[:, off:off + width]
        new = old.to(torch.float32) + delta if add_inputs else delta
        if col_scale is not None and col_scale[s] is not None:
            new = new * col_scale[s][slot].to(torch.float32)                    # DoRA: g[slot] per column
        old.copy_(torch.where(valid[:, None], new.to(y.dtype), old))


def _channel_scaled(delta: torch.Tensor, scales, s: int, slot: torch.Tensor) -> torch.Tensor:
    """delta (T, n) times slot[t]'s row of scales[s] (an fp8 weight's channel scales), or delta."""
    if scales is None or scales[s] is None:
        return delta
    return delta * scales[s].to(torch.float32)[slot]


def _expand_pairs(buf, lora_b, y, columns, offsets, add_inputs, lora_ranks, bias, col_scale, rows,
                  b_scales=None) -> None:
    """`expand` with adapter pairs: y[t, slice s] (+)= sum_j buf[s, t, j*r:(j+1)*r] @ B_s[slot_j].T over
    the token's pairs; rows without any pair are untouched."""
    if bias is not None and any(b is not None for b in bias) or col_scale is not None and any(
            g is not None for g in col_scale):
        raise ValueError("several adapters per token take no LoRA bias or DoRA column scale (lora_bias_stacked / "
                         "dora_scale_stacked must be None)")
    for s, (b, off) in enumerate(zip(lora_b, offsets)):
        num_slots, width, rank = b.shape
        keep = None if lora_ranks is None else _rank_keep(lora_ranks, num_slots, rank, y.device)   # (L, r)
        delta = torch.zeros((y.shape[0], width), dtype=torch.float32, device=y.device)
        any_pair = torch.zeros(y.shape[0], dtype=torch.bool, device=y.device)
        for j, (idx_j, _) in enumerate(columns):
            valid, slot = _slots(idx_j, num_slots)
            x = buf[s][:, j * rank:(j + 1) * rank].to(torch.float32)
            if keep is not None:
                x = torch.where(keep[slot], x, torch.zeros_like(x))
            part = _channel_scaled(rows(x, slot, b, keep), b_scales, s, slot)
            delta = delta + torch.where(valid[:, None], part, torch.zeros_like(part))
            any_pair = any_pair | valid
        old = y[:, off:off + width]
        new = old.to(torch.float32) + delta if add_inputs else delta
        old.copy_(torch.where(any_pair[:, None], new.to(y.dtype), old))


from .moe_ref import fused_moe_lora  # noqa: E402,F401 - the MoE LoRA op of this backend
