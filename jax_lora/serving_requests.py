"""The serving loop's requests: what a caller hands `ServingEngine.generate` and gets back, and what
the engine keeps per request while it is in flight.

Request names the prompt and the adapters (one `lora_id`, or several `lora_ids` with `lora_weights`,
summed: x W + sum_i w_i s_i (x A_i) B_i); Completion carries the generated tokens back.
`check_adapter_fields` refuses a request's malformed adapter fields before anything runs.
`InFlight` is the engine's record of one admitted request: its KV row, its tokens so far and the
LoRA id of each of its positions (an aLoRA request's tokens before its invocation get id 0).
`jax_lora.serving` re-exports Request and Completion (their public path).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np

from lora_core import alora
from lora_core.adapter_pairs import PAIR_BUCKETS

__all__ = ["Completion", "InFlight", "Request", "check_adapter_fields", "is_int"]


@dataclasses.dataclass
class Request:
    """prompt: token ids; lora_id: registered adapter id, or None / 0 for the base model (an aLoRA
    adapter applies from its invocation sequence in the prompt on; see jax_lora.serving's docstring).

    request_id: any hashable value that tells the request's Completion apart (None: the request's
    index in the `generate` call); no two requests of one call may end up with the same id.
    lora_ids: several registered adapters for the request (instead of lora_id), summed
    (contract section 10); lora_weights: their strengths, one per id of lora_ids, or one number
    for lora_id (None: strength 1). Each token then computes x W + sum_i w_i s_i (x A_i) B_i.
    """

    prompt: Sequence[int]
    lora_id: int | None = None
    max_new_tokens: int = 16
    request_id: Any = None
    eos_token_id: int | None = None
    lora_ids: Sequence[int] | None = None
    lora_weights: Sequence[float] | float | None = None

    def adapters(self) -> tuple[tuple, tuple | None]:
        """(the request's adapter ids, their weights or None for a plain one-adapter request)."""
        if self.lora_ids is not None:
            ids = tuple(int(i) for i in self.lora_ids)
            weights = (1.0,) * len(ids) if self.lora_weights is None else tuple(float(w) for w in self.lora_weights)
            return ids, weights
        ids = (int(self.lora_id),) if self.lora_id else ()
        if self.lora_weights is None:
            return ids, None
        return ids, (float(self.lora_weights),) * len(ids)


@dataclasses.dataclass
class Completion:
    """tokens: the generated ids. logits: (len(tokens), vocab) float32 when the engine keeps logits.
    cached_tokens: the prompt tokens whose K/V came from the base-model prefix cache (not prefilled)."""

    request_id: Any
    prompt: list
    lora_id: int | None
    tokens: list
    logits: np.ndarray | None = None
    cached_tokens: int = 0


def is_int(value) -> bool:
    """A Python or NumPy integer, never a bool."""
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def check_adapter_fields(i: int, r: Request) -> None:
    """Request i's lora_ids / lora_weights: ids are positive ints (at most PAIR_BUCKETS[-1]), not
    with lora_id; weights finite numbers, one per id (or one number for lora_id)."""
    if r.lora_ids is not None:
        if r.lora_id:
            raise ValueError(f"request {i}: give lora_id or lora_ids, not both")
        if isinstance(r.lora_ids, (str, bytes)) or not isinstance(r.lora_ids, Sequence) or not all(
                is_int(v) and v > 0 for v in r.lora_ids):
            raise TypeError(f"request {i}: lora_ids must be a sequence of registered (positive int) LoRA ids, got "
                            f"{r.lora_ids!r:.200}")
        if len(r.lora_ids) > PAIR_BUCKETS[-1]:
            raise ValueError(f"request {i}: lora_ids names {len(r.lora_ids)} adapters, at most {PAIR_BUCKETS[-1]}")
    if r.lora_weights is None:
        return
    many = r.lora_ids is not None
    values = r.lora_weights if many and isinstance(r.lora_weights, Sequence) else (
        None if many else [r.lora_weights])
    if values is None or isinstance(values, (str, bytes)) or (many and len(values) != len(r.lora_ids)):
        raise ValueError(f"request {i}: lora_weights must be one weight per id of lora_ids, or one number for "
                         f"lora_id, got {r.lora_weights!r:.200}")
    for w in values:
        if isinstance(w, (bool, np.bool_)) or not isinstance(w, (int, float, np.integer, np.floating)) \
                or not np.isfinite(w):
            raise ValueError(f"request {i}: lora_weights must hold finite numbers, got {w!r}")


@dataclasses.dataclass
class InFlight:
    """One admitted request in the engine: the request, its index in the `generate` call, its KV row,
    the tokens (and logits) generated so far."""

    req: Request
    index: int
    row: int
    tokens: list = dataclasses.field(default_factory=list)
    logits: list = dataclasses.field(default_factory=list)
    invocation: tuple | None = None     # an aLoRA adapter's invocation tokens (None: every token)
    start: int | None = None            # where the invocation starts in the prompt (aLoRA; None: absent)
    cached: int = 0                     # leading prompt tokens whose K/V the prefix cache supplied

    @property
    def base_len(self) -> int:
        """The prompt's leading tokens computed with no adapter (LoRA id 0): the whole prompt of a base
        request, an aLoRA request's tokens before its invocation, none for an adapter on every token."""
        n = len(self.req.prompt)
        nonzero = np.flatnonzero(self.lora_ids(0, n))
        return int(nonzero[0]) if nonzero.size else n

    @property
    def lora(self) -> int:
        """The first adapter id (0: none): the sampled row's adapter and the one-adapter mapping's."""
        ids, _ = self.req.adapters()
        return ids[0] if ids else 0

    @property
    def loras(self) -> set:
        return set(self.req.adapters()[0])

    @property
    def pair_entry(self) -> tuple:
        """(ids, weights) of the request's tokens in a paired mapping."""
        ids, weights = self.req.adapters()
        return ids, (1.0,) * len(ids) if weights is None else weights

    def lora_ids(self, first_position: int, num_tokens: int) -> np.ndarray:
        """(num_tokens,) the LoRA id of each position first_position.. (0 before an aLoRA invocation,
        and everywhere when the prompt holds none)."""
        if self.invocation is None:
            return np.full(num_tokens, self.lora, np.int64)
        return alora.token_ids(self.lora, self.start, first_position, num_tokens)

    @property
    def done(self) -> bool:
        eos = self.req.eos_token_id
        return len(self.tokens) >= self.req.max_new_tokens or (eos is not None and bool(self.tokens)
                                                               and self.tokens[-1] == eos)
