"""The `torch-lora demo` main job: mixed-adapter batches through MultiLoRAModel, each request checked
against PEFT running it alone. The demo's own check is tested too: a wrong logit fails it. Also: a
checkpoint directory with LRU eviction, bad options as one-line errors with exit status 2 (also
through `python -m torch_lora.cli`), and colliding request ids refused. CPU, torch backend.
"""

from __future__ import annotations

import io
import json
import os
import pathlib
import re
import subprocess
import sys

import pytest
import tomllib

from . import hf_llama

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("peft")

from torch_lora import cli  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_console_script_is_declared():
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        scripts = tomllib.load(f)["project"]["scripts"]
    assert scripts["torch-lora"] == "torch_lora.cli:main"


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    root = tmp_path_factory.mktemp("demo")
    return cli.build_demo_assets(str(root), seed=0)


def test_demo_serves_and_verifies_every_request_with_lru_swaps(assets):
    """Two slots for three adapters: batches evict and reload adapters, all requests still match."""
    model_dir, adapter_dirs = assets
    out = io.StringIO()
    status = cli.run_demo(model_dir, adapter_dirs, num_requests=8, batch_size=4, max_new_tokens=3, slots=2, out=out)
    text = out.getvalue()
    assert status == 0, text
    assert "rank 16, alpha 16, rslora: down_proj, embed_tokens, lm_head, o_proj, q_proj" in text
    assert "rank_pattern, alpha_pattern" in text
    assert "2 without adapter" in text
    evictions = int(re.search(r"(\d+) evictions? while serving", text).group(1))
    assert evictions > 0, text
    assert text.rstrip().endswith("verified: 8/8 requests match PEFT outputs")


def test_demo_mixtral_serves_expert_lora_and_verifies(tmp_path):
    """--model mixtral: a tiny mixture of experts, adapters with expert LoRA (target_parameters),
    attention LoRA and both, every request equal to PEFT's."""
    out = io.StringIO()
    model_dir, adapter_dirs = cli.build_demo_assets(str(tmp_path), seed=0, model="mixtral")
    status = cli.run_demo(model_dir, adapter_dirs, num_requests=6, batch_size=3, max_new_tokens=2, out=out)
    text = out.getvalue()
    assert status == 0, text
    assert "rank 8, alpha 16, rank_pattern: down_proj, gate_up_proj" in text
    assert "model: MixtralForCausalLM" in text
    assert text.rstrip().endswith("verified: 6/6 requests match PEFT outputs")
    assert cli.main(["demo", "--model", "gpt"]) == 2


def test_the_check_fails_on_a_wrong_logit(assets):
    """verify() is what the demo's last line counts: a served logit off by 1e-3 (relative) fails."""
    import peft
    import transformers

    model_dir, adapter_dirs = assets
    from torch_lora.hf import MultiLoRAModel

    names = [os.path.basename(d) for d in adapter_dirs]
    mm = MultiLoRAModel(transformers.AutoModelForCausalLM.from_pretrained(model_dir).eval(), max_loras=3,
                        max_rank=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                                     "down_proj", "embed_tokens", "lm_head"])
    for n, d in zip(names, adapter_dirs):
        mm.load_adapter(n, d)
    requests = cli._demo_requests(512, ["__base__"] + names, 4, seed=3)
    served, _, _ = cli.serve(lambda ids, mask, names, **kw: mm.generate(ids, attention_mask=mask, adapter_names=names,
                                                                      **kw),
                             requests, device="cpu", batch_size=4, max_new_tokens=2, pad_id=0)
    ref = peft.PeftModel.from_pretrained(transformers.AutoModelForCausalLM.from_pretrained(model_dir), adapter_dirs[0],
                                         adapter_name=names[0])
    for n, d in zip(names[1:], adapter_dirs[1:]):
        ref.load_adapter(d, adapter_name=n)
    ok, worst, _ = cli.verify(ref.eval(), requests, served, torch.device("cpu"))
    assert all(ok.values()) and worst < cli.RTOL
    rid = requests[1][0]
    tokens, logits = served[rid]
    bad = logits.clone()
    bad[0, 0] += 1e-3 * max(1.0, float(logits.abs().max()))
    ok, _, _ = cli.verify(ref, requests, {**served, rid: (tokens, bad)}, torch.device("cpu"))
    assert not ok[rid] and sum(ok.values()) == len(requests) - 1


def test_demo_arguments_are_checked(tmp_path, capsys):
    assert cli.main(["demo", str(tmp_path / "no-model")]) == 2
    assert "torch-lora demo: error: give at least one adapter directory" in capsys.readouterr().err
    with pytest.raises(ValueError, match="num_requests must be an int >= 1, got 0"):
        cli.run_demo(num_requests=0)
    with pytest.raises(ValueError, match="slots must be an int >= 1, got 0"):
        cli.run_demo(slots=0)
    if not torch.cuda.is_available():
        assert cli.main(["demo", "--device", "cuda"]) == 2
        assert "torch-lora demo: error: device 'cuda', but this torch sees no CUDA device" in capsys.readouterr().err
    assert cli.main(["demo", "--device", "gpu0"]) == 2
    assert "torch-lora demo: error: device 'gpu0'" in capsys.readouterr().err


def test_batches_hold_at_most_the_slots_adapters():
    reqs = [(i, name, [1]) for i, name in enumerate(["a", "__base__", "b", "c", "a", "__base__", "c", "b"])]
    cut = cli.batches(reqs, batch_size=8, max_adapters=2)
    assert [[r[1] for r in b] for b in cut] == [["a", "__base__", "b"], ["c", "a", "__base__", "c"], ["b"]]
    assert [len(b) for b in cli.batches(reqs, batch_size=3)] == [3, 3, 2]
    assert sum(cli.batches(reqs, batch_size=1, max_adapters=1), []) == reqs


def test_serve_refuses_colliding_request_ids():
    """The results are keyed by request id: a second request with an id already in flight is
    refused before any batch is served (it would overwrite the first one's result)."""
    def generate(*args, **kwargs):
        raise AssertionError("a batch was served")
    kw = dict(device="cpu", batch_size=4, max_new_tokens=2, pad_id=0)
    with pytest.raises(ValueError, match=r"requests\[2\]: request id 7 is already in flight \(requests\[0\] has it\)"):
        cli.serve(generate, [(7, "a", [1, 2]), (8, "a", [3]), (7, "__base__", [4])], **kw)
    with pytest.raises(TypeError, match=r"requests\[0\]: the request id must be hashable \(it keys the results\), "
                                        r"got list \[1\]"):
        cli.serve(generate, [([1], "a", [1, 2])], **kw)


@pytest.fixture(scope="module")
def llama_assets(tmp_path_factory):
    """A tiny random transformers Llama and three peft adapters (tests/hf_llama.py): (fresh, dirs)."""
    return hf_llama.write_assets(tmp_path_factory.mktemp("hf_llama"))


REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_torch_lora_demo_on_a_checkpoint_verifies_every_request_with_eviction(llama_assets, capsys, tmp_path):
    """docs/torch.md: `torch-lora demo MODEL_DIR ADAPTER_DIR...` serves mixed
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
    gen = json.loads(pathlib.Path(gen_path).read_text())
    gen["eos_token_id"] = list(range(2, 34))
    pathlib.Path(gen_path).write_text(json.dumps(gen))
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
    """Clean CLI errors (no traceback, exit status 2) from `torch-lora demo`:
    --requests 0, --device cuda without CUDA, --backend bogus."""
    from torch_lora import cli
    _, dirs = llama_assets
    rc = cli.main(["demo", dirs["_model"], dirs["sql"], *argv])
    err = capsys.readouterr().err
    assert rc == 2
    assert "Traceback" not in err and word in err
    assert err.strip().splitlines()[-1].startswith("torch-lora demo: error:"), err


def test_python_m_torch_lora_cli_exits_2_on_a_bad_option():
    """docs/torch.md (`python -m torch_lora.cli demo`): a bad option is a
    one-line error and exit status 2 from the process, no traceback."""
    out = subprocess.run([sys.executable, "-m", "torch_lora.cli", "demo", "--requests", "0"], cwd=REPO,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    assert "Traceback" not in out.stderr and "requests" in out.stderr


def test_demo_serve_refuses_colliding_request_ids():
    """Colliding request ids are refused (torch demo) before anything
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
