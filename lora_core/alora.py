"""Activated LoRA (aLoRA, PEFT's `alora_invocation_tokens`): which tokens of a request an adapter applies to.

An aLoRA adapter carries an invocation sequence v = (v_0, ..., v_{k-1}) of token ids. For a
request whose prompt is p = (p_0, ..., p_{n-1}), PEFT finds the LAST start j of v in p
(p[j:j+k] == v, j + k <= n) and applies the adapter to positions t >= j only: the invocation
tokens themselves and everything after them, generated tokens included; positions t < j get the
base model. When v does not occur in p, the adapter applies to no token at all (the request is
served by the base model). Only the prompt is searched: tokens generated later never start an
invocation.

Because every position before j is computed without the adapter, the key/value cache of the
prompt's first j tokens is the base model's, equal to that of a base request with the same
prefix.

The serving code turns this into the per-token LoRA mapping the kernels already take (no adapter
= LoRA id 0 on the host, slot -1 on the device):

  1. `invocation_start(prompt, v)` -> j or None, once per request;
  2. `active_from(j, first_position, num_tokens)` -> the index, within a pass over the positions
     first_position .. first_position + num_tokens - 1, of the first token the adapter applies to
     (num_tokens when none: j is None or beyond the pass);
  3. the pass's ids: 0 for tokens before it, the adapter's id from it on.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

__all__ = ["active_from", "invocation_start", "token_ids"]


def invocation_start(prompt: Sequence[int] | np.ndarray, invocation: Sequence[int]) -> int | None:
    """The start j of the last occurrence of `invocation` (k >= 1 token ids) in `prompt` (n token
    ids), or None when it does not occur (PEFT's calculate_alora_offsets: offset = n - j).

    1. candidate starts: the positions where prompt equals invocation[0], j + k <= n;
    2. keep those where the k tokens match; the largest wins.
    Shapes: prompt (n,), invocation (k,); O(n k) in the worst case, NumPy on the host."""
    p = np.asarray(prompt).reshape(-1)
    v = np.asarray(invocation).reshape(-1)
    k, n = v.size, p.size
    if k == 0:
        raise ValueError("invocation must hold at least one token id")
    if k > n:
        return None
    windows = np.lib.stride_tricks.sliding_window_view(p, k)               # (n - k + 1, k)
    hits = np.flatnonzero((windows == v).all(axis=1))
    return int(hits[-1]) if hits.size else None


def active_from(start: int | None, first_position: int, num_tokens: int) -> int:
    """In a pass over the positions first_position .. first_position + num_tokens - 1 of a request
    whose invocation starts at `start` (None: absent), the index of the first token the adapter
    applies to: clip(start - first_position, 0, num_tokens); num_tokens when start is None."""
    if start is None:
        return num_tokens
    return int(min(max(start - first_position, 0), num_tokens))


def token_ids(lora_id: int, start: int | None, first_position: int, num_tokens: int) -> np.ndarray:
    """(num_tokens,) int64: the LoRA id of each token of the pass, 0 (no adapter) before
    `active_from(start, first_position, num_tokens)` and `lora_id` from it on."""
    out = np.full(num_tokens, lora_id, np.int64)
    out[:active_from(start, first_position, num_tokens)] = 0
    return out
