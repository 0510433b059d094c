"""--check-weight-hash-across-dp-replicas-interval: equal replicas pass, one changed element
on one replica is named."""

import pytest
import torch
from conftest import TinyGPT

from megatron.common.errors import RunFailed, UserError
from megatron.training import divergence
from megatron.training.arguments import build_parser, validate_args
from megatron.training.divergence import check_replicas_match, parameter_hashes


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


class ExpertAndDenseReplicas:
    """torch.distributed as a stage of four data-parallel ranks with expert parallelism 2
    would answer rank 4: its dense replicas (ranks 4-7) hold `dense_peer`'s dense weights, its
    expert replicas (ranks 4 and 6, the same experts) hold `expert_peer`'s routed experts."""

    DENSE, EXPERT = "dense group", "expert group"

    def __init__(self, dense_peer: torch.nn.Module, expert_peer: torch.nn.Module):
        self.peers = {self.DENSE: dense_peer, self.EXPERT: expert_peer}
        self.gathered = []

    def all_gather(self, outputs, tensor, group=None):
        self.gathered.append(group)
        named = list(self.peers[group].named_parameters())
        if len(tensor) < len(named):  # the dense or the routed part only
            routed = group == self.EXPERT
            named = [(n, p) for n, p in named if getattr(p, "moe_expert", False) == routed]
        outputs[0].copy_(tensor)
        for output in outputs[1:]:
            output.copy_(divergence._hashes(named)[1])

    def get_world_size(self, group=None):
        return 4 if group == self.DENSE else 2

    def get_process_group_ranks(self, group):
        return [4, 5, 6, 7] if group == self.DENSE else [4, 6]


def with_routed_expert(seed: int) -> TinyGPT:
    """TinyGPT whose linear_proj stands for a routed expert (megatron-core's MoE marks them)."""
    model = TinyGPT(seed=0)
    expert = model.decoder.layers[0].self_attention.linear_proj.weight
    expert.moe_expert = True
    with torch.no_grad():
        expert.copy_(torch.randn(expert.shape, generator=torch.Generator().manual_seed(seed)))
    return model


def test_experts_are_compared_within_their_expert_replicas(monkeypatch):
    """Under expert parallelism a stage's data-parallel ranks hold other experts: that is no
    divergence. The experts' own replicas must still agree, and a difference there is named."""
    mine, other_experts, same_experts = (
        with_routed_expert(1),
        with_routed_expert(2),
        with_routed_expert(1),
    )
    fake = ExpertAndDenseReplicas(dense_peer=other_experts, expert_peer=same_experts)
    monkeypatch.setattr(divergence, "dist", fake)
    check_replicas_match(mine, fake.DENSE, 2, expert_group=fake.EXPERT)  # no error
    assert fake.gathered == [fake.DENSE, fake.EXPERT]
    with pytest.raises(RunFailed, match="the weights of data-parallel replicas differ"):
        check_replicas_match(mine, fake.DENSE, 2)  # the old check: every weight over DP
    with torch.no_grad():
        same_experts.decoder.layers[0].self_attention.linear_proj.weight[0, 0] += 1e-6
    with pytest.raises(RunFailed) as failure:
        check_replicas_match(mine, fake.DENSE, 3, expert_group=fake.EXPERT)
    assert str(failure.value).startswith(
        "the weights of expert data-parallel replicas differ after iteration 3: "
        "decoder.layers.0.self_attention.linear_proj.weight on rank 6 is not rank 4's (1 of 1 "
    )


def test_experts_with_no_replica_are_not_gathered(monkeypatch):
    mine = with_routed_expert(1)
    fake = ExpertAndDenseReplicas(dense_peer=with_routed_expert(2), expert_peer=None)
    fake.get_world_size = lambda group=None: 4 if group == fake.DENSE else 1
    monkeypatch.setattr(divergence, "dist", fake)
    check_replicas_match(mine, fake.DENSE, 2, expert_group=fake.EXPERT)
    assert fake.gathered == [fake.DENSE]


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
