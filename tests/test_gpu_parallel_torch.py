"""torch_lora.parallel on GPUs (marked `gpu`): two processes, one GPU each, NCCL (one process on a
machine with one GPU: the layers are then unsharded, but the NCCL collectives, the kernels and the
capture still run). The same equality as tests/test_parallel_torch.py with the Triton kernels, a
CUDA graph capture of each layer's forward pass (collectives inside the graph) replayed after a new
mapping, no host synchronisation in the eager pass, and the slot loader's device memory."""

from __future__ import annotations

import pytest

from . import parallel_cases as cases
from .distributed import ProcessPool, cuda_devices

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(cuda_devices() < 1, reason="needs a CUDA GPU"),
              pytest.mark.skipif(not __import__("torch").distributed.is_nccl_available(), reason="needs NCCL")]

# float32 runs the kernels in IEEE fp32; the tolerance is contract section 4's for GPUs
TOL = {"float32": 1e-3, "bfloat16": 2e-2}


@pytest.fixture(scope="module")
def nccl_pool():
    pool = ProcessPool(min(2, cuda_devices()), "nccl", timeout=120)
    yield pool
    pool.close()


def _check(results, dtype):
    for rank, r in enumerate(results):
        assert r["err_oracle"] < TOL[dtype], (rank, r["err_oracle"])
        assert r["err_ref"] < TOL[dtype], (rank, r["err_ref"])
        assert r["untouched"], f"rank {rank}: rows without LoRA changed"
        assert r["lora_calls"] == r["formula"], (rank, r["lora_calls"], r["formula"])


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("fully_sharded", [False, True], ids=["replicated", "fully_sharded"])
@pytest.mark.parametrize("kind", cases.LINEAR_KINDS)
def test_linear_layers_on_gpus(nccl_pool, kind, fully_sharded, dtype):
    _check(nccl_pool.run(cases.case_linear, kind=kind, fully_sharded=fully_sharded, dtype=dtype, device="cuda"),
           dtype)


@pytest.mark.parametrize("fully_sharded", [False, True], ids=["replicated", "fully_sharded"])
@pytest.mark.parametrize("kind", ["embedding", "lm_head"])
def test_vocab_layers_on_gpus(nccl_pool, kind, fully_sharded):
    _check(nccl_pool.run(cases.case_vocab, kind=kind, fully_sharded=fully_sharded, dtype="bfloat16",
                         device="cuda"), "bfloat16")


@pytest.mark.parametrize("fully_sharded", [False, True], ids=["replicated", "fully_sharded"])
@pytest.mark.parametrize("kind", ["column", "qkv", "row", "embedding", "lm_head"])
def test_cuda_graph_capture(nccl_pool, kind, fully_sharded):
    for rank, r in enumerate(nccl_pool.run(cases.case_cuda_graph, kind=kind, fully_sharded=fully_sharded)):
        assert r["max_diff"] == 0.0, (rank, r)
        assert r["lora_rows_changed"] and r["no_lora_untouched"], (rank, r)


def test_slot_loading_uploads_only_the_shard(nccl_pool):
    if nccl_pool.world < 2:
        pytest.skip("needs 2 GPUs (with one, the shard is the whole B)")
    for rank, r in enumerate(nccl_pool.run(cases.case_cuda_upload)):
        assert r["equal"], rank
        assert r["after"] == 0, (rank, r)              # the slots were allocated at construction
        assert r["peak"] < r["full_bytes"], (rank, r)    # at most the cut, converted on its way
