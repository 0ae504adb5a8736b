"""Warm-up before serving (lora_core.warmup, each side's warmup): argument checks, the twin wrapper
left untouched, and on torch (the Triton interpreter here) every (token count, layer) really run.

CPU.
"""

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
    assert sorted(map(sorted, exact.values()), key=str) == sorted(map(sorted, planned.values()), key=str)
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
