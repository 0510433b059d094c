"""--check-weight-hash-across-dp-replicas-interval: equal replicas pass, one changed element
on one replica is named (two gloo processes)."""

import socket

import pytest
import torch
import torch.distributed as dist
from conftest import TinyGPT

from megatron.training.arguments import build_parser, validate_args
from megatron.training.errors import RunFailed, UserError
from megatron.training.weight_hashes import check_replicas_match, parameter_hashes


def test_hashes_are_per_parameter_and_see_one_ulp():
    model = TinyGPT()
    names, hashes = parameter_hashes(model)
    assert names == [n for n, _ in model.named_parameters()] and hashes.shape == (len(names), 20)
    with torch.no_grad():
        weight = model.decoder.layers[0].self_attention.linear_proj.weight
        weight[0, 0] = torch.nextafter(weight[0, 0], torch.tensor(1.0))
    changed = (parameter_hashes(model)[1] != hashes).any(dim=1)
    assert changed.tolist() == [n.endswith("linear_proj.weight") for n in names]


def _worker(rank: int, port: int, outcomes) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2)  # fmt: skip
    try:
        model = TinyGPT(seed=0)
        check_replicas_match(model, dist.group.WORLD, 4)  # equal: no error
        if rank == 1:
            with torch.no_grad():
                model.output_layer.weight[3, 1] += 1e-6
        try:
            check_replicas_match(model, dist.group.WORLD, 8)
            outcomes[rank] = "passed"
        except RunFailed as failure:
            outcomes[rank] = str(failure)
    finally:
        dist.destroy_process_group()


def test_a_replica_with_another_weight_is_named_on_every_replica():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    outcomes = torch.multiprocessing.Manager().dict()
    torch.multiprocessing.start_processes(_worker, args=(port, outcomes), nprocs=2,
                                          start_method="spawn")  # fmt: skip
    expected = (
        "the weights of data-parallel replicas differ after iteration 8: output_layer.weight on "
        "rank 1 is not rank 0's (1 of 8 parameters differ; "
        "--check-weight-hash-across-dp-replicas-interval)"
    )
    assert dict(outcomes) == {0: expected, 1: expected}


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
