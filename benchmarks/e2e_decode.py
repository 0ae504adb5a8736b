"""Model step benchmark: a Llama-3-8B-shaped decoder with LoRA on its seven projections, in JAX and
in torch, base step against LoRA step, and the LoRA overhead against its bytes floor.

    PYTHONPATH=. python benchmarks/e2e_decode.py --out benchmarks/results        # one H200, all cases
    PYTHONPATH=. python benchmarks/e2e_decode.py --quick --out /tmp/e2e            # three step shapes
    PYTHONPATH=. python benchmarks/e2e_decode.py --cases 'dec B32' --out /tmp/e2e  # a regex over names
    PYTHONPATH=. python benchmarks/e2e_decode.py --smoke --out /tmp/e2e            # CPU, tiny model
    PYTHONPATH=. python benchmarks/e2e_decode.py --base fp8 --out /tmp/e2e-fp8     # an fp8 base model
    PYTHONPATH=. python benchmarks/e2e_decode.py --frameworks jax --jax-lora fused --out /tmp/e2e-jf
    PYTHONPATH=. python benchmarks/e2e_decode.py --base fp8 --lora-dtype fp8 --out /tmp/e2e-fp8   # and fp8 adapters

The model: 32 layers, hidden 4096, 32 query / 8 key-value heads of 128, intermediate 14336, vocab
128256, bf16, random weights (never zeros), LoRA on q, k, v, o, gate, up, down in 32 slots (every
slot filled, all at the case's rank). Both frameworks run the same weights: the JAX model owns them
and torch reads them through DLPack (one copy in memory), so both compute the same function and one
reference checks both. A step includes the embedding lookup, the final norm and the LM head on
each sequence's last position (greedy next token too), as jax_lora.serving's step does.

  * JAX: `jax_lora.models.llama.LlamaForCausalLM` after `add_lora`, the step body of
    `jax_lora.serving` under `jax.jit` (KV cache donated), `jax_lora.PunicaWrapper` with the
    Triton backend (the XLA FFI launcher). Base step: the same program with the LoRA layers off
    (no wrapper). --jax-lora fused / fused-norm: the model's fused LoRA linears
    (`jax_lora.models.llama.use_fused_lora` "gemm" / "norm": each LoRA linear one Triton GEMM with
    the expand in its epilogue over a transposed copy of its kernel, after the wrapper's shrink, or
    for qkv and gate_up after the RMSNorm kernel that also shrinks); --jax-lora auto: each LoRA
    linear fused ("gemm") where the device's tuned fused linear table says so for its layer, row
    count and rank (`lora_core.kernels.fused_linear_configs.use_fused_linear`), else the base
    product and add_lora_linear, and qkv and gate_up on the "norm" path where the table's
    `use_norm_fused` says so (`use_norm_fused_linear`); --smoke runs them in Triton's interpreter. Timed per step on
    the host: the call to `block_until_ready`, median of N steps, so JAX's dispatch of the step
    is included. --jax-call: how the step is called, `jit` (default: the jitted function, which
    looks the program up from its ~800 arguments on every call) or `aot` (each step shape's
    ahead-of-time compiled program, `jit.lower(...).compile()`, called directly, as
    `jax_lora.serving.ServingEngine` calls its steps with aot_calls=True): the two differ in the
    host's dispatch time only (meta.jax_call; "_aot" in the file names).
  * torch: a lean decoder written here (RMSNorm, rotate-half RoPE, GQA attention over a static KV
    cache with `scaled_dot_product_attention`, SiLU MLP), LoRA through
    `torch_lora.PunicaWrapper.add_lora_linear` on the fused qkv (3 slices), o, gate_up (2 slices)
    and down (--torch-lora fused / fused-norm / auto: the fused paths as JAX's, `fused_lora` and
    `auto_lora`). Each step is one CUDA graph, captured once per step shape and rank; a case's mapping
    is written with `update_metadata` (in place) before the replays. Timed with CUDA events around
    each replay, median of N.
  * Base and LoRA steps are timed alternately (base, LoRA, base, ...), so drift hits both alike.

Base model (--base): bf16 (default), or fp8: the decoder's linears (qkv, o, gate_up, down) quantized to
float8_e4m3fn with per-output-channel scales (`jax_lora.quant.quantize_model`; the embedding and the
LM head stay bf16), the adapters bf16 on top. JAX computes it weight-only, (x @ Q) * s with Q
converted inside the product (`jax_lora.quant.QuantizedLinear`). torch reads the same Q and s and
computes, by default on CUDA, `torch._scaled_mm` with each token's activations quantized to e4m3
(row-wise scales: the W8A8 path fp8 serving engines run; --torch-fp8 scaled_mm), or weight-only like
JAX (--torch-fp8 dequant; the default on the CPU). The two are different base models: the
activations' e4m3 rounding (3 mantissa bits, about 3% per product) compounds through the layers,
and the W8A8 logits differ from the weight-only ones by about 13% after 32 layers, near the check's
bound before any LoRA or bf16 error. The checks are about the LoRA step over the base each framework
runs, so each framework's reference step computes its base products as its step does: weight-only
(dequantized Q s) for JAX and torch dequant, the same `base_product` (per-token e4m3 activations,
`torch._scaled_mm`) for torch scaled_mm; the LoRA deltas are exact in both. Over the W8A8 base the
step is chaotic: a LoRA delta summed in another order rounds y to another bf16 value now and then,
that moves a token's e4m3 activation by a whole step (about 6%) in the next product, and the
difference grows through the layers. So for scaled_mm the reference runs twice, its deltas once as
(x A^T) B^T and once as x (A^T B^T) (float32 both), and the relative error between the two
(`w8a8_rounding_noise`) is the distance a correct step may be from either: the bound on torch's
error becomes max(TOL_ERR, W8A8_NOISE_FACTOR x that noise); the bound against the LoRA's effect stays
(a missing or wrong adapter misses by about the effect). Each case records, beside the checks, how
far the W8A8 base is from the weight-only one (`w8a8_base_vs_weight_only`, relative error of the
base logits), and each framework the product its reference used (`reference_product`) and its
error bound (`tol_err`).

Adapters (--lora-dtype): bf16 (default), or fp8: every slot's A and B stored in float8_e4m3fn with
one float32 scale per output channel (contract section 11: A's rank rows, B's output rows), the drawn
bf16 adapters quantised on the device by that section's rule (`quantize_rows_on_device`). JAX builds
its layers with `add_lora(..., lora_dtype="fp8")` (the scales are the layers' `lora_a_scale` /
`lora_b_scale`); torch reads the same e4m3 weights and scales through DLPack and hands the scales to
`add_lora_linear(..., lora_a_scale=, lora_b_scale=)`. The reference adds the deltas of the
dequantised weights (float32 Q * s), so the checks keep their tolerances. The floor counts the
weights at 1 byte plus their scales. vLLM's kernels are not timed beside ours then (their fp8 mode
quantises the activations as well), and torch's fused paths (--torch-lora fused*) take bf16
adapters only. Results record the adapter dtype (meta.config.lora_dtype, each case's `lora_dtype`,
"_lora-fp8" in the file names); case names stay as they are, so one --cases regex selects both.

Cases: decode steps (every sequence one token, its own request) at batch 1, 8, 32, 128, 256 with
1, 8 and 32 distinct adapters (at most the batch), rank 16 and 64; prefill of one sequence of 2048
tokens (1 adapter) and of four sequences of 2048 = 8192 tokens (1 or 4 adapters). The decode KV
cache has --max-len positions (1024) per row, positions in the middle; attention reads every
position of the row under a mask, in both frameworks. A prefill step writes its keys and values
into a cache of exactly its length and attends causally.

Floor of the LoRA overhead (docs/benchmarks.md's minimal bytes of `add_lora_linear`, summed over the
four LoRA'd linears of a layer and the 32 layers, all tokens with an adapter):
    per linear: D * (S * r * H_in + r * N) * 2       A and B of the D active adapters at rank r
              + T * H_in * 2                         x read again
              + 2 * S * T * r * 4                    float32 rank buffer written and read
              + 2 * T * N * 2                        y read and written
    (S slices of total width N, input width H_in, T tokens), floor = bytes / 4300 GB/s.

Correctness, before any time is taken: for one or two sequences of the batch, a reference step in
plain torch, run eagerly on the same weights, computes every LoRA'd linear as base output plus the
LoRA delta computed separately, (x @ A[slot].T) @ B[slot].T in float32 per adapter. The LoRA
step's logits of those sequences must match it (relative Frobenius error), the base step's must
match the reference without deltas, and the LoRA error must be small against the LoRA's effect on
the logits. A framework whose check fails reports no time for that case (and the run exits 1).

Step shapes run rank by rank (the adapters rebuilt once per rank) in SHAPE_ORDER, docs/benchmarks.md's
targets first; --budget-s skips a step shape whose projected cost would end past the budget. The
JSON is rewritten after every case, so a run cut short keeps what it measured.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import functools
import gc
import json
import math
import os
import platform
import re
import sys
import time
import zlib

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")    # JAX and torch share the GPU

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

PEAK_GBS = 4300.0
NUM_SLOTS = 32
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# the torch decoder's name of each linear -> the JAX model's (quantized with --base fp8)
QUANTIZED_LINEARS = {"qkv": "qkv_proj", "o": "o_proj", "gate_up": "gate_up_proj", "down": "down_proj"}
# Scale of B against a unit-variance LoRA path: each adapter changes its projection's output by
# about half the base output's size, so a wrong or missing delta moves the logits far outside the
# bf16 noise of a correct one (the check needs that contrast; timing does not depend on it).
B_SCALE = 0.5
# Check tolerances on the logits of the checked sequences (relative Frobenius error). A correct
# step differs from the reference by bf16 rounding carried through the layers (the attention is
# float32 in JAX, SDPA in torch; sums run in other orders): 2-4% after 32 layers on a narrow
# model on the CPU. A missing or wrong adapter moves the logits by about the LoRA's effect (~1.2).
TOL_ERR = 0.15
TOL_ERR_OVER_EFFECT = 0.2
# Over a W8A8 base (torch --torch-fp8 scaled_mm): the error bound as a multiple of the distance between
# two correct reference steps whose LoRA deltas are summed in different orders (module docstring).
W8A8_NOISE_FACTOR = 2.0
HOST_RANDOM_ELEMENTS = 1 << 24
# --jax-lora -> the JAX model's fused LoRA path (jax_lora.models.llama.use_fused_lora)
JAX_FUSED = {"linear": None, "fused": "gemm", "fused-norm": "norm", "auto": "auto"}


# ------------------------------------------------------------------------------------------ cases

@dataclasses.dataclass(frozen=True)
class Case:
    """One measured step: `rows` sequences of `seq` tokens (decode: seq 1), `adapters` distinct
    adapters among them, every slot at rank `rank`."""

    kind: str          # "dec" | "pre"
    rows: int
    seq: int
    adapters: int
    rank: int

    @property
    def tokens(self) -> int:
        return self.rows * self.seq

    @property
    def shape(self) -> tuple:
        """What a compiled program / captured graph depends on besides the rank."""
        return (self.kind, self.rows, self.seq)

    @property
    def name(self) -> str:
        where = f"B{self.rows}" if self.kind == "dec" else f"{self.rows}x{self.seq}"
        return f"{self.kind} {where} D{self.adapters} r{self.rank}"


def full_cases(ranks=(16, 64)) -> list:
    cases = []
    for r in ranks:
        for b in (1, 8, 32, 128, 256):
            for d in sorted({min(b, 1), min(b, 8), min(b, 32)}):
                cases.append(Case("dec", b, 1, d, r))
        cases.append(Case("pre", 1, 2048, 1, r))
        cases.append(Case("pre", 4, 2048, 1, r))
        cases.append(Case("pre", 4, 2048, 4, r))
    return cases


QUICK = ("dec B32 D8 r16", "dec B256 D32 r64", "pre 4x2048 D4 r16")
# Order of the step shapes within a rank: docs/benchmarks.md's model-step targets first (decode batch
# <= 32 with 8 adapters, prefill of 8192 tokens), so a run cut short by its budget has them.
SHAPE_ORDER = (("dec", 32, 1), ("dec", 8, 1), ("dec", 1, 1), ("pre", 4, 2048), ("dec", 128, 1), ("dec", 256, 1),
               ("pre", 1, 2048))


def smoke_cases() -> list:
    return [Case("dec", 4, 1, 1, 4), Case("dec", 4, 1, 2, 4), Case("dec", 4, 1, 2, 8), Case("pre", 2, 16, 2, 4)]


def model_config(smoke: bool):
    from jax_lora.models.llama import LlamaConfig
    if smoke:
        return LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-5,
                           rope_theta=500000.0)
    return LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                       num_attention_heads=32, num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-5,
                       rope_theta=500000.0, max_position_embeddings=8192)


def projections(cfg) -> dict:
    """{name: (LoRA input width, output slice widths)} of the four LoRA'd linears of a layer."""
    h, i = cfg.hidden_size, cfg.intermediate_size
    return {"qkv": (h, (cfg.q_size, cfg.kv_size, cfg.kv_size)), "o": (cfg.q_size, (h,)),
            "gate_up": (h, (i, i)), "down": (i, (h,))}


def floor_bytes(cfg, tokens: int, adapters: int, rank: int, lora_dtype: str = "bf16") -> int:
    """Minimal bytes of the LoRA path of one step (module docstring): docs/benchmarks.md's
    `add_lora_linear` bytes of every LoRA'd linear, all `tokens` with an adapter. fp8 adapters: their
    weights at 1 byte an element instead of 2, plus their float32 channel scales (`adapter_bytes`)."""
    from bench_triton import min_bytes
    per_layer = sum(min_bytes(tokens, adapters, widths, rank, H=h_in) for h_in, widths in projections(cfg).values())
    bf16_weights = adapters * adapter_bytes(cfg, rank) // cfg.num_hidden_layers
    weights = adapters * adapter_bytes(cfg, rank, lora_dtype) // cfg.num_hidden_layers
    return (per_layer - bf16_weights + weights) * cfg.num_hidden_layers


def adapter_bytes(cfg, rank: int, lora_dtype: str = "bf16") -> int:
    """Bytes of one adapter's A and B over the 7 targets and all layers: bf16, 2 bytes an element;
    fp8, 1 byte an element plus a float32 scale per channel (S * r of A's, N of B's per linear)."""
    elements = sum(rank * (len(w) * h_in + sum(w)) for h_in, w in projections(cfg).values())
    if lora_dtype != "fp8":
        return 2 * elements * cfg.num_hidden_layers
    channels = sum(len(w) * rank + sum(w) for h_in, w in projections(cfg).values())
    return (elements + 4 * channels) * cfg.num_hidden_layers


def slots_of(case: Case, seed: int) -> np.ndarray:
    """(rows,) int slot of each sequence: exactly `adapters` distinct slots, each used at least once,
    shuffled over the rows."""
    rng = np.random.default_rng(seed)
    chosen = rng.permutation(NUM_SLOTS)[: case.adapters]
    per_row = chosen[np.arange(case.rows) % case.adapters]
    return per_row[rng.permutation(case.rows)] if case.kind == "dec" else per_row


def capture_cuda_graph(step, stream):
    """`step()` captured in a CUDA graph on `stream`, after two eager calls there (Triton compiles,
    plans are built, the allocator settles), and replayed once: (graph, step's output: the tensors
    each replay writes)."""
    import torch
    stream.wait_stream(torch.cuda.current_stream())
    with torch.no_grad(), torch.cuda.stream(stream):
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    # thread_local: JAX's runtime threads may touch CUDA while this thread captures
    with torch.no_grad(), torch.cuda.graph(g, stream=stream, capture_error_mode="thread_local"):
        out = step()
    g.replay()
    torch.cuda.synchronize()
    return g, out


# ------------------------------------------------------------------------------------------ JAX model

class JaxModel:
    """The JAX model with random bf16 weights: kernels N(0, 1/in), embeddings N(0, 1), norm weights
    1 + N(0, 0.1^2); after `add_lora` on the 7 targets with NUM_SLOTS slots. `set_rank(r)` fills every
    slot with a random rank-r adapter: A (S, L, r, in) ~ N(0, 1/in), B (L, out, r) ~ N(0, B_SCALE^2/r),
    lora_ranks r. lora_dtype "fp8": the layers store A and B in e4m3 with per-channel float32 scales
    (`add_lora(..., lora_dtype="fp8")`), the drawn bf16 adapters quantised by `quantize_rows_on_device`."""

    def __init__(self, cfg, seed: int = 0, base: str = "bf16", fused=None, lora_dtype: str = "bf16"):
        import jax.numpy as jnp
        from flax import nnx

        from jax_lora import quant
        from jax_lora.models import llama

        self.cfg = cfg
        self._rng = np.random.default_rng(seed)
        self._torch_gen = None
        self.model = self.random_model(lambda: llama.LlamaForCausalLM(cfg, dtype=jnp.bfloat16, rngs=nnx.Rngs(0)))
        if base == "fp8":                   # the decoder's linears; the embedding and LM head stay bf16
            quant.quantize_model(self.model, "fp8", target_modules=list(QUANTIZED_LINEARS.values()))
        self.lora_dtype = lora_dtype
        llama.add_lora(self.model, max_loras=NUM_SLOTS, max_rank=1, target_modules=LORA_TARGETS,
                       dtype=jnp.bfloat16, fused=fused, lora_dtype="fp8" if lora_dtype == "fp8" else None)
        self.rank = None

    def random_model(self, make):
        """The model `make()` builds, with random weights: kernels N(0, 1/in) (expert weights (E, in,
        out): in = shape[-2]), embeddings N(0, 1), norm weights 1 + N(0, 0.1^2)."""
        import jax
        from flax import nnx
        graphdef, state = nnx.split(nnx.eval_shape(make))
        leaves, treedef = jax.tree_util.tree_flatten_with_path(state)
        specs = []
        for path, leaf in leaves:
            name = jax.tree_util.keystr(path)
            if "norm" in name:
                specs.append((tuple(leaf.shape), leaf.dtype.name, 0.1, 1.0))
            else:
                fan_in = leaf.shape[-2] if leaf.ndim == 3 else leaf.shape[0]
                scale = 1.0 if "embedding" in name else 1.0 / math.sqrt(fan_in)
                specs.append((tuple(leaf.shape), leaf.dtype.name, scale, 0.0))
        return nnx.merge(graphdef, jax.tree_util.tree_unflatten(treedef, self.random(specs)))

    def random(self, specs) -> list:
        """Arrays for (shape, dtype name, scale, offset) specs: N(offset, scale^2), fresh keys.
        Drawn on the GPU by torch, array by array; a small model's (under HOST_RANDOM_ELEMENTS in
        all) on the host with NumPy."""
        import jax.numpy as jnp
        specs = tuple(specs)
        if sum(math.prod(shape) for shape, *_ in specs) < HOST_RANDOM_ELEMENTS:
            return [jnp.asarray((self._rng.standard_normal(shape, np.float32) * scale + offset).astype(jnp.dtype(dt)))
                    for shape, dt, scale, offset in specs]
        return [self._random_cuda(shape, jnp.dtype(dt), scale, offset) for shape, dt, scale, offset in specs]

    def _random_cuda(self, shape, dtype, scale, offset):
        """One array drawn by torch's CUDA generator (gigabytes per second; JAX's threefry took
        minutes for the model's 16 GB) and copied into a buffer JAX owns (so that it can be donated)."""
        import jax.dlpack
        import jax.numpy as jnp
        import torch
        if self._torch_gen is None:
            self._torch_gen = torch.Generator(device="cuda").manual_seed(int(self._rng.integers(1 << 62)))
        t = torch.randn(shape, dtype=torch.float32, device="cuda", generator=self._torch_gen)
        t = t.mul_(scale).add_(offset).to(getattr(torch, dtype.name))
        torch.cuda.synchronize()
        out = jnp.copy(jax.dlpack.from_dlpack(t))
        out.block_until_ready()
        return out

    def lora_layers(self) -> dict:
        from jax_lora import nn as lnn
        return lnn.lora_layers(self.model)

    def lora_holders(self) -> list:
        """[(holder, its layers)] of the adapter arrays: each LoRA bank (jax_lora.lora_bank: a
        projection kind's variables stacked over the decoder layers, `add_lora`'s default) with its
        layers in layer order, or a layer that holds its own with [layer]."""
        holders, banks = [], {}
        for layer in self.lora_layers().values():
            if not getattr(layer, "banked", False):
                holders.append((layer, [layer]))
            elif id(layer.bank) not in banks:
                banks[id(layer.bank)] = (layer.bank, [layer])
                holders.append(banks[id(layer.bank)])
            else:
                banks[id(layer.bank)][1].append(layer)
        return holders

    def set_rank(self, rank: int) -> None:
        import jax.numpy as jnp
        holders = self.lora_holders()
        fp8 = self.lora_dtype == "fp8"
        for holder, _ in holders:                         # free the previous rank's weights first
            holder.lora_a.set_value(jnp.zeros((0,), holder.lora_a.get_value().dtype))
            holder.lora_b.set_value(jnp.zeros((0,), holder.lora_b.get_value().dtype))
            if fp8:
                holder.lora_a_scale.set_value(jnp.zeros((0,), jnp.float32))
                holder.lora_b_scale.set_value(jnp.zeros((0,), jnp.float32))
        specs, leads = [], []
        for holder, layers in holders:
            layer = layers[0]
            lead = (len(layers),) if holder is not layer else ()     # a bank's leading layer axis
            leads.append(lead)
            specs.append(((*lead, len(layer.output_slices), NUM_SLOTS, rank, layer.in_features), "bfloat16",
                          1.0 / math.sqrt(layer.in_features), 0.0))
            specs.append(((*lead, NUM_SLOTS, layer.out_features, rank), "bfloat16", B_SCALE / math.sqrt(rank), 0.0))
        arrays = self.random(specs)
        for i, ((holder, layers), lead) in enumerate(zip(holders, leads)):
            a, b = arrays[2 * i], arrays[2 * i + 1]
            arrays[2 * i] = arrays[2 * i + 1] = None      # the bf16 draws are freed as the holders take theirs
            if fp8:
                (a, a_scale), (b, b_scale) = quantize_rows_on_device(a), quantize_rows_on_device(b)
                holder.lora_a_scale.set_value(a_scale)
                holder.lora_b_scale.set_value(b_scale)
            holder.lora_a.set_value(a)
            holder.lora_b.set_value(b)
            holder.lora_ranks.set_value(jnp.full((*lead, NUM_SLOTS), rank, jnp.int32))
            for layer in layers:
                layer.max_rank = rank
        self.rank = rank

    def states(self):
        """(step key, LoRA leaves, leaves of the rest of the state, base LoRA leaves): the states as
        flat lists of arrays, the form the step takes (as jax_lora.serving passes its state: jax.jit
        flattens an nnx.State in Python on every call, a list of arrays in C++); the step key
        (graphdef, LoRA tree structure, rest's structure) is what `_jax_step` closes over. The base
        LoRA leaves are empty arrays in place of the adapter weights, which the base step never
        reads, so one compiled base program serves every rank."""
        import jax
        import jax.numpy as jnp
        from flax import nnx

        from jax_lora import nn as lnn
        graphdef, lora_state, rest = nnx.split(self.model, lnn.LoRAWeight, ...)
        lora_leaves, lora_def = jax.tree.flatten(lora_state)
        rest_leaves, rest_def = jax.tree.flatten(rest)
        empty = [jnp.zeros((0,), a.dtype) for a in lora_leaves]
        return (graphdef, lora_def, rest_def), lora_leaves, rest_leaves, empty


def _torch_lora(layer, name: str):
    """A JAX LoRA layer's adapter variable `name` as a torch view (DLPack, no copy): of the layer's
    own array, or of its entry in its bank's layer-stacked array (jax_lora.lora_bank)."""
    import torch
    if getattr(layer, "banked", False):
        return torch.from_dlpack(getattr(layer.bank, name).get_value())[layer.layer_index]
    return torch.from_dlpack(getattr(layer, name).get_value())


@functools.cache
def _quantize_rows_jit():
    import jax
    import jax.numpy as jnp

    def quantize(w):
        w = w.astype(jnp.float32)
        amax = jnp.max(jnp.abs(w), axis=-1)
        scale = jnp.where(amax > 0, amax / 448.0, 1.0).astype(jnp.float32)
        q = jnp.clip(w / scale[..., None], -448.0, 448.0).astype(jnp.float8_e4m3fn)
        return q, scale
    return jax.jit(quantize)


def quantize_rows_on_device(w):
    """(Q (..., c, k) float8_e4m3fn, s (..., c) float32) of the weights w (..., c, k): contract section
    11's rule, one scale per row c (A's rank rows, B's output rows), s = amax(|w[..., c, :]|) / 448 (1
    for a zero row), Q = e4m3(clip(w / s, -448, 448)). `jax_lora.quant.quantize_rows` computes the
    same on the host in NumPy; here it runs where w lives (the 8B model's adapters are gigabytes),
    under jit, so a scale may be one float32 ulp from the host's (XLA may divide by 448 as a product
    with its reciprocal): both frameworks and the reference read these same Q and s."""
    return _quantize_rows_jit()(w)


def _jax_step(graphdef, lora_def, rest_def, lora_leaves, rest_leaves, cache, punica, tokens, positions, rows,
              sample_idx, use_lora):
    """jax_lora.serving's step body: the model under `punica_context`, greedy next tokens.

    The state arrives as flat lists of arrays (`JaxModel.states`) and is rebuilt with the closed-over
    tree structures.

    tokens, positions (B, S) int32; rows (B,) int32 cache rows; sample_idx (B,) int32 position of
    each row's logits. Returns (new cache, next tokens (B,) int32, logits (B, V) float32)."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from jax_lora import nn as lnn
    model = nnx.merge(graphdef, jax.tree.unflatten(lora_def, lora_leaves), jax.tree.unflatten(rest_def, rest_leaves))
    with lnn.punica_context(punica if use_lora else None):
        logits, cache = model(tokens, positions, cache=cache, rows=rows, sample_idx=sample_idx)
    return cache, jnp.argmax(logits, axis=-1).astype(jnp.int32), logits


# ------------------------------------------------------------------------------------------ torch model

@dataclasses.dataclass(frozen=True)
class Fp8Weight:
    """An fp8 base linear as torch reads it: q (in, out) float8_e4m3fn and s (out,) float32 (views
    of the JAX layer's arrays), and q_col, q in column-major order (what `torch._scaled_mm` takes as
    its second operand; None unless the scaled_mm product is used)."""

    q: object
    s: object
    q_col: object = None


def base_product(x, weight, fp8_product: str = "dequant"):
    """The base linear's output (T, out) in x's dtype.

    A bf16 kernel: x @ W. An `Fp8Weight`:
      dequant    (x @ q.to(x.dtype)) * s, in float32 after the product, rounded to x's dtype
                 (jax_lora.quant.QuantizedLinear's math);
      scaled_mm  x_q = e4m3(x / a) with a = max|x_t| / 448 per token t, then
                 torch._scaled_mm(x_q, q_col, scale_a=a (T, 1), scale_b=s (1, out)) in bf16 (CUDA,
                 and torch's CPU kernel). Each token's quantization reads that token alone, so a
                 reference step over some of the rows computes those rows' products exactly so.
    """
    import torch
    if not isinstance(weight, Fp8Weight):
        return x @ weight
    if fp8_product == "scaled_mm":
        amax = x.abs().amax(dim=-1, keepdim=True).float().clamp_min(1e-12)
        a = amax / 448.0
        x_q = (x.float() / a).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
        return torch._scaled_mm(x_q, weight.q_col, scale_a=a, scale_b=weight.s[None, :], out_dtype=x.dtype)
    return ((x @ weight.q.to(x.dtype)).float() * weight.s).to(x.dtype)


class TorchDecoder:
    """A Llama decoder step in plain torch over the JAX model's weights (DLPack views, no copies).

    Kernels keep JAX's (in, out) layout, so a projection is `x @ W`; an fp8 base's linears are
    `Fp8Weight`s (`base_product`). Caches are per layer
    (k, v), each (R, kv_heads, M, head_dim) bf16: a decode step writes its token's key/value at
    (row, position) and attends over the row's M positions with a mask (position <= its own); a
    prefill step writes positions 0..S-1 and attends causally within the sequence.
    """

    lora_scales = None      # fp8 adapters' channel scales (load_lora), None for 16-bit adapters

    def __init__(self, cfg, jm: JaxModel, device, fp8_product: str = "dequant"):
        import torch
        self.cfg, self.device = cfg, device
        m = jm.model.model

        def t(var):
            return torch.from_dlpack(var.get_value())

        def linear(layer):
            base = layer.base
            if not hasattr(base, "qkernel"):
                return t(base.kernel)
            q, s = t(base.qkernel), t(base.scale)
            return Fp8Weight(q, s, q.t().contiguous().t() if fp8_product == "scaled_mm" else None)

        self.embed = t(m.embed_tokens.embedding)                               # (V, H)
        self.norm = t(m.norm.weight)                                           # (H,)
        self.lm_head = t(jm.model.lm_head.kernel)                              # (H, V)
        self.layers = []
        for layer in m.layers:
            at, mlp = layer.self_attn, layer.mlp
            self.layers.append(dict(ln1=t(layer.input_layernorm.weight), ln2=t(layer.post_attention_layernorm.weight),
                                    qkv=linear(at.qkv_proj), o=linear(at.o_proj),
                                    gate_up=linear(mlp.gate_up_proj), down=linear(mlp.down_proj)))
        self._jm = jm
        self.lora = None
        self.fp8_product = fp8_product       # an fp8 base's product: "scaled_mm" (W8A8) or "dequant"
        d = cfg.head_dim
        self.inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float32, device=device) / d))

    def load_lora(self) -> None:
        """Views of the JAX model's current adapters, per layer and linear: (A slices (L, r, in),
        B slices (L, n_s, r) strided views of the fused B, slice widths, lora_ranks (L,) int32).
        fp8 adapters: `lora_scales`, per layer and linear, (A's channel scales per slice (L, r), B's
        per slice (L, n_s): views of the fused (L, out) scales, channels contiguous, rows strided),
        else None."""
        self.lora = []
        self.lora_scales = None
        for layer in self._jm.model.model.layers:
            per, scales = {}, {}
            for name, mod in (("qkv", layer.self_attn.qkv_proj), ("o", layer.self_attn.o_proj),
                              ("gate_up", layer.mlp.gate_up_proj), ("down", layer.mlp.down_proj)):
                a, b = _torch_lora(mod, "lora_a"), _torch_lora(mod, "lora_b")
                slices, off, bs = tuple(mod.output_slices), 0, []
                for n in slices:
                    bs.append(b[:, off:off + n, :])
                    off += n
                per[name] = (tuple(a[s] for s in range(len(slices))), tuple(bs), slices,
                             _torch_lora(mod, "lora_ranks"))
                if mod.lora_dtype == "fp8":
                    sa = _torch_lora(mod, "lora_a_scale")                                  # (S, L, r)
                    sb = _torch_lora(mod, "lora_b_scale")                                  # (L, out)
                    offsets = np.cumsum((0,) + slices)
                    scales[name] = (tuple(sa[s] for s in range(len(slices))),
                                    tuple(sb[:, int(lo):int(hi)] for lo, hi in zip(offsets[:-1], offsets[1:])))
            self.lora.append(per)
            if scales:
                self.lora_scales = (self.lora_scales or []) + [scales]

    def scales_of(self, i: int, name: str) -> dict:
        """The keyword arguments that hand layer i's `name` adapters' fp8 scales to the wrapper
        (`lora_a_scale`, `lora_b_scale`), or none for 16-bit adapters."""
        if self.lora_scales is None:
            return {}
        a_scales, b_scales = self.lora_scales[i][name]
        return dict(lora_a_scale=a_scales, lora_b_scale=b_scales)

    def dequantized(self, i: int, name: str, slot: int) -> tuple:
        """Slot `slot`'s adapter of layer i's `name` in float32, (A slices (r, in), B slices (n_s, r)):
        fp8 weights times their channel scales (the weights the fp8 step stands for), 16-bit ones
        cast."""
        a, b, _slices, _ranks = self.lora[i][name]
        if self.lora_scales is None:
            return tuple(w[slot].float() for w in a), tuple(w[slot].float() for w in b)
        a_scales, b_scales = self.lora_scales[i][name]
        return (tuple(w[slot].float() * sc[slot][:, None] for w, sc in zip(a, a_scales)),
                tuple(w[slot].float() * sc[slot][:, None] for w, sc in zip(b, b_scales)))

    def drop_lora(self) -> None:
        self.lora = None
        self.lora_scales = None
        self.vllm_weights = None

    def load_vllm_weights(self) -> None:
        """Contiguous copies of the current adapters' slices for vLLM's kernels (they take no
        strided views): per layer and linear, (A slices (L, r, in), B slices (L, n_s, r))."""
        self.vllm_weights = [{name: (tuple(a.contiguous() for a in a_s), tuple(b.contiguous() for b in b_s))
                              for name, (a_s, b_s, _slices, _ranks) in per.items()} for per in self.lora]

    def _rms(self, x, w):
        import torch
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.cfg.rms_norm_eps)
        return w * xf.to(x.dtype)

    def _rope(self, x, cos, sin):
        """x (B, S, heads, d) bf16; cos, sin (B, S, 1, d) float32."""
        import torch
        d = x.shape[-1]
        xf = x.float()
        rot = torch.cat([-xf[..., d // 2:], xf[..., : d // 2]], dim=-1)
        return (xf * cos + rot * sin).to(x.dtype)

    def forward(self, tokens, positions, kv, rows=None, lora=None):
        """One step. tokens, positions (B, S) int64 (prefill: positions 0..S-1); kv: per layer
        (k, v) caches (R, kv_heads, M, head_dim); rows (B,) int64 cache rows, or None for rows
        0..B-1 (read as a view); lora(layer, name, y (T, N), x (T, H_in)) adds the LoRA term to y
        in place, or None for the base step. Returns (logits (B, V) float32 at each row's last
        position, greedy next tokens (B,) int64)."""
        import torch
        import torch.nn.functional as F
        cfg = self.cfg
        B, S = tokens.shape
        H, nh, nkv, hd = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        Q, KV = cfg.q_size, cfg.kv_size
        T = B * S
        freqs = positions.float()[..., None] * self.inv_freq                  # (B, S, d/2)
        emb = torch.cat([freqs, freqs], dim=-1)[:, :, None, :]
        cos, sin = emb.cos(), emb.sin()
        if rows is None:
            write_rows = torch.arange(B, device=tokens.device)
        else:
            write_rows = rows
        x = F.embedding(tokens, self.embed)                                    # (B, S, H)
        for i, w in enumerate(self.layers):
            qkv = self._norm_linear(i, "qkv", x.view(T, H), w["ln1"], w["qkv"], lora)
            q = self._rope(qkv[:, :Q].view(B, S, nh, hd), cos, sin)
            k = self._rope(qkv[:, Q:Q + KV].view(B, S, nkv, hd), cos, sin)
            v = qkv[:, Q + KV:].view(B, S, nkv, hd)
            kc, vc = kv[i]
            if S == 1:
                pos = positions[:, 0]
                kc[write_rows, :, pos] = k[:, 0]
                vc[write_rows, :, pos] = v[:, 0]
                keys, values = (kc[:B], vc[:B]) if rows is None else (kc[rows], vc[rows])
                mask = (torch.arange(kc.shape[2], device=kc.device)[None, :] <= pos[:, None])[:, None, None, :]
                # GQA with one query position: the g query heads of a kv head are g query rows
                # against that head's keys (same mask), so SDPA needs no head expansion.
                qg = q.view(B, nkv, nh // nkv, hd)
                att = F.scaled_dot_product_attention(qg, keys, values, attn_mask=mask).reshape(T, Q)
            else:
                kt, vt = k.transpose(1, 2), v.transpose(1, 2)                  # (B, nkv, S, hd)
                if rows is None:
                    kc[:B, :, :S] = kt
                    vc[:B, :, :S] = vt
                else:
                    kc[rows, :, :S] = kt
                    vc[rows, :, :S] = vt
                att = F.scaled_dot_product_attention(q.transpose(1, 2), kt, vt, is_causal=True, enable_gqa=True)
                att = att.transpose(1, 2).reshape(T, Q)
            o = self._linear(i, "o", att, w["o"], lora)
            x = x + o.view(B, S, H)
            x = x + self._mlp(i, w, x.view(T, H), lora).view(B, S, H)
        last = self._rms(x[:, S - 1], self.norm)                               # (B, H)
        logits = (last @ self.lm_head).float()
        return logits, logits.argmax(-1)

    def _mlp(self, i, w, x, lora):
        """Layer i's feed-forward of the residual x (T, H): RMSNorm, gate_up, SiLU-gated, down
        (benchmarks/e2e_moe.py's decoder replaces it by a mixture of experts)."""
        import torch.nn.functional as F
        inter = self.cfg.intermediate_size
        gu = self._norm_linear(i, "gate_up", x, w["ln2"], w["gate_up"], lora)
        act = F.silu(gu[:, :inter]) * gu[:, inter:]
        return self._linear(i, "down", act, w["down"], lora)

    # ---------------------------------------------------------------- LoRA paths
    def _norm_linear(self, i, name, x, norm_weight, weight, lora):
        """RMSNorm(x) * norm_weight @ weight with the LoRA hook: a hook with `norm_linear` computes
        the whole (the fused path: the norm with the shrink, the GEMM with the expand); else the
        norm here and `_linear`."""
        if lora is not None and hasattr(lora, "norm_linear"):
            return lora.norm_linear(i, name, x, norm_weight, weight)
        return self._linear(i, name, self._rms(x, norm_weight), weight, lora)

    def _linear(self, i, name, x, weight, lora):
        """x @ weight (`base_product`) with the LoRA hook: lora(i, name, y, x) after the product; a
        hook with `linear` computes the product itself (the fused path); an overlapping hook (one
        with `begin`) gets lora.begin(i, name, x) before the product and lora.end(i, name, y, token)
        after it."""
        if lora is not None and hasattr(lora, "linear"):
            return lora.linear(i, name, x, weight)
        if lora is not None and hasattr(lora, "begin"):
            token = lora.begin(i, name, x)
            y = base_product(x, weight, self.fp8_product)
            lora.end(i, name, y, token)
            return y
        y = base_product(x, weight, self.fp8_product)
        if lora is not None:
            lora(i, name, y, x)
        return y

    def wrapper_lora(self, punica):
        """The LoRA hook through `torch_lora.PunicaWrapper.add_lora_linear` (scale 1: B holds it)."""
        def lora(i, name, y, x):
            a, b, slices, ranks = self.lora[i][name]
            punica.add_lora_linear(y, x, a, b, None, 1.0, slices, lora_ranks=ranks, **self.scales_of(i, name))
        return lora

    def vllm_lora(self, vk, meta):
        """The LoRA hook through vLLM 0.33's kernels, as its PunicaWrapperGPU.add_lora_linear runs
        them (benchmarks/vllm_kernels.py; scale 1: B holds it)."""
        import vllm_kernels

        def lora(i, name, y, x):
            a, b = self.vllm_weights[i][name]
            vllm_kernels.add_lora_linear(vk, meta, y, x, a, b, 1.0)
        return lora

    def overlapped_lora(self, punica, side):
        """An experiment (--torch-lora overlap): the shrink (`add_shrink`, it needs only x) on the
        side stream `side` while the base product runs, the expand (`add_expand`) after both; a
        captured step replays the fork and join as parallel graph branches."""
        import torch
        buffers: dict = {}
        lora_of, scales_of = self.lora, self.scales_of

        class Overlap:
            @staticmethod
            def begin(i, name, x):
                a, _b, _slices, ranks = lora_of[i][name]
                key = (i, name, x.shape[0])
                buf = buffers.get(key)
                if buf is None:
                    buf = buffers[key] = torch.empty((len(a), x.shape[0], a[0].shape[-2]), dtype=torch.float32,
                                                     device=x.device)
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    punica.add_shrink(buf, x, a, 1.0, lora_ranks=ranks,
                                      **{k: v for k, v in scales_of(i, name).items() if k == "lora_a_scale"})
                return buf

            @staticmethod
            def end(i, name, y, buf):
                _a, b, slices, ranks = lora_of[i][name]
                torch.cuda.current_stream().wait_stream(side)
                punica.add_expand(y, buf, b, None, slices, 0, True, lora_ranks=ranks,
                                  **{k: v for k, v in scales_of(i, name).items() if k == "lora_b_scale"})
        return Overlap()

    def fused_lora(self, punica, fuse_norm: bool):
        """The fused path (--torch-lora fused / fused-norm): each LoRA linear is one Triton GEMM
        with the expand in its epilogue (`torch_lora.ops.fused_linear.gemm_lora`, replacing cuBLAS
        and the expand kernel), its shrink before it: `punica.add_shrink` for o and down, and with
        fuse_norm the RMSNorm kernel that also shrinks (`rms_norm_shrink`) for qkv and gate_up, so
        that no LoRA kernel runs between the norm and the GEMM."""
        import torch

        from torch_lora.ops.fused_linear import gemm_lora, norm_shrink_config, rms_norm_shrink
        lora_of, eps = self.lora, self.cfg.rms_norm_eps
        buffers: dict = {}
        # nn.Linear's (out, in) layout, K contiguous, as the kernel's tiles are read (the JAX
        # model's (in, out) kernels seen transposed would read BLOCK_N-wide runs): copies, once
        if not hasattr(self, "_weights_nk"):
            self._weights_nk = [{name: w[name].t().contiguous() for name in ("qkv", "o", "gate_up", "down")}
                                for w in self.layers]
        weights_nk = self._weights_nk

        def buffer(key, shape, dtype, device):
            t = buffers.get(key)
            if t is None or tuple(t.shape) != tuple(shape):
                t = buffers[key] = torch.empty(shape, dtype=dtype, device=device)
            return t

        class Fused:
            @staticmethod
            def linear(i, name, x, weight):
                a, b, slices, ranks = lora_of[i][name]
                buf = buffer((name, "buf", x.shape[0]), (len(a), x.shape[0], a[0].shape[-2]), torch.float32,
                             x.device)
                punica.add_shrink(buf, x, a, 1.0, lora_ranks=ranks)
                return gemm_lora(x, weights_nk[i][name], None, buf, b, punica.token_lora_indices, slices,
                                 lora_ranks=ranks)

            if fuse_norm:
                @staticmethod
                def norm_linear(i, name, x, norm_weight, weight):
                    a, b, slices, ranks = lora_of[i][name]
                    m = x.shape[0]
                    planes = norm_shrink_config(m, a[0].shape[-2])["SPLIT_K"]
                    buf = buffer((name, "planes", m), (planes, len(a), m, a[0].shape[-2]), torch.float32, x.device)
                    xn = buffer((name, "xn", m), (m, x.shape[1]), x.dtype, x.device)
                    slots = punica.token_lora_indices
                    rms_norm_shrink(x, norm_weight, eps, a, slots, 1.0, out=xn, buf=buf, lora_ranks=ranks)
                    return gemm_lora(xn, weights_nk[i][name], None, buf, b, slots, slices, lora_ranks=ranks)
        return Fused()

    def auto_lora(self, punica):
        """--torch-lora auto: each LoRA linear takes the fused path of `fused_lora` (the shrink, then
        gemm_lora) where the device's tuned fused linear table says it beats today's path for its
        layer (K, slices), row count and rank (`lora_core.kernels.fused_linear_configs.use_fused_linear`,
        logged once per choice), else today's (the base product, then add_lora_linear). The layers
        behind an RMSNorm (qkv, gate_up) take `fused_lora(fuse_norm=True)`'s norm path (the norm
        with the shrink, then gemm_lora) where the table's `use_norm_fused` says it beats the
        step's norm + today's path (`use_norm_fused_linear`), else the norm here and the choice
        above. Without a table every linear takes today's path."""
        from lora_core.kernels.fused_linear_configs import use_fused_linear, use_norm_fused_linear
        fused, today, lora_of, fp8_product = self.fused_lora(punica, True), self.wrapper_lora(punica), self.lora, \
            self.fp8_product
        rms = self._rms
        chosen: dict = {}

        def choice(policy, i, name, x):
            a, _b, slices, _ranks = lora_of[i][name]
            key = (policy.__name__, name, x.shape[0])
            if key not in chosen:
                chosen[key] = policy((int(x.shape[1]), tuple(int(w) for w in slices)), int(x.shape[0]),
                                     int(a[0].shape[-2]))
            return chosen[key]

        class Auto:
            @staticmethod
            def linear(i, name, x, weight):
                if choice(use_fused_linear, i, name, x):
                    return fused.linear(i, name, x, weight)
                y = base_product(x, weight, fp8_product)
                today(i, name, y, x)
                return y

            @staticmethod
            def norm_linear(i, name, x, norm_weight, weight):
                if choice(use_norm_fused_linear, i, name, x):
                    return fused.norm_linear(i, name, x, norm_weight, weight)
                return Auto.linear(i, name, rms(x, norm_weight), weight)
        return Auto()

    def reference_lora(self, groups, regroup: bool = False):
        """The LoRA hook of the reference: for each (slot, token indices) of `groups`, the delta
        (x @ A_s[slot].T) @ B_s[slot].T in float32 per slice (regroup: x @ (A_s[slot].T @ B_s[slot].T),
        the same sum in another order), added to y and rounded to y's dtype (fp8 adapters: A and B
        dequantised, `dequantized`)."""
        def lora(i, name, y, x):
            slices = self.lora[i][name][2]
            for slot, tok in groups:
                xs = x[tok].float()
                a, b = self.dequantized(i, name, int(slot))
                off = 0
                for s, n in enumerate(slices):
                    delta = xs @ (a[s].T @ b[s].T) if regroup else (xs @ a[s].T) @ b[s].T
                    y[tok, off:off + n] = (y[tok, off:off + n].float() + delta).to(y.dtype)
                    off += n
        return lora


# ------------------------------------------------------------------------------------------ one step shape

class Shape:
    """Inputs and caches of one step shape (kind, rows, seq), shared by both frameworks.

    Decode rows are the rows of the decode caches (`Bench.dec_cache`, made for this B when the
    shape runs), each at its own position near the middle of the M positions; prefill has caches of
    its own (rows, seq). Both frameworks' steps read cache rows 0..B-1 in place (JAX: rows=None)."""

    def __init__(self, bench, kind: str, rows: int, seq: int):
        import jax
        import jax.numpy as jnp
        import torch
        self.kind, self.rows, self.seq = kind, rows, seq
        self.key = (kind, rows, seq)
        cfg = bench.cfg
        rng = np.random.default_rng(1000 + rows * 7 + seq)
        tokens = rng.integers(0, cfg.vocab_size, (rows, seq)).astype(np.int32)
        if kind == "dec":
            pos = bench.dec_positions[:rows, None].astype(np.int32)
            sample = np.zeros(rows, np.int32)
        else:
            pos = np.broadcast_to(np.arange(seq, dtype=np.int32), (rows, seq)).copy()
            sample = np.full(rows, seq - 1, np.int32)
        self.bench = bench
        tokens_j, pos_j, sample_j = jax.device_put((jnp.asarray(tokens), jnp.asarray(pos), jnp.asarray(sample)))
        self.j_args = (tokens_j, pos_j, None, sample_j)
        dev = bench.device
        self.t_tokens = torch.from_numpy(tokens.astype(np.int64)).to(dev)
        self.t_positions = torch.from_numpy(pos.astype(np.int64)).to(dev)
        if kind == "pre":
            self.j_cache, self._t_cache = bench.make_caches(rows, seq)

    @property
    def t_cache(self):
        """The torch caches of this shape (decode: the Bench's, made for this B by ensure_dec_cache)."""
        return self.bench.t_dec_cache if self.kind == "dec" else self._t_cache

    def mapping(self, slots: np.ndarray):
        """LoRAMapping of the step: LoRA id slot + 1 for every token of each row."""
        from lora_core.host_mapping import LoRAMapping
        ids = (slots + 1).astype(int)
        return LoRAMapping(tuple(np.repeat(ids, self.seq).tolist()), tuple(ids.tolist()), self.kind == "pre")


# ------------------------------------------------------------------------------------------ benchmark

def rel_err(got, ref) -> float:
    got, ref = np.asarray(got, np.float64), np.asarray(ref, np.float64)
    if not np.all(np.isfinite(got)):
        return float("inf")
    return float(np.linalg.norm(got - ref) / np.linalg.norm(ref))


class Bench:
    def __init__(self, args, cfg, cases):
        import torch
        self.args, self.cfg, self.cases = args, cfg, cases
        self.smoke = args.smoke
        self.cuda = not args.smoke
        self.device = torch.device("cuda" if self.cuda else "cpu")
        self.frameworks = [f for f in args.frameworks.split(",") if f]
        self.steps = args.steps
        self.t_start = getattr(args, "t_start", None) or time.perf_counter()
        self.phases = _Phases(self.t_start)
        t0 = time.perf_counter()
        self.jm = JaxModel(cfg, base=args.base, fused=JAX_FUSED[getattr(args, "jax_lora", "linear")],
                           lora_dtype=args.lora_dtype)
        self._sync_jax()
        from jax_lora import quant
        self.quantized_linears = len(quant.quantized_layers(self.jm.model))     # 4 per layer with --base fp8
        # what the JAX layers store (torch reads the same arrays): e4m3 weights and float32 scales with fp8
        self.adapter_storage = sorted({f"{name}:{getattr(layer, name).get_value().dtype}"
                                       for layer in self.jm.lora_layers().values()
                                       for name in ("lora_a", "lora_b", "lora_a_scale", "lora_b_scale")
                                       if hasattr(layer, name)})
        self.phases["jax_model_init_s"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        self.td = TorchDecoder(cfg, self.jm, self.device, fp8_product=args.torch_fp8)
        self.phases["torch_decoder_init_s"] = time.perf_counter() - t0
        dec_rows = max([c.rows for c in cases if c.kind == "dec"], default=0)
        self.max_len = args.max_len
        rng = np.random.default_rng(7)
        m = self.max_len
        self.dec_positions = rng.integers(m // 2 - m // 8, m // 2 + m // 8, max(dec_rows, 1))
        self.dec_cache = self.t_dec_cache = None       # made per decode batch size (ensure_dec_cache)
        self.dec_cache_rows = 0
        self._punica()
        self._torch_stream = torch.cuda.Stream() if self.cuda else None
        self._torch_side = torch.cuda.Stream() if self.cuda else None
        self._states = None
        self._jax_base = self._jax_lora = self._jax_lora_rank = None
        self.results = []
        self.skipped = []
        self.budget_s = args.budget_s
        self.shape_costs = {}          # step kind -> seconds each step shape took (set-up, checks, timing)
        self._jax_base_compiled = set()
        self._jax_programs = {}        # --jax-call aot: ("base", shape key) / ("lora", rank, shape key) -> Compiled
        self.jax_aot_programs = dict(precompiled=0, on_first_call=0)     # Compiled programs kept, by where built
        self._last_precompile_s = 0.0
        self.on_result = None          # called after every case (the partial results are written)

    # ---------------------------------------------------------------- setup
    def _sync_jax(self):
        import jax
        from flax import nnx
        jax.block_until_ready(nnx.state(self.jm.model))

    def make_caches(self, rows: int, max_len: int):
        """(JAX KVCache with (rows, max_len, kv_heads, hd) per layer, torch caches
        (rows, kv_heads, max_len, hd) per layer holding the same values), N(0, 1) bf16."""
        import jax
        import torch

        from jax_lora.models.llama import KVCache
        cfg = self.cfg
        shape = (rows, max_len, cfg.num_key_value_heads, cfg.head_dim)
        arrays = self.jm.random([(shape, "bfloat16", 1.0, 0.0)] * (2 * cfg.num_hidden_layers))
        jax.block_until_ready(arrays)
        tc = [tuple(torch.from_dlpack(a).permute(0, 2, 1, 3).contiguous() for a in arrays[2 * i:2 * i + 2])
              for i in range(cfg.num_hidden_layers)]
        self._torch_sync()
        return KVCache(tuple(arrays[0::2]), tuple(arrays[1::2])), tc

    def ensure_dec_cache(self, shape: Shape) -> None:
        """The decode caches hold exactly shape.rows rows (the previous batch size's are freed
        first), so that both frameworks read the whole cache in place."""
        if shape.kind != "dec" or self.dec_cache_rows == shape.rows:
            return
        self.dec_cache = self.t_dec_cache = None
        gc.collect()
        if self.cuda:
            import torch
            torch.cuda.empty_cache()
        t0 = time.perf_counter()
        self.dec_cache, self.t_dec_cache = self.make_caches(shape.rows, self.max_len)
        self.dec_cache_rows = shape.rows
        self.phases[f"kv_cache_B{shape.rows}_s"] = time.perf_counter() - t0

    def _jax_cache_spec(self, shape: Shape):
        """What the JAX step's cache argument will be for this shape (decode: shapes only, for
        lowering before the caches of that batch size exist)."""
        if shape.kind != "dec":
            return shape.j_cache
        import jax
        import jax.numpy as jnp

        from jax_lora.models.llama import KVCache
        cfg = self.cfg
        # no sharding given: the real (uncommitted default-device) caches then hit the same
        # compiled program and trace
        spec = jax.ShapeDtypeStruct((shape.rows, self.max_len, cfg.num_key_value_heads, cfg.head_dim),
                                    jnp.bfloat16)
        layers = (spec,) * cfg.num_hidden_layers
        return KVCache(layers, layers)

    def _punica(self):
        import jax_lora
        import torch_lora
        cap = max([c.tokens for c in self.cases] + [8])
        self.j_punica = jax_lora.PunicaWrapper(cap, cap, None, max_loras=NUM_SLOTS,
                                               backend="xla" if self.smoke else "triton")
        self.t_punica = torch_lora.PunicaWrapper(cap, cap, self.device, max_loras=NUM_SLOTS,
                                                 backend="torch" if self.smoke else "triton")
        self.vk = self.v_meta = None
        # vLLM's fp8 LoRA kernels quantise the activations too (W8A8, benchmarks/vllm_kernels.py):
        # another computation than e4m3 adapter weights over bf16 activations, so not beside ours
        if self.cuda and "torch" in self.frameworks and self.args.vllm != "off" and self.args.lora_dtype != "fp8":
            import vllm_kernels
            self.vk = vllm_kernels.load()
            if self.vk is None and self.args.vllm == "on":
                raise SystemExit("--vllm on: vLLM's kernel files are missing (bash benchmarks/fetch_vllm_kernels.sh)")
            if self.vk is not None:
                self.v_meta = self.vk.LoRAKernelMeta.make(NUM_SLOTS, cap, self.device)

    def _torch_sync(self):
        import torch
        if self.cuda:
            torch.cuda.synchronize()

    def update_metadata(self, shape: Shape, slots):
        m = shape.mapping(slots)
        ids = list(range(1, NUM_SLOTS + 1))
        self.t_punica.update_metadata(m, ids, NUM_SLOTS, self.cfg.vocab_size)
        if self.v_meta is not None:
            import torch
            token_slots = np.asarray(m.index_mapping, np.int32) - 1
            self.v_meta.prepare_tensors(torch.from_numpy(token_slots).to(self.device))
        self.j_punica.update_metadata(m, ids, NUM_SLOTS, self.cfg.vocab_size)

    # ---------------------------------------------------------------- reference
    def reference_products(self) -> dict:
        """{framework: the base product its reference step computes}: an fp8 base's product as the
        framework's step computes it (JAX weight-only, "dequant"; torch `--torch-fp8`), so that the
        check compares LoRA steps over one base; "dequant" for a bf16 base (no fp8 product)."""
        torch_product = self.td.fp8_product if self.args.base == "fp8" else "dequant"
        return {fw: torch_product if fw == "torch" else "dequant" for fw in self.frameworks}

    def reference(self, shape: Shape, slots, lora: bool, product: str = "dequant", regroup: bool = False):
        """Logits (len(checked rows), V) float64 of the checked sequences: the eager plain-torch step
        on those rows alone, LoRA deltas computed separately per adapter (or none; regroup: summed in
        the other order, `TorchDecoder.reference_lora`), an fp8 base's products by `product`
        (`base_product`)."""
        import torch
        rows = checked_rows(shape)
        idx = torch.tensor(rows, dtype=torch.int64, device=self.device)
        groups = None
        if lora:
            groups = []
            for slot in sorted({int(slots[r]) for r in rows}):
                toks = [i * shape.seq + j for i, r in enumerate(rows) if slots[r] == slot for j in range(shape.seq)]
                groups.append((slot, torch.tensor(toks, dtype=torch.int64, device=self.device)))
        product, self.td.fp8_product = self.td.fp8_product, product
        try:
            with torch.no_grad():
                logits, _ = self.td.forward(shape.t_tokens[idx], shape.t_positions[idx], shape.t_cache, rows=idx,
                                            lora=self.td.reference_lora(groups, regroup) if lora else None)
        finally:
            self.td.fp8_product = product
        self._torch_sync()
        return logits.double().cpu().numpy()

    # ---------------------------------------------------------------- torch
    def torch_step_fn(self, shape: Shape, lora):
        """lora: False (base), True (ours) or "vllm" (vLLM's kernels)."""
        hook = None
        if lora == "vllm":
            hook = self.td.vllm_lora(self.vk, self.v_meta)
        elif lora:
            if self.args.torch_lora == "overlap":
                hook = self.td.overlapped_lora(self.t_punica, self._torch_side)
            elif self.args.torch_lora == "auto":
                hook = self.td.auto_lora(self.t_punica)
            elif self.args.torch_lora.startswith("fused"):
                hook = self.td.fused_lora(self.t_punica, fuse_norm=self.args.torch_lora == "fused-norm")
            else:
                hook = self.td.wrapper_lora(self.t_punica)

        def step():
            return self.td.forward(shape.t_tokens, shape.t_positions, shape.t_cache, lora=hook)
        return step

    def torch_prepare(self, shape: Shape, lora):
        """A runner of the step: on CUDA a captured graph (warmed up eagerly first, so Triton compiles
        and the wrapper's plans are built outside the capture), on the CPU the eager step. Returns
        (run() -> (logits, next tokens) as tensors updated in place, seconds spent)."""
        import torch
        t0 = time.perf_counter()
        step = self.torch_step_fn(shape, lora)
        if not self.cuda:
            with torch.no_grad():
                step()
            return step, time.perf_counter() - t0
        g, out = capture_cuda_graph(step, self._torch_stream)

        def run():
            g.replay()
            return out
        run.graph = g
        return run, time.perf_counter() - t0

    def torch_time(self, runs: list, n: int) -> list:
        """Per runner, n step times in us, interleaved (run 0, run 1, run 0, ...): CUDA events around
        each graph replay, or the host clock around each eager step on the CPU."""
        import torch
        times = [[] for _ in runs]
        if not self.cuda:
            with torch.no_grad():
                for _ in range(n):
                    for i, run in enumerate(runs):
                        t0 = time.perf_counter()
                        run()
                        times[i].append((time.perf_counter() - t0) * 1e6)
            return times
        events = []
        for _ in range(n):
            for i, run in enumerate(runs):
                e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                e0.record()
                run()
                e1.record()
                events.append((i, e0, e1))
        torch.cuda.synchronize()
        for i, e0, e1 in events:
            times[i].append(e0.elapsed_time(e1) * 1e3)
        return times

    # ---------------------------------------------------------------- JAX
    def _jax_jits(self):
        """(base step, LoRA step) jitted with the current step key (graphdef and tree structures)
        closed over (not static arguments), as jax_lora.serving does. The base step's jit is made
        once: it reads no LoRA attribute, so its programs serve every rank; the LoRA step's per
        rank (the graphdef holds the layers' max_rank)."""
        import jax

        def make(key):
            return jax.jit(functools.partial(_jax_step, *key), static_argnums=(8,), donate_argnums=(2,))
        key = self._states[0]
        if self._jax_base is None:
            self._jax_base = make(key)
        if self._jax_lora_rank != self.jm.rank:
            self._jax_lora, self._jax_lora_rank = make(key), self.jm.rank
            self._jax_programs = {k: v for k, v in self._jax_programs.items() if k[0] == "base"}
        return self._jax_base, self._jax_lora

    @property
    def jax_aot(self) -> bool:
        """`--jax-call aot`: the steps are called as ahead-of-time compiled programs."""
        return getattr(self.args, "jax_call", "jit") == "aot"

    def _program_key(self, shape: Shape, lora: bool) -> tuple:
        """The key of a step shape's Compiled program: the base programs serve every rank (as the
        base jit does), the LoRA ones one rank."""
        return ("lora", self.jm.rank, shape.key) if lora else ("base", shape.key)

    def jax_step_fn(self, shape: Shape, lora: bool) -> tuple:
        """(callable, trailing arguments) of a step: the jitted step and its static LoRA flag, or
        with --jax-call aot the shape's Compiled program (lowered and compiled here unless the
        precompile kept it) and nothing, the flag being baked into the program."""
        base_fn, lora_fn = self._jax_jits()
        fn = lora_fn if lora else base_fn
        if not self.jax_aot:
            return fn, (lora,)
        key = self._program_key(shape, lora)
        if key not in self._jax_programs:
            _key, lora_leaves, rest, empty = self._states
            self._jax_programs[key] = fn.lower(lora_leaves if lora else empty, rest, self._jax_cache_spec(shape),
                                               self.j_punica if lora else None, *shape.j_args, lora).compile()
            self.jax_aot_programs["on_first_call"] += 1
        return self._jax_programs[key], ()

    def jax_run(self, shape: Shape, lora: bool, wait=True):
        """One JAX step on the shape's cache (donated: the new cache replaces it); returns
        (logits (B, V) float32, next tokens (B,)), ready unless wait=False."""
        import jax
        _key, lora_leaves, rest, empty = self._states
        fn, flag = self.jax_step_fn(shape, lora)
        cache = self._jax_cache(shape)
        cache, tok, logits = fn(lora_leaves if lora else empty, rest, cache, self.j_punica if lora else None,
                                *shape.j_args, *flag)
        if shape.kind == "dec":
            self.dec_cache = cache
        else:
            shape.j_cache = cache
        if wait:
            jax.block_until_ready((cache, tok, logits))
        return logits, tok

    @property
    def jax_chain(self) -> int:
        """JAX steps per timed sample (`--jax-chain`, at least 1)."""
        return max(1, int(getattr(self.args, "jax_chain", 1) or 1))

    def jax_time(self, shape: Shape, flags: list, n: int) -> list:
        """Per flag (LoRA on/off), n step times in us, interleaved: host clock from the jitted call
        to `block_until_ready` of the step's next tokens (dispatch included; the outputs of one
        execution become ready together). With `--jax-chain K` (K > 1) each sample is K steps
        dispatched back to back, then one wait, divided by K: the host's dispatch and wake-up
        overlap the device's work, as in a serving loop that keeps the device fed."""
        import jax
        _key, lora_leaves, rest, empty = self._states
        calls = [(*self.jax_step_fn(shape, lora), lora_leaves if lora else empty, self.j_punica if lora else None)
                 for lora in flags]
        cache = self._jax_cache(shape)
        times = [[] for _ in flags]
        chain = self.jax_chain
        for _ in range(n):
            for i, (fn, flag, lora_arg, punica) in enumerate(calls):
                t0 = time.perf_counter()
                for _step in range(chain):
                    cache, tok, _logits = fn(lora_arg, rest, cache, punica, *shape.j_args, *flag)
                tok.block_until_ready()
                times[i].append((time.perf_counter() - t0) * 1e6 / chain)
        jax.block_until_ready(cache)
        if shape.kind == "dec":
            self.dec_cache = cache
        else:
            shape.j_cache = cache
        return times

    # ---------------------------------------------------------------- cases
    def run(self):
        """Every case, rank by rank (LoRA weights rebuilt once per rank), step shape by step shape
        in SHAPE_ORDER. With a time budget, a step shape whose projected cost (the most a shape of
        its kind has cost so far, plus the last rank's compile time for a rank not compiled yet)
        would end past the budget is skipped and listed in `skipped`."""
        by_rank = {}
        for c in self.cases:
            by_rank.setdefault(c.rank, []).append(c)
        shapes = {}
        for rank in sorted(by_rank):
            by_shape = {}
            for c in by_rank[rank]:
                by_shape.setdefault(c.shape, []).append(c)
            keys = sorted(by_shape, key=lambda k: SHAPE_ORDER.index(k) if k in SHAPE_ORDER else len(SHAPE_ORDER))
            run_keys = [k for k in keys if not self.over_budget(k, extra=self._last_precompile_s)]
            self.skip([c for k in keys if k not in run_keys for c in by_shape[k]])
            if not run_keys:
                continue
            t0 = time.perf_counter()
            self.td.drop_lora()
            self._torch_sync()
            self._states = None
            self.jm.set_rank(rank)
            self._sync_jax()
            self._states = self.jm.states()
            self.td.load_lora()
            if self.vk is not None:
                self.td.load_vllm_weights()
            self.phases[f"set_rank_{rank}_s"] = time.perf_counter() - t0
            for key in run_keys:
                if key not in shapes:
                    shapes[key] = Shape(self, *key)
            if "jax" in self.frameworks and self.args.precompile:
                try:
                    self.precompile([shapes[k] for k in run_keys])
                except Exception as e:
                    _error("jax precompile", e)
            for key in run_keys:
                if key != run_keys[0] and self.over_budget(key):
                    self.skip(by_shape[key])
                    continue
                t0 = time.perf_counter()
                self.run_shape(shapes[key], by_shape[key])
                gc.collect()
                if self.cuda:
                    import torch
                    torch.cuda.empty_cache()
                self.shape_costs.setdefault(key[0], []).append(time.perf_counter() - t0)

    def precompile(self, shapes: list) -> None:
        """Compiles the JAX step programs of these step shapes before any is timed: base programs
        not compiled yet one after another (each autotunes its own matrix products on the GPU),
        then the current rank's LoRA programs concurrently (the compiler releases the GIL; their
        matrix products are the base programs', already tuned). The jitted calls then find the
        compiled programs in JAX's cache; with --jax-call aot the Compiled programs are kept and
        called."""
        from concurrent.futures import ThreadPoolExecutor
        base_fn, lora_fn = self._jax_jits()
        _key, lora_leaves, rest, empty = self._states
        t0 = time.perf_counter()
        for shape in shapes:
            if shape.key not in self._jax_base_compiled:
                t_shape = time.perf_counter()
                program = base_fn.lower(empty, rest, self._jax_cache_spec(shape), None, *shape.j_args,
                                        False).compile()
                if self.jax_aot:
                    self._jax_programs[self._program_key(shape, False)] = program
                    self.jax_aot_programs["precompiled"] += 1
                self._jax_base_compiled.add(shape.key)
                self.phases[f"jax_compile_base_{shape.key}_s"] = time.perf_counter() - t_shape
        t1 = time.perf_counter()
        lowered = [lora_fn.lower(lora_leaves, rest, self._jax_cache_spec(shape), self.j_punica, *shape.j_args, True)
                   for shape in shapes]
        with ThreadPoolExecutor(max_workers=min(8, len(lowered))) as pool:
            programs = list(pool.map(lambda low: low.compile(), lowered))
        if self.jax_aot:
            self._jax_programs.update({self._program_key(shape, True): program
                                       for shape, program in zip(shapes, programs)})
            self.jax_aot_programs["precompiled"] += len(programs)
        t2 = time.perf_counter()
        rank = self.jm.rank
        self.phases[f"jax_precompile_base_r{rank}_s"] = t1 - t0
        self.phases[f"jax_precompile_lora_r{rank}_s"] = t2 - t1
        self._last_precompile_s = t2 - t0
        print(f"JAX programs compiled: base {t1 - t0:.1f} s, LoRA rank {rank} ({len(lowered)} programs, "
              f"concurrently) {t2 - t1:.1f} s", flush=True)

    def _jax_cache(self, shape: Shape):
        return self.dec_cache if shape.kind == "dec" else shape.j_cache

    def over_budget(self, key, extra: float = 0.0) -> bool:
        if self.budget_s is None:
            return False
        costs = self.shape_costs.get(key[0]) or [c for v in self.shape_costs.values() for c in v]
        return time.perf_counter() - self.t_start + extra + max(costs, default=0.0) > self.budget_s

    def skip(self, cases) -> None:
        for c in cases:
            self.skipped.append(c.name)
            print(f"{c.name:22s} skipped: the time budget ({self.budget_s:.0f} s) would be exceeded", flush=True)

    def run_shape(self, shape: Shape, cases: list):
        """The cases of one step shape at the current rank: each framework's base and LoRA step
        built and warmed up once (torch: graphs captured; JAX: compiled), then per case the
        mapping written, the check, and the timing. A framework that fails to build or run the
        shape is recorded as an error for these cases; the other framework carries on."""
        setup, runs, errors = {}, {}, {}
        self.ensure_dec_cache(shape)
        first = slots_of(cases[0], seed=hash_case(cases[0]))
        self.update_metadata(shape, first)
        if "torch" in self.frameworks:
            try:
                t_base, setup["torch_base_s"] = self.torch_prepare(shape, lora=False)
                t_lora, setup["torch_lora_s"] = self.torch_prepare(shape, lora=True)
                t_vllm = None
                if self.vk is not None:
                    t_vllm, setup["torch_vllm_s"] = self.torch_prepare(shape, lora="vllm")
                runs["torch"] = (t_base, t_lora, t_vllm)
            except Exception as e:
                errors["torch"] = _error("torch", e)
        if "jax" in self.frameworks:
            try:
                t0 = time.perf_counter()
                self.jax_run(shape, False)
                setup["jax_base_first_call_s"] = time.perf_counter() - t0
                t0 = time.perf_counter()
                self.jax_run(shape, True)
                setup["jax_lora_first_call_s"] = time.perf_counter() - t0
                for flag in (False, True):
                    self.jax_run(shape, flag)
                runs["jax"] = True
            except Exception as e:
                errors["jax"] = _error("jax", e)
        print(f"{shape.key}: set up {json.dumps({k: round(v, 1) for k, v in setup.items()})}", flush=True)
        rows = checked_rows(shape)
        products = self.reference_products()
        base_refs = {p: self.reference(shape, None, lora=False, product=p) for p in {"dequant", *products.values()}}
        base_ref = base_refs["dequant"]
        for case in cases:
            t_case = time.perf_counter()
            slots = slots_of(case, seed=hash_case(case))
            self.update_metadata(shape, slots)
            refs = {p: self.reference(shape, slots, lora=True, product=p) for p in base_refs}
            ref = refs["dequant"]
            n = self.steps if case.kind == "dec" else max(3, self.steps // 2)
            lora_dtype = self.args.lora_dtype
            fb = floor_bytes(self.cfg, case.tokens, case.adapters, case.rank, lora_dtype)
            res = dict(case=case.name, kind=case.kind, rows=case.rows, seq=case.seq, tokens=case.tokens,
                       adapters=case.adapters, rank=case.rank, lora_dtype=lora_dtype, base=self.args.base,
                       slots=NUM_SLOTS, slots_used=sorted(set(slots.tolist())),
                       floor_bytes=fb, floor_us=fb / (PEAK_GBS * 1e3),
                       adapter_bytes=case.adapters * adapter_bytes(self.cfg, case.rank, lora_dtype),
                       lora_effect=rel_err(base_ref, ref), checked_rows=rows, steps_timed=n, setup_s=setup)
            tol_err = dict.fromkeys(self.frameworks, TOL_ERR)
            if "scaled_mm" in base_refs:
                res["w8a8_base_vs_weight_only"] = rel_err(base_refs["scaled_mm"], base_ref)
                noise = rel_err(self.reference(shape, slots, lora=True, product="scaled_mm", regroup=True),
                                refs["scaled_mm"])
                res["w8a8_rounding_noise"] = noise
                for fw, p in products.items():
                    if p == "scaled_mm":
                        tol_err[fw] = max(TOL_ERR, W8A8_NOISE_FACTOR * noise)
            for fw in self.frameworks:
                if fw not in runs:
                    res[fw] = dict(check_passed=False, error=errors.get(fw, "not run"))
                    continue
                try:
                    p = products[fw]
                    res[fw] = self.measure(fw, shape, runs.get(fw), rows, refs[p], base_refs[p],
                                           rel_err(base_refs[p], refs[p]), n, fb / (PEAK_GBS * 1e3),
                                           tol_err=tol_err[fw])
                    res[fw]["reference_product"] = p
                except Exception as e:
                    res[fw] = dict(check_passed=False, error=_error(fw, e))
            if all((res.get(fw) or {}).get("lora_us") for fw in ("jax", "torch")):
                res["jax_over_torch_lora"] = res["jax"]["lora_us"] / res["torch"]["lora_us"]
                res["jax_over_torch_base"] = res["jax"]["base_us"] / res["torch"]["base_us"]
            res["case_s"] = time.perf_counter() - t_case
            self.results.append(res)
            print(line(res), flush=True)
            if self.on_result is not None:
                self.on_result()
        runs.clear()

    def measure(self, fw: str, shape: Shape, torch_runs, rows: list, ref, base_ref, effect: float, n: int,
                floor_us: float, tol_err: float = TOL_ERR) -> dict:
        """Check the framework's LoRA and base steps against the reference (logits of `rows`; the
        reference over the framework's own base products, `reference_products`, and effect its LoRA
        effect), then, only if both pass, time n alternating base / LoRA steps."""
        t_vllm = vllm_err = None
        if fw == "torch":
            t_base, t_lora, t_vllm = torch_runs
            lora_logits = t_lora()[0].double().cpu().numpy()[rows]
            base_logits = t_base()[0].double().cpu().numpy()[rows]
            if t_vllm is not None:
                vllm_err = rel_err(t_vllm()[0].double().cpu().numpy()[rows], ref)
        else:
            lora_logits = np.asarray(self.jax_run(shape, True)[0], np.float64)[rows]
            base_logits = np.asarray(self.jax_run(shape, False)[0], np.float64)[rows]
        err, base_err = rel_err(lora_logits, ref), rel_err(base_logits, base_ref)
        ok = bool(err <= tol_err and base_err <= TOL_ERR and err <= TOL_ERR_OVER_EFFECT * effect)
        r = dict(lora_err=err, base_err=base_err, check_passed=ok, tol_err=tol_err)
        if vllm_err is not None:
            r["vllm_err"] = vllm_err
            if not (vllm_err <= TOL_ERR and vllm_err <= TOL_ERR_OVER_EFFECT * effect):
                t_vllm = None          # vLLM's step failed the check: no time for it
                r["vllm_check_passed"] = False
        if not ok:
            return r
        handler_calls = _ffi_handler_calls if fw == "jax" and self.cuda else (lambda: None)
        calls0 = handler_calls()
        with _profiler_range(self.cuda, f"{fw}_{shape.kind}{shape.rows}x{shape.seq}"):
            if fw == "torch":
                tb, tl, *tv = self.torch_time([t_base, t_lora] + ([t_vllm] if t_vllm is not None else []), n)
            else:
                tb, tl = self.jax_time(shape, [False, True], n)
                tv = []
        calls1 = handler_calls()
        if calls0 is not None and calls1 is not None:
            # the FFI handler runs when XLA records or eagerly issues a launch, not when it replays
            # its command buffers: about 0 per step when the LoRA launches are replayed (each of the
            # n samples is `--jax-chain` steps)
            steps = n * self.jax_chain
            r["ffi_handler_calls_per_lora_step"] = (calls1 - calls0) / steps
        if self.cuda and os.environ.get("E2E_PROFILE"):
            step = {False: t_base, True: t_lora} if fw == "torch" else None
            _profile_kernel_diff(f"{fw}_{shape.kind}{shape.rows}x{shape.seq}", n,
                                 lambda lora: step[lora]() if step else self.jax_time(shape, [lora], 1))
        base_us, lora_us = float(np.median(tb)), float(np.median(tl))
        r.update(base_us=base_us, lora_us=lora_us, overhead_us=lora_us - base_us,
                 overhead_pct=100 * (lora_us - base_us) / base_us, overhead_over_floor=(lora_us - base_us) / floor_us,
                 base_samples_us=tb, lora_samples_us=tl)
        if tv:
            v_us = float(np.median(tv[0]))
            r.update(vllm_lora_us=v_us, vllm_overhead_us=v_us - base_us,
                     vllm_overhead_pct=100 * (v_us - base_us) / base_us,
                     vllm_overhead_over_floor=(v_us - base_us) / floor_us, vllm_samples_us=tv[0])
        return r


def _ffi_handler_calls():
    """The XLA FFI launcher's handler calls so far in this process (None where JAX does not launch
    through it)."""
    from jax_lora.ops import ffi_launcher
    return ffi_launcher.handler_calls() if ffi_launcher.available() else None


@contextlib.contextmanager
def _profiler_range(cuda: bool, label: str):
    """With E2E_PROFILE=<dir> on a GPU, the timed steps run under torch's profiler (CUPTI sees every
    kernel of the process: torch's, XLA's and ours, CUDA-graph nodes included) and the kernel table,
    sorted by GPU time, is written to <dir>/kernels_<label>.txt."""
    out = os.environ.get("E2E_PROFILE") if cuda else None
    if not out:
        yield
        return
    import torch
    from torch.profiler import ProfilerActivity, profile
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        yield
        torch.cuda.synchronize()
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, f"kernels_{label}.txt"), "w") as f:
        f.write(prof.key_averages().table(sort_by="cuda_time_total", row_limit=60, max_name_column_width=90))


def _profile_kernel_diff(label: str, n: int, run) -> None:
    """With E2E_PROFILE=<dir>: n base steps, then n LoRA steps, each under torch's profiler; writes
    <dir>/kernel_diff_<label>.md, per kernel name the launches and GPU time per step in each and
    the difference (LoRA - base), largest differences first: where a LoRA step's extra time goes,
    the LoRA kernels' own durations and any base kernel that runs slower beside them."""
    import torch
    from torch.profiler import ProfilerActivity, profile
    per_step, timelines = {}, {}
    for lora in (False, True):
        run(lora)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(n):
                run(lora)
            torch.cuda.synchronize()
        timelines[lora] = _gpu_timeline(prof, n)
        table = {}
        for ev in prof.key_averages():
            us = getattr(ev, "device_time_total", None)
            if us is None:
                us = getattr(ev, "cuda_time_total", 0.0)
            if ev.count and us:
                table[ev.key] = (ev.count / n, us / n)
        per_step[lora] = table
    names = set(per_step[False]) | set(per_step[True])
    rows = []
    for name in names:
        bc, bt = per_step[False].get(name, (0.0, 0.0))
        lc, lt = per_step[True].get(name, (0.0, 0.0))
        rows.append((lt - bt, name, bc, bt, lc, lt))
    rows.sort(key=lambda r: -abs(r[0]))
    total_b = sum(r[3] for r in rows)
    total_l = sum(r[5] for r in rows)
    out = os.environ["E2E_PROFILE"]
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, f"kernel_diff_{label}.md"), "w") as f:
        f.write(f"# {label}: GPU time per step by kernel, base vs LoRA ({n} steps each)\n\n"
                f"kernel time per step: base {total_b:.1f} us, LoRA {total_l:.1f} us, difference "
                f"{total_l - total_b:.1f} us\n\n| kernel | base launches | base us | LoRA launches | LoRA us | "
                f"LoRA - base us | us per LoRA launch |\n|---|---|---|---|---|---|---|\n")
        for d, name, bc, bt, lc, lt in rows[:40]:
            f.write(f"| {name[:90]} | {bc:.0f} | {bt:.1f} | {lc:.0f} | {lt:.1f} | {d:+.1f} | "
                    f"{(lt / lc if lc else 0):.2f} |\n")
    with open(os.path.join(out, f"timeline_{label}.md"), "w") as f:
        f.write(_timeline_markdown(label, n, timelines))


STEP_GAP_US = 50.0   # a GPU idle gap longer than this is host time between steps, not part of one


def _gpu_timeline(prof, n: int) -> dict:
    """The GPU timeline of n profiled steps (CUPTI's kernel, memcpy and memset records, from torch's
    profiler's trace): per step, the GPU activities, their busy time (the union of their intervals)
    and the idle time between them inside a step (gaps < STEP_GAP_US); for the LoRA kernels (names
    containing "lora"), their mean duration and the mean idle gap before each; and one stretch of
    the timeline around a LoRA launch (name, start, duration, gap before, in us)."""
    import json as _json
    import tempfile as _tempfile
    with _tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = _json.load(f).get("traceEvents", [])
    acts = sorted(((float(e["ts"]), float(e.get("dur", 0.0)), str(e.get("name", "")))
                   for e in events if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")),
                  key=lambda a: a[0])
    if not acts:
        return dict(activities=0)
    busy = idle = 0.0
    end = acts[0][0]
    between_steps = 0
    rows = []     # (name, start, dur, gap before)
    for ts, dur, name in acts:
        gap = ts - end
        if gap >= STEP_GAP_US:
            between_steps += 1
        elif gap > 0:
            idle += gap
        busy += max(0.0, ts + dur - max(ts, end))
        rows.append((name, ts, dur, gap))
        end = max(end, ts + dur)
    lora = [(i, r) for i, r in enumerate(rows) if "lora" in r[0].lower()]
    after = [rows[i + 1][3] for i, r in lora
             if i + 1 < len(rows) and "lora" not in rows[i + 1][0].lower() and rows[i + 1][3] < STEP_GAP_US]
    by_name = {}
    for _i, (name, _ts, dur, gap) in lora:
        k = name.split("_kernel")[0][:40]
        c, d, g, cg = by_name.get(k, (0, 0.0, 0.0, 0))
        inside = gap < STEP_GAP_US
        by_name[k] = (c + 1, d + dur, g + (max(0.0, gap) if inside else 0.0), cg + inside)
    mid = lora[len(lora) // 2][0] if lora else len(rows) // 2
    t0 = rows[max(0, mid - 6)][1]
    stretch = [(name[:70], ts - t0, dur, gap) for name, ts, dur, gap in rows[max(0, mid - 6):mid + 10]]
    return dict(activities=len(rows) / n, busy_us=busy / n, idle_us=idle / n, between_steps=between_steps,
                lora=by_name, gap_after_lora_us=sum(max(g, 0.0) for g in after) / len(after) if after else 0.0,
                stretch=stretch)


def _timeline_markdown(label: str, n: int, tl: dict) -> str:
    base, lora = tl[False], tl[True]
    if not base.get("activities") or not lora.get("activities"):
        return f"# {label}: no GPU activity recorded\n"
    lines = [f"# {label}: GPU timeline per step ({n} steps each; CUPTI through torch's profiler)", "",
             "Busy = the union of the step's kernel/memcpy/memset intervals; idle = the gaps between them "
             f"inside a step (gaps >= {STEP_GAP_US:.0f} us count as host time between steps: base "
             f"{base['between_steps']}, LoRA {lora['between_steps']}).", "",
             "| step | activities | busy us | idle us | busy + idle us |", "|---|---|---|---|---|"]
    for name, t in (("base", base), ("LoRA", lora)):
        lines.append(f"| {name} | {t['activities']:.0f} | {t['busy_us']:.1f} | {t['idle_us']:.1f} | "
                     f"{t['busy_us'] + t['idle_us']:.1f} |")
    lines.append(f"| LoRA - base | {lora['activities'] - base['activities']:+.0f} | "
                 f"{lora['busy_us'] - base['busy_us']:+.1f} | {lora['idle_us'] - base['idle_us']:+.1f} | "
                 f"{lora['busy_us'] + lora['idle_us'] - base['busy_us'] - base['idle_us']:+.1f} |")
    lines += ["", "| LoRA kernel | launches per step | mean us | mean idle gap before, us |", "|---|---|---|---|"]
    for k, (c, d, g, cg) in sorted(lora["lora"].items()):
        lines.append(f"| {k} | {c / n:.0f} | {d / c:.2f} | {g / max(cg, 1):.2f} |")
    lines += ["", f"Mean idle gap after a LoRA kernel, before the next non-LoRA activity: "
              f"{lora['gap_after_lora_us']:.2f} us.", "", "One stretch of the LoRA step's timeline:", "",
              "| activity | start us | duration us | idle gap before us |", "|---|---|---|---|"]
    lines += [f"| {name} | {ts:.2f} | {dur:.2f} | {gap:.2f} |" for name, ts, dur, gap in lora["stretch"]]
    return "\n".join(lines) + "\n"


class _Phases(dict):
    """Set-up phases and their seconds; each is printed as it ends (a run cut short shows where)."""

    def __init__(self, t_start: float):
        super().__init__()
        self.t_start = t_start

    def __setitem__(self, name: str, seconds: float) -> None:
        super().__setitem__(name, seconds)
        print(f"[{time.perf_counter() - self.t_start:7.1f} s] {name} = {seconds:.1f}", flush=True)


def _error(fw: str, e: Exception) -> str:
    import traceback
    traceback.print_exc()
    print(f"{fw} failed: {type(e).__name__}: {e}", flush=True)
    return f"{type(e).__name__}: {e}"


def checked_rows(shape: Shape) -> list:
    """The sequences whose logits the reference checks: the batch's first and last."""
    return sorted({0, shape.rows - 1})


def hash_case(case: Case) -> int:
    """A seed per case (stable across runs and processes, unlike hash())."""
    return zlib.crc32(case.name.encode())


# ------------------------------------------------------------------------------------------ report

def line(res) -> str:
    parts = [f"{res['case']:22s} floor {res['floor_us']:9.1f} us"]
    for fw in ("torch", "jax"):
        r = res.get(fw)
        if r is None:
            continue
        if r.get("error"):
            parts.append(f"{fw}: ERROR {r['error'][:200]}")
            continue
        if r.get("lora_us") is None:
            parts.append(f"{fw}: CHECK FAILED (err {r['lora_err']:.2e}, base {r['base_err']:.2e}, "
                         f"effect {res['lora_effect']:.2e})")
            continue
        parts.append(f"{fw}: base {r['base_us']:9.1f} lora {r['lora_us']:9.1f} over {r['overhead_us']:8.1f} us "
                     f"({r['overhead_pct']:5.1f}%, {r['overhead_over_floor']:6.2f}x floor) err {r['lora_err']:.1e}")
        if r.get("vllm_lora_us") is not None:
            parts.append(f"vllm: lora {r['vllm_lora_us']:9.1f} over {r['vllm_overhead_us']:8.1f} us "
                         f"({r['vllm_overhead_pct']:5.1f}%, {r['vllm_overhead_over_floor']:6.2f}x floor) "
                         f"err {r['vllm_err']:.1e}")
    if res.get("jax_over_torch_lora"):
        parts.append(f"jax/torch {res['jax_over_torch_lora']:.2f}")
    return " | ".join(parts)


def cfg_of(out) -> dict:
    """The model configuration a results dict records (meta.config)."""
    return out.get("meta", {}).get("config", {})


def markdown(out) -> str:
    torch_how = ("eager steps, host clock (--smoke: times mean nothing)" if out["meta"]["smoke"]
                 else "CUDA-graph replay, CUDA events")
    chain = int(out["meta"].get("jax_chain", 1) or 1)
    aot = out["meta"].get("jax_call") == "aot"
    call = "ahead-of-time compiled" if aot else "jitted"
    steps = "ahead-of-time compiled steps" if aot else "steps"
    jax_how = (f"host clock from the {call} call to block_until_ready (dispatch included)" if chain == 1 else
               f"host clock over {chain} {steps} dispatched back to back and one block_until_ready, / {chain}")
    lines = [
        f"Times: median per step. torch: {torch_how}; JAX: {jax_how}. overhead = LoRA step - base step; "
        f"floor = LoRA path's minimal bytes / {PEAK_GBS:.0f} GB/s; err = relative error of the LoRA step's logits "
        "against the reference.",
        "",
        f"Base linears {cfg_of(out).get('base', 'bf16')}, adapters {cfg_of(out).get('lora_dtype', 'bf16')}"
        + (" (e4m3 with per-channel float32 scales; the reference reads the dequantised weights)"
           if cfg_of(out).get("lora_dtype") == "fp8" else "") + ".",
        "",
        "| case | tokens | floor us | torch base us | torch LoRA us | torch overhead us (% base) | torch x floor "
        "| vLLM kernels in torch's step: overhead us (% base) | vLLM x floor "
        "| JAX base us | JAX LoRA us | JAX overhead us (% base) | JAX x floor | JAX/torch LoRA (base) "
        "| err torch / vLLM / JAX |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for res in out["cases"]:
        cells = [res["case"], str(res["tokens"]), f"{res['floor_us']:.1f}"]
        errs = []
        for fw in ("torch", "jax"):
            r = res.get(fw)
            width = 6 if fw == "torch" else 4
            if r is None:
                cells += ["-"] * width
                errs.append("-")
                continue
            if r.get("error"):
                errs.append("error")
                cells += ["error"] + ["-"] * (width - 1)
                continue
            errs.append(f"{r['lora_err']:.1e}" + ("" if r["check_passed"] else " FAILED"))
            if fw == "torch":
                errs.append(f"{r['vllm_err']:.1e}" if r.get("vllm_err") is not None else "-")
            if r.get("lora_us") is None:
                cells += ["check failed"] + ["-"] * (width - 1)
                continue
            cells += [f"{r['base_us']:.1f}", f"{r['lora_us']:.1f}",
                      f"{r['overhead_us']:.1f} ({r['overhead_pct']:.1f}%)", f"{r['overhead_over_floor']:.2f}"]
            if fw == "torch":
                cells += ([f"{r['vllm_overhead_us']:.1f} ({r['vllm_overhead_pct']:.1f}%)",
                           f"{r['vllm_overhead_over_floor']:.2f}"] if r.get("vllm_lora_us") is not None else ["-", "-"])
        ratio = (f"{res['jax_over_torch_lora']:.2f} ({res['jax_over_torch_base']:.2f})"
                 if res.get("jax_over_torch_lora") else "-")
        cells += [ratio, " / ".join(errs)]
        lines.append("| " + " | ".join(cells) + " |")
    handler = [f"{res['case']} {res['jax']['ffi_handler_calls_per_lora_step']:.1f}" for res in out["cases"]
               if (res.get("jax") or {}).get("ffi_handler_calls_per_lora_step") is not None]
    if handler:
        lines += ["", "JAX's FFI handler calls per LoRA step (XLA recording or eagerly issuing a launch; "
                  "replayed command buffers do not call it): " + ", ".join(handler) + "."]
    summary = out.get("summary", {})
    if summary.get("skipped"):
        lines += ["", f"Skipped for the time budget: {', '.join(summary['skipped'])}."]
    if summary.get("checks_failed"):
        lines += ["", f"Check failed (no time reported): {', '.join(summary['checks_failed'])}."]
    return "\n".join(lines) + "\n"


def plot(out, path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(8.5, 6))
    pts = [(res, fw) for res in out["cases"] for fw in ("torch", "jax") if (res.get(fw) or {}).get("lora_us")]
    if not pts:
        return
    floors = [res["floor_us"] for res, _ in pts]
    lo, hi = min(floors) / 2, max(floors) * 2
    xs = np.logspace(math.log10(lo), math.log10(hi), 50)
    ax.plot(xs, xs, "k--", lw=1, label="overhead = floor")
    ax.plot(xs, 1.2 * xs, "k:", lw=0.8, label="1.2x floor")
    style = {("torch", "dec"): ("o", "C0"), ("torch", "pre"): ("s", "C0"), ("jax", "dec"): ("o", "C3"),
             ("jax", "pre"): ("s", "C3")}
    bottom = min([r[fw]["overhead_us"] for r, fw in pts if r[fw]["overhead_us"] > 0] + [lo]) / 3
    for fw in ("torch", "jax"):
        for kind in ("dec", "pre"):
            sel = [res for res, f in pts if f == fw and res["kind"] == kind]
            if not sel:
                continue
            mk, col = style[(fw, kind)]
            pos = [r for r in sel if r[fw]["overhead_us"] > 0]
            ax.scatter([r["floor_us"] for r in pos], [r[fw]["overhead_us"] for r in pos], marker=mk,
                       c=col if fw == "torch" else "none", edgecolors=col,
                       label=f"{fw} {'decode' if kind == 'dec' else 'prefill'}")
            neg = [r for r in sel if r[fw]["overhead_us"] <= 0]
            if neg:
                ax.scatter([r["floor_us"] for r in neg], [bottom] * len(neg), marker="v", c=col,
                           label=f"{fw} {'decode' if kind == 'dec' else 'prefill'}: overhead <= 0 (not to scale)")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("floor of the LoRA overhead per step (us): minimal bytes / 4300 GB/s")
    ax.set_ylabel("LoRA step - base step (us)")
    c = out["meta"]["config"]
    ax.set_title(f"{c['layers']}-layer decoder step (hidden {c['hidden']}, vocab {c['vocab']}), LoRA on 7 "
                 f"projections, {out['meta']['device']}", fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def env_meta(args, cfg) -> dict:
    import jax
    import torch
    from bench_triton import git_commit, host_cpu, source_digest
    commit = git_commit()
    meta = dict(date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                device=torch.cuda.get_device_name() if not args.smoke else "cpu",
                jax_device=str(jax.devices()[0]), torch=torch.__version__, python=platform.python_version(),
                numpy=np.__version__, commit=commit, source_digest=source_digest(), host_cpu=host_cpu(),
                smoke=bool(args.smoke), peak_gbs=PEAK_GBS, num_slots=NUM_SLOTS, b_scale=B_SCALE,
                max_len=args.max_len, steps=args.steps, frameworks=args.frameworks, budget_s=args.budget_s,
                jax_chain=args.jax_chain, jax_call=args.jax_call,
                fused=args.fused, torch_lora=args.torch_lora, jax_lora=getattr(args, "jax_lora", "linear"),
                vllm_kernels=_vllm_version(args),
                tolerances=dict(err=TOL_ERR, err_over_effect=TOL_ERR_OVER_EFFECT),
                config=dict(layers=cfg.num_hidden_layers, hidden=cfg.hidden_size, intermediate=cfg.intermediate_size,
                            heads=cfg.num_attention_heads, kv_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim,
                            vocab=cfg.vocab_size, dtype="bfloat16", base=args.base, lora_dtype=args.lora_dtype,
                            torch_fp8=args.torch_fp8 if args.base == "fp8" else None),
                backends=dict(jax="xla" if args.smoke else "triton (XLA FFI launcher)",
                              torch="torch" if args.smoke else "triton, CUDA graph"))
    from importlib import metadata
    for pkg in ("jax", "jaxlib", "flax", "triton", "jax-triton", "matplotlib"):
        with contextlib.suppress(Exception):
            meta[pkg] = metadata.version(pkg)
    if not args.smoke:
        from lora_core.kernels import configs
        meta["configs"] = configs.current_table().source
        meta["launch_pdl"] = os.environ.get("LORA_CORE_PDL", "auto")
    if "jax" in args.frameworks:
        import jax.numpy as jnp

        from jax_lora.models import attention
        backend, reason = attention.attention_backend(jnp.bfloat16, jnp.bfloat16, cfg.head_dim)
        meta["jax_attention"] = f"{backend} ({reason})"
    return meta


def _vllm_version(args):
    """The version of vLLM's kernels timed beside ours (benchmarks/vllm_kernels.py), or None."""
    import vllm_kernels
    if args.smoke or args.vllm == "off" or not vllm_kernels.available():
        return None
    path = os.path.join(vllm_kernels.ROOT, "VERSION")
    return open(path).read().strip() if os.path.exists(path) else "unknown"


def memory_meta(args) -> dict:
    """Peak device memory so far (GB): torch's caching allocator and JAX's, which share the GPU."""
    if args.smoke:
        return {}
    import jax
    import torch
    out = dict(torch_max_allocated=torch.cuda.max_memory_allocated() / 1e9,
               torch_max_reserved=torch.cuda.max_memory_reserved() / 1e9)
    stats = jax.devices()[0].memory_stats() or {}
    for key in ("peak_bytes_in_use", "bytes_limit"):
        if key in stats:
            out[f"jax_{key}"] = stats[key] / 1e9
    free, total = torch.cuda.mem_get_info()
    out["device_in_use"] = (total - free) / 1e9
    return out


def select_cases(args) -> list:
    if args.smoke:
        cases = smoke_cases()
    else:
        cases = full_cases()
        if args.quick:
            cases = [c for c in cases if c.name in QUICK]
    if args.cases:
        cases = [c for c in cases if re.search(args.cases, c.name)]
    return cases


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="benchmarks/results")
    p.add_argument("--quick", action="store_true", help=f"only {', '.join(QUICK)}")
    p.add_argument("--cases", default=None, help="regex: only the cases whose name matches (e.g. 'dec B(1|32) ')")
    p.add_argument("--smoke", action="store_true",
                   help="CPU, tiny model (2 layers, hidden 64, vocab 128), JAX backend xla, torch backend torch, "
                        "no CUDA graph: checks the pipeline, times mean nothing")
    p.add_argument("--frameworks", default="torch,jax", help="comma list of torch, jax")
    p.add_argument("--steps", type=int, default=None, help="timed steps per case and step kind (decode; "
                   "prefill half, at least 3: its overhead is a few percent of a 250 ms step). Default 20 (smoke 3)")
    p.add_argument("--max-len", type=int, default=None, help="decode KV positions per row (default 1024, smoke 32)")
    p.add_argument("--budget-s", type=float, default=None,
                   help="stop starting step shapes that would end past this many seconds of the run (default "
                        "450 on the GPU, none with --smoke); skipped cases are listed in summary.skipped")
    p.add_argument("--no-precompile", dest="precompile", action="store_false",
                   help="compile each JAX step program at its first call instead of ahead (LoRA programs of "
                        "a rank concurrently)")
    p.add_argument("--fused", choices=("auto", "on", "off"), default="auto",
                   help="add_lora_linear's one-launch fused kernel: the launch tables' choice (auto), or forced")
    p.add_argument("--vllm", choices=("auto", "on", "off"), default="auto",
                   help="also time torch's step with vLLM's LoRA kernels (benchmarks/vllm_kernels.py; their files "
                        "in .vllm/ from benchmarks/fetch_vllm_kernels.sh): when present (auto), required (on) or not")
    p.add_argument("--torch-lora", choices=("linear", "overlap", "fused", "fused-norm", "auto"), default="linear",
                   help="torch's LoRA path: add_lora_linear after the base product (linear); the shrink on a "
                        "side stream beside the base product and the expand after it (overlap; CUDA only); the "
                        "shrink then a Triton GEMM with the expand in its epilogue (fused); the same with the "
                        "RMSNorm kernel that also shrinks before qkv and gate_up (fused-norm); per layer and row "
                        "count, fused or fused-norm where the device's tuned fused linear table says it wins, else "
                        "linear (auto)")
    p.add_argument("--jax-lora", choices=tuple(JAX_FUSED), default="linear",
                   help="JAX's LoRA path: add_lora_linear after the base product (linear); the wrapper's shrink "
                        "then a Triton GEMM with the expand in its epilogue over (out, in) copies of the kernels "
                        "(fused); the same with the RMSNorm kernel that also shrinks before qkv and gate_up "
                        "(fused-norm); per layer and row count, fused or fused-norm where the device's tuned fused "
                        "linear table says it wins, else linear (auto). Not with --base fp8")
    p.add_argument("--jax-chain", type=int, default=1,
                   help="JAX samples of K steps dispatched back to back, one wait, divided by K (default 1: "
                        "each step waited for)")
    p.add_argument("--jax-call", choices=("jit", "aot"), default="jit",
                   help="how the JAX steps are called: the jitted function (jit), or each step shape's ahead-of-time "
                        "compiled program (aot: jit.lower(...).compile(), as ServingEngine(aot_calls=True) calls its "
                        "steps; the dispatch skips jit's per-call lookup)")
    p.add_argument("--base", choices=("bf16", "fp8"), default="bf16",
                   help="the base model's linears: bf16, or fp8 (float8_e4m3fn, per-channel scales; the adapters "
                        "as --lora-dtype says)")
    p.add_argument("--lora-dtype", choices=("bf16", "fp8"), default="bf16",
                   help="the adapters' storage in both frameworks: bf16, or fp8 (float8_e4m3fn with per-channel "
                        "float32 scales, contract section 11; the reference reads the dequantised weights)")
    p.add_argument("--torch-fp8", choices=("scaled_mm", "dequant"), default=None,
                   help="torch's product with an fp8 base: torch._scaled_mm with per-token e4m3 activations "
                        "(default on CUDA) or weight-only dequantization as JAX computes it (default with --smoke); "
                        "torch's reference step computes the same product")
    p.add_argument("--tag", default="")
    p.add_argument("--list", action="store_true", help="print the selected cases and exit")
    args = p.parse_args(argv)
    if args.smoke and args.torch_lora == "overlap":
        p.error("--torch-lora overlap needs CUDA streams (not --smoke)")
    if args.base == "fp8" and args.torch_lora in ("fused", "fused-norm", "auto"):
        p.error(f"--torch-lora {args.torch_lora} runs a Triton GEMM over bf16 weights; with --base fp8 use "
                "--torch-lora linear or overlap")
    if args.base == "fp8" and args.jax_lora != "linear":
        p.error(f"--jax-lora {args.jax_lora} runs a Triton GEMM over bf16 weights; with --base fp8 use "
                "--jax-lora linear")
    if args.smoke and (args.jax_lora != "linear" or args.torch_lora in ("fused", "fused-norm", "auto")):
        os.environ.setdefault("TRITON_INTERPRET", "1")       # the fused kernels on the CPU: Triton's interpreter
    if "auto" in (args.torch_lora, args.jax_lora):
        show_fused_linear_choices()
    if args.lora_dtype == "fp8" and args.torch_lora in ("fused", "fused-norm", "auto"):
        p.error(f"--torch-lora {args.torch_lora}'s fused GEMM takes bf16 adapters; with --lora-dtype fp8 use "
                "--torch-lora linear or overlap")
    if args.lora_dtype == "fp8" and args.jax_lora != "linear":
        p.error(f"--jax-lora {args.jax_lora}'s fused GEMM takes bf16 adapters; with --lora-dtype fp8 use "
                "--jax-lora linear")
    if args.lora_dtype == "fp8" and args.vllm == "on":
        p.error("--vllm on: vLLM's fp8 LoRA kernels quantise the activations too (W8A8), another computation than "
                "--lora-dtype fp8's; use --vllm auto or off")
    args.torch_fp8 = args.torch_fp8 or ("dequant" if args.smoke else "scaled_mm")
    args.steps = args.steps or (3 if args.smoke else 20)
    args.max_len = args.max_len or (32 if args.smoke else 1024)
    if args.budget_s is None and not args.smoke:
        args.budget_s = 450.0
    if args.budget_s is not None and args.budget_s <= 0:
        args.budget_s = None
    cases = select_cases(args)
    if args.list or not cases:
        for c in cases:
            print(c.name)
        return 0 if cases else 2
    if args.smoke:
        # tiny ops on a few (often shared) cores: one thread each, or thread contention dominates
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
        # (and the least LLVM optimisation: smoke compiles, it does not time)
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_cpu_multi_thread_eigen=false"
                                   " --xla_backend_optimization_level=0").strip()
        import torch
        torch.set_num_threads(1)
    with launch_policy(args):
        return run(args, cases)


def show_fused_linear_choices() -> None:
    """Prints the fused linear table's decisions (--torch-lora / --jax-lora auto) as the package logs
    them, once per (layer, M bucket, rank): which path each layer takes and why."""
    import logging

    class Choices(logging.Filter):
        def filter(self, record):
            return record.getMessage().startswith(("LoRA linear ", "RMSNorm + LoRA linear ", "fused linear table"))
    handler = logging.StreamHandler(sys.stdout)
    handler.addFilter(Choices())
    handler.setFormatter(logging.Formatter("%(name)s: %(message)s"))
    log = logging.getLogger("lora_core")
    log.addHandler(handler)
    log.setLevel(min(log.getEffectiveLevel(), logging.INFO))


def launch_policy(args):
    """The launch policy of the run: the device's, or with the fused kernel forced on / off (--fused)."""
    if args.fused == "auto":
        return contextlib.nullcontext()
    from lora_core.kernels import configs
    return configs.override_policy(dataclasses.replace(configs.launch_policy(), force_fused=args.fused == "on"))


def run(args, cases) -> int:
    """Times the selected cases and writes the results (main's work, under the run's launch policy)."""
    t_start = args.t_start = time.perf_counter()
    cfg = model_config(args.smoke)
    meta = env_meta(args, cfg)
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%S")
    fp8 = (("_fp8" if args.base == "fp8" else "") + ("_lora-fp8" if args.lora_dtype == "fp8" else "")
           + ("_aot" if args.jax_call == "aot" else ""))
    base = os.path.join(args.out, f"e2e_{'smoke' if args.smoke else 'h200'}{fp8}_{stamp}{args.tag}")
    os.makedirs(args.out, exist_ok=True)
    bench = Bench(args, cfg, cases)

    def report(final: bool) -> dict:
        failed = [r["case"] for r in bench.results for fw in bench.frameworks if not r[fw]["check_passed"]]
        out = dict(meta={**meta, "phases_s": bench.phases, "wall_s": time.perf_counter() - t_start,
                         "complete": final, "memory_gb": memory_meta(args),
                         "quantized_linears": bench.quantized_linears, "adapter_storage": bench.adapter_storage,
                         "jax_aot_programs": bench.jax_aot_programs if args.jax_call == "aot" else None},
                   cases=bench.results,
                   summary=dict(cases=len(bench.results), planned=len(cases), checks_failed=failed,
                                skipped=bench.skipped))
        with open(base + ".json", "w") as f:
            json.dump(out, f, indent=1)
        return out

    bench.on_result = lambda: report(False)           # a run cut short still leaves its cases
    bench.run()
    out = report(True)
    md = markdown(out)
    with open(base + ".md", "w") as f:
        f.write(f"run {json.dumps(out['meta'])}\n\n" + md)
    try:
        plot(out, base + ".png")
    except ImportError as e:
        print(f"no plot ({e})")
    print(md)
    print(f"wrote {base}.json / .md / .png in {out['meta']['wall_s']:.0f} s")
    if bench.skipped:
        print(f"skipped for the time budget: {bench.skipped}")
    if out["summary"]["checks_failed"]:
        print(f"CHECK FAILED: {out['summary']['checks_failed']}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
