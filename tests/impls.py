"""The implementations the conformance suite runs over, behind one NumPy-in/NumPy-out adapter.

Each entry of IMPLS wraps one side (JAX or torch) with one backend. A new backend (a kernel, a
bridge direction) joins the suite by appending ONE entry here; tests/test_conformance.py never
changes for it. Adapters convert NumPy inputs (already rounded to the test dtype) to native arrays,
call the public API exactly as a user would, and return float64 NumPy results.

Fields an entry may set:
  dtypes: the activation/weight dtypes it is tested with.
  small: True for interpreters (Triton interpreter, Pallas TPU interpret mode): the suite then
         uses its smallest shapes and skips the hypothesis sweep.
  torch_device: where the torch side's tensors live; None: CUDA when a GPU is present (the compiled
         Triton kernels), else the CPU (the Triton interpreter). JAX arrays go to JAX's default device.
  vllm_methods: the wrapper has vLLM's TPU wrapper's per-token `shrink` / `expand` / `expand_slice`
         (False for the bridged wrappers, which offer only the `add_*` methods).
  moe_lora: the side has the mixture-of-experts LoRA op and wrapper methods (contract section 9),
         run through `fused_moe_lora` and `moe_w13_w2` below.
  fp8: the side's ops and wrapper take fp8 (e4m3) weights with their scales (contract section 11;
         `fp8_weight` makes one, `lora_shrink` / `lora_expand` pass `scales`).
  fp8_moe: the side's `fused_moe_lora` takes fp8 expert weights with their scales (`fused_moe_lora`
         below with `a_scales` / `b_scales`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import ml_dtypes
import numpy as np

ALL_DTYPES = ("float32", "bfloat16", "float16")
NP_DTYPES = {"float32": np.float32, "float16": np.float16, "bfloat16": ml_dtypes.bfloat16}


def triton_runs() -> bool:
    """Whether Triton kernels can run in this process: compiled on a CUDA GPU, or in Triton's
    interpreter (conftest sets TRITON_INTERPRET=1 where no GPU is present)."""
    import os
    if os.environ.get("TRITON_INTERPRET") == "1":
        return True
    try:
        import torch
        return torch.cuda.is_available()
    except ImportError:  # pragma: no cover - the JAX-only install
        return False


def torch_triton_device() -> str:
    """Where torch tensors for the Triton backend live: CUDA (compiled kernels) when a GPU is present,
    else the CPU (the interpreter)."""
    import torch
    return "cuda" if torch.cuda.is_available() else "cpu"


def round_to(a: np.ndarray, dtype: str) -> np.ndarray:
    """float32 values exactly representable in `dtype` (what the implementation will see)."""
    return np.asarray(a, np.float32).astype(NP_DTYPES[dtype]).astype(np.float32)


@dataclasses.dataclass
class Impl:
    name: str
    side: str                      # "jax" or "torch"
    backend: str | None         # forced backend, or None for the device default
    dtypes: tuple = ALL_DTYPES
    small: bool = False
    wrapper_factory: Callable[..., Any] | None = None  # (T, B, L, backend) -> wrapper
    ops_module: Any | None = None                      # defaults to the side's ops
    marks: tuple = ()
    torch_device: str | None = None
    vllm_methods: bool = True
    moe_lora: bool = False
    fp8: bool = False
    fp8_moe: bool = False

    def __str__(self):
        return self.name

    # -------------------------------------------------------------- arrays
    def arr(self, a, dtype=None):
        a = np.asarray(a)
        if self.side == "jax":
            import jax.numpy as jnp
            if dtype is None:
                return jnp.asarray(a)
            return jnp.asarray(a.astype(np.float32)).astype(getattr(jnp, dtype))
        import torch
        if dtype is None:
            return torch.from_numpy(np.ascontiguousarray(a)).to(self.device)
        return torch.from_numpy(np.ascontiguousarray(a.astype(np.float32))).to(self.device, getattr(torch, dtype))

    @property
    def device(self) -> str:
        """The torch side's device (see `torch_device`)."""
        if self.torch_device is not None:
            return self.torch_device
        import torch
        return "cuda" if torch.cuda.is_available() else "cpu"

    def fp8_weight(self, q):
        """A native float8_e4m3fn array from ml_dtypes float8_e4m3fn values (bit for bit)."""
        q = np.ascontiguousarray(q)
        if self.side == "jax":
            import jax.numpy as jnp
            return jnp.asarray(q)
        import torch
        return torch.from_numpy(q.view(np.uint8)).view(torch.float8_e4m3fn).to(self.device)

    def idx(self, a):
        return self.arr(np.asarray(a, np.int32))

    def to_np(self, a):
        if self.side == "torch":
            return a.detach().to("cpu").double().numpy()
        return np.asarray(a).astype(np.float64)

    # -------------------------------------------------------------- namespaces
    @property
    def pkg(self):
        if self.side == "jax":
            import jax_lora
            return jax_lora
        import torch_lora
        return torch_lora

    @property
    def ops(self):
        return self.ops_module if self.ops_module is not None else self.pkg.ops

    def wrapper(self, max_num_batched_tokens, max_batches, max_loras):
        if self.wrapper_factory is not None:
            return self.wrapper_factory(max_num_batched_tokens, max_batches, max_loras, self.backend)
        device = None if self.side == "jax" else self.device
        return self.pkg.PunicaWrapper(max_num_batched_tokens, max_batches, device, max_loras=max_loras,
                                      backend=self.backend)

    @property
    def mutates(self) -> bool:
        """torch updates y in place (vLLM GPU semantics); JAX returns a new array."""
        return self.side == "torch"

    @property
    def pads_prompt_mapping(self) -> bool:
        """The JAX wrapper pads the prompt mapping to a power-of-two bucket (TPU seed)."""
        return self.side == "jax"

    # -------------------------------------------------------------- ops through the public API
    def meta(self, idx, max_loras, capacity=None):
        idx = np.asarray(idx, np.int32)
        if self.side == "jax":
            return self.pkg.LoRAKernelMeta.build(idx, max_loras, capacity or len(idx))
        meta = self.pkg.LoRAKernelMeta.make(max_loras, capacity or max(len(idx), 1), self.device)
        meta.prepare_tensors(self.idx(idx))
        return meta

    def lora_shrink(self, x, lora_a, idx, scale, max_loras, lora_ranks=None, scales=None):
        meta = self.meta(idx, max_loras, capacity=len(idx) + 3)
        kw = dict(backend=self.backend, lora_ranks=lora_ranks)
        if scales is not None:
            kw["lora_a_scale"] = scales
        if self.side == "jax":
            return self.to_np(self.ops.lora_shrink(x, lora_a, meta, scale, **kw))
        import torch
        rank = lora_a[0].shape[-2]
        out = torch.full((len(lora_a), x.shape[0], rank), float("nan"), dtype=torch.float32, device=self.device)
        res = self.ops.lora_shrink(x, lora_a, out, *meta.meta_args(x.shape[0]), scale, **kw)
        assert res is out
        return self.to_np(out)

    def lora_expand(self, buf, lora_b, y, idx, offset_start, add_inputs, max_loras, lora_ranks=None, scales=None):
        meta = self.meta(idx, max_loras, capacity=len(idx) + 3)
        kw = dict(backend=self.backend, lora_ranks=lora_ranks)
        if scales is not None:
            kw["lora_b_scale"] = scales
        if self.side == "jax":
            return self.to_np(self.ops.lora_expand(buf, lora_b, y, meta, offset_start, add_inputs, **kw))
        res = self.ops.lora_expand(buf, lora_b, y, *meta.meta_args(y.shape[0]), offset_start=offset_start,
                                   add_inputs=add_inputs, **kw)
        assert res is y
        return self.to_np(y)

    def call_op(self, name, *args, **kwargs):
        """A BGMV/SGMV op; returns its result as NumPy (for torch expand: y, updated in place)."""
        res = getattr(self.ops, name)(*args, backend=self.backend, **kwargs)
        if self.side == "torch" and "expand" in name:
            assert res is args[2], f"{name} must update y in place and return it"
        return self.to_np(res)

    def wrapper_value(self, w, method, *args, **kwargs):
        """Calls a wrapper method that returns a new array (no y argument); returns it as NumPy."""
        return self.to_np(getattr(w, method)(*args, **kwargs))

    def wrapper_call(self, w, method, y, *args, **kwargs):
        """Calls a wrapper `add_*` method; checks the calling convention; returns NumPy y."""
        res = getattr(w, method)(y, *args, **kwargs)
        if self.mutates:
            assert res is y, f"torch {method} must return the y it updated in place"
        return self.to_np(res)


    # -------------------------------------------------------------- mixture-of-experts LoRA
    def fused_moe_lora(self, y, x, lora_a, lora_b, topk_ids, topk_weights, token_lora, adapter_enabled,
                       mul_routed_weight, offset, naive, block_size, dtype, deterministic=False, a_scales=None,
                       b_scales=None):
        """The MoE LoRA op on one order (naive: topk_ids flattened; else the op's own alignment);
        returns y as NumPy. a_scales / b_scales: per slice float32 scales of fp8 A / B (then the
        weights are ml_dtypes e4m3 values, passed bit for bit)."""
        ops = self.ops
        ids = self.idx(topk_ids)
        mapping, enabled = self.idx(token_lora), self.idx(adapter_enabled)
        if naive:
            sorted_ids, expert_ids, post_pad = None, ids.reshape(-1), None
        else:
            sorted_ids, expert_ids, post_pad = ops.moe_lora_align_block_size(
                ids, mapping, lora_a[0].shape[1], block_size, lora_a[0].shape[0], enabled)
        out = self.arr(y, dtype)
        fp8 = {}
        if a_scales is not None:
            fp8["lora_a_scale"] = [self.arr(s) for s in a_scales]
        if b_scales is not None:
            fp8["lora_b_scale"] = [self.arr(s) for s in b_scales]
        res = ops.fused_moe_lora(out, self.arr(x, dtype),
                                 [self.fp8_weight(a) if a_scales is not None else self.arr(a, dtype) for a in lora_a],
                                 [self.fp8_weight(b) if b_scales is not None else self.arr(b, dtype) for b in lora_b],
                                 self.arr(topk_weights, "float32"), sorted_ids, expert_ids, post_pad, mapping,
                                 lora_a[0].shape[2], topk_ids.shape[1], enabled, mul_routed_weight, offset,
                                 block_size=None if naive else block_size, backend=self.backend,
                                 deterministic=deterministic, **fp8)
        if self.side == "torch":
            assert res is out
            return self.to_np(out)
        return self.to_np(res)

    def moe_w13_w2(self, w, y13, x, gu_a, gu_b, y2, h, dn_a, dn_b, topk_ids, topk_weights, adapter_enabled,
                   num_experts, dtype):
        """The wrapper's add_lora_w13 then add_lora_w2 on its current metadata; returns (y13, y2,
        whether add_lora_w13 chose the naive pair order)."""
        num_tokens, top_k = topk_ids.shape
        max_loras = gu_a[0].shape[0]
        out13, out2 = self.arr(y13, dtype), self.arr(y2, dtype)
        if self.side == "torch":
            import torch
            w1 = torch.empty((num_experts, 1, 1))
        else:
            w1 = None
        res13 = w.add_lora_w13(
            out13, self.arr(x, dtype), tuple(self.arr(a, dtype) for a in gu_a), tuple(self.arr(b, dtype) for b in gu_b),
            self.idx(topk_ids), self.arr(topk_weights, "float32"), None, w1, w1, num_tokens, top_k, max_loras,
            self.idx(adapter_enabled), num_experts, top_k, len(gu_a), False, False)
        if self.side == "jax":          # functional: the new y comes first
            out13, *res13 = res13
        sorted_ids, expert_ids, post_pad, mapping = res13
        res = w.add_lora_w2(out2, self.arr(h, dtype), (self.arr(dn_a[0], dtype),), (self.arr(dn_b[0], dtype),),
                            self.arr(topk_weights, "float32"), sorted_ids, expert_ids, post_pad, mapping, num_tokens,
                            w1, w1, top_k, max_loras, self.idx(adapter_enabled), top_k, False, 0, False)
        if self.side == "torch":
            assert res is out2
        else:
            out2 = res
        return self.to_np(out13), self.to_np(out2), sorted_ids is None

def _jax_impls():
    from .pallas_tpu_impl import make_impl as pallas_tpu_impl  # TPU interpret mode, races checked
    return [Impl("jax-xla", "jax", "xla", moe_lora=True, fp8_moe=True), pallas_tpu_impl(Impl),
            Impl("jax-triton", "jax", "triton", small=True, moe_lora=True, fp8_moe=True)]  # Triton interpreter


def _torch_impls():
    return [Impl("torch-ref", "torch", "torch", moe_lora=True, fp8=True, fp8_moe=True),
            Impl("torch-triton", "torch", "triton", small=True, moe_lora=True, fp8=True,
                 fp8_moe=True)]  # Triton interpreter on CPU


def _bridge_impls():
    from . import bridge_impl  # each side's API over the other side's kernels (bridge/)
    impls = [bridge_impl.torch_over_jax(Impl), bridge_impl.jax_over_torch(Impl)]
    for impl in impls:
        impl.vllm_methods = False
        impl.fp8 = True              # the scales travel zero-copy beside the weights
    return impls


IMPLS: list = _jax_impls() + _torch_impls() + _bridge_impls()
