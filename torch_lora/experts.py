"""Multi-LoRA on a mixture-of-experts layer: the stacked expert adapters of one experts module.

An experts module (transformers' MixtralExperts, Qwen2MoeExperts, Qwen3MoeExperts, and any module
holding fused 3-D `gate_up_proj` (E, 2I, H) and `down_proj` (E, H, I) parameters) computes, for
token t routed to experts e_k with router weights w_k:

  gu = W_gu[e] @ x[t];  h = act(gu[:I]) * gu[I:];  out[t] = sum_k w_k * (W_dn[e] @ h)

With expert LoRA (slot l of token t, scaling folded into B):

  gu += B_gu[l, e] @ A_gu[l, e] @ x[t]         (vLLM's add_lora_w13: two slices, gate and up, one A)
  d   = w_k * (W_dn[e] @ h + B_dn[l, e] @ A_dn[l, e] @ h)   (add_lora_w2: router weight applied)

`LoRAExperts` holds the slots (buffers gu_a (L, E, r, H), gu_b (L, E, 2I, r), dn_a (L, E, r, I),
dn_b (L, E, H, r), adapter_enabled (L + 1,): 1 where the slot's adapter has expert LoRA here,
so a slot without it costs nothing) and `forward(module, x, top_k_index, top_k_weights)`, the
experts module's computation with the LoRA terms added through the PunicaWrapper. Built with
`lora_dtype="fp8"` the four stacks are float8_e4m3fn with float32 per-output-channel scales beside
them (contract section 11): gu_a_scale (L, E, r), gu_b_scale (L, E, 2I), dn_a_scale (L, E, r),
dn_b_scale (L, E, H), a weight's value being float32(w) * scale of its row; they go to the
wrapper's MoE methods as lora_a_scale / lora_b_scale (the gate and up slices: column views of
gu_b_scale, both reading gu_a_scale):

1. Base gate_up per routed pair (T, top_k, 2I), expert by expert (the experts hit by the batch).
2. `add_lora_w13` adds the gate and up LoRA terms; both slices read the one A (the shrink runs once).
3. h = act(gate) * up, one row per pair; base down per pair times the router weight.
4. `add_lora_w2` adds the down LoRA term times the router weight; the pairs are summed over k.
`torch_lora.hf.MultiLoRAModel` installs it as the experts module's forward.
"""

from __future__ import annotations

import torch
from torch import nn

from .layers import _LoRALayer, check_lora_dtype

__all__ = ["LoRAExperts", "is_experts_module"]


def is_experts_module(module: nn.Module) -> bool:
    """Whether `module` holds fused expert weights: 3-D parameters gate_up_proj (E, 2I, H) (gate
    rows then up rows) and down_proj (E, H, I) of one E, and an `act_fn`."""
    gate_up = getattr(module, "gate_up_proj", None)
    down = getattr(module, "down_proj", None)
    if getattr(module, "is_transposed", False) or not getattr(module, "is_concatenated", True):
        return False            # (E, H, 2I) storage or interleaved gate / up columns
    return (isinstance(gate_up, nn.Parameter) and isinstance(down, nn.Parameter) and gate_up.dim() == 3
            and down.dim() == 3 and gate_up.shape[0] == down.shape[0] and gate_up.shape[1] == 2 * down.shape[2]
            and gate_up.shape[2] == down.shape[1] and callable(getattr(module, "act_fn", None)))


class LoRAExperts(_LoRALayer):
    """Stacked expert LoRA of one experts module (module docstring).

    Args:
      path: the experts module's name in the model; the layer takes the adapter modules
        path + ".gate_up_proj" and path + ".down_proj" (kind "experts", lora_core.peft.experts).
      num_experts, hidden, intermediate: E, H, I.
      lora_dtype: None (the stacks in `dtype`) or "fp8": the stacks in float8_e4m3fn with float32
        per-output-channel scales gu_a_scale (L, E, r), gu_b_scale (L, E, 2I), dn_a_scale (L, E, r),
        dn_b_scale (L, E, H) (contract section 11; `torch_lora.adapters` quantises a 16-bit
        adapter's expert factors when it places them).
    """

    kind = "experts"

    def __init__(self, path: str, num_experts: int, hidden: int, intermediate: int, *, max_loras: int,
                 max_rank: int, dtype=torch.float32, device=None, punica=None, lora_dtype: str | None = None):
        super().__init__((f"{path}.gate_up_proj", f"{path}.down_proj"), max_loras=max_loras, max_rank=max_rank,
                         device=device, punica=punica)
        self.lora_dtype = check_lora_dtype(lora_dtype)
        if self.lora_dtype == "fp8":
            dtype = torch.float8_e4m3fn
        self.num_experts, self.hidden, self.intermediate = num_experts, hidden, intermediate
        L, E, r = max_loras, num_experts, max_rank
        kw = dict(dtype=dtype, device=device)
        self.register_buffer("gu_a", torch.zeros(L, E, r, hidden, **kw), persistent=False)
        self.register_buffer("gu_b", torch.zeros(L, E, 2 * intermediate, r, **kw), persistent=False)
        self.register_buffer("dn_a", torch.zeros(L, E, r, intermediate, **kw), persistent=False)
        self.register_buffer("dn_b", torch.zeros(L, E, hidden, r, **kw), persistent=False)
        if self.lora_dtype == "fp8":
            for name, rows in (("gu_a_scale", r), ("gu_b_scale", 2 * intermediate), ("dn_a_scale", r),
                               ("dn_b_scale", hidden)):
                self.register_buffer(name, torch.ones(L, E, rows, dtype=torch.float32, device=device),
                                     persistent=False)
        self.register_buffer("adapter_enabled", torch.zeros(L + 1, dtype=torch.int32, device=device),
                             persistent=False)

    @property
    def in_features(self) -> tuple:
        """(H, I): the input widths of gate_up and down."""
        return (self.hidden, self.intermediate)

    @property
    def out_features(self) -> tuple:
        """(2I, H): the output widths of gate_up and down."""
        return (2 * self.intermediate, self.hidden)

    def slot_views(self, slot: int) -> tuple:
        """(A_gu (E, r, H), B_gu (E, 2I, r), A_dn (E, r, I), B_dn (E, H, r)) of `slot`, then with
        lora_dtype="fp8" their scales (a_gu (E, r), b_gu (E, 2I), a_dn (E, r), b_dn (E, H))."""
        views = (self.gu_a[slot], self.gu_b[slot], self.dn_a[slot], self.dn_b[slot])
        if self.lora_dtype == "fp8":
            views += (self.gu_a_scale[slot], self.gu_b_scale[slot], self.dn_a_scale[slot], self.dn_b_scale[slot])
        return views

    def _fp8_scales(self) -> tuple:
        """({}, {}) for 16-bit stacks; with lora_dtype="fp8" the wrapper keywords of gate_up (A's
        scale for both slices, B's column views: gate then up) and of down."""
        if self.lora_dtype != "fp8":
            return {}, {}
        inter = self.intermediate
        gate_up = dict(lora_a_scale=(self.gu_a_scale, self.gu_a_scale),
                       lora_b_scale=(self.gu_b_scale[:, :, :inter], self.gu_b_scale[:, :, inter:]))
        return gate_up, dict(lora_a_scale=(self.dn_a_scale,), lora_b_scale=(self.dn_b_scale,))

    def _routed_linear(self, rows: torch.Tensor, weight: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """(P, n): rows[p] @ weight[experts[p]].T, expert by expert over the experts present."""
        out = rows.new_zeros(rows.shape[0], weight.shape[1])
        for e in torch.unique(experts).tolist():
            if 0 <= e < self.num_experts:
                pick = (experts == e).nonzero().squeeze(1)
                out[pick] = nn.functional.linear(rows[pick], weight[e])
        return out

    def forward_experts(self, module: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                        top_k_weights: torch.Tensor) -> torch.Tensor:
        """The experts module's output (T, H) for x (T, H) routed to top_k_index (T, k) with
        top_k_weights (T, k), each token's expert LoRA added (module docstring, steps 1-4)."""
        punica = self._wrapper()
        num_tokens, top_k = top_k_index.shape
        self._check_step(hidden_states, num_tokens, punica.indices_len[0], "tokens")
        inter = self.intermediate
        experts = top_k_index.reshape(-1)
        rows = hidden_states.repeat_interleave(top_k, dim=0)
        gate_up = self._routed_linear(rows, module.gate_up_proj, experts).view(num_tokens, top_k, 2 * inter)
        gu_b = (self.gu_b[:, :, :inter], self.gu_b[:, :, inter:])
        fp8_gate_up, fp8_down = self._fp8_scales()
        align = punica.add_lora_w13(gate_up, hidden_states, (self.gu_a, self.gu_a), gu_b, top_k_index,
                                    top_k_weights, None, module.gate_up_proj, module.down_proj, num_tokens, top_k,
                                    self.max_loras, self.adapter_enabled, self.num_experts, top_k, 2, False, False,
                                    **fp8_gate_up)
        gate, up = gate_up.chunk(2, dim=-1)
        h = (module.act_fn(gate) * up).reshape(num_tokens * top_k, inter)
        down = self._routed_linear(h, module.down_proj, experts).view(num_tokens, top_k, self.hidden)
        down = down * top_k_weights[..., None].to(down.dtype)
        sorted_ids, expert_ids, post_pad, mapping = align
        punica.add_lora_w2(down, h, (self.dn_a,), (self.dn_b,), top_k_weights, sorted_ids, expert_ids, post_pad,
                           mapping, num_tokens, module.gate_up_proj, module.down_proj, top_k, self.max_loras,
                           self.adapter_enabled, top_k, False, 0, False, **fp8_down)
        return down.sum(dim=1).to(hidden_states.dtype)

    def extra_repr(self) -> str:
        return (f"modules={list(self.module_names)}, experts={self.num_experts}, hidden={self.hidden}, "
                f"intermediate={self.intermediate}, max_loras={self.max_loras}, max_rank={self.max_rank}"
                f"{', lora_dtype=fp8' if self.lora_dtype == 'fp8' else ''}")
