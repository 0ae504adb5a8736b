"""What each rank of a tensor-parallel test runs (tests/test_parallel_torch.py, test_gpu_parallel_torch.py).

One step on every rank: the same random data (seeded), the same mapping (mixed adapters, rows
without LoRA, an empty slot), adapters of ranks 2, 4 and 8 in slots of rank 8, one adapter not
targeting every slice. Each rank builds the sharded layer around a real base layer shard (below),
loads the full adapters with the per-rank slot loader, runs one forward pass with its collectives
logged, and measures its output against

  - the unsharded layer computed on this process: the full base layer plus torch_lora's
    PunicaWrapper over the full (unsharded) adapter weights, cut to this rank's columns;
  - the float64 oracle (tests/oracle.py) of the same, added to this rank's base output.

It returns the measurements; the test asserts on every rank's.

Base layer shards (real tensor-parallel layers, small): `ColumnShard` (x @ W[rows].T + b[rows]),
`RowShard` (x_p @ W[:, cols].T, all-reduced, + b), `VocabShardEmbedding` (this rank's vocabulary rows,
others masked to zero, all-reduced) and `LMHeadShard` (h @ W[vocab rows].T, the local logits).
"""

from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist

import torch_lora
import torch_lora.parallel
from torch_lora import LoRAMapping
from torch_lora.parallel import (
    ColumnParallelLinearWithLoRA,
    MergedColumnParallelLinearWithLoRA,
    QKVParallelLinearWithLoRA,
    RowParallelLinearWithLoRA,
)
from torch_lora.parallel.layout import even_range, qkv_ranges

from . import oracle
from .distributed import CollectiveLog

IDS = [5, 6, 7, None]            # slots 0, 1, 2 hold adapters 5, 6, 7; slot 3 is empty
ADAPTER_RANKS = {5: 2, 6: 4, 7: 8}
SCALING = {5: 0.5, 6: 1.0, 7: 2.0}
MAX_LORAS, MAX_RANK = 4, 8
TOKENS = (5, 0, 7, 6, 7, 0, 5)   # adapter ids per token, 0 = no LoRA
ROWS = (7, 0, 6)                 # adapter ids per sampled row (LM head)
HIDDEN = 32
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def slot_of(i: int) -> int:
    return IDS.index(i) if i else -1


def make_wrapper(device, vocab: int = 64, backend: str | None = None) -> torch_lora.PunicaWrapper:
    w = torch_lora.PunicaWrapper(16, 4, device, max_loras=MAX_LORAS, backend=backend)
    w.update_metadata(LoRAMapping(TOKENS, ROWS), IDS, MAX_LORAS + 1, vocab)
    return w


def random_adapters(g: torch.Generator, in_size: int, widths, skip_slice: dict | None = None) -> dict:
    """id -> (A per slice (r, in) or None, B per slice (n_s, r) or None, bias per slice or None)."""
    out = {}
    for i, r in ADAPTER_RANKS.items():
        a, b, bias = [], [], []
        for s, n in enumerate(widths):
            if skip_slice and skip_slice.get(i) == s:
                a.append(None), b.append(None), bias.append(None)
                continue
            a.append(torch.randn(r, in_size, generator=g) / in_size ** 0.5)
            b.append(torch.randn(n, r, generator=g))
            bias.append(torch.randn(n, generator=g))
        out[i] = (a, b, bias)
    return out


def stacked_full(adapters: dict, in_size: int, widths, dtype, with_bias: bool):
    """The unsharded stacked slots (L, r, in), (L, n_s, r), (L, n_s) and ranks, scaling folded into B
    and rounded to `dtype` as the loader does."""
    a = [torch.zeros(MAX_LORAS, MAX_RANK, in_size, dtype=dtype) for _ in widths]
    b = [torch.zeros(MAX_LORAS, n, MAX_RANK, dtype=dtype) for n in widths]
    bias = [torch.zeros(MAX_LORAS, n, dtype=dtype) for n in widths]
    ranks = torch.zeros(MAX_LORAS, dtype=torch.int32)
    for i, (fa, fb, fbias) in adapters.items():
        slot = slot_of(i)
        ranks[slot] = ADAPTER_RANKS[i]
        for s in range(len(widths)):
            if fa[s] is None:
                continue
            r = fa[s].shape[0]
            a[s][slot, :r] = fa[s].to(dtype)
            b[s][slot, :, :r] = (fb[s] * SCALING[i]).to(dtype)
            bias[s][slot] = fbias[s].to(dtype)
    return a, b, (bias if with_bias else None), ranks


def load_all(layer, adapters: dict, with_bias: bool) -> None:
    for i, (fa, fb, fbias) in adapters.items():
        layer.set_lora(slot_of(i), fa if len(fa) > 1 else fa[0], fb if len(fb) > 1 else fb[0],
                       (fbias if len(fbias) > 1 else fbias[0]) if with_bias else None, scaling=SCALING[i])


def f64(t: torch.Tensor) -> np.ndarray:
    return t.detach().to("cpu", torch.float64).numpy()


# ----------------------------------------------------------------------------- base layer shards

class ColumnShard(torch.nn.Module):
    """Rows `rows` of a full linear layer's (W, b): x (T, H) -> (T, len(rows))."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor, rows: torch.Tensor):
        super().__init__()
        self.weight = torch.nn.Parameter(weight[rows].clone(), requires_grad=False)
        self.bias = torch.nn.Parameter(bias[rows].clone(), requires_grad=False)

    def forward(self, x):
        return torch.nn.functional.linear(x, self.weight, self.bias)


class RowShard(torch.nn.Module):
    """Columns `cols` of a full linear layer's W: x_p (T, |cols|) -> x_p @ W[:, cols].T summed over the
    group, + b (vLLM's RowParallelLinear with input_is_parallel and reduce_results)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor, cols: slice, group=None):
        super().__init__()
        self.weight = torch.nn.Parameter(weight[:, cols].clone(), requires_grad=False)
        self.bias = torch.nn.Parameter(bias.clone(), requires_grad=False)
        self.group = group

    def forward(self, x):
        y = torch.nn.functional.linear(x, self.weight)
        dist.all_reduce(y, group=self.group)
        return y + self.bias


# ----------------------------------------------------------------------------- linear layers

LINEAR_KINDS = ("column", "merged", "qkv", "row")
QKV_HEADS = dict(num_heads=4, num_kv_heads=2, head_size=4)   # kv heads split on 2 ranks, replicated on 4


def _linear_geometry(kind: str, rank: int, world: int):
    """(full slice widths, this rank's (start, stop) per slice)."""
    if kind == "column":
        return (24,), (even_range("n", 24, rank, world),)
    if kind == "merged":
        return (16, 24), tuple(even_range("n", n, rank, world) for n in (16, 24))
    if kind == "qkv":
        h = QKV_HEADS
        widths = (h["num_heads"] * h["head_size"],) + (h["num_kv_heads"] * h["head_size"],) * 2
        return widths, qkv_ranges(h["num_heads"], h["num_kv_heads"], h["head_size"], rank, world)
    if kind == "row":
        return (24,), ((0, 24),)
    raise ValueError(kind)


def _build_linear(kind, base, widths, fully_sharded, tokens_per_step, dtype, device, with_bias):
    common = dict(max_loras=MAX_LORAS, max_rank=MAX_RANK, fully_sharded=fully_sharded,
                  tokens_per_step=tokens_per_step, lora_bias=with_bias, dtype=dtype, device=device)
    if kind == "column":
        return ColumnParallelLinearWithLoRA(base, input_size=HIDDEN, output_size=widths[0], **common)
    if kind == "merged":
        return MergedColumnParallelLinearWithLoRA(base, input_size=HIDDEN, output_sizes=list(widths), **common)
    if kind == "qkv":
        return QKVParallelLinearWithLoRA(base, input_size=HIDDEN, **QKV_HEADS, **common)
    return RowParallelLinearWithLoRA(base, input_size=HIDDEN, output_size=widths[0], **common)


def case_linear(rank: int, world: int, kind: str, fully_sharded, dtype: str = "float32", seed: int = 0,
                device: str = "cpu", backend: str | None = None, with_bias: bool = True,
                tokens_per_step: int | None = None) -> dict:
    """One forward pass of a sharded linear layer; its errors against the unsharded layer and oracle,
    the collectives it issued beyond its base layer's, and the formula's."""
    dev = torch.device(device if device != "cuda" else f"cuda:{rank}")
    dt = DTYPES[dtype]
    g = torch.Generator().manual_seed(seed)
    widths, ranges = _linear_geometry(kind, rank, world)
    n = sum(widths)
    weight, bias = torch.randn(n, HIDDEN, generator=g) / HIDDEN ** 0.5, torch.randn(n, generator=g)
    x = torch.randn(len(TOKENS), HIDDEN, generator=g)
    adapters = random_adapters(g, HIDDEN, widths, skip_slice={6: 1} if len(widths) > 1 else None)
    weight, bias, x = weight.to(dt), bias.to(dt), x.to(dt)

    offsets = np.cumsum((0,) + widths[:-1])
    cols = torch.cat([torch.arange(o + s, o + e) for o, (s, e) in zip(offsets, ranges)])
    if kind == "row":
        in_cols = slice(*even_range("input_size", HIDDEN, rank, world))
        base, x_in = RowShard(weight, bias, in_cols), x[:, in_cols]
    else:
        base, x_in = ColumnShard(weight, bias, cols), x
    base = base.to(dev)
    layer = _build_linear(kind, base, widths, fully_sharded, tokens_per_step, dt, dev, with_bias)
    load_all(layer, adapters, with_bias)
    w = make_wrapper(dev, backend=backend)
    x_in = x_in.to(dev)

    with CollectiveLog() as base_log:
        base_y = base(x_in)
    layer.set_mapping(w)
    with CollectiveLog() as log:
        got = layer(x_in)
    lora_calls = log.calls[len(base_log.calls):]

    # the unsharded layer on this process, and the oracle
    a, b, bs, ranks = stacked_full(adapters, HIDDEN, widths, dt, with_bias)
    full_w = make_wrapper(dev, backend=backend)
    delta = torch.zeros(len(TOKENS), n, dtype=torch.float32, device=dev)
    full_w.add_lora_linear(delta, x.to(dev), tuple(t.to(dev) for t in a), tuple(t.to(dev) for t in b),
                           None if bs is None else tuple(t.to(dev) for t in bs), 1.0, widths,
                           lora_ranks=ranks.to(dev))
    idx = [slot_of(i) for i in TOKENS]
    want_delta = oracle.lora_linear(np.zeros((len(TOKENS), n)), f64(x), [f64(t) for t in a], [f64(t) for t in b],
                                    None if bs is None else [f64(t) for t in bs], 1.0, idx)
    expected_oracle = f64(base_y) + want_delta[:, cols.numpy()]
    expected_ref = f64(base_y) + f64(delta)[:, cols.numpy()]
    no_lora = [t for t, i in enumerate(idx) if i < 0]
    return dict(
        layout=layer.layout,
        shapes=[tuple(t.shape) for t in layer.lora_a_stacked + layer.lora_b_stacked],
        err_oracle=float(oracle.rel_err(f64(got), expected_oracle)),
        err_ref=float(oracle.rel_err(f64(got), expected_ref)),
        untouched=bool(torch.equal(got[no_lora], base_y[no_lora])),
        lora_calls=lora_calls,
        formula=list(layer.layout_costs(len(TOKENS), 3)[layer.layout].collectives),
        costs={k: v.moved_bytes() for k, v in layer.layout_costs(tokens_per_step or len(TOKENS)).items()},
        full_out=n, in_size=HIDDEN,
    )


def case_bad_input(rank: int, world: int) -> dict:
    """The construction and call errors of the linear layers, as (exception type, message)."""
    g = torch.Generator().manual_seed(1)
    weight, bias = torch.randn(24, HIDDEN, generator=g), torch.randn(24, generator=g)
    base = ColumnShard(weight, bias, torch.arange(*even_range("n", 24, rank, world)))
    found = {}

    def attempt(name, fn):
        try:
            fn()
        except (ValueError, TypeError, RuntimeError) as e:
            found[name] = (type(e).__name__, str(e))

    col = dict(input_size=HIDDEN, output_size=24, max_loras=MAX_LORAS)
    attempt("no_layout", lambda: ColumnParallelLinearWithLoRA(base, max_rank=MAX_RANK, **col))
    attempt("rank_split", lambda: ColumnParallelLinearWithLoRA(base, max_rank=3, fully_sharded=True, **col))
    attempt("bad_flag", lambda: ColumnParallelLinearWithLoRA(base, max_rank=MAX_RANK, fully_sharded=1, **col))
    attempt("uneven_out", lambda: ColumnParallelLinearWithLoRA(base, input_size=HIDDEN, output_size=25,
                                                                max_loras=MAX_LORAS, max_rank=MAX_RANK,
                                                                fully_sharded=False))
    attempt("not_module", lambda: ColumnParallelLinearWithLoRA(lambda x: x, max_rank=MAX_RANK, fully_sharded=False,
                                                                **col))
    attempt("bad_dtype", lambda: ColumnParallelLinearWithLoRA(base, max_rank=MAX_RANK, fully_sharded=False,
                                                               dtype=torch.float64, **col))
    attempt("row_split", lambda: RowParallelLinearWithLoRA(torch.nn.Identity(), input_size=HIDDEN,
                                                           output_size=3 * world + 1, max_loras=MAX_LORAS,
                                                           max_rank=MAX_RANK, fully_sharded=True))
    layer = ColumnParallelLinearWithLoRA(base, max_rank=MAX_RANK, fully_sharded=False, **col)
    layer.set_mapping(make_wrapper("cpu", backend="torch"))
    attempt("x_width", lambda: layer(torch.randn(len(TOKENS), HIDDEN + 1)))
    wrong_base = ColumnParallelLinearWithLoRA(ColumnShard(weight, bias, torch.arange(5)), max_rank=MAX_RANK,
                                              fully_sharded=False, **col)
    wrong_base.set_mapping(make_wrapper("cpu", backend="torch"))
    attempt("base_width", lambda: wrong_base(torch.randn(len(TOKENS), HIDDEN)))
    attempt("slot", lambda: layer.set_lora(MAX_LORAS, torch.randn(2, HIDDEN), torch.randn(24, 2)))
    attempt("a_shape", lambda: layer.set_lora(0, torch.randn(2, HIDDEN + 1), torch.randn(24, 2)))
    attempt("a_rank", lambda: layer.set_lora(0, torch.randn(MAX_RANK + 1, HIDDEN), torch.randn(24, MAX_RANK + 1)))
    attempt("b_shape", lambda: layer.set_lora(0, torch.randn(2, HIDDEN), torch.randn(24, 3)))
    attempt("half_none", lambda: layer.set_lora(0, torch.randn(2, HIDDEN), None))
    attempt("bias_unwanted", lambda: layer.set_lora(0, torch.randn(2, HIDDEN), torch.randn(24, 2), torch.randn(24)))
    attempt("int_weights", lambda: layer.set_lora(0, torch.ones(2, HIDDEN, dtype=torch.int32), torch.randn(24, 2)))
    attempt("not_a_layer", lambda: torch_lora.parallel.load_lora_slot(base, 0, torch.randn(2, HIDDEN),
                                                                         torch.randn(24, 2)))
    merged_base = ColumnShard(weight, bias, torch.arange(*even_range("n", 24, rank, world)))
    merged = MergedColumnParallelLinearWithLoRA(merged_base, input_size=HIDDEN, output_sizes=[8, 16],
                                                max_loras=MAX_LORAS, max_rank=MAX_RANK, fully_sharded=False)
    attempt("slices", lambda: merged.set_lora(0, torch.randn(2, HIDDEN), torch.randn(8, 2)))
    # without a wrapper a layer is its base layer
    x = torch.randn(len(TOKENS), HIDDEN)
    plain = ColumnParallelLinearWithLoRA(base, max_rank=MAX_RANK, fully_sharded=False, **col)
    return dict(errors=found, base_only=bool(torch.equal(plain(x), base(x))))


# ----------------------------------------------------------------------------- vocabulary-parallel layers

VOCAB, EMBED = 50, 16            # 50 = 2 * 25, and 4 * 13 - 2: the last rank's shard is padded at P = 4


class VocabShardEmbedding(torch.nn.Module):
    """Rows [start, stop) of a full embedding table; other ids give zero here; summed over the group."""

    def __init__(self, table: torch.Tensor, vocab_range: tuple[int, int], group=None):
        super().__init__()
        start, stop = vocab_range
        part = torch.zeros(stop - start, table.shape[1], dtype=table.dtype)
        part[: max(0, min(stop, table.shape[0]) - start)] = table[start:stop]
        self.weight = torch.nn.Parameter(part, requires_grad=False)
        self.start, self.group = start, group

    def forward(self, ids):
        local = ids - self.start
        inside = (local >= 0) & (local < self.weight.shape[0])
        y = torch.nn.functional.embedding(local.clamp(0, self.weight.shape[0] - 1), self.weight) * inside[..., None]
        dist.all_reduce(y, group=self.group)
        return y


class LMHeadShard(torch.nn.Module):
    """Rows [start, stop) of a full LM head W (V, H), zero past V: h (R, H) -> this rank's logits."""

    def __init__(self, weight: torch.Tensor, vocab_range: tuple[int, int]):
        super().__init__()
        start, stop = vocab_range
        part = torch.zeros(stop - start, weight.shape[1], dtype=weight.dtype)
        part[: max(0, min(stop, weight.shape[0]) - start)] = weight[start:stop]
        self.weight = torch.nn.Parameter(part, requires_grad=False)

    def forward(self, h):
        return torch.nn.functional.linear(h, self.weight)


def case_vocab(rank: int, world: int, kind: str, fully_sharded, dtype: str = "float32", seed: int = 0,
               device: str = "cpu", backend: str | None = None, tokens_per_step: int | None = None) -> dict:
    """One forward pass of the sharded embedding or LM head; measured as case_linear's."""
    from torch_lora.parallel import ParallelLMHeadWithLoRA, VocabParallelEmbeddingWithLoRA
    from torch_lora.parallel.layout import padded_range

    dev = torch.device(device if device != "cuda" else f"cuda:{rank}")
    dt = DTYPES[dtype]
    g = torch.Generator().manual_seed(seed)
    shard = padded_range(VOCAB, rank, world)
    cols = np.arange(shard[0], min(shard[1], VOCAB))
    common = dict(max_loras=MAX_LORAS, max_rank=MAX_RANK, fully_sharded=fully_sharded,
                  tokens_per_step=tokens_per_step, dtype=dt, device=dev)
    if kind == "embedding":
        table = torch.randn(VOCAB, EMBED, generator=g).to(dt)
        ids = torch.randint(0, VOCAB, (len(TOKENS),), generator=g)
        adapters = random_adapters(g, VOCAB, (EMBED,))
        base = VocabShardEmbedding(table, padded_range(VOCAB, rank, world)).to(dev)
        layer = VocabParallelEmbeddingWithLoRA(base, num_embeddings=VOCAB, embedding_dim=EMBED, **common)
        x_in, idx_of = ids.to(dev), [slot_of(i) for i in TOKENS]
        full_base = torch.nn.functional.embedding(ids, table)
    else:
        weight = (torch.randn(VOCAB, HIDDEN, generator=g) / HIDDEN ** 0.5).to(dt)
        h = torch.randn(len(ROWS), HIDDEN, generator=g).to(dt)
        adapters = random_adapters(g, HIDDEN, (VOCAB,))
        base = LMHeadShard(weight, shard).to(dev)
        layer = ParallelLMHeadWithLoRA(base, input_size=HIDDEN, vocab_size=VOCAB, **common)
        x_in, idx_of = h.to(dev), [slot_of(i) for i in ROWS]
        full_base = torch.nn.functional.linear(h, weight)
    load_all(layer, adapters, False)
    w = make_wrapper(dev, vocab=VOCAB, backend=backend)

    with CollectiveLog() as base_log:
        base_y = base(x_in)
    layer.set_mapping(w)
    with CollectiveLog() as log:
        got = layer(x_in)
    lora_calls = log.calls[len(base_log.calls):]

    # the unsharded layer on this process (PEFT's A (r, V) as a table (L, V, r) for the embedding)
    in_size = VOCAB if kind == "embedding" else HIDDEN
    a, b, _, ranks = stacked_full(adapters, in_size, (EMBED if kind == "embedding" else VOCAB,), dt, False)
    full_w = make_wrapper(dev, vocab=VOCAB, backend=backend)
    y_ref = torch.zeros(full_base.shape, dtype=torch.float32, device=dev)
    if kind == "embedding":
        slots = torch.tensor([max(i, 0) for i in idx_of])
        rows = a[0].transpose(1, 2)[slots, ids].to(torch.float32)          # (T, r): table[slot, id]
        full_w.add_lora_embedding(y_ref, rows.to(dev), b[0].to(dev), lora_ranks=ranks.to(dev))
        want = oracle.expand(f64(rows)[None], [f64(b[0])], np.zeros(full_base.shape), idx_of)
        keep = np.arange(EMBED)
    else:
        full_w.add_lora_logits(y_ref, h.to(dev), a[0].to(dev), b[0].to(dev), 1.0, lora_ranks=ranks.to(dev))
        want = oracle.logits(np.zeros(full_base.shape), f64(h), f64(a[0]), f64(b[0]), 1.0, idx_of)
        keep = cols
    local = f64(got)[:, : len(keep)]
    no_lora = [t for t, i in enumerate(idx_of) if i < 0]
    return dict(
        layout=layer.layout,
        shapes=[tuple(t.shape) for t in layer.lora_a_stacked + layer.lora_b_stacked],
        err_oracle=float(oracle.rel_err(local, f64(base_y)[:, : len(keep)] + want[:, keep])),
        err_ref=float(oracle.rel_err(local, f64(base_y)[:, : len(keep)] + f64(y_ref)[:, keep])),
        untouched=bool(torch.equal(got[no_lora], base_y[no_lora])) and bool(torch.equal(got[:, len(keep):],
                                                                                        base_y[:, len(keep):])),
        lora_calls=lora_calls,
        formula=list(layer.layout_costs(len(idx_of), 3)[layer.layout].collectives),
        costs={k: v.moved_bytes() for k, v in layer.layout_costs(tokens_per_step or len(idx_of)).items()},
    )


# ----------------------------------------------------------------------------- per-rank slot loading

def case_loading(rank: int, world: int, fully_sharded: bool) -> dict:
    """The slot loader on a QKV layer (kv heads replicated at P = 4) and a sharded embedding table:
    what each rank keeps, that the caller's full tensors are not kept, NumPy input, reloading and
    clearing a slot in place."""
    import gc
    import weakref

    from torch_lora.parallel import VocabParallelEmbeddingWithLoRA
    from torch_lora.parallel.layout import padded_range

    g = torch.Generator().manual_seed(3)
    widths, ranges = _linear_geometry("qkv", rank, world)
    n = sum(widths)
    weight, bias = torch.randn(n, HIDDEN, generator=g), torch.randn(n, generator=g)
    offsets = np.cumsum((0,) + widths[:-1])
    cols = torch.cat([torch.arange(o + s, o + e) for o, (s, e) in zip(offsets, ranges)])
    layer = _build_linear("qkv", ColumnShard(weight, bias, cols), widths, fully_sharded, None, torch.float32,
                          "cpu", False)
    ptrs = [t.data_ptr() for t in layer.lora_a_stacked + layer.lora_b_stacked + (layer.lora_ranks,)]
    adapters = random_adapters(g, HIDDEN, widths, skip_slice={6: 1})

    # 1. the caller's full tensors are not kept by the layer
    full_b = [t.clone() for t in adapters[7][1]]
    refs = [weakref.ref(t) for t in full_b]
    layer.set_lora(slot_of(7), adapters[7][0], full_b, scaling=SCALING[7])
    before = [t[slot_of(7)].clone() for t in layer.lora_b_stacked]
    for full in full_b:         # shared memory would show here
        full.fill_(float("nan"))
    del full
    kept = [not torch.equal(t[slot_of(7)], b) for t, b in zip(layer.lora_b_stacked, before)]
    del full_b
    gc.collect()
    kept += [r() is not None for r in refs]

    # 2. this rank's B rows and A chunk, and the ranks; all ranks' B rows together are the full B
    for i in (5, 6):
        fa, fb, _ = adapters[i]
        layer.set_lora(slot_of(i), [t.numpy() if t is not None else None for t in fa],   # NumPy, as lora_core.peft
                       [t.numpy() if t is not None else None for t in fb], scaling=SCALING[i])
    a_full, b_full, _, ranks = stacked_full(adapters, HIDDEN, widths, torch.float32, False)
    gathered_b = []
    for b in layer.lora_b_stacked:
        pieces = [torch.empty_like(b) for _ in range(world)]
        dist.all_gather(pieces, b.contiguous())
        gathered_b.append(pieces)
    b_ok = []
    for s, (start, stop) in enumerate(ranges):
        b_ok.append(bool(torch.equal(layer.lora_b_stacked[s], b_full[s][:, start:stop])))
    chunk = layer.slice_shards[0].a_rank
    a_ok = [bool(torch.equal(layer.lora_a_stacked[s], a_full[s][:, chunk[0]:chunk[1]])) for s in range(3)]
    # q rows of all ranks, concatenated in rank order, are the full q slice of B
    q_all = torch.cat(list(gathered_b[0]), dim=1)
    q_complete = bool(torch.equal(q_all, b_full[0]))
    layer_ranks, local_ranks = layer.lora_ranks.tolist(), layer.lora_ranks_local.tolist()

    # 3. reloading a slot with a smaller adapter leaves nothing of the old one; clearing empties it
    layer.set_lora(slot_of(7), adapters[5][0], adapters[5][1], scaling=SCALING[5])
    reload_ok = all(torch.equal(layer.lora_b_stacked[s][slot_of(7)], layer.lora_b_stacked[s][slot_of(5)])
                    and torch.equal(layer.lora_a_stacked[s][slot_of(7)], layer.lora_a_stacked[s][slot_of(5)])
                    for s in range(3))
    ranks_after_reload = layer.lora_ranks.tolist()
    layer.reset_lora(slot_of(6))
    cleared = all(not t[slot_of(6)].any() for t in layer.lora_a_stacked + layer.lora_b_stacked)

    # 4. an embedding table sharded over the vocabulary: rows [start, stop) of A.T, zero past V
    table_layer = VocabParallelEmbeddingWithLoRA(torch.nn.Identity(), num_embeddings=VOCAB, embedding_dim=EMBED,
                                                 max_loras=MAX_LORAS, max_rank=MAX_RANK, fully_sharded=True,
                                                 dtype=torch.float32)
    ea = torch.randn(4, VOCAB, generator=g)
    eb = torch.randn(EMBED, 4, generator=g)
    table_layer.set_lora(1, ea.numpy(), eb.numpy(), scaling=0.25)
    start, stop = padded_range(VOCAB, rank, world)
    want_rows = torch.zeros(stop - start, MAX_RANK)
    held = max(0, min(stop, VOCAB) - start)
    want_rows[:held, :4] = ea.T[start:start + held]
    table_ok = bool(torch.equal(table_layer.lora_a_0[1], want_rows)) and bool(
        torch.equal(table_layer.lora_b_0[1][:, :4], eb * 0.25)) and not table_layer.lora_a_0[0].any()
    return dict(
        kept=kept, b_ok=b_ok, a_ok=a_ok, q_complete=q_complete,
        ranks=ranks.tolist(), layer_ranks=layer_ranks, local_ranks=local_ranks,
        ranks_after_reload=ranks_after_reload, reload_ok=reload_ok, cleared=cleared,
        ranks_after_clear=layer.lora_ranks.tolist(), in_place=ptrs == [t.data_ptr() for t in layer.lora_a_stacked +
                                                                      layer.lora_b_stacked + (layer.lora_ranks,)],
        b_rows=[t.shape[1] for t in layer.lora_b_stacked], table_ok=table_ok,
    )


# ----------------------------------------------------------------------------- CUDA (NCCL) only

def case_cuda_graph(rank: int, world: int, kind: str, fully_sharded: bool) -> dict:
    """A layer's forward pass captured in a CUDA graph, replayed after the next step's mapping and
    inputs are written in place; compared with the eager pass of that step. The eager pass runs
    under torch.cuda.set_sync_debug_mode("error"): no host synchronisation, collectives included."""
    from torch_lora.parallel import ParallelLMHeadWithLoRA, VocabParallelEmbeddingWithLoRA
    from torch_lora.parallel.layout import padded_range

    dev = torch.device(f"cuda:{rank}")
    dt = torch.bfloat16
    g = torch.Generator().manual_seed(7)
    common = dict(max_loras=MAX_LORAS, max_rank=MAX_RANK, fully_sharded=fully_sharded, dtype=dt, device=dev)
    if kind in ("column", "row", "qkv", "merged"):
        widths, ranges = _linear_geometry(kind, rank, world)
        n = sum(widths)
        weight, bias = (torch.randn(n, HIDDEN, generator=g) / HIDDEN ** 0.5).to(dt), torch.randn(n, generator=g).to(dt)
        offsets = np.cumsum((0,) + widths[:-1])
        cols = torch.cat([torch.arange(o + s, o + e) for o, (s, e) in zip(offsets, ranges)])
        if kind == "row":
            in_cols = slice(*even_range("input_size", HIDDEN, rank, world))
            base = RowShard(weight, bias, in_cols)
        else:
            in_cols, base = slice(None), ColumnShard(weight, bias, cols)
        layer = _build_linear(kind, base.to(dev), widths, fully_sharded, None, dt, dev, False)
        adapters = random_adapters(g, HIDDEN, widths, skip_slice={6: 1} if len(widths) > 1 else None)
        inputs = [torch.randn(len(TOKENS), HIDDEN, generator=g).to(dt)[:, in_cols] for _ in range(2)]
    elif kind == "embedding":
        base = VocabShardEmbedding(torch.randn(VOCAB, EMBED, generator=g).to(dt), padded_range(VOCAB, rank, world))
        layer = VocabParallelEmbeddingWithLoRA(base.to(dev), num_embeddings=VOCAB, embedding_dim=EMBED, **common)
        adapters = random_adapters(g, VOCAB, (EMBED,))
        inputs = [torch.randint(0, VOCAB, (len(TOKENS),), generator=g) for _ in range(2)]
    else:
        base = LMHeadShard((torch.randn(VOCAB, HIDDEN, generator=g) / HIDDEN ** 0.5).to(dt),
                           padded_range(VOCAB, rank, world))
        layer = ParallelLMHeadWithLoRA(base.to(dev), input_size=HIDDEN, vocab_size=VOCAB, **common)
        adapters = random_adapters(g, HIDDEN, (VOCAB,))
        inputs = [torch.randn(len(ROWS), HIDDEN, generator=g).to(dt) for _ in range(2)]
    load_all(layer, adapters, False)
    w = make_wrapper(dev, vocab=VOCAB)
    layer.set_mapping(w)
    static_x = inputs[0].to(dev).clone()
    side = torch.cuda.Stream(dev)
    side.wait_stream(torch.cuda.current_stream(dev))
    with torch.cuda.stream(side):
        for _ in range(2):                          # compile the kernels, start the communicator
            layer(static_x)
    torch.cuda.current_stream(dev).wait_stream(side)
    torch.cuda.synchronize(dev)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = layer(static_x)
    static_out = static_out[0] if isinstance(static_out, tuple) else static_out

    # the next step: another mapping (same token count) and new inputs, written in place
    tokens2, rows2 = tuple(reversed(TOKENS)), tuple(reversed(ROWS))
    w.update_metadata(LoRAMapping(tokens2, rows2), IDS, MAX_LORAS + 1, VOCAB)
    static_x.copy_(inputs[1].to(dev))
    graph.replay()
    replayed = static_out.clone()
    torch.cuda.synchronize(dev)
    torch.cuda.set_sync_debug_mode("error")
    try:
        eager = layer(static_x)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    eager = eager[0] if isinstance(eager, tuple) else eager
    base_y = base(static_x)
    idx2 = [slot_of(i) for i in (rows2 if kind == "lm_head" else tokens2)]
    changed = [t for t, i in enumerate(idx2) if i >= 0]
    return dict(max_diff=float((replayed.float() - eager.float()).abs().max()),
                scale=float(eager.float().abs().max()),
                lora_rows_changed=bool((eager[changed].float() != base_y[changed].float()).any(dim=-1).all()),
                no_lora_untouched=bool(torch.equal(replayed[[t for t, i in enumerate(idx2) if i < 0]],
                                                   base_y[[t for t, i in enumerate(idx2) if i < 0]])))


def case_cuda_upload(rank: int, world: int) -> dict:
    """Loading a full B held on the host into a CUDA column layer allocates less than the full B on
    the device (peak memory): only this rank's rows travel."""
    dev = torch.device(f"cuda:{rank}")
    out_size, hidden, r = 8192, 256, 16
    base = torch.nn.Linear(hidden, out_size // world, bias=False).to(dev)
    layer = ColumnParallelLinearWithLoRA(base, input_size=hidden, output_size=out_size, max_loras=2, max_rank=r,
                                         fully_sharded=False, dtype=torch.bfloat16, device=dev)
    a, b = torch.randn(r, hidden), torch.randn(out_size, r)       # float32, on the host
    torch.cuda.synchronize(dev)
    before = torch.cuda.memory_allocated(dev)
    torch.cuda.reset_peak_memory_stats(dev)
    layer.set_lora(1, a, b, scaling=0.5)
    torch.cuda.synchronize(dev)
    peak = torch.cuda.max_memory_allocated(dev) - before
    start, stop = even_range("output_size", out_size, rank, world)
    ok = bool(torch.equal(layer.lora_b_0[1].cpu(), (b[start:stop] * 0.5).to(torch.bfloat16)))
    return dict(peak=peak, full_bytes=b.numel() * b.element_size(), equal=ok,
                after=torch.cuda.memory_allocated(dev) - before)


def case_manager(rank: int, world: int, fully_sharded: bool) -> dict:
    """torch_lora.AdapterManager over tensor-parallel layers (a QKV layer, a row layer, a sharded
    embedding table): each rank's slots and host cache hold only its shard, equal slot for slot to
    what the per-rank loader (`set_lora`) writes; eviction and hot swap keep it so."""
    from lora_core.peft import LoraModule, PeftAdapter
    from torch_lora.adapters import AdapterManager
    from torch_lora.parallel import VocabParallelEmbeddingWithLoRA

    g = torch.Generator().manual_seed(11)
    widths, ranges = _linear_geometry("qkv", rank, world)
    n = sum(widths)
    weight, bias = torch.randn(n, HIDDEN, generator=g), torch.randn(n, generator=g)
    offsets = np.cumsum((0,) + widths[:-1])
    cols = torch.cat([torch.arange(o + s, o + e) for o, (s, e) in zip(offsets, ranges)])
    in_cols = slice(*even_range("input_size", HIDDEN, rank, world))
    row_w, row_b = torch.randn(HIDDEN, HIDDEN, generator=g), torch.randn(HIDDEN, generator=g)

    def build():
        qkv = _build_linear("qkv", ColumnShard(weight, bias, cols), widths, fully_sharded, None, torch.float32,
                            "cpu", False)
        row = _build_linear("row", RowShard(row_w, row_b, in_cols), (HIDDEN,), fully_sharded, None, torch.float32,
                            "cpu", False)
        emb = VocabParallelEmbeddingWithLoRA(torch.nn.Identity(), num_embeddings=VOCAB, embedding_dim=EMBED,
                                             max_loras=MAX_LORAS, max_rank=MAX_RANK, fully_sharded=fully_sharded,
                                             dtype=torch.float32)
        qkv.module_names = ("m.q_proj", "m.k_proj", "m.v_proj")
        row.module_names = ("m.o_proj",)
        emb.module_names = ("m.embed_tokens",)
        return {"qkv": qkv, "row": row, "embed": emb}

    def adapter(name, r, scaling):
        mods = {}
        for s, w in zip(("q", "k", "v"), widths):
            mods[f"m.{s}_proj"] = LoraModule(torch.randn(r, HIDDEN, generator=g).numpy(),
                                             torch.randn(w, r, generator=g).numpy(), scaling, "linear")
        mods["m.o_proj"] = LoraModule(torch.randn(r, HIDDEN, generator=g).numpy(),
                                      torch.randn(HIDDEN, r, generator=g).numpy(), scaling, "linear")
        mods["m.embed_tokens"] = LoraModule(torch.randn(r, VOCAB, generator=g).numpy(),
                                            torch.randn(EMBED, r, generator=g).numpy(), scaling, "embedding")
        return PeftAdapter(name=name, r=r, lora_alpha=r * scaling, use_rslora=False, target_modules=None,
                           modules=mods, config={}, base_layer_shapes={})

    adapters = {1: adapter("a", 8, 2.0), 2: adapter("b", 4, 0.5), 3: adapter("c", 2, 1.0)}
    layers = build()
    manager = AdapterManager(layers, host_cache_size=2)
    for i, ad in adapters.items():
        manager.register(i, ad)
    manager.activate([1, 2, 3])
    manager.register(2, adapters[3])            # hot swap: slot of 2 now holds c

    def expected(table):
        """Fresh layers loaded by the per-rank loader with the manager's slot table."""
        ref = build()
        for slot, i in enumerate(table):
            if i is None:
                continue
            ad = adapters[3] if i == 2 else adapters[i]
            m = ad.modules
            for path, names in (("qkv", ("m.q_proj", "m.k_proj", "m.v_proj")), ("row", ("m.o_proj",)),
                                ("embed", ("m.embed_tokens",))):
                a = [m[k].lora_a for k in names]
                b = [m[k].lora_b for k in names]
                ref[path].set_lora(slot, a if len(a) > 1 else a[0], b if len(b) > 1 else b[0],
                                   scaling=m[names[0]].scaling)
        return ref

    def same(ref) -> bool:
        return all(torch.equal(x, y) for path in layers for x, y in
                   zip(layers[path].lora_a_stacked + layers[path].lora_b_stacked + (layers[path].lora_ranks,
                                                                                     layers[path].lora_ranks_local),
                       ref[path].lora_a_stacked + ref[path].lora_b_stacked + (ref[path].lora_ranks,
                                                                               ref[path].lora_ranks_local)))

    first = same(expected(manager.lora_index_to_id))
    manager.register(4, adapters[1])
    adapters[4] = adapters[1]
    manager.activate([4])                       # evicts the least recently used slot
    second = same(expected(manager.lora_index_to_id))
    host_elems = sum(t.numel() for t in manager._host[4].tensors["qkv"])
    slot_elems = sum(t[0].numel() for t in layers["qkv"].lora_a_stacked + layers["qkv"].lora_b_stacked)
    full_b = sum(widths) * MAX_RANK
    return dict(first=first, second=second, host_elems=host_elems, slot_elems=slot_elems,
                b_rows=[t.shape[1] for t in layers["qkv"].lora_b_stacked], full_b_elems=full_b,
                table=manager.lora_index_to_id)
