"""Builds and loads `cuda_launch.c` (launching compiled Triton kernels from C; see its header).

The library is compiled at first use with the machine's C compiler (the one Triton itself needs
for its launchers), against Triton's bundled cuda.h and, for the XLA FFI handler, jaxlib's FFI
headers; it is cached under $LORA_CORE_CACHE_DIR (default ~/.cache/lora_core) by a hash of the
source and headers. Nothing here imports torch; jax is imported only to find its FFI headers.

The cache is verified, never trusted: beside each `cuda_launch_<hash>.so` a `.sha256` record holds
its size and SHA-256. A build compiles into a temporary file of the cache directory, loads it once
(a library the loader refuses is never cached), writes the record and then moves the library into
place (`os.replace`: readers see the whole file or none); the temporary files are removed when the
build fails or is interrupted (KeyboardInterrupt included). A cached library whose record is
missing or does not match (truncated, overwritten) is rebuilt, with a warning on the "lora_core"
logger, and so is one the loader refuses (`load_library`).

`PreparedLaunches` is the torch side's use: kernel launches whose parameter blocks are built
once, launched in order with a few parameters patched per call.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from collections.abc import Sequence

SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "cuda_launch.c")
# parameter kinds of jl_prepared_new (and, 0-5, of the FFI handler's `params` attribute)
ARG, OUT, I32, F32, I64, NULL, PTR, COUNTERS, ARG_AT = range(9)
_LOG = logging.getLogger("lora_core")


def _cache_dir() -> str:
    d = os.environ.get("LORA_CORE_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "lora_core")
    os.makedirs(d, exist_ok=True)
    return d


def _include_dirs(xla_ffi: bool) -> list:
    import triton
    dirs = [os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "include")]
    if xla_ffi:
        import jax
        dirs.append(jax.ffi.include_dir())
    return dirs


def build_library(xla_ffi: bool, out_dir: str | None = None) -> str:
    """Compiles cuda_launch.c into a shared library (once per source and header version); its path.

    xla_ffi: include the XLA FFI handler (needs jaxlib's headers). A cached library is used only
    when its record matches (`verify_cached`); otherwise it is rebuilt, with a warning."""
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if not compiler:
        raise RuntimeError("launching Triton kernels from C needs a C compiler (cc, gcc or clang, or $CC)")
    includes = _include_dirs(xla_ffi)
    with open(SOURCE, "rb") as f:
        digest = hashlib.sha256(f.read())
    digest.update(b"xla" if xla_ffi else b"plain")
    for inc in includes:
        for name in ("cuda.h", os.path.join("xla", "ffi", "api", "c_api.h")):
            path = os.path.join(inc, name)
            if os.path.exists(path):
                with open(path, "rb") as f:
                    digest.update(f.read())
    out_dir = out_dir or _cache_dir()
    path = os.path.join(out_dir, f"cuda_launch_{digest.hexdigest()[:20]}.so")
    if os.path.exists(path):
        problem = verify_cached(path)
        if not problem:
            return path
        _LOG.warning("the cached C launcher %s is damaged (%s): rebuilding it", path, problem)
        _remove(path, _record_path(path))
    cmd = [compiler, "-O2", "-shared", "-fPIC", "-std=gnu11", "-Wall", "-Werror",
           *(["-DJL_XLA_FFI"] if xla_ffi else []), *[f"-I{i}" for i in includes], SOURCE, "-o", "{out}",
           "-ldl", "-lpthread"]
    _build_atomically(cmd, path)
    return path


def _record_path(path: str) -> str:
    return path + ".sha256"


def _fingerprint(path: str) -> str:
    """'<size> <sha256 hex>' of the file at `path`."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return f"{os.path.getsize(path)} {h.hexdigest()}"


def verify_cached(path: str) -> str:
    """Why the cached library at `path` cannot be used ("" when its size and SHA-256 match the
    record written beside it at build time)."""
    try:
        with open(_record_path(path)) as f:
            recorded = f.read().strip()
    except OSError:
        return "no checksum record beside it"
    try:
        actual = _fingerprint(path)
    except OSError as e:
        return f"unreadable: {e}"
    if actual == recorded:
        return ""
    size, recorded_size = actual.split()[0], recorded.split()[0] if recorded else "?"
    return (f"{size} bytes, {recorded_size} recorded" if size != recorded_size
            else "its SHA-256 differs from the recorded one")


def _remove(*paths: str) -> None:
    for p in paths:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(p)


def _build_atomically(cmd: list, path: str) -> None:
    """Runs the compiler command (its "{out}" argument: a temporary file beside `path`), checks
    that the result loads, writes the record and moves the library to `path`. On any failure or
    interrupt the temporary files are removed and the error propagates."""
    out_dir = os.path.dirname(path)
    fd, tmp = tempfile.mkstemp(prefix=".cuda_launch_", suffix=".so.tmp", dir=out_dir)
    os.close(fd)
    record_tmp = tmp + ".sha256"
    try:
        cmd = [tmp if a == "{out}" else a for a in cmd]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode:
            raise RuntimeError(f"building the C launcher failed: {' '.join(cmd)}\n{proc.stderr[-4000:]}")
        try:
            ctypes.CDLL(tmp)
        except OSError as e:
            raise RuntimeError(f"the C launcher just built cannot be loaded: {e}") from e
        with open(record_tmp, "w") as f:
            f.write(_fingerprint(tmp) + "\n")
        # The record first: a reader that sees the library also sees its record.
        os.replace(record_tmp, _record_path(path))
        os.replace(tmp, path)
    except BaseException:
        _remove(tmp, record_tmp)
        raise


def load_library(xla_ffi: bool, out_dir: str | None = None) -> ctypes.CDLL:
    """The library built by `build_library`, loaded and declared (`declare`). A cached library the
    loader refuses (e.g. damaged after its record was written) is rebuilt once, with a warning; a
    second refusal raises OSError."""
    path = build_library(xla_ffi, out_dir)
    try:
        return declare(ctypes.CDLL(path))
    except OSError as e:
        _LOG.warning("the cached C launcher %s cannot be loaded (%s): rebuilding it", path, e)
        _remove(path, _record_path(path))
    return declare(ctypes.CDLL(build_library(xla_ffi, out_dir)))


def declare(lib: ctypes.CDLL) -> ctypes.CDLL:
    """Sets the ctypes signatures of the library's plain C entry points."""
    c = ctypes
    lib.jl_load_kernel.argtypes = [c.c_int64, c.c_char_p, c.c_char_p, c.c_int, c.c_int, c.c_char_p, c.c_int]
    lib.jl_load_kernel.restype = c.c_int
    lib.jl_prepared_new.argtypes = [c.c_void_p, c.c_int, c.c_int, c.c_int, c.c_int, c.c_int, c.c_int, c.c_int,
                                    c.c_void_p, c.c_int, c.c_void_p, c.c_char_p, c.c_int]
    lib.jl_prepared_new.restype = c.c_void_p
    lib.jl_prepared_free.argtypes = [c.c_void_p]
    lib.jl_prepared_free.restype = None
    lib.jl_prepared_launch.argtypes = [c.POINTER(c.c_void_p), c.c_int, c.c_void_p, c.POINTER(c.c_uint64)]
    lib.jl_prepared_launch.restype = c.c_int
    lib.jl_ensure_counters.argtypes = [c.c_int, c.c_int64, c.c_char_p, c.c_int]
    lib.jl_ensure_counters.restype = c.c_int
    lib.jl_error_string.argtypes = [c.c_int]
    lib.jl_error_string.restype = c.c_char_p
    lib.jl_allow_shared.argtypes = [c.c_void_p, c.c_int]
    lib.jl_allow_shared.restype = c.c_int
    return lib


@functools.cache
def plain_library() -> ctypes.CDLL:
    """The library without the XLA FFI handler (what torch needs)."""
    return load_library(xla_ffi=False)


# Launch flags (jl_prepared_new's `flags`; the FFI handler's per-kernel launch word 5).
FLAG_PDL = 1          # programmatic dependent launch (programmatic stream serialization)
FLAG_COOPERATIVE = 2  # cooperative launch: the driver refuses a grid that cannot be co-resident


class PreparedLaunches:
    """Kernel launches with their parameter blocks built once; `launch(stream, vars)` runs them in
    order, each with its slots set from vars.

    launches: per kernel (function handle, grid (3 ints), threads per block, dynamic shared bytes,
    flags, params, slots): flags FLAG_PDL | FLAG_COOPERATIVE; params a list of (kind, value) with
    kinds I32, F32 (value: the float), I64, NULL, PTR; slots a list of (parameter index, variable
    index). `vars` is a ctypes uint64 array the caller fills per call (pointers; float32 variables
    as their bits).
    """

    __slots__ = ("_lib", "_handles", "_array", "n")

    def __init__(self, launches: Sequence[tuple], lib: ctypes.CDLL | None = None):
        import numpy as np
        self._lib = lib or plain_library()
        self._handles = []
        err = ctypes.create_string_buffer(512)
        for fn, grid, threads, shared, flags, params, slots in launches:
            kv = []
            for kind, v in params:
                if kind == F32:
                    v = int(np.array(v, np.float32).view(np.int32))
                kv += [int(kind), int(v)]
            kv_arr = (ctypes.c_int64 * max(1, len(kv)))(*kv)
            sl = [int(v) for pair in slots for v in pair]
            sl_arr = (ctypes.c_int32 * max(1, len(sl)))(*sl)
            h = self._lib.jl_prepared_new(ctypes.c_void_p(fn), *[int(g) for g in grid], int(threads), int(shared),
                                          int(flags), len(params), kv_arr, len(slots), sl_arr, err, len(err))
            if not h:
                self.close()
                raise RuntimeError(err.value.decode())
            self._handles.append(h)
        self.n = len(self._handles)
        self._array = (ctypes.c_void_p * max(1, self.n))(*self._handles)

    def launch(self, stream: int, vars_) -> None:
        r = self._lib.jl_prepared_launch(self._array, self.n, stream, vars_)
        if r:
            raise RuntimeError(f"cuLaunchKernelEx failed: {self._lib.jl_error_string(r).decode()} ({r})")

    def close(self) -> None:
        for h in self._handles:
            self._lib.jl_prepared_free(h)
        self._handles = []
        self.n = 0

    def __del__(self):
        # try/except, not contextlib.suppress: at interpreter exit a module's globals may be gone
        try:  # noqa: SIM105
            self.close()
        except Exception:
            pass
