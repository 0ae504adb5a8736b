"""Where a JAX model step's host time goes: the jitted call's dispatch (until it returns) against
the wait for its outputs, with one step shape compiled and again after four more step shapes'
programs are compiled in the same process.

    PYTHONPATH=. python benchmarks/jax_dispatch.py --frameworks jax --vllm off --max-len 128 \
        --steps 10 --budget-s 120 --no-precompile --cases 'dec B(1|8|32|128|256) D8 r16$' --out OUT

It runs `e2e_decode.py` with those arguments and replaces its first JAX timing: at the first
decode shape (B32 in e2e_decode's order) it prints, for the base and the LoRA step, the median
dispatch time and dispatch + wait of 20 steps each waited for, and the per-step time of ten steps
dispatched back to back with one wait (and their median dispatch); then compiles the other shapes'
programs (DBL_ROWS, default 1,8,32,128,256) and measures again, twice; then a cProfile of ten LoRA
dispatches (Python frames: empty when jit's C++ fast path takes every call) and the dispatch of the
same program called as an ahead-of-time `Compiled` object; last, the base program's `Compiled`
dispatch with its usual zero-sized LoRA arguments and with the real LoRA weights in their place
(which the base step does not read): the share of PJRT's time the weight arguments take, against
the LoRA program's custom calls. The process exits after that.
"""
from __future__ import annotations

import cProfile
import io
import os
import pstats
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import e2e_decode

ROWS = [int(r) for r in os.environ.get("DBL_ROWS", "1,8,32,128,256").split(",")]
_timed = e2e_decode.Bench.jax_time


def _steps(bench, lora: bool):
    """(jitted step, LoRA argument, wrapper argument) of the base or the LoRA step."""
    _key, lora_leaves, _rest, empty = bench._states
    base_fn, lora_fn = bench._jax_jits()
    return (lora_fn, lora_leaves, bench.j_punica) if lora else (base_fn, empty, None)


def measure(bench, shape, tag: str, n: int = 20) -> None:
    """Prints the median dispatch and dispatch + wait of n steps each waited for (base, LoRA, base,
    LoRA: the later pair is kept), and the per-step time of ten steps dispatched back to back."""
    import jax
    rest = bench._states[2]
    cache = bench._jax_cache(shape)
    res = {}
    for lora in (False, True, False, True):
        fn, lora_arg, punica = _steps(bench, lora)
        dispatch, total = [], []
        for _ in range(n):
            t0 = time.perf_counter()
            cache, tok, _logits = fn(lora_arg, rest, cache, punica, *shape.j_args, lora)
            t1 = time.perf_counter()
            tok.block_until_ready()
            dispatch.append((t1 - t0) * 1e6)
            total.append((time.perf_counter() - t0) * 1e6)
        res[lora] = (statistics.median(dispatch), statistics.median(total))
    for lora in (False, True):
        fn, lora_arg, punica = _steps(bench, lora)
        t0 = time.perf_counter()
        dispatch = []
        for _ in range(10):
            ta = time.perf_counter()
            cache, tok, _logits = fn(lora_arg, rest, cache, punica, *shape.j_args, lora)
            dispatch.append((time.perf_counter() - ta) * 1e6)
        tok.block_until_ready()
        res[("chain", lora)] = ((time.perf_counter() - t0) * 1e5, statistics.median(dispatch))
    jax.block_until_ready(cache)
    bench.dec_cache = cache
    chain_b, chain_l = res[("chain", False)], res[("chain", True)]
    print(f"[{tag}] base dispatch {res[False][0]:.0f} us total {res[False][1]:.0f} | lora dispatch "
          f"{res[True][0]:.0f} total {res[True][1]:.0f} | chain10 base {chain_b[0]:.0f} (disp {chain_b[1]:.0f}) "
          f"lora {chain_l[0]:.0f} (disp {chain_l[1]:.0f})", flush=True)


def probe(bench, shape) -> None:
    """The measurements of the module docstring, then the process exits."""
    measure(bench, shape, "one shape compiled")
    bench.precompile([e2e_decode.Shape(bench, "dec", r, 1) for r in ROWS if r != shape.rows])
    measure(bench, shape, "five shapes compiled")
    measure(bench, shape, "again")
    fn, lora_arg, punica = _steps(bench, True)
    rest = bench._states[2]
    cache = bench._jax_cache(shape)
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(10):
        cache, tok, _logits = fn(lora_arg, rest, cache, punica, *shape.j_args, True)
    prof.disable()
    tok.block_until_ready()
    for order, top in (("tottime", 22), ("cumtime", 18)):
        out = io.StringIO()
        pstats.Stats(prof, stream=out).sort_stats(order).print_stats(top)
        print(out.getvalue()[:6000])
    dispatch, cache = compiled_dispatch(bench, shape, fn, lora_arg, punica, True, cache)
    print(f"[compiled object] lora dispatch {dispatch:.0f} us", flush=True)
    base_fn = bench._jax_jits()[0]
    for label, lora_arg in (("empty placeholders", bench._states[3]), ("the LoRA weights", bench._states[1])):
        dispatch, cache = compiled_dispatch(bench, shape, base_fn, lora_arg, None, False, cache)
        print(f"[compiled object] base dispatch with {label} as its LoRA arguments {dispatch:.0f} us", flush=True)
    os._exit(0)


def compiled_dispatch(bench, shape, fn, lora_arg, punica, lora: bool, cache, n: int = 20):
    """(median dispatch in us of n steps of `fn` called as an ahead-of-time `Compiled` object, each
    waited for; the cache after them)."""
    rest = bench._states[2]
    compiled = fn.lower(lora_arg, rest, bench._jax_cache_spec(shape), punica, *shape.j_args, lora).compile()
    dispatch = []
    for _ in range(n):
        t0 = time.perf_counter()
        cache, tok, _logits = compiled(lora_arg, rest, cache, punica, *shape.j_args)
        dispatch.append((time.perf_counter() - t0) * 1e6)
        tok.block_until_ready()
    return statistics.median(dispatch), cache


def jax_time(self, shape, flags, n):
    probe(self, shape)
    return _timed(self, shape, flags, n)


if __name__ == "__main__":
    e2e_decode.Bench.jax_time = jax_time
    sys.exit(e2e_decode.main(sys.argv[1:]))
