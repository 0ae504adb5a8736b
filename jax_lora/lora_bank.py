"""Adapter weights stacked over a model's decoder layers: one array per (projection kind, variable).

A `MultiLoRALinear` built on its own holds its adapter variables itself (jax_lora.nn). In a model,
the layers of one projection kind (every decoder layer's `qkv_proj`, its `o_proj`, ...) share one
`LoRABank` instead: each variable stacked along a leading layer axis,

  lora_a (n, S, L, r, in)   lora_b (n, L, out, r)   lora_ranks (n, L) int32
  lora_scale (n, L, out) float32 (DoRA)   lora_a_scale (n, S, L, r), lora_b_scale (n, L, out) (fp8)

with n the layers of that kind, and each layer keeps a reference to the bank and its `layer_index`
l. Entry l of every stacked array is exactly the array the layer would hold itself. NNX keeps a
shared module once in a model's state, so a jitted step over the model takes O(kinds x variables)
adapter arrays instead of O(layers x kinds x variables): fewer arguments, less host time per call.

Reading layer l inside a program: the jnp and Pallas paths index `bank[l]` (a static slice in the
program); the Triton backend reads the stacked array in place at layer l's byte offset
(`PunicaWrapper.add_lora_linear_stacked(..., layer=l)`, jax_lora.ops.triton.View). Outside a
program, `layer.lora_a` of a banked layer is a `BankedVariable`: get_value() / set_value() read and
write entry l of the bank's array, as a layer's own LoRAWeight reads and writes the whole.

`LoRAWeight` is the variable type of every adapter array (per layer or stacked): filter the adapter
state with `nnx.state(model, LoRAWeight)`.
"""

from __future__ import annotations

from collections.abc import Mapping

import jax.numpy as jnp
from flax import nnx

from .quant import quantize_rows

__all__ = ["BANKED_VARIABLES", "BankedVariable", "LoRABank", "LoRAWeight"]


class LoRAWeight(nnx.Variable):
    """Stacked per-slot adapter weights: served, not trained (filter with `nnx.state(m, LoRAWeight)`)."""


BANKED_VARIABLES = ("lora_a", "lora_b", "lora_ranks", "lora_scale", "lora_a_scale", "lora_b_scale")
"""A MultiLoRALinear's adapter variables, the ones a bank stacks (those present: lora_scale with
DoRA, the scales with fp8 storage)."""


class LoRABank(nnx.Module):
    """One projection kind's adapter variables stacked over the layers that share them.

    Args:
      values: {variable name (BANKED_VARIABLES): array (n, ...)}: entry l is layer l's variable.
      dora: the layers hold DoRA column scales (`lora_scale` is among the values).
      lora_dtype: None or "fp8" (the layers' adapter storage; fp8: the scales are among the values).

    The bank holds each as a LoRAWeight attribute of the same name, `num_layers` = n, and the
    layers' `dora` / `lora_dtype`, which `enable_dora` / `use_fp8` change for all of them at once.
    """

    def __init__(self, values: Mapping, *, dora: bool = False, lora_dtype=None):
        unknown = sorted(set(values) - set(BANKED_VARIABLES))
        if unknown or "lora_a" not in values:
            raise ValueError(f"values must name lora_a and others of {BANKED_VARIABLES}, got {sorted(values)}")
        counts = {int(v.shape[0]) for v in values.values()}
        if len(counts) != 1:
            raise ValueError(f"the stacked values must share their leading (layer) axis, got sizes {sorted(counts)}")
        for name, value in values.items():
            setattr(self, name, LoRAWeight(jnp.asarray(value)))
        self.num_layers = counts.pop()
        self.dora = bool(dora)
        self.lora_dtype = lora_dtype

    def names(self) -> tuple:
        """The variables the bank holds, in BANKED_VARIABLES order."""
        return tuple(n for n in BANKED_VARIABLES if n in vars(self))

    def enable_dora(self, out_features: int) -> bool:
        """Adds `lora_scale` (n, L, out) float32, all ones (every slot plain LoRA), for every layer of
        the bank; returns whether it was added."""
        if self.dora:
            return False
        slots = self.lora_b.get_value().shape[1]
        self.lora_scale = LoRAWeight(jnp.ones((self.num_layers, slots, out_features), jnp.float32))
        self.dora = True
        return True

    def use_fp8(self) -> bool:
        """lora_a / lora_b quantised to e4m3 per row (jax_lora.quant.quantize_rows: per layer and slot,
        the rows of each layer's arrays as the layer alone would quantise them), with the float32
        scales as `lora_a_scale` (n, S, L, r) and `lora_b_scale` (n, L, out); returns whether the
        storage changed."""
        if self.lora_dtype == "fp8":
            return False
        qa, sa = quantize_rows(self.lora_a.get_value())
        qb, sb = quantize_rows(self.lora_b.get_value())
        self.lora_a, self.lora_b = LoRAWeight(jnp.asarray(qa)), LoRAWeight(jnp.asarray(qb))
        self.lora_a_scale, self.lora_b_scale = LoRAWeight(jnp.asarray(sa)), LoRAWeight(jnp.asarray(sb))
        self.lora_dtype = "fp8"
        return True


class BankedVariable:
    """Entry `layer` of a bank's variable `name`, read and written as a layer's own LoRAWeight.

    get_value() -> bank.<name>[layer]; set_value(v) writes that entry (same shape; cast to the
    bank's dtype). Not a graph node: a banked layer returns a new one on each attribute read."""

    __slots__ = ("bank", "layer", "name")

    def __init__(self, bank: LoRABank, name: str, layer: int):
        self.bank, self.name, self.layer = bank, name, layer

    def _variable(self) -> LoRAWeight:
        return getattr(self.bank, self.name)

    def get_value(self):
        return self._variable().get_value()[self.layer]

    def set_value(self, value) -> None:
        var = self._variable()
        stacked = var.get_value()
        value = jnp.asarray(value)
        if value.shape != stacked.shape[1:]:
            raise ValueError(f"{self.name} of layer {self.layer} has shape {stacked.shape[1:]}, got {value.shape}")
        var.set_value(stacked.at[self.layer].set(value.astype(stacked.dtype)))

    @property
    def value(self):
        return self.get_value()

    @property
    def shape(self) -> tuple:
        return tuple(self._variable().get_value().shape[1:])

    @property
    def dtype(self):
        return self._variable().get_value().dtype

    def __getitem__(self, index):
        return self.get_value()[index]

    def __repr__(self) -> str:
        return f"BankedVariable({self.name}, layer={self.layer}, shape={self.shape}, dtype={self.dtype})"
