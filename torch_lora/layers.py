"""Multi-LoRA layers for PyTorch: stacked adapter weights in fixed slots, computed through a PunicaWrapper.

Each layer holds the LoRA weights of every slot for one place of a model and adds, to the output
of the model's own module, each token's adapter's LoRA term:

layer: base module; buffers (L = max_loras slots, r = max_rank); wrapper call
  * `LoRALinear`: one linear module (`nn.Linear`, a quantized linear, any module computing
    (..., in) -> (..., out)), or several that read the same input (q/k/v, gate/up);
    `lora_a` (S, L, r, in), `lora_b_<s>` (L, n_s, r); one `add_lora_linear` over the S slices.
  * `LoRAEmbedding`: `nn.Embedding`; `lora_a` (L, V, r), `lora_b` (L, D, r); `add_lora_embedding_ids`
    (row lookup at `embeddings_indices[1]`, then the expand).
  * `LoRALogits`: the LM head (`nn.Linear`); `lora_a` (L, r, H), `lora_b` (L, V, r);
    `add_lora_logits` on the sampled rows.

A `LoRALinear` built with `lora_dtype="fp8"` stores `lora_a` / `lora_b_<s>` in e4m3 with float32
per-output-channel scales beside them, `lora_a_scale` (S, L, r) and `lora_b_scale_<s>` (L, n_s)
(contract section 11; `torch_lora.adapters` quantises a 16-bit adapter when it places it). A
`LoRALogits` built so stores `lora_a` (L, r, H) / `lora_b` (L, V, r) in e4m3 with `lora_a_scale`
(L, r) and `lora_b_scale` (L, V). A `LoRAEmbedding` built so stores its table `lora_a` (L, V, r)
and `lora_b` (L, D, r) in e4m3 with `lora_a_scale` (L, V) (one per table row: the row a token
looks up) and `lora_b_scale` (L, D), passed to `add_lora_embedding_ids`.

Every layer also has `lora_ranks` (L,) int32: each slot's real rank in this layer (0 for an empty
slot), passed to the kernels as `lora_ranks` so they skip the zero padding. A `LoRALinear` built
with `dora=True`, or given a DoRA adapter later (`enable_dora()`), also has `dora_scale`
(L, out_features) float32: each slot's DoRA column scale (lora_core.dora; 1 for plain LoRA adapters
and empty slots), passed as `dora_scale_stacked`. The adapter's scaling is
folded into `lora_b` when it is placed (`torch_lora.adapters`), so the layers call the wrapper with
scale 1. The buffers are allocated once and written in place (slot by slot): their addresses never
change, so a CUDA graph captured once keeps reading the current adapters.

The layers never run their base module: `apply(...)` takes the base module's input and output and
adds the LoRA term to the output in place (`torch_lora.hf` calls it from forward hooks). Inference
only: an output that requires grad is refused.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from .wrapper import PunicaWrapper

__all__ = ["LoRAEmbedding", "LoRALinear", "LoRALogits"]


def check_lora_dtype(lora_dtype) -> str | None:
    """lora_dtype as a layer takes it: None (the weights in the layer's dtype) or "fp8"."""
    if lora_dtype is not None and lora_dtype != "fp8":
        raise ValueError(f"lora_dtype must be None (the model's dtype) or 'fp8' (e4m3 weights with per-channel "
                         f"float32 scales), got {lora_dtype!r}")
    return lora_dtype


def _positive(name: str, value) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{name} must be an int > 0, got {value!r}")
    return value


class _LoRALayer(nn.Module):
    """What every multi-LoRA layer shares: its slots, its ranks and the wrapper it computes through.

    module_names: the Hugging Face names of the modules whose LoRA weights the layer holds (one per
    slice; an adapter's tensors for module m go to the slice of m). Each layer's `slot_views(slot)`
    returns that slot's tensors (views of the buffers) in the order `torch_lora.adapters` lays out
    an adapter's host data for the layer; `lora_ranks` is written separately.
    """

    kind = ""

    def __init__(self, module_names: Sequence[str], *, max_loras: int, max_rank: int, device, punica=None):
        super().__init__()
        self.module_names = tuple(module_names)
        self.max_loras = _positive("max_loras", max_loras)
        self.max_rank = _positive("max_rank", max_rank)
        self.punica: PunicaWrapper | None = punica
        self.register_buffer("lora_ranks", torch.zeros(max_loras, dtype=torch.int32, device=device),
                             persistent=False)

    def _wrapper(self) -> PunicaWrapper:
        if self.punica is None:
            raise RuntimeError(f"LoRA layer for {self.module_names[0]!r} has no PunicaWrapper: set layer.punica "
                               "(torch_lora.hf.MultiLoRAModel does)")
        return self.punica

    def _check_step(self, out: torch.Tensor, num_rows: int, mapped: int | None, what: str) -> None:
        if out.requires_grad:
            raise RuntimeError(f"LoRA layer for {self.module_names[0]!r}: multi-LoRA layers serve inference only; run "
                               "the model under torch.no_grad() or torch.inference_mode()")
        if num_rows != (mapped or 0):
            raise ValueError(f"LoRA layer for {self.module_names[0]!r}: the input has {num_rows} {what}, but the "
                             f"step's LoRA metadata maps {mapped or 0}; call MultiLoRAModel.prepare_step(...) (or "
                             "PunicaWrapper.update_metadata) for this batch shape before calling the model directly")


class LoRALinear(_LoRALayer):
    """Stacked LoRA weights of one linear module, or of several linears that read the same input.

    The layer never reads its modules' weights (except a DoRA layer's `base_weights`): it adds to
    the output each module computed, so a module with a quantized weight (torchao, bitsandbytes)
    holds a LoRA layer as an `nn.Linear` does; the LoRA weights are in `dtype` (16/32-bit float).

    A group (q/k/v of an attention, gate/up of an MLP) is one multi-slice layer: the first member
    called with an input computes every slice's LoRA term in ONE `add_lora_linear` call into a
    `(T, sum(output_slices))` buffer; each member (the first included) then adds its columns to its
    own output. A member called with another input recomputes the group for that input, so the
    result is right whatever the model does; it is one call per group when the members share their
    input, as they do in the decoder families `torch_lora.hf` groups.

    Args:
      module_names: names of the S member modules, in slice order.
      in_features: H, the input width every member shares.
      output_slices: (n_0, ..., n_{S-1}), each member's output width.
      dora: also serve DoRA adapters (PEFT's use_dora): the layer holds each slot's column scale g
        and a token whose adapter is DoRA gets, in member s,
            y = g_s[slot] * (x W_s^T + delta_s) + bias_s
        (W_s, bias_s the member's base weight and bias; delta_s the LoRA term). `apply` then needs
        the member's bias (the base output it receives holds it; it is added after the scale).
      base_weights: the S members' base weights (n_s, H) (references to the modules' weights, not
        copies): torch_lora.adapters reads them to compute g when it places a DoRA adapter
        (g = m / ||W + s B A||_row, lora_core.dora.column_scale). Needed with dora=True; without
        it they let a DoRA adapter in later: its first placement calls `enable_dora()`, which
        allocates dora_scale then (MultiLoRAModel passes them always).
      lora_dtype: None (the weights in `dtype`) or "fp8": lora_a and lora_b_<s> in float8_e4m3fn with
        float32 per-output-channel scales lora_a_scale (S, L, r) and lora_b_scale_<s> (L, n_s)
        (contract section 11), passed to the wrapper as lora_a_scale / lora_b_scale; `dtype` is then
        only the dtype of the terms `lora_terms` is asked for.
    Buffers: lora_a (S, L, r, H); lora_b_<s> (L, n_s, r) (scaling folded in); lora_ranks (L,) int32;
    with dora=True (or after `enable_dora()`), dora_scale (L, out_features) float32 (slice s at
    columns offsets[s]:, ones where the slot's adapter is plain LoRA or the slot is empty).
    """

    kind = "linear"

    def __init__(self, module_names: Sequence[str], in_features: int, output_slices: Sequence[int], *,
                 max_loras: int, max_rank: int, dtype: torch.dtype, device, punica=None, dora: bool = False,
                 base_weights: Sequence[torch.Tensor] | None = None, lora_dtype: str | None = None):
        super().__init__(module_names, max_loras=max_loras, max_rank=max_rank, device=device, punica=punica)
        self.lora_dtype = check_lora_dtype(lora_dtype)
        if self.lora_dtype == "fp8":
            dtype = torch.float8_e4m3fn
        self.in_features = _positive("in_features", in_features)
        self.output_slices = tuple(_positive("output_slices[i]", int(n)) for n in output_slices)
        if len(self.output_slices) != len(self.module_names):
            raise ValueError(f"output_slices must have one width per module ({len(self.module_names)}), got "
                             f"{len(self.output_slices)}")
        self.offsets = tuple(sum(self.output_slices[:s]) for s in range(len(self.output_slices)))
        self.out_features = sum(self.output_slices)
        self.register_buffer("lora_a", torch.zeros(len(self.module_names), max_loras, max_rank, in_features,
                                                   dtype=dtype, device=device), persistent=False)
        for s, n in enumerate(self.output_slices):
            self.register_buffer(f"lora_b_{s}", torch.zeros(max_loras, n, max_rank, dtype=dtype, device=device),
                                 persistent=False)
        if self.lora_dtype == "fp8":
            self.register_buffer("lora_a_scale", torch.ones(len(self.module_names), max_loras, max_rank,
                                                            dtype=torch.float32, device=device), persistent=False)
            for s, n in enumerate(self.output_slices):
                self.register_buffer(f"lora_b_scale_{s}", torch.ones(max_loras, n, dtype=torch.float32,
                                                                     device=device), persistent=False)
        self._fp8_stacks = None
        if not isinstance(dora, bool):
            raise TypeError(f"dora must be a bool, got {dora!r}")
        self.dora = False
        self.base_weights = (self._check_base_weights(base_weights) if dora or base_weights is not None else None)
        if dora:
            self.enable_dora()
        self._stacks = None
        self._pending = None          # [input, LoRA terms (..., out_features), members served, token scales,
                                      #  the input's version counter when the terms were computed]

    def enable_dora(self) -> bool:
        """Allocates `dora_scale` (L, out_features) float32, all ones (every slot plain LoRA), on the
        layer's device unless the layer has it; returns whether it was allocated. Needs base_weights.
        The buffer is new: a CUDA graph captured before it existed does not read it (capture again
        after the first DoRA adapter is loaded, or build with dora=True)."""
        if self.dora:
            return False
        if self.base_weights is None:
            raise ValueError(f"LoRA layer for {self.module_names[0]!r} has no base_weights, which DoRA's column "
                             "scale is computed from: build it with base_weights=[each member's weight] "
                             "(MultiLoRAModel does)")
        self.register_buffer("dora_scale", torch.ones(self.max_loras, self.out_features, dtype=torch.float32,
                                                      device=self.lora_a.device), persistent=False)
        self.dora = True
        return True

    def _check_base_weights(self, base_weights) -> tuple:
        want = [(n, self.in_features) for n in self.output_slices]
        if not isinstance(base_weights, (list, tuple)) or len(base_weights) != len(self.module_names) or not all(
                isinstance(w, torch.Tensor) for w in base_weights):
            raise ValueError(f"LoRA layer for {self.module_names[0]!r}: dora=True needs base_weights, one tensor per "
                             f"member module with shapes {want} (out, in), got {base_weights!r:.200}"
                             if base_weights is None else
                             f"LoRA layer for {self.module_names[0]!r}: base_weights must be one tensor per member "
                             f"module with shapes {want} (out, in), got {base_weights!r:.200}")
        got = [tuple(w.shape) for w in base_weights]
        if got != want:
            raise ValueError(f"LoRA layer for {self.module_names[0]!r}: base_weights must have shapes {want} "
                             f"(each member's (out_features, in_features)), got {got}")
        return tuple(base_weights)

    @property
    def lora_b(self) -> tuple:
        """(lora_b_0, ..., lora_b_{S-1}), each (L, n_s, r)."""
        return tuple(getattr(self, f"lora_b_{s}") for s in range(len(self.module_names)))

    def _weights(self) -> tuple:
        """Per-slice A views (L, r, H), the B buffers and, for a DoRA layer, per-slice views (L, n_s)
        of dora_scale (else None), as persistent objects: the wrapper caches its argument checks per
        tensor object. Rebuilt if the buffers were replaced (.to())."""
        scale = self.dora_scale if self.dora else None
        if self._stacks is None or self._stacks[0] is not self.lora_a or self._stacks[1] is not scale:
            views = None if scale is None else tuple(scale[:, off:off + n]
                                                     for off, n in zip(self.offsets, self.output_slices))
            self._stacks = (self.lora_a, scale, tuple(self.lora_a[s] for s in range(len(self.module_names))),
                            self.lora_b, views)
        return self._stacks[2:]

    def _fp8_scales(self) -> dict:
        """{} for 16-bit weights; with lora_dtype="fp8" the wrapper's keywords lora_a_scale (per-slice
        views (L, r) of lora_a_scale) and lora_b_scale (the lora_b_scale_<s> buffers), as persistent
        objects (the wrapper caches its checks per tensor object); rebuilt if the buffers were replaced."""
        if self.lora_dtype != "fp8":
            return {}
        if self._fp8_stacks is None or self._fp8_stacks[0] is not self.lora_a_scale:
            b_scales = tuple(getattr(self, f"lora_b_scale_{s}") for s in range(len(self.module_names)))
            self._fp8_stacks = (self.lora_a_scale, dict(
                lora_a_scale=tuple(self.lora_a_scale[s] for s in range(len(self.module_names))),
                lora_b_scale=b_scales))
        return self._fp8_stacks[1]

    def slot_views(self, slot: int) -> tuple:
        """(A_0 (r, H), ..., A_{S-1}, B_0 (n_0, r), ..., B_{S-1}) of `slot`, then with lora_dtype="fp8"
        their scales (a_scale_0 (r,), ..., b_scale_0 (n_0,), ...) (a DoRA layer's dora_scale[slot] is
        written apart: ones, not zeros, where the slot has no DoRA adapter)."""
        views = (tuple(self.lora_a[s, slot] for s in range(len(self.module_names)))
                 + tuple(b[slot] for b in self.lora_b))
        if self.lora_dtype == "fp8":
            views += (tuple(self.lora_a_scale[s, slot] for s in range(len(self.module_names)))
                      + tuple(getattr(self, f"lora_b_scale_{s}")[slot] for s in range(len(self.module_names))))
        return views

    def lora_terms(self, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """(..., out_features) in `dtype`: every slice's LoRA term for x (..., H), 0 for tokens without
        an adapter; in a DoRA layer, g[slot] times it (the base output's share, (g - 1) x W^T, is
        `apply`'s)."""
        punica = self._wrapper()
        a, b, scales = self._weights()
        terms = torch.zeros(x.shape[:-1] + (self.out_features,), dtype=dtype, device=x.device)
        punica.add_lora_linear(terms, x, a, b, None, 1.0, self.output_slices, lora_ranks=self.lora_ranks,
                               dora_scale_stacked=scales, **self._fp8_scales())
        return terms

    def apply(self, member: int, x: torch.Tensor, out: torch.Tensor,
              bias: torch.Tensor | None = None) -> torch.Tensor:
        """out += the LoRA term of slice `member` for x, in place; returns out.

        x: (..., H), the member module's input; out: (..., n_member), its output (x W^T + bias).
        bias: (n_member,) the member's base bias, or None; read by a DoRA layer only, which writes
        out = g[slot] * (x W^T + delta) + bias for each token with an adapter (g = 1: out + delta).
        """
        punica = self._wrapper()
        self._check_step(out, x.numel() // self.in_features, punica.indices_len[0], "tokens")
        if len(self.module_names) == 1:
            a, b, scales = self._weights()
            punica.add_lora_linear(out, x, a, b, None, 1.0, self.output_slices, lora_ranks=self.lora_ranks,
                                   dora_scale_stacked=scales, **self._fp8_scales())
            if scales is not None and bias is not None:
                # The kernel scaled the bias with the rest: out = g * (x W^T + bias + delta). Add
                # (1 - g) * bias (0 where g = 1: plain LoRA slots, tokens without an adapter).
                valid, g = self._token_scales(punica)
                out.add_(((1 - g) * bias.to(torch.float32)).view(out.shape))
            return out
        # The terms are reused only for the same, unmodified input (an in-place change to x between
        # the members' calls bumps its version counter). An inference tensor (torch.inference_mode())
        # has no version counter: an in-place change could not be seen, so each member computes its
        # own slice (one call of its A and B: the group's work in total, one launch per member).
        version = None if x.is_inference() else x._version
        if version is None and not self.dora:
            a, b, _ = self._weights()
            fp8 = {k: (v[member],) for k, v in self._fp8_scales().items()}
            punica.add_lora_linear(out, x, (a[member],), (b[member],), None, 1.0, (self.output_slices[member],),
                                   lora_ranks=self.lora_ranks, **fp8)
            return out
        pending = self._pending
        if (pending is None or pending[0] is not x or version is None or pending[4] != version
                or member in pending[2]):
            pending = [x, self.lora_terms(x, out.dtype), set(), self._token_scales(punica) if self.dora else None,
                       version]
            self._pending = pending if version is not None else None
        off, width = self.offsets[member], self.output_slices[member]
        if pending[3] is None:
            out += pending[1][..., off:off + width]
        else:
            # terms hold g * delta; the base output's share is (g - 1) * (out - bias).
            valid, g = pending[3]
            g = g[:, off:off + width].view(out.shape)
            base = out.to(torch.float32) if bias is None else out.to(torch.float32) - bias.to(torch.float32)
            new = out.to(torch.float32) + pending[1][..., off:off + width] + (g - 1) * base
            out.copy_(torch.where(valid.view(out.shape[:-1] + (1,)), new, out))
        pending[2].add(member)
        if len(pending[2]) == len(self.module_names):
            self._pending = None      # every member served: release the input and the terms
        return out

    def _token_scales(self, punica: PunicaWrapper) -> tuple:
        """(valid (T,) bool, g (T, out_features) float32) of this step's tokens: whether the token
        has an adapter, and its slot's DoRA column scale (1 without an adapter)."""
        idx = punica.token_lora_indices
        valid = idx >= 0
        g = self.dora_scale.index_select(0, idx.clamp(0, self.max_loras - 1).long())
        return valid, torch.where(valid[:, None], g, torch.ones_like(g))

    def extra_repr(self) -> str:
        return (f"modules={list(self.module_names)}, in_features={self.in_features}, "
                f"output_slices={self.output_slices}, max_loras={self.max_loras}, "
                f"max_rank={self.max_rank}{', dora=True' if self.dora else ''}")


class LoRAEmbedding(_LoRALayer):
    """Stacked LoRA weights of an `nn.Embedding` (PEFT's lora_embedding_A / lora_embedding_B).

    The term for token id v of an adapter in slot l is `lora_a[l, v] @ lora_b[l].T`, times the base
    module's `embed_scale` when it has one (Gemma 3's scaled embedding; PEFT scales the LoRA term
    the same way), folded into lora_b when the adapter is placed.

    lora_dtype: None (weights in `dtype`) or "fp8": lora_a and lora_b in float8_e4m3fn with float32
    scales lora_a_scale (L, V) (one per table row) and lora_b_scale (L, D) (one per output channel)
    (contract section 11): a token's row is float32(lora_a[l, v]) * lora_a_scale[l, v].
    Buffers: lora_a (L, V, r) (A transposed: one row per token id); lora_b (L, D, r); lora_ranks.
    """

    kind = "embedding"

    def __init__(self, module: str, num_embeddings: int, embedding_dim: int, *, max_loras: int, max_rank: int,
                 dtype: torch.dtype, device, embed_scale: float = 1.0, punica=None, lora_dtype: str | None = None):
        super().__init__((module,), max_loras=max_loras, max_rank=max_rank, device=device, punica=punica)
        self.lora_dtype = check_lora_dtype(lora_dtype)
        if self.lora_dtype == "fp8":
            dtype = torch.float8_e4m3fn
        self.num_embeddings = _positive("num_embeddings", num_embeddings)
        self.embedding_dim = _positive("embedding_dim", embedding_dim)
        self.embed_scale = float(embed_scale)
        self.register_buffer("lora_a", torch.zeros(max_loras, num_embeddings, max_rank, dtype=dtype, device=device),
                             persistent=False)
        self.register_buffer("lora_b", torch.zeros(max_loras, embedding_dim, max_rank, dtype=dtype, device=device),
                             persistent=False)
        if self.lora_dtype == "fp8":
            self.register_buffer("lora_a_scale", torch.ones(max_loras, num_embeddings, dtype=torch.float32,
                                                            device=device), persistent=False)
            self.register_buffer("lora_b_scale", torch.ones(max_loras, embedding_dim, dtype=torch.float32,
                                                            device=device), persistent=False)

    def slot_views(self, slot: int) -> tuple:
        """(A (V, r), B (D, r)) of `slot`, then with lora_dtype="fp8" their scales (a_scale (V,),
        b_scale (D,))."""
        views = (self.lora_a[slot], self.lora_b[slot])
        if self.lora_dtype == "fp8":
            views += (self.lora_a_scale[slot], self.lora_b_scale[slot])
        return views

    def apply(self, ids: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """out += the LoRA term of each token, in place; returns out. ids: (...) token ids (int);
        out: (..., D), the embedding's output."""
        punica = self._wrapper()
        self._check_step(out, ids.numel(), punica.indices_len[0], "tokens")
        # Row `slot * V + id` of the flattened (L * V, r) table (embeddings_indices[1] = slot * V: the
        # step must be prepared with vocab_size = V); tokens without adapter read slot 0's row and
        # are then skipped by the expand (their index is -1). Several adapters per token: each pair's
        # rows (the wrapper).
        check_rows = getattr(punica, "_check_embedding_rows", None)     # (the bridge's wrappers have none)
        if check_rows is not None:
            check_rows(f"LoRA layer for {self.module_names[0]!r}: the embedding", self.num_embeddings)
        fp8 = ({} if self.lora_dtype != "fp8" else dict(lora_a_scale=self.lora_a_scale, lora_b_scale=self.lora_b_scale))
        punica.add_lora_embedding_ids(out.view(-1, self.embedding_dim), ids.reshape(-1), self.lora_a, self.lora_b,
                                      lora_ranks=self.lora_ranks, **fp8)
        return out

    def extra_repr(self) -> str:
        return (f"module={self.module_names[0]!r}, num_embeddings={self.num_embeddings}, embedding_dim="
                f"{self.embedding_dim}, max_loras={self.max_loras}, max_rank={self.max_rank}"
                f"{', lora_dtype=fp8' if self.lora_dtype == 'fp8' else ''}")


class LoRALogits(_LoRALayer):
    """Stacked LoRA weights of the LM head; each logits row uses its sampled row's adapter (the
    wrapper's sampler indices: `prompt_mapping`, one entry per row of logits).

    lora_dtype: None (the weights in `dtype`) or "fp8": lora_a and lora_b in float8_e4m3fn with
    float32 per-output-channel scales lora_a_scale (L, r) and lora_b_scale (L, V) (contract section
    11), passed to add_lora_logits.
    Buffers: lora_a (L, r, H); lora_b (L, V, r) (scaling folded in); lora_ranks (L,) int32.
    """

    kind = "logits"

    def __init__(self, module: str, in_features: int, out_features: int, *, max_loras: int, max_rank: int,
                 dtype: torch.dtype, device, punica=None, lora_dtype: str | None = None):
        super().__init__((module,), max_loras=max_loras, max_rank=max_rank, device=device, punica=punica)
        self.lora_dtype = check_lora_dtype(lora_dtype)
        if self.lora_dtype == "fp8":
            dtype = torch.float8_e4m3fn
        self.in_features = _positive("in_features", in_features)
        self.out_features = _positive("out_features", out_features)
        self.register_buffer("lora_a", torch.zeros(max_loras, max_rank, in_features, dtype=dtype, device=device),
                             persistent=False)
        self.register_buffer("lora_b", torch.zeros(max_loras, out_features, max_rank, dtype=dtype, device=device),
                             persistent=False)
        if self.lora_dtype == "fp8":
            self.register_buffer("lora_a_scale", torch.ones(max_loras, max_rank, dtype=torch.float32, device=device),
                                 persistent=False)
            self.register_buffer("lora_b_scale", torch.ones(max_loras, out_features, dtype=torch.float32,
                                                            device=device), persistent=False)

    def slot_views(self, slot: int) -> tuple:
        """(A (r, H), B (V, r)) of `slot`, then with lora_dtype="fp8" their scales (a_scale (r,),
        b_scale (V,))."""
        views = (self.lora_a[slot], self.lora_b[slot])
        if self.lora_dtype == "fp8":
            views += (self.lora_a_scale[slot], self.lora_b_scale[slot])
        return views

    def apply(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """out += the LoRA term of each logits row, in place; returns out. x: (..., H), the head's
        input; out: (..., V), its output (one row per entry of the step's prompt mapping)."""
        punica = self._wrapper()
        self._check_step(out, x.numel() // self.in_features, punica.indices_len[1], "rows of logits")
        fp8 = ({} if self.lora_dtype != "fp8" else dict(lora_a_scale=self.lora_a_scale, lora_b_scale=self.lora_b_scale))
        punica.add_lora_logits(out.view(-1, self.out_features), x.reshape(-1, self.in_features), self.lora_a,
                               self.lora_b, 1.0, lora_ranks=self.lora_ranks, **fp8)
        return out

    def extra_repr(self) -> str:
        return (f"module={self.module_names[0]!r}, in_features={self.in_features}, out_features={self.out_features}, "
                f"max_loras={self.max_loras}, max_rank={self.max_rank}"
                f"{', lora_dtype=fp8' if self.lora_dtype == 'fp8' else ''}")
