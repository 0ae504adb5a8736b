"""Several adapters per request in whole models: equal to merging the weighted deltas into the base.

torch: `MultiLoRAModel` on a tiny random transformers Llama (float32, CPU) with two PEFT adapters;
a batch whose rows name two adapters with weights, one adapter with a strength, the base, and one
adapter alone must give, row by row, the logits of the base model whose weights are
W + sum_i w_i * delta_i (delta_i = peft's own `get_delta_weight` of adapter i), in a forward pass
and through generate(). JAX: the serving engine's `Request(lora_ids=..., lora_weights=...)` on
the tiny Llama of jax_lora.models.llama against the same model with merged weights.
"""

from __future__ import annotations

import numpy as np
import pytest

from . import hf_llama

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from torch_lora.hf import MultiLoRAModel  # noqa: E402

RTOL = 1e-4
TARGETS = {"x": dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"]),
           "y": dict(r=8, lora_alpha=4, target_modules=hf_llama.ALL7, rank_pattern={"o_proj": 2})}


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    root = tmp_path_factory.mktemp("multi")
    state = hf_llama.tiny_llama().state_dict()

    def fresh():
        m = hf_llama.tiny_llama()
        m.load_state_dict(state)
        return m
    dirs = {name: hf_llama.save_peft(fresh, root / name, 10 + i, **kw) for i, (name, kw) in enumerate(TARGETS.items())}
    return fresh, dirs


def _deltas(fresh, dirs) -> dict:
    """{adapter: {module path: delta W (out, in)}}, from peft's own get_delta_weight."""
    out = {}
    for name, path in dirs.items():
        pm = peft.PeftModel.from_pretrained(fresh(), path, adapter_name=name).eval()
        out[name] = {mod_name.removeprefix("base_model.model."): module.get_delta_weight(name).detach().clone()
                     for mod_name, module in pm.named_modules()
                     if hasattr(module, "get_delta_weight") and name in getattr(module, "lora_A", {})}
    return out


def _merged(fresh, deltas, names_weights) -> torch.nn.Module:
    """The base model with W += sum_i w_i * delta_i."""
    model = fresh()
    modules = dict(model.named_modules())
    with torch.no_grad():
        for name, w in names_weights:
            for path, delta in deltas[name].items():
                modules[path].weight += w * delta
    return model


ROWS = [(["x", "y"], [0.7, -0.4]), ("x", 1.5), ("__base__", 1.0), (["y"], [0.5]), (["y", "x"], [1.0, 1.0])]


def _row_weights(row):
    names, weights = row
    if isinstance(names, str):
        return [] if names == "__base__" else [(names, weights)]
    return list(zip(names, weights))


def test_forward_equals_merged_weights(assets):
    fresh, dirs = assets
    deltas = _deltas(fresh, dirs)
    mm = MultiLoRAModel(fresh(), max_loras=2, max_rank=8)
    for name, path in dirs.items():
        mm.load_adapter(name, path)
    tokens = torch.as_tensor(np.random.default_rng(3).integers(1, 64, size=(len(ROWS), 6)))
    out = mm(tokens, adapter_names=[r[0] for r in ROWS], adapter_weights=[r[1] for r in ROWS]).logits.numpy()
    base = fresh()(tokens).logits.detach().numpy()
    for j, row in enumerate(ROWS):
        with torch.no_grad():
            want = _merged(fresh, deltas, _row_weights(row))(tokens[j:j + 1]).logits[0].numpy()
        err = np.abs(out[j] - want).max() / max(1.0, np.abs(want).max())
        assert err < RTOL, (j, row, err)
        if _row_weights(row):
            assert np.abs(want - base[j]).max() > 1e-3, row       # the adapters matter


def test_generate_equals_merged_weights(assets):
    fresh, dirs = assets
    deltas = _deltas(fresh, dirs)
    mm = MultiLoRAModel(fresh(), max_loras=2, max_rank=8)
    for name, path in dirs.items():
        mm.load_adapter(name, path)
    prompts = torch.as_tensor(np.random.default_rng(4).integers(1, 64, size=(2, 5)))
    rows = [ROWS[0], ROWS[1]]
    got = mm.generate(prompts, adapter_names=[r[0] for r in rows], adapter_weights=[r[1] for r in rows],
                      max_new_tokens=4, do_sample=False, pad_token_id=0)
    for j, row in enumerate(rows):
        want = _merged(fresh, deltas, _row_weights(row)).generate(prompts[j:j + 1], max_new_tokens=4,
                                                                   do_sample=False, pad_token_id=0)
        np.testing.assert_array_equal(got[j].numpy(), want[0].numpy())


def test_bad_weights_and_single_adapter_layers(assets):
    fresh, dirs = assets
    mm = MultiLoRAModel(fresh(), max_loras=2, max_rank=8)
    mm.load_adapter("x", dirs["x"])
    tokens = torch.ones(2, 3, dtype=torch.long)
    with pytest.raises(ValueError, match=r"adapter_weights\[0\] has 1 weights for 2 adapters"):
        mm(tokens, adapter_names=[["x", "x"], "x"], adapter_weights=[[1.0], 1.0])
    with pytest.raises(ValueError, match="one entry per row"):
        mm(tokens, adapter_names=["x", "x"], adapter_weights=[1.0])
    with pytest.raises(ValueError, match="not a loaded adapter"):
        mm(tokens, adapter_names=[["x", "nope"], "x"])
    head = MultiLoRAModel(fresh(), max_loras=2, max_rank=8, target_modules=hf_llama.ALL7 + ["lm_head"])
    head.load_adapter("x", dirs["x"])
    with pytest.raises(ValueError, match="serve linear layers only"):
        head(tokens, adapter_names=[["x"], "x"], adapter_weights=[[0.5], 1.0])
