"""PEFT LoRA adapters without a framework: adapter_config.json and adapter_model.safetensors as NumPy.

`jax_lora.adapters` (and the torch side) place the adapter read here into their own layers. Reading
needs NumPy alone (the safetensors format is parsed here); `save_peft_adapter` writes with the
safetensors package. A PEFT adapter directory holds `adapter_config.json`
(r, lora_alpha, use_rslora, target_modules, rank_pattern, alpha_pattern, ...) and
`adapter_model.safetensors` with, per targeted module `m` (its name in the base model):

  base_model.model.<m>.lora_A.weight           (r, in)        linear layers (LM head included)
  base_model.model.<m>.lora_B.weight           (out, r)
  base_model.model.<m>.lora_embedding_A        (r, vocab)     embeddings
  base_model.model.<m>.lora_embedding_B        (dim, r)

The adapter adds `scaling * x @ A.T @ B.T` to the module's output, `scaling = lora_alpha / r`
(`lora_alpha / sqrt(r)` with use_rslora), r and lora_alpha per module from rank_pattern and
alpha_pattern. `load_peft_adapter` returns the factors and each module's scaling, unapplied.

What is refused, and why:

- Config fields: every field of adapter_config.json is looked up in three tables. `IMPLEMENTED`
  fields are read; `METADATA` fields do not change an adapter's output at inference (training and
  initialisation settings, provenance); `UNSUPPORTED` fields change the output in a way this
  package does not compute (LoRA bias, QALoRA, modules_to_save, ...) and are accepted only at their default
  value. A field in none of the tables is refused too: an unknown field may change the math.
  The tables classify every field of peft 0.21's `LoraConfig` (tests/test_peft_core.py checks the
  installed peft against them).
- Files: only `adapter_config.json` and `adapter_model.safetensors` are read, and only where their
  real path lies inside the adapter directory (a Hugging Face hub cache snapshot may point into its
  repository's `blobs/`). `adapter_model.bin` is a pickle, which can run code when loaded: it is
  never opened.
- Sizes: the safetensors header is parsed here (8-byte little-endian length, then JSON) with at most
  `max_header_bytes`; every tensor's dtype, shape and offsets are checked against each other and the
  file size, every dimension against MAX_DIM, every LoRA tensor against `max_tensor_bytes` and all
  of them together against `max_total_bytes`, before any tensor data is read. Given the model's
  `module_shapes` (the managers pass theirs), every module's shapes are checked against the
  model's from the header, so a file declaring a tensor larger than its layer is refused without
  reading or allocating it.
- JSON: adapter_config.json and the safetensors header are parsed by lora_core.safe_json, with the
  nesting depth bounded before parsing.
- Regular expressions (a string target_modules / exclude_modules, rank_pattern / alpha_pattern
  keys, layers_pattern) are compiled under the guard of `patterns` (no nested or ambiguous
  quantifiers, few unbounded loops, short names, a time budget), so no config backtracks for long.

Every error is an `AdapterError` (a ValueError) naming the file, the field or tensor, what was
expected and what was received.
"""

from __future__ import annotations

from .adapter import (
    Fp8Factors,
    LoraModule,
    ModuleShape,
    PeftAdapter,
    largest_adapter_bytes,
    load_peft_adapter,
    save_peft_adapter,
)
from .config import (
                     CONFIG_NAME,
                     IMPLEMENTED,
                     MAX_ADAPTER_BYTES,
                     MAX_CONFIG_BYTES,
                     MAX_DIM,
                     MAX_HEADER_BYTES,
                     MAX_TENSOR_BYTES,
                     METADATA,
                     PICKLE_NAME,
                     UNSUPPORTED,
                     WEIGHTS_NAME,
                     AdapterConfig,
                     AdapterError,
                     parse_adapter_config,
)
from .files import read_adapter_config, resolve_adapter_file
from .safetensors_format import TensorInfo, read_safetensors, read_safetensors_header

__all__ = [
    "CONFIG_NAME",
    "IMPLEMENTED",
    "MAX_ADAPTER_BYTES",
    "MAX_CONFIG_BYTES",
    "MAX_DIM",
    "MAX_HEADER_BYTES",
    "MAX_TENSOR_BYTES",
    "METADATA",
    "PICKLE_NAME",
    "UNSUPPORTED",
    "WEIGHTS_NAME",
    "AdapterConfig",
    "AdapterError",
    "Fp8Factors",
    "LoraModule",
    "ModuleShape",
    "PeftAdapter",
    "TensorInfo",
    "largest_adapter_bytes",
    "load_peft_adapter",
    "parse_adapter_config",
    "read_adapter_config",
    "read_safetensors",
    "read_safetensors_header",
    "resolve_adapter_file",
    "save_peft_adapter",
]
