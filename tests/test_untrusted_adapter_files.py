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
