"""Audit of the PyTorch side against the promises of issues 2, 3, 5, 16-20 and 22 (and docs/contract.md).

Written as an outside test author would: only the public API as README, docs/torch.md,
docs/api.md, docs/parallel_torch.md and docs/bridge.md describe it. CPU only; the torch reference
backend ("torch") for product behaviour. Each test's docstring names the issue and the promise.
"""

from __future__ import annotations

import json
import math
import os
import socket
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

import torch_lora
from torch_lora import LoRAMapping, PunicaWrapper

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ----------------------------------------------------------------------------- helpers

def _rng(seed=0):
    return np.random.default_rng(seed)


def _stacked(rng, num_slots, rank, hidden, widths, dtype=torch.float32):
    """(A list of (L, 1, r, H), B list of (L, 1, n_s, r)) in vLLM's layout."""
    a = [torch.tensor(rng.standard_normal((num_slots, 1, rank, hidden)), dtype=dtype) for _ in widths]
    b = [torch.tensor(rng.standard_normal((num_slots, 1, n, rank)), dtype=dtype) for n in widths]
    return a, b


def _oracle_linear(y, x, a, b, bias, scale, idx, widths):
    """float64 NumPy: y[t] += sum_s (scale x[t] A_s[i].T) B_s[i].T + bias_s[i] at the slice offsets."""
    out = y.detach().double().numpy().copy()
    xs = x.detach().double().numpy()
    off = 0
    for s, n in enumerate(widths):
        A = a[s].detach().double().numpy().reshape(a[s].shape[0], -1, xs.shape[1])
        B = b[s].detach().double().numpy().reshape(b[s].shape[0], n, -1)
        for t, i in enumerate(idx):
            if i < 0:
                continue
            delta = (scale * xs[t] @ A[i].T) @ B[i].T
            if bias is not None and bias[s] is not None:
                delta = delta + bias[s].detach().double().numpy().reshape(A.shape[0], n)[i]
            out[t, off:off + n] += delta
        off += n
    return out


def _rel(a, b):
    a = np.asarray(a, np.float64)
    b = np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def _wrapper(token_ids, lora_index_to_id, *, prompt_ids=None, num_slots=None, backend="torch", **kw):
    num_slots = num_slots or len(lora_index_to_id)
    w = PunicaWrapper(64, 8, "cpu", max_loras=num_slots, backend=backend, **kw)
    prompt_ids = token_ids if prompt_ids is None else prompt_ids
    w.update_metadata(LoRAMapping(tuple(token_ids), tuple(prompt_ids)), list(lora_index_to_id), num_slots + 1, 16)
    return w


# ===== the contract: the API basics

def test_public_names_exist():
    """Issue 2 / contract section 8: torch_lora exports LoRAMapping, convert_mapping, compute_meta, LoRAKernelMeta,
    PunicaWrapper, and torch_lora.ops the metadata, BGMV and SGMV ops."""
    for name in ("LoRAMapping", "convert_mapping", "compute_meta", "LoRAKernelMeta", "PunicaWrapper",
                 "load_peft_adapter", "AdapterManager", "AdapterError"):
        assert hasattr(torch_lora, name), name
    for name in ("lora_shrink", "lora_expand", "bgmv_shrink", "bgmv_expand", "bgmv_expand_slice",
                 "sgmv_shrink", "sgmv_expand", "sgmv_expand_slice"):
        assert callable(getattr(torch_lora.ops, name)), name
    assert issubclass(torch_lora.AdapterError, ValueError)


def test_add_lora_linear_updates_y_in_place_and_matches_oracle():
    """Issue 2 / contract section 5: torch add_lora_linear updates y in place and returns it; unequal slices,
    bias per slot, tokens without LoRA untouched; equal to a float64 oracle within 1e-5 (fp32)."""
    rng = _rng(1)
    widths = (6, 3, 5)
    a, b = _stacked(rng, 3, 4, 16, widths)
    bias = [torch.tensor(rng.standard_normal((3, n)), dtype=torch.float32) for n in widths]
    ids = (1, 0, 2, 2, 3, 0, 1)
    w = _wrapper(ids, [1, 2, 3])
    idx = [{0: -1, 1: 0, 2: 1, 3: 2}[i] for i in ids]
    x = torch.tensor(rng.standard_normal((7, 16)), dtype=torch.float32)
    y = torch.tensor(rng.standard_normal((7, 14)), dtype=torch.float32)
    y0 = y.clone()
    ret = w.add_lora_linear(y, x, a, b, bias, 0.5, widths)
    assert ret is y
    want = _oracle_linear(y0, x, a, b, bias, 0.5, idx, widths)
    assert _rel(y.numpy(), want) < 1e-5
    assert torch.equal(y[1], y0[1]) and torch.equal(y[5], y0[5])


def test_ops_take_the_gpu_seeds_argument_order():
    """contract section 8: torch_lora.ops.lora_shrink(x, lora_a, y, *meta.meta_args(T), scale) and
    lora_expand(x, lora_b, y, *meta.meta_args(T), offset_start=..., add_inputs=...) write into y."""
    rng = _rng(2)
    a, b = _stacked(rng, 2, 4, 8, (5,))
    x = torch.tensor(rng.standard_normal((4, 8)), dtype=torch.float32)
    meta = torch_lora.LoRAKernelMeta.make(2, 16, "cpu")
    idx = torch.tensor([1, -1, 0, 1], dtype=torch.int32)
    meta.prepare_tensors(idx)
    buf = torch.full((1, 4, 4), 7.0)
    torch_lora.ops.lora_shrink(x, a, buf, *meta.meta_args(4), 2.0, backend="torch")
    A = a[0][:, 0].double().numpy()
    for t, i in enumerate(idx.tolist()):
        want = np.zeros(4) if i < 0 else 2.0 * x[t].double().numpy() @ A[i].T
        np.testing.assert_allclose(buf[0, t].numpy(), want, rtol=1e-5, atol=1e-5)
    y = torch.ones(4, 9)
    torch_lora.ops.lora_expand(buf, b, y, *meta.meta_args(4), offset_start=3, add_inputs=True, backend="torch")
    B = b[0][:, 0].double().numpy()
    for t, i in enumerate(idx.tolist()):
        want = np.ones(9)
        if i >= 0:
            want[3:8] += buf[0, t].double().numpy() @ B[i].T
        np.testing.assert_allclose(y[t].numpy(), want, rtol=1e-5, atol=1e-5)


def test_logits_route_by_sampler_indices_and_embedding_by_token_indices():
    """contract section 5 (issue 2): add_lora_logits uses the prompt mapping (one slot per sampled row),
    add_lora_embedding the token mapping."""
    rng = _rng(3)
    w = _wrapper((1, 1, 2, 0), [1, 2], prompt_ids=(2, 0, 1))
    a = torch.tensor(rng.standard_normal((2, 4, 8)), dtype=torch.float32)
    b = torch.tensor(rng.standard_normal((2, 10, 4)), dtype=torch.float32)
    x = torch.tensor(rng.standard_normal((3, 8)), dtype=torch.float32)
    y = torch.zeros(3, 10)
    w.add_lora_logits(y, x, a, b, 1.0)
    for j, slot in enumerate([1, -1, 0]):
        want = np.zeros(10) if slot < 0 else (x[j].double().numpy() @ a[slot].double().numpy().T) @ \
            b[slot].double().numpy().T
        np.testing.assert_allclose(y[j].numpy(), want, rtol=1e-5, atol=1e-5)
    xe = torch.tensor(rng.standard_normal((4, 4)), dtype=torch.float32)
    ye = torch.zeros(4, 10)
    w.add_lora_embedding(ye, xe, b)
    for t, slot in enumerate([0, 0, 1, -1]):
        want = np.zeros(10) if slot < 0 else xe[t].double().numpy() @ b[slot].double().numpy().T
        np.testing.assert_allclose(ye[t].numpy(), want, rtol=1e-5, atol=1e-5)


def test_convert_mapping_worked_values_and_unknown_id():
    """contract section 2: base/sampler indices, sampler_indices_padded = j + p_j * n (-1 -> max_loras - 1),
    embeddings_indices rows; an id in no slot raises a ValueError naming the id."""
    m = LoRAMapping((3, 0, 5), (5, 0))
    base, sampler, padded, emb, long_idx, lens = torch_lora.convert_mapping(m, [5, 3, None], 4, 100, 2)
    assert base.tolist() == [1, -1, 0]
    assert sampler.tolist() == [0, -1]
    assert padded.tolist() == [0 + 0 * 2, 1 + 3 * 2]
    assert emb.tolist() == [[2, 0, 0], [102, 0, 0]]
    assert long_idx is None
    assert base.dtype == torch.int32
    with pytest.raises(ValueError, match="7"):
        torch_lora.convert_mapping(LoRAMapping((7,), (7,)), [5, 3], 3, 100, 0)


def test_bad_inputs_name_the_argument():
    """Issue 2 / contract section 6 / README: bad input raises ValueError/TypeError naming the argument:
    mismatched hidden sizes, wrong slice count, too many tokens, float64, a NumPy x."""
    rng = _rng(4)
    a, b = _stacked(rng, 2, 4, 8, (5,))
    w = _wrapper((1, 2), [1, 2])
    y = torch.zeros(2, 5)
    with pytest.raises(ValueError, match="lora_a_stacked|hidden"):
        w.add_lora_linear(y, torch.zeros(2, 9), a, b, None, 1.0, (5,))
    with pytest.raises(ValueError, match="output_slices"):
        w.add_lora_linear(y, torch.zeros(2, 8), a, b, None, 1.0, (2, 3))
    with pytest.raises((TypeError, ValueError), match="x"):
        w.add_lora_linear(y, torch.zeros(2, 8, dtype=torch.float64), a, b, None, 1.0, (5,))
    with pytest.raises(TypeError, match=r"\bx\b"):
        w.add_lora_linear(y, np.zeros((2, 8), np.float32), a, b, None, 1.0, (5,))
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        w.update_metadata(LoRAMapping((1,) * 65, (1,)), [1, 2], 3, 16)


def test_unknown_backend_is_a_clear_error():
    """contract section 8 / issue 2: backend= forces an implementation; an unknown name is an error naming it."""
    with pytest.raises(ValueError, match="bogus"):
        PunicaWrapper(16, 4, "cpu", max_loras=2, backend="bogus")


# ===== issue 17: hardening

def test_nan_in_an_unused_slot_stays_there_linear_logits_embedding():
    """Issue 17 item 1: a NaN/Inf in one slot's A, B or bias -- a slot no token uses -- never reaches
    another row, on the torch backend, for linear, logits and embedding."""
    rng = _rng(5)
    a, b = _stacked(rng, 3, 4, 8, (5,))
    bias = [torch.tensor(rng.standard_normal((3, 5)), dtype=torch.float32)]
    clean = [t.clone() for t in (a[0], b[0], bias[0])]
    a[0][2].fill_(float("nan"))
    b[0][2, 0, 0, 0] = float("inf")
    bias[0][2].fill_(float("nan"))
    w = _wrapper((1, 0, 2, 1), [1, 2, 3], prompt_ids=(2, 0, 1))
    x = torch.tensor(rng.standard_normal((4, 8)), dtype=torch.float32)
    y = torch.zeros(4, 5)
    w.add_lora_linear(y, x, a, b, bias, 1.0, (5,))
    want = _oracle_linear(torch.zeros(4, 5), x, [clean[0]], [clean[1]], [clean[2]], 1.0, [0, -1, 1, 0], (5,))
    assert torch.isfinite(y).all()
    assert _rel(y.numpy(), want) < 1e-5
    yl = torch.zeros(3, 5)
    w.add_lora_logits(yl, x[:3], a[0][:, 0], b[0][:, 0], 1.0)
    assert torch.isfinite(yl).all() and torch.equal(yl[1], torch.zeros(5))
    ye = torch.zeros(4, 5)
    w.add_lora_embedding(ye, torch.ones(4, 4), b[0][:, 0])
    assert torch.isfinite(ye).all() and torch.equal(ye[1], torch.zeros(5))


def test_add_shrink_writes_zero_rows_for_tokens_without_lora_despite_nan_weights():
    """Issue 17 item 1 / contract section 4: add_shrink writes 0 on no-LoRA rows (never NaN), whatever another
    slot holds."""
    rng = _rng(6)
    a, _ = _stacked(rng, 2, 4, 8, (5,))
    a[0][1].fill_(float("nan"))
    w = _wrapper((1, 0, 1), [1, 2])
    buf = torch.full((1, 3, 4), float("nan"))
    w.add_shrink(buf, torch.ones(3, 8), a, 1.0)
    assert torch.equal(buf[0, 1], torch.zeros(4))
    assert torch.isfinite(buf).all()


def test_lora_ranks_ignores_nan_in_the_rank_padding():
    """Issue 17 item 2: with lora_ranks=, NaN in the rank padding gives the zero-padded result."""
    rng = _rng(7)
    a, b = _stacked(rng, 2, 8, 8, (6,))
    ranks = torch.tensor([3, 8], dtype=torch.int32)
    a_clean, b_clean = a[0].clone(), b[0].clone()
    a_clean[0, :, 3:] = 0
    b_clean[0, :, :, 3:] = 0
    a[0][0, :, 3:] = float("nan")
    b[0][0, :, :, 3:] = float("nan")
    w = _wrapper((1, 2, 1), [1, 2])
    x = torch.tensor(rng.standard_normal((3, 8)), dtype=torch.float32)
    y = torch.zeros(3, 6)
    w.add_lora_linear(y, x, a, b, None, 1.0, (6,), lora_ranks=ranks)
    want = _oracle_linear(torch.zeros(3, 6), x, [a_clean], [b_clean], None, 1.0, [0, 1, 0], (6,))
    assert _rel(y.numpy(), want) < 1e-5


def test_swapped_weight_storage_is_seen_and_rechecked():
    """Issue 17 item 4: the wrapper's cached plan follows `A.data = ...` / `B.set_(...)`, and a
    swapped-in tensor of another rank is checked again (refused when it no longer fits B)."""
    rng = _rng(8)
    a, b = _stacked(rng, 2, 4, 8, (5,))
    w = _wrapper((1, 2), [1, 2])
    x = torch.tensor(rng.standard_normal((2, 8)), dtype=torch.float32)
    w.add_lora_linear(torch.zeros(2, 5), x, a, b, None, 1.0, (5,))
    new_a = torch.tensor(rng.standard_normal((2, 1, 4, 8)), dtype=torch.float32)
    a[0].data = new_a
    y = torch.zeros(2, 5)
    w.add_lora_linear(y, x, a, b, None, 1.0, (5,))
    assert _rel(y.numpy(), _oracle_linear(torch.zeros(2, 5), x, [new_a], b, None, 1.0, [0, 1], (5,))) < 1e-5
    new_b = torch.tensor(rng.standard_normal((2, 1, 5, 4)), dtype=torch.float32)
    b[0].set_(new_b)
    y = torch.zeros(2, 5)
    w.add_lora_linear(y, x, a, b, None, 1.0, (5,))
    assert _rel(y.numpy(), _oracle_linear(torch.zeros(2, 5), x, [new_a], [new_b], None, 1.0, [0, 1], (5,))) < 1e-5
    a[0].data = torch.zeros(2, 1, 3, 8)           # rank 3 against B's rank 4
    with pytest.raises(ValueError, match="rank"):
        w.add_lora_linear(torch.zeros(2, 5), x, a, b, None, 1.0, (5,))


def test_unclear_inputs_of_issue_17_name_their_argument():
    """Issue 17 'unclear errors': scale=None, output_slices=None, a LoRA id of 2**70,
    lora_index_to_id=None, an int32 bias: each a ValueError/TypeError naming the argument."""
    rng = _rng(9)
    a, b = _stacked(rng, 2, 4, 8, (5,))
    w = _wrapper((1, 2), [1, 2])
    x, y = torch.zeros(2, 8), torch.zeros(2, 5)
    with pytest.raises(TypeError, match="scale"):
        w.add_lora_linear(y, x, a, b, None, None, (5,))
    with pytest.raises((TypeError, ValueError), match="output_slices"):
        w.add_lora_linear(y, x, a, b, None, 1.0, None)
    with pytest.raises(ValueError, match=str(2**70)):
        w.update_metadata(LoRAMapping((2**70,), (2**70,)), [1, 2], 3, 16)
    with pytest.raises(TypeError, match="lora_index_to_id"):
        w.update_metadata(LoRAMapping((1,), (1,)), None, 3, 16)
    with pytest.raises((TypeError, ValueError), match="lora_bias_stacked"):
        w.add_lora_linear(y, x, a, b, [torch.zeros(2, 5, dtype=torch.int32)], 1.0, (5,))


def test_bias_with_none_entries_and_numpy_offset_start():
    """Issue 17: add_lora_linear takes a bias list [tensor, None] (as add_expand does), and an
    `offset_start` given as np.int64 is accepted."""
    rng = _rng(10)
    a, b = _stacked(rng, 2, 4, 8, (3, 4))
    bias = [torch.tensor(rng.standard_normal((2, 3)), dtype=torch.float32), None]
    w = _wrapper((1, 0, 2), [1, 2])
    x = torch.tensor(rng.standard_normal((3, 8)), dtype=torch.float32)
    y = torch.zeros(3, 7)
    w.add_lora_linear(y, x, a, b, bias, 1.0, (3, 4))
    assert _rel(y.numpy(), _oracle_linear(torch.zeros(3, 7), x, a, b, bias, 1.0, [0, -1, 1], (3, 4))) < 1e-5
    buf = torch.tensor(rng.standard_normal((2, 3, 4)), dtype=torch.float32)
    y2 = torch.zeros(3, 9)
    w.add_expand(y2, buf, b, bias, (3, 4), np.int64(2), True)
    assert torch.equal(y2[:, :2], torch.zeros(3, 2)) and torch.equal(y2[1], torch.zeros(9))
    want = buf[0, 0].double().numpy() @ b[0][0, 0].double().numpy().T + bias[0][0].double().numpy()
    np.testing.assert_allclose(y2[0, 2:5].numpy(), want, rtol=1e-5, atol=1e-5)


def test_nonfinite_scale_refused():
    """Issue 22 (hostile leftovers): a NaN or infinite scale is refused (ValueError naming scale)
    by the wrapper and the ops."""
    rng = _rng(11)
    a, b = _stacked(rng, 2, 4, 8, (5,))
    w = _wrapper((1, 2), [1, 2])
    for bad in (float("nan"), float("inf")):
        with pytest.raises(ValueError, match="scale"):
            w.add_lora_linear(torch.zeros(2, 5), torch.zeros(2, 8), a, b, None, bad, (5,))
        with pytest.raises(ValueError, match="scale"):
            torch_lora.ops.bgmv_shrink(torch.zeros(2, 8), a[0], torch.tensor([0, 1]), bad, backend="torch")


def test_negative_host_lora_ranks_refused_naming_the_slot():
    """Issue 22: a negative lora_ranks value held on the host is refused, naming its slot."""
    rng = _rng(12)
    a, b = _stacked(rng, 3, 4, 8, (5,))
    w = _wrapper((1, 2), [1, 2, 3])
    with pytest.raises(ValueError, match=r"lora_ranks.*2|slot 2"):
        w.add_lora_linear(torch.zeros(2, 5), torch.zeros(2, 8), a, b, None, 1.0, (5,),
                          lora_ranks=torch.tensor([4, 4, -1], dtype=torch.int32))


def test_forcing_triton_without_interpreter_errors_and_backend_choice_is_logged():
    """contract section 8 + issue 17 (loggers) + issue 16 (import test): in a fresh interpreter, importing
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


# ===== issues 17 / 18: PEFT adapters

Q = "model.layers.0.self_attn.q_proj"


def _write_adapter(path, modules, *, r, lora_alpha, **config_extra):
    """A PEFT directory written by hand: {module: (A (r, in), B (out, r))} in PEFT's tensor names."""
    from safetensors.numpy import save_file
    os.makedirs(path, exist_ok=True)
    tensors = {}
    for m, (a, b) in modules.items():
        tensors[f"base_model.model.{m}.lora_A.weight"] = np.ascontiguousarray(a, np.float32)
        tensors[f"base_model.model.{m}.lora_B.weight"] = np.ascontiguousarray(b, np.float32)
    save_file(tensors, os.path.join(path, "adapter_model.safetensors"))
    cfg = {"peft_type": "LORA", "r": r, "lora_alpha": lora_alpha,
           "target_modules": sorted({m.rsplit(".", 1)[-1] for m in modules}), **config_extra}
    cfg = {k: v for k, v in cfg.items() if v is not _DROP}
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump(cfg, f)
    return str(path)


_DROP = object()


def _q_adapter(path, rank, seed, *, hidden=8, out=6, alpha=None, **extra):
    rng = _rng(seed)
    return _write_adapter(path, {Q: (rng.standard_normal((rank, hidden)), rng.standard_normal((out, rank)))},
                          r=rank, lora_alpha=alpha if alpha is not None else 2 * rank, **extra)


def test_load_peft_adapter_is_the_shared_reader_and_reads_scaling(tmp_path):
    """Issue 18 item 1: torch_lora.load_peft_adapter is lora_core's reader (one implementation with
    JAX); rsLoRA scaling alpha/sqrt(r); a missing lora_alpha means PEFT's default 8 (issue 17 note);
    adapter_tensors gives the factors as torch tensors."""
    import lora_core.peft
    assert torch_lora.load_peft_adapter is lora_core.peft.load_peft_adapter
    ad = torch_lora.load_peft_adapter(_q_adapter(tmp_path / "rs", 4, 0, alpha=8, use_rslora=True))
    assert math.isclose(ad.modules[Q].scaling, 8 / math.sqrt(4))
    ad = torch_lora.load_peft_adapter(_q_adapter(tmp_path / "noalpha", 4, 0, alpha=_DROP))
    assert math.isclose(ad.modules[Q].scaling, 8 / 4)
    tensors = torch_lora.adapter_tensors(ad)
    assert isinstance(tensors[Q].lora_a, torch.Tensor) and tuple(tensors[Q].lora_a.shape) == (4, 8)
    assert tuple(tensors[Q].lora_b.shape) == (6, 4)


@pytest.mark.parametrize("case", ["missing_config", "malformed_json", "list_config", "missing_r", "r_zero",
                                  "pickle_only", "truncated", "garbage", "empty", "huge_header", "alora",
                                  "symlink_outside", "untargeted_tensor"])
def test_bad_adapter_files_raise_adapter_error_naming_file_and_field(tmp_path, case):
    """Issue 17 (unclear errors, PEFT allowlist, files inside the directory, tensors of modules the
    config does not target refused) and issue 18 (bad adapter files): each is an AdapterError (a
    ValueError) naming the file and, for config problems, the field; `adapter_model.bin` is never
    unpickled."""
    d = _q_adapter(tmp_path / "ad", 4, 1)
    cfg_path = os.path.join(d, "adapter_config.json")
    st_path = os.path.join(d, "adapter_model.safetensors")
    cfg = json.load(open(cfg_path))
    expect = [os.path.basename(cfg_path)]
    if case == "missing_config":
        os.remove(cfg_path)
    elif case == "malformed_json":
        open(cfg_path, "w").write("{\"r\": 4,,}")
    elif case == "list_config":
        json.dump([cfg], open(cfg_path, "w"))
    elif case in ("missing_r", "r_zero", "alora"):
        if case == "missing_r":
            del cfg["r"]
        elif case == "r_zero":
            cfg["r"] = 0
        else:
            cfg["alora_invocation_tokens"] = [1, 2]
        json.dump(cfg, open(cfg_path, "w"))
        expect.append({"missing_r": "r", "r_zero": "r", "alora": "alora_invocation_tokens"}[case])
    elif case == "pickle_only":
        os.remove(st_path)
        open(os.path.join(d, "adapter_model.bin"), "wb").write(b"\x80\x04K\x01.")   # would unpickle to 1
        expect = ["adapter_model.bin"]
    elif case in ("truncated", "garbage", "empty", "huge_header"):
        data = open(st_path, "rb").read()
        new = {"truncated": data[: len(data) - 40], "garbage": os.urandom(200), "empty": b"",
               "huge_header": (2**40).to_bytes(8, "little") + b"{}"}[case]
        open(st_path, "wb").write(new)
        expect = ["adapter_model.safetensors"]
    elif case == "untargeted_tensor":          # a k_proj tensor while the config targets q_proj only
        from safetensors.numpy import save_file
        rng = _rng(2)
        save_file({f"base_model.model.{Q}.lora_A.weight": rng.standard_normal((4, 8)).astype(np.float32),
                   f"base_model.model.{Q}.lora_B.weight": rng.standard_normal((6, 4)).astype(np.float32),
                   "base_model.model.model.layers.0.self_attn.k_proj.lora_A.weight":
                       rng.standard_normal((4, 8)).astype(np.float32),
                   "base_model.model.model.layers.0.self_attn.k_proj.lora_B.weight":
                       rng.standard_normal((6, 4)).astype(np.float32)}, st_path)
        expect = ["adapter_model.safetensors", "k_proj"]
    elif case == "symlink_outside":
        outside = tmp_path / "elsewhere.safetensors"
        os.replace(st_path, outside)
        os.symlink(outside, st_path)
        expect = ["adapter_model.safetensors"]
    with pytest.raises(torch_lora.AdapterError) as info:
        torch_lora.load_peft_adapter(d)
    assert isinstance(info.value, ValueError)
    for word in expect:
        assert word in str(info.value), (word, str(info.value))


def _layers(max_loras=2, max_rank=4, hidden=8, out=6):
    from torch_lora.layers import LoRALinear
    return {"q": LoRALinear((Q,), hidden, (out,), max_loras=max_loras, max_rank=max_rank, dtype=torch.float32,
                            device="cpu")}


def test_adapter_manager_places_pads_scales_and_evicts_lru(tmp_path):
    """Issue 18 item 2: fixed slots (zero-padded to max_rank, scaling folded into B, per-slot real
    rank in lora_ranks), LRU eviction of the least recently used slot the batch does not need."""
    layers = _layers()
    mgr = torch_lora.AdapterManager(layers)
    dirs = {i: _q_adapter(tmp_path / f"a{i}", r, i) for i, r in ((1, 2), (2, 4), (3, 3))}
    for i, d in dirs.items():
        mgr.register(i, d)
    mgr.activate([1])
    mgr.activate([2])
    assert mgr.lora_index_to_id == [1, 2]
    s1 = mgr.slot_of(1)
    ad = torch_lora.load_peft_adapter(dirs[1])
    a, b, scaling, _ = ad.modules[Q]
    layer = layers["q"]
    np.testing.assert_allclose(layer.lora_a[0, s1, :2].numpy(), a, rtol=1e-6)
    assert torch.equal(layer.lora_a[0, s1, 2:], torch.zeros(2, 8))
    np.testing.assert_allclose(layer.lora_b[0][s1, :, :2].numpy(), b * scaling, rtol=1e-6)
    assert layer.lora_ranks.tolist()[s1] == 2 and layer.lora_ranks.tolist()[mgr.slot_of(2)] == 4
    mgr.activate([1])                   # 1 used more recently than 2
    mgr.activate([3])                   # evicts 2
    assert mgr.slot_of(2) is None and mgr.slot_of(1) == s1 and mgr.slot_of(3) is not None
    assert mgr.stats["evictions"] == 1
    assert layer.lora_ranks.tolist()[mgr.slot_of(3)] == 3
    with pytest.raises(ValueError):
        mgr.activate([1, 2, 3])         # more adapters than slots


def test_adapter_manager_hot_swap_same_slot_and_bad_adapter_changes_nothing(tmp_path):
    """Issue 18 item 2: registering an id again hot-swaps it (same slot, new weights); a bad adapter
    (rank above max_rank) raises AdapterError and leaves every slot and weight intact."""
    layers = _layers()
    mgr = torch_lora.AdapterManager(layers)
    mgr.register(1, _q_adapter(tmp_path / "a", 2, 1))
    mgr.activate([1])
    slot = mgr.slot_of(1)
    new = _q_adapter(tmp_path / "b", 3, 7)
    mgr.register(1, new)
    assert mgr.slot_of(1) == slot
    a_new = torch_lora.load_peft_adapter(new).modules[Q].lora_a
    np.testing.assert_allclose(layers["q"].lora_a[0, slot, :3].numpy(), a_new, rtol=1e-6)
    assert layers["q"].lora_ranks.tolist()[slot] == 3
    before = [t.clone() for t in (layers["q"].lora_a, layers["q"].lora_b[0], layers["q"].lora_ranks)]
    with pytest.raises(torch_lora.AdapterError, match="max_rank"):
        mgr.register(1, _q_adapter(tmp_path / "big", 6, 3))
    with pytest.raises(torch_lora.AdapterError):
        mgr.register(2, _q_adapter(tmp_path / "wide", 2, 3, hidden=9))
    after = (layers["q"].lora_a, layers["q"].lora_b[0], layers["q"].lora_ranks)
    assert all(torch.equal(x, y) for x, y in zip(before, after))
    assert mgr.lora_index_to_id[slot] == 1 and 2 not in mgr.registered


def test_failed_reload_inside_activate_leaves_lru_intact(tmp_path):
    """Issue 17 item 6: a reload failing inside activate() changes nothing (the would-be victim stays
    in its slot and on the LRU list); afterwards the right adapter is evicted and a 2-slot batch of
    2 adapters still activates. Issue 22: the AdapterError names the adapter as registered and its
    directory."""
    layers = _layers()
    mgr = torch_lora.AdapterManager(layers, host_cache_size=1)
    d3 = _q_adapter(tmp_path / "three", 2, 3)
    mgr.register(1, _q_adapter(tmp_path / "one", 2, 1))
    mgr.register(2, _q_adapter(tmp_path / "two", 2, 2))
    mgr.register(3, d3, name="my-third")
    mgr.activate([1])
    mgr.activate([2])               # host cache (size 1) now holds 2 only: 3 reloads from disk
    cfg = json.load(open(os.path.join(d3, "adapter_config.json")))
    cfg["r"] = 99
    json.dump(cfg, open(os.path.join(d3, "adapter_config.json"), "w"))
    state = (mgr.lora_index_to_id, layers["q"].lora_a.clone())
    with pytest.raises(torch_lora.AdapterError) as info:
        mgr.activate([3])
    assert "my-third" in str(info.value) and str(tmp_path / "three") in str(info.value)
    assert mgr.lora_index_to_id == state[0] and torch.equal(layers["q"].lora_a, state[1])
    mgr.register(3, _q_adapter(tmp_path / "three-b", 2, 3), name="my-third")
    mgr.activate([2, 3])            # 1 is the least recently used and not needed: evicted
    assert mgr.slot_of(1) is None and mgr.slot_of(2) is not None and mgr.slot_of(3) is not None


def test_unload_zeroes_the_slot_and_rank(tmp_path):
    """docs/torch.md (issue 18 manager): unload zeroes the slot, rank 0; the adapter stays registered."""
    layers = _layers()
    mgr = torch_lora.AdapterManager(layers)
    mgr.register(1, _q_adapter(tmp_path / "a", 4, 1))
    slot = mgr.load(1)
    assert layers["q"].lora_a[0, slot].abs().sum() > 0
    mgr.unload(1)
    assert mgr.lora_index_to_id[slot] is None
    assert torch.equal(layers["q"].lora_a[0, slot], torch.zeros(4, 8))
    assert torch.equal(layers["q"].lora_b[0][slot], torch.zeros(6, 4))
    assert layers["q"].lora_ranks.tolist()[slot] == 0
    assert 1 in mgr.registered


# ===== issue 18: Hugging Face models

ALL7 = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _tiny_llama(seed=0, **extra):
    import transformers
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                   tie_word_embeddings=False, **extra)
    return transformers.LlamaForCausalLM(cfg).eval()


def _save_peft(model_factory, path, seed, **lora_kw):
    """An adapter made and saved by peft itself (B not zero: init_lora_weights=False)."""
    import peft
    torch.manual_seed(seed)
    lora = peft.get_peft_model(model_factory(), peft.LoraConfig(init_lora_weights=False, **lora_kw))
    lora.save_pretrained(str(path))
    return str(path)


@pytest.fixture(scope="module")
def llama_assets(tmp_path_factory):
    """A tiny random Llama's state and three peft adapters: a regex on one layer's q/v (rank 4);
    all seven projections with rank_pattern / alpha_pattern (rank 8); rsLoRA on q/o, embed_tokens
    and lm_head (rank 4)."""
    root = tmp_path_factory.mktemp("llama")
    state = _tiny_llama().state_dict()

    def fresh():
        m = _tiny_llama()
        m.load_state_dict(state)
        return m
    dirs = {
        "sql": _save_peft(fresh, root / "sql", 1, r=4, lora_alpha=8,
                          target_modules=r"model\.layers\.1\.self_attn\.(q_proj|v_proj)"),
        "chat": _save_peft(fresh, root / "chat", 2, r=8, lora_alpha=16, target_modules=ALL7,
                           rank_pattern={"down_proj": 4}, alpha_pattern={"o_proj": 32}),
        "code": _save_peft(fresh, root / "code", 3, r=4, lora_alpha=4, use_rslora=True,
                           target_modules=["q_proj", "o_proj", "embed_tokens", "lm_head"]),
    }
    fresh().save_pretrained(str(root / "model"))
    dirs["_model"] = str(root / "model")
    return fresh, dirs


def _peft_model(fresh, dirs):
    import peft
    names = list(dirs)
    pm = peft.PeftModel.from_pretrained(fresh(), dirs[names[0]], adapter_name=names[0]).eval()
    for n in names[1:]:
        pm.load_adapter(dirs[n], adapter_name=n)
    return pm


def _peft_logits(pm, ids, name):
    with torch.no_grad():
        if name == "__base__":
            with pm.disable_adapter():
                return pm(ids).logits
        pm.set_adapter(name)
        return pm(ids).logits


@pytest.fixture(scope="module")
def served(llama_assets):
    """One MultiLoRAModel (torch backend) with the three adapters, and peft with the same three."""
    from torch_lora.hf import MultiLoRAModel
    fresh, dirs = llama_assets
    mm = MultiLoRAModel(fresh(), max_loras=4, max_rank=8, target_modules=ALL7 + ["embed_tokens", "lm_head"],
                        backend="torch")
    adapters = {n: d for n, d in dirs.items() if not n.startswith("_")}
    for n, d in adapters.items():
        mm.load_adapter(n, d)
    return mm, _peft_model(fresh, adapters)


def test_mixed_batch_equals_peft_per_row(served):
    """Issue 18 item 3 / tests: one mixed batch (one adapter per row, '__base__' rows) equals peft
    running each row with its adapter alone: fp32 logits within 1e-4 relative, same greedy tokens;
    regex target_modules, rank/alpha patterns, rsLoRA, embed_tokens and lm_head LoRA."""
    mm, pm = served
    names = ["sql", "__base__", "chat", "code", "chat"]
    ids = torch.tensor(_rng(20).integers(1, 64, size=(5, 6)))
    out = mm(ids, adapter_names=names)
    for j, n in enumerate(names):
        ref = _peft_logits(pm, ids[j:j + 1], n)[0]
        got = out.logits[j]
        assert float((got - ref).abs().max() / ref.abs().max()) < 1e-4, n
        assert torch.equal(got.argmax(-1), ref.argmax(-1)), n
    base = _peft_logits(pm, ids[:1], "__base__")[0]
    for j, n in enumerate(names):
        if n != "__base__":
            assert float((out.logits[j] - _peft_logits(pm, ids[j:j + 1], "__base__")[0]).abs().max()) > 1e-3, n
    assert base.shape == out.logits[0].shape


def test_mixed_batch_with_padding_equals_peft_mixed_batch(served):
    """Issue 18 ('a drop-in' for peft's `model(input_ids, adapter_names=[...])`): a left-padded mixed
    batch with an attention mask gives peft's own mixed-batch logits (fp32, 1e-4)."""
    mm, pm = served
    ids = torch.tensor(_rng(29).integers(1, 64, size=(3, 6)))
    mask = torch.ones_like(ids)
    mask[0, :2] = 0
    mask[2, :1] = 0
    names = ["chat", "__base__", "code"]
    got = mm(ids, attention_mask=mask, adapter_names=names).logits
    with torch.no_grad():
        ref = pm(input_ids=ids, attention_mask=mask, adapter_names=names).logits
    assert float((got - ref).abs().max() / ref.abs().max()) < 1e-4


def test_generate_mixed_adapters_equals_peft_per_request(served):
    """Issue 18 item 3: generate(input_ids, adapter_names=...) keeps each row's adapter for the whole
    generation; greedy tokens equal peft's generate for each request alone."""
    mm, pm = served
    names = ["code", "__base__", "sql"]
    ids = torch.tensor(_rng(21).integers(1, 64, size=(3, 5)))
    seqs = mm.generate(ids, attention_mask=torch.ones_like(ids), adapter_names=names, max_new_tokens=4,
                       do_sample=False, pad_token_id=0)
    for j, n in enumerate(names):
        with torch.no_grad():
            if n == "__base__":
                with pm.disable_adapter():
                    ref = pm.generate(input_ids=ids[j:j + 1], attention_mask=torch.ones_like(ids[j:j + 1]),
                                      max_new_tokens=4, do_sample=False, pad_token_id=0)
            else:
                pm.set_adapter(n)
                ref = pm.generate(input_ids=ids[j:j + 1], attention_mask=torch.ones_like(ids[j:j + 1]),
                                  max_new_tokens=4, do_sample=False, pad_token_id=0)
        assert seqs[j].tolist() == ref[0].tolist(), n


def test_groups_are_one_call_and_named_by_members(served):
    """docs/torch.md (issue 18 item 3: q/k/v and gate/up fused into one multi-slice call): the group
    layers are named parent + members joined by '+', and a decoder layer costs four add_lora_linear
    calls (q/k/v, o, gate/up, down) under no_grad."""
    mm, _ = served
    assert "model.layers.0.self_attn.q_proj+k_proj+v_proj" in mm.layers
    assert "model.layers.1.mlp.gate_proj+up_proj" in mm.layers
    calls = []
    original = mm.punica.add_lora_linear

    def counting(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)
    mm.punica.add_lora_linear = counting
    try:
        mm(torch.ones(2, 3, dtype=torch.long), adapter_names=["chat", "sql"])
    finally:
        del mm.punica.add_lora_linear
    assert len(calls) == 4 * 2


def test_inference_mode_gives_the_no_grad_result(served):
    """Issue 22 (product-layer edge pass): under torch.inference_mode() the grouped q/k/v and
    gate/up layers work and give the same logits as under no_grad."""
    mm, _ = served
    ids = torch.tensor(_rng(22).integers(1, 64, size=(3, 4)))
    names = ["chat", "sql", "__base__"]
    want = mm(ids, adapter_names=names).logits
    with torch.inference_mode():
        got = mm(ids, adapter_names=names).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_logits_to_keep_and_generate_inputs_keyword(served):
    """docs/torch.md (lm_head LoRA follows logits_to_keep row by row: an int or a 1-D tensor) and
    issue 22 (generate(inputs=...) raised): logits_to_keep=1 / [1, 3] equal those rows of the full
    logits; generate(inputs=ids) equals generate(ids)."""
    mm, _ = served
    ids = torch.tensor(_rng(23).integers(1, 64, size=(2, 5)))
    names = ["code", "chat"]
    full = mm(ids, adapter_names=names).logits
    last = mm(ids, adapter_names=names, logits_to_keep=1).logits
    torch.testing.assert_close(last[:, -1], full[:, -1], rtol=1e-5, atol=1e-5)
    picked = mm(ids, adapter_names=names, logits_to_keep=torch.tensor([1, 3])).logits
    torch.testing.assert_close(picked, full[:, [1, 3]], rtol=1e-5, atol=1e-5)
    kw = dict(adapter_names=["code", "sql"], max_new_tokens=2, do_sample=False, pad_token_id=0,
              attention_mask=torch.ones_like(ids))
    assert torch.equal(mm.generate(inputs=ids, **kw), mm.generate(ids, **kw))


def test_direct_model_call_with_another_shape_is_refused(served):
    """docs/torch.md ('A step'): a layer refuses an input whose token count differs from the prepared
    one, so a direct model call cannot silently use another batch's mapping."""
    mm, _ = served
    mm.prepare_step(["chat", "sql"], 3)
    with torch.no_grad(), pytest.raises(ValueError, match="prepare_step"):
        mm.model(input_ids=torch.ones(2, 5, dtype=torch.long))


def test_unknown_adapter_name_and_wrong_row_count_are_clear(served):
    """Issue 18 (PEFT convention: one name per row): an unknown name or a name list of the wrong
    length raises a ValueError naming the problem."""
    mm, _ = served
    ids = torch.ones(2, 3, dtype=torch.long)
    with pytest.raises(ValueError, match="nope"):
        mm(ids, adapter_names=["chat", "nope"])
    with pytest.raises(ValueError, match="adapter_names"):
        mm(ids, adapter_names=["chat"])


def test_hot_swap_unload_and_refusals_keep_loaded_adapters(llama_assets, tmp_path):
    """Issue 18 item 3 / docs/torch.md: load_adapter of a loaded name hot-swaps it (same slot, new
    outputs); an adapter targeting a module outside target_modules is refused naming the module
    and target_modules; a rank above max_rank is refused; nothing changes on failure;
    unload_adapter forgets the name."""
    from torch_lora.hf import MultiLoRAModel
    fresh, dirs = llama_assets
    mm = MultiLoRAModel(fresh(), max_loras=2, max_rank=4, target_modules=["q_proj", "v_proj"], backend="torch")
    mm.load_adapter("a", dirs["sql"])
    ids = torch.tensor(_rng(24).integers(1, 64, size=(1, 5)))
    before = mm(ids, adapter_names=["a"]).logits
    slot = mm.adapters.slot_of(1)
    with pytest.raises(torch_lora.AdapterError, match="o_proj|embed_tokens|lm_head") as info:
        mm.load_adapter("b", dirs["code"])           # targets o_proj, embed_tokens, lm_head
    assert "target_modules" in str(info.value)
    with pytest.raises(torch_lora.AdapterError, match="max_rank"):
        mm.load_adapter("a", _save_peft(fresh, tmp_path / "big", 4, r=8, lora_alpha=8, target_modules=["q_proj"]))
    assert mm.loaded_adapters == ["a"]
    torch.testing.assert_close(mm(ids, adapter_names=["a"]).logits, before, rtol=0, atol=0)
    other = _save_peft(fresh, tmp_path / "sql2", 9, r=4, lora_alpha=8, target_modules=["q_proj"])
    mm.load_adapter("a", other)
    assert mm.adapters.slot_of(1) == slot
    swapped = mm(ids, adapter_names=["a"]).logits
    assert float((swapped - before).abs().max()) > 1e-4
    pm = _peft_model(fresh, {"a": other})
    ref = _peft_logits(pm, ids, "a")
    assert float((swapped - ref).abs().max() / ref.abs().max()) < 1e-4
    mm.unload_adapter("a")
    assert mm.loaded_adapters == []
    with pytest.raises(ValueError, match="'a'"):
        mm(ids, adapter_names=["a"])


def test_target_modules_that_match_nothing_raise(llama_assets):
    """docs/torch.md ('What gets LoRA'): a target name matching nothing raises (a typo never yields
    a model without adapters)."""
    from torch_lora.hf import MultiLoRAModel
    fresh, _ = llama_assets
    with pytest.raises(ValueError, match="q_prj"):
        MultiLoRAModel(fresh(), max_loras=2, max_rank=4, target_modules=["q_prj"], backend="torch")
    with pytest.raises(ValueError, match="q_prj"):
        MultiLoRAModel(fresh(), max_loras=2, max_rank=4, target_modules=["q_proj", "q_prj"], backend="torch")


def test_wrapping_keeps_the_model_and_unwrap_restores_it(llama_assets):
    """docs/torch.md ('How it is wrapped'): no module is replaced -- class, state_dict keys and
    parameters stay; unwrap() removes the hooks (base outputs again) and the model can be wrapped
    again; a model wrapped twice is refused."""
    from torch_lora.hf import MultiLoRAModel
    fresh, dirs = llama_assets
    model = fresh()
    keys = list(model.state_dict())
    ids = torch.tensor(_rng(25).integers(1, 64, size=(1, 4)))
    with torch.no_grad():
        base = model(ids).logits
    mm = MultiLoRAModel(model, max_loras=2, max_rank=8, backend="torch")
    assert type(mm.model).__name__ == "LlamaForCausalLM" and list(model.state_dict()) == keys
    with pytest.raises(ValueError, match="unwrap"):
        MultiLoRAModel(model, max_loras=2, max_rank=8, backend="torch")
    mm.load_adapter("chat", dirs["chat"])
    assert float((mm(ids, adapter_names=["chat"]).logits - base).abs().max()) > 1e-4
    assert mm.unwrap() is model
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, base, rtol=0, atol=0)
    MultiLoRAModel(model, max_loras=2, max_rank=8, backend="torch").unwrap()


def test_wrapped_inside_inference_mode_loads_and_serves_outside(llama_assets):
    """Issue 22: a model wrapped inside torch.inference_mode() can load adapters outside it."""
    from torch_lora.hf import MultiLoRAModel
    fresh, dirs = llama_assets
    with torch.inference_mode():
        mm = MultiLoRAModel(fresh(), max_loras=2, max_rank=8, backend="torch")
    mm.load_adapter("chat", dirs["chat"])
    ids = torch.tensor(_rng(26).integers(1, 64, size=(1, 4)))
    ref = _peft_logits(_peft_model(fresh, {"chat": dirs["chat"]}), ids, "chat")
    got = mm(ids, adapter_names=["chat"]).logits
    assert float((got - ref).abs().max() / ref.abs().max()) < 1e-4


def test_dora_adapter_refused_without_dora_true(llama_assets, tmp_path):
    """Issue 19 / docs/torch.md: without dora=True, load_adapter of a use_dora adapter raises
    AdapterError naming the adapter and saying to build with dora=True; nothing changes."""
    from torch_lora.hf import MultiLoRAModel
    fresh, dirs = llama_assets
    d = _save_peft(fresh, tmp_path / "dora", 5, r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                   use_dora=True)
    mm = MultiLoRAModel(fresh(), max_loras=2, max_rank=8, backend="torch")
    mm.load_adapter("sql", dirs["sql"])
    with pytest.raises(torch_lora.AdapterError, match="dora=True") as info:
        mm.load_adapter("my-dora", d)
    assert "my-dora" in str(info.value)
    assert mm.loaded_adapters == ["sql"]


def _family_model(family, seed=0):
    import transformers
    torch.manual_seed(seed)
    common = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False)
    if family == "qwen2":
        return transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**common)).eval()
    if family == "mistral":
        return transformers.MistralForCausalLM(transformers.MistralConfig(**common)).eval()
    if family == "gemma":
        return transformers.GemmaForCausalLM(transformers.GemmaConfig(head_dim=8, **common)).eval()
    raise ValueError(family)


@pytest.mark.parametrize("family", ["qwen2", "gemma"])
def test_other_families_mixed_batch_equals_peft(family, tmp_path):
    """Issue 18 item 3: Qwen2 (biased q/k/v) and Gemma (scaled embedding, LoRA on embed_tokens) as
    the installed transformers defines them: a mixed batch with two adapters (one restricted by
    layers_to_transform) and a base row equals peft per row (fp32, 1e-4)."""
    from torch_lora.hf import MultiLoRAModel
    state = _family_model(family).state_dict()

    def fresh():
        m = _family_model(family)
        m.load_state_dict(state)
        return m
    dirs = {"x": _save_peft(fresh, tmp_path / "x", 1, r=4, lora_alpha=8, target_modules=ALL7, layers_to_transform=[1]),
            "y": _save_peft(fresh, tmp_path / "y", 2, r=2, lora_alpha=4, use_rslora=True,
                            target_modules=["k_proj", "up_proj", "embed_tokens"])}
    mm = MultiLoRAModel(fresh(), max_loras=2, max_rank=4, target_modules=ALL7 + ["embed_tokens"], backend="torch")
    for n, d in dirs.items():
        mm.load_adapter(n, d)
    pm = _peft_model(fresh, dirs)
    ids = torch.tensor(_rng(27).integers(1, 64, size=(3, 5)))
    names = ["y", "x", "__base__"]
    out = mm(ids, adapter_names=names).logits
    for j, n in enumerate(names):
        ref = _peft_logits(pm, ids[j:j + 1], n)[0]
        assert float((out[j] - ref).abs().max() / ref.abs().max()) < 1e-4, n
        if n != "__base__":
            assert float((ref - _peft_logits(pm, ids[j:j + 1], "__base__")[0]).abs().max()) > 1e-4


def test_dora_mixed_with_lora_and_base_rows_equals_peft(tmp_path):
    """Issue 19 item 2 / docs/torch.md 'DoRA adapters': MultiLoRAModel(dora=True) serves a use_dora
    adapter, a plain LoRA adapter and '__base__' rows in one batch, each row equal to peft (fp32,
    1e-4), on a Llama with biased attention; plain LoRA and base rows are bit for bit what a model
    without dora=True gives; generate() keeps each row's adapter too."""
    from torch_lora.hf import MultiLoRAModel
    state = _tiny_llama(attention_bias=True).state_dict()

    def fresh():
        m = _tiny_llama(attention_bias=True)
        m.load_state_dict(state)
        return m
    dirs = {"dora": _save_peft(fresh, tmp_path / "dora", 1, r=4, lora_alpha=8, use_dora=True,
                               target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "down_proj"]),
            "plain": _save_peft(fresh, tmp_path / "plain", 2, r=4, lora_alpha=8, target_modules=["q_proj", "o_proj"])}
    mm = MultiLoRAModel(fresh(), max_loras=2, max_rank=4, target_modules=ALL7, backend="torch", dora=True)
    for n, d in dirs.items():
        mm.load_adapter(n, d)
    pm = _peft_model(fresh, dirs)
    ids = torch.tensor(_rng(28).integers(1, 64, size=(4, 5)))
    names = ["dora", "__base__", "plain", "dora"]
    out = mm(ids, adapter_names=names).logits
    for j, n in enumerate(names):
        ref = _peft_logits(pm, ids[j:j + 1], n)[0]
        assert float((out[j] - ref).abs().max() / ref.abs().max()) < 1e-4, n
    assert float((out[0] - _peft_logits(pm, ids[:1], "__base__")[0]).abs().max()) > 1e-4   # DoRA is active
    plain_model = MultiLoRAModel(fresh(), max_loras=2, max_rank=4, target_modules=ALL7, backend="torch")
    plain_model.load_adapter("plain", dirs["plain"])
    same = plain_model(ids, adapter_names=["__base__", "__base__", "plain", "__base__"]).logits
    assert torch.equal(out[1:3], same[1:3])   # plain LoRA and base rows: exactly what dora=False gives
    kw = dict(max_new_tokens=3, do_sample=False, pad_token_id=0)
    seqs = mm.generate(ids[:2], attention_mask=torch.ones_like(ids[:2]), adapter_names=["dora", "plain"], **kw)
    for j, n in enumerate(["dora", "plain"]):
        pm.set_adapter(n)
        with torch.no_grad():
            ref = pm.generate(input_ids=ids[j:j + 1], attention_mask=torch.ones_like(ids[j:j + 1]), **kw)
        assert seqs[j].tolist() == ref[0].tolist(), n


# ===== issue 19: batch invariance, seed methods, DoRA scale

def test_deterministic_wrapper_gives_a_token_bitwise_the_same_row_in_any_batch():
    """Issue 19 item 1: with deterministic=True a token's add_lora_linear row (and its shrink row)
    is bitwise the same whatever the batch size, its position, the other tokens and their
    adapters, and from run to run (torch backend)."""
    rng = _rng(30)
    num_slots, hidden, widths = 4, 64, (24, 8)
    a, b = _stacked(rng, num_slots, 8, hidden, widths)
    probe = torch.tensor(rng.standard_normal((1, hidden)), dtype=torch.float32)
    rows, shrinks = [], []
    for trial, size in enumerate([1, 3, 17, 40, 40]):
        ids = [int(i) for i in rng.integers(0, num_slots + 1, size=size)]
        pos = int(rng.integers(0, size))
        ids[pos] = 2
        w = PunicaWrapper(64, 8, "cpu", max_loras=num_slots, backend="torch", deterministic=True)
        w.update_metadata(LoRAMapping(tuple(ids), tuple(ids)), [1, 2, 3, 4], num_slots + 1, 16)
        x = torch.tensor(rng.standard_normal((size, hidden)), dtype=torch.float32)
        x[pos] = probe[0]
        y = torch.zeros(size, sum(widths))
        w.add_lora_linear(y, x, a, b, None, 0.7, widths)
        rows.append(y[pos].clone())
        buf = torch.zeros(2, size, 8)
        w.add_shrink(buf, x, a, 0.7)
        shrinks.append(buf[:, pos].clone())
    for r in rows[1:]:
        assert torch.equal(r, rows[0])
    for s in shrinks[1:]:
        assert torch.equal(s, shrinks[0])
    want = _oracle_linear(torch.zeros(1, 32), probe, a, b, None, 0.7, [1], widths)
    assert _rel(rows[0].numpy()[None], want) < 1e-5


def test_deterministic_ops_and_type_check():
    """Issue 19 item 1 / docs/api.md: deterministic= on the ops (bgmv_shrink here) gives a token
    the same bits in any batch; anything but a bool is a TypeError; default off."""
    rng = _rng(31)
    w3 = torch.tensor(rng.standard_normal((3, 8, 64)), dtype=torch.float32)
    probe = torch.tensor(rng.standard_normal(64), dtype=torch.float32)
    outs = []
    for size in (1, 9, 33):
        x = torch.tensor(rng.standard_normal((size, 64)), dtype=torch.float32)
        x[-1] = probe
        idx = torch.tensor(rng.integers(-1, 3, size=size), dtype=torch.int32)
        idx[-1] = 1
        outs.append(torch_lora.ops.bgmv_shrink(x, w3, idx, 1.0, backend="torch", deterministic=True)[-1])
    assert all(torch.equal(o, outs[0]) for o in outs)
    with pytest.raises(TypeError, match="deterministic"):
        PunicaWrapper(8, 2, "cpu", max_loras=2, backend="torch", deterministic="yes")
    assert PunicaWrapper(8, 2, "cpu", max_loras=2, backend="torch").deterministic is False


def test_seed_shrink_expand_expand_slice_methods():
    """Issue 19 item 3 / docs/api.md: vLLM's TPU wrapper's shrink(x, w_t_all, scale), expand(y, x, w_t_all,
    add_inputs) and expand_slice(y, x, w_t_all, y_offset, y_slice_size, add_inputs) on the torch
    wrapper, with the token's slot from the step's metadata; expand cuts a wider output to y;
    expand_slice needs y_slice_size == n; add_inputs has no default."""
    rng = _rng(32)
    ids = (2, 0, 1, 2)
    idx = [1, -1, 0, 1]
    w = _wrapper(ids, [1, 2])
    x = torch.tensor(rng.standard_normal((4, 8)), dtype=torch.float32)
    wa = torch.tensor(rng.standard_normal((2, 1, 3, 8)), dtype=torch.float32)
    s = w.shrink(x, wa, 0.5)
    assert tuple(s.shape) == (4, 3) and s.dtype == torch.float32
    for t, i in enumerate(idx):
        want = np.zeros(3) if i < 0 else 0.5 * x[t].double().numpy() @ wa[i, 0].double().numpy().T
        np.testing.assert_allclose(s[t].numpy(), want, rtol=1e-5, atol=1e-6)
    wb = torch.tensor(rng.standard_normal((2, 7, 3)), dtype=torch.float32)
    y = torch.full((4, 5), 2.0)
    assert w.expand(y, s, wb, True) is y
    for t, i in enumerate(idx):
        want = np.full(5, 2.0) if i < 0 else 2.0 + (s[t].double().numpy() @ wb[i].double().numpy().T)[:5]
        np.testing.assert_allclose(y[t].numpy(), want, rtol=1e-5, atol=1e-5)
    y = torch.full((4, 9), 2.0)
    w.expand_slice(y, s, wb, 1, 7, False)
    for t, i in enumerate(idx):
        want = np.full(9, 2.0)
        if i >= 0:
            want[1:8] = s[t].double().numpy() @ wb[i].double().numpy().T
        np.testing.assert_allclose(y[t].numpy(), want, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="y_slice_size"):
        w.expand_slice(y, s, wb, 1, 6, False)
    with pytest.raises(TypeError):
        w.expand(y, s, wb)


def test_dora_scale_stacked_in_the_epilogue_and_bias_plus_scale_refused():
    """Issue 19 item 2 / docs/api.md: add_lora_linear(..., dora_scale_stacked=) gives a token with
    slot i g_s[i] * (y + delta) in its slice (rows without LoRA untouched); a slice with both a
    LoRA bias and a DoRA scale is refused naming lora_bias_stacked and dora_scale_stacked."""
    rng = _rng(33)
    widths = (4, 3)
    a, b = _stacked(rng, 2, 2, 8, widths)
    g = [torch.tensor(rng.uniform(0.5, 1.5, (2, n)), dtype=torch.float32) for n in widths]
    w = _wrapper((1, 0, 2), [1, 2])
    x = torch.tensor(rng.standard_normal((3, 8)), dtype=torch.float32)
    y0 = torch.tensor(rng.standard_normal((3, 7)), dtype=torch.float32)
    y = y0.clone()
    w.add_lora_linear(y, x, a, b, None, 1.0, widths, dora_scale_stacked=g)
    plain = _oracle_linear(y0, x, a, b, None, 1.0, [0, -1, 1], widths)
    want = plain.copy()
    for t, i in enumerate([0, -1, 1]):
        if i >= 0:
            want[t] *= np.concatenate([g[0][i].double().numpy(), g[1][i].double().numpy()])
    assert _rel(y.numpy(), want) < 1e-5
    assert torch.equal(y[1], y0[1])
    bias = [torch.zeros(2, 4), None]
    with pytest.raises(ValueError, match=r"lora_bias_stacked\[0\].*dora_scale_stacked\[0\]|"
                                         r"dora_scale_stacked\[0\].*lora_bias_stacked\[0\]"):
        w.add_lora_linear(y, x, a, b, bias, 1.0, widths, dora_scale_stacked=[g[0], None])


# ===== issue 20: tensor-parallel layers over gloo

_TP_WORKER = r'''
import os, sys, numpy as np, torch, torch.distributed as dist
import torch_lora
from torch_lora import LoRAMapping
from torch_lora.parallel import (ColumnParallelLinearWithLoRA, ParallelLMHeadWithLoRA, QKVParallelLinearWithLoRA,
                                 RowParallelLinearWithLoRA)
from torch_lora.adapters import save_peft_adapter

rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
dist.init_process_group("gloo", rank=rank, world_size=world)
H, N_COL, N_ROW, R = 16, 8, 12, 4
rng = np.random.default_rng(0)                                   # same full weights on every rank
W_col, W_row = rng.standard_normal((N_COL, H)), rng.standard_normal((N_ROW, H))
adapters = {0: (rng.standard_normal((2, H)), rng.standard_normal((N_COL, 2)), rng.standard_normal((N_ROW, 2))),
            1: (rng.standard_normal((4, H)), rng.standard_normal((N_COL, 4)), rng.standard_normal((N_ROW, 4)))}
x = rng.standard_normal((5, H))
slots = [0, -1, 1, 0, 1]                                          # per token; -1 = no LoRA
ids = [{0: 1, 1: 2, -1: 0}[s] for s in slots]
SCALE = 0.5

def expected(W, which):
    y = x @ W.T
    for t, s in enumerate(slots):
        if s >= 0:
            A, B = adapters[s][0], adapters[s][which]
            y[t] += SCALE * (x[t] @ A.T) @ B.T
    return y

cols = slice(rank * N_COL // world, (rank + 1) * N_COL // world)
ins = slice(rank * H // world, (rank + 1) * H // world)

class RowBase(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.tensor(W_row[:, ins], dtype=torch.float32), requires_grad=False)
    def forward(self, xp):
        y = xp @ self.weight.T
        dist.all_reduce(y)
        return y

def punica():
    w = torch_lora.PunicaWrapper(16, 4, "cpu", max_loras=2, backend="torch")
    w.update_metadata(LoRAMapping(tuple(ids), tuple(ids)), [1, 2], 3, 32)
    return w

failures = []
for fs in (False, True):
    base = torch.nn.Linear(H, N_COL // world, bias=False)
    base.weight.data = torch.tensor(W_col[cols], dtype=torch.float32)
    col = ColumnParallelLinearWithLoRA(base, input_size=H, output_size=N_COL, max_loras=2, max_rank=R,
                                       fully_sharded=fs)
    row = RowParallelLinearWithLoRA(RowBase(), input_size=H, output_size=N_ROW, max_loras=2, max_rank=R,
                                    fully_sharded=fs)
    for layer in (col, row):
        layer.set_mapping(punica())
    for s, (A, Bc, Br) in adapters.items():
        col.set_lora(s, A, Bc, scaling=SCALE)
        row.set_lora(s, A, Br, scaling=SCALE)
    with torch.no_grad():
        yc = col(torch.tensor(x, dtype=torch.float32)).double().numpy()
        yr = row(torch.tensor(x[:, ins], dtype=torch.float32)).double().numpy()
    for name, got, want in (("column", yc, expected(W_col, 1)[:, cols]), ("row", yr, expected(W_row, 2))):
        err = np.linalg.norm(got - want) / np.linalg.norm(want)
        if not err < 1e-5:
            failures.append(f"{name} fully_sharded={fs}: rel err {err}")
    # rows without an adapter are the base layer's output bit for bit
    with torch.no_grad():
        plain = base(torch.tensor(x, dtype=torch.float32))[1:2].double().numpy()
    if not np.array_equal(yc[1:2], plain):
        failures.append(f"column fully_sharded={fs}: no-LoRA row changed")

# QKV with fewer kv heads than ranks (each kv head replicated) and an LM head whose last shard is padded
NH, NKV, HD, V = 4, 1, 2, 7
Wq, Wk, Wv, W_head = (rng.standard_normal((n, H)) for n in (NH * HD, NKV * HD, NKV * HD, V))
qkv_ad = {s: [(rng.standard_normal((r, H)), rng.standard_normal((n, r))) for n in (NH * HD, NKV * HD, NKV * HD)]
          for s, r in ((0, 2), (1, 4))}
head_ad = {s: (rng.standard_normal((r, H)), rng.standard_normal((V, r))) for s, r in ((0, 2), (1, 4))}
q_rows = slice(rank * NH * HD // world, (rank + 1) * NH * HD // world)
part = -(-V // world)
v_rows = slice(rank * part, min((rank + 1) * part, V))

class Fixed(torch.nn.Module):
    def __init__(self, W):
        super().__init__()
        self.W = torch.tensor(W, dtype=torch.float32)
    def forward(self, h):
        return h @ self.W.T

head_w = np.zeros((part, H))
head_w[: v_rows.stop - v_rows.start] = W_head[v_rows]
for fs in (False, True):
    qkv = QKVParallelLinearWithLoRA(Fixed(np.concatenate([Wq[q_rows], Wk, Wv])), input_size=H, num_heads=NH,
                                    num_kv_heads=NKV, head_size=HD, max_loras=2, max_rank=R, fully_sharded=fs)
    head = ParallelLMHeadWithLoRA(Fixed(head_w), input_size=H, vocab_size=V, max_loras=2, max_rank=R,
                                  fully_sharded=fs)
    for layer in (qkv, head):
        layer.set_mapping(punica())
    for s in (0, 1):
        qkv.set_lora(s, [f[0] for f in qkv_ad[s]], [f[1] for f in qkv_ad[s]], scaling=SCALE)
        head.set_lora(s, *head_ad[s], scaling=SCALE)
    with torch.no_grad():
        got_qkv = qkv(torch.tensor(x, dtype=torch.float32)).double().numpy()
        got_head = head(torch.tensor(x, dtype=torch.float32)).double().numpy()
    want = []
    for k, (W, rows) in enumerate(((Wq, q_rows), (Wk, slice(None)), (Wv, slice(None)))):
        y = x @ W.T
        for t, s in enumerate(slots):
            if s >= 0:
                y[t] += SCALE * (x[t] @ qkv_ad[s][k][0].T) @ qkv_ad[s][k][1].T
        want.append(y[:, rows])
    want = np.concatenate(want, 1)
    if not np.abs(got_qkv - want).max() < 1e-4:
        failures.append(f"qkv (replicated kv heads) fully_sharded={fs}: error {np.abs(got_qkv - want).max()}")
    logits = x @ W_head.T
    for t, s in enumerate(slots):
        if s >= 0:
            logits[t] += SCALE * (x[t] @ head_ad[s][0].T) @ head_ad[s][1].T
    want = np.zeros((len(slots), part))
    want[:, : v_rows.stop - v_rows.start] = logits[:, v_rows]
    if not np.abs(got_head - want).max() < 1e-4:
        failures.append(f"LM head (padded shard) fully_sharded={fs}: error {np.abs(got_head - want).max()}")

# bytes per call (docs/parallel_torch.md formulas, worked by hand for P=2, T=5, D=2, r=4, w=f=e=4)
costs = col.layout_costs(5)
got = {k: (c.weight_bytes, tuple(c.collectives), c.link_bytes) for k, c in costs.items()}
want = {"replicated": (2 * (4 * 16 + 4 * 4) * 4, (), 0),
        "fully_sharded": (2 * (2 * 16 + 4 * 4) * 4, (("all_gather", 5 * 4 * 4),), 40)}
if got != want:
    failures.append(f"column layout_costs {got} != {want}")
costs = row.layout_costs(5)
got = {k: (c.weight_bytes, tuple(c.collectives), c.link_bytes) for k, c in costs.items()}
want = {"replicated": (2 * (4 * 8 + 12 * 4) * 4, (("all_reduce", 80),), 80),
        "fully_sharded": (2 * (4 * 8 + 6 * 4) * 4, (("all_reduce", 80), ("all_gather", 5 * 12 * 4)), 80 + 120)}
if got != want:
    failures.append(f"row layout_costs {got} != {want}")

try:
    ColumnParallelLinearWithLoRA(torch.nn.Linear(H, N_COL // world), input_size=H, output_size=N_COL, max_loras=2,
                                 max_rank=3, fully_sharded=True)
    failures.append("max_rank 3 over 2 ranks with fully_sharded=True did not raise")
except ValueError:
    pass
try:
    ColumnParallelLinearWithLoRA(torch.nn.Linear(H, N_COL // world), input_size=H, output_size=N_COL, max_loras=2,
                                 max_rank=4)
    failures.append("no layout and no tokens_per_step did not raise")
except ValueError:
    pass

# AdapterManager on a tensor-parallel layer: each rank keeps only its shard of B (issue 20 item 3)
name = "model.layers.0.mlp.up_proj"
path = os.path.join(sys.argv[1], f"adapter-rank{rank}")
A, Bc, _ = adapters[1]
save_peft_adapter(path, {name: (A, Bc)}, r=4, lora_alpha=2.0)
base = torch.nn.Linear(H, N_COL // world, bias=False)
base.weight.data = torch.tensor(W_col[cols], dtype=torch.float32)
col = ColumnParallelLinearWithLoRA(base, input_size=H, output_size=N_COL, max_loras=2, max_rank=R, fully_sharded=False)
col.module_names = (name,)
mgr = torch_lora.AdapterManager({"col": col})
mgr.register(2, path)
mgr.activate([2])
if tuple(col.lora_b_stacked[0].shape) != (2, N_COL // world, R):
    failures.append(f"manager slot B shape {tuple(col.lora_b_stacked[0].shape)}: not this rank's shard")
slot = mgr.slot_of(2)
want_b = Bc[cols] * (2.0 / 4)
if not np.allclose(col.lora_b_stacked[0][slot].numpy(), want_b, atol=1e-6):
    failures.append("manager wrote another part of B than this rank's rows")
print("RANK", rank, "FAILURES", failures, flush=True)
dist.destroy_process_group()
sys.exit(1 if failures else 0)
'''


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_tensor_parallel_layers_over_two_gloo_processes(tmp_path):
    """Issue 20 item 2/3 (tests on CPU with gloo processes): column-, row-, QKV- (GQA, kv heads
    replicated over ranks) parallel layers and the LM head (padded last vocabulary shard), in both
    layouts, equal the unsharded computation (float64 oracle) with mixed adapters, the bytes each
    layout moves (layout_costs) equal the documented formulas worked by hand,
    heterogeneous ranks and a no-LoRA row (bit-for-bit base output); fully_sharded=True with a
    rank not divisible by P and a layer without a layout choice raise; AdapterManager writes only
    this rank's shard of a column-parallel layer's B."""
    script = tmp_path / "tp_worker.py"
    script.write_text(_TP_WORKER)
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), WORLD_SIZE="2",
               OMP_NUM_THREADS="1")
    env.pop("TRITON_INTERPRET", None)
    procs = [subprocess.Popen([sys.executable, str(script), str(tmp_path)], cwd=REPO, env=dict(env, RANK=str(r)),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in range(2)]
    outs = [p.communicate(timeout=120)[0] for p in procs]
    for p, out in zip(procs, outs):
        assert p.returncode == 0, out[-3000:]


# ===== issues 17 / 18 / 22: the torch CLI

def test_torch_lora_demo_on_a_checkpoint_verifies_every_request_with_eviction(llama_assets, capsys, tmp_path):
    """Issue 18 item 4 / docs/torch.md: `torch-lora demo MODEL_DIR ADAPTER_DIR...` serves mixed
    requests (some '__base__') in batches through MultiLoRAModel.generate, checks each against peft
    and ends with `verified: N/N requests match PEFT outputs` (exit 0), also for a checkpoint whose
    end-of-sequence ids are often the greedy choice; --slots below the adapter count exercises LRU
    eviction."""
    import shutil

    from torch_lora import cli
    _, dirs = llama_assets
    # A checkpoint with many end-of-sequence ids (as chat models have several): generate may not pick
    # them before max_new_tokens, so they are often the raw greedy choice without being served.
    model_dir = str(tmp_path / "model")
    shutil.copytree(dirs["_model"], model_dir)
    gen_path = os.path.join(model_dir, "generation_config.json")
    gen = json.load(open(gen_path))
    gen["eos_token_id"] = list(range(2, 34))
    json.dump(gen, open(gen_path, "w"))
    rc = cli.main(["demo", model_dir, dirs["sql"], dirs["chat"], dirs["code"], "--requests", "8",
                   "--batch-size", "4", "--max-new-tokens", "2", "--slots", "2", "--device", "cpu",
                   "--backend", "torch"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert out.rstrip().splitlines()[-1] == "verified: 8/8 requests match PEFT outputs"
    assert "without adapter" in out


@pytest.mark.parametrize("argv, word", [
    (["--requests", "0"], "requests"),
    pytest.param(["--device", "cuda"], "cuda", marks=pytest.mark.skipif(torch.cuda.is_available(),
                                                                        reason="a machine with CUDA")),
    (["--backend", "bogus"], "bogus")])
def test_torch_lora_demo_bad_options_are_one_line_errors(llama_assets, capsys, argv, word):
    """Issue 17 (clean CLI errors, no tracebacks, exit status 2) applied to `torch-lora demo`:
    --requests 0, --device cuda without CUDA, --backend bogus."""
    from torch_lora import cli
    _, dirs = llama_assets
    rc = cli.main(["demo", dirs["_model"], dirs["sql"], *argv])
    err = capsys.readouterr().err
    assert rc == 2
    assert "Traceback" not in err and word in err
    assert err.strip().splitlines()[-1].startswith("torch-lora demo: error:"), err


def test_python_m_torch_lora_cli_exits_2_on_a_bad_option():
    """docs/torch.md (`python -m torch_lora.cli demo`) + issue 17 (clean errors): a bad option is a
    one-line error and exit status 2 from the process, no traceback."""
    out = subprocess.run([sys.executable, "-m", "torch_lora.cli", "demo", "--requests", "0"], cwd=REPO,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    assert "Traceback" not in out.stderr and "requests" in out.stderr


def test_demo_serve_refuses_colliding_request_ids():
    """Issue 22 (hostile leftovers): colliding request ids are refused (torch demo) before anything
    is served."""
    from torch_lora import cli
    called = []

    def generate(*args, **kwargs):
        called.append(1)
        raise AssertionError("served despite colliding ids")
    reqs = [(7, "__base__", [1, 2, 3]), (7, "__base__", [4, 5, 6])]
    with pytest.raises(ValueError, match="7"):
        cli.serve(generate, reqs, device="cpu", batch_size=2, max_new_tokens=1, pad_id=0)
    assert not called


# ===== issues 5 / 17: the bridge, torch direction

def test_torch_facing_bridged_wrapper_equals_native_and_updates_y_in_place():
    """Issue 5 item 2: bridge.TorchPunicaWrapper (torch API over jax_lora's kernels) updates y in
    place, returns it, and equals the native torch wrapper and the float64 oracle."""
    import bridge
    rng = _rng(40)
    widths = (6, 3)
    a, b = _stacked(rng, 2, 4, 16, widths)
    bias = [torch.tensor(rng.standard_normal((2, 6)), dtype=torch.float32), None]
    ids = (1, 0, 2, 1)
    x = torch.tensor(rng.standard_normal((4, 16)), dtype=torch.float32)
    y0 = torch.tensor(rng.standard_normal((4, 9)), dtype=torch.float32)
    bw = bridge.TorchPunicaWrapper(16, 4, "cpu", max_loras=2)
    bw.update_metadata(LoRAMapping(ids, ids), [1, 2], 3, 16)
    y = y0.clone()
    assert bw.add_lora_linear(y, x, a, b, bias, 0.5, widths) is y
    native = _wrapper(ids, [1, 2]).add_lora_linear(y0.clone(), x, a, b, bias, 0.5, widths)
    torch.testing.assert_close(y, native, rtol=1e-5, atol=1e-5)
    assert _rel(y.numpy(), _oracle_linear(y0, x, a, b, bias, 0.5, [0, -1, 1, 0], widths)) < 1e-5
    assert torch.equal(y[1], y0[1])


def test_bridged_wrapper_copy_true_sees_writes_through_data_and_numpy():
    """Issue 17 item 4: bridge.TorchPunicaWrapper(copy=True) sees updates made through `.data` and
    through a NumPy array aliased by torch.from_numpy (weights that have to be copied)."""
    import bridge
    rng = _rng(41)
    host_a = rng.standard_normal((2, 4, 16)).astype(np.float32)
    a = torch.from_numpy(host_a)                 # NumPy memory: not necessarily shareable
    b = torch.tensor(rng.standard_normal((2, 5, 4)), dtype=torch.float32)
    ids = (1, 2, 1)
    x = torch.tensor(rng.standard_normal((3, 16)), dtype=torch.float32)
    bw = bridge.TorchPunicaWrapper(16, 4, "cpu", max_loras=2, copy=True)
    bw.update_metadata(LoRAMapping(ids, ids), [1, 2], 3, 16)
    bw.add_lora_linear(torch.zeros(3, 5), x, a, b, None, 1.0, (5,))
    host_a[:] = rng.standard_normal(host_a.shape)           # a write torch's version counter misses
    y = bw.add_lora_linear(torch.zeros(3, 5), x, a, b, None, 1.0, (5,))
    want = _oracle_linear(torch.zeros(3, 5), x, [torch.from_numpy(host_a.copy())], [b], None, 1.0, [0, 1, 0], (5,))
    assert _rel(y.numpy(), want) < 1e-5
    new_b = torch.tensor(rng.standard_normal((2, 5, 4)), dtype=torch.float32)
    b.data = new_b
    y = bw.add_lora_linear(torch.zeros(3, 5), x, a, b, None, 1.0, (5,))
    want = _oracle_linear(torch.zeros(3, 5), x, [torch.from_numpy(host_a.copy())], [new_b], None, 1.0, [0, 1, 0],
                          (5,))
    assert _rel(y.numpy(), want) < 1e-5


def test_bridged_wrapper_refuses_tensors_requiring_grad():
    """docs/bridge.md (issue 5: tensors requiring grad are refused unless detached): the
    torch-facing wrapper refuses an x requiring grad while grad mode is on."""
    import bridge
    a, b = _stacked(_rng(42), 2, 4, 8, (5,))
    bw = bridge.TorchPunicaWrapper(16, 4, "cpu", max_loras=2)
    bw.update_metadata(LoRAMapping((1, 2), (1, 2)), [1, 2], 3, 16)
    x = torch.zeros(2, 8, requires_grad=True)
    with pytest.raises((ValueError, TypeError), match="grad"):
        bw.add_lora_linear(torch.zeros(2, 5), x, a, b, None, 1.0, (5,))


def test_to_jax_zero_copy_refusals_and_int64():
    """Issue 5 item 1 / issue 17 item 3: to_jax shares memory (pointer identity) and to_torch back;
    a strided view raises CopyRequiredError (a ValueError) unless copy=True; int64 becomes int32
    explicitly with copy=True, and values beyond int32 are refused instead of wrapping."""
    import bridge
    t = torch.arange(64 * 4, dtype=torch.float32).reshape(64, 4)
    if t.data_ptr() % 64 == 0:
        j = bridge.to_jax(t)
        assert j.unsafe_buffer_pointer() == t.data_ptr()
        assert bridge.to_torch(j).data_ptr() == t.data_ptr()
    with pytest.raises(bridge.CopyRequiredError):
        bridge.to_jax(t[:, ::2])
    assert issubclass(bridge.CopyRequiredError, ValueError)
    np.testing.assert_array_equal(np.asarray(bridge.to_jax(t[:, ::2], copy=True)), t[:, ::2].numpy())
    small = torch.tensor([1, -1, 3], dtype=torch.int64)
    j = bridge.to_jax(small, copy=True)
    assert str(j.dtype) == "int32" and np.asarray(j).tolist() == [1, -1, 3]
    with pytest.raises(ValueError):
        bridge.to_jax(torch.tensor([2**32 + 1], dtype=torch.int64), copy=True)


def test_to_torch_then_delete_keeps_the_tensor_valid():
    """Issue 17 item 7: bridge.to_torch(a) followed by a.delete() must not abort the process; the
    torch tensor keeps the buffer alive (or the delete is refused cleanly). A child process, since
    the failure mode is an abort."""
    code = textwrap.dedent("""
        import jax, jax.numpy as jnp, torch, bridge
        a = jnp.arange(1024, dtype=jnp.float32) * 2
        t = bridge.to_torch(a)
        try:
            a.delete()
        except Exception as e:
            print("REFUSED", type(e).__name__)
        b = jnp.ones(1 << 16, jnp.float32) * 3
        b.block_until_ready()
        print("SUM", float(t.sum()))
    """)
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120,
                         env=dict(os.environ, JAX_PLATFORMS="cpu"))
    assert out.returncode == 0, out.stderr[-2000:]
    assert f"SUM {float(sum(range(1024)) * 2)}" in out.stdout


# ===== more of contract section 2-5 (issue 2)

def test_kernel_meta_worked_example():
    """contract section 3 (issue 2 item 3): LoRAKernelMeta.make / prepare_tensors: sorted token order (stable),
    active ids ascending (-1 first) padded with -1, counts, start locations, no_lora flag."""
    meta = torch_lora.LoRAKernelMeta.make(3, 8, "cpu")
    meta.prepare_tensors(torch.tensor([1, -1, 0, 1, -1], dtype=torch.int32))
    mapping, order, counts, starts, active, no_lora = meta.meta_args(5)
    assert mapping.tolist() == [1, -1, 0, 1, -1]
    assert order.tolist() == [1, 4, 2, 0, 3]
    assert active.tolist() == [-1, 0, 1, -1]
    assert counts.tolist() == [2, 1, 2, 0]
    assert starts.tolist()[:4] == [0, 2, 3, 5]
    assert bool(no_lora.reshape(-1)[0]) is False
    meta.prepare_tensors(torch.tensor([-1, -1], dtype=torch.int32))
    assert bool(meta.meta_args(2)[5].reshape(-1)[0]) is True


def test_prefill_metadata_feeds_sgmv_which_equals_bgmv():
    """contract section 2/4 + docs/api.md: compute_meta merges runs of equal indices; a prefill wrapper's
    prefill_metadata unpacks into the SGMV ops, which equal BGMV on the expanded indices."""
    starts, lengths, loras, batch, max_len, tokens, no_lora = torch_lora.compute_meta(
        torch.tensor([0, 0, 1, 1, 1, -1]))
    assert starts.tolist() == [0, 2, 5] and lengths.tolist() == [2, 3, 1] and loras.tolist() == [0, 1, -1]
    assert (batch, max_len, tokens, no_lora) == (3, 3, 6, False)
    ids = (1, 1, 2, 2, 2, 0)
    w = PunicaWrapper(16, 4, "cpu", max_loras=2, backend="torch")
    w.update_metadata(LoRAMapping(ids, (1, 2, 0), is_prefill=True), [1, 2], 3, 16)
    rng = _rng(50)
    x = torch.tensor(rng.standard_normal((6, 8)), dtype=torch.float32)
    wa = torch.tensor(rng.standard_normal((2, 4, 8)), dtype=torch.float32)
    s = torch_lora.ops.sgmv_shrink(x, wa, *w.prefill_metadata, 0.5, backend="torch")
    idx = torch.tensor([0, 0, 1, 1, 1, -1], dtype=torch.int32)
    torch.testing.assert_close(s, torch_lora.ops.bgmv_shrink(x, wa, idx, 0.5, backend="torch"))
    wb = torch.tensor(rng.standard_normal((2, 5, 4)), dtype=torch.float32)
    y1, y2 = torch.ones(6, 5), torch.ones(6, 5)
    torch_lora.ops.sgmv_expand(s, wb, y1, *w.prefill_metadata, True, backend="torch")
    torch_lora.ops.bgmv_expand(s, wb, y2, idx, True, backend="torch")
    torch.testing.assert_close(y1, y2)
    assert torch.equal(y1[5], torch.ones(5))


def test_add_lora_linear_buffer_receives_the_shrink():
    """contract section 5: add_lora_linear(..., buffer=) -- the (S, T, r) float32 buffer gets the shrink result
    and y the same as without it."""
    rng = _rng(51)
    a, b = _stacked(rng, 2, 4, 8, (3, 5))
    w = _wrapper((1, 0, 2), [1, 2])
    x = torch.tensor(rng.standard_normal((3, 8)), dtype=torch.float32)
    buf = torch.full((2, 3, 4), 9.0)
    y = w.add_lora_linear(torch.zeros(3, 8), x, a, b, None, 0.5, (3, 5), buffer=buf)
    torch.testing.assert_close(y, w.add_lora_linear(torch.zeros(3, 8), x, a, b, None, 0.5, (3, 5)))
    for s_ in range(2):
        want = 0.5 * x[0].double().numpy() @ a[s_][0, 0].double().numpy().T
        np.testing.assert_allclose(buf[s_, 0].numpy(), want, rtol=1e-5, atol=1e-6)
        assert torch.equal(buf[s_, 1], torch.zeros(4))


# ===== Triton (interpreter, tiny shapes)

_INTERPRETED = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                  reason="Triton on CPU tensors needs TRITON_INTERPRET=1 before import")


@_INTERPRETED
def test_triton_backend_on_cpu_runs_the_interpreter_with_strided_lora_ranks():
    """contract section 8 (a forced kernel backend runs in its interpreter on CPU) + issue 22 (strided
    lora_ranks views on torch Triton gave wrong numbers): backend='triton' equals the float64 oracle
    with unequal slices, a bias and lora_ranks given as a strided view."""
    rng = _rng(60)
    widths = (6, 3)
    a, b = _stacked(rng, 2, 4, 8, widths)
    bias = [torch.tensor(rng.standard_normal((2, 6)), dtype=torch.float32), None]
    ranks = torch.tensor([2, 99, 4, 99], dtype=torch.int32)[::2]
    a_pad = [t.clone() for t in a]
    b_pad = [t.clone() for t in b]
    for t in a_pad:
        t[0, :, 2:] = 0
    for t in b_pad:
        t[0, :, :, 2:] = 0
    w = _wrapper((1, 0, 2), [1, 2], backend="triton")
    x = torch.tensor(rng.standard_normal((3, 8)), dtype=torch.float32)
    y0 = torch.tensor(rng.standard_normal((3, 9)), dtype=torch.float32)
    y = w.add_lora_linear(y0.clone(), x, a, b, bias, 0.5, widths, lora_ranks=ranks)
    assert _rel(y.numpy(), _oracle_linear(y0, x, a_pad, b_pad, bias, 0.5, [0, -1, 1], widths)) < 1e-5
    assert torch.equal(y[1], y0[1])
