"""Process groups for the tensor-parallel tests: a pool of P processes joined in one torch.distributed
group (gloo on 127.0.0.1, or NCCL with one GPU each), started once and given cases to run.

    pool = ProcessPool(world=2, backend="gloo")
    results = pool.run(case_fn, **kwargs)   # case_fn(rank, world, **kwargs) on every rank -> [r0, r1]
    pool.close()

Every rank runs the same case; a case returns a picklable value (its measurements), and the test
asserts on the values of all ranks. An exception on any rank is raised in the caller with every
rank's traceback. Bounded: the group's collectives time out after `timeout` seconds, a case's
results are awaited for at most `timeout` + 30 seconds; after a timeout or a crash the pool is
torn down (processes joined, then terminated) and later cases fail at once with the reason.

`CollectiveLog` records the collectives a process issues (kind and payload bytes) by wrapping the
torch.distributed functions in place around a block; the real collective runs inside the wrapper.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import queue
import socket
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, backend: str, timeout: float, inbox, outbox) -> None:
    try:
        torch.set_num_threads(1)
        if backend == "nccl":
            torch.cuda.set_device(rank)
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=timeout))
        outbox.put((rank, "ready", None))
    except BaseException:
        outbox.put((rank, "error", traceback.format_exc()))
        return
    try:
        while True:
            job = inbox.get()
            if job is None:
                break
            fn, kwargs = job
            try:
                outbox.put((rank, "ok", fn(rank, world, **kwargs)))
            except BaseException:
                outbox.put((rank, "error", traceback.format_exc()))
    finally:
        dist.destroy_process_group()


class ProcessPool:
    """`world` processes in one process group, each waiting for cases (see the module docstring)."""

    def __init__(self, world: int, backend: str = "gloo", timeout: float = 60.0):
        self.world, self.backend, self.timeout = world, backend, timeout
        self.broken = None
        ctx = mp.get_context("spawn")
        self._inboxes = [ctx.Queue() for _ in range(world)]
        self._outbox = ctx.Queue()
        port = _free_port()
        self._procs = [ctx.Process(target=_worker, args=(r, world, port, backend, timeout, self._inboxes[r],
                                                         self._outbox), daemon=True) for r in range(world)]
        for p in self._procs:
            p.start()
        self._collect("start the process group", expect="ready", wait=timeout + 120)

    def _collect(self, what: str, expect: str = "ok", wait: float | None = None) -> list:
        results, errors = [None] * self.world, {}
        wait = self.timeout + 30 if wait is None else wait
        for _ in range(self.world):
            try:
                rank, status, value = self._outbox.get(timeout=wait)
            except queue.Empty:
                self.close()
                self.broken = f"no answer within {wait:.0f} s to {what!r}"
                raise TimeoutError(f"{self.world}-process {self.backend} pool: {self.broken}") from None
            if status == "error":
                errors[rank] = value
            else:
                results[rank] = value
        if errors:
            text = "\n".join(f"--- rank {r} ---\n{tb}" for r, tb in sorted(errors.items()))
            if expect == "ready" or len(errors) < self.world:
                # Ranks that did not fail may be left inside a collective: the group cannot be reused.
                self.close()
                self.broken = f"{what!r} failed on ranks {sorted(errors)}"
            raise AssertionError(f"{what} failed on {len(errors)} of {self.world} ranks:\n{text}")
        return results

    def run(self, fn, **kwargs) -> list:
        """fn(rank, world, **kwargs) on every rank; the ranks' return values in rank order."""
        if self.broken:
            raise RuntimeError(f"the {self.world}-process pool is unusable: {self.broken}")
        for q in self._inboxes:
            q.put((fn, kwargs))
        return self._collect(f"{fn.__name__}({', '.join(f'{k}={v!r}' for k, v in kwargs.items())})")

    def close(self) -> None:
        for q, p in zip(self._inboxes, self._procs):
            if p.is_alive():
                with contextlib.suppress(Exception):
                    q.put(None)
        for p in self._procs:
            p.join(timeout=10)
        for p in self._procs:
            if p.is_alive():
                p.terminate()
                p.join(timeout=5)
        self.broken = self.broken or "closed"


_WRAPPED = ("all_reduce", "all_gather_single", "all_gather_into_tensor", "all_gather", "reduce_scatter_tensor",
            "broadcast", "all_to_all_single")


class CollectiveLog:
    """Records (kind, payload bytes) of each collective issued inside `with log:` on this process.

    Payload: the all-reduced tensor's bytes, or the all-gathered output's bytes (all_gather_single
    and all_gather_into_tensor both log as "all_gather"). A collective called from inside another
    (torch's own forwarding) is logged once.
    """

    def __init__(self):
        self.calls: list[tuple[str, int]] = []
        self._saved: dict = {}
        self._depth = 0

    def _wrap(self, name, fn):
        def wrapped(*args, **kwargs):
            if self._depth == 0:
                self.calls.append(self._describe(name, args, kwargs))
            self._depth += 1
            try:
                return fn(*args, **kwargs)
            finally:
                self._depth -= 1
        return wrapped

    @staticmethod
    def _describe(name, args, kwargs) -> tuple[str, int]:
        def nbytes(t):
            return t.numel() * t.element_size()
        first = args[0] if args else next(iter(kwargs.values()))
        if name in ("all_gather_single", "all_gather_into_tensor"):
            return "all_gather", nbytes(first)
        if name == "all_gather":
            return "all_gather", sum(nbytes(t) for t in first)
        return name, nbytes(first)

    def __enter__(self):
        for name in _WRAPPED:
            fn = getattr(dist, name, None)
            if fn is not None:
                self._saved[name] = fn
                setattr(dist, name, self._wrap(name, fn))
        return self

    def __exit__(self, *exc):
        for name, fn in self._saved.items():
            setattr(dist, name, fn)
        self._saved.clear()
        return False


def cuda_devices() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def gloo_env_ok() -> bool:
    """gloo on 127.0.0.1 (no network needed); False where torch.distributed is not built in."""
    return dist.is_available() and dist.is_gloo_available() and os.name == "posix"
