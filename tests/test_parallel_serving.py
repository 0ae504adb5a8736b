"""Serving on a mesh: the Llama split over 2 CPU devices serves mixed adapters equal to merged
weights, adapter slots are written shard by shard, no recompilation, no weight is gathered; the
demo command with --tp 4 in a subprocess (4 host devices).

CPU-device meshes; skipped where JAX's default backend is not the CPU.
"""

import os
import re
import subprocess
import sys

import jax
import numpy as np
import pytest
from flax import nnx
from jax.sharding import Mesh

from jax_lora import LoRAMapping, parallel
from jax_lora.adapters import AdapterManager, load_peft_adapter, prepare_adapter
from jax_lora.cli import build_demo_assets, verify
from jax_lora.models import add_lora, load_llama, save_llama
from jax_lora.serving import Request, ServingEngine

from . import jax_helpers, llama_checkpoint

# The meshes here are of host CPU devices: on a machine whose default backend is an accelerator,
# run these with JAX_PLATFORMS=cpu. Multi-GPU meshes are tested apart.
pytestmark = pytest.mark.skipif(jax.default_backend() != "cpu",
                                reason="CPU-device meshes; JAX's default backend here is not the CPU")

MAX_LEN = 48
N = 2


@pytest.fixture(scope="module")
def split(tmp_path_factory):
    root = tmp_path_factory.mktemp("tp")
    model_dir, dirs = build_demo_assets(str(root), seed=5)
    mesh = Mesh(np.array(jax.devices("cpu")[:N]), ("tp",))
    model = load_llama(model_dir, mesh=mesh)          # split before the adapters are added
    add_lora(model, max_loras=2, max_rank=16)          # 3 adapters, 2 slots: LRU swaps
    mgr = AdapterManager(model)
    for i, d in enumerate(dirs):
        mgr.register(i + 1, d)
    engine = ServingEngine(model, mgr, max_seqs=8, max_len=MAX_LEN, keep_logits=True, mesh=mesh)
    adapters = {i + 1: load_peft_adapter(d) for i, d in enumerate(dirs)}
    return engine, model_dir, adapters, mesh


def _requests(seed, n, ids):
    rng = np.random.default_rng(seed)
    return [Request([int(t) for t in rng.integers(0, 512, size=int(rng.integers(2, 17)))], lora_id=ids[i % len(ids)],
                    max_new_tokens=int(rng.integers(3, 7)), request_id=i) for i in range(n)]


def test_split_model_serves_mixed_adapters_equal_to_merged_weights(split):
    engine, model_dir, adapters, _ = split
    base = load_llama(model_dir)
    out = engine.generate(_requests(0, 10, [1, None, 2]))
    matches, worst, differ = verify(base, adapters, out, max_len=MAX_LEN)
    assert all(matches), (worst, matches)
    assert differ > 0.2                                        # the adapters change the outputs
    programs = engine.compile_count
    assert programs == 2                                       # one prefill bucket + decode
    swaps = engine.adapters.stats["slot_loads"]
    out = engine.generate(_requests(1, 9, [3, 1, None]))       # adapter 3 evicts a slot
    assert engine.adapters.stats["slot_loads"] > swaps
    assert engine.compile_count == programs                    # slot writes keep shapes and shardings
    matches, worst, _ = verify(base, adapters, out, max_len=MAX_LEN)
    assert all(matches), (worst, matches)


def test_adapter_slots_are_written_shard_by_shard(split):
    engine, _, adapters, _ = split
    mgr = engine.adapters
    qkv_path = "model.layers.0.self_attn.qkv_proj"
    layer = mgr.layers[qkv_path]
    before = {(p, n): getattr(l, n).get_value().sharding for p, l in mgr.layers.items()
              for n in ("lora_a", "lora_b", "lora_ranks")}
    mgr.activate([2])
    slot = mgr.slot_of(2)
    after = {(p, n): getattr(l, n).get_value().sharding for p, l in mgr.layers.items()
             for n in ("lora_a", "lora_b", "lora_ranks")}
    assert after == before
    slices, width = layer.output_slices, layer.out_features
    b = layer.lora_b.get_value()                               # (L, N, r), column-split
    assert {s.data.shape for s in b.addressable_shards} == {(2, width // N, 16)}
    # What a device receives for one slot is its block only ...
    natural = prepare_adapter(engine.model, adapters[2])[qkv_path][1]
    placed = parallel.place_slot_value(layer, "lora_b", natural)
    assert {s.data.shape for s in placed.addressable_shards} == {(width // N, 16)}
    # ... and holds part d of every slice (q, k, v), so the stored slot undoes to the natural B.
    stored = np.asarray(b)[slot]
    np.testing.assert_array_equal(parallel.natural_columns(stored, slices, N, axis=0), natural)
    # The row-parallel o_proj (row_reduce at 8 tokens) splits A along its input and B along its output.
    o = mgr.layers["model.layers.0.self_attn.o_proj"]
    assert o.tp.layout == "row_reduce"
    assert {s.data.shape for s in o.lora_a.get_value().addressable_shards} == {(1, 2, 16, 128 // N)}


def test_step_program_gathers_no_weight(split):
    """XLA partitions the attention and norms; no collective in the step returns a whole weight."""
    engine, _, _, _ = split
    m = engine.max_seqs
    ids = np.zeros(m, np.int32)
    engine.adapters.activate([1])
    ids[:3] = 1
    engine.punica.update_metadata(LoRAMapping(ids, ids, False), engine.adapters.lora_index_to_id,
                                  engine.adapters.num_slots + 1, engine.config.vocab_size)
    z = np.zeros((m, 1), np.int32)
    hlo = engine._jit_step.lower(engine._state_leaves, engine.cache, engine.punica, z, z, np.arange(m, dtype=np.int32),
                                 np.zeros(m, np.int32), True).compile().as_text()
    weights = {tuple(v.get_value().shape) for _, v in nnx.iter_graph(engine.model)
               if isinstance(v, nnx.Variable) and np.ndim(v.get_value()) >= 2}
    gathered = [tuple(int(d) for d in dims.split(",")) for dims in
                re.findall(r"=\s*[a-z0-9]+\[([0-9,]+)\][^ ]*\s+all-gather(?:-start)?\(", hlo)]
    assert not [g for g in gathered if g in weights]


def test_step_shard_maps_take_no_zero_sized_operand(split):
    """Every layer's manual computation in the serving step takes only arrays that hold data: XLA
    does not compile a manual computation that reads a zero-sized operand (jaxlib 0.11 crashes in
    Shardy), and the ops' constants stay inside the per-device functions."""
    engine, _, _, _ = split
    m = engine.max_seqs
    z = np.zeros((m, 1), np.int32)
    text = engine._jit_step.lower(engine._state_leaves, engine.cache, engine.punica, z, z, np.arange(m, dtype=np.int32),
                                  np.zeros(m, np.int32), True).as_text()
    operands = jax_helpers.shard_map_operands(text)
    layers = 2 + 4 * engine.config.num_hidden_layers          # embedding, LM head, 4 per decoder layer
    assert len(operands) == layers
    assert not [t for ops in operands for t in ops if jax_helpers.zero_sized(t)]


def test_save_from_a_split_model_writes_natural_order(split, tmp_path):
    engine, model_dir, _, _ = split
    save_llama(engine.model, str(tmp_path / "saved"))
    from safetensors.numpy import load_file
    a, b = load_file(os.path.join(model_dir,
                                  "model.safetensors")), load_file(str(tmp_path / "saved" / "model.safetensors"))
    assert sorted(a) == sorted(b)
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)


def test_mesh_errors(split):
    engine, model_dir, _, _ = split
    other = Mesh(np.array(jax.devices("cpu")[:4]), ("tp",))
    with pytest.raises(ValueError, match=r"the model is split over axis 'tp' of another mesh \{'tp': 2\}"):
        ServingEngine(engine.model, engine.adapters, mesh=other)
    with pytest.raises(TypeError, match=r"mesh must be a jax.sharding.Mesh, got str"):
        ServingEngine(engine.model, engine.adapters, mesh="tp")
    three = Mesh(np.array(jax.devices("cpu")[:3]), ("tp",))
    with pytest.raises(ValueError, match=r"num_attention_heads=4 must be divisible by the 3 devices"):
        load_llama(model_dir, mesh=three)


def test_demo_with_tp_4_verifies_every_request():
    """`jax-lora demo --tp 4` in a fresh process with 4 host devices (KV heads 2 < 4: replicated cache)."""
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4", PYTHONPATH=os.getcwd())
    proc = subprocess.run([sys.executable, "-m", "jax_lora.cli", "demo", "--tp", "4", "--requests", "8",
                           "--max-new-tokens", "4"], capture_output=True, text=True, env=env, timeout=900,
                          check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "tensor parallel: 4 devices" in proc.stdout
    assert "verified: 8/8 requests match merged-weights outputs" in proc.stdout
    assert "recompilations after warm-up: 0" in proc.stdout


def test_demo_tp_needs_the_devices():
    from jax_lora.cli import DemoError, _tp_mesh
    assert _tp_mesh(1) is None and dict(_tp_mesh(2).shape) == {"tp": 2}
    with pytest.raises(DemoError, match=r"--tp 16 needs 16 devices, this process has 8 .*device_count=16"):
        _tp_mesh(16)
    with pytest.raises(DemoError, match=r"--tp must be >= 1, got 0"):
        _tp_mesh(0)


@pytest.fixture(scope="module")
def llama_dirs(tmp_path_factory):
    """A tiny random Llama checkpoint and three PEFT adapters (tests/llama_checkpoint.py): directory per key."""
    return llama_checkpoint.write_assets(tmp_path_factory.mktemp("llama_checkpoint"))


# Meshes of host CPU devices (tests/conftest.py forces 8). On a GPU machine JAX's default backend
# is the GPU, with one device here, and XLA's CPU compiler crashed on these shard_map programs
# (tests/test_parallel.py): skipped there; multi-GPU meshes are tested apart.
_CPU_MESHES = pytest.mark.skipif(jax.default_backend() != "cpu",
                                 reason="CPU-device meshes; JAX's default backend here is not the CPU")


@_CPU_MESHES
def test_adapter_slots_of_a_split_model_keep_their_sharding(llama_dirs):
    """The adapter manager writes each device's shard of a split layer: after
    activating adapters on a model split over 2 devices, a column-parallel layer's B keeps its
    NamedSharding (rows split) and holds the adapter's weights in the layer's stored column order."""
    mesh = Mesh(np.array(jax.devices()[:2]), ("tp",))
    model = load_llama(llama_dirs["model"], mesh=mesh)
    add_lora(model, max_loras=2, max_rank=8, target_modules=["q_proj", "v_proj"])
    layer = model.model.layers[0].self_attn.qkv_proj
    sharding = layer.lora_b.get_value().sharding
    mgr = AdapterManager(model)
    mgr.register(1, llama_dirs["a1"])
    mgr.activate([1])
    b = layer.lora_b.get_value()
    assert b.sharding.is_equivalent_to(sharding, b.ndim)
    assert b.sharding.shard_shape(b.shape)[1] == b.shape[1] // 2
    stored = np.asarray(b)[mgr.slot_of(1)]                       # (out, r), shard-major columns
    natural = parallel.natural_columns(stored, layer.output_slices, 2, axis=0)
    ad = load_peft_adapter(llama_dirs["a1"])
    q = ad.modules["model.layers.0.self_attn.q_proj"]
    np.testing.assert_allclose(natural[:32, :4], q.lora_b * q.scaling, rtol=1e-6)
    np.testing.assert_array_equal(natural[32:48], 0)               # k has no adapter
