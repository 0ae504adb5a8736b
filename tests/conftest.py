"""Test configuration shared by every test file.

TRITON_INTERPRET=1 must be set before any `@triton.jit` decorator runs, so it is set here, before
the packages are imported, unless CUDA is present (then the compiled kernels are tested).
"""

import os

import pytest


def _cuda_present() -> bool:
    if os.environ.get("JAX_LORA_TEST_CUDA") == "0":
        return False
    return os.path.exists("/dev/nvidiactl") or bool(os.environ.get("CUDA_VISIBLE_DEVICES"))


if not _cuda_present():
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
# Eight CPU devices: device-mismatch errors use two of them (SPEC section 6), the tensor-parallel
# tests meshes of 2, 4 and 8 (tests/test_parallel.py). Code that does not shard runs on device 0.
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                               " --xla_force_host_platform_device_count=8").strip()


def pytest_configure(config):
    # Float32 results are compared with float64 oracles and with torch/PEFT at float32 tolerances:
    # JAX's default float32 matmul precision on NVIDIA GPUs is TF32 (10-bit mantissa), so ask for
    # full float32 (the CPU computes that anyway).
    try:
        import jax
        jax.config.update("jax_default_matmul_precision", "highest")
    except ImportError:  # pragma: no cover - the torch-only install
        pass
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU (run on the device machine)")
    config.addinivalue_line("markers", "slow: longer CPU test, still part of CI")


def pytest_collection_modifyitems(config, items):
    try:
        import torch
        has_cuda = torch.cuda.is_available()
    except ImportError:  # pragma: no cover
        has_cuda = False
    if has_cuda:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
