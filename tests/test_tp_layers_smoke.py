"""benchmarks/tp_layers.py (the tensor-parallel benchmark) on CPU host devices: the JAX chain
of a layer's four split projections runs at TP 2 in both layout sets, and the LoRA byte
model of our layouts and vLLM's behaves as docs/parallel.md says. Times on the CPU mean nothing;
the torch side (gloo processes) is run by the benchmark's own --smoke."""

import os
import sys

import jax
import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))

import tp_layers

pytestmark = pytest.mark.skipif(jax.default_backend() != "cpu" or len(jax.devices()) < 2,
                                reason="needs 2 CPU host devices (tests/conftest.py sets 8)")


def test_jax_chain_runs_split_in_every_layout_set():
    args = tp_layers.parse_args(["--smoke", "--tp", "2", "--batches", "4", "--layers", "1", "--steps", "1"])
    rows = tp_layers.run_jax(args)
    assert sorted((r["tp"], r["layouts"]) for r in rows) == [(2, "fully_sharded"), (2, "replicated")]
    for r in rows:
        assert r["base_us"] > 0 and r["lora_us"] > 0 and r["adapters"] == 4 and r["batch"] == 4
        assert r["bytes"]["read"] > 0 and r["bytes"]["sent"] > 0      # both sets all-reduce the row buffer


def test_lora_bytes_of_our_layouts_and_vllms():
    sizes = tp_layers.SIZES["llama3-8b"]
    one = {name: tp_layers.lora_bytes(sizes, layouts, tokens=32, adapters=8, rank=16, shards=1)
           for name, layouts in {**tp_layers.LAYOUT_SETS, **tp_layers.VLLM_LAYOUTS}.items()}
    assert len({(b["read"], b["sent"]) for b in one.values()}) == 1 and one["vLLM"]["sent"] == 0
    two = {name: tp_layers.lora_bytes(sizes, layouts, tokens=32, adapters=8, rank=16, shards=2)
           for name, layouts in {**tp_layers.LAYOUT_SETS, **tp_layers.VLLM_LAYOUTS}.items()}
    assert two["vLLM"]["sent"] == 0                       # rides the base layer's all-reduce
    assert two["fully_sharded"] == two["vLLM fully_sharded"]
    assert two["fully_sharded"]["read"] * 2 == one["vLLM"]["read"]     # every weight split in two
    assert two["vLLM"]["read"] > two["replicated"]["read"] > two["fully_sharded"]["read"]
    # a row-parallel layer's rank buffer: 2 (n-1)/n * 4 T r bytes each; a gathered column one (n-1)/n * 4 S T r
    assert two["replicated"]["sent"] == 2 * (4 * 32 * 16)
    assert two["fully_sharded"]["sent"] == 2 * (4 * 32 * 16) + (3 + 2) * 4 * 32 * 16 // 2
