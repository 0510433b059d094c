"""The split cross-entropy (pipeline.vocab_parallel) against torch's on the whole vocabulary:
the loss, the hidden state's gradient and every shard's weight gradient, through the messages
the passes exchange."""

import pytest
import torch
import torch.nn.functional as F

from megatron.pipeline import vocab_parallel as vp


def _split_run(hidden, labels, weight, shards, mask, dtype=torch.float32):
    hidden = hidden.clone().requires_grad_(True)
    parts = [weight[a:b].detach().clone().requires_grad_(True)
             for a, b in vp.shard_ranges(weight.shape[0], shards)]  # fmt: skip
    output = vp.HiddenForLoss(hidden, labels)
    message = vp.hidden_message(output, dtype)
    assert message.dtype == dtype
    received_hidden, received_labels = vp.read_hidden(message, hidden.shape[-1])
    starts = [a for a, _ in vp.shard_ranges(weight.shape[0], shards)]
    scores = [vp.score_shard(received_hidden, received_labels, w, a)
              for w, a in zip(parts, starts)]  # fmt: skip
    combined = vp.combine_shards([message for _, message in scores], hidden.shape[-1])
    sink = []
    losses = vp.per_token_loss(output, combined, sink)
    loss = (losses * mask).sum() / mask.sum()
    loss.backward()
    stats = vp.stats_message(combined, sink[0])
    for score, _ in scores:
        vp.shard_weight_gradient(score, stats)
    return losses.detach(), loss.detach(), hidden.grad, torch.cat([w.grad for w in parts])


@pytest.mark.parametrize("shards", [1, 2, 4, 8])
def test_split_equals_the_whole_vocabulary(shards):
    torch.manual_seed(shards)
    tokens, hidden_size, vocab = 24, 16, 64
    hidden = torch.randn(2, tokens // 2, hidden_size) * 3
    weight = torch.randn(vocab, hidden_size)
    labels = torch.randint(0, vocab, (2, tokens // 2))
    mask = (torch.rand(2, tokens // 2) > 0.3).float()
    losses, loss, hidden_grad, weight_grad = _split_run(hidden, labels, weight, shards, mask)

    h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    reference = F.cross_entropy((h @ w.t()).view(-1, vocab), labels.view(-1), reduction="none")
    ref_loss = (reference.view(2, -1) * mask).sum() / mask.sum()
    ref_loss.backward()
    torch.testing.assert_close(losses, reference.detach().view(2, -1), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(loss, ref_loss.detach(), atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(hidden_grad, h.grad, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(weight_grad, w.grad, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_messages_in_the_models_dtype(dtype):
    """A bf16 (fp16) run's messages: half an fp32 one's elements' bytes, the labels and the
    statistics carried bit for bit, the result as the whole vocabulary's on the same rounded
    hidden state within the dtype's rounding of the gradient parts."""
    torch.manual_seed(3)
    tokens, hidden_size, vocab = 24, 16, 4096  # labels beyond bf16's exact integers (256)
    hidden = (torch.randn(2, tokens // 2, hidden_size) * 0.3).to(dtype).float()
    weight = torch.randn(vocab, hidden_size) * 0.3
    labels = torch.randint(0, vocab, (2, tokens // 2))
    output = vp.HiddenForLoss(hidden, labels)
    message = vp.hidden_message(output, dtype)
    assert message.numel() == tokens * (hidden_size + 2)
    _, received = vp.read_hidden(message, hidden_size)
    assert torch.equal(received, labels.view(-1))
    mask = torch.ones(2, tokens // 2)
    fp32 = _split_run(hidden, labels, weight, 4, mask)
    low = _split_run(hidden, labels, weight, 4, mask, dtype)
    torch.testing.assert_close(low[0], fp32[0], atol=1e-4, rtol=1e-4)  # the statistics: exact
    torch.testing.assert_close(low[2], fp32[2], atol=2e-3, rtol=2e-2)  # A_p, B_p rounded
    torch.testing.assert_close(low[3], fp32[3], atol=1e-6, rtol=1e-4)


def test_large_logits_do_not_overflow():
    hidden = torch.full((1, 4, 8), 100.0)
    weight = torch.randn(32, 8)
    labels = torch.tensor([[0, 5, 17, 31]])
    losses, *_ = _split_run(hidden, labels, weight, 4, torch.ones(1, 4))
    assert torch.isfinite(losses).all()


def test_bad_splits_are_refused():
    with pytest.raises(ValueError, match="does not split evenly over 3 ranks"):
        vp.shard_ranges(64, 3)
    with pytest.raises(ValueError, match="is over 16777216 entries"):
        vp.shard_ranges(2**25, 2)
