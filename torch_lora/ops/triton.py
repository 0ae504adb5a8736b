"""Backend "triton" for torch: launches the shared Triton kernels of `lora_core.kernels`.

Contract (torch_lora.ops.dispatch): `shrink` writes every row of `out` (0 for tokens without
LoRA), `expand` writes the slices of `y` in place; `linear` is shrink + expand with add_inputs
(`add_lora_linear`'s math): a split-K shrink into a float32 workspace and an expand launched as its
programmatic dependent (Hopper; the shrink itself is a dependent of the kernel before it and waits
for it before reading x), or the one-launch fused kernel for the shape classes where the tuned
table says it wins (`configs.use_fused`; `fused=True` / `False` forces either). The
fused kernel's barrier counters come from `_sync_buffer` (one zeroed-once buffer per (device,
stream)). `prepare_linear` binds `linear`'s persistent arguments once (`PreparedLinear`: the
argument lists of the launches, built once; a call fills in x, y, lora_ranks, scale and the
stream's workspace (`_workspace_buffer`, no allocation per call) and barrier counters).

No host synchronisation: every decision (which adapters are active, whether any is) is made on the
device from the metadata; the grids depend only on shapes, so calls can be captured in a CUDA
graph and replayed with new mappings. Launch plans are cached by shapes, strides-free keys and
dtypes only (never by data pointers; only a PreparedLinear, owned by its caller, holds pointers).
"""

from __future__ import annotations

import ctypes
import functools
import logging
import types
from collections.abc import Sequence

import torch

from lora_core.kernels import arguments, configs
from lora_core.kernels.expand import plan_expand
from lora_core.kernels.fused import plan_fused
from lora_core.kernels.launch import triton_launch
from lora_core.kernels.planning import interpreting, next_pow2, slice_chunks
from lora_core.kernels.shrink import plan_shrink

from . import c_launch
from .pdl import pdl_enabled

NAME = "triton"
_LOG = logging.getLogger("torch_lora")
# Programmatic dependent launch for `linear` (Hopper and newer, `pdl.pdl_enabled`): the expand's
# prologue (metadata, y and B loads) overlaps the shrink, and a one-token call's shrink overlaps the
# kernel before it; both kernels gdc_wait before reading what the kernel before them wrote.
_pdl_enabled = pdl_enabled

_DTYPE_NAMES = {torch.float16: "float16", torch.bfloat16: "bfloat16", torch.float32: "float32",
                torch.float8_e4m3fn: "float8_e4m3fn"}


def _dtype_name(t: torch.Tensor) -> str:
    return _DTYPE_NAMES.get(t.dtype, str(t.dtype).replace("torch.", ""))


def _torch_strides(t: torch.Tensor) -> tuple:
    return t.stride()


# ------------------------------------------------------------------------------------- plans

@functools.lru_cache(maxsize=4096)
def _shrink_plan(T, H, R, S, G, L, xd, wd, lora_only, workspace, has_ranks, cfg_key, deterministic=False, pairs=0):
    cfg = dict(cfg_key) if cfg_key else configs.shrink_config(T, H, R, S, L, deterministic=deterministic, w_dtype=wd)
    return plan_shrink(T, H, R, S, G, xd, wd, cfg, lora_only=lora_only, workspace=workspace,
                         has_ranks=has_ranks, pdl=workspace and _pdl_enabled(), deterministic=deterministic,
                         pairs=pairs)


@functools.lru_cache(maxsize=4096)
def _expand_plan(T, R, widths, G, L, partials, wd, yd, add_inputs, bias_flags, has_ranks, cfg_key, pdl,
                 deterministic=False, pairs=0):
    cfg = dict(cfg_key) if cfg_key else configs.expand_config(T, max(widths), R, len(widths), L,
                                                              deterministic=deterministic, w_dtype=wd)
    return plan_expand(T, R, widths, G, partials, wd, yd, cfg, add_inputs=add_inputs,
                         bias_flags=bias_flags, has_ranks=has_ranks, pdl=pdl and _pdl_enabled(),
                         deterministic=deterministic, pairs=pairs)


@functools.lru_cache(maxsize=4096)
def _fused_plan(T, H, R, widths, G, L, xd, wd, bias_flags, has_ranks, cfg_key, pairs=0):
    cfg = dict(cfg_key) if cfg_key else configs.fused_config(T, H, max(widths), R, len(widths), L, w_dtype=wd)
    return plan_fused(T, H, R, widths, G, xd, wd, cfg, add_inputs=True, bias_flags=bias_flags,
                        has_ranks=has_ranks, pdl=_pdl_enabled(), pairs=pairs)


# ------------------------------------------------------------------------------------- stream buffers
# Buffers that launches on one (device, stream) share, kept for the process's life.
#  * The fused kernel's barrier counters (`_sync_buffer`): its programs of one token tile meet at a
#    barrier, one int32 counter per tile, zeroed once; every launch leaves it a multiple of
#    lora_triton.BARRIER_SPAN. Launches that may run at the same time must not share counters.
#  * PreparedLinear's float32 workspace (`_workspace_buffer`): every call on a stream writes it
#    and reads it back, and the next call's first kernel writes it only after the previous call's
#    last kernel has completed (stream order; with PDL, the shrink and the fused kernel write
#    the workspace only after their gdc_wait on the kernel before them). So one buffer serves
#    every call of every layer on the stream, and a call allocates nothing.
# A buffer first needed while a CUDA graph is being captured is allocated inside that capture:
# the graph's private pool holds it (every replay zeroes the counters again -- harmless). Two
# graphs captured on one stream share that stream's buffers: do not replay them concurrently.
# A buffer that is outgrown is kept (never freed): graphs captured earlier still point at it.
_SYNC_INTS = 2 * 1024
_WORKSPACE_FLOATS = 64 * 1024
_SYNC_BUFFERS: dict = {}
_WORKSPACES: dict = {}
_OUTGROWN: list = []


def _stream_buffer(store: dict, dtype, minimum: int, device: torch.device, stream: int, n: int) -> torch.Tensor:
    """store's zeroed buffer of (device, stream): at least n elements (a power of two, >= minimum)."""
    key = (device.index, stream)
    buf = store.get(key)
    if buf is None or buf.numel() < n:
        if buf is not None:
            _OUTGROWN.append(buf)
        buf = torch.zeros(max(minimum, next_pow2(n)), dtype=dtype, device=device)
        store[key] = buf
    return buf


def _sync_buffer(device: torch.device, stream: int, ints: int) -> torch.Tensor:
    """The barrier counters of launches on (device, stream): int32, at least `ints` of them."""
    return _stream_buffer(_SYNC_BUFFERS, torch.int32, _SYNC_INTS, device, stream, ints)


def _workspace_buffer(device: torch.device, stream: int, floats: int) -> torch.Tensor:
    """PreparedLinear's workspace on (device, stream): float32, at least `floats` of them."""
    return _stream_buffer(_WORKSPACES, torch.float32, _WORKSPACE_FLOATS, device, stream, floats)


def _key(config: dict | None):
    return tuple(sorted(config.items())) if config else None


# ------------------------------------------------------------------------------------- launches
# Triton's own launcher (`kernel[grid](...)`) re-derives the specialisation of ~60 arguments on
# every call (tens of microseconds of host time). After the first launch of a given specialisation
# the compiled kernel is kept and launched directly. Its key holds everything Triton specialises
# on: the kernel, the plan (meta-parameters), every integer argument's value, every tensor's dtype,
# and whether every tensor is 16-byte aligned (else Triton's own launcher is used) -- never a data
# pointer itself.
_COMPILED: dict = {}
_FAST = [c_launch.LAUNCHER != "triton" and not interpreting()]
_MAX_COMPILED = 4096


def _compiled_key(call: arguments.KernelCall):
    """(key of `_COMPILED`, misalignment bits of every pointer argument)."""
    misaligned = call.out.data_ptr() & 15
    for p in [t.data_ptr() for t in call.pointers]:
        misaligned |= p
    # (the kernel by name: a JITFunction hashes in Python, microseconds per lookup)
    return (call.kernel.__name__, call.plan.key, call.scalars, tuple([t.dtype for t in call.pointers]),
            call.out.dtype, misaligned & 15), misaligned & 15


def _launch(call: arguments.KernelCall) -> None:
    """The call through the direct fast path once its specialisation is compiled, else Triton's launcher."""
    plan = call.plan
    if len(getattr(plan, "phases", (0,))) > 1:   # the fused kernel under the interpreter: one launch per phase
        triton_launch(call)
        return
    if _FAST[0]:
        key, misaligned = _compiled_key(call)
        c = _COMPILED.get(key)
        if c is not None and not misaligned:
            grid = plan.grid
            stream = torch._C._cuda_getCurrentRawStream(call.out.device.index)
            c[0].run(grid[0], grid[1], grid[2] if len(grid) > 2 else 1, stream, c[0].function,
                     c[0].packed_metadata, None, None, None, *call.args, *c[1])
            return
    options = {"launch_pdl": True} if plan.launch_pdl else {}
    if getattr(plan, "cooperative", False) and not interpreting():
        options["launch_cooperative_grid"] = True
    compiled = triton_launch(call, **options)
    if _FAST[0]:
        try:
            names = call.kernel.arg_names[len(call.args):]
            consts = tuple(plan.constexprs[n] for n in names)
            compiled.function  # noqa: B018 - fails early if this Triton has another layout
            if len(_COMPILED) > _MAX_COMPILED:
                _COMPILED.clear()
            _COMPILED[key] = (compiled, consts)
        except Exception as e:
            _FAST[0] = False
            _LOG.warning("direct launches of compiled kernels are off (Triton's launcher from now on): %s: %s",
                         type(e).__name__, e)


def _num_pairs(pairs) -> int:
    """The launch's PAIRS: 0 without adapter pairs (lora_core.adapter_pairs), else k."""
    return 0 if pairs is None else pairs.num_pairs


def _plan_for_shrink(x, lora_a, meta_args, lora_ranks, lora_only, workspace, config, deterministic=False,
                     pairs=None):
    T, H = x.shape
    L, R, _ = lora_a[0].shape
    return _shrink_plan(T, H, R, len(lora_a), meta_args.active_lora_ids.shape[0], L, _dtype_name(x),
                        _dtype_name(lora_a[0]), lora_only, workspace, lora_ranks is not None, _key(config),
                        deterministic, _num_pairs(pairs))


def _part(scales, lo: int, hi: int):
    """Slices lo..hi of per-slice fp8 channel scales (None stays None)."""
    return None if scales is None else tuple(scales[lo:hi])


def _shrink_call(x, lora_a, out, meta_args, scale, lora_ranks, plan, pairs=None,
                 a_scales=None) -> arguments.KernelCall:
    return arguments.shrink_call(plan, x, lora_a, lora_ranks, meta_args, scale,
                                 out if out.dim() == 4 else out[None],
                                 _torch_strides, pairs, a_scales)


def _expand_call(buf, lora_b, y, meta_args, offsets, add_inputs, lora_ranks, bias, config=None,
                 pdl=False, deterministic=False, pairs=None, b_scales=None) -> arguments.KernelCall:
    """The expand of slices lora_b (at most MAX_SLICES) from buf (S, T, r) or (planes, S, T, r)."""
    L, _, R = lora_b[0].shape
    widths = tuple(int(b.shape[1]) for b in lora_b)
    buf4 = buf if buf.dim() == 4 else buf[None]
    plan = _expand_plan(y.shape[0], R, widths, meta_args.active_lora_ids.shape[0], L, buf4.shape[0],
                        _dtype_name(lora_b[0]), _dtype_name(y), bool(add_inputs),
                        arguments.bias_flags(bias, len(lora_b)), lora_ranks is not None, _key(config), pdl,
                        deterministic, _num_pairs(pairs))
    return arguments.expand_call(plan, buf4, lora_b, bias, lora_ranks, meta_args, y, offsets, _torch_strides, pairs,
                                 b_scales)


def _fused_call(y, x, lora_a, lora_b, meta_args, scale, offsets, lora_ranks, bias, config=None, pairs=None,
                a_scales=None, b_scales=None):
    """(workspace, call) of the fused launch of slices lora_a / lora_b (the workspace allocated here)."""
    T, H = x.shape
    L, R, _ = lora_a[0].shape
    widths = tuple(int(b.shape[1]) for b in lora_b)
    plan = _fused_plan(T, H, R, widths, meta_args.active_lora_ids.shape[0], L, _dtype_name(x), _dtype_name(lora_a[0]),
                       arguments.bias_flags(bias, len(lora_b)), lora_ranks is not None, _key(config),
                       _num_pairs(pairs))
    ws = torch.empty(plan.workspace_shape, dtype=torch.float32, device=x.device)
    sync = _sync_buffer(x.device, torch._C._cuda_getCurrentRawStream(x.device.index) if x.is_cuda else 0,
                        plan.sync_ints)
    return ws, arguments.fused_call(plan, x, lora_a, lora_b, bias, lora_ranks, meta_args, y, sync, ws, scale,
                                    offsets, _torch_strides, pairs, a_scales, b_scales)


def _linear_chunks(y, x, lora_a, lora_b, meta_args, scale, offsets, lora_ranks, bias, fused,
                   shrink_config=None, expand_config=None, fused_config=None, deterministic=False, pairs=None,
                   a_scales=None, b_scales=None):
    """add_lora_linear's launches, per chunk of <= MAX_SLICES slices: (workspace, [calls]).
    Each chunk's workspace is allocated here; its launches must be enqueued before the next chunk.
    With adapter pairs the workspace's rank axis holds k * r columns. a_scales / b_scales: the fp8
    weights' channel scales per slice (None where 16-bit)."""
    T = x.shape[0]
    R = lora_a[0].shape[1]
    for lo, hi in slice_chunks(len(lora_a), lora_a, lora_b):
        chunk_bias = None if bias is None else tuple(bias[lo:hi])
        if fused:
            ws, call = _fused_call(y, x, lora_a[lo:hi], lora_b[lo:hi], meta_args, scale, offsets[lo:hi], lora_ranks,
                                   chunk_bias, config=fused_config, pairs=pairs, a_scales=_part(a_scales, lo, hi),
                                   b_scales=_part(b_scales, lo, hi))
            yield ws, [call]
            continue
        plan = _plan_for_shrink(x, lora_a[lo:hi], meta_args, lora_ranks, True, True, shrink_config, deterministic,
                                pairs)
        ws = torch.empty((plan.num_partials, hi - lo, T, R * max(1, _num_pairs(pairs))), dtype=torch.float32,
                         device=x.device)
        yield ws, [_shrink_call(x, lora_a[lo:hi], ws, meta_args, scale, lora_ranks, plan, pairs,
                                _part(a_scales, lo, hi)),
                   _expand_call(ws, lora_b[lo:hi], y, meta_args, offsets[lo:hi], True, lora_ranks, chunk_bias,
                                config=expand_config, pdl=plan.constexprs["USE_PDL"], deterministic=deterministic,
                                pairs=pairs, b_scales=_part(b_scales, lo, hi))]


# ------------------------------------------------------------------------------------- prepared linear
# What changes between two `add_lora_linear` calls of one layer in one step shape is only x, y,
# lora_ranks and scale (and the stream, whose workspace and barrier counters a call uses).
# `PreparedLinear` builds each launch's argument list once and fills in those values per call: no
# plan lookups, stride tuples, launch keys or allocations.

# The variable arguments of a launch, by kernel argument name: index into the per-call values
# (x pointer, y pointer, lora_ranks pointer, workspace pointer, scale, barrier counters pointer).
_X, _Y, _RANKS, _WS, _SCALE, _SYNC = range(6)
_VARIABLE_ARGS = {
    "lora_shrink_kernel": {"x_ptr": _X, "ranks_ptr": _RANKS, "scale": _SCALE, "out_ptr": _WS},
    "lora_expand_kernel": {"buf_ptr": _WS, "ranks_ptr": _RANKS, "y_ptr": _Y, "out_ptr": _Y},
    "lora_fused_kernel": {"x_ptr": _X, "ranks_ptr": _RANKS, "scale": _SCALE, "y_ptr": _Y, "out_ptr": _Y,
                          "ws_ptr": _WS, "sync_ptr": _SYNC},
}


class PreparedLinear:
    """`linear` for fixed persistent arguments (weights, bias, metadata views, slice offsets) and
    the activation layout of its first call (x and y shapes, strides, dtypes; lora_ranks given or
    not; calls with another layout take the generic path).

    `prepared(y, x, scale, lora_ranks)` == `linear(y, x, lora_a, lora_b, meta_args, scale,
    offsets, lora_ranks, bias)` for any x, y of that layout. The first call goes through `linear`
    (compiling); after it each launch's argument list is kept with the fixed arguments as data
    pointers, and a call only fills in the pointers of x, y, lora_ranks and the current stream's
    float32 workspace (`_workspace_buffer`: shared by every PreparedLinear on that stream, nothing
    allocated per call: a torch.empty there would add its host time to every call), and the scale.
    Falls back to `linear` for 16-byte-misaligned x/y/lora_ranks (Triton specialises on alignment),
    under the interpreter, or when the direct launch is off.

    The persistent tensors' data pointers are taken once: their storage must not be replaced
    (in-place updates of their contents are fine). The caller keys a PreparedLinear by the
    tensors' identities and the layout (torch_lora.PunicaWrapper does).
    """

    __slots__ = ("_args", "_device", "_layout", "_steps", "_tries", "_c_steps", "_c_vars", "_c_scale",
                 "_sync_ints", "_ws_floats", "_ws_stream", "_ws_ptr")

    def __init__(self, lora_a, lora_b, meta_args, offsets, bias=None, *, fused: bool | None = None,
                 deterministic: bool = False, pairs=None, a_scales=None, b_scales=None):
        _check_fused_deterministic(fused, deterministic)
        self._args = (tuple(lora_a), tuple(lora_b), meta_args, tuple(offsets), bias, fused, deterministic, pairs,
                      a_scales, b_scales)
        self._steps = None
        self._layout = None
        self._device = lora_a[0].device.index
        self._tries = 0
        self._c_steps = None      # per chunk of _steps: its cuda_launch.PreparedLaunches
        self._c_vars = None       # ctypes uint64[6]: the per-call values (_X.._SYNC)
        self._sync_ints = 0       # barrier words of the fused launches (0: none)
        self._c_scale = None
        self._ws_floats = 0       # the largest chunk's workspace (floats; chunks run one after another)
        self._ws_stream = None    # the stream of the last call, and its workspace's address
        self._ws_ptr = 0

    def __call__(self, y: torch.Tensor, x: torch.Tensor, scale: float, lora_ranks: torch.Tensor | None = None):
        steps = self._steps
        if steps is not None and (x.shape, x.stride(), x.dtype, y.shape, y.stride(), y.dtype,
                                  lora_ranks is None) == self._layout:
            xp, yp = x.data_ptr(), y.data_ptr()
            rp = lora_ranks.data_ptr() if lora_ranks is not None else 0
            if not (xp | yp | rp) & 15:
                stream = torch._C._cuda_getCurrentRawStream(self._device)
                c_steps = self._c_steps          # launched from C (lora_core/kernels/cuda_launch.c)
                if c_steps is not None:
                    vals = self._c_vars
                    vals[_X], vals[_Y], vals[_RANKS] = xp, yp, rp
                    if scale != self._c_scale:
                        vals[_SCALE] = c_launch.float_bits(scale)
                        self._c_scale = scale
                else:
                    vals = [xp, yp, rp, 0, scale, 0]
                if self._sync_ints:
                    vals[_SYNC] = _sync_buffer(x.device, stream, self._sync_ints).data_ptr()
                if stream != self._ws_stream:
                    # (buffers are never freed, so the address stays valid for this stream)
                    self._ws_ptr = _workspace_buffer(x.device, stream, self._ws_floats).data_ptr()
                    self._ws_stream = stream
                vals[_WS] = self._ws_ptr
                for i, (_ws_shape, launches) in enumerate(steps):
                    if c_steps is not None:
                        c_steps[i].launch(stream, vals)
                    else:
                        for run, g0, g1, g2, function, packed, template, slots, _, _, _ in launches:
                            args = template.copy()
                            for pos, v in slots:
                                args[pos] = vals[v]
                            run(g0, g1, g2, stream, function, packed, None, None, None, *args)
                return
        if x.shape[0] == 0:
            return
        lora_a, lora_b, meta_args, offsets, bias, fused, deterministic, pairs, a_scales, b_scales = self._args
        T = x.shape[0]
        if fused is None:
            fused = configs.use_fused(T, lora_a[0].shape[1], len(lora_a), lora_a[0].shape[0],
                                      deterministic=deterministic, w_dtype=_dtype_name(lora_a[0]))
        chunks = []
        for ws, calls in _linear_chunks(y, x, lora_a, lora_b, meta_args, scale, offsets, lora_ranks, bias, fused,
                                        deterministic=deterministic, pairs=pairs, a_scales=a_scales,
                                        b_scales=b_scales):
            for call in calls:
                _launch(call)
            chunks.append((ws, calls))
        if steps is None and self._tries < 2:
            self._tries += 1
            self._steps = self._build(chunks, y, x, lora_ranks)
            self._sync_ints = max([getattr(call.plan, "sync_ints", 0) for _, calls in chunks for call in calls])
            self._ws_floats = max([1] + [ws.numel() for ws, _ in chunks if ws is not None])
            self._ws_stream = None
            self._layout = (x.shape, x.stride(), x.dtype, y.shape, y.stride(), y.dtype, lora_ranks is None)
            self._c_steps = c_launch.prepared_launches(self._steps, self._device)
            if self._c_steps is not None:
                self._c_vars = (ctypes.c_uint64 * 6)()
                self._c_scale = None

    @staticmethod
    def _build(chunks, y, x, lora_ranks):
        """The per-chunk (workspace shape, launches) of the direct path, or None if it cannot be used."""
        if not _FAST[0]:
            return None
        var_ptrs = {x.data_ptr(): _X, y.data_ptr(): _Y}
        if lora_ranks is not None:
            var_ptrs[lora_ranks.data_ptr()] = _RANKS
        steps = []
        for ws, calls in chunks:
            if ws is not None:
                var_ptrs = {**var_ptrs, ws.data_ptr(): _WS}
            for call in calls:
                if getattr(call.plan, "sync_ints", 0):
                    var_ptrs = {**var_ptrs, call.pointers[-2].data_ptr(): _SYNC}
            launches = []
            for call in calls:
                key, misaligned = _compiled_key(call)
                c = _COMPILED.get(key)
                if c is None or misaligned:
                    return None
                args = call.args
                names = call.kernel.arg_names[:len(args)]
                variable = _VARIABLE_ARGS[call.kernel.__name__]
                template, slots = [], []
                for pos, (name, v) in enumerate(zip(names, args)):
                    which = variable.get(name)
                    if isinstance(v, torch.Tensor):
                        ptr = v.data_ptr()
                        if which is None and ptr in var_ptrs:
                            return None        # a persistent tensor aliases an activation
                        if which is not None and var_ptrs.get(ptr) == which:
                            slots.append((pos, which))
                            v = 0
                        elif which is not None and which != _RANKS:
                            return None        # unexpected layout: keep the generic path
                        else:
                            v = ptr
                    elif which == _SCALE:
                        slots.append((pos, which))
                    template.append(v)
                template.extend(c[1])
                grid = call.plan.grid
                compiled = c[0]
                launches.append((compiled.run, grid[0], grid[1], grid[2] if len(grid) > 2 else 1,
                                 compiled.function, compiled.packed_metadata, template, tuple(slots),
                                 compiled, names, call.plan))
            steps.append((None if ws is None else tuple(ws.shape), tuple(launches)))
        return tuple(steps)


# ------------------------------------------------------------------------------------- backend API

def shrink(x: torch.Tensor, lora_a: Sequence[torch.Tensor], out: torch.Tensor, meta_args, scale: float,
           lora_ranks: torch.Tensor | None = None, *, config: dict | None = None,
           deterministic: bool = False, pairs=None, a_scales=None) -> None:
    """out[s, t] = scale * x[t] @ lora_a[s][idx[t]].T (float32, 0 for tokens without LoRA); fp8 A_s:
    times a_scales[s][idx[t]] (its (L, r) float32 channel scales).
    deterministic: batch-invariant launches (configs.deterministic_config; unsplit, no atomics).
    pairs: several adapters per token (lora_core.adapter_pairs): out (S, T, k * r), pair j's
    weighted product at columns j*r..(j+1)*r."""
    if x.shape[0] == 0:
        return
    for lo, hi in slice_chunks(len(lora_a), lora_a):
        plan = _plan_for_shrink(x, lora_a[lo:hi], meta_args, lora_ranks, False, False, config, deterministic,
                                pairs)
        if plan.atomic:
            out[lo:hi].zero_()                       # split-K adds atomically into zeros
        _launch(_shrink_call(x, lora_a[lo:hi], out[lo:hi], meta_args, scale, lora_ranks, plan, pairs,
                             _part(a_scales, lo, hi)))


def expand(buf: torch.Tensor, lora_b: Sequence[torch.Tensor], y: torch.Tensor, meta_args,
           offsets: Sequence[int], add_inputs: bool, lora_ranks: torch.Tensor | None = None,
           bias=None, *, config: dict | None = None, deterministic: bool = False, col_scale=None,
           pairs=None, b_scales=None) -> None:
    """y[t, off_s:off_s+n_s] = (y if add_inputs else 0) + buf[s, t] @ lora_b[s][idx[t]].T + bias, times
    col_scale[s][idx[t]] where given (DoRA). deterministic: batch-invariant launches. pairs: several
    adapters per token, summed (buf (S, T, k * r) from `shrink`; no bias or col_scale). b_scales:
    per slice None or the (L, n_s) float32 channel scales of an fp8 B_s (its product times them)."""
    if y.shape[0] == 0:
        return
    bias = arguments.epilogue(bias, col_scale, len(lora_b))
    buf4 = buf if buf.dim() == 4 else buf[None]
    for lo, hi in slice_chunks(len(lora_b), lora_b):
        _launch(_expand_call(buf4[:, lo:hi], lora_b[lo:hi], y, meta_args, tuple(offsets[lo:hi]), add_inputs,
                             lora_ranks, None if bias is None else tuple(bias[lo:hi]), config=config,
                             deterministic=deterministic, pairs=pairs, b_scales=_part(b_scales, lo, hi)))


def linear(y: torch.Tensor, x: torch.Tensor, lora_a: Sequence[torch.Tensor], lora_b: Sequence[torch.Tensor],
           meta_args, scale: float, offsets: Sequence[int], lora_ranks: torch.Tensor | None = None,
           bias=None, *, fused: bool | None = None, shrink_config: dict | None = None,
           expand_config: dict | None = None, fused_config: dict | None = None,
           deterministic: bool = False, col_scale=None, pairs=None, a_scales=None, b_scales=None) -> None:
    """add_lora_linear's math in place: y[t, slice s] += (scale * x[t] @ A_s[idx].T) @ B_s[idx].T + bias_s[idx].

    One launch (fused kernel) when `configs.use_fused` says so for this size (or fused=True), else
    a split-K shrink into a float32 workspace and an expand that sums its planes (launched as a
    programmatic dependent of the shrink on Hopper). deterministic=True: always shrink + expand
    with the batch-invariant configs (configs.deterministic_config); fused=True is then an error.
    pairs: several adapters per token (lora_core.adapter_pairs), summed, on either path.
    a_scales / b_scales: per slice None or the channel scales of an fp8 A_s (L, r) / B_s (L, n_s).
    """
    _check_fused_deterministic(fused, deterministic)
    T = x.shape[0]
    if T == 0:
        return
    bias = arguments.epilogue(bias, col_scale, len(lora_b))
    if fused is None:
        fused = configs.use_fused(T, lora_a[0].shape[1], len(lora_a), lora_a[0].shape[0],
                                  deterministic=deterministic, w_dtype=_dtype_name(lora_a[0]))
    for _ws, calls in _linear_chunks(y, x, lora_a, lora_b, meta_args, scale, tuple(offsets), lora_ranks, bias,
                                     fused, shrink_config, expand_config, fused_config, deterministic, pairs,
                                     a_scales, b_scales):
        for call in calls:
            _launch(call)


def prepare_linear(lora_a: Sequence[torch.Tensor], lora_b: Sequence[torch.Tensor], meta_args,
                   offsets: Sequence[int], bias=None, *, deterministic: bool = False,
                   col_scale=None, pairs=None, a_scales=None, b_scales=None) -> PreparedLinear:
    """`linear` with its persistent arguments bound, for repeated calls (see PreparedLinear);
    col_scale (DoRA, as in `linear`) is bound too: its tensors are read in place at every call;
    pairs (several adapters per token, lora_core.adapter_pairs) too: their tables are read in place;
    so are a_scales / b_scales (fp8 weights' channel scales)."""
    return PreparedLinear(lora_a, lora_b, meta_args, offsets, arguments.epilogue(bias, col_scale, len(lora_b)),
                          deterministic=deterministic, pairs=pairs, a_scales=a_scales, b_scales=b_scales)


def _check_fused_deterministic(fused: bool | None, deterministic: bool) -> None:
    if fused and deterministic:
        raise ValueError("fused=True cannot be deterministic: deterministic launches always run shrink + "
                         "expand (one kernel path for every token count); pass fused=None or False")


def deterministic_backend():
    """This backend with batch-invariant launches (`deterministic=True` bound): what
    torch_lora.ops.dispatch hands out for deterministic=True."""
    return _DETERMINISTIC


from .moe_triton import fused_moe_lora  # noqa: E402 - the MoE LoRA op of this backend

_DETERMINISTIC = types.SimpleNamespace(
    NAME=NAME, deterministic=True,
    shrink=functools.partial(shrink, deterministic=True), expand=functools.partial(expand, deterministic=True),
    linear=functools.partial(linear, deterministic=True),
    prepare_linear=functools.partial(prepare_linear, deterministic=True),
    fused_moe_lora=functools.partial(fused_moe_lora, deterministic=True))
