"""The command line, with Megatron's flag names: `build_parser` assembles the flag groups, each
defined beside the code that reads it (model/flags.py and the model's feature modules,
distributed/context_parallel/flags.py, training/layout_flags.py, loop_flags.py,
pipeline_flags.py, optimizer/flags.py, checkpointing/flags.py, data/sources.py, ...), and
`validate_args` runs their checks in one order, so that a command line with several mistakes
is refused for the same first one, with the few checks that cross sections.

Validation runs before anything heavy (process groups, model, data) and raises `UserError`
with one line naming the problem.
"""

import argparse
import os

from megatron.common.errors import UserError
from megatron.distributed.data_parallel import add_data_parallel_args
from megatron.distributed.fsdp_flags import add_fsdp_args, validate_fsdp_args
from megatron.model.dsa import add_dsa_args, validate_dsa_args
from megatron.model.flags import add_model_args, validate_model_args, validate_test_mode
from megatron.model.gated_delta_net import (
    add_gated_delta_net_args,
    validate_gated_delta_net_args,
)
from megatron.model.mla import add_mla_args, validate_mla_and_yarn_args
from megatron.model.moe import (
    add_moe_args,
    add_moe_unsupported_args,
    moe_config_fields,
    validate_moe_args,
)
from megatron.model.mtp import add_mtp_args, validate_mtp_args
from megatron.model.mup import add_mup_args, validate_mup_args
from megatron.model.recompute import add_recompute_args, validate_recompute_args
from megatron.pipeline.schedules import get_schedule
from megatron.training.batch_schedule import validate_accumulation_schedule
from megatron.training.checkpointing.flags import add_checkpoint_args, validate_checkpoint_args
from megatron.training.config import MoEConfig, ParallelConfig, pipeline_plan
from megatron.training.data.sources import (
    add_data_args,
    add_data_source_args,
    validate_data_args,
    validate_sample_options,
)
from megatron.training.layout_flags import add_parallel_args, validate_parallel_layout
from megatron.training.loop_flags import (
    add_logging_args,
    add_training_args,
    replicas_order_on_their_own,
    validate_batch_and_run_length,
    validate_weight_hash_check,
)
from megatron.training.megatron_flags import add_compatibility_flags, reject_unsupported_flags
from megatron.training.optimizer.flags import (
    add_optimizer_args,
    add_optimizer_suite_args,
    add_precision_args,
    validate_lr_schedule_source,
    validate_optimizer_suite_args,
    validate_precision_args,
)
from megatron.training.pipeline_flags import (
    add_benchmark_args,
    add_paci_args,
    validate_defer_embedding_wgrad,
    validate_deferred_step,
    validate_emulated_stages,
    validate_weight_stashing,
)
from megatron.training.rerun import add_rerun_args, validate_rerun_args
from megatron.training.tracking.wandb_run import add_wandb_args, validate_wandb_args
from megatron.training.validation import add_reliability_args, validate_reliability


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description="GPT pretraining on megatron-core with synchronous and asynchronous "
        "pipeline schedules",
        allow_abbrev=False,
    )
    for add_group in (add_model_args, add_parallel_args, add_training_args,
                      add_optimizer_args, add_data_args, add_logging_args,
                      add_checkpoint_args, add_paci_args, add_benchmark_args):  # fmt: skip
        add_group(parser)
    add_optimizer_suite_args(parser)
    add_precision_args(parser)
    add_data_parallel_args(parser)
    add_fsdp_args(parser)
    add_data_source_args(parser)
    add_wandb_args(parser)
    add_recompute_args(parser)
    add_reliability_args(parser)
    add_rerun_args(parser)
    add_mla_args(parser)
    add_gated_delta_net_args(parser)
    add_dsa_args(parser)
    add_mtp_args(parser)
    add_mup_args(parser)
    add_moe_args(parser)
    add_moe_unsupported_args(parser)
    add_compatibility_flags(parser)
    return parser


def parse_args(argv=None) -> argparse.Namespace:
    args = build_parser().parse_args(argv)
    validate_args(args, world_size=int(os.environ.get("WORLD_SIZE", "1")))
    return args


def _validate_moe_with_megatron_core(args) -> None:
    """megatron-core's own rules on the MoE settings (TransformerConfig's checks: top-1
    softmax routing needs pre-softmax, expert bias needs sigmoid scores, padding needs a
    capacity factor, bias with expert tensor parallelism, ...), each as one line. Run here,
    after the MoE section's own checks: it builds the run's typed sections, which the model
    package does not import."""
    import warnings

    import torch
    from megatron.core.transformer.transformer_config import TransformerConfig

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            TransformerConfig(
                num_layers=args.num_layers,
                hidden_size=args.hidden_size,
                num_attention_heads=args.num_attention_heads,
                ffn_hidden_size=args.ffn_hidden_size or 4 * args.hidden_size,
                add_bias_linear=not args.disable_bias_linear,
                tensor_model_parallel_size=args.tensor_model_parallel_size,
                pipeline_dtype=torch.float32,
                **moe_config_fields(MoEConfig.from_flags(args), ParallelConfig.from_flags(args)),
            )
    except (AssertionError, ValueError) as error:
        detail = " ".join(str(error).split()) or type(error).__name__
        raise UserError(f"MoE settings: {detail}") from None


def validate_args(args: argparse.Namespace, *, world_size: int, check_files: bool = True) -> None:
    """Fill defaults that depend on other flags and reject inconsistent ones.

    `check_files=False` skips the checks that read the data files (for measuring which command
    lines parse, see tools/megatron_flag_coverage.py)."""
    reject_unsupported_flags(args)
    validate_wandb_args(args)
    validate_reliability(args)
    validate_parallel_layout(args, world_size)
    validate_moe_args(args, world_size=world_size)
    if args.num_experts is not None:
        _validate_moe_with_megatron_core(args)
    validate_model_args(args)
    validate_weight_hash_check(args)
    validate_test_mode(args, replicas_order_on_their_own=replicas_order_on_their_own(args))
    validate_mla_and_yarn_args(args)
    validate_gated_delta_net_args(args)
    validate_dsa_args(args)
    validate_mtp_args(args, placement_v=get_schedule(args.pipeline_schedule).placement is not None)
    validate_recompute_args(args, args.stage_layers)
    validate_mup_args(args)
    validate_rerun_args(args, synchronous=get_schedule(args.pipeline_schedule).flushes_every_call)
    validate_batch_and_run_length(args)
    validate_data_args(args, check_files=check_files)
    validate_emulated_stages(args)
    validate_checkpoint_args(args)
    validate_defer_embedding_wgrad(args)
    if args.emulated_forward_ms is not None and (args.save or args.load):
        if args.ckpt_format == "torch_dist":  # its keys come from megatron-core's model
            raise UserError("emulated stages have no megatron-core model: checkpoint them with "
                            "--ckpt-format torch")  # fmt: skip
    validate_sample_options(args)
    # before the optimizer's: Megatron-FSDP turns the distributed one on
    validate_fsdp_args(args, replicas_order_on_their_own=replicas_order_on_their_own(args))
    validate_optimizer_suite_args(args)
    validate_weight_stashing(args)
    validate_deferred_step(args)
    validate_precision_args(args)
    validate_accumulation_schedule(args)
    validate_lr_schedule_source(args)
    pipeline_plan(args)  # a combination no schedule defines fails here, in one line
