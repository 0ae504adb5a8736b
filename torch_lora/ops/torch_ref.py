"""Reference backend "torch": the ops in plain torch, written for clarity (the oracle's twin).

Math (SPEC section 4), idx[t] the slot of token t or -1, every product in float32:

  shrink:  out[s, t, :] = scale * x[t] @ A_s[idx[t]].T               (0 where idx[t] = -1)
  expand:  y[t, off_s : off_s + n_s] = (y[t, ...] if add_inputs else 0) + buf[s, t] @ B_s[idx[t]].T
           + bias_s[idx[t]]                                         (rows with idx -1 untouched)

The slot is selected with a one-hot matrix over all slots: no data-dependent shapes, so no host
sync on any device, at the price of reading every slot's weights (it is the fallback, not the fast
path).
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

NAME = "torch"


def _one_hot(idx: torch.Tensor, num_slots: int) -> torch.Tensor:
    """(T, L) float32; all-zero rows for -1 and for indices outside 0..L-1."""
    valid = (idx >= 0) & (idx < num_slots)
    hot = torch.nn.functional.one_hot(torch.where(valid, idx, 0).long(), num_slots).to(torch.float32)
    return hot * valid[:, None]


def _rank_mask(lora_ranks: torch.Tensor, num_slots: int, rank: int, device) -> torch.Tensor:
    """(L, r) float32: 1 for the first lora_ranks[l] columns of slot l."""
    cols = torch.arange(rank, device=device)[None, :]
    return (cols < lora_ranks[:num_slots, None].to(device)).to(torch.float32)


@torch.no_grad()
def shrink(x: torch.Tensor, lora_a: Sequence[torch.Tensor], out: torch.Tensor, meta_args: tuple,
           scale: float, lora_ranks: Optional[torch.Tensor] = None) -> None:
    t = x.shape[0]
    idx = meta_args[0][:t]
    xf = x.to(torch.float32)
    for s, a in enumerate(lora_a):
        num_slots, rank, _ = a.shape
        hot = _one_hot(idx, num_slots)
        every = torch.einsum("th,lrh->tlr", xf, a.to(torch.float32))
        if lora_ranks is not None:
            every = every * _rank_mask(lora_ranks, num_slots, rank, x.device)[None]
        out[s].copy_(scale * torch.einsum("tl,tlr->tr", hot, every))


@torch.no_grad()
def expand(buf: torch.Tensor, lora_b: Sequence[torch.Tensor], y: torch.Tensor, meta_args: tuple,
           offsets: Sequence[int], add_inputs: bool, lora_ranks: Optional[torch.Tensor] = None,
           bias=None) -> None:
    t = y.shape[0]
    idx = meta_args[0][:t]
    for s, (b, off) in enumerate(zip(lora_b, offsets)):
        num_slots, width, rank = b.shape
        hot = _one_hot(idx, num_slots)
        routed = hot[:, :, None] * buf[s].to(torch.float32)[:, None, :]      # (T, L, r)
        if lora_ranks is not None:
            routed = routed * _rank_mask(lora_ranks, num_slots, rank, y.device)[None]
        delta = torch.einsum("tlr,lnr->tn", routed, b.to(torch.float32))
        if bias is not None and bias[s] is not None:
            delta = delta + hot @ bias[s].to(torch.float32)
        old = y[:, off:off + width]
        new = old.to(torch.float32) + delta if add_inputs else delta
        has_lora = hot.sum(dim=1, keepdim=True) > 0
        old.copy_(torch.where(has_lora, new.to(y.dtype), old))
