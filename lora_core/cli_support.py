"""What both console scripts (`jax-lora`, `torch-lora`) need beside their demos: Ctrl-C as one line
and exit status 130, sizes checked against the memory there is, and counted nouns.

Ctrl-C. `interrupt_handler(prog)` installs a SIGINT handler for the duration of a `with` block. The
handler never raises into the running code (a KeyboardInterrupt raised inside a callback of a native
library, e.g. while XLA compiles, can be swallowed or crash the process): it runs the registered
clean-ups (`on_interrupt`: the demo's temporary directories), prints `<prog>: interrupted` on
stderr and ends the process with `os._exit(130)` (130 = 128 + SIGINT, the shell's convention),
without unwinding native threads. Python runs a signal handler in the main thread between two
bytecodes, so an interrupt during a native call (a compilation, a kernel) takes effect when that
call returns: the compilation finishes, then the process exits.

Sizes. `check_size(option, value, cap, per_item, available, what)` refuses a count whose memory
(value x per_item bytes) exceeds the budget of `available` bytes, or which exceeds `cap`, with a
one-line message naming the option and the limit (`SizeError`, a ValueError).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import threading
from collections.abc import Callable

__all__ = ["SizeError", "available_host_bytes", "check_size", "human_bytes", "interrupt_handler", "on_interrupt",
           "plural", "read_model_sizes"]

EXIT_INTERRUPTED = 130
_CLEANUPS: list = []


def plural(n: int, noun: str, nouns: str | None = None) -> str:
    """'1 adapter', '3 adapters' (nouns: the plural when it is not noun + 's')."""
    return f"{n} {noun if n == 1 else (nouns or noun + 's')}"


# ----------------------------------------------------------------------------- Ctrl-C

@contextlib.contextmanager
def on_interrupt(cleanup: Callable[[], object]):
    """Registers `cleanup` to run if the process is interrupted inside the block."""
    _CLEANUPS.append(cleanup)
    try:
        yield
    finally:
        with contextlib.suppress(ValueError):
            _CLEANUPS.remove(cleanup)


def _handler(prog: str):
    def handle(signum, frame):
        signal.signal(signal.SIGINT, signal.SIG_IGN)          # a second Ctrl-C does not cut the clean-up short
        for cleanup in reversed(_CLEANUPS):
            with contextlib.suppress(Exception):
                cleanup()
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        newline = ""
        with contextlib.suppress(Exception):
            newline = "\n" if sys.stderr.isatty() else ""      # after a progress bar's carriage return
        os.write(2, f"{newline}{prog}: interrupted\n".encode())
        os._exit(EXIT_INTERRUPTED)
    return handle


@contextlib.contextmanager
def interrupt_handler(prog: str):
    """SIGINT -> clean-ups, `<prog>: interrupted` on stderr, exit status 130 (see the module
    docstring), inside the block; the previous handler afterwards. Outside the main thread (where
    Python cannot set signal handlers) the block runs unchanged."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGINT, _handler(prog))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


# ----------------------------------------------------------------------------- sizes

class SizeError(ValueError):
    """A count too large for the memory here or for the demo's cap; the message names the option."""


def available_host_bytes() -> int | None:
    """Memory the kernel says is available to new allocations (MemAvailable), else free physical
    pages; None when neither can be read."""
    with contextlib.suppress(OSError, ValueError), open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    with contextlib.suppress(OSError, ValueError, AttributeError):
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return None


def human_bytes(n: float) -> str:
    for unit in ("bytes", "kB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "bytes" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"


def check_size(option: str, value: int, *, cap: int, per_item: float, available: float | None, what: str,
               where: str, share: float = 0.5) -> None:
    """Raises SizeError when `value` exceeds `cap` or value x per_item bytes exceed `share` of the
    `available` bytes (None: memory unknown, the cap alone applies).

    option: the command-line option ("--max-seqs"); what: what one item costs ("KV cache per row");
    where: the memory's name ("cpu memory")."""
    fit = None
    if available is not None and per_item > 0:
        fit = max(0, int(available * share // per_item))
    limit = cap if fit is None else min(cap, fit)
    if value <= limit:
        return
    if fit is None:
        raise SizeError(f"{option} {value} is too large: the limit is {cap} (the demo's cap)")
    memory = (f"{what} {human_bytes(per_item)}, {value} would need {human_bytes(value * per_item)}; "
              f"{human_bytes(available)} of {where} available, {share:.0%} of it usable")
    if fit < cap:
        raise SizeError(f"{option} {value} is too large: at most {fit} fit in memory here ({memory})")
    raise SizeError(f"{option} {value} is too large: the limit is {cap}"
                    + (f" (the demo's cap; {memory})" if value > fit else " (the demo's cap)"))


def read_model_sizes(model_dir: str) -> dict | None:
    """A Hugging Face checkpoint's sizes from its config.json: {hidden, layers, heads, kv_heads,
    head_dim, inter, vocab, max_pos, experts} (ints; max_pos 0 when the config has none, experts 1
    for a dense model; inter is each expert's width in a MoE model); None when the file
    cannot be read or lacks them (loading the model then reports the problem)."""
    try:
        with open(os.path.join(model_dir, "config.json")) as f:
            raw = json.load(f)
        hidden, layers, heads = int(raw["hidden_size"]), int(raw["num_hidden_layers"]), int(raw["num_attention_heads"])
        kv = int(raw.get("num_key_value_heads") or heads)
        return {"hidden": hidden, "layers": layers, "heads": heads, "kv_heads": kv,
                "head_dim": int(raw.get("head_dim") or hidden // heads),
                "inter": int(raw.get("intermediate_size") or 0), "vocab": int(raw["vocab_size"]),
                "max_pos": int(raw.get("max_position_embeddings") or 0),
                "experts": int(raw.get("num_local_experts") or raw.get("num_experts") or 1)}
    except (OSError, ValueError, KeyError, TypeError, ZeroDivisionError, RecursionError):
        return None


def package_version(fallback: str) -> str:
    """The installed distribution's version; `fallback` (the package's `__version__`) when the
    tree runs without being installed."""
    from importlib import metadata
    try:
        return metadata.version("jax-torch-lora")
    except metadata.PackageNotFoundError:
        return fallback


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1."""
    import argparse
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value
