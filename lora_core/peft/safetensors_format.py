"""The safetensors format parsed with NumPy alone, every size checked before any tensor data is read."""

from __future__ import annotations

import json
import math
import os
from typing import NamedTuple

import numpy as np

from .. import safe_json
from .config import (
    MAX_DIM,
    MAX_HEADER_BYTES,
    MAX_TENSOR_BYTES,
    AdapterError,
    _is_int,
    _short,
    refuse_json_constants,
    unique_json_keys,
)

# ----------------------------------------------------------------------------- safetensors

# safetensors dtype -> (item size in bytes, NumPy dtype read, or None for dtypes never read).
_DTYPES = {
    "BOOL": (1, None), "U8": (1, None), "I8": (1, None), "F8_E5M2": (1, None), "F8_E4M3": (1, "u1"),
    "F8_E8M0": (1, None), "I16": (2, None), "U16": (2, None), "I32": (4, None), "U32": (4, None),
    "I64": (8, None), "U64": (8, None),
    "F16": (2, "<f2"), "BF16": (2, "<u2"), "F32": (4, "<f4"), "F64": (8, "<f8"),
}


class TensorInfo(NamedTuple):
    """A tensor as a safetensors header declares it; `begin` / `end` are absolute file offsets."""

    name: str
    dtype: str
    shape: tuple
    begin: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


def read_safetensors_header(path: str, *, max_header_bytes: int = MAX_HEADER_BYTES) -> dict[str, TensorInfo]:
    """{name: TensorInfo} of a safetensors file, every entry checked; no tensor data is read.

    The file is an 8-byte little-endian header length n, n bytes of JSON {name: {"dtype", "shape",
    "data_offsets": [begin, end]}} (plus an optional "__metadata__" {str: str}), then the data. Checks:
    n <= max_header_bytes and within the file; each dtype known; each shape a list of ints >= 0;
    end - begin == prod(shape) * item size; the tensors tile the data section exactly (no gap,
    overlap or trailing bytes, as the safetensors library requires).
    """
    size = os.path.getsize(path)
    if size < 8:
        raise AdapterError(f"{path}: expected a safetensors file (an 8-byte header length, a JSON header, the data), "
                           f"got {size} bytes")
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        if n > max_header_bytes:
            raise AdapterError(f"{path}: header length field says {n} bytes, more than the limit of {max_header_bytes} "
                               "(corrupt or not a safetensors file)")
        if n > size - 8:
            raise AdapterError(f"{path}: header length field says {n} bytes, but only {size - 8} bytes follow "
                               "(truncated or not a safetensors file)")
        text = f.read(n)
    try:
        header = safe_json.loads(text.decode("utf-8"), path, error=AdapterError,
                                 object_pairs_hook=unique_json_keys(path, "header key"),
                                 parse_constant=refuse_json_constants(path))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise AdapterError(f"{path}: expected a JSON object as the safetensors header, got undecodable or malformed "
                           f"bytes ({e}); truncated or not a safetensors file") from None
    if not isinstance(header, dict):
        raise AdapterError(f"{path}: expected a JSON object as the safetensors header, got {type(header).__name__}")
    metadata = header.pop("__metadata__", None)
    if metadata is not None and not (isinstance(metadata, dict)
                                     and all(isinstance(v, str) for v in metadata.values())):
        raise AdapterError(f"{path}: header '__metadata__' must be an object of strings, got {_short(metadata)}")
    start = 8 + n
    data_bytes = size - start
    tensors = {}
    for name, entry in header.items():
        if not isinstance(entry, dict) or set(entry) != {"dtype", "shape", "data_offsets"}:
            raise AdapterError(f"{path}: tensor {name!r}: expected {{'dtype', 'shape', 'data_offsets'}}, "
                               f"got {_short(entry)}")
        dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
        if dtype not in _DTYPES:
            raise AdapterError(f"{path}: tensor {name!r}: dtype {dtype!r} is not a safetensors dtype this loader "
                               f"knows ({', '.join(_DTYPES)})")
        if not isinstance(shape, list) or not all(_is_int(d) and d >= 0 for d in shape):
            raise AdapterError(f"{path}: tensor {name!r}: shape must be a list of ints >= 0, got {_short(shape)}")
        huge = next((d for d in shape if d > MAX_DIM), None)
        if huge is not None:
            raise AdapterError(f"{path}: tensor {name!r}: shape dimension {_short(huge)} is more than {MAX_DIM} "
                               "(the largest dimension an int32 index reaches)")
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(_is_int(o) for o in offsets)
                and 0 <= offsets[0] <= offsets[1]):
            raise AdapterError(f"{path}: tensor {name!r}: data_offsets must be [begin, end] with 0 <= begin <= end, "
                               f"got {_short(offsets)}")
        declared = math.prod(shape) * _DTYPES[dtype][0]
        if offsets[1] - offsets[0] != declared:
            raise AdapterError(f"{path}: tensor {name!r}: {dtype} {tuple(shape)} needs {declared} bytes, but "
                               f"data_offsets {offsets} span {offsets[1] - offsets[0]}")
        if offsets[1] > data_bytes:
            raise AdapterError(f"{path}: tensor {name!r}: data_offsets {offsets} end past the {data_bytes} data bytes "
                               "of the file (truncated?)")
        tensors[name] = TensorInfo(name, dtype, tuple(shape), start + offsets[0], start + offsets[1])
    covered = start
    for info in sorted(tensors.values(), key=lambda t: (t.begin, t.end)):
        if info.begin != covered:
            what = ("overlaps the tensor before it" if info.begin < covered
                    else f"leaves a gap of {info.begin - covered} bytes")
            raise AdapterError(f"{path}: tensor {info.name!r}: data_offsets [{info.begin - start}, {info.end - start}] "
                               f"{what} (the tensors must tile the data section)")
        covered = info.end
    if covered != size:
        raise AdapterError(f"{path}: {size - covered} bytes after the last tensor; the header declares "
                           f"{covered - start} data bytes, the file has {data_bytes}")
    return tensors


def _e4m3_values() -> np.ndarray:
    """(256,) float32: the value of every float8_e4m3fn bit pattern (sign, 4 exponent bits with bias
    7, 3 mantissa bits; exponent 0 subnormal; S.1111.111 NaN, no infinities)."""
    bits = np.arange(256)
    sign = np.where(bits & 0x80, -1.0, 1.0)
    exp, mant = (bits >> 3) & 0xF, bits & 0x7
    mag = np.where(exp == 0, mant / 8.0 * 2.0 ** -6, (1 + mant / 8.0) * 2.0 ** (exp - 7.0))
    values = sign * mag
    values[(exp == 15) & (mant == 7)] = np.nan
    return values.astype(np.float32)


E4M3_VALUES = _e4m3_values()


def read_safetensors(path: str, names=None, *, max_header_bytes: int = MAX_HEADER_BYTES,
                     max_tensor_bytes: int = MAX_TENSOR_BYTES) -> dict[str, np.ndarray]:
    """{name: array} for `names` (all tensors when None) of a safetensors file, after
    `read_safetensors_header`'s checks. F16 / F32 / F64 keep their dtype; BF16 and F8_E4M3 (fp8
    adapter weights, contract section 11) are widened to float32 (exactly); other dtypes are
    refused. Each tensor must hold at most max_tensor_bytes."""
    header = read_safetensors_header(path, max_header_bytes=max_header_bytes)
    names = list(header) if names is None else list(names)
    for name in names:
        if name not in header:
            raise AdapterError(f"{path}: tensor {name!r} is missing")
        info = header[name]
        if _DTYPES[info.dtype][1] is None:
            raise AdapterError(f"{path}: tensor {name!r}: expected a float dtype (F16, BF16, F32, F64, F8_E4M3), "
                               f"got {info.dtype}")
        if info.nbytes > max_tensor_bytes:
            raise AdapterError(f"{path}: tensor {name!r}: {info.dtype} {info.shape} is {info.nbytes} bytes, more than "
                               f"the limit of {max_tensor_bytes} bytes per tensor")
    out = {}
    with open(path, "rb") as f:
        for name in names:
            info = header[name]
            f.seek(info.begin)
            data = bytearray(info.nbytes)
            got = f.readinto(data)
            if got != info.nbytes:
                raise AdapterError(f"{path}: tensor {name!r}: read {got} of {info.nbytes} bytes (file changed "
                                   "while reading?)")
            array = np.frombuffer(data, _DTYPES[info.dtype][1]).reshape(info.shape)
            if info.dtype == "BF16":
                array = (array.astype(np.uint32) << 16).view(np.float32)
            elif info.dtype == "F8_E4M3":
                array = E4M3_VALUES[array]
            out[name] = array
    return out
