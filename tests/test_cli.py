"""The `jax-lora` command line: option checks, clean errors, --version, --prompt and --dtype.

Argument and input errors must exit with status 2 and one message line, never a traceback (bad
options, missing or unloadable adapter directories, --prompt without a tokenizer). `jax-lora demo
MODEL_DIR ADAPTER_DIR... --tp 2` serves tests/llama_checkpoint.py's tiny Llama split over 2 CPU
devices with LRU swaps and verifies every request. The tests that serve (`--prompt`, `--dtype`)
run the whole demo on the small model and are marked slow (tests/conftest.py); the option checks
run before JAX is imported and take milliseconds. CPU only.
"""

from __future__ import annotations

import ast
import json
import os
import shutil
import subprocess
import sys

import jax
import pytest

import jax_lora
from jax_lora import cli

from . import llama_checkpoint
from .jax_helpers import plain_config, q_tensors, write_adapter

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run_cli(*args):
    """`python -m jax_lora.cli ARGS` in a fresh interpreter: what a user sees."""
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, "-m", "jax_lora.cli", *args], capture_output=True, text=True,
                          env=env, cwd=REPO, timeout=300, check=False)


def _exit_status(capsys, argv):
    """main(argv)'s exit status (argparse exits through SystemExit) and its stderr."""
    try:
        status = cli.main(argv)
    except SystemExit as e:
        status = e.code
    return status, capsys.readouterr().err


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    """The demo's small random Llama and its three PEFT adapters, written once."""
    root = tmp_path_factory.mktemp("cli-assets")
    model_dir, adapter_dirs = cli.build_demo_assets(str(root), seed=0)
    return model_dir, adapter_dirs


# ----------------------------------------------------------------------------- options


@pytest.mark.parametrize("argv, expected", [
    (["demo", "--backend", "bogus"], "argument --backend: invalid choice: 'bogus'"),
    (["demo", "--max-seqs", "0"], "argument --max-seqs: expected a positive integer, got 0"),
    (["demo", "--num-requests", "-3"], "argument --num-requests/--requests: expected a positive integer, got -3"),
    (["demo", "--requests", "many"], "argument --num-requests/--requests: expected a positive integer, got 'many'"),
    (["demo", "--max-new-tokens", "0"], "argument --max-new-tokens: expected a positive integer, got 0"),
    (["demo", "--slots", "0"], "argument --slots: expected a positive integer, got 0"),
    (["demo", "--dtype", "float64"], "argument --dtype: invalid choice: 'float64'"),
    (["demo", "--prompt", "hi", "--num-requests", "3"], "--num-requests does not go with --prompt"),
    (["bogus"], "invalid choice: 'bogus'"),
    ([], "the following arguments are required: command"),
])
def test_bad_options_exit_2_with_a_message(capsys, argv, expected):
    status, err = _exit_status(capsys, argv)
    assert status == 2
    assert expected in err
    assert "Traceback" not in err


def test_bad_option_from_the_shell_is_one_message_without_traceback():
    result = _run_cli("demo", "--backend", "bogus")
    assert result.returncode == 2
    assert result.stdout == ""
    assert "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines()[-1].startswith("jax-lora demo: error: argument --backend: invalid "
                                                             "choice: 'bogus' (choose from")


def test_version(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["--version"])
    assert e.value.code == 0
    assert capsys.readouterr().out.strip() == f"jax-lora {cli.package_version()}"
    result = _run_cli("--version")
    assert result.returncode == 0 and result.stdout.strip() == f"jax-lora {cli.package_version()}"


def test_version_falls_back_to_the_package_when_not_installed(monkeypatch):
    from importlib import metadata

    import jax_lora

    def not_installed(name):
        raise metadata.PackageNotFoundError(name)

    monkeypatch.setattr(metadata, "version", not_installed)
    assert cli.package_version() == jax_lora.__version__


# ----------------------------------------------------------------------------- bad input


def test_missing_directories_are_one_line_errors(capsys, tmp_path):
    status, err = _exit_status(capsys, ["demo", str(tmp_path / "nowhere"), str(tmp_path)])
    assert status == 2
    assert err == f"jax-lora demo: error: MODEL_DIR {str(tmp_path / 'nowhere')!r} is not a directory\n"
    status, err = _exit_status(capsys, ["demo", str(tmp_path), str(tmp_path / "no-adapter")])
    assert status == 2 and "is not a directory" in err and err.count("\n") == 1
    status, err = _exit_status(capsys, ["demo", str(tmp_path)])
    assert status == 2 and "give at least one adapter directory" in err


def _bad_copy(adapter_dir, dest, edit):
    shutil.copytree(adapter_dir, dest)
    edit(str(dest))
    return str(dest)


def _corrupt_config(d):
    with open(os.path.join(d, "adapter_config.json"), "w") as f:
        f.write("{not json")


def _rank_too_wide(d):
    from safetensors.numpy import load_file, save_file
    path = os.path.join(d, "adapter_model.safetensors")
    tensors = load_file(path)
    name = min(n for n in tensors if "lora_A" in n)
    tensors[name] = tensors[name][:, :-1]                   # A no longer matches the layer's input width
    save_file(tensors, path)


def _dora(d):
    path = os.path.join(d, "adapter_config.json")
    with open(path) as f:
        cfg = json.load(f)
    cfg["use_dora"] = True
    with open(path, "w") as f:
        json.dump(cfg, f)


@pytest.mark.parametrize("edit, expected", [
    (lambda d: os.remove(os.path.join(d, "adapter_config.json")), "adapter_config.json is missing"),
    (lambda d: os.remove(os.path.join(d, "adapter_model.safetensors")), "adapter_model.safetensors: missing"),
    (_corrupt_config, ""),
    (_rank_too_wide, ""),
    (_dora, "DoRA"),
], ids=["no-config", "no-weights", "bad-json", "wrong-shape", "dora"])
def test_bad_adapters_are_one_line_errors(capsys, tmp_path, assets, edit, expected):
    model_dir, adapter_dirs = assets
    bad = _bad_copy(adapter_dirs[1], tmp_path / "bad-adapter", edit)
    status, err = _exit_status(capsys, ["demo", model_dir, adapter_dirs[0], bad])
    assert status == 2
    assert err.startswith("jax-lora demo: error: ") and err.count("\n") == 1, err
    assert expected in err
    assert "Traceback" not in err


def test_a_bad_model_directory_is_a_one_line_error(capsys, tmp_path, assets):
    model_dir, adapter_dirs = assets
    broken = tmp_path / "model"
    shutil.copytree(model_dir, broken)
    os.remove(broken / "model.safetensors")
    status, err = _exit_status(capsys, ["demo", str(broken), adapter_dirs[0]])
    assert status == 2 and "has no model.safetensors" in err and err.count("\n") == 1


@pytest.mark.parametrize("edit, expected", [
    (lambda cfg: [], "a Llama config must be a JSON object, got list"),
    (lambda cfg: {**cfg, "num_attention_heads": 0}, "LlamaConfig.num_attention_heads must be an int >= 1, got 0"),
    (lambda cfg: {**cfg, "hidden_size": "64"}, "LlamaConfig.hidden_size must be an int >= 1, got '64'"),
    (lambda cfg: {**cfg, "vocab_size": None}, "LlamaConfig.vocab_size must be an int >= 1, got None"),
    (lambda cfg: {**cfg, "rope_scaling": "linear"}, "rope_scaling must be null or an object, got 'linear'"),
    (lambda cfg: {**cfg, "rms_norm_eps": "x"}, "LlamaConfig.rms_norm_eps must be a positive finite number"),
])
def test_a_bad_model_config_is_a_one_line_error(capsys, tmp_path, assets, edit, expected):
    model_dir, adapter_dirs = assets
    broken = tmp_path / "model"
    shutil.copytree(model_dir, broken)
    cfg = json.loads((broken / "config.json").read_text())
    (broken / "config.json").write_text(json.dumps(edit(cfg)))
    status, err = _exit_status(capsys, ["demo", str(broken), adapter_dirs[0]])
    assert status == 2 and expected in err and err.count("\n") == 1, err


@pytest.mark.parametrize("argv, expected", [
    (["demo", "--seed", "-1"], "seed must be an integer in 0..2**32 - 1, got -1"),
    (["demo", "--seed", "99999999999999999999"], "seed must be an integer in 0..2**32 - 1"),
    (["demo", "--max-new-tokens", "99999999999"], "exceeds the model's max_position_embeddings=256"),
])
def test_out_of_range_numbers_are_one_line_errors(capsys, argv, expected):
    status, err = _exit_status(capsys, argv)
    assert status == 2 and expected in err and "Traceback" not in err, err


def test_prompt_needs_the_checkpoints_tokenizer(capsys, assets):
    model_dir, adapter_dirs = assets                        # save_llama writes no tokenizer
    status, err = _exit_status(capsys, ["demo", model_dir, adapter_dirs[0], "--prompt", "hello"])
    assert status == 2
    assert "--prompt needs a tokenizer" in err and err.count("\n") == 1


def test_triton_backend_on_the_cpu_asks_for_the_interpreter(monkeypatch):
    pytest.importorskip("triton")
    import jax
    if jax.default_backend() != "cpu":
        pytest.skip("checks the CPU message")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(cli.DemoError, match="TRITON_INTERPRET=1"):
        cli._check_backend("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    cli._check_backend("triton")


# ----------------------------------------------------------------------------- tokenizers and dtypes


def test_byte_tokenizer_round_trips_text_and_marks_ids_without_a_byte():
    tok = cli.ByteTokenizer()
    text = "Hello, wörld ✓"
    ids = tok.encode(text)
    assert ids == list(text.encode("utf-8")) and max(ids) < 256
    assert tok.decode(ids) == text
    assert tok.decode([104, 105, 300, 33]) == "hi<300>!"


def test_checkpoint_dtype(tmp_path):
    def dtype_of(cfg):
        (tmp_path / "config.json").write_text(json.dumps(cfg))
        return cli.checkpoint_dtype(str(tmp_path))

    assert dtype_of({"torch_dtype": "bfloat16"}) == "bfloat16"
    assert dtype_of({"dtype": "float16"}) == "float16"               # newer transformers' key
    assert dtype_of({"torch_dtype": "auto"}) is None
    assert dtype_of({}) is None
    assert cli.checkpoint_dtype(str(tmp_path / "missing")) is None


def _write_tokenizer(model_dir):
    """A word-level tokenizer of 12 ids in the Hugging Face layout (tokenizer.json + config)."""
    tokenizers = pytest.importorskip("tokenizers", reason="builds the test tokenizer (pip install tokenizers)")
    words = ["[UNK]", "<s>", "</s>", "hello", "world", "the", "cat", "sat", "on", "mat", "a", "dog"]
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.decoder = tokenizers.decoders.WordPiece()
    tok.save(os.path.join(model_dir, "tokenizer.json"))
    with open(os.path.join(model_dir, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
                   "unk_token": "[UNK]"}, f)
    return words


def test_prompt_through_the_checkpoints_tokenizer_in_its_dtype(capsys, tmp_path, assets, monkeypatch):
    """A checkpoint with a tokenizer and torch_dtype bfloat16: prompts are encoded with its tokenizer,
    outputs decoded to its words, the model served in bfloat16 (config.json) and verified."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    model_src, adapter_dirs = assets
    model_dir = str(tmp_path / "model")
    shutil.copytree(model_src, model_dir)
    words = _write_tokenizer(model_dir)
    with open(os.path.join(model_dir, "config.json")) as f:
        cfg = json.load(f)
    cfg["torch_dtype"] = "bfloat16"
    with open(os.path.join(model_dir, "config.json"), "w") as f:
        json.dump(cfg, f)

    status = cli.main(["demo", model_dir, *adapter_dirs, "--prompt", "hello the cat", "--prompt", "a dog sat",
                       "--max-new-tokens", "4"])
    out = capsys.readouterr().out.splitlines()
    assert status == 0, "\n".join(out)
    assert out[-1] == "verified: 8/8 requests match merged-weights outputs"
    assert any(line.startswith("model: ") and line.endswith(", bfloat16") for line in out)
    assert any(line.startswith("tokenizer: ") and model_dir in line for line in out)
    first = out.index("prompt 1: 'hello the cat'")
    assert out[first + 5] == "prompt 2: 'a dog sat'"
    shown = out[first + 1:first + 5]
    assert [line.split(":")[0].strip() for line in shown] == ["no adapter", "adapter 1", "adapter 2", "adapter 3"]
    for line in shown:                                        # decoded text: the tokenizer's words only
        text = ast.literal_eval(line.split(":", 1)[1].strip())    # the repr the demo printed
        assert all(word in words for word in text.split()), line
    assert any(line.startswith("recompilations after warm-up: 0") for line in out)


def test_dtype_option_and_byte_prompts_on_the_built_in_model(capsys):
    """--dtype float16 overrides the checkpoint's float32; byte prompts of 20 and 5 tokens need two
    prefill buckets, both compiled by the warm-up (no recompilation when serving)."""
    status = cli.main(["demo", "--dtype", "float16", "--prompt", "x" * 20, "--prompt", "short",
                       "--max-new-tokens", "3"])
    out = capsys.readouterr().out.splitlines()
    assert status == 0, "\n".join(out)
    assert out[-1] == "verified: 8/8 requests match merged-weights outputs"
    assert any(line.startswith("model: ") and line.endswith(", float16") for line in out)
    assert any(line.startswith("tokenizer: byte-level") for line in out)
    assert "prompt 1: 'xxxxxxxxxxxxxxxxxxxx'" in out
    warm = [line for line in out if line.startswith("warm-up ")]
    assert any("prefill step, 8 rows x 32 tokens" in line for line in warm), warm
    assert any("prefill step, 8 rows x 16 tokens" in line for line in warm), warm
    assert "recompilations after warm-up: 0" in out
    assert any("tolerance 1e-02" in line for line in out)


class _ShapeRecorder:
    """Stands in for ServingEngine in the warm-up: its real bucketing, and the programs that
    `generate` would compile (one group of requests admitted at once, as the warm-up sends them)."""

    from jax_lora.serving import ServingEngine as _engine

    prefill_shape = _engine.prefill_shape
    _bucket_len = _engine._bucket_len

    def __init__(self, max_seqs, max_len=64, max_prefill_tokens=512):
        from types import SimpleNamespace
        self.max_seqs, self.max_len, self.max_prefill_tokens = max_seqs, max_len, max_prefill_tokens
        self.min_prefill_len, self.min_prefill_rows = 16, 8
        self.config = SimpleNamespace(vocab_size=512)
        self.programs = set()

    @property
    def compile_count(self):
        return len(self.programs)

    def generate(self, requests, use_lora=True):
        shape = self.prefill_shape(len(requests), max(len(r.prompt) for r in requests))
        assert shape is not None, "the warm-up sent a group that cannot be admitted at once"
        self.programs.add(("prefill", shape, use_lora))
        if any(r.max_new_tokens > 1 for r in requests):
            self.programs.add(("decode", self.max_seqs, use_lora))


@pytest.mark.parametrize("max_seqs", [3, 8, 16])
def test_warm_up_compiles_every_bucket_serving_can_use(max_seqs, capsys):
    """Every (rows, length) prefill bucket that any number of admitted requests can form, with and
    without adapters, and the decode step: more than one rows bucket when max_seqs > 8."""
    from jax_lora.serving import Request

    engine = _ShapeRecorder(max_seqs)
    requests = [Request(prompt=[1] * n, lora_id=1) for n in (5, 16, 17, 40)]
    count = cli._warm_up(engine, requests, 1, print)
    expected = {("prefill", engine.prefill_shape(n, length), lora) for n in range(1, max_seqs + 1)
                for length in (5, 16, 17, 40) for lora in (True, False) if engine.prefill_shape(n, length)}
    expected |= {("decode", max_seqs, lora) for lora in (True, False)}
    assert engine.programs == expected and count == len(expected)
    lines = capsys.readouterr().out.splitlines()
    assert len([line for line in lines if line.startswith("warm-up ") and "compiling the" in line]) == len(expected)
    if max_seqs == 16:
        assert ("prefill", (16, 16), True) in expected


def test_slow_tests_name_existing_tests():
    """Every SLOW_TESTS pattern (tests/conftest.py) names a test function that exists, so a renamed
    slow test does not silently join the quick subset."""
    from .conftest import SLOW_TESTS

    for pattern in SLOW_TESTS:
        path, _, name = pattern.partition("::")
        with open(os.path.join(REPO, path)) as f:
            functions = {node.name for node in ast.walk(ast.parse(f.read())) if isinstance(node, ast.FunctionDef)}
        name = name.split("[")[0]
        if name == "*":
            continue
        assert name in functions, f"SLOW_TESTS names {pattern!r}, but {path} has no test {name}"


@pytest.fixture(scope="module")
def llama_dirs(tmp_path_factory):
    """A tiny random Llama checkpoint and three PEFT adapters (tests/llama_checkpoint.py): directory per key."""
    return llama_checkpoint.write_assets(tmp_path_factory.mktemp("llama_checkpoint"))








# Meshes of host CPU devices (tests/conftest.py forces 8). On a GPU machine JAX's default backend
# is the GPU, with one device here, and XLA's CPU compiler crashed on these shard_map programs
# (tests/test_parallel.py): skipped there; multi-GPU meshes are tested apart.
_CPU_MESHES = pytest.mark.skipif(jax.default_backend() != "cpu",
                                 reason="CPU-device meshes; JAX's default backend here is not the CPU")


@pytest.mark.parametrize("argv, word", [(["demo", "--max-seqs", "0"], "--max-seqs"),
                                        (["demo", "--backend", "bogus"], "--backend"),
                                        (["demo", "--dtype", "int8"], "--dtype")])
def test_cli_bad_options_exit_2_with_argparse_message(argv, word, capsys):
    """Bad demo options (counts that are not positive, unknown backend or dtype) exit with
    status 2 and argparse's message, no traceback."""
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert word in err and "Traceback" not in err


@_CPU_MESHES
def test_demo_with_model_and_adapter_directories_verifies(llama_dirs, capsys):
    """`jax-lora demo MODEL_DIR
    ADAPTER_DIR... --tp 2` serves mixed-adapter requests (some without adapter) through the jit loop
    split over 2 CPU devices, here with one slot for two adapters (LRU swapping), reports no
    recompilation after warm-up, prints tokens/s and the LoRA overhead, and ends with
    `verified: N/N requests match merged-weights outputs`, exit status 0."""
    rc = cli.main(["demo", llama_dirs["model"], llama_dirs["a1"], llama_dirs["a2"], "--num-requests", "3",
                   "--max-new-tokens", "2", "--max-seqs", "2", "--slots", "1", "--tp", "2"])
    out = capsys.readouterr().out
    assert rc == 0, out
    lines = out.strip().splitlines()
    assert lines[-1] == "verified: 3/3 requests match merged-weights outputs"
    assert "recompilations after warm-up: 0" in out and "LoRA overhead" in out and "tokens/s" in out
    assert "tensor parallel: 2 devices" in out


def test_cli_version(capsys):
    """`jax-lora --version` prints the version and exits 0."""
    with pytest.raises(SystemExit) as e:
        cli.main(["--version"])
    assert e.value.code == 0
    assert jax_lora.__version__ in capsys.readouterr().out


def test_cli_bad_directories_and_adapters_one_line_exit_2(llama_dirs, tmp_path, capsys):
    """`jax-lora demo MODEL_DIR ADAPTER_DIR` with an adapter that cannot be loaded (an
    empty aLoRA invocation), a missing directory, no adapter after MODEL_DIR, or --prompt with a MODEL_DIR that
    has no tokenizer exits 2 with one line `jax-lora demo: error: <what and why>`, no traceback."""
    bad = write_adapter(tmp_path / "alora", plain_config(alora_invocation_tokens=[]), q_tensors(
        2, "model.layers.0.self_attn.q_proj", 32, 32))
    for argv, word in [([llama_dirs["model"], bad], "alora_invocation_tokens"),
                       ([llama_dirs["model"], str(tmp_path / "missing")], "missing"),
                       ([llama_dirs["model"]], "adapter"),
                       ([llama_dirs["model"], llama_dirs["a1"], "--prompt", "hi"], "tokenizer")]:
        assert cli.main(["demo", *argv]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("jax-lora demo: error:") and word in err[0], err
