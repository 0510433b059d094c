"""Mixture of experts: megatron-core's MoE layer (router, token dispatchers, experts) as
Megatron's flags configure it, the fixes megatron-core 0.16.1 needs to run it here, and its
place in the training loop (docs/moe.md).

* `flags`: the MoE and expert-parallel flags, their one-line checks, their TransformerConfig
  fields;
* `megatron_core`: the two fixes applied at model build (Transformer Engine names, integer
  all-to-all split sizes);
* `training_hooks`: the aux-loss scale, the per-step expert-bias update and counter reset,
  the routing buffers a weight stash keeps, each stage's aux losses and load statistics.
"""

from megatron.model.moe.flags import (
    add_moe_args,
    add_moe_unsupported_args,
    moe_config_fields,
    moe_layer_pattern,
    parse_moe_layer_freq,
    validate_moe_args,
)
from megatron.model.moe.megatron_core import _all_to_all_with_int_splits, patch_megatron_core_moe
from megatron.model.moe.training_hooks import (
    MoELoadStats,
    MoEStepHooks,
    experts_apart_from_dense,
    routing_buffers,
    set_aux_loss_scale,
)

__all__ = [
    "add_moe_args",
    "add_moe_unsupported_args",
    "moe_config_fields",
    "moe_layer_pattern",
    "parse_moe_layer_freq",
    "validate_moe_args",
    "patch_megatron_core_moe",
    "MoELoadStats",
    "MoEStepHooks",
    "experts_apart_from_dense",
    "routing_buffers",
    "set_aux_loss_scale",
]
