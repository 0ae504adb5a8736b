"""The contract's worked examples as exact tests, on both sides: convert_mapping, the prefill
segments, the kernel metadata and the prompt-mapping padding. CPU only.
"""

from __future__ import annotations

import numpy as np
import pytest

from lora_core.host_mapping import LongContextLoRAContext, LoRAMapping, pad_prompt_mapping

from .impls import IMPLS

SIDES = {}
for _impl in IMPLS:
    SIDES.setdefault(_impl.side, _impl)
SIDE_PARAMS = [pytest.param(impl, id=impl.side) for impl in SIDES.values()]


def ints(impl, a):
    return None if a is None else np.asarray(impl.to_np(a)).astype(np.int64).tolist()


@pytest.mark.parametrize("impl", SIDE_PARAMS)
def test_convert_mapping_example(impl):
    # Slots: 0 -> id 5, 1 -> empty, 2 -> id 9. vLLM passes max_loras = slots + 1 = 4.
    mapping = LoRAMapping(index_mapping=(5, 5, 0, 9), prompt_mapping=(5, 0, 9))
    base, sampler, padded, emb, long_lora, lens = impl.pkg.convert_mapping(
        mapping, [5, None, 9], 4, 32000, 256, LongContextLoRAContext({9: 4096}))
    assert ints(impl, base) == [0, 0, -1, 2]
    assert ints(impl, sampler) == [0, -1, 2]
    # j + p_j * n with n = 3 and -1 -> max_loras - 1 = 3: [0 + 0, 1 + 9, 2 + 6]
    assert ints(impl, padded) == [0, 10, 8]
    # e = [0, 0, 0, 2]: row 0 = e * 256, row 1 = e * (32000 + 256)
    assert ints(impl, emb) == [[0, 0, 0, 512], [0, 0, 0, 64512]]
    assert ints(impl, long_lora) == [0, 0, 0, 4096]
    assert lens == [4, 3, 3, 4, 4]


@pytest.mark.parametrize("impl", SIDE_PARAMS)
def test_compute_meta_example(impl):
    starts, lengths, loras, batch, max_len, tokens, no_lora = impl.pkg.compute_meta(impl.idx([2, 2, -1, 0, 0, 0]))
    assert (ints(impl, starts), ints(impl, lengths), ints(impl, loras)) == ([0, 2, 3], [2, 1, 3], [2, -1, 0])
    assert (batch, max_len, tokens, no_lora) == (3, 3, 6, False)
    assert impl.pkg.compute_meta(impl.idx([-1, -1]))[6] is True


@pytest.mark.parametrize("impl", SIDE_PARAMS)
def test_kernel_meta_example(impl):
    # vLLM's running example: 3 slots, tokens of no-LoRA (3), slot 0 (10), slot 2 (5), slot 1 (2).
    idx = [-1] * 3 + [0] * 10 + [2] * 5 + [1] * 2
    rng = np.random.default_rng(0)
    perm = rng.permutation(len(idx))
    idx = [idx[p] for p in perm]
    meta = impl.meta(np.array(idx), 3, capacity=32)
    mapping, order, num, start, active, no_lora = (ints(impl, a) for a in meta.meta_args(len(idx)))
    assert active == [-1, 0, 1, 2]          # ascending, -1 first
    assert num == [3, 10, 2, 5]
    assert start == [0, 3, 13, 15, 20]
    assert order == sorted(range(20), key=lambda t: (idx[t], t))  # stable
    assert np.asarray(no_lora).reshape(-1).tolist() == [0]


def test_prompt_padding_example():
    assert pad_prompt_mapping((3, 0, 7)) == (3, 0, 7, -1, -1, -1, -1, -1)
    assert len(pad_prompt_mapping(tuple(range(1, 10)))) == 16
    assert len(pad_prompt_mapping(tuple(range(1, 71)), capacity=100)) == 100
