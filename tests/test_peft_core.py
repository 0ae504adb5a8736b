"""lora_core.peft: PEFT adapters read without a framework. Config fields are allowlisted, files stay
inside the adapter directory, the safetensors header is checked before any data is read, and every
refusal is an AdapterError (a ValueError) naming the file and the field or tensor.

CPU; no framework imported.
"""

from __future__ import annotations

import json
import math
import os
import pathlib
import pickle
import struct

import numpy as np
import pytest

from lora_core import peft as core_peft
from lora_core.peft import AdapterError, load_peft_adapter, save_peft_adapter

from .jax_helpers import plain_config, q_tensors, write_adapter

H, OUT = 8, 12
MODULE = "model.layers.0.self_attn.q_proj"
KEY_A = f"base_model.model.{MODULE}.lora_A.weight"
KEY_B = f"base_model.model.{MODULE}.lora_B.weight"


def _adapter(tmp_path, name="adapter", r=2, alpha=4, modules=None, seed=0, config=None, **fields):
    """A valid adapter directory (our writer), then `config` and `fields` merged into its
    adapter_config.json (a value of `...` deletes the field)."""
    config = {**fields, **(config or {})}
    rng = np.random.default_rng(seed)
    modules = modules or {MODULE: (rng.normal(size=(r, H)), rng.normal(size=(OUT, r)))}
    path = tmp_path / name
    save_peft_adapter(str(path), modules, r=r, lora_alpha=alpha)
    if config:
        cfg = json.loads((path / "adapter_config.json").read_text())
        for field, value in config.items():
            if value is ...:
                cfg.pop(field, None)
            else:
                cfg[field] = value
        (path / "adapter_config.json").write_text(json.dumps(cfg))
    return path


def _refused(path, *needles):
    """Loads `path`, expects an AdapterError (a ValueError) whose message holds every needle."""
    with pytest.raises(AdapterError) as info:
        load_peft_adapter(str(path))
    assert isinstance(info.value, ValueError)
    message = str(info.value)
    for needle in needles:
        assert str(needle) in message, (needle, message)
    return message


def _safetensors(entries, data: bytes, header_length: int | None = None) -> bytes:
    """A safetensors file from {name: (dtype, shape, [begin, end])} and the data bytes, written by
    hand so that any header can be made."""
    header = json.dumps({name: {"dtype": d, "shape": list(s), "data_offsets": list(o)}
                         for name, (d, s, o) in entries.items()}).encode()
    return struct.pack("<Q", len(header) if header_length is None else header_length) + header + data


def _good_entries(r=2):
    a_bytes, b_bytes = r * H * 4, OUT * r * 4
    return {KEY_A: ("F32", (r, H), (0, a_bytes)), KEY_B: ("F32", (OUT, r), (a_bytes, a_bytes + b_bytes))}


# ----------------------------------------------------------------------------- valid adapters

def test_valid_adapter_per_module_rank_and_scaling(tmp_path):
    rng = np.random.default_rng(1)
    down = "model.layers.1.mlp.down_proj"
    mods = {MODULE: (rng.normal(size=(4, H)), rng.normal(size=(OUT, 4))),
            down: (rng.normal(size=(2, H)), rng.normal(size=(OUT, 2)))}
    path = _adapter(tmp_path, r=4, alpha=8, modules=mods, rank_pattern={"down_proj": 2},
                    alpha_pattern={"q_proj": 3})
    adapter = load_peft_adapter(str(path))
    q = adapter.modules[MODULE]
    assert q.kind == "linear" and q.rank == 4 and q.scaling == pytest.approx(3 / 4)
    np.testing.assert_array_equal(q.lora_a, mods[MODULE][0].astype(np.float32))
    assert adapter.modules[down].rank == 2 and adapter.modules[down].scaling == pytest.approx(8 / 2)
    assert adapter.path == str(path) and adapter.max_rank == 4


def test_missing_lora_alpha_takes_peft_default(tmp_path):
    """PEFT's LoraConfig default lora_alpha is 8 (not r)."""
    adapter = load_peft_adapter(str(_adapter(tmp_path, r=2, lora_alpha=...)))
    assert adapter.lora_alpha == 8 and adapter.modules[MODULE].scaling == pytest.approx(8 / 2)


@pytest.mark.parametrize("dtype", ["F16", "BF16", "F64"])
def test_half_and_double_precision_tensors(tmp_path, dtype):
    path = _adapter(tmp_path)
    rng = np.random.default_rng(2)
    a = rng.normal(size=(2, H)).astype(np.float32)
    b = rng.normal(size=(OUT, 2)).astype(np.float32)
    if dtype == "BF16":                              # bfloat16: the top 16 bits of a float32
        a = (a.view(np.uint32) & 0xFFFF0000).view(np.float32)
        b = (b.view(np.uint32) & 0xFFFF0000).view(np.float32)
        raw_a, raw_b = (a.view(np.uint32) >> 16).astype("<u2"), (b.view(np.uint32) >> 16).astype("<u2")
    else:
        np_dtype = {"F16": "<f2", "F64": "<f8"}[dtype]
        a, b = a.astype(np_dtype).astype(np.float32), b.astype(np_dtype).astype(np.float32)
        raw_a, raw_b = a.astype(np_dtype), b.astype(np_dtype)
    entries = {KEY_A: (dtype, a.shape, (0, raw_a.nbytes)),
               KEY_B: (dtype, b.shape, (raw_a.nbytes, raw_a.nbytes + raw_b.nbytes))}
    (path / "adapter_model.safetensors").write_bytes(_safetensors(entries, raw_a.tobytes() + raw_b.tobytes()))
    module = load_peft_adapter(str(path)).modules[MODULE]
    assert module.lora_a.dtype == np.float32
    np.testing.assert_array_equal(module.lora_a, a)
    np.testing.assert_array_equal(module.lora_b, b)


# ----------------------------------------------------------------------------- config fields

@pytest.mark.parametrize("field, value, reason", [
    ("layer_replication", [[0, 1], [0, 1]], "layer replication"),
    ("lora_bias", True, "LoRA bias"),
    ("use_qalora", True, "QALoRA"),
    ("trainable_token_indices", [5, 6], "trainable tokens"),
    ("megatron_config", {"tensor_model_parallel_size": 2}, "Megatron"),
    ("use_bdlora", {"nblocks": 2}, "BD-LoRA"),
    ("arrow_config", {"top_k": 2}, "Arrow"),
    ("kasa_config", {"beta": 1.0}, "KaSA"),
    ("ensure_weight_tying", True, "tied"),
    ("modules_to_save", ["lm_head"], "modules_to_save"),
    ("fan_in_fan_out", True, "Conv1D"),
    ("bias", "all", "biases"),
    ("bias", "lora_only", "biases"),
    ("enable_lora", [True, False, True], "MergedLinear"),
    ("init_lora_weights", "pissa", "path_initial_model_for_weight_conversion"),
    ("init_lora_weights", "pissa_niter_4", "PiSSA"),
    ("init_lora_weights", "olora", "OLoRA"),
    ("init_lora_weights", "corda", "CorDA"),
    ("init_lora_weights", "loftq", "LoftQ"),
    ("init_lora_weights", "lora_ga", "LoRA-GA"),
    ("peft_type", "LOHA", "'LORA'"),
])
def test_math_changing_fields_are_refused(tmp_path, field, value, reason):
    path = _adapter(tmp_path, config={field: value})
    _refused(path, path / "adapter_config.json", repr(field), reason)


def test_unknown_field_is_refused(tmp_path):
    path = _adapter(tmp_path, lora_scale_by_token=[0.5, 2.0])
    message = _refused(path, path / "adapter_config.json", "unknown field 'lora_scale_by_token'")
    assert "[0.5, 2.0]" in message


@pytest.mark.parametrize("config", [
    {"lora_dropout": 0.1, "inference_mode": False, "task_type": "CAUSAL_LM", "revision": "main",
     "peft_version": "0.21.2", "auto_mapping": {"base_model_class": "LlamaForCausalLM"},
     "base_model_name_or_path": "some/model", "megatron_core": "megatron.core", "qalora_group_size": 32,
     "loftq_config": {}, "eva_config": None, "corda_config": None, "lora_ga_config": None,
     "runtime_config": {"ephemeral_gpu_offload": False}, "merge_weights": False},
    {"init_lora_weights": False}, {"init_lora_weights": "gaussian"}, {"init_lora_weights": "eva"},
    {"init_lora_weights": "orthogonal"}, {"init_lora_weights": "mica"},
    {"use_dora": False, "alora_invocation_tokens": None, "layer_replication": None, "lora_bias": False,
     "use_qalora": False, "target_parameters": None, "trainable_token_indices": None, "megatron_config": None,
     "use_bdlora": None, "arrow_config": None, "kasa_config": None, "ensure_weight_tying": False,
     "modules_to_save": None, "fan_in_fan_out": False, "bias": "none", "enable_lora": None},
    {"peft_type": ...},
])
def test_harmless_fields_and_defaults_load_unchanged(tmp_path, config):
    want = load_peft_adapter(str(_adapter(tmp_path, "plain"))).modules[MODULE]
    got = load_peft_adapter(str(_adapter(tmp_path, "with", config=config))).modules[MODULE]
    np.testing.assert_array_equal(got.lora_a, want.lora_a)
    np.testing.assert_array_equal(got.lora_b, want.lora_b)
    assert got.scaling == want.scaling


def test_training_state_of_inference_neutral_variants_is_skipped(tmp_path):
    """VeLoRA and MonteCLoRA change training only; PEFT saves their buffers beside A and B."""
    path = _adapter(tmp_path, velora_config={"num_groups": 64, "scale": 1.0, "init_type": "batch_average"})
    from safetensors.numpy import load_file, save_file
    tensors = load_file(str(path / "adapter_model.safetensors"))
    tensors[f"base_model.model.{MODULE}.lora_velora_embed"] = np.ones((1, 64), np.float32)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    assert load_peft_adapter(str(path)).modules[MODULE].rank == 2
    plain = _adapter(tmp_path, "plain")
    save_file(tensors, str(plain / "adapter_model.safetensors"))
    _refused(plain, "lora_velora_embed", "not a LoRA A/B weight")   # without velora_config: refused


def test_installed_peft_fields_are_all_classified(tmp_path):
    """Every field peft writes into adapter_config.json is implemented, metadata or refused."""
    peft = pytest.importorskip("peft")
    import dataclasses

    from lora_core.peft import IMPLEMENTED, METADATA, UNSUPPORTED, parse_adapter_config
    fields = {f.name for f in dataclasses.fields(peft.LoraConfig)}
    unclassified = fields - set(IMPLEMENTED) - set(METADATA) - set(UNSUPPORTED)
    assert not unclassified, f"peft {peft.__version__} LoraConfig fields to classify: {sorted(unclassified)}"
    peft.LoraConfig(r=4, lora_alpha=16, target_modules=["q_proj", "v_proj"]).save_pretrained(str(tmp_path))
    config = parse_adapter_config(json.loads((tmp_path / "adapter_config.json").read_text()))
    assert config.r == 4 and config.scaling("model.layers.0.self_attn.q_proj") == 4.0


@pytest.mark.parametrize("config", [
    {"target_modules": ["q_proj", "v_proj"]},
    {"target_modules": ["q_proj"], "layers_to_transform": [1, 3]},
    {"target_modules": ["q_proj"], "layers_to_transform": 0, "layers_pattern": "layers"},
    {"target_modules": ["q_proj"], "layers_to_transform": [0], "layers_pattern": ["h", "blocks"]},
    {"target_modules": r".*\.layers\.[02]\.self_attn\.(q|v)_proj"},
    {"target_modules": ["q_proj", "v_proj", "lm_head"], "exclude_modules": ["v_proj"]},
    {"target_modules": ["proj"], "exclude_modules": r".*\.layers\.1\..*"},
    {"target_modules": ["model.layers.0.self_attn.q_proj", "embed_tokens"]},
])
def test_target_matching_equals_peft(config):
    """AdapterConfig.targets decides as peft's check_target_module_exists, on names of a Llama."""
    pytest.importorskip("peft")
    from peft import LoraConfig
    from peft.tuners.tuners_utils import check_target_module_exists

    from lora_core.peft import parse_adapter_config
    names = [f"model.layers.{i}.{part}" for i in range(4) for part in
             ("self_attn.q_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.down_proj", "mlp.proj")]
    names += ["model.embed_tokens", "lm_head", "model.h.0.attn.q_proj", "model.blocks.1.q_proj"]
    ours = parse_adapter_config({"r": 2, **config})
    theirs = LoraConfig(r=2, **config)
    for name in names:
        assert ours.targets(name) == bool(check_target_module_exists(theirs, name)), name


def test_tensors_of_untargeted_modules_are_refused(tmp_path):
    """PEFT ignores the weights of a module its config does not target; serving them would differ."""
    path = _adapter(tmp_path, "other", target_modules=["v_proj"])
    _refused(path, path / "adapter_model.safetensors", KEY_A, "does not target", "['v_proj']")
    path = _adapter(tmp_path, "layers", layers_to_transform=[1])
    _refused(path, KEY_A, "layers_to_transform=[1]")
    assert load_peft_adapter(str(_adapter(tmp_path, "regex", target_modules=r".*\.q_proj"))).modules


# ----------------------------------------------------------------------------- config errors

@pytest.mark.parametrize("text, needles", [
    ("{not json", ["malformed JSON"]),
    ("", ["malformed JSON"]),
    ("[1, 2]", ["expected a JSON object", "got list"]),
    (b"\xff\xfe{}", ["UTF-8"]),
    ('{"r": 2, "r": 4}', ["'r' appears twice"]),
    ('{"r": 2, "lora_alpha": NaN}', ["NaN"]),
])
def test_malformed_config_files(tmp_path, text, needles):
    path = _adapter(tmp_path)
    config = path / "adapter_config.json"
    if isinstance(text, bytes):
        config.write_bytes(text)
    else:
        config.write_text(text)
    _refused(path, config, *needles)


@pytest.mark.parametrize("field, value, needle", [
    ("r", ..., "field 'r' (the rank, an int > 0) is missing"),
    ("r", 0, "field 'r' must be an int > 0, got 0"),
    ("r", -2, "got -2"),
    ("r", "2", "got '2' (str)"),
    ("r", 2.0, "got 2.0 (float)"),
    ("r", True, "got True (bool)"),
    ("lora_alpha", "8", "field 'lora_alpha' must be a finite number, got '8'"),
    ("lora_alpha", None, "field 'lora_alpha'"),
    ("use_rslora", "yes", "field 'use_rslora' must be true or false"),
    ("target_modules", 3, "field 'target_modules' must be a list of strings or a regex string or null, got 3"),
    ("target_modules", ["q_proj", 1], "field 'target_modules'"),
    ("target_modules", "(q_proj", "not a valid regular expression"),
    ("exclude_modules", {"q": 1}, "field 'exclude_modules'"),
    ("rank_pattern", "q_proj", "field 'rank_pattern' must be an object"),
    ("rank_pattern", {"q_proj": 0}, "field 'rank_pattern': value for 'q_proj' must be an int > 0, got 0"),
    ("alpha_pattern", {"q_proj": "x"}, "field 'alpha_pattern'"),
    ("layers_to_transform", "0", "field 'layers_to_transform'"),
    ("layers_pattern", 3, "field 'layers_pattern'"),
])
def test_config_field_errors_name_the_field(tmp_path, field, value, needle):
    path = _adapter(tmp_path, config={field: value})
    _refused(path, path / "adapter_config.json", needle)


def test_layer_options_need_a_list_of_targets(tmp_path):
    path = _adapter(tmp_path, target_modules=r".*q_proj", layers_to_transform=[0])
    _refused(path, "'layers_to_transform'", "regex")
    path = _adapter(tmp_path, "p", layers_pattern="layers")
    _refused(path, "'layers_pattern'", "needs layers_to_transform")


def test_config_rank_must_match_the_tensors(tmp_path):
    path = _adapter(tmp_path, r=2, rank_pattern={"q_proj": 3})
    _refused(path, path / "adapter_model.safetensors", MODULE, "rank 2", "r=3")


# ----------------------------------------------------------------------------- safetensors errors

def _with_weights(tmp_path, data: bytes, name="adapter"):
    path = _adapter(tmp_path, name)
    (path / "adapter_model.safetensors").write_bytes(data)
    return path, path / "adapter_model.safetensors"


@pytest.mark.parametrize("case", ["empty", "short", "garbage", "truncated", "huge header", "header past end",
                                  "header not JSON", "header a list", "metadata not strings"])
def test_malformed_safetensors_files(tmp_path, case):
    good = (_adapter(tmp_path, "good") / "adapter_model.safetensors").read_bytes()
    data, needle = {
        "empty": (b"", "got 0 bytes"),
        "short": (b"\x01\x02\x03", "got 3 bytes"),
        "garbage": (b"\x00garbage" * 16, "header length field says"),
        "truncated": (good[:-7], "end past the"),
        "huge header": (struct.pack("<Q", 2**40) + b"{}", "more than the limit of 100000000"),
        "header past end": (struct.pack("<Q", 1000) + b"{}", "only 2 bytes follow"),
        "header not JSON": (struct.pack("<Q", 4) + b"{{{{", "malformed"),
        "header a list": (struct.pack("<Q", 2) + b"[]", "got list"),
        "metadata not strings": (struct.pack("<Q", 24) + b'{"__metadata__":{"a":1}}', "__metadata__"),
    }[case]
    path, weights = _with_weights(tmp_path, data)
    _refused(path, weights, needle)


@pytest.mark.parametrize("case", ["size mismatch", "past end", "overlap", "gap", "trailing bytes", "unknown dtype",
                                  "int dtype", "bad shape", "bad offsets", "huge declared shape"])
def test_inconsistent_tensor_entries_name_the_tensor(tmp_path, case):
    entries = _good_entries()
    size = sum(o[1] - o[0] for _, _, o in entries.values())
    data = bytes(size)
    a_end = entries[KEY_A][2][1]
    if case == "size mismatch":
        entries[KEY_A] = ("F32", (3, H), (0, a_end))
    elif case == "past end":
        data = data[:-8]
    elif case == "overlap":
        entries[KEY_B] = ("F32", (OUT, 2), (a_end - 4, a_end - 4 + OUT * 8))
    elif case == "gap":
        entries[KEY_B] = ("F32", (OUT, 2), (a_end + 4, a_end + 4 + OUT * 8))
        data += bytes(4)
    elif case == "trailing bytes":
        data += bytes(16)
    elif case == "unknown dtype":
        entries[KEY_A] = ("F12", (2, H), (0, a_end))
    elif case == "int dtype":
        entries[KEY_A] = ("I32", (2, H), (0, a_end))
    elif case == "bad shape":
        entries[KEY_A] = ("F32", (2, -8), (0, a_end))
    elif case == "bad offsets":
        entries[KEY_A] = ("F32", (2, H), (a_end, 0))
    elif case == "huge declared shape":         # must be refused from the header, never allocated
        entries[KEY_A] = ("F32", (2**40, 2**40), (0, a_end))
    path, weights = _with_weights(tmp_path, _safetensors(entries, data))
    needle = {"past end": KEY_B, "overlap": KEY_B, "gap": KEY_B, "trailing bytes": "16 bytes after the last tensor"}
    _refused(path, weights, needle.get(case, KEY_A))


def test_tensor_size_limit_names_the_tensor(tmp_path):
    path = _adapter(tmp_path)
    with pytest.raises(AdapterError, match=f"{KEY_B}.*{OUT * 2 * 4} bytes, more than the limit of 64"):
        load_peft_adapter(str(path), max_tensor_bytes=64)
    with pytest.raises(AdapterError, match="more than the limit of 16"):
        load_peft_adapter(str(path), max_header_bytes=16)
    assert load_peft_adapter(str(path), max_tensor_bytes=OUT * 2 * 4).modules


def test_reader_agrees_with_the_safetensors_library(tmp_path):
    from safetensors.numpy import save_file

    from lora_core.peft import read_safetensors
    rng = np.random.default_rng(3)
    tensors = {"a": rng.normal(size=(3, 5)).astype(np.float16), "b": rng.normal(size=(7,)),
               "c": rng.normal(size=(2, 2, 2)).astype(np.float32), "empty": np.zeros((0, 4), np.float32)}
    save_file(tensors, str(tmp_path / "t.safetensors"), metadata={"format": "pt"})
    got = read_safetensors(str(tmp_path / "t.safetensors"))
    assert set(got) == set(tensors)
    for name, want in tensors.items():
        assert got[name].dtype == want.dtype and got[name].shape == want.shape
        np.testing.assert_array_equal(got[name], want)


def test_duplicate_lora_tensors_for_one_module(tmp_path):
    path = _adapter(tmp_path)
    from safetensors.numpy import load_file, save_file
    tensors = load_file(str(path / "adapter_model.safetensors"))
    tensors[f"base_model.model.{MODULE}.lora_A.default.weight"] = tensors[KEY_A] * 2
    save_file(tensors, str(path / "adapter_model.safetensors"))
    _refused(path, "lora_A.default.weight", "are both lora_A")


# ----------------------------------------------------------------------------- files

def test_weights_symlinked_outside_the_directory_are_refused(tmp_path):
    outside = _adapter(tmp_path, "elsewhere")
    path = _adapter(tmp_path)
    weights = path / "adapter_model.safetensors"
    weights.unlink()
    weights.symlink_to(outside / "adapter_model.safetensors")
    _refused(path, weights, "outside the adapter directory", os.path.realpath(outside / "adapter_model.safetensors"))
    config = path / "adapter_config.json"
    weights.unlink()
    (path / "real.safetensors").write_bytes((outside / "adapter_model.safetensors").read_bytes())
    weights.symlink_to("real.safetensors")                      # a link inside the directory is fine
    assert load_peft_adapter(str(path)).modules
    config.unlink()
    config.symlink_to(outside / "adapter_config.json")
    _refused(path, config, "outside the adapter directory")


def test_hub_cache_snapshot_links_into_its_blobs(tmp_path):
    """huggingface_hub's cache: snapshots/<revision>/<file> -> ../../blobs/<hash>."""
    source = _adapter(tmp_path, "source")
    repository = tmp_path / "models--org--adapter"
    (repository / "blobs").mkdir(parents=True)
    snapshot = repository / "snapshots" / "0123abcd"
    snapshot.mkdir(parents=True)
    for i, name in enumerate(["adapter_config.json", "adapter_model.safetensors"]):
        (repository / "blobs" / f"blob{i}").write_bytes((source / name).read_bytes())
        (snapshot / name).symlink_to(f"../../blobs/blob{i}")
    assert load_peft_adapter(str(snapshot)).modules[MODULE].rank == 2
    (snapshot / "adapter_model.safetensors").unlink()
    (snapshot / "adapter_model.safetensors").symlink_to(source / "adapter_model.safetensors")
    _refused(snapshot, "outside the adapter directory")


class _Trap:
    """Unpickling this creates a file: proof that a pickle was loaded."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_pickled_weights_are_never_loaded(tmp_path):
    path = _adapter(tmp_path)
    (path / "adapter_model.safetensors").unlink()
    marker = tmp_path / "unpickled"
    (path / "adapter_model.bin").write_bytes(pickle.dumps(_Trap(str(marker))))
    _refused(path, path / "adapter_model.bin", "pickle", "safe_serialization=True")
    assert not marker.exists()


def test_missing_or_odd_files(tmp_path):
    path = _adapter(tmp_path)
    (path / "adapter_model.safetensors").unlink()
    _refused(path, path / "adapter_model.safetensors", "missing")
    (path / "adapter_model.safetensors").mkdir()
    _refused(path, path / "adapter_model.safetensors", "expected a regular file, got a directory")
    _refused(tmp_path / "nothing", "no such path")
    _refused(tmp_path, "adapter_config.json is missing")








def test_peft_scaling_rslora_rank_and_alpha_patterns(tmp_path):
    """load_peft_adapter reads r, lora_alpha (PEFT's default 8 when absent), use_rslora
    (alpha / sqrt(r)), rank_pattern / alpha_pattern per module, as float32 NumPy factors."""
    t = {**q_tensors(4), **q_tensors(2, "model.layers.0.self_attn.v_proj")}
    d = write_adapter(tmp_path / "a", plain_config(r=4, lora_alpha=16, target_modules=["q_proj", "v_proj"],
                                                     rank_pattern={"v_proj": 2}, alpha_pattern={"v_proj": 3}), t)
    ad = core_peft.load_peft_adapter(d)
    q, v = ad.modules["model.layers.0.self_attn.q_proj"], ad.modules["model.layers.0.self_attn.v_proj"]
    assert q.lora_a.dtype == np.float32 and q.lora_a.shape == (4, 8) and q.lora_b.shape == (8, 4)
    assert math.isclose(q.scaling, 16 / 4) and math.isclose(v.scaling, 3 / 2)
    cfg = plain_config(r=4, use_rslora=True)
    cfg.pop("lora_alpha")
    d2 = write_adapter(tmp_path / "b", cfg, q_tensors(4))
    assert math.isclose(core_peft.load_peft_adapter(d2).modules["model.layers.0.self_attn.q_proj"].scaling,
                        8 / math.sqrt(4))
    d3 = write_adapter(tmp_path / "c", plain_config(lora_dropout=0.1, task_type="CAUSAL_LM",
                                                      init_lora_weights="gaussian"), q_tensors())
    core_peft.load_peft_adapter(d3)                       # metadata fields are accepted


@pytest.mark.parametrize("field, value", [
    ("alora_invocation_tokens", []),
    ("lora_bias", True),
    ("modules_to_save", ["lm_head"]),
    ("init_lora_weights", "pissa"),
    ("some_future_field", 1),
    ("r", 0),
])
def test_peft_fields_that_change_the_math_are_refused(tmp_path, field, value):
    """An allowlist of PEFT fields: an empty aLoRA invocation, LoRA bias, modules_to_save, PiSSA init, an
    unknown field and r=0 raise AdapterError (a ValueError) naming the file and the field."""
    d = write_adapter(tmp_path / "a", plain_config(**{field: value}), q_tensors())
    with pytest.raises(AdapterError) as e:
        core_peft.load_peft_adapter(d)
    assert isinstance(e.value, ValueError)
    assert "adapter_config.json" in str(e.value) and field in str(e.value)


def test_peft_bad_files_fail_cleanly(tmp_path):
    """Malformed or list-shaped adapter_config.json, a config without r, a truncated /
    empty / garbage / huge-header safetensors, tensors of a module the config does not target, a
    pickle-only adapter and a safetensors symlinked outside the directory all raise AdapterError
    naming the file (or field)."""
    good = write_adapter(tmp_path / "good", plain_config(), q_tensors())
    weights = os.path.join(good, "adapter_model.safetensors")
    data = pathlib.Path(weights).read_bytes()

    def case(name, config_text=None, weights_bytes=None, tensors=None, config=None):
        d = tmp_path / name
        d.mkdir()
        (d / "adapter_config.json").write_text(config_text if config_text is not None else
                                               json.dumps(config or plain_config()))
        if tensors is not None:
            write_adapter(d, config or plain_config(), tensors)
        elif weights_bytes is not None:
            (d / "adapter_model.safetensors").write_bytes(weights_bytes)
        return str(d)

    bad = {
        "malformed": (case("malformed", config_text="{r: 2"), "adapter_config.json"),
        "list": (case("list", config_text="[1, 2]"), "adapter_config.json"),
        "truncated": (case("truncated", weights_bytes=data[:-5]), "adapter_model.safetensors"),
        "empty": (case("empty", weights_bytes=b""), "adapter_model.safetensors"),
        "huge": (case("huge", weights_bytes=struct.pack("<Q", 2**40) + b"{}"), "adapter_model.safetensors"),
        "untargeted": (case("untargeted", tensors={**q_tensors(), **q_tensors(2, "model.layers.0.mlp.up_proj")}),
                       "up_proj"),
        "garbage": (case("garbage", weights_bytes=b"\x10\x00\x00\x00\x00\x00\x00\x00not json at all!"),
                    "adapter_model.safetensors"),
        "missing-r": (case("missing_r", config={"peft_type": "LORA", "lora_alpha": 4, "target_modules": ["q_proj"]}),
                      "'r'"),
    }
    pickle_dir = tmp_path / "pickle"
    pickle_dir.mkdir()
    (pickle_dir / "adapter_config.json").write_text(json.dumps(plain_config()))
    (pickle_dir / "adapter_model.bin").write_bytes(b"\x80\x04not really")
    bad["pickle"] = (str(pickle_dir), "safe_serialization")
    link_dir = tmp_path / "link"
    link_dir.mkdir()
    (link_dir / "adapter_config.json").write_text(json.dumps(plain_config()))
    os.symlink(weights, link_dir / "adapter_model.safetensors")
    bad["symlink"] = (str(link_dir), "adapter_model.safetensors")
    for name, (d, word) in bad.items():
        with pytest.raises(AdapterError) as e:
            core_peft.load_peft_adapter(d)
        assert word in str(e.value), (name, str(e.value))
