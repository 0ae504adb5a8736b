"""A tiny random Llama checkpoint with three PEFT adapters, and its merged-weights oracle (JAX side).

`write_assets(root)` writes, under `root`:
  model/  config.json + model.safetensors in Hugging Face layout (vocab 64, hidden 32, one layer,
          4 query heads over 2 KV heads);
  a1/     rank 4, alpha 8 on q_proj and v_proj;
  a2/     rank 8, alpha 16, rsLoRA, on o_proj, down_proj, gate_proj, embed_tokens and lm_head;
  a3/     rank 2, alpha 2 on k_proj and up_proj;
and returns {"root": root, "model": dir, "a1": dir, "a2": dir, "a3": dir}.

`merged_logits(assets, adapter_dir, tokens)` is the float64 oracle every serving test compares with:
the base checkpoint with the adapter merged into its weights, run on `tokens` padded to ORACLE_LEN
(causal attention: the padding never reaches earlier positions), (len(tokens), vocab) float64.
"""

from __future__ import annotations

import json
import os

import jax
import numpy as np
from flax import nnx

from jax_lora.adapters import load_peft_adapter, merge_adapter, save_peft_adapter
from jax_lora.models import LlamaConfig, load_llama

from .jax_helpers import rand, rel_err

CFG = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=64)
# module -> (in_features, out_features)
SHAPES = {"self_attn.q_proj": (32, 32), "self_attn.k_proj": (32, 16), "self_attn.v_proj": (32, 16),
          "self_attn.o_proj": (32, 32), "mlp.gate_proj": (32, 64), "mlp.up_proj": (32, 64),
          "mlp.down_proj": (64, 32)}
ORACLE_LEN = 16


def modules(names, r, scale=0.3, embed=False, head=False):
    """{module path: (lora_A (r, in), lora_B (out, r))} float32 for `names` on every layer."""
    out = {}
    for layer in range(CFG.num_hidden_layers):
        for n in names:
            i, o = SHAPES[n]
            out[f"model.layers.{layer}.{n}"] = (rand(r, i, scale=scale), rand(o, r, scale=scale))
    if embed:
        out["model.embed_tokens"] = (rand(r, CFG.vocab_size, scale=scale), rand(CFG.hidden_size, r, scale=scale))
    if head:
        out["lm_head"] = (rand(r, CFG.hidden_size, scale=scale), rand(CFG.vocab_size, r, scale=scale))
    return out


def write_assets(root):
    """The checkpoint and three adapters under `root` (a pathlib.Path); see the module docstring."""
    from safetensors.numpy import save_file
    os.makedirs(root / "model")
    c = CFG
    weights = {"model.embed_tokens.weight": rand(c.vocab_size, c.hidden_size),
               "model.norm.weight": 1 + rand(c.hidden_size, scale=0.1),
               "lm_head.weight": rand(c.vocab_size, c.hidden_size, scale=0.2)}
    for i in range(c.num_hidden_layers):
        for n, (fan_in, fan_out) in SHAPES.items():                  # Hugging Face layout: (out, in)
            weights[f"model.layers.{i}.{n}.weight"] = rand(fan_out, fan_in, scale=fan_in ** -0.5)
        for n in ("input_layernorm", "post_attention_layernorm"):
            weights[f"model.layers.{i}.{n}.weight"] = 1 + rand(c.hidden_size, scale=0.1)
    save_file(weights, str(root / "model" / "model.safetensors"))
    (root / "model" / "config.json").write_text(json.dumps(c.to_dict()))
    save_peft_adapter(str(root / "a1"), modules(["self_attn.q_proj", "self_attn.v_proj"], 4), r=4, lora_alpha=8)
    save_peft_adapter(str(root / "a2"), modules(["self_attn.o_proj", "mlp.down_proj", "mlp.gate_proj"], 8,
                                                embed=True, head=True), r=8, lora_alpha=16, use_rslora=True)
    save_peft_adapter(str(root / "a3"), modules(["self_attn.k_proj", "mlp.up_proj"], 2), r=2, lora_alpha=2)
    return {"root": root, "model": str(root / "model"), **{k: str(root / k) for k in ("a1", "a2", "a3")}}


_ORACLE: dict = {}


def merged_logits(assets, adapter_dir, tokens):
    """(len(tokens), vocab) float64: the checkpoint with `adapter_dir` merged (None: the base model)."""
    key = (assets["model"], adapter_dir)     # several checkpoints share a test process (the base is None in each)
    if key not in _ORACLE:
        base = load_llama(assets["model"])
        model = base if adapter_dir is None else merge_adapter(base, load_peft_adapter(adapter_dir))
        graphdef, state = nnx.split(model)
        pos = np.arange(ORACLE_LEN, dtype=np.int32)[None]
        _ORACLE[key] = (jax.jit(lambda st, t: nnx.merge(graphdef, st)(t, pos)[0][0]), state)
    forward, state = _ORACLE[key]
    t = np.zeros((1, ORACLE_LEN), np.int32)
    t[0, :len(tokens)] = tokens
    return np.asarray(forward(state, t), np.float64)[:len(tokens)]


def check_against_merged(assets, completions, dirs):
    """Every completion's logits within 1e-4 of the merged model's and its greedy tokens equal;
    `dirs` maps a completion's lora_id (0: none) to its adapter directory."""
    for c in completions:
        seq = list(c.prompt) + list(c.tokens)
        want = merged_logits(assets, dirs[c.lora_id or 0], seq)[len(c.prompt) - 1:len(seq) - 1]
        assert rel_err(c.logits, want) < 1e-4, c.request_id
        assert list(np.argmax(want, axis=-1)) == list(c.tokens), c.request_id
