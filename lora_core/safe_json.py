"""JSON from files this package does not trust, with the nesting depth bounded before parsing.

Python's `json` parser recurses once per nested `[` or `{`: 200k nested brackets end in a bare
RecursionError that names no file (or, near the C stack's limit, worse). Every JSON file read
here (adapter_config.json, safetensors headers, launch tables) goes through `loads` / `load`:

1. The text's nesting depth is measured without recursion: string literals are removed (a
   bracket inside a string does not nest), then the remaining brackets are counted, +1 for `[`
   and `{`, -1 for `]` and `}`, in chunks with NumPy (linear time, bounded memory).
2. A depth above `max_depth` (default MAX_DEPTH, far above any real file: an adapter config
   nests 3 levels, a safetensors header 3) raises `error` (ValueError by default) naming the file.
3. Otherwise the text is parsed by `json.loads` with the caller's hooks; its JSONDecodeError (a
   ValueError) is left to the caller, which knows what the file should hold.
"""

from __future__ import annotations

import json
import re
from typing import IO, Any

import numpy as np

__all__ = ["MAX_DEPTH", "json_depth", "load", "loads"]

MAX_DEPTH = 64

# A JSON string literal: quote, runs of plain characters or escapes, quote (linear: no ambiguity).
_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"', re.S)
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")
_CHUNK = 1 << 20


def json_depth(text: str | bytes, stop_above: int | None = None) -> int:
    """The deepest bracket nesting of JSON `text` (0 for a scalar), counted without recursion;
    brackets inside string literals are not counted. Stops early once it exceeds `stop_above`."""
    if isinstance(text, (bytes, bytearray)):
        text = bytes(text).decode("utf-8", "replace")
    brackets = _STRING.sub("", text).encode("utf-8", "replace").translate(None, _NOT_BRACKETS)
    depth = peak = 0
    for start in range(0, len(brackets), _CHUNK):
        chunk = np.frombuffer(brackets, np.uint8, count=min(_CHUNK, len(brackets) - start), offset=start)
        steps = np.where((chunk == ord("[")) | (chunk == ord("{")), 1, -1).astype(np.int32)
        levels = np.cumsum(steps, dtype=np.int64) + depth
        peak = max(peak, int(levels.max()))
        depth = int(levels[-1])
        if stop_above is not None and peak > stop_above:
            break
    return peak


def loads(text: str | bytes, where: str, *, error: type[Exception] = ValueError, max_depth: int = MAX_DEPTH,
          **hooks: Any) -> Any:
    """json.loads(text, **hooks) once the nesting depth is known to be <= max_depth.

    where: the file, named in the error. error: the exception class raised for a too-deep text or a
    number Python will not convert (an integer of thousands of digits), a ValueError subclass such
    as lora_core.peft.AdapterError. UnicodeDecodeError and json.JSONDecodeError come from
    json.loads as usual; exceptions the hooks raise pass through.
    """
    depth = json_depth(text, stop_above=max_depth)
    if depth > max_depth:
        raise error(f"{where}: JSON nested more than {max_depth} levels deep (brackets [ {{ inside each other); "
                    "refused before parsing (corrupt or hostile file)")
    try:
        return json.loads(text, **hooks)
    except RecursionError:             # unreachable below max_depth; kept so no bare RecursionError escapes
        raise error(f"{where}: JSON nested too deeply to parse") from None
    except ValueError as e:
        if isinstance(e, (json.JSONDecodeError, error)):
            raise
        # Python refuses to convert integers of more than sys.get_int_max_str_digits() digits.
        raise error(f"{where}: a JSON value cannot be read ({e})") from None


def load(f: IO, where: str, **kwargs: Any) -> Any:
    """`loads` of a file object's whole content."""
    return loads(f.read(), where, **kwargs)
