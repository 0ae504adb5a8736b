"""The contract (docs/contract.md sections 2-8) clause by clause, the way an outside caller uses the packages.

Only public imports; both sides (JAX and torch) wherever the clause is shared. The cases the
conformance suite (tests/test_conformance.py) and tests/test_input_errors.py already cover are not
repeated here: these are the public names each package exports, the API shapes of vLLM's
reference pages (argument names, orders, defaults, vLLM's call patterns), the kernel metadata
field by field against vLLM's algorithm, and section 6's device rule against the wrapper's own
index arrays. CPU only.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect

import numpy as np
import pytest

import torch_lora

from . import oracle
from .impls import torch_triton_device

SIDES = ("jax", "torch")


def _pkg(side):
    return importlib.import_module("jax_lora" if side == "jax" else "torch_lora")


def _arr(side, a, dtype="float32", device="cpu"):
    """A NumPy array as the side's array type (values rounded to `dtype`; torch: on `device`)."""
    if side == "jax":
        import jax.numpy as jnp
        a = np.asarray(a)
        return jnp.asarray(a).astype(dtype) if a.dtype.kind == "f" else jnp.asarray(a)
    import torch
    t = torch.from_numpy(np.ascontiguousarray(a))
    return (t.to(getattr(torch, dtype)) if t.is_floating_point() else t).to(device)


def _np(a):
    if hasattr(a, "detach"):
        a = a.detach().cpu()
        return a.float().numpy().astype(np.float64) if a.is_floating_point() else a.numpy()
    a = np.asarray(a)
    return a.astype(np.float64) if a.dtype.kind == "f" or str(a.dtype) == "bfloat16" else a


# ----------------------------------------------------------------------------- section 8: names

PUBLIC = [("jax_lora", n) for n in ("LoRAMapping", "convert_mapping", "compute_meta", "LoRAKernelMeta",
                                     "PunicaWrapper", "ops", "nn")]
PUBLIC += [("torch_lora", n) for n in ("LoRAMapping", "convert_mapping", "compute_meta", "LoRAKernelMeta",
                                       "PunicaWrapper", "ops")]
PUBLIC += [(f"{p}.ops", n) for p in ("jax_lora", "torch_lora")
           for n in ("lora_shrink", "lora_expand", "bgmv_shrink", "bgmv_expand", "bgmv_expand_slice",
                     "sgmv_shrink", "sgmv_expand", "sgmv_expand_slice")]
PUBLIC += [("bridge", n) for n in ("to_jax", "to_torch")]


@pytest.mark.parametrize("module,name", PUBLIC, ids=[f"{m}.{n}" for m, n in PUBLIC])
def test_public_name_importable_where_the_spec_says(module, name):
    assert getattr(importlib.import_module(module), name) is not None


def _params(fn):
    return [p for p in inspect.signature(fn).parameters.values() if p.name != "self"]


def _head(fn, names):
    """The first len(names) parameters of fn: their names, and that they can be passed by position."""
    ps = _params(fn)[: len(names)]
    assert [p.name for p in ps] == list(names), f"{fn.__qualname__}: {[p.name for p in ps]}"
    assert all(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) for p in ps), fn.__qualname__
    return {p.name: p for p in ps}


def _default(fn, name):
    return inspect.signature(fn).parameters[name].default


@pytest.mark.parametrize("side", SIDES)
def test_wrapper_signatures_follow_section_5(side):
    W = _pkg(side).PunicaWrapper
    _head(W.__init__, ("max_num_batched_tokens", "max_batches", "device"))
    assert inspect.signature(W.__init__).parameters["max_loras"].kind is inspect.Parameter.KEYWORD_ONLY
    _head(W.update_metadata, ("mapping", "lora_index_to_id", "max_loras", "vocab_size", "extra_vocab_size",
                              "long_lora_context"))
    assert _default(W.update_metadata, "extra_vocab_size") == 0
    assert _default(W.update_metadata, "long_lora_context") is None
    _head(W.add_shrink, ("y", "x", "lora_a_stacked", "scale"))
    _head(W.add_expand, ("y", "x", "lora_b_stacked", "lora_bias_stacked", "output_slices", "offset_start",
                         "add_inputs"))
    assert (_default(W.add_expand, "offset_start"), _default(W.add_expand, "add_inputs")) == (0, True)
    _head(W.add_lora_embedding, ("y", "x", "lora_b_stacked", "add_inputs"))
    assert _default(W.add_lora_embedding, "add_inputs") is True
    _head(W.add_lora_linear, ("y", "x", "lora_a_stacked", "lora_b_stacked", "lora_bias_stacked", "scale",
                              "output_slices"))
    _head(W.add_lora_logits, ("y", "x", "lora_a_stacked", "lora_b_stacked", "scale"))
    for method in (W.add_lora_linear, W.add_lora_logits):
        buffer = inspect.signature(method).parameters["buffer"]
        assert buffer.kind is inspect.Parameter.KEYWORD_ONLY and buffer.default is None
    for prop in ("token_lora_indices", "sampler_indices", "sampler_indices_padded", "embeddings_indices",
                 "long_lora_indices", "prefill_metadata"):
        assert isinstance(inspect.getattr_static(W, prop), property), prop


@pytest.mark.parametrize("side", SIDES)
def test_op_signatures_follow_sections_4_and_8(side):
    ops = _pkg(side).ops
    if side == "torch":  # vLLM's GPU wrapper's order: x, weights, out, the six meta_args, then scale / offsets
        meta6 = ("token_lora_mapping", "token_indices_sorted_by_lora_ids", "num_tokens_per_lora",
                 "lora_token_start_loc", "lora_ids")
        _head(ops.lora_shrink, ("inputs", "lora_a_weights", "output_tensor") + meta6)
        assert len([p for p in _params(ops.lora_shrink) if p.kind is p.POSITIONAL_OR_KEYWORD]) == 10
        _head(ops.lora_expand, ("inputs", "lora_b_weights", "output_tensor") + meta6)
        ps = [p for p in _params(ops.lora_expand) if p.kind is p.POSITIONAL_OR_KEYWORD]
        assert [p.name for p in ps[9:]] == ["offset_start", "add_inputs"]
        assert (ps[9].default, ps[10].default) == (0, False)
    else:
        _head(ops.lora_shrink, ("x", "lora_a_stacked", "meta", "scale"))
        _head(ops.lora_expand, ("buf", "lora_b_stacked", "y", "meta", "offset_start", "add_inputs"))
    _head(ops.bgmv_shrink, ("x", "w", "idx", "scale"))
    _head(ops.bgmv_expand, ("x", "w", "y", "idx", "add_inputs"))
    _head(ops.bgmv_expand_slice, ("x", "w", "y", "idx", "y_offset", "y_slice_size", "add_inputs"))
    seg = ("seq_start_locs", "seq_lengths", "lora_indices_per_batch", "batch_size", "max_length", "token_nums")
    _head(ops.sgmv_shrink, ("x", "w") + seg + ("scale",))
    _head(ops.sgmv_expand, ("x", "w", "y") + seg + ("add_inputs",))
    _head(ops.sgmv_expand_slice, ("x", "w", "y") + seg + ("y_offset", "y_slice_size", "add_inputs"))
    for name in ("lora_shrink", "lora_expand", "bgmv_shrink", "sgmv_expand_slice"):
        assert inspect.signature(getattr(ops, name)).parameters["backend"].kind is inspect.Parameter.KEYWORD_ONLY
    assert inspect.signature(_pkg(side).PunicaWrapper.__init__).parameters["backend"].kind is \
        inspect.Parameter.KEYWORD_ONLY


def test_bridge_copy_is_keyword_only_and_off_by_default():
    import bridge
    for fn in (bridge.to_jax, bridge.to_torch):
        copy = inspect.signature(fn).parameters["copy"]
        assert copy.kind is inspect.Parameter.KEYWORD_ONLY and copy.default is False


# ----------------------------------------------------------------------------- section 2: convert_mapping

class _Ctx:  # any object with offsets_by_lora_id works as a long-LoRA context (vLLM's class does)
    def __init__(self, offsets):
        self.offsets_by_lora_id = offsets


@pytest.mark.parametrize("side", SIDES)
def test_convert_mapping_takes_vllms_positional_device(side):
    """The TPU seed calls convert_mapping(mapping, ids, max_loras, vocab, extra, "cpu", long_lora_context)."""
    pkg = _pkg(side)
    mapping = pkg.LoRAMapping((0, 7, 7, 3, 11, 0), (7, 0, 11))
    ids = [None, 7, 3, None, 11]
    ctx = _Ctx({7: 100, 11: 5})
    want = oracle.convert_mapping(mapping.index_mapping, mapping.prompt_mapping, ids, 6, 32, 4, ctx.offsets_by_lora_id)
    for got in (pkg.convert_mapping(mapping, ids, 6, 32, 4, "cpu", ctx),     # vLLM's order
                pkg.convert_mapping(mapping, ids, 6, 32, 4, ctx, device="cpu")):
        assert [_np(a).tolist() for a in got[:4]] == [list(w) for w in want[:4]]
        assert _np(got[4]).tolist() == want[4] and list(got[5]) == want[5]
    no_ctx = pkg.convert_mapping(mapping, ids, 6, 32, 4, "cpu")
    assert no_ctx[4] is None and no_ctx[5][4] is None
    assert _np(no_ctx[0]).tolist() == want[0]
    with pytest.raises(TypeError, match="device twice"):
        pkg.convert_mapping(mapping, ids, 6, 32, 4, "cpu", ctx, device="cpu")


# ----------------------------------------------------------------------------- section 3: kernel metadata

def _seed_meta(m, max_loras):
    """vLLM's GPU wrapper's prepare_tensors + meta_args, in NumPy (for a mapping with a LoRA token)."""
    m = np.asarray(m, np.int64)
    ids, counts = np.unique(m, return_counts=True)
    k = len(ids)
    active = np.full(max_loras + 1, -1)
    active[:k] = ids
    num = np.zeros(max_loras + 1, np.int64)
    num[:k] = counts
    start = np.zeros(max_loras + 2, np.int64)
    start[1:k + 1] = np.cumsum(counts)
    return m.tolist(), np.argsort(m, kind="stable").tolist(), num.tolist(), start.tolist(), active.tolist()


def _make_meta(side, max_loras, capacity, idx, device="cpu"):
    """vLLM's call pattern: make(...) by keyword, then prepare_tensors(...) with its result ignored."""
    pkg = _pkg(side)
    meta = pkg.LoRAKernelMeta.make(max_loras=max_loras, max_num_tokens=capacity, device=device)
    meta.prepare_tensors(_arr(side, np.asarray(idx, np.int64), device=device))
    return meta


@pytest.mark.parametrize("side", SIDES)
@pytest.mark.parametrize("idx,max_loras", [([1, -1, 0, 1, 2, -1, 0], 4), ([0, 0, 0], 4), ([3, 1, 3], 4),
                                           ([2, 2, 2, 2], 3), ([0], 1)])
def test_kernel_meta_equals_the_seed_field_by_field(side, idx, max_loras):
    """Every entry of meta_args(T), padding included (lora_token_start_loc is 0 past the active ids)."""
    meta = _make_meta(side, max_loras, len(idx) + 3, idx)
    got = meta.meta_args(token_nums=len(idx))
    assert [_np(a).tolist() for a in got[:5]] == list(_seed_meta(idx, max_loras))
    assert not bool(np.asarray(_np(got[5])).reshape(-1)[0])
    assert bool(np.asarray(_np(meta.no_lora_flag_cpu)).reshape(-1)[0]) is False   # vLLM's name


@pytest.mark.parametrize("side", SIDES)
def test_wrapper_kernel_meta_pads_start_with_zero(side):
    """The wrappers build their metadata on the host (StepLayout): the same padding as vLLM."""
    pkg = _pkg(side)
    w = pkg.PunicaWrapper(8, 4, "cpu", max_loras=4)
    w.update_metadata(pkg.LoRAMapping((5, 0, 6, 5), (6,)), [5, 6, None, None], 5, 32)
    meta = w.token_meta if side == "jax" else w.token_mapping_meta
    assert _np(meta.lora_token_start_loc).tolist() == _seed_meta([0, -1, 1, 0], 4)[3]


def test_jax_meta_make_takes_a_platform_string():
    import jax

    import jax_lora
    meta = jax_lora.LoRAKernelMeta.make(3, 5, "cpu")
    assert meta.token_lora_mapping.devices() == {jax.devices("cpu")[0]}
    with pytest.raises(ValueError, match="device 'cpu:99' is not available"):
        jax_lora.LoRAKernelMeta.make(3, 5, "cpu:99")


def test_jax_prepare_tensors_inside_jit_leaves_an_outside_meta_concrete():
    """Called in a trace on a meta made outside, prepare_tensors returns the traced result and does
    not store tracers in the outside object (it would leak them)."""
    import jax
    import jax.numpy as jnp

    import jax_lora
    meta = jax_lora.LoRAKernelMeta.make(3, 4)
    out = jax.jit(lambda m: meta.prepare_tensors(m).token_lora_mapping)(jnp.asarray([2, 0, -1, 2]))
    assert np.asarray(out).tolist() == [2, 0, -1, 2]
    assert np.asarray(meta.token_lora_mapping).tolist() == [-1, -1, -1, -1]   # still concrete, unchanged
    same = meta.prepare_tensors(jnp.asarray([1, 1]))                         # outside: in place
    assert same is meta and np.asarray(meta.token_lora_mapping).tolist() == [1, 1, -1, -1]


# ----------------------------------------------------------------------------- section 4: vLLM-style op calls

def _vllm_case(seed, num_loras, nslices, rank, hidden, seq_lengths):
    rng = np.random.default_rng(seed)
    lora_of_seq = rng.integers(-1, num_loras, len(seq_lengths))
    idx = np.repeat(lora_of_seq, seq_lengths)
    T = int(idx.shape[0])
    x = rng.standard_normal((T, hidden)).astype(np.float32)
    a = [(rng.standard_normal((num_loras, rank, hidden)) / np.sqrt(hidden)).astype(np.float32) for _ in range(nslices)]
    b = [(rng.standard_normal((num_loras, hidden, rank)) / np.sqrt(rank)).astype(np.float32) for _ in range(nslices)]
    buf = rng.standard_normal((nslices, T, rank)).astype(np.float32)
    y = rng.standard_normal((T, hidden * nslices)).astype(np.float32)
    return idx, x, a, b, buf, y


_VLLM_SHAPES = [("torch", "torch", 0, 4, 3, 8, 33, (3, 1, 5), "torch-ref-qkv"),
                ("torch", "torch", 1, 1, 1, 16, 64, (1, 1, 1, 1), "torch-ref-decode-1lora"),
                ("torch", "triton", 2, 3, 2, 8, 16, (2, 3), "torch-triton"),
                ("jax", "xla", 0, 4, 3, 8, 33, (3, 1, 5), "jax-xla-qkv"),
                ("jax", "xla", 1, 1, 1, 16, 64, (1, 1, 1, 1), "jax-xla-decode-1lora"),
                ("jax", "triton", 2, 3, 2, 8, 16, (2, 3), "jax-triton")]
VLLM_CASES = [pytest.param(*case[:-1], dtype, id=f"{case[-1]}-{dtype}") for case in _VLLM_SHAPES
              for dtype in (("float16",) if case[1] == "triton" else ("float16", "bfloat16"))]  # interpreter: one dtype


@pytest.mark.parametrize("side,backend,seed,num_loras,nslices,rank,hidden,seq_lengths,dtype", VLLM_CASES)
def test_lora_shrink_expand_called_as_in_vllms_kernel_tests(side, backend, seed, num_loras, nslices, rank, hidden,
                                                            seq_lengths, dtype):
    """LoRAKernelMeta.make(max_loras=..., max_num_tokens=T, device=...); prepare_tensors(mapping);
    torch: lora_shrink(x, weights, out, *meta.meta_args(token_nums=T), scale) and
    lora_expand(buf, weights, y, *meta.meta_args(token_nums=T), offset_start=0, add_inputs=...);
    JAX: the same with the metadata object in place of the six values."""
    idx, x, a, b, buf, y = _vllm_case(seed, num_loras, nslices, rank, hidden, seq_lengths)
    T = len(idx)
    dev = torch_triton_device() if (side, backend) == ("torch", "triton") else "cpu"
    meta = _make_meta(side, num_loras, T, idx, dev)
    ops = _pkg(side).ops
    X, A, B = _arr(side, x, dtype, dev), [_arr(side, w, dtype, dev) for w in a], [_arr(side, w, dtype, dev) for w in b]
    BUF, Y = _arr(side, buf, dtype, dev), _arr(side, y, dtype, dev)
    want_buf = oracle.shrink(_np(X), [_np(w) for w in A], idx, 0.5)
    for add_inputs in (True, False):
        want_y = oracle.expand(_np(BUF), [_np(w) for w in B], _np(Y), idx, 0, add_inputs)
        if side == "torch":
            import torch
            out = torch.full((nslices, T, rank), float("nan"), dtype=torch.float32, device=dev)
            ops.lora_shrink(X, A, out, *meta.meta_args(token_nums=T), 0.5, backend=backend)
            y_new = Y.clone()
            ops.lora_expand(BUF, B, y_new, *meta.meta_args(token_nums=T), offset_start=0, add_inputs=add_inputs,
                            backend=backend)
        else:
            out = ops.lora_shrink(X, A, meta, 0.5, backend=backend)
            y_new = ops.lora_expand(BUF, B, Y, meta, offset_start=0, add_inputs=add_inputs, backend=backend)
        assert oracle.rel_err(_np(out), want_buf) <= oracle.TOL[dtype]
        assert oracle.rel_err(_np(y_new), want_y) <= oracle.TOL[dtype]
        np.testing.assert_array_equal(_np(y_new)[idx < 0], _np(Y)[idx < 0])


# ----------------------------------------------------------------------------- section 5: JAX never mutates

def test_jax_wrapper_leaves_host_inputs_alone_and_returns_new_arrays():
    import jax

    import jax_lora
    rng = np.random.default_rng(3)
    w = jax_lora.PunicaWrapper(8, 4, None, max_loras=3)
    w.update_metadata(jax_lora.LoRAMapping((1, 0, 3, 2, 3), (3, 1)), [1, 2, 3], 4, 32)
    f = lambda *s: rng.standard_normal(s).astype(np.float32)
    x, a, b, y = f(5, 16), [f(3, 1, 4, 16)], [f(3, 1, 6, 4)], f(5, 6)
    buf, xe, be, ys, xs, yl = np.zeros((1, 5, 4), np.float32), f(5, 4), f(3, 6, 4), f(2, 16), f(2, 16), f(2, 6)
    inputs = [x, y, buf, xe, be, ys, xs, yl] + a + b
    before = [v.copy() for v in inputs]
    results = [w.add_lora_linear(y, x, a, b, None, 1.0, (6,)), w.add_shrink(buf, x, a, 1.0),
               w.add_expand(y, buf, b, None, (6,)), w.add_lora_embedding(y, xe, be),
               w.add_lora_logits(yl, xs, a[0], b[0], 1.0)]
    assert all(isinstance(r, jax.Array) for r in results)
    assert [r.shape for r in results] == [(5, 6), (1, 5, 4), (5, 6), (5, 6), (2, 6)]
    for v, v0 in zip(inputs, before):
        np.testing.assert_array_equal(v, v0)


# ----------------------------------------------------------------------------- section 6: devices

def _torch_wrapper_calls(w, dev):
    import torch
    T, H, r, L = 4, 16, 4, 2
    z = lambda *s: torch.zeros(*s, device=dev)
    return {
        "add_lora_linear": lambda: w.add_lora_linear(z(T, 10), z(T, H), (z(L, r, H),), (z(L, 10, r),), None, 1.0,
                                                     (10,)),
        "add_lora_linear(buffer)": lambda: w.add_lora_linear(z(T, 10), z(T, H), (z(L, r, H),), (z(L, 10, r),), None,
                                                             1.0, (10,), buffer=z(1, T, r)),
        "add_shrink": lambda: w.add_shrink(z(1, T, r), z(T, H), (z(L, r, H),), 1.0),
        "add_expand": lambda: w.add_expand(z(T, 10), z(1, T, r), (z(L, 10, r),), None, (10,)),
        "add_lora_embedding": lambda: w.add_lora_embedding(z(T, 10), z(T, r), z(L, 10, r)),
        "add_lora_logits": lambda: w.add_lora_logits(z(2, 10), z(2, H), z(L, r, H), z(L, 10, r), 1.0),
        "shrink": lambda: w.shrink(z(T, H), z(L, r, H), 1.0),
        "expand": lambda: w.expand(z(T, 10), z(T, r), z(L, 10, r), True),
    }


@pytest.mark.parametrize("method", list(_torch_wrapper_calls(None, "cpu")))
def test_torch_wrapper_refuses_tensors_off_its_device(method):
    """All arguments on one device, but not the one of the wrapper's index tensors (metadata a kernel
    would read from the wrong memory): a ValueError naming both, before anything runs."""
    import torch_lora
    w = torch_lora.PunicaWrapper(8, 4, "cpu", max_loras=2, backend="torch")
    w.update_metadata(torch_lora.LoRAMapping((1, 2, 0, 2), (2, 1)), [1, 2], 3, 32)
    with pytest.raises(ValueError, match=r"different devices: .* on meta, the wrapper's index tensors on cpu"):
        _torch_wrapper_calls(w, "meta")[method]()


def _two_cpu_devices():
    import jax
    devices = jax.devices("cpu")
    if len(devices) < 2:
        pytest.skip("needs two CPU devices (tests/conftest.py sets XLA_FLAGS for eight)")
    return devices[:2]


def test_jax_wrapper_refuses_arrays_off_its_device():
    import jax

    import jax_lora
    d0, d1 = _two_cpu_devices()
    w = jax_lora.PunicaWrapper(8, 4, d1, max_loras=2)
    w.update_metadata(jax_lora.LoRAMapping((1, 2, 0, 2), (2, 1)), [1, 2], 3, 32)
    z = lambda *s: jax.device_put(np.zeros(s, np.float32), d0)
    calls = [lambda: w.add_lora_linear(z(4, 10), z(4, 16), (z(2, 4, 16),), (z(2, 10, 4),), None, 1.0, (10,)),
             lambda: w.add_shrink(z(1, 4, 4), z(4, 16), (z(2, 4, 16),), 1.0),
             lambda: w.add_expand(z(4, 10), z(1, 4, 4), (z(2, 10, 4),), None, (10,)),
             lambda: w.add_lora_embedding(z(4, 10), z(4, 4), z(2, 10, 4)),
             lambda: w.add_lora_logits(z(2, 10), z(2, 16), z(2, 4, 16), z(2, 10, 4), 1.0),
             lambda: w.shrink(z(4, 16), z(2, 4, 16), 1.0)]
    for call in calls:
        with pytest.raises(ValueError, match=r"different devices: .*the wrapper's index arrays on \['cpu:1'\]"):
            call()


def test_jax_bias_on_another_device_is_named():
    import jax

    import jax_lora
    d0, d1 = _two_cpu_devices()
    w = jax_lora.PunicaWrapper(8, 4, d0, max_loras=2)
    w.update_metadata(jax_lora.LoRAMapping((1, 2, 0, 2), (2, 1)), [1, 2], 3, 32)
    z = lambda *s: jax.device_put(np.zeros(s, np.float32), d0)
    bias = (jax.device_put(np.zeros((2, 10), np.float32), d1),)
    with pytest.raises(ValueError, match=r"different devices: .*lora_bias_stacked on \['cpu:1'\]"):
        w.add_lora_linear(z(4, 10), z(4, 16), (z(2, 4, 16),), (z(2, 10, 4),), bias, 1.0, (10,))
    with pytest.raises(ValueError, match=r"different devices: .*lora_bias_stacked on \['cpu:1'\]"):
        w.add_expand(z(4, 10), z(1, 4, 4), (z(2, 10, 4),), bias, (10,))


# ----------------------------------------------------------------------------- section 6: the ops' own checks

def _op_call(side, bad):
    """lora_shrink / lora_expand with one bad argument (`bad`), as an outside caller passes them."""
    T, H, r, L = 4, 16, 4, 2
    rng = np.random.default_rng(5)
    f = lambda *s: rng.standard_normal(s).astype(np.float32)
    idx = [0, 1, -1, 1] if bad != "index" else [0, 2, -1, 1]
    meta = _make_meta(side, L if bad != "index" else 3, T, idx)
    x = np.ones((T, H)) if bad == "dtype" else f(T, H)
    a = f(L, r, H + 1 if bad == "hidden" else H)
    b = f(L, 8, r + 1 if bad == "rank" else r)
    X = x if side == "jax" and bad == "dtype" else _arr(side, x, str(x.dtype))
    ops = _pkg(side).ops
    if bad in ("hidden", "dtype", "index"):
        if side == "torch":
            import torch
            return ops.lora_shrink(X, [_arr(side, a)], torch.zeros(1, T, r), *meta.meta_args(T), 1.0)
        return ops.lora_shrink(X, [_arr(side, a)], meta, 1.0)
    if side == "torch":
        import torch
        return ops.lora_expand(torch.zeros(1, T, r), [_arr(side, b)], torch.zeros(T, 8), *meta.meta_args(T))
    return ops.lora_expand(_arr(side, np.zeros((1, T, r), np.float32)), [_arr(side, b)], _arr(side, f(T, 8)), meta)


OP_ERRORS = [("hidden", ValueError,
              r"lora_a_\w+\[0\] has hidden size 17 \(shape \(2, 4, 17\)\), but \w+ has hidden size 16"),
             ("rank", ValueError, r"lora_b_\w+\[0\] has rank 5 \(shape \(2, 8, 5\)\), but inputs has rank 4"),
             ("dtype", TypeError, r"(x|inputs) must have dtype in \('float16', 'bfloat16', 'float32'\), got float64"),
             ("index", ValueError, r"token_lora_mapping holds slot 2, but lora_a_\w+ has only 2 slots")]


@pytest.mark.parametrize("side", SIDES)
@pytest.mark.parametrize("bad,error,message", OP_ERRORS, ids=[e[0] for e in OP_ERRORS])
def test_metadata_driven_ops_name_the_bad_argument(side, bad, error, message):
    """On the host (index values are read only there: on an accelerator that would be a sync)."""
    with contextlib.ExitStack() as stack:
        if side == "jax":
            import jax
            stack.enter_context(jax.default_device(jax.devices("cpu")[0]))
        with pytest.raises(error, match=message):
            _op_call(side, bad)


def test_public_names_exist():
    """Contract section 8: torch_lora exports LoRAMapping, convert_mapping, compute_meta, LoRAKernelMeta,
    PunicaWrapper, and torch_lora.ops the metadata, BGMV and SGMV ops."""
    for name in ("LoRAMapping", "convert_mapping", "compute_meta", "LoRAKernelMeta", "PunicaWrapper",
                 "load_peft_adapter", "AdapterManager", "AdapterError"):
        assert hasattr(torch_lora, name), name
    for name in ("lora_shrink", "lora_expand", "bgmv_shrink", "bgmv_expand", "bgmv_expand_slice",
                 "sgmv_shrink", "sgmv_expand", "sgmv_expand_slice"):
        assert callable(getattr(torch_lora.ops, name)), name
    assert issubclass(torch_lora.AdapterError, ValueError)
