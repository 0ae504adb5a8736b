"""The float64 NumPy oracle: contract section 2-5 written as plainly as possible, loops included.

Every implementation in the conformance suite is compared to these functions. Inputs are NumPy
arrays already rounded to the implementation's dtype (so the oracle sees the same values), and all
arithmetic here is float64.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

FP8_MAX = 448.0  # the largest finite float8_e4m3fn value (contract section 11)


def f64(a):
    return np.asarray(a, dtype=np.float64)


def w3(w):
    """(L, 1, a, b) -> (L, a, b)."""
    w = np.asarray(w)
    return w.reshape(w.shape[0], w.shape[-2], w.shape[-1]) if w.ndim == 4 else w


def fp8_quantize(w):
    """Contract section 11's rule for a stacked weight (..., rows, cols), per output channel (row):
    scale = amax(|w[row]|) / 448 as float32 (1 where the row is all zeros), w_q = e4m3(clip(w /
    scale, -448, 448)) rounded to nearest even (ml_dtypes). Returns (w_q as ml_dtypes
    float8_e4m3fn, scale (..., rows) float32); the division is float64."""
    w = f64(w)
    amax = np.abs(w).max(axis=-1)
    scale = np.where(amax == 0, 1.0, amax / FP8_MAX).astype(np.float32)
    q = np.clip(w / f64(scale)[..., None], -FP8_MAX, FP8_MAX).astype(ml_dtypes.float8_e4m3fn)
    return q, scale


def fp8_dequantize(q, scale):
    """float64 w[..., row, k] = float(w_q[..., row, k]) * scale[..., row] (scale (..., rows), or one
    per slot (L,) broadcast to the rows)."""
    scale = f64(scale)
    q = f64(np.asarray(q).astype(np.float32))
    if scale.ndim == q.ndim - 2:          # per tensor: one scale per slot
        scale = np.broadcast_to(scale[..., None], q.shape[:-1])
    return q * scale[..., None]


def shrink(x, lora_a, idx, scale):
    """(S, T, r): scale * x[t] @ A_s[idx[t]].T, 0 for idx -1."""
    x = f64(x)
    out = []
    for a in lora_a:
        a = f64(w3(a))
        o = np.zeros((x.shape[0], a.shape[1]))
        for t, i in enumerate(idx):
            if i >= 0:
                o[t] = scale * (a[i] @ x[t])
        out.append(o)
    return np.stack(out)


def expand(buf, lora_b, y, idx, offset_start=0, add_inputs=True, bias=None):
    """y with y[t, off_s:off_s+n_s] = (y if add_inputs else 0) + buf[s, t] @ B_s[idx].T + bias_s[idx]."""
    y = f64(y).copy()
    off = offset_start
    for s, b in enumerate(lora_b):
        b = f64(w3(b))
        n = b.shape[1]
        for t, i in enumerate(idx):
            if i < 0:
                continue
            delta = b[i] @ f64(buf[s][t])
            if bias is not None and bias[s] is not None:
                delta = delta + f64(bias[s]).reshape(b.shape[0], -1)[i]
            y[t, off:off + n] = (y[t, off:off + n] if add_inputs else 0.0) + delta
        off += n
    return y


def lora_linear(y, x, lora_a, lora_b, bias, scale, idx):
    return expand(shrink(x, lora_a, idx, scale), lora_b, y, idx, 0, True, bias)


def multi_lora_linear(y, x, lora_a, lora_b, scale, pair_slots, pair_weights):
    """Several adapters per token (contract section 10): y[t, slice s] += sum_j w[t, j] * scale *
    (x[t] @ A_s[slot[t, j]].T) @ B_s[slot[t, j]].T over the pairs with slot >= 0, in float64."""
    y = f64(y).copy()
    x = f64(x)
    off = 0
    for a, b in zip(lora_a, lora_b):
        a, b = f64(w3(a)), f64(w3(b))
        n = b.shape[1]
        for t in range(x.shape[0]):
            for i, w in zip(pair_slots[t], pair_weights[t]):
                if i >= 0:
                    y[t, off:off + n] += float(w) * scale * (b[i] @ (a[i] @ x[t]))
        off += n
    return y


def logits(y, x, lora_a, lora_b, scale, sampler_idx):
    """LM-head LoRA: one slice, sampler indices, B cut to y's width."""
    width = y.shape[1]
    b = w3(lora_b)[:, :width]
    return expand(shrink(x, [lora_a], sampler_idx, scale), [b], y, sampler_idx, 0, True)


def segments_to_indices(starts, lengths, loras, num_tokens):
    idx = np.full(num_tokens, -1, np.int64)
    for s, n, l in zip(starts, lengths, loras):
        idx[s:s + n] = l
    return idx


def convert_mapping(index_mapping, prompt_mapping, lora_index_to_id, max_loras, vocab_size,
                    extra_vocab_size, offsets_by_lora_id=None):
    """contract section 2, literally."""
    def slot(i):
        return lora_index_to_id.index(i) if i > 0 else -1

    base = [slot(i) for i in index_mapping]
    sampler = [slot(i) for i in prompt_mapping]
    n = len(sampler)
    padded = [j + (p if p != -1 else max_loras - 1) * n for j, p in enumerate(sampler)]
    e = [slot(i) if i > 0 else 0 for i in index_mapping]
    emb = [[v * extra_vocab_size for v in e], [v * (vocab_size + extra_vocab_size) for v in e]]
    emb = [[max_loras - 1 if v == -1 else v for v in row] for row in emb]
    long_lora = None if offsets_by_lora_id is None else [offsets_by_lora_id.get(i, 0) for i in index_mapping]
    lens = [len(base), n, n, len(index_mapping), None if long_lora is None else len(long_lora)]
    return base, sampler, padded, emb, long_lora, lens


def compute_meta(idx):
    """Segments of equal consecutive indices."""
    starts, lengths, loras = [], [], []
    for t, i in enumerate(idx):
        if t == 0 or i != idx[t - 1]:
            starts.append(t)
            lengths.append(0)
            loras.append(i)
        lengths[-1] += 1
    no_lora = len(loras) == 0 or (len(loras) == 1 and loras[0] == -1)
    return starts, lengths, loras, len(starts), max(lengths, default=0), len(idx), no_lora


def kernel_meta(idx, max_loras):
    """contract section 3 for a mapping of exactly T tokens."""
    idx = list(idx)
    ids = sorted(set(idx))
    counts = [idx.count(i) for i in ids]
    active = ids + [-1] * (max_loras + 1 - len(ids))
    num = counts + [0] * (max_loras + 1 - len(ids))
    start = [0] + list(np.cumsum(counts)) + [0] * (max_loras + 1 - len(ids))
    order = sorted(range(len(idx)), key=lambda t: (idx[t], t))
    return idx, order, active, num, start, all(i == -1 for i in idx)


def fused_moe_lora(y, x, lora_a, lora_b, topk_ids, topk_weights, token_lora, adapter_enabled, mul_routed_weight,
                   offset=0):
    """MoE LoRA (contract section 9), loops: for token t with slot l = token_lora[t] >= 0 and
    adapter_enabled[l] != 0, each of its top-k choices k (expert e = topk_ids[t, k] >= 0) and each
    slice s (output columns offset + sum of the widths before it):

      y[t, k, cols_s] += w * B_s[l, e] @ (A_s[l, e] @ x[row])

    row = t * top_k + k and w = topk_weights[t, k] when mul_routed_weight (the down projection:
    one x row per pair), else row = t and w = 1 (gate_up: one x row per token). y is (T, top_k, N)."""
    y = f64(y).copy()
    x = f64(x)
    num_tokens, top_k = np.asarray(topk_ids).shape
    for t in range(num_tokens):
        slot = int(token_lora[t])
        if slot < 0 or not adapter_enabled[slot]:
            continue
        for k in range(top_k):
            e = int(topk_ids[t, k])
            if e < 0:
                continue
            row = x[t * top_k + k] if mul_routed_weight else x[t]
            w = float(topk_weights[t, k]) if mul_routed_weight else 1.0
            col = offset
            for a, b in zip(lora_a, lora_b):
                a, b = f64(a)[slot, e], f64(b)[slot, e]
                y[t, k, col:col + b.shape[0]] += w * (b @ (a @ row))
                col += b.shape[0]
    return y


def moe_block_lora(x, w_gate_up, w_down, topk_ids, topk_weights, token_lora, gu_a, gu_b, dn_a, dn_b, scales):
    """A whole MoE block with expert LoRA, float64 (HF Mixtral's experts): per token t and choice k,
    expert e, adapter slot l = token_lora[t] (-1: none), scaling c = scales[l]:

      gu = W_gu[e] @ x[t] + c * B_gu[l, e] @ A_gu[l, e] @ x[t];  h = silu(gu[:I]) * gu[I:]
      out[t] += w[t, k] * (W_dn[e] @ h + c * B_dn[l, e] @ A_dn[l, e] @ h)"""
    x = f64(x)
    out = np.zeros_like(x)
    inter = w_gate_up.shape[1] // 2
    for t in range(x.shape[0]):
        slot = int(token_lora[t])
        for k in range(topk_ids.shape[1]):
            e = int(topk_ids[t, k])
            gu = f64(w_gate_up)[e] @ x[t]
            if slot >= 0:
                gu = gu + scales[slot] * (f64(gu_b)[slot, e] @ (f64(gu_a)[slot, e] @ x[t]))
            h = gu[:inter] / (1 + np.exp(-gu[:inter])) * gu[inter:]
            d = f64(w_down)[e] @ h
            if slot >= 0:
                d = d + scales[slot] * (f64(dn_b)[slot, e] @ (f64(dn_a)[slot, e] @ h))
            out[t] += float(topk_weights[t, k]) * d
    return out


def rel_err(got, want):
    got, want = f64(got), f64(want)
    if not np.all(np.isfinite(got)):
        return np.inf
    denom = np.linalg.norm(want)
    return np.linalg.norm(got - want) / (denom if denom > 0 else 1.0)


TOL = {"float32": 1e-5, "float16": 5e-3, "bfloat16": 2e-2}
# fp8 (e4m3) weights (contract section 11), by activation dtype, against this oracle run on the
# DEQUANTISED weights (`fp8_dequantize`): the e4m3 values are exact in every activation dtype and
# the channel scale is one more float32 rounding, so the 16-bit tolerances hold.
FP8_TOL = dict(TOL)
# The fp8 result against the oracle on the original (unquantised) 16-bit weights: e4m3 keeps 3
# mantissa bits (each weight off by at most 2^-4 relative, 2^-5 on average), and the errors of a
# product's terms are independent, so a result's relative error is a few percent at most.
FP8_QUANT_TOL = 0.05
