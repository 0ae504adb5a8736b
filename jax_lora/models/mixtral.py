"""A Mixtral-style mixture-of-experts decoder in Flax NNX, loading Hugging Face checkpoints.

The Llama of jax_lora.models.llama with each layer's MLP replaced by a sparse MoE block: attention
(fused `qkv_proj`, GQA, RoPE, the KV cache), RMSNorm and the LM head are the Llama's modules; the
feed-forward is `model.layers.N.mlp` = a router `gate` (an nnx.Linear hidden -> E, no bias) and
`experts` (jax_lora.moe.MoEExperts: fused gate_up_proj (E, H, 2I) and down_proj (E, I, H)). Each
token goes to its top `num_experts_per_tok` experts, weighted by the softmax of the router logits
renormalised over the chosen ones (Hugging Face's Mixtral; `norm_topk_prob=False` keeps the plain
softmax probabilities, as some Qwen-MoE configs do).

Checkpoints (`load_mixtral`): Hugging Face safetensors with the experts in any of the layouts
transformers writes or reads:
  model.layers.N.block_sparse_moe.experts.E.w1 / w3 / w2.weight  (Mixtral's per-expert linears;
      gate w1, up w3, down w2) and model.layers.N.block_sparse_moe.gate.weight
  model.layers.N.mlp.experts.E.gate_proj / up_proj / down_proj.weight and mlp.gate.weight
  model.layers.N.mlp.experts.gate_up_proj (E, 2I, H) / down_proj (E, H, I) (fused) and mlp.gate.weight

LoRA (`add_lora`): the Llama's targets (attention, embeddings, LM head) plus the experts
(`experts`, or its parameters' names `gate_up_proj` / `down_proj`, as PEFT's target_parameters
names them), which become jax_lora.nn.MultiLoRAExperts. The router is never adapted.
Tensor parallelism is not implemented for this model.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Iterable, Sequence
from typing import ClassVar

import jax.numpy as jnp
import numpy as np
from flax import nnx

from .. import moe
from .. import nn as lnn
from .llama import (
    KVCache,
    LlamaConfig,
    LlamaDecoderLayer,
    RMSNorm,
    _Checkpoint,
    causal_lm_step,
)

__all__ = ["MIXTRAL_LORA_TARGETS", "MixtralConfig", "MixtralForCausalLM", "add_lora", "load_mixtral", "save_mixtral"]

MIXTRAL_LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "experts", "embed_tokens", "lm_head")
_EXPERT_NAMES = ("experts", "gate_up_proj", "down_proj", "w1", "w2", "w3", "gate_proj", "up_proj")


@dataclasses.dataclass(frozen=True)
class MixtralConfig(LlamaConfig):
    """LlamaConfig plus the MoE fields (`intermediate_size` is each expert's)."""

    intermediate_size: int = 14336
    num_local_experts: int = 8
    num_experts_per_tok: int = 2
    norm_topk_prob: bool = True
    rope_theta: float = 1e6
    qk_norm: bool = False          # Qwen3-MoE: RMSNorm of each head's q and k before RoPE

    def __post_init__(self):
        super().__post_init__()
        for name in ("num_local_experts", "num_experts_per_tok"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"MixtralConfig.{name} must be an int >= 1, got {value!r}")
        if self.num_experts_per_tok > self.num_local_experts:
            raise ValueError(f"MixtralConfig.num_experts_per_tok={self.num_experts_per_tok} exceeds "
                             f"num_local_experts={self.num_local_experts}")
        for name in ("norm_topk_prob", "qk_norm"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"MixtralConfig.{name} must be true or false, got {getattr(self, name)!r}")
        if self.mlp_bias:
            raise ValueError("MixtralConfig.mlp_bias must be false (the experts have no bias)")

    @classmethod
    def from_dict(cls, d: dict) -> MixtralConfig:
        if not isinstance(d, dict):
            raise ValueError(f"a Mixtral config must be a JSON object, got {type(d).__name__}")
        d = dict(d)
        if d.get("sliding_window") is not None and d.get("use_sliding_window", True):
            raise NotImplementedError(f"sliding_window={d['sliding_window']!r} is not supported by jax_lora's "
                                      "Mixtral (full attention only)")
        if d.get("model_type") == "qwen3_moe":
            d.setdefault("qk_norm", True)
            d.setdefault("norm_topk_prob", False)
        if d.get("mlp_only_layers") or d.get("decoder_sparse_step", 1) != 1:
            raise NotImplementedError(f"mlp_only_layers={d.get('mlp_only_layers')!r} / decoder_sparse_step="
                                      f"{d.get('decoder_sparse_step')!r}: layers without experts are not supported "
                                      "(every layer must be a MoE layer)")
        if d.get("num_experts") is not None and "num_local_experts" not in d:     # Qwen-MoE spelling
            d["num_local_experts"] = d["num_experts"]
        if d.get("moe_intermediate_size") is not None:
            d["intermediate_size"] = d["moe_intermediate_size"]
        for unsupported in ("shared_expert_intermediate_size", "n_shared_experts"):
            if d.get(unsupported):
                raise NotImplementedError(f"{unsupported}={d[unsupported]!r}: shared experts are not supported by "
                                          "jax_lora's Mixtral")
        d.setdefault("rope_theta", (d.get("rope_parameters") or {}).get("rope_theta", 1e6))
        return super().from_dict(d)

    def to_dict(self) -> dict:
        d = super().to_dict()
        d.update(model_type="mixtral", architectures=["MixtralForCausalLM"], sliding_window=None)
        if self.qk_norm:
            d.update(model_type="qwen3_moe", architectures=["Qwen3MoeForCausalLM"], num_experts=self.num_local_experts,
                     moe_intermediate_size=self.intermediate_size)
        del d["mlp_bias"]
        return d


class MixtralSparseMoeBlock(nnx.Module):
    """Router + experts: (B, S, H) -> (B, S, H) (jax_lora.moe)."""

    def __init__(self, cfg: MixtralConfig, *, dtype, rngs: nnx.Rngs):
        self.top_k = cfg.num_experts_per_tok
        self.norm_topk_prob = cfg.norm_topk_prob
        self.gate = nnx.Linear(cfg.hidden_size, cfg.num_local_experts, use_bias=False, dtype=dtype,
                               param_dtype=dtype, rngs=rngs)
        self.experts = moe.MoEExperts(cfg.num_local_experts, cfg.hidden_size, cfg.intermediate_size, dtype=dtype,
                                      rngs=rngs)

    def __call__(self, x):
        b, s, h = x.shape
        flat = x.reshape(b * s, h)
        weights, ids = moe.route_top_k(self.gate(flat), self.top_k, self.norm_topk_prob)
        return self.experts(flat, ids, weights).reshape(b, s, h)


class MixtralDecoderLayer(LlamaDecoderLayer):
    MLP = MixtralSparseMoeBlock


class MixtralModel(nnx.Module):
    def __init__(self, cfg: MixtralConfig, *, dtype, rngs: nnx.Rngs):
        self.embed_tokens = nnx.Embed(cfg.vocab_size, cfg.hidden_size, dtype=dtype, param_dtype=dtype, rngs=rngs)
        self.layers = nnx.List([MixtralDecoderLayer(cfg, dtype=dtype, rngs=rngs)
                                for _ in range(cfg.num_hidden_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype)


class MixtralForCausalLM(nnx.Module):
    """Mixtral decoder + LM head, called as jax_lora.models.LlamaForCausalLM is:

    __call__(tokens (B, S) int32, positions (B, S) int32, cache=None, rows=None, sample_idx=None)
      -> (logits, cache), with the same cache, rows, sample_idx and range-check rules.
    """

    packed_modules_mapping: ClassVar[dict] = {"qkv_proj": ("q_proj", "k_proj", "v_proj")}

    def __init__(self, config: MixtralConfig, *, dtype=jnp.float32, rngs: nnx.Rngs | None = None):
        if not isinstance(config, MixtralConfig):
            raise TypeError(f"config must be a MixtralConfig, got {type(config).__name__}")
        rngs = rngs if rngs is not None else nnx.Rngs(0)
        self.config = config
        self.compute_dtype = jnp.dtype(dtype)
        self.model = MixtralModel(config, dtype=dtype, rngs=rngs)
        self.lm_head = None if config.tie_word_embeddings else nnx.Linear(
            config.hidden_size, config.vocab_size, use_bias=False, dtype=dtype, param_dtype=dtype, rngs=rngs)
        self.mesh = None           # tensor parallelism is not implemented for this model
        self.tp_axis = None

    def lora_slices(self) -> dict:
        c = self.config
        return {"qkv_proj": (c.q_size, c.kv_size, c.kv_size)}

    def shard(self, mesh, **_):
        raise NotImplementedError("tensor parallelism is not implemented for MixtralForCausalLM; serve it unsplit")

    def cache_dtype(self):
        """The dtype of the attention's keys and values (jax_lora.models.LlamaForCausalLM.cache_dtype)."""
        return self.compute_dtype

    def cache_sharding(self):
        return None

    def __call__(self, tokens, positions, cache: KVCache | None = None, rows=None, sample_idx=None):
        return causal_lm_step(self, tokens, positions, cache, rows, sample_idx)


# ----------------------------------------------------------------------------- LoRA

def add_lora(model: MixtralForCausalLM, *, max_loras: int, max_rank: int,
             target_modules: Sequence[str] = MIXTRAL_LORA_TARGETS, dtype=None, lora_dtype=None,
             stack_layers: bool = True) -> dict:
    """Replaces the layers `target_modules` names (Hugging Face / PEFT names) by multi-LoRA layers.

    q/k/v_proj select `qkv_proj`; `experts` (or an expert weight's name: `gate_up_proj`,
    `down_proj`, `w1`, `w2`, `w3`, `gate_proj`, `up_proj`) selects every layer's experts
    (jax_lora.nn.MultiLoRAExperts: both projections get slots). lora_dtype="fp8": the dense linear
    layers and the experts store e4m3 adapter weights with per-channel float32 scales (the experts
    per expert and output channel).
    stack_layers (default True): the decoder layers' dense LoRA linears of each kind keep their
    adapter variables in one layer-stacked bank (as the Llama's `add_lora`). Returns {path: layer}.
    """
    if isinstance(target_modules, (str, bytes)) or not isinstance(target_modules, Iterable):
        raise TypeError(f"target_modules must be a list of module names from {MIXTRAL_LORA_TARGETS} (e.g. "
                        f"['q_proj', 'experts']), got {type(target_modules).__name__} {target_modules!r}")
    target_modules = tuple(target_modules)
    allowed = MIXTRAL_LORA_TARGETS + _EXPERT_NAMES
    unknown = [t for t in target_modules if t not in allowed]
    if unknown:
        raise ValueError(f"target_modules {unknown} are not LoRA-targetable Mixtral layers {MIXTRAL_LORA_TARGETS}")
    ours = set()
    for t in target_modules:
        if t in _EXPERT_NAMES:
            ours.add("experts")
        elif t in ("q_proj", "k_proj", "v_proj"):
            ours.add("qkv_proj")
        else:
            ours.add(t)
    if "lm_head" in ours and model.lm_head is None:
        raise ValueError("lm_head is tied to embed_tokens in this model (tie_word_embeddings=True); "
                         "LoRA on a tied lm_head is not supported")
    layers = {}
    dense = sorted(ours - {"experts"})
    if dense:
        layers.update(lnn.replace_lora_layers(model, dense, max_loras=max_loras, max_rank=max_rank,
                                              output_slices=model.lora_slices(), dtype=dtype,
                                              lora_dtype=lora_dtype))
        if stack_layers:
            lnn.stack_lora_layers(model)
    if "experts" in ours:
        for i, layer in enumerate(model.model.layers):
            if isinstance(layer.mlp.experts, lnn.MultiLoRAExperts):
                continue
            layer.mlp.experts = lnn.MultiLoRAExperts(layer.mlp.experts, max_loras=max_loras, max_rank=max_rank,
                                                     dtype=dtype, lora_dtype=lora_dtype)
            layers[f"model.layers.{i}.mlp.experts"] = layer.mlp.experts
    return layers


# ----------------------------------------------------------------------------- checkpoints

def _expert_weights(get, has, p: str, c: MixtralConfig) -> tuple[str, np.ndarray, np.ndarray, np.ndarray]:
    """(router weight name, router (E, H), gate_up (E, H, 2I), down (E, I, H)) of layer prefix `p`
    from whichever layout the checkpoint uses (module docstring)."""
    e, h, i = c.num_local_experts, c.hidden_size, c.intermediate_size
    if has(p + "mlp.experts.gate_up_proj"):
        gu = get(p + "mlp.experts.gate_up_proj", (e, 2 * i, h))
        down = get(p + "mlp.experts.down_proj", (e, h, i))
        return get(p + "mlp.gate.weight", (e, h)), gu.transpose(0, 2, 1), down.transpose(0, 2, 1)
    if has(p + "block_sparse_moe.gate.weight"):
        base, names = p + "block_sparse_moe.", ("w1", "w3", "w2")
    else:
        base, names = p + "mlp.", ("gate_proj", "up_proj", "down_proj")
    router = get(base + "gate.weight", (e, h))
    gate = np.stack([get(f"{base}experts.{k}.{names[0]}.weight", (i, h)) for k in range(e)])
    up = np.stack([get(f"{base}experts.{k}.{names[1]}.weight", (i, h)) for k in range(e)])
    down = np.stack([get(f"{base}experts.{k}.{names[2]}.weight", (h, i)) for k in range(e)])
    return router, np.concatenate([gate, up], axis=1).transpose(0, 2, 1), down.transpose(0, 2, 1)


def load_mixtral(model_dir: str, *, dtype=jnp.float32) -> MixtralForCausalLM:
    """Builds the model from `config.json` and Hugging Face-format safetensors in `model_dir`
    (any expert layout of the module docstring)."""
    cfg = MixtralConfig.from_json(os.path.join(model_dir, "config.json"))
    ckpt = _Checkpoint(model_dir)
    get = ckpt.get
    model = nnx.eval_shape(lambda: MixtralForCausalLM(cfg, dtype=dtype, rngs=nnx.Rngs(0)))

    def put(var, value):
        var.set_value(jnp.asarray(value, dtype))

    c = cfg
    put(model.model.embed_tokens.embedding, get("model.embed_tokens.weight", (c.vocab_size, c.hidden_size)))
    for n, layer in enumerate(model.model.layers):
        p = f"model.layers.{n}."
        at = layer.self_attn
        q = get(p + "self_attn.q_proj.weight", (c.q_size, c.hidden_size))
        k = get(p + "self_attn.k_proj.weight", (c.kv_size, c.hidden_size))
        v = get(p + "self_attn.v_proj.weight", (c.kv_size, c.hidden_size))
        put(at.qkv_proj.kernel, np.concatenate([q, k, v]).T)
        put(at.o_proj.kernel, get(p + "self_attn.o_proj.weight", (c.hidden_size, c.q_size)).T)
        if c.attention_bias:
            put(at.qkv_proj.bias, np.concatenate([get(p + f"self_attn.{m}_proj.bias", (s,)) for m, s in
                                                  (("q", c.q_size), ("k", c.kv_size), ("v", c.kv_size))]))
            put(at.o_proj.bias, get(p + "self_attn.o_proj.bias", (c.hidden_size,)))
        if c.qk_norm:
            put(at.q_norm.weight, get(p + "self_attn.q_norm.weight", (c.head_dim,)))
            put(at.k_norm.weight, get(p + "self_attn.k_norm.weight", (c.head_dim,)))
        router, gate_up, down = _expert_weights(get, ckpt.has, p, c)
        put(layer.mlp.gate.kernel, router.T)
        put(layer.mlp.experts.gate_up_proj, gate_up)
        put(layer.mlp.experts.down_proj, down)
        put(layer.input_layernorm.weight, get(p + "input_layernorm.weight", (c.hidden_size,)))
        put(layer.post_attention_layernorm.weight, get(p + "post_attention_layernorm.weight", (c.hidden_size,)))
    put(model.model.norm.weight, get("model.norm.weight", (c.hidden_size,)))
    if model.lm_head is not None:
        put(model.lm_head.kernel, get("lm_head.weight", (c.vocab_size, c.hidden_size)).T)
    extra = ckpt.unused()
    if extra:
        raise ValueError(f"checkpoint {model_dir} has tensors this Mixtral does not use: {extra[:5]}")
    return model


def save_mixtral(model: MixtralForCausalLM, model_dir: str, *, fused_experts: bool = False) -> None:
    """Writes `config.json` and `model.safetensors` in the Hugging Face layout: Mixtral's per-expert
    `block_sparse_moe.experts.E.w1/w2/w3` (what transformers writes), or with fused_experts=True
    `mlp.experts.gate_up_proj` / `down_proj`."""
    from safetensors.numpy import save_file
    os.makedirs(model_dir, exist_ok=True)
    c = model.config
    out = {}

    def arr(var):
        return np.asarray(var.get_value(), np.float32)

    def base(layer):
        return getattr(layer, "base", layer)

    out["model.embed_tokens.weight"] = arr(base(model.model.embed_tokens).embedding)
    for n, layer in enumerate(model.model.layers):
        p = f"model.layers.{n}."
        qkv = arr(base(layer.self_attn.qkv_proj).kernel).T
        out[p + "self_attn.q_proj.weight"] = qkv[: c.q_size]
        out[p + "self_attn.k_proj.weight"] = qkv[c.q_size: c.q_size + c.kv_size]
        out[p + "self_attn.v_proj.weight"] = qkv[c.q_size + c.kv_size:]
        out[p + "self_attn.o_proj.weight"] = arr(base(layer.self_attn.o_proj).kernel).T
        if c.attention_bias:
            qkv_b = arr(base(layer.self_attn.qkv_proj).bias)
            out[p + "self_attn.q_proj.bias"] = qkv_b[: c.q_size]
            out[p + "self_attn.k_proj.bias"] = qkv_b[c.q_size: c.q_size + c.kv_size]
            out[p + "self_attn.v_proj.bias"] = qkv_b[c.q_size + c.kv_size:]
            out[p + "self_attn.o_proj.bias"] = arr(base(layer.self_attn.o_proj).bias)
        if c.qk_norm:
            out[p + "self_attn.q_norm.weight"] = arr(layer.self_attn.q_norm.weight)
            out[p + "self_attn.k_norm.weight"] = arr(layer.self_attn.k_norm.weight)
        experts = base(layer.mlp.experts)
        gate_up = arr(experts.gate_up_proj).transpose(0, 2, 1)                 # (E, 2I, H)
        down = arr(experts.down_proj).transpose(0, 2, 1)                       # (E, H, I)
        if fused_experts:
            out[p + "mlp.gate.weight"] = arr(layer.mlp.gate.kernel).T
            out[p + "mlp.experts.gate_up_proj"] = gate_up
            out[p + "mlp.experts.down_proj"] = down
        else:
            out[p + "block_sparse_moe.gate.weight"] = arr(layer.mlp.gate.kernel).T
            i = c.intermediate_size
            for e in range(c.num_local_experts):
                out[f"{p}block_sparse_moe.experts.{e}.w1.weight"] = gate_up[e, :i]
                out[f"{p}block_sparse_moe.experts.{e}.w3.weight"] = gate_up[e, i:]
                out[f"{p}block_sparse_moe.experts.{e}.w2.weight"] = down[e]
        out[p + "input_layernorm.weight"] = arr(layer.input_layernorm.weight)
        out[p + "post_attention_layernorm.weight"] = arr(layer.post_attention_layernorm.weight)
    out["model.norm.weight"] = arr(model.model.norm.weight)
    if model.lm_head is not None:
        out["lm_head.weight"] = arr(base(model.lm_head).kernel).T
    save_file({k: np.ascontiguousarray(v) for k, v in out.items()}, os.path.join(model_dir, "model.safetensors"),
              metadata={"format": "pt"})
    with open(os.path.join(model_dir, "config.json"), "w") as f:
        json.dump(c.to_dict(), f, indent=2)

