"""Hugging Face causal LMs served with many LoRA adapters in one batch (PEFT's mixed-batch convention).

    from transformers import AutoModelForCausalLM
    from torch_lora.hf import MultiLoRAModel

    model = AutoModelForCausalLM.from_pretrained("...")
    mm = MultiLoRAModel(model, max_loras=4, max_rank=16)          # wraps `model` in place
    mm.load_adapter("sql", "adapters/sql")                        # PEFT directories
    mm.load_adapter("chat", "adapters/chat")
    out = mm(input_ids, attention_mask, adapter_names=["sql", "__base__", "chat"])   # one row each
    tokens = mm.generate(input_ids, attention_mask=mask, adapter_names=[...], max_new_tokens=32)

How the model is wrapped. `MultiLoRAModel` does not replace any module: it registers forward
hooks on the targeted modules (every `nn.Linear` of the decoder by default; `embed_tokens` and the
LM head when `target_modules` names them), so the model keeps its class, its parameters, its
state_dict and everything transformers reads from it (tied weights, `embed_scale`, ...). Each hook
adds the LoRA term of each token's adapter to its module's output, through one shared
`torch_lora.PunicaWrapper`:

- Linears that read the same input form one multi-slice layer (`SHARED_INPUT_GROUPS`: q/k/v of an
  attention, gate/up of an MLP, among the targeted modules of one parent): the first member's hook
  computes all their LoRA terms in ONE `add_lora_linear` call and each member adds its columns (see
  `torch_lora.layers.LoRALinear`). In the Llama, Mistral, Qwen2, Qwen3 and Gemma families the
  members read the very same tensor, so a group costs one call.
- `o_proj`, `down_proj` and other lone linears: one `add_lora_linear` each, into the output in place.
- Mixture-of-experts layers: every experts module holding fused `gate_up_proj` (E, 2I, H) and
  `down_proj` (E, H, I) parameters (Mixtral, Qwen2-MoE, Qwen3-MoE) gets a `torch_lora.experts.LoRAExperts`
  and runs its `forward_experts` as its forward (the one module whose forward is replaced, put back
  by `unwrap()`): the base experts plus each routed pair's expert LoRA (PEFT's `target_parameters`
  on those weights), through the wrapper's `add_lora_w13` / `add_lora_w2`.
- The input embedding: `add_lora_embedding` (times the module's `embed_scale` where it has one, as
  PEFT does for Gemma's scaled embeddings). The LM head: `add_lora_logits` on the rows of logits the
  model computes (`logits_to_keep`).

Quantized bases. A hook never reads its module's weight (the module computes its own output), so a
linear layer is any module that takes x (..., in_features) as its first argument and returns its base
output (..., out_features): `nn.Linear` and its subclasses (torchao's int8 / float8 quantized
linears keep the class and swap the weight for a tensor subclass; bitsandbytes' Linear8bitLt and
Linear4bit subclass it), and, named in `target_modules`, any other module with int `in_features` and
`out_features` (`select_target_modules`). The adapter weights' dtype is the module's weight dtype when
that is a 16/32-bit float (torchao's tensors report their float dtype), else the model's activation
dtype (its first 16/32-bit float parameter: the embedding of a bitsandbytes model). DoRA needs plain
float base weights.

Which adapter each token uses: a forward pre-hook on the model reads the batch shape (input_ids or
inputs_embeds, and logits_to_keep) during `__call__` and `generate` and calls `prepare_step`:
the batch's adapters are put into slots (`torch_lora.AdapterManager`: LRU, host cache, uploads
ordered with the compute stream) and the wrapper's metadata is updated in place. Called directly
(`mm.model(...)`), the model uses the metadata of the last `prepare_step`: that is how a decode step
is captured in a CUDA graph and replayed (the wrapper's index tensors and the slot tensors keep
their addresses; call `prepare_step` with the step's adapters before each replay). A layer refuses
an input whose token count differs from the prepared one.

Inference only: `__call__` and `generate` run under `torch.no_grad()`; a direct call with grad
enabled is refused by the layers.

Thread safety: one `MultiLoRAModel` may be shared by threads. Its lock (`mm.lock`, reentrant) makes
what must be serial one unit: `__call__` and `generate` hold it for the whole call (adapters put into
slots -> metadata updated -> every forward pass), `load_adapter`, `unload_adapter` and `prepare_step`
hold it, and every forward pass of the model holds it (a pre-hook takes it, a hook that always runs
gives it back). Concurrent calls therefore run one after another, each with its own adapters. A
direct `mm.model(...)` call uses the metadata of the last `prepare_step`: it is refused with a
RuntimeError when that `prepare_step` was made by another thread; a thread that prepares and then
calls the model (or replays a CUDA graph) while other threads serve holds `with mm.lock:` around both.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from torch import nn

from lora_core import alora
from lora_core.host_mapping import LoRAMapping
from lora_core.peft import AdapterConfig, PeftAdapter

from .adapters import AdapterManager
from .experts import LoRAExperts, is_experts_module
from .layers import LoRAEmbedding, LoRALinear, LoRALogits, check_lora_dtype
from .wrapper import PunicaWrapper

__all__ = ["BASE", "SHARED_INPUT_GROUPS", "MultiLoRAModel", "select_target_modules"]

_LOG = logging.getLogger("torch_lora")

_WRAPPED_MARK = "_torch_lora_wrapped"     # set on a model while a MultiLoRAModel's hooks are on it

BASE = "__base__"           # PEFT's name for "no adapter" in adapter_names

# Sibling linears (same parent module) that a decoder computes from the same input, in slice order.
SHARED_INPUT_GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


def _positive_int(name: str, value: Any) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{name} must be an int > 0, got {value!r}")
    return value


def select_target_modules(model: nn.Module, target_modules: None | str | Sequence[str] = None) -> dict:
    """{module name: module} of the modules of `model` that get LoRA layers.

    target_modules: None or "all-linear" (PEFT's meaning: every nn.Linear but the output layer);
    a list of names, each matching a module whose full name equals it or ends with "." + it (as in
    PEFT: "q_proj", "lm_head", "embed_tokens"); or a regex string matched against full names.
    Matched modules must be nn.Linear (torchao- and bitsandbytes-quantized linears included),
    nn.Embedding, or linear-like: a module with int `in_features` and `out_features` whose forward
    returns its base output (..., out_features) for an input (..., in_features) (other quantized
    linear classes); "all-linear" selects nn.Linear modules only, as PEFT does. Raises ValueError when
    nothing matches (a typo never yields a model without adapters), TypeError for a matched module
    of another type.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    output = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    selected = {}
    if target_modules is None or target_modules == "all-linear":
        for name, module in model.named_modules():
            if isinstance(module, nn.Linear) and module is not output:
                selected[name] = module
        what = "all-linear"
    else:
        if isinstance(target_modules, str):
            patterns: str | tuple = target_modules
        elif isinstance(target_modules, (list, tuple, set)) and all(isinstance(t, str) for t in target_modules):
            patterns = tuple(target_modules)
        else:
            raise TypeError(f"target_modules must be None, 'all-linear', a list of module names or a regex string, "
                            f"got {target_modules!r}")
        # PEFT's own matching rules (lora_core.peft implements them once, for both sides).
        matcher = AdapterConfig(r=1, lora_alpha=1.0, target_modules=patterns)
        for name, module in model.named_modules():
            if name and matcher.targets(name):
                if not isinstance(module, (nn.Linear, nn.Embedding)) and not _linear_like(module):
                    raise TypeError(f"target_modules={target_modules!r} matches {name!r}, a {type(module).__name__}; "
                                    "only nn.Linear and nn.Embedding modules, and linear-like modules (int in_features "
                                    "and out_features, forward(x) returning the base output), can hold LoRA layers")
                selected[name] = module
        what = repr(target_modules)
        if selected and isinstance(patterns, tuple):              # each listed name must match (a typo among others)
            one = {t: AdapterConfig(r=1, lora_alpha=1.0, target_modules=(t,)) for t in patterns}
            unmatched = [t for t in patterns if not any(one[t].targets(n) for n in selected)]
            if unmatched:
                raise ValueError(f"target_modules={what}: {unmatched} match no nn.Linear / nn.Embedding of "
                                 f"{type(model).__name__}")
    if not selected:
        linears = [n for n, m in model.named_modules() if isinstance(m, (nn.Linear, nn.Embedding))]
        raise ValueError(f"target_modules={what} matches no nn.Linear / nn.Embedding of {type(model).__name__} "
                         f"(its modules: {linears[:8]}{' ...' if len(linears) > 8 else ''})")
    return selected


def _embed_scale(module: nn.Module) -> float:
    """The factor a scaled embedding applies to its output (1.0 for a plain nn.Embedding), in the
    weight's dtype as the module applies it."""
    scale = getattr(module, "embed_scale", None)
    if scale is None:
        return 1.0
    if isinstance(scale, torch.Tensor):
        if scale.numel() != 1:
            raise ValueError(f"{type(module).__name__}.embed_scale must be a scalar, got shape {tuple(scale.shape)}")
        return float(scale.detach().to(module.weight.dtype).float().cpu())
    return float(torch.tensor(float(scale), dtype=module.weight.dtype))


def _linear_like(module: nn.Module) -> bool:
    """Whether a module that is not an nn.Linear declares a linear layer's widths (int
    in_features, out_features > 0)."""
    widths = (getattr(module, "in_features", None), getattr(module, "out_features", None))
    return all(isinstance(w, int) and not isinstance(w, bool) and w > 0 for w in widths)


_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _plain_float_weight(module: nn.Module) -> bool:
    """Whether the module's weight is a plain 16/32/64-bit float tensor (not quantized)."""
    w = getattr(module, "weight", None)
    return type(w) in (torch.Tensor, nn.Parameter) and w.dtype in _FLOAT_DTYPES


def _activation_dtype(model: nn.Module) -> torch.dtype | None:
    """The model's first 16/32-bit float parameter's dtype (quantized weights are skipped)."""
    for p in model.parameters():
        if p.dtype in _FLOAT_DTYPES:
            return p.dtype
    return None


def _lora_dtype_and_device(name: str, module: nn.Module, model: nn.Module) -> tuple:
    """(dtype, device) of the LoRA weights of a targeted module: the weight's dtype when it is a
    16/32-bit float (torchao's quantized tensors report their float dtype), else the model's
    activation dtype; the device of the module's weight, else of its first parameter or buffer."""
    w = getattr(module, "weight", None)
    tensors = ([w] if isinstance(w, torch.Tensor) else []) + list(module.parameters(recurse=False)) + list(
        module.buffers(recurse=False))
    if not tensors:
        raise TypeError(f"module {name!r} ({type(module).__name__}) holds no parameter or buffer, so its device is "
                        "unknown: it cannot hold a LoRA layer")
    if isinstance(w, torch.Tensor) and w.dtype in _FLOAT_DTYPES:
        return w.dtype, tensors[0].device
    dtype = _activation_dtype(model)
    if dtype is None:
        raise TypeError(f"module {name!r} ({type(module).__name__}) has a quantized weight and the model has no float "
                        "parameter to take the activation dtype from: the LoRA weights' dtype is unknown")
    return dtype, tensors[0].device


def _input(args: tuple, kwargs: dict, name: str) -> torch.Tensor:
    return args[0] if args else kwargs[name]


class MultiLoRAModel:
    """A Hugging Face causal LM (wrapped in place) that serves a different LoRA adapter per batch row.

    Args:
      model: a transformers causal LM (LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM,
        Qwen3ForCausalLM, GemmaForCausalLM, Gemma2ForCausalLM, Gemma3ForCausalLM, and the mixtures of
        experts MixtralForCausalLM, Qwen2MoeForCausalLM, Qwen3MoeForCausalLM, ...), on one device.
        It gets hooks; `unwrap()` removes them.
      max_loras: adapter slots (distinct adapters in one batch).
      max_rank: the largest adapter rank the slots hold.
      target_modules: which modules get LoRA layers (see `select_target_modules`; default every
        decoder linear). An adapter targeting a module outside them is refused at `load_adapter`.
      max_num_tokens: tokens per forward pass (batch x sequence); max_num_seqs: rows per pass.
      host_cache_size: prepared adapters kept on the host (pinned on CUDA).
      backend: force the wrapper's backend ("torch" reference or "triton"); default: the device's.
      dora: allocate the DoRA column scales now. DoRA adapters (PEFT's use_dora) are served in
        any case, mixed in one batch with plain LoRA adapters and rows without one: a linear layer
        (not the embedding or the LM head) a DoRA adapter touches holds a (max_loras, out_features)
        float32 column-scale buffer, and a DoRA row gets g * (x W^T + delta) + bias with
        g = m / ||W + s B A||_row computed at load from the module's base weight
        (torch_lora.layers.LoRALinear). Without dora=True the buffer of a layer is allocated when
        the first DoRA adapter touching it is put into a slot: a new tensor, so a CUDA graph
        captured before then does not read it (capture after loading a DoRA adapter, or pass
        dora=True to allocate every linear layer's scale up front). Plain LoRA never needs it.
      lora_dtype: None (the LoRA weights in the modules' dtype) or "fp8": every linear layer's slots
        in float8_e4m3fn with float32 per-output-channel scales (contract section 11), a 16-bit
        adapter quantised when it is placed, an fp8 PEFT file's values kept as they are; half
        the slot memory of bf16; the LM head's, the embedding's (its LoRA-A table with one scale
        per row) and the experts' slots too (`LoRAExperts`: per expert and output channel).

    Attributes: `model`, `punica` (the PunicaWrapper), `adapters` (the AdapterManager), `layers`
    ({path: LoRA layer}; a group's path is its parent's name + "." + the members' names joined by "+"),
    `lock`.

    Thread safety: safe to share between threads. `__call__`, `generate`, `load_adapter`,
    `unload_adapter`, `prepare_step` and every forward pass of the model hold `lock` (reentrant), so
    concurrent calls run one after another, each row with its own adapter. A direct `model(...)`
    call after another thread's `prepare_step` raises RuntimeError; hold `with mm.lock:` around a
    `prepare_step` and the direct call or CUDA graph replay that uses it.
    """

    def __init__(self, model: nn.Module, *, max_loras: int, max_rank: int,
                 target_modules: None | str | Sequence[str] = None, max_num_tokens: int = 2048,
                 max_num_seqs: int = 256, host_cache_size: int = 8, backend: str | None = None,
                 dora: bool = False, lora_dtype: str | None = None):
        if not isinstance(dora, bool):
            raise TypeError(f"dora must be a bool, got {dora!r}")
        self.lora_dtype = check_lora_dtype(lora_dtype)
        _positive_int("max_loras", max_loras)
        _positive_int("max_rank", max_rank)
        _positive_int("max_num_tokens", max_num_tokens)
        _positive_int("max_num_seqs", max_num_seqs)
        if getattr(model, _WRAPPED_MARK, False):
            raise ValueError(f"this {type(model).__name__} is already wrapped by a MultiLoRAModel (its hooks would "
                             "add that wrapper's adapters too): call its unwrap() first")
        targets = select_target_modules(model, target_modules)
        devices = {p.device for m in targets.values()
                   for p in list(m.parameters(recurse=False)) + list(m.buffers(recurse=False))}
        if len(devices) != 1:
            raise ValueError(f"the targeted modules must be on one device, got {sorted(map(str, devices))}")
        self.device = devices.pop()
        self.model = model
        self.max_loras, self.max_rank, self._dora = max_loras, max_rank, dora
        # Normal tensors even when built under torch.inference_mode(): the slots and the wrapper's
        # metadata block are updated in place later, which an inference tensor refuses outside it.
        with torch.inference_mode(False):
            self.punica = PunicaWrapper(max_num_tokens, max_num_seqs, self.device, max_loras=max_loras,
                                        backend=backend)
            self.layers, members = self._build_layers(model, targets)
            self.adapters = AdapterManager(self.layers, host_cache_size=host_cache_size)
        embeds = [layer for layer in self.layers.values() if isinstance(layer, LoRAEmbedding)]
        config_vocab = getattr(getattr(model, "config", None), "vocab_size", None)
        self.vocab_size = embeds[0].num_embeddings if embeds else (config_vocab if isinstance(config_vocab, int)
                                                                   else 0)
        self._lock = threading.RLock()
        self._held = threading.local()        # .depth: forward passes of this thread holding the lock
        self._prepared_by: int | None = None  # the thread of the last prepare_step
        self._hooks = [module.register_forward_hook(hook, with_kwargs=True) for module, hook in members]
        self._experts = self._install_experts(model)
        self._hooks.append(model.register_forward_pre_hook(self._before_forward, with_kwargs=True))
        self._hooks.append(model.register_forward_hook(self._after_forward, always_call=True))
        setattr(model, _WRAPPED_MARK, True)
        self._ids: dict = {}                 # adapter name -> LoRA id
        self._next_id = 1
        self._rows: list | None = None    # the names of the rows being served (None: caller-managed)
        self._row_weights: list | None = None   # their adapter_weights (None: strength 1)
        self._expand_rows = 1                # generate's rows per prompt (num_beams / num_return_sequences)
        self._alora: dict | None = None      # generate's aLoRA rows: {"starts": [...], "position": int}
        self._closed = False

    # -------------------------------------------------------------- wrapping
    def _build_layers(self, model: nn.Module, targets: dict) -> tuple:
        """({path: LoRA layer}, [(module, forward hook)]) for the targeted modules."""
        output = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
        kw = dict(max_loras=self.max_loras, max_rank=self.max_rank, punica=self.punica)
        layers, members = {}, []
        by_parent: dict = collections.defaultdict(dict)
        specs = {}                # linear name -> (dtype, device) of its LoRA weights
        for name, module in targets.items():
            if isinstance(module, nn.Embedding):
                layer = LoRAEmbedding(name, module.num_embeddings, module.embedding_dim, dtype=module.weight.dtype,
                                      device=module.weight.device, embed_scale=_embed_scale(module),
                                      lora_dtype=self.lora_dtype, **kw)
                layers[name] = layer
                members.append((module, _embedding_hook(layer)))
                continue
            dtype, device = specs[name] = _lora_dtype_and_device(name, module, model)
            if module is output:
                layer = LoRALogits(name, module.in_features, module.out_features, dtype=dtype, device=device,
                                   lora_dtype=self.lora_dtype, **kw)
                layers[name] = layer
                members.append((module, _logits_hook(layer)))
            else:
                parent, _, leaf = name.rpartition(".")
                by_parent[parent][leaf] = module
        no_float = [n for n in specs
                    if getattr(getattr(targets[n], "weight", None), "dtype", None) not in _FLOAT_DTYPES]
        if no_float:
            _LOG.info("MultiLoRAModel: %d targeted modules (%s) hold no float weight; their LoRA weights take the "
                      "model's activation dtype %s", len(no_float),
                      ", ".join(sorted({type(targets[n]).__name__ for n in no_float})), specs[no_float[0]][0])
        for name, module in model.named_modules():
            if name and is_experts_module(module):
                weight = module.gate_up_proj
                layers[name] = LoRAExperts(name, weight.shape[0], weight.shape[2], module.down_proj.shape[2],
                                           dtype=weight.dtype, device=weight.device, lora_dtype=self.lora_dtype, **kw)
        for parent, children in by_parent.items():
            grouped = set()
            for group in SHARED_INPUT_GROUPS:
                leaves = [leaf for leaf in group if leaf in children]
                mods = [children[leaf] for leaf in leaves]
                names = [f"{parent}.{leaf}" if parent else leaf for leaf in leaves]
                if len(leaves) < 2 or len({(m.in_features,) + specs[n] for m, n in zip(mods, names)}) != 1:
                    continue
                path = (f"{parent}." if parent else "") + "+".join(leaves)
                dtype, device = specs[names[0]]
                layer = LoRALinear(names, mods[0].in_features, [m.out_features for m in mods], dtype=dtype,
                                   device=device, lora_dtype=self.lora_dtype, **self._dora_kw(names, mods), **kw)
                layers[path] = layer
                members += [(m, _linear_hook(layer, s, m)) for s, m in enumerate(mods)]
                grouped.update(leaves)
            for leaf, module in children.items():
                if leaf in grouped:
                    continue
                name = f"{parent}.{leaf}" if parent else leaf
                dtype, device = specs[name]
                layer = LoRALinear((name,), module.in_features, (module.out_features,), dtype=dtype, device=device,
                                   lora_dtype=self.lora_dtype, **self._dora_kw([name], [module]), **kw)
                layers[name] = layer
                members.append((module, _linear_hook(layer, 0, module)))
        return layers, members

    def _dora_kw(self, names: list, modules: list) -> dict:
        """A LoRALinear's DoRA arguments: the members' base weights (out, in), read when a DoRA adapter
        is placed; with dora=True the column scale is allocated now. DoRA reads plain float weights
        only: over a quantized member, dora=True raises and no base weights are passed (a DoRA adapter
        on such a layer is refused when it is loaded)."""
        quantized = [(name, m) for name, m in zip(names, modules) if not _plain_float_weight(m)]
        if quantized and self._dora:
            name, m = quantized[0]
            raise TypeError(f"dora=True needs plain float base weights (DoRA's column scale reads them); module "
                            f"{name!r} ({type(m).__name__}) holds a {type(getattr(m, 'weight', None)).__name__} "
                            "weight (quantized): wrap the model with dora=False, or a float model")
        return {"dora": self._dora, "base_weights": None if quantized else [m.weight for m in modules]}

    @property
    def dora(self) -> bool:
        """Whether any linear layer holds a DoRA column scale (dora=True, or a DoRA adapter loaded)."""
        return any(getattr(layer, "dora", False) for layer in self.layers.values())

    def _install_experts(self, model: nn.Module) -> list:
        """Each experts module's forward set to its LoRAExperts' `forward_experts` (an instance
        attribute, removed by unwrap); returns the modules."""
        modules = []
        for name, module in model.named_modules():
            layer = self.layers.get(name)
            if isinstance(layer, LoRAExperts):
                module.forward = _experts_forward(layer, module)
                modules.append(module)
        return modules

    def unwrap(self) -> nn.Module:
        """Removes every hook and returns the plain model (adapters no longer apply). The wrapper
        is then closed: serving or loading through it raises; the model can be wrapped again."""
        with self._lock:                          # not while another thread's call runs
            for h in self._hooks:
                h.remove()
            self._hooks = []
            for module in self._experts:
                module.__dict__.pop("forward", None)
            self._experts = []
            if getattr(self.model, _WRAPPED_MARK, False):
                delattr(self.model, _WRAPPED_MARK)
            self._closed = True
        return self.model

    def _check_open(self) -> None:
        if self._closed:
            raise ValueError("this MultiLoRAModel was unwrapped: its hooks are gone and adapters would not apply "
                             "(wrap the model again)")

    @property
    def lock(self) -> threading.RLock:
        """The wrapper's reentrant lock (see the module docstring, "Thread safety"): hold it around
        a `prepare_step` and the direct model call or CUDA graph replay that uses it when other
        threads serve through this wrapper."""
        return self._lock

    # -------------------------------------------------------------- adapters
    @property
    def loaded_adapters(self) -> list:
        """The names of the loaded adapters, in load order."""
        return list(self._ids)

    def load_adapter(self, name: str, path: str | os.PathLike | PeftAdapter) -> None:
        """Reads and checks the PEFT adapter at `path` (or a PeftAdapter) and makes it available as
        `name`. Loading a name again replaces its adapter (hot swap: the same slot gets the new
        weights, no CUDA graph needs re-capturing). A bad adapter raises AdapterError (a ValueError
        naming the file, tensor or module) and leaves every loaded adapter as it was. A DoRA adapter
        loads into any model (see `dora`); an aLoRA adapter (alora_invocation_tokens) applies to a
        row from its invocation tokens on (docs/torch.md, "Activated LoRA")."""
        self._check_open()
        if not isinstance(name, str):
            raise TypeError(f"name must be a str, got {type(name).__name__}")
        if not name or name == BASE:
            raise ValueError(f"name must be a non-empty adapter name other than {BASE!r} (which means no adapter), "
                             f"got {name!r}")
        with self._lock:
            lora_id = self._ids.get(name, self._next_id)
            self.adapters.register(lora_id, path, name=name)      # raises before anything changes
            if name not in self._ids:
                self._ids[name] = lora_id
                self._next_id += 1

    def unload_adapter(self, name: str) -> None:
        """Forgets the adapter `name` and frees (zeroes) its slot."""
        with self._lock:
            if name not in self._ids:
                raise ValueError(f"no adapter named {name!r} is loaded (loaded: {self.loaded_adapters})")
            self.adapters.unregister(self._ids.pop(name))

    def pin(self, name: str) -> None:
        """Keeps the adapter `name` in an adapter slot (loading it now if it is in none): the LRU
        never evicts it, so batches that name it never wait for its upload, and a CUDA graph replay
        finds it in the same slot. Raises ValueError naming the adapter and max_loras when every
        slot already holds another pinned adapter. See `AdapterManager.pin`."""
        self._check_open()
        with self._lock:
            self.adapters.pin(self._id_of(name))
            self.adapters.wait_uploads()

    def unpin(self, name: str) -> None:
        """Makes the adapter `name` evictable by the LRU again (it stays in its slot until then)."""
        with self._lock:
            self.adapters.unpin(self._id_of(name))

    @property
    def pinned_adapters(self) -> list:
        """The names of the pinned adapters, in load order."""
        with self._lock:
            pinned = set(self.adapters.pinned)
            return [n for n, i in self._ids.items() if i in pinned]

    def _id_of(self, name: str) -> int:
        if name not in self._ids:
            raise ValueError(f"no adapter named {name!r} is loaded (loaded: {self.loaded_adapters})")
        return self._ids[name]

    def _lora_ids(self, adapter_names: Sequence[str]) -> list:
        """One LoRA id per row (0 for BASE), or per row a tuple of ids where the row names several."""
        if isinstance(adapter_names, str) or not isinstance(adapter_names, (list, tuple)):
            raise TypeError(f"adapter_names must be a list of adapter names (one per row, {BASE!r} for none; a list "
                            f"of names for a row served by several), got {type(adapter_names).__name__}")
        ids = [tuple(self._lora_id(n) for n in name) if isinstance(name, (list, tuple)) else self._lora_id(name)
               for name in adapter_names]
        for name, row in zip(adapter_names, ids):
            for n, i in zip(name, row) if isinstance(row, tuple) else ():
                if i and self.adapters.invocation_tokens(i) is not None:
                    raise ValueError(f"adapter_names holds {n!r}, an activated LoRA (aLoRA), in a row of several "
                                     "adapters: an aLoRA adapter serves its row alone (its invocation decides where "
                                     "it applies)")
        return ids

    def _lora_id(self, name) -> int:
        if name == BASE:
            return 0
        if isinstance(name, str) and name in self._ids:
            return self._ids[name]
        raise ValueError(f"adapter_names holds {name!r}, which is not a loaded adapter (loaded: "
                         f"{self.loaded_adapters}; {BASE!r} = no adapter)")

    def _row_pairs(self, ids: list, adapter_weights) -> tuple | None:
        """(per row a tuple of ids, per row a tuple of weights) when the rows name several adapters or
        carry weights (contract section 10), else None (one adapter per row, at strength 1)."""
        if adapter_weights is None and not any(isinstance(i, tuple) for i in ids):
            return None
        if adapter_weights is not None and (isinstance(adapter_weights, (str, bytes)) or
                                            not isinstance(adapter_weights, (list, tuple))
                                            or len(adapter_weights) != len(ids)):
            raise ValueError(f"adapter_weights must hold one entry per row ({len(ids)}): a weight, or a list of "
                             f"weights for a row of several adapters; got {adapter_weights!r:.200}")
        row_ids = [i if isinstance(i, tuple) else (i,) for i in ids]
        if adapter_weights is None:
            return row_ids, None
        row_w = [tuple(w) if isinstance(w, (list, tuple)) else (w,) for w in adapter_weights]
        for j, (i, w) in enumerate(zip(row_ids, row_w)):
            if len(i) != len(w):
                raise ValueError(f"adapter_weights[{j}] has {len(w)} weights for {len(i)} adapters "
                                 f"(adapter_names[{j}])")
        return row_ids, row_w

    # -------------------------------------------------------------- steps
    def prepare_step(self, adapter_names: Sequence[str], num_tokens_per_row: int,
                     logits_per_row: None | int | Sequence[int] = None, *,
                     active_from: Sequence[int] | None = None, adapter_weights=None) -> None:
        """Sets which adapter each token of the next forward pass uses.

        adapter_names: one name per row ("__base__" = none), or for a row served by several adapters
        a list of names; adapter_weights: None (strength 1), or per row a weight, or a list with one
        weight per name: row j computes x W + sum_i w_i * s_i * (x A_i) B_i (contract section 10);
        num_tokens_per_row: the sequence length S
        of the pass (the model sees (rows, S) tokens); logits_per_row: rows of logits per batch row
        the LM head computes (S by default; 1 for a decode step or `logits_to_keep=1`; a list when
        rows differ: a row's logits are its last positions). active_from: per row, the index in
        0..S of the row's first token that uses its adapter (the earlier ones use none: aLoRA,
        lora_core.alora.active_from); None: every token. Activates the adapters (loads into slots as
        needed), makes the current stream wait for their uploads and updates the wrapper's metadata
        in place (one host-to-device copy, no host sync). `__call__` and `generate` call it; call
        it yourself before a direct `model(...)` call or a CUDA graph replay.
        """
        self._check_open()
        ids = self._lora_ids(adapter_names)
        s = _positive_int("num_tokens_per_row", num_tokens_per_row)
        if logits_per_row is None:
            counts = [s] * len(ids)
        elif isinstance(logits_per_row, int) and not isinstance(logits_per_row, bool):
            counts = [logits_per_row] * len(ids)
        else:
            counts = list(logits_per_row)
        if len(counts) != len(ids) or not all(isinstance(c, int) and 0 <= c <= s for c in counts):
            raise ValueError(f"logits_per_row must be an int or one int per row, each in 0..{s} "
                             f"(num_tokens_per_row), got {logits_per_row!r} for {len(ids)} rows")
        if len(ids) > self.punica.max_batches:
            raise ValueError(f"the batch has {len(ids)} rows, more than max_num_seqs={self.punica.max_batches} "
                             "(MultiLoRAModel's argument)")
        if len(ids) * s > self.punica.max_num_batched_tokens:
            raise ValueError(f"the batch has {len(ids)} x {s} = {len(ids) * s} tokens, more than max_num_tokens="
                             f"{self.punica.max_num_batched_tokens} (MultiLoRAModel's argument)")
        pairs = self._row_pairs(ids, adapter_weights)
        flat_names = [n for row in adapter_names for n in (row if isinstance(row, (list, tuple)) else (row,))]
        distinct = sorted({n for n in flat_names if n != BASE})
        if len(distinct) > self.max_loras:
            raise ValueError(f"the batch names {_plural(len(distinct), 'distinct adapter')} {distinct}, more than "
                             f"max_loras={self.max_loras} (MultiLoRAModel's argument: the adapter slots, the most "
                             "distinct adapters in one batch)")
        on = np.ones((len(ids), s), bool)            # (rows, S): the tokens whose row's adapters apply
        if active_from is not None:
            starts = list(active_from)
            if len(starts) != len(ids) or not all(isinstance(a, (int, np.integer)) and not isinstance(a, bool)
                                                  and 0 <= a <= s for a in starts):
                raise ValueError(f"active_from must hold one int in 0..{s} (num_tokens_per_row) per row, got "
                                 f"{active_from!r:.200} for {len(ids)} rows")
            on = np.arange(s)[None, :] >= np.asarray(starts, np.int64)[:, None]
        if pairs is None:
            per_token = np.where(on, np.asarray(ids, np.int64)[:, None], 0)
            flat_ids = ids
            tokens = per_token.reshape(-1)
            rows = np.concatenate([per_token[j, s - c:] for j, c in enumerate(counts)]) if counts else tokens[:0]
            mapping = LoRAMapping(tokens, rows, is_prefill=s > 1)
        else:
            # several adapters per row (contract section 10): each token's tuple and weights, none where
            # the row's adapter is not active (aLoRA) or the row has none
            row_ids, row_w = pairs
            flat_ids = [i for row in row_ids for i in row]
            row_w = row_w or [(1.0,) * len(row) for row in row_ids]
            tok_ids = [row_ids[j] if on[j, p] else () for j in range(len(ids)) for p in range(s)]
            tok_w = [row_w[j] if on[j, p] else () for j in range(len(ids)) for p in range(s)]
            last = [(j, p) for j, c in enumerate(counts) for p in range(s - c, s)]
            mapping = LoRAMapping(tok_ids, [tok_ids[j * s + p] for j, p in last], s > 1, tok_w,
                                  [tok_w[j * s + p] for j, p in last])
        with self._lock:
            self.adapters.activate(flat_ids)
            self.adapters.wait_uploads()
            self.punica.update_metadata(mapping, self.adapters.lora_index_to_id, self.max_loras + 1, self.vocab_size)
            self._prepared_by = threading.get_ident()

    def _before_forward(self, module, args, kwargs):
        """The model's forward pre-hook: takes the lock for the pass (`_after_forward` gives it
        back); during __call__ / generate, prepares the step for the batch shape the model is
        called with; a direct call checks that this thread prepared the step."""
        self._lock.acquire()
        self._held.depth = getattr(self._held, "depth", 0) + 1
        try:
            self._prepare_for(args, kwargs)
        except BaseException:
            self._after_forward(module, args, None)      # the pass will not run: give the lock back now
            raise

    def _prepare_for(self, args, kwargs) -> None:
        if self._rows is None:
            if self._prepared_by is not None and self._prepared_by != threading.get_ident():
                raise RuntimeError("MultiLoRAModel: the model is called directly, but its last prepare_step was "
                                   "made by another thread (whose adapters it would use): call prepare_step in this "
                                   "thread first, holding `with mm.lock:` around both while other threads serve")
            return
        ref = kwargs.get("input_ids", args[0] if args else None)
        if ref is None:
            ref = kwargs.get("inputs_embeds")
        if ref is None or ref.dim() < 2:
            raise ValueError("MultiLoRAModel needs input_ids (batch, seq) or inputs_embeds (batch, seq, hidden)")
        batch, seq = int(ref.shape[0]), int(ref.shape[1])
        names, weights = self._rows, self._row_weights
        expand = 1
        if len(names) != batch:
            if self._expand_rows > 1 and batch == len(names) * self._expand_rows:   # generate's beams / sequences
                expand = self._expand_rows
                names = [n for n in names for _ in range(expand)]
                weights = None if weights is None else [w for w in weights for _ in range(expand)]
            else:
                raise ValueError(f"adapter_names has {len(names)} names, but the batch has {batch} rows "
                                 "(one name per row)")
        active = None
        invocations = [self._invocation(n) for n in names]
        if any(v is not None for v in invocations):
            if self._alora is not None:             # generate: the prompt's invocation, positions counted
                starts = [st for st in self._alora["starts"] for _ in range(expand)]
                first = self._alora["position"]
                self._alora["position"] += seq
            else:                                    # a forward pass: the invocation in this pass's tokens
                ids = kwargs.get("input_ids", args[0] if args else None)
                if ids is None:
                    raise ValueError(f"aLoRA adapters {sorted({n for n, v in zip(names, invocations) if v})} need "
                                     "input_ids to find their invocation tokens; got inputs_embeds only")
                host = ids.detach().to("cpu").numpy()
                starts = [None if v is None else alora.invocation_start(host[j], v) for j, v in enumerate(invocations)]
                first = 0
            active = [0 if v is None else alora.active_from(st, first, seq) for v, st in zip(invocations, starts)]
        self.prepare_step(names, seq, _logits_rows(kwargs.get("logits_to_keep", 0), batch, seq), active_from=active,
                          adapter_weights=weights)

    def _invocation(self, name) -> tuple | None:
        """The aLoRA invocation tokens of the loaded adapter `name` (None: plain adapter, BASE, or a
        row of several adapters, which take no aLoRA adapter: `_lora_ids`)."""
        if not isinstance(name, str) or name == BASE:
            return None
        return self.adapters.invocation_tokens(self._ids[name])

    def _after_forward(self, module, args, output):
        """The model's forward hook (always called, also when the pass raises): gives back the
        lock `_before_forward` took."""
        if getattr(self._held, "depth", 0) > 0:
            self._held.depth -= 1
            self._lock.release()

    @contextlib.contextmanager
    def _serving(self, adapter_names, expand: int, prompt: torch.Tensor | None = None, adapter_weights=None):
        """Holds the lock and sets the rows' adapters (and weights) for the forward passes of one call.
        With `prompt` (generate's input_ids), an aLoRA row's invocation is searched in its prompt
        once, and the passes are taken to cover consecutive positions from 0 (prefill, then one
        token per decode step), as transformers' generate runs them."""
        with self._lock:
            self._check_open()
            previous = (self._rows, self._expand_rows, self._alora, self._row_weights)
            self._row_pairs(self._lora_ids(adapter_names), adapter_weights)   # bad names / weights fail first
            invocations = [self._invocation(n) for n in adapter_names]
            state = None
            if prompt is not None and any(v is not None for v in invocations):
                host = prompt.detach().to("cpu").numpy()
                state = {"starts": [None if v is None else alora.invocation_start(host[j], v)
                                    for j, v in enumerate(invocations)], "position": 0}
            self._rows, self._expand_rows, self._alora = list(adapter_names), expand, state
            self._row_weights = None if adapter_weights is None else list(adapter_weights)
            try:
                yield
            finally:
                self._rows, self._expand_rows, self._alora, self._row_weights = previous

    def __call__(self, input_ids: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None,
                 adapter_names: Sequence[str] | None = None, adapter_weights=None, **kwargs: Any):
        """The wrapped model's forward pass with row j served by adapter adapter_names[j] (PEFT's
        convention: "__base__" = no adapter; None = every row without adapter; a list of names: the
        row's adapters summed, each at its adapter_weights[j] strength; see `prepare_step`). Returns
        what the model returns (logits (batch, seq or logits_to_keep, vocab), cache, ...)."""
        if adapter_names is None:
            ref = input_ids if input_ids is not None else kwargs.get("inputs_embeds")
            adapter_names = [BASE] * (int(ref.shape[0]) if ref is not None else 0)
        with torch.no_grad(), self._serving(adapter_names, expand=1, adapter_weights=adapter_weights):
            return self.model(input_ids=input_ids, attention_mask=attention_mask, **kwargs)

    def generate(self, input_ids: torch.Tensor | None = None, adapter_names: Sequence[str] | None = None,
                 adapter_weights=None, **generate_kwargs: Any):
        """The model's `generate` with row j served by adapter adapter_names[j] for the whole
        generation (rows expanded by num_return_sequences / num_beams keep their row's adapter);
        a row may name several adapters, with adapter_weights[j] their strengths (`prepare_step`).
        generate_kwargs go to transformers' generate (attention_mask, max_new_tokens, ...); the prompt
        may also be given as `inputs=`, transformers' name for it."""
        if "inputs" in generate_kwargs:
            if input_ids is not None:
                raise ValueError("generate got the prompt twice, as input_ids and as inputs: pass one of them")
            input_ids = generate_kwargs.pop("inputs")
        ref = input_ids if input_ids is not None else generate_kwargs.get("inputs_embeds")
        prompts = int(ref.shape[0]) if ref is not None else 0
        if adapter_names is None:
            adapter_names = [BASE] * prompts
        elif isinstance(adapter_names, (list, tuple)) and ref is not None and len(adapter_names) != prompts:
            raise ValueError(f"adapter_names has {len(adapter_names)} names, but the batch has {prompts} prompts "
                             "(one name per prompt)")
        alora_rows = [n for n in adapter_names if isinstance(n, str) and n in self._ids and self._invocation(n)]
        if alora_rows and input_ids is None:
            raise ValueError(f"aLoRA adapters {sorted(set(alora_rows))} need input_ids to find their invocation "
                             "tokens in the prompt; got inputs_embeds only")
        with torch.no_grad(), self._serving(adapter_names, expand=self._rows_per_prompt(generate_kwargs),
                                            prompt=input_ids if alora_rows else None,
                                            adapter_weights=adapter_weights):
            return self.model.generate(input_ids, **generate_kwargs)

    def _rows_per_prompt(self, generate_kwargs: dict) -> int:
        """The rows transformers' generate makes of each prompt: num_beams for beam search,
        num_return_sequences otherwise (from the arguments, else the generation config)."""
        config = generate_kwargs.get("generation_config") or getattr(self.model, "generation_config", None)

        def setting(name):
            value = generate_kwargs.get(name, getattr(config, name, None))
            return int(value) if value is not None else 1
        beams = setting("num_beams")
        return beams if beams > 1 else setting("num_return_sequences")

    def __repr__(self) -> str:
        return (f"MultiLoRAModel({type(self.model).__name__}, max_loras={self.max_loras}, max_rank={self.max_rank}, "
                f"{len(self.layers)} LoRA layers, adapters={self.loaded_adapters}, backend={self.punica.backend!r}"
                f"{', dora=True' if self.dora else ''})")


def _plural(n: int, noun: str) -> str:
    return f"{n} {noun}" + ("" if n == 1 else "s")


def _logits_rows(logits_to_keep: Any, batch: int, seq: int) -> int | list:
    """Rows of logits per batch row that the model computes for `logits_to_keep` (transformers'
    `slice_logits_to_keep`): an int k keeps the last k positions (0: all); a 1-D tensor, those
    positions; a 2-D integer tensor (batch, K), K per row; a 2-D bool mask, its count per row."""
    if isinstance(logits_to_keep, int) and not isinstance(logits_to_keep, bool):
        return seq if logits_to_keep == 0 else min(logits_to_keep, seq)
    if isinstance(logits_to_keep, torch.Tensor):
        if logits_to_keep.dim() == 1:
            return int(logits_to_keep.shape[0])
        if logits_to_keep.dim() == 2 and logits_to_keep.dtype == torch.bool:
            return [int(c) for c in logits_to_keep.sum(dim=1).tolist()]
        if logits_to_keep.dim() == 2:
            return int(logits_to_keep.shape[1])
    raise TypeError(f"logits_to_keep must be an int or a 1-D / 2-D tensor, got {logits_to_keep!r}")


def _linear_hook(layer: LoRALinear, member: int, module: nn.Module | None = None):
    if module is not None and not isinstance(module, nn.Linear):
        return _checked_linear_hook(layer, member)

    def hook(module, args, kwargs, output):       # a DoRA layer adds the bias after its scale
        return layer.apply(member, _input(args, kwargs, "input"), output, module.bias if layer.dora else None)
    return hook


def _checked_linear_hook(layer: LoRALinear, member: int):
    """The hook of a linear-like module that is not an nn.Linear: checks that its forward returned
    its base output, a tensor (..., out_features), before adding the LoRA term."""
    width = layer.output_slices[member]

    def hook(module, args, kwargs, output):
        if not isinstance(output, torch.Tensor) or output.dim() < 1 or output.shape[-1] != width:
            got = (f"a tensor of shape {tuple(output.shape)}" if isinstance(output, torch.Tensor)
                   else f"a {type(output).__name__}")
            raise TypeError(f"module {layer.module_names[member]!r} ({type(module).__name__}) returned {got}; a module "
                            f"holding a LoRA layer must return its base output (..., out_features={width})")
        bias = getattr(module, "bias", None) if layer.dora else None
        return layer.apply(member, _input(args, kwargs, "input"), output, bias)
    return hook


def _experts_forward(layer: LoRAExperts, module: nn.Module):
    def forward(hidden_states, top_k_index, top_k_weights):
        return layer.forward_experts(module, hidden_states, top_k_index, top_k_weights)
    return forward


def _embedding_hook(layer: LoRAEmbedding):
    def hook(module, args, kwargs, output):
        return layer.apply(_input(args, kwargs, "input"), output)
    return hook


def _logits_hook(layer: LoRALogits):
    def hook(module, args, kwargs, output):
        return layer.apply(_input(args, kwargs, "input"), output)
    return hook
