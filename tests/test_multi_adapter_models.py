"""Several adapters per request in whole models: equal to merging the weighted deltas into the base.

torch: `MultiLoRAModel` on a tiny random transformers Llama (float32, CPU) with three PEFT
adapters; a batch whose rows name two or three adapters with weights (one of them on the embedding
and the LM head too), one adapter with a strength, the base, and one adapter alone must give, row
by row, the logits of the base model whose weights are W + sum_i w_i * delta_i (delta_i: peft's
own `get_delta_weight` of adapter i), in a forward pass and through generate(). JAX: the serving
engine's `Request(lora_ids=..., lora_weights=...)` on the demo's tiny Llama against the same model
with the weighted deltas merged (`merge_adapter` with scaled scalings), teacher-forced.
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
           "y": dict(r=8, lora_alpha=4, target_modules=hf_llama.ALL7, rank_pattern={"o_proj": 2}),
           "z": dict(r=4, lora_alpha=4, target_modules=["embed_tokens", "lm_head", "up_proj"])}
EVERY = hf_llama.ALL7 + ["embed_tokens", "lm_head"]


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
                     if hasattr(module, "get_delta_weight")
                     and (name in getattr(module, "lora_A", {}) or name in getattr(module, "lora_embedding_A", {}))}
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


ROWS = [(["x", "y"], [0.7, -0.4]), ("x", 1.5), ("__base__", 1.0), (["y"], [0.5]), (["y", "x"], [1.0, 1.0]),
        (["z", "x", "y"], [0.8, 0.5, -1.2])]


def _row_weights(row):
    names, weights = row
    if isinstance(names, str):
        return [] if names == "__base__" else [(names, weights)]
    return list(zip(names, weights))


def test_forward_equals_merged_weights(assets):
    fresh, dirs = assets
    deltas = _deltas(fresh, dirs)
    mm = MultiLoRAModel(fresh(), max_loras=3, max_rank=8, target_modules=EVERY)
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
    mm = MultiLoRAModel(fresh(), max_loras=3, max_rank=8, target_modules=EVERY)
    for name, path in dirs.items():
        mm.load_adapter(name, path)
    prompts = torch.as_tensor(np.random.default_rng(4).integers(1, 64, size=(3, 5)))
    rows = [ROWS[0], ROWS[1], ROWS[5]]
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


# ----------------------------------------------------------------------------- JAX serving engine

def test_serving_requests_with_several_adapters_equal_merged_weights(tmp_path):
    """Requests naming two adapters with weights, one adapter with a strength, one plain adapter and
    the base in one generate call: each completion's logits equal the model with the weighted
    deltas merged (teacher-forced, float32)."""
    import dataclasses

    import jax
    import jax.numpy as jnp
    from flax import nnx

    from jax_lora.adapters import AdapterManager, load_peft_adapter, merge_adapter
    from jax_lora.cli import build_demo_assets
    from jax_lora.models import add_lora, load_llama
    from jax_lora.serving import Request, ServingEngine

    max_len = 32
    model_dir, dirs = build_demo_assets(str(tmp_path), seed=5)
    model = load_llama(model_dir)
    add_lora(model, max_loras=3, max_rank=16)
    mgr = AdapterManager(model, host_cache_size=2)
    for i, d in enumerate(dirs):
        mgr.register(i + 1, d)
    engine = ServingEngine(model, mgr, max_seqs=4, max_len=max_len, keep_logits=True)
    rng = np.random.default_rng(6)
    prompts = [[int(t) for t in rng.integers(0, 512, size=n)] for n in (5, 9, 4, 7)]
    reqs = [Request(prompts[0], lora_ids=[1, 2], lora_weights=[0.6, -0.8], max_new_tokens=4),
            Request(prompts[1], lora_id=3, lora_weights=1.7, max_new_tokens=3),
            Request(prompts[2], lora_id=2, max_new_tokens=3),
            Request(prompts[3], max_new_tokens=2)]
    combos = [[(1, 0.6), (2, -0.8)], [(3, 1.7)], [(2, 1.0)], []]
    out = engine.generate(reqs)

    base = load_llama(model_dir)
    adapters = {i + 1: load_peft_adapter(d) for i, d in enumerate(dirs)}

    def weighted(adapter, w):
        return dataclasses.replace(adapter, modules={m: mod._replace(scaling=mod.scaling * w)
                                                     for m, mod in adapter.modules.items()})
    graphdef, _ = nnx.split(base)

    @jax.jit
    def forward(state, tokens):
        pos = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
        return nnx.merge(graphdef, state)(tokens, pos)[0]

    base_logits = None
    for c, combo in zip(out, combos):
        merged = base
        for lora_id, w in combo:
            merged = merge_adapter(merged, weighted(adapters[lora_id], w))
        seq = np.zeros((1, max_len), np.int32)
        full = list(c.prompt) + list(c.tokens[:-1])
        seq[0, :len(full)] = full
        n = len(c.prompt)
        want = np.asarray(forward(nnx.state(merged), jnp.asarray(seq)))[0, n - 1:len(full)]
        err = float(np.abs(want - np.asarray(c.logits)).max() / max(1.0, float(np.abs(want).max())))
        assert err < RTOL, (combo, err)
        assert list(np.asarray(want).argmax(-1)) == c.tokens, combo
        if combo:
            base_logits = np.asarray(forward(nnx.state(base), jnp.asarray(seq)))[0, n - 1:len(full)]
            assert np.abs(base_logits - want).max() > 1e-3, combo          # the adapters matter
    with pytest.raises(ValueError, match="lora_id or lora_ids, not both"):
        engine.generate([Request(prompts[0], lora_id=1, lora_ids=[2])])
    with pytest.raises(ValueError, match="one weight per id"):
        engine.generate([Request(prompts[0], lora_ids=[1, 2], lora_weights=[0.5])])


# ----------------------------------------------------------------------------- beside activated LoRA

def test_alora_with_a_weight_keeps_its_invocation_and_refuses_company(tmp_path):
    """An aLoRA adapter with a strength (the paired path) applies from its invocation on: at weight 1
    the same logits as the plain aLoRA request, on both sides; in a row / request of several
    adapters it is refused by name."""
    from .test_alora import ADAPTERS, INVOCATION, NAMES, _prompt
    from .test_peft_roundtrip import build_peft_models
    root, dirs, _ = build_peft_models(tmp_path, ADAPTERS)
    rng = np.random.default_rng(8)
    prompts = [_prompt(rng, 9, [3]), _prompt(rng, 7, [2]), _prompt(rng, 8, [])]
    # torch: one padded batch, rows aLoRA / plain / aLoRA without invocation
    model = transformers.LlamaForCausalLM.from_pretrained(str(root / "base")).eval()
    mm = MultiLoRAModel(model, max_loras=2, max_rank=8)
    for lora_id, d in dirs.items():
        mm.load_adapter(NAMES[lora_id], d)
    tokens = torch.as_tensor([p + [p[-1]] * (9 - len(p)) for p in prompts])
    names = [NAMES[1], NAMES[2], NAMES[1]]
    plain = mm(tokens, adapter_names=names).logits.numpy()
    weighted = mm(tokens, adapter_names=names, adapter_weights=[1.0, 1.0, 1.0]).logits.numpy()
    np.testing.assert_allclose(weighted, plain, rtol=1e-5, atol=1e-5)
    half = mm(tokens, adapter_names=names, adapter_weights=[0.5, 1.0, 1.0]).logits.numpy()
    start = 3                                                      # the invocation's first token in row 0
    np.testing.assert_allclose(half[0, :start], plain[0, :start], rtol=1e-5, atol=1e-5)    # base before it
    assert np.abs(half[0, start + len(INVOCATION):] - plain[0, start + len(INVOCATION):]).max() > 1e-4
    with pytest.raises(ValueError, match="activated LoRA"):
        mm(tokens, adapter_names=[[NAMES[1], NAMES[2]], NAMES[2], NAMES[2]])
    # JAX: the serving engine
    from jax_lora.adapters import AdapterManager
    from jax_lora.models import add_lora, load_llama
    from jax_lora.serving import Request, ServingEngine
    jmodel = load_llama(str(root / "base"))
    add_lora(jmodel, max_loras=2, max_rank=8)
    mgr = AdapterManager(jmodel)
    for lora_id, d in dirs.items():
        mgr.register(lora_id, d)
    engine = ServingEngine(jmodel, mgr, max_seqs=4, max_len=32, keep_logits=True)
    base = engine.generate([Request(p, lora_id=i, max_new_tokens=3) for p, i in zip(prompts, (1, 2, 1))])
    paired = engine.generate([Request(p, lora_id=i, lora_weights=1.0, max_new_tokens=3)
                              for p, i in zip(prompts, (1, 2, 1))])
    for a, b in zip(base, paired):
        assert a.tokens == b.tokens
        np.testing.assert_allclose(b.logits, a.logits, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="activated LoRA"):
        engine.generate([Request(prompts[0], lora_ids=[1, 2])])
