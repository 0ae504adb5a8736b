"""The runnable examples stay runnable and keep verifying what they claim.

CPU.
"""

from __future__ import annotations

import importlib.util
import pathlib

import pytest

EXAMPLES = pathlib.Path(__file__).resolve().parent.parent / "examples"


def _load(name):
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_quickstart_verifies_every_request(capsys):
    _load("quickstart").main()
    assert "verified: 8/8 requests match merged-weights outputs" in capsys.readouterr().out


def test_torch_hf_example_matches_peft_per_request():
    pytest.importorskip("transformers")
    pytest.importorskip("peft")
    assert _load("torch_hf_multi_lora").main(verbose=False) == 0
