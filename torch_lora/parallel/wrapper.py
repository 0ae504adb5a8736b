"""ParallelPunicaWrapper: torch_lora's PunicaWrapper for one rank of a tensor-parallel group, whose
`update_metadata` checks that every rank is about to run the same step.

Math. A step's output is right only if every rank maps the same tokens to the same slots and every
slot the step uses holds (this rank's part of) the same adapter on every rank. So, per step, each
rank describes its step as the fields below (agreement.py: counts as they are, the rest as
digests), the group all-gathers them (one collective of P * 16 int64s: the fields and their names'
digest), and every rank raises the same ValueError when a field differs.

  update_metadata's own checks failed (1 or 0): the local conversion raised (a bad mapping)
  tokens, sampled rows, is_prefill, max_loras, vocab_size, extra_vocab_size
  token mapping, sampled-row mapping  digests of the LoRA ids per token / per sampled row
  slot table                          digest of lora_index_to_id
  long-context offsets                digest of long_lora_context's offsets (None: none)
  layers tracked                      how many layers set_mapping installed this wrapper in, and
                                      how many of them keep slot digests (check_agreement=True)
  layer geometry                      digest of every tracked layer's geometry fields, in order
  adapters in the slots used          digest, over the slots the mapping uses and every layer
                                      keeping slot digests, of the layer's slot digest (loading.py)

Steps of `update_metadata`:
  1. The wrapper's own update (torch_lora.PunicaWrapper.update_metadata); an error is held, not
     raised yet, so that this rank still takes part in step 2 and the others do not wait for it.
  2. The fields above, all-gathered and compared (agreement.gather_fields).
  3. When only "adapters in the slots used" differs, a second all-gather of the per-(layer, slot)
     digests (the same size on every rank: the layer geometries agree) names the layers and slots
     that differ and what each rank holds there (empty or an adapter). It runs only on that error.
  4. Every rank raises the same ValueError for a disagreement; otherwise a rank whose own update
     failed raises its error (every rank then failed).

Cost and when it runs: one all-gather of a few int64 per update_metadata, on the host with a gloo
group (or a gloo part of the group, "cpu:gloo,cuda:nccl"); with an NCCL-only group on the current
CUDA device, where reading the gathered table back synchronises the host with the stream once per
step. Never while a CUDA graph is being captured (the step is then not checked). With
`check_agreement=False` update_metadata is PunicaWrapper's, with no collective.
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Sequence
from typing import Any

import numpy as np

from ..wrapper import PunicaWrapper
from . import agreement
from .comm import group_rank_and_size

__all__ = ["ParallelPunicaWrapper"]


class ParallelPunicaWrapper(PunicaWrapper):
    """A PunicaWrapper for one rank of a tensor-parallel group (see the module docstring).

    Args: those of torch_lora.PunicaWrapper, and
      group: the layers' torch.distributed process group (None: the default group).
      check_agreement: check at each update_metadata that every rank runs the same step with the
        same adapters (one small all-gather); False for an engine that guarantees agreement itself.
        The same value on every rank.
    """

    def __init__(self, max_num_batched_tokens: int, max_batches: int, device="cpu", *, max_loras: int,
                 group=None, check_agreement: bool = True, **kwargs: Any):
        if not isinstance(check_agreement, bool):
            raise TypeError(f"check_agreement must be True or False, got {check_agreement!r}")
        super().__init__(max_num_batched_tokens, max_batches, device, max_loras=max_loras, **kwargs)
        self.group = group
        self.tp_rank, self.tp_size = group_rank_and_size(group)
        self.check_agreement = check_agreement
        self._layers: list = []            # weak references, in the order set_mapping installed this wrapper
        self._layer_part = (-1, None)      # (agreement.changes() when computed, _LayerPart)

    def track_layer(self, layer) -> None:
        """Adds `layer` to the layers whose slots are checked (called by the layer's set_mapping)."""
        if not any(ref() is layer for ref in self._layers):
            self._layers.append(weakref.ref(layer))

    @property
    def layers(self) -> list:
        """The live layers this wrapper is installed in, in the order they were installed."""
        return [layer for layer in (ref() for ref in self._layers)
                if layer is not None and layer.punica_wrapper is self]

    def update_metadata(self, mapping, lora_index_to_id: Sequence[int | None], max_loras: int, vocab_size: int,
                        extra_vocab_size: int = 0, long_lora_context=None, **kwargs: Any) -> None:
        """PunicaWrapper.update_metadata, then the agreement check (see the module docstring).

        Raises ValueError on every rank when the ranks disagree on the step, naming each field that
        differs and which ranks hold which value. A mapping with several adapters per token
        (contract section 10) is refused: the tensor-parallel layers take one adapter per token."""
        paired = None
        if getattr(mapping, "paired", False):
            paired = ValueError("mapping: the tensor-parallel wrapper takes one adapter per token at strength 1; "
                                "a mapping with id tuples or weights (several adapters per token) runs on "
                                "torch_lora.PunicaWrapper")
        if not self.check_agreement or agreement.capturing():
            if paired is not None:
                raise paired
            return super().update_metadata(mapping, lora_index_to_id, max_loras, vocab_size, extra_vocab_size,
                                           long_lora_context, **kwargs)
        error = None
        try:
            if paired is not None:
                raise paired
            super().update_metadata(mapping, lora_index_to_id, max_loras, vocab_size, extra_vocab_size,
                                    long_lora_context, **kwargs)
        except (ValueError, TypeError) as e:
            error = e
        part = self._layers_part()
        ids = [_ids(v) for v in (getattr(mapping, "index_mapping", None), getattr(mapping, "prompt_mapping", None),
                                 lora_index_to_id)]
        used = [s for s in _used_slots(*ids) if s < self.max_loras]
        fields = _step_fields(error, mapping, ids, max_loras, vocab_size, extra_vocab_size, long_lora_context, part,
                              used)
        what = "the step passed to update_metadata"
        hint = f"; on this rank: {type(error).__name__}: {error}" if error is not None else ""
        try:
            table, differ = agreement.gather_fields(what, fields, self.group, self.tp_size, self.tp_rank)
        except ValueError as e:
            raise e from error
        if differ == [len(fields) - 1]:
            # only the slots' adapters differ: the mapping, slot table and layers agree, so every rank
            # has the same number of (layer, used slot) digests to gather
            raise self._slot_disagreement(part, used, lora_index_to_id) from error
        if differ:
            raise agreement.disagreement(what, fields, table, differ, self.tp_rank, hint) from error
        if error is not None:
            raise error

    def _layers_part(self) -> _LayerPart:
        """The layers' part of the step's fields, recomputed only after a slot write or a set_mapping
        anywhere (agreement.note_change): per step it costs an index into a small array."""
        version, part = self._layer_part
        if version != agreement.changes() or part is None:
            tracked = self.layers
            checked = [layer for layer in tracked if layer.check_agreement]   # those keeping slot digests
            part = _LayerPart(
                tracked=len(tracked), names=[_layer_name(layer, i) for i, layer in enumerate(checked)],
                geometry=agreement.digest(np.array([layer.geometry_digest for layer in tracked], dtype=np.int64)),
                slots=np.array([(list(layer.slot_digests) + [-1] * self.max_loras)[: self.max_loras]
                                for layer in checked], dtype=np.int64).reshape(len(checked), self.max_loras))
            self._layer_part = (agreement.changes(), part)
        return part

    def check_step_rows(self, name: str, rows: int, sampled: bool = False) -> None:
        """A layer's forward pass: its `rows` tokens (sampled rows when `sampled`) must be the count
        update_metadata mapped and every rank agreed on; another count on this rank would make its
        collectives another size than the other ranks' (a gloo abort, an NCCL hang). Raised here, on
        this rank only (the forward adds no collective to tell the others: they wait in their next
        collective until the group's timeout)."""
        if not self.check_agreement:
            return
        mapped = self.indices_len[1 if sampled else 0]
        if mapped is not None and rows != mapped:
            what = "sampled rows" if sampled else "tokens"
            raise ValueError(f"{name} has {rows} {what}, but update_metadata mapped {mapped} {what} on every rank of "
                             f"the tensor-parallel group (this is rank {self.tp_rank}): every rank's forward must "
                             "take the step's mapped count, or the ranks' collectives differ in size")

    def _slot_disagreement(self, part, used, lora_index_to_id) -> ValueError:
        """Step 3: all-gathers every (layer, used slot) digest and names those that differ."""
        layers = part.names
        values = part.slots[:, used].reshape(-1).tolist()
        table = agreement.exchange(values, self.group, self.tp_size).reshape(self.tp_size, len(layers), len(used))
        lines = []
        for i, name in enumerate(layers):
            for j, s in enumerate(used):
                column = table[:, i, j]
                if len(set(column.tolist())) > 1:
                    held = {}
                    for rank, v in enumerate(column.tolist()):
                        held.setdefault(_slot_state(v), []).append(rank)
                    what = ", ".join(f"{'rank' if len(r) == 1 else 'ranks'} {r[0] if len(r) == 1 else r}: {state}"
                                     for state, r in held.items())
                    lines.append(f"{name} slot {s} (LoRA id {lora_index_to_id[s]}): {what}")
        shown = "; ".join(lines[:8]) + (f"; and {len(lines) - 8} more" if len(lines) > 8 else "")
        return ValueError(f"tensor-parallel ranks disagree on the adapters in the slots this step uses: {shown} "
                          f"(this is rank {self.tp_rank}; every rank raises this error); load the same adapter "
                          "into the same slot on every rank before the step")


@dataclasses.dataclass
class _LayerPart:
    tracked: int                 # layers using the wrapper
    names: list                  # of those keeping slot digests, for messages (no reference kept)
    geometry: int                # digest of every tracked layer's geometry digest, in order
    slots: np.ndarray            # (len(checked), L) int64: each checked layer's slot digests (-1 past
                                 # a layer's own slots)


def _slot_state(value: int) -> str:
    from .layer import WRITTEN_THROUGH_VIEWS
    if value == 0:
        return "empty"
    if value == WRITTEN_THROUGH_VIEWS:
        return "written through slot_views"
    return f"adapter {value & 0xFFFFFFFF:08x}"


def _layer_name(layer, index: int) -> str:
    names = getattr(layer, "module_names", ())
    return f"layer {index} ({type(layer).__name__}{', ' + names[0] if names else ''})"


def _ids(ids) -> np.ndarray | None:
    """LoRA ids as int64 (None as 0), or None when they are not ids (the wrapper's own checks say why)."""
    if ids is None:
        return None
    try:
        return np.asarray(ids, dtype=np.int64)
    except (TypeError, ValueError, OverflowError):
        pass
    try:
        return np.asarray([0 if i is None else int(i) for i in ids], dtype=np.int64)
    except (TypeError, ValueError, OverflowError):
        return None


def _used_slots(tokens, rows, table) -> list[int]:
    """The slots whose LoRA id the mapping uses (tokens or sampled rows), in slot order."""
    if tokens is None or rows is None or table is None:
        return []
    wanted = set(np.unique(tokens).tolist()) | set(np.unique(rows).tolist())
    return [s for s, i in enumerate(table.tolist()) if i and i in wanted]


def _count(value) -> int:
    try:
        return int(value)
    except (TypeError, ValueError, OverflowError):
        return -1


def _length(seq) -> int:
    try:
        return len(seq)
    except TypeError:
        return -1


def _offsets(offsets):
    if offsets is None:
        return None
    try:
        return sorted((int(k), int(v)) for k, v in dict(offsets).items())
    except (TypeError, ValueError, OverflowError):
        return "unreadable"


def _step_fields(error, mapping, ids, max_loras, vocab_size, extra_vocab_size, long_lora_context, part,
                 used) -> list:
    """The step's fields (see the module docstring); the slots' digest last. ids: the LoRA ids per
    token, per sampled row and per slot, as int64 arrays (None where unreadable)."""
    F, d = agreement.Field, agreement.digest
    tokens, rows, table = ids
    offsets = getattr(long_lora_context, "offsets_by_lora_id", None)
    return [
        F("update_metadata's own checks failed (1 or 0)", int(error is not None)),
        F("tokens", _length(tokens)),
        F("sampled rows", _length(rows)),
        F("is_prefill (0 or 1)", int(bool(getattr(mapping, "is_prefill", False)))),
        F("max_loras", _count(max_loras)),
        F("vocab_size", _count(vocab_size)),
        F("extra_vocab_size", _count(extra_vocab_size)),
        F("token mapping (LoRA id per token)", d(tokens), False),
        F("sampled-row mapping (LoRA id per row)", d(rows), False),
        F("slot table (lora_index_to_id)", d(table), False),
        F("long-context offsets", d(_offsets(offsets)), False),
        F("layers using this wrapper", part.tracked),
        F("layers keeping slot digests (check_agreement=True)", len(part.names)),
        F("layer geometry", part.geometry, False),
        F("adapters in the slots used", d([used, part.slots[:, used] if used else None]), False),
    ]
