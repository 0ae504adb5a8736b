"""The conformance suite: every implementation in tests/impls.py against the float64 oracle.

Same cases for all: unequal slice widths, bias, -1 tokens (rows untouched, bit for bit),
offset_start, add_inputs both ways, embeddings, logits through the sampler indices, prefill
segments, the index-array properties, every op family. Fresh random data per case; outputs that a
kernel must write are poisoned with NaN first (NaN never passes).

CPU: the kernels run in their interpreters (Triton's, Pallas TPU interpret mode); no test here is
gpu-marked, and on a GPU machine the Triton entries run the compiled kernels.
"""

from __future__ import annotations

import numpy as np
import pytest

from lora_core.host_mapping import LongContextLoRAContext, LoRAMapping, pad_prompt_mapping

from . import oracle
from .impls import IMPLS, round_to

IMPL_PARAMS = [pytest.param(impl, id=impl.name, marks=impl.marks) for impl in IMPLS]
DTYPES = ("float32", "bfloat16", "float16")


def _dtype_params():
    return [pytest.param(impl, dt, id=f"{impl.name}-{dt}", marks=impl.marks)
            for impl in IMPLS for dt in DTYPES if dt in impl.dtypes]


IMPL_DTYPE_PARAMS = _dtype_params()


# ----------------------------------------------------------------------------- case builders

class Case:
    """Random weights for `num_slots` slots, ids 101.. in slots (one slot empty), and a mapping."""

    def __init__(self, seed, dtype, num_tokens=11, hidden=64, rank=16, slices=(24, 8, 16), num_slots=4,
                 frac_none=0.3, empty_slot=1):
        rng = np.random.default_rng(seed)
        self.rng, self.dtype, self.slices = rng, dtype, tuple(slices)
        self.num_slots, self.rank, self.hidden, self.num_tokens = num_slots, rank, hidden, num_tokens
        self.lora_index_to_id = [None if s == empty_slot else 101 + s for s in range(num_slots)]
        usable = [s for s in range(num_slots) if s != empty_slot]
        idx = rng.choice(usable, size=num_tokens)
        idx[rng.random(num_tokens) < frac_none] = -1
        self.idx = idx.astype(np.int32)
        self.x = round_to(rng.standard_normal((num_tokens, hidden)), dtype)
        self.lora_a = [round_to(rng.standard_normal((num_slots, 1, rank, hidden)) / np.sqrt(hidden), dtype)
                       for _ in slices]
        self.lora_b = [round_to(rng.standard_normal((num_slots, 1, n, rank)) / np.sqrt(rank), dtype)
                       for n in slices]
        self.bias = [round_to(rng.standard_normal((num_slots, n)), dtype) for n in slices]
        self.y = round_to(rng.standard_normal((num_tokens, sum(slices) + 5)), dtype)
        self.scale = 0.75

    def ids(self, idx):
        return tuple(0 if i < 0 else self.lora_index_to_id[i] for i in idx)

    def mapping(self, prompt_idx=None, is_prefill=False):
        prompt = self.idx if prompt_idx is None else prompt_idx
        return LoRAMapping(self.ids(self.idx), self.ids(prompt), is_prefill)

    def native(self, impl, arrays):
        return [impl.arr(a, self.dtype) for a in arrays]


def assert_close(got, want, dtype, what=""):
    err = oracle.rel_err(got, want)
    assert err <= oracle.TOL[dtype], f"{what}: relative error {err:.3g} > {oracle.TOL[dtype]} ({dtype})"


def assert_rows_untouched(got, y0, idx, what=""):
    rows = np.asarray(idx) < 0
    np.testing.assert_array_equal(got[rows], np.asarray(y0, np.float64)[rows],
                                  err_msg=f"{what}: rows with index -1 changed")


def make_wrapper(impl, case, capacity_extra=5, max_batches=16):
    w = impl.wrapper(case.num_tokens + capacity_extra, max_batches, case.num_slots)
    return w


# ----------------------------------------------------------------------------- wrapper methods

@pytest.mark.parametrize("impl,dtype", IMPL_DTYPE_PARAMS)
@pytest.mark.parametrize("with_bias", [False, True], ids=["nobias", "bias"])
def test_add_lora_linear(impl, dtype, with_bias):
    case = Case(1 + with_bias, dtype)
    w = make_wrapper(impl, case)
    w.update_metadata(case.mapping(), case.lora_index_to_id, case.num_slots + 1, 32, 0)
    bias = case.bias if with_bias else None
    y0 = case.y.copy()
    x, y = case.native(impl, [case.x, case.y])
    got = impl.wrapper_call(w, "add_lora_linear", y, x, case.native(impl, case.lora_a),
                            case.native(impl, case.lora_b),
                            case.native(impl, bias) if with_bias else None, case.scale, case.slices)
    want = oracle.lora_linear(y0, case.x, case.lora_a, case.lora_b, bias, case.scale, case.idx)
    assert_close(got, want, dtype, "add_lora_linear")
    assert_rows_untouched(got, y0, case.idx, "add_lora_linear")
    np.testing.assert_array_equal(got[:, sum(case.slices):], y0[:, sum(case.slices):],
                                  err_msg="columns outside the slices changed")


@pytest.mark.parametrize("impl", IMPL_PARAMS)
def test_add_lora_linear_3d_weights_and_token_axes(impl):
    """3-D weights (no size-1 axis), one slice, x and y with two leading token axes."""
    dtype = impl.dtypes[0]
    case = Case(3, dtype, num_tokens=12, slices=(40,))
    w = make_wrapper(impl, case)
    w.update_metadata(case.mapping(), case.lora_index_to_id, case.num_slots + 1, 32, 0)
    a3 = [a[:, 0] for a in case.lora_a]
    b3 = [b[:, 0] for b in case.lora_b]
    y0 = case.y.copy()
    x, y = case.native(impl, [case.x.reshape(3, 4, -1), case.y.reshape(3, 4, -1)])
    got = impl.wrapper_call(w, "add_lora_linear", y, x, case.native(impl, a3), case.native(impl, b3), None,
                            case.scale, case.slices)
    want = oracle.lora_linear(y0, case.x, a3, b3, None, case.scale, case.idx)
    assert got.shape == (3, 4, y0.shape[1])
    assert_close(got.reshape(12, -1), want, dtype, "add_lora_linear 3-D")


@pytest.mark.parametrize("impl,dtype", IMPL_DTYPE_PARAMS)
def test_add_shrink_then_add_expand(impl, dtype):
    case = Case(4, dtype)
    w = make_wrapper(impl, case)
    w.update_metadata(case.mapping(), case.lora_index_to_id, case.num_slots + 1, 32, 0)
    import_buf = np.full((len(case.slices), case.num_tokens, case.rank), np.nan, np.float32)
    buf = impl.arr(import_buf, "float32")
    got_buf = impl.wrapper_call(w, "add_shrink", buf, impl.arr(case.x, dtype),
                                case.native(impl, case.lora_a), case.scale)
    want_buf = oracle.shrink(case.x, case.lora_a, case.idx, case.scale)
    assert_close(got_buf, want_buf, dtype, "add_shrink")
    assert np.all(got_buf[:, case.idx < 0] == 0), "shrink rows of -1 tokens must be 0"
    for add_inputs in (True, False):
        for offset_start in (0, 3):
            y0 = case.y.copy()
            y = impl.arr(y0, dtype)
            got = impl.wrapper_call(w, "add_expand", y, impl.arr(want_buf.astype(np.float32), "float32"),
                                    case.native(impl, case.lora_b), case.native(impl, case.bias),
                                    case.slices, offset_start=offset_start, add_inputs=add_inputs)
            want = oracle.expand(want_buf, case.lora_b, y0, case.idx, offset_start, add_inputs, case.bias)
            what = f"add_expand add_inputs={add_inputs} offset_start={offset_start}"
            assert_close(got, want, dtype, what)
            assert_rows_untouched(got, y0, case.idx, what)
            end = offset_start + sum(case.slices)
            np.testing.assert_array_equal(got[:, :offset_start], y0[:, :offset_start], err_msg=what)
            np.testing.assert_array_equal(got[:, end:], y0[:, end:], err_msg=what)


@pytest.mark.parametrize("impl,dtype", IMPL_DTYPE_PARAMS)
def test_add_expand_sequence_input(impl, dtype):
    """x given as a sequence of (T, r) buffers, one per slice (TPU seed form)."""
    case = Case(5, dtype, slices=(16, 8))
    w = make_wrapper(impl, case)
    w.update_metadata(case.mapping(), case.lora_index_to_id, case.num_slots + 1, 32, 0)
    buf = case.rng.standard_normal((2, case.num_tokens, case.rank)).astype(np.float32)
    y0 = case.y.copy()
    got = impl.wrapper_call(w, "add_expand", impl.arr(y0, dtype), [impl.arr(b, "float32") for b in buf],
                            case.native(impl, case.lora_b), None, case.slices)
    assert_close(got, oracle.expand(buf, case.lora_b, y0, case.idx), dtype, "add_expand sequence")


@pytest.mark.parametrize("impl,dtype", IMPL_DTYPE_PARAMS)
@pytest.mark.parametrize("add_inputs", [True, False])
def test_add_lora_embedding(impl, dtype, add_inputs):
    case = Case(6, dtype, slices=(48,))
    w = make_wrapper(impl, case)
    w.update_metadata(case.mapping(), case.lora_index_to_id, case.num_slots + 1, 32, 0)
    x = round_to(case.rng.standard_normal((case.num_tokens, case.rank)), dtype)
    y0 = case.y[:, :48].copy()
    got = impl.wrapper_call(w, "add_lora_embedding", impl.arr(y0, dtype), impl.arr(x, dtype),
                            impl.arr(case.lora_b[0], dtype), add_inputs=add_inputs)
    want = oracle.expand(x[None], [case.lora_b[0]], y0, case.idx, 0, add_inputs)
    assert_close(got, want, dtype, "add_lora_embedding")
    assert_rows_untouched(got, y0, case.idx, "add_lora_embedding")


@pytest.mark.parametrize("impl,dtype", IMPL_DTYPE_PARAMS)
@pytest.mark.parametrize("vocab_cut", [0, 7], ids=["same_vocab", "lora_vocab_wider"])
def test_add_lora_logits(impl, dtype, vocab_cut):
    """Rows are routed by the sampler indices (prompt mapping), not the token indices."""
    case = Case(7, dtype, slices=(40,))
    rng = case.rng
    rows = 5
    prompt_idx = np.array([0, -1, 3, 2, 0], np.int32)
    w = make_wrapper(impl, case)
    w.update_metadata(case.mapping(prompt_idx=prompt_idx), case.lora_index_to_id, case.num_slots + 1, 32, 0)
    x = round_to(rng.standard_normal((rows, case.hidden)), dtype)
    vocab = 40 - vocab_cut
    y0 = round_to(rng.standard_normal((rows, vocab)), dtype)
    got = impl.wrapper_call(w, "add_lora_logits", impl.arr(y0, dtype), impl.arr(x, dtype),
                            impl.arr(case.lora_a[0], dtype), impl.arr(case.lora_b[0], dtype), case.scale)
    want = oracle.logits(y0, x, case.lora_a[0], case.lora_b[0], case.scale, prompt_idx)
    assert_close(got, want, dtype, "add_lora_logits")
    assert_rows_untouched(got, y0, prompt_idx, "add_lora_logits")


@pytest.mark.parametrize("impl", IMPL_PARAMS)
def test_metadata_update_between_calls(impl):
    """One wrapper, several steps with different mappings and token counts: each result is right."""
    dtype = impl.dtypes[0]
    case = Case(8, dtype, num_tokens=10, slices=(16,))
    w = impl.wrapper(16, 8, case.num_slots)
    for step in range(3):
        n = [10, 3, 7][step]
        idx = case.rng.choice([-1, 0, 2, 3], size=n).astype(np.int32)
        w.update_metadata(LoRAMapping(case.ids(idx), case.ids(idx[:2])), case.lora_index_to_id,
                          case.num_slots + 1, 32, 0)
        y0 = case.y[:n].copy()
        got = impl.wrapper_call(w, "add_lora_linear", impl.arr(y0, dtype), impl.arr(case.x[:n], dtype),
                                case.native(impl, case.lora_a), case.native(impl, case.lora_b), None,
                                case.scale, case.slices)
        want = oracle.lora_linear(y0, case.x[:n], case.lora_a, case.lora_b, None, case.scale, idx)
        assert_close(got, want, dtype, f"step {step}")


@pytest.mark.parametrize("impl", IMPL_PARAMS)
def test_all_tokens_without_lora(impl):
    dtype = impl.dtypes[0]
    case = Case(9, dtype, frac_none=1.0, slices=(16,))
    w = make_wrapper(impl, case)
    w.update_metadata(case.mapping(), case.lora_index_to_id, case.num_slots + 1, 32, 0)
    y0 = case.y.copy()
    got = impl.wrapper_call(w, "add_lora_linear", impl.arr(y0, dtype), impl.arr(case.x, dtype),
                            case.native(impl, case.lora_a), case.native(impl, case.lora_b),
                            case.native(impl, case.bias[:1]), case.scale, case.slices)
    np.testing.assert_array_equal(got, y0.astype(np.float64))


# ----------------------------------------------------------------------------- vLLM's TPU wrapper's per-token methods

@pytest.mark.parametrize("impl,dtype", IMPL_DTYPE_PARAMS)
def test_seed_shrink_expand_expand_slice(impl, dtype):
    """`shrink` / `expand` / `expand_slice` (TPU seed): the BGMV ops with the wrapper's token indices."""
    if not impl.vllm_methods:
        pytest.skip(f"{impl.name}'s wrapper offers only the add_* methods")
    case = Case(17, dtype, slices=(24,))
    w = make_wrapper(impl, case)
    w.update_metadata(case.mapping(), case.lora_index_to_id, case.num_slots + 1, 32, 0)
    a, b = case.lora_a[0], case.lora_b[0]
    got_buf = impl.wrapper_value(w, "shrink", impl.arr(case.x, dtype), impl.arr(a, dtype), case.scale)
    want_buf = oracle.shrink(case.x, [a], case.idx, case.scale)
    assert got_buf.shape == (case.num_tokens, case.rank)
    assert_close(got_buf, want_buf[0], dtype, "shrink")
    assert np.all(got_buf[case.idx < 0] == 0), "shrink rows of -1 tokens must be 0"
    xb = impl.arr(want_buf[0].astype(np.float32), "float32")
    for add_inputs in (True, False):
        y0 = case.y.copy()
        got = impl.wrapper_call(w, "expand", impl.arr(y0, dtype), xb, impl.arr(b, dtype), add_inputs)
        what = f"expand add_inputs={add_inputs}"
        assert_close(got, oracle.expand(want_buf, [b], y0, case.idx, 0, add_inputs), dtype, what)
        assert_rows_untouched(got, y0, case.idx, what)
        np.testing.assert_array_equal(got[:, 24:], y0[:, 24:], err_msg=f"{what}: columns past the slice changed")
        y0 = case.y.copy()
        got = impl.wrapper_call(w, "expand_slice", impl.arr(y0, dtype), xb, impl.arr(b[:, 0], dtype), 3, 24,
                                add_inputs)
        what = f"expand_slice add_inputs={add_inputs}"
        assert_close(got, oracle.expand(want_buf, [b], y0, case.idx, 3, add_inputs), dtype, what)
        assert_rows_untouched(got, y0, case.idx, what)
        np.testing.assert_array_equal(got[:, :3], y0[:, :3], err_msg=f"{what}: columns before the slice changed")
        np.testing.assert_array_equal(got[:, 27:], y0[:, 27:], err_msg=f"{what}: columns past the slice changed")
    # a LoRA output wider than y is cut to y's width (vLLM's bgmv_expand)
    y0 = case.y[:, :20].copy()
    got = impl.wrapper_call(w, "expand", impl.arr(y0, dtype), xb, impl.arr(b, dtype), True)
    assert_close(got, oracle.expand(want_buf, [b[:, :, :20]], y0, case.idx, 0, True), dtype, "expand, y narrower")


# ----------------------------------------------------------------------------- index properties

@pytest.mark.parametrize("impl", IMPL_PARAMS)
@pytest.mark.parametrize("long_lora", [False, True])
def test_index_properties(impl, long_lora):
    lora_index_to_id = [7, None, 3, 9]
    index_mapping = (3, 3, 0, 7, 9, 9, 0, 3)
    prompt_mapping = (3, 0, 9)
    ctx = LongContextLoRAContext({3: 100, 9: 200}) if long_lora else None
    max_loras, vocab, extra = 5, 50, 6
    w = impl.wrapper(12, 6, 4)
    w.update_metadata(LoRAMapping(index_mapping, prompt_mapping, True), lora_index_to_id, max_loras, vocab,
                      extra, ctx)
    prompt = pad_prompt_mapping(prompt_mapping, 12) if impl.pads_prompt_mapping else prompt_mapping
    base, sampler, padded, emb, longl, _ = oracle.convert_mapping(
        index_mapping, prompt, lora_index_to_id, max_loras, vocab, extra,
        ctx.offsets_by_lora_id if long_lora else None)
    as_list = lambda a: np.asarray(impl.to_np(a)).astype(np.int64).tolist()
    assert as_list(w.token_lora_indices) == base
    assert as_list(w.sampler_indices) == sampler
    assert as_list(w.sampler_indices_padded) == padded
    assert as_list(w.embeddings_indices) == emb
    if long_lora:
        assert as_list(w.long_lora_indices) == longl
    starts, lengths, loras, b, max_len, token_nums, _ = oracle.compute_meta(base)
    pm = w.prefill_metadata
    assert [as_list(pm[0]), as_list(pm[1]), as_list(pm[2])] == [starts, lengths, loras]
    assert (int(pm[3]), int(pm[4]), int(pm[5])) == (b, max_len, token_nums)


@pytest.mark.parametrize("impl", IMPL_PARAMS)
def test_convert_mapping_function(impl):
    lora_index_to_id = [None, 4, 2]
    mapping = LoRAMapping((2, 0, 4, 4), (4, 2, 0, 0, 2), False)
    got = impl.pkg.convert_mapping(mapping, lora_index_to_id, 4, 100, 10, LongContextLoRAContext({4: 64}))
    want = oracle.convert_mapping(mapping.index_mapping, mapping.prompt_mapping, lora_index_to_id, 4, 100, 10,
                                  {4: 64})
    for g, wv in zip(got[:5], want[:5]):
        assert np.asarray(impl.to_np(g)).astype(np.int64).tolist() == wv
        assert str(g.dtype).endswith("int32")
    assert got[5] == want[5]
    no_long = impl.pkg.convert_mapping(mapping, lora_index_to_id, 4, 100, 10)
    assert no_long[4] is None and no_long[5][4] is None


@pytest.mark.parametrize("impl", IMPL_PARAMS)
def test_compute_meta_function(impl):
    for idx in ([2, 2, -1, 0, 0, 0], [-1, -1, -1], [1], [0, 1, 0, 1]):
        got = impl.pkg.compute_meta(impl.idx(idx))
        want = oracle.compute_meta(idx)
        assert [np.asarray(impl.to_np(g)).astype(np.int64).tolist() for g in got[:3]] == list(want[:3])
        assert tuple(got[3:]) == tuple(want[3:])


@pytest.mark.parametrize("impl", IMPL_PARAMS)
def test_kernel_meta_matches_spec(impl):
    rng = np.random.default_rng(10)
    for trial in range(4):
        max_loras = int(rng.integers(1, 6))
        n = int(rng.integers(1, 20))
        idx = rng.integers(-1, max_loras, n).astype(np.int32)
        if trial == 0:
            idx[:] = -1
        meta = impl.meta(idx, max_loras, capacity=n + 4)
        got = [impl.to_np(a).astype(np.int64).tolist() for a in meta.meta_args(n)]
        want = oracle.kernel_meta(idx.tolist(), max_loras)
        assert got[0] == want[0] and got[1] == want[1]
        assert got[4] == want[2] and got[2] == want[3]
        k = len(set(idx.tolist()))
        assert got[3][: k + 1] == want[4][: k + 1]
        assert bool(np.asarray(impl.to_np(meta.meta_args(n)[5])).reshape(-1)[0]) == want[5]


# ----------------------------------------------------------------------------- ops

@pytest.mark.parametrize("impl,dtype", IMPL_DTYPE_PARAMS)
def test_lora_shrink_expand_ops(impl, dtype):
    case = Case(11, dtype)
    x = impl.arr(case.x, dtype)
    got_buf = impl.lora_shrink(x, case.native(impl, case.lora_a), case.idx, case.scale, case.num_slots)
    want_buf = oracle.shrink(case.x, case.lora_a, case.idx, case.scale)
    assert_close(got_buf, want_buf, dtype, "lora_shrink")
    assert np.all(got_buf[:, case.idx < 0] == 0)
    for add_inputs in (False, True):
        y0 = case.y.copy()
        got = impl.lora_expand(impl.arr(want_buf.astype(np.float32), "float32"), case.native(impl, case.lora_b),
                               impl.arr(y0, dtype), case.idx, 2, add_inputs, case.num_slots)
        want = oracle.expand(want_buf, case.lora_b, y0, case.idx, 2, add_inputs)
        assert_close(got, want, dtype, f"lora_expand add_inputs={add_inputs}")
        assert_rows_untouched(got, y0, case.idx, "lora_expand")


@pytest.mark.parametrize("impl,dtype", IMPL_DTYPE_PARAMS)
def test_bgmv_ops(impl, dtype):
    case = Case(12, dtype, slices=(24, 24))
    a, b = case.lora_a[0], case.lora_b[0]
    idx = impl.idx(case.idx)
    got = impl.call_op("bgmv_shrink", impl.arr(case.x, dtype), impl.arr(a, dtype), idx, case.scale)
    buf = oracle.shrink(case.x, [a], case.idx, case.scale)
    assert_close(got, buf[0], dtype, "bgmv_shrink")
    xb = buf[0].astype(np.float32)
    for add_inputs in (True, False):
        y0 = case.y.copy()
        got = impl.call_op("bgmv_expand", impl.arr(xb, "float32"), impl.arr(b, dtype), impl.arr(y0, dtype), idx,
                           add_inputs)
        assert_close(got, oracle.expand(buf, [b], y0, case.idx, 0, add_inputs), dtype, "bgmv_expand")
        y0 = case.y.copy()
        got = impl.call_op("bgmv_expand_slice", impl.arr(xb, "float32"), impl.arr(b, dtype), impl.arr(y0, dtype),
                           idx, 9, 24, add_inputs)
        assert_close(got, oracle.expand(buf, [b], y0, case.idx, 9, add_inputs), dtype, "bgmv_expand_slice")
        assert_rows_untouched(got, y0, case.idx, "bgmv_expand_slice")


@pytest.mark.parametrize("impl,dtype", IMPL_DTYPE_PARAMS)
def test_sgmv_ops_with_prefill_metadata(impl, dtype):
    """Prefill: requests' tokens contiguous; SGMV over the wrapper's prefill_metadata == BGMV."""
    case = Case(13, dtype, slices=(24,))
    seg_idx = np.repeat(np.array([2, -1, 0, 2, 3], np.int32), [3, 2, 1, 4, 1])
    case.idx = seg_idx
    w = impl.wrapper(16, 8, case.num_slots)
    w.update_metadata(case.mapping(is_prefill=True), case.lora_index_to_id, case.num_slots + 1, 32, 0)
    meta = w.prefill_metadata
    a, b = case.lora_a[0], case.lora_b[0]
    got = impl.call_op("sgmv_shrink", impl.arr(case.x, dtype), impl.arr(a, dtype), *meta, case.scale)
    buf = oracle.shrink(case.x, [a], seg_idx, case.scale)
    assert_close(got, buf[0], dtype, "sgmv_shrink")
    y0 = case.y.copy()
    got = impl.call_op("sgmv_expand", impl.arr(buf[0].astype(np.float32), "float32"), impl.arr(b, dtype),
                       impl.arr(y0, dtype), *meta, True)
    assert_close(got, oracle.expand(buf, [b], y0, seg_idx, 0, True), dtype, "sgmv_expand")
    y0 = case.y.copy()
    got = impl.call_op("sgmv_expand_slice", impl.arr(buf[0].astype(np.float32), "float32"), impl.arr(b, dtype),
                       impl.arr(y0, dtype), *meta, 4, 24, False)
    assert_close(got, oracle.expand(buf, [b], y0, seg_idx, 4, False), dtype, "sgmv_expand_slice")


@pytest.mark.parametrize("impl", IMPL_PARAMS)
def test_heterogeneous_ranks_equal_zero_padding(impl):
    """lora_ranks: results equal the computation with weights past each slot's rank zeroed."""
    dtype = impl.dtypes[0]
    case = Case(14, dtype, slices=(24, 8), rank=16)
    ranks = np.array([4, 16, 8, 1], np.int32)
    padded_a = [a.copy() for a in case.lora_a]
    padded_b = [b.copy() for b in case.lora_b]
    for s in range(len(case.slices)):
        for slot, r in enumerate(ranks):
            padded_a[s][slot, :, r:] = 0
            padded_b[s][slot, :, :, r:] = 0
    lr = impl.idx(ranks)
    got_buf = impl.lora_shrink(impl.arr(case.x, dtype), case.native(impl, case.lora_a), case.idx, case.scale,
                               case.num_slots, lora_ranks=lr)
    want_buf = oracle.shrink(case.x, padded_a, case.idx, case.scale)
    assert_close(got_buf, want_buf, dtype, "shrink with lora_ranks")
    y0 = case.y.copy()
    # Values past a token's rank in the buffer must not leak into y.
    dirty = want_buf.astype(np.float32)
    for t, slot in enumerate(case.idx):
        if slot >= 0:
            dirty[:, t, ranks[slot]:] = case.rng.standard_normal(dirty[:, t, ranks[slot]:].shape)
    got = impl.lora_expand(impl.arr(dirty, "float32"), case.native(impl, case.lora_b), impl.arr(y0, dtype),
                           case.idx, 0, True, case.num_slots, lora_ranks=lr)
    assert_close(got, oracle.expand(want_buf, padded_b, y0, case.idx, 0, True), dtype, "expand with lora_ranks")


# ----------------------------------------------------------------------------- JAX specifics

@pytest.mark.parametrize("impl", [p for p in IMPL_PARAMS if p.values[0].side == "jax"])
def test_jax_padded_rows_never_change_real_rows(impl):
    """A bucket-padded batch: x has more rows than the mapping; padded rows are left unchanged."""
    dtype = impl.dtypes[0]
    case = Case(15, dtype, num_tokens=6, slices=(16,))
    w = impl.wrapper(16, 8, case.num_slots)
    w.update_metadata(case.mapping(), case.lora_index_to_id, case.num_slots + 1, 32, 0)
    x = np.concatenate([case.x, round_to(case.rng.standard_normal((4, case.hidden)), dtype)])
    y0 = round_to(case.rng.standard_normal((10, 16)), dtype)
    got = impl.wrapper_call(w, "add_lora_linear", impl.arr(y0, dtype), impl.arr(x, dtype),
                            case.native(impl, case.lora_a), case.native(impl, case.lora_b), None, case.scale,
                            case.slices)
    idx = np.concatenate([case.idx, np.full(4, -1, np.int32)])
    assert_close(got, oracle.lora_linear(y0, x, case.lora_a, case.lora_b, None, case.scale, idx), dtype, "padded")
    np.testing.assert_array_equal(got[6:], y0[6:].astype(np.float64))


@pytest.mark.parametrize("impl", IMPL_PARAMS)
def test_add_lora_linear_with_lora_ranks(impl):
    """The wrapper's `lora_ranks=`: equal to zero padding past each slot's rank."""
    dtype = impl.dtypes[0]
    case = Case(16, dtype, slices=(24, 8), rank=16)
    ranks = np.array([16, 2, 8, 5], np.int32)
    padded_a, padded_b = [a.copy() for a in case.lora_a], [b.copy() for b in case.lora_b]
    for s in range(len(case.slices)):
        for slot, r in enumerate(ranks):
            padded_a[s][slot, :, r:] = 0
            padded_b[s][slot, :, :, r:] = 0
    w = make_wrapper(impl, case)
    w.update_metadata(case.mapping(), case.lora_index_to_id, case.num_slots + 1, 32, 0)
    y0 = case.y.copy()
    got = impl.wrapper_call(w, "add_lora_linear", impl.arr(y0, dtype), impl.arr(case.x, dtype),
                            case.native(impl, case.lora_a), case.native(impl, case.lora_b),
                            case.native(impl, case.bias), case.scale, case.slices, lora_ranks=impl.idx(ranks))
    want = oracle.lora_linear(y0, case.x, padded_a, padded_b, case.bias, case.scale, case.idx)
    assert_close(got, want, dtype, "add_lora_linear lora_ranks")


# ----------------------------------------------------------------------------- mixture-of-experts LoRA

MOE_PARAMS = [pytest.param(impl, dt, id=f"{impl.name}-{dt}", marks=impl.marks)
              for impl in IMPLS if impl.moe_lora for dt in DTYPES if dt in impl.dtypes]


class MoeCase:
    """Routing of T tokens to top_k of E experts, L slots (slot 1 without expert LoRA), weights."""

    def __init__(self, seed, dtype, num_tokens=7, top_k=2, experts=4, slots=3, hidden=32, inter=24, rank=8):
        rng = np.random.default_rng(seed)
        self.rng, self.top_k, self.experts = rng, top_k, experts
        ids = [rng.choice(experts, top_k, replace=False) for _ in range(num_tokens)]
        self.topk_ids = np.stack(ids).astype(np.int32)
        w = rng.random((num_tokens, top_k)).astype(np.float32)
        self.topk_weights = w / w.sum(1, keepdims=True)
        self.idx = rng.choice([-1, 0, 1, 2], size=num_tokens).astype(np.int32)
        self.enabled = np.array([1, 0, 1] + [0] * (slots - 3), np.int32)
        self.lora_index_to_id = [101 + s for s in range(slots)]

        def weights(*shape):
            return round_to(rng.standard_normal(shape) / np.sqrt(shape[-1]), dtype)

        self.gu_a = [weights(slots, experts, rank, hidden) for _ in range(2)]
        self.gu_b = [weights(slots, experts, inter, rank) for _ in range(2)]
        self.dn_a = [weights(slots, experts, rank, inter)]
        self.dn_b = [weights(slots, experts, hidden, rank)]
        self.x = round_to(rng.standard_normal((num_tokens, hidden)), dtype)
        self.h = round_to(rng.standard_normal((num_tokens * top_k, inter)), dtype)
        self.y13 = round_to(rng.standard_normal((num_tokens, top_k, 2 * inter + 3)), dtype)
        self.y2 = round_to(rng.standard_normal((num_tokens, top_k, hidden)), dtype)

    def mapping(self):
        ids = tuple(0 if i < 0 else self.lora_index_to_id[i] for i in self.idx)
        return LoRAMapping(ids, ids, False)

    def untouched(self, got, y0):
        """Pairs without a live adapter are bit for bit what they were."""
        dead = (self.idx < 0) | (self.enabled[np.maximum(self.idx, 0)] == 0)
        np.testing.assert_array_equal(got[dead], np.asarray(y0, np.float64)[dead])


@pytest.mark.parametrize("impl,dtype", MOE_PARAMS)
@pytest.mark.parametrize("order", ["naive", "sorted"])
@pytest.mark.parametrize("down", [False, True], ids=["gate_up", "down"])
def test_fused_moe_lora_op(impl, dtype, order, down):
    """The op on both pair orders: gate_up (two slices, one x row per token, at an offset) and
    down (one slice, one x row per pair, router weights applied)."""
    case = MoeCase(40 + down, dtype)
    a, b = (case.dn_a, case.dn_b) if down else (case.gu_a, case.gu_b)
    x, y0, offset = (case.h, case.y2, 0) if down else (case.x, case.y13, 1)
    got = impl.fused_moe_lora(y0, x, a, b, case.topk_ids, case.topk_weights, case.idx, case.enabled, down, offset,
                              order == "naive", 16, dtype)
    want = oracle.fused_moe_lora(y0, x, a, b, case.topk_ids, case.topk_weights, case.idx, case.enabled, down, offset)
    assert_close(got, want, dtype, f"fused_moe_lora {order}")
    case.untouched(got, y0)


@pytest.mark.parametrize("impl", [p for p in IMPL_PARAMS if p.values[0].moe_lora])
@pytest.mark.parametrize("order", ["naive", "sorted"])
def test_fused_moe_lora_wide_rank_many_slots(impl, order):
    """Rank 40 (the naive shrink's rank chunks, a padded rank block), 6 slots (5 with expert
    LoRA), 6 experts, top 3, 30 tokens, blocks of 32 pairs; both slices of gate_up."""
    dtype = impl.dtypes[0]
    case = MoeCase(45, dtype, num_tokens=30, top_k=3, experts=6, slots=6, rank=40)
    case.enabled = np.array([1, 0, 1, 1, 1, 1], np.int32)
    case.idx = case.rng.choice([-1, 0, 1, 2, 3, 4, 5], size=30).astype(np.int32)
    got = impl.fused_moe_lora(case.y13, case.x, case.gu_a, case.gu_b, case.topk_ids, case.topk_weights, case.idx,
                              case.enabled, False, 2, order == "naive", 32, dtype)
    want = oracle.fused_moe_lora(case.y13, case.x, case.gu_a, case.gu_b, case.topk_ids, case.topk_weights, case.idx,
                                 case.enabled, False, 2)
    assert_close(got, want, dtype, f"rank 40 {order}")
    case.untouched(got, case.y13)


@pytest.mark.parametrize("impl", [p for p in IMPL_PARAMS if p.values[0].moe_lora])
def test_fused_moe_lora_shared_a_and_expert_minus_one(impl):
    """One A tensor for both gate_up slices (PEFT's fused gate_up_proj) and an expert id of -1
    (expert parallelism: not local) give the oracle's result."""
    dtype = impl.dtypes[0]
    case = MoeCase(43, dtype, num_tokens=9)
    case.topk_ids[2, 1] = -1
    a = [case.gu_a[0], case.gu_a[0]]
    for naive in (True, False):
        got = impl.fused_moe_lora(case.y13, case.x, a, case.gu_b, case.topk_ids, case.topk_weights, case.idx,
                                  case.enabled, False, 0, naive, 16, dtype)
        want = oracle.fused_moe_lora(case.y13, case.x, a, case.gu_b, case.topk_ids, case.topk_weights, case.idx,
                                     case.enabled, False, 0)
        assert_close(got, want, dtype, f"shared A naive={naive}")
        np.testing.assert_array_equal(got[2, 1], case.y13[2, 1].astype(np.float64))


@pytest.mark.parametrize("impl,dtype", MOE_PARAMS)
@pytest.mark.parametrize("num_tokens,experts", [(1, 8), (24, 4)], ids=["naive", "sorted"])
def test_wrapper_add_lora_w13_then_w2(impl, dtype, num_tokens, experts):
    """vLLM's add_lora_w13 / add_lora_w2 on the wrapper's metadata: the pair order vLLM's rule
    picks (naive for 1 token of 8 experts, sorted for 24 tokens), the router weights on w2 only."""
    case = MoeCase(44, dtype, num_tokens=num_tokens, experts=experts)
    w = impl.wrapper(num_tokens + 3, 8, len(case.lora_index_to_id))
    w.update_metadata(case.mapping(), case.lora_index_to_id, len(case.lora_index_to_id) + 1, 32, 0)
    got13, got2, naive = impl.moe_w13_w2(w, case.y13, case.x, case.gu_a, case.gu_b, case.y2, case.h, case.dn_a,
                                         case.dn_b, case.topk_ids, case.topk_weights, case.enabled, case.experts,
                                         dtype)
    want13 = oracle.fused_moe_lora(case.y13, case.x, case.gu_a, case.gu_b, case.topk_ids, case.topk_weights,
                                   case.idx, case.enabled, False)
    want2 = oracle.fused_moe_lora(case.y2, case.h, case.dn_a, case.dn_b, case.topk_ids, case.topk_weights,
                                  case.idx, case.enabled, True)
    assert naive == (num_tokens == 1)
    assert_close(got13, want13, dtype, "add_lora_w13")
    assert_close(got2, want2, dtype, "add_lora_w2")
    case.untouched(got13, case.y13)
    case.untouched(got2, case.y2)


@pytest.mark.parametrize("impl", [p for p in IMPL_PARAMS if p.values[0].moe_lora])
@pytest.mark.parametrize("order", ["naive", "sorted"])
def test_fused_moe_lora_never_reads_unused_weights(impl, order):
    """NaN in the weights of the slot without expert LoRA and of an expert no token is routed to
    never reaches y: those weights are not read (or not used)."""
    dtype = impl.dtypes[0]
    case = MoeCase(46, dtype, num_tokens=6, experts=5)
    case.topk_ids = np.stack([case.rng.choice(4, 2, replace=False) for _ in range(6)]).astype(np.int32)  # not 4
    a = [w.copy() for w in case.gu_a]
    b = [w.copy() for w in case.gu_b]
    for w in a + b:
        w[1] = np.nan                       # slot 1: adapter_enabled 0
        w[:, 4] = np.nan                    # expert 4: no pair
    got = impl.fused_moe_lora(case.y13, case.x, a, b, case.topk_ids, case.topk_weights, case.idx, case.enabled,
                              False, 0, order == "naive", 16, dtype)
    want = oracle.fused_moe_lora(case.y13, case.x, case.gu_a, case.gu_b, case.topk_ids, case.topk_weights,
                                 case.idx, case.enabled, False, 0)
    assert np.isfinite(got).all()
    assert_close(got, want, dtype, f"unused weights NaN, {order}")


@pytest.mark.parametrize("impl", [p for p in IMPL_PARAMS if p.values[0].moe_lora])
@pytest.mark.parametrize("order", ["naive", "sorted"])
def test_fused_moe_lora_long_hidden(impl, order):
    """A hidden size of 1100 (the naive shrink's hidden split into partial-sum planes, a last
    part shorter than the others) at rank 40, down projection with router weights."""
    from lora_core.kernels.moe_lora import plan_moe_lora
    plan = plan_moe_lora(num_pairs=10, num_slots=3, num_experts=4, hidden=1100, widths=(24,), rank=40, naive=True,
                         sorted_len=0, block_m=16, mul_routed_weight=True, shared_a=False, dtypes=("float32",) * 3)
    k_per = plan.constexprs["K_PER"]
    assert plan.k_split >= 2 and 0 < 1100 - (plan.k_split - 1) * k_per < k_per     # a shorter last part
    dtype = impl.dtypes[0]
    case = MoeCase(47, dtype, num_tokens=5, experts=4, inter=1100, hidden=24, rank=40)
    got = impl.fused_moe_lora(case.y2, case.h, case.dn_a, case.dn_b, case.topk_ids, case.topk_weights, case.idx,
                              case.enabled, True, 0, order == "naive", 16, dtype)
    want = oracle.fused_moe_lora(case.y2, case.h, case.dn_a, case.dn_b, case.topk_ids, case.topk_weights, case.idx,
                                 case.enabled, True, 0)
    assert_close(got, want, dtype, f"hidden 1100 {order}")
    case.untouched(got, case.y2)


# ----------------------------------------------------------------------------- several adapters per token

def _pair_case(case, max_pairs):
    """Per token up to `max_pairs` (LoRA id, weight) pairs over the case's filled slots (some tokens
    none, some fewer), as the mapping's tuples and as the oracle's (T, max_pairs) slots / weights."""
    usable = [s for s, i in enumerate(case.lora_index_to_id) if i is not None]
    ids, weights = [], []
    slots = np.full((case.num_tokens, max_pairs), -1, np.int64)
    ws = np.zeros((case.num_tokens, max_pairs))
    for t in range(case.num_tokens):
        n = int(case.rng.integers(0, max_pairs + 1)) if t else max_pairs
        chosen = case.rng.choice(usable, size=n, replace=n > len(usable))
        w = np.round(case.rng.uniform(-1.0, 1.5, size=n), 3)
        ids.append(tuple(case.lora_index_to_id[s] for s in chosen))
        weights.append(tuple(float(v) for v in w))
        slots[t, :n], ws[t, :n] = chosen, w
    return ids, weights, slots, ws


def _check_several_adapters(impl, dtype, max_pairs, seed):
    case = Case(seed, dtype, slices=(24, 8, 16))
    ids, weights, slots, ws = _pair_case(case, max_pairs)
    w = make_wrapper(impl, case)
    w.update_metadata(LoRAMapping(ids, case.ids(case.idx), False, weights), case.lora_index_to_id,
                      case.num_slots + 1, 32, 0)
    y0 = case.y.copy()
    got = impl.wrapper_call(w, "add_lora_linear", impl.arr(y0, dtype), impl.arr(case.x, dtype),
                            case.native(impl, case.lora_a), case.native(impl, case.lora_b), None, case.scale,
                            case.slices)
    want = oracle.multi_lora_linear(y0, case.x, case.lora_a, case.lora_b, case.scale, slots, ws)
    assert_close(got, want, dtype, f"add_lora_linear with {max_pairs} adapters per token")
    none = slots[:, 0] < 0
    np.testing.assert_array_equal(got[none], np.asarray(y0, np.float64)[none],
                                  err_msg="rows without any adapter changed")
    np.testing.assert_array_equal(got[:, sum(case.slices):], y0[:, sum(case.slices):],
                                  err_msg="columns outside the slices changed")


@pytest.mark.parametrize("impl,dtype", IMPL_DTYPE_PARAMS)
def test_add_lora_linear_two_adapters_per_token(impl, dtype):
    """Tokens with 0, 1 or 2 weighted adapters (contract section 10) against the float64 oracle."""
    _check_several_adapters(impl, dtype, 2, 21)


@pytest.mark.parametrize("impl", IMPL_PARAMS)
@pytest.mark.parametrize("max_pairs", [1, 3], ids=["one_weighted", "bucket4"])
def test_add_lora_linear_weighted_and_four_adapters(impl, max_pairs):
    """One adapter with a per-token strength (bucket 1), and up to 3 adapters (bucket 4)."""
    _check_several_adapters(impl, impl.dtypes[0], max_pairs, 22 + max_pairs)


# ----------------------------------------------------------------------------- fp8 adapter weights
# Contract section 11: e4m3 weights with float32 scales per output channel ((L, rows)) or per
# tensor ((L,), one per slot). Checked against the oracle on the DEQUANTISED weights (oracle.FP8_TOL)
# and, for accuracy, against the oracle on the original 16-bit weights (oracle.FP8_QUANT_TOL).

FP8_PARAMS = [pytest.param(impl, dt, gran, id=f"{impl.name}-{dt}-{gran}", marks=impl.marks)
              for impl in IMPLS if impl.fp8 for dt in DTYPES if dt in impl.dtypes
              for gran in ("channel", "tensor")]


def fp8_quantize(w, granularity):
    """(w_q, scale, dequantised float64 w) of a stacked weight (L, [1,] rows, cols) by contract
    section 11's rule, per output channel or per tensor (one scale per slot)."""
    w = np.asarray(w, np.float64)
    if granularity == "channel":
        q, scale = oracle.fp8_quantize(w.reshape(w.shape[0], w.shape[-2], w.shape[-1]))
    else:
        q, scale = oracle.fp8_quantize(w.reshape(w.shape[0], -1))
    q = q.reshape(w.shape)
    return q, scale, oracle.fp8_dequantize(q.reshape(w.shape[0], w.shape[-2], w.shape[-1]), scale)


def _fp8_slices(impl, weights, granularity):
    qs = [fp8_quantize(w, granularity) for w in weights]
    return ([impl.fp8_weight(q) for q, _, _ in qs], [impl.arr(s) for _, s, _ in qs], [d for _, _, d in qs])


FP8_MOE_PARAMS = [pytest.param(impl, dt, id=f"{impl.name}-{dt}", marks=impl.marks)
                  for impl in IMPLS if impl.fp8_moe for dt in DTYPES if dt in impl.dtypes]


def fp8_quantize_experts(w, granularity):
    """(w_q, scale, dequantised float64 w) of stacked expert weights (L, E, rows, cols) by contract
    section 11's rule: scale (L, E, rows) per channel, or (L,) per tensor (one per slot)."""
    w = np.asarray(w, np.float64)
    if granularity == "channel":
        q, scale = oracle.fp8_quantize(w)
        return q, scale, oracle.fp8_dequantize(q, scale)
    q, scale = oracle.fp8_quantize(w.reshape(w.shape[0], 1, -1))
    q, scale = q.reshape(w.shape), scale.reshape(-1)
    return q, scale, q.astype(np.float64) * scale.astype(np.float64)[:, None, None, None]


@pytest.mark.parametrize("impl,dtype", FP8_MOE_PARAMS)
@pytest.mark.parametrize("order", ["naive", "sorted"])
@pytest.mark.parametrize("down,granularity", [(False, "channel"), (True, "tensor")], ids=["gate_up", "down"])
def test_fp8_fused_moe_lora_op(impl, dtype, order, down, granularity):
    """fused_moe_lora with fp8 expert A and B (gate_up: two slices at an offset, per-channel scales
    (L, E, rows); down: router-weighted, per-slot scales (L,)) against the oracle on the dequantised
    weights, and within the quantisation's accuracy of the 16-bit weights."""
    case = MoeCase(48 + down, dtype)
    a, b = (case.dn_a, case.dn_b) if down else (case.gu_a, case.gu_b)
    x, y0, offset = (case.h, case.y2, 0) if down else (case.x, case.y13, 1)
    qa = [fp8_quantize_experts(w, granularity) for w in a]
    qb = [fp8_quantize_experts(w, granularity) for w in b]
    got = impl.fused_moe_lora(y0, x, [q for q, _, _ in qa], [q for q, _, _ in qb], case.topk_ids, case.topk_weights,
                              case.idx, case.enabled, down, offset, order == "naive", 16, dtype,
                              a_scales=[s for _, s, _ in qa], b_scales=[s for _, s, _ in qb])
    want = oracle.fused_moe_lora(y0, x, [d for _, _, d in qa], [d for _, _, d in qb], case.topk_ids,
                                 case.topk_weights, case.idx, case.enabled, down, offset)
    assert_close(got, want, dtype, f"fp8 fused_moe_lora {order}")
    case.untouched(got, y0)
    want16 = oracle.fused_moe_lora(y0, x, a, b, case.topk_ids, case.topk_weights, case.idx, case.enabled, down,
                                   offset)
    err16 = oracle.rel_err(got - np.asarray(y0, np.float64), want16 - np.asarray(y0, np.float64))
    assert err16 <= oracle.FP8_QUANT_TOL + oracle.FP8_TOL[dtype], f"fp8 fused_moe_lora vs 16-bit: {err16:.3g}"


@pytest.mark.parametrize("impl,dtype,granularity", FP8_PARAMS)
def test_fp8_lora_shrink_expand_ops(impl, dtype, granularity):
    """lora_shrink / lora_expand with fp8 A and B (three slices of unequal widths)."""
    case = Case(31, dtype)
    a_q, a_s, a_deq = _fp8_slices(impl, case.lora_a, granularity)
    got_buf = impl.lora_shrink(impl.arr(case.x, dtype), a_q, case.idx, case.scale, case.num_slots, scales=a_s)
    assert_close(got_buf, oracle.shrink(case.x, a_deq, case.idx, case.scale), dtype, "fp8 lora_shrink")
    assert np.all(got_buf[:, case.idx < 0] == 0)
    err16 = oracle.rel_err(got_buf, oracle.shrink(case.x, case.lora_a, case.idx, case.scale))
    assert err16 <= oracle.FP8_QUANT_TOL, f"fp8 lora_shrink vs the 16-bit weights: {err16:.3g}"
    b_q, b_s, b_deq = _fp8_slices(impl, case.lora_b, granularity)
    buf = oracle.shrink(case.x, case.lora_a, case.idx, case.scale).astype(np.float32)
    for add_inputs in (False, True):
        y0 = case.y.copy()
        got = impl.lora_expand(impl.arr(buf, "float32"), b_q, impl.arr(y0, dtype), case.idx, 2, add_inputs,
                               case.num_slots, scales=b_s)
        assert_close(got, oracle.expand(buf, b_deq, y0, case.idx, 2, add_inputs), dtype,
                     f"fp8 lora_expand add_inputs={add_inputs}")
        assert_rows_untouched(got, y0, case.idx, "fp8 lora_expand")
        if not add_inputs:
            err16 = oracle.rel_err(got[:, 2:2 + sum(case.slices)],
                                   oracle.expand(buf, case.lora_b, y0, case.idx, 2, False)[:, 2:2 + sum(case.slices)])
            assert err16 <= oracle.FP8_QUANT_TOL + oracle.FP8_TOL[dtype], f"fp8 lora_expand vs 16-bit: {err16:.3g}"


@pytest.mark.parametrize("impl,dtype,granularity", FP8_PARAMS)
def test_fp8_bgmv_ops(impl, dtype, granularity):
    """bgmv_shrink / bgmv_expand / bgmv_expand_slice with an fp8 weight and w_scale."""
    case = Case(32, dtype, slices=(24, 24))
    (a_q, _), (a_s, _), (a_deq, _) = _fp8_slices(impl, case.lora_a, granularity)
    (b_q, _), (b_s, _), (b_deq, _) = _fp8_slices(impl, case.lora_b, granularity)
    idx = impl.idx(case.idx)
    got = impl.call_op("bgmv_shrink", impl.arr(case.x, dtype), a_q, idx, case.scale, w_scale=a_s)
    buf = oracle.shrink(case.x, [a_deq], case.idx, case.scale)
    assert_close(got, buf[0], dtype, "fp8 bgmv_shrink")
    xb = buf[0].astype(np.float32)
    y0 = case.y.copy()
    got = impl.call_op("bgmv_expand", impl.arr(xb, "float32"), b_q, impl.arr(y0, dtype), idx, True, w_scale=b_s)
    assert_close(got, oracle.expand(buf, [b_deq], y0, case.idx, 0, True), dtype, "fp8 bgmv_expand")
    y0 = case.y.copy()
    got = impl.call_op("bgmv_expand_slice", impl.arr(xb, "float32"), b_q, impl.arr(y0, dtype), idx, 9, 24, False,
                       w_scale=b_s)
    assert_close(got, oracle.expand(buf, [b_deq], y0, case.idx, 9, False), dtype, "fp8 bgmv_expand_slice")
    assert_rows_untouched(got, y0, case.idx, "fp8 bgmv_expand_slice")


@pytest.mark.parametrize("impl,dtype,granularity", FP8_PARAMS)
def test_fp8_add_lora_linear(impl, dtype, granularity):
    """The wrapper's add_lora_linear with fp8 A and B (lora_a_scale / lora_b_scale), twice (the
    second call takes the cached plan), then with fp8 A and 16-bit B (mixed)."""
    case = Case(33, dtype)
    w = make_wrapper(impl, case)
    w.update_metadata(case.mapping(), case.lora_index_to_id, case.num_slots + 1, 32, 0)
    a_q, a_s, a_deq = _fp8_slices(impl, case.lora_a, granularity)
    b_q, b_s, b_deq = _fp8_slices(impl, case.lora_b, granularity)
    want = oracle.lora_linear(case.y, case.x, a_deq, b_deq, None, case.scale, case.idx)
    for _ in range(2):
        got = impl.wrapper_call(w, "add_lora_linear", impl.arr(case.y, dtype), impl.arr(case.x, dtype), a_q, b_q,
                                None, case.scale, case.slices, lora_a_scale=a_s, lora_b_scale=b_s)
        assert_close(got, want, dtype, "fp8 add_lora_linear")
        assert_rows_untouched(got, case.y, case.idx, "fp8 add_lora_linear")
    got = impl.wrapper_call(w, "add_lora_linear", impl.arr(case.y, dtype), impl.arr(case.x, dtype), a_q,
                            case.native(impl, case.lora_b), None, case.scale, case.slices, lora_a_scale=a_s)
    assert_close(got, oracle.lora_linear(case.y, case.x, a_deq, case.lora_b, None, case.scale, case.idx), dtype,
                 "fp8 A with 16-bit B")


@pytest.mark.parametrize("impl", [p for p in IMPL_PARAMS if p.values[0].fp8])
def test_fp8_two_adapters_per_token(impl):
    """Several adapters per token (contract section 10) with fp8 weights."""
    dtype = impl.dtypes[0]
    case = Case(34, dtype, slices=(24, 8, 16))
    ids, weights, slots, ws = _pair_case(case, 2)
    w = make_wrapper(impl, case)
    w.update_metadata(LoRAMapping(ids, case.ids(case.idx), False, weights), case.lora_index_to_id,
                      case.num_slots + 1, 32, 0)
    a_q, a_s, a_deq = _fp8_slices(impl, case.lora_a, "channel")
    b_q, b_s, b_deq = _fp8_slices(impl, case.lora_b, "channel")
    got = impl.wrapper_call(w, "add_lora_linear", impl.arr(case.y, dtype), impl.arr(case.x, dtype), a_q, b_q, None,
                            case.scale, case.slices, lora_a_scale=a_s, lora_b_scale=b_s)
    want = oracle.multi_lora_linear(case.y, case.x, a_deq, b_deq, case.scale, slots, ws)
    assert_close(got, want, dtype, "fp8 add_lora_linear with 2 adapters per token")
    rows = 5                                     # the LM head of the paired step: one adapter per sampled row
    y0 = case.y[:rows, :20]
    got = impl.wrapper_call(w, "add_lora_logits", impl.arr(y0, dtype), impl.arr(case.x[:rows], dtype), a_q[0],
                            b_q[0], case.scale, lora_a_scale=a_s[0], lora_b_scale=b_s[0])
    assert_close(got, oracle.logits(y0, case.x[:rows], a_deq[0], b_deq[0], case.scale, case.idx[:rows]), dtype,
                 "fp8 add_lora_logits in a paired step")


@pytest.mark.parametrize("impl", [p for p in IMPL_PARAMS if p.values[0].fp8])
def test_fp8_wrapper_shrink_expand_embedding_logits(impl):
    """add_shrink / add_expand (with a bias), add_lora_embedding and add_lora_logits (a B wider than
    y, cut with its scales) with fp8 weights and their scales."""
    dtype = impl.dtypes[0]
    case = Case(35, dtype, slices=(24, 8))
    w = make_wrapper(impl, case)
    prompt_idx = np.array([0, -1, 3, 2, 0] + [0] * (case.num_tokens - 5), np.int32)
    w.update_metadata(case.mapping(prompt_idx=prompt_idx), case.lora_index_to_id, case.num_slots + 1, 32, 0)
    a_q, a_s, a_deq = _fp8_slices(impl, case.lora_a, "channel")
    b_q, b_s, b_deq = _fp8_slices(impl, case.lora_b, "tensor")
    buf = impl.wrapper_call(w, "add_shrink", impl.arr(np.zeros((2, case.num_tokens, case.rank), np.float32)),
                            impl.arr(case.x, dtype), a_q, case.scale, lora_a_scale=a_s)
    want_buf = oracle.shrink(case.x, a_deq, case.idx, case.scale)
    assert_close(buf, want_buf, dtype, "fp8 add_shrink")
    got = impl.wrapper_call(w, "add_expand", impl.arr(case.y, dtype), impl.arr(want_buf.astype(np.float32)), b_q,
                            case.native(impl, case.bias), case.slices, offset_start=3, lora_b_scale=b_s)
    assert_close(got, oracle.expand(want_buf, b_deq, case.y, case.idx, 3, True, case.bias), dtype, "fp8 add_expand")
    x = round_to(case.rng.standard_normal((case.num_tokens, case.rank)), dtype)
    got = impl.wrapper_call(w, "add_lora_embedding", impl.arr(case.y[:, :24], dtype), impl.arr(x, dtype), b_q[0],
                            lora_b_scale=b_s[0])
    assert_close(got, oracle.expand(x[None], [b_deq[0]], case.y[:, :24], case.idx, 0, True), dtype,
                 "fp8 add_lora_embedding")
    rows = 5
    y0 = case.y[:rows, :20]
    got = impl.wrapper_call(w, "add_lora_logits", impl.arr(y0, dtype), impl.arr(case.x[:rows], dtype), a_q[0],
                            b_q[0], case.scale, lora_a_scale=a_s[0], lora_b_scale=b_s[0])
    assert_close(got, oracle.logits(y0, case.x[:rows], a_deq[0], b_deq[0], case.scale, prompt_idx[:rows]), dtype,
                 "fp8 add_lora_logits")


def _embedding_oracle(y, ids, table, lora_b, slots, weights):
    """y[t] + sum_j weights[t, j] * table[slot_j, ids[t]] @ B[slot_j].T over the token's pairs (slot
    -1: none), float64: the embedding's LoRA term (contract sections 5, 10 and 11)."""
    out = np.asarray(y, np.float64).copy()
    b = oracle.w3(lora_b)
    for t in range(len(ids)):
        for s, wt in zip(slots[t], weights[t]):
            if s >= 0:
                out[t] += wt * (b[s] @ table[s, ids[t]])
    return out


@pytest.mark.parametrize("impl,dtype,granularity", FP8_PARAMS)
def test_fp8_add_lora_embedding_ids(impl, dtype, granularity):
    """add_lora_embedding_ids with an fp8 LoRA-A table (one scale per table row, (L, V), or per slot)
    and an fp8 B (one per output channel, or per slot): the looked-up row is float32(A_q[l, v]) *
    a_scale[l, v]; then fp8 A with a 16-bit B (mixed)."""
    vocab = 13
    case = Case(36, dtype, slices=(24,))
    w = make_wrapper(impl, case)
    w.update_metadata(case.mapping(), case.lora_index_to_id, case.num_slots + 1, vocab, 0)
    ids = case.rng.integers(0, vocab, case.num_tokens).astype(np.int32)
    table = round_to(case.rng.standard_normal((case.num_slots, vocab, case.rank)), dtype)
    a_q, a_s, a_deq = fp8_quantize(table, granularity)
    (b_q,), (b_s,), (b_deq,) = _fp8_slices(impl, case.lora_b, granularity)
    y0 = case.y[:, :24]
    one = (case.idx[:, None], np.ones((case.num_tokens, 1)))
    got = impl.wrapper_call(w, "add_lora_embedding_ids", impl.arr(y0, dtype), impl.idx(ids), impl.fp8_weight(a_q),
                            b_q, lora_a_scale=impl.arr(a_s), lora_b_scale=b_s)
    assert_close(got, _embedding_oracle(y0, ids, a_deq, b_deq, *one), dtype, "fp8 add_lora_embedding_ids")
    assert_rows_untouched(got, y0, case.idx, "fp8 add_lora_embedding_ids")
    err16 = oracle.rel_err(got - y0, _embedding_oracle(y0, ids, table, case.lora_b[0], *one) - y0)
    assert err16 <= oracle.FP8_QUANT_TOL + oracle.FP8_TOL[dtype], f"fp8 embedding vs the 16-bit weights: {err16:.3g}"
    got = impl.wrapper_call(w, "add_lora_embedding_ids", impl.arr(y0, dtype), impl.idx(ids), impl.fp8_weight(a_q),
                            impl.arr(case.lora_b[0], dtype), lora_a_scale=impl.arr(a_s))
    assert_close(got, _embedding_oracle(y0, ids, a_deq, case.lora_b[0], *one), dtype, "fp8 table with 16-bit B")


@pytest.mark.parametrize("impl", [p for p in IMPL_PARAMS if p.values[0].fp8])
def test_fp8_add_lora_embedding_ids_two_adapters_per_token(impl):
    """The embedding of a paired step (contract section 10) from an fp8 table and B: each pair's row
    scaled by its table row's scale, weighted and summed in float32."""
    dtype, vocab = impl.dtypes[0], 13
    case = Case(37, dtype, slices=(24,))
    ids_pairs, weights, slots, ws = _pair_case(case, 2)
    w = make_wrapper(impl, case)
    w.update_metadata(LoRAMapping(ids_pairs, case.ids(case.idx), False, weights), case.lora_index_to_id,
                      case.num_slots + 1, vocab, 0)
    ids = case.rng.integers(0, vocab, case.num_tokens).astype(np.int32)
    table = round_to(case.rng.standard_normal((case.num_slots, vocab, case.rank)), dtype)
    a_q, a_s, a_deq = fp8_quantize(table, "channel")
    (b_q,), (b_s,), (b_deq,) = _fp8_slices(impl, case.lora_b, "channel")
    y0 = case.y[:, :24]
    got = impl.wrapper_call(w, "add_lora_embedding_ids", impl.arr(y0, dtype), impl.idx(ids), impl.fp8_weight(a_q),
                            b_q, lora_a_scale=impl.arr(a_s), lora_b_scale=b_s)
    assert_close(got, _embedding_oracle(y0, ids, a_deq, b_deq, slots, ws), dtype,
                 "fp8 add_lora_embedding_ids with 2 adapters per token")
