"""A jax.jit serving loop: continuous batching of requests that each name an adapter (or none).

Per step, on the host: pick the rows, build a LoRAMapping (LoRA id per token and per sampled row),
`PunicaWrapper.update_metadata` (host NumPy, one upload, one jitted metadata build). On the device:
one jitted call `step(state arrays, cache, wrapper, tokens, positions, rows, sample_idx)` that runs the
model with `jax_lora.nn.punica_context(wrapper)`, samples greedily and returns the new KV cache
(the old one is donated), the next tokens and the logits. Nothing inside the step reads back to the
host; between steps the host reads the (rows,) next tokens to schedule the next step.

Shapes are bucketed, so one compiled program serves every step of a bucket:
  prefill: (rows, length) with rows = max(next power of two of the admitted requests,
           min_prefill_rows = 8 by default, vLLM's rule), capped at max_seqs; length =
           max(min_prefill_len, next power of two of the longest prompt);
  decode:  (max_seqs, 1), every row, the cache read and written in place (rows=None: no gather of
           the KV rows); a free row writes its ignored token's key and value at position 0 of its
           own row, which the next request placed there overwrites in its prefill before any read.
Activated LoRA (aLoRA: an adapter registered from a PEFT adapter with `alora_invocation_tokens`):
the request's prompt is searched for the last occurrence of the invocation sequence
(lora_core.alora); the prompt's tokens before it get LoRA id 0 (no adapter), the invocation, the
rest of the prompt and every generated token get the adapter; a prompt without the invocation is
served by the base model throughout (PEFT's rule). The KV cache of the tokens before the
invocation is therefore the base model's.
Base-model prefix cache (`prefix_cache_tokens` > 0; jax_lora.prefix_cache): whole blocks of
`prefix_block_size` prompt tokens computed with no adapter (a base request's prompt, an aLoRA
request's tokens before its invocation) are kept in a device pool after their prefill, LRU-bounded.
A later request whose base-computed prefix starts with cached blocks gets them copied into its KV
row, and its prefill runs over the rest of its prompt only, at positions from the reused length on
(the prefill bucket is that of the rest: no new program). K/V computed with an adapter are never
stored. Generated tokens are not stored. Completion.cached_tokens says how many prompt tokens a
request reused; `prefix_cache_stats()` gives the cumulative counters.
The wrapper's buffers have fixed lengths (the prompt mapping padded by vLLM's rule, max(next
power of two, 8) rows); padded tokens and rows use LoRA id 0 (no adapter) and never change real rows.
Adapters are swapped by AdapterManager between steps with same-shape writes: no recompilation.
`compile_count` counts the compiled step programs. The one exception: the first DoRA adapter in a
model built without dora=True gives its layers a column-scale variable (AdapterManager's
`layout_version` changes), and the step is traced and compiled again, once per bucket.

With `mesh=` the model is split over the mesh's tensor-parallel axis (`LlamaForCausalLM.shard`,
jax_lora.parallel): the wrapper's index block and the step inputs are replicated on the mesh, the
KV cache is placed with `model.cache_sharding()` and kept there by the step, and adapter slots are
written shard by shard (AdapterManager). The step is the same jitted function.

The first step of each bucket compiles its program (seconds on a large model): the engine logs one
INFO line per program on the "jax_lora" logger, naming the bucket and the time the compilation took.
With `aot_calls=True` (the default) each bucket's program is compiled ahead of time on its first
step (`jit.lower(...).compile()`), kept in a dict keyed by what selects the program -- the tokens'
(rows, length), whether the step gathers KV rows (prefill) or not (decode), LoRA on/off and the
wrapper's pair bucket -- and called directly afterwards: the call skips jax.jit's per-call
signature and cache lookup over the step's arguments (one per model array: hundreds for a
full-size model), host time the serving loop waits for. The Compiled program keeps the jitted
step's donation and shardings. aot_calls=False calls the jitted step instead.

The step's arguments: the model's arrays as two flat lists, the adapter arrays (`LoRAWeight`
leaves) and the others. Each costs host time per call. The models' `add_lora` keeps a projection
kind's adapter variables stacked over the decoder layers (jax_lora.lora_bank), so the adapter
list holds a few arrays per kind, not per layer; the base step (use_lora=False) takes no adapter
array at all (zero-sized constants stand in for them inside its program, which reads none).

Thread safety: `generate` holds the engine's lock for the whole call (the KV cache, the wrapper's
metadata and the adapter slots are the engine's own), so concurrent calls from several threads run
one after another, each request with its own adapter. A call from inside a `progress` callback of
the same engine raises RuntimeError (it would interleave with the call in progress).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import logging
import threading
import time
from collections.abc import Callable, Iterable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from lora_core import alora, checks
from lora_core.host_mapping import MIN_NUM_SEQS, LoRAMapping, next_power_of_two

from . import nn as lnn
from .adapters import AdapterManager
from .models.llama import init_cache
from .prefix_cache import PrefixCache
from .serving_requests import Completion, InFlight, Request, check_adapter_fields, is_int
from .wrapper import PunicaWrapper

__all__ = ["Completion", "Request", "ServingEngine"]

_LOG = logging.getLogger("jax_lora")


def _step(graphdef, state_defs, lora_dtypes, cache_sharding, state_leaves, cache, punica, tokens, positions, rows,
          sample_idx, use_lora):
    """The model under `punica_context`, greedy next tokens. state_leaves: (the adapter arrays (the
    LoRAWeight leaves), the other arrays), each flat; the base step (use_lora False) gets no adapter
    arrays: zero-sized constants stand in for them (it reads none), so its program takes none."""
    lora_leaves, rest_leaves = state_leaves
    if not use_lora:
        lora_leaves = [jnp.zeros((0,), dtype) for dtype in lora_dtypes]
    lora_def, rest_def = state_defs
    model = nnx.merge(graphdef, jax.tree.unflatten(lora_def, lora_leaves), jax.tree.unflatten(rest_def, rest_leaves))
    with lnn.punica_context(punica if use_lora else None):
        logits, cache = model(tokens, positions, cache=cache, rows=rows, sample_idx=sample_idx)
    if cache_sharding is not None:     # the next step takes the cache as this one did: no recompilation
        cache = jax.lax.with_sharding_constraint(cache, cache_sharding)
    return cache, jnp.argmax(logits, axis=-1).astype(jnp.int32), logits


class ServingEngine:
    """Greedy generation for many requests, each with its own adapter, through one jitted step.

    Args:
      model: a LlamaForCausalLM or MixtralForCausalLM (jax_lora.models) after `add_lora` (or a plain
        one: base only).
      adapters: the AdapterManager of `model` (None: no adapters).
      max_seqs: rows of the KV cache = most requests in flight.
      max_len: positions per row (prompt + generated tokens must fit).
      max_prefill_tokens: most tokens (padded rows x padded length) in one prefill step.
      min_prefill_len: smallest prefill length bucket.
      min_prefill_rows: smallest prefill row bucket (default 8, vLLM's MIN_NUM_SEQS; capped at
        max_seqs): fewer buckets, fewer compilations.
      keep_logits: return each generated token's logits (for verification).
      backend: the PunicaWrapper backend (None: the device's default).
      mesh: a jax.sharding.Mesh to serve on (tensor parallelism over its `tp_axis`); the model is
        split over it unless it already is (`model.shard(mesh, tokens=max_seqs)`).
      tp_axis: the mesh axis the model is split over.
      deterministic: the PunicaWrapper's deterministic mode: a request's LoRA contributions are
        bitwise the same whatever it is batched with (the base model's own layers are not changed).
      prefix_cache_tokens: capacity, in tokens, of the base-model prefix cache (0: off; rounded down
        to whole blocks): K/V of prompt blocks computed with no adapter, reused by later requests
        that start with them (module docstring, jax_lora.prefix_cache).
      prefix_block_size: tokens per prefix-cache block (the granularity of reuse).
      aot_calls: call each bucket's ahead-of-time compiled program (compiled on the bucket's first
        step) instead of the jitted step, which looks the program up from its arguments on every
        call (module docstring). Same programs, same results; False: the jitted call.

    Thread safety: `generate` may be called from several threads; the calls run one after another
    (the engine's lock), each request served with its own adapter. Each program compiled on a
    first step is logged (INFO, logger "jax_lora": the bucket and the compile time).
    """

    def __init__(self, model: nnx.Module, adapters: AdapterManager | None = None, *, max_seqs: int = 8,
                 max_len: int = 256, max_prefill_tokens: int = 512, min_prefill_len: int = 16,
                 min_prefill_rows: int = MIN_NUM_SEQS, keep_logits: bool = False, backend: str | None = None,
                 mesh: jax.sharding.Mesh | None = None, tp_axis: str = "tp", deterministic: bool = False,
                 prefix_cache_tokens: int = 0, prefix_block_size: int = 16, aot_calls: bool = True):
        if not isinstance(model, nnx.Module) or not hasattr(model, "config"):
            raise TypeError(f"model must be a jax_lora.models LlamaForCausalLM (an nnx.Module with a config), got "
                            f"{type(model).__name__}")
        for name, value in (("max_seqs", max_seqs), ("max_len", max_len), ("max_prefill_tokens", max_prefill_tokens),
                            ("min_prefill_len", min_prefill_len), ("min_prefill_rows", min_prefill_rows)):
            if not is_int(value) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        if not is_int(prefix_cache_tokens) or prefix_cache_tokens < 0:
            raise ValueError(f"prefix_cache_tokens must be an int >= 0 (0: no prefix cache), got "
                             f"{prefix_cache_tokens!r}")
        if not is_int(prefix_block_size) or not 1 <= prefix_block_size <= max_len:
            raise ValueError(f"prefix_block_size must be an int in [1, max_len={max_len}], got {prefix_block_size!r}")
        if adapters is not None and adapters.model is not model:
            raise ValueError("adapters must be the AdapterManager of this model")
        if not isinstance(aot_calls, bool):
            raise TypeError(f"aot_calls must be a bool, got {aot_calls!r}")
        self.aot_calls = aot_calls
        self.model = model
        self.config = model.config
        self.adapters = adapters
        self.max_seqs, self.max_len = int(max_seqs), int(max_len)
        self.max_prefill_tokens, self.min_prefill_len = int(max_prefill_tokens), int(min_prefill_len)
        if self.max_prefill_tokens < self.min_prefill_len:
            raise ValueError(f"max_prefill_tokens={max_prefill_tokens} < min_prefill_len={min_prefill_len}")
        self.min_prefill_rows = max(1, int(min_prefill_rows))
        self.keep_logits = keep_logits
        self.mesh = mesh
        self._replicated = None
        if mesh is not None:
            if not isinstance(mesh, jax.sharding.Mesh):
                raise TypeError(f"mesh must be a jax.sharding.Mesh, got {type(mesh).__name__}")
            if not hasattr(model, "shard"):
                raise TypeError(f"serving on a mesh needs a model with `shard` (jax_lora.models), got "
                                f"{type(model).__name__}")
            if model.mesh is None:
                model.shard(mesh, axis=tp_axis, tokens=self.max_seqs)
            elif model.mesh != mesh or model.tp_axis != tp_axis:
                raise ValueError(f"the model is split over axis {model.tp_axis!r} of another mesh "
                                 f"{dict(model.mesh.shape)}; pass that mesh or an unsplit model")
            self._replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
        cache_sharding = model.cache_sharding() if mesh is not None else None
        self._cache_sharding = cache_sharding
        self.graphdef, *state = nnx.split(model, lnn.LoRAWeight, ...)
        self._state_def = self._jit_step = None
        self._compiled_before = 0                 # programs of step functions replaced by a new layout
        self._programs: dict = {}                 # aot_calls: the bucket's key -> its Compiled step
        self._set_state(*state)
        self._state_version = adapters.version if adapters is not None else 0
        self._layout_version = adapters.layout_version if adapters is not None else 0
        self.cache = init_cache(self.config, self.max_seqs, self.max_len, model.cache_dtype(), sharding=cache_sharding)
        capacity = max(self.max_prefill_tokens, self.max_seqs)
        self.punica = None
        if adapters is not None:
            self.punica = PunicaWrapper(capacity, capacity, self._replicated, max_loras=adapters.num_slots,
                                        backend=backend,
                                        deterministic=deterministic)
        self.prefix_cache = None
        if prefix_cache_tokens:
            block = int(prefix_block_size)
            self.prefix_cache = PrefixCache(self.config, int(prefix_cache_tokens), block, model.cache_dtype(),
                                            cache_sharding, copy_blocks=-(-self.max_prefill_tokens // block))
        self.last_stats: dict = {}
        self._lock = threading.Lock()
        self._owner: int | None = None            # the thread inside generate

    def _set_state(self, lora_state: nnx.State, rest_state: nnx.State) -> None:
        """Keeps the model state as flat lists of arrays, the form the step takes: (the adapter
        arrays, the others). The base step takes the second only (`_step`).

        jax.jit flattens its arguments on every call, and an nnx.State flattens in Python, a cost
        that grows with the layer count and is a sizeable part of a decode step for a full-size
        model. A list of arrays flattens in C++. The tree structure and the graph definition are closed over,
        not static arguments (hashing them on every call would cost more than the step at small
        sizes); the step is jitted again only if the structure changes (adapter swaps write
        same-shape arrays, so they do not), and its ahead-of-time compiled programs are dropped
        with it (compile_count keeps counting them).
        """
        lora_leaves, lora_def = jax.tree.flatten(lora_state)
        rest_leaves, rest_def = jax.tree.flatten(rest_state)
        state_def = (lora_def, rest_def)
        if self._state_def is None or state_def != self._state_def:
            if self._jit_step is not None:
                self._compiled_before += self._programs_now()
            self._programs = {}
            self._state_def = state_def
            dtypes = tuple(jnp.dtype(a.dtype) for a in lora_leaves)
            self._jit_step = jax.jit(functools.partial(_step, self.graphdef, state_def, dtypes, self._cache_sharding),
                                     static_argnums=(7,), donate_argnums=(1,))
        self._state_leaves = (lora_leaves, rest_leaves)

    # ------------------------------------------------------------------ introspection
    def prefix_cache_stats(self) -> dict | None:
        """The prefix cache's cumulative counters (None when it is off): block_size, capacity_tokens,
        cached_tokens (held now), lookups, reused_tokens (prompt tokens not prefilled thanks to it),
        stored_tokens, evicted_tokens. Callable from a `progress` callback (the lock is then this
        thread's already)."""
        with self._held_lock():
            return None if self.prefix_cache is None else self.prefix_cache.stats()

    def clear_prefix_cache(self) -> None:
        """Forgets every cached prefix (e.g. after the base model's weights were changed in place)."""
        with self._held_lock():
            if self.prefix_cache is not None:
                self.prefix_cache.clear()

    def _held_lock(self):
        """The engine's lock, or nothing when this thread holds it (inside generate: a callback)."""
        return contextlib.nullcontext() if self._owner == threading.get_ident() else self._lock

    @property
    def compile_count(self) -> int:
        """Compiled step programs so far (one per bucket and LoRA on/off)."""
        return self._compiled_before + self._programs_now()

    def _programs_now(self) -> int:
        """Programs of the current step function: the ahead-of-time ones, or those in jit's cache."""
        return len(self._programs) if self.aot_calls else self._jit_step._cache_size()

    def _bucket_len(self, n: int) -> int:
        return min(max(self.min_prefill_len, next_power_of_two(n)), self.max_len)

    def prefill_shape(self, num_seqs: int, longest_prompt: int) -> tuple | None:
        """The (rows, length) bucket of a prefill step, or None when it exceeds max_prefill_tokens.

        length = max(min_prefill_len, next_pow2(longest)) capped at max_len; rows = max(next_pow2(n),
        min_prefill_rows), capped at max_seqs and at the largest power of two that keeps
        rows * length <= max_prefill_tokens.
        """
        s = self._bucket_len(longest_prompt)
        cap = self.max_prefill_tokens // s
        if cap < 1:
            return None
        cap = 1 << (cap.bit_length() - 1)                      # largest power of two <= cap
        b = min(max(next_power_of_two(num_seqs), self.min_prefill_rows), self.max_seqs, cap)
        return (b, s) if b >= num_seqs else None

    # ------------------------------------------------------------------ checks
    def _check(self, reqs: Sequence[Request], use_lora: bool) -> None:
        """Every request's fields, before anything runs: a ValueError / TypeError naming the request
        and the field (an int field takes Python or NumPy integers, never bools or floats). Two
        requests whose Completions would carry the same request_id are refused."""
        vocab = self.config.vocab_size
        for i, r in enumerate(reqs):
            if not isinstance(r, Request):
                raise TypeError(f"request {i}: expected a jax_lora.serving.Request, got {type(r).__name__}")
            if isinstance(r.prompt, (str, bytes)) or not isinstance(r.prompt, (Sequence, np.ndarray)):
                raise TypeError(f"request {i}: prompt must be a sequence of token ids, got {type(r.prompt).__name__}")
            p = np.asarray(r.prompt)
            if p.ndim != 1 or (p.size and (p.dtype == np.bool_ or not np.issubdtype(p.dtype, np.integer))):
                raise TypeError(f"request {i}: prompt must be a 1-D sequence of integer token ids, got dtype "
                                f"{p.dtype} and shape {p.shape}")
            n = len(p)
            if n == 0:
                raise ValueError(f"request {i}: empty prompt")
            if p.min() < 0 or p.max() >= vocab:
                raise ValueError(f"request {i}: token ids must be in [0, {vocab}), got {p.min()}..{p.max()}")
            if not is_int(r.max_new_tokens):
                raise TypeError(f"request {i}: max_new_tokens must be an int, got {r.max_new_tokens!r}")
            if r.max_new_tokens < 1:
                raise ValueError(f"request {i}: max_new_tokens must be >= 1, got {r.max_new_tokens}")
            if n + r.max_new_tokens > self.max_len:
                raise ValueError(f"request {i}: prompt ({n}) + max_new_tokens ({r.max_new_tokens}) exceeds "
                                 f"max_len={self.max_len}")
            if self._bucket_len(n) > self.max_prefill_tokens:
                raise ValueError(f"request {i}: prompt of {n} tokens does not fit max_prefill_tokens="
                                 f"{self.max_prefill_tokens}")
            if r.eos_token_id is not None and not (is_int(r.eos_token_id) and 0 <= r.eos_token_id < vocab):
                raise ValueError(f"request {i}: eos_token_id must be None or a token id in [0, {vocab}), got "
                                 f"{r.eos_token_id!r}")
            if r.lora_id is not None and not is_int(r.lora_id):
                raise TypeError(f"request {i}: lora_id must be None or an int (0: no adapter), got {r.lora_id!r}")
            check_adapter_fields(i, r)
            for lora_id in r.lora_ids or () if use_lora and self.adapters is not None else ():
                if lora_id in self.adapters.registered and self.adapters.invocation_tokens(lora_id) is not None:
                    raise ValueError(f"request {i}: adapter {lora_id} is an activated LoRA (aLoRA), served alone "
                                     "through lora_id (its invocation decides where it applies), not in lora_ids")
            for lora_id in r.adapters()[0] if use_lora else ():
                if self.adapters is None:
                    raise ValueError(f"request {i} names adapter {lora_id} but the engine has no adapters "
                                     "(generate(..., use_lora=False) serves every request with the base model)")
                if lora_id not in self.adapters.registered:
                    raise ValueError(f"request {i}: LoRA id {lora_id} is not registered "
                                     f"(registered: {sorted(self.adapters.registered)})")
                refused = self.adapters.activation_error(list(r.adapters()[0]))   # pinned adapters fill every slot
                if refused is not None:
                    raise ValueError(f"request {i}: {refused}")
        ids = [i if r.request_id is None else r.request_id for i, r in enumerate(reqs)]
        repeat = checks.first_repeat(ids, "request {}: request_id", "it tells the Completions apart")
        if repeat is not None:
            i, j = repeat
            first = (f"request {j}'s" if reqs[j].request_id is not None
                     else f"request {j}'s index (it has no request_id)")
            raise ValueError(f"request {i}: request_id {ids[i]!r} is already in flight in this call ({first}); "
                             "every request needs its own id")

    # ------------------------------------------------------------------ steps
    def _run(self, tokens, positions, rows, sample_idx, token_ids, row_ids, is_prefill, use_lora, pairs=None):
        if self.adapters is not None and self.adapters.version != self._state_version:
            if self.adapters.layout_version != self._layout_version:
                # A layer gained a variable (the first DoRA adapter in a layer built without dora=True):
                # a new graph, so a new step function, traced and compiled again for each bucket.
                self.graphdef, *state = nnx.split(self.model, lnn.LoRAWeight, ...)
                self._state_def = None
                self._layout_version = self.adapters.layout_version
                _LOG.info("ServingEngine: the model's LoRA layers gained DoRA column scales; the step programs are "
                          "compiled again")
            else:
                state = nnx.state(self.model, lnn.LoRAWeight, ...)
            self._set_state(*state)
            self._state_version = self.adapters.version
        punica = None
        if use_lora:
            # pairs: (token id tuples, token weights, row id tuples, row weights) of a paired step
            mapping = (LoRAMapping(token_ids, row_ids, is_prefill) if pairs is None else
                       LoRAMapping(pairs[0], pairs[2], is_prefill, pairs[1], pairs[3]))
            self.punica.update_metadata(mapping,
                                        self.adapters.lora_index_to_id, self.adapters.num_slots + 1,
                                        self.config.vocab_size)
            punica = self.punica
        # One explicit upload of the step's inputs (so a transfer guard can prove there is no other).
        tokens, positions, rows, sample_idx = jax.device_put((tokens, positions, rows, sample_idx), self._replicated)
        before, t0 = self.compile_count, time.perf_counter()
        self.cache, next_tok, logits = self._call_step(punica, tokens, positions, rows, sample_idx, use_lora)
        if self.compile_count != before:       # the call compiled (dispatch returns once the program is built)
            kind = "prefill" if is_prefill else "decode"
            n = self.compile_count
            _LOG.info("ServingEngine: compiled the %s step program for the bucket (%d, %d) (rows, tokens), %s, in "
                      "%.2fs (%d program%s so far)", kind, tokens.shape[0], tokens.shape[1],
                      "with adapters" if use_lora else "without adapters", time.perf_counter() - t0, n,
                      "" if n == 1 else "s")
        return next_tok, logits

    def _call_step(self, punica, tokens, positions, rows, sample_idx, use_lora: bool):
        """One step: the jitted call, or (aot_calls) the bucket's Compiled program, compiled first
        if it is the bucket's first step. Returns (cache, next tokens, logits).

        The key holds everything besides the state's structure (fixed per step function: the dict
        is rebuilt with it) that selects a program: the tokens' (rows, length) -- positions, rows
        and sample_idx follow from it, all int32 arrays built the same way every step --, whether
        the step gathers KV rows (rows given: prefill) and the static LoRA on/off and pair bucket
        (the wrapper's pytree).
        """
        state = self._state_leaves if use_lora else ((), self._state_leaves[1])     # the base step: no adapters
        args = (state, self.cache, punica, tokens, positions, rows, sample_idx)
        if not self.aot_calls:
            return self._jit_step(*args, use_lora)
        key = (tokens.shape, rows is None, use_lora, punica.num_pairs if punica is not None else 0)
        program = self._programs.get(key)
        if program is None:
            program = self._jit_step.lower(*args, use_lora).compile()
            self._programs[key] = program
        try:
            return program(*args)
        except (TypeError, ValueError) as e:  # avals or tree (TypeError), shardings (ValueError) differ
            raise type(e)(f"ServingEngine: the step's arguments for the bucket {key} (tokens shape, decode, "
                          "use_lora, pair bucket) differ from those its ahead-of-time program was compiled for "
                          f"(shapes, dtypes, shardings or tree structure): {e}. ServingEngine(..., "
                          "aot_calls=False) calls the jitted step, which compiles again instead") from e

    def _prefill(self, seqs: list, use_lora: bool):
        # A row's prefill covers its prompt from q.cached on (the tokens before it are in its KV row
        # already, copied from the prefix cache), at positions q.cached, q.cached + 1, ...
        b, s = self.prefill_shape(len(seqs), max(len(q.req.prompt) - q.cached for q in seqs))
        tokens = np.zeros((b, s), np.int32)
        positions = np.broadcast_to(np.arange(s, dtype=np.int32), (b, s)).copy()
        rows = np.full(b, self.max_seqs, np.int32)          # padding rows: out of range, writes dropped
        sample = np.zeros(b, np.int32)
        token_ids = np.zeros((b, s), np.int32)
        row_ids = np.zeros(b, np.int32)
        for i, q in enumerate(seqs):
            n = len(q.req.prompt) - q.cached
            tokens[i, :n] = q.req.prompt[q.cached:]
            positions[i] += q.cached
            token_ids[i, :n] = q.lora_ids(q.cached, n)         # padded tokens: no adapter
            rows[i], sample[i], row_ids[i] = q.row, n - 1, token_ids[i, n - 1]
        pairs = None
        if use_lora and any(q.req.adapters()[1] is not None for q in seqs):
            entries = [((), ())] * (b * s)                     # padded tokens and rows: no adapter
            rows_e = [((), ())] * b
            for i, q in enumerate(seqs):
                n = len(q.req.prompt) - q.cached
                entries[i * s:i * s + n] = [q.pair_entry if lid else ((), ()) for lid in token_ids[i, :n]]
                rows_e[i] = entries[i * s + n - 1]
            pairs = ([e[0] for e in entries], [e[1] for e in entries], [e[0] for e in rows_e], [e[1] for e in rows_e])
        next_tok, logits = self._run(tokens, positions, rows, sample, token_ids.reshape(-1), row_ids, True, use_lora,
                                     pairs)
        return [(q, i) for i, q in enumerate(seqs)], next_tok, logits

    def _reuse_prefixes(self, seqs: list) -> None:
        """Looks each admitted request's base-computed prefix up in the prefix cache, sets q.cached
        and copies the cached blocks into its KV row (before its prefill)."""
        if self.prefix_cache is None:
            return
        loads = []
        for q in seqs:
            q.cached, slots = self.prefix_cache.lookup(q.req.prompt, q.base_len)
            if slots:
                loads.append((q.row, q.cached, slots))
        self.cache = self.prefix_cache.load(self.cache, loads)

    def _decode(self, by_row: list, use_lora: bool):
        m = self.max_seqs
        tokens = np.zeros((m, 1), np.int32)
        positions = np.zeros((m, 1), np.int32)
        ids = np.zeros(m, np.int32)
        entries = [((), ())] * m
        live = []
        for r, q in enumerate(by_row):
            if q is None or q.done:
                continue
            tokens[r, 0] = q.tokens[-1]
            positions[r, 0] = len(q.req.prompt) + len(q.tokens) - 1
            ids[r] = q.lora_ids(int(positions[r, 0]), 1)[0]
            entries[r] = q.pair_entry if ids[r] else ((), ())
            live.append((q, r))
        if not live:
            return
        pairs = None
        if use_lora and any(q.req.adapters()[1] is not None for q, _ in live):
            pairs = ([e[0] for e in entries], [e[1] for e in entries]) * 2       # a decode row is its one token
        next_tok, logits = self._run(tokens, positions, None, np.zeros(m, np.int32), ids, ids, False, use_lora, pairs)
        self._collect(live, next_tok, logits)

    def _collect(self, pairs, next_tok, logits):
        # The one read-back, between steps (explicit, like every transfer of the loop).
        toks, lg = jax.device_get((next_tok, logits if self.keep_logits else None))
        for q, i in pairs:
            q.tokens.append(int(toks[i]))
            if lg is not None:
                q.logits.append(lg[i])

    # ------------------------------------------------------------------ public
    def generate(self, requests: Iterable[Request], *, use_lora: bool = True,
                 progress: Callable[[int, int], None] | None = None) -> list:
        """Serves `requests` to completion (greedy); returns Completions in request order.

        use_lora=False serves every request with the base model (adapter ids ignored; the "no
        adapters" baseline). progress(done, total) is called as requests finish. Concurrent calls
        from several threads run one after another (the engine's lock).
        """
        me = threading.get_ident()
        if self._owner == me:
            raise RuntimeError("ServingEngine.generate was called again from inside its own call (a progress "
                               "callback): it would interleave with the requests in flight")
        with self._lock:
            self._owner = me
            try:
                return self._generate(requests, use_lora, progress)
            finally:
                self._owner = None

    def _generate(self, requests, use_lora, progress) -> list:
        reqs = list(requests)
        self._check(reqs, bool(use_lora))
        use_lora = bool(use_lora and self.adapters is not None)
        waiting = collections.deque(range(len(reqs)))
        by_row: list = [None] * self.max_seqs
        done: dict = {}
        steps = generated = reused = 0
        t0 = time.perf_counter()
        while waiting or any(q is not None for q in by_row):
            admitted = []
            free = [r for r, q in enumerate(by_row) if q is None]
            running = {i for q in by_row if q is not None for i in q.loras} if use_lora else set()
            while waiting and len(admitted) < len(free):
                req = reqs[waiting[0]]
                ids = running | {i for q in admitted for i in q.loras} | (set(req.adapters()[0]) if use_lora else set())
                if use_lora and not self.adapters.can_activate(ids):
                    break
                longest = max([len(req.prompt)] + [len(q.req.prompt) for q in admitted])
                if self.prefill_shape(len(admitted) + 1, longest) is None:
                    break
                plain = dataclasses.replace(req, lora_id=None, lora_ids=None, lora_weights=None)
                seq = InFlight(req if use_lora else plain, waiting.popleft(), free[len(admitted)])
                lora = seq.lora if use_lora and req.lora_ids is None else 0     # (aLoRA: one adapter per request)
                if lora:
                    seq.invocation = self.adapters.invocation_tokens(lora)
                    if seq.invocation is not None:
                        seq.start = alora.invocation_start(req.prompt, seq.invocation)
                admitted.append(seq)
            if not admitted and len(free) == self.max_seqs:
                raise RuntimeError(f"request {waiting[0]} cannot be admitted into an empty batch")
            if admitted:
                if use_lora:
                    self.adapters.activate(running | {i for q in admitted for i in q.loras})
                for q in admitted:
                    by_row[q.row] = q
                self._reuse_prefixes(admitted)
                pairs, next_tok, logits = self._prefill(admitted, use_lora)
                if self.prefix_cache is not None:
                    self.prefix_cache.store(self.cache, [(q.row, q.req.prompt, q.base_len) for q in admitted])
                self._collect(pairs, next_tok, logits)
                reused += sum(q.cached for q in admitted)
                steps += 1
            if any(q is not None and not q.done for q in by_row):
                self._decode(by_row, use_lora)
                steps += 1
            for r, q in enumerate(by_row):
                if q is not None and q.done:
                    done[q.index] = q
                    generated += len(q.tokens)
                    by_row[r] = None
                    if progress is not None:
                        progress(len(done), len(reqs))
        seconds = time.perf_counter() - t0
        self.last_stats = {"requests": len(reqs), "generated_tokens": generated, "steps": steps,
                           "seconds": seconds, "tokens_per_s": generated / seconds if seconds > 0 else 0.0,
                           "prefix_reused_tokens": reused}
        out = []
        for i in range(len(reqs)):
            q = done[i]
            out.append(Completion(reqs[i].request_id if reqs[i].request_id is not None else i,
                                  list(reqs[i].prompt), reqs[i].lora_id if use_lora else None, q.tokens,
                                  np.stack(q.logits) if q.logits else None, q.cached))
        return out
