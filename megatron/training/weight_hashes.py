"""--check-weight-hash-across-dp-replicas-interval: the data-parallel replicas of a stage hold
the same weights.

Every replica steps on the same averaged gradient, so their weights must stay bit-identical;
a difference means a silent fault (a bad GPU, a lost update, a bug in a collective). As in
Megatron, each rank hashes each of its parameters (SHA-1 of its fp32 values, on the host) at the
start of training and every N iterations, and the hashes are all-gathered and compared. The
gather stays inside the stage's data-parallel group: a stage checks its own replicas, and PACI
keeps no collective across stages. The replicas of a stage run the same order of forwards,
backwards and steps, so at the end of an iteration they have taken the same steps, under every
schedule (validation refuses the reactive PACI orders with data parallelism).
"""

import hashlib

import torch
import torch.distributed as dist

from megatron.training.errors import RunFailed

DIGEST_BYTES = 20  # SHA-1


def parameter_hashes(model: torch.nn.Module) -> tuple[list[str], torch.Tensor]:
    """(names, one SHA-1 digest per parameter as a [parameters, 20] uint8 tensor)."""
    names, digests = [], []
    for name, param in model.named_parameters():
        values = param.detach().float().cpu().contiguous().numpy()
        names.append(name)
        digests.append(
            torch.frombuffer(bytearray(hashlib.sha1(values).digest()), dtype=torch.uint8)
        )
    if not digests:
        return names, torch.zeros(0, DIGEST_BYTES, dtype=torch.uint8)
    return names, torch.stack(digests)


def check_replicas_match(model: torch.nn.Module, group, iteration: int) -> None:
    """All-gather every replica's hashes over `group` (the stage's data-parallel group) and
    stop the run with one line naming the first parameter that differs, and where."""
    names, mine = parameter_hashes(model)
    first = next(model.parameters(), None)
    device = first.device if first is not None else torch.device("cpu")
    replicas = [torch.empty_like(mine, device=device) for _ in range(dist.get_world_size(group))]
    dist.all_gather(replicas, mine.to(device), group=group)
    ranks = dist.get_process_group_ranks(group)
    reference = replicas[0].cpu()
    for replica, rank in zip(replicas[1:], ranks[1:]):
        differs = (replica.cpu() != reference).any(dim=1).nonzero()
        if len(differs):
            name = names[differs[0].item()]
            raise RunFailed(
                f"the weights of data-parallel replicas differ after iteration {iteration}: "
                f"{name} on rank {rank} is not rank {ranks[0]}'s ({len(differs)} of "
                f"{len(names)} parameters differ; --check-weight-hash-across-dp-replicas-"
                f"interval)"
            )
