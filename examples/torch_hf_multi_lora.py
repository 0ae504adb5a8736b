"""PyTorch integration: serve one Hugging Face model with several PEFT adapters in ONE forward pass.

A tiny Llama (transformers, random weights) gets three LoRA adapters of different ranks through peft.
Their weights are copied into stacked slots, the LoRA-targeted projections are replaced by a small
multi-adapter layer driven by `torch_lora.PunicaWrapper`, and one batch mixes requests of every
adapter and some without adapter. Each request's logits are checked against peft running that
request alone with its adapter active (or disabled).

    python examples/torch_hf_multi_lora.py

The layer below is all an engine needs on the torch side: keep stacked weights per slot, call
`wrapper.add_lora_linear` after the base projection, and call `wrapper.update_metadata` once per
step with the batch's mapping (token -> adapter id).
"""

from __future__ import annotations

import torch
from torch import nn

import torch_lora

TARGETS = ("q_proj", "v_proj")


class MultiLoRALinear(nn.Module):
    """base(x) + LoRA of each token's adapter. Stacked weights: A (slots, 1, r_max, in),
    B (slots, 1, out, r_max) with the adapter's scaling folded into B; smaller ranks zero-padded."""

    def __init__(self, base: nn.Linear, wrapper: torch_lora.PunicaWrapper, num_slots: int, max_rank: int):
        super().__init__()
        self.base, self.wrapper = base, wrapper
        w = base.weight
        self.register_buffer("lora_a", torch.zeros(num_slots, 1, max_rank, base.in_features, dtype=w.dtype))
        self.register_buffer("lora_b", torch.zeros(num_slots, 1, base.out_features, max_rank, dtype=w.dtype))

    @torch.no_grad()
    def load_slot(self, slot: int, a: torch.Tensor, b: torch.Tensor, scaling: float) -> None:
        """Writes one adapter into `slot` in place (a: (r, in), b: (out, r)); no re-allocation."""
        r = a.shape[0]
        self.lora_a[slot].zero_()
        self.lora_b[slot].zero_()
        self.lora_a[slot, 0, :r].copy_(a)
        self.lora_b[slot, 0, :, :r].copy_(b * scaling)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        return self.wrapper.add_lora_linear(y, x, (self.lora_a,), (self.lora_b,), None, 1.0,
                                            (self.base.out_features,))


def main(seed: int = 0, verbose: bool = True) -> int:
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2)
    base = LlamaForCausalLM(cfg).eval()
    adapters = {"a": (4, 8), "b": (8, 8), "c": (16, 32)}            # name -> (rank, lora_alpha)
    names = list(adapters)
    peft_model = None
    for name, (r, alpha) in adapters.items():
        lcfg = LoraConfig(r=r, lora_alpha=alpha, target_modules=list(TARGETS), init_lora_weights=False)
        if peft_model is None:
            peft_model = get_peft_model(base, lcfg, adapter_name=name)
        else:
            peft_model.add_adapter(name, lcfg)
    peft_model.eval()

    # The batch: 6 requests of 5 tokens, 0 = no adapter; LoRA ids 1..3 live in slots 0..2.
    lora_ids = {name: i + 1 for i, name in enumerate(names)}
    requests = ["a", None, "c", "b", "a", None]
    prompts = torch.randint(0, cfg.vocab_size, (len(requests), 5))

    # References: peft, one request at a time, with its adapter active or disabled.
    want = []
    with torch.no_grad():
        for name, prompt in zip(requests, prompts):
            if name is None:
                with peft_model.disable_adapter():
                    want.append(peft_model(prompt[None]).logits[0])
            else:
                peft_model.set_adapter(name)
                want.append(peft_model(prompt[None]).logits[0])

    # Our model: a copy of the base weights with the targets replaced by multi-adapter layers.
    ours = LlamaForCausalLM(cfg).eval()
    ours.load_state_dict({k.replace("base_layer.", ""): v for k, v in peft_model.get_base_model().state_dict().items()
                          if "lora_" not in k}, strict=True)
    num_slots, max_rank = 4, max(r for r, _ in adapters.values())
    wrapper = torch_lora.PunicaWrapper(max_num_batched_tokens=64, max_batches=8, device="cpu", max_loras=num_slots)
    peft_layers = dict(peft_model.get_base_model().named_modules())
    for layer_name, module in list(ours.named_modules()):
        for target in TARGETS:
            base_linear = getattr(module, target, None)
            if isinstance(base_linear, nn.Linear):
                multi = MultiLoRALinear(base_linear, wrapper, num_slots, max_rank)
                src = peft_layers[f"{layer_name}.{target}"]
                for name in names:
                    multi.load_slot(lora_ids[name] - 1, src.lora_A[name].weight, src.lora_B[name].weight,
                                    src.scaling[name])
                setattr(module, target, multi)

    # One step: the mapping says which adapter each token (and each sampled row) uses.
    tokens_ids = tuple(lora_ids.get(name, 0) for name in requests for _ in range(prompts.shape[1]))
    rows_ids = tuple(lora_ids.get(name, 0) for name in requests)
    wrapper.update_metadata(torch_lora.LoRAMapping(tokens_ids, rows_ids, is_prefill=True),
                            lora_index_to_id=[1, 2, 3, None], max_loras=num_slots + 1, vocab_size=cfg.vocab_size)
    with torch.no_grad():
        got = ours(prompts).logits                                    # all requests, one forward pass

    ok = 0
    for i, name in enumerate(requests):
        err = ((got[i] - want[i]).norm() / want[i].norm()).item()
        good = err < 1e-4
        ok += good
        if verbose:
            print(f"request {i}: adapter {name or '-'}  relative error vs peft {err:.1e}  {'ok' if good else 'MISMATCH'}")
    if verbose:
        print(f"verified: {ok}/{len(requests)} requests match peft (one mixed-adapter forward pass, backend "
              f"{wrapper.backend})")
    return len(requests) - ok


if __name__ == "__main__":
    raise SystemExit(1 if main() else 0)
