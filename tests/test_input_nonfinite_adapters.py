"""Through jax_lora.AdapterManager: one slot with NaN in its weights poisons only its own rows.

The manager puts every active adapter into a slot of the same stacked weights; the reference
backend selects each row's slot (no one-hot matmul over all slots), so a NaN in one adapter's
lora_B stays in the rows that use it. The manager refuses adapters with non-finite weights, so the
NaN is written into a loaded slot.

CPU, xla backend.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from flax import nnx

from jax_lora import LoRAMapping, PunicaWrapper
from jax_lora import nn as lnn
from jax_lora.adapters import (
    AdapterManager,
    load_peft_adapter,
    merge_adapter,
)
from jax_lora.models import LlamaForCausalLM

from .test_adapters import CFG, V, _model, _write

TARGETS = ("q_proj", "v_proj", "down_proj", "embed_tokens", "lm_head")
SEQ = 6


def _poison_slot(model, slot):
    """NaN (and an Inf) in `slot` of every LoRA layer's lora_B (slot axis 0, then rows, rank)."""
    for i, layer in enumerate(lnn.lora_layers(model).values()):
        b = layer.lora_b.get_value()
        b = b.at[slot, 1, 0].set(jnp.nan).at[slot, -1, 0].set(jnp.inf if i % 2 else jnp.nan)
        layer.lora_b.set_value(b)


def _run(model, mgr, seq_ids):
    """Logits (B, S, V) for sequences of SEQ tokens, sequence i served with LoRA id seq_ids[i]."""
    tokens = jnp.array([[(7 * i + 3 * j) % V for j in range(SEQ)] for i in range(len(seq_ids))], jnp.int32)
    pos = jnp.broadcast_to(jnp.arange(SEQ)[None], tokens.shape)
    per_token = tuple(i for i in seq_ids for _ in range(SEQ))
    w = PunicaWrapper(32, 16, None, max_loras=mgr.num_slots)
    w.update_metadata(LoRAMapping(per_token, per_token), mgr.lora_index_to_id, mgr.num_slots + 1, V)
    with lnn.punica_context(w):
        return np.asarray(model(tokens, pos)[0]), tokens, pos


def test_nan_adapter_poisons_only_its_own_rows(tmp_path):
    """The poisoned adapter sits in slot 0, the slot whose embedding rows no-LoRA tokens look up."""
    good_path, _ = _write(tmp_path, "good", 4, targets=TARGETS, seed=5)
    other_path, _ = _write(tmp_path, "other", 4, targets=TARGETS, seed=6)
    model = _model(slots=3, rank=8)
    mgr = AdapterManager(model)
    mgr.register(1, good_path)
    mgr.register(2, other_path)
    mgr.activate([2, 1])
    assert mgr.slot_of(2) == 0
    _poison_slot(model, 0)

    base = LlamaForCausalLM(CFG, rngs=nnx.Rngs(0))
    merged = merge_adapter(base, load_peft_adapter(good_path))

    # A batch that does not use the poisoned adapter: adapter 1 and no adapter.
    got, tokens, pos = _run(model, mgr, (1, 0, 0))
    assert np.all(np.isfinite(got)), "a NaN adapter in another slot reached this batch"
    want_good = np.asarray(merged(tokens, pos)[0])[0]
    want_base = np.asarray(base(tokens, pos)[0])[1:]
    scale = np.abs(want_good).max()
    assert np.abs(got[0] - want_good).max() < 1e-4 * scale
    assert np.abs(got[1:] - want_base).max() < 1e-4 * np.abs(want_base).max()
    assert np.abs(want_good - np.asarray(base(tokens, pos)[0])[0]).max() > 1e-2   # the adapter acts

    # The same tokens with the last sequence on the poisoned adapter: its rows are non-finite,
    # the others unchanged.
    got2, _, _ = _run(model, mgr, (1, 0, 2))
    np.testing.assert_allclose(got2[:2], got[:2], rtol=1e-5, atol=1e-5 * scale)
    assert not np.all(np.isfinite(got2[2])), "the poisoned adapter's own rows must show its NaN"
