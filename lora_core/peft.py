"""PEFT LoRA adapters without a framework: adapter_config.json and adapter_model.safetensors as NumPy.

`jax_lora.adapters` and `torch_lora` place the adapter read here into their own layers; this module
imports NumPy and safetensors only. A PEFT adapter directory holds `adapter_config.json` (r,
lora_alpha, use_rslora, target_modules, rank_pattern, alpha_pattern, ...) and
`adapter_model.safetensors` with, per targeted module `m`:

  base_model.model.<m>.lora_A.weight           (r, in)        linear layers
  base_model.model.<m>.lora_B.weight           (out, r)
  base_model.model.<m>.lora_embedding_A        (r, vocab)     embeddings
  base_model.model.<m>.lora_embedding_B        (dim, r)

The adapter's output is `scaling * x @ A.T @ B.T` with `scaling = lora_alpha / r`
(`lora_alpha / sqrt(r)` with use_rslora; per-module r / alpha from rank_pattern / alpha_pattern).
Pickled `adapter_model.bin` files are refused (they can run code when loaded).
"""

from __future__ import annotations

import collections
import dataclasses
import json
import math
import os
import re
from collections.abc import Mapping
from typing import Any

import numpy as np

__all__ = ["CONFIG_NAME", "WEIGHTS_NAME", "AdapterError", "PeftAdapter", "load_peft_adapter", "save_peft_adapter"]

CONFIG_NAME = "adapter_config.json"
WEIGHTS_NAME = "adapter_model.safetensors"


class AdapterError(ValueError):
    """An adapter that cannot be loaded into this model (message says which tensor and why)."""


@dataclasses.dataclass
class PeftAdapter:
    """A LoRA adapter in PEFT terms, weights on the host.

    modules: {module name (Hugging Face path, e.g. "model.layers.0.self_attn.q_proj"):
              (A, B, scaling, kind)} with kind "linear" (A (r, in), B (out, r)) or "embedding"
              (A (r, vocab), B (dim, r)); scaling not yet applied.
    """

    name: str
    r: int
    lora_alpha: float
    use_rslora: bool
    target_modules: Any
    modules: dict
    config: dict = dataclasses.field(default_factory=dict)
    base_layer_shapes: dict = dataclasses.field(default_factory=dict)

    @property
    def max_rank(self) -> int:
        return max(a.shape[0] for a, _, _, _ in self.modules.values())

    @property
    def ranks(self) -> set:
        return {a.shape[0] for a, _, _, _ in self.modules.values()}


def _pattern_value(pattern: Mapping[str, Any], module: str, default):
    """PEFT's rank_pattern / alpha_pattern lookup: a key matches a module name's suffix (regex)."""
    for key, value in (pattern or {}).items():
        if re.match(rf"(.*\.)?({key})$", module):
            return value
    return default


def _scaling(alpha: float, r: int, rslora: bool) -> float:
    return alpha / math.sqrt(r) if rslora else alpha / r


_KEY = re.compile(r"^(?P<module>.+?)\.(?P<kind>lora_A|lora_B|lora_embedding_A|lora_embedding_B)(?P<rest>(\.[^.]+)*)$")


def load_peft_adapter(path: str, name: str | None = None) -> PeftAdapter:
    """Reads a PEFT LoRA adapter directory (adapter_config.json + adapter_model.safetensors).

    Raises AdapterError for a missing file, a pickled checkpoint, a non-LoRA or unsupported PEFT
    feature (DoRA, LoRA bias, modules_to_save, fan_in_fan_out), or inconsistent tensor shapes.
    """
    from safetensors.numpy import load_file
    cfg_path = os.path.join(path, CONFIG_NAME)
    w_path = os.path.join(path, WEIGHTS_NAME)
    if not os.path.isfile(cfg_path):
        raise AdapterError(f"{path!r} is not a PEFT adapter directory: {CONFIG_NAME} is missing")
    if not os.path.isfile(w_path):
        if os.path.isfile(os.path.join(path, "adapter_model.bin")):
            raise AdapterError(f"{path!r} holds adapter_model.bin (pickle); only {WEIGHTS_NAME} is loaded. "
                               "Re-save it with save_pretrained(..., safe_serialization=True)")
        raise AdapterError(f"{path!r}: {WEIGHTS_NAME} is missing")
    with open(cfg_path) as f:
        cfg = json.load(f)
    if cfg.get("peft_type", "LORA") != "LORA":
        raise AdapterError(f"{path!r}: peft_type {cfg.get('peft_type')!r} is not LORA")
    for key, bad, what in (("use_dora", True, "DoRA"), ("lora_bias", True, "LoRA bias"),
                           ("fan_in_fan_out", True, "fan_in_fan_out (Conv1D) layers")):
        if cfg.get(key) == bad:
            raise AdapterError(f"{path!r}: {what} ({key}={bad}) is not supported")
    if cfg.get("modules_to_save"):
        raise AdapterError(f"{path!r}: modules_to_save={cfg['modules_to_save']} replaces whole layers per "
                           "adapter, which multi-LoRA serving does not support")
    r = int(cfg["r"])
    alpha = float(cfg.get("lora_alpha", r))
    rslora = bool(cfg.get("use_rslora", False))
    for key in ("trainable_token_indices", "target_parameters", "layer_replication"):
        if cfg.get(key):
            raise AdapterError(f"{path!r}: {key}={cfg[key]!r} is not supported")
    tensors = load_file(w_path)
    parts: dict = collections.defaultdict(dict)
    base_layers = {}
    for key, value in tensors.items():
        k = key.removeprefix("base_model.model.")
        if k.endswith(".base_layer.weight"):
            # PEFT saves a copy of a targeted embedding / LM head (for resized vocabularies): it is
            # the base model's own weight; only its shape is checked against the model.
            base_layers[k[: -len(".base_layer.weight")]] = tuple(value.shape)
            continue
        m = _KEY.match(k)
        rest = m.group("rest").split(".")[1:] if m else []
        if m is None or "bias" in rest or len(rest) > 2 or (len(rest) == 2 and rest[-1] != "weight"):
            raise AdapterError(f"{path!r}: tensor {key!r} is not a LoRA A/B weight (unsupported PEFT feature?)")
        parts[m.group("module")][m.group("kind")] = np.asarray(value, np.float32)
    modules = {}
    for module, kinds in sorted(parts.items()):
        if set(kinds) == {"lora_A", "lora_B"}:
            a, b, kind = kinds["lora_A"], kinds["lora_B"], "linear"
        elif set(kinds) == {"lora_embedding_A", "lora_embedding_B"}:
            a, b, kind = kinds["lora_embedding_A"], kinds["lora_embedding_B"], "embedding"
        else:
            raise AdapterError(f"{path!r}: module {module!r} has tensors {sorted(kinds)}; expected lora_A and "
                               "lora_B (or lora_embedding_A and lora_embedding_B)")
        if a.ndim != 2 or b.ndim != 2 or a.shape[0] != b.shape[1]:
            raise AdapterError(f"{path!r}: module {module!r}: A {a.shape} and B {b.shape} do not have one "
                               "rank (A (r, in), B (out, r))")
        r_m = int(_pattern_value(cfg.get("rank_pattern"), module, r))
        alpha_m = float(_pattern_value(cfg.get("alpha_pattern"), module, alpha))
        if a.shape[0] != r_m:
            raise AdapterError(f"{path!r}: module {module!r} has rank {a.shape[0]}, but adapter_config.json "
                               f"says r={r_m}")
        modules[module] = (a, b, _scaling(alpha_m, r_m, rslora), kind)
    if not modules:
        raise AdapterError(f"{path!r}: {WEIGHTS_NAME} holds no LoRA weights")
    return PeftAdapter(name or os.path.basename(os.path.normpath(path)), r, alpha, rslora,
                       cfg.get("target_modules"), modules, cfg, base_layers)


def save_peft_adapter(path: str, modules: Mapping[str, tuple], *, r: int, lora_alpha: float,
                      use_rslora: bool = False, base_model_name_or_path: str | None = None,
                      rank_pattern: dict | None = None) -> None:
    """Writes an adapter in PEFT's format (what `PeftModel.save_pretrained` writes).

    modules: {Hugging Face module name: (A, B)}; embeddings are recognised by name ("embed_tokens")
    and stored as lora_embedding_A (r, vocab) / lora_embedding_B (dim, r).
    """
    from safetensors.numpy import save_file
    os.makedirs(path, exist_ok=True)
    tensors = {}
    for module, (a, b) in modules.items():
        emb = module.split(".")[-1] in ("embed_tokens", "wte", "word_embeddings")
        ka, kb = ("lora_embedding_A", "lora_embedding_B") if emb else ("lora_A.weight", "lora_B.weight")
        tensors[f"base_model.model.{module}.{ka}"] = np.ascontiguousarray(a, np.float32)
        tensors[f"base_model.model.{module}.{kb}"] = np.ascontiguousarray(b, np.float32)
    save_file(tensors, os.path.join(path, WEIGHTS_NAME), metadata={"format": "pt"})
    targets = sorted({m.split(".")[-1] for m in modules})
    cfg = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": int(r), "lora_alpha": lora_alpha,
           "use_rslora": bool(use_rslora), "target_modules": targets, "lora_dropout": 0.0, "bias": "none",
           "fan_in_fan_out": False, "use_dora": False, "modules_to_save": None,
           "rank_pattern": rank_pattern or {}, "alpha_pattern": {}, "init_lora_weights": True,
           "base_model_name_or_path": base_model_name_or_path, "inference_mode": True}
    with open(os.path.join(path, CONFIG_NAME), "w") as f:
        json.dump(cfg, f, indent=2)
