"""Conformance-suite entries for the two bridged directions (bridge/).

  torch-over-jax: torch tensors in and out (torch_lora's API, y updated in place) computed by
                  jax_lora's kernels through `bridge.TorchPunicaWrapper` and `bridge.torch_over_jax`.
  jax-over-torch: JAX arrays in, new JAX arrays out (jax_lora's API) computed by torch_lora's
                  kernels through `bridge.JaxPunicaWrapper` and `bridge.jax_over_torch`.

Both run strictly zero-copy (copy=False): every activation, weight and fp8 weight scale the suite
passes is shared, never copied. The only adaptation: torch inputs of the torch-over-jax entry are allocated by torch
(64-byte aligned), because `torch.from_numpy` memory usually sits at 16 mod 64 and JAX's CPU runtime
cannot wrap it (the bridge refuses it with CopyRequiredError unless copy=True; tests/test_bridge.py
checks that refusal).
"""

from __future__ import annotations


def torch_over_jax(impl_cls):
    import bridge

    class TorchOverJaxImpl(impl_cls):
        def arr(self, a, dtype=None):
            return super().arr(a, dtype).clone()  # torch's allocator: 64-byte aligned

        def fp8_weight(self, q):
            return super().fp8_weight(q).clone()

    return TorchOverJaxImpl(
        "torch-over-jax", "torch", "xla", ops_module=bridge.torch_over_jax, torch_device="cpu",
        wrapper_factory=lambda T, B, L, backend: bridge.TorchPunicaWrapper(T, B, "cpu", max_loras=L, backend=backend))


def jax_over_torch(impl_cls):
    import bridge

    return impl_cls(
        "jax-over-torch", "jax", "torch", ops_module=bridge.jax_over_torch,
        wrapper_factory=lambda T, B, L, backend: bridge.JaxPunicaWrapper(T, B, None, max_loras=L, backend=backend))
