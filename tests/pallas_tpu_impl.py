"""The conformance-suite entry for backend "pallas_tpu": TPU interpret mode with race detection.

Every kernel call made through the entry runs under `pltpu.InterpretParams(detect_races=True)` with
out-of-bounds reads raising and uninitialised memory reading as NaN (so an unwritten output row
shows up as NaN and fails the comparison). The race detector only prints and sets a flag, so
`races_checked` records every detector instance created during the call and raises if any found a
race. On a TPU backend the same tests run the kernels compiled (no interpreter, no race check).
"""

from __future__ import annotations

import contextlib

import jax
from jax._src.pallas.mosaic.interpret import interpret_pallas_call as _ipc
from jax.experimental.pallas import tpu as pltpu

from jax_lora.ops import pallas_tpu

RACE_PARAMS = pltpu.InterpretParams(detect_races=True, out_of_bounds_reads="raise",
                                    uninitialized_memory="nan")


@contextlib.contextmanager
def races_checked(params=None):
    """Runs the pallas_tpu kernels in the block under `params` (default: RACE_PARAMS, or compiled on
    a TPU backend); fails if a race was detected."""
    if params is None:
        params = False if jax.default_backend() == "tpu" else RACE_PARAMS
    seen = []
    original = _ipc.RaceDetectionState

    class Recording(original):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            seen.append(self)

    _ipc.RaceDetectionState = Recording
    try:
        with pallas_tpu.interpret_mode(params):
            yield seen
    except BaseException:
        pltpu.reset_tpu_interpret_mode_state()  # interpret mode keeps state after an error
        raise
    finally:
        _ipc.RaceDetectionState = original
    if params and params.detect_races and any(r.races_found for r in seen):
        raise AssertionError("TPU interpret mode detected a data race in a pallas_tpu kernel")


def make_impl(impl_cls):
    """An instance of a subclass of tests.impls.Impl whose kernel-running methods check races."""

    class PallasTPUImpl(impl_cls):
        def lora_shrink(self, *args, **kwargs):
            with races_checked():
                return super().lora_shrink(*args, **kwargs)

        def lora_expand(self, *args, **kwargs):
            with races_checked():
                return super().lora_expand(*args, **kwargs)

        def call_op(self, *args, **kwargs):
            with races_checked():
                return super().call_op(*args, **kwargs)

        def wrapper_call(self, *args, **kwargs):
            with races_checked():
                return super().wrapper_call(*args, **kwargs)

        def wrapper_value(self, *args, **kwargs):
            with races_checked():
                return super().wrapper_value(*args, **kwargs)

        def fused_moe_lora(self, *args, **kwargs):
            with races_checked():
                return super().fused_moe_lora(*args, **kwargs)

        def moe_w13_w2(self, *args, **kwargs):
            with races_checked():
                return super().moe_w13_w2(*args, **kwargs)

    return PallasTPUImpl("jax-pallas_tpu", "jax", "pallas_tpu", small=True, moe_lora=True, fp8_moe=True)
