"""The one kernel-argument builder (lora_core.kernels.arguments): every launcher's parameter list.

The builder's positional lists must line up with each kernel's signature (the launchers pass them
positionally, the C launcher and the FFI handler by position too), and the alignment hint must be
set exactly when every hinted integer is a multiple of 16.

Plain Python on the CPU.
"""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("triton")

from lora_core.kernels import arguments, plan_expand, plan_fused, plan_shrink
from lora_core.kernels.launch import HostArray, host_strides


def _arrays(T=8, H=256, R=16, L=4, widths=(128, 64), dtype=np.float32):
    rng = np.random.default_rng(0)
    x = HostArray(rng.standard_normal((T, H)).astype(dtype))
    a = [HostArray(rng.standard_normal((L, R, H)).astype(dtype)) for _ in widths]
    b = [HostArray(rng.standard_normal((L, n, R)).astype(dtype)) for n in widths]
    y = HostArray(np.zeros((T, sum(widths) + 16), dtype))
    meta = [HostArray(np.zeros(n, np.int32)) for n in (T, T, L + 1, L + 2, L + 1)]
    return x, a, b, y, meta


def _free_names(kernel, plan):
    return [n for n in kernel.arg_names if n not in plan.constexprs]


def test_every_builder_follows_its_kernels_signature():
    x, a, b, y, meta = _arrays()
    bias = (HostArray(np.zeros((4, 128), np.float32)), None)
    cfg = dict(BLOCK_M=16, BLOCK_K=64, SPLIT_K=2, BLOCK_N=64, num_warps=4, num_stages=2)
    shrink_plan = plan_shrink(8, 256, 16, 2, 5, "float32", "float32", cfg, lora_only=True, workspace=True,
                              has_ranks=False)
    out = HostArray(np.zeros((shrink_plan.num_partials, 2, 8, 16), np.float32))
    shrink = arguments.shrink_call(shrink_plan, x, a, None, meta, 0.5, out, host_strides)
    names = _free_names(shrink.kernel, shrink_plan)
    assert len(shrink.args) == len(names)
    assert dict(zip(names, shrink.args))["out_ptr"] is out
    assert shrink.named_scalars()["hidden"] == 256 and shrink.named_scalars()["stride_a1_slot"] == 16 * 256
    expand_plan = plan_expand(8, 16, (128, 64), 5, shrink_plan.num_partials, "float32", "float32", cfg,
                              add_inputs=True, bias_flags=(True, False), has_ranks=False)
    expand = arguments.expand_call(expand_plan, out, b, bias, None, meta, y, (0, 144), host_strides)
    named = dict(zip(_free_names(expand.kernel, expand_plan), expand.args))
    assert len(expand.args) == len(_free_names(expand.kernel, expand_plan))
    assert named["y_ptr"] is y and named["out_ptr"] is y and named["bias0_ptr"] is bias[0]
    # a missing bias: an unread dummy of the present biases' dtype (the kernels' tl.where picks among them)
    assert named["bias1_ptr"] is bias[0] and named["stride_bias1_slot"] == 0
    assert arguments.expand_call(expand_plan, out, b, None, None, meta, y, (0, 144), host_strides).args[
        _free_names(expand.kernel, expand_plan).index("bias0_ptr")] is b[0]              # no bias at all: B
    mixed = (bias[0], arguments.ColumnScale(HostArray(np.ones((4, 64), np.float16))))
    with pytest.raises(ValueError, match=r"must share one dtype .* float32 \(slice 0\), float16 \(slice 1\)"):
        arguments.expand_call(expand_plan, out, b, mixed, None, meta, y, (0, 144), host_strides)
    assert (named["width0"], named["width1"], named["width2"], named["offset1"]) == (128, 64, 0, 144)
    fused_plan = plan_fused(8, 256, 16, (128, 64), 5, "float32", "float32", cfg, add_inputs=True,
                            bias_flags=(True, False), has_ranks=True)
    sync = HostArray(np.zeros(fused_plan.sync_ints, np.int32))
    ws = HostArray(np.zeros(fused_plan.workspace_shape, np.float32))
    ranks = HostArray(np.full(4, 16, np.int32))
    fused = arguments.fused_call(fused_plan, x, a, b, bias, ranks, meta, y, sync, ws, 0.5, (0, 144), host_strides)
    named = dict(zip(_free_names(fused.kernel, fused_plan), fused.args))
    assert len(fused.args) == len(_free_names(fused.kernel, fused_plan))
    assert named["sync_ptr"] is sync and named["ws_ptr"] is ws and named["ranks_ptr"] is ranks
    assert named["a2_ptr"] is a[0] and named["stride_a3_hidden"] == 1       # unused slices repeat slice 0


@pytest.mark.parametrize("hidden, aligned", [(256, True), (200, False)])
def test_the_alignment_hint_follows_the_hinted_integers(hidden, aligned):
    x, a, _, _, meta = _arrays(H=hidden)
    cfg = dict(BLOCK_M=16, BLOCK_K=64, SPLIT_K=1, num_warps=4, num_stages=2)
    plan = plan_shrink(8, hidden, 16, 2, 5, "float32", "float32", cfg, lora_only=False, workspace=False,
                       has_ranks=False)
    out = HostArray(np.zeros((1, 2, 8, 16), np.float32))
    call = arguments.shrink_call(plan, x, a, None, meta, 0.5, out, host_strides)
    assert not call.plan.constexprs["ALIGNED"]
    hinted = call.with_alignment_hints()
    assert hinted.plan.constexprs["ALIGNED"] == aligned
    assert hinted.args == call.args and call.plan.constexprs["ALIGNED"] is False
