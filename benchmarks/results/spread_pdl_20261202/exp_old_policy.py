"""Runs a benchmark with the launch policy before 685814b (first kernel dependent at one token only, no spreading)."""
import runpy
import sys

import lora_core.kernels.planning as p

p.SPREAD_PDL_MAX_TOKENS = 1
p.spread_shared_bytes = lambda programs, shared, *a: shared
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
