"""Flax NNX multi-adapter layers driven by the PunicaWrapper (contract section 5 and 8).

Every layer keeps its base layer (`.base`, an `nnx.Linear` / `nnx.Embed`, untouched; a linear base
may also be a `jax_lora.quant.QuantizedLinear`, int8 / fp8 weight-only) and adds the
stacked per-slot adapter weights as `LoRAWeight` variables, in the layouts the wrapper takes:

  MultiLoRALinear   lora_a (S, L, r, in)   lora_b (L, out, r)    slices of out: `output_slices`
  MultiLoRAEmbed    lora_a (L, V, r)       lora_b (L, D, r)      (PEFT lora_embedding_A.T / _B)
  MultiLoRALogits   lora_a (L, r, H)       lora_b (L, V, r)      the LM head, on sampled rows
  MultiLoRAExperts  the experts of a MoE layer, per expert (its docstring)

with L = max_loras slots, r = max_rank (a smaller adapter rank is zero-padded), S = number of
slices of a fused projection (QKV, gate_up; widths may differ), and `lora_ranks` (L,) int32, each
slot's real rank in the layer, passed to the wrapper so kernels skip the zero padding (PEFT's
rank_pattern gives modules of one adapter different ranks). The adapter scaling is folded into
`lora_b` when an adapter is loaded (jax_lora.adapters), so the layers call the wrapper with scale 1.

In a model, the MultiLoRALinears of one projection kind across the decoder layers may share one
layer-stacked `jax_lora.lora_bank.LoRABank` instead of holding their own variables
(`stack_lora_layers`, the models' `add_lora` default): each layer then reads entry `layer_index` of
the bank's arrays, and `layer.lora_a` etc. are `BankedVariable`s of that entry.

Which adapter each token uses is not a module attribute: it is the wrapper of the current step,
installed with `punica_context(wrapper)` around the model call (inside `jax.jit`, where the wrapper
is a traced argument) or passed as `punica=` to a layer. Without a wrapper a layer computes its base
layer only, so the same model serves the "no adapters" baseline.

`replace_lora_layers(model, targets, ...)` swaps the targeted `nnx.Linear` / `nnx.Embed` layers of any
NNX model for these layers, in place. Filter the adapter state with `nnx.state(model, LoRAWeight)`.

fp8 adapter weights: `MultiLoRALinear(..., lora_dtype="fp8")` (or `replace_lora_layers(...,
lora_dtype="fp8")`, `AdapterManager(model, lora_dtype="fp8")`) stores lora_a and lora_b in e4m3
with per-output-channel float32 scales beside them, `lora_a_scale` (S, L, r) and `lora_b_scale`
(L, out): w[..., c, k] ~ scale[..., c] * float32(w_q[..., c, k]) (jax_lora.quant.quantize_rows). The
wrapper applies the scales once per channel after the float32 sums. `MultiLoRALogits` takes
lora_dtype="fp8" too (lora_a_scale (L, r), lora_b_scale (L, V)), and so does `MultiLoRAEmbed`
(its table lora_a (L, V, r) with lora_a_scale (L, V), one per table row: the row a token looks up;
lora_b_scale (L, D)), and so does `MultiLoRAExperts` (each of its four stacks with float32 scales
per expert and output channel, `<stack>_scale`).

Tensor parallelism: `jax_lora.parallel.shard_layer` splits a layer over a mesh axis and sets its
static `tp` attribute; with a wrapper installed, the call then runs per device (`tp.apply`), and
without one the base layer runs as XLA partitions it.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import logging
import numbers
import re
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
from flax import nnx

from .lora_bank import BANKED_VARIABLES, BankedVariable, LoRABank, LoRAWeight
from .module_paths import path_name, set_submodule
from .moe import ExpertOrder, MoEExperts
from .quant import QuantizedLinear, quantize_rows

__all__ = [
    "FUSED_MODES",
    "FusedKernel",
    "LORA_LAYER_TYPES",
    "LoRAWeight",
    "MultiLoRAEmbed",
    "MultiLoRAExperts",
    "MultiLoRALinear",
    "MultiLoRALogits",
    "current_punica",
    "lora_layers",
    "punica_context",
    "replace_lora_layers",
    "stack_lora_layers",
    "unstack_lora_layers",
]

_ACTIVE = contextvars.ContextVar("jax_lora_punica", default=None)
_LOG = logging.getLogger("jax_lora")


class FusedKernel(nnx.Variable):
    """A base kernel transposed to (out, in), in, contiguous: the layout the fused GEMM's tiles read
    in long runs (`MultiLoRALinear.use_fused`). A copy of the base layer's kernel, not a parameter."""


FUSED_MODES = (None, "gemm", "norm", "auto")
"""MultiLoRALinear's fused paths: None (the base product, then the wrapper's add_lora_linear);
"gemm" (the wrapper's shrink, then one Triton GEMM with the expand in its epilogue); "norm"
(also: the RMSNorm before the layer computes the shrink, for layers behind a norm); "auto" ("norm"
for the `norm_linear` calls whose layer shape, token count and rank the device's tuned fused linear
table marks `use_norm_fused`, `lora_core.kernels.fused_linear_configs.use_norm_fused_linear`; else
"gemm" for the calls it marks fused, `use_fused_linear`; None for the others)."""


@contextlib.contextmanager
def punica_context(wrapper) -> Iterator[Any]:
    """Makes `wrapper` (a PunicaWrapper, or None for base-only) the one the LoRA layers use.

    Use it inside the jitted step around the model call; the wrapper there is a traced pytree.
    """
    token = _ACTIVE.set(wrapper)
    try:
        yield wrapper
    finally:
        _ACTIVE.reset(token)


def current_punica():
    """The wrapper installed by the innermost `punica_context`, or None."""
    return _ACTIVE.get()


def _pick(punica):
    return punica if punica is not None else _ACTIVE.get()


def _ranks_variable(max_loras: int, max_rank: int) -> LoRAWeight:
    """(max_loras,) int32: each slot's real rank in this layer, passed to the wrapper as `lora_ranks`
    so kernels that skip rank padding read only the real columns. Starts at max_rank (weights set by
    hand use every column); AdapterManager writes the loaded adapter's rank, 0 for an empty slot.
    The padding is zero either way, so results never depend on it."""
    return LoRAWeight(jnp.full((max_loras,), max_rank, jnp.int32))


def _check_int(name: str, v: int) -> int:
    if not isinstance(v, numbers.Integral) or isinstance(v, bool) or v < 1:
        raise ValueError(f"{name} must be an int >= 1, got {v!r}")
    return int(v)


LORA_DTYPES = (None, "fp8")
"""The adapter storage choices: None (the layer's dtype) or "fp8" (e4m3 + per-channel float32 scales)."""


def check_lora_dtype(lora_dtype) -> str | None:
    """lora_dtype as given when it is None or "fp8"; a ValueError naming it otherwise."""
    if lora_dtype not in LORA_DTYPES:
        raise ValueError(f"lora_dtype must be None (the adapter weights in the layer's dtype) or 'fp8' (e4m3 with "
                         f"per-channel float32 scales), got {lora_dtype!r}")
    return lora_dtype


def _check_linear_base(base) -> None:
    if not isinstance(base, (nnx.Linear, QuantizedLinear)):
        raise TypeError(f"base must be an nnx.Linear or a jax_lora.quant.QuantizedLinear, got {type(base).__name__}")


def _base_dtype(base):
    """The adapter weights' default dtype: a float base's kernel dtype, a quantized base's activation
    dtype."""
    return base.dtype if isinstance(base, QuantizedLinear) else base.kernel.get_value().dtype


def _store_fp8(layer) -> bool:
    """A LoRA layer's `use_fp8` after its own checks: refused when the layer is split over a mesh,
    else its `lora_a` / `lora_b` quantised to e4m3 along their last axis (jax_lora.quant.quantize_rows)
    with the float32 scales as new `lora_a_scale` / `lora_b_scale` variables; returns True."""
    if layer.tp is not None:
        raise ValueError("fp8 adapter weights are not supported on a LoRA layer split over a mesh: build the "
                         "layers with lora_dtype='fp8' before splitting, or serve 16-bit adapters")
    qa, sa = quantize_rows(layer.lora_a.get_value())
    qb, sb = quantize_rows(layer.lora_b.get_value())
    layer.lora_a, layer.lora_b = LoRAWeight(jnp.asarray(qa)), LoRAWeight(jnp.asarray(qb))
    layer.lora_a_scale, layer.lora_b_scale = LoRAWeight(jnp.asarray(sa)), LoRAWeight(jnp.asarray(sb))
    layer.lora_dtype = "fp8"
    return True


class MultiLoRALinear(nnx.Module):
    """An `nnx.Linear` plus one adapter per token, with fused output slices.

    Args:
      base: the layer (kernel (in, out)), an nnx.Linear or a jax_lora.quant.QuantizedLinear (int8 /
        fp8 weights, per-channel scales: the LoRA terms are added in `dtype` to its output, as over a
        float base); kept as `self.base`.
      max_loras: slots L. max_rank: r (adapters of smaller rank are zero-padded).
      output_slices: widths of the fused outputs (q, k, v / gate, up), summing to `out`; default
        one slice. dtype: of the adapter weights (default: the base kernel's; over a quantized
        base, its activation dtype).
      lora_dtype: None (weights in `dtype`) or "fp8": lora_a / lora_b in e4m3 with float32 scales
        `lora_a_scale` (S, L, r) and `lora_b_scale` (L, out) (ones until an adapter is written).

    __call__(x (..., in), punica=None) -> (..., out): `base(x)` plus, per token t with slot
    i = idx[t] >= 0, `x[t] @ A_s[i].T @ B_s[i].T` at each slice's columns (the wrapper's
    add_lora_linear with scale 1: the scaling is folded into B).

    dora=True: the layer also holds `lora_scale` (L, out) float32, each slot's DoRA column scale
    g (lora_core.dora; 1 for plain LoRA slots), and a token with slot i gets
    g[i] * (x W + x A_s[i].T B_s[i].T) + bias instead (the base bias is added after the scale).
    A layer built without it gets the scale from `enable_dora()` (the AdapterManager calls it when
    the first DoRA adapter lands in the layer): a new variable, so the model's graph changes and a
    jitted step that takes the model is traced and compiled again, once.

    fused ("gemm", "norm" or "auto"; `use_fused`): with a wrapper installed the layer computes
    y = x @ W + bias + LoRA term in one Triton GEMM whose epilogue adds each token's expand
    (jax_lora.ops.fused_linear.gemm_lora), after the wrapper's shrink ("gemm") or after the
    RMSNorm kernel that also shrinks (`norm_linear`, "norm": the model calls it with the norm in
    front of the layer); "auto": "norm" for a `norm_linear` call where the device's tuned fused
    linear table says the norm path wins for the layer, the call's token count and max_rank, else
    "gemm" where it says the fused GEMM wins, else the unfused path, decided when the call is
    traced. Its docstring says what it needs and refuses.
    """

    def __init__(self, base: nnx.Linear, *, max_loras: int, max_rank: int,
                 output_slices: Sequence[int] | None = None, dtype=None, dora: bool = False, lora_dtype=None):
        _check_linear_base(base)
        check_lora_dtype(lora_dtype)
        if dora and isinstance(base, QuantizedLinear):
            raise ValueError("dora=True needs a float base layer (DoRA's column scale reads the base kernel); this "
                             f"base is a {base.quantize} QuantizedLinear: serve DoRA adapters over a float model")
        self.base = base
        self.in_features = int(base.in_features)
        self.out_features = int(base.out_features)
        slices = tuple(int(s) for s in output_slices) if output_slices else (self.out_features,)
        if any(s < 1 for s in slices) or sum(slices) != self.out_features:
            raise ValueError(f"output_slices {slices} must be positive widths summing to the layer's "
                             f"out_features={self.out_features}")
        self.output_slices = slices
        self.max_loras = max_loras = _check_int("max_loras", max_loras)
        self.max_rank = max_rank = _check_int("max_rank", max_rank)
        dtype = dtype or _base_dtype(base)
        self.lora_a = LoRAWeight(jnp.zeros((len(slices), max_loras, max_rank, self.in_features), dtype))
        self.lora_b = LoRAWeight(jnp.zeros((max_loras, self.out_features, max_rank), dtype))
        self.lora_ranks = _ranks_variable(max_loras, max_rank)
        self.dora = bool(dora)
        if self.dora:
            self.lora_scale = LoRAWeight(jnp.ones((max_loras, self.out_features), jnp.float32))
        self.tp = None      # jax_lora.parallel.TensorParallel once split over a mesh
        self.lora_dtype = None
        self.fused = None
        if lora_dtype == "fp8":
            self.use_fp8()

    def __getattr__(self, name: str):
        # Called only for names the layer does not hold: a banked layer (`join_bank`) reads its
        # adapter variables (entry `layer_index` of the bank's), `dora` and `lora_dtype` from its bank.
        bank = self.__dict__.get("bank")
        if bank is not None:
            if name in ("dora", "lora_dtype"):
                return getattr(bank, name)
            if name in BANKED_VARIABLES and name in vars(bank):
                return BankedVariable(bank, name, self.__dict__["layer_index"])
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    @property
    def banked(self) -> bool:
        """Whether the layer's adapter variables live in a shared LoRABank (`join_bank`)."""
        return "bank" in vars(self)

    def join_bank(self, bank: LoRABank, layer_index: int) -> None:
        """Hands the layer's adapter variables to `bank` (jax_lora.lora_bank): they are entry
        `layer_index` of its stacked arrays from now on (`stack_lora_layers` builds the bank from the
        layers' own values), and `dora` / `lora_dtype` are the bank's. `self.lora_a` etc. then read
        and write that entry (lora_bank.BankedVariable)."""
        for name in (*BANKED_VARIABLES, "dora", "lora_dtype"):
            if name in vars(self):
                delattr(self, name)
        self.bank = bank
        self.layer_index = int(layer_index)

    def leave_bank(self) -> None:
        """The inverse of `join_bank`: the layer holds its entry of the bank's arrays as its own
        variables again (the bank keeps its arrays for the other layers)."""
        if not self.banked:
            return
        bank, layer = self.bank, self.layer_index
        values = {name: getattr(bank, name).get_value()[layer] for name in bank.names()}
        del self.bank, self.layer_index
        for name, value in values.items():
            setattr(self, name, LoRAWeight(value))
        self.dora, self.lora_dtype = bank.dora, bank.lora_dtype

    def _adapter_arrays(self) -> tuple:
        """(lora_a, lora_b, keywords of add_lora_linear_stacked) of a wrapper call: the layer's own
        arrays, or its bank's stacked arrays with `layer` = its index (the Triton backend reads the
        entry in place; the others slice it)."""
        bank = self.__dict__.get("bank")
        owner = self if bank is None else bank
        fp8 = self.lora_dtype == "fp8"
        kw = dict(lora_ranks=owner.lora_ranks.get_value(),
                  dora_scale=owner.lora_scale.get_value() if self.dora else None,
                  lora_a_scale=owner.lora_a_scale.get_value() if fp8 else None,
                  lora_b_scale=owner.lora_b_scale.get_value() if fp8 else None)
        if bank is not None:
            kw["layer"] = self.layer_index
        return owner.lora_a.get_value(), owner.lora_b.get_value(), kw

    def use_fused(self, mode) -> bool:
        """Turns the fused path on ("gemm", "norm" or "auto") or off (None); returns whether it changed.

        The fused GEMM reads the base weight as (out, in) with `in` contiguous, so turning it on
        stores a transposed copy of the base kernel, `kernel_nk` (a `FusedKernel` variable: the
        layer's base weight bytes twice; made here, once; call `use_fused` again after changing
        the base kernel). The layer stays unfused without a wrapper (the base layer alone) and
        with a deterministic wrapper (logged: the fused kernels are not batch invariant).
        Refused (ValueError): a quantized base, DoRA (`dora=True`: the GEMM has no column scale),
        fp8 adapter weights (the kernels read 16-bit weights), a layer split over a mesh, a base
        dtype other than float16 / bfloat16 / float32. A step with several adapters per token is
        refused when it runs (NotImplementedError). New variables: call it before the serving
        step is first traced.
        """
        if mode not in FUSED_MODES:
            raise ValueError(f"fused must be one of {FUSED_MODES} (None: off), got {mode!r}")
        if mode == self.fused:
            return False
        if mode is None:
            del self.kernel_nk
            self.fused = None
            return True
        what = ("a quantized base layer (the fused GEMM reads float weights)" if isinstance(self.base, QuantizedLinear)
                else "DoRA (the fused GEMM has no column scale)" if self.dora
                else "fp8 adapter weights (the fused kernels read 16-bit weights)" if self.lora_dtype == "fp8"
                else "a layer split over a mesh" if self.tp is not None else None)
        if what is None and jnp.dtype(self.base.kernel.get_value().dtype).name not in ("float16", "bfloat16",
                                                                                        "float32"):
            what = f"a {self.base.kernel.get_value().dtype} base kernel (float16, bfloat16 or float32 only)"
        if what is not None:
            raise ValueError(f"fused={mode!r} is not supported with {what}: serve this layer unfused (fused=None)")
        self.kernel_nk = FusedKernel(jnp.asarray(self.base.kernel.get_value()).T.copy())
        self.fused = mode
        return True

    def use_fp8(self) -> bool:
        """Stores the adapter weights in e4m3 with per-channel float32 scales (`lora_a_scale` (S, L, r),
        `lora_b_scale` (L, out)), the weights held now quantised (jax_lora.quant.quantize_rows);
        returns whether the storage changed (False when it is fp8 already). New variables: call it
        before the serving step is first traced. Refused for a layer split over a mesh."""
        if self.lora_dtype == "fp8":
            return False
        if self.fused is not None:
            raise ValueError(f"fp8 adapter weights are not supported on a fused LoRA layer (fused={self.fused!r}): "
                             "turn the fused path off (use_fused(None)) first")
        return self.bank.use_fp8() if self.banked else _store_fp8(self)

    def enable_dora(self) -> bool:
        """Gives the layer its DoRA column scale `lora_scale` (L, out) float32, all ones (every slot
        plain LoRA), unless it has one; returns whether it was added. Refused for a layer split over
        a mesh (its scale would have to follow the row split's reduction) and for a fused layer."""
        if self.dora:
            return False
        if self.fused is not None:
            raise ValueError(f"a fused LoRA layer (fused={self.fused!r}) cannot serve DoRA adapters (the fused GEMM "
                             "has no column scale): turn the fused path off (use_fused(None)) first")
        if self.tp is not None:
            raise ValueError("a LoRA layer split over a mesh cannot serve DoRA adapters (its column scale would have "
                             "to follow the reduction): serve them with unsplit layers")
        if self.banked:                    # every layer of the bank gets its scale
            return self.bank.enable_dora(self.out_features)
        self.lora_scale = LoRAWeight(jnp.ones((self.max_loras, self.out_features), jnp.float32))
        self.dora = True
        return True

    def __call__(self, x: jax.Array, punica=None) -> jax.Array:
        w = _pick(punica)
        if self.dora and self.tp is not None:
            raise NotImplementedError("DoRA layers (dora=True) split over a mesh are not supported: serve "
                                      "DoRA adapters with unsplit layers")
        if w is not None and self.fuses(w) and self._fused_for(x):
            return self._fused_linear(x, w)
        if w is not None and self.tp is not None:
            return self.tp.apply(self, x, w)
        if w is None:
            return self.base(x)
        y = self._base_without_bias(x) if self.dora else self.base(x)
        lora_a, lora_b, kw = self._adapter_arrays()
        y = w.add_lora_linear_stacked(y, x, lora_a, lora_b, 1.0, self.output_slices, **kw)
        if self.dora and self.base.bias is not None:
            y = y + self.base.bias[...].astype(y.dtype)
        return y

    def fuses(self, punica=None) -> bool:
        """Whether a call with this wrapper (default: the installed one) takes the fused path: fused
        on, a wrapper installed, and the wrapper not deterministic (then the unfused path, logged
        once). Raises NotImplementedError for a step with several adapters per token, and
        ValueError for a fused layer split over a mesh since `use_fused`."""
        w = _pick(punica)
        if self.fused is None or w is None:
            return False
        if self.tp is not None:
            raise ValueError("a fused LoRA layer cannot run split over a mesh: turn the fused path off "
                             "(use_fused(None)) before splitting the model")
        if getattr(w, "num_pairs", 0):
            raise NotImplementedError("the fused LoRA linear kernels take one adapter per token; this step maps "
                                      "several adapters per token: serve it with fused=None")
        if getattr(w, "deterministic", False):
            _log_fused_fallback("the wrapper is deterministic (the fused kernels are not batch invariant)")
            return False
        return True

    def _fused_for(self, x) -> bool:
        """Whether this call (x (..., in)) takes the fused GEMM: always with "gemm" / "norm"; with
        "auto" the tuned fused linear table's choice for (in, output_slices), the token count and
        max_rank (False without an entry: the unfused path)."""
        if self.fused != "auto":
            return True
        from lora_core.kernels.fused_linear_configs import use_fused_linear
        tokens = x.size // self.in_features if self.in_features else 0
        return use_fused_linear((self.in_features, self.output_slices), int(tokens), self.max_rank)

    def _fused_linear(self, x, w, xn=None, buf=None) -> jax.Array:
        """x @ W + bias + each token's LoRA term through jax_lora.ops.fused_linear.gemm_lora; buf
        (P, S, T, r) float32 is the shrink of x (`norm_linear` gives it), else the wrapper's
        shrink computes it here."""
        from .ops.fused_linear import gemm_lora
        x2 = (x if xn is None else xn).reshape(-1, self.in_features)
        t = x2.shape[0]
        w._check_tokens("x", t)
        _, lora_b, ranks = self._fused_weights()
        if buf is None:
            lora_a = self.lora_a.get_value()
            s, r = lora_a.shape[0], lora_a.shape[2]
            buf = w.add_shrink(jnp.zeros((s, t, r), jnp.float32), x2, tuple(lora_a[i] for i in range(s)), 1.0,
                               lora_ranks=ranks)
        bias = None if self.base.bias is None else self.base.bias.get_value()
        slots = w.token_meta.token_lora_mapping[:t]
        y = gemm_lora(x2.astype(self.kernel_nk.get_value().dtype), self.kernel_nk.get_value(), bias, buf,
                      lora_b, slots, self.output_slices, lora_ranks=ranks)
        return y.reshape(*x.shape[:-1], self.out_features)

    def norm_linear(self, h: jax.Array, norm_weight: jax.Array, eps: float, punica=None) -> jax.Array | None:
        """The layer of RMSNorm(h) * norm_weight (Hugging Face's LlamaRMSNorm rounding) through the
        fused "norm" path: one kernel for the norm and the shrink (rms_norm_shrink), one GEMM with
        the expand; None when this call does not take it (fused is not "norm" or "auto", `fuses`
        says no, or with "auto" the tuned table's `use_norm_fused_linear` says no): the caller then
        runs its norm and the layer.

        h: (..., in) float16 / bfloat16 / float32; norm_weight (in,); returns (..., out)."""
        w = _pick(punica)
        if self.fused not in ("norm", "auto") or not self.fuses(w):
            return None
        if self.fused == "auto":
            from lora_core.kernels.fused_linear_configs import use_norm_fused_linear
            tokens = h.size // self.in_features if self.in_features else 0
            if not use_norm_fused_linear((self.in_features, self.output_slices), int(tokens), self.max_rank):
                return None
        from .ops.fused_linear import rms_norm_shrink
        h2 = h.reshape(-1, self.in_features)
        w._check_tokens("h", h2.shape[0])
        slots = w.token_meta.token_lora_mapping[:h2.shape[0]]
        lora_a, _, ranks = self._fused_weights()
        xn, buf = rms_norm_shrink(h2, norm_weight, float(eps), lora_a, slots, 1.0, lora_ranks=ranks)
        return self._fused_linear(h, w, xn, buf)

    def _fused_weights(self) -> tuple:
        """(lora_a, lora_b, lora_ranks) as the fused kernels take them: the layer's own arrays, or for
        a banked layer per-slice Views of its entry of the bank's arrays (jax_lora.ops.triton.View:
        read in place, no copy per layer) and its ranks."""
        if not self.banked:
            return self.lora_a.get_value(), self.lora_b.get_value(), self.lora_ranks.get_value()
        from .ops.triton import view
        layer, a, b = self.layer_index, self.bank.lora_a.get_value(), self.bank.lora_b.get_value()
        offsets = [sum(self.output_slices[:s]) for s in range(len(self.output_slices))]
        return (tuple(view(a, (layer, s)) for s in range(len(self.output_slices))),
                tuple(view(b, (layer, slice(None), slice(o, o + n))) for o, n in zip(offsets, self.output_slices)),
                self.bank.lora_ranks.get_value()[layer])

    def _base_without_bias(self, x):
        """nnx.Linear's product without its bias (the bias is added after DoRA's scale)."""
        base = self.base
        x, kernel = base.promote_dtype((x, base.kernel[...]), dtype=base.dtype)
        kwargs = {} if base.preferred_element_type is None else {"preferred_element_type": base.preferred_element_type}
        return base.dot_general(x, kernel, (((x.ndim - 1,), (0,)), ((), ())), precision=base.precision, **kwargs)

    slot_axis: ClassVar[dict] = {"lora_a": 1, "lora_b": 0, "lora_ranks": 0, "lora_scale": 0, "lora_a_scale": 1,
                                 "lora_b_scale": 0}


@functools.cache
def _log_fused_fallback(reason: str) -> None:
    _LOG.info("fused LoRA linear: the unfused path (base product + add_lora_linear) runs: %s", reason)


class MultiLoRAEmbed(nnx.Module):
    """An `nnx.Embed` plus one adapter per token.

    The token's LoRA-A row is looked up in the flattened (L * V, r) table at `id + slot * V` (the
    wrapper's `embeddings_indices[1]`), then `row @ B[slot].T` is added (the wrapper's
    add_lora_embedding_ids). Tokens without adapter keep the base embedding.

    lora_dtype: None (weights in `dtype`) or "fp8": lora_a (L, V, r) and lora_b (L, D, r) in e4m3
    with float32 scales `lora_a_scale` (L, V) (one per table row) and `lora_b_scale` (L, D) (one per
    output channel) (contract section 11; `use_fp8`): a token's row is float32(A_q[l, v]) *
    lora_a_scale[l, v].
    """

    def __init__(self, base: nnx.Embed, *, max_loras: int, max_rank: int, dtype=None, lora_dtype=None):
        if not isinstance(base, nnx.Embed):
            raise TypeError(f"base must be an nnx.Embed, got {type(base).__name__}")
        check_lora_dtype(lora_dtype)
        self.base = base
        self.num_embeddings = int(base.num_embeddings)
        self.features = int(base.features)
        self.max_loras = max_loras = _check_int("max_loras", max_loras)
        self.max_rank = max_rank = _check_int("max_rank", max_rank)
        dtype = dtype or base.embedding.get_value().dtype
        self.lora_a = LoRAWeight(jnp.zeros((max_loras, self.num_embeddings, max_rank), dtype))
        self.lora_b = LoRAWeight(jnp.zeros((max_loras, self.features, max_rank), dtype))
        self.lora_ranks = _ranks_variable(max_loras, max_rank)
        self.tp = None      # jax_lora.parallel.TensorParallel once split over a mesh
        self.lora_dtype = None
        if lora_dtype == "fp8":
            self.use_fp8()

    def use_fp8(self) -> bool:
        """Stores the adapter weights in e4m3 with float32 scales (`lora_a_scale` (L, V), one per table
        row; `lora_b_scale` (L, D), one per output channel), the weights held now quantised
        (jax_lora.quant.quantize_rows); returns whether the storage changed. New variables: call it
        before the serving step is first traced. Refused for a layer split over a mesh."""
        if self.lora_dtype == "fp8":
            return False
        return _store_fp8(self)

    def attend(self, query: jax.Array) -> jax.Array:
        """The base embedding's `attend` (tied LM heads): adapters do not apply here."""
        return self.base.attend(query)

    def __call__(self, ids: jax.Array, punica=None) -> jax.Array:
        w = _pick(punica)
        if w is not None and self.tp is not None:
            return self.tp.apply(self, ids, w)
        y = self.base(ids)
        if w is None:
            return y
        flat = ids.reshape(-1).astype(jnp.int32)
        t = flat.shape[0]
        check_rows = getattr(w, "_check_embedding_rows", None)     # (the bridge's wrappers have none)
        if check_rows is not None:
            check_rows("the embedding", self.num_embeddings)
        if not getattr(w, "num_pairs", 0) and w.embeddings_indices.shape[1] < t:
            raise ValueError(f"ids has {t} tokens but the wrapper's mapping has {w.embeddings_indices.shape[1]}")
        # Row `id + slot * V` of the flattened table (several adapters per token: each pair's rows),
        # clipped so no read is out of bounds; tokens without an adapter are skipped by the expand.
        fp8 = ({} if self.lora_dtype != "fp8" else
               dict(lora_a_scale=self.lora_a_scale.get_value(), lora_b_scale=self.lora_b_scale.get_value()))
        out = w.add_lora_embedding_ids(y.reshape(t, self.features), flat, self.lora_a.get_value(),
                                       self.lora_b.get_value(), lora_ranks=self.lora_ranks.get_value(), **fp8)
        return out.reshape(y.shape)

    slot_axis: ClassVar[dict] = {"lora_a": 0, "lora_b": 0, "lora_ranks": 0, "lora_a_scale": 0, "lora_b_scale": 0}


class MultiLoRALogits(nnx.Module):
    """The LM head (an `nnx.Linear` hidden -> vocab) plus one adapter per sampled row.

    __call__(h (R, H)) -> (R, V): rows are the sampled rows of the step, in the order of the
    mapping's `prompt_mapping` (the wrapper's sampler indices; add_lora_logits).

    lora_dtype: None (weights in `dtype`) or "fp8": lora_a (L, r, H) and lora_b (L, V, r) in e4m3
    with float32 per-channel scales `lora_a_scale` (L, r) and `lora_b_scale` (L, V) (contract
    section 11), handed to add_lora_logits (`use_fp8`).
    """

    def __init__(self, base: nnx.Linear, *, max_loras: int, max_rank: int, dtype=None, lora_dtype=None):
        check_lora_dtype(lora_dtype)
        _check_linear_base(base)
        self.base = base
        self.in_features = int(base.in_features)
        self.out_features = int(base.out_features)
        self.max_loras = max_loras = _check_int("max_loras", max_loras)
        self.max_rank = max_rank = _check_int("max_rank", max_rank)
        dtype = dtype or _base_dtype(base)
        self.lora_a = LoRAWeight(jnp.zeros((max_loras, max_rank, self.in_features), dtype))
        self.lora_b = LoRAWeight(jnp.zeros((max_loras, self.out_features, max_rank), dtype))
        self.lora_ranks = _ranks_variable(max_loras, max_rank)
        self.tp = None      # jax_lora.parallel.TensorParallel once split over a mesh
        self.lora_dtype = None
        if lora_dtype == "fp8":
            self.use_fp8()

    def use_fp8(self) -> bool:
        """Stores the adapter weights in e4m3 with per-channel float32 scales (`lora_a_scale` (L, r),
        `lora_b_scale` (L, V)), the weights held now quantised (jax_lora.quant.quantize_rows);
        returns whether the storage changed. New variables: call it before the serving step is
        first traced. Refused for a layer split over a mesh."""
        if self.lora_dtype == "fp8":
            return False
        return _store_fp8(self)

    def __call__(self, h: jax.Array, punica=None) -> jax.Array:
        w = _pick(punica)
        if w is not None and self.tp is not None:
            return self.tp.apply(self, h, w)
        y = self.base(h)
        if w is None:
            return y
        h2 = h.reshape(-1, h.shape[-1])
        fp8 = ({} if self.lora_dtype != "fp8" else
               dict(lora_a_scale=self.lora_a_scale.get_value(), lora_b_scale=self.lora_b_scale.get_value()))
        out = w.add_lora_logits(y.reshape(h2.shape[0], -1), h2, self.lora_a.get_value(), self.lora_b.get_value(), 1.0,
                                lora_ranks=self.lora_ranks.get_value(), **fp8)
        return out.reshape(y.shape)

    slot_axis: ClassVar[dict] = {"lora_a": 0, "lora_b": 0, "lora_ranks": 0, "lora_a_scale": 0, "lora_b_scale": 0}


class MultiLoRAExperts(nnx.Module):
    """The experts of a MoE layer (jax_lora.moe.MoEExperts) plus one adapter per token on every expert.

    Slot weights, in vLLM's fused MoE LoRA layouts (E experts, H hidden, I each expert's width):
      w13_lora_a (2, L, E, r, H)   w13_lora_b (2, L, E, I, r)   gate (0) and up (1) of gate_up_proj
      w2_lora_a  (L, E, r, I)      w2_lora_b  (L, E, H, r)      down_proj
      lora_ranks (L,) int32        adapter_enabled (L,) int32 (0: the slot's adapter has no expert
                                   LoRA in this layer, and its tokens' pairs cost nothing)
    PEFT's gate_up_proj LoRA (one A, B (2I, r)) lands as A in both slices and B's halves.

    lora_dtype: None (the stacks in `dtype`) or "fp8" (`use_fp8`): the four stacks in e4m3 with
    float32 scales per expert and output channel (contract section 11), w13_lora_a_scale
    (2, L, E, r), w13_lora_b_scale (2, L, E, I), w2_lora_a_scale (L, E, r), w2_lora_b_scale
    (L, E, H), handed to add_lora_w13 / add_lora_w2 as lora_a_scale / lora_b_scale.

    __call__(x (T, H), ids (T, k), weights (T, k), punica=None) -> (T, H): the experts' output, and
    with a wrapper, each routed pair (t, e) of a token with slot l adds (x[t] @ A13_s[l, e].T) @
    B13_s[l, e].T to gate_up's slice s, and weights[t, k] * (a_p @ A2[l, e].T) @ B2[l, e].T to the
    weighted down output (the wrapper's add_lora_w13 and add_lora_w2, scale 1: the scaling is folded
    into B).
    """

    def __init__(self, base, *, max_loras: int, max_rank: int, dtype=None, lora_dtype=None):
        check_lora_dtype(lora_dtype)
        if not isinstance(base, MoEExperts):
            raise TypeError(f"base must be a jax_lora.moe.MoEExperts, got {type(base).__name__}")
        self.base = base
        e, h, i = base.num_experts, base.hidden_size, base.intermediate_size
        self.max_loras = max_loras = _check_int("max_loras", max_loras)
        self.max_rank = max_rank = _check_int("max_rank", max_rank)
        dtype = dtype or base.gate_up_proj.get_value().dtype
        self.w13_lora_a = LoRAWeight(jnp.zeros((2, max_loras, e, max_rank, h), dtype))
        self.w13_lora_b = LoRAWeight(jnp.zeros((2, max_loras, e, i, max_rank), dtype))
        self.w2_lora_a = LoRAWeight(jnp.zeros((max_loras, e, max_rank, i), dtype))
        self.w2_lora_b = LoRAWeight(jnp.zeros((max_loras, e, h, max_rank), dtype))
        self.lora_ranks = _ranks_variable(max_loras, max_rank)
        self.adapter_enabled = LoRAWeight(jnp.ones((max_loras,), jnp.int32))
        self.tp = None
        self.lora_dtype = None
        if lora_dtype == "fp8":
            self.use_fp8()

    STACKS: ClassVar[tuple] = ("w13_lora_a", "w13_lora_b", "w2_lora_a", "w2_lora_b")

    def use_fp8(self) -> bool:
        """Stores the four stacks in e4m3 with float32 scales per expert and output channel (their
        last axis quantised, jax_lora.quant.quantize_rows), as new `<stack>_scale` variables; returns
        whether the storage changed (False when it is fp8 already). Refused on a layer split over
        a mesh. New variables: call it before the serving step is first traced."""
        if self.lora_dtype == "fp8":
            return False
        if self.tp is not None:
            raise ValueError("fp8 adapter weights are not supported on a LoRA layer split over a mesh: build the "
                             "layers with lora_dtype='fp8' before splitting, or serve 16-bit adapters")
        for name in self.STACKS:
            q, scale = quantize_rows(getattr(self, name).get_value())
            setattr(self, name, LoRAWeight(jnp.asarray(q)))
            setattr(self, f"{name}_scale", LoRAWeight(jnp.asarray(scale)))
        self.lora_dtype = "fp8"
        return True

    def _fp8_scales(self) -> tuple:
        """({}, {}) for 16-bit stacks; with fp8 the wrapper keywords of gate_up (per slice) and of down."""
        if self.lora_dtype != "fp8":
            return {}, {}
        a13, b13 = self.w13_lora_a_scale.get_value(), self.w13_lora_b_scale.get_value()
        return (dict(lora_a_scale=(a13[0], a13[1]), lora_b_scale=(b13[0], b13[1])),
                dict(lora_a_scale=(self.w2_lora_a_scale.get_value(),),
                     lora_b_scale=(self.w2_lora_b_scale.get_value(),)))

    @property
    def num_experts(self) -> int:
        return self.base.num_experts

    def __call__(self, x: jax.Array, ids: jax.Array, weights: jax.Array, punica=None) -> jax.Array:
        w = _pick(punica)
        if w is None:
            return self.base(x, ids, weights)
        base, (t, k) = self.base, ids.shape
        ranks, enabled = self.lora_ranks.get_value(), self.adapter_enabled.get_value()
        order = ExpertOrder(ids, base.num_experts)
        a13, b13 = self.w13_lora_a.get_value(), self.w13_lora_b.get_value()
        fp8_13, fp8_2 = self._fp8_scales()
        h, *layout = w.add_lora_w13(base.gate_up(x, ids, order), x, (a13[0], a13[1]), (b13[0], b13[1]), ids,
                                    weights, None, None, None, t, k, self.max_loras, enabled, base.num_experts, k, 2,
                                    False, False, lora_ranks=ranks, **fp8_13)
        a = base.activate(h)
        d = w.add_lora_w2(base.down(a, ids, weights, order), a, (self.w2_lora_a.get_value(),),
                          (self.w2_lora_b.get_value(),), weights, *layout, t, None, None, k, self.max_loras, enabled,
                          k, False, 0, False, lora_ranks=ranks, **fp8_2)
        return d.sum(axis=1)

    slot_axis: ClassVar[dict] = {"w13_lora_a": 1, "w13_lora_b": 1, "w2_lora_a": 0, "w2_lora_b": 0,
                                 "lora_ranks": 0, "adapter_enabled": 0, "w13_lora_a_scale": 1, "w13_lora_b_scale": 1,
                                 "w2_lora_a_scale": 0, "w2_lora_b_scale": 0}


LORA_LAYER_TYPES = (MultiLoRALinear, MultiLoRAEmbed, MultiLoRALogits, MultiLoRAExperts)


def _matches(name: str, leaf: str, targets: str | Sequence[str]) -> bool:
    """PEFT's rule: a string is a regex over the full name; a list matches the last name part(s)."""
    if isinstance(targets, str):
        return re.fullmatch(targets, name) is not None
    return any(name == t or name.endswith("." + t) or leaf == t for t in targets)


def lora_layers(model: nnx.Module) -> dict[str, nnx.Module]:
    """The multi-LoRA layers of `model`, by dotted path ("model.layers.0.self_attn.qkv_proj")."""
    return {path_name(p): node for p, node in nnx.iter_graph(model) if isinstance(node, LORA_LAYER_TYPES)}


def replace_lora_layers(model: nnx.Module, target_modules: str | Sequence[str], *, max_loras: int,
                        max_rank: int, output_slices: Mapping[str, Sequence[int]] | None = None,
                        logits_modules: Sequence[str] = ("lm_head",), dtype=None,
                        dora: bool = False, lora_dtype=None) -> dict[str, nnx.Module]:
    """Replaces the targeted layers of an NNX model by multi-adapter layers, in place.

    Args:
      model: any NNX module tree (attributes, nnx.List, nnx.Dict).
      target_modules: layer names (a list matches a path's last part(s), as PEFT) or one regex over
        the dotted path. `nnx.Linear` -> MultiLoRALinear (MultiLoRALogits for `logits_modules`),
        `nnx.Embed` -> MultiLoRAEmbed.
      max_loras, max_rank: slots and the largest adapter rank the slots hold.
      output_slices: {layer name (last part) or full path: slice widths} for fused projections.
      dtype: adapter weight dtype (default: each base layer's).
      dora: the linear layers (not the logits or embeddings) hold DoRA column scales from the start
        (without it, `MultiLoRALinear.enable_dora` adds one when the first DoRA adapter reaches a layer).
      lora_dtype: None or "fp8": the linear layers, the logits and the embeddings store e4m3 weights
        with float32 scales (MultiLoRALinear, MultiLoRALogits, MultiLoRAEmbed; contract section 11;
        expert layers are not replaced here: `MultiLoRAExperts(..., lora_dtype="fp8")`).

    Returns {path: new layer}. Raises ValueError when nothing matches (a typo should not silently
    give a model without adapters).
    """
    check_lora_dtype(lora_dtype)
    output_slices = dict(output_slices or {})
    found = []
    nodes = list(nnx.iter_graph(model))
    inside = [p for p, n in nodes if isinstance(n, LORA_LAYER_TYPES)]   # already multi-LoRA: skip their bases
    for path, node in nodes:
        if not path or not isinstance(node, (nnx.Linear, QuantizedLinear, nnx.Embed)) or isinstance(
                node, LORA_LAYER_TYPES):
            continue
        if any(tuple(path[:len(p)]) == tuple(p) for p in inside):
            continue
        name, leaf = path_name(path), str(path[-1])
        if _matches(name, leaf, target_modules):
            found.append((path, node))
    if not found:
        raise ValueError(f"target_modules {target_modules!r} match no nnx.Linear / QuantizedLinear / nnx.Embed "
                         f"layer of {type(model).__name__}")
    replaced = {}
    for path, node in found:
        name, leaf = path_name(path), str(path[-1])
        if isinstance(node, nnx.Embed):
            new = MultiLoRAEmbed(node, max_loras=max_loras, max_rank=max_rank, dtype=dtype, lora_dtype=lora_dtype)
        elif leaf in logits_modules:
            new = MultiLoRALogits(node, max_loras=max_loras, max_rank=max_rank, dtype=dtype, lora_dtype=lora_dtype)
        else:
            slices = output_slices.get(name, output_slices.get(leaf))
            new = MultiLoRALinear(node, max_loras=max_loras, max_rank=max_rank, output_slices=slices,
                                  dtype=dtype, dora=dora, lora_dtype=lora_dtype)
        set_submodule(model, path, new)
        replaced[name] = new
    return replaced


def _bank_kind(path) -> str | None:
    """A decoder layer's projection kind from its graph path: the parts after its one layer index
    joined by "_" ("model.layers.3.self_attn.qkv_proj" -> "self_attn_qkv_proj"); None for a path
    without exactly one index."""
    at = [i for i, p in enumerate(path) if isinstance(p, int)]
    return "_".join(str(p) for p in path[at[0] + 1:]) if len(at) == 1 and at[0] + 1 < len(path) else None


def _bank_signature(layer: MultiLoRALinear) -> tuple:
    """What the layers of one bank must share: their adapter arrays' shapes and dtypes, DoRA, storage."""
    return (tuple((n, getattr(layer, n).get_value().shape, getattr(layer, n).get_value().dtype)
                  for n in BANKED_VARIABLES if n in vars(layer)), layer.dora, layer.lora_dtype)


def stack_lora_layers(model: nnx.Module) -> dict:
    """Moves the adapter variables of the decoder layers' MultiLoRALinears into shared, layer-stacked
    LoRABanks (jax_lora.lora_bank), in place; returns {kind: bank} of the banks made.

    1. The MultiLoRALinears of `model` whose graph path holds one integer (the decoder layer's
       index: "model.layers.3.self_attn.qkv_proj") are grouped by the path around it (the kind);
       a layer already banked, split over a mesh (`tp`) or on the fused path stays as it is.
    2. Per kind whose layers agree on their variables' shapes and dtypes, DoRA and storage: a bank
       whose arrays stack each layer's, in layer order (entry l = the layer's values, bit for bit),
       held by the model as `model.lora_banks[kind]` (an nnx.Dict).
    3. Each layer `join_bank`s it with its position l in the stack.

    The model's state then holds each kind's arrays once (NNX keeps a shared module once): a
    jitted step over it takes O(kinds) adapter arrays instead of O(layers x kinds). Results are
    unchanged. `unstack_lora_layers` undoes it.
    """
    groups: dict = {}
    for path, node in nnx.iter_graph(model):
        if isinstance(node, MultiLoRALinear) and not node.banked and node.tp is None and node.fused is None:
            kind = _bank_kind(path)
            if kind is not None:
                groups.setdefault(kind, []).append((path, node))
    made = {}
    for kind, members in sorted(groups.items()):
        members.sort(key=lambda pn: [p for p in pn[0] if isinstance(p, int)])
        layers = [node for _path, node in members]
        if len({_bank_signature(layer) for layer in layers}) != 1:
            _LOG.info("LoRA banks: the %s layers differ in their adapter variables; they keep their own arrays", kind)
            continue
        values = {n: jnp.stack([getattr(layer, n).get_value() for layer in layers])
                  for n in BANKED_VARIABLES if n in vars(layers[0])}
        bank = LoRABank(values, dora=layers[0].dora, lora_dtype=layers[0].lora_dtype)
        for i, layer in enumerate(layers):
            layer.join_bank(bank, i)
        made[kind] = bank
    if made:
        banks = getattr(model, "lora_banks", None)
        if banks is None:
            model.lora_banks = banks = nnx.Dict()
        for kind, bank in made.items():
            banks[kind] = bank
    return made


def unstack_lora_layers(model: nnx.Module) -> list:
    """Gives every banked MultiLoRALinear of `model` its own adapter variables again (its entry of
    its bank's arrays) and drops `model.lora_banks`; returns the paths of the layers changed."""
    changed = []
    for path, node in list(nnx.iter_graph(model)):
        if isinstance(node, MultiLoRALinear) and node.banked:
            node.leave_bank()
            changed.append(path_name(path))
    if getattr(model, "lora_banks", None) is not None:
        del model.lora_banks
    return changed
