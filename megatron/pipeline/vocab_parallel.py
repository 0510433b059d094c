"""The cross-entropy of an output layer split by vocabulary over the pipeline ranks.

Rank p holds rows [start_p, start_p + V_p) of the output weight W. For one microbatch of T
tokens with last hidden state h_t and target y_t, each rank scores its shard on its own
(`score_shard`, the VF pass):

    logits       l_pv = h_t . W_v                     for the shard's rows v
    statistics   m_p = max_v l_pv,  s_p = sum_v exp(l_pv - m_p),  t_p = l_py if y in shard
    gradient     A_p = sum_v exp(l_pv - m_p) W_v,  B_p = W_y if y in shard (else 0)

The last stage combines the shards (`combine_shards`; with tensor parallelism each tensor-
parallel rank its own column of shards, completed by two all-reduces over the stage's group)
into the loss and the hidden state's gradient, exactly the unsplit softmax's:

    M = max_p m_p,  S = sum_p s_p exp(m_p - M)
    loss_t = log S + M - sum_p t_p
    dloss_t / dh_t = sum_p exp(m_p - M) / S * A_p - sum_p B_p

so one message from each shard suffices (the statistics and the gradient part travel
together). Each shard's weight gradient needs M, S and the loss's gradient g_t, which the last
stage sends back after its backward (`shard_weight_gradient`, the VB pass):

    dW_v += sum_t g_t (exp(l_pv - m_p) exp(m_p - M) / S - [v = y_t]) h_t

Everything is computed in fp32 whatever the model's dtype. Messages are flat tensors in the
pipeline's dtype (the model's): the hidden state and the gradient parts A_p, B_p in it, the
labels and the statistics as fp32 values whose bits ride in it unchanged (`_carried`), so a
bf16 run sends half of an fp32 one's bytes and loses nothing the hidden state had. Labels
travel as exact fp32 integers, so vocabularies up to 2**24. The statistics sent back
(LOGIT_STATS) are small and stay fp32.

The messages travel on trees over the pipeline ranks rooted at the last stage
(`vocab_tree.VocabTree`, binary by default): the hidden state goes down (a rank forwards it to its children as it
receives it), the statistics after the backward go down the same way, and the shards' outputs
come up combined (`combine_partials`): the combine is associative (M = max, S and A rescaled
by exp(m - M) and summed, t and B summed), so a rank sends its parent one message of the same
shape for its whole subtree, and the root finishes with `combine_shards` of that one message.
With a tree of arity N - 1 every rank is the root's child: the fan of point-to-point messages.
In fp32 the tree changes only the order of the sums; in bf16 a partial's A is rounded to bf16
at every level it passes (depth ceil(log2 N) roundings where the fan had one; B sums zeros
with one row and stays exact).

Why A and B stay two tensors: the hidden state's gradient is sum_p e_p A_p / S - sum_p B_p,
and the factor 1 / S of A against B is the global S, known only at the root. A folded
C = A - c B would need c = S of the whole vocabulary; with a partial's own s the combine of
two partials leaves the cross terms e_1 s_1 B_2 + e_2 s_2 B_1, which need B again. So folding
is exact only after a second round trip (the root's M and S down, then one normalised tensor
up), which would add the tree's depth to the last stage's critical path: not done.

The input embedding split the same way (`InputShard`) needs no statistics: a token's row is
on exactly one rank, so the first stage's input is the sum of every rank's lookup (zero rows
for the tokens it does not hold), and each rank's rows take the input's gradient at their
tokens. Those messages go in the model's dtype: the sum is exact in any.
"""

import math
from dataclasses import dataclass
from typing import Callable

import torch

MAX_VOCAB = 2**24  # labels travel as fp32 integers


def shard_ranges(vocab_size: int, num_shards: int) -> list[tuple[int, int]]:
    """[start, end) of each shard: equal shares (the padded vocabulary divides evenly)."""
    if vocab_size % num_shards:
        raise ValueError(
            f"a vocabulary of {vocab_size} does not split evenly over {num_shards} ranks"
        )
    if vocab_size > MAX_VOCAB:
        raise ValueError(f"a vocabulary of {vocab_size} is over {MAX_VOCAB} entries")
    size = vocab_size // num_shards
    return [(p * size, (p + 1) * size) for p in range(num_shards)]


@dataclass(frozen=True)
class OutputShard:
    """A rank's rows [start, start + rows) of the output layer (`weight` is one of the
    rank's parameters, so its optimizer steps it)."""

    weight: torch.Tensor
    start: int
    # tensor parallelism: the stage's tensor-parallel group, whose ranks hold the columns of
    # shards the last stage combines (None: no tensor parallelism)
    group: object = None
    # tokens of a microbatch's hidden state (None: those of a boundary tensor; with sequence
    # parallelism a boundary holds 1/TP of the sequence, the gathered hidden state all of it)
    tokens: int | None = None

    @property
    def hidden_size(self) -> int:
        return self.weight.shape[1]

    def score(self, hidden: torch.Tensor, labels: torch.Tensor):
        """VF (`score_shard`); an emulated shard adds its wait here."""
        return score_shard(hidden, labels, self.weight, self.start)

    def weight_gradient(self, score: "ShardScore", stats: torch.Tensor) -> None:
        """VB (`shard_weight_gradient`)."""
        shard_weight_gradient(score, stats)


@dataclass(frozen=True)
class InputShard:
    """A rank's rows [start, start + rows) of the input embedding (with tied embeddings the
    output shard's own weight). EF looks a microbatch's tokens up in them (zero for a token
    outside), the first stage sums every rank's part into its input, and EB takes the rows'
    gradient from the first stage's backward."""

    weight: torch.Tensor
    start: int
    batch_shape: tuple[int, ...]  # the tokens of a microbatch, [b, s]
    # tensor parallelism: the first stage's tensor-parallel group, over which the columns of
    # shards (this tensor rank's rows on every pipeline rank) are summed (None: no TP)
    group: object = None
    tokens_of: Callable[[object], torch.Tensor] = lambda batch: batch["tokens"]

    @property
    def hidden_size(self) -> int:
        return self.weight.shape[1]

    @property
    def message_elements(self) -> int:
        return math.prod(self.batch_shape) * self.hidden_size

    def look_up(self, tokens: torch.Tensor) -> torch.Tensor:
        """EF: the rows of `tokens` ([b, s] -> [b, s, hidden], the graph attached)."""
        return look_up_rows(tokens, self.weight, self.start)

    def weight_gradient(self, rows: torch.Tensor, grad: torch.Tensor) -> None:
        """EB: accumulate the rows' gradient (through autograd, so gradient hooks see it)."""
        torch.autograd.backward(rows, grad_tensors=grad.view(rows.shape).to(rows.dtype))

    def combine(self, parts: list[torch.Tensor]) -> torch.Tensor:
        """The first stage's input from every rank's part: their sum (each token's row is in
        exactly one part, so any dtype sums it exactly), over the tensor-parallel group too."""
        total = torch.stack(parts).sum(dim=0).view(*self.batch_shape, self.hidden_size)
        if self.group is not None:
            torch.distributed.all_reduce(total, group=self.group)
        return total


def look_up_rows(tokens: torch.Tensor, weight: torch.Tensor, start: int) -> torch.Tensor:
    """Embedding rows [start, start + len(weight)) of `tokens`, zero for the others."""
    local = tokens.to(weight.device) - start
    outside = (local < 0) | (local >= weight.shape[0])
    rows = torch.nn.functional.embedding(local.masked_fill(outside, 0), weight)
    return rows.masked_fill(outside.unsqueeze(-1), 0.0)


@dataclass(frozen=True)
class HiddenForLoss:
    """What the last stage's forward step returns with a split vocabulary: its last hidden
    state (`[..., hidden]`, the graph attached) and the targets (`[...]`, the same leading
    shape). The loss function is then called with the per-token losses, shaped like `labels`,
    as Megatron's loss functions are."""

    hidden: torch.Tensor
    labels: torch.Tensor


# ------------------------------------------------------------------------------ messages
def carried_words(dtype: torch.dtype) -> int:
    """Elements of `dtype` that carry one fp32 value's bits (2 for bf16 and fp16)."""
    return 4 // torch.empty((), dtype=dtype).element_size()


def _carried(values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """fp32 `values` as elements of `dtype`, bit for bit (a view, no rounding)."""
    return values.float().contiguous().reshape(-1).view(dtype)


def _uncarried(words: torch.Tensor) -> torch.Tensor:
    return words.contiguous().view(torch.float32)


def hidden_message(output: HiddenForLoss, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """HIDDEN: the hidden state in `dtype` and the labels (exact fp32 integers) carried in it."""
    hidden = output.hidden.detach().to(dtype).reshape(-1)
    return torch.cat([hidden, _carried(output.labels.reshape(-1), dtype)])


def read_hidden(message: torch.Tensor, hidden_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = message.numel() // (hidden_size + carried_words(message.dtype))
    hidden = message[: tokens * hidden_size].view(tokens, hidden_size)
    return hidden, _uncarried(message[tokens * hidden_size :]).round().long()


def _split(message: torch.Tensor, tokens: int, hidden_size: int) -> list[torch.Tensor]:
    """SHARD_OUTPUT: m_p, s_p, t_p (T each, fp32 carried), A_p, B_p (T x hidden each)."""
    stats = 3 * tokens * carried_words(message.dtype)
    gradient = tokens * hidden_size
    carried, softmax_part, target_part = message.split([stats, gradient, gradient])
    return [
        *_uncarried(carried).split(tokens),
        softmax_part.float().view(tokens, hidden_size),
        target_part.float().view(tokens, hidden_size),
    ]


# ------------------------------------------------------------------------------ VF
@dataclass
class ShardScore:
    """What a shard keeps of a microbatch between its VF and its VB."""

    logits: torch.Tensor  # [T, V_p], the graph to the shard's weight
    exp_logits: torch.Tensor  # exp(l - m_p), fp32
    local_max: torch.Tensor  # m_p
    local_targets: torch.Tensor  # y - start, clamped into the shard
    in_shard: torch.Tensor  # whether y is in the shard


def score_shard(
    hidden: torch.Tensor, labels: torch.Tensor, weight: torch.Tensor, start: int
) -> tuple[ShardScore, torch.Tensor]:
    """VF: the shard's logits of `hidden` ([T, hidden]) and its SHARD_OUTPUT message, in the
    hidden state's dtype."""
    logits = hidden.to(weight.dtype) @ weight.t()
    with torch.no_grad():
        values, w = logits.float(), weight.float()
        local_max = values.max(dim=1).values
        exp_logits = torch.exp(values - local_max[:, None])
        local_ids = labels - start
        in_shard = (local_ids >= 0) & (local_ids < weight.shape[0])
        local_targets = local_ids.clamp(0, weight.shape[0] - 1)
        target_logit = values.gather(1, local_targets[:, None])[:, 0] * in_shard
        softmax_part = exp_logits @ w
        target_part = w[local_targets] * in_shard[:, None]
        stats = torch.cat([local_max, exp_logits.sum(dim=1), target_logit])
        dtype = hidden.dtype
        message = torch.cat([_carried(stats, dtype), softmax_part.to(dtype).reshape(-1),
                             target_part.to(dtype).reshape(-1)])  # fmt: skip
    score = ShardScore(logits, exp_logits, local_max, local_targets, in_shard)
    return score, message


# ------------------------------------------------------------------------------ the loss
@dataclass
class Combined:
    """The shards combined at the last stage, for one microbatch."""

    per_token_loss: torch.Tensor  # [T], fp32
    direction: torch.Tensor  # dloss_t / dh_t, [T, hidden], fp32
    global_max: torch.Tensor  # M
    global_sum: torch.Tensor  # S


def combine_shards(messages: list[torch.Tensor], hidden_size: int, group=None) -> Combined:
    """The shards' messages combined. With tensor parallelism (`group`: the last stage's
    tensor-parallel group) each rank of the group holds the messages of its own column of
    shards; two all-reduces over the group (the max, then the rescaled sums) complete them."""
    tokens = messages[0].numel() // (3 * carried_words(messages[0].dtype) + 2 * hidden_size)
    parts = [_split(message, tokens, hidden_size) for message in messages]
    local_max = torch.stack([p[0] for p in parts])  # [shards, T]
    global_max = local_max.max(dim=0).values
    if group is not None:
        torch.distributed.all_reduce(global_max, torch.distributed.ReduceOp.MAX, group=group)
    scale = torch.exp(local_max - global_max)  # each shard's statistics brought to M
    sums = torch.cat([
        (torch.stack([p[1] for p in parts]) * scale).sum(dim=0),  # S
        torch.stack([p[2] for p in parts]).sum(dim=0),  # the target's logit
        sum(w[:, None] * p[3] for w, p in zip(scale, parts)).reshape(-1),  # S x softmax . W
        sum(p[4] for p in parts).reshape(-1),  # the target's row of W
    ])  # fmt: skip
    if group is not None:
        torch.distributed.all_reduce(sums, group=group)
    global_sum, target_logit, softmax_part, target_part = sums.split(
        [tokens, tokens, tokens * hidden_size, tokens * hidden_size]
    )
    loss = torch.log(global_sum) + global_max - target_logit
    direction = softmax_part.view(tokens, hidden_size) / global_sum[:, None]
    direction = direction - target_part.view(tokens, hidden_size)
    return Combined(loss, direction, global_max, global_sum)


def combine_partials(messages: list[torch.Tensor], hidden_size: int) -> torch.Tensor:
    """SHARD_OUTPUT messages (shards' or partials') combined into one of the same shape and
    dtype, as if one shard held all their rows: `combine_shards` of the result equals
    `combine_shards` of `messages` (up to the order of the sums)."""
    if len(messages) == 1:
        return messages[0]
    dtype = messages[0].dtype
    tokens = messages[0].numel() // (3 * carried_words(dtype) + 2 * hidden_size)
    parts = [_split(message, tokens, hidden_size) for message in messages]
    local_max = torch.stack([p[0] for p in parts])  # [inputs, T]
    global_max = local_max.max(dim=0).values
    scale = torch.exp(local_max - global_max)
    stats = torch.cat([
        global_max,
        (torch.stack([p[1] for p in parts]) * scale).sum(dim=0),
        torch.stack([p[2] for p in parts]).sum(dim=0),
    ])  # fmt: skip
    softmax_part = sum(w[:, None] * p[3] for w, p in zip(scale, parts))
    target_part = sum(p[4] for p in parts)
    return torch.cat([_carried(stats, dtype), softmax_part.to(dtype).reshape(-1),
                      target_part.to(dtype).reshape(-1)])  # fmt: skip


class _ShardedCrossEntropy(torch.autograd.Function):
    """The per-token losses as a function of the hidden state, with the gradient the shards
    computed; the loss's gradient g_t is kept for the shards' weight gradients."""

    @staticmethod
    def forward(ctx, hidden, combined: Combined, loss_gradient: list):
        ctx.combined, ctx.loss_gradient = combined, loss_gradient
        return combined.per_token_loss.clone()

    @staticmethod
    def backward(ctx, grad):
        ctx.loss_gradient.append(grad.detach().float())
        direction = ctx.combined.direction * grad.float()[:, None]
        return direction, None, None


def per_token_loss(output: HiddenForLoss, combined: Combined, loss_gradient: list):
    """The per-token losses shaped like the labels, differentiable in the hidden state; its
    backward appends the loss's gradient (fp32, [T]) to `loss_gradient`."""
    hidden = output.hidden.reshape(-1, output.hidden.shape[-1])
    losses = _ShardedCrossEntropy.apply(hidden, combined, loss_gradient)
    return losses.view(output.labels.shape)


def stats_message(combined: Combined, loss_gradient: torch.Tensor) -> torch.Tensor:
    """LOGIT_STATS: M, S and g_t (T each)."""
    return torch.cat([combined.global_max, combined.global_sum, loss_gradient.reshape(-1)])


# ------------------------------------------------------------------------------ VB
def shard_weight_gradient(score: ShardScore, message: torch.Tensor) -> None:
    """VB: accumulate the shard's weight gradient (through autograd, so gradient hooks see it)."""
    global_max, global_sum, loss_gradient = message.view(3, -1)
    share = torch.exp(score.local_max - global_max) / global_sum
    grad = score.exp_logits * share[:, None]
    rows = torch.arange(grad.shape[0])
    grad[rows, score.local_targets] -= score.in_shard.float()
    grad *= loss_gradient[:, None]
    torch.autograd.backward(score.logits, grad_tensors=grad.to(score.logits.dtype))
