"""Adapter pinning on both AdapterManagers, torch's MultiLoRAModel and the JAX ServingEngine.

A pinned adapter stays in its slot whatever the LRU would evict (each adapter's lora_A is the
constant of its id, so a slot's content says which adapter it holds); a batch or a pin that needs
a slot when pinned adapters fill the rest is refused by name, with the slot count, and changes
nothing; unpinning makes the slot evictable again; unload refuses a pinned adapter, unregister
forgets the pin, a hot swap keeps it; concurrent pins, unpins and activations keep the invariant.
"""

from __future__ import annotations

import random
import threading

import pytest

from .slot_managers import IDS, MANAGERS, write_constant_adapters


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    """{id: directory} of adapters on q_proj whose lora_A is the constant id."""
    return write_constant_adapters(tmp_path_factory.mktemp("pinning"))


def _holds(mgr, read_slot, lora_id):
    slot = mgr.slot_of(lora_id)
    return slot is not None and read_slot(slot) == float(lora_id)


@pytest.mark.parametrize("side", MANAGERS)
def test_a_pinned_adapter_survives_the_lru(side, adapters):
    mgr, read_slot = MANAGERS[side](2)
    for i in IDS:
        mgr.register(i, adapters[i], name=f"a{i}")
    assert mgr.pin("a1") == mgr.slot_of(1)                  # by name: loaded now
    assert mgr.pinned == [1] and _holds(mgr, read_slot, 1)
    for ids in ([2], [3], [4], [2, 3][:1], [3], [4]):      # the LRU would evict adapter 1 first
        mgr.activate(ids)
        assert _holds(mgr, read_slot, 1), mgr.lora_index_to_id
    mgr.activate([1, 2])                                     # a batch naming the pinned adapter fits
    assert _holds(mgr, read_slot, 1) and _holds(mgr, read_slot, 2)
    mgr.unpin(1)
    mgr.activate([3])
    mgr.activate([4])                                        # now the LRU evicts it
    assert mgr.slot_of(1) is None and mgr.pinned == []


@pytest.mark.parametrize("side", MANAGERS)
def test_pinned_adapters_filling_the_slots_refuse_a_new_one_by_name(side, adapters):
    mgr, read_slot = MANAGERS[side](2)
    for i in IDS:
        mgr.register(i, adapters[i], name=f"a{i}")
    mgr.pin(1)
    mgr.pin(2)
    before = (mgr.lora_index_to_id, mgr.version, dict(mgr.stats))
    with pytest.raises(ValueError, match=r"'a3' \(LoRA id 3\).*2 of the 2 adapter slots.*'a1'.*'a2'.*unpin"):
        mgr.activate([3])
    with pytest.raises(ValueError, match=r"'a4' \(LoRA id 4\).*2 adapter slots"):
        mgr.pin("a4")
    with pytest.raises(ValueError, match=r"'a3'.*2 adapter slots"):
        mgr.activate([1, 3])
    assert (mgr.lora_index_to_id, mgr.version, dict(mgr.stats)) == before
    assert not mgr.can_activate([3]) and mgr.can_activate([1, 2])
    mgr.activate([2, 1])                                     # the pinned ones themselves are served
    mgr.unpin("a2")
    assert mgr.can_activate([1, 3])
    mgr.activate([3])
    assert _holds(mgr, read_slot, 1) and _holds(mgr, read_slot, 3) and mgr.slot_of(2) is None


@pytest.mark.parametrize("side", MANAGERS)
def test_unload_unregister_hot_swap_and_bad_names(side, adapters):
    mgr, read_slot = MANAGERS[side](2)
    for i in IDS:
        mgr.register(i, adapters[i], name=f"a{i}")
    mgr.pin(1)
    with pytest.raises(ValueError, match=r"'a1' \(LoRA id 1\) is pinned: unpin it"):
        mgr.unload(1)
    slot = mgr.slot_of(1)
    mgr.register(1, adapters[1], name="a1")                  # hot swap: same slot, still pinned
    assert mgr.slot_of(1) == slot and mgr.pinned == [1]
    mgr.unregister(1)
    assert mgr.pinned == [] and mgr.slot_of(1) is None
    with pytest.raises(ValueError, match="not pinned"):
        mgr.unpin(2)
    with pytest.raises(ValueError, match="no registered adapter"):
        mgr.pin("nope")
    with pytest.raises(ValueError, match="LoRA id 9 is not registered"):
        mgr.pin(9)
    with pytest.raises(TypeError, match="LoRA id"):
        mgr.pin(1.5)
    mgr.register(5, adapters[2], name="a2")                  # a name two ids hold: ask for the id
    with pytest.raises(ValueError, match=r"2 registered adapters \(ids \[2, 5\]\)"):
        mgr.pin("a2")


@pytest.mark.parametrize("side", MANAGERS)
def test_concurrent_pins_and_activations_keep_pinned_adapters_in_place(side, adapters):
    """Threads pin, unpin and activate at once; whenever a thread holds the lock, every pinned
    adapter sits in a slot that holds its weights, and no call fails except refusals for room."""
    mgr, read_slot = MANAGERS[side](3)
    for i in IDS:
        mgr.register(i, adapters[i])
    errors = []
    rounds = 10 if side == "jax" else 40

    def work(k):
        rng = random.Random(k)
        try:
            for _ in range(rounds):
                i = rng.choice(IDS)
                with mgr.lock:
                    op = rng.random()
                    if op < 0.3 and i not in mgr.pinned and len(mgr.pinned) < 2:
                        mgr.pin(i)
                    elif op < 0.5 and i in mgr.pinned:
                        mgr.unpin(i)
                    elif mgr.can_activate([i]):
                        mgr.activate([i])
                    for p in mgr.pinned:
                        assert _holds(mgr, read_slot, p), (p, mgr.lora_index_to_id)
        except Exception as e:           # collected: a thread's failure must fail the test
            errors.append(f"thread {k}: {type(e).__name__}: {e}")

    pool = [threading.Thread(target=work, args=(k,)) for k in range(3)]
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    assert not errors, errors[:3]


def test_multilora_model_pin_by_name(tmp_path):
    import torch

    from tests.hf_llama import save_peft, tiny_llama
    from torch_lora.hf import MultiLoRAModel
    dirs = {n: save_peft(tiny_llama, tmp_path / n, seed) for seed, n in enumerate(("x", "y", "z"), start=1)}
    mm = MultiLoRAModel(tiny_llama(), max_loras=2, max_rank=8)
    for n, d in dirs.items():
        mm.load_adapter(n, d)
    ids = torch.tensor([[1, 2, 3, 4]])
    mm.pin("x")
    mm.pin("y")
    assert mm.pinned_adapters == ["x", "y"]
    with pytest.raises(ValueError, match=r"'z'.*2 of the 2 adapter slots.*'x'.*'y'"):
        mm(ids, adapter_names=["z"])
    expect = mm(ids, adapter_names=["x"]).logits
    mm.unpin("y")
    mm(ids, adapter_names=["z"])                             # evicts y, never x
    assert mm.adapters.slot_of(mm._ids["x"]) is not None and mm.adapters.slot_of(mm._ids["y"]) is None
    torch.testing.assert_close(mm(ids, adapter_names=["x"]).logits, expect, rtol=0, atol=0)
    with pytest.raises(ValueError, match="no adapter named 'w'"):
        mm.pin("w")
    mm.unload_adapter("x")
    assert mm.pinned_adapters == []


def test_serving_engine_refuses_a_request_pinned_adapters_leave_no_room_for(adapters):
    from jax_lora.serving import Request, ServingEngine
    mgr, _ = MANAGERS["jax"](1)
    for i in (1, 2):
        mgr.register(i, adapters[i], name=f"a{i}")
    mgr.pin(1)
    engine = ServingEngine(mgr.model, mgr, max_seqs=2, max_len=16, max_prefill_tokens=32, min_prefill_len=4)
    with pytest.raises(ValueError, match=r"request 1: adapter 'a2' \(LoRA id 2\).*1 of the 1 adapter slots"):
        engine.generate([Request([1, 2], lora_id=1, max_new_tokens=1), Request([1, 2], lora_id=2, max_new_tokens=1)])
    out = engine.generate([Request([1, 2], lora_id=1, max_new_tokens=2), Request([3], max_new_tokens=2)])
    assert [len(c.tokens) for c in out] == [2, 2] and mgr.pinned == [1]
