"""adapter_config.json: the fields PEFT writes, which of them this package computes, and their values checked.

`parse_adapter_config` turns the JSON object into an `AdapterConfig` (per module: rank, alpha,
scaling, whether PEFT targets it). Every field is looked up in IMPLEMENTED, METADATA and UNSUPPORTED
(see the package docstring).
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from collections.abc import Mapping
from typing import Any

import numpy as np

from ..errors import AdapterError
from .patterns import MAX_KEY_LOOPS, compile_guarded

CONFIG_NAME = "adapter_config.json"
WEIGHTS_NAME = "adapter_model.safetensors"
PICKLE_NAME = "adapter_model.bin"

MAX_CONFIG_BYTES = 16 * 2**20          # a rank_pattern listing every module of a large model is < 1 MB
MAX_HEADER_BYTES = 100_000_000         # the safetensors library's own limit
MAX_TENSOR_BYTES = 2**31               # per LoRA tensor; vocab 256k x rank 256 in fp32 is 256 MiB
MAX_ADAPTER_BYTES = 2**34              # all LoRA tensors of one adapter read without a model to size them by
MAX_DIM = 2**31 - 1                    # a rank or a tensor dimension (the kernels index with int32)
MAX_INVOCATION_TOKENS = 4096          # an aLoRA invocation sequence (a chat-template turn marker is a few tokens)


# ----------------------------------------------------------------------------- config fields

# Read by parse_adapter_config.
IMPLEMENTED = {
    "r": "the rank (int > 0)",
    "lora_alpha": "the scale numerator (number; PEFT's default 8 when absent)",
    "use_rslora": "scaling lora_alpha / sqrt(r) instead of lora_alpha / r",
    "use_dora": "DoRA: each targeted module carries lora_magnitude_vector (read as LoraModule.magnitude)",
    "target_modules": "which modules hold LoRA (list of names or suffixes, or a regex over the full name)",
    "exclude_modules": "modules taken out of target_modules (list or regex)",
    "layers_to_transform": "layer indices a list of target_modules is restricted to",
    "layers_pattern": "the name of the layer list layers_to_transform counts in",
    "rank_pattern": "per-module r ({regex matching a name's suffix: r})",
    "alpha_pattern": "per-module lora_alpha ({regex matching a name's suffix: alpha})",
    "peft_type": "must be 'LORA'",
    "alora_invocation_tokens": "aLoRA: the adapter applies from the last occurrence of these token ids on "
                               "(lora_core.alora); a non-empty list of token ids, or null",
    "target_parameters": "which parameters hold LoRA (names or suffixes of 3-D expert weights such as "
                         "'mlp.experts.gate_up_proj'; read as kind 'experts', see lora_core.peft.experts)",
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
    "layer_replication": ((None, []), "layer replication serves a model with repeated base layers"),
    "lora_bias": ((False,), "LoRA bias adds a trained bias to lora_B"),
    "use_qalora": ((False,), "QALoRA pools the input in groups before lora_A"),
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
TRAINING_STATE_TENSORS = {"velora_config": ("lora_velora_embed",), "monteclora_config": ("lora_monteclora_sampler",)}


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
        compile_guarded(names, where, field)
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
        compile_guarded(key, where, field, max_loops=MAX_KEY_LOOPS, is_key=True)
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
    use_dora: bool = False
    target_modules: tuple | str | None = None
    exclude_modules: tuple | str | None = None
    layers_to_transform: tuple | None = None
    layers_pattern: tuple | None = None
    rank_pattern: dict = dataclasses.field(default_factory=dict)
    alpha_pattern: dict = dataclasses.field(default_factory=dict)
    alora_invocation_tokens: tuple | None = None
    target_parameters: tuple = ()

    @staticmethod
    def _lookup(pattern: Mapping[str, Any], module: str, default):
        r"""PEFT's `re.match(rf"(.*\.)?({key})$", module)`, as a full match of the name from each
        dotted position on (the start, then after each dot; `^` and lookbehinds still see the
        whole name): the same keys match, and the config's pattern runs on its own (its guard in
        lora_core.peft.patterns counts this loop)."""
        starts = [0] + [i + 1 for i, c in enumerate(module) if c == "."]
        for key, value in pattern.items():
            compiled = re.compile(key)
            if any(compiled.fullmatch(module, i) for i in starts):
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

    def targets_parameter(self, parameter: str) -> bool:
        """Whether PEFT wraps the parameter `parameter` (its full name in the base model, e.g.
        "model.layers.0.mlp.experts.down_proj"): equal to an entry of target_parameters or ending
        with "." + one (PEFT's `_inject_parameters`)."""
        return any(parameter == t or parameter.endswith(f".{t}") for t in self.target_parameters)

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
    if r > MAX_DIM:
        raise AdapterError(f"{where}: field 'r' = {_short(r)} is more than {MAX_DIM}, the largest rank (an int32)")
    alpha = config.get("lora_alpha", 8)          # LoraConfig's default
    if not _is_number(alpha):
        raise AdapterError(f"{where}: field 'lora_alpha' must be a finite number, got {_short(alpha)} "
                           f"({type(alpha).__name__})")
    rslora = config.get("use_rslora", False)
    if not isinstance(rslora, bool):
        raise AdapterError(f"{where}: field 'use_rslora' must be true or false, got {_short(rslora)}")
    dora = config.get("use_dora", False)
    if not isinstance(dora, bool):
        raise AdapterError(f"{where}: field 'use_dora' must be true or false, got {_short(dora)}")
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
    for pattern in layers_pattern or ():
        compile_guarded(pattern, where, "layers_pattern", max_loops=1)
    if isinstance(targets, str) and (layers is not None or layers_pattern):
        raise AdapterError(f"{where}: fields 'layers_to_transform' / 'layers_pattern' need target_modules as a list, "
                           f"got the regex {_short(targets)} (PEFT refuses this config too)")
    if layers_pattern and layers is None:
        raise AdapterError(f"{where}: field 'layers_pattern' = {list(layers_pattern)!r} needs layers_to_transform "
                           "(PEFT refuses this config too)")
    rank_pattern = _pattern_map(config.get("rank_pattern"), where, "rank_pattern",
                                lambda v: _is_int(v) and v > 0, "an int > 0")
    for key, v in rank_pattern.items():
        if v > MAX_DIM:
            raise AdapterError(f"{where}: field 'rank_pattern': value for {key!r} = {_short(v)} is more than "
                               f"{MAX_DIM}, the largest rank (an int32)")
    alpha_pattern = _pattern_map(config.get("alpha_pattern"), where, "alpha_pattern", _is_number, "a finite number")
    invocation = config.get("alora_invocation_tokens")
    if invocation is not None:
        if (not isinstance(invocation, list) or not invocation or len(invocation) > MAX_INVOCATION_TOKENS
                or not all(_is_int(t) and 0 <= t <= MAX_DIM for t in invocation)):
            raise AdapterError(f"{where}: field 'alora_invocation_tokens' must be null or a non-empty list of at most "
                               f"{MAX_INVOCATION_TOKENS} token ids (ints in 0..{MAX_DIM}), got {_short(invocation)}")
        if dora:
            raise AdapterError(f"{where}: fields 'alora_invocation_tokens' and 'use_dora' together are not supported "
                               "(an aLoRA adapter is plain LoRA from its invocation on)")
        invocation = tuple(int(t) for t in invocation)
    parameters = _patterns(config.get("target_parameters"), where, "target_parameters", allow_regex=False) or ()
    if parameters and dora:
        raise AdapterError(f"{where}: fields 'target_parameters' and 'use_dora' together: PEFT's parameter LoRA has "
                           "no DoRA variant (PEFT refuses this config too)")
    return AdapterConfig(int(r), float(alpha), rslora, dora, targets, excluded, layers,
                         tuple(layers_pattern) if layers_pattern else None, rank_pattern, alpha_pattern, invocation,
                         parameters)


def unique_json_keys(where: str, what: str):
    def hook(pairs):
        out = {}
        for key, value in pairs:
            if key in out:
                raise AdapterError(f"{where}: {what} {key!r} appears twice")
            out[key] = value
        return out
    return hook


def refuse_json_constants(where: str):
    def hook(name):
        raise AdapterError(f"{where}: expected JSON numbers, got {name}")
    return hook
