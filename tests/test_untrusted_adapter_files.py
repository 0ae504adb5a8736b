"""Adapter files as untrusted input: what a hostile adapter directory cannot do.

Covers, on both managers (JAX `jax_lora.adapters.AdapterManager`, torch `torch_lora.adapters.AdapterManager`)
and on the framework-free reader (`lora_core.peft`):
- deep JSON (adapter_config.json, safetensors headers, launch tables): an AdapterError / ValueError naming
  the file, never a RecursionError;
- sparse files whose header declares huge tensors: refused from the header, against the model's shapes,
  before any tensor data is read or allocated; a total-bytes limit per adapter, and its override;
- huge integers (r, pattern ranks, shape dims) refused by name;
- regular expressions from the config compiled under a guard (nested quantifiers refused, the common PEFT
  patterns accepted, every match fast);
- a failed load leaves the manager as it was;
- the registered-files stamp taken before the read; a PeftAdapter copied at register.
"""

from __future__ import annotations

import json
import os
import struct
import time

import numpy as np
import pytest

from lora_core import safe_json
from lora_core.peft import CONFIG_NAME, WEIGHTS_NAME, AdapterError, load_peft_adapter, save_peft_adapter

H, Q, KV, V = 16, 16, 8, 32
QMOD = "model.layers.0.self_attn.q_proj"
VMOD = "model.layers.0.self_attn.v_proj"


def _config(path, **fields):
    cfg = {"peft_type": "LORA", "r": 2, "lora_alpha": 4, "target_modules": ["q_proj", "v_proj"]}
    cfg.update(fields)
    with open(os.path.join(path, CONFIG_NAME), "w") as f:
        json.dump(cfg, f)


def _good(tmp_path, name="good", r=2, seed=0, scale=1.0, **config):
    """A small valid adapter on q_proj and v_proj of a one-block Llama-shaped model."""
    rng = np.random.default_rng(seed)
    path = str(tmp_path / name)
    save_peft_adapter(path, {QMOD: (rng.normal(size=(r, H)) * scale, rng.normal(size=(Q, r)) * scale),
                             VMOD: (rng.normal(size=(r, H)) * scale, rng.normal(size=(KV, r)) * scale)},
                      r=r, lora_alpha=2 * r)
    if config:
        with open(os.path.join(path, CONFIG_NAME)) as f:
            cfg = json.load(f)
        cfg.update(config)
        with open(os.path.join(path, CONFIG_NAME), "w") as f:
            json.dump(cfg, f)
    return path


def _raw_safetensors(path, header: dict, data_bytes: int, sparse: bool = True):
    """A safetensors file with `header` and `data_bytes` of data; sparse (a hole, no disk used)."""
    text = json.dumps(header).encode()
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        if sparse:
            f.truncate(8 + len(text) + data_bytes)
        else:
            f.write(b"\0" * data_bytes)


def _entry(shape, begin, dtype="F32"):
    size = int(np.prod(shape)) * {"F32": 4, "F16": 2}[dtype]
    return {"dtype": dtype, "shape": list(shape), "data_offsets": [begin, begin + size]}, begin + size


# ----------------------------------------------------------------------------- deep JSON

def test_deeply_nested_adapter_config_names_the_file(tmp_path):
    path = _good(tmp_path)
    with open(os.path.join(path, CONFIG_NAME), "w") as f:
        f.write('{"r": 2, "x": ' + "[" * 200_000 + "]" * 200_000 + "}")
    with pytest.raises(AdapterError, match=rf"{CONFIG_NAME}: JSON nested more than 64 levels"):
        load_peft_adapter(path)


def test_deeply_nested_safetensors_header_names_the_file(tmp_path):
    path = _good(tmp_path)
    text = b'{"__metadata__": ' + b"[" * 200_000 + b"]" * 200_000 + b"}"
    with open(os.path.join(path, WEIGHTS_NAME), "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text)
    with pytest.raises(AdapterError, match=rf"{WEIGHTS_NAME}: JSON nested more than 64 levels"):
        load_peft_adapter(path)


def test_deeply_nested_launch_table_is_a_value_error(tmp_path):
    from lora_core.kernels import configs
    path = tmp_path / "table.json"
    path.write_text('{"classes": ' + "{" * 200_000 + "}" * 200_000 + "}")
    with pytest.raises(ValueError, match="table.json: JSON nested more than 64 levels"):
        configs._read_table(str(path), "any device")


def test_json_depth_ignores_brackets_in_strings_and_keeps_values():
    text = '{"a": ["[[[[{{{{", {"b": [1, 2]}], "c": "\\"]]]"}'
    assert safe_json.json_depth(text) == 4
    assert safe_json.loads(text, "x") == json.loads(text)


# ----------------------------------------------------------------------------- the two managers

def _jax_manager(slots=2, rank=4, dtype=None, dora=False):
    import jax.numpy as jnp
    from flax import nnx

    from jax_lora.adapters import AdapterManager
    from jax_lora.models import LlamaConfig, LlamaForCausalLM, add_lora
    cfg = LlamaConfig(vocab_size=V, hidden_size=H, intermediate_size=24, num_hidden_layers=1, num_attention_heads=4,
                      num_key_value_heads=2)                       # q 16, k / v 8
    model = LlamaForCausalLM(cfg, dtype=dtype or jnp.float32, rngs=nnx.Rngs(0))
    add_lora(model, max_loras=slots, max_rank=rank, dora=dora)
    return AdapterManager(model)


def _torch_manager(slots=2, rank=4, dtype=None, dora=False):
    import torch

    from torch_lora.adapters import AdapterManager
    from torch_lora.layers import LoRAEmbedding, LoRALinear, LoRALogits
    dtype = dtype or torch.float32
    kw = dict(max_loras=slots, max_rank=rank, dtype=dtype, device="cpu")
    gen = torch.Generator().manual_seed(0)
    base = [torch.randn(n, H, generator=gen, dtype=dtype) for n in (Q, KV, KV)]
    return AdapterManager({
        "qkv": LoRALinear(("model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.k_proj", VMOD), H, (Q, KV, KV),
                          dora=dora, base_weights=base if dora else None, **kw),
        "embed": LoRAEmbedding("model.embed_tokens", V, H, **kw),
        "head": LoRALogits("lm_head", H, V, **kw)})


MANAGERS = {"jax": _jax_manager, "torch": _torch_manager}


def _state(mgr):
    """Everything a failed register / activate must leave as it was: tables, counters and slot data."""
    if hasattr(mgr, "model"):
        slots = [np.asarray(getattr(layer, n).get_value()) for layer, n in mgr._vars]
    else:
        slots = [t.clone().numpy() for layer in mgr.layers.values() for _, t in sorted(layer.named_buffers())]
    return (mgr.registered, mgr.lora_index_to_id, list(mgr._host), dict(mgr.stats), mgr.version), slots


def _assert_same(before, after):
    assert before[0] == after[0]
    assert len(before[1]) == len(after[1])
    for x, y in zip(before[1], after[1]):
        np.testing.assert_array_equal(x, y)


def _sparse_huge_adapter(tmp_path, name, a_shape, b_shape, r):
    """An adapter whose safetensors header declares q_proj factors of the given shapes (GiBs), in a
    sparse file of a few KiB on disk: reading it would allocate the declared size."""
    path = tmp_path / name
    path.mkdir()
    _config(str(path), r=r, target_modules=["q_proj"])
    a, end = _entry(a_shape, 0)
    b, end = _entry(b_shape, end)
    _raw_safetensors(str(path / WEIGHTS_NAME), {f"base_model.model.{QMOD}.lora_A.weight": a,
                                                f"base_model.model.{QMOD}.lora_B.weight": b}, end)
    assert os.stat(path / WEIGHTS_NAME).st_blocks * 512 < 64 * 1024     # nothing real on disk
    return str(path)


@pytest.mark.parametrize("side", MANAGERS)
@pytest.mark.parametrize("case", ["rank", "width"])
def test_sparse_file_declaring_a_gib_tensor_is_refused_from_the_header(tmp_path, side, case):
    """1 GiB lora_A (and B) declared for a 16-wide layer: refused against the model's shapes before any
    data is read; the peak of traced allocations stays far below the declared size."""
    import tracemalloc
    if case == "rank":      # r = 2**24: lora_A (2**24, 16) float32 = 1 GiB
        path = _sparse_huge_adapter(tmp_path, case, (2**24, H), (Q, 2**24), 2**24)
        want = r"rank 16777216 .*exceeds the model's max_rank=4"
    else:                   # rank 2 but lora_A (2, 2**27) float32 = 1 GiB
        path = _sparse_huge_adapter(tmp_path, case, (2, 2**27), (Q, 2), 2)
        want = r"lora_A \(2, 134217728\) / lora_B \(16, 2\) do not fit the module: expected lora_A \(2, 16\)"
    mgr = MANAGERS[side]()
    before = _state(mgr)
    tracemalloc.start()
    try:
        with pytest.raises(AdapterError, match=rf"adapter '1' \({path}\), module '{QMOD}': {want}.* of {WEIGHTS_NAME}"):
            mgr.register(1, path, name="1")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 32 * 2**20, f"{peak} bytes allocated while refusing a header"
    _assert_same(before, _state(mgr))


@pytest.mark.parametrize("side", MANAGERS)
def test_total_bytes_limit_per_adapter_and_its_override(tmp_path, side):
    """max_adapter_bytes (None: the model's largest adapter) bounds the bytes one adapter may read."""
    path = _good(tmp_path)
    mgr = MANAGERS[side]()
    mgr.max_adapter_bytes = 100
    with pytest.raises(AdapterError, match=r"its LoRA tensors hold 448 bytes, more than the limit of 100 bytes per "
                                           r"adapter \(max_total_bytes\); raise it with max_total_bytes="):
        mgr.register(1, path)
    assert mgr.registered == {}
    mgr.max_adapter_bytes = None
    mgr.register(1, path)
    assert mgr.registered == {1: "good"}


def test_total_bytes_limit_without_a_model(tmp_path):
    from lora_core.peft import ModuleShape, largest_adapter_bytes
    path = _good(tmp_path)
    with pytest.raises(AdapterError, match=r"hold 448 bytes, more than the limit of 447 bytes"):
        load_peft_adapter(path, max_total_bytes=447)
    assert load_peft_adapter(path, max_total_bytes=448).modules
    shapes = {QMOD: ModuleShape("linear", H, Q, 4), VMOD: ModuleShape("linear", H, KV, 4)}
    assert largest_adapter_bytes(shapes) == ((4 * (H + Q) + Q) + (4 * (H + KV) + KV)) * 8
    assert load_peft_adapter(path, module_shapes=shapes).modules
    with pytest.raises(ValueError, match="max_total_bytes must be an int >= 1 or None"):
        load_peft_adapter(path, max_total_bytes=0)


# ----------------------------------------------------------------------------- huge integers

@pytest.mark.parametrize("r", [10**400, 2**63, 2**31])
def test_huge_rank_is_refused_by_field(tmp_path, r):
    path = tmp_path / "huge"
    path.mkdir()
    (path / CONFIG_NAME).write_text(f'{{"peft_type": "LORA", "r": {r}, "target_modules": ["q_proj"]}}')
    _raw_safetensors(str(path / WEIGHTS_NAME), {}, 0)
    with pytest.raises(AdapterError, match=rf"{CONFIG_NAME}: field 'r' = .* is more than 2147483647"):
        load_peft_adapter(str(path))


def test_huge_rank_pattern_and_unreadable_integer_are_refused_by_field(tmp_path):
    path = _good(tmp_path, rank_pattern={"q_proj": 2**63})
    with pytest.raises(AdapterError, match=r"field 'rank_pattern': value for 'q_proj' = 9223372036854775808 is more"):
        load_peft_adapter(path)
    with open(os.path.join(path, CONFIG_NAME), "w") as f:
        f.write('{"peft_type": "LORA", "r": ' + "9" * 5000 + "}")
    with pytest.raises(AdapterError, match=rf"{CONFIG_NAME}: a JSON value cannot be read"):
        load_peft_adapter(path)


@pytest.mark.parametrize("dims", [[10**400, 0], [2**63, 0], [0, 2**63]])
def test_huge_shape_dimensions_with_empty_tensors_name_the_tensor(tmp_path, dims):
    """Empty tensors (a zero dimension: no bytes) with a huge other dimension: refused from the header,
    naming the file and the tensor, instead of NumPy's 'Maximum allowed dimension exceeded'."""
    path = tmp_path / "empty"
    path.mkdir()
    _config(str(path), r=2, target_modules=["q_proj"])
    key = f"base_model.model.{QMOD}.lora_A.weight"
    text = json.dumps({key: {"dtype": "F32", "shape": [0, 0], "data_offsets": [0, 0]},
                       f"base_model.model.{QMOD}.lora_B.weight": {"dtype": "F32", "shape": [0, 0],
                                                                  "data_offsets": [0, 0]}})
    text = text.replace("[0, 0], \"data_offsets\"", f"[{dims[0]}, {dims[1]}], \"data_offsets\"", 1)
    with open(path / WEIGHTS_NAME, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text.encode())
    with pytest.raises(AdapterError, match=rf"{WEIGHTS_NAME}: tensor '{key}': shape dimension .* is more than "
                                           "2147483647"):
        load_peft_adapter(str(path))


# ----------------------------------------------------------------------------- JAX refuses what torch refuses

def _fused_adapter(tmp_path, name, with_q: bool):
    """An adapter on the fused name qkv_proj (factors as wide as q_proj's slice), with or without q_proj."""
    rng = np.random.default_rng(1)
    mods = {"model.layers.0.self_attn.qkv_proj": (rng.normal(size=(2, H)), rng.normal(size=(Q, 2)))}
    if with_q:
        mods[QMOD] = (rng.normal(size=(2, H)), rng.normal(size=(Q, 2)))
    path = str(tmp_path / name)
    save_peft_adapter(path, mods, r=2, lora_alpha=4)
    return path


@pytest.mark.parametrize("with_q", [True, False])
def test_fused_module_name_is_refused_on_both_sides(tmp_path, with_q):
    """q_proj and qkv_proj in one adapter (or qkv_proj alone) against q / k / v slices: refused with
    one message, never placed into the q slice."""
    from jax_lora.adapters import prepare_adapter as jax_prepare
    from torch_lora.adapters import prepare_adapter as torch_prepare
    path = _fused_adapter(tmp_path, "fused", with_q)
    want = (r"targets 'model\.layers\.0\.self_attn\.qkv_proj', which is not a LoRA module of the model "
            r"\(LoRA modules: ")
    messages = []
    for side, make in MANAGERS.items():
        mgr = make()
        before = _state(mgr)
        with pytest.raises(AdapterError, match=want) as e:
            mgr.register(1, path)
        messages.append(str(e.value).split(" (LoRA modules")[0])
        _assert_same(before, _state(mgr))
        # A PeftAdapter built in memory skips the header check: placement refuses it the same way.
        with pytest.raises(AdapterError, match=r"targets 'model\.layers\.0\.self_attn\.qkv_proj', which is not a "
                                               "LoRA module of the model"):
            if side == "jax":
                jax_prepare(mgr.model, load_peft_adapter(path))
            else:
                torch_prepare(mgr.layers, load_peft_adapter(path))
    assert messages[0] == messages[1]


def _nonfinite_cases(tmp_path):
    return {
        "alpha 1e308": (_good(tmp_path, "alpha", lora_alpha=1e308), None,
                        r"the factors placed in '.*' hold NaN or infinite values"),
        "1e5 in float16": (_good(tmp_path, "big", scale=1e5), "float16",
                           r"the factors placed in '.*' reach .* beyond the largest float16 value 65504"),
    }


@pytest.mark.parametrize("side", MANAGERS)
def test_non_finite_scales_and_overflow_are_refused_on_both_sides(tmp_path, side):
    for _what, (path, dtype, want) in _nonfinite_cases(tmp_path).items():
        if dtype is None:
            mgr = MANAGERS[side]()
        elif side == "jax":
            import jax.numpy as jnp
            mgr = MANAGERS[side](dtype=jnp.float16)
        else:
            import torch
            mgr = MANAGERS[side](dtype=torch.float16)
        before = _state(mgr)
        with pytest.raises(AdapterError, match=want):
            mgr.register(1, path)
        _assert_same(before, _state(mgr))


def _dora_nan_adapter(tmp_path):
    """A use_dora adapter on q_proj whose magnitude vector holds a NaN."""
    from safetensors.numpy import save_file
    rng = np.random.default_rng(2)
    path = tmp_path / "dora-nan"
    path.mkdir()
    m = np.abs(rng.normal(size=(Q,))).astype(np.float32) + 0.5
    m[3] = np.nan
    save_file({f"base_model.model.{QMOD}.lora_A.weight": rng.normal(size=(2, H)).astype(np.float32),
               f"base_model.model.{QMOD}.lora_B.weight": rng.normal(size=(Q, 2)).astype(np.float32),
               f"base_model.model.{QMOD}.lora_magnitude_vector": m}, str(path / WEIGHTS_NAME))
    _config(str(path), r=2, target_modules=["q_proj"], use_dora=True)
    return str(path)


@pytest.mark.parametrize("side", MANAGERS)
def test_dora_magnitude_with_nan_is_refused_on_both_sides(tmp_path, side):
    path = _dora_nan_adapter(tmp_path)
    mgr = MANAGERS[side](dora=True)
    before = _state(mgr)
    with pytest.raises(AdapterError, match=r"the DoRA column scale of '.*' holds NaN or infinite values"):
        mgr.register(1, path)
    _assert_same(before, _state(mgr))


# ----------------------------------------------------------------------------- regular expressions

EVIL = [r"(.|.)*x", r"(a+)+b", r"(x*y)*z", r"(\w)\1", r".*a.*b.*c.*d"]


@pytest.mark.parametrize("field", ["target_modules", "exclude_modules", "rank_pattern", "alpha_pattern",
                                   "layers_pattern"])
@pytest.mark.parametrize("pattern", EVIL)
def test_catastrophic_patterns_are_refused_quickly(tmp_path, field, pattern):
    """Each would backtrack for minutes against a 30-character module name; refused before any match,
    naming the file, the field and the pattern."""
    value = {"rank_pattern": {pattern: 2}, "alpha_pattern": {pattern: 4}}.get(field, pattern)
    extra = {"layers_to_transform": [0], "target_modules": ["q_proj", "v_proj"]} if field == "layers_pattern" else {}
    path = _good(tmp_path, **{field: value}, **extra)
    start = time.monotonic()
    with pytest.raises(AdapterError, match=rf"{CONFIG_NAME}: field '{field}.*(refused|has \d+ characters)"):
        load_peft_adapter(path)
    assert time.monotonic() - start < 3


def test_long_pattern_and_long_tensor_names_are_refused(tmp_path):
    path = _good(tmp_path, target_modules="q_proj|" * 100 + "v_proj")
    with pytest.raises(AdapterError, match=r"field 'target_modules': the regular expression .* has 706 characters, "
                                           "more than 512"):
        load_peft_adapter(path)
    path = tmp_path / "long"
    path.mkdir()
    _config(str(path), target_modules=".*q_proj")
    name = "model." + "a." * 300 + "q_proj"
    a, end = _entry((2, H), 0)
    b, end = _entry((Q, 2), end)
    _raw_safetensors(str(path / WEIGHTS_NAME), {f"base_model.model.{name}.lora_A.weight": a,
                                                f"base_model.model.{name}.lora_B.weight": b}, end, sparse=False)
    with pytest.raises(AdapterError, match=r"tensor name .* has \d+ characters; module names are at most 256"):
        load_peft_adapter(str(path))


@pytest.mark.parametrize("config", [
    {"target_modules": r".*\.(q_proj|v_proj)"},
    {"target_modules": r"model\.layers\.\d+\.self_attn\.(q|k|v|o)_proj"},
    {"target_modules": r"^(?!.*lm_head).*"},
    {"target_modules": r".*\.layers\.[02]\.self_attn\.(q|v)_proj"},
    {"target_modules": ["q_proj", "v_proj"], "exclude_modules": r".*\.layers\.1\..*",
     "rank_pattern": {r"layers\.\d+\.self_attn\.v_proj": 2, "^model.layers.0.self_attn.q_proj": 2},
     "alpha_pattern": {"v_proj": 3}},
    {"target_modules": ["q_proj", "v_proj"], "layers_to_transform": [0], "layers_pattern": "layers"},
])
def test_common_peft_patterns_are_accepted(tmp_path, config):
    ad = load_peft_adapter(_good(tmp_path, **config))
    assert sorted(ad.modules) == [QMOD, VMOD]
    if "alpha_pattern" in config:
        assert ad.modules[VMOD].scaling == pytest.approx(3 / 2)


def test_pattern_keys_match_like_peft():
    """rank_pattern / alpha_pattern keys: PEFT's re.match(rf"(.*\\.)?({key})$", name), the same keys."""
    import re

    from lora_core.peft.config import AdapterConfig
    keys = ["q_proj", r"layers\.0\.self_attn\.q_proj", "^model.layers.0.self_attn.q_proj", "^q_proj",
            r"(?<=attn\.)q_proj", "proj", ".*proj", "self_attn.q_proj", "0", "attn", r"layers\.\d+\.mlp\..*"]
    names = ["model.layers.0.self_attn.q_proj", "model.layers.10.mlp.down_proj", "q_proj", "lm_head"]
    for key in keys:
        for name in names:
            assert (AdapterConfig._lookup({key: 1}, name, 0) == 1) == bool(re.match(rf"(.*\.)?({key})$", name)), \
                (key, name)


# ----------------------------------------------------------------------------- stamps and copies

def _rewriting_manager(rewrite_on: set, seeds: list):
    """A torch manager whose adapter preparation (the moment register / a reload has just read the
    files) rewrites the adapter directory with the next seed's weights on the calls in `rewrite_on`:
    a writer racing the reader, at the worst moment."""
    from torch_lora.adapters import AdapterManager

    base = _torch_manager(slots=1)

    class Racing(AdapterManager):
        calls = 0
        directory = None

        def _prepare_uncounted(self, adapter):
            prepared = super()._prepare_uncounted(adapter)
            Racing.calls += 1
            if Racing.calls in rewrite_on:
                _good_at(Racing.directory, seeds.pop(0))
            return prepared

    return Racing(base.layers, host_cache_size=1), Racing


def _good_at(path, seed):
    rng = np.random.default_rng(seed)
    save_peft_adapter(path, {QMOD: (rng.normal(size=(2, H)), rng.normal(size=(Q, 2))),
                             VMOD: (rng.normal(size=(2, H)), rng.normal(size=(KV, 2)))}, r=2, lora_alpha=4)
    os.utime(os.path.join(path, WEIGHTS_NAME), ns=(time.time_ns(), time.time_ns() + seed))


def _served_q_a(mgr, lora_id):
    """The q_proj lora_A (rank 2) that lora_id's slot holds."""
    return mgr.layers["qkv"].slot_views(mgr.slot_of(lora_id))[0][:2].numpy()


def test_files_rewritten_during_register_are_read_again(tmp_path):
    path = _good(tmp_path, "racing")
    mgr, racing = _rewriting_manager({1}, [11])
    racing.directory = path
    mgr.register(1, path)
    assert racing.calls == 2                                   # read, rewritten meanwhile, read again
    mgr.activate([1])
    np.testing.assert_allclose(_served_q_a(mgr, 1), load_peft_adapter(path).modules[QMOD].lora_a, rtol=1e-6)


def test_files_that_keep_changing_during_register_are_refused(tmp_path):
    path = _good(tmp_path, "racing")
    mgr, racing = _rewriting_manager({1, 2, 3}, [11, 12, 13])
    racing.directory = path
    before = _state(mgr)
    with pytest.raises(AdapterError, match=r"adapter 'racing': the files in .* changed while they were read, 3 times"):
        mgr.register(1, path)
    _assert_same(before, _state(mgr))


def test_reload_after_eviction_refuses_files_rewritten_during_the_reload(tmp_path):
    """host_cache_size=1 and one slot: adapter 1 is evicted by 2 and reloaded from disk; files rewritten
    while that reload reads them are refused, not served under id 1."""
    path = _good(tmp_path, "one")
    mgr, racing = _rewriting_manager({3}, [21])      # calls: register 1, register 2, reload of 1
    racing.directory = path
    mgr.register(1, path)
    mgr.register(2, _good(tmp_path, "two", seed=2))
    mgr.activate([2])
    before = _state(mgr)
    with pytest.raises(AdapterError, match=r"adapter 'one' \(LoRA id 1\): the files in .* changed since it was "
                                           "registered"):
        mgr.activate([1])
    assert racing.calls == 3
    _assert_same(before, _state(mgr))


def test_a_registered_peft_adapter_is_copied(tmp_path):
    """Changing the caller's PeftAdapter after register (in place, or its dicts) changes nothing served,
    neither now nor after an eviction and reload."""
    mgr = _torch_manager(slots=1)
    mgr.host_cache_size = 1
    adapter = load_peft_adapter(_good(tmp_path))
    want = adapter.modules[QMOD].lora_a.copy()
    mgr.register(1, adapter)
    adapter.modules[QMOD].lora_a[:] = 1e3
    adapter.modules[VMOD] = adapter.modules[QMOD]
    mgr.register(2, _good(tmp_path, "two", seed=2))
    mgr.activate([2])
    mgr.activate([1])                                         # evicted from the host cache: prepared again
    assert mgr.stats["prepares"] == 2
    np.testing.assert_allclose(_served_q_a(mgr, 1), want, rtol=1e-6)
