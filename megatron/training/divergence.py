"""Non-finite training: agreeing on it at drain points, refusing to save it, rolling back.

Each stage skips its own optimizer step when its gradient norm is not finite and counts it
(optimizer/build.py); the last stage counts non-finite losses (training.py). None of that talks to
other stages, so training keeps its only-point-to-point traffic. At a drain point (evaluation,
checkpoint, the end), where the pipeline is empty and ranks synchronize anyway, one all-reduce
tells every rank whether some stage has skipped `--max-consecutive-skips` steps in a row or
holds non-finite weights. Then every rank rolls back to the last good checkpoint together and
training continues with the next data; with no checkpoint to go back to, or at the end of the
run, the run has diverged and ends with a non-zero exit code.

Data-parallel replicas that disagree (`check_replicas_match`,
--check-weight-hash-across-dp-replicas-interval): every replica steps on the same averaged
gradient, so their weights must stay bit-identical; a difference means a silent fault (a bad
GPU, a lost update, a bug in a collective). As in Megatron, each rank hashes each of its
parameters (SHA-1 of its fp32 values, on the host) at the start of training and every N
iterations, and the hashes are all-gathered and compared. The gather stays inside the stage's
data-parallel group: a stage checks its own replicas, and PACI keeps no collective across
stages. The replicas of a stage run the same order of forwards, backwards and steps, so at the
end of an iteration they have taken the same steps, under every schedule (validation refuses
the reactive PACI orders with data parallelism).
"""

import hashlib
import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron.common.errors import RunFailed
from megatron.training.checkpointing import save_load as checkpointing


@dataclass
class Health:
    """What every rank agreed on at a drain point."""

    consecutive_skips: int  # the most steps any stage skipped in a row, up to now
    weights_finite: bool
    last_step_ok: bool  # no stage skipped its last step and the last loss was finite

    def must_roll_back(self, limit: int) -> bool:
        return self.consecutive_skips >= limit or not self.weights_finite

    def fit_to_save(self) -> bool:
        return self.weights_finite and self.last_step_ok


def _weights_finite(model: torch.nn.Module) -> bool:
    return all(bool(torch.isfinite(p).all()) for p in model.parameters())


def agree_on_health(model, step_func, last_loss: float | None) -> Health:
    """Collective over the world (call only with the pipeline drained)."""
    device = next(model.parameters()).device
    last_step_ok = step_func.consecutive_skips == 0 and (
        last_loss is None or math.isfinite(last_loss)
    )
    local = torch.tensor(
        [step_func.consecutive_skips, 0 if _weights_finite(model) else 1, 0 if last_step_ok else 1],
        dtype=torch.float64,
        device=device,
    )
    dist.all_reduce(local, op=dist.ReduceOp.MAX)
    skips, bad_weights, bad_step = (int(v) for v in local.tolist())
    return Health(
        consecutive_skips=skips, weights_finite=not bad_weights, last_step_ok=not bad_step
    )


def describe(health: Health, iteration: int) -> str:
    if not health.weights_finite:
        return f"the weights are not finite at iteration {iteration}"
    return (
        f"a stage skipped {health.consecutive_skips} optimizer steps in a row (non-finite "
        f"gradient norm) by iteration {iteration}"
    )


def last_good_checkpoint(checkpoint) -> str | None:
    """Where to roll back to: --save (only healthy models are saved there), else --load
    (`checkpoint`: the run's `CheckpointConfig`)."""
    for root in (checkpoint.save, checkpoint.load):
        if root and checkpointing.read_tracker(root, quiet=True) is not None:
            return root
    return None


def roll_back(checkpoint, state, model, step_func) -> int | None:
    """Every rank loads the last good checkpoint (collective); the iteration counter, the data
    position and the LR schedule's position stay where they are. Returns the checkpoint's
    iteration, or None when there is none."""
    root = last_good_checkpoint(checkpoint)
    if root is None:
        return None
    device = next(model.parameters()).device
    payload = checkpointing.read_checkpoint(
        root, device, fallback=checkpoint.load_fallback,
        verify_integrity=checkpoint.verify_integrity,
    )  # fmt: skip
    scheduler = step_func.scheduler
    steps_now = scheduler.num_steps
    scheduler.num_steps = 0  # load_state_dict adds the checkpoint's steps to it
    checkpointing.restore(
        payload, model=model, optimizer=step_func.optimizer, scheduler=scheduler, path=root
    )
    scheduler.num_steps = 0
    scheduler.step(increment=steps_now)  # the schedule goes on from where it was
    step_func.optimizer.zero_grad(set_to_none=True)
    step_func.forget_skips()  # on the wrapped step, not on a wrapper's attribute
    return payload["iteration"]


# ---------------------------------------------------------------------------- replicas
DIGEST_BYTES = 20  # SHA-1


def parameter_hashes(model: torch.nn.Module) -> tuple[list[str], torch.Tensor]:
    """(names, one SHA-1 digest per parameter as a [parameters, 20] uint8 tensor)."""
    return _hashes(list(model.named_parameters()))


def _hashes(named: list[tuple[str, torch.nn.Parameter]]) -> tuple[list[str], torch.Tensor]:
    names, digests = [], []
    for name, param in named:
        values = param.detach().float().cpu().contiguous().numpy()
        names.append(name)
        digests.append(
            torch.frombuffer(bytearray(hashlib.sha1(values).digest()), dtype=torch.uint8)
        )
    if not digests:
        return names, torch.zeros(0, DIGEST_BYTES, dtype=torch.uint8)
    return names, torch.stack(digests)


def check_replicas_match(
    model: torch.nn.Module, group, iteration: int, *, expert_group=None
) -> None:
    """All-gather every replica's hashes over `group` (the stage's data-parallel group) and
    stop the run with one line naming the first parameter that differs, and where.

    With expert parallelism (`expert_group` given) a stage's data-parallel ranks hold different
    routed experts: the dense parameters are compared over `group` and the routed experts over
    the expert data-parallel group, the ranks that hold the same experts (nowhere when it has
    one member)."""
    named = list(model.named_parameters())
    if expert_group is None:
        _compare_over(named, group, iteration, "data-parallel")
        return
    routed = [(n, p) for n, p in named if getattr(p, "moe_expert", False)]
    dense = [(n, p) for n, p in named if not getattr(p, "moe_expert", False)]
    _compare_over(dense, group, iteration, "data-parallel")
    if routed and dist.get_world_size(expert_group) > 1:
        _compare_over(routed, expert_group, iteration, "expert data-parallel")


def _compare_over(named, group, iteration: int, replicas_of: str) -> None:
    names, mine = _hashes(named)
    device = named[0][1].device if named else torch.device("cpu")
    replicas = [torch.empty_like(mine, device=device) for _ in range(dist.get_world_size(group))]
    dist.all_gather(replicas, mine.to(device), group=group)
    ranks = dist.get_process_group_ranks(group)
    reference = replicas[0].cpu()
    for replica, rank in zip(replicas[1:], ranks[1:]):
        differs = (replica.cpu() != reference).any(dim=1).nonzero()
        if len(differs):
            name = names[differs[0].item()]
            raise RunFailed(
                f"the weights of {replicas_of} replicas differ after iteration {iteration}: "
                f"{name} on rank {rank} is not rank {ranks[0]}'s ({len(differs)} of "
                f"{len(names)} parameters differ; --check-weight-hash-across-dp-replicas-"
                f"interval)"
            )
