"""DeepSeek sparse attention (`--experimental-attention-variant dsa`, DeepSeek-V3.2's), with
multi-latent attention: megatron-core's DSAttention as MLA's core attention on the portable
layer spec, so it runs on CPU too.

Each layer's lightning indexer scores every key for every query (ReLU'd dot products of its
own small queries and keys, weighted per indexer head) and the layer attends to the top
`--dsa-indexer-topk` keys only. The indexer learns from a KL loss towards the layer's true
attention distribution (`--dsa-indexer-loss-coeff`), on detached inputs, so it never changes
the main model's gradients; the loss's gradient is scaled as each backward's main loss
(`set_indexer_loss_scale`, 1/m under 1F1B-flush, 1/a under PACI), as megatron-core's
schedules scale it.

What megatron-core 0.16.1 leaves to the caller, done here: its Hadamard rotation of the
indexer's queries and keys needs the CUDA `fast_hadamard_transform` (`hadamard_rotation` is
the same transform in torch); the indexer's linears are Transformer Engine's `TELinear` in
its spec (`DuplicatedLinear` here: every tensor-parallel rank holds the whole weight and
computes the same gradient); its loss tracker allocates on the CUDA device (`IndexerLossLog`
keeps it where the model is, and logs `indexer loss` per stage, over the stage's
data-parallel ranks, as the MTP loss).
"""

import argparse

import torch

from megatron.common.errors import UserError

DSA_VARIANT = "dsa"
DSA_FIELDS = ("dsa_indexer_n_heads", "dsa_indexer_head_dim", "dsa_indexer_topk",
              "dsa_indexer_loss_coeff", "dsa_indexer_use_sparse_loss")  # fmt: skip


def add_dsa_args(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument_group("DeepSeek sparse attention (dsa.py)").add_argument
    add("--dsa-indexer-n-heads", type=int, default=None, help="the indexer's heads")
    add("--dsa-indexer-head-dim", type=int, default=None,
        help="the indexer's head dim (a power of two: the Hadamard rotation)")  # fmt: skip
    add("--dsa-indexer-topk", type=int, default=None, help="keys each query attends to")
    add(
        "--dsa-indexer-loss-coeff",
        type=float,
        default=None,
        help="the indexer's KL loss coefficient (0 or unset: the indexer does not learn)",
    )
    add("--dsa-indexer-use-sparse-loss", action="store_true",
        help="the KL loss over the top-k keys only")  # fmt: skip


def validate_dsa_args(args: argparse.Namespace) -> None:
    """megatron-core's asserts, one line each."""
    if args.experimental_attention_variant != DSA_VARIANT:
        return
    if not args.multi_latent_attention:
        raise UserError("--experimental-attention-variant dsa needs --multi-latent-attention "
                        "(megatron-core's sparse attention is MLA's)")  # fmt: skip
    for name in ("n_heads", "head_dim", "topk"):
        value = getattr(args, f"dsa_indexer_{name}")
        if value is None or value < 1:
            raise UserError(f"--experimental-attention-variant dsa needs "
                            f"--dsa-indexer-{name.replace('_', '-')} >= 1")  # fmt: skip
    head_dim = args.dsa_indexer_head_dim
    if head_dim & (head_dim - 1):
        raise UserError(f"--dsa-indexer-head-dim must be a power of two (the Hadamard "
                        f"rotation), got {head_dim}")  # fmt: skip
    if head_dim <= args.qk_pos_emb_head_dim:
        raise UserError(
            f"--dsa-indexer-head-dim {head_dim} must exceed --qk-pos-emb-head-dim "
            f"{args.qk_pos_emb_head_dim} (the rotary part of the indexer's heads)"
        )
    if (args.dsa_indexer_loss_coeff or 0.0) < 0:
        raise UserError("--dsa-indexer-loss-coeff must be >= 0")
    if args.context_parallel_size > 1:
        raise UserError("--experimental-attention-variant dsa with --context-parallel-size > 1 "
                        "is not supported (megatron-core's DSAttention has no context "
                        "parallelism)")  # fmt: skip


def dsa_config_fields(model) -> dict:
    """The TransformerConfig fields of the run's `ModelConfig` (empty without DSA)."""
    if model.experimental_attention_variant != DSA_VARIANT:
        return {}
    fields = {name: getattr(model, name) for name in DSA_FIELDS}
    fields["dsa_indexer_loss_coeff"] = fields["dsa_indexer_loss_coeff"] or 0.0
    return {"experimental_attention_variant": DSA_VARIANT, **fields}


def uses_sparse_attention(config) -> bool:
    return getattr(config, "experimental_attention_variant", None) == DSA_VARIANT


# ---------------------------------------------------------------------------- modules
def hadamard_rotation(x: torch.Tensor) -> torch.Tensor:
    """x times the orthonormal Hadamard matrix (Sylvester's order) over its last dimension,
    computed in fp32 and returned in x's dtype: `fast_hadamard_transform`'s
    `hadamard_transform(x, scale=n ** -0.5)`, which DeepSeek-V3.2 applies to the indexer's
    queries and keys."""
    n = x.shape[-1]
    y = x.float().reshape(-1, n)
    half = 1
    while half < n:
        pairs = y.view(-1, n // (2 * half), 2, half)
        y = torch.stack((pairs[:, :, 0] + pairs[:, :, 1], pairs[:, :, 0] - pairs[:, :, 1]), dim=2)
        half *= 2
    return (y.reshape(x.shape) * n**-0.5).to(x.dtype)


class DuplicatedLinear(torch.nn.Module):
    """A linear layer that every tensor-parallel rank holds whole (TELinear's
    `parallel_mode="duplicated"`): the indexer's inputs are whole on every rank, so each
    rank computes the same output and the same gradient."""

    def __init__(self, input_size: int, output_size: int, *, config, init_method, bias: bool,
                 skip_bias_add: bool, skip_weight_param_allocation: bool = False,
                 parallel_mode: str = "duplicated", **_):  # fmt: skip
        super().__init__()
        dtype = config.params_dtype
        self.weight = torch.nn.Parameter(torch.empty(output_size, input_size, dtype=dtype))
        init_method(self.weight)  # our layout-independent init draws it again
        self.bias = torch.nn.Parameter(torch.zeros(output_size, dtype=dtype)) if bias else None
        self.skip_bias_add = skip_bias_add

    def forward(self, x: torch.Tensor):
        if self.skip_bias_add:
            return torch.nn.functional.linear(x, self.weight), self.bias
        return torch.nn.functional.linear(x, self.weight, self.bias), None


class IndexerKeyNorm(torch.nn.LayerNorm):
    """The indexer's key LayerNorm, whole on every tensor-parallel rank (not a sequence-
    parallel norm: its input is the gathered sequence)."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-5):
        super().__init__(hidden_size, eps=eps, dtype=config.params_dtype)


def with_sparse_attention(layer):
    """A copy of a portable MLA layer spec whose core attention is megatron-core's
    DSAttention with its indexer."""
    import copy

    from megatron.core.transformer.experimental_attention_variant.dsa import (
        DSAIndexer,
        DSAIndexerSubmodules,
        DSAttention,
        DSAttentionSubmodules,
    )
    from megatron.core.transformer.spec_utils import ModuleSpec

    layer = copy.deepcopy(layer)
    indexer = ModuleSpec(
        module=DSAIndexer,
        submodules=DSAIndexerSubmodules(
            linear_wq_b=DuplicatedLinear, linear_wk=DuplicatedLinear, k_norm=IndexerKeyNorm,
            linear_weights_proj=DuplicatedLinear,
        ),
    )  # fmt: skip
    attention = layer.submodules.self_attention.submodules
    attention.core_attention = ModuleSpec(
        module=DSAttention, submodules=DSAttentionSubmodules(indexer=indexer)
    )
    return layer


def prepare_megatron_core() -> None:
    """megatron-core's rotation without its CUDA kernel (any dtype: fp32 runs too)."""
    from megatron.core.transformer.experimental_attention_variant import dsa

    dsa.rotate_activation = hadamard_rotation


def set_indexer_loss_scale(scale: float) -> None:
    """The indexer loss's gradient scale for the next backward pass: the main loss's (see
    moe.set_aux_loss_scale)."""
    from megatron.core.transformer.experimental_attention_variant.dsa import (
        DSAIndexerLossAutoScaler,
    )

    DSAIndexerLossAutoScaler.set_loss_scale(torch.tensor(scale, dtype=torch.float32))


class IndexerLossLog:
    """The indexer losses megatron-core records on this stage (per layer, summed over the
    training forwards), as `indexer loss`: the mean over the stage's DSA layers and the
    interval's training forwards, then over the stage's data-parallel ranks."""

    def __init__(self, model, num_layers: int, device: torch.device):
        from megatron.core.transformer.experimental_attention_variant.dsa import (
            DSAIndexerLossLoggingHelper,
        )

        tracker = DSAIndexerLossLoggingHelper.tracker
        tracker.clear()  # a process-wide dict: a run starts empty, where the model is
        tracker["values"] = torch.zeros(num_layers, device=device)
        chunks = list(getattr(model, "chunks", [model]))
        decoders = [getattr(chunk, "decoder", None) for chunk in chunks]
        self.layers = [layer.layer_number - 1 for decoder in decoders
                       for layer in getattr(decoder, "layers", [])]  # fmt: skip
        self.forwards = 0  # each layer sees every training forward of the first chunk
        self.history: list[float] = []  # every interval's loss (summary.json)
        chunks[0].register_forward_hook(self._count)

    def _count(self, module, inputs, output) -> None:
        if module.training and torch.is_grad_enabled():
            self.forwards += 1

    def collect(self, group=None) -> dict:
        import torch.distributed as dist
        from megatron.core.transformer.experimental_attention_variant.dsa import (
            DSAIndexerLossLoggingHelper,
        )

        values = DSAIndexerLossLoggingHelper.tracker["values"]
        if not self.layers or not self.forwards:
            return {}
        # reduced where the values are (NCCL reduces device tensors only)
        loss = values[self.layers].detach().double().mean() / self.forwards
        if group is not None and dist.get_world_size(group) > 1:
            dist.all_reduce(loss, group=group)
            loss /= dist.get_world_size(group)
        values.zero_()
        self.forwards = 0
        self.history.append(float(loss))
        return {"indexer loss": self.history[-1]}
