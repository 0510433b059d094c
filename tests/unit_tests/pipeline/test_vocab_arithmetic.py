"""The split cross-entropy (pipeline.vocab_parallel) against torch's on the whole vocabulary:
the loss, the hidden state's gradient and every shard's weight gradient, through the messages
the passes exchange."""

import pytest
import torch
import torch.nn.functional as F

from megatron.pipeline import vocab_parallel as vp


def _split_run(hidden, labels, weight, shards, mask):
    hidden = hidden.clone().requires_grad_(True)
    parts = [weight[a:b].detach().clone().requires_grad_(True)
             for a, b in vp.shard_ranges(weight.shape[0], shards)]  # fmt: skip
    output = vp.HiddenForLoss(hidden, labels)
    received_hidden, received_labels = vp.read_hidden(vp.hidden_message(output), hidden.shape[-1])
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
