"""The state every tensor-parallel LoRA layer shares: its base layer shard, its process group, its
layout, and its stacked adapter slots (this rank's shard of each).

Per output slice s, with L = max_loras slots and the ranges of `SliceShard` (layout.py):

  lora_a_{s}     (L, a_rows, a_cols)   this rank's A: (rank rows, input columns), or for an
                                       embedding table (vocabulary rows, rank)
  lora_b_{s}     (L, b_rows, max_rank) this rank's B rows
  lora_bias_{s}  (L, b_rows)           with lora_bias=True
  lora_ranks       (L,) int32          each slot's adapter rank (0: empty slot)
  lora_ranks_local (L,) int32          the ranks this rank's A holds: equal to lora_ranks except
                                       when A is split along the rank axis (fully sharded column
                                       layers), where it is clamp(lora_ranks - p * r/P, 0, r/P)

They are non-persistent buffers (module.to() moves them; a base model's state_dict is unchanged).
Slots are written by `set_lora` / `reset_lora` (loading.py) and read by the forward pass through the
PunicaWrapper installed with `set_mapping`; without a wrapper a layer returns its base layer's output.

Agreement between ranks (agreement.py): with `check_agreement=True` (the default) a layer, once
built, all-gathers its geometry (class, P, max_loras, max_rank, layout, dtype, bias, the full sizes
of its slices) and every rank raises the same ValueError when a rank differs; and it keeps, per
slot, a digest of the full adapter last written there (`slot_digests`, 0 for an empty slot), which
a ParallelPunicaWrapper compares at each step. Building a layer is then a collective: every rank
builds the same layers in the same order, each with the same `check_agreement`.
"""

from __future__ import annotations

import torch

from lora_core import checks

from . import agreement, loading
from .comm import group_rank_and_size
from .layout import LAYOUTS, SliceShard, check_layout_args, choose_layout

__all__ = ["WRITTEN_THROUGH_VIEWS", "ParallelLoRALayer"]

WRITTEN_THROUGH_VIEWS = agreement.digest("slot written through slot_views")


def positive_int(name: str, value) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return value


class ParallelLoRALayer(torch.nn.Module):
    """Base of the tensor-parallel LoRA layers (linear.py, vocab.py).

    Subclasses set their geometry, then call `_build`, and define:
      `_slice_shards()` -> tuple[SliceShard]: the weights this rank keeps, for `self.fully_sharded`;
      `_sharding_problem()` -> str | None: why the fully sharded layout cannot be used, if it cannot;
      `layout_costs(num_tokens, num_adapters=None)` -> {layout: LayoutCost} (layout.py's formulas);
      `forward`.
    """

    def __init__(self, base_layer: torch.nn.Module, *, max_loras: int, max_rank: int, group=None,
                 check_agreement: bool = True):
        super().__init__()
        if not isinstance(check_agreement, bool):
            raise TypeError(f"check_agreement must be True or False, got {check_agreement!r}")
        self.check_agreement = check_agreement
        if not isinstance(base_layer, torch.nn.Module):
            raise TypeError(f"base_layer must be a torch.nn.Module, got {type(base_layer).__name__}")
        self.base_layer = base_layer
        self.max_loras = positive_int("max_loras", max_loras)
        self.max_rank = positive_int("max_rank", max_rank)
        self.group = group
        self.tp_rank, self.tp_size = group_rank_and_size(group)
        self.punica_wrapper = None
        # the PEFT module names of the output slices, in order (e.g. ("model.layers.0.self_attn.q_proj",
        # ...k_proj, ...v_proj)): set them to let torch_lora.AdapterManager load adapters into this layer
        self.module_names: tuple[str, ...] = ()

    # ------------------------------------------------------------------ construction
    def _build(self, **kwargs) -> None:
        """Resolves dtype and device, picks the layout, allocates the slots (zero: every slot empty);
        then, with check_agreement, checks that every rank built the same layer. A rank whose checks
        here fail (layout, dtype, sharding) still takes part in that check, so the other ranks raise
        too instead of waiting; the size checks a constructor makes before calling this raise at once
        (a rank failing one alone leaves the others waiting in this check until the group's timeout)."""
        error = None
        try:
            self._build_local(**kwargs)
        except (ValueError, TypeError) as e:
            if not self.check_agreement:
                raise
            error = e
        if self.check_agreement and not agreement.capturing():
            fields = [agreement.Field("the layer's own argument checks failed (1 or 0)", int(error is not None))]
            fields += self.geometry_fields()
            hint = "; build the same layers with the same arguments on every rank"
            if error is not None:
                hint += f"; on this rank: {type(error).__name__}: {error}"
            try:
                agreement.check_fields(f"the {type(self).__name__} being built", fields, self.group, self.tp_size,
                                       self.tp_rank, hint=hint)
            except ValueError as disagreement:
                raise disagreement from error
        if error is not None:
            raise error

    def _build_local(self, *, fully_sharded: bool | None, tokens_per_step: int | None,
                     adapters_per_step: int | None, link_weight: float, dtype, device, lora_bias: bool) -> None:
        check_layout_args(fully_sharded, tokens_per_step)
        param = next(self.base_layer.parameters(), None)
        self.dtype = dtype if dtype is not None else (param.dtype if param is not None else torch.get_default_dtype())
        if not isinstance(self.dtype, torch.dtype):
            raise TypeError(f"dtype must be a torch.dtype, got {self.dtype!r}")
        checks.check_dtype("dtype", self.dtype, checks.UNSCALED_WEIGHT_DTYPES)
        device = torch.device(device) if device is not None else (param.device if param is not None
                                                                  else torch.device("cpu"))
        problem = self._sharding_problem()
        if fully_sharded is None:
            costs = self.layout_costs(tokens_per_step, adapters_per_step)
            layout = "replicated" if problem else choose_layout(costs, link_weight)
        else:
            if fully_sharded and problem:
                raise ValueError(f"fully_sharded=True is not possible here: {problem}")
            layout = LAYOUTS[int(fully_sharded)]
        self.layout = layout
        self.fully_sharded = layout == "fully_sharded"
        self.slice_shards: tuple[SliceShard, ...] = tuple(self._slice_shards())
        L, r = self.max_loras, self.max_rank
        for s, shard in enumerate(self.slice_shards):
            self.register_buffer(f"lora_a_{s}", torch.zeros((L,) + shard.a_shape, dtype=self.dtype, device=device),
                                 persistent=False)
            self.register_buffer(f"lora_b_{s}", torch.zeros((L, shard.b_rows, r), dtype=self.dtype, device=device),
                                 persistent=False)
            if lora_bias:
                self.register_buffer(f"lora_bias_{s}", torch.zeros((L, shard.b_rows), dtype=self.dtype,
                                                                   device=device), persistent=False)
        self.lora_bias = bool(lora_bias)
        self.register_buffer("lora_ranks", torch.zeros(L, dtype=torch.int32, device=device), persistent=False)
        self.register_buffer("lora_ranks_local", torch.zeros(L, dtype=torch.int32, device=device), persistent=False)
        # per slot: a digest of the full adapter written there (loading.py), 0 when empty
        self.slot_digests: list[int] = [0] * L

    def geometry_fields(self) -> list:
        """What every rank's copy of this layer must share (agreement.Field): class, P, max_loras,
        max_rank, layout, dtype, bias, and the full (unsharded) sizes of each slice. What a failed
        build did not set counts as -1 (or the digest of None)."""
        F, d = agreement.Field, agreement.digest
        shards = getattr(self, "slice_shards", None)
        return [F("layer class", d(type(self).__qualname__), False),
                F("process group size", self.tp_size),
                F("max_loras", self.max_loras),
                F("max_rank", self.max_rank),
                F("fully_sharded (layout, 0 or 1)", int(getattr(self, "fully_sharded", -1))),
                F("dtype", d(str(getattr(self, "dtype", None))), False),
                F("lora_bias (0 or 1)", int(getattr(self, "lora_bias", -1))),
                F("number of output slices", -1 if shards is None else len(shards)),
                F("full sizes (input, output) of each slice",
                  d(None if shards is None else [(s.full_in, s.full_out) for s in shards]), False)]

    @property
    def geometry_digest(self) -> int:
        """A digest of `geometry_fields()` (fixed once the layer is built: computed once)."""
        cached = getattr(self, "_geometry_digest", None)
        if cached is None:
            cached = self._geometry_digest = agreement.digest([f[1] for f in self.geometry_fields()])
        return cached

    def _sharding_problem(self) -> str | None:
        return None

    def _rank_chunk(self) -> tuple[int, int]:
        """This rank's rows of A along the rank axis: all of them, or chunk p of P when fully sharded
        along the rank (column layers)."""
        if not self.fully_sharded:
            return 0, self.max_rank
        q = self.max_rank // self.tp_size
        return self.tp_rank * q, (self.tp_rank + 1) * q

    def _adapters(self, num_adapters: int | None) -> int:
        return self.max_loras if num_adapters is None else num_adapters

    # ------------------------------------------------------------------ slots
    @property
    def num_slices(self) -> int:
        return len(self.slice_shards)

    @property
    def lora_a_stacked(self) -> tuple[torch.Tensor, ...]:
        return tuple(getattr(self, f"lora_a_{s}") for s in range(self.num_slices))

    @property
    def lora_b_stacked(self) -> tuple[torch.Tensor, ...]:
        return tuple(getattr(self, f"lora_b_{s}") for s in range(self.num_slices))

    @property
    def lora_bias_stacked(self) -> tuple[torch.Tensor, ...] | None:
        if not self.lora_bias:
            return None
        return tuple(getattr(self, f"lora_bias_{s}") for s in range(self.num_slices))

    def slot_views(self, slot: int) -> tuple[torch.Tensor, ...]:
        """Slot `slot` of this rank's A of every slice, then of its B (what AdapterManager writes).

        A caller writes this rank's shard through them, so the slot's digest of the full adapter
        becomes `WRITTEN_THROUGH_VIEWS` (equal on every rank: such slots are compared by the slot
        table a ParallelPunicaWrapper is given, not by weights)."""
        self.slot_digests[slot] = WRITTEN_THROUGH_VIEWS
        agreement.note_change()
        return tuple(t[slot] for t in self.lora_a_stacked + self.lora_b_stacked)

    def set_lora(self, index: int, lora_a, lora_b, lora_bias=None, *, scaling: float = 1.0) -> None:
        """Writes this rank's shard of one adapter into slot `index` (loading.load_lora_slot)."""
        loading.load_lora_slot(self, index, lora_a, lora_b, lora_bias, scaling=scaling)

    def reset_lora(self, index: int) -> None:
        """Empties slot `index` (loading.clear_lora_slot)."""
        loading.clear_lora_slot(self, index)

    # ------------------------------------------------------------------ forward helpers
    def set_mapping(self, punica_wrapper) -> None:
        """Installs the step's PunicaWrapper (one per rank, updated with the same mapping on every rank).
        A ParallelPunicaWrapper also learns of the layer, to compare its slots at each update_metadata."""
        self.punica_wrapper = punica_wrapper
        agreement.note_change()
        track = getattr(punica_wrapper, "track_layer", None)
        if track is not None:
            track(self)

    def _check_step_rows(self, name: str, rows: int, sampled: bool = False) -> None:
        """With a wrapper that checks agreement (ParallelPunicaWrapper): the forward's token count (or
        sampled rows, for the LM head) must be the one every rank agreed on in update_metadata, so
        that every rank's collectives have one size. Checked on this rank, before the base layer."""
        check = getattr(self.punica_wrapper, "check_step_rows", None)
        if check is not None:
            check(name, rows, sampled)

    def _run_base(self, x: torch.Tensor, width: int, what: str):
        """(base output as returned, y: its output tensor viewed as (T, width))."""
        out = self.base_layer(x)
        y = out[0] if isinstance(out, tuple) else out
        if not isinstance(y, torch.Tensor):
            raise TypeError(f"base_layer must return a tensor or a tuple starting with one, got {type(y).__name__}")
        if y.dim() < 1 or y.shape[-1] != width:
            raise ValueError(f"base_layer returned shape {tuple(y.shape)}, but {what} has {width} columns on this "
                             f"rank: the LoRA shard and the base layer shard must match")
        try:
            y2 = y.view(-1, width)
        except RuntimeError:
            raise ValueError(f"base_layer's output (shape {tuple(y.shape)}, strides {y.stride()}) cannot be "
                             "viewed as (tokens, features) without a copy, so it cannot be updated in place") from None
        return out, y2

    @staticmethod
    def _tokens(x: torch.Tensor, width: int, name: str) -> torch.Tensor:
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
        if x.dim() < 1 or x.shape[-1] != width:
            raise ValueError(f"{name} must have shape (..., {width}) on this rank, got {tuple(x.shape)}")
        return x.reshape(-1, width)

    def extra_repr(self) -> str:
        return (f"max_loras={self.max_loras}, max_rank={self.max_rank}, layout={self.layout}, "
                f"tp_rank={self.tp_rank}, tp_size={self.tp_size}")
