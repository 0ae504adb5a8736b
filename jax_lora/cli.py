"""The `jax-lora` console script. `jax-lora demo`: serve one batch with many adapters, and verify it.

    jax-lora demo                                  # builds a small model + 3 PEFT adapters, CPU is fine
    jax-lora demo MODEL_DIR ADAPTER_DIR [...]      # a Hugging Face Llama directory + PEFT adapter dirs
    python -m jax_lora.cli demo                    # the same without the script

The demo serves mixed-adapter requests (some without adapter) through the jit serving loop
(jax_lora.serving), then checks every request against the same model with that request's adapter
merged into its weights (teacher-forced: the merged model sees the served tokens and its logits
must equal the served logits within tolerance, and its greedy choice the served token), and prints
tokens/s with adapters and without. It ends with `verified: N/N requests match merged-weights
outputs` and exits non-zero when a request does not match.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from collections.abc import Sequence

RTOL = 1e-4          # float32 logits, relative to the request's largest |logit|


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
        stream.write(f"{chr(13) if tty else ''}{label} [{bar}] {done}/{total} requests  {time.perf_counter() - start:5.2f}s{end}")
        stream.flush()
    return update


# ----------------------------------------------------------------------------- demo assets

DEMO_ADAPTERS = (   # (lora id, rank, alpha, rslora, target modules)
    (1, 4, 8.0, False, ("q_proj", "v_proj")),
    (2, 8, 16.0, False, ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")),
    (3, 16, 16.0, True, ("q_proj", "o_proj", "down_proj", "embed_tokens", "lm_head")),
)


def build_demo_assets(root: str, seed: int = 0) -> tuple:
    """Writes a small random Llama (HF format) and the demo's PEFT adapters under `root`.

    Returns (model_dir, [adapter dirs]).
    """
    import numpy as np
    from flax import nnx

    from .adapters import save_peft_adapter
    from .models.llama import LlamaConfig, LlamaForCausalLM, save_llama

    cfg = LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      rope_theta=10000.0, rms_norm_eps=1e-5)
    model_dir = os.path.join(root, "tiny-llama")
    save_llama(LlamaForCausalLM(cfg, rngs=nnx.Rngs(seed)), model_dir)
    rng = np.random.default_rng(seed + 1)
    dims = {"q_proj": (cfg.hidden_size, cfg.q_size), "k_proj": (cfg.hidden_size, cfg.kv_size),
            "v_proj": (cfg.hidden_size, cfg.kv_size), "o_proj": (cfg.q_size, cfg.hidden_size),
            "gate_proj": (cfg.hidden_size, cfg.intermediate_size),
            "up_proj": (cfg.hidden_size, cfg.intermediate_size),
            "down_proj": (cfg.intermediate_size, cfg.hidden_size)}
    dirs = []
    for lora_id, r, alpha, rslora, targets in DEMO_ADAPTERS:
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


# ----------------------------------------------------------------------------- demo

def _load_demo_model(model_dir, adapter_dirs, slots, say):
    """(model with LoRA layers, its AdapterManager, {lora id: adapter}, slot count) of the demo."""
    from .adapters import AdapterManager, load_peft_adapter
    from .models.llama import HF_LORA_TARGETS, add_lora, load_llama

    adapters = {i + 1: load_peft_adapter(d) for i, d in enumerate(adapter_dirs)}
    model = load_llama(model_dir)
    cfg = model.config
    leaves = {m.rsplit(".", 1)[-1] for a in adapters.values() for m in a.modules}
    targets = [t for t in HF_LORA_TARGETS if t in leaves]
    max_rank = max(a.max_rank for a in adapters.values())
    num_slots = slots or len(adapters) + 1
    add_lora(model, max_loras=num_slots, max_rank=max_rank, target_modules=targets)
    manager = AdapterManager(model)
    for lora_id, adapter in adapters.items():
        manager.register(lora_id, adapter)
    say(f"model: {model_dir}: Llama, {cfg.num_hidden_layers} layers, hidden {cfg.hidden_size}, "
        f"heads {cfg.num_attention_heads}/{cfg.num_key_value_heads} (q/kv), vocab {cfg.vocab_size}")
    for lora_id, a in adapters.items():
        mods = sorted({m.rsplit(".", 1)[-1] for m in a.modules})
        say(f"adapter {lora_id}: {os.path.basename(os.path.normpath(adapter_dirs[lora_id - 1]))}  rank "
            f"{a.r}, alpha {a.lora_alpha:g}{', rslora' if a.use_rslora else ''}: {', '.join(mods)}")
    return model, manager, adapters, num_slots


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


def run_demo(model_dir: str | None = None, adapter_dirs: Sequence[str] = (), *, num_requests: int = 24,
             max_new_tokens: int = 16, max_seqs: int = 8, slots: int | None = None, seed: int = 0,
             backend: str | None = None, out=None, tp: int = 1) -> int:
    """The demo; returns the process exit status (0 when every request verifies). tp > 1 serves the
    model split over that many devices (tensor parallelism, jax_lora.parallel)."""
    t_start = time.perf_counter()
    import jax


    def say(msg=""):
        print(msg, file=out if out is not None else sys.stdout, flush=True)

    tmp = None
    if model_dir is None:
        if adapter_dirs:
            raise SystemExit("jax-lora demo: adapter directories need a MODEL_DIR first")
        tmp = tempfile.TemporaryDirectory(prefix="jax-lora-demo-")
        model_dir, adapter_dirs = build_demo_assets(tmp.name, seed)
        say(f"built a small random Llama and {len(adapter_dirs)} PEFT adapters in {tmp.name}")
    if not adapter_dirs:
        raise SystemExit("jax-lora demo: give at least one adapter directory after MODEL_DIR")
    # The check compares float32 serving with float32 merged weights at a 1e-4 relative tolerance:
    # on NVIDIA GPUs JAX's default float32 matmul is TF32 (~1e-3), so both run at full float32.
    with jax.default_matmul_precision("highest"):
        return _serve_and_verify(model_dir, adapter_dirs, tmp, slots, num_requests, max_new_tokens, max_seqs,
                                 seed, backend, say, t_start, tp=tp)


def _tp_mesh(tp: int):
    """A one-axis ("tp") mesh of the first `tp` devices, or None for tp = 1."""
    import jax
    import numpy as np

    if tp < 1:
        raise SystemExit(f"jax-lora demo: --tp must be >= 1, got {tp}")
    if tp == 1:
        return None
    devices = jax.devices()
    if len(devices) < tp:
        raise SystemExit(f"jax-lora demo: --tp {tp} needs {tp} devices, this process has {len(devices)} "
                         f"(on a CPU: XLA_FLAGS=--xla_force_host_platform_device_count={tp})")
    return jax.sharding.Mesh(np.array(devices[:tp]), ("tp",))


def _serve_and_verify(model_dir, adapter_dirs, tmp, slots, num_requests, max_new_tokens, max_seqs, seed, backend,
                      say, t_start, tp: int = 1) -> int:
    """The demo after its assets exist: load, serve, time, verify (removes `tmp` at the end)."""
    import jax

    from .models.llama import load_llama
    from .serving import Request, ServingEngine

    try:
        model, manager, adapters, num_slots = _load_demo_model(model_dir, adapter_dirs, slots, say)
        ids = [None] + list(adapters)
        max_len = max(64, 16 + max_new_tokens)
        requests = _demo_requests(model.config.vocab_size, ids, num_requests, max_new_tokens, seed)
        mesh = _tp_mesh(tp)
        engine = ServingEngine(model, manager, max_seqs=max_seqs, max_len=max_len, keep_logits=True,
                               backend=backend, mesh=mesh)
        if mesh is not None:
            layouts = sorted({layer.tp.layout for layer in manager.layers.values()})
            say(f"tensor parallel: {tp} devices, adapter layouts {', '.join(layouts)} (jax_lora.parallel)")
        counts = {i: sum(1 for r in requests if r.lora_id == i) for i in ids}
        say(f"requests: {num_requests} ({counts[None]} without adapter, "
            + ", ".join(f"{counts[i]} with adapter {i}" for i in adapters)
            + f"), {max_new_tokens} new tokens each; {max_seqs} rows, {num_slots} adapter slots; "
            f"device {jax.devices()[0].platform}, backend {engine.punica.backend}")

        t0 = time.perf_counter()
        warm = [Request(prompt=[1, 2, 3], lora_id=ids[1], max_new_tokens=2)]
        engine.generate(warm)
        engine.generate(warm, use_lora=False)
        warm_programs = engine.compile_count
        say(f"warm-up: compiled {warm_programs} step programs (prefill + decode bucket, with and without "
            f"adapters) in {time.perf_counter() - t0:.1f}s")

        completions, _, _ = _serve_timed(engine, requests, say)
        recompiles = engine.compile_count - warm_programs
        say(f"recompilations after warm-up: {recompiles}")
        st = manager.stats
        say(f"adapter slots: {st['slot_loads']} slot loads, {st['evictions']} evictions, {st['slot_hits']} slot hits")

        matches, worst, differ = verify(load_llama(model_dir), adapters, completions, max_len=max_len)
        say(f"adapters changed {differ * 100:.0f}% of generated tokens against the base model")
        say(f"largest logit error against merged weights: {worst:.1e} (relative; tolerance {RTOL:.0e})")
        bad = [c.request_id for c, ok in zip(completions, matches) if not ok]
        if bad:
            say(f"MISMATCH: requests {bad}")
        if recompiles:
            say(f"FAIL: {recompiles} recompilations after warm-up")
        say(f"done in {time.perf_counter() - t_start:.1f}s")
        say(f"verified: {sum(matches)}/{len(matches)} requests match merged-weights outputs")
        return 0 if not bad and not recompiles else 1
    finally:
        if tmp is not None:
            tmp.cleanup()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="jax-lora", description="Multi-LoRA (Punica) serving for JAX.")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="serve one batch with many adapters through the jit loop and verify it",
                          description="Without arguments: build a small Llama and 3 PEFT adapters of ranks 4, 8, "
                                      "16, serve mixed-adapter requests and verify them against merged weights. "
                                      "With MODEL_DIR (Hugging Face Llama: config.json + safetensors) and PEFT "
                                      "adapter directories: the same on those.")
    demo.add_argument("model_dir", nargs="?", help="Hugging Face-format Llama directory")
    demo.add_argument("adapter_dirs", nargs="*", help="PEFT adapter directories (adapter_config.json + "
                                                      "adapter_model.safetensors)")
    demo.add_argument("--requests", type=int, default=24, help="number of requests (default 24)")
    demo.add_argument("--max-new-tokens", type=int, default=16)
    demo.add_argument("--max-seqs", type=int, default=8, help="rows served at once (default 8)")
    demo.add_argument("--slots", type=int, default=None, help="adapter slots on the device (default: adapters + 1)")
    demo.add_argument("--backend", default=None, help="force a wrapper backend (xla, pallas_tpu, triton)")
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument("--tp", type=int, default=1, help="serve split over this many devices (tensor parallelism)")
    args = parser.parse_args(argv)
    if args.command == "demo":
        from .adapters import AdapterError
        try:
            return run_demo(args.model_dir, args.adapter_dirs, num_requests=args.requests,
                            max_new_tokens=args.max_new_tokens, max_seqs=args.max_seqs, slots=args.slots,
                            seed=args.seed, backend=args.backend, tp=args.tp)
        except (AdapterError, FileNotFoundError, NotImplementedError) as e:
            print(f"jax-lora demo: error: {e}", file=sys.stderr)
            return 2
    return 2


if __name__ == "__main__":
    sys.exit(main())
