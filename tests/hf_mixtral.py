"""A tiny random transformers Mixtral (the oracle of the JAX Mixtral) and PEFT adapters on it.

`tiny_mixtral(seed)` builds the same random model every call (vocab 64, hidden 32, two layers, 4
query heads over 2 KV heads, 4 experts of width 24, top 2, float32, eval mode), with the router
weights scaled up so that the routing is far from ties; `tiny_qwen3_moe(seed)` a Qwen3-MoE alike.
`save_expert_adapter(...)` saves an adapter made by peft itself (B not zero) with
`target_parameters` on the fused experts and/or `target_modules` on attention. torch,
transformers and peft are imported when called.
"""

from __future__ import annotations

EXPERT_PARAMS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]


def tiny_mixtral(seed=0, **extra):
    import torch
    import transformers
    torch.manual_seed(seed)
    cfg = transformers.MixtralConfig(vocab_size=64, hidden_size=32, intermediate_size=24, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                                     num_experts_per_tok=2, max_position_embeddings=64, tie_word_embeddings=False,
                                     **extra)
    model = transformers.MixtralForCausalLM(cfg).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.mlp.gate.weight.mul_(20.0)           # decisive routing: no near-ties between experts
            layer.mlp.experts.gate_up_proj.normal_(0, 0.2)
            layer.mlp.experts.down_proj.normal_(0, 0.2)
    return model


def tiny_qwen3_moe(seed=0):
    """A tiny random transformers Qwen3-MoE (q/k norms, head_dim 16 != hidden / heads, no top-k
    renormalisation), its router scaled as `tiny_mixtral`'s."""
    import torch
    import transformers
    torch.manual_seed(seed)
    cfg = transformers.Qwen3MoeConfig(vocab_size=64, hidden_size=32, intermediate_size=48, moe_intermediate_size=24,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                      num_experts=4, num_experts_per_tok=2, norm_topk_prob=False,
                                      max_position_embeddings=64, tie_word_embeddings=False)
    model = transformers.Qwen3MoeForCausalLM(cfg).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.mlp.gate.weight.normal_(0, 1.0)
            layer.mlp.experts.gate_up_proj.normal_(0, 0.2)
            layer.mlp.experts.down_proj.normal_(0, 0.2)
            layer.self_attn.q_norm.weight.uniform_(0.5, 1.5)
            layer.self_attn.k_norm.weight.uniform_(0.5, 1.5)
    return model


def save_expert_adapter(model_factory, path, seed, **lora_kw):
    """An adapter made and saved by peft (init_lora_weights=False: B random); its directory."""
    import peft
    import torch
    torch.manual_seed(seed)
    lora = peft.get_peft_model(model_factory(), peft.LoraConfig(init_lora_weights=False, **lora_kw))
    lora.save_pretrained(str(path))
    return str(path)


def hf_greedy(model, prompt, new_tokens):
    """transformers' own greedy generation: the new token ids."""
    import torch
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=new_tokens, do_sample=False,
                             pad_token_id=0)
    return out[0, len(prompt):].tolist()
