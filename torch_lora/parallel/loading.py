"""Writing one adapter into one slot of a tensor-parallel LoRA layer: each rank keeps only its shard.

Math. For output slice s of the layer, the full (unsharded) adapter factors in PEFT's orientation
A_s (r_s, in) and B_s (out_s, r_s) (for an embedding: in = the vocabulary, A = lora_embedding_A),
and the slice's `SliceShard` (layout.py) with ranges a_rank, a_in, b_out:

  lora_a_s[slot] = A_s[a_rank, a_in]              (as (in, rank) for an embedding table)
  lora_b_s[slot] = scaling * B_s[b_out, :]
  lora_bias_s[slot] = bias_s[b_out]               (added as given, not scaled)

zero-padded to the slot's shape (ranks below max_rank, rows or columns past the full size in a
padded vocabulary shard); a slice the adapter does not target (None) is zero.

Steps:
  1. Check the slot, and every given factor's shape against the layer's full sizes.
  2. Cut this rank's rows/columns out of each full factor where it lies (a host tensor stays on the
     host: only the cut piece is copied to the layer's device, so no rank holds another rank's part
     of B after loading).
  3. Write the pieces into the slot (in place: addresses captured by CUDA graphs stay valid), and
     the slot's ranks: lora_ranks[slot] = max_s r_s; lora_ranks_local[slot] = the part of it in this
     rank's chunk of the rank axis (equal to lora_ranks unless A is split along the rank).
  4. With the layer's check_agreement: slot_digests[slot] = a digest of the full factors as given
     (dtype, shape and bytes of every A, B and bias, and `scaling`), equal on every rank that loads
     the same adapter (agreement.py; it reads the whole factors once, on the host); 0 when cleared.

The caller's tensors are not kept. NumPy arrays (lora_core.peft's output) and torch tensors are
accepted; the cut is converted to the layer's dtype on copy.
"""

from __future__ import annotations

import numbers

import numpy as np
import torch

from . import agreement

__all__ = ["adapter_digest", "clear_lora_slot", "load_lora_slot", "local_rank", "shard_cut"]


def _check_layer_and_slot(layer, slot) -> None:
    if not hasattr(layer, "slice_shards") or not hasattr(layer, "lora_ranks"):
        raise TypeError(f"layer must be a tensor-parallel LoRA layer (torch_lora.parallel), got "
                        f"{type(layer).__name__}")
    if not isinstance(slot, numbers.Integral) or isinstance(slot, bool) or not 0 <= slot < layer.max_loras:
        raise ValueError(f"slot must be an int in [0, {layer.max_loras}) (the layer's max_loras), got {slot!r}")


def _per_slice(name: str, value, num_slices: int) -> list:
    if isinstance(value, (list, tuple)):
        if len(value) != num_slices:
            raise ValueError(f"{name} must hold one entry per slice ({num_slices}), got {len(value)}")
        return list(value)
    if num_slices != 1:
        raise ValueError(f"{name} must be a sequence of {num_slices} per-slice tensors (None where the adapter "
                         f"does not target a slice), got a single {type(value).__name__}")
    return [value]


def _host_view(name: str, value) -> torch.Tensor:
    """A tensor sharing the caller's memory (NumPy arrays included): nothing is copied here."""
    if isinstance(value, np.ndarray):
        if value.dtype.kind != "f":
            raise TypeError(f"{name} must hold floating-point values, got NumPy dtype {value.dtype}")
        value = torch.from_numpy(value)
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor or a NumPy array, got {type(value).__name__}")
    if not value.is_floating_point():
        raise TypeError(f"{name} must hold floating-point values, got dtype {value.dtype}")
    return value


def shard_cut(shard, a, b) -> tuple:
    """This rank's pieces of one slice's full factors A (r, full_in) and B (full_out, r), as views
    of them (torch tensors or NumPy arrays): (A piece as the slot stores it, i.e. (rank rows, input
    columns) or transposed for an embedding table, or None; B rows, or None; (o0, o1) the rows of B
    and of the bias taken). Each piece goes into the top-left corner of its zeroed slot."""
    r = a.shape[0]
    r0, r1 = shard.a_rank[0], min(shard.a_rank[1], r)
    i0, i1 = shard.a_in[0], min(shard.a_in[1], shard.full_in)
    a_piece = None
    if r1 > r0 and i1 > i0:
        a_piece = a[r0:r1, i0:i1].T if shard.a_table else a[r0:r1, i0:i1]
    o0, o1 = shard.b_out[0], min(shard.b_out[1], shard.full_out)
    return a_piece, (b[o0:o1] if o1 > o0 else None), (o0, o1)


def local_rank(shard, rank: int) -> int:
    """The part of an adapter's rank that lies in this rank's chunk of A's rank axis."""
    r0, r1 = shard.a_rank
    return max(0, min(rank, r1) - r0)


def load_lora_slot(layer, slot: int, lora_a, lora_b, lora_bias=None, *, scaling: float = 1.0) -> None:
    """Writes this rank's shard of one adapter into slot `slot` of `layer` (see the module docstring).

    Args:
      layer: a torch_lora.parallel layer.
      slot: 0 .. layer.max_loras - 1.
      lora_a: per slice, A_s (r_s, in) or None; a single tensor for a one-slice layer.
      lora_b: per slice, B_s (out_s, r_s) or None, None exactly where lora_a is None.
      lora_bias: per slice, (out_s,) or None; only for layers built with lora_bias=True.
      scaling: multiplies B (PEFT's lora_alpha / r), so the layer runs with scale 1.
    """
    _check_layer_and_slot(layer, slot)
    if not isinstance(scaling, numbers.Real) or isinstance(scaling, bool):
        raise TypeError(f"scaling must be a real number, got {type(scaling).__name__}")
    shards = layer.slice_shards
    a_list = _per_slice("lora_a", lora_a, len(shards))
    b_list = _per_slice("lora_b", lora_b, len(shards))
    bias_list = [None] * len(shards) if lora_bias is None else _per_slice("lora_bias", lora_bias, len(shards))
    if lora_bias is not None and not layer.lora_bias:
        raise ValueError("lora_bias was given, but the layer was built with lora_bias=False")

    # 1. checks (nothing is written before every factor has passed)
    pieces, rank = [], 0
    for s, (shard, a, b, bias) in enumerate(zip(shards, a_list, b_list, bias_list)):
        sfx = f"[{s}]" if len(shards) > 1 else ""
        if (a is None) != (b is None):
            raise ValueError(f"lora_a{sfx} and lora_b{sfx} must both be given or both be None, got "
                             f"{'None' if a is None else 'a tensor'} and {'None' if b is None else 'a tensor'}")
        if a is None:
            if bias is not None:
                raise ValueError(f"lora_bias{sfx} was given for a slice without lora_a{sfx} / lora_b{sfx}")
            pieces.append(None)
            continue
        a, b = _host_view(f"lora_a{sfx}", a), _host_view(f"lora_b{sfx}", b)
        if a.dim() != 2 or a.shape[1] != shard.full_in or not 1 <= a.shape[0] <= layer.max_rank:
            raise ValueError(f"lora_a{sfx} must have shape (rank <= {layer.max_rank}, {shard.full_in}), "
                             f"got {tuple(a.shape)}")
        r = a.shape[0]
        if b.dim() != 2 or tuple(b.shape) != (shard.full_out, r):
            raise ValueError(f"lora_b{sfx} must have shape ({shard.full_out}, {r}) (out_features, the rank of "
                             f"lora_a{sfx}), got {tuple(b.shape)}")
        if bias is not None:
            bias = _host_view(f"lora_bias{sfx}", bias)
            if tuple(bias.shape) != (shard.full_out,):
                raise ValueError(f"lora_bias{sfx} must have shape ({shard.full_out},), got {tuple(bias.shape)}")
        rank = max(rank, r)
        pieces.append((a, b, bias))
    slot_digest = adapter_digest(pieces, scaling) if getattr(layer, "check_agreement", False) else 0

    # 2.-3. cut this rank's piece out of each full factor and write it
    a_slots, b_slots, bias_slots = layer.lora_a_stacked, layer.lora_b_stacked, layer.lora_bias_stacked
    with torch.no_grad():
        for s, (shard, piece) in enumerate(zip(shards, pieces)):
            a_dst, b_dst = a_slots[s][slot], b_slots[s][slot]
            a_dst.zero_()
            b_dst.zero_()
            if bias_slots is not None:
                bias_slots[s][slot].zero_()
            if piece is None:
                continue
            a, b, bias = piece
            a_piece, b_piece, (o0, o1) = shard_cut(shard, a, b)
            if a_piece is not None:
                a_dst[: a_piece.shape[0], : a_piece.shape[1]].copy_(a_piece)
            if b_piece is not None:
                b_dst[: o1 - o0, : a.shape[0]].copy_(b_piece.to(torch.float32) * float(scaling))
                if bias is not None:
                    bias_slots[s][slot][: o1 - o0].copy_(bias[o0:o1])
        layer.lora_ranks[slot] = rank
        layer.lora_ranks_local[slot] = local_rank(shards[0], rank)
    layer.slot_digests[slot] = slot_digest
    agreement.note_change()


def clear_lora_slot(layer, slot: int) -> None:
    """Empties slot `slot` of `layer`: weights and bias zero, ranks 0."""
    _check_layer_and_slot(layer, slot)
    with torch.no_grad():
        for t in layer.lora_a_stacked + layer.lora_b_stacked + (layer.lora_bias_stacked or ()):
            t[slot].zero_()
        layer.lora_ranks[slot] = 0
        layer.lora_ranks_local[slot] = 0
    layer.slot_digests[slot] = 0
    agreement.note_change()


def adapter_digest(pieces, scaling) -> int:
    """A digest of one adapter's full factors: per slice None or (A, B, bias or None), and scaling."""
    return agreement.digest(("adapter", float(scaling), [
        None if p is None else tuple(None if t is None else agreement.tensor_digest(t) for t in p) for p in pieces]))
