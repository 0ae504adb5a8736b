"""Warm-up before serving (lora_core.warmup, each side's warmup): argument checks, the twin wrapper
left untouched, and on torch (the Triton interpreter here) every (token count, layer) really run."""

from __future__ import annotations

import io

import numpy as np
import pytest

from lora_core.host_mapping import LoRAMapping
from lora_core.warmup import LinearShape, Progress, check_warmup_arguments, vllm_capture_sizes


def test_vllm_capture_sizes():
    sizes = vllm_capture_sizes(512)
    assert sizes[:5] == [1, 2, 4, 8, 16] and sizes[-1] == 512 and len(sizes) == 67
    assert vllm_capture_sizes(20) == [1, 2, 4, 8, 16]


def test_bad_warmup_arguments_name_what_is_wrong():
    with pytest.raises(TypeError, match=r"layers\[0\] must be a LinearShape"):
        check_warmup_arguments([("x",)], [1], 16)
    with pytest.raises(ValueError, match=r"layers\[1\] must have hidden >= 1"):
        check_warmup_arguments([(8, (4,), 2), (8, (0,), 2)], [1], 16)
    with pytest.raises(ValueError, match="token_counts must be between 1 and max_num_batched_tokens=16"):
        check_warmup_arguments([(8, (4,), 2)], [1, 17], 16)
    with pytest.raises(ValueError, match="at least one"):
        check_warmup_arguments([], [1], 16)
    shapes, counts = check_warmup_arguments([LinearShape(8, (4, 2), 2), (8, [4], 2)], [4, 1, 4], 16)
    assert shapes[1] == LinearShape(8, (4,), 2) and counts == [1, 4]


def test_progress_writes_a_line_per_decile_off_a_terminal():
    out = io.StringIO()
    bar = Progress(20, "warmup", stream=out)
    for _ in range(20):
        bar.step()
    lines = out.getvalue().splitlines()
    assert 10 <= len(lines) <= 11 and lines[-1].startswith("warmup [") and "20/20" in lines[-1]


def test_torch_warmup_runs_every_case_and_leaves_the_wrapper_alone():
    torch = pytest.importorskip("torch")
    pytest.importorskip("triton")
    import torch_lora
    device = "cuda" if torch.cuda.is_available() else "cpu"      # compiled kernels, or the interpreter
    w = torch_lora.PunicaWrapper(16, 4, device, max_loras=3, backend="triton")
    w.update_metadata(LoRAMapping((7, 0, 7), (7, 0, 7)), [None, 7, None], 4, 32)
    before = w.token_lora_indices.clone()
    stats = w.warmup([(32, (16, 8), 8), LinearShape(16, (16,), 4)], [1, 3], dtype=torch.float32,
                     lora_ranks=True, bias=True, progress=False)
    assert stats["calls"] == 4 and stats["token_counts"] == [1, 3]
    assert torch.equal(w.token_lora_indices, before)          # the wrapper's own step is untouched
    with pytest.raises(ValueError, match=r"dtype must be torch.float16, torch.bfloat16 or torch.float32 .*got "
                                         r"torch.int8"):
        w.warmup([(32, (16, 8), 8)], [1], dtype=torch.int8, progress=False)


def test_jax_warmup_lowers_every_case_without_touching_the_wrapper():
    jax = pytest.importorskip("jax")
    import jax.numpy as jnp

    import jax_lora
    w = jax_lora.PunicaWrapper(16, 4, None, max_loras=3, backend="xla")
    w.update_metadata(LoRAMapping((7, 0, 7), (7, 0, 7)), [None, 7, None], 4, 32)
    before = np.asarray(w.token_lora_indices)
    stats = w.warmup([(32, (16, 8), 8)], [2, 8], dtype=jnp.float32, progress=False)
    assert stats["calls"] == 2
    assert np.array_equal(np.asarray(w.token_lora_indices), before)
    with pytest.raises(ValueError, match="dtype must be float16, bfloat16 or float32 .*got int8"):
        w.warmup([(32, (16, 8), 8)], [2], dtype=jnp.int8, progress=False)
    del jax


@pytest.mark.parametrize("side", ["torch", "jax"])
def test_a_deterministic_wrapper_warms_up_its_batch_invariant_launches(side, monkeypatch):
    """The twin that runs the warm-up calls is deterministic exactly when the wrapper is (its
    launches are other kernel variants than the default ones)."""
    if side == "torch":
        torch = pytest.importorskip("torch")
        import torch_lora as lib
        dtype, backend, device = torch.float32, "torch", "cpu"
    else:
        jnp = pytest.importorskip("jax.numpy")
        import jax_lora as lib
        dtype, backend, device = jnp.float32, "xla", None
    built = []
    init = lib.PunicaWrapper.__init__

    def spy(self, *args, **kwargs):
        built.append(kwargs.get("deterministic", False))
        init(self, *args, **kwargs)
    monkeypatch.setattr(lib.PunicaWrapper, "__init__", spy)
    for deterministic in (True, False):
        w = lib.PunicaWrapper(16, 4, device, max_loras=3, backend=backend, deterministic=deterministic)
        built.clear()
        stats = w.warmup([(32, (16, 8), 8)], [2, 5], dtype=dtype, progress=False, workers=0)
        assert stats["calls"] == 2 and built and set(built) == {deterministic}


def test_warmup_groups_keep_each_layer_and_token_class_together():
    from lora_core.kernels.configs import token_class
    from lora_core.warmup import warmup_groups
    shapes = [LinearShape(4096, (4096, 1024, 1024), 16), LinearShape(4096, (4096,), 16),
              LinearShape(4096, (14336, 14336), 16), LinearShape(14336, (4096,), 16)]
    counts = vllm_capture_sizes(512)
    for workers in (1, 3, 16, 64):
        groups = warmup_groups(shapes, counts, workers)
        assert 1 <= len(groups) <= workers
        cases = [(shape, t) for g in groups for shape, ts in g for t in ts]
        assert sorted(cases, key=str) == sorted(((s, t) for s in shapes for t in counts), key=str)   # each once
        owner = {}
        for i, g in enumerate(groups):
            for shape, ts in g:
                for t in ts:
                    assert owner.setdefault((shape, token_class(t)), i) == i      # a pair is never split
    assert len(warmup_groups(shapes, counts, 64)) == len({(s, token_class(t)) for s in shapes for t in counts})


LLAMA_LAYERS = [LinearShape(4096, (4096, 1024, 1024), 16), LinearShape(4096, (4096,), 16),
                LinearShape(4096, (14336, 14336), 16), LinearShape(14336, (4096,), 16)]


def _compiled_variants(shape, num_tokens):
    """The variants one add_lora_linear compiles, as Triton identifies them: kernel, meta-parameters,
    warps, stages and the specialised signature of a real torch launch (benchmarks/compile_launches)."""
    import os
    import sys
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
    import compile_launches
    return frozenset(compile_launches.variant_key(call) for _label, call in
                     compile_launches.launches(num_tokens, shape.rank, shape.slices, 8, 0, hidden=shape.hidden))


def test_case_variants_name_the_variants_a_launch_compiles():
    """case_variants (host planning, no array) splits the cases exactly as Triton's own variant
    identity does, and token counts that differ only in divisibility by 16 share their variants."""
    from lora_core.warmup import case_variants
    counts = [1, 2, 4, 8, 16, 24, 72, 80, 184, 192, 232, 264, 272, 512]
    exact, planned = {}, {}
    for shape in LLAMA_LAYERS:
        for t in counts:
            exact.setdefault(_compiled_variants(shape, t), set()).add((shape, t))
            planned.setdefault(case_variants(shape, t, 8, "bfloat16", device="NVIDIA H200"), set()).add((shape, t))
    def groups(found):        # layers of other shapes may share variants: order the cases by text
        return sorted((sorted(cases, key=str) for cases in found.values()), key=str)
    assert groups(exact) == groups(planned)
    for shape in LLAMA_LAYERS:          # 72 / 80 and 264 / 272: one launch config, one compiled variant
        assert _compiled_variants(shape, 72) == _compiled_variants(shape, 80)
        assert _compiled_variants(shape, 264) == _compiled_variants(shape, 272)
    assert case_variants(LLAMA_LAYERS[0], 8, 8, "bfloat16", device="NVIDIA H200", bias=True) != \
        case_variants(LLAMA_LAYERS[0], 8, 8, "bfloat16", device="NVIDIA H200")


def test_warmup_groups_balance_the_variants_each_group_compiles():
    from lora_core.warmup import case_variants, warmup_groups
    counts = vllm_capture_sizes(512)

    def variants(shape, t):
        return case_variants(shape, t, 8, "bfloat16", device="NVIDIA H200")

    every = set().union(*(variants(s, t) for s in LLAMA_LAYERS for t in counts))
    for workers in (1, 4, 16, 64):
        groups = warmup_groups(LLAMA_LAYERS, counts, workers, variants=variants)
        assert 1 <= len(groups) <= min(workers, len(every))
        cases = [(shape, t) for g in groups for shape, ts in g for t in ts]
        assert sorted(cases, key=str) == sorted(((s, t) for s in LLAMA_LAYERS for t in counts), key=str)
        loads = [set().union(*(variants(shape, t) for shape, ts in g for t in ts)) for g in groups]
        assert set().union(*loads) == every
        # a greedy packing of cases whose variants chain (a case compiles a shrink and an expand
        # variant, each shared with other cases): within one variant of an even share at the
        # default 16 workers, within half an even share plus two elsewhere
        even = -(-len(every) // len(groups))
        bound = even + 1 if workers == 16 else 1.5 * even + 2
        assert max(map(len, loads)) <= bound, [len(x) for x in loads]
    # toy cases: disjoint variant sets spread out; a case whose variants are compiled elsewhere joins that group
    toy = {("a", 1): {1, 2}, ("a", 2): {3, 4}, ("a", 3): {5, 6}, ("a", 4): {1, 2}}
    groups = warmup_groups(["a"], [1, 2, 3, 4], 3, variants=lambda s, t: toy[(s, t)])
    assert sorted(ts for g in groups for _, ts in g) == [[1, 4], [2], [3]]


def test_failed_warmup_workers_are_reported_not_raised(caplog):
    from lora_core.warmup import run_workers
    with caplog.at_level("WARNING", logger="lora_core"):
        results = run_workers("lora_core.no_such_module", [{}, {}], timeout=60)
    assert [r["ok"] for r in results] == [False, False] and "No module named" in results[0]["error"]
    assert "2 of 2 warm-up workers failed" in caplog.text


def test_torch_warmup_workers_compile_in_other_processes_first():
    torch = pytest.importorskip("torch")
    import torch_lora
    w = torch_lora.PunicaWrapper(16, 4, "cpu", max_loras=3, backend="torch")
    stats = w.warmup([(32, (16, 8), 8), LinearShape(16, (16,), 4)], [1, 3, 12, 16], dtype=torch.float32,
                     progress=False, workers=2)
    assert stats["calls"] == 8
    assert len(stats["workers"]) == 2 and all(r["ok"] for r in stats["workers"]), stats["workers"]
    assert w.warmup([(32, (16,), 8)], [1], dtype=torch.float32, progress=False)["workers"] == []   # CPU: none
    with pytest.raises(ValueError, match="workers must be None or an int >= 0"):
        w.warmup([(32, (16,), 8)], [1], workers=-1)


def test_jax_warmup_threads_lower_every_case_once():
    pytest.importorskip("jax")
    import jax.numpy as jnp

    import jax_lora
    w = jax_lora.PunicaWrapper(64, 4, None, max_loras=3, backend="xla")
    stats = w.warmup([(32, (16, 8), 8), (16, (16,), 4)], [1, 2, 24, 40, 64], dtype=jnp.float32, progress=False,
                     workers=4)
    assert stats["calls"] == 10 and stats["workers"] == 4


def test_dora_warmup_runs_the_scaled_variants_on_both_sides():
    """dora=True warms up add_lora_linear with DoRA column scales (the epilogue's other variant);
    bias and dora together are refused by name."""
    torch = pytest.importorskip("torch")
    import jax.numpy as jnp

    import jax_lora
    import torch_lora
    device = "cuda" if torch.cuda.is_available() else "cpu"
    tw = torch_lora.PunicaWrapper(16, 4, device, max_loras=2, backend="torch" if device == "cpu" else "triton")
    stats = tw.warmup([(32, (16, 8), 8)], [1, 3], dtype=torch.float32, dora=True, progress=False)
    assert stats["calls"] == 2
    jw = jax_lora.PunicaWrapper(16, 4, None, max_loras=2, backend="xla")
    assert jw.warmup([(32, (16, 8), 8)], [2], dtype=jnp.float32, dora=True, progress=False)["calls"] == 1
    for w, dtype in ((tw, torch.float32), (jw, jnp.float32)):
        with pytest.raises(ValueError, match="bias and dora cannot both be True"):
            w.warmup([(32, (16, 8), 8)], [1], dtype=dtype, bias=True, dora=True, progress=False)
        with pytest.raises(TypeError, match="dora must be a bool, got str"):
            w.warmup([(32, (16, 8), 8)], [1], dtype=dtype, dora="yes", progress=False)


# vLLM's kernel tests (tests/lora/test_punica_ops.py) as shapes: the hidden sizes of the models vLLM
# serves, each divided by tensor-parallel sizes 1, 2, 8, 16 and 64, at 4 batches of 128 tokens, 4
# adapters, rank 32; and hidden size 2049 at 1-32 batches of 128 tokens, 1-128 adapters, ranks
# 1-256. Both with 1-3 slices, fp16 and bf16; the stand-alone shrink and expand (add_inputs).
_VLLM_TEST_HIDDEN = [
    128, 256, 512, 896, 1024, 1152, 1216, 1280, 1536, 1664, 2048, 2240, 2304, 2368, 2432, 2560, 2752, 3072,
    3328, 3456, 3584, 3712, 4096, 4480, 4608, 4736, 4864, 5120, 5504, 5632, 5888, 6144, 6400, 6848, 6912,
    7168, 7424, 8192, 8960, 9216, 9472, 10240, 11008, 11264, 13824, 14336, 14784, 14848, 15360, 18944,
    22016, 22528, 24576, 27392, 27648, 29568, 29696, 32000, 32256, 32512, 32768, 33024, 36864, 43264,
    49152, 49408, 60544, 60672, 64000, 64256, 102400, 102656, 128000, 128256]


def _vllm_kernel_test_cases():
    import itertools
    hidden = sorted({h // tp for h in _VLLM_TEST_HIDDEN for tp in (1, 2, 8, 16, 64)})
    dtypes = ("float16", "bfloat16")
    for batches, loras, rank, slices, dtype in itertools.product((1, 4, 16, 32), (1, 8, 32, 128),
                                                                 (1, 4, 8, 16, 32, 64, 128, 256), (1, 2, 3), dtypes):
        yield batches * 128, 2049, rank, slices, loras, dtype
    for h, slices, dtype in itertools.product(hidden, (1, 2, 3), dtypes):
        yield 512, h, 32, slices, 4, dtype


def _variant(call, dtype):
    """What Triton compiles `call` as: kernel, meta-parameters, warps, stages, the element type and
    its integer parameters' specialisation (1 a constant, multiples of 16 hinted, the token counts
    never hinted, planning.UNSPECIALISED_PARAMS neither)."""
    from lora_core.kernels.planning import TOKEN_COUNT_PARAMS, UNSPECIALISED_PARAMS
    spec = []
    for name, v in call.named_scalars().items():
        if isinstance(v, float) or name in UNSPECIALISED_PARAMS:
            continue
        spec.append((name, "one" if v == 1 else "d16" if v % 16 == 0 and name not in TOKEN_COUNT_PARAMS else ""))
    return call.kernel.__name__, call.plan.key[1:], dtype, tuple(spec)


def test_vllm_kernel_test_sweep_compiles_few_variants(monkeypatch):
    """vLLM's kernel-test sweep (4,272 stand-alone shrinks and expands over 228 hidden sizes, ranks
    1-256, 1-128 adapters), planned as on an H200 (compiled, programmatic dependent launch allowed):
    the expand's tile numbers are runtime values (`plan.sizes`), so slice widths that share a
    launch config share the compiled expand -- at most 75% of the variants that the same plans
    with those values as meta-parameters compiled (1,158 against 1,650 at the time of writing)."""
    from types import SimpleNamespace as A

    from lora_core.kernels import arguments, configs, expand, plan_expand, plan_shrink, planning
    for module in (planning, expand, configs):        # plans as compiled, not as interpreted
        monkeypatch.setattr(module, "interpreting", lambda: False)
    dev = "NVIDIA H200"
    strides = arguments.shape_strides
    found, as_meta, launches = set(), set(), 0
    for T, H, R, S, L, dtype in _vllm_kernel_test_cases():
        meta = (A(shape=(T,)), A(shape=(T,)), A(shape=(L + 1,)), A(shape=(L + 2,)), A(shape=(L + 1,)))
        plan = plan_shrink(T, H, R, S, L + 1, dtype, dtype, configs.shrink_config(T, H, R, S, L, device=dev),
                           lora_only=False, workspace=False, has_ranks=False, pdl=True)
        calls = [arguments.shrink_call(plan, A(shape=(T, H)), [A(shape=(L, R, H))] * S, None, meta, 0.5,
                                       A(shape=(S, T, R)), strides)]
        plan = plan_expand(T, R, (H,) * S, L + 1, 1, dtype, dtype, configs.expand_config(T, H, R, S, L, device=dev),
                           add_inputs=True, bias_flags=(0,) * S, has_ranks=False, pdl=True)
        calls.append(arguments.expand_call(plan, A(shape=(1, S, T, R)), [A(shape=(L, H, R))] * S, None, None, meta,
                                           A(shape=(T, H * S)), [H * s for s in range(S)], strides))
        assert calls[1].plan.sizes
        for call in calls:
            found.add(_variant(call, dtype))
            as_meta.add((_variant(call, dtype), tuple(call.plan.sizes.items())))
        launches += 2
    assert launches == 4272
    assert 4 * len(found) <= 3 * len(as_meta), (len(found), len(as_meta))
