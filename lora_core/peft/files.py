"""Which files of an adapter directory are read: only those whose real path lies inside it."""

from __future__ import annotations

import json
import os

from .. import safe_json
from .config import (
    CONFIG_NAME,
    MAX_CONFIG_BYTES,
    AdapterConfig,
    AdapterError,
    parse_adapter_config,
    refuse_json_constants,
    unique_json_keys,
)

# ----------------------------------------------------------------------------- files

def _hub_repository(directory: str) -> str | None:
    """The repository folder of a Hugging Face hub cache snapshot holding `directory` (a real path),
    `<repository>/snapshots/<revision>[/...]`, whose files link into `<repository>/blobs/`; else None."""
    parts = directory.split(os.sep)
    for i in range(len(parts) - 2, 0, -1):
        if parts[i] == "snapshots":
            repository = os.sep.join(parts[:i]) or os.sep
            return repository if os.path.isdir(os.path.join(repository, "blobs")) else None
    return None


def resolve_adapter_file(directory: str, filename: str) -> str | None:
    """The real path of `directory/filename`, or None when there is no such file.

    Raises AdapterError when the file resolves (through symlinks) outside the directory's real path,
    or to something that is not a regular file. A Hugging Face hub cache snapshot
    (`.../snapshots/<revision>/`) may link into its repository's `blobs/`.
    """
    path = os.path.join(directory, filename)
    if not os.path.lexists(path):
        return None
    real_dir = os.path.realpath(directory)
    real = os.path.realpath(path)
    inside = os.path.commonpath([real_dir, real]) == real_dir
    if not inside:
        repository = _hub_repository(real_dir)
        blobs = os.path.join(repository, "blobs") if repository else None
        inside = blobs is not None and os.path.commonpath([blobs, real]) == blobs
    if not inside:
        raise AdapterError(f"{path}: resolves to {real}, outside the adapter directory {real_dir}; only files "
                           "inside the adapter directory are read")
    if not os.path.isfile(real):
        kind = ("a directory" if os.path.isdir(real) else "a special file" if os.path.exists(real)
                else "a broken link")
        raise AdapterError(f"{path}: expected a regular file, got {kind}"
                           + ("" if real == os.path.abspath(path) else f" ({real})"))
    return real


def read_adapter_config(directory: str | os.PathLike) -> tuple[AdapterConfig, dict]:
    """(parsed config, the decoded JSON object) of `directory/adapter_config.json`."""
    directory = os.fspath(directory)
    path = os.path.join(directory, CONFIG_NAME)
    real = resolve_adapter_file(directory, CONFIG_NAME)
    if real is None:
        raise AdapterError(f"{directory}: not a PEFT adapter directory: {CONFIG_NAME} is missing")
    size = os.path.getsize(real)
    if size > MAX_CONFIG_BYTES:
        raise AdapterError(f"{path}: {size} bytes, more than the {MAX_CONFIG_BYTES} bytes a config may have")
    with open(real, "rb") as f:
        data = f.read(MAX_CONFIG_BYTES + 1)
    try:
        raw = safe_json.loads(data.decode("utf-8"), path, error=AdapterError,
                              object_pairs_hook=unique_json_keys(path, "field"),
                              parse_constant=refuse_json_constants(path))
    except UnicodeDecodeError as e:
        raise AdapterError(f"{path}: expected UTF-8 JSON, got undecodable bytes at offset {e.start}") from None
    except json.JSONDecodeError as e:
        raise AdapterError(f"{path}: expected a JSON object, got malformed JSON ({e.msg} at line {e.lineno} "
                           f"column {e.colno})") from None
    return parse_adapter_config(raw, path), raw
