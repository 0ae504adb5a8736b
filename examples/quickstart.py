"""Quickstart: one batch, several LoRA adapters of different ranks, on JAX and on PyTorch.

A base linear layer W (out x in) serves 8 requests; each request names an adapter (or none).
Both wrappers compute y = x @ W.T + LoRA(x) in one call for the whole batch, and every request's
output is checked against the same layer with its adapter merged into W (W + scale * B @ A).

    python examples/quickstart.py
"""

from __future__ import annotations

import numpy as np


def main() -> None:
    import jax
    import jax.numpy as jnp
    import torch

    import jax_lora
    import torch_lora

    rng = np.random.default_rng(0)
    hidden, out, max_rank, slots, scale = 256, 384, 16, 4, 0.5
    adapters = {101: 4, 202: 8, 303: 16}                     # LoRA id -> rank
    lora_index_to_id = [101, 202, 303, None]                  # slot -> LoRA id (one slot free)

    # Stacked weights (vLLM layout), each adapter zero-padded to the largest rank.
    lora_a = np.zeros((slots, 1, max_rank, hidden), np.float32)
    lora_b = np.zeros((slots, 1, out, max_rank), np.float32)
    for slot, lora_id in enumerate(lora_index_to_id):
        if lora_id is not None:
            r = adapters[lora_id]
            lora_a[slot, 0, :r] = rng.standard_normal((r, hidden)) / np.sqrt(hidden)
            lora_b[slot, 0, :, :r] = rng.standard_normal((out, r)) / np.sqrt(r)
    base_w = rng.standard_normal((out, hidden)).astype(np.float32) / np.sqrt(hidden)

    # One token per request (decode); 0 = no adapter.
    requests = [101, 0, 303, 202, 101, 303, 0, 202]
    mapping = jax_lora.LoRAMapping(index_mapping=tuple(requests), prompt_mapping=tuple(requests))
    x = rng.standard_normal((len(requests), hidden)).astype(np.float32)
    y_base = (x @ base_w.T).astype(np.float32)

    # JAX: the wrapper is a pytree, so the whole step is one jitted function.
    jw = jax_lora.PunicaWrapper(max_num_batched_tokens=16, max_batches=8, device=None, max_loras=slots)
    jw.update_metadata(mapping, lora_index_to_id, max_loras=slots + 1, vocab_size=32000)
    step = jax.jit(lambda w, y, x: w.add_lora_linear(y, x, (lora_a,), (lora_b,), None, scale, (out,)))
    y_jax = np.asarray(step(jw, jnp.asarray(y_base), jnp.asarray(x)))

    # PyTorch: same API, y updated in place.
    tw = torch_lora.PunicaWrapper(16, 8, "cpu", max_loras=slots)
    tw.update_metadata(mapping, lora_index_to_id, slots + 1, 32000)
    y_torch = torch.from_numpy(y_base.copy())
    tw.add_lora_linear(y_torch, torch.from_numpy(x), (torch.from_numpy(lora_a),), (torch.from_numpy(lora_b),),
                       None, scale, (out,))

    print(f"{len(requests)} requests, adapters {adapters} (id: rank), backend jax={jw.backend} "
          f"torch={tw.backend}")
    ok = 0
    for t, lora_id in enumerate(requests):
        merged = base_w.astype(np.float64)
        if lora_id:
            slot = lora_index_to_id.index(lora_id)
            merged = merged + scale * lora_b[slot, 0].astype(np.float64) @ lora_a[slot, 0].astype(np.float64)
        want = merged @ x[t].astype(np.float64)
        err_j = np.abs(y_jax[t] - want).max()
        err_t = np.abs(y_torch[t].numpy() - want).max()
        good = err_j < 1e-4 and err_t < 1e-4
        ok += good
        print(f"  request {t}: adapter {lora_id or '-':>4}  max|err| jax {err_j:.1e}  torch {err_t:.1e}  "
              f"{'ok' if good else 'MISMATCH'}")
    print(f"verified: {ok}/{len(requests)} requests match merged-weights outputs")
    if ok != len(requests):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
