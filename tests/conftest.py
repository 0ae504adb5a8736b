"""Test configuration shared by every test file.

TRITON_INTERPRET=1 must be set before any `@triton.jit` decorator runs, so it is set here, before
the packages are imported, unless CUDA is present (then the compiled kernels are tested).

`SLOW_TESTS` marks the longest CPU tests `slow`, so `python3 -m pytest -q -m "not slow"` is a quick
subset (docs/testing.md); the full suite, `python3 -m pytest -q`, still runs them (README, CI).
"""

import os
import re

import pytest


def _cuda_present() -> bool:
    if os.environ.get("JAX_LORA_TEST_CUDA") == "0":
        return False
    return os.path.exists("/dev/nvidiactl") or bool(os.environ.get("CUDA_VISIBLE_DEVICES"))


if not _cuda_present():
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
# Eight CPU devices: device-mismatch errors use two of them (docs/contract.md section 6), the
# tensor-parallel tests meshes of 2, 4 and 8 (tests/test_parallel.py). Code that does not shard
# runs on device 0.
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                               " --xla_force_host_platform_device_count=8").strip()


# Node ids of the tests marked `slow` (`*` matches anything; brackets are literal): the longest ones measured on a
# 2-core CPU (`pytest --durations`), 7 s to 3 min each there. Interpreted kernels (Pallas TPU interpret mode,
# Triton's interpreter), whole-model serving and the demo, hypothesis sweeps, fresh interpreters.
# test_slow_tests_name_existing_tests (test_cli.py) fails on a pattern naming a missing test.
SLOW_TESTS = (
    # layer-stacked LoRA banks against per-layer variables: two served models per case (~12-20 s)
    "tests/test_lora_bank.py::test_stacked_equals_per_layer_xla[*]",
    "tests/test_lora_bank.py::test_stacked_equals_per_layer_triton_interpreter",
    "tests/test_lora_bank.py::test_stacked_fused_path_equals_per_layer_triton_interpreter",
    # the JAX Llama's fused LoRA path: whole steps in Triton's interpreter, eagerly and under jit (~10 s)
    "tests/test_jax_fused_llama.py::test_fused_step_matches_the_unfused_step[*bfloat16*]",
    # batch invariance: one request inside many random batches, per backend (15-50 s a case)
    "tests/test_deterministic.py::test_request_rows_bitwise_equal_in_every_batch[*]",
    "tests/test_deterministic.py::test_bridged_wrappers_pass_deterministic_on[*]",
    "tests/test_moe_deterministic.py::test_request_rows_bitwise_equal_in_every_batch[jax-xla]",
    "tests/test_serving.py::test_deterministic_serving_gives_a_request_the_same_tokens_in_any_batch",
    # fp8 adapter weights: the Pallas TPU cases in interpret mode, the pair steps, the fp8 Llama (9-35 s each)
    "tests/test_fp8_jax_conformance.py::test_lora_shrink_fp8_slices_match_oracle[*pallas_tpu]",
    "tests/test_fp8_jax_conformance.py::test_lora_expand_fp8_slices_match_oracle[*pallas_tpu]",
    "tests/test_fp8_jax_conformance.py::test_fp8_with_lora_ranks_matches_oracle[*pallas_tpu]",
    "tests/test_fp8_jax_conformance.py::test_bgmv_and_sgmv_take_w_scale[*pallas_tpu]",
    "tests/test_fp8_jax_conformance.py::test_fp8_accuracy_against_16_bit_weights[*pallas_tpu]",
    "tests/test_fp8_jax_conformance.py::test_wrapper_add_lora_linear_fp8_matches_oracle[*pallas_tpu]",
    "tests/test_fp8_jax_conformance.py::test_wrapper_shrink_expand_and_embedding_take_scales[*pallas_tpu]",
    "tests/test_fp8_jax_conformance.py::test_wrapper_several_adapters_per_token_fp8[*]",
    "tests/test_fp8_jax_conformance.py::test_pallas_expand_fp8_in_place_kernels[*]",
    "tests/test_fp8_jax_serving.py::test_fp8_slot_writes_keep_one_compiled_program",
    "tests/test_fp8_jax_serving.py::test_serving_engine_with_fp8_adapters_equals_dequantised_merged_model",
    # MultiLoRAModel over torchao's int8 weight-only linears: the first case pays torchao's import (7 s)
    "tests/test_quantized_base_torch.py::test_torchao_weight_only_equals_peft_on_the_same_model[*]",
    # several adapters per token in deterministic mode, Triton's interpreter (20-100 s a case)
    "tests/test_deterministic_pairs.py::test_pairs_rows_bitwise_equal_in_every_batch[*triton*]",
    "tests/test_deterministic_pairs.py::test_a_token_keeps_its_bits_across_pair_buckets[*triton*]",
    "tests/test_deterministic_pairs.py::test_deterministic_serving_of_several_adapters_per_request",
    # the serving engine's ahead-of-time calls against its jitted calls: two engines' programs (~30 s)
    "tests/test_serving_aot.py::test_aot_calls_equal_jit_calls_and_compile_each_bucket_once",
    # the prefix cache's serving engines: compilation of each engine's programs (10-50 s each)
    "tests/test_prefix_cache.py::test_alora_request_reuses_the_base_prefix_and_equals_peft",
    "tests/test_prefix_cache.py::test_eviction_in_the_engine",
    "tests/test_prefix_cache.py::test_mixed_batch_with_reuse_equals_peft_per_request",
    "tests/test_prefix_cache.py::test_reuse_on_a_mesh",
    # the serving engine over a quantized Llama, per quantization (10-17 s each)
    "tests/test_quantized_base_jax.py::test_serving_engine_on_quantized_llama_equals_dequantized_merged_model[*]",
    # whole demos and models in a subprocess or through the interpreter
    # the docs' examples in fresh interpreters: the tensor-parallel, serving and Hugging Face ones (15-45 s each)
    "tests/test_docs_snippets.py::test_snippet_runs_as_written[docs/parallel.md:*]",
    "tests/test_docs_snippets.py::test_snippet_runs_as_written[docs/flax.md:*]",
    "tests/test_docs_snippets.py::test_snippet_runs_as_written[docs/torch.md:*]",
    "tests/test_parallel_serving.py::test_demo_with_tp_4_verifies_every_request",
    "tests/test_torch_hf.py::test_triton_kernels_match_peft",
    "tests/test_torch_hf_moe.py::test_triton_kernels_and_unwrap",
    "tests/test_torch_cli.py::test_demo_mixtral_serves_expert_lora_and_verifies",
    # the conformance suite over the Pallas TPU kernels in TPU interpret mode (10-28 s a case);
    # tests/test_pallas_tpu.py keeps its quicker cases in the quick subset
    "tests/test_conformance.py::*[*jax-pallas_tpu*]",
    "tests/test_conformance.py::test_add_shrink_then_add_expand[jax-triton-*]",
    "tests/test_conformance.py::test_metadata_update_between_calls[*]",
    "tests/test_pallas_tpu.py::test_expand_aligned_slices_in_place[*]",
    "tests/test_pallas_tpu.py::test_expand_matches_oracle[qkv-unequal-widths-*]",
    "tests/test_pallas_tpu.py::test_shrink_matches_oracle[prefill-runs-het-ranks-*]",
    "tests/test_pallas_tpu.py::test_shrink_matches_oracle[multi-tile-k-tiles-*]",
    "tests/test_pallas_tpu.py::test_shrink_matches_oracle[decode-3slices-float32]",
    "tests/test_pallas_tpu.py::test_linear_one_row_order_for_both_kernels[shuffled-unaligned]",
    # Triton's interpreter at the larger shapes
    "tests/test_triton_kernels.py::test_fused_barrier_counters_advance_by_one_span_per_launch[*]",
    "tests/test_triton_kernels.py::test_fused_sums_the_workspace_planes_in_groups[*]",
    "tests/test_triton_kernels.py::test_jax_backend_in_interpreter[*]",
    "tests/test_triton_kernels.py::test_shrink_poisoned_and_split[*]",
    "tests/test_triton_kernels.py::test_more_slices_than_one_launch_and_bad_ids",
    "tests/test_triton_kernels.py::test_expand_several_output_tiles_per_program[*]",
    "tests/test_triton_kernels.py::test_shrink_all_slices_in_one_program[*]",
    "tests/test_triton_kernels.py::test_small_batch_in_sorted_tiles[*]",
    # hypothesis sweeps
    "tests/test_properties.py::test_add_lora_linear_any_shape_and_mapping[*]",
    "tests/test_properties.py::test_host_metadata_equals_both_device_builds",
    "tests/test_properties.py::test_kernel_meta_invariants[*]",
    # whole models: the demo, serving, peft and transformers round trips, merge checks
    "tests/test_serving.py::test_demo_command_verifies_every_request",
    "tests/test_mixtral_lora.py::test_mixed_batch_greedy_tokens_equal_peft",
    "tests/test_mixtral_lora.py::test_qwen3_moe_expert_adapter_equals_peft",
    "tests/test_mixtral_lora.py::test_pallas_tpu_serving_equals_xla",
    "tests/test_fp8_experts_jax.py::test_fp8_mixtral_logits_match_the_16_bit_model",
    "tests/test_mixtral_model.py::test_qwen3_moe_logits_and_greedy_tokens_equal_transformers",
    "tests/test_mixtral_lora.py::test_demo_with_the_built_in_mixtral_verifies_every_request",
    "tests/test_cli.py::test_prompt_through_the_checkpoints_tokenizer_in_its_dtype",
    "tests/test_cli.py::test_dtype_option_and_byte_prompts_on_the_built_in_model",
    "tests/test_peft_roundtrip.py::*",
    "tests/test_alora.py::test_serving_engine_equals_peft_generate",
    "tests/test_alora.py::test_torch_forward_equals_peft_per_row[triton]",
    "tests/test_dora_peft.py::test_dora_loads_into_a_model_built_without_dora",
    "tests/test_adapters.py::test_merge_adapter_matches_the_lora_layers",
    "tests/test_adapters.py::test_prepare_places_slices_pads_ranks_and_folds_scaling",
    "tests/test_nn.py::test_linear_fused_unequal_slices_matches_oracle",
    "tests/test_nn.py::test_replace_lora_layers_swaps_targets_in_place",
    "tests/test_multi_adapter_models.py::*",
    # bridge equality sweeps and fresh interpreters
    "tests/test_bridge.py::test_torch_over_jax_equals_native_jax_bitwise[*]",
    "tests/test_bridge.py::test_every_method_and_op_equals_native_bitwise[torch-over-jax-bfloat16]",
    "tests/test_package_imports.py::test_the_jax_interpreter_path_runs_without_torch",
    "tests/test_package_imports.py::test_torch_lora_loads_nothing_of_jax[*]",
    "tests/test_benchmark_provenance.py::test_the_digest_is_printed_without_a_gpu",
    "tests/test_tune_moe_lora_smoke.py::test_quick_run_writes_a_table_the_plan_reads",
    # the fused linear tuner in fresh interpreters, and the JAX Llama's fused="auto" step (~20-40 s)
    "tests/test_tune_fused_linear_smoke.py::*",
    "tests/test_jax_fused_llama.py::test_auto_fuses_the_layers_the_tuned_table_marks",
    "tests/test_bench_moe_lora_smoke.py::test_quick_run_writes_checked_results",
    "tests/test_triton_compile.py::test_kernel_compiles_for_sm90[moe]",
    "tests/test_wrapper_torch.py::test_cache_does_not_keep_weights_alive",
)


_SLOW_RES = [re.compile(".*".join(re.escape(part) for part in pattern.split("*")) + "$") for pattern in SLOW_TESTS]


def is_slow(nodeid: str) -> bool:
    return any(regex.match(nodeid) for regex in _SLOW_RES)


def pytest_configure(config):
    # Float32 results are compared with float64 oracles and with torch/PEFT at float32 tolerances:
    # JAX's default float32 matmul precision on NVIDIA GPUs is TF32 (10-bit mantissa), so ask for
    # full float32 (the CPU computes that anyway).
    try:
        import jax
        jax.config.update("jax_default_matmul_precision", "highest")
    except ImportError:  # pragma: no cover - the torch-only install
        pass
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU (run on the device machine)")
    config.addinivalue_line("markers", "slow: one of the longest CPU tests (SLOW_TESTS); -m 'not slow' leaves them "
                                       "out, CI runs them")


@pytest.hookimpl(tryfirst=True)       # before `-m` deselects by marker
def pytest_collection_modifyitems(config, items):
    for item in items:
        if is_slow(item.nodeid):
            item.add_marker(pytest.mark.slow)
    try:
        import torch
        has_cuda = torch.cuda.is_available()
    except ImportError:  # pragma: no cover
        has_cuda = False
    if has_cuda:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
