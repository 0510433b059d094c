"""Multi-token prediction (DeepSeek-V3's MTP): megatron-core's `MultiTokenPredictionBlock`
under Megatron's flags, on the last pipeline stage.

Each of `--mtp-num-layers` MTP layers takes the main model's last hidden state (or the
previous MTP layer's), normalizes it and the embedding of the next token, projects the two to
one hidden state, runs one transformer layer (the decoder's last layer kind: an MoE layer in an
MoE model) and scores it with the shared output layer against the token one step further. The
k-th layer's loss, averaged over the layers and times `--mtp-loss-scaling-factor` (0.1, as
Megatron), joins the main loss through the hidden state's backward (megatron-core's
`MTPLossAutoScaler`): its gradient scale is the main loss's, set before every backward pass as
the MoE aux losses' is.

Placement, as Megatron's default: the MTP layers on the last stage (with a
`--pipeline-model-parallel-layout`, its `m` beside the loss `L`). They need the token ids
there, which the last stage reads with its labels, and the input embedding: the last stage
holds a copy of the first stage's word embeddings, which Megatron ties to them, tied or untied
output layer alike. Here that copy is the one the tied output layer uses (`model.py`): under
1F1B-flush the two copies' gradients are summed before every step, under the asynchronous
schedules the last stage's copy follows the first stage's weight point to point
(optimizer/tied_embeddings.py), so the MTP layers, the output layer and the copy step with
the last stage and its drift bound.

Logged as Megatron logs it: `mtp_1 loss`, ... (the per-layer loss before scaling, averaged over
the interval's microbatches and the data-parallel ranks).
"""

import argparse

from megatron.common.errors import UserError


def add_mtp_args(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument_group("multi-token prediction").add_argument
    add("--mtp-num-layers", type=int, default=None,
        help="multi-token prediction layers on the last stage (default: none)")  # fmt: skip
    add("--mtp-loss-scaling-factor", type=float, default=0.1,
        help="weight of the MTP loss (averaged over the MTP layers) beside the main loss")  # fmt: skip


def validate_mtp_args(args: argparse.Namespace, *, placement_v: bool) -> None:
    """Megatron's checks and what is not built yet, one line each. `placement_v`: the schedule
    places two chunks per rank in a V. A count of 0 turns MTP off, as in Megatron."""
    if args.mtp_num_layers is not None and args.mtp_num_layers < 0:
        raise UserError(f"--mtp-num-layers must be >= 0, got {args.mtp_num_layers}")
    if not args.mtp_num_layers:
        args.mtp_num_layers = None
        return
    if args.position_embedding_type not in ("rope", "none"):
        raise UserError(
            f"--mtp-num-layers is not supported with --position-embedding-type "
            f"{args.position_embedding_type} (supported: rope, none)"
        )
    unsupported = [
        (args.context_parallel_size > 1, "with --context-parallel-size > 1"),
        (placement_v, f"with --pipeline-schedule {args.pipeline_schedule}"),
        (bool(args.pipeline_model_parallel_layout)
         and not _mtp_beside_loss(args.pipeline_model_parallel_layout),
         "on a stage of --pipeline-model-parallel-layout other than the loss's (m beside L)"),
    ]  # fmt: skip
    for refused, where in unsupported:
        if refused:
            raise UserError(f"--mtp-num-layers {where} is not supported yet")


def _mtp_beside_loss(layout: str) -> bool:
    """Whether a layout string puts every `m` in the last stage, the one with `L`."""
    stages = layout.split("|")
    return all("m" not in stage for stage in stages[:-1])


def mtp_config_fields(model) -> dict:
    """The TransformerConfig fields of the run's `ModelConfig` (empty without MTP)."""
    if not model.mtp_num_layers:
        return {}
    return {
        "mtp_num_layers": model.mtp_num_layers,
        "mtp_loss_scaling_factor": model.mtp_loss_scaling_factor,
    }


def set_mtp_loss_scale(scale: float) -> None:
    """The MTP loss's gradient scale for the next backward pass: the main loss's (the runtime
    announces it before each backward pass, as for the MoE aux losses)."""
    import torch
    from megatron.core.transformer.multi_token_prediction import MTPLossAutoScaler

    MTPLossAutoScaler.set_loss_scale(torch.tensor(scale, dtype=torch.float32))


class MTPLossLog:
    """The MTP losses megatron-core records on this stage (its tracker, one entry per MTP
    layer, summed over training forwards), averaged over the interval's training forwards and
    over the stage's data-parallel ranks; empty on a stage without MTP layers."""

    def __init__(self, model):
        from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

        MTPLossLoggingHelper.tracker.clear()  # a process-wide dict: a run starts empty
        chunks = list(getattr(model, "chunks", [model]))
        blocks = [chunk.mtp for chunk in chunks if getattr(chunk, "mtp_process", False)]
        self.layers = len(blocks[0].layers) if blocks else 0
        self.forwards = 0
        self.history: list[dict] = []  # every interval's losses, in order (summary.json)
        for block in blocks:
            block.register_forward_hook(self._count)

    def _count(self, module, inputs, output) -> None:
        import torch

        if module.training and torch.is_grad_enabled():
            self.forwards += 1

    def collect(self, group=None) -> dict:
        """{'mtp_1 loss': ..., ...} over the interval; starts the next interval."""
        import torch
        import torch.distributed as dist
        from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

        tracker = MTPLossLoggingHelper.tracker
        if not self.layers or not self.forwards or "values" not in tracker:
            return {}
        # reduced where the values are (NCCL reduces device tensors only)
        values = tracker["values"].detach().double() / self.forwards
        if group is not None and dist.get_world_size(group) > 1:
            dist.all_reduce(values, group=group)
            values /= dist.get_world_size(group)
        tracker["values"].zero_()
        self.forwards = 0
        self.history.append({f"mtp_{k + 1} loss": float(v) for k, v in enumerate(values)})
        return self.history[-1]


def mtp_block_spec(
    decoder_spec, num_layers: int, *, norm: type | None = None, use_te: bool = False
):
    """The MTP block of the last stage: `num_layers` of megatron-core's MTP layer around the
    decoder's last layer spec (its MoE layer in an MoE model), with Transformer Engine's or the
    local backend's linear and norms, or `norm` for its three norms (the portable spec's own,
    where the decoder's are). megatron-core imported here: the flags stay import-light."""
    import copy

    from megatron.core.models.backends import LocalSpecProvider
    from megatron.core.transformer.multi_token_prediction import (
        MultiTokenPredictionBlockSubmodules,
        get_mtp_layer_spec_for_backend,
    )

    layer_specs = getattr(decoder_spec, "layer_specs", None)
    layer = layer_specs[-1] if layer_specs is not None else decoder_spec
    if use_te:
        from megatron.core.extensions.transformer_engine_spec_provider import TESpecProvider

        backend = TESpecProvider()
    else:
        backend = LocalSpecProvider()
    spec = copy.deepcopy(get_mtp_layer_spec_for_backend(layer, backend=backend))
    if norm is not None:
        spec.submodules.enorm = spec.submodules.hnorm = spec.submodules.layer_norm = norm
    return MultiTokenPredictionBlockSubmodules(layer_specs=[spec] * num_layers)
