"""A tiny random transformers Llama and adapters made by peft itself, with peft as the oracle (torch side).

`write_assets(root)` returns (fresh, dirs): `fresh()` builds the same random Llama every call (vocab
64, hidden 32, two layers, 4 query heads over 2 KV heads, float32); `dirs` maps adapter names to
directories saved by peft:
  sql   rank 4, alpha 8, a regex target: layer 1's q_proj and v_proj;
  chat  rank 8, alpha 16 on all seven projections, rank_pattern {down_proj: 4}, alpha_pattern {o_proj: 32};
  code  rank 4, alpha 4, rsLoRA, on q_proj, o_proj, embed_tokens and lm_head;
and "_model" to the base model saved with save_pretrained. torch, transformers and peft are imported
when called, so test files import this module before their importorskip lines.
"""

from __future__ import annotations

ALL7 = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def tiny_llama(seed=0, **extra):
    import torch
    import transformers
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                   tie_word_embeddings=False, **extra)
    return transformers.LlamaForCausalLM(cfg).eval()


def save_peft(model_factory, path, seed, **lora_kw):
    """An adapter made and saved by peft itself (B not zero: init_lora_weights=False); its directory."""
    import peft
    import torch
    torch.manual_seed(seed)
    lora = peft.get_peft_model(model_factory(), peft.LoraConfig(init_lora_weights=False, **lora_kw))
    lora.save_pretrained(str(path))
    return str(path)


def write_assets(root):
    """(fresh, dirs) under `root` (a pathlib.Path); see the module docstring."""
    state = tiny_llama().state_dict()

    def fresh():
        m = tiny_llama()
        m.load_state_dict(state)
        return m
    dirs = {
        "sql": save_peft(fresh, root / "sql", 1, r=4, lora_alpha=8,
                         target_modules=r"model\.layers\.1\.self_attn\.(q_proj|v_proj)"),
        "chat": save_peft(fresh, root / "chat", 2, r=8, lora_alpha=16, target_modules=ALL7,
                          rank_pattern={"down_proj": 4}, alpha_pattern={"o_proj": 32}),
        "code": save_peft(fresh, root / "code", 3, r=4, lora_alpha=4, use_rslora=True,
                          target_modules=["q_proj", "o_proj", "embed_tokens", "lm_head"]),
    }
    fresh().save_pretrained(str(root / "model"))
    dirs["_model"] = str(root / "model")
    return fresh, dirs


def peft_model(fresh, dirs):
    """peft.PeftModel over `fresh()` with every adapter of `dirs` loaded under its name."""
    import peft
    names = list(dirs)
    pm = peft.PeftModel.from_pretrained(fresh(), dirs[names[0]], adapter_name=names[0]).eval()
    for n in names[1:]:
        pm.load_adapter(dirs[n], adapter_name=n)
    return pm


def peft_logits(pm, ids, name):
    """Peft's logits for `ids` (B, S) with adapter `name` ("__base__": adapters disabled)."""
    import torch
    with torch.no_grad():
        if name == "__base__":
            with pm.disable_adapter():
                return pm(ids).logits
        pm.set_adapter(name)
        return pm(ids).logits
