"""What every pallas_tpu module shares: interpret vs compiled, small array helpers, and the helpers
used inside the kernels (row masks, lane placement, float32 dots, row DMAs).

Interpret vs compiled: on a TPU backend the kernels are compiled (Mosaic); anywhere else they run
in TPU interpret mode (`pltpu.InterpretParams`: out-of-bounds reads raise, uninitialised memory
reads as NaN). `interpret_mode(params)` overrides the choice (the tests turn on race detection).
"""

from __future__ import annotations

import contextlib
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax._src import (
    config as _jax_config,  # the flag behind pltpu.force_tpu_interpret_mode
)
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

HIGHEST = lax.Precision.HIGHEST
DEFAULT_INTERPRET = pltpu.InterpretParams()  # out_of_bounds_reads="raise", uninitialized "nan"


# ------------------------------------------------------------------------------- interpret mode

_interpret_override: list = []


def current_interpret():
    """False (compile with Mosaic) on a TPU backend, else TPU interpret-mode params.

    `interpret_mode(p)` overrides it for the calls traced inside the context, and so do JAX's own
    `pltpu.force_tpu_interpret_mode(p)` / `pltpu.set_tpu_interpret_mode(p)`.
    """
    if _interpret_override:
        return _interpret_override[-1]
    forced = _jax_config.pallas_tpu_interpret_mode_context_manager.value  # pltpu.force_tpu_interpret_mode
    if forced is not None:
        return forced
    return False if jax.default_backend() == "tpu" else DEFAULT_INTERPRET


def partitionable() -> bool:
    """Whether the kernels traced now can run inside a custom-partitioned sub-program
    (jax_lora.ops.partition): compiled (Mosaic) or in Pallas' generic interpreter (interpret=True);
    not in TPU interpret mode, whose ordered host callbacks such a sub-program cannot carry."""
    return not isinstance(current_interpret(), pltpu.InterpretParams)


@contextlib.contextmanager
def interpret_mode(params):
    """Runs the kernels traced in this context with `interpret=params` (InterpretParams or False)."""
    _interpret_override.append(params)
    try:
        yield
    finally:
        _interpret_override.pop()


# Interpret mode compiles a large host program per kernel configuration; XLA's backend
# optimisations roughly double that compile time and buy nothing for a simulation, so the eager
# entry points jit twice: plainly for a TPU, with optimisations off for the interpreter. (Inside a
# caller's jit the caller's compile options apply.)
_INTERPRET_COMPILE_OPTIONS = {"xla_backend_optimization_level": 0,
                              "xla_llvm_disable_expensive_passes": True}


def _two_jits(fn, static_argnames):
    compiled = jax.jit(fn, static_argnames=static_argnames)
    try:
        interpreted = jax.jit(fn, static_argnames=static_argnames,
                              compiler_options=_INTERPRET_COMPILE_OPTIONS)
    except TypeError:  # an older jax without compiler_options
        interpreted = compiled

    @functools.wraps(fn)
    def call(*args, interpret, **kwargs):
        nested = any(isinstance(v, jax.core.Tracer) for v in jax.tree.leaves((args, kwargs)))
        jitted = compiled if interpret is False or nested else interpreted
        return jitted(*args, interpret=interpret, **kwargs)

    return call


# -------------------------------------------------------------------------- small array helpers

def _round_up(v: int, m: int) -> int:
    return -(-v // m) * m


def _pad_rows(a: jax.Array, rows: int, value) -> jax.Array:
    """`a` with rows appended up to `rows` (a no-op when it has them)."""
    if a.shape[0] == rows:
        return a
    pad = [(0, rows - a.shape[0])] + [(0, 0)] * (a.ndim - 1)
    return jnp.pad(a, pad, constant_values=value)


def _ranks_or_full(lora_ranks, num_slots: int, rank: int) -> jax.Array:
    if lora_ranks is None:
        return jnp.full((num_slots,), rank, jnp.int32)
    return jnp.clip(jnp.asarray(lora_ranks, jnp.int32)[:num_slots], 0, rank)


# ------------------------------------------------------------------------------- inside kernels

def _row_mask(row_slot_ref, slot) -> jax.Array:
    """(tm, 1) bool: the rows of this tile that belong to the step's group."""
    return row_slot_ref[...] == slot


def _placement(r: int, width: int, offset: int, rank) -> jax.Array:
    """(r, width) float32 0/1: column c (c < rank) of a rank block goes to lane offset + c.

    A matmul with it places a slice's (tm, r) result at a static lane offset of a packed tile, and
    its transpose extracts one; both are exact in float32 and lower on every TPU generation (no
    unaligned lane stores)."""
    c = lax.broadcasted_iota(jnp.int32, (r, width), 0)
    lane = lax.broadcasted_iota(jnp.int32, (r, width), 1)
    return ((lane == c + offset) & (c < rank)).astype(jnp.float32)


def _below(values: jax.Array, limit, axis: int) -> jax.Array:
    """values with every entry whose index along `axis` is >= limit set to 0 (a select, so NaN or
    Inf there -- rank padding, another slot's rows -- never reaches a product)."""
    index = lax.broadcasted_iota(jnp.int32, values.shape, axis)
    return jnp.where(index < limit, values, jnp.zeros_like(values))


def _window(values: jax.Array, start: int, limit, axis: int) -> jax.Array:
    """values with every entry outside [start, start + limit) along `axis` set to 0 (a select)."""
    index = lax.broadcasted_iota(jnp.int32, values.shape, axis) - start
    return jnp.where((index >= 0) & (index < limit), values, jnp.zeros_like(values))


def _dot(a, b, contract):
    """a @ b in float32; contract = (a_dim, b_dim). bf16 x bf16 goes to the MXU natively; any other
    pair is upcast to float32 at HIGHEST precision. An e4m3 (fp8 weight) block is upcast first, to
    bf16 beside a bf16 operand (exact: every e4m3 value is a bf16 value), else to float32."""
    a, b = _upcast_fp8(a, b.dtype), _upcast_fp8(b, a.dtype)
    if a.dtype == b.dtype == jnp.bfloat16:
        return lax.dot_general(a, b, ((contract[:1], contract[1:]), ((), ())),
                               preferred_element_type=jnp.float32)
    return lax.dot_general(a.astype(jnp.float32), b.astype(jnp.float32),
                           ((contract[:1], contract[1:]), ((), ())), precision=HIGHEST,
                           preferred_element_type=jnp.float32)


def _upcast_fp8(v, other):
    """v in bf16 (other bf16) or float32 when v is e4m3; otherwise v unchanged."""
    if v.dtype != jnp.float8_e4m3fn:
        return v
    return v.astype(jnp.bfloat16 if other == jnp.bfloat16 else jnp.float32)


def scales_by_slice(scales, count: int, num_slots: int, widths) -> jax.Array | None:
    """Per-slice fp8 weight scales as one float32 array per call: None when no slice has one, else
    S arrays (L, c_s) (ones for a 16-bit slice), as a tuple for the kernels' epilogues."""
    if scales is None or all(v is None for v in scales):
        return None
    if len(scales) != count:
        raise ValueError(f"weight scales must have one entry per slice ({count}), got {len(scales)}")
    return tuple(jnp.ones((num_slots, w), jnp.float32) if v is None else jnp.asarray(v, jnp.float32)
                 for v, w in zip(scales, widths))


def _rows_dma(row_tok_ref, tile, tm: int, wait: bool, make_copy) -> None:
    """For each of the tile's tm rows whose token (row_tok_ref[tile * tm + row]) is real (>= 0),
    start -- or, with wait, wait for -- the row's DMA `make_copy(tok, row)`."""
    def body(row, carry):
        tok = row_tok_ref[tile * tm + row]

        @pl.when(tok >= 0)
        def _start_or_wait():
            copy = make_copy(tok, row)
            if wait:
                copy.wait()
            else:
                copy.start()
        return carry
    lax.fori_loop(0, tm, body, 0)
