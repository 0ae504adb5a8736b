"""The tuned fused linear table (`lora_core.kernels.fused_linear_configs`): its keys, its reader, the
fused-or-today policy `use_fused_linear`, the norm path's policy `use_norm_fused_linear`,
`gemm_config`'s tuned configs, and `gemm_lora` at every
config shape class the tuner (benchmarks/tune_fused_linear.py) proposes.

CPU: the reader on tables written here (a tuner-shaped table read back; bad keys, configs and
decisions refused by name; the LORA_CORE_FUSED_LINEAR_TABLE override, a missing file); the policy's
decisions from a small synthetic table (M and rank buckets, shapes, M above the buckets and
untuned layers on today's path, each decision logged once with its reason; the norm path's
decision from `use_norm_fused`, False for entries without the key); `gemm_lora` in
Triton's interpreter with BLOCK_M 16-128, BLOCK_N 32-256, BLOCK_K 64-256, split-K 1-8, GROUP_M 8,
both epilogue modes and PREFETCH_B, with and without LoRA, against a float64 NumPy oracle (outputs
poisoned with NaN first); every candidate the tuner makes for the Llama-3-8B and Qwen2-7B layers
plans (no config the kernel refuses) and fits the shared memory bound. GPU (`gpu`): every entry
of the GPU's own table, compiled at its layer shape, against float64.
"""

from __future__ import annotations

import json
import logging
import os
import sys

import numpy as np
import pytest

from lora_core.kernels import fused_linear_configs as flc

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

QKV = (4096, (4096, 1024, 1024))
CFG = {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 128, "SPLIT_K": 2, "num_warps": 4, "num_stages": 4,
       "LORA_MODE": "rows"}


def _entry(use_fused, **cfg):
    return {"config": {**CFG, **cfg}, "use_fused": use_fused, "reason": f"synthetic {use_fused}",
            "fused_us": 1.0, "today_us": 2.0}


def _write(path, entries, **top):
    path.write_text(json.dumps({"device": "test", "format": 1, **top, "entries": entries}))
    return str(path)


SYNTHETIC = {
    "k4096/n4096+1024+1024/m8/r16": _entry(True),
    "k4096/n4096+1024+1024/m32/r16": _entry(False),
    "k4096/n4096/m1/r16": _entry(True, BLOCK_N=32),
    "k4096/n4096/m8/r64": _entry(True, BLOCK_N=256),
}


@pytest.fixture(autouse=True)
def _fresh_caches():
    flc.fused_linear_table.cache_clear()
    flc._log_choice.cache_clear()
    flc._log_norm_choice.cache_clear()
    yield
    flc.fused_linear_table.cache_clear()
    flc._log_choice.cache_clear()
    flc._log_norm_choice.cache_clear()


def test_table_keys_bucket_rows_and_ranks():
    assert flc.table_key(QKV, 8, 16) == "k4096/n4096+1024+1024/m8/r16"
    assert flc.table_key(QKV, 5, 9) == "k4096/n4096+1024+1024/m8/r16"       # M 2..8 -> 8, rank 9 -> 16
    assert flc.table_key((14336, 4096), 1, 64) == "k14336/n4096/m1/r64"      # N as an int: one slice
    assert flc.table_key(QKV, 129, 17) == "k4096/n4096+1024+1024/m256/r32"
    assert flc.table_key(QKV, flc.M_BUCKETS[-1] + 1, 16) is None
    with pytest.raises(TypeError, match="layer_shape"):
        flc.table_key(4096, 8, 16)
    with pytest.raises(ValueError, match="layer_shape"):
        flc.table_key((4096, (0,)), 8, 16)


def test_reader_takes_a_table_and_refuses_bad_entries_by_name(tmp_path):
    path = _write(tmp_path / "t.json", SYNTHETIC, margin=0.02)
    assert flc.read_fused_linear_table(path) == SYNTHETIC
    bad = {
        "k4096/m8/r16": "keys are",
        "k4096/n4096/m8/r16 ": "keys are",
    }
    for key, match in bad.items():
        with pytest.raises(ValueError, match=match):
            flc.read_fused_linear_table(_write(tmp_path / "b.json", {key: _entry(True)}))
    entries = [({"config": CFG, "use_fused": "yes"}, "bool 'use_fused'"),
               ({"config": {**CFG, "BLOCK_N": 48}, "use_fused": True}, "BLOCK_N must be a power of two"),
               ({"config": {**CFG, "num_warps": 3}, "use_fused": True}, "num_warps must be a power of two"),
               ({"config": {**CFG, "SPLIT_K": 0}, "use_fused": True}, "SPLIT_K must be an int >= 1"),
               ({"config": {**CFG, "TILES": 2}, "use_fused": True}, "keys among"),
               ({"use_fused": True}, "'config' must be an object"),
               ({"config": CFG, "use_fused": True, "use_norm_fused": 1}, "'use_norm_fused' must be a bool"),
               ([1], "bool 'use_fused'")]
    for entry, match in entries:
        with pytest.raises(ValueError, match=f"entry 'k1/n2/m8/r16'.*{match}|{match}"):
            flc.read_fused_linear_table(_write(tmp_path / "b.json", {"k1/n2/m8/r16": entry}))
    (tmp_path / "c.json").write_text(json.dumps({"classes": {}}))
    with pytest.raises(ValueError, match="c.json: expected"):
        flc.read_fused_linear_table(str(tmp_path / "c.json"))


def test_policy_decides_from_the_table_and_says_why_once(caplog):
    with caplog.at_level(logging.INFO, logger="lora_core"):
        assert flc.use_fused_linear(QKV, 8, 16, table=SYNTHETIC)
        assert flc.use_fused_linear(QKV, 3, 8, table=SYNTHETIC)              # same bucket: logged once
        assert not flc.use_fused_linear(QKV, 20, 16, table=SYNTHETIC)        # m32 entry says today
        assert not flc.use_fused_linear(QKV, 1, 16, table=SYNTHETIC)         # no m1 entry for qkv
        assert flc.use_fused_linear((4096, (4096,)), 1, 16, table=SYNTHETIC)
        assert not flc.use_fused_linear((4096, (4096,)), 8, 16, table=SYNTHETIC)   # only r64 at m8
        assert flc.use_fused_linear((4096, (4096,)), 8, 33, table=SYNTHETIC)       # rank 33 -> r64
        assert not flc.use_fused_linear(QKV, 300, 16, table=SYNTHETIC)       # above the M buckets
        assert not flc.use_fused_linear(QKV, 8, 16, table={})               # no table: today's path
    msgs = [r.getMessage() for r in caplog.records if r.getMessage().startswith("LoRA linear")]
    assert msgs.count("LoRA linear k4096/n4096+1024+1024/m8/r16: the fused GEMM (shrink, then gemm_lora): "
                      "synthetic True") == 1
    assert "LoRA linear k4096/n4096+1024+1024/m32/r16: today's path (library GEMM + add_lora_linear): " \
           "synthetic False" in msgs
    assert any("m1/r16: today's path" in m and "no tuned entry" in m for m in msgs)
    assert any("/mNone/r16: today's path" in m and "above the tuned row counts" in m for m in msgs)
    with pytest.raises(ValueError, match="rank must be"):
        flc.use_fused_linear(QKV, 8, 0, table=SYNTHETIC)
    with pytest.raises(ValueError, match="m must be"):
        flc.use_fused_linear(QKV, -1, 16, table=SYNTHETIC)


def test_norm_policy_decides_from_use_norm_fused_and_old_entries_mean_false(tmp_path, caplog):
    """use_norm_fused_linear: the entry's use_norm_fused (independent of use_fused), False for an
    entry without the key (a table from before it), without an entry and above the M buckets;
    logged once per (layer, M bucket, rank) with the reason; a tuner-shaped table with the new keys
    reads back whole."""
    gate_up = (4096, (14336, 14336))
    table = {**SYNTHETIC,
             "k4096/n14336+14336/m8/r16": {**_entry(False), "use_norm_fused": True, "norm_reason": "norm wins",
                                            "norm_us": 1.0, "today_with_norm_us": 2.0},
             "k4096/n14336+14336/m1/r16": {**_entry(True), "use_norm_fused": False, "norm_reason": "norm loses"}}
    assert flc.read_fused_linear_table(_write(tmp_path / "t.json", table)) == table
    with caplog.at_level(logging.INFO, logger="lora_core"):
        assert flc.use_norm_fused_linear(gate_up, 8, 16, table=table)
        assert flc.use_norm_fused_linear(gate_up, 2, 9, table=table)          # same bucket: logged once
        assert not flc.use_fused_linear(gate_up, 8, 16, table=table)          # use_fused unchanged
        assert not flc.use_norm_fused_linear(gate_up, 1, 16, table=table)
        assert flc.use_fused_linear(gate_up, 1, 16, table=table)
        assert not flc.use_norm_fused_linear(QKV, 8, 16, table=table)         # an old entry: no key
        assert flc.use_fused_linear(QKV, 8, 16, table=table)
        assert not flc.use_norm_fused_linear(gate_up, 32, 16, table=table)    # no entry
        assert not flc.use_norm_fused_linear(gate_up, 300, 16, table=table)   # above the M buckets
    msgs = [r.getMessage() for r in caplog.records if r.getMessage().startswith("RMSNorm + LoRA linear")]
    assert msgs.count("RMSNorm + LoRA linear k4096/n14336+14336/m8/r16: the fused norm path (rms_norm_shrink, "
                      "then gemm_lora): norm wins") == 1
    assert ("RMSNorm + LoRA linear k4096/n14336+14336/m1/r16: the norm, then the LoRA linear's own choice: "
            "norm loses") in msgs
    assert any("k4096/n4096+1024+1024/m8/r16: the norm, then" in m and "no norm path decision" in m for m in msgs)
    assert any("m32/r16: the norm, then" in m and "no tuned entry" in m for m in msgs)
    assert any("/mNone/r16: the norm, then" in m and "above the tuned row counts" in m for m in msgs)
    with pytest.raises(ValueError, match="rank must be"):
        flc.use_norm_fused_linear(gate_up, 8, 0, table=table)
    with pytest.raises(TypeError, match="layer_shape"):
        flc.use_norm_fused_linear(4096, 8, 16, table=table)


def test_gemm_config_takes_the_tuned_entry_else_the_row_table():
    assert flc.gemm_config(8, QKV[1], 4096, 16, table=SYNTHETIC) == SYNTHETIC["k4096/n4096+1024+1024/m8/r16"]["config"]
    # a tuned BLOCK_N wider than a slice is halved until the slices are whole tiles
    wide = {"k4096/n4096+1024+1024/m8/r16": _entry(True, BLOCK_N=2048)}
    assert flc.gemm_config(8, QKV[1], 4096, 16, table=wide)["BLOCK_N"] == 1024
    # without k and rank (the GEMM alone), or without an entry: GEMM_CONFIGS by row count
    assert flc.gemm_config(8, QKV[1], table=SYNTHETIC) == flc.gemm_config(8, QKV[1])
    assert flc.gemm_config(1, QKV[1], 4096, 16, table=SYNTHETIC) == flc.gemm_config(1, QKV[1])
    assert flc.gemm_config(8, QKV[1]) == flc._bucket(flc.GEMM_CONFIGS, 8)


def test_the_device_table_comes_from_the_override_file_or_is_empty(tmp_path, monkeypatch, caplog):
    path = _write(tmp_path / "t.json", SYNTHETIC)
    monkeypatch.setenv("LORA_CORE_FUSED_LINEAR_TABLE", path)
    assert flc.fused_linear_table(None) == SYNTHETIC
    assert flc.use_fused_linear(QKV, 8, 16, device="any")
    flc.fused_linear_table.cache_clear()
    monkeypatch.setenv("LORA_CORE_FUSED_LINEAR_TABLE", str(tmp_path / "missing.json"))
    with pytest.raises(FileNotFoundError, match="LORA_CORE_FUSED_LINEAR_TABLE"):
        flc.fused_linear_table(None)
    flc.fused_linear_table.cache_clear()
    monkeypatch.delenv("LORA_CORE_FUSED_LINEAR_TABLE")
    with caplog.at_level(logging.INFO, logger="lora_core"):
        assert flc.fused_linear_table("No Such GPU 9000") == {}
    assert any("none for No Such GPU 9000" in r.getMessage() for r in caplog.records)
    assert flc.fused_linear_table_file("NVIDIA H200").endswith(os.path.join("tuned", "NVIDIA_H200_fused_linear.json"))
    assert not flc.use_fused_linear(QKV, 8, 16, device="No Such GPU 9000")


# ------------------------------------------------------------------------------ the tuner's config classes

def test_every_tuner_candidate_plans_and_fits_shared_memory():
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import tune_fused_linear as tuner

    from lora_core.kernels.gemm_lora import plan_gemm_lora
    seen = set()
    for shapes in tuner.MODELS.values():
        for k, widths in shapes.values():
            for m in flc.M_BUCKETS:
                cands = tuner.candidates(m, k, widths, 132, 10)
                assert cands[0]["BLOCK_M"] == flc.gemm_config(m, widths)["BLOCK_M"]      # the default first
                assert len({json.dumps(c, sort_keys=True) for c in cands}) == len(cands)
                for c in cands:
                    plan = plan_gemm_lora(m, sum(widths), k, widths, 16, "bfloat16", "bfloat16", "bfloat16", c,
                                          has_bias=False, add_inputs=False, has_lora=True, has_ranks=False)
                    assert c["num_stages"] * (c["BLOCK_M"] + c["BLOCK_N"]) * c["BLOCK_K"] * 2 <= tuner.SMEM_BYTES
                    assert plan.split_k == c["SPLIT_K"]
                    seen.add((c["BLOCK_M"], c["BLOCK_N"], c["BLOCK_K"], c["SPLIT_K"] > 1, c.get("GROUP_M", 1),
                              c["LORA_MODE"], bool(c.get("PREFETCH_B"))))
    # the classes the kernel test below runs
    for bm in (16, 32, 64, 128):
        assert any(s[0] == bm for s in seen)
    for bn in (32, 64, 128, 256):
        assert any(s[1] == bn for s in seen)
    assert {s[2] for s in seen} >= {64, 128, 256}
    assert any(s[3] for s in seen) and any(s[4] == 8 for s in seen) and any(s[6] for s in seen)
    assert {s[5] for s in seen} == {"rows", "slots"}


torch = pytest.importorskip("torch")
pytest.importorskip("triton")

L = 3
# (BLOCK_M, BLOCK_N, BLOCK_K, SPLIT_K, GROUP_M, LORA_MODE, PREFETCH_B, warps, stages), M, K, widths, dtype
CLASSES = [
    ((16, 32, 128, 1, 1, "rows", False, 4, 5), 5, 256, (64, 32, 32), torch.float32),
    ((16, 64, 64, 8, 1, "rows", False, 4, 6), 7, 512, (64, 64), torch.float32),            # split-K 8
    ((16, 256, 64, 2, 1, "rows", True, 8, 4), 3, 256, (256, 128), torch.bfloat16),        # wide tiles, prefetch
    ((32, 128, 256, 4, 1, "slots", False, 8, 3), 20, 1024, (128, 64), torch.bfloat16),    # split-K 4 (16-bit smem)
    ((64, 64, 64, 1, 8, "slots", False, 4, 4), 150, 128, (64, 64), torch.float32),        # GROUP_M 8
    ((128, 128, 64, 2, 8, "slots", False, 8, 3), 260, 256, (128, 64), torch.bfloat16),    # 3 row tiles
]
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def _oracle(x, w, buf, b, slots, widths):
    ref = x @ w.T
    if buf is None:
        return ref
    off = 0
    for s, n in enumerate(widths):
        for m, slot in enumerate(slots):
            if 0 <= slot < L:
                ref[m, off:off + n] += buf[s, m] @ b[s][slot].T
        off += n
    return ref


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available(),
                    reason="needs Triton's interpreter (TRITON_INTERPRET=1) or CUDA")
@pytest.mark.parametrize("lora", [True, False], ids=["lora", "base"])
@pytest.mark.parametrize("cls,m,k,widths,dtype", CLASSES,
                         ids=[f"bm{c[0]}-bn{c[1]}-bk{c[2]}-split{c[3]}-group{c[4]}-{c[5]}{'-prefetch' if c[6] else ''}"
                              for c, *_ in CLASSES])
def test_gemm_lora_matches_oracle_at_every_tuner_config_class(cls, m, k, widths, dtype, lora):
    from torch_lora.ops.fused_linear import gemm_lora
    bm, bn, bk, split, group, mode, prefetch, warps, stages = cls
    cfg = dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, SPLIT_K=split, GROUP_M=group, num_warps=warps,
               num_stages=stages)
    if lora:
        cfg.update(LORA_MODE=mode, PREFETCH_B=prefetch)
    dev = "cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1" else "cpu"
    rng = np.random.default_rng(bm * 1000 + m)
    n, rank = sum(widths), 16
    x = rng.standard_normal((m, k))
    w = rng.standard_normal((n, k)) / np.sqrt(k)
    buf = rng.standard_normal((len(widths), m, rank)).astype(np.float32)
    b = [rng.standard_normal((L, wd, rank)) / np.sqrt(rank) for wd in widths]
    slots = rng.integers(-1, L + 1, m).astype(np.int32)          # -1 and L: no LoRA term

    def t(a):
        return torch.from_numpy(np.asarray(a, np.float32)).to(dev, dtype)

    def q(a):
        return t(a).double().cpu().numpy()
    y = torch.full((m, n), float("nan"), dtype=dtype, device=dev)
    if lora:
        out = gemm_lora(t(x), t(w), None, torch.from_numpy(buf).to(dev), [t(v) for v in b],
                        torch.from_numpy(slots).to(dev), widths, y=y, config=cfg)
        ref = _oracle(q(x), q(w), buf.astype(np.float64), [q(v) for v in b], slots, widths)
    else:
        out = gemm_lora(t(x), t(w), None, None, None, None, widths, y=y, config=cfg)
        ref = _oracle(q(x), q(w), None, None, None, widths)
    got = out.double().cpu().numpy()
    assert not np.isnan(got).any(), "an output tile was never written"
    assert np.linalg.norm(got - ref) / np.linalg.norm(ref) <= TOL[dtype]
    if split > 1 and dev == "cpu":       # the split-K counters are back at 0 for the next launch
        from torch_lora.ops import fused_linear as tfl
        assert all(int(c.abs().sum()) == 0 for c in tfl._LOCKS.values())


@pytest.mark.gpu
def test_gpu_every_entry_of_the_device_table_matches_float64():
    """The GPU's own fused linear table (tuned/<device>_fused_linear.json): every entry's config at its
    layer shape, M bucket and rank, compiled, with LoRA against float64 (bf16, 8 slots, slot -1 rows)."""
    if not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("compiled kernels need a CUDA GPU")
    from torch_lora.ops.fused_linear import gemm_lora
    table = flc.fused_linear_table(torch.cuda.get_device_name())
    if not table:
        pytest.skip(f"no fused linear table for {torch.cuda.get_device_name()}")
    rng = np.random.default_rng(0)
    for key, entry in table.items():
        k_part, n_part, m_part, r_part = key.split("/")
        k, widths, m, rank = int(k_part[1:]), tuple(int(w) for w in n_part[1:].split("+")), int(m_part[1:]), \
            int(r_part[1:])
        n = sum(widths)
        x = torch.randn(m, k, device="cuda").bfloat16()
        w = (torch.randn(n, k, device="cuda") / k ** 0.5).bfloat16()
        buf = torch.randn(len(widths), m, rank, device="cuda")
        b = [(torch.randn(8, wd, rank, device="cuda") / rank ** 0.5).bfloat16() for wd in widths]
        slots_np = rng.integers(-1, 8, m).astype(np.int32)
        out = gemm_lora(x, w, None, buf, b, torch.from_numpy(slots_np).cuda(), widths, config=entry["config"])
        ref = x.double() @ w.double().T                    # float64 on the GPU: the layer sizes are large for NumPy
        bufd = buf.double()
        off = 0
        for s, width in enumerate(widths):
            for row, slot in enumerate(slots_np.tolist()):
                if slot >= 0:
                    ref[row, off:off + width] += bufd[s, row] @ b[s][slot].double().T
            off += width
        err = float(torch.linalg.norm(out.double() - ref) / torch.linalg.norm(ref))
        assert err <= 2e-2, (key, entry["config"], err)
