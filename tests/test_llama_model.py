"""The Flax Llama (jax_lora.models) as a user loads it: a Hugging Face-format checkpoint round trip
(load_llama / save_llama give the same weights), token ids and sample indices out of range refused on
the host and clamped under jit, and `add_lora` / `replace_lora_layers` refusing target names that
match nothing or are given as a string. CPU, xla backend; the checkpoint is tests/llama_checkpoint.py's.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest
from flax import nnx

from jax_lora import nn as lnn
from jax_lora.models import add_lora, load_llama, save_llama

from . import jax_helpers, llama_checkpoint


@pytest.fixture(scope="module")
def llama_dirs(tmp_path_factory):
    """A tiny random Llama checkpoint and three PEFT adapters (tests/llama_checkpoint.py): directory per key."""
    return llama_checkpoint.write_assets(tmp_path_factory.mktemp("llama_checkpoint"))


def test_llama_checkpoint_round_trip_and_host_range_checks(llama_dirs, tmp_path):
    """load_llama / save_llama round-trip a Hugging Face-format checkpoint (same
    logits); token ids outside [0, vocab) and sample_idx outside [0, S) held on the host are
    refused naming the argument, and clamped (finite logits, no NaN) under jax.jit."""
    model = load_llama(llama_dirs["model"])
    save_llama(model, str(tmp_path / "again"))
    again = load_llama(str(tmp_path / "again"))
    for a, b in zip(jax.tree.leaves(nnx.state(model)), jax.tree.leaves(nnx.state(again))):
        np.testing.assert_array_equal(a, b)
    tok, pos = np.array([[1, 5, 9]], np.int32), np.arange(3, dtype=np.int32)[None]
    with pytest.raises(ValueError, match="tokens"):
        model(np.array([[1, 64]], np.int32), pos[:, :2])
    with pytest.raises(ValueError, match="sample_idx"):
        model(tok, pos, sample_idx=np.array([3], np.int32))
    tokens = np.array([1, 999, 3] + [0] * (llama_checkpoint.ORACLE_LEN - 3), np.int32)
    logits = llama_checkpoint.merged_logits(llama_dirs, None, tokens)         # jitted: the id 999 is clamped, not NaN
    assert np.all(np.isfinite(logits))
    np.testing.assert_array_equal(logits, llama_checkpoint.merged_logits(llama_dirs, None, np.where(tokens == 999, 63,
                                                                                                    tokens)))


def test_add_lora_and_replace_lora_layers_refuse_typos(llama_dirs):
    """add_lora(target_modules="q_proj") (a string) is a TypeError, not read letter by
    letter; unknown names are a ValueError; replace_lora_layers raises when nothing matches, and
    replaces a list-named layer (last path part) and an lm_head (as MultiLoRALogits) in place."""
    model = load_llama(llama_dirs["model"])
    with pytest.raises(TypeError):
        add_lora(model, max_loras=2, max_rank=4, target_modules="q_proj")
    with pytest.raises(ValueError, match="qproj"):
        add_lora(model, max_loras=2, max_rank=4, target_modules=["qproj"])

    class Tiny(nnx.Module):
        def __init__(self):
            self.proj = nnx.Linear(8, 8, rngs=nnx.Rngs(0))
            self.lm_head = nnx.Linear(8, 16, rngs=nnx.Rngs(1))

    tiny = Tiny()
    with pytest.raises(ValueError):
        lnn.replace_lora_layers(tiny, ["porj"], max_loras=2, max_rank=2)
    new = lnn.replace_lora_layers(tiny, ["proj", "lm_head"], max_loras=2, max_rank=2)
    assert set(new) == {"proj", "lm_head"}
    assert isinstance(tiny.proj, lnn.MultiLoRALinear) and isinstance(tiny.lm_head, lnn.MultiLoRALogits)
    x = jax_helpers.rand(3, 8)
    np.testing.assert_array_equal(tiny.proj(x), tiny.proj.base(x))          # no wrapper: base only
