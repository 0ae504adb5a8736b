"""MoE model step benchmark: a Mixtral-8x7B-shaped decoder with LoRA on its attention and its
experts, in JAX and in torch, base step against LoRA step (the MoE counterpart of e2e_decode.py).

    PYTHONPATH=. python benchmarks/e2e_moe.py --out $OUT                  # one H200, all cases
    PYTHONPATH=. python benchmarks/e2e_moe.py --cases 'dec B32' --out /tmp/m  # a regex over names
    PYTHONPATH=. python benchmarks/e2e_moe.py --smoke --out /tmp/m          # CPU, tiny model

The model: Mixtral-8x7B's layer (hidden 4096, 32 query / 8 key-value heads of 128, 8 experts of
intermediate 14336, top 2, vocab 32000), bf16, random weights, with LAYERS = 4 layers (`--layers`;
the full model has 32: the step's layers are alike, so the per-step overhead scales with their
number and the overhead % barely depends on it). LoRA on q, k, v, o and the experts (gate_up and
down of every expert) in NUM_SLOTS = 8 slots, all at rank 16: A ~ N(0, 1/in), B ~ N(0, B_SCALE^2/r).
Both frameworks run the same weights: the JAX model owns them and torch reads them through DLPack
(the expert weights as (E, out, in) copies, the layout torch's grouped GEMM takes).

  * JAX: `jax_lora.models.mixtral.MixtralForCausalLM` after `add_lora`, e2e_decode's step body
    under `jax.jit` (KV cache donated), `jax_lora.PunicaWrapper` with the Triton backend (the
    attention through add_lora_linear, the experts through add_lora_w13 / add_lora_w2:
    jax_lora.ops.triton_moe, the XLA FFI launcher). The base experts: `jax.lax.ragged_dot`
    (jax_lora.moe). Base step: the same program with the LoRA layers off. Timed per step on the
    host, the call to `block_until_ready`, median of N.
  * torch: e2e_decode's lean decoder with its feed-forward replaced by the MoE block here: the
    router (softmax, top 2, renormalised), the pairs sorted by expert and each expert's rows
    multiplied in one grouped GEMM (`torch._grouped_mm`; where it cannot run, every expert on every
    row, masked: stated in the output), LoRA through `torch_lora.PunicaWrapper` (add_lora_linear
    on qkv and o, add_lora_w13 / add_lora_w2 on the experts). Each step is one CUDA graph, captured
    once per step shape; timed with CUDA events around each replay, median of N.
  * Base and LoRA steps are timed alternately, so drift hits both alike.

Cases: decode (one token per sequence, each its own request, at KV position CONTEXT of MAX_LEN) at
batch 1, 8, 32 with 1 and 8 distinct adapters (at most the batch); prefill of one sequence of 2048
tokens with 1 adapter. Order: B1 D1, B8 D8, B32 D8, the prefill, B8 D1, B32 D1.

Correctness, before any time is taken:
  * torch: the LoRA step eagerly (the same kernels the graph replays) against a reference step in
    plain torch, every LoRA term computed separately per token in float32 (gathered A and B of the
    token's slot and expert), with the routing of the checked step forced (a router decision that
    flips between two roundings would otherwise dominate the error); the graph's logits must equal
    the eager step's to TOL_GRAPH.
  * JAX (the decode case of 8 rows and 8 adapters: one more compiled program): the Triton LoRA step
    against the same model with the "xla" backend's reference ops; a row whose top-2 experts nearly
    tie may route differently under the two paths' roundings, so at least ROWS_OK of the rows must
    be within TOL_ERR.
  * Relative Frobenius error per row of the logits, each below TOL_ERR and below TOL_ERR_OVER_EFFECT
    times the LoRA's effect (LoRA logits against base logits). A framework whose check fails
    reports no time for that case (and the run exits 1).

Output: `e2e_moe.json` (meta, rows: per case and framework base us, LoRA us, overhead us and %,
the check's errors) and `e2e_moe.md` in --out, rewritten after every case; `--budget-s` skips a
case that would end past it (its start plus the longest case so far; listed as skipped).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import json
import os
import re
import sys
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")    # JAX and torch share the GPU

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import e2e_decode

NUM_SLOTS = 8
RANK = 16
LAYERS = 4
CONTEXT, MAX_LEN = 256, 512
B_SCALE = 0.5
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "experts")
TOL_ERR = 0.1
TOL_ERR_OVER_EFFECT = 0.2
TOL_GRAPH = 1e-2
ROWS_OK = 0.75


@dataclasses.dataclass(frozen=True)
class Case:
    """One measured step: `rows` sequences of `seq` tokens (decode: seq 1), `adapters` distinct
    adapters among them."""

    kind: str          # "dec" | "pre"
    rows: int
    seq: int
    adapters: int

    @property
    def tokens(self) -> int:
        return self.rows * self.seq

    @property
    def name(self) -> str:
        return (f"dec B{self.rows} D{self.adapters} r{RANK}" if self.kind == "dec"
                else f"pre {self.rows}x{self.seq} D{self.adapters} r{RANK}")


def cases(smoke: bool) -> list:
    if smoke:
        return [Case("dec", 1, 1, 1), Case("dec", 8, 1, 3), Case("pre", 1, 16, 1)]
    # the 8-adapter decode cases and the prefill first: a budget cut leaves out the 1-adapter ones
    return [Case("dec", 1, 1, 1), Case("dec", 8, 1, 8), Case("dec", 32, 1, 8), Case("pre", 1, 2048, 1),
            Case("dec", 8, 1, 1), Case("dec", 32, 1, 1)]


def model_config(smoke: bool, layers: int):
    from jax_lora.models.mixtral import MixtralConfig
    if smoke:
        return MixtralConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4,
                             num_experts_per_tok=2)
    return MixtralConfig(vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=layers,
                         num_attention_heads=32, num_key_value_heads=8, head_dim=128, num_local_experts=8,
                         num_experts_per_tok=2)


# ------------------------------------------------------------------------------------------ JAX model

class MoEJaxModel(e2e_decode.JaxModel):
    """The Flax Mixtral with random bf16 weights: 2-D kernels N(0, 1/in), expert weights (E, in,
    out) N(0, 1/in), embeddings N(0, 1), norm weights 1 + N(0, 0.1^2); after `add_lora` on
    LORA_TARGETS with NUM_SLOTS slots of rank RANK, every slot a random adapter."""

    def __init__(self, cfg, seed: int = 0):
        import jax
        import jax.numpy as jnp
        from flax import nnx

        from jax_lora import nn as lnn
        from jax_lora.models import mixtral

        self.cfg = cfg
        self._rng = np.random.default_rng(seed)
        self._torch_gen = None
        self.model = self.random_model(
            lambda: mixtral.MixtralForCausalLM(cfg, dtype=jnp.bfloat16, rngs=nnx.Rngs(0)))
        mixtral.add_lora(self.model, max_loras=NUM_SLOTS, max_rank=RANK, target_modules=LORA_TARGETS,
                         dtype=jnp.bfloat16)
        lora = nnx.state(self.model, lnn.LoRAWeight)
        flat, lora_def = jax.tree_util.tree_flatten_with_path(lora)
        specs, keep = [], []
        for path, leaf in flat:
            name = jax.tree_util.keystr(path)
            if re.search(r"lora_a\b", name):
                specs.append((tuple(leaf.shape), "bfloat16", leaf.shape[-1] ** -0.5, 0.0))
            elif re.search(r"lora_b\b", name):
                specs.append((tuple(leaf.shape), "bfloat16", B_SCALE * leaf.shape[-1] ** -0.5, 0.0))
            else:
                keep.append(len(specs) + len(keep))
                continue
        drawn = iter(self.random(specs))
        values = [leaf if i in keep else next(drawn) for i, (_, leaf) in enumerate(flat)]
        nnx.update(self.model, jax.tree_util.tree_unflatten(lora_def, values))
        self.rank = RANK


# ------------------------------------------------------------------------------------------ torch model

class ExpertOrder:
    """The pairs of one step sorted by expert (torch, no host sync): perm (P,) pair indices in
    expert order (stable), offs (E,) int32 the groups' running ends, expert (P,) of each sorted row."""

    def __init__(self, ids, num_experts: int):
        import torch
        flat = ids.reshape(-1)
        self.expert, self.perm = torch.sort(flat, stable=True)
        counts = (flat[:, None] == torch.arange(num_experts, device=flat.device)[None, :]).sum(0)
        self.offs = torch.cumsum(counts, 0).to(torch.int32)


def grouped_mm_probe(device) -> str:
    """"" when `torch._grouped_mm` runs here (CUDA, bf16, offsets, eagerly and from a CUDA
    graph), else why not."""
    import torch
    if getattr(device, "type", device) != "cuda" or not hasattr(torch, "_grouped_mm"):
        return "not a CUDA device" if getattr(device, "type", device) != "cuda" else "torch has no _grouped_mm"
    try:
        a = torch.randn(32, 64, device=device, dtype=torch.bfloat16)
        w = torch.randn(2, 64, 64, device=device, dtype=torch.bfloat16)       # (E, out, in)
        offs = torch.tensor([16, 32], dtype=torch.int32, device=device)
        out = torch._grouped_mm(a, w.transpose(1, 2), offs=offs)
        want = torch.cat([a[:16] @ w[0].T, a[16:] @ w[1].T])
        if float((out.float() - want.float()).abs().max()) > 0.1 * float(want.float().abs().max()):
            return "torch._grouped_mm gave a wrong product"
        graph = torch.cuda.CUDAGraph()                     # the steps are captured: so must it be
        with torch.cuda.graph(graph):
            captured = torch._grouped_mm(a, w.transpose(1, 2), offs=offs)
        graph.replay()
        torch.cuda.synchronize()
        if not torch.equal(captured, out):
            return "torch._grouped_mm replayed from a CUDA graph gave another product"
        return ""
    except Exception as e:
        return f"torch._grouped_mm failed: {type(e).__name__}: {e}"


class MoETorchModel(e2e_decode.TorchDecoder):
    """e2e_decode's lean decoder on the JAX Mixtral's weights, each layer's MLP the MoE block:
    router logits x @ gate (T, E) in float32, softmax, top k renormalised; gate_up per pair
    (T, k, 2I) by expert; LoRA hook `lora.experts_w13(i, gu, x, ids, weights) -> alignment`;
    h = silu(gate) * up; down per pair times the router weight; `lora.experts_w2(i, down, h,
    weights, alignment)`; the sum over k. `route` (a list) records each layer's (ids, weights), or
    forces them when it holds one entry per layer."""

    def __init__(self, cfg, jm: MoEJaxModel, device):
        import torch
        self.cfg, self.device = cfg, device
        m = jm.model.model

        def t(var):
            return torch.from_dlpack(var.get_value())

        self.embed = t(m.embed_tokens.embedding)
        self.norm = t(m.norm.weight)
        self.lm_head = t(jm.model.lm_head.kernel)
        self.layers = []
        for layer in m.layers:
            at, mlp = layer.self_attn, layer.mlp
            experts = mlp.experts.base
            self.layers.append(dict(
                ln1=t(layer.input_layernorm.weight), ln2=t(layer.post_attention_layernorm.weight),
                qkv=t(at.qkv_proj.base.kernel), o=t(at.o_proj.base.kernel), gate=t(mlp.gate.kernel),
                gate_up=t(experts.gate_up_proj).transpose(1, 2).contiguous(),      # (E, 2I, H)
                down=t(experts.down_proj).transpose(1, 2).contiguous()))          # (E, H, I)
        self._jm = jm
        self.lora = None
        self.fp8_product = "dequant"
        self.route = None
        self.grouped_reason = grouped_mm_probe(device)
        d = cfg.head_dim
        self.inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float32, device=device) / d))

    def load_lora(self) -> None:
        """Views of the JAX model's adapters: per layer, qkv and o as e2e_decode reads them, and
        "experts": (A_gu slices (L, E, r, H), B_gu slices (L, E, I, r), A_dn (L, E, r, I),
        B_dn (L, E, H, r), adapter_enabled (L,) int32)."""
        import torch
        self.lora = []
        for layer in self._jm.model.model.layers:
            per = {}
            for name, mod in (("qkv", layer.self_attn.qkv_proj), ("o", layer.self_attn.o_proj)):
                a = torch.from_dlpack(mod.lora_a.get_value())
                b = torch.from_dlpack(mod.lora_b.get_value())
                slices, off, bs = tuple(mod.output_slices), 0, []
                for n in slices:
                    bs.append(b[:, off:off + n, :])
                    off += n
                per[name] = (tuple(a[s] for s in range(len(slices))), tuple(bs), slices,
                             torch.from_dlpack(mod.lora_ranks.get_value()))
            ex = layer.mlp.experts
            a13, b13 = (torch.from_dlpack(v.get_value()) for v in (ex.w13_lora_a, ex.w13_lora_b))
            per["experts"] = ((a13[0], a13[1]), (b13[0], b13[1]), torch.from_dlpack(ex.w2_lora_a.get_value()),
                              torch.from_dlpack(ex.w2_lora_b.get_value()),
                              torch.from_dlpack(ex.adapter_enabled.get_value()))
            self.lora.append(per)

    def _grouped(self, rows, weight, order):
        """(P, out): rows[p] (P, in) @ weight[expert of p].T, weight (E, out, in)."""
        import torch
        sorted_rows = rows[order.perm]
        if not self.grouped_reason:
            out = torch._grouped_mm(sorted_rows, weight.transpose(1, 2), offs=order.offs)
        else:
            out = torch.zeros(rows.shape[0], weight.shape[1], dtype=rows.dtype, device=rows.device)
            for e in range(weight.shape[0]):
                mine = (order.expert == e)[:, None]
                out = torch.where(mine, sorted_rows @ weight[e].T, out)
        res = torch.empty_like(out)
        res[order.perm] = out
        return res

    def _mlp(self, i, w, x, lora):
        import torch
        import torch.nn.functional as F
        cfg = self.cfg
        T, k, E, inter = x.shape[0], cfg.num_experts_per_tok, cfg.num_local_experts, cfg.intermediate_size
        xn = self._rms(x, w["ln2"])
        if self.route is not None and len(self.route) == cfg.num_hidden_layers:
            ids, weights = self.route[i]                                       # forced (the check)
        else:
            probs = torch.softmax((xn @ w["gate"]).float(), dim=-1)
            weights, ids = torch.topk(probs, k, dim=-1)
            weights = weights / weights.sum(-1, keepdim=True)
            ids = ids.to(torch.int32)
            if self.route is not None:
                self.route.append((ids, weights))
        order = ExpertOrder(ids, E)
        gu = self._grouped(xn.repeat_interleave(k, dim=0), w["gate_up"], order).view(T, k, 2 * inter)
        align = lora.experts_w13(i, gu, xn, ids, weights) if lora is not None else None
        h = (F.silu(gu[..., :inter]) * gu[..., inter:]).reshape(T * k, inter)
        down = self._grouped(h, w["down"], order).view(T, k, -1)
        down = (down.float() * weights[..., None]).to(x.dtype)
        if lora is not None:
            lora.experts_w2(i, down, h, weights, align)
        return down.sum(dim=1)

    def wrapper_lora(self, punica):
        """The LoRA hooks through `torch_lora.PunicaWrapper` (scale 1: B holds it)."""
        td, cfg = self, self.cfg

        class Hook:
            def __call__(self, i, name, y, x):
                a, b, slices, ranks = td.lora[i][name]
                punica.add_lora_linear(y, x, a, b, None, 1.0, slices, lora_ranks=ranks)

            def experts_w13(self, i, gu, x, ids, weights):
                a13, b13, _, _, enabled = td.lora[i]["experts"]
                t, k = ids.shape
                w = td.layers[i]["gate_up"]
                return punica.add_lora_w13(gu, x, a13, b13, ids, weights, None, w, w, t, k, NUM_SLOTS, enabled,
                                           cfg.num_local_experts, k, 2, False, False)

            def experts_w2(self, i, down, h, weights, align):
                _, _, a2, b2, enabled = td.lora[i]["experts"]
                t, k = weights.shape
                w = td.layers[i]["down"]
                punica.add_lora_w2(down, h, (a2,), (b2,), weights, *align, t, w, w, k, NUM_SLOTS, enabled, k,
                                   False, 0, False)
        return Hook()

    def reference_hooks(self, slots):
        """LoRA terms in plain torch, float32, one gathered A and B per token (slots (T,) int64,
        -1 none)."""
        import torch
        td = self
        live = slots >= 0
        slot = slots.clamp(min=0)

        def add(y, delta, rows_live):
            y.copy_(torch.where(rows_live, (y.float() + delta).to(y.dtype), y))

        class Hook:
            def __call__(self, i, name, y, x):
                a, b, slices, _ = td.lora[i][name]
                off = 0
                for a_s, b_s, n in zip(a, b, slices):
                    h = torch.einsum("th,trh->tr", x.float(), a_s[slot].float())
                    d = torch.einsum("tr,tnr->tn", h, b_s[slot].float())
                    add(y[:, off:off + n], d, live[:, None])
                    off += n

            def experts_w13(self, i, gu, x, ids, weights):
                a13, b13, _, _, _ = td.lora[i]["experts"]
                e = ids.long()
                off = 0
                for a_s, b_s in zip(a13, b13):
                    h = torch.einsum("th,tkrh->tkr", x.float(), a_s[slot[:, None], e].float())
                    d = torch.einsum("tkr,tknr->tkn", h, b_s[slot[:, None], e].float())
                    n = b_s.shape[2]
                    add(gu[..., off:off + n], d, live[:, None, None])
                    off += n
                return ids

            def experts_w2(self, i, down, h, weights, ids):
                _, _, a2, b2, _ = td.lora[i]["experts"]
                t, k = ids.shape
                e = ids.long()
                hk = h.float().view(t, k, -1)
                r = torch.einsum("tki,tkri->tkr", hk, a2[slot[:, None], e].float())
                d = torch.einsum("tkr,tknr->tkn", r, b2[slot[:, None], e].float()) * weights[..., None]
                add(down, d, live[:, None, None])
        return Hook()


# ------------------------------------------------------------------------------------------ benchmark

def row_errors(got, ref) -> np.ndarray:
    """Relative error of each row (inf where got is not finite)."""
    got, ref = np.asarray(got, np.float64), np.asarray(ref, np.float64)
    err = np.linalg.norm(got - ref, axis=-1) / np.maximum(np.linalg.norm(ref, axis=-1), 1e-30)
    return np.where(np.isfinite(got).all(-1), err, np.inf)


class Bench:
    def __init__(self, args):
        import torch
        self.args, self.smoke = args, bool(args.smoke)
        self.cuda = torch.cuda.is_available() and not self.smoke
        self.device = torch.device("cuda" if self.cuda else "cpu")
        self.cfg = model_config(self.smoke, args.layers)
        self.cases = [c for c in cases(self.smoke) if re.search(args.cases or "", c.name)]
        self.t0 = time.perf_counter()
        self.jm = MoEJaxModel(self.cfg)
        self.td = MoETorchModel(self.cfg, self.jm, self.device)
        self.td.load_lora()
        self.states = self.jm.states()
        key = self.states[0]
        import jax
        self.jit = jax.jit(functools.partial(e2e_decode._jax_step, *key), static_argnums=(8,), donate_argnums=(2,))
        self.rows, self.skipped = [], []
        self.failed = False
        self.setup_s = time.perf_counter() - self.t0

    # ---------------------------------------------------------------- per case
    def _inputs(self, case: Case):
        import jax.numpy as jnp
        import torch
        rng = np.random.default_rng(1000 + case.rows * 7 + case.seq + case.adapters)
        tokens = rng.integers(0, self.cfg.vocab_size, (case.rows, case.seq)).astype(np.int32)
        if case.kind == "dec":
            pos = np.full((case.rows, 1), CONTEXT, np.int32)
            sample = np.zeros(case.rows, np.int32)
        else:
            pos = np.broadcast_to(np.arange(case.seq, dtype=np.int32), (case.rows, case.seq)).copy()
            sample = np.full(case.rows, case.seq - 1, np.int32)
        slots = rng.permutation(np.resize(np.arange(case.adapters), case.rows)).astype(np.int64)
        j = (jnp.asarray(tokens), jnp.asarray(pos), None, jnp.asarray(sample))
        t = (torch.from_numpy(tokens.astype(np.int64)).to(self.device),
             torch.from_numpy(pos.astype(np.int64)).to(self.device))
        return j, t, slots

    def _caches(self, case: Case):
        """(JAX KVCache, torch caches), zeros: (rows, max_len, kv, hd) / (rows, kv, max_len, hd) per layer."""
        import jax.numpy as jnp
        import torch

        from jax_lora.models.llama import init_cache
        max_len = MAX_LEN if case.kind == "dec" else case.seq
        cfg = self.cfg
        jc = init_cache(cfg, case.rows, max_len, dtype=jnp.bfloat16)
        shape = (case.rows, cfg.num_key_value_heads, max_len, cfg.head_dim)
        tc = [(torch.zeros(shape, dtype=torch.bfloat16, device=self.device),
               torch.zeros(shape, dtype=torch.bfloat16, device=self.device)) for _ in range(cfg.num_hidden_layers)]
        return jc, tc

    def _wrappers(self, case: Case, slots, backend_jax: str):
        import jax_lora
        import torch_lora
        from lora_core.host_mapping import LoRAMapping
        ids = (slots + 1).astype(int)
        mapping = LoRAMapping(tuple(np.repeat(ids, case.seq).tolist()), tuple(ids.tolist()), case.kind == "pre")
        lora_ids = list(range(1, NUM_SLOTS + 1))
        cap = max(case.tokens, 8)
        jw = jax_lora.PunicaWrapper(cap, max(case.rows, 8), None, max_loras=NUM_SLOTS, backend=backend_jax)
        jw.update_metadata(mapping, lora_ids, NUM_SLOTS, self.cfg.vocab_size)
        tw = torch_lora.PunicaWrapper(cap, max(case.rows, 8), self.device, max_loras=NUM_SLOTS,
                                      backend="triton" if self.cuda else "torch")
        tw.update_metadata(mapping, lora_ids, NUM_SLOTS, self.cfg.vocab_size)
        return jw, tw

    def _jax_step(self, case, j_args, cache, punica, lora: bool):
        import jax
        _key, lora_leaves, rest, empty = self.states
        cache, _tok, logits = self.jit(lora_leaves if lora else empty, rest, cache, punica if lora else None,
                                       *j_args, lora)
        jax.block_until_ready(logits)
        return cache, logits

    def _torch_check(self, case, t_args, t_cache, tw, slots) -> dict:
        """Eager LoRA step (routing recorded) against the reference step with that routing forced."""
        import torch
        td = self.td
        token_slots = torch.from_numpy(np.repeat(slots, case.seq)).to(self.device)
        with torch.no_grad():
            td.route = []
            lora_logits, _ = td.forward(*t_args, t_cache, lora=td.wrapper_lora(tw))
            ref_logits, _ = td.forward(*t_args, t_cache, lora=td.reference_hooks(token_slots))
            base_logits, _ = td.forward(*t_args, t_cache, lora=None)
            td.route = None
        got, ref, base = (v.double().cpu().numpy() for v in (lora_logits, ref_logits, base_logits))
        err, effect = row_errors(got, ref), row_errors(base, ref)
        ok = bool(np.all(err <= TOL_ERR) and np.all(err <= TOL_ERR_OVER_EFFECT * effect))
        return dict(ok=ok, err=float(err.max()), effect=float(effect.min()), eager=got)

    def _jax_check(self, case, j_args, slots, got) -> dict:
        """The Triton LoRA step's logits against the xla backend's (rows of decode cases >= 8)."""
        jc, _ = self._caches(case)
        jw, _ = self._wrappers(case, slots, "xla")
        _, ref = self._jax_step(case, j_args, jc, jw, True)
        jc, _ = self._caches(case)
        _, base = self._jax_step(case, j_args, jc, None, False)
        err, effect = row_errors(got, ref), row_errors(base, ref)
        good = (err <= TOL_ERR) & (err <= TOL_ERR_OVER_EFFECT * effect)
        return dict(ok=bool(good.mean() >= ROWS_OK), err=float(np.median(err)), effect=float(np.median(effect)),
                    rows_ok=float(good.mean()))

    def _torch_graph(self, step):
        import torch
        if not self.cuda:
            with torch.no_grad():
                out = step()
            return (lambda: step()), out
        g, out = e2e_decode.capture_cuda_graph(step, torch.cuda.Stream())
        return g.replay, out

    def _time_torch(self, runs, n):
        import torch
        times = [[] for _ in runs]
        if not self.cuda:
            with torch.no_grad():
                for _ in range(n):
                    for i, run in enumerate(runs):
                        t0 = time.perf_counter()
                        run()
                        times[i].append((time.perf_counter() - t0) * 1e6)
            return [float(np.median(t)) for t in times]
        events = []
        for _ in range(n):
            for i, run in enumerate(runs):
                e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                e0.record()
                run()
                e1.record()
                events.append((i, e0, e1))
        torch.cuda.synchronize()
        for i, e0, e1 in events:
            times[i].append(e0.elapsed_time(e1) * 1e3)
        return [float(np.median(t)) for t in times]

    def run_case(self, case: Case) -> None:
        n = self.args.steps
        j_args, t_args, slots = self._inputs(case)
        jw, tw = self._wrappers(case, slots, "triton" if self.cuda else "xla")
        row = dict(case=case.name, kind=case.kind, rows=case.rows, seq=case.seq, adapters=case.adapters, rank=RANK)
        jc, tc = self._caches(case)
        try:
            self._run_torch(case, row, t_args, tc, tw, slots, n)
        except Exception as e:
            self.td.route = None
            print(f"{case.name}: torch failed: {type(e).__name__}: {e}", file=sys.stderr)
            self._record(row, "torch", 0.0, 0.0, dict(ok=False, error=f"{type(e).__name__}: {e}"))
        # JAX: both steps compiled and warmed, the check, then timed alternately
        _, lora_logits = self._jax_step(case, j_args, jc, jw, True)
        jc, _ = self._caches(case)
        if case.kind == "dec" and case.rows == 8 and case.adapters > 1:
            jcheck = self._jax_check(case, j_args, slots, np.asarray(lora_logits, np.float64))
            jw, _ = self._wrappers(case, slots, "triton" if self.cuda else "xla")
        else:
            jcheck = dict(ok=True, note="JAX checked on the decode case of 8 rows and several adapters")
        jc, _ = self._caches(case)
        for lora in (False, True):
            jc, _ = self._jax_step(case, j_args, jc, jw, lora)
        times = [[], []]
        for _ in range(n):
            for i, lora in enumerate((False, True)):
                t0 = time.perf_counter()
                jc, _ = self._jax_step(case, j_args, jc, jw, lora)
                times[i].append((time.perf_counter() - t0) * 1e6)
        self._record(row, "jax", float(np.median(times[0])), float(np.median(times[1])), jcheck)

    def _run_torch(self, case, row, t_args, tc, tw, slots, n) -> None:
        """torch: the eager check, then graphs of both steps, timed alternately."""
        check = self._torch_check(case, t_args, tc, tw, slots)
        base_run, _ = self._torch_graph(lambda: self.td.forward(*t_args, tc, lora=None))
        lora_hook = self.td.wrapper_lora(tw)
        lora_run, lora_out = self._torch_graph(lambda: self.td.forward(*t_args, tc, lora=lora_hook))
        graph_err = float(row_errors(lora_out[0].double().cpu().numpy(), check.pop("eager")).max())
        check["ok"] = check["ok"] and graph_err <= TOL_GRAPH
        base_us, lora_us = self._time_torch([base_run, lora_run], n)
        self._record(row, "torch", base_us, lora_us, dict(check, graph_err=graph_err))

    def _record(self, row: dict, fw: str, base_us: float, lora_us: float, check: dict) -> None:
        ok = bool(check.get("ok"))
        self.failed |= not ok
        out = dict(row, framework=fw, check=check)
        if ok:
            out.update(base_us=round(base_us, 1), lora_us=round(lora_us, 1), overhead_us=round(lora_us - base_us, 1),
                       overhead_pct=round(100.0 * (lora_us - base_us) / base_us, 1))
        self.rows.append(out)
        self.write()

    def run(self) -> int:
        longest = 0.0
        for case in self.cases:
            start = time.perf_counter()
            if self.args.budget_s and start - self.t0 + longest > self.args.budget_s:
                self.skipped.append(case.name)
                self.write()
                continue
            self.run_case(case)
            longest = max(longest, time.perf_counter() - start)
        self.write()
        return 1 if self.failed else 0

    def write(self) -> None:
        import jax
        import torch
        meta = dict(date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                    smoke=self.smoke, device=torch.cuda.get_device_name() if self.cuda else "cpu",
                    jax=jax.__version__, torch=torch.__version__, layers=self.cfg.num_hidden_layers,
                    hidden=self.cfg.hidden_size, intermediate=self.cfg.intermediate_size,
                    experts=self.cfg.num_local_experts, top_k=self.cfg.num_experts_per_tok, slots=NUM_SLOTS,
                    rank=RANK, lora_targets=list(LORA_TARGETS), steps=self.args.steps,
                    torch_moe_base="grouped_mm" if not self.td.grouped_reason else
                    f"every expert on every row, masked ({self.td.grouped_reason})",
                    setup_s=round(self.setup_s, 1), elapsed_s=round(time.perf_counter() - self.t0, 1),
                    tolerances=dict(err=TOL_ERR, err_over_effect=TOL_ERR_OVER_EFFECT, graph=TOL_GRAPH,
                                    rows_ok=ROWS_OK))
        os.makedirs(self.args.out, exist_ok=True)
        with open(os.path.join(self.args.out, "e2e_moe.json"), "w") as f:
            json.dump(dict(meta=meta, rows=self.rows, skipped=self.skipped), f, indent=1)
        lines = [f"# MoE model step: base vs expert + attention LoRA ({meta['device']}, {meta['layers']} "
                 f"Mixtral-shaped layers, r{RANK})", "",
                 "| case | framework | base us | LoRA us | overhead us | overhead % | check |",
                 "|---|---|---:|---:|---:|---:|---|"]
        for r in self.rows:
            lines.append(f"| {r['case']} | {r['framework']} | {r.get('base_us', '-')} | {r.get('lora_us', '-')} | "
                         f"{r.get('overhead_us', '-')} | {r.get('overhead_pct', '-')} | "
                         f"{'ok' if r['check'].get('ok') else 'FAILED'} |")
        if self.skipped:
            lines += ["", "Skipped (budget): " + ", ".join(self.skipped)]
        with open(os.path.join(self.args.out, "e2e_moe.md"), "w") as f:
            f.write("\n".join(lines) + "\n")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True, help="folder for e2e_moe.json and e2e_moe.md")
    p.add_argument("--smoke", action="store_true", help="CPU, tiny model, reference backends")
    p.add_argument("--layers", type=int, default=LAYERS, help="decoder layers (Mixtral-8x7B has 32)")
    p.add_argument("--cases", default="", help="regex over case names")
    p.add_argument("--steps", type=int, default=None, help="timed steps per case and step kind")
    p.add_argument("--budget-s", type=float, default=0.0, help="skip cases that would start past this many seconds")
    args = p.parse_args(argv)
    if args.steps is None:
        args.steps = 3 if args.smoke else 30
    bench = Bench(args)
    return bench.run()


if __name__ == "__main__":
    raise SystemExit(main())
