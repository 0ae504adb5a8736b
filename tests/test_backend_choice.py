"""Backend choice: what runs and why is said on the package loggers, and a forced backend that
cannot run is a clear error.

- lora_core's backend registry logs a fallback with its reason (caplog, the `jax_lora` logger).
- torch: `backend="triton"` forced on a CPU without TRITON_INTERPRET=1 is an error saying so (a
  fresh interpreter without the variable); the backend chosen is logged on `torch_lora`.
CPU only.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import textwrap

import pytest


def test_core_backend_registry_says_fallbacks_with_the_reason(caplog):
    """Nothing falls back in silence: the shared registry warns once, on the side's
    logger, which backend could not run where, what runs instead, and why."""
    from lora_core.backend_registry import BackendRegistry
    reg = BackendRegistry({"a": "lora_core.checks", "b": "lora_core.dora"}, "jax_lora")
    with caplog.at_level(logging.INFO, logger="jax_lora"):
        assert reg.fallback("a", "b", "tpu", RuntimeError("no libtpu")) == "b"
        reg.fallback("a", "b", "tpu", RuntimeError("no libtpu"))
    warnings = [r for r in caplog.records if r.name == "jax_lora" and r.levelno == logging.WARNING]
    assert len(warnings) == 1
    msg = warnings[0].getMessage()
    assert "'a'" in msg and "'b'" in msg and "tpu" in msg and "no libtpu" in msg
    with pytest.raises(ValueError, match="'zzz'"):
        reg.load("zzz")


REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_forcing_triton_without_interpreter_errors_and_backend_choice_is_logged():
    """Contract section 8, the loggers, the import layering: in a fresh interpreter, importing
    torch_lora (with .hf and .parallel) loads no JAX module; a wrapper without backend= says on the
    `torch_lora` logger which backend runs and why; without TRITON_INTERPRET, backend='triton' on
    CPU tensors raises a clear error saying to set it."""
    code = textwrap.dedent("""
        import logging, io
        stream = io.StringIO()
        handler = logging.StreamHandler(stream)
        logging.getLogger("torch_lora").addHandler(handler)
        logging.getLogger("torch_lora").setLevel(logging.INFO)
        import sys
        import torch_lora, torch_lora.hf, torch_lora.parallel
        print("JAXMODS", sorted(m for m in sys.modules if m == "jax" or m.startswith(("jax.", "jaxlib", "jax_lora"))))
        w = torch_lora.PunicaWrapper(8, 2, "cpu", max_loras=2)
        print("BACKEND", w.backend)
        print("LOG", stream.getvalue().replace("\\n", " | "))
        try:
            torch_lora.PunicaWrapper(8, 2, "cpu", max_loras=2, backend="triton")
            print("NO ERROR")
        except Exception as e:
            print("ERROR", type(e).__name__, e)
    """)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    lines = {line.split(" ", 1)[0]: line for line in out.stdout.splitlines()}
    assert lines["JAXMODS"] == "JAXMODS []", lines["JAXMODS"]
    assert lines["BACKEND"] == "BACKEND torch"
    assert "torch" in lines["LOG"] and "cpu" in lines["LOG"], out.stdout
    assert lines["ERROR"].startswith("ERROR") and "TRITON_INTERPRET" in lines["ERROR"], out.stdout
