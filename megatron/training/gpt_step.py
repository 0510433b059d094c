"""Megatron's GPT step: `forward_step` reads a microbatch and runs the model; `loss_func`
reduces the per-token losses. The schedule (1F1B-flush, PACI, ...) decides when each runs.

`pretrain_gpt.py` trains with it; the single-process engine and the delayed reference
(megatron/studies) run the same step on their stages.
"""

from functools import partial

import torch

from megatron.pipeline.vocab_parallel import HiddenForLoss


def get_batch(data_iterator, model):
    """The first stage needs tokens and positions, the last stage labels and the loss mask,
    both the attention mask where the data has one (--reset-attention-mask); stages in between
    read nothing (their input comes from the previous stage)."""
    first, last = model.pre_process, model.post_process
    device = next(model.parameters()).device
    if not (first or last):
        return None, None, None, None, None
    batch = _on_this_context_parallel_rank(next(data_iterator))
    tokens = batch["tokens"].to(device, non_blocking=True)
    position_ids = batch["position_ids"].to(device, non_blocking=True)
    labels = batch["labels"].to(device, non_blocking=True) if last else None
    loss_mask = batch["loss_mask"].to(device, non_blocking=True) if last else None
    attention_mask = batch.get("attention_mask")
    if attention_mask is not None:
        attention_mask = attention_mask.to(device, non_blocking=True)
    return tokens, position_ids, attention_mask, labels, loss_mask


def _on_this_context_parallel_rank(batch: dict) -> dict:
    """With --context-parallel-size > 1, this rank's 2 of the sequence's 2 x CP chunks
    (megatron-core's `get_batch_on_this_cp_rank`); else the batch as it is."""
    from megatron.core.utils import get_batch_on_this_cp_rank

    group = _context_parallel_group()
    return batch if group is None else get_batch_on_this_cp_rank(dict(batch), group)


def loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor, per_token: bool = False):
    """Mean per-token loss over the unmasked tokens of the microbatch. With
    --calculate-per-token-loss, Megatron's 3-tuple instead: the loss sum, the number of
    unmasked tokens, and both for reporting (the schedule divides by the step's count).

    With context parallelism each rank holds part of every sequence: the mean is over the
    whole sequences (sum and count summed over the context-parallel group), and the loss a
    rank backpropagates is its part of the sum over the whole count, times CP, since the step
    averages gradients over the context-parallel ranks too (as Megatron's). With a per-token
    loss the rank backpropagates its own sum and counts its own tokens; the step divides by
    the count summed over data x context ranks."""
    losses = output_tensor.float().view(-1)
    mask = loss_mask.view(-1).float()
    local_sum = torch.sum(losses * mask)
    totals, cp_group = torch.stack([local_sum.detach(), mask.sum()]), _context_parallel_group()
    if per_token:  # this rank's sum and count; the step sums counts over data x context ranks
        reported = totals.clone()
        if cp_group is not None:
            torch.distributed.all_reduce(reported, group=cp_group)
        return local_sum, totals[1], {"lm loss": reported}
    if cp_group is None:
        loss = local_sum / totals[1].clamp(min=1.0)
        return loss, {"lm loss": loss.detach()}
    torch.distributed.all_reduce(totals, group=cp_group)
    count = totals[1].clamp(min=1.0)
    loss = local_sum * torch.distributed.get_world_size(cp_group) / count
    return loss, {"lm loss": totals[0] / count}


def _context_parallel_group():
    from megatron.model.gpt import context_parallel_group  # after validation: megatron-core

    return context_parallel_group()


def run_model(model, tokens, position_ids, attention_mask, labels):
    """The stage's output: on the last stage the per-token losses, or with the vocabulary split
    over the ranks (--enable-vocab-parallel) its hidden state ([b, s, h]) and the labels, which
    go to every rank's output shard (the runtime hands the loss function the per-token losses
    the shards make)."""
    if model.post_process and passes_hidden_state(model):
        hidden = model(tokens, position_ids, attention_mask, labels=None)
        return HiddenForLoss(hidden, labels)
    return model(tokens, position_ids, attention_mask, labels=labels)


def passes_hidden_state(model) -> bool:
    """Whether the model's last stage hands its hidden state to the vocabulary shards instead
    of an output layer of its own (--enable-vocab-parallel)."""
    output_layer = getattr(model, "output_layer", None)
    return getattr(model, "splits_vocabulary", False) or getattr(
        output_layer, "passes_hidden_state", False
    )


def forward_step(data_iterator, model):
    tokens, position_ids, attention_mask, labels, loss_mask = get_batch(data_iterator, model)
    output_tensor = run_model(model, tokens, position_ids, attention_mask, labels)
    per_token = getattr(getattr(model, "config", None), "calculate_per_token_loss", False)
    return output_tensor, partial(loss_func, loss_mask, per_token=per_token)
