"""The package sources (lora_core, jax_lora, torch_lora, bridge: Python and C) state rules, not
measurements: no comment, docstring or message quotes a time (us, ms, ns, seconds), a bandwidth
(GB/s, TB/s), a speed-up ("15% slower", "2x faster") or a GPU by model name outside a device-name
string ("NVIDIA H200" names a launch table). The measurements behind the rules live in
docs/benchmarks_evidence.md. Plain text scan: no GPU, nothing imported."""

from __future__ import annotations

import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = ("lora_core", "jax_lora", "torch_lora", "bridge")
SUFFIXES = (".py", ".c", ".h")

# a number standing alone ("8", "0.35", "5-7", "8 to 16"), not the end of a name ("int32s")
_NUMBER = r"(?<![\w.])\d+(?:\.\d+)?(?:\s?(?:-|to)\s?\d+(?:\.\d+)?)?"
PATTERNS = {
    "a time": re.compile(rf"{_NUMBER}(?:\s?(?:us|µs|ms|ns|seconds?|microseconds?|milliseconds?)|\s(?:s|sec))\b"),
    "a bandwidth": re.compile(rf"{_NUMBER}\s?(?:[KMGT]i?B)/s\b"),
    "a speed-up": re.compile(rf"{_NUMBER}\s?(?:%|x)\s+(?:faster|slower)\b"),
    # a GPU model outside a device name ("NVIDIA H200", NVIDIA_H200.json): "on the H200", "an H100's"
    "a GPU model": re.compile(r"(?<!NVIDIA )(?<!NVIDIA_)\b(?:[ABHV]100|H200|H800|B200|GB200|GH200|A10G?|A30|A40|"
                              r"L40S?|RTX ?\d{4})\b(?!\.json)"),
}

def _sources():
    for package in PACKAGES:
        for folder, dirs, files in os.walk(os.path.join(ROOT, package)):
            dirs[:] = [d for d in dirs if d != "__pycache__"]
            for name in sorted(files):
                if name.endswith(SUFFIXES):
                    path = os.path.join(folder, name)
                    yield os.path.relpath(path, ROOT).replace(os.sep, "/"), path


def hits(text: str):
    """(kind, matched text) of every pattern hit in `text`."""
    return [(kind, m.group(0)) for kind, pattern in PATTERNS.items() for m in pattern.finditer(text)]


def test_the_patterns_catch_quoted_timings_and_pass_rules():
    """The scan is honest: it catches the forms measurements take and lets plain rules through."""
    caught = ["costs ~8 us of host time", "5-7 us per launch", "T=2048 ran 49 us unsplit", "18.6 us with 4",
              "283 / 216 ms", "2^24 polls are 8-16 s", "at 4300 GB/s", "about 1 TB/s", "2-11% faster",
              "15% slower", "1.7x slower", "measured on an H200", "on the H200 host", "an H100's HBM"]
    passed = ['device_name() ("NVIDIA H200")', "tuned/NVIDIA_H200.json", "16 bytes; the gaps are zeros",
              "int32s", "one round trip per tile", "2x the programs", "128-byte lines", "timeout in seconds",
              "f\"{t:.1f} us\"", "rank 64 with 3 slices", "the split-K planes", "{who:12s}",
              "# noqa: B019"]
    assert [text for text in caught if not hits(text)] == []
    assert [(text, hits(text)) for text in passed if hits(text)] == []


def test_package_sources_quote_no_device_timings():
    found = []
    for rel, path in _sources():
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
        for number, line in enumerate(lines, 1):
            found += [f"{rel}:{number}: {kind} {text!r}: {line.strip()}" for kind, text in hits(line)]
    assert found == [], ("state the rule in the code and put the measurement in docs/benchmarks_evidence.md:\n"
                         + "\n".join(found))
