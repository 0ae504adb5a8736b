"""Attention of the Llama model (`jax_lora.models.llama`): one query per row against the KV cache
(decode) and a prompt's queries against its keys (prefill), on cuDNN's fused attention or XLA's.

Shapes: queries (B, S, nh, hd), keys and values (B, M, nkv, hd) in the cache's layout (GQA: nh is
a multiple of nkv), positions (B, S), key positions (B, M); the output (B, S, nh * hd). Scores and
softmax in float32; probabilities rounded to the values' 16-bit dtype for the second product, as
flash attention does. Which implementation runs: `attention_backend` (`JAX_LORA_ATTENTION`).
"""

from __future__ import annotations

import functools
import logging
import math
import os

import jax
import jax.numpy as jnp

__all__ = ["ATTENTION_CHOICES", "ATTENTION_ENV", "attention_backend", "decode_attention", "prefill_attention"]

ATTENTION_ENV = "JAX_LORA_ATTENTION"
ATTENTION_CHOICES = ("auto", "xla", "cudnn")
_LOG = logging.getLogger("jax_lora")


def attention_backend(q_dtype, kv_dtype, head_dim: int, tensor_parallel: bool = False) -> tuple[str, str]:
    """Which attention runs (decode and prefill), and why: ("cudnn" | "xla", reason).

    `JAX_LORA_ATTENTION` (read when a step is traced): "auto" (default) takes cuDNN's fused
    attention where it applies (JAX's default backend is a CUDA GPU with cuDNN, queries and cache
    in the same 16-bit dtype, head_dim a multiple of 8 and at most 256) and XLA's attention
    (`decode_attention`, `prefill_attention`) elsewhere; "xla" always the latter; "cudnn"
    requires cuDNN and raises where it does not apply, naming the reason. A model split over a
    mesh (`tensor_parallel`) takes XLA's under "auto": cuDNN's partitioning rules (queries, keys
    and values sharded alike, the mask unsharded) have not run on several GPUs here; "cudnn"
    forces it. The choice is logged once per (choice, reason) on the `jax_lora` logger.

    "auto" prefers cuDNN's attention because in the model-step benchmark it was faster than XLA's,
    or within noise of it, at every step shape measured, decode and prefill, base and LoRA steps
    (docs/benchmarks_evidence.md, "Rules in the code and their measurements")."""
    setting = os.environ.get(ATTENTION_ENV, "auto").strip().lower() or "auto"
    if setting not in ATTENTION_CHOICES:
        raise ValueError(f"{ATTENTION_ENV}={setting!r}: expected one of {', '.join(ATTENTION_CHOICES)}")
    if setting == "xla":
        choice = ("xla", f"{ATTENTION_ENV}=xla")
    else:
        why_not = _cudnn_unavailable(q_dtype, kv_dtype, head_dim)
        if why_not and setting == "cudnn":
            raise ValueError(f"{ATTENTION_ENV}=cudnn, but cuDNN attention does not apply here: {why_not}")
        if not why_not and setting == "auto" and tensor_parallel:
            why_not = ("the model is split over a mesh (cuDNN attention under tensor parallelism is not verified on "
                       "GPUs; JAX_LORA_ATTENTION=cudnn forces it)")
        choice = ("xla", f"auto: {why_not}") if why_not else ("cudnn", f"{setting}: cuDNN fused attention applies")
    _log_attention(*choice)
    return choice


@functools.cache
def _log_attention(backend: str, why: str, level: int = logging.INFO) -> None:
    """Says once per (backend, reason) which attention runs (steps are traced per shape)."""
    _LOG.log(level, "attention: %s (%s)", backend, why)


def _cudnn_unavailable(q_dtype, kv_dtype, head_dim: int) -> str:
    """Why cuDNN's fused attention cannot run a step here ("" when it can)."""
    if jax.default_backend() != "gpu":
        return f"JAX's default backend is {jax.default_backend()!r}, not a CUDA GPU"
    if "cuda" not in jax.devices()[0].client.platform_version.lower():
        return "the GPU backend is not CUDA"
    if jnp.dtype(q_dtype) != jnp.dtype(kv_dtype) or jnp.dtype(kv_dtype) not in (jnp.bfloat16, jnp.float16):
        return f"queries {jnp.dtype(q_dtype).name} and cache {jnp.dtype(kv_dtype).name} (cuDNN needs one 16-bit dtype)"
    if head_dim % 8 or head_dim > 256:
        return f"head_dim {head_dim} (cuDNN needs a multiple of 8, at most 256)"
    return ""


def _cudnn_attention(why: str, q, keys, values, **mask):
    """cuDNN's fused attention of (B, S, nh, hd) queries over (B, M, nkv, hd) keys and values with
    the given mask argument (`key_value_seq_lengths` or `mask`), scale 1/sqrt(hd); None when JAX
    refuses it under "auto" (said once, XLA's attention then runs); a ValueError when
    JAX_LORA_ATTENTION=cudnn forced it (`why`: attention_backend's reason)."""
    try:
        return jax.nn.dot_product_attention(q, keys, values, scale=1.0 / math.sqrt(q.shape[-1]),
                                            implementation="cudnn", **mask)
    except (NotImplementedError, RuntimeError) as e:   # JAX's cuDNN checks (version, shapes)
        if not why.startswith("auto"):
            raise ValueError(f"{ATTENTION_ENV}=cudnn, but JAX refused cuDNN attention: {e}") from e
        _log_attention("xla", f"cuDNN attention refused by JAX: {e}", logging.WARNING)
        return None


def decode_attention(q, keys, values, key_pos, positions, dtype, tensor_parallel=False):
    """One query per row against the cache, in the cache's own layout: (B, 1, nh, hd) queries,
    (B, M, nkv, hd) keys and values -> (B, 1, nh * hd). Query b attends to cache positions
    0..min(positions[b], M - 1) (`key_pos` is arange(M) per row).

    cuDNN (`attention_backend`): its fused attention with each row's key count
    min(positions + 1, M) as the padding mask; float32 softmax, probabilities rounded to the cache
    dtype for the product with the values (flash attention's rounding). Otherwise
    multiply-and-reduce (XLA fuses each product into one pass over the cache, widening to float32
    in registers) rather than batched matrix products, which would need the cache transposed to
    (B, nkv, M, hd) first: a copy of the whole cache per layer and step. XLA's path zeroes masked
    values (non-finite values past a row's position do not reach its result); cuDNN's reads a
    cache whose positions past each row's are finite, as the model's prefill leaves them."""
    b, _, nh, hd = q.shape
    nkv, max_len = keys.shape[2], keys.shape[1]
    backend, why = attention_backend(q.dtype, keys.dtype, hd, tensor_parallel)
    if backend == "cudnn":
        lengths = jnp.clip(positions[:, 0].astype(jnp.int32) + 1, 1, max_len)
        out = _cudnn_attention(why, q, keys, values, key_value_seq_lengths=lengths)
        if out is not None:
            return out.reshape(b, 1, nh * hd).astype(dtype)
    qf = q.reshape(b, 1, nkv, nh // nkv, hd).astype(jnp.float32)             # (B, 1, nkv, g, hd)
    scores = jnp.sum(qf * keys[:, :, :, None, :].astype(jnp.float32), axis=-1) / math.sqrt(hd)   # (B, M, nkv, g)
    mask = key_pos <= positions                                              # (B, M)
    scores = jnp.where(mask[:, :, None, None], scores, -1e30)
    probs = jax.nn.softmax(scores, axis=1)
    vals = jnp.where(mask[:, :, None, None], values.astype(jnp.float32), 0.0)   # masked: 0, never 0 x NaN
    out = jnp.sum(probs[..., None] * vals[:, :, :, None, :], axis=1)         # (B, nkv, g, hd)
    return out.reshape(b, 1, nh * hd).astype(dtype)


def prefill_attention(q, keys, values, key_pos, positions, dtype, tensor_parallel=False):
    """Every query of a row against the row's keys: (B, S, nh, hd) queries at `positions` (B, S),
    (B, M, nkv, hd) keys and values at `key_pos` (B, M) -> (B, S, nh * hd). Query (b, s) attends to
    the keys m with key_pos[b, m] <= positions[b, s] (causal within a prompt; a chunk of a longer
    prompt also reads the earlier chunks' keys in the cache).

    cuDNN (`attention_backend`): its fused (flash) attention with that mask as a (B, 1, S, M) bias
    shared by the heads; the S x M scores stay on chip. Otherwise two products under XLA, the
    float32 scores (B, nkv, g, S, M) materialised. Both read q, keys and values in their own dtype
    and accumulate in float32 (a 16-bit cache is never widened in memory); the probabilities are
    rounded to the values' dtype for the second product, as flash attention does."""
    b, s, nh, hd = q.shape
    nkv = keys.shape[2]
    mask = key_pos[:, None, :] <= positions[:, :, None]                 # (B, S, M)
    backend, why = attention_backend(q.dtype, keys.dtype, hd, tensor_parallel)
    if backend == "cudnn":
        out = _cudnn_attention(why, q, keys, values, mask=mask[:, None])
        if out is not None:
            return out.reshape(b, s, nh * hd).astype(dtype)
    # Keys past a row's last query position meet no query: their values are zeroed (a masked
    # probability is 0, and 0 x NaN = NaN); their scores are replaced below.
    values = jnp.where((key_pos <= positions.max(axis=1)[:, None])[:, :, None, None], values, 0)
    qk = jnp.promote_types(q.dtype, keys.dtype)
    qg = q.astype(qk).reshape(b, s, nkv, nh // nkv, hd)
    scores = jnp.einsum("bsngd,bmnd->bngsm", qg, keys.astype(qk),
                        preferred_element_type=jnp.float32) / math.sqrt(hd)
    scores = jnp.where(mask[:, None, None], scores, -1e30)
    probs = jax.nn.softmax(scores, axis=-1)
    pv = values.dtype if jnp.dtype(values.dtype).itemsize < 4 else jnp.promote_types(values.dtype, jnp.float32)
    out = jnp.einsum("bngsm,bmnd->bsngd", probs.astype(pv), values.astype(pv),
                     preferred_element_type=jnp.float32)
    return out.reshape(b, s, nh * hd).astype(dtype)
