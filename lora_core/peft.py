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
  package does not compute (DoRA, aLoRA, LoRA bias, ...) and are accepted only at their default
  value. A field in none of the tables is refused too: an unknown field may change the math.
  The tables classify every field of peft 0.21's `LoraConfig` (tests/test_peft_core.py checks the
  installed peft against them).
- Files: only `adapter_config.json` and `adapter_model.safetensors` are read, and only where their
  real path lies inside the adapter directory (a Hugging Face hub cache snapshot may point into its
  repository's `blobs/`). `adapter_model.bin` is a pickle, which can run code when loaded: it is
  never opened.
- Sizes: the safetensors header is parsed here (8-byte little-endian length, then JSON) with at most
  `max_header_bytes`; every tensor's dtype, shape and offsets are checked against each other and the
  file size, and every LoRA tensor against `max_tensor_bytes`, before any tensor data is read.

Every error is an `AdapterError` (a ValueError) naming the file, the field or tensor, what was
expected and what was received.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
from collections.abc import Mapping
from typing import Any, NamedTuple

import numpy as np

__all__ = [
    "CONFIG_NAME",
    "IMPLEMENTED",
    "MAX_CONFIG_BYTES",
    "MAX_HEADER_BYTES",
    "MAX_TENSOR_BYTES",
    "METADATA",
    "PICKLE_NAME",
    "UNSUPPORTED",
    "WEIGHTS_NAME",
    "AdapterConfig",
    "AdapterError",
    "LoraModule",
    "PeftAdapter",
    "TensorInfo",
    "load_peft_adapter",
    "parse_adapter_config",
    "read_adapter_config",
    "read_safetensors",
    "read_safetensors_header",
    "resolve_adapter_file",
    "save_peft_adapter",
]

CONFIG_NAME = "adapter_config.json"
WEIGHTS_NAME = "adapter_model.safetensors"
PICKLE_NAME = "adapter_model.bin"

MAX_CONFIG_BYTES = 16 * 2**20          # a rank_pattern listing every module of a large model is < 1 MB
MAX_HEADER_BYTES = 100_000_000         # the safetensors library's own limit
MAX_TENSOR_BYTES = 2**31               # per LoRA tensor; vocab 256k x rank 256 in fp32 is 256 MiB


class AdapterError(ValueError):
    """An adapter that cannot be loaded (the message names the file, the field or tensor, what was
    expected and what was received) or placed into a model (the module and the shapes)."""


# ----------------------------------------------------------------------------- config fields

# Read by parse_adapter_config.
IMPLEMENTED = {
    "r": "the rank (int > 0)",
    "lora_alpha": "the scale numerator (number; PEFT's default 8 when absent)",
    "use_rslora": "scaling lora_alpha / sqrt(r) instead of lora_alpha / r",
    "target_modules": "which modules hold LoRA (list of names or suffixes, or a regex over the full name)",
    "exclude_modules": "modules taken out of target_modules (list or regex)",
    "layers_to_transform": "layer indices a list of target_modules is restricted to",
    "layers_pattern": "the name of the layer list layers_to_transform counts in",
    "rank_pattern": "per-module r ({regex matching a name's suffix: r})",
    "alpha_pattern": "per-module lora_alpha ({regex matching a name's suffix: alpha})",
    "peft_type": "must be 'LORA'",
}

# No effect on an adapter's output at inference: provenance, and training or initialisation
# settings whose result is already in the saved A and B.
METADATA = {
    "task_type": "the head the adapter was trained with (modules_to_save holds any new head)",
    "peft_version": "provenance",
    "auto_mapping": "provenance: the base model class",
    "base_model_name_or_path": "provenance",
    "revision": "provenance",
    "inference_mode": "training switch",
    "lora_dropout": "dropout is the identity at inference",
    "init_lora_weights": "initialisation of A and B (values that also change the base weights are refused)",
    "loftq_config": "LoftQ initialisation settings (init_lora_weights='loftq' is refused)",
    "eva_config": "EVA initialisation settings",
    "corda_config": "CorDA initialisation settings (init_lora_weights='corda' is refused)",
    "lora_ga_config": "LoRA-GA initialisation settings (init_lora_weights='lora_ga' is refused)",
    "megatron_core": "module path used only with megatron_config",
    "qalora_group_size": "used only with use_qalora",
    "runtime_config": "runtime-only settings; PEFT drops them when loading",
    "velora_config": "VeLoRA changes the backward pass only; its lora_velora_embed buffers are skipped",
    "monteclora_config": "MonteCLoRA samples A only in training; its sampler buffers are skipped",
    "merge_weights": "peft < 0.3: merge on eval(), same output",
}

# Change an adapter's output in a way this package does not compute: accepted only at a default.
UNSUPPORTED = {
    "use_dora": ((False,), "DoRA (weight-decomposed LoRA) is not supported yet"),
    "alora_invocation_tokens": ((None,), "aLoRA applies the adapter only from its invocation tokens on"),
    "layer_replication": ((None, []), "layer replication serves a model with repeated base layers"),
    "lora_bias": ((False,), "LoRA bias adds a trained bias to lora_B"),
    "use_qalora": ((False,), "QALoRA pools the input in groups before lora_A"),
    "target_parameters": ((None, []), "LoRA on parameters (e.g. MoE expert weights) is not supported"),
    "trainable_token_indices": ((None, [], {}), "trainable tokens replace rows of the embedding"),
    "megatron_config": ((None,), "Megatron parallel LoRA layers are not supported"),
    "use_bdlora": ((None,), "BD-LoRA uses block-diagonal factors"),
    "arrow_config": ((None,), "Arrow routes each token to a mixture of LoRA experts"),
    "kasa_config": ((None,), "KaSA inserts learned singular values between A and B"),
    "ensure_weight_tying": ((False,), "adapters tied between the embedding and the LM head are not supported"),
    "modules_to_save": ((None, []), "modules_to_save replaces whole layers per adapter (multi-LoRA serving cannot)"),
    "fan_in_fan_out": ((False,), "fan_in_fan_out marks Conv1D base layers (GPT-2 style, stored (in, out))"),
    "bias": (("none",), "bias='all' / 'lora_only' trains base-layer biases that the adapter carries"),
    "enable_lora": ((None,), "peft < 0.3 MergedLinear LoRA on part of a fused layer is not supported"),
}

# init_lora_weights values that leave the base weights alone; PiSSA, OLoRA, CorDA, LoftQ and LoRA-GA
# subtract their initial factors from the base weights, so such an adapter only works on its own
# modified base model. PEFT re-saves it as a plain LoRA against the original base with
# `save_pretrained(..., path_initial_model_for_weight_conversion=...)` (init_lora_weights becomes true).
_PLAIN_INITS = (True, False, "gaussian", "eva", "orthogonal", "mica")

# Training-state tensors of variants whose inference output is plain LoRA.
_TRAINING_STATE = {"velora_config": ("lora_velora_embed",), "monteclora_config": ("lora_monteclora_sampler",)}


def _is_int(value: Any) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    if not isinstance(value, (int, float, np.integer, np.floating)) or isinstance(value, bool):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:                   # an int too large for a float
        return False


def _short(value: Any, limit: int = 80) -> str:
    """repr(value), cut to `limit` characters (a received value in a message)."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 4] + " ..."


def _same(value: Any, defaults: tuple) -> bool:
    return any(type(value) is type(d) and value == d for d in defaults)


def _patterns(names: Any, where: str, field: str, allow_regex: bool) -> tuple | str | None:
    """A list of strings (as a tuple), a regex string, or None; anything else is an AdapterError."""
    if names is None:
        return None
    if isinstance(names, str):
        if not allow_regex:
            raise AdapterError(f"{where}: field {field!r} must be a list of strings, got the string {_short(names)}")
        try:
            re.compile(names)
        except re.error as e:
            raise AdapterError(f"{where}: field {field!r} is not a valid regular expression: {names!r} ({e})") from None
        return names
    if isinstance(names, list) and all(isinstance(n, str) for n in names):
        return tuple(names)
    alternatives = " or a regex string" if allow_regex else ""
    raise AdapterError(f"{where}: field {field!r} must be a list of strings{alternatives}"
                       f" or null, got {_short(names)} ({type(names).__name__})")


def _pattern_map(value: Any, where: str, field: str, check, expected: str) -> dict:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise AdapterError(f"{where}: field {field!r} must be an object {{module regex: {expected}}}, "
                           f"got {_short(value)} ({type(value).__name__})")
    for key, v in value.items():
        try:
            re.compile(key)
        except re.error as e:
            raise AdapterError(f"{where}: field {field!r}: key {key!r} is not a valid regular expression "
                               f"({e})") from None
        if not check(v):
            raise AdapterError(f"{where}: field {field!r}: value for {key!r} must be {expected}, got {_short(v)}")
    return dict(value)


@dataclasses.dataclass(frozen=True)
class AdapterConfig:
    """What adapter_config.json says about the adapter's math (built by `parse_adapter_config`).

    target_modules / exclude_modules: a tuple of names (a module matches a name equal to its own or
    to its last dotted part(s)), a regex string (full match of the module name), or None.
    layers_to_transform: layer indices (a tuple) or None; layers_pattern: names of the layer list.
    rank_pattern / alpha_pattern: {regex: value}, the first key matching the end of a module's name
    wins (PEFT's `get_pattern_key`).
    """

    r: int
    lora_alpha: float
    use_rslora: bool = False
    target_modules: tuple | str | None = None
    exclude_modules: tuple | str | None = None
    layers_to_transform: tuple | None = None
    layers_pattern: tuple | None = None
    rank_pattern: dict = dataclasses.field(default_factory=dict)
    alpha_pattern: dict = dataclasses.field(default_factory=dict)

    @staticmethod
    def _lookup(pattern: Mapping[str, Any], module: str, default):
        for key, value in pattern.items():
            if re.match(rf"(.*\.)?({key})$", module):
                return value
        return default

    def rank(self, module: str) -> int:
        """The module's r: rank_pattern's value for it, else r."""
        return int(self._lookup(self.rank_pattern, module, self.r))

    def alpha(self, module: str) -> float:
        """The module's lora_alpha: alpha_pattern's value for it, else lora_alpha."""
        return float(self._lookup(self.alpha_pattern, module, self.lora_alpha))

    def scaling(self, module: str) -> float:
        """alpha / r, or alpha / sqrt(r) with use_rslora (per-module r and alpha)."""
        r = self.rank(module)
        return self.alpha(module) / (math.sqrt(r) if self.use_rslora else r)

    def targets(self, module: str) -> bool:
        """Whether PEFT puts a LoRA layer on `module` (its name in the base model), as
        `peft.tuners.tuners_utils.check_target_module_exists` decides. True when target_modules is
        None (the config does not say; PEFT writes the resolved list when it saves)."""
        excluded = self.exclude_modules
        if isinstance(excluded, str):
            if re.fullmatch(excluded, module):
                return False
        elif excluded and (module in excluded or any(module.endswith(f".{name}") for name in excluded)):
            return False
        targets = self.target_modules
        if targets is None:
            return True
        if targets == "all-linear":          # PEFT resolves it to names before saving; the LM head is excluded
            return module.rpartition(".")[2] != "lm_head"
        if isinstance(targets, str):
            return re.fullmatch(targets, module) is not None
        if module in targets:
            return True
        if not any(module.endswith(f".{name}") for name in targets):
            return False
        if not self.layers_to_transform:
            return True
        if not self.layers_pattern:
            found = re.match(r".*?\.[^.]*\.(?P<idx>\d+)\.", module)
        else:
            found = None
            for pattern in self.layers_pattern:
                found = re.match(rf"(?:^|.*?\.){pattern}\.(?P<idx>\d+)\.", module)
                if found:
                    break
        return found is not None and int(found.group("idx")) in self.layers_to_transform


def parse_adapter_config(config: Any, source: str = CONFIG_NAME) -> AdapterConfig:
    """Checks a decoded adapter_config.json against the field tables and returns its `AdapterConfig`.

    `source` names the file in error messages. Raises AdapterError for an unknown field, a field of
    `UNSUPPORTED` away from its default, a refused init_lora_weights, a peft_type other than LORA,
    or a field of the wrong type or range.
    """
    where = source
    if not isinstance(config, dict):
        raise AdapterError(f"{where}: expected a JSON object {{field: value}}, got {type(config).__name__}")
    for field, value in config.items():
        if field in IMPLEMENTED or field in METADATA:
            continue
        if field in UNSUPPORTED:
            defaults, why = UNSUPPORTED[field]
            if not _same(value, defaults):
                raise AdapterError(f"{where}: field {field!r} = {_short(value)} is not supported: {why} "
                                   f"(accepted: {' or '.join(json.dumps(d) for d in defaults)})")
            continue
        raise AdapterError(f"{where}: unknown field {field!r} (= {_short(value)}); a field this loader does not know "
                           "may change the adapter's output, so the adapter is refused. Known fields: see "
                           "lora_core.peft.IMPLEMENTED, METADATA and UNSUPPORTED")
    peft_type = config.get("peft_type", "LORA")
    if peft_type != "LORA":
        raise AdapterError(f"{where}: field 'peft_type' must be 'LORA', got {_short(peft_type)}")
    init = config.get("init_lora_weights", True)
    if not _same(init, _PLAIN_INITS):
        raise AdapterError(f"{where}: field 'init_lora_weights' = {init!r} is not supported: PiSSA, OLoRA, CorDA, "
                           "LoftQ and LoRA-GA adapters need their own modified base weights; re-save the adapter with "
                           "PEFT's save_pretrained(..., path_initial_model_for_weight_conversion=...) to get a plain "
                           f"LoRA (accepted: {', '.join(json.dumps(v) for v in _PLAIN_INITS)})")
    if "r" not in config:
        raise AdapterError(f"{where}: field 'r' (the rank, an int > 0) is missing")
    r = config["r"]
    if not _is_int(r) or r <= 0:
        raise AdapterError(f"{where}: field 'r' must be an int > 0, got {_short(r)} ({type(r).__name__})")
    alpha = config.get("lora_alpha", 8)          # LoraConfig's default
    if not _is_number(alpha):
        raise AdapterError(f"{where}: field 'lora_alpha' must be a finite number, got {_short(alpha)} "
                           f"({type(alpha).__name__})")
    rslora = config.get("use_rslora", False)
    if not isinstance(rslora, bool):
        raise AdapterError(f"{where}: field 'use_rslora' must be true or false, got {_short(rslora)}")
    targets = _patterns(config.get("target_modules"), where, "target_modules", allow_regex=True)
    excluded = _patterns(config.get("exclude_modules"), where, "exclude_modules", allow_regex=True)
    layers = config.get("layers_to_transform")
    if layers is not None:
        if _is_int(layers):
            layers = [layers]
        if not isinstance(layers, list) or not all(_is_int(i) and i >= 0 for i in layers):
            raise AdapterError(f"{where}: field 'layers_to_transform' must be an int >= 0, a list of them or null, "
                               f"got {_short(layers)}")
        layers = tuple(int(i) for i in layers)
    layers_pattern = config.get("layers_pattern")
    if isinstance(layers_pattern, str):
        layers_pattern = [layers_pattern] if layers_pattern else []
    layers_pattern = _patterns(layers_pattern, where, "layers_pattern", allow_regex=False)
    if isinstance(targets, str) and (layers is not None or layers_pattern):
        raise AdapterError(f"{where}: fields 'layers_to_transform' / 'layers_pattern' need target_modules as a list, "
                           f"got the regex {_short(targets)} (PEFT refuses this config too)")
    if layers_pattern and layers is None:
        raise AdapterError(f"{where}: field 'layers_pattern' = {list(layers_pattern)!r} needs layers_to_transform "
                           "(PEFT refuses this config too)")
    rank_pattern = _pattern_map(config.get("rank_pattern"), where, "rank_pattern",
                                lambda v: _is_int(v) and v > 0, "an int > 0")
    alpha_pattern = _pattern_map(config.get("alpha_pattern"), where, "alpha_pattern", _is_number, "a finite number")
    return AdapterConfig(int(r), float(alpha), rslora, targets, excluded, layers,
                         tuple(layers_pattern) if layers_pattern else None, rank_pattern, alpha_pattern)


# ----------------------------------------------------------------------------- files

def _hub_repository(directory: str) -> str | None:
    """The repository folder of a Hugging Face hub cache snapshot holding `directory` (a real path),
    `<repository>/snapshots/<revision>[/...]`, whose files link into `<repository>/blobs/`; else None."""
    parts = directory.split(os.sep)
    for i in range(len(parts) - 2, 0, -1):
        if parts[i] == "snapshots":
            repository = os.sep.join(parts[:i]) or os.sep
            return repository if os.path.isdir(os.path.join(repository, "blobs")) else None
    return None


def resolve_adapter_file(directory: str, filename: str) -> str | None:
    """The real path of `directory/filename`, or None when there is no such file.

    Raises AdapterError when the file resolves (through symlinks) outside the directory's real path,
    or to something that is not a regular file. A Hugging Face hub cache snapshot
    (`.../snapshots/<revision>/`) may link into its repository's `blobs/`.
    """
    path = os.path.join(directory, filename)
    if not os.path.lexists(path):
        return None
    real_dir = os.path.realpath(directory)
    real = os.path.realpath(path)
    inside = os.path.commonpath([real_dir, real]) == real_dir
    if not inside:
        repository = _hub_repository(real_dir)
        blobs = os.path.join(repository, "blobs") if repository else None
        inside = blobs is not None and os.path.commonpath([blobs, real]) == blobs
    if not inside:
        raise AdapterError(f"{path}: resolves to {real}, outside the adapter directory {real_dir}; only files "
                           "inside the adapter directory are read")
    if not os.path.isfile(real):
        kind = ("a directory" if os.path.isdir(real) else "a special file" if os.path.exists(real)
                else "a broken link")
        raise AdapterError(f"{path}: expected a regular file, got {kind}"
                           + ("" if real == os.path.abspath(path) else f" ({real})"))
    return real


def _no_duplicates(where: str, what: str):
    def hook(pairs):
        out = {}
        for key, value in pairs:
            if key in out:
                raise AdapterError(f"{where}: {what} {key!r} appears twice")
            out[key] = value
        return out
    return hook


def _refuse_constant(where: str):
    def hook(name):
        raise AdapterError(f"{where}: expected JSON numbers, got {name}")
    return hook


def read_adapter_config(directory: str | os.PathLike) -> tuple[AdapterConfig, dict]:
    """(parsed config, the decoded JSON object) of `directory/adapter_config.json`."""
    directory = os.fspath(directory)
    path = os.path.join(directory, CONFIG_NAME)
    real = resolve_adapter_file(directory, CONFIG_NAME)
    if real is None:
        raise AdapterError(f"{directory}: not a PEFT adapter directory: {CONFIG_NAME} is missing")
    size = os.path.getsize(real)
    if size > MAX_CONFIG_BYTES:
        raise AdapterError(f"{path}: {size} bytes, more than the {MAX_CONFIG_BYTES} bytes a config may have")
    with open(real, "rb") as f:
        data = f.read(MAX_CONFIG_BYTES + 1)
    try:
        raw = json.loads(data.decode("utf-8"), object_pairs_hook=_no_duplicates(path, "field"),
                         parse_constant=_refuse_constant(path))
    except UnicodeDecodeError as e:
        raise AdapterError(f"{path}: expected UTF-8 JSON, got undecodable bytes at offset {e.start}") from None
    except json.JSONDecodeError as e:
        raise AdapterError(f"{path}: expected a JSON object, got malformed JSON ({e.msg} at line {e.lineno} "
                           f"column {e.colno})") from None
    return parse_adapter_config(raw, path), raw


# ----------------------------------------------------------------------------- safetensors

# safetensors dtype -> (item size in bytes, NumPy dtype read, or None for dtypes never read).
_DTYPES = {
    "BOOL": (1, None), "U8": (1, None), "I8": (1, None), "F8_E5M2": (1, None), "F8_E4M3": (1, None),
    "F8_E8M0": (1, None), "I16": (2, None), "U16": (2, None), "I32": (4, None), "U32": (4, None),
    "I64": (8, None), "U64": (8, None),
    "F16": (2, "<f2"), "BF16": (2, "<u2"), "F32": (4, "<f4"), "F64": (8, "<f8"),
}


class TensorInfo(NamedTuple):
    """A tensor as a safetensors header declares it; `begin` / `end` are absolute file offsets."""

    name: str
    dtype: str
    shape: tuple
    begin: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


def read_safetensors_header(path: str, *, max_header_bytes: int = MAX_HEADER_BYTES) -> dict[str, TensorInfo]:
    """{name: TensorInfo} of a safetensors file, every entry checked; no tensor data is read.

    The file is an 8-byte little-endian header length n, n bytes of JSON {name: {"dtype", "shape",
    "data_offsets": [begin, end]}} (plus an optional "__metadata__" {str: str}), then the data. Checks:
    n <= max_header_bytes and within the file; each dtype known; each shape a list of ints >= 0;
    end - begin == prod(shape) * item size; the tensors tile the data section exactly (no gap,
    overlap or trailing bytes, as the safetensors library requires).
    """
    size = os.path.getsize(path)
    if size < 8:
        raise AdapterError(f"{path}: expected a safetensors file (an 8-byte header length, a JSON header, the data), "
                           f"got {size} bytes")
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        if n > max_header_bytes:
            raise AdapterError(f"{path}: header length field says {n} bytes, more than the limit of {max_header_bytes} "
                               "(corrupt or not a safetensors file)")
        if n > size - 8:
            raise AdapterError(f"{path}: header length field says {n} bytes, but only {size - 8} bytes follow "
                               "(truncated or not a safetensors file)")
        text = f.read(n)
    try:
        header = json.loads(text.decode("utf-8"), object_pairs_hook=_no_duplicates(path, "header key"),
                            parse_constant=_refuse_constant(path))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise AdapterError(f"{path}: expected a JSON object as the safetensors header, got undecodable or malformed "
                           f"bytes ({e}); truncated or not a safetensors file") from None
    if not isinstance(header, dict):
        raise AdapterError(f"{path}: expected a JSON object as the safetensors header, got {type(header).__name__}")
    metadata = header.pop("__metadata__", None)
    if metadata is not None and not (isinstance(metadata, dict)
                                     and all(isinstance(v, str) for v in metadata.values())):
        raise AdapterError(f"{path}: header '__metadata__' must be an object of strings, got {_short(metadata)}")
    start = 8 + n
    data_bytes = size - start
    tensors = {}
    for name, entry in header.items():
        if not isinstance(entry, dict) or set(entry) != {"dtype", "shape", "data_offsets"}:
            raise AdapterError(f"{path}: tensor {name!r}: expected {{'dtype', 'shape', 'data_offsets'}}, "
                               f"got {_short(entry)}")
        dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
        if dtype not in _DTYPES:
            raise AdapterError(f"{path}: tensor {name!r}: dtype {dtype!r} is not a safetensors dtype this loader "
                               f"knows ({', '.join(_DTYPES)})")
        if not isinstance(shape, list) or not all(_is_int(d) and d >= 0 for d in shape):
            raise AdapterError(f"{path}: tensor {name!r}: shape must be a list of ints >= 0, got {_short(shape)}")
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(_is_int(o) for o in offsets)
                and 0 <= offsets[0] <= offsets[1]):
            raise AdapterError(f"{path}: tensor {name!r}: data_offsets must be [begin, end] with 0 <= begin <= end, "
                               f"got {_short(offsets)}")
        declared = math.prod(shape) * _DTYPES[dtype][0]
        if offsets[1] - offsets[0] != declared:
            raise AdapterError(f"{path}: tensor {name!r}: {dtype} {tuple(shape)} needs {declared} bytes, but "
                               f"data_offsets {offsets} span {offsets[1] - offsets[0]}")
        if offsets[1] > data_bytes:
            raise AdapterError(f"{path}: tensor {name!r}: data_offsets {offsets} end past the {data_bytes} data bytes "
                               "of the file (truncated?)")
        tensors[name] = TensorInfo(name, dtype, tuple(shape), start + offsets[0], start + offsets[1])
    covered = start
    for info in sorted(tensors.values(), key=lambda t: (t.begin, t.end)):
        if info.begin != covered:
            what = ("overlaps the tensor before it" if info.begin < covered
                    else f"leaves a gap of {info.begin - covered} bytes")
            raise AdapterError(f"{path}: tensor {info.name!r}: data_offsets [{info.begin - start}, {info.end - start}] "
                               f"{what} (the tensors must tile the data section)")
        covered = info.end
    if covered != size:
        raise AdapterError(f"{path}: {size - covered} bytes after the last tensor; the header declares "
                           f"{covered - start} data bytes, the file has {data_bytes}")
    return tensors


def read_safetensors(path: str, names=None, *, max_header_bytes: int = MAX_HEADER_BYTES,
                     max_tensor_bytes: int = MAX_TENSOR_BYTES) -> dict[str, np.ndarray]:
    """{name: array} for `names` (all tensors when None) of a safetensors file, after
    `read_safetensors_header`'s checks. F16 / F32 / F64 keep their dtype; BF16 is widened to
    float32 (exactly); other dtypes are refused. Each tensor must hold at most max_tensor_bytes."""
    header = read_safetensors_header(path, max_header_bytes=max_header_bytes)
    names = list(header) if names is None else list(names)
    for name in names:
        if name not in header:
            raise AdapterError(f"{path}: tensor {name!r} is missing")
        info = header[name]
        if _DTYPES[info.dtype][1] is None:
            raise AdapterError(f"{path}: tensor {name!r}: expected a float dtype (F16, BF16, F32, F64), "
                               f"got {info.dtype}")
        if info.nbytes > max_tensor_bytes:
            raise AdapterError(f"{path}: tensor {name!r}: {info.dtype} {info.shape} is {info.nbytes} bytes, more than "
                               f"the limit of {max_tensor_bytes} bytes per tensor")
    out = {}
    with open(path, "rb") as f:
        for name in names:
            info = header[name]
            f.seek(info.begin)
            data = bytearray(info.nbytes)
            got = f.readinto(data)
            if got != info.nbytes:
                raise AdapterError(f"{path}: tensor {name!r}: read {got} of {info.nbytes} bytes (file changed "
                                   "while reading?)")
            array = np.frombuffer(data, _DTYPES[info.dtype][1]).reshape(info.shape)
            if info.dtype == "BF16":
                array = (array.astype(np.uint32) << 16).view(np.float32)
            out[name] = array
    return out


# ----------------------------------------------------------------------------- the adapter

class LoraModule(NamedTuple):
    """One module's LoRA: lora_a (r, in) and lora_b (out, r) for a linear layer, lora_a (r, vocab) and
    lora_b (dim, r) for an embedding (kind "embedding"); float32. scaling is not applied."""

    lora_a: np.ndarray
    lora_b: np.ndarray
    scaling: float
    kind: str

    @property
    def rank(self) -> int:
        return int(self.lora_a.shape[0])


@dataclasses.dataclass
class PeftAdapter:
    """A LoRA adapter in PEFT terms, weights on the host as NumPy.

    modules: {module name in the base model (e.g. "model.layers.0.self_attn.q_proj"): LoraModule}
      (a named tuple: lora_a, lora_b, scaling, kind); each module has its own rank and scaling.
    config: adapter_config.json as decoded; base_layer_shapes: {module: shape} of the base weights
      PEFT saved beside an embedding / LM-head LoRA (their data is not read).
    """

    name: str
    r: int
    lora_alpha: float
    use_rslora: bool
    target_modules: Any
    modules: dict
    config: dict = dataclasses.field(default_factory=dict)
    base_layer_shapes: dict = dataclasses.field(default_factory=dict)
    path: str | None = None

    @property
    def max_rank(self) -> int:
        return max(m[0].shape[0] for m in self.modules.values())

    @property
    def ranks(self) -> set:
        return {m[0].shape[0] for m in self.modules.values()}


_KEY = re.compile(r"^(?P<module>.+?)\.(?P<kind>lora_A|lora_B|lora_embedding_A|lora_embedding_B)(?P<rest>(\.[^.]+)*)$")
_PAIRS = {"linear": ("lora_A", "lora_B"), "embedding": ("lora_embedding_A", "lora_embedding_B")}


def load_peft_adapter(path: str | os.PathLike, name: str | None = None, *, max_tensor_bytes: int = MAX_TENSOR_BYTES,
                      max_header_bytes: int = MAX_HEADER_BYTES) -> PeftAdapter:
    """Reads a PEFT LoRA adapter directory (adapter_config.json + adapter_model.safetensors).

    Everything is checked before tensor data is read: the config (see the module docstring), the
    files' real paths, the safetensors header, and every module: a lora_A / lora_B (or
    lora_embedding_A / lora_embedding_B) pair of 2-D tensors with one rank equal to the config's r
    for that module, on a module the config targets. Returns float32 factors and each module's
    scaling. Raises AdapterError naming the file and the field or tensor.
    """
    directory = os.fspath(path)
    if not os.path.isdir(directory):
        raise AdapterError(f"{directory}: expected a PEFT adapter directory, got "
                           f"{'a file' if os.path.exists(directory) else 'nothing (no such path)'}")
    config, raw = read_adapter_config(directory)
    weights_path = os.path.join(directory, WEIGHTS_NAME)
    weights = resolve_adapter_file(directory, WEIGHTS_NAME)
    if weights is None:
        if os.path.lexists(os.path.join(directory, PICKLE_NAME)):
            raise AdapterError(f"{os.path.join(directory, PICKLE_NAME)}: a pickle, which can run code when loaded, so "
                               f"it is never read; only {WEIGHTS_NAME} is. Re-save the adapter with "
                               "save_pretrained(..., safe_serialization=True)")
        raise AdapterError(f"{weights_path}: missing ({CONFIG_NAME} is there)")
    header = read_safetensors_header(weights, max_header_bytes=max_header_bytes)
    skip = tuple(part for field, parts in _TRAINING_STATE.items() if raw.get(field) is not None for part in parts)

    # Sort the tensor names into modules before any data is read.
    parts: dict = {}
    base_layers = {}
    for key, info in header.items():
        name_in_model = key.removeprefix("base_model.model.")
        if name_in_model.endswith(".base_layer.weight"):
            # PEFT's copy of a targeted embedding / LM head (for resized vocabularies): the base
            # model's own weight; only its shape is checked against the model.
            base_layers[name_in_model[: -len(".base_layer.weight")]] = info.shape
            continue
        if skip and any(f".{part}." in f".{name_in_model}." for part in skip):
            continue
        m = _KEY.match(name_in_model)
        rest = m.group("rest").split(".")[1:] if m else []
        if m is None or "bias" in rest or len(rest) > 2 or (len(rest) == 2 and rest[-1] != "weight"):
            raise AdapterError(f"{weights_path}: tensor {key!r} is not a LoRA A/B weight (expected "
                               "<module>.lora_A.weight, .lora_B.weight, .lora_embedding_A or .lora_embedding_B); "
                               "an unsupported PEFT feature?")
        kinds = parts.setdefault(m.group("module"), {})
        if m.group("kind") in kinds:
            raise AdapterError(f"{weights_path}: tensors {kinds[m.group('kind')]!r} and {key!r} are both "
                               f"{m.group('kind')} of module {m.group('module')!r}")
        kinds[m.group("kind")] = key
    if not parts:
        raise AdapterError(f"{weights_path}: expected LoRA weights, got none (tensors: {sorted(header)[:6]})")

    plan = {}
    for module, kinds in sorted(parts.items()):
        kind = next((k for k, pair in _PAIRS.items() if set(kinds) == set(pair)), None)
        if kind is None:
            raise AdapterError(f"{weights_path}: module {module!r} has tensors {sorted(kinds)}; expected lora_A and "
                               "lora_B (or lora_embedding_A and lora_embedding_B)")
        key_a, key_b = (kinds[k] for k in _PAIRS[kind])
        shape_a, shape_b = header[key_a].shape, header[key_b].shape
        if len(shape_a) != 2 or len(shape_b) != 2 or shape_a[0] != shape_b[1]:
            raise AdapterError(f"{weights_path}: module {module!r}: expected A (r, in) and B (out, r) with one r, got "
                               f"{key_a!r} {shape_a} and {key_b!r} {shape_b}")
        if not config.targets(module):
            raise AdapterError(f"{weights_path}: tensor {key_a!r} is for module {module!r}, which {CONFIG_NAME} does "
                               f"not target (target_modules={raw.get('target_modules')!r}, layers_to_transform="
                               f"{raw.get('layers_to_transform')!r}, exclude_modules={raw.get('exclude_modules')!r}); "
                               "PEFT would not load it")
        if shape_a[0] != config.rank(module):
            raise AdapterError(f"{weights_path}: module {module!r} has rank {shape_a[0]} ({key_a!r} {shape_a}), but "
                               f"{CONFIG_NAME} says r={config.rank(module)}")
        plan[module] = (key_a, key_b, kind)
    arrays = read_safetensors(weights, [k for a, b, _ in plan.values() for k in (a, b)],
                              max_header_bytes=max_header_bytes, max_tensor_bytes=max_tensor_bytes)
    modules = {module: LoraModule(np.asarray(arrays[a], np.float32), np.asarray(arrays[b], np.float32),
                                  config.scaling(module), kind)
               for module, (a, b, kind) in plan.items()}
    return PeftAdapter(name or os.path.basename(os.path.normpath(directory)), config.r, config.lora_alpha,
                       config.use_rslora, raw.get("target_modules"), modules, raw, base_layers, directory)


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
