"""The pipeline, resolved once: which schedule (with its options), on how many ranks, with how
many model chunks per rank and where they sit.

`PipelinePlan` is built once from the flags (`megatron.training.arguments` validates them) and
handed to the runtime, the training loop and the reports, which ask it instead of looking the
schedule up again by name.
"""

import dataclasses
from dataclasses import dataclass

from .schedules import CHUNKS_FROM_FLAGS, flush_1f1b, get_schedule, virtual_schedule
from .schedules.base import Schedule
from .schedules.paci import with_paci_options, with_weight_stashing
from .schedules.placement import Placement
from .schedules.vocab_passes import splits_input, with_vocab_passes


@dataclass(frozen=True)
class PipelinePlan:
    """A schedule resolved for `num_stages` ranks and `chunks_per_rank` model chunks each."""

    name: str  # the --pipeline-schedule value
    schedule: Schedule  # with its options and, with virtual stages, its chunked variant
    num_stages: int
    chunks_per_rank: int = 1
    microbatch_group_size: int | None = None  # interleaved 1F1B's group (None: the ranks)

    @property
    def placement(self) -> Placement | None:
        """Where the model chunks sit (None: one chunk per rank, rank r is stage r)."""
        if self.schedule.placement is None:
            return None
        return self.schedule.placement(self.num_stages, self.chunks_per_rank)

    @property
    def flushes(self) -> bool:
        """The pipeline is empty at every step boundary (a synchronous schedule)."""
        return self.schedule.flushes_every_call

    @property
    def global_grad_norm(self) -> bool:
        return self.schedule.global_grad_norm

    @property
    def synchronous(self) -> "PipelinePlan":
        """1F1B-flush on the same ranks and chunks: the schedule of a run's synchronous phases
        (--async-sync-warmup-iters, --async-sync-cooldown-iters)."""
        if self.flushes:  # a synchronous schedule is its own synchronous phase
            return self
        return resolve_plan(
            flush_1f1b.SCHEDULE.name,
            num_stages=self.num_stages,
            chunks_per_rank=self.chunks_per_rank,
            microbatch_group_size=self.microbatch_group_size,
            vocab_passes=self.schedule.vocab_passes,
            split_input=self.schedule.embedding_passes,
        )

    def microbatches_per_update(self, microbatches: int) -> int:
        return self.schedule.microbatches_per_update(microbatches)


def resolve_plan(
    name: str,
    *,
    num_stages: int,
    chunks_per_rank: int | None = None,
    microbatch_group_size: int | None = None,
    arrival_rule: str | None = None,
    inflight_limit: str | None = None,
    weight_stashing: bool = False,
    vocab_passes: bool = False,
    split_input: bool | None = None,
) -> PipelinePlan:
    """The plan for --pipeline-schedule `name`. `chunks_per_rank` (None: the schedule's own,
    two for the V schedules, else one) above one selects the variant with virtual stages
    (1F1B: Megatron's interleaved 1F1B; PACI over virtual stages); `arrival_rule`,
    `inflight_limit` and `weight_stashing` are PACI's options; `vocab_passes` places the passes
    of an output layer split by vocabulary over the ranks (`schedules.vocab_passes`), and with
    `split_input` (None: wherever the schedule can take it, every schedule that does not stash
    weights) the input embedding's too. ValueError for a combination no schedule defines."""
    plan = _resolve(name, num_stages, chunks_per_rank, microbatch_group_size, arrival_rule,
                    inflight_limit, weight_stashing)  # fmt: skip
    if not vocab_passes:
        return plan
    if split_input is None:
        split_input = splits_input(plan.schedule)
    return dataclasses.replace(plan, schedule=with_vocab_passes(plan.schedule, split_input))


def _resolve(
    name, num_stages, chunks_per_rank, microbatch_group_size, arrival_rule, inflight_limit,
    weight_stashing,
) -> PipelinePlan:  # fmt: skip
    base = get_schedule(name)
    # an option of an asynchronous schedule that does not stash already (PACI)
    stashable = not (base.flushes_every_call or base.stashes_weights)
    if weight_stashing and (not stashable or (chunks_per_rank or 1) > 1):
        raise ValueError("PACI's weight stashing runs on plain PACI (one model chunk per rank)")
    chunks = chunks_per_rank or base.default_chunks_per_rank
    if base.placement is not None:  # its own placement (ZB-V, DualPipeV, zb-interleaved)
        if name in CHUNKS_FROM_FLAGS and chunks < 2:
            raise ValueError(f"{name} runs at least 2 model chunks per rank, not {chunks}")
        if name not in CHUNKS_FROM_FLAGS and chunks != base.default_chunks_per_rank:
            raise ValueError(
                f"{name} runs {base.default_chunks_per_rank} model chunks per rank, not {chunks}"
            )
        return PipelinePlan(name, base, num_stages, chunks)
    if chunks > 1:
        schedule = virtual_schedule(name, microbatch_group_size, arrival_rule, inflight_limit)
        return PipelinePlan(name, schedule, num_stages, chunks, microbatch_group_size)
    schedule = with_paci_options(base, arrival_rule, inflight_limit)
    if weight_stashing:
        schedule = with_weight_stashing(schedule)
    return PipelinePlan(name, schedule, num_stages)
