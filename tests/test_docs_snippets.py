"""The docs' Python snippets run as written, and the docs cite only paths that exist.

Every ```python block of README.md and docs/*.md runs on its own in a fresh interpreter (cwd an
empty temporary directory, the repository root on PYTHONPATH, the environment the test suite's
conftest adds taken out again, no accelerator visible) and must exit 0 within its timeout: a
reader copying a snippet onto a CPU machine gets a working program. Blocks the docs show as
```text or plain ``` are not run.

The second test reads every backticked or linked repository path in the same documents and in
the results READMEs under benchmarks/results/ and requires it to exist in the tree.
"""

from __future__ import annotations

import glob
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = ["README.md", *sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "docs", "*.md")))]
TIMEOUT_S = 300
# Set for the test process by tests/conftest.py; a reader's shell has neither.
CONFTEST_ENV = ("TRITON_INTERPRET", "XLA_FLAGS", "XLA_PYTHON_CLIENT_PREALLOCATE")

_FENCE = re.compile(r"^([ \t]*)```python[ \t]*\n(.*?)^\1```[ \t]*$", re.S | re.M)


def python_blocks(path: str) -> list[tuple[int, str]]:
    """(first line number, dedented source) of every ```python block of `path`."""
    with open(os.path.join(ROOT, path)) as f:
        text = f.read()
    blocks = []
    for m in _FENCE.finditer(text):
        indent = m.group(1)
        lines = [ln[len(indent):] if ln.startswith(indent) else ln for ln in m.group(2).splitlines()]
        blocks.append((text[:m.start()].count("\n") + 2, "\n".join(lines) + "\n"))
    return blocks


SNIPPETS = [(f"{doc}:{line}", src) for doc in DOCS for line, src in python_blocks(doc)]


def test_the_docs_have_python_snippets():
    """The extraction finds README's usage snippets (a changed fence would skip every block)."""
    names = [name for name, _ in SNIPPETS]
    assert sum(name.startswith("README.md:") for name in names) >= 2, names


@pytest.mark.parametrize("name,source", SNIPPETS, ids=[name for name, _ in SNIPPETS])
def test_snippet_runs_as_written(name, source, tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in CONFTEST_ENV}
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "") if env.get("PYTHONPATH") else ROOT
    # the claim is about a CPU machine: on a GPU machine the snippet sees no accelerator either
    env.update(JAX_PLATFORMS="cpu", CUDA_VISIBLE_DEVICES="")
    script = tmp_path / "snippet.py"
    script.write_text(source)
    try:
        out = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True,
                             text=True, timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        pytest.fail(f"{name}: no exit within {TIMEOUT_S} s")
    assert out.returncode == 0, f"{name} exited {out.returncode}:\n{out.stderr[-3000:]}"


# ------------------------------------------------------------------------------- cited paths

# Repository folders: a cited token starting with one of these is a path from the repository root.
_TOP = ("lora_core/", "jax_lora/", "torch_lora/", "bridge/", "tests/", "docs/", "benchmarks/", "examples/", ".ci/")


def _expand(token: str) -> list[str]:
    """`a.{json,md}` -> [`a.json`, `a.md`]."""
    m = re.search(r"\{([^{}]*)\}", token)
    if not m:
        return [token]
    return [e for alt in m.group(1).split(",") for e in _expand(token[:m.start()] + alt + token[m.end():])]


def _cited(text: str) -> list[str]:
    """Backticked tokens without spaces and link targets, trailing punctuation cut."""
    tokens = re.findall(r"`([^`\s]+)`", text) + re.findall(r"\]\(([^)#\s]+)", text)
    return [p.rstrip(".,;:") for t in tokens for p in _expand(t)]


def _tracked() -> list[str]:
    out = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True)
    if out.returncode != 0:
        pytest.skip("not a git checkout")
    return out.stdout.split()


def test_docs_cite_only_paths_that_exist():
    """Paths from the repository root (`lora_core/...`, `benchmarks/results/...`), paths relative
    to a doc (`../CHANGELOG.md`, `contract.md`), and dated result names (`..._2026...`, found under
    benchmarks/results/, a folder-relative tail suffices) all name tracked files or folders (or, for
    root paths, files on disk: a copy of the tree may carry an older git index). Names
    with placeholders (`<device>`, `*`, `...`) are not checked; `name.*` needs one file so named."""
    files = _tracked()
    folders = {f.rsplit("/", i)[0] for f in files for i in range(1, f.count("/") + 1)}
    results = [f for f in files if f.startswith("benchmarks/results/")]
    results_folders = [d for d in folders if d.startswith("benchmarks/results/")]
    for where, _dirs, names in os.walk(os.path.join(ROOT, "benchmarks", "results")):   # an older git index
        rel = os.path.relpath(where, ROOT).replace(os.sep, "/")
        results_folders.append(rel)
        results += [f"{rel}/{n}" for n in names]
    readmes = [f for f in results if f.endswith("README.md")]

    def exists(path: str) -> bool:
        path = os.path.normpath(path)
        if path.endswith(".*"):
            return any(f.startswith(path[:-1]) for f in files)
        return (path in files or path in folders or any(f.startswith(path + ".") for f in files)
                or os.path.exists(os.path.join(ROOT, path)))        # a copy whose git index is older

    def result_exists(name: str) -> bool:
        name = name.rstrip("/")
        if name.endswith(".*"):
            return any(f.rsplit("/", 1)[-1].startswith(name[:-1].rsplit("/", 1)[-1]) for f in results)
        return (any(f.endswith("/" + name) for f in results + results_folders)
                or any(("/" + f).rsplit(".", 1)[0].endswith("/" + name) for f in results))

    missing = []
    for doc in [*DOCS, "CHANGELOG.md", *readmes]:
        with open(os.path.join(ROOT, doc)) as f:
            text = f.read()
        for token in _cited(text):
            if any(c in token for c in "<>|") or "..." in token or ("*" in token and not token.endswith(".*")):
                continue
            if token.startswith(_TOP):
                ok = exists(token)
            elif token.startswith("../"):
                ok = exists(os.path.join(os.path.dirname(doc), token))
            elif "_2026" in token:
                ok = result_exists(token)
            elif re.fullmatch(r"\w+\.md", token) and doc in DOCS:
                ok = exists(os.path.join(os.path.dirname(doc), token)) or exists(token)
            else:
                continue
            if not ok:
                missing.append(f"{doc}: {token}")
    assert not missing, "cited paths missing from the tree:\n" + "\n".join(missing)
