"""Serve one batch with several PEFT adapters through the jit loop (CPU is fine).

    python examples/flax_multi_lora_serving.py                      # a small random model + adapters
    python examples/flax_multi_lora_serving.py MODEL_DIR ADAPTER...  # your HF Llama + PEFT adapter dirs
"""

import sys
import tempfile

import numpy as np

from jax_lora.adapters import AdapterManager, load_peft_adapter
from jax_lora.models import add_lora, load_llama
from jax_lora.serving import Request, ServingEngine


def main(model_dir, adapter_dirs):
    # 1. The base model (config.json + safetensors), then multi-LoRA layers in place of the targets.
    model = load_llama(model_dir)
    max_rank = max(load_peft_adapter(d).max_rank for d in adapter_dirs)
    add_lora(model, max_loras=len(adapter_dirs), max_rank=max_rank)

    # 2. Adapters under LoRA ids 1..n; they go into device slots when a batch needs them.
    adapters = AdapterManager(model, host_cache_size=4)
    for lora_id, d in enumerate(adapter_dirs, start=1):
        adapters.register(lora_id, d)

    # 3. Requests name an adapter id, or None for the base model; one jitted step serves them all.
    engine = ServingEngine(model, adapters, max_seqs=8, max_len=64)
    rng = np.random.default_rng(0)
    vocab = model.config.vocab_size
    requests = [Request(prompt=rng.integers(0, vocab, size=8).tolist(), lora_id=lora_id, max_new_tokens=8)
                for lora_id in [None, *range(1, len(adapter_dirs) + 1)] * 3]
    for c in engine.generate(requests):
        print(f"adapter {c.lora_id}: {c.prompt} -> {c.tokens}")
    print(f"{engine.last_stats['tokens_per_s']:.0f} tokens/s (includes compilation on the first call); "
          f"{engine.compile_count} compiled step programs")


if __name__ == "__main__":
    if len(sys.argv) > 2:
        main(sys.argv[1], sys.argv[2:])
    else:
        from jax_lora.cli import build_demo_assets
        with tempfile.TemporaryDirectory() as tmp:
            main(*build_demo_assets(tmp))
