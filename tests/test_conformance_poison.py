"""Conformance property: a slot's values reach only its own tokens (run over every tests/impls.py entry).

NaN and +-Inf are put where a row must not look, and every row must still equal the float64 oracle
computed with clean values:
  - "unused_slots": the empty slot and a slot holding an adapter this batch does not use are full of
    NaN/+Inf/-Inf (A, B and bias);
  - "rank_padding": with `lora_ranks=`, every weight entry past its slot's rank is NaN/+-Inf (an
    empty slot has rank 0: all of it), and so is every expand-buffer value past a token's rank;
  - "other_adapter": one adapter that the batch does use holds a NaN in A, an Inf in B and a -Inf in
    its bias: its own rows must show it (non-finite, the poison is not hidden), every other row is clean.
In every mode: no-LoRA rows are bit-for-bit unchanged (0 in shrink buffers, contract section 4), and
expand buffers / embedding inputs hold NaN on no-LoRA rows (those rows are never read). The cut-off
part of a LoRA vocabulary wider than the logits (never read) is NaN too. The cases are small (the
interpreters are slow); the dtype is each implementation's first.

The cause these guard against: selecting a token's slot by multiplying with a one-hot matrix over all
slots, where 0 * NaN = NaN turns every LoRA row NaN; a slot must be selected (gather / where), never
multiplied by 0.

CPU, over the same implementations as tests/test_conformance.py.
"""

from __future__ import annotations

import numpy as np
import pytest

from . import oracle
from .impls import round_to
from .test_conformance import IMPLS, Case, assert_close

# NaN arithmetic is the point here (the Triton interpreter's NumPy matmul warns about it).
pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")

MODES = ("unused_slots", "rank_padding", "other_adapter")

IDX = np.array([0, -1, 2, 3, 0, -1, 3, 2, 2, 0, -1], np.int32)  # slot 1 empty, slot 4 loaded but unused
PROMPT_IDX = np.array([0, -1, 3, 2, 0], np.int32)                 # logits rows (sampler indices)
RANKS = np.array([4, 0, 16, 1, 5], np.int32)                      # "rank_padding" only
POISONED_SLOT = 3                                                 # "other_adapter" only
BAD = np.array([np.nan, np.inf, -np.inf], np.float32)


def _params():
    out = []
    for impl in IMPLS:
        for mode in MODES:
            marks = list(impl.marks)
            out.append(pytest.param(impl, mode, id=f"{impl.name}-{mode}", marks=marks))
    return out


PARAMS = _params()


def _bad_like(shape, rng):
    return rng.choice(BAD, size=shape)


class Poisoned:
    """Clean weights (what the oracle sees) and poisoned copies (what the implementation gets)."""

    def __init__(self, seed, dtype, mode, slices=(24, 8)):
        case = Case(seed, dtype, num_tokens=len(IDX), slices=slices, num_slots=5, empty_slot=1)
        case.idx = IDX.copy()
        self.case, self.mode, self.dtype, self.idx = case, mode, dtype, case.idx
        self.ranks = RANKS if mode == "rank_padding" else None
        self.poisoned_slot = POISONED_SLOT if mode == "other_adapter" else None
        rng = np.random.default_rng(seed + 1000)
        self.rng = rng
        a, b, bias = ([w.copy() for w in ws] for ws in (case.lora_a, case.lora_b, case.bias))
        if self.ranks is not None:                       # the clean computation: padding zeroed
            for s in range(len(slices)):
                for slot, r in enumerate(self.ranks):
                    a[s][slot, :, r:] = 0
                    b[s][slot, :, :, r:] = 0
        self.a, self.b, self.bias = a, b, bias
        pa, pb, pbias = ([w.copy() for w in ws] for ws in (a, b, bias))
        for s in range(len(slices)):
            if mode == "unused_slots":
                for slot in (1, 4):
                    pa[s][slot] = _bad_like(pa[s][slot].shape, rng)
                    pb[s][slot] = _bad_like(pb[s][slot].shape, rng)
                    pbias[s][slot] = _bad_like(pbias[s][slot].shape, rng)
            elif mode == "rank_padding":
                for slot, r in enumerate(self.ranks):
                    pa[s][slot, :, r:] = _bad_like(pa[s][slot, :, r:].shape, rng)
                    pb[s][slot, :, :, r:] = _bad_like(pb[s][slot, :, :, r:].shape, rng)
        if mode == "other_adapter":
            pa[0][POISONED_SLOT, 0, 2, 5] = np.nan
            pb[-1][POISONED_SLOT, 0, 3, 1] = np.inf
            pbias[0][POISONED_SLOT, 7] = -np.inf
        self.pa, self.pb, self.pbias = pa, pb, pbias

    def lora_ranks(self, impl):
        return None if self.ranks is None else impl.idx(self.ranks)

    def rank_kw(self, impl):
        return {} if self.ranks is None else {"lora_ranks": impl.idx(self.ranks)}

    def dirty_buffer(self, buf, idx):
        """buf (S, T, r) float32 with NaN on no-LoRA rows, NaN/Inf past each token's rank, and NaN on
        the poisoned adapter's rows (what its shrink gives)."""
        buf = np.array(buf, np.float32)
        for t, slot in enumerate(idx):
            if slot < 0 or slot == self.poisoned_slot:
                buf[:, t] = np.nan
            elif self.ranks is not None:
                buf[:, t, self.ranks[slot]:] = _bad_like(buf[:, t, self.ranks[slot]:].shape, self.rng)
        return buf

    def check_rows(self, got, want, idx, what, y0=None):
        """got/want: (T, ...) or (S, T, r) buffers when y0 is None (no-LoRA rows must be 0)."""
        idx = np.asarray(idx)
        if y0 is None:
            got = np.moveaxis(got, 1, 0).reshape(len(idx), -1)
            want = np.moveaxis(want, 1, 0).reshape(len(idx), -1)
        clean = idx >= 0
        if self.poisoned_slot is not None:
            clean &= idx != self.poisoned_slot
        assert_close(got[clean], want[clean], self.dtype, f"{what} [{self.mode}]: rows of clean slots")
        none = idx < 0
        if y0 is None:
            assert np.all(got[none] == 0), f"{what} [{self.mode}]: shrink rows of -1 tokens must be 0"
        else:
            np.testing.assert_array_equal(got[none], np.asarray(y0, np.float64)[none],
                                          err_msg=f"{what} [{self.mode}]: rows with index -1 changed")
        if self.poisoned_slot is not None:
            for t in np.flatnonzero(idx == self.poisoned_slot):
                assert not np.all(np.isfinite(got[t])), (
                    f"{what} [{self.mode}]: row {t} uses the poisoned adapter but came out finite")


# ----------------------------------------------------------------------------- wrapper methods

@pytest.mark.parametrize("impl,mode", PARAMS)
def test_poison_add_lora_linear(impl, mode):
    p = Poisoned(21, impl.dtypes[0], mode)
    case, dtype = p.case, p.dtype
    w = impl.wrapper(case.num_tokens + 5, 16, case.num_slots)
    w.update_metadata(case.mapping(), case.lora_index_to_id, case.num_slots + 1, 32, 0)
    y0 = case.y.copy()
    got = impl.wrapper_call(w, "add_lora_linear", impl.arr(y0, dtype), impl.arr(case.x, dtype),
                            case.native(impl, p.pa), case.native(impl, p.pb), case.native(impl, p.pbias),
                            case.scale, case.slices, **p.rank_kw(impl))
    want = oracle.lora_linear(y0, case.x, p.a, p.b, p.bias, case.scale, p.idx)
    p.check_rows(got, want, p.idx, "add_lora_linear", y0)
    np.testing.assert_array_equal(got[:, sum(case.slices):], y0[:, sum(case.slices):],
                                  err_msg="columns outside the slices changed")


@pytest.mark.parametrize("impl,mode", PARAMS)
def test_poison_add_shrink_expand_embedding(impl, mode):
    p = Poisoned(22, impl.dtypes[0], mode)
    case, dtype = p.case, p.dtype
    w = impl.wrapper(case.num_tokens + 5, 16, case.num_slots)
    w.update_metadata(case.mapping(), case.lora_index_to_id, case.num_slots + 1, 32, 0)
    buf0 = np.full((len(case.slices), case.num_tokens, case.rank), np.nan, np.float32)
    got = impl.wrapper_call(w, "add_shrink", impl.arr(buf0, "float32"), impl.arr(case.x, dtype),
                            case.native(impl, p.pa), case.scale, **p.rank_kw(impl))
    want_buf = oracle.shrink(case.x, p.a, p.idx, case.scale)
    p.check_rows(got, want_buf, p.idx, "add_shrink")

    dirty = p.dirty_buffer(want_buf, p.idx)
    y0 = case.y.copy()
    got = impl.wrapper_call(w, "add_expand", impl.arr(y0, dtype), impl.arr(dirty, "float32"),
                            case.native(impl, p.pb), case.native(impl, p.pbias), case.slices,
                            offset_start=3, add_inputs=True, **p.rank_kw(impl))
    p.check_rows(got, oracle.expand(want_buf, p.b, y0, p.idx, 3, True, p.bias), p.idx, "add_expand", y0)

    # Embedding: x is the looked-up LoRA-A row (T, r), the expand half only.
    x = p.dirty_buffer(round_to(case.rng.standard_normal((1, case.num_tokens, case.rank)), dtype), p.idx)[0]
    clean_x = np.nan_to_num(x, nan=0.0, posinf=0.0, neginf=0.0)
    y0 = case.y[:, :24].copy()
    got = impl.wrapper_call(w, "add_lora_embedding", impl.arr(y0, dtype), impl.arr(x, dtype),
                            impl.arr(p.pb[0], dtype), add_inputs=True, **p.rank_kw(impl))
    p.check_rows(got, oracle.expand(clean_x[None], [p.b[0]], y0, p.idx, 0, True), p.idx,
                 "add_lora_embedding", y0)


@pytest.mark.parametrize("impl,mode", PARAMS)
def test_poison_add_lora_logits(impl, mode):
    """Sampler-routed rows; B is wider than y and its cut-off columns are NaN in every slot."""
    p = Poisoned(23, impl.dtypes[0], mode, slices=(40,))
    case, dtype = p.case, p.dtype
    w = impl.wrapper(case.num_tokens + 5, 16, case.num_slots)
    w.update_metadata(case.mapping(prompt_idx=PROMPT_IDX), case.lora_index_to_id, case.num_slots + 1, 32, 0)
    vocab = 33
    x = round_to(case.rng.standard_normal((len(PROMPT_IDX), case.hidden)), dtype)
    y0 = round_to(case.rng.standard_normal((len(PROMPT_IDX), vocab)), dtype)
    pb = p.pb[0].copy()
    pb[:, :, vocab:] = np.nan
    got = impl.wrapper_call(w, "add_lora_logits", impl.arr(y0, dtype), impl.arr(x, dtype),
                            impl.arr(p.pa[0], dtype), impl.arr(pb, dtype), case.scale, **p.rank_kw(impl))
    want = oracle.logits(y0, x, p.a[0], p.b[0], case.scale, PROMPT_IDX)
    p.check_rows(got, want, PROMPT_IDX, "add_lora_logits", y0)


# ----------------------------------------------------------------------------- ops

@pytest.mark.parametrize("impl,mode", PARAMS)
def test_poison_ops(impl, mode):
    """lora_shrink / lora_expand, BGMV and SGMV with the same poison."""
    p = Poisoned(24, impl.dtypes[0], mode)
    case, dtype = p.case, p.dtype
    lr = p.lora_ranks(impl)
    got = impl.lora_shrink(impl.arr(case.x, dtype), case.native(impl, p.pa), p.idx, case.scale,
                           case.num_slots, lora_ranks=lr)
    want_buf = oracle.shrink(case.x, p.a, p.idx, case.scale)
    p.check_rows(got, want_buf, p.idx, "lora_shrink")
    y0 = case.y.copy()
    got = impl.lora_expand(impl.arr(p.dirty_buffer(want_buf, p.idx), "float32"), case.native(impl, p.pb),
                           impl.arr(y0, dtype), p.idx, 2, True, case.num_slots, lora_ranks=lr)
    p.check_rows(got, oracle.expand(want_buf, p.b, y0, p.idx, 2, True), p.idx, "lora_expand", y0)

    # BGMV on slice 0 (per-token indices), SGMV over prefill segments of the same tokens.
    a, b, pa, pb = p.a[0], p.b[0], p.pa[0], p.pb[0]
    kw = p.rank_kw(impl)
    got = impl.call_op("bgmv_shrink", impl.arr(case.x, dtype), impl.arr(pa, dtype), impl.idx(p.idx),
                       case.scale, **kw)
    buf = oracle.shrink(case.x, [a], p.idx, case.scale)
    p.check_rows(got[None], buf, p.idx, "bgmv_shrink")
    xb = p.dirty_buffer(buf, p.idx)[0]
    y0 = case.y.copy()
    got = impl.call_op("bgmv_expand", impl.arr(xb, "float32"), impl.arr(pb, dtype), impl.arr(y0, dtype),
                       impl.idx(p.idx), True, **kw)
    p.check_rows(got, oracle.expand(buf, [b], y0, p.idx, 0, True), p.idx, "bgmv_expand", y0)
    y0 = case.y.copy()
    got = impl.call_op("bgmv_expand_slice", impl.arr(xb, "float32"), impl.arr(pb, dtype), impl.arr(y0, dtype),
                       impl.idx(p.idx), 5, b.shape[2], False, **kw)
    p.check_rows(got, oracle.expand(buf, [b], y0, p.idx, 5, False), p.idx, "bgmv_expand_slice", y0)

    w = impl.wrapper(case.num_tokens + 5, 16, case.num_slots)
    w.update_metadata(case.mapping(is_prefill=True), case.lora_index_to_id, case.num_slots + 1, 32, 0)
    meta = w.prefill_metadata
    got = impl.call_op("sgmv_shrink", impl.arr(case.x, dtype), impl.arr(pa, dtype), *meta, case.scale, **kw)
    p.check_rows(got[None], buf, p.idx, "sgmv_shrink")
    y0 = case.y.copy()
    got = impl.call_op("sgmv_expand", impl.arr(xb, "float32"), impl.arr(pb, dtype), impl.arr(y0, dtype),
                       *meta, True, **kw)
    p.check_rows(got, oracle.expand(buf, [b], y0, p.idx, 0, True), p.idx, "sgmv_expand", y0)
