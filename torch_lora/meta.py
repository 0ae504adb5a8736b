"""Kernel metadata for the torch side (contract section 3), built on the device without a host sync.

Fields, values and invariants: `lora_core.kernel_meta` (the record `KernelMeta`, in `meta_args(T)`'s
order); the build is `jax_lora.meta`'s: a counting build (scatter-add over max_loras + 1 bins) plus
one stable sort, every shape fixed by (max_num_tokens, max_loras). Unlike vLLM's GPU wrapper,
`prepare_tensors` never reads a value back to the host: the no-LoRA flag is a device tensor, and
kernels decide on the device.
"""

from __future__ import annotations

import dataclasses

import torch

from lora_core import checks
from lora_core.kernel_meta import KernelMeta

__all__ = ["LoRAKernelMeta"]


@dataclasses.dataclass(init=False)
class LoRAKernelMeta:
    """Token-to-adapter metadata, int32 device tensors of fixed capacity.

    token_lora_mapping, token_indices_sorted_by_lora_ids: (max_num_tokens,);
    active_lora_ids, num_tokens_per_lora: (max_loras + 1,); lora_token_start_loc: (max_loras + 2,);
    no_lora: (1,) bool.
    """

    token_lora_mapping: torch.Tensor
    token_indices_sorted_by_lora_ids: torch.Tensor
    active_lora_ids: torch.Tensor
    num_tokens_per_lora: torch.Tensor
    lora_token_start_loc: torch.Tensor
    no_lora: torch.Tensor

    def __init__(self, token_lora_mapping, token_indices_sorted_by_lora_ids, active_lora_ids, num_tokens_per_lora,
                 lora_token_start_loc, no_lora=None, *, no_lora_flag_cpu=None):
        """The fields in vLLM's order; the no-LoRA flag as `no_lora` or by vLLM's keyword
        `no_lora_flag_cpu` (one of them; kept on its own device: kernels read it there)."""
        if (no_lora is None) == (no_lora_flag_cpu is None):
            raise TypeError("LoRAKernelMeta takes the no-LoRA flag once: as no_lora or as no_lora_flag_cpu")
        self.token_lora_mapping = token_lora_mapping
        self.token_indices_sorted_by_lora_ids = token_indices_sorted_by_lora_ids
        self.active_lora_ids = active_lora_ids
        self.num_tokens_per_lora = num_tokens_per_lora
        self.lora_token_start_loc = lora_token_start_loc
        self.no_lora = no_lora if no_lora is not None else no_lora_flag_cpu

    @property
    def max_loras(self) -> int:
        return self.active_lora_ids.shape[0] - 1

    @property
    def max_num_tokens(self) -> int:
        return self.token_lora_mapping.shape[0]

    @staticmethod
    def make(max_loras: int, max_num_tokens: int, device: torch.device | str = "cpu") -> LoRAKernelMeta:
        """Empty metadata (every token without LoRA) for `max_num_tokens` tokens and `max_loras` slots."""
        if max_loras < 1 or max_num_tokens < 1:
            raise ValueError(f"max_loras and max_num_tokens must be >= 1, got {max_loras}, {max_num_tokens}")
        i32 = dict(dtype=torch.int32, device=device)
        meta = LoRAKernelMeta(
            token_lora_mapping=torch.full((max_num_tokens,), -1, **i32),
            token_indices_sorted_by_lora_ids=torch.arange(max_num_tokens, **i32),
            active_lora_ids=torch.full((max_loras + 1,), -1, **i32),
            num_tokens_per_lora=torch.zeros(max_loras + 1, **i32),
            lora_token_start_loc=torch.zeros(max_loras + 2, **i32),
            no_lora=torch.ones(1, dtype=torch.bool, device=device),
        )
        return meta

    def _reset(self) -> None:
        self.token_lora_mapping.fill_(-1)
        self.token_indices_sorted_by_lora_ids.copy_(self._positions_())
        self.active_lora_ids.fill_(-1)
        self.num_tokens_per_lora.fill_(0)
        self.lora_token_start_loc.fill_(0)
        self.no_lora.fill_(True)

    def _positions_(self) -> torch.Tensor:
        pos = getattr(self, "_positions", None)
        if pos is None or pos.device != self.token_lora_mapping.device:
            pos = self._positions = torch.arange(self.max_num_tokens, dtype=torch.int32,
                                                 device=self.token_lora_mapping.device)
        return pos

    def _bins_(self) -> torch.Tensor:
        bins = getattr(self, "_bins", None)
        if bins is None or bins.device != self.active_lora_ids.device:
            bins = self._bins = torch.arange(self.max_loras + 1, dtype=torch.int32,
                                             device=self.active_lora_ids.device)
        return bins

    @torch.no_grad()
    def prepare_tensors(self, token_lora_mapping: torch.Tensor) -> None:
        """Fills the metadata for a (T,) slot-per-token tensor (-1 = no LoRA), on its device.

        A CPU tensor's values are checked (ValueError for a slot outside -1..max_loras-1); a device
        tensor's are not read back to the host: there such slots are treated as -1 (they never
        index weights).
        """
        m = torch.as_tensor(token_lora_mapping)
        if m.ndim != 1 or m.dtype.is_floating_point or m.dtype == torch.bool:
            raise ValueError(f"token_lora_mapping must be a 1-D integer tensor, got shape "
                             f"{tuple(m.shape)} dtype {m.dtype}")
        t, capacity, num_slots = m.shape[0], self.max_num_tokens, self.max_loras
        if t > capacity:
            raise ValueError(f"token_lora_mapping has {t} tokens, more than max_num_tokens={capacity}")
        if m.device.type == "cpu" and t:
            checks.check_index_values("token_lora_mapping", int(m.min()), int(m.max()), num_slots,
                                      "the metadata (max_loras)")
        self._fill(m)

    def _fill(self, m: torch.Tensor) -> None:
        """prepare_tensors' build for a (T,) integer tensor whose shape is checked; its values are
        not read (out-of-range slots become -1)."""
        t, num_slots = m.shape[0], self.max_loras
        device = self.token_lora_mapping.device
        m = m.to(device=device, non_blocking=True)
        # Out-of-range slots become -1 before the int32 cast (which would wrap an int64 2**32 + 1 to 1).
        mapping = torch.where((m >= 0) & (m < num_slots), m, -1).to(torch.int32)
        key = (mapping + 1).long()                                     # bin 0 = no LoRA
        counts = torch.zeros(num_slots + 1, dtype=torch.int32, device=device)
        counts.scatter_add_(0, key, torch.ones_like(mapping))
        present = counts > 0
        bins = self._bins_()
        order = torch.sort(torch.where(present, bins, bins + num_slots + 1), stable=True).indices
        active_present = present[order]
        self.token_lora_mapping[:t].copy_(mapping)
        self.token_lora_mapping[t:].fill_(-1)
        self.active_lora_ids.copy_(torch.where(active_present, order.to(torch.int32) - 1, -1))
        self.num_tokens_per_lora.copy_(torch.where(active_present, counts[order], 0))
        self.lora_token_start_loc[:1].zero_()  # a device fill: no host value, capturable
        torch.cumsum(self.num_tokens_per_lora, 0, out=self.lora_token_start_loc[1:])
        self.lora_token_start_loc[1:].masked_fill_(~active_present, 0)   # 0 past the active ids, as vLLM
        self.token_indices_sorted_by_lora_ids[:t].copy_(torch.sort(key, stable=True).indices)
        self.token_indices_sorted_by_lora_ids[t:].copy_(self._positions_()[t:])
        torch.eq(counts[1:].sum().reshape(1), 0, out=self.no_lora)

    @property
    def no_lora_flag_cpu(self) -> torch.Tensor:
        """vLLM's name for `no_lora` (here on the metadata's device: kernels read it there, no
        host sync)."""
        return self.no_lora

    def meta_args(self, token_nums: int) -> KernelMeta:
        """(token_lora_mapping[:T], token_indices_sorted_by_lora_ids[:T], num_tokens_per_lora,
        lora_token_start_loc, active_lora_ids, no_lora) for T = token_nums: vLLM's order, as a
        `KernelMeta` (a tuple)."""
        return KernelMeta(self.token_lora_mapping[:token_nums], self.token_indices_sorted_by_lora_ids[:token_nums],
                          self.num_tokens_per_lora, self.lora_token_start_loc, self.active_lora_ids, self.no_lora)
