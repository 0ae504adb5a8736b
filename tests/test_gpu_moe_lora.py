"""GPU tests of the mixture-of-experts LoRA kernel (marked `gpu`; run on the lent H200 with PYTHONPATH=.).

The compiled kernel (`lora_core.kernels.moe_lora` through `torch_lora.ops.fused_moe_lora`) against a
float64 reference at Mixtral-8x7B and Qwen3-30B-A3B layer shapes (hidden / intermediate sizes, 8 or
128 experts, top 2 or 8), both pair orders, ranks 16 and 64, gate_up and down, the sorted order's
sub-blocks and grids; a CUDA-graph replay with a new routing; and MultiLoRAModel on a tiny Mixtral
on CUDA (Triton backend) against PEFT. The JAX side's Triton backend (`jax_lora.ops.triton_moe`,
the same kernel through the XLA FFI launcher) under jax.jit on the same cases, both pair orders,
per-slot ranks.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")

pytestmark = pytest.mark.gpu

SHAPES = {"mixtral": (4096, 14336, 8, 2), "qwen3": (2048, 768, 128, 8)}


def _case(shape, tokens, rank, slots, down, seed):
    from torch_lora.ops.moe import moe_block_size, moe_lora_align_block_size, naive_block_assignment
    hidden, inter, experts, top_k = SHAPES[shape]
    g = torch.Generator(device="cuda").manual_seed(seed)
    kw = dict(device="cuda", generator=g)
    k_in, widths = (inter, (hidden,)) if down else (hidden, (inter, inter))
    bf = torch.bfloat16
    a = [(torch.randn(slots, experts, rank, k_in, **kw) / math.sqrt(k_in)).to(bf) for _ in widths]
    b = [(torch.randn(slots, experts, n, rank, **kw) / math.sqrt(rank)).to(bf) for n in widths]
    x = torch.randn(tokens * top_k if down else tokens, k_in, **kw).to(bf)
    topk_ids = torch.argsort(torch.rand(tokens, experts, **kw), dim=1)[:, :top_k].to(torch.int32)
    w = torch.rand(tokens, top_k, **kw) + 0.1
    topk_weights = w / w.sum(1, keepdim=True)
    token_lora = torch.randint(-1, slots, (tokens,), **kw).to(torch.int32)
    enabled = torch.ones(slots + 1, dtype=torch.int32, device="cuda")
    enabled[0] = 0
    naive = naive_block_assignment(tokens, top_k, experts, slots)
    block = moe_block_size(tokens * top_k, experts)
    align = ((None, topk_ids.reshape(-1), None) if naive else
             moe_lora_align_block_size(topk_ids, token_lora, experts, block, slots, enabled))
    return dict(a=a, b=b, x=x, topk_ids=topk_ids, topk_weights=topk_weights, token_lora=token_lora, enabled=enabled,
                align=align, block=None if naive else block, top_k=top_k, rank=rank, down=down,
                y=torch.zeros(tokens, top_k, sum(widths), dtype=bf, device="cuda"))


def _reference(c):
    """float64 LoRA term of every live pair (slot enabled), through the oracle's loop order per pair group."""
    tokens, top_k = c["topk_ids"].shape
    lora = c["token_lora"].long().repeat_interleave(top_k)
    expert = c["topk_ids"].reshape(-1).long()
    rows = torch.arange(tokens * top_k, device="cuda")
    xrow = rows if c["down"] else rows // top_k
    out = torch.zeros(tokens * top_k, c["y"].shape[2], dtype=torch.float64, device="cuda")
    live = (lora >= 0) & (c["enabled"][lora.clamp(min=0)] != 0)
    key = torch.where(live, lora * 1000 + expert, torch.full_like(lora, -1))
    for k in torch.unique(key[live]).tolist():
        pick = (key == k).nonzero().squeeze(1)
        slot, e = divmod(k, 1000)
        xs = c["x"][xrow[pick]].double()
        col = 0
        for a, b in zip(c["a"], c["b"]):
            term = (xs @ a[slot, e].double().T) @ b[slot, e].double().T
            if c["down"]:
                term = term * c["topk_weights"].reshape(-1)[pick].double()[:, None]
            out[pick, col:col + b.shape[2]] = term
            col += b.shape[2]
    return out.view(tokens, top_k, -1)


def _run(c):
    from torch_lora.ops import fused_moe_lora
    sorted_ids, expert_ids, post_pad = c["align"]
    fused_moe_lora(c["y"], c["x"], c["a"], c["b"], c["topk_weights"], sorted_ids, expert_ids, post_pad,
                   c["token_lora"], c["rank"], c["top_k"], c["enabled"], c["down"], 0, block_size=c["block"],
                   backend="triton")


def _rel(got, want):
    """Relative error; a case whose tokens all lack a live adapter wants an untouched (zero) y."""
    diff = float(torch.linalg.norm(got.double() - want))
    scale = float(torch.linalg.norm(want))
    return diff / scale if scale > 0 else (0.0 if diff == 0 else float("inf"))


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("tokens", [1, 32, 2048])
@pytest.mark.parametrize("rank", [16, 64])
@pytest.mark.parametrize("down", [False, True], ids=["w13", "w2"])
def test_compiled_kernel_matches_float64(shape, tokens, rank, down):
    c = _case(shape, tokens, rank, 8, down, seed=tokens + rank + down)
    _run(c)
    torch.cuda.synchronize()
    assert _rel(c["y"], _reference(c)) < 2e-2


_CONFIGS = {  # one knob of the default moved per config (lora_core.kernels.moe_configs), compiled for the GPU
    "dot-naive": dict(GEMV=False, R_CHUNK=16, BLOCK_K=128),
    "many-tiles": dict(BLOCK_N=32, TILES_N=16, expand_warps=8, expand_stages=4),
    "split-16": dict(K_SPLIT=16, BLOCK_K=32, shrink_warps=8, shrink_stages=2),
}


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("tokens", [16, 256])
@pytest.mark.parametrize("name", sorted(_CONFIGS))
def test_compiled_kernel_under_moved_configs(shape, tokens, name):
    """The tuner's kinds of candidates (the naive order's tl.dot path, many narrow tiles per expand
    program, a 16-way hidden split) at both models' gate_up shapes, rank 64, against float64."""
    from lora_core.kernels import moe_configs
    c = _case(shape, tokens, 64, 8, False, seed=tokens + 3)
    hidden, inter, experts, top_k = SHAPES[shape]
    base = moe_configs.default_moe_config(moe_configs.MoeShape(
        num_pairs=tokens * top_k, naive=c["block"] is None, block_m=c["block"] or 16, num_slots=8,
        num_experts=experts, hidden=hidden, widest=inter, slices=2, shrink_slices=2, rank=64))
    with moe_configs.override_moe_config(base.replace(**_CONFIGS[name])):
        _run(c)
    torch.cuda.synchronize()
    assert _rel(c["y"], _reference(c)) < 2e-2


_SORTED_CONFIGS = {  # the sorted order's structural knobs (tune_moe_lora.sorted_moves), compiled for the GPU
    "sub-16": dict(BLOCK_M=16),
    "bound-grid": dict(PERSIST=0),
    "one-per-block-wide": dict(PERSIST=1, BLOCK_N=128, TILES_N=1, expand_warps=4, expand_stages=3),
}


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("down", [False, True], ids=["w13", "w2"])
@pytest.mark.parametrize("name", sorted(_SORTED_CONFIGS))
def test_compiled_sorted_kernel_under_structural_configs(shape, down, name):
    """Prefill (2048 tokens, 8 adapters: blocks of 64 rows for Mixtral, 32 for Qwen3) in sub-blocks,
    on the routing-free bound's grid, and with fewer programs than blocks (each looping), rank 64,
    against float64."""
    from lora_core.kernels import moe_configs
    c = _case(shape, 2048, 64, 8, down, seed=11 + down)
    hidden, inter, experts, top_k = SHAPES[shape]
    k_in, widest = (inter, hidden) if down else (hidden, inter)
    base = moe_configs.default_moe_config(moe_configs.MoeShape(
        num_pairs=2048 * top_k, naive=False, block_m=c["block"], num_slots=8, num_experts=experts, hidden=k_in,
        widest=widest, slices=1 if down else 2, shrink_slices=1 if down else 2, rank=64))
    with moe_configs.override_moe_config(base.replace(**_SORTED_CONFIGS[name])):
        _run(c)
    torch.cuda.synchronize()
    assert _rel(c["y"], _reference(c)) < 2e-2


def test_graph_replay_follows_a_new_routing():
    """Captured once, replayed after the routing, the mapping and the alignment changed in place."""
    c = _case("qwen3", 64, 16, 8, False, seed=7)
    if c["block"] is None:
        pytest.skip("naive order at this size")
    _run(c)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        _run(c)
    fresh = _case("qwen3", 64, 16, 8, False, seed=8)
    for key in ("topk_ids", "topk_weights", "token_lora", "x"):
        c[key].copy_(fresh[key])
    for dst, src in zip(c["align"], fresh["align"]):
        dst.copy_(src)
    c["y"].zero_()
    graph.replay()
    torch.cuda.synchronize()
    assert _rel(c["y"], _reference(c)) < 2e-2


def test_multilora_mixtral_on_cuda_matches_peft(tmp_path):
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    from torch_lora.hf import MultiLoRAModel
    torch.manual_seed(0)
    torch.backends.cuda.matmul.allow_tf32 = False
    cfg = transformers.MixtralConfig(vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, num_local_experts=8,
                                     num_experts_per_tok=2, tie_word_embeddings=False)
    transformers.MixtralForCausalLM(cfg).save_pretrained(tmp_path / "base")

    def fresh():
        return transformers.MixtralForCausalLM.from_pretrained(tmp_path / "base").cuda().eval()
    lora = peft.LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj"], init_lora_weights=False,
                           target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])
    pm = peft.get_peft_model(fresh(), lora).eval()
    pm.save_pretrained(tmp_path / "adapter")
    mm = MultiLoRAModel(fresh(), max_loras=2, max_rank=8, backend="triton")
    mm.load_adapter("a", str(tmp_path / "adapter"))
    tokens = torch.as_tensor(np.random.default_rng(0).integers(1, 64, size=(2, 7))).cuda()
    out = mm(tokens, adapter_names=["a", "__base__"]).logits
    with torch.no_grad():
        want = pm(tokens[:1]).logits[0]
        with pm.disable_adapter():
            base = pm(tokens[1:]).logits[0]
    assert float((out[0] - want).abs().max() / want.abs().max()) < 1e-4
    assert float((out[1] - base).abs().max() / base.abs().max()) < 1e-4


def _jax(t):
    """A torch CUDA tensor as a jax array of the same dtype (bfloat16 values pass exactly)."""
    import jax.numpy as jnp
    if t is None:
        return None
    if t.dtype == torch.bfloat16:
        return jnp.asarray(t.float().cpu().numpy()).astype(jnp.bfloat16)
    return jnp.asarray(t.cpu().numpy())


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("tokens", [1, 32, 2048])
@pytest.mark.parametrize("down", [False, True], ids=["w13", "w2"])
def test_jax_triton_moe_under_jit_matches_float64(shape, tokens, down):
    """jax_lora.ops.fused_moe_lora(backend="triton") under jax.jit runs the Triton kernel through
    the FFI launcher (never the xla fallback) and matches the float64 reference."""
    jax = pytest.importorskip("jax")
    from jax_lora.ops import ffi_launcher, fused_moe, fused_moe_lora, triton_moe
    ffi_launcher.unavailable_reason.cache_clear()
    assert ffi_launcher.available(), ffi_launcher.unavailable_reason()
    assert fused_moe.backend_module("triton") is triton_moe
    c = _case(shape, tokens, 16, 8, down, seed=100 + tokens + down)
    sorted_ids, expert_ids, post_pad = (_jax(v) for v in c["align"])
    args = [_jax(v) for v in (c["y"], c["x"])] + [[_jax(a) for a in c["a"]], [_jax(b) for b in c["b"]]]
    weights, mapping, enabled = _jax(c["topk_weights"]), _jax(c["token_lora"]), _jax(c["enabled"])
    top_k, block = c["top_k"], c["block"]

    @jax.jit
    def step(y, x, a, b, sorted_ids, expert_ids, post_pad, weights, mapping, enabled):
        return fused_moe_lora(y, x, a, b, weights, sorted_ids, expert_ids, post_pad, mapping, 16, top_k, enabled,
                              down, 0, block_size=block, backend="triton")

    got = step(*args, sorted_ids, expert_ids, post_pad, weights, mapping, enabled)
    got = torch.as_tensor(np.asarray(got.astype(jax.numpy.float32)), device="cuda")
    assert _rel(got, _reference(c)) < 2e-2


def test_jax_triton_moe_per_slot_ranks():
    """lora_ranks: rank columns past a slot's rank are never read (Inf there), on the compiled kernel."""
    jax = pytest.importorskip("jax")
    from jax_lora.ops import fused_moe_lora
    c = _case("mixtral", 32, 16, 4, False, seed=5)
    ranks = torch.tensor([16, 5, 9, 16], dtype=torch.int32, device="cuda")
    poisoned = []
    for a in c["a"]:
        p = a.clone()
        for slot, r in enumerate(ranks.tolist()):
            a[slot, :, r:] = 0
            p[slot, :, r:] = float("inf")
        poisoned.append(p)
    sorted_ids, expert_ids, post_pad = (_jax(v) for v in c["align"])
    got = fused_moe_lora(_jax(c["y"]), _jax(c["x"]), [_jax(a) for a in poisoned], [_jax(b) for b in c["b"]],
                         _jax(c["topk_weights"]), sorted_ids, expert_ids, post_pad, _jax(c["token_lora"]), 16,
                         c["top_k"], _jax(c["enabled"]), False, 0, block_size=c["block"], backend="triton",
                         lora_ranks=_jax(ranks))
    got = torch.as_tensor(np.asarray(got.astype(jax.numpy.float32)), device="cuda")
    assert torch.isfinite(got).all()
    assert _rel(got, _reference(c)) < 2e-2


def test_wrapper_add_lora_w13_captures_with_its_alignment():
    """torch_lora.PunicaWrapper.add_lora_w13 (the sorted order: its alignment runs in the graph too,
    no host read) captured once and replayed after a new routing and new inputs written in place."""
    import torch_lora
    from lora_core.host_mapping import LoRAMapping
    c = _case("qwen3", 64, 16, 8, False, seed=11)
    slots = 8
    w = torch_lora.PunicaWrapper(64, 64, "cuda", max_loras=slots, backend="triton")
    ids = tuple(int(s) + 1 for s in c["token_lora"].tolist())
    w.update_metadata(LoRAMapping(ids, ids, False), list(range(1, slots + 1)), slots, 32000)
    experts, top_k = c["a"][0].shape[1], c["top_k"]

    def step():
        c["y"].zero_()
        return w.add_lora_w13(c["y"], c["x"], tuple(c["a"]), tuple(c["b"]), c["topk_ids"], c["topk_weights"], None,
                              c["a"][0], c["a"][0], 64, top_k, slots, c["enabled"], experts, top_k, 2, False, False)
    align = step()
    assert align[0] is not None, "expected the sorted order at 64 tokens of 128 experts"
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    fresh = _case("qwen3", 64, 16, 8, False, seed=12)
    for key in ("topk_ids", "topk_weights", "x"):
        c[key].copy_(fresh[key])
    graph.replay()
    torch.cuda.synchronize()
    assert _rel(c["y"], _reference(c)) < 2e-2
