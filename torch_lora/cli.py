"""The `torch-lora` console script. `torch-lora demo`: serve mixed-adapter batches with a Hugging Face
model through torch_lora.hf.MultiLoRAModel, and verify every request against PEFT.

    torch-lora demo                                  # a tiny random Llama + 3 adapters saved by peft
    torch-lora demo --model mixtral                  # a tiny random Mixtral + 3 adapters, expert LoRA included
    torch-lora demo MODEL_DIR ADAPTER_DIR [...]      # any transformers causal LM + PEFT LoRA directories
    python -m torch_lora.cli demo                    # the same without the script

The requests (a quarter of them without adapter) are served in batches with `MultiLoRAModel.generate`
(greedy, left-padded prompts, one adapter per row). Each request is then run alone through PEFT
(`PeftModel` with that adapter active, or disabled) on the served tokens (teacher forcing): PEFT's
logits must equal the served logits (relative error below 1e-4, float32) and PEFT's greedy choice
the served token. The demo ends with `verified: N/N requests match PEFT outputs` and exits 1 when a
request does not match. It runs on CUDA when present (float32, no TF32), else on the CPU.

    torch-lora --version
    torch-lora demo --verbose                        # also transformers' / peft's progress bars and warnings

Bad input is one line on stderr and exit status 2: paths are checked before anything loads, counts
against the memory they need (`--batch-size`, `--requests`), and a missing torch, transformers or
peft is named with what to install. Ctrl-C prints `torch-lora: interrupted` and exits with 130.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import os
import sys
import tempfile
import time
import warnings
from collections.abc import Sequence

from lora_core import checks, cli_support
from lora_core.cli_support import (
    available_host_bytes,
    check_size,
    interrupt_handler,
    on_interrupt,
    plural,
    read_model_sizes,
)

RTOL = 1e-4          # float32 logits, relative to the request's largest |logit|
BASE = "__base__"
BACKENDS = ("torch", "triton")
BATCH_CAP = 4096             # --batch-size: rows of one generate call
REQUESTS_CAP = 100_000       # --requests
REQUEST_HOST_BYTES = 4096    # a request, its prompt and its result beside the kept logits
MAX_PROMPT = 16              # the random requests' longest prompt (_demo_requests)
DEMO_NEEDS = ("torch", "transformers", "peft")
INSTALL_HINT = ("pip install 'jax-torch-lora[torch]' transformers peft (on a CPU machine with PyTorch's CPU index: "
                "see the README)")

# (name, LoraConfig arguments): three ranks; rank_pattern / alpha_pattern; rsLoRA with the embedding
# and the LM head.
DEMO_ADAPTERS = (
    ("sql", {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"]}),
    ("chat", {"r": 8, "lora_alpha": 16, "rank_pattern": {"down_proj": 4}, "alpha_pattern": {"o_proj": 32},
              "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]}),
    ("code", {"r": 16, "lora_alpha": 16, "use_rslora": True,
              "target_modules": ["q_proj", "o_proj", "down_proj", "embed_tokens", "lm_head"]}),
)

# The mixture-of-experts demo (--model mixtral): attention LoRA only; expert LoRA only (PEFT's
# target_parameters on the fused expert weights, rank_pattern); both, with rsLoRA and the LM head.
EXPERT_WEIGHTS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
MOE_DEMO_ADAPTERS = (
    ("attn", {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"]}),
    ("experts", {"r": 8, "lora_alpha": 16, "rank_pattern": {"down_proj": 4}, "target_modules": [],
                 "target_parameters": EXPERT_WEIGHTS}),
    ("mixed", {"r": 16, "lora_alpha": 16, "use_rslora": True, "target_modules": ["q_proj", "o_proj", "lm_head"],
               "target_parameters": EXPERT_WEIGHTS}),
)
DEMO_MODELS = ("llama", "mixtral")


def build_demo_assets(root: str, seed: int = 0, model: str = "llama") -> tuple:
    """Writes a tiny random Llama or Mixtral (model="mixtral": 4 experts, 2 per token; Hugging Face
    format) and the demo's adapters, made and saved by peft itself, under `root`. Returns
    (model_dir, [adapter dirs])."""
    import peft
    import torch
    import transformers

    if model not in DEMO_MODELS:
        raise ValueError(f"model must be one of {', '.join(DEMO_MODELS)}, got {model!r}")
    torch.manual_seed(seed)
    common = dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=False)
    if model == "mixtral":
        cls, cfg = transformers.MixtralForCausalLM, transformers.MixtralConfig(num_local_experts=4,
                                                                               num_experts_per_tok=2, **common)
        adapters = MOE_DEMO_ADAPTERS
    else:
        cls, cfg, adapters = transformers.LlamaForCausalLM, transformers.LlamaConfig(**common), DEMO_ADAPTERS
    model_dir = os.path.join(root, f"tiny-{model}")
    cls(cfg).save_pretrained(model_dir)
    dirs = []
    for i, (name, kw) in enumerate(adapters):
        torch.manual_seed(seed + 1 + i)
        base = cls.from_pretrained(model_dir)
        # init_lora_weights=False: random non-zero B, so every adapter changes the outputs (a trained
        # adapter's B is non-zero too; PEFT's default B = 0 would make the check vacuous).
        lora = peft.get_peft_model(base, peft.LoraConfig(init_lora_weights=False, **kw))
        path = os.path.join(root, f"adapter-{name}-r{kw['r']}")
        lora.save_pretrained(path)
        dirs.append(path)
    return model_dir, dirs


def _demo_requests(vocab_size: int, names: Sequence[str], num_requests: int, seed: int, max_prompt: int = 16) -> list:
    """[(request id, adapter name, prompt token list)]: prompts of 4..max_prompt tokens, adapters in
    turn (BASE among them), shuffled."""
    import numpy as np

    rng = np.random.default_rng(seed)
    requests = [(i, names[i % len(names)], [int(t) for t in rng.integers(1, vocab_size,
                                                                         size=int(rng.integers(4, max_prompt + 1)))])
                for i in range(num_requests)]
    order = rng.permutation(num_requests)
    return [requests[k] for k in order]


def _batch_inputs(prompts: Sequence[list], device, pad_id: int) -> tuple:
    """(input_ids, attention_mask), both (rows, longest), prompts left-padded."""
    import torch

    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for j, p in enumerate(prompts):
        ids[j, width - len(p):] = torch.as_tensor(p)
        mask[j, width - len(p):] = 1
    return ids.to(device), mask.to(device)


def batches(requests: Sequence[tuple], batch_size: int, max_adapters: int | None = None) -> list:
    """The requests (id, adapter name, prompt) in order, cut into batches of at most batch_size
    requests and at most max_adapters distinct adapters (BASE takes no slot; None: no limit)."""
    out, current, names = [], [], set()
    for req in requests:
        name = req[1]
        grows = name != BASE and name not in names
        if current and (len(current) == batch_size or (grows and max_adapters is not None
                                                        and len(names) == max_adapters)):
            out.append(current)
            current, names = [], set()
        current.append(req)
        if name != BASE:
            names.add(name)
    return out + ([current] if current else [])


def serve(generate, requests: Sequence[tuple], *, device, batch_size: int, max_new_tokens: int, pad_id: int,
          say=None, max_adapters: int | None = None) -> tuple:
    """Serves `requests` in batches (`batches`: at most batch_size requests and max_adapters
    distinct adapters each); returns ({request id: (new tokens, logits (new, vocab) float32 on
    the CPU)}, seconds, generated tokens).

    generate(input_ids, attention_mask, adapter_names, **generate_kwargs): `MultiLoRAModel.generate`,
    or a plain model's generate that ignores the names (the baseline without adapters). Each request
    needs its own (hashable) id: two requests with one id are refused before anything is served.
    """
    import torch

    repeat = checks.first_repeat([rid for rid, _, _ in requests], "requests[{}]: the request id",
                                 "it keys the results")
    if repeat is not None:
        i, j = repeat
        raise ValueError(f"requests[{i}]: request id {requests[i][0]!r} is already in flight (requests[{j}] has "
                         "it); every request needs its own id")
    out, generated = {}, 0
    sync = torch.cuda.synchronize if torch.device(device).type == "cuda" else (lambda: None)
    sync()
    start = time.perf_counter()
    for number, batch in enumerate(batches(requests, batch_size, max_adapters), 1):
        ids, mask = _batch_inputs([p for _, _, p in batch], device, pad_id)
        names = [name for _, name, _ in batch]
        t0 = time.perf_counter()
        res = generate(ids, mask, names, max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens,
                       do_sample=False, pad_token_id=pad_id, output_logits=True, return_dict_in_generate=True)
        logits = torch.stack(res.logits, dim=1).float().cpu()
        sync()
        for j, (rid, _, _) in enumerate(batch):
            out[rid] = (res.sequences[j, ids.shape[1]:].tolist(), logits[j])
        generated += len(batch) * max_new_tokens
        if say is not None:
            used = sorted({n for n in names if n != BASE})
            say(f"  batch {number}: {plural(len(batch), 'request')}, adapters {used or '-'}, "
                f"{time.perf_counter() - t0:.2f}s")
    sync()
    return out, time.perf_counter() - start, generated


def verify(peft_model, requests: Sequence[tuple], served: dict, device, rtol: float = RTOL,
           suppressed: Sequence[int] = ()) -> tuple:
    """Runs each request alone through PEFT (its adapter active, or disabled for BASE) on the prompt
    plus the served tokens, and compares logits and greedy tokens.

    suppressed: token ids generate could not choose while serving (the end-of-sequence ids, masked
    until `min_new_tokens`, which `serve` sets to max_new_tokens): PEFT's greedy choice is taken
    among the other tokens, as generate's was (the logits are compared whole).

    Returns ({request id: matches}, largest relative logit error, fraction of generated tokens an
    adapter changed against the base model)."""
    import torch

    def choosable(logits):
        if not suppressed:
            return logits
        logits = logits.clone()
        logits[..., list(suppressed)] = float("-inf")
        return logits

    ok, worst, changed, total = {}, 0.0, 0, 0
    for rid, name, prompt in requests:
        tokens, logits = served[rid]
        seq = torch.as_tensor([prompt + tokens[:-1]], device=device)
        with torch.no_grad():
            if name == BASE:
                with peft_model.disable_adapter():
                    ref = peft_model(seq).logits[0, len(prompt) - 1:].float().cpu()
            else:
                peft_model.set_adapter(name)
                ref = peft_model(seq).logits[0, len(prompt) - 1:].float().cpu()
                with peft_model.disable_adapter():
                    base = choosable(peft_model(seq).logits[0, len(prompt) - 1:]).argmax(-1).cpu()
                changed += int((base != torch.as_tensor(tokens)).sum())
                total += len(tokens)
        scale = max(1.0, float(ref.abs().max()))
        err = float((logits - ref).abs().max()) / scale
        choices = choosable(ref)
        top2 = choices.topk(2, dim=-1).values
        clear = (top2[:, 0] - top2[:, 1]) > 10 * rtol * scale
        tokens_ok = bool(((choices.argmax(-1) == torch.as_tensor(tokens)) | ~clear).all())
        ok[rid] = err <= rtol and tokens_ok
        worst = max(worst, err)
    return ok, worst, (changed / total if total else 0.0)


@contextlib.contextmanager
def _full_float32():
    """float32 matmuls at full precision on CUDA (TF32 off), restored afterwards."""
    import torch

    old = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = old


def run_demo(model_dir: str | None = None, adapter_dirs: Sequence[str] = (), *, num_requests: int = 24,
             batch_size: int = 8, max_new_tokens: int = 8, slots: int | None = None, device: str | None = None,
             backend: str | None = None, seed: int = 0, out=None, verbose: bool = False, model: str = "llama") -> int:
    """The demo; returns the process exit status (0 when every request verifies).

    Every path is checked before anything loads, and the counts against the memory they need
    (SizeError naming the option); verbose=False keeps transformers' and peft's progress bars and
    warnings out of the output."""
    t_start = time.perf_counter()

    def say(msg=""):
        print(msg, file=out if out is not None else sys.stdout, flush=True)

    for name, value in (("num_requests", num_requests), ("batch_size", batch_size),
                        ("max_new_tokens", max_new_tokens)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    if slots is not None and (not isinstance(slots, int) or slots < 1):
        raise ValueError(f"slots must be an int >= 1, got {slots!r}")
    if backend is not None and backend not in BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
    check_size("--requests", num_requests, cap=REQUESTS_CAP, per_item=0, available=None, what="", where="")
    check_size("--batch-size", batch_size, cap=BATCH_CAP, per_item=0, available=None, what="", where="")
    if model_dir is None and adapter_dirs:
        raise ValueError("adapter directories need a MODEL_DIR first")
    if model not in DEMO_MODELS:
        raise ValueError(f"model must be one of {', '.join(DEMO_MODELS)}, got {model!r}")
    if model_dir is not None:
        _check_paths(model_dir, adapter_dirs)
    import torch

    try:
        device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    except RuntimeError as e:
        raise ValueError(f"device {device!r}: {e}") from e
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {str(device)!r}, but this torch sees no CUDA device (torch.cuda.is_available() "
                         "is False)")
    tmp = None
    with contextlib.ExitStack() as scope:
        scope.enter_context(_third_party_output(verbose))
        if model_dir is None:
            tmp = tempfile.TemporaryDirectory(prefix="torch-lora-demo-")
            scope.callback(tmp.cleanup)
            scope.enter_context(on_interrupt(tmp.cleanup))       # Ctrl-C removes it too
            model_dir, adapter_dirs = build_demo_assets(tmp.name, seed, model)
            say(f"built a tiny random {model.capitalize()} and {plural(len(adapter_dirs), 'adapter')} saved by peft "
                f"in {tmp.name}")
        _check_sizes(model_dir, num_requests, batch_size, max_new_tokens, device)
        scope.enter_context(_full_float32())
        return _serve_and_verify(model_dir, list(adapter_dirs), num_requests, batch_size, max_new_tokens, slots,
                                 device, backend, seed, say, t_start)


def _check_paths(model_dir: str, adapter_dirs: Sequence[str]) -> None:
    """MODEL_DIR and every ADAPTER_DIR exist as directories (ValueError naming the first that does not)."""
    if not adapter_dirs:
        raise ValueError("give at least one adapter directory after MODEL_DIR")
    if not os.path.isdir(model_dir):
        raise ValueError(f"MODEL_DIR {model_dir!r} is not a directory (a Hugging Face causal LM: config.json + "
                         "weights)")
    if not os.path.isfile(os.path.join(model_dir, "config.json")):
        raise ValueError(f"MODEL_DIR {model_dir!r} has no config.json (a Hugging Face causal LM directory)")
    for d in adapter_dirs:
        if not os.path.isdir(d):
            raise ValueError(f"ADAPTER_DIR {d!r} is not a directory (a PEFT adapter: adapter_config.json + "
                             "adapter_model.safetensors)")
        if not os.path.isfile(os.path.join(d, "adapter_config.json")):
            raise ValueError(f"ADAPTER_DIR {d!r} has no adapter_config.json (a PEFT adapter directory)")


def _check_sizes(model_dir: str, num_requests: int, batch_size: int, max_new_tokens: int, device) -> None:
    """--requests and --batch-size against their caps and the memory they need (SizeError):
    a request keeps its float32 logits (max_new_tokens x vocab x 4) on the host; a row of a batch
    holds its KV cache (2 x layers x (16 + max_new_tokens) x kv_heads x head_dim x 4), its logits
    and the wrapper's per-token metadata on the device."""
    import torch

    cfg = read_model_sizes(model_dir)
    host = available_host_bytes() if cfg is not None else None
    vocab = cfg["vocab"] if cfg else 0
    if cfg is not None and cfg["max_pos"]:
        max_new_tokens = min(max_new_tokens, cfg["max_pos"])      # generate refuses more on its own terms
    check_size("--requests", num_requests, cap=REQUESTS_CAP, per_item=max_new_tokens * vocab * 4 + REQUEST_HOST_BYTES,
               available=host, what="each request keeps", where="host memory")
    if cfg is None:
        check_size("--batch-size", batch_size, cap=BATCH_CAP, per_item=0, available=None, what="", where="")
        return
    length = MAX_PROMPT + max_new_tokens
    per_row = (2 * cfg["layers"] * length * cfg["kv_heads"] * cfg["head_dim"] * 4 + 2 * max_new_tokens * vocab * 4
               + (64 + max_new_tokens) * 64)
    if device.type == "cuda":
        available, where = torch.cuda.mem_get_info(device)[0], "CUDA device memory"
    else:
        available, where = host, "host memory"
    check_size("--batch-size", batch_size, cap=BATCH_CAP, per_item=per_row, available=available,
               what="one row (KV cache, logits, metadata) takes", where=where)


@contextlib.contextmanager
def _third_party_output(verbose: bool):
    """Without `verbose`: transformers' and huggingface_hub's progress bars and log messages below
    ERROR, and Python warnings (transformers', peft's), kept out of the demo's output; restored after."""
    if verbose:
        yield
        return
    from transformers.utils import logging as hf_logging

    level, bars = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
    hub = None
    with contextlib.suppress(ImportError):
        import huggingface_hub.utils as hub
    hub_bars = hub.are_progress_bars_disabled() if hub is not None else None
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    if hub is not None:
        hub.disable_progress_bars()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        hf_logging.set_verbosity(level)
        if bars:
            hf_logging.enable_progress_bar()
        if hub is not None and not hub_bars:
            hub.enable_progress_bars()


def _serve_and_verify(model_dir, adapter_dirs, num_requests, batch_size, max_new_tokens, slots, device, backend,
                      seed, say, t_start) -> int:
    import peft
    import torch
    import transformers

    from . import load_peft_adapter
    from .hf import MultiLoRAModel

    adapters = {}
    for d in adapter_dirs:
        name = os.path.basename(os.path.normpath(d))
        adapters[name if name not in adapters else f"{name}-{len(adapters)}"] = load_peft_adapter(d)
    # Expert LoRA (kind "experts") needs no target: every fused experts module gets its layer.
    targets = sorted({m.rsplit(".", 1)[-1] for a in adapters.values() for m, mod in a.modules.items()
                      if mod.kind != "experts"}) or None
    max_rank = max(a.max_rank for a in adapters.values())
    num_slots = len(adapters) + 1 if slots is None else slots
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device).eval()
    cfg = model.config
    mm = MultiLoRAModel(model, max_loras=num_slots, max_rank=max_rank, target_modules=targets,
                        max_num_tokens=batch_size * (64 + max_new_tokens), max_num_seqs=batch_size, backend=backend)
    for (name, adapter), d in zip(adapters.items(), adapter_dirs):
        mm.load_adapter(name, d)
        mods = sorted({m.rsplit(".", 1)[-1] for m in adapter.modules})
        patterns = [k for k in ("rank_pattern", "alpha_pattern") if adapter.config.get(k)]
        say(f"adapter {name}: rank {adapter.r}, alpha {adapter.lora_alpha:g}{', rslora' if adapter.use_rslora else ''}"
            f"{''.join(f', {p}' for p in patterns)}: {', '.join(mods)}")
    say(f"model: {type(model).__name__}, {plural(cfg.num_hidden_layers, 'layer')}, hidden {cfg.hidden_size}, "
        f"vocab {cfg.vocab_size}; {plural(len(mm.layers), 'LoRA layer')}, {plural(num_slots, 'slot')}, max rank "
        f"{max_rank}; device {device.type}, backend {mm.punica.backend}")
    pad_id = cfg.pad_token_id if isinstance(cfg.pad_token_id, int) else 0
    names = [BASE] + list(adapters)
    requests = _demo_requests(cfg.vocab_size, names, num_requests, seed)
    counts = {n: sum(1 for _, a, _ in requests if a == n) for n in names}
    say(f"requests: {num_requests} ({counts[BASE]} without adapter, "
        + ", ".join(f"{counts[n]} with {n}" for n in adapters)
        + f"), {plural(max_new_tokens, 'new token')} each, batches of {batch_size}")

    def lora_generate(ids, mask, names, **kw):
        return mm.generate(ids, attention_mask=mask, adapter_names=names, **kw)

    reference = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device).eval()

    def plain_generate(ids, mask, names, **kw):
        with torch.no_grad():
            return reference.generate(ids, attention_mask=mask, **kw)

    kw = dict(device=device, batch_size=batch_size, pad_id=pad_id, max_adapters=num_slots)
    warm = requests[:min(batch_size, len(requests))]
    serve(lora_generate, warm, max_new_tokens=2, **kw)                 # warm-up (kernels, allocator)
    serve(plain_generate, warm, max_new_tokens=2, **kw)
    before = dict(mm.adapters.stats)
    say("serving (mixed adapters):")
    served, seconds, generated = serve(lora_generate, requests, max_new_tokens=max_new_tokens, say=say, **kw)
    _, base_seconds, _ = serve(plain_generate, requests, max_new_tokens=max_new_tokens, **kw)
    say(f"mixed adapters:              {generated} tokens in {seconds:.3f}s = {generated / seconds:.0f} tokens/s")
    say(f"plain model (no LoRA hooks): {generated} tokens in {base_seconds:.3f}s = {generated / base_seconds:.0f} "
        f"tokens/s ({100 * (seconds / base_seconds - 1):+.0f}% time with adapters, one run each)")
    st = mm.adapters.stats
    say(f"adapter slots: {plural(st['slot_loads'] - before.get('slot_loads', 0), 'slot load')}, "
        f"{plural(st['evictions'] - before.get('evictions', 0), 'eviction')} while serving")

    peft_model = None
    for name, d in zip(adapters, adapter_dirs):
        if peft_model is None:
            peft_model = peft.PeftModel.from_pretrained(reference, d, adapter_name=name).eval()
        else:
            peft_model.load_adapter(d, adapter_name=name)
    ok, worst, changed = verify(peft_model, requests, served, device, suppressed=_eos_ids(reference, cfg.vocab_size))
    say(f"adapters changed {100 * changed:.0f}% of generated tokens against the base model")
    say(f"largest logit error against PEFT: {worst:.1e} (relative; tolerance {RTOL:.0e})")
    bad = sorted(rid for rid, good in ok.items() if not good)
    if bad:
        say(f"MISMATCH: requests {bad}")
    say(f"done in {time.perf_counter() - t_start:.1f}s")
    say(f"verified: {sum(ok.values())}/{len(ok)} requests match PEFT outputs")
    return 0 if not bad else 1


def _eos_ids(model, vocab_size: int) -> tuple:
    """The end-of-sequence ids of `model`'s generation config: generate never picks them before
    min_new_tokens (serve asks for exactly max_new_tokens), so the greedy check excludes them."""
    config = getattr(model, "generation_config", None)
    eos = getattr(config, "eos_token_id", None)
    if eos is None:
        return ()
    values = eos.tolist() if hasattr(eos, "tolist") else eos
    values = values if isinstance(values, (list, tuple)) else [values]
    return tuple(int(e) for e in values if 0 <= int(e) < vocab_size)


def package_version() -> str:
    """The installed distribution's version; the package's own `__version__` when not installed."""
    from . import __version__
    return cli_support.package_version(__version__)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="torch-lora", description="Multi-LoRA (Punica) serving for PyTorch.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {package_version()}")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="serve mixed-adapter batches through MultiLoRAModel and verify them "
                                       "against PEFT",
                          description="Without arguments: build a tiny random Llama and 3 adapters saved by peft "
                                      "(ranks 4, 8, 16; rank/alpha patterns; rsLoRA with embed_tokens and lm_head), "
                                      "serve mixed-adapter requests in batches and check each against PEFT running "
                                      "it alone. With MODEL_DIR (a transformers causal LM) and PEFT adapter "
                                      "directories: the same on those. Needs torch, transformers and peft.")
    demo.add_argument("model_dir", nargs="?", metavar="MODEL_DIR", help="Hugging Face causal LM directory")
    demo.add_argument("adapter_dirs", nargs="*", metavar="ADAPTER_DIR",
                      help="PEFT LoRA directories (adapter_config.json + adapter_model.safetensors)")
    demo.add_argument("--requests", type=cli_support.positive_int, default=24, metavar="N",
                      help=f"number of requests (default 24, at most {REQUESTS_CAP})")
    demo.add_argument("--batch-size", type=cli_support.positive_int, default=8, metavar="N",
                      help=f"requests per batch (default 8, at most {BATCH_CAP} and what memory holds)")
    demo.add_argument("--max-new-tokens", type=cli_support.positive_int, default=8, metavar="N",
                      help="tokens generated per request (default 8)")
    demo.add_argument("--slots", type=cli_support.positive_int, default=None, metavar="N",
                      help="adapter slots (default: adapters + 1; fewer exercises LRU eviction; a batch holds at "
                           "most this many adapters)")
    demo.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    demo.add_argument("--backend", choices=BACKENDS, default=None,
                      help="force the wrapper's backend (default: the device's: triton on CUDA, torch on the CPU)")
    demo.add_argument("--seed", type=int, default=0, help="seed of the built-in model and random requests")
    demo.add_argument("--model", choices=DEMO_MODELS, default="llama",
                      help="the built-in model without MODEL_DIR: a tiny random Llama (default) or Mixtral (a "
                           "mixture of experts, with expert LoRA adapters)")
    demo.add_argument("--verbose", action="store_true",
                      help="also show transformers' and peft's progress bars and warnings")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """The console script: exit status 0 (verified), 1 (a mismatch), 2 (bad input, one line on
    stderr), 130 (Ctrl-C, one line)."""
    with interrupt_handler("torch-lora"):
        return _main(argv)


def _main(argv: Sequence[str] | None) -> int:
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as e:            # --help, --version (0) or a bad option (2, argparse's message printed)
        return e.code if isinstance(e.code, int) else 2
    missing = [m for m in DEMO_NEEDS if not _importable(m)]
    if missing:
        print(f"torch-lora demo: error: the demo needs {', '.join(DEMO_NEEDS)}; {', '.join(missing)} "
              f"{'is' if len(missing) == 1 else 'are'} not installed: {INSTALL_HINT}", file=sys.stderr)
        return 2
    from .adapters import AdapterError
    try:
        return run_demo(args.model_dir, args.adapter_dirs, num_requests=args.requests, batch_size=args.batch_size,
                        max_new_tokens=args.max_new_tokens, slots=args.slots, device=args.device,
                        backend=args.backend, seed=args.seed, verbose=args.verbose, model=args.model)
    except (AdapterError, ValueError, OSError) as e:       # SizeError is a ValueError
        print(f"torch-lora demo: error: {_one_line(e)}", file=sys.stderr)
        return 2
    except RuntimeError as e:         # a backend that cannot run here (e.g. Triton on the CPU without its interpreter)
        print(f"torch-lora demo: error: {_one_line(e)}", file=sys.stderr)
        return 2


def _importable(module: str) -> bool:
    """Whether `module` can be imported (a module set to None in sys.modules, as a test hides one, cannot)."""
    if module in sys.modules:
        return sys.modules[module] is not None
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def _one_line(e: BaseException) -> str:
    text = " ".join(str(e).split())
    return text if text else type(e).__name__


if __name__ == "__main__":
    sys.exit(main())
