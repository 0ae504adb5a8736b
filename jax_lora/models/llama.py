"""A Llama-style decoder in Flax NNX with a KV cache, loading Hugging Face-format checkpoints.

Module names follow the Hugging Face layout (`model.layers.3.self_attn...`) except that q/k/v and
gate/up are fused (`qkv_proj`, `gate_up_proj`), as vLLM does: `packed_modules_mapping` says which
Hugging Face (and PEFT) names live in which slice, so adapters for `q_proj` and `v_proj` land in
slices 0 and 2 of `qkv_proj` (GQA: the slices have unequal widths).

Math is Hugging Face's LlamaForCausalLM (RMSNorm, rotate-half RoPE, GQA, SiLU MLP) in float32
accumulation (attention reads a 16-bit cache as it is and rounds its probabilities to that dtype
for the product with the values, as flash attention does). Attention runs cuDNN's fused attention
on a CUDA GPU with a 16-bit cache (unless the model is split over a mesh), XLA's elsewhere
(`jax_lora.models.attention`, `JAX_LORA_ATTENTION`). Rope scaling variants are not implemented (a clear
error says so).

KV cache: one (k, v) pair per layer, each (rows, max_len, kv_heads, head_dim). A step writes its
tokens' keys/values at (row, position) and attends, per query, to the row's positions <= its own.
Writes to a row index < 0 or >= rows (padding) are dropped; nothing is ever read out of bounds. A
prefill step (S > 1) also zeroes its rows' positions past its last one, so what an earlier request
left in a row (NaN or Inf included) never reaches the next one's results.

Tensor parallelism (`model.shard(mesh)`, `load_llama(..., mesh=mesh)`): `tp_plan()` names each
layer's kind for jax_lora.parallel: qkv_proj and gate_up_proj column-parallel (each slice split on
its own, stored shard-major: attention and MLP split their outputs with `parallel.split_fused`),
o_proj and down_proj row-parallel, embed_tokens and lm_head split along the vocabulary. Multi-LoRA
layers run per device with their layout's collectives; the rest (norms, RoPE, attention, plain
layers) is partitioned by XLA from the weights' shardings. The KV cache is split along the KV
heads when the device count divides them (`cache_sharding`), replicated otherwise.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Iterable, Sequence
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from .. import nn as lnn
from .. import parallel, quant
from ..ops.api import _on_host
from .attention import decode_attention, prefill_attention

__all__ = [
    "HF_LORA_TARGETS",
    "KVCache",
    "LlamaConfig",
    "LlamaForCausalLM",
    "add_lora",
    "init_cache",
    "load_llama",
    "save_llama",
    "use_fused_lora",
]

HF_LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
                   "embed_tokens", "lm_head")


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    """The Hugging Face LlamaConfig fields this model reads (frozen: it is static in the jit key)."""

    vocab_size: int = 32000
    hidden_size: int = 4096
    intermediate_size: int = 11008
    num_hidden_layers: int = 32
    num_attention_heads: int = 32
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    bos_token_id: int | None = 1
    eos_token_id: int | None = 2

    def __post_init__(self):
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                     "max_position_embeddings"):
            _positive_int_field(name, getattr(self, name))
        for name in ("num_key_value_heads", "head_dim"):
            if getattr(self, name) is not None:
                _positive_int_field(name, getattr(self, name))
        for name in ("rms_norm_eps", "rope_theta"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
                raise ValueError(f"LlamaConfig.{name} must be a positive finite number, got {value!r}")
        for name in ("tie_word_embeddings", "attention_bias", "mlp_bias"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"LlamaConfig.{name} must be true or false, got {getattr(self, name)!r}")
        if self.num_key_value_heads is None:
            object.__setattr__(self, "num_key_value_heads", self.num_attention_heads)
        if self.head_dim is None:
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_attention_heads)
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_attention_heads={self.num_attention_heads} must be a multiple of "
                             f"num_key_value_heads={self.num_key_value_heads}")

    @classmethod
    def from_dict(cls, d: dict) -> LlamaConfig:
        if not isinstance(d, dict):
            raise ValueError(f"a Llama config must be a JSON object, got {type(d).__name__}")
        scaling = d.get("rope_scaling")
        if scaling is not None and not isinstance(scaling, dict):
            raise ValueError(f"rope_scaling must be null or an object, got {scaling!r}")
        if scaling not in (None, {}) and (scaling.get("rope_type", scaling.get("type")) not in (None, "default")):
            raise NotImplementedError(f"rope_scaling {scaling!r} is not supported by jax_lora's Llama")
        if d.get("hidden_act", "silu") != "silu":
            raise NotImplementedError(f"hidden_act {d['hidden_act']!r} is not supported (silu only)")
        rope_theta = d.get("rope_theta", (d.get("rope_parameters") or {}).get("rope_theta", 10000.0))
        names = {f.name for f in dataclasses.fields(cls)}
        kwargs = {k: v for k, v in d.items() if k in names}
        kwargs["rope_theta"] = float(rope_theta)
        return cls(**kwargs)

    @classmethod
    def from_json(cls, path: str) -> LlamaConfig:
        with open(path) as f:
            return cls.from_dict(json.load(f))

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d.update(model_type="llama", architectures=["LlamaForCausalLM"], hidden_act="silu",
                 torch_dtype="float32", rope_scaling=None)
        return d

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim


def _positive_int_field(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"LlamaConfig.{name} must be an int >= 1, got {value!r}")


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class KVCache:
    """Per layer keys and values, each (rows, max_len, kv_heads, head_dim)."""

    k: tuple
    v: tuple


def init_cache(config: LlamaConfig, rows: int, max_len: int, dtype=jnp.float32, sharding=None) -> KVCache:
    """Zeroed keys and values, per layer (rows, max_len, kv_heads, head_dim), placed with `sharding`
    (e.g. `model.cache_sharding()`) when given."""
    shape = (rows, max_len, config.num_key_value_heads, config.head_dim)
    n = config.num_hidden_layers
    zeros = (lambda: jnp.zeros(shape, dtype)) if sharding is None else (
        lambda: jax.device_put(np.zeros(shape, dtype), sharding))
    return KVCache(tuple(zeros() for _ in range(n)), tuple(zeros() for _ in range(n)))


def _rope(x: jax.Array, positions: jax.Array, theta: float) -> jax.Array:
    """Hugging Face's rotate-half RoPE. x (B, S, heads, d); positions (B, S)."""
    d = x.shape[-1]
    inv_freq = 1.0 / (theta ** (jnp.arange(0, d, 2, dtype=jnp.float32) / d))
    freqs = positions.astype(jnp.float32)[..., None] * inv_freq          # (B, S, d/2)
    emb = jnp.concatenate([freqs, freqs], axis=-1)[:, :, None, :]         # (B, S, 1, d)
    cos, sin = jnp.cos(emb), jnp.sin(emb)
    xf = x.astype(jnp.float32)
    rot = jnp.concatenate([-xf[..., d // 2:], xf[..., : d // 2]], axis=-1)
    return (xf * cos + rot * sin).astype(x.dtype)


class LlamaAttention(nnx.Module):
    def __init__(self, cfg: LlamaConfig, *, dtype, rngs: nnx.Rngs):
        self.cfg = cfg
        self.qkv_proj = nnx.Linear(cfg.hidden_size, cfg.q_size + 2 * cfg.kv_size, use_bias=cfg.attention_bias,
                                   dtype=dtype, param_dtype=dtype, rngs=rngs)
        self.o_proj = nnx.Linear(cfg.q_size, cfg.hidden_size, use_bias=cfg.attention_bias, dtype=dtype,
                                 param_dtype=dtype, rngs=rngs)
        self.fused_shards = 1      # devices qkv_proj's columns are split over (shard-major order)
        if getattr(cfg, "qk_norm", False):     # Qwen3's RMSNorm of each head's q and k before RoPE
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, dtype=dtype)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, dtype=dtype)

    def __call__(self, x, positions, kv=None, rows=None, norm=None):
        """x (B, S, H): the normed hidden states, or with `norm` (an RMSNorm) the residual stream
        that norm(x) is taken of (`normed_linear`: the fused "norm" LoRA path computes the two
        together)."""
        cfg = self.cfg
        b, s, _ = x.shape
        nh, nkv, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        q, k, v = parallel.split_fused(normed_linear(norm, self.qkv_proj, x), (cfg.q_size, cfg.kv_size, cfg.kv_size),
                                       self.fused_shards)
        q, k, v = q.reshape(b, s, nh, hd), k.reshape(b, s, nkv, hd), v.reshape(b, s, nkv, hd)
        if getattr(cfg, "qk_norm", False):
            q, k = self.q_norm(q), self.k_norm(k)
        q = _rope(q, positions, cfg.rope_theta)
        k = _rope(k, positions, cfg.rope_theta)
        if kv is None:                     # no cache: attend within the sequence (causal)
            keys, values, key_pos = k, v, positions                          # (B, M, ...), (B, M)
        else:
            k_cache, v_cache = kv
            n_rows, max_len = k_cache.shape[:2]
            if rows is None and n_rows < b:
                raise ValueError(f"rows=None reads cache rows 0..{b - 1}, but the cache has {n_rows} rows")
            if rows is not None:           # a negative row is padding too (no wrap-around into the last rows)
                rows = jnp.where(rows < 0, n_rows, rows)
            r = (jnp.arange(b, dtype=jnp.int32) if rows is None else rows)[:, None]
            if s > 1:
                # A prefill starts (or continues) a request in its rows: positions past the step's
                # last hold no value of this request yet. They are zeroed, so that what a previous
                # request left there (NaN or Inf included) never meets this request's masked-out
                # probabilities (0 x NaN = NaN) in this step or its decode steps.
                stale = jnp.arange(max_len, dtype=jnp.int32)[None, :] > positions.max(axis=1)[:, None]   # (B, M)
                safe = jnp.minimum(r[:, 0], n_rows - 1)
                k_cache = k_cache.at[r[:, 0]].set(jnp.where(stale[:, :, None, None], 0, k_cache[safe]), mode="drop")
                v_cache = v_cache.at[r[:, 0]].set(jnp.where(stale[:, :, None, None], 0, v_cache[safe]), mode="drop")
            # Write first, then read: a query at position p only reads positions <= p, all written by
            # this request (prompt now or earlier steps). Padding rows (row >= n_rows) are dropped.
            k_cache = k_cache.at[r, positions].set(k.astype(k_cache.dtype), mode="drop")
            v_cache = v_cache.at[r, positions].set(v.astype(v_cache.dtype), mode="drop")
            if rows is None:               # rows 0..B-1: read the cache in place, no gather
                keys, values = (k_cache, v_cache) if n_rows == b else (k_cache[:b], v_cache[:b])
            else:
                safe_rows = jnp.minimum(rows, n_rows - 1)
                keys, values = k_cache[safe_rows], v_cache[safe_rows]         # (B, M, nkv, hd)
            key_pos = jnp.broadcast_to(jnp.arange(max_len, dtype=jnp.int32), (b, max_len))
            kv = (k_cache, v_cache)
        split = self.fused_shards > 1
        if s == 1 and kv is not None:
            return self.o_proj(decode_attention(q, keys, values, key_pos, positions, x.dtype, split)), kv
        return self.o_proj(prefill_attention(q, keys, values, key_pos, positions, x.dtype, split)), kv


class LlamaMLP(nnx.Module):
    def __init__(self, cfg: LlamaConfig, *, dtype, rngs: nnx.Rngs):
        self.intermediate_size = cfg.intermediate_size
        self.gate_up_proj = nnx.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, use_bias=cfg.mlp_bias,
                                       dtype=dtype, param_dtype=dtype, rngs=rngs)
        self.down_proj = nnx.Linear(cfg.intermediate_size, cfg.hidden_size, use_bias=cfg.mlp_bias,
                                    dtype=dtype, param_dtype=dtype, rngs=rngs)
        self.fused_shards = 1      # devices gate_up_proj's columns are split over (shard-major order)

    def __call__(self, x, norm=None):
        """x (B, S, H): the normed hidden states, or with `norm` the residual stream (as the attention's)."""
        i = self.intermediate_size
        gate, up = parallel.split_fused(normed_linear(norm, self.gate_up_proj, x), (i, i), self.fused_shards)
        return self.down_proj(jax.nn.silu(gate) * up)


class RMSNorm(nnx.Module):
    """Hugging Face's LlamaRMSNorm: normalise in float32, then scale by `weight`."""

    def __init__(self, dim: int, eps: float, *, dtype):
        self.eps = eps
        self.weight = nnx.Param(jnp.ones((dim,), dtype))

    def __call__(self, x):
        xf = x.astype(jnp.float32)
        xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
        return self.weight.get_value() * xf.astype(x.dtype)


def normed_linear(norm: RMSNorm | None, proj, x):
    """proj(norm(x)) (proj(x) without a norm). A multi-LoRA layer on its fused "norm" path, with a
    wrapper installed, computes the whole in two kernels (`jax_lora.nn.MultiLoRALinear.norm_linear`:
    the norm with the LoRA shrink, the GEMM with the expand)."""
    if norm is None:
        return proj(x)
    if isinstance(proj, lnn.MultiLoRALinear):
        y = proj.norm_linear(x, norm.weight.get_value(), norm.eps)
        if y is not None:
            return y
    return proj(norm(x))


class LlamaDecoderLayer(nnx.Module):
    """Pre-norm attention and MLP blocks with residuals; `MLP` builds the feed-forward block (the
    Mixtral's layer is this one with its sparse MoE block)."""

    MLP = LlamaMLP

    def __init__(self, cfg: LlamaConfig, *, dtype, rngs: nnx.Rngs):
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype)
        self.self_attn = LlamaAttention(cfg, dtype=dtype, rngs=rngs)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype)
        self.mlp = self.MLP(cfg, dtype=dtype, rngs=rngs)

    def __call__(self, x, positions, kv=None, rows=None):
        h, kv = self.self_attn(x, positions, kv, rows, norm=self.input_layernorm)
        x = x + h
        if isinstance(self.mlp, LlamaMLP):          # its gate_up may compute the norm (normed_linear)
            return x + self.mlp(x, norm=self.post_attention_layernorm), kv
        return x + self.mlp(self.post_attention_layernorm(x)), kv


class LlamaModel(nnx.Module):
    def __init__(self, cfg: LlamaConfig, *, dtype, rngs: nnx.Rngs):
        self.embed_tokens = nnx.Embed(cfg.vocab_size, cfg.hidden_size, dtype=dtype, param_dtype=dtype,
                                      rngs=rngs)
        self.layers = nnx.List([LlamaDecoderLayer(cfg, dtype=dtype, rngs=rngs)
                                for _ in range(cfg.num_hidden_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype)


class LlamaForCausalLM(nnx.Module):
    """Llama decoder + LM head.

    __call__(tokens (B, S) int32, positions (B, S) int32, cache=None, rows=None, sample_idx=None)
      -> (logits, cache). With `sample_idx` (B,) the logits are (B, V) at those positions (the
      sampled rows: the LoRA LM head is indexed per sampled row); without, (B, S, V) at every
      position. With `cache` (a KVCache) and `rows` (B,) the step reads and writes cache rows;
      rows=None means rows 0..B-1, read in place (no gather of the batch's rows: the fast path
      when the batch fills the cache's first rows).

    Token ids must be in [0, vocab_size) and sample_idx in [0, S). Values the host holds (NumPy,
    lists, concrete arrays on the CPU) are checked: a ValueError names the argument, the range and
    the value. Under jit, or on an accelerator (reading them would be a host sync), they are not:
    an id outside the range is clamped to it (it reads the nearest row of the embedding, never out
    of bounds or NaN), and so is a sample_idx (the nearest position of its row).
    """

    packed_modules_mapping: ClassVar[dict] = {"qkv_proj": ("q_proj", "k_proj", "v_proj"),
                                              "gate_up_proj": ("gate_proj", "up_proj")}

    def __init__(self, config: LlamaConfig, *, dtype=jnp.float32, rngs: nnx.Rngs | None = None):
        rngs = rngs if rngs is not None else nnx.Rngs(0)
        self.config = config
        self.compute_dtype = jnp.dtype(dtype)   # the layers' parameter and activation dtype
        self.model = LlamaModel(config, dtype=dtype, rngs=rngs)
        self.lm_head = None if config.tie_word_embeddings else nnx.Linear(
            config.hidden_size, config.vocab_size, use_bias=False, dtype=dtype, param_dtype=dtype, rngs=rngs)
        self.mesh = None           # the jax.sharding.Mesh after `shard`
        self.tp_axis = None

    def lora_slices(self) -> dict:
        c = self.config
        return {"qkv_proj": (c.q_size, c.kv_size, c.kv_size),
                "gate_up_proj": (c.intermediate_size, c.intermediate_size)}

    def tp_plan(self) -> dict:
        """{layer name: (jax_lora.parallel kind, output slices or None)} of the tensor-parallel split."""
        slices = self.lora_slices()
        return {"qkv_proj": ("column", slices["qkv_proj"]), "gate_up_proj": ("column", slices["gate_up_proj"]),
                "o_proj": ("row", None), "down_proj": ("row", None), "embed_tokens": ("embed", None),
                "lm_head": ("logits", None)}

    def shard(self, mesh, *, axis: str = "tp", tokens: int = 64, layouts=None) -> dict:
        """Splits the model over `axis` of `mesh` (tensor parallelism), in place; returns
        {layer path: layout, or "plain" for a layer without adapters} for the layers split now.

        Multi-LoRA layers added later (`add_lora`) are split when they are added. Layer-stacked
        LoRA banks (`add_lora`'s stack_layers) are first given back to the layers (per-layer
        variables, `jax_lora.parallel.shard_model`), which are split one by one. `tokens`: the
        step size the byte model picks each multi-LoRA layer's layout for (`parallel.choose_layout`);
        `layouts` ({path or layer name: layout}) overrides it. Raises ValueError when a size is not
        divisible by the device count, or when the model is already split over another mesh.
        """
        if quant.quantized_layers(self):
            raise NotImplementedError("a model with quantized layers (quantize=...) cannot be split over a mesh: "
                                      "serve it on one device, or split the float model")
        if self.mesh is not None and (self.mesh != mesh or self.tp_axis != axis):
            raise ValueError(f"the model is already split over axis {self.tp_axis!r} of another mesh "
                             f"{dict(self.mesh.shape)}; load it again to split it differently")
        n = int(mesh.shape[axis]) if axis in mesh.shape else None
        if n is None:
            raise ValueError(f"axis {axis!r} is not an axis of the mesh {dict(mesh.shape)}")
        c = self.config
        if c.num_attention_heads % n:
            raise ValueError(f"num_attention_heads={c.num_attention_heads} must be divisible by the {n} devices "
                             f"of axis {axis!r}")
        done = parallel.shard_model(self, mesh, self.tp_plan(), axis=axis, tokens=tokens, layouts=layouts)
        self.mesh, self.tp_axis = mesh, axis
        for layer in self.model.layers:
            layer.self_attn.fused_shards = n
            layer.mlp.fused_shards = n
        return done

    def cache_dtype(self):
        """The dtype the attention writes its keys and values in (the q/k/v projection's): a cache of
        this dtype stores them as computed (a 16-bit model gets a 16-bit cache, half the memory of a
        float32 one, and cuDNN's attention)."""
        return self.compute_dtype

    def cache_sharding(self):
        """The KV cache arrays' NamedSharding on the model's mesh (split along the KV heads when the
        device count divides them, replicated otherwise), or None for an unsplit model."""
        if self.mesh is None:
            return None
        n = int(self.mesh.shape[self.tp_axis])
        split = self.config.num_key_value_heads % n == 0
        spec = jax.sharding.PartitionSpec(None, None, self.tp_axis) if split else jax.sharding.PartitionSpec()
        return jax.sharding.NamedSharding(self.mesh, spec)

    def __call__(self, tokens, positions, cache: KVCache | None = None, rows=None, sample_idx=None):
        return causal_lm_step(self, tokens, positions, cache, rows, sample_idx)


def _check_host_range(name: str, values, stop: int, what: str) -> None:
    """Refuses values outside [0, stop) when the host holds them (NumPy, Python numbers or lists, a
    concrete jax.Array on the CPU); no-op for tracers and accelerator arrays."""
    if isinstance(values, (list, tuple, int, np.integer)):
        values = np.asarray(values)
    if not _on_host(values):
        return
    v = np.asarray(values)
    if v.size and (v.min() < 0 or v.max() >= stop):
        bad = v.min() if v.min() < 0 else v.max()
        raise ValueError(f"{name} must be in [0, {stop}) ({what}), got {bad}")


# ----------------------------------------------------------------------------- LoRA

def add_lora(model: LlamaForCausalLM, *, max_loras: int, max_rank: int,
             target_modules: Sequence[str] = HF_LORA_TARGETS, dtype=None, dora: bool = False,
             lora_dtype=None, fused=None, stack_layers: bool = True) -> dict:
    """Replaces the layers that `target_modules` (Hugging Face / PEFT names) name by multi-LoRA layers.

    q/k/v_proj select `qkv_proj`, gate/up_proj select `gate_up_proj` (all slices get slots; an
    adapter that targets only some of them has zeros in the others). dora=True: the linear layers
    hold DoRA column scales from the start; without it a layer gets its scale when the first
    use_dora adapter reaches it (MultiLoRALinear.enable_dora: a new variable, so one recompilation
    of a jitted step). lora_dtype="fp8": the linear layers store e4m3 adapter weights with per-channel
    float32 scales (jax_lora.nn.MultiLoRALinear). fused: None (default), "gemm", "norm" or "auto": the
    decoder's LoRA linears take the fused path (`use_fused_lora`). stack_layers (default True): the
    decoder layers' LoRA linears of each projection kind keep their adapter variables in one
    layer-stacked bank (`jax_lora.nn.stack_lora_layers`, jax_lora.lora_bank: a jitted step takes
    O(kinds) adapter arrays, not O(layers x kinds)); a model split over a mesh keeps per-layer
    variables. Returns {path: layer}.
    """
    if isinstance(target_modules, (str, bytes)) or not isinstance(target_modules, Iterable):
        raise TypeError(f"target_modules must be a list of module names from {HF_LORA_TARGETS} (e.g. "
                        f"['q_proj', 'v_proj']), got {type(target_modules).__name__} {target_modules!r}")
    target_modules = tuple(target_modules)       # an iterator is read more than once below
    unknown = [t for t in target_modules if t not in HF_LORA_TARGETS]
    if unknown:
        raise ValueError(f"target_modules {unknown} are not LoRA-targetable Llama layers {HF_LORA_TARGETS}")
    ours = set()
    for t in target_modules:
        packed = [p for p, subs in model.packed_modules_mapping.items() if t in subs]
        ours.add(packed[0] if packed else t)
    if "lm_head" in ours and model.lm_head is None:
        raise ValueError("lm_head is tied to embed_tokens in this model (tie_word_embeddings=True); "
                         "LoRA on a tied lm_head is not supported")
    layers = lnn.replace_lora_layers(model, sorted(ours), max_loras=max_loras, max_rank=max_rank,
                                     output_slices=model.lora_slices(), dtype=dtype, dora=dora,
                                     lora_dtype=lora_dtype)
    if model.mesh is not None:         # a split model: the new layers are split the same way
        model.shard(model.mesh, axis=model.tp_axis)
    elif stack_layers:
        lnn.stack_lora_layers(model)
    if fused is not None:
        use_fused_lora(model, fused)
    return layers


def use_fused_lora(model: LlamaForCausalLM, mode) -> list:
    """Sets the fused LoRA path of the decoder's multi-LoRA linears (jax_lora.nn.MultiLoRALinear.use_fused).

    mode None: off (the base product, then the wrapper's add_lora_linear). "gemm": every LoRA
    linear (qkv, o, gate_up, down) is the wrapper's shrink, then one Triton GEMM with the expand in
    its epilogue (jax_lora.ops.fused_linear.gemm_lora) over a transposed copy of its base kernel.
    "norm": the same, and qkv_proj and gate_up_proj also take the RMSNorm in front of them into
    the shrink (rms_norm_shrink: no LoRA kernel between the norm and the GEMM); o and down stay
    "gemm". "auto": "norm" for the qkv_proj / gate_up_proj calls the device's tuned fused linear
    table marks `use_norm_fused` (by layer shape, token count and rank:
    lora_core.kernels.fused_linear_configs.use_norm_fused_linear), else "gemm" for the calls it
    marks fused (`use_fused_linear`), the unfused path for the others. Embeddings and the LM head
    are unchanged. Returns the paths of the layers it changed. Refused (ValueError naming the
    layer): a split model, and what `use_fused` refuses.
    """
    if mode not in lnn.FUSED_MODES:
        raise ValueError(f"fused must be one of {lnn.FUSED_MODES} (None: off), got {mode!r}")
    if mode is not None and model.mesh is not None:
        raise ValueError("fused LoRA linears are not supported on a model split over a mesh")
    changed = []
    for i, layer in enumerate(model.model.layers):
        for path, parent, name in ((f"model.layers.{i}.self_attn.qkv_proj", layer.self_attn, "qkv_proj"),
                                   (f"model.layers.{i}.self_attn.o_proj", layer.self_attn, "o_proj"),
                                   (f"model.layers.{i}.mlp.gate_up_proj", layer.mlp, "gate_up_proj"),
                                   (f"model.layers.{i}.mlp.down_proj", layer.mlp, "down_proj")):
            proj = getattr(parent, name, None)
            if not isinstance(proj, lnn.MultiLoRALinear):
                continue
            want = "gemm" if mode == "norm" and name in ("o_proj", "down_proj") else mode
            try:
                if proj.use_fused(want):
                    changed.append(path)
            except ValueError as e:
                raise ValueError(f"{path}: {e}") from e
    return changed


# ----------------------------------------------------------------------------- checkpoints

def _read_safetensors_dir(model_dir: str) -> dict:
    from safetensors.numpy import load_file
    index = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    elif os.path.exists(os.path.join(model_dir, "model.safetensors")):
        files = ["model.safetensors"]
    else:
        raise FileNotFoundError(f"{model_dir} has no model.safetensors or model.safetensors.index.json "
                                "(only safetensors checkpoints are loaded; pickled .bin files are refused)")
    out = {}
    for fn in files:
        out.update(load_file(os.path.join(model_dir, fn)))
    return out


class _Checkpoint:
    """A Hugging Face safetensors checkpoint (`_read_safetensors_dir`): `get(name, shape)` reads a
    tensor as float32, checked against the shape config.json implies; `unused()` names the tensors
    no `get` took (a tied lm_head and RoPE's inv_freq buffers aside)."""

    def __init__(self, model_dir: str):
        self.model_dir = model_dir
        self.weights = _read_safetensors_dir(model_dir)
        self.used: set = set()

    def has(self, name: str) -> bool:
        return name in self.weights

    def get(self, name: str, shape) -> np.ndarray:
        if name not in self.weights:
            raise ValueError(f"checkpoint {self.model_dir} lacks tensor {name!r}")
        w = self.weights[name]
        if tuple(w.shape) != tuple(shape):
            raise ValueError(f"checkpoint tensor {name!r} has shape {tuple(w.shape)}, expected {tuple(shape)} "
                             "from config.json")
        self.used.add(name)
        return np.asarray(w, np.float32)

    def unused(self) -> list:
        extra = sorted(set(self.weights) - self.used - {"lm_head.weight"})
        return [e for e in extra if "rotary_emb.inv_freq" not in e]


def load_llama(model_dir: str, *, dtype=jnp.float32, mesh=None, tp_axis: str = "tp",
               quantize: str | None = None) -> LlamaForCausalLM:
    """Builds the model from `config.json` and Hugging Face-format safetensors in `model_dir`;
    with `mesh`, split over its `tp_axis` (`LlamaForCausalLM.shard`).

    quantize: None (float layers in `dtype`), "int8" or "fp8": the decoder's linears are quantized
    while loading (`jax_lora.quant.QuantizedLinear`, activations in `dtype`), each from its float32
    host copy, so the device never holds the model's float linears. Not with `mesh`.
    """
    if quantize is not None:
        quant._check_quantize(quantize)
        if mesh is not None:
            raise NotImplementedError("load_llama: quantize= with mesh= is not supported (quantized layers are "
                                      "served on one device)")
    cfg = LlamaConfig.from_json(os.path.join(model_dir, "config.json"))
    ckpt = _Checkpoint(model_dir)
    get = ckpt.get
    model = nnx.eval_shape(lambda: LlamaForCausalLM(cfg, dtype=dtype, rngs=nnx.Rngs(0)))

    def put(var, value):
        var.set_value(jnp.asarray(value, dtype))

    def put_linear(parent, attr, kernel, bias=None):
        """Sets the float kernel (in, out) (and bias) of parent.attr, or, with quantize, replaces the
        layer by its quantized twin."""
        if quantize is None:
            put(getattr(parent, attr).kernel, kernel)
            if bias is not None:
                put(getattr(parent, attr).bias, bias)
        else:
            setattr(parent, attr, quant.QuantizedLinear.from_kernel(kernel, bias, quantize=quantize, dtype=dtype))

    c = cfg
    put(model.model.embed_tokens.embedding, get("model.embed_tokens.weight", (c.vocab_size, c.hidden_size)))
    for i, layer in enumerate(model.model.layers):
        p = f"model.layers.{i}."
        at = layer.self_attn
        q = get(p + "self_attn.q_proj.weight", (c.q_size, c.hidden_size))
        k = get(p + "self_attn.k_proj.weight", (c.kv_size, c.hidden_size))
        v = get(p + "self_attn.v_proj.weight", (c.kv_size, c.hidden_size))
        qkv_bias = o_bias = gu_bias = down_bias = None
        if c.attention_bias:
            qkv_bias = np.concatenate([get(p + f"self_attn.{n}_proj.bias", (s,)) for n, s in
                                       (("q", c.q_size), ("k", c.kv_size), ("v", c.kv_size))])
            o_bias = get(p + "self_attn.o_proj.bias", (c.hidden_size,))
        put_linear(at, "qkv_proj", np.concatenate([q, k, v]).T, qkv_bias)
        put_linear(at, "o_proj", get(p + "self_attn.o_proj.weight", (c.hidden_size, c.q_size)).T, o_bias)
        g = get(p + "mlp.gate_proj.weight", (c.intermediate_size, c.hidden_size))
        u = get(p + "mlp.up_proj.weight", (c.intermediate_size, c.hidden_size))
        if c.mlp_bias:
            gu_bias = np.concatenate([get(p + "mlp.gate_proj.bias", (c.intermediate_size,)),
                                      get(p + "mlp.up_proj.bias", (c.intermediate_size,))])
            down_bias = get(p + "mlp.down_proj.bias", (c.hidden_size,))
        put_linear(layer.mlp, "gate_up_proj", np.concatenate([g, u]).T, gu_bias)
        put_linear(layer.mlp, "down_proj", get(p + "mlp.down_proj.weight", (c.hidden_size, c.intermediate_size)).T,
                   down_bias)
        put(layer.input_layernorm.weight, get(p + "input_layernorm.weight", (c.hidden_size,)))
        put(layer.post_attention_layernorm.weight, get(p + "post_attention_layernorm.weight", (c.hidden_size,)))
    put(model.model.norm.weight, get("model.norm.weight", (c.hidden_size,)))
    if model.lm_head is not None:
        put(model.lm_head.kernel, get("lm_head.weight", (c.vocab_size, c.hidden_size)).T)
    extra = ckpt.unused()
    if extra:
        raise ValueError(f"checkpoint {model_dir} has tensors this Llama does not use: {extra[:5]}")
    if mesh is not None:
        model.shard(mesh, axis=tp_axis)
    return model


def save_llama(model: LlamaForCausalLM, model_dir: str) -> None:
    """Writes `config.json` and `model.safetensors` in the Hugging Face layout (unfused q/k/v etc.)."""
    from safetensors.numpy import save_file
    quantized = quant.quantized_layers(model)
    if quantized:
        raise ValueError("save_llama writes float checkpoints; this model has quantized layers "
                         f"({sorted(quantized)[:2]} ...): save the model before quantizing it")
    os.makedirs(model_dir, exist_ok=True)
    c = model.config
    out = {}

    def arr(var):
        return np.asarray(var.get_value(), np.float32)

    def base(layer):  # the plain layer under a multi-LoRA wrapper
        return getattr(layer, "base", layer)

    shards = 1 if model.mesh is None else int(model.mesh.shape[model.tp_axis])

    def fused(var, slices):  # a split fused layer stores its columns shard-major
        return parallel.natural_columns(arr(var), slices, shards) if shards > 1 else arr(var)

    qkv_slices, gu_slices = model.lora_slices()["qkv_proj"], model.lora_slices()["gate_up_proj"]

    out["model.embed_tokens.weight"] = arr(base(model.model.embed_tokens).embedding)
    for i, layer in enumerate(model.model.layers):
        p = f"model.layers.{i}."
        qkv = fused(base(layer.self_attn.qkv_proj).kernel, qkv_slices).T
        out[p + "self_attn.q_proj.weight"] = qkv[: c.q_size]
        out[p + "self_attn.k_proj.weight"] = qkv[c.q_size: c.q_size + c.kv_size]
        out[p + "self_attn.v_proj.weight"] = qkv[c.q_size + c.kv_size:]
        out[p + "self_attn.o_proj.weight"] = arr(base(layer.self_attn.o_proj).kernel).T
        gu = fused(base(layer.mlp.gate_up_proj).kernel, gu_slices).T
        out[p + "mlp.gate_proj.weight"] = gu[: c.intermediate_size]
        out[p + "mlp.up_proj.weight"] = gu[c.intermediate_size:]
        out[p + "mlp.down_proj.weight"] = arr(base(layer.mlp.down_proj).kernel).T
        if c.attention_bias:
            qkv_b = fused(base(layer.self_attn.qkv_proj).bias, qkv_slices)
            out[p + "self_attn.q_proj.bias"] = qkv_b[: c.q_size]
            out[p + "self_attn.k_proj.bias"] = qkv_b[c.q_size: c.q_size + c.kv_size]
            out[p + "self_attn.v_proj.bias"] = qkv_b[c.q_size + c.kv_size:]
            out[p + "self_attn.o_proj.bias"] = arr(base(layer.self_attn.o_proj).bias)
        if c.mlp_bias:
            gu_b = fused(base(layer.mlp.gate_up_proj).bias, gu_slices)
            out[p + "mlp.gate_proj.bias"] = gu_b[: c.intermediate_size]
            out[p + "mlp.up_proj.bias"] = gu_b[c.intermediate_size:]
            out[p + "mlp.down_proj.bias"] = arr(base(layer.mlp.down_proj).bias)
        out[p + "input_layernorm.weight"] = arr(layer.input_layernorm.weight)
        out[p + "post_attention_layernorm.weight"] = arr(layer.post_attention_layernorm.weight)
    out["model.norm.weight"] = arr(model.model.norm.weight)
    if model.lm_head is not None:
        out["lm_head.weight"] = arr(base(model.lm_head).kernel).T
    save_file({k: np.ascontiguousarray(v) for k, v in out.items()}, os.path.join(model_dir, "model.safetensors"),
              metadata={"format": "pt"})
    with open(os.path.join(model_dir, "config.json"), "w") as f:
        json.dump(c.to_dict(), f, indent=2)


def causal_lm_step(lm, tokens, positions, cache: KVCache | None = None, rows=None, sample_idx=None):
    """One step of a decoder-only model holding `config`, `model.embed_tokens`, `model.layers`
    (each `layer(x, positions, kv, rows) -> (x, kv)`), `model.norm` and `lm_head` (None: the tied
    embedding): (logits (B, V) or (B, S, V) float32, the new KVCache or None). The Llama's and the
    Mixtral's `__call__`."""
    vocab = lm.config.vocab_size
    s = np.shape(tokens)[1]
    _check_host_range("tokens", tokens, vocab, f"token ids, vocab_size = {vocab}")
    if sample_idx is not None:
        _check_host_range("sample_idx", sample_idx, s, f"a position of the step's S = {s}")
    # nnx.Embed's lookup fills an out-of-range id's row with NaN; clamped, every read is in bounds.
    x = lm.model.embed_tokens(jnp.clip(jnp.asarray(tokens), 0, vocab - 1))
    new_k, new_v = [], []
    for i, layer in enumerate(lm.model.layers):
        kv = None if cache is None else (cache.k[i], cache.v[i])
        x, kv = layer(x, positions, kv, rows)
        if cache is not None:
            new_k.append(kv[0])
            new_v.append(kv[1])
    x = lm.model.norm(x)
    if sample_idx is not None:
        idx = jnp.clip(jnp.asarray(sample_idx).astype(jnp.int32), 0, s - 1)
        x = jnp.take_along_axis(x, idx[:, None, None], axis=1)[:, 0]
    logits = lm.model.embed_tokens.attend(x) if lm.lm_head is None else lm.lm_head(x)
    return logits.astype(jnp.float32), (None if cache is None else KVCache(tuple(new_k), tuple(new_v)))
