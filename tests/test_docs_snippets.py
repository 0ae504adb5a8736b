"""The docs' Python snippets run as written, and the docs cite only paths that exist.

Every ```python block of README.md and docs/*.md runs on its own in a fresh interpreter (cwd an
empty temporary directory, the repository root on PYTHONPATH, the environment the test suite's
conftest adds taken out again) and must exit 0 within its timeout: a reader copying a snippet onto
a CPU machine gets a working program. Blocks the docs show as ```text or plain ``` are not run.

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
    script = tmp_path / "snippet.py"
    script.write_text(source)
    try:
        out = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True,
                             text=True, timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        pytest.fail(f"{name}: no exit within {TIMEOUT_S} s")
    assert out.returncode == 0, f"{name} exited {out.returncode}:\n{out.stderr[-3000:]}"


# ------------------------------------------------------------------------------- cited paths

# A path-looking token: a repository folder first, or a file name with one of these endings.
_TOP = ("lora_core/", "jax_lora/", "torch_lora/", "bridge/", "tests/", "docs/", "benchmarks/", "examples/", ".ci/")
_EXT = re.compile(r"\.(py|md|json|log|txt|c|toml|png)$")


def _expand(token: str) -> list[str]:
    """`a.{json,md}` -> [`a.json`, `a.md`]."""
    m = re.search(r"\{([^{}]*)\}", token)
    if not m:
        return [token]
    return [e for alt in m.group(1).split(",") for e in _expand(token[:m.start()] + alt + token[m.end():])]


def _cited(text: str) -> list[str]:
    tokens = re.findall(r"`([^`\s]+)`", text) + re.findall(r"\]\(([^)#\s]+)", text)
    return [t.rstrip(".,;:") for t in tokens if not t.startswith(("http", "-", "$", "/", "~"))]


def _exists(token: str, doc_dir: str) -> bool:
    for cand in (token, os.path.join(doc_dir, token), os.path.join("benchmarks", "results", token)):
        path = os.path.normpath(os.path.join(ROOT, cand))
        if cand.endswith(".*"):
            if glob.glob(path[:-1] + "*"):
                return True
        elif os.path.exists(path):
            return True
    return False


def test_docs_cite_only_paths_that_exist():
    """Paths that start at a package or repository folder, and result files named in the docs and
    the results READMEs, exist. Names with placeholders (`<device>`, `*`) are not checked."""
    readmes = sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "benchmarks", "results", "**", "README.md"),
                                                                  recursive=True))
    missing = []
    for doc in [*DOCS, "CHANGELOG.md", *readmes]:
        with open(os.path.join(ROOT, doc)) as f:
            text = f.read()
        doc_dir = os.path.dirname(doc)
        for token in _cited(text):
            for path in _expand(token):
                if any(c in path for c in "<>*|") and not path.endswith(".*"):
                    continue
                in_results = doc.startswith("benchmarks/results/") or "_h200_" in path or "results/" in path
                if not (path.startswith(_TOP) or (in_results and (_EXT.search(path) or path.endswith(("/", ".*"))))):
                    continue
                if path.startswith(("benchmarks/results/", "docs/", "tests/")) or in_results or "/" in path:
                    if not _exists(path, doc_dir):
                        missing.append(f"{doc}: {path}")
    assert not missing, "cited paths missing from the tree:\n" + "\n".join(missing)
