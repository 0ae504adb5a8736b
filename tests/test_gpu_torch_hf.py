"""MultiLoRAModel on a GPU, eagerly and inside CUDA graphs (marked `gpu`; skipped without CUDA).

- A mixed batch through the compiled Triton kernels equals peft per request.
- A decode step (KV cache: transformers' StaticCache) captured once in a CUDA graph and replayed
  step after step with new tokens and new adapter mappings equals the eager model.
- Hot swap between replays: the replay after `load_adapter(name, other)` uses the new weights,
  without re-capturing (slot tensors and index tensors keep their addresses).
- Eviction under churn with a captured graph: more adapters than slots, each replay's batch
  activates its adapters (LRU) before the replay, and every replay equals eager.
- A DoRA adapter loaded into a model built without dora=True, then a graph captured: equal to peft.
- aLoRA rows (invocation found and absent) and generate() through the compiled kernels equal peft.
- aLoRA and DoRA in bfloat16: the model's error against peft in float32 is within twice peft's
  own bfloat16 error (plus a small floor), row by row.

The other models run in float32 (no TF32), so those comparisons are at the CPU tests' 1e-4.
"""

from __future__ import annotations

import inspect

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from torch_lora.hf import MultiLoRAModel  # noqa: E402

pytestmark = pytest.mark.gpu

RTOL = 1e-4
VOCAB = 128
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "embed_tokens", "lm_head"]
ADAPTERS = {
    "a": {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"]},
    "b": {"r": 8, "lora_alpha": 16, "use_rslora": True, "rank_pattern": {"down_proj": 2},
          "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]},
    "c": {"r": 2, "lora_alpha": 4, "target_modules": ["embed_tokens", "lm_head", "up_proj"]},
    "d": {"r": 6, "lora_alpha": 3, "target_modules": ["k_proj", "gate_proj"], "layers_to_transform": [1]},
}


def _rel(got, want) -> float:
    got, want = got.double().cpu(), want.double().cpu()
    return float((got - want).abs().max() / max(1.0, float(want.abs().max())))


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    root = tmp_path_factory.mktemp("gpu-hf")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                   tie_word_embeddings=False)
    transformers.LlamaForCausalLM(cfg).save_pretrained(str(root / "base"))
    dirs = {}
    for i, (name, kw) in enumerate(ADAPTERS.items()):
        torch.manual_seed(10 + i)
        model = transformers.LlamaForCausalLM.from_pretrained(str(root / "base"))
        peft.get_peft_model(model, peft.LoraConfig(init_lora_weights=False, **kw)).save_pretrained(str(root / name))
        dirs[name] = str(root / name)
    return str(root / "base"), dirs


def _wrapped(assets, max_loras=4, adapters=tuple(ADAPTERS)):
    base, dirs = assets
    model = transformers.LlamaForCausalLM.from_pretrained(base, dtype=torch.float32).cuda().eval()
    mm = MultiLoRAModel(model, max_loras=max_loras, max_rank=8, target_modules=ALL)
    for name in adapters:
        mm.load_adapter(name, dirs[name])
    return mm


class Graphed:
    """A forward pass of fixed shape (rows, seq) with logits_to_keep=1, captured once."""

    def __init__(self, mm, rows, seq, names):
        self.mm = mm
        self.ids = torch.zeros(rows, seq, dtype=torch.long, device="cuda")
        mm.prepare_step(names, seq, 1)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side), torch.no_grad():
            for _ in range(2):                                   # warm-up: Triton compiles, allocator settles
                mm.model(input_ids=self.ids, logits_to_keep=1)
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.no_grad(), torch.cuda.graph(self.graph):
            self.logits = mm.model(input_ids=self.ids, logits_to_keep=1).logits

    def __call__(self, tokens, names):
        self.ids.copy_(tokens)
        self.mm.prepare_step(names, self.ids.shape[1], 1)       # activate (uploads) + metadata, in place
        self.graph.replay()
        return self.logits[:, -1].clone()                        # (rows, vocab)


def test_mixed_batch_on_cuda_equals_peft_per_request(assets):
    """The Triton kernels (compiled) in every layer kind, against peft on the same GPU in float32."""
    base, dirs = assets
    mm = _wrapped(assets)
    assert mm.punica.backend == "triton"
    names = ["a", "b", "__base__", "c", "d", "b"]
    tokens = torch.randint(1, VOCAB, (len(names), 9), device="cuda")
    got = mm(tokens, adapter_names=names).logits
    ref = peft.PeftModel.from_pretrained(transformers.LlamaForCausalLM.from_pretrained(base).cuda(), dirs["a"],
                                         adapter_name="a").eval()
    for name in ("b", "c", "d"):
        ref.load_adapter(dirs[name], adapter_name=name)
    with torch.no_grad():
        for j, name in enumerate(names):
            if name == "__base__":
                with ref.disable_adapter():
                    want = ref(tokens[j:j + 1]).logits[0]
            else:
                ref.set_adapter(name)
                want = ref(tokens[j:j + 1]).logits[0]
            assert _rel(got[j], want) < RTOL, (j, name, _rel(got[j], want))


def test_decode_step_in_a_cuda_graph_equals_eager(assets):
    mm = _wrapped(assets)
    names = ["a", "b", "__base__", "c", "d", "a"]
    rows, prompt_len, steps = len(names), 5, 6
    gen = torch.Generator().manual_seed(1)
    seq = torch.randint(1, VOCAB, (rows, prompt_len), generator=gen).cuda()
    cache = transformers.StaticCache(config=mm.model.config, max_cache_len=prompt_len + steps + 2)
    params = inspect.signature(mm.model.forward).parameters
    cache_kw = "past_key_values" if "past_key_values" in params else "cache"
    with_cache_position = "cache_position" in params              # transformers < 5.20 takes it
    ids = torch.zeros(rows, 1, dtype=torch.long, device="cuda")
    pos = torch.zeros(1, 1, dtype=torch.long, device="cuda")
    cpos = torch.zeros(1, dtype=torch.long, device="cuda")

    def step_kwargs():
        kw = {"input_ids": ids, "position_ids": pos, cache_kw: cache, "use_cache": True, "logits_to_keep": 1}
        if with_cache_position:
            kw["cache_position"] = cpos
        return kw

    def set_position(p):
        pos.fill_(p)
        cpos.fill_(p)

    prefill = {cache_kw: cache, "use_cache": True}
    if with_cache_position:
        prefill["cache_position"] = torch.arange(prompt_len, device="cuda")
    out = mm(seq, adapter_names=names, **prefill).logits[:, -1]
    seq = torch.cat([seq, out.argmax(-1, keepdim=True)], dim=1)
    # One eager decode step (also the warm-up: same shapes, same kernels), then the capture.
    ids.copy_(seq[:, -1:])
    set_position(seq.shape[1] - 1)
    mm.prepare_step(names, 1, 1)
    with torch.no_grad():
        out = mm.model(**step_kwargs()).logits[:, -1]
    seq = torch.cat([seq, out.argmax(-1, keepdim=True)], dim=1)
    graph = torch.cuda.CUDAGraph()
    with torch.no_grad(), torch.cuda.graph(graph):
        static_logits = mm.model(**step_kwargs()).logits[:, -1]
    for step in range(steps - 1):
        ids.copy_(seq[:, -1:])
        set_position(seq.shape[1] - 1)
        mm.prepare_step(names, 1, 1)
        graph.replay()
        got = static_logits.clone()
        want = mm(seq, adapter_names=names, logits_to_keep=1).logits[:, -1]      # eager, no cache
        assert _rel(got, want) < RTOL, (step, _rel(got, want))
        assert torch.equal(got.argmax(-1), want.argmax(-1))
        seq = torch.cat([seq, got.argmax(-1, keepdim=True)], dim=1)


def test_hot_swap_between_replays_needs_no_recapture(assets):
    _, dirs = assets
    mm = _wrapped(assets)
    names = ["a", "__base__", "c", "b"]
    g = Graphed(mm, len(names), 7, names)
    tokens = torch.randint(1, VOCAB, (len(names), 7), device="cuda")
    ptrs = {k: t.data_ptr() for k, layer in mm.layers.items() for t in [layer.lora_a, layer.lora_ranks]}
    got = g(tokens, names)
    assert _rel(got, mm(tokens, adapter_names=names, logits_to_keep=1).logits[:, -1]) < RTOL
    mm.load_adapter("a", dirs["d"])                            # hot swap while the graph stays captured
    mm.load_adapter("c", dirs["b"])
    swapped = g(tokens, names)
    want = mm(tokens, adapter_names=names, logits_to_keep=1).logits[:, -1]
    assert _rel(swapped, want) < RTOL
    assert _rel(swapped[0], got[0]) > 1e-3 and _rel(swapped[1], got[1]) < 1e-6    # "a" changed, base did not
    fresh = _wrapped(assets, adapters=())
    fresh.load_adapter("a", dirs["d"])
    fresh.load_adapter("c", dirs["b"])
    fresh.load_adapter("b", dirs["b"])
    assert _rel(swapped, fresh(tokens, adapter_names=names, logits_to_keep=1).logits[:, -1]) < RTOL
    assert ptrs == {k: t.data_ptr() for k, layer in mm.layers.items() for t in [layer.lora_a, layer.lora_ranks]}


def test_eviction_under_churn_with_a_captured_graph(assets):
    mm = _wrapped(assets, max_loras=2)
    rng = np.random.default_rng(2)
    first = ["a", "b", "__base__", "a"]
    g = Graphed(mm, 4, 6, first)
    for step in range(12):
        pair = list(rng.choice(list(ADAPTERS), size=2, replace=False))
        names = [pair[0], "__base__", pair[1], pair[int(rng.integers(0, 2))]]
        tokens = torch.randint(1, VOCAB, (4, 6), device="cuda")
        got = g(tokens, names)
        want = mm(tokens, adapter_names=names, logits_to_keep=1).logits[:, -1]
        assert _rel(got, want) < RTOL, (step, names, _rel(got, want))
    assert mm.adapters.stats["evictions"] >= 6


def _peft_dir(assets, path, seed, **kw):
    """An adapter saved by peft for the base model; DoRA magnitudes moved off their initial norms."""
    base, _ = assets
    torch.manual_seed(seed)
    pm = peft.get_peft_model(transformers.LlamaForCausalLM.from_pretrained(base),
                             peft.LoraConfig(init_lora_weights=False, **kw))
    with torch.no_grad():
        for module in pm.modules():
            mags = getattr(module, "lora_magnitude_vector", None)
            if mags is not None and "default" in mags:
                mags["default"].weight.mul_(1.3).add_(0.05)
    pm.save_pretrained(str(path))
    return str(path)


def _peft_logits(assets, adapter_dir, tokens):
    base, _ = assets
    ref = peft.PeftModel.from_pretrained(transformers.LlamaForCausalLM.from_pretrained(base).cuda(),
                                         adapter_dir).eval()
    with torch.no_grad():
        return ref(tokens).logits


def test_dora_loaded_late_then_a_captured_graph_equals_peft(assets, tmp_path):
    """A DoRA adapter loaded into a model built without dora=True (its scales allocated then), a
    graph captured after it: replays equal eager and peft, next to plain LoRA and base rows."""
    d = _peft_dir(assets, tmp_path / "dora", 30, r=4, lora_alpha=8, use_dora=True,
                  target_modules=["q_proj", "v_proj", "down_proj"])
    mm = _wrapped(assets, adapters=("a", "b"))
    assert not mm.dora
    mm.load_adapter("dora", d)
    names = ["dora", "a", "__base__", "b"]
    tokens = torch.randint(1, VOCAB, (len(names), 7), device="cuda")
    eager = mm(tokens, adapter_names=names, logits_to_keep=1).logits[:, -1]
    assert mm.dora
    assert _rel(eager[0], _peft_logits(assets, d, tokens[:1])[0, -1]) < RTOL
    g = Graphed(mm, len(names), 7, names)
    assert _rel(g(tokens, names), eager) < RTOL


def test_alora_rows_on_cuda_equal_peft(assets, tmp_path):
    """An aLoRA adapter through the compiled kernels: forward rows with the invocation and without,
    and greedy generate, equal peft."""
    d = _peft_dir(assets, tmp_path / "alora", 31, r=4, lora_alpha=16, target_modules=["q_proj", "v_proj"],
                  alora_invocation_tokens=[5, 6], task_type="CAUSAL_LM")
    mm = _wrapped(assets, adapters=("a",))
    mm.load_adapter("act", d)
    tokens = torch.randint(10, VOCAB, (3, 8), device="cuda")
    tokens[0, 2:4] = torch.tensor([5, 6])
    tokens[2, 5:7] = torch.tensor([5, 6])
    got = mm(tokens, adapter_names=["act", "act", "a"]).logits
    want = _peft_logits(assets, d, tokens[:2])
    assert _rel(got[0], want[0]) < RTOL and _rel(got[1], want[1]) < RTOL
    base, _ = assets
    ref = peft.PeftModel.from_pretrained(transformers.LlamaForCausalLM.from_pretrained(base).cuda(), d).eval()
    gen = dict(max_new_tokens=4, min_new_tokens=4, do_sample=False, pad_token_id=0)
    out = mm.generate(tokens[:1], attention_mask=torch.ones_like(tokens[:1]), adapter_names=["act"], **gen)
    with torch.no_grad():
        ref_out = ref.generate(input_ids=tokens[:1], attention_mask=torch.ones_like(tokens[:1]), **gen)
    assert out[0].tolist() == ref_out[0].tolist()


def test_alora_and_dora_in_bfloat16_as_close_as_peft_in_bfloat16(assets, tmp_path):
    """bfloat16 serving: an aLoRA adapter (rows with and without the invocation) and a DoRA adapter
    loaded late, in one mixed batch of a bfloat16 MultiLoRAModel. Each row's distance to peft in
    float32 is at most 2x (+ 2e-3) the distance of peft itself run in bfloat16: our kernels' float32
    accumulation may not add error beyond bfloat16's own rounding."""
    base, _ = assets
    d_act = _peft_dir(assets, tmp_path / "alora16", 32, r=4, lora_alpha=16, target_modules=["q_proj", "v_proj"],
                      alora_invocation_tokens=[5, 6], task_type="CAUSAL_LM")
    d_dora = _peft_dir(assets, tmp_path / "dora16", 33, r=4, lora_alpha=8, use_dora=True,
                       target_modules=["q_proj", "v_proj", "down_proj"])
    model = transformers.LlamaForCausalLM.from_pretrained(base, dtype=torch.bfloat16).cuda().eval()
    mm = MultiLoRAModel(model, max_loras=4, max_rank=8, target_modules=ALL)
    mm.load_adapter("act", d_act)
    mm.load_adapter("dora", d_dora)
    tokens = torch.randint(10, VOCAB, (4, 8), device="cuda")
    tokens[0, 2:4] = torch.tensor([5, 6])
    tokens[3, 4:6] = torch.tensor([5, 6])
    names = ["act", "act", "dora", "__base__"]
    with torch.no_grad():
        got = mm(tokens, adapter_names=names).logits.float()
    for j, name in enumerate(names):
        want, peft16 = {}, {}
        for dtype, out in ((torch.float32, want), (torch.bfloat16, peft16)):
            ref_model = transformers.LlamaForCausalLM.from_pretrained(base, dtype=dtype).cuda()
            if name == "__base__":
                ref = ref_model.eval()
            else:
                ref = peft.PeftModel.from_pretrained(ref_model, d_act if name == "act" else d_dora).eval()
            with torch.no_grad():
                out["logits"] = ref(tokens[j:j + 1]).logits[0].float()
        ours, theirs = _rel(got[j], want["logits"]), _rel(peft16["logits"], want["logits"])
        assert ours <= 2 * theirs + 2e-3, (j, name, ours, theirs)
