"""The packages' module structure: imports point one way, the op code sits in `ops/api.py`, and the
kernel metadata travels as one record (`lora_core.kernel_meta.KernelMeta`).

- No import circle between the project's modules, counting imports inside functions too (an import
  moved into a function hides a circle from Python, not from a reader).
- `ops/__init__.py` on each side is a re-export of `ops/api.py`: the public ops keep their path.
- The host build, `jax_lora`'s and `torch_lora`'s `meta_args(T)` give the same `KernelMeta`, field by
  field, in `meta_args(T)`'s order; a wrapper's metadata views are that record's segments.
"""

from __future__ import annotations

import ast
import pathlib

import numpy as np
import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGES = ("lora_core", "jax_lora", "torch_lora", "bridge")


def _module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict:
    """{module name: path} of every Python module of the four packages."""
    return {_module_name(p): p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")}


def _imported(name: str, path: pathlib.Path, modules: dict) -> set:
    """The project modules `name` imports anywhere in its file (top level or inside functions):
    `from X import y` counts X, and X.y when that is a module."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[:len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            targets = [base] + [f"{base}.{alias.name}" for alias in node.names]
        else:
            continue
        found.update(t for t in targets if t in modules and t != name)
    return found


def _circles(graph: dict) -> list:
    """The strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on_stack, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    return out


def test_no_import_circles_between_project_modules():
    """A package's __init__ importing its own submodules is how packages work; every other edge
    counts, including imports written inside functions."""
    modules = _modules()
    graph = {}
    for name, path in modules.items():
        edges = _imported(name, path, modules)
        # A module importing its parent package is not an edge of the graph (Python loads the
        # parent first anyway), and a package importing its own submodule is its re-export.
        graph[name] = {t for t in edges if not name.startswith(t + ".")}
    assert _circles(graph) == []


def test_ops_init_re_exports_the_op_code():
    jax_ops = pytest.importorskip("jax_lora.ops")
    from jax_lora.ops import api as jax_api
    for name in jax_ops.__all__:
        assert getattr(jax_ops, name) is getattr(jax_api, name)
    torch_ops = pytest.importorskip("torch_lora.ops")
    from torch_lora.ops import api as torch_api
    for name in torch_ops.__all__:
        assert getattr(torch_ops, name) is getattr(torch_api, name)


def test_meta_args_is_one_record_on_every_side():
    torch = pytest.importorskip("torch")
    import jax_lora
    import torch_lora
    from lora_core.kernel_meta import KernelMeta, build_host, field_shapes

    m, max_loras, capacity, t = np.array([2, -1, 0, 2, 0], np.int32), 4, 8, 5
    host = build_host(m, max_loras, capacity)
    jm = jax_lora.LoRAKernelMeta.build(m, max_loras, capacity).meta_args(capacity)
    tmeta = torch_lora.LoRAKernelMeta.make(max_loras, capacity, "cpu")
    tmeta.prepare_tensors(torch.from_numpy(m))
    tm = tmeta.meta_args(capacity)
    assert type(host) is type(jm) is type(tm) is KernelMeta
    assert KernelMeta._fields == ("token_lora_mapping", "token_indices_sorted_by_lora_ids", "num_tokens_per_lora",
                                  "lora_token_start_loc", "active_lora_ids", "no_lora")
    for field, shape in zip(KernelMeta._fields[:5], field_shapes(capacity, max_loras)):
        want = getattr(host, field).tolist()
        assert len(want) == shape[0], field
        assert np.asarray(getattr(jm, field)).tolist() == getattr(tm, field).tolist() == want, field
    assert host.no_lora.tolist() == [0] and not bool(jm.no_lora) and not bool(tm.no_lora[0])
    assert jax_lora.LoRAKernelMeta.build(m, max_loras, capacity).meta_args(t).token_lora_mapping.shape == (t,)


def test_wrapper_metadata_is_the_step_blocks_record():
    """Both wrappers' kernel metadata are the StepLayout segments named by KernelMeta's fields."""
    torch = pytest.importorskip("torch")
    import jax_lora
    import torch_lora
    from lora_core.host_mapping import LoRAMapping
    from lora_core.kernel_meta import KernelMeta, build_host

    mapping, ids = LoRAMapping((1, 0, 2, 1), (1, 2)), [1, 2, None]
    want = build_host(np.array([0, -1, 1, 0]), 3, 8)
    jw = jax_lora.PunicaWrapper(8, 4, "cpu", max_loras=3, backend="xla")
    tw = torch_lora.PunicaWrapper(8, 4, "cpu", max_loras=3, backend="torch")
    for w in (jw, tw):
        w.update_metadata(mapping, ids, 4, 32)
    jmeta, tmeta = jw.token_meta.meta_args(8), tw.token_mapping_meta.meta_args(8)
    for field in KernelMeta._fields[:5]:
        assert np.asarray(getattr(jmeta, field)).tolist() == getattr(want, field).tolist(), field
        assert getattr(tmeta, field).tolist() == getattr(want, field).tolist(), field
    assert not bool(jmeta.no_lora) and tmeta.no_lora.dtype == torch.bool and not bool(tmeta.no_lora[0])
