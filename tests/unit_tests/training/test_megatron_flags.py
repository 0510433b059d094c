"""Megatron flag parity: every flag we accept works, is our behaviour, or says it is not
supported yet (one line); the model switches reach megatron-core's TransformerConfig."""

import os

import pytest
from small_run_flags import BASE, configured, validated

from megatron.common.errors import UserError
from megatron.training.arguments import build_parser, validate_args
from megatron.training.config import RunConfig
from megatron.training.megatron_flags import NOT_SUPPORTED, OUR_BEHAVIOUR, not_supported_message
from megatron.training.optimizer.config import LRScheduleConfig

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def error_of(extra: list[str], world_size: int = 1) -> str:
    with pytest.raises(UserError) as caught:
        validated(extra, world_size)
    return str(caught.value)


def non_default_value(flag) -> list[str]:
    """The flag set to something other than its default (what a command line would pass)."""
    if flag.type is None:
        return [flag.name]
    sample = {int: "3", float: "0.5", str: "x"}[flag.type]
    return [flag.name] + ([sample, sample] if flag.nargs in ("+", "*") else [sample])


@pytest.mark.parametrize("flag", NOT_SUPPORTED, ids=lambda f: f.name)
def test_not_supported_flag_fails_with_one_line(flag):
    assert error_of(non_default_value(flag), 1) == not_supported_message(flag.name)


@pytest.mark.parametrize("extra, message", [
    (["--fp8-format", "hybrid"],
     "--fp8-format is not supported yet (GPU-only: FP8 needs Transformer Engine on a Hopper or "
     "newer GPU)"),
    (["--cuda-graph-impl", "transformer_engine", "--cuda-graph-modules", "attn", "mlp"],
     "--cuda-graph-impl is not supported yet (GPU-only: CUDA graphs)"),
    (["--tp-comm-overlap"], "--tp-comm-overlap is not supported yet (GPU-only: Transformer "
     "Engine's userbuffers overlap of tensor-parallel comms)"),
    (["--grad-reduce-in-bf16"], "--grad-reduce-in-bf16 is not supported yet"),  # not GPU-only
])  # fmt: skip
def test_gpu_only_flags_say_so(extra, message):
    assert error_of(extra) == message


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--ckpt-format", "torch_dcp"], "--ckpt-format torch_dcp is not supported yet"),
        (["--expert-model-parallel-size", "2"], "--expert-model-parallel-size > 1 needs --num-experts"),
        (["--rerun-mode", "report_stats"], "--rerun-mode report_stats is not supported yet"),
        (["--timing-log-level", "2"], "--timing-log-level 2 is not supported yet"),
        (["--transformer-impl", "inference_optimized"],
         "--transformer-impl inference_optimized is not supported yet"),
    ],
)  # fmt: skip
def test_unsupported_values_fail_naming_the_value(extra, message):
    assert error_of(extra) == message


def test_our_behaviour_flags_are_accepted():
    extra = [flag.name for flag in OUR_BEHAVIOUR if flag.type is None]
    extra += ["--transformer-impl", "local", "--attention-backend", "flash", "--ckpt-format",
              "torch", "--context-parallel-size", "1", "--rerun-mode", "disabled",
              "--timing-log-level", "0", "--num-workers", "6", "--dist-ckpt-strictness",
              "log_all"]  # fmt: skip
    validated(extra)


def test_pretrain_gpt_prints_one_error_line_and_exits_2(capsys, monkeypatch):
    monkeypatch.setenv("RANK", "0")
    import pretrain_gpt

    assert pretrain_gpt.main(BASE + ["--full-validation"]) == 2
    assert capsys.readouterr().err == "error: --full-validation is not supported yet\n"


@pytest.mark.parametrize("schedule", ["paci", "2bw", "pipedream"])
def test_tied_embeddings_run_under_the_asynchronous_schedules(schedule):
    """Megatron's default (tied) needs no flag; only the synchronous phases are refused."""
    args = validated(["--pipeline-model-parallel-size", "2", "--pipeline-schedule", schedule], 2)
    assert not args.untie_embeddings_and_output_weights
    if schedule == "paci":
        message = error_of(["--pipeline-model-parallel-size", "2", "--pipeline-schedule",
                            "paci", "--async-sync-warmup-iters", "2"], 2)  # fmt: skip
        assert message == (
            "--async-sync-warmup-iters with tied embeddings is not supported yet "
            "(add --untie-embeddings-and-output-weights)"
        )


def test_sequence_parallel_without_tensor_parallelism_is_turned_off(capsys, monkeypatch):
    """As Megatron: a warning, and the run goes on without it (nothing to split)."""
    monkeypatch.setenv("RANK", "0")
    args = validated(["--sequence-parallel"])
    assert args.sequence_parallel is False
    assert "WARNING: Disabling sequence parallelism because tensor model parallelism is " \
        "disabled" in capsys.readouterr().out  # fmt: skip
    kept = validated(["--sequence-parallel", "--tensor-model-parallel-size", "2"], 2)
    assert kept.sequence_parallel is True  # with tensor parallelism it runs


def test_step_batch_size_schedule_parses_as_megatron_and_runs():
    """One string of threshold:batch pairs, as Megatron's str flag (quoted on a shell); the
    schedule sets the global batch, so Megatron refuses --global-batch-size with it (accepted
    here when it is the schedule's last batch, as Megatron's own 175B example passes it)."""
    schedule = "0:384 200B:768 400B:1152"
    args = build_parser().parse_args(BASE + ["--step-batch-size-schedule", schedule])
    assert args.step_batch_size_schedule == [schedule]
    assert error_of(["--step-batch-size-schedule", schedule]) == (
        "cannot specify both --step-batch-size-schedule and --global-batch-size 8: the schedule "
        "sets the global batch (its last is 1152)"
    )
    args = validated(["--step-batch-size-schedule", "0:4 200B:6 400B:8"])
    assert args.step_batch_size_schedule == [[0, 4], [6250000000, 6], [12500000000, 8]]
    assert args.global_batch_size == 8


def test_megatron_defaults():
    minimal = [
        "--num-layers",
        "2",
        "--hidden-size",
        "8",
        "--num-attention-heads",
        "2",
        "--seq-length",
        "8",
        "--micro-batch-size",
        "1",
        "--train-iters",
        "1",
        "--lr",
        "1",
    ]
    args = build_parser().parse_args(minimal)  # fmt: skip
    assert args.tokenizer_type == "GPT2BPETokenizer"
    assert not args.untie_embeddings_and_output_weights
    assert (args.log_interval, args.eval_interval, args.eval_iters) == (100, 1000, 100)
    assert args.ckpt_format == "torch_dist" and not args.auto_detect_ckpt_format


def test_swiglu_ffn_default_and_kv_channels():
    args = validated(["--swiglu", "--hidden-size", "96", "--num-attention-heads", "4"])
    assert args.ffn_hidden_size == 256  # int(4 * 96 * 2 / 3 / 64) * 64
    assert args.kv_channels == 24


def test_train_samples_set_iterations_and_sample_schedule():
    at = BASE.index("--train-iters")
    args = build_parser().parse_args(
        BASE[:at]
        + BASE[at + 2 :]
        + ["--train-samples", "40", "--lr-decay-samples", "36", "--lr-warmup-samples", "12"]
    )
    validate_args(args, world_size=1)
    assert args.train_iters == 5  # 40 samples / global batch 8
    assert schedule_lengths(args) == (1.5, 4.5)  # samples / global batch


@pytest.mark.parametrize(
    "extra, needle",
    [
        (["--train-samples", "16"], "exactly one of --train-iters and --train-samples"),
        (["--lr-decay-samples", "16"], "need --train-samples"),
        (["--group-query-attention", "--num-query-groups", "3"], "--num-query-groups"),
        (["--swiglu", "--squared-relu"], "exclude each other"),
        (["--override-opt_param-scheduler", "--use-checkpoint-opt_param-scheduler"],
         "exclude each other"),
        (["--exit-interval", "0"], "--exit-interval must be >= 1"),
        (["--cross-entropy-loss-fusion", "--cross-entropy-fusion-impl", "te"],
         "--cross-entropy-fusion-impl te is disabled"),
        (["--test-mode", "--qk-layernorm", "--normalization", "RMSNorm"],
         "--test-mode compares the q/k layernorm biases: it needs LayerNorm"),
        (["--cpu-mmap-threshold-kib", "-1"], "--cpu-mmap-threshold-kib must be >= 0"),
    ],
)  # fmt: skip
def test_inconsistent_run_and_model_flags(extra, needle):
    assert needle in error_of(extra)


def test_test_mode_refuses_a_reactive_rule_with_data_parallel_replicas():
    extra = ["--test-mode", "--qk-layernorm", "--pipeline-schedule", "paci",
             "--untie-embeddings-and-output-weights", "--paci-arrival-rule", "backward-first"]  # fmt: skip
    message = error_of(extra, world_size=2)  # one stage, two data-parallel replicas
    assert message.startswith("--test-mode with --paci-arrival-rule backward-first and data")
    validated(extra + ["--deterministic-mode"], world_size=2)  # the fixed order: same order
    validated(extra, world_size=1)


def test_model_switches_reach_transformer_config():
    import torch

    from megatron.model.build import transformer_config

    args = configured(["--normalization", "RMSNorm", "--swiglu", "--group-query-attention",
                      "--num-query-groups", "2", "--disable-bias-linear", "--qk-layernorm",
                      "--apply-layernorm-1p", "--kv-channels", "32", "--norm-epsilon", "1e-6",
                      "--attention-softmax-in-fp32", "--rotary-interleaved",
                      "--apply-residual-connection-post-layernorm",
                      "--cross-entropy-loss-fusion"])  # fmt: skip
    config = transformer_config(args, torch.device("cpu"))
    assert config.cross_entropy_loss_fusion and config.cross_entropy_fusion_impl == "native"
    assert transformer_config(configured(["--test-mode"]), torch.device("cpu")).test_mode
    assert config.normalization == "RMSNorm" and config.layernorm_epsilon == 1e-6
    assert config.gated_linear_unit and config.activation_func is torch.nn.functional.silu
    assert config.num_query_groups == 2 and config.kv_channels == 32
    assert not config.add_bias_linear and config.qk_layernorm
    assert config.layernorm_zero_centered_gamma and config.attention_softmax_in_fp32
    assert config.rotary_interleaved and config.apply_residual_connection_post_layernorm


def test_flag_coverage_of_megatron_command_lines():
    """Every stored Megatron GPT command line parses; each is either accepted or names the
    features we lack (tools/megatron_flag_coverage.py, whose report is in the docs)."""
    import json

    from megatron.studies import flag_coverage as coverage

    data_file = os.path.join(REPO, "tools", "data", "megatron_gpt_command_lines.json")
    with open(data_file) as handle:
        command_lines = coverage.decode(json.load(handle))
    assert len(command_lines) == 163
    outcomes = [coverage.classify(flags)[0] for flags in command_lines.values()]
    assert outcomes.count("parse error") == 0
    assert outcomes.count("other error") == 0
    assert outcomes.count("accepted") >= 125  # docs/megatron_flags.md
    # A Megatron user's switch to PACI: the same command lines start (tied embeddings too),
    # but for result validation, which needs an iteration to run again (rerun.py).
    paci = [coverage.classify(coverage.with_schedule(flags, "paci"))
            for flags in command_lines.values()]  # fmt: skip
    differ = [(o, p) for o, p in zip(outcomes, paci) if o != p[0]]
    assert differ and all(
        o == "accepted" and p == ("not supported yet", ["--rerun-mode validate_results with "
                                                       "--pipeline-schedule paci"])
        for o, p in differ
    )  # fmt: skip
    # at least 90% of those with virtual pipeline stages, under both schedules
    virtual = [
        o for o, f in zip(outcomes, command_lines.values()) if coverage.uses_virtual_stages(f)
    ]
    assert len(virtual) == 26 and virtual.count("accepted") >= 0.9 * 26


def _scheduler_for(extra: list[str]):
    import torch

    from megatron.training.optimizer.build import build_lr_scheduler

    args = validated(extra)
    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], lr=args.lr)
    return optimizer, build_lr_scheduler(optimizer, LRScheduleConfig.from_args(args))


@pytest.mark.parametrize(
    "flag, loaded_lr",
    [(None, None), ("--override-opt_param-scheduler", 1e-3), ("--use-checkpoint-opt_param-scheduler", 2e-3)],
)  # fmt: skip
def test_scheduler_settings_are_checked_against_the_checkpoint(flag, loaded_lr):
    """Megatron's rule: a command line whose LR schedule differs from the checkpoint's fails
    (one line) unless one of the two flags says which one wins."""
    from megatron.training.checkpointing import save_load as checkpointing

    _, saved = _scheduler_for(["--lr", "2e-3"])
    optimizer, scheduler = _scheduler_for([flag] if flag else [])
    payload = {"model": {}, "optimizer": optimizer.state_dict(),
               "opt_param_scheduler": saved.state_dict(), "rng_state": None}  # fmt: skip
    config = RunConfig.from_args(validated([flag] if flag else []))
    if flag is None:
        with pytest.raises(UserError, match="schedule differs.*--override-opt_param-scheduler"):
            checkpointing.check_schedule(payload, scheduler, config, "ckpt")
        return
    checkpointing.check_schedule(payload, scheduler, config, "ckpt")
    config = RunConfig.from_args(validated([flag, "--no-load-rng"]))
    model = torch_module()
    checkpointing.restore(payload | {"model": model.state_dict()}, model=model,
                          optimizer=optimizer, scheduler=scheduler, path="ckpt", config=config)  # fmt: skip
    assert scheduler.max_lr == loaded_lr


def torch_module():
    import torch

    return torch.nn.Linear(1, 1)


def test_checkpoint_without_optimizer_state_says_how_to_load_it():
    from megatron.training.checkpointing import save_load as checkpointing

    optimizer, scheduler = _scheduler_for([])
    with pytest.raises(UserError, match="add --no-load-optim"):
        checkpointing.restore({"model": {}}, model=torch_module(), optimizer=optimizer,
                              scheduler=scheduler, path="ckpt", config=configured([]))  # fmt: skip


def test_throughput_flops_match_the_published_gpt_formula():
    """72 B s L h^2 (1 + s/6h + V/12Lh) (Narayanan et al., 2021) for a GPT with 4h MLP and
    one key/value head per query head; --log-throughput uses Megatron's general form."""
    from megatron.training.reporting import floating_point_operations

    args = configured(["--num-layers", "12", "--hidden-size", "768", "--num-attention-heads", "12",
                       "--seq-length", "1024", "--micro-batch-size", "8",
                       "--global-batch-size", "8"], vocab_size=50304)  # fmt: skip
    b, s, layers, h, v = 8, 1024, 12, 768, 50304
    published = 72 * b * s * layers * h * h * (1 + s / (6 * h) + v / (12 * layers * h))
    assert floating_point_operations(args) == pytest.approx(published, rel=1e-12)


def schedule_lengths(args) -> tuple[float, float]:
    config = LRScheduleConfig.from_args(args)
    return config.warmup_steps, config.decay_steps


LAYOUT_RULES = [
    (["--num-layers", "8", "--account-for-embedding-in-pipeline-split"],
     "--num-layers 8 (+1 for --account-for-embedding-in-pipeline-split) is not divisible by "
     "--pipeline-model-parallel-size 4"),
    (["--num-layers", "7", "--account-for-loss-in-pipeline-split",
      "--decoder-first-pipeline-num-layers", "1"],
     "--account-for-loss-in-pipeline-split cannot be set at the same time as "
     "--decoder-first-pipeline-num-layers"),
    (["--num-layers", "6", "--pipeline-model-parallel-layout", "Et|tt|tt|tL",
      "--account-for-embedding-in-pipeline-split"],
     "--pipeline-model-parallel-layout cannot be set with other pipeline layout arguments: "
     "--account-for-embedding-in-pipeline-split"),
    (["--num-layers", "6", "--pipeline-model-parallel-layout", "Et|tt|ttL"],
     "--pipeline-model-parallel-layout 'Et|tt|ttL': the length of the layout (3 stages) must "
     "be divisible by --pipeline-model-parallel-size 4"),
    (["--num-layers", "8", "--pipeline-model-parallel-layout", "Et|tt|tt|tL"],
     "--pipeline-model-parallel-layout 'Et|tt|tt|tL': Number of decoder layers 6must match "
     "num_layers 8"),  # megatron-core's own words
    (["--num-layers", "6", "--pipeline-model-parallel-layout", "tE|tt|tt|tL"],
     "--pipeline-model-parallel-layout 'tE|tt|tt|tL': The first layer must be embedding, but "
     "got LayerType.decoder"),
]  # fmt: skip


@pytest.mark.parametrize("extra, message", LAYOUT_RULES)
def test_layout_flags_follow_megatrons_rules(extra, message):
    assert error_of(["--pipeline-model-parallel-size", "4"] + extra, 4) == message


def test_a_layout_with_more_stages_than_ranks_is_the_interleaved_pipeline():
    """Stage i of the layout is virtual stage i // PP of rank i % PP (megatron-core's table)."""
    args = validated(["--pipeline-model-parallel-size", "4", "--num-layers", "14",
                      "--pipeline-model-parallel-layout", "Et|(tt|)*6,tL"], 4)  # fmt: skip
    assert args.virtual_pipeline_model_parallel_size == 2
    assert args.chunk_layers == [[1, 2], [2, 2], [2, 2], [2, 1]]
    assert args.stage_layers == [3, 4, 4, 3]


@pytest.mark.parametrize(
    "extra, layers",
    [
        (["--num-layers", "7", "--account-for-embedding-in-pipeline-split"], [1, 2, 2, 2]),
        (["--num-layers", "7", "--account-for-loss-in-pipeline-split"], [2, 2, 2, 1]),
        (["--num-layers", "6", "--account-for-embedding-in-pipeline-split",
          "--account-for-loss-in-pipeline-split"], [1, 2, 2, 1]),
        (["--num-layers", "6", "--pipeline-model-parallel-layout", "E|(tt|)*2,ttL"], [0, 2, 2, 2]),
        (["--num-layers", "7", "--decoder-first-pipeline-num-layers", "1"], [1, 2, 2, 2]),
        (["--num-layers", "8"], [2, 2, 2, 2]),
    ],
)  # fmt: skip
def test_stage_layers_are_megatron_cores_assignment(extra, layers):
    args = validated(["--pipeline-model-parallel-size", "4"] + extra, 4)
    assert args.stage_layers == layers


def test_overlap_param_gather_with_optimizer_step_follows_megatrons_rules():
    overlap = ["--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather",
               "--overlap-param-gather-with-optimizer-step"]  # fmt: skip
    virtual = ["--pipeline-model-parallel-size", "2", "--num-virtual-stages-per-pipeline-rank",
               "2", "--num-layers", "4"]  # fmt: skip
    assert validated(overlap + virtual, 2).overlap_param_gather_with_optimizer_step
    message = (
        "--overlap-param-gather-with-optimizer-step needs --overlap-param-gather (and so "
        "--use-distributed-optimizer) and virtual pipeline stages"
    )
    assert error_of(overlap[:1] + overlap[3:] + virtual, 2) == message
    assert error_of(overlap, 1) == message


def _initialize(rank: int, port: int, found) -> None:
    from megatron.core import parallel_state

    from megatron.training.training import initialize_distributed

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1")
    for disabled in (False, True):
        initialize_distributed(configured(["--disable-gloo-process-groups"] if disabled else []))
        found[disabled] = parallel_state._DATA_PARALLEL_GROUP_GLOO is not None
        parallel_state.destroy_model_parallel()


def test_disable_gloo_process_groups_reaches_megatron_core():
    import socket

    import torch

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    found = torch.multiprocessing.Manager().dict()
    torch.multiprocessing.start_processes(_initialize, args=(port, found), nprocs=1,
                                          start_method="spawn")  # fmt: skip
    assert dict(found) == {False: True, True: False}


def test_logging_level_sets_the_root_logger(monkeypatch):
    """--logging-level N (or MEGATRON_LOGGING_LEVEL), as Megatron: the root logger's level."""
    import logging

    from small_run_flags import configured

    from megatron.training.training import set_logging_level

    root = logging.getLogger()
    monkeypatch.setattr(root, "level", root.level)  # restored after the test
    set_logging_level(configured(["--logging-level", "40"]).logging.logging_level)
    assert root.level == 40
    monkeypatch.setenv("MEGATRON_LOGGING_LEVEL", "10")
    set_logging_level(configured([]).logging.logging_level)
    assert root.level == 10
    monkeypatch.setenv("MEGATRON_LOGGING_LEVEL", "loud")
    with pytest.raises(UserError, match="MEGATRON_LOGGING_LEVEL must be an integer"):
        set_logging_level(None)


def test_fim_flags_reach_the_data_config_with_megatrons_defaults():
    """--fim-* (data/fim.py): parsed with Megatron's defaults into DataConfig, whose
    FimSettings the datasets are built with; without --fim-data there are none."""
    from megatron.training.data.fim import FimSettings

    def fim_settings(extra):
        real_data = ["--data-path", os.path.join(REPO, "data", "stdlib_text_document")]
        args = build_parser().parse_args(BASE[:-5] + real_data + ["--fim-data"] + extra)
        validate_args(args, world_size=1, check_files=False)
        return FimSettings.of_run(RunConfig.from_args(args).data)

    assert fim_settings([]) == FimSettings(rate=0.5, spm_rate=0.5, eod_token="<|endoftext|>")
    given = fim_settings(
        ["--fim-rate", "0.9", "--fim-spm-rate", "0.1", "--fim-split-sample", "<file_sep>",
         "--fim-fragment-rate", "0.3", "--fim-no-prefix", "#!", "--fim-prefix-token", "<pre>",
         "--fim-middle-token", "<mid>", "--fim-suffix-token", "<suf>", "--fim-pad-token",
         "<pad>", "--fim-eod-token", "</s>"]
    )  # fmt: skip
    assert given == FimSettings(0.9, 0.1, "<file_sep>", 0.3, "#!", "<pre>", "<mid>", "<suf>",
                                "<pad>", "</s>")  # fmt: skip
    assert FimSettings.of_run(configured([]).data) is None


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--fim-data"], "--fim-data needs --data-path: it does not take --mock-data"),
        (["--fim-data", "--fim-rate", "1.5"], "--fim-rate must be a number >= 0 and <= 1, got 1.5"),
        (["--fim-spm-rate", "-0.1"], "--fim-spm-rate must be a number >= 0 and <= 1, got -0.1"),
    ],
)
def test_fim_flag_errors_are_one_line(extra, message):
    assert error_of(extra) == message


def test_fim_split_sample_needs_a_fragment_rate(tmp_path):
    from megatron.training.validation import validate_numbers

    args = build_parser().parse_args(
        BASE[:-5] + ["--data-path", "x", "--fim-data", "--fim-split-sample", "<file_sep>"]
    )
    with pytest.raises(UserError, match="^--fim-split-sample needs --fim-fragment-rate$"):
        validate_numbers(args)


def test_defer_embedding_wgrad_compute_reaches_the_config_and_is_refused_as_in_megatron():
    """--defer-embedding-wgrad-compute / --wgrad-deferral-limit: the pipeline config's, and
    refused in one line with one stage (as megatron-core), a negative limit, vocab-parallel."""
    from small_run_flags import configured, validated

    pp2 = ["--pipeline-model-parallel-size", "2"]
    pipeline = configured(pp2 + ["--defer-embedding-wgrad-compute", "--wgrad-deferral-limit",
                                 "2", "--pipeline-schedule", "paci"], world_size=2).pipeline  # fmt: skip
    assert (pipeline.defer_embedding_wgrad_compute, pipeline.wgrad_deferral_limit) == (True, 2)
    assert not configured(pp2, world_size=2).pipeline.defer_embedding_wgrad_compute
    # megatron-core reads the limit only with the flag; its gradient-accumulation-fusion
    # requirement is its CUDA kernel's (the fusions are off here, the deferral works without)
    validated(pp2 + ["--wgrad-deferral-limit", "-1"], world_size=2)
    validated(pp2 + ["--defer-embedding-wgrad-compute", "--no-gradient-accumulation-fusion"],
              world_size=2)  # fmt: skip
    refused = [
        ([], "needs --pipeline-model-parallel-size > 1"),
        (pp2 + ["--wgrad-deferral-limit", "-1"], "--wgrad-deferral-limit must be >= 0"),
        (pp2 + ["--enable-vocab-parallel"], "with --enable-vocab-parallel is not supported yet"),
    ]
    for extra, message in refused:
        with pytest.raises(UserError, match=message):
            validated(["--defer-embedding-wgrad-compute"] + extra, world_size=2 if extra else 1)


def test_dataloader_type_cyclic_and_no_data_sharding_reach_the_data_config():
    assert configured([]).data.dataloader_type == "single"
    data = configured(["--dataloader-type", "cyclic", "--no-data-sharding"]).data
    assert (data.dataloader_type, data.data_sharding) == ("cyclic", False)
    assert configured(["--dataloader-type", "cyclic"]).data.data_sharding
    assert error_of(["--dataloader-type", "external"]) == (
        "--dataloader-type external is not supported yet"
    )


def test_eval_batch_flags_default_to_trainings_and_set_evaluations_microbatches():
    assert configured([]).training.eval_batch == (8, 2, 4)
    given = ["--eval-global-batch-size", "16", "--eval-micro-batch-size", "4"]
    assert configured(given, world_size=2).training.eval_batch == (16, 4, 2)
    refused = [
        (["--eval-global-batch-size", "6"], "--eval-global-batch-size 6 is not divisible by "
         "--eval-micro-batch-size x data-parallel size = 2 x 2"),
        (["--eval-micro-batch-size", "0"], "--eval-micro-batch-size must be >= 1, got 0"),
        (["--eval-micro-batch-size", "3", "--eval-global-batch-size", "12"],
         "--eval-micro-batch-size 3 other than a multiple of --micro-batch-size 2 is not "
         "supported yet"),
    ]  # fmt: skip
    for extra, message in refused:
        assert error_of(extra, world_size=2) == message
