"""benchmarks/e2e_decode.py in --smoke mode: the model-step benchmark's whole pipeline (JAX model with
LoRA under jit, the torch decoder over the same weights, metadata updates between cases, the
reference check, timing, the JSON/markdown report) on the CPU with a tiny model; with an fp8 base
(--base fp8: the decoder's linears float8_e4m3fn, both frameworks checked against the reference); and
JAX's fused LoRA linears (--jax-lora fused-norm, in Triton's interpreter) checked against the reference; and
both frameworks' --torch-lora / --jax-lora auto over a small fused linear table, checked the same way;
and JAX's steps called as their precompiled ahead-of-time programs (--jax-call aot)."""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("triton")        # the benchmark's provenance helpers live in bench_triton
pytest.importorskip("flax")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def smoke_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("e2e")
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "TRITON_INTERPRET")}
    env.update(PYTHONPATH=ROOT, JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "e2e_decode.py"), "--smoke",
                           "--jax-chain", "2", "--out", str(out)],
                          capture_output=True, text=True, cwd=ROOT, env=env, timeout=900, check=False)
    files = glob.glob(str(out / "e2e_smoke_*.json"))
    return proc, files


@pytest.mark.slow
def test_smoke_run_writes_checked_results(smoke_run):
    proc, files = smoke_run
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert len(files) == 1
    with open(files[0]) as f:
        res = json.load(f)
    meta = res["meta"]
    for key in ("date", "device", "torch", "jax", "python", "commit", "source_digest", "config", "phases_s"):
        assert key in meta, key
    assert meta["smoke"] is True and meta["device"] == "cpu"
    assert meta["jax_chain"] == 2                     # JAX samples: 2 steps back to back, one wait
    assert len(meta["source_digest"]) == 16
    assert meta["config"]["layers"] == 2 and meta["config"]["hidden"] == 64
    assert res["summary"]["checks_failed"] == []
    names = [c["case"] for c in res["cases"]]
    assert {"dec B4 D1 r4", "dec B4 D2 r4", "dec B4 D2 r8", "pre 2x16 D2 r4"} == set(names)
    for c in res["cases"]:
        assert c["floor_us"] > 0 and c["floor_bytes"] > c["adapter_bytes"] > 0
        assert c["lora_effect"] > 0.05               # the adapters move the logits: the check can fail
        for fw in ("torch", "jax"):
            r = c[fw]
            assert r["check_passed"] is True
            assert r["lora_err"] <= 0.2 * c["lora_effect"]
            assert r["base_us"] > 0 and r["lora_us"] > 0
            assert r["overhead_us"] == pytest.approx(r["lora_us"] - r["base_us"])
            assert r["overhead_over_floor"] == pytest.approx(r["overhead_us"] / c["floor_us"])
            assert len(r["lora_samples_us"]) == len(r["base_samples_us"]) == c["steps_timed"]
        assert c["jax_over_torch_lora"] == pytest.approx(c["jax"]["lora_us"] / c["torch"]["lora_us"])
    md = files[0][:-len(".json")] + ".md"
    assert os.path.exists(md)
    with open(md) as f:
        text = f.read()
    assert "dec B4 D2 r8" in text
    assert "JAX: host clock over 2 steps dispatched back to back and one block_until_ready, / 2" in text


def test_floor_counts_bytes_as_benchmarks_md_says():
    """The floor of one decode token with one rank-16 adapter, counted by hand for the 8B shapes."""
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import e2e_decode
    cfg = e2e_decode.model_config(smoke=False)
    r, T, D = 16, 1, 1
    h, i, q, kv = 4096, 14336, 4096, 1024
    adapter = r * ((3 * h + q + 2 * kv) + (h + h) + (2 * h + 2 * i) + (i + h)) * 2   # A and B, one layer
    acts = (T * h * 2 + 2 * 3 * T * r * 4 + 2 * T * (q + 2 * kv) * 2      # qkv: x, rank buffer, y
            + T * q * 2 + 2 * T * r * 4 + 2 * T * h * 2                  # o
            + T * h * 2 + 2 * 2 * T * r * 4 + 2 * T * 2 * i * 2          # gate_up
            + T * i * 2 + 2 * T * r * 4 + 2 * T * h * 2)                 # down
    assert e2e_decode.floor_bytes(cfg, T, D, r) == 32 * (D * adapter + acts)
    assert e2e_decode.adapter_bytes(cfg, r) == 32 * adapter


def test_case_lists():
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import e2e_decode
    full = e2e_decode.full_cases()
    assert len(full) == len({c.name for c in full})
    assert all(c.adapters <= c.rows * c.seq for c in full)
    dec = {(c.rows, c.adapters) for c in full if c.kind == "dec"}
    assert dec == {(1, 1), (8, 1), (8, 8), (32, 1), (32, 8), (32, 32), (128, 1), (128, 8), (128, 32),
                   (256, 1), (256, 8), (256, 32)}
    assert {c.tokens for c in full if c.kind == "pre"} == {2048, 8192}
    assert set(e2e_decode.QUICK) <= {c.name for c in full}
    for c in full:
        slots = e2e_decode.slots_of(c, seed=e2e_decode.hash_case(c))
        assert len(slots) == c.rows and len(set(slots.tolist())) == c.adapters


DROP_DOWN_PROJ = """
import sys
sys.path.insert(0, {bench!r})
import e2e_decode

real = e2e_decode.TorchDecoder.wrapper_lora


def wrapper_lora_without_down(self, punica):
    hook = real(self, punica)
    return lambda i, name, y, x: None if name == "down" else hook(i, name, y, x)


e2e_decode.TorchDecoder.wrapper_lora = wrapper_lora_without_down
sys.exit(e2e_decode.main(["--smoke", "--frameworks", "torch", "--cases", "dec B4 D2 r4", "--out", {out!r}]))
"""


def test_a_wrong_lora_step_fails_the_check_and_reports_no_time(tmp_path):
    """The torch LoRA step with the down projection's adapters left out: the run exits 1, the case
    is marked failed and carries no time."""
    script = tmp_path / "drop_down.py"
    script.write_text(DROP_DOWN_PROJ.format(bench=os.path.join(ROOT, "benchmarks"), out=str(tmp_path)))
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "TRITON_INTERPRET")}
    env.update(PYTHONPATH=ROOT, JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, cwd=ROOT, env=env,
                          timeout=600, check=False)
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    (path,) = glob.glob(str(tmp_path / "e2e_smoke_*.json"))
    with open(path) as f:
        res = json.load(f)
    (case,) = res["cases"]
    assert res["summary"]["checks_failed"] == ["dec B4 D2 r4"]
    assert case["torch"]["check_passed"] is False and "lora_us" not in case["torch"]
    assert case["torch"]["lora_err"] > 0.2 * case["lora_effect"]


class _Trace:
    """A profiler stand-in that writes a fixed Chrome trace: two steps 200 us apart, each a GEMM,
    then a LoRA shrink / expand pair (the expand starting before the shrink ends), then a memcpy."""

    def export_chrome_trace(self, path):
        events, t = [], 0.0
        for _ in range(2):
            events += [dict(ph="X", cat="kernel", name="gemm", ts=t, dur=10.0),
                       dict(ph="X", cat="kernel", name="lora_shrink_kernel", ts=t + 11.0, dur=4.0),
                       dict(ph="X", cat="kernel", name="lora_expand_kernel", ts=t + 13.0, dur=5.0),
                       dict(ph="X", cat="gpu_memcpy", name="Memcpy DtoD", ts=t + 18.5, dur=1.0),
                       dict(ph="X", cat="cpu_op", name="aten::mm", ts=t, dur=30.0)]      # not GPU activity
            t += 200.0
        with open(path, "w") as f:
            json.dump(dict(traceEvents=events), f)


def test_gpu_timeline_splits_busy_idle_and_lora_gaps():
    """Busy = the union of GPU intervals, idle = gaps inside a step, gaps >= STEP_GAP_US between
    steps; per LoRA kernel its mean duration and gap before; the gap after the LoRA pair."""
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import e2e_decode
    tl = e2e_decode._gpu_timeline(_Trace(), 2)
    assert tl["activities"] == 4 and tl["between_steps"] == 1
    assert tl["busy_us"] == pytest.approx(10.0 + 7.0 + 1.0)          # the expand overlaps the shrink by 2 us
    assert tl["idle_us"] == pytest.approx(1.0 + 0.5)                  # before the shrink, before the memcpy
    shrink, expand = tl["lora"]["lora_shrink"], tl["lora"]["lora_expand"]
    assert shrink[:2] == (2, pytest.approx(8.0)) and shrink[2] == pytest.approx(2.0)
    assert expand[2] == pytest.approx(0.0)                            # overlapping: no gap
    assert tl["gap_after_lora_us"] == pytest.approx(0.5)
    md = e2e_decode._timeline_markdown("case", 2, {False: tl, True: tl})
    assert "| base | 4 | 18.0 | 1.5 | 19.5 |" in md and "| lora_shrink | 1 | 4.00 | 1.00 |" in md


@pytest.mark.slow
def test_smoke_run_with_an_fp8_base_passes_its_checks(tmp_path):
    """--base fp8: the 8 decoder linears of the 2 layers are quantized, and both frameworks' base
    and LoRA steps pass the reference check on one decode case."""
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "TRITON_INTERPRET")}
    env.update(PYTHONPATH=ROOT, JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "e2e_decode.py"), "--smoke", "--base",
                           "fp8", "--cases", "dec B4 D2 r4", "--out", str(tmp_path)],
                          capture_output=True, text=True, cwd=ROOT, env=env, timeout=900, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    files = glob.glob(str(tmp_path / "e2e_smoke_fp8_*.json"))
    assert len(files) == 1
    with open(files[0]) as f:
        res = json.load(f)
    assert res["meta"]["config"]["base"] == "fp8" and res["meta"]["config"]["torch_fp8"] == "dequant"
    assert res["meta"]["quantized_linears"] == 8
    assert res["summary"]["checks_failed"] == [] and [c["case"] for c in res["cases"]] == ["dec B4 D2 r4"]
    for fw in ("torch", "jax"):
        assert res["cases"][0][fw]["check_passed"] is True


@pytest.mark.slow
def test_smoke_run_with_jax_fused_lora_passes_its_check(tmp_path):
    """--jax-lora fused-norm: the JAX model's LoRA linears are the fused kernels (the RMSNorm that
    shrinks, the GEMM with the expand), and its LoRA step passes the reference check."""
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "TRITON_INTERPRET")}
    env.update(PYTHONPATH=ROOT, JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "e2e_decode.py"), "--smoke", "--frameworks",
                           "jax", "--jax-lora", "fused-norm", "--cases", "dec B4 D2 r4", "--out", str(tmp_path)],
                          capture_output=True, text=True, cwd=ROOT, env=env, timeout=900, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (path,) = glob.glob(str(tmp_path / "e2e_smoke_*.json"))
    with open(path) as f:
        res = json.load(f)
    assert res["meta"]["jax_lora"] == "fused-norm" and res["summary"]["checks_failed"] == []
    (case,) = res["cases"]
    assert case["jax"]["check_passed"] is True and case["jax"]["lora_err"] <= 0.2 * case["lora_effect"]


@pytest.mark.slow
def test_smoke_run_with_aot_calls_passes_its_checks(tmp_path):
    """--jax-call aot: the JAX base and LoRA steps are the precompiled Compiled programs, called
    directly (two ranks: the LoRA programs per rank, the base programs shared), and pass the
    reference check; the run records the call and how many programs it kept."""
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "TRITON_INTERPRET")}
    env.update(PYTHONPATH=ROOT, JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "e2e_decode.py"), "--smoke", "--frameworks",
                           "jax", "--jax-call", "aot", "--cases", "dec B4 D2 r(4|8)$|pre 2x16 D2 r4", "--out",
                           str(tmp_path)],
                          capture_output=True, text=True, cwd=ROOT, env=env, timeout=900, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (path,) = glob.glob(str(tmp_path / "e2e_smoke_aot_*.json"))
    with open(path) as f:
        res = json.load(f)
    assert res["meta"]["jax_call"] == "aot" and res["summary"]["checks_failed"] == []
    # base: dec B4, pre 2x16 (every rank); LoRA: both at rank 4, dec B4 at rank 8; none built on a first call
    assert res["meta"]["jax_aot_programs"] == {"precompiled": 5, "on_first_call": 0}
    assert {c["case"] for c in res["cases"]} == {"dec B4 D2 r4", "dec B4 D2 r8", "pre 2x16 D2 r4"}
    for case in res["cases"]:
        assert case["jax"]["check_passed"] is True and case["jax"]["lora_err"] <= 0.2 * case["lora_effect"]
        assert case["jax"]["base_us"] > 0 and case["jax"]["lora_us"] > 0
    with open(path[:-len(".json")] + ".md") as f:
        assert "JAX: host clock from the ahead-of-time compiled call to block_until_ready" in f.read()


@pytest.mark.slow
def test_smoke_run_with_a_w8a8_torch_base_checks_each_framework_over_its_own_base(tmp_path):
    """--base fp8 --torch-fp8 scaled_mm (torch's CPU kernel): torch's reference step computes the same
    per-token e4m3 products as its step, JAX's stays weight-only; both pass, and the case records
    how far the W8A8 base logits are from the weight-only ones."""
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "TRITON_INTERPRET")}
    env.update(PYTHONPATH=ROOT, JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "e2e_decode.py"), "--smoke", "--base",
                           "fp8", "--lora-dtype", "fp8", "--torch-fp8", "scaled_mm", "--cases", "dec B4 D2 r4",
                           "--out", str(tmp_path)],
                          capture_output=True, text=True, cwd=ROOT, env=env, timeout=900, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (path,) = glob.glob(str(tmp_path / "e2e_smoke_fp8_lora-fp8_*.json"))
    with open(path) as f:
        res = json.load(f)
    assert res["meta"]["config"]["torch_fp8"] == "scaled_mm" and res["summary"]["checks_failed"] == []
    (case,) = res["cases"]
    assert case["torch"]["reference_product"] == "scaled_mm" and case["jax"]["reference_product"] == "dequant"
    assert case["torch"]["check_passed"] is True and case["jax"]["check_passed"] is True
    # two layers of e4m3 activations move the base logits by a few percent (measurable, under the bound)
    assert 1e-3 < case["w8a8_base_vs_weight_only"] < 0.15


@pytest.mark.gpu
def test_gpu_fp8_base_products_match_the_float64_oracle():
    """The benchmark's torch products over an fp8 base on CUDA: weight-only (dequant) within bf16
    rounding of x @ (Q s) in float64, torch._scaled_mm with per-token e4m3 activations (scaled_mm)
    within the activations' e4m3 rounding (6% relative, Frobenius)."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import e2e_decode
    g = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(5, 64, generator=g).to("cuda", torch.bfloat16)
    w = torch.randn(64, 48, generator=g) / 8
    s = w.abs().amax(dim=0) / 448
    q = (w / s).clamp(-448, 448).to(torch.float8_e4m3fn)
    weight = e2e_decode.Fp8Weight(q.cuda(), s.cuda(), q.cuda().t().contiguous().t())
    want = x.double().cpu() @ (q.double() * s.double())
    for product, tol in (("dequant", 1e-2), ("scaled_mm", 6e-2)):
        got = e2e_decode.base_product(x, weight, product)
        assert got.dtype == torch.bfloat16 and got.shape == (5, 48), product
        got = got.double().cpu()
        assert float((got - want).norm() / want.norm()) < tol, product


@pytest.mark.slow
def test_smoke_run_with_an_fp8_base_and_fp8_adapters_passes_its_checks(tmp_path):
    """--base fp8 --lora-dtype fp8: the JAX layers store e4m3 adapters with float32 channel scales,
    torch reads the same through DLPack, and both frameworks' LoRA steps match the reference built
    on the dequantised adapters; the results carry the adapter dtype."""
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "TRITON_INTERPRET")}
    env.update(PYTHONPATH=ROOT, JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "e2e_decode.py"), "--smoke", "--base",
                           "fp8", "--lora-dtype", "fp8", "--cases", "dec B4 D2 r4", "--out", str(tmp_path)],
                          capture_output=True, text=True, cwd=ROOT, env=env, timeout=900, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    files = glob.glob(str(tmp_path / "e2e_smoke_fp8_lora-fp8_*.json"))
    assert len(files) == 1
    with open(files[0]) as f:
        res = json.load(f)
    meta = res["meta"]
    assert meta["config"]["base"] == "fp8" and meta["config"]["lora_dtype"] == "fp8"
    assert meta["adapter_storage"] == ["lora_a:float8_e4m3fn", "lora_a_scale:float32", "lora_b:float8_e4m3fn",
                                       "lora_b_scale:float32"]
    assert meta["vllm_kernels"] is None
    (case,) = res["cases"]
    assert case["case"] == "dec B4 D2 r4" and case["lora_dtype"] == "fp8" and case["base"] == "fp8"
    assert res["summary"]["checks_failed"] == []
    assert case["lora_effect"] > 0.05
    for fw in ("torch", "jax"):
        assert case[fw]["check_passed"] is True and case[fw]["lora_err"] <= 0.2 * case["lora_effect"]


def test_fp8_adapter_bytes_count_one_byte_a_weight_and_the_channel_scales():
    """fp8 adapters in the floor, counted by hand for the 8B shapes: 1 byte per weight element plus a
    float32 scale per channel (S * r for A, N for B, per linear), the rest of the floor unchanged."""
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import e2e_decode
    cfg = e2e_decode.model_config(smoke=False)
    r, T, D = 16, 4, 3
    h, i, q, kv = 4096, 14336, 4096, 1024
    elements = r * ((3 * h + q + 2 * kv) + (h + h) + (2 * h + 2 * i) + (i + h))
    channels = (3 * r + q + 2 * kv) + (r + h) + (2 * r + 2 * i) + (r + h)
    assert e2e_decode.adapter_bytes(cfg, r, "fp8") == 32 * (elements + 4 * channels)
    assert (e2e_decode.floor_bytes(cfg, T, D, r) - e2e_decode.floor_bytes(cfg, T, D, r, "fp8")
            == D * 32 * (2 * elements - elements - 4 * channels))


def test_fp8_adapters_refuse_the_paths_that_take_bf16_adapters_only(capsys):
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import e2e_decode
    for extra in (["--torch-lora", "fused"], ["--vllm", "on"]):
        with pytest.raises(SystemExit):
            e2e_decode.main(["--smoke", "--lora-dtype", "fp8", "--list"] + extra)
        assert "--lora-dtype fp8" in capsys.readouterr().err


def test_quantize_rows_on_device_follows_the_contract_rule():
    """The benchmark's device quantiser against contract section 11's rule in float64 NumPy: scales
    amax / 448 per row (1 for a zero row) within a float32 ulp, e4m3 values equal except where the
    scale's last-ulp difference tips a rounding, dequantised within e4m3's 2^-4 relative step."""
    pytest.importorskip("jax")
    import jax.numpy as jnp
    import ml_dtypes
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import e2e_decode
    rng = np.random.default_rng(3)
    w = (rng.standard_normal((2, 3, 5, 40)) * rng.uniform(0.01, 3.0, (2, 3, 5, 1))).astype(np.float32)
    w[1, 2, 4] = 0.0                                                  # a zero row: scale 1, zeros
    q, s = e2e_decode.quantize_rows_on_device(jnp.asarray(w, jnp.bfloat16))
    assert q.dtype == jnp.float8_e4m3fn and s.dtype == jnp.float32 and q.shape == w.shape and s.shape == w.shape[:-1]
    w64 = np.asarray(jnp.asarray(w, jnp.bfloat16), np.float64)
    amax = np.abs(w64).max(-1)
    want_s = np.where(amax > 0, amax / 448.0, 1.0)
    np.testing.assert_allclose(np.asarray(s, np.float64), want_s, rtol=2 ** -23)
    want_q = np.clip(w64 / want_s[..., None], -448, 448).astype(ml_dtypes.float8_e4m3fn).astype(np.float64)
    got_q = np.asarray(q.astype(jnp.float32), np.float64)
    assert np.mean(got_q == want_q) > 0.99
    assert s[1, 2, 4] == 1.0 and not np.any(got_q[1, 2, 4])
    deq = got_q * np.asarray(s, np.float64)[..., None]
    assert np.all(np.abs(deq - w64) <= 2 ** -4 * np.abs(w64) + 1e-12 + 2 ** -9 * amax[..., None] / 448)


@pytest.mark.slow
def test_smoke_run_with_auto_fused_linears_passes_its_checks(tmp_path):
    """--torch-lora auto --jax-lora auto with a fused linear table that marks qkv and down fused, o
    today's, gate_up's norm path (use_norm_fused) and qkv's entry without a norm decision (an older
    table's): each framework's step takes the path the table says per layer (the decisions printed)
    and passes the reference check."""
    table = tmp_path / "fl.json"
    cfg = {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 64, "num_warps": 4, "num_stages": 2}
    # the smoke model: hidden 64, 4 heads / 2 KV heads of 16, intermediate 128; dec B4 -> M bucket 8, rank 4 -> r16
    table.write_text(json.dumps({"device": "test", "format": 1, "entries": {
        "k64/n64+32+32/m8/r16": {"config": cfg, "use_fused": True, "reason": "marked fused"},
        "k64/n64/m8/r16": {"config": cfg, "use_fused": False, "reason": "marked today"},
        "k128/n64/m8/r16": {"config": {**cfg, "SPLIT_K": 2}, "use_fused": True, "reason": "marked fused"},
        "k64/n128+128/m8/r16": {"config": cfg, "use_fused": False, "reason": "marked today", "use_norm_fused": True,
                                "norm_reason": "marked norm"}}}))
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "TRITON_INTERPRET")}
    env.update(PYTHONPATH=ROOT, JAX_PLATFORMS="cpu", LORA_CORE_FUSED_LINEAR_TABLE=str(table))
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "e2e_decode.py"), "--smoke", "--frameworks",
                           "torch,jax", "--torch-lora", "auto", "--jax-lora", "auto", "--vllm", "off", "--cases",
                           "dec B4 D2 r4", "--out", str(tmp_path)],
                          capture_output=True, text=True, cwd=ROOT, env=env, timeout=900, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for line in ("LoRA linear k64/n64+32+32/m8/r16: the fused GEMM (shrink, then gemm_lora): marked fused",
                 "LoRA linear k64/n64/m8/r16: today's path (library GEMM + add_lora_linear): marked today",
                 "LoRA linear k128/n64/m8/r16: the fused GEMM (shrink, then gemm_lora): marked fused",
                 "RMSNorm + LoRA linear k64/n128+128/m8/r16: the fused norm path (rms_norm_shrink, then gemm_lora): "
                 "marked norm",
                 "RMSNorm + LoRA linear k64/n64+32+32/m8/r16: the norm, then the LoRA linear's own choice: the tuned "
                 "entry has no norm path decision (use_norm_fused)"):
        assert line in proc.stdout, proc.stdout[-3000:]
    assert "LoRA linear k64/n128+128/m8/r16: today's path" not in proc.stdout      # gate_up never asks use_fused
    (path,) = glob.glob(str(tmp_path / "e2e_smoke_*.json"))
    with open(path) as f:
        res = json.load(f)
    assert res["meta"]["torch_lora"] == res["meta"]["jax_lora"] == "auto" and res["summary"]["checks_failed"] == []
    (case,) = res["cases"]
    for fw in ("torch", "jax"):
        assert case[fw]["check_passed"] is True and case[fw]["lora_err"] <= 0.2 * case["lora_effect"]
