"""`jax-lora demo`'s size checks: the counts a user gives (`--max-seqs`, `--slots`,
`--num-requests`) checked against the memory they need before anything is allocated.

Memory per item, from the checkpoint's config.json (cli_support.read_model_sizes, before the weights):
  --max-seqs (rows of the KV cache, on the device):
      2 (K and V) x layers x max_len x kv_heads x head_dim x dtype bytes, + 2 x vocab x 4 (a row's
      float32 logits in a step and in its result);
  --slots (adapter slots, on the device): per targeted module of every layer, (in + out) x
      max_rank x dtype bytes (the stacked A and B); the embedding and the LM head (vocab + hidden)
      x max_rank;
  --num-requests (on the host): max_new_tokens x vocab x 4 (the kept float32 logits the
      verification reads) + 4 kB (the request, its prompt and its completion).
Each must fit in half of the memory available (lora_core.cli_support.check_size), after the
model's weights for the device checks, and under a cap (MAX_SEQS_CAP, SLOTS_CAP, REQUESTS_CAP).
A config that cannot be read skips the memory part (loading the model reports it).
"""

from __future__ import annotations

from collections.abc import Sequence

from lora_core.cli_support import available_host_bytes, check_size, read_model_sizes

MAX_SEQS_CAP = 4096
SLOTS_CAP = 1024
REQUESTS_CAP = 100_000
REQUEST_HOST_BYTES = 4096
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
MAX_RANDOM_PROMPT = 16          # the random requests' longest prompt (cli._demo_requests)


def check_caps(*, num_requests: int, max_seqs: int, slots: int | None) -> None:
    """The caps alone, before anything is built or read (SizeError)."""
    for option, value, cap in (("--num-requests", num_requests, REQUESTS_CAP), ("--max-seqs", max_seqs, MAX_SEQS_CAP),
                               ("--slots", slots or 1, SLOTS_CAP)):
        check_size(option, value, cap=cap, per_item=0, available=None, what="", where="")


def module_dims(cfg: dict) -> dict:
    """{target leaf: (in, out)} of a Llama layer, and of a MoE layer's fused expert parameters
    (gate_up_proj; down_proj as the Llama's), each expert's."""
    q, kv, h, i = cfg["heads"] * cfg["head_dim"], cfg["kv_heads"] * cfg["head_dim"], cfg["hidden"], cfg["inter"]
    return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h), "gate_proj": (h, i),
            "up_proj": (h, i), "down_proj": (i, h), "gate_up_proj": (h, 2 * i)}


MLP_LEAVES = ("gate_proj", "up_proj", "down_proj", "gate_up_proj")


def _copies(cfg: dict, leaf: str) -> int:
    """How many of `leaf` a layer holds: one per expert for the MLP of a MoE model, else one."""
    return cfg.get("experts", 1) if leaf in MLP_LEAVES else 1


def weight_bytes(cfg: dict, dtype: str) -> int:
    """The model's weights (embedding, LM head and every layer's linears; a MoE layer's experts and router)."""
    dims = module_dims(cfg)
    per_layer = sum(a * b * _copies(cfg, leaf) for leaf, (a, b) in dims.items() if leaf != "gate_up_proj")
    if cfg.get("experts", 1) > 1:
        per_layer += cfg["experts"] * cfg["hidden"]
    return (2 * cfg["vocab"] * cfg["hidden"] + cfg["layers"] * per_layer) * DTYPE_BYTES[dtype]


def device_memory() -> tuple:
    """(bytes available to new arrays on the first device or None, its name)."""
    import jax

    device = jax.devices()[0]
    if device.platform == "cpu":
        return available_host_bytes(), "cpu memory"
    try:
        stats = device.memory_stats() or {}
    except Exception:                       # a backend without memory statistics
        stats = {}
    limit = stats.get("bytes_limit")
    name = f"{device.platform} device memory"
    return (limit - stats.get("bytes_in_use", 0), name) if limit else (None, name)


def check_run_sizes(model_dir: str, *, num_requests: int, max_new_tokens: int, max_seqs: int, dtype: str,
                    prompts: Sequence[str] = ()) -> None:
    """--num-requests and --max-seqs against their caps and the memory here (SizeError)."""
    cfg = read_model_sizes(model_dir)
    host = available_host_bytes() if cfg is not None else None
    if cfg is not None and cfg["max_pos"]:
        # more does not fit the model's positions, which the demo reports on its own terms
        max_new_tokens = min(max_new_tokens, cfg["max_pos"])
    if not prompts:
        per_request = max_new_tokens * cfg["vocab"] * 4 + REQUEST_HOST_BYTES if cfg else REQUEST_HOST_BYTES
        check_size("--num-requests", num_requests, cap=REQUESTS_CAP, per_item=per_request, available=host,
                   what="each request keeps", where="host memory")
    if cfg is None:
        check_size("--max-seqs", max_seqs, cap=MAX_SEQS_CAP, per_item=0, available=None, what="", where="")
        return
    longest = max([len(p.encode()) + 2 for p in prompts] or [MAX_RANDOM_PROMPT])
    max_len = max(64, 16 + max_new_tokens, longest + max_new_tokens)
    per_row = 2 * cfg["layers"] * max_len * cfg["kv_heads"] * cfg["head_dim"] * DTYPE_BYTES[dtype] + 8 * cfg["vocab"]
    available, where = device_memory()
    if available is not None:
        available = max(0, available - weight_bytes(cfg, dtype))
    check_size("--max-seqs", max_seqs, cap=MAX_SEQS_CAP, per_item=per_row, available=available,
               what=f"the KV cache of one row of {max_len} positions takes", where=where + " beside the weights")


def check_slots(model_dir: str, adapters: dict, slots: int, dtype: str) -> None:
    """--slots against its cap and the device memory the slots of these adapters' modules take."""
    cfg = read_model_sizes(model_dir)
    if cfg is None:
        check_size("--slots", slots, cap=SLOTS_CAP, per_item=0, available=None, what="", where="")
        return
    dims = module_dims(cfg)
    leaves = {m.rsplit(".", 1)[-1] for a in adapters.values() for m in a.modules}
    rank = max(a.max_rank for a in adapters.values())
    width = sum(cfg["layers"] * sum(dims[leaf]) * _copies(cfg, leaf) for leaf in leaves if leaf in dims)
    width += sum(cfg["vocab"] + cfg["hidden"] for leaf in ("embed_tokens", "lm_head") if leaf in leaves)
    per_slot = width * rank * DTYPE_BYTES[dtype]
    available, where = device_memory()
    if available is not None:
        available = max(0, available - weight_bytes(cfg, dtype))
    check_size("--slots", slots, cap=SLOTS_CAP, per_item=per_slot, available=available,
               what=f"one slot of rank {rank} takes", where=where + " beside the weights")
