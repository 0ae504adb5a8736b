"""Small builders and float64 oracles for JAX-side tests written against the public API.

`rand` draws float32 normal arrays from one seeded generator; `shrink_ref` / `expand_ref` are the
ops' math as plain loops (contract section 5); `wrapper` builds a jax_lora.PunicaWrapper already
updated with a mapping; `shard_map_operands` reads the operand types of a lowered program's
shard_maps, `hlo_collectives` the collectives of a compiled one; `cpu_mesh` is a mesh of the
host's CPU devices (tests/conftest.py asks XLA for eight). Slot i holds LoRA id LORA_INDEX_TO_ID[i];
id 0 is "no LoRA".
"""

from __future__ import annotations

import re

import jax
import numpy as np
import pytest
from jax.sharding import Mesh

from jax_lora import LoRAMapping, PunicaWrapper

RNG = np.random.default_rng(1234)
LORA_INDEX_TO_ID = [1, 2, 3]        # three slots, ids 1..3 in slots 0..2


def rand(*shape, scale=1.0, dtype=np.float32):
    """`shape` normal values times `scale`, as `dtype` (float32)."""
    return (RNG.standard_normal(shape) * scale).astype(dtype)


def shrink_ref(x, a, idx, scale):
    """(T, r) float64: scale * x[t] @ a[idx[t]].T, 0 for idx -1. a: (L, r, H)."""
    x, a = np.asarray(x, np.float64), np.asarray(a, np.float64)
    out = np.zeros((x.shape[0], a.shape[1]))
    for t, i in enumerate(idx):
        if i >= 0:
            out[t] = scale * x[t] @ a[i].T
    return out


def expand_ref(y, buf, b, idx, offset, add_inputs):
    """y with columns offset:offset+n of rows idx >= 0 set to (y if add else 0) + buf[t] @ b[idx].T."""
    y = np.array(y, np.float64)
    buf, b = np.asarray(buf, np.float64), np.asarray(b, np.float64)
    n = b.shape[1]
    for t, i in enumerate(idx):
        if i >= 0:
            base = y[t, offset:offset + n] if add_inputs else 0.0
            y[t, offset:offset + n] = base + buf[t] @ b[i].T
    return y


def rel_err(got, want):
    """Relative Frobenius error in float64; NaN/Inf in `got` fails."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert np.all(np.isfinite(got)), "NaN/Inf in the result"
    denom = max(np.linalg.norm(want), 1e-30)
    return float(np.linalg.norm(got - want) / denom)


def wrapper(idx_ids, lora_index_to_id, *, prompt=None, prefill=False, capacity=32, backend="xla", vocab=64, **kw):
    """A PunicaWrapper with one slot per entry of `lora_index_to_id`, updated with the token ids
    `idx_ids` (and `prompt`, default the same) for a vocabulary of `vocab`."""
    w = PunicaWrapper(max_num_batched_tokens=capacity, max_batches=16, device=None,
                      max_loras=len(lora_index_to_id), backend=backend, **kw)
    w.update_metadata(LoRAMapping(tuple(idx_ids), tuple(prompt if prompt is not None else idx_ids), prefill),
                      lora_index_to_id, max_loras=len(lora_index_to_id) + 1, vocab_size=vocab)
    return w


def shard_map_operands(stablehlo: str) -> list:
    """[[operand type, ...] per sdy.manual_computation] of StableHLO text (`jax.jit(f).lower(...).as_text()`):
    a manual computation lists its block arguments, one `%argN: tensor<...>` per operand, on its
    first line."""
    return [re.findall(r"%arg\d+: (tensor<[^>]*>)", line) for line in stablehlo.splitlines()
            if "sdy.manual_computation(" in line]


def hlo_collectives(hlo: str) -> list:
    """[(op, result shape)] of every collective in compiled HLO text."""
    ops = r"(all-gather|all-reduce|reduce-scatter|collective-permute|all-to-all|collective-broadcast)"
    found = []
    for line in hlo.splitlines():
        m = re.search(r"=\s*(\S+)\s+" + ops + r"(?:-start)?\(", line)
        if m:
            found.append((m.group(2), m.group(1).split("{")[0]))
    return found


def cpu_mesh(shape=(4,), names=("tp",)):
    """A jax.sharding.Mesh of the first prod(shape) CPU devices, axes `names`; the test fails (not
    skips) when there are fewer: tests/conftest.py sets xla_force_host_platform_device_count=8."""
    n = int(np.prod(shape))
    devices = jax.devices("cpu")
    if len(devices) < n:
        pytest.fail(f"needs {n} CPU devices; tests/conftest.py sets xla_force_host_platform_device_count=8")
    return Mesh(np.array(devices[:n]).reshape(shape), names)


def zero_sized(tensor_type: str) -> bool:
    """Whether a `tensor<d0xd1x...xdtype>` type has a dimension of size 0."""
    return "0" in tensor_type[len("tensor<"):-1].split("x")[:-1]


def ids_to_slots(ids):
    """LoRA ids to slots under LORA_INDEX_TO_ID: id i > 0 is slot i - 1, 0 is -1 (no LoRA)."""
    return [i - 1 if i > 0 else -1 for i in ids]


def write_adapter(path, config: dict, tensors: dict) -> str:
    """A PEFT adapter directory at `path`: `config` as adapter_config.json, `tensors` (name -> array)
    as float32 adapter_model.safetensors. Returns the path."""
    import json
    import os

    from safetensors.numpy import save_file
    os.makedirs(path, exist_ok=True)
    save_file({k: np.ascontiguousarray(v, np.float32) for k, v in tensors.items()},
              os.path.join(path, "adapter_model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump(config, f)
    return str(path)


def plain_config(**kw) -> dict:
    """A minimal LoRA adapter_config (r 2, alpha 4, q_proj) with `kw` overriding or adding fields."""
    cfg = {"peft_type": "LORA", "r": 2, "lora_alpha": 4, "target_modules": ["q_proj"]}
    cfg.update(kw)
    return cfg


def q_tensors(r=2, module="model.layers.0.self_attn.q_proj", i=8, o=8) -> dict:
    """PEFT tensor names -> random factors of one module: lora_A (r, i), lora_B (o, r)."""
    return {f"base_model.model.{module}.lora_A.weight": rand(r, i),
            f"base_model.model.{module}.lora_B.weight": rand(o, r)}
