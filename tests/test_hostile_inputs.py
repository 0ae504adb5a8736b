"""Hostile inputs (SPEC section 6): values a conversion used to change in silence, and arguments whose
error named nothing, get a ValueError/TypeError naming the argument, what was expected and what was
received, at the public boundary of both sides. Also: the torch wrapper's cached plan follows a
weight whose storage is swapped (`.data =`, `set_`)."""

from __future__ import annotations

import numpy as np
import pytest

from lora_core.host_mapping import LoRAMapping

from . import oracle
from .impls import IMPLS

SIDES = {}
for _impl in IMPLS:
    SIDES.setdefault(_impl.side, _impl)  # the reference entry of each side
SIDE_PARAMS = [pytest.param(impl, id=impl.side) for impl in SIDES.values()]

BIG = 2 ** 32 + 1       # int64; cut to int32 it would be slot 1
HUGE_ID = 2 ** 70       # beyond int64
F32 = r"\('float16', 'bfloat16', 'float32'\)"


def host(impl, a):
    """A host array as the side's user would pass it: NumPy for JAX (converted by the library, which
    is where a silent narrowing would happen), a CPU tensor of the same dtype for torch."""
    a = np.asarray(a)
    if impl.side == "jax":
        return a
    import torch
    return torch.from_numpy(a.copy())


def setup(impl, slices=(8, 4), rank=4, hidden=16, slots=3, num_tokens=4):
    rng = np.random.default_rng(0)
    w = impl.wrapper(8, 4, slots)
    w.update_metadata(LoRAMapping((11, 0, 13, 12)[:num_tokens], (11,)), [11, 12, 13][:slots], slots + 1, 32, 0)
    f = lambda *s: impl.arr(rng.standard_normal(s).astype(np.float32), "float32")  # noqa: E731
    x = f(num_tokens, hidden)
    a = [f(slots, 1, rank, hidden) for _ in slices]
    b = [f(slots, 1, n, rank) for n in slices]
    y = f(num_tokens, sum(slices))
    return w, x, a, b, y, f


# ----------------------------------------------------------------------------- 64-bit integers


@pytest.mark.parametrize("impl", SIDE_PARAMS)
def test_compute_meta_refuses_int64_beyond_int32(impl):
    with pytest.raises(ValueError, match=r"token_lora_tensor holds 4294967297, outside the int32 range.*wrap it to 1"):
        impl.pkg.compute_meta(host(impl, np.array([BIG, BIG, 0], np.int64)))


# ----------------------------------------------------------------------------- LoRA ids

@pytest.mark.parametrize("impl", SIDE_PARAMS)
def test_lora_id_beyond_int64(impl):
    w = impl.wrapper(8, 4, 3)
    with pytest.raises(ValueError, match=rf"LoRA id {HUGE_ID} \(mapping.index_mapping\[1\]\) is outside the int64 range"):
        w.update_metadata(LoRAMapping((11, HUGE_ID), (11,)), [11, 12, 13], 4, 32, 0)
    with pytest.raises(ValueError, match=rf"LoRA id {HUGE_ID} \(mapping.prompt_mapping\[0\]\)"):
        impl.pkg.convert_mapping(LoRAMapping((11,), (HUGE_ID,)), [11], 2, 32, 0)
    with pytest.raises(ValueError, match=rf"lora_index_to_id\[1\] must be None or a positive LoRA id <= 2\*\*63 - 1, "
                                         rf"got {HUGE_ID}"):
        w.update_metadata(LoRAMapping((11,), (11,)), [11, HUGE_ID, 13], 4, 32, 0)
    with pytest.raises(TypeError, match=r"LoRAMapping.index_mapping must hold integer LoRA ids, got 'a'"):
        LoRAMapping([1, HUGE_ID, "a"], [])


@pytest.mark.parametrize("impl", SIDE_PARAMS)
def test_lora_index_to_id_none(impl):
    w = impl.wrapper(8, 4, 3)
    with pytest.raises(TypeError, match=r"lora_index_to_id must be a sequence with one entry per slot .*got None"):
        w.update_metadata(LoRAMapping((11,), (11,)), None, 4, 32, 0)
    with pytest.raises(TypeError, match=r"lora_index_to_id must be a sequence .*got int"):
        impl.pkg.convert_mapping(LoRAMapping((11,), (11,)), 11, 2, 32, 0)
