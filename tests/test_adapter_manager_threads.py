"""Both AdapterManagers (jax_lora.adapters, torch_lora.adapters) under concurrent callers.

Several threads register (hot swaps included) and activate adapters on a manager with fewer slots
than adapters. Each adapter's lora_A is the constant of its id, so a slot's content says which
adapter it holds. Holding `manager.lock` across `activate` and the read of the slots, every thread
finds its own adapters in the slots `activate` returned; without it, the tables stay consistent
(no id in two slots, every slot holding the adapter its table names, counters that add up) and no
call fails.
"""

from __future__ import annotations

import random
import sys
import threading

import pytest

from lora_core.peft import load_peft_adapter

from .slot_managers import IDS, MANAGERS, write_constant_adapters


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    """{id: directory} of adapters on q_proj whose lora_A is the constant id."""
    return write_constant_adapters(tmp_path_factory.mktemp("threads"))


@pytest.fixture
def fast_switching():
    """Thread switches every microsecond, so that unsynchronised table updates would interleave."""
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    yield
    sys.setswitchinterval(old)


def _run(threads: int, work) -> list:
    errors = []

    def body(k):
        try:
            work(k)
        except Exception as e:            # collected: a thread's failure must fail the test
            errors.append(f"thread {k}: {type(e).__name__}: {e}")

    pool = [threading.Thread(target=body, args=(k,)) for k in range(threads)]
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    return errors


def _check_tables(mgr, read_slot):
    table = mgr.lora_index_to_id
    held = [i for i in table if i is not None]
    assert len(held) == len(set(held)), f"an adapter in two slots: {table}"
    for slot, i in enumerate(table):
        if i is not None:
            assert read_slot(slot) == float(i), f"slot {slot} is named {i} but holds adapter {read_slot(slot)}"
    stats = mgr.stats
    assert stats["slot_loads"] - stats["evictions"] - stats["unloads"] == len(held)


@pytest.mark.parametrize("side", MANAGERS)
def test_threads_holding_the_lock_find_their_own_adapters(side, adapters, fast_switching):
    mgr, read_slot = MANAGERS[side]()
    in_memory = {i: load_peft_adapter(path) for i, path in adapters.items()}
    for i in IDS:
        mgr.register(i, adapters[i])
    rounds = 12 if side == "jax" else 60

    def work(k):
        rng = random.Random(k)
        for n in range(rounds):
            ids = rng.sample(IDS, rng.choice((1, 2)))
            if n % 5 == k % 5:                               # a hot swap: the same weights, from memory
                mgr.register(ids[0], in_memory[ids[0]])
            with mgr.lock:
                table = mgr.activate(ids)
                for i in ids:
                    got = read_slot(table.index(i))
                    assert got == float(i), f"adapter {i} asked for, slot {table.index(i)} holds {got}"

    errors = _run(4, work)
    assert not errors, errors[:3]
    _check_tables(mgr, read_slot)


@pytest.mark.parametrize("side", MANAGERS)
def test_unsynchronised_callers_keep_the_tables_consistent(side, adapters, fast_switching):
    """register / activate / unload from several threads at once: no call fails, and afterwards every
    slot holds the adapter the table names, no adapter sits in two slots, the counters add up."""
    mgr, read_slot = MANAGERS[side]()
    for i in IDS:
        mgr.register(i, adapters[i])
    rounds = 12 if side == "jax" else 60

    def work(k):
        rng = random.Random(100 + k)
        for n in range(rounds):
            ids = rng.sample(IDS, rng.choice((1, 2)))
            if n % 7 == k:
                mgr.unload(ids[0])
            elif n % 5 == k:
                mgr.register(ids[0], adapters[ids[0]])
            else:
                table = mgr.activate(ids)
                assert len([i for i in table if i is not None]) == len({i for i in table if i is not None})

    errors = _run(4, work)
    assert not errors, errors[:3]
    _check_tables(mgr, read_slot)
