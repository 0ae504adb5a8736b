"""The C launcher's on-disk cache (lora_core.kernels.cuda_launch): what a build leaves behind, and
what happens to a damaged cached library.

Builds run the machine's C compiler on the CPU (no GPU needed; the torch flavour without the XLA
FFI handler, which the JAX side builds the same way). A build leaves the library and its size +
SHA-256 record and no temporary file, also when the compiler fails or the build is interrupted;
a truncated library, or one whose record matches but which the loader refuses, is rebuilt with a
warning, never reused.
"""

from __future__ import annotations

import ctypes
import logging
import os
import stat

import pytest

from lora_core.kernels import cuda_launch


def _build(tmp_path):
    try:
        return cuda_launch.build_library(False, str(tmp_path))
    except (RuntimeError, ImportError) as e:          # no C compiler / no Triton headers here
        pytest.skip(str(e))


def _fake_compiler(tmp_path, body: str) -> str:
    """A compiler script: finds its -o argument as $out, then runs `body`."""
    path = tmp_path / "fake-cc.sh"
    path.write_text('#!/bin/sh\nout=""\nprev=""\nfor a in "$@"; do [ "$prev" = "-o" ] && out="$a"; prev="$a"; done\n'
                    + body + "\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return str(path)


def test_a_build_leaves_the_library_and_its_record_only(tmp_path):
    path = _build(tmp_path)
    assert sorted(os.listdir(tmp_path)) == sorted([os.path.basename(path), os.path.basename(path) + ".sha256"])
    assert cuda_launch.verify_cached(path) == ""
    with open(path + ".sha256") as f:
        size, digest = f.read().split()
    assert int(size) == os.path.getsize(path) and len(digest) == 64
    assert cuda_launch.build_library(False, str(tmp_path)) == path          # reused as it is


def test_a_truncated_library_is_rebuilt_with_a_warning(tmp_path, caplog):
    path = _build(tmp_path)
    whole = os.path.getsize(path)
    with open(path, "r+b") as f:
        f.truncate(whole // 2)
    assert "bytes" in cuda_launch.verify_cached(path)
    with caplog.at_level(logging.WARNING, logger="lora_core"):
        again = cuda_launch.build_library(False, str(tmp_path))
    assert again == path and os.path.getsize(path) == whole and cuda_launch.verify_cached(path) == ""
    assert any("damaged" in r.getMessage() and path in r.getMessage() for r in caplog.records)
    cuda_launch.declare(ctypes.CDLL(path))


def test_a_library_without_its_record_is_rebuilt(tmp_path, caplog):
    path = _build(tmp_path)
    os.unlink(path + ".sha256")
    with caplog.at_level(logging.WARNING, logger="lora_core"):
        cuda_launch.build_library(False, str(tmp_path))
    assert cuda_launch.verify_cached(path) == ""
    assert any("no checksum record" in r.getMessage() for r in caplog.records)


def test_a_library_the_loader_refuses_is_rebuilt_on_load(tmp_path, caplog):
    path = _build(tmp_path)
    with open(path, "r+b") as f:
        f.truncate(100)
    with open(path + ".sha256", "w") as f:                   # a record that matches the damaged file
        f.write(cuda_launch._fingerprint(path) + "\n")
    with caplog.at_level(logging.WARNING, logger="lora_core"):
        lib = cuda_launch.load_library(False, str(tmp_path))
    assert lib.jl_error_string(0) is not None
    assert cuda_launch.verify_cached(path) == "" and os.path.getsize(path) > 100
    assert any("cannot be loaded" in r.getMessage() for r in caplog.records)


def test_a_failed_build_leaves_no_temporary_file(tmp_path, monkeypatch):
    out = tmp_path / "cache"
    out.mkdir()
    monkeypatch.setenv("CC", _fake_compiler(tmp_path, 'echo partial > "$out"; echo "cc: error" >&2; exit 1'))
    with pytest.raises(RuntimeError, match="building the C launcher failed"):
        cuda_launch.build_library(False, str(out))
    assert os.listdir(out) == []


def test_an_output_the_loader_refuses_is_never_cached(tmp_path, monkeypatch):
    out = tmp_path / "cache"
    out.mkdir()
    monkeypatch.setenv("CC", _fake_compiler(tmp_path, 'echo "not a shared object" > "$out"'))
    with pytest.raises(RuntimeError, match="cannot be loaded"):
        cuda_launch.build_library(False, str(out))
    assert os.listdir(out) == []


def test_an_interrupted_build_leaves_no_temporary_file(tmp_path, monkeypatch):
    """Ctrl-C while the compiler runs (KeyboardInterrupt raised from the wait, after the compiler
    wrote part of its output): the interrupt propagates and the cache directory holds nothing.
    The interrupt is raised from the wait itself rather than sent as a signal, whose delivery to a
    busy test worker is not timed."""
    out = tmp_path / "cache"
    out.mkdir()
    monkeypatch.setenv("CC", _fake_compiler(tmp_path, 'exit 0'))

    def interrupted_run(cmd, **kwargs):
        target = next(a for a in cmd if a.endswith(".so.tmp"))
        with open(target, "w") as f:
            f.write("partial")
        raise KeyboardInterrupt

    monkeypatch.setattr(cuda_launch.subprocess, "run", interrupted_run)
    with pytest.raises(KeyboardInterrupt):
        cuda_launch.build_library(False, str(out))
    assert os.listdir(out) == []
