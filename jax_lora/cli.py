"""The `jax-lora` console script. `jax-lora demo`: serve one batch with many adapters, and verify it.

    jax-lora demo                                  # builds a small model + 3 PEFT adapters, CPU is fine
    jax-lora demo --model mixtral                  # a small mixture of experts, expert LoRA adapters
    jax-lora demo MODEL_DIR ADAPTER_DIR [...]      # a Hugging Face Llama / Mixtral directory + PEFT adapter dirs
    jax-lora demo --prompt "Hello" [--prompt ...]  # serve texts (each without and with every adapter)
    jax-lora --version
    python -m jax_lora.cli demo                    # the same without the script

The demo serves mixed-adapter requests (some without adapter) through the jit serving loop
(jax_lora.serving), then checks every request against the same model with that request's adapter
merged into its weights (teacher-forced: the merged model sees the served tokens and its logits
must equal the served logits within tolerance, and its greedy choice the served token), and prints
tokens/s with adapters and without. It ends with `verified: N/N requests match merged-weights
outputs` and exits 1 when a request does not match, 2 on bad input (one line on stderr).

Options: `--dtype` (float32, bfloat16, float16; default config.json's `torch_dtype`, float32 for
the built-in model), `--backend`, `--num-requests`, `--max-new-tokens`, `--max-seqs`, `--slots`,
`--seed`, `--prompt` (texts through MODEL_DIR's tokenizer, via transformers.AutoTokenizer; the
built-in random model has none, so its prompts go through a byte-level tokenizer: UTF-8 bytes are
token ids 0-255). The warm-up prints one line per step program as it compiles.

Counts are checked against the memory they need before anything is allocated (`--max-seqs`: the KV
cache, `--slots`: the adapter slots, `--num-requests`: the kept results; jax_lora.demo_sizes): one
line and exit status 2 naming the option and the limit. Ctrl-C prints `jax-lora: interrupted` and
exits with status 130 (lora_core.cli_support), after the compilation in progress, if any, returns.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import tempfile
import time
from collections.abc import Sequence

from lora_core import cli_support
from lora_core.cli_support import SizeError, interrupt_handler, on_interrupt, plural

from .demo_sizes import check_caps, check_run_sizes, check_slots
from .demo_text import DTYPES, TOKENIZER_FILES, ByteTokenizer, DemoError, checkpoint_dtype, load_tokenizer  # noqa: F401 - the demo's helpers

RTOL = 1e-4          # float32 logits, relative to the request's largest |logit|
# --dtype bfloat16 / float16: the served model (LoRA path beside the base layer) and the merged one
# (adapter added into the weights) round differently at every layer. The demo model measured up to
# 2.3e-2 (bfloat16) and 2.6e-3 (float16) on the CPU: about 3x headroom.
RTOL_BY_DTYPE = {"float32": RTOL, "bfloat16": 6e-2, "float16": 1e-2}


def _progress_bar(label: str, stream=None, width: int = 30):
    stream = stream if stream is not None else sys.stderr
    start = time.perf_counter()

    tty = stream.isatty()

    def update(done: int, total: int) -> None:
        if not tty and done < total:
            return
        filled = int(width * done / max(total, 1))
        bar = "#" * filled + "." * (width - filled)
        end = "\n" if done >= total else ""
        elapsed = time.perf_counter() - start
        stream.write(f"{chr(13) if tty else ''}{label} [{bar}] {done}/{total} requests  {elapsed:5.2f}s{end}")
        stream.flush()
    return update


# ----------------------------------------------------------------------------- demo assets

DEMO_ADAPTERS = (   # (lora id, rank, alpha, rslora, target modules)
    (1, 4, 8.0, False, ("q_proj", "v_proj")),
    (2, 8, 16.0, False, ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")),
    (3, 16, 16.0, True, ("q_proj", "o_proj", "down_proj", "embed_tokens", "lm_head")),
)


MOE_DEMO_ADAPTERS = (   # attention only, attention + experts, experts + embeddings (target_parameters)
    (1, 4, 8.0, False, ("q_proj", "v_proj")),
    (2, 8, 16.0, False, ("q_proj", "k_proj", "v_proj", "o_proj", "gate_up_proj", "down_proj")),
    (3, 16, 16.0, True, ("gate_up_proj", "down_proj", "embed_tokens", "lm_head")),
)
MODELS = ("llama", "mixtral")          # the built-in demo model's family (--model)
ROUTER_GAIN = 32.0
"""The built-in Mixtral's router weights are scaled by this, so that each token's top-k experts
lead the next by a clear margin: served and merged-weights models then route alike although
their values round differently."""


def build_demo_assets(root: str, seed: int = 0, model: str = "llama") -> tuple:
    """Writes a small random Llama, or Mixtral (model="mixtral": 4 experts, top 2), in Hugging Face
    format and the demo's PEFT adapters under `root` (the Mixtral's with expert LoRA as PEFT's
    target_parameters on the fused experts).

    Returns (model_dir, [adapter dirs]).
    """
    import numpy as np
    from flax import nnx

    from .adapters import save_peft_adapter
    from .models.llama import LlamaConfig, LlamaForCausalLM, save_llama
    from .models.mixtral import MixtralConfig, MixtralForCausalLM, save_mixtral

    if model not in MODELS:
        raise DemoError(f"model must be one of {', '.join(MODELS)}, got {model!r}")
    sizes = dict(vocab_size=512, hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 max_position_embeddings=256, rope_theta=10000.0, rms_norm_eps=1e-5)
    if model == "mixtral":
        cfg = MixtralConfig(intermediate_size=128, num_local_experts=4, num_experts_per_tok=2, **sizes)
        model_dir = os.path.join(root, "tiny-mixtral")
        net = MixtralForCausalLM(cfg, rngs=nnx.Rngs(seed))
        for layer in net.model.layers:
            layer.mlp.gate.kernel.set_value(layer.mlp.gate.kernel.get_value() * ROUTER_GAIN)
        save_mixtral(net, model_dir)
        adapters = MOE_DEMO_ADAPTERS
    else:
        cfg = LlamaConfig(intermediate_size=256, **sizes)
        model_dir = os.path.join(root, "tiny-llama")
        save_llama(LlamaForCausalLM(cfg, rngs=nnx.Rngs(seed)), model_dir)
        adapters = DEMO_ADAPTERS
    rng = np.random.default_rng(seed + 1)
    dims = {"q_proj": (cfg.hidden_size, cfg.q_size), "k_proj": (cfg.hidden_size, cfg.kv_size),
            "v_proj": (cfg.hidden_size, cfg.kv_size), "o_proj": (cfg.q_size, cfg.hidden_size),
            "gate_proj": (cfg.hidden_size, cfg.intermediate_size),
            "up_proj": (cfg.hidden_size, cfg.intermediate_size),
            "down_proj": (cfg.intermediate_size, cfg.hidden_size),
            "gate_up_proj": (cfg.hidden_size, 2 * cfg.intermediate_size)}
    dirs = []
    for lora_id, r, alpha, rslora, targets in adapters:
        modules = {}
        for t in targets:
            if t == "embed_tokens":
                modules["model.embed_tokens"] = (rng.normal(size=(r, cfg.vocab_size)),
                                                 rng.normal(size=(cfg.hidden_size, r)) * 0.2 / r)
                continue
            if t == "lm_head":
                modules["lm_head"] = (rng.normal(size=(r, cfg.hidden_size)) / np.sqrt(cfg.hidden_size),
                                      rng.normal(size=(cfg.vocab_size, r)) * 0.5 / r)
                continue
            n_in, n_out = dims[t]
            part = "self_attn" if t in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            if model == "mixtral" and part == "mlp":          # per expert: A (E, r, in), B (E, out, r)
                e = cfg.num_local_experts
                for i in range(cfg.num_hidden_layers):
                    modules[f"model.layers.{i}.mlp.experts.{t}"] = (
                        rng.normal(size=(e, r, n_in)) / np.sqrt(n_in), rng.normal(size=(e, n_out, r)) * 0.4 / r)
                continue
            for i in range(cfg.num_hidden_layers):
                # PEFT's A init scale (kaiming-uniform-like) and a trained-looking, non-zero B.
                modules[f"model.layers.{i}.{part}.{t}"] = (rng.normal(size=(r, n_in)) / np.sqrt(n_in),
                                                           rng.normal(size=(n_out, r)) * 0.4 / r)
        path = os.path.join(root, f"adapter-{lora_id}-r{r}")
        save_peft_adapter(path, modules, r=r, lora_alpha=alpha, use_rslora=rslora, base_model_name_or_path=model_dir)
        dirs.append(path)
    return model_dir, dirs


# ----------------------------------------------------------------------------- verification

def verify(base_model, adapters: dict, completions, *, max_len: int, rtol: float = RTOL) -> tuple:
    """Checks each completion against the merged-weights model of its adapter (teacher-forced).

    adapters: {lora id: PeftAdapter}. Returns (matches: list[bool], worst relative logit error,
    fraction of tokens that differ from the base model's choice).
    """
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from .adapters import merge_adapter

    graphdef, base_state = nnx.split(base_model)

    @jax.jit
    def forward(state, tokens):
        model = nnx.merge(graphdef, state)
        pos = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
        return model(tokens, pos)[0]

    states = {None: base_state}
    for lora_id, adapter in adapters.items():
        states[lora_id] = nnx.state(merge_adapter(base_model, adapter))
    matches, worst, differ, total = [], 0.0, 0, 0
    for c in completions:
        n = len(c.prompt)
        seq = np.zeros((1, max_len), np.int32)            # one padded length: one compiled program
        full = list(c.prompt) + list(c.tokens[:-1])
        seq[0, :len(full)] = full
        ref = np.asarray(forward(states[c.lora_id or None], jnp.asarray(seq)))[0, n - 1:len(full)]
        err = float(np.abs(ref - c.logits).max() / max(1.0, float(np.abs(ref).max())))
        top2 = np.sort(ref, axis=-1)[:, -2:]
        clear = (top2[:, 1] - top2[:, 0]) > 10 * rtol * max(1.0, float(np.abs(ref).max()))
        tokens_ok = bool(np.all((ref.argmax(-1) == np.asarray(c.tokens)) | ~clear))
        matches.append(err <= rtol and tokens_ok)
        worst = max(worst, err)
        if c.lora_id:
            base = np.asarray(forward(base_state, jnp.asarray(seq)))[0, n - 1:len(full)]
            differ += int(np.sum(base.argmax(-1) != np.asarray(c.tokens)))
            total += len(c.tokens)
    return matches, worst, (differ / total if total else 0.0)


# ----------------------------------------------------------------------------- options and errors


BACKENDS = ("xla", "pallas_tpu", "triton")      # the JAX backends (jax_lora.ops.dispatch)


def package_version() -> str:
    """The installed distribution's version; the package's own `__version__` when not installed."""
    from . import __version__
    return cli_support.package_version(__version__)


def model_family(model_dir: str) -> str:
    """"mixtral" when the checkpoint's config.json names a Mixtral-style MoE model (Qwen3-MoE included),
    else "llama"."""
    import json
    try:
        with open(os.path.join(model_dir, "config.json")) as f:
            raw = json.load(f)
    except (OSError, ValueError):
        return "llama"                        # loading reports the problem
    moe = isinstance(raw, dict) and (raw.get("model_type") in ("mixtral", "qwen3_moe")
                                     or bool(raw.get("num_local_experts") or raw.get("num_experts")))
    return "mixtral" if moe else "llama"


def _family(model_dir: str) -> tuple:
    """(name, loader, add_lora, targetable leaf names) of the checkpoint's model family."""
    if model_family(model_dir) == "mixtral":
        from .models import mixtral
        return ("Mixtral", mixtral.load_mixtral, mixtral.add_lora,
                mixtral.MIXTRAL_LORA_TARGETS + ("gate_up_proj", "down_proj"))
    from .models import llama
    return "Llama", llama.load_llama, llama.add_lora, llama.HF_LORA_TARGETS


def _load_demo_model(model_dir, adapter_dirs, slots, dtype):
    """(model with LoRA layers, its AdapterManager, {lora id: adapter}, slot count) of the demo."""
    import jax.numpy as jnp
    from safetensors import SafetensorError

    from .adapters import AdapterError, AdapterManager, load_peft_adapter

    _, load_model, add_lora, lora_targets = _family(model_dir)

    def named(what, load, *args, **kwargs):
        """load(...), its errors as DemoError prefixed by `what` (JSON, safetensors and shape
        errors do not name the file); AdapterError from reading a directory names it already."""
        try:
            return load(*args, **kwargs)
        except AdapterError as e:
            if load is load_peft_adapter:
                raise DemoError(str(e)) from e
            raise DemoError(f"{what}: {e}") from e
        except (ValueError, OSError, NotImplementedError, KeyError, SafetensorError) as e:
            raise DemoError(f"{what}: {e}") from e

    adapters = {i + 1: named(f"adapter {d}", load_peft_adapter, d) for i, d in enumerate(adapter_dirs)}
    num_slots = slots or len(adapters) + 1
    try:
        check_slots(model_dir, adapters, num_slots, dtype)          # before the model and its slots exist
    except SizeError as e:
        raise DemoError(str(e)) from None
    model = named(f"model {model_dir}", load_model, model_dir, dtype=jnp.dtype(dtype))
    leaves = {m.rsplit(".", 1)[-1] for a in adapters.values() for m in a.modules}
    targets = [t for t in lora_targets if t in leaves]
    max_rank = max(a.max_rank for a in adapters.values())
    named(f"adapters on {model_dir}", add_lora, model, max_loras=num_slots, max_rank=max_rank,
          target_modules=targets)
    manager = AdapterManager(model)
    for lora_id, adapter in adapters.items():
        named(f"adapter {adapter_dirs[lora_id - 1]} does not fit {model_dir}", manager.register, lora_id, adapter)
    return model, manager, adapters, num_slots


def _describe(model, adapters, model_dir, adapter_dirs, dtype, say) -> None:
    cfg = model.config
    experts = getattr(cfg, "num_local_experts", None)
    moe = f", {experts} experts (top {cfg.num_experts_per_tok})" if experts else ""
    say(f"model: {model_dir}: {_family(model_dir)[0]}, {cfg.num_hidden_layers} layers, hidden {cfg.hidden_size}"
        f"{moe}, heads {cfg.num_attention_heads}/{cfg.num_key_value_heads} (q/kv), vocab {cfg.vocab_size}, {dtype}")
    for lora_id, a in adapters.items():
        mods = sorted({m.rsplit(".", 1)[-1] for m in a.modules})
        say(f"adapter {lora_id}: {os.path.basename(os.path.normpath(adapter_dirs[lora_id - 1]))}  rank "
            f"{a.r}, alpha {a.lora_alpha:g}{', rslora' if a.use_rslora else ''}: {', '.join(mods)}")


def _demo_requests(vocab_size: int, lora_ids: Sequence, num_requests: int, max_new_tokens: int, seed: int,
                   max_prompt: int = 16) -> list:
    """Random prompts of 4..max_prompt tokens, adapters taken in turn (None = no adapter), shuffled."""
    import numpy as np

    from .serving import Request

    rng = np.random.default_rng(seed)
    requests = [Request(prompt=[int(t) for t in rng.integers(0, vocab_size, size=int(rng.integers(4,
                                                                                                  max_prompt + 1)))],
                        lora_id=lora_ids[i % len(lora_ids)], max_new_tokens=max_new_tokens, request_id=i)
                for i in range(num_requests)]
    rng.shuffle(requests)
    return requests


def _prompt_requests(tokenizer, prompts: Sequence[str], vocab_size: int, lora_ids: Sequence,
                     max_new_tokens: int) -> list:
    """Every prompt once per adapter and once without (lora id None), in that order."""
    from .serving import Request

    requests = []
    for text in prompts:
        ids = [int(t) for t in tokenizer.encode(text)]
        if not ids:
            raise DemoError(f"--prompt {text!r} encodes to no tokens")
        if max(ids) >= vocab_size or min(ids) < 0:
            raise DemoError(f"--prompt {text!r}: the tokenizer gives id {max(ids)}, outside the model's "
                            f"vocabulary of {vocab_size}: tokenizer and model do not match")
        for lora_id in lora_ids:
            requests.append(Request(prompt=ids, lora_id=lora_id, max_new_tokens=max_new_tokens,
                                    request_id=len(requests), eos_token_id=tokenizer.eos_token_id))
    return requests


def _warm_up(engine, requests, lora_id, say) -> int:
    """Compiles every step program that serving `requests` can use, one line per program; returns
    their number.

    The programs: one prefill program per (rows, length) bucket the requests can form (every
    admitted count 1..max_seqs, every prompt length present) and the decode program, each with and
    without adapters. Each is compiled by serving dummy requests of that shape.
    """
    from .serving import Request

    shapes = {}
    for length in sorted({len(r.prompt) for r in requests}):
        for n in range(1, engine.max_seqs + 1):
            shape = engine.prefill_shape(n, length)
            if shape is not None:
                shapes.setdefault(shape, (n, length))

    def dummy(n, length, new_tokens):
        return [Request(prompt=[(i + j) % engine.config.vocab_size for j in range(length)], lora_id=lora_id,
                        max_new_tokens=new_tokens) for i in range(n)]

    first_length = min(len(r.prompt) for r in requests)
    plan = []
    for use_lora in (True, False):
        which = "with adapters" if use_lora else "without adapters"
        for (rows, length), (n, prompt_len) in sorted(shapes.items()):
            plan.append((f"prefill step, {rows} rows x {length} tokens, {which}", dummy(n, prompt_len, 1), use_lora))
        plan.append((f"decode step, {engine.max_seqs} rows x 1 token, {which}", dummy(1, first_length, 2), use_lora))
    t_start = time.perf_counter()
    for i, (what, reqs, use_lora) in enumerate(plan):
        t0 = time.perf_counter()
        say(f"warm-up {i + 1}/{len(plan)}: compiling the {what} ...", end="")
        before = engine.compile_count
        engine.generate(reqs, use_lora=use_lora)
        new = engine.compile_count - before
        say(f" {time.perf_counter() - t0:.1f}s" + ("" if new == 1 else f" ({plural(new, 'program')})"))
    programs = engine.compile_count
    say(f"warm-up: compiled {plural(programs, 'step program')} (prefill and decode buckets, with and without "
        f"adapters) in {time.perf_counter() - t_start:.1f}s")
    return programs


def _serve_timed(engine, requests, say) -> tuple:
    """(completions with adapters, stats with adapters, stats without): the batch served with and
    without adapters, timings the best of three runs of each."""
    completions = engine.generate(requests, progress=_progress_bar("serving (mixed adapters)"))
    lora_stats = dict(engine.last_stats)
    engine.generate(requests, use_lora=False, progress=_progress_bar("serving (no adapters)   "))
    base_stats = dict(engine.last_stats)
    for _ in range(2):
        engine.generate(requests)
        lora_stats = min(lora_stats, dict(engine.last_stats), key=lambda s: s["seconds"])
        engine.generate(requests, use_lora=False)
        base_stats = min(base_stats, dict(engine.last_stats), key=lambda s: s["seconds"])
    overhead = lora_stats["seconds"] / base_stats["seconds"] - 1.0
    say(f"mixed adapters: {lora_stats['generated_tokens']} tokens in {lora_stats['seconds']:.3f}s = "
        f"{lora_stats['tokens_per_s']:.0f} tokens/s ({lora_stats['steps']} steps)")
    say(f"no adapters:    {base_stats['generated_tokens']} tokens in {base_stats['seconds']:.3f}s = "
        f"{base_stats['tokens_per_s']:.0f} tokens/s")
    say(f"LoRA overhead: {overhead * 100:+.0f}% time against no adapters (best of 3 runs; backend "
        f"{engine.punica.backend}, host metadata included)")
    return completions, lora_stats, base_stats


def _show_texts(tokenizer, prompts, completions, lora_ids, say) -> None:
    say(f"tokenizer: {tokenizer.name}")
    per_prompt = len(lora_ids)
    for p, text in enumerate(prompts):
        say(f"prompt {p + 1}: {text!r}")
        for c in completions[p * per_prompt:(p + 1) * per_prompt]:
            who = f"adapter {c.lora_id}" if c.lora_id else "no adapter"
            say(f"  {who + ':':12s} {tokenizer.decode(c.tokens)!r}")


def _check_backend(backend: str | None) -> None:
    """Refuses --backend triton where it could only fail or crawl, with what to do instead."""
    if backend != "triton":
        return
    import importlib.util

    import jax
    if importlib.util.find_spec("triton") is None:
        raise DemoError("--backend triton needs Triton: pip install triton (or the [triton] extra)")
    interpreting = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
    if jax.default_backend() not in ("gpu", "cuda") and not interpreting:
        raise DemoError("--backend triton without a CUDA GPU runs the kernels in Triton's interpreter (minutes "
                        "for a few requests): set TRITON_INTERPRET=1 to do that, or use --backend xla")


def _tp_mesh(tp: int):
    """A one-axis ("tp") mesh of the first `tp` devices, or None for tp = 1."""
    import jax
    import numpy as np

    if tp < 1:
        raise DemoError(f"--tp must be >= 1, got {tp}")
    if tp == 1:
        return None
    devices = jax.devices()
    if len(devices) < tp:
        raise DemoError(f"--tp {tp} needs {tp} devices, this process has {len(devices)} "
                        f"(on a CPU: XLA_FLAGS=--xla_force_host_platform_device_count={tp})")
    return jax.sharding.Mesh(np.array(devices[:tp]), ("tp",))


def run_demo(model_dir: str | None = None, adapter_dirs: Sequence[str] = (), *, num_requests: int = 24,
             max_new_tokens: int = 16, max_seqs: int = 8, slots: int | None = None, seed: int = 0,
             backend: str | None = None, dtype: str | None = None, prompts: Sequence[str] = (),
             out=None, tp: int = 1, model: str = "llama") -> int:
    """The demo; returns the process exit status (0 when every request verifies).

    dtype: "float32", "bfloat16" or "float16"; None: the checkpoint's (config.json), float32 for the
    built-in model. prompts: texts to serve (each once without and once per adapter) instead of
    random token ids. tp > 1: serve the model split over that many devices (tensor parallelism,
    jax_lora.parallel). model: the built-in model's family, "llama" or "mixtral" (a MODEL_DIR's
    config.json says its own). Raises DemoError for bad input.
    """
    t_start = time.perf_counter()
    stream = out if out is not None else sys.stdout

    def say(msg="", end="\n"):
        print(msg, file=stream, end=end, flush=True)

    _check_demo_args(model_dir, adapter_dirs, num_requests, max_new_tokens, max_seqs, slots, seed, backend, dtype)
    _check_backend(backend)
    try:
        check_caps(num_requests=num_requests, max_seqs=max_seqs, slots=slots)
    except SizeError as e:
        raise DemoError(str(e)) from None

    if model_dir is None and adapter_dirs:
        raise DemoError("adapter directories need a MODEL_DIR first")
    if model not in MODELS:
        raise DemoError(f"model must be one of {', '.join(MODELS)}, got {model!r}")
    if model != "llama" and model_dir is not None:
        raise DemoError("--model chooses the built-in model; a MODEL_DIR's config.json names its own")
    tmp = None
    scope = contextlib.ExitStack()         # the float32 precision and the Ctrl-C clean-up
    try:
        if model_dir is None:
            tmp = tempfile.TemporaryDirectory(prefix="jax-lora-demo-")
            scope.enter_context(on_interrupt(tmp.cleanup))       # Ctrl-C removes it too
            say(f"building a small random {'Mixtral' if model == 'mixtral' else 'Llama'} and 3 PEFT adapters ...",
                end="")
            t0 = time.perf_counter()
            model_dir, adapter_dirs = build_demo_assets(tmp.name, seed, model)
            say(f" {time.perf_counter() - t0:.1f}s, in {tmp.name}")
        import jax

        dtype = dtype or checkpoint_dtype(model_dir) or "float32"
        try:
            check_run_sizes(model_dir, num_requests=num_requests, max_new_tokens=max_new_tokens, max_seqs=max_seqs,
                            dtype=dtype, prompts=prompts)
        except SizeError as e:
            raise DemoError(str(e)) from None
        if dtype == "float32":
            # float32 serving is checked against float32 merged weights at 1e-4: on NVIDIA GPUs JAX's
            # default float32 matmul is TF32 (~1e-3), so both run at full float32.
            scope.enter_context(jax.default_matmul_precision("highest"))
        tokenizer = load_tokenizer(model_dir, built_in=tmp is not None) if prompts else None
        say(f"loading the model and {plural(len(adapter_dirs), 'adapter')} ({dtype}) ...", end="")
        t0 = time.perf_counter()
        try:
            loaded = _load_demo_model(model_dir, adapter_dirs, slots, dtype)
        except DemoError:
            say(" failed")
            raise
        model, manager, adapters, num_slots = loaded
        say(f" {time.perf_counter() - t0:.1f}s")
        _describe(model, adapters, model_dir, adapter_dirs, dtype, say)
        ids = [None] + list(adapters)
        if prompts:
            requests = _prompt_requests(tokenizer, prompts, model.config.vocab_size, ids, max_new_tokens)
        else:
            requests = _demo_requests(model.config.vocab_size, ids, num_requests, max_new_tokens, seed)
        engine, max_len = _demo_engine(model, manager, requests, ids, max_new_tokens, max_seqs, num_slots, backend,
                                       tp, say)

        warm_programs = _warm_up(engine, requests, ids[1], say)
        completions, _, _ = _serve_timed(engine, requests, say)
        recompiles = engine.compile_count - warm_programs
        say(f"recompilations after warm-up: {recompiles}")
        st = manager.stats
        say(f"adapter slots: {st['slot_loads']} slot loads, {st['evictions']} evictions, {st['slot_hits']} slot hits")
        if prompts:
            _show_texts(tokenizer, prompts, completions, ids, say)

        bad = _verify_and_report(model_dir, dtype, adapters, completions, max_len, recompiles, t_start, say)
        return 0 if not bad and not recompiles else 1
    finally:
        scope.close()
        if tmp is not None:
            tmp.cleanup()


def _demo_engine(model, manager, requests, ids, max_new_tokens: int, max_seqs: int, num_slots: int, backend, tp: int,
                 say) -> tuple:
    """The demo's ServingEngine sized for `requests` (split over `tp` devices when > 1), its set-up
    said; (engine, max_len)."""
    import jax

    from .serving import ServingEngine

    longest = max(len(r.prompt) for r in requests)
    if longest + max_new_tokens > model.config.max_position_embeddings:
        raise DemoError(f"the longest prompt ({longest} tokens) + max_new_tokens ({max_new_tokens}) exceeds the "
                        f"model's max_position_embeddings={model.config.max_position_embeddings}")
    max_len = max(64, 16 + max_new_tokens, longest + max_new_tokens)
    prefill_tokens = max(512, 1 << (max(longest, 16) - 1).bit_length())
    mesh = _tp_mesh(tp)
    engine = ServingEngine(model, manager, max_seqs=max_seqs, max_len=max_len, keep_logits=True,
                           backend=backend, max_prefill_tokens=prefill_tokens, mesh=mesh)
    if mesh is not None:
        layouts = sorted({layer.tp.layout for layer in manager.layers.values()})
        say(f"tensor parallel: {tp} devices, adapter layouts {', '.join(layouts)} (jax_lora.parallel)")
    counts = {i: sum(1 for r in requests if r.lora_id == i) for i in ids}
    say(f"requests: {len(requests)} ({counts[None]} without adapter, "
        + ", ".join(f"{counts[i]} with adapter {i}" for i in ids[1:])
        + f"), {plural(max_new_tokens, 'new token')} each; {plural(max_seqs, 'row')}, "
        f"{plural(num_slots, 'adapter slot')}; "
        f"device {jax.devices()[0].platform}, backend {engine.punica.backend}")
    return engine, max_len


def _check_demo_args(model_dir, adapter_dirs, num_requests, max_new_tokens, max_seqs, slots, seed, backend,
                     dtype) -> None:
    """run_demo's argument checks (DemoError naming the argument)."""
    if dtype is not None and dtype not in DTYPES:
        raise DemoError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    if backend is not None and backend not in BACKENDS:
        raise DemoError(f"backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
    for name, value in (("num_requests", num_requests), ("max_new_tokens", max_new_tokens),
                        ("max_seqs", max_seqs), ("slots", 1 if slots is None else slots)):
        if int(value) < 1:
            raise DemoError(f"{name} must be a positive integer, got {value}")
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**32:
        raise DemoError(f"seed must be an integer in 0..2**32 - 1, got {seed!r}")
    if model_dir is not None and not adapter_dirs:
        raise DemoError("give at least one adapter directory after MODEL_DIR")
    if model_dir is not None and not os.path.isdir(model_dir):
        raise DemoError(f"MODEL_DIR {model_dir!r} is not a directory")
    for d in adapter_dirs:
        if not os.path.isdir(d):
            raise DemoError(f"adapter directory {d!r} is not a directory")


def _verify_and_report(model_dir: str, dtype: str, adapters, completions, max_len: int, recompiles: int,
                       t_start: float, say) -> list:
    """Checks every completion against the model with its adapter merged into the weights, says
    the outcome; the ids of the requests that do not match."""
    import jax.numpy as jnp

    load_model = _family(model_dir)[1]
    rtol = RTOL_BY_DTYPE[dtype]
    say(f"verifying {len(completions)} requests against the model with each adapter merged into its "
        "weights ...", end="")
    t0 = time.perf_counter()
    matches, worst, differ = verify(load_model(model_dir, dtype=jnp.dtype(dtype)), adapters, completions,
                                    max_len=max_len, rtol=rtol)
    say(f" {time.perf_counter() - t0:.1f}s")
    say(f"adapters changed {differ * 100:.0f}% of generated tokens against the base model")
    say(f"largest logit error against merged weights: {worst:.1e} (relative; tolerance {rtol:.0e})")
    bad = [c.request_id for c, ok in zip(completions, matches) if not ok]
    if bad:
        say(f"MISMATCH: requests {bad}")
    if recompiles:
        say(f"FAIL: {recompiles} recompilations after warm-up")
    say(f"done in {time.perf_counter() - t_start:.1f}s")
    say(f"verified: {sum(matches)}/{len(matches)} requests match merged-weights outputs")
    return bad


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="jax-lora", description="Multi-LoRA (Punica) serving for JAX.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {package_version()}")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="serve one batch with many adapters through the jit loop and verify it",
                          description="Without arguments: build a small random Llama and 3 PEFT adapters of "
                                      "ranks 4, 8, 16, serve mixed-adapter requests and verify them against "
                                      "merged weights. With MODEL_DIR (Hugging Face Llama: config.json + "
                                      "safetensors) and PEFT adapter directories: the same on those.")
    demo.add_argument("model_dir", nargs="?", metavar="MODEL_DIR", help="Hugging Face-format Llama directory")
    demo.add_argument("adapter_dirs", nargs="*", metavar="ADAPTER_DIR",
                      help="PEFT adapter directories (adapter_config.json + adapter_model.safetensors)")
    demo.add_argument("--prompt", action="append", default=[], metavar="TEXT",
                      help="serve TEXT (repeatable) once without and once per adapter, and print the outputs "
                           "as text; needs MODEL_DIR's tokenizer (transformers) or, for the built-in random "
                           "model, uses a byte-level tokenizer (UTF-8 bytes = token ids)")
    demo.add_argument("--num-requests", "--requests", dest="num_requests", type=cli_support.positive_int, default=None,
                      metavar="N", help="number of random-token requests (default 24; not with --prompt)")
    demo.add_argument("--max-new-tokens", type=cli_support.positive_int, default=16, metavar="N",
                      help="tokens generated per request (default 16)")
    demo.add_argument("--max-seqs", type=cli_support.positive_int, default=8, metavar="N",
                      help="rows served at once (default 8)")
    demo.add_argument("--slots", type=cli_support.positive_int, default=None, metavar="N",
                      help="adapter slots on the device (default: adapters + 1; fewer swaps adapters LRU)")
    demo.add_argument("--dtype", choices=DTYPES, default=None,
                      help="weights' dtype (default: config.json's torch_dtype; float32 for the built-in model)")
    demo.add_argument("--backend", choices=BACKENDS, default=None,
                      help="force the wrapper's backend (default: the device's: xla on CPU, triton on a CUDA "
                           "GPU, pallas_tpu on a TPU)")
    demo.add_argument("--seed", type=int, default=0, help="seed of the built-in model and random requests")
    demo.add_argument("--tp", type=cli_support.positive_int, default=1, metavar="N",
                      help="serve split over N devices (tensor parallelism; on a CPU: "
                           "XLA_FLAGS=--xla_force_host_platform_device_count=N)")
    demo.add_argument("--model", choices=MODELS, default="llama",
                      help="the built-in model: a dense Llama, or a Mixtral-style mixture of experts whose adapters "
                           "put LoRA on the experts (without MODEL_DIR)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """The console script: exit status 0 (verified), 1 (a mismatch), 2 (bad input, one line on
    stderr), 130 (Ctrl-C, one line)."""
    with interrupt_handler("jax-lora"):        # before jax is imported and anything compiles
        return _main(argv)


def _main(argv: Sequence[str] | None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "demo":
        if args.prompt and args.num_requests is not None:
            parser.error("--num-requests does not go with --prompt (each prompt is served once without and "
                         "once per adapter)")
        try:
            return run_demo(args.model_dir, args.adapter_dirs,
                            num_requests=args.num_requests if args.num_requests is not None else 24,
                            max_new_tokens=args.max_new_tokens, max_seqs=args.max_seqs, slots=args.slots,
                            seed=args.seed, backend=args.backend, dtype=args.dtype, prompts=args.prompt, tp=args.tp,
                            model=args.model)
        except DemoError as e:
            print(f"jax-lora demo: error: {e}", file=sys.stderr)
            return 2
    return 2


if __name__ == "__main__":
    sys.exit(main())
