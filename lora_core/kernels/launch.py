"""Launching a `KernelCall` through Triton's own launcher, and NumPy arrays for its interpreter.

`triton_launch` is what torch's generic path and the interpreter use (the fused kernel runs as two
launches under the interpreter, whose programs run one after another: `FusedPlan.phases`).
`HostArray` presents a NumPy array the way Triton's interpreter expects a tensor argument
(`data_ptr`, `dtype`, a storage it copies to and from the host), so the interpreter runs the
kernels on NumPy memory without any framework: JAX's CPU path (`jax.pure_callback`) uses it.
"""

from __future__ import annotations

import dataclasses
import os

import numpy as np

from .arguments import KernelCall


def triton_launch(call: KernelCall, **options):
    """`call.kernel[grid](*call.args, num_warps=..., num_stages=..., **options, **constexprs)`,
    once per phase of the plan; returns Triton's compiled kernel of the last launch."""
    plan = call.plan
    if os.environ.get("TRITON_CACHE_DIR") == "":
        # jax_triton sets it to "" when imported; Triton then cannot compile ("Could not create or
        # locate cache dir")
        os.environ.pop("TRITON_CACHE_DIR")
    compiled = None
    for phase in getattr(plan, "phases", (None,)):
        constexprs = plan.constexprs if phase is None else {**plan.constexprs, "PHASE": phase}
        compiled = call.kernel[plan.grid](*call.args, num_warps=plan.num_warps, num_stages=plan.num_stages,
                                          **options, **constexprs)
    return compiled


class _HostStorage:
    """The storage of a HostArray: host memory already, so copies to and from it are no-ops."""

    def __init__(self, array: np.ndarray):
        self._array = array

    def data_ptr(self) -> int:
        return self._array.ctypes.data

    def cpu(self) -> _HostStorage:
        return self

    def copy_(self, other) -> None:
        if other.data_ptr() != self.data_ptr():
            raise RuntimeError("a HostArray storage is only ever copied onto itself")


class HostArray:
    """A NumPy array (any dtype Triton knows, ml_dtypes' bfloat16 included) as a Triton interpreter
    argument. Strides are in elements; the array must stay alive while the kernel runs."""

    def __init__(self, array: np.ndarray, *, offset: int = 0, shape=None, strides=None):
        self._array = array
        self._offset = offset
        self.shape = tuple(array.shape if shape is None else shape)
        self._strides = tuple(s // array.itemsize for s in array.strides) if strides is None else tuple(strides)
        self.dtype = _DtypeName(array.dtype.name)

    @classmethod
    def wrap(cls, array: np.ndarray) -> HostArray:
        return cls(array)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def stride(self) -> tuple:
        return self._strides

    def size(self) -> tuple:
        return self.shape

    def data_ptr(self) -> int:
        return self._array.ctypes.data + self._offset * self._array.itemsize

    def storage_offset(self) -> int:
        return self._offset

    def untyped_storage(self) -> _HostStorage:
        return _HostStorage(self._array)

    def new_empty(self, *_args, **_kwargs) -> HostArray:
        return HostArray(self._array)

    def set_(self, _storage, offset, size, stride) -> HostArray:
        self._offset, self.shape, self._strides = offset, tuple(size), tuple(stride)
        return self

    def reshape(self, *shape):
        return HostArray(self._array.reshape(*shape))


@dataclasses.dataclass(frozen=True)
class _DtypeName:
    """What Triton reads of a tensor's dtype: its name ("float32", "bfloat16", "int32", ...)."""
    name: str

    def __str__(self) -> str:
        return self.name


def host_strides(array) -> tuple:
    """`Strides` of HostArrays (elements)."""
    return array.stride()
