"""A forward_step whose loss mask differs from microbatch to microbatch (for the per-token loss
cases): pretrain_gpt's, keeping only the labels with `id % 8 < 1 + (id // 8) % 8`, so each
token id counts or not, and microbatches count different numbers of tokens. The mask depends
on each token alone, so every layout of a run masks the same tokens (context parallelism's
chunks included)."""

from functools import partial

from megatron.training.gpt_step import run_model
from pretrain_gpt import get_batch, loss_func


def forward_step(data_iterator, model):
    tokens, position_ids, attention_mask, labels, loss_mask = get_batch(data_iterator, model)
    output_tensor = run_model(model, tokens, position_ids, attention_mask, labels)
    if loss_mask is not None:
        threshold = 1 + (labels // 8) % 8
        loss_mask = loss_mask * (labels % 8 < threshold).to(loss_mask.dtype)
    per_token = getattr(getattr(model, "config", None), "calculate_per_token_loss", False)
    return output_tensor, partial(loss_func, loss_mask, per_token=per_token)
