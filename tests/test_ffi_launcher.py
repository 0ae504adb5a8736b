"""The C launcher (lora_core/kernels/cuda_launch.c) and the JAX side's FFI launcher, without a GPU.

What runs here: the handler library builds with the machine's C compiler against jaxlib's FFI
headers and Triton's cuda.h; registered on the CPU platform, XLA calls it and it reports malformed
calls and missing kernels as errors (the attribute decoding and the error path of the C code);
loading a kernel without a CUDA driver fails with a message; and the parameter list handed to
the handler matches the kernel's signature the way Triton's JIT specialises it. Launching the
compiled kernels is covered on the GPU (tests/test_gpu_triton.py, JAX cases).
"""

from __future__ import annotations

import ctypes
import itertools
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_lora.ops import ffi_launcher
from lora_core.kernels import cuda_launch

_NAMES = itertools.count()


@pytest.fixture(scope="module")
def library(tmp_path_factory):
    try:
        path = cuda_launch.build_library(True, str(tmp_path_factory.mktemp("ffi")))
    except (RuntimeError, ImportError) as e:  # no C compiler / no Triton CUDA headers here
        pytest.skip(str(e))
    return cuda_launch.declare(ctypes.CDLL(path))


def _probe(library):
    name = f"jax_lora_ffi_probe_{next(_NAMES)}"
    jax.ffi.register_ffi_target(name, jax.ffi.pycapsule(library.jl_triton_launch), platform="cpu")
    return jax.ffi.ffi_call(name, jax.ShapeDtypeStruct((4,), jnp.float32))


def _cpu_ones():
    """The probe's operand on a CPU device (the probe handler is registered for the CPU platform)."""
    return jax.device_put(np.ones(4, np.float32), jax.devices("cpu")[0])


def test_the_handler_rejects_inconsistent_attributes(library):
    call = _probe(library)
    with pytest.raises(Exception, match="inconsistent"):
        call(_cpu_ones(), kernels=np.array([5], np.int64), launch=np.ones(7, np.int64),
             params=np.zeros(2, np.int64)).block_until_ready()


def test_the_handler_reports_kernels_that_were_never_loaded(library):
    call = _probe(library)
    with pytest.raises(Exception, match="no kernel was registered|not loaded"):
        call(_cpu_ones(), kernels=np.array([5], np.int64), launch=np.ones(8, np.int64),
             params=np.zeros(0, np.int64)).block_until_ready()


def test_loading_a_kernel_without_a_driver_or_a_valid_cubin_fails_with_a_message(library):
    err = ctypes.create_string_buffer(512)
    rc = library.jl_load_kernel(7, b"\x00" * 64, b"not_a_kernel", 0, 0, err, len(err))
    assert rc == -1
    assert err.value.startswith(b"jax_lora ffi launcher:"), err.value
    assert library.jl_load_kernel(0, b"", b"k", 0, 0, err, len(err)) == -1   # id 0 is reserved
    assert b"bad kernel id" in err.value


def _shrink_launch(T: int = 8):
    from jax_lora.meta import LoRAKernelMeta
    from jax_lora.ops import triton as jax_triton_backend
    H, R, L = 256, 16, 4
    x = jnp.zeros((T, H), jnp.bfloat16)
    a = [jnp.zeros((L, R, H), jnp.bfloat16) for _ in range(3)]
    meta = LoRAKernelMeta.build(np.resize(np.array([0, 1, 1, -1, 2, 0, 3, 3], np.int32), T), L, T)
    return jax_triton_backend._shrink_launch(x, a, meta, 0.5, None, workspace=True,
                                             config=dict(BLOCK_M=16, BLOCK_K=64, SPLIT_K=2, num_warps=4, num_stages=2))


def _result_shape(result):
    return jax.ShapeDtypeStruct(result.shape, result.dtype)


def _launch_of(launch):
    """(ffi_launcher.Launch, operands) of one launch as the JAX backend hands it to the handler:
    arrays become operands, placeholders results or the handler's counters, `out` its result."""
    from jax_lora.ops import triton as jax_triton_backend
    ffi, operands, _aliases = jax_triton_backend._ffi_launches([launch])
    return ffi[0], operands


@pytest.mark.parametrize("T", [8, 32])
def test_parameters_follow_the_kernel_signature_as_triton_specialises_it(T):
    shrink = _shrink_launch(T)
    launch, operands = _launch_of(shrink)
    results = [_result_shape(shrink.call.out)]
    sig, consts, attrs, passed = ffi_launcher._specialise(launch, operands, results)
    names = shrink.call.kernel.arg_names
    assert list(sig) == list(names)
    for name, v in zip([n for n in names if n not in shrink.call.plan.constexprs], launch.params):
        i = names.index(name)
        if isinstance(v, ffi_launcher.Arg):
            assert sig[name] == "*" + ffi_launcher._triton_type(operands[v.index].dtype)
            assert attrs[(i,)] == [["tt.divisibility", 16]]
        elif isinstance(v, ffi_launcher.Out):
            assert sig[name] == "*fp32" and name == "out_ptr"
        elif isinstance(v, float):
            assert sig[name] == "fp32"
        elif v == 1:                                    # Triton's JIT makes ints equal to 1 constants
            assert sig[name] == "constexpr" and consts[(i,)] == 1
        else:
            assert sig[name] == "i32"
            hinted = v % 16 == 0 and name not in ("num_tokens", "num_sorted")   # do_not_specialize_on_alignment
            assert ((i,) in attrs) == hinted, name
    assert sig["out_ptr"] == "*fp32"
    kinds = [k for k, _ in passed]
    n_free = sum(1 for n in names if sig[n] != "constexpr")
    assert len(passed) == n_free
    assert kinds[0] == ffi_launcher._ARG and passed[-1] == (ffi_launcher._OUT, 0)
    scale = passed[[n for n in names if sig[n] != "constexpr"].index("scale")]
    assert scale == (ffi_launcher._F32, int(np.array(0.5, np.float32).view(np.int32)))


def test_the_fused_kernel_gets_the_persistent_barrier_counters_not_a_result():
    """Its barrier counters are the handler's zeroed-once buffer (kind COUNTERS, *i32), so the call
    has no per-call memset; its workspace is result 1."""
    from jax_lora.meta import LoRAKernelMeta
    from jax_lora.ops import triton as jax_triton_backend
    T, H, R, L = 8, 256, 16, 4
    x = jnp.zeros((T, H), jnp.bfloat16)
    y = jnp.zeros((T, 192), jnp.bfloat16)
    a = [jnp.zeros((L, R, H), jnp.bfloat16) for _ in range(2)]
    b = [jnp.zeros((L, n, R), jnp.bfloat16) for n in (128, 64)]
    meta = LoRAKernelMeta.build(np.array([0, 1, 1, -1, 2, 0, 3, 3], np.int32), L, T)
    fused = jax_triton_backend._fused_launch(
        y, x, a, b, meta, 0.5, (0, 128), None, None,
        config=dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=64, SPLIT_K=2, num_warps=4, num_stages=2))
    workspace = fused.call.pointers[-1]
    assert workspace.index == 1
    launch, operands = _launch_of(fused)
    sig, _, attrs, passed = ffi_launcher._specialise(launch, operands, [jax.ShapeDtypeStruct(y.shape, y.dtype),
                                                             _result_shape(workspace)])
    free = [n for n in fused.call.kernel.arg_names if sig[n] != "constexpr"]
    assert sig["sync_ptr"] == "*i32" and sig["ws_ptr"] == "*fp32"
    assert passed[free.index("sync_ptr")] == (ffi_launcher._COUNTERS, 0)
    assert passed[free.index("ws_ptr")] == (ffi_launcher._OUT, 1)
    assert fused.call.plan.sync_ints == fused.call.plan.grid[1]


def test_a_kernel_writing_mid_list_gets_its_results_in_place_of_those_parameters():
    """The MoE kernel writes its rank buffer and y, pointer parameters in the middle of its list:
    both launches (shrink, expand) of one call pass result 1 as buf_ptr and result 0 as y_ptr, y's
    operand is aliased to result 0 (updated in place), and nothing follows the scalars; the
    jax_triton launcher, which appends outputs after the inputs, refuses such launches."""
    from jax_lora.ops import triton as jax_triton_backend
    from jax_lora.ops.moe_layout import align_layout
    from jax_lora.ops.triton_moe import moe_launches
    M, K, E, L, R, H, N = 8, 2, 4, 3, 16, 64, 48
    ids = jnp.asarray(np.arange(M * K, dtype=np.int32).reshape(M, K) % E)
    layout = align_layout(ids, jnp.asarray(np.arange(M, dtype=np.int32) % L), E, 16, L)
    y3 = jnp.zeros((M, K, N), jnp.bfloat16)
    x = jnp.zeros((M, H), jnp.bfloat16)
    a = [jnp.zeros((L, E, R, H), jnp.bfloat16) for _ in range(2)]
    b = [jnp.zeros((L, E, N // 2, R), jnp.bfloat16) for _ in range(2)]
    launches, results = moe_launches(y3, x, a, b, None, layout, (0, N // 2), None)
    ffi, operands, aliases = jax_triton_backend._ffi_launches(launches)
    assert [ln.constexprs["PHASE"] for ln in ffi] == [0, 1] and len(results) == 2
    y_operand = next(i for i, v in enumerate(operands) if v.shape == (M * K, N))
    assert aliases == {y_operand: 0}
    for ln in ffi:
        sig, _, _, passed = ffi_launcher._specialise(ln, operands, results)
        free = [n for n in ln.kernel.arg_names if sig[n] != "constexpr"]
        assert passed[free.index("buf_ptr")] == (ffi_launcher._OUT, 1)
        assert passed[free.index("y_ptr")] == (ffi_launcher._OUT, 0)
        assert sig["buf_ptr"] == "*fp32" and sig["y_ptr"] == "*bf16"
        assert len(passed) == len(free) and passed[-1][0] != ffi_launcher._OUT
    assert jax_triton_backend.writes_mid_list(launches)
    with pytest.raises(NotImplementedError, match="writes mid-list"):
        jax_triton_backend._run_jax_triton(launches, results)


def test_counter_allocation_without_a_driver_fails_with_a_message(library):
    err = ctypes.create_string_buffer(512)
    assert library.jl_ensure_counters(-1, 4, err, len(err)) == -1
    assert b"bad device" in err.value
    rc = library.jl_ensure_counters(0, 4, err, len(err))
    assert rc == 0 or err.value.startswith(b"jax_lora ffi launcher:"), err.value


def test_a_parameter_count_that_does_not_match_the_kernel_is_an_error():
    shrink = _shrink_launch()
    launch = ffi_launcher.Launch(shrink.call.kernel, shrink.call.plan.grid, 4, 2, shrink.call.plan.constexprs,
                                 (ffi_launcher.Arg(0),))
    with pytest.raises(ValueError, match="non-constexpr"):
        ffi_launcher._specialise(launch, [shrink.call.pointers[0]], [_result_shape(shrink.call.out)])


def test_the_launcher_choice_is_validated(monkeypatch):
    monkeypatch.setenv("JAX_LORA_TRITON_LAUNCHER", "cuda_graphs")
    with pytest.raises(ValueError, match="JAX_LORA_TRITON_LAUNCHER"):
        ffi_launcher.launcher_choice()
    monkeypatch.setenv("JAX_LORA_TRITON_LAUNCHER", "jax_triton")
    assert ffi_launcher.launcher_choice() == "jax_triton"


def test_the_cpu_never_selects_the_ffi_launcher():
    if any(d.platform == "gpu" for d in jax.local_devices()):
        pytest.skip("a GPU is present")
    ffi_launcher.unavailable_reason.cache_clear()
    assert not ffi_launcher.available()
    assert os.path.exists(cuda_launch.SOURCE)


def test_the_plain_library_for_torch_builds_without_xla_headers(tmp_path, monkeypatch):
    monkeypatch.setattr(cuda_launch, "_include_dirs", lambda xla_ffi: list(_triton_include()))
    try:
        path = cuda_launch.build_library(False, str(tmp_path))
    except (RuntimeError, ImportError) as e:
        pytest.skip(str(e))
    lib = cuda_launch.declare(ctypes.CDLL(path))
    assert not hasattr(lib, "jl_triton_launch") or _missing(lib, "jl_triton_launch")


def _triton_include():
    import triton
    return [os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "include")]


def _missing(lib, name):
    try:
        getattr(lib, name)
        return False
    except AttributeError:
        return True


def test_prepared_launches_reject_bad_input_with_a_message(library):
    err = ctypes.create_string_buffer(512)
    kv = (ctypes.c_int64 * 2)(9, 0)                     # kind 9 does not exist
    slots = (ctypes.c_int32 * 2)(0, 0)
    h = library.jl_prepared_new(ctypes.c_void_p(1), 1, 1, 1, 128, 0, 0, 1, kv, 0, slots, err, len(err))
    # without a CUDA driver the driver load fails first; with one, the parameter kind is refused
    assert not h and err.value.startswith((b"jax_lora ffi launcher:", b"jax_lora prepared launch:")), err.value
    with pytest.raises(RuntimeError, match="jax_lora"):
        cuda_launch.PreparedLaunches([(1, (1, 1, 1), 128, 0, False, [(cuda_launch.I32, 5)], [(3, 0)])], lib=library)


def test_torch_prepared_launch_parameters_follow_the_compiled_signature():
    """torch_lora's PreparedLinear hands C each kernel's non-constexpr parameters with their C types
    (from the compiled kernel's signature: pointers, int32, int64, float32), its slots for the
    per-call values, and Triton's two scratch pointers as nulls; an unknown type or a kernel that
    needs scratch memory keeps Triton's launcher."""
    pytest.importorskip("torch")
    from types import SimpleNamespace

    from torch_lora.ops import c_launch as torch_c_launch
    from torch_lora.ops import triton as torch_triton
    names = ["x_ptr", "n", "one", "big", "scale", "out_ptr"]
    sig = {"x_ptr": "*bf16", "n": "i32", "one": "constexpr", "big": "i64", "scale": "fp32", "out_ptr": "*fp32",
           "BLOCK": "constexpr"}
    md = SimpleNamespace(num_warps=4, shared=1024, launch_pdl=True, num_ctas=1, global_scratch_size=0,
                         profile_scratch_size=0)
    compiled = SimpleNamespace(metadata=md, src=SimpleNamespace(signature=sig))
    template = [0, 48, 1, 2 ** 40, 0.5, 0]
    slots = {0: torch_triton._X, 4: torch_triton._SCALE, 5: torch_triton._WS}
    fn, grid, threads, shared, pdl, params, c_slots = torch_c_launch.launch_spec(cuda_launch, compiled, names,
                                                                                 template, slots,
                                                                         (3, 2, 1), 1234)
    assert (fn, grid, threads, shared, pdl) == (1234, (3, 2, 1), 128, 1024, True)
    assert params == [(cuda_launch.PTR, 0), (cuda_launch.I32, 48), (cuda_launch.I64, 2 ** 40), (cuda_launch.F32, 0.5),
                      (cuda_launch.PTR, 0), (cuda_launch.NULL, 0), (cuda_launch.NULL, 0)]
    assert c_slots == [(0, torch_triton._X), (3, torch_triton._SCALE),
                       (4, torch_triton._WS)]     # positions among the passed parameters
    sig["n"] = "bf16"                                                # not a type a launch parameter has here
    assert torch_c_launch.launch_spec(cuda_launch, compiled, names, template, slots, (1, 1, 1), 1) is None
    sig["n"] = "i32"
    md.global_scratch_size = 64
    assert torch_c_launch.launch_spec(cuda_launch, compiled, names, template, slots, (1, 1, 1), 1) is None


def test_torch_c_launch_spreads_a_dependent_decode_shrink(monkeypatch):
    """With its plan, torch's C launch spec follows `pdl_for(spread=True)`: under auto a shrink of
    <= spread_pdl_max_tokens tokens (the launch policy's) is a dependent launch with spread_shared_bytes (after the
    function was allowed that much shared memory), a larger one a plain launch with its own
    shared memory, an expand a dependent with its own; where the function cannot be allowed more,
    the launch keeps its own shared memory (still a dependent)."""
    pytest.importorskip("torch")
    from types import SimpleNamespace

    from lora_core.kernels import configs, plan_expand, plan_shrink, planning
    from torch_lora.ops import c_launch as torch_c_launch
    monkeypatch.delenv("LORA_CORE_PDL", raising=False)
    monkeypatch.setattr(torch_c_launch, "sm_resources", lambda device: (132, 232448))
    allowed = []
    monkeypatch.setattr(torch_c_launch, "allow_shared", lambda cl, fn, m: allowed.append((fn, m)) or True)
    names = ["x_ptr", "n"]
    sig = {"x_ptr": "*bf16", "n": "i32"}
    md = SimpleNamespace(num_warps=4, shared=16384, launch_pdl=False, num_ctas=1, global_scratch_size=0,
                         profile_scratch_size=0)
    compiled = SimpleNamespace(metadata=md, src=SimpleNamespace(signature=sig))

    def spec(plan):
        grid = tuple(plan.grid) + (1,) * (3 - len(plan.grid))
        return torch_c_launch.launch_spec(cuda_launch, compiled, names, [0, 8], {}, grid, 77, plan, 0)

    def shrink(T):
        return plan_shrink(T, 4096, 16, 1, 9, "bfloat16", "bfloat16", configs.shrink_config(T, 4096, 16, 1, 8),
                           lora_only=True, workspace=True, has_ranks=False, pdl=True)

    small, large = shrink(8), shrink(configs.launch_policy().spread_pdl_max_tokens + 1)
    programs = small.grid[0] * small.grid[1] * small.grid[2]
    _, _, _, shared, flags, _, _ = spec(small)
    assert shared == planning.spread_shared_bytes(programs, 16384, 132, 232448) > 16384
    assert flags & cuda_launch.FLAG_PDL and allowed == [(77, 232448)]
    _, _, _, shared, flags, _, _ = spec(large)
    assert (shared, flags & cuda_launch.FLAG_PDL) == (16384, 0)
    expand = plan_expand(8, 16, (4096,), 9, small.num_partials, "bfloat16", "bfloat16",
                         configs.expand_config(8, 4096, 16, 1, 8), add_inputs=True, bias_flags=(0,), has_ranks=False,
                         pdl=True)
    _, _, _, shared, flags, _, _ = spec(expand)
    assert shared == 16384 and flags & cuda_launch.FLAG_PDL
    monkeypatch.setattr(torch_c_launch, "allow_shared", lambda cl, fn, m: False)
    _, _, _, shared, flags, _, _ = spec(small)
    assert shared == 16384 and flags & cuda_launch.FLAG_PDL
    monkeypatch.setattr(torch_c_launch, "sm_resources", lambda device: None)    # a Triton that cannot tell
    _, _, _, shared, flags, _, _ = spec(small)
    assert shared == 16384 and flags & cuda_launch.FLAG_PDL


def test_torch_sm_resources_say_when_triton_cannot_tell(monkeypatch, caplog):
    """c_launch.sm_resources: None with a warning (not an exception that would turn the C launcher off)
    when Triton's driver utilities cannot give the device's SMs and shared memory."""
    pytest.importorskip("torch")
    import logging

    from torch_lora.ops import c_launch as torch_c_launch

    class Broken:
        def get_device_properties(self, device):
            raise RuntimeError("no such device")

    from types import SimpleNamespace
    fake = SimpleNamespace(runtime=SimpleNamespace(driver=SimpleNamespace(active=SimpleNamespace(utils=Broken()))))
    monkeypatch.setattr(torch_c_launch, "triton", fake)
    torch_c_launch.sm_resources.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger="torch_lora"):
            assert torch_c_launch.sm_resources(0) is None
        assert "spreading dependent shrinks" in caplog.text
    finally:
        torch_c_launch.sm_resources.cache_clear()


@pytest.mark.parametrize("c_launch", [True, False])
def test_prepared_linear_fills_the_per_call_values_for_each_chunk(c_launch, monkeypatch):
    """PreparedLinear's direct path, its Python logic on the CPU: per call it sets x, y, lora_ranks
    and the scale (float32 bits for C), points every chunk at the stream's workspace (one buffer
    per (device, stream), nothing allocated per call) and hands each chunk's launches the values
    -- to C's prepared launches, or into Triton's argument templates. The launchers are recorders
    here; the GPU test runs the real ones (test_prepared_linear_direct_path)."""
    torch = pytest.importorskip("torch")
    import struct

    from torch_lora.ops import triton as torch_triton
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda device: 77, raising=False)
    seen = []

    class Recorder:                                      # stands in for cuda_launch.PreparedLaunches
        def __init__(self, i):
            self.i = i

        def launch(self, stream, vals):
            seen.append((self.i, stream, list(vals)))

    def run(g0, g1, g2, stream, function, packed, h0, h1, h2, *args):   # stands in for CompiledKernel.run
        seen.append((function, stream, list(args)))

    x, y = torch.zeros(4, 8), torch.zeros(4, 16)
    p = torch_triton.PreparedLinear([torch.zeros(2, 4, 8)], [torch.zeros(2, 16, 4)], None, (0,))
    # two chunks: the first with a workspace, the second without (a fused launch)
    template = [0, 0, 5, 0.0]                            # x, workspace, a fixed int, the scale
    slots = ((0, torch_triton._X), (1, torch_triton._WS), (3, torch_triton._SCALE))
    p._steps = (((1, 1, 4, 4), ((run, 1, 1, 1, "f0", None, template, slots, None, None, None),)),
                (None, ((run, 1, 1, 1, "f1", None, [0, 0.0], ((0, torch_triton._Y), (1, torch_triton._SCALE)), None,
                         None, None),)))
    p._layout = (x.shape, x.stride(), x.dtype, y.shape, y.stride(), y.dtype, True)
    p._ws_floats = 16
    torch_triton._WORKSPACES.clear()
    if c_launch:
        import ctypes
        p._c_steps = (Recorder(0), Recorder(1))
        p._c_vars = (ctypes.c_uint64 * 5)()
    for scale in (0.5, 0.5, 2.0):
        seen.clear()
        p(y, x, scale)
        assert len(seen) == 2
        if c_launch:
            bits = struct.unpack("<I", struct.pack("<f", scale))[0]
            (i0, s0, v0), (i1, s1, v1) = seen
            assert (i0, i1, s0, s1) == (0, 1, 77, 77)
            assert v0[torch_triton._X] == x.data_ptr() and v0[torch_triton._Y] == y.data_ptr()
            assert v0[torch_triton._RANKS] == 0
            assert v0[torch_triton._SCALE] == bits and v1[torch_triton._SCALE] == bits
            ws = torch_triton._WORKSPACES[(x.device.index, 77)]
            # the stream's workspace
            assert v0[torch_triton._WS] == ws.data_ptr() and v1[torch_triton._WS] == v0[torch_triton._WS]
        else:
            (f0, _, a0), (f1, _, a1) = seen
            assert (f0, f1) == ("f0", "f1")
            assert a0[0] == x.data_ptr() and a0[1] == torch_triton._WORKSPACES[(x.device.index, 77)].data_ptr()
            assert a0[2] == 5 and a0[3] == scale
            assert a1 == [y.data_ptr(), scale]
    assert torch_triton._WORKSPACES[(x.device.index, 77)].numel() >= 16
    # another stream: its own workspace
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda device: 78, raising=False)
    seen.clear()
    p(y, x, 0.5)
    ws78 = torch_triton._WORKSPACES[(x.device.index, 78)]
    assert ws78.data_ptr() != torch_triton._WORKSPACES[(x.device.index, 77)].data_ptr()
    assert (seen[0][2][torch_triton._WS] if c_launch else seen[0][2][1]) == ws78.data_ptr()
    torch_triton._WORKSPACES.clear()


def test_views_of_stacked_weights_pass_the_stacked_operand_at_byte_offsets():
    """Slices of one stacked weight (jax_lora.nn's layout) reach the handler as one operand and a
    byte offset per slice (kind ARG_AT), never as copies; divisibility only where the offset keeps it."""
    from jax_lora.meta import LoRAKernelMeta
    from jax_lora.ops import triton as backend
    T, H, R, L = 8, 256, 16, 4
    x = jnp.zeros((T, H), jnp.bfloat16)
    stacked = jnp.zeros((3, L, R, H), jnp.bfloat16)
    meta = LoRAKernelMeta.build(np.array([0, 1, 1, -1, 2, 0, 3, 3], np.int32), L, T)
    launch = backend._shrink_launch(x, [backend.view(stacked, (s,)) for s in range(3)], meta, 0.5, None,
                                    workspace=True, config=dict(BLOCK_M=16, BLOCK_K=64, SPLIT_K=2, num_warps=4,
                                                                num_stages=2))
    ffi, operands = _launch_of(launch)
    assert sum(o is stacked for o in operands) == 1 and len(operands) == 7    # x, stacked, 5 metadata
    sig, _, attrs, passed = ffi_launcher._specialise(ffi, operands, [_result_shape(launch.call.out)])
    names = launch.call.kernel.arg_names
    free = [n for n in names if sig[n] != "constexpr"]
    base = next(i for i, o in enumerate(operands) if o is stacked)
    per_slice = L * R * H * 2
    for s in range(4):                                 # slice 3 repeats slice 0 (MAX_SLICES padding)
        kind, value = passed[free.index(f"a{s}_ptr")]
        offset = (s % 3) * per_slice
        assert (kind, value) == ((ffi_launcher._ARG_AT, base | offset << 16) if offset
                                 else (ffi_launcher._ARG, base))
        assert attrs[(names.index(f"a{s}_ptr"),)] == [["tt.divisibility", 16]]
    odd = backend.view(jnp.zeros((5, 3), jnp.bfloat16), (slice(1, 3),))          # 6 bytes in
    assert (odd.offset, odd.shape, odd.strides) == (3, (2, 3), (3, 1))
    assert np.array_equal(odd.materialize(), jnp.zeros((5, 3), jnp.bfloat16)[1:3])
    with pytest.raises(ValueError, match="unit-step"):
        backend.view(stacked, (slice(0, 3, 2),))
    with pytest.raises(ValueError, match="out of range"):
        backend.view(stacked, (3,))
