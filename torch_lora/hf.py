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
- The input embedding: `add_lora_embedding` (times the module's `embed_scale` where it has one, as
  PEFT does for Gemma's scaled embeddings). The LM head: `add_lora_logits` on the rows of logits the
  model computes (`logits_to_keep`).

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
import os
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from torch import nn

from lora_core.host_mapping import LoRAMapping
from lora_core.peft import AdapterConfig, PeftAdapter

from .adapters import AdapterManager
from .layers import LoRAEmbedding, LoRALinear, LoRALogits
from .wrapper import PunicaWrapper

__all__ = ["BASE", "SHARED_INPUT_GROUPS", "MultiLoRAModel", "select_target_modules"]

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
    Matched modules must be nn.Linear or nn.Embedding. Raises ValueError when nothing matches (a
    typo never yields a model without adapters), TypeError for a matched module of another type.
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
                if not isinstance(module, (nn.Linear, nn.Embedding)):
                    raise TypeError(f"target_modules={target_modules!r} matches {name!r}, a {type(module).__name__}; "
                                    "only nn.Linear and nn.Embedding modules can hold LoRA layers")
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


def _input(args: tuple, kwargs: dict, name: str) -> torch.Tensor:
    return args[0] if args else kwargs[name]


class MultiLoRAModel:
    """A Hugging Face causal LM (wrapped in place) that serves a different LoRA adapter per batch row.

    Args:
      model: a transformers causal LM (LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM,
        Qwen3ForCausalLM, GemmaForCausalLM, Gemma2ForCausalLM, Gemma3ForCausalLM, ...), on one device.
        It gets hooks; `unwrap()` removes them.
      max_loras: adapter slots (distinct adapters in one batch).
      max_rank: the largest adapter rank the slots hold.
      target_modules: which modules get LoRA layers (see `select_target_modules`; default every
        decoder linear). An adapter targeting a module outside them is refused at `load_adapter`.
      max_num_tokens: tokens per forward pass (batch x sequence); max_num_seqs: rows per pass.
      host_cache_size: prepared adapters kept on the host (pinned on CUDA).
      backend: force the wrapper's backend ("torch" reference or "triton"); default: the device's.
      dora: also serve DoRA adapters (PEFT's use_dora), mixed in one batch with plain LoRA
        adapters and rows without one: the linear layers (not the embedding or the LM head) get a
        (max_loras, out_features) float32 column-scale buffer, and a DoRA row gets
        g * (x W^T + delta) + bias with g = m / ||W + s B A||_row computed at load from the
        module's base weight (torch_lora.layers.LoRALinear). Without it a DoRA adapter is refused
        at `load_adapter`.

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
                 dora: bool = False):
        if not isinstance(dora, bool):
            raise TypeError(f"dora must be a bool, got {dora!r}")
        _positive_int("max_loras", max_loras)
        _positive_int("max_rank", max_rank)
        _positive_int("max_num_tokens", max_num_tokens)
        _positive_int("max_num_seqs", max_num_seqs)
        if getattr(model, _WRAPPED_MARK, False):
            raise ValueError(f"this {type(model).__name__} is already wrapped by a MultiLoRAModel (its hooks would "
                             "add that wrapper's adapters too): call its unwrap() first")
        targets = select_target_modules(model, target_modules)
        devices = {p.device for m in targets.values() for p in m.parameters(recurse=False)}
        if len(devices) != 1:
            raise ValueError(f"the targeted modules must be on one device, got {sorted(map(str, devices))}")
        self.device = devices.pop()
        self.model = model
        self.max_loras, self.max_rank, self.dora = max_loras, max_rank, dora
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
        self._hooks.append(model.register_forward_pre_hook(self._before_forward, with_kwargs=True))
        self._hooks.append(model.register_forward_hook(self._after_forward, always_call=True))
        setattr(model, _WRAPPED_MARK, True)
        self._ids: dict = {}                 # adapter name -> LoRA id
        self._next_id = 1
        self._rows: list | None = None    # the names of the rows being served (None: caller-managed)
        self._row_weights: list | None = None   # their adapter_weights (None: strength 1)
        self._expand_rows = 1                # generate's rows per prompt (num_beams / num_return_sequences)
        self._closed = False

    # -------------------------------------------------------------- wrapping
    def _build_layers(self, model: nn.Module, targets: dict) -> tuple:
        """({path: LoRA layer}, [(module, forward hook)]) for the targeted modules."""
        output = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
        kw = dict(max_loras=self.max_loras, max_rank=self.max_rank, punica=self.punica)
        layers, members = {}, []
        by_parent: dict = collections.defaultdict(dict)
        for name, module in targets.items():
            dtype, device = module.weight.dtype, module.weight.device
            if isinstance(module, nn.Embedding):
                layer = LoRAEmbedding(name, module.num_embeddings, module.embedding_dim, dtype=dtype, device=device,
                                      embed_scale=_embed_scale(module), **kw)
                layers[name] = layer
                members.append((module, _embedding_hook(layer)))
            elif module is output:
                layer = LoRALogits(name, module.in_features, module.out_features, dtype=dtype, device=device, **kw)
                layers[name] = layer
                members.append((module, _logits_hook(layer)))
            else:
                parent, _, leaf = name.rpartition(".")
                by_parent[parent][leaf] = module
        for parent, children in by_parent.items():
            grouped = set()
            for group in SHARED_INPUT_GROUPS:
                leaves = [leaf for leaf in group if leaf in children]
                mods = [children[leaf] for leaf in leaves]
                if len(leaves) < 2 or len({(m.in_features, m.weight.dtype) for m in mods}) != 1:
                    continue
                names = [f"{parent}.{leaf}" if parent else leaf for leaf in leaves]
                path = (f"{parent}." if parent else "") + "+".join(leaves)
                layer = LoRALinear(names, mods[0].in_features, [m.out_features for m in mods],
                                   dtype=mods[0].weight.dtype, device=mods[0].weight.device,
                                   **self._dora_kw(mods), **kw)
                layers[path] = layer
                members += [(m, _linear_hook(layer, s)) for s, m in enumerate(mods)]
                grouped.update(leaves)
            for leaf, module in children.items():
                if leaf in grouped:
                    continue
                name = f"{parent}.{leaf}" if parent else leaf
                layer = LoRALinear((name,), module.in_features, (module.out_features,), dtype=module.weight.dtype,
                                   device=module.weight.device, **self._dora_kw([module]), **kw)
                layers[name] = layer
                members.append((module, _linear_hook(layer, 0)))
        return layers, members

    def _dora_kw(self, modules: list) -> dict:
        """A LoRALinear's DoRA arguments: with dora=True, the members' base weights (out, in)."""
        return {"dora": True, "base_weights": [m.weight for m in modules]} if self.dora else {}

    def unwrap(self) -> nn.Module:
        """Removes every hook and returns the plain model (adapters no longer apply). The wrapper
        is then closed: serving or loading through it raises; the model can be wrapped again."""
        with self._lock:                          # not while another thread's call runs
            for h in self._hooks:
                h.remove()
            self._hooks = []
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
        naming the file, tensor or module) and leaves every loaded adapter as it was."""
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

    def _lora_ids(self, adapter_names: Sequence[str]) -> list:
        """One LoRA id per row (0 for BASE), or per row a tuple of ids where the row names several."""
        if isinstance(adapter_names, str) or not isinstance(adapter_names, (list, tuple)):
            raise TypeError(f"adapter_names must be a list of adapter names (one per row, {BASE!r} for none; a list "
                            f"of names for a row served by several), got {type(adapter_names).__name__}")
        return [tuple(self._lora_id(n) for n in name) if isinstance(name, (list, tuple)) else self._lora_id(name)
                for name in adapter_names]

    def _lora_id(self, name) -> int:
        if name == BASE:
            return 0
        if isinstance(name, str) and name in self._ids:
            return self._ids[name]
        raise ValueError(f"adapter_names holds {name!r}, which is not a loaded adapter (loaded: "
                         f"{self.loaded_adapters}; {BASE!r} = no adapter)")

    def _row_pairs(self, ids: list, adapter_weights) -> tuple | None:
        """(per row a tuple of ids, per row a tuple of weights) when the rows name several adapters or
        carry weights (contract section 9), else None (one adapter per row, at strength 1)."""
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
                     logits_per_row: None | int | Sequence[int] = None, adapter_weights=None) -> None:
        """Sets which adapter each token of the next forward pass uses.

        adapter_names: one name per row ("__base__" = none), or for a row served by several adapters
        a list of names; adapter_weights: None (strength 1), or per row a weight, or a list with one
        weight per name: row j computes x W + sum_i w_i * s_i * (x A_i) B_i (contract section 9);
        num_tokens_per_row: the sequence length S
        of the pass (the model sees (rows, S) tokens); logits_per_row: rows of logits per batch row
        the LM head computes (S by default; 1 for a decode step or `logits_to_keep=1`; a list when
        rows differ). Activates the adapters (loads into slots as needed), makes the current
        stream wait for their uploads and updates the wrapper's metadata in place (one host-to-
        device copy, no host sync). `__call__` and `generate` call it; call it yourself before a
        direct `model(...)` call or a CUDA graph replay.
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
        if pairs is None:
            flat_ids = ids
            mapping = LoRAMapping(np.repeat(np.asarray(ids, np.int64), s), np.repeat(np.asarray(ids, np.int64), counts),
                                  is_prefill=s > 1)
        else:
            row_ids, row_w = pairs
            flat_ids = [i for row in row_ids for i in row]
            row_w = row_w or [(1.0,) * len(row) for row in row_ids]
            mapping = LoRAMapping([row for row in row_ids for _ in range(s)],
                                  [row for row, c in zip(row_ids, counts) for _ in range(c)], s > 1,
                                  [w for w in row_w for _ in range(s)],
                                  [w for w, c in zip(row_w, counts) for _ in range(c)])
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
        if len(names) != batch:
            if self._expand_rows > 1 and batch == len(names) * self._expand_rows:   # generate's beams / sequences
                names = [n for n in names for _ in range(self._expand_rows)]
                weights = None if weights is None else [w for w in weights for _ in range(self._expand_rows)]
            else:
                raise ValueError(f"adapter_names has {len(names)} names, but the batch has {batch} rows "
                                 "(one name per row)")
        self.prepare_step(names, seq, _logits_rows(kwargs.get("logits_to_keep", 0), batch, seq), weights)

    def _after_forward(self, module, args, output):
        """The model's forward hook (always called, also when the pass raises): gives back the
        lock `_before_forward` took."""
        if getattr(self._held, "depth", 0) > 0:
            self._held.depth -= 1
            self._lock.release()

    @contextlib.contextmanager
    def _serving(self, adapter_names, expand: int, adapter_weights=None):
        """Holds the lock and sets the rows' adapters (and weights) for the forward passes of one call."""
        with self._lock:
            self._check_open()
            previous = (self._rows, self._expand_rows, self._row_weights)
            self._row_pairs(self._lora_ids(adapter_names), adapter_weights)   # bad names / weights fail first
            self._rows, self._expand_rows = list(adapter_names), expand
            self._row_weights = None if adapter_weights is None else list(adapter_weights)
            try:
                yield
            finally:
                self._rows, self._expand_rows, self._row_weights = previous

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
        with torch.no_grad(), self._serving(adapter_names, expand=self._rows_per_prompt(generate_kwargs),
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


def _linear_hook(layer: LoRALinear, member: int):
    if layer.dora:
        def dora_hook(module, args, kwargs, output):       # the bias is added after DoRA's scale
            return layer.apply(member, _input(args, kwargs, "input"), output, module.bias)
        return dora_hook

    def hook(module, args, kwargs, output):
        return layer.apply(member, _input(args, kwargs, "input"), output)
    return hook


def _embedding_hook(layer: LoRAEmbedding):
    def hook(module, args, kwargs, output):
        return layer.apply(_input(args, kwargs, "input"), output)
    return hook


def _logits_hook(layer: LoRALogits):
    def hook(module, args, kwargs, output):
        return layer.apply(_input(args, kwargs, "input"), output)
    return hook
