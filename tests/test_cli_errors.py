"""What a user sees when things go wrong or take time in the console scripts (`jax-lora`,
`torch-lora`) and the serving front ends.

- Ctrl-C: a demo interrupted while XLA compiles (jax-lora) or while serving (torch-lora) prints one
  line, exits with status 130, without a traceback, and removes its temporary directory.
- Counts checked before anything is allocated: a one-line error with exit status 2 naming the
  option and the limit (`--max-seqs`, `--slots`, `--num-requests`, `--batch-size`, `--requests`),
  from the caps or from the memory a large checkpoint's config says it would need.
- torch-lora as a newcomer meets it: `--version`; `--help` and a one-line install hint without
  torch; missing paths named before any loading; `--backend` choices; option names in messages;
  no transformers / peft progress bars or warnings in the demo's output; plurals.
- MultiLoRAModel names `max_loras` when a batch has more adapters than slots; ServingEngine logs
  each program it compiles, with its bucket and the time it took.
"""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from lora_core.peft import save_peft_adapter

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HIDE_TORCH = "import sys; sys.modules['torch'] = None; from torch_lora.cli import main; sys.exit(main())"


def _env():
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("TRITON_INTERPRET", None)
    return env


def _run(args, timeout=120):
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=timeout, env=_env(),
                          cwd=ROOT)


def _interrupt_when(args, marker: str, timeout: float = 240) -> tuple:
    """Starts `python args`, sends SIGINT once `marker` appears on its stdout, waits; (rc, stdout,
    stderr, seconds from the interrupt to the exit)."""
    proc = subprocess.Popen([sys.executable, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=_env(),
                            cwd=ROOT)
    os.set_blocking(proc.stdout.fileno(), False)
    out, deadline = b"", time.monotonic() + timeout
    try:
        while marker.encode() not in out:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"{marker!r} never appeared (rc {proc.returncode}): {out.decode()[-2000:]}")
            chunk = proc.stdout.read()
            out += chunk or b""
            if not chunk:
                time.sleep(0.05)
        proc.send_signal(signal.SIGINT)
        t0 = time.monotonic()
        os.set_blocking(proc.stdout.fileno(), True)
        rest, err = proc.communicate(timeout=120)
        return proc.returncode, (out + rest).decode(), err.decode(), time.monotonic() - t0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


def _assert_interrupted(rc, out, err, prog):
    assert rc == 130, (rc, err[-3000:])
    assert "Traceback" not in err and "Traceback" not in out, err[-3000:]
    assert err.strip().splitlines()[-1] == f"{prog}: interrupted", err[-3000:]
    assert len([line for line in err.splitlines() if line.strip()]) <= 2, err      # (a progress bar's line)


# ----------------------------------------------------------------------------- Ctrl-C

def test_jax_lora_demo_interrupted_while_compiling_exits_130_in_one_line():
    rc, out, err, seconds = _interrupt_when(["-m", "jax_lora.cli", "demo", "--slots", "1", "--max-new-tokens", "1",
                                             "--num-requests", "4"], "warm-up 1/")
    _assert_interrupted(rc, out, err, "jax-lora")
    assert seconds < 60
    tmp = re.search(r"in (\S*jax-lora-demo-\S+)", out).group(1)
    assert not os.path.exists(tmp), "the demo's temporary directory is left behind"
    # counted nouns in the set-up lines
    assert "1 new token each" in out and "1 adapter slot;" in out


@pytest.fixture(scope="module")
def torch_interrupted():
    """The torch demo (1 slot, small), interrupted once it serves: (rc, stdout, stderr)."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    pytest.importorskip("peft")
    rc, out, err, _ = _interrupt_when(["-m", "torch_lora.cli", "demo", "--requests", "4", "--batch-size", "2",
                                       "--max-new-tokens", "1", "--slots", "1"], "serving (mixed adapters):")
    return rc, out, err


def test_torch_lora_demo_interrupted_while_serving_exits_130_in_one_line(torch_interrupted):
    rc, out, err = torch_interrupted
    _assert_interrupted(rc, out, err, "torch-lora")
    tmp = re.search(r"in (\S*torch-lora-demo-\S+)", out).group(1)
    assert not os.path.exists(tmp), "the demo's temporary directory is left behind"


def test_torch_lora_demo_output_has_no_third_party_noise_and_counts_nouns(torch_interrupted):
    _, out, err = torch_interrupted
    for noise in ("Loading weights", "Writing model shards", "it/s]", "Warning", "warnings.warn"):
        assert noise not in out and noise not in err, (noise, out, err)
    assert ", 1 slot, " in out and "1 new token each" in out


# ----------------------------------------------------------------------------- sizes

@pytest.mark.parametrize("argv, option, limit", [
    (["--max-seqs", "1000000"], "--max-seqs", "4096"),
    (["--slots", "1000000"], "--slots", "1024"),
    (["--num-requests", "200000000"], "--num-requests", "100000"),
])
def test_jax_lora_huge_counts_are_one_line_errors_before_anything_is_built(capsys, argv, option, limit):
    from jax_lora import cli
    t0 = time.perf_counter()
    assert cli.main(["demo", *argv]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and err.startswith(f"jax-lora demo: error: {option} ")
    assert f"limit is {limit}" in err
    assert time.perf_counter() - t0 < 10


def _big_checkpoint(root) -> str:
    """A config.json of a 70B-class Llama, and no weights: the size checks must refuse before loading."""
    d = root / "big-llama"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "hidden_size": 8192, "intermediate_size": 28672,
        "num_hidden_layers": 80, "num_attention_heads": 64, "num_key_value_heads": 8, "vocab_size": 128256,
        "max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "torch_dtype": "float32"}))
    return str(d)


def _adapter(root, name="adapter", modules=("q_proj",)) -> str:
    path = str(root / name)
    save_peft_adapter(path, {f"model.layers.0.self_attn.{m}": (np.zeros((16, 8192)), np.zeros((8192, 16)))
                             for m in modules}, r=16, lora_alpha=16.0)
    return path


def test_jax_lora_sizes_follow_the_memory_the_checkpoint_needs(capsys, tmp_path):
    from jax_lora import cli
    from lora_core.cli_support import available_host_bytes
    if available_host_bytes() is None:
        pytest.skip("the available memory cannot be read here")
    model, adapter = _big_checkpoint(tmp_path), _adapter(tmp_path)
    # 4000 rows x 2 x 80 layers x 1016 positions x 8 x 128 x 4 bytes = 2.7 TB of KV cache
    assert cli.main(["demo", model, adapter, "--max-seqs", "4000", "--max-new-tokens", "1000",
                     "--num-requests", "1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("jax-lora demo: error: --max-seqs 4000 is too large: at most ") and "KV cache" in err
    assert len(err.strip().splitlines()) == 1
    # each request keeps 1000 x 128256 float32 logits (513 MB): 100000 of them do not fit
    assert cli.main(["demo", model, adapter, "--max-new-tokens", "1000", "--num-requests", "100000"]) == 2
    assert "--num-requests 100000 is too large: at most " in capsys.readouterr().err


def test_torch_lora_huge_counts_are_one_line_errors(capsys, tmp_path):
    pytest.importorskip("torch")
    from torch_lora import cli
    assert cli.main(["demo", "--batch-size", "1000000"]) == 2
    err = capsys.readouterr().err
    assert err.strip() == ("torch-lora demo: error: --batch-size 1000000 is too large: the limit is 4096 "
                           "(the demo's cap)")
    assert cli.main(["demo", "--requests", "200000000"]) == 2
    assert "--requests 200000000 is too large: the limit is 100000" in capsys.readouterr().err
    model, adapter = _big_checkpoint(tmp_path), _adapter(tmp_path)
    # a row: 666 MB of KV cache (80 layers x 1016 positions) and 1 GB of logits
    assert cli.main(["demo", model, adapter, "--batch-size", "4000", "--max-new-tokens", "1000", "--requests", "1",
                     "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("torch-lora demo: error: --batch-size 4000 is too large: at most ")


# ----------------------------------------------------------------------------- torch-lora as a newcomer meets it

def test_torch_lora_version():
    res = _run(["-m", "torch_lora.cli", "--version"])
    assert res.returncode == 0 and re.fullmatch(r"torch-lora \d+\.\d+\S*\n", res.stdout), res


def test_torch_lora_help_and_version_without_torch():
    res = _run(["-c", HIDE_TORCH, "--help"])
    assert res.returncode == 0 and "usage: torch-lora" in res.stdout and not res.stderr, res
    res = _run(["-c", HIDE_TORCH, "demo", "--help"])
    assert res.returncode == 0 and "--batch-size" in res.stdout, res
    res = _run(["-c", HIDE_TORCH, "--version"])
    assert res.returncode == 0 and res.stdout.startswith("torch-lora "), res


def test_torch_lora_demo_without_torch_is_an_install_hint():
    res = _run(["-c", HIDE_TORCH, "demo"])
    assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr
    assert len(res.stderr.strip().splitlines()) == 1
    assert "torch is not installed" in res.stderr and "pip install 'jax-torch-lora[torch]'" in res.stderr


def test_torch_lora_missing_paths_fail_at_once_naming_them(capsys, tmp_path):
    pytest.importorskip("torch")
    from torch_lora import cli
    model, adapter = _big_checkpoint(tmp_path), _adapter(tmp_path)
    for argv, named in ((["/no/such/model", adapter], "MODEL_DIR '/no/such/model'"),
                        ([model, "/no/such/adapter"], "ADAPTER_DIR '/no/such/adapter'"),
                        ([model, adapter, "/no/such/adapter"], "ADAPTER_DIR '/no/such/adapter'"),
                        ([str(tmp_path), adapter], "has no config.json")):
        t0 = time.perf_counter()
        assert cli.main(["demo", *argv]) == 2
        err = capsys.readouterr().err
        assert len(err.strip().splitlines()) == 1 and named in err, err
        assert time.perf_counter() - t0 < 5           # before any loading (the checkpoint has no weights anyway)


@pytest.mark.parametrize("argv, expected", [
    (["--requests", "0"], "argument --requests: expected a positive integer, got 0"),
    (["--batch-size", "-1"], "argument --batch-size: expected a positive integer, got -1"),
    (["--backend", "cuda"], "argument --backend: invalid choice: 'cuda'"),
])
def test_torch_lora_options_are_validated_by_name(capsys, argv, expected):
    pytest.importorskip("torch")
    from torch_lora import cli
    assert cli.main(["demo", *argv]) == 2
    err = capsys.readouterr().err
    assert expected in err and "num_requests" not in err


# ----------------------------------------------------------------------------- front ends

def test_multilora_model_names_max_loras_when_a_batch_has_too_many_adapters(tmp_path):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from torch_lora.hf import MultiLoRAModel

    cfg = transformers.LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=16, num_hidden_layers=1,
                                   num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=16)
    mm = MultiLoRAModel(transformers.LlamaForCausalLM(cfg).eval(), max_loras=1, max_rank=2, target_modules=["q_proj"])
    for name in ("a", "b"):
        path = str(tmp_path / name)
        save_peft_adapter(path, {"model.layers.0.self_attn.q_proj": (np.ones((2, 16)), np.ones((16, 2)))}, r=2,
                          lora_alpha=2.0)
        mm.load_adapter(name, path)
    with pytest.raises(ValueError, match=r"the batch names 2 distinct adapters \['a', 'b'\], more than max_loras=1 "):
        mm(torch.ones((2, 3), dtype=torch.long), adapter_names=["a", "b"])
    mm(torch.ones((2, 3), dtype=torch.long), adapter_names=["a", "a"])          # one adapter fits


def test_serving_engine_logs_each_program_it_compiles(caplog):
    from flax import nnx

    from jax_lora.models.llama import LlamaConfig, LlamaForCausalLM
    from jax_lora.serving import Request, ServingEngine

    cfg = LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2,
                      num_key_value_heads=1, max_position_embeddings=32, rope_theta=10000.0, rms_norm_eps=1e-5)
    engine = ServingEngine(LlamaForCausalLM(cfg, rngs=nnx.Rngs(0)), max_seqs=2, max_len=16, max_prefill_tokens=16,
                           min_prefill_len=8, min_prefill_rows=1)
    with caplog.at_level(logging.INFO, logger="jax_lora"):
        engine.generate([Request([1, 2, 3], max_new_tokens=2)])
    lines = [r.getMessage() for r in caplog.records if "compiled the" in r.getMessage()]
    assert len(lines) == engine.compile_count == 2, lines
    assert re.search(r"compiled the prefill step program for the bucket \(1, 8\) \(rows, tokens\), without adapters, "
                     r"in \d+\.\d\ds \(1 program so far\)", lines[0]), lines
    assert "decode step program for the bucket (2, 1) (rows, tokens)" in lines[1] and "(2 programs so far)" in lines[1]
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="jax_lora"):
        engine.generate([Request([4, 5], max_new_tokens=3)])
    assert not [r for r in caplog.records if "compiled the" in r.getMessage()]      # warm: nothing compiles
