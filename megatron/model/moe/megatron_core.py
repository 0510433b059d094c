"""The two fixes megatron-core 0.16.1's MoE needs to run here, applied when an MoE model is
built (docs/moe.md):

* `moe_utils` binds its Transformer Engine helpers (`te_general_gemm`, `fused_permute`, ...)
  only when TE imports, but its router gating reads `te_general_gemm` unconditionally, so a
  router forward without TE raises NameError (on GPU too). The missing names are bound to
  None, which is how megatron-core itself spells "not available" (its code then takes the
  plain torch path).
* the all-to-all token dispatcher hands `all_to_all_single` its split sizes as tensors when
  they stay on the host (CPU); gloo accepts only lists of ints. The dispatcher's `all_to_all`
  is wrapped to pass lists (the same sizes; uneven splits work with gloo in torch 2.13).
"""

import importlib

import torch

_TE_NAMES = (
    "fused_compute_score_for_moe_aux_loss",
    "fused_moe_aux_loss",
    "fused_permute",
    "fused_permute_with_probs",
    "fused_sort_chunks_by_index",
    "fused_sort_chunks_by_index_with_probs",
    "fused_topk_with_score_function",
    "fused_unpermute",
    "te_general_gemm",
)


def _as_int_list(sizes):
    if isinstance(sizes, torch.Tensor):
        return [int(n) for n in sizes.tolist()]
    return sizes


def _all_to_all_with_int_splits(all_to_all):
    def wrapped(group, input_, output_split_sizes_=None, input_split_sizes=None):
        return all_to_all(
            group, input_, _as_int_list(output_split_sizes_), _as_int_list(input_split_sizes)
        )

    wrapped.with_int_splits = True
    return wrapped


def patch_megatron_core_moe() -> None:
    """The two fixes of the module docstring; idempotent."""
    moe_utils = importlib.import_module("megatron.core.transformer.moe.moe_utils")
    for name in _TE_NAMES:
        if not hasattr(moe_utils, name):
            setattr(moe_utils, name, None)
    dispatcher = importlib.import_module("megatron.core.transformer.moe.token_dispatcher")
    if not getattr(dispatcher.all_to_all, "with_int_splits", False):
        dispatcher.all_to_all = _all_to_all_with_int_splits(dispatcher.all_to_all)
