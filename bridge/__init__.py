"""bridge: zero-copy DLPack exchange between torch and JAX (issue 5)."""
