"""PyTorch integration: one Hugging Face model serves several PEFT adapters in ONE forward pass.

A tiny Llama (transformers, random weights) and three LoRA adapters of different ranks saved by peft
are loaded into `torch_lora.hf.MultiLoRAModel`; one batch mixes requests of every adapter and some
without adapter ("__base__", PEFT's convention). Each request's logits are checked against peft
running that request alone with its adapter active (or disabled).

    python examples/torch_hf_multi_lora.py

`torch-lora demo` does the same at a larger scale, with generate() and batches of 8.
"""

from __future__ import annotations

import tempfile

import torch

from torch_lora.hf import MultiLoRAModel

ADAPTERS = {"a": dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]),
            "b": dict(r=8, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"]),
            "c": dict(r=16, lora_alpha=32, use_rslora=True, target_modules=["o_proj", "down_proj", "lm_head"])}


def main(seed: int = 0, verbose: bool = True) -> int:
    """Returns the number of requests whose logits differ from peft's (0 when all match)."""
    from peft import LoraConfig, PeftModel, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    with tempfile.TemporaryDirectory() as root:
        LlamaForCausalLM(cfg).save_pretrained(f"{root}/base")
        for name, kw in ADAPTERS.items():                 # adapters as a user gets them: saved by peft
            lora = get_peft_model(LlamaForCausalLM.from_pretrained(f"{root}/base"),
                                  LoraConfig(init_lora_weights=False, **kw))
            lora.save_pretrained(f"{root}/{name}")

        # Serving: wrap the model once, load adapters by name, pass one adapter name per row.
        model = MultiLoRAModel(LlamaForCausalLM.from_pretrained(f"{root}/base").eval(), max_loras=4, max_rank=16,
                               target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                               "down_proj", "lm_head"])
        for name in ADAPTERS:
            model.load_adapter(name, f"{root}/{name}")
        requests = ["a", "__base__", "c", "b", "a", "__base__"]
        prompts = torch.randint(0, cfg.vocab_size, (len(requests), 5))
        got = model(prompts, adapter_names=requests).logits          # all requests, one forward pass

        # Reference: peft, one request at a time.
        ref = PeftModel.from_pretrained(LlamaForCausalLM.from_pretrained(f"{root}/base"), f"{root}/a",
                                        adapter_name="a").eval()
        for name in ("b", "c"):
            ref.load_adapter(f"{root}/{name}", adapter_name=name)
        bad = 0
        with torch.no_grad():
            for i, (name, prompt) in enumerate(zip(requests, prompts)):
                if name == "__base__":
                    with ref.disable_adapter():
                        want = ref(prompt[None]).logits[0]
                else:
                    ref.set_adapter(name)
                    want = ref(prompt[None]).logits[0]
                err = ((got[i] - want).norm() / want.norm()).item()
                bad += err >= 1e-4
                if verbose:
                    print(f"request {i}: adapter {name:8s} relative error vs peft {err:.1e}  "
                          f"{'ok' if err < 1e-4 else 'MISMATCH'}")
    if verbose:
        print(f"verified: {len(requests) - bad}/{len(requests)} requests match peft (one mixed-adapter forward "
              f"pass, backend {model.punica.backend})")
    return bad


if __name__ == "__main__":
    raise SystemExit(1 if main() else 0)
