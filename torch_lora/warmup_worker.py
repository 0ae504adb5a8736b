"""A warm-up worker process: `python -m torch_lora.warmup_worker --warmup-worker JSON`.

`torch_lora.warmup.warmup` starts these (through `lora_core.warmup.run_workers`) to compile kernel
variants concurrently before its own pass. The payload names a wrapper like the caller's (capacity,
slots, device, backend, deterministic) and its share of the (layer shape, token counts) cases; the
worker builds that wrapper and warms it up without workers of its own, so its compiles land in
Triton's cache for the caller to load.
"""

from __future__ import annotations

import json
import sys

import torch

from lora_core.warmup import LinearShape

from .warmup import warmup
from .wrapper import PunicaWrapper


def run(payload: dict) -> None:
    """Warms up the payload's cases on a wrapper built from the payload."""
    w = PunicaWrapper(payload["max_num_batched_tokens"], payload["max_batches"], payload["device"],
                      max_loras=payload["max_loras"], backend=payload["backend"],
                      deterministic=payload.get("deterministic", False))
    dtype = getattr(torch, payload["dtype"])
    for (hidden, slices, rank), counts in payload["cases"]:
        warmup(w, [LinearShape(hidden, tuple(slices), rank)], counts, dtype=dtype, lora_ranks=payload["lora_ranks"],
               bias=payload["bias"], dora=payload.get("dora", False), progress=False, workers=0)


if __name__ == "__main__" and len(sys.argv) == 3 and sys.argv[1] == "--warmup-worker":
    run(json.loads(sys.argv[2]))
