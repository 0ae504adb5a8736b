"""vLLM's LoRA Triton kernels, loaded beside ours for side-by-side GPU benchmarks.

The kernels are vLLM's own files (`vllm/lora/ops/triton_ops/` of the vLLM wheel), extracted by
`benchmarks/fetch_vllm_kernels.sh` into the git-ignored folder `.vllm/` at the repository root;
nothing of vLLM is committed here. Those files import a few helpers from the rest of vLLM (its
environment switches, logger, platform query, Triton re-export, tensor utilities); when vLLM
itself is not installed, `load()` registers small stand-ins for exactly those names, with vLLM's
defaults (no batch-invariant mode, programmatic dependent launch on sm_90+, no tuned-config
folder, no dual stream), so the kernels run as a default vLLM install runs them.

    vk = vllm_kernels.load()            # None when .vllm/ is absent
    meta = vk.LoRAKernelMeta.make(max_loras, max_tokens, "cuda")
    meta.prepare_tensors(token_slots)   # int32 (T,), -1 = no LoRA; outside graph capture
    add_lora_linear(vk, meta, y, x, a_slices, b_slices, scale)   # vLLM's PunicaWrapperGPU order

`add_lora_linear` is vLLM 0.33's `PunicaWrapperGPU.add_lora_linear` without bias: a float32
buffer (S, T, r), `lora_shrink` (which zeroes it) and `lora_expand` with `add_inputs=True`, the
metadata's launch shape padded to every slot (vLLM's default `specialize_active_lora=False`, the
setting that keeps one CUDA graph per batch size). vLLM needs contiguous weights per slice.
"""

from __future__ import annotations

import importlib
import logging
import os
import sys
import types

ROOT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), ".vllm")
OPS = ("vllm", "lora", "ops", "triton_ops")


def available(root: str = ROOT) -> bool:
    """Whether vLLM's kernel files are present under `root`."""
    return os.path.isfile(os.path.join(root, *OPS, "__init__.py"))


def _module(name: str, **attrs) -> types.ModuleType:
    mod = types.ModuleType(name)
    mod.__dict__.update(attrs)
    sys.modules[name] = mod
    return mod


def _install_stand_ins(root: str) -> None:
    """The names vLLM's LoRA kernel files import from the rest of vLLM."""
    import torch
    import triton
    import triton.language as tl

    log = logging.getLogger("vllm")
    log.warning_once = log.warning
    log.info_once = log.info
    log.debug_once = log.debug

    class Platform:
        @staticmethod
        def is_cuda() -> bool:
            return torch.cuda.is_available() and torch.version.hip is None

        is_cuda_alike = is_cuda

        @staticmethod
        def is_xpu() -> bool:
            return False

        @staticmethod
        def has_device_capability(cap: int, device_id: int = 0) -> bool:
            major, minor = torch.cuda.get_device_capability(device_id)
            return major * 10 + minor >= cap

        @staticmethod
        def is_device_capability(cap: int, device_id: int = 0) -> bool:
            major, minor = torch.cuda.get_device_capability(device_id)
            return major * 10 + minor == cap

        @staticmethod
        def num_compute_units(device_id: int = 0) -> int:
            return torch.cuda.get_device_properties(device_id).multi_processor_count

    def next_power_of_2(n: int) -> int:
        return 1 if n < 1 else 1 << (int(n) - 1).bit_length()

    def get_max_shared_memory_bytes(device_id: int = 0) -> int:
        props = torch.cuda.get_device_properties(device_id)
        return int(getattr(props, "shared_memory_per_block_optin", 0) or props.max_shared_memory_per_block_optin)

    def async_tensor_h2d(data, dtype, device, pin_memory: bool = True):
        return torch.tensor(data, dtype=dtype, pin_memory=pin_memory and torch.cuda.is_available(),
                            device="cpu").to(device, non_blocking=True)

    def direct_register_custom_op(*args, **kwargs):
        # vLLM's files fall back to the plain Python functions on AttributeError
        raise AttributeError("custom-op registration is left out of the benchmark's stand-ins")

    def not_distributed(*args, **kwargs):
        raise RuntimeError("vLLM's tensor-parallel collectives are not available in the benchmark")

    def set_triton_allocator(device) -> None:
        def alloc(size: int, alignment: int, stream):
            return torch.empty(size, device=device, dtype=torch.int8)
        triton.set_allocator(alloc)

    top = _module("vllm", __path__=[os.path.join(root, "vllm")])
    _module("vllm.lora", __path__=[os.path.join(root, "vllm", "lora")])
    _module("vllm.lora.ops", __path__=[os.path.join(root, "vllm", "lora", "ops")])
    top.envs = _module("vllm.envs", VLLM_BATCH_INVARIANT=False, VLLM_LORA_DISABLE_PDL=False,
                       VLLM_LORA_ENABLE_DUAL_STREAM=False, VLLM_TUNED_CONFIG_FOLDER=None)
    _module("vllm.logger", init_logger=lambda name: log)
    _module("vllm.platforms", current_platform=Platform())
    _module("vllm.triton_utils", __path__=[], tl=tl, triton=triton)
    _module("vllm.triton_utils.allocation", set_triton_allocator=set_triton_allocator)
    _module("vllm.utils", __path__=[])
    _module("vllm.utils.math_utils", next_power_of_2=next_power_of_2)
    _module("vllm.utils.mem_utils", get_max_shared_memory_bytes=get_max_shared_memory_bytes)
    _module("vllm.utils.torch_utils", async_tensor_h2d=async_tensor_h2d,
            direct_register_custom_op=direct_register_custom_op)
    _module("vllm.distributed", tensor_model_parallel_all_gather=not_distributed,
            tensor_model_parallel_all_reduce=not_distributed)


def load(root: str | None = None):
    """vLLM's `vllm.lora.ops.triton_ops` module, or None when its files are absent.

    `root` (default: the repository's `.vllm/`, or $VLLM_KERNELS_DIR) holds `vllm/lora/ops/triton_ops/`.
    An installed vLLM is used as it is."""
    root = root or os.environ.get("VLLM_KERNELS_DIR") or ROOT
    try:
        return importlib.import_module("vllm.lora.ops.triton_ops")
    except ImportError:
        for name in [m for m in sys.modules if m == "vllm" or m.startswith("vllm.")]:
            del sys.modules[name]
    if not available(root):
        return None
    _install_stand_ins(root)
    return importlib.import_module("vllm.lora.ops.triton_ops")


def add_lora_linear(vk, meta, y, x, lora_a, lora_b, scale: float) -> None:
    """y[t, slice s] += scale * (x[t] @ lora_a[s][slot_t].T) @ lora_b[s][slot_t].T, in place, through
    vLLM's kernels as vLLM 0.33's PunicaWrapperGPU.add_lora_linear runs them.

    x: (T, H); lora_a[s]: (L, r, H) contiguous; lora_b[s]: (L, n_s, r) contiguous; y: (T, sum n_s)."""
    import torch
    t, r = x.size(0), lora_b[0].size(-1)
    buffer = torch.empty((len(lora_b), t, r), dtype=torch.float32, device=x.device)
    vk.lora_shrink(x, list(lora_a), buffer, *meta.meta_args(t, False), scale)
    vk.lora_expand(buffer, list(lora_b), y, *meta.meta_args(t, False), offset_start=0, add_inputs=True)


# vLLM 0.33's fp8 LoRA kernels (lora_shrink_fp8_op.py / lora_expand_fp8_op.py) scale their weights
# only in their W8A8 mode (use_fp8_w8a8=True): e4m3 activations with per-token scales; their other
# mode takes 16-bit weights only (lora_expand_fp8 asserts it). The mode closest to weight-only e4m3
# weights with per-output-channel scales is therefore W8A8 with per_channel_quant=True.
FP8_MODE = ("vLLM lora_shrink_fp8 / lora_expand_fp8, use_fp8_w8a8=True, per_channel_quant=True: e4m3 weights "
            "with per-output-channel float32 scales, e4m3 activations (x, the shrink buffer) with per-token "
            "scales; the activations are quantised before the timed kernels and that step is not timed")


def quantize_per_token(t):
    """(t_q e4m3, scale (T, 1) float32) of t (T, K) or (S, T, K): one scale per token (over every
    slice), amax / 448, as vLLM's W8A8 path takes its activations."""
    import torch
    t32 = t.float()
    amax = t32.abs().amax(dim=-1)
    if t32.dim() == 3:
        amax = amax.amax(dim=0)
    scale = torch.where(amax > 0, amax / 448.0, torch.ones_like(amax))[:, None]
    full = scale if t32.dim() == 2 else scale[None]
    return (t32 / full).clamp(-448, 448).to(torch.float8_e4m3fn), scale.contiguous()


def lora_linear_fp8_calls(vk, meta, y, x_q, x_scale, a_q, a_scales, b_q, b_scales, scale: float, buffer, buf_q,
                          buf_scale):
    """(shrink, expand) callables of vLLM's fp8 kernels (FP8_MODE) for one add_lora_linear: the shrink
    of x_q into the float32 `buffer`, the expand of buf_q (the buffer quantised per token,
    `quantize_per_token`, prepared by the caller) into y with add_inputs. a_q / b_q: per slice
    contiguous (L, r, H) / (L, n, r) e4m3; a_scales / b_scales: per slice (L, r) / (L, n) float32."""
    t = x_q.size(0)

    def shrink():
        vk.lora_shrink_fp8(x_q, list(a_q), buffer, *meta.meta_args(t, False), scale, list(a_scales), x_scale,
                           0, 0, True, True)

    def expand():
        vk.lora_expand_fp8(buf_q, list(b_q), y, *meta.meta_args(t, False), list(b_scales), buf_scale,
                           offset_start=0, add_inputs=True, group_k=0, group_n=0, use_fp8_w8a8=True,
                           per_channel_quant=True)
    return shrink, expand
