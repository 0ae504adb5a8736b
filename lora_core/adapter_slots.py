"""The adapter slot table both frameworks' `AdapterManager`s share: registry, LRU slots, host cache.

A serving engine has L device slots per LoRA layer and any number of adapters. This class keeps,
on the host and without any framework:

  registry     LoRA id (int > 0) -> its source (a PEFT directory, or a private copy of a
               `PeftAdapter` taken at register: changing the caller's object afterwards changes
               nothing served) and name;
  host cache   LoRA id -> the adapter prepared for the slots (the framework's layout), LRU,
               at most `host_cache_size` entries (a reload then skips the disk);
  slot table   slot -> LoRA id or None (`lora_index_to_id`, the wrapper's table), with the slots'
               use in LRU order, and the pinned ids the LRU skips.

With each adapter it keeps its aLoRA invocation tokens (`invocation_tokens(lora_id)`, None for an
adapter that applies to every token; lora_core.alora), read with the adapter.

Registered files are stamped (name, size, modification and change times, inode of each file in
the directory): the stamp is taken before the read and compared after it, so files rewritten
while `register` reads them are read again (up to STAMP_TRIES times, then AdapterError), never
registered with content other than what was read. A reload after eviction compares the files'
stamp with the registered one before and after reading: files changed since registration raise
AdapterError instead of serving other weights under the same id.

Threads. Every method that reads or changes the registry, the host cache or the slot table holds
`lock` (a re-entrant lock), so concurrent callers never see a half-updated table nor write two
adapters into one slot; `register` reads and prepares the adapter before taking it (a slow disk
does not stall the other callers) and then commits under it. A slot table returned by `activate`
stays true only while no other thread activates: a caller that runs a step on the slots holds
`with manager.lock:` across `activate` and the step (or one thread serves, as an engine does).

`activate(ids)` puts a batch's adapters into slots: free slots first, then the least recently
used slots whose adapter the batch does not need and that is not pinned. Every adapter the batch
needs is prepared before any slot is written, so an adapter that fails to load leaves the manager
as it was.

Pinning. `pin(adapter)` puts a registered adapter (its LoRA id, or its registered name) into a
slot and keeps it there: the LRU never evicts it, so a batch that names it never waits for a
load. `unpin(adapter)` makes its slot evictable again (the adapter stays loaded until the LRU
picks it). A batch that needs more slots than the unpinned ones (`num_slots - len(pinned)`, plus
the pinned adapters it names itself) is refused with a ValueError naming the adapters that do not
fit, the slot count and the pinned adapters, before anything changes; so is `pin` when every slot
holds another pinned adapter. `unload` refuses a pinned adapter (unpin it first); `unregister`
forgets the pin with the adapter; re-registering a pinned id (hot swap) keeps it pinned, in its slot.

Adapter files are untrusted input: a directory is read with `load_peft_adapter(...,
module_shapes=..., max_total_bytes=max_adapter_bytes)`, so every tensor's shape is checked against
the model's modules from the safetensors header before any data is read, and all of them together
against `max_adapter_bytes` (None, the default: the model's largest adapter, every LoRA module at
max_rank, lora_core.peft.largest_adapter_bytes; set the attribute to an int to lower or raise it).

A framework's manager subclasses it and provides four things:
  `_module_shapes()` -> {module name: lora_core.peft.ModuleShape}: what the model's modules accept;
  `_prepare_uncounted(adapter)` -> prepared: the host layout of a PeftAdapter (raises
      lora_core.peft.AdapterError for a bad adapter); SlotTable reads directories itself and
      passes the adapter named as registered, so its errors name the adapter as the caller does;
  `_largest_rank(prepared)` -> int: the adapter's largest rank;
  `_write_slot(slot, prepared)`: writes prepared (None: zeros and rank 0) into slot `slot` of every
      layer, on the device.
"""

from __future__ import annotations

import collections
import copy
import dataclasses
import os
import threading
from collections.abc import Iterable
from typing import Any

import numpy as np

from .peft import AdapterError, PeftAdapter, load_peft_adapter

__all__ = ["MAX_LORA_ID", "STAMP_TRIES", "SlotTable"]

MAX_LORA_ID = 2**63 - 1            # the largest id a wrapper's int64 slot table holds
STAMP_TRIES = 3                    # reads of a directory whose files keep changing before register gives up


class SlotTable:
    """See the module docstring. num_slots: L; host_cache_size: prepared adapters kept (>= 1)."""

    def __init__(self, num_slots: int, *, host_cache_size: int = 8):
        if not isinstance(host_cache_size, int) or isinstance(host_cache_size, bool) or host_cache_size < 1:
            raise ValueError(f"host_cache_size must be an int >= 1, got {host_cache_size!r}")
        self.num_slots = int(num_slots)
        self.host_cache_size = host_cache_size
        self._sources: dict = {}                        # id -> directory or PeftAdapter
        self._stamps: dict = {}                         # id -> its directory's file stamps at registration
        self._names: dict = {}
        self._ranks: dict = {}                          # id -> the adapter's largest rank
        self._invocations: dict = {}                    # id -> aLoRA invocation token ids, or None
        self._host: collections.OrderedDict = collections.OrderedDict()    # id -> prepared (LRU)
        self._slots: list = [None] * self.num_slots    # slot -> id
        self._slot_use: collections.OrderedDict = collections.OrderedDict()   # id -> None, LRU order
        self._pinned: set = set()                       # ids the LRU never evicts (always in a slot)
        self.version = 0                                # +1 per slot write
        self.stats = collections.Counter()
        self.max_adapter_bytes: int | None = None       # None: the model's largest adapter (module docstring)
        self.lock = threading.RLock()                   # held by every method that reads or changes the tables

    # -------------------------------------------------------------- the framework's part
    def _module_shapes(self) -> dict:
        raise NotImplementedError

    def _prepare_uncounted(self, adapter: PeftAdapter) -> Any:
        raise NotImplementedError

    def _largest_rank(self, prepared) -> int:
        raise NotImplementedError

    def _write_slot(self, slot: int, prepared) -> None:
        raise NotImplementedError

    # -------------------------------------------------------------- registry
    def register(self, lora_id: int, adapter: str | os.PathLike | PeftAdapter, name: str | None = None) -> None:
        """Makes `lora_id` name `adapter`, read and checked now. Re-registering an id hot-swaps it:
        when it is in a slot, the same slot gets the new weights. A bad adapter raises AdapterError
        and changes nothing (the id keeps its previous adapter, if any). A PeftAdapter is copied
        (later changes to the caller's object are not served); a directory is stamped before it is
        read and checked after (see the module docstring)."""
        if (not isinstance(lora_id, (int, np.integer)) or isinstance(lora_id, bool) or lora_id <= 0
                or lora_id > MAX_LORA_ID):
            raise ValueError(f"lora_id must be an int in 1..2**63 - 1 (0 means no adapter; the wrappers' slot "
                             f"tables hold int64 ids), got {lora_id!r}")
        if not isinstance(adapter, (PeftAdapter, str, os.PathLike)):
            raise TypeError(f"adapter must be a PEFT adapter directory (str or os.PathLike) or a PeftAdapter, got "
                            f"{type(adapter).__name__}")
        lora_id = int(lora_id)
        src = copy.deepcopy(adapter) if isinstance(adapter, PeftAdapter) else os.fspath(adapter)
        name = name or (src.name if isinstance(src, PeftAdapter) else os.path.basename(os.path.normpath(src)))
        (prepared, invocation), stamp = self._read_stamped(src, name)   # raises for a bad adapter; nothing changed
        with self.lock:
            self._count_prepare(src)
            self._invocations[lora_id] = invocation
            self._ranks[lora_id] = self._largest_rank(prepared)
            self._sources[lora_id] = src
            self._stamps[lora_id] = stamp
            self._names[lora_id] = name
            self._host.pop(lora_id, None)
            self._cache(lora_id, prepared)
            if lora_id in self._slots:                      # hot swap: same slot, new weights
                self._write(self._slots.index(lora_id), prepared)
                self.stats["hot_swaps"] += 1

    def _read_stamped(self, src, name: str) -> tuple:
        """((prepared, invocation tokens), stamp) of `src`, the stamp taken before the read and equal to
        the files' after it; a directory whose files change during the read is read again, AdapterError
        after STAMP_TRIES."""
        for _ in range(STAMP_TRIES):
            before = _file_stamps(src)
            prepared = self._prepare(src, name)
            if _file_stamps(src) == before:
                return prepared, before
        raise AdapterError(f"adapter {name!r}: the files in {src!r} changed while they were read, {STAMP_TRIES} "
                           "times in a row; register it once they are written")

    def unregister(self, lora_id: int) -> None:
        """Frees the adapter's slot (zeroed) and forgets it (its pin too)."""
        with self.lock:
            self._pinned.discard(lora_id)
            self.unload(lora_id)
            for table in (self._sources, self._stamps, self._names, self._ranks, self._host, self._invocations):
                table.pop(lora_id, None)

    def invocation_tokens(self, lora_id: int) -> tuple | None:
        """The registered adapter's aLoRA invocation token ids (lora_core.alora), or None when it
        applies to every token (plain LoRA, DoRA)."""
        with self.lock:
            if lora_id not in self._sources:
                raise ValueError(f"LoRA id {lora_id} is not registered (registered: {sorted(self._sources)})")
            return self._invocations.get(lora_id)

    @property
    def registered(self) -> dict:
        """{lora id: name}."""
        with self.lock:
            return dict(self._names)

    # -------------------------------------------------------------- slots
    @property
    def lora_index_to_id(self) -> list:
        """slot -> LoRA id or None (the wrapper's table)."""
        with self.lock:
            return list(self._slots)

    @property
    def slot_ranks(self) -> np.ndarray:
        """(num_slots,) int32: each slot's adapter's largest rank (0 when empty). The layers hold
        their own per-slot ranks, which the kernels read (they skip the zero padding)."""
        with self.lock:
            return np.array([self._ranks.get(i, 0) if i is not None else 0 for i in self._slots], np.int32)

    def slot_of(self, lora_id: int) -> int | None:
        with self.lock:
            return self._slots.index(lora_id) if lora_id in self._slots else None

    def can_activate(self, ids: Iterable[int | None]) -> bool:
        """Whether `activate(ids)` finds slots for every adapter of `ids` next to the pinned ones."""
        with self.lock:
            return len({int(i) for i in ids if i} | self._pinned) <= self.num_slots

    # -------------------------------------------------------------- pinning
    @property
    def pinned(self) -> list:
        """The pinned LoRA ids, sorted."""
        with self.lock:
            return sorted(self._pinned)

    def lora_id_of(self, adapter: int | str) -> int:
        """The registered LoRA id of `adapter`: a LoRA id, or a registered name (held by one id)."""
        with self.lock:
            if isinstance(adapter, str):
                ids = [i for i, n in self._names.items() if n == adapter]
                if len(ids) != 1:
                    what = "no registered adapter" if not ids else f"{len(ids)} registered adapters (ids {sorted(ids)})"
                    raise ValueError(f"adapter name {adapter!r} names {what}; pass its LoRA id (registered: "
                                     f"{self.registered})")
                return ids[0]
            if not isinstance(adapter, (int, np.integer)) or isinstance(adapter, bool):
                raise TypeError(f"adapter must be a LoRA id (int) or a registered name (str), got {adapter!r:.80}")
            if int(adapter) not in self._sources:
                raise ValueError(f"LoRA id {adapter} is not registered (registered: {sorted(self._sources)})")
            return int(adapter)

    def pin(self, adapter: int | str) -> int:
        """Puts the registered `adapter` (LoRA id or name) into a slot, if it is in none, and keeps it
        there: the LRU never evicts a pinned adapter. Returns its slot. Raises ValueError naming the
        adapter and the slot count when every slot holds another pinned adapter (nothing changes)."""
        with self.lock:
            lora_id = self.lora_id_of(adapter)
            if lora_id not in self._slots:
                self.activate([lora_id])          # refuses when the pinned adapters fill every slot
            self._pinned.add(lora_id)
            return self._slots.index(lora_id)

    def unpin(self, adapter: int | str) -> None:
        """Makes the adapter's slot evictable by the LRU again (it stays loaded until then)."""
        with self.lock:
            lora_id = self.lora_id_of(adapter)
            if lora_id not in self._pinned:
                raise ValueError(f"adapter {self._label(lora_id)} is not pinned (pinned: "
                                 f"{[self._label(i) for i in sorted(self._pinned)]})")
            self._pinned.discard(lora_id)

    def _label(self, lora_id: int) -> str:
        return f"{self._names.get(lora_id)!r} (LoRA id {lora_id})"

    def activation_error(self, ids: Iterable[int | None]) -> str | None:
        """Why `activate(ids)` would be refused for lack of slots (None: it finds slots): the adapters
        of `ids` not in a slot outnumber the slots that are free or hold an unpinned adapter `ids`
        does not name, the pinned adapters filling the rest."""
        with self.lock:
            need = [int(i) for i in dict.fromkeys(i for i in ids if i)]
            if len(need) > self.num_slots:
                return f"{len(need)} distinct adapters requested at once, but there are {self.num_slots} slots"
            incoming = [i for i in need if i not in self._slots]
            room = sum(1 for i in self._slots if i is None or (i not in self._pinned and i not in need))
            if len(incoming) <= room:
                return None
            pinned = [self._label(i) for i in sorted(self._pinned)]
            refused = [self._label(i) for i in incoming[room:]]
            busy = sum(1 for i in self._slots if i in need and i not in self._pinned)
            return (f"adapter{'s' if len(refused) > 1 else ''} {', '.join(refused)} cannot be loaded: "
                    f"{len(pinned)} of the {self.num_slots} adapter slots (the capacity, max_loras) hold pinned "
                    f"adapters {pinned}" + (f" and {busy} hold adapters the same batch needs" if busy else "")
                    + "; unpin one (unpin(name)) or build the model with more slots")

    def activate(self, ids: Iterable[int | None]) -> list:
        """Puts every adapter in `ids` (0 / None ignored) into a slot; returns lora_index_to_id.

        Free slots first, then the least recently used slots whose adapter is not in `ids`.
        Raises ValueError for an unknown id or more distinct adapters than slots, and AdapterError
        when an adapter cannot be reloaded from disk; either way nothing changes (every adapter is
        prepared before any slot is written).
        """
        if ids is None or isinstance(ids, (str, bytes)):
            raise TypeError(f"ids must be an iterable of LoRA ids (int, or 0 / None for no adapter), got {ids!r}")
        ids = list(ids)
        bad = next(((k, i) for k, i in enumerate(ids) if i is not None
                    and (not isinstance(i, (int, np.integer)) or isinstance(i, bool))), None)
        if bad is not None:
            raise TypeError(f"ids[{bad[0]}] must be an int LoRA id (or 0 / None for no adapter), got "
                            f"{type(bad[1]).__name__} {bad[1]!r:.80}")
        with self.lock:
            need = [int(i) for i in dict.fromkeys(i for i in ids if i)]
            unknown = [i for i in need if i not in self._sources]
            if unknown:
                raise ValueError(f"LoRA ids {unknown} are not registered (registered: {sorted(self._sources)})")
            refused = self.activation_error(need)
            if refused is not None:
                raise ValueError(refused)
            incoming = {i: self._host_peek(i) for i in need if i not in self._slots}   # may raise
            for i in need:
                if i in self._slots:
                    self.stats["slot_hits"] += 1
                else:
                    prepared, cached = incoming[i]
                    if cached:
                        self.stats["host_hits"] += 1
                    else:
                        self._count_prepare(self._sources[i])
                        self._ranks[i] = self._largest_rank(prepared)
                    self._cache(i, prepared)           # (re)inserted: caching another may have evicted it
                    self._write(self._free_slot(set(need)), prepared, lora_id=i)
                self._slot_use.pop(i, None)
                self._slot_use[i] = None
            return self.lora_index_to_id

    def load(self, lora_id: int, adapter=None) -> int:
        """Registers (when `adapter` is given) and activates one adapter; returns its slot."""
        with self.lock:
            if adapter is not None:
                self.register(lora_id, adapter)
            self.activate([lora_id])
            return self.slot_of(lora_id)

    def unload(self, lora_id: int) -> None:
        """Frees the adapter's slot (zeroed, rank 0); it stays registered and in the host cache.
        Raises ValueError for a pinned adapter (unpin it first)."""
        with self.lock:
            if lora_id in self._pinned:
                raise ValueError(f"adapter {self._label(lora_id)} is pinned: unpin it before unloading it")
            if lora_id in self._slots:
                slot = self._slots.index(lora_id)
                self._write(slot, None)
                self._slots[slot] = None
                self._slot_use.pop(lora_id, None)
                self.stats["unloads"] += 1

    def _write(self, slot: int, prepared, lora_id: int | None = None) -> None:
        self._write_slot(slot, prepared)
        if lora_id is not None:
            self._slots[slot] = lora_id
            self.stats["slot_loads"] += 1
        self.version += 1

    def _free_slot(self, keep: set) -> int:
        if None in self._slots:
            return self._slots.index(None)
        for victim in self._slot_use:                  # least recently used first
            if victim not in keep and victim not in self._pinned:
                self._slot_use.pop(victim)
                self.stats["evictions"] += 1
                return self._slots.index(victim)
        raise ValueError("no slot can be freed")      # unreachable: activate checked the count

    # -------------------------------------------------------------- host cache
    def _count_prepare(self, src) -> None:
        self.stats["prepares" if isinstance(src, PeftAdapter) else "disk_loads"] += 1

    def _cache(self, lora_id: int, prepared) -> None:
        self._host[lora_id] = prepared
        self._host.move_to_end(lora_id)
        while len(self._host) > self.host_cache_size:
            self._host.popitem(last=False)
            self.stats["host_evictions"] += 1

    def _host_peek(self, lora_id: int) -> tuple:
        """(the adapter's prepared host data, whether it came from the host cache), changing nothing:
        the caller updates the cache and the counters once every adapter of the batch is prepared."""
        if lora_id in self._host:
            return self._host[lora_id], True
        src = self._sources[lora_id]
        changed = (f"adapter {self._names[lora_id]!r} (LoRA id {lora_id}): the files in {src!r} changed since it was "
                   "registered; register it again to serve the new files")
        if _file_stamps(src) != self._stamps.get(lora_id):
            raise AdapterError(changed)
        prepared, _invocation = self._prepare(src, self._names[lora_id])
        if _file_stamps(src) != self._stamps.get(lora_id):     # rewritten while being read
            raise AdapterError(changed)
        return prepared, False

    def _prepare(self, src, name: str) -> tuple:
        """(`_prepare_uncounted` of `src` (a directory, read here, or a PeftAdapter) as the adapter
        `name`, its aLoRA invocation tokens or None): every AdapterError names it as registered (a
        directory's own name, or the name a PeftAdapter was built with, is not what the caller
        called it), and the path."""
        if isinstance(src, PeftAdapter):
            adapter = src if src.name == name else dataclasses.replace(src, name=name)
        else:
            try:
                adapter = load_peft_adapter(src, name, module_shapes=self._module_shapes(),
                                            max_total_bytes=self.max_adapter_bytes)
            except AdapterError as e:
                text = str(e)           # checks against the model already name the adapter and its directory
                named = text.startswith(f"adapter {name!r}")
                raise AdapterError(text if named else f"adapter {name!r}: {text}") from None
        return self._prepare_uncounted(adapter), adapter.invocation_tokens


def _file_stamps(src) -> tuple | None:
    """(name, size, modification and change times in ns, inode) of the files directly in a source
    directory, sorted (any rewrite changes the change time); None for a PeftAdapter (held in
    memory) or a directory that cannot be listed."""
    if isinstance(src, PeftAdapter):
        return None
    try:
        stamps = []
        for entry in os.scandir(src):
            if entry.is_file():
                st = entry.stat()
                stamps.append((entry.name, st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino))
        return tuple(sorted(stamps))
    except OSError:
        return None
