"""The one kernel-argument builder: every launcher's parameter list for the Triton kernels.

Each kernel takes ~30-90 non-constexpr parameters in a fixed order: its arrays (pointer
parameters), then scalars (scale, sizes, element strides, slice widths and offsets), then the
array it writes (`out_ptr`). `shrink_call`, `expand_call` and `fused_call` build that list once
(and `gemm_lora_call` / `norm_shrink_call` for the fused linear kernels: the base GEMM with the
LoRA expand in its epilogue, RMSNorm with the LoRA shrink), for every launcher: torch's
(Triton's launcher, the direct launch and the C launcher of `PreparedLinear`), JAX's (the XLA
FFI handler, jax_triton) and the interpreter's.

Arrays are whatever the launcher passes (torch tensors, jax arrays, NumPy arrays, or a launcher's
placeholders for buffers it provides itself); the builder reads only their `.shape`, and their
element strides through the `strides` function it is given (torch: `Tensor.stride()`; JAX: the
row-major strides of the shape). Slices past the launch's own (up to MAX_SLICES = 4 per launch)
repeat slice 0's weights and strides; a missing bias passes another slice's bias / DoRA scale
(else slice 0's B) with zero strides (its BIAS flag keeps it unread; the vectors of one launch share
one dtype); without per-slot ranks the ranks pointer is the counts array (never
read: HAS_RANKS is off), and without adapter pairs (`lora_core.adapter_pairs`: several adapters
per token) so are the pair-table pointers (PAIRS is 0). With pairs, the metadata's ids are group
ids and the kernels' `num_slots` is the number of groups.

fp8 (e4m3) weights come with per-output-channel float32 scales (`a_scales` (L, r) / `b_scales`
(L, n_s) per slice, channels contiguous): each slice's scale pointer and slot stride follow its
weights' (as0..as3 / bs0..bs3). The kernels read them only when the weight's element type is fp8
(a compile-time constant), so a 16-bit launch passes the counts array with stride 0 there. A
launch's slices share one weight dtype (the kernels pick a slice's pointer with `tl.where`).

The metadata arrives as a `KernelMeta` (lora_core.kernel_meta: its five index arrays are the
kernels' metadata pointers, in its order); each slice's part of a launch is one `SliceArgs`
record, and a kernel's per-slice parameter groups (a0..a3, their strides, widths, offsets) are
those records read field by field.

`KernelCall.with_alignment_hints()` sets the ALIGNED meta-parameter when every integer the kernel
passes through `hint16` is a multiple of 16 (JAX's launchers: Triton's own launcher specialises
integers itself, so torch leaves it off).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import NamedTuple

from ..dora import epilogue_vectors
from ..kernel_meta import KernelMeta
from .expand import lora_expand_kernel
from .fused import lora_fused_kernel
from .gemm_lora import gemm_lora_kernel
from .norm_shrink import rms_norm_shrink_kernel
from .planning import MAX_SLICES
from .shrink import lora_shrink_kernel

Strides = Callable[[object], Sequence[int]]

# Integer parameters each kernel passes through `hint16` (ALIGNED tells the compiler that they are
# multiples of 16): the slot/row strides of the weights and biases, the token strides of x, y and
# the buffers, the hidden size, slice widths and offsets.
_WEIGHT_HINTS = {f"stride_{w}{s}_{axis}" for s in range(MAX_SLICES) for w, axis in
                 (("a", "slot"), ("a", "rank"), ("b", "slot"), ("b", "col"), ("bias", "slot"))}
_SLICE_HINTS = {f"{name}{s}" for s in range(MAX_SLICES) for name in ("width", "offset")}
_HINTED = {
    "lora_shrink_kernel": _WEIGHT_HINTS | {"hidden", "stride_x_token", "stride_out_plane", "stride_out_slice",
                                           "stride_out_token"},
    "lora_expand_kernel": _WEIGHT_HINTS | _SLICE_HINTS | {"stride_buf_plane", "stride_buf_slice",
                                                          "stride_buf_token", "stride_y_token"},
    "lora_fused_kernel": _WEIGHT_HINTS | _SLICE_HINTS | {"hidden", "stride_x_token", "stride_y_token",
                                                         "stride_ws_plane", "stride_ws_slice", "stride_ws_token"},
}


@dataclasses.dataclass(frozen=True, eq=False)
class KernelCall:
    """One launch: `kernel[plan.grid](*pointers, *scalars, out, **plan.constexprs)`.

    pointers: the array parameters before the scalars, in the kernel's order; scalars: the scale,
    sizes and strides, in order; out: the array the kernel writes (its last parameter), or None
    for a kernel without a trailing out parameter, which writes arrays among its pointers
    (`lora_core.kernels.moe_lora`: its rank buffer and y; each launcher says how such a call
    names the arrays it writes)."""
    kernel: object
    plan: object
    pointers: tuple
    scalars: tuple
    out: object = None

    @property
    def args(self) -> tuple:
        """Every non-constexpr parameter, in the kernel's order."""
        return (*self.pointers, *self.scalars) + (() if self.out is None else (self.out,))

    def named_scalars(self) -> dict:
        """{parameter name: value} of the scalar parameters."""
        names = self.kernel.arg_names[len(self.pointers):len(self.pointers) + len(self.scalars)]
        return dict(zip(names, self.scalars))

    def with_alignment_hints(self) -> KernelCall:
        """This call with ALIGNED set when every hinted integer (0 and 1 aside) is a multiple of 16."""
        hinted = _HINTED[self.kernel.__name__]
        aligned = all(int(v) % 16 == 0 for name, v in self.named_scalars().items()
                      if name in hinted and int(v) not in (0, 1))
        if aligned == bool(self.plan.constexprs.get("ALIGNED")):
            return self
        plan = dataclasses.replace(self.plan, constexprs={**self.plan.constexprs, "ALIGNED": aligned})
        return dataclasses.replace(self, plan=plan)


def row_major_strides(shape: Sequence[int]) -> tuple:
    """Element strides of a contiguous array of `shape` (what jax arrays have)."""
    strides, acc = [], 1
    for d in reversed(shape):
        strides.append(acc)
        acc *= int(d)
    return tuple(reversed(strides))


def shape_strides(array) -> tuple:
    """`Strides` of arrays laid out row-major (jax arrays, launcher placeholders with a shape)."""
    return row_major_strides(array.shape)


class SliceArgs(NamedTuple):
    """One slice's parameters of a launch. The kernels take each field as MAX_SLICES consecutive
    parameters (a0..a3, then b0..b3, ...; a stride triple per slice), so a launch's parameter
    list is its slices' records read field by field."""
    a: object = None             # (L, r, H) weight (shrink, fused)
    a_strides: tuple = ()        # its (slot, rank, hidden) element strides
    b: object = None             # (L, n, r) weight (expand, fused)
    b_strides: tuple = ()        # its (slot, col, rank) element strides
    bias: object = None          # (L, n) epilogue vector: a LoRA bias or a DoRA column scale
    bias_strides: tuple = ()     # its (slot, col) element strides; (0, 0) when the slice has none
    width: int = 0               # n, the slice's columns in y (expand, fused)
    offset: int = 0              # the slice's first column in y
    a_scale: object = None       # (L, r) float32 channel scales of an fp8 A (else the dummy, never read)
    a_scale_stride: int = 0      # its slot stride
    b_scale: object = None       # (L, n) float32 channel scales of an fp8 B (else the dummy, never read)
    b_scale_stride: int = 0      # its slot stride


def _is_fp8(w) -> bool:
    return "float8" in str(getattr(w, "dtype", ""))


def _scale_args(name: str, weights: Sequence, scales, strides: Strides, dummy) -> list:
    """[(pointer, slot stride)] per slice of `weights`: a slice's channel scales when its weight is
    fp8, else (dummy, 0). Checked here, whatever the launcher: the slices share one weight dtype,
    an fp8 weight has a scale and a 16-bit one none, and a scale is (L, rows) with contiguous
    channels (ValueError naming `name`)."""
    scales = tuple(scales) if scales is not None else (None,) * len(weights)
    if len(scales) != len(weights):
        raise ValueError(f"{name} must hold one entry per slice ({len(weights)}), got {len(scales)}")
    dtypes = {str(w.dtype) for w in weights}
    if len(dtypes) > 1 and any(_is_fp8(w) for w in weights):
        raise ValueError(f"the slices of one launch of the Triton kernels must share one weight dtype, got "
                         f"{sorted(dtypes)}")
    out = []
    for s, (w, sc) in enumerate(zip(weights, scales)):
        if not _is_fp8(w):
            if sc is not None:
                raise ValueError(f"{name}[{s}] is given, but the weight of slice {s} is {w.dtype}, not fp8")
            out.append((dummy, 0))
            continue
        want = (int(w.shape[0]), int(w.shape[1]))
        if sc is None or tuple(int(d) for d in sc.shape) != want:
            raise ValueError(f"{name}[{s}] must be the (num_slots, channels) = {want} float32 channel scales of "
                             f"the fp8 weight of slice {s}, got "
                             f"{None if sc is None else tuple(int(d) for d in sc.shape)}")
        slot_stride, chan_stride = (int(v) for v in strides(sc))
        if chan_stride != 1 and want[1] > 1:
            raise ValueError(f"{name}[{s}] must have contiguous channels (stride 1), got strides "
                             f"{(slot_stride, chan_stride)}")
        out.append((sc, slot_stride))
    return out


def _slices(strides: Strides, lora_a: Sequence = (), lora_b: Sequence = (), bias=None,
            offsets: Sequence[int] = (), a_scales=None, b_scales=None, dummy=None) -> list:
    """The launch's MAX_SLICES SliceArgs, slice 0 first. Slices past the launch's own repeat slice
    0's weights and strides with width and offset 0; the epilogue vectors: `_bias_args`; the fp8
    channel scales: `_scale_args` (`dummy` where there are none)."""
    num_slices = max(len(lora_a), len(lora_b))
    a_sc = _scale_args("a_scales", lora_a, a_scales, strides, dummy) if lora_a else [(None, 0)] * num_slices
    b_sc = _scale_args("b_scales", lora_b, b_scales, strides, dummy) if lora_b else [(None, 0)] * num_slices
    bias_pointers, bias_strides = _bias_args(bias, num_slices, lora_b[0], strides) if lora_b else ((), ())
    own = []
    for s in range(num_slices):
        a = lora_a[s] if lora_a else None
        b = lora_b[s] if lora_b else None
        own.append(SliceArgs(a, () if a is None else tuple(strides(a)), b, () if b is None else tuple(strides(b)),
                             width=0 if b is None else int(b.shape[1]), offset=int(offsets[s]) if offsets else 0,
                             a_scale=a_sc[s][0], a_scale_stride=a_sc[s][1], b_scale=b_sc[s][0],
                             b_scale_stride=b_sc[s][1]))
    slices = own + [own[0]._replace(width=0, offset=0)] * (MAX_SLICES - num_slices)
    if lora_b:
        slices = [sl._replace(bias=p, bias_strides=st) for sl, p, st in zip(slices, bias_pointers, bias_strides)]
    return slices


def _as_kernel_meta(meta) -> KernelMeta:
    """`meta` as a KernelMeta (any sequence of its fields in its order is read as one)."""
    return meta if isinstance(meta, KernelMeta) else KernelMeta(*meta)


def _index_pointers(m: KernelMeta) -> tuple:
    """The kernels' metadata pointer parameters: KernelMeta's five index arrays, in its order."""
    return (m.token_lora_mapping, m.token_indices_sorted_by_lora_ids, m.num_tokens_per_lora,
            m.lora_token_start_loc, m.active_lora_ids)


class ColumnScale(NamedTuple):
    """A slice's DoRA column scale g (L, n_s), passed where the slice's bias would be: the kernels
    then write g[slot] * (y + delta) instead of adding a bias (`epilogue`)."""
    vector: object


def bias_flags(bias, num_slices: int) -> tuple:
    """BIAS0.. of a launch's slices, each slice's epilogue: 0 none, 1 a bias (added), 2 a
    ColumnScale (DoRA: the new value times g)."""
    return tuple(0 if bias is None or bias[s] is None else 2 if isinstance(bias[s], ColumnScale) else 1
                 for s in range(num_slices))


def epilogue(bias, col_scale, num_slices: int):
    """The per-slice vectors a launch takes as its `bias`: a slice's LoRA bias, or its DoRA column
    scale wrapped in ColumnScale, never both (ValueError naming the slice); None when neither."""
    if col_scale is None:
        return bias
    vectors, _, scaled = epilogue_vectors(bias, col_scale, num_slices)
    return None if vectors is None else tuple(ColumnScale(v) if g else v for v, g in zip(vectors, scaled))


def _one_dtype_vectors(bias, num_slices: int) -> list:
    """The slices' epilogue vectors (a bias, or a ColumnScale's vector; None where neither), checked
    to share one dtype: the kernels pick a slice's vector pointer with `tl.where`, which takes
    pointers of one element type only."""
    vectors = [None if bias is None else (b.vector if isinstance(b, ColumnScale) else b) for b in
               (bias or ())[:num_slices]]
    dtypes = {str(getattr(v, "dtype", None)): s for s, v in enumerate(vectors) if v is not None}
    if len(dtypes) > 1:
        seen = ", ".join(f"{d.replace('torch.', '')} (slice {s})" for d, s in dtypes.items())
        raise ValueError(f"the slices' LoRA biases / DoRA column scales must share one dtype in one launch of the "
                         f"Triton kernels, got {seen}")
    return vectors


def _bias_args(bias, num_slices: int, dummy, strides: Strides) -> tuple:
    """(pointers, (slot, col) strides), one of each per slice up to MAX_SLICES; a missing bias
    passes the first present vector (else `dummy`) with zero strides: one pointer element type for
    every slice (`_one_dtype_vectors`), never read (its BIAS flag is 0)."""
    vectors = _one_dtype_vectors(bias, num_slices)
    dummy = next((v for v in vectors if v is not None), dummy)
    pointers, pairs = [], []
    for s in range(MAX_SLICES):
        b = vectors[s] if s < len(vectors) else None
        if b is None:
            pointers.append(dummy)
            pairs.append((0, 0))
        else:
            b = b if b.ndim == 2 else b.reshape(b.shape[0], -1)
            pointers.append(b)
            pairs.append(tuple(strides(b)))
    return pointers, pairs


def _pair_pointers(m: KernelMeta, pairs) -> tuple:
    """(pair slots, pair weights) of a launch with adapter pairs, else the counts array twice
    (never read: PAIRS is 0)."""
    if pairs is None:
        return m.num_tokens_per_lora, m.num_tokens_per_lora
    return pairs.slots, pairs.weights


def _id_bound(m: KernelMeta, lora_a_or_b, pairs) -> int:
    """The kernels' `num_slots`: the ids of the metadata below it are real (slots, or groups with
    adapter pairs)."""
    return int(lora_a_or_b.shape[0]) if pairs is None else int(m.active_lora_ids.shape[0]) - 1


def shrink_call(plan, x, lora_a: Sequence, lora_ranks, meta: Sequence, scale: float, out,
                strides: Strides, pairs=None, a_scales=None) -> KernelCall:
    """`lora_shrink_kernel`'s call. x (T, H); lora_a: up to MAX_SLICES (L, r, H) weights; lora_ranks
    (L,) int32 or None; meta: a KernelMeta (its five index arrays are read); out: (planes, S, T, r)
    float32, (planes, S, T, k * r) with k adapter pairs (`pairs`: an AdapterPairs, or None);
    a_scales: None, or per slice None / the (L, r) float32 channel scales of an fp8 A."""
    m = _as_kernel_meta(meta)
    sl = _slices(strides, lora_a=lora_a, a_scales=a_scales, dummy=m.num_tokens_per_lora)
    ranks = m.num_tokens_per_lora if lora_ranks is None else lora_ranks
    pointers = (x, *(s.a for s in sl), *(s.a_scale for s in sl), ranks, *_pair_pointers(m, pairs),
                *_index_pointers(m))
    scalars = (scale, x.shape[0], x.shape[1], m.token_indices_sorted_by_lora_ids.shape[0],
               _id_bound(m, lora_a[0], pairs),
               *strides(x), *(v for s in sl for v in s.a_strides), *(s.a_scale_stride for s in sl),
               *strides(out))
    return KernelCall(lora_shrink_kernel, plan, pointers, scalars, out)


def expand_call(plan, buf, lora_b: Sequence, bias, lora_ranks, meta: Sequence, y, offsets: Sequence[int],
                strides: Strides, pairs=None, b_scales=None) -> KernelCall:
    """`lora_expand_kernel`'s call, writing y in place. buf: (planes, S, T, r) float32 ((planes, S, T,
    k * r) with k adapter pairs); lora_b: up to MAX_SLICES (L, n_s, r) weights; bias: None or per
    slice None / (L, n_s) (or (L, 1, n_s)); meta: a KernelMeta; offsets: the slices' first columns
    in y (T, N); pairs: an AdapterPairs, or None; b_scales: None, or per slice None / the (L, n_s)
    float32 channel scales of an fp8 B."""
    m = _as_kernel_meta(meta)
    sl = _slices(strides, lora_b=lora_b, bias=bias, offsets=offsets, b_scales=b_scales, dummy=m.num_tokens_per_lora)
    ranks = m.num_tokens_per_lora if lora_ranks is None else lora_ranks
    pointers = (buf, *(s.b for s in sl), *(s.b_scale for s in sl), *(s.bias for s in sl), ranks,
                _pair_pointers(m, pairs)[0], *_index_pointers(m), y)
    scalars = (y.shape[0], m.token_indices_sorted_by_lora_ids.shape[0], _id_bound(m, lora_b[0], pairs),
               *strides(buf),
               *(v for s in sl for v in s.b_strides), *(s.b_scale_stride for s in sl),
               *(v for s in sl for v in s.bias_strides),
               *(s.width for s in sl), *(s.offset for s in sl), *strides(y))
    return KernelCall(lora_expand_kernel, plan, pointers, scalars, y)


def fused_call(plan, x, lora_a: Sequence, lora_b: Sequence, bias, lora_ranks, meta: Sequence, y, sync, workspace,
               scale: float, offsets: Sequence[int], strides: Strides, pairs=None, a_scales=None,
               b_scales=None) -> KernelCall:
    """`lora_fused_kernel`'s call, writing y in place. meta: a KernelMeta; sync: the int32 barrier
    counters (plan.sync_ints, zeroed once); workspace: plan.workspace_shape float32; pairs: an
    AdapterPairs, or None; a_scales / b_scales: as in `shrink_call` / `expand_call`."""
    m = _as_kernel_meta(meta)
    sl = _slices(strides, lora_a=lora_a, lora_b=lora_b, bias=bias, offsets=offsets, a_scales=a_scales,
                 b_scales=b_scales, dummy=m.num_tokens_per_lora)
    ranks = m.num_tokens_per_lora if lora_ranks is None else lora_ranks
    pointers = (x, *(s.a for s in sl), *(s.b for s in sl), *(s.a_scale for s in sl), *(s.b_scale for s in sl),
                *(s.bias for s in sl), ranks, *_pair_pointers(m, pairs), *_index_pointers(m), y, sync, workspace)
    scalars = (scale, x.shape[0], x.shape[1], m.token_indices_sorted_by_lora_ids.shape[0],
               _id_bound(m, lora_a[0], pairs),
               *strides(x), *(v for s in sl for v in s.a_strides), *(v for s in sl for v in s.b_strides),
               *(s.a_scale_stride for s in sl), *(s.b_scale_stride for s in sl),
               *(v for s in sl for v in s.bias_strides), *(s.width for s in sl), *(s.offset for s in sl),
               *strides(y), *strides(workspace)[:3])
    return KernelCall(lora_fused_kernel, plan, pointers, scalars, y)


def _padded4(values: Sequence, fill) -> list:
    """values followed by `fill` up to MAX_SLICES entries (the kernels' per-slice parameters)."""
    values = list(values)
    return values + [fill] * (MAX_SLICES - len(values))


def gemm_lora_call(plan, x, weight, bias, buf, lora_b: Sequence | None, slots, lora_ranks, y, workspace, lock,
                   strides: Strides) -> KernelCall:
    """`gemm_lora_kernel`'s call (lora_core.kernels.gemm_lora), writing y whole: y_ptr (read with
    ADD_INPUTS) and the trailing out_ptr are both y. x (M, K); weight (N, K); bias (N,) or None;
    buf (P, S, M, R) float32 or None; lora_b: S (L, n_s, R) weights of one dtype, or None with
    slots, buf and lora_ranks None (the GEMM alone); slots (M,) int32; lora_ranks (L,) int32 or
    None; workspace (SPLIT_K, M, N) float32 and lock (one int32 counter per output tile, 0 between
    launches) when plan.split_k > 1, else None. Absent arrays pass slots (or x) in their place,
    never read (their flags are off); slices past lora_b's repeat slice 0 with zero strides."""
    has_lora = lora_b is not None
    m, k = (int(d) for d in x.shape)
    n = int(weight.shape[0])
    dummy = slots if has_lora else x
    b = tuple(lora_b) if has_lora else (weight,)
    b_strides = [v for t in b for v in strides(t)] if has_lora else [0, 0, 0] * len(b)
    b_strides += [0, 0, 0] * (MAX_SLICES - len(b))
    num_slots = int(b[0].shape[0]) if has_lora else 0
    pointers = (x, weight, dummy if bias is None else bias, buf if has_lora else dummy, *_padded4(b, b[0]), dummy,
                dummy if lora_ranks is None else lora_ranks, y,
                dummy if workspace is None else workspace, dummy if lock is None else lock)
    scalars = (m, n, k, plan.k_per_split, num_slots, int(buf.shape[0]) if has_lora else 1, *plan.slice_tiles,
               *strides(x), *strides(weight), *strides(y), 0 if bias is None else strides(bias)[0],
               *(strides(buf) if has_lora else (0, 0, 0, 0)), *b_strides)
    return KernelCall(gemm_lora_kernel, plan, pointers, scalars, y)


def norm_shrink_call(plan, h, norm_weight, lora_a: Sequence | None, slots, lora_ranks, xn, buf, eps: float,
                     scale: float, strides: Strides) -> KernelCall:
    """`rms_norm_shrink_kernel`'s call (lora_core.kernels.norm_shrink): it writes xn (M, K), a
    pointer mid-list, and buf (P, S, M, R) float32, its trailing parameter. h (M, K); norm_weight
    (K,); lora_a: S (L, R, K) weights of one dtype, or None with slots, lora_ranks and buf None (the
    norm alone: xn is then also the trailing parameter, never written there: LORA_MODE 0); slots
    (M,) int32; lora_ranks (L,) int32 or None."""
    has_lora = lora_a is not None
    m, k = (int(d) for d in h.shape)
    dummy = slots if has_lora else norm_weight
    a = tuple(lora_a) if has_lora else (norm_weight,)
    a_strides = [v for t in a for v in strides(t)] if has_lora else [0, 0, 0] * len(a)
    a_strides += [0, 0, 0] * (MAX_SLICES - len(a))
    pointers = (h, norm_weight, *_padded4(a, a[0]), dummy, dummy if lora_ranks is None else lora_ranks, xn)
    scalars = (m, k, plan.k_per_split, int(a[0].shape[0]) if has_lora else 0, float(eps),
               float(scale) if has_lora else 1.0, *strides(h), strides(norm_weight)[0], *strides(xn), *a_strides,
               *(strides(buf) if has_lora else (0, 0, 0, 0)))
    return KernelCall(rms_norm_shrink_kernel, plan, pointers, scalars, buf if has_lora else xn)
