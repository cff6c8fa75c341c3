import os
import re

import pytest
import torch

# The Triton kernels run under the interpreter on machines without a GPU; the flag must be set
# before any @triton.jit function is defined.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# pytest.ini's `-n auto` runs one xdist worker per core on a CPU machine: one thread each.
WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
torch.set_num_threads(max(1, min(2, (os.cpu_count() or 1) // WORKERS)))


# Workers for the quick subset on a GPU machine: its models are tiny, and most of its time is the
# first tests' kernel and graph compiles, which run on the host (PERF_NOTES.md, run DV).
QUICK_GPU_WORKERS = 4


def pytest_xdist_auto_num_workers(config):
    """Workers for `-n auto`: one per core on a CPU machine, where the suite is mostly single-threaded
    (the Triton interpreter, subprocesses). On a GPU machine none for the whole suite, whose
    full-width models run each other out of the one GPU's memory (PERF_NOTES.md, run DS), and a few
    for the quick subset (`-m "not slow"`)."""
    if not torch.cuda.is_available():
        return max(1, os.cpu_count() or 1)
    quick = re.search(r"\bnot\s+slow\b", config.getoption("markexpr") or "")
    return min(QUICK_GPU_WORKERS, os.cpu_count() or 1) if quick else 0


# What `pytest -m "not slow"` leaves out, for a quick run of the rest in a few minutes (CI runs all):
# subprocess runs of the launch script and the tools, multi-process gloo runs, the Triton compile
# check, the largest kernel sweeps under the interpreter, and on a GPU the modules that compile every
# kernel variant or build full-width layers. One list, so that the subset is chosen in one place.
SLOW_MODULES = {
    "test_examples.py", "test_parallel.py", "test_export_hf_weights.py", "test_check_triton_compile.py",
    "test_dualkv_attn_sm90.py", "test_dualkv_attn_gpu.py", "test_recompute_gpu.py", "test_memory_gpu.py",
    "test_transformer_engine_gpu.py",
}
SLOW_TESTS = {
    "test_kernels_match_reference", "test_triton_within_the_flash_bound", "test_tma_loads", "test_many_groups_with_p1_and_r1_and_split_key_tiles",
    "test_key_items_follow_the_window", "test_gradients_are_bitwise_reproducible",
    "test_tensor_parallel_matches_one_rank", "test_expert_parallel_packed_equals_replicated",
    "test_planned_micro_batches_reproduce_the_whole_batch", "test_importing_the_package_maps_nothing",
    "test_a_module_that_imports_megatron_is_caught", "test_modules_without_megatron_import_none_of_it",
    "test_the_launch_script_trains_the_tiny_card", "test_the_launch_script_fits_a_gated_delta_net_model",
}
# On a GPU, also the model tests that compile the most kernels and torch.compile graphs (FlexAttention
# for Gemma's replicated windows, Gemma's and the tree kernels' variants): each over 10 s on the H200
# (PERF_NOTES.md, run DU), under a second on a CPU.
SLOW_ON_GPU_TESTS = {
    "test_gemma.py::test_packed_equals_replicated", "test_convert_checkpoint.py::test_loaded_model_matches_hugging_face",
    "test_rl_trees.py::test_losses_and_gradients_on_trees_are_those_of_each_trajectory_alone",
    "test_interop.py::test_the_verl_style_actor_of_the_docs_learns_the_advantages",
}

# Modules of the kernels, layouts and packing, which use no Megatron-Core, marked `without_megatron`:
# .ci/run's second pass, which puts another Megatron-Core in front, leaves them out (a third of the
# suite's time). tests/test_suite_markers.py checks that importing them imports no Megatron.
WITHOUT_MEGATRON_MODULES = {
    "test_ab_native.py", "test_causal_conv1d.py", "test_causal_conv1d_gpu.py", "test_check_triton_compile.py",
    "test_chunk_state_scan.py",
    "test_depth1_tables.py",
    "test_dualkv_attn.py", "test_dualkv_prefix_attn.py",
    "test_dualkv_attn_gpu.py", "test_dualkv_attn_sm90.py", "test_fa4_chains.py", "test_gated_delta_rule.py",
    "test_gated_delta_rule_gpu.py",
    "test_geglu.py", "test_layout.py",
    "test_packing.py",
    "test_reference.py", "test_rms_norm.py", "test_rms_norm_rope.py", "test_row_gather_sum.py", "test_tool_args.py",
    "test_trajectories.py",
}


def pytest_collection_modifyitems(items):
    slow_on_gpu = SLOW_ON_GPU_TESTS if torch.cuda.is_available() else set()
    for item in items:
        name = getattr(item, "originalname", item.name)
        if item.path.name in SLOW_MODULES or name in SLOW_TESTS or f"{item.path.name}::{name}" in slow_on_gpu:
            item.add_marker(pytest.mark.slow)
        if item.path.name in WITHOUT_MEGATRON_MODULES:
            item.add_marker(pytest.mark.without_megatron)


@pytest.fixture
def fresh_offload(monkeypatch):
    """A process offload of its own for one GPU test (``mcore.offload.layer_offload``), with page-locked
    slabs; imported here, not at the top, so that modules without Megatron stay without it."""
    from megatron_dualkv.mcore import offload
    from megatron_dualkv.mcore.offload import LayerOffload
    from megatron_dualkv.rl.host_stash import HostStash

    fresh = LayerOffload(HostStash(pin=True, slab_bytes=1 << 26))
    monkeypatch.setattr(offload, "layer_offload", lambda: fresh)
    return fresh
