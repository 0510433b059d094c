"""Fully sharded data parallelism (fsdp.py, fsdp_flags.py, optimizer/fsdp_optimizer.py):
what the flags resolve to, the one-line refusals, and on a one-process group the sharded model's
training step, its checkpoint format and the whole parameters a checkpoint sees, against the
same model unsharded."""

import pytest
import small_run_flags
import torch

TWO_STAGES = ["--pipeline-model-parallel-size", "2", "--untie-embeddings-and-output-weights"]


def validated(extra: list[str]):
    """Four processes: PP 2 x DP 2."""
    return small_run_flags.validated(TWO_STAGES + extra, world_size=4)


def error_of(extra: list[str]) -> str:
    return small_run_flags.error_of(TWO_STAGES + extra, world_size=4)


@pytest.mark.parametrize(
    "extra, fully_sharded, reshard, distributed_optimizer",
    [
        ([], None, True, False),
        (["--use-torch-fsdp2"], "torch_fsdp2", True, False),
        (["--use-torch-fsdp2", "--torch-fsdp2-no-reshard-after-forward"], "torch_fsdp2", False,
         False),
        (["--use-megatron-fsdp"], "megatron_fsdp", True, True),
        (["--use-megatron-fsdp", "--data-parallel-sharding-strategy", "optim_grads"],
         "megatron_fsdp", False, True),
        (["--use-megatron-fsdp", "--data-parallel-sharding-strategy", "optim"], None, True, True),
        (["--use-megatron-fsdp", "--data-parallel-sharding-strategy", "no_shard"], None, True,
         False),
        # Megatron's defaults written out, fp32 everywhere
        (["--use-megatron-fsdp", "--megatron-fsdp-main-params-dtype", "fp32",
          "--megatron-fsdp-main-grads-dtype", "fp32", "--megatron-fsdp-grad-comm-dtype", "fp32",
          "--outer-dp-sharding-strategy", "no_shard", "--ckpt-format", "fsdp_dtensor"],
         "megatron_fsdp", True, True),
    ],
)  # fmt: skip
def test_what_the_flags_resolve_to(extra, fully_sharded, reshard, distributed_optimizer):
    args = validated(extra)
    assert args.fully_sharded == fully_sharded
    assert args.reshard_after_forward == reshard
    assert args.use_distributed_optimizer == distributed_optimizer


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--use-torch-fsdp2", "--use-megatron-fsdp"],
         "--use-torch-fsdp2 and --use-megatron-fsdp exclude each other"),
        (["--use-torch-fsdp2", "--use-distributed-optimizer"],
         "--use-torch-fsdp2 is not supported with --use-distributed-optimizer (as in Megatron): "
         "FSDP shards the optimizer state itself"),
        (["--use-torch-fsdp2", "--pipeline-schedule", "zb-h1"],
         "--use-torch-fsdp2 with --pipeline-schedule zb-h1 is not supported yet"),
        (["--use-megatron-fsdp", "--optimizer", "muon"],
         "--use-megatron-fsdp with --optimizer muon is not supported yet"),
        (["--use-torch-fsdp2", "--num-layers-per-virtual-pipeline-stage", "1"],
         "--use-torch-fsdp2 with virtual pipeline stages is not supported yet"),
        (["--use-megatron-fsdp", "--check-weight-hash-across-dp-replicas-interval", "1"],
         "--use-megatron-fsdp with --check-weight-hash-across-dp-replicas-interval (no replicas: "
         "each rank holds its rows) is not supported yet"),
        (["--use-megatron-fsdp", "--megatron-fsdp-main-grads-dtype", "bf16"],
         "--megatron-fsdp-main-grads-dtype bf16 is not supported yet: fp32 main weights and "
         "gradients"),
        (["--use-megatron-fsdp", "--bf16", "--megatron-fsdp-main-params-dtype", "auto"],
         "--megatron-fsdp-main-params-dtype auto (the model's dtype) is not supported yet: fp32 "
         "main weights and gradients"),
        (["--use-megatron-fsdp", "--outer-dp-sharding-strategy", "optim"],
         "--outer-dp-sharding-strategy optim is not supported yet (hybrid sharding)"),
        (["--use-megatron-fsdp", "--pipeline-schedule", "paci", "--paci-arrival-rule",
          "backward-first"],
         "--use-megatron-fsdp with --paci-arrival-rule backward-first and data parallelism is "
         "not supported yet (each replica orders its passes by its own arrivals, and FSDP "
         "gathers over the replicas in every pass; add --deterministic-mode or keep the fixed "
         "order)"),
        (["--no-fsdp-prefetch"], "--no-fsdp-prefetch needs --use-torch-fsdp2 or "
         "--use-megatron-fsdp"),
        (["--ckpt-format", "fsdp_dtensor"],
         "--ckpt-format fsdp_dtensor needs a fully sharded model: --use-megatron-fsdp (with "
         "--data-parallel-sharding-strategy optim_grads_params or optim_grads) or "
         "--use-torch-fsdp2"),
    ],
)  # fmt: skip
def test_refusals_are_one_line(extra, message):
    assert error_of(extra) == message


def test_no_fsdp_prefetch_turns_the_prefetch_off():
    assert validated(["--use-torch-fsdp2"]).fsdp_prefetch
    assert not validated(["--use-torch-fsdp2", "--no-fsdp-prefetch"]).fsdp_prefetch
    assert not validated(["--use-megatron-fsdp", "--no-fsdp-prefetch"]).fsdp_prefetch


def test_tied_embeddings_over_stages_are_refused_but_one_stage_holds_them():
    tied = ["--use-torch-fsdp2", "--pipeline-model-parallel-size"]
    assert "embeddings tied over several pipeline stages" in small_run_flags.error_of(
        tied + ["2"], world_size=4
    )
    assert small_run_flags.validated(tied + ["1"], world_size=4).fully_sharded == "torch_fsdp2"


# ---------------------------------------------------------------------------- one process
class TwoLayers(torch.nn.Module):
    """Two megatron-core-like units: the FSDP units here are the layers (TransformerLayer in
    a GPT stage), the root holds the rest."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Linear(6, 5)
        self.layers = torch.nn.ModuleList([torch.nn.Linear(5, 5) for _ in range(2)])
        self.out = torch.nn.Linear(5, 3)

    def forward(self, x):
        x = torch.tanh(self.embed(x))
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return self.out(x)


def _sharded_copy(model):
    import copy

    from torch.distributed.fsdp import fully_shard

    from megatron.distributed import fsdp

    sharded = copy.deepcopy(model)
    sharded.layers[0].weight.tensor_model_parallel = True  # marks fully_shard must keep
    sharded.layers[0].weight.partition_dim = 0
    marks = fsdp._marks(sharded)
    mesh = fsdp._mesh(torch.distributed.group.WORLD, torch.device("cpu"))
    for layer in sharded.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(sharded, mesh=mesh)
    fsdp._restore_marks(sharded, marks)
    sharded.fsdp_compute_dtype = torch.float32
    return sharded


def _adam(view):
    return torch.optim.AdamW([p for _, p in view.named_parameters()], lr=0.1, weight_decay=0.1)


def test_row_ranges_follow_torch_chunk():
    from megatron.distributed.fsdp import row_range

    class Fake:
        def __init__(self, rows, shards, rank):
            self.shape = (rows, 4)
            self.device_mesh = type("Mesh", (), {"size": lambda s: shards,
                                                 "get_local_rank": lambda s: rank})()  # fmt: skip

    for rows in range(0, 9):
        for shards in (1, 2, 3, 4):
            chunks = torch.arange(rows).chunk(shards) if rows else ()
            for rank in range(shards):
                start, end = row_range(Fake(rows, shards, rank))
                expected = chunks[rank].tolist() if rank < len(chunks) else []
                assert list(range(start, end)) == expected, (rows, shards, rank)


def test_the_sharded_step_and_checkpoint_equal_the_unsharded_ones(one_rank_group):
    """Two AdamW steps of the rows equal two steps of the model; the optimizer's state dict
    has the unsharded optimizer's numbering and shapes; the marks survive sharding."""
    from megatron.training.optimizer.fsdp_optimizer import FullyShardedOptimizer

    model = TwoLayers()
    sharded = _sharded_copy(model)
    optimizer = FullyShardedOptimizer(sharded)
    optimizer.attach(_adam(optimizer.main_view(None)))
    reference = _adam(model)
    x = torch.randn(4, 6)
    for _ in range(2):
        for net, opt in ((model, reference), (sharded, optimizer)):
            opt.zero_grad()
            net(x).pow(2).mean().backward()
            opt.step()
    for (name, expected), got in zip(model.named_parameters(), sharded.parameters()):
        assert torch.allclose(got.full_tensor(), expected, atol=1e-6), name
    assert sharded.layers[0].weight.tensor_model_parallel
    mine, theirs = optimizer.state_dict(), reference.state_dict()
    assert mine["state"].keys() == theirs["state"].keys()
    for number, entries in theirs["state"].items():
        for key, value in entries.items():
            assert torch.allclose(mine["state"][number][key], value, atol=1e-6), (number, key)


def test_a_checkpoint_sees_whole_parameters_and_a_load_reaches_the_rows(one_rank_group):
    from megatron.distributed import fsdp
    from megatron.training.optimizer.fsdp_optimizer import FullyShardedOptimizer

    sharded = _sharded_copy(TwoLayers())
    optimizer = FullyShardedOptimizer(sharded)
    optimizer.attach(_adam(optimizer.main_view(None)))
    state = {k: torch.full_like(v, 0.5) for k, v in TwoLayers().state_dict().items()}
    with fsdp.unsharded_for_checkpoint(sharded, optimizer, load=True):
        assert not fsdp.is_fully_sharded(sharded)
        assert optimizer.state_index_params()[0] is optimizer.params[0]  # the whole ones
        sharded.load_state_dict(state)
    assert fsdp.is_fully_sharded(sharded)
    for param in sharded.parameters():
        assert torch.equal(param.to_local(), torch.full_like(param.to_local(), 0.5))
    x = torch.randn(2, 6)  # still a working FSDP model
    assert sharded(x).shape == (2, 3)


@pytest.mark.parametrize("prefetch", [True, False])
def test_shard_model_sets_the_prefetch_only_when_asked(one_rank_group, monkeypatch, prefetch):
    """--no-fsdp-prefetch reaches shard_model: no layer starts the next one's all-gather."""
    from megatron.distributed import fsdp

    monkeypatch.setattr(fsdp, "TransformerLayer", torch.nn.Linear)  # TwoLayers' units
    model = fsdp.shard_model(TwoLayers(), group=torch.distributed.group.WORLD, prefetch=prefetch)
    first, second = (layer._get_fsdp_state() for layer in model.layers)
    assert first._states_to_forward_prefetch == ([second] if prefetch else [])
    assert second._states_to_backward_prefetch == ([first] if prefetch else [])
