import socket
import sys

import pytest

# The unit tests that take longest (5 s or more each, measured with --durations on the 2-core
# machine): `make test-quick` leaves them out (-m "not slow"), `make test` runs them.
SLOW = (
    "data/test_preprocess_data.py::test_end_to_end_with_workers",
    "data/test_preprocess_data.py::test_cli_write_failure_exit_code_and_no_traceback",
    "data/test_preprocess_data.py::test_cli_error_is_one_line",
    "test_calibration.py::test_calibrate_stage_cli_on_cpu",
    "test_calibration.py::test_gpu_check_without_cuda_says_so_and_runs_nothing",
    "test_replicate_report.py::test_report_figures_and_tables",
    "test_package_layout.py::test_pretrain_gpt_imports_no_study",
    "test_package_layout.py::test_no_import_circle",
    "test_docs.py::test_every_command_of_the_readme_and_the_guides",
    "test_shaped_link.py::test_measured_rate_at_200mbit",
    "test_checkpoint_checks.py::",
    "training/test_cp_comm_types.py::",
    "training/test_ring_attention.py::",
    "training/test_layer_wise_muon.py::test_layer_wise_muon_equals_the_replicated_one_over_two",
    "training/test_megatron_flags.py::test_flag_coverage_of_megatron_command_lines",
    "training/test_megatron_flags.py::test_disable_gloo_process_groups_reaches_megatron_core",
    "training/test_muon.py::test_duplicated_tp_mode_at_tp2_equals_tp1_and_blockwise_does_not",
    "training/test_precision.py::test_distributed_optimizer_equals_the_unsharded_one_over_two",
    "training/test_param_gather.py::",
    "training/test_delayed_reference.py::",
    "training/test_wandb_logging.py::test_scalars_reach_the_offline_run_as_in_tensorboard",
    "training/test_moe.py::test_flag_coverage_of_megatron_moe_command_lines",
    "training/test_time_to_accuracy.py::test_the_small_models_data_missing_is_one_line",
    "pipeline/test_vocab_passes.py::test_paci_reaches_the_physical_limit_on_gpt2_medium",
    "pipeline/test_vocab_passes.py::test_the_flushes_gain_from_the_split",
    "pipeline/test_vocab_passes.py::test_the_asynchronous_schedules_reach_the_limit_with_the",
    "pipeline/test_paci_interleaved.py::",
    "pipeline/test_comparison.py::test_the_vocabulary_split_lifts_the_whole_layer_cap",
    "pipeline/test_comparison.py::test_schedules_outside_their_rules_are_marked_not_defined",
    "pipeline/test_runtime_comparison.py::test_steady_pace_of_a_simulated_run_is_the_projected",
    "pipeline/test_accumulation_phases.py::test_a_change_costs_one_drain",
)


def pytest_collection_modifyitems(config, items):
    for item in items:
        relative = item.nodeid.split("tests/unit_tests/", 1)[-1]
        if relative.startswith(SLOW):
            item.add_marker(pytest.mark.slow)


@pytest.fixture(scope="module", autouse=True)
def no_process_group_left():
    """Every test module starts without a torch.distributed group: an in-process run
    (delayed_reference.py's) leaves its world of one up, and which modules share a pytest
    process depends on how pytest-xdist deals the files."""
    yield
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_initialized():
        from megatron.core import parallel_state

        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def one_rank_group():
    """A one-process gloo group with megatron-core's parallel state (TP = PP = 1), for tests
    that build model pieces in process."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    if dist.is_initialized():  # left by an earlier in-process run (delayed_reference.py)
        assert dist.get_world_size() == 1
        if not parallel_state.model_parallel_is_initialized():
            parallel_state.initialize_model_parallel(1, 1)
        yield
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    parallel_state.initialize_model_parallel(1, 1)
    yield
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()
