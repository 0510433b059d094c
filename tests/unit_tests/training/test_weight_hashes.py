"""--check-weight-hash-across-dp-replicas-interval: equal replicas pass, one changed element
on one replica is named."""

import pytest
import torch
from conftest import TinyGPT

from megatron.training.arguments import build_parser, validate_args
from megatron.training.divergence import check_replicas_match, parameter_hashes
from megatron.training.errors import RunFailed, UserError


def test_hashes_are_per_parameter_and_see_one_ulp():
    model = TinyGPT()
    names, hashes = parameter_hashes(model)
    assert names == [n for n, _ in model.named_parameters()] and hashes.shape == (len(names), 20)
    with torch.no_grad():
        weight = model.decoder.layers[0].self_attention.linear_proj.weight
        weight[0, 0] = torch.nextafter(weight[0, 0], torch.tensor(1.0))
    changed = (parameter_hashes(model)[1] != hashes).any(dim=1)
    assert changed.tolist() == [n.endswith("linear_proj.weight") for n in names]


class TwoReplicas:
    """torch.distributed's calls as a data-parallel group of two would answer them, rank 1
    holding `other` (the real gather over processes runs in the functional cases)."""

    def __init__(self, other: torch.nn.Module):
        self.other = other

    def all_gather(self, outputs, tensor, group=None):
        outputs[0].copy_(tensor)
        outputs[1].copy_(parameter_hashes(self.other)[1])

    def get_world_size(self, group=None):
        return 2

    def get_process_group_ranks(self, group):
        return [4, 6]


def test_a_replica_with_another_weight_is_named(monkeypatch):
    from megatron.training import divergence

    model, other = TinyGPT(seed=0), TinyGPT(seed=0)
    monkeypatch.setattr(divergence, "dist", TwoReplicas(other))
    check_replicas_match(model, None, 4)  # equal: no error
    with torch.no_grad():
        other.output_layer.weight[3, 1] += 1e-6
    with pytest.raises(RunFailed) as failure:
        check_replicas_match(model, None, 8)
    assert str(failure.value) == (
        "the weights of data-parallel replicas differ after iteration 8: output_layer.weight on "
        "rank 6 is not rank 4's (1 of 8 parameters differ; "
        "--check-weight-hash-across-dp-replicas-interval)"
    )


BASE = (
    "--num-layers 4 --hidden-size 64 --num-attention-heads 4 --seq-length 32 "
    "--micro-batch-size 2 --global-batch-size 8 --train-iters 2 --lr 1e-3 --mock-data "
    "--tokenizer-type NullTokenizer --vocab-size 1000 --pipeline-model-parallel-size 2"
).split()


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--check-weight-hash-across-dp-replicas-interval", "0"], "must be >= 1, got 0"),
        (["--check-weight-hash-across-dp-replicas-interval", "4", "--pipeline-schedule", "paci",
          "--paci-arrival-rule", "backward-first"],
         "--check-weight-hash-across-dp-replicas-interval with --paci-arrival-rule "
         "backward-first and data parallelism is not supported yet"),
    ],
)  # fmt: skip
def test_bad_settings_are_one_line(extra, message):
    args = build_parser().parse_args(BASE + extra)
    with pytest.raises(UserError, match=message):
        validate_args(args, world_size=4)


def test_accepted_with_the_fixed_order():
    flags = ["--check-weight-hash-across-dp-replicas-interval", "4", "--pipeline-schedule", "paci"]
    args = build_parser().parse_args(BASE + flags)
    validate_args(args, world_size=4)
    assert args.check_weight_hash_across_dp_replicas_interval == 4
