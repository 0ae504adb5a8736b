"""bridge: what used to crash the process.

- `to_torch(a)` then `a.delete()`: the tensor keeps the buffer alive (it used to abort the process
  on a jaxlib check failure; tested in a child process).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run_child(code: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, env=env,
                           timeout=300, cwd=ROOT)


# ----------------------------------------------------------------------------- to_torch, then delete

@pytest.mark.parametrize("fast", [True, False], ids=["fast-path", "public-path"])
def test_to_torch_then_delete_or_donate_keeps_the_buffer(fast):
    child = _run_child(f"""
        import gc
        import jax, jax.numpy as jnp, numpy as np
        import bridge
        from bridge import dlpack
        dlpack._fast["export"] = {fast}
        a = jnp.arange(1 << 16, dtype=jnp.float32) + 1
        want = np.asarray(a).copy()
        t = bridge.to_torch(a)
        assert t.data_ptr() == a.unsafe_buffer_pointer()          # still zero-copy
        a.delete()
        del a
        gc.collect()
        junk = [jnp.full((1 << 16,), 7.0) + i for i in range(16)]  # reuse freed memory, if any was freed
        assert np.array_equal(t.numpy(), want), "the torch tensor lost its buffer"
        b = jnp.arange(1 << 16, dtype=jnp.float32) + 1
        u = bridge.to_torch(b)
        c = jax.jit(lambda v: v * 2, donate_argnums=0)(b)           # donation while torch holds the buffer
        junk = [jnp.full((1 << 16,), 7.0) + i for i in range(16)]
        assert np.array_equal(u.numpy(), want) and np.array_equal(np.asarray(c), 2 * want)
        print("OK")
    """)
    assert child.returncode == 0 and "OK" in child.stdout, (child.returncode, child.stdout, child.stderr[-3000:])
