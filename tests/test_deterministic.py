"""Deterministic mode (`deterministic=True`): a request's rows are bitwise the same in every batch.

One request (a few tokens of one adapter, fixed inputs) is served alone and inside random batches:
random neighbours with random adapters (and tokens without LoRA), the request at a random
position. Its rows of every op (lora_shrink, lora_expand, BGMV, SGMV) and of add_lora_linear
(through a `PunicaWrapper(..., deterministic=True)`) must be bitwise equal to the rows it gets
alone, and the same batch run twice must give the same bits. Every result is also checked against
the float64 oracle, so a deterministic path that computes the wrong thing fails too.

On the CPU: the reference backends (xla, pallas_tpu, torch) and the Triton kernels in Triton's
interpreter, tiny shapes, batches of 1-64 tokens. tests/test_gpu_deterministic.py runs the same
check (`check_request_invariance`) on the compiled kernels with 100 batches of 1-512 tokens.

Also the deterministic wrapper and ops as a caller meets them (xla under jit, torch; a
non-bool deterministic= is a TypeError).
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest
import torch

import torch_lora
from lora_core.host_mapping import LoRAMapping

from . import jax_helpers, oracle, torch_helpers
from .impls import IMPLS, round_to

OPS = ("lora_shrink", "lora_expand", "bgmv_shrink", "bgmv_expand", "bgmv_expand_slice", "sgmv_shrink",
       "sgmv_expand", "sgmv_expand_slice", "add_lora_linear")
SCALE = 0.5
SLICE_OFFSET = 3   # bgmv/sgmv_expand_slice write slice 0's B at this column


@dataclasses.dataclass(frozen=True)
class Shapes:
    hidden: int = 64
    rank: int = 32          # > the interpreter's deterministic BLOCK_R (16): the expand's rank loop runs
    slots: int = 4
    slices: tuple = (24, 8)
    request_tokens: int = 3
    request_slot: int = 1


class Traffic:
    """Weights, one request and random batches around it (NumPy, already rounded to `dtype`)."""

    def __init__(self, dtype: str, shapes: Shapes = Shapes(), seed: int = 0):
        rng = self.rng = np.random.default_rng(seed)
        self.dtype, self.shapes = dtype, shapes
        sh = shapes
        self.width = sum(sh.slices) + SLICE_OFFSET
        self.lora_a = [round_to(rng.standard_normal((sh.slots, 1, sh.rank, sh.hidden)) / np.sqrt(sh.hidden), dtype)
                       for _ in sh.slices]
        self.lora_b = [round_to(rng.standard_normal((sh.slots, 1, n, sh.rank)) / np.sqrt(sh.rank), dtype)
                       for n in sh.slices]
        self.bias = [round_to(rng.standard_normal((sh.slots, n)), dtype) for n in sh.slices]
        self.request = self._tokens(sh.request_tokens)

    def _tokens(self, n: int):
        """(x, y, buf) of n random tokens."""
        sh, rng = self.shapes, self.rng
        return (round_to(rng.standard_normal((n, sh.hidden)), self.dtype),
                round_to(rng.standard_normal((n, self.width)), self.dtype),
                rng.standard_normal((len(sh.slices), n, sh.rank)).astype(np.float32))

    def alone(self, n: int):
        """The request's first n tokens alone: (x, y, buf, idx)."""
        x, y, buf = self.request
        return x[:n], y[:n], buf[:, :n], np.full(n, self.shapes.request_slot, np.int32)

    def batch(self, size: int):
        """(x, y, buf, idx, rows): `size` random tokens with the request's tokens at `rows` (the
        request is cut to the batch when the batch is smaller)."""
        sh, rng = self.shapes, self.rng
        n = min(sh.request_tokens, size)
        start = int(rng.integers(0, size - n + 1))
        rows = np.arange(start, start + n)
        idx = rng.integers(-1, sh.slots, size).astype(np.int32)
        idx[rows] = sh.request_slot
        x, y, buf = self._tokens(size)
        rx, ry, rbuf = self.request
        x[rows], y[rows], buf[:, rows] = rx[:n], ry[:n], rbuf[:, :n]
        return x, y, buf, idx, rows


def _ids(idx):
    return tuple(0 if i < 0 else 101 + int(i) for i in idx)


def _side_wrapper(impl, capacity: int, slots: int):
    device = None if impl.side == "jax" else impl.device
    return impl.pkg.PunicaWrapper(capacity, 4, device, max_loras=slots, backend=impl.backend, deterministic=True)


def run_ops(impl, traffic: Traffic, x, y, buf, idx, ops=OPS, make_wrapper=_side_wrapper) -> dict:
    """{op: its float64 NumPy result} for one batch, every op deterministic; add_lora_linear
    through `make_wrapper(impl, capacity, slots)`, a deterministic PunicaWrapper."""
    sh, dt = traffic.shapes, traffic.dtype
    a = [impl.arr(w, dt) for w in traffic.lora_a]
    b = [impl.arr(w, dt) for w in traffic.lora_b]
    b0 = impl.arr(traffic.lora_b[0], dt)                       # (L, 1, n_0, r): the one-slice ops
    kw = dict(backend=impl.backend, deterministic=True)
    n, torch_side = len(idx), impl.side == "torch"
    fresh_y = lambda: impl.arr(y, dt)
    buf0 = impl.arr(buf[0], "float32")
    segments = oracle.compute_meta(idx.tolist())[:6]
    seg = tuple(impl.idx(v) for v in segments[:3]) + tuple(segments[3:])
    out = {}
    for op in ops:
        if op == "lora_shrink":
            meta = impl.meta(idx, sh.slots, capacity=n + 2)
            if torch_side:
                import torch
                res = torch.full((len(sh.slices), n, sh.rank), float("nan"), dtype=torch.float32, device=impl.device)
                impl.ops.lora_shrink(impl.arr(x, dt), a, res, *meta.meta_args(n), SCALE, **kw)
            else:
                res = impl.ops.lora_shrink(impl.arr(x, dt), a, meta, SCALE, **kw)
        elif op == "lora_expand":
            meta = impl.meta(idx, sh.slots, capacity=n + 2)
            if torch_side:
                res = fresh_y()
                impl.ops.lora_expand(impl.arr(buf, "float32"), b, res, *meta.meta_args(n), offset_start=SLICE_OFFSET,
                                     add_inputs=True, **kw)
            else:
                res = impl.ops.lora_expand(impl.arr(buf, "float32"), b, fresh_y(), meta, SLICE_OFFSET, True, **kw)
        elif op == "bgmv_shrink":
            res = impl.ops.bgmv_shrink(impl.arr(x, dt), impl.arr(traffic.lora_a[0], dt), impl.idx(idx), SCALE, **kw)
        elif op == "bgmv_expand":
            res = impl.ops.bgmv_expand(buf0, b0, fresh_y(), impl.idx(idx), True, **kw)
        elif op == "bgmv_expand_slice":
            res = impl.ops.bgmv_expand_slice(buf0, b0, fresh_y(), impl.idx(idx), SLICE_OFFSET, sh.slices[0], False,
                                             **kw)
        elif op == "sgmv_shrink":
            res = impl.ops.sgmv_shrink(impl.arr(x, dt), impl.arr(traffic.lora_a[0], dt), *seg, SCALE, **kw)
        elif op == "sgmv_expand":
            res = impl.ops.sgmv_expand(buf0, b0, fresh_y(), *seg, True, **kw)
        elif op == "sgmv_expand_slice":
            res = impl.ops.sgmv_expand_slice(buf0, b0, fresh_y(), *seg, SLICE_OFFSET, sh.slices[0], True, **kw)
        elif op == "add_lora_linear":
            w = make_wrapper(impl, max(n, 8), sh.slots)
            w.update_metadata(LoRAMapping(_ids(idx), _ids(idx[:1])), [101 + s for s in range(sh.slots)],
                              sh.slots + 1, 32)
            res = w.add_lora_linear(fresh_y(), impl.arr(x, dt), a, b, [impl.arr(v, dt) for v in traffic.bias],
                                    SCALE, sh.slices)
        else:
            raise ValueError(f"unknown op {op!r}")
        out[op] = impl.to_np(res)
    return out


def check_oracle(traffic: Traffic, x, y, buf, idx, got: dict) -> None:
    """Every op's result against the float64 oracle (the dtype's tolerance)."""
    a0, b0 = traffic.lora_a[0], traffic.lora_b[0]
    want = {
        "lora_shrink": lambda: oracle.shrink(x, traffic.lora_a, idx, SCALE),
        "lora_expand": lambda: oracle.expand(buf, traffic.lora_b, y, idx, SLICE_OFFSET, True),
        "bgmv_shrink": lambda: oracle.shrink(x, [a0], idx, SCALE)[0],
        "bgmv_expand": lambda: oracle.expand(buf[:1], [b0], y, idx, 0, True),
        "bgmv_expand_slice": lambda: oracle.expand(buf[:1], [b0], y, idx, SLICE_OFFSET, False),
        "sgmv_shrink": lambda: oracle.shrink(x, [a0], idx, SCALE)[0],
        "sgmv_expand": lambda: oracle.expand(buf[:1], [b0], y, idx, 0, True),
        "sgmv_expand_slice": lambda: oracle.expand(buf[:1], [b0], y, idx, SLICE_OFFSET, True),
        "add_lora_linear": lambda: oracle.lora_linear(y, x, traffic.lora_a, traffic.lora_b, traffic.bias, SCALE, idx),
    }
    tol = oracle.TOL[traffic.dtype]
    for op, res in got.items():
        err = oracle.rel_err(res, want[op]())
        assert err <= tol, f"{op}: relative error {err:.3g} > {tol} ({traffic.dtype})"


def _rows(op: str, res: np.ndarray, rows) -> bytes:
    """The request's rows of an op's result, as bytes (float64 holds every input dtype exactly)."""
    return (res[:, rows] if op == "lora_shrink" else res[rows]).tobytes()


def check_request_invariance(impl, traffic: Traffic, sizes, ops=OPS, oracle_every: int = 1,
                             make_wrapper=_side_wrapper) -> None:
    """The request's rows of every op are bitwise equal alone and in batches of `sizes` tokens;
    the last batch run twice gives the same bits. Results are checked against the oracle for the
    request alone and every `oracle_every`-th batch."""
    alone = {}
    for n in range(1, traffic.shapes.request_tokens + 1):
        x, y, buf, idx = traffic.alone(n)
        alone[n] = got = run_ops(impl, traffic, x, y, buf, idx, ops, make_wrapper)
        check_oracle(traffic, x, y, buf, idx, got)
    for i, size in enumerate(sizes):
        x, y, buf, idx, rows = traffic.batch(int(size))
        got = run_ops(impl, traffic, x, y, buf, idx, ops, make_wrapper)
        if i % oracle_every == 0:
            check_oracle(traffic, x, y, buf, idx, got)
        first = np.arange(len(rows))
        for op in ops:
            assert _rows(op, got[op], rows) == _rows(op, alone[len(rows)][op], first), (
                f"{op}: the request's rows differ in batch {i} of {size} tokens (rows {rows[0]}..{rows[-1]})")
        if i == len(sizes) - 1:
            again = run_ops(impl, traffic, x, y, buf, idx, ops, make_wrapper)
            for op in ops:
                assert again[op].tobytes() == got[op].tobytes(), f"{op}: the same batch run twice differs"


CPU_NAMES = ("jax-xla", "jax-pallas_tpu", "jax-triton", "torch-ref", "torch-triton")
# Both ends of the two smallest token classes of the launch table (t16: 1..16, t64: 17..64), where
# the default launches change configs: every new size costs each op a compilation on the CPU.
CPU_SIZES = (1, 16, 23, 64)
# The interpreters upcast every tile to float32 (CAST_FP32), so one dtype covers them.
CPU_PARAMS = [pytest.param(impl, dt, id=f"{impl.name}-{dt}", marks=impl.marks)
              for impl in IMPLS if impl.name in CPU_NAMES
              for dt in (("float32",) if impl.small else ("float32", "bfloat16"))]


@pytest.mark.parametrize("impl,dtype", CPU_PARAMS)
def test_request_rows_bitwise_equal_in_every_batch(impl, dtype):
    check_request_invariance(impl, Traffic(dtype), CPU_SIZES)


def _bridged_wrapper(impl, capacity: int, slots: int):
    import bridge
    if impl.side == "torch":
        return bridge.TorchPunicaWrapper(capacity, 4, "cpu", max_loras=slots, backend=impl.backend, deterministic=True)
    return bridge.JaxPunicaWrapper(capacity, 4, None, max_loras=slots, backend=impl.backend, deterministic=True)


@pytest.mark.parametrize("impl", [pytest.param(i, id=i.name) for i in IMPLS
                                  if i.name in ("torch-over-jax", "jax-over-torch")])
def test_bridged_wrappers_pass_deterministic_on(impl):
    """The bridged wrappers hand `deterministic=True` to the wrapper they drive (their op functions
    do not take it): add_lora_linear is batch invariant through them too."""
    check_request_invariance(impl, Traffic("float32"), CPU_SIZES, ops=("add_lora_linear",),
                             make_wrapper=_bridged_wrapper)


@pytest.mark.parametrize("impl", [pytest.param(i, id=i.side) for i in IMPLS if i.name in ("jax-xla", "torch-ref")])
def test_deterministic_must_be_a_bool(impl):
    with pytest.raises(TypeError, match="deterministic must be a bool, got 'yes'"):
        impl.pkg.PunicaWrapper(8, 2, None if impl.side == "jax" else "cpu", max_loras=2, deterministic="yes")
    x = impl.arr(np.zeros((2, 16), np.float32))
    a = impl.arr(np.zeros((2, 4, 16), np.float32))
    with pytest.raises(TypeError, match="deterministic must be a bool, got 1"):
        impl.ops.bgmv_shrink(x, a, impl.idx([0, 1]), 1.0, backend=impl.backend, deterministic=1)


def test_triton_linear_refuses_fused_and_deterministic():
    torch = pytest.importorskip("torch")
    import jax.numpy as jnp

    from jax_lora.ops import triton as jax_triton
    from torch_lora.ops import triton as torch_triton
    y, x = torch.zeros(2, 16), torch.zeros(2, 16)
    with pytest.raises(ValueError, match="fused=True cannot be deterministic"):
        torch_triton.linear(y, x, (torch.zeros(2, 4, 16),), (torch.zeros(2, 16, 4),), None, 1.0, (0,),
                            fused=True, deterministic=True)
    with pytest.raises(ValueError, match="fused=True cannot be deterministic"):
        jax_triton.linear(jnp.zeros((2, 16)), jnp.zeros((2, 16)), (jnp.zeros((2, 4, 16)),), (jnp.zeros((2, 16, 4)),),
                          None, 1.0, (0,), fused=True, deterministic=True)


def test_deterministic_wrapper_rows_are_bitwise_batch_invariant():
    """PunicaWrapper(deterministic=True): a token's add_lora_linear row is bitwise
    the same whatever the batch size, its position and its neighbours' adapters (xla, under jit:
    one program per bucket size)."""
    H, r, L, N = 32, 8, 3, 16
    A, B = [jax_helpers.rand(L, r, H)], [jax_helpers.rand(L, N, r)]
    probe = jax_helpers.rand(1, H)
    step = jax.jit(lambda w, y, x: w.add_lora_linear(y, x, A, B, None, 0.5, (N,)))
    rows = []
    for size, pos in [(1, 0), (6, 4)]:
        ids = list(jax_helpers.RNG.integers(0, 4, size))
        ids[pos] = 2
        x = jax_helpers.rand(size, H)
        x[pos] = probe[0]
        w = jax_helpers.wrapper(ids, jax_helpers.LORA_INDEX_TO_ID, capacity=16, deterministic=True)
        assert w.deterministic is True
        rows.append(np.asarray(step(w, np.zeros((size, N), np.float32), x))[pos])
    np.testing.assert_array_equal(rows[1], rows[0])


def test_deterministic_wrapper_gives_a_token_bitwise_the_same_row_in_any_batch():
    """With deterministic=True a token's add_lora_linear row (and its shrink row)
    is bitwise the same whatever the batch size, its position, the other tokens and their
    adapters, and from run to run (torch backend)."""
    rng = torch_helpers.rng(30)
    num_slots, hidden, widths = 4, 64, (24, 8)
    a, b = torch_helpers.stacked(rng, num_slots, 8, hidden, widths)
    probe = torch.tensor(rng.standard_normal((1, hidden)), dtype=torch.float32)
    rows, shrinks = [], []
    for size in [1, 3, 17, 40, 40]:
        ids = [int(i) for i in rng.integers(0, num_slots + 1, size=size)]
        pos = int(rng.integers(0, size))
        ids[pos] = 2
        w = torch_lora.PunicaWrapper(64, 8, "cpu", max_loras=num_slots, backend="torch", deterministic=True)
        w.update_metadata(LoRAMapping(tuple(ids), tuple(ids)), [1, 2, 3, 4], num_slots + 1, 16)
        x = torch.tensor(rng.standard_normal((size, hidden)), dtype=torch.float32)
        x[pos] = probe[0]
        y = torch.zeros(size, sum(widths))
        w.add_lora_linear(y, x, a, b, None, 0.7, widths)
        rows.append(y[pos].clone())
        buf = torch.zeros(2, size, 8)
        w.add_shrink(buf, x, a, 0.7)
        shrinks.append(buf[:, pos].clone())
    for r in rows[1:]:
        assert torch.equal(r, rows[0])
    for s in shrinks[1:]:
        assert torch.equal(s, shrinks[0])
    want = torch_helpers.oracle_linear(torch.zeros(1, 32), probe, a, b, None, 0.7, [1], widths)
    assert torch_helpers.rel(rows[0].numpy()[None], want) < 1e-5


def test_deterministic_ops_and_type_check():
    """docs/api.md: deterministic= on the ops (bgmv_shrink here) gives a token
    the same bits in any batch; anything but a bool is a TypeError; default off."""
    rng = torch_helpers.rng(31)
    w3 = torch.tensor(rng.standard_normal((3, 8, 64)), dtype=torch.float32)
    probe = torch.tensor(rng.standard_normal(64), dtype=torch.float32)
    outs = []
    for size in (1, 9, 33):
        x = torch.tensor(rng.standard_normal((size, 64)), dtype=torch.float32)
        x[-1] = probe
        idx = torch.tensor(rng.integers(-1, 3, size=size), dtype=torch.int32)
        idx[-1] = 1
        outs.append(torch_lora.ops.bgmv_shrink(x, w3, idx, 1.0, backend="torch", deterministic=True)[-1])
    assert all(torch.equal(o, outs[0]) for o in outs)
    with pytest.raises(TypeError, match="deterministic"):
        torch_lora.PunicaWrapper(8, 2, "cpu", max_loras=2, backend="torch", deterministic="yes")
    assert torch_lora.PunicaWrapper(8, 2, "cpu", max_loras=2, backend="torch").deterministic is False
