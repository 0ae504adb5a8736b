"""Weight-only quantized linear layers (int8, float8_e4m3fn) for serving LoRA over a quantized base.

A `QuantizedLinear` replaces an `nnx.Linear` (kernel W (in, out), bias b) by its quantized kernel Q
and one float32 scale per output channel s:

    y = (x @ Q) * s + b          Q (in, out) int8 or float8_e4m3fn, s (out,) float32

Quantization (symmetric, per output channel, absmax), `quantize_kernel`:
  1. a_j = max_i |W_ij| over the column j (the output channel); s_j = a_j / qmax, with qmax = 127
     for int8 and 448 for float8_e4m3fn (its largest finite value); s_j = 1 for an all-zero column;
  2. int8: Q_ij = clip(round(W_ij / s_j), -127, 127) (round half to even);
     fp8:  Q_ij = e4m3(clip(W_ij / s_j, -448, 448)) (the cast rounds to nearest even; the clip keeps a
     quotient that rounds above 448 from becoming NaN, e4m3fn having no infinity).
The dequantized kernel is Q_ij * s_j (`QuantizedLinear.dequantized_kernel`).

Compute (`QuantizedLinear.__call__`), dequantize-on-the-fly:
  1. x is cast to the layer's activation dtype (the dtype of the float layer it replaced);
  2. Q is converted to that dtype inside the product: exact, since every int8 value and every e4m3
     value is representable in bfloat16, float16 and float32; the product accumulates in float32;
  3. the (..., out) float32 product is multiplied by s, the bias added in float32, the result
     rounded to the activation dtype.
The weights stay 1 byte per element in memory; XLA fuses the conversion into the matrix product
where the backend can. The LoRA terms of a `jax_lora.nn.MultiLoRALinear` over this layer are added
in the adapter dtype (16-bit), as over a float base.

`quantize_model(model, "int8" | "fp8")` replaces a model's `nnx.Linear` layers in place (before any
multi-LoRA layer is added); `jax_lora.models.llama.load_llama(..., quantize=...)` quantizes while
loading, tensor by tensor, so the float weights of the whole model are never on the device at once.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from .module_paths import path_name, set_submodule

__all__ = ["QUANTIZED_DTYPES", "QuantizedLinear", "dequantize_rows", "quantize_kernel", "quantize_model",
           "quantize_rows", "quantized_layers"]

# quantize= name -> (storage dtype, qmax: the largest magnitude Q holds)
QUANTIZED_DTYPES = {"int8": (jnp.int8, 127.0), "fp8": (jnp.float8_e4m3fn, 448.0)}


def _check_quantize(quantize) -> str:
    if quantize not in QUANTIZED_DTYPES:
        raise ValueError(f"quantize must be one of {sorted(QUANTIZED_DTYPES)} (int8 or float8_e4m3fn weights with "
                         f"per-output-channel scales), got {quantize!r}")
    return quantize


def quantize_kernel(kernel, quantize: str) -> tuple:
    """(Q (in, out) int8 / float8_e4m3fn, s (out,) float32) of a float kernel (in, out), per output
    channel (module docstring, "Quantization"). Computed in float32 with jax.numpy (on the default
    device); `kernel` may be a NumPy or JAX array."""
    storage, qmax = QUANTIZED_DTYPES[_check_quantize(quantize)]
    w = jnp.asarray(kernel, jnp.float32)
    if w.ndim != 2:
        raise ValueError(f"kernel must be 2-D (in, out), got shape {tuple(w.shape)}")
    if not bool(jnp.all(jnp.isfinite(w))):
        raise ValueError("kernel holds NaN or Inf: it cannot be quantized (no finite scale represents it)")
    amax = jnp.max(jnp.abs(w), axis=0)                                          # (out,)
    scale = jnp.where(amax > 0, amax / qmax, 1.0).astype(jnp.float32)
    q = w / scale
    if quantize == "int8":
        q = jnp.clip(jnp.round(q), -qmax, qmax)
    else:
        q = jnp.clip(q, -qmax, qmax)
    return q.astype(storage), scale


def quantize_rows(w, quantize: str = "fp8") -> tuple:
    """(Q (..., c, k), s (..., c) float32) of float weights (..., c, k) with one scale per row c: the
    rule of `quantize_kernel` with the row as the channel (fp8 LoRA weights: the rows of A (L, r, H)
    are its rank channels, those of B (L, n, r) its output channels). s = amax(|w[..., c, :]|) / qmax
    (1 for an all-zero row); Q = e4m3(clip(w / s, -448, 448)) (int8: round then clip).

    Computed in NumPy float32 on the host (adapters are quantised once, on load): the scales are the
    correctly rounded quotients amax / qmax on every platform (XLA may divide by a constant as a
    multiplication by its reciprocal, one ulp away). Returns NumPy arrays."""
    storage, qmax = QUANTIZED_DTYPES[_check_quantize(quantize)]
    w = np.asarray(w).astype(np.float32)
    if w.ndim < 2:
        raise ValueError(f"w must be at least 2-D (..., channels, k), got shape {tuple(w.shape)}")
    if not np.all(np.isfinite(w)):
        raise ValueError("w holds NaN or Inf: it cannot be quantized (no finite scale represents it)")
    amax = np.abs(w).max(axis=-1) if w.shape[-1] else np.zeros(w.shape[:-1], np.float32)   # (..., c)
    scale = np.where(amax > 0, amax / np.float32(qmax), np.float32(1.0)).astype(np.float32)
    q = w / scale[..., None]
    q = np.clip(np.round(q), -qmax, qmax) if quantize == "int8" else np.clip(q, -qmax, qmax)
    return q.astype(jnp.dtype(storage)), scale


def dequantize_rows(q, scale) -> jax.Array:
    """float32 Q[..., c, k] * s[..., c]: the weights `quantize_rows` stands for."""
    return jnp.asarray(q).astype(jnp.float32) * jnp.asarray(scale, jnp.float32)[..., None]


class QuantizedLinear(nnx.Module):
    """A weight-only quantized linear layer: y = (x @ Q) * s + b (module docstring).

    Args:
      qkernel: Q (in, out), int8 or float8_e4m3fn.
      scale: s (out,), the per-output-channel scales (stored float32).
      bias: b (out,) or None (stored in the activation dtype, as nnx.Linear stores it).
      dtype: the activation dtype: x is cast to it and y returned in it.
    Attributes: in_features, out_features, dtype, quantize ("int8" / "fp8"), qkernel, scale, bias.
    """

    def __init__(self, qkernel: jax.Array, scale: jax.Array, bias: jax.Array | None = None, *, dtype=jnp.float32):
        qkernel, scale = jnp.asarray(qkernel), jnp.asarray(scale)
        names = {jnp.dtype(d): name for name, (d, _) in QUANTIZED_DTYPES.items()}
        if qkernel.ndim != 2 or jnp.dtype(qkernel.dtype) not in names:
            raise TypeError(f"qkernel must be a 2-D int8 or float8_e4m3fn array (in, out), got {qkernel.dtype} "
                            f"{tuple(qkernel.shape)}")
        self.in_features, self.out_features = int(qkernel.shape[0]), int(qkernel.shape[1])
        if tuple(scale.shape) != (self.out_features,):
            raise ValueError(f"scale must have shape ({self.out_features},) (one per output channel), got "
                             f"{tuple(scale.shape)}")
        self.dtype = jnp.dtype(dtype)
        if not jnp.issubdtype(self.dtype, jnp.floating) or self.dtype.itemsize < 2:
            raise TypeError(f"dtype must be a 16- or 32-bit float activation dtype, got {self.dtype}")
        self.quantize = names[jnp.dtype(qkernel.dtype)]
        self.qkernel = nnx.Param(qkernel)
        self.scale = nnx.Param(scale.astype(jnp.float32))
        if bias is not None:
            bias = jnp.asarray(bias)
            if tuple(bias.shape) != (self.out_features,):
                raise ValueError(f"bias must have shape ({self.out_features},), got {tuple(bias.shape)}")
            bias = nnx.Param(bias.astype(self.dtype))
        self.bias = bias

    @classmethod
    def from_kernel(cls, kernel, bias=None, *, quantize: str, dtype=jnp.float32) -> QuantizedLinear:
        """Quantizes a float kernel (in, out) (`quantize_kernel`)."""
        q, s = quantize_kernel(kernel, quantize)
        return cls(q, s, None if bias is None else jnp.asarray(bias, dtype), dtype=dtype)

    @classmethod
    def from_linear(cls, linear: nnx.Linear, quantize: str) -> QuantizedLinear:
        """The quantized twin of `linear` (same bias, activation dtype = linear.dtype, or its
        kernel's dtype when linear.dtype is None)."""
        if not isinstance(linear, nnx.Linear):
            raise TypeError(f"linear must be an nnx.Linear, got {type(linear).__name__}")
        kernel = linear.kernel.get_value()
        dtype = linear.dtype or kernel.dtype
        bias = None if linear.bias is None else linear.bias.get_value()
        return cls.from_kernel(kernel, bias, quantize=quantize, dtype=dtype)

    def dequantized_kernel(self) -> jax.Array:
        """Q * s (in, out) float32: the float kernel this layer computes with."""
        return self.qkernel.get_value().astype(jnp.float32) * self.scale.get_value()[None, :]

    def __call__(self, x: jax.Array) -> jax.Array:
        x = jnp.asarray(x).astype(self.dtype)
        w = self.qkernel.get_value().astype(self.dtype)                       # exact conversion
        y = jax.lax.dot_general(x, w, (((x.ndim - 1,), (0,)), ((), ())), preferred_element_type=jnp.float32)
        y = y * self.scale.get_value()
        if self.bias is not None:
            y = y + self.bias.get_value().astype(jnp.float32)
        return y.astype(self.dtype)


def quantized_layers(model: nnx.Module) -> dict:
    """{dotted path: QuantizedLinear} of `model`."""
    return {".".join(str(p) for p in path): node for path, node in nnx.iter_graph(model)
            if isinstance(node, QuantizedLinear)}


def quantize_model(model: nnx.Module, quantize: str, *, target_modules: None | str | Sequence[str] = None,
                   skip_modules: Sequence[str] = ("lm_head",)) -> dict:
    """Replaces the `nnx.Linear` layers of an NNX model by `QuantizedLinear`, in place.

    Args:
      model: any NNX module tree without multi-LoRA layers yet (quantize first, then `add_lora` /
        `jax_lora.nn.replace_lora_layers`: the LoRA layers then wrap the quantized layers).
      quantize: "int8" or "fp8" (float8_e4m3fn), weight-only, per-output-channel scales.
      target_modules: None (every nnx.Linear), a list of layer names (a path's last part(s)) or one
        regex over the dotted path, as in `jax_lora.nn.replace_lora_layers`.
      skip_modules: layer names (a path's last part) never quantized (default: the LM head).
    Returns {path: QuantizedLinear}. Raises ValueError when nothing matches, when the model already
    holds multi-LoRA layers, or when it is split over a mesh.
    """
    _check_quantize(quantize)
    if getattr(model, "mesh", None) is not None:
        raise NotImplementedError("quantize_model on a model split over a mesh is not supported: quantize the "
                                  "unsplit model (quantized layers are served on one device)")
    nodes = list(nnx.iter_graph(model))
    lora = [path_name(p) for p, n in nodes if p and hasattr(n, "lora_a")]
    if lora:
        raise ValueError(f"quantize the model before adding multi-LoRA layers: it already has {lora[:3]}; call "
                         "quantize_model first, then add_lora / replace_lora_layers")
    found = []
    for path, node in nodes:
        if not path or type(node) is not nnx.Linear or str(path[-1]) in skip_modules:
            continue
        name = path_name(path)
        if target_modules is None or (re.fullmatch(target_modules, name) is not None if isinstance(target_modules, str)
                                      else any(name == t or name.endswith("." + t) for t in target_modules)):
            found.append((path, node))
    if not found:
        raise ValueError(f"target_modules={target_modules!r} match no nnx.Linear layer of {type(model).__name__} "
                         f"(skip_modules={tuple(skip_modules)})")
    done = {}
    for path, node in found:
        new = QuantizedLinear.from_linear(node, quantize)
        set_submodule(model, path, new)
        done[path_name(path)] = new
    return done

